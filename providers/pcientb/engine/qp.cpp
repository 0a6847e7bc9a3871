// Queue pairs: creation, the state machine with IB's attribute-mask rules,
// query, destruction and posting receives.
#include <cerrno>
#include <cstring>

#include "engine/responder.hpp"

namespace pcientb::engine {
namespace {

// As an HCA's reset or destroy: the QP's completions not yet polled are gone.
void discard_completions(Qp *qp) {
  cq_discard_qp(qp->scq, qp->ibv->qp_num);
  if (qp->rcq != qp->scq) cq_discard_qp(qp->rcq, qp->ibv->qp_num);
}

// Required and optional attributes of each transition (IBA 11.2.4.2, as the
// kernel's ib_modify_qp_is_ok has them), for RC and UD.
struct Rule {
  bool allowed;
  int req_rc, opt_rc, req_ud, opt_ud;
};
constexpr int kRcPath =
    IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS | IBV_QP_MIN_RNR_TIMER | IBV_QP_PATH_MIG_STATE;
constexpr int N = IBV_QPS_ERR + 1;
struct RuleTable {
  Rule at[N][N]{};
};
constexpr RuleTable make_rules() {
  RuleTable t{};
  auto set = [&t](int from, int to, int req_rc, int opt_rc, int req_ud, int opt_ud) {
    t.at[from][to] = Rule{true, req_rc, opt_rc, req_ud, opt_ud};
  };
  for (int s = IBV_QPS_RESET; s <= IBV_QPS_ERR; ++s) {
    set(s, IBV_QPS_RESET, 0, 0, 0, 0);
    set(s, IBV_QPS_ERR, 0, 0, 0, 0);
  }
  set(IBV_QPS_RESET, IBV_QPS_INIT, IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, 0,
      IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY, 0);
  set(IBV_QPS_INIT, IBV_QPS_INIT, 0, IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, 0,
      IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY);
  set(IBV_QPS_INIT, IBV_QPS_RTR,
      IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
          IBV_QP_MIN_RNR_TIMER,
      IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS | IBV_QP_PKEY_INDEX, 0,
      IBV_QP_PKEY_INDEX | IBV_QP_QKEY);
  set(IBV_QPS_RTR, IBV_QPS_RTS,
      IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
          IBV_QP_MAX_QP_RD_ATOMIC,
      IBV_QP_CUR_STATE | kRcPath, IBV_QP_SQ_PSN, IBV_QP_CUR_STATE | IBV_QP_QKEY);
  set(IBV_QPS_RTS, IBV_QPS_RTS, 0, IBV_QP_CUR_STATE | kRcPath, 0, IBV_QP_CUR_STATE | IBV_QP_QKEY);
  set(IBV_QPS_RTS, IBV_QPS_SQD, 0, IBV_QP_EN_SQD_ASYNC_NOTIFY, 0, IBV_QP_EN_SQD_ASYNC_NOTIFY);
  set(IBV_QPS_SQD, IBV_QPS_RTS, 0, IBV_QP_CUR_STATE | kRcPath, 0, IBV_QP_CUR_STATE | IBV_QP_QKEY);
  set(IBV_QPS_SQD, IBV_QPS_SQD, 0,
      IBV_QP_AV | IBV_QP_PKEY_INDEX | kRcPath | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
          IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC | IBV_QP_MAX_DEST_RD_ATOMIC,
      0, IBV_QP_PKEY_INDEX | IBV_QP_QKEY);
  set(IBV_QPS_SQE, IBV_QPS_RTS, 0, 0, 0, IBV_QP_CUR_STATE | IBV_QP_QKEY);  // UD only
  return t;
}
constexpr RuleTable kRules = make_rules();

bool values_ok(const ibv_qp_attr *a, int mask) {
  constexpr int kAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                          IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
  if ((mask & IBV_QP_PORT) && a->port_num != 1) return false;
  if ((mask & IBV_QP_PKEY_INDEX) && a->pkey_index != 0) return false;
  if ((mask & IBV_QP_ACCESS_FLAGS) && (a->qp_access_flags & ~kAccess)) return false;
  if ((mask & IBV_QP_PATH_MTU) && (a->path_mtu < IBV_MTU_256 || a->path_mtu > IBV_MTU_4096))
    return false;
  if ((mask & IBV_QP_MAX_QP_RD_ATOMIC) && a->max_rd_atomic > kMaxRdAtom) return false;
  if ((mask & IBV_QP_MAX_DEST_RD_ATOMIC) && a->max_dest_rd_atomic > kMaxRdAtom) return false;
  if ((mask & IBV_QP_DEST_QPN) && a->dest_qp_num > 0xffffff) return false;
  if ((mask & IBV_QP_TIMEOUT) && a->timeout > 31) return false;
  if ((mask & IBV_QP_RETRY_CNT) && a->retry_cnt > 7) return false;
  if ((mask & IBV_QP_RNR_RETRY) && a->rnr_retry > 7) return false;
  if ((mask & IBV_QP_MIN_RNR_TIMER) && a->min_rnr_timer > 31) return false;
  if (mask & IBV_QP_AV) {
    const ibv_ah_attr &ah = a->ah_attr;
    if (ah.dlid == 0 || (ah.port_num != 1 && ah.port_num != 0)) return false;
    if (ah.is_global && ah.grh.sgid_index != 0) return false;
  }
  return true;
}

void apply(Qp *qp, const ibv_qp_attr *a, int mask) {
  ibv_qp_attr &q = qp->attr;
  if (mask & IBV_QP_PKEY_INDEX) q.pkey_index = a->pkey_index;
  if (mask & IBV_QP_PORT) q.port_num = a->port_num;
  if (mask & IBV_QP_ACCESS_FLAGS) {
    q.qp_access_flags = a->qp_access_flags;
    qp->sh->access = a->qp_access_flags;
  }
  if (mask & IBV_QP_QKEY) {
    q.qkey = a->qkey;
    qp->sh->qkey = a->qkey;
  }
  if (mask & IBV_QP_AV) {
    q.ah_attr = a->ah_attr;
    qp->sh->dest_lid = a->ah_attr.dlid;
  }
  if (mask & IBV_QP_PATH_MTU) q.path_mtu = a->path_mtu;
  if (mask & IBV_QP_DEST_QPN) {
    q.dest_qp_num = a->dest_qp_num;
    qp->sh->dest_qpn = a->dest_qp_num;
  }
  if (mask & IBV_QP_RQ_PSN) q.rq_psn = a->rq_psn;
  if (mask & IBV_QP_SQ_PSN) q.sq_psn = a->sq_psn;
  if (mask & IBV_QP_MAX_DEST_RD_ATOMIC) q.max_dest_rd_atomic = a->max_dest_rd_atomic;
  if (mask & IBV_QP_MAX_QP_RD_ATOMIC) q.max_rd_atomic = a->max_rd_atomic;
  if (mask & IBV_QP_MIN_RNR_TIMER) {
    q.min_rnr_timer = a->min_rnr_timer;
    qp->sh->min_rnr_timer = a->min_rnr_timer;
  }
  if (mask & IBV_QP_TIMEOUT) q.timeout = a->timeout;
  if (mask & IBV_QP_RETRY_CNT) q.retry_cnt = a->retry_cnt;
  if (mask & IBV_QP_RNR_RETRY) q.rnr_retry = a->rnr_retry;
  if (mask & IBV_QP_ALT_PATH) {
    q.alt_ah_attr = a->alt_ah_attr;
    q.alt_pkey_index = a->alt_pkey_index;
    q.alt_port_num = a->alt_port_num;
    q.alt_timeout = a->alt_timeout;
  }
  if (mask & IBV_QP_PATH_MIG_STATE) q.path_mig_state = a->path_mig_state;
  if (mask & IBV_QP_EN_SQD_ASYNC_NOTIFY) q.en_sqd_async_notify = a->en_sqd_async_notify;
  qp->attr_mask_seen |= mask;
}

}  // namespace

Qp *create_qp(Context *ctx, ibv_qp_init_attr_ex *a, int *err) {
  *err = 0;
  if (a->qp_type != IBV_QPT_RC && a->qp_type != IBV_QPT_UD) *err = EOPNOTSUPP;
  if (a->comp_mask & ~uint32_t(IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS |
                               IBV_QP_INIT_ATTR_CREATE_FLAGS))
    *err = EOPNOTSUPP;
  if ((a->comp_mask & IBV_QP_INIT_ATTR_CREATE_FLAGS) && a->create_flags) *err = EOPNOTSUPP;
  if (!(a->comp_mask & IBV_QP_INIT_ATTR_PD) || !a->pd || !a->send_cq || !a->recv_cq) *err = EINVAL;
  ibv_qp_cap &c = a->cap;
  if (c.max_send_wr > kMaxQpWr || c.max_send_sge > kMaxSge || c.max_inline_data > kMaxInline ||
      (!a->srq && (c.max_recv_wr > kMaxQpWr || c.max_recv_sge > kMaxSge)))
    *err = *err ? *err : EINVAL;
  if (*err) return nullptr;
  Node &node = *ctx->node;
  auto *qp = new Qp{};
  qp->ctx = ctx;
  qp->pd = from_ibv<Pd>(a->pd);
  qp->scq = from_ibv<Cq>(a->send_cq);
  qp->rcq = from_ibv<Cq>(a->recv_cq);
  qp->srq = a->srq ? from_ibv<Srq>(a->srq) : nullptr;
  qp->sig_all = a->sq_sig_all;
  c.max_send_wr = std::max<uint32_t>(c.max_send_wr, 1);
  c.max_send_sge = std::max<uint32_t>(c.max_send_sge, 1);
  // As an HCA's send WQE holds some inline data whatever was asked (mlx5:
  // ~60 B): rdma_xclient and others send 16 B inline from a QP created with 0.
  c.max_inline_data = std::max<uint32_t>(c.max_inline_data, kMinInline);
  if (qp->srq) {
    c.max_recv_wr = 0;
    c.max_recv_sge = 0;
  } else {
    c.max_recv_wr = std::max<uint32_t>(c.max_recv_wr, 1);
    c.max_recv_sge = std::max<uint32_t>(c.max_recv_sge, 1);
    qp->rq_off = rq_create(node, pow2_at_least(c.max_recv_wr + 1), c.max_recv_sge, qp->pd->id);
    if (!qp->rq_off) {
      delete qp;
      *err = ENOMEM;
      return nullptr;
    }
    qp->rq = static_cast<RqShared *>(node.ptr(qp->rq_off));
  }
  qp->cap = c;
  uint32_t qpn;
  if ((*err = node.alloc_qp(qp, &qp->idx, &qpn))) {
    node.free(qp->rq_off);
    delete qp;
    return nullptr;
  }
  node.reset_sq(qp->idx);
  qp->stats->type = a->qp_type;
  qp->stats->sq_depth = c.max_send_wr;
  qp->stats->rq_depth = qp->srq ? 0 : c.max_recv_wr;
  QpShared *sh = qp->sh = &node.root()->qps[qp->idx];
  sh->state.store(IBV_QPS_RESET);
  sh->type = a->qp_type;
  sh->pd = qp->pd->id;
  sh->access = 0;
  sh->qkey = 0;
  sh->dest_qpn = 0;
  sh->dest_lid = 0;
  sh->min_rnr_timer = 0;
  sh->rq = qp->rq_off;
  sh->srq = qp->srq ? qp->srq->off : 0;
  sh->rcq = qp->rcq->off;
  sh->async = ctx->async_events();
  sh->qpn.store(qpn, std::memory_order_release);
  qp->pd->users++;
  qp->scq->users++;
  qp->rcq->users++;
  if (qp->srq) qp->srq->users++;
  return qp;
}

void set_qp_handle(Qp *qp, ibv_qp *ibv) {
  qp->ibv = ibv;
  qp->sh->handle = reinterpret_cast<uint64_t>(ibv);
}

int modify_qp(Qp *qp, const ibv_qp_attr *a, int mask) {
  ibv_qp_state cur = qp->state();
  ibv_qp_state next = (mask & IBV_QP_STATE) ? a->qp_state : cur;
  if (next < IBV_QPS_RESET || next > IBV_QPS_ERR) return EINVAL;
  if ((mask & IBV_QP_CUR_STATE) && a->cur_qp_state != cur) return EINVAL;
  const Rule &r = kRules.at[cur][next];
  bool ud = qp->ibv->qp_type == IBV_QPT_UD;
  int req = ud ? r.req_ud : r.req_rc, opt = ud ? r.opt_ud : r.opt_rc;
  if (!r.allowed || (cur == IBV_QPS_SQE && next == IBV_QPS_RTS && !ud)) return EINVAL;
  int given = mask & ~IBV_QP_STATE;
  if ((given & req) != req || (given & ~(req | opt))) return EINVAL;
  if (!values_ok(a, mask)) return EINVAL;

  Node &node = *qp->ctx->node;
  if (next == IBV_QPS_RESET) {
    // No thread serves a request of it from here on (links_barrier; not
    // under sq_mu, which answers take after a link's lock): the receive
    // queue and CQs are reset under nobody.
    qp->sh->state.store(IBV_QPS_RESET, std::memory_order_release);
    node.links_barrier();
  }
  bool kick = false;
  {
    std::lock_guard<SpinLock> g(qp->sq_mu);
    apply(qp, a, given);
    if (next == IBV_QPS_RESET) {
      qp->sh->state.store(IBV_QPS_RESET, std::memory_order_release);
      withdraw_pulls_locked(qp);
      qp->backlog.clear();
      qp->sent.clear();  // answers to come are dropped: their PSNs are unknown now
      qp->unanswered = 0;
      discard_completions(qp);
      qp->sq_posted = 0;
      node.reset_sq(qp->idx);
      if (qp->rq) rq_reset(qp->rq);
      qp->sh->torn.store(0, std::memory_order_relaxed);
      qp->errored = false;
      qp->halted = false;
      qp->resume.store(0, std::memory_order_relaxed);
      qp->busy_since_ns = 0;
      // The old connection's late requests must not find this QP connected to them
      // (serve_in_order would set `resume` for them, and drop the next connection's).
      qp->sh->dest_qpn = 0;
      qp->sh->dest_lid = 0;
      qp->peer = nullptr;
      qp->link = nullptr;
      qp->mirror = nullptr;
      qp->attr = ibv_qp_attr{};
    } else {
      if (next == IBV_QPS_RTR && cur == IBV_QPS_INIT && !ud) {
        qp->peer = node.fab().peer(qp->attr.ah_attr.dlid);
        qp->epoch = node.new_epoch();  // a new connection: the target forgets what it went back for
        qp->resume.store(0, std::memory_order_relaxed);  // and so does this QP as a target
        qp->link = nullptr;
        qp->mirror = nullptr;
        if (qp->peer) qp->peer_nonce = qp->peer->nonce();
      }
      qp->sh->state.store(next, std::memory_order_release);
      kick = next == IBV_QPS_RTS && !qp->backlog.empty();
    }
  }
  node.push_qp(qp->idx);
  if (next == IBV_QPS_RESET) return 0;
  if (next == IBV_QPS_ERR && cur != IBV_QPS_ERR) qp_enter_error(qp);
  if (qp->peer && next == IBV_QPS_RTR) {
    node.watch(qp->peer);
    node.link(*qp->peer);  // asks for the link now: up by the first WR
  }
  if (kick) node.schedule(qp);
  // Nothing is ever in flight once posted: the send queue is drained at once.
  if (next == IBV_QPS_SQD && (given & IBV_QP_EN_SQD_ASYNC_NOTIFY) && a->en_sqd_async_notify)
    qp->ctx->raise_async(reinterpret_cast<uint64_t>(qp->ibv), IBV_EVENT_SQ_DRAINED);
  return 0;
}

int query_qp(Qp *qp, ibv_qp_attr *a, int, ibv_qp_init_attr *init) {
  std::lock_guard<SpinLock> g(qp->sq_mu);
  *a = qp->attr;
  a->qp_state = a->cur_qp_state = qp->state();
  a->cap = qp->cap;
  a->qp_access_flags = qp->sh->access;
  a->sq_draining = 0;
  if (!(qp->attr_mask_seen & IBV_QP_PORT)) a->port_num = 1;
  if (init) {
    memset(init, 0, sizeof *init);
    init->qp_context = qp->ibv->qp_context;
    init->send_cq = qp->ibv->send_cq;
    init->recv_cq = qp->ibv->recv_cq;
    init->srq = qp->ibv->srq;
    init->cap = qp->cap;
    init->qp_type = qp->ibv->qp_type;
    init->sq_sig_all = qp->sig_all;
  }
  return 0;
}

int destroy_qp(Qp *qp) {
  Node &node = *qp->ctx->node;
  qp->sh->state.store(IBV_QPS_RESET, std::memory_order_release);
  {
    std::lock_guard<SpinLock> g(qp->sq_mu);
    withdraw_pulls_locked(qp);
  }
  node.retire_qp(qp);
  node.push_qp(qp->idx);
  node.links_barrier();  // nobody serves a request of it or hands it an answer any more
  discard_completions(qp);
  node.free(qp->rq_off);
  qp->pd->users--;
  qp->scq->users--;
  qp->rcq->users--;
  if (qp->srq) qp->srq->users--;
  delete qp;
  return 0;
}

int post_recv(Qp *qp, const ibv_recv_wr *wr, ibv_recv_wr **bad) {
  if (qp->srq || qp->state() == IBV_QPS_RESET) {
    *bad = const_cast<ibv_recv_wr *>(wr);
    return EINVAL;
  }
  int err;
  {
    std::lock_guard<SpinLock> g(qp->rq_mu);
    err = rq_post(qp->rq, qp->cap.max_recv_wr, wr, bad);
  }
  // Receives posted to a failed QP complete at once, flushed.
  if (qp->state() == IBV_QPS_ERR) {
    rq_flush(*qp->ctx->node, qp->sh);
  }
  return err;
}

}  // namespace pcientb::engine
