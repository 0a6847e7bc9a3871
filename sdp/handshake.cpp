// Who gets SDP, and the negotiation over the real TCP connection.
//
// A program without the layer must never see a byte of the negotiation, whichever side it
// is on. So the ends learn about each other before any byte is sent, through names only
// processes of the same fabric on this host can see (abstract AF_UNIX names, which vanish
// with their process):
//   - a listener the rules give to SDP holds  pcientb-sdp/<fabric>/L/<port>;
//   - a client that finds that name holds, before connecting, pcientb-sdp/<fabric>/C/<the
//     inode of its socket>; the server finds that inode for each accepted connection in the
//     kernel's socket table (sock_diag), by the connection's addresses and ports.
// A client without the name of its server's port stays on TCP without a word; a server that
// accepts a connection without the client's name does too. Otherwise the client sends Hello
// (its QP, ring and ack slot) right after connect; the server answers Accept (the same, its
// QP ready to receive) or Decline (reason); the client answers Confirm (ready too) or Abandon.
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <vector>

#include "sdp.hpp"

namespace sdp {
namespace {

constexpr char kMagic[8] = {'P', 'C', 'I', 'E', 'S', 'D', 'P', '1'};
enum MsgType : uint32_t { kHello = 1, kAccept = 2, kDecline = 3, kConfirm = 4, kAbandon = 5 };

struct HsMsg {
  char magic[8];
  uint32_t type;
  uint32_t reason;  // Decline/Abandon: an errno value
  char fabric[64];
  LinkInfo info;
};

constexpr int kHandshakeMs = 5000;

uint16_t port_of(const sockaddr *sa) {
  return ntohs(sa->sa_family == AF_INET ? reinterpret_cast<const sockaddr_in *>(sa)->sin_port
                                        : reinterpret_cast<const sockaddr_in6 *>(sa)->sin6_port);
}

// A name of the fabric: kind 'L' (a listener) or 'C' (a client) and the inode of its socket.
socklen_t mark_name(sockaddr_un &un, char kind, uint64_t key) {
  un = sockaddr_un{};
  un.sun_family = AF_UNIX;
  int n = snprintf(un.sun_path + 1, sizeof un.sun_path - 1, "pcientb-sdp/%s/%c/%llu",
                   config().fabric_tag.c_str(), kind, (unsigned long long)key);
  return socklen_t(offsetof(sockaddr_un, sun_path) + 1 + n);
}

// Holds the name; -1 if someone else holds it already (or on error).
int hold_name(char kind, uint64_t key) {
  sockaddr_un un;
  socklen_t len = mark_name(un, kind, key);
  int fd = real().socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  if (real().bind(fd, reinterpret_cast<sockaddr *>(&un), len) != 0) {
    real().close(fd);
    return -1;
  }
  return fd;
}

bool name_held(char kind, uint64_t key) {
  sockaddr_un un;
  socklen_t len = mark_name(un, kind, key);
  int fd = real().socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  bool held = real().connect(fd, reinterpret_cast<sockaddr *>(&un), len) == 0;
  real().close(fd);
  return held;
}

uint64_t socket_inode(int fd) {
  struct stat st;
  return fstat(fd, &st) == 0 ? uint64_t(st.st_ino) : 0;
}

// Fills a sock_diag lookup for the socket whose own end is `from` and whose peer is `to`, in
// `family` (an IPv4 end may be seen as v4-mapped IPv6 by the other side, and the other way).
bool diag_id(inet_diag_req_v2 &r, int family, const sockaddr_storage &from,
             const sockaddr_storage &to) {
  r.sdiag_family = uint8_t(family);
  r.id.idiag_sport = htons(port_of(reinterpret_cast<const sockaddr *>(&from)));
  r.id.idiag_dport = htons(port_of(reinterpret_cast<const sockaddr *>(&to)));
  const sockaddr_storage *ends[2] = {&from, &to};
  uint32_t *addrs[2] = {r.id.idiag_src, r.id.idiag_dst};
  for (int i = 0; i < 2; ++i) {
    in6_addr a6{};
    if (ends[i]->ss_family == AF_INET) {
      const in_addr a4 = reinterpret_cast<const sockaddr_in *>(ends[i])->sin_addr;
      if (family == AF_INET) {
        memcpy(addrs[i], &a4, 4);
        continue;
      }
      a6.s6_addr[10] = a6.s6_addr[11] = 0xff;  // ::ffff:a.b.c.d
      memcpy(a6.s6_addr + 12, &a4, 4);
    } else {
      a6 = reinterpret_cast<const sockaddr_in6 *>(ends[i])->sin6_addr;
      if (family == AF_INET) {
        if (!IN6_IS_ADDR_V4MAPPED(&a6)) return false;
        memcpy(addrs[i], a6.s6_addr + 12, 4);
        continue;
      }
    }
    memcpy(addrs[i], &a6, 16);
  }
  return true;
}

// The inode of the TCP socket of this host that the kernel finds for a segment from `from` to
// `to`, looked up in `family`'s table (sock_diag's one-socket lookup: an established socket,
// else the listener that `to` reaches); 0 if none.
uint64_t diag_inode(int nl, int family, const sockaddr_storage &from, const sockaddr_storage &to) {
  struct {
    nlmsghdr h;
    inet_diag_req_v2 r;
  } req{};
  req.h.nlmsg_len = sizeof req;
  req.h.nlmsg_type = SOCK_DIAG_BY_FAMILY;
  req.h.nlmsg_flags = NLM_F_REQUEST;  // one socket, looked up by its addresses
  req.r.sdiag_protocol = IPPROTO_TCP;
  req.r.idiag_states = ~0u;
  req.r.id.idiag_cookie[0] = req.r.id.idiag_cookie[1] = INET_DIAG_NOCOOKIE;
  // The table's view: the socket's own end (`to`) is the source.
  if (!diag_id(req.r, family, to, from)) return 0;
  if (real().sendto(nl, &req, sizeof req, 0, nullptr, 0) != ssize_t(sizeof req)) return 0;
  alignas(nlmsghdr) char buf[1024];
  ssize_t n = real().recvfrom(nl, buf, sizeof buf, 0, nullptr, nullptr);
  const auto *h = reinterpret_cast<const nlmsghdr *>(buf);
  if (n >= ssize_t(NLMSG_LENGTH(sizeof(inet_diag_msg))) && h->nlmsg_type == SOCK_DIAG_BY_FAMILY)
    return static_cast<const inet_diag_msg *>(NLMSG_DATA(h))->idiag_inode;
  return 0;
}

bool is_v4(const sockaddr_storage &a) {
  return a.ss_family == AF_INET ||
         IN6_IS_ADDR_V4MAPPED(&reinterpret_cast<const sockaddr_in6 *>(&a)->sin6_addr);
}

// diag_inode in the family the addresses show first, then in the other (an IPv4 end may be
// a dual-stack IPv6 socket, a v4-mapped one an IPv4 socket).
uint64_t find_inode(const sockaddr_storage &from, const sockaddr_storage &to) {
  const int nl = real().socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
  if (nl < 0) return 0;
  uint64_t ino = 0;
  const bool v4 = is_v4(to);
  for (int family : {v4 ? AF_INET : AF_INET6, v4 ? AF_INET6 : AF_INET})
    if ((ino = diag_inode(nl, family, from, to))) break;
  real().close(nl);
  return ino;
}

// The inode of the socket at the other end of TCP connection `fd` when it is on this host
// (the client's, for an accepted connection); 0 if none.
uint64_t peer_socket_inode(int fd) {
  sockaddr_storage me{}, peer{};
  socklen_t ml = sizeof me, pl = sizeof peer;
  if (getsockname(fd, reinterpret_cast<sockaddr *>(&me), &ml) != 0 ||
      getpeername(fd, reinterpret_cast<sockaddr *>(&peer), &pl) != 0)
    return 0;
  return find_inode(me, peer);
}

// The inode of the listening socket of this host that a connect to `dest` reaches (an address
// of its own, ANY, or a dual-stack IPv6 socket); 0 if none.
uint64_t listener_inode(const sockaddr *dest, socklen_t len) {
  sockaddr_storage to{}, from{};
  memcpy(&to, dest, std::min<size_t>(len, sizeof to));
  from.ss_family = is_v4(to) ? AF_INET : AF_INET6;  // address 0, port 0: no established match
  return find_inode(from, to);
}

// Whether the address is this host's (loopback, any, or an interface address): on the
// emulated fabric those are the peers the fabric reaches.
bool address_is_local(const sockaddr *sa) {
  if (sa->sa_family == AF_INET) {
    uint32_t a = ntohl(reinterpret_cast<const sockaddr_in *>(sa)->sin_addr.s_addr);
    if ((a >> 24) == 127 || a == 0) return true;
  } else {
    const in6_addr &a = reinterpret_cast<const sockaddr_in6 *>(sa)->sin6_addr;
    if (IN6_IS_ADDR_LOOPBACK(&a) || IN6_IS_ADDR_UNSPECIFIED(&a)) return true;
    if (IN6_IS_ADDR_V4MAPPED(&a) &&
        (a.s6_addr[12] == 127 || !memcmp(a.s6_addr + 12, "\0\0\0\0", 4)))
      return true;
  }
  ifaddrs *list = nullptr;
  if (getifaddrs(&list) != 0) return false;
  bool found = false;
  for (ifaddrs *i = list; i && !found; i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != sa->sa_family) continue;
    if (sa->sa_family == AF_INET)
      found = reinterpret_cast<sockaddr_in *>(i->ifa_addr)->sin_addr.s_addr ==
              reinterpret_cast<const sockaddr_in *>(sa)->sin_addr.s_addr;
    else
      found = !memcmp(&reinterpret_cast<sockaddr_in6 *>(i->ifa_addr)->sin6_addr,
                      &reinterpret_cast<const sockaddr_in6 *>(sa)->sin6_addr, 16);
  }
  freeifaddrs(list);
  return found;
}

HsMsg make_msg(MsgType type, const Link *link, int reason) {
  HsMsg m{};
  memcpy(m.magic, kMagic, sizeof kMagic);
  m.type = type;
  m.reason = uint32_t(reason);
  snprintf(m.fabric, sizeof m.fabric, "%s", config().fabric_tag.c_str());
  if (link) m.info = link->local;
  return m;
}

bool send_msg(Sock &s, MsgType type, int reason = 0) {
  HsMsg m = make_msg(type, type == kHello || type == kAccept ? &s.link : nullptr, reason);
  return tcp_write_all(s.fd, &m, sizeof m, kHandshakeMs);
}

// Reads one handshake message if it is all there (or, with wait, when it is; wait_ms < 0:
// for ever). 1: read; 0: not yet; -1: EOF, error or garbage; -2: the peer's first bytes are
// not a handshake message (left unread: they are the program's).
int64_t now_ms() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000 + ts.tv_nsec / 1000000;
}

