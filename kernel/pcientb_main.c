// SPDX-License-Identifier: GPL-2.0
/*
 * pcientb.ko: the module and its NTB client.
 *
 * The client takes every NTB device the hardware drivers register, enables its link and
 * counts its doorbells and link events (debugfs pcientb/<device>/link: "up|down EVENTS").
 * debugfs pcientb/<device>/selftest runs, toward the device's peer
 * port when both are in this kernel (the one-guest test), what the transport will rely
 * on: scratchpads both ways, a doorbell, and a write through the peer's memory window
 * that lands where the peer's inbound translation points. When the peer is another host
 * (the two-guest test), both sides read pcientb/<device>/remote at once (each writes the
 * other's window, rings, and checks what it received); then one side reads "sink" (keeps
 * its window open until the link goes down) while the other reads "source" (writes
 * through the window until the link goes down, or it is killed).
 */
#include <linux/module.h>
#include <linux/debugfs.h>
#include <linux/delay.h>
#include <linux/dma-mapping.h>
#include <linux/io.h>
#include <linux/ktime.h>
#include <linux/list.h>
#include <linux/mutex.h>
#include <linux/ntb.h>
#include <linux/sched/signal.h>
#include <linux/seq_file.h>
#include <linux/wait.h>

#include "pcientb.h"

#define PCIENTB_SELFTEST_BYTES (64 * 1024)
#define PCIENTB_WAIT_MS 2000
/*
 * Across hosts (tier 2): the scratchpad that says which window is set, and how long to
 * wait. Each use of a window has its own tag, so that a peer never takes a window that is
 * about to go away for the next one.
 */
#define PCIENTB_SPAD_WINDOW 2
#define PCIENTB_WINDOW_REMOTE 0x57494e31 /* "WIN1" */
#define PCIENTB_WINDOW_SINK 0x57494e32 /* "WIN2" */
#define PCIENTB_REMOTE_WAIT_MS 30000

struct pcientb_port {
	struct list_head node;
	struct ntb_dev *ntb;
	struct dentry *dir;
	atomic_t db_events[BITS_PER_LONG];
	atomic_t link_events;
	wait_queue_head_t wq;
	bool dying; /* being removed: waits end */
	struct list_head kept; /* windows a peer may still write: freed at removal */
	struct pcientb_ib *ib; /* the port's verbs device */
};

static DEFINE_MUTEX(ports_lock);
static LIST_HEAD(ports);
static struct dentry *debug_root;

static void port_link_event(void *ctx)
{
	struct pcientb_port *port = ctx;

	atomic_inc(&port->link_events);
	pcientb_ib_link_event(port->ib);
	wake_up_all(&port->wq);
}

static void port_db_event(void *ctx, int vector)
{
	struct pcientb_port *port = ctx;
	u64 bits = ntb_db_read(port->ntb) & ntb_db_vector_mask(port->ntb, vector);
	int b;

	/* Counted by bit: one vector may carry many (a PEX8749's 16 share its INTx). */
	for (b = 0; b < BITS_PER_LONG; b++)
		if (bits & BIT_ULL(b))
			atomic_inc(&port->db_events[b]);
	ntb_db_clear(port->ntb, bits);
	if (bits & BIT_ULL(PCIENTB_DB_BRIDGE) && port->ib)
		pcientb_bridge_kick(port->ib, false);
	/* A driver with a level-triggered interrupt masks what it reports until then. */
	ntb_db_clear_mask(port->ntb, bits);
	wake_up_all(&port->wq);
}

static const struct ntb_ctx_ops port_ctx_ops = {
	.link_event = port_link_event,
	.db_event = port_db_event,
};

/* The port of this kernel that is `port`'s peer, if any. Called with ports_lock held. */
static struct pcientb_port *peer_of(struct pcientb_port *port)
{
	int want = ntb_peer_port_number(port->ntb, 0);
	struct pcientb_port *p;

	if (want < 0) /* not known yet (a PEX pair whose link never came up) */
		return NULL;
	list_for_each_entry(p, &ports, node)
		if (p != port && ntb_port_number(p->ntb) == want)
			return p;
	return NULL;
}

static bool link_up(struct pcientb_port *p)
{
	return ntb_link_is_up(p->ntb, NULL, NULL) != 0;
}

/* Waits until `cond`, the port's removal or `ms`; whether `cond` holds. */
#define wait_port(port, cond, ms)                                                                  \
	(wait_event_timeout((port)->wq, (cond) || READ_ONCE((port)->dying), msecs_to_jiffies(ms)), \
	 (cond))

