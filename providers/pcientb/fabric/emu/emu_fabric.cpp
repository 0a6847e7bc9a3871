// The emulated NTB fabric: nodes are processes of one user on one machine.
//
// - The fabric table (/dev/shm/pcientb.<uid>.<name>, mode 0600) maps LIDs to
//   processes. Joining and leaving hold flock() on it, which a dying process
//   gives back by itself. The last node to leave removes it; a join removes
//   the tables of this user whose nodes all died (killed, nobody left).
// - A node's segment is a memfd; peers take a copy of the descriptor with
//   pidfd_getfd() and map it. It dies with the last mapping: nothing to clean.
// - Liveness: a word in the segment holds the thread id of the node's life
//   thread and is on that thread's robust futex list, so the kernel itself
//   marks it (FUTEX_OWNER_DIED) as the process dies, before its memory goes.
//   A peer checks it with one load after every transfer: a transfer that
//   finds it intact landed in a live node. A node that leaves clears it.
// - A window (registered memory) is made of memfd chunks: registration moves
//   the pages of the range, contents kept, onto a memfd mapped at the same
//   address, so a peer maps the same pages and moves bytes with plain loads
//   and stores, as through an NT window. Memory that cannot be moved (shared
//   file mappings, read-only) is reached with process_vm_readv/writev.
// - Moving costs a page allocation and a copy per page, so a chunk outlives
//   its last registration (the registration cache): registering the same
//   memory again reuses it once /proc/self/pagemap shows the pages are still
//   the shared ones moved there. Unreferenced chunks are bounded by
//   $PCIENTB_MR_CACHE bytes (default 256 MiB; 0 disables the cache).
#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <pthread.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <dirent.h>
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "bulk_copy.hpp"
#include "fabric/emu/kernel_vm.hpp"
#include "fabric/emu/move_guard.hpp"
#include "fabric/fabric.hpp"

namespace pcientb::fabric {
namespace {

uint64_t emu_node_guid() {
  // Vendor 0x10b5 (PLX/Broadcom), part 0x8749, then the process: unique per node.
  return (uint64_t{0x0010b5} << 40) | (uint64_t{0x8749} << 24) |
         (static_cast<uint64_t>(getpid()) & 0xffffff);
}

constexpr uint64_t kTableMagic = 0x70636e7462746231ULL;  // "pcntbtb1"
constexpr uint64_t kSegMagic = 0x70636e7462736731ULL;    // "pcntbsg1"
constexpr uint32_t kMaxNodes = 1024;
constexpr uint32_t kMaxWindows = 16384;
constexpr uint32_t kMaxChunks = 16384;
constexpr uint32_t kMaxExtents = 8;
constexpr size_t kAreaSize = size_t{2} << 30;  // sparse: only touched pages cost memory
constexpr size_t kPage = 4096;
constexpr uint64_t kDefaultMrCache = uint64_t{256} << 20;

struct NodeSlot {
  int32_t pid;
  int32_t seg_fd;
  uint64_t start_time;  // tells a live owner from a recycled pid
  uint64_t seg_ino;
  uint64_t nonce;
  uint64_t seg_size;
};

struct TableFile {
  uint64_t magic;
  uint32_t max_nodes;
  uint32_t layout;  // fabric_layout() of the nodes' build; 0 in tables of older builds
  NodeSlot slots[kMaxNodes];
};

enum WindowMode : uint32_t { kMapped = 0, kCopy = 1 };

struct Extent {
  uint64_t va;
  uint64_t len;
  uint64_t chunk_off;
  uint32_t chunk;
  uint32_t chunk_gen;
};
static_assert(sizeof(Extent) == 32);

struct WindowEntry {
  std::atomic<uint32_t> gen;  // odd while being written
  uint32_t mode;
  uint32_t n_extents;
  uint32_t pad;
  Extent ext[kMaxExtents];
};

struct ChunkEntry {
  std::atomic<uint32_t> gen;
  int32_t fd;
  uint64_t ino;
  uint64_t size;
};

struct SegHeader {
  uint64_t magic;
  uint64_t nonce;
  int32_t pid;
  uint32_t pad;
  // The robust-list entry of the life thread; the kernel finds the word at
  // entry + (offsetof(life) - offsetof(life_entry)).
  robust_list life_entry;
  std::atomic<uint32_t> life;  // the life thread's tid while the node lives
  uint32_t pad3;
  // The node's doorbell mask, as an NT port's: peers need not ring before
  // this time (CLOCK_MONOTONIC ns) because a thread of the node polls.
  std::atomic<uint64_t> quiet_until;
  int32_t bell_fd;   // the node doorbell: a pipe's write end, of the owner
  int32_t bell_rfd;  // its read end
  uint64_t bell_ino;
  WindowEntry windows[kMaxWindows];
  ChunkEntry chunks[kMaxChunks];
};
constexpr size_t kHeaderSize = (sizeof(SegHeader) + kPage - 1) & ~(kPage - 1);

// The engine's layout mixed with this backend's own (FNV-1a over the sizes peers rely on).
uint32_t fabric_layout(uint32_t engine) {
  const uint64_t parts[] = {engine,           sizeof(TableFile),
                            sizeof(NodeSlot), sizeof(SegHeader),
                            kMaxWindows,      kMaxExtents,
                            kMaxChunks,       sizeof(WindowEntry),
                            kAreaSize,        offsetof(SegHeader, life)};
  uint32_t h = 2166136261u;
  for (uint64_t p : parts)
    for (int i = 0; i < 8; ++i) h = (h ^ uint8_t(p >> (8 * i))) * 16777619u;
  return h ? h : 1;  // 0 is "unknown" (an older build's table)
}
constexpr size_t kSegSize = kHeaderSize + kAreaSize;
constexpr uint64_t kQuietNs = 1000000;  // how long a poll masks the doorbell

// PCIENTB_NTB_STRICT=1: peers are rung whatever their mask, which only an
// NT port's receiving side would apply: no load from a peer's memory is left.
bool strict_from_env() {
  const char *e = getenv("PCIENTB_NTB_STRICT");
  return e && *e && strcmp(e, "0") != 0;
}

// Work counts, per thread (no locked instruction on the data path), summed
// when asked; a thread's slot outlives it.
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
// Never destroyed: threads may count while the process exits, and a leak
// checker sees the slots reachable.
std::mutex &work_mu = *new std::mutex;
std::vector<WorkSlot *> &work_slots = *new std::vector<WorkSlot *>;

// One operation of kind k (kPosts, kDoorbells, kDmaWrites, kDmaReads,
// kRemoteReads) and, for those with bytes, its bytes (the kind after it).
inline void count(WorkKind k, uint64_t bytes = 0) {
  static thread_local WorkSlot *slot __attribute__((tls_model("initial-exec"))) = nullptr;
  if (__builtin_expect(!slot, 0)) {
    slot = new WorkSlot;
    std::lock_guard<std::mutex> g(work_mu);
    work_slots.push_back(slot);
  }
  auto add = [](std::atomic<uint64_t> &v, uint64_t n) {
    v.store(v.load(std::memory_order_relaxed) + n, std::memory_order_relaxed);
  };
  add(slot->v[k], 1);
  if (k == kPosts || k == kDmaWrites || k == kDmaReads) add(slot->v[k + 1], bytes);
}

Work work_done() {
  uint64_t v[kWorkKinds] = {};
  std::lock_guard<std::mutex> g(work_mu);
  for (const WorkSlot *s : work_slots)
    for (int k = 0; k < kWorkKinds; ++k) v[k] += s->v[k].load(std::memory_order_relaxed);
  return Work{v[kPosts],         v[kPostBytes], v[kDoorbells],    v[kDmaWrites],
              v[kDmaWriteBytes], v[kDmaReads],  v[kDmaReadBytes], v[kRemoteReads]};
}

uint64_t mono_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000u + uint64_t(ts.tv_nsec);
}

// -1 where the kernel (or valgrind, which does not know the call) has no
// pidfds: the node then learns of a peer's death from its life word alone.
int sys_pidfd_open(pid_t pid) {
  return static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
}

// A copy of the peer's descriptor `fd`; without pidfd_getfd, opened anew
// through /proc (same file, same rights check: ptrace access to the peer).
int peer_fd(pid_t pid, int pidfd, int fd, int flags) {
  if (pidfd >= 0) {
    int got = static_cast<int>(syscall(SYS_pidfd_getfd, pidfd, fd, 0));
    if (got >= 0 || errno != ENOSYS) return got;
  }
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/fd/%d", static_cast<int>(pid), fd);
  return open(path, flags | O_CLOEXEC);
}

uint64_t process_start_time(pid_t pid) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/stat", pid);
  FILE *f = fopen(path, "re");
  if (!f) return 0;
  char buf[1024];
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = 0;
  // Field 22; the command name (field 2) may hold spaces, so count after ')'.
  const char *p = strrchr(buf, ')');
  if (!p) return 0;
  int field = 2;
  for (; *p && field < 22; ++p)
    if (*p == ' ') ++field;
  return strtoull(p, nullptr, 10);
}

