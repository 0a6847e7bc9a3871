// The node (this process on a fabric), device and port queries, completion
// channels, async events and the progress thread.
#include <endian.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <map>
#include <mutex>
#include <set>
#include <string>

#include "engine/engine.hpp"
#include "engine/responder.hpp"

namespace pcientb::engine {

uint64_t now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000u + uint64_t(ts.tv_nsec);
}

uint64_t coarse_now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  return uint64_t(ts.tv_sec) * 1000000000u + uint64_t(ts.tv_nsec);
}

// ---- node -----------------------------------------------------------------

namespace {
// The nodes of this process, for what concerns them all: fork() and exit.
// Never destroyed: atexit handlers may run after static destructors.
std::mutex &nodes_mu = *new std::mutex;
std::set<Node *> &live_nodes = *new std::set<Node *>;
}  // namespace

// fork() while the progress thread holds a lock (its allocator's, under a
// sanitizer) would leave the child's copy of that lock held forever: the
// progress threads of this process's nodes are parked over fork().
void Node::before_fork() {
  nodes_mu.lock();
  for (Node *n : live_nodes)
    if (n->pid_ == getpid()) n->park_progress(true);
}

void Node::after_fork_in_parent() {
  for (Node *n : live_nodes)
    if (n->pid_ == getpid()) n->park_progress(false);
  nodes_mu.unlock();
}

void Node::after_fork_in_child() {
  nodes_mu.unlock();  // the child's nodes are new ones; these are its parent's
}

void Node::park_progress(bool park) {
  std::unique_lock<std::mutex> l(prog_mu_);
  park_ = park;
  if (!park) {
    parked_cv_.notify_all();
    return;
  }
  wake();
  parked_cv_.wait(l, [this] { return parked_ || stop_; });
}

std::shared_ptr<Node> Node::acquire(const char *fabric_name, int *err) {
  static std::mutex mu;
  static std::map<std::string, std::weak_ptr<Node>> nodes;
  std::lock_guard<std::mutex> g(mu);
  // A forked child is a new node: what it inherited belongs to its parent.
  if (auto n = nodes[fabric_name].lock(); n && n->pid_ == getpid()) return n;
  std::shared_ptr<Node> n(new Node());
  n->pid_ = getpid();
  n->fab_ = fabric::backend_for(fabric_name).open(fabric_name, kAreaLayout, err);
  if (!n->fab_) return nullptr;
  n->root_ = static_cast<AreaRoot *>(n->fab_->area());
  n->root_->magic = kAreaMagic;
  n->describe();
  n->bump_ = (sizeof(AreaRoot) + kAreaPage - 1) & ~(kAreaPage - 1);
  n->self_ = n->fab_->peer(n->fab_->lid());
  n->wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (!n->self_ || n->wake_fd_ < 0) {
    *err = n->self_ ? errno : EIO;
    return nullptr;
  }
  n->progress_ = std::thread([p = n.get()] { p->progress_loop(); });
  if (const char *to = getenv("PCIENTB_STATS"); to && *to) n->stats_to_ = to;
  static std::once_flag process_hooks;
  std::call_once(process_hooks, [] {
    pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child);
    atexit(report_all_at_exit);
  });
  {
    std::lock_guard<std::mutex> r(nodes_mu);
    live_nodes.insert(n.get());
  }
  nodes[fabric_name] = n;
  return n;
}

void Node::describe() {
  NodeStats &st = root_->stats;
  memset(st.comm, 0, sizeof st.comm);
  if (FILE *f = fopen("/proc/self/comm", "re")) {
    if (fgets(st.comm, sizeof st.comm, f)) st.comm[strcspn(st.comm, "\n")] = 0;
    fclose(f);
  }
  st.pid = pid_;
  st.lid = fab_->lid();
  st.guid = fab_->node_guid();
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  st.started_ns = uint64_t(ts.tv_sec) * 1000000000 + uint64_t(ts.tv_nsec);
}

