// The memory system calls of the emulated fabric, made directly to the kernel.
//
// Programs hook libc's memory calls: UCX 1.13's memory hooks patch mremap()
// and drop its fifth argument, so a MREMAP_FIXED move through libc lands
// wherever a stale register points (and may replace an unrelated mapping);
// hooks also report our internal maps and unmaps as the application's, which
// invalidates registration caches. Whatever maps, moves or unmaps memory for a
// registration goes through these instead.
#pragma once

#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>

namespace pcientb::fabric::kernel {

// MAP_FAILED with errno set on failure, as mmap().
inline void *mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off) {
  long r = syscall(SYS_mmap, addr, len, prot, flags, fd, off);
  return r == -1 ? MAP_FAILED : reinterpret_cast<void *>(r);
}

inline int munmap(void *addr, size_t len) {
  return static_cast<int>(syscall(SYS_munmap, addr, len));
}

// Moves [from, from+len) to exactly `to`, replacing what was mapped there.
inline void *mremap_fixed(void *from, size_t len, void *to) {
  long r = syscall(SYS_mremap, from, len, len, MREMAP_MAYMOVE | MREMAP_FIXED, to);
  return r == -1 ? MAP_FAILED : reinterpret_cast<void *>(r);
}

inline int madvise(void *addr, size_t len, int advice) {
  return static_cast<int>(syscall(SYS_madvise, addr, len, advice));
}

}  // namespace pcientb::fabric::kernel
