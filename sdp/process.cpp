// The process model: what becomes of SDP connections when the program forks, execs, spawns
// or daemonizes.
//
// An SDP connection's QP, rings and completions belong to one process: the one that made it.
// The kernel's TCP socket under it can be held by several (fork, exec, inherited descriptors).
// So, as a TCP socket would, a connection stays one byte stream whoever holds it:
//   - fork(): the parent keeps the connection; the child sees a plain TCP socket. When the
//     parent lets go of it (close, exit, exec), it hands it back to TCP (stream_revert): the
//     peer sends again over TCP what the parent had not read, and everything after, and the
//     child (or whoever holds the socket) reads it there.
//   - exec: before the image goes, its connections are handed back to TCP, and handshakes it
//     began are ended; a server socket whose client has not sent Hello yet is left to the new
//     image, which takes it up at start (process_start).
//   - posix_spawn(), system(), popen(): the child may inherit the sockets; they are marked
//     shared, so that their close hands them back instead of ending them.
//   - daemon(): the calling process exits in it: its connections go back to TCP first.
// A vfork()ed child (it shares the parent's memory) changes nothing of the layer's state.
#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <spawn.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <thread>
#include <vector>

#include "sdp.hpp"

#define SDP_EXPORT extern "C" __attribute__((visibility("default")))