Node::~Node() {
  {
    std::lock_guard<std::mutex> r(nodes_mu);
    live_nodes.erase(this);
    report_traffic();
  }
  {
    std::lock_guard<std::mutex> g(prog_mu_);
    stop_ = true;
  }
  parked_cv_.notify_all();
  wake();
  if (progress_.joinable()) progress_.join();
  if (wake_fd_ >= 0) close(wake_fd_);
}

// Whole pages, best fit, free neighbours merged: a node that creates and
// destroys queues of every size forever neither fragments nor grows its area.
// Freed pages go back to the system and read as zeros (an empty ring) when
// they are handed out again.
Off Node::alloc(size_t bytes) {
  bytes = (bytes + kAreaPage - 1) & ~(kAreaPage - 1);
  std::lock_guard<std::mutex> g(mu_);
  Off off;
  if (auto it = free_by_size_.lower_bound({bytes, 0}); it != free_by_size_.end()) {
    auto [size, at] = *it;
    free_by_size_.erase(it);
    free_at_.erase(at);
    if (size > bytes) {
      free_at_[at + bytes] = size - bytes;
      free_by_size_.insert({size - bytes, at + bytes});
    }
    off = at;
  } else {
    if (bump_ + bytes > fab_->area_size()) return 0;
    off = bump_;
    bump_ += bytes;
    kept_above_ -= std::min(kept_above_, bytes);
  }
  used_[off] = bytes;
  return off;
}

void Node::free(Off off) {
  if (!off) return;
  std::lock_guard<std::mutex> g(mu_);
  auto u = used_.find(off);
  if (u == used_.end()) return;
  size_t size = u->second;
  used_.erase(u);
  const Off piece = off;
  const size_t piece_size = size;
  // Merge with the free blocks on either side.
  if (auto next = free_at_.find(off + size); next != free_at_.end()) {
    free_by_size_.erase({next->second, next->first});
    size += next->second;
    free_at_.erase(next);
  }
  if (auto prev = free_at_.lower_bound(off); prev != free_at_.begin()) {
    --prev;
    if (prev->first + prev->second == off) {
      free_by_size_.erase({prev->second, prev->first});
      off = prev->first;
      size += prev->second;
      free_at_.erase(prev);
    }
  }
  // A piece freed in a small free block is likely the next allocation's (churning QPs): it
  // stays resident, zeroed. In a large one it goes back to the system, and so does the top of
  // the area once 1 MiB above it is kept: memory used in a burst is not kept for ever.
  constexpr size_t kKeep = 1 << 20;
  if (off + size == bump_) {
    bump_ = off;  // the top of the area shrinks instead
    kept_above_ += size;
    if (kept_above_ < kKeep) {
      fab_->discard(piece, piece_size, true);
    } else {
      fab_->discard(bump_, kept_above_, false);
      kept_above_ = 0;
    }
    return;
  }
  fab_->discard(piece, piece_size, size < kKeep);
  free_at_[off] = size;
  free_by_size_.insert({size, off});
}

bool Node::take_quota(Quota q) {
  auto &n = quota_[static_cast<int>(q)];
  uint32_t v = n.load(std::memory_order_relaxed);
  do {
    if (v >= kQuotaLimit[static_cast<int>(q)]) return false;
  } while (!n.compare_exchange_weak(v, v + 1, std::memory_order_relaxed));
  return true;
}

void Node::give_quota(Quota q) {
  quota_[static_cast<int>(q)].fetch_sub(1, std::memory_order_relaxed);
}

int Node::alloc_mr(uint32_t *idx, uint32_t *key) {
  std::lock_guard<std::mutex> g(mu_);
  for (uint32_t n = 0; n < kMaxMrs - 1; ++n) {
    uint32_t i = 1 + (next_mr_ - 1 + n) % (kMaxMrs - 1);
    if (root_->mrs[i].key.load(std::memory_order_relaxed) == 0 && !(mr_gen_[i] & 0x80)) {
      mr_gen_[i] = static_cast<uint8_t>(((mr_gen_[i] + 1) & 0x7f) | 0x80);  // 0x80: in use
      next_mr_ = i + 1;
      *idx = i;
      *key = (i << 8) | (mr_gen_[i] & 0x7f);
      return 0;
    }
  }
  return ENOMEM;
}