static int selftest_spads(struct seq_file *s, struct pcientb_port *a, struct pcientb_port *b)
{
	u32 token = get_random_u32();

	ntb_spad_write(a->ntb, 0, token);
	ntb_peer_spad_write(b->ntb, 0, 1, ~token);
	if (ntb_peer_spad_read(b->ntb, 0, 0) != token || ntb_spad_read(a->ntb, 1) != ~token) {
		seq_puts(
			s,
			"FAIL scratchpads: a value written on one side is not read on the other\n");
		return -EIO;
	}
	seq_printf(s, "ok   scratchpads (%d per port)\n", ntb_spad_count(a->ntb));
	return 0;
}

/* Rings doorbell bit 0 of b from a: microseconds until b's event, or -1. */
static s64 ring_peer(struct pcientb_port *a, struct pcientb_port *b)
{
	int before = atomic_read(&b->db_events[0]);
	ktime_t t0 = ktime_get();

	ntb_peer_db_set(a->ntb, BIT_ULL(0));
	if (!wait_port(b, atomic_read(&b->db_events[0]) != before, PCIENTB_WAIT_MS))
		return -1;
	return ktime_us_delta(ktime_get(), t0);
}

static int selftest_doorbell(struct seq_file *s, struct pcientb_port *a, struct pcientb_port *b)
{
	s64 us = ring_peer(a, b);

	if (us < 0) {
		seq_puts(s, "FAIL doorbell: the peer saw no doorbell event\n");
		return -EIO;
	}
	seq_printf(s, "ok   doorbell (%lld us to the peer's event)\n", us);
	return 0;
}

/*
 * The bytes a window holding `want` bytes takes on this port: hardware windows come in
 * units (a PEX8749 link BAR: a power of two of at least 1 MiB; an A-LUT entry). A
 * power of two from dma_alloc_coherent is aligned to its size, so to the unit too.
 * 0 when the window cannot be that large, or the link is down (the NTB API tells the
 * alignment only then).
 */
static size_t window_bytes(struct ntb_dev *ntb, size_t want)
{
	resource_size_t addr_align = 1, size_align = 1, size_max = 0;

	if (ntb_mw_get_align(ntb, 0, 0, &addr_align, &size_align, &size_max))
		return 0;
	want = roundup_pow_of_two(max3(want, (size_t)addr_align, (size_t)size_align));
	return want <= size_max ? want : 0;
}

static int selftest_window(struct seq_file *s, struct pcientb_port *a, struct pcientb_port *b)
{
	struct device *dev = &b->ntb->pdev->dev;
	size_t size = PCIENTB_SELFTEST_BYTES, win = window_bytes(b->ntb, size);
	phys_addr_t base;
	resource_size_t got;
	void __iomem *out;
	dma_addr_t dma;
	u8 *in;
	size_t i;
	int rc = -EIO;

	if (ntb_mw_count(b->ntb, 0) < 1) {
		seq_puts(s, "FAIL window: no memory window\n");
		return -EIO;
	}
	if (!win) {
		seq_puts(s, "FAIL window: the port's window cannot hold the test\n");
		return -EIO;
	}
	in = dma_alloc_coherent(dev, win, &dma, GFP_KERNEL);
	if (!in)
		return -ENOMEM;
	memset(in, 0, win);
	if (ntb_mw_set_trans(b->ntb, 0, 0, dma, win) ||
	    ntb_peer_mw_get_addr(a->ntb, 0, &base, &got) || got < win) {
		seq_puts(
			s,
			"FAIL window: the translation set by one side is not the other's window\n");
		goto free;
	}
	out = ioremap_wc(base, size);
	if (!out) {
		rc = -ENOMEM;
		goto clear;
	}
	for (i = 0; i < size; i += 4)
		iowrite32(0x9e3779b9u * (u32)(i / 4 + 1), out + i);
	wmb(); /* the data, then the doorbell that announces it */
	iounmap(out);
	if (ring_peer(a, b) < 0) {
		seq_puts(s, "FAIL window: the peer saw no doorbell after the write\n");
		goto clear;
	}
	for (i = 0; i < size; i += 4) {
		if (*(u32 *)(in + i) != 0x9e3779b9u * (u32)(i / 4 + 1)) {
			seq_printf(s,
				   "FAIL window: byte %zu of the peer's buffer is not what was "
				   "written\n",
				   i);
			goto clear;
		}
	}
	seq_printf(s,
		   "ok   window (%llu KiB written through the window, read in the peer's memory)\n",
		   (unsigned long long)size >> 10);
	rc = 0;
clear:
	ntb_mw_clear_trans(b->ntb, 0, 0);
free:
	dma_free_coherent(dev, win, in, dma);
	return rc;
}

