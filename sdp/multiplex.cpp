// poll, ppoll, select, pselect and epoll over SDP sockets and ordinary descriptors together.
//
// The kernel cannot see an SDP socket's data (it arrives in the ring by RDMA), so a waiter asks the
// stream for readiness, busy-polls a while (SpinWindow), then sleeps in the kernel on the ordinary
// descriptors plus, for each SDP socket, its completion channel (armed: the next arrival, data or
// credit, wakes it) and its kernel socket (the peer's end). For epoll the program's registrations
// of SDP sockets live here (level- and edge-triggered, oneshot) and the kernel set holds those two
// descriptors with tagged data.
#include <dlfcn.h>
#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/select.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <unordered_map>

#include "sdp.hpp"
#include "spin.hpp"

#define SDP_EXPORT extern "C" __attribute__((visibility("default")))

namespace sdp {

void note_epoll_fd(int epfd, bool on);  // interpose.cpp

namespace {

// Readiness of a socket the layer holds, as poll reports it; -1 when the kernel now serves
// it (it stayed on TCP, or went back to it).
int sock_revents(const std::shared_ptr<Sock> &s, short events, uint64_t *changes = nullptr) {
  if (negotiating(*s)) {
    std::lock_guard<SockMutex> lk(s->mu);
    handshake_progress(*s);
  }
  if (s->state != State::kSdp) return sdp_like(*s) ? 0 : -1;
  bool on_tcp = false;
  short r = stream_poll(*s, changes, &on_tcp);
  if (on_tcp) {
    leave_layer(*s);
    return -1;
  }
  return r & (events | POLLERR | POLLHUP | POLLNVAL);
}

// What the kernel is asked about an SDP socket's own descriptor: its end (and, until it
// holds data that is not the layer's, readability).
short own_events(const Sock &s) {
  return short(s.tcp_early ? POLLRDHUP : POLLIN | POLLRDHUP);
}

// A wait's end: deadline_ns < 0 waits for ever.
int remaining_ms(int64_t deadline_ns) {
  if (deadline_ns < 0) return -1;
  int64_t left = deadline_ns - int64_t(now_ns());
  return left <= 0 ? 0 : int((left + 999999) / 1000000);
}

int mux_poll(pollfd *fds, nfds_t n, int64_t timeout_ns, const sigset_t *mask) {
  std::vector<std::shared_ptr<Sock>> socks(n);
  bool any = false;
  for (nfds_t i = 0; i < n; ++i) {
    std::shared_ptr<Sock> s = find_sock(fds[i].fd);
    if (s && sdp_like(*s)) {
      socks[i] = std::move(s);
      any = true;
    }
  }
  if (!any) {
    if (timeout_ns < 0 && !mask) return real().poll(fds, n, -1);
    timespec ts{timeout_ns / 1000000000, timeout_ns % 1000000000};
    return real().ppoll(fds, n, timeout_ns < 0 ? nullptr : &ts, mask);
  }
  const int64_t start = int64_t(now_ns());
  const int64_t deadline = timeout_ns < 0 ? -1 : start + timeout_ns;
  WaitSpin spin;
  const int64_t spin_end = start + spin.ns();
  std::vector<pollfd> k;
  std::vector<nfds_t> kidx;
  for (;;) {
    int ready = 0;
    k.clear();
    kidx.clear();
    for (nfds_t i = 0; i < n; ++i) {
      fds[i].revents = 0;
      if (socks[i]) {
        int r = sock_revents(socks[i], fds[i].events);
        if (r >= 0) {
          fds[i].revents = short(r);
          ready += r != 0;
          continue;
        }
        socks[i] = nullptr;
      }
      k.push_back(fds[i]);
      kidx.push_back(i);
    }
    // The kernel's view, without waiting: the program's other descriptors, and each SDP
    // socket's own (a peer that died shows only there; a busy poller must see it too).
    const size_t plain = k.size();
    for (nfds_t i = 0; i < n; ++i)
      if (socks[i]) {
        k.push_back({socks[i]->fd, own_events(*socks[i]), 0});
        kidx.push_back(i);
      }
    if (!k.empty() && real().poll(k.data(), k.size(), 0) > 0) {
      for (size_t j = 0; j < plain; ++j) {
        fds[kidx[j]].revents = k[j].revents;
        ready += k[j].revents != 0;
      }
      for (size_t j = plain; j < k.size(); ++j) {
        if (!k[j].revents) continue;
        const nfds_t i = kidx[j];
        stream_check_peer(*socks[i], k[j].revents & (POLLRDHUP | POLLHUP | POLLERR));
        const bool was = fds[i].revents != 0;
        int r = sock_revents(socks[i], fds[i].events);
        fds[i].revents = short(r > 0 ? r : 0);
        ready += !was && fds[i].revents != 0;
      }
    }
    k.resize(plain);
    kidx.resize(plain);
    if (ready) return ready;
    const int64_t now = int64_t(now_ns());
    if (deadline >= 0 && now >= deadline) {
      spin.timed_out = true;
      return 0;
    }
    if (now < spin_end) {
      sched_yield();
      continue;
    }
    // Sleep: counted as asleep (a wakeup another thread takes from now on kicks), arm every
    // SDP socket, look once more, then wait on the kernel. Arming unmasks the node's doorbell:
    // what the last look finds counts as a sleep too, a short one.
    spin.sleeping(spin_end);
    for (nfds_t i = 0; i < n; ++i)
      if (socks[i]) ++socks[i]->sleepers;
    const size_t kernel_n = k.size();
    std::vector<ibv_cq *> cqs(n, nullptr);  // what each socket armed
    for (nfds_t i = 0; i < n; ++i) {
      // Negotiating ones with a link too: the last look below may finish their handshake.
      int channel_fd = -1;
      if (!socks[i] || !sdp_like(*socks[i]) || !(cqs[i] = stream_arm(*socks[i], &channel_fd)))
        continue;
      k.push_back({channel_fd, POLLIN, 0});
      kidx.push_back(i);
    }
    // Ready, left the layer (-1), or given a link by the last look (a handshake it advanced:
    // nothing armed or watched of it): look again instead of sleeping.
    bool late = false;
    for (nfds_t i = 0; i < n && !late; ++i)
      if (socks[i])
        late = sock_revents(socks[i], fds[i].events) != 0 || stream_cq(*socks[i]) != cqs[i];
    if (late) {
      for (nfds_t i = 0; i < n; ++i)
        if (socks[i]) --socks[i]->sleepers;
      continue;
    }
    const size_t chan_end = k.size();
    for (nfds_t i = 0; i < n; ++i)
      if (socks[i]) {
        k.push_back({socks[i]->fd, own_events(*socks[i]), 0});
        kidx.push_back(i);
      }
    const size_t sock_end = k.size();
    for (nfds_t i = 0; i < n; ++i)
      if (socks[i] && socks[i]->link.kick_fd >= 0) {
        k.push_back({socks[i]->link.kick_fd, POLLIN, 0});
        kidx.push_back(i);
      }
    int ms = remaining_ms(deadline);
    timespec ts{ms / 1000, (ms % 1000) * 1000000l};
    int r = real().ppoll(k.data(), k.size(), ms < 0 ? nullptr : &ts, mask);
    int err = errno;
    for (nfds_t i = 0; i < n; ++i)
      if (socks[i]) --socks[i]->sleepers;
    if (r < 0) {
      errno = err;
      return -1;
    }
    for (size_t j = sock_end; j < k.size(); ++j)
      if (k[j].revents) stream_take_kick(*socks[kidx[j]]);
    for (size_t j = kernel_n; j < chan_end; ++j)
      if (k[j].revents) link_drain(socks[kidx[j]]->link);
    for (size_t j = chan_end; j < sock_end; ++j)
      if (k[j].revents)
        stream_check_peer(*socks[kidx[j]], k[j].revents & (POLLRDHUP | POLLHUP | POLLERR));
  }
}

int64_t ts_ns(const timespec *ts) {
  return ts ? int64_t(ts->tv_sec) * 1000000000ll + ts->tv_nsec : -1;
}

bool select_has_sdp(int nfds, fd_set *r, fd_set *w, fd_set *e) {
  for (int fd = 0; fd < nfds; ++fd) {
    if (!((r && FD_ISSET(fd, r)) || (w && FD_ISSET(fd, w)) || (e && FD_ISSET(fd, e)))) continue;
    std::shared_ptr<Sock> s = find_sock(fd);
    if (s && sdp_like(*s)) return true;
  }
  return false;
}

int mux_select(int nfds, fd_set *r, fd_set *w, fd_set *e, int64_t timeout_ns,
               const sigset_t *mask) {
  std::vector<pollfd> p;
  for (int fd = 0; fd < nfds; ++fd) {
    short ev = short((r && FD_ISSET(fd, r) ? POLLIN : 0) | (w && FD_ISSET(fd, w) ? POLLOUT : 0) |
                     (e && FD_ISSET(fd, e) ? POLLPRI : 0));
    if (ev) p.push_back({fd, ev, 0});
  }
  int n = mux_poll(p.data(), p.size(), timeout_ns, mask);
  if (n < 0) return n;
  for (const pollfd &x : p) {
    if (x.revents & POLLNVAL) {
      errno = EBADF;
      return -1;
    }
  }
  if (r) FD_ZERO(r);
  if (w) FD_ZERO(w);
  if (e) FD_ZERO(e);
  int count = 0;
  for (const pollfd &x : p) {
    if (r && (x.events & POLLIN) && (x.revents & (POLLIN | POLLHUP | POLLERR)))
      FD_SET(x.fd, r), ++count;
    if (w && (x.events & POLLOUT) && (x.revents & (POLLOUT | POLLERR))) FD_SET(x.fd, w), ++count;
    if (e && (x.events & POLLPRI) && (x.revents & POLLPRI)) FD_SET(x.fd, e), ++count;
  }
  return count;
}

// ---- epoll ---------------------------------------------------------------------------------

constexpr uint64_t kTag = 0xfedc000000000000ull;  // no user pointer has these top bits
constexpr uint64_t kTagMask = 0xffff000000000000ull;
// kind 0: the socket's own descriptor, 1: its completion channel, 2: its kick.
uint64_t tag(int fd, int kind) {
  return kTag | (uint64_t(uint32_t(fd)) << 2) | uint64_t(kind);
}

struct Reg {
  std::shared_ptr<Sock> s;
  uint32_t events = 0;
  epoll_data_t data{};
  bool kernel = false;        // registered in the kernel as the program asked (not SDP yet)
  bool disabled = false;      // EPOLLONESHOT fired
  bool watched_link = false;  // its channel and kick are in the kernel set
  uint32_t last = 0;          // edge-triggered: what was reported and still holds
  uint64_t rx_seen = 0, tx_seen = 0;
  int channel_fd = -1;  // its CQ group's channel, counted in EpSet::channels
  // Removed by the program (EPOLL_CTL_DEL), its kernel watches kept until the socket
  // closes: event loops that take a socket out and put it back per request (redis-benchmark
  // does, per reply) pay no system call for it.
  bool ghost = false;
  bool idle = false;          // found with nothing to report ...
  uint64_t idle_changes = 0;  // ... when its lock had been released this many times
};

struct EpSet {
  std::mutex mu;
  std::map<int, Reg> regs;      // by the program's descriptor
  std::map<int, int> channels;  // CQ group channels in the kernel set: registrations using each
  // Written when a registration of the layer's is added or re-armed: a thread asleep in the
  // kernel on this set looks again (the kernel saw no change of its own).
  int wake_fd = -1;
  std::atomic<int> sleepers{0};  // threads asleep in the kernel on this set: wake_fd is for them
  ~EpSet() {
    if (wake_fd >= 0) real().close(wake_fd);
  }
};

constexpr uint64_t kWakeTag = 0xfedcffffffffffffull;  // the set's wake_fd (no socket's tag)

// After a change of a registration (made under set.mu): a thread counted asleep before it
// looks again; one counted after it looks at the registrations before it sleeps.
void wake_sleepers(EpSet &set) {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (set.sleepers.load(std::memory_order_relaxed) == 0) return;
  uint64_t one = 1;
  if (set.wake_fd >= 0) (void)!syscall(SYS_write, set.wake_fd, &one, sizeof one);
}

std::mutex sets_mu;
auto *sets = new std::unordered_map<int, std::shared_ptr<EpSet>>();

// Threads asleep in the kernel on a set the layer holds no state for (say, a worker's set
// before the program has any socket of the layer). A socket of the layer added to such a set
// arms nothing they wait on, so the layer's state made for a set wakes them: its wake_fd
// starts readable.
std::atomic<int> plain_sleepers{0};

std::shared_ptr<EpSet> find_set(int epfd, bool create) {
  std::lock_guard<std::mutex> lk(sets_mu);
  auto it = sets->find(epfd);
  if (it != sets->end()) return it->second;
  if (!create) return nullptr;
  auto set = std::make_shared<EpSet>();
  set->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (set->wake_fd >= 0) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = kWakeTag;
    real().epoll_ctl(epfd, EPOLL_CTL_ADD, set->wake_fd, &ev);
    // After the waiter's count, before its look at the table (both under sets_mu's order).
    if (plain_sleepers.load() > 0) {
      uint64_t one = 1;
      (void)!syscall(SYS_write, set->wake_fd, &one, sizeof one);
    }
  }
  (*sets)[epfd] = set;
  note_epoll_fd(epfd, true);
  return set;
}

// Moves a registration to the layer: the kernel watches the socket's own descriptor, its
// kick, and its CQ group's channel for it (the channel once per set, however many of the
// set's sockets share it).
void watch(int epfd, EpSet &set, int fd, Reg &reg) {
  if (reg.kernel) {
    real().epoll_ctl(epfd, EPOLL_CTL_DEL, fd, nullptr);
    reg.kernel = false;
  }
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP;
  ev.data.u64 = tag(fd, 0);
  real().epoll_ctl(epfd, EPOLL_CTL_ADD, reg.s->fd, &ev);
  if (ibv_comp_channel *channel = reg.s->link.channel) {  // read once: link_create may run
    const int ch = channel->fd;
    reg.channel_fd = ch;
    if (set.channels[ch]++ == 0) {
      ev.events = EPOLLIN;
      ev.data.u64 = tag(ch, 1);
      real().epoll_ctl(epfd, EPOLL_CTL_ADD, ch, &ev);
    }
  }
  if (reg.s->link.kick_fd >= 0) {
    ev.events = EPOLLIN;
    ev.data.u64 = tag(fd, 2);
    real().epoll_ctl(epfd, EPOLL_CTL_ADD, reg.s->link.kick_fd, &ev);
  }
  reg.watched_link = reg.channel_fd >= 0;
}

void unwatch(int epfd, EpSet &set, Reg &reg) {
  if (reg.kernel) return;
  real().epoll_ctl(epfd, EPOLL_CTL_DEL, reg.s->fd, nullptr);
  if (reg.channel_fd >= 0) {
    auto it = set.channels.find(reg.channel_fd);
    if (it != set.channels.end() && --it->second == 0) {
      real().epoll_ctl(epfd, EPOLL_CTL_DEL, reg.channel_fd, nullptr);
      set.channels.erase(it);
    }
    reg.channel_fd = -1;
  }
  if (reg.s->link.kick_fd >= 0) real().epoll_ctl(epfd, EPOLL_CTL_DEL, reg.s->link.kick_fd, nullptr);
}

// The registrations that are ready, as the program asked for them. `full`: look at every
// one; else skip an SDP socket found idle before when nothing may have changed since (its
// lock not taken since then, nothing in its CQ): a server with many connections pays for
// those with news, not for all of them. A sleeper looks at every one after arming.
int scan(int epfd, EpSet &set, epoll_event *out, int max, bool full) {
  // Copies, not pointers: another thread may change or remove a registration while this one
  // looks at the socket (without the set's lock, which is never held while taking a socket's).
  struct Todo {
    int fd;
    std::shared_ptr<Sock> s;
    uint32_t events;
    int r = 0;
    uint64_t changes = 0;  // the socket's, as its evaluation left it
    uint64_t rx = 0, tx = 0;
  };
  static thread_local std::vector<Todo> todo;
  todo.clear();
  if (!full) link_dispatch_all();  // news of every link, from a few CQs
  std::vector<int> fallen;
  {
    std::lock_guard<std::mutex> lk(set.mu);
    for (auto &[fd, reg] : set.regs) {
      if (sdp_like(*reg.s) && reg.kernel) watch(epfd, set, fd, reg);  // it became SDP meanwhile
      if (!reg.kernel && !reg.watched_link && reg.s->link.channel) {
        // Registered while negotiating: its channel and kick exist now.
        real().epoll_ctl(epfd, EPOLL_CTL_DEL, reg.s->fd, nullptr);
        watch(epfd, set, fd, reg);
      }
      if (reg.kernel || reg.disabled || reg.ghost) continue;
      // Safe without the socket's lock: its link goes only after close took the
      // registration out of this set, under the set's lock held here.
      const Sock &s = *reg.s;
      if (!full && reg.idle && s.state == State::kSdp && !inherited(s) &&
          s.mu.changes() == reg.idle_changes && !link_has_news(s.link))
        continue;
      todo.push_back({fd, reg.s, reg.events});
    }
  }
  for (Todo &t : todo) {
    t.r = sock_revents(t.s, short(t.events), &t.changes);
    if (t.r >= 0 && (t.events & EPOLLET)) {
      std::lock_guard<SockMutex> sl(t.s->mu);
      t.rx = t.s->rx_produced + t.s->fin_arrived + uint64_t(t.s->error);
      t.tx = t.s->peer_consumed;
      ++t.changes;  // this lock's release
    }
  }
  int n = 0;
  {
    std::lock_guard<std::mutex> lk(set.mu);
    for (const Todo &t : todo) {
      if (n >= max) break;
      if (t.r < 0) {
        fallen.push_back(t.fd);
        continue;
      }
      auto it = set.regs.find(t.fd);
      if (it == set.regs.end() || it->second.s != t.s || it->second.disabled || it->second.kernel ||
          it->second.ghost)
        continue;  // removed, replaced, or taken by another thread (oneshot) meanwhile
      Reg &reg = it->second;
      uint32_t ev = uint32_t(t.r) & (reg.events | EPOLLERR | EPOLLHUP);
      // Nothing to report, and nothing will be until the socket changes: skipped until then.
      reg.idle = ev == 0 && t.s->state == State::kSdp && t.events == reg.events;
      reg.idle_changes = t.changes;
      if (reg.events & EPOLLET) {
        reg.last &= ev;  // a condition that ended may be reported again when it comes back
        uint32_t fresh = ev & ~reg.last;
        if ((ev & EPOLLIN) && t.rx != reg.rx_seen) fresh |= EPOLLIN;
        if ((ev & EPOLLOUT) && t.tx != reg.tx_seen) fresh |= EPOLLOUT;
        reg.rx_seen = t.rx;
        reg.tx_seen = t.tx;
        reg.last |= ev;
        ev = fresh;
      }
      if (!ev) continue;
      out[n].events = ev;
      out[n].data = reg.data;
      ++n;
      if (reg.events & EPOLLONESHOT) reg.disabled = true;
    }
  }
  todo.clear();  // the sockets' references go now, not at the next call
  if (!fallen.empty()) {
    // It stayed on TCP: the kernel takes the registration as the program made it.
    std::lock_guard<std::mutex> lk(set.mu);
    for (int fd : fallen) {
      auto it = set.regs.find(fd);
      if (it == set.regs.end()) continue;
      unwatch(epfd, set, it->second);
      epoll_event ev{it->second.events, it->second.data};
      real().epoll_ctl(epfd, EPOLL_CTL_ADD, fd, &ev);
      set.regs.erase(it);
    }
  }
  return n;
}

// Takes in what the kernel reported: the program's own events, and wakeups of SDP sockets.
int take_kernel(int epfd, EpSet &set, epoll_event *k, int kn, epoll_event *out, int n, int max) {
  for (int i = 0; i < kn; ++i) {
    if ((k[i].data.u64 & kTagMask) != kTag) {
      if (n < max) out[n++] = k[i];
      continue;
    }
    if (k[i].data.u64 == kWakeTag) {
      uint64_t v;
      (void)!syscall(SYS_read, set.wake_fd, &v, sizeof v);
      continue;
    }
    int fd = int((k[i].data.u64 >> 2) & 0xffffffffu);
    std::shared_ptr<Sock> s;
    {
      std::lock_guard<std::mutex> lk(set.mu);
      auto it = set.regs.find(fd);
      if (it != set.regs.end()) s = it->second.s;
    }
    const uint64_t kind = k[i].data.u64 & 3;
    if (s && kind == 0 && s->state == State::kSdp) {
      stream_check_peer(*s, k[i].events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR));
      // Its end stays readable for good: the stream reports it from now on (level).
      if (s->peer_gone) {
        real().epoll_ctl(epfd, EPOLL_CTL_DEL, s->fd, nullptr);
      } else if (s->tcp_early) {
        epoll_event ev{};
        ev.events = EPOLLRDHUP;
        ev.data.u64 = tag(fd, 0);
        real().epoll_ctl(epfd, EPOLL_CTL_MOD, s->fd, &ev);
      }
    }
    if (kind == 1) link_drain_channel(fd);  // fd: the channel's own
    if (s && kind == 2) stream_take_kick(*s);
  }
  return n;
}

