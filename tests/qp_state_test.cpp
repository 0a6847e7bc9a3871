// The QP state machine: legal and illegal transitions, required and forbidden
// attribute masks, what query returns, flushing in ERR, recycling through RESET.
#include "verbs_helpers.hpp"

#include <algorithm>
#include <thread>

namespace pcientb::test {
namespace {

// One node with an RC QP under test and a second QP that plays its remote
// (state transitions do not need the remote to answer).
class QpState : public ::testing::Test {
 protected:
  Node node;
  CqPtr cq = create_cq(node.ctx.get());
  QpPtr qp = create_qp(node.pd.get(), rc_qp_attr(cq.get(), 16, 2));
  QpPtr other = create_qp(node.pd.get(), rc_qp_attr(cq.get(), 16, 2));
  Buffer buf{node.pd.get(), 4096};

  Endpoint remote() const {
    Endpoint ep;
    ep.lid = node.lid();
    ep.qpn = other->qp_num;
    ep.psn = 0x123;
    ep.gid = node.gid;
    return ep;
  }
  int to_init() { return modify_qp(qp.get(), init_attr(kRemoteAll), kInitMask); }
  int to_rtr(const RcParams &p = {}) {
    return modify_qp(qp.get(), rtr_attr(remote(), p), kRtrMask);
  }
  int to_rts(const RcParams &p = {}) { return modify_qp(qp.get(), rts_attr(0x456, p), kRtsMask); }
  int to(ibv_qp_state state) { return modify_qp(qp.get(), state_attr(state), IBV_QP_STATE); }
  // Brings the QP from RESET to `state` along the normal path.
  void bring_to(ibv_qp_state state) {
    if (state == IBV_QPS_RESET) return;
    ASSERT_EQ(0, to_init());
    if (state == IBV_QPS_INIT) return;
    ASSERT_EQ(0, to_rtr());
    if (state == IBV_QPS_RTR) return;
    ASSERT_EQ(0, to_rts());
    if (state == IBV_QPS_RTS) return;
    ASSERT_EQ(0, to(state));
  }
};

TEST_F(QpState, NewRcQpIsInResetWithAtLeastTheRequestedCaps) {
  EXPECT_EQ(qp->state, IBV_QPS_RESET);
  EXPECT_EQ(qp->qp_type, IBV_QPT_RC);
  EXPECT_NE(qp->qp_num, 0u);
  EXPECT_NE(qp->qp_num, other->qp_num);
  ibv_qp_attr attr{};
  ibv_qp_init_attr init{};
  ASSERT_EQ(0, ibv_query_qp(qp.get(), &attr, IBV_QP_STATE | IBV_QP_CAP, &init));
  EXPECT_EQ(attr.qp_state, IBV_QPS_RESET);
  EXPECT_GE(init.cap.max_send_wr, 16u);
  EXPECT_GE(init.cap.max_recv_wr, 16u);
  EXPECT_GE(init.cap.max_send_sge, 2u);
  EXPECT_GE(init.cap.max_recv_sge, 2u);
  EXPECT_GE(init.cap.max_inline_data, 64u);
}

TEST_F(QpState, CreateWritesTheActualCapsBackIntoTheInitAttr) {
  ibv_qp_init_attr attr = rc_qp_attr(cq.get(), 10, 3);
  attr.cap.max_inline_data = 32;
  ibv_qp *raw = ibv_create_qp(node.pd.get(), &attr);
  ASSERT_NE(raw, nullptr);
  QpPtr holder(raw);
  EXPECT_GE(attr.cap.max_send_wr, 10u);
  EXPECT_GE(attr.cap.max_recv_wr, 10u);
  EXPECT_GE(attr.cap.max_send_sge, 3u);
  EXPECT_GE(attr.cap.max_inline_data, 32u);
}

TEST_F(QpState, ResetInitRtrRtsSucceedsAndUpdatesTheState) {
  ASSERT_EQ(0, to_init());
  EXPECT_EQ(qp->state, IBV_QPS_INIT);
  EXPECT_EQ(query_state(qp.get()), IBV_QPS_INIT);
  ASSERT_EQ(0, to_rtr());
  EXPECT_EQ(query_state(qp.get()), IBV_QPS_RTR);
  ASSERT_EQ(0, to_rts());
  EXPECT_EQ(query_state(qp.get()), IBV_QPS_RTS);
}

TEST_F(QpState, ResetToRtrIsEinval) {
  EXPECT_EQ(EINVAL, to_rtr());
  EXPECT_EQ(query_state(qp.get()), IBV_QPS_RESET);
}

TEST_F(QpState, ResetToRtsIsEinval) {
  EXPECT_EQ(EINVAL, modify_qp(qp.get(), rts_attr(0), kRtsMask));
  EXPECT_EQ(query_state(qp.get()), IBV_QPS_RESET);
}

TEST_F(QpState, InitToRtsIsEinval) {
  ASSERT_EQ(0, to_init());
  EXPECT_EQ(EINVAL, to_rts());
  EXPECT_EQ(query_state(qp.get()), IBV_QPS_INIT);
}

TEST_F(QpState, RtrToInitIsEinval) {
  bring_to(IBV_QPS_RTR);
  EXPECT_EQ(EINVAL, to_init());
  EXPECT_EQ(query_state(qp.get()), IBV_QPS_RTR);
}

TEST_F(QpState, ResetToInitWithAnAttributeNotAllowedThereIsEinval) {
  ibv_qp_attr attr = init_attr(kRemoteAll);
  attr.dest_qp_num = other->qp_num;
  EXPECT_EQ(EINVAL, modify_qp(qp.get(), attr, kInitMask | IBV_QP_DEST_QPN));
  EXPECT_EQ(query_state(qp.get()), IBV_QPS_RESET);
}

TEST_F(QpState, WrongCurrentStateIsEinval) {
  ibv_qp_attr attr = init_attr(kRemoteAll);
  attr.cur_qp_state = IBV_QPS_RTS;
  EXPECT_EQ(EINVAL, modify_qp(qp.get(), attr, kInitMask | IBV_QP_CUR_STATE));
}

TEST_F(QpState, ResetToInitWithANonexistentPortIsEinval) {
  ibv_qp_attr attr = init_attr(kRemoteAll);
  attr.port_num = 2;
  EXPECT_EQ(EINVAL, modify_qp(qp.get(), attr, kInitMask));
}

TEST_F(QpState, ResetToInitWithAPkeyIndexOutOfTheTableIsEinval) {
  ibv_qp_attr attr = init_attr(kRemoteAll);
  attr.pkey_index = static_cast<uint16_t>(node.port.pkey_tbl_len);
  EXPECT_EQ(EINVAL, modify_qp(qp.get(), attr, kInitMask));
}

TEST_F(QpState, InitToRtrWithAnInvalidPathMtuIsEinval) {
  ASSERT_EQ(0, to_init());
  ibv_qp_attr attr = rtr_attr(remote());
  attr.path_mtu = static_cast<ibv_mtu>(6);
  EXPECT_EQ(EINVAL, modify_qp(qp.get(), attr, kRtrMask));
}

TEST_F(QpState, InitToInitChangesTheAccessFlags) {
  ASSERT_EQ(0, to_init());
  ASSERT_EQ(0, modify_qp(qp.get(), init_attr(IBV_ACCESS_REMOTE_READ), kInitMask));
  ibv_qp_attr attr{};
  ibv_qp_init_attr init{};
  ASSERT_EQ(0, ibv_query_qp(qp.get(), &attr, IBV_QP_STATE | IBV_QP_ACCESS_FLAGS, &init));
  EXPECT_EQ(attr.qp_state, IBV_QPS_INIT);
  EXPECT_EQ(attr.qp_access_flags, static_cast<unsigned>(IBV_ACCESS_REMOTE_READ));
}

TEST_F(QpState, RtsToRtsChangesTheAccessFlags) {
  bring_to(IBV_QPS_RTS);
  ibv_qp_attr attr = state_attr(IBV_QPS_RTS);
  attr.qp_access_flags = IBV_ACCESS_REMOTE_WRITE;
  ASSERT_EQ(0, modify_qp(qp.get(), attr, IBV_QP_STATE | IBV_QP_ACCESS_FLAGS));
  ibv_qp_attr got{};
  ibv_qp_init_attr init{};
  ASSERT_EQ(0, ibv_query_qp(qp.get(), &got, IBV_QP_STATE | IBV_QP_ACCESS_FLAGS, &init));
  EXPECT_EQ(got.qp_state, IBV_QPS_RTS);
  EXPECT_EQ(got.qp_access_flags, static_cast<unsigned>(IBV_ACCESS_REMOTE_WRITE));
}

TEST_F(QpState, QueryReturnsWhatWasSet) {
  RcParams p;
  p.mtu = IBV_MTU_2048;
  p.timeout = 14;
  p.retry_cnt = 5;
  p.rnr_retry = 6;
  p.min_rnr_timer = 12;
  p.rd_atomic = 8;
  p.access = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  ASSERT_EQ(0, modify_qp(qp.get(), init_attr(p.access), kInitMask));
  ASSERT_EQ(0, to_rtr(p));
  ASSERT_EQ(0, to_rts(p));

  ibv_qp_attr attr{};
  ibv_qp_init_attr init{};
  ASSERT_EQ(0, ibv_query_qp(qp.get(), &attr, kInitMask | kRtrMask | kRtsMask | IBV_QP_CAP, &init));
  EXPECT_EQ(attr.qp_state, IBV_QPS_RTS);
  EXPECT_EQ(attr.port_num, kPort);
  EXPECT_EQ(attr.pkey_index, 0);
  EXPECT_EQ(attr.qp_access_flags, static_cast<unsigned>(p.access));
  EXPECT_EQ(attr.path_mtu, IBV_MTU_2048);
  EXPECT_EQ(attr.dest_qp_num, other->qp_num);
  EXPECT_EQ(attr.rq_psn, 0x123u);
  EXPECT_EQ(attr.sq_psn, 0x456u);
  EXPECT_EQ(attr.max_dest_rd_atomic, 8);
  EXPECT_EQ(attr.max_rd_atomic, 8);
  EXPECT_EQ(attr.min_rnr_timer, 12);
  EXPECT_EQ(attr.timeout, 14);
  EXPECT_EQ(attr.retry_cnt, 5);
  EXPECT_EQ(attr.rnr_retry, 6);
  EXPECT_EQ(attr.ah_attr.dlid, node.lid());
  EXPECT_EQ(attr.ah_attr.port_num, kPort);
  EXPECT_GE(init.cap.max_send_wr, 16u);
  EXPECT_GE(init.cap.max_recv_sge, 2u);
}

TEST_F(QpState, PostSendInResetOrInitIsRejected) {
  EXPECT_NE(0, SendWr(IBV_WR_SEND, 1).sge(buf.sge(0, 8)).post(qp.get()));
  ASSERT_EQ(0, to_init());
  EXPECT_NE(0, SendWr(IBV_WR_SEND, 2).sge(buf.sge(0, 8)).post(qp.get()));
  EXPECT_TRUE(stays_empty(cq.get(), 50ms));
}

TEST_F(QpState, PostRecvInResetIsRejectedAndAcceptedFromInit) {
  EXPECT_NE(0, RecvWr(1).sge(buf.sge(0, 8)).post(qp.get()));
  ASSERT_EQ(0, to_init());
  EXPECT_EQ(0, RecvWr(2).sge(buf.sge(0, 8)).post(qp.get()));
}

// ---- required attributes ----------------------------------------------------------

struct Omitted {
  int mask;
  const char *name;
  friend void PrintTo(const Omitted &o, std::ostream *os) { *os << o.name; }
};
std::string omitted_name(const ::testing::TestParamInfo<Omitted> &info) {
  return info.param.name;
}

class ResetToInitWithout : public QpState, public ::testing::WithParamInterface<Omitted> {};
TEST_P(ResetToInitWithout, IsEinval) {
  EXPECT_EQ(EINVAL, modify_qp(qp.get(), init_attr(kRemoteAll), kInitMask & ~GetParam().mask));
  EXPECT_EQ(query_state(qp.get()), IBV_QPS_RESET);
}
INSTANTIATE_TEST_SUITE_P(QpState, ResetToInitWithout,
                         ::testing::Values(Omitted{IBV_QP_PKEY_INDEX, "PkeyIndex"},
                                           Omitted{IBV_QP_PORT, "Port"},
                                           Omitted{IBV_QP_ACCESS_FLAGS, "AccessFlags"}),
                         omitted_name);

class InitToRtrWithout : public QpState, public ::testing::WithParamInterface<Omitted> {};
TEST_P(InitToRtrWithout, IsEinval) {
  ASSERT_EQ(0, to_init());
  EXPECT_EQ(EINVAL, modify_qp(qp.get(), rtr_attr(remote()), kRtrMask & ~GetParam().mask));
  EXPECT_EQ(query_state(qp.get()), IBV_QPS_INIT);
}
INSTANTIATE_TEST_SUITE_P(QpState, InitToRtrWithout,
                         ::testing::Values(Omitted{IBV_QP_AV, "Av"},
                                           Omitted{IBV_QP_PATH_MTU, "PathMtu"},
                                           Omitted{IBV_QP_DEST_QPN, "DestQpn"},
                                           Omitted{IBV_QP_RQ_PSN, "RqPsn"},
                                           Omitted{IBV_QP_MAX_DEST_RD_ATOMIC, "MaxDestRdAtomic"},
                                           Omitted{IBV_QP_MIN_RNR_TIMER, "MinRnrTimer"}),
                         omitted_name);

class RtrToRtsWithout : public QpState, public ::testing::WithParamInterface<Omitted> {};
TEST_P(RtrToRtsWithout, IsEinval) {
  bring_to(IBV_QPS_RTR);
  EXPECT_EQ(EINVAL, modify_qp(qp.get(), rts_attr(0x456), kRtsMask & ~GetParam().mask));
  EXPECT_EQ(query_state(qp.get()), IBV_QPS_RTR);
}
INSTANTIATE_TEST_SUITE_P(QpState, RtrToRtsWithout,
                         ::testing::Values(Omitted{IBV_QP_SQ_PSN, "SqPsn"},
                                           Omitted{IBV_QP_TIMEOUT, "Timeout"},
                                           Omitted{IBV_QP_RETRY_CNT, "RetryCnt"},
                                           Omitted{IBV_QP_RNR_RETRY, "RnrRetry"},
                                           Omitted{IBV_QP_MAX_QP_RD_ATOMIC, "MaxQpRdAtomic"}),
                         omitted_name);

// ---- ERR and RESET from every state ---------------------------------------------------

struct From {
  ibv_qp_state state;
  const char *name;
  friend void PrintTo(const From &f, std::ostream *os) { *os << f.name; }
};
std::string from_name(const ::testing::TestParamInfo<From> &info) {
  return info.param.name;
}
const auto kEveryState =
    ::testing::Values(From{IBV_QPS_RESET, "Reset"}, From{IBV_QPS_INIT, "Init"},
                      From{IBV_QPS_RTR, "Rtr"}, From{IBV_QPS_RTS, "Rts"}, From{IBV_QPS_SQD, "Sqd"});

class ToErrFrom : public QpState, public ::testing::WithParamInterface<From> {};
TEST_P(ToErrFrom, Succeeds) {
  bring_to(GetParam().state);
  EXPECT_EQ(0, to(IBV_QPS_ERR));
  EXPECT_EQ(query_state(qp.get()), IBV_QPS_ERR);
}
INSTANTIATE_TEST_SUITE_P(QpState, ToErrFrom, kEveryState, from_name);

class ToResetFrom : public QpState, public ::testing::WithParamInterface<From> {};
TEST_P(ToResetFrom, Succeeds) {
  bring_to(GetParam().state);
  EXPECT_EQ(0, to(IBV_QPS_RESET));
  EXPECT_EQ(query_state(qp.get()), IBV_QPS_RESET);
}
INSTANTIATE_TEST_SUITE_P(QpState, ToResetFrom, kEveryState, from_name);

TEST_F(QpState, ErrFlushesPostedReceivesInOrder) {
  ASSERT_EQ(0, to_init());
  for (uint64_t i = 0; i < 4; ++i) ASSERT_EQ(0, RecvWr(10 + i).sge(buf.sge(0, 64)).post(qp.get()));
  ASSERT_EQ(0, to(IBV_QPS_ERR));
  auto wcs = wait_wcs(cq.get(), 4);
  for (uint64_t i = 0; i < 4; ++i) {
    EXPECT_EQ(wcs[i].wr_id, 10 + i);
    EXPECT_EQ(wcs[i].status, IBV_WC_WR_FLUSH_ERR);
    EXPECT_EQ(wcs[i].qp_num, qp->qp_num);
  }
}

TEST_F(QpState, WorkPostedInErrIsFlushed) {
  bring_to(IBV_QPS_RTS);
  ASSERT_EQ(0, to(IBV_QPS_ERR));
  ASSERT_EQ(0, SendWr(IBV_WR_SEND, 1).sge(buf.sge(0, 8)).post(qp.get()));
  ASSERT_EQ(0, RecvWr(2).sge(buf.sge(0, 8)).post(qp.get()));
  auto wcs = wait_wcs(cq.get(), 2);
  std::sort(wcs.begin(), wcs.end(), [](auto &x, auto &y) { return x.wr_id < y.wr_id; });
  EXPECT_EQ(wcs[0].wr_id, 1u);
  EXPECT_EQ(wcs[0].status, IBV_WC_WR_FLUSH_ERR);
  EXPECT_EQ(wcs[1].wr_id, 2u);
  EXPECT_EQ(wcs[1].status, IBV_WC_WR_FLUSH_ERR);
}

TEST_F(QpState, ResetDiscardsPostedReceivesWithoutCompletions) {
  ASSERT_EQ(0, to_init());
  ASSERT_EQ(0, RecvWr(1).sge(buf.sge(0, 8)).post(qp.get()));
  ASSERT_EQ(0, to(IBV_QPS_RESET));
  EXPECT_TRUE(stays_empty(cq.get(), 100ms));
}

TEST_F(QpState, ErrThenResetThenInitRtrRtsWorksAgain) {
  bring_to(IBV_QPS_RTS);
  ASSERT_EQ(0, to(IBV_QPS_ERR));
  ASSERT_EQ(0, to(IBV_QPS_RESET));
  ASSERT_EQ(0, to_init());
  ASSERT_EQ(0, to_rtr());
  ASSERT_EQ(0, to_rts());
  EXPECT_EQ(query_state(qp.get()), IBV_QPS_RTS);
}

TEST_F(QpState, RtsToSqdAndBackToRts) {
  bring_to(IBV_QPS_RTS);
  ASSERT_EQ(0, to(IBV_QPS_SQD));
  EXPECT_EQ(query_state(qp.get()), IBV_QPS_SQD);
  ASSERT_EQ(0, to(IBV_QPS_RTS));
  EXPECT_EQ(query_state(qp.get()), IBV_QPS_RTS);
}

// ---- UD transitions -------------------------------------------------------------------

class UdQpState : public ::testing::Test {
 protected:
  Node node;
  CqPtr cq = create_cq(node.ctx.get());
  QpPtr qp = create_qp(node.pd.get(), ud_qp_attr(cq.get()));
};

TEST_F(UdQpState, ResetToInitWithoutQkeyIsEinval) {
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_INIT;
  attr.port_num = kPort;
  EXPECT_EQ(EINVAL, modify_qp(qp.get(), attr, kUdInitMask & ~IBV_QP_QKEY));
}

TEST_F(UdQpState, RtrToRtsWithoutSqPsnIsEinval) {
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_INIT;
  attr.port_num = kPort;
  attr.qkey = 7;
  ASSERT_EQ(0, modify_qp(qp.get(), attr, kUdInitMask));
  ASSERT_EQ(0, modify_qp(qp.get(), state_attr(IBV_QPS_RTR), IBV_QP_STATE));
  EXPECT_EQ(EINVAL, modify_qp(qp.get(), state_attr(IBV_QPS_RTS), IBV_QP_STATE));
}

TEST_F(UdQpState, ReachesRtsAndReportsItsQkey) {
  ud_to_rts(qp.get(), 0x1234);
  ibv_qp_attr attr{};
  ibv_qp_init_attr init{};
  ASSERT_EQ(0, ibv_query_qp(qp.get(), &attr, IBV_QP_STATE | IBV_QP_QKEY, &init));
  EXPECT_EQ(attr.qp_state, IBV_QPS_RTS);
  EXPECT_EQ(attr.qkey, 0x1234u);
}

// ---- two processes: what the states mean for traffic ----------------------------------

// SENDs stuck waiting for a receive (RNR, retried forever) are flushed when the
// QP is moved to ERR.
TEST(QpStateTraffic, OutstandingSendsAreFlushedWhenTheQpGoesToErr) {
  two_process(
      [](Channel &ch) {
        RcEnd a;
        a.connect(ch);
        for (uint64_t i = 1; i <= 3; ++i) ASSERT_EQ(0, a.post_send(i, 0, 64));
        EXPECT_TRUE(stays_empty(a.cq(), 200ms)) << "a SEND completed without a receive";
        ASSERT_EQ(0, modify_qp(a.qp(), state_attr(IBV_QPS_ERR), IBV_QP_STATE));
        auto wcs = wait_wcs(a.cq(), 3);
        for (uint64_t i = 0; i < 3; ++i) {
          EXPECT_EQ(wcs[i].wr_id, i + 1);
          EXPECT_EQ(wcs[i].status, IBV_WC_WR_FLUSH_ERR);
        }
        ch.signal();
      },
      [](Channel &ch) {
        RcEnd b;  // posts no receive
        b.connect(ch);
        ch.wait();
      });
}

// Takes a connected QP through ERR and RESET back to INIT, ready to connect
// again with a new PSN.
void recycle(RcEnd &end) {
  ASSERT_EQ(0, modify_qp(end.qp(), state_attr(IBV_QPS_ERR), IBV_QP_STATE));
  ASSERT_EQ(0, modify_qp(end.qp(), state_attr(IBV_QPS_RESET), IBV_QP_STATE));
  ASSERT_EQ(0, modify_qp(end.qp(), init_attr(kRemoteAll), kInitMask));
  end.rc.psn = (end.rc.psn + 1000) & 0xffffff;
}

// Both sides recycle their QPs through ERR and RESET and connect again.
TEST(QpStateTraffic, ErrResetAndReconnectCarriesDataAgain) {
  two_process(
      [&](Channel &ch) {
        RcEnd a;
        a.connect(ch);
        fill_pattern(a.buf.span(0, 512), 1);
        ASSERT_EQ(0, a.post_send(1, 0, 512));
        EXPECT_EQ(a.wait_wc().status, IBV_WC_SUCCESS);
        recycle(a);
        a.connect(ch);
        fill_pattern(a.buf.span(0, 512), 2);
        ASSERT_EQ(0, a.post_send(2, 0, 512));
        EXPECT_EQ(a.wait_wc().status, IBV_WC_SUCCESS);
      },
      [&](Channel &ch) {
        RcEnd b;
        ASSERT_EQ(0, b.post_recv(1, 0, 4096));
        b.connect(ch);
        EXPECT_EQ(b.wait_wc().status, IBV_WC_SUCCESS);
        EXPECT_TRUE(has_pattern(b.buf.span(0, 512), 1));
        recycle(b);
        ASSERT_EQ(0, b.post_recv(2, 0, 4096));
        b.connect(ch);
        ibv_wc wc = b.wait_wc();
        EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
        EXPECT_EQ(wc.wr_id, 2u);
        EXPECT_TRUE(has_pattern(b.buf.span(0, 512), 2));
      });
}

// Small SENDs reserve receives the sender knows were posted; a receiver that
// resets with such SENDs unpolled loses them with its receives, and a sender
// that knew of the old receives must not deliver into ones not posted yet.
TEST(QpStateTraffic, ResetWithUnpolledSmallSendsThenReconnectDeliversOnlyNewOnes) {
  two_process(
      [&](Channel &ch) {
        RcEnd a;
        a.connect(ch);
        for (uint64_t i = 1; i <= 3; ++i) {
          fill_pattern(a.buf.span(0, 8), 1);
          ASSERT_EQ(0, a.post_send(i, 0, 8));
          EXPECT_EQ(a.wait_wc().status, IBV_WC_SUCCESS);
        }
        ch.signal();
        recycle(a);
        a.connect(ch);
        fill_pattern(a.buf.span(0, 8), 2);
        ASSERT_EQ(0, a.post_send(4, 0, 8));  // before the peer posts: RNR, retried
        ibv_wc wc = a.wait_wc();
        EXPECT_EQ(wc.wr_id, 4u);
        EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
      },
      [&](Channel &ch) {
        RcEnd b;
        for (uint64_t i = 1; i <= 8; ++i) ASSERT_EQ(0, b.post_recv(i, 64 * i, 64));
        b.connect(ch);
        ch.wait();  // the three SENDs arrived, unpolled
        recycle(b);
        b.connect(ch);
        EXPECT_TRUE(stays_empty(b.cq(), 100ms)) << "a completion from before the reset";
        ASSERT_EQ(0, b.post_recv(10, 0, 64));
        ibv_wc wc = b.wait_wc();
        EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
        EXPECT_EQ(wc.wr_id, 10u);
        EXPECT_EQ(wc.byte_len, 8u);
        EXPECT_TRUE(has_pattern(b.buf.span(0, 8), 2));
        EXPECT_TRUE(stays_empty(b.cq(), 100ms));
      });
}

// A SEND posted while the send queue is drained (SQD) waits until the QP is
// back in RTS.
TEST(QpStateTraffic, SendPostedInSqdIsHeldUntilRts) {
  two_process(
      [](Channel &ch) {
        RcEnd a;
        a.connect(ch);
        ASSERT_EQ(0, modify_qp(a.qp(), state_attr(IBV_QPS_SQD), IBV_QP_STATE));
        fill_pattern(a.buf.span(0, 64), 4);
        ASSERT_EQ(0, a.post_send(1, 0, 64));
        EXPECT_TRUE(stays_empty(a.cq(), 300ms)) << "a SEND was executed in SQD";
        ch.signal();  // the peer checks that nothing arrived
        ch.wait();
        ASSERT_EQ(0, modify_qp(a.qp(), state_attr(IBV_QPS_RTS), IBV_QP_STATE));
        EXPECT_EQ(a.wait_wc().status, IBV_WC_SUCCESS);
        ch.signal();
      },
      [](Channel &ch) {
        RcEnd b;
        ASSERT_EQ(0, b.post_recv(1, 0, 4096));
        b.connect(ch);
        ch.wait();
        EXPECT_TRUE(stays_empty(b.cq(), 50ms)) << "a SEND posted in SQD arrived";
        ch.signal();
        ch.wait();
        ibv_wc wc = b.wait_wc();
        EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
        EXPECT_TRUE(has_pattern(b.buf.span(0, 64), 4));
      });
}

}  // namespace
}  // namespace pcientb::test
