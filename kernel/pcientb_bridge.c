// SPDX-License-Identifier: GPL-2.0
/*
 * pcientb.ko: the bridge, how the nodes of this host and those of the host across the NT
 * port reach each other (docs/kernel.md).
 *
 * - Each port has an inbox: memory of this host that only the peer host's module writes,
 *   through its window. Per LID of the peer's half: what the peer module published of its
 *   node (nonce, life, where the chunks of its area are in the window). Per LID of ours:
 *   a count of the rings the peer's nodes sent it, and which incarnation of it the peer
 *   module knows (its ack). The inbox's address goes to the peer in scratchpads; its first
 *   words, written by this host before that, say where this host's region table and
 *   doorbell masks are, and the peer reads them once each time it connects (so a module
 *   loaded anew is never written at its predecessor's addresses).
 * - The bridge's window (the port's last: the first is the self-tests') translates flat:
 *   all of this host's memory below the window's size, so that the peer reaches every
 *   node's area and the inbox. A window whose aperture is smaller than memory (a PEX8749's
 *   BAR) would need its A-LUT to map areas one by one: not done, the bridge stays off.
 * - A node that comes or goes is written into the peer's inbox, then a doorbell bit tells
 *   the peer module to look: its work item compares the inbox with what it knew, adds and
 *   removes the remote nodes (pcientb_node.c), wakes the nodes that were rung, and frees
 *   the areas the peer no longer reaches.
 * - A process posts to a remote node with stores into a write-combined mapping of its area
 *   through the window (pcientb_node.c, PCIENTB_MMAP_REMOTE), or by PCIENTB_METHOD_POST;
 *   rings are system calls (RING), which a process leaves out while the node's doorbell
 *   mask says it polls (the node's module writes the mask into the peer host's memory:
 *   PCIENTB_METHOD_MASK). Those write through the window with the bridge's
 *   semaphore held for reading. The work item holds it for writing while it removes a
 *   remote node, and empties the node's mappings then, so no write reaches that node after
 *   its removal.
 * - A node's area is freed only once the peer module cannot write it. The peer acks a
 *   node (the ack word = its nonce) before it lets any write go to it, and acks 0 after
 *   removing it; a dying node is written dead into the peer's inbox, and its area is kept
 *   while the ack names it. Each side writes, flushes (a read through the window) and then
 *   reads the other's word, so one of the two always sees the other: either the peer sees
 *   the node dead and never acks it, or this side sees the ack and keeps the area.
 */
#include <linux/debugfs.h>
#include <linux/io.h>
#include <linux/dma-mapping.h>
#include <linux/ntb.h>
#include <linux/random.h>
#include <linux/rwsem.h>
#include <linux/seq_file.h>
#include <linux/slab.h>
#include <linux/uaccess.h>
#include <linux/workqueue.h>
#include <asm/unaligned.h>

#define UVERBS_MODULE_NAME pcientb
#include <rdma/uverbs_named_ioctl.h>

#include "pcientb.h"
#include "pcientb_ib.h"
#include "pcientb-abi.h"

enum {
	SPAD_INBOX_LO = 3,
	SPAD_INBOX_HI = 4,
	SPAD_BRIDGE = 5, /* BRIDGE_MAGIC while the inbox address stands */
	SPAD_INCARNATION = 6, /* this load's bridge: another after a reload of the module */
};
#define BRIDGE_MAGIC 0x42524734 /* "BRG4": the inbox as below */
#define LIDS PCIENTB_LIDS_PER_PORT
#define POST_PIECE 256
#define MOVERS 32 /* moves of this host's nodes into the peer's regions at once */
#define MOVING BIT_ULL(63) /* a mover's word: MOVING | the key of the region it moves */
#define MOVE_LOOK_PAGES 256 /* a mover looks again whether its region stands, every 1 MiB */

struct inbox_node {
	__le64 nonce;
	__le32 life; /* non-zero while the node lives: written last */
	__le32 chunks;
	__le64 chunk[PCIENTB_AREA_CHUNKS_MAX]; /* offsets in the peer's window onto its host */
	__le32 layout; /* its engine's */
	__le32 chunk_shift; /* log2 of its chunks' size: both hosts' must be the same */
};

struct inbox {
	/* Written by this host before it publishes the inbox, read by the peer at connect. */
	__le64 regions; /* where our region table is in the peer's window onto us */
	__le64 masks; /* where our nodes' doorbell masks are (the peer's nodes read them) */
	/* Written by the peer only. */
	__le64 rings[LIDS]; /* by our LID: rings counted by the peer */
	__le64 acks[LIDS]; /* by our LID: the nonce of ours the peer knows, or 0 */
	__le64 adds[LIDS]; /* by our LID: how many times the peer added our node there */
	struct inbox_node nodes[LIDS]; /* by the peer's LID: its nodes */
	__le64 movers[MOVERS]; /* the peer's moves into our regions: MOVING | key, or 0 */
};

/*
 * A region of ours as the peer's movers read it (through their window): its pages'
 * addresses are a list in our memory, from the first page of the region on.
 */
struct region {
	__le32 key; /* 0: none (written first when it goes, last when it comes) */
	__le32 lid;
	__le32 access;
	__le32 reserved;
	__le64 iova;
	__le64 length;
	__le64 first; /* the region's offset in its first page */
	__le64 pages; /* the list's address */
};

