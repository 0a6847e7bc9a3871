// Local buffers of work requests: a few registered chunks, each used as a
// FIFO ring (WRs of one send queue complete in order), so a WR's gather or
// scatter list spans several MRs and its bytes stay untouched until it has
// completed.
#ifndef PCIENTB_STRESS_STAGING_HPP
#define PCIENTB_STRESS_STAGING_HPP

#include "pattern.hpp"
#include "verbs.hpp"

#include <array>
#include <vector>

namespace stress {

inline constexpr int kChunks = 4;
inline constexpr int kMaxPieces = 16;

struct Piece {
  uint8_t chunk;
  uint32_t off;
  uint32_t len;
};

// Where one WR's bytes are: pieces in order, and what to give back.
struct Layout {
  uint8_t n = 0;
  std::array<Piece, kMaxPieces> pieces{};
  std::array<size_t, kChunks> cost{};
  uint64_t length = 0;
};

class Staging {
 public:
  Staging() = default;
  Staging(ibv_pd *pd, size_t chunk_size, int chunks);
  // Splits `len` into 1..max_pieces pieces (none when len == 0) over the
  // chunks; false (and nothing taken) when the rings are too full now.
  bool take(Rng &rng, uint64_t len, uint32_t max_pieces, size_t align, Layout *out);
  void give(const Layout &l);  // in the order taken
  // To undo several takes at once (rings are FIFO: no single give-back).
  std::vector<ByteRing> mark() const { return rings_; }
  void restore(std::vector<ByteRing> mark) { rings_ = std::move(mark); }
  void reset();  // nothing outstanding any more
  bool empty() const;

  uint8_t *at(const Piece &p) const { return chunks_[p.chunk].at(p.off); }
  // The logical bytes [0, length) of the layout carry the pattern `seed`.
  void fill(const Layout &l, uint64_t seed, uint64_t base_offset = 0) const;
  // First logical offset that differs from the pattern, or kNoMismatch.
  size_t mismatch(const Layout &l, uint64_t seed, uint64_t base_offset) const;
  uint8_t *byte_at(const Layout &l, uint64_t logical) const;
  int sges(const Layout &l, ibv_sge *out) const;

 private:
  int count_ = 0;
  std::vector<Region> chunks_;
  std::vector<ByteRing> rings_;
};

}  // namespace stress

#endif
