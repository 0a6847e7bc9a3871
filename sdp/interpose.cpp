// The libc entry points the layer takes over, and the table of the sockets it holds.
//
// Every AF_INET/AF_INET6 stream socket is noted at socket() (or accept()); at connect() or
// accept() the handshake decides, and a socket that stays on TCP is forgotten at once, so the
// program's other descriptors and TCP sockets pay one table check per call. Calls on an SDP
// socket go to stream.cpp; poll/select/epoll to multiplex.cpp.
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <unordered_map>
#include <utility>

#include "sdp.hpp"

#define SDP_EXPORT extern "C" __attribute__((visibility("default")))

namespace sdp {

void multiplex_close_epoll(int epfd);

namespace {

template <class F>
F next(const char *name) {
  void *p = dlsym(RTLD_NEXT, name);
  if (!p) die_internal(name);
  return reinterpret_cast<F>(p);
}

Real load_real() {
  Real r;
  r.socket = next<decltype(r.socket)>("socket");
  r.connect = next<decltype(r.connect)>("connect");
  r.listen = next<decltype(r.listen)>("listen");
  r.accept4 = next<decltype(r.accept4)>("accept4");
  r.close = next<decltype(r.close)>("close");
  r.shutdown = next<decltype(r.shutdown)>("shutdown");
  r.read = next<decltype(r.read)>("read");
  r.write = next<decltype(r.write)>("write");
  r.recvmsg = next<decltype(r.recvmsg)>("recvmsg");
  r.sendmsg = next<decltype(r.sendmsg)>("sendmsg");
  r.recvfrom = next<decltype(r.recvfrom)>("recvfrom");
  r.sendto = next<decltype(r.sendto)>("sendto");
  r.poll = next<decltype(r.poll)>("poll");
  r.epoll_ctl = next<decltype(r.epoll_ctl)>("epoll_ctl");
  r.epoll_wait = next<decltype(r.epoll_wait)>("epoll_wait");
  r.fcntl = next<decltype(r.fcntl)>("fcntl");
  r.ioctl = next<decltype(r.ioctl)>("ioctl");
  r.dup = next<decltype(r.dup)>("dup");
  r.dup3 = next<decltype(r.dup3)>("dup3");
  r.dup2 = next<decltype(r.dup2)>("dup2");
  r.getsockopt = next<decltype(r.getsockopt)>("getsockopt");
  r.setsockopt = next<decltype(r.setsockopt)>("setsockopt");
  r.bind = next<decltype(r.bind)>("bind");
  r.readv = next<decltype(r.readv)>("readv");
  r.writev = next<decltype(r.writev)>("writev");
  r.sendfile = next<decltype(r.sendfile)>("sendfile");
  r.ppoll = next<decltype(r.ppoll)>("ppoll");
  r.epoll_pwait = next<decltype(r.epoll_pwait)>("epoll_pwait");
  return r;
}

// The table: a flag per small descriptor so that other descriptors cost one load.
constexpr int kFast = 1 << 16;
std::atomic<uint8_t> fast[kFast];
// The sockets of small descriptors, read without the table's lock (written under it), each
// under its stripe's lock. Not std::atomic<std::shared_ptr>: its hidden spin lock, held by
// another thread at a fork(), stays held in the child, whose first lookup of that
// descriptor then spins for ever. fork_prepare holds every stripe over fork().
std::shared_ptr<Sock> *fast_sock = new std::shared_ptr<Sock>[kFast];
constexpr int kStripes = 64;
std::mutex *fast_mu = new std::mutex[kStripes];

std::shared_ptr<Sock> fast_sock_of(int fd) {
  std::lock_guard<std::mutex> lk(fast_mu[fd % kStripes]);
  return fast_sock[fd];
}

// Returns the socket fd named before, to be let go of after the stripe's lock.
std::shared_ptr<Sock> set_fast_sock(int fd, std::shared_ptr<Sock> s) {
  std::lock_guard<std::mutex> lk(fast_mu[fd % kStripes]);
  return std::exchange(fast_sock[fd], std::move(s));
}

void fast_fork_lock(bool take) {
  for (int i = 0; i < kStripes; ++i) take ? fast_mu[i].lock() : fast_mu[i].unlock();
}
// Bumped at every change of a small descriptor's mapping: a thread's cached lookup of the
// descriptor is good while the number has not moved.
std::atomic<uint32_t> fast_gen[kFast];

struct LookupCache {
  int fd = -1;
  uint32_t gen = 0;
  std::shared_ptr<Sock> sock;  // keeps it alive while this thread may use it
};
thread_local LookupCache lookup_cache;
std::mutex tab_mu;
std::unordered_map<int, std::shared_ptr<Sock>> *tab =
    new std::unordered_map<int, std::shared_ptr<Sock>>();

// Names s by fd, unless the layer let go of s meanwhile (another thread handed it back
// between the caller's lookup and here): fd is then the kernel's TCP socket only.
void map_fd(int fd, const std::shared_ptr<Sock> &s) {
  std::lock_guard<std::mutex> lk(tab_mu);
  if (s->forgotten) return;
  auto &slot = (*tab)[fd];
  if (slot) --slot->refs;
  slot = s;
  ++s->refs;
  if (fd < kFast) {
    set_fast_sock(fd, s);
    fast_gen[fd].fetch_add(1, std::memory_order_acq_rel);
    fast[fd].store(1, std::memory_order_release);
  }
}

// The small descriptor fd names no socket now (tab_mu held).
void unmap_fast(int fd) {
  if (fd >= kFast) return;
  fast[fd].store(0, std::memory_order_release);
  fast_gen[fd].fetch_add(1, std::memory_order_acq_rel);
  set_fast_sock(fd, nullptr);
}

// Removes the program's descriptor; returns the socket if that was its last descriptor.
std::shared_ptr<Sock> unmap_fd(int fd) {
  std::lock_guard<std::mutex> lk(tab_mu);
  auto it = tab->find(fd);
  if (it == tab->end()) return nullptr;
  std::shared_ptr<Sock> s = std::move(it->second);
  tab->erase(it);
  unmap_fast(fd);
  if (--s->refs != 0) return nullptr;
  s->forgotten = true;
  return s;
}

// Takes every descriptor naming s out of the table, once: true for the caller that did
// (it closes s.fd), false when another thread let go of s first. Without the once, a
// descriptor dup'd meanwhile named s again, and its close closed s.fd a second time:
// by then the number could be a file another thread had just opened.
bool unmap_all(Sock &s) {
  std::lock_guard<std::mutex> lk(tab_mu);
  if (s.forgotten) return false;
  s.forgotten = true;
  for (auto it = tab->begin(); it != tab->end();) {
    if (it->second.get() != &s) {
      ++it;
      continue;
    }
    unmap_fast(it->first);
    it = tab->erase(it);
  }
  s.refs = 0;
  return true;
}

bool is_stream_inet(int domain, int type, int protocol) {
  return (domain == AF_INET || domain == AF_INET6) && (type & 0xf) == SOCK_STREAM &&
         (protocol == 0 || protocol == IPPROTO_TCP);
}

std::shared_ptr<Sock> track(int fd, int domain, bool nonblocking) {
  int kfd = real().fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (kfd < 0) return nullptr;
  auto s = std::make_shared<Sock>(kfd, domain);
  s->nonblocking = nonblocking;
  struct stat st;
  if (fstat(kfd, &st) == 0) s->ino = st.st_ino;
  map_fd(fd, s);
  return s;
}

// The program let go of an SDP connection: a FIN, or, when another process may hold the
// kernel socket too, the hand-back to TCP (that process goes on with it over TCP). True when
// the connection lingers (closed with data the peer has not read: stream_close).
bool end_connection(Sock &s) {
  if (maybe_shared(s)) {
    stream_revert(s);
    return false;
  }
  return stream_close(s);
}

// The layer's part of a socket the program closed; true when its descriptor stays open
// (the connection lingers) and must not be closed by the caller.
bool release(const std::shared_ptr<Sock> &s) {
  multiplex_forget(*s, false);
  bool lingers = false;
  if (s->state == State::kSdp && !inherited(*s)) lingers = end_connection(*s);
  handshake_forget(*s);
  if (!inherited(*s) && !lingers) link_destroy(s->link);
  return lingers;
}

// Which of the socket's timeouts bounds a call's wait for the peer's handshake.
enum class Waits { kRecv, kSend, kOther };

// Settles the socket of `fd` still negotiating before data calls: after it, the socket is
// SDP, or untracked (TCP). The peer's next message comes when its program first uses the
// connection, which may be never: false with errno when it cannot be settled yet, as the
// call would fail on TCP: EAGAIN for a call that must not wait (O_NONBLOCK, or !may_wait as
// for MSG_DONTWAIT) or whose SO_RCVTIMEO/SO_SNDTIMEO passed, EINTR when a signal came (as
// the kernel, unless the handler restarts calls), EBADF when another thread closed it. The
// wait holds no lock: other threads may poll, use or close the socket meanwhile.
bool settle(int fd, const std::shared_ptr<Sock> &s, bool may_wait, Waits waits) {
  if (s->state == State::kSdp) return true;
  const int64_t timeout_ns = waits == Waits::kRecv   ? s->rcv_timeo_ns
                             : waits == Waits::kSend ? s->snd_timeo_ns
                                                     : 0;
  const int64_t start = int64_t(now_ns());
  for (;;) {
    int kfd;
    {
      std::lock_guard<SockMutex> lk(s->mu);
      if (!negotiating(*s)) return true;  // another thread settled it meanwhile
      if (find_sock(fd) != s) {           // or closed it
        errno = EBADF;
        return false;
      }
      if (handshake_progress(*s)) return true;
      if (!may_wait || s->nonblocking) return false;  // EAGAIN
      kfd = s->fd;
    }
    int ms = 100;  // a close by another thread is seen within this
    if (timeout_ns > 0) {
      const int64_t left = start + timeout_ns - int64_t(now_ns());
      if (left <= 0) {
        errno = EAGAIN;
        return false;
      }
      ms = int(std::min<int64_t>(ms, (left + 999999) / 1000000));
    }
    pollfd p{kfd, POLLIN, 0};
    signal_wait_begins();
    if (real().poll(&p, 1, ms) < 0 && errno == EINTR && !signal_restarts()) {
      errno = EINTR;
      return false;
    }
  }
}

}  // namespace

const Real &real() {
  static Real r = load_real();
  return r;
}

namespace {

std::shared_ptr<Sock> lookup(int fd) {
  if (fd < 0) return nullptr;
  if (fd < kFast) return fast[fd].load(std::memory_order_acquire) == 1 ? fast_sock_of(fd) : nullptr;
  std::lock_guard<std::mutex> lk(tab_mu);
  auto it = tab->find(fd);
  return it == tab->end() ? nullptr : it->second;
}

// Takes a forked child's copy of an SDP connection (or a socket another process may hold
// as one) out of the table: the kernel serves it here, and the process that has the
// connection is asked to hand it back to TCP, since this one uses it now. The epoll sets
// it may be in are the parent's too: left alone.
void drop_inherited(const std::shared_ptr<Sock> &s) {
  if (s->ino) ask_hand_back(inherited(*s) ? s->owner : kAncestors, s->ino);
  if (unmap_all(*s)) real().close(s->fd);
}

}  // namespace

bool sock_released(const Sock &s) {
  std::lock_guard<std::mutex> lk(tab_mu);
  return s.forgotten;
}

std::shared_ptr<Sock> find_sock(int fd) {
  std::shared_ptr<Sock> s = lookup(fd);
  if (s && (inherited(*s) || s->ask_ancestors)) {
    drop_inherited(s);
    return nullptr;
  }
  return s;
}

void forget_sock(Sock &s) {
  if (!unmap_all(s)) return;  // another thread let go of it: it closed s.fd
  multiplex_forget(s, true);
  // The kernel socket lives on in the program's descriptors.
  real().close(s.fd);
}

void note_epoll_fd(int epfd, bool on) {
  if (epfd >= 0 && epfd < kFast) fast[epfd].store(on ? 2 : 0, std::memory_order_release);
}

Sock::~Sock() {}

// A program that exits without closing its connections: as the kernel sends TCP's FIN for
// it, the layer sends each SDP connection's FIN (the peer reads EOF, not a reset), and writes
// their stats lines. Registered at the first SDP connection, after the provider set up its
// own exit work, so that it runs before it; _exit runs it too (process.cpp).
void close_all_at_exit() {
  std::vector<std::shared_ptr<Sock>> all;
  {
    std::lock_guard<std::mutex> lk(tab_mu);
    for (auto &kv : *tab) all.push_back(kv.second);
  }
  std::sort(all.begin(), all.end());
  all.erase(std::unique(all.begin(), all.end()), all.end());  // dup'd descriptors: once
  for (auto &s : all) {
    if (s->state != State::kSdp || inherited(*s)) continue;
    multiplex_forget(*s, false);  // before its link goes: an epoll scan may look at it
    end_connection(*s);
  }
  stream_linger_wait(2000);  // the process's end would take the rings the peers still read
}

namespace {
pid_t exit_handler_pid = 0;
}  // namespace

void note_sdp_connection() {
  {
    std::lock_guard<std::mutex> lk(tab_mu);
    if (exit_handler_pid == getpid()) return;
    exit_handler_pid = getpid();
    atexit(close_all_at_exit);
  }
  hand_back_listen();
}

std::shared_ptr<Sock> track_fd(int fd, int domain, bool nonblocking) {
  return track(fd, domain, nonblocking);
}

void alias_fd(int fd, const std::shared_ptr<Sock> &s) {
  map_fd(fd, s);
}

std::vector<SockUse> table_snapshot() {
  std::vector<SockUse> v;
  std::unordered_map<const Sock *, size_t> at;
  std::lock_guard<std::mutex> lk(tab_mu);
  for (auto &[fd, s] : *tab) {
    int fl = real().fcntl(fd, F_GETFD, 0);
    bool keeps = fl >= 0 && !(fl & FD_CLOEXEC);
    auto [it, fresh] = at.emplace(s.get(), v.size());
    if (fresh)
      v.push_back({s, keeps});
    else
      v[it->second].survives_exec |= keeps;
  }
  return v;
}

namespace {

// The layer's tables are held over fork(), so that no other thread holds them at the fork:
// the child, which has only the forking thread, would wait for them for ever. Registered
// first, so their prepare runs last (after the provider's, which takes none of them).
void fork_prepare() {
  multiplex_fork_lock(true);
  tab_mu.lock();
  fast_fork_lock(true);
  flusher_fork_lock(true);
  auto_fork_lock(true);  // last: taken under sockets' locks only, and takes none
}
void fork_parent() {
  auto_fork_lock(false);
  flusher_fork_lock(false);
  fast_fork_lock(false);
  tab_mu.unlock();
  multiplex_fork_lock(false);
  process_fork_parent();
}
void fork_child() {
  auto_fork_lock(false);
  flusher_fork_lock(false);
  fast_fork_lock(false);
  tab_mu.unlock();
  multiplex_fork_lock(false);
  process_fork_child();
}

struct Init {
  Init() {
    (void)real();
    pthread_atfork(fork_prepare, fork_parent, fork_child);
    process_start();
  }
} init;

}  // namespace

void leave_layer(Sock &s) {
  // Out of the epoll sets before the link goes (a scan looks at links without the lock).
  if (!stream_on_tcp(s)) return;
  multiplex_forget(s, true);
  if (stream_leave(s)) forget_sock(s);  // once: the descriptor may be reused after
}

namespace {

// The SDP socket of fd, settled out of negotiation; nullptr when the kernel serves fd.
std::shared_ptr<Sock> sdp_of(int fd, bool *failed, bool may_wait = true,
                             Waits waits = Waits::kOther) {
  *failed = false;
  std::shared_ptr<Sock> s = find_sock(fd);
  if (!s || !sdp_like(*s)) return nullptr;
  if (!settle(fd, s, may_wait, waits)) {
    *failed = true;
    return s;
  }
  if (s->state == State::kSdp && s->tx_tcp) {
    leave_layer(*s);
    if (s->state != State::kSdp) return nullptr;
  }
  return s->state == State::kSdp ? s : nullptr;
}

// The data path's lookup: an SDP socket of a small descriptor this thread used last time
// costs two loads (no reference count traffic); anything else takes sdp_of().
Sock *cached_sdp(int fd) {
  if (fd < 0 || fd >= kFast || fd != lookup_cache.fd) return nullptr;
  if (fast_gen[fd].load(std::memory_order_acquire) != lookup_cache.gen) return nullptr;
  Sock *s = lookup_cache.sock.get();
  return s && s->state == State::kSdp && !s->tx_tcp && !inherited(*s) ? s : nullptr;
}

Sock *sdp_for_io(int fd, bool *failed, bool *handled, int flags, Waits waits) {
  *failed = false;
  if (Sock *s = cached_sdp(fd)) {
    *handled = true;
    return s;
  }
  uint32_t gen = fd >= 0 && fd < kFast ? fast_gen[fd].load(std::memory_order_acquire) : 0;
  std::shared_ptr<Sock> s = sdp_of(fd, failed, !(flags & MSG_DONTWAIT), waits);
  *handled = s != nullptr;
  if (!s) return nullptr;
  Sock *raw = s.get();
  if (fd >= 0 && fd < kFast)
    lookup_cache = LookupCache{fd, gen, std::move(s)};
  else
    lookup_cache = LookupCache{-1, 0, std::move(s)};  // held until the next lookup
  return raw;
}

// kServedByKernel: the caller makes the call on the kernel's socket.
ssize_t kernel_serves(Sock &s, bool *handled) {
  leave_layer(s);
  *handled = false;
  return 0;
}

ssize_t do_send(int fd, const iovec *iov, int cnt, int flags, bool *handled) {
  bool failed;
  Sock *s = sdp_for_io(fd, &failed, handled, flags, Waits::kSend);
  if (failed) return -1;
  if (!s) return 0;
  ssize_t r = stream_send(*s, iov, cnt, flags);
  return r == kServedByKernel ? kernel_serves(*s, handled) : r;
}

ssize_t do_recv(int fd, const iovec *iov, int cnt, int flags, bool *handled) {
  bool failed;
  Sock *s = sdp_for_io(fd, &failed, handled, flags, Waits::kRecv);
  if (failed) return -1;
  if (!s) return 0;
  ssize_t r = stream_recv(*s, iov, cnt, flags);
  return r == kServedByKernel ? kernel_serves(*s, handled) : r;
}

// For a libc entry point this libc lacks.
int enosys() {
  errno = ENOSYS;
  return -1;
}

void fill_peer(int fd, sockaddr *addr, socklen_t *len) {
  if (addr && len) getpeername(fd, addr, len);
}

}  // namespace
}  // namespace sdp

