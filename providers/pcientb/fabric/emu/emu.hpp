// The emulated fabric's parts, shared by its files (membership.cpp: the
// fabric table, joining and leaving, liveness, views; windows.cpp:
// registration and fork; peers.cpp: peers, data movement, posts and
// doorbells). Private to the backend: the engine sees fabric.hpp only.
#pragma once

#include <linux/futex.h>
#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "fabric/fabric.hpp"
#include "fabric/work.hpp"

namespace pcientb::fabric::emu {

constexpr uint64_t kTableMagic = 0x70636e7462746231ULL;  // "pcntbtb1"
constexpr uint64_t kSegMagic = 0x70636e7462736731ULL;    // "pcntbsg1"
constexpr uint32_t kMaxNodes = 1024;
constexpr uint32_t kMaxWindows = 16384;
constexpr uint32_t kMaxChunks = 16384;
constexpr uint32_t kMaxExtents = 8;
constexpr uint32_t kMoverLanes = 7;            // moves of one node into one peer at once
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
  // The highest LID a node has had (raised when one joins, never lowered): how far a
  // node looks for movers (EmuFabric::wait_for_movers).
  std::atomic<uint32_t> high_lid;
  uint32_t pad;
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

// The windows of a node that one peer (or the node itself) is moving bytes
// into or out of: a lane per thread of that peer at a time, each written only
// by the thread holding it, (gen << 32 | index) of the window, 0 when idle.
// unexpose() waits for the lanes naming the window it retires, so no byte
// moves after ibv_dereg_mr returns (as pcientb.ko waits for its movers).
struct alignas(64) MoverLanes {
  // The mover's nonce, written when it attaches (after clearing the lanes
  // that a dead holder of its LID may have left).
  std::atomic<uint64_t> nonce;
  std::atomic<uint64_t> lane[kMoverLanes];
};
static_assert(sizeof(MoverLanes) == 64);

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
  // this time (CLOCK_MONOTONIC ns) because a thread of the node polls. On a
  // line of its own: peers load `life` with every WR, and a line the owner
  // keeps writing would miss in their caches each time.
  alignas(64) std::atomic<uint64_t> quiet_until;
  alignas(64) int32_t bell_fd;  // the node doorbell: a pipe's write end, of the owner
  int32_t bell_rfd;             // its read end
  uint64_t bell_ino;
  WindowEntry windows[kMaxWindows];
  ChunkEntry chunks[kMaxChunks];
  MoverLanes movers[kMaxNodes + 1];  // by the mover's LID
};
constexpr size_t kHeaderSize = (sizeof(SegHeader) + kPage - 1) & ~(kPage - 1);
constexpr size_t kSegSize = kHeaderSize + kAreaSize;
constexpr uint64_t kQuietNs = 1000000;  // how long a poll masks the doorbell

// membership.cpp
uint64_t emu_node_guid();
bool strict_from_env();
// The owner of a slot still runs (its pid's start time is the slot's).
bool slot_alive(const NodeSlot &s);
int sys_pidfd_open(pid_t pid);
int peer_fd(pid_t pid, int pidfd, int fd, int flags);
uint64_t fd_ino(int fd);
// windows.cpp
void own_chunk_name(char *out, size_t n, pid_t pid);
void fork_prepare();
void fork_parent();
void fork_child();
// This process's pid without a system call; valid in a child forked after join (the fork
// handlers are installed then).
pid_t own_pid();
// peers.cpp
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
  // The write end of the peer's node doorbell, -1 if it cannot be had.
  int bell();
  // A lane of this node's in the peer's mover table (see MoverLanes), held
  // by one thread of this process at a time.
  uint32_t claim_lane();
  void release_lane(uint32_t lane) { lanes_busy_.fetch_and(uint8_t(~(1u << lane))); }

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
  // The peer's doorbell pipe, both ends: holding a reader, a write never
  // raises SIGPIPE when the peer has gone.
  std::atomic<int> bell_w_{-1};
  int bell_r_ = -1;
  std::atomic<uint8_t> lanes_busy_{0};
  static_assert(kMoverLanes < 8);
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
  // What is reused soon (a QP's queues, for the next QP) is zeroed in place: punching it out
  // unmapped it in every peer that maps the area (a TLB shootdown each) and the next QP
  // faulted it in again, a tenth of a short SDP connection's time.
  void discard(size_t off, size_t len, bool reuse) override {
    if (reuse)
      memset(static_cast<uint8_t *>(area()) + off, 0, len);
    else
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
  int post(Peer &p, size_t off, const void *src, size_t len) override;
  void doorbell(Peer &p, bool maskable) override;
  void polling() override {
    if (strict_) return;
    // Renewed once half of it has run: each store takes the line from the
    // caches of the peers that read it before ringing.
    const uint64_t now = mono_ns();
    if (hdr_->quiet_until.load(std::memory_order_relaxed) < now + kQuietNs / 2)
      hdr_->quiet_until.store(now + kQuietNs, std::memory_order_relaxed);
  }
  uint64_t quiet_until_ns() override { return hdr_->quiet_until.load(std::memory_order_relaxed); }
  bool not_polling() override {
    const uint64_t quiet = hdr_->quiet_until.load(std::memory_order_relaxed);
    if (!quiet) return false;
    hdr_->quiet_until.store(0, std::memory_order_relaxed);
    // Pairs with a ringer's fence: it sees no mask, or this node's next look
    // at its lanes sees what it posted.
    std::atomic_thread_fence(std::memory_order_seq_cst);
    return quiet > mono_ns();
  }
  Work work() const override { return work_done(); }
  int doorbell_fd() override { return bell_rfd_; }
  void clear_doorbell() override {
    // A short read emptied the pipe: no second read to see EAGAIN (a ring after it
    // leaves the pipe readable, as it would after that EAGAIN).
    char v[64];
    while (syscall(SYS_read, bell_rfd_, v, sizeof v) == static_cast<long>(sizeof v)) {
    }
  }

 private:
  template <typename Fn>
  MoveStatus move(EmuPeer &p, WindowId w, uint64_t raddr, size_t len, Fn &&fn);
  MoveStatus copy_move(EmuPeer &p, uint64_t raddr, void *local, size_t len, bool to_peer);
  const WindowEntry *window(EmuPeer &p, WindowId w, uint32_t *gen);
  int new_chunk(uint64_t va, uint64_t len, bool anon, uint32_t *idx);
  int copy_into(int fd, char *map, uint64_t va, uint64_t len, bool touched_only);
  int pagemap();  // /proc/self/pagemap, or -1
  void put_region(uint64_t va);
  void drop_region(std::map<uint64_t, Region>::iterator it);
  void trim_cache();
  bool still_moved(uint64_t start, const Region &r, uint64_t a, uint64_t b);
  void wait_for_movers(WindowId id);

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
  dev_t chunk_dev_ = 0;  // the file system of every memfd (shmem's)
};

}  // namespace pcientb::fabric::emu
