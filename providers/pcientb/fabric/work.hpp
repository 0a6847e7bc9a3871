// What this process did through its fabric (Work, fabric.hpp), counted per
// thread with no locked instruction on the data path, and how a posted write
// stores its bytes: shared by the backends.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "fabric/fabric.hpp"

namespace pcientb::fabric {

enum WorkKind {
  kPosts,
  kPostBytes,
  kDoorbells,
  kDmaWrites,
  kDmaWriteBytes,
  kDmaReads,
  kDmaReadBytes,
  kRemoteReads
};
constexpr int kWorkKinds = kRemoteReads + 1;

struct WorkSlot {
  std::atomic<uint64_t> v[kWorkKinds] = {};
};
extern thread_local WorkSlot *work_slot __attribute__((tls_model("initial-exec")));
WorkSlot *new_work_slot();

// One operation of kind k (kPosts, kDoorbells, kDmaWrites, kDmaReads,
// kRemoteReads) and, for those with bytes, its bytes (the kind after it).
inline void count(WorkKind k, uint64_t bytes = 0) {
  WorkSlot *slot = work_slot;
  if (__builtin_expect(!slot, 0)) slot = new_work_slot();
  auto add = [](std::atomic<uint64_t> &v, uint64_t n) {
    v.store(v.load(std::memory_order_relaxed) + n, std::memory_order_relaxed);
  };
  add(slot->v[k], 1);
  if (k == kPosts || k == kDmaWrites || k == kDmaReads) add(slot->v[k + 1], bytes);
}

// The sum over every thread this process has had.
Work work_done();

// CLOCK_MONOTONIC in ns: the clock of the doorbell masks (quiet_until_ns).
uint64_t mono_ns();

// A posted write's stores into a peer's area, each a release (a plain store on
// x86): a post lands after the posts before it, as the reader's acquire of a
// seq or key sees (and as TSan can follow, which a fence before relaxed stores
// hides from it). Aligned words are stored whole: they are what a reader
// checks. A post may start mid-word (a record's body after its seq): up to the
// first aligned word it goes by 4-byte word or byte, then a word at a time.
inline void store_posted(uint8_t *dst, const void *src, size_t len) {
  const auto *from = static_cast<const uint8_t *>(src);
  size_t i = 0;
  auto word32 = [&] {
    uint32_t v;
    memcpy(&v, from + i, 4);
    __atomic_store_n(reinterpret_cast<uint32_t *>(dst + i), v, __ATOMIC_RELEASE);
    i += 4;
  };
  while (i < len && (reinterpret_cast<uintptr_t>(dst + i) & 7)) {
    if ((reinterpret_cast<uintptr_t>(dst + i) & 3) == 0 && i + 4 <= len) {
      word32();
    } else {
      __atomic_store_n(dst + i, from[i], __ATOMIC_RELEASE);
      ++i;
    }
  }
  for (; i + 8 <= len; i += 8) {
    uint64_t v;
    memcpy(&v, from + i, 8);
    __atomic_store_n(reinterpret_cast<uint64_t *>(dst + i), v, __ATOMIC_RELEASE);
  }
  if (i + 4 <= len) word32();
  for (; i < len; ++i) __atomic_store_n(dst + i, from[i], __ATOMIC_RELEASE);
}

}  // namespace pcientb::fabric