bool slot_alive(const NodeSlot &s) {
  return s.pid > 0 && s.start_time != 0 && process_start_time(s.pid) == s.start_time;
}

uint64_t random_nonce() {
  uint64_t v = 0;
  int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    if (::read(fd, &v, sizeof v) != sizeof v) v = 0;
    close(fd);
  }
  return v ^ (uint64_t(getpid()) << 32) ^ uint64_t(time(nullptr));
}

uint64_t fd_ino(int fd) {
  struct stat st {};
  return fstat(fd, &st) == 0 ? st.st_ino : 0;
}

// The memfd name of this process's moved memory: its peers' windows, which
// it maps too, carry their owners' pids.
void own_chunk_name(char *out, size_t n, pid_t pid) {
  snprintf(out, n, "pcientb-mr-%d", pid);
}

// The bytes of an RDMA WRITE land once each, the last ones last, as an HCA's
// DMA writes them: programs poll the last byte of a buffer for the arrival of
// the whole (riostream, rsockets' riowrite). glibc's memcpy stores some bytes
// twice (all 64 of a 64-byte copy), so a target that saw the last byte and
// wrote it at once (a ping-pong marker) could see its own store undone.
constexpr size_t kLastBytes = 8;

void ordered_copy(void *dst, const void *src, size_t n) {
  auto *d = static_cast<uint8_t *>(dst);
  const auto *s = static_cast<const uint8_t *>(src);
  if (n < kLastBytes) {
    for (size_t i = 0; i < n; ++i) reinterpret_cast<volatile uint8_t *>(d)[i] = s[i];
    return;
  }
  const size_t head = n - kLastBytes;
  bulk_copy(d, s, head);
  std::atomic_thread_fence(std::memory_order_release);  // x86 keeps stores in order
  // One 8-byte store (x86 takes it unaligned): each of the last bytes written once.
  using Unaligned64 = uint64_t __attribute__((aligned(1), may_alias));
  uint64_t last;
  memcpy(&last, s + head, sizeof last);
  *reinterpret_cast<volatile Unaligned64 *>(d + head) = last;
}

// Whether every page of [a, b) may move onto a memfd: private anonymous
// read-write memory, or our own earlier chunks.
bool remappable(uint64_t a, uint64_t b) {
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
    own_chunk_name(mine + 7, sizeof mine - 7, getpid());
    bool ours = strncmp(path, mine, strlen(mine)) == 0 && path[strlen(mine)] == ' ';
    bool rw = perms[0] == 'r' && perms[1] == 'w';
    if (!rw || !((anon && perms[3] == 'p') || (ours && perms[3] == 's'))) ok = false;
    if (!strncmp(path, "[vsyscall]", 10) || !strncmp(path, "[vvar]", 6)) ok = false;
    covered = hi;
  }
  fclose(f);
  return ok && covered >= b;
}

std::string table_prefix() {
  return "pcientb." + std::to_string(getuid()) + ".";
}

