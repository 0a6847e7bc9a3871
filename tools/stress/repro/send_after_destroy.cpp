// Reproduction (pcientb-stress found it): the target of a large SEND pulls its bytes
// from the requester's window after the requester destroyed its QP and reused
// the buffer; the receive completes successfully with bytes the sender wrote
// after ibv_destroy_qp returned (an HCA reads no byte of a QP's WRs after its
// destroy returns: a message it had not sent whole is never completed).
//
// Sender (child, its own node): a SIZE-byte buffer of 0x11, one signaled SEND
// of all of it, ibv_destroy_qp at once, then memset(buffer, 0x22) (its memory
// again). Receiver (parent): one receive of SIZE bytes (zeroed); a successful
// completion must hold 0x11 only.
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

int main(int argc, char **argv) {
  const size_t size = argc > 1 ? strtoull(argv[1], nullptr, 0) : (16u << 20);
  const int rounds = argc > 2 ? atoi(argv[2]) : 20;
  const int delay_us = argc > 3 ? atoi(argv[3]) : 0;   // sender: pause between destroy and memset
  const int before_us = argc > 4 ? atoi(argv[4]) : 0;  // sender: pause between post and destroy
  ibv_context *ctx = open_dev("repro-after-destroy");
  ibv_pd *pd = ibv_alloc_pd(ctx);
  ibv_port_attr port;
  ibv_query_port(ctx, 1, &port);
  auto *rbuf = static_cast<uint8_t *>(aligned_alloc(4096, size));
  ibv_mr *rmr = ibv_reg_mr(pd, rbuf, size, IBV_ACCESS_LOCAL_WRITE);
  CHECK(rmr);
  int bad_rounds = 0, completed = 0, torn = 0;
  for (int round = 1; round <= rounds; ++round) {
    memset(rbuf, 0, size);
    ibv_cq *cq = ibv_create_cq(ctx, 16, nullptr, nullptr, 0);
    ibv_qp *qp = create_rc_qp(pd, cq, 1);
    int to_child[2], to_parent[2];
    CHECK(!pipe(to_child) && !pipe(to_parent));
    pid_t pid = fork();
    if (pid == 0) {
      ibv_context *c = open_dev();
      ibv_pd *p = ibv_alloc_pd(c);
      ibv_port_attr pa;
      ibv_query_port(c, 1, &pa);
      auto *sbuf = static_cast<uint8_t *>(aligned_alloc(4096, size));
      memset(sbuf, 0x11, size);
      ibv_mr *smr = ibv_reg_mr(p, sbuf, size, IBV_ACCESS_LOCAL_WRITE);
      CHECK(smr);
      ibv_cq *scq = ibv_create_cq(c, 16, nullptr, nullptr, 0);
      ibv_qp *s = create_rc_qp(p, scq, 4);
      Ep me{pa.lid, s->qp_num}, peer;
      CHECK(write(to_parent[1], &me, sizeof me) == sizeof me);
      CHECK(read(to_child[0], &peer, sizeof peer) == sizeof peer);
      connect(s, peer.lid, peer.qpn);
      ibv_sge sge{reinterpret_cast<uintptr_t>(sbuf), static_cast<uint32_t>(size), smr->lkey};
      ibv_send_wr wr{}, *bad;
      wr.opcode = IBV_WR_SEND;
      wr.sg_list = &sge;
      wr.num_sge = 1;
      wr.send_flags = IBV_SEND_SIGNALED;
      CHECK(ibv_post_send(s, &wr, &bad) == 0);
      if (before_us) std::this_thread::sleep_for(std::chrono::microseconds(before_us));
      CHECK(ibv_destroy_qp(s) == 0);  // the SEND is abandoned: the buffer is ours again
      if (delay_us) std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
      memset(sbuf, 0x22, size);
      char done = 1;
      CHECK(write(to_parent[1], &done, 1) == 1);
      pause();  // stays alive (a dead sender's memory cannot change)
      _exit(0);
    }
    Ep child, me{port.lid, qp->qp_num};
    CHECK(read(to_parent[0], &child, sizeof child) == sizeof child);
    connect(qp, child.lid, child.qpn);
    ibv_sge sge{reinterpret_cast<uintptr_t>(rbuf), static_cast<uint32_t>(size), rmr->lkey};
    ibv_recv_wr rwr{}, *rbad;
    rwr.sg_list = &sge;
    rwr.num_sge = 1;
    CHECK(ibv_post_recv(qp, &rwr, &rbad) == 0);
    CHECK(write(to_child[1], &me, sizeof me) == sizeof me);
    char done;
    CHECK(read(to_parent[0], &done, 1) == 1);
    ibv_wc wc{};
    int n = 0;
    for (auto t0 = std::chrono::steady_clock::now();
         n == 0 && std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(500);)
      n = ibv_poll_cq(cq, 1, &wc);
    if (n == 1 && wc.status == IBV_WC_SUCCESS) {
      ++completed;
      size_t n11 = 0, n22 = 0, other = 0, first22 = SIZE_MAX;
      for (size_t i = 0; i < size; ++i) {
        if (rbuf[i] == 0x11)
          ++n11;
        else if (rbuf[i] == 0x22) {
          ++n22;
          if (first22 == SIZE_MAX) first22 = i;
        } else
          ++other;
      }
      if (n22 || other) {
        ++bad_rounds;
        printf(
            "round %d: receive completed OK with %zu bytes 0x11 (before the destroy), %zu bytes "
            "0x22 (written after ibv_destroy_qp returned; first at %zu), %zu other\n",
            round, n11, n22, first22 == SIZE_MAX ? 0 : first22, other);
      }
    } else if (n == 1) {
      printf("round %d: receive completed with %s\n", round, ibv_wc_status_str(wc.status));
    } else {
      ++torn;
    }
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    ibv_destroy_qp(qp);
    ibv_destroy_cq(cq);
    for (int fd : {to_child[0], to_child[1], to_parent[0], to_parent[1]}) close(fd);
  }
  printf(
      "%d rounds: %d receives completed, %d with bytes written after the sender's "
      "ibv_destroy_qp, %d not completed\n%s\n",
      rounds, completed, bad_rounds, torn, bad_rounds ? "FAIL" : "PASS");
  return bad_rounds ? 1 : 0;
}