using namespace sdp;

SDP_EXPORT int socket(int domain, int type, int protocol) {
  int fd = real().socket(domain, type, protocol);
  if (fd >= 0 && config().enabled && is_stream_inet(domain, type, protocol))
    track(fd, domain, type & SOCK_NONBLOCK);
  return fd;
}

SDP_EXPORT int connect(int fd, const sockaddr *addr, socklen_t len) {
  std::shared_ptr<Sock> s = find_sock(fd);
  if (!s || s->state != State::kCandidate || !addr) return real().connect(fd, addr, len);
  handshake_before_connect(*s, addr, len);
  int r = real().connect(fd, addr, len);
  int err = errno;
  if (r != 0 && err == EINPROGRESS && s->mark_fd >= 0) {
    // The handshake follows the connection at once: wait for it here (a local connection
    // completes within microseconds), and report the connection made.
    pollfd p{fd, POLLOUT, 0};
    real().poll(&p, 1, 5000);
    socklen_t el = sizeof err;
    real().getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el);
    r = err ? -1 : 0;
    if (r == 0 && p.revents == 0) r = -1, err = ETIMEDOUT;
  }
  if (r == 0) {
    handshake_after_connect(*s);
    return 0;
  }
  if (err == EINPROGRESS || err == EALREADY || err == EINTR) {
    handshake_forget(*s);
    s->reason = *s->reason ? s->reason : "nonblocking_connect";
    // The connection completes later, on TCP.
    write_stats(*s);
    forget_sock(*s);
  } else {
    handshake_forget(*s);  // a failed connect may be retried: the socket stays a candidate
  }
  errno = err;
  return -1;
}

