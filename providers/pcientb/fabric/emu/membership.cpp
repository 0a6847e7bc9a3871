// The emulated NTB fabric: nodes are processes of one user on one machine.
// This file: who is on the fabric.
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
#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "fabric/emu/emu.hpp"
#include "fabric/emu/kernel_vm.hpp"

namespace pcientb::fabric::emu {

uint64_t emu_node_guid() {
  // Vendor 0x10b5 (PLX/Broadcom), part 0x8749, then the process: unique per node.
  return (uint64_t{0x0010b5} << 40) | (uint64_t{0x8749} << 24) |
         (static_cast<uint64_t>(getpid()) & 0xffffff);
}

// PCIENTB_NTB_STRICT=1: peers are rung whatever their mask, which only an
// NT port's receiving side would apply: no load from a peer's memory is left.
bool strict_from_env() {
  const char *e = getenv("PCIENTB_NTB_STRICT");
  return e && *e && strcmp(e, "0") != 0;
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

uint64_t fd_ino(int fd) {
  struct stat st {};
  return fstat(fd, &st) == 0 ? st.st_ino : 0;
}

namespace {

// The engine's layout mixed with this backend's own (FNV-1a over the sizes peers rely on).
uint32_t fabric_layout(uint32_t engine) {
  const uint64_t parts[] = {engine,
                            sizeof(TableFile),
                            sizeof(NodeSlot),
                            sizeof(SegHeader),
                            kMaxWindows,
                            kMaxExtents,
                            kMaxChunks,
                            sizeof(WindowEntry),
                            kAreaSize,
                            offsetof(SegHeader, life),
                            offsetof(SegHeader, quiet_until)};
  uint32_t h = 2166136261u;
  for (uint64_t p : parts)
    for (int i = 0; i < 8; ++i) h = (h ^ uint8_t(p >> (8 * i))) * 16777619u;
  return h ? h : 1;  // 0 is "unknown" (an older build's table)
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

struct TableLock {
  explicit TableLock(int fd) : fd_(fd) { flock(fd_, LOCK_EX); }
  TableLock(int fd, std::adopt_lock_t) : fd_(fd) {}
  ~TableLock() { flock(fd_, LOCK_UN); }
  int fd_;
};

}  // namespace

// ---- joining and leaving -------------------------------------------------
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
    memset(static_cast<void *>(table_), 0, sizeof *table_);  // fields atomic or plain
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
    // Before this node moves anything (seq_cst: see wait_for_movers).
    if (table_->high_lid.load(std::memory_order_relaxed) < lid_) table_->high_lid.store(lid_);
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

bool EmuFabric::member() {
  struct stat named {
  }, held{};
  if (stat(path_.c_str(), &named) || fstat(table_fd_, &held) || named.st_ino != held.st_ino)
    return false;  // the table was removed or replaced: nobody can find us
  return table_->slots[lid_ - 1].nonce == nonce_;
}

// The life thread only sleeps: its robust list (the life word) is what the
// kernel processes when the process dies. It replaces the robust list glibc
// gave the thread, which holds no robust mutex.
int EmuFabric::start_life() {
  std::atomic<int> started{0};
  life_ = std::thread([this, &started] {
    pthread_setname_np(pthread_self(), "pcientb-life");
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

// ---- views, for management tools -----------------------------------------

namespace {

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
}  // namespace pcientb::fabric::emu

namespace pcientb::fabric {

const Backend &emu_backend() {
  static const Backend b{"emulated", emu::open_emu_fabric, emu::emu_node_guid,
                         emu::emu_fabric_names, emu::view_emu_fabric};
  return b;
}

}  // namespace pcientb::fabric
