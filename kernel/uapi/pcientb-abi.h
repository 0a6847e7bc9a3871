/* SPDX-License-Identifier: (GPL-2.0 WITH Linux-syscall-note) OR BSD-2-Clause */
/*
 * What pcientb.ko and the userspace provider (libpcientb-rdmav34.so) exchange through
 * uverbs: the driver id that binds a kernel device to the provider, the uverbs ABI version,
 * and the driver data that follow the core structures of the commands (udata).
 * Included by the kernel module and by the provider's verbs glue; nothing else.
 */
#ifndef PCIENTB_ABI_H
#define PCIENTB_ABI_H

#include <linux/types.h>

/*
 * Not an upstream RDMA_DRIVER_* value (those are small and taken in order): libibverbs
 * binds by it, and every uverbs ioctl carries it.
 */
#define PCIENTB_DRIVER_ID 0x504e
#define PCIENTB_UVERBS_ABI_VERSION 6
#define PCIENTB_UCONTEXT_MAGIC 0x7063696e /* "pcin" */

/*
 * A context is a node of the fabric, as a process is on the emulated one: it has a LID of
 * its own, from its port's half of the LID space (port 0: 1..511, port 1: 513..1023), so
 * the two hosts never give the same one, and a nonce that tells its incarnation apart.
 */
#define PCIENTB_LIDS_PER_PORT 512

/*
 * The driver data of GET_CONTEXT's command (optional). A context without a node has no
 * LID, area or doorbell: what libibverbs itself asks of a device (GIDs) is served on it,
 * while the provider's engine is a node on a context of its own.
 */
#define PCIENTB_UCONTEXT_NO_NODE 0x1
struct pcientb_ucontext_req {
	__u32 flags;
	/*
	 * The node's engine layout: a fingerprint of what its peers read in its area. Published
	 * in the node table; a provider talks only to nodes of its own (two builds would
	 * misread each other's areas).
	 */
	__u32 layout;
};

/* The driver data of GET_CONTEXT's response. */
struct pcientb_ucontext_resp {
	__u32 magic; /* PCIENTB_UCONTEXT_MAGIC */
	__u32 abi_version; /* PCIENTB_UVERBS_ABI_VERSION */
	__u32 port; /* this host's NTB port number */
	__u32 peer_port; /* the port number of the host across the bridge */
	__u32 lid; /* this context's */
	__u32 table_entries; /* of the node table (PCIENTB_MMAP_TABLE): one per LID */
	__aligned_u64 nonce;
	__aligned_u64 area_size; /* of each node's area (PCIENTB_MMAP_AREA) */
	__aligned_u64 chunk_bytes; /* the size of an area's chunk (PCIENTB_MMAP_REMOTE) */
};

/*
 * What the context's uverbs fd maps, by offset (in pages): its node's area (read-write,
 * shared memory that the nodes of this host map too: what they post), the node table
 * (read-only), and the area of the node with LID `lid` of this host (read-write: a
 * node posts into its peers' areas; it never loads from them, by the transport's rules).
 * An area is memory of the kernel, all of it allocated with the node (area_size, the
 * module's parameter area_mb); nothing gives its pages back before the node goes.
 */
#define PCIENTB_MMAP_AREA 0
#define PCIENTB_MMAP_TABLE 1
/*
 * The doorbell masks (one page, read-only): a __u32 per LID (table_entries of them),
 * non-zero while that node polls (PCIENTB_METHOD_MASK). A node of this host or across the
 * bridge that reads it non-zero after its posts left may leave that node's doorbell alone:
 * the node looks at what was posted when its mask ends. The module keeps each LID's word
 * here; the host across the bridge writes those of its nodes through its window, so that a
 * look is a load of this host's memory.
 */
#define PCIENTB_MMAP_MASKS 2
#define PCIENTB_MMAP_PEER(lid) (0x10000 + (lid))

/*
 * The area of a node of the host across the bridge, a chunk (chunk_bytes) a mapping:
 * write-combined through the NT window, read-write though a node only posts there (a load
 * would cross the link). When the node goes, every mapping of it is emptied before its
 * host may reuse the memory: stores then land in a page of the caller's own. The offsets
 * of two chunks are apart by the largest chunk, so that each mapping has a range of its
 * own in the file.
 */
#define PCIENTB_MMAP_REMOTE_CHUNKS 32 /* of an area, at most */
#define PCIENTB_MMAP_REMOTE_STRIDE 1024 /* pages */
#define PCIENTB_MMAP_REMOTE(lid, chunk)                                                            \
	((1ULL << 30) +                                                                            \
	 ((__u64)(lid)*PCIENTB_MMAP_REMOTE_CHUNKS + (chunk)) * PCIENTB_MMAP_REMOTE_STRIDE)

/*
 * A node table entry, indexed by LID: `life` is non-zero while the node lives (the low
 * bits of its nonce, made odd), 0 once it is gone; `nonce` tells its incarnation.
 */
