// libpcientb-rscompat.so: what Debian 12's rsockets preload (librspreload.so, rdma-core 44)
// refuses of the socket calls common programs make, given the kernel TCP socket's meaning.
// `pcientb-run --rsockets` loads it in front of librspreload. It acts only on an error that
// the kernel's TCP never gives for that call, and only on an rsocket's descriptor (an
// AF_UNIX socket gives both errors itself), so a call librspreload carries, and every
// kernel socket, behave as without it.
//
// - getsockopt(IPPROTO_TCP, TCP_INFO): rsockets 44 answers ENOTSUP (iperf3 stops on it).
//   Answered much as rsockets itself does from rdma-core 63 on: the state, and zero for
//   the counters (an rsocket has no TCP underneath to count).
// - sendto() with an address on a connected stream socket: rsockets answers EISCONN (every
//   version), where Linux's TCP ignores the address (sockperf's ping-pong sends so). Sent
//   without it.
// - select(): rsockets 44 maps its poll results back to the wrong descriptors and can write
//   past the caller's fd_set (iperf3 saw no data, or died of stack smashing; rdma-core 63
//   fixed it). Done here through poll(), which librspreload maps correctly, with the
//   kernel's rules: which poll events make a descriptor readable, writable or exceptional,
//   timeouts folded and written back, only the caller's nfds bits written.
// - select() and poll() waiting for a connection: rsockets' poll sleeps on a listening
//   socket's rdma_cm channel, which its own accept thread drains, so the sleeper misses the
//   connection until rsockets looks again by itself, 5 s later (0.5 s from rdma-core 63;
//   the race is still there). iperf3 waited 5 s for each of its two connections. A wait
//   longer than kSliceMs on a set that holds an rsocket goes in slices of kSliceMs, and
//   rsockets looks at its accept queue before each. Other waits go whole.
#include <dlfcn.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/select.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <ctime>
#include <memory>
#include <new>

namespace {

template <typename Fn>
Fn next_symbol(const char *name) {
  return reinterpret_cast<Fn>(dlsym(RTLD_NEXT, name));
}

using GetsockoptFn = int (*)(int, int, int, void *, socklen_t *);
using GetpeernameFn = int (*)(int, sockaddr *, socklen_t *);
using PollFn = int (*)(pollfd *, nfds_t, int);
using SendtoFn = ssize_t (*)(int, const void *, size_t, int, const sockaddr *, socklen_t);

// Whether `fd` is an rsocket's: librspreload holds an rsocket's descriptor number with
// /dev/null (character device 1:3). Asked of the kernel directly, past every interposer
// (librspreload's __fxstat says "socket" for its descriptors); x86_64's struct stat is the
// kernel's. Keeps errno.
bool is_rsocket(int fd) {
  const int saved = errno;
  struct stat st {};
  const bool yes =
      syscall(SYS_fstat, fd, &st) == 0 && S_ISCHR(st.st_mode) && st.st_rdev == makedev(1, 3);
  errno = saved;
  return yes;
}

int next_poll(pollfd *fds, nfds_t n, int timeout_ms) {
  static const auto next = next_symbol<PollFn>("poll");
  if (next == nullptr) {
    errno = ENOSYS;
    return -1;
  }
  return next(fds, n, timeout_ms);
}

// The state of a stream rsocket: connected while it has a peer and poll reports neither a
// hang-up nor an error.
int stream_state(int fd) {
  static const auto next_getpeername = next_symbol<GetpeernameFn>("getpeername");
  sockaddr_storage peer{};
  socklen_t len = sizeof(peer);
  pollfd p{fd, POLLIN, 0};
  const bool connected = next_getpeername != nullptr &&
                         next_getpeername(fd, reinterpret_cast<sockaddr *>(&peer), &len) == 0 &&
                         peer.ss_family != 0 && next_poll(&p, 1, 0) >= 0 &&
                         (p.revents & (POLLHUP | POLLERR | POLLNVAL)) == 0;
  return connected ? TCP_ESTABLISHED : TCP_CLOSE;
}

constexpr int kSliceMs = 20;

long long now_us() {
  timespec t{};
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<long long>(t.tv_sec) * 1000000 + t.tv_nsec / 1000;
}

// librspreload's poll until `timeout_ms` (negative: for ever); see the slices above.
int sliced_poll(pollfd *fds, nfds_t n, int timeout_ms) {
  const bool long_wait = timeout_ms < 0 || timeout_ms > kSliceMs;
  if (!long_wait || std::none_of(fds, fds + n, [](const pollfd &p) { return is_rsocket(p.fd); }))
    return next_poll(fds, n, timeout_ms);
  const long long deadline = timeout_ms < 0 ? -1 : now_us() + timeout_ms * 1000LL;
  for (;;) {
    // Rounded up: the kernel never cuts a timeout short.
    const long long left_ms = deadline < 0 ? LLONG_MAX : (deadline - now_us() + 999) / 1000;
    const int ret =
        next_poll(fds, n, static_cast<int>(std::clamp<long long>(left_ms, 0, kSliceMs)));
    if (ret != 0 || left_ms <= kSliceMs) return ret;
  }
}

// fd_set bits, read and written as the kernel does: only the first nfds, as longs.
constexpr int kBitsPerLong = 8 * sizeof(long);

bool bit(const fd_set *set, int fd) {
  const auto *w = reinterpret_cast<const unsigned long *>(set);
  return set != nullptr && ((w[fd / kBitsPerLong] >> (fd % kBitsPerLong)) & 1UL) != 0;
}

void set_bit(unsigned long *w, int fd) {
  w[fd / kBitsPerLong] |= 1UL << (fd % kBitsPerLong);
}

}  // namespace

