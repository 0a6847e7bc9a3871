#include "fake_fabric.hpp"

#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "engine/engine.hpp"

namespace pcientb::test::fake {
namespace {

using fabric::Fabric;
using fabric::MoveStatus;
using fabric::Peer;
using fabric::WindowId;

constexpr size_t kArea = size_t{256} << 20;  // sparse: only touched pages cost memory
constexpr uint16_t kMaxLids = 64;

void bump(int fd) {
  uint64_t one = 1;
  if (write(fd, &one, sizeof one) < 0) {
    // Full: it is readable already.
  }
}

struct Window {
  uint64_t addr = 0, len = 0;
  uint32_t gen = 0;
  bool live = false;
};

// A node of the fake fabric: what the emulated backend keeps in a segment.
struct NodeState {
  uint16_t lid = 0;
  uint64_t nonce = 0;
  uint8_t *area = nullptr;
  std::atomic<uint32_t> life{1};  // 0: dead
  int bell = -1;                  // eventfd: the node doorbell
  std::atomic<uint64_t> quiet_until{0};
  std::atomic<bool> deaf{false};
  std::atomic<uint32_t> read_delay_us{0};
  std::mutex windows_mu;
  std::vector<Window> windows{1};  // index 0 is never a window
};

class FakePeer final : public Peer {
 public:
  FakePeer(NodeState *n) : node(n), death(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
    lid_ = n->lid;
    nonce_ = n->nonce;
    life_ = &n->life;
    life_value_ = 1;
  }
  ~FakePeer() override { close(death); }
  NodeState *node;
  int death;
};

struct Hub {
  std::mutex mu;
  NodeState *nodes[kMaxLids + 1] = {};
  uint16_t next_lid = 1;
  std::vector<FakePeer *> peers;  // every peer object of every node, for kill()
};
Hub &hub() {
  static Hub *h = new Hub;  // never destroyed: nodes may outlive static destruction
  return *h;
}

class FakeFabric final : public Fabric {
 public:
  explicit FakeFabric(NodeState *n, std::string name) : me_(n), name_(std::move(name)) {}
  ~FakeFabric() override {
    // The node leaves: its peers see it dead. Its memory stays (a peer's
    // thread may still post to it, as to a segment that is gone).
    kill(me_->lid);
    Hub &h = hub();
    std::lock_guard<std::mutex> g(h.mu);
    std::erase_if(h.peers, [this](FakePeer *p) { return mine(p); });
  }

  uint16_t lid() const override { return me_->lid; }
  uint64_t nonce() const override { return me_->nonce; }
  uint64_t node_guid() const override { return 0x0010b5'8749'000000ull | me_->lid; }
  const char *name() const override { return name_.c_str(); }
  void *area() override { return me_->area; }
  size_t area_size() const override { return kArea; }
  void discard(size_t off, size_t len, bool) override {
    madvise(me_->area + off, len, MADV_DONTNEED);
  }
  bool member() override { return me_->life.load() != 0; }

  Peer *peer(uint16_t lid) override {
    Hub &h = hub();
    std::lock_guard<std::mutex> g(h.mu);
    if (lid == 0 || lid > kMaxLids || !h.nodes[lid] || !h.nodes[lid]->life.load()) return nullptr;
    auto &p = peers_[lid];
    if (!p || p->dead()) {
      if (p) retired_.push_back(std::move(p));
      p = std::make_unique<FakePeer>(h.nodes[lid]);
      h.peers.push_back(p.get());
    }
    return p.get();
  }
  bool check_alive(Peer &p) override { return p.live(); }
  int death_fd(Peer &p) override { return static_cast<FakePeer &>(p).death; }

  int expose(void *addr, size_t len, WindowId *out) override {
    std::lock_guard<std::mutex> g(me_->windows_mu);
    auto &ws = me_->windows;
    ws.push_back({reinterpret_cast<uint64_t>(addr), len, ++gen_, true});
    *out = WindowId{static_cast<uint32_t>(ws.size() - 1), gen_};
    return 0;
  }
  void unexpose(WindowId id) override {
    std::lock_guard<std::mutex> g(me_->windows_mu);
    if (id.index < me_->windows.size() && me_->windows[id.index].gen == id.gen)
      me_->windows[id.index].live = false;
  }

  MoveStatus write(Peer &p, WindowId w, uint64_t raddr, const void *src, size_t len) override {
    add(&fabric::Work::dma_writes, 1);
    add(&fabric::Work::dma_write_bytes, len);
    return move(p, w, raddr, len, [&](uint8_t *at) { memcpy(at, src, len); });
  }
  MoveStatus read(Peer &p, WindowId w, uint64_t raddr, void *dst, size_t len) override {
    add(&fabric::Work::dma_reads, 1);
    add(&fabric::Work::dma_read_bytes, len);
    if (const uint32_t us = me_->read_delay_us.load()) usleep(us);
    return move(p, w, raddr, len, [&](uint8_t *at) { memcpy(dst, at, len); });
  }

