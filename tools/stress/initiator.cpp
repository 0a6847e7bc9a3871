#include "initiator.hpp"

#include <arpa/inet.h>

#include <algorithm>
#include <cinttypes>
#include <cstring>

namespace stress {
namespace {

constexpr uint32_t kSendWr = 128;  // send queue depth
constexpr int kSignalEvery = 16;   // at most 15 unsignaled WRs in a row
constexpr int kPostsPerStep = 4;   // fairness between the connections of a worker
constexpr uint64_t kFlushQuietNs = 20 * kMs;
// A WR's completion status that has no completion of its own: an unsignaled
// WR behind one that failed (flushed with it).
constexpr int kImpliedFlush = -1;

size_t chunk_size(uint64_t max_size) {
  uint64_t size = std::max<uint64_t>(max_size + max_size / 2, 64 * 1024);
  return (size + 4095) & ~uint64_t{4095};
}

bool is_atomic(Op op) {
  return op == Op::kFetchAdd || op == Op::kCmpSwap;
}

}  // namespace

Initiator::Initiator(Env &env, int q)
    : env_(env),
      q_(q),
      rec_(env.me.conns[q]),
      staging_(env.node->pd.get(), chunk_size(env.opt.max_size), kChunks) {}

Initiator::~Initiator() {
  // The worker is exiting: whatever is outstanding is dropped with the QP.
  qp_.reset();
  cq_.reset();
}

// ---- connection lifecycle -----------------------------------------------------------------

bool Initiator::step() {
  uint64_t now = now_ns();
  switch (state_) {
    case State::kIdle:
      if (now < next_try_ns_) return false;
      if (stopping_ || env_.phase() != RunPhase::kRun) {
        state_ = State::kStopped;
        return true;
      }
      start_connect();
      return true;
    case State::kRequesting:
      poll_handshake();
      return false;
    case State::kActive: {
      bool did = poll();
      if (state_ == State::kActive && (stopping_ || close_requested_)) state_ = State::kClosing;
      if (state_ == State::kActive) did |= post_some();
      check_deadlines();
      return did;
    }
    case State::kClosing: {
      bool did = poll();
      if (state_ != State::kClosing) return did;
      if (outstanding_.empty()) {
        if (close_requested_ && !stopping_) bump(env_.cnt.qp_recreations_clean);
        teardown(true);
        return true;
      }
      // Everything must complete before the finals are final: the last WR
      // must be signaled for the unsignaled ones before it to complete. A
      // full send queue has signaled WRs to wait for (kSignalEvery) first.
      if (!outstanding_.back().signaled && outstanding_.size() < kSendWr) post_read(0, true);
      check_deadlines();
      return did;
    }
    case State::kFailed: {
      bool did = poll();
      bool signaled_left = std::any_of(outstanding_.begin(), outstanding_.end(),
                                       [](const WrRecord &r) { return r.signaled; });
      if (!signaled_left && now - last_activity_ns_ > kFlushQuietNs) {
        teardown(false);
        return true;
      }
      check_deadlines();
      return did;
    }
    case State::kStopped:
      return false;
  }
  return false;
}

bool Initiator::recreate(bool clean) {
  if (state_ != State::kActive) return false;
  if (clean) {
    close_requested_ = true;
  } else {
    bump(env_.cnt.qp_recreations_abrupt);
    env_.trace("q%d: destroying the QP to w%d with %zu WRs outstanding (epoch %u)", q_, target_,
               outstanding_.size(), epoch_);
    teardown(false);
  }
  return true;
}

void Initiator::start_connect() {
  int candidates[kMaxProcs], n = 0;
  for (int s = 0; s < env_.dir.procs; ++s) {
    WorkerSlot &w = env_.slot_of(s);
    if (static_cast<Life>(w.life.load(std::memory_order_acquire)) == Life::kReady &&
        w.accepting.load(std::memory_order_acquire))
      candidates[n++] = s;
  }
  if (n == 0) return backoff(20, 100);
  target_ = candidates[env_.rng.below(n)];
  target_gen_ = env_.slot_of(target_).generation.load(std::memory_order_acquire);
  epoch_ = Handshake::unpack(rec_.state.load(std::memory_order_acquire)).epoch + 1;
  try {
    env_.doing(Doing::kCreate, q_);
    cq_ = create_cq(env_.node->ctx.get(), 2 * kSendWr);
    ibv_qp_init_attr attr{};
    attr.send_cq = attr.recv_cq = cq_.get();
    attr.qp_type = IBV_QPT_RC;
    attr.cap = {kSendWr, 1, env_.send_sge, 1, 64};
    qp_ = create_qp(env_.node->pd.get(), &attr);
    max_inline_ = attr.cap.max_inline_data;
    rc_init(qp_.get(), 0);  // nobody reads or writes the initiator's memory
  } catch (const VerbsError &e) {
    env_.anomaly(Anomaly::kVerbsCall, "q%d: %s", q_, e.what());
    qp_.reset();
    cq_.reset();
    return backoff(50, 200);
  }
  psn_ = env_.rng.next32() & 0xffffff;
  rec_.init_gen = env_.gen;
  rec_.init_qpn = qp_->qp_num;
  rec_.init_psn = psn_;
  rec_.init_lid = env_.node->lid;
  rec_.target_gen = target_gen_;
  rec_.key = key_ = env_.rng.next();
  rec_.state.store(Handshake{epoch_, static_cast<uint8_t>(target_), 0, Phase::kRequested}.pack(),
                   std::memory_order_release);
  state_ = State::kRequesting;
  deadline_ns_ = now_ns() + static_cast<uint64_t>(env_.opt.hang_ms) * kMs;
}

void Initiator::poll_handshake() {
  Handshake h = Handshake::unpack(rec_.state.load(std::memory_order_acquire));
  if (h.epoch != epoch_) {
    env_.anomaly(Anomaly::kHandshake, "q%d: handshake word of epoch %u changed to epoch %u", q_,
                 epoch_, h.epoch);
    return teardown(false);
  }
  switch (h.phase) {
    case Phase::kAccepted:
      return on_accepted(h);
    case Phase::kRefused:  // the target has no room (or is draining): try another
      qp_.reset();
      cq_.reset();
      return backoff(5, 50);
    case Phase::kRequested:
    case Phase::kClaimed:
      if (target_gone()) return abandon_request(true);
      if (now_ns() > deadline_ns_) return abandon_request(false);
      return;
    default:
      env_.anomaly(Anomaly::kHandshake, "q%d: unexpected handshake phase %d", q_,
                   static_cast<int>(h.phase));
      return teardown(false);
  }
}

void Initiator::abandon_request(bool gone) {
  if (!gone) {
    env_.hung("q%d: w%d.g%u (alive) did not answer a connection request in %d ms", q_, target_,
              target_gen_, env_.opt.hang_ms);
  }
  // Whatever state the target left the word in, it is ours again: a target
  // still working on it finds its final compare-and-swap failing.
  rec_.state.store(Handshake{epoch_, static_cast<uint8_t>(target_), 0, Phase::kClosed}.pack(),
                   std::memory_order_release);
  qp_.reset();
  cq_.reset();
  backoff(10, 100);
}

void Initiator::on_accepted(const Handshake &h) {
  WorkerSlot &t = env_.slot_of(target_);
  const ResponderInfo &ri = t.responders[h.responder];
  if (ri.init_slot != static_cast<uint32_t>(env_.slot) || ri.init_q != static_cast<uint32_t>(q_) ||
      ri.epoch != epoch_) {
    env_.anomaly(Anomaly::kHandshake, "q%d: w%d accepted with responder %d of another connection",
                 q_, target_, h.responder);
    return teardown(false);
  }
  responder_ = h.responder;
  region_addr_ = ri.region_addr;
  atomic_addr_ = ri.atomic_addr;
  atomic_value_ = atomic_confirmed_ = ri.atomic_init;
  read_addr_ = t.read_addr;
  read_len_ = t.read_len;
  window_key_ = t.window_key.load(std::memory_order_acquire);
  read_key_ = t.read_key.load(std::memory_order_acquire);
  next_seq_ = acked_ = 0;
  unverified_.clear();
  failed_ = false;
  failure_reason_.reset();
  since_signal_ = 0;
  close_requested_ = false;
  last_write_ok_ = false;
  Finals &f = rec_.finals[epoch_ % kFinalsRing];
  f.clean.store(0, std::memory_order_relaxed);
  f.atomic_value.store(atomic_confirmed_, std::memory_order_relaxed);
  publish_acked();
  try {
    env_.doing(Doing::kModifyQp, q_);
    rc_connect(qp_.get(), RcPeer{static_cast<uint16_t>(t.lid), ri.qpn, ri.psn}, psn_);
  } catch (const VerbsError &e) {
    env_.anomaly(Anomaly::kVerbsCall, "q%d: %s", q_, e.what());
    return teardown(false);
  }
  state_ = State::kActive;
  last_activity_ns_ = now_ns();
  bump(env_.cnt.connections);
}

void Initiator::teardown(bool clean) {
  if (clean) rec_.finals[epoch_ % kFinalsRing].clean.store(epoch_ + 1, std::memory_order_release);
  env_.doing(Doing::kDestroy, q_);
  qp_.reset();
  cq_.reset();
  outstanding_.clear();
  unverified_.clear();
  staging_.reset();
  rec_.state.store(Handshake{epoch_, static_cast<uint8_t>(target_),
                             static_cast<uint8_t>(responder_), Phase::kClosed}
                       .pack(),
                   std::memory_order_release);
  close_requested_ = false;
  backoff(5, 50);
}

void Initiator::backoff(uint64_t min_ms, uint64_t max_ms) {
  state_ = stopping_ ? State::kStopped : State::kIdle;
  next_try_ns_ = now_ns() + (min_ms + env_.rng.below(max_ms - min_ms + 1)) * kMs;
}

void Initiator::publish_acked() {
  rec_.finals[epoch_ % kFinalsRing].acked.store((static_cast<uint64_t>(epoch_) << 32) | acked_,
                                                std::memory_order_release);
}

bool Initiator::target_gone() const {
  return generation_gone(env_.dir, target_, target_gen_);
}

// ---- posting ------------------------------------------------------------------------------

bool Initiator::post_some() {
  bool did = false;
  for (int i = 0; i < kPostsPerStep && state_ == State::kActive; ++i) {
    if (outstanding_.size() + 2 > kSendWr || !reserve_op()) break;
    uint64_t r = env_.rng.below(100);
    bool posted;
    if (r < 55) {
      posted = post_message() ||
               post_read(random_size(env_.rng, std::min(env_.opt.max_size, read_len_)), false);
    } else if (r < 75) {
      posted = post_read(random_size(env_.rng, std::min(env_.opt.max_size, read_len_)), false);
    } else {
      posted = post_atomic(r >= 88);
    }
    if (!posted) {
      env_.dir.ops_posted.fetch_sub(1, std::memory_order_relaxed);
      // Buffers are full of WRs that wait for a later signaled one.
      if (!outstanding_.empty() && !outstanding_.back().signaled) post_read(0, true);
      break;
    }
    did = true;
  }
  return did;
}

bool Initiator::reserve_op() {
  if (env_.opt.ops && env_.dir.ops_posted.load(std::memory_order_relaxed) >= env_.opt.ops)
    return false;
  env_.dir.ops_posted.fetch_add(1, std::memory_order_relaxed);
  return true;
}

bool Initiator::refresh_key(RemoteMr mr) {
  uint64_t &key = mr == RemoteMr::kWindow ? window_key_ : read_key_;
  if (key_rkey(key) != 0) return true;  // keep using it, stale or not: that is the point
  WorkerSlot &t = env_.slot_of(target_);
  key = (mr == RemoteMr::kWindow ? t.window_key : t.read_key).load(std::memory_order_acquire);
  return key_rkey(key) != 0;
}

int Initiator::send_flags(bool force_signal, uint64_t inline_len) {
  bool signaled = force_signal || since_signal_ >= kSignalEvery - 1 || env_.rng.chance(25);
  since_signal_ = signaled ? 0 : since_signal_ + 1;
  int flags = signaled ? IBV_SEND_SIGNALED : 0;
  if (inline_len > 0 && inline_len <= max_inline_ && env_.rng.chance(50)) flags |= IBV_SEND_INLINE;
  return flags;
}

bool Initiator::overlaps_unverified(uint64_t offset, uint64_t length) {
  uint64_t verified =
      env_.slot_of(target_).responders[responder_].verified.load(std::memory_order_acquire);
  while (!unverified_.empty() && unverified_.front().seq < verified) unverified_.pop_front();
  return std::any_of(unverified_.begin(), unverified_.end(), [&](const PendingWrite &w) {
    return offset < w.offset + w.length && w.offset < offset + length;
  });
}

void Initiator::inject_corruption(const Layout &l) {
  if (!(env_.opt.inject & kInjectCorrupt) || l.length == 0 || !env_.rng.chance(1)) return;
  *staging_.byte_at(l, env_.rng.below(l.length)) ^= 0x20;
}

// A WRITE is followed by a SEND (the manifest) that tells the target to check
// the written bytes: RC delivers in order, so they have landed when it arrives.
bool Initiator::post_message() {
  if ((env_.opt.inject & kInjectLose) && env_.rng.below(500) == 0) ++next_seq_;  // never sent
  MessageDesc d = describe(key_, next_seq_, env_.opt.max_size, env_.region_len);
  bool write = d.kind == MsgKind::kWrite || d.kind == MsgKind::kWriteImm;
  if (write && (!refresh_key(RemoteMr::kWindow) || overlaps_unverified(d.offset, d.length)))
    return false;

  auto mark = staging_.mark();
  WrRecord recs[2]{};
  ibv_sge sges[2][kMaxPieces];
  ibv_send_wr wrs[2]{};
  int n = d.kind == MsgKind::kWrite ? 2 : 1;
  if (!staging_.take(env_.rng, d.length, env_.send_sge, 1, &recs[0].layout) ||
      (n == 2 && !staging_.take(env_.rng, d.manifest_len, env_.send_sge, 1, &recs[1].layout))) {
    staging_.restore(std::move(mark));
    return false;
  }
  staging_.fill(recs[0].layout, d.seed);
  inject_corruption(recs[0].layout);

  static constexpr Op kOps[] = {Op::kSend, Op::kSendImm, Op::kWrite, Op::kWriteImm};
  static constexpr ibv_wr_opcode kOpcodes[] = {IBV_WR_SEND, IBV_WR_SEND_WITH_IMM, IBV_WR_RDMA_WRITE,
                                               IBV_WR_RDMA_WRITE_WITH_IMM};
  int k = static_cast<int>(d.kind);
  WrRecord &main = recs[0];
  main.op = kOps[k];
  main.bytes = d.length;
  main.message = d.kind != MsgKind::kWrite;
  main.seq = next_seq_;
  ibv_send_wr &wr = wrs[0];
  wr.opcode = kOpcodes[k];
  wr.num_sge = staging_.sges(main.layout, sges[0]);
  wr.sg_list = sges[0];
  wr.send_flags = send_flags(false, d.length);
  if (d.kind == MsgKind::kSendImm || d.kind == MsgKind::kWriteImm) wr.imm_data = htonl(d.imm);
  if (write) {
    main.mr = RemoteMr::kWindow;
    main.key_version = key_version(window_key_);
    wr.wr.rdma.remote_addr = region_addr_ + d.offset;
    wr.wr.rdma.rkey = key_rkey(window_key_);
  }
  if (n == 2) {
    WrRecord &m = recs[1];
    m.op = Op::kWrite;
    m.manifest = m.message = true;
    m.seq = next_seq_;
    staging_.fill(m.layout, d.manifest_seed);
    wrs[1].opcode = IBV_WR_SEND;
    wrs[1].num_sge = staging_.sges(m.layout, sges[1]);
    wrs[1].sg_list = sges[1];
    wrs[1].send_flags = send_flags(false, d.manifest_len);
    wrs[0].next = &wrs[1];
  }
  std::vector<WrRecord> list(recs, recs + n);
  for (int i = 0; i < n; ++i) list[i].signaled = wrs[i].send_flags & IBV_SEND_SIGNALED;
  if (!post_chain(wrs, list)) return true;  // the connection failed; nothing more to do here
  if (write && d.length > 0) unverified_.push_back({next_seq_, d.offset, d.length});
  ++next_seq_;
  return true;
}

bool Initiator::post_read(uint64_t len, bool force_signal) {
  if (len > 0 && !refresh_key(RemoteMr::kRead)) return false;
  len = std::min(len, read_len_);
  std::vector<WrRecord> list(1);
  WrRecord &rec = list[0];
  if (!staging_.take(env_.rng, len, std::min<uint32_t>(env_.send_sge, env_.node->dev.max_sge_rd), 1,
                     &rec.layout))
    return false;
  rec.op = Op::kRead;
  rec.bytes = len;
  rec.read_offset = env_.rng.below(read_len_ - len + 1);
  rec.mr = len ? RemoteMr::kRead : RemoteMr::kNone;  // a 0-byte READ names no memory
  rec.key_version = key_version(read_key_);
  // Poison the destination so that a READ that writes nothing cannot pass.
  uint64_t seed = read_region_seed(target_, target_gen_), logical = rec.read_offset;
  for (int j = 0; j < rec.layout.n; logical += rec.layout.pieces[j++].len)
    *staging_.at(rec.layout.pieces[j]) = ~pattern_byte(seed, logical);

  ibv_sge sges[kMaxPieces];
  ibv_send_wr wr{};
  wr.opcode = IBV_WR_RDMA_READ;
  wr.num_sge = staging_.sges(rec.layout, sges);
  wr.sg_list = sges;
  wr.send_flags = send_flags(force_signal, 0);
  wr.wr.rdma.remote_addr = read_addr_ + rec.read_offset;
  wr.wr.rdma.rkey = key_rkey(read_key_);
  rec.signaled = wr.send_flags & IBV_SEND_SIGNALED;
  post_chain(&wr, list);
  return true;
}

bool Initiator::post_atomic(bool cmp_swap) {
  if (!refresh_key(RemoteMr::kWindow)) return false;
  std::vector<WrRecord> list(1);
  WrRecord &rec = list[0];
  if (!staging_.take(env_.rng, 8, 1, 8, &rec.layout)) return false;
  ibv_send_wr wr{};
  rec.op = cmp_swap ? Op::kCmpSwap : Op::kFetchAdd;
  rec.bytes = 8;
  rec.mr = RemoteMr::kWindow;
  rec.key_version = key_version(window_key_);
  rec.expect_old = atomic_value_;
  if (cmp_swap) {
    // Mostly a compare that matches; sometimes one that must not swap.
    uint64_t compare =
        env_.rng.chance(75) ? atomic_value_ : atomic_value_ + 1 + env_.rng.below(1000);
    uint64_t swap = env_.rng.next();
    wr.opcode = IBV_WR_ATOMIC_CMP_AND_SWP;
    wr.wr.atomic.compare_add = compare;
    wr.wr.atomic.swap = swap;
    rec.value_after = compare == atomic_value_ ? swap : atomic_value_;
  } else {
    uint64_t add = env_.rng.next();
    wr.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
    wr.wr.atomic.compare_add = add;
    rec.value_after = atomic_value_ + add;
  }
  atomic_value_ = rec.value_after;
  uint64_t poison = ~rec.expect_old;
  std::memcpy(staging_.at(rec.layout.pieces[0]), &poison, 8);
  ibv_sge sge;
  wr.num_sge = staging_.sges(rec.layout, &sge);
  wr.sg_list = &sge;
  wr.send_flags = send_flags(false, 0);
  wr.wr.atomic.remote_addr = atomic_addr_;
  wr.wr.atomic.rkey = key_rkey(window_key_);
  rec.signaled = wr.send_flags & IBV_SEND_SIGNALED;
  post_chain(&wr, list);
  return true;
}

bool Initiator::post_chain(ibv_send_wr *first, std::vector<WrRecord> &records) {
  uint64_t now = now_ns();
  // Reaped (not just marked for death): no WR posted from now on may succeed.
  const WorkerSlot &t = env_.slot_of(target_);
  bool dead = t.generation.load(std::memory_order_acquire) != target_gen_ ||
              static_cast<Life>(t.life.load(std::memory_order_acquire)) == Life::kDead;
  size_t i = 0;
  for (ibv_send_wr *wr = first; wr; wr = wr->next, ++i) {
    records[i].id = wr->wr_id = next_wr_id_++;
    records[i].posted_ns = now;
    records[i].target_dead = dead;
  }
  ibv_send_wr *bad = nullptr;
  env_.doing(Doing::kPostSend, q_);
  int rc = ibv_post_send(qp_.get(), first, &bad);
  if (rc != 0) {
    env_.anomaly(Anomaly::kVerbsCall, "q%d: ibv_post_send to w%d: %s (%zu outstanding)", q_,
                 target_, std::strerror(rc), outstanding_.size());
    teardown(false);
    return false;
  }
  for (auto &r : records) outstanding_.push_back(std::move(r));
  return true;
}

// ---- completions ---------------------------------------------------------------------------

bool Initiator::poll() {
  ibv_wc wcs[32];
  env_.doing(Doing::kPollCq, q_);
  int n = ibv_poll_cq(cq_.get(), 32, wcs);
  if (n < 0) {
    env_.anomaly(Anomaly::kVerbsCall, "q%d: ibv_poll_cq returned %d", q_, n);
    teardown(false);
    return false;
  }
  for (int i = 0; i < n && qp_; ++i) on_completion(wcs[i]);
  return n > 0;
}

void Initiator::on_completion(const ibv_wc &wc) {
  if (outstanding_.empty() || wc.wr_id < outstanding_.front().id ||
      wc.wr_id > outstanding_.back().id) {
    env_.anomaly(Anomaly::kUnknownCompletion,
                 "q%d: completion of WR #%" PRIu64 " (%s), not outstanding", q_, wc.wr_id,
                 status_name(wc.status).c_str());
    return;
  }
  last_activity_ns_ = now_ns();
  // Earlier unsignaled WRs are complete too: successfully before a failure,
  // flushed after one.
  while (outstanding_.front().id < wc.wr_id) {
    retire(outstanding_.front(),
           failed_ ? static_cast<ibv_wc_status>(kImpliedFlush) : IBV_WC_SUCCESS);
    outstanding_.pop_front();
  }
  retire(outstanding_.front(), wc.status);
  outstanding_.pop_front();
}

void Initiator::retire(WrRecord &rec, ibv_wc_status status) {
  if (status == IBV_WC_SUCCESS) {
    if (failed_) {
      env_.anomaly(Anomaly::kSuccessAfterError,
                   "q%d: WR #%" PRIu64
                   " (%s) to w%d succeeded after "
                   "an earlier WR failed",
                   q_, rec.id, op_name(rec.op), target_);
    }
    if (rec.target_dead) {
      env_.anomaly(Anomaly::kSuccessToDead,
                   "q%d: WR #%" PRIu64 " (%s of %" PRIu64
                   " B) succeeded, but was posted after "
                   "w%d.g%u had been reaped",
                   q_, rec.id, op_name(rec.op), rec.bytes, target_, target_gen_);
    }
    on_success(rec);
  } else if (static_cast<int>(status) != kImpliedFlush) {
    if (!rec.manifest) bump(env_.cnt.op_errors[static_cast<int>(rec.op)]);
    if (rec.manifest && last_write_ok_) bump(env_.cnt.unverified_write_bytes, last_write_bytes_);
    if (!failed_) {
      on_first_error(rec, status);
    } else if (status == IBV_WC_WR_FLUSH_ERR) {
      if (failure_reason_) bump(env_.cnt.flushed[static_cast<int>(*failure_reason_)]);
    } else {
      env_.anomaly(Anomaly::kSecondError,
                   "q%d: %s on WR #%" PRIu64
                   " (%s) after the QP had failed "
                   "(expected IBV_WC_WR_FLUSH_ERR)",
                   q_, status_name(status).c_str(), rec.id, op_name(rec.op));
    }
  }
  if (rec.op == Op::kWrite && !rec.manifest) {
    last_write_ok_ = status == IBV_WC_SUCCESS;
    last_write_bytes_ = rec.bytes;
  }
  staging_.give(rec.layout);
}

void Initiator::on_success(WrRecord &rec) {
  if (!rec.manifest) {
    bump(env_.cnt.ops[static_cast<int>(rec.op)]);
    bump(env_.cnt.bytes, rec.bytes);
  }
  if (rec.op == Op::kRead) check_read(rec);
  if (is_atomic(rec.op)) check_atomic(rec);
  if (rec.message) {
    acked_ = rec.seq + 1;
    publish_acked();
  }
}

void Initiator::check_read(WrRecord &rec) {
  if (rec.bytes == 0) return;
  uint64_t seed = read_region_seed(target_, target_gen_);
  if ((env_.opt.inject & kInjectRead) && env_.rng.chance(1))
    *staging_.byte_at(rec.layout, env_.rng.below(rec.bytes)) ^= 0x01;
  size_t bad = staging_.mismatch(rec.layout, seed, rec.read_offset);
  if (bad != kNoMismatch) {
    env_.corrupted("READ of %" PRIu64 " B at offset %" PRIu64
                   " of w%d.g%u's READ MR (q%d, WR #%" PRIu64
                   ", %d SGEs): byte %zu is 0x%02x, expected 0x%02x",
                   rec.bytes, rec.read_offset, target_, target_gen_, q_, rec.id, rec.layout.n, bad,
                   *staging_.byte_at(rec.layout, bad), pattern_byte(seed, rec.read_offset + bad));
  }
  bump(env_.cnt.verified_bytes, rec.bytes);
}

void Initiator::check_atomic(WrRecord &rec) {
  uint64_t old;
  std::memcpy(&old, staging_.at(rec.layout.pieces[0]), 8);
  uint64_t expect = rec.expect_old;
  if ((env_.opt.inject & kInjectAtomic) && env_.rng.chance(2)) expect ^= 1;
  if (old != expect) {
    env_.corrupted("%s on w%d.g%u's word (q%d, epoch %u, WR #%" PRIu64 ") returned 0x%016" PRIx64
                   ", expected 0x%016" PRIx64,
                   op_name(rec.op), target_, target_gen_, q_, epoch_, rec.id, old, expect);
  }
  atomic_confirmed_ = rec.value_after;
  rec_.finals[epoch_ % kFinalsRing].atomic_value.store(atomic_confirmed_,
                                                       std::memory_order_release);
  bump(env_.cnt.verified_bytes, 8);
}

void Initiator::on_first_error(const WrRecord &rec, ibv_wc_status status) {
  failed_ = true;
  failed_ns_ = now_ns();
  state_ = State::kFailed;
  failure_reason_ = cause_of(rec, status);
  ibv_qp_state qs = qp_state(qp_.get());
  if (qs != IBV_QPS_ERR) {
    env_.anomaly(Anomaly::kNotInError, "q%d: QP in state %d after %s on WR #%" PRIu64, q_, qs,
                 status_name(status).c_str(), rec.id);
  }
  if (failure_reason_) {
    bump(env_.cnt.expected[static_cast<int>(*failure_reason_)]);
    env_.trace("q%d: %s on %s to w%d (%s)", q_, status_name(status).c_str(), op_name(rec.op),
               target_, reason_name(*failure_reason_));
    return;
  }
  const WorkerSlot &t = env_.slot_of(target_);
  env_.unexpected_status(
      status,
      "q%d: %s on WR #%" PRIu64 " %s%s of %" PRIu64
      " B to w%d.g%u (epoch %u, responder %d), %.1f ms after it was posted; "
      "target now g%u life %u, window key v%u/v%u, read key v%u/v%u, responder aborted %" PRIu64,
      q_, status_name(status).c_str(), rec.id, op_name(rec.op), rec.manifest ? " manifest" : "",
      rec.bytes, target_, target_gen_, epoch_, responder_,
      static_cast<double>(now_ns() - rec.posted_ns) / 1e6, t.generation.load(), t.life.load(),
      key_version(window_key_), key_version(t.window_key.load()), key_version(read_key_),
      key_version(t.read_key.load()), get(t.responders[responder_].aborted));
}

// The cause the directory shows for a first error, if the status is the one
// an HCA reports for that cause.
std::optional<Reason> Initiator::cause_of(const WrRecord &rec, ibv_wc_status status) const {
  const WorkerSlot &t = env_.slot_of(target_);
  if (status == IBV_WC_RETRY_EXC_ERR) {
    if (target_gone()) return Reason::kPeerKilled;
    const ResponderInfo &ri = t.responders[responder_];
    if (ri.aborted.load(std::memory_order_acquire) == epoch_ + 1ull &&
        ri.init_slot == static_cast<uint32_t>(env_.slot) && ri.init_q == static_cast<uint32_t>(q_))
      return Reason::kPeerQpGone;
  }
  if (status == IBV_WC_REM_ACCESS_ERR && rec.mr != RemoteMr::kNone) {
    uint64_t now =
        (rec.mr == RemoteMr::kWindow ? t.window_key : t.read_key).load(std::memory_order_acquire);
    if (key_version(now) != rec.key_version) return Reason::kMrReregistered;
  }
  return std::nullopt;
}

void Initiator::check_deadlines() {
  if (outstanding_.empty() || !qp_) return;
  uint64_t now = now_ns();
  uint64_t limit = static_cast<uint64_t>(env_.opt.hang_ms) * kMs;
  const WrRecord &oldest = outstanding_.front();
  // Twice the worker limit: a target that stopped is found (and killed) by
  // the controller first, and counted once, there.
  if (now - oldest.posted_ns > 2 * limit) {
    env_.hung("q%d: WR #%" PRIu64 " %s of %" PRIu64
              " B to w%d.g%u (epoch %u, %s) not complete "
              "after %d ms; %zu WRs outstanding; target life %u heartbeat %.1f s ago",
              q_, oldest.id, op_name(oldest.op), oldest.bytes, target_, target_gen_, epoch_,
              failed_ ? "after an error" : "no error", 2 * env_.opt.hang_ms, outstanding_.size(),
              env_.slot_of(target_).life.load(),
              (now - get(env_.slot_of(target_).heartbeat_ns)) / 1e9);
    teardown(false);
  }
}

void Initiator::on_qp_event(ibv_event_type type) {
  env_.anomaly(Anomaly::kAsyncEvent, "%s on the QP of q%d (to w%d, epoch %u)", event_name(type), q_,
               target_, epoch_);
}

uint64_t Initiator::oldest_wait_ns(char *text, size_t n) const {
  if (state_ == State::kRequesting) {
    std::snprintf(text, n, "q%d: connection request to w%d.g%u (epoch %u)", q_, target_,
                  target_gen_, epoch_);
    return deadline_ns_ - static_cast<uint64_t>(env_.opt.hang_ms) * kMs;
  }
  if (outstanding_.empty()) return 0;
  const WrRecord &w = outstanding_.front();
  std::snprintf(text, n,
                "q%d: WR #%" PRIu64 " %s of %" PRIu64 " B to w%d.g%u (epoch %u, %zu outstanding%s)",
                q_, w.id, op_name(w.op), w.bytes, target_, target_gen_, epoch_, outstanding_.size(),
                failed_ ? ", failed" : "");
  return w.posted_ns;
}

}  // namespace stress
