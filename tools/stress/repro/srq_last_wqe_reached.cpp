// Repro: a QP attached to an SRQ that enters the ERR state must raise
// IBV_EVENT_QP_LAST_WQE_REACHED (the IBA affiliated event "Last WQE Reached"; mlx5
// and rxe raise it), which
// applications wait for before destroying such a QP.
// Build: cmake --build --preset default --target stress_repro_srq_last_wqe_reached
// Run:   build/bin/stress_repro_srq_last_wqe_reached   (PASS or FAIL)
#include <infiniband/verbs.h>
#include <poll.h>
#include <unistd.h>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "repro.hpp"

int main() {
  ibv_context *ctx = open_dev("repro-last-wqe");
  ibv_pd *pd = ibv_alloc_pd(ctx);
  ibv_port_attr port;
  ibv_query_port(ctx, 1, &port);
  ibv_srq *srq = create_srq(pd, 4);
  ibv_cq *cq = ibv_create_cq(ctx, 16, nullptr, nullptr, 0);
  ibv_qp *qp = create_srq_qp(pd, cq, srq);
  to_init(qp);
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_ERR;
  CHECK(!ibv_modify_qp(qp, &a, IBV_QP_STATE));
  for (;;) {
    pollfd p{ctx->async_fd, POLLIN, 0};
    if (poll(&p, 1, 2000) <= 0) {
      printf("no IBV_EVENT_QP_LAST_WQE_REACHED within 2 s of moving an SRQ QP to ERR\nFAIL\n");
      return 1;
    }
    ibv_async_event ev;
    CHECK(ibv_get_async_event(ctx, &ev) == 0);
    ibv_event_type t = ev.event_type;
    bool ours = t == IBV_EVENT_QP_LAST_WQE_REACHED && ev.element.qp == qp;
    ibv_ack_async_event(&ev);
    printf("event: %s\n", ibv_event_type_str(t));
    if (ours) {
      printf("PASS\n");
      return 0;
    }
  }
}
