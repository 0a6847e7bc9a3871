// UD: address handles, Q_Keys, the 40-byte GRH area, the MTU limit, and what
// the receiver learns about the sender.
#include "verbs_helpers.hpp"

#include <arpa/inet.h>

#include <cstring>

namespace pcientb::test {
namespace {

int ud_send(UdEnd &from, ibv_ah *ah, const Endpoint &to, uint64_t wr_id, size_t offset,
            uint32_t length, uint32_t qkey) {
  return SendWr(IBV_WR_SEND, wr_id)
      .sge(from.buf.sge(offset, length))
      .ud(ah, to.qpn, qkey)
      .post(from.qp.get());
}

TEST(Ud, AddressHandleCreateAndDestroy) {
  Node node;
  Endpoint self;
  self.lid = node.lid();
  self.gid = node.gid;
  ibv_ah_attr attr{};
  attr.dlid = node.lid();
  attr.port_num = kPort;
  ibv_ah *ah = ibv_create_ah(node.pd.get(), &attr);
  ASSERT_NE(ah, nullptr) << std::strerror(errno);
  EXPECT_EQ(ah->pd, node.pd.get());
  EXPECT_EQ(0, ibv_destroy_ah(ah));
  EXPECT_NE(create_ah(node.pd.get(), self, true), nullptr);
}

TEST(Ud, SendDeliversThePayloadAfterThe40ByteGrhArea) {
  two_process(
      [](Channel &ch) {
        UdEnd a;
        auto peer = ch.exchange(a.local());
        auto ah = create_ah(a.node.pd.get(), peer);
        fill_pattern(a.buf.span(0, 1000), 1);
        ASSERT_EQ(0, ud_send(a, ah.get(), peer, 9, 0, 1000, peer.qkey));
        ibv_wc wc = a.wait_wc();
        EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
        EXPECT_EQ(wc.wr_id, 9u);
        EXPECT_EQ(wc.opcode, IBV_WC_SEND);
      },
      [](Channel &ch) {
        UdEnd b;
        ASSERT_EQ(0, RecvWr(4).sge(b.buf.sge(0, kGrhBytes + 4096)).post(b.qp.get()));
        auto sender = ch.exchange(b.local());
        ibv_wc wc = b.wait_wc();
        EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
        EXPECT_EQ(wc.wr_id, 4u);
        EXPECT_EQ(wc.opcode, IBV_WC_RECV);
        EXPECT_EQ(wc.byte_len, kGrhBytes + 1000);
        EXPECT_EQ(wc.src_qp, sender.qpn);
        EXPECT_EQ(wc.slid, sender.lid);
        EXPECT_EQ(wc.qp_num, b.qp->qp_num);
        EXPECT_EQ(wc.wc_flags & IBV_WC_GRH, 0u) << "the sender sent no GRH";
        EXPECT_TRUE(has_pattern(b.buf.span(kGrhBytes, 1000), 1));
        EXPECT_TRUE(all_bytes_are(b.buf.span(kGrhBytes + 1000, 100), 0));
      });
}

TEST(Ud, SendWithImmDeliversTheImmediate) {
  two_process(
      [](Channel &ch) {
        UdEnd a;
        auto peer = ch.exchange(a.local());
        auto ah = create_ah(a.node.pd.get(), peer);
        ASSERT_EQ(0, SendWr(IBV_WR_SEND_WITH_IMM, 1)
                         .sge(a.buf.sge(0, 16))
                         .imm(0xabcdef01)
                         .ud(ah.get(), peer.qpn, peer.qkey)
                         .post(a.qp.get()));
        EXPECT_EQ(a.wait_wc().status, IBV_WC_SUCCESS);
      },
      [](Channel &ch) {
        UdEnd b;
        ASSERT_EQ(0, RecvWr(1).sge(b.buf.sge(0, kGrhBytes + 64)).post(b.qp.get()));
        ch.exchange(b.local());
        ibv_wc wc = b.wait_wc();
        EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
        EXPECT_EQ(wc.byte_len, kGrhBytes + 16);
        EXPECT_TRUE(wc.wc_flags & IBV_WC_WITH_IMM);
        EXPECT_EQ(ntohl(wc.imm_data), 0xabcdef01u);
      });
}

// With a global address the GRH is delivered into the first 40 bytes: an IPv6
// style header whose source GID (bytes 8..23) is the sender's and destination
// GID (bytes 24..39) the receiver's.
TEST(Ud, GlobalAddressDeliversAGrhWithBothGids) {
  two_process(
      [](Channel &ch) {
        UdEnd a;
        auto peer = ch.exchange(a.local());
        auto ah = create_ah(a.node.pd.get(), peer, /*grh=*/true);
        fill_pattern(a.buf.span(0, 100), 2);
        ASSERT_EQ(0, ud_send(a, ah.get(), peer, 1, 0, 100, peer.qkey));
        EXPECT_EQ(a.wait_wc().status, IBV_WC_SUCCESS);
      },
      [](Channel &ch) {
        UdEnd b;
        ASSERT_EQ(0, RecvWr(1).sge(b.buf.sge(0, kGrhBytes + 128)).post(b.qp.get()));
        auto sender = ch.exchange(b.local());
        ibv_wc wc = b.wait_wc();
        EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
        EXPECT_EQ(wc.byte_len, kGrhBytes + 100);
        EXPECT_TRUE(wc.wc_flags & IBV_WC_GRH);
        EXPECT_EQ(0, std::memcmp(b.buf.at(8), &sender.gid, 16)) << "source GID";
        EXPECT_EQ(0, std::memcmp(b.buf.at(24), &b.node.gid, 16)) << "destination GID";
        EXPECT_TRUE(has_pattern(b.buf.span(kGrhBytes, 100), 2));
      });
}

TEST(Ud, WrongQkeyIsSilentlyDropped) {
  two_process(
      [](Channel &ch) {
        UdEnd a;
        auto peer = ch.exchange(a.local());
        auto ah = create_ah(a.node.pd.get(), peer);
        fill_pattern(a.buf.span(0, 64), 3);
        fill_pattern(a.buf.span(64, 64), 4);
        ASSERT_EQ(0, ud_send(a, ah.get(), peer, 1, 0, 64, peer.qkey + 1));
        EXPECT_EQ(a.wait_wc().status, IBV_WC_SUCCESS) << "UD does not tell the sender";
        ch.barrier();  // the receiver saw nothing
        ASSERT_EQ(0, ud_send(a, ah.get(), peer, 2, 64, 64, peer.qkey));
        EXPECT_EQ(a.wait_wc().status, IBV_WC_SUCCESS);
      },
      [](Channel &ch) {
        UdEnd b;
        ASSERT_EQ(0, RecvWr(1).sge(b.buf.sge(0, kGrhBytes + 64)).post(b.qp.get()));
        ch.exchange(b.local());
        ch.wait();
        EXPECT_TRUE(stays_empty(b.cq.get(), 300ms)) << "a message with the wrong Q_Key arrived";
        ch.signal();
        ibv_wc wc = b.wait_wc();
        EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
        EXPECT_EQ(wc.wr_id, 1u) << "the dropped message consumed a receive";
        EXPECT_TRUE(has_pattern(b.buf.span(kGrhBytes, 64), 4));
      });
}

TEST(Ud, MessageOfExactlyTheMtuIsDelivered) {
  two_process(
      [](Channel &ch) {
        UdEnd a;
        auto peer = ch.exchange(a.local());
        auto ah = create_ah(a.node.pd.get(), peer);
        fill_pattern(a.buf.span(0, 4096), 5);
        ASSERT_EQ(0, ud_send(a, ah.get(), peer, 1, 0, 4096, peer.qkey));
        EXPECT_EQ(a.wait_wc().status, IBV_WC_SUCCESS);
      },
      [](Channel &ch) {
        UdEnd b;
        ASSERT_EQ(0, RecvWr(1).sge(b.buf.sge(0, kGrhBytes + 4096)).post(b.qp.get()));
        ch.exchange(b.local());
        ibv_wc wc = b.wait_wc();
        EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
        EXPECT_EQ(wc.byte_len, kGrhBytes + 4096);
        EXPECT_TRUE(has_pattern(b.buf.span(kGrhBytes, 4096), 5));
      });
}

// A UD message is one packet: larger than the MTU (4096) it fails, either at
// post time or with an error completion, and nothing is delivered.
TEST(Ud, MessageLargerThanTheMtuFails) {
  two_process(
      [](Channel &ch) {
        UdEnd a;
        auto peer = ch.exchange(a.local());
        auto ah = create_ah(a.node.pd.get(), peer);
        int rc = ud_send(a, ah.get(), peer, 1, 0, 4097, peer.qkey);
        if (rc == 0) {
          EXPECT_NE(a.wait_wc().status, IBV_WC_SUCCESS);
        }
        ch.signal();
      },
      [](Channel &ch) {
        UdEnd b;
        ASSERT_EQ(0, RecvWr(1).sge(b.buf.sge(0, kGrhBytes + 8192)).post(b.qp.get()));
        ch.exchange(b.local());
        ch.wait();
        EXPECT_TRUE(stays_empty(b.cq.get(), 200ms))
            << "a message larger than the MTU was delivered";
      });
}

TEST(Ud, SendToAQpnThatDoesNotExistIsDropped) {
  two_process(
      [](Channel &ch) {
        UdEnd a;
        auto peer = ch.exchange(a.local());
        auto ah = create_ah(a.node.pd.get(), peer);
        Endpoint nobody = peer;
        nobody.qpn = peer.qpn + 1000;
        ASSERT_EQ(0, ud_send(a, ah.get(), nobody, 1, 0, 64, peer.qkey));
        EXPECT_EQ(a.wait_wc().status, IBV_WC_SUCCESS);
        ch.signal();
      },
      [](Channel &ch) {
        UdEnd b;
        ASSERT_EQ(0, RecvWr(1).sge(b.buf.sge(0, kGrhBytes + 64)).post(b.qp.get()));
        ch.exchange(b.local());
        ch.wait();
        EXPECT_TRUE(stays_empty(b.cq.get(), 200ms));
      });
}

TEST(Ud, TwoSendersAreToldApartBySourceQp) {
  two_process(
      [](Channel &ch) {
        UdEnd a;
        auto second = create_qp(a.node.pd.get(), ud_qp_attr(a.cq.get()));
        ud_to_rts(second.get(), 0x5555);
        auto peer = ch.exchange(a.local());
        ch.send(second->qp_num);
        auto ah = create_ah(a.node.pd.get(), peer);
        fill_pattern(a.buf.span(0, 64), 6);
        ASSERT_EQ(0, ud_send(a, ah.get(), peer, 1, 0, 64, peer.qkey));
        EXPECT_EQ(a.wait_wc().status, IBV_WC_SUCCESS);
        ASSERT_EQ(0, SendWr(IBV_WR_SEND, 2)
                         .sge(a.buf.sge(0, 32))
                         .ud(ah.get(), peer.qpn, peer.qkey)
                         .post(second.get()));
        EXPECT_EQ(a.wait_wc().status, IBV_WC_SUCCESS);
      },
      [](Channel &ch) {
        UdEnd b;
        for (uint64_t i = 0; i < 2; ++i)
          ASSERT_EQ(0, RecvWr(i).sge(b.buf.sge(1024 * i, kGrhBytes + 64)).post(b.qp.get()));
        auto first = ch.exchange(b.local());
        auto second_qpn = ch.recv<uint32_t>();
        auto wcs = wait_wcs(b.cq.get(), 2);
        EXPECT_EQ(wcs[0].src_qp, first.qpn);
        EXPECT_EQ(wcs[0].byte_len, kGrhBytes + 64);
        EXPECT_EQ(wcs[1].src_qp, second_qpn);
        EXPECT_EQ(wcs[1].byte_len, kGrhBytes + 32);
        EXPECT_EQ(wcs[0].slid, first.lid);
        EXPECT_EQ(wcs[1].slid, first.lid);
      });
}

TEST(Ud, ManyMessagesFillTheReceivesInOrder) {
  constexpr uint32_t kMessages = 48;
  two_process(
      [&](Channel &ch) {
        UdEnd a;
        auto peer = ch.exchange(a.local());
        auto ah = create_ah(a.node.pd.get(), peer);
        for (uint32_t i = 0; i < kMessages; ++i) {
          fill_pattern(a.buf.span(256 * i, 200), i);
          ASSERT_EQ(0, ud_send(a, ah.get(), peer, i, 256 * i, 200, peer.qkey));
        }
        auto wcs = wait_wcs(a.cq.get(), kMessages);
        for (uint32_t i = 0; i < kMessages; ++i) EXPECT_EQ(wcs[i].status, IBV_WC_SUCCESS);
      },
      [&](Channel &ch) {
        UdEnd b;
        for (uint32_t i = 0; i < kMessages; ++i)
          ASSERT_EQ(0, RecvWr(i).sge(b.buf.sge(512 * i, kGrhBytes + 256)).post(b.qp.get()));
        ch.exchange(b.local());
        auto wcs = wait_wcs(b.cq.get(), kMessages);
        for (uint32_t i = 0; i < kMessages; ++i) {
          EXPECT_EQ(wcs[i].status, IBV_WC_SUCCESS);
          EXPECT_EQ(wcs[i].wr_id, i);
          EXPECT_TRUE(has_pattern(b.buf.span(512 * i + kGrhBytes, 200), i)) << "message " << i;
        }
      });
}

}  // namespace
}  // namespace pcientb::test