extern "C" __attribute__((visibility("default"))) int poll(pollfd *fds, nfds_t n, int timeout) {
  return sliced_poll(fds, n, timeout);
}

extern "C" __attribute__((visibility("default"))) int getsockopt(int fd, int level, int optname,
                                                                 void *optval, socklen_t *optlen) {
  static const auto next = next_symbol<GetsockoptFn>("getsockopt");
  if (next == nullptr) {
    errno = ENOSYS;
    return -1;
  }
  const int ret = next(fd, level, optname, optval, optlen);
  const int err = errno;
  if (ret == 0 || err != EOPNOTSUPP || level != IPPROTO_TCP || optname != TCP_INFO ||
      optval == nullptr || optlen == nullptr || !is_rsocket(fd)) {
    errno = err;
    return ret;
  }
  tcp_info info{};
  info.tcpi_state = static_cast<uint8_t>(stream_state(fd));
  const socklen_t len = std::min<socklen_t>(*optlen, sizeof(info));
  std::memcpy(optval, &info, len);
  *optlen = len;
  return 0;
}

extern "C" __attribute__((visibility("default"))) ssize_t sendto(int fd, const void *buf,
                                                                 size_t len, int flags,
                                                                 const sockaddr *addr,
                                                                 socklen_t addrlen) {
  static const auto next = next_symbol<SendtoFn>("sendto");
  if (next == nullptr) {
    errno = ENOSYS;
    return -1;
  }
  const ssize_t ret = next(fd, buf, len, flags, addr, addrlen);
  const int err = errno;
  if (ret >= 0 || err != EISCONN || (addr == nullptr && addrlen == 0) || !is_rsocket(fd)) {
    errno = err;
    return ret;
  }
  return next(fd, buf, len, flags, nullptr, 0);
}