// The kernel's wait on a set the layer holds no state for. `*set` is the state the layer
// made for it meanwhile, if it did: then the events may hold the layer's tags.
template <class Wait>
int plain_wait(int epfd, std::shared_ptr<EpSet> *set, Wait wait) {
  ++plain_sleepers;
  *set = find_set(epfd, false);  // made before the count: no wake was written for this thread
  if (*set) {
    --plain_sleepers;
    return 0;
  }
  int kn = wait();
  int err = errno;
  --plain_sleepers;
  *set = find_set(epfd, false);
  errno = err;
  return kn;
}

int mux_epoll_wait(int epfd, epoll_event *out, int max, int timeout_ms, const sigset_t *mask) {
  std::shared_ptr<EpSet> set = find_set(epfd, false);
  if (max <= 0) return real().epoll_pwait(epfd, out, max, timeout_ms, mask);
  if (!set) {
    const int64_t started = timeout_ms > 0 ? int64_t(now_ns()) : 0;
    int kn = plain_wait(epfd, &set,
                        [&] { return real().epoll_pwait(epfd, out, max, timeout_ms, mask); });
    if (!set || kn < 0) return kn;
    int n = take_kernel(epfd, *set, out, kn, out, 0, max);  // in place: n <= i
    if (n || timeout_ms == 0) return n;
    if (timeout_ms > 0) {
      timeout_ms = remaining_ms(started + int64_t(timeout_ms) * 1000000);
      if (timeout_ms == 0) return 0;
    }
  }
  bool empty;
  {
    std::lock_guard<std::mutex> lk(set->mu);
    empty = set->regs.empty();
  }
  const int64_t start = int64_t(now_ns());
  const int64_t deadline = timeout_ms < 0 ? -1 : start + int64_t(timeout_ms) * 1000000;
  WaitSpin spin;
  const int64_t spin_end = start + spin.ns();
  // Programs pass their whole set size as max (redis: 10128): the buffer is kept per thread,
  // not allocated and zeroed per call.
  static thread_local std::vector<epoll_event> k;
  if (k.size() < size_t(max)) k.resize(size_t(max));
  while (empty) {
    // No socket of the layer (left, or fell back to TCP) but the set's wake eventfd is
    // still there, and may be readable: its event is the layer's, never the program's.
    ++set->sleepers;
    {
      std::lock_guard<std::mutex> lk(set->mu);
      empty = set->regs.empty();  // a socket added meanwhile did not wake this thread
    }
    if (!empty) {
      --set->sleepers;
      break;
    }
    int kn = real().epoll_pwait(epfd, k.data(), max, remaining_ms(deadline), mask);
    int err = errno;
    --set->sleepers;
    if (kn <= 0) {
      errno = err;
      return kn;
    }
    int n = take_kernel(epfd, *set, k.data(), kn, out, 0, max);
    if (n || (deadline >= 0 && int64_t(now_ns()) >= deadline)) return n;
    std::lock_guard<std::mutex> lk(set->mu);
    empty = set->regs.empty();
  }
  // While spinning, the kernel's part of the set (the program's other descriptors, the
  // layer's wakeups) is looked at first, then every kKernelEveryNs: a system call (and a
  // yield of the CPU) per round cost more than the round's look at the SDP sockets.
  constexpr int64_t kKernelEveryNs = 16000;
  int64_t kernel_due = 0;
  for (;;) {
    int n = scan(epfd, *set, out, max, false);
    const int64_t now = int64_t(now_ns());
    const bool kernel = n < max && now >= kernel_due;
    if (kernel) {
      kernel_due = now + kKernelEveryNs;
      // Never more than the caller can take: what the kernel hands over leaves its ready list
      // (edge-triggered and oneshot events of other descriptors would be lost).
      int kn = real().epoll_wait(epfd, k.data(), max - n, 0);
      if (kn > 0) n = take_kernel(epfd, *set, k.data(), kn, out, n, max);
    }
    if (n) return n;
    if (deadline >= 0 && now >= deadline) {
      spin.timed_out = true;
      return 0;
    }
    if (now < spin_end) {
      if (kernel)
        sched_yield();
      else
        __builtin_ia32_pause();
      continue;
    }
    // Arming unmasks the node's doorbell: what the last look finds counts as a sleep too.
    spin.sleeping(spin_end);
    ++set->sleepers;  // before the last look: a registration changed from now on wakes it
    std::vector<std::shared_ptr<Sock>> armed;
    {
      std::lock_guard<std::mutex> lk(set->mu);
      for (auto &[fd, reg] : set->regs)
        // Negotiating ones too (those with a link): the last look may finish their
        // handshake, and their first data must wake this thread.
        if (!reg.kernel && !reg.ghost && sdp_like(*reg.s)) armed.push_back(reg.s);
    }
    // Counted as asleep before arming: a wakeup another thread takes from now on kicks.
    for (auto &s : armed) ++s->sleepers;
    std::vector<ibv_cq *> cqs;
    cqs.reserve(armed.size());
    for (auto &s : armed) cqs.push_back(stream_arm(*s));
    n = scan(epfd, *set, out, max, true);
    // A socket the last look gave a link (a handshake it advanced) has its CQ unarmed and its
    // channel and kick out of the kernel set: look again (scan() watches them) rather than
    // sleep through its data.
    bool linked = false;
    for (size_t i = 0; i < armed.size() && !n && !linked; ++i)
      linked = stream_cq(*armed[i]) != cqs[i];
    if (n || linked) {
      for (auto &s : armed) --s->sleepers;
      --set->sleepers;
      if (n) return n;
      continue;
    }
    int kn = real().epoll_pwait(epfd, k.data(), max, remaining_ms(deadline), mask);
    int err = errno;
    for (auto &s : armed) --s->sleepers;
    --set->sleepers;
    if (kn < 0) {
      errno = err;
      return -1;
    }
    n = take_kernel(epfd, *set, k.data(), kn, out, 0, max);
    if (n) return n;
  }
}

}  // namespace