// Whether no node of the table lives (all slots empty or dead).
bool table_deserted(const TableFile &t) {
  if (t.magic != kTableMagic) return false;
  for (const NodeSlot &s : t.slots)
    if (s.pid != 0 && slot_alive(s)) return false;
  return true;
}

// Removes the table at `path` if it is still the file open as `fd` (locked
// by the caller): a joiner that opened it before takes the inode change as
// "try again".
void unlink_if_same(const std::string &path, int fd) {
  struct stat named {
  }, held{};
  if (stat(path.c_str(), &named) == 0 && fstat(fd, &held) == 0 && named.st_ino == held.st_ino)
    unlink(path.c_str());
}

// Tables of this user's fabrics whose nodes were all killed: nobody is left to
// remove them, so whoever joins next does. A table in use is locked only for
// a moment by a joiner; it is skipped then.
void sweep_deserted_tables(const std::string &keep) {
  DIR *d = opendir("/dev/shm");
  if (!d) return;
  const std::string prefix = table_prefix();
  while (dirent *e = readdir(d)) {
    if (strncmp(e->d_name, prefix.c_str(), prefix.size()) != 0) continue;
    std::string path = std::string("/dev/shm/") + e->d_name;
    if (path == keep) continue;
    int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) continue;
    struct stat st {};
    auto *t = static_cast<TableFile *>(malloc(sizeof(TableFile)));
    if (t && fstat(fd, &st) == 0 && st.st_uid == getuid() &&
        static_cast<size_t>(st.st_size) >= sizeof(TableFile) && flock(fd, LOCK_EX | LOCK_NB) == 0) {
      if (pread(fd, t, sizeof *t, 0) == static_cast<ssize_t>(sizeof *t) && table_deserted(*t))
        unlink_if_same(path, fd);
      flock(fd, LOCK_UN);
    }
    free(t);
    close(fd);
  }
  closedir(d);
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

void fork_prepare() {
  n_fork_copies = 0;
  char mine[64] = "/memfd:";
  own_chunk_name(mine + 7, sizeof mine - 7, getpid());
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
  for (size_t i = 0; i < n_fork_copies; ++i) {
    const ForkCopy &c = fork_copies[i];
    kernel::mremap_fixed(c.copy, c.len, reinterpret_cast<void *>(c.at));
  }
  n_fork_copies = 0;
}

class EmuFabric;

// A range of this process's memory moved onto a chunk, owner side only.
struct Region {
  uint64_t len;
  uint32_t chunk;
  uint32_t refs;       // windows using it; 0: cached
  uint64_t last_used;  // for evicting the oldest cached region
};

class EmuPeer final : public Peer {
 public:
  explicit EmuPeer(uint16_t lid) { lid_ = lid; }
  ~EmuPeer() override;

  int attach(const NodeSlot &slot);
  void attach_self(SegHeader *hdr, uint64_t nonce);
  // Local address of a peer's window range, nullptr if it is not mapped.
  uint8_t *translate(const WindowEntry &w, uint64_t raddr, size_t len, size_t *run);
  int doorbell_fd(int fd, uint64_t ino);
  // The write end of the peer's node doorbell, -1 if it cannot be had.
  int bell();

  // The engine area of the peer's segment, mapped here: only post() writes it.
  void *area() const { return area_; }

  bool self = false;
  pid_t pid = 0;
  int pidfd = -1;
  SegHeader *hdr = nullptr;
  void *area_ = nullptr;
  uint64_t seg_size = 0;

 private:
  struct Mapping {
    uint32_t gen;
    uint8_t *base;
    uint64_t size;
  };
  const Mapping *chunk_mapping(uint32_t idx, uint32_t gen);

  std::mutex mu_;
  std::unique_ptr<std::atomic<const Mapping *>[]> cache_;
  std::vector<std::unique_ptr<Mapping>> mappings_;  // kept mapped until the peer goes
  std::map<std::pair<int, uint64_t>, int> doorbells_;
  // The peer's doorbell pipe, both ends: holding a reader, a write never
  // raises SIGPIPE when the peer has gone.
  std::atomic<int> bell_w_{-1};
  int bell_r_ = -1;
};

class EmuFabric final : public Fabric {
 public:
  ~EmuFabric() override;
  int join(const char *name, uint32_t layout);

  uint16_t lid() const override { return lid_; }
  uint64_t nonce() const override { return nonce_; }
  uint64_t node_guid() const override { return emu_node_guid(); }
  const char *name() const override { return name_.c_str(); }
  void *area() override { return reinterpret_cast<uint8_t *>(hdr_) + kHeaderSize; }
  size_t area_size() const override { return kAreaSize; }
  void discard(size_t off, size_t len) override {
    fallocate(seg_fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
              static_cast<off_t>(kHeaderSize + off), static_cast<off_t>(len));
  }

  bool member() override;
  Peer *peer(uint16_t lid) override;
  bool check_alive(Peer &p) override;
  int death_fd(Peer &p) override { return static_cast<EmuPeer &>(p).pidfd; }

  int expose(void *addr, size_t len, WindowId *out) override;
  void unexpose(WindowId id) override;
  MoveStatus write(Peer &p, WindowId w, uint64_t raddr, const void *src, size_t len) override;
  MoveStatus read(Peer &p, WindowId w, uint64_t raddr, void *dst, size_t len) override;
  int ring(Peer &p, int fd, uint64_t ino, const void *rec, size_t len) override;
  int post(Peer &p, size_t off, const void *src, size_t len) override;
  void doorbell(Peer &p, bool maskable) override;
  void polling() override {
    if (!strict_) hdr_->quiet_until.store(mono_ns() + kQuietNs, std::memory_order_relaxed);
  }
  uint64_t quiet_until_ns() override { return hdr_->quiet_until.load(std::memory_order_relaxed); }
  void not_polling() override {
    hdr_->quiet_until.store(0, std::memory_order_relaxed);
    // Pairs with a ringer's fence: it sees no mask, or this node's next look
    // at its lanes sees what it posted.
    std::atomic_thread_fence(std::memory_order_seq_cst);
  }
  Work work() const override { return work_done(); }
  int doorbell_fd() override { return bell_rfd_; }
  void clear_doorbell() override {
    char v[64];
    while (syscall(SYS_read, bell_rfd_, v, sizeof v) > 0) {
    }
  }

