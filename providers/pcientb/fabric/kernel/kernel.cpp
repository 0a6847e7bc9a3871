// The kernel fabric: the engine over pcientb.ko, for the nodes of one host
// (docs/kernel.md). The node is a uverbs context of its own on the device's
// uverbs fd (GET_CONTEXT gives its LID, nonce and area size); its area, its
// peers' areas and the node table are mappings of that fd; doorbells,
// watchers and one-sided moves are the module's driver methods; windows are
// memory regions of the module (pinned, keyed: a window's id is its key).
// A node of the host across the bridge is mapped too, chunk by chunk, write-combined
// through the NT window. A node that polls masks its doorbell (a system call when the mask
// comes and when it ends, the module's MASK); its peers read the masks in a page of their
// own host (PCIENTB_MMAP_MASKS) and ring (a system call) only a node whose mask is off.
#include <dirent.h>
#include <endian.h>
#include <fcntl.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "fabric/fabric.hpp"
#include "fabric/kernel/uverbs.hpp"
#include "fabric/work.hpp"

namespace pcientb::fabric::kernel {
namespace {

constexpr size_t kPage = 4096;
constexpr const char kPrefix[] = "kernel:";
// How long a poll masks the doorbell (renewed by the polls after it); a mask that ran out
// costs the progress thread a system call to end it.
constexpr uint64_t kQuietNs = 1000000;

class KernelPeer final : public Peer {
 public:
  KernelPeer(uint16_t lid, uint64_t nonce, const std::atomic<uint32_t> *life, uint32_t value,
             uint8_t *area, size_t area_size, bool self, bool across)
      : area(area), area_size(area_size), self(self), across(across) {
    lid_ = lid;
    nonce_ = nonce;
    life_ = life;
    life_value_ = value;
  }
  ~KernelPeer() override {
    if (!self && area) munmap(area, area_size);
    if (watch_fd >= 0) close(watch_fd);
  }
  // The peer's area as mapped here: only post() writes it. nullptr: across the bridge, and
  // not mappable (posts are the module's).
  uint8_t *const area;
  const size_t area_size;
  const bool self;
  const bool across;  // the area is write-combined: stores may pass each other
  int watch_fd = -1;  // under the fabric's peers_mu_
};

class KernelFabric final : public Fabric {
 public:
  ~KernelFabric() override;
  int open(const char *name, uint32_t layout);

  uint16_t lid() const override { return static_cast<uint16_t>(info_.lid); }
  uint64_t nonce() const override { return info_.nonce; }
  uint64_t node_guid() const override { return guid_; }
  const char *name() const override { return name_.c_str(); }
  void *area() override { return area_; }
  size_t area_size() const override { return info_.area_size; }
  // The module's areas are allocated whole: a discarded range is only zeroed.
  void discard(size_t off, size_t len, bool) override { memset(area_ + off, 0, len); }

  bool member() override {
    ib_uverbs_query_port_resp r{};
    ib_uverbs_query_port cmd{};
    cmd.response = response_at(&r);
    cmd.port_num = 1;
    return execute(fd_, IB_USER_VERBS_CMD_QUERY_PORT, cmd, sizeof r) == 0;
  }
  Peer *peer(uint16_t lid) override;
  bool check_alive(Peer &p) override { return p.live(); }
  int death_fd(Peer &p) override;

