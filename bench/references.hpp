// The references every pcientb figure is a ratio against, measured in the same run:
// memcpy between two buffers (bandwidth) and a shared-memory ping-pong between two processes
// (latency).
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace pcientb::bench {

// Page-aligned, pre-faulted anonymous memory; unmapped on destruction.
class Buffer {
 public:
  explicit Buffer(size_t size);
  ~Buffer();
  Buffer(const Buffer &) = delete;
  Buffer &operator=(const Buffer &) = delete;

  uint8_t *data() const { return data_; }
  size_t size() const { return size_; }
  explicit operator bool() const { return data_ != nullptr; }

 private:
  uint8_t *data_ = nullptr;
  size_t size_ = 0;
};

// memcpy of `size` bytes between two buffers of that size, `count` times; returns seconds.
double time_memcpy(const Buffer &dst, const Buffer &src, size_t size, uint64_t count);

// A child process that answers pings written to one cache line of a MAP_SHARED anonymous page
// with pongs on another. It spins only while awake: round_trips() wakes it and sleep()
// puts it back to sleep on a futex, so it can be forked before a verbs device is opened and kept
// for the whole run without competing for a core with other measurements.
class ShmPingPong {
 public:
  // Forks the answering child, asleep. nullptr and *err on failure.
  static std::unique_ptr<ShmPingPong> start(std::string *err);
  ~ShmPingPong();
  ShmPingPong(const ShmPingPong &) = delete;
  ShmPingPong &operator=(const ShmPingPong &) = delete;

  // n pings, each after the previous pong; returns seconds, negative if the child stopped
  // answering. Wakes the child if it sleeps.
  double round_trips(uint64_t n);
  // After a warm-up, `batches` batches of `per_batch` round trips; returns the mean half round
  // trip in seconds (negative on error) and, if samples is given, appends each batch's mean
  // round trip to it.
  double half_rtt(uint64_t batches, uint64_t per_batch, std::vector<double> *samples = nullptr);
  void sleep();

  struct Flags;  // the shared page, defined in references.cpp

 private:
  ShmPingPong(Flags *flags, pid_t pid) : flags_(flags), pid_(pid) {}

  Flags *flags_;
  pid_t pid_;
  uint64_t seq_ = 0;
  bool awake_ = false;
};

// Seconds since an arbitrary epoch, from the steady clock.
double now_s();

// Waits up to timeout_s for child `pid` to exit (it was told to), then kills it.
void reap_child(pid_t pid, double timeout_s);

// A busy-wait, as perftest polls: call expired() after every check that found nothing. It reads
// no clock on a short wait, so it adds nothing to a timed round. Once one wait has lasted 20 us it
// also yields the CPU at each clock reading, so on an oversubscribed machine the other side gets
// to run (a round then costs microseconds, not a scheduler tick). expired() is true once the
// wait has lasted timeout_s (negative: never).
class SpinWait {
 public:
  explicit SpinWait(double timeout_s) : timeout_s_(timeout_s) {}
  void progress() { spins_ = 0, since_ = 0; }
  bool expired() { return ++spins_ % 256 == 0 && slow_check(); }

 private:
  bool slow_check();

  double timeout_s_;
  double since_ = 0;  // when the wait was first seen to be long; 0: not yet
  uint32_t spins_ = 0;
};

}  // namespace pcientb::bench