 private:
  template <typename Fn>
  MoveStatus move(EmuPeer &p, WindowId w, uint64_t raddr, size_t len, Fn &&fn);
  MoveStatus copy_move(EmuPeer &p, uint64_t raddr, void *local, size_t len, bool to_peer);
  const WindowEntry *window(EmuPeer &p, WindowId w, uint32_t *gen);
  int new_chunk(uint64_t va, uint64_t len, uint32_t *idx);
  void put_region(uint64_t va);
  void drop_region(std::map<uint64_t, Region>::iterator it);
  void trim_cache();
  bool still_moved(uint64_t a, uint64_t b);

  int start_life();
  void end_life();

  std::string name_;
  std::string path_;
  const bool strict_ = strict_from_env();
  std::thread life_;
  std::atomic<uint32_t> life_stop_{0};  // futex word the life thread sleeps on
  int table_fd_ = -1;
  TableFile *table_ = nullptr;
  int seg_fd_ = -1;
  // A pipe, not an eventfd: a peer without pidfd_getfd (valgrind) opens the
  // write end through /proc, which an anonymous inode refuses.
  int bell_rfd_ = -1, bell_fd_ = -1;
  SegHeader *hdr_ = nullptr;
  uint16_t lid_ = 0;
  uint64_t nonce_ = 0;

  std::mutex peers_mu_;
  std::unique_ptr<EmuPeer> peers_[kMaxNodes + 1];
  std::vector<std::unique_ptr<EmuPeer>> retired_;  // dead peers' mappings, kept until we go

  // Registration state, owner side only.
  std::mutex reg_mu_;
  std::map<uint64_t, Region> regions_;  // moved ranges by start address, disjoint
  uint64_t cached_bytes_ = 0;           // of regions no registration uses
  uint64_t cache_limit_ = kDefaultMrCache;
  uint64_t use_clock_ = 0;
  int pagemap_fd_ = -1;
  pid_t pagemap_pid_ = 0;
  uint32_t next_window_ = 1;
  uint32_t next_chunk_ = 1;
};

// ---- joining and leaving -------------------------------------------------

struct TableLock {
  explicit TableLock(int fd) : fd_(fd) { flock(fd_, LOCK_EX); }
  TableLock(int fd, std::adopt_lock_t) : fd_(fd) {}
  ~TableLock() { flock(fd_, LOCK_UN); }
  int fd_;
};

int EmuFabric::join(const char *name, uint32_t layout) {
  name_ = name;
  for (char c : name_)
    if (c == '/' || c == '\0') return EINVAL;
  if (name_.empty() || name_.size() > 64) return EINVAL;
  // Peers reach our memory with pidfd_getfd/process_vm_*: allow them under Yama.
  prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
  if (const char *c = getenv("PCIENTB_MR_CACHE"); c && *c) {
    char *end = nullptr;
    cache_limit_ = strtoull(c, &end, 0);
    if (*end) {
      fprintf(stderr, "pcientb: PCIENTB_MR_CACHE=%s is not a number of bytes\n", c);
      return EINVAL;
    }
  }
  static std::once_flag fork_handler;
  std::call_once(fork_handler, [] { pthread_atfork(fork_prepare, fork_parent, fork_child); });

  path_ = "/dev/shm/" + table_prefix() + name_;
  const std::string &path = path_;
  sweep_deserted_tables(path);
  struct stat st {};
  for (;;) {
    table_fd_ = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (table_fd_ < 0) return errno;
    if (fstat(table_fd_, &st) || st.st_uid != getuid() || (st.st_mode & 077)) {
      fprintf(stderr, "pcientb: %s is not private to this user; refusing it\n", path.c_str());
      return EACCES;
    }
    flock(table_fd_, LOCK_EX);
    // The last node may have removed the table between our open and our lock.
    struct stat named {};
    if (stat(path.c_str(), &named) == 0 && named.st_ino == st.st_ino) break;
    close(table_fd_);  // gives the lock back
    table_fd_ = -1;
  }
  TableLock lock(table_fd_, std::adopt_lock);
  if (fstat(table_fd_, &st)) return errno;
  if (static_cast<size_t>(st.st_size) < sizeof(TableFile) &&
      ftruncate(table_fd_, sizeof(TableFile)))
    return errno;
  void *t =
      kernel::mmap(nullptr, sizeof(TableFile), PROT_READ | PROT_WRITE, MAP_SHARED, table_fd_, 0);
  if (t == MAP_FAILED) return errno;
  table_ = static_cast<TableFile *>(t);
  const uint32_t mine = fabric_layout(layout);
  if (table_->magic == kTableMagic && table_->layout != mine && !table_deserted(*table_)) {
    fprintf(stderr,
            "pcientb: fabric '%s' is in use by processes with another build of the pcientb "
            "provider (layout %08x, this one %08x); a fabric's processes must all use one "
            "build: use another fabric (PCIENTB_FABRIC, --fabric) or the same provider\n",
            name_.c_str(), table_->layout, mine);
    return EPROTO;
  }
  if (table_->magic != kTableMagic || table_->layout != mine) {
    memset(table_, 0, sizeof *table_);
    table_->max_nodes = kMaxNodes;
    table_->layout = mine;
    table_->magic = kTableMagic;
  }

  seg_fd_ = static_cast<int>(syscall(SYS_memfd_create, "pcientb-node", MFD_CLOEXEC));
  if (seg_fd_ < 0) return errno;
  if (ftruncate(seg_fd_, static_cast<off_t>(kSegSize))) return errno;
  void *s = kernel::mmap(nullptr, kSegSize, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE,
                         seg_fd_, 0);
  if (s == MAP_FAILED) return errno;
  hdr_ = static_cast<SegHeader *>(s);
  nonce_ = random_nonce();
  hdr_->magic = kSegMagic;
  hdr_->nonce = nonce_;
  hdr_->pid = getpid();
  int bell[2];
  if (pipe2(bell, O_CLOEXEC | O_NONBLOCK)) return errno;
  bell_rfd_ = bell[0];
  bell_fd_ = bell[1];
  hdr_->bell_fd = bell_fd_;
  hdr_->bell_rfd = bell_rfd_;
  hdr_->bell_ino = fd_ino(bell_fd_);
  if (int e = start_life()) return e;

  for (uint32_t i = 0; i < kMaxNodes; ++i) {
    NodeSlot &slot = table_->slots[i];
    if (slot.pid != 0 && slot_alive(slot)) continue;
    slot.pid = getpid();
    slot.seg_fd = seg_fd_;
    slot.start_time = process_start_time(getpid());
    slot.seg_ino = fd_ino(seg_fd_);
    slot.nonce = nonce_;
    slot.seg_size = kSegSize;
    lid_ = static_cast<uint16_t>(i + 1);
    return 0;
  }
  return ENOSPC;
}

