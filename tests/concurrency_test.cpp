// Several threads posting at once: the provider's data path must be safe to
// call concurrently (as verbs requires), and no byte may go astray.
#include "verbs_helpers.hpp"

#include <cstring>
#include <exception>
#include <memory>
#include <thread>

namespace pcientb::test {
namespace {

constexpr uint32_t kThreads = 4, kRounds = 64, kChunk = 16 * 1024;
constexpr size_t kRegion = size_t{kRounds} * kChunk;  // one thread's share of the buffer

uint32_t seed_of(uint32_t thread, uint32_t round) {
  return thread * 1000 + round;
}

// Runs body(i) on n threads; an exception in one becomes a test failure.
template <class Body>
void on_threads(uint32_t n, Body body) {
  std::vector<std::thread> threads;
  for (uint32_t i = 0; i < n; ++i)
    threads.emplace_back([&, i] {
      try {
        body(i);
      } catch (const std::exception &e) {
        ADD_FAILURE() << "thread " << i << ": " << e.what();
      }
    });
  for (auto &t : threads) t.join();
}

// One node, one buffer, kThreads RC QPs (each with its own CQ).
struct ManyQps {
  explicit ManyQps(size_t buffer_size) : buf(node.pd.get(), buffer_size) {
    for (uint32_t i = 0; i < kThreads; ++i) qps.push_back(std::make_unique<RcQp>(node));
  }
  void connect(Channel &ch) {
    for (auto &qp : qps) qp->connect(ch, qp->endpoint(node, buf), {});
  }
  Node node;
  Buffer buf;
  std::vector<std::unique_ptr<RcQp>> qps;
};

// Thread t, round r: RDMA WRITE 16 KiB to the peer's region t, slot r, then a
// SEND naming (t, r). When the SEND arrives the peer checks the data. At the
// end each thread reads its whole region back and checks it.
TEST(Concurrency, ThreadsPostingOnTheirOwnQpsAllLand) {
  two_process(
      [](Channel &ch) {
        // Local: the sources in [0, 4 regions), the read-back in [4, 8).
        ManyQps a(2 * kThreads * kRegion);
        a.connect(ch);
        on_threads(kThreads, [&](uint32_t t) {
          RcQp &rc = *a.qps[t];
          uint32_t outstanding = 0;
          for (uint32_t r = 0; r < kRounds; ++r) {
            size_t off = t * kRegion + r * kChunk;
            fill_pattern(a.buf.span(off, kChunk), seed_of(t, r));
            ASSERT_EQ(0, SendWr(IBV_WR_RDMA_WRITE, r, 0)
                             .sge(a.buf.sge(off, kChunk))
                             .remote(rc.remote.addr + off, rc.remote.rkey)
                             .post(rc.qp.get()));
            ASSERT_EQ(0, SendWr(IBV_WR_SEND, r).sge(a.buf.sge(off, 8)).post(rc.qp.get()));
            if (++outstanding == 8) {
              for (auto &wc : wait_wcs(rc.cq.get(), outstanding))
                ASSERT_EQ(wc.status, IBV_WC_SUCCESS);
              outstanding = 0;
            }
          }
          wait_wcs(rc.cq.get(), outstanding);
          size_t back = (kThreads + t) * kRegion;
          ASSERT_EQ(0, SendWr(IBV_WR_RDMA_READ, 1000)
                           .sge(a.buf.sge(back, kRegion))
                           .remote(rc.remote.addr + t * kRegion, rc.remote.rkey)
                           .post(rc.qp.get()));
          ASSERT_EQ(wait_wc(rc.cq.get()).status, IBV_WC_SUCCESS);
          for (uint32_t r = 0; r < kRounds; ++r)
            ASSERT_TRUE(has_pattern(a.buf.span(back + r * kChunk, kChunk), seed_of(t, r)))
                << "thread " << t << " round " << r;
        });
        ch.signal();
      },
      [](Channel &ch) {
        // The regions the peer writes, then a scratch slot per QP for the
        // SENDs (each QP's receives are completed by its own thread).
        ManyQps b(kThreads * kRegion + 4096);
        for (uint32_t t = 0; t < kThreads; ++t)
          for (uint32_t r = 0; r < kRounds; ++r)
            ASSERT_EQ(
                0,
                RecvWr(r).sge(b.buf.sge(kThreads * kRegion + 64 * t, 8)).post(b.qps[t]->qp.get()));
        b.connect(ch);
        on_threads(kThreads, [&](uint32_t t) {
          for (uint32_t r = 0; r < kRounds; ++r) {
            ibv_wc wc = wait_wc(b.qps[t]->cq.get());
            ASSERT_EQ(wc.status, IBV_WC_SUCCESS);
            ASSERT_EQ(wc.wr_id, r);
            ASSERT_TRUE(has_pattern(b.buf.span(t * kRegion + r * kChunk, kChunk), seed_of(t, r)))
                << "thread " << t << " round " << r
                << ": the SEND overtook its WRITE or data went astray";
          }
        });
        ch.wait();
      });
}

// Threads post concurrently on ONE QP (post_send must be thread-safe): every
// WR is executed exactly once.
TEST(Concurrency, ThreadsPostingOnOneSharedQpAllLand) {
  constexpr uint32_t kPerThread = 16, kSize = 4096;
  RcOptions options;
  options.buffer_size = kThreads * kPerThread * kSize;
  options.max_send_wr = kThreads * kPerThread;
  two_process(
      [&](Channel &ch) {
        RcEnd a(options);
        a.connect(ch);
        on_threads(kThreads, [&](uint32_t t) {
          for (uint32_t i = 0; i < kPerThread; ++i) {
            size_t off = (t * kPerThread + i) * kSize;
            fill_pattern(a.buf.span(off, kSize), seed_of(t, i));
            ASSERT_EQ(0, a.post_write(t * kPerThread + i, off, kSize, off));
          }
        });
        auto wcs = wait_wcs(a.cq(), kThreads * kPerThread);
        std::vector<int> seen(kThreads * kPerThread, 0);
        for (auto &wc : wcs) {
          EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
          ASSERT_LT(wc.wr_id, seen.size());
          ++seen[wc.wr_id];
        }
        EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), static_cast<long>(seen.size()))
            << "a WR completed twice or not at all";
        ch.signal();
      },
      [&](Channel &ch) {
        RcEnd b(options);
        b.connect(ch);
        ch.wait();
        for (uint32_t t = 0; t < kThreads; ++t)
          for (uint32_t i = 0; i < kPerThread; ++i)
            EXPECT_TRUE(
                has_pattern(b.buf.span((t * kPerThread + i) * kSize, kSize), seed_of(t, i)));
      });
}

}  // namespace
}  // namespace pcientb::test
