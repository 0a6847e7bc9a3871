// Signals and blocked calls: whether a socket call that a signal interrupted restarts.
//
// The kernel restarts a blocked socket call after a handler installed with SA_RESTART and
// fails it with EINTR otherwise. The layer's waits sleep in poll(), which is never restarted,
// and poll's EINTR does not say which signal came. So the layer installs each handler the
// program sets behind a trampoline that notes, for the thread it interrupts, whether that
// handler asked for restarts; a wait that ends with EINTR asks (signal_restarts). sigaction
// and friends hand the program back its own handler and flags.
#include <dlfcn.h>
#include <signal.h>

#include <atomic>
#include <mutex>

#include "sdp.hpp"

#define SDP_EXPORT extern "C" __attribute__((visibility("default")))

namespace sdp {
namespace {

using SigactionFn = int (*)(int, const struct sigaction *, struct sigaction *);

SigactionFn real_sigaction() {
  static SigactionFn fn = reinterpret_cast<SigactionFn>(dlsym(RTLD_NEXT, "sigaction"));
  if (!fn) die_internal("sigaction");
  return fn;
}

// The program's handler of each signal that the trampoline stands for.
struct Program {
  std::atomic<void *> fn{nullptr};
  std::atomic<int> flags{0};
};
Program g_program[NSIG];
std::mutex g_mu;  // one installation at a time (read the kernel's, then replace it)

// What the handlers that ran on this thread since its wait began asked for. Initial-exec:
// read in a signal handler, where a first access of dynamic TLS could allocate.
__attribute__((tls_model("initial-exec"))) thread_local int t_caught = 0;
__attribute__((tls_model("initial-exec"))) thread_local bool t_interrupts = false;

void trampoline(int sig, siginfo_t *info, void *ctx) {
  const int flags = g_program[sig].flags.load(std::memory_order_relaxed);
  void *fn = g_program[sig].fn.load(std::memory_order_relaxed);
  ++t_caught;
  if (!(flags & SA_RESTART)) t_interrupts = true;
  if (flags & SA_SIGINFO)
    reinterpret_cast<void (*)(int, siginfo_t *, void *)>(fn)(sig, info, ctx);
  else
    reinterpret_cast<void (*)(int)>(fn)(sig);
}

bool is_trampoline(const struct sigaction &sa) {
  return (sa.sa_flags & SA_SIGINFO) && sa.sa_sigaction == trampoline;
}

void *handler_of(const struct sigaction &sa) {
  return (sa.sa_flags & SA_SIGINFO) ? reinterpret_cast<void *>(sa.sa_sigaction)
                                    : reinterpret_cast<void *>(sa.sa_handler);
}

bool catches(const struct sigaction &sa) {
  void *h = handler_of(sa);
  return h && h != reinterpret_cast<void *>(SIG_IGN) && h != reinterpret_cast<void *>(SIG_DFL);
}

// Whether a handler the layer did not see (set before it loaded, or by a raw system call)
// may have interrupted: then every caught signal must ask for restarts.
bool all_caught_restart() {
  for (int sig = 1; sig < NSIG; ++sig) {
    struct sigaction sa;
    if (sig == SIGKILL || sig == SIGSTOP || real_sigaction()(sig, nullptr, &sa) != 0) continue;
    if (catches(sa) && !is_trampoline(sa) && !(sa.sa_flags & SA_RESTART)) return false;
  }
  return true;
}

// sigaction, as the program sees it: its own handler and flags.
int program_sigaction(int sig, const struct sigaction *act, struct sigaction *old) {
  if (sig <= 0 || sig >= NSIG || sig == SIGKILL || sig == SIGSTOP)
    return real_sigaction()(sig, act, old);
  std::lock_guard<std::mutex> lk(g_mu);
  struct sigaction cur;
  if (real_sigaction()(sig, nullptr, &cur) != 0) return -1;
  if (act) {
    if (catches(*act)) {
      struct sigaction mine = *act;
      mine.sa_sigaction = trampoline;
      mine.sa_flags = act->sa_flags | SA_SIGINFO;
      // Before the kernel can call the trampoline with them.
      g_program[sig].fn.store(handler_of(*act), std::memory_order_relaxed);
      g_program[sig].flags.store(act->sa_flags, std::memory_order_relaxed);
      if (real_sigaction()(sig, &mine, nullptr) != 0) return -1;
    } else if (real_sigaction()(sig, act, nullptr) != 0) {
      return -1;
    }
  }
  if (old) {
    *old = cur;
    if (is_trampoline(cur)) {
      const int flags = g_program[sig].flags.load(std::memory_order_relaxed);
      old->sa_flags = flags;
      void *fn = g_program[sig].fn.load(std::memory_order_relaxed);
      if (flags & SA_SIGINFO)
        old->sa_sigaction = reinterpret_cast<void (*)(int, siginfo_t *, void *)>(fn);
      else
        old->sa_handler = reinterpret_cast<void (*)(int)>(fn);
    }
  }
  return 0;
}

sighandler_t install(int sig, sighandler_t handler, int flags) {
  struct sigaction sa {
  }, old{};
  sa.sa_handler = handler;
  sa.sa_flags = flags;
  sigemptyset(&sa.sa_mask);
  if (!(flags & SA_NODEFER)) sigaddset(&sa.sa_mask, sig);
  if (program_sigaction(sig, &sa, &old) != 0) return SIG_ERR;
  return (old.sa_flags & SA_SIGINFO)
             ? reinterpret_cast<sighandler_t>(reinterpret_cast<void *>(old.sa_sigaction))
             : old.sa_handler;
}

}  // namespace

void signal_wait_begins() {
  t_caught = 0;
  t_interrupts = false;
}

bool signal_interrupts() {
  return t_interrupts;
}

bool signal_restarts() {
  if (t_caught) return !t_interrupts;
  return all_caught_restart();
}

}  // namespace sdp

using namespace sdp;

SDP_EXPORT int sigaction(int sig, const struct sigaction *act, struct sigaction *old) {
  return program_sigaction(sig, act, old);
}

// glibc's signal() (BSD semantics: restarts) and its relatives set handlers with an
// internal sigaction the layer would not see.
SDP_EXPORT sighandler_t signal(int sig, sighandler_t handler) {
  return install(sig, handler, SA_RESTART);
}
SDP_EXPORT sighandler_t bsd_signal(int sig, sighandler_t handler) {
  return install(sig, handler, SA_RESTART);
}
SDP_EXPORT sighandler_t sysv_signal(int sig, sighandler_t handler) {
  return install(sig, handler, SA_RESETHAND | SA_NODEFER);
}
SDP_EXPORT int siginterrupt(int sig, int interrupt) {
  struct sigaction sa;
  if (program_sigaction(sig, nullptr, &sa) != 0) return -1;
  if (interrupt)
    sa.sa_flags &= ~SA_RESTART;
  else
    sa.sa_flags |= SA_RESTART;
  return program_sigaction(sig, &sa, nullptr);
}
