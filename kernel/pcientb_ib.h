/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The verbs device's objects, shared by its files: pcientb_ib.c (the device, its queries,
 * contexts and PDs), pcientb_node.c (the nodes: areas, node table, doorbells, watchers)
 * and pcientb_mem.c (memory regions, and the moves into and out of them).
 */
#ifndef PCIENTB_KERNEL_PCIENTB_IB_H
#define PCIENTB_KERNEL_PCIENTB_IB_H

#include <linux/atomic.h>
#include <linux/idr.h>
#include <linux/list.h>
#include <linux/mutex.h>
#include <linux/xarray.h>
#include <rdma/ib_verbs.h>
#include <rdma/uverbs_ioctl.h>

#include "pcientb-abi.h"

#define PCIENTB_MAX_PD (1 << 20)
/* MR keys are index << 8 | a byte that changes with each registration of the index. */
#define PCIENTB_MAX_MR (1 << 16)
#define PCIENTB_MAX_MR_SIZE (1ULL << 40)
#define PCIENTB_LIDS (2 * PCIENTB_LIDS_PER_PORT) /* both ports' halves: the node table */

/*
 * A node's area: chunks of contiguous pages, the largest the page allocator gives (so that
 * a peer host reaches them through its window in few pieces).
 */
#define PCIENTB_CHUNK_ORDER min(10, MAX_ORDER - 1) /* 1 << 10: PCIENTB_MMAP_REMOTE_STRIDE */
#define PCIENTB_CHUNK_PAGES (1UL << PCIENTB_CHUNK_ORDER)
#define PCIENTB_CHUNK_BYTES (PAGE_SIZE << PCIENTB_CHUNK_ORDER)
#define PCIENTB_AREA_MB_MAX 64U
#define PCIENTB_AREA_CHUNKS_MAX (PCIENTB_AREA_MB_MAX / 2) /* chunks of 2 MiB at least */
static_assert(PCIENTB_AREA_CHUNKS_MAX <= PCIENTB_MMAP_REMOTE_CHUNKS);

struct pcientb_area {
	struct kref ref; /* its node's, and the bridge's while the peer host may reach it */
	unsigned int chunks;
	struct page *chunk[];
};

/*
 * A node: a context of this host (with its area), or a node of the host across the bridge
 * as the bridge knows it (remote: its area is reached through the window, at the offsets
 * of its chunks there).
 */
struct pcientb_node {
	struct kref ref;
	u32 lid;
	u64 nonce;
	u32 layout; /* its engine's */
	struct pcientb_area *area; /* NULL: remote */
	unsigned int chunks; /* remote: of its area */
	u64 chunk_off[PCIENTB_AREA_CHUNKS_MAX]; /* remote: in the outbound window */
	phys_addr_t window; /* remote: the outbound window's bus address */
	struct mutex map_mu; /* remote: mappings made vs the node's going (dead) */
	struct list_head mappers; /* remote: who mapped it (struct pcientb_mapper) */
	struct list_head mapped_files; /* remote: through what (struct pcientb_mapped_file) */
	bool dead;
	wait_queue_head_t watchers;
	spinlock_t lock; /* doorbell */
	struct eventfd_ctx *doorbell;
	struct rcu_head rcu;
};

struct ntb_dev;
struct pcientb_bridge;

struct pcientb_ib {
	struct ib_device ibdev;
	struct ntb_dev *ntb;
	atomic_t pds;
	struct ida lids; /* of its contexts */
	struct xarray nodes; /* LID -> struct pcientb_node, while the context lives */
	void *table; /* PCIENTB_LIDS struct pcientb_node_entry, mapped read-only */
	struct page *masks_page; /* PCIENTB_MMAP_MASKS, mapped read-only */
	u32 *masks; /* its words, by LID: ours written here, the peer's by the peer host */
	struct xarray mrs; /* key index -> struct pcientb_mr */
	u32 next_mr; /* xa_alloc_cyclic's cursor */
	u8 *mr_gens; /* per index: the key byte of its last registration */
	bool active; /* what the last event said; under the NTB's ctx_lock (link events) */
	struct pcientb_bridge *bridge; /* NULL: the port cannot reach the peer's nodes */
};

static inline struct pcientb_ib *to_dev(struct ib_device *ibdev)
{
	return container_of(ibdev, struct pcientb_ib, ibdev);
}

/* A context: a node of the fabric. */
struct pcientb_ucontext {
	struct ib_ucontext ibuc;
	u32 lid;
	struct pcientb_node *node;
};

extern const struct uapi_definition pcientb_mem_defs[];
extern const struct uapi_definition pcientb_node_defs[];

int pcientb_nodes_init(struct pcientb_ib *dev);
void pcientb_nodes_destroy(struct pcientb_ib *dev);
int pcientb_node_add(struct pcientb_ib *dev, struct pcientb_ucontext *uc, u64 nonce, u32 layout);
void pcientb_node_remove(struct pcientb_ib *dev, struct pcientb_ucontext *uc);
size_t pcientb_area_size(void);
void pcientb_area_put(struct pcientb_area *area);
struct pcientb_node *pcientb_node_get(struct pcientb_ib *dev, u32 lid);
void pcientb_node_put(struct pcientb_node *node);
void pcientb_node_signal(struct pcientb_node *node);
int pcientb_remote_add(struct pcientb_ib *dev, u32 lid, u64 nonce, u32 layout, unsigned int chunks,
		       const u64 *chunk_off, phys_addr_t window);
void pcientb_remote_remove(struct pcientb_ib *dev, struct pcientb_node *node);

/* The bridge (pcientb_bridge.c): the nodes of the host across the NT port. */
extern const struct uapi_definition pcientb_bridge_defs[];
int pcientb_bridge_init(struct pcientb_ib *dev);
void pcientb_bridge_destroy(struct pcientb_ib *dev);
void pcientb_bridge_publish(struct pcientb_ib *dev, struct pcientb_node *node, bool alive);
int pcientb_bridge_ring(struct pcientb_ib *dev, struct pcientb_node *node);
void pcientb_bridge_mask(struct pcientb_ib *dev, u32 lid, u32 quiet);
void pcientb_bridge_export(struct pcientb_ib *dev, u32 index, u32 key, u32 lid, int access,
			   u64 iova, u64 length, u64 first, const u64 *pages);
void pcientb_bridge_unexport(struct pcientb_ib *dev, u32 index, u32 key);
int pcientb_bridge_move(struct pcientb_ib *dev, struct pcientb_node *node,
			const struct pcientb_move *cmd);
int pcientb_mmap(struct ib_ucontext *ibuc, struct vm_area_struct *vma);

struct ib_mr *pcientb_reg_user_mr(struct ib_pd *ibpd, u64 start, u64 length, u64 iova, int access,
				  struct ib_udata *udata);
int pcientb_dereg_mr(struct ib_mr *ibmr, struct ib_udata *udata);
int pcientb_mem_init(struct pcientb_ib *dev);
void pcientb_mem_destroy(struct pcientb_ib *dev);

#endif