static int selftest_show(struct seq_file *s, void *unused)
{
	struct pcientb_port *a = s->private, *b;
	int rc;

	mutex_lock(&ports_lock);
	b = peer_of(a);
	if (!b) {
		seq_puts(s, "FAIL no peer port in this kernel\n");
		rc = 0;
		goto out;
	}
	/* Each port hears of the link from its own events: both are waited for. */
	if (!wait_port(a, link_up(a), PCIENTB_WAIT_MS) ||
	    !wait_port(b, link_up(b), PCIENTB_WAIT_MS)) {
		seq_puts(s, "FAIL link: not up on both ports\n");
		goto out;
	}
	seq_puts(s, "ok   link up\n");
	rc = selftest_spads(s, a, b);
	if (!rc)
		rc = selftest_doorbell(s, a, b);
	if (!rc)
		rc = selftest_window(s, a, b);
	if (!rc)
		seq_puts(s, "PASS\n");
out:
	mutex_unlock(&ports_lock);
	return 0;
}
DEFINE_SHOW_ATTRIBUTE(selftest);

static u32 remote_word(int port, size_t i)
{
	return (0x9e3779b9u * (u32)(i / 4 + 1)) ^ ((u32)port << 28);
}

/* An inbound window the peer may write: set, and announced in a scratchpad. */
struct window {
	struct list_head node;
	struct ntb_dev *ntb;
	u8 *buf;
	dma_addr_t dma;
	size_t size;
};

static struct window *window_open(struct ntb_dev *ntb, size_t size, u32 tag)
{
	struct window *w = kzalloc(sizeof(*w), GFP_KERNEL);

	if (!w)
		return NULL;
	w->ntb = ntb;
	w->size = window_bytes(ntb, size);
	if (!w->size)
		goto free;
	w->buf = dma_alloc_coherent(&ntb->pdev->dev, w->size, &w->dma, GFP_KERNEL);
	if (!w->buf)
		goto free;
	memset(w->buf, 0, w->size);
	if (ntb_mw_set_trans(ntb, 0, 0, w->dma, w->size))
		goto free_buf;
	ntb_spad_write(ntb, PCIENTB_SPAD_WINDOW, tag);
	return w;
free_buf:
	dma_free_coherent(&ntb->pdev->dev, w->size, w->buf, w->dma);
free:
	kfree(w);
	return NULL;
}

/*
 * Only once the peer is done with it: a window cannot be revoked from a peer that mapped it
 * (ntb_ivshmem.c), so one the peer may still write is kept instead (window_keep).
 */
static void window_close(struct window *w)
{
	ntb_spad_write(w->ntb, PCIENTB_SPAD_WINDOW, 0);
	ntb_mw_clear_trans(w->ntb, 0, 0);
	dma_free_coherent(&w->ntb->pdev->dev, w->size, w->buf, w->dma);
	kfree(w);
}

/* No new peer takes it; its memory stays until the port goes. */
static void window_keep(struct pcientb_port *port, struct window *w)
{
	ntb_spad_write(w->ntb, PCIENTB_SPAD_WINDOW, 0);
	mutex_lock(&ports_lock);
	list_add(&w->node, &port->kept);
	mutex_unlock(&ports_lock);
}

/* The peer's window `tag`, once the link is up and the peer has announced it. */
static void __iomem *peer_window(struct pcientb_port *p, size_t size, u32 tag)
{
	unsigned long end = jiffies + msecs_to_jiffies(PCIENTB_REMOTE_WAIT_MS);
	resource_size_t got;
	phys_addr_t base;

	while (!link_up(p) || ntb_peer_spad_read(p->ntb, 0, PCIENTB_SPAD_WINDOW) != tag ||
	       ntb_peer_mw_get_addr(p->ntb, 0, &base, &got) || got < size) {
		if (time_after(jiffies, end) || READ_ONCE(p->dying))
			return NULL;
		msleep(10);
	}
	return ioremap_wc(base, size);
}

