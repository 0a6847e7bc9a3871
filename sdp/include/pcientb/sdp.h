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
 * zero copy on this socket. The default comes from PCIENTB_SDP_ZCOPY_THRESH or the config
 * file (1048576: on the emulated fabric
 * registering a buffer costs a copy of it, so BCopy is as fast below that; see NOTES.md). Number
 * and level as OFED's SDP. getsockopt returns the current value. */
#define SDP_ZCOPY_THRESH 80

/* getsockopt(fd, IPPROTO_TCP, PCIENTB_SDP_STATS, &struct pcientb_sdp_stats, &len). */
#define PCIENTB_SDP_STATS 81

enum pcientb_sdp_path {
  PCIENTB_SDP_PATH_TCP = 0,     /* kernel TCP (not taken, or fell back) */
  PCIENTB_SDP_PATH_SDP = 1,     /* over pcientb0 */
  PCIENTB_SDP_PATH_PENDING = 2, /* not connected yet, or still negotiating */
};

struct pcientb_sdp_stats {
  uint32_t path; /* enum pcientb_sdp_path */
  uint32_t reserved;
  uint64_t bcopy_tx; /* payload bytes sent through the peer's receive ring */
  uint64_t bcopy_rx;
  uint64_t zcopy_tx; /* payload bytes the peer read from this side's buffers */
  uint64_t zcopy_rx;
};

#endif /* PCIENTB_SDP_H */
