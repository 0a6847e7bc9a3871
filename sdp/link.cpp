// Verbs resources of one SDP connection: one RC QP, a share of a CQ and completion channel
// (a group of links), the receive ring the peer writes into, the mirror this side stages
// its writes in, and the ack slot. Public verbs API only (the provider's CQ hint is optional):
// the provider is one of the layer's users, nothing more.
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <new>
#include <random>
#include <unordered_map>
#include <vector>

#include "sdp.hpp"

namespace sdp {

struct Inbox {
  std::vector<ibv_wc> wcs;        // under the group's mu
  std::atomic<bool> news{false};  // wcs is not empty: read without the lock (hints)
  std::atomic<int> *sleepers = nullptr;
  int kick_fd = -1;
};

struct CqGroup {
  ibv_comp_channel *channel = nullptr;
  ibv_cq *cq = nullptr;
  int (*pending)(ibv_cq *) = nullptr;
  uint32_t links = 0;  // under groups_mu
  std::mutex mu;
  std::unordered_map<uint32_t, Inbox *> by_qpn;
};

namespace {

struct Device {
  ibv_context *ctx = nullptr;
  ibv_pd *pd = nullptr;
  int (*cq_pending)(ibv_cq *) = nullptr;  // the provider's hint (pcientb.h), if it has one
  uint16_t lid = 0;
  ibv_mtu mtu = IBV_MTU_4096;
  uint8_t gid[16]{};
  // Remote atomics; on a pcientb device (the only kind picked below) they are atomic with
  // the CPU's too, though it says HCA for UCX's sake (PCIENTB_ATOMICS_WITH_CPU, pcientb.h).
  bool atomics = false;
  int err = 0;
};

std::mutex dev_mu;
Device *dev = nullptr;

// Buffers of closed connections, kept for the next ones: registering memory anew moves its
// pages (about 2 ms per MiB on the emulated fabric), registering the same memory again is
// a cache hit (tens of microseconds). The MRs are deregistered at close all the same, so
// that a peer of the closed connection holds no key to the memory a new one gets.
struct Buffers {
  char *ring, *mirror;
  AckPage *page;
  uint32_t ring_bytes;
};
constexpr size_t kPoolMax = 16;  // 16 x (2 rings + 4 KiB): 32 MiB at the default ring size
std::mutex pool_mu;
std::vector<Buffers> *pool = nullptr;

// Links share CQs, kLinksPerGroup to one: an event loop with many connections finds the
// ones with news by polling a few CQs, not one per connection (the CQ lines of many
// connections, each a cache miss, cost more than the rest of a small request). What a poll
// takes goes to each link's inbox; the owner handles it under its socket's lock. Groups
// live as long as the process: an epoll set may still watch a group's channel.
constexpr uint32_t kLinksPerGroup = 8;
constexpr int kGroupCqe = int(kLinksPerGroup * (1024 + 512 + 16));  // send + recv depths

// Published once each, never removed: readers (every epoll scan) take no lock.
constexpr uint32_t kMaxGroups = 1024;  // 8192 connections
std::mutex groups_mu;                  // joining and leaving
std::atomic<CqGroup *> groups[kMaxGroups];
std::atomic<uint32_t> n_groups{0};

void unmap(const Buffers &b) {
  if (b.ring) munmap(b.ring, b.ring_bytes);
  if (b.mirror) munmap(b.mirror, b.ring_bytes);
  if (b.page) munmap(b.page, 4096);
}

void forget_device_in_child() {
  dev = nullptr;
  pool = nullptr;                 // the parent's buffers: left mapped, never reused here
  n_groups.store(0);              // the parent's CQs: its inherited sockets never poll them
  new (&groups_mu) std::mutex();  // another thread may have held it at fork()
}  // the parent's context is not the child's

// Takes what the group's CQ holds into the inboxes (g.mu held). A link gone meanwhile
// loses its entries; an owner asleep is woken.
void dispatch(CqGroup &g) {
  ibv_wc wc[32];
  for (;;) {
    int n = ibv_poll_cq(g.cq, 32, wc);
    if (n <= 0) return;
    for (int i = 0; i < n; ++i) {
      auto it = g.by_qpn.find(wc[i].qp_num);
      if (it == g.by_qpn.end()) continue;
      Inbox &box = *it->second;
      box.wcs.push_back(wc[i]);
      if (!box.news.exchange(true, std::memory_order_release) && box.sleepers &&
          box.sleepers->load(std::memory_order_acquire) > 0) {
        uint64_t one = 1;
        (void)!syscall(SYS_write, box.kick_fd, &one, sizeof one);
      }
    }
  }
}

// A group with room for one more link, with its CQ and channel; nullptr (errno) if none.
CqGroup *join_group(Device *d) {
  std::lock_guard<std::mutex> lk(groups_mu);
  const uint32_t n = n_groups.load();
  for (uint32_t i = 0; i < n; ++i) {
    CqGroup *g = groups[i].load();
    if (g->links < kLinksPerGroup) {
      ++g->links;
      return g;
    }
  }
  if (n == kMaxGroups) {
    errno = ENOMEM;
    return nullptr;
  }
  auto *g = new CqGroup();
  g->pending = d->cq_pending;
  g->channel = ibv_create_comp_channel(d->ctx);
  if (!g->channel) {
    delete g;
    return nullptr;
  }
  // Wakeups are consumed without blocking (several waiters may race for one).
  fcntl(g->channel->fd, F_SETFL, fcntl(g->channel->fd, F_GETFL) | O_NONBLOCK);
  fcntl(g->channel->fd, F_SETFD, FD_CLOEXEC);
  g->cq = ibv_create_cq(d->ctx, kGroupCqe, nullptr, g->channel, 0);
  if (!g->cq) {
    int e = errno;
    ibv_destroy_comp_channel(g->channel);
    delete g;
    errno = e;
    return nullptr;
  }
  g->links = 1;
  groups[n].store(g, std::memory_order_release);
  n_groups.store(n + 1, std::memory_order_release);
  return g;
}

Device *device() {
  std::lock_guard<std::mutex> lk(dev_mu);
  if (dev) return dev->ctx ? dev : nullptr;
  static bool atfork = (pthread_atfork(nullptr, nullptr, forget_device_in_child), true);
  (void)atfork;
  dev = new Device();
  int n = 0;
  ibv_device **list = ibv_get_device_list(&n);
  ibv_device *pick = nullptr;
  // The first: the preload lists the emulated device before any of pcientb.ko's (which
  // may have the same name and, for now, no data path).
  for (int i = 0; list && i < n && !pick; ++i)
    if (strncmp(ibv_get_device_name(list[i]), "pcientb", 7) == 0) pick = list[i];
  if (pick) dev->ctx = ibv_open_device(pick);
  if (list) ibv_free_device_list(list);
  if (!dev->ctx) {
    logf("no pcientb device (is libpcientb-preload.so loaded? use pcientb-sdp)");
    return nullptr;
  }
  dev->pd = ibv_alloc_pd(dev->ctx);
  ibv_port_attr pa{};
  ibv_gid g{};
  if (!dev->pd || ibv_query_port(dev->ctx, 1, &pa) || ibv_query_gid(dev->ctx, 1, 0, &g)) {
    logf("pcientb device unusable: %s", strerror(errno));
    ibv_close_device(dev->ctx);
    dev->ctx = nullptr;
    return nullptr;
  }
  ibv_device_attr da{};
  if (ibv_query_device(dev->ctx, &da) == 0) {
    dev->atomics = da.atomic_cap != IBV_ATOMIC_NONE;
  }
  dev->cq_pending = reinterpret_cast<int (*)(ibv_cq *)>(provider_symbol("pcientb_cq_pending"));
  dev->lid = pa.lid;
  dev->mtu = pa.active_mtu;
  memcpy(dev->gid, g.raw, 16);
  return dev;
}

void *map_buffer(size_t len) {
  void *p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return p == MAP_FAILED ? nullptr : p;
}

}  // namespace

void *provider_symbol(const char *name) {
  void *lib = dlopen("libpcientb-rdmav34.so", RTLD_NOW | RTLD_NOLOAD);
  if (!lib) return nullptr;
  void *f = dlsym(lib, name);
  dlclose(lib);  // it stays loaded: libibverbs or the preload library holds it
  return f;
}

bool link_device_usable() {
  return device() != nullptr;
}

bool link_create(Link &l, std::atomic<int> *sleepers) {
  Device *d = device();
  if (!d) {
    errno = ENODEV;
    return false;
  }
  l.ring_bytes = config().ring_bytes;
  l.recv_depth = 512;
  l.send_depth = 1024;
  {
    std::lock_guard<std::mutex> lk(pool_mu);
    if (pool && !pool->empty()) {
      const Buffers &b = pool->back();
      l.ring = b.ring, l.mirror = b.mirror, l.page = b.page;
      pool->pop_back();
    }
  }
  if (l.ring) {
    // The ring keeps the old connection's bytes: a receiver reads only what the peer's
    // immediates announced. The ack page is read as it stands (claims, the ack slot).
    memset(static_cast<void *>(l.page), 0, 4096);
  } else {
    l.ring = static_cast<char *>(map_buffer(l.ring_bytes));
    l.mirror = static_cast<char *>(map_buffer(l.ring_bytes));
    l.page = static_cast<AckPage *>(map_buffer(4096));
  }
  if (!l.ring || !l.mirror || !l.page) return false;
  const int acc = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
  // The peer claims this side's SinkAvails by compare-and-swap on the page.
  const int atomic = d->atomics ? IBV_ACCESS_REMOTE_ATOMIC : 0;
  l.ring_mr = ibv_reg_mr(d->pd, l.ring, l.ring_bytes, acc);
  l.mirror_mr = ibv_reg_mr(d->pd, l.mirror, l.ring_bytes, IBV_ACCESS_LOCAL_WRITE);
  l.ack_mr = ibv_reg_mr(d->pd, l.page, 4096, acc | atomic);
  if (!l.ring_mr || !l.mirror_mr || !l.ack_mr) return false;
  l.kick_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (l.kick_fd < 0) return false;
  l.group = join_group(d);
  if (!l.group) return false;
  l.channel = l.group->channel;
  l.cq = l.group->cq;
  l.inbox = new Inbox();
  l.inbox->sleepers = sleepers;
  l.inbox->kick_fd = l.kick_fd;
  ibv_qp_init_attr qa{};
  qa.send_cq = qa.recv_cq = l.cq;
  qa.qp_type = IBV_QPT_RC;
  qa.cap.max_send_wr = l.send_depth;
  qa.cap.max_recv_wr = l.recv_depth;
  qa.cap.max_send_sge = 1;
  qa.cap.max_recv_sge = 1;
  qa.cap.max_inline_data = 256;
  l.qp = ibv_create_qp(d->pd, &qa);
  if (!l.qp) return false;
  {
    std::lock_guard<std::mutex> lk(l.group->mu);
    l.group->by_qpn[l.qp->qp_num] = l.inbox;
  }
  l.max_inline = qa.cap.max_inline_data;
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = 0;
  a.port_num = 1;
  a.qp_access_flags =
      IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_LOCAL_WRITE | atomic;
  if (ibv_modify_qp(l.qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
    return false;

  static thread_local std::mt19937 rng(std::random_device{}());
  LinkInfo &me = l.local;
  memcpy(me.gid, d->gid, 16);
  me.lid = d->lid;
  me.qpn = l.qp->qp_num;
  me.psn = rng() & 0xffffff;
  me.ring_addr = reinterpret_cast<uintptr_t>(l.ring);
  me.ring_rkey = l.ring_mr->rkey;
  me.ring_bytes = l.ring_bytes;
  me.ack_addr = reinterpret_cast<uintptr_t>(l.page);
  me.ack_rkey = l.ack_mr->rkey;
  me.recv_depth = l.recv_depth;
  me.uid = getuid();  // the fabric's table is this user's (a server may have changed user)
  return true;
}

bool link_post_recvs(Link &l, uint32_t n) {
  // Write-with-immediate consumes a receive; the payload goes to the ring, not here.
  ibv_recv_wr wr[32];
  while (n > 0) {
    uint32_t k = n < 32 ? n : 32;
    for (uint32_t i = 0; i < k; ++i) {
      wr[i] = ibv_recv_wr{};
      wr[i].wr_id = 0;
      wr[i].num_sge = 0;
      wr[i].next = i + 1 < k ? &wr[i + 1] : nullptr;
    }
    ibv_recv_wr *bad = nullptr;
    if (int e = ibv_post_recv(l.qp, wr, &bad)) {
      errno = e;
      return false;
    }
    n -= k;
  }
  return true;
}

int link_poll(Link &l, ibv_wc *wc, int max) {
  if (!l.group) return 0;
  CqGroup &g = *l.group;
  std::lock_guard<std::mutex> lk(g.mu);
  dispatch(g);
  Inbox &box = *l.inbox;
  int n = std::min<int>(max, int(box.wcs.size()));
  std::copy(box.wcs.begin(), box.wcs.begin() + n, wc);
  box.wcs.erase(box.wcs.begin(), box.wcs.begin() + n);
  if (box.wcs.empty()) box.news.store(false, std::memory_order_relaxed);
  return n;
}

void link_dispatch_all() {
  const uint32_t n = n_groups.load(std::memory_order_acquire);
  for (uint32_t i = 0; i < n; ++i) {
    CqGroup *g = groups[i].load(std::memory_order_acquire);
    if (g->pending && !g->pending(g->cq)) continue;  // one line for the group's links
    std::lock_guard<std::mutex> lk(g->mu);
    dispatch(*g);
  }
}

namespace {

// Consumes the group's wakeups; what woke its sleepers goes to their inboxes, which kicks
// each one whose link has news (those of other links, woken by the same channel, sleep on).
void drain(CqGroup &g) {
  ibv_cq *cq;
  void *ctx;
  unsigned n = 0;
  while (ibv_get_cq_event(g.channel, &cq, &ctx) == 0) ++n;
  if (!n) return;
  ibv_ack_cq_events(g.cq, n);
  std::lock_guard<std::mutex> lk(g.mu);
  dispatch(g);
}

}  // namespace

void link_drain(Link &l) {
  if (l.group) drain(*l.group);
}

void link_drain_channel(int channel_fd) {
  const uint32_t count = n_groups.load(std::memory_order_acquire);
  for (uint32_t i = 0; i < count; ++i) {
    CqGroup *g = groups[i].load(std::memory_order_acquire);
    if (g->channel->fd == channel_fd) return drain(*g);
  }
}

bool link_has_news(const Link &l) {
  return !l.inbox || l.inbox->news.load(std::memory_order_acquire);
}

bool link_connect(Link &l) {
  Device *d = device();
  const LinkInfo &peer = l.remote;
  // The mirror that stages what this side writes into the peer's ring has this side's ring
  // size: a larger peer ring would take writes past its end (PCIENTB_SDP_RING differing).
  if (!d || peer.ring_bytes < 65536 || (peer.ring_bytes & (peer.ring_bytes - 1)) ||
      peer.ring_bytes > l.ring_bytes || peer.recv_depth < 8) {
    errno = EPROTO;
    return false;
  }
  if (!link_post_recvs(l, l.recv_depth)) return false;
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = d->mtu;
  a.dest_qp_num = peer.qpn;
  a.rq_psn = peer.psn;
  a.max_dest_rd_atomic = 16;
  a.min_rnr_timer = 12;
  a.ah_attr.dlid = static_cast<uint16_t>(peer.lid);
  a.ah_attr.port_num = 1;
  memcpy(a.ah_attr.grh.dgid.raw, peer.gid, 16);
  a.ah_attr.grh.hop_limit = 1;
  a.ah_attr.is_global = peer.lid == 0;
  int e = ibv_modify_qp(l.qp, &a,
                        IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                            IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
  if (e) {
    errno = e;
    return false;
  }
  a = ibv_qp_attr{};
  a.qp_state = IBV_QPS_RTS;
  a.sq_psn = l.local.psn;
  a.timeout = 14;  // 67 ms x 7 retries: a dead peer is an error within half a second
  a.retry_cnt = 7;
  a.rnr_retry = 7;
  a.max_rd_atomic = 16;
  e = ibv_modify_qp(l.qp, &a,
                    IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                        IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC);
  if (e) {
    errno = e;
    return false;
  }
  return true;
}

void link_destroy(Link &l) {
  const uint32_t qpn = l.qp ? l.qp->qp_num : 0;
  if (l.qp) ibv_destroy_qp(l.qp);
  if (l.group) {
    {
      // What the CQ still holds of this QP goes now: a later QP may get its number.
      std::lock_guard<std::mutex> lk(l.group->mu);
      dispatch(*l.group);
      auto it = l.group->by_qpn.find(qpn);
      if (l.qp && it != l.group->by_qpn.end() && it->second == l.inbox) l.group->by_qpn.erase(it);
    }
    std::lock_guard<std::mutex> lk(groups_mu);
    --l.group->links;
  }
  delete l.inbox;
  if (l.kick_fd >= 0) real().close(l.kick_fd);
  if (l.ring_mr) ibv_dereg_mr(l.ring_mr);
  if (l.mirror_mr) ibv_dereg_mr(l.mirror_mr);
  if (l.ack_mr) ibv_dereg_mr(l.ack_mr);
  for (ibv_mr *mr : l.window_mrs) ibv_dereg_mr(mr);
  Buffers b{l.ring, l.mirror, l.page, l.ring_bytes};
  bool kept = false;
  if (b.ring && b.mirror && b.page && b.ring_bytes == config().ring_bytes) {
    std::lock_guard<std::mutex> lk(pool_mu);
    if (!pool) pool = new std::vector<Buffers>();
    if (pool->size() < kPoolMax) {
      pool->push_back(b);
      kept = true;
    }
  }
  if (!kept) unmap(b);
  l = Link{};
}

bool link_sink_ok() {
  Device *d = device();
  return d && d->atomics;
}

ibv_mr *reg_user(void *addr, size_t len) {
  Device *d = device();
  if (!d) return nullptr;
  return ibv_reg_mr(d->pd, addr, len,
                    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE);
}

}  // namespace sdp