SDP_EXPORT int listen(int fd, int backlog) {
  int r = real().listen(fd, backlog);
  if (r == 0) {
    std::shared_ptr<Sock> s = find_sock(fd);
    if (s && (s->state == State::kCandidate || s->state == State::kListener)) handshake_listen(*s);
  }
  return r;
}

SDP_EXPORT int accept4(int fd, sockaddr *addr, socklen_t *len, int flags) {
  int nfd = real().accept4(fd, addr, len, flags);
  if (nfd < 0) return nfd;
  std::shared_ptr<Sock> l = find_sock(fd);
  if (!l || l->state != State::kListener || strcmp(l->reason, "listener") != 0) return nfd;
  std::shared_ptr<Sock> s = track(nfd, l->domain, flags & SOCK_NONBLOCK);
  if (s) handshake_accepted(*s);
  return nfd;
}

SDP_EXPORT int accept(int fd, sockaddr *addr, socklen_t *len) {
  return accept4(fd, addr, len, 0);
}

SDP_EXPORT int close(int fd) {
  uint8_t f = fd >= 0 && fd < kFast ? fast[fd].load(std::memory_order_acquire) : 1;
  if (f && in_vfork_child()) return real().close(fd);
  if (f == 2 || fd >= kFast) {
    multiplex_close_epoll(fd);
    note_epoll_fd(fd, false);
  }
  if (fd >= 0 && f == 1) {
    if (std::shared_ptr<Sock> s = unmap_fd(fd))
      if (!release(s)) real().close(s->fd);
  }
  return real().close(fd);
}

