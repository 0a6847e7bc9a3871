// Ids, channels and events of the rdma_cm command interface, and the CM
// protocol state machine (cm.hpp, wire.hpp).
//
// One lock guards everything: commands are rare and short. The service thread
// waits in epoll without it, for messages from peers, listeners' new
// connections, channels whose program side was closed, and deadlines.
#include "cm.hpp"

#include <fcntl.h>
#include <infiniband/verbs.h>
#include <poll.h>
#include <pthread.h>
#include <rdma/rdma_user_cm.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "device.hpp"
#include "wire.hpp"

namespace pcientb::cm {

namespace {

using Clock = std::chrono::steady_clock;

// librdmacm's events (rdma_cma.h), as the kernel numbers them.
enum : uint32_t {
  kEvAddrResolved = 0,
  kEvAddrError = 1,
  kEvRouteResolved = 2,
  kEvRouteError = 3,
  kEvConnectRequest = 4,
  kEvConnectResponse = 5,
  kEvConnectError = 6,
  kEvUnreachable = 7,
  kEvRejected = 8,
  kEvEstablished = 9,
  kEvDisconnected = 10,
  kEvDeviceRemoval = 11,
};

constexpr uint32_t kUdpQkey = 0x01234567;               // RDMA_UDP_QKEY
constexpr auto kReqTimeout = std::chrono::seconds(5);   // no MRA/REP: unreachable
constexpr auto kDreqTimeout = std::chrono::seconds(2);  // no DREP: disconnected anyway
// A REQ to a port nobody listens on yet waits this long for a listener before it is
// rejected. Programs that sync out of band and then listen and connect at once
// (perftest -R) race on hardware too, where address and route resolution give the
// listener milliseconds; here resolution is instant.
constexpr auto kListenerGrace = std::chrono::seconds(1);
constexpr auto kListenerRetry = std::chrono::milliseconds(5);
constexpr int kBacklog = 1024;

enum class St {
  kIdle,
  kBound,
  kAddrResolved,
  kRouteResolved,
  kListen,
  kReqSent,  // active: REQ (or SIDR REQ) sent
  kReqRcvd,  // passive: CONNECT_REQUEST reported, not yet accepted
  kRepSent,  // passive: accepted, waiting for RTU
  kRepRcvd,  // active: CONNECT_RESPONSE reported, waiting for the program's RTU
  kConnected,
  kDreqSent,
  kDisconnected,  // also: rejected, unreachable; the id can only be destroyed
};

struct Channel;

struct Id {
  uint32_t handle = 0;
  uint64_t uid = 0;
  Channel *ch = nullptr;
  uint16_t ps = 0;
  uint8_t qp_type = 0;
  St st = St::kIdle;
  sockaddr_in6 src{};  // sockaddr_in when AF_INET
  sockaddr_in6 dst{};
  bool has_device = false;
  int port_fd = -1;  // holds the port's name; listens when st == kListen
  int conn_fd = -1;  // to the peer, for this connection's CM messages
  bool peer_gone = false;
  Clock::time_point deadline{};     // {} = none
  std::unique_ptr<Msg> unsent_req;  // kReqSent, no listener yet: sent again at the deadline
  Clock::time_point listener_wait_end{};
  uint32_t events_reported = 0;
  // Local QP, as given to CONNECT or ACCEPT.
  uint32_t qpn = 0, psn = 0;
  uint8_t resp_res = 0, init_depth = 0, retry_count = 7, rnr_retry_count = 7;
  // The peer's.
  uint32_t remote_qpn = 0, remote_psn = 0, remote_qkey = 0;
  uint16_t remote_lid = 0;
  uint8_t remote_gid[16] = {};
  bool remote_known = false;
};

struct Event {
  rdma_ucm_event_resp resp{};
  uint32_t counted_on = 0;  // whose events_reported grows when it is read
  uint32_t child = 0;       // CONNECT_REQUEST: the new id
};

struct Channel {
  uint64_t serial = 0;
  int hub = -1;            // our end of the socketpair
  ino_t ino = 0;           // of the program's end
  bool token = false;      // one byte is in the program's end (events queued)
  bool inherited = false;  // a forked child's copy of its parent's channel
  std::deque<Event> events;
};

// epoll keys: kind in the top byte.
enum Kind : uint64_t { kWake = 0, kHub = 1, kListener = 2, kConn = 3, kPending = 4 };
uint64_t key(Kind k, uint64_t v) {
  return (static_cast<uint64_t>(k) << 56) | v;
}

struct Pending {  // a connection accepted by a listener, its REQ not read yet
  int fd = -1;
  uint32_t listener = 0;
};

// An event of address or route resolution, reported by the service thread as
// the kernel reports it from its work queue: after the command has returned.
// librdmacm writes the id's route after RESOLVE_IP's write() returns, while a
// program's event thread may already read it on ADDR_RESOLVED (rping does).
struct Deferred {
  uint32_t handle;
  uint32_t event;
  int status;
};

struct State {
  std::mutex mu;
  std::deque<Deferred> deferred;
  std::map<uint32_t, std::unique_ptr<Id>> ids;
  std::map<uint64_t, std::unique_ptr<Channel>> channels;
  std::map<uint64_t, Pending> pending;
  uint32_t next_handle = 1;
  uint64_t next_serial = 1;
  int epfd = -1;
  int wake_fd = -1;
  bool service_running = false;
  std::mt19937 rng{std::random_device{}()};
};

State &state() {
  static auto *s = new State;  // never destroyed: atexit handlers may still use it
  return *s;
}

// fd -> inode of channels the program holds, read without any lock by
// write(); and the inodes of all channels, under a lock of their own (write()
// may come from code this layer calls with the state locked).
constexpr int kMaxFd = 1 << 16;
std::atomic<ino_t> g_fd_ino[kMaxFd];
std::atomic<bool> g_any_channel{false};
struct Inodes {
  std::mutex mu;
  std::vector<ino_t> live;
};

// Never destroyed: the service thread may close a channel during exit().
Inodes &inodes() {
  static auto *i = new Inodes;
  return *i;
}

bool channel_inode(ino_t ino) {
  const std::lock_guard<std::mutex> g(inodes().mu);
  return std::find(inodes().live.begin(), inodes().live.end(), ino) != inodes().live.end();
}

// --- helpers ------------------------------------------------------------------

// PCIENTB_CM_TRACE=1: every command, and what peers do, on stderr.
bool tracing() {
  static const bool on = [] {
    const char *t = std::getenv("PCIENTB_CM_TRACE");
    return t != nullptr && *t != '\0' && *t != '0';
  }();
  return on;
}

// The kernel's fstat, not the interposed one (which asks is_channel()).
ino_t inode_of(int fd) {
  struct stat st {};
  if (syscall(SYS_fstat, fd, &st) != 0 || !S_ISSOCK(st.st_mode)) return 0;
  return st.st_ino;
}

Channel *channel_of_fd(State &s, int fd) {
  const ino_t ino = inode_of(fd);
  if (ino == 0) return nullptr;
  for (auto &[serial, ch] : s.channels)
    if (ch->ino == ino) return ch.get();
  return nullptr;
}

void watch(State &s, int fd, uint64_t k) {
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP;
  ev.data.u64 = k;
  epoll_ctl(s.epfd, EPOLL_CTL_ADD, fd, &ev);
}

void close_fd(State &s, int &fd) {
  if (fd < 0) return;
  epoll_ctl(s.epfd, EPOLL_CTL_DEL, fd, nullptr);
  close(fd);
  fd = -1;
}

void wake(State &s) {
  const uint64_t one = 1;
  if (s.wake_fd >= 0) (void)!::write(s.wake_fd, &one, sizeof one);
}

// The program's end is readable exactly while events are queued.
void set_token(Channel &ch, bool want, int app_fd) {
  if (ch.token == want) return;
  char b = 1;
  if (want) {
    if (::send(ch.hub, &b, 1, MSG_DONTWAIT | MSG_NOSIGNAL) == 1) ch.token = true;
  } else if (app_fd >= 0 && ::recv(app_fd, &b, 1, MSG_DONTWAIT) == 1) {
    ch.token = false;
  }
}

Event &push(Id &id, uint32_t event, int status) {
  Channel &ch = *id.ch;
  Event &e = ch.events.emplace_back();
  e.resp.uid = id.uid;
  e.resp.id = id.handle;
  e.resp.event = event;
  e.resp.status = static_cast<uint32_t>(status);
  e.counted_on = id.handle;
  set_token(ch, true, -1);
  return e;
}

void defer(State &s, Id &id, uint32_t event, int status) {
  s.deferred.push_back(Deferred{id.handle, event, status});
  wake(s);
}

void copy_private(uint8_t *dst_data, uint8_t *dst_len, const Msg &m) {
  *dst_len = m.private_data_len;
  std::memcpy(dst_data, m.private_data, m.private_data_len);
}

void fill_conn(rdma_ucm_conn_param &p, const Msg &m, bool swap) {
  p.qp_num = m.qpn;
  p.srq = m.srq;
  // What the peer offers as responder is what this side may initiate.
  p.responder_resources = swap ? m.initiator_depth : m.responder_resources;
  p.initiator_depth = swap ? m.responder_resources : m.initiator_depth;
  p.flow_control = m.flow_control;
  p.retry_count = m.retry_count;
  p.rnr_retry_count = m.rnr_retry_count;
  p.valid = 1;
  copy_private(p.private_data, &p.private_data_len, m);
}

void fill_ah(ib_uverbs_ah_attr &ah, uint16_t lid, const uint8_t *gid) {
  ah = ib_uverbs_ah_attr{};
  ah.dlid = lid;
  ah.port_num = 1;
  std::memcpy(ah.grh.dgid, gid, sizeof ah.grh.dgid);
  ah.grh.hop_limit = 1;
}

void fill_ud(rdma_ucm_ud_param &p, const Msg &m) {
  p.qp_num = m.qpn;
  p.qkey = m.qkey;
  fill_ah(p.ah_attr, m.lid, m.gid);
  copy_private(p.private_data, &p.private_data_len, m);
}

void learn_remote(Id &id, const Msg &m) {
  id.remote_qpn = m.qpn;
  id.remote_psn = m.psn;
  id.remote_qkey = m.qkey;
  id.remote_lid = m.lid;
  std::memcpy(id.remote_gid, m.gid, sizeof id.remote_gid);
  id.remote_known = true;
}

Msg make_msg(const Id &id, MsgType t) {
  Msg m{};
  m.type = t;
  m.qpn = id.qpn;
  m.psn = id.psn;
  m.ps = id.ps;
  m.qp_type = id.qp_type;
  m.responder_resources = id.resp_res;
  m.initiator_depth = id.init_depth;
  m.retry_count = id.retry_count;
  m.rnr_retry_count = id.rnr_retry_count;
  if (const Device *d = local_device()) {
    m.lid = d->lid;
    m.guid = d->guid;
    std::memcpy(m.gid, d->gid, sizeof m.gid);
  }
  return m;
}

bool is_ud(const Id &id) {
  return id.qp_type == IBV_QPT_UD;
}

// Drops the connection to the peer, telling it why when it is still there.
void hang_up(State &s, Id &id, MsgType why, uint8_t reason) {
  if (id.conn_fd < 0) return;
  Msg m = make_msg(id, why);
  m.reason = reason;
  if (!id.peer_gone) (void)send_msg(id.conn_fd, m);
  close_fd(s, id.conn_fd);
}

// An id leaves: the peer hears of it as from a destroyed kernel id.
void release_id(State &s, Id &id) {
  switch (id.st) {
    case St::kReqRcvd:
    case St::kRepSent:
      if (is_ud(id))
        hang_up(s, id, MsgType::kSidrRep, kSidrUnsupported);
      else
        hang_up(s, id, MsgType::kRej, kRejConsumer);
      break;
    case St::kConnected:
    case St::kRepRcvd:
      hang_up(s, id, MsgType::kDreq, 0);
      break;
    default:
      break;
  }
  close_fd(s, id.conn_fd);
  close_fd(s, id.port_fd);
}

void destroy_id(State &s, uint32_t handle, int app_fd);

// Events of `handle` leave the queue; a CONNECT_REQUEST's new id with them.
void drop_events(State &s, Channel &ch, uint32_t handle, int app_fd) {
  std::vector<uint32_t> orphans;
  std::erase_if(ch.events, [&](const Event &e) {
    if (e.resp.id != handle && e.counted_on != handle) return false;
    if (e.child != 0 && e.child != handle) orphans.push_back(e.child);
    return true;
  });
  if (ch.events.empty()) set_token(ch, false, app_fd);
  for (uint32_t c : orphans) destroy_id(s, c, app_fd);
}

void destroy_id(State &s, uint32_t handle, int app_fd) {
  auto it = s.ids.find(handle);
  if (it == s.ids.end()) return;
  std::unique_ptr<Id> id = std::move(it->second);
  s.ids.erase(it);
  release_id(s, *id);
  drop_events(s, *id->ch, handle, app_fd);
}

void destroy_channel(State &s, uint64_t serial) {
  auto it = s.channels.find(serial);
  if (it == s.channels.end()) return;
  Channel *ch = it->second.get();
  std::vector<uint32_t> handles;
  for (auto &[h, id] : s.ids)
    if (id->ch == ch) handles.push_back(h);
  for (uint32_t h : handles) destroy_id(s, h, -1);
  close_fd(s, ch->hub);
  {
    const std::lock_guard<std::mutex> g(inodes().mu);
    std::erase(inodes().live, ch->ino);
  }
  s.channels.erase(it);
}

// Reserves (ps, port) fabric-wide; port 0: an ephemeral one. 0 or an errno.
int reserve_port(State &s, Id &id, sockaddr *addr) {
  int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return errno;
  uint16_t port = port_of(addr);
  const bool ephemeral = port == 0;
  std::uniform_int_distribution<int> pick(32768, 60999);
  for (int tries = 0; tries < 1000; ++tries) {
    if (ephemeral) port = static_cast<uint16_t>(pick(s.rng));
    socklen_t len = 0;
    sockaddr_un name = port_address(id.ps, port, &len);
    if (bind(fd, reinterpret_cast<sockaddr *>(&name), len) == 0) {
      set_port(addr, port);
      id.port_fd = fd;
      return 0;
    }
    if (errno != EADDRINUSE || !ephemeral) break;
  }
  const int err = errno;
  close(fd);
  return err;
}

// BIND_IP / BIND: 0 or an errno.
int bind_id(State &s, Id &id, const sockaddr *addr) {
  if (addr->sa_family == AF_IB) return EAFNOSUPPORT;
  if (addr->sa_family != AF_INET && addr->sa_family != AF_INET6) return EAFNOSUPPORT;
  if (id.st != St::kIdle) return EINVAL;
  if (!is_local_address(addr)) return EADDRNOTAVAIL;
  sockaddr_in6 a{};
  std::memcpy(&a, addr, addr_len(addr));
  if (const int err = reserve_port(s, id, reinterpret_cast<sockaddr *>(&a)); err != 0) return err;
  id.src = a;
  id.has_device = !is_wildcard(addr) && local_device() != nullptr;
  id.st = St::kBound;
  return 0;
}

sockaddr_in6 loopback_of(int family) {
  sockaddr_in6 a{};
  if (family == AF_INET) {
    auto *v4 = reinterpret_cast<sockaddr_in *>(&a);
    v4->sin_family = AF_INET;
    v4->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  } else {
    a.sin6_family = AF_INET6;
    a.sin6_addr = in6addr_loopback;
  }
  return a;
}

// RESOLVE_IP / RESOLVE_ADDR: 0 or an errno; the result comes as an event.
int resolve_addr(State &s, Id &id, const sockaddr *src, const sockaddr *dst) {
  if (dst->sa_family == AF_IB || (src != nullptr && src->sa_family == AF_IB)) return EAFNOSUPPORT;
  if (dst->sa_family != AF_INET && dst->sa_family != AF_INET6) return EAFNOSUPPORT;
  if (id.st != St::kIdle && id.st != St::kBound) return EINVAL;
  if (!(is_local_address(dst) || is_multicast(dst)) || local_device() == nullptr) {
    defer(s, id, kEvAddrError, -EHOSTUNREACH);
    return 0;
  }
  sockaddr_in6 d{};
  std::memcpy(&d, dst, addr_len(dst));
  if (is_wildcard(dst)) {  // as the kernel: the wildcard is this host
    const uint16_t port = port_of(dst);
    d = loopback_of(dst->sa_family);
    set_port(reinterpret_cast<sockaddr *>(&d), port);
  }
  if (id.st == St::kIdle) {
    sockaddr_in6 a{};
    if (src != nullptr && (src->sa_family == AF_INET || src->sa_family == AF_INET6)) {
      std::memcpy(&a, src, addr_len(src));
    } else if (is_multicast(dst)) {
      a = loopback_of(dst->sa_family);  // a group is joined from this host
    } else {
      a = d;  // a local destination is reached from itself
      set_port(reinterpret_cast<sockaddr *>(&a), 0);
    }
    if (const int err = bind_id(s, id, reinterpret_cast<sockaddr *>(&a)); err != 0) return err;
  }
  if (is_wildcard(reinterpret_cast<sockaddr *>(&id.src))) {
    const uint16_t port = port_of(reinterpret_cast<sockaddr *>(&id.src));
    id.src = d;
    set_port(reinterpret_cast<sockaddr *>(&id.src), port);
  }
  id.dst = d;
  id.has_device = true;
  id.st = St::kAddrResolved;
  defer(s, id, kEvAddrResolved, 0);
  return 0;
}

// No listener has the port (or its backlog is full): the REQ is sent again until
// the grace ends, then answered as by a CM with no such service.
void retry_or_reject(Id &id) {
  const auto now = Clock::now();
  if (now < id.listener_wait_end) {
    id.deadline = std::min(now + kListenerRetry, id.listener_wait_end);
    return;
  }
  id.unsent_req.reset();
  id.deadline = {};
  id.st = St::kDisconnected;
  if (is_ud(id))
    push(id, kEvUnreachable, kSidrUnsupported);
  else
    push(id, kEvRejected, kRejInvalidServiceId);
}

// Nonzero only when no socket could be made.
int send_request(State &s, Id &id) {
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return errno;
  socklen_t len = 0;
  sockaddr_un name = port_address(id.ps, port_of(reinterpret_cast<sockaddr *>(&id.dst)), &len);
  if (connect(fd, reinterpret_cast<sockaddr *>(&name), len) == 0 && send_msg(fd, *id.unsent_req)) {
    id.unsent_req.reset();
    id.conn_fd = fd;
    watch(s, fd, key(kConn, id.handle));
    id.deadline = Clock::now() + kReqTimeout;
    return 0;
  }
  close(fd);
  retry_or_reject(id);
  return 0;
}

int connect_id(State &s, Id &id, const rdma_ucm_conn_param &p) {
  if (id.st != St::kRouteResolved) return EINVAL;
  const uint8_t limit = is_ud(id) ? kSidrReqPrivate : kReqPrivate;
  if (p.private_data_len > limit) return EINVAL;
  id.qpn = p.qp_num;
  id.psn = s.rng() & 0xffffff;
  id.resp_res = p.responder_resources;
  id.init_depth = p.initiator_depth;
  id.retry_count = p.retry_count;
  id.rnr_retry_count = p.rnr_retry_count;

  Msg m = make_msg(id, is_ud(id) ? MsgType::kSidrReq : MsgType::kReq);
  m.flow_control = p.flow_control;
  m.srq = p.srq;
  m.src = id.src;
  m.dst = id.dst;
  m.private_data_len = p.private_data_len;
  std::memcpy(m.private_data, p.private_data, p.private_data_len);

  id.unsent_req = std::make_unique<Msg>(m);
  id.listener_wait_end = Clock::now() + kListenerGrace;
  id.st = St::kReqSent;
  if (const int err = send_request(s, id); err != 0) {
    id.unsent_req.reset();
    id.st = St::kRouteResolved;
    return err;
  }
  wake(s);
  return 0;
}

int accept_id(State &s, Id &id, const rdma_ucm_accept &cmd) {
  if (id.st == St::kRepRcvd) {  // the active side's RTU (librdmacm sends it as ACCEPT)
    Msg m = make_msg(id, MsgType::kRtu);
    id.st = St::kConnected;
    if (id.peer_gone || !send_msg(id.conn_fd, m)) {
      id.st = St::kDisconnected;
      close_fd(s, id.conn_fd);
      push(id, kEvDisconnected, 0);
    }
    return 0;
  }
  if (id.st != St::kReqRcvd) return EINVAL;
  const rdma_ucm_conn_param &p = cmd.conn_param;
  if (p.private_data_len > (is_ud(id) ? kSidrRepPrivate : kRepPrivate)) return EINVAL;
  if (p.valid) id.uid = cmd.uid;
  id.qpn = p.qp_num;
  id.psn = s.rng() & 0xffffff;
  if (p.valid) {
    id.resp_res = p.responder_resources;
    id.init_depth = p.initiator_depth;
    id.rnr_retry_count = p.rnr_retry_count;
  }
  Msg m = make_msg(id, is_ud(id) ? MsgType::kSidrRep : MsgType::kRep);
  m.qkey = kUdpQkey;
  m.srq = p.srq;
  m.private_data_len = p.private_data_len;
  std::memcpy(m.private_data, p.private_data, p.private_data_len);
  const bool sent = !id.peer_gone && send_msg(id.conn_fd, m);
  if (is_ud(id)) {  // SIDR ends with the reply
    close_fd(s, id.conn_fd);
    id.st = St::kConnected;
    return 0;
  }
  if (!sent) {  // the requester went away: as a REP that times out
    close_fd(s, id.conn_fd);
    id.st = St::kDisconnected;
    push(id, kEvUnreachable, -ETIMEDOUT);
    return 0;
  }
  id.st = St::kRepSent;
  return 0;
}

int reject_id(State &s, Id &id, const rdma_ucm_reject &cmd) {
  if (id.st != St::kReqRcvd) return EINVAL;
  if (cmd.private_data_len > kRejPrivate) return EINVAL;
  Msg m = make_msg(id, is_ud(id) ? MsgType::kSidrRep : MsgType::kRej);
  m.reason = is_ud(id) ? 2 /* IB_SIDR_REJECT */ : (cmd.reason ? cmd.reason : kRejConsumer);
  m.private_data_len = cmd.private_data_len;
  std::memcpy(m.private_data, cmd.private_data, cmd.private_data_len);
  if (!id.peer_gone) (void)send_msg(id.conn_fd, m);
  close_fd(s, id.conn_fd);
  id.st = St::kDisconnected;
  return 0;
}

int disconnect_id(State &s, Id &id) {
  switch (id.st) {
    case St::kConnected:
    case St::kRepSent:
    case St::kRepRcvd:
      if (is_ud(id)) return EINVAL;
      if (id.peer_gone || !send_msg(id.conn_fd, make_msg(id, MsgType::kDreq))) {
        close_fd(s, id.conn_fd);
        id.st = St::kDisconnected;
        push(id, kEvDisconnected, 0);
        return 0;
      }
      id.st = St::kDreqSent;
      id.deadline = Clock::now() + kDreqTimeout;
      wake(s);
      return 0;
    case St::kReqRcvd:
      return reject_id(s, id, rdma_ucm_reject{});
    case St::kDreqSent:
    case St::kDisconnected:
      return 0;  // the kernel answers a DREQ it received with DREP here
    default:
      return EINVAL;
  }
}

int init_qp_attr(Id &id, uint32_t qp_state, ib_uverbs_qp_attr *a) {
  const Device *d = local_device();
  if (d == nullptr || !id.has_device) return EINVAL;
  *a = ib_uverbs_qp_attr{};
  a->qp_state = qp_state;
  a->port_num = 1;
  switch (qp_state) {
    case IBV_QPS_INIT:
      a->qp_attr_mask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT;
      if (is_ud(id)) {
        a->qkey = kUdpQkey;
        a->qp_attr_mask |= IBV_QP_QKEY;
      } else {
        a->qp_access_flags =
            IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
        a->qp_attr_mask |= IBV_QP_ACCESS_FLAGS;
      }
      return 0;
    case IBV_QPS_RTR:
      if (is_ud(id) || !id.remote_known) return EINVAL;
      a->qp_attr_mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                        IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
      fill_ah(a->ah_attr, id.remote_lid, id.remote_gid);
      a->path_mtu = d->active_mtu;
      a->dest_qp_num = id.remote_qpn;
      a->rq_psn = id.remote_psn;
      a->max_dest_rd_atomic = std::min(id.resp_res, d->max_dest_rd_atomic);
      a->min_rnr_timer = 12;  // 0.64 ms
      return 0;
    case IBV_QPS_RTS:
      if (is_ud(id)) {
        a->qp_attr_mask = IBV_QP_STATE | IBV_QP_SQ_PSN;
        return 0;
      }
      if (!id.remote_known) return EINVAL;
      a->qp_attr_mask = IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                        IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC;
      a->sq_psn = id.psn;
      a->timeout = 14;  // 67 ms
      a->retry_cnt = std::min<uint8_t>(id.retry_count, 7);
      a->rnr_retry = std::min<uint8_t>(id.rnr_retry_count, 7);
      a->max_rd_atomic = std::min(id.init_depth, d->max_rd_atomic);
      return 0;
    default:
      return EINVAL;
  }
}

void fill_route(const Id &id, rdma_ucm_query_route_resp *r) {
  *r = rdma_ucm_query_route_resp{};
  r->ibdev_index = UINT32_MAX;
  r->port_num = 1;
  std::memcpy(&r->src_addr, &id.src, sizeof r->src_addr);
  std::memcpy(&r->dst_addr, &id.dst, sizeof r->dst_addr);
  const Device *d = id.has_device ? local_device() : nullptr;
  if (d == nullptr) return;
  r->node_guid = d->guid;
  r->ibdev_index = 0;
  ib_user_path_rec &p = r->ib_route[0];
  std::memcpy(p.sgid, d->gid, sizeof p.sgid);
  std::memcpy(p.dgid, id.remote_known ? id.remote_gid : d->gid, sizeof p.dgid);
  p.slid = htons(d->lid);
  p.dlid = htons(id.remote_known ? id.remote_lid : 0);
  p.pkey = htons(0xffff);
  p.mtu = d->active_mtu;
  p.numb_path = 1;
  p.reversible = 1;
  p.packet_life_time = 1;
  if (id.st == St::kRouteResolved || id.st >= St::kReqSent) r->num_paths = 1;
}

// --- messages from peers (service thread, lock held) ---------------------------

void on_request(State &s, Pending p, const Msg &m, size_t n) {
  auto lit = s.ids.find(p.listener);
  Id *l = lit == s.ids.end() ? nullptr : lit->second.get();
  const bool ud_req = m.type == MsgType::kSidrReq;
  const bool ok = l != nullptr && l->st == St::kListen && n >= offsetof(Msg, private_data) &&
                  (m.type == MsgType::kReq || ud_req) && m.ps == l->ps && ud_req == is_ud(*l) &&
                  listener_matches(reinterpret_cast<const sockaddr *>(&l->src),
                                   reinterpret_cast<const sockaddr *>(&m.dst));
  if (!ok) {
    Msg r{};
    r.type = ud_req ? MsgType::kSidrRep : MsgType::kRej;
    r.reason = ud_req ? kSidrUnsupported : kRejInvalidServiceId;
    (void)send_msg(p.fd, r);
    close(p.fd);
    return;
  }
  auto owned = std::make_unique<Id>();
  Id &c = *owned;
  c.handle = s.next_handle++;
  c.ch = l->ch;
  c.ps = l->ps;
  c.qp_type = l->qp_type;
  c.src = m.dst;
  c.dst = m.src;
  c.has_device = true;
  c.conn_fd = p.fd;
  c.st = St::kReqRcvd;
  c.resp_res = m.initiator_depth;
  c.init_depth = m.responder_resources;
  c.retry_count = m.retry_count;
  c.rnr_retry_count = m.rnr_retry_count;
  learn_remote(c, m);
  s.ids[c.handle] = std::move(owned);
  watch(s, c.conn_fd, key(kConn, c.handle));

  Event &e = push(*l, kEvConnectRequest, 0);
  e.resp.id = c.handle;
  e.child = c.handle;
  if (ud_req)
    fill_ud(e.resp.param.ud, m);
  else
    fill_conn(e.resp.param.conn, m, true);
  if (!ud_req) (void)send_msg(c.conn_fd, make_msg(c, MsgType::kMra));
}

void on_peer_gone(State &s, Id &id) {
  if (tracing())
    std::fprintf(stderr, "pcientb-cm[%d]: id %u: peer gone in state %d\n", getpid(), id.handle,
                 static_cast<int>(id.st));
  id.peer_gone = true;
  close_fd(s, id.conn_fd);
  switch (id.st) {
    case St::kReqSent:
    case St::kRepSent:
      id.st = St::kDisconnected;
      id.deadline = {};
      push(id, kEvUnreachable, -ETIMEDOUT);
      break;
    case St::kConnected:
    case St::kDreqSent:
      if (is_ud(id)) break;
      id.st = St::kDisconnected;
      id.deadline = {};
      push(id, kEvDisconnected, 0);
      break;
    default:  // kReqRcvd / kRepRcvd: the program's next step finds it gone
      break;
  }
}

void on_message(State &s, Id &id, const Msg &m) {
  if (tracing())
    std::fprintf(stderr, "pcientb-cm[%d]: id %u: message %u in state %d\n", getpid(), id.handle,
                 static_cast<unsigned>(m.type), static_cast<int>(id.st));
  switch (m.type) {
    case MsgType::kMra:
      if (id.st == St::kReqSent) id.deadline = {};
      break;
    case MsgType::kRep:
      if (id.st != St::kReqSent) break;
      learn_remote(id, m);
      id.init_depth = std::min(id.init_depth, m.responder_resources);
      id.resp_res = std::min(id.resp_res, m.initiator_depth);
      id.st = St::kRepRcvd;
      id.deadline = {};
      fill_conn(push(id, kEvConnectResponse, 0).resp.param.conn, m, true);
      break;
    case MsgType::kSidrRep:
      if (id.st != St::kReqSent) break;
      id.deadline = {};
      close_fd(s, id.conn_fd);
      if (m.reason != 0) {
        id.st = St::kDisconnected;
        push(id, kEvUnreachable, m.reason);
        break;
      }
      learn_remote(id, m);
      id.st = St::kConnected;
      fill_ud(push(id, kEvEstablished, 0).resp.param.ud, m);
      break;
    case MsgType::kRtu:
      if (id.st != St::kRepSent) break;
      id.st = St::kConnected;
      push(id, kEvEstablished, 0);
      break;
    case MsgType::kRej:
      if (id.st != St::kReqSent && id.st != St::kRepSent) break;
      id.st = St::kDisconnected;
      id.deadline = {};
      close_fd(s, id.conn_fd);
      fill_conn(push(id, kEvRejected, m.reason).resp.param.conn, m, false);
      break;
    case MsgType::kDreq:
      (void)send_msg(id.conn_fd, make_msg(id, MsgType::kDrep));
      if (id.st == St::kConnected || id.st == St::kDreqSent || id.st == St::kRepSent ||
          id.st == St::kRepRcvd) {
        id.st = St::kDisconnected;
        id.deadline = {};
        push(id, kEvDisconnected, 0);
      }
      close_fd(s, id.conn_fd);
      break;
    case MsgType::kDrep:
      if (id.st != St::kDreqSent) break;
      id.st = St::kDisconnected;
      id.deadline = {};
      close_fd(s, id.conn_fd);
      push(id, kEvDisconnected, 0);
      break;
    default:
      break;
  }
}

void on_deadline(State &s, Id &id) {
  id.deadline = {};
  if (id.st == St::kReqSent && id.unsent_req) {
    if (send_request(s, id) != 0) retry_or_reject(id);
  } else if (id.st == St::kReqSent) {
    close_fd(s, id.conn_fd);
    id.st = St::kDisconnected;
    push(id, kEvUnreachable, -ETIMEDOUT);
  } else if (id.st == St::kDreqSent) {
    close_fd(s, id.conn_fd);
    id.st = St::kDisconnected;
    push(id, kEvDisconnected, 0);
  }
}

void handle(State &s, uint64_t k) {
  const auto kind = static_cast<Kind>(k >> 56);
  const uint64_t v = k & ((1ULL << 56) - 1);
  if (kind == kWake) {
    uint64_t n = 0;
    (void)!::read(s.wake_fd, &n, sizeof n);
  } else if (kind == kHub) {
    auto it = s.channels.find(v);
    char b = 0;
    if (it != s.channels.end() && ::recv(it->second->hub, &b, 1, MSG_DONTWAIT | MSG_PEEK) == 0)
      destroy_channel(s, v);  // the program closed its last descriptor
  } else if (kind == kListener) {
    auto it = s.ids.find(static_cast<uint32_t>(v));
    if (it == s.ids.end() || it->second->port_fd < 0) return;
    for (;;) {
      const int fd = accept4(it->second->port_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) break;
      const uint64_t serial = s.next_serial++;
      s.pending[serial] = Pending{fd, it->second->handle};
      watch(s, fd, key(kPending, serial));
    }
  } else if (kind == kPending) {
    auto it = s.pending.find(v);
    if (it == s.pending.end()) return;
    Msg m{};
    const ssize_t n = ::recv(it->second.fd, &m, sizeof m, MSG_DONTWAIT);
    if (n < 0 && errno == EAGAIN) return;
    Pending p = it->second;
    s.pending.erase(it);
    epoll_ctl(s.epfd, EPOLL_CTL_DEL, p.fd, nullptr);
    if (n <= 0) {
      close(p.fd);
      return;
    }
    on_request(s, p, m, static_cast<size_t>(n));
  } else if (kind == kConn) {
    for (;;) {
      auto it = s.ids.find(static_cast<uint32_t>(v));
      if (it == s.ids.end() || it->second->conn_fd < 0) return;
      Id &id = *it->second;
      Msg m{};
      const ssize_t n = ::recv(id.conn_fd, &m, sizeof m, MSG_DONTWAIT);
      if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
      if (n <= 0) {
        on_peer_gone(s, id);
        return;
      }
      if (static_cast<size_t>(n) < offsetof(Msg, private_data) ||
          static_cast<size_t>(n) != offsetof(Msg, private_data) + m.private_data_len)
        continue;  // malformed: ignored, as a CM drops a bad MAD
      on_message(s, id, m);
    }
  }
}

void service_loop() {
  State &s = state();
  epoll_event evs[32];
  for (;;) {
    int timeout = -1;
    {
      const std::lock_guard<std::mutex> g(s.mu);
      for (const Deferred &d : s.deferred)
        if (auto it = s.ids.find(d.handle); it != s.ids.end()) push(*it->second, d.event, d.status);
      s.deferred.clear();
      const Clock::time_point now = Clock::now();
      for (auto &[h, id] : s.ids) {
        if (id->deadline != Clock::time_point{} && id->deadline <= now) on_deadline(s, *id);
        if (id->deadline == Clock::time_point{}) continue;  // none, or on_deadline set none
        const auto ms = std::chrono::ceil<std::chrono::milliseconds>(id->deadline - now).count();
        timeout = timeout < 0 ? static_cast<int>(ms) : std::min(timeout, static_cast<int>(ms));
      }
    }
    const int n = epoll_wait(s.epfd, evs, 32, timeout);
    const std::lock_guard<std::mutex> g(s.mu);
    for (int i = 0; i < n; ++i) handle(s, evs[i].data.u64);
  }
}

void before_fork() {
  state().mu.lock();
}
void after_fork_parent() {
  state().mu.unlock();
}

// The child shares its parent's channels as files, not as ids: what it
// inherited is closed here and answers EINVAL; new channels work.
void after_fork_child() {
  State &s = state();
  s.mu.unlock();
  const std::lock_guard<std::mutex> g(s.mu);
  for (auto &[h, id] : s.ids) {
    if (id->conn_fd >= 0) close(id->conn_fd);
    if (id->port_fd >= 0) close(id->port_fd);
  }
  s.ids.clear();
  s.deferred.clear();
  for (auto &[serial, p] : s.pending) close(p.fd);
  s.pending.clear();
  for (auto &[serial, ch] : s.channels) {
    if (ch->hub >= 0) close(ch->hub);
    ch->hub = -1;
    ch->inherited = true;
    ch->events.clear();
  }
  if (s.epfd >= 0) close(s.epfd);
  if (s.wake_fd >= 0) close(s.wake_fd);
  s.epfd = s.wake_fd = -1;
  s.service_running = false;
}

// 0 or an errno.
int start_service(State &s) {
  if (s.service_running) return 0;
  static std::once_flag hooks;
  std::call_once(hooks, [] { pthread_atfork(before_fork, after_fork_parent, after_fork_child); });
  s.epfd = epoll_create1(EPOLL_CLOEXEC);
  s.wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (s.epfd < 0 || s.wake_fd < 0) return errno;
  watch(s, s.wake_fd, key(kWake, 0));
  std::thread(service_loop).detach();
  s.service_running = true;
  return 0;
}

// Copies a response to the program's buffer as the kernel would: EFAULT for a
// bad address rather than a crash.
int put_response(uint64_t where, const void *data, size_t len, size_t room) {
  const size_t n = std::min(len, room);
  if (n == 0) return 0;
  iovec local{const_cast<void *>(data), n};
  iovec remote{reinterpret_cast<void *>(where), n};
  if (process_vm_writev(getpid(), &local, 1, &remote, 1, 0) != static_cast<ssize_t>(n)) {
    if (errno == ENOSYS || errno == EPERM) {  // no process_vm_writev: trust the pointer
      std::memcpy(reinterpret_cast<void *>(where), data, n);
      return 0;
    }
    return EFAULT;
  }
  return 0;
}

// GET_EVENT: waits without the lock, in poll(), so signals interrupt it.
int get_event(State &s, std::unique_lock<std::mutex> &l, Channel *ch, int fd, uint64_t response,
              size_t room) {
  const uint64_t serial = ch->serial;
  for (;;) {
    auto it = s.channels.find(serial);
    if (it == s.channels.end()) return EINVAL;
    ch = it->second.get();
    if (!ch->events.empty()) {
      Event e = ch->events.front();
      if (const int err = put_response(response, &e.resp, sizeof e.resp, room); err != 0)
        return err;
      ch->events.pop_front();
      if (ch->events.empty()) set_token(*ch, false, fd);
      if (auto id = s.ids.find(e.counted_on); id != s.ids.end()) ++id->second->events_reported;
      return 0;
    }
    const int flags = fcntl(fd, F_GETFL);
    if (flags >= 0 && (flags & O_NONBLOCK) != 0) return EAGAIN;
    l.unlock();
    pollfd p{fd, POLLIN, 0};
    const int rc = poll(&p, 1, -1);
    const int err = errno;
    l.lock();
    if (rc < 0 && err == EINTR) return EINTR;
  }
}

Id *find_id(State &s, Channel *ch, uint32_t handle) {
  auto it = s.ids.find(handle);
  if (it == s.ids.end() || it->second->ch != ch) return nullptr;
  return it->second.get();
}

template <typename T>
T input(const void *buf, size_t len) {
  T t{};
  std::memcpy(&t, static_cast<const char *>(buf) + sizeof(rdma_ucm_cmd_hdr),
              std::min(len - sizeof(rdma_ucm_cmd_hdr), sizeof t));
  return t;
}

// One command; 0 or an errno.
int run(State &s, std::unique_lock<std::mutex> &l, Channel *ch, int fd, const rdma_ucm_cmd_hdr &h,
        const void *buf, size_t len) {
  const size_t room = h.out;
  switch (h.cmd) {
    case RDMA_USER_CM_CMD_CREATE_ID: {
      auto c = input<rdma_ucm_create_id>(buf, len);
      if (c.ps != RDMA_PS_TCP && c.ps != RDMA_PS_UDP && c.ps != RDMA_PS_IB && c.ps != RDMA_PS_IPOIB)
        return EINVAL;
      auto id = std::make_unique<Id>();
      id->handle = s.next_handle++;
      id->uid = c.uid;
      id->ch = ch;
      id->ps = c.ps;
      id->qp_type = c.qp_type;
      rdma_ucm_create_id_resp r{id->handle};
      if (const int err = put_response(c.response, &r, sizeof r, room); err != 0) return err;
      s.ids[id->handle] = std::move(id);
      return 0;
    }
    case RDMA_USER_CM_CMD_DESTROY_ID: {
      auto c = input<rdma_ucm_destroy_id>(buf, len);
      Id *id = find_id(s, ch, c.id);
      if (id == nullptr) return ENOENT;
      rdma_ucm_destroy_id_resp r{id->events_reported};
      destroy_id(s, c.id, fd);
      return put_response(c.response, &r, sizeof r, room);
    }
    case RDMA_USER_CM_CMD_BIND_IP: {
      auto c = input<rdma_ucm_bind_ip>(buf, len);
      Id *id = find_id(s, ch, c.id);
      return id == nullptr ? ENOENT : bind_id(s, *id, reinterpret_cast<sockaddr *>(&c.addr));
    }
    case RDMA_USER_CM_CMD_BIND: {
      auto c = input<rdma_ucm_bind>(buf, len);
      Id *id = find_id(s, ch, c.id);
      return id == nullptr ? ENOENT : bind_id(s, *id, reinterpret_cast<sockaddr *>(&c.addr));
    }
    case RDMA_USER_CM_CMD_RESOLVE_IP: {
      auto c = input<rdma_ucm_resolve_ip>(buf, len);
      Id *id = find_id(s, ch, c.id);
      if (id == nullptr) return ENOENT;
      return resolve_addr(s, *id, reinterpret_cast<sockaddr *>(&c.src_addr),
                          reinterpret_cast<sockaddr *>(&c.dst_addr));
    }
    case RDMA_USER_CM_CMD_RESOLVE_ADDR: {
      auto c = input<rdma_ucm_resolve_addr>(buf, len);
      Id *id = find_id(s, ch, c.id);
      if (id == nullptr) return ENOENT;
      return resolve_addr(s, *id, c.src_size ? reinterpret_cast<sockaddr *>(&c.src_addr) : nullptr,
                          reinterpret_cast<sockaddr *>(&c.dst_addr));
    }
    case RDMA_USER_CM_CMD_RESOLVE_ROUTE: {
      auto c = input<rdma_ucm_resolve_route>(buf, len);
      Id *id = find_id(s, ch, c.id);
      if (id == nullptr) return ENOENT;
      if (id->st != St::kAddrResolved && id->st != St::kRouteResolved) return EINVAL;
      id->st = St::kRouteResolved;
      defer(s, *id, kEvRouteResolved, 0);
      return 0;
    }
    case RDMA_USER_CM_CMD_QUERY_ROUTE: {
      auto c = input<rdma_ucm_query>(buf, len);
      Id *id = find_id(s, ch, c.id);
      if (id == nullptr) return ENOENT;
      rdma_ucm_query_route_resp r;
      fill_route(*id, &r);
      return put_response(c.response, &r, sizeof r, room);
    }
    case RDMA_USER_CM_CMD_QUERY: {
      auto c = input<rdma_ucm_query>(buf, len);
      Id *id = find_id(s, ch, c.id);
      if (id == nullptr) return ENOENT;
      if (c.option != RDMA_USER_CM_QUERY_ADDR) return ENOSYS;  // only AF_IB asks the others
      rdma_ucm_query_addr_resp r{};
      const Device *d = id->has_device ? local_device() : nullptr;
      r.node_guid = d != nullptr ? d->guid : 0;
      r.ibdev_index = d != nullptr ? 0 : UINT32_MAX;
      r.port_num = 1;
      r.pkey = htons(0xffff);
      r.src_size = static_cast<uint16_t>(addr_len(reinterpret_cast<sockaddr *>(&id->src)));
      r.dst_size = static_cast<uint16_t>(addr_len(reinterpret_cast<sockaddr *>(&id->dst)));
      std::memcpy(&r.src_addr, &id->src, sizeof id->src);
      std::memcpy(&r.dst_addr, &id->dst, sizeof id->dst);
      return put_response(c.response, &r, sizeof r, room);
    }
    case RDMA_USER_CM_CMD_LISTEN: {
      auto c = input<rdma_ucm_listen>(buf, len);
      Id *id = find_id(s, ch, c.id);
      if (id == nullptr) return ENOENT;
      if (id->st == St::kListen) return 0;
      if (id->st == St::kIdle) {
        sockaddr_in any{};
        any.sin_family = AF_INET;
        if (const int err = bind_id(s, *id, reinterpret_cast<sockaddr *>(&any)); err != 0)
          return err;
      }
      if (id->st != St::kBound) return EINVAL;
      if (listen(id->port_fd, kBacklog) != 0) return errno;
      id->st = St::kListen;
      watch(s, id->port_fd, key(kListener, id->handle));
      return 0;
    }
    case RDMA_USER_CM_CMD_CONNECT: {
      auto c = input<rdma_ucm_connect>(buf, len);
      Id *id = find_id(s, ch, c.id);
      return id == nullptr ? ENOENT : connect_id(s, *id, c.conn_param);
    }
    case RDMA_USER_CM_CMD_ACCEPT: {
      auto c = input<rdma_ucm_accept>(buf, len);
      Id *id = find_id(s, ch, c.id);
      return id == nullptr ? ENOENT : accept_id(s, *id, c);
    }
    case RDMA_USER_CM_CMD_REJECT: {
      auto c = input<rdma_ucm_reject>(buf, len);
      Id *id = find_id(s, ch, c.id);
      return id == nullptr ? ENOENT : reject_id(s, *id, c);
    }
    case RDMA_USER_CM_CMD_DISCONNECT: {
      auto c = input<rdma_ucm_disconnect>(buf, len);
      Id *id = find_id(s, ch, c.id);
      return id == nullptr ? ENOENT : disconnect_id(s, *id);
    }
    case RDMA_USER_CM_CMD_INIT_QP_ATTR: {
      auto c = input<rdma_ucm_init_qp_attr>(buf, len);
      Id *id = find_id(s, ch, c.id);
      if (id == nullptr) return ENOENT;
      ib_uverbs_qp_attr a;
      if (const int err = init_qp_attr(*id, c.qp_state, &a); err != 0) return err;
      return put_response(c.response, &a, sizeof a, room);
    }
    case RDMA_USER_CM_CMD_GET_EVENT: {
      auto c = input<rdma_ucm_get_event>(buf, len);
      return get_event(s, l, ch, fd, c.response, room);
    }
    case RDMA_USER_CM_CMD_SET_OPTION: {
      auto c = input<rdma_ucm_set_option>(buf, len);
      if (find_id(s, ch, c.id) == nullptr) return ENOENT;
      if (c.level == RDMA_OPTION_ID &&
          (c.optname == RDMA_OPTION_ID_TOS || c.optname == RDMA_OPTION_ID_REUSEADDR ||
           c.optname == RDMA_OPTION_ID_AFONLY || c.optname == RDMA_OPTION_ID_ACK_TIMEOUT))
        return 0;     // accepted; nothing here depends on them
      return ENOSYS;  // a path record given by the program (ibacm): resolve instead
    }
    case RDMA_USER_CM_CMD_NOTIFY: {
      auto c = input<rdma_ucm_notify>(buf, len);
      return find_id(s, ch, c.id) == nullptr ? ENOENT : 0;
    }
    case RDMA_USER_CM_CMD_JOIN_IP_MCAST:
    case RDMA_USER_CM_CMD_JOIN_MCAST:
      return EOPNOTSUPP;  // pcientb has no multicast groups
    case RDMA_USER_CM_CMD_LEAVE_MCAST:
      return EINVAL;
    case RDMA_USER_CM_CMD_MIGRATE_ID: {
      auto c = input<rdma_ucm_migrate_id>(buf, len);
      Channel *from = channel_of_fd(s, static_cast<int>(c.fd));
      if (from == nullptr || from->inherited) return EBADF;
      Id *id = find_id(s, from, c.id);
      if (id == nullptr) return ENOENT;
      rdma_ucm_migrate_resp r{id->events_reported};
      if (const int err = put_response(c.response, &r, sizeof r, room); err != 0) return err;
      if (from != ch) {
        std::deque<Event> keep;
        for (Event &e : from->events) (e.counted_on == id->handle ? ch->events : keep).push_back(e);
        from->events.swap(keep);
        if (from->events.empty()) set_token(*from, false, static_cast<int>(c.fd));
        if (!ch->events.empty()) set_token(*ch, true, fd);
        id->ch = ch;
      }
      return 0;
    }
    default:
      return EINVAL;  // GET_OPTION (the kernel has none either) and unknown commands
  }
}

}  // namespace

int open_channel(int open_flags) {
  State &s = state();
  const std::lock_guard<std::mutex> g(s.mu);
  if (const int err = start_service(s); err != 0) {
    errno = err;
    return -1;
  }
  int sv[2];
  const int type = SOCK_STREAM | ((open_flags & O_CLOEXEC) ? SOCK_CLOEXEC : 0) |
                   ((open_flags & O_NONBLOCK) ? SOCK_NONBLOCK : 0);
  if (socketpair(AF_UNIX, type, 0, sv) != 0) return -1;
  const int hub = fcntl(sv[1], F_DUPFD_CLOEXEC, 0);
  close(sv[1]);
  if (hub < 0 || sv[0] >= kMaxFd) {
    if (hub >= 0) close(hub);
    close(sv[0]);
    errno = EMFILE;
    return -1;
  }
  auto ch = std::make_unique<Channel>();
  ch->serial = s.next_serial++;
  ch->hub = hub;
  ch->ino = inode_of(sv[0]);
  watch(s, hub, key(kHub, ch->serial));
  g_fd_ino[sv[0]].store(ch->ino);
  {
    const std::lock_guard<std::mutex> ig(inodes().mu);
    inodes().live.push_back(ch->ino);
  }
  g_any_channel.store(true);
  s.channels[ch->serial] = std::move(ch);
  return sv[0];
}

bool any_channel() {
  return g_any_channel.load(std::memory_order_relaxed);
}

bool known_channel(int fd) {
  return fd >= 0 && fd < kMaxFd && g_fd_ino[fd].load(std::memory_order_relaxed) != 0;
}

bool is_channel(int fd) {
  if (fd < 0 || fd >= kMaxFd || !any_channel()) return false;
  const ino_t known = g_fd_ino[fd].load(std::memory_order_relaxed);
  const ino_t ino = inode_of(fd);
  if (known != 0 && known == ino) return true;
  if (known != 0) g_fd_ino[fd].store(0);
  // A dup of a channel's descriptor, or its number reused.
  if (ino == 0 || !channel_inode(ino)) return false;
  g_fd_ino[fd].store(ino);
  return true;
}

void forget(int fd) {
  if (fd >= 0 && fd < kMaxFd) g_fd_ino[fd].store(0, std::memory_order_relaxed);
}

ssize_t execute(int fd, int held, const void *buf, size_t len) {
  rdma_ucm_cmd_hdr h{};
  if (len < sizeof h) {
    errno = EINVAL;
    return -1;
  }
  std::memcpy(&h, buf, sizeof h);
  if (h.in + sizeof h > len) {
    errno = EINVAL;
    return -1;
  }
  open_local_device();  // before the lock (device.hpp)
  const int on = held >= 0 ? held : fd;
  State &s = state();
  std::unique_lock<std::mutex> l(s.mu);
  Channel *ch = channel_of_fd(s, on);
  int err = EINVAL;
  if (ch != nullptr && !ch->inherited) err = run(s, l, ch, on, h, buf, len);
  l.unlock();
  if (tracing())
    std::fprintf(stderr, "pcientb-cm[%d]: fd %d cmd %u in %u out %u -> %s\n", getpid(), fd, h.cmd,
                 h.in, h.out, err != 0 ? std::strerror(err) : "ok");
  if (err != 0) {
    errno = err;
    return -1;
  }
  return static_cast<ssize_t>(len);
}

void describe(struct stat *st) {
  st->st_mode = (st->st_mode & ~S_IFMT) | S_IFCHR;
  st->st_rdev = makedev(10, 58);  // a misc device, as rdma_cm is
}

}  // namespace pcientb::cm
