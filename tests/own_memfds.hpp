// The fabric's shared memory a test process holds: the memfds the emulated fabric moves
// registered memory onto (named pcientb-mr-<pid>), found through the process's own
// descriptors and maps, which need no privilege (/proc/self/map_files does).
#pragma once

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <string>

namespace pcientb::test {

// stat of each memfd of this process's moved memory, by inode.
inline std::map<ino_t, struct stat> own_memfds() {
  std::map<ino_t, struct stat> found;
  const std::string mine = "/memfd:pcientb-mr-" + std::to_string(getpid()) + " ";
  DIR *d = opendir("/proc/self/fd");
  if (!d) return found;
  while (dirent *e = readdir(d)) {
    const std::string fd = std::string("/proc/self/fd/") + e->d_name;
    char target[256] = {};
    if (readlink(fd.c_str(), target, sizeof target - 1) <= 0 ||
        strncmp(target, mine.c_str(), mine.size()))
      continue;
    struct stat st {};
    if (stat(fd.c_str(), &st) == 0) found[st.st_ino] = st;
  }
  closedir(d);
  return found;
}

// The inode of the file mapped at exactly [addr, addr + len), or 0.
inline ino_t mapped_inode(const void *addr, size_t len) {
  const auto lo = reinterpret_cast<uintptr_t>(addr), hi = lo + len;
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    unsigned long a = 0, b = 0;
    unsigned long long inode = 0;
    if (sscanf(line.c_str(), "%lx-%lx %*s %*s %*s %llu", &a, &b, &inode) == 3 && a == lo)
      return b == hi ? inode : 0;
  }
  return 0;
}

// Bytes of shared memory allocated to this process's moved memory (pages where used).
inline uint64_t fabric_memory_bytes() {
  uint64_t bytes = 0;
  for (const auto &[ino, st] : own_memfds()) bytes += uint64_t(st.st_blocks) * 512;
  return bytes;
}

}  // namespace pcientb::test