void Node::free_mr(uint32_t idx) {
  std::lock_guard<std::mutex> g(mu_);
  root_->mrs[idx].key.store(0, std::memory_order_release);
  mr_gen_[idx] &= 0x7f;
}

int Node::alloc_qp(Qp *qp, uint32_t *idx, uint32_t *qpn) {
  std::lock_guard<std::mutex> g(mu_);
  for (uint32_t n = 0; n < kMaxQps - 1; ++n) {
    uint32_t i = 1 + (next_qp_ - 1 + n) % (kMaxQps - 1);
    if (qps_[i].load(std::memory_order_relaxed)) continue;
    qp_gen_[i] = static_cast<uint16_t>(qp_gen_[i] % 4095 + 1);
    next_qp_ = i + 1;
    qp->sh = &root_->qps[i];  // before the QP can be found (qp_by_idx)
    qps_[i].store(qp, std::memory_order_release);
    *idx = i;
    *qpn = (uint32_t{qp_gen_[i]} << 12) | i;
    qp->stats = &root_->qp_stats[i];
    qp->stats->clear();
    qp->stats->qpn.store(*qpn, std::memory_order_relaxed);
    return 0;
  }
  return ENOMEM;
}

Qp *Node::qp_by_idx(uint32_t idx) {
  return idx < kMaxQps ? qps_[idx].load(std::memory_order_acquire) : nullptr;
}

// ---- progress thread --------------------------------------------------------

constexpr uint64_t kMembershipPeriodNs = 1000000000;

void Node::wake() {
  uint64_t one = 1;
  // The kernel's write, not libc's interposed one (see EmuFabric::ring).
  if (syscall(SYS_write, wake_fd_, &one, sizeof one) < 0) {
    // The counter is saturated only if the thread is already awake.
  }
}

void Node::schedule(Qp *qp, uint64_t due) {
  bool wake_now;
  {
    std::lock_guard<std::mutex> g(prog_mu_);
    // An answer may come for a QP being destroyed: once retired, it stays out.
    if (qp->retired) return;
    pending_.insert(qp);
    uint64_t next = next_due_ns_.load(std::memory_order_relaxed);
    if (!next || due < next) next_due_ns_.store(due, std::memory_order_relaxed);
    // A thread that polls runs it when due; the progress thread is woken
    // only if it would otherwise sleep past that (an answer's deadline is
    // a second away: no wake-up per request).
    wake_now = due < sleep_until_ns_;
  }
  if (wake_now) wake();
}

uint64_t Node::run_pending_locked() {
  uint64_t next = 0;
  for (auto it = pending_.begin(); it != pending_.end();) {
    uint64_t t = progress_qp(*it);
    if (t == 0) {
      it = pending_.erase(it);
    } else {
      next = next ? std::min(next, t) : t;
      ++it;
    }
  }
  next_due_ns_.store(next, std::memory_order_relaxed);
  return next;
}

void Node::run_due() {
  std::unique_lock<std::mutex> g(prog_mu_, std::try_to_lock);
  if (g.owns_lock()) run_pending_locked();
}

void Node::attach(Context *ctx) {
  std::lock_guard<std::mutex> g(prog_mu_);
  contexts_.insert(ctx);
}

void Node::detach(Context *ctx) {
  std::lock_guard<std::mutex> g(prog_mu_);
  contexts_.erase(ctx);
}

void Node::retire_qp(Qp *qp) {
  // Under prog_mu_, as on_peer_death runs: it never sees a QP being freed.
  std::lock_guard<std::mutex> g(prog_mu_);
  pending_.erase(qp);
  qp->retired = true;
  std::lock_guard<std::mutex> t(mu_);
  root_->qps[qp->idx].qpn.store(0, std::memory_order_release);
  qps_[qp->idx].store(nullptr, std::memory_order_release);
  qp->stats->add_to(root_->stats.gone);
  qp->stats->qpn.store(0, std::memory_order_relaxed);
}

