// How long a thread's waits busy-poll before they sleep: poll/select/epoll (multiplex.cpp)
// and a blocking call's wait on its socket (stream.cpp) adapt one window per thread.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "sdp.hpp"

namespace sdp {

// Adapted as Linux adapts a vCPU's halt-polling: on these VMs a sleep and its wake cost
// 50-90 us (a ppoll of 20 us returns after ~70-130 us), so an event loop whose events come
// a little after the spin ends (redis with 50 clients: a batch every ~100 us), or a
// zero-copy send whose sink copies for ~110 us, pays wakeups on its critical path: the
// provider's progress thread's and its own. A wait whose sleep ended within what a spin of
// up to 8x spin_us would have covered doubles the window; a longer one (an idle loop), or a
// wait that timed out (spinning or asleep), halves it, down to spin_us: an idle connection
// still costs no CPU, nor does a loop of waits shorter than the window.
class SpinWindow {
 public:
  int64_t ns() {
    if (window_ < 0) window_ = least();
    return window_;
  }
  void slept(int64_t slept_ns) {
    const int64_t spun = ns();
    window_ = spun + slept_ns <= most() ? std::min(most(), 2 * spun) : shrunk();
  }
  void timed_out() { window_ = shrunk(); }
  static int64_t least() { return int64_t(config().spin_us) * 1000; }

 private:
  static int64_t most() { return 8 * least(); }
  int64_t shrunk() { return std::max(least(), ns() / 2); }
  int64_t window_ = -1;
};
inline __attribute__((tls_model("initial-exec"))) thread_local SpinWindow t_spin;

// One wait's spin: the thread's window, or the least spin while as many threads of the
// process as it has CPUs spin beyond that already (more would take the CPUs from the
// threads they wait for; the window is then not trained). Told when the spin ended and the
// wait went to sleep, or that the wait timed out; the window learns of it at the end.
class WaitSpin {
 public:
  WaitSpin() : ns_(t_spin.ns()) {
    static const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    if (ns_ <= SpinWindow::least()) return;
    if (long_spinners().fetch_add(1, std::memory_order_relaxed) < cpus) {
      long_ = true;
    } else {
      long_spinners().fetch_sub(1, std::memory_order_relaxed);
      ns_ = SpinWindow::least();
      trains_ = false;
    }
  }
  ~WaitSpin() {
    spin_over();
    if (!trains_) return;
    if (timed_out)
      t_spin.timed_out();
    else if (since_ >= 0)
      t_spin.slept(int64_t(now_ns()) - since_);
  }
  WaitSpin(const WaitSpin &) = delete;
  WaitSpin &operator=(const WaitSpin &) = delete;
  int64_t ns() const { return ns_; }
  void sleeping(int64_t spin_end) {
    spin_over();
    if (since_ < 0) since_ = spin_end;
  }
  bool timed_out = false;

 private:
  static std::atomic<long> &long_spinners() {
    static std::atomic<long> n{0};
    return n;
  }
  void spin_over() {
    if (long_) long_spinners().fetch_sub(1, std::memory_order_relaxed);
    long_ = false;
  }
  int64_t ns_;
  int64_t since_ = -1;  // when the first sleep began; -1: it has not slept
  bool long_ = false;
  bool trains_ = true;
};

}  // namespace sdp
