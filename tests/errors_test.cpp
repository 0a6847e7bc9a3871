// The error model: remote access violations, RNR, local protection and length
// errors, a peer that dies, and invalid arguments. As a ConnectX HCA behaves:
// a failed WR completes with the IB status, the QP goes to ERR, later WRs are
// flushed, and memory outside what was granted is never touched.
#include "verbs_helpers.hpp"

#include <arpa/inet.h>
#include <sys/wait.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstring>
#include <functional>
#include <span>
#include <thread>

namespace pcientb::test {
namespace {

// ---- remote access violations -----------------------------------------------------

struct TargetOptions {
  int mr_access = kAllAccess;
  int qp_access = kRemoteAll;
  bool mr_on_another_pd = false;
};

constexpr size_t kTargetMemory = 16384, kMrOffset = 4096, kMrLength = 8192;

// The target of the remote-access tests: 16 KiB of memory of which only the
// middle 8 KiB are registered, so a stray access is visible on either side.
struct Target {
  explicit Target(const TargetOptions &options)
      : other_pd(alloc_pd(node.ctx.get())),
        mr(reg_mr(options.mr_on_another_pd ? other_pd.get() : node.pd.get(), mem.data() + kMrOffset,
                  kMrLength, options.mr_access)),
        rc(node, rc_options(options)) {}

  static RcOptions rc_options(const TargetOptions &options) {
    RcOptions rc;
    rc.params.access = options.qp_access;
    return rc;
  }
  // The advertised range is the registered one.
  Endpoint endpoint() const {
    Endpoint ep;
    ep.lid = node.lid();
    ep.qpn = rc.qp->qp_num;
    ep.psn = rc.psn;
    ep.rkey = mr->rkey;
    ep.addr = reinterpret_cast<uintptr_t>(mem.data()) + kMrOffset;
    ep.length = kMrLength;
    ep.gid = node.gid;
    return ep;
  }
  void connect(Channel &ch) { rc.connect(ch, endpoint(), {}); }

