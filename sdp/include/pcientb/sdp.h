/* pcientb SDP socket layer (libpcientb-sdp.so): what a program may ask of it.
 *
 * The layer diverts TCP sockets to pcientb0 transparently; programs need none of
 * this. Programs that want to tune or observe a socket use these options on a
 * socket the layer may have taken (on a plain socket they fail with ENOPROTOOPT,
 * as any unknown TCP option does).
 */
#ifndef PCIENTB_SDP_H
#define PCIENTB_SDP_H

#include <netinet/in.h>
#include <stdint.h>

/* setsockopt(fd, IPPROTO_TCP, SDP_ZCOPY_THRESH, &int, sizeof(int)): blocking sends of at
 * least this many bytes go zero-copy (the peer RDMA-reads the sender's buffer); 0 disables
 * zero copy on this socket; SDP_ZCOPY_AUTO lets the layer choose per send from what each
 * path has cost in this process for that size and that many connections sending (sends
 * below 16 KiB always copy). The default comes from PCIENTB_SDP_ZCOPY_THRESH (a number or
 * "auto"); without it 2097152: on the emulated fabric BCopy is as fast below that (the best
 * single threshold of scripts/sdp-bench.sh's sweep; see NOTES.md). Number and level as
 * OFED's SDP.
 * getsockopt returns the current value. */
#define SDP_ZCOPY_THRESH 80
#define SDP_ZCOPY_AUTO (-1)

/* getsockopt(fd, IPPROTO_TCP, PCIENTB_SDP_STATS, &struct pcientb_sdp_stats, &len). */
#define PCIENTB_SDP_STATS 81

enum pcientb_sdp_path {
  PCIENTB_SDP_PATH_TCP = 0,     /* kernel TCP (not taken, or fell back) */
  PCIENTB_SDP_PATH_SDP = 1,     /* over pcientb0 */
  PCIENTB_SDP_PATH_PENDING = 2, /* not connected yet, or still negotiating */
};

/* A shorter buffer (a program built against the first version of this header) gets the
 * fields it has room for. */
struct pcientb_sdp_stats {
  uint32_t path; /* enum pcientb_sdp_path */
  uint32_t reserved;
  uint64_t bcopy_tx; /* payload bytes sent through the peer's receive ring */
  uint64_t bcopy_rx;
  uint64_t zcopy_tx;      /* payload bytes moved zero copy from this side's buffers (Read and
                            Write ZCopy) */
  uint64_t zcopy_rx;      /* ... into this side's buffers */
  uint64_t onesided_tx;   /* bytes written into the peer's exposed window (pcientb_sdp_write) */
  uint64_t registrations; /* buffers this socket registered (zero copy, one-sided, window) */
  uint64_t wzcopy_tx;     /* of zcopy_tx: written by this side into a buffer the peer's blocking
                             receive offered (Write ZCopy: SinkAvail, RDMA WRITE, RdmaWrCompl) */
  uint64_t wzcopy_rx;     /* of zcopy_rx: written by the peer into this side's offered buffers */
  uint64_t sink_avails;   /* receive buffers this side offered (taken or not) */
  uint64_t held_sends;    /* sends that returned with bytes not yet posted (small ones
                             coalescing, or write credits short), posted by the next
                             call or within ~50 us */
};

/* One-sided writes, in the spirit of rsockets' riomap/riowrite. A program exposes a buffer
 * of its own to the peer of an SDP socket; the peer writes into it at an offset, and this
 * side makes no call for it. A write is ordered with the byte stream: what the writer sends
 * after it arrives after its data is in place, so "write, then send a message" tells the
 * exposing side that the data is there. On a socket that is not (or no longer) on SDP the
 * calls fail, and the program sends its data through the stream instead.
 *
 *   setsockopt(fd, IPPROTO_TCP, PCIENTB_SDP_EXPOSE, &struct pcientb_sdp_window, sizeof)
 *     exposes [addr, addr + len) to the peer's writes (one window per socket; a new one
 *     replaces it, len 0 withdraws it). The memory must stay valid while exposed. A window
 *     takes effect where it is in the stream: when the peer's program reads past it (the
 *     first window as soon as the peer has read everything sent before it).
 *   setsockopt(fd, IPPROTO_TCP, PCIENTB_SDP_WRITE, &struct pcientb_sdp_window, sizeof)
 *     with offset: writes len bytes from addr into the peer's window at offset, and returns
 *     once they are in place. It waits for the peer's window if none came yet (EAGAIN on a
 *     non-blocking socket).
 * Errors: ENOPROTOOPT (not an SDP socket: kernel TCP, or the layer is not there), EINVAL
 * (outside the window), EOPNOTSUPP (the connection went back to TCP), ECONNRESET/EPIPE. */
#define PCIENTB_SDP_EXPOSE 82
#define PCIENTB_SDP_WRITE 83

struct pcientb_sdp_window {
  void *addr;
  uint64_t len;
  uint64_t offset; /* PCIENTB_SDP_WRITE: where in the peer's window */
};

#include <sys/socket.h>

static inline int pcientb_sdp_expose(int fd, void *addr, uint64_t len) {
  struct pcientb_sdp_window w = {addr, len, 0};
  return setsockopt(fd, IPPROTO_TCP, PCIENTB_SDP_EXPOSE, &w, sizeof w);
}

static inline int pcientb_sdp_write(int fd, const void *addr, uint64_t len, uint64_t offset) {
  struct pcientb_sdp_window w = {(void *)addr, len, offset};
  return setsockopt(fd, IPPROTO_TCP, PCIENTB_SDP_WRITE, &w, sizeof w);
}

#endif /* PCIENTB_SDP_H */
