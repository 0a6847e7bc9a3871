// The ZCopy threshold `auto`: each large blocking send goes BCopy or ZCopy by what the two
// paths have been measured to deliver in this process, for sends of that size while that many
// connections send.
//
// Why measure, not model: on the emulated fabric a registration copies the pages, on
// hardware it pins them; the receiver's copy, contention for the cores and the peer's speed
// all move the crossover (NOTES.md: from 2.6 MiB for one connection to 500 KiB for eight).
// Why the whole process at once: with many connections ZCopy wins by needing less CPU per
// byte, which one socket trying it alone among BCopy senders cannot show. So time runs in
// epochs per size class: in an epoch every socket of the process sends that size by one
// path, and the epoch's figure is the bytes all of them completed per second (after a
// settling part: the other path's leftovers in the rings). The better path is used; the
// other gets an epoch again after a number of epochs that doubles while it keeps losing, up
// to 64 (0.64 s) when it lost by less than 1.5x, otherwise up to half the epochs the choice
// has held, within 64-256 (at once, when it lost by 4x or more), so that a change of
// conditions is seen, a choice made while a path was held back is undone soon, and a loser
// costs little; it takes over when it wins two such trials in a row. Each size class warms up each
// path first (registration caches, page faults: BCopy until each socket that sent went round its
// ring once), and keeps estimates per number of sockets that sent in an epoch (1, 2, 3-4, 5+):
// those that completed a send in it, or as many as were in a send at once, if more (a socket whose
// send outlasts the epoch sends too: counting only the completions filed an epoch of 8 sockets
// after a slow one under 3-4, and the path that had been slow kept a stale figure for 5+ for ever).
//
// A measured send costs 65-70 ns here (two clock reads, three locks): 1.6% of a 64 KiB BCopy
// send, 4% of a 16 KiB one. So in a BCopy epoch a socket measures its first send and then
// one in sample_every() (1 in 8 at 16 KiB, 1 in 4 up to 128 KiB, 1 in 2 up to 512 KiB); the
// others take the path in use (measures(): no lock, no clock), and a measured send stands for
// itself and them. Every ZCopy send is measured. A trial of a path that lost by 4x or more
// lasts half an epoch: it only has to show that the path still loses (ZCopy of 16-256 KiB is
// 3-40x slower than BCopy here).
//
// This file knows no socket: the caller gives the time and what it knows of the socket, so
// tests drive it with a clock of their own (tests/auto_threshold_test.cpp).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>

namespace sdp {

constexpr size_t kAutoMinBytes = 16 << 10;  // smaller sends go BCopy (no crossover below)

class AutoThreshold {
 public:
  using Log = void (*)(const char *fmt, ...);
  explicit AutoThreshold(Log log = nullptr) : log_(log) {}

  // One blocking send of at least kAutoMinBytes: its size class, epoch and path.
  struct Send {
    int size = 0;
    uint64_t epoch = 0;
    bool zcopy = false;
    uint32_t weight = 1;  // the sends it stands for
  };
  // A send of `len` bytes begins at `now` (ns, any monotonic clock); `weight`: what
  // measures() answered.
  Send begin(size_t len, uint64_t now, uint32_t weight = 1);
  // It completed `bytes` by `went_zcopy` at `now` (a send partly sent by the other path, or
  // failed, is not reported). `new_socket`: its socket has counted no send in this epoch yet;
  // `cold`: a BCopy send that wrote ring pages never written before. True if it counted (the
  // caller then remembers the epoch for its socket).
  bool completed(const Send &send, size_t bytes, bool went_zcopy, uint64_t now, bool new_socket,
                 bool cold);
  // It ended, completed or not.
  void end(const Send &send);
  // Whether a socket measures its next send of `len` bytes (begin .. end): its first in an
  // epoch (`socket_epoch`: the last one a send of it counted in), then 1 in a few
  // (`unmeasured` counts). Returns the sends it stands for (itself, and the unmeasured ones
  // since the last), or 0: then *zcopy is the running epoch's path, for the send to take.
  uint32_t measures(size_t len, uint64_t socket_epoch, uint32_t &unmeasured, bool *zcopy) const;
  // Held over fork(): a child, which has only the forking thread, would wait for it for ever.
  void fork_lock(bool lock) { lock ? mu_.lock() : mu_.unlock(); }

  static constexpr uint64_t kEpochNs = 10'000'000;
  static constexpr uint32_t kMaxGap = 256;  // epochs between trials of a path, at most

 private:
  static constexpr int kConnBuckets = 4;   // 1, 2, 3-4, 5 or more connections sending
  static constexpr int kSizeBuckets = 16;  // log2 of the size, from kAutoMinBytes up
  static constexpr uint32_t kMinGap = 4;

  struct Estimate {
    double rate[2] = {0, 0};  // bytes per ns of BCopy and ZCopy epochs (0: none yet)
    uint32_t gap = kMinGap;   // epochs of the better path before the other is tried again
    uint32_t since = 0;       // epochs since the last trial
    uint32_t in_use = 0;      // epochs since the better path was chosen
    uint32_t retries = 0;     // trials made again at once since the last figure
    bool decided = false;     // both measured (the choice was logged)
    bool challenged = false;  // the other path won its last trial: one more decides
    bool zcopy = false;       // the better one
  };
  struct Cell {
    Estimate est[kConnBuckets];
    uint64_t epoch = 0;        // 0: none running
    bool zcopy = false;        // the running epoch's path
    bool short_trial = false;  // ... of a path that lost by 4x or more: half an epoch
    // epoch << 1 | zcopy, for the sends that are not measured
    std::atomic<uint64_t> running{0};
    bool trial = false;             // ... is the worse one, tried again
    bool warm[2] = {false, false};  // a path's warm-up in this cell is over
    bool cold = false;              // a BCopy send of the epoch wrote ring pages the first time
    int conns = 0;                  // bucket of the connections that sent in the last epoch
    uint64_t start_ns = 0, timed_ns = 0;
    uint64_t active_ns = 0;  // the last begin or completion of the epoch
    // Sends completed after timed_ns: the rate is the bytes after the first of them over the
    // time from the first to the last.
    uint64_t first_ns = 0, last_ns = 0, first_bytes = 0, bytes = 0;
    uint32_t sends = 0;
    uint32_t sockets = 0;    // distinct sockets that completed a send in the epoch
    uint32_t in_flight = 0;  // sends of this size class under way (any epoch's)
    uint32_t peak = 0;       // the most under way at once in the epoch
  };

  static int conn_bucket(uint32_t sockets);
  static int size_bucket(size_t len);
  static uint32_t sample_every(int size);
  void close_epoch(Cell &c, int size, bool idle);
  void open_epoch(Cell &c, uint64_t now);

  std::mutex mu_;
  Cell cells_[kSizeBuckets];
  uint64_t epochs_ = 0;
  const Log log_;
};

}  // namespace sdp