// close_range and closefrom close descriptors in the kernel without close(): the layer's
// own in the range (its sockets, its epoll sets) are closed through close() first.
SDP_EXPORT int close_range(unsigned int first, unsigned int last, int flags) {
  static auto real_close_range =
      reinterpret_cast<int (*)(unsigned int, unsigned int, int)>(dlsym(RTLD_NEXT, "close_range"));
  // Python's subprocess calls it in a vfork()ed child, whose closes are the kernel's only.
  if (!(flags & CLOSE_RANGE_CLOEXEC) && first <= last && !in_vfork_child()) {
    std::vector<int> ours;
    for (unsigned int fd = first; fd <= last && fd < unsigned(kFast); ++fd)
      if (fast[fd].load(std::memory_order_acquire)) ours.push_back(int(fd));
    if (last >= unsigned(kFast)) {
      std::lock_guard<std::mutex> lk(tab_mu);
      for (const auto &[fd, s] : *tab)
        if (unsigned(fd) >= std::max(first, unsigned(kFast)) && unsigned(fd) <= last)
          ours.push_back(fd);
    }
    for (int fd : ours) close(fd);
  }
  return real_close_range ? real_close_range(first, last, flags) : enosys();
}

SDP_EXPORT void closefrom(int lowfd) {
  close_range(unsigned(std::max(lowfd, 0)), ~0u, 0);
}

