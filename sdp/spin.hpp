// How long a thread's waits busy-poll before they sleep: poll/select/epoll (multiplex.cpp)
// and a blocking call's wait on its socket (stream.cpp) adapt one window per thread.
#pragma once

#include <algorithm>
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

 private:
  static int64_t least() { return int64_t(config().spin_us) * 1000; }
  static int64_t most() { return 8 * least(); }
  int64_t shrunk() { return std::max(least(), ns() / 2); }
  int64_t window_ = -1;
};
inline __attribute__((tls_model("initial-exec"))) thread_local SpinWindow t_spin;

// Tells the thread's window, when the wait ends, how long it slept after its spin, or that
// it timed out.
struct SleepRecord {
  int64_t since = -1;  // when the first sleep began; -1: it has not slept
  bool timed_out = false;
  void sleeping(int64_t spin_end) {
    if (since < 0) since = spin_end;
  }
  ~SleepRecord() {
    if (timed_out)
      t_spin.timed_out();
    else if (since >= 0)
      t_spin.slept(int64_t(now_ns()) - since);
  }
  SleepRecord() = default;
  SleepRecord(const SleepRecord &) = delete;
  SleepRecord &operator=(const SleepRecord &) = delete;
};

}  // namespace sdp