/* The area of a node of ours that is gone, while the peer module may still write it. */
struct kept_area {
	struct list_head node;
	u32 idx;
	u64 nonce;
	struct pcientb_area *area;
};

struct pcientb_bridge {
	struct pcientb_ib *dev;
	struct ntb_dev *ntb;
	int widx;
	struct inbox *in; /* written by the peer */
	dma_addr_t in_dma;
	struct rw_semaphore sem; /* write: connect, disconnect, publish, scan; read: post, ring */
	bool connected; /* the peer's inbox is mapped */
	bool ever; /* was connected once: a peer may know our nodes */
	/*
	 * Ours, and the peer's when we connected: a peer module unloaded and loaded again
	 * between two looks of the work item (its link down and up before we looked) has a
	 * new inbox, and the old one is freed memory of its host.
	 */
	u32 incarnation, peer_incarnation;
	atomic_t hold; /* debugfs bridge_hold: the work item does not look (tests) */
	u64 trans_size; /* our inbound translation: [0, trans_size) */
	void __iomem *out; /* the peer's window onto its host */
	phys_addr_t out_phys; /* its bus address (where remote areas are mapped from) */
	resource_size_t out_size;
	struct inbox __iomem *peer_in;
	u64 peer_regions, peer_masks; /* in `out`, as the peer's inbox said at connect; 0: none */
	u64 adds_out[LIDS]; /* by the peer's LID: how many times we added its node there */
	u64 adds_seen[LIDS]; /* by ours: the peer's count as the work item last saw it */
	/*
	 * Set when every mask of ours is to be written again: after a link event (a blip that
	 * neither side saw as down may have dropped posted writes), or a MASK(0) whose flush
	 * read back another value. Debugfs drop_masks: MASK writes to drop, as such a blip does
	 * (tests).
	 */
	atomic_t remask;
	atomic_t drop_masks;
	u32 own_base, peer_base; /* the LIDs of index 0 */
	atomic64_t ring_out[LIDS]; /* by the peer's LID */
	u64 ring_seen[LIDS]; /* by ours */
	struct region *regions; /* by key index: ours, read by the peer */
	struct semaphore movers_free;
	spinlock_t movers_lock;
	unsigned long movers_used[BITS_TO_LONGS(MOVERS)];
	struct list_head kept;
	struct work_struct work;
	/* System calls that wrote through the window (debugfs pcientb/<port>/bridge). */
	atomic64_t posts, rings, moves;
};

static void to_window(void __iomem *dst, const u8 *src, size_t n)
{
	/* Aligned words go whole: they are what a reader checks (the contract's rule). */
	while (n && !IS_ALIGNED((unsigned long)dst, 8)) {
		if (IS_ALIGNED((unsigned long)dst, 4) && n >= 4) {
			iowrite32(get_unaligned((const u32 *)src), dst);
			dst += 4, src += 4, n -= 4;
		} else {
			iowrite8(*src, dst);
			dst++, src++, n--;
		}
	}
	for (; n >= 8; dst += 8, src += 8, n -= 8)
		writeq(get_unaligned((const u64 *)src), dst);
	if (n >= 4) {
		iowrite32(get_unaligned((const u32 *)src), dst);
		dst += 4, src += 4, n -= 4;
	}
	for (; n; dst++, src++, n--)
		iowrite8(*src, dst);
}

static void ring_peer(struct pcientb_bridge *b)
{
	ntb_peer_db_set(b->ntb, BIT_ULL(PCIENTB_DB_BRIDGE));
}

/* What the peer module knows of its node at `idx`: written, then flushed (a read back). */
static void set_ack(struct pcientb_bridge *b, u32 idx, u64 nonce)
{
	writeq(nonce, &b->peer_in->acks[idx]);
	wmb();
	readq(&b->peer_in->acks[idx]);
}

/* Our node at `idx` as the peer is to see it (area NULL: gone, or none). */
static void write_entry(struct pcientb_bridge *b, u32 idx, u64 nonce, u32 layout,
			struct pcientb_area *area)
{
	struct inbox_node __iomem *e = &b->peer_in->nodes[idx];
	unsigned int i;

	iowrite32(0, &e->life);
	wmb();
	writeq(nonce, &e->nonce);
	iowrite32(layout, &e->layout);
	iowrite32(PAGE_SHIFT + PCIENTB_CHUNK_ORDER, &e->chunk_shift);
	if (area) {
		for (i = 0; i < area->chunks; i++)
			if (page_to_phys(area->chunk[i]) + PCIENTB_CHUNK_BYTES > b->trans_size)
				break;
		if (i < area->chunks || area->chunks > PCIENTB_AREA_CHUNKS_MAX) {
			dev_warn_ratelimited(&b->ntb->dev,
					     "node %u: its area is beyond the window\n",
					     b->own_base + idx);
			area = NULL;
		}
	}
	if (area) {
		iowrite32(area->chunks, &e->chunks);
		for (i = 0; i < area->chunks; i++)
			writeq(page_to_phys(area->chunk[i]), &e->chunk[i]);
		wmb();
		iowrite32((u32)nonce | 1, &e->life);
	}
	wmb();
	ioread32(&e->life); /* flushed: the peer's next look sees it */
}