namespace {
// A free entry of a directory (at most as many live objects as entries: the
// quota), which then names `off`.
uint32_t dir_add(std::atomic<Off> *dir, uint32_t n, Off off) {
  for (uint32_t i = 0; i < n; ++i)
    if (dir[i].load(std::memory_order_relaxed) == 0) {
      dir[i].store(off, std::memory_order_release);
      return i;
    }
  return n;
}
}  // namespace

void Node::add_cq(Cq *cq) {
  std::lock_guard<std::mutex> g(mu_);
  cqs_.insert(cq);
  cq->dir = dir_add(root_->cq_dir, kMaxCqs, cq->off);
}

void Node::remove_cq(Cq *cq) {
  std::lock_guard<std::mutex> g(mu_);
  cqs_.erase(cq);
  if (cq->dir < kMaxCqs) root_->cq_dir[cq->dir].store(0, std::memory_order_relaxed);
}

void Node::add_srq(Srq *srq) {
  std::lock_guard<std::mutex> g(mu_);
  srqs_.insert(srq);
  srq->dir = dir_add(root_->srq_dir, kMaxSrqs, srq->off);
}

void Node::remove_srq(Srq *srq) {
  std::lock_guard<std::mutex> g(mu_);
  srqs_.erase(srq);
  if (srq->dir < kMaxSrqs) root_->srq_dir[srq->dir].store(0, std::memory_order_relaxed);
}

void Node::traffic(QpStats *sum) {
  std::lock_guard<std::mutex> g(mu_);
  root_->stats.gone.add_to(*sum);
  for (const auto &q : qps_)
    if (Qp *qp = q.load(std::memory_order_relaxed)) qp->stats->add_to(*sum);
}

