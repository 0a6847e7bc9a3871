// What the target side of a transfer does: receive queues (a QP's own and
// SRQs), key checks against the target's MR table, delivery into posted
// receives, and responder errors. Run by whichever node moves the data: the
// target's CPU takes no part.
#include "engine/responder.hpp"

#include <cerrno>
#include <cstring>

namespace pcientb::engine {

namespace {
// The room of a receive; its MR entries go to mrs. False when an SGE is not
// local-write memory of pd (the receive fails with IBV_WC_LOC_PROT_ERR).
bool receive_room(AreaRoot *root, uint32_t pd, const ibv_sge *sge, uint32_t n, MrShared *mrs,
                  uint64_t *room) {
  *room = 0;
  for (uint32_t i = 0; i < n; ++i) {
    const ibv_sge &g = sge[i];
    if (g.length &&
        !mr_check(root->mrs, g.lkey, false, pd, IBV_ACCESS_LOCAL_WRITE, g.addr, g.length, &mrs[i]))
      return false;
    *room += g.length;
  }
  return true;
}

// Whether a receive can take `need` bytes. The whole receive is checked
// first: nothing moves into a receive that fails.
ibv_wc_status check_receive(AreaRoot *root, uint32_t pd, const ibv_sge *sge, uint32_t n,
                            uint64_t need, MrShared *mrs) {
  uint64_t room;
  if (!receive_room(root, pd, sge, n, mrs, &room)) return IBV_WC_LOC_PROT_ERR;
  return room < need ? IBV_WC_LOC_LEN_ERR : IBV_WC_SUCCESS;
}
}  // namespace

// ---- receive queues ------------------------------------------------------------

Off rq_create(Node &node, uint32_t capacity, uint32_t max_sge, uint32_t pd) {
  Off off = node.alloc(offsetof(RqShared, ring) + ring_bytes(capacity, recv_slot_size(max_sge)));
  if (!off) return 0;
  auto *rq = static_cast<RqShared *>(node.ptr(off));
  rq->max_sge = max_sge;
  rq->pd = pd;
  rq->async = Doorbell{-1, 0, 0};
  ring_init(&rq->ring, capacity, recv_slot_size(max_sge));
  return off;
}

void rq_reset(RqShared *rq) {
  uint64_t base = rq->ring.tail.load(std::memory_order_relaxed);
  ring_reinit_at(&rq->ring, base);
  rq->released.store(base, std::memory_order_release);
}

namespace {
// Gives a consumed WQE's slot back and counts it.
void rq_release(RqShared *rq, RingSlot *s, uint64_t pos) {
  ring_release(&rq->ring, s, pos);
  rq->released.fetch_add(1, std::memory_order_acq_rel);
}
}  // namespace

int rq_post(AreaRoot *root, RqShared *rq, uint32_t max_wr, const ibv_recv_wr *wr,
            ibv_recv_wr **bad) {
  RingHeader *r = &rq->ring;
  for (; wr; wr = wr->next) {
    if (wr->num_sge < 0 || static_cast<uint32_t>(wr->num_sge) > rq->max_sge) {
      *bad = const_cast<ibv_recv_wr *>(wr);
      return EINVAL;
    }
    // Full when max_wr WQEs are posted and not consumed; the slot at the
    // tail must be free too (the ring is at least max_wr + 1 slots, but a
    // WQE held for long, its completion unpolled, can still be in the way).
    uint64_t pos = r->tail.load(std::memory_order_relaxed);
    bool vacant = pos - rq->released.load(std::memory_order_acquire) < max_wr;
    RingSlot *s = ring_slot(r, pos);
    if (!vacant || ring_seq(r, s, pos) != pos) {
      *bad = const_cast<ibv_recv_wr *>(wr);
      return ENOMEM;
    }
    // What eager senders may assume of this WQE without reading it.
    MrShared mrs[kMaxSge];
    uint64_t room;
    bool valid =
        receive_room(root, rq->pd, wr->sg_list, static_cast<uint32_t>(wr->num_sge), mrs, &room);
    for (uint32_t c = 0; c < kEagerClasses; ++c)
      if (!valid || room < kEagerRoom[c])
        rq->unfit_below[c].store(pos + 1, std::memory_order_relaxed);
    auto *w = reinterpret_cast<RecvWqe *>(s);
    w->wr_id = wr->wr_id;
    w->num_sge = static_cast<uint32_t>(wr->num_sge);
    if (w->num_sge) memcpy(w->sge, wr->sg_list, sizeof(ibv_sge) * w->num_sge);
    ring_publish(r, s, pos);
    // The tail moves last: a sender that sees it sees the WQE and its class.
    r->tail.store(pos + 1, std::memory_order_release);
  }
  return 0;
}

namespace {
// SRQ limit: one event when the queue falls below it, then disarmed.
void check_limit(fabric::Fabric &fab, fabric::Peer &owner, RqShared *rq) {
  uint32_t limit = rq->limit.load(std::memory_order_relaxed);
  if (limit && ring_count(&rq->ring) < limit && rq->limit.compare_exchange_strong(limit, 0)) {
    AsyncRecord rec{rq->handle, IBV_EVENT_SRQ_LIMIT_REACHED, 0};
    ring_doorbell(fab, owner, rq->async, &rec, sizeof rec);
  }
}
}  // namespace

bool rq_take(fabric::Fabric &fab, fabric::Peer &owner, RqShared *rq, RecvCopy *out) {
  uint64_t pos;
  RingSlot *s = ring_take(&rq->ring, &pos);
  if (!s) return false;
  auto *w = reinterpret_cast<RecvWqe *>(s);
  out->wr_id = w->wr_id;
  out->num_sge = std::min(w->num_sge, kMaxSge);
  memcpy(out->sge, w->sge, sizeof(ibv_sge) * out->num_sge);
  rq_release(rq, s, pos);
  check_limit(fab, owner, rq);
  return true;
}

void rq_reclaim(AreaRoot *root, RqShared *rq, uint32_t max_wr, uint64_t pos) {
  RingHeader *r = &rq->ring;
  RingSlot *s = ring_slot(r, pos);
  if (pos >= r->head.load(std::memory_order_acquire) || ring_seq(r, s, pos) != pos + 1) return;
  auto *w = reinterpret_cast<RecvWqe *>(s);
  ibv_sge sge[kMaxSge];
  ibv_recv_wr wr{};
  wr.wr_id = w->wr_id;
  wr.num_sge = static_cast<int>(std::min(w->num_sge, kMaxSge));
  wr.sg_list = sge;
  memcpy(sge, w->sge, sizeof(ibv_sge) * wr.num_sge);
  rq_release(rq, s, pos);
  ibv_recv_wr *bad = nullptr;
  if (rq_post(root, rq, max_wr, &wr, &bad)) {
    // The application took the room meanwhile: the receive is gone, as one
    // an HCA discards with a destroyed QP's completions.
  }
}

void rq_give_back(RqShared *rq, uint64_t pos) {
  RingSlot *s = ring_slot(&rq->ring, pos);
  if (ring_seq(&rq->ring, s, pos) == pos + 1) rq_release(rq, s, pos);
}

Reserve rq_reserve(fabric::Fabric &fab, fabric::Peer &owner, QpShared *target, RqShared *rq,
                   RqView *view, int cls, uint64_t *pos_out) {
  uint32_t qpn = target->qpn.load(std::memory_order_relaxed);
  if (view->rq != rq || view->qpn != qpn) *view = RqView{rq, qpn};
  RingHeader *r = &rq->ring;
  uint64_t pos = r->head.load(std::memory_order_relaxed);
  for (;;) {
    if (pos >= view->tail || (cls >= 0 && pos < view->unfit_below[cls])) {
      // What this sender knew is used up: one look at the owner's lines.
      view->tail = r->tail.load(std::memory_order_acquire);
      for (uint32_t c = 0; c < kEagerClasses; ++c)
        view->unfit_below[c] = rq->unfit_below[c].load(std::memory_order_relaxed);
      pos = r->head.load(std::memory_order_relaxed);
      if (pos >= view->tail) return Reserve::empty;
      if (cls >= 0 && pos < view->unfit_below[cls]) return Reserve::unfit;
    }
    if (r->head.compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed)) break;
  }
  *pos_out = pos;
  check_limit(fab, owner, rq);
  return Reserve::ok;
}

