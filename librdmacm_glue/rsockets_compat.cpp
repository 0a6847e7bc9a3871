// libpcientb-rscompat.so: what Debian 12's rsockets preload (librspreload.so, rdma-core 44)
// refuses of the socket calls common programs make, given the kernel TCP socket's meaning.
// `pcientb-run --rsockets` loads it in front of librspreload. It acts only on an error that
// the kernel's TCP never gives for that call, and only on an rsocket's descriptor (an
// AF_UNIX socket gives both errors itself), so a call librspreload carries, and every
// kernel socket, behave as without it.
//
// - getsockopt(IPPROTO_TCP, TCP_INFO): rsockets 44 answers ENOTSUP (iperf3 stops on it).
//   Answered as rsockets itself does from rdma-core 63 on: the state, every counter zero
//   (an rsocket has no TCP underneath to count).
// - sendto() with an address on a connected stream socket: rsockets answers EISCONN (every
//   version), where Linux's TCP ignores the address (sockperf's ping-pong sends so). Sent
//   without it.
// - select(): rsockets 44 maps its poll results back to the wrong descriptors and can write
//   past the caller's fd_set (iperf3 saw no data, or died of stack smashing; rdma-core 63
//   fixed it). Done here through poll(), which librspreload maps correctly, with the
//   kernel's rules for which poll events make a descriptor readable, writable or
//   exceptional.
// - select() and poll() waiting for a connection: rsockets' poll sleeps on a listening
//   socket's rdma_cm channel, which its own accept thread drains, so the sleeper misses the
//   connection until rsockets looks again by itself, 5 s later (0.5 s from rdma-core 63;
//   the race is still there). iperf3 waited 5 s for each of its two connections. Waits
//   here go in slices of 20 ms, and rsockets looks at its accept queue before each.
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
#include <cstring>
#include <ctime>
#include <vector>

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
// /dev/null (character device 1:3). Asked of the kernel directly, past every interposer.
bool is_rsocket(int fd) {
  struct stat st {};
  return syscall(SYS_fstat, fd, &st) == 0 && S_ISCHR(st.st_mode) && st.st_rdev == makedev(1, 3);
}

// The state of a stream rsocket: connected while it has a peer (rsockets' getpeername
// answers from its own state).
int stream_state(int fd) {
  static const auto next_getpeername = next_symbol<GetpeernameFn>("getpeername");
  sockaddr_storage peer{};
  socklen_t len = sizeof(peer);
  return next_getpeername != nullptr &&
                 next_getpeername(fd, reinterpret_cast<sockaddr *>(&peer), &len) == 0
             ? TCP_ESTABLISHED
             : TCP_CLOSE;
}

constexpr int kSliceMs = 20;

long long now_us() {
  timespec t{};
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<long long>(t.tv_sec) * 1000000 + t.tv_nsec / 1000;
}

// librspreload's poll until `timeout_ms` (-1: for ever), at most kSliceMs at a time while an
// rsocket is among `fds` (looked at only once the first slice ends: short waits pay nothing,
// and rsockets' waits on its own internal descriptors go whole).
int sliced_poll(pollfd *fds, nfds_t n, int timeout_ms) {
  static const auto next_poll = next_symbol<PollFn>("poll");
  if (next_poll == nullptr) {
    errno = ENOSYS;
    return -1;
  }
  const long long deadline = timeout_ms < 0 ? -1 : now_us() + timeout_ms * 1000LL;
  bool sliced = false;
  for (;;) {
    // Rounded up, as the kernel never cuts a timeout short.
    const long long left_ms = deadline < 0 ? kSliceMs : (deadline - now_us() + 999) / 1000;
    const int slice = static_cast<int>(std::clamp<long long>(left_ms, 0, kSliceMs));
    const int ret = next_poll(fds, n, slice);
    if (ret != 0 || left_ms <= kSliceMs) {
      return ret;
    }
    if (!sliced && std::none_of(fds, fds + n, [](const pollfd &p) { return is_rsocket(p.fd); })) {
      return next_poll(fds, n, deadline < 0 ? -1 : static_cast<int>(left_ms - slice));
    }
    sliced = true;
  }
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
  if (ret >= 0 || err != EISCONN || addr == nullptr || !is_rsocket(fd)) {
    errno = err;
    return ret;
  }
  return next(fd, buf, len, flags, nullptr, 0);
}

extern "C" __attribute__((visibility("default"))) int select(int nfds, fd_set *readfds,
                                                             fd_set *writefds, fd_set *exceptfds,
                                                             timeval *timeout) {
  if (nfds < 0 || nfds > FD_SETSIZE ||
      (timeout != nullptr &&
       (timeout->tv_sec < 0 || timeout->tv_usec < 0 || timeout->tv_usec >= 1000000))) {
    errno = EINVAL;
    return -1;
  }
  const auto in = [](fd_set *set, int fd) { return set != nullptr && FD_ISSET(fd, set); };
  std::vector<pollfd> fds;
  for (int fd = 0; fd < nfds; ++fd) {
    const auto events =
        static_cast<short>((in(readfds, fd) ? POLLIN : 0) | (in(writefds, fd) ? POLLOUT : 0) |
                           (in(exceptfds, fd) ? POLLPRI : 0));
    if (events != 0) {
      fds.push_back(pollfd{fd, events, 0});
    }
  }
  // As the kernel's select: a timeout is never cut short, and what is left is written back.
  const long long us = timeout == nullptr
                           ? -1
                           : static_cast<long long>(timeout->tv_sec) * 1000000 + timeout->tv_usec;
  const long long start = now_us();
  const int ret = sliced_poll(
      fds.data(), fds.size(),
      us < 0 ? -1 : static_cast<int>(std::min<long long>((us + 999) / 1000, INT32_MAX)));
  if (ret < 0) {
    return ret;
  }
  if (timeout != nullptr) {
    const long long left = std::max(0LL, us - (now_us() - start));
    timeout->tv_sec = static_cast<time_t>(left / 1000000);
    timeout->tv_usec = static_cast<suseconds_t>(left % 1000000);
  }
  for (const pollfd &p : fds) {
    if ((p.revents & POLLNVAL) != 0) {
      errno = EBADF;
      return -1;
    }
  }
  int ready = 0;
  const auto mark = [&ready](fd_set *set, int fd, bool on) {
    if (set != nullptr && on) {
      FD_SET(fd, set);
      ++ready;
    }
  };
  for (fd_set *set : {readfds, writefds, exceptfds}) {
    if (set != nullptr) {
      FD_ZERO(set);
    }
  }
  for (const pollfd &p : fds) {
    mark(readfds, p.fd,
         (p.events & POLLIN) != 0 && (p.revents & (POLLIN | POLLHUP | POLLERR)) != 0);
    mark(writefds, p.fd, (p.events & POLLOUT) != 0 && (p.revents & (POLLOUT | POLLERR)) != 0);
    mark(exceptfds, p.fd, (p.events & POLLPRI) != 0 && (p.revents & POLLPRI) != 0);
  }
  return ready;
}
