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
#define PCIENTB_UVERBS_ABI_VERSION 1
#define PCIENTB_UCONTEXT_MAGIC 0x7063696e /* "pcin" */

/* The driver data of GET_CONTEXT's response. */
struct pcientb_ucontext_resp {
	__u32 magic; /* PCIENTB_UCONTEXT_MAGIC */
	__u32 abi_version; /* PCIENTB_UVERBS_ABI_VERSION */
	__u32 port; /* this host's NTB port number */
	__u32 peer_port; /* the port number of the host across the bridge */
};

#endif
