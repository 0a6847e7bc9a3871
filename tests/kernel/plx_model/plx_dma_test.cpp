// kernel/plx_dma.c (the PEX87xx DMA engine's ring) against the register model: copies in
// ring order with write-back, into and out of the peer's memory through the NT window
// (only when the NT lets the engine out), a failed descriptor and the handler that goes
// on after it, a full ring and its wrap, arguments the engine cannot take, and stop.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "plx_model.hpp"

extern "C" {
#include "plx_dma.h"
}

namespace {

using plx_model::Fabric;

constexpr uint64_t kMiB = 1ull << 20;
constexpr uint64_t kRing = 64ull * 1024;

std::vector<uint8_t> pattern(size_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(size_t{seed} * 31 + i * 7);
  return v;
}

// Host A's DMA engine, its ring 64 KiB into A's memory; both NTs up, B's window 0
// translated to B's memory at `peer_at`. A lets its DMA function out only if asked.
struct Dma : ::testing::Test {
  void start(bool let_dma_out, uint32_t count = 64) {
    for (auto [c, nt] : {std::pair{&f.a, &a}, std::pair{&f.b, &b}}) {
      c->add_bar(2, true, 0xd0000000, 16 * kMiB);
      c->add_bar(4, true, 0xe0000000, 8 * kMiB);
      ASSERT_EQ(plx_nt_identify(nt, &c->regs_map, c->nt_id()), 0);
      if (c == &f.a && let_dma_out) {
        ASSERT_EQ(plx_nt_add_requester(nt, f.a.dma.rid >> 8, (f.a.dma.rid >> 3) & 31), 0);
      }
      ASSERT_EQ(plx_nt_add_mw(nt, 2, true, 0xd0000000, 16 * kMiB), 0);
      ASSERT_EQ(plx_nt_add_mw(nt, 4, true, 0xe0000000, 8 * kMiB), 0);
      ASSERT_EQ(plx_nt_start(nt, &c->bar_map[4]), 0);
      plx_nt_irq_on(nt);
      plx_nt_link_enable(nt, true);
    }
    ASSERT_TRUE(f.link_up());
    ASSERT_EQ(plx_nt_mw_set_trans(&b, 0, peer_at, kMiB), 0);
    len.resize(count);
    ring = reinterpret_cast<plx_dma_desc *>(f.a.ram_at(host(kRing), count * 16ull));
    ASSERT_EQ(plx_dma_init(&d, &f.a.dma_map, ring, host(kRing), count, len.data()), 0);
  }
  uint64_t host(uint64_t off) const { return f.a.ram_base + off; }
  uint8_t *mem(uint64_t off) { return f.a.ram_at(host(off), 1); }
  // Reaps everything that finished: (slot, result, residue).
  std::vector<std::tuple<int, plx_dma_result, uint32_t>> reap() {
    std::vector<std::tuple<int, plx_dma_result, uint32_t>> out;
    plx_dma_result r;
    uint32_t residue;
    for (int s; (s = plx_dma_reap(&d, &r, &residue)) >= 0;) out.emplace_back(s, r, residue);
    return out;
  }

