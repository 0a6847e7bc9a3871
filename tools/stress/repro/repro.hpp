// What the reproductions share: a check that ends the program, opening
// pcientb0 on a fabric of the program's own, an SRQ, the QPs on it and their
// receives, and an RC connection.
#pragma once

#include <infiniband/verbs.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#define CHECK(x)                                      \
  do {                                                \
    if (!(x)) {                                       \
      printf("FAILED: %s (line %d)\n", #x, __LINE__); \
      exit(2);                                        \
    }                                                 \
  } while (0)

// Joins the fabric `name`-<pid> (set once, before the first open: children
// forked later join the same one).
inline ibv_context *open_dev(const char *name = nullptr) {
  if (name)
    setenv("PCIENTB_FABRIC", (std::string(name) + "-" + std::to_string(getpid())).c_str(), 1);
  ibv_device **l = ibv_get_device_list(nullptr);
  CHECK(l && l[0]);
  ibv_context *ctx = ibv_open_device(l[0]);
  CHECK(ctx);
  return ctx;
}

// RESET -> INIT.
inline void to_init(ibv_qp *qp) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.port_num = 1;
  CHECK(
      !ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS));
}

// RESET -> INIT -> RTR -> RTS towards QP dqpn of the node at lid.
inline void connect(ibv_qp *qp, uint16_t lid, uint32_t dqpn) {
  to_init(qp);
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = IBV_MTU_4096;
  a.dest_qp_num = dqpn;
  a.max_dest_rd_atomic = 1;
  a.min_rnr_timer = 1;
  a.ah_attr.dlid = lid;
  a.ah_attr.port_num = 1;
  CHECK(!ibv_modify_qp(qp, &a,
                       IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                           IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER));
  a = {};
  a.qp_state = IBV_QPS_RTS;
  a.timeout = 10;
  a.retry_cnt = 3;
  a.rnr_retry = 7;
  a.max_rd_atomic = 1;
  CHECK(!ibv_modify_qp(qp, &a,
                       IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                           IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC));
}

inline ibv_srq *create_srq(ibv_pd *pd, uint32_t max_wr) {
  ibv_srq_init_attr sa{};
  sa.attr.max_wr = max_wr;
  sa.attr.max_sge = 1;
  ibv_srq *srq = ibv_create_srq(pd, &sa);
  CHECK(srq);
  return srq;
}

// An RC QP with its own receive queue (one WR of one SGE) and send_wr send WRs.
inline ibv_qp *create_rc_qp(ibv_pd *pd, ibv_cq *cq, uint32_t send_wr, uint32_t max_inline = 0) {
  ibv_qp_init_attr qa{};
  qa.send_cq = qa.recv_cq = cq;
  qa.qp_type = IBV_QPT_RC;
  qa.cap = {send_wr, 1, 1, 1, max_inline};
  ibv_qp *qp = ibv_create_qp(pd, &qa);
  CHECK(qp);
  return qp;
}

// An RC QP that receives from srq and sends at most one WR.
inline ibv_qp *create_srq_qp(ibv_pd *pd, ibv_cq *cq, ibv_srq *srq) {
  ibv_qp_init_attr ra{};
  ra.send_cq = ra.recv_cq = cq;
  ra.srq = srq;
  ra.qp_type = IBV_QPT_RC;
  ra.cap = {1, 0, 1, 1, 0};
  ibv_qp *qp = ibv_create_qp(pd, &ra);
  CHECK(qp);
  return qp;
}

// Posts receive `id` on srq: 64 bytes at buf + 64 * id.
inline int post_srq(ibv_srq *srq, char *buf, ibv_mr *mr, uint64_t id) {
  ibv_sge sge{reinterpret_cast<uintptr_t>(buf + 64 * id), 64, mr->lkey};
  ibv_recv_wr wr{}, *bad;
  wr.wr_id = id;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  return ibv_post_srq_recv(srq, &wr, &bad);
}