// Over fork(): the table of sets and every set (a child's close looks at all of them).
// Nothing that holds a set's lock waits for the table's.
void multiplex_fork_lock(bool lock) {
  if (lock) {
    sets_mu.lock();
    for (auto &kv : *sets) kv.second->mu.lock();
  } else {
    for (auto &kv : *sets) kv.second->mu.unlock();
    sets_mu.unlock();
  }
}

// The socket leaves the layer: closed (program_keeps_fd false), or staying on TCP, when the
// kernel takes the program's registrations as they were made.
void multiplex_forget(Sock &s, bool program_keeps_fd) {
  std::vector<std::pair<int, std::shared_ptr<EpSet>>> all;
  {
    std::lock_guard<std::mutex> lk(sets_mu);
    for (auto &kv : *sets) all.push_back(kv);
  }
  for (auto &[epfd, set] : all) {
    std::lock_guard<std::mutex> lk(set->mu);
    for (auto it = set->regs.begin(); it != set->regs.end();) {
      if (it->second.s.get() != &s) {
        ++it;
        continue;
      }
      if (!it->second.kernel) {
        unwatch(epfd, *set, it->second);
        if (program_keeps_fd && !it->second.ghost) {
          // A oneshot registration that fired stays disabled until the program re-arms it.
          const uint32_t events = it->second.disabled ? EPOLLONESHOT | (it->second.events & EPOLLET)
                                                      : it->second.events;
          epoll_event ev{events, it->second.data};
          real().epoll_ctl(epfd, EPOLL_CTL_ADD, it->first, &ev);
        }
      }
      it = set->regs.erase(it);
    }
  }
}