int read_msg(Sock &s, HsMsg &m, bool wait, int wait_ms = -1) {
  const int64_t end = wait_ms < 0 ? -1 : now_ms() + wait_ms;
  for (;;) {
    ssize_t n = real().recvfrom(s.fd, &m, sizeof m, MSG_PEEK | MSG_DONTWAIT, nullptr, nullptr);
    if (n > 0 && memcmp(m.magic, kMagic, std::min<size_t>(size_t(n), sizeof kMagic)) != 0)
      return -2;
    if (n == ssize_t(sizeof m)) break;
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return -1;
    if (!wait) return 0;
    // No time limit unless asked: the peer sends its part when its program first uses the
    // connection, and giving up here would leave the two ends disagreeing about the stream.
    pollfd p{s.fd, POLLIN, 0};
    const int left = end < 0 ? -1 : int(std::max<int64_t>(0, end - now_ms()));
    if (left == 0) return 0;
    real().poll(&p, 1, left);
  }
  if (!tcp_read_all(s.fd, &m, sizeof m, kHandshakeMs)) return -1;
  if (memcmp(m.magic, kMagic, sizeof kMagic) != 0) {
    errno = EPROTO;
    return -1;
  }
  return 1;
}

// The connection stays on TCP: the layer lets go of it.
void stay_tcp(Sock &s, const char *reason) {
  logf("fd %d (%s): TCP (%s)", s.fd, s.role == Role::kServer ? "server" : "client", reason);
  s.state = State::kCandidate;
  link_destroy(s.link);
  handshake_forget(s);
  s.stats.path = PCIENTB_SDP_PATH_TCP;
  s.reason = reason;
  write_stats(s);
  forget_sock(s);
}

