// bulk_copy(): memcpy for payloads, without glibc's slow case on AMD Zen.
//
// glibc (2.33 and later) copies with REP MOVSB from about 2 KiB up to the L2
// size on CPUs with ERMS/FSRM. On AMD Zen that instruction runs about 20 times
// slower when (dst - src) mod 4096 is between 1 and 31 (measured here: 64 KiB
// at 2 GB/s instead of 40). glibc's malloc hands out large buffers 16 bytes
// past a page boundary, so an RDMA READ into a malloc'd buffer from a
// page-aligned window, or a socket receive from a ring, lands in that case.
// There a plain vector loop runs at full speed, so it takes those copies.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace pcientb {

namespace detail {

#if defined(__x86_64__)
// Both copy n >= 128 bytes: whole blocks, then the last block of the buffer
// (overlapping the one before), so that no string instruction runs at all.
__attribute__((target("avx2"))) inline void vector_copy_avx2(uint8_t *d, const uint8_t *s,
                                                             size_t n) {
  auto block = [](uint8_t * to, const uint8_t *from) __attribute__((target("avx2"))) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(from));
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(from + 32));
    __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(from + 64));
    __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(from + 96));
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(to), a);
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(to + 32), b);
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(to + 64), c);
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(to + 96), e);
  };
  for (size_t i = 0; i + 128 <= n; i += 128) block(d + i, s + i);
  block(d + n - 128, s + n - 128);
}

inline void vector_copy_sse2(uint8_t *d, const uint8_t *s, size_t n) {
  auto block = [](uint8_t *to, const uint8_t *from) {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i *>(from));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i *>(from + 16));
    __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i *>(from + 32));
    __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i *>(from + 48));
    _mm_storeu_si128(reinterpret_cast<__m128i *>(to), a);
    _mm_storeu_si128(reinterpret_cast<__m128i *>(to + 16), b);
    _mm_storeu_si128(reinterpret_cast<__m128i *>(to + 32), c);
    _mm_storeu_si128(reinterpret_cast<__m128i *>(to + 48), e);
  };
  for (size_t i = 0; i + 64 <= n; i += 64) block(d + i, s + i);
  block(d + n - 64, s + n - 64);
}

inline bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}
#endif

}  // namespace detail

// Below this size glibc's memcpy uses vector moves only.
inline constexpr size_t kBulkCopyMin = 2048;
// The distances (mod 4096) at which REP MOVSB is slow, with a margin.
inline constexpr uintptr_t kSlowDistance = 64;

// Non-overlapping copy of n bytes.
inline void bulk_copy(void *dst, const void *src, size_t n) {
#if defined(__x86_64__)
  const uintptr_t distance =
      (reinterpret_cast<uintptr_t>(dst) - reinterpret_cast<uintptr_t>(src)) & 4095;
  if (n >= kBulkCopyMin && distance != 0 && distance < kSlowDistance) {
    auto *d = static_cast<uint8_t *>(dst);
    const auto *s = static_cast<const uint8_t *>(src);
    if (detail::has_avx2())
      detail::vector_copy_avx2(d, s, n);
    else
      detail::vector_copy_sse2(d, s, n);
    return;
  }
#endif
  memcpy(dst, src, n);
}

}  // namespace pcientb
