// The ZCopy threshold `auto`: each large blocking send goes BCopy or ZCopy by what the two
// paths have been measured to deliver in this process, for sends of that size while that many
// connections send.
//
// Why measure, not model: on the emulated fabric a registration copies the pages, on
// hardware it pins them; the receiver's copy, contention for the cores and the peer's speed
// all move the crossover (NOTES.md: from 2.6 MiB for one connection to 500 KiB for eight).
// Why the whole process at once: with many connections ZCopy wins by needing less CPU per
// byte, which one socket trying it alone among BCopy senders cannot show. So time runs in
// epochs per size class: in an epoch every socket of the process sends that size by one
// path, and the epoch's figure is the bytes all of them completed per second (after a
// settling part: the other path's leftovers in the rings). The better path is used; the
// other gets an epoch again after a number of epochs that doubles while it keeps losing
// clearly (at most 1 in 64), so that a change of conditions is seen and a loser costs little;
// it takes over when it wins two such trials in a row. Each size class warms up each path
// for an epoch first (registration caches, page faults), and keeps estimates per number of
// sockets that sent in an epoch (1, 2, 3-4, 5+): those that completed a send in it, or as
// many as were in a send at once, if more (a socket whose send outlasts the epoch sends too:
// counting only the completions filed an epoch of 8 sockets after a slow one under 3-4, and
// the path that had been slow kept a stale figure for 5+ for ever).
#include <algorithm>
#include <mutex>

#include "sdp.hpp"