SDP_EXPORT int shutdown(int fd, int how) {
  bool failed;
  std::shared_ptr<Sock> s = sdp_of(fd, &failed);
  if (failed) return -1;
  if (!s) return real().shutdown(fd, how);
  return stream_shutdown(*s, how);
}

#define SEND_OR(fd, iov, cnt, flags, fallback)           \
  do {                                                   \
    bool handled;                                        \
    ssize_t r_ = do_send(fd, iov, cnt, flags, &handled); \
    if (handled) return r_;                              \
    return fallback;                                     \
  } while (0)
#define RECV_OR(fd, iov, cnt, flags, fallback)           \
  do {                                                   \
    bool handled;                                        \
    ssize_t r_ = do_recv(fd, iov, cnt, flags, &handled); \
    if (handled) return r_;                              \
    return fallback;                                     \
  } while (0)

SDP_EXPORT ssize_t write(int fd, const void *buf, size_t n) {
  if (fd >= 0 && fd < 1 << 16 && !fast[fd].load(std::memory_order_acquire))
    return real().write(fd, buf, n);
  iovec v{const_cast<void *>(buf), n};
  SEND_OR(fd, &v, 1, 0, real().write(fd, buf, n));
}

SDP_EXPORT ssize_t send(int fd, const void *buf, size_t n, int flags) {
  iovec v{const_cast<void *>(buf), n};
  SEND_OR(fd, &v, 1, flags, real().sendto(fd, buf, n, flags, nullptr, 0));
}

SDP_EXPORT ssize_t sendto(int fd, const void *buf, size_t n, int flags, const sockaddr *to,
                          socklen_t tolen) {
  iovec v{const_cast<void *>(buf), n};
  SEND_OR(fd, &v, 1, flags, real().sendto(fd, buf, n, flags, to, tolen));
}

SDP_EXPORT ssize_t writev(int fd, const iovec *iov, int cnt) {
  SEND_OR(fd, iov, cnt, 0, real().writev(fd, iov, cnt));
}

