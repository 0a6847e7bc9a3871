// The ibv_wr_* send API (ibv_qp_ex): WRs built between wr_start and
// wr_complete, posted together through the engine.
#include <cerrno>
#include <cstring>

#include "glue/glue.hpp"

namespace pcientb::glue {
namespace {

using engine::SendWqe;

GlueQp *of(ibv_qp_ex *q) {
  return reinterpret_cast<GlueQp *>(q);
}

SendWqe *current(ibv_qp_ex *q) {
  GlueQp *g = of(q);
  if (!g->batch || g->batch->empty()) {
    g->batch_err = EINVAL;
    return nullptr;
  }
  return &g->batch->back();
}

// Starts the next WR with the wr_id and flags the caller set on the QP.
SendWqe *begin(ibv_qp_ex *q, ibv_wr_opcode op) {
  GlueQp *g = of(q);
  if (!g->batch) {
    g->batch_err = EINVAL;
    return nullptr;
  }
  SendWqe &w = g->batch->emplace_back();
  w.wr_id = q->wr_id;
  w.opcode = op;
  w.flags = q->wr_flags;
  w.imm = 0;
  w.num_sge = 0;
  w.ah = nullptr;
  w.remote_addr = 0;
  w.rkey = 0;
  w.compare_add = w.swap = 0;
  w.remote_qpn = w.remote_qkey = 0;
  return &w;
}

void wr_start(ibv_qp_ex *q) {
  GlueQp *g = of(q);
  if (!g->batch) g->batch = new std::vector<SendWqe>();
  g->batch->clear();
  g->batch_err = 0;
}

// The batch goes as a whole or not at all: EINVAL when a WR breaks a rule of
// ibv_post_send (engine::check_wqe) or was built wrong, ENOMEM when the send
// queue has no room for all of it.
int wr_complete(ibv_qp_ex *q) {
  GlueQp *g = of(q);
  if (!g->batch) return EINVAL;
  int err = g->batch_err;
  for (const SendWqe &w : *g->batch) {
    if (err) break;
    err = engine::check_wqe(g->qp, w);
  }
  if (!err) err = engine::post_wqes(g->qp, g->batch->data(), g->batch->size());
  g->batch->clear();
  return err;
}

void wr_abort(ibv_qp_ex *q) {
  if (of(q)->batch) of(q)->batch->clear();
}

void wr_send(ibv_qp_ex *q) {
  begin(q, IBV_WR_SEND);
}
void wr_send_imm(ibv_qp_ex *q, __be32 imm) {
  if (SendWqe *w = begin(q, IBV_WR_SEND_WITH_IMM)) w->imm = imm;
}
void wr_rdma_write(ibv_qp_ex *q, uint32_t rkey, uint64_t addr) {
  if (SendWqe *w = begin(q, IBV_WR_RDMA_WRITE)) {
    w->rkey = rkey;
    w->remote_addr = addr;
  }
}
void wr_rdma_write_imm(ibv_qp_ex *q, uint32_t rkey, uint64_t addr, __be32 imm) {
  if (SendWqe *w = begin(q, IBV_WR_RDMA_WRITE_WITH_IMM)) {
    w->rkey = rkey;
    w->remote_addr = addr;
    w->imm = imm;
  }
}
void wr_rdma_read(ibv_qp_ex *q, uint32_t rkey, uint64_t addr) {
  if (SendWqe *w = begin(q, IBV_WR_RDMA_READ)) {
    w->rkey = rkey;
    w->remote_addr = addr;
  }
}
void wr_atomic_cmp_swp(ibv_qp_ex *q, uint32_t rkey, uint64_t addr, uint64_t compare,
                       uint64_t swap) {
  if (SendWqe *w = begin(q, IBV_WR_ATOMIC_CMP_AND_SWP)) {
    w->rkey = rkey;
    w->remote_addr = addr;
    w->compare_add = compare;
    w->swap = swap;
  }
}
void wr_atomic_fetch_add(ibv_qp_ex *q, uint32_t rkey, uint64_t addr, uint64_t add) {
  if (SendWqe *w = begin(q, IBV_WR_ATOMIC_FETCH_AND_ADD)) {
    w->rkey = rkey;
    w->remote_addr = addr;
    w->compare_add = add;
  }
}

void wr_set_ud_addr(ibv_qp_ex *q, ibv_ah *ah, uint32_t remote_qpn, uint32_t remote_qkey) {
  if (SendWqe *w = current(q)) {
    w->ah = engine::from_ibv<engine::Ah>(ah);
    w->remote_qpn = remote_qpn;
    w->remote_qkey = remote_qkey;
  }
}

// The WR's data come from SGEs: the last setter of the data wins, inline
// data set before included.
void use_sges(ibv_qp_ex *q, SendWqe *w) {
  w->holds_inline = false;
  w->flags = (w->flags & ~IBV_SEND_INLINE) | (q->wr_flags & IBV_SEND_INLINE);
}

void wr_set_sge(ibv_qp_ex *q, uint32_t lkey, uint64_t addr, uint32_t length) {
  if (SendWqe *w = current(q)) {
    use_sges(q, w);
    w->num_sge = 1;
    w->sge[0] = ibv_sge{addr, length, lkey};
  }
}

void wr_set_sge_list(ibv_qp_ex *q, size_t n, const ibv_sge *list) {
  SendWqe *w = current(q);
  if (!w) return;
  use_sges(q, w);
  if (n > engine::kMaxSge) {
    of(q)->batch_err = EINVAL;
    return;
  }
  w->num_sge = static_cast<uint32_t>(n);
  if (n) memcpy(w->sge, list, n * sizeof(ibv_sge));
}

// Inline data is copied now: the caller may reuse its buffer on return.
void wr_set_inline_data_list(ibv_qp_ex *q, size_t n, const ibv_data_buf *bufs) {
  SendWqe *w = current(q);
  if (!w) return;
  w->hold_inline(bufs, n);
}

void wr_set_inline_data(ibv_qp_ex *q, void *addr, size_t length) {
  ibv_data_buf buf{addr, length};
  wr_set_inline_data_list(q, 1, &buf);
}

}  // namespace

void init_qp_ex(GlueQp *g, uint64_t ops) {
  ibv_qp_ex &q = g->vqp.qp_ex;
  q.wr_start = wr_start;
  q.wr_complete = wr_complete;
  q.wr_abort = wr_abort;
  if (ops & IBV_QP_EX_WITH_SEND) q.wr_send = wr_send;
  if (ops & IBV_QP_EX_WITH_SEND_WITH_IMM) q.wr_send_imm = wr_send_imm;
  if (ops & IBV_QP_EX_WITH_RDMA_WRITE) q.wr_rdma_write = wr_rdma_write;
  if (ops & IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM) q.wr_rdma_write_imm = wr_rdma_write_imm;
  if (ops & IBV_QP_EX_WITH_RDMA_READ) q.wr_rdma_read = wr_rdma_read;
  if (ops & IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP) q.wr_atomic_cmp_swp = wr_atomic_cmp_swp;
  if (ops & IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD) q.wr_atomic_fetch_add = wr_atomic_fetch_add;
  q.wr_set_ud_addr = wr_set_ud_addr;
  q.wr_set_sge = wr_set_sge;
  q.wr_set_sge_list = wr_set_sge_list;
  q.wr_set_inline_data = wr_set_inline_data;
  q.wr_set_inline_data_list = wr_set_inline_data_list;
}

}  // namespace pcientb::glue