  Node node;
  PdPtr other_pd;
  std::vector<uint8_t> mem = std::vector<uint8_t>(kTargetMemory, 0);
  MrPtr mr;
  RcQp rc;
};

using BadWr = std::function<SendWr(RcEnd &)>;

// The requester posts the bad WR (wr_id 1) and then a valid WRITE (wr_id 2):
// the bad one fails with `status`, the next is flushed, the QP is in ERR, and
// none of the target's 16 KiB changed.
void expect_rejected(const TargetOptions &target, const BadWr &bad,
                     ibv_wc_status status = IBV_WC_REM_ACCESS_ERR) {
  two_process(
      [&](Channel &ch) {
        RcEnd a;
        a.connect(ch);
        fill_pattern(a.buf.span(0, 16384), 1);
        ASSERT_EQ(0, bad(a).post(a.qp()));
        ASSERT_EQ(0, a.post_write(2, 0, 64, 0));
        auto wcs = wait_wcs(a.cq(), 2);
        EXPECT_EQ(wcs[0].wr_id, 1u);
        EXPECT_EQ(wcs[0].status, status);
        EXPECT_EQ(wcs[1].wr_id, 2u);
        EXPECT_EQ(wcs[1].status, IBV_WC_WR_FLUSH_ERR);
        EXPECT_EQ(query_state(a.qp()), IBV_QPS_ERR);
        ch.signal();
      },
      [&](Channel &ch) {
        Target t(target);
        t.connect(ch);
        ch.wait();
        EXPECT_TRUE(all_bytes_are(t.mem, 0)) << "a rejected access changed the target's memory";
      });
}

SendWr write(RcEnd &a, uint64_t remote_addr, uint32_t rkey, uint32_t length = 64) {
  return std::move(SendWr(IBV_WR_RDMA_WRITE, 1).sge(a.sge(0, length)).remote(remote_addr, rkey));
}
// Longer than a request record carries: the requester places the bytes, as a WRITE's.
SendWr write_imm(RcEnd &a, uint64_t remote_addr, uint32_t rkey, uint32_t length = 4096) {
  return std::move(
      SendWr(IBV_WR_RDMA_WRITE_WITH_IMM, 1).sge(a.sge(0, length)).remote(remote_addr, rkey).imm(7));
}
SendWr read(RcEnd &a, uint64_t remote_addr, uint32_t rkey, uint32_t length = 64) {
  return std::move(SendWr(IBV_WR_RDMA_READ, 1).sge(a.sge(8192, length)).remote(remote_addr, rkey));
}
SendWr fetch_add(RcEnd &a, uint64_t remote_addr, uint32_t rkey) {
  return std::move(SendWr(IBV_WR_ATOMIC_FETCH_AND_ADD, 1)
                       .sge(a.sge(8192, 8))
                       .remote(remote_addr, rkey)
                       .compare_add(1));
}

TEST(RcWrite, BadRkeyFailsWithRemAccessErr) {
  expect_rejected({}, [](RcEnd &a) { return write(a, a.raddr(0), a.rkey() ^ 0x00ff0f00); });
}

TEST(RcWrite, PastTheEndOfTheMrFailsWithRemAccessErr) {
  expect_rejected({}, [](RcEnd &a) { return write(a, a.raddr(kMrLength - 32), a.rkey(), 64); });
}

TEST(RcWrite, OneByteBeforeTheMrFailsWithRemAccessErr) {
  expect_rejected({}, [](RcEnd &a) { return write(a, a.raddr(0) - 1, a.rkey(), 64); });
}

TEST(RcWrite, AddressThatWrapsAroundFailsWithRemAccessErr) {
  expect_rejected({}, [](RcEnd &a) { return write(a, ~uint64_t{0} - 15, a.rkey(), 64); });
}

TEST(RcWrite, WriteToReadonlyMrFailsWithRemAccessErr) {
  expect_rejected({.mr_access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ},
                  [](RcEnd &a) { return write(a, a.raddr(0), a.rkey()); });
}

TEST(RcWrite, QpWithoutRemoteWriteAccessFailsWithRemAccessErr) {
  expect_rejected({.qp_access = IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC},
                  [](RcEnd &a) { return write(a, a.raddr(0), a.rkey()); });
}

TEST(RcWrite, MrOfAnotherPdThanTheTargetQpFailsWithRemAccessErr) {
  expect_rejected({.mr_on_another_pd = true},
                  [](RcEnd &a) { return write(a, a.raddr(0), a.rkey()); });
}

TEST(RcWriteWithImm, LargeWithABadRkeyFailsWithRemAccessErr) {
  expect_rejected({}, [](RcEnd &a) { return write_imm(a, a.raddr(0), a.rkey() ^ 0x00ff0f00); });
}

TEST(RcWriteWithImm, LargePastTheEndOfTheMrFailsWithRemAccessErr) {
  expect_rejected({}, [](RcEnd &a) { return write_imm(a, a.raddr(kMrLength - 4000), a.rkey()); });
}

TEST(RcRead, BadRkeyFailsWithRemAccessErr) {
  expect_rejected({}, [](RcEnd &a) { return read(a, a.raddr(0), a.rkey() ^ 0x00ff0f00); });
}

TEST(RcRead, PastTheEndOfTheMrFailsWithRemAccessErr) {
  expect_rejected({}, [](RcEnd &a) { return read(a, a.raddr(kMrLength - 1), a.rkey(), 2); });
}

TEST(RcRead, MrWithoutRemoteReadFailsWithRemAccessErr) {
  expect_rejected({.mr_access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE},
                  [](RcEnd &a) { return read(a, a.raddr(0), a.rkey()); });
}

TEST(RcRead, QpWithoutRemoteReadAccessFailsWithRemAccessErr) {
  expect_rejected({.qp_access = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC},
                  [](RcEnd &a) { return read(a, a.raddr(0), a.rkey()); });
}

TEST(RcAtomic, MrWithoutRemoteAtomicFailsWithRemAccessErr) {
  expect_rejected(
      {.mr_access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ},
      [](RcEnd &a) { return fetch_add(a, a.raddr(0), a.rkey()); });
}

TEST(RcAtomic, QpWithoutRemoteAtomicAccessFailsWithRemAccessErr) {
  expect_rejected({.qp_access = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ},
                  [](RcEnd &a) { return fetch_add(a, a.raddr(0), a.rkey()); });
}

// IB: an atomic on an address not 8-byte aligned is an Invalid Request NAK.
TEST(RcAtomic, MisalignedAddressFailsWithRemInvReqErr) {
  expect_rejected(
      {}, [](RcEnd &a) { return fetch_add(a, a.raddr(4), a.rkey()); }, IBV_WC_REM_INV_REQ_ERR);
}

// ---- RNR ------------------------------------------------------------------------------

// With no receive posted and rnr_retry N < 7, the SEND is retried N times and
// then fails with IBV_WC_RNR_RETRY_EXC_ERR.
class RnrRetry : public ::testing::TestWithParam<int> {};

TEST_P(RnrRetry, NoReceivePostedExhaustsTheRetries) {
  RcOptions requester;
  requester.params.rnr_retry = static_cast<uint8_t>(GetParam());
  RcOptions responder;
  responder.params.min_rnr_timer = 1;  // 0.01 ms: the retries are quick
  two_process(
      [&](Channel &ch) {
        RcEnd a(requester);
        a.connect(ch);
        ASSERT_EQ(0, a.post_send(1, 0, 64));
        ASSERT_EQ(0, a.post_send(2, 0, 64));
        auto wcs = wait_wcs(a.cq(), 2);
        EXPECT_EQ(wcs[0].status, IBV_WC_RNR_RETRY_EXC_ERR);
        EXPECT_EQ(wcs[1].status, IBV_WC_WR_FLUSH_ERR);
        EXPECT_EQ(query_state(a.qp()), IBV_QPS_ERR);
        ch.signal();
      },
      [&](Channel &ch) {
        RcEnd b(responder);  // posts no receive
        b.connect(ch);
        ch.wait();
        EXPECT_TRUE(stays_empty(b.cq(), 50ms));
      });
}
INSTANTIATE_TEST_SUITE_P(Rnr, RnrRetry, ::testing::Range(0, 7),
                         [](const auto &info) { return "RnrRetry" + std::to_string(info.param); });

TEST(Rnr, InfiniteRetryCompletesOnceThePeerPostsAReceive) {
  two_process(
      [](Channel &ch) {
        RcEnd a;  // rnr_retry = 7
        a.connect(ch);
        fill_pattern(a.buf.span(0, 2048), 2);
        ASSERT_EQ(0, a.post_send(1, 0, 2048));
        EXPECT_TRUE(stays_empty(a.cq(), 300ms)) << "the SEND completed without a receive";
        ch.signal();  // now post one
        ibv_wc wc = a.wait_wc();
        EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
        EXPECT_EQ(query_state(a.qp()), IBV_QPS_RTS);
        ch.signal();
      },
      [](Channel &ch) {
        RcEnd b;
        b.connect(ch);
        ch.wait();
        ASSERT_EQ(0, b.post_recv(1, 0, 4096));
        ibv_wc wc = b.wait_wc();
        EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
        EXPECT_EQ(wc.byte_len, 2048u);
        EXPECT_TRUE(has_pattern(b.buf.span(0, 2048), 2));
        ch.wait();  // the QP stays until the requester has checked its state
      });
}

// WRITEs with immediate whose bytes the requester places: refused for want of a receive,
// they go back and are placed again, and the one after waits its turn (RC order).
TEST(Rnr, LargeWritesWithImmWaitForAReceiveAndArriveInOrder) {
  two_process(
      [](Channel &ch) {
        RcEnd a;
        a.connect(ch);
        for (uint32_t i = 0; i < 2; ++i) {
          fill_pattern(a.buf.span(i * 4096, 4096), 10 + i);
          ASSERT_EQ(0, SendWr(IBV_WR_RDMA_WRITE_WITH_IMM, i)
                           .sge(a.sge(i * 4096, 4096))
                           .remote(a.raddr(8192 + i * 4096), a.rkey())
                           .imm(100 + i)
                           .post(a.qp()));
        }
        EXPECT_TRUE(stays_empty(a.cq(), 300ms)) << "a WRITE with immediate took no receive";
        ch.signal();  // now post them
        auto wcs = wait_wcs(a.cq(), 2);
        for (uint32_t i = 0; i < 2; ++i) {
          EXPECT_EQ(wcs[i].wr_id, i);
          EXPECT_EQ(wcs[i].status, IBV_WC_SUCCESS);
        }
        ch.signal();
      },
      [](Channel &ch) {
        RcEnd b;
        b.connect(ch);
        ch.wait();
        for (uint32_t i = 0; i < 2; ++i) ASSERT_EQ(0, b.post_recv(i, 32768, 16));
        auto wcs = wait_wcs(b.cq(), 2);
        for (uint32_t i = 0; i < 2; ++i) {
          EXPECT_EQ(wcs[i].status, IBV_WC_SUCCESS);
          EXPECT_EQ(wcs[i].wr_id, i);
          EXPECT_EQ(wcs[i].byte_len, 4096u);
          EXPECT_EQ(ntohl(wcs[i].imm_data), 100 + i);
          EXPECT_TRUE(has_pattern(b.buf.span(8192 + i * 4096, 4096), 10 + i));
        }
        ch.wait();
      });
}

// ---- local errors -----------------------------------------------------------------------

TEST(LocalError, InvalidLkeyFailsWithLocProtErrAndSendsNothing) {
  two_process(
      [](Channel &ch) {
        RcEnd a;
        a.connect(ch);
        ibv_sge bad = a.sge(0, 64);
        bad.lkey ^= 0x00ff0f00;
        ASSERT_EQ(0, SendWr(IBV_WR_SEND, 1).sge(bad).post(a.qp()));
        ASSERT_EQ(0, a.post_send(2, 0, 64));
        auto wcs = wait_wcs(a.cq(), 2);
        EXPECT_EQ(wcs[0].status, IBV_WC_LOC_PROT_ERR);
        EXPECT_EQ(wcs[1].status, IBV_WC_WR_FLUSH_ERR);
        EXPECT_EQ(query_state(a.qp()), IBV_QPS_ERR);
        ch.signal();
      },
      [](Channel &ch) {
        RcEnd b;
        ASSERT_EQ(0, b.post_recv(1, 0, 4096));
        b.connect(ch);
        ch.wait();
        EXPECT_TRUE(stays_empty(b.cq(), 100ms)) << "a SEND with a bad lkey was delivered";
      });
}

TEST(LocalError, SgeBeyondTheLocalMrFailsWithLocProtErr) {
  two_process(
      [](Channel &ch) {
        RcEnd a;
        a.connect(ch);
        ASSERT_EQ(0, a.post_write(1, a.buf.bytes.size() - 16, 32, 0));
        EXPECT_EQ(a.wait_wc().status, IBV_WC_LOC_PROT_ERR);
        ch.signal();
      },
      [](Channel &ch) {
        RcEnd b;
        b.connect(ch);
        ch.wait();
        EXPECT_TRUE(all_bytes_are(b.buf.span(0, 64), 0));
      });
}

// The data of an RDMA READ is written locally: the local MR needs LOCAL_WRITE.
TEST(LocalError, ReadIntoAnMrWithoutLocalWriteFailsWithLocProtErr) {
  RcOptions requester;
  requester.mr_access = IBV_ACCESS_REMOTE_READ;
  two_process(
      [&](Channel &ch) {
        RcEnd a(requester);
        a.connect(ch);
        ch.wait();
        ASSERT_EQ(0, a.post_read(1, 0, 64, 0));
        EXPECT_EQ(a.wait_wc().status, IBV_WC_LOC_PROT_ERR);
        EXPECT_TRUE(all_bytes_are(a.buf.span(0, 64), 0));
        ch.signal();
      },
      [&](Channel &ch) {
        RcEnd b;
        b.connect(ch);
        fill_pattern(b.buf.span(0, 64), 3);
        ch.signal();
        ch.wait();
      });
}

// A SEND larger than the receive buffer: the requester sees
// IBV_WC_REM_INV_REQ_ERR, the responder IBV_WC_LOC_LEN_ERR.
// The target checks the receive, for messages inline in their record and
// for those it pulls from the requester.
struct TooSmall {
  uint32_t receive, message;
};
class ReceiveTooSmall : public ::testing::TestWithParam<TooSmall> {};
TEST_P(ReceiveTooSmall, FailsOnBothSides) {
  const TooSmall p = GetParam();
  two_process(
      [&](Channel &ch) {
        RcEnd a;
        a.connect(ch);
        ASSERT_EQ(0, a.post_send(1, 0, p.message));
        EXPECT_EQ(a.wait_wc().status, IBV_WC_REM_INV_REQ_ERR);
        EXPECT_EQ(query_state(a.qp()), IBV_QPS_ERR);
        ch.signal();
      },
      [&](Channel &ch) {
        RcEnd b;
        ASSERT_EQ(0, b.post_recv(1, 0, p.receive));
        b.connect(ch);
        ibv_wc wc = b.wait_wc();
        EXPECT_EQ(wc.wr_id, 1u);
        EXPECT_EQ(wc.status, IBV_WC_LOC_LEN_ERR);
        EXPECT_TRUE(all_bytes_are(b.buf.span(p.receive, 64), 0))
            << "written past the receive buffer";
        ch.wait();
      });
}
INSTANTIATE_TEST_SUITE_P(LocalError, ReceiveTooSmall,
                         ::testing::Values(TooSmall{16, 64}, TooSmall{4, 8}, TooSmall{23, 24},
                                           TooSmall{0, 1}, TooSmall{1024, 2048}));

// A receive whose lkey is invalid: the responder sees IBV_WC_LOC_PROT_ERR, the
// requester IBV_WC_REM_OP_ERR, for messages of every size.
class ReceiveWithAnInvalidLkey : public ::testing::TestWithParam<uint32_t> {};
TEST_P(ReceiveWithAnInvalidLkey, FailsOnBothSides) {
  const uint32_t message = GetParam();
  two_process(
      [&](Channel &ch) {
        RcEnd a;
        a.connect(ch);
        ASSERT_EQ(0, a.post_send(1, 0, message));
        EXPECT_EQ(a.wait_wc().status, IBV_WC_REM_OP_ERR);
        ch.signal();
      },
      [&](Channel &ch) {
        RcEnd b;
        ibv_sge bad = b.sge(0, 4096);
        bad.lkey ^= 0x00ff0f00;
        ASSERT_EQ(0, RecvWr(1).sge(bad).post(b.qp()));
        b.connect(ch);
        ibv_wc wc = b.wait_wc();
        EXPECT_EQ(wc.status, IBV_WC_LOC_PROT_ERR);
        ch.wait();
      });
}
INSTANTIATE_TEST_SUITE_P(LocalError, ReceiveWithAnInvalidLkey, ::testing::Values(64u, 8u, 0u));

// Memory deregistered under a posted receive: the receive completes with
// IBV_WC_LOC_PROT_ERR and the QP fails, the sender is told
// IBV_WC_REM_OP_ERR, and nothing is written anywhere.
TEST(LocalError, ReceiveWhoseMemoryWasDeregisteredFailsTheReceiver) {
  two_process(
      [](Channel &ch) {
        RcEnd a;
        a.connect(ch);
        ch.wait();  // the peer deregistered
        fill_pattern(a.buf.span(0, 8), 3);
        ASSERT_EQ(0, a.post_send(1, 0, 8));
        EXPECT_EQ(a.wait_wc().status, IBV_WC_REM_OP_ERR);
        ch.wait();
      },
      [](Channel &ch) {
        RcEnd b;
        Buffer other(b.node.pd.get(), 4096, IBV_ACCESS_LOCAL_WRITE);
        ASSERT_EQ(0, RecvWr(7).sge(other.sge(0, 64)).post(b.qp()));
        ASSERT_EQ(0, b.post_recv(8, 0, 64));
        b.connect(ch);
        other.mr.reset();
        ch.signal();
        ibv_wc wc = b.wait_wc();
        EXPECT_EQ(wc.wr_id, 7u);
        EXPECT_EQ(wc.status, IBV_WC_LOC_PROT_ERR);
        EXPECT_TRUE(all_bytes_are(other.span(0, 4096), 0));
        wc = b.wait_wc();
        EXPECT_EQ(wc.wr_id, 8u);
        EXPECT_EQ(wc.status, IBV_WC_WR_FLUSH_ERR);
        EXPECT_EQ(query_state(b.qp()), IBV_QPS_ERR);
        ch.signal();
      });
}

// ---- a peer that dies --------------------------------------------------------------------

RcOptions short_timeouts() {
  RcOptions options;
  options.params.timeout = 10;  // ~4 ms
  options.params.retry_cnt = 3;
  return options;
}

// How the survivor learns that its peer died, as on an HCA whose transport
// retries ran out: `failed` holds the completions from the first unsuccessful
// one on; that one fails with IBV_WC_RETRY_EXC_ERR, the rest are flushed, and
// the QP is in ERR.
void expect_peer_death_reported(std::span<const ibv_wc> failed, RcEnd &a) {
  ASSERT_FALSE(failed.empty());
  EXPECT_EQ(failed[0].status, IBV_WC_RETRY_EXC_ERR) << "wr_id " << failed[0].wr_id;
  for (size_t i = 1; i < failed.size(); ++i)
    EXPECT_EQ(failed[i].status, IBV_WC_WR_FLUSH_ERR) << "wr_id " << failed[i].wr_id;
  EXPECT_EQ(query_state(a.qp()), IBV_QPS_ERR);
}

// As an HCA: a QP whose peer died but that sends nothing learns nothing; its
// posted receives stay posted and it stays in RTS.
TEST(PeerDeath, AnIdleQpIsLeftAlone) {
  two_process(
      [](Channel &ch) {
        RcEnd a(short_timeouts());
        ASSERT_EQ(0, a.post_recv(1, 0, 64));
        a.connect(ch);
        ch.kill_peer();
        EXPECT_TRUE(stays_empty(a.cq(), 300ms));
        EXPECT_EQ(query_state(a.qp()), IBV_QPS_RTS);
      },
      [](Channel &ch) {
        RcEnd b(short_timeouts());
        b.connect(ch);
        ch.wait();
      });
}

// ---- completions that cannot be written ------------------------------------------------

// Receive queue slots free up as messages arrive, so a receiver that posts
// receives but never polls overruns its CQ. As an HCA does, that fails the QP
// whose completion was lost: IBV_EVENT_CQ_ERR for the CQ, IBV_EVENT_QP_FATAL
// for the QP, which is in ERR.
TEST(CqOverrun, FailsTheQpWithCqErrAndQpFatal) {
  constexpr int kRounds = 80;  // 80 x 64 receive completions: more than any CQ holds
  constexpr int kBatch = 64;
  two_process(
      [&](Channel &ch) {
        RcEnd a(short_timeouts());
        a.connect(ch);
        for (int r = 0; r < kRounds; ++r) {
          ch.wait();  // the peer posted a batch of receives
          for (int i = 0; i < kBatch; ++i) ASSERT_EQ(0, a.post_send(i, 0, 8));
          wait_wcs(a.cq(), kBatch);
          ch.signal();
        }
      },
      [&](Channel &ch) {
        // Receives stay taken until their completions are polled (as on
        // mlx5): the receive queue holds every round, the CQ cannot.
        RcOptions options = short_timeouts();
        options.max_recv_wr = kRounds * kBatch;
        options.cqe = kBatch;
        RcEnd b(options);
        b.connect(ch);
        for (int r = 0; r < kRounds; ++r) {
          for (int i = 0; i < kBatch; ++i) ASSERT_EQ(0, b.post_recv(i, 0, 8));
          ch.signal();
          ch.wait();
        }
        bool cq_err = false, qp_fatal = false;
        auto deadline = std::chrono::steady_clock::now() + 3s;
        while (!(cq_err && qp_fatal) && std::chrono::steady_clock::now() < deadline) {
          auto event = wait_async_event(b.node.ctx.get(), 500ms);
          if (!event) continue;
          if (event->event_type == IBV_EVENT_CQ_ERR) cq_err = event->element.cq == b.cq();
          if (event->event_type == IBV_EVENT_QP_FATAL) qp_fatal = event->element.qp == b.qp();
        }
        EXPECT_TRUE(cq_err) << "no IBV_EVENT_CQ_ERR for the CQ";
        EXPECT_TRUE(qp_fatal) << "no IBV_EVENT_QP_FATAL for the QP";
        EXPECT_EQ(query_state(b.qp()), IBV_QPS_ERR);
      });
}

// The SEND waits for a receive (RNR, retried forever) when the peer is
// SIGKILLed: both posted WRs complete in error, nothing hangs.
TEST(PeerDeath, SendWaitingForAReceiveFailsWhenThePeerIsKilled) {
  two_process(
      [](Channel &ch) {
        RcEnd a(short_timeouts());
        a.connect(ch);
        ASSERT_EQ(0, a.post_send(1, 0, 64));
        ASSERT_EQ(0, a.post_send(2, 0, 64));
        EXPECT_TRUE(stays_empty(a.cq(), 100ms));
        ch.kill_peer();
        auto wcs = wait_wcs(a.cq(), 2);
        expect_peer_death_reported(wcs, a);
      },
      [](Channel &ch) {
        RcEnd b(short_timeouts());  // posts no receive
        b.connect(ch);
        ch.wait();  // until killed
      });
}

// The peer died a while ago and the QP has been idle since: WRs posted now
// fail.
TEST(PeerDeath, WorkPostedAfterThePeerWasKilledFails) {
  two_process(
      [](Channel &ch) {
        RcEnd a(short_timeouts());
        a.connect(ch);
        ch.kill_peer();
        std::this_thread::sleep_for(200ms);
        ASSERT_EQ(0, a.post_write(1, 0, 64, 0));
        ASSERT_EQ(0, a.post_read(2, 0, 64, 0));
        auto wcs = wait_wcs(a.cq(), 2);
        expect_peer_death_reported(wcs, a);
      },
      [](Channel &ch) {
        RcEnd b(short_timeouts());
        b.connect(ch);
        ch.wait();
      });
}

// No success for data that went to a dead process: work posted the moment
// the peer has been killed and reaped fails, every time, with no grace period.
TEST(PeerDeath, WorkPostedRightAfterThePeerIsReapedNeverSucceeds) {
  for (int round = 0; round < 5; ++round) {
    two_process(
        [](Channel &ch) {
          RcEnd a(short_timeouts());
          a.connect(ch);
          ASSERT_EQ(0, a.post_write(100, 0, 64, 0));  // the peer is alive: this one lands
          ASSERT_EQ(a.wait_wc().status, IBV_WC_SUCCESS);
          ch.kill_peer();  // killed and reaped
          for (uint64_t i = 0; i < 4; ++i) ASSERT_EQ(0, a.post_write(i, 0, 64, 0));
          expect_peer_death_reported(wait_wcs(a.cq(), 4), a);
        },
        [](Channel &ch) {
          RcEnd b(short_timeouts());
          b.connect(ch);
          ch.wait();
        });
  }
}

// The peer closes its QP and device in an orderly way (and exits): the next
// WRs fail as with a death, nothing hangs.
TEST(PeerDeath, WorkPostedAfterThePeerClosedItsQpFails) {
  two_process(
      [](Channel &ch) {
        RcEnd a(short_timeouts());
        a.connect(ch);
        ch.wait();  // the peer is closing
        std::this_thread::sleep_for(200ms);
        ASSERT_EQ(0, a.post_send(1, 0, 64));
        ASSERT_EQ(0, a.post_write(2, 0, 64, 0));
        auto wcs = wait_wcs(a.cq(), 2);
        expect_peer_death_reported(wcs, a);
      },
      [](Channel &ch) {
        {
          RcEnd b(short_timeouts());
          b.connect(ch);
        }
        ch.signal();
      });
}

// As on an HCA, a dead target is found by the transport's retries: a WR in
// flight when it died, and one posted after, fail once it has been tried
// again retry_cnt times, the QP's timeout apart, not at once. A program that
// exits right after its last receive (ibv_srq_pingpong does) thus leaves its
// peer the time to poll what it answered before any WR it never saw fails.
TEST(PeerDeath, WorkToADeadPeerFailsWhenTheRetriesRunOut) {
  const RcOptions options = short_timeouts();
  const auto retries_take =
      std::chrono::nanoseconds((4096ull << options.params.timeout) * options.params.retry_cnt);
  two_process(
      [&](Channel &ch) {
        RcEnd a(options);
        a.connect(ch);
        // Stopped, the peer answers nothing: the SEND stays in flight until the kill.
        ASSERT_EQ(0, ::kill(ch.peer_pid(), SIGSTOP));
        int status = 0;
        ASSERT_EQ(ch.peer_pid(), waitpid(ch.peer_pid(), &status, WUNTRACED));
        ASSERT_EQ(0, a.post_send(1, 0, 64));
        const auto killed = std::chrono::steady_clock::now();  // it dies before waitpid returns
        ch.kill_peer();
        ASSERT_EQ(0, a.post_send(2, 0, 64));
        auto wcs = wait_wcs(a.cq(), 2);
        EXPECT_GE(std::chrono::steady_clock::now() - killed, retries_take);
        expect_peer_death_reported(wcs, a);
      },
      [&](Channel &ch) {
        RcEnd b(options);
        ASSERT_EQ(0, b.post_recv(1, 0, 64));
        ASSERT_EQ(0, b.post_recv(2, 0, 64));
        b.connect(ch);
        ch.wait();
      });
}

// A stream of 4 MiB writes is running when the target is SIGKILLed: every WR
// completes, in order: successes, then failures as above (including two WRs
// posted after the first failure). Nothing hangs.
TEST(PeerDeath, KilledMidTransferEveryWrCompletes) {
  constexpr uint64_t kMaxWrites = 2000, kWindow = 8;
  constexpr uint32_t kSize = 4u << 20;
  RcOptions options = short_timeouts();
  options.buffer_size = kSize;
  two_process(
      [&](Channel &ch) {
        RcEnd a(options);
        a.connect(ch);
        // Killed once the first write has completed, with the next ones in flight: no fixed
        // delay is mid-transfer under every tool (a 4 MiB write takes tens of ms under TSan).
        std::atomic<bool> first_done{false};
        std::jthread killer([&](std::stop_token stop) {
          while (!first_done.load() && !stop.stop_requested()) std::this_thread::sleep_for(1ms);
          if (stop.stop_requested()) return;
          std::this_thread::sleep_for(5ms);
          ch.kill_peer();
        });
        std::vector<ibv_wc> wcs;
        uint64_t posted = 0;
        auto failed = [&] { return !wcs.empty() && wcs.back().status != IBV_WC_SUCCESS; };
        while (posted < kMaxWrites && !failed()) {
          if (posted - wcs.size() == kWindow) {
            wcs.push_back(a.wait_wc(20s));
            first_done = true;
            continue;
          }
          int rc = a.post_write(posted++, 0, kSize, 0);
          if (rc != 0) {
            ADD_FAILURE() << "ibv_post_send returned " << rc;
            return;
          }
        }
        for (int extra = 0; extra < 2; ++extra) ASSERT_EQ(0, a.post_write(posted++, 0, 64, 0));
        while (wcs.size() < posted) wcs.push_back(a.wait_wc(20s));

        for (size_t k = 0; k < wcs.size(); ++k) EXPECT_EQ(wcs[k].wr_id, k) << "out of order";
        size_t ok = 0;
        while (ok < wcs.size() && wcs[ok].status == IBV_WC_SUCCESS) ++ok;
        EXPECT_GT(ok, 0u) << "the kill came before the first write";
        ASSERT_LT(ok, wcs.size()) << "all writes succeeded though the target was killed";
        expect_peer_death_reported(std::span(wcs).subspan(ok), a);
      },
      [&](Channel &ch) {
        RcEnd b(options);
        b.connect(ch);
        ch.wait();
      });
}

// ---- invalid arguments ---------------------------------------------------------------------

class InvalidArgs : public ::testing::Test {
 protected:
  Node node;
  ibv_device_attr dev{};
  CqPtr cq = create_cq(node.ctx.get());
  Buffer buf{node.pd.get(), 65536};
  void SetUp() override { ASSERT_EQ(0, ibv_query_device(node.ctx.get(), &dev)); }

