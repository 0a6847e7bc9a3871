// The ZCopy threshold `auto` (adaptive.hpp says how it chooses and why).
#include "adaptive.hpp"

#include <algorithm>

namespace sdp {
namespace {

constexpr uint64_t kSettleNs = 2'500'000;  // the start of an epoch, not timed
constexpr uint32_t kMinSends = 4;          // completions an epoch needs to count
constexpr uint32_t kMaxRetries = 4;        // trials made again at once, in a row
// A trial that loses by this much is not tried again for the longest gap at once (ZCopy of
// 64 KiB is 5-40x slower than BCopy here; each trial cost an epoch of BCopy's bytes), unless
// it was the first verdict: both paths are still warming up then (connections starting, the
// peer's first registrations and page faults), and the first figures can be 2-8x off.
constexpr double kHopeless = 4;
// A trial that loses by less than this waits at most kNarrowMaxGap epochs for the next (the
// paths are near their crossover, which moves with the machine's load); a wider loser, up to
// half the epochs the choice has held, within kNarrowMaxGap..kMaxGap (a trial of a path at
// half the speed every 64 epochs cost 0.8% of the bytes; but a choice made while the other
// path was held back, at the start of 4 connections, kept ZCopy for the longest gap at once).
constexpr double kNarrow = 1.5;
constexpr uint32_t kNarrowMaxGap = 64;
// The other path must be this much better to be taken instead of the one in use.
constexpr double kStay = 1.05;

}  // namespace

int AutoThreshold::conn_bucket(uint32_t sockets) {
  return sockets <= 1 ? 0 : sockets == 2 ? 1 : sockets <= 4 ? 2 : 3;
}
int AutoThreshold::size_bucket(size_t len) {
  int b = 0;
  for (size_t n = len / kAutoMinBytes; n > 1 && b < kSizeBuckets - 1; n >>= 1) ++b;
  return b;
}

// Of a socket's BCopy sends of 16-32 KiB 1 in 8, 32-128 KiB 1 in 4, 128-512 KiB 1 in 2, larger
// every one: the bookkeeping stays near 0.2% of the sends' time (at 1 in 4 and 2 it cost auto
// ~0.5% against BCopy at 16-256 KiB in sdp-bench), and the samples many: an epoch of 16 KiB
// sends by 8 sockets has some 400 (a sample's weight may include sends that completed before
// the epoch's timed part).
uint32_t AutoThreshold::sample_every(int size) {
  return size == 0 ? 8 : size <= 2 ? 4 : size <= 4 ? 2 : 1;
}

uint32_t AutoThreshold::measures(size_t len, uint64_t socket_epoch, uint32_t &unmeasured,
                                 bool *zcopy) const {
  const int size = size_bucket(len);
  const uint64_t running = cells_[size].running.load(std::memory_order_relaxed);
  // A socket's first send in an epoch, and every ZCopy send, stand for themselves. ZCopy
  // sends are not sampled: where they are slow enough for the bookkeeping not to matter,
  // a socket makes few in an epoch, and a sample's weight then included sends completed
  // before the epoch's timed part (a ZCopy trial of 8 sockets at 16 KiB measured 1.4x its
  // speed).
  if (running >> 1 == 0 || running >> 1 != socket_epoch || (running & 1)) {
    unmeasured = 0;
    return 1;
  }
  if (++unmeasured >= sample_every(size)) {
    const uint32_t weight = unmeasured;
    unmeasured = 0;
    return weight;
  }
  *zcopy = running & 1;
  return 0;
}

// Takes the figure of the epoch that ends (mu_ held).
void AutoThreshold::close_epoch(Cell &c, int size, bool idle) {
  const int conns = conn_bucket(std::max(c.sockets, c.peak));
  // The first epoch of a path warms up (registration caches, page faults): not a figure. Nor
  // is a BCopy epoch in which a socket had not yet gone round its ring once: the first touch
  // of each ring page faults in both processes (~10 us a page on these VMs), which made BCopy
  // look 20x slower than it is while 8 new connections started, and ZCopy won for good.
  const bool warm = c.warm[c.zcopy] && !c.cold;
  c.warm[c.zcopy] = true;
  // A trial that only warmed up is made again at once, a few times in a row (a socket that
  // joins while ZCopy is chosen gets BCopy's ring laps in trials only; short connections, or
  // rings reused from closed ones, may look cold for ever).
  // Nor is an epoch in which the sends stopped for an epoch's time: its completions after the
  // pause would be timed from before it (a program that sends in bursts; sdp-bench's slices).
  const bool figure = warm && !idle && c.sends >= kMinSends && c.last_ns > c.first_ns;
  if (Estimate &last = c.est[c.conns];
      !figure && (c.cold || idle) && c.trial && last.decided && last.retries < kMaxRetries) {
    last.since = last.gap;
    ++last.retries;
  }
  if (figure) {
    c.conns = conns;
    Estimate &e = c.est[conns];
    const double rate = double(c.bytes - c.first_bytes) / double(c.last_ns - c.first_ns);
    double &mine = e.rate[c.zcopy];
    // A trial is a fresh look: its figure replaces the old one (conditions change). A routine
    // epoch moves the estimate a quarter of the way, and at most 2x (the machine's other work
    // is not a path's cost).
    mine =
        c.trial || mine == 0 ? rate : mine + (std::clamp(rate, mine / 2, mine * 2) - mine) * 0.25;
    e.retries = 0;
    const double b = e.rate[0], z = e.rate[1];
    if (b != 0 && z != 0) {
      // The path in use stays unless the other is better by a margin, in two trials in a row
      // (one lucky epoch of the other path, or an unlucky one of this, does not flap).
      bool best = e.decided ? (e.zcopy ? z * kStay > b : z > b * kStay) : z > b;
      // A trial that loses, by however little, waits twice as long for the next: a trial
      // costs (1 - 1/r) of an epoch, and near the crossover, where the paths are within
      // 1.1-1.3x, one every 4 epochs cost 2-4% of the bytes (sdp-bench, auto at 1 MiB).
      if (c.trial) {
        const double r = std::max(b, z) / std::min(b, z);
        const uint32_t cap =
            r < kNarrow ? kNarrowMaxGap : std::clamp(e.in_use / 2, kNarrowMaxGap, kMaxGap);
        e.gap = !e.decided      ? kMinGap  // the first verdict is checked soon
                : r > kHopeless ? cap
                                : std::min(std::max(e.gap, kMinGap) * 2, cap);
      }
      if (e.decided && best != e.zcopy && !e.challenged) {
        e.challenged = true;
        e.gap = 1;  // the next epoch tries it again
        best = e.zcopy;
      } else {
        e.challenged = false;
      }
      const bool changed = !e.decided || best != e.zcopy;
      if (e.decided && changed) e.gap = kMinGap;  // a change of mind is checked again soon
      if (changed) e.in_use = 0;
      e.decided = true;
      e.zcopy = best;
      static const char *const conn_label[kConnBuckets] = {"1", "2", "3-4", "5+"};
      if (changed && log_)
        log_("zcopy auto: %s connection(s) sending %zu KiB: %s (BCopy %.0f MB/s, ZCopy %.0f MB/s)",
             conn_label[conns], (kAutoMinBytes << size) >> 10, best ? "ZCopy" : "BCopy", b * 1e3,
             z * 1e3);
    }
  }
}

// Starts the next epoch of `c` (mu_ held): the better path, or a trial of the other.
void AutoThreshold::open_epoch(Cell &c, uint64_t now) {
  Estimate &e = c.est[c.conns];
  if (e.rate[0] == 0 || e.rate[1] == 0) {
    c.zcopy = e.rate[0] != 0;  // BCopy first, then ZCopy (each after its warm-up)
    c.trial = true;
  } else {
    c.trial = ++e.since >= e.gap;
    if (c.trial) e.since = 0;
    ++e.in_use;
    c.zcopy = c.trial ? !e.zcopy : e.zcopy;
  }
  // A trial of a path that lost hopelessly (after the first verdict's second look) is short.
  const double lost = e.rate[c.zcopy] == 0 ? 0 : e.rate[!c.zcopy] / e.rate[c.zcopy];
  c.short_trial = c.trial && e.gap >= kNarrowMaxGap && lost > kHopeless;
  c.epoch = ++epochs_;
  c.running.store(c.epoch << 1 | uint64_t(c.zcopy), std::memory_order_relaxed);
  c.start_ns = c.active_ns = now;
  c.timed_ns = now + kSettleNs;
  c.first_ns = c.last_ns = c.first_bytes = 0;
  c.bytes = 0;
  c.sends = 0;
  c.sockets = 0;
  c.cold = false;
  c.peak = c.in_flight;
}

AutoThreshold::Send AutoThreshold::begin(size_t len, uint64_t now, uint32_t weight) {
  std::lock_guard<std::mutex> lk(mu_);
  const int size = size_bucket(len);
  Cell &c = cells_[size];
  // The caller read its clock before the lock: another thread may have opened an epoch
  // meanwhile, later than that (now - start_ns would wrap and close it at once).
  if (c.epoch) now = std::max(now, c.start_ns);
  // An epoch ends at its time with enough sends to time, or when it has waited long for them;
  // at once, without a figure, after a pause of an epoch's time.
  // (Another thread's completion may have come after `now` was read.)
  const bool idle = c.epoch && now > c.active_ns && now - c.active_ns >= kEpochNs;
  if (c.epoch && (idle || (now - c.start_ns >= (c.short_trial ? kEpochNs / 2 : kEpochNs) &&
                           ((c.sends >= kMinSends && c.last_ns > c.first_ns) ||
                            now - c.start_ns >= 10 * kEpochNs)))) {
    close_epoch(c, size, idle);
    c.epoch = 0;
  }
  if (!c.epoch) open_epoch(c, now);
  c.active_ns = std::max(c.active_ns, now);
  c.peak = std::max(c.peak, ++c.in_flight);
  return {size, c.epoch, c.zcopy, weight};
}

void AutoThreshold::end(const Send &send) {
  std::lock_guard<std::mutex> lk(mu_);
  --cells_[send.size].in_flight;
}

bool AutoThreshold::completed(const Send &send, size_t bytes, bool went_zcopy, uint64_t now,
                              bool new_socket, bool cold) {
  std::lock_guard<std::mutex> lk(mu_);
  Cell &c = cells_[send.size];
  if (c.epoch != send.epoch || went_zcopy != c.zcopy) return false;  // a fallback, or late
  if (new_socket) ++c.sockets;
  if (cold && !went_zcopy) c.cold = true;
  c.active_ns = std::max(c.active_ns, now);
  if (now < c.timed_ns) return true;
  bytes *= send.weight;  // a measured send stands for the unmeasured ones before it
  if (!c.sends++) {
    c.first_ns = now;
    c.first_bytes = bytes;
  }
  c.bytes += bytes;
  c.last_ns = std::max(c.last_ns, now);
  return true;
}

}  // namespace sdp
