// Two-process test harness.
//
// A test that needs two nodes on the emulated fabric forks before either side
// opens the device. Parent and child then each run their own body, talking over
// a socketpair (the out-of-band channel, as perftest uses TCP):
//
//   two_process(
//       [](Channel& ch) { RcEnd a; a.connect(ch); ... ch.signal(); },
//       [](Channel& ch) { RcEnd b; b.connect(ch); ch.wait(); ... });
//
// A failure on either side fails the test and never hangs it:
//  - a gtest failure or an exception in the child makes it exit non-zero, and
//    the parent reports that (the child's own message is printed by the child);
//  - a child that crashes closes the channel, so the parent's next recv()
//    throws; its status is reported after the parent's body returns;
//  - every channel wait has a deadline, the parent kills the child when it has
//    failed itself, and a watchdog (alarm) ends a test stuck in a verbs call.
#ifndef PCIENTB_TESTS_TWO_PROCESS_HPP
#define PCIENTB_TESTS_TWO_PROCESS_HPP

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace pcientb::test {

using namespace std::chrono_literals;

// A helper could not do what the test needs (a resource could not be made, a
// wait timed out, the peer went away). The harness reports it as a failure.
struct SetupError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Throws SetupError "<what>: <strerror(err)>".
[[noreturn]] void throw_errno(const std::string &what, int err);

// Gives this process (and the children it forks) a fabric of its own by
// setting PCIENTB_FABRIC once, before any verbs call, so tests run in
// parallel without meeting each other's nodes.
void use_private_fabric();

// How long the channel waits for the peer before it gives up.
inline constexpr std::chrono::milliseconds kChannelTimeout = 20s;

// The out-of-band channel between parent and child.
class Channel {
 public:
  Channel(int fd, pid_t peer, bool is_parent);
  ~Channel();
  Channel(const Channel &) = delete;
  Channel &operator=(const Channel &) = delete;

  template <class T>
  void send(const T &value) {
    static_assert(std::is_trivially_copyable_v<T>);
    send_message(kValue, &value, sizeof value);
  }
  template <class T>
  T recv(std::chrono::milliseconds timeout = kChannelTimeout) {
    static_assert(std::is_trivially_copyable_v<T>);
    T value;
    recv_message(kValue, &value, sizeof value, timeout);
    return value;
  }
  // Sends ours, returns theirs.
  template <class T>
  T exchange(const T &mine) {
    send(mine);
    return recv<T>();
  }

  void signal();                                                   // "go on" to the peer
  void wait(std::chrono::milliseconds timeout = kChannelTimeout);  // the peer's signal
  void barrier() {
    signal();
    wait();
  }

  bool is_parent() const { return is_parent_; }
  pid_t peer_pid() const { return peer_; }

  // Parent only: SIGKILL the child now and reap it. The harness then takes
  // the child's death as intended.
  void kill_peer();
  bool peer_killed() const { return peer_killed_; }

 private:
  enum Kind : uint32_t { kValue = 0x56414c55, kSignal = 0x5349474e };
  void send_message(Kind kind, const void *data, size_t size);
  void recv_message(Kind kind, void *data, size_t size, std::chrono::milliseconds timeout);
  void write_all(const void *data, size_t size);
  void read_all(void *data, size_t size, std::chrono::steady_clock::time_point deadline);

  int fd_;
  pid_t peer_;
  bool is_parent_;
  bool peer_killed_ = false;
};

using Body = std::function<void(Channel &)>;

// Both limits are multiplied by $PCIENTB_TEST_TIME_SCALE (a whole number, default 1) for runs
// under a slow tool: valgrind's fork and exit of a process with the node's large mappings can
// take more than 15 s on a loaded machine.
struct TwoProcessOptions {
  // The whole test, both sides; past it the watchdog kills both processes.
  std::chrono::seconds deadline = 50s;
  // How long the child may take to finish once the parent's body is done.
  std::chrono::milliseconds child_grace = 15s;
};

// Forks; runs `parent` here and `child` in the child process; reports either
// side's failure as a failure of the current test.
void two_process(const Body &parent, const Body &child, TwoProcessOptions options = {});

}  // namespace pcientb::test

#endif
