// The requester side of one RC connection: it connects its QP to a random
// worker through the directory, posts random operations, checks what comes
// back (READ data, atomics' old values) and classifies every error.
//
// A connection lives for one epoch of the QP's record. It ends cleanly
// (nothing outstanding, finals published), abruptly (QP destroyed with work
// outstanding, on purpose), or after an error (the first error completion
// is classified, the flushes after it are counted, then the QP is
// destroyed). Then a new QP connects, maybe to another worker.
#ifndef PCIENTB_STRESS_INITIATOR_HPP
#define PCIENTB_STRESS_INITIATOR_HPP

#include "env.hpp"
#include "staging.hpp"

#include <deque>
#include <optional>
#include <vector>

namespace stress {

class Initiator {
 public:
  Initiator(Env &env, int q);
  ~Initiator();
  Initiator(const Initiator &) = delete;
  Initiator &operator=(const Initiator &) = delete;

  // One round of work; true if anything happened.
  bool step();
  // Chaos: end the connection (cleanly after draining, or by destroying the
  // QP with work outstanding) and connect again. False if not connected.
  bool recreate(bool clean);
  // The run is ending: close cleanly and never reconnect.
  void stop() { stopping_ = true; }
  bool stopped() const { return state_ == State::kStopped; }
  bool owns(const ibv_qp *qp) const { return qp_ && qp_.get() == qp; }
  // An async event for our QP; nothing we do should raise one.
  void on_qp_event(ibv_event_type type);
  // The oldest thing this connection waits for, and since when (0: nothing).
  uint64_t oldest_wait_ns(char *text, size_t n) const;

 private:
  enum class State { kIdle, kRequesting, kActive, kClosing, kFailed, kStopped };
  enum class RemoteMr : uint8_t { kNone, kWindow, kRead };

  struct WrRecord {
    uint64_t id;
    Op op;
    bool signaled;
    bool manifest;  // the SEND after a WRITE: tells the target to check it
    bool message;   // takes a receive at the target; `seq` is its number
    uint64_t seq;
    uint64_t bytes;  // counted when it succeeds
    RemoteMr mr;
    uint32_t key_version;              // version of the rkey it used
    uint64_t read_offset;              // READ: offset in the target's READ MR
    uint64_t expect_old, value_after;  // atomics
    uint64_t posted_ns;
    bool target_dead;  // the target had been reaped when it was posted
    Layout layout;
  };
  struct PendingWrite {  // a WRITE whose bytes the target has not checked yet
    uint64_t seq, offset, length;
  };

  // ---- connection lifecycle ----
  void start_connect();
  void poll_handshake();
  void on_accepted(const Handshake &h);
  void abandon_request(bool target_gone);
  void teardown(bool clean);
  void backoff(uint64_t min_ms, uint64_t max_ms);
  void publish_acked();
  bool target_gone() const;

  // ---- posting ----
  bool post_some();
  bool reserve_op();
  bool post_message();
  bool post_read(uint64_t len, bool force_signal);
  bool post_atomic(bool cmp_swap);
  bool post_chain(ibv_send_wr *first, std::vector<WrRecord> &records);
  int send_flags(bool force_signal, uint64_t inline_len);
  bool overlaps_unverified(uint64_t offset, uint64_t length);
  bool refresh_key(RemoteMr mr);
  void inject_corruption(const Layout &l);

  // ---- completions ----
  bool poll();
  void on_completion(const ibv_wc &wc);
  void retire(WrRecord &rec, ibv_wc_status status);
  void on_success(WrRecord &rec);
  void check_read(WrRecord &rec);
  void check_atomic(WrRecord &rec);
  void on_first_error(const WrRecord &rec, ibv_wc_status status);
  std::optional<Reason> cause_of(const WrRecord &rec, ibv_wc_status status) const;
  void check_deadlines();

  Env &env_;
  int q_;
  ConnRecord &rec_;
  Staging staging_;
  State state_ = State::kIdle;
  bool stopping_ = false;
  bool close_requested_ = false;  // chaos asked for a clean close
  uint64_t next_try_ns_ = 0;
  uint64_t deadline_ns_ = 0;

  CqPtr cq_;
  QpPtr qp_;
  uint32_t max_inline_ = 0;
  uint32_t psn_ = 0;

  // The current epoch's connection.
  uint32_t epoch_ = 0;
  int target_ = 0;
  uint32_t target_gen_ = 0;
  int responder_ = 0;
  uint64_t key_ = 0;
  uint64_t region_addr_ = 0, atomic_addr_ = 0;
  uint64_t read_addr_ = 0, read_len_ = 0;
  uint64_t window_key_ = 0, read_key_ = 0;  // as cached at connect time (pack_key)
  uint64_t next_seq_ = 0, acked_ = 0;
  uint64_t atomic_value_ = 0;      // what the word holds once everything posted is done
  uint64_t atomic_confirmed_ = 0;  // what it holds after the WRs completed so far
  std::deque<PendingWrite> unverified_;
  std::deque<WrRecord> outstanding_;
  uint64_t next_wr_id_ = 1;
  int since_signal_ = 0;
  bool failed_ = false;
  std::optional<Reason> failure_reason_;
  uint64_t failed_ns_ = 0;
  bool last_write_ok_ = false;
  uint64_t last_write_bytes_ = 0;
  uint64_t last_activity_ns_ = 0;
};

}  // namespace stress

#endif
