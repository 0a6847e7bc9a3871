// The ZCopy threshold `auto` (sdp/adaptive.cpp) driven by a simulated clock: sockets that
// each send one message after another, at speeds the test sets per path, so the choices can
// be checked without the noise of real transfers.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>

#include "adaptive.hpp"

namespace {

using sdp::AutoThreshold;

constexpr uint64_t kMs = 1'000'000;
constexpr uint64_t kRing = 1 << 20;

struct Socket {
  uint64_t busy_until = 0;  // the running send completes then
  AutoThreshold::Send send;
  bool running = false;
  uint64_t tx = 0;  // ring bytes written (BCopy data; a ZCopy send writes a record)
  uint64_t auto_epoch = 0;
};

// What the paths deliver to one socket (bytes per ns) at `now`: `cold` while its BCopy has
// not yet gone round its ring.
using Speed = std::function<double(bool zcopy, bool cold, uint64_t now)>;

struct Tally {
  uint64_t sends[2] = {0, 0};  // sends begun by BCopy, ZCopy
  std::vector<uint64_t> zcopy_epochs;
  double zcopy_share() const { return double(sends[1]) / double(sends[0] + sends[1]); }
};

class Sim {
 public:
  Sim(size_t len, Speed speed) : len_(len), speed_(std::move(speed)) {}

  void add_sockets(int n) { sockets_.resize(sockets_.size() + size_t(n)); }
  // Every socket's connection replaced by a new one (its ring cold again).
  void replace_connections() {
    for (Socket &s : sockets_) s.tx = 0;
  }

  // Runs until `until`; counts the sends begun from `from` on.
  Tally run(uint64_t from, uint64_t until) {
    Tally t;
    for (;;) {
      auto next = std::min_element(
          sockets_.begin(), sockets_.end(),
          [](const Socket &a, const Socket &b) { return a.busy_until < b.busy_until; });
      now_ = std::max(now_, next->busy_until);
      if (now_ >= until) return t;
      Socket &s = *next;
      if (s.running) {
        s.tx += s.send.zcopy ? 64 : len_;
        if (auto_.completed(s.send, len_, s.send.zcopy, now_, s.auto_epoch != s.send.epoch,
                            s.tx < kRing))
          s.auto_epoch = s.send.epoch;
        auto_.end(s.send);
      }
      s.send = auto_.begin(len_, now_);
      s.running = true;
      const bool cold = !s.send.zcopy && s.tx < kRing;
      s.busy_until = now_ + uint64_t(double(len_) / speed_(s.send.zcopy, cold, now_)) + 1;
      if (now_ >= from) {
        ++t.sends[s.send.zcopy];
        if (s.send.zcopy && (t.zcopy_epochs.empty() || t.zcopy_epochs.back() != s.send.epoch))
          t.zcopy_epochs.push_back(s.send.epoch);
      }
    }
  }