// ---- memory checks -------------------------------------------------------------

bool mr_check(const MrShared *table, uint32_t key, bool remote, uint32_t pd, uint32_t need,
              uint64_t addr, uint64_t len, MrShared *out) {
  if (remote != ((key & kRkeyBit) != 0)) return false;
  uint32_t want = key & ~kRkeyBit;
  uint32_t idx = want >> 8;
  if (idx == 0 || idx >= kMaxMrs) return false;
  const MrShared &e = table[idx];
  if (e.key.load(std::memory_order_acquire) != want) return false;
  out->pd = e.pd;
  out->access = e.access;
  out->addr = e.addr;
  out->va = e.va;
  out->length = e.length;
  out->window = e.window;
  // A change in between sets the key to 0 first: then nothing read counts.
  std::atomic_thread_fence(std::memory_order_acquire);
  if (e.key.load(std::memory_order_relaxed) != want) return false;
  if (out->pd != pd || (out->access & need) != need) return false;
  return addr >= out->addr && len <= out->length && addr - out->addr <= out->length - len;
}

bool read_qp(const QpMirror &m, QpView *out) {
  for (int tries = 0; tries < 1000; ++tries) {
    uint32_t seq = m.seq.load(std::memory_order_acquire);
    if (seq & 1) continue;  // a push is landing
    out->qpn = m.qpn.load(std::memory_order_relaxed);
    out->state = m.state.load(std::memory_order_relaxed);
    out->type = m.type.load(std::memory_order_relaxed);
    out->pd = m.pd.load(std::memory_order_relaxed);
    out->access = m.access.load(std::memory_order_relaxed);
    out->dest_qpn = m.dest_qpn.load(std::memory_order_relaxed);
    out->dest_lid = m.dest_lid.load(std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (m.seq.load(std::memory_order_relaxed) == seq) return true;
  }
  return false;
}

// ---- delivery -------------------------------------------------------------------

ibv_wc_status scatter(fabric::Fabric &fab, fabric::Peer &peer, AreaRoot *root, uint32_t pd,
                      const RecvCopy &r, uint64_t skip, const Gather &src, uint64_t len) {
  MrShared mrs[kMaxSge];
  ibv_wc_status st = check_receive(root, pd, r.sge, r.num_sge, skip + len, mrs);
  if (st != IBV_WC_SUCCESS) return st;
  uint64_t done = 0;  // bytes of the message placed
  uint64_t pos = 0;   // position in the receive's scatter list
  uint32_t si = 0;
  uint64_t soff = 0;  // position in the source's current piece
  for (uint32_t i = 0; i < r.num_sge && done < len; ++i) {
    const ibv_sge &g = r.sge[i];
    uint64_t begin = pos, end = pos + g.length;
    pos = end;
    if (end <= skip) continue;
    uint64_t at = begin < skip ? skip - begin : 0;
    while (at < g.length && done < len) {
      while (si < src.n && soff == src.len[si]) {
        ++si;
        soff = 0;
      }
      if (si == src.n) break;
      uint64_t n = std::min<uint64_t>({g.length - at, src.len[si] - soff, len - done});
      auto s = fab.write(peer, mrs[i].window, va_of(mrs[i], g.addr + at), src.ptr[si] + soff, n);
      if (s == fabric::MoveStatus::peer_dead) return IBV_WC_RETRY_EXC_ERR;
      if (s != fabric::MoveStatus::ok) return IBV_WC_LOC_PROT_ERR;
      at += n;
      soff += n;
      done += n;
    }
  }
  return IBV_WC_SUCCESS;
}

void qp_overran(fabric::Fabric &fab, fabric::Peer &owner, QpShared *qp) {
  uint32_t s = qp->state.load();
  while (s != IBV_QPS_ERR && s != IBV_QPS_RESET &&
         !qp->state.compare_exchange_weak(s, IBV_QPS_ERR)) {
  }
  if (s == IBV_QPS_ERR || s == IBV_QPS_RESET) return;  // failed already: one event
  AsyncRecord rec{qp->handle, IBV_EVENT_QP_FATAL, 0};
  ring_doorbell(fab, owner, qp->async, &rec, sizeof rec);
  last_wqe_reached(fab, owner, qp);
}

void last_wqe_reached(fabric::Fabric &fab, fabric::Peer &owner, QpShared *qp) {
  if (!qp->srq) return;
  AsyncRecord rec{qp->handle, IBV_EVENT_QP_LAST_WQE_REACHED, 0};
  ring_doorbell(fab, owner, qp->async, &rec, sizeof rec);
}

void fail_target(fabric::Fabric &fab, fabric::Peer &peer, QpShared *target) {
  uint32_t s = target->state.load();
  while (s != IBV_QPS_ERR && s != IBV_QPS_RESET &&
         !target->state.compare_exchange_weak(s, IBV_QPS_ERR)) {
  }
  if (s == IBV_QPS_RESET) return;
  rq_flush(fab, peer, target);
  if (s != IBV_QPS_ERR) last_wqe_reached(fab, peer, target);
}

void responder_error(fabric::Fabric &fab, fabric::Peer &peer, QpShared *target, const ibv_wc &wc) {
  complete_to(fab, peer, target, at<CqShared>(peer.area(), target->rcq), wc, true);
  fail_target(fab, peer, target);
}

bool deliver_eager(Node &node, const EagerRecv &e, Off srq, ibv_wc *wc) {
  AreaRoot *root = node.root();
  QpShared *t = &root->qps[e.qp_num & (kMaxQps - 1)];
  if (t->qpn.load(std::memory_order_acquire) != e.qp_num) {
    // Published after its QP's destroy stopped waiting for it (a sender
    // stalled for long): a shared queue gets the reserved WQE back.
    if (srq && node.srq_alive(srq)) rq_give_back(at<RqShared>(root, srq), e.rq_pos);
    return false;
  }
  auto *rq = at<RqShared>(root, t->srq ? t->srq : t->rq);
  if (!rq) return false;
  // Sent as the QP was being reset: the message goes with the reset.
  if (t->state.load(std::memory_order_acquire) == IBV_QPS_RESET) {
    if (t->srq) rq_give_back(rq, e.rq_pos);
    return false;
  }
  // The sender saw the WQE published; a slot in another state was reset
  // under it, and the message went with the reset.
  RingSlot *s = ring_slot(&rq->ring, e.rq_pos);
  if (ring_seq(&rq->ring, s, e.rq_pos) != e.rq_pos + 1) return false;
  const auto *wqe = reinterpret_cast<const RecvWqe *>(s);

  *wc = ibv_wc{};
  wc->wr_id = wqe->wr_id;
  wc->opcode = (e.flags & kEagerWriteImm) ? IBV_WC_RECV_RDMA_WITH_IMM : IBV_WC_RECV;
  wc->byte_len = e.byte_len;
  wc->qp_num = e.qp_num;
  wc->src_qp = t->dest_qpn;
  wc->slid = t->dest_lid;
  if (e.flags & kEagerImm) {
    wc->imm_data = e.imm_data;
    wc->wc_flags = IBV_WC_WITH_IMM;
  }
  if (!(e.flags & kEagerWriteImm)) {
    // This node's own memory: placed by the CPU, no fabric in between.
    MrShared mrs[kMaxSge];
    uint32_t n = std::min(wqe->num_sge, kMaxSge);
    wc->status = check_receive(root, rq->pd, wqe->sge, n, e.byte_len, mrs);
    for (uint32_t i = 0, done = 0; wc->status == IBV_WC_SUCCESS && done < e.byte_len; ++i) {
      uint32_t k = std::min(wqe->sge[i].length, e.byte_len - done);
      if (k) memcpy(reinterpret_cast<void *>(va_of(mrs[i], wqe->sge[i].addr)), e.data + done, k);
      done += k;
    }
  }
  rq_release(rq, s, e.rq_pos);
  if (wc->status != IBV_WC_SUCCESS) {
    // Only a receive whose memory went away since it was posted: the
    // sender, told otherwise, has completed already.
    wc->byte_len = 0;
    fail_target(node.fab(), node.self(), t);
  }
  return true;
}

void rq_flush(fabric::Fabric &fab, fabric::Peer &peer, QpShared *target) {
  auto *rq = at<RqShared>(peer.area(), target->rq);
  auto *rcq = at<CqShared>(peer.area(), target->rcq);
  if (!rq || !rcq) return;
  RecvCopy r;
  while (rq_take(fab, peer, rq, &r)) {
    ibv_wc wc{};
    wc.wr_id = r.wr_id;
    wc.status = IBV_WC_WR_FLUSH_ERR;
    wc.opcode = IBV_WC_RECV;
    wc.qp_num = target->qpn.load(std::memory_order_relaxed);
    complete_to(fab, peer, target, rcq, wc, true);  // target is in ERR: an overrun drops it
  }
}

// ---- requests from linked peers ---------------------------------------------

void serve_request(Node &node, uint16_t from, const RecordHead &h, AnswerRecord *answer) {
  answer->head.type = kRecAnswer;
  answer->head.psn = h.psn;
  answer->status = IBV_WC_REM_INV_REQ_ERR;
  if (h.type != kRecAtomic || h.cells != 1) return;  // unknown: the requester hears nothing
  AtomicRecord r;
  memcpy(static_cast<void *>(&r), &h, sizeof r);
  answer->head.qpn = r.src_qpn;
  // The target QP, as on an HCA: there, connected to the requester, ready.
  AreaRoot *root = node.root();
  const QpShared &q = root->qps[r.head.qpn & (kMaxQps - 1)];
  uint32_t st = q.state.load(std::memory_order_acquire);
  if (q.qpn.load(std::memory_order_acquire) != r.head.qpn || q.type != IBV_QPT_RC ||
      (st != IBV_QPS_RTR && st != IBV_QPS_RTS && st != IBV_QPS_SQD) || q.dest_lid != from ||
      q.dest_qpn != r.src_qpn) {
    answer->status = kAnswerRetry;
    return;
  }
  MrShared mr;
  if (!(q.access & IBV_ACCESS_REMOTE_ATOMIC) ||
      !mr_check(root->mrs, r.rkey, true, q.pd, IBV_ACCESS_REMOTE_ATOMIC, r.addr, 8, &mr)) {
    answer->status = IBV_WC_REM_ACCESS_ERR;
    return;
  }
  if (r.addr & 7) return;  // REM_INV_REQ_ERR
  // This node's own memory: atomic against its CPU and every initiator,
  // which all come here.
  auto *at = reinterpret_cast<uint64_t *>(va_of(mr, r.addr));
  if (r.op == IBV_WR_ATOMIC_FETCH_AND_ADD) {
    answer->value = __atomic_fetch_add(at, r.compare_add, __ATOMIC_SEQ_CST);
  } else if (r.op == IBV_WR_ATOMIC_CMP_AND_SWP) {
    uint64_t expected = r.compare_add;
    __atomic_compare_exchange_n(at, &expected, r.swap, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    answer->value = expected;
  } else {
    return;  // REM_INV_REQ_ERR
  }
  answer->status = IBV_WC_SUCCESS;
}

}  // namespace pcientb::engine
