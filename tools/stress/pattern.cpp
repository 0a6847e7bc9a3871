#include "pattern.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

namespace stress {
namespace {

constexpr uint64_t kGolden = 0x9e3779b97f4a7c15ull;

inline uint64_t pattern_word(uint64_t seed, uint64_t index) {
  return seed + index * kGolden;
}

}  // namespace

double Rng::exponential(double mean) {
  double u = (static_cast<double>(next() >> 11) + 0.5) * 0x1.0p-53;  // (0, 1)
  return -mean * std::log(u);
}

uint64_t random_size(Rng &rng, uint64_t max) {
  uint64_t pick = rng.below(32);
  if (pick == 0 || max == 0) return 0;
  if (pick == 1) return max;
  int top = std::bit_width(max) - 1;  // 2^top <= max
  double u = static_cast<double>(rng.below(1u << 20)) / (1u << 20);
  int e = static_cast<int>(u * u * (top + 1));  // skewed towards small exponents
  uint64_t lo = 1ull << e;
  uint64_t hi = std::min<uint64_t>(max, (2ull << e) - 1);
  if (lo > hi) lo = hi;
  return lo + rng.below(hi - lo + 1);
}

uint8_t pattern_byte(uint64_t seed, uint64_t offset) {
  return static_cast<uint8_t>(pattern_word(seed, offset >> 3) >> (8 * (offset & 7)));
}

void fill_pattern(uint8_t *dst, size_t len, uint64_t seed, uint64_t offset) {
  while (len && (offset & 7)) {
    *dst++ = pattern_byte(seed, offset++);
    --len;
  }
  uint64_t index = offset >> 3;
  for (; len >= 8; len -= 8, dst += 8, offset += 8) {
    uint64_t w = pattern_word(seed, index++);
    std::memcpy(dst, &w, 8);
  }
  while (len) {
    *dst++ = pattern_byte(seed, offset++);
    --len;
  }
}

size_t find_mismatch(const uint8_t *src, size_t len, uint64_t seed, uint64_t offset) {
  uint8_t expect[4096];
  for (size_t done = 0; done < len;) {
    size_t n = std::min(sizeof expect, len - done);
    fill_pattern(expect, n, seed, offset + done);
    if (std::memcmp(expect, src + done, n) != 0) {
      for (size_t i = 0; i < n; ++i)
        if (expect[i] != src[done + i]) return done + i;
    }
    done += n;
  }
  return kNoMismatch;
}

MessageDesc describe(uint64_t key, uint64_t seq, uint64_t max_size, uint64_t region_len) {
  Rng r(mix(key ^ mix(seq)));
  MessageDesc d{};
  uint64_t k = r.below(100);
  d.kind = k < 30   ? MsgKind::kSend
           : k < 50 ? MsgKind::kSendImm
           : k < 75 ? MsgKind::kWrite
                    : MsgKind::kWriteImm;
  d.length = random_size(r, max_size);
  d.offset = r.below(region_len - d.length + 1);
  d.imm = r.next32();
  d.manifest_len = static_cast<uint32_t>(8 + r.below(57));  // >= 8 bytes: names its message
  d.seed = r.next();
  d.manifest_seed = r.next();
  return d;
}

}  // namespace stress