void multiplex_close_epoll(int epfd) {
  std::lock_guard<std::mutex> lk(sets_mu);
  sets->erase(epfd);
}

}  // namespace sdp

using namespace sdp;

SDP_EXPORT int poll(pollfd *fds, nfds_t n, int timeout) {
  return mux_poll(fds, n, timeout < 0 ? -1 : int64_t(timeout) * 1000000, nullptr);
}

SDP_EXPORT int __poll_chk(pollfd *fds, nfds_t n, int timeout, size_t) {
  return poll(fds, n, timeout);
}

SDP_EXPORT int ppoll(pollfd *fds, nfds_t n, const timespec *ts, const sigset_t *mask) {
  return mux_poll(fds, n, ts_ns(ts), mask);
}

SDP_EXPORT int __ppoll_chk(pollfd *fds, nfds_t n, const timespec *ts, const sigset_t *mask,
                           size_t) {
  return ppoll(fds, n, ts, mask);
}

SDP_EXPORT int select(int nfds, fd_set *r, fd_set *w, fd_set *e, timeval *tv) {
  if (!select_has_sdp(nfds, r, w, e)) {
    static auto real_select =
        reinterpret_cast<int (*)(int, fd_set *, fd_set *, fd_set *, timeval *)>(
            dlsym(RTLD_NEXT, "select"));
    return real_select(nfds, r, w, e, tv);
  }
  int64_t ns = tv ? int64_t(tv->tv_sec) * 1000000000ll + int64_t(tv->tv_usec) * 1000 : -1;
  return mux_select(nfds, r, w, e, ns, nullptr);
}