// The link is this process's: a child forked from now on uses the socket as TCP.
void own_link(Sock &s) {
  s.owner = getpid();
  s.link_gen = g_fork_gen.load(std::memory_order_relaxed);
}

void become_sdp(Sock &s) {
  note_sdp_connection();
  s.state = State::kSdp;
  s.stats.path = PCIENTB_SDP_PATH_SDP;
  s.reason = "negotiated";
  handshake_forget(s);
  logf("fd %d (%s): SDP over pcientb0 (QP %u -> %u)", s.fd,
       s.role == Role::kServer ? "server" : "client", s.link.local.qpn, s.link.remote.qpn);
}

}  // namespace

bool tcp_write_all(int fd, const void *buf, size_t len, int timeout_ms) {
  const char *p = static_cast<const char *>(buf);
  while (len) {
    ssize_t n = real().sendto(fd, p, len, MSG_NOSIGNAL | MSG_DONTWAIT, nullptr, 0);
    if (n > 0) {
      p += n;
      len -= size_t(n);
      continue;
    }
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return false;
    pollfd pf{fd, POLLOUT, 0};
    if (real().poll(&pf, 1, timeout_ms) == 0) {
      errno = ETIMEDOUT;
      return false;
    }
  }
  return true;
}

bool tcp_read_all(int fd, void *buf, size_t len, int timeout_ms) {
  char *p = static_cast<char *>(buf);
  while (len) {
    ssize_t n = real().recvfrom(fd, p, len, MSG_DONTWAIT, nullptr, nullptr);
    if (n > 0) {
      p += n;
      len -= size_t(n);
      continue;
    }
    if (n == 0) {
      errno = ECONNRESET;
      return false;
    }
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return false;
    pollfd pf{fd, POLLIN, 0};
    if (real().poll(&pf, 1, timeout_ms) == 0) {
      errno = ETIMEDOUT;
      return false;
    }
  }
  return true;
}