  int expose(void *addr, size_t len, WindowId *out) override;
  void unexpose(WindowId id) override;
  MoveStatus write(Peer &p, WindowId w, uint64_t raddr, const void *src, size_t len) override {
    count(kDmaWrites, len);
    return move(p, w, raddr, const_cast<void *>(src), len, PCIENTB_MOVE_WRITE);
  }
  MoveStatus read(Peer &p, WindowId w, uint64_t raddr, void *dst, size_t len) override {
    count(kDmaReads, len);
    return move(p, w, raddr, dst, len, PCIENTB_MOVE_READ);
  }
  int post(Peer &pp, size_t off, const void *src, size_t len) override {
    auto &p = static_cast<KernelPeer &>(pp);
    if (off > p.area_size || len > p.area_size - off) return EFAULT;
    count(kPosts, len);
    if (p.area) {
      store_posted(p.area + off, src, len);
      // Write-combined: what a post announces lands before the post after it.
      if (p.across) __builtin_ia32_sfence();
      return 0;
    }
    // Across the bridge the module writes through its window (ENOENT: the node is gone,
    // and will be found so).
    pcientb_post cmd{};
    cmd.lid = p.lid();
    cmd.offset = off;
    cmd.addr = reinterpret_cast<uintptr_t>(src);
    cmd.length = len;
    const int rc = method(fd_, PCIENTB_METHOD_POST, cmd);
    return rc == ENOENT ? 0 : rc;
  }
  void doorbell(Peer &p, bool maskable) override {
    if (maskable) {
      // The posts before the look (across: out of the write-combining buffers too); pairs
      // with the module's MASK, which ends the mask before the node looks at its lanes.
      std::atomic_thread_fence(std::memory_order_seq_cst);
      if (masks_[p.lid()].load(std::memory_order_relaxed)) return;
    }
    pcientb_ring cmd{};
    cmd.lid = p.lid();
    count(kDoorbells);
    method(fd_, PCIENTB_METHOD_RING, cmd);  // ENOENT: it is gone, and will be found so
  }
  void polling() override {
    const uint64_t now = mono_ns();
    if (masked_.load(std::memory_order_acquire) &&
        quiet_until_.load(std::memory_order_relaxed) >= now + kQuietNs / 2)
      return;
    std::lock_guard<std::mutex> g(mask_mu_);
    if (!masked_.load(std::memory_order_relaxed)) {
      if (mask(1)) return;  // not masked: peers ring
      masked_.store(true, std::memory_order_release);
    }
    quiet_until_.store(now + kQuietNs, std::memory_order_relaxed);
  }
  uint64_t quiet_until_ns() override {
    return masked_.load(std::memory_order_acquire) ? quiet_until_.load(std::memory_order_relaxed)
                                                   : 0;
  }
  bool quiet_ran_out(uint64_t quiet) override {
    std::lock_guard<std::mutex> g(mask_mu_);
    // Renewed meanwhile (polling() renews under the lock): it stands.
    if (!masked_.load(std::memory_order_relaxed) ||
        quiet_until_.load(std::memory_order_relaxed) != quiet)
      return false;
    end_mask();
    return true;
  }
  bool not_polling() override {
    if (!masked_.load(std::memory_order_acquire)) return false;
    std::lock_guard<std::mutex> g(mask_mu_);
    if (!masked_.load(std::memory_order_relaxed)) return false;
    end_mask();
    return true;
  }
  Work work() const override { return work_done(); }
  int device_event_fd() override { return event_fd_; }
  int device_event() override {
    ib_uverbs_async_event_desc e{};
    if (::read(event_fd_, &e, sizeof e) != sizeof e) return -1;
    return static_cast<int>(e.event_type);  // ibv_event_type's values are the kernel's
  }
  int doorbell_fd() override { return bell_fd_; }
  void clear_doorbell() override {
    uint64_t v;
    while (::read(bell_fd_, &v, sizeof v) > 0) {
    }
  }

 private:
  MoveStatus move(Peer &p, WindowId w, uint64_t raddr, void *local, size_t len, uint32_t dir);
  void end_mask() {  // with mask_mu_
    // Retried: while the mask stands, peers leave this node's doorbell alone.
    while (mask(0) == EINTR) {
    }
    masked_.store(false, std::memory_order_release);
    quiet_until_.store(0, std::memory_order_relaxed);
  }
  int mask(uint32_t quiet) {
    pcientb_mask cmd{};
    cmd.quiet = quiet;
    return method(fd_, PCIENTB_METHOD_MASK, cmd);
  }
  uint8_t *map_remote(uint16_t lid, uint32_t chunks);

