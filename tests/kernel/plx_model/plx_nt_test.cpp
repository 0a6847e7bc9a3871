// kernel/plx_nt.c (the PEX8749 NT port's register sequences) against the register model
// of two chips back to back: bring-up, scratchpads and doorbells across, windows with and
// without the A-LUT (where the peer's writes land, and that nothing else is reachable),
// link down and up with the chip's reset of the link side, and stop.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "plx_model.hpp"

extern "C" {
#include "plx_nt.h"
}

namespace {

using plx_model::Chip;
using plx_model::Fabric;

constexpr uint64_t kMiB = 1ull << 20;
constexpr uint64_t kBar2 = 16 * kMiB, kBar4 = 8 * kMiB;  // BAR4: the B2B window

// A host's BIOS placed two 64-bit window BARs; the driver probes as ntb_plx.c does.
void bring_up(Chip &c, plx_nt *nt, bool bar2_64 = true) {
  c.add_bar(2, bar2_64, 0xd0000000, kBar2);
  c.add_bar(4, true, 0xe0000000, kBar4);
  ASSERT_EQ(plx_nt_identify(nt, &c.regs_map, c.nt_id()), 0);
  ASSERT_EQ(plx_nt_add_mw(nt, 2, bar2_64, 0xd0000000, kBar2), 0);
  ASSERT_EQ(plx_nt_add_mw(nt, 4, true, 0xe0000000, kBar4), 0);
  ASSERT_EQ(plx_nt_start(nt, &c.bar_map[4]), 0);
  plx_nt_irq_on(nt);  // as ntb_plx.c does once its handler is there
}

std::vector<uint8_t> pattern(size_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(seed + i * 7);
  return v;
}

// Both hosts up, link enabled by both.
struct Pair : ::testing::Test {
  explicit Pair(unsigned alut_bits = 0) : f(alut_bits, alut_bits) {}
  void SetUp() override {
    bring_up(f.a, &a);
    bring_up(f.b, &b);
    plx_nt_link_enable(&a, true);
    plx_nt_link_enable(&b, true);
    ASSERT_TRUE(f.link_up());
  }
  Fabric f;
  plx_nt a{}, b{};
};

TEST(PlxIdentify, PortAndALutFromTheChip) {
  struct Case {
    int ntx, port;
    unsigned bits, alut;
  } cases[] = {{0, 8, 0, 0}, {0, 8, 1, 2}, {0, 8, 2, 0}, {0, 8, 3, 1}, {1, 9, 2, 2}, {1, 17, 1, 0}};
  for (const Case &k : cases) {
    Chip c(k.ntx, k.port, k.bits, 0, 4096);
    plx_nt nt{};
    ASSERT_EQ(plx_nt_identify(&nt, &c.regs_map, c.nt_id()), 0);
    EXPECT_EQ(nt.ntx, static_cast<unsigned>(k.ntx));
    EXPECT_EQ(nt.port, static_cast<unsigned>(k.port));
    EXPECT_EQ(nt.alut, k.alut) << "bits " << k.bits << " ntx " << k.ntx;
  }
  Chip c(0, 8, 0, 0, 4096);
  plx_nt nt{};
  EXPECT_EQ(plx_nt_identify(&nt, &c.regs_map, c.nt_id() | 0x80000000u), -EOPNOTSUPP);
}

TEST(PlxIdentify, WindowsMustBeWholeLinkBarsInOrder) {
  Chip c(0, 8, 0, 0, 4096);
  plx_nt nt{};
  ASSERT_EQ(plx_nt_identify(&nt, &c.regs_map, c.nt_id()), 0);
  EXPECT_EQ(plx_nt_add_mw(&nt, 2, true, 0, 3 * kMiB), -EINVAL);  // not a power of two
  EXPECT_EQ(plx_nt_add_mw(&nt, 2, true, 0, kMiB / 2), -EINVAL);  // under 1 MiB
  EXPECT_EQ(plx_nt_add_mw(&nt, 5, true, 0, kMiB), -EINVAL);      // no BAR6 for its top
  ASSERT_EQ(plx_nt_add_mw(&nt, 2, true, 0, kMiB), 0);
  EXPECT_EQ(plx_nt_add_mw(&nt, 3, false, 0, kMiB), -EINVAL);  // BAR3 is BAR2's top half
  EXPECT_EQ(plx_nt_start(&nt, nullptr), -ENODEV);
}

TEST(PlxLink, UpWhenBothEnableDownWithDlDownOnBothSides) {
  Fabric f(0, 0);
  plx_nt a{}, b{};
  bring_up(f.a, &a);
  bring_up(f.b, &b);
  EXPECT_FALSE(plx_nt_link_enabled(&a));
  plx_nt_link_enable(&a, true);
  EXPECT_TRUE(plx_nt_link_enabled(&a));
  EXPECT_FALSE(f.link_up());
  plx_nt_link_enable(&b, true);
  EXPECT_TRUE(f.link_up());
  EXPECT_FALSE(f.a.irq());
  plx_nt_link_enable(&a, false);
  EXPECT_FALSE(f.link_up());
  // Unmasked by start: both hosts are interrupted and find DL_Down.
  EXPECT_TRUE(f.a.irq());
  EXPECT_TRUE(f.b.irq());
  EXPECT_EQ(plx_nt_link_errors(&a) & 0x4, 0x4u);
  EXPECT_EQ(plx_nt_link_errors(&b) & 0x4, 0x4u);
  EXPECT_FALSE(f.a.irq());
  EXPECT_EQ(plx_nt_link_errors(&a), 0u);
  plx_nt_link_enable(&a, true);
  EXPECT_TRUE(f.link_up());
}

TEST_F(Pair, ScratchpadsBothWays) {
  ASSERT_EQ(plx_nt_peer_spad_write(&a, 3, 0xa5a5a5a5), 0);
  ASSERT_EQ(plx_nt_spad_write(&b, 4, 0x12345678), 0);
  uint32_t v = 0;
  ASSERT_EQ(plx_nt_spad_read(&b, 3, &v), 0);
  EXPECT_EQ(v, 0xa5a5a5a5u);
  ASSERT_EQ(plx_nt_peer_spad_read(&a, 4, &v), 0);
  EXPECT_EQ(v, 0x12345678u);
  ASSERT_EQ(plx_nt_peer_spad_read(&b, 3, &v), 0);  // A's own, untouched
  EXPECT_EQ(v, 0u);
  EXPECT_EQ(plx_nt_spad_write(&a, 8, 1), -EINVAL);
  EXPECT_EQ(plx_nt_peer_spad_read(&a, -1, &v), -EINVAL);
  // The last is the order word's: no client reaches it, on either side.
  EXPECT_EQ(plx_nt_spad_write(&a, 7, 1), -EINVAL);
  EXPECT_EQ(plx_nt_peer_spad_write(&a, 7, 1), -EINVAL);
  EXPECT_EQ(plx_nt_spad_read(&b, 7, &v), -EINVAL);
}

// The port numbers of a pair, as ntb_plx.c agrees on them once the link is up.
struct Order : Pair {
  // Both drivers started (tags ta, tb); what each side decides, in this order.
  std::pair<int, int> decide(uint32_t ta, uint32_t tb) {
    plx_nt_order_init(&a, ta);
    plx_nt_order_init(&b, tb);
    const int pa = plx_nt_order(&a);
    return {pa, plx_nt_order(&b)};
  }
  // A chip's order word (its last scratchpad), as the peer reads it.
  static uint32_t &word(Chip &c) { return c.regs[(c.nt_base() + 0xc6c + 4 * 7) / 4]; }
};

TEST_F(Order, TheLowerTagIsPortZero) {
  EXPECT_EQ(decide(0x1234, 0x99), std::make_pair(1, 0));
  // Decided: asked again, each keeps its number.
  EXPECT_EQ(plx_nt_order(&a), 1);
  EXPECT_EQ(plx_nt_order(&b), 0);
}

TEST_F(Order, TheTagIsTwentyFourBitsAndAWordWithoutTheMagicIsNoDriver) {
  // The top byte of a tag does not fit: these two are the same tag.
  EXPECT_EQ(decide(0x01000007, 0x02000007), std::make_pair(-ENOTUNIQ, -ENOTUNIQ));
  word(f.b) = 0x12345601;  // a client's leftover in the pad, "decided" but no magic
  plx_nt_order_init(&a, 5);
  EXPECT_EQ(plx_nt_order(&a), -EAGAIN);
}

TEST_F(Order, BothDecidingAtOnceAgree) {
  plx_nt_order_init(&a, 5);
  plx_nt_order_init(&b, 6);
  const uint32_t undecided = word(f.a);
  EXPECT_EQ(plx_nt_order(&a), 0);
  word(f.a) = undecided;  // B read A's word before A wrote its decision
  EXPECT_EQ(plx_nt_order(&b), 1);
}

TEST_F(Order, TheSameTagIsATieForTheCallerToRedraw) {
  EXPECT_EQ(decide(7, 7), std::make_pair(-ENOTUNIQ, -ENOTUNIQ));
  plx_nt_order_init(&b, 3);
  EXPECT_EQ(plx_nt_order(&a), 1);
  EXPECT_EQ(plx_nt_order(&b), 0);
}

TEST_F(Order, NothingIsDecidedWithoutThePeersWordOrLink) {
  plx_nt_order_init(&a, 1);
  EXPECT_EQ(plx_nt_order(&a), -EAGAIN);  // no driver on B yet
  plx_nt_order_init(&b, 2);
  f.set_cable(false);
  EXPECT_EQ(plx_nt_order(&a), -EAGAIN);  // the link is down: reads return ones
  f.set_cable(true);
  plx_nt_link_errors(&a);  // DL_Down: both drivers set their chips up again
  plx_nt_link_errors(&b);
  EXPECT_EQ(plx_nt_order(&a), 0);
}

TEST_F(Order, APeerThatComesBackTakesTheOtherNumber) {
  EXPECT_EQ(decide(1, 2), std::make_pair(0, 1));
  // B's driver reloads with a tag that would have made it port 0: A keeps 0 (its contexts
  // hold LIDs of that half), so B takes 1.
  plx_nt_order_init(&b, 0);
  EXPECT_EQ(plx_nt_order(&b), 1);
  EXPECT_EQ(plx_nt_order(&a), 0);
}

TEST_F(Order, TheWordOutlivesTheChipsResetOfTheLinkSide) {
  EXPECT_EQ(decide(1, 2), std::make_pair(0, 1));
  f.set_cable(false);
  word(f.b) = 0;  // were the pad cleared with the link
  f.set_cable(true);
  plx_nt_link_errors(&a);  // DL_Down: both drivers set their chips up again
  plx_nt_link_errors(&b);
  plx_nt_order_init(&a, 9);  // A reloads
  EXPECT_EQ(plx_nt_order(&a), 0);
  EXPECT_EQ(plx_nt_order(&b), 1);
}

TEST_F(Order, AWordTheHandlersSetUpWroteBackIsWrittenAgainAtTheNextLook) {
  plx_nt_order_init(&a, 1);
  const uint32_t undecided = word(f.a);
  plx_nt_order_init(&b, 2);
  EXPECT_EQ(plx_nt_order(&a), 0);
  word(f.a) = undecided;  // the set-up after DL_Down wrote the word as it was
  EXPECT_EQ(plx_nt_order(&a), 0);
  EXPECT_EQ(word(f.a) & 3u, 1u);  // port 0, plus one: the peer sees the decision again
  EXPECT_EQ(plx_nt_order(&b), 1);
}

TEST_F(Order, AWordTakenBackLeavesThePeerNothingToFollow) {
  EXPECT_EQ(decide(1, 2), std::make_pair(0, 1));
  plx_nt_order_clear(&a);  // A's driver went
  EXPECT_EQ(word(f.a), 0u);
  plx_nt_order_init(&b, 3);  // B reloads: no number of A's to take the complement of
  EXPECT_EQ(plx_nt_order(&b), -EAGAIN);
}

TEST_F(Order, BothHoldingTheSameNumberIsAConflict) {
  EXPECT_EQ(decide(1, 2), std::make_pair(0, 1));
  // B paired with another host meanwhile and took 0 there.
  b.order_word = (b.order_word & ~3u) | 1;
  word(f.b) = b.order_word;
  EXPECT_EQ(plx_nt_order(&a), -EBUSY);
  EXPECT_EQ(plx_nt_order(&b), -EBUSY);
}

TEST_F(Pair, DoorbellRaisesThePeersInterruptOnlyWhenUnmasked) {
  EXPECT_EQ(plx_nt_db_read_mask(&b), 0xffffu);  // masked from start until a client unmasks
  plx_nt_peer_db_set(&a, 1u << 5);
  EXPECT_EQ(plx_nt_db_read(&b), 1u << 5);
  EXPECT_FALSE(f.b.irq());
  plx_nt_db_clear_mask(&b, 1u << 5);
  EXPECT_TRUE(f.b.irq());
  EXPECT_FALSE(f.a.irq());
  plx_nt_db_clear(&b, 1u << 5);
  EXPECT_EQ(plx_nt_db_read(&b), 0u);
  EXPECT_FALSE(f.b.irq());
  plx_nt_peer_db_set(&a, 1u << 6);  // another bit, still masked
  EXPECT_FALSE(f.b.irq());
  plx_nt_db_set_mask(&b, 1u << 5);
  plx_nt_db_clear_mask(&b, 1u << 6);
  EXPECT_TRUE(f.b.irq());
  EXPECT_EQ(plx_nt_db_read_mask(&b), 0xffbfu);
}

// Whether A-LUT or not, the peer reaches exactly the translated memory.
class Windows : public Pair, public ::testing::WithParamInterface<unsigned> {
 public:
  Windows() : Pair(GetParam()) {}
};

TEST_P(Windows, WritesLandWhereThePeerTranslatedThemAndNowhereElse) {
  ASSERT_EQ(plx_nt_mw_count(&b), 2);  // BAR2, and BAR4's upper half
  uint64_t addr_align, size_align, size_max;
  ASSERT_EQ(plx_nt_mw_get_align(&b, 0, &addr_align, &size_align, &size_max), 0);
  EXPECT_EQ(size_max, kBar2);
  EXPECT_EQ(addr_align, b.alut ? kBar2 / (128ull * b.alut) : kMiB);
  ASSERT_EQ(plx_nt_mw_get_align(&b, 1, &addr_align, nullptr, &size_max), 0);
  EXPECT_EQ(size_max, kBar4 / 2);
  EXPECT_EQ(addr_align, kMiB);  // BAR4: no A-LUT
  uint64_t phys, size;
  ASSERT_EQ(plx_nt_peer_mw_get_addr(&a, 1, &phys, &size), 0);
  EXPECT_EQ(phys, 0xe0000000 + kBar4 / 2);
  EXPECT_EQ(size, kBar4 / 2);
  EXPECT_EQ(plx_nt_mw_get_align(&b, 2, nullptr, nullptr, nullptr), -EINVAL);

  // Nothing set: the peer reaches nothing.
  auto data = pattern(4096, 1);
  EXPECT_FALSE(f.a.host_write(2, 0, data.data(), data.size()));

  const uint64_t at = f.b.ram_base + 4 * kMiB;
  ASSERT_EQ(plx_nt_mw_set_trans(&b, 0, at, kMiB), 0);
  ASSERT_EQ(plx_nt_mw_set_trans(&b, 1, f.b.ram_base + 8 * kMiB, 2 * kMiB), 0);
  ASSERT_TRUE(f.a.host_write(2, 12345, data.data(), data.size()));
  EXPECT_EQ(std::memcmp(f.b.ram_at(at + 12345, data.size()), data.data(), data.size()), 0);
  auto back = std::vector<uint8_t>(data.size());
  ASSERT_TRUE(f.a.host_read(2, 12345, back.data(), back.size()));
  EXPECT_EQ(back, data);
  ASSERT_TRUE(f.a.host_write(4, kBar4 / 2 + 100, data.data(), 64));
  EXPECT_EQ(std::memcmp(f.b.ram_at(f.b.ram_base + 8 * kMiB + 100, 64), data.data(), 64), 0);

  // Past the translation: refused, memory after it untouched.
  const auto before =
      std::vector<uint8_t>(f.b.ram_at(at + kMiB, 64), f.b.ram_at(at + kMiB, 64) + 64);
  EXPECT_FALSE(f.a.host_write(2, kMiB, data.data(), 64));
  EXPECT_FALSE(f.a.host_write(2, kMiB - 32, data.data(), 64));
  EXPECT_EQ(std::memcmp(f.b.ram_at(at + kMiB, 64), before.data(), 64), 0);
  EXPECT_FALSE(f.a.host_write(4, kBar4 / 2 + 2 * kMiB, data.data(), 4));

  // The whole window: its last entries too (the A-LUT's second block).
  ASSERT_EQ(plx_nt_mw_set_trans(&b, 0, f.b.ram_base, kBar2), 0);
  ASSERT_TRUE(f.a.host_write(2, kBar2 - 4 * kMiB + 4, data.data(), 64));
  EXPECT_EQ(std::memcmp(f.b.ram_at(f.b.ram_base + kBar2 - 4 * kMiB + 4, 64), data.data(), 64), 0);

  // What the chip cannot bound is refused, not rounded.
  const uint64_t unit = b.alut ? kBar2 / (128ull * b.alut) : kMiB;
  EXPECT_EQ(plx_nt_mw_set_trans(&b, 0, at + unit / 2, kMiB), -EINVAL);
  EXPECT_EQ(plx_nt_mw_set_trans(&b, 0, at, kBar2 * 2), -EINVAL);
  EXPECT_EQ(plx_nt_mw_set_trans(&b, 0, at, unit + 4096), -EINVAL);
  EXPECT_EQ(plx_nt_mw_set_trans(&b, 1, f.b.ram_base + kMiB, 2 * kMiB), -EINVAL);  // unaligned
  // A window of 3 entries at an entry-aligned address: only with the A-LUT.
  int rc = plx_nt_mw_set_trans(&b, 0, at + unit, 3 * unit);
  if (!b.alut) {
    EXPECT_EQ(rc, -EINVAL);
    return;
  }
  ASSERT_EQ(rc, 0);
  ASSERT_TRUE(f.a.host_write(2, 2 * unit + 8, data.data(), 64));
  EXPECT_EQ(std::memcmp(f.b.ram_at(at + unit + 2 * unit + 8, 64), data.data(), 64), 0);
  EXPECT_FALSE(f.a.host_write(2, 3 * unit, data.data(), 4));

  ASSERT_EQ(plx_nt_mw_clear_trans(&b, 0), 0);
  EXPECT_FALSE(f.a.host_write(2, 0, data.data(), 4));
}

INSTANTIATE_TEST_SUITE_P(ALut, Windows, ::testing::Values(0u, 1u, 3u), [](const auto &info) {
  return info.param == 0   ? std::string("None")
         : info.param == 1 ? std::string("Entries256")
                           : std::string("Entries128");
});

TEST_P(Windows, LinkDownAndUpRestoresWhatTheChipReset) {
  const uint64_t at = f.b.ram_base + 2 * kMiB;
  ASSERT_EQ(plx_nt_mw_set_trans(&b, 0, at, kMiB), 0);
  f.set_cable(false);
  auto data = pattern(256, 9);
  EXPECT_FALSE(f.a.host_write(2, 0, data.data(), data.size()));
  // Both interrupt handlers find DL_Down and write the link side again.
  ASSERT_TRUE(f.a.irq());
  ASSERT_TRUE(f.b.irq());
  EXPECT_EQ(plx_nt_link_errors(&a), 0x4u);
  EXPECT_EQ(plx_nt_link_errors(&b), 0x4u);
  f.set_cable(true);
  ASSERT_TRUE(f.link_up());
  ASSERT_TRUE(f.a.host_write(2, 0, data.data(), data.size()));
  EXPECT_EQ(std::memcmp(f.b.ram_at(at, data.size()), data.data(), data.size()), 0);
  ASSERT_EQ(plx_nt_peer_spad_write(&b, 1, 77), 0);
  uint32_t v = 0;
  ASSERT_EQ(plx_nt_spad_read(&a, 1, &v), 0);
  EXPECT_EQ(v, 77u);
}

TEST_F(Pair, WithoutTheReinitTheLinkSideStaysDark) {
  // The model's reset is real: skipping the handler leaves the peer unable to reach us.
  ASSERT_EQ(plx_nt_mw_set_trans(&b, 0, f.b.ram_base, kMiB), 0);
  f.set_cable(false);
  f.set_cable(true);
  uint32_t word = 1;
  EXPECT_FALSE(f.a.host_write(2, 0, &word, 4));
  EXPECT_EQ(plx_nt_link_errors(&b), 0x4u);
  EXPECT_EQ(plx_nt_link_errors(&a), 0x4u);
  EXPECT_TRUE(f.a.host_write(2, 0, &word, 4));
}

TEST_F(Pair, StopLeavesThePeerNothing) {
  ASSERT_EQ(plx_nt_mw_set_trans(&b, 0, f.b.ram_base, kMiB), 0);
  ASSERT_EQ(plx_nt_mw_set_trans(&b, 1, f.b.ram_base + 4 * kMiB, kMiB), 0);
  plx_nt_db_clear_mask(&b, 0xffff);
  plx_nt_stop(&b);
  uint32_t word = 1;
  EXPECT_FALSE(f.a.host_write(2, 0, &word, 4));
  EXPECT_FALSE(f.a.host_write(4, kBar4 / 2, &word, 4));
  plx_nt_peer_db_set(&a, 1);
  EXPECT_FALSE(f.b.irq());
}

TEST(PlxWindows, A32BitWindowTakesOnlyMemoryBelow4GiB) {
  Fabric f(0, 0);
  plx_nt a{}, b{};
  bring_up(f.a, &a, false);
  bring_up(f.b, &b, false);
  // Host B's memory is above 4 GiB in the model.
  EXPECT_EQ(plx_nt_mw_set_trans(&b, 0, f.b.ram_base, kMiB), -ERANGE);
  EXPECT_EQ(plx_nt_mw_set_trans(&b, 1, f.b.ram_base + 4 * kMiB, kMiB), 0);  // BAR4: 64-bit
}

// Every register the driver wrote is its NT function's or its port's link control:
// never another port's, the other NT's, or an A-LUT the chip does not have.
TEST_F(Pair, WritesStayInTheDriversRegisters) {
  ASSERT_EQ(plx_nt_mw_set_trans(&b, 0, f.b.ram_base, kMiB), 0);
  plx_nt_peer_db_set(&a, 1);
  for (const Chip *c : {&f.a, &f.b}) {
    const uint32_t nt = c->nt_base(), port_ctl = ((8u & ~7u) << 12) + 0x208;
    for (auto [off, val] : c->writes) {
      const bool ok = (off >= nt && off < nt + 0x2000) || off == port_ctl;  // no A-LUT here
      EXPECT_TRUE(ok) << std::hex << "write of 0x" << val << " at 0x" << off;
    }
  }
}

TEST_F(Pair, TheHandlerMasksTheDoorbellsItReportsUntilTheClientUnmasks) {
  plx_nt_db_clear_mask(&b, 0xffff);  // the client is there
  plx_nt_peer_db_set(&a, 1u << 3 | 1u << 9);
  ASSERT_TRUE(f.b.irq());
  uint64_t db;
  uint32_t errs;
  ASSERT_EQ(plx_nt_isr(&b, &db, &errs), 0);
  EXPECT_EQ(db, 1u << 3 | 1u << 9);
  EXPECT_EQ(errs, 0u);
  EXPECT_FALSE(f.b.irq());  // no storm while the client has not run
  plx_nt_peer_db_set(&a, 1u << 3);
  EXPECT_FALSE(f.b.irq());  // still masked
  plx_nt_db_clear(&b, db);  // the client: clear, then unmask
  plx_nt_db_clear_mask(&b, db);
  EXPECT_FALSE(f.b.irq());
  plx_nt_peer_db_set(&a, 1u << 3);
  EXPECT_TRUE(f.b.irq());
  // A device that is gone reads all ones: not taken for doorbells or a link down.
  f.b.present = false;
  EXPECT_EQ(plx_nt_isr(&b, &db, &errs), -ENODEV);
  EXPECT_EQ(plx_nt_link_errors(&b), 0u);
}

TEST(PlxLink, LinkErrorsRaiseNothingUntilTheHandlerIsThere) {
  Fabric f(0, 0);
  plx_nt a{}, b{};
  for (auto [c, nt] : {std::pair{&f.a, &a}, std::pair{&f.b, &b}}) {
    c->add_bar(2, true, 0xd0000000, kBar2);
    c->add_bar(4, true, 0xe0000000, kBar4);
    ASSERT_EQ(plx_nt_identify(nt, &c->regs_map, c->nt_id()), 0);
    ASSERT_EQ(plx_nt_add_mw(nt, 2, true, 0xd0000000, kBar2), 0);
    ASSERT_EQ(plx_nt_add_mw(nt, 4, true, 0xe0000000, kBar4), 0);
    ASSERT_EQ(plx_nt_start(nt, &c->bar_map[4]), 0);
    plx_nt_link_enable(nt, true);
  }
  ASSERT_TRUE(f.link_up());
  f.set_cable(false);
  EXPECT_FALSE(f.a.irq());
  plx_nt_irq_on(&a);
  EXPECT_TRUE(f.a.irq());  // what happened meanwhile is reported now
}

// A B2B window under 2 MiB is all registers: no memory window in it, its link BAR off.
// With BAR2 the only window (and the A-LUT), that link BAR would cover the register BAR.
TEST(PlxWindows, AB2BWindowUnder2MiBIsRegistersOnly) {
  Fabric f(1, 1);
  plx_nt a{}, b{};
  for (auto [c, nt] : {std::pair{&f.a, &a}, std::pair{&f.b, &b}}) {
    c->add_bar(2, true, 0xd0000000, kMiB);
    ASSERT_EQ(plx_nt_identify(nt, &c->regs_map, c->nt_id()), 0);
    ASSERT_EQ(plx_nt_add_mw(nt, 2, true, 0xd0000000, kMiB), 0);
    ASSERT_EQ(plx_nt_start(nt, &c->bar_map[2]), 0);
    plx_nt_link_enable(nt, true);
  }
  ASSERT_TRUE(f.link_up());
  EXPECT_EQ(plx_nt_mw_count(&a), 0);
  EXPECT_EQ(plx_nt_mw_set_trans(&b, 0, f.b.ram_base, kMiB), -EINVAL);
  ASSERT_EQ(plx_nt_peer_spad_write(&a, 2, 0x55), 0);
  uint32_t v = 0;
  ASSERT_EQ(plx_nt_spad_read(&b, 2, &v), 0);
  EXPECT_EQ(v, 0x55u);
  uint32_t word = 1;
  EXPECT_FALSE(f.a.host_write(2, kMiB / 2, &word, 4));  // past the registers: nothing
}

// The other NT of the chip (NT1, port 17), 32-bit windows with memory below 4 GiB.
TEST(PlxWindows, Nt1And32BitWindowsCarryWritesToo) {
  Fabric f(0, 0, 1, 0x40000000ull);
  plx_nt a{}, b{};
  for (auto [c, nt] : {std::pair{&f.a, &a}, std::pair{&f.b, &b}}) {
    c->add_bar(2, false, 0xd0000000, 4 * kMiB);
    c->add_bar(3, false, 0xd8000000, 4 * kMiB);
    ASSERT_EQ(plx_nt_identify(nt, &c->regs_map, c->nt_id()), 0);
    EXPECT_EQ(nt->ntx, 1u);
    EXPECT_EQ(nt->port, 17u);
    ASSERT_EQ(plx_nt_add_mw(nt, 2, false, 0xd0000000, 4 * kMiB), 0);
    ASSERT_EQ(plx_nt_add_mw(nt, 3, false, 0xd8000000, 4 * kMiB), 0);
    ASSERT_EQ(plx_nt_start(nt, &c->bar_map[3]), 0);
    plx_nt_irq_on(nt);
    plx_nt_link_enable(nt, true);
  }
  ASSERT_TRUE(f.link_up());
  ASSERT_EQ(plx_nt_mw_count(&b), 2);
  ASSERT_EQ(plx_nt_mw_set_trans(&b, 0, 0x40000000ull + kMiB, kMiB), 0);
  ASSERT_EQ(plx_nt_mw_set_trans(&b, 1, 0x40000000ull + 4 * kMiB, 2 * kMiB), 0);
  auto data = pattern(256, 5);
  ASSERT_TRUE(f.a.host_write(2, 64, data.data(), data.size()));
  EXPECT_EQ(
      std::memcmp(f.b.ram_at(0x40000000ull + kMiB + 64, data.size()), data.data(), data.size()), 0);
  ASSERT_TRUE(f.a.host_write(3, 2 * kMiB + 8, data.data(), data.size()));
  EXPECT_EQ(
      std::memcmp(f.b.ram_at(0x40000000ull + 4 * kMiB + 8, data.size()), data.data(), data.size()),
      0);
  plx_nt_peer_db_set(&a, 1u << 1);
  EXPECT_EQ(plx_nt_db_read(&b), 1u << 1);
}

}  // namespace
