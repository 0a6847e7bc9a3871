#include "two_process.hpp"

#include <gtest/gtest.h>

#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <thread>

namespace pcientb::test {

void throw_errno(const std::string &what, int err) {
  throw SetupError(what + ": " + std::strerror(err));
}

void use_private_fabric() {
  static bool done = false;
  if (done) return;
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  char name[64];
  std::snprintf(name, sizeof name, "t%d_%lx", static_cast<int>(getpid()),
                static_cast<unsigned long>(ts.tv_nsec & 0xffffff));
  setenv("PCIENTB_FABRIC", name, 1);
  done = true;
}

// ---- Channel ---------------------------------------------------------------

Channel::Channel(int fd, pid_t peer, bool is_parent)
    : fd_(fd), peer_(peer), is_parent_(is_parent) {}

Channel::~Channel() {
  close(fd_);
}

void Channel::write_all(const void *data, size_t size) {
  auto *p = static_cast<const char *>(data);
  while (size > 0) {
    ssize_t n = ::send(fd_, p, size, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw_errno("channel: the peer is gone (send)", errno);
    p += n;
    size -= static_cast<size_t>(n);
  }
}

void Channel::read_all(void *data, size_t size, std::chrono::steady_clock::time_point deadline) {
  auto *p = static_cast<char *>(data);
  while (size > 0) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) throw SetupError("channel: timed out waiting for the peer");
    pollfd pfd{fd_, POLLIN, 0};
    int r = ::poll(&pfd, 1, static_cast<int>(left.count()));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw_errno("channel: poll", errno);
    if (r == 0) continue;  // the deadline check above ends the loop
    ssize_t n = ::recv(fd_, p, size, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw_errno("channel: recv", errno);
    if (n == 0) throw SetupError("channel: the peer closed the channel (it failed or died)");
    p += n;
    size -= static_cast<size_t>(n);
  }
}

struct Header {
  uint32_t kind;
  uint32_t size;
};

void Channel::send_message(Kind kind, const void *data, size_t size) {
  Header h{kind, static_cast<uint32_t>(size)};
  write_all(&h, sizeof h);
  if (size > 0) write_all(data, size);
}

void Channel::recv_message(Kind kind, void *data, size_t size, std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  Header h{};
  read_all(&h, sizeof h, deadline);
  if (h.kind != kind || h.size != size)
    throw SetupError("channel: protocol mismatch (expected " +
                     std::string(kind == kSignal ? "a signal" : "a value") + " of " +
                     std::to_string(size) + " bytes, got " +
                     std::string(h.kind == kSignal ? "a signal" : "a value") + " of " +
                     std::to_string(h.size) + " bytes)");
  if (size > 0) read_all(data, size, deadline);
}

void Channel::signal() {
  send_message(kSignal, nullptr, 0);
}

void Channel::wait(std::chrono::milliseconds timeout) {
  recv_message(kSignal, nullptr, 0, timeout);
}

void Channel::kill_peer() {
  if (!is_parent_) throw SetupError("kill_peer() is for the parent only");
  if (peer_killed_) return;
  ::kill(peer_, SIGKILL);
  int status = 0;
  while (waitpid(peer_, &status, 0) < 0 && errno == EINTR) {
  }
  peer_killed_ = true;
}

// ---- the runner --------------------------------------------------------------

namespace {

volatile sig_atomic_t g_child_pid = 0;

void on_watchdog(int) {
  static const char msg[] =
      "\n*** two_process watchdog: the test exceeded its deadline; "
      "killing both processes (a verbs call or wait hung)\n";
  ssize_t ignored = write(STDERR_FILENO, msg, sizeof msg - 1);
  (void)ignored;
  if (g_child_pid > 0) ::kill(g_child_pid, SIGKILL);
  _exit(124);
}

// Runs one side's body, turning an escaped exception into a gtest failure.
void run_body(const char *side, const Body &body, Channel &ch) {
  try {
    body(ch);
  } catch (const std::exception &e) {
    ADD_FAILURE() << "[" << side << "] " << e.what();
  } catch (...) {
    ADD_FAILURE() << "[" << side << "] unknown exception";
  }
}

// Waits for the child to exit; kills it past the grace period.
// Returns its wait status and whether the grace period ran out.
std::pair<int, bool> reap(pid_t pid, std::chrono::milliseconds grace) {
  auto deadline = std::chrono::steady_clock::now() + grace;
  int status = 0;
  for (;;) {
    pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) return {status, false};
    if (r < 0 && errno != EINTR) return {0, false};
    if (std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(5ms);
  }
  ::kill(pid, SIGKILL);
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return {status, true};
}

std::string describe(int status) {
  if (WIFEXITED(status))
    return "exited with status " + std::to_string(WEXITSTATUS(status)) +
           (WEXITSTATUS(status) == 1 ? " (its failures are printed above)" : "");
  if (WIFSIGNALED(status))
    return "was killed by signal " + std::to_string(WTERMSIG(status)) + " (" +
           strsignal(WTERMSIG(status)) + ")";
  return "ended with wait status " + std::to_string(status);
}

}  // namespace

void two_process(const Body &parent, const Body &child, TwoProcessOptions options) {
  if (const char *s = getenv("PCIENTB_TEST_TIME_SCALE"); s && atoi(s) > 1) {
    options.deadline *= atoi(s);
    options.child_grace *= atoi(s);
  }
  use_private_fabric();
  int sv[2];
  ASSERT_EQ(0, socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv)) << std::strerror(errno);
  std::fflush(nullptr);
  const pid_t parent_pid = getpid();
  const pid_t pid = fork();
  ASSERT_GE(pid, 0) << "fork: " << std::strerror(errno);

  if (pid == 0) {
    close(sv[0]);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent_pid) _exit(3);
    // The default action of SIGALRM ends the child; the parent reports it.
    signal(SIGALRM, SIG_DFL);
    alarm(static_cast<unsigned>(options.deadline.count()) + 5);
    int code;
    {
      Channel ch(sv[1], parent_pid, false);
      run_body("child", child, ch);
      code = ::testing::Test::HasFailure() ? 1 : 0;
    }
    std::fflush(nullptr);
    _exit(code);
  }

  close(sv[1]);
  g_child_pid = pid;
  struct sigaction sa {
  }, old{};
  sa.sa_handler = on_watchdog;
  sigaction(SIGALRM, &sa, &old);
  alarm(static_cast<unsigned>(options.deadline.count()));

  bool killed_by_test;
  {
    Channel ch(sv[0], pid, true);
    run_body("parent", parent, ch);
    killed_by_test = ch.peer_killed();
    // Nothing more will come from us: a child still waiting fails fast.
  }

  const bool parent_failed = ::testing::Test::HasFailure();
  if (!killed_by_test) {
    // A failed parent gives the child a moment to report its own failure
    // (it sees the channel close), then ends it.
    auto [status, timed_out] = reap(pid, parent_failed ? 1000ms : options.child_grace);
    if (timed_out && !parent_failed)
      ADD_FAILURE() << "the child did not finish within " << options.child_grace.count()
                    << " ms after the parent did; killed";
    else if (!timed_out && status != 0)
      ADD_FAILURE() << "the child " << describe(status);
  }

  alarm(0);
  sigaction(SIGALRM, &old, nullptr);
  g_child_pid = 0;
}

}  // namespace pcientb::test