/*
 * Whether the peer's inbox holds our live node `nonce` at `idx` already, complete: the
 * link went down and up on this side only, and the peer kept the node (rewritten, its
 * entry would go dead for a moment, and the peer tear the node down).
 */
static bool entry_stands(struct pcientb_bridge *b, u32 idx, u64 nonce)
{
	struct inbox_node __iomem *e = &b->peer_in->nodes[idx];

	return ioread32(&e->life) == ((u32)nonce | 1) && readq(&e->nonce) == nonce;
}

static struct pcientb_node *local_node(struct pcientb_bridge *b, u32 idx)
{
	struct pcientb_node *node = pcientb_node_get(b->dev, b->own_base + idx);

	if (node && !node->area) {
		pcientb_node_put(node);
		node = NULL;
	}
	return node;
}

static struct pcientb_node *remote_node(struct pcientb_bridge *b, u32 idx)
{
	struct pcientb_node *node = pcientb_node_get(b->dev, b->peer_base + idx);

	if (node && node->area) {
		pcientb_node_put(node);
		node = NULL;
	}
	return node;
}

static void disconnect(struct pcientb_bridge *b)
{
	struct pcientb_node *node;
	u32 idx;

	if (!b->connected)
		return;
	b->connected = false;
	for (idx = 0; idx < LIDS; idx++) {
		node = remote_node(b, idx);
		if (node) {
			pcientb_remote_remove(b->dev, node);
			pcientb_node_put(node);
		}
	}
	iounmap(b->out);
	b->out = NULL;
	b->peer_in = NULL;
	b->peer_regions = 0;
	b->peer_masks = 0;
}

/* An address the peer's inbox gave, if `len` bytes there are in our window onto it; or 0. */
static u64 peer_table(struct pcientb_bridge *b, u64 at, u64 len)
{
	if (!at || !IS_ALIGNED(at, sizeof(u64)) || at > b->out_size || b->out_size - at < len)
		return 0;
	return at;
}

static void connect(struct pcientb_bridge *b)
{
	resource_size_t addr_align, size_align, size_max, size;
	struct pcientb_node *node;
	struct kept_area *k;
	phys_addr_t base;
	int port, peer;
	u64 off;
	u32 idx;

	if (b->connected)
		return;
	port = ntb_port_number(b->ntb);
	peer = ntb_peer_port_number(b->ntb, 0);
	if (peer < 0)
		return;
	b->own_base = (port & 1) * LIDS;
	b->peer_base = (peer & 1) * LIDS;
	if (ntb_mw_get_align(b->ntb, 0, b->widx, &addr_align, &size_align, &size_max))
		return;
	b->trans_size = round_down(size_max, max(size_align, (resource_size_t)PAGE_SIZE));
	if (b->in_dma + sizeof(*b->in) > b->trans_size ||
	    virt_to_phys(b->regions) + PCIENTB_MAX_MR * sizeof(*b->regions) > b->trans_size ||
	    page_to_phys(b->dev->masks_page) + PAGE_SIZE > b->trans_size ||
	    ntb_mw_set_trans(b->ntb, 0, b->widx, 0, b->trans_size)) {
		dev_warn_once(&b->ntb->dev,
			      "the bridge's window cannot cover this host's memory\n");
		return;
	}
	/* What the peer reads when it connects: written before the inbox is published. */
	b->in->regions = cpu_to_le64(virt_to_phys(b->regions));
	b->in->masks = cpu_to_le64(page_to_phys(b->dev->masks_page));
	wmb();
	ntb_spad_write(b->ntb, SPAD_INBOX_LO, lower_32_bits(b->in_dma));
	ntb_spad_write(b->ntb, SPAD_INBOX_HI, upper_32_bits(b->in_dma));
	ntb_spad_write(b->ntb, SPAD_INCARNATION, b->incarnation);
	ntb_spad_write(b->ntb, SPAD_BRIDGE, BRIDGE_MAGIC);
	ring_peer(b); /* a peer that looked before now finds the inbox */
	b->peer_incarnation = ntb_peer_spad_read(b->ntb, 0, SPAD_INCARNATION);
	if (ntb_peer_spad_read(b->ntb, 0, SPAD_BRIDGE) != BRIDGE_MAGIC)
		return;
	off = (u64)ntb_peer_spad_read(b->ntb, 0, SPAD_INBOX_HI) << 32 |
	      ntb_peer_spad_read(b->ntb, 0, SPAD_INBOX_LO);
	/* Read across a reload of the peer's module: its next doorbell brings us back. */
	if (ntb_peer_spad_read(b->ntb, 0, SPAD_INCARNATION) != b->peer_incarnation)
		return;
	if (ntb_peer_mw_get_addr(b->ntb, b->widx, &base, &size))
		return;
	if (!PAGE_ALIGNED(base)) { /* its pages are mapped into processes */
		dev_warn_ratelimited(&b->ntb->dev, "the window is not page-aligned\n");
		return;
	}
	if (off > size || size - off < sizeof(struct inbox)) {
		dev_warn_ratelimited(&b->ntb->dev, "the peer's inbox is beyond its window\n");
		return;
	}
	b->out = ioremap_wc(base, size);
	if (!b->out)
		return;
	b->out_phys = base;
	b->out_size = size;
	b->peer_in = b->out + off;
	b->connected = true;
	b->ever = true;
	b->peer_regions =
		peer_table(b, readq(&b->peer_in->regions), PCIENTB_MAX_MR * sizeof(struct region));
	b->peer_masks = peer_table(b, readq(&b->peer_in->masks), PCIENTB_LIDS * sizeof(u32));
	/*
	 * The work item writes the mask of every node the peer knows again (its count of adds
	 * is not 0): one that ended while the link was down never reached the peer.
	 */
	memset(b->adds_seen, 0, sizeof(b->adds_seen));
	/* None of ours moves (a move in flight held the link up). */
	for (idx = 0; idx < MOVERS; idx++)
		writeq(0, &b->peer_in->movers[idx]);
	/* The peer's view of our nodes, anew: nothing known of its nodes, ours as they are. */
	for (idx = 0; idx < LIDS; idx++) {
		writeq(0, &b->peer_in->acks[idx]);
		node = local_node(b, idx);
		if (!node || !entry_stands(b, idx, node->nonce))
			write_entry(b, idx, node ? node->nonce : 0, node ? node->layout : 0,
				    node ? node->area : NULL);
		if (node)
			pcientb_node_put(node);
	}
	/* Nodes that went while the link was down: the peer may still know them. */
	list_for_each_entry(k, &b->kept, node) {
		node = local_node(b, k->idx);
		if (node)
			pcientb_node_put(node); /* its successor's entry is written */
		else
			write_entry(b, k->idx, k->nonce, 0, NULL);
	}
	/* The peer's work item may have looked before these entries were there. */
	ring_peer(b);
	dev_info(&b->ntb->dev, "bridge to the peer's nodes up\n");
}

