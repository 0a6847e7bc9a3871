// What every part of a worker shares: its place in the directory, its
// counters, the device, the options, a random generator, and logging.
#ifndef PCIENTB_STRESS_ENV_HPP
#define PCIENTB_STRESS_ENV_HPP

#include "directory.hpp"
#include "options.hpp"
#include "pattern.hpp"
#include "verbs.hpp"

#include <cstdarg>

namespace stress {

struct Env {
  Env(Directory &dir, const Options &opt, int slot, uint32_t gen);

  Directory &dir;
  const Options &opt;
  int slot;
  uint32_t gen;
  WorkerSlot &me;
  Counters &cnt;
  Rng rng;
  Node *node = nullptr;
  uint64_t region_len;    // each connection's WRITE region at its target (2 * max_size)
  uint32_t send_sge = 1;  // SGEs per send WR (min of 16 and the device's max_sge)
  uint32_t recv_sge = 1;

  WorkerSlot &slot_of(int s) { return dir.slots[s]; }
  RunPhase phase() const {
    return static_cast<RunPhase>(dir.phase.load(std::memory_order_acquire));
  }
  void doing(Doing d, uint32_t arg = 0) {
    me.doing.store(static_cast<uint32_t>(d), std::memory_order_relaxed);
    me.doing_arg.store(arg, std::memory_order_relaxed);
  }

  // Logs to stderr as "pcientb-stress[w<slot>.g<gen>]: ..." (a bounded number
  // of lines per worker, so a systematic failure cannot flood the output).
  void log(const char *fmt, ...) __attribute__((format(printf, 2, 3)));
  // Only with --verbose.
  void trace(const char *fmt, ...) __attribute__((format(printf, 2, 3)));
  // Counts an unexpected completion status and logs why it was unexpected.
  void unexpected_status(int status, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
  void anomaly(Anomaly a, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
  void corrupted(const char *fmt, ...) __attribute__((format(printf, 2, 3)));
  void lost(uint64_t n, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
  void hung(const char *fmt, ...) __attribute__((format(printf, 2, 3)));

 private:
  // Each kind of message has its own budget, so that a flood of one kind
  // cannot hide the first of another.
  enum LogKind { kInfo, kStatus, kAnomaly, kCorrupted, kLost, kHung, kLogKinds };
  void vlog(LogKind kind, const char *fmt, va_list ap);
  int budget_[kLogKinds] = {50, 50, 50, 50, 50, 50};
};

}  // namespace stress

#endif