SDP_EXPORT int pselect(int nfds, fd_set *r, fd_set *w, fd_set *e, const timespec *ts,
                       const sigset_t *mask) {
  if (!select_has_sdp(nfds, r, w, e)) {
    static auto real_pselect =
        reinterpret_cast<int (*)(int, fd_set *, fd_set *, fd_set *, const timespec *,
                                 const sigset_t *)>(dlsym(RTLD_NEXT, "pselect"));
    return real_pselect(nfds, r, w, e, ts, mask);
  }
  return mux_select(nfds, r, w, e, ts_ns(ts), mask);
}

SDP_EXPORT int epoll_ctl(int epfd, int op, int fd, epoll_event *ev) {
  std::shared_ptr<Sock> s = find_sock(fd);
  bool ours = s && (sdp_like(*s) || s->state == State::kCandidate);
  std::shared_ptr<EpSet> set = find_set(epfd, ours);
  if (!set) return real().epoll_ctl(epfd, op, fd, ev);
  std::lock_guard<std::mutex> lk(set->mu);
  auto it = set->regs.find(fd);
  if (it != set->regs.end() && it->second.ghost) {
    if (op != EPOLL_CTL_ADD) {  // removed, as far as the program knows
      errno = ENOENT;
      return -1;
    }
    if (!ev) {
      errno = EFAULT;
      return -1;
    }
    Reg &reg = it->second;
    if (ours && reg.s == s && sdp_like(*s)) {  // back: as a fresh registration
      reg.ghost = false;
      reg.events = ev->events;
      reg.data = ev->data;
      reg.disabled = false;
      reg.last = 0;
      reg.idle = false;
      wake_sleepers(*set);  // it may be ready already
      return 0;
    }
    unwatch(epfd, *set, reg);  // another socket has the number now
    set->regs.erase(it);
    it = set->regs.end();
  }
  if (it == set->regs.end() && !ours) return real().epoll_ctl(epfd, op, fd, ev);
  if (op == EPOLL_CTL_ADD) {
    if (it != set->regs.end()) {
      errno = EEXIST;
      return -1;
    }
    if (!ev) {
      errno = EFAULT;
      return -1;
    }
    Reg reg;
    reg.s = s;
    reg.events = ev->events;
    reg.data = ev->data;
    if (s->state == State::kCandidate) {
      // Not connected yet: the kernel serves it until it turns SDP (scan() moves it then).
      int r = real().epoll_ctl(epfd, op, fd, ev);
      if (r != 0) return r;
      reg.kernel = true;
      set->regs.emplace(fd, std::move(reg));
      return 0;
    }
    auto &placed = set->regs.emplace(fd, std::move(reg)).first->second;
    watch(epfd, *set, fd, placed);
    wake_sleepers(*set);  // it may be ready already
    return 0;
  }
  if (it == set->regs.end()) {
    errno = ENOENT;
    return -1;
  }
  if (op == EPOLL_CTL_DEL) {
    if (it->second.kernel) {
      real().epoll_ctl(epfd, op, fd, ev);
      set->regs.erase(it);
    } else if (it->second.s->state != State::kSdp) {
      // Still negotiating: its own descriptor in the kernel set would stay readable with
      // handshake bytes nobody takes while it is out of the set.
      unwatch(epfd, *set, it->second);
      set->regs.erase(it);
    } else {
      it->second.ghost = true;  // multiplex_forget() takes it out when the socket closes
    }
    return 0;
  }
  if (op == EPOLL_CTL_MOD) {
    if (!ev) {
      errno = EFAULT;
      return -1;
    }
    if (it->second.kernel) {
      int r = real().epoll_ctl(epfd, op, fd, ev);
      if (r != 0) return r;
    }
    it->second.events = ev->events;
    it->second.data = ev->data;
    it->second.disabled = false;
    it->second.last = 0;
    it->second.idle = false;                      // asked for other events: look again
    if (!it->second.kernel) wake_sleepers(*set);  // re-armed: it may be ready already
    return 0;
  }
  errno = EINVAL;
  return -1;
}