/* The peer's node at `idx` as its inbox entry says: added, replaced or removed. */
static bool scan_node(struct pcientb_bridge *b, u32 idx)
{
	struct inbox_node *e = &b->in->nodes[idx];
	u64 off[PCIENTB_AREA_CHUNKS_MAX];
	struct pcientb_node *cur = remote_node(b, idx);
	u32 life = le32_to_cpu(READ_ONCE(e->life)), chunks, i;
	bool acked = false;
	u64 nonce;

	rmb();
	nonce = le64_to_cpu(READ_ONCE(e->nonce));
	if (cur && life && cur->nonce == nonce) {
		pcientb_node_put(cur);
		return false;
	}
	if (cur) {
		pcientb_remote_remove(b->dev, cur);
		pcientb_node_put(cur);
		/* What processes stored into its mappings before they were emptied lands first. */
		readq(&b->peer_in->acks[idx]);
		set_ack(b, idx, 0);
		acked = true;
	}
	if (!life)
		return acked;
	chunks = le32_to_cpu(READ_ONCE(e->chunks));
	if (!chunks || chunks > PCIENTB_AREA_CHUNKS_MAX ||
	    le32_to_cpu(READ_ONCE(e->chunk_shift)) != PAGE_SHIFT + PCIENTB_CHUNK_ORDER)
		return acked;
	for (i = 0; i < chunks; i++) {
		off[i] = le64_to_cpu(READ_ONCE(e->chunk[i]));
		/* Mapped page by page into processes: whole pages of the window only. */
		if (off[i] > b->out_size || b->out_size - off[i] < PCIENTB_CHUNK_BYTES ||
		    !PAGE_ALIGNED(off[i]))
			return acked;
	}
	/*
	 * No earlier node's mask: its word is zeroed before the add, and the node's module
	 * writes it again when it sees the count of adds change (mask_again), so a mask the
	 * node set before we knew it stands.
	 */
	WRITE_ONCE(b->dev->masks[b->peer_base + idx], 0);
	wmb();
	/* Acked before anything is written to it, and looked at again after the flush. */
	set_ack(b, idx, nonce);
	rmb();
	if (le32_to_cpu(READ_ONCE(e->life)) != life || le64_to_cpu(READ_ONCE(e->nonce)) != nonce ||
	    pcientb_remote_add(b->dev, b->peer_base + idx, nonce, le32_to_cpu(READ_ONCE(e->layout)),
			       chunks, off, b->out_phys)) {
		set_ack(b, idx, 0);
		return true;
	}
	writeq(++b->adds_out[idx], &b->peer_in->adds[idx]);
	wmb();
	readq(&b->peer_in->adds[idx]); /* flushed before the doorbell that says to look */
	return true;
}

/*
 * Our node `lid`'s doorbell mask, as the peer's nodes read it (in the peer's memory). Its
 * end is flushed (a read through the window) before this returns: a node of the peer that
 * posted, then read the mask still set, posted before the flush, and its posts land in our
 * memory before the read's answer (PCIe ordering: a completion never passes a posted
 * write), so the caller's next look at its lanes finds them. With the bridge's semaphore.
 */
static bool put_mask(struct pcientb_bridge *b, u32 lid, u32 quiet)
{
	void __iomem *word;

	if (!b->connected || !b->peer_masks)
		return true;
	word = b->out + b->peer_masks + lid * sizeof(*b->dev->masks);
	if (!atomic_add_unless(&b->drop_masks, -1, 0))
		iowrite32(quiet, word);
	if (!quiet) {
		mb(); /* out of the write-combining buffer before the read is issued */
		/*
		 * Not 0: lost (all ones: the read failed), or another MASK of the node since. The
		 * caller has the work item write the node's word again as it stands.
		 */
		if (ioread32(word)) {
			atomic_set(&b->remask, 1);
			return false;
		}
	}
	return true;
}

