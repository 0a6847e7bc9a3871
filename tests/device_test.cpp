// The device and its port, as ibv_devinfo and every consumer sees them.
#include "verbs_helpers.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>

namespace pcientb::test {
namespace {

bool gid_is_zero(const ibv_gid &gid) {
  static const ibv_gid zero{};
  return std::memcmp(&gid, &zero, sizeof gid) == 0;
}

TEST(Device, ListContainsPcientb0) {
  use_private_fabric();
  int num = 0;
  ibv_device **list = ibv_get_device_list(&num);
  ASSERT_NE(list, nullptr) << std::strerror(errno);
  bool found = false;
  for (int i = 0; i < num; ++i) {
    if (std::strcmp(ibv_get_device_name(list[i]), kDeviceName) == 0) {
      found = true;
      EXPECT_EQ(list[i]->node_type, IBV_NODE_CA);
      EXPECT_EQ(list[i]->transport_type, IBV_TRANSPORT_IB);
    }
  }
  EXPECT_EQ(list[num], nullptr) << "the list is NULL-terminated";
  ibv_free_device_list(list);
  EXPECT_TRUE(found);
}

TEST(Device, QueryReportsPlxIdsAndCapabilities) {
  Node node;
  ibv_device_attr attr{};
  ASSERT_EQ(0, ibv_query_device(node.ctx.get(), &attr));
  EXPECT_EQ(attr.vendor_id, 0x10B5u);
  EXPECT_EQ(attr.vendor_part_id, 0x8749u);
  EXPECT_GE(attr.phys_port_cnt, 1);
  EXPECT_GE(attr.max_qp_rd_atom, 16);
  EXPECT_GE(attr.max_qp_init_rd_atom, 16);
  EXPECT_GT(attr.max_qp, 1);
  EXPECT_GT(attr.max_qp_wr, 64);
  EXPECT_GE(attr.max_sge, 4);
  EXPECT_GT(attr.max_cq, 1);
  EXPECT_GT(attr.max_cqe, 256);
  EXPECT_GT(attr.max_mr, 1);
  EXPECT_GE(attr.max_mr_size, 4u << 20);
  EXPECT_GT(attr.max_pd, 1);
  EXPECT_GT(attr.max_srq, 0);
  EXPECT_GT(attr.max_srq_wr, 64);
  EXPECT_NE(attr.node_guid, 0u);
  EXPECT_EQ(node.ctx->device->node_type, IBV_NODE_CA);
}

TEST(Device, QueryDeviceExMatchesQueryDevice) {
  Node node;
  ibv_device_attr attr{};
  ASSERT_EQ(0, ibv_query_device(node.ctx.get(), &attr));
  ibv_device_attr_ex ex{};
  ASSERT_EQ(0, ibv_query_device_ex(node.ctx.get(), nullptr, &ex));
  EXPECT_EQ(ex.orig_attr.vendor_id, attr.vendor_id);
  EXPECT_EQ(ex.orig_attr.vendor_part_id, attr.vendor_part_id);
  EXPECT_EQ(ex.orig_attr.max_qp_rd_atom, attr.max_qp_rd_atom);
  EXPECT_EQ(ex.orig_attr.max_qp_wr, attr.max_qp_wr);
  EXPECT_EQ(ex.orig_attr.node_guid, attr.node_guid);
}

TEST(Port, IsActiveInfinibandWith4096Mtu) {
  Node node;
  ibv_port_attr port{};
  ASSERT_EQ(0, ibv_query_port(node.ctx.get(), kPort, &port));
  EXPECT_EQ(port.state, IBV_PORT_ACTIVE);
  EXPECT_EQ(port.link_layer, IBV_LINK_LAYER_INFINIBAND);
  EXPECT_EQ(port.active_mtu, IBV_MTU_4096);
  EXPECT_EQ(port.max_mtu, IBV_MTU_4096);
  EXPECT_NE(port.lid, 0);
  EXPECT_GT(port.gid_tbl_len, 0);
  EXPECT_GT(port.pkey_tbl_len, 0u);
  EXPECT_GE(port.max_msg_sz, 4u << 20);
}

TEST(Port, QueryingAPortThatDoesNotExistFails) {
  Node node;
  ibv_device_attr attr{};
  ASSERT_EQ(0, ibv_query_device(node.ctx.get(), &attr));
  ibv_port_attr port{};
  EXPECT_NE(0, ibv_query_port(node.ctx.get(), static_cast<uint8_t>(attr.phys_port_cnt + 1), &port));
}

TEST(Port, GidIndexZeroIsNonZero) {
  Node node;
  ibv_gid gid{};
  ASSERT_EQ(0, ibv_query_gid(node.ctx.get(), kPort, 0, &gid));
  EXPECT_FALSE(gid_is_zero(gid));
}

TEST(Port, PkeyIndexZeroIsTheDefaultFullMemberPkey) {
  Node node;
  __be16 pkey = 0;
  ASSERT_EQ(0, ibv_query_pkey(node.ctx.get(), kPort, 0, &pkey));
  EXPECT_EQ(ntohs(pkey), 0xffff);
}

TEST(Device, HasAnAsyncEventFd) {
  Node node;
  ASSERT_GE(node.ctx->async_fd, 0);
  EXPECT_NE(fcntl(node.ctx->async_fd, F_GETFL), -1) << std::strerror(errno);
}

TEST(Device, HasAtLeastOneCompletionVector) {
  Node node;
  EXPECT_GE(node.ctx->num_comp_vectors, 1);
}

TEST(Device, OpenTwiceInOneProcessGivesTwoContextsOnTheSamePort) {
  Node first;
  Node second;
  EXPECT_NE(first.ctx.get(), second.ctx.get());
  EXPECT_NE(first.lid(), 0);
  EXPECT_EQ(first.lid(), second.lid()) << "one port, one LID, however many contexts";
}

TEST(Device, TwoProcessesGetDistinctNonZeroLids) {
  two_process(
      [](Channel &ch) {
        Node node;
        auto theirs = ch.exchange(node.lid());
        EXPECT_NE(node.lid(), 0);
        EXPECT_NE(theirs, 0);
        EXPECT_NE(node.lid(), theirs);
      },
      [](Channel &ch) {
        Node node;
        ch.exchange(node.lid());
      });
}

TEST(Device, TwoProcessesGetDistinctGids) {
  two_process(
      [](Channel &ch) {
        Node node;
        auto theirs = ch.exchange(node.gid);
        EXPECT_FALSE(gid_is_zero(theirs));
        EXPECT_NE(0, std::memcmp(&theirs, &node.gid, sizeof theirs));
      },
      [](Channel &ch) {
        Node node;
        ch.exchange(node.gid);
      });
}

// A process that used the device forks (an MPI launcher, a test harness): the
// child opens the device anew and is a node of its own.
void send_one_message(bool parent_holds_device) {
  std::optional<Node> held;
  if (parent_holds_device)
    held.emplace();
  else
    Node{};  // opened and closed before the fork
  two_process(
      [](Channel &ch) {
        RcEnd a;
        a.connect(ch);
        EXPECT_NE(a.node.lid(), a.remote().lid);
        fill_pattern(a.buf.span(0, 100), 1);
        ASSERT_EQ(0, a.post_send(1, 0, 100));
        EXPECT_EQ(a.wait_wc().status, IBV_WC_SUCCESS);
      },
      [](Channel &ch) {
        RcEnd b;
        ASSERT_EQ(0, b.post_recv(1, 0, 4096));
        b.connect(ch);
        ibv_wc wc = b.wait_wc();
        EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
        EXPECT_TRUE(has_pattern(b.buf.span(0, 100), 1));
      });
}

TEST(Fork, ChildOfAProcessThatClosedTheDeviceOpensItAnew) {
  send_one_message(false);
}

// A node that loses its place on the fabric (here: the fabric's table is
// removed, so no peer can find it any more) is a device that failed: every
// context open on it gets IBV_EVENT_DEVICE_FATAL.
TEST(DeviceFatal, LosingTheFabricRaisesDeviceFatal) {
  Node node;
  std::string table =
      "/dev/shm/pcientb." + std::to_string(getuid()) + "." + std::getenv("PCIENTB_FABRIC");
  ASSERT_EQ(0, unlink(table.c_str())) << table << ": " << std::strerror(errno);
  auto event = wait_async_event_of(node.ctx.get(), IBV_EVENT_DEVICE_FATAL, 3000ms);
  EXPECT_TRUE(event.has_value()) << "no IBV_EVENT_DEVICE_FATAL within 3 s";
}

TEST(Fork, ChildOfAProcessThatHoldsTheDeviceOpenOpensItAnew) {
#if defined(__SANITIZE_THREAD__)
  // The child starts the device's progress thread; ThreadSanitizer cannot
  // track threads created after a fork of a multi-threaded process.
  GTEST_SKIP() << "ThreadSanitizer does not support threads in a forked child";
#endif
  send_one_message(true);
}

// What a gtest binary run as a whole does: one pair of processes after the
// other, forked from the same parent.
TEST(Fork, OneParentRunsFivePairsOneAfterTheOther) {
  for (int i = 0; i < 5; ++i) {
    SCOPED_TRACE("pair " + std::to_string(i));
    send_one_message(false);
  }
}

}  // namespace
}  // namespace pcientb::test
