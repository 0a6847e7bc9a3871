// The target side of a transfer, shared by requester.cpp, qp.cpp, srq.cpp
// and cq.cpp: a node's own receive queues, key checks, completions into its
// own CQs, and the execution of the requests peers post to its lanes.
#pragma once

#include <algorithm>
#include <memory>

#include "engine/engine.hpp"

namespace pcientb::engine {

// A receive WQE as taken off a receive queue.
struct RecvCopy {
  uint64_t wr_id;
  uint32_t num_sge;
  ibv_sge sge[kMaxSge];
};

// The bytes of a message at the requester, piece by piece, with the window
// each piece lies in (none for inline data).
struct Gather {
  const uint8_t *ptr[kMaxSge + 1];
  uint64_t len[kMaxSge + 1];
  // Filled as far as n, not zeroed up front (a small SEND's post paid for that).
  struct Windows {
    union {
      fabric::WindowId v[kMaxSge + 1];
    };
    Windows() {}
    void set(size_t i, fabric::WindowId w) { std::construct_at(&v[i], w); }
    const fabric::WindowId &operator[](size_t i) const { return v[i]; }
  } win;
  uint32_t n = 0;
};

Off rq_create(Node &node, uint32_t capacity, uint32_t max_sge, uint32_t pd);
// Drops every WQE; positions go on from where they were.
void rq_reset(RqShared *rq);
// The owner posts (one thread at a time); at most max_wr WQEs not consumed.
int rq_post(RqShared *rq, uint32_t max_wr, const ibv_recv_wr *wr, ibv_recv_wr **bad);
// Takes the next receive WQE of one of this node's queues; raises the SRQ
// limit event when that is due.
bool rq_take(Node &node, RqShared *rq, RecvCopy *out);
// Completes every WQE left on a QP's own receive queue with a flush error.
void rq_flush(Node &node, QpShared *qp);

// Whether key names a live MR of `pd` in `table` (a node's own, or its
// mirror of a peer's) that grants `need` over [addr, addr+len); copies the
// entry to *out.
bool mr_check(const MrShared *table, uint32_t key, bool remote, uint32_t pd, uint32_t need,
              uint64_t addr, uint64_t len, MrShared *out);

// A consistent copy of a mirrored QP entry; false when none could be taken
// (the owner died in the middle of a push).
struct QpView {
  uint32_t qpn, state, type, pd, access, dest_qpn, dest_lid;
};
bool read_qp(const QpMirror &m, QpView *out);

// Adds a completion of this node's QP qp to its CQ cq, filled in place by
// fill(CqEntry &). An HCA that cannot write a completion (the CQ overran)
// fails the QP and tells its owner: QP_FATAL.
void qp_overran(Node &node, QpShared *qp);
template <typename Fill>
void complete_with(Node &node, QpShared *qp, CqShared *cq, bool solicited, Fill &&fill) {
  uint64_t pos;
  CqEntry *e = cq_claim(node.fab(), cq, &pos);
  if (!e) {
    qp_overran(node, qp);
    return;
  }
  fill(*e);
  cq_commit(node.fab(), cq, pos, solicited);
}
inline void complete_to(Node &node, QpShared *qp, CqShared *cq, const ibv_wc &wc, bool solicited) {
  complete_with(node, qp, cq, solicited, [&](CqEntry &e) {
    e.wc = wc;
    e.sq_ticket = 0;
  });
}

// The responder fails: the QP to ERR, its receive queue flushed, its peers'
// mirrors told.
void fail_target(Node &node, QpShared *qp);
// A QP that takes its receives from an SRQ has just entered ERR: no more are
// consumed for it, and its owner learns so (IBV_EVENT_QP_LAST_WQE_REACHED:
// applications wait for it before destroying the QP).
void last_wqe_reached(Node &node, QpShared *qp);

// The receive completion a served request makes, not added yet: its answer
// goes first (a program that sees the receive and replies must not overtake
// the answer), then commit_receipt adds it. Not claimed while requests are
// served: a claimed slot not yet published hides later entries of the CQ
// from its poller (receipt_claim comes just before the answer goes).
struct Receipt {
  QpShared *qp = nullptr;  // nullptr: none
  CqShared *cq = nullptr;
  ibv_wc wc;
  bool solicited = false;
  bool fail = false;        // a responder error: the QP fails once it is added
  CqEntry *slot = nullptr;  // claimed (receipt_claim), not published yet
  uint64_t pos = 0;
};
void commit_receipt(Node &node, Receipt &r);
// commit_receipt in two steps: the CQ slot claimed (a locked instruction)
// before the answer's stores, published after them, so that no locked
// instruction waits for those stores to reach the requester.
void receipt_claim(Node &node, Receipt &r);
void receipt_publish(Node &node, const Receipt &r);

// Executes a request a peer (`from`) posted to this node's lane: the record
// of `cells` cells at h (checked to lie in the lane; h->cells is not read). Fills in the answer and
// returns whether one is due (datagrams, requests dropped while the QP goes back for a PSN, and
// records that make no sense are not answered), and the receive completion it made.
bool serve_request(Node &node, fabric::Peer &from, const RecordHead &h, uint16_t cells,
                   AnswerRecord *answer, Receipt *receipt);

}  // namespace pcientb::engine