/*
 * Our node at `idx`'s mask, written again into the peer's page when the peer added the
 * node (it zeroed the word first: a mask set before that is lost there), or when this
 * side connected anew (connect forgets the counts seen: a mask that ended while the link
 * was down never reached the peer, whose ringers would leave the node unrung). After an
 * end written so, the node looks at its lanes: a peer's post that saw the stale mask rang
 * nobody. With the bridge's semaphore for writing: no MASK writes meanwhile (a MASK that
 * changed the word since writes it after this).
 */
static void mask_again(struct pcientb_bridge *b, u32 idx)
{
	u64 adds = le64_to_cpu(READ_ONCE(b->in->adds[idx]));
	struct pcientb_node *node;
	u32 quiet;

	if (adds == b->adds_seen[idx])
		return;
	b->adds_seen[idx] = adds;
	node = local_node(b, idx);
	if (!node)
		return;
	rmb(); /* the ack was written before the count */
	if (le64_to_cpu(READ_ONCE(b->in->acks[idx])) == node->nonce) {
		quiet = READ_ONCE(b->dev->masks[node->lid]);
		put_mask(b, node->lid, quiet); /* if lost: again at the work item's next run */
		if (!quiet)
			pcientb_node_signal(node);
	}
	pcientb_node_put(node);
}

static void bridge_work(struct work_struct *work)
{
	struct pcientb_bridge *b = container_of(work, struct pcientb_bridge, work);
	struct kept_area *k, *next;
	struct pcientb_node *node;
	bool told = false;
	u64 v;
	u32 idx;

	down_write(&b->sem);
	if (atomic_read(&b->hold))
		goto out;
	if (!ntb_link_is_up(b->ntb, NULL, NULL)) {
		disconnect(b);
		goto out;
	}
	/* The peer's bridge is gone, or another one stands there now: connect anew. */
	if (b->connected &&
	    (ntb_peer_spad_read(b->ntb, 0, SPAD_BRIDGE) != BRIDGE_MAGIC ||
	     ntb_peer_spad_read(b->ntb, 0, SPAD_INCARNATION) != b->peer_incarnation))
		disconnect(b);
	connect(b);
	if (!b->connected)
		goto out;
	if (atomic_xchg(&b->remask, 0))
		memset(b->adds_seen, 0, sizeof(b->adds_seen)); /* mask_again writes each one */
	for (idx = 0; idx < LIDS; idx++)
		told |= scan_node(b, idx);
	for (idx = 0; idx < LIDS; idx++) {
		v = le64_to_cpu(READ_ONCE(b->in->rings[idx]));
		if (v == b->ring_seen[idx])
			continue;
		b->ring_seen[idx] = v;
		node = local_node(b, idx);
		if (node) {
			pcientb_node_signal(node);
			pcientb_node_put(node);
		}
	}
	for (idx = 0; idx < LIDS; idx++)
		mask_again(b, idx);
	if (told)
		ring_peer(b); /* its kept areas may go now */
out:
	/* Areas of ours that the peer no longer knows. */
	list_for_each_entry_safe(k, next, &b->kept, node) {
		if (le64_to_cpu(READ_ONCE(b->in->acks[k->idx])) == k->nonce)
			continue;
		list_del(&k->node);
		pcientb_area_put(k->area);
		kfree(k);
	}
	up_write(&b->sem);
}

/* A link event or the peer's doorbell: look at the inbox. Any context. */
void pcientb_bridge_kick(struct pcientb_ib *dev, bool link)
{
	if (!dev->bridge)
		return;
	if (link)
		atomic_set(&dev->bridge->remask, 1);
	queue_work(system_highpri_wq, &dev->bridge->work);
}

/*
 * Our node `lid` came (area: its area) or went (area: the area it had): the peer learns
 * it. A gone node's area is kept while the peer may still write it.
 */
void pcientb_bridge_publish(struct pcientb_ib *dev, struct pcientb_node *node, bool alive)
{
	struct pcientb_bridge *b = dev->bridge;
	u32 idx = node->lid - (b ? b->own_base : 0);
	struct pcientb_area *area = node->area;
	u64 nonce = node->nonce;
	struct kept_area *k;

	if (!b)
		return;
	down_write(&b->sem);
	if (b->connected) {
		write_entry(b, idx, nonce, node->layout, alive ? area : NULL);
		ring_peer(b);
	}
	/* Dead, written and flushed: now the ack tells whether the peer knew it. */
	if (!alive &&
	    ((b->ever && !b->connected) || le64_to_cpu(READ_ONCE(b->in->acks[idx])) == nonce)) {
		k = kmalloc(sizeof(*k), GFP_KERNEL | __GFP_NOFAIL);
		k->idx = idx;
		k->nonce = nonce;
		k->area = area;
		kref_get(&area->ref);
		list_add(&k->node, &b->kept);
	}
	up_write(&b->sem);
}

