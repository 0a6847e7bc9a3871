#include "fabric/emu/move_guard.hpp"

#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <mutex>

namespace pcientb::fabric::emu::detail {

namespace {

std::mutex g_move_mu;  // one move at a time, process-wide

// The range being moved (lo == hi: none), the thread moving it, and a count of
// ended moves that waiting writers watch (a futex word).
std::atomic<uint64_t> g_lo{0}, g_hi{0};
std::atomic<long> g_mover{0};
std::atomic<uint32_t> g_ended{0};

// Ranges moved recently: a writer that faulted during a move but entered the
// handler after it ended retries its store. A bounded number of times, so
// that a real fault there (the program made the page read-only itself) still
// reaches the program's handler.
constexpr int kRecent = 8;
constexpr uint32_t kRecentRetries = 64;
struct Recent {
  std::atomic<uint64_t> lo{0}, hi{0};
  std::atomic<uint32_t> retries{0};
};
Recent g_recent[kRecent];
uint32_t g_recent_next = 0;  // under g_move_mu

// The SIGSEGV action before ours (written under g_move_mu before ours is set).
struct sigaction g_previous;

void wake_writers() {
  g_ended.fetch_add(1, std::memory_order_acq_rel);
  syscall(SYS_futex, &g_ended, FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
}

void chain(int sig, siginfo_t *si, void *uc) {
  const struct sigaction &p = g_previous;
  if ((p.sa_flags & SA_SIGINFO) != 0 && p.sa_sigaction != nullptr) {
    p.sa_sigaction(sig, si, uc);
  } else if (p.sa_handler == SIG_DFL || p.sa_handler == SIG_IGN) {
    // The default action: the fault happens again, without us.
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(sig, &dfl, nullptr);
  } else {
    p.sa_handler(sig);
  }
}

void on_segv(int sig, siginfo_t *si, void *uc) {
  const int saved_errno = errno;
  const auto a = reinterpret_cast<uint64_t>(si->si_addr);
  if (si->si_code == SEGV_ACCERR) {
    const uint32_t ended = g_ended.load(std::memory_order_acquire);
    const uint64_t lo = g_lo.load(std::memory_order_acquire);
    const uint64_t hi = g_hi.load(std::memory_order_acquire);
    if (a >= lo && a < hi) {
      if (syscall(SYS_gettid) == g_mover.load(std::memory_order_acquire)) {
        // The mover itself writes there (its stack, errno): give up the
        // guard rather than wait for itself.
        syscall(SYS_mprotect, lo, hi - lo, PROT_READ | PROT_WRITE);
      } else {
        while (g_ended.load(std::memory_order_acquire) == ended)
          syscall(SYS_futex, &g_ended, FUTEX_WAIT_PRIVATE, ended, nullptr, nullptr, 0);
      }
      errno = saved_errno;
      return;  // the store is retried
    }
    for (Recent &r : g_recent)
      if (a >= r.lo.load(std::memory_order_acquire) && a < r.hi.load(std::memory_order_acquire) &&
          r.retries.fetch_add(1, std::memory_order_relaxed) < kRecentRetries) {
        errno = saved_errno;
        return;
      }
  }
  chain(sig, si, uc);
}

// Ours, on top of whatever the program (or a sanitizer) set since; false when
// it cannot be (a sanitizer that keeps SIGSEGV for itself).
bool handler_installed() {
  struct sigaction cur {};
  if (sigaction(SIGSEGV, nullptr, &cur) != 0) return false;
  const auto ours = [](const struct sigaction &s) {
    return (s.sa_flags & SA_SIGINFO) != 0 && s.sa_sigaction == on_segv;
  };
  if (ours(cur)) return true;
  g_previous = cur;
  struct sigaction sa {};
  sa.sa_sigaction = on_segv;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESTART;
  sigemptyset(&sa.sa_mask);
  if (sigaction(SIGSEGV, &sa, nullptr) != 0) return false;
  return sigaction(SIGSEGV, nullptr, &cur) == 0 && ours(cur);
}

// Whether [va, va + len) holds part of the calling thread's stack. The bounds
// are looked up once per thread: for the main thread pthread_getattr_np reads
// /proc/self/maps, too slow to do on every registration.
bool on_own_stack(uint64_t va, uint64_t len) {
  thread_local uint64_t lo = 0, hi = 0;
  if (hi == 0) {
    pthread_attr_t attr;
    if (pthread_getattr_np(pthread_self(), &attr) != 0) return true;
    void *base = nullptr;
    size_t size = 0;
    const int rc = pthread_attr_getstack(&attr, &base, &size);
    pthread_attr_destroy(&attr);
    if (rc != 0) return true;
    lo = reinterpret_cast<uint64_t>(base);
    hi = lo + size;
  }
  return va < hi && lo < va + len;
}

}  // namespace

int begin_move(uint64_t va, uint64_t len) {
  g_move_mu.lock();
  if (on_own_stack(va, len) || !handler_installed()) return 0;  // unguarded, as before
  g_mover.store(syscall(SYS_gettid), std::memory_order_release);
  g_lo.store(va, std::memory_order_release);
  g_hi.store(va + len, std::memory_order_release);
  if (syscall(SYS_mprotect, va, len, PROT_READ) != 0) {
    g_lo.store(0, std::memory_order_release);
    g_hi.store(0, std::memory_order_release);
  }
  return 0;
}

void end_move(uint64_t va, uint64_t len, bool moved) {
  if (g_hi.load(std::memory_order_acquire) != 0) {
    // Moved: the new pages are read-write. Not moved: the old ones again.
    if (!moved) syscall(SYS_mprotect, va, len, PROT_READ | PROT_WRITE);
    Recent &r = g_recent[g_recent_next++ % kRecent];
    r.retries.store(0, std::memory_order_relaxed);
    r.lo.store(va, std::memory_order_release);
    r.hi.store(va + len, std::memory_order_release);
    g_lo.store(0, std::memory_order_release);
    g_hi.store(0, std::memory_order_release);
    g_mover.store(0, std::memory_order_release);
    wake_writers();
  }
  g_move_mu.unlock();
}

}  // namespace pcientb::fabric::emu::detail
