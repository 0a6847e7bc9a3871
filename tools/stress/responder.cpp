#include "responder.hpp"

#include <arpa/inet.h>

#include <algorithm>
#include <cinttypes>
#include <cstdarg>
#include <cstdio>
#include <cstring>

namespace stress {
namespace {

constexpr int kPlainReceives = 4;                // receives on a QP's own queue
constexpr uint64_t kTailGraceNs = 1000 * kMs;    // for the last completions to show up
constexpr uint64_t kLastWqeWaitNs = 1000 * kMs;  // for IBV_EVENT_QP_LAST_WQE_REACHED
constexpr int kLookaround = 32;                  // how far a gap or a repeat is searched

std::string format(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
std::string format(const char *fmt, ...) {
  char buf[256];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return buf;
}

}  // namespace

// ---- receive buffers ---------------------------------------------------------------------

RecvPool::RecvPool(ibv_pd *pd, int slots, uint64_t max_size, uint32_t max_sge)
    : max_(max_size),
      b_stride_(max_size / 2 + 64),
      max_sge_(std::max<uint32_t>(1, std::min<uint64_t>(max_sge, max_size))),
      a_(pd, slots * max_size, IBV_ACCESS_LOCAL_WRITE),
      b_(pd, slots * b_stride_, IBV_ACCESS_LOCAL_WRITE),
      sges_(slots, 1) {
  for (int s = slots - 1; s >= 0; --s) free_.push_back(s);
}

std::optional<int> RecvPool::take() {
  if (free_.empty()) return std::nullopt;
  int s = free_.back();
  free_.pop_back();
  return s;
}

// Piece j of a slot posted as n SGEs is max/n bytes (the last one takes the
// rest), in MR a for even j and MR b for odd j, one after the other.
int RecvPool::pieces(int slot, Span *out) const {
  int n = sges_[slot];
  uint64_t base = max_ / n, a_off = slot * max_, b_off = slot * b_stride_;
  for (int j = 0; j < n; ++j) {
    uint64_t len = j + 1 == n ? max_ - base * (n - 1) : base;
    if (j % 2 == 0) {
      out[j] = {a_.at(a_off), len};
      a_off += len;
    } else {
      out[j] = {b_.at(b_off), len};
      b_off += len;
    }
  }
  return n;
}

int RecvPool::post(Rng &rng, int slot, ibv_qp *qp, ibv_srq *srq) {
  sges_[slot] = static_cast<uint8_t>(rng.chance(50) ? 1 : 1 + rng.below(max_sge_));
  Span spans[16];
  int n = pieces(slot, spans);
  ibv_sge sge[16];
  for (int j = 0; j < n; ++j) {
    const Region &r = j % 2 == 0 ? a_ : b_;
    sge[j] = {reinterpret_cast<uintptr_t>(spans[j].ptr), static_cast<uint32_t>(spans[j].len),
              r.mr->lkey};
  }
  ibv_recv_wr wr{};
  wr.wr_id = static_cast<uint64_t>(slot);
  wr.sg_list = sge;
  wr.num_sge = n;
  ibv_recv_wr *bad = nullptr;
  return srq ? ibv_post_srq_recv(srq, &wr, &bad) : ibv_post_recv(qp, &wr, &bad);
}

void RecvPool::retry_deferred(Rng &rng, ibv_srq *srq) {
  while (!deferred_srq_.empty() && post(rng, deferred_srq_.back(), nullptr, srq) == 0)
    deferred_srq_.pop_back();
}

size_t RecvPool::mismatch(int slot, uint64_t len, uint64_t seed) const {
  Span spans[16];
  int n = pieces(slot, spans);
  uint64_t off = 0;
  for (int j = 0; j < n && off < len; ++j) {
    uint64_t take = std::min(spans[j].len, len - off);
    size_t bad = find_mismatch(spans[j].ptr, take, seed, off);
    if (bad != kNoMismatch) return off + bad;
    off += take;
  }
  return kNoMismatch;
}

uint8_t RecvPool::byte(int slot, uint64_t logical) const {
  Span spans[16];
  int n = pieces(slot, spans);
  for (int j = 0; j < n; ++j) {
    if (logical < spans[j].len) return spans[j].ptr[logical];
    logical -= spans[j].len;
  }
  return 0;
}

// ---- the responder -----------------------------------------------------------------------

Responder::Responder(Env &env, RecvPool &pool, ibv_srq *srq, int index, int init_slot, int init_q,
                     uint32_t epoch, uint8_t *region, uint64_t *atomic_word)
    : env_(env),
      pool_(pool),
      srq_(srq),
      index_(index),
      init_slot_(init_slot),
      init_q_(init_q),
      epoch_(epoch),
      region_(region),
      atomic_word_(atomic_word),
      info_(env.me.responders[index]),
      conn_(env.dir.slots[init_slot].conns[init_q]),
      created_ns_(now_ns()) {
  init_gen_ = conn_.init_gen;
  key_ = conn_.key;
  env_.doing(Doing::kCreate, 1000 + index);
  cq_ = create_cq(env_.node->ctx.get(), 2 * kPlainReceives + 16);
  ibv_qp_init_attr attr{};
  attr.send_cq = attr.recv_cq = cq_.get();
  attr.srq = srq;
  attr.qp_type = IBV_QPT_RC;
  attr.cap = {1, srq ? 0u : static_cast<uint32_t>(kPlainReceives), 1, env_.recv_sge, 0};
  qp_ = create_qp(env_.node->pd.get(), &attr);
  rc_init(qp_.get(), kRemoteAccess);
  if (!srq_) post_receives();
  env_.doing(Doing::kModifyQp, 1000 + index);
  uint32_t psn = env_.rng.next32() & 0xffffff;
  rc_connect(qp_.get(), RcPeer{conn_.init_lid, conn_.init_qpn, conn_.init_psn}, psn);

  // Published for the initiator (before the handshake word says kAccepted).
  uint64_t atomic_init = env_.rng.next();
  __atomic_store_n(atomic_word_, atomic_init, __ATOMIC_RELAXED);
  info_.init_slot = init_slot;
  info_.init_q = init_q;
  info_.epoch = epoch;
  info_.qpn = qp_->qp_num;
  info_.psn = psn;
  info_.region_addr = reinterpret_cast<uintptr_t>(region);
  info_.region_len = env_.region_len;
  info_.atomic_addr = reinterpret_cast<uintptr_t>(atomic_word);
  info_.atomic_init = atomic_init;
  info_.srq = srq != nullptr;
  info_.verified.store(0, std::memory_order_relaxed);
  info_.aborted.store(0, std::memory_order_release);
}

Responder::~Responder() {
  qp_.reset();
  cq_.reset();
  for (int s : posted_) pool_.give(s);
}

void Responder::post_receives() {
  while (posted_.size() < kPlainReceives) {
    auto slot = pool_.take();
    if (!slot) return;  // the pool is sized for every responder; never expected
    env_.doing(Doing::kPostRecv, 1000 + index_);
    if (int rc = pool_.post(env_.rng, *slot, qp_.get(), nullptr)) {
      pool_.give(*slot);
      env_.anomaly(Anomaly::kVerbsCall, "responder %d: ibv_post_recv: %s", index_,
                   std::strerror(rc));
      return;
    }
    posted_.push_back(*slot);
  }
}

bool Responder::step() {
  bool did = qp_ ? poll() : false;
  switch (state_) {
    case State::kActive:
    case State::kBroken:
      if (initiator_moved_on()) {
        state_ = State::kFinishing;
        deadline_ns_ = now_ns() + kTailGraceNs;
      }
      return did;
    case State::kFinishing:
      if (tail_arrived() || now_ns() > deadline_ns_) {
        check_end();
        release();
        return true;
      }
      return did;
    case State::kReleasing:
      if (last_wqe_ || now_ns() > deadline_ns_) {
        if (!last_wqe_) no_last_wqe();
        poll();  // what the QP's failure flushed
        destroy();
        return true;
      }
      return did;
    case State::kDone:
      return did;
  }
  return did;
}

bool Responder::initiator_moved_on() const {
  Handshake h = Handshake::unpack(conn_.state.load(std::memory_order_acquire));
  bool same = h.epoch == epoch_ && h.phase == Phase::kAccepted &&
              h.target == static_cast<uint8_t>(env_.slot) && h.responder == index_;
  return !same || generation_gone(env_.dir, init_slot_, init_gen_);
}

// The completions of messages the initiator saw succeed are here (or the
// initiator's count is gone, or our QP is).
bool Responder::tail_arrived() const {
  uint64_t acked = conn_.finals[epoch_ % kFinalsRing].acked.load(std::memory_order_acquire);
  return (acked >> 32) != epoch_ || next_seq_ >= static_cast<uint32_t>(acked) || !qp_;
}

// Nothing acknowledged is missing; after a clean close, the atomic word holds
// what the initiator's atomics left there.
void Responder::check_end() {
  const Finals &f = conn_.finals[epoch_ % kFinalsRing];
  bool clean = f.clean.load(std::memory_order_acquire) == epoch_ + 1ull;
  uint64_t acked = f.acked.load(std::memory_order_acquire);
  uint64_t told = (acked >> 32) == epoch_ ? static_cast<uint32_t>(acked) : 0;
  if (told > next_seq_) {
    if (destroyed_) {
      // Acknowledged, then destroyed with our QP before we polled them (on purpose).
      bump(env_.cnt.discarded, told - next_seq_);
    } else {
      env_.lost(told - next_seq_,
                "responder %d (from w%d.g%u q%d, epoch %u): the initiator saw %" PRIu64
                " messages succeed, %" PRIu64 " arrived",
                index_, init_slot_, init_gen_, init_q_, epoch_, told, next_seq_);
    }
  }
  if (clean) {
    uint64_t value = __atomic_load_n(atomic_word_, __ATOMIC_ACQUIRE);
    uint64_t expect = f.atomic_value.load(std::memory_order_acquire);
    if (value != expect) {
      env_.corrupted("responder %d (from w%d.g%u q%d, epoch %u): atomic word holds 0x%016" PRIx64
                     ", the initiator's atomics left 0x%016" PRIx64,
                     index_, init_slot_, init_gen_, init_q_, epoch_, value, expect);
    }
    bump(env_.cnt.verified_bytes, 8);
  }
}

// A QP on an SRQ is taken down as the spec asks: to ERR, then (after
// IBV_EVENT_QP_LAST_WQE_REACHED) its last completions are polled, then it is
// destroyed, so that no SRQ WQE is lost with it.
void Responder::release() {
  if (!srq_ || !qp_) return destroy();
  if (!failed_on_purpose_) {
    env_.doing(Doing::kModifyQp, 1000 + index_);
    if (int rc = to_error(qp_.get())) {
      env_.anomaly(Anomaly::kVerbsCall, "responder %d: ibv_modify_qp(ERR): %s", index_,
                   std::strerror(rc));
      return destroy();
    }
    failed_on_purpose_ = true;
    errored_ns_ = now_ns();
  }
  deadline_ns_ = errored_ns_ + kLastWqeWaitNs;
  state_ = State::kReleasing;
}

void Responder::no_last_wqe() {
  env_.anomaly(Anomaly::kNoLastWqe,
               "responder %d (from w%d q%d, epoch %u): QP on the SRQ in ERR for %.1f s, no "
               "IBV_EVENT_QP_LAST_WQE_REACHED",
               index_, init_slot_, init_q_, epoch_, kLastWqeWaitNs / 1e9);
  last_wqe_ = true;  // reported once
}

void Responder::destroy() {
  env_.doing(Doing::kDestroy, 1000 + index_);
  qp_.reset();
  cq_.reset();
  for (int s : posted_) pool_.give(s);
  posted_.clear();
  state_ = State::kDone;
}

bool Responder::abort(bool destroy) {
  if (state_ != State::kActive || !qp_) return false;
  // The cause goes into the directory before the initiator can see its effect.
  info_.aborted.store(epoch_ + 1ull, std::memory_order_release);
  if (destroy) {
    poll();  // what arrived before is checked; what arrives now is discarded with the QP
    env_.doing(Doing::kDestroy, 1000 + index_);
    qp_.reset();
    for (int s : posted_) pool_.give(s);
    posted_.clear();
    destroyed_ = true;
    state_ = State::kBroken;
    bump(env_.cnt.target_qp_destroyed);
  } else {
    env_.doing(Doing::kModifyQp, 1000 + index_);
    if (int rc = to_error(qp_.get())) {
      env_.anomaly(Anomaly::kVerbsCall, "responder %d: ibv_modify_qp(ERR): %s", index_,
                   std::strerror(rc));
      return false;
    }
    failed_on_purpose_ = true;
    errored_ns_ = now_ns();
    state_ = State::kBroken;
    bump(env_.cnt.target_qp_errored);
  }
  env_.trace("responder %d (from w%d q%d): %s", index_, init_slot_, init_q_,
             destroy ? "QP destroyed" : "QP moved to ERR");
  return true;
}

bool Responder::poll() {
  if (!cq_) return false;
  ibv_wc wcs[16];
  env_.doing(Doing::kPollCq, 1000 + index_);
  int n = ibv_poll_cq(cq_.get(), 16, wcs);
  if (n < 0) {
    env_.anomaly(Anomaly::kVerbsCall, "responder %d: ibv_poll_cq returned %d", index_, n);
    return false;
  }
  for (int i = 0; i < n; ++i) on_receive(wcs[i]);
  return n > 0;
}

void Responder::on_receive(const ibv_wc &wc) {
  int slot = static_cast<int>(wc.wr_id);
  if (!srq_) posted_.erase(std::remove(posted_.begin(), posted_.end(), slot), posted_.end());
  if (wc.status == IBV_WC_SUCCESS) {
    check_message(wc, slot);
  } else {
    on_error(wc);
  }
  // The buffer goes back where it came from (the SRQ outlives this QP).
  if (srq_) {
    env_.doing(Doing::kPostRecv, 1000 + index_);
    if (int rc = pool_.post(env_.rng, slot, nullptr, srq_)) {
      env_.anomaly(Anomaly::kRepostRefused,
                   "responder %d: ibv_post_srq_recv after polling a receive completion: %s "
                   "(fewer than max_wr WQEs are outstanding)",
                   index_, std::strerror(rc));
      pool_.defer_srq(slot);
    }
  } else {
    pool_.give(slot);
    if (state_ == State::kActive) post_receives();
  }
}

void Responder::on_error(const ibv_wc &wc) {
  if (wc.status == IBV_WC_WR_FLUSH_ERR && failed_on_purpose_) {
    bump(env_.cnt.flushed[static_cast<int>(Reason::kOwnQpFailed)]);
  } else if (!(wc.status == IBV_WC_WR_FLUSH_ERR && state_ == State::kBroken)) {
    env_.unexpected_status(wc.status,
                           "responder %d (from w%d.g%u q%d, epoch %u): receive completed with %s "
                           "(opcode %d, %" PRIu64 " messages so far)",
                           index_, init_slot_, init_gen_, init_q_, epoch_,
                           status_name(wc.status).c_str(), wc.opcode, next_seq_);
  }
  if (state_ == State::kActive) state_ = State::kBroken;
}

// What in the completion itself differs from message `d` (empty: nothing).
std::string Responder::header_differs(const ibv_wc &wc, const MessageDesc &d) const {
  bool imm = d.kind == MsgKind::kSendImm || d.kind == MsgKind::kWriteImm;
  ibv_wc_opcode opcode = d.kind == MsgKind::kWriteImm ? IBV_WC_RECV_RDMA_WITH_IMM : IBV_WC_RECV;
  uint64_t len = d.kind == MsgKind::kWrite ? d.manifest_len : d.length;  // what byte_len says
  if (wc.opcode != opcode) return format("opcode %d, expected %d", wc.opcode, opcode);
  if (((wc.wc_flags & IBV_WC_WITH_IMM) != 0) != imm)
    return format("IBV_WC_WITH_IMM %s", imm ? "missing" : "set");
  if (imm && ntohl(wc.imm_data) != d.imm)
    return format("immediate 0x%08x, expected 0x%08x", ntohl(wc.imm_data), d.imm);
  if (wc.byte_len != len) return format("byte_len %u, expected %" PRIu64, wc.byte_len, len);
  return {};
}

// Which byte of message `d` (received in `slot`, or written into the region)
// differs from its pattern (empty: none).
std::string Responder::bytes_differ(int slot, const MessageDesc &d) const {
  if (d.kind != MsgKind::kWriteImm) {  // a SEND's payload, or the manifest of a WRITE
    uint64_t seed = d.kind == MsgKind::kWrite ? d.manifest_seed : d.seed;
    uint64_t len = d.kind == MsgKind::kWrite ? d.manifest_len : d.length;
    size_t bad = pool_.mismatch(slot, len, seed);
    if (bad != kNoMismatch)
      return format("%s byte %zu of %" PRIu64 " is 0x%02x, expected 0x%02x",
                    d.kind == MsgKind::kWrite ? "manifest" : "payload", bad, len,
                    pool_.byte(slot, bad), pattern_byte(seed, bad));
  }
  if (d.kind == MsgKind::kWrite || d.kind == MsgKind::kWriteImm) {
    size_t bad = find_mismatch(region_ + d.offset, d.length, d.seed, 0);
    if (bad != kNoMismatch)
      return format(
          "written byte %zu of %" PRIu64 " (region offset %" PRIu64 ") is 0x%02x, expected 0x%02x",
          bad, d.length, d.offset + bad, region_[d.offset + bad], pattern_byte(d.seed, bad));
  }
  return {};
}

bool Responder::is_message(const ibv_wc &wc, int slot, uint64_t seq) const {
  MessageDesc d = describe(key_, seq, env_.opt.max_size, env_.region_len);
  return header_differs(wc, d).empty() && bytes_differ(slot, d).empty();
}

// A completion that is the next message with wrong bytes is a corruption. One
// that is not the next message at all is a later one (those before it were
// lost), an earlier one (a repeat), or else garbage.
void Responder::check_message(const ibv_wc &wc, int slot) {
  MessageDesc d = describe(key_, next_seq_, env_.opt.max_size, env_.region_len);
  std::string why = header_differs(wc, d);
  if (why.empty()) {
    why = bytes_differ(slot, d);
    if (!why.empty())
      env_.corrupted("responder %d (from w%d.g%u q%d, epoch %u): message %" PRIu64 ": %s", index_,
                     init_slot_, init_gen_, init_q_, epoch_, next_seq_, why.c_str());
  } else if (!out_of_sequence(wc, slot, why)) {
    return;  // a repeat: the next message is still to come
  }
  d = describe(key_, next_seq_, env_.opt.max_size, env_.region_len);
  bump(env_.cnt.messages);
  bump(env_.cnt.verified_bytes, d.kind == MsgKind::kWrite ? d.length + d.manifest_len : d.length);
  ++next_seq_;
  info_.verified.store(next_seq_, std::memory_order_release);
}

// False for a repeat (the completion does not take the next number).
bool Responder::out_of_sequence(const ibv_wc &wc, int slot, const std::string &why) {
  for (int j = 1; j <= kLookaround; ++j) {
    if (!is_message(wc, slot, next_seq_ + j)) continue;
    env_.lost(j,
              "responder %d (from w%d.g%u q%d, epoch %u): message %" PRIu64 " arrived when %" PRIu64
              " was next (that one would differ: %s)",
              index_, init_slot_, init_gen_, init_q_, epoch_, next_seq_ + j, next_seq_,
              why.c_str());
    next_seq_ += j;
    return true;
  }
  for (uint64_t j = 1; j <= std::min<uint64_t>(kLookaround, next_seq_); ++j) {
    if (!is_message(wc, slot, next_seq_ - j)) continue;
    bump(env_.cnt.duplicated);
    env_.corrupted("responder %d (from w%d.g%u q%d, epoch %u): message %" PRIu64
                   " arrived again (next is %" PRIu64 ")",
                   index_, init_slot_, init_gen_, init_q_, epoch_, next_seq_ - j, next_seq_);
    return false;
  }
  env_.corrupted("responder %d (from w%d.g%u q%d, epoch %u): message %" PRIu64 ": %s", index_,
                 init_slot_, init_gen_, init_q_, epoch_, next_seq_, why.c_str());
  return true;
}

bool Responder::on_qp_event(const ibv_qp *qp, ibv_event_type type) {
  if (!owns(qp)) return false;
  if (type == IBV_EVENT_QP_LAST_WQE_REACHED && srq_ && failed_on_purpose_ && !last_wqe_) {
    last_wqe_ = true;
    bump(env_.cnt.expected_events[static_cast<int>(Reason::kOwnQpFailed)]);
  } else {
    env_.anomaly(Anomaly::kAsyncEvent, "%s on responder %d (from w%d q%d, epoch %u)",
                 event_name(type), index_, init_slot_, init_q_, epoch_);
  }
  return true;
}

uint64_t Responder::oldest_wait_ns(char *text, size_t n) const {
  if (state_ == State::kFinishing) {
    std::snprintf(text, n, "responder %d: last completions from w%d q%d (epoch %u)", index_,
                  init_slot_, init_q_, epoch_);
    return deadline_ns_ - kTailGraceNs;
  }
  if (state_ == State::kReleasing) {
    std::snprintf(text, n, "responder %d: IBV_EVENT_QP_LAST_WQE_REACHED (from w%d q%d)", index_,
                  init_slot_, init_q_);
    return deadline_ns_ - kLastWqeWaitNs;
  }
  return 0;
}

}  // namespace stress
