#include "worker.hpp"

#include "chaos.hpp"
#include "env.hpp"
#include "initiator.hpp"
#include "responder.hpp"
#include "ud.hpp"

#include <fcntl.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <vector>

namespace stress {
namespace {

constexpr int kAtomicStride = 64;  // one cache line per connection's atomic word
constexpr uint64_t kWaitingEveryNs = 1000 * kMs;

class Worker {
 public:
  Worker(Directory &dir, const Options &opt, int slot, uint32_t gen)
      : env_(dir, opt, slot, gen), chaos_(env_), overrun_(env_) {}
  ~Worker();  // members go in reverse order: QPs, then the SRQ, MRs, the device
  int run();

 private:
  void setup();
  void publish();
  bool loop_once();
  bool serve_requests();
  void accept(int init_slot, int q, uint64_t word);
  void handle_async_events();
  void dispatch(const ibv_async_event &ev);
  void do_chaos();
  bool abort_random_responder(bool destroy);
  void reregister(bool window);
  void start_drain();
  bool drained();
  void publish_waiting();

  Env env_;
  std::unique_ptr<Node> node_;
  Region window_, read_;
  std::unique_ptr<RecvPool> pool_;
  SrqPtr srq_;
  std::vector<std::unique_ptr<Initiator>> initiators_;
  std::array<std::unique_ptr<Responder>, kMaxResponders> responders_;
  int max_responders_ = 0;
  std::unique_ptr<UdEndpoint> ud_;
  ChaosClock chaos_;
  CqOverrun overrun_;
  bool draining_ = false;
  uint64_t drain_deadline_ns_ = 0;
  uint64_t started_ns_ = 0;
  uint64_t next_waiting_ns_ = 0;
  int idle_rounds_ = 0;
};

Worker::~Worker() {
  env_.doing(Doing::kExiting);
}

int Worker::run() {
  try {
    setup();
    while (!drained()) {
      // Nothing to do: let the others (2 cores, many processes) run.
      if (loop_once()) {
        idle_rounds_ = 0;
      } else if (++idle_rounds_ > 64) {
        usleep(100);
        idle_rounds_ = 0;
      } else {
        sched_yield();
      }
    }
  } catch (const VerbsError &e) {
    env_.anomaly(Anomaly::kVerbsCall, "%s; the worker gives up", e.what());
    return 3;
  }
  env_.me.life.store(static_cast<uint32_t>(Life::kDone), std::memory_order_release);
  return 0;
}

void Worker::setup() {
  started_ns_ = now_ns();
  env_.doing(Doing::kStarting);
  node_ = std::make_unique<Node>();
  env_.node = node_.get();
  int flags = fcntl(node_->ctx->async_fd, F_GETFL);
  fcntl(node_->ctx->async_fd, F_SETFL, flags | O_NONBLOCK);
  env_.send_sge = env_.recv_sge = static_cast<uint32_t>(std::min(16, node_->dev.max_sge));

  const Options &o = env_.opt;
  max_responders_ = std::min(kMaxResponders, 2 * o.qps + 2);  // qps come in on average
  ibv_pd *pd = node_->pd.get();
  env_.doing(Doing::kRegMr);
  window_ = Region(pd, max_responders_ * (env_.region_len + kAtomicStride), kAllAccess);
  read_ = Region(pd, o.max_size, IBV_ACCESS_REMOTE_READ);
  fill_pattern(read_.at(0), o.max_size, read_region_seed(env_.slot, env_.gen), 0);

  int srq_slots = 2 * o.qps + 4;
  ibv_srq_init_attr sattr{};
  sattr.attr.max_wr = static_cast<uint32_t>(srq_slots);  // exactly what is kept posted
  sattr.attr.max_sge = env_.recv_sge;
  env_.doing(Doing::kCreate);
  srq_.reset(ibv_create_srq(pd, &sattr));
  if (!srq_) throw_verbs("ibv_create_srq", errno);
  pool_ =
      std::make_unique<RecvPool>(pd, srq_slots + max_responders_ * 4, o.max_size, env_.recv_sge);
  for (int i = 0; i < srq_slots; ++i) {
    int slot = *pool_->take();
    if (int rc = pool_->post(env_.rng, slot, nullptr, srq_.get()))
      throw_verbs("ibv_post_srq_recv", rc);
  }
  ud_ = std::make_unique<UdEndpoint>(env_);
  for (int q = 0; q < o.qps; ++q) initiators_.push_back(std::make_unique<Initiator>(env_, q));
  publish();
}

// Endpoints first, then life = kReady (release): a peer that sees kReady sees them.
void Worker::publish() {
  WorkerSlot &me = env_.me;
  me.lid = node_->lid;
  me.ud_qpn = ud_->qpn();
  me.ud_qkey = kUdQkey;
  me.read_addr = read_.addr();
  me.read_len = read_.mem.size();
  me.window_addr = window_.addr();
  me.window_len = window_.mem.size();
  // Versions continue from the previous generation's, so no key ever repeats one.
  me.read_key.store(pack_key(key_version(get(me.read_key)) + 2, read_.mr->rkey));
  me.window_key.store(pack_key(key_version(get(me.window_key)) + 2, window_.mr->rkey));
  me.accepting.store(1, std::memory_order_relaxed);
  me.heartbeat_ns.store(now_ns());
  uint32_t starting = static_cast<uint32_t>(Life::kStarting);
  me.life.compare_exchange_strong(starting, static_cast<uint32_t>(Life::kReady),
                                  std::memory_order_acq_rel);
  env_.trace("ready: lid %u, %d QPs, max %d responders", node_->lid, env_.opt.qps, max_responders_);
}

bool Worker::loop_once() {
  uint64_t now = now_ns();
  env_.me.heartbeat_ns.store(now, std::memory_order_relaxed);
  env_.doing(Doing::kLoop);
  if ((env_.opt.inject & kInjectHang) && env_.slot == 0 && env_.gen == 1 &&
      now - started_ns_ > 3000 * kMs) {
    env_.doing(Doing::kInjectedHang);
    for (;;) pause();  // the controller must find this worker hung
  }
  bool did = false;
  handle_async_events();
  for (auto &i : initiators_) did |= i->step();
  for (auto &r : responders_) {
    if (!r) continue;
    did |= r->step();
    if (r->done()) r.reset();
  }
  pool_->retry_deferred(env_.rng, srq_.get());
  did |= serve_requests();
  did |= ud_->step();
  overrun_.step();
  if (!draining_) do_chaos();
  if (!draining_ && env_.phase() != RunPhase::kRun) start_drain();
  if (now >= next_waiting_ns_) {
    publish_waiting();
    next_waiting_ns_ = now + kWaitingEveryNs;
  }
  return did;
}

// ---- connections others ask for ---------------------------------------------------------

bool Worker::serve_requests() {
  bool did = false;
  for (int i = 0; i < env_.dir.procs; ++i) {
    for (int q = 0; q < env_.opt.qps; ++q) {
      uint64_t word = env_.slot_of(i).conns[q].state.load(std::memory_order_acquire);
      Handshake h = Handshake::unpack(word);
      if (h.phase != Phase::kRequested || h.target != env_.slot) continue;
      accept(i, q, word);
      did = true;
    }
  }
  return did;
}

// kRequested -> kClaimed (ours to answer) -> kAccepted or kRefused, each a
// compare-and-swap, so an initiator that gave up meanwhile (or died and was
// replaced) is never answered by mistake.
void Worker::accept(int init_slot, int q, uint64_t word) {
  ConnRecord &rec = env_.slot_of(init_slot).conns[q];
  Handshake h = Handshake::unpack(word);
  Handshake claimed = h;
  claimed.phase = Phase::kClaimed;
  if (!rec.state.compare_exchange_strong(word, claimed.pack(), std::memory_order_acq_rel)) return;
  auto answer = [&](Handshake to) {
    uint64_t expect = claimed.pack();
    return rec.state.compare_exchange_strong(expect, to.pack(), std::memory_order_acq_rel);
  };
  Handshake refused = h;
  refused.phase = Phase::kRefused;
  int index = -1;
  for (int r = 0; r < max_responders_ && index < 0; ++r)
    if (!responders_[r]) index = r;
  if (!env_.me.accepting.load() || draining_ || rec.target_gen != env_.gen ||
      generation_gone(env_.dir, init_slot, rec.init_gen) || index < 0) {
    answer(refused);
    return;
  }
  bool use_srq = env_.rng.chance(static_cast<uint32_t>(env_.opt.srq_percent));
  uint8_t *region = window_.at(index * env_.region_len);
  auto *atomic_word = reinterpret_cast<uint64_t *>(
      window_.at(max_responders_ * env_.region_len + index * kAtomicStride));
  std::unique_ptr<Responder> r;
  try {
    r = std::make_unique<Responder>(env_, *pool_, use_srq ? srq_.get() : nullptr, index, init_slot,
                                    q, h.epoch, region, atomic_word);
  } catch (const VerbsError &e) {
    env_.anomaly(Anomaly::kVerbsCall, "accepting w%d q%d: %s", init_slot, q, e.what());
    answer(refused);
    return;
  }
  Handshake accepted = h;
  accepted.phase = Phase::kAccepted;
  accepted.responder = static_cast<uint8_t>(index);
  if (answer(accepted)) responders_[index] = std::move(r);  // else: it gave up; r is destroyed
}

// ---- async events -------------------------------------------------------------------------

void Worker::handle_async_events() {
  ibv_async_event ev;
  env_.doing(Doing::kAsyncEvent);
  while (ibv_get_async_event(node_->ctx.get(), &ev) == 0) {
    dispatch(ev);
    ibv_ack_async_event(&ev);
  }
}

void Worker::dispatch(const ibv_async_event &ev) {
  switch (ev.event_type) {
    case IBV_EVENT_PORT_ACTIVE:
    case IBV_EVENT_COMM_EST:
      return;  // informational
    case IBV_EVENT_CQ_ERR:
      if (overrun_.on_cq_event(ev.element.cq)) return;
      env_.anomaly(Anomaly::kAsyncEvent,
                   "IBV_EVENT_CQ_ERR on a CQ that was not overrun on purpose");
      return;
    case IBV_EVENT_QP_FATAL:
    case IBV_EVENT_QP_REQ_ERR:
    case IBV_EVENT_QP_ACCESS_ERR:
    case IBV_EVENT_QP_LAST_WQE_REACHED:
    case IBV_EVENT_SQ_DRAINED:
    case IBV_EVENT_PATH_MIG:
    case IBV_EVENT_PATH_MIG_ERR: {
      const ibv_qp *qp = ev.element.qp;
      if (overrun_.on_qp_event(qp, ev.event_type)) return;
      for (auto &r : responders_)
        if (r && r->on_qp_event(qp, ev.event_type)) return;
      for (auto &i : initiators_) {
        if (i->owns(qp)) return i->on_qp_event(ev.event_type);
      }
      env_.anomaly(Anomaly::kAsyncEvent, "%s on a QP this worker does not have (any more)",
                   event_name(ev.event_type));
      return;
    }
    default:
      env_.anomaly(Anomaly::kAsyncEvent, "%s", event_name(ev.event_type));
  }
}

// ---- chaos ------------------------------------------------------------------------------

void Worker::do_chaos() {
  ChaosEvent e = chaos_.poll();
  try {
    switch (e) {
      case ChaosEvent::kNone:
        return;
      case ChaosEvent::kRecreateQpClean:
      case ChaosEvent::kRecreateQpAbrupt: {
        auto &i = initiators_[env_.rng.below(initiators_.size())];
        i->recreate(e == ChaosEvent::kRecreateQpClean);
        return;
      }
      case ChaosEvent::kDestroyTargetQp:
      case ChaosEvent::kFailTargetQp:
        abort_random_responder(e == ChaosEvent::kDestroyTargetQp);
        return;
      case ChaosEvent::kReregisterWindow:
      case ChaosEvent::kReregisterReadMr:
        reregister(e == ChaosEvent::kReregisterWindow);
        return;
      case ChaosEvent::kCqOverrun:
        if (!overrun_.active()) overrun_.start();
        return;
    }
  } catch (const VerbsError &e) {
    env_.anomaly(Anomaly::kVerbsCall, "chaos: %s", e.what());
  }
}

// Only QPs with their own receive queue are destroyed under traffic: an SRQ
// WQE taken by a message whose completion is destroyed with the QP is gone
// without a completion (as on mlx5), and the SRQ would slowly run dry.
bool Worker::abort_random_responder(bool destroy) {
  int live[kMaxResponders], n = 0;
  for (int r = 0; r < max_responders_; ++r)
    if (responders_[r] && !(destroy && responders_[r]->uses_srq())) live[n++] = r;
  if (n == 0) return false;
  return responders_[live[env_.rng.below(n)]]->abort(destroy);
}

// The new version (with rkey 0: no key) goes into the directory before the
// MR is deregistered, so a peer whose WR fails for it can see why.
void Worker::reregister(bool window) {
  Counter &key = window ? env_.me.window_key : env_.me.read_key;
  Region &region = window ? window_ : read_;
  uint32_t version = key_version(get(key));
  key.store(pack_key(version + 1, 0), std::memory_order_release);
  env_.doing(Doing::kRegMr, window);
  region.reregister(node_->pd.get(), window ? kAllAccess : IBV_ACCESS_REMOTE_READ);
  key.store(pack_key(version + 2, region.mr->rkey), std::memory_order_release);
  bump(env_.cnt.mr_reregistrations);
  env_.trace("%s MR re-registered: rkey 0x%x (version %u)", window ? "window" : "READ",
             region.mr->rkey, version + 2);
}

// ---- the end of the run -------------------------------------------------------------------

void Worker::start_drain() {
  draining_ = true;
  drain_deadline_ns_ = now_ns() + 2ull * env_.opt.hang_ms * kMs;
  env_.me.accepting.store(0, std::memory_order_release);
  uint32_t ready = static_cast<uint32_t>(Life::kReady);
  env_.me.life.compare_exchange_strong(ready, static_cast<uint32_t>(Life::kDraining));
  for (auto &i : initiators_) i->stop();
  ud_->stop();
  env_.doing(Doing::kDraining);
}

// Done when our connections are closed, the ones to us have been checked,
// and the overrun scenario is over (or the drain took too long: a hang).
bool Worker::drained() {
  if (!draining_) return false;
  bool busy =
      overrun_.active() ||
      std::any_of(initiators_.begin(), initiators_.end(),
                  [](const auto &i) { return !i->stopped(); }) ||
      std::any_of(responders_.begin(), responders_.end(), [](const auto &r) { return !!r; });
  if (!busy) return true;
  if (now_ns() < drain_deadline_ns_) return false;
  publish_waiting();
  env_.hung("the drain did not finish in %d ms; waiting for: %s", 2 * env_.opt.hang_ms,
            env_.me.waiting);
  return true;
}

// The oldest wait of the worker, for the controller's hang report.
void Worker::publish_waiting() {
  char best[256] = "nothing", text[256];
  uint64_t since = UINT64_MAX;
  auto consider = [&](uint64_t t) {
    if (t && t < since) {
      since = t;
      std::memcpy(best, text, sizeof best);
    }
  };
  for (auto &i : initiators_) consider(i->oldest_wait_ns(text, sizeof text));
  for (auto &r : responders_)
    if (r) consider(r->oldest_wait_ns(text, sizeof text));
  char line[sizeof env_.me.waiting];
  if (since == UINT64_MAX) {
    std::snprintf(line, sizeof line, "nothing");
  } else {
    std::snprintf(line, sizeof line, "%s, for %.1f s", best, (now_ns() - since) / 1e9);
  }
  std::memcpy(env_.me.waiting, line, sizeof line);
}

}  // namespace

int run_worker(Directory &dir, const Options &opt, int slot, uint32_t gen) {
  int status;
  {
    Worker w(dir, opt, slot, gen);
    status = w.run();
  }
  return status;
}

}  // namespace stress
