// What the target side of a transfer does, on its own node: receive queues
// (a QP's own and SRQs), key checks against its own MR table, the requests
// peers post to its lanes (SENDs, WRITEs with immediate, atomics, UD
// datagrams), delivery into posted receives and completions into its own
// CQs, and responder errors. Nothing here touches a peer's memory except to
// pull a large message from the requester's window (the DMA role).
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
}  // namespace

// ---- receive queues ------------------------------------------------------------

Off rq_create(Node &node, uint32_t capacity, uint32_t max_sge, uint32_t pd) {
  Off off = node.alloc(offsetof(RqShared, ring) + ring_bytes(capacity, recv_slot_size(max_sge)));
  if (!off) return 0;
  auto *rq = static_cast<RqShared *>(node.ptr(off));
  rq->max_sge = max_sge;
  rq->pd = pd;
  rq->async = EventFd{-1};
  ring_init(&rq->ring, capacity, recv_slot_size(max_sge));
  return off;
}

void rq_reset(RqShared *rq) {
  uint64_t base = rq->ring.tail.load(std::memory_order_relaxed);
  ring_reinit_at(&rq->ring, base);
  rq->released.store(base, std::memory_order_release);
}

int rq_post(RqShared *rq, uint32_t max_wr, const ibv_recv_wr *wr, ibv_recv_wr **bad) {
  RingHeader *r = &rq->ring;
  for (; wr; wr = wr->next) {
    if (wr->num_sge < 0 || static_cast<uint32_t>(wr->num_sge) > rq->max_sge) {
      *bad = const_cast<ibv_recv_wr *>(wr);
      return EINVAL;
    }
    // Full when max_wr WQEs are posted and not consumed.
    uint64_t pos = r->tail.load(std::memory_order_relaxed);
    bool vacant = pos - rq->released.load(std::memory_order_acquire) < max_wr;
    RingSlot *s = ring_slot(r, pos);
    if (!vacant || ring_seq(r, s, pos) != pos) {
      *bad = const_cast<ibv_recv_wr *>(wr);
      return ENOMEM;
    }
    auto *w = reinterpret_cast<RecvWqe *>(s);
    w->wr_id = wr->wr_id;
    w->num_sge = static_cast<uint32_t>(wr->num_sge);
    if (w->num_sge) memcpy(w->sge, wr->sg_list, sizeof(ibv_sge) * w->num_sge);
    ring_publish(r, s, pos);
    r->tail.store(pos + 1, std::memory_order_release);
  }
  return 0;
}

bool rq_take(Node &node, RqShared *rq, RecvCopy *out) {
  uint64_t pos;
  RingSlot *s = ring_take(&rq->ring, &pos);
  if (!s) return false;
  auto *w = reinterpret_cast<RecvWqe *>(s);
  out->wr_id = w->wr_id;
  out->num_sge = std::min(w->num_sge, kMaxSge);
  memcpy(out->sge, w->sge, sizeof(ibv_sge) * out->num_sge);
  ring_release(&rq->ring, s, pos);
  rq->released.fetch_add(1, std::memory_order_acq_rel);
  // SRQ limit: one event when the queue falls below it, then disarmed.
  uint32_t limit = rq->limit.load(std::memory_order_relaxed);
  if (limit && ring_count(&rq->ring) < limit && rq->limit.compare_exchange_strong(limit, 0)) {
    AsyncRecord rec{rq->handle, IBV_EVENT_SRQ_LIMIT_REACHED, 0};
    raise_event(node.fab(), rq->async, &rec, sizeof rec);
  }
  return true;
}

