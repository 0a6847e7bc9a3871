/* C entry points of libpcientb-rdmav34.so beyond the libibverbs provider ABI.
 *
 * libibverbs cannot list, or ask the kernel about, a device that has no kernel
 * behind it (the emulated fabric). The preload library (libpcientb-preload.so)
 * interposes the few libibverbs calls that would go to the kernel and routes
 * them here for pcientb devices; every other device is left to libibverbs.
 */
#ifndef PCIENTB_PCIENTB_H
#define PCIENTB_PCIENTB_H

#include <infiniband/verbs.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The emulated devices of this process ("pcientb0" on the fabric named by
 * $PCIENTB_FABRIC, default "default"). Returns a malloc'd NULL-terminated
 * array and its length in *num; each device in it holds one reference, given
 * back with pcientb_put_device(). The array itself is the caller's to free().
 * Returns NULL with errno set on failure. */
struct ibv_device **pcientb_emu_device_list(int *num);
void pcientb_put_device(struct ibv_device *dev);

/* A pcientb device reports IBV_ATOMIC_HCA (UCX 1.13 takes no other value as "has
 * atomics"), but its atomics are executed by the target host's CPU on its own
 * memory: they are atomic with that CPU's atomic instructions too, as
 * IBV_ATOMIC_GLOB promises. The SDP layer relies on it (Write ZCopy). */
#define PCIENTB_ATOMICS_WITH_CPU 1

/* Whether an object belongs to this provider. */
int pcientb_owns_device(struct ibv_device *dev);
int pcientb_owns_context(struct ibv_context *ctx);
int pcientb_owns_comp_channel(struct ibv_comp_channel *channel);

/* What libibverbs would ask the kernel (uverbs / sysfs) for. Return 0 or an
 * errno value (not -1), except where noted. */
struct ibv_comp_channel *pcientb_create_comp_channel(struct ibv_context *ctx); /* NULL + errno */
int pcientb_destroy_comp_channel(struct ibv_comp_channel *channel); /* EBUSY while a CQ uses it */
int pcientb_query_gid_ex(struct ibv_context *ctx, uint32_t port_num, uint32_t gid_index,
                         struct ibv_gid_entry *entry);
int pcientb_query_pkey(struct ibv_context *ctx, uint8_t port_num, int index, __be16 *pkey);
__be64 pcientb_device_guid(struct ibv_device *dev);
int pcientb_device_index(struct ibv_device *dev);

/* Traffic counters of the node behind a context (this process on its fabric:
 * every context, QP and CQ of it, live and destroyed), named after an HCA's
 * port counters (sysfs .../ports/1/counters) but counted in bytes and work
 * requests. What pcientb-stat(1) shows as the node's counters. One-sided
 * traffic counts at its requester only: a target does not see RDMA WRITEs
 * into it or READs from it. */
struct pcientb_port_counters {
  uint64_t
      port_xmit_data; /* bytes of the WRs completed without error: SEND, WRITE, READ, atomics */
  uint64_t port_xmit_packets; /* those WRs */
  uint64_t port_rcv_data;     /* bytes of the receive completions polled without error */
  uint64_t port_rcv_packets;  /* those completions (SEND, RDMA WRITE with immediate) */
  uint64_t errors;            /* completions in error, flushes not counted */
  uint64_t flushed;           /* IBV_WC_WR_FLUSH_ERR completions */
  uint64_t rnr_retries;       /* attempts repeated after a receiver-not-ready answer */
  uint64_t transport_retries; /* attempts repeated after a transport timeout */
  uint64_t doorbells;         /* completion and async events rung */
};
/* 0, or EINVAL (not a pcientb context, or port is not 1). The provider is
 * loaded by libibverbs, not linked by programs: once a device is open, find
 * the function with dlsym(dlopen("libpcientb-rdmav34.so", RTLD_NOW |
 * RTLD_NOLOAD), "pcientb_query_port_counters"). */
int pcientb_query_port_counters(struct ibv_context *ctx, uint8_t port,
                                struct pcientb_port_counters *out);

/* The PCIe-level work this process has done through the fabric of `ctx` so
 * far, what a hardware timing model takes (docs/transport.md): posted writes
 * to peers' control memory (link boxes, mirrors, lanes) and their bytes, node
 * doorbells rung (a masked peer is not rung), one-sided moves into and out
 * of peers' registered windows (the DMA role: one per contiguous piece) and
 * their bytes, and loads from a peer's memory outside that role (the
 * emulated fabric's looks at a peer's doorbell mask; none with
 * PCIENTB_NTB_STRICT=1). Counted for the process, whatever its contexts. 0,
 * or EINVAL (not a pcientb context). Found as pcientb_query_port_counters is. */
struct pcientb_work {
  uint64_t posts;
  uint64_t post_bytes;
  uint64_t doorbells;
  uint64_t dma_writes;
  uint64_t dma_write_bytes;
  uint64_t dma_reads;
  uint64_t dma_read_bytes;
  uint64_t remote_reads;
};
int pcientb_query_work(struct ibv_context *ctx, struct pcientb_work *out);

/* 1 if a completion may be waiting in `cq` (a CQ of this provider), or peers
 * posted work that a poll of a CQ of its node turns into completions; 0 if
 * none was a moment ago: a few loads, no lock and no system call, for an
 * event loop watching many CQs that polls only those with news. A hint: a
 * completion arriving as it looks may be missed, so before sleeping poll every
 * CQ (or arm it). Found as pcientb_query_port_counters is. */
int pcientb_cq_pending(struct ibv_cq *cq);

/* The name of the fabric this process is on: $PCIENTB_FABRIC, or its value
 * when the provider loaded if the program has cleared it since (servers that
 * replace their environment), or "default". The socket layer and the rdma_cm
 * glue name their rendezvous after it, so that they meet the peers the
 * provider reaches. Found as pcientb_query_port_counters is. */
const char *pcientb_fabric_name(void);

/* The index of the emulated device whose uverbs device node a kernel driver
 * would create at `path` (/dev/infiniband/<dev_name>), or -1. */
int pcientb_device_node_index(const char *path);

#ifdef __cplusplus
}
#endif
#endif