EmuFabric::~EmuFabric() {
  if (table_ && lid_) {
    TableLock lock(table_fd_);
    NodeSlot &slot = table_->slots[lid_ - 1];
    if (slot.nonce == nonce_) memset(&slot, 0, sizeof slot);
    if (table_deserted(*table_)) unlink_if_same(path_, table_fd_);
  }
  end_life();
  for (auto &p : peers_) p.reset();
  retired_.clear();
  {
    std::lock_guard<std::mutex> g(reg_mu_);
    for (uint32_t i = 1; i < next_chunk_ && hdr_; ++i)
      if (hdr_->chunks[i].fd > 0) close(hdr_->chunks[i].fd);
  }
  if (pagemap_fd_ >= 0) close(pagemap_fd_);
  if (hdr_) kernel::munmap(hdr_, kSegSize);
  if (seg_fd_ >= 0) close(seg_fd_);
  if (bell_fd_ >= 0) close(bell_fd_);
  if (bell_rfd_ >= 0) close(bell_rfd_);
  if (table_) kernel::munmap(table_, sizeof(TableFile));
  if (table_fd_ >= 0) close(table_fd_);
}

// ---- peers ---------------------------------------------------------------

EmuPeer::~EmuPeer() {
  for (auto &[key, fd] : doorbells_) close(fd);
  if (bell_w_ >= 0) close(bell_w_);
  if (bell_r_ >= 0) close(bell_r_);
  for (auto &m : mappings_) kernel::munmap(m->base, m->size);
  if (!self && hdr) kernel::munmap(hdr, seg_size);
  if (pidfd >= 0) close(pidfd);
}

void EmuPeer::attach_self(SegHeader *h, uint64_t nonce) {
  self = true;
  pid = getpid();
  hdr = h;
  nonce_ = nonce;
  area_ = reinterpret_cast<uint8_t *>(h) + kHeaderSize;
  pidfd = sys_pidfd_open(pid);
}

int EmuPeer::attach(const NodeSlot &slot) {
  pid = slot.pid;
  pidfd = sys_pidfd_open(pid);
  if (pidfd < 0 && errno != ENOSYS) return errno;
  // The slot may belong to a process that exited and whose pid was reused.
  if (!slot_alive(slot)) return ESRCH;
  int fd = peer_fd(pid, pidfd, slot.seg_fd, O_RDWR);
  if (fd < 0) return errno == ESRCH ? ESRCH : errno;
  if (fd_ino(fd) != slot.seg_ino) {
    close(fd);
    return ESRCH;
  }
  void *m = kernel::mmap(nullptr, slot.seg_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE,
                         fd, 0);
  close(fd);
  if (m == MAP_FAILED) return errno;
  hdr = static_cast<SegHeader *>(m);
  seg_size = slot.seg_size;
  if (hdr->magic != kSegMagic || hdr->nonce != slot.nonce) return ESRCH;
  uint32_t life = hdr->life.load(std::memory_order_acquire);
  if (life == 0 || (life & FUTEX_OWNER_DIED)) return ESRCH;
  life_ = &hdr->life;  // Peer::live() compares it with the value it has now
  life_value_ = life;
  nonce_ = slot.nonce;
  area_ = reinterpret_cast<uint8_t *>(m) + kHeaderSize;
  cache_ = std::make_unique<std::atomic<const Mapping *>[]>(kMaxChunks);
  return 0;
}

const EmuPeer::Mapping *EmuPeer::chunk_mapping(uint32_t idx, uint32_t gen) {
  if (idx == 0 || idx >= kMaxChunks) return nullptr;
  const Mapping *m = cache_[idx].load(std::memory_order_acquire);
  if (m && m->gen == gen) return m;
  std::lock_guard<std::mutex> g(mu_);
  m = cache_[idx].load(std::memory_order_acquire);
  if (m && m->gen == gen) return m;
  const ChunkEntry &c = hdr->chunks[idx];
  if (c.gen.load(std::memory_order_acquire) != gen) return nullptr;
  int32_t cfd = c.fd;
  uint64_t ino = c.ino, size = c.size;
  int fd = peer_fd(pid, pidfd, cfd, O_RDWR);
  if (fd < 0) return nullptr;
  if (fd_ino(fd) != ino || c.gen.load(std::memory_order_acquire) != gen) {
    close(fd);
    return nullptr;
  }
  void *base = kernel::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) return nullptr;
  mappings_.push_back(std::make_unique<Mapping>(Mapping{gen, static_cast<uint8_t *>(base), size}));
  cache_[idx].store(mappings_.back().get(), std::memory_order_release);
  return mappings_.back().get();
}

uint8_t *EmuPeer::translate(const WindowEntry &w, uint64_t raddr, size_t len, size_t *run) {
  for (uint32_t i = 0; i < w.n_extents && i < kMaxExtents; ++i) {
    const Extent &e = w.ext[i];
    // The peer writes its window table: no sum of its numbers may wrap, and a
    // run never leaves the chunk as mapped here.
    if (raddr < e.va || raddr - e.va >= e.len) continue;
    const uint64_t in = raddr - e.va;
    if (self) {
      *run = std::min<uint64_t>(len, e.len - in);
      return reinterpret_cast<uint8_t *>(raddr);
    }
    const Mapping *m = chunk_mapping(e.chunk, e.chunk_gen);
    if (!m || e.chunk_off >= m->size || in >= m->size - e.chunk_off) return nullptr;
    *run = std::min<uint64_t>({len, e.len - in, m->size - e.chunk_off - in});
    return m->base + e.chunk_off + in;
  }
  return nullptr;
}