  int post(Peer &pp, size_t off, const void *src, size_t len) override {
    auto &p = static_cast<FakePeer &>(pp);
    if (off > kArea || len > kArea - off) return EFAULT;
    if (!p.live()) return 0;  // lost, as a posted write to a node that is gone
    add(&fabric::Work::posts, 1);
    add(&fabric::Work::post_bytes, len);
    uint8_t *dst = p.node->area + off;
    auto *from = static_cast<const uint8_t *>(src);
    // Aligned words land whole, each store a release: the contract's order.
    for (size_t i = 0; i < len;) {
      const auto at = reinterpret_cast<uintptr_t>(dst + i);
      if (!(at & 7) && len - i >= 8) {
        uint64_t v;
        memcpy(&v, from + i, 8);
        __atomic_store_n(reinterpret_cast<uint64_t *>(dst + i), v, __ATOMIC_RELEASE);
        i += 8;
      } else if (!(at & 3) && len - i >= 4) {
        uint32_t v;
        memcpy(&v, from + i, 4);
        __atomic_store_n(reinterpret_cast<uint32_t *>(dst + i), v, __ATOMIC_RELEASE);
        i += 4;
      } else {
        __atomic_store_n(dst + i, from[i], __ATOMIC_RELEASE);
        ++i;
      }
    }
    return 0;
  }
  void doorbell(Peer &pp, bool maskable) override {
    auto &p = static_cast<FakePeer &>(pp);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (maskable && p.node->quiet_until.load(std::memory_order_relaxed) > engine::now_ns()) return;
    if (p.node->deaf.load()) return;
    add(&fabric::Work::doorbells, 1);
    bump(p.node->bell);
  }
  void polling() override {
    if (!me_->deaf.load()) me_->quiet_until.store(engine::now_ns() + 1000000);
  }
  uint64_t quiet_until_ns() override { return me_->quiet_until.load(); }
  bool not_polling() override {
    const uint64_t quiet = me_->quiet_until.exchange(0);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    return quiet > engine::now_ns();
  }
  fabric::Work work() const override {
    std::lock_guard<std::mutex> g(work_mu_);
    return work_;
  }
  int doorbell_fd() override { return me_->bell; }
  void clear_doorbell() override {
    uint64_t v;
    if (::read(me_->bell, &v, sizeof v) < 0) {
      // Not rung.
    }
  }

 private:
  template <typename Copy>
  MoveStatus move(Peer &pp, WindowId w, uint64_t raddr, size_t len, Copy &&copy) {
    auto &p = static_cast<FakePeer &>(pp);
    if (!p.live()) return MoveStatus::peer_dead;
    if (len == 0) return MoveStatus::ok;
    std::lock_guard<std::mutex> g(p.node->windows_mu);
    const auto &ws = p.node->windows;
    if (w.index == 0 || w.index >= ws.size()) return MoveStatus::bad_window;
    const Window &win = ws[w.index];
    if (!win.live || win.gen != w.gen || raddr < win.addr || len > win.len ||
        raddr - win.addr > win.len - len)
      return MoveStatus::bad_window;
    copy(reinterpret_cast<uint8_t *>(raddr));
    return MoveStatus::ok;
  }

  bool mine(const FakePeer *p) const {
    for (const auto &q : peers_)
      if (q.get() == p) return true;
    for (const auto &q : retired_)
      if (q.get() == p) return true;
    return false;
  }

  void add(uint64_t fabric::Work::*what, uint64_t n) {
    std::lock_guard<std::mutex> g(work_mu_);
    work_.*what += n;
  }

  NodeState *me_;
  std::string name_;
  uint32_t gen_ = 0;
  std::unique_ptr<FakePeer> peers_[kMaxLids + 1];
  std::vector<std::unique_ptr<FakePeer>> retired_;
  mutable std::mutex work_mu_;
  fabric::Work work_;
};

std::unique_ptr<Fabric> open_fake(const char *name, uint32_t, int *err) {
  Hub &h = hub();
  std::lock_guard<std::mutex> g(h.mu);
  if (h.next_lid > kMaxLids) {
    *err = ENOSPC;
    return nullptr;
  }
  void *area = mmap(nullptr, kArea, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (area == MAP_FAILED) {
    *err = errno;
    return nullptr;
  }
  auto *n = new NodeState;  // kept: peers may hold it after the node leaves
  n->lid = h.next_lid++;
  n->nonce = 0x6e6f6e6365000000ull | n->lid;
  n->area = static_cast<uint8_t *>(area);
  n->bell = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  h.nodes[n->lid] = n;
  return std::make_unique<FakeFabric>(n, name);
}

uint64_t fake_guid() {
  return 0x0010b5'8749'000000ull;
}
std::vector<std::string> no_names() {
  return {};
}
std::unique_ptr<fabric::FabricView> no_view(const char *, uint32_t, int *err) {
  *err = ENOSYS;
  return nullptr;
}

}  // namespace

void install() {
  static const fabric::Backend b{"fake", open_fake, fake_guid, no_names, no_view};
  fabric::install_backend(b);
}

void *area(uint16_t lid) {
  Hub &h = hub();
  std::lock_guard<std::mutex> g(h.mu);
  return lid && lid <= kMaxLids && h.nodes[lid] ? h.nodes[lid]->area : nullptr;
}

void deafen(uint16_t lid, bool deaf) {
  Hub &h = hub();
  std::lock_guard<std::mutex> g(h.mu);
  if (lid && lid <= kMaxLids && h.nodes[lid]) {
    h.nodes[lid]->deaf.store(deaf);
    // No mask either: its end would have the progress thread take the lanes (under ASan a
    // requester's next steps outlast the 1 ms a poll before deafen masked for).
    if (deaf) h.nodes[lid]->quiet_until.store(0);
  }
}

void slow_reads(uint16_t lid, uint32_t us) {
  Hub &h = hub();
  std::lock_guard<std::mutex> g(h.mu);
  if (lid && lid <= kMaxLids && h.nodes[lid]) h.nodes[lid]->read_delay_us.store(us);
}

void kill(uint16_t lid) {
  Hub &h = hub();
  std::lock_guard<std::mutex> g(h.mu);
  if (!lid || lid > kMaxLids || !h.nodes[lid]) return;
  h.nodes[lid]->life.store(0);
  for (FakePeer *p : h.peers)
    if (p->node == h.nodes[lid]) bump(p->death);
}

}  // namespace pcientb::test::fake
