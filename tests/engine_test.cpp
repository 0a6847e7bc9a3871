// The engine over the in-process fake backend (fake_fabric.hpp): two nodes in
// one process, driven through the engine's API, no libibverbs and no second
// process. What the verbs suites show between processes is shown here
// where one process must see both sides at once: every byte of a lane that
// wraps, the guard bytes around registered memory, the QP state rules.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <thread>

#include "engine_end.hpp"
#include "fake_fabric.hpp"

namespace pcientb::test {
namespace {

class EngineOnFake : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { fake::install(); }

  // Two ends, each on a node of its own, connected to each other.
  void connect_pair(size_t size = 1 << 20, uint32_t depth = 64) {
    a = std::make_unique<EngineEnd>("engine_a", size, depth);
    b = std::make_unique<EngineEnd>("engine_b", size, depth);
    ASSERT_EQ(0, a->connect(b->lid(), b->qpn()));
    ASSERT_EQ(0, b->connect(a->lid(), a->qpn()));
  }
  static ibv_wc one(EngineEnd &e) {
    auto wcs = e.poll(1, 5000);
    EXPECT_EQ(wcs.size(), 1u);
    return wcs.empty() ? ibv_wc{} : wcs[0];
  }

  std::unique_ptr<EngineEnd> a, b;
};

TEST_F(EngineOnFake, SendWriteReadAndAtomicBetweenTwoNodesOfOneProcess) {
  connect_pair();
  ASSERT_NE(a->lid(), b->lid());
  for (size_t i = 0; i < 8192; ++i) a->buf()[i] = static_cast<uint8_t>(i * 7);

  // SEND, inline-sized and pulled (larger than a record carries).
  for (uint32_t len : {100u, 5000u}) {
    ASSERT_EQ(0, b->post_recv(1, 65536, len));
    ASSERT_EQ(0, a->post_send(2, IBV_WR_SEND, 0, len));
    ibv_wc s = one(*a), r = one(*b);
    EXPECT_EQ(s.status, IBV_WC_SUCCESS);
    EXPECT_EQ(r.status, IBV_WC_SUCCESS);
    EXPECT_EQ(r.byte_len, len);
    EXPECT_EQ(0, memcmp(a->buf(), b->buf() + 65536, len));
  }
  // WRITE, then READ it back elsewhere.
  const uint64_t at = reinterpret_cast<uint64_t>(b->buf()) + 131072;
  ASSERT_EQ(0, a->post_send(3, IBV_WR_RDMA_WRITE, 0, 8192, at, b->rkey()));
  EXPECT_EQ(one(*a).status, IBV_WC_SUCCESS);
  EXPECT_EQ(0, memcmp(a->buf(), b->buf() + 131072, 8192));
  ASSERT_EQ(0, a->post_send(4, IBV_WR_RDMA_READ, 16384, 8192, at, b->rkey()));
  EXPECT_EQ(one(*a).status, IBV_WC_SUCCESS);
  EXPECT_EQ(0, memcmp(a->buf(), a->buf() + 16384, 8192));
  // Fetch-and-add 1, executed by the target; the old value comes back.
  const uint64_t word = reinterpret_cast<uint64_t>(b->buf()) + 262144;
  memcpy(b->buf() + 262144, "\x29\0\0\0\0\0\0\0", 8);
  ASSERT_EQ(0, a->post_send(5, IBV_WR_ATOMIC_FETCH_AND_ADD, 32768, 8, word, b->rkey()));
  EXPECT_EQ(one(*a).status, IBV_WC_SUCCESS);
  uint64_t old = 0, now = 0;
  memcpy(&old, a->buf() + 32768, 8);
  memcpy(&now, b->buf() + 262144, 8);
  EXPECT_EQ(old, 0x29u);
  EXPECT_EQ(now, 0x2au);
  // A wrong rkey is a remote access error, and touches nothing.
  ASSERT_EQ(0, a->post_send(6, IBV_WR_RDMA_WRITE, 0, 64, at, b->rkey() ^ 0x100));
  EXPECT_EQ(one(*a).status, IBV_WC_REM_ACCESS_ERR);
  EXPECT_TRUE(a->guards_intact());
  EXPECT_TRUE(b->guards_intact());
}

// Records of 1 to 16 cells fill the 2048-cell request lane many times over:
// each wrap leaves a pad record. Every message arrives whole and in order.
TEST_F(EngineOnFake, TheRequestLaneWrapsWithPadRecordsAndKeepsEveryMessageInOrder) {
  connect_pair();
  constexpr uint32_t kMessages = 3000, kWindow = 32;
  constexpr size_t kSlot = 1024;
  uint32_t sent = 0, received = 0, completed = 0;
  auto length = [](uint32_t i) { return 4 + (i * 37) % 960; };  // 1 to 16 cells
  for (uint32_t i = 0; i < kWindow; ++i) ASSERT_EQ(0, b->post_recv(i, i * kSlot, kSlot));
  while (received < kMessages) {
    while (sent < kMessages && sent - completed < kWindow) {
      uint8_t *m = a->buf() + (sent % kWindow) * kSlot;
      memcpy(m, &sent, 4);
      memset(m + 4, static_cast<int>(sent), length(sent) - 4);
      ASSERT_EQ(0, a->post_send(sent, IBV_WR_SEND, (sent % kWindow) * kSlot, length(sent)));
      ++sent;
    }
    for (const ibv_wc &wc : a->poll(0)) {
      ASSERT_EQ(wc.status, IBV_WC_SUCCESS);
      ASSERT_EQ(wc.wr_id, completed) << "send completions out of order";
      ++completed;
    }
    for (const ibv_wc &wc : b->poll(0)) {
      ASSERT_EQ(wc.status, IBV_WC_SUCCESS);
      const uint8_t *m = b->buf() + wc.wr_id * kSlot;
      uint32_t n;
      memcpy(&n, m, 4);
      ASSERT_EQ(n, received) << "messages out of order";
      ASSERT_EQ(wc.byte_len, length(n));
      for (uint32_t k = 4; k < wc.byte_len; ++k)
        ASSERT_EQ(m[k], static_cast<uint8_t>(n)) << "message " << n << " byte " << k;
      ++received;
      ASSERT_EQ(0, b->post_recv(wc.wr_id, wc.wr_id * kSlot, kSlot));
    }
  }
  EXPECT_TRUE(b->guards_intact());
}

// A requester whose window goes (or who dies) while the target pulls the
// bytes of its SEND leaves a torn message. As on an HCA, whose responder
// waits for the rest of it, the target completes nothing and its QP goes on;
// the receive stays taken until the QP fails, when it completes flushed. The
// requester, which lives, fails with a local protection error.
TEST_F(EngineOnFake, ATornMessageLeavesTheTargetQpAsItWasUntilItFails) {
  connect_pair();
  ASSERT_EQ(0, b->post_recv(6, 0, 64));  // a first message: the link is up
  ASSERT_EQ(0, a->post_send(0, IBV_WR_SEND, 0, 64));
  ASSERT_EQ(one(*a).status, IBV_WC_SUCCESS);
  ASSERT_EQ(one(*b).status, IBV_WC_SUCCESS);
  fake::deafen(b->lid(), true);  // b serves the SEND when it polls, after the window went
  ASSERT_EQ(0, b->post_recv(7, 0, 65536));
  ASSERT_EQ(0, a->post_send(1, IBV_WR_SEND, 0, 65536));  // pulled: larger than a record
  a->deregister();
  EXPECT_TRUE(b->poll(1, 100).empty()) << "the target completed a torn message";
  EXPECT_EQ(b->state(), IBV_QPS_RTS);
  ibv_wc wc = one(*a);
  EXPECT_EQ(wc.wr_id, 1u);
  EXPECT_EQ(wc.status, IBV_WC_LOC_PROT_ERR);
  fake::deafen(b->lid(), false);
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_ERR;
  ASSERT_EQ(0, engine::modify_qp(b->qp(), &attr, IBV_QP_STATE));
  wc = one(*b);
  EXPECT_EQ(wc.wr_id, 7u);
  EXPECT_EQ(wc.status, IBV_WC_WR_FLUSH_ERR);
  EXPECT_TRUE(b->poll(1, 50).empty());
}

// SENDs to a live target whose lane fills, whose receiver is not ready (RNR: everything
// sent goes back and is sent again) and which stops taking its lane for a while, again
// and again, are delayed but none fails: a WR fails for a full lane only when its QP
// could put nothing for a whole answer wait (1 s here). (The soak's "transport retry
// counter exceeded" to a live target: the wait was counted from the first time a WR
// found the lane full, even if it had waited in the backlog behind a go-back since. This
// test does not reproduce that case every time: the target's progress thread also takes
// its lane on its own schedule.) Each SEND takes 16 cells: the 2048-cell lane holds 128.
TEST_F(EngineOnFake, LaneFullAndGoBacksDelaySendsToALiveTargetButFailNone) {
  using std::chrono::milliseconds;
  using std::this_thread::sleep_for;
  a = std::make_unique<EngineEnd>("engine_busy_a", 1 << 20, 512);
  b = std::make_unique<EngineEnd>("engine_busy_b", 1 << 20, 512);
  ASSERT_EQ(0, a->connect(b->lid(), b->qpn()));
  ASSERT_EQ(0, b->connect(a->lid(), a->qpn(), 14, 7, 0));  // RNR timer 655 ms
  constexpr uint32_t kCount = 160, kLen = engine::kRecordInline;
  auto take = [&](int ms) {  // B takes its lane for a while, without receives
    fake::deafen(b->lid(), false);
    for (int i = 0; i < ms; ++i) {
      b->poll(0);
      sleep_for(milliseconds(1));
    }
    fake::deafen(b->lid(), true);
  };
  fake::deafen(b->lid(), true);
  for (uint32_t i = 0; i < kCount; ++i) ASSERT_EQ(0, a->post_send(i, IBV_WR_SEND, 0, kLen));
  take(50);  // RNR on SEND 0: what was sent goes back for 655 ms
  sleep_for(milliseconds(850));
  take(50);  // RNR again
  sleep_for(milliseconds(1350));
  for (uint32_t i = 0; i < kCount; ++i) ASSERT_EQ(0, b->post_recv(i, i * 1024ull, 1024));
  fake::deafen(b->lid(), false);
  size_t ok = 0;
  for (const ibv_wc &wc : a->poll(kCount, 20000)) {
    EXPECT_EQ(wc.status, IBV_WC_SUCCESS)
        << "wr " << wc.wr_id << ": " << ibv_wc_status_str(wc.status);
    ok += wc.status == IBV_WC_SUCCESS;
  }
  EXPECT_EQ(ok, kCount);
  EXPECT_EQ(b->poll(kCount, 20000).size(), kCount);
}

// A target whose pulls are slow (a busy host, pulls across a bridge) answers as it
// serves, not after a batch of them, and each answer restarts the requester's timer: a
// window of large SENDs that takes longer to serve than the answer timeout fails none and
// is sent once.
TEST_F(EngineOnFake, SlowPullsDelayAnswersButFailNoSend) {
  connect_pair(1 << 20, 256);
  constexpr uint32_t kCount = 128, kLen = 4096;  // pulled: over kRecordInline
  for (uint32_t i = 0; i < kCount; ++i) ASSERT_EQ(0, b->post_recv(i, i * kLen, kLen));
  fake::slow_reads(b->lid(), 20000);  // 2.6 s for them all
  for (uint32_t i = 0; i < kCount; ++i) ASSERT_EQ(0, a->post_send(i, IBV_WR_SEND, 0, kLen));
  size_t ok = 0;
  for (const ibv_wc &wc : a->poll(kCount, 30000)) {
    EXPECT_EQ(wc.status, IBV_WC_SUCCESS)
        << "wr " << wc.wr_id << ": " << ibv_wc_status_str(wc.status);
    ok += wc.status == IBV_WC_SUCCESS;
  }
  EXPECT_EQ(ok, kCount);
  EXPECT_EQ(b->poll(kCount, 30000).size(), kCount);
  fake::slow_reads(b->lid(), 0);
  EXPECT_EQ(a->qp()->stats->transport_retries.get(), 0u) << "requests were sent again";
  EXPECT_EQ(a->qp()->stats->rnr_retries.get(), 0u) << "requests were sent again";
}

// Inline SENDs keep the bytes they had when posted, even when they are sent again after
// receiver-not-ready answers and the caller reused its buffer at once: short ones (held
// in the WR itself) and longer ones (held on the heap), from one piece or several.
TEST_F(EngineOnFake, InlineSendsSentAgainAfterRnrCarryTheBytesOfTheirPost) {
  connect_pair();
  struct Msg {
    uint32_t len, pieces;
  };
  const Msg msgs[] = {{8, 1}, {64, 1}, {64, 3}, {65, 2}, {200, 4}, {256, 1}, {0, 1}};
  uint8_t data[256];
  for (size_t m = 0; m < std::size(msgs); ++m) {
    for (uint32_t i = 0; i < msgs[m].len; ++i) data[i] = static_cast<uint8_t>(m * 31 + i);
    ibv_sge sge[4];
    const uint32_t step = (msgs[m].len + msgs[m].pieces - 1) / msgs[m].pieces;
    for (uint32_t p = 0, at = 0; p < msgs[m].pieces; ++p, at += step) {
      const uint32_t n = std::min(step, msgs[m].len - std::min(at, msgs[m].len));
      sge[p] = ibv_sge{reinterpret_cast<uint64_t>(data + std::min(at, msgs[m].len)), n, 0};
    }
    ibv_send_wr wr{};
    wr.wr_id = m;
    wr.opcode = IBV_WR_SEND;
    wr.send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
    wr.sg_list = sge;
    wr.num_sge = static_cast<int>(msgs[m].pieces);
    ibv_send_wr *bad = nullptr;
    ASSERT_EQ(0, engine::post_send(a->qp(), &wr, &bad)) << "message " << m;
    memset(data, 0xee, sizeof data);
  }
  // No receive yet: B answers RNR, A sends everything again after the timer.
  for (int i = 0; i < 20; ++i) {
    EXPECT_TRUE(b->poll(0).empty());
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  for (size_t m = 0; m < std::size(msgs); ++m) ASSERT_EQ(0, b->post_recv(m, m * 1024, 1024));
  auto sends = a->poll(std::size(msgs), 5000);
  auto recvs = b->poll(std::size(msgs), 5000);
  ASSERT_EQ(sends.size(), std::size(msgs));
  ASSERT_EQ(recvs.size(), std::size(msgs));
  for (size_t m = 0; m < std::size(msgs); ++m) {
    EXPECT_EQ(sends[m].status, IBV_WC_SUCCESS) << "message " << m;
    EXPECT_EQ(recvs[m].status, IBV_WC_SUCCESS) << "message " << m;
    ASSERT_EQ(recvs[m].wr_id, m);
    ASSERT_EQ(recvs[m].byte_len, msgs[m].len);
    for (uint32_t i = 0; i < msgs[m].len; ++i)
      ASSERT_EQ(b->buf()[m * 1024 + i], static_cast<uint8_t>(m * 31 + i))
          << "message " << m << ", byte " << i;
  }
  EXPECT_GT(a->qp()->stats->rnr_retries.get(), 0u) << "no go-back happened: the test shows nothing";
}

// The QP state rules: transitions an HCA refuses leave the QP as it was.
TEST_F(EngineOnFake, RefusedTransitionsLeaveTheQpAsItWas) {
  a = std::make_unique<EngineEnd>("engine_rules", 4096);
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_RTS;
  EXPECT_EQ(EINVAL, engine::modify_qp(a->qp(), &attr, IBV_QP_STATE));  // RESET -> RTS
  EXPECT_EQ(a->state(), IBV_QPS_RESET);
  attr.qp_state = IBV_QPS_INIT;
  EXPECT_EQ(EINVAL, engine::modify_qp(a->qp(), &attr, IBV_QP_STATE));  // without its attributes
  EXPECT_EQ(a->state(), IBV_QPS_RESET);
  EXPECT_EQ(EINVAL, a->post_recv(1, 0, 64));  // no receives in RESET
  EXPECT_EQ(EINVAL, a->post_send(1, IBV_WR_SEND, 0, 64));
  ASSERT_EQ(0, a->connect(a->lid(), a->qpn()));  // to itself: loopback
  EXPECT_EQ(a->state(), IBV_QPS_RTS);
  attr.qp_state = IBV_QPS_RTR;
  EXPECT_EQ(EINVAL, engine::modify_qp(a->qp(), &attr, IBV_QP_STATE));  // RTS -> RTR
  EXPECT_EQ(a->state(), IBV_QPS_RTS);
}

}  // namespace
}  // namespace pcientb::test
