// The ZCopy threshold `auto` (sdp/adaptive.cpp) driven by a simulated clock: sockets that
// each send one message after another, at speeds the test sets per path, so the choices can
// be checked without the noise of real transfers.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "adaptive.hpp"

namespace {

using sdp::AutoThreshold;

constexpr uint64_t kMs = 1'000'000;
constexpr uint64_t kRing = 1 << 20;

struct Socket {
  uint64_t busy_until = 0;   // the running send completes then
  AutoThreshold::Send send;  // of the last measured send
  bool running = false;
  bool measured = false;  // the running send is (else it took AutoThreshold::path())
  bool zcopy = false;     // the running send's path
  uint32_t unmeasured = 0;
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
  Sim(size_t len, Speed speed, AutoThreshold::Log log = nullptr)
      : auto_(log), len_(len), speed_(std::move(speed)) {}

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
      if (s.running) complete(s);
      // As the socket layer.
      const uint32_t weight = auto_.measures(len_, s.auto_epoch, s.unmeasured, &s.zcopy);
      s.measured = weight != 0;
      if (s.measured) {
        s.send = auto_.begin(len_, now_, weight);
        s.zcopy = s.send.zcopy;
      }
      s.running = true;
      const bool cold = !s.zcopy && s.tx < kRing;
      s.busy_until = now_ + uint64_t(double(len_) / speed_(s.zcopy, cold, now_)) + 1;
      if (now_ >= from) {
        ++t.sends[s.zcopy];
        if (s.measured && s.zcopy &&
            (t.zcopy_epochs.empty() || t.zcopy_epochs.back() != s.send.epoch))
          t.zcopy_epochs.push_back(s.send.epoch);
      }
    }
  }

 private:
  void complete(Socket &s) {
    s.tx += s.zcopy ? 64 : len_;
    if (!s.measured) return;
    if (auto_.completed(s.send, len_, s.zcopy, now_, s.auto_epoch != s.send.epoch, s.tx < kRing))
      s.auto_epoch = s.send.epoch;
    auto_.end(s.send);
  }

  AutoThreshold auto_;
  size_t len_;
  Speed speed_;
  std::vector<Socket> sockets_;
  uint64_t now_ = 0;
};