void rq_flush(Node &node, QpShared *qp) {
  auto *rq = static_cast<RqShared *>(node.ptr(qp->rq));
  auto *rcq = static_cast<CqShared *>(node.ptr(qp->rcq));
  if (!rcq) return;
  auto flushed = [&](uint64_t wr_id) {
    ibv_wc wc{};
    wc.wr_id = wr_id;
    wc.status = IBV_WC_WR_FLUSH_ERR;
    wc.opcode = IBV_WC_RECV;
    wc.qp_num = qp->qpn.load(std::memory_order_relaxed);
    complete_to(node, qp, rcq, wc, true);  // the QP is in ERR: an overrun drops it
  };
  if (qp->torn.exchange(0, std::memory_order_acquire)) flushed(qp->torn_wr_id);
  RecvCopy r;
  while (rq && rq_take(node, rq, &r)) flushed(r.wr_id);
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
  // Word by word: the owner (or a push into a mirror) may be changing them.
  auto word = [](const auto &f) { return __atomic_load_n(&f, __ATOMIC_RELAXED); };
  out->pd = word(e.pd);
  out->access = word(e.access);
  out->addr = word(e.addr);
  out->va = word(e.va);
  out->length = word(e.length);
  __atomic_load(&e.window, &out->window, __ATOMIC_RELAXED);
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

// ---- errors ------------------------------------------------------------------------

void qp_overran(Node &node, QpShared *qp) {
  uint32_t s = qp->state.load();
  while (s != IBV_QPS_ERR && s != IBV_QPS_RESET &&
         !qp->state.compare_exchange_weak(s, IBV_QPS_ERR)) {
  }
  if (s == IBV_QPS_ERR || s == IBV_QPS_RESET) return;  // failed already: one event
  node.push_qp(static_cast<uint32_t>(qp - node.root()->qps));
  AsyncRecord rec{qp->handle, IBV_EVENT_QP_FATAL, 0};
  raise_event(node.fab(), qp->async, &rec, sizeof rec);
  last_wqe_reached(node, qp);
}

void last_wqe_reached(Node &node, QpShared *qp) {
  if (!qp->srq) return;
  AsyncRecord rec{qp->handle, IBV_EVENT_QP_LAST_WQE_REACHED, 0};
  raise_event(node.fab(), qp->async, &rec, sizeof rec);
}

void fail_target(Node &node, QpShared *qp) {
  uint32_t s = qp->state.load();
  while (s != IBV_QPS_ERR && s != IBV_QPS_RESET &&
         !qp->state.compare_exchange_weak(s, IBV_QPS_ERR)) {
  }
  if (s == IBV_QPS_RESET) return;
  node.push_qp(static_cast<uint32_t>(qp - node.root()->qps));
  rq_flush(node, qp);
  if (s != IBV_QPS_ERR) last_wqe_reached(node, qp);
}

// ---- requests from linked peers ---------------------------------------------

namespace {

bool receiving(uint32_t st) {
  return st == IBV_QPS_RTR || st == IBV_QPS_RTS || st == IBV_QPS_SQD;
}

// Where a message lands in this node's memory, piece by piece.
struct Dest {
  uint8_t *ptr[kMaxSge];
  uint64_t len[kMaxSge];
  uint32_t n = 0;
};

// The bytes of a message as the record brings them: inline after it, or in
// pieces of the requester's windows.
struct Source {
  const uint8_t *inl = nullptr;
  const Piece *pieces = nullptr;
  uint32_t n = 0;
};

// Copies len bytes of src to dst, from byte `skip` of dst on.
fabric::MoveStatus place(fabric::Fabric &fab, fabric::Peer &from, const Dest &dst, uint64_t skip,
                         const Source &src, uint64_t len) {
  uint64_t done = 0;  // bytes of the message placed
  uint32_t p = 0;     // the piece of src being pulled, and where in it
  uint64_t poff = 0;
  for (uint32_t i = 0, pos = 0; i < dst.n && done < len; pos += dst.len[i], ++i) {
    uint64_t at = skip > pos ? std::min<uint64_t>(skip - pos, dst.len[i]) : 0;
    while (at < dst.len[i] && done < len) {
      uint64_t n = std::min(dst.len[i] - at, len - done);
      if (src.inl) {
        memcpy(dst.ptr[i] + at, src.inl + done, n);
      } else {
        while (p < src.n && poff == src.pieces[p].len) {
          ++p;
          poff = 0;
        }
        if (p == src.n) return fabric::MoveStatus::bad_window;  // checked: not reached
        n = std::min(n, src.pieces[p].len - poff);
        auto s = fab.read(from, src.pieces[p].window, src.pieces[p].va + poff, dst.ptr[i] + at, n);
        if (s != fabric::MoveStatus::ok) return s;
        poff += n;
      }
      at += n;
      done += n;
    }
  }
  return fabric::MoveStatus::ok;
}

// A receive's pieces as destinations; false (with the receive's status) when
// it cannot take need bytes: nothing moves into a receive that fails.
ibv_wc_status receive_dest(AreaRoot *root, uint32_t pd, const RecvCopy &r, uint64_t need, Dest *d) {
  MrShared mrs[kMaxSge];
  uint64_t room;
  if (!receive_room(root, pd, r.sge, r.num_sge, mrs, &room)) return IBV_WC_LOC_PROT_ERR;
  if (room < need) return IBV_WC_LOC_LEN_ERR;
  for (uint32_t i = 0; i < r.num_sge; ++i) {
    d->ptr[i] =
        r.sge[i].length ? reinterpret_cast<uint8_t *>(va_of(mrs[i], r.sge[i].addr)) : nullptr;
    d->len[i] = r.sge[i].length;
  }
  d->n = r.num_sge;
  return IBV_WC_SUCCESS;
}

// The source of a message of byte_len bytes whose record has `room` bytes
// after its fixed part; false when the record contradicts itself.
bool source_of(const uint8_t *after, size_t room, uint32_t pieces, uint64_t byte_len, Source *src) {
  if (!pieces) {
    src->inl = after;
    return byte_len <= room;
  }
  if (pieces > kMaxSge + 1 || pieces * sizeof(Piece) > room) return false;
  src->pieces = reinterpret_cast<const Piece *>(after);
  src->n = pieces;
  uint64_t sum = 0;
  for (uint32_t i = 0; i < pieces; ++i) sum += src->pieces[i].len;
  return sum == byte_len;
}

Qp *receiver(Node &node, uint32_t qpn) {
  Qp *t = node.qp_by_idx(qpn & (kMaxQps - 1));
  return t && t->sh->qpn.load(std::memory_order_acquire) == qpn ? t : nullptr;
}

RqShared *receive_queue(Qp *t) {
  return t->srq ? t->srq->sh : t->rq;
}

// Claims and fills the receive completion wc of QP t (its QP fails if the
// CQ overran).
void receipt(Qp *t, const ibv_wc &wc, bool solicited, Receipt *out) {
  out->qp = t->sh;
  out->cq = t->rcq->sh;
  out->wc = wc;
  out->solicited = solicited;
}

// The requester died, or its window went, while the bytes of its message
// were pulled: as on an HCA, whose responder waits for the rest of such a
// message, nothing completes and the QP goes on; the receive stays taken
// until the QP fails (rq_flush).
void tear(Qp *t, const RecvCopy &r) {
  t->sh->torn_wr_id = r.wr_id;
  t->sh->torn.store(1, std::memory_order_release);
}

void serve_send(Node &node, fabric::Peer &from, Qp *t, const SendRecord &r, uint64_t remote_addr,
                const uint8_t *after, size_t room, const RecordHead &lane, AnswerRecord *answer,
                Receipt *out) {
  answer->status = IBV_WC_REM_INV_REQ_ERR;
  const bool write_imm = r.opcode == IBV_WR_RDMA_WRITE_WITH_IMM;
  // The requester wrote the bytes of a WRITE before this record: only the receive is taken.
  const bool placed = write_imm && r.pieces == kPiecesPlaced;
  Source src;
  if ((!write_imm && r.opcode != IBV_WR_SEND && r.opcode != IBV_WR_SEND_WITH_IMM) ||
      r.byte_len > (1u << 31) || (!placed && !source_of(after, room, r.pieces, r.byte_len, &src)))
    return;
  if (src.pieces && r.head.psn == 0) {
    // Withdrawn by its requester before we came to it: nothing is pulled or
    // answered, and the connection's later requests are dropped (RC order).
    answer->status = kAnswerNone;
    return;
  }
  AreaRoot *root = node.root();
  MrShared mr;
  if (write_imm && r.byte_len &&
      (!(t->sh->access & IBV_ACCESS_REMOTE_WRITE) ||
       !mr_check(root->mrs, r.rkey, true, t->sh->pd, IBV_ACCESS_REMOTE_WRITE, remote_addr,
                 r.byte_len, &mr))) {
    answer->status = IBV_WC_REM_ACCESS_ERR;
    return;
  }
  RecvCopy wqe;
  if (!rq_take(node, receive_queue(t), &wqe)) {
    // Receiver not ready: the requester tries again after the timer.
    answer->status = kAnswerRnr;
    answer->value = t->sh->min_rnr_timer;
    return;
  }
  ibv_wc wc{};
  wc.wr_id = wqe.wr_id;
  wc.opcode = write_imm ? IBV_WC_RECV_RDMA_WITH_IMM : IBV_WC_RECV;
  wc.byte_len = r.byte_len;
  wc.qp_num = r.head.qpn;
  wc.src_qp = r.head.src_qpn;
  wc.slid = from.lid();
  if (r.opcode != IBV_WR_SEND) {
    wc.imm_data = r.imm;
    wc.wc_flags = IBV_WC_WITH_IMM;
  }
  Dest dst;
  if (write_imm) {
    dst.ptr[0] = reinterpret_cast<uint8_t *>(va_of(mr, remote_addr));
    dst.len[0] = r.byte_len;
    dst.n = r.byte_len ? 1 : 0;
  } else if ((wc.status = receive_dest(root, receive_queue(t)->pd, wqe, r.byte_len, &dst)) !=
             IBV_WC_SUCCESS) {
    // The responder completes the receive in error and its QP fails; the
    // requester is told its request was invalid.
    answer->status = wc.status == IBV_WC_LOC_LEN_ERR ? IBV_WC_REM_INV_REQ_ERR : IBV_WC_REM_OP_ERR;
    wc.byte_len = 0;
    receipt(t, wc, true, out);
    out->fail = true;
    return;
  }
  if (!placed && place(node.fab(), from, dst, 0, src, r.byte_len) != fabric::MoveStatus::ok) {
    tear(t, wqe);
    answer->status = IBV_WC_LOC_PROT_ERR;  // a requester that lives: its memory went
    return;
  }
  if (src.pieces) {
    // The requester withdrew the WR (destroyed, reset or failed its QP) while
    // its bytes were pulled: some may be what its program wrote there since.
    // As a message whose requester died: nothing completes; the receive stays
    // taken until the QP fails. The void lands before the program's stores
    // (posts of one thread in order; a read completion does not pass a
    // posted write): bytes read after them mean the void is seen here.
    std::atomic_thread_fence(std::memory_order_acquire);
    if (__atomic_load_n(&lane.psn, __ATOMIC_RELAXED) != r.head.psn) {
      tear(t, wqe);
      answer->status = kAnswerNone;
      return;
    }
  }
  receipt(t, wc, r.solicited, out);
  answer->status = IBV_WC_SUCCESS;
}

// Unreliable: whatever does not fit is lost, and nobody is told.
void serve_datagram(Node &node, fabric::Peer &from, const DatagramRecord &r, const uint8_t *after,
                    size_t room, Receipt *out) {
  Qp *t = receiver(node, r.head.qpn);
  if (!t || t->sh->type != IBV_QPT_UD || !receiving(t->sh->state.load(std::memory_order_acquire)) ||
      t->sh->qkey != r.qkey || r.byte_len > kMtu || r.byte_len > room)
    return;
  RecvCopy wqe;
  if (!rq_take(node, receive_queue(t), &wqe)) return;
  ibv_wc wc{};
  wc.wr_id = wqe.wr_id;
  wc.opcode = IBV_WC_RECV;
  wc.byte_len = r.byte_len + kGrhBytes;
  wc.qp_num = r.head.qpn;
  wc.src_qp = r.head.src_qpn;
  wc.slid = from.lid();
  if (r.flags & kDgImm) {
    wc.imm_data = r.imm;
    wc.wc_flags |= IBV_WC_WITH_IMM;
  }
  Dest dst;
  RqShared *rq = receive_queue(t);
  wc.status = receive_dest(node.root(), rq->pd, wqe, wc.byte_len, &dst);
  if (wc.status == IBV_WC_SUCCESS) {
    Source grh, body;
    grh.inl = r.grh;
    body.inl = after;
    if (r.flags & kDgGrh) {
      place(node.fab(), from, dst, 0, grh, kGrhBytes);
      wc.wc_flags |= IBV_WC_GRH;
    }
    place(node.fab(), from, dst, kGrhBytes, body, r.byte_len);
  } else {
    wc.byte_len = 0;
  }
  receipt(t, wc, r.solicited, out);
}

void serve_atomic(Node &node, Qp *t, const AtomicRecord &r, AnswerRecord *answer) {
  MrShared mr;
  if (!(t->sh->access & IBV_ACCESS_REMOTE_ATOMIC) ||
      !mr_check(node.root()->mrs, r.rkey, true, t->sh->pd, IBV_ACCESS_REMOTE_ATOMIC, r.addr, 8,
                &mr)) {
    answer->status = IBV_WC_REM_ACCESS_ERR;
    return;
  }
  answer->status = IBV_WC_REM_INV_REQ_ERR;
  if (r.addr & 7) return;
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
    return;
  }
  answer->status = IBV_WC_SUCCESS;
}

// The target QP of a request, as on an HCA: there, RC, ready, connected to
// the requester; nullptr if not.
Qp *connected(Node &node, fabric::Peer &from, const RecordHead &h) {
  Qp *t = receiver(node, h.qpn);
  if (!t || t->sh->type != IBV_QPT_RC || !receiving(t->sh->state.load(std::memory_order_acquire)) ||
      t->sh->dest_lid != from.lid() || t->sh->dest_qpn != h.src_qpn)
    return nullptr;
  return t;
}

// Whether a request of the connection is dropped: after refusing one (RNR,
// or an error that fails the requester's QP), the target takes nothing more
// of that connection until the refused PSN comes again (go-back after an
// RNR; never, after an error). A new connection (epoch) starts afresh.
bool dropped(Qp *t, const RecordHead &h) {
  uint64_t resume = t->resume.load(std::memory_order_relaxed);
  if (!resume) return false;
  if (static_cast<uint32_t>(resume >> 32) == h.epoch && static_cast<uint32_t>(resume) != h.psn)
    return true;
  t->resume.store(0, std::memory_order_relaxed);
  return false;
}

// Serves a request of an RC connection, in the connection's order.
template <typename Serve>
bool serve_in_order(Node &node, fabric::Peer &from, const RecordHead &h, AnswerRecord *answer,
                    Serve &&serve) {
  answer->head.psn = h.psn;
  answer->head.qpn = h.src_qpn;
  Qp *t = connected(node, from, h);
  if (!t) {
    // The connection's QP not ready now: its later requests are dropped too
    // (one served after this refusal would arrive out of order).
    if (Qp *q = receiver(node, h.qpn); q && q->sh->type == IBV_QPT_RC &&
                                       q->sh->dest_lid == from.lid() &&
                                       q->sh->dest_qpn == h.src_qpn)
      q->resume.store(uint64_t{h.epoch} << 32 | h.psn, std::memory_order_relaxed);
    answer->status = kAnswerRetry;
    return true;
  }
  if (dropped(t, h)) return false;
  serve(t);
  // Withdrawn (kAnswerNone) too: the connection's later requests are dropped,
  // so that it tears one receive at most.
  if (answer->status != IBV_WC_SUCCESS)
    t->resume.store(uint64_t{h.epoch} << 32 | h.psn, std::memory_order_relaxed);
  return answer->status != kAnswerNone;
}

}  // namespace