void handshake_listen(Sock &s) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (getsockname(s.fd, reinterpret_cast<sockaddr *>(&ss), &len) != 0) return;
  const char *reason = "";
  s.state = State::kListener;
  s.role = Role::kServer;
  if (!rules_allow(Role::kServer, reinterpret_cast<sockaddr *>(&ss), len, &reason)) {
    s.reason = reason;
    return;
  }
  // The mark names the listening socket, so that a client finds out whether the listener its
  // connect reaches is this one (not another of the same port on another address).
  if (!s.ino) s.ino = socket_inode(s.fd);
  if (s.mark_fd < 0) s.mark_fd = hold_name('L', s.ino);  // -1: a process sharing it holds it
  logf("listener fd %d on port %u takes SDP", s.fd, port_of(reinterpret_cast<sockaddr *>(&ss)));
  s.reason = "listener";
}

void handshake_before_connect(Sock &s, const sockaddr *addr, socklen_t len) {
  s.role = Role::kClient;
  const char *reason = "";
  if (addr->sa_family != AF_INET && addr->sa_family != AF_INET6) return;
  if (!rules_allow(Role::kClient, addr, len, &reason)) {
    s.reason = reason;
  } else if (!address_is_local(addr)) {
    s.reason = "not_on_fabric";
  } else if (!name_held('L', listener_inode(addr, len))) {
    s.reason = "peer_no_sdp";  // the listener it reaches has no layer on this fabric
  } else if (!link_device_usable()) {
    // Without a device the client would have to take back its offer with an Abandon, and a
    // server that accepts after the marker is gone would read that as the program's bytes.
    s.reason = "no_device";
  } else {
    // The marker names this socket's inode: the server finds it by the connection's ends.
    if (!s.ino) s.ino = socket_inode(s.fd);
    s.mark_fd = hold_name('C', s.ino);
    s.reason = s.mark_fd >= 0 ? "" : "marker_taken";
  }
}

void handshake_after_connect(Sock &s) {
  if (s.mark_fd < 0) {
    stay_tcp(s, *s.reason ? s.reason : "peer_no_sdp");
    return;
  }
  s.state = State::kClientPending;  // Hello at the first use; the marker tells the server
}

void handshake_accepted(Sock &s) {
  s.role = Role::kServer;
  const uint64_t client = peer_socket_inode(s.fd);
  if (!client || !name_held('C', client)) {
    stay_tcp(s, "peer_no_sdp");
    return;
  }
  s.state = State::kServerPending;  // the client sends Hello at its first use
}

