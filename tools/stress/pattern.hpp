// What every byte should be, and what every message should look like.
//
// Contents are never stored for later comparison: a byte at offset o of a
// stream with seed s is a pure function of (s, o), so the side that checks
// recomputes it. A connection's messages are a pure function of (connection
// key, sequence number): the target knows the opcode, length, immediate and
// (for WRITEs) the target offset of message n without being told, so a lost,
// repeated or altered message shows up as a mismatch.
#ifndef PCIENTB_STRESS_PATTERN_HPP
#define PCIENTB_STRESS_PATTERN_HPP

#include <cstddef>
#include <cstdint>

namespace stress {

// splitmix64's finalizer: a good 64-bit mix.
constexpr uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Small fast generator (splitmix64 sequence); deterministic per seed.
class Rng {
 public:
  explicit Rng(uint64_t seed = 1) : state_(seed) {}
  uint64_t next() { return mix(state_ += 0x9e3779b97f4a7c15ull); }
  uint32_t next32() { return static_cast<uint32_t>(next() >> 32); }
  // Uniform in [0, n); n > 0.
  uint64_t below(uint64_t n) { return static_cast<uint64_t>((unsigned __int128)next() * n >> 64); }
  bool chance(uint32_t percent) { return below(100) < percent; }
  // Exponentially distributed with the given mean (for chaos intervals).
  double exponential(double mean);

 private:
  uint64_t state_;
};

// A size in 0..max skewed towards small: 1 in 32 is 0, 1 in 32 is max, the
// rest log-uniform with the exponent itself skewed low (mean about max/20).
uint64_t random_size(Rng &rng, uint64_t max);

// The byte pattern: 8-byte words seed + i * golden, little endian.
void fill_pattern(uint8_t *dst, size_t len, uint64_t seed, uint64_t offset);
// Offset (from dst) of the first byte that differs from the pattern, or
// kNoMismatch.
inline constexpr size_t kNoMismatch = SIZE_MAX;
size_t find_mismatch(const uint8_t *src, size_t len, uint64_t seed, uint64_t offset);
uint8_t pattern_byte(uint64_t seed, uint64_t offset);

// ---- messages of an RC connection ----------------------------------------------

// Operations that take a receive at the target, in sequence order.
enum class MsgKind : uint8_t { kSend, kSendImm, kWrite, kWriteImm };

struct MessageDesc {
  MsgKind kind;
  uint64_t length;        // SEND payload, or WRITE length
  uint64_t offset;        // WRITE: offset in the connection's region
  uint32_t imm;           // SEND_IMM / WRITE_IMM (host order)
  uint32_t manifest_len;  // WRITE: length of the SEND that follows it (8..64)
  uint64_t seed;          // pattern of the SEND payload / written bytes
  uint64_t manifest_seed;
};

// Message `seq` of the connection with `key`; `region_len` >= 2 * max_size.
MessageDesc describe(uint64_t key, uint64_t seq, uint64_t max_size, uint64_t region_len);

// Pattern of a worker's READ-only MR (function of slot and generation).
inline uint64_t read_region_seed(int slot, uint32_t generation) {
  return mix(0x52454144ull ^ (static_cast<uint64_t>(slot) << 40) ^ generation);
}
// Pattern of a UD datagram body.
inline uint64_t datagram_seed(int slot, uint32_t generation, uint64_t seq) {
  return mix(mix(0x5544ull ^ (static_cast<uint64_t>(slot) << 48) ^ generation) ^ seq);
}

}  // namespace stress

#endif