SDP_EXPORT ssize_t sendmsg(int fd, const msghdr *m, int flags) {
  SEND_OR(fd, m->msg_iov, int(m->msg_iovlen), flags, real().sendmsg(fd, m, flags));
}

SDP_EXPORT ssize_t read(int fd, void *buf, size_t n) {
  if (fd >= 0 && fd < 1 << 16 && !fast[fd].load(std::memory_order_acquire))
    return real().read(fd, buf, n);
  iovec v{buf, n};
  RECV_OR(fd, &v, 1, 0, real().read(fd, buf, n));
}

SDP_EXPORT ssize_t __read_chk(int fd, void *buf, size_t n, size_t) {
  return read(fd, buf, n);
}

SDP_EXPORT ssize_t recv(int fd, void *buf, size_t n, int flags) {
  iovec v{buf, n};
  RECV_OR(fd, &v, 1, flags, real().recvfrom(fd, buf, n, flags, nullptr, nullptr));
}

SDP_EXPORT ssize_t __recv_chk(int fd, void *buf, size_t n, size_t, int flags) {
  return recv(fd, buf, n, flags);
}

SDP_EXPORT ssize_t recvfrom(int fd, void *buf, size_t n, int flags, sockaddr *from,
                            socklen_t *fromlen) {
  iovec v{buf, n};
  bool handled;
  ssize_t r = do_recv(fd, &v, 1, flags, &handled);
  if (!handled) return real().recvfrom(fd, buf, n, flags, from, fromlen);
  if (r >= 0) fill_peer(fd, from, fromlen);
  return r;
}

SDP_EXPORT ssize_t __recvfrom_chk(int fd, void *buf, size_t n, size_t, int flags, sockaddr *from,
                                  socklen_t *fromlen) {
  return recvfrom(fd, buf, n, flags, from, fromlen);
}

SDP_EXPORT ssize_t readv(int fd, const iovec *iov, int cnt) {
  RECV_OR(fd, iov, cnt, 0, real().readv(fd, iov, cnt));
}

namespace {

// recvmsg on an SDP socket (*handled), or nothing done.
ssize_t sdp_recvmsg(int fd, msghdr *m, int flags, bool *handled) {
  ssize_t r = do_recv(fd, m->msg_iov, int(m->msg_iovlen), flags, handled);
  if (*handled && r >= 0) {
    if (m->msg_name) {
      socklen_t l = m->msg_namelen;
      getpeername(fd, static_cast<sockaddr *>(m->msg_name), &l);
      m->msg_namelen = l;
    }
    m->msg_controllen = 0;
    m->msg_flags = 0;
  }
  return r;
}

}  // namespace

SDP_EXPORT ssize_t recvmsg(int fd, msghdr *m, int flags) {
  bool handled;
  ssize_t r = sdp_recvmsg(fd, m, flags, &handled);
  return handled ? r : real().recvmsg(fd, m, flags);
}

// recvmmsg and sendmmsg on an SDP socket are what the kernel makes of them on a stream
// socket: one recvmsg/sendmsg per entry. A blocking recvmmsg waits for every entry
// (MSG_WAITFORONE: for the first only), the timeout is looked at after each entry, and an
// error after the first entry ends the call with the entries done.
SDP_EXPORT int recvmmsg(int fd, mmsghdr *v, unsigned int n, int flags, timespec *timeout) {
  static auto real_recvmmsg =
      reinterpret_cast<int (*)(int, mmsghdr *, unsigned int, int, timespec *)>(
          dlsym(RTLD_NEXT, "recvmmsg"));
  const int64_t deadline =
      timeout ? int64_t(now_ns()) + timeout->tv_sec * 1000000000ll + timeout->tv_nsec : -1;
  unsigned int done = 0;
  for (; done < n; ++done) {
    bool handled;
    ssize_t r = sdp_recvmsg(fd, &v[done].msg_hdr, flags & ~MSG_WAITFORONE, &handled);
    if (!handled) {
      if (done == 0) return real_recvmmsg ? real_recvmmsg(fd, v, n, flags, timeout) : enosys();
      break;  // the connection went back to TCP: the next call goes to the kernel
    }
    if (r < 0) {
      if (done == 0) return -1;
      break;
    }
    v[done].msg_len = static_cast<unsigned int>(r);
    if (flags & MSG_WAITFORONE) flags |= MSG_DONTWAIT;
    if (deadline >= 0 && int64_t(now_ns()) >= deadline) {
      ++done;
      break;
    }
  }
  return static_cast<int>(done);
}

SDP_EXPORT int sendmmsg(int fd, mmsghdr *v, unsigned int n, int flags) {
  static auto real_sendmmsg =
      reinterpret_cast<int (*)(int, mmsghdr *, unsigned int, int)>(dlsym(RTLD_NEXT, "sendmmsg"));
  unsigned int done = 0;
  for (; done < n; ++done) {
    const msghdr &m = v[done].msg_hdr;
    bool handled;
    ssize_t r = do_send(fd, m.msg_iov, int(m.msg_iovlen), flags, &handled);
    if (!handled) {
      if (done == 0) return real_sendmmsg ? real_sendmmsg(fd, v, n, flags) : enosys();
      break;
    }
    if (r < 0) {
      if (done == 0) return -1;
      break;
    }
    v[done].msg_len = static_cast<unsigned int>(r);
  }
  return static_cast<int>(done);
}