namespace {

// Client, first use: the QP and Hello.
void send_hello(Sock &s) {
  if (!link_create(s.link, &s.sleepers)) {
    int e = errno;
    logf("fd %d: verbs setup failed: %s", s.fd, strerror(e));
    send_msg(s, kAbandon, e);  // the server waits for a message: tell it
    stay_tcp(s, "verbs_setup_failed");
    return;
  }
  own_link(s);
  if (!send_msg(s, kHello)) {
    stay_tcp(s, "hello_failed");
    return;
  }
  s.state = State::kClientHello;
}

// Server: the client's Hello has arrived.
void take_hello(Sock &s, const HsMsg &m) {
  if (m.type != kHello) {
    // The client announced itself, then sent something else: it gave up (Abandon).
    stay_tcp(s, m.type == kAbandon ? "peer_abandoned" : "bad_hello");
    return;
  }
  if (strncmp(m.fabric, config().fabric_tag.c_str(), sizeof m.fabric) != 0) {
    send_msg(s, kDecline, EXDEV);
    stay_tcp(s, "other_fabric");
    return;
  }
  if (m.info.uid != getuid()) {  // e.g. a server's worker that dropped root: another fabric
    send_msg(s, kDecline, EACCES);
    stay_tcp(s, "other_user");
    return;
  }
  if (link_create(s.link, &s.sleepers)) own_link(s);
  if (!s.link.qp || !(s.link.remote = m.info, link_connect(s.link))) {
    int e = errno;
    logf("fd %d: verbs setup failed: %s", s.fd, strerror(e));
    send_msg(s, kDecline, e);
    stay_tcp(s, "verbs_setup_failed");
    return;
  }
  if (!send_msg(s, kAccept)) {
    stay_tcp(s, "accept_failed");
    return;
  }
  s.state = State::kServerWait;
}

// Client: Accept or Decline has arrived.
void take_answer(Sock &s, const HsMsg &m) {
  if (m.type != kAccept) {
    stay_tcp(s, m.reason == EXDEV    ? "other_fabric"
                : m.reason == EACCES ? "other_user"
                                     : "declined");
    return;
  }
  if (m.info.uid != getuid()) {
    send_msg(s, kAbandon, EACCES);
    stay_tcp(s, "other_user");
    return;
  }
  s.link.remote = m.info;
  if (!link_connect(s.link)) {
    send_msg(s, kAbandon, errno);
    stay_tcp(s, "verbs_setup_failed");
    return;
  }
  if (!send_msg(s, kConfirm)) {
    stay_tcp(s, "confirm_failed");
    return;
  }
  become_sdp(s);
}

}  // namespace

bool handshake_progress(Sock &s) {
  for (;;) {
    if (s.state == State::kClientPending) {
      send_hello(s);
      continue;
    }
    if (s.state != State::kServerPending && s.state != State::kClientHello &&
        s.state != State::kServerWait)
      return true;  // decided: SDP, or TCP (the layer has let go)
    HsMsg m;
    int r = read_msg(s, m, false);
    if (r == 0) {
      errno = EAGAIN;
      return false;
    }
    if (r == -2) {  // a peer that knows nothing of the handshake (a program after exec)
      stay_tcp(s, "peer_sent_data");
      return true;
    }
    if (r < 0) {
      stay_tcp(s, "handshake_failed");  // the program sees what the kernel socket says
      return true;
    }
    if (s.state == State::kServerPending) {
      take_hello(s, m);
    } else if (s.state == State::kClientHello) {
      take_answer(s, m);
    } else if (m.type == kConfirm) {
      become_sdp(s);
    } else {
      stay_tcp(s, "peer_abandoned");
    }
  }
}

namespace {

constexpr int kExecWaitMs = 2000;

// Whether fd is an inherited TCP socket of this host (and its domain).
bool inet_stream(int fd, int *domain, bool *listening) {
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) return false;
  int type = 0, acc = 0;
  socklen_t l = sizeof *domain;
  if (real().getsockopt(fd, SOL_SOCKET, SO_DOMAIN, domain, &l) != 0 ||
      (*domain != AF_INET && *domain != AF_INET6))
    return false;
  l = sizeof type;
  if (real().getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &l) != 0 || type != SOCK_STREAM)
    return false;
  l = sizeof acc;
  real().getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &acc, &l);
  *listening = acc != 0;
  return true;
}

bool nonblocking_fd(int fd) {
  int fl = real().fcntl(fd, F_GETFL, 0);
  return fl >= 0 && (fl & O_NONBLOCK);
}

// The socket inode a client marker of this fabric that fd holds names; 0 if it holds none.
uint64_t marker_inode(int fd) {
  sockaddr_un un{};
  socklen_t len = sizeof un;
  if (getsockname(fd, reinterpret_cast<sockaddr *>(&un), &len) != 0 || un.sun_family != AF_UNIX ||
      len <= offsetof(sockaddr_un, sun_path) + 1 || un.sun_path[0] != '\0')
    return 0;
  sockaddr_un want;
  socklen_t wlen = mark_name(want, 'C', 0);  // ".../C/0": compare the part before the inode
  const size_t prefix = wlen - offsetof(sockaddr_un, sun_path) - 1;
  const size_t have = len - offsetof(sockaddr_un, sun_path);
  if (have <= prefix || memcmp(un.sun_path, want.sun_path, prefix) != 0) return 0;
  std::string digits(un.sun_path + prefix, have - prefix);
  return strtoull(digits.c_str(), nullptr, 10);
}

}  // namespace