 private:
  AutoThreshold auto_;
  size_t len_;
  Speed speed_;
  std::vector<Socket> sockets_;
  uint64_t now_ = 0;
};

// Bytes per ns for one of `n` sockets sharing `gb_s` GB/s.
double share(double gb_s, int n) {
  return gb_s / n;
}

// New connections fault in their ring pages as BCopy first fills them (here 30x slower than
// later); ZCopy touches no ring. Measured then, BCopy lost to ZCopy for good: 8 x 64 KiB
// streams ran at 0.17x BCopy's speed in scripts/sdp-bench.sh.
TEST(AutoThreshold, BcopyIsNotJudgedWhileItsRingsFaultInTheFirstTime) {
  Sim sim(64 << 10, [](bool zcopy, bool cold, uint64_t) {
    return share(zcopy ? 0.8 : cold ? 0.2 : 6.0, 8);
  });
  sim.add_sockets(8);
  sim.run(0, 300 * kMs);
  const Tally t = sim.run(300 * kMs, 1000 * kMs);
  EXPECT_LT(t.zcopy_share(), 0.02) << t.sends[0] << " BCopy sends, " << t.sends[1] << " ZCopy";
}

// A path that loses by 4x or more is tried again only after the longest gap: at 64 KiB ZCopy
// is 5-40x slower than BCopy here, and each trial epoch cost about an epoch of BCopy's bytes.
TEST(AutoThreshold, APathThatLosesHopelesslyIsTriedAgainOnlyAfterTheLongestGap) {
  Sim sim(64 << 10, [](bool zcopy, bool, uint64_t) { return share(zcopy ? 0.5 : 8.0, 2); });
  sim.add_sockets(2);
  const Tally t = sim.run(0, AutoThreshold::kMaxGap * AutoThreshold::kEpochNs);
  // Its warm-up, its measurement and a second look (the first verdict is checked once); the
  // next trial is the longest gap later.
  EXPECT_EQ(t.zcopy_epochs.size(), 3u) << ::testing::PrintToString(t.zcopy_epochs);
  ASSERT_FALSE(t.zcopy_epochs.empty());
  const Tally later = sim.run(0, (3 * AutoThreshold::kMaxGap + 10) * AutoThreshold::kEpochNs);
  EXPECT_GE(later.zcopy_epochs.size(), 1u) << "the losing path is never tried again";
  EXPECT_LE(later.zcopy_epochs.size(), 3u);
}

// When the faster path becomes the slower, the other takes over within the longest gap and
// its two trials.
TEST(AutoThreshold, FollowsAChangeOfTheFasterPath) {
  Sim sim(1 << 20, [](bool zcopy, bool, uint64_t now) {
    const bool zcopy_faster = now < 2000 * kMs;
    return share(zcopy == zcopy_faster ? 9.0 : 5.0, 4);
  });
  sim.add_sockets(4);
  sim.run(0, 500 * kMs);
  EXPECT_GT(sim.run(500 * kMs, 2000 * kMs).zcopy_share(), 0.9);
  sim.run(2000 * kMs, 3000 * kMs);
  EXPECT_LT(sim.run(3000 * kMs, 4000 * kMs).zcopy_share(), 0.1);
}

// Sockets that join while ZCopy is chosen lap their rings in BCopy's trials only. A trial that
// was only their warm-up is made again at once, so a change in BCopy's favour is seen soon
// (not after several of the longest gaps).
TEST(AutoThreshold, ATrialThatOnlyWarmedUpNewSocketsIsMadeAgainAtOnce) {
  Sim sim(64 << 10, [](bool zcopy, bool cold, uint64_t now) {
    if (now < 1000 * kMs) return share(zcopy ? 8.0 : 1.0, 8);  // ZCopy: hopeless BCopy
    return share(zcopy ? 2.0 : cold ? 0.2 : 8.0, 8);
  });
  sim.add_sockets(5);  // 5 or more: the same estimates (a new count would measure anew)
  sim.run(0, 1000 * kMs);
  sim.add_sockets(3);
  sim.run(1000 * kMs, 1700 * kMs);
  EXPECT_LT(sim.run(1700 * kMs, 2000 * kMs).zcopy_share(), 0.1);
}

// The caller reads its clock before the threshold's lock: a thread that read it a moment
// before another thread opened an epoch must not close that epoch (its now - start wraps).
TEST(AutoThreshold, AClockReadBeforeAnEpochOpenedDoesNotEndIt) {
  AutoThreshold at;
  const AutoThreshold::Send opened = at.begin(64 << 10, 1000 * kMs);
  const AutoThreshold::Send stale = at.begin(64 << 10, 1000 * kMs - 1);
  EXPECT_EQ(stale.epoch, opened.epoch);
  at.end(stale);
  at.end(opened);
}

// Connections that never go round their rings (short ones, or rings reused from closed
// connections) keep every BCopy trial cold: after a few trials made again at once, the usual
// gap holds (else BCopy ran trial after trial while ZCopy was the faster path).
TEST(AutoThreshold, TrialsThatStayColdAreMadeAgainOnlyAFewTimes) {
  Sim sim(256 << 10, [](bool zcopy, bool cold, uint64_t) {
    return share(zcopy ? 8.0 : cold ? 0.5 : 2.0, 8);
  });
  sim.add_sockets(8);
  sim.run(0, 1000 * kMs);  // ZCopy chosen, BCopy measured warm
  Tally t;
  for (uint64_t ms = 1000; ms < 3000; ms += 5) {
    sim.replace_connections();
    const Tally slice = sim.run(ms * kMs, (ms + 5) * kMs);
    t.sends[0] += slice.sends[0];
    t.sends[1] += slice.sends[1];
  }
  EXPECT_GT(t.zcopy_share(), 0.8) << t.sends[0] << " BCopy sends, " << t.sends[1] << " ZCopy";
}

}  // namespace
