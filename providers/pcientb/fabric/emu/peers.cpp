// The emulated NTB fabric: peers, and what moves between nodes (one-sided
// moves through windows, posted writes into a peer's area, doorbells).
// A peer is alive while its life word (membership.cpp) is intact: every
// transfer checks it after landing.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "bulk_copy.hpp"
#include "fabric/emu/emu.hpp"
#include "fabric/emu/kernel_vm.hpp"
#include "fabric/work.hpp"

namespace pcientb::fabric::emu {
namespace {

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

}  // namespace

// ---- peers ---------------------------------------------------------------

EmuPeer::~EmuPeer() {
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
  // Our lanes in its mover table may still name windows a previous holder of
  // our LID was moving when it died; only we write them.
  MoverLanes &mine = p->hdr->movers[lid_];
  for (auto &lane : mine.lane) lane.store(0, std::memory_order_relaxed);
  mine.nonce.store(nonce_, std::memory_order_release);
  slot_peer = std::move(p);
  return slot_peer.get();
}

bool EmuFabric::check_alive(Peer &p) {
  return p.live();
}

// ---- data movement -------------------------------------------------------

const WindowEntry *EmuFabric::window(EmuPeer &p, WindowId w, uint32_t *gen) {
  if (w.index == 0 || w.index >= kMaxWindows) return nullptr;
  const WindowEntry &e = p.hdr->windows[w.index];
  // seq_cst, after the mover's lane (move()): see EmuFabric::wait_for_movers.
  *gen = e.gen.load(std::memory_order_seq_cst);
  return *gen == w.gen ? &e : nullptr;
}

uint32_t EmuPeer::claim_lane() {
  for (;;) {
    uint8_t busy = lanes_busy_.load(std::memory_order_relaxed);
    constexpr uint8_t kAll = (1u << kMoverLanes) - 1;
    while ((busy & kAll) != kAll) {
      const auto lane = static_cast<uint32_t>(__builtin_ctz(~busy & kAll));
      if (lanes_busy_.compare_exchange_weak(busy, uint8_t(busy | (1u << lane)),
                                            std::memory_order_acquire))
        return lane;
    }
    std::this_thread::yield();  // more threads than lanes moving to this peer
  }
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
  if (w.index == 0 || w.index >= kMaxWindows) return MoveStatus::bad_window;
  // The window is named in the peer's mover table before it is looked at, and
  // until the last byte has moved.
  struct Lane {
    EmuPeer &p;
    const uint32_t lane = p.claim_lane();
    std::atomic<uint64_t> &word;
    Lane(EmuPeer &peer, uint16_t mover, uint64_t key)
        : p(peer), word(peer.hdr->movers[mover].lane[lane]) {
      word.store(key, std::memory_order_seq_cst);
    }
    ~Lane() {
      word.store(0, std::memory_order_release);
      p.release_lane(lane);
    }
  } named(p, lid_, uint64_t{w.gen} << 32 | w.index);
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

int EmuFabric::post(Peer &pp, size_t off, const void *src, size_t len) {
  auto &p = static_cast<EmuPeer &>(pp);
  if (off > kAreaSize || len > kAreaSize - off) return EFAULT;
  count(kPosts, len);
  store_posted(static_cast<uint8_t *>(p.area()) + off, src, len);
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

}  // namespace pcientb::fabric::emu