  Fabric f{0, 0};
  plx_nt a{}, b{};
  plx_dma d{};
  plx_dma_desc *ring = nullptr;
  std::vector<uint32_t> len;
  const uint64_t peer_at = 0x200000000ull + 2 * kMiB;
};

TEST_F(Dma, CopiesWithinHostMemoryInRingOrder) {
  start(false);
  auto src = pattern(3ull * 4096, 1);
  std::memcpy(mem(kMiB), src.data(), src.size());
  for (int i = 0; i < 3; ++i) {
    int s = plx_dma_prep(&d, host(2 * kMiB + i * 4096ull), host(kMiB + i * 4096ull), 4096, i == 2);
    ASSERT_EQ(s, i);
    plx_dma_submit(&d, s);
  }
  EXPECT_TRUE(reap().empty());  // given, not started
  plx_dma_kick(&d);
  auto done = reap();
  ASSERT_EQ(done.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(std::get<0>(done[i]), i);
    EXPECT_EQ(std::get<1>(done[i]), PLX_DMA_OK);
    EXPECT_EQ(std::get<2>(done[i]), 0u);
  }
  EXPECT_EQ(std::memcmp(mem(2 * kMiB), src.data(), src.size()), 0);
  // One interrupt, for the last: the handler clears it.
  EXPECT_TRUE(f.a.dma.irq());
  EXPECT_EQ(plx_dma_irq(&d), PLX_DMA_INTR_DESC_DONE);
  EXPECT_FALSE(f.a.dma.irq());
  EXPECT_EQ(plx_dma_irq(&d), 0);
}

TEST_F(Dma, ReachesThePeerThroughTheWindowOnlyIfTheNtLetsItOut) {
  start(true);
  auto src = pattern(64ull * 1024, 2);
  std::memcpy(mem(kMiB), src.data(), src.size());
  // To the peer: the window BAR's bus address, as the CPU's writes use it.
  plx_dma_submit(&d, plx_dma_prep(&d, 0xd0000000 + 4096, host(kMiB), src.size(), false));
  // And back from it.
  plx_dma_submit(&d, plx_dma_prep(&d, host(3 * kMiB), 0xd0000000 + 4096, src.size(), false));
  plx_dma_kick(&d);
  auto done = reap();
  ASSERT_EQ(done.size(), 2u);
  EXPECT_EQ(std::get<1>(done[0]), PLX_DMA_OK);
  EXPECT_EQ(std::get<1>(done[1]), PLX_DMA_OK);
  EXPECT_EQ(std::memcmp(f.b.ram_at(peer_at + 4096, src.size()), src.data(), src.size()), 0);
  EXPECT_EQ(std::memcmp(mem(3 * kMiB), src.data(), src.size()), 0);
}

TEST_F(Dma, WithoutTheLutEntryTheWriteFailsAndNothingLands) {
  start(false);
  auto src = pattern(4096, 3);
  std::memcpy(mem(kMiB), src.data(), src.size());
  plx_dma_submit(&d, plx_dma_prep(&d, 0xd0000000, host(kMiB), 4096, false));
  plx_dma_kick(&d);
  plx_dma_result r;
  uint32_t residue;
  ASSERT_EQ(plx_dma_reap(&d, &r, &residue), 0);
  EXPECT_EQ(r, PLX_DMA_WRITE_FAILED);
  EXPECT_EQ(residue, 4096u);
  EXPECT_EQ(*f.b.ram_at(peer_at, 1), 0);
  EXPECT_TRUE(f.a.dma.irq());  // the error interrupt
}

TEST_F(Dma, AFailedDescriptorStopsTheEngineAKickGoesOnAfterIt) {
  start(false);
  auto src = pattern(4096, 4);
  std::memcpy(mem(kMiB), src.data(), src.size());
  plx_dma_submit(&d, plx_dma_prep(&d, host(2 * kMiB), host(kMiB), 4096, false));
  plx_dma_submit(&d, plx_dma_prep(&d, host(2 * kMiB), 0x7f0000000000ull, 512, false));  // no memory
  plx_dma_submit(&d, plx_dma_prep(&d, host(3 * kMiB), host(kMiB), 4096, true));
  plx_dma_kick(&d);
  auto first = reap();
  ASSERT_EQ(first.size(), 2u);  // the third waits: the engine stopped
  EXPECT_EQ(std::get<1>(first[0]), PLX_DMA_OK);
  EXPECT_EQ(std::get<1>(first[1]), PLX_DMA_READ_FAILED);
  EXPECT_EQ(std::get<2>(first[1]), 512u);
  EXPECT_EQ(plx_dma_irq(&d) & PLX_DMA_INTR_ERROR, PLX_DMA_INTR_ERROR);
  EXPECT_TRUE(reap().empty());
  plx_dma_kick(&d);  // what dma_plx.c's tasklet does after an error
  auto rest = reap();
  ASSERT_EQ(rest.size(), 1u);
  EXPECT_EQ(std::get<1>(rest[0]), PLX_DMA_OK);
  EXPECT_EQ(std::memcmp(mem(3 * kMiB), src.data(), src.size()), 0);
}

TEST_F(Dma, AFullRingRefusesThenWrapsRoundManyTimes) {
  start(false, 8);
  for (int round = 0; round < 5; ++round) {
    auto src = pattern(8ull * 256, static_cast<uint8_t>(round));
    std::memcpy(mem(kMiB), src.data(), src.size());
    for (int i = 0; i < 8; ++i) {
      int s = plx_dma_prep(&d, host(2 * kMiB + i * 256ull), host(kMiB + i * 256ull), 256, false);
      ASSERT_GE(s, 0);
      plx_dma_submit(&d, s);
    }
    EXPECT_EQ(plx_dma_prep(&d, host(2 * kMiB), host(kMiB), 256, false), -ENOSPC);
    plx_dma_kick(&d);
    auto done = reap();
    ASSERT_EQ(done.size(), 8u) << "round " << round;
    for (auto &[slot, r, residue] : done) EXPECT_EQ(r, PLX_DMA_OK);
    EXPECT_EQ(std::memcmp(mem(2 * kMiB), src.data(), src.size()), 0) << "round " << round;
  }
  EXPECT_EQ(f.a.dma.ran, 40u);
}

TEST_F(Dma, RefusesWhatTheEngineCannotTake) {
  start(false, 8);
  EXPECT_EQ(plx_dma_prep(&d, host(kMiB), host(kMiB), 0, false), -EINVAL);
  EXPECT_EQ(plx_dma_prep(&d, host(kMiB), host(kMiB), PLX_DMA_MAX_LEN + 1, false), -EINVAL);
  EXPECT_EQ(plx_dma_prep(&d, 1ull << 48, host(kMiB), 8, false), -EINVAL);
  EXPECT_EQ(plx_dma_prep(&d, host(kMiB), 1ull << 48, 8, false), -EINVAL);
  plx_dma other{};
  std::vector<uint32_t> l(8);
  EXPECT_EQ(plx_dma_init(&other, &f.b.dma_map, ring, host(kRing), 6, l.data()), -EINVAL);
  EXPECT_EQ(plx_dma_init(&other, &f.b.dma_map, ring, host(kRing) + 32, 8, l.data()), -EINVAL);
  EXPECT_EQ(plx_dma_init(&other, &f.b.dma_map, ring, host(kRing), 4096, l.data()), -EINVAL);
}

// Submitted out of order, slots go to the engine in ring order: one waits for those before.
TEST_F(Dma, SlotsSubmittedOutOfOrderGoInRingOrder) {
  start(false, 8);
  int s0 = plx_dma_prep(&d, host(2 * kMiB), host(kMiB), 64, false);
  int s1 = plx_dma_prep(&d, host(2 * kMiB + 64), host(kMiB), 64, false);
  plx_dma_submit(&d, s1);  // before s0: held back
  plx_dma_kick(&d);
  EXPECT_TRUE(reap().empty());
  EXPECT_EQ(f.a.dma.ran, 0u);
  plx_dma_submit(&d, s0);  // both go
  plx_dma_submit(&d, s0);  // again: nothing
  plx_dma_submit(&d, 7);   // never prepared: nothing
  plx_dma_kick(&d);
  auto done = reap();
  ASSERT_EQ(done.size(), 2u);
  EXPECT_EQ(std::get<0>(done[0]), s0);
  EXPECT_EQ(std::get<0>(done[1]), s1);
  EXPECT_EQ(f.a.dma.ran, 2u);
}

TEST_F(Dma, StopAbortsWhatDidNotRun) {
  start(false, 8);
  f.a.dma.manual = true;
  for (int i = 0; i < 4; ++i)
    plx_dma_submit(&d, plx_dma_prep(&d, host(2 * kMiB + i * 64ull), host(kMiB), 64, false));
  plx_dma_prep(&d, host(3 * kMiB), host(kMiB), 64, false);  // prepared, never given
  plx_dma_kick(&d);
  ASSERT_EQ(f.a.dma.step(1), 1);
  ASSERT_EQ(plx_dma_stop(&d), 0);
  EXPECT_FALSE(f.a.dma.running);
  EXPECT_EQ(f.a.dma.count, 0u);      // the ring is forgotten
  EXPECT_EQ(f.a.dma.intr_ctrl, 0u);  // and its interrupts off
  auto done = reap();
  ASSERT_EQ(done.size(), 5u);
  EXPECT_EQ(std::get<1>(done[0]), PLX_DMA_OK);
  for (size_t i = 1; i < 5; ++i) {
    EXPECT_EQ(std::get<1>(done[i]), PLX_DMA_ABORTED);
    EXPECT_EQ(std::get<2>(done[i]), 64u);
  }
  EXPECT_EQ(plx_dma_prep(&d, host(kMiB), host(kMiB), 8, false), -EIO);
  plx_dma_kick(&d);  // nothing: stopped
  EXPECT_EQ(f.a.dma.ran, 1u);
}

TEST_F(Dma, AnEngineThatNeverStopsIsReported) {
  start(false, 8);
  f.a.dma.manual = true;
  f.a.dma.stuck = true;
  plx_dma_submit(&d, plx_dma_prep(&d, host(2 * kMiB), host(kMiB), 64, false));
  plx_dma_kick(&d);
  EXPECT_EQ(plx_dma_stop(&d), -ETIMEDOUT);  // the caller keeps the ring: it may be written
}

}  // namespace
