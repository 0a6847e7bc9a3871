// Worker-side chaos. The events themselves live with what they break
// (Initiator::recreate, Responder::abort, Worker::reregister); this file has
// the choice of event and the CQ overrun scenario, which needs its own
// objects: a CQ that is never polled, fed by a loopback RC pair until more
// completions are due than it holds. An HCA then raises IBV_EVENT_CQ_ERR for
// the CQ (and IBV_EVENT_QP_FATAL for the QP whose completion was lost); the
// scenario waits for that (bounded), then destroys everything.
#ifndef PCIENTB_STRESS_CHAOS_HPP
#define PCIENTB_STRESS_CHAOS_HPP

#include "env.hpp"

namespace stress {

enum class ChaosEvent {
  kNone,
  kRecreateQpClean,   // an initiator drains, closes and reconnects
  kRecreateQpAbrupt,  // an initiator destroys its QP with work outstanding
  kDestroyTargetQp,   // a responder QP is destroyed under traffic
  kFailTargetQp,      // a responder QP is moved to ERR under traffic
  kReregisterWindow,  // the MR others WRITE into / do atomics on
  kReregisterReadMr,  // the MR others READ from
  kCqOverrun,
};

// When the next event is due and which one (every --churn-ms on average).
class ChaosClock {
 public:
  explicit ChaosClock(Env &env);
  ChaosEvent poll();

 private:
  Env &env_;
  uint64_t next_ns_ = 0;
};

class CqOverrun {
 public:
  explicit CqOverrun(Env &env) : env_(env) {}
  bool active() const { return victim_ != nullptr; }
  void start();  // throws VerbsError
  void step();
  // An async event of ours? Counts it.
  bool on_cq_event(const ibv_cq *cq);
  bool on_qp_event(const ibv_qp *qp, ibv_event_type type);

 private:
  void finish();

  Env &env_;
  CqPtr victim_, other_;
  QpPtr a_, b_;
  bool cq_err_ = false, qp_fatal_ = false;
  uint64_t started_ns_ = 0;
  int posted_ = 0, capacity_ = 0;
};

}  // namespace stress

#endif
