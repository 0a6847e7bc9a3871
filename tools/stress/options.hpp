// pcientb-stress command line: what to run, for how long, how much chaos.
#ifndef PCIENTB_STRESS_OPTIONS_HPP
#define PCIENTB_STRESS_OPTIONS_HPP

#include <cstdint>
#include <string>

namespace stress {

// Faults the tool injects into its own traffic to prove that its checks can
// fail (hidden option --inject; see README "Soak test").
enum InjectMask : uint32_t {
  kInjectCorrupt = 1u << 0,  // flip one byte of some SEND/WRITE payloads after filling them
  kInjectLose = 1u << 1,     // skip a message sequence number now and then
  kInjectRead = 1u << 2,     // flip a byte of some READ results before checking them
  kInjectAtomic = 1u << 3,   // expect a wrong old value from some atomics
  kInjectHang = 1u << 4,     // one worker stops making progress (heartbeat stops)
};

// Chaos events a worker may choose (--chaos).
enum ChaosMask : uint32_t {
  kChaosQpClean = 1u << 0,        // qp-clean: drain, destroy and re-create an initiator QP
  kChaosQpAbrupt = 1u << 1,       // qp-abrupt: destroy an initiator QP with work outstanding
  kChaosTargetDestroy = 1u << 2,  // target-destroy: destroy a QP others send to
  kChaosTargetError = 1u << 3,    // target-error: move a QP others send to to ERR
  kChaosMrWindow = 1u << 4,       // mr-window: re-register the MR others WRITE to / do atomics on
  kChaosMrRead = 1u << 5,         // mr-read: re-register the MR others READ
  kChaosCqOverrun = 1u << 6,      // cq-overrun
  kChaosAll = (1u << 7) - 1,
};

struct Options {
  int procs = 4;                // worker processes (nodes)
  int qps = 4;                  // RC QPs each worker initiates traffic on
  uint64_t ops = 0;             // stop after this many operations (0: no limit)
  double seconds = 0;           // stop after this long (0: no limit; default 60 without --ops)
  uint64_t max_size = 4 << 20;  // largest message / RDMA size
  uint64_t seed = 0;
  int kill_ms = 3000;          // mean interval between SIGKILLs of a random worker (0: none)
  int churn_ms = 500;          // mean interval between chaos events, per worker (0: none)
  uint32_t chaos = kChaosAll;  // which events (ChaosMask)
  int srq_percent = 50;        // share of incoming connections that receive on the SRQ
  int hang_ms = 20000;         // a wait longer than this is a hang
  std::string fabric;
  bool quiet = false;
  int verbose = 0;      // 1: log every error completion and chaos event
  uint32_t inject = 0;  // InjectMask bits
};

// Parses argv. On --help prints the manual and exits 0; on a bad option or
// value prints a one-line error and "Try --help" and exits 2.
Options parse_options(int argc, char **argv);

// Human-readable bytes: "4.0 MiB".
std::string format_bytes(double bytes);

}  // namespace stress

#endif
