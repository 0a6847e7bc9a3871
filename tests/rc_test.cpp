// RC data movement between two processes: every opcode, scatter/gather,
// inline, selective signalling, fence, zero-length and large messages, and
// the ordering an HCA guarantees.
#include "verbs_helpers.hpp"

#include <arpa/inet.h>

#include <array>
#include <cstring>

namespace pcientb::test {
namespace {

constexpr size_t k4MiB = 4u << 20;

// ---- SEND / RECV --------------------------------------------------------------

TEST(RcSend, DeliversThePayloadIntoThePostedReceive) {
  two_process(
      [](Channel &ch) {
        RcEnd a;
        a.connect(ch);
        fill_pattern(a.buf.span(0, 1000), 1);
        ASSERT_EQ(0, a.post_send(11, 0, 1000));
        ibv_wc wc = a.wait_wc();
        EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
        EXPECT_EQ(wc.wr_id, 11u);
        EXPECT_EQ(wc.opcode, IBV_WC_SEND);
        EXPECT_EQ(wc.qp_num, a.qp()->qp_num);
      },
      [](Channel &ch) {
        RcEnd b;
        ASSERT_EQ(0, b.post_recv(22, 100, 4096));
        b.connect(ch);
        ibv_wc wc = b.wait_wc();
        EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
        EXPECT_EQ(wc.wr_id, 22u);
        EXPECT_EQ(wc.opcode, IBV_WC_RECV);
        EXPECT_EQ(wc.byte_len, 1000u);
        EXPECT_EQ(wc.qp_num, b.qp()->qp_num);
        EXPECT_EQ(wc.wc_flags & IBV_WC_WITH_IMM, 0u);
        EXPECT_TRUE(has_pattern(b.buf.span(100, 1000), 1));
        EXPECT_TRUE(all_bytes_are(b.buf.span(0, 100), 0));
        EXPECT_TRUE(all_bytes_are(b.buf.span(1100, 4096), 0)) << "written past byte_len";
      });
}

TEST(RcSend, SendWithImmDeliversTheImmediate) {
  two_process(
      [](Channel &ch) {
        RcEnd a;
        a.connect(ch);
        fill_pattern(a.buf.span(0, 256), 2);
        ASSERT_EQ(0,
                  SendWr(IBV_WR_SEND_WITH_IMM, 1).sge(a.sge(0, 256)).imm(0xdeadbeef).post(a.qp()));
        ibv_wc wc = a.wait_wc();
        EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
        EXPECT_EQ(wc.opcode, IBV_WC_SEND);
      },
      [](Channel &ch) {
        RcEnd b;
        ASSERT_EQ(0, b.post_recv(1, 0, 4096));
        b.connect(ch);
        ibv_wc wc = b.wait_wc();
        EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
        EXPECT_EQ(wc.opcode, IBV_WC_RECV);
        EXPECT_EQ(wc.byte_len, 256u);
        EXPECT_TRUE(wc.wc_flags & IBV_WC_WITH_IMM);
        EXPECT_EQ(ntohl(wc.imm_data), 0xdeadbeefu);
        EXPECT_TRUE(has_pattern(b.buf.span(0, 256), 2));
      });
}

// pyverbs-style connections address the peer with a GRH (is_global = 1).
TEST(RcSend, WorksOverAConnectionAddressedWithAGrh) {
  RcOptions options;
  options.params.grh = true;
  two_process(
      [&](Channel &ch) {
        RcEnd a(options);
        a.connect(ch);
        fill_pattern(a.buf.span(0, 128), 3);
        ASSERT_EQ(0, a.post_send(1, 0, 128));
        EXPECT_EQ(a.wait_wc().status, IBV_WC_SUCCESS);
      },
      [&](Channel &ch) { receive_one_message(ch, options, 128, 3); });
}

TEST(RcSend, GathersAndScattersAcrossSeveralSges) {
  // The sender gathers 100 + 200 + 300 bytes from three places; the receiver
  // scatters the 600-byte message over 50 + 250 + 400 bytes.
  two_process(
      [](Channel &ch) {
        RcEnd a;
        a.connect(ch);
        fill_pattern(a.buf.span(0, 8192), 4);
        ASSERT_EQ(0, SendWr(IBV_WR_SEND, 1)
                         .sge(a.sge(0, 100))
                         .sge(a.sge(1000, 200))
                         .sge(a.sge(3000, 300))
                         .post(a.qp()));
        EXPECT_EQ(a.wait_wc().status, IBV_WC_SUCCESS);
      },
      [](Channel &ch) {
        RcEnd b;
        ASSERT_EQ(
            0,
            RecvWr(1).sge(b.sge(0, 50)).sge(b.sge(2000, 250)).sge(b.sge(5000, 400)).post(b.qp()));
        b.connect(ch);
        ibv_wc wc = b.wait_wc();
        ASSERT_EQ(wc.status, IBV_WC_SUCCESS);
        EXPECT_EQ(wc.byte_len, 600u);
        std::vector<uint8_t> sent(600);
        fill_pattern({sent.data(), 100}, 4, 0);
        fill_pattern({sent.data() + 100, 200}, 4, 1000);
        fill_pattern({sent.data() + 300, 300}, 4, 3000);
        std::vector<uint8_t> got;
        got.insert(got.end(), b.buf.at(0), b.buf.at(50));
        got.insert(got.end(), b.buf.at(2000), b.buf.at(2250));
        got.insert(got.end(), b.buf.at(5000), b.buf.at(5300));
        EXPECT_EQ(got, sent);
        EXPECT_TRUE(all_bytes_are(b.buf.span(5300, 100), 0)) << "written past the message";
      });
}

// IBV_SEND_INLINE copies the data at post time: the buffer (not even
// registered; its lkey is not checked) can be reused at once.
TEST(RcSend, InlineDataIsCopiedAtPostTime) {
  two_process(
      [](Channel &ch) {
        RcEnd a;
        a.connect(ch);
        std::array<uint8_t, 48> data;
        fill_pattern(data, 5);
        ASSERT_EQ(0, SendWr(IBV_WR_SEND, 1, IBV_SEND_SIGNALED | IBV_SEND_INLINE)
                         .sge(data.data(), data.size(), 0)
                         .post(a.qp()));
        data.fill(0xee);
        EXPECT_EQ(a.wait_wc().status, IBV_WC_SUCCESS);
      },
      [](Channel &ch) { receive_one_message(ch, RcOptions{}, 48, 5); });
}

TEST(RcWrite, InlineWriteIsCopiedAtPostTime) {
  two_process(
      [](Channel &ch) {
        RcEnd a;
        a.connect(ch);
        std::array<uint8_t, 60> data;
        fill_pattern(data, 6);
        ASSERT_EQ(0, SendWr(IBV_WR_RDMA_WRITE, 1, IBV_SEND_SIGNALED | IBV_SEND_INLINE)
                         .sge(data.data(), 20, 0)
                         .sge(data.data() + 20, 40, 0)
                         .remote(a.raddr(512), a.rkey())
                         .post(a.qp()));
        data.fill(0xee);
        EXPECT_EQ(a.wait_wc().status, IBV_WC_SUCCESS);
        ch.signal();
      },
      [](Channel &ch) {
        RcEnd b;
        b.connect(ch);
        ch.wait();
        EXPECT_TRUE(has_pattern(b.buf.span(512, 60), 6));
      });
}

TEST(RcSend, InlineLargerThanTheQpsMaxInlineIsRejected) {
  Node node;
  auto cq = create_cq(node.ctx.get());
  auto qp = create_qp(node.pd.get(), rc_qp_attr(cq.get()));
  ibv_qp_attr attr{};
  ibv_qp_init_attr init{};
  ASSERT_EQ(0, ibv_query_qp(qp.get(), &attr, IBV_QP_CAP, &init));
  Endpoint self{node.lid(), qp->qp_num, 0, 0, 0, 0, 0, node.gid};
  rc_to_rts(qp.get(), self, self);
  std::vector<uint8_t> data(init.cap.max_inline_data + 1);
  EXPECT_NE(0, SendWr(IBV_WR_SEND, 1, IBV_SEND_SIGNALED | IBV_SEND_INLINE)
                   .sge(data.data(), static_cast<uint32_t>(data.size()), 0)
                   .post(qp.get()));
}

TEST(RcSend, ZeroLengthSendCompletesWithZeroByteLen) {
  two_process(
      [](Channel &ch) {
        RcEnd a;
        a.connect(ch);
        ASSERT_EQ(0, SendWr(IBV_WR_SEND, 1).post(a.qp()));  // num_sge = 0
        EXPECT_EQ(a.wait_wc().status, IBV_WC_SUCCESS);
      },
      [](Channel &ch) {
        RcEnd b;
        ASSERT_EQ(0, b.post_recv(1, 0, 64));
        b.connect(ch);
        ibv_wc wc = b.wait_wc();
        EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
        EXPECT_EQ(wc.opcode, IBV_WC_RECV);
        EXPECT_EQ(wc.byte_len, 0u);
      });
}

// UCX posts an empty active message as an SGE of length 0 at address NULL
// (lkey 0) in front of its header: nothing is read from it.
TEST(RcSend, AnEmptySgeAtNullIsSkipped) {
  two_process(
      [](Channel &ch) {
        RcEnd a;
        a.connect(ch);
        fill_pattern(a.buf.span(0, 16), 5);
        ASSERT_EQ(0, SendWr(IBV_WR_SEND, 1).sge(nullptr, 0, 0).sge(a.sge(0, 16)).post(a.qp()));
        EXPECT_EQ(a.wait_wc().status, IBV_WC_SUCCESS);
      },
      [](Channel &ch) { receive_one_message(ch, {}, 16, 5); });
}

TEST(RcSend, FourMebibyteSendArrivesIntact) {
  RcOptions options;
  options.buffer_size = k4MiB;
  two_process(
      [&](Channel &ch) {
        RcEnd a(options);
        a.connect(ch);
        fill_pattern(a.buf.span(0, k4MiB), 7);
        ASSERT_EQ(0, a.post_send(1, 0, k4MiB));
        EXPECT_EQ(a.wait_wc().status, IBV_WC_SUCCESS);
      },
      [&](Channel &ch) {
        RcEnd b(options);
        ASSERT_EQ(0, b.post_recv(1, 0, k4MiB));
        b.connect(ch);
        ibv_wc wc = b.wait_wc();
        EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
        EXPECT_EQ(wc.byte_len, k4MiB);
        EXPECT_TRUE(has_pattern(b.buf.span(0, k4MiB), 7));
      });
}

// 2000 SENDs through a 64-entry receive queue that the receiver keeps
// refilling (the sender retries RNR forever): every message arrives, in order.
TEST(RcSend, ManySendsArriveInOrder) {
  constexpr uint32_t kMessages = 2000, kSlots = 64, kSize = 64, kWindow = 32;
  two_process(
      [&](Channel &ch) {
        RcEnd a;
        a.connect(ch);
        uint32_t completed = 0;
        for (uint32_t seq = 0; seq < kMessages; ++seq) {
          while (seq - completed >= kWindow) {
            ibv_wc wc = a.wait_wc();
            ASSERT_EQ(wc.status, IBV_WC_SUCCESS);
            ASSERT_EQ(wc.wr_id, completed) << "send completions out of order";
            ++completed;
          }
          size_t slot = (seq % kSlots) * kSize;
          std::memcpy(a.buf.at(slot), &seq, sizeof seq);
          fill_pattern(a.buf.span(slot + 4, kSize - 4), seq);
          ASSERT_EQ(0, a.post_send(seq, slot, kSize));
        }
        for (; completed < kMessages; ++completed) {
          ibv_wc wc = a.wait_wc();
          ASSERT_EQ(wc.status, IBV_WC_SUCCESS);
          ASSERT_EQ(wc.wr_id, completed);
        }
      },
      [&](Channel &ch) {
        RcEnd b;
        for (uint32_t s = 0; s < kSlots; ++s) ASSERT_EQ(0, b.post_recv(s, s * kSize, kSize));
        b.connect(ch);
        for (uint32_t expected = 0; expected < kMessages; ++expected) {
          ibv_wc wc = b.wait_wc();
          ASSERT_EQ(wc.status, IBV_WC_SUCCESS);
          ASSERT_EQ(wc.wr_id, expected % kSlots) << "receives consumed out of order";
          ASSERT_EQ(wc.byte_len, kSize);
          size_t slot = wc.wr_id * kSize;
          uint32_t seq;
          std::memcpy(&seq, b.buf.at(slot), sizeof seq);
          ASSERT_EQ(seq, expected) << "messages out of order";
          ASSERT_TRUE(has_pattern(b.buf.span(slot + 4, kSize - 4), seq));
          ASSERT_EQ(0, b.post_recv(wc.wr_id, slot, kSize));
        }
      });
}

// SENDs up to about 1 KiB travel inline in their record, larger ones are
// pulled by the target, and a WRITE with immediate takes a receive too:
// mixed on one QP, they consume the receives in order and each lands whole.
TEST(RcSend, SmallLargeAndWriteWithImmInterleavedArriveInOrder) {
  constexpr uint32_t kMessages = 700, kSlots = 32, kSlotSize = 4096;
  constexpr uint32_t kSizes[] = {0, 1, 8, 23, 24, 25, 64, 4096};
  auto size_of = [&](uint32_t seq) { return kSizes[seq % std::size(kSizes)]; };
  auto imm_of = [](uint32_t seq) { return seq % 3 == 1; };
  auto write_of = [](uint32_t seq) { return seq % 5 == 4; };  // WRITE with immediate
  two_process(
      [&](Channel &ch) {
        RcEnd a(RcOptions{.buffer_size = 2 * kSlots * kSlotSize});
        a.connect(ch);
        uint32_t completed = 0;
        for (uint32_t seq = 0; seq < kMessages; ++seq) {
          while (seq - completed >= kSlots / 2) {
            ibv_wc wc = a.wait_wc();
            ASSERT_EQ(wc.status, IBV_WC_SUCCESS) << "wr_id " << wc.wr_id;
            ASSERT_EQ(wc.wr_id, completed++);
          }
          size_t slot = (seq % kSlots) * kSlotSize;
          fill_pattern(a.buf.span(slot, size_of(seq)), seq);
          SendWr wr(write_of(seq) ? IBV_WR_RDMA_WRITE_WITH_IMM
                    : imm_of(seq) ? IBV_WR_SEND_WITH_IMM
                                  : IBV_WR_SEND,
                    seq);
          if (size_of(seq)) wr.sge(a.sge(slot, size_of(seq)));
          if (write_of(seq)) wr.remote(a.raddr(kSlots * kSlotSize + slot), a.rkey());
          if (write_of(seq) || imm_of(seq)) wr.imm(0x1000 + seq);
          ASSERT_EQ(0, wr.post(a.qp()));
        }
        for (; completed < kMessages; ++completed) {
          ibv_wc wc = a.wait_wc();
          ASSERT_EQ(wc.status, IBV_WC_SUCCESS);
          ASSERT_EQ(wc.wr_id, completed);
        }
      },
      [&](Channel &ch) {
        RcEnd b(RcOptions{.buffer_size = 2 * kSlots * kSlotSize});
        uint64_t next_wr = 0;
        auto post = [&] {
          size_t slot = (next_wr % kSlots) * kSlotSize;
          return b.post_recv(next_wr++, slot, kSlotSize);
        };
        for (uint32_t s = 0; s < kSlots; ++s) ASSERT_EQ(0, post());
        b.connect(ch);
        for (uint32_t seq = 0; seq < kMessages; ++seq) {
          ibv_wc wc = b.wait_wc();
          ASSERT_EQ(wc.status, IBV_WC_SUCCESS) << "message " << seq;
          ASSERT_EQ(wc.wr_id, seq) << "receives consumed out of order";
          ASSERT_EQ(wc.opcode, write_of(seq) ? IBV_WC_RECV_RDMA_WITH_IMM : IBV_WC_RECV);
          ASSERT_EQ(wc.byte_len, size_of(seq));
          ASSERT_EQ(wc.qp_num, b.qp()->qp_num);
          ASSERT_EQ(wc.src_qp, b.remote().qpn);
          bool imm = write_of(seq) || imm_of(seq);
          ASSERT_EQ((wc.wc_flags & IBV_WC_WITH_IMM) != 0, imm);
          if (imm) {
            ASSERT_EQ(ntohl(wc.imm_data), 0x1000 + seq);
          }
          size_t slot = (seq % kSlots) * kSlotSize;
          size_t at = write_of(seq) ? kSlots * kSlotSize + slot : slot;
          ASSERT_TRUE(has_pattern(b.buf.span(at, size_of(seq)), seq)) << "message " << seq;
          ASSERT_EQ(0, post());
        }
      });
}

// ---- RDMA WRITE -----------------------------------------------------------------

TEST(RcWrite, LandsInRemoteMemoryWithoutConsumingAReceive) {
  two_process(
      [](Channel &ch) {
        RcEnd a;
        a.connect(ch);
        fill_pattern(a.buf.span(0, 3000), 8);
        ASSERT_EQ(0, a.post_write(5, 0, 3000, 777));
        ibv_wc wc = a.wait_wc();
        EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
        EXPECT_EQ(wc.wr_id, 5u);
        EXPECT_EQ(wc.opcode, IBV_WC_RDMA_WRITE);
        ch.signal();
      },
      [](Channel &ch) {
        RcEnd b;
        ASSERT_EQ(0, b.post_recv(1, 32768, 64));
        b.connect(ch);
        ch.wait();
        EXPECT_TRUE(has_pattern(b.buf.span(777, 3000), 8));
        EXPECT_TRUE(all_bytes_are(b.buf.span(0, 777), 0));
        EXPECT_TRUE(all_bytes_are(b.buf.span(3777, 1000), 0));
        EXPECT_TRUE(stays_empty(b.cq(), 50ms)) << "an RDMA WRITE consumed a receive";
      });
}

TEST(RcWrite, WriteWithImmConsumesAReceiveAndDeliversTheImmediate) {
  two_process(
      [](Channel &ch) {
        RcEnd a;
        a.connect(ch);
        fill_pattern(a.buf.span(0, 1000), 9);
        ASSERT_EQ(0, SendWr(IBV_WR_RDMA_WRITE_WITH_IMM, 1)
                         .sge(a.sge(0, 1000))
                         .remote(a.raddr(0), a.rkey())
                         .imm(77)
                         .post(a.qp()));
        ibv_wc wc = a.wait_wc();
        EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
        EXPECT_EQ(wc.opcode, IBV_WC_RDMA_WRITE);
      },
      [](Channel &ch) {
        RcEnd b;
        ASSERT_EQ(0, b.post_recv(3, 8192, 64));
        b.connect(ch);
        ibv_wc wc = b.wait_wc();
        EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
        EXPECT_EQ(wc.wr_id, 3u);
        EXPECT_EQ(wc.opcode, IBV_WC_RECV_RDMA_WITH_IMM);
        EXPECT_EQ(wc.byte_len, 1000u);
        EXPECT_TRUE(wc.wc_flags & IBV_WC_WITH_IMM);
        EXPECT_EQ(ntohl(wc.imm_data), 77u);
        EXPECT_TRUE(has_pattern(b.buf.span(0, 1000), 9));
        EXPECT_TRUE(all_bytes_are(b.buf.span(8192, 64), 0))
            << "the data went into the receive buffer";
      });
}

TEST(RcWrite, GathersFromSeveralSges) {
  two_process(
      [](Channel &ch) {
        RcEnd a;
        a.connect(ch);
        fill_pattern(a.buf.span(0, 8192), 10);
        ASSERT_EQ(0, SendWr(IBV_WR_RDMA_WRITE, 1)
                         .sge(a.sge(0, 10))
                         .sge(a.sge(4000, 1))
                         .sge(a.sge(6000, 2000))
                         .remote(a.raddr(100), a.rkey())
                         .post(a.qp()));
        EXPECT_EQ(a.wait_wc().status, IBV_WC_SUCCESS);
        ch.signal();
      },
      [](Channel &ch) {
        RcEnd b;
        b.connect(ch);
        ch.wait();
        EXPECT_TRUE(has_pattern(b.buf.span(100, 10), 10, 0));
        EXPECT_TRUE(has_pattern(b.buf.span(110, 1), 10, 4000));
        EXPECT_TRUE(has_pattern(b.buf.span(111, 2000), 10, 6000));
        EXPECT_TRUE(all_bytes_are(b.buf.span(2111, 100), 0));
      });
}

TEST(RcWrite, ZeroLengthWriteWithoutSgesCompletes) {
  // As UCX flushes: no SGE and rkey 0.
  two_process(
      [](Channel &ch) {
        RcEnd a;
        a.connect(ch);
        ASSERT_EQ(0, SendWr(IBV_WR_RDMA_WRITE, 1).remote(0, 0).post(a.qp()));
        EXPECT_EQ(a.wait_wc().status, IBV_WC_SUCCESS);
        ASSERT_EQ(0, SendWr(IBV_WR_RDMA_WRITE, 2, IBV_SEND_SIGNALED | IBV_SEND_INLINE)
                         .remote(0, 0)
                         .post(a.qp()));
        EXPECT_EQ(a.wait_wc().status, IBV_WC_SUCCESS);
        ch.signal();
      },
      [](Channel &ch) {
        RcEnd b;
        b.connect(ch);
        ch.wait();
      });
}

TEST(RcWrite, ZeroLengthWriteWithImmDeliversTheImmediate) {
  two_process(
      [](Channel &ch) {
        RcEnd a;
        a.connect(ch);
        ASSERT_EQ(
            0,
            SendWr(IBV_WR_RDMA_WRITE_WITH_IMM, 1).remote(a.raddr(0), a.rkey()).imm(5).post(a.qp()));
        EXPECT_EQ(a.wait_wc().status, IBV_WC_SUCCESS);
      },
      [](Channel &ch) {
        RcEnd b;
        ASSERT_EQ(0, b.post_recv(1, 0, 64));
        b.connect(ch);
        ibv_wc wc = b.wait_wc();
        EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
        EXPECT_EQ(wc.opcode, IBV_WC_RECV_RDMA_WITH_IMM);
        EXPECT_EQ(wc.byte_len, 0u);
        EXPECT_EQ(ntohl(wc.imm_data), 5u);
      });
}

TEST(RcWrite, FourMebibyteWriteArrivesIntact) {
  RcOptions options;
  options.buffer_size = k4MiB + 4096;
  two_process(
      [&](Channel &ch) {
        RcEnd a(options);
        a.connect(ch);
        fill_pattern(a.buf.span(0, k4MiB), 11);
        ASSERT_EQ(0, a.post_write(1, 0, k4MiB, 4096));
        EXPECT_EQ(a.wait_wc().status, IBV_WC_SUCCESS);
        ch.signal();
      },
      [&](Channel &ch) {
        RcEnd b(options);
        b.connect(ch);
        ch.wait();
        EXPECT_TRUE(has_pattern(b.buf.span(4096, k4MiB), 11));
        EXPECT_TRUE(all_bytes_are(b.buf.span(0, 4096), 0));
      });
}

// ---- RDMA READ -------------------------------------------------------------------

TEST(RcRead, FetchesRemoteMemory) {
  two_process(
      [](Channel &ch) {
        RcEnd a;
        a.connect(ch);
        ch.wait();  // the peer filled its buffer
        ASSERT_EQ(0, a.post_read(4, 100, 5000, 300));
        ibv_wc wc = a.wait_wc();
        EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
        EXPECT_EQ(wc.wr_id, 4u);
        EXPECT_EQ(wc.opcode, IBV_WC_RDMA_READ);
        EXPECT_TRUE(has_pattern(a.buf.span(100, 5000), 12, 300));
        EXPECT_TRUE(all_bytes_are(a.buf.span(0, 100), 0));
        EXPECT_TRUE(all_bytes_are(a.buf.span(5100, 100), 0));
        ch.signal();
      },
      [](Channel &ch) {
        RcEnd b;
        b.connect(ch);
        fill_pattern(b.buf.span(0, 8192), 12);
        ch.signal();
        ch.wait();
      });
}

TEST(RcRead, ScattersIntoSeveralSges) {
  two_process(
      [](Channel &ch) {
        RcEnd a;
        a.connect(ch);
        ch.wait();
        ASSERT_EQ(0, SendWr(IBV_WR_RDMA_READ, 1)
                         .sge(a.sge(0, 7))
                         .sge(a.sge(1000, 993))
                         .sge(a.sge(9000, 1000))
                         .remote(a.raddr(0), a.rkey())
                         .post(a.qp()));
        EXPECT_EQ(a.wait_wc().status, IBV_WC_SUCCESS);
        EXPECT_TRUE(has_pattern(a.buf.span(0, 7), 13, 0));
        EXPECT_TRUE(has_pattern(a.buf.span(1000, 993), 13, 7));
        EXPECT_TRUE(has_pattern(a.buf.span(9000, 1000), 13, 1000));
        ch.signal();
      },
      [](Channel &ch) {
        RcEnd b;
        b.connect(ch);
        fill_pattern(b.buf.span(0, 2000), 13);
        ch.signal();
        ch.wait();
      });
}

TEST(RcRead, FourMebibyteReadArrivesIntact) {
  RcOptions options;
  options.buffer_size = k4MiB;
  two_process(
      [&](Channel &ch) {
        RcEnd a(options);
        a.connect(ch);
        ch.wait();
        ASSERT_EQ(0, a.post_read(1, 0, k4MiB, 0));
        EXPECT_EQ(a.wait_wc().status, IBV_WC_SUCCESS);
        EXPECT_TRUE(has_pattern(a.buf.span(0, k4MiB), 14));
        ch.signal();
      },
      [&](Channel &ch) {
        RcEnd b(options);
        b.connect(ch);
        fill_pattern(b.buf.span(0, k4MiB), 14);
        ch.signal();
        ch.wait();
      });
}

// The fabric copies payloads with its own loop where glibc's memcpy is slow (destination 1..63
// bytes past the source's position in a page): every byte lands, and nothing around it.
TEST(RcWriteRead, LandIntactAtEveryDistanceAroundASourcePage) {
  constexpr uint32_t kLen = 9000;
  constexpr size_t kDistances[] = {0, 1, 15, 16, 17, 31, 32, 48, 63, 64, 4080, 4095};
  // The WRITE of distance number i lands at write_at(i, d) of the peer's buffer.
  auto write_at = [](size_t i, size_t d) { return 65536 + i * 20480 + 2 * d; };
  RcOptions options;
  options.buffer_size = 512 * 1024;
  two_process(
      [&](Channel &ch) {
        RcEnd a(options);
        a.connect(ch);
        ch.wait();  // the peer filled 0..kLen
        uint64_t id = 0;
        for (size_t i = 0; i < std::size(kDistances); ++i) {
          const size_t d = kDistances[i];
          // READ: the peer's page-aligned bytes into ours at distance d.
          memset(a.buf.span(0, 16384).data(), 0, 16384);
          ASSERT_EQ(0, a.post_read(++id, d, kLen, 0));
          EXPECT_EQ(a.wait_wc().status, IBV_WC_SUCCESS);
          EXPECT_TRUE(has_pattern(a.buf.span(d, kLen), 21)) << "READ at distance " << d;
          EXPECT_TRUE(all_bytes_are(a.buf.span(0, d), 0)) << "before, distance " << d;
          EXPECT_TRUE(all_bytes_are(a.buf.span(d + kLen, 64), 0)) << "after, distance " << d;
          // WRITE: those bytes from ours at d into the peer's at 2 d: distance d again.
          ASSERT_EQ(0, a.post_write(++id, d, kLen, write_at(i, d)));
          EXPECT_EQ(a.wait_wc().status, IBV_WC_SUCCESS);
        }
        ch.signal();
        ch.wait();  // the peer checked what was written
      },
      [&](Channel &ch) {
        RcEnd b(options);
        b.connect(ch);
        fill_pattern(b.buf.span(0, kLen), 21);
        ch.signal();
        ch.wait();
        for (size_t i = 0; i < std::size(kDistances); ++i) {
          const size_t at = write_at(i, kDistances[i]);
          EXPECT_TRUE(has_pattern(b.buf.span(at, kLen), 21)) << "WRITE at " << kDistances[i];
          EXPECT_TRUE(all_bytes_are(b.buf.span(at - 16, 16), 0)) << "before " << kDistances[i];
          EXPECT_TRUE(all_bytes_are(b.buf.span(at + kLen, 16), 0)) << "after " << kDistances[i];
        }
        ch.signal();
      });
}

TEST(RcRead, SixteenReadsInFlightAllComplete) {
  two_process(
      [](Channel &ch) {
        RcEnd a;
        a.connect(ch);
        ch.wait();
        for (uint64_t i = 0; i < 16; ++i)
          ASSERT_EQ(0, a.post_read(i, 1024 * i, 1024, 1024 * (15 - i)));
        auto wcs = wait_wcs(a.cq(), 16);
        for (uint64_t i = 0; i < 16; ++i) {
          EXPECT_EQ(wcs[i].status, IBV_WC_SUCCESS);
          EXPECT_EQ(wcs[i].wr_id, i);
          EXPECT_TRUE(has_pattern(a.buf.span(1024 * i, 1024), 15, 1024 * (15 - i)));
        }
        ch.signal();
      },
      [](Channel &ch) {
        RcEnd b;
        b.connect(ch);
        fill_pattern(b.buf.span(0, 16384), 15);
        ch.signal();
        ch.wait();
      });
}

// ---- atomics ---------------------------------------------------------------------

// The 64-bit target value is read and written in host byte order.
TEST(RcAtomic, FetchAndAddReturnsTheOldValueAndAdds) {
  two_process(
      [](Channel &ch) {
        RcEnd a;
        a.connect(ch);
        ch.wait();  // target holds 100 at offset 64
        ASSERT_EQ(0, SendWr(IBV_WR_ATOMIC_FETCH_AND_ADD, 1)
                         .sge(a.sge(0, 8))
                         .remote(a.raddr(64), a.rkey())
                         .compare_add(23)
                         .post(a.qp()));
        ibv_wc wc = a.wait_wc();
        EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
        EXPECT_EQ(wc.opcode, IBV_WC_FETCH_ADD);
        uint64_t old;
        std::memcpy(&old, a.buf.at(0), 8);
        EXPECT_EQ(old, 100u);
        ASSERT_EQ(0, SendWr(IBV_WR_ATOMIC_FETCH_AND_ADD, 2)
                         .sge(a.sge(8, 8))
                         .remote(a.raddr(64), a.rkey())
                         .compare_add(~uint64_t{0})  // adds -1, wrapping
                         .post(a.qp()));
        EXPECT_EQ(a.wait_wc().status, IBV_WC_SUCCESS);
        std::memcpy(&old, a.buf.at(8), 8);
        EXPECT_EQ(old, 123u);
        ch.signal();
      },
      [](Channel &ch) {
        RcEnd b;
        b.connect(ch);
        uint64_t v = 100;
        std::memcpy(b.buf.at(64), &v, 8);
        ch.signal();
        ch.wait();
        std::memcpy(&v, b.buf.at(64), 8);
        EXPECT_EQ(v, 122u);
        EXPECT_TRUE(all_bytes_are(b.buf.span(56, 8), 0));
        EXPECT_TRUE(all_bytes_are(b.buf.span(72, 8), 0));
      });
}

TEST(RcAtomic, CompareAndSwapSwapsOnlyOnAMatchAndReturnsTheOldValue) {
  two_process(
      [](Channel &ch) {
        RcEnd a;
        a.connect(ch);
        ch.wait();  // target holds 5 at offset 128
        ASSERT_EQ(0, SendWr(IBV_WR_ATOMIC_CMP_AND_SWP, 1)
                         .sge(a.sge(0, 8))
                         .remote(a.raddr(128), a.rkey())
                         .compare_add(5)
                         .swap(9)
                         .post(a.qp()));
        ibv_wc wc = a.wait_wc();
        EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
        EXPECT_EQ(wc.opcode, IBV_WC_COMP_SWAP);
        uint64_t old;
        std::memcpy(&old, a.buf.at(0), 8);
        EXPECT_EQ(old, 5u) << "matching compare";
        ASSERT_EQ(0, SendWr(IBV_WR_ATOMIC_CMP_AND_SWP, 2)
                         .sge(a.sge(8, 8))
                         .remote(a.raddr(128), a.rkey())
                         .compare_add(5)  // no longer matches: it is 9
                         .swap(11)
                         .post(a.qp()));
        EXPECT_EQ(a.wait_wc().status, IBV_WC_SUCCESS);
        std::memcpy(&old, a.buf.at(8), 8);
        EXPECT_EQ(old, 9u) << "non-matching compare";
        ch.signal();
      },
      [](Channel &ch) {
        RcEnd b;
        b.connect(ch);
        uint64_t v = 5;
        std::memcpy(b.buf.at(128), &v, 8);
        ch.signal();
        ch.wait();
        std::memcpy(&v, b.buf.at(128), 8);
        EXPECT_EQ(v, 9u) << "the non-matching swap changed memory";
      });
}

// ---- signalling, fence, ordering ------------------------------------------------

TEST(RcSignal, UnsignaledWorkRequestsMakeNoCompletion) {
  two_process(
      [](Channel &ch) {
        RcEnd a;  // sq_sig_all = 0
        a.connect(ch);
        fill_pattern(a.buf.span(0, 300), 16);
        ASSERT_EQ(0, a.post_write(1, 0, 100, 0, 0));
        ASSERT_EQ(0, a.post_write(2, 100, 100, 100, 0));
        ASSERT_EQ(0, a.post_write(3, 200, 100, 200, IBV_SEND_SIGNALED));
        ibv_wc wc = a.wait_wc();
        EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
        EXPECT_EQ(wc.wr_id, 3u);
        EXPECT_TRUE(stays_empty(a.cq(), 100ms)) << "an unsignaled WR made a completion";
        ch.signal();
      },
      [](Channel &ch) {
        RcEnd b;
        b.connect(ch);
        ch.wait();
        EXPECT_TRUE(has_pattern(b.buf.span(0, 300), 16));
      });
}

TEST(RcSignal, SqSigAllSignalsEveryWorkRequest) {
  RcOptions options;
  options.sq_sig_all = true;
  two_process(
      [&](Channel &ch) {
        RcEnd a(options);
        a.connect(ch);
        for (uint64_t i = 1; i <= 3; ++i) ASSERT_EQ(0, a.post_write(i, 0, 64, 0, 0));
        auto wcs = wait_wcs(a.cq(), 3);
        for (uint64_t i = 0; i < 3; ++i) {
          EXPECT_EQ(wcs[i].status, IBV_WC_SUCCESS);
          EXPECT_EQ(wcs[i].wr_id, i + 1);
        }
        ch.signal();
      },
      [&](Channel &ch) {
        RcEnd b;
        b.connect(ch);
        ch.wait();
      });
}

// A fenced WR starts only after the preceding RDMA READs completed: a SEND
// of the buffer a READ just filled carries the data read.
TEST(RcFence, FencedSendCarriesTheDataOfThePrecedingRead) {
  RcOptions options;
  options.buffer_size = 1 << 20;
  two_process(
      [&](Channel &ch) {
        RcEnd a(options);
        a.connect(ch);
        ch.wait();
        ASSERT_EQ(0, a.post_read(1, 0, 256 * 1024, 0, 0));
        ASSERT_EQ(0, a.post_send(2, 0, 256 * 1024, IBV_SEND_SIGNALED | IBV_SEND_FENCE));
        ibv_wc wc = a.wait_wc();
        EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
        EXPECT_EQ(wc.wr_id, 2u);
      },
      [&](Channel &ch) {
        RcEnd b(options);
        ASSERT_EQ(0, b.post_recv(1, 512 * 1024, 256 * 1024));
        b.connect(ch);
        fill_pattern(b.buf.span(0, 256 * 1024), 17);
        ch.signal();
        ibv_wc wc = b.wait_wc();
        EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
        EXPECT_TRUE(has_pattern(b.buf.span(512 * 1024, 256 * 1024), 17));
      });
}

// The guarantee every RDMA protocol relies on: when the SEND that follows an
// RDMA WRITE on the same QP arrives, the written data is visible.
TEST(RcOrder, WrittenDataIsVisibleWhenTheFollowingSendArrives) {
  constexpr uint32_t kRounds = 50, kSize = 32 * 1024;
  RcOptions options;
  options.buffer_size = 128 * 1024;
  two_process(
      [&](Channel &ch) {
        RcEnd a(options);
        a.connect(ch);
        for (uint32_t round = 0; round < kRounds; ++round) {
          fill_pattern(a.buf.span(0, kSize), round);
          std::memcpy(a.buf.at(kSize), &round, 4);
          ASSERT_EQ(0, a.post_write(1, 0, kSize, 0, 0));
          ASSERT_EQ(0, a.post_send(2, kSize, 4));
          ASSERT_EQ(a.wait_wc().status, IBV_WC_SUCCESS);
          ch.wait();  // the peer checked this round
        }
      },
      [&](Channel &ch) {
        RcEnd b(options);
        for (uint32_t round = 0; round < kRounds; ++round)
          ASSERT_EQ(0, b.post_recv(round, 64 * 1024, 4));
        b.connect(ch);
        for (uint32_t round = 0; round < kRounds; ++round) {
          ibv_wc wc = b.wait_wc();
          ASSERT_EQ(wc.status, IBV_WC_SUCCESS);
          ASSERT_TRUE(has_pattern(b.buf.span(0, kSize), round)) << "round " << round;
          ch.signal();
        }
      });
}

TEST(RcOrder, ReadAfterWriteOnTheSameQpSeesTheWrite) {
  two_process(
      [](Channel &ch) {
        RcEnd a;
        a.connect(ch);
        fill_pattern(a.buf.span(0, 4096), 18);
        ASSERT_EQ(0, a.post_write(1, 0, 4096, 8192, 0));
        ASSERT_EQ(0, a.post_read(2, 16384, 4096, 8192));
        ibv_wc wc = a.wait_wc();
        EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
        EXPECT_EQ(wc.wr_id, 2u);
        EXPECT_TRUE(has_pattern(a.buf.span(16384, 4096), 18));
        ch.signal();
      },
      [](Channel &ch) {
        RcEnd b;
        b.connect(ch);
        ch.wait();
      });
}

// A WRITE with immediate too long for a request record is placed by the requester (as a
// WRITE is), yet never before an atomic posted ahead of it on the same bytes. The target
// waits off the CQ meanwhile, so that its progress thread, not a poll, serves the atomic.
TEST(RcOrder, ALargeWriteWithImmAfterAnAtomicLandsAfterIt) {
  constexpr uint32_t kRounds = 20;
  two_process(
      [&](Channel &ch) {
        RcEnd a;
        a.connect(ch);
        for (uint64_t round = 0; round < kRounds; ++round) {
          ch.wait();  // the target holds 100 at offset 64
          const uint64_t written = 7000 + round;
          std::memcpy(a.buf.at(4096 + 64), &written, 8);
          ASSERT_EQ(0, SendWr(IBV_WR_ATOMIC_FETCH_AND_ADD, 1)
                           .sge(a.sge(0, 8))
                           .remote(a.raddr(64), a.rkey())
                           .compare_add(23)
                           .post(a.qp()));
          ASSERT_EQ(0, SendWr(IBV_WR_RDMA_WRITE_WITH_IMM, 2)
                           .sge(a.sge(4096, 4096))
                           .remote(a.raddr(0), a.rkey())
                           .imm(uint32_t(round))
                           .post(a.qp()));
          auto wcs = wait_wcs(a.cq(), 2);
          EXPECT_EQ(wcs[0].status, IBV_WC_SUCCESS);
          EXPECT_EQ(wcs[1].status, IBV_WC_SUCCESS);
          uint64_t old;
          std::memcpy(&old, a.buf.at(0), 8);
          EXPECT_EQ(old, 100u) << "round " << round << ": the WRITE landed before the atomic";
          ch.signal();
        }
      },
      [&](Channel &ch) {
        RcEnd b;
        for (uint32_t round = 0; round < kRounds; ++round)
          ASSERT_EQ(0, b.post_recv(round, 32768, 16));
        b.connect(ch);
        for (uint32_t round = 0; round < kRounds; ++round) {
          uint64_t v = 100;
          std::memcpy(b.buf.at(64), &v, 8);
          ch.signal();
          ch.wait();  // the requester saw both complete
          ibv_wc wc = b.wait_wc();
          EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
          EXPECT_EQ(ntohl(wc.imm_data), round);
          std::memcpy(&v, b.buf.at(64), 8);
          EXPECT_EQ(v, 7000u + round)
              << "round " << round << ": the WRITE landed before the atomic";
        }
      });
}

// A short WRITE with immediate (executed by the target, from its record) or a SEND into the
// same bytes, posted before a long WRITE with immediate (placed by the requester): the long
// one's bytes are what stays. Rounds alternate the two; the target waits off the CQ.
TEST(RcOrder, ALargeWriteWithImmLandsAfterTheShortWritesAndSendsBeforeIt) {
  constexpr uint32_t kRounds = 20;
  two_process(
      [&](Channel &ch) {
        RcEnd a;
        a.connect(ch);
        for (uint32_t round = 0; round < kRounds; ++round) {
          ch.wait();  // the target posted this round's receives
          fill_pattern(a.buf.span(0, 512), 1000 + round);
          fill_pattern(a.buf.span(4096, 4096), 2000 + round);
          SendWr first =
              round % 2
                  ? SendWr(IBV_WR_SEND, 1)
                  : std::move(
                        SendWr(IBV_WR_RDMA_WRITE_WITH_IMM, 1).remote(a.raddr(0), a.rkey()).imm(1));
          ASSERT_EQ(0, first.sge(a.sge(0, 512)).post(a.qp()));
          ASSERT_EQ(0, SendWr(IBV_WR_RDMA_WRITE_WITH_IMM, 2)
                           .sge(a.sge(4096, 4096))
                           .remote(a.raddr(0), a.rkey())
                           .imm(2)
                           .post(a.qp()));
          auto wcs = wait_wcs(a.cq(), 2);
          EXPECT_EQ(wcs[0].status, IBV_WC_SUCCESS);
          EXPECT_EQ(wcs[1].status, IBV_WC_SUCCESS);
          ch.signal();
        }
      },
      [&](Channel &ch) {
        RcEnd b;
        b.connect(ch);
        for (uint32_t round = 0; round < kRounds; ++round) {
          // The SEND's receive is the start of the bytes the long WRITE then covers.
          ASSERT_EQ(0, b.post_recv(2 * round, 0, 512));
          ASSERT_EQ(0, b.post_recv(2 * round + 1, 0, 512));
          ch.signal();
          ch.wait();  // the requester saw both complete
          auto wcs = wait_wcs(b.cq(), 2);
          EXPECT_EQ(wcs[0].status, IBV_WC_SUCCESS);
          EXPECT_EQ(wcs[1].status, IBV_WC_SUCCESS);
          EXPECT_TRUE(has_pattern(b.buf.span(0, 4096), 2000 + round))
              << "round " << round << ": the long WRITE landed before the "
              << (round % 2 ? "SEND" : "short WRITE") << " posted ahead of it";
        }
      });
}

}  // namespace
}  // namespace pcientb::test