int pcientb_bridge_ring(struct pcientb_ib *dev, struct pcientb_node *node)
{
	struct pcientb_bridge *b = dev->bridge;
	u32 idx;
	int rc = -ENOENT;

	if (!b)
		return rc;
	idx = node->lid - b->peer_base;
	atomic64_inc(&b->rings);
	down_read(&b->sem);
	if (b->connected && !READ_ONCE(node->dead)) {
		writeq(atomic64_inc_return(&b->ring_out[idx]), &b->peer_in->rings[idx]);
		wmb();
		ring_peer(b);
		rc = 0;
	}
	up_read(&b->sem);
	return rc;
}

/*
 * Our node `lid`'s mask (see put_mask). The word of a node that the peer never added (it
 * went before the peer's work item looked) may stay set there: no ringer reads a dead
 * LID's word, and the peer zeroes it when it adds the LID's next node.
 */
void pcientb_bridge_mask(struct pcientb_ib *dev, u32 lid, u32 quiet)
{
	struct pcientb_bridge *b = dev->bridge;

	if (!b)
		return;
	down_read(&b->sem);
	if (!put_mask(b, lid, quiet))
		queue_work(system_highpri_wq, &b->work);
	up_read(&b->sem);
}

/* Writes `len` bytes from user memory at `addr` to [off, off + len) of a remote node's area. */
static int post(struct pcientb_bridge *b, struct pcientb_node *node, u64 off, u64 addr, u64 len)
{
	u64 size = (u64)node->chunks * PCIENTB_CHUNK_BYTES, at;
	u8 buf[POST_PIECE];
	size_t n;
	int rc = 0;

	if (off > size || len > size - off)
		return -EFAULT;
	atomic64_inc(&b->posts);
	down_read(&b->sem);
	if (!b->connected || READ_ONCE(node->dead))
		rc = -ENOENT;
	while (!rc && len) {
		at = off % PCIENTB_CHUNK_BYTES;
		n = min3(len, (u64)POST_PIECE, PCIENTB_CHUNK_BYTES - at);
		if (copy_from_user(buf, u64_to_user_ptr(addr), n)) {
			rc = -EFAULT;
			break;
		}
		to_window(b->out + node->chunk_off[off / PCIENTB_CHUNK_BYTES] + at, buf, n);
		off += n, addr += n, len -= n;
	}
	wmb(); /* this post lands before the next */
	up_read(&b->sem);
	return rc;
}

/*
 * Our region `key` (index `index`) as the peer's movers see it. `pages`: the physical
 * address of each page, from the region's first (kept by the caller until unexported).
 */
void pcientb_bridge_export(struct pcientb_ib *dev, u32 index, u32 key, u32 lid, int access,
			   u64 iova, u64 length, u64 first, const u64 *pages)
{
	struct pcientb_bridge *b = dev->bridge;
	struct region *r;

	if (!b)
		return;
	r = &b->regions[index];
	r->lid = cpu_to_le32(lid);
	r->access = cpu_to_le32(access);
	r->iova = cpu_to_le64(iova);
	r->length = cpu_to_le64(length);
	r->first = cpu_to_le64(first);
	r->pages = cpu_to_le64(virt_to_phys((void *)pages));
	smp_wmb();
	WRITE_ONCE(r->key, cpu_to_le32(key));
}

static bool peer_moves(struct pcientb_bridge *b, u32 key)
{
	unsigned int s;

	for (s = 0; s < MOVERS; s++)
		if (le64_to_cpu(READ_ONCE(b->in->movers[s])) == (MOVING | key))
			return true;
	return false;
}

/*
 * Our region goes: once this returns, no move of the peer's reaches its pages. A mover
 * names the key in our inbox, then reads the region; here the region is taken back, then
 * the movers' words are read: one of the two sees the other (the header's argument). A
 * mover looks again every MOVE_LOOK_PAGES, so the wait is short; a peer that stopped
 * with its word set (its host died) is waited for 2 s once its link is down, 10 s at most.
 */
void pcientb_bridge_unexport(struct pcientb_ib *dev, u32 index, u32 key)
{
	struct pcientb_bridge *b = dev->bridge;
	unsigned long end = jiffies + 2 * HZ;

	if (!b || le32_to_cpu(READ_ONCE(b->regions[index].key)) != key)
		return;
	WRITE_ONCE(b->regions[index].key, 0);
	smp_mb();
	while (peer_moves(b, key)) {
		/* A mover looks again every MiB: 10 s is a peer that no longer moves. */
		if (time_after(jiffies, end) &&
		    (!ntb_link_is_up(b->ntb, NULL, NULL) || time_after(jiffies, end + 8 * HZ))) {
			dev_warn(&b->ntb->dev, "region %#x: a stopped peer still names it\n", key);
			break;
		}
		usleep_range(20, 100);
	}
}

/* Reads the peer's region `key` of node `lid`; 0 or the error the move returns. */
static int peer_region(struct pcientb_bridge *b, u32 lid, u32 key, struct region *r)
{
	u64 at = b->peer_regions + (u64)(key >> 8) * sizeof(*r);

	/* The whole table is in the window (connect checked it). */
	if (!b->peer_regions || (key >> 8) >= PCIENTB_MAX_MR)
		return -ENOENT;
	memcpy_fromio(r, b->out + at, sizeof(*r));
	if (le32_to_cpu(r->key) != key || le32_to_cpu(r->lid) != lid)
		return -ENOENT;
	return 0;
}