// splice moves bytes between the kernel's socket and a pipe, past the layer: a connection
// a program splices goes back to TCP first (as with fdopen), then the kernel splices.
SDP_EXPORT ssize_t splice(int in, loff_t *in_off, int out, loff_t *out_off, size_t len,
                          unsigned int flags) {
  static auto real_splice =
      reinterpret_cast<ssize_t (*)(int, loff_t *, int, loff_t *, size_t, unsigned int)>(
          dlsym(RTLD_NEXT, "splice"));
  for (int fd : {in, out}) {
    bool failed;
    if (std::shared_ptr<Sock> s = sdp_of(fd, &failed)) {
      logf("fd %d: splice: the connection goes back to TCP (splice bypasses the layer)", fd);
      hand_back_sock(*s);
    }
  }
  return real_splice ? real_splice(in, in_off, out, out_off, len, flags) : enosys();
}

SDP_EXPORT ssize_t sendfile(int out, int in, off_t *offset, size_t count) {
  bool failed;
  std::shared_ptr<Sock> s = sdp_of(out, &failed, true, Waits::kSend);
  if (failed) return -1;
  if (!s) return real().sendfile(out, in, offset, count);
  // The socket layer has no page cache path: read, then send (one copy more than TCP).
  char buf[65536];
  size_t done = 0;
  while (done < count) {
    size_t want = std::min(sizeof buf, count - done);
    ssize_t n = offset ? pread(in, buf, want, *offset + off_t(done)) : real().read(in, buf, want);
    if (n < 0) return done ? ssize_t(done) : -1;
    if (n == 0) break;
    iovec v{buf, size_t(n)};
    ssize_t w = stream_send(*s, &v, 1, 0);
    if (w == kServedByKernel) {  // the connection went back to TCP: the kernel sends the rest
      leave_layer(*s);
      if (!offset) lseek(in, -n, SEEK_CUR);
      off_t at = offset ? *offset + off_t(done) : 0;
      ssize_t k = real().sendfile(out, in, offset ? &at : nullptr, count - done);
      if (k > 0) done += size_t(k);
      if (offset) *offset += off_t(done);
      return done || k >= 0 ? ssize_t(done) : -1;
    }
    if (w < 0) {
      int err = errno;
      if (!offset) lseek(in, -n, SEEK_CUR);  // not sent: the file position stays before it
      errno = err;
      return done ? ssize_t(done) : -1;
    }
    done += size_t(w);
    if (w < n) {
      if (!offset) lseek(in, w - n, SEEK_CUR);
      break;
    }
  }
  if (offset) *offset += off_t(done);
  return ssize_t(done);
}

SDP_EXPORT ssize_t sendfile64(int out, int in, off_t *offset, size_t count) {
  return sendfile(out, in, offset, count);
}

SDP_EXPORT int fcntl(int fd, int cmd, ...) {
  va_list ap;
  va_start(ap, cmd);
  long arg = va_arg(ap, long);
  va_end(ap);
  int r = real().fcntl(fd, cmd, arg);
  if (r < 0) return r;
  std::shared_ptr<Sock> s = find_sock(fd);
  if (!s) return r;
  if (cmd == F_SETFL) s->nonblocking = arg & O_NONBLOCK;
  if ((cmd == F_DUPFD || cmd == F_DUPFD_CLOEXEC) && !in_vfork_child()) map_fd(r, s);
  return r;
}

SDP_EXPORT int fcntl64(int fd, int cmd, ...) {
  va_list ap;
  va_start(ap, cmd);
  long arg = va_arg(ap, long);
  va_end(ap);
  return fcntl(fd, cmd, arg);
}

SDP_EXPORT int ioctl(int fd, unsigned long req, ...) {
  va_list ap;
  va_start(ap, req);
  void *arg = va_arg(ap, void *);
  va_end(ap);
  std::shared_ptr<Sock> s = find_sock(fd);
  if (s && req == FIONREAD && sdp_like(*s)) {
    // Negotiating: the kernel holds handshake bytes, none of the program's yet.
    if (negotiating(*s)) {
      std::lock_guard<SockMutex> lk(s->mu);
      handshake_progress(*s);
    }
    if (s->state == State::kSdp || negotiating(*s)) {
      *static_cast<int *>(arg) = s->state == State::kSdp ? stream_fionread(*s) : 0;
      return 0;
    }
  }
  int r = real().ioctl(fd, req, arg);
  if (r == 0 && s && req == FIONBIO) s->nonblocking = *static_cast<int *>(arg) != 0;
  return r;
}

SDP_EXPORT int dup(int fd) {
  int r = real().dup(fd);
  if (r >= 0)
    if (std::shared_ptr<Sock> s = find_sock(fd); s && !in_vfork_child()) map_fd(r, s);
  return r;
}