  std::string name_;
  int fd_ = -1;
  int event_fd_ = -1;  // the kernel context's async events
  int bell_fd_ = -1;
  pcientb_ucontext_resp info_{};
  uint32_t layout_ = 0;  // the engine's: a node of another is not a peer
  uint64_t guid_ = 0;
  uint32_t pd_ = 0;
  uint8_t *area_ = nullptr;
  const pcientb_node_entry *table_ = nullptr;
  size_t table_bytes_ = 0;
  const std::atomic<uint32_t> *masks_ = nullptr;  // PCIENTB_MMAP_MASKS, by LID
  // This node's mask: set while its threads poll, until quiet_until_ (mono_ns) at least.
  std::mutex mask_mu_;
  std::atomic<bool> masked_{false};
  std::atomic<uint64_t> quiet_until_{0};

  std::atomic<bool> warned_layout_{false};
  std::mutex peers_mu_;
  std::vector<std::unique_ptr<KernelPeer>> peers_;    // by LID
  std::vector<std::unique_ptr<KernelPeer>> retired_;  // dead peers' mappings, kept until we go

  std::mutex windows_mu_;
  std::map<uint32_t, uint32_t> windows_;  // key -> the MR's handle
};

// The ib_devices with a uverbs device node: name -> /dev/infiniband/uverbsN.
std::map<std::string, std::string> uverbs_devices() {
  std::map<std::string, std::string> found;
  DIR *d = opendir("/sys/class/infiniband_verbs");
  while (dirent *e = d ? readdir(d) : nullptr) {
    if (strncmp(e->d_name, "uverbs", 6) != 0) continue;
    char name[64] = {};
    std::string p = std::string("/sys/class/infiniband_verbs/") + e->d_name + "/ibdev";
    if (FILE *f = fopen(p.c_str(), "re")) {
      if (fgets(name, sizeof name, f)) name[strcspn(name, "\n")] = 0;
      fclose(f);
    }
    if (name[0]) found[name] = std::string("/dev/infiniband/") + e->d_name;
  }
  if (d) closedir(d);
  return found;
}

// The uverbs device node of the ib_device `ibdev`, or "".
std::string uverbs_path(const std::string &ibdev) {
  auto devices = uverbs_devices();
  auto it = devices.find(ibdev);
  return it == devices.end() ? std::string() : it->second;
}

int KernelFabric::open(const char *name, uint32_t layout) {
  name_ = name;
  layout_ = layout;
  const std::string path = uverbs_path(name_.substr(sizeof kPrefix - 1));
  if (path.empty()) return ENODEV;
  fd_ = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd_ < 0) return errno;
  alignas(8) unsigned char r[sizeof(ib_uverbs_get_context_resp) + sizeof info_] = {};
  // The command, then its driver data: this node's layout, which the node table publishes.
  struct {
    uint64_t response;
    pcientb_ucontext_req req;
  } gc{};
  static_assert(sizeof(ib_uverbs_get_context) == offsetof(decltype(gc), req));
  gc.response = response_at(r);
  gc.req.layout = layout;
  if (int err = execute(fd_, IB_USER_VERBS_CMD_GET_CONTEXT, gc, sizeof r)) return err;
  ib_uverbs_get_context_resp core{};
  memcpy(&core, r, sizeof core);
  memcpy(&info_, r + sizeof core, sizeof info_);  // the driver data follow the core answer
  event_fd_ = static_cast<int>(core.async_fd);    // the port's and the device's events
  fcntl(event_fd_, F_SETFL, fcntl(event_fd_, F_GETFL) | O_NONBLOCK);
  if (info_.magic != PCIENTB_UCONTEXT_MAGIC || info_.abi_version != PCIENTB_UVERBS_ABI_VERSION)
    return EPROTO;
  ib_uverbs_query_device_resp dev{};
  ib_uverbs_query_device qd{};
  qd.response = response_at(&dev);
  if (int err = execute(fd_, IB_USER_VERBS_CMD_QUERY_DEVICE, qd, sizeof dev)) return err;
  guid_ = be64toh(dev.node_guid);
  ib_uverbs_alloc_pd_resp pd{};
  ib_uverbs_alloc_pd ap{};
  ap.response = response_at(&pd);
  if (int err = execute(fd_, IB_USER_VERBS_CMD_ALLOC_PD, ap, sizeof pd)) return err;
  pd_ = pd.pd_handle;
  void *a = mmap(nullptr, info_.area_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd_,
                 PCIENTB_MMAP_AREA * kPage);
  if (a == MAP_FAILED) return errno;
  area_ = static_cast<uint8_t *>(a);
  table_bytes_ = (info_.table_entries * sizeof(pcientb_node_entry) + kPage - 1) & ~(kPage - 1);
  void *t = mmap(nullptr, table_bytes_, PROT_READ, MAP_SHARED, fd_, PCIENTB_MMAP_TABLE * kPage);
  if (t == MAP_FAILED) return errno;
  table_ = static_cast<const pcientb_node_entry *>(t);
  if (info_.table_entries * sizeof(uint32_t) > kPage) return EPROTO;
  void *m = mmap(nullptr, kPage, PROT_READ, MAP_SHARED, fd_, PCIENTB_MMAP_MASKS * kPage);
  if (m == MAP_FAILED) return errno;
  masks_ = static_cast<const std::atomic<uint32_t> *>(m);
  peers_.resize(info_.table_entries);
  bell_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (bell_fd_ < 0) return errno;
  pcientb_doorbell db{};
  db.fd = bell_fd_;
  return method(fd_, PCIENTB_METHOD_DOORBELL, db);
}

KernelFabric::~KernelFabric() {
  peers_.clear();
  retired_.clear();
  if (table_) munmap(const_cast<pcientb_node_entry *>(table_), table_bytes_);
  if (masks_) munmap(const_cast<std::atomic<uint32_t> *>(masks_), kPage);
  if (area_) munmap(area_, info_.area_size);
  if (bell_fd_ >= 0) close(bell_fd_);
  if (event_fd_ >= 0) close(event_fd_);
  if (fd_ >= 0) close(fd_);  // the node goes: the module tells its peers
}

Peer *KernelFabric::peer(uint16_t lid) {
  if (lid >= peers_.size()) return nullptr;
  std::lock_guard<std::mutex> g(peers_mu_);
  if (KernelPeer *p = peers_[lid].get(); p && p->live()) return p;
  if (peers_[lid]) retired_.push_back(std::move(peers_[lid]));
  const pcientb_node_entry &e = table_[lid];
  auto *life = reinterpret_cast<const std::atomic<uint32_t> *>(&e.life);
  const uint32_t value = life->load(std::memory_order_acquire);
  const uint64_t nonce = __atomic_load_n(&e.nonce, __ATOMIC_ACQUIRE);
  // The module writes the nonce, then the life made of it: a pair that does not
  // match was read across another incarnation's coming or going.
  if (!value || value != (static_cast<uint32_t>(nonce) | 1)) return nullptr;
  // A node of another build of the provider would misread our posts, and we its area.
  if (e.layout != layout_) {
    if (!warned_layout_.exchange(true))
      fprintf(stderr,
              "pcientb: %s: node %u runs another build of the pcientb provider (layout %08x, "
              "this one %08x): it is not reached (use one build on all nodes)\n",
              name_.c_str(), lid, e.layout, layout_);
    return nullptr;
  }
  const bool self = lid == info_.lid;
  // A node of the other host: the other half of the LIDs.
  const bool across = lid / PCIENTB_LIDS_PER_PORT != info_.lid / PCIENTB_LIDS_PER_PORT;
  uint8_t *area = area_;
  size_t area_size = info_.area_size;
  if (across) {
    area_size = size_t{e.chunks} * info_.chunk_bytes;
    area = map_remote(lid, e.chunks);
  } else if (!self) {
    void *m = mmap(nullptr, info_.area_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd_,
                   static_cast<off_t>(PCIENTB_MMAP_PEER(lid) * kPage));
    if (m == MAP_FAILED) return nullptr;
    area = static_cast<uint8_t *>(m);
  }
  peers_[lid] =
      std::make_unique<KernelPeer>(lid, nonce, life, value, area, area_size, self, across);
  // Mapped after another incarnation took the LID: this one is gone already.
  if (life->load(std::memory_order_acquire) != value) peers_[lid]->mark_dead();
  return peers_[lid].get();
}

// The area of node `lid` across the bridge, its chunks mapped side by side; nullptr when
// the module cannot map it (the node went meanwhile): posts then go by system call.
uint8_t *KernelFabric::map_remote(uint16_t lid, uint32_t chunks) {
  const size_t chunk = info_.chunk_bytes, len = chunks * chunk;
  if (!chunks || !chunk || chunks > PCIENTB_MMAP_REMOTE_CHUNKS) return nullptr;
  void *base = mmap(nullptr, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) return nullptr;
  auto *at = static_cast<uint8_t *>(base);
  for (uint32_t i = 0; i < chunks; ++i) {
    const auto off = static_cast<off_t>(PCIENTB_MMAP_REMOTE(lid, i) * kPage);
    if (mmap(at + i * chunk, chunk, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd_, off) ==
        MAP_FAILED) {
      munmap(base, len);
      return nullptr;
    }
  }
  return at;
}

int KernelFabric::death_fd(Peer &pp) {
  auto &p = static_cast<KernelPeer &>(pp);
  std::lock_guard<std::mutex> g(peers_mu_);
  if (p.watch_fd < 0) {
    pcientb_watch cmd{};
    cmd.lid = p.lid();
    cmd.nonce = p.nonce();
    pcientb_watch_resp resp{};
    resp.fd = -1;
    if (method(fd_, PCIENTB_METHOD_WATCH, cmd, &resp, sizeof resp) == 0) p.watch_fd = resp.fd;
  }
  return p.watch_fd;
}

int KernelFabric::expose(void *addr, size_t len, WindowId *out) {
  ib_uverbs_reg_mr_resp r{};
  ib_uverbs_reg_mr cmd{};
  cmd.response = response_at(&r);
  cmd.start = reinterpret_cast<uintptr_t>(addr);
  cmd.length = len;
  cmd.hca_va = cmd.start;  // a window is addressed by its owner's addresses
  cmd.pd_handle = pd_;
  // The engine checks rights per MR; the window takes what the memory allows.
  cmd.access_flags = IB_UVERBS_ACCESS_LOCAL_WRITE | IB_UVERBS_ACCESS_REMOTE_WRITE |
                     IB_UVERBS_ACCESS_REMOTE_READ | IB_UVERBS_ACCESS_REMOTE_ATOMIC;
  int err = execute(fd_, IB_USER_VERBS_CMD_REG_MR, cmd, sizeof r);
  if (err == EFAULT) {  // read-only memory: readable through the window only
    cmd.access_flags = IB_UVERBS_ACCESS_REMOTE_READ;
    err = execute(fd_, IB_USER_VERBS_CMD_REG_MR, cmd, sizeof r);
  }
  if (err) return err;
  out->index = r.rkey >> 8;
  out->gen = r.rkey & 0xff;
  std::lock_guard<std::mutex> g(windows_mu_);
  windows_[r.rkey] = r.mr_handle;
  return 0;
}

void KernelFabric::unexpose(WindowId id) {
  const uint32_t key = id.index << 8 | id.gen;
  ib_uverbs_dereg_mr cmd{};
  {
    std::lock_guard<std::mutex> g(windows_mu_);
    auto it = windows_.find(key);
    if (it == windows_.end()) return;
    cmd.mr_handle = it->second;
    windows_.erase(it);
  }
  // Returns once no move of a peer reaches the pages (the module waits for them).
  execute(fd_, IB_USER_VERBS_CMD_DEREG_MR, cmd, 0);
}

MoveStatus KernelFabric::move(Peer &p, WindowId w, uint64_t raddr, void *local, size_t len,
                              uint32_t dir) {
  if (!p.live()) return MoveStatus::peer_dead;
  pcientb_move cmd{};
  cmd.lid = p.lid();
  cmd.window = w.index << 8 | w.gen;
  cmd.raddr = raddr;
  cmd.addr = reinterpret_cast<uintptr_t>(local);
  cmd.length = len;
  cmd.dir = dir;
  const int err = method(fd_, PCIENTB_METHOD_MOVE, cmd);
  if (!err) return MoveStatus::ok;
  return p.live() ? MoveStatus::bad_window : MoveStatus::peer_dead;
}

std::unique_ptr<Fabric> open_kernel(const char *name, uint32_t layout, int *err) {
  auto f = std::make_unique<KernelFabric>();
  if (int e = f->open(name, layout)) {
    *err = e;
    return nullptr;
  }
  return f;
}

uint64_t no_guid() {
  return 0;  // a kernel device's GUID is the module's (sysfs), not the backend's
}

// The fabrics of pcientb.ko's devices: "kernel:<device>", sorted.
std::vector<std::string> kernel_fabric_names() {
  std::vector<std::string> names;
  for (const auto &[name, path] : uverbs_devices())
    if (name.rfind("pcientb", 0) == 0) names.push_back(kPrefix + name);
  return names;
}

// The node table of a device, through a context that is not a node, and the
// areas of its host's nodes mapped read-only. Nodes across the bridge are
// listed without their areas (EREMOTE: a load through the window would cross
// the link), as are nodes of another build (EPROTO: their areas would be
// misread). The module keeps no pid: NodeView::pid is 0.
class KernelFabricView final : public FabricView {
 public:
  ~KernelFabricView() override {
    for (auto [m, len] : maps_) munmap(m, len);
    if (fd_ >= 0) close(fd_);
  }
  int open(const char *name, uint32_t layout) {
    name_ = name;
    if (!is_kernel_fabric(name)) return ENOENT;
    const std::string path = uverbs_path(name_.substr(sizeof kPrefix - 1));
    if (path.empty()) return ENOENT;
    fd_ = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd_ < 0) return errno;
    pcientb_ucontext_resp info{};
    if (int err = get_context_without_node(fd_, &info)) return err;
    if (info.magic != PCIENTB_UCONTEXT_MAGIC || info.abi_version != PCIENTB_UVERBS_ABI_VERSION)
      return EPROTO;
    const size_t table_bytes =
        (info.table_entries * sizeof(pcientb_node_entry) + kPage - 1) & ~(kPage - 1);
    void *t = mmap(nullptr, table_bytes, PROT_READ, MAP_SHARED, fd_, PCIENTB_MMAP_TABLE * kPage);
    if (t == MAP_FAILED) return errno;
    maps_.emplace_back(t, table_bytes);
    const auto *table = static_cast<const pcientb_node_entry *>(t);
    const uint32_t half = info.port & 1;  // this host's half of the LIDs (pcientb_ib.c)
    for (uint32_t lid = 0; lid < info.table_entries; ++lid) {
      if (!__atomic_load_n(&table[lid].life, __ATOMIC_ACQUIRE)) continue;
      NodeView v;
      v.lid = static_cast<uint16_t>(lid);
      v.alive = true;
      if (lid / PCIENTB_LIDS_PER_PORT != half) {
        v.error = EREMOTE;
      } else if (table[lid].layout != layout) {
        v.error = EPROTO;
      } else {
        void *a = mmap(nullptr, info.area_size, PROT_READ, MAP_SHARED, fd_,
                       static_cast<off_t>(PCIENTB_MMAP_PEER(lid) * kPage));
        if (a == MAP_FAILED) {
          v.error = errno;
        } else {
          maps_.emplace_back(a, info.area_size);
          v.area = a;
          v.area_size = info.area_size;
        }
      }
      nodes_.push_back(v);
    }
    return 0;
  }
  const char *name() const override { return name_.c_str(); }
  const std::vector<NodeView> &nodes() const override { return nodes_; }

 private:
  std::string name_;
  int fd_ = -1;
  std::vector<NodeView> nodes_;
  std::vector<std::pair<void *, size_t>> maps_;
};

std::unique_ptr<FabricView> view_kernel_fabric(const char *name, uint32_t layout, int *err) {
  auto v = std::make_unique<KernelFabricView>();
  if (int e = v->open(name, layout)) {
    *err = e;
    return nullptr;
  }
  return v;
}

}  // namespace

bool is_kernel_fabric(const char *name) {
  return strncmp(name, kPrefix, sizeof kPrefix - 1) == 0;
}

const Backend &kernel_backend() {
  static const Backend b{"kernel", open_kernel, no_guid, kernel_fabric_names, view_kernel_fabric};
  return b;
}

}  // namespace pcientb::fabric::kernel
