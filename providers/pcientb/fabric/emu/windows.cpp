// The emulated NTB fabric: registration, and memory at fork.
//
// - A window (registered memory) is made of memfd chunks: registration moves
//   the pages of the range, contents kept, onto a memfd mapped at the same
//   address, so a peer maps the same pages and moves bytes with plain loads
//   and stores, as through an NT window. Memory that cannot be moved (shared
//   file mappings, read-only) is reached with process_vm_readv/writev.
// - Moving costs a page allocation and a copy per page that holds data (pages
//   never touched stay holes until used), so a chunk outlives its last
//   registration (the registration cache): registering the same memory again
//   reuses it once /proc/self/pagemap shows the pages are still the shared
//   ones moved there (and, where some are holes, the mapping is still the
//   chunk's). Unreferenced chunks are bounded by $PCIENTB_MR_CACHE bytes
//   (default 256 MiB; 0 disables the cache).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>

#if __has_include(<valgrind/valgrind.h>)
#include <valgrind/valgrind.h>
#endif

#include "fabric/emu/emu.hpp"
#include "fabric/emu/kernel_vm.hpp"
#include "fabric/emu/move_guard.hpp"

namespace pcientb::fabric::emu {

// The memfd name of this process's moved memory: its peers' windows, which
// it maps too, carry their owners' pids.
void own_chunk_name(char *out, size_t n, pid_t pid) {
  snprintf(out, n, "pcientb-mr-%d", pid);
}

namespace {

// Whether every page of [a, b) may move onto a memfd: private anonymous
// read-write memory, or our own earlier chunks. *all_anon: all of it the former.
bool remappable(uint64_t a, uint64_t b, bool *all_anon) {
  *all_anon = true;
  FILE *f = fopen("/proc/self/maps", "re");
  if (!f) return false;
  char line[512];
  uint64_t covered = a;
  bool ok = true;
  while (ok && covered < b && fgets(line, sizeof line, f)) {
    unsigned long lo, hi;
    char perms[8] = {};
    int path_at = 0;
    if (sscanf(line, "%lx-%lx %7s %*s %*s %*s %n", &lo, &hi, perms, &path_at) < 3) continue;
    if (hi <= covered || lo >= b) continue;
    if (lo > covered) ok = false;  // a hole
    const char *path = line + path_at;
    bool anon = *path == '\n' || *path == '\0' || *path == '[';
    char mine[64] = "/memfd:";
    own_chunk_name(mine + 7, sizeof mine - 7, own_pid());
    bool ours = strncmp(path, mine, strlen(mine)) == 0 && path[strlen(mine)] == ' ';
    bool rw = perms[0] == 'r' && perms[1] == 'w';
    if (!rw || !((anon && perms[3] == 'p') || (ours && perms[3] == 's'))) ok = false;
    if (ours) *all_anon = false;
    if (!strncmp(path, "[vsyscall]", 10) || !strncmp(path, "[vvar]", 6)) ok = false;
    covered = hi;
  }
  fclose(f);
  return ok && covered >= b;
}

// Registration moves memory onto shared memfd pages. A forked child must
// still get its own copy of that memory, taken at fork time as for any
// private memory: the parent copies its moved ranges just before fork(), the
// child puts the copies in place, the parent drops them. Ranges marked
// MADV_DONTFORK (ibv_fork_init) are left out: the child gets no mapping there,
// as with an HCA. Raw system calls and static storage only, as in any fork
// handler of a threaded process.
struct ForkCopy {
  uintptr_t at;
  size_t len;
  void *copy;
};
ForkCopy fork_copies[4096];
// getpid() is a system call (glibc caches nothing), ~1 us on these VMs: a fifth of a repeated
// registration. Forgotten in a child by fork_child().
std::atomic<pid_t> own_pid_cache{0};
size_t n_fork_copies = 0;

void fork_copy(uintptr_t lo, uintptr_t hi) {
  if (n_fork_copies == std::size(fork_copies)) return;
  size_t len = hi - lo;
  void *copy =
      kernel::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (copy == MAP_FAILED) return;
  struct iovec to {
    copy, len
  }, from{reinterpret_cast<void *>(lo), len};
  if (process_vm_readv(getpid(), &to, 1, &from, 1, 0) == static_cast<ssize_t>(len))
    fork_copies[n_fork_copies++] = ForkCopy{lo, len, copy};
  else
    kernel::munmap(copy, len);
}

}  // namespace

void fork_prepare() {
  n_fork_copies = 0;
  char mine[64] = "/memfd:";
  own_chunk_name(mine + 7, sizeof mine - 7, own_pid());  // the pid the chunks were named with
  size_t mine_len = strlen(mine);
  // smaps: a header line per mapping, then its fields, "VmFlags:" last.
  int fd = open("/proc/self/smaps", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  static char buf[1 << 16];
  size_t have = 0;
  unsigned long lo = 0, hi = 0;  // the moved range whose flags come next, if any
  for (;;) {
    ssize_t n = ::read(fd, buf + have, sizeof buf - 1 - have);
    if (n <= 0) break;
    have += static_cast<size_t>(n);
    buf[have] = 0;
    char *line = buf;
    char *nl;
    while ((nl = strchr(line, '\n'))) {
      *nl = 0;
      if (!strncmp(line, "VmFlags:", 8)) {
        if (hi > lo && !strstr(line, " dc")) fork_copy(lo, hi);
        lo = hi = 0;
      } else if (const char *path = strchr(line, '/');
                 path && !strncmp(path, mine, mine_len) && path[mine_len] == ' ') {
        if (sscanf(line, "%lx-%lx", &lo, &hi) != 2) lo = hi = 0;
      }
      line = nl + 1;
    }
    have = strlen(line);
    memmove(buf, line, have);
  }
  close(fd);
}

void fork_parent() {
  for (size_t i = 0; i < n_fork_copies; ++i)
    kernel::munmap(fork_copies[i].copy, fork_copies[i].len);
  n_fork_copies = 0;
}

void fork_child() {
  own_pid_cache.store(0, std::memory_order_relaxed);
  for (size_t i = 0; i < n_fork_copies; ++i) {
    const ForkCopy &c = fork_copies[i];
    kernel::mremap_fixed(c.copy, c.len, reinterpret_cast<void *>(c.at));
  }
  n_fork_copies = 0;
}

pid_t own_pid() {
  pid_t pid = own_pid_cache.load(std::memory_order_relaxed);
  if (pid == 0) own_pid_cache.store(pid = getpid(), std::memory_order_relaxed);
  return pid;
}

// ---- registration --------------------------------------------------------

namespace {

// Under valgrind a move copies everything through the mapping, as before
// pages were copied through the page cache: valgrind checks every byte pwrite
// writes, and each system call in the move (pagemap too) lengthens the time
// the range stays read-only; another thread's system call that valgrind
// emulates and that stores there then kills valgrind (SIGSEGV in its core).
bool under_valgrind() {
#ifdef RUNNING_ON_VALGRIND
  return RUNNING_ON_VALGRIND;
#else
  return false;
#endif
}

// Copies [src, src + len) to offset `off` of the memfd `fd`, mapped at `map`:
// through the page cache (pwrite), which faults in no page of a mapping one by
// one (a fault is costly on these VMs: through the mapping took 5x longer). The
// raw system call: the range is whole pages, beyond the caller's buffer, which
// a sanitizer's pwrite would take for an overflow.
int copy_pages(int fd, char *map, const char *src, uint64_t len, uint64_t off) {
  if (under_valgrind()) {
    iovec to{map + off, len}, from{const_cast<char *>(src), len};
    if (process_vm_readv(getpid(), &to, 1, &from, 1, 0) == static_cast<ssize_t>(len)) return 0;
    return errno ? errno : EFAULT;
  }
  const uint64_t at = off, bytes = len;
  while (len > 0) {
    const long n = syscall(SYS_pwrite64, fd, src, len, off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return n < 0 ? errno : EIO;
    src += n, len -= static_cast<uint64_t>(n), off += static_cast<uint64_t>(n);
  }
  // Mapped now (~0.1 ms per MiB): registering the same memory again then finds
  // its pages present, the fast check (still_moved), 10 us rather than 12.7.
  (void)madvise(map + at, bytes, MADV_POPULATE_WRITE);
  return 0;
}

}  // namespace

// Copies the pages of [va, va + len) into the memfd `fd` (mapped at `map`).
// With `touched_only` (private anonymous memory), only the pages that hold data
// (present or swapped out): one never touched reads as zeros, which the
// memfd's hole already is, so a fresh buffer (an SDP ring) moves without a
// copy and gets pages only where used. 0 or an errno.
int EmuFabric::copy_into(int fd, char *map, uint64_t va, uint64_t len, bool touched_only) {
  constexpr uint64_t kPresent = uint64_t{1} << 63, kSwapped = uint64_t{1} << 62;
  const int pm = touched_only && !under_valgrind() ? pagemap() : -1;
  if (pm < 0) return copy_pages(fd, map, reinterpret_cast<const char *>(va), len, 0);
  uint64_t entries[512];
  uint64_t run = 0, run_len = 0;  // pages with data not yet written
  for (uint64_t done = 0; done < len;) {
    const size_t n = std::min<uint64_t>(std::size(entries), (len - done) / kPage);
    const auto at = static_cast<off_t>((va + done) / kPage * 8);
    if (pread(pm, entries, n * 8, at) != static_cast<ssize_t>(n * 8)) return errno ? errno : EIO;
    for (size_t i = 0; i < n; ++i) {
      const uint64_t off = done + i * kPage;
      if (entries[i] & (kPresent | kSwapped)) {
        if (run_len == 0) run = off;
        run_len += kPage;
        continue;
      }
      if (run_len == 0) continue;
      if (const int err =
              copy_pages(fd, map, reinterpret_cast<const char *>(va + run), run_len, run))
        return err;
      run_len = 0;
    }
    done += n * kPage;
  }
  return run_len ? copy_pages(fd, map, reinterpret_cast<const char *>(va + run), run_len, run) : 0;
}

int EmuFabric::pagemap() {
  if (pagemap_pid_ != own_pid()) {  // /proc/self at open time: reopen in a child
    if (pagemap_fd_ >= 0) close(pagemap_fd_);
    pagemap_fd_ = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
    pagemap_pid_ = own_pid();
  }
  return pagemap_fd_;
}

int EmuFabric::new_chunk(uint64_t va, uint64_t len, bool anon, uint32_t *idx) {
  if (next_chunk_ >= kMaxChunks) {
    // Reuse a free entry; generations tell old mappings apart.
    uint32_t i = 1;
    while (i < kMaxChunks && hdr_->chunks[i].fd > 0) ++i;
    if (i == kMaxChunks) return ENOMEM;
    *idx = i;
  } else {
    *idx = next_chunk_++;
  }
  char name[32];
  own_chunk_name(name, sizeof name, own_pid());
  int fd = static_cast<int>(syscall(SYS_memfd_create, name, MFD_CLOEXEC));
  if (fd < 0) return errno;
  if (ftruncate(fd, static_cast<off_t>(len))) {
    int e = errno;
    close(fd);
    return e;
  }
  void *tmp = kernel::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (tmp == MAP_FAILED) {
    int e = errno;
    close(fd);
    return e;
  }
  (void)pagemap();  // opened (once per process) before the range goes read-only
  // Copy, then atomically replace the private pages at va with the shared
  // copy; other threads' stores in between wait (move_guard.hpp). Our own
  // chunk's pages are copied whole: a hole there may hold what a peer wrote.
  const int moved = emu::guarded_move(va, len, [&]() -> int {
    if (const int err = copy_into(fd, static_cast<char *>(tmp), va, len, anon); err != 0)
      return err;
    if (kernel::mremap_fixed(tmp, len, reinterpret_cast<void *>(va)) == MAP_FAILED) return errno;
    return 0;
  });
  if (moved != 0) {
    kernel::munmap(tmp, len);
    close(fd);
    return moved;
  }
  ChunkEntry &c = hdr_->chunks[*idx];
  struct stat st {};
  (void)fstat(fd, &st);
  c.fd = fd;
  c.ino = st.st_ino;
  chunk_dev_ = st.st_dev;
  c.size = len;
  c.gen.fetch_add(1, std::memory_order_release);
  return 0;
}

int EmuFabric::expose(void *addr, size_t len, WindowId *out) {
  std::lock_guard<std::mutex> g(reg_mu_);
  uint32_t wi = 0;
  for (uint32_t n = 0; n < kMaxWindows - 1; ++n) {
    uint32_t i = 1 + (next_window_ - 1 + n) % (kMaxWindows - 1);
    if (!(hdr_->windows[i].gen.load(std::memory_order_relaxed) & 0x80000000u)) {
      wi = i;
      break;
    }
  }
  if (!wi) return ENOMEM;
  next_window_ = wi + 1;
  WindowEntry &w = hdr_->windows[wi];
  uint64_t a = reinterpret_cast<uint64_t>(addr) & ~(kPage - 1);
  uint64_t b = (reinterpret_cast<uint64_t>(addr) + len + kPage - 1) & ~(kPage - 1);

  // Walk [a, b): reuse moved regions whose pages are still there, move the
  // gaps. Only a gap needs the (slow) look at /proc/self/maps.
  std::vector<Extent> ext;
  std::vector<uint64_t> taken;
  bool mapped = len > 0;
  uint64_t at = a;
  while (at < b && mapped) {
    auto it = regions_.upper_bound(at);
    if (it != regions_.begin() && std::prev(it)->first + std::prev(it)->second.len > at) --it;
    if (it != regions_.end() && it->first <= at) {
      Region &r = it->second;
      uint64_t end = std::min(b, it->first + r.len);
      if (!still_moved(it->first, r, at, end)) {
        // Unmapped and mapped anew since it was moved: a cached region is
        // stale; one that a registration still uses stays for it (the
        // new registration gets a copy window).
        if (r.refs == 0) {
          drop_region(it);
          continue;
        }
        mapped = false;
        break;
      }
      if (r.refs++ == 0) cached_bytes_ -= r.len;
      taken.push_back(it->first);
      ext.push_back({at, end - at, at - it->first, r.chunk, hdr_->chunks[r.chunk].gen.load()});
      at = end;
      continue;
    }
    uint64_t next = it != regions_.end() ? std::min(b, it->first) : b;
    uint32_t ci;
    bool anon = false;
    if (!remappable(at, next, &anon) || new_chunk(at, next - at, anon, &ci) != 0) {
      mapped = false;
      break;
    }
    regions_[at] = Region{next - at, ci, 1, 0};
    taken.push_back(at);
    ext.push_back({at, next - at, 0, ci, hdr_->chunks[ci].gen.load()});
    at = next;
  }
  if (ext.size() > kMaxExtents) mapped = false;
  if (!mapped) {
    for (uint64_t r : taken) put_region(r);
    ext.clear();
  }
  uint32_t gen = w.gen.load(std::memory_order_relaxed);
  uint32_t next_gen = ((gen + 1) & 0x7fffffffu) | 0x80000000u;
  w.mode = mapped ? kMapped : kCopy;
  w.n_extents = static_cast<uint32_t>(ext.size());
  std::copy(ext.begin(), ext.end(), w.ext);
  w.gen.store(next_gen, std::memory_order_release);
  *out = WindowId{wi, next_gen};
  return 0;
}

void EmuFabric::put_region(uint64_t va) {
  auto it = regions_.find(va);
  if (it == regions_.end() || --it->second.refs) return;
  // The pages stay mapped here: they are the application's memory. The chunk
  // stays too, for the next registration of the same memory.
  it->second.last_used = ++use_clock_;
  cached_bytes_ += it->second.len;
  trim_cache();
}

void EmuFabric::drop_region(std::map<uint64_t, Region>::iterator it) {
  if (it->second.refs == 0) cached_bytes_ -= it->second.len;
  ChunkEntry &c = hdr_->chunks[it->second.chunk];
  c.gen.fetch_add(1, std::memory_order_release);
  close(c.fd);
  c.fd = 0;
  regions_.erase(it);
}

void EmuFabric::trim_cache() {
  while (cached_bytes_ > cache_limit_) {
    auto oldest = regions_.end();
    for (auto it = regions_.begin(); it != regions_.end(); ++it)
      if (it->second.refs == 0 &&
          (oldest == regions_.end() || it->second.last_used < oldest->second.last_used))
        oldest = it;
    if (oldest == regions_.end()) return;
    drop_region(oldest);
  }
}

namespace {

enum class Said { kNo, kYes, kNotAllowed };

// Whether [start, end) is exactly one mapping of the file (dev, ino), by one stat of its
// /proc/self/map_files entry: kNotAllowed without the privilege that needs
// (CAP_CHECKPOINT_RESTORE, or root), which is not asked for again once refused.
Said map_files_says(uint64_t start, uint64_t end, dev_t dev, ino_t ino) {
  static std::atomic<bool> refused{false};
  if (refused.load(std::memory_order_relaxed)) return Said::kNotAllowed;
  char path[80];
  snprintf(path, sizeof path, "/proc/self/map_files/%lx-%lx", static_cast<unsigned long>(start),
           static_cast<unsigned long>(end));
  struct stat st {};
  if (stat(path, &st) == 0) return st.st_dev == dev && st.st_ino == ino ? Said::kYes : Said::kNo;
  if (errno != EPERM && errno != EACCES) return Said::kNo;
  refused.store(true, std::memory_order_relaxed);
  return Said::kNotAllowed;
}

// The same question, answered from the mapping's line of /proc/self/maps where map_files is
// not allowed.
bool maps_exactly(uint64_t start, uint64_t end, dev_t dev, ino_t ino) {
  if (const Said said = map_files_says(start, end, dev, ino); said != Said::kNotAllowed)
    return said == Said::kYes;
  FILE *f = fopen("/proc/self/maps", "re");
  if (!f) return false;
  char line[512];
  bool same = false;
  while (fgets(line, sizeof line, f)) {
    unsigned long lo = 0, hi = 0;
    unsigned major = 0, minor = 0;
    unsigned long long inode = 0;
    if (sscanf(line, "%lx-%lx %*s %*s %x:%x %llu", &lo, &hi, &major, &minor, &inode) != 5 ||
        lo != start)
      continue;
    same = hi == end && makedev(major, minor) == dev && inode == ino;
    break;
  }
  fclose(f);
  return same;
}

}  // namespace

// Whether [a, b) of the region at `start` is still the chunk's memory a
// registration moved there, not memory mapped anew. The proof: the region is
// still exactly one mapping of the chunk's memfd (one stat of its map_files
// entry, ~4.5 us here, where allowed); from 512 KiB on that alone decides
// (its "no" also catches shared memory mapped anew there, which pagemap
// cannot tell from the chunk's). Below (the pagemap costs ~5.5 us a MiB, the
// stat more than that of 4 KiB): every page present and shared (pagemap gives
// these flags to unprivileged processes, frame numbers only to the admin);
// where pages are not present (holes of the memfd: moved untouched, or never
// used since) the mapping is looked at after all.
bool EmuFabric::still_moved(uint64_t start, const Region &r, uint64_t a, uint64_t b) {
  constexpr uint64_t kPresent = uint64_t{1} << 63, kShared = uint64_t{1} << 61;
  constexpr uint64_t kStatFirst = 512 << 10;
  if (b - a >= kStatFirst) {
    const Said said = map_files_says(start, start + r.len, chunk_dev_, hdr_->chunks[r.chunk].ino);
    if (said != Said::kNotAllowed) return said == Said::kYes;
  }
  const int pm = pagemap();
  if (pm < 0) return false;
  uint64_t entries[512];
  bool holes = false;
  for (uint64_t page = a / kPage; page < b / kPage;) {
    size_t n = std::min<uint64_t>(std::size(entries), b / kPage - page);
    ssize_t got = pread(pm, entries, n * 8, static_cast<off_t>(page * 8));
    if (got != static_cast<ssize_t>(n * 8)) return false;
    for (size_t i = 0; i < n; ++i) {
      if ((entries[i] & (kPresent | kShared)) == (kPresent | kShared)) continue;
      if (entries[i] & kPresent) return false;  // a private page: mapped anew
      holes = true;
    }
    page += n;
  }
  return !holes || maps_exactly(start, start + r.len, chunk_dev_, hdr_->chunks[r.chunk].ino);
}

void EmuFabric::unexpose(WindowId id) {
  if (id.index == 0 || id.index >= kMaxWindows) return;
  {
    std::lock_guard<std::mutex> g(reg_mu_);
    WindowEntry &w = hdr_->windows[id.index];
    if (w.gen.load(std::memory_order_relaxed) != id.gen) return;
    w.gen.store((id.gen + 1) & 0x7fffffffu, std::memory_order_seq_cst);
    if (w.mode == kMapped)
      for (uint32_t i = 0; i < w.n_extents; ++i) put_region(w.ext[i].va - w.ext[i].chunk_off);
    w.n_extents = 0;
  }
  wait_for_movers(id);
}

// A mover names the window in its lane, then loads the window's generation;
// we retired the window, then load the lanes (all seq_cst): either the mover
// sees the window retired, or we see its lane and wait for the move to end.
// Lanes are looked at up to the highest LID yet, which a node raised when it
// joined, before it could move (seq_cst too: a mover we do not reach sees the
// window retired).
// Not waited for: a mover that died or left the fabric (or whose lane a dead
// holder of its LID left), or one holding its lane for more than 10 s (a
// stopped process; logged).
void EmuFabric::wait_for_movers(WindowId id) {
  constexpr uint64_t kMaxWaitNs = 10'000'000'000;
  const uint64_t key = uint64_t{id.gen} << 32 | id.index;
  uint64_t deadline = 0;
  const uint32_t high = std::min(table_->high_lid.load(), kMaxNodes);
  for (uint32_t mover = 1; mover <= high; ++mover) {
    const MoverLanes &m = hdr_->movers[mover];
    for (const auto &lane : m.lane) {
      while (lane.load(std::memory_order_seq_cst) == key) {
        const uint64_t now = mono_ns();
        if (!deadline) deadline = now + kMaxWaitNs;
        const NodeSlot &slot = table_->slots[mover - 1];
        if (mover != lid_ &&
            (m.nonce.load(std::memory_order_acquire) != slot.nonce || !slot_alive(slot)))
          break;
        if (now > deadline) {
          fprintf(stderr,
                  "pcientb: node %u still moves bytes of a deregistered window after 10 s\n",
                  mover);
          return;
        }
        usleep(20);
      }
    }
  }
}

}  // namespace pcientb::fabric::emu