extern "C" __attribute__((visibility("default"))) int select(int nfds, fd_set *readfds,
                                                             fd_set *writefds, fd_set *exceptfds,
                                                             timeval *timeout) {
  long long us = -1;  // for ever
  if (timeout != nullptr) {
    if (timeout->tv_sec < 0 || timeout->tv_usec < 0) {
      errno = EINVAL;
      return -1;
    }
    // As the kernel: microseconds beyond a second fold into seconds; far is for ever.
    const long long sec = timeout->tv_sec + timeout->tv_usec / 1000000;
    us = sec > LLONG_MAX / 2000000 ? -1 : sec * 1000000 + timeout->tv_usec % 1000000;
  }
  if (nfds < 0) {
    errno = EINVAL;
    return -1;
  }
  // A pollfd per descriptor asked about: on the stack up to FD_SETSIZE, else on the heap.
  pollfd local[FD_SETSIZE];
  std::unique_ptr<pollfd[]> heap;
  pollfd *fds = local;
  if (nfds > FD_SETSIZE) {
    heap.reset(new (std::nothrow) pollfd[nfds]);
    if (!heap) {
      errno = ENOMEM;
      return -1;
    }
    fds = heap.get();
  }
  nfds_t n = 0;
  for (int fd = 0; fd < nfds; ++fd) {
    const auto events =
        static_cast<short>((bit(readfds, fd) ? POLLIN : 0) | (bit(writefds, fd) ? POLLOUT : 0) |
                           (bit(exceptfds, fd) ? POLLPRI : 0));
    if (events != 0) fds[n++] = pollfd{fd, events, 0};
  }
  // The kernel's select: readable on POLLIN/HUP/ERR, writable on POLLOUT/ERR, exceptional
  // on POLLPRI. An event that answers nothing asked (a hang-up of a descriptor watched for
  // writing) does not end the wait: that descriptor is dropped and the wait goes on.
  const size_t words = (static_cast<size_t>(nfds) + kBitsPerLong - 1) / kBitsPerLong;
  unsigned long local_bits[3 * (FD_SETSIZE / kBitsPerLong)] = {};
  std::unique_ptr<unsigned long[]> heap_bits;
  unsigned long *in = local_bits;
  if (nfds > FD_SETSIZE) {
    heap_bits.reset(new (std::nothrow) unsigned long[3 * words]());
    if (!heap_bits) {
      errno = ENOMEM;
      return -1;
    }
    in = heap_bits.get();
  }
  unsigned long *wr = in + words, *ex = wr + words;
  const long long start = now_us();
  int ready = 0, ret = 0, err = 0;
  while (ready == 0) {
    const long long left = us < 0 ? -1 : std::max(0LL, us - (now_us() - start));
    ret = sliced_poll(
        fds, n,
        left < 0 ? -1 : static_cast<int>(std::min<long long>((left + 999) / 1000, INT_MAX)));
    if (ret <= 0) {
      if (ret < 0) err = errno;
      break;
    }
    nfds_t kept = 0;
    for (nfds_t i = 0; i < n && err == 0; ++i) {
      const pollfd &p = fds[i];
      const bool r = (p.events & POLLIN) && (p.revents & (POLLIN | POLLHUP | POLLERR));
      const bool w = (p.events & POLLOUT) && (p.revents & (POLLOUT | POLLERR));
      const bool e = (p.events & POLLPRI) && (p.revents & POLLPRI);
      if ((p.revents & POLLNVAL) != 0) err = EBADF;
      if (r) set_bit(in, p.fd);
      if (w) set_bit(wr, p.fd);
      if (e) set_bit(ex, p.fd);
      ready += int(r) + int(w) + int(e);
      if (r || w || e || p.revents == 0) fds[kept++] = p;
    }
    if (err != 0) break;
    n = kept;
  }
  if (timeout != nullptr) {  // what is left, written back whatever the outcome
    const long long left = us < 0 ? 0 : std::max(0LL, us - (now_us() - start));
    timeout->tv_sec = static_cast<time_t>(left / 1000000);
    timeout->tv_usec = static_cast<suseconds_t>(left % 1000000);
  }
  if (err != 0) {
    errno = err;
    return -1;
  }
  // Only the caller's nfds bits, set after set as the kernel copies them out.
  const size_t bytes = words * sizeof(unsigned long);
  if (readfds != nullptr) std::memcpy(readfds, in, bytes);
  if (writefds != nullptr) std::memcpy(writefds, wr, bytes);
  if (exceptfds != nullptr) std::memcpy(exceptfds, ex, bytes);
  return ready;
}