static int after_dup_to(int fd, int nfd, int r) {
  if (r < 0 || fd == nfd) return r;
  std::shared_ptr<Sock> s = find_sock(fd);
  // Only descriptors the layer knows cost the vfork check (a system call).
  if ((s || find_sock(nfd)) && in_vfork_child()) return r;
  // nfd was closed by the kernel: release what the layer held for it.
  if (std::shared_ptr<Sock> old = unmap_fd(nfd))
    if (!release(old)) real().close(old->fd);
  if (s) map_fd(nfd, s);
  return r;
}

SDP_EXPORT int dup2(int fd, int nfd) {
  return after_dup_to(fd, nfd, real().dup2(fd, nfd));
}
SDP_EXPORT int dup3(int fd, int nfd, int flags) {
  return after_dup_to(fd, nfd, real().dup3(fd, nfd, flags));
}

// stdio reads and writes a descriptor through glibc's internal calls, which the layer does
// not see: a connection a program wraps in a FILE goes back to TCP first.
SDP_EXPORT FILE *fdopen(int fd, const char *mode) {
  static auto real_fdopen =
      reinterpret_cast<FILE *(*)(int, const char *)>(dlsym(RTLD_NEXT, "fdopen"));
  bool failed;
  if (std::shared_ptr<Sock> s = sdp_of(fd, &failed)) {
    logf("fd %d: fdopen: the connection goes back to TCP (stdio bypasses the layer)", fd);
    hand_back_sock(*s);
  }
  return real_fdopen(fd, mode);
}

SDP_EXPORT int getsockopt(int fd, int level, int name, void *val, socklen_t *len) {
  std::shared_ptr<Sock> s = find_sock(fd);
  if (level == IPPROTO_TCP && (name == SDP_ZCOPY_THRESH || name == PCIENTB_SDP_STATS) && val &&
      len) {
    if (!s && !config().enabled) {
      errno = ENOPROTOOPT;
      return -1;
    }
    if (name == SDP_ZCOPY_THRESH && *len >= sizeof(int)) {
      *static_cast<int *>(val) = s ? zcopy_threshold(*s) : config().zcopy_thresh;
      *len = sizeof(int);
      return 0;
    }
    // The first version of the struct ended at zcopy_rx: such a buffer gets what fits.
    if (name == PCIENTB_SDP_STATS && *len >= offsetof(pcientb_sdp_stats, onesided_tx)) {
      pcientb_sdp_stats st{PCIENTB_SDP_PATH_TCP, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
      if (s) {
        std::lock_guard<SockMutex> lk(s->mu);
        st = s->stats;
      }
      *len = std::min<socklen_t>(*len, sizeof st);
      memcpy(val, &st, *len);
      return 0;
    }
    errno = EINVAL;
    return -1;
  }
  if (s && s->state == State::kSdp && level == SOL_SOCKET && name == SO_ERROR && val && len &&
      *len >= sizeof(int)) {
    std::lock_guard<SockMutex> lk(s->mu);
    *static_cast<int *>(val) = s->error;
    *len = sizeof(int);
    return 0;
  }
  return real().getsockopt(fd, level, name, val, len);
}

SDP_EXPORT int setsockopt(int fd, int level, int name, const void *val, socklen_t len) {
  if (level == IPPROTO_TCP && (name == PCIENTB_SDP_EXPOSE || name == PCIENTB_SDP_WRITE)) {
    if (!val || len < sizeof(pcientb_sdp_window)) {
      errno = EINVAL;
      return -1;
    }
    bool failed;
    std::shared_ptr<Sock> s = sdp_of(fd, &failed);
    if (failed) return -1;
    if (!s) {  // the kernel's TCP socket: no windows there
      errno = ENOPROTOOPT;
      return -1;
    }
    const auto *w = static_cast<const pcientb_sdp_window *>(val);
    return name == PCIENTB_SDP_EXPOSE ? stream_expose(*s, w->addr, w->len)
                                      : stream_write_window(*s, w->addr, w->len, w->offset);
  }
  if (level == IPPROTO_TCP && name == SDP_ZCOPY_THRESH) {
    std::shared_ptr<Sock> s = find_sock(fd);
    if (!s && !config().enabled) {
      errno = ENOPROTOOPT;
      return -1;
    }
    if (!val || len < sizeof(int) || *static_cast<const int *>(val) < SDP_ZCOPY_AUTO) {
      errno = EINVAL;
      return -1;
    }
    if (s) s->zcopy_thresh = *static_cast<const int *>(val);
    return 0;
  }
  int r = real().setsockopt(fd, level, name, val, len);
  if (r == 0 && level == SOL_SOCKET && (name == SO_RCVTIMEO || name == SO_SNDTIMEO) && val &&
      len >= sizeof(timeval)) {
    if (std::shared_ptr<Sock> s = find_sock(fd)) {  // the layer's waits keep them too
      const timeval *tv = static_cast<const timeval *>(val);
      int64_t ns = int64_t(tv->tv_sec) * 1000000000ll + int64_t(tv->tv_usec) * 1000;
      (name == SO_RCVTIMEO ? s->rcv_timeo_ns : s->snd_timeo_ns) = ns;
    }
  }
  return r;
}
