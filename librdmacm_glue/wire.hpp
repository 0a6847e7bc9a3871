// The CM protocol between two nodes, and where a node finds a listener.
//
// One CM connection is one AF_UNIX SOCK_SEQPACKET connection between the two
// processes: the active side connects to the name of the (port space, port)
// it wants and sends REQ (or SIDR_REQ for UD); the messages are those of the
// IB CM (REQ, MRA, REP, RTU, REJ, DREQ, DREP, SIDR REQ/REP), carrying what
// each side needs for INIT_QP_ATTR. The end of the socket tells a side that
// its peer is gone (destroyed, exited or killed). Names are abstract (no file
// to clean up) and include the fabric, so two fabrics never meet; binding the
// name is what reserves the port, fabric-wide, and frees it at process death.
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <cstdint>
#include <string>

namespace pcientb::cm {

enum class MsgType : uint32_t {
  kReq = 1,
  kMra,
  kRep,
  kRtu,
  kRej,
  kDreq,
  kDrep,
  kSidrReq,
  kSidrRep,
};

// IB CM reject reasons (IBTA 12.6.7.2) that a peer reports here.
constexpr uint8_t kRejInvalidServiceId = 8;  // no listener
constexpr uint8_t kRejConsumer = 28;         // rdma_reject, or destroyed before accept
constexpr uint8_t kSidrUnsupported = 1;      // SIDR REP status: no such service

// Private data limits of the IB CM, after rdma_cm's own header in REQ/SIDR REQ.
constexpr uint8_t kReqPrivate = 56;
constexpr uint8_t kRepPrivate = 196;
constexpr uint8_t kRejPrivate = 148;
constexpr uint8_t kSidrReqPrivate = 180;
constexpr uint8_t kSidrRepPrivate = 136;
constexpr uint8_t kRtuPrivate = 224;

struct Msg {
  MsgType type;
  uint32_t qpn;
  uint32_t psn;
  uint32_t qkey;
  uint64_t guid;
  uint8_t gid[16];
  uint16_t lid;
  uint16_t ps;
  uint8_t qp_type;
  uint8_t responder_resources;
  uint8_t initiator_depth;
  uint8_t flow_control;
  uint8_t retry_count;
  uint8_t rnr_retry_count;
  uint8_t srq;
  uint8_t reason;    // REJ reason, SIDR REP status
  sockaddr_in6 src;  // of the active side (sockaddr_in when AF_INET)
  sockaddr_in6 dst;
  uint8_t private_data_len;
  uint8_t private_data[256];
};

// The abstract AF_UNIX address of (port space, port) on this process's fabric.
sockaddr_un port_address(uint16_t ps, uint16_t port, socklen_t *len);

// Sends one message; false when the peer is gone.
bool send_msg(int fd, const Msg &m);

// Whether an IPv4/IPv6 address is one of this host's (so reaches the fabric):
// loopback, any interface address, or the wildcard (which means loopback).
bool is_local_address(const sockaddr *a);
bool is_wildcard(const sockaddr *a);
// A group address: resolves (to this host's device), joining is refused.
bool is_multicast(const sockaddr *a);
uint16_t port_of(const sockaddr *a);
void set_port(sockaddr *a, uint16_t port);
socklen_t addr_len(const sockaddr *a);
// Whether a listener bound to `bound` takes a connection addressed to `dst`.
bool listener_matches(const sockaddr *bound, const sockaddr *dst);

}  // namespace pcientb::cm