// The threshold's last log line.
std::string g_logged;
void capture_log(const char *fmt, ...) {
  char line[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  g_logged = line;
}

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

// A path that loses by 4x or more is tried again after 64 epochs at first, then ever more
// rarely while the choice holds, up to the longest gap: at 64 KiB ZCopy is 5-40x slower than
// BCopy here, and each trial epoch cost about an epoch of BCopy's bytes.
TEST(AutoThreshold, APathThatLosesHopelesslyIsTriedEverMoreRarely) {
  constexpr uint64_t kEpoch = AutoThreshold::kEpochNs;
  Sim sim(64 << 10, [](bool zcopy, bool, uint64_t) { return share(zcopy ? 0.5 : 8.0, 2); });
  sim.add_sockets(2);
  const Tally t = sim.run(0, 200 * kEpoch);
  // Its warm-up, its measurement and a second look (the first verdict is checked once), then
  // trials 64 epochs apart while the choice is young.
  EXPECT_GE(t.zcopy_epochs.size(), 5u) << ::testing::PrintToString(t.zcopy_epochs);
  EXPECT_LE(t.zcopy_epochs.size(), 6u) << ::testing::PrintToString(t.zcopy_epochs);
  sim.run(200 * kEpoch, 1000 * kEpoch);
  const Tally later = sim.run(1000 * kEpoch, (1000 + 2 * AutoThreshold::kMaxGap) * kEpoch);
  EXPECT_GE(later.zcopy_epochs.size(), 1u) << "the losing path is never tried again";
  EXPECT_LE(later.zcopy_epochs.size(), 3u) << ::testing::PrintToString(later.zcopy_epochs);
}

// Near the crossover the paths are within 1.1-1.3x; a trial of the slower costs (1 - 1/r) of
// an epoch, and one every 4 epochs cost 2-4% of the bytes. Each lost trial doubles the gap,
// up to 64 epochs (the crossover moves with the machine's load: it is looked at again soon).
TEST(AutoThreshold, ATrialThatLosesNarrowlyWaitsLongerEachTime) {
  Sim sim(1 << 20, [](bool zcopy, bool, uint64_t) { return share(zcopy ? 5.0 : 6.0, 2); });
  sim.add_sockets(2);
  const Tally t = sim.run(0, 600 * AutoThreshold::kEpochNs);
  // Warm-up, measurement, then trials after 4, 8, 16, 32 and 64 epochs, then every 64.
  EXPECT_LE(t.zcopy_epochs.size(), 15u) << ::testing::PrintToString(t.zcopy_epochs);
  EXPECT_GE(t.zcopy_epochs.size(), 12u) << ::testing::PrintToString(t.zcopy_epochs);
  EXPECT_LT(t.zcopy_share(), 0.05);
}

// A path at half the other's speed costs half an epoch's bytes at each trial: its trials
// come up to 256 epochs apart (every 64 cost 0.8% of the bytes at 4 MiB, where BCopy ran at
// 0.5-0.7x ZCopy's speed in sdp-bench, the other way round).
TEST(AutoThreshold, ATrialThatLosesWidelyWaitsUpToTheLongestGap) {
  Sim sim(4 << 20, [](bool zcopy, bool, uint64_t) { return share(zcopy ? 4.0 : 8.0, 4); });
  sim.add_sockets(4);
  // Gaps of 8, 16, 32, 64, 64, then half the epochs the choice has held: 94, 141, 211, 256.
  sim.run(0, 700 * AutoThreshold::kEpochNs);
  const Tally t = sim.run(700 * AutoThreshold::kEpochNs,
                          (700 + 2 * AutoThreshold::kMaxGap) * AutoThreshold::kEpochNs);
  EXPECT_LE(t.zcopy_epochs.size(), 3u) << ::testing::PrintToString(t.zcopy_epochs);
  EXPECT_GE(t.zcopy_epochs.size(), 1u) << "the losing path is never tried again";
}

// A choice made while one path was held back (connections starting, another process on the
// cores) is looked at again within 64 epochs: trials grow as far apart as the longest gap
// only once the choice has held for twice that long. (A ZCopy verdict at 128 KiB x4 made
// early, where ZCopy runs at a fifth of BCopy's speed, held for 256 epochs in sdp-bench:
// auto at 0.33x BCopy.)
TEST(AutoThreshold, AChoiceMadeWhileAPathWasHeldBackIsUndoneSoon) {
  constexpr uint64_t kHeldBack = 300 * kMs;
  Sim sim(128 << 10, [](bool zcopy, bool, uint64_t now) {
    return share(zcopy ? 1.5 : now < kHeldBack ? 0.15 : 8.0, 4);
  });
  sim.add_sockets(4);
  constexpr uint64_t kSeen = kHeldBack + 100 * AutoThreshold::kEpochNs;
  EXPECT_GT(sim.run(0, kHeldBack).zcopy_share(), 0.9) << "ZCopy was the faster then";
  sim.run(kHeldBack, kSeen);
  EXPECT_LT(sim.run(kSeen, kSeen + 500 * kMs).zcopy_share(), 0.1);
}

// When the faster path becomes the slower, the other takes over within the longest gap and
// its two trials.
TEST(AutoThreshold, FollowsAChangeOfTheFasterPath) {
  constexpr uint64_t kChange = 4000 * kMs;
  constexpr uint64_t kTakeOver = (AutoThreshold::kMaxGap + 10) * AutoThreshold::kEpochNs;
  Sim sim(1 << 20, [](bool zcopy, bool, uint64_t now) {
    const bool zcopy_faster = now < kChange;
    return share(zcopy == zcopy_faster ? 9.0 : 5.0, 4);
  });
  sim.add_sockets(4);
  sim.run(0, 500 * kMs);
  EXPECT_GT(sim.run(500 * kMs, kChange).zcopy_share(), 0.9);
  sim.run(kChange, kChange + kTakeOver);
  EXPECT_LT(sim.run(kChange + kTakeOver, kChange + kTakeOver + 1000 * kMs).zcopy_share(), 0.1);
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
  // Within the gap of a choice that held for 100 epochs (64) and a few trials made again.
  constexpr uint64_t kSeen = 1000 * kMs + 100 * AutoThreshold::kEpochNs;
  sim.run(1000 * kMs, kSeen);
  EXPECT_LT(sim.run(kSeen, kSeen + 300 * kMs).zcopy_share(), 0.1);
}

// Sends of 16-32 KiB are measured one in eight (the bookkeeping cost 9% of such a send); the
// others take the path of the running epoch, so the choice holds for all of them.
TEST(AutoThreshold, SendsThatAreNotMeasuredTakeTheChosenPath) {
  for (const bool zcopy_faster : {true, false}) {
    Sim sim(16 << 10, [zcopy_faster](bool zcopy, bool, uint64_t) {
      return share(zcopy == zcopy_faster ? 8.0 : 2.0, 2);
    });
    sim.add_sockets(2);
    sim.run(0, 500 * kMs);
    const Tally t = sim.run(500 * kMs, 1000 * kMs);
    if (zcopy_faster)
      EXPECT_GT(t.zcopy_share(), 0.9) << t.sends[0] << " BCopy sends, " << t.sends[1] << " ZCopy";
    else
      EXPECT_LT(t.zcopy_share(), 0.1) << t.sends[0] << " BCopy sends, " << t.sends[1] << " ZCopy";
  }
}

// After its first send of an epoch, a socket measures 1 in 8 sends of 16-32 KiB, 1 in 4 up to
// 128 KiB, 1 in 2 up to 512 KiB, and every larger one.
TEST(AutoThreshold, SmallSendsAreMeasuredOneInAFew) {
  for (const auto &[len, every] :
       {std::pair{size_t{16} << 10, 8}, std::pair{size_t{100} << 10, 4},
        std::pair{size_t{256} << 10, 2}, std::pair{size_t{1} << 20, 1}}) {
    AutoThreshold at;
    const AutoThreshold::Send first = at.begin(len, 0);
    at.end(first);
    uint32_t unmeasured = 0;
    int measured = 0;
    bool zcopy = true;
    for (int i = 0; i < 100; i++) {
      if (const uint32_t weight = at.measures(len, first.epoch, unmeasured, &zcopy)) {
        ++measured;
        EXPECT_EQ(weight, uint32_t(every)) << "it stands for itself and the unmeasured ones";
      }
    }
    EXPECT_EQ(measured, 100 / every) << len << " bytes";
    if (every > 1) {
      EXPECT_FALSE(zcopy) << "the path of the epoch (BCopy first)";
    }
    EXPECT_EQ(at.measures(len, first.epoch - 1, unmeasured, &zcopy), 1u)
        << "a socket's first send in an epoch, standing for itself";
  }
}

// A measured send stands for itself and the sends not measured since the socket's last one,
// so that the paths' figures are the bytes all sends moved. ZCopy sends are all measured: a
// ZCopy trial of 8 sockets at 16 KiB makes few sends a socket, and sampled it measured 1.4x
// its speed (the first sample's weight included sends completed before the timed part).
TEST(AutoThreshold, TheFiguresCountTheSendsThatWereNotMeasured) {
  Sim sim(
      16 << 10, [](bool zcopy, bool, uint64_t) { return share(zcopy ? 0.2 : 8.0, 8); },
      capture_log);
  sim.add_sockets(8);
  g_logged.clear();
  sim.run(0, 300 * kMs);
  double bcopy = 0, zcopy = 0;
  const size_t at = g_logged.find("(BCopy");
  ASSERT_NE(at, std::string::npos) << g_logged;
  ASSERT_EQ(sscanf(g_logged.c_str() + at, "(BCopy %lf MB/s, ZCopy %lf MB/s)", &bcopy, &zcopy), 2)
      << g_logged;
  EXPECT_NEAR(bcopy, 8000, 800) << g_logged;
  EXPECT_NEAR(zcopy, 200, 20) << g_logged;
}

// A program that sends in bursts: an epoch that a pause falls in would time the sends after
// it from before it, and its path would look many times slower than it is. It ends at the
// first send after a pause of an epoch's time, without a figure.
TEST(AutoThreshold, AnEpochThatAPauseFallsInEndsAtTheFirstSendAfterIt) {
  AutoThreshold at;
  const AutoThreshold::Send a = at.begin(64 << 10, 0);
  at.completed(a, 64 << 10, a.zcopy, 3 * kMs, true, false);
  at.end(a);
  const AutoThreshold::Send b = at.begin(64 << 10, 3 * kMs);
  at.completed(b, 64 << 10, b.zcopy, 4 * kMs, false, false);
  at.end(b);
  const AutoThreshold::Send later = at.begin(64 << 10, 60 * kMs);
  EXPECT_NE(later.epoch, a.epoch);
  at.end(later);
}

// An epoch whose timed sends all completed at one instant has no time to divide by: it goes
// on until it has (so a short trial of 8 sockets in step is not lost, and made again).
TEST(AutoThreshold, AnEpochGoesOnUntilItsSendsCanBeTimed) {
  AutoThreshold at;
  const AutoThreshold::Send first = at.begin(64 << 10, 0);
  at.end(first);
  for (int i = 0; i < 4; i++) {
    const AutoThreshold::Send s = at.begin(64 << 10, 1 * kMs);
    at.completed(s, 64 << 10, s.zcopy, 5 * kMs, i == 0, false);
    at.end(s);
  }
  const AutoThreshold::Send later = at.begin(64 << 10, 11 * kMs);
  EXPECT_EQ(later.epoch, first.epoch);
  at.end(later);
}

// A trial of a path that lost by 4x or more lasts half an epoch: it only has to show that the
// path still loses, and at 16-256 KiB every such trial of ZCopy cost an epoch of BCopy's
// bytes.
TEST(AutoThreshold, AHopelessPathIsTriedForHalfAnEpoch) {
  constexpr size_t kLen = 64 << 10;
  constexpr double kZcopy = 0.5;  // bytes per ns, against BCopy's 8
  Sim sim(kLen, [](bool zcopy, bool, uint64_t) { return share(zcopy ? kZcopy : 8.0, 1); });
  sim.add_sockets(1);
  sim.run(0, 300 * kMs);
  constexpr uint64_t kFourGaps = AutoThreshold::kEpochNs * 4 * (AutoThreshold::kMaxGap + 1);
  const Tally t = sim.run(300 * kMs, 300 * kMs + kFourGaps);
  ASSERT_GE(t.zcopy_epochs.size(), 3u);
  const double zcopy_ns = double(t.sends[1]) * double(kLen) / kZcopy;
  EXPECT_LT(zcopy_ns / double(t.zcopy_epochs.size()), 0.6 * double(AutoThreshold::kEpochNs))
      << t.sends[1] << " ZCopy sends in " << t.zcopy_epochs.size() << " trials";
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