/*
 * A move between the caller's memory and region `key` of a node across the bridge: the
 * peer's region table says where its pages are, the CPU copies through the window (the
 * DMA engine is the next step).
 */
static int move(struct pcientb_bridge *b, struct pcientb_node *node, const struct pcientb_move *cmd,
		u8 *bounce)
{
	bool to_region = cmd->dir == PCIENTB_MOVE_WRITE;
	u64 addr[64], off, len = cmd->length, uaddr = cmd->addr, page, pa;
	unsigned int n = 0, got = 0, batches = 0;
	struct region r;
	size_t in_page, chunk;
	int rc;

	rc = peer_region(b, node->lid, cmd->window, &r);
	if (rc)
		return rc;
	if (cmd->raddr < le64_to_cpu(r.iova) || len > le64_to_cpu(r.length) ||
	    cmd->raddr - le64_to_cpu(r.iova) > le64_to_cpu(r.length) - len)
		return -ERANGE;
	if (!(le32_to_cpu(r.access) & (to_region ? IB_ACCESS_REMOTE_WRITE : IB_ACCESS_REMOTE_READ)))
		return -EACCES;
	off = cmd->raddr - le64_to_cpu(r.iova) + le64_to_cpu(r.first);
	page = off >> PAGE_SHIFT;
	while (len) {
		if (n == got) { /* the next addresses of the page list, 64 at a time */
			/* The region may have gone meanwhile: looked at again every MiB. */
			if (batches && batches % (MOVE_LOOK_PAGES / ARRAY_SIZE(addr)) == 0) {
				rc = peer_region(b, node->lid, cmd->window, &r);
				if (rc)
					return rc;
			}
			pa = le64_to_cpu(r.pages) + page * sizeof(u64);
			got = min_t(u64, ARRAY_SIZE(addr),
				    DIV_ROUND_UP(len + (off & ~PAGE_MASK), PAGE_SIZE));
			if (pa > b->out_size || b->out_size - pa < got * sizeof(u64))
				return -EFAULT;
			memcpy_fromio(addr, b->out + pa, got * sizeof(u64));
			n = 0;
			batches++;
		}
		pa = le64_to_cpu(addr[n++]);
		page++;
		in_page = off & ~PAGE_MASK;
		chunk = min_t(u64, len, PAGE_SIZE - in_page);
		if (!PAGE_ALIGNED(pa) || pa > b->out_size || b->out_size - pa < PAGE_SIZE)
			return -EFAULT;
		if (to_region) {
			if (copy_from_user(bounce, u64_to_user_ptr(uaddr), chunk))
				return -EFAULT;
			memcpy_toio(b->out + pa + in_page, bounce, chunk);
		} else {
			memcpy_fromio(bounce, b->out + pa + in_page, chunk);
			if (copy_to_user(u64_to_user_ptr(uaddr), bounce, chunk))
				return -EFAULT;
		}
		off += chunk;
		uaddr += chunk;
		len -= chunk;
		if (fatal_signal_pending(current))
			return -EINTR;
	}
	return 0;
}

int pcientb_bridge_move(struct pcientb_ib *dev, struct pcientb_node *node,
			const struct pcientb_move *cmd)
{
	struct pcientb_bridge *b = dev->bridge;
	u8 *bounce = kmalloc(PAGE_SIZE, GFP_KERNEL);
	unsigned int s;
	int rc = -ENOENT;

	if (!bounce)
		return -ENOMEM;
	atomic64_inc(&b->moves);
	/* Only a dying process stops waiting: any other error fails the transfer. */
	if (down_killable(&b->movers_free)) {
		kfree(bounce);
		return -EINTR;
	}
	spin_lock(&b->movers_lock);
	s = find_first_zero_bit(b->movers_used, MOVERS);
	__set_bit(s, b->movers_used);
	spin_unlock(&b->movers_lock);
	down_read(&b->sem);
	if (b->connected && !READ_ONCE(node->dead)) {
		/* Named, flushed, then the region is read (the argument at unexport). */
		writeq(MOVING | cmd->window, &b->peer_in->movers[s]);
		wmb();
		readq(&b->peer_in->movers[s]);
		rc = move(b, node, cmd, bounce);
		wmb(); /* the moved bytes, then the word that lets the region go */
		writeq(0, &b->peer_in->movers[s]);
	}
	up_read(&b->sem);
	spin_lock(&b->movers_lock);
	__clear_bit(s, b->movers_used);
	spin_unlock(&b->movers_lock);
	up(&b->movers_free);
	kfree(bounce);
	return rc;
}

static int UVERBS_HANDLER(PCIENTB_METHOD_POST)(struct uverbs_attr_bundle *attrs)
{
	struct ib_ucontext *ibuc = ib_uverbs_get_ucontext(attrs);
	struct pcientb_node *node;
	struct pcientb_post cmd;
	struct pcientb_ib *dev;
	int rc;

	if (IS_ERR(ibuc))
		return PTR_ERR(ibuc);
	rc = uverbs_copy_from(&cmd, attrs, PCIENTB_ATTR_POST_CMD);
	if (rc)
		return rc;
	if (cmd.reserved || cmd.lid >= PCIENTB_LIDS)
		return -EINVAL;
	dev = to_dev(ibuc->device);
	node = pcientb_node_get(dev, cmd.lid);
	if (!node)
		return -ENOENT;
	/* A node of this host is mapped and written by the process itself. */
	rc = node->area || !dev->bridge ? -EINVAL :
					  post(dev->bridge, node, cmd.offset, cmd.addr, cmd.length);
	pcientb_node_put(node);
	return rc;
}

