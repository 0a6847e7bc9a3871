// Repro: ibv_post_srq_recv fails with ENOMEM although fewer than max_wr WQEs
// are outstanding, when SRQ completions are polled out of order (two QPs on
// one SRQ, each with its own CQ, small eager SENDs).
// Build: cmake --build --preset default --target stress_repro_srq_out_of_order_repost
// Run:   build/bin/stress_repro_srq_out_of_order_repost   (prints PASS or FAIL; exit 0 / 1)
#include <cstring>

#include "repro.hpp"

int main() {
  ibv_context *ctx = open_dev("repro-srq-order");
  ibv_pd *pd = ibv_alloc_pd(ctx);
  ibv_port_attr port;
  ibv_query_port(ctx, 1, &port);
  static char buf[4096];
  ibv_mr *mr = ibv_reg_mr(pd, buf, sizeof buf, IBV_ACCESS_LOCAL_WRITE);
  ibv_srq *srq = create_srq(pd, 2);
  ibv_cq *rcq[2], *scq = ibv_create_cq(ctx, 16, nullptr, nullptr, 0);
  ibv_qp *r[2], *s[2];
  for (int i = 0; i < 2; ++i) {
    rcq[i] = ibv_create_cq(ctx, 16, nullptr, nullptr, 0);
    r[i] = create_srq_qp(pd, rcq[i], srq);
    s[i] = create_rc_qp(pd, scq, 4);
    connect(r[i], port.lid, s[i]->qp_num);
    connect(s[i], port.lid, r[i]->qp_num);
  }
  auto post = [&](uint64_t id) { return post_srq(srq, buf, mr, id); };
  CHECK(post(0) == 0);
  CHECK(post(1) == 0);           // max_wr = 2 WQEs outstanding
  for (int i = 0; i < 2; ++i) {  // one 8-byte SEND per QP
    ibv_sge sge{(uintptr_t)(buf + 2048), 8, mr->lkey};
    ibv_send_wr wr{}, *bad;
    wr.opcode = IBV_WR_SEND;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.send_flags = IBV_SEND_SIGNALED;
    CHECK(ibv_post_send(s[i], &wr, &bad) == 0);
    ibv_wc wc;
    while (ibv_poll_cq(scq, 1, &wc) == 0) {
    }
    CHECK(wc.status == IBV_WC_SUCCESS);
  }
  ibv_wc wc;
  int n;
  while ((n = ibv_poll_cq(rcq[1], 1, &wc)) == 0) {
  }  // the second QP's receive first
  CHECK(n == 1 && wc.status == IBV_WC_SUCCESS);
  printf("polled the receive of QP 2 (wr_id %lu); 1 of max_wr 2 WQEs outstanding\n",
         (unsigned long)wc.wr_id);
  int rc = post(wc.wr_id);
  printf("ibv_post_srq_recv: %s\n", rc ? strerror(rc) : "ok");
  while ((n = ibv_poll_cq(rcq[0], 1, &wc)) == 0) {
  }
  rc == 0 ? printf("PASS\n") : printf("FAIL: expected success (1 WQE outstanding, max_wr 2)\n");
  return rc != 0;
}