static void fill_window(void __iomem *out, int port, size_t size)
{
	size_t i;

	for (i = 0; i < size; i += 4)
		iowrite32(remote_word(port, i), out + i);
	wmb(); /* the data, then the doorbell that announces it */
}

static int remote_show(struct seq_file *s, void *unused)
{
	struct pcientb_port *a = s->private;
	int before = atomic_read(&a->db_events[1]);
	int peer;
	void __iomem *out;
	struct window *w;
	size_t i;

	/* A window's size follows the port's alignment, known once the link is up. */
	if (!wait_port(a, link_up(a), PCIENTB_REMOTE_WAIT_MS)) {
		seq_puts(s, "FAIL link: not up\n");
		return 0;
	}
	/* Known once the link is up (a PEX8749 pair agrees on its numbers first). */
	peer = ntb_peer_port_number(a->ntb, 0);
	if (peer < 0) {
		seq_printf(s, "FAIL link: no peer port number (%d)\n", peer);
		return 0;
	}
	w = window_open(a->ntb, PCIENTB_SELFTEST_BYTES, PCIENTB_WINDOW_REMOTE);
	if (!w) {
		seq_puts(s, "FAIL window: cannot set the inbound window\n");
		return 0;
	}
	out = peer_window(a, w->size, PCIENTB_WINDOW_REMOTE);
	if (!out) {
		seq_puts(s, "FAIL link: no link, or the peer announced no window\n");
		goto keep;
	}
	fill_window(out, ntb_port_number(a->ntb), w->size);
	iounmap(out);
	ntb_peer_db_set(a->ntb, BIT_ULL(1));
	if (!wait_port(a, atomic_read(&a->db_events[1]) != before, PCIENTB_REMOTE_WAIT_MS)) {
		seq_puts(s, "FAIL doorbell: the peer never rang\n");
		goto keep;
	}
	/* The peer rang after its write, and writes nothing more here. */
	for (i = 0; i < w->size; i += 4) {
		if (*(u32 *)(w->buf + i) != remote_word(peer, i)) {
			seq_printf(s, "FAIL window: byte %zu of what the peer wrote differs\n", i);
			break;
		}
	}
	if (i == w->size)
		seq_printf(s,
			   "ok   %zu KiB each way through the windows, a doorbell each way\nPASS\n",
			   w->size >> 10);
	window_close(w);
	return 0;
keep:
	window_keep(a, w);
	return 0;
}
DEFINE_SHOW_ATTRIBUTE(remote);

static int sink_show(struct seq_file *s, void *unused)
{
	struct pcientb_port *a = s->private;
	int writes = atomic_read(&a->db_events[1]);
	struct window *w;

	if (!wait_port(a, link_up(a), PCIENTB_REMOTE_WAIT_MS)) {
		seq_puts(s, "FAIL link: not up\n");
		return 0;
	}
	w = window_open(a->ntb, PCIENTB_SELFTEST_BYTES, PCIENTB_WINDOW_SINK);
	if (!w) {
		seq_puts(s, "FAIL window: cannot set the inbound window\n");
		return 0;
	}
	if (!wait_port(a, !link_up(a), PCIENTB_REMOTE_WAIT_MS) || READ_ONCE(a->dying))
		seq_puts(s, "FAIL link: did not go down\n");
	else
		seq_printf(s, "ok   link down after %d doorbells of the source\n",
			   atomic_read(&a->db_events[1]) - writes);
	/* Down on this side only (a stalled peer), the peer may still write. */
	window_keep(a, w);
	return 0;
}
DEFINE_SHOW_ATTRIBUTE(sink);

static int source_show(struct seq_file *s, void *unused)
{
	struct pcientb_port *a = s->private;
	void __iomem *out = peer_window(a, PCIENTB_SELFTEST_BYTES, PCIENTB_WINDOW_SINK);
	unsigned long n = 0;

	if (!out) {
		seq_puts(s, "FAIL link: no link, or the peer announced no window\n");
		return 0;
	}
	pr_info("pcientb: %s: streaming to the peer\n", dev_name(&a->ntb->dev));
	while (link_up(a) && !READ_ONCE(a->dying) && !signal_pending(current)) {
		fill_window(out, ntb_port_number(a->ntb), PCIENTB_SELFTEST_BYTES);
		ntb_peer_db_set(a->ntb, BIT_ULL(1));
		n++;
		cond_resched();
	}
	iounmap(out);
	seq_printf(s, "ok   %lu windows written until the link went down\n", n);
	return 0;
}
DEFINE_SHOW_ATTRIBUTE(source);