bool handshake_before_exec(Sock &s) {
  HsMsg m;
  switch (s.state) {
    case State::kClientPending:
      // Hello never went: the server reads Abandon where it waits for it, and stays on TCP.
      // The marker goes into the new image with the socket (process_start ties them again):
      // a server that accepts later must still find it, to read the Abandon.
      send_msg(s, kAbandon, 0);
      if (s.mark_fd >= 0 && real().fcntl(s.mark_fd, F_SETFD, 0) == 0) s.mark_fd = -1;
      stay_tcp(s, "exec");
      return false;
    case State::kClientHello:
      if (read_msg(s, m, true, kExecWaitMs) == 1 && m.type == kAccept)
        send_msg(s, kAbandon, 0);
      else
        logf("fd %d: exec before the server answered Hello: the new image may read it", s.fd);
      stay_tcp(s, "exec");
      return false;
    case State::kServerWait:
      if (read_msg(s, m, true, kExecWaitMs) == 1 && m.type == kConfirm) {
        become_sdp(s);
        return true;
      }
      stay_tcp(s, "exec");
      return false;
    default:
      return false;  // a server still waiting for Hello: the new image takes it up
  }
}

void handshake_adopt(const std::vector<int> &fds) {
  std::vector<std::pair<int, uint64_t>> markers;
  for (int fd : fds)
    if (uint64_t ino = marker_inode(fd)) markers.emplace_back(fd, ino);
  // Descriptors of one socket (dup2 onto stdin and stdout) are one socket of the layer.
  std::vector<std::pair<ino_t, std::shared_ptr<Sock>>> seen;
  for (int fd : fds) {
    int domain = 0;
    bool listening = false;
    if (!inet_stream(fd, &domain, &listening)) continue;
    struct stat st;
    fstat(fd, &st);
    auto same =
        std::find_if(seen.begin(), seen.end(), [&](auto &p) { return p.first == st.st_ino; });
    if (same != seen.end()) {
      if (same->second) alias_fd(fd, same->second);
      continue;
    }
    seen.emplace_back(st.st_ino, nullptr);
    if (listening) {  // as listen() marks it (the previous image's mark went with it)
      if (std::shared_ptr<Sock> s = track_fd(fd, domain, nonblocking_fd(fd))) {
        handshake_listen(*s);
        seen.back().second = s;
      }
      continue;
    }
    auto mk = std::find_if(markers.begin(), markers.end(),
                           [&](auto &p) { return p.second == uint64_t(st.st_ino); });
    if (mk != markers.end()) {
      // A client connection whose previous image abandoned the handshake: TCP, with the
      // marker held until it closes (the server may not have looked yet).
      if (std::shared_ptr<Sock> s = track_fd(fd, domain, nonblocking_fd(fd))) {
        real().fcntl(mk->first, F_SETFD, FD_CLOEXEC);
        s->mark_fd = mk->first;
        s->role = Role::kClient;
        s->reason = "exec";
        seen.back().second = s;
      }
      continue;
    }
    sockaddr_storage peer{};
    socklen_t plen = sizeof peer;
    if (getpeername(fd, reinterpret_cast<sockaddr *>(&peer), &plen) != 0 ||
        !address_is_local(reinterpret_cast<sockaddr *>(&peer)))
      continue;
    std::shared_ptr<Sock> s = track_fd(fd, domain, nonblocking_fd(fd));
    if (!s) continue;
    seen.back().second = s;
    const uint64_t client = peer_socket_inode(fd);
    if (client && name_held('C', client)) {
      // Accepted by the previous image, and its client (with the layer) waits to negotiate.
      s->role = Role::kServer;
      s->state = State::kServerPending;
      logf("fd %d: inherited with a client negotiating on it: taken up", fd);
    } else {
      // Maybe an SDP connection of an ancestor (system(), popen(), posix_spawn(), a fork()ed
      // child's exec): if this program uses it, the ancestors are asked to hand it back.
      s->ask_ancestors = true;
    }
  }
}

void handshake_forget(Sock &s) {
  if (s.mark_fd >= 0) real().close(s.mark_fd);
  s.mark_fd = -1;
}

}  // namespace sdp
