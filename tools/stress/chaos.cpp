#include "chaos.hpp"

#include <algorithm>
#include <cstring>

namespace stress {
namespace {

constexpr int kBatch = 64;
constexpr int kExtra = 512;  // completions beyond the CQ's capacity
constexpr int kMinCqCapacity = 4096;
constexpr uint64_t kEventWaitNs = 5000 * kMs;    // for IBV_EVENT_CQ_ERR
constexpr uint64_t kQpFatalGraceNs = 200 * kMs;  // after it, for IBV_EVENT_QP_FATAL

}  // namespace

ChaosClock::ChaosClock(Env &env) : env_(env) {
  if (env_.opt.churn_ms > 0)
    next_ns_ = now_ns() + static_cast<uint64_t>(env_.rng.exponential(env_.opt.churn_ms) * kMs);
}

ChaosEvent ChaosClock::poll() {
  if (env_.opt.churn_ms <= 0 || env_.phase() != RunPhase::kRun) return ChaosEvent::kNone;
  uint64_t now = now_ns();
  if (now < next_ns_) return ChaosEvent::kNone;
  next_ns_ = now + static_cast<uint64_t>(env_.rng.exponential(env_.opt.churn_ms) * kMs);
  // Weights of the events, among those --chaos allows.
  static constexpr struct {
    ChaosEvent event;
    uint32_t bit, weight;
  } kTable[] = {
      {ChaosEvent::kRecreateQpClean, kChaosQpClean, 18},
      {ChaosEvent::kRecreateQpAbrupt, kChaosQpAbrupt, 12},
      {ChaosEvent::kDestroyTargetQp, kChaosTargetDestroy, 10},
      {ChaosEvent::kFailTargetQp, kChaosTargetError, 10},
      {ChaosEvent::kReregisterWindow, kChaosMrWindow, 18},
      {ChaosEvent::kReregisterReadMr, kChaosMrRead, 14},
      {ChaosEvent::kCqOverrun, kChaosCqOverrun, 18},
  };
  uint32_t total = 0;
  for (const auto &e : kTable)
    if (env_.opt.chaos & e.bit) total += e.weight;
  if (total == 0) return ChaosEvent::kNone;
  uint64_t r = env_.rng.below(total);
  for (const auto &e : kTable) {
    if (!(env_.opt.chaos & e.bit)) continue;
    if (r < e.weight) return e.event;
    r -= e.weight;
  }
  return ChaosEvent::kNone;
}

void CqOverrun::start() {
  ibv_context *ctx = env_.node->ctx.get();
  env_.doing(Doing::kOverrun);
  // Asked for 1 entry; the provider rounds CQs up to 4096 entries or more
  // (its cqe may say so, or may repeat what was asked).
  victim_ = create_cq(ctx, 1);
  capacity_ = std::max(victim_->cqe, kMinCqCapacity);
  other_ = create_cq(ctx, 16);
  int wrs = std::min<int>(capacity_ + kExtra, env_.node->dev.max_qp_wr);
  if (wrs <= capacity_) {  // cannot overrun it from one send queue: skip
    victim_.reset();
    other_.reset();
    return;
  }
  ibv_qp_init_attr attr{};
  attr.qp_type = IBV_QPT_RC;
  attr.send_cq = victim_.get();
  attr.recv_cq = other_.get();
  attr.cap = {static_cast<uint32_t>(wrs), 1, 1, 1, 0};
  a_ = create_qp(env_.node->pd.get(), &attr);
  attr.send_cq = other_.get();
  attr.cap = {1, 1, 1, 1, 0};
  b_ = create_qp(env_.node->pd.get(), &attr);
  rc_init(a_.get(), 0);
  rc_init(b_.get(), IBV_ACCESS_REMOTE_WRITE);
  rc_connect(a_.get(), RcPeer{env_.node->lid, b_->qp_num, 1}, 1);
  rc_connect(b_.get(), RcPeer{env_.node->lid, a_->qp_num, 1}, 1);

  // Zero-length RDMA WRITEs, all signaled: each needs a completion on the
  // victim, which nobody polls. (A zero-length WRITE names no memory.)
  cq_err_ = qp_fatal_ = false;
  posted_ = 0;
  started_ns_ = now_ns();
  ibv_send_wr wrs_batch[kBatch];
  while (posted_ < wrs) {
    int n = std::min(kBatch, wrs - posted_);
    for (int i = 0; i < n; ++i) {
      wrs_batch[i] = ibv_send_wr{};
      wrs_batch[i].wr_id = static_cast<uint64_t>(posted_ + i);
      wrs_batch[i].opcode = IBV_WR_RDMA_WRITE;
      wrs_batch[i].send_flags = IBV_SEND_SIGNALED;
      wrs_batch[i].next = i + 1 < n ? &wrs_batch[i + 1] : nullptr;
    }
    ibv_send_wr *bad = nullptr;
    if (int rc = ibv_post_send(a_.get(), wrs_batch, &bad)) {
      env_.anomaly(Anomaly::kVerbsCall, "overrun: ibv_post_send after %d WRs (CQ of %d): %s",
                   posted_, capacity_, std::strerror(rc));
      break;
    }
    posted_ += n;
  }
  env_.trace("overrun: %d completions due on a CQ of %d", posted_, capacity_);
}

void CqOverrun::step() {
  if (!active()) return;
  uint64_t waited = now_ns() - started_ns_;
  if (cq_err_ && (qp_fatal_ || waited > kQpFatalGraceNs)) return finish();
  if (waited > kEventWaitNs) {
    env_.anomaly(Anomaly::kNoOverrunEvent,
                 "overrun: %d signaled WRs on a QP whose send CQ holds %d: no IBV_EVENT_CQ_ERR "
                 "after %.1f s (QP state %d)",
                 posted_, capacity_, waited / 1e9, qp_state(a_.get()));
    finish();
  }
}

void CqOverrun::finish() {
  if (cq_err_) bump(env_.cnt.cq_overruns);
  env_.doing(Doing::kDestroy, 3000);
  a_.reset();
  b_.reset();
  victim_.reset();
  other_.reset();
}

bool CqOverrun::on_cq_event(const ibv_cq *cq) {
  if (!victim_ || cq != victim_.get()) return false;
  cq_err_ = true;
  bump(env_.cnt.expected_events[static_cast<int>(Reason::kCqOverrun)]);
  return true;
}

bool CqOverrun::on_qp_event(const ibv_qp *qp, ibv_event_type type) {
  if (!a_ || (qp != a_.get() && qp != b_.get())) return false;
  if (qp == a_.get() && type == IBV_EVENT_QP_FATAL) {
    qp_fatal_ = true;
    bump(env_.cnt.expected_events[static_cast<int>(Reason::kCqOverrun)]);
  } else {
    env_.anomaly(Anomaly::kAsyncEvent, "overrun: %s on the %s QP", event_name(type),
                 qp == a_.get() ? "sending" : "receiving");
  }
  return true;
}

}  // namespace stress