  // ibv_create_qp must fail (NULL, errno one of `allowed`) and not crash.
  void expect_create_qp_fails(ibv_qp_init_attr attr,
                              std::initializer_list<int> allowed = {EINVAL, ENOMEM}) {
    errno = 0;
    ibv_qp *qp = ibv_create_qp(node.pd.get(), &attr);
    EXPECT_EQ(qp, nullptr);
    EXPECT_TRUE(is_one_of(errno, allowed))
        << "errno " << errno << " (" << std::strerror(errno) << ")";
    if (qp) ibv_destroy_qp(qp);
  }
};

TEST_F(InvalidArgs, CreateQpWithMoreSendSgesThanTheDeviceAllowsFails) {
  ibv_qp_init_attr attr = rc_qp_attr(cq.get());
  attr.cap.max_send_sge = static_cast<uint32_t>(dev.max_sge) + 1;
  expect_create_qp_fails(attr);
}

TEST_F(InvalidArgs, CreateQpWithMoreRecvSgesThanTheDeviceAllowsFails) {
  ibv_qp_init_attr attr = rc_qp_attr(cq.get());
  attr.cap.max_recv_sge = static_cast<uint32_t>(dev.max_sge) + 1;
  expect_create_qp_fails(attr);
}

TEST_F(InvalidArgs, CreateQpWithMoreWrsThanTheDeviceAllowsFails) {
  ibv_qp_init_attr attr = rc_qp_attr(cq.get());
  attr.cap.max_send_wr = static_cast<uint32_t>(dev.max_qp_wr) + 1;
  expect_create_qp_fails(attr);
}

TEST_F(InvalidArgs, CreateQpWithHugeInlineDataFails) {
  ibv_qp_init_attr attr = rc_qp_attr(cq.get());
  attr.cap.max_inline_data = 1u << 30;
  expect_create_qp_fails(attr);
}

TEST_F(InvalidArgs, CreateQpOfAnUnknownTypeFails) {
  ibv_qp_init_attr attr = rc_qp_attr(cq.get());
  attr.qp_type = static_cast<ibv_qp_type>(0x77);
  expect_create_qp_fails(attr, {EINVAL, EOPNOTSUPP});
}

TEST_F(InvalidArgs, CreateQpWithoutCqsFails) {
  ibv_qp_init_attr attr = rc_qp_attr(nullptr);
  expect_create_qp_fails(attr, {EINVAL});
}

TEST_F(InvalidArgs, CreateCqOnACompletionVectorThatDoesNotExistFails) {
  errno = 0;
  ibv_cq *bad = ibv_create_cq(node.ctx.get(), 16, nullptr, nullptr, node.ctx->num_comp_vectors);
  EXPECT_EQ(bad, nullptr);
  EXPECT_EQ(errno, EINVAL);
  if (bad) ibv_destroy_cq(bad);
}

// A QP in ERR accepts posts (they are flushed), so what is rejected at post
// time is visible without a peer.
class InvalidPost : public InvalidArgs {
 protected:
  QpPtr qp = create_qp(node.pd.get(), rc_qp_attr(cq.get(), 16, 2));
  void SetUp() override {
    InvalidArgs::SetUp();
    Endpoint self{node.lid(), qp->qp_num, 0, 0, 0, 0, 0, node.gid};
    rc_to_rts(qp.get(), self, self);
    ASSERT_EQ(0, modify_qp(qp.get(), state_attr(IBV_QPS_ERR), IBV_QP_STATE));
  }
  uint32_t max_send_sge() {
    ibv_qp_attr attr{};
    ibv_qp_init_attr init{};
    if (ibv_query_qp(qp.get(), &attr, IBV_QP_CAP, &init)) throw SetupError("ibv_query_qp");
    return init.cap.max_send_sge;
  }
};

TEST_F(InvalidPost, SendWithMoreSgesThanTheQpHasIsRejected) {
  SendWr wr(IBV_WR_SEND, 1);
  for (uint32_t i = 0; i <= max_send_sge(); ++i) wr.sge(buf.sge(64 * i, 64));
  ibv_send_wr *bad = nullptr;
  EXPECT_TRUE(is_one_of(wr.post(qp.get(), &bad), {EINVAL, ENOMEM}));
  EXPECT_EQ(bad, &wr.wr);
  EXPECT_TRUE(stays_empty(cq.get(), 50ms));
}

TEST_F(InvalidPost, RecvWithMoreSgesThanTheQpHasIsRejected) {
  ibv_qp_attr attr{};
  ibv_qp_init_attr init{};
  ASSERT_EQ(0, ibv_query_qp(qp.get(), &attr, IBV_QP_CAP, &init));
  RecvWr wr(1);
  for (uint32_t i = 0; i <= init.cap.max_recv_sge; ++i) wr.sge(buf.sge(64 * i, 64));
  ibv_recv_wr *bad = nullptr;
  EXPECT_TRUE(is_one_of(wr.post(qp.get(), &bad), {EINVAL, ENOMEM}));
  EXPECT_EQ(bad, &wr.wr);
}

TEST_F(InvalidPost, UnknownOpcodeIsRejected) {
  // 13: between IBV_WR_DRIVER1 and IBV_WR_ATOMIC_WRITE, named by no opcode
  // (and still a value of the enum's range, so the test itself is valid C++).
  SendWr wr(static_cast<ibv_wr_opcode>(13), 1);
  wr.sge(buf.sge(0, 8));
  ibv_send_wr *bad = nullptr;
  EXPECT_EQ(EINVAL, wr.post(qp.get(), &bad));
  EXPECT_EQ(bad, &wr.wr);
}

// In a chain, the WRs before the bad one are posted, bad_wr points at the bad
// one, and the ones after it are not posted.
TEST_F(InvalidPost, AChainStopsAtTheFirstBadWr) {
  ibv_sge good = buf.sge(0, 8);
  std::vector<ibv_sge> too_many(max_send_sge() + 1, good);
  ibv_send_wr wrs[3]{};
  for (int i = 0; i < 3; ++i) {
    wrs[i].wr_id = static_cast<uint64_t>(i + 1);
    wrs[i].opcode = IBV_WR_SEND;
    wrs[i].send_flags = IBV_SEND_SIGNALED;
    wrs[i].sg_list = &good;
    wrs[i].num_sge = 1;
    wrs[i].next = i < 2 ? &wrs[i + 1] : nullptr;
  }
  wrs[1].sg_list = too_many.data();
  wrs[1].num_sge = static_cast<int>(too_many.size());
  ibv_send_wr *bad = nullptr;
  EXPECT_NE(0, ibv_post_send(qp.get(), wrs, &bad));
  EXPECT_EQ(bad, &wrs[1]);
  ibv_wc wc = wait_wc(cq.get());
  EXPECT_EQ(wc.wr_id, 1u);
  EXPECT_EQ(wc.status, IBV_WC_WR_FLUSH_ERR);
  EXPECT_TRUE(stays_empty(cq.get(), 50ms)) << "a WR after the bad one was posted";
}

// More receives than the receive queue holds: the one that does not fit is
// refused.
TEST(RecvQueue, PostingBeyondTheQueueDepthIsRejected) {
  Node node;
  Buffer buf(node.pd.get(), 4096);
  RcOptions options;
  options.max_recv_wr = 16;
  RcQp rc(node, options);  // in INIT
  ibv_qp_attr attr{};
  ibv_qp_init_attr init{};
  ASSERT_EQ(0, ibv_query_qp(rc.qp.get(), &attr, IBV_QP_CAP, &init));
  for (uint32_t i = 0; i < init.cap.max_recv_wr; ++i)
    ASSERT_EQ(0, RecvWr(i).sge(buf.sge(0, 64)).post(rc.qp.get())) << "receive " << i;
  int rc_post = RecvWr(999).sge(buf.sge(0, 64)).post(rc.qp.get());
  EXPECT_TRUE(is_one_of(rc_post, {ENOMEM, EINVAL})) << "ibv_post_recv returned " << rc_post;
}

// More WRs than the send queue holds: the one that does not fit is refused.
TEST(SendQueue, PostingBeyondTheQueueDepthIsRejected) {
  RcOptions options;
  options.max_send_wr = 16;
  two_process(
      [&](Channel &ch) {
        RcEnd a(options);
        a.connect(ch);
        ibv_qp_attr attr{};
        ibv_qp_init_attr init{};
        ASSERT_EQ(0, ibv_query_qp(a.qp(), &attr, IBV_QP_CAP, &init));
        // The peer posts no receive and we retry RNR forever: nothing completes.
        for (uint32_t i = 0; i < init.cap.max_send_wr; ++i)
          ASSERT_EQ(0, a.post_send(i, 0, 8)) << "WR " << i << " of " << init.cap.max_send_wr;
        ibv_send_wr *bad = nullptr;
        int rc = SendWr(IBV_WR_SEND, 999).sge(a.sge(0, 8)).post(a.qp(), &bad);
        EXPECT_TRUE(is_one_of(rc, {ENOMEM, EINVAL})) << "ibv_post_send returned " << rc;
        ASSERT_EQ(0, modify_qp(a.qp(), state_attr(IBV_QPS_ERR), IBV_QP_STATE));
        wait_wcs(a.cq(), init.cap.max_send_wr);
        ch.signal();
      },
      [&](Channel &ch) {
        RcEnd b;
        b.connect(ch);
        ch.wait();
      });
}

}  // namespace
}  // namespace pcientb::test
