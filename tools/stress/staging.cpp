#include "staging.hpp"

#include <algorithm>

namespace stress {

Staging::Staging(ibv_pd *pd, size_t chunk_size, int chunks) : count_(chunks) {
  for (int i = 0; i < chunks; ++i) {
    chunks_.emplace_back(pd, chunk_size, IBV_ACCESS_LOCAL_WRITE);
    rings_.emplace_back(chunk_size);
  }
}

bool Staging::take(Rng &rng, uint64_t len, uint32_t max_pieces, size_t align, Layout *out) {
  *out = Layout{};
  out->length = len;
  if (len == 0) return true;
  uint32_t limit = static_cast<uint32_t>(std::min<uint64_t>({max_pieces, len, kMaxPieces}));
  uint32_t n = rng.chance(50) ? 1 : 1 + static_cast<uint32_t>(rng.below(limit));
  // Random shares of what is left after one byte per piece.
  uint64_t weights[kMaxPieces], total = 0;
  for (uint32_t j = 0; j < n; ++j) total += weights[j] = 1 + rng.below(1000);
  uint64_t spare = len - n, given = 0;
  int first = static_cast<int>(rng.below(count_));
  std::vector<ByteRing> saved = rings_;  // undo if a piece does not fit
  for (uint32_t j = 0; j < n; ++j) {
    uint64_t share = j + 1 == n ? spare - given : spare * weights[j] / total;
    given += share;
    int c = (first + static_cast<int>(j)) % count_;
    size_t cost = 0;
    auto off = rings_[c].take(share + 1, align, &cost);
    if (!off) {
      rings_ = std::move(saved);
      return false;
    }
    out->pieces[j] = Piece{static_cast<uint8_t>(c), static_cast<uint32_t>(*off),
                           static_cast<uint32_t>(share + 1)};
    out->cost[c] += cost;
  }
  out->n = static_cast<uint8_t>(n);
  return true;
}

void Staging::give(const Layout &l) {
  for (int c = 0; c < count_; ++c) rings_[c].give(l.cost[c]);
}

void Staging::reset() {
  for (auto &r : rings_) r.reset();
}

bool Staging::empty() const {
  return std::all_of(rings_.begin(), rings_.end(), [](const ByteRing &r) { return r.used() == 0; });
}

void Staging::fill(const Layout &l, uint64_t seed, uint64_t base_offset) const {
  uint64_t off = base_offset;
  for (int j = 0; j < l.n; ++j) {
    fill_pattern(at(l.pieces[j]), l.pieces[j].len, seed, off);
    off += l.pieces[j].len;
  }
}

size_t Staging::mismatch(const Layout &l, uint64_t seed, uint64_t base_offset) const {
  uint64_t off = 0;
  for (int j = 0; j < l.n; ++j) {
    size_t bad = find_mismatch(at(l.pieces[j]), l.pieces[j].len, seed, base_offset + off);
    if (bad != kNoMismatch) return off + bad;
    off += l.pieces[j].len;
  }
  return kNoMismatch;
}

uint8_t *Staging::byte_at(const Layout &l, uint64_t logical) const {
  for (int j = 0; j < l.n; ++j) {
    if (logical < l.pieces[j].len) return at(l.pieces[j]) + logical;
    logical -= l.pieces[j].len;
  }
  return nullptr;
}

int Staging::sges(const Layout &l, ibv_sge *out) const {
  for (int j = 0; j < l.n; ++j) {
    const Piece &p = l.pieces[j];
    out[j] = ibv_sge{reinterpret_cast<uintptr_t>(at(p)), p.len, chunks_[p.chunk].mr->lkey};
  }
  return l.n;
}

}  // namespace stress
