// Links: an initiator checks rkeys and the target QP against a mirror of the
// target's tables that the target pushes into the initiator's memory
// (docs/transport.md). It never reads the target's tables, so the target
// must take part once, when the link comes up, and every change it makes
// reaches the mirror before its verb returns.
#include <signal.h>

#include <cstring>
#include <fstream>
#include <string>
#include <thread>

#include <pcientb/pcientb.h>

#include "verbs_helpers.hpp"

namespace pcientb::test {
namespace {

// Whether process `pid` is stopped (state T in /proc/<pid>/stat).
bool stopped(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(stat, line);
  auto paren = line.rfind(')');
  return paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] == 'T';
}

// Posts a FETCH_AND_ADD of `add` to the first word of the peer's buffer; the
// old value lands in the first 8 bytes of ours.
int fetch_add(RcEnd &a, uint64_t wr_id, uint64_t add) {
  return SendWr(IBV_WR_ATOMIC_FETCH_AND_ADD, wr_id)
      .sge(a.sge(0, 8))
      .remote(a.raddr(0), a.rkey())
      .compare_add(add)
      .post(a.qp());
}

// One WRITE through the connection: once it succeeds, the link to the peer
// is up (its tables mirrored here, the lanes known).
void bring_link_up(RcEnd &end) {
  ASSERT_EQ(0, end.post_write(1, 64, 8, 64));
  ASSERT_EQ(end.wait_wc().status, IBV_WC_SUCCESS);
}

// Waits (10 s at most) for process `pid` to stop itself; whether it did.
bool wait_stopped(pid_t pid) {
  auto deadline = std::chrono::steady_clock::now() + 10s;
  while (!stopped(pid) && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(1ms);
  return stopped(pid);
}

// The target stops (SIGSTOP) before the initiator connects: nothing serves
// the initiator's ask, so its first WRITE waits for the link and fails as an
// unanswered WR after timeout x (retry_cnt + 1). A transport that read the
// target's tables itself would have completed it. Continued, the target
// serves the ask late, and a new QP of the initiator uses the link at once.
TEST(Link, TheFirstWrWaitsForTheTargetAndFailsWhenItNeverTakesPart) {
  RcOptions options;
  options.params.timeout = 8;  // ~1 ms
  options.params.retry_cnt = 2;
  two_process(
      [&](Channel &ch) {  // the target
        RcEnd b(options);
        Endpoint local = b.local();
        b.rc.remote = ch.exchange(local);
        rc_init_to_rts(b.qp(), local, b.rc.remote, options.params);
        ch.signal();
        raise(SIGSTOP);  // the initiator continues us
        RcQp second(b.node, options);
        Endpoint mine = second.endpoint(b.node, b.buf);
        second.remote = ch.exchange(mine);
        rc_init_to_rts(second.qp.get(), mine, second.remote, options.params);
        ch.barrier();
        ch.wait();  // the initiator wrote through the second QP
        EXPECT_TRUE(has_pattern(b.buf.span(0, 64), 7));
      },
      [&](Channel &ch) {  // the initiator
        RcEnd a(options);
        Endpoint local = a.local();
        a.rc.remote = ch.exchange(local);
        ch.wait();
        const pid_t target = ch.peer_pid();
        ASSERT_TRUE(wait_stopped(target));
        rc_init_to_rts(a.qp(), local, a.rc.remote, options.params);
        fill_pattern(a.buf.span(0, 64), 7);
        auto posted = std::chrono::steady_clock::now();
        ASSERT_EQ(0, a.post_write(1, 0, 64, 0));
        ibv_wc wc = a.wait_wc(10s);
        EXPECT_EQ(wc.status, IBV_WC_RETRY_EXC_ERR);
        EXPECT_GE(std::chrono::steady_clock::now() - posted, 3ms);  // 3 x ~1 ms waited
        kill(target, SIGCONT);

        RcQp second(a.node, options);
        Endpoint mine = second.endpoint(a.node, a.buf);
        second.remote = ch.exchange(mine);
        rc_init_to_rts(second.qp.get(), mine, second.remote, options.params);
        ch.barrier();
        ASSERT_EQ(0, SendWr(IBV_WR_RDMA_WRITE, 2)
                         .sge(a.buf.sge(0, 64))
                         .remote(second.remote.addr, second.remote.rkey)
                         .post(second.qp.get()));
        EXPECT_EQ(wait_wc(second.cq.get()).status, IBV_WC_SUCCESS);
        ch.signal();
      });
}

// MRs registered and deregistered after the link is up reach the
// initiator's mirror before the target's verb returns: each new MR is
// written at once, and access taken away by a re-registration is refused.
TEST(Link, MrChangesReachTheMirrorBeforeTheVerbReturns) {
  constexpr int kRounds = 20;
  struct Mr {
    uint64_t addr;
    uint32_t rkey;
  };
  two_process(
      [](Channel &ch) {  // the initiator
        RcEnd a;
        a.connect(ch);
        for (int round = 0; round <= kRounds; ++round) {
          auto [addr, rkey] = ch.recv<Mr>();
          fill_pattern(a.buf.span(0, 256), round);
          ASSERT_EQ(
              0, SendWr(IBV_WR_RDMA_WRITE, 1).sge(a.sge(0, 256)).remote(addr, rkey).post(a.qp()));
          ibv_wc wc = a.wait_wc();
          if (round < kRounds) {
            ASSERT_EQ(wc.status, IBV_WC_SUCCESS) << "round " << round;
            ch.barrier();  // the target checks the bytes and deregisters
          } else {
            EXPECT_EQ(wc.status, IBV_WC_REM_ACCESS_ERR) << "after re-registration";
            ch.signal();
          }
        }
      },
      [](Channel &ch) {  // the target
        RcEnd b;
        b.connect(ch);
        std::vector<uint8_t> mem(4096);
        for (int round = 0; round <= kRounds; ++round) {
          ibv_mr *mr = ibv_reg_mr(b.node.pd.get(), mem.data(), mem.size(), kAllAccess);
          ASSERT_NE(mr, nullptr);
          if (round == kRounds) {  // remote write taken away before the key is sent
            ASSERT_EQ(0, ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_ACCESS, nullptr, nullptr, 0,
                                      IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ));
          }
          ch.send(Mr{reinterpret_cast<uint64_t>(mem.data()), mr->rkey});
          if (round < kRounds) {
            ch.barrier();
            EXPECT_TRUE(has_pattern(std::span<const uint8_t>(mem.data(), 256), round));
          } else {
            ch.wait();
          }
          EXPECT_EQ(0, ibv_dereg_mr(mr));
        }
      });
}

// An atomic runs at the target, on its own memory, so it is atomic against
// the target's CPU and every initiator: a stopped target answers nothing
// until it is continued (a CAS through the window would have completed).
TEST(Link, AnAtomicIsExecutedByTheTarget) {
  two_process(
      [](Channel &ch) {  // the target
        RcEnd b;
        uint64_t *word = reinterpret_cast<uint64_t *>(b.buf.at(0));
        *word = 40;
        b.connect(ch);
        ch.wait();  // the link is up
        raise(SIGSTOP);
        ch.wait();
        EXPECT_EQ(*word, 42u);
      },
      [](Channel &ch) {  // the initiator
        RcEnd a;
        a.connect(ch);
        ASSERT_NO_FATAL_FAILURE(bring_link_up(a));
        ch.signal();
        const pid_t target = ch.peer_pid();
        ASSERT_TRUE(wait_stopped(target));
        ASSERT_EQ(0, fetch_add(a, 2, 2));
        EXPECT_TRUE(stays_empty(a.cq(), 50ms)) << "completed with the target stopped";
        kill(target, SIGCONT);
        ibv_wc wc = a.wait_wc();
        EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
        uint64_t old;
        memcpy(&old, a.buf.at(0), 8);
        EXPECT_EQ(old, 40u);
        ch.signal();
      });
}

// A thread that polls its CQ masks the node's doorbell (peers need not ring a node that
// polls), and the node promises to look at its lanes when the mask ends. A thread that then
// stops polling without arming a CQ leaves that look to the progress thread, asleep since
// before the mask: it must be woken for it. Before, a request posted under the mask waited
// for that thread's own next wake, up to a second (the membership period).
TEST(Link, ARequestPostedWhileTheTargetHadPolledIsServedWhenItsMaskEnds) {
  two_process(
      [](Channel &ch) {  // the target
        RcEnd b;
        b.connect(ch);
        ch.wait();  // the link is up
        for (int round = 0; round < 3; ++round) {
          std::this_thread::sleep_for(1200ms);  // the progress thread sleeps long by now
          ibv_wc wc;
          for (int i = 0; i < 200; ++i) ASSERT_EQ(ibv_poll_cq(b.cq(), 1, &wc), 0);
          ch.signal();  // polled just now: the mask holds for about a millisecond
          ch.wait();
        }
      },
      [](Channel &ch) {  // the initiator
        RcEnd a;
        a.connect(ch);
        ASSERT_NO_FATAL_FAILURE(bring_link_up(a));
        ch.signal();
        for (int round = 0; round < 3; ++round) {
          ch.wait();
          const auto t0 = std::chrono::steady_clock::now();
          ASSERT_EQ(0, fetch_add(a, 10 + round, 1));
          ibv_wc wc = a.wait_wc(5s);
          EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
          EXPECT_LT(std::chrono::steady_clock::now() - t0, 300ms) << "round " << round;
          ch.signal();
        }
      });
}

// A request in flight when its target dies fails within the timeout (the
// death is seen, not waited out): the target stops with an atomic in its
// lane, then is killed; the atomic and the WR behind it complete in error.
TEST(Link, ARequestInFlightFailsWhenItsTargetDies) {
  two_process(
      [](Channel &ch) {  // the initiator
        RcEnd a;
        a.connect(ch);
        ASSERT_NO_FATAL_FAILURE(bring_link_up(a));
        ch.signal();
        ASSERT_TRUE(wait_stopped(ch.peer_pid()));
        ASSERT_EQ(0, fetch_add(a, 2, 1));
        ASSERT_EQ(0, a.post_write(3, 64, 8, 64));  // waits behind the atomic
        EXPECT_TRUE(stays_empty(a.cq(), 50ms));
        auto killed = std::chrono::steady_clock::now();
        ch.kill_peer();
        ibv_wc wc = a.wait_wc(5s);
        EXPECT_EQ(wc.wr_id, 2u);
        EXPECT_EQ(wc.status, IBV_WC_RETRY_EXC_ERR);
        EXPECT_LT(std::chrono::steady_clock::now() - killed, 1s);  // not the answer's deadline
        wc = a.wait_wc(5s);
        EXPECT_EQ(wc.wr_id, 3u);
        EXPECT_EQ(wc.status, IBV_WC_WR_FLUSH_ERR);
      },
      [](Channel &ch) {  // the target
        RcEnd b;
        b.connect(ch);
        ch.wait();
        raise(SIGSTOP);  // killed while stopped
      });
}

// pcientb_query_work counts what the fabric did for each operation: a WRITE
// and a READ are one DMA descriptor each, with their bytes and no post; an
// atomic is posts into the target's lane and no DMA.
TEST(Link, TheFabricWorkOfEachOperationIsCounted) {
  two_process(
      [](Channel &ch) {  // the initiator
        RcEnd a;
        a.connect(ch);
        ASSERT_NO_FATAL_FAILURE(bring_link_up(a));
        ch.barrier();  // both links are up: nothing else moves now
        auto work = [&] {
          pcientb_work w{};
          EXPECT_EQ(0, pcientb_query_work(a.node.ctx.get(), &w));
          return w;
        };
        pcientb_work w0 = work();
        ASSERT_EQ(0, a.post_write(2, 0, 4096, 0));
        ASSERT_EQ(a.wait_wc().status, IBV_WC_SUCCESS);
        pcientb_work w1 = work();
        EXPECT_EQ(w1.dma_writes - w0.dma_writes, 1u);
        EXPECT_EQ(w1.dma_write_bytes - w0.dma_write_bytes, 4096u);
        EXPECT_EQ(w1.posts, w0.posts);
        ASSERT_EQ(0, a.post_read(3, 0, 4096, 8192));
        ASSERT_EQ(a.wait_wc().status, IBV_WC_SUCCESS);
        pcientb_work w2 = work();
        EXPECT_EQ(w2.dma_reads - w1.dma_reads, 1u);
        EXPECT_EQ(w2.dma_read_bytes - w1.dma_read_bytes, 4096u);
        EXPECT_EQ(w2.posts, w1.posts);
        ASSERT_EQ(0, fetch_add(a, 4, 1));
        ASSERT_EQ(a.wait_wc().status, IBV_WC_SUCCESS);
        pcientb_work w3 = work();
        EXPECT_GE(w3.posts - w2.posts, 1u);
        EXPECT_GE(w3.post_bytes - w2.post_bytes,
                  32u);  // the request: target, rkey, address, values
        EXPECT_EQ(w3.dma_writes, w2.dma_writes);
        EXPECT_EQ(w3.dma_reads, w2.dma_reads);
        // Strict mode: nothing of a peer is ever loaded from; by default the
        // peer's doorbell mask is looked at when it is rung (the atomic).
        if (const char *s = getenv("PCIENTB_NTB_STRICT"); s && strcmp(s, "1") == 0)
          EXPECT_EQ(w3.remote_reads, 0u);
        else
          EXPECT_GT(w3.remote_reads, w2.remote_reads);
        pcientb_work none{};
        EXPECT_EQ(EINVAL, pcientb_query_work(nullptr, &none));
        ch.signal();
      },
      [](Channel &ch) {  // the target
        RcEnd b;
        b.connect(ch);
        ASSERT_NO_FATAL_FAILURE(bring_link_up(b));
        ch.barrier();
        ch.wait();
      });
}

}  // namespace
}  // namespace pcientb::test
