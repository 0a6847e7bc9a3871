// The directory: one MAP_SHARED|MAP_ANONYMOUS mapping made by the controller
// before it forks the workers, so it outlives any of them. Workers publish
// there what their peers need (LID, QPNs, MR keys, per-connection state) and
// count there what they did (so a SIGKILLed worker's counts survive it). The
// controller publishes who is alive (generation and life of each slot).
//
// Only atomics are written while others may read; plain fields are written
// before a release store that publishes them (a handshake word, `life`).
#ifndef PCIENTB_STRESS_DIRECTORY_HPP
#define PCIENTB_STRESS_DIRECTORY_HPP

#include <infiniband/verbs.h>
#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>

namespace stress {

inline constexpr int kMaxProcs = 64;
inline constexpr int kMaxQps = 32;         // initiator QPs per worker
inline constexpr int kMaxResponders = 80;  // QPs a worker answers on (2 * qps + 8 used)
inline constexpr int kFinalsRing = 8;      // closed epochs whose finals a target can still read
inline constexpr int kStatusSlots = 32;    // ibv_wc_status values

// ---- what is counted --------------------------------------------------------------------

enum class Op : uint8_t { kSend, kSendImm, kWrite, kWriteImm, kRead, kFetchAdd, kCmpSwap, kUdSend };
inline constexpr int kOpCount = 8;
const char *op_name(Op op);

// Why an error completion was expected; shown by the directory.
enum class Reason : uint8_t {
  kPeerKilled,      // the other side's process was SIGKILLed (or had exited)
  kPeerQpGone,      // the target destroyed its QP or moved it to ERR
  kMrReregistered,  // the target deregistered the MR the WR's rkey named
  kCqOverrun,       // the CQ was overrun on purpose
  kOwnQpFailed,     // a receive flushed because this side failed its own QP on purpose
};
inline constexpr int kReasonCount = 5;
const char *reason_name(Reason r);

// Unexpected events that are not a completion status.
enum class Anomaly : uint8_t {
  kSuccessAfterError,  // a WR completed successfully after an earlier one failed
  kSecondError,        // a second non-flush error on a QP that had failed already
  kAsyncEvent,         // an async event with no cause in the directory
  kNoOverrunEvent,     // an overrun CQ raised no IBV_EVENT_CQ_ERR
  kVerbsCall,          // a verbs call failed (create, modify, post, poll, reg)
  kWorkerCrash,        // a worker exited or died by itself
  kHandshake,          // a connection was refused or timed out with the target alive
  kUnknownCompletion,  // a completion for no WR this side has outstanding
  kNotInError,         // a QP not in ERR after an error completion
  kSuccessToDead,      // success for a WR posted after its target had been reaped
  kNoLastWqe,          // an SRQ QP in ERR raised no IBV_EVENT_QP_LAST_WQE_REACHED
  kRepostRefused,      // a receive repost refused (ENOMEM) with fewer than max_wr outstanding
};
inline constexpr int kAnomalyCount = 12;
const char *anomaly_name(Anomaly a);

using Counter = std::atomic<uint64_t>;

struct Counters {
  Counter ops[kOpCount];        // completed successfully
  Counter op_errors[kOpCount];  // completed with an error status
  Counter bytes;                // payload of successful operations
  Counter verified_bytes;       // bytes compared against their pattern
  Counter messages;             // RC messages checked by their target
  Counter ud_sent, ud_received, ud_reordered;
  Counter connections;            // RC connections established
  Counter qp_recreations_clean;   // an initiator QP closed after draining
  Counter qp_recreations_abrupt;  // an initiator QP destroyed with work outstanding
  Counter target_qp_destroyed;    // a responder QP destroyed under traffic
  Counter target_qp_errored;      // a responder QP moved to ERR under traffic
  Counter mr_reregistrations;
  Counter cq_overruns;
  Counter discarded;  // messages acknowledged but destroyed with their target QP on purpose
  Counter unverified_write_bytes;         // WRITEs that succeeded but whose manifest failed
  Counter expected[kReasonCount];         // first error completions, by reason
  Counter flushed[kReasonCount];          // IBV_WC_WR_FLUSH_ERR after them
  Counter expected_events[kReasonCount];  // async events with a cause
  Counter unexpected_status[kStatusSlots];
  Counter anomalies[kAnomalyCount];
  Counter lost, corrupted, duplicated, hung;
};

inline void bump(Counter &c, uint64_t n = 1) {
  c.fetch_add(n, std::memory_order_relaxed);
}
inline uint64_t get(const Counter &c) {
  return c.load(std::memory_order_relaxed);
}

// ---- liveness --------------------------------------------------------------------------

enum class Life : uint32_t {
  kEmpty,     // never started
  kStarting,  // forked, opening the device
  kReady,     // published its endpoints; takes connections
  kDying,     // the controller is about to SIGKILL it (set before the kill)
  kDead,      // reaped
  kDraining,  // the run is ending: closes its connections, takes no new ones
  kDone,      // finished cleanly, about to exit
};

// An MR key with a version that changes when the MR is re-registered:
// (version << 32) | rkey; rkey 0 while the MR is being re-registered.
inline uint64_t pack_key(uint32_t version, uint32_t rkey) {
  return (static_cast<uint64_t>(version) << 32) | rkey;
}
inline uint32_t key_version(uint64_t k) {
  return static_cast<uint32_t>(k >> 32);
}
inline uint32_t key_rkey(uint64_t k) {
  return static_cast<uint32_t>(k);
}

// ---- connection handshake ---------------------------------------------------------------

// The handshake word of an initiator QP: epoch (bumped for every connection
// attempt), target slot, responder index at the target, phase.
enum class Phase : uint8_t { kIdle, kRequested, kClaimed, kAccepted, kRefused, kClosed };
struct Handshake {
  uint32_t epoch = 0;
  uint8_t target = 0;
  uint8_t responder = 0;
  Phase phase = Phase::kIdle;
  uint64_t pack() const {
    return (static_cast<uint64_t>(epoch) << 32) | (static_cast<uint64_t>(target) << 16) |
           (static_cast<uint64_t>(responder) << 8) | static_cast<uint8_t>(phase);
  }
  static Handshake unpack(uint64_t w) {
    return {static_cast<uint32_t>(w >> 32), static_cast<uint8_t>(w >> 16),
            static_cast<uint8_t>(w >> 8), static_cast<Phase>(w & 0xff)};
  }
};

// What the initiator reports about one epoch, for the target's end check:
// messages acknowledged (epoch << 32 | count), the value its atomic word must
// hold, and epoch + 1 in `clean` once nothing is outstanding any more.
struct Finals {
  Counter acked;
  Counter atomic_value;
  Counter clean;
};

// One initiator QP's record (owned by the initiating worker).
struct ConnRecord {
  Counter state;  // Handshake::pack()
  // The request, written before the state goes to kRequested.
  uint32_t init_gen, init_qpn, init_psn, target_gen;
  uint16_t init_lid;
  uint64_t key;  // seeds this connection's messages
  Finals finals[kFinalsRing];
};

// One QP a worker answers on (owned by the target), filled before it accepts.
struct ResponderInfo {
  uint32_t init_slot, init_q, epoch;
  uint32_t qpn, psn;
  uint64_t region_addr, region_len;  // for this connection's WRITEs
  uint64_t atomic_addr, atomic_init;
  uint32_t srq;
  Counter verified;  // messages the target has checked (the initiator may reuse their bytes)
  Counter aborted;   // set before the target destroys or fails this QP on purpose
};

// What a worker is doing, for the hang report (code + argument, cheap to set).
enum class Doing : uint32_t {
  kStarting,
  kLoop,
  kPostSend,
  kPostRecv,
  kPollCq,
  kCreate,
  kModifyQp,
  kDestroy,
  kRegMr,
  kDeregMr,
  kAsyncEvent,
  kOverrun,
  kDraining,
  kExiting,
  kInjectedHang,
};
const char *doing_name(Doing d);

struct WorkerSlot {
  std::atomic<uint32_t> generation;
  std::atomic<uint32_t> life;  // Life
  std::atomic<int32_t> pid;
  Counter heartbeat_ns;  // steady clock, every loop
  std::atomic<uint32_t> doing, doing_arg;
  char waiting[256];  // the oldest thing it waits for (rewritten every second)
  // Endpoints, written before life goes to kReady.
  uint32_t lid, ud_qpn, ud_qkey;
  uint64_t read_addr, read_len, window_addr, window_len;
  Counter read_key, window_key;     // pack_key(version, rkey)
  std::atomic<uint32_t> accepting;  // takes new connections (not during the drain)
  Counters counters;
  ConnRecord conns[kMaxQps];
  ResponderInfo responders[kMaxResponders];
};

enum class RunPhase : uint32_t { kRun, kDrain, kStop };

struct Directory {
  std::atomic<uint32_t> phase;  // RunPhase
  Counter ops_posted;           // against --ops
  Counter started, kills, crashes, hung_workers;
  int procs;
  WorkerSlot slots[kMaxProcs];
};

// The shared mapping, zeroed; never unmapped (the controller exits with it).
Directory *create_directory(int procs);

inline uint64_t now_ns() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}
inline constexpr uint64_t kMs = 1000000;  // ns

// The process `gen` of `slot` is gone or going (killed, crashed or finished).
bool generation_gone(const Directory &dir, int slot, uint32_t gen);

}  // namespace stress

#endif