DECLARE_UVERBS_NAMED_METHOD(PCIENTB_METHOD_POST,
			    UVERBS_ATTR_PTR_IN(PCIENTB_ATTR_POST_CMD,
					       UVERBS_ATTR_TYPE(struct pcientb_post),
					       UA_MANDATORY));

ADD_UVERBS_METHODS(pcientb_bridge_methods, UVERBS_OBJECT_DEVICE,
		   &UVERBS_METHOD(PCIENTB_METHOD_POST));

const struct uapi_definition pcientb_bridge_defs[] = {
	UAPI_DEF_CHAIN_OBJ_TREE(UVERBS_OBJECT_DEVICE, &pcientb_bridge_methods),
	{},
};

static int counts_show(struct seq_file *m, void *unused)
{
	struct pcientb_bridge *b = m->private;

	seq_printf(m, "posts %lld rings %lld moves %lld\n", atomic64_read(&b->posts),
		   atomic64_read(&b->rings), atomic64_read(&b->moves));
	return 0;
}
DEFINE_SHOW_ATTRIBUTE(counts);

static int hold_get(void *data, u64 *val)
{
	*val = atomic_read(&((struct pcientb_bridge *)data)->hold);
	return 0;
}

/* Holding keeps the work item from looking; releasing makes it look (as a link event). */
static int hold_set(void *data, u64 val)
{
	struct pcientb_bridge *b = data;

	atomic_set(&b->hold, val != 0);
	if (!val)
		pcientb_bridge_kick(b->dev, true);
	return 0;
}
DEFINE_DEBUGFS_ATTRIBUTE(hold_fops, hold_get, hold_set, "%llu\n");

/* debugfs `dir`/bridge: the system calls that wrote through the window, by kind. */
void pcientb_bridge_debugfs(struct pcientb_ib *dev, struct dentry *dir)
{
	if (!dev->bridge)
		return;
	debugfs_create_file("bridge", 0400, dir, dev->bridge, &counts_fops);
	debugfs_create_atomic_t("drop_masks", 0600, dir, &dev->bridge->drop_masks);
	debugfs_create_file("bridge_hold", 0600, dir, dev->bridge, &hold_fops);
}

/* Before the device registers; without a second window the port reaches no peer's nodes. */
int pcientb_bridge_init(struct pcientb_ib *dev)
{
	struct ntb_dev *ntb = dev->ntb;
	struct pcientb_bridge *b;
	int windows = ntb_mw_count(ntb, 0);

	if (windows < 2) {
		dev_info(&ntb->dev, "one memory window: no bridge to the peer's nodes\n");
		return 0;
	}
	b = kzalloc(sizeof(*b), GFP_KERNEL);
	if (!b)
		return -ENOMEM;
	b->in = dma_alloc_coherent(&ntb->pdev->dev, sizeof(*b->in), &b->in_dma, GFP_KERNEL);
	if (!b->in) {
		kfree(b);
		return -ENOMEM;
	}
	b->regions =
		alloc_pages_exact(PCIENTB_MAX_MR * sizeof(*b->regions), GFP_KERNEL | __GFP_ZERO);
	if (!b->regions) {
		dma_free_coherent(&ntb->pdev->dev, sizeof(*b->in), b->in, b->in_dma);
		kfree(b);
		return -ENOMEM;
	}
	sema_init(&b->movers_free, MOVERS);
	spin_lock_init(&b->movers_lock);
	b->dev = dev;
	b->ntb = ntb;
	b->widx = windows - 1;
	init_rwsem(&b->sem);
	INIT_LIST_HEAD(&b->kept);
	INIT_WORK(&b->work, bridge_work);
	b->incarnation = get_random_u32() | 1;
	dev->bridge = b;
	return 0;
}

/* After the device unregistered: no context is left, no event comes. */
void pcientb_bridge_destroy(struct pcientb_ib *dev)
{
	struct pcientb_bridge *b = dev->bridge;
	struct kept_area *k, *next;

	if (!b)
		return;
	cancel_work_sync(&b->work);
	down_write(&b->sem);
	disconnect(b);
	up_write(&b->sem);
	ntb_spad_write(b->ntb, SPAD_BRIDGE, 0);
	ntb_spad_write(b->ntb, SPAD_INCARNATION, 0);
	ring_peer(b); /* the peer stops writing into our inbox now, not at its next look */
	ntb_mw_clear_trans(b->ntb, 0, b->widx);
	list_for_each_entry_safe(k, next, &b->kept, node) {
		pcientb_area_put(k->area);
		kfree(k);
	}
	dma_free_coherent(&b->ntb->pdev->dev, sizeof(*b->in), b->in, b->in_dma);
	free_pages_exact(b->regions, PCIENTB_MAX_MR * sizeof(*b->regions));
	kfree(b);
	dev->bridge = NULL;
}
