// Shared receive queues: lifecycle, attributes, sharing between QPs and the
// limit event.
#include "verbs_helpers.hpp"

#include <algorithm>
#include <cstring>

namespace pcientb::test {
namespace {

SrqPtr create_srq(ibv_pd *pd, uint32_t max_wr, uint32_t max_sge = 1, uint32_t limit = 0) {
  ibv_srq_init_attr attr{};
  attr.attr.max_wr = max_wr;
  attr.attr.max_sge = max_sge;
  attr.attr.srq_limit = limit;
  ibv_srq *srq = ibv_create_srq(pd, &attr);
  if (!srq) throw_errno("ibv_create_srq", errno);
  return SrqPtr(srq);
}

TEST(Srq, CreateQueryModifyDestroy) {
  Node node;
  ibv_srq_init_attr init{};
  init.attr.max_wr = 64;
  init.attr.max_sge = 2;
  ibv_srq *srq = ibv_create_srq(node.pd.get(), &init);
  ASSERT_NE(srq, nullptr) << std::strerror(errno);
  EXPECT_GE(init.attr.max_wr, 64u);
  EXPECT_GE(init.attr.max_sge, 2u);

  ibv_srq_attr attr{};
  ASSERT_EQ(0, ibv_query_srq(srq, &attr));
  EXPECT_GE(attr.max_wr, 64u);
  EXPECT_GE(attr.max_sge, 2u);
  EXPECT_EQ(attr.srq_limit, 0u);

  ibv_srq_attr limit{};
  limit.srq_limit = 10;
  ASSERT_EQ(0, ibv_modify_srq(srq, &limit, IBV_SRQ_LIMIT));
  ASSERT_EQ(0, ibv_query_srq(srq, &attr));
  EXPECT_EQ(attr.srq_limit, 10u);
  EXPECT_EQ(0, ibv_destroy_srq(srq));
}

TEST(Srq, CreateWithMoreWrsThanTheDeviceAllowsFails) {
  Node node;
  ibv_device_attr dev{};
  ASSERT_EQ(0, ibv_query_device(node.ctx.get(), &dev));
  ibv_srq_init_attr init{};
  init.attr.max_wr = static_cast<uint32_t>(dev.max_srq_wr) + 1;
  init.attr.max_sge = 1;
  errno = 0;
  ibv_srq *srq = ibv_create_srq(node.pd.get(), &init);
  EXPECT_EQ(srq, nullptr);
  EXPECT_TRUE(is_one_of(errno, {EINVAL, ENOMEM})) << std::strerror(errno);
  if (srq) ibv_destroy_srq(srq);
}

TEST(Srq, LimitAboveMaxWrIsEinval) {
  Node node;
  auto srq = create_srq(node.pd.get(), 16);
  ibv_srq_attr attr{};
  ASSERT_EQ(0, ibv_query_srq(srq.get(), &attr));
  ibv_srq_attr limit{};
  limit.srq_limit = attr.max_wr + 1;
  EXPECT_EQ(EINVAL, ibv_modify_srq(srq.get(), &limit, IBV_SRQ_LIMIT));
}

TEST(Srq, DestroyWhileAttachedToAQpIsEbusy) {
  Node node;
  auto cq = create_cq(node.ctx.get());
  ibv_srq_init_attr init{};
  init.attr.max_wr = 16;
  init.attr.max_sge = 1;
  ibv_srq *srq = ibv_create_srq(node.pd.get(), &init);
  ASSERT_NE(srq, nullptr);
  ibv_qp_init_attr attr = rc_qp_attr(cq.get());
  attr.srq = srq;
  ibv_qp *qp = ibv_create_qp(node.pd.get(), &attr);
  ASSERT_NE(qp, nullptr) << std::strerror(errno);
  EXPECT_EQ(EBUSY, ibv_destroy_srq(srq));
  EXPECT_EQ(0, ibv_destroy_qp(qp));
  EXPECT_EQ(0, ibv_destroy_srq(srq));
}

TEST(Srq, PostRecvOnAQpThatUsesAnSrqIsRejected) {
  Node node;
  Buffer buf(node.pd.get(), 4096);
  auto srq = create_srq(node.pd.get(), 16);
  RcQp rc(node, {}, srq.get());
  EXPECT_NE(0, RecvWr(1).sge(buf.sge(0, 64)).post(rc.qp.get()));
}

TEST(Srq, PostingMoreSgesThanMaxSgeIsRejected) {
  Node node;
  Buffer buf(node.pd.get(), 4096);
  auto srq = create_srq(node.pd.get(), 16, 1);
  ibv_srq_attr attr{};
  ASSERT_EQ(0, ibv_query_srq(srq.get(), &attr));
  RecvWr wr(1);
  for (uint32_t i = 0; i <= attr.max_sge; ++i) wr.sge(buf.sge(64 * i, 64));
  ibv_recv_wr *bad = nullptr;
  EXPECT_NE(0, wr.post(srq.get(), &bad));
  EXPECT_EQ(bad, &wr.wr);
}

// The receiver's side of the SRQ tests: one node, one buffer, one SRQ, and
// two RC QPs that take their receives from it.
struct SrqReceiver {
  Node node;
  Buffer buf{node.pd.get(), 64 * 1024};
  SrqPtr srq = create_srq(node.pd.get(), 64);
  RcQp first{node, {}, srq.get()};
  RcQp second{node, {}, srq.get()};
  // Posts receive i at offset 1024 * i.
  void post(uint64_t i) {
    if (int rc = RecvWr(i).sge(buf.sge(1024 * i, 1024)).post(srq.get()))
      throw_errno("ibv_post_srq_recv", rc);
  }
};

// The sender's side: two RC QPs, each connected to one of the receiver's.
struct TwoQpSender {
  Node node;
  Buffer buf{node.pd.get(), 64 * 1024};
  RcQp first{node};
  RcQp second{node};
};

TEST(Srq, ReceivesFromTwoQpsComeFromOneSrq) {
  two_process(
      [](Channel &ch) {
        TwoQpSender a;
        a.first.connect(ch, a.first.endpoint(a.node, a.buf), {});
        a.second.connect(ch, a.second.endpoint(a.node, a.buf), {});
        // Message k (0..4) carries its number in its first byte: 0, 1, 2 on
        // the first QP, 3, 4 on the second.
        for (uint8_t k = 0; k < 5; ++k) {
          fill_pattern(a.buf.span(100 * k, 100), k);
          a.buf.bytes[100 * k] = k;
          RcQp &qp = k < 3 ? a.first : a.second;
          ASSERT_EQ(0, SendWr(IBV_WR_SEND, k).sge(a.buf.sge(100 * k, 100)).post(qp.qp.get()));
          EXPECT_EQ(wait_wc(qp.cq.get()).status, IBV_WC_SUCCESS);
        }
      },
      [](Channel &ch) {
        SrqReceiver b;
        for (uint64_t i = 0; i < 8; ++i) b.post(i);
        b.first.connect(ch, b.first.endpoint(b.node, b.buf), {});
        b.second.connect(ch, b.second.endpoint(b.node, b.buf), {});
        std::vector<ibv_wc> got = wait_wcs(b.first.cq.get(), 3);
        auto more = wait_wcs(b.second.cq.get(), 2);
        got.insert(got.end(), more.begin(), more.end());
        for (uint8_t k = 0; k < 5; ++k) {
          const ibv_wc &wc = got[k];
          EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
          EXPECT_EQ(wc.byte_len, 100u);
          EXPECT_EQ(wc.qp_num, (k < 3 ? b.first : b.second).qp->qp_num);
          EXPECT_EQ(wc.wr_id, k) << "SRQ receives not consumed in order";
          const uint8_t *msg = b.buf.at(1024 * wc.wr_id);
          EXPECT_EQ(msg[0], k) << "messages of one QP out of order";
          EXPECT_TRUE(has_pattern({msg + 1, 99}, k, 1));
        }
      });
}

// A message consumes its SRQ receive when it arrives (as rxe does): the SRQ
// has room for max_wr new receives at once, polled or not. A QP destroyed
// with its completions unpolled reports nothing, and the next message, on
// another QP, takes the first of the new receives.
TEST(Srq, ArrivedSendsFreeTheirReceivesAndADestroyedQpReportsNothing) {
  constexpr uint32_t kMaxWr = 4;
  two_process(
      [&](Channel &ch) {
        TwoQpSender a;
        a.first.connect(ch, a.first.endpoint(a.node, a.buf), {});
        a.second.connect(ch, a.second.endpoint(a.node, a.buf), {});
        for (uint64_t k = 0; k < kMaxWr; ++k) {
          ASSERT_EQ(0, SendWr(IBV_WR_SEND, k).sge(a.buf.sge(0, 8)).post(a.first.qp.get()));
          EXPECT_EQ(wait_wc(a.first.cq.get()).status, IBV_WC_SUCCESS);
        }
        ch.signal();
        ch.wait();  // the peer destroyed its first QP and posted anew
        fill_pattern(a.buf.span(0, 8), 9);
        ASSERT_EQ(0, SendWr(IBV_WR_SEND, 9).sge(a.buf.sge(0, 8)).post(a.second.qp.get()));
        EXPECT_EQ(wait_wc(a.second.cq.get()).status, IBV_WC_SUCCESS);
      },
      [&](Channel &ch) {
        Node node;
        Buffer buf{node.pd.get(), 64 * 1024};
        SrqPtr srq = create_srq(node.pd.get(), kMaxWr);
        RcQp first{node, {}, srq.get()};
        RcQp second{node, {}, srq.get()};
        auto post = [&](uint64_t i) { return RecvWr(i).sge(buf.sge(64 * i, 64)).post(srq.get()); };
        for (uint64_t i = 0; i < kMaxWr; ++i) ASSERT_EQ(0, post(i));
        first.connect(ch, first.endpoint(node, buf), {});
        second.connect(ch, second.endpoint(node, buf), {});
        ch.wait();  // four SENDs arrived on the first QP, unpolled
        for (uint64_t i = kMaxWr; i < 2 * kMaxWr; ++i) ASSERT_EQ(0, post(i)) << "receive " << i;
        EXPECT_EQ(ENOMEM, post(2 * kMaxWr)) << "the SRQ holds max_wr receives";
        first.qp.reset();
        EXPECT_TRUE(stays_empty(first.cq.get(), 10ms)) << "a completion of a destroyed QP";
        ch.signal();
        ibv_wc wc = wait_wc(second.cq.get());
        EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
        EXPECT_EQ(wc.wr_id, kMaxWr);
        EXPECT_TRUE(has_pattern(buf.span(64 * kMaxWr, 8), 9));
      });
}

// A QP destroyed while small SENDs stream into it: no SRQ receive is lost
// to the race, whether its message was completed, discarded or refused.
// Filled up again, the SRQ serves max_wr messages without an RNR (rnr_retry
// 0 on the new QP): a receive slot lost to the race would show.
TEST(Srq, AQpDestroyedMidStreamLeavesEveryUnpolledReceiveInTheSrq) {
  constexpr uint32_t kMaxWr = 16;
  for (int round = 0; round < 3; ++round) {
    two_process(
        [&](Channel &ch) {
          TwoQpSender a;
          RcParams streaming;
          streaming.timeout = 8;
          streaming.retry_cnt = 2;
          RcParams strict;
          strict.rnr_retry = 0;
          a.first.connect(ch, a.first.endpoint(a.node, a.buf), streaming);
          a.second.connect(ch, a.second.endpoint(a.node, a.buf), strict);
          // Stream until the target QP is gone: successes, then one failure,
          // then flushes.
          uint64_t posted = 0, done = 0;
          bool failed = false;
          while (!failed || done < posted) {
            if (!failed && posted - done < 8) {
              ASSERT_EQ(0,
                        SendWr(IBV_WR_SEND, posted++).sge(a.buf.sge(0, 8)).post(a.first.qp.get()));
              continue;
            }
            ibv_wc wc = wait_wc(a.first.cq.get(), 20s);
            ++done;
            if (wc.status != IBV_WC_SUCCESS) failed = true;
          }
          ch.wait();  // the target destroyed its first QP
          for (uint64_t k = 0; k < kMaxWr; ++k) {
            ASSERT_EQ(0, SendWr(IBV_WR_SEND, k).sge(a.buf.sge(0, 8)).post(a.second.qp.get()));
            EXPECT_EQ(wait_wc(a.second.cq.get()).status, IBV_WC_SUCCESS) << "message " << k;
          }
        },
        [&](Channel &ch) {
          Node node;
          Buffer buf{node.pd.get(), 64 * 1024};
          SrqPtr srq = create_srq(node.pd.get(), kMaxWr);
          RcQp first{node, {}, srq.get()};
          RcQp second{node, {}, srq.get()};
          auto post = [&](uint64_t i) {
            return RecvWr(i).sge(buf.sge(64 * (i % kMaxWr), 64)).post(srq.get());
          };
          for (uint64_t i = 0; i < kMaxWr; ++i) ASSERT_EQ(0, post(i));
          first.connect(ch, first.endpoint(node, buf), {});
          second.connect(ch, second.endpoint(node, buf), {});
          // Take 300 messages, giving each receive back at once, then destroy
          // the QP while the sender still sends.
          for (uint64_t got = 0; got < 300;) {
            ibv_wc wc = wait_wc(first.cq.get());
            ASSERT_EQ(wc.status, IBV_WC_SUCCESS);
            ASSERT_EQ(0, post(wc.wr_id));
            ++got;
          }
          first.qp.reset();
          // Receives that discarded messages consumed are gone: fill up again.
          for (uint64_t i = kMaxWr; post(i) == 0; ++i) ASSERT_LT(i, 3 * kMaxWr);
          ch.signal();
          auto wcs = wait_wcs(second.cq.get(), kMaxWr);
          for (const ibv_wc &wc : wcs) EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
        });
  }
}

// An SRQ armed with limit 8 and holding 10 receives raises
// IBV_EVENT_SRQ_LIMIT_REACHED when the third message leaves 7, and disarms.
TEST(Srq, DroppingBelowTheLimitRaisesTheLimitEventOnce) {
  two_process(
      [](Channel &ch) {
        TwoQpSender a;
        a.first.connect(ch, a.first.endpoint(a.node, a.buf), {});
        a.second.connect(ch, a.second.endpoint(a.node, a.buf), {});
        for (uint64_t k = 0; k < 2; ++k) {
          ASSERT_EQ(0, SendWr(IBV_WR_SEND, k).sge(a.buf.sge(0, 10)).post(a.first.qp.get()));
          EXPECT_EQ(wait_wc(a.first.cq.get()).status, IBV_WC_SUCCESS);
        }
        ch.barrier();  // the receiver checked there is no event at 8
        ASSERT_EQ(0, SendWr(IBV_WR_SEND, 2).sge(a.buf.sge(0, 10)).post(a.second.qp.get()));
        EXPECT_EQ(wait_wc(a.second.cq.get()).status, IBV_WC_SUCCESS);
        ch.barrier();
        ASSERT_EQ(0, SendWr(IBV_WR_SEND, 3).sge(a.buf.sge(0, 10)).post(a.first.qp.get()));
        EXPECT_EQ(wait_wc(a.first.cq.get()).status, IBV_WC_SUCCESS);
        ch.signal();
      },
      [](Channel &ch) {
        SrqReceiver b;
        for (uint64_t i = 0; i < 10; ++i) b.post(i);
        ibv_srq_attr limit{};
        limit.srq_limit = 8;
        ASSERT_EQ(0, ibv_modify_srq(b.srq.get(), &limit, IBV_SRQ_LIMIT));
        b.first.connect(ch, b.first.endpoint(b.node, b.buf), {});
        b.second.connect(ch, b.second.endpoint(b.node, b.buf), {});
        ch.wait();
        EXPECT_FALSE(wait_async_event_of(b.node.ctx.get(), IBV_EVENT_SRQ_LIMIT_REACHED, 200ms))
            << "the event came with 8 receives left (the limit is 8: it must drop below)";
        ch.signal();
        ch.wait();
        auto event = wait_async_event_of(b.node.ctx.get(), IBV_EVENT_SRQ_LIMIT_REACHED);
        ASSERT_TRUE(event) << "no IBV_EVENT_SRQ_LIMIT_REACHED with 7 receives left";
        EXPECT_EQ(event->element.srq, b.srq.get());
        ibv_srq_attr attr{};
        ASSERT_EQ(0, ibv_query_srq(b.srq.get(), &attr));
        EXPECT_EQ(attr.srq_limit, 0u) << "the limit is disarmed by the event";
        ch.signal();
        ch.wait();
        EXPECT_FALSE(wait_async_event_of(b.node.ctx.get(), IBV_EVENT_SRQ_LIMIT_REACHED, 200ms))
            << "a second event without re-arming";
        wait_wcs(b.first.cq.get(), 3);
        wait_wcs(b.second.cq.get(), 1);
      });
}

}  // namespace
}  // namespace pcientb::test