SDP_EXPORT int epoll_wait(int epfd, epoll_event *out, int max, int timeout) {
  return mux_epoll_wait(epfd, out, max, timeout, nullptr);
}

SDP_EXPORT int epoll_pwait(int epfd, epoll_event *out, int max, int timeout, const sigset_t *mask) {
  return mux_epoll_wait(epfd, out, max, timeout, mask);
}

// A set with SDP sockets is waited on in milliseconds (the timeout rounded up); any other set
// goes to the kernel with its timeout as given.
SDP_EXPORT int epoll_pwait2(int epfd, epoll_event *out, int max, const timespec *timeout,
                            const sigset_t *mask) {
  static auto real_pwait2 =
      reinterpret_cast<int (*)(int, epoll_event *, int, const timespec *, const sigset_t *)>(
          dlsym(RTLD_NEXT, "epoll_pwait2"));
  int64_t ns = -1;
  if (timeout) ns = timeout->tv_sec * 1000000000ll + timeout->tv_nsec;
  std::shared_ptr<EpSet> set = find_set(epfd, false);
  if (!set && !real_pwait2) {
    errno = ENOSYS;
    return -1;
  }
  if (!set && max > 0) {
    const int64_t started = ns > 0 ? int64_t(now_ns()) : 0;
    int kn = plain_wait(epfd, &set, [&] { return real_pwait2(epfd, out, max, timeout, mask); });
    if (!set || kn < 0) return kn;
    int n = take_kernel(epfd, *set, out, kn, out, 0, max);
    if (n || ns == 0) return n;
    if (ns > 0) ns = std::max<int64_t>(0, started + ns - int64_t(now_ns()));
  }
  if (!set) return real_pwait2(epfd, out, max, timeout, mask);
  const int ms = ns < 0 ? -1 : int(std::min<int64_t>((ns + 999999) / 1000000, INT32_MAX));
  return mux_epoll_wait(epfd, out, max, ms, mask);
}
