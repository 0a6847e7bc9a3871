// The extended QP (ibv_create_qp_ex with send_ops_flags) and the ibv_wr_*
// posting API.
#include "verbs_helpers.hpp"

#include <arpa/inet.h>

#include <array>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

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

// Inline data of a batch, short (held in the WR) and long (held on the heap, from two
// pieces), still carries the bytes of its post when it is sent again after the receiver
// was not ready (RNR); an SGE set after the inline data replaces it.
TEST(QpEx, InlineDataOfABatchSurvivesAnRnrGoBack) {
  RcOptions opts = qp_ex_options();
  opts.max_inline = 256;
  two_process(
      [opts](Channel &ch) {
        RcEnd a(opts);
        a.connect(ch);
        std::array<uint8_t, 40> small;
        std::array<uint8_t, 200> large;
        fill_pattern(small, 11);
        fill_pattern(large, 12);
        fill_pattern(a.buf.span(0, 64), 13);
        ibv_qp_ex *qpx = start(a, 1, IBV_SEND_SIGNALED);
        ibv_wr_send(qpx);
        ibv_wr_set_inline_data(qpx, small.data(), small.size());
        qpx->wr_id = 2;
        ibv_wr_send(qpx);
        ibv_data_buf pieces[2] = {{large.data(), 120}, {large.data() + 120, 80}};
        ibv_wr_set_inline_data_list(qpx, 2, pieces);
        qpx->wr_id = 3;
        ibv_wr_send(qpx);
        ibv_wr_set_inline_data(qpx, small.data(), small.size());
        ibv_wr_set_sge(qpx, a.buf.mr->lkey, a.buf.addr(0), 64);  // the last setter wins
        ASSERT_EQ(0, ibv_wr_complete(qpx));
        small.fill(0);
        large.fill(0);
        for (uint64_t id = 1; id <= 3; ++id) {
          ibv_wc wc = a.wait_wc();
          EXPECT_EQ(wc.status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc.status);
          EXPECT_EQ(wc.wr_id, id);
        }
      },
      [opts](Channel &ch) {
        RcEnd b(opts);
        b.connect(ch);
        // No receive yet: the sender's SENDs are refused (RNR) and sent again.
        std::this_thread::sleep_for(std::chrono::milliseconds(30));
        for (uint64_t id = 1; id <= 3; ++id) ASSERT_EQ(0, b.post_recv(id, id * 1024, 1024));
        const uint32_t len[] = {40, 200, 64}, seed[] = {11, 12, 13};
        for (int i = 0; i < 3; ++i) {
          ibv_wc wc = b.wait_wc();
          ASSERT_EQ(wc.status, IBV_WC_SUCCESS) << ibv_wc_status_str(wc.status);
          ASSERT_EQ(wc.wr_id, i + 1u);
          EXPECT_EQ(wc.byte_len, len[i]);
          EXPECT_TRUE(has_pattern(b.buf.span((i + 1) * 1024, len[i]), seed[i])) << "message " << i;
        }
      });
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

// ---- what ibv_wr_complete refuses: the rules of ibv_post_send, for the batch as a whole ----

// An extended RC QP in RTS connected to itself on this node: no peer needed.
struct SelfRc {
  explicit SelfRc(RcOptions options = qp_ex_options()) : options(options), rc(node, options) {
    Endpoint self = rc.endpoint(node, buf);
    rc_init_to_rts(rc.qp.get(), self, self, options.params);
    ibv_qp_attr attr{};
    if (ibv_query_qp(rc.qp.get(), &attr, IBV_QP_CAP, &init)) throw SetupError("ibv_query_qp");
  }
  ibv_qp_ex *start(uint64_t wr_id, unsigned flags = IBV_SEND_SIGNALED) {
    ibv_qp_ex *qpx = ibv_qp_to_qp_ex(rc.qp.get());
    ibv_wr_start(qpx);
    qpx->wr_id = wr_id;
    qpx->wr_flags = flags;
    return qpx;
  }
  // Queues an RDMA WRITE of `length` bytes from offset 0 to the upper half of the buffer.
  void write(ibv_qp_ex *qpx, uint32_t length = 64) {
    ibv_wr_rdma_write(qpx, buf.mr->rkey, buf.addr(buf.bytes.size() / 2));
    ibv_wr_set_sge(qpx, buf.mr->lkey, buf.addr(0), length);
  }
  ibv_cq *cq() const { return rc.cq.get(); }

  RcOptions options;
  Node node;
  Buffer buf{node.pd.get(), 64 * 1024};
  RcQp rc;
  ibv_qp_init_attr init{};  // its capabilities, as created
};

TEST(QpExRules, AFullSendQueueFailsTheBatchWithEnomemAndPostsNothing) {
  RcOptions options = qp_ex_options();
  options.max_send_wr = 8;
  SelfRc q(options);
  const uint32_t max_wr = q.init.cap.max_send_wr;
  fill_pattern(q.buf.span(0, 64), 11);

  // One batch larger than the whole queue.
  ibv_qp_ex *qpx = q.start(1);
  for (uint32_t i = 0; i <= max_wr; ++i) q.write(qpx);
  EXPECT_EQ(ENOMEM, ibv_wr_complete(qpx));
  EXPECT_TRUE(stays_empty(q.cq(), 50ms)) << "a WR of the refused batch was executed";
  EXPECT_TRUE(all_bytes_are(q.buf.span(q.buf.bytes.size() / 2, 64), 0));

  // The queue filled by earlier batches whose completions are not polled yet.
  for (uint32_t i = 0; i < max_wr; ++i) {
    qpx = q.start(100 + i);
    q.write(qpx);
    ASSERT_EQ(0, ibv_wr_complete(qpx)) << "WR " << i << " of " << max_wr;
  }
  qpx = q.start(999);
  q.write(qpx);
  EXPECT_EQ(ENOMEM, ibv_wr_complete(qpx));
  auto wcs = wait_wcs(q.cq(), max_wr);
  for (uint32_t i = 0; i < max_wr; ++i) {
    EXPECT_EQ(wcs[i].wr_id, 100u + i);
    EXPECT_EQ(wcs[i].status, IBV_WC_SUCCESS);
  }
  EXPECT_TRUE(stays_empty(q.cq(), 50ms)) << "the refused WR was executed";

  // Polled: there is room again.
  qpx = q.start(1000);
  q.write(qpx);
  ASSERT_EQ(0, ibv_wr_complete(qpx));
  EXPECT_EQ(wait_wc(q.cq()).wr_id, 1000u);
}

TEST(QpExRules, OneInvalidWrFailsTheWholeBatch) {
  SelfRc q;
  fill_pattern(q.buf.span(0, 64), 12);
  ibv_qp_ex *qpx = q.start(1);
  q.write(qpx);  // valid
  qpx->wr_id = 2;
  qpx->wr_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;  // an inline READ is not
  ibv_wr_rdma_read(qpx, q.buf.mr->rkey, q.buf.addr(0));
  ibv_wr_set_sge(qpx, q.buf.mr->lkey, q.buf.addr(1024), 64);
  EXPECT_EQ(EINVAL, ibv_wr_complete(qpx));
  EXPECT_TRUE(stays_empty(q.cq(), 50ms));
  EXPECT_TRUE(all_bytes_are(q.buf.span(q.buf.bytes.size() / 2, 64), 0))
      << "the valid WRITE ahead of the bad WR was executed";
}

TEST(QpExRules, InlineReadAndAtomicsAreRejected) {
  SelfRc q;
  const unsigned inl = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
  ibv_qp_ex *qpx = q.start(1, inl);
  ibv_wr_rdma_read(qpx, q.buf.mr->rkey, q.buf.addr(0));
  ibv_wr_set_sge(qpx, q.buf.mr->lkey, q.buf.addr(1024), 64);
  EXPECT_EQ(EINVAL, ibv_wr_complete(qpx)) << "inline RDMA READ";
  qpx = q.start(2, inl);
  ibv_wr_atomic_fetch_add(qpx, q.buf.mr->rkey, q.buf.addr(0), 1);
  ibv_wr_set_sge(qpx, q.buf.mr->lkey, q.buf.addr(1024), 8);
  EXPECT_EQ(EINVAL, ibv_wr_complete(qpx)) << "inline fetch-and-add";
  qpx = q.start(3, inl);
  ibv_wr_atomic_cmp_swp(qpx, q.buf.mr->rkey, q.buf.addr(0), 0, 1);
  ibv_wr_set_sge(qpx, q.buf.mr->lkey, q.buf.addr(1024), 8);
  EXPECT_EQ(EINVAL, ibv_wr_complete(qpx)) << "inline compare-and-swap";
  // The same rule as ibv_post_send's.
  EXPECT_EQ(EINVAL, SendWr(IBV_WR_RDMA_READ, 4, inl)
                        .sge(q.buf.sge(1024, 64))
                        .remote(q.buf.addr(0), q.buf.mr->rkey)
                        .post(q.rc.qp.get()));
  EXPECT_TRUE(stays_empty(q.cq(), 50ms));
}

// With IBV_SEND_INLINE in wr_flags, SGEs set by ibv_wr_set_sge(_list) are the
// inline data, as with ibv_post_send: the QP's SGE and inline limits apply.
TEST(QpExRules, InlineFlagWithSgesObeysTheSgeAndInlineLimits) {
  SelfRc q;
  const unsigned inl = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
  const uint32_t max_sge = q.init.cap.max_send_sge;
  const uint32_t max_inline = q.init.cap.max_inline_data;
  ASSERT_LT(max_sge, 16u);

  ibv_qp_ex *qpx = q.start(1, inl);
  ibv_wr_rdma_write(qpx, q.buf.mr->rkey, q.buf.addr(32768));
  std::vector<ibv_sge> sges;
  for (uint32_t i = 0; i <= max_sge; ++i) sges.push_back(q.buf.sge(i, 1));
  ibv_wr_set_sge_list(qpx, sges.size(), sges.data());
  EXPECT_EQ(EINVAL, ibv_wr_complete(qpx)) << max_sge + 1 << " inline SGEs";

  qpx = q.start(2, inl);
  q.write(qpx, max_inline + 1);
  EXPECT_EQ(EINVAL, ibv_wr_complete(qpx)) << max_inline + 1 << " bytes inline in one SGE";

  std::vector<uint8_t> data(max_inline + 1, 0x5a);
  qpx = q.start(3, inl);
  ibv_wr_rdma_write(qpx, q.buf.mr->rkey, q.buf.addr(32768));
  ibv_wr_set_inline_data(qpx, data.data(), data.size());
  EXPECT_EQ(EINVAL, ibv_wr_complete(qpx)) << max_inline + 1 << " bytes by set_inline_data";

  qpx = q.start(4);
  ibv_wr_rdma_write(qpx, q.buf.mr->rkey, q.buf.addr(32768));
  sges.resize(max_sge + 1);
  ibv_wr_set_sge_list(qpx, sges.size(), sges.data());
  EXPECT_EQ(EINVAL, ibv_wr_complete(qpx)) << max_sge + 1 << " SGEs";
  EXPECT_TRUE(stays_empty(q.cq(), 50ms));
  EXPECT_TRUE(all_bytes_are(q.buf.span(32768, 256), 0));

  // At the limits it goes.
  fill_pattern(q.buf.span(0, max_inline), 13);
  qpx = q.start(5, inl);
  q.write(qpx, max_inline);
  ASSERT_EQ(0, ibv_wr_complete(qpx));
  EXPECT_EQ(wait_wc(q.cq()).status, IBV_WC_SUCCESS);
  EXPECT_TRUE(has_pattern(q.buf.span(32768, max_inline), 13));
}

TEST(QpExRules, AQpNotYetInRtsRefusesTheBatch) {
  Node node;
  Buffer buf(node.pd.get(), 4096);
  RcQp rc(node, qp_ex_options());  // in INIT
  ibv_qp_ex *qpx = ibv_qp_to_qp_ex(rc.qp.get());
  ibv_wr_start(qpx);
  qpx->wr_id = 1;
  qpx->wr_flags = IBV_SEND_SIGNALED;
  ibv_wr_rdma_write(qpx, buf.mr->rkey, buf.addr(2048));
  ibv_wr_set_sge(qpx, buf.mr->lkey, buf.addr(0), 64);
  EXPECT_EQ(EINVAL, ibv_wr_complete(qpx)) << "in INIT";
  EXPECT_TRUE(stays_empty(rc.cq.get(), 50ms));
}

// A UD QP made with every send op: what ibv_wr_* may build on it is still
// limited to SENDs, as for ibv_post_send.
TEST(QpExRules, UdQpRefusesRdmaAndAtomics) {
  Node node;
  Buffer buf(node.pd.get(), 64 * 1024);
  auto cq = create_cq(node.ctx.get());
  ibv_qp_init_attr attr = ud_qp_attr(cq.get());
  ibv_qp_init_attr_ex ex{};
  ex.qp_type = attr.qp_type;
  ex.send_cq = ex.recv_cq = cq.get();
  ex.cap = attr.cap;
  ex.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
  ex.pd = node.pd.get();
  ex.send_ops_flags = kAllSendOps;
  QpPtr qp(ibv_create_qp_ex(node.ctx.get(), &ex));
  ASSERT_NE(qp, nullptr) << std::strerror(errno);
  constexpr uint32_t kQkey = 0x11111111;
  ud_to_rts(qp.get(), kQkey);
  // The receiver, on this node too.
  auto rcq = create_cq(node.ctx.get());
  auto rqp = create_qp(node.pd.get(), ud_qp_attr(rcq.get()));
  ud_to_rts(rqp.get(), kQkey);
  for (int i = 0; i < 8; ++i)
    ASSERT_EQ(0, RecvWr(i).sge(buf.sge(8192 + 4096 * i, 4096)).post(rqp.get()));
  Endpoint self;
  self.lid = node.lid();
  self.gid = node.gid;
  auto ah = create_ah(node.pd.get(), self);
  ibv_qp_ex *qpx = ibv_qp_to_qp_ex(qp.get());

  struct Case {
    const char *name;
    void (*build)(ibv_qp_ex *, uint32_t rkey, uint64_t addr);
  };
  const Case cases[] = {
      {"RDMA WRITE", [](ibv_qp_ex *x, uint32_t k, uint64_t a) { ibv_wr_rdma_write(x, k, a); }},
      {"RDMA WRITE with immediate",
       [](ibv_qp_ex *x, uint32_t k, uint64_t a) { ibv_wr_rdma_write_imm(x, k, a, htonl(1)); }},
      {"RDMA READ", [](ibv_qp_ex *x, uint32_t k, uint64_t a) { ibv_wr_rdma_read(x, k, a); }},
      {"compare-and-swap",
       [](ibv_qp_ex *x, uint32_t k, uint64_t a) { ibv_wr_atomic_cmp_swp(x, k, a, 0, 1); }},
      {"fetch-and-add",
       [](ibv_qp_ex *x, uint32_t k, uint64_t a) { ibv_wr_atomic_fetch_add(x, k, a, 1); }},
  };
  for (const Case &c : cases) {
    ibv_wr_start(qpx);
    qpx->wr_id = 1;
    qpx->wr_flags = IBV_SEND_SIGNALED;
    c.build(qpx, buf.mr->rkey, buf.addr(4096));
    ibv_wr_set_ud_addr(qpx, ah.get(), rqp->qp_num, kQkey);
    ibv_wr_set_sge(qpx, buf.mr->lkey, buf.addr(0), 8);
    EXPECT_EQ(EINVAL, ibv_wr_complete(qpx)) << c.name << " on a UD QP";
  }
  // The same rule as ibv_post_send's.
  for (ibv_wr_opcode op : {IBV_WR_RDMA_WRITE, IBV_WR_RDMA_WRITE_WITH_IMM, IBV_WR_RDMA_READ,
                           IBV_WR_ATOMIC_CMP_AND_SWP, IBV_WR_ATOMIC_FETCH_AND_ADD})
    EXPECT_EQ(EINVAL,
              SendWr(op, 1).sge(buf.sge(0, 8)).ud(ah.get(), rqp->qp_num, kQkey).post(qp.get()))
        << "ibv_post_send of opcode " << op << " on a UD QP";
  EXPECT_TRUE(stays_empty(cq.get(), 50ms)) << "a refused WR completed";
  EXPECT_TRUE(stays_empty(rcq.get(), 50ms)) << "a refused WR went out as a datagram";

  // A SEND on the same QP goes out.
  ibv_wr_start(qpx);
  qpx->wr_id = 2;
  qpx->wr_flags = IBV_SEND_SIGNALED;
  ibv_wr_send(qpx);
  ibv_wr_set_ud_addr(qpx, ah.get(), rqp->qp_num, kQkey);
  ibv_wr_set_sge(qpx, buf.mr->lkey, buf.addr(0), 8);
  ASSERT_EQ(0, ibv_wr_complete(qpx));
  ibv_wc wc = wait_wc(cq.get());
  EXPECT_EQ(wc.wr_id, 2u);
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
  wc = wait_wc(rcq.get());
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
  EXPECT_EQ(wc.byte_len, kGrhBytes + 8);
}

}  // namespace
}  // namespace pcientb::test
