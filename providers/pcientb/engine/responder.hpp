// The target side of a transfer, shared by requester.cpp, qp.cpp and srq.cpp.
#pragma once

#include <algorithm>

#include "engine/engine.hpp"

namespace pcientb::engine {

// A receive WQE as taken off a receive queue.
struct RecvCopy {
  uint64_t wr_id;
  uint32_t num_sge;
  ibv_sge sge[kMaxSge];
};

// The bytes of a message at the requester, piece by piece.
struct Gather {
  const uint8_t *ptr[kMaxSge + 1];
  uint64_t len[kMaxSge + 1];
  uint32_t n = 0;
};

Off rq_create(Node &node, uint32_t capacity, uint32_t max_sge, uint32_t pd);
// Drops every WQE; positions go on from where they were (see RqView).
void rq_reset(RqShared *rq);
// The owner posts (one thread at a time); at most max_wr WQEs not consumed.
int rq_post(AreaRoot *root, RqShared *rq, uint32_t max_wr, const ibv_recv_wr *wr,
            ibv_recv_wr **bad);
// Frees the WQE at pos, taken by an eager message that will not be delivered
// (its QP was reset or destroyed); the owner's side.
void rq_give_back(RqShared *rq, uint64_t pos);
// The receive at pos was reserved by a node that died before announcing the
// message: it is posted again (wr_id and buffers kept) and its slot released,
// unless it was consumed meanwhile. With the owner's posting lock.
void rq_reclaim(AreaRoot *root, RqShared *rq, uint32_t max_wr, uint64_t pos);
// Takes the next receive WQE of a (possibly remote) queue; raises the SRQ
// limit event of its owner when that is due.
bool rq_take(fabric::Fabric &fab, fabric::Peer &owner, RqShared *rq, RecvCopy *out);

enum class Reserve { ok, empty, unfit };
// Reserves the next receive WQE of a (possibly remote) queue without reading
// it, for an eager SEND of class cls (or, cls < 0, a WRITE with immediate,
// which needs no room): the receiver's poll consumes it. `empty` is an RNR;
// `unfit` leaves the WQE to rq_take.
Reserve rq_reserve(fabric::Fabric &fab, fabric::Peer &owner, QpShared *target, RqShared *rq,
                   RqView *view, int cls, uint64_t *pos_out);
// Completes every WQE left on a QP's own receive queue with a flush error.
void rq_flush(fabric::Fabric &fab, fabric::Peer &peer, QpShared *target);

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

// Places `len` bytes from src into the receive r of `peer`, after `skip`
// bytes (the GRH of UD). Returns the responder's status.
ibv_wc_status scatter(fabric::Fabric &fab, fabric::Peer &peer, AreaRoot *root, uint32_t pd,
                      const RecvCopy &r, uint64_t skip, const Gather &src, uint64_t len);

// Adds a completion of QP qp (of `owner`) to cq, filled in place by
// fill(CqEntry &). An HCA that cannot write a completion (the CQ overran)
// fails the QP and tells its owner: QP_FATAL.
//
// A message for a peer's QP passes that QP's number as `qpn`: once the slot
// is claimed, a QP with another number there means it was destroyed since
// the sender's checks, and the slot is published void (false: the message did
// not arrive). A destroy after that point finds the entry: cq_discard_qp
// waits for every slot claimed before it took the QP's number away.
void qp_overran(fabric::Fabric &fab, fabric::Peer &owner, QpShared *qp);
template <typename Fill>
bool complete_with(fabric::Fabric &fab, fabric::Peer &owner, QpShared *qp, CqShared *cq,
                   bool solicited, Fill &&fill, uint32_t qpn = 0) {
  if (!cq) return true;
  uint64_t pos;
  CqEntry *e = cq_claim(fab, owner, cq, &pos);
  if (!e) {
    qp_overran(fab, owner, qp);
    return true;
  }
  if (owner.lid() != fab.lid()) {  // a peer's CQ: say who holds the slot
    e->wc.wr_id = fab.nonce();
    e->sq_ticket = CqEntry::kClaimed;
  }
  // seq_cst, as the claim (mpsc_reserve) and Node::retire_qp's store: a
  // destroy either sees this claim or this load sees the number gone.
  if (qpn && qp->qpn.load(std::memory_order_seq_cst) != qpn) {
    cq_void(cq, pos);
    return false;
  }
  fill(*e);
  cq_commit(fab, owner, cq, pos, solicited);
  return true;
}
inline bool complete_to(fabric::Fabric &fab, fabric::Peer &owner, QpShared *qp, CqShared *cq,
                        const ibv_wc &wc, bool solicited, uint32_t qpn = 0) {
  return complete_with(
      fab, owner, qp, cq, solicited,
      [&](CqEntry &e) {
        e.wc = wc;
        e.sq_ticket = 0;
      },
      qpn);
}

// A responder-side error: completes wc on the target's receive CQ, moves the
// target QP to ERR and flushes its receive queue.
void responder_error(fabric::Fabric &fab, fabric::Peer &peer, QpShared *target, const ibv_wc &wc);
// The second half of that: the target QP to ERR, its receive queue flushed.
void fail_target(fabric::Fabric &fab, fabric::Peer &peer, QpShared *target);
// A QP that takes its receives from an SRQ has just entered ERR: no more are
// consumed for it, and its owner learns so (IBV_EVENT_QP_LAST_WQE_REACHED:
// applications wait for it before destroying the QP).
void last_wqe_reached(fabric::Fabric &fab, fabric::Peer &owner, QpShared *qp);

// At the receiver's poll: the completion of an eager entry of this node,
// with its WQE consumed and its bytes placed. False when the entry is void
// (its QP was destroyed or reset since); a WQE it took from the SRQ at
// offset `srq` (0: none) then goes back.
bool deliver_eager(Node &node, const EagerRecv &e, Off srq, ibv_wc *wc);

}  // namespace pcientb::engine