// With nodes_mu.
void Node::report_traffic() {
  // A forked child holds a copy of its parent's node: not its to report.
  if (reported_ || stats_to_.empty() || getpid() != pid_) return;
  reported_ = true;
  auto c = std::make_unique<QpStats>();
  traffic(c.get());
  std::string line = "pcientb-stats pid=" + std::to_string(pid_) + " fabric=" + fab_->name() +
                     " lid=" + std::to_string(fab_->lid());
  auto field = [&](const char *name, const char *what, const Stat &v) {
    line += std::string(" ") + name + what + std::to_string(v.get());
  };
  for (int i = 0; i < kTxKinds; ++i) {
    field(kTxNames[i], "_ops=", c->tx_ops[i]);
    field(kTxNames[i], "_bytes=", c->tx_bytes[i]);
  }
  // Receives of both kinds, as one figure.
  Stat recv_ops, recv_bytes;
  recv_ops.set(c->rx_ops[0].get() + c->rx_ops[1].get());
  recv_bytes.set(c->rx_bytes[0].get() + c->rx_bytes[1].get());
  field("recv", "_ops=", recv_ops);
  field("recv", "_bytes=", recv_bytes);
  // Errors: send completions in error, flushes not counted.
  uint64_t errors = 0;
  for (int s = 1; s < kWcStatuses; ++s)
    if (s != IBV_WC_WR_FLUSH_ERR) errors += c->tx_status[s].get();
  line += " errors=" + std::to_string(errors) + "\n";
  // One write of one line: lines of processes that end together do not mix.
  int fd = stats_to_ == "stderr"
               ? dup(STDERR_FILENO)
               : open(stats_to_.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return;
  if (::write(fd, line.data(), line.size()) != static_cast<ssize_t>(line.size())) {
    // Nothing to do about a statistics line that could not be written.
  }
  close(fd);
}

void Node::report_all_at_exit() {
  std::lock_guard<std::mutex> r(nodes_mu);
  for (Node *n : live_nodes) n->report_traffic();
}

void Node::watch(fabric::Peer *peer) {
  if (!peer || peer == self_) return;
  {
    // Not prog_mu_: a WR retried by the progress thread (which holds it)
    // may find its peer only now.
    std::lock_guard<std::mutex> g(watch_mu_);
    if (!watched_.insert(peer).second) return;
  }
  wake();
}

// As an HCA: a QP connected to a dead peer learns of it only when it sends.
// WRs waiting in a backlog fail at their next attempt, newly posted ones at
// once (RETRY_EXC_ERR); an idle QP and its posted receives stay as they are.
void Node::on_peer_death(fabric::Peer *peer) {
  peer->mark_dead();
}

// What the device under the fabric reports reaches every context, as an
// HCA's async events: the port going down or up, the device going away (the
// node is lost then: its membership is not asked again).
void Node::on_device_events() {
  for (int e; (e = fab_->device_event()) >= 0;) {
    const auto type = static_cast<ibv_event_type>(e);
    std::lock_guard<std::mutex> g(prog_mu_);
    if (type == IBV_EVENT_DEVICE_FATAL) {
      if (lost_) continue;
      lost_ = true;
    }
    const uint64_t element = type == IBV_EVENT_DEVICE_FATAL ? 0 : 1;  // the port
    for (Context *c : contexts_) c->raise_async(element, type);
  }
}

void Node::progress_loop() {
  pthread_setname_np(pthread_self(), "pcientb-progres");  // top -H, perf: 15 chars
  constexpr size_t kFirstDeathFd = 3;  // after the wake, doorbell and device event fds
  std::vector<pollfd> fds;
  std::vector<fabric::Peer *> peers;
  for (;;) {
    uint64_t next = 0;
    fds.assign({pollfd{wake_fd_, POLLIN, 0}, pollfd{fab_->doorbell_fd(), POLLIN, 0},
                pollfd{fab_->device_event_fd(), POLLIN, 0}});
    peers.clear();
    {
      std::unique_lock<std::mutex> g(prog_mu_);
      while (park_ && !stop_) {  // over fork(), holding nothing
        parked_ = true;
        parked_cv_.notify_all();
        parked_cv_.wait(g);
      }
      parked_ = false;
      if (stop_) return;
      next = run_pending_locked();
      // A node whose place on the fabric is gone is a device that failed.
      uint64_t now = now_ns();
      if (!lost_ && now - membership_checked_ns_ >= kMembershipPeriodNs) {
        membership_checked_ns_ = now;
        if (!fab_->member()) {
          lost_ = true;
          for (Context *c : contexts_) c->raise_async(0, IBV_EVENT_DEVICE_FATAL);
        }
      }
      if (!lost_) {
        uint64_t check = membership_checked_ns_ + kMembershipPeriodNs;
        next = next ? std::min(next, check) : check;
      }
      sleep_until_ns_ = next ? next : UINT64_MAX;
      std::lock_guard<std::mutex> w(watch_mu_);
      for (fabric::Peer *p : watched_) {
        int fd = p->dead() ? -1 : fab_->death_fd(*p);
        if (fd < 0) continue;
        fds.push_back(pollfd{fd, POLLIN, 0});
        peers.push_back(p);
      }
    }
    // Peers do not ring while this node's threads poll (the fabric's mask):
    // what they post meanwhile is looked at here when that ends. A mask set
    // after the read below wakes this thread (poll_progress): the plan is
    // published first.
    looks_at_ns_.store(next ? next : UINT64_MAX, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (uint64_t quiet = fab_->quiet_until_ns(); quiet > now_ns()) {
      next = next ? std::min(next, quiet) : quiet;
      looks_at_ns_.store(next, std::memory_order_relaxed);
    } else if (quiet && fab_->quiet_ran_out(quiet)) {
      // The mask ran out (the polls stopped without arming a CQ) and peers are told: what
      // they posted without ringing is taken.
      service();
      continue;
    }
    timespec ts{}, *tsp = nullptr;
    if (next) {
      uint64_t now = now_ns();
      uint64_t d = next > now ? next - now : 0;
      ts.tv_sec = static_cast<time_t>(d / 1000000000u);
      ts.tv_nsec = static_cast<long>(d % 1000000000u);
      tsp = &ts;
    }
    int n = ppoll(fds.data(), fds.size(), tsp, nullptr);
    if (n <= 0) {
      service();
      continue;
    }
    if (fds[0].revents) {
      uint64_t v;  // an eventfd: one read takes all wakes
      (void)!::read(wake_fd_, &v, sizeof v);
    }
    if (fds[1].revents) {  // a peer asks for a link, sent a request or an answer
      fab_->clear_doorbell();
      serve_links();
    }
    if (fds[2].revents) on_device_events();
    service();
    for (size_t i = kFirstDeathFd; i < fds.size(); ++i) {
      if (!fds[i].revents) continue;
      std::lock_guard<std::mutex> g(prog_mu_);
      on_peer_death(peers[i - kFirstDeathFd]);
      std::lock_guard<std::mutex> w(watch_mu_);
      watched_.erase(peers[i - kFirstDeathFd]);
    }
  }
}

// ---- context --------------------------------------------------------------

namespace {
const char *fabric_at_load = nullptr;
__attribute__((constructor)) void read_fabric_at_load() {
  const char *name = getenv("PCIENTB_FABRIC");
  if (name && *name) fabric_at_load = strdup(name);
}
}  // namespace

const char *fabric_name() {
  const char *name = getenv("PCIENTB_FABRIC");
  if (name && *name) return name;
  return fabric_at_load ? fabric_at_load : "default";
}

Context *Context::open(int *err, const char *fabric) {
  auto node = Node::acquire(fabric ? fabric : fabric_name(), err);
  if (!node) return nullptr;
  auto *ctx = new Context();
  ctx->node = std::move(node);
  int p[2];
  if (pipe2(p, O_CLOEXEC)) {
    *err = errno;
    delete ctx;
    return nullptr;
  }
  fcntl(p[1], F_SETFL, O_NONBLOCK);
  ctx->async_rfd = p[0];
  ctx->async_wfd = p[1];
  // Told of device-wide events only once it can report them.
  ctx->node->attach(ctx);
  // The port comes up as the node joins the fabric.
  ctx->raise_async(1, IBV_EVENT_PORT_ACTIVE);
  return ctx;
}

Context::~Context() {
  if (node) node->detach(this);
  // async_rfd belongs to libibverbs (context->async_fd), which closes it.
  if (async_wfd >= 0) close(async_wfd);
}

void Context::raise_async(uint64_t element, ibv_event_type type) {
  AsyncRecord rec{element, static_cast<uint32_t>(type), 0};
  if (::write(async_wfd, &rec, sizeof rec) != sizeof rec) {
    // Full pipe: the application is not reading events; dropping is what a
    // device does with an overflowing event queue.
  }
}

int Context::query_device(ibv_device_attr_ex *out, size_t attr_size) {
  ibv_device_attr_ex a{};
  ibv_device_attr &d = a.orig_attr;
  snprintf(d.fw_ver, sizeof d.fw_ver, "1.0.0");
  d.node_guid = htobe64(node->fab().node_guid());
  d.sys_image_guid = d.node_guid;
  d.max_mr_size = uint64_t{1} << 40;
  d.page_size_cap = 0xfffff000;
  d.vendor_id = 0x10B5;
  d.vendor_part_id = 0x8749;
  d.hw_ver = 0xAB;
  d.max_qp = kMaxQps - 1;
  d.max_qp_wr = kMaxQpWr;
  d.device_cap_flags = IBV_DEVICE_RC_RNR_NAK_GEN | IBV_DEVICE_PORT_ACTIVE_EVENT |
                       IBV_DEVICE_N_NOTIFY_CQ | IBV_DEVICE_SRQ_RESIZE;
  d.max_sge = kMaxSge;
  d.max_sge_rd = kMaxSge;
  d.max_cq = kMaxCqs;
  d.max_cqe = kMaxCqe - 1;
  d.max_mr = kMaxMrs - 1;
  d.max_pd = kMaxPds;
  d.max_qp_rd_atom = kMaxRdAtom;
  d.max_res_rd_atom = kMaxRdAtom * (kMaxQps - 1);
  d.max_qp_init_rd_atom = kMaxRdAtom;
  // Served at the target with the CPU's atomics on its own memory (serve_atomic): atomic
  // against that host's CPUs as well as other initiators, which is IBV_ATOMIC_GLOB; but UCX
  // 1.13 takes only IBV_ATOMIC_HCA as "has atomics" (its rc_verbs atomics fail on GLOB), so
  // HCA is what the device says, and pcientb.h states the rest.
  d.atomic_cap = IBV_ATOMIC_HCA;
  d.max_ah = kMaxAhs;
  d.max_srq = kMaxSrqs;
  d.max_srq_wr = kMaxSrqWr - 1;
  d.max_srq_sge = kMaxSge;
  d.max_pkeys = 1;
  d.local_ca_ack_delay = 1;
  d.phys_port_cnt = 1;
  a.device_cap_flags_ex = d.device_cap_flags;
  a.phys_port_cnt_ex = d.phys_port_cnt;
  memcpy(out, &a, std::min(attr_size, sizeof a));
  return 0;
}

int Context::query_port(uint8_t port, ibv_port_attr *a) {
  if (port != 1) return EINVAL;
  memset(a, 0, sizeof *a);
  a->state = IBV_PORT_ACTIVE;
  a->max_mtu = IBV_MTU_4096;
  a->active_mtu = IBV_MTU_4096;
  a->gid_tbl_len = 1;
  a->max_msg_sz = 1u << 31;
  a->pkey_tbl_len = 1;
  a->lid = node->fab().lid();
  a->sm_lid = 1;
  a->max_vl_num = 1;
  a->subnet_timeout = 18;
  a->active_width = 2;   // 4X
  a->active_speed = 32;  // EDR
  a->phys_state = 5;     // LinkUp
  a->link_layer = IBV_LINK_LAYER_INFINIBAND;
  return 0;
}

int Context::query_gid(uint32_t port, uint32_t index, ibv_gid_entry *e) {
  if (port != 1 || index != 0) return EINVAL;
  memset(e, 0, sizeof *e);
  e->gid.global.subnet_prefix = htobe64(0xfe80000000000000ULL);
  e->gid.global.interface_id = htobe64(node->fab().node_guid());
  e->gid_index = 0;
  e->port_num = 1;
  e->gid_type = IBV_GID_TYPE_IB;
  return 0;
}

int Context::query_pkey(uint8_t port, int index, __be16 *pkey) {
  if (port != 1 || index != 0) return EINVAL;
  *pkey = htobe16(0xffff);
  return 0;
}

Channel *Context::create_channel(int *err) {
  int p[2];
  if (pipe2(p, O_CLOEXEC)) {
    *err = errno;
    return nullptr;
  }
  fcntl(p[1], F_SETFL, O_NONBLOCK);
  auto *ch = static_cast<Channel *>(calloc(1, sizeof(Channel)));
  if (!ch) {
    close(p[0]);
    close(p[1]);
    *err = ENOMEM;
    return nullptr;
  }
  ch->ibv.context = ibv;
  ch->ibv.fd = p[0];
  ch->wfd = p[1];
  return ch;
}

int Context::destroy_channel(Channel *ch) {
  if (ch->ibv.refcnt) return EBUSY;
  close(ch->ibv.fd);
  close(ch->wfd);
  ::free(ch);
  return 0;
}

void raise_event(fabric::Fabric &fab, const EventFd &to, const void *rec, size_t len) {
  if (to.fd < 0) return;
  static_cast<AreaRoot *>(fab.area())->stats.doorbells.fetch_add(1, std::memory_order_relaxed);
  // The kernel's write: under pcientb-run, libc's write() is interposed (rdma_cm), and an
  // event per SEND should not pay for that. Full (nonblocking): the reader has events
  // enough to wake.
  if (syscall(SYS_write, to.fd, rec, len) < 0) {
  }
}

}  // namespace pcientb::engine
