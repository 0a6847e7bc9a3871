// The device's advertised limits hold in both directions: every object can be
// made up to its limit, one more fails with ENOMEM; and creating and
// destroying objects of every type again and again leaks nothing (no
// descriptor, no mapping, no memory, no area fragmentation).
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "verbs_helpers.hpp"

namespace pcientb::test {
namespace {

struct Limits {
  Node node;
  ibv_device_attr dev{};
  Limits() {
    if (int rc = ibv_query_device(node.ctx.get(), &dev)) throw_errno("ibv_query_device", rc);
  }
};

// Makes objects with make() until it returns nullptr; expects exactly `limit`
// of them (those made already, `have`, included) and ENOMEM for the next.
template <class T>
void expect_limit(const char *what, int limit, int have, const std::function<T *()> &make,
                  const std::function<void(T *)> &destroy) {
  std::vector<T *> made;
  for (int i = have; i < limit + 1; ++i) {
    errno = 0;
    T *p = make();
    if (!p) break;
    made.push_back(p);
  }
  int err = errno;
  EXPECT_EQ(static_cast<int>(made.size()) + have, limit) << what;
  EXPECT_EQ(err, ENOMEM) << what << ": " << std::strerror(err);
  for (auto it = made.rbegin(); it != made.rend(); ++it) destroy(*it);
}

TEST(Limits, EveryObjectUpToItsAdvertisedLimitThenEnomem) {
  Limits l;
  ibv_context *ctx = l.node.ctx.get();
  ibv_pd *pd = l.node.pd.get();
  expect_limit<ibv_pd>(
      "PD", l.dev.max_pd, 1, [&] { return ibv_alloc_pd(ctx); }, ibv_dealloc_pd);
  expect_limit<ibv_cq>(
      "CQ", l.dev.max_cq, 0, [&] { return ibv_create_cq(ctx, 16, nullptr, nullptr, 0); },
      ibv_destroy_cq);
  std::vector<uint8_t> mem(4096);
  expect_limit<ibv_mr>(
      "MR", l.dev.max_mr, 0,
      [&] { return ibv_reg_mr(pd, mem.data(), mem.size(), IBV_ACCESS_LOCAL_WRITE); }, ibv_dereg_mr);
  ibv_ah_attr ah{};
  ah.dlid = l.node.lid();
  ah.port_num = kPort;
  expect_limit<ibv_ah>(
      "AH", l.dev.max_ah, 0, [&] { return ibv_create_ah(pd, &ah); }, ibv_destroy_ah);
  expect_limit<ibv_srq>(
      "SRQ", l.dev.max_srq, 0,
      [&] {
        ibv_srq_init_attr a{};
        a.attr.max_wr = 16;
        a.attr.max_sge = 1;
        return ibv_create_srq(pd, &a);
      },
      ibv_destroy_srq);
  CqPtr cq = create_cq(ctx, 64);
  expect_limit<ibv_qp>(
      "QP", l.dev.max_qp, 0,
      [&] {
        ibv_qp_init_attr a = rc_qp_attr(cq.get(), 16, 1);
        return ibv_create_qp(pd, &a);
      },
      ibv_destroy_qp);
}

void expect_no_growth(const Footprint &before, const char *what) {
  const Footprint after = footprint();
  EXPECT_EQ(after.fds, before.fds) << what << ": descriptors";
  if (kSanitizerOwnsMemory) return;
  EXPECT_EQ(after.maps, before.maps) << what << ": mappings";
  EXPECT_LT(after.rss_kib - before.rss_kib, 8 * 1024) << what << ": resident memory grew (KiB)";
}

constexpr int kCycles = 10000;

// Runs cycle() twice to warm up (lazily opened descriptors, caches), then
// kCycles times, and checks the footprint.
void cycles(const char *what, const std::function<void()> &cycle) {
  cycle();
  cycle();
  const Footprint before = footprint();
  for (int i = 0; i < kCycles; ++i) cycle();
  expect_no_growth(before, what);
}

TEST(Leaks, TenThousandCyclesOfEveryObjectLeaveNothingBehind) {
  cycles("context", [] { Node node; });
  Node node;
  ibv_context *ctx = node.ctx.get();
  ibv_pd *pd = node.pd.get();
  cycles("PD", [&] { alloc_pd(ctx); });
  std::vector<uint8_t> mem(64 * 1024);
  cycles("MR", [&] { reg_mr(pd, mem.data(), mem.size(), kAllAccess); });
  cycles("completion channel", [&] { create_comp_channel(ctx); });
  cycles("CQ", [&] {
    CompChannelPtr ch = create_comp_channel(ctx);
    CqPtr cq = create_cq(ctx, 1 + std::rand() % 5000, ch.get());
  });
  CqPtr cq = create_cq(ctx, 256);
  cycles("QP", [&] { create_qp(pd, rc_qp_attr(cq.get(), 1 + std::rand() % 2000, 4)); });
  cycles("UD QP", [&] { create_qp(pd, ud_qp_attr(cq.get(), 64, 1)); });
  cycles("SRQ", [&] {
    ibv_srq_init_attr a{};
    a.attr.max_wr = 1 + std::rand() % 4000;
    a.attr.max_sge = 2;
    SrqPtr srq(ibv_create_srq(pd, &a));
    ASSERT_TRUE(srq);
  });
  Endpoint self{node.lid(), 0, 0, 0, 0, 0, 0, node.gid};
  cycles("AH", [&] { create_ah(pd, self); });
  // No fragmentation: the largest queues can still be made.
  CqPtr big = create_cq(ctx, static_cast<int>(1u << 20) - 1);
  EXPECT_TRUE(big);
}

}  // namespace
}  // namespace pcientb::test