int EmuPeer::doorbell_fd(int fd, uint64_t ino) {
  if (self) return fd;
  std::lock_guard<std::mutex> g(mu_);
  auto it = doorbells_.find({fd, ino});
  if (it != doorbells_.end()) return it->second;
  int local = peer_fd(pid, pidfd, fd, O_WRONLY | O_NONBLOCK);
  if (local < 0) return -1;
  if (fd_ino(local) != ino) {
    close(local);
    return -1;
  }
  doorbells_[{fd, ino}] = local;
  return local;
}

int EmuPeer::bell() {
  int w = bell_w_.load(std::memory_order_acquire);
  if (w >= 0 || self) return w;
  std::lock_guard<std::mutex> g(mu_);
  if ((w = bell_w_.load(std::memory_order_relaxed)) >= 0) return w;
  int r = peer_fd(pid, pidfd, hdr->bell_rfd, O_RDONLY | O_NONBLOCK);
  if (r < 0) return -1;
  w = peer_fd(pid, pidfd, hdr->bell_fd, O_WRONLY | O_NONBLOCK);
  if (w < 0 || fd_ino(w) != hdr->bell_ino || fd_ino(r) != hdr->bell_ino) {
    close(r);
    if (w >= 0) close(w);
    return -1;
  }
  bell_r_ = r;
  bell_w_.store(w, std::memory_order_release);
  return w;
}

Peer *EmuFabric::peer(uint16_t lid) {
  if (lid == 0 || lid > kMaxNodes) return nullptr;
  std::lock_guard<std::mutex> g(peers_mu_);
  auto &slot_peer = peers_[lid];
  if (slot_peer) {
    // A node that died may have been replaced by a new one with the same LID
    // (live(), not dead(): a death not noticed yet would hide its successor).
    if (slot_peer->live() || table_->slots[lid - 1].nonce == slot_peer->nonce())
      return slot_peer.get();
    retired_.push_back(std::move(slot_peer));
  }
  auto p = std::make_unique<EmuPeer>(lid);
  if (lid == lid_) {
    p->attach_self(hdr_, nonce_);
  } else {
    NodeSlot slot = table_->slots[lid - 1];
    if (slot.pid == 0 || p->attach(slot) != 0) return nullptr;
  }
  slot_peer = std::move(p);
  return slot_peer.get();
}

bool EmuFabric::member() {
  struct stat named {
  }, held{};
  if (stat(path_.c_str(), &named) || fstat(table_fd_, &held) || named.st_ino != held.st_ino)
    return false;  // the table was removed or replaced: nobody can find us
  return table_->slots[lid_ - 1].nonce == nonce_;
}

bool EmuFabric::check_alive(Peer &p) {
  return p.live();
}

// The life thread only sleeps: its robust list (the life word) is what the
// kernel processes when the process dies. It replaces the robust list glibc
// gave the thread, which holds no robust mutex.
int EmuFabric::start_life() {
  std::atomic<int> started{0};
  life_ = std::thread([this, &started] {
    static thread_local robust_list_head head;
    head.list.next = &hdr_->life_entry;
    head.futex_offset =
        static_cast<long>(offsetof(SegHeader, life) - offsetof(SegHeader, life_entry));
    head.list_op_pending = nullptr;
    hdr_->life_entry.next = &head.list;
    hdr_->life.store(static_cast<uint32_t>(gettid()), std::memory_order_release);
    bool ok = syscall(SYS_set_robust_list, &head, sizeof head) == 0;
    started.store(ok ? 1 : -1, std::memory_order_release);
    syscall(SYS_futex, &started, FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0);
    while (!life_stop_.load(std::memory_order_acquire))
      syscall(SYS_futex, &life_stop_, FUTEX_WAIT_PRIVATE, 0, nullptr, nullptr, 0);
    hdr_->life.store(0, std::memory_order_release);  // left: peers see it gone
  });
  while (started.load(std::memory_order_acquire) == 0)
    syscall(SYS_futex, &started, FUTEX_WAIT_PRIVATE, 0, nullptr, nullptr, 0);
  return started.load() == 1 ? 0 : ENOSYS;
}

void EmuFabric::end_life() {
  if (!life_.joinable()) return;
  life_stop_.store(1, std::memory_order_release);
  syscall(SYS_futex, &life_stop_, FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0);
  life_.join();
}

// ---- registration --------------------------------------------------------

