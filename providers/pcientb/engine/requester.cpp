// The requester: executes send WRs. A WR runs at once, in the caller's
// thread, when it can; one that must wait (RNR, a target not ready) waits in
// the QP's backlog, in order, for the progress thread.
#include <endian.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "engine/opcodes.hpp"
#include "engine/responder.hpp"

namespace pcientb::engine {
namespace {

// IB min_rnr_timer codes, in microseconds.
constexpr uint32_t kRnrTimerUs[32] = {655360, 10,    20,    30,     40,     60,     80,     120,
                                      160,    240,   320,   480,    640,    960,    1280,   1920,
                                      2560,   3840,  5120,  7680,   10240,  15360,  20480,  30720,
                                      40960,  61440, 81920, 122880, 163840, 245760, 327680, 491520};

constexpr uint64_t kLinkRetryNs = 20000;
constexpr uint64_t kAnswersFirstNs = 100000;  // a dead target's answers are taken by then
constexpr uint64_t kLinkWaitNs = 10000000;    // how long a datagram's post waits for a link
// An answer (or a link) is waited for at least this long, whatever the QP's
// timeout: it takes the target's CPU, which a loaded host may give it late.
constexpr uint64_t kAnswerFloorNs = 1000000000;

uint64_t transport_timeout_ns(uint8_t timeout) {
  // 4.096 us * 2^timeout; 0 means infinite, retried every second.
  return timeout ? 4096ull << std::min<uint8_t>(timeout, 31) : 1000000000ull;
}

// How long a request may wait for its answer, or for its link to come up:
// as long as the QP's retries would take an HCA, at least kAnswerFloorNs.
uint64_t answer_wait_ns(const Qp *qp) {
  return std::max(kAnswerFloorNs,
                  transport_timeout_ns(qp->attr.timeout) * (qp->attr.retry_cnt + 1u));
}

// no_ack: the target QP is not ready for us (transport retry); busy: the
// link is not up yet or its lane is full (tried again soon); sent: a
// request went out, its answer completes the WR (Qp::sent).
enum class Outcome { done, no_ack, busy, sent };
struct Result {
  Outcome outcome;
  ibv_wc_status status;
  uint32_t byte_len;
  uint32_t psn = 0;      // of the request, when sent
  uint64_t rec_pos = 0;  // of a request whose bytes are pulled: lane position + 1
};
Result done(ibv_wc_status s, uint32_t len = 0) {
  return {Outcome::done, s, len};
}

// A dead target (or one not ready for us) answers nothing: as on an HCA,
// the WR is tried again after the QP's timeout and fails when its retries
// run out, so what the target answered before it died completes first.
Result no_answer() {
  return {Outcome::no_ack, IBV_WC_RETRY_EXC_ERR, 0};
}

// Success once the bytes are placed, if the peer was alive when they landed:
// data that went to a dying node is not delivered.
Result landed(fabric::Peer &peer, uint64_t len) {
  if (!peer.live()) return no_answer();
  return done(IBV_WC_SUCCESS, static_cast<uint32_t>(len));
}

uint64_t total_length(const SendWqe &w) {
  uint64_t n = 0;
  for (uint32_t i = 0; i < w.num_sge; ++i) n += w.sge[i].length;
  return n;
}

// The local side: the message's source pieces, or where a READ/atomic lands.
ibv_wc_status local_gather(Qp *qp, const SendWqe &w, bool dest, Gather *g) {
  const MrShared *mrs = qp->ctx->node->root()->mrs;
  bool inl = (w.flags & IBV_SEND_INLINE) && !dest;
  for (uint32_t i = 0; i < w.num_sge; ++i) {
    const ibv_sge &s = w.sge[i];
    MrShared mr;
    if (!inl && s.length &&
        !mr_check(mrs, s.lkey, false, qp->pd->id, dest ? IBV_ACCESS_LOCAL_WRITE : 0, s.addr,
                  s.length, &mr))
      return IBV_WC_LOC_PROT_ERR;
    g->ptr[g->n] =
        w.holds_inline
            ? w.held()
            : reinterpret_cast<const uint8_t *>(inl || !s.length ? s.addr : va_of(mr, s.addr));
    g->len[g->n] = s.length;
    g->win.set(g->n, inl || !s.length ? fabric::WindowId{} : mr.window);
    g->n++;
  }
  return IBV_WC_SUCCESS;
}

// A request's number in its QP's stream (go-back resends keep it): 0 is
// never one.
uint32_t stamp(Qp *qp, SendWqe &w, RecordHead *h, uint32_t dqpn) {
  if (!w.psn && !++qp->next_psn) ++qp->next_psn;
  if (!w.psn) w.psn = qp->next_psn;
  h->qpn = dqpn;
  h->psn = w.psn;
  h->src_qpn = qp->ibv->qp_num;
  h->epoch = qp->epoch;
  return w.psn;
}

// Posts a record to the link's request lane and rings the target; busy when
// the lane has no room (the target is behind: tried again soon).
bool put_request(fabric::Fabric &fab, fabric::Peer &peer, OutLink &l, RecordHead *rec, size_t len,
                 const Gather *after = nullptr, uint64_t *pos = nullptr) {
  bool put;
  {
    std::lock_guard<SpinLock> g(l.req_mu);
    put = lane_put(fab, peer, l.requests, rec, len, after, pos);
  }
  if (put) fab.doorbell(peer);
  return put;
}

// A message too long to go inline names the pieces of this node's windows
// the target pulls its bytes from. Returns the record's length.
size_t add_pieces(SendRecord *r, size_t header, const Gather &src) {
  auto *p = reinterpret_cast<Piece *>(reinterpret_cast<uint8_t *>(r) + header);
  r->pieces = 0;
  for (uint32_t i = 0; i < src.n; ++i)
    if (src.len[i])
      p[r->pieces++] = Piece{src.win[i], reinterpret_cast<uint64_t>(src.ptr[i]), src.len[i]};
  return header + r->pieces * sizeof(Piece);
}

void fill_grh(Qp *qp, const Ah *ah, uint32_t payload, uint8_t *grh) {
  memset(grh, 0, kGrhBytes);
  uint32_t word0 = htobe32((6u << 28) | (uint32_t{ah->attr.grh.traffic_class} << 20) |
                           (ah->attr.grh.flow_label & 0xfffff));
  memcpy(grh, &word0, 4);
  uint16_t plen = htobe16(static_cast<uint16_t>(payload));
  memcpy(grh + 4, &plen, 2);
  grh[6] = 0x1b;  // next header: IBA transport
  grh[7] = ah->attr.grh.hop_limit;
  ibv_gid_entry sgid{};
  qp->ctx->query_gid(1, 0, &sgid);
  memcpy(grh + 8, sgid.gid.raw, 16);
  memcpy(grh + 24, ah->attr.grh.dgid.raw, 16);
}

Result execute_ud(Qp *qp, SendWqe &w, const Gather &src, uint64_t len) {
  Node &node = *qp->ctx->node;
  fabric::Fabric &fab = node.fab();
  Ah *ah = w.ah;
  if (len > kMtu) return done(IBV_WC_LOC_LEN_ERR);
  fabric::Peer *peer = ah->peer.load(std::memory_order_acquire);
  if (!peer || peer->dead()) {
    peer = fab.peer(ah->attr.dlid);
    ah->peer.store(peer, std::memory_order_release);
  }
  // Unreliable datagrams to nobody are lost; the target drops those for a
  // QP that is not there (or not ready, or of another Q_Key).
  if (!peer || !peer->live()) return done(IBV_WC_SUCCESS);
  // The first datagram to a node waits briefly for the link, as a first
  // use of an address resolves it: its completion then says it left.
  OutLink *l = node.link(*peer);
  for (uint64_t until = now_ns() + kLinkWaitNs; !l && now_ns() < until; l = node.link(*peer))
    sched_yield();
  if (!l) return {Outcome::busy, IBV_WC_SUCCESS, 0};
  DatagramRecord r{};
  r.head.type = kRecDatagram;
  r.head.qpn = w.remote_qpn;
  r.head.src_qpn = qp->ibv->qp_num;
  r.qkey = (w.remote_qkey & 0x80000000u) ? qp->attr.qkey : w.remote_qkey;
  r.solicited = (w.flags & IBV_SEND_SOLICITED) != 0;
  r.byte_len = static_cast<uint32_t>(len);
  if (w.opcode == IBV_WR_SEND_WITH_IMM) {
    r.imm = w.imm;
    r.flags |= kDgImm;
  }
  if (ah->attr.is_global) {
    fill_grh(qp, ah, static_cast<uint32_t>(len), r.grh);
    r.flags |= kDgGrh;
  }
  if (!put_request(fab, *peer, *l, &r.head, sizeof r, &src))
    return {Outcome::busy, IBV_WC_SUCCESS, 0};
  return done(IBV_WC_SUCCESS);
}

Result execute_rc(Qp *qp, SendWqe &w, const Gather &src, uint64_t len) {
  fabric::Fabric &fab = qp->ctx->node->fab();
  fabric::Peer *peer = qp->peer;
  if (!peer) {
    peer = qp->peer = fab.peer(qp->attr.ah_attr.dlid);
    if (!peer) return no_answer();
    qp->peer_nonce = peer->nonce();
    qp->ctx->node->watch(peer);
  }
  if (!peer->live()) return no_answer();
  // The target's QP and MRs as it pushed them here: nothing is read from its memory.
  const Mirror *m = qp->mirror;
  if (!m) {
    if (!(qp->link = qp->ctx->node->link(*peer))) return {Outcome::busy, IBV_WC_RETRY_EXC_ERR, 0};
    m = qp->mirror = static_cast<const Mirror *>(qp->ctx->node->ptr(qp->link->mirror));
  }
  uint32_t dqpn = qp->attr.dest_qp_num;
  QpView tv;
  // A target that is not (yet) there, or not connected to us, never answers.
  if (!read_qp(m->qps[dqpn & (kMaxQps - 1)], &tv) || tv.qpn != dqpn || tv.type != IBV_QPT_RC ||
      (tv.state != IBV_QPS_RTR && tv.state != IBV_QPS_RTS && tv.state != IBV_QPS_SQD) ||
      tv.dest_qpn != qp->ibv->qp_num || tv.dest_lid != fab.lid())
    return no_answer();

  MrShared mr;
  auto remote_ok = [&](uint32_t need, uint64_t n) {
    return (tv.access & need) && mr_check(m->mrs, w.rkey, true, tv.pd, need, w.remote_addr, n, &mr);
  };
  auto failed_move = [&](fabric::MoveStatus s) {
    return s == fabric::MoveStatus::peer_dead ? no_answer() : done(IBV_WC_REM_ACCESS_ERR);
  };
  // The bytes of a WRITE through the window into the MR remote_ok found.
  auto push = [&] {
    uint64_t off = 0;
    for (uint32_t i = 0; i < src.n; ++i) {
      auto s = fab.write(*peer, mr.window, va_of(mr, w.remote_addr + off), src.ptr[i], src.len[i]);
      if (s != fabric::MoveStatus::ok) return s;
      off += src.len[i];
    }
    return fabric::MoveStatus::ok;
  };
  auto sent = [&](RecordHead *h, size_t rec_len, const Gather *after = nullptr,
                  bool pulled = false) -> Result {
    uint64_t pos = 0;
    if (!put_request(fab, *peer, *qp->link, h, rec_len, after, &pos))
      return {Outcome::busy, IBV_WC_RETRY_EXC_ERR, 0};
    return {Outcome::sent, IBV_WC_SUCCESS, 0, h->psn, pulled ? pos + 1 : 0};
  };

  switch (w.opcode) {
    case IBV_WR_RDMA_READ: {
      if (len && !remote_ok(IBV_ACCESS_REMOTE_READ, len)) return done(IBV_WC_REM_ACCESS_ERR);
      uint64_t off = 0;
      for (uint32_t i = 0; i < src.n; ++i) {
        auto s = fab.read(*peer, mr.window, va_of(mr, w.remote_addr + off),
                          const_cast<uint8_t *>(src.ptr[i]), src.len[i]);
        if (s != fabric::MoveStatus::ok) return failed_move(s);
        off += src.len[i];
      }
      return landed(*peer, len);
    }
    case IBV_WR_RDMA_WRITE: {
      // A zero-length write touches no memory and needs no valid rkey.
      if (len && !remote_ok(IBV_ACCESS_REMOTE_WRITE, len)) return done(IBV_WC_REM_ACCESS_ERR);
      if (auto s = push(); s != fabric::MoveStatus::ok) return failed_move(s);
      return landed(*peer, len);
    }
    case IBV_WR_ATOMIC_CMP_AND_SWP:
    case IBV_WR_ATOMIC_FETCH_AND_ADD: {
      if (len != 8 || src.n != 1) return done(IBV_WC_LOC_LEN_ERR);
      if (w.remote_addr & 7) return done(IBV_WC_REM_INV_REQ_ERR);
      if (!remote_ok(IBV_ACCESS_REMOTE_ATOMIC, 8)) return done(IBV_WC_REM_ACCESS_ERR);
      // Executed by the target, atomic against its own CPU and every other
      // initiator; the answer carries the old value.
      AtomicRecord r{};
      r.head.type = kRecAtomic;
      stamp(qp, w, &r.head, dqpn);
      r.rkey = w.rkey;
      r.addr = w.remote_addr;
      r.compare_add = w.compare_add;
      r.swap = w.swap;
      r.op = w.opcode;
      return sent(&r.head, sizeof r);
    }
    case IBV_WR_RDMA_WRITE_WITH_IMM:
    case IBV_WR_SEND:
    case IBV_WR_SEND_WITH_IMM: {
      // Executed by the target: it takes the receive from its own queue,
      // places the bytes (a WRITE's after checking the rkey in its own
      // table) and completes into its own CQ; the answer completes the WR.
      alignas(8) uint8_t buf[sizeof(SendRecord) + sizeof(uint64_t) + (kMaxSge + 1) * sizeof(Piece)];
      auto *r = new (buf) SendRecord{};
      r->head.type = kRecSend;
      stamp(qp, w, &r->head, dqpn);
      r->opcode = static_cast<uint8_t>(w.opcode);
      r->solicited = (w.flags & IBV_SEND_SOLICITED) != 0;
      r->imm = w.imm;
      r->rkey = w.rkey;
      r->byte_len = static_cast<uint32_t>(len);
      const size_t header = sizeof *r + send_extra(w.opcode);
      if (header > sizeof *r) memcpy(buf + sizeof *r, &w.remote_addr, sizeof w.remote_addr);
      // Short: the bytes follow the record in the lane, posted from where they are.
      if (len <= kRecordInline) return sent(&r->head, header, &src);
      if (w.opcode == IBV_WR_RDMA_WRITE_WITH_IMM) {
        // Placed here as a WRITE's (posted writes through the window; a pull by the target
        // would read across it), before the record that takes the receive: a go-back
        // places them again.
        if (!remote_ok(IBV_ACCESS_REMOTE_WRITE, len)) return done(IBV_WC_REM_ACCESS_ERR);
        if (auto s = push(); s != fabric::MoveStatus::ok) return failed_move(s);
        r->pieces = kPiecesPlaced;
        return sent(&r->head, header);
      }
      return sent(&r->head, add_pieces(r, header, src), nullptr, true);
    }
    default:
      return done(IBV_WC_LOC_QP_OP_ERR);
  }
}

Result execute(Qp *qp, SendWqe &w) {
  bool dest = op_info(w.opcode)->local_dest;  // a posted WR's opcode is supported
  Gather src;
  ibv_wc_status s = local_gather(qp, w, dest, &src);
  if (s != IBV_WC_SUCCESS) return done(s);
  uint64_t len = total_length(w);
  if (len > (1ull << 31)) return done(IBV_WC_LOC_LEN_ERR);
  return qp->ibv->qp_type == IBV_QPT_UD ? execute_ud(qp, w, src, len) : execute_rc(qp, w, src, len);
}

// With sq_mu held.
void complete(Qp *qp, const SendWqe &w, ibv_wc_status status, uint32_t byte_len) {
  qp->stats->count_tx(w.opcode, status, total_length(w));
  if (status == IBV_WC_SUCCESS && !qp->sig_all && !(w.flags & IBV_SEND_SIGNALED)) return;
  Node &node = *qp->ctx->node;
  complete_with(node, qp->sh, qp->scq->sh, false, [&](CqEntry &e) {
    e.wc = ibv_wc{};
    e.wc.wr_id = w.wr_id;
    e.wc.status = status;
    e.wc.opcode = op_info(w.opcode)->wc;
    e.wc.byte_len = byte_len;
    e.wc.qp_num = qp->ibv->qp_num;
    if (status != IBV_WC_SUCCESS && status != IBV_WC_WR_FLUSH_ERR) e.wc.vendor_err = 1;
    e.sq_ticket = (uint64_t{qp->idx} << 48) | w.seq;
  });
}

}  // namespace

void withdraw_pulls_locked(Qp *qp) {
  OutLink *l = qp->link;
  if (!l || !qp->peer) return;
  fabric::Fabric &fab = qp->ctx->node->fab();
  auto withdraw = [&](WqeQueue &q) {
    for (size_t i = 0; i < q.size(); ++i) {
      SendWqe &w = q[i];
      if (!w.rec_pos) continue;
      const uint64_t pos = w.rec_pos - 1;
      w.rec_pos = 0;
      // Under the lane's lock: cells the target has not credited are not
      // reused meanwhile, so the post lands in this record and no other.
      if (pos < l->requests.taken->load(std::memory_order_acquire)) continue;  // taken
      const uint32_t none = 0;
      fab.post(*qp->peer,
               l->requests.lane + (pos % l->requests.cells) * kCell + offsetof(RecordHead, psn),
               &none, sizeof none);
    }
  };
  std::lock_guard<SpinLock> g(l->req_mu);
  withdraw(qp->sent);
  withdraw(qp->backlog);  // sent once, gone back: that copy is dropped, but who knows when
  // The program may reuse the buffers once this returns: the voids land first.
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

namespace {

// With sq_mu held: the QP fails; everything it holds completes flushed.
void enter_error_locked(Qp *qp) {
  withdraw_pulls_locked(qp);
  qp->sh->state.store(IBV_QPS_ERR, std::memory_order_release);
  qp->ctx->node->push_qp(qp->idx);
  while (!qp->sent.empty()) {
    complete(qp, qp->sent.front(), IBV_WC_WR_FLUSH_ERR, 0);
    qp->sent.pop_front();
  }
  qp->unanswered = 0;
  while (!qp->backlog.empty()) {
    complete(qp, qp->backlog.front(), IBV_WC_WR_FLUSH_ERR, 0);
    qp->backlog.pop_front();
  }
  Node &node = *qp->ctx->node;
  rq_flush(node, qp->sh);
  if (!qp->errored) last_wqe_reached(node, qp->sh);
  qp->errored = true;
}

// Completes the WRs at the front of Qp::sent that are done, in order; the
// first that failed fails the QP. With sq_mu held.
void drain_sent(Qp *qp) {
  while (!qp->sent.empty() && qp->sent.front().done) {
    const SendWqe &w = qp->sent.front();
    complete(qp, w, w.status, w.byte_len);
    const ibv_wc_status status = w.status;
    qp->sent.pop_front();
    if (status != IBV_WC_SUCCESS) {
      enter_error_locked(qp);
      return;
    }
  }
}

// Whether a WR travels to the target as a request (it is executed there,
// in the QP's order, and answered): SENDs, WRITEs with immediate, atomics.
bool travels(const SendWqe &w) {
  const OpInfo &op = *op_info(w.opcode);
  return w.ah == nullptr && (op.recv_wc || is_atomic(op));
}

// A WRITE with immediate too long for a record: its bytes are placed here.
bool places_bytes(const SendWqe &w) {
  return w.opcode == IBV_WR_RDMA_WRITE_WITH_IMM && total_length(w) > kRecordInline;
}

// Where [addr, addr + len) of the target's MR rkey is in the target's memory,
// as the mirror of its tables says; false when it does not say.
bool target_va(const Qp *qp, uint32_t rkey, uint64_t addr, uint64_t len, uint64_t *va) {
  const Mirror *m = qp->mirror;
  QpView tv;
  MrShared mr;
  if (!m || !read_qp(m->qps[qp->attr.dest_qp_num & (kMaxQps - 1)], &tv) ||
      !mr_check(m->mrs, rkey, true, tv.pd, IBV_ACCESS_REMOTE_WRITE, addr, len, &mr))
    return false;
  *va = va_of(mr, addr);
  return true;
}

// A WRITE with immediate whose bytes are placed here (longer than a record
// carries) waits for the requests before it that the target has still to
// execute and that may write the same bytes: SENDs (their receives are the
// target's to choose), atomics, and short WRITEs with immediate into them.
// Placed ones before it landed before it; a go-back places its bytes again.
bool placed_waits(const Qp *qp, const SendWqe &w) {
  const uint64_t len = total_length(w);
  uint64_t va;
  if (!target_va(qp, w.rkey, w.remote_addr, len, &va)) return true;
  for (size_t i = 0; i < qp->sent.size(); ++i) {
    const SendWqe &x = qp->sent[i];
    if (x.done) continue;
    if (x.opcode != IBV_WR_RDMA_WRITE_WITH_IMM) return true;
    const uint64_t xlen = total_length(x);
    if (xlen == 0 || places_bytes(x)) continue;
    uint64_t xva;
    if (!target_va(qp, x.rkey, x.remote_addr, xlen, &xva) || (xva < va + len && va < xva + xlen))
      return true;
  }
  return false;
}

// A WR the requester executes itself (RDMA WRITE or READ) waits for the
// answers to the requests before it: it would otherwise land first (a WRITE
// over the bytes of an atomic before it, or past an RNR'd SEND). Requests go
// out behind unanswered ones, a placed WRITE with immediate as placed_waits says.
bool behind_answers(const Qp *qp, const SendWqe &w) {
  if (qp->halted) return true;
  if (!qp->unanswered) return false;
  if (!travels(w)) return true;
  return places_bytes(w) && placed_waits(qp, w);
}

// A WR that may be executed again (it waits, or a go-back may resend it)
// keeps its inline data: the caller's buffer may be reused once posted.
void own_inline(SendWqe &k) {
  if (!(k.flags & IBV_SEND_INLINE) || k.holds_inline) return;
  k.hold_inline(k.sge, k.num_sge);  // reads every piece before it rewrites sge[0]
}

// Applies one attempt's result to w (not in the backlog, or its front): a
// WR executed here completes at once unless WRs sent before it still wait
// for their answers; then it waits behind them, done (Qp::sent).
enum class Settled { ok, failed, waits, sent };

// One transport retry of w, as an HCA's after its timeout: false if they are
// spent; else counted, and w waits the QP's timeout.
bool take_retry(Qp *qp, SendWqe &w) {
  if (w.retry_left == 0) return false;
  qp->stats->transport_retries.add(1);
  if (w.retry_left > 0) --w.retry_left;
  w.not_before_ns = now_ns() + transport_timeout_ns(qp->attr.timeout);
  return true;
}

Settled settle(Qp *qp, SendWqe &w, Result r) {
  if (r.outcome == Outcome::busy) {
    // The link comes up within a doorbell and a push, and a full lane is taken at the
    // target's next look: a QP that could put nothing for as long as an answer may take
    // fails the WR as an unanswered one would (a datagram is lost). Counted from the
    // QP's last success at putting something, not from this WR's first try: a WR that
    // waited in the backlog meanwhile (behind a go-back) has not been stuck.
    uint64_t now = now_ns();
    if (!qp->busy_since_ns) qp->busy_since_ns = now;
    if (now - qp->busy_since_ns <= answer_wait_ns(qp)) {
      w.not_before_ns = now + kLinkRetryNs;
      return Settled::waits;
    }
    r = done(r.status);
  }
  qp->busy_since_ns = 0;
  if (r.outcome == Outcome::no_ack) {
    if (take_retry(qp, w)) return Settled::waits;
    r = done(r.status);
  }
  if (r.outcome == Outcome::done) {
    if (!qp->sent.empty()) {
      // Waits for the answers before it; failed, it stops the WRs after it
      // (on an HCA the QP would fail now).
      if (r.status != IBV_WC_SUCCESS) qp->halted = true;
      w.done = true;
      w.status = r.status;
      w.byte_len = r.byte_len;
      qp->sent.push_back(std::move(w));
      return Settled::ok;
    }
    complete(qp, w, r.status, r.byte_len);
    return r.status == IBV_WC_SUCCESS ? Settled::ok : Settled::failed;
  }
  own_inline(w);
  w.done = false;
  w.rec_pos = r.rec_pos;
  // A second or more away: the coarse clock (a few ms behind) is close enough.
  w.deadline_ns = coarse_now_ns() + answer_wait_ns(qp);
  qp->sent.push_back(std::move(w));
  ++qp->unanswered;
  return Settled::sent;
}

void keep(Qp *qp, SendWqe &&w) {
  own_inline(w);
  qp->backlog.push_back(std::move(w));
}

// The sooner of two times the progress thread must look at a QP (0: never).
uint64_t sooner(uint64_t a, uint64_t b) {
  return !a ? b : !b ? a : std::min(a, b);
}

// With sq_mu held. Returns when the progress thread must look at the QP
// (1: now; 0: no need).
uint64_t submit(Qp *qp, SendWqe &&w) {
  ibv_qp_state st = qp->state();
  if (st == IBV_QPS_ERR) {
    complete(qp, w, IBV_WC_WR_FLUSH_ERR, 0);
    return 0;
  }
  w.rnr_left = qp->attr.rnr_retry == 7 ? -1 : qp->attr.rnr_retry;
  w.retry_left = qp->attr.retry_cnt;
  w.not_before_ns = 0;
  // Requests go out while others wait for their answers (the target takes
  // them in order); WRs executed here wait for those answers.
  if (!qp->backlog.empty() || st != IBV_QPS_RTS || behind_answers(qp, w)) {
    keep(qp, std::move(w));
    return st == IBV_QPS_RTS && !behind_answers(qp, qp->backlog.front()) ? 1 : 0;
  }
  Settled r = settle(qp, w, execute(qp, w));
  if (r == Settled::failed) enter_error_locked(qp);
  // The progress thread watches the answers' deadlines while any is due.
  if (r == Settled::sent) {
    const uint64_t d = qp->sent.back().deadline_ns;
    if (qp->watched_at && qp->watched_at <= d) return 0;
    qp->watched_at = d;
    return d;
  }
  if (r != Settled::waits) return 0;
  keep(qp, std::move(w));
  return 1;
}

void to_wqe(const ibv_send_wr *wr, SendWqe *w) {
  w->wr_id = wr->wr_id;
  w->opcode = wr->opcode;
  w->flags = wr->send_flags;
  w->imm = wr->imm_data;
  w->num_sge = static_cast<uint32_t>(wr->num_sge);
  if (w->num_sge) memcpy(w->sge, wr->sg_list, sizeof(ibv_sge) * w->num_sge);
  w->ah = nullptr;
  const OpInfo *op = op_info(wr->opcode);
  if (op && is_atomic(*op)) {
    w->remote_addr = wr->wr.atomic.remote_addr;
    w->rkey = wr->wr.atomic.rkey;
    w->compare_add = wr->wr.atomic.compare_add;
    w->swap = wr->wr.atomic.swap;
  } else if (op && op->remote_access) {  // RDMA WRITE (with immediate), READ
    w->remote_addr = wr->wr.rdma.remote_addr;
    w->rkey = wr->wr.rdma.rkey;
  }
}

}  // namespace

int check_wqe(Qp *qp, ibv_wr_opcode opcode, unsigned int flags, const ibv_sge *sge,
              uint32_t num_sge, bool has_ah) {
  ibv_qp_state st = qp->state();
  if (st == IBV_QPS_RESET || st == IBV_QPS_INIT || st == IBV_QPS_RTR) return EINVAL;
  ibv_qp_type type = qp->ibv->qp_type;
  const OpInfo *op = op_info(opcode);
  if (!op || !op_allowed_on(*op, type)) return EINVAL;
  if (num_sge > qp->cap.max_send_sge) return EINVAL;
  if (flags & IBV_SEND_INLINE) {
    if (op->local_dest) return EINVAL;
    uint64_t n = 0;
    for (uint32_t i = 0; i < num_sge; ++i) n += sge[i].length;
    if (n > qp->cap.max_inline_data) return EINVAL;
  }
  if (type == IBV_QPT_UD && !has_ah) return EINVAL;
  return 0;
}

int check_send_wr(Qp *qp, const ibv_send_wr *wr) {
  if (wr->num_sge < 0 || static_cast<uint32_t>(wr->num_sge) > qp->cap.max_send_sge) return EINVAL;
  if (wr->num_sge && !wr->sg_list) return EINVAL;
  // wr.ud.ah is looked at for UD only.
  return check_wqe(qp, wr->opcode, wr->send_flags, wr->sg_list, static_cast<uint32_t>(wr->num_sge),
                   wr->wr.ud.ah != nullptr);
}

int post_send(Qp *qp, const ibv_send_wr *wr, ibv_send_wr **bad) {
  uint64_t due = 0;
  int err = 0;
  {
    std::lock_guard<SpinLock> g(qp->sq_mu);
    for (; wr; wr = wr->next) {
      if ((err = check_send_wr(qp, wr))) {
        *bad = const_cast<ibv_send_wr *>(wr);
        break;
      }
      // The send queue holds what the application has not retired by polling.
      if (qp->sq_posted - qp->ctx->node->sq_retired(qp->idx) >= qp->cap.max_send_wr) {
        *bad = const_cast<ibv_send_wr *>(wr);
        err = ENOMEM;
        break;
      }
      SendWqe w;
      to_wqe(wr, &w);
      w.seq = ++qp->sq_posted;
      if (qp->ibv->qp_type == IBV_QPT_UD) {
        w.ah = from_ibv<Ah>(wr->wr.ud.ah);
        w.remote_qpn = wr->wr.ud.remote_qpn;
        w.remote_qkey = wr->wr.ud.remote_qkey;
      }
      due = sooner(due, submit(qp, std::move(w)));
    }
    qp->stats->sq_posted.set(qp->sq_posted);
  }
  if (due) qp->ctx->node->schedule(qp, due);
  return err;
}

int post_wqes(Qp *qp, SendWqe *wqes, size_t n) {
  uint64_t due = 0;
  {
    std::lock_guard<SpinLock> g(qp->sq_mu);
    if (qp->sq_posted + n - qp->ctx->node->sq_retired(qp->idx) > qp->cap.max_send_wr) return ENOMEM;
    for (size_t i = 0; i < n; ++i) {
      wqes[i].seq = ++qp->sq_posted;
      due = sooner(due, submit(qp, std::move(wqes[i])));
    }
    qp->stats->sq_posted.set(qp->sq_posted);
  }
  if (due) qp->ctx->node->schedule(qp, due);
  return 0;
}

namespace {
uint64_t run_backlog(Qp *qp, uint64_t next);
uint64_t answer_locked(Qp *qp, const AnswerRecord &a);

// Go-back: sent[k] and every WR after it return to the backlog's front, in
// order, to be sent again with the same PSNs from not_before_ns on (the
// target drops the connection's later requests until sent[k] comes again).
// With sq_mu held.
void go_back(Qp *qp, size_t k, uint64_t not_before_ns) {
  WqeQueue &sent = qp->sent;
  sent[k].not_before_ns = not_before_ns;
  qp->halted = false;        // a WR that failed here goes back too: it fails again in its turn
  while (sent.size() > k) {  // from the back: pushed to the front, they keep their order
    SendWqe &x = sent.back();
    if (!x.done) --qp->unanswered;
    x.done = false;
    qp->backlog.push_front(std::move(x));
    sent.pop_back();
  }
}

// No answer will come for sent[k] (its target QP is not ready for us, or its
// node died): as an HCA whose timeout expired, it goes back to be sent again
// after the QP's timeout, unless its retries are spent (false: it fails).
bool retry_unanswered(Qp *qp, size_t k) {
  if (!take_retry(qp, qp->sent[k])) return false;
  go_back(qp, k, qp->sent[k].not_before_ns);
  return true;
}
}  // namespace

namespace {
uint64_t progress_qp_locked(Qp *qp);
}

uint64_t progress_qp(Qp *qp) {
  std::lock_guard<SpinLock> g(qp->sq_mu);
  return qp->watched_at = progress_qp_locked(qp);  // 0: the caller stops watching it
}

namespace {
uint64_t progress_qp_locked(Qp *qp) {
  ibv_qp_state st = qp->state();
  if (st == IBV_QPS_ERR) {
    enter_error_locked(qp);
    return 0;
  }
  // Answers that did not come in time, or never will (the target died).
  uint64_t next = 0, now = now_ns();
  bool gone = qp->peer && qp->peer->dead();
  // Answers already in the lane are taken (by the next look at the lanes, moments away)
  // before anything fails for want of one: a target answers before its program can see
  // the message and may exit right after, and this thread looks at deadlines before it
  // takes what arrived.
  const bool answers = qp->link && qp->ctx->node->answers_waiting(*qp->link);
  const uint64_t soon = now + kAnswersFirstNs;
  if (answers && gone) {
    gone = false;
    next = soon;
  }
  for (size_t k = 0; k < qp->sent.size(); ++k) {
    SendWqe &w = qp->sent[k];
    if (w.done) continue;
    if (gone && retry_unanswered(qp, k)) break;  // it and the WRs after it went back
    if (answers && now >= w.deadline_ns) {       // looked at again once they are taken
      next = next ? std::min(next, soon) : soon;
      continue;
    }
    if (gone || now >= w.deadline_ns) {
      w.done = true;
      w.status = IBV_WC_RETRY_EXC_ERR;
      w.byte_len = 0;
      --qp->unanswered;
    } else {
      next = next ? std::min(next, w.deadline_ns) : w.deadline_ns;
    }
  }
  drain_sent(qp);
  if (qp->state() == IBV_QPS_ERR) return 0;
  if (st != IBV_QPS_RTS) return next;  // SQD, or reset: RTS schedules it again
  return run_backlog(qp, next);
}

// Executes the backlog's WRs that are due, in order, until one must wait
// (its time, or an answer to a request before it). With sq_mu held, in RTS.
// Returns when to look again (0: only an answer or a post will need it).
uint64_t run_backlog(Qp *qp, uint64_t next) {
  uint64_t now;
  while (!qp->backlog.empty() && !behind_answers(qp, qp->backlog.front())) {
    SendWqe &w = qp->backlog.front();
    now = now_ns();
    if (w.not_before_ns > now) return next ? std::min(next, w.not_before_ns) : w.not_before_ns;
    Settled r = settle(qp, w, execute(qp, w));
    if (r == Settled::waits) return next ? std::min(next, w.not_before_ns) : w.not_before_ns;
    if (r == Settled::sent) {
      const uint64_t d = qp->sent.back().deadline_ns;
      next = next ? std::min(next, d) : d;
    }
    qp->backlog.pop_front();
    if (r == Settled::failed) {
      enter_error_locked(qp);
      return 0;
    }
  }
  return next;
}

}  // namespace

void qp_answer(Qp *qp, const fabric::Peer &from, const AnswerRecord &a) {
  uint64_t due;
  {
    std::lock_guard<SpinLock> g(qp->sq_mu);
    // Only a QP connected to that peer (modify_qp changes it under sq_mu).
    if (qp->peer != &from) return;
    due = answer_locked(qp, a);
  }
  if (due) qp->ctx->node->schedule(qp, due);
}

namespace {
// With sq_mu held; returns when the progress thread must look at the QP (0: no need).
uint64_t answer_locked(Qp *qp, const AnswerRecord &a) {
  WqeQueue &sent = qp->sent;
  size_t k = 0;
  while (k < sent.size() && (sent[k].done || sent[k].psn != a.head.psn)) ++k;
  if (k == sent.size()) return 0;  // flushed, or not ours
  SendWqe &w = sent[k];
  if (a.status == kAnswerRnr && w.rnr_left != 0) {
    // Receiver not ready: sent again after the timer the target named.
    qp->stats->rnr_retries.add(1);
    if (w.rnr_left > 0) --w.rnr_left;
    go_back(qp, k, now_ns() + uint64_t{kRnrTimerUs[a.value & 31]} * 1000);
    return 1;
  }
  if (a.status == kAnswerRetry && retry_unanswered(qp, k)) return 1;
  w.done = true;
  w.byte_len = 0;
  --qp->unanswered;
  if (a.status == kAnswerRnr) {
    w.status = IBV_WC_RNR_RETRY_EXC_ERR;
  } else if (a.status == IBV_WC_SUCCESS) {
    w.status = IBV_WC_SUCCESS;
    if (!is_atomic(*op_info(w.opcode))) {
      // Cumulative: the target answers only the last of a run of successful
      // SENDs (an atomic before it was answered on its own).
      for (size_t j = 0; j < k; ++j)
        if (SendWqe &x = sent[j]; !x.done && !is_atomic(*op_info(x.opcode))) {
          x.done = true;
          x.status = IBV_WC_SUCCESS;
          x.byte_len = 0;
          --qp->unanswered;
        }
    } else {
      // The old value lands in the WR's local buffer, checked again now.
      MrShared mr;
      const ibv_sge &d = w.sge[0];
      if (w.num_sge == 1 && d.length == 8 &&
          mr_check(qp->ctx->node->root()->mrs, d.lkey, false, qp->pd->id, IBV_ACCESS_LOCAL_WRITE,
                   d.addr, 8, &mr)) {
        memcpy(reinterpret_cast<void *>(va_of(mr, d.addr)), &a.value, 8);
        w.byte_len = 8;
      } else {
        w.status = IBV_WC_LOC_PROT_ERR;
      }
    }
  } else if (a.status == kAnswerRetry || a.status >= kWcStatuses) {
    // The target QP was not there or not ready, and the retries are spent.
    w.status = IBV_WC_RETRY_EXC_ERR;
  } else {
    w.status = static_cast<ibv_wc_status>(a.status);
  }
  // The target makes progress: as an HCA's transport timer, restarted for the requests
  // still out. Counted from their posts, their deadlines would include their wait behind
  // the requests before them in the target's lane (a window of large pulls on a busy host).
  const uint64_t deadline = coarse_now_ns() + answer_wait_ns(qp);
  for (size_t j = 0; j < sent.size(); ++j)
    if (!sent[j].done && sent[j].deadline_ns < deadline) sent[j].deadline_ns = deadline;
  drain_sent(qp);
  // WRs that waited for this answer go now; later deadlines are the
  // progress thread's, which watches the QP while requests are out.
  if (qp->state() == IBV_QPS_RTS && !qp->backlog.empty() &&
      !behind_answers(qp, qp->backlog.front()))
    return run_backlog(qp, 0);
  return 0;
}
}  // namespace

void qp_enter_error(Qp *qp) {
  std::lock_guard<SpinLock> g(qp->sq_mu);
  enter_error_locked(qp);
}

}  // namespace pcientb::engine
