// bulk_copy (common/bulk_copy.hpp): byte-exact at every size and distance, the vector loop's
// cases (>= 2048 bytes, destination 1..63 bytes past the source within a page) included.

#include "bulk_copy.hpp"

#include <gtest/gtest.h>
#include <sys/mman.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

TEST(BulkCopy, CopiesExactlyTheBytesAtEveryDistanceAndSize) {
  constexpr size_t kMap = 64 * 1024;
  auto *src = static_cast<uint8_t *>(
      mmap(nullptr, kMap, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  auto *dst = static_cast<uint8_t *>(
      mmap(nullptr, kMap, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(src, MAP_FAILED);
  ASSERT_NE(dst, MAP_FAILED);
  for (size_t i = 0; i < kMap; ++i) src[i] = static_cast<uint8_t>(i * 131 + (i >> 8));
  const size_t sizes[] = {0, 1, 127, 128, 129, 2047, 2048, 2049, 2111, 4096, 9000, 40000};
  for (size_t src_off : {size_t{0}, size_t{5}, size_t{4090}})
    for (size_t d = 0; d < 80; ++d)
      for (size_t n : sizes) {
        const size_t dst_off = src_off + d;  // both maps start on a page: distance d
        memset(dst, 0xee, kMap);
        pcientb::bulk_copy(dst + dst_off, src + src_off, n);
        ASSERT_EQ(0, memcmp(dst + dst_off, src + src_off, n))
            << "size " << n << " source offset " << src_off << " distance " << d;
        for (size_t k = 0; k < dst_off; ++k) ASSERT_EQ(dst[k], 0xee) << "before, size " << n;
        for (size_t k = dst_off + n; k < dst_off + n + 256; ++k)
          ASSERT_EQ(dst[k], 0xee) << "after, size " << n;
      }
  munmap(src, kMap);
  munmap(dst, kMap);
}

}  // namespace
