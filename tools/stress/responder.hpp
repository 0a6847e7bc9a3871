// The target side of one RC connection: receives (on the worker's SRQ or on
// the QP's own receive queue), checks every message against what message n
// of that connection must be, and when the initiator moves on checks that
// nothing it was told had arrived is missing and that the atomic word holds
// what the initiator's atomics left there.
#ifndef PCIENTB_STRESS_RESPONDER_HPP
#define PCIENTB_STRESS_RESPONDER_HPP

#include "env.hpp"

#include <optional>
#include <string>
#include <vector>

namespace stress {

// The worker's receive buffers: slots of max_size bytes, each posted as 1..16
// SGEs alternating between two MRs.
class RecvPool {
 public:
  RecvPool(ibv_pd *pd, int slots, uint64_t max_size, uint32_t max_sge);
  std::optional<int> take();
  void give(int slot) { free_.push_back(slot); }
  // Posts `slot` to `srq`, or else to `qp`; ibv_post_*'s value.
  int post(Rng &rng, int slot, ibv_qp *qp, ibv_srq *srq);
  // An SRQ post refused with ENOMEM although fewer than max_wr WQEs are
  // outstanding (a provider bug, counted as unexpected): the slot is posted
  // again later, so the SRQ keeps its depth.
  void defer_srq(int slot) { deferred_srq_.push_back(slot); }
  void retry_deferred(Rng &rng, ibv_srq *srq);
  // First offset in [0, len) of the slot's bytes that differs from the pattern.
  size_t mismatch(int slot, uint64_t len, uint64_t seed) const;
  uint8_t byte(int slot, uint64_t logical) const;

 private:
  struct Span {
    uint8_t *ptr;
    uint64_t len;
  };
  // The slot's pieces as posted (`n` SGEs).
  int pieces(int slot, Span *out) const;

  uint64_t max_, b_stride_;
  uint32_t max_sge_;
  Region a_, b_;
  std::vector<int> free_;
  std::vector<uint8_t> sges_;  // SGE count of each slot's last posting
  std::vector<int> deferred_srq_;
};

struct Window;  // the worker's MR that connections WRITE into and do atomics on

class Responder {
 public:
  // Creates the QP and brings it to RTS towards the initiator of `conn`
  // (throws VerbsError).
  Responder(Env &env, RecvPool &pool, ibv_srq *srq, int index, int init_slot, int init_q,
            uint32_t epoch, uint8_t *region, uint64_t *atomic_word);
  ~Responder();
  Responder(const Responder &) = delete;
  Responder &operator=(const Responder &) = delete;

  bool step();  // poll, check, repost, notice the end; true if anything happened
  bool done() const { return state_ == State::kDone; }
  // Chaos: destroy the QP, or move it to ERR, while the initiator sends.
  bool abort(bool destroy);
  bool owns(const ibv_qp *qp) const { return qp_ && qp_.get() == qp; }
  bool on_qp_event(const ibv_qp *qp, ibv_event_type type);
  uint64_t oldest_wait_ns(char *text, size_t n) const;
  int index() const { return index_; }
  bool uses_srq() const { return srq_ != nullptr; }

 private:
  // kBroken: an error completion, or abort(); kFinishing: the initiator has
  // moved on, its last messages may still be coming; kReleasing: an SRQ QP in
  // ERR waits for IBV_EVENT_QP_LAST_WQE_REACHED.
  enum class State { kActive, kBroken, kFinishing, kReleasing, kDone };

  void post_receives();
  bool poll();
  void on_receive(const ibv_wc &wc);
  void on_error(const ibv_wc &wc);
  void check_message(const ibv_wc &wc, int slot);
  bool out_of_sequence(const ibv_wc &wc, int slot, const std::string &why);
  std::string header_differs(const ibv_wc &wc, const MessageDesc &d) const;
  std::string bytes_differ(int slot, const MessageDesc &d) const;
  bool is_message(const ibv_wc &wc, int slot, uint64_t seq) const;
  bool initiator_moved_on() const;
  bool tail_arrived() const;
  void check_end();
  void release();
  void no_last_wqe();
  void destroy();

  Env &env_;
  RecvPool &pool_;
  ibv_srq *srq_;
  int index_;
  int init_slot_, init_q_;
  uint32_t epoch_, init_gen_;
  uint64_t key_;
  uint8_t *region_;
  uint64_t *atomic_word_;
  ResponderInfo &info_;
  ConnRecord &conn_;
  CqPtr cq_;
  QpPtr qp_;
  State state_ = State::kActive;
  bool failed_on_purpose_ = false;  // moved to ERR by abort()
  bool destroyed_ = false;          // destroyed by abort()
  bool last_wqe_ = false;           // IBV_EVENT_QP_LAST_WQE_REACHED seen (or reported missing)
  std::vector<int> posted_;         // slots on the QP's own receive queue
  uint64_t next_seq_ = 0;
  uint64_t deadline_ns_ = 0;  // of the state's wait
  uint64_t errored_ns_ = 0;   // when we moved the QP to ERR
  uint64_t created_ns_ = 0;
};

}  // namespace stress

#endif