void receipt_claim(Node &node, Receipt &r) {
  if (!r.qp) return;
  r.slot = cq_claim(node.fab(), r.cq, &r.pos);
  if (!r.slot) qp_overran(node, r.qp);
}

void receipt_publish(Node &node, const Receipt &r) {
  if (!r.qp) return;
  if (r.slot) {
    r.slot->wc = r.wc;
    r.slot->sq_ticket = 0;
    cq_commit(node.fab(), r.cq, r.pos, r.solicited);
  }
  if (r.fail) fail_target(node, r.qp);
}

void commit_receipt(Node &node, Receipt &r) {
  receipt_claim(node, r);
  receipt_publish(node, r);
}

bool serve_request(Node &node, fabric::Peer &from, const RecordHead &h, uint16_t cells,
                   AnswerRecord *answer, Receipt *receipt) {
  // The record is copied before it is looked at: the requester may write
  // its lane meanwhile (it hurts only itself), and what was checked stays.
  const size_t size = size_t{cells} * kCell;
  const auto *bytes = reinterpret_cast<const uint8_t *>(&h);
  answer->head.type = kRecAnswer;
  switch (h.type) {
    case kRecSend: {
      SendRecord r;
      if (size < sizeof r) return false;
      memcpy(static_cast<void *>(&r), bytes, sizeof r);
      const size_t header = sizeof r + send_extra(r.opcode);
      if (size < header) return false;
      uint64_t remote_addr = 0;
      memcpy(&remote_addr, bytes + sizeof r, header - sizeof r);
      return serve_in_order(node, from, r.head, answer, [&](Qp *t) {
        serve_send(node, from, t, r, remote_addr, bytes + header, size - header, h, answer,
                   receipt);
      });
    }
    case kRecAtomic: {
      AtomicRecord r;
      if (size < sizeof r) return false;
      memcpy(static_cast<void *>(&r), bytes, sizeof r);
      return serve_in_order(node, from, r.head, answer,
                            [&](Qp *t) { serve_atomic(node, t, r, answer); });
    }
    case kRecDatagram: {
      DatagramRecord r;
      if (size < sizeof r) return false;
      memcpy(static_cast<void *>(&r), bytes, sizeof r);
      serve_datagram(node, from, r, bytes + sizeof r, size - sizeof r, receipt);
      return false;
    }
    default:
      return false;  // not a request: the requester hears nothing
  }
}

}  // namespace pcientb::engine
