#include "env.hpp"

#include <cstdio>

namespace stress {

Env::Env(Directory &dir_, const Options &opt_, int slot_, uint32_t gen_)
    : dir(dir_),
      opt(opt_),
      slot(slot_),
      gen(gen_),
      me(dir_.slots[slot_]),
      cnt(me.counters),
      rng(mix(opt_.seed ^ mix((static_cast<uint64_t>(slot_) << 32) | gen_))),
      region_len(2 * opt_.max_size) {
  if (opt.verbose) budget_[kInfo] = 1 << 30;  // --verbose asks for all of them
}

void Env::vlog(LogKind kind, const char *fmt, va_list ap) {
  static const char *names[kLogKinds] = {
      "log", "unexpected status", "unexpected event", "corruption", "loss", "hang"};
  if (budget_[kind] <= 0) return;
  if (--budget_[kind] == 0) {
    std::fprintf(stderr, "pcientb-stress[w%d.g%u]: (further %s messages of this worker omitted)\n",
                 slot, gen, names[kind]);
    return;
  }
  char line[1024];
  std::vsnprintf(line, sizeof line, fmt, ap);
  std::fprintf(stderr, "pcientb-stress[w%d.g%u]: %s\n", slot, gen, line);
}

void Env::log(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vlog(kInfo, fmt, ap);
  va_end(ap);
}

void Env::trace(const char *fmt, ...) {
  if (!opt.verbose) return;
  va_list ap;
  va_start(ap, fmt);
  vlog(kInfo, fmt, ap);
  va_end(ap);
}

void Env::unexpected_status(int status, const char *fmt, ...) {
  bump(cnt.unexpected_status[status >= 0 && status < kStatusSlots ? status : kStatusSlots - 1]);
  va_list ap;
  va_start(ap, fmt);
  vlog(kStatus, fmt, ap);
  va_end(ap);
}

void Env::anomaly(Anomaly a, const char *fmt, ...) {
  bump(cnt.anomalies[static_cast<int>(a)]);
  va_list ap;
  va_start(ap, fmt);
  vlog(kAnomaly, fmt, ap);
  va_end(ap);
}

void Env::corrupted(const char *fmt, ...) {
  bump(cnt.corrupted);
  va_list ap;
  va_start(ap, fmt);
  vlog(kCorrupted, fmt, ap);
  va_end(ap);
}

void Env::lost(uint64_t n, const char *fmt, ...) {
  bump(cnt.lost, n);
  va_list ap;
  va_start(ap, fmt);
  vlog(kLost, fmt, ap);
  va_end(ap);
}

void Env::hung(const char *fmt, ...) {
  bump(cnt.hung);
  va_list ap;
  va_start(ap, fmt);
  vlog(kHung, fmt, ap);
  va_end(ap);
}

}  // namespace stress