namespace sdp {

std::atomic<uint32_t> g_fork_gen{0};
std::atomic<uint64_t> g_share_epoch{0};

namespace {

pid_t layer_pid = 0;  // the process whose state the layer holds

template <class F>
F libc(const char *name) {
  void *p = dlsym(RTLD_NEXT, name);
  if (!p) die_internal(name);
  return reinterpret_cast<F>(p);
}

// Hands the SDP connections this process made back to TCP: all of them (`all`: exec,
// daemon()), or those a program it spawns inherits. For exec it also ends the handshakes it
// began on sockets the new image keeps. Connections and handshakes of an ancestor (this
// process is a forked child) are not its to end.
void hand_back(bool exec, bool all) {
  if (getpid() != layer_pid) {
    // A vfork()ed child about to exec (its memory is its parent's, whose other threads
    // run): nothing may be done here but saying that the sockets are shared now.
    g_share_epoch.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  for (SockUse &u : table_snapshot()) {
    Sock &s = *u.s;
    if (inherited(s) || !made_here(s) || (!all && !u.survives_exec)) continue;
    if (exec && negotiating(s)) {
      if (!u.survives_exec) continue;  // exec closes it: the peer sees the TCP socket end
      std::lock_guard<SockMutex> lk(s.mu);
      if (!handshake_before_exec(s)) continue;
    }
    if (s.state != State::kSdp) continue;
    hand_back_sock(s);
  }
  g_share_epoch.fetch_add(1, std::memory_order_relaxed);
}

void end_image() {
  hand_back(true, true);
  if (getpid() == layer_pid) stats_end_image();
}

std::vector<char *> gather_args(const char *arg0, va_list *ap) {
  std::vector<char *> argv{const_cast<char *>(arg0)};
  if (arg0)
    while (char *a = va_arg(*ap, char *)) argv.push_back(a);
  argv.push_back(nullptr);
  return argv;
}

socklen_t hand_back_name(sockaddr_un &un, pid_t pid) {
  un = sockaddr_un{};
  un.sun_family = AF_UNIX;
  int n = snprintf(un.sun_path + 1, sizeof un.sun_path - 1, "pcientb-sdp/%s/H/%d",
                   config().fabric_tag.c_str(), int(pid));
  return socklen_t(offsetof(sockaddr_un, sun_path) + 1 + n);
}

// Hands back the SDP connection of the kernel socket `ino` that another process asked for
// (it uses the socket now).
void hand_back_ino(uint64_t ino) {
  for (SockUse &u : table_snapshot()) {
    Sock &s = *u.s;
    if (s.ino != ino || s.state != State::kSdp || inherited(s) || s.owner != getpid()) continue;
    logf("fd %d: another process uses the socket: handing the connection back to TCP", s.fd);
    hand_back_sock(s);
    return;
  }
}

pid_t listener_pid = 0;

}  // namespace

void hand_back_sock(Sock &s) {
  multiplex_forget(s, true);  // before its link goes: an epoll scan may look at it
  stream_revert(s);
  forget_sock(s);
}

void hand_back_listen() {
  if (listener_pid == getpid()) return;
  listener_pid = getpid();
  int fd = real().socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return;
  sockaddr_un un;
  socklen_t len = hand_back_name(un, getpid());
  if (real().bind(fd, reinterpret_cast<sockaddr *>(&un), len) != 0) {
    real().close(fd);
    return;
  }
  std::thread([fd] {
    pthread_setname_np(pthread_self(), "sdp-handback");
    for (;;) {
      uint64_t ino = 0;
      ssize_t n = real().recvfrom(fd, &ino, sizeof ino, 0, nullptr, nullptr);
      if (n == ssize_t(sizeof ino)) hand_back_ino(ino);
      if (n < 0 && errno != EINTR) return;
    }
  }).detach();
}

void ask_hand_back(pid_t owner, uint64_t ino) {
  if (owner == kAncestors) {
    // Which ancestor holds it is not known (a shell may stand between: system()): each of
    // them is asked, up to init.
    pid_t p = getppid();
    for (int depth = 0; p > 1 && depth < 16; ++depth) {
      ask_hand_back(p, ino);
      char path[32], buf[512];
      snprintf(path, sizeof path, "/proc/%d/stat", int(p));
      int fd = open(path, O_RDONLY | O_CLOEXEC);
      if (fd < 0) break;
      ssize_t n = read(fd, buf, sizeof buf - 1);
      close(fd);
      if (n <= 0) break;
      buf[n] = 0;
      const char *rp = strrchr(buf, ')');  // after the command name: " S ppid ..."
      if (!rp || sscanf(rp + 1, " %*c %d", &p) != 1) break;
    }
    return;
  }
  if (owner <= 0 || owner == getpid()) return;
  int fd = real().socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return;
  sockaddr_un un;
  socklen_t len = hand_back_name(un, owner);
  // No such process, or one without SDP connections: nothing to hand back.
  real().sendto(fd, &ino, sizeof ino, MSG_DONTWAIT, reinterpret_cast<sockaddr *>(&un), len);
  real().close(fd);
}

void process_start() {
  layer_pid = getpid();
  const char *off = getenv("PCIENTB_SDP");
  if (off && (!strcmp(off, "off") || !strcmp(off, "0"))) return;
  // The sockets a previous image left (exec): most programs start with none.
  std::vector<int> fds;
  if (DIR *d = opendir("/proc/self/fd")) {
    while (dirent *e = readdir(d)) {
      if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
      int fd = atoi(e->d_name);
      struct stat st;
      if (fd != dirfd(d) && fstat(fd, &st) == 0 && S_ISSOCK(st.st_mode)) fds.push_back(fd);
    }
    closedir(d);
  }
  if (!fds.empty()) handshake_adopt(fds);
}

// Both ends of a fork() may hold every socket made before it. The child's handler runs
// before the provider's has given it private copies of registered memory (heap included):
// counters only.
bool in_vfork_child() {
  return getpid() != layer_pid;
}

void process_fork_parent() {
  g_share_epoch.fetch_add(1, std::memory_order_relaxed);
}

void process_fork_child() {
  layer_pid = getpid();
  g_fork_gen.fetch_add(1, std::memory_order_relaxed);
  g_share_epoch.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace sdp

using namespace sdp;

SDP_EXPORT int execve(const char *path, char *const argv[], char *const envp[]) {
  static auto next = libc<int (*)(const char *, char *const[], char *const[])>("execve");
  end_image();
  return next(path, argv, envp);
}

SDP_EXPORT int execv(const char *path, char *const argv[]) {
  static auto next = libc<int (*)(const char *, char *const[])>("execv");
  end_image();
  return next(path, argv);
}

SDP_EXPORT int execvp(const char *file, char *const argv[]) {
  static auto next = libc<int (*)(const char *, char *const[])>("execvp");
  end_image();
  return next(file, argv);
}

SDP_EXPORT int execvpe(const char *file, char *const argv[], char *const envp[]) {
  static auto next = libc<int (*)(const char *, char *const[], char *const[])>("execvpe");
  end_image();
  return next(file, argv, envp);
}

SDP_EXPORT int fexecve(int fd, char *const argv[], char *const envp[]) {
  static auto next = libc<int (*)(int, char *const[], char *const[])>("fexecve");
  end_image();
  return next(fd, argv, envp);
}

SDP_EXPORT int execl(const char *path, const char *arg, ...) {
  va_list ap;
  va_start(ap, arg);
  std::vector<char *> argv = gather_args(arg, &ap);
  va_end(ap);
  return execv(path, argv.data());
}

SDP_EXPORT int execlp(const char *file, const char *arg, ...) {
  va_list ap;
  va_start(ap, arg);
  std::vector<char *> argv = gather_args(arg, &ap);
  va_end(ap);
  return execvp(file, argv.data());
}

SDP_EXPORT int execle(const char *path, const char *arg, ...) {
  va_list ap;
  va_start(ap, arg);
  std::vector<char *> argv = gather_args(arg, &ap);
  char *const *envp = va_arg(ap, char *const *);
  va_end(ap);
  return execve(path, argv.data(), envp);
}

SDP_EXPORT int posix_spawn(pid_t *pid, const char *path, const posix_spawn_file_actions_t *fa,
                           const posix_spawnattr_t *attr, char *const argv[], char *const envp[]) {
  static auto next =
      libc<int (*)(pid_t *, const char *, const posix_spawn_file_actions_t *,
                   const posix_spawnattr_t *, char *const[], char *const[])>("posix_spawn");
  g_share_epoch.fetch_add(1, std::memory_order_relaxed);  // the child may hold them
  return next(pid, path, fa, attr, argv, envp);
}

SDP_EXPORT int posix_spawnp(pid_t *pid, const char *file, const posix_spawn_file_actions_t *fa,
                            const posix_spawnattr_t *attr, char *const argv[], char *const envp[]) {
  static auto next =
      libc<int (*)(pid_t *, const char *, const posix_spawn_file_actions_t *,
                   const posix_spawnattr_t *, char *const[], char *const[])>("posix_spawnp");
  g_share_epoch.fetch_add(1, std::memory_order_relaxed);  // the child may hold them
  return next(pid, file, fa, attr, argv, envp);
}

SDP_EXPORT int system(const char *command) {
  static auto next = libc<int (*)(const char *)>("system");
  g_share_epoch.fetch_add(1, std::memory_order_relaxed);  // the child may hold them
  return next(command);
}

SDP_EXPORT FILE *popen(const char *command, const char *type) {
  static auto next = libc<FILE *(*)(const char *, const char *)>("popen");
  g_share_epoch.fetch_add(1, std::memory_order_relaxed);  // the child may hold them
  return next(command, type);
}

SDP_EXPORT int daemon(int nochdir, int noclose) {
  static auto next = libc<int (*)(int, int)>("daemon");
  // The caller exits in it (without exit handlers); its child goes on with the sockets.
  hand_back(false, true);
  if (getpid() == layer_pid) stats_end_image();
  return next(nochdir, noclose);
}

// _exit skips exit handlers: the connections are closed (FIN, or handed back) as exit
// would, and the totals line written. Not in a vfork()ed child (its parent's state).
SDP_EXPORT void _exit(int status) {
  static auto next = libc<void (*)(int)>("_exit");
  if (getpid() == layer_pid) {
    close_all_at_exit();
    stats_end_image();
  }
  next(status);
  __builtin_unreachable();
}

SDP_EXPORT void _Exit(int status) {
  _exit(status);
}
