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
#define PCIENTB_UVERBS_ABI_VERSION 2
#define PCIENTB_UCONTEXT_MAGIC 0x7063696e /* "pcin" */

/*
 * A context is a node of the fabric, as a process is on the emulated one: it has a LID of
 * its own, from its port's half of the LID space (port 0: 1..511, port 1: 513..1023), so
 * the two hosts never give the same one, and a nonce that tells its incarnation apart.
 */
#define PCIENTB_LIDS_PER_PORT 512

/* The driver data of GET_CONTEXT's response. */
struct pcientb_ucontext_resp {
	__u32 magic; /* PCIENTB_UCONTEXT_MAGIC */
	__u32 abi_version; /* PCIENTB_UVERBS_ABI_VERSION */
	__u32 port; /* this host's NTB port number */
	__u32 peer_port; /* the port number of the host across the bridge */
	__u32 lid; /* this context's */
	__u32 reserved;
	__aligned_u64 nonce;
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
};

enum pcientb_move_attrs {
	PCIENTB_ATTR_MOVE_CMD = 1U << 12, /* struct pcientb_move, in */
};

enum pcientb_move_dir {
	PCIENTB_MOVE_WRITE = 0, /* the caller's memory to the window */
	PCIENTB_MOVE_READ = 1, /* the window to the caller's memory */
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