struct pcientb_node_entry {
	__u32 life;
	__u32 chunks; /* of its area */
	__aligned_u64 nonce;
	__u32 layout; /* its engine's (pcientb_ucontext_req) */
	__u32 reserved;
};

/*
 * Driver methods (uverbs ioctl, on the device object: UVERBS_OBJECT_DEVICE), named in the
 * driver's namespace.
 */
enum pcientb_methods {
	/*
	 * Moves bytes between the caller's memory and a window of a node of this host: the
	 * memory region `window` (its key) of the context with LID `lid`, at `raddr` (an
	 * address in the region, as registered). The kernel checks that the region is that
	 * node's, the bounds, and the right (remote write to write, remote read to read):
	 * ENOENT no such window at that node (or deregistered), ERANGE out of its bounds,
	 * EACCES without the right, EFAULT the caller's memory, EINVAL a bad command.
	 */
	PCIENTB_METHOD_MOVE = 1U << 12, /* UVERBS_ID_NS_SHIFT: the driver's namespace */
	/* Rings node `lid` of this host: its doorbell eventfd counts one. ENOENT: no such node. */
	PCIENTB_METHOD_RING,
	/* The caller's doorbell: an eventfd (fd -1: none). */
	PCIENTB_METHOD_DOORBELL,
	/*
	 * A new file descriptor that polls readable (POLLIN) once node `lid` of incarnation
	 * `nonce` is gone (at once if it is not there); close it when done.
	 */
	PCIENTB_METHOD_WATCH,
	/*
	 * Writes `length` bytes of the caller's memory at `addr` to [offset, offset + length)
	 * of the area of node `lid` across the bridge, as posted writes through the window
	 * (a node of this host is mapped instead: EINVAL). The posts of one caller land in
	 * order; aligned 8-byte words whole. ENOENT: no such node (or gone, or the link is
	 * down), EFAULT: out of its area, or the caller's memory.
	 */
	PCIENTB_METHOD_POST,
	/*
	 * The caller's doorbell mask (its word in PCIENTB_MMAP_MASKS, on both hosts): `quiet`
	 * non-zero while a thread of the node polls its lanes. Set to 0, the call returns once
	 * every peer's look sees 0 (across the bridge: written, then flushed by a read), so
	 * that the caller's next look at its lanes finds whatever a peer posted without ringing.
	 * EINVAL: the context is not a node.
	 */
	PCIENTB_METHOD_MASK,
};

enum pcientb_move_attrs {
	PCIENTB_ATTR_MOVE_CMD = 1U << 12, /* struct pcientb_move, in */
};

enum pcientb_move_dir {
	PCIENTB_MOVE_WRITE = 0, /* the caller's memory to the window */
	PCIENTB_MOVE_READ = 1, /* the window to the caller's memory */
};

enum pcientb_ring_attrs {
	PCIENTB_ATTR_RING_CMD = 1U << 12, /* struct pcientb_ring, in */
};

enum pcientb_doorbell_attrs {
	PCIENTB_ATTR_DOORBELL_CMD = 1U << 12, /* struct pcientb_doorbell, in */
};

enum pcientb_post_attrs {
	PCIENTB_ATTR_POST_CMD = 1U << 12, /* struct pcientb_post, in */
};

enum pcientb_mask_attrs {
	PCIENTB_ATTR_MASK_CMD = 1U << 12, /* struct pcientb_mask, in */
};

enum pcientb_watch_attrs {
	PCIENTB_ATTR_WATCH_CMD = 1U << 12, /* struct pcientb_watch, in */
	PCIENTB_ATTR_WATCH_RESP, /* struct pcientb_watch_resp, out */
};

/* (Attributes of 8 bytes or less travel in the attribute itself, not by pointer.) */
struct pcientb_ring {
	__u32 lid;
	__u32 reserved;
};

struct pcientb_doorbell {
	__s32 fd;
	__u32 reserved;
};

struct pcientb_mask {
	__u32 quiet;
	__u32 reserved;
};

struct pcientb_watch {
	__u32 lid;
	__u32 reserved;
	__aligned_u64 nonce;
};

struct pcientb_watch_resp {
	__s32 fd;
	__u32 reserved;
};

struct pcientb_post {
	__u32 lid;
	__u32 reserved; /* 0 */
	__aligned_u64 offset; /* in the node's area */
	__aligned_u64 addr; /* the caller's memory */
	__aligned_u64 length;
};

struct pcientb_move {
	__u32 lid; /* the window's node */
	__u32 window; /* its memory region's key */
	__aligned_u64 raddr;
	__aligned_u64 addr; /* the caller's memory */
	__aligned_u64 length;
	__u32 dir; /* enum pcientb_move_dir */
	__u32 reserved; /* 0 */
};

#endif
