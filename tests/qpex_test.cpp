// The extended QP (ibv_create_qp_ex with send_ops_flags) and the ibv_wr_*
// posting API.
#include "verbs_helpers.hpp"

#include <arpa/inet.h>

#include <array>
#include <cstring>

namespace pcientb::test {
namespace {

constexpr uint64_t kAllSendOps = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM |
                                 IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM |
                                 IBV_QP_EX_WITH_RDMA_READ | IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP |
                                 IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD;

RcOptions qp_ex_options() {
  RcOptions options;
  options.send_ops_flags = kAllSendOps;
  return options;
}

// Starts a one-WR batch with the given id, signaled.
ibv_qp_ex *start(RcEnd &end, uint64_t wr_id, unsigned flags = IBV_SEND_SIGNALED) {
  ibv_qp_ex *qpx = ibv_qp_to_qp_ex(end.qp());
  ibv_wr_start(qpx);
  qpx->wr_id = wr_id;
  qpx->wr_flags = flags;
  return qpx;
}

TEST(QpEx, CreateWithSendOpsFlagsGivesAnExtendedQp) {
  Node node;
  RcQp rc(node, qp_ex_options());
  ibv_qp_ex *qpx = ibv_qp_to_qp_ex(rc.qp.get());
  ASSERT_NE(qpx, nullptr);
  EXPECT_EQ(&qpx->qp_base, rc.qp.get());
  EXPECT_NE(qpx->wr_start, nullptr);
  EXPECT_NE(qpx->wr_complete, nullptr);
  EXPECT_NE(qpx->wr_abort, nullptr);
  EXPECT_NE(qpx->wr_send, nullptr);
  EXPECT_NE(qpx->wr_rdma_write, nullptr);
  EXPECT_NE(qpx->wr_rdma_read, nullptr);
  EXPECT_NE(qpx->wr_atomic_fetch_add, nullptr);
  EXPECT_NE(qpx->wr_atomic_cmp_swp, nullptr);
  EXPECT_NE(qpx->wr_set_sge, nullptr);
  EXPECT_NE(qpx->wr_set_sge_list, nullptr);
  EXPECT_NE(qpx->wr_set_inline_data, nullptr);
}

TEST(QpEx, WrSendWithSetSge) {
  two_process(
      [](Channel &ch) {
        RcEnd a(qp_ex_options());
        a.connect(ch);
        fill_pattern(a.buf.span(0, 500), 1);
        ibv_qp_ex *qpx = start(a, 7);
        ibv_wr_send(qpx);
        ibv_wr_set_sge(qpx, a.buf.mr->lkey, a.buf.addr(0), 500);
        ASSERT_EQ(0, ibv_wr_complete(qpx));
        ibv_wc wc = a.wait_wc();
        EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
        EXPECT_EQ(wc.wr_id, 7u);
        EXPECT_EQ(wc.opcode, IBV_WC_SEND);
      },
      [](Channel &ch) { receive_one_message(ch, RcOptions{}, 500, 1); });
}

TEST(QpEx, WrSendImmWithSetSgeList) {
  two_process(
      [](Channel &ch) {
        RcEnd a(qp_ex_options());
        a.connect(ch);
        fill_pattern(a.buf.span(0, 4096), 2);
        ibv_qp_ex *qpx = start(a, 1);
        ibv_wr_send_imm(qpx, htonl(0x600d));
        ibv_sge sges[] = {a.sge(0, 10), a.sge(2000, 90)};
        ibv_wr_set_sge_list(qpx, 2, sges);
        ASSERT_EQ(0, ibv_wr_complete(qpx));
        EXPECT_EQ(a.wait_wc().status, IBV_WC_SUCCESS);
      },
      [](Channel &ch) {
        RcEnd b;
        ASSERT_EQ(0, b.post_recv(1, 0, 4096));
        b.connect(ch);
        ibv_wc wc = b.wait_wc();
        EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
        EXPECT_EQ(wc.byte_len, 100u);
        EXPECT_TRUE(wc.wc_flags & IBV_WC_WITH_IMM);
        EXPECT_EQ(ntohl(wc.imm_data), 0x600du);
        EXPECT_TRUE(has_pattern(b.buf.span(0, 10), 2, 0));
        EXPECT_TRUE(has_pattern(b.buf.span(10, 90), 2, 2000));
      });
}

TEST(QpEx, WrRdmaWriteAndWriteImm) {
  two_process(
      [](Channel &ch) {
        RcEnd a(qp_ex_options());
        a.connect(ch);
        fill_pattern(a.buf.span(0, 2048), 3);
        ibv_qp_ex *qpx = start(a, 1);
        ibv_wr_rdma_write(qpx, a.rkey(), a.raddr(0));
        ibv_wr_set_sge(qpx, a.buf.mr->lkey, a.buf.addr(0), 1024);
        ASSERT_EQ(0, ibv_wr_complete(qpx));
        ibv_wc wc = a.wait_wc();
        EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
        EXPECT_EQ(wc.opcode, IBV_WC_RDMA_WRITE);

        qpx = start(a, 2);
        ibv_wr_rdma_write_imm(qpx, a.rkey(), a.raddr(1024), htonl(99));
        ibv_wr_set_sge(qpx, a.buf.mr->lkey, a.buf.addr(1024), 1024);
        ASSERT_EQ(0, ibv_wr_complete(qpx));
        EXPECT_EQ(a.wait_wc().status, IBV_WC_SUCCESS);
      },
      [](Channel &ch) {
        RcEnd b;
        ASSERT_EQ(0, b.post_recv(1, 8192, 64));
        b.connect(ch);
        ibv_wc wc = b.wait_wc();
        EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
        EXPECT_EQ(wc.opcode, IBV_WC_RECV_RDMA_WITH_IMM);
        EXPECT_EQ(wc.byte_len, 1024u);
        EXPECT_EQ(ntohl(wc.imm_data), 99u);
        EXPECT_TRUE(has_pattern(b.buf.span(0, 2048), 3));
      });
}

TEST(QpEx, WrRdmaRead) {
  two_process(
      [](Channel &ch) {
        RcEnd a(qp_ex_options());
        a.connect(ch);
        ch.wait();
        ibv_qp_ex *qpx = start(a, 3);
        ibv_wr_rdma_read(qpx, a.rkey(), a.raddr(100));
        ibv_wr_set_sge(qpx, a.buf.mr->lkey, a.buf.addr(0), 3000);
        ASSERT_EQ(0, ibv_wr_complete(qpx));
        ibv_wc wc = a.wait_wc();
        EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
        EXPECT_EQ(wc.opcode, IBV_WC_RDMA_READ);
        EXPECT_TRUE(has_pattern(a.buf.span(0, 3000), 4, 100));
        ch.signal();
      },
      [](Channel &ch) {
        RcEnd b;
        b.connect(ch);
        fill_pattern(b.buf.span(0, 4096), 4);
        ch.signal();
        ch.wait();
      });
}

TEST(QpEx, WrAtomicFetchAddAndCmpSwp) {
  two_process(
      [](Channel &ch) {
        RcEnd a(qp_ex_options());
        a.connect(ch);
        ch.wait();  // target holds 40 at offset 0
        ibv_qp_ex *qpx = start(a, 1);
        ibv_wr_atomic_fetch_add(qpx, a.rkey(), a.raddr(0), 2);
        ibv_wr_set_sge(qpx, a.buf.mr->lkey, a.buf.addr(0), 8);
        ASSERT_EQ(0, ibv_wr_complete(qpx));
        ibv_wc wc = a.wait_wc();
        EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
        EXPECT_EQ(wc.opcode, IBV_WC_FETCH_ADD);
        uint64_t old;
        std::memcpy(&old, a.buf.at(0), 8);
        EXPECT_EQ(old, 40u);

        qpx = start(a, 2);
        ibv_wr_atomic_cmp_swp(qpx, a.rkey(), a.raddr(0), 42, 1000);
        ibv_wr_set_sge(qpx, a.buf.mr->lkey, a.buf.addr(8), 8);
        ASSERT_EQ(0, ibv_wr_complete(qpx));
        wc = a.wait_wc();
        EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
        EXPECT_EQ(wc.opcode, IBV_WC_COMP_SWAP);
        std::memcpy(&old, a.buf.at(8), 8);
        EXPECT_EQ(old, 42u);
        ch.signal();
      },
      [](Channel &ch) {
        RcEnd b;
        b.connect(ch);
        uint64_t v = 40;
        std::memcpy(b.buf.at(0), &v, 8);
        ch.signal();
        ch.wait();
        std::memcpy(&v, b.buf.at(0), 8);
        EXPECT_EQ(v, 1000u);
      });
}

TEST(QpEx, WrSetInlineDataIsCopiedAtPostTime) {
  two_process(
      [](Channel &ch) {
        RcEnd a(qp_ex_options());
        a.connect(ch);
        std::array<uint8_t, 40> data;
        fill_pattern(data, 5);
        ibv_qp_ex *qpx = start(a, 1, IBV_SEND_SIGNALED | IBV_SEND_INLINE);
        ibv_wr_send(qpx);
        ibv_wr_set_inline_data(qpx, data.data(), data.size());
        data.fill(0);  // before completing: the data was copied by set_inline_data
        ASSERT_EQ(0, ibv_wr_complete(qpx));
        EXPECT_EQ(a.wait_wc().status, IBV_WC_SUCCESS);
      },
      [](Channel &ch) { receive_one_message(ch, RcOptions{}, 40, 5); });
}

TEST(QpEx, SeveralWrsInOneBatchCompleteInOrder) {
  two_process(
      [](Channel &ch) {
        RcEnd a(qp_ex_options());
        a.connect(ch);
        fill_pattern(a.buf.span(0, 1024), 6);
        ibv_qp_ex *qpx = ibv_qp_to_qp_ex(a.qp());
        ibv_wr_start(qpx);
        qpx->wr_id = 1;
        qpx->wr_flags = IBV_SEND_SIGNALED;
        ibv_wr_rdma_write(qpx, a.rkey(), a.raddr(0));
        ibv_wr_set_sge(qpx, a.buf.mr->lkey, a.buf.addr(0), 1024);
        qpx->wr_id = 2;
        qpx->wr_flags = 0;  // unsignaled: no completion
        ibv_wr_rdma_read(qpx, a.rkey(), a.raddr(0));
        ibv_wr_set_sge(qpx, a.buf.mr->lkey, a.buf.addr(4096), 1024);
        qpx->wr_id = 3;
        qpx->wr_flags = IBV_SEND_SIGNALED;
        ibv_wr_send(qpx);
        ibv_wr_set_sge(qpx, a.buf.mr->lkey, a.buf.addr(0), 64);
        ASSERT_EQ(0, ibv_wr_complete(qpx));
        auto wcs = wait_wcs(a.cq(), 2);
        EXPECT_EQ(wcs[0].wr_id, 1u);
        EXPECT_EQ(wcs[0].status, IBV_WC_SUCCESS);
        EXPECT_EQ(wcs[1].wr_id, 3u);
        EXPECT_EQ(wcs[1].status, IBV_WC_SUCCESS);
        EXPECT_TRUE(stays_empty(a.cq(), 50ms));
        EXPECT_TRUE(has_pattern(a.buf.span(4096, 1024), 6)) << "the READ saw the earlier WRITE";
      },
      [](Channel &ch) {
        RcEnd b;
        ASSERT_EQ(0, b.post_recv(1, 8192, 64));
        b.connect(ch);
        EXPECT_EQ(b.wait_wc().status, IBV_WC_SUCCESS);
        EXPECT_TRUE(has_pattern(b.buf.span(0, 1024), 6));
      });
}

TEST(QpEx, WrAbortDiscardsTheBatch) {
  two_process(
      [](Channel &ch) {
        RcEnd a(qp_ex_options());
        a.connect(ch);
        fill_pattern(a.buf.span(0, 64), 7);
        ibv_qp_ex *qpx = start(a, 1);
        ibv_wr_send(qpx);
        ibv_wr_set_sge(qpx, a.buf.mr->lkey, a.buf.addr(0), 32);
        ibv_wr_abort(qpx);
        EXPECT_TRUE(stays_empty(a.cq(), 100ms)) << "an aborted WR completed";
        qpx = start(a, 2);
        ibv_wr_send(qpx);
        ibv_wr_set_sge(qpx, a.buf.mr->lkey, a.buf.addr(0), 64);
        ASSERT_EQ(0, ibv_wr_complete(qpx));
        ibv_wc wc = a.wait_wc();
        EXPECT_EQ(wc.wr_id, 2u);
        EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
      },
      [](Channel &ch) {
        RcEnd b;
        ASSERT_EQ(0, b.post_recv(1, 0, 4096));
        b.connect(ch);
        ibv_wc wc = b.wait_wc();
        EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
        EXPECT_EQ(wc.byte_len, 64u) << "the aborted 32-byte SEND was delivered";
      });
}

}  // namespace
}  // namespace pcientb::test