/* The link as the port sees it, and how many link events it has had. */
static int link_show(struct seq_file *s, void *unused)
{
	struct pcientb_port *port = s->private;

	seq_printf(s, "%s %d\n", link_up(port) ? "up" : "down", atomic_read(&port->link_events));
	return 0;
}
DEFINE_SHOW_ATTRIBUTE(link);

static int pcientb_probe(struct ntb_client *client, struct ntb_dev *ntb)
{
	struct pcientb_port *port;
	int rc;

	port = kzalloc(sizeof(*port), GFP_KERNEL);
	if (!port)
		return -ENOMEM;
	port->ntb = ntb;
	init_waitqueue_head(&port->wq);
	INIT_LIST_HEAD(&port->kept);
	/* Before the context: link events find it there. */
	port->ib = pcientb_ib_add(ntb);
	if (IS_ERR(port->ib)) {
		rc = PTR_ERR(port->ib);
		kfree(port);
		return rc;
	}
	rc = ntb_set_ctx(ntb, port, &port_ctx_ops);
	if (rc) {
		pcientb_ib_remove(port->ib);
		kfree(port);
		return rc;
	}
	port->dir = debugfs_create_dir(dev_name(&ntb->dev), debug_root);
	debugfs_create_file("selftest", 0400, port->dir, port, &selftest_fops);
	debugfs_create_file("link", 0400, port->dir, port, &link_fops);
	debugfs_create_file("remote", 0400, port->dir, port, &remote_fops);
	debugfs_create_file("sink", 0400, port->dir, port, &sink_fops);
	debugfs_create_file("source", 0400, port->dir, port, &source_fops);
	pcientb_bridge_debugfs(port->ib, port->dir);
	mutex_lock(&ports_lock);
	list_add_tail(&port->node, &ports);
	mutex_unlock(&ports_lock);
	ntb_db_clear_mask(ntb, ntb_db_valid_mask(ntb)); /* drivers may start with all masked */
	ntb_link_enable(ntb, NTB_SPEED_AUTO, NTB_WIDTH_AUTO);
	return 0;
}

static void pcientb_remove(struct ntb_client *client, struct ntb_dev *ntb)
{
	struct pcientb_port *port = ntb->ctx;
	struct window *w, *next;

	/* Readers of the debugfs files stop waiting; removing the files waits for them. */
	WRITE_ONCE(port->dying, true);
	wake_up_all(&port->wq);
	debugfs_remove_recursive(port->dir);
	ntb_link_disable(ntb);
	ntb_db_set_mask(ntb, ntb_db_valid_mask(ntb)); /* nothing pending unserved meanwhile */
	ntb_clear_ctx(ntb);
	pcientb_ib_remove(port->ib);
	mutex_lock(&ports_lock);
	list_del(&port->node);
	mutex_unlock(&ports_lock);
	list_for_each_entry_safe(w, next, &port->kept, node)
		window_close(w);
	kfree(port);
}

static struct ntb_client pcientb_client = {
	.ops = {
		.probe = pcientb_probe,
		.remove = pcientb_remove,
	},
};

static int __init pcientb_init(void)
{
	int rc;

	rc = pcientb_areas_init();
	if (rc)
		return rc;
	debug_root = debugfs_create_dir("pcientb", NULL);
	rc = ntb_register_client(&pcientb_client);
	if (rc)
		goto err;
	rc = pcientb_ivshmem_init();
	if (rc)
		goto client;
	rc = pcientb_plx_dma_init();
	if (rc)
		goto ivshmem;
	rc = pcientb_plx_init();
	if (rc)
		goto dma;
	return 0;
dma:
	pcientb_plx_dma_exit();
ivshmem:
	pcientb_ivshmem_exit();
client:
	ntb_unregister_client(&pcientb_client);
err:
	debugfs_remove_recursive(debug_root);
	pcientb_areas_exit();
	return rc;
}

static void __exit pcientb_exit(void)
{
	pcientb_plx_exit();
	pcientb_plx_dma_exit();
	pcientb_ivshmem_exit();
	ntb_unregister_client(&pcientb_client);
	debugfs_remove_recursive(debug_root);
	pcientb_areas_exit();
}

module_init(pcientb_init);
module_exit(pcientb_exit);
MODULE_DESCRIPTION("RDMA verbs over PCIe non-transparent bridges");
MODULE_LICENSE("GPL");