namespace sdp {
namespace {

constexpr int kConnBuckets = 4;   // 1, 2, 3-4, 5 or more connections sending in an epoch
constexpr int kSizeBuckets = 16;  // log2 of the size, from kAutoMinBytes up
constexpr uint64_t kEpochNs = 10'000'000;
constexpr uint64_t kSettleNs = 2'500'000;  // the start of an epoch, not timed
constexpr uint32_t kMinSends = 4;          // completions an epoch needs to count
constexpr uint32_t kMinGap = 4, kMaxGap = 64;
// A trial loses "clearly" when the other path was this much better: it waits longer.
constexpr double kClearly = 1.25;
// The other path must be this much better to be taken instead of the one in use.
constexpr double kStay = 1.05;

struct Estimate {
  double rate[2] = {0, 0};  // bytes per ns of BCopy and ZCopy epochs (0: none yet)
  uint32_t gap = kMinGap;   // epochs of the better path before the other is tried again
  uint32_t since = 0;       // epochs since the last trial
  bool decided = false;     // both measured (the choice was logged)
  bool challenged = false;  // the other path won its last trial: one more decides
  bool zcopy = false;       // the better one
};

struct Cell {
  Estimate est[kConnBuckets];
  uint64_t epoch = 0;             // 0: none running
  bool zcopy = false;             // the running epoch's path
  bool trial = false;             // ... is the worse one, tried again
  bool warm[2] = {false, false};  // a path's first epoch in this cell is over
  int conns = 0;                  // bucket of the connections that sent in the last epoch
  uint64_t start_ns = 0, timed_ns = 0;
  // Sends completed after timed_ns: the rate is the bytes after the first of them over the
  // time from the first to the last.
  uint64_t first_ns = 0, last_ns = 0, first_bytes = 0, bytes = 0;
  uint32_t sends = 0;
  uint32_t sockets = 0;    // distinct sockets that completed a send in the epoch
  uint32_t in_flight = 0;  // sends of this size class under way (any epoch's)
  uint32_t peak = 0;       // the most under way at once in the epoch
};

std::mutex g_mu;
Cell g_cells[kSizeBuckets];
uint64_t g_epochs = 0;

int conn_bucket(uint32_t sockets) {
  return sockets <= 1 ? 0 : sockets == 2 ? 1 : sockets <= 4 ? 2 : 3;
}
int size_bucket(size_t len) {
  int b = 0;
  for (size_t n = len / kAutoMinBytes; n > 1 && b < kSizeBuckets - 1; n >>= 1) ++b;
  return b;
}
const char *conn_label(int c) {
  static const char *const names[kConnBuckets] = {"1", "2", "3-4", "5+"};
  return names[c];
}

// Takes the figure of the epoch that ends (g_mu held).
void close_epoch(Cell &c, int size) {
  const int conns = conn_bucket(std::max(c.sockets, c.peak));
  // The first epoch of a path warms up (registration caches, page faults): not a figure.
  const bool warm = c.warm[c.zcopy];
  c.warm[c.zcopy] = true;
  if (warm && c.sends >= kMinSends && c.last_ns > c.first_ns) {
    c.conns = conns;
    Estimate &e = c.est[conns];
    const double rate = double(c.bytes - c.first_bytes) / double(c.last_ns - c.first_ns);
    double &mine = e.rate[c.zcopy];
    // A trial is a fresh look: its figure replaces the old one (conditions change). A routine
    // epoch moves the estimate a quarter of the way, and at most 2x (the machine's other work
    // is not a path's cost).
    mine =
        c.trial || mine == 0 ? rate : mine + (std::clamp(rate, mine / 2, mine * 2) - mine) * 0.25;
    const double b = e.rate[0], z = e.rate[1];
    if (b != 0 && z != 0) {
      // The path in use stays unless the other is better by a margin, in two trials in a row
      // (one lucky epoch of the other path, or an unlucky one of this, does not flap).
      bool best = e.decided ? (e.zcopy ? z * kStay > b : z > b * kStay) : z > b;
      if (c.trial)
        e.gap = std::max(b, z) > kClearly * std::min(b, z)
                    ? std::min(std::max(e.gap, kMinGap) * 2, kMaxGap)
                    : kMinGap;
      if (e.decided && best != e.zcopy && !e.challenged) {
        e.challenged = true;
        e.gap = 1;  // the next epoch tries it again
        best = e.zcopy;
      } else {
        e.challenged = false;
      }
      const bool changed = !e.decided || best != e.zcopy;
      if (e.decided && changed) e.gap = kMinGap;  // a change of mind is checked again soon
      e.decided = true;
      e.zcopy = best;
      if (changed)
        logf("zcopy auto: %s connection(s) sending %zu KiB: %s (BCopy %.0f MB/s, ZCopy %.0f MB/s)",
             conn_label(conns), (kAutoMinBytes << size) >> 10, best ? "ZCopy" : "BCopy", b * 1e3,
             z * 1e3);
    }
  }
}

// Starts the next epoch of `c` (g_mu held): the better path, or a trial of the other.
void open_epoch(Cell &c, uint64_t now) {
  Estimate &e = c.est[c.conns];
  if (e.rate[0] == 0 || e.rate[1] == 0) {
    c.zcopy = e.rate[0] != 0;  // BCopy first, then ZCopy (each after an epoch to warm up)
    c.trial = true;
  } else {
    c.trial = ++e.since >= e.gap;
    if (c.trial) e.since = 0;
    c.zcopy = c.trial ? !e.zcopy : e.zcopy;
  }
  c.epoch = ++g_epochs;
  c.start_ns = now;
  c.timed_ns = now + kSettleNs;
  c.first_ns = c.last_ns = c.first_bytes = 0;
  c.bytes = 0;
  c.sends = 0;
  c.sockets = 0;
  c.peak = c.in_flight;
}

}  // namespace

AutoSend::AutoSend(Sock &s, size_t len) : s_(s), size_(size_bucket(len)) {
  std::lock_guard<std::mutex> lk(g_mu);
  const uint64_t now = now_ns();  // after the lock: another thread may have opened an epoch
  Cell &c = g_cells[size_];
  // An epoch ends at its time with enough sends, or when it has waited long for them.
  if (c.epoch && now - c.start_ns >= kEpochNs &&
      (c.sends >= kMinSends || now - c.start_ns >= 10 * kEpochNs)) {
    close_epoch(c, size_);
    c.epoch = 0;
  }
  if (!c.epoch) open_epoch(c, now);
  epoch_ = c.epoch;
  zcopy_ = c.zcopy;
  c.peak = std::max(c.peak, ++c.in_flight);
}

AutoSend::~AutoSend() {
  std::lock_guard<std::mutex> lk(g_mu);
  --g_cells[size_].in_flight;
}

void AutoSend::done(size_t sent, bool went_zcopy) {
  const uint64_t now = now_ns();
  std::lock_guard<std::mutex> lk(g_mu);
  Cell &c = g_cells[size_];
  if (c.epoch != epoch_ || went_zcopy != c.zcopy) return;  // a fallback, or a late one
  if (s_.auto_epoch != epoch_) {
    s_.auto_epoch = epoch_;
    ++c.sockets;
  }
  if (now < c.timed_ns) return;
  if (!c.sends++) {
    c.first_ns = now;
    c.first_bytes = sent;
  }
  c.bytes += sent;
  c.last_ns = now;
}

}  // namespace sdp
