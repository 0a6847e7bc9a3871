// Repro: a sender SIGKILLed while it sends small SENDs to a QP on an SRQ
// could leave an SRQ WQE taken for ever (the eager path reserved it at the
// target before the issue 9 transport): no completion ever reported it and,
// once max_wr more WQEs have been posted, every ibv_post_srq_recv fails with
// ENOMEM (the SRQ is unusable for all its QPs).
// Build: cmake --build --preset default --target stress_repro_srq_killed_sender
// Run:   build/bin/stress_repro_srq_killed_sender   (up to 200 kills; PASS or FAIL)
#include <infiniband/verbs.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "repro.hpp"

struct Ep {
  uint16_t lid;
  uint32_t qpn;
};
static void connect(ibv_qp *qp, Ep peer) {
  connect(qp, peer.lid, peer.qpn);
}
constexpr int kMaxWr = 8;
int main() {
  ibv_context *ctx = open_dev("repro-killed");
  ibv_pd *pd = ibv_alloc_pd(ctx);
  ibv_port_attr port;
  ibv_query_port(ctx, 1, &port);
  static char buf[kMaxWr * 64];
  ibv_mr *mr = ibv_reg_mr(pd, buf, sizeof buf, IBV_ACCESS_LOCAL_WRITE);
  ibv_srq *srq = create_srq(pd, kMaxWr);
  auto post = [&](uint64_t id) { return post_srq(srq, buf, mr, id); };
  for (int i = 0; i < kMaxWr; ++i) CHECK(post(i) == 0);
  srand(getpid());
  for (int round = 1; round <= 200; ++round) {
    ibv_cq *cq = ibv_create_cq(ctx, 64, nullptr, nullptr, 0);
    ibv_qp *qp = create_srq_qp(pd, cq, srq);
    int to_child[2], to_parent[2];
    CHECK(!pipe(to_child) && !pipe(to_parent));
    pid_t pid = fork();
    if (pid == 0) {  // the sender: its own node; 8-byte SENDs as fast as it can
      ibv_context *c = open_dev();
      ibv_pd *p = ibv_alloc_pd(c);
      ibv_port_attr pa;
      ibv_query_port(c, 1, &pa);
      ibv_cq *scq = ibv_create_cq(c, 64, nullptr, nullptr, 0);
      ibv_qp *s = create_rc_qp(p, scq, 16, 16);
      Ep me{pa.lid, s->qp_num}, peer;
      write(to_parent[1], &me, sizeof me);
      read(to_child[0], &peer, sizeof peer);
      connect(s, peer);
      write(to_parent[1], &me, 1);
      static char data[8];
      for (uint64_t n = 0;; ++n) {
        ibv_sge sge{(uintptr_t)data, 8, 0};
        ibv_send_wr wr{}, *bad;
        wr.opcode = IBV_WR_SEND;
        wr.sg_list = &sge;
        wr.num_sge = 1;
        wr.send_flags = IBV_SEND_INLINE | IBV_SEND_SIGNALED;
        if (ibv_post_send(s, &wr, &bad) == 0) {
          ibv_wc wc;
          while (ibv_poll_cq(scq, 1, &wc) == 0) {
          }
        }
      }
    }
    Ep child, me{port.lid, qp->qp_num};
    read(to_parent[0], &child, sizeof child);
    connect(qp, child);
    write(to_child[1], &me, sizeof me);
    char go;
    read(to_parent[0], &go, 1);
    // Receive and repost for a moment, then SIGKILL the sender mid-stream.
    auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(200 + rand() % 3000);
    auto drain = [&] {
      ibv_wc wc;
      while (ibv_poll_cq(cq, 1, &wc) == 1) {
        CHECK(wc.status == IBV_WC_SUCCESS);
        if (post(wc.wr_id)) return false;
      }
      return true;
    };
    while (std::chrono::steady_clock::now() < until)
      if (!drain()) break;
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    bool ok = drain();
    ibv_destroy_qp(qp);
    ibv_destroy_cq(cq);
    close(to_child[0]);
    close(to_child[1]);
    close(to_parent[0]);
    close(to_parent[1]);
    // Every WQE that completed was reposted: kMaxWr are outstanding, none consumed.
    // Another QP on the SRQ must be able to receive kMaxWr messages now.
    if (!ok) {
      printf("round %d: ibv_post_srq_recv failed with ENOMEM after polling a completion\n", round);
      printf("FAIL\n");
      return 1;
    }
    // Probe: a fresh loopback sender consumes and we repost kMaxWr+1 times.
    ibv_cq *cq2 = ibv_create_cq(ctx, 64, nullptr, nullptr, 0);
    ibv_qp *rq = create_srq_qp(pd, cq2, srq);
    ibv_qp *sq = create_rc_qp(pd, cq2, 4, 16);
    connect(rq, Ep{port.lid, sq->qp_num});
    connect(sq, Ep{port.lid, rq->qp_num});
    for (int i = 0; i < 2 * kMaxWr + 2; ++i) {
      static char d[8];
      ibv_sge sge{(uintptr_t)d, 8, 0};
      ibv_send_wr wr{}, *bad;
      wr.opcode = IBV_WR_SEND;
      wr.sg_list = &sge;
      wr.num_sge = 1;
      wr.send_flags = IBV_SEND_INLINE | IBV_SEND_SIGNALED;
      CHECK(ibv_post_send(sq, &wr, &bad) == 0);
      int got = 0;
      auto t0 = std::chrono::steady_clock::now();
      while (got < 2 && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(2)) {
        ibv_wc wc;
        if (ibv_poll_cq(cq2, 1, &wc) == 1) {
          ++got;
          if (wc.opcode == IBV_WC_RECV && post(wc.wr_id)) {
            printf(
                "round %d: after the kill, ibv_post_srq_recv fails with ENOMEM (%d WQEs "
                "outstanding, max_wr %d)\nFAIL\n",
                round, kMaxWr - 1, kMaxWr);
            return 1;
          }
        }
      }
      if (got < 2) {
        printf("round %d: after the kill, a SEND to the SRQ got no completion in 2 s\nFAIL\n",
               round);
        return 1;
      }
    }
    ibv_destroy_qp(rq);
    ibv_destroy_qp(sq);
    ibv_destroy_cq(cq2);
  }
  printf("PASS (200 kills)\n");
  return 0;
}
