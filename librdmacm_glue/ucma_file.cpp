// The libc calls through which librdmacm reaches the kernel's rdma_cm
// character device, interposed for /dev/infiniband/rdma_cm when the host has
// none (no rdma_ucm module): open() gets an event channel of cm.hpp, fstat()
// reports it as a character device, write() runs a command on it, close()
// forgets it. Every other descriptor and path goes straight to libc.
//
// These are linked into libpcientb-preload.so (pcientb-run preloads it) and
// exported with glibc's symbol versions (preload.map.in).
#include <dlfcn.h>
#include <fcntl.h>
#include <rdma/rdma_user_cm.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstring>

#include "cm.hpp"

#define PCIENTB_EXPORT __attribute__((visibility("default")))

namespace {

constexpr const char *kDevice = "/dev/infiniband/rdma_cm";

template <typename Fn>
Fn *next(const char *name, const char *version) {
  void *sym = dlvsym(RTLD_NEXT, name, version);
  if (sym == nullptr)
    std::fprintf(stderr, "pcientb-rdmacm: no %s@%s: %s\n", name, version, dlerror());
  return reinterpret_cast<Fn *>(sym);
}

#define PCIENTB_NEXT(fn, version)                                          \
  ([]() {                                                                  \
    static decltype(&fn) const real_fn = next<decltype(fn)>(#fn, version); \
    return real_fn;                                                        \
  }())

bool is_device(const char *path) {
  return path != nullptr && std::strcmp(path, kDevice) == 0;
}

// The real device node answers when there is one; otherwise ours.
template <typename Real>
int open_or_channel(const char *path, int flags, Real &&real) {
  const int fd = real();
  if (fd >= 0 || !is_device(path)) return fd;
  if (errno != ENOENT && errno != ENODEV && errno != ENXIO) return fd;
  return pcientb::cm::open_channel(flags);
}

mode_t mode_arg(int flags, va_list ap) {
  return (flags & (O_CREAT | O_TMPFILE)) != 0 ? static_cast<mode_t>(va_arg(ap, int)) : 0;
}

// A write that could be a command on a dup of a channel's descriptor:
// librdmacm writes exactly a header and its input. Only these pay an fstat.
bool command_shaped(const void *buf, size_t n) {
  if (buf == nullptr || n < sizeof(rdma_ucm_cmd_hdr) || n > 4096) return false;
  rdma_ucm_cmd_hdr h;
  std::memcpy(&h, buf, sizeof h);
  return h.cmd <= RDMA_USER_CM_CMD_JOIN_MCAST && h.in + sizeof h == n;
}

template <typename Stat>
int describe_if_channel(int fd, int rc, Stat *st) {
  if (rc == 0 && S_ISSOCK(st->st_mode) && pcientb::cm::is_channel(fd)) {
    struct stat s {};
    s.st_mode = st->st_mode;
    pcientb::cm::describe(&s);
    st->st_mode = s.st_mode;
    st->st_rdev = s.st_rdev;
  }
  return rc;
}

}  // namespace

extern "C" {

PCIENTB_EXPORT int open(const char *path, int flags, ...) {
  va_list ap;
  va_start(ap, flags);
  const mode_t mode = mode_arg(flags, ap);
  va_end(ap);
  return open_or_channel(path, flags,
                         [&] { return PCIENTB_NEXT(open, "GLIBC_2.2.5")(path, flags, mode); });
}

PCIENTB_EXPORT int open64(const char *path, int flags, ...) {
  va_list ap;
  va_start(ap, flags);
  const mode_t mode = mode_arg(flags, ap);
  va_end(ap);
  return open_or_channel(path, flags,
                         [&] { return PCIENTB_NEXT(open64, "GLIBC_2.2.5")(path, flags, mode); });
}

PCIENTB_EXPORT int openat(int dirfd, const char *path, int flags, ...) {
  va_list ap;
  va_start(ap, flags);
  const mode_t mode = mode_arg(flags, ap);
  va_end(ap);
  return open_or_channel(
      path, flags, [&] { return PCIENTB_NEXT(openat, "GLIBC_2.4")(dirfd, path, flags, mode); });
}

PCIENTB_EXPORT int openat64(int dirfd, const char *path, int flags, ...) {
  va_list ap;
  va_start(ap, flags);
  const mode_t mode = mode_arg(flags, ap);
  va_end(ap);
  return open_or_channel(
      path, flags, [&] { return PCIENTB_NEXT(openat64, "GLIBC_2.4")(dirfd, path, flags, mode); });
}

PCIENTB_EXPORT int fstat(int fd, struct stat *st) {
  return describe_if_channel(fd, PCIENTB_NEXT(fstat, "GLIBC_2.33")(fd, st), st);
}

PCIENTB_EXPORT int fstat64(int fd, struct stat64 *st) {
  return describe_if_channel(fd, PCIENTB_NEXT(fstat64, "GLIBC_2.33")(fd, st), st);
}

// Before glibc 2.33, fstat was an inline wrapper of these.
int __fxstat(int ver, int fd, struct stat *st);
int __fxstat64(int ver, int fd, struct stat64 *st);

PCIENTB_EXPORT int __fxstat(int ver, int fd, struct stat *st) {
  return describe_if_channel(fd, PCIENTB_NEXT(__fxstat, "GLIBC_2.2.5")(ver, fd, st), st);
}

PCIENTB_EXPORT int __fxstat64(int ver, int fd, struct stat64 *st) {
  return describe_if_channel(fd, PCIENTB_NEXT(__fxstat64, "GLIBC_2.2.5")(ver, fd, st), st);
}

PCIENTB_EXPORT ssize_t write(int fd, const void *buf, size_t n) {
  if (!pcientb::cm::any_channel() || !(pcientb::cm::known_channel(fd) || command_shaped(buf, n)))
    return PCIENTB_NEXT(write, "GLIBC_2.2.5")(fd, buf, n);
  // A command holds the channel's file from its first step, as the kernel's write() does: a
  // thread that closes the descriptor meanwhile (rping's main thread, while its event
  // thread asks for the next event) neither fails nor ends it. Closed before: EBADF.
  const int held = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (held < 0 && errno != EMFILE) return -1;
  ssize_t r;
  if (pcientb::cm::is_channel(held >= 0 ? held : fd)) {
    r = pcientb::cm::execute(fd, held, buf, n);
  } else {
    r = PCIENTB_NEXT(write, "GLIBC_2.2.5")(fd, buf, n);
  }
  if (held >= 0) {
    const int err = errno;
    close(held);  // after the command: the last reference may end the channel
    errno = err;
  }
  return r;
}

PCIENTB_EXPORT int close(int fd) {
  pcientb::cm::forget(fd);
  return PCIENTB_NEXT(close, "GLIBC_2.2.5")(fd);
}

}  // extern "C"