int EmuFabric::new_chunk(uint64_t va, uint64_t len, uint32_t *idx) {
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
  own_chunk_name(name, sizeof name, getpid());
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
  // Copy, then atomically replace the private pages at va with the shared
  // copy; other threads' stores in between wait (move_guard.hpp).
  const int moved = emu::guarded_move(va, len, [&]() -> int {
    // Whole pages, beyond the caller's buffer: a kernel copy, which
    // sanitizers do not take for an overflow of the buffer.
    struct iovec to {
      tmp, len
    }, from{reinterpret_cast<void *>(va), len};
    if (process_vm_readv(getpid(), &to, 1, &from, 1, 0) != static_cast<ssize_t>(len))
      return errno ? errno : EFAULT;
    if (kernel::mremap_fixed(tmp, len, reinterpret_cast<void *>(va)) == MAP_FAILED) return errno;
    return 0;
  });
  if (moved != 0) {
    kernel::munmap(tmp, len);
    close(fd);
    return moved;
  }
  ChunkEntry &c = hdr_->chunks[*idx];
  c.fd = fd;
  c.ino = fd_ino(fd);
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
      if (!still_moved(at, end)) {
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
    if (!remappable(at, next) || new_chunk(at, next - at, &ci) != 0) {
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

// Whether every page of [a, b) is present and shared: still the chunk's pages
// a registration moved there, not private memory mapped anew. pagemap gives
// these flags to unprivileged processes (frame numbers only to the admin).
bool EmuFabric::still_moved(uint64_t a, uint64_t b) {
  constexpr uint64_t kPresent = uint64_t{1} << 63, kShared = uint64_t{1} << 61;
  if (pagemap_pid_ != getpid()) {  // /proc/self at open time: reopen in a child
    if (pagemap_fd_ >= 0) close(pagemap_fd_);
    pagemap_fd_ = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
    pagemap_pid_ = getpid();
  }
  if (pagemap_fd_ < 0) return false;
  uint64_t entries[512];
  for (uint64_t page = a / kPage; page < b / kPage;) {
    size_t n = std::min<uint64_t>(std::size(entries), b / kPage - page);
    ssize_t got = pread(pagemap_fd_, entries, n * 8, static_cast<off_t>(page * 8));
    if (got != static_cast<ssize_t>(n * 8)) return false;
    for (size_t i = 0; i < n; ++i)
      if ((entries[i] & (kPresent | kShared)) != (kPresent | kShared)) return false;
    page += n;
  }
  return true;
}

void EmuFabric::unexpose(WindowId id) {
  if (id.index == 0 || id.index >= kMaxWindows) return;
  std::lock_guard<std::mutex> g(reg_mu_);
  WindowEntry &w = hdr_->windows[id.index];
  if (w.gen.load(std::memory_order_relaxed) != id.gen) return;
  w.gen.store((id.gen + 1) & 0x7fffffffu, std::memory_order_release);
  if (w.mode == kMapped)
    for (uint32_t i = 0; i < w.n_extents; ++i) put_region(w.ext[i].va - w.ext[i].chunk_off);
  w.n_extents = 0;
}

// ---- data movement -------------------------------------------------------

const WindowEntry *EmuFabric::window(EmuPeer &p, WindowId w, uint32_t *gen) {
  if (w.index == 0 || w.index >= kMaxWindows) return nullptr;
  const WindowEntry &e = p.hdr->windows[w.index];
  *gen = e.gen.load(std::memory_order_acquire);
  return *gen == w.gen ? &e : nullptr;
}

MoveStatus EmuFabric::copy_move(EmuPeer &p, uint64_t raddr, void *local, size_t len, bool to_peer) {
  auto *remote = reinterpret_cast<uint8_t *>(raddr);
  auto *mine = static_cast<uint8_t *>(local);
  if (p.self) {
    const bool overlap = remote < mine + len && mine < remote + len;
    if (overlap)
      to_peer ? memmove(remote, mine, len) : memmove(mine, remote, len);
    else if (!to_peer)
      bulk_copy(mine, remote, len);
    else
      ordered_copy(remote, mine, len);
    return MoveStatus::ok;
  }
  // To a peer: the last bytes in an iovec of their own, copied after the rest.
  const size_t head = to_peer && len > kLastBytes ? len - kLastBytes : len;
  struct iovec l[2] = {{mine, head}, {mine + head, len - head}};
  struct iovec r[2] = {{remote, head}, {remote + head, len - head}};
  const unsigned long cnt = head < len ? 2 : 1;
  ssize_t n = to_peer ? process_vm_writev(p.pid, l, cnt, r, cnt, 0)
                      : process_vm_readv(p.pid, l, cnt, r, cnt, 0);
  if (n == static_cast<ssize_t>(len)) return MoveStatus::ok;
  if (n < 0 && errno == ESRCH) {
    p.mark_dead();
    return MoveStatus::peer_dead;
  }
  return MoveStatus::bad_window;
}

template <typename Fn>
MoveStatus EmuFabric::move(EmuPeer &p, WindowId w, uint64_t raddr, size_t len, Fn &&fn) {
  uint32_t gen;
  const WindowEntry *e = window(p, w, &gen);
  if (!e) return MoveStatus::bad_window;
  if (e->mode == kCopy) return fn(nullptr, raddr, len);
  size_t done = 0;
  while (done < len) {
    size_t run = 0;
    uint8_t *at = p.translate(*e, raddr + done, len - done, &run);
    if (!at) return MoveStatus::bad_window;
    MoveStatus s = fn(at, done, run);
    if (s != MoveStatus::ok) return s;
    done += run;
  }
  return MoveStatus::ok;
}

MoveStatus EmuFabric::write(Peer &pp, WindowId w, uint64_t raddr, const void *src, size_t len) {
  auto &p = static_cast<EmuPeer &>(pp);
  if (len == 0) return MoveStatus::ok;
  count(kDmaWrites, len);
  auto *s = static_cast<const uint8_t *>(src);
  return move(p, w, raddr, len, [&](uint8_t *at, uint64_t off, size_t n) {
    if (!at) return copy_move(p, raddr, const_cast<uint8_t *>(s), len, true);
    ordered_copy(at, s + off, n);
    return MoveStatus::ok;
  });
}

MoveStatus EmuFabric::read(Peer &pp, WindowId w, uint64_t raddr, void *dst, size_t len) {
  auto &p = static_cast<EmuPeer &>(pp);
  if (len == 0) return MoveStatus::ok;
  count(kDmaReads, len);
  auto *d = static_cast<uint8_t *>(dst);
  return move(p, w, raddr, len, [&](uint8_t *at, uint64_t off, size_t n) {
    if (!at) return copy_move(p, raddr, d, len, false);
    bulk_copy(d + off, at, n);
    return MoveStatus::ok;
  });
}

int EmuFabric::ring(Peer &pp, int fd, uint64_t ino, const void *rec, size_t len) {
  auto &p = static_cast<EmuPeer &>(pp);
  int local = p.doorbell_fd(fd, ino);
  if (local < 0) return ESRCH;
  // The kernel's write: under pcientb-run, libc's write() is interposed (rdma_cm), and a
  // doorbell per SEND should not pay for that (~12 ns of an 8 B SEND's latency).
  ssize_t n = syscall(SYS_write, local, rec, len);
  return n == static_cast<ssize_t>(len) ? 0 : errno;
}

int EmuFabric::post(Peer &pp, size_t off, const void *src, size_t len) {
  auto &p = static_cast<EmuPeer &>(pp);
  if (off > kAreaSize || len > kAreaSize - off) return EFAULT;
  count(kPosts, len);
  auto *dst = static_cast<uint8_t *>(p.area()) + off;
  auto *from = static_cast<const uint8_t *>(src);
  // Each store a release (a plain store on x86): a post lands after the posts
  // before it, as the reader's acquire of a seq or key sees (and as TSan can
  // follow, which a fence before relaxed stores hides from it).
  // Aligned words are stored whole: they are what a reader checks. A post may
  // start mid-word (a record's body after its seq): up to the first aligned
  // word it goes by 4-byte word or byte, then a word at a time.
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
  return 0;
}

void EmuFabric::doorbell(Peer &pp, bool maskable) {
  auto &p = static_cast<EmuPeer &>(pp);
  // Strict: as through an NT port, the ringer does not see the peer's mask.
  if (maskable && !strict_) {
    count(kRemoteReads);
    // Masked for long yet: the peer's progress thread looks at its lanes
    // only when the mask runs out, long after what was posted is visible.
    // (The fence below would wait for those stores to leave this core: a
    // tenth of a SEND's round trip.)
    const uint64_t now = mono_ns();
    if (p.hdr->quiet_until.load(std::memory_order_relaxed) > now + kQuietNs / 8) return;
    // Near its end: pairs with the progress thread of the peer, which reads
    // its lanes after the mask ran out: either it sees what was posted or
    // we see no mask.
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (p.hdr->quiet_until.load(std::memory_order_relaxed) > now) return;
  }
  int fd = p.self ? bell_fd_ : p.bell();
  char one = 1;
  count(kDoorbells);
  if (fd >= 0 && syscall(SYS_write, fd, &one, 1) < 0) {
    // Full: it has rung already.
  }
}

class EmuFabricView : public FabricView {
 public:
  ~EmuFabricView() override {
    for (auto &[base, size] : maps_) kernel::munmap(base, size);
  }
  int open(const char *name, uint32_t layout);
  const char *name() const override { return name_.c_str(); }
  const std::vector<NodeView> &nodes() const override { return nodes_; }

 private:
  NodeView view(const NodeSlot &slot, uint16_t lid);
  std::string name_;
  std::vector<NodeView> nodes_;
  std::vector<std::pair<void *, size_t>> maps_;
};

int EmuFabricView::open(const char *name, uint32_t layout) {
  name_ = name;
  if (name_.empty() || name_.find('/') != std::string::npos) return EINVAL;
  const std::string path = "/dev/shm/" + table_prefix() + name_;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return errno;
  struct stat st {};
  auto table = std::make_unique<TableFile>();
  int e = 0;
  if (fstat(fd, &st) || st.st_uid != getuid() || static_cast<size_t>(st.st_size) < sizeof *table)
    e = ENOENT;  // not (or not yet) a table of this user
  // Shared: joiners and leavers (exclusive) wait only for this copy.
  if (!e) {
    flock(fd, LOCK_SH);
    if (pread(fd, table.get(), sizeof *table, 0) != static_cast<ssize_t>(sizeof *table)) e = EIO;
    flock(fd, LOCK_UN);
  }
  close(fd);
  if (e) return e;
  if (table->magic != kTableMagic) return ENOENT;
  if (table->layout != fabric_layout(layout)) return EPROTO;  // its areas would be misread
  for (uint32_t i = 0; i < kMaxNodes; ++i)
    if (table->slots[i].pid != 0) nodes_.push_back(view(table->slots[i], uint16_t(i + 1)));
  return 0;
}

NodeView EmuFabricView::view(const NodeSlot &slot, uint16_t lid) {
  NodeView v;
  v.lid = lid;
  v.pid = slot.pid;
  v.alive = slot_alive(slot);
  if (!v.alive) return v;
  int pidfd = sys_pidfd_open(slot.pid);
  int fd = peer_fd(slot.pid, pidfd, slot.seg_fd, O_RDONLY);
  if (fd < 0) v.error = errno;
  if (pidfd >= 0) close(pidfd);
  if (fd < 0) return v;
  void *m = MAP_FAILED;
  if (fd_ino(fd) != slot.seg_ino)
    v.error = ESRCH;  // the node left as we looked
  else if ((m = kernel::mmap(nullptr, slot.seg_size, PROT_READ, MAP_SHARED | MAP_NORESERVE, fd,
                             0)) == MAP_FAILED)
    v.error = errno;
  close(fd);
  if (m == MAP_FAILED) return v;
  maps_.emplace_back(m, slot.seg_size);
  const auto *hdr = static_cast<const SegHeader *>(m);
  if (hdr->magic != kSegMagic || hdr->nonce != slot.nonce) {
    v.error = ESRCH;
    return v;
  }
  v.area = static_cast<const uint8_t *>(m) + kHeaderSize;
  v.area_size = slot.seg_size - kHeaderSize;
  return v;
}

std::vector<std::string> emu_fabric_names() {
  std::vector<std::string> names;
  DIR *d = opendir("/dev/shm");
  if (!d) return names;
  const std::string prefix = table_prefix();
  while (dirent *e = readdir(d))
    if (strncmp(e->d_name, prefix.c_str(), prefix.size()) == 0)
      names.emplace_back(e->d_name + prefix.size());
  closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

std::unique_ptr<FabricView> view_emu_fabric(const char *name, uint32_t layout, int *err) {
  auto v = std::make_unique<EmuFabricView>();
  if (int e = v->open(name, layout)) {
    if (err) *err = e;
    return nullptr;
  }
  return v;
}

std::unique_ptr<Fabric> open_emu_fabric(const char *name, uint32_t layout, int *err) {
  auto f = std::make_unique<EmuFabric>();
  int e = f->join(name, layout);
  if (e) {
    if (err) *err = e;
    return nullptr;
  }
  return f;
}

}  // namespace

const Backend &emu_backend() {
  static const Backend b{"emulated", open_emu_fabric, emu_node_guid, emu_fabric_names,
                         view_emu_fabric};
  return b;
}

}  // namespace pcientb::fabric
