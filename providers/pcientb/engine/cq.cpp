// Completion queues: the ring in this node's area that local and remote
// producers fill, polling (classic and extended), arming and events.
#include <linux/membarrier.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "engine/responder.hpp"

namespace pcientb::engine {
namespace {

// A producer publishes an entry, then looks whether the CQ is armed; the
// consumer arms, then polls: one of them must see the other (Dekker), which
// takes a fence on each side. The producer's came right after the stores of
// the answer it sent (serve_requests_locked) and waited for them to reach
// the requester's core, on every completion of a CQ with a channel (UCX
// polls such CQs and never arms them). So while a CQ has never been armed
// its producers (all threads of this process) publish without a fence, and
// the first arm makes up for every fence skipped with a membarrier (each
// thread of the process passes a full barrier), then has them fence again.
// (A forked child maps its parent's area but uses contexts of its own: it
// produces nothing into the parent's CQs.)
constexpr uint32_t kFenceNone = 0, kFenceComing = 1, kFenceAlways = 2;

std::atomic<bool> membarrier_failed{false};  // once: CQs made from then on always fence

bool membarrier_registered() {
  static const bool ok =
      syscall(SYS_membarrier, MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED, 0, 0) == 0;
  return ok && !membarrier_failed.load(std::memory_order_relaxed);
}

// Every thread of the process passes a full barrier; false if that cannot be had.
bool barrier_all_threads() {
  if (syscall(SYS_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0) == 0) return true;
  // A forked child may have to register again.
  if (syscall(SYS_membarrier, MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED, 0, 0) == 0 &&
      syscall(SYS_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0) == 0)
    return true;
  membarrier_failed.store(true, std::memory_order_relaxed);
  return false;
}

// Small CQs get room to grow in place: an untouched ring costs no memory.
constexpr uint32_t kMinCqCapacity = 4096;

constexpr uint64_t kSupportedWcFlags =
    IBV_WC_EX_WITH_BYTE_LEN | IBV_WC_EX_WITH_IMM | IBV_WC_EX_WITH_QP_NUM | IBV_WC_EX_WITH_SRC_QP |
    IBV_WC_EX_WITH_SLID | IBV_WC_EX_WITH_SL | IBV_WC_EX_WITH_DLID_PATH_BITS;

Off alloc_ring(Node &node, uint32_t capacity) {
  return node.alloc(offsetof(CqShared, ring) + ring_bytes(capacity, kCqSlotSize));
}

// A receive completion, counted for its QP by the poller of the QP's
// receive CQ (the one writer of those counters).
void count_receive(Node &node, const ibv_wc &wc) {
  QpStats &st = node.root()->qp_stats[wc.qp_num & (kMaxQps - 1)];
  if (st.qpn.load(std::memory_order_relaxed) == wc.qp_num) st.count_rx(wc);
}

bool take(Cq *cq, ibv_wc *wc) {
  RingHeader *ring = &cq->sh->ring;
  for (;;) {
    uint64_t pos;
    RingSlot *s = mpsc_peek(ring, &pos);
    if (!s) return false;
    const CqEntry &e = reinterpret_cast<CqSlot *>(s)->e;  // ours until popped
    uint64_t ticket = e.sq_ticket;
    bool got = !(ticket & CqEntry::kDiscarded);
    if (got) {
      *wc = e.wc;
      if (ticket) cq->ctx->node->retire(ticket);
    }
    mpsc_pop(ring, pos);
    if (!got) continue;
    if (!ticket) count_receive(*cq->ctx->node, *wc);
    return true;
  }
}

// ---- the extended poll API (ibv_cq_ex) --------------------------------------
Cq *cq_of(ibv_cq_ex *c) {
  return from_ibv<Cq>(c);
}

int start_poll(ibv_cq_ex *c, ibv_poll_cq_attr *attr) {
  Cq *cq = cq_of(c);
  if (attr && attr->comp_mask) return EINVAL;
  cq->ctx->node->poll_progress();
  cq->poll_mu.lock();
  if (!take(cq, &cq->cur)) {
    cq->poll_mu.unlock();
    return ENOENT;
  }
  c->wr_id = cq->cur.wr_id;
  c->status = cq->cur.status;
  return 0;
}
int next_poll(ibv_cq_ex *c) {
  Cq *cq = cq_of(c);
  if (!take(cq, &cq->cur)) return ENOENT;
  c->wr_id = cq->cur.wr_id;
  c->status = cq->cur.status;
  return 0;
}
void end_poll(ibv_cq_ex *c) {
  cq_of(c)->poll_mu.unlock();
}
ibv_wc_opcode read_opcode(ibv_cq_ex *c) {
  return cq_of(c)->cur.opcode;
}
uint32_t read_vendor_err(ibv_cq_ex *c) {
  return cq_of(c)->cur.vendor_err;
}
uint32_t read_byte_len(ibv_cq_ex *c) {
  return cq_of(c)->cur.byte_len;
}
__be32 read_imm_data(ibv_cq_ex *c) {
  return cq_of(c)->cur.imm_data;
}
uint32_t read_qp_num(ibv_cq_ex *c) {
  return cq_of(c)->cur.qp_num;
}
uint32_t read_src_qp(ibv_cq_ex *c) {
  return cq_of(c)->cur.src_qp;
}
unsigned int read_wc_flags(ibv_cq_ex *c) {
  return cq_of(c)->cur.wc_flags;
}
uint32_t read_slid(ibv_cq_ex *c) {
  return cq_of(c)->cur.slid;
}
uint8_t read_sl(ibv_cq_ex *c) {
  return cq_of(c)->cur.sl;
}
uint8_t read_dlid_path_bits(ibv_cq_ex *c) {
  return cq_of(c)->cur.dlid_path_bits;
}

}  // namespace

void init_cq_ex(Cq *cq) {
  ibv_cq_ex &c = cq->ibv;
  c.start_poll = start_poll;
  c.next_poll = next_poll;
  c.end_poll = end_poll;
  c.read_opcode = read_opcode;
  c.read_vendor_err = read_vendor_err;
  c.read_byte_len = read_byte_len;
  c.read_imm_data = read_imm_data;
  c.read_qp_num = read_qp_num;
  c.read_src_qp = read_src_qp;
  c.read_wc_flags = read_wc_flags;
  c.read_slid = read_slid;
  c.read_sl = read_sl;
  c.read_dlid_path_bits = read_dlid_path_bits;
}

Cq *create_cq(Context *ctx, int cqe, Channel *channel, const ibv_cq_init_attr_ex *ex, int *err) {
  if (cqe < 1 || static_cast<uint32_t>(cqe) >= kMaxCqe) {
    *err = EINVAL;
    return nullptr;
  }
  if (ex) {
    if (ex->wc_flags & ~kSupportedWcFlags) {
      *err = EOPNOTSUPP;
      return nullptr;
    }
    if (ex->comp_mask & ~uint32_t{IBV_CQ_INIT_ATTR_MASK_FLAGS}) {
      *err = EOPNOTSUPP;
      return nullptr;
    }
  }
  Node &node = *ctx->node;
  if (!node.take_quota(Quota::cq)) {
    *err = ENOMEM;
    return nullptr;
  }
  uint32_t capacity = pow2_at_least(std::max<uint32_t>(cqe + 1, kMinCqCapacity));
  Off off = alloc_ring(node, capacity);
  if (!off) {
    node.give_quota(Quota::cq);
    *err = ENOMEM;
    return nullptr;
  }
  auto *cq = new Cq{};
  cq->ctx = ctx;
  cq->off = off;
  cq->sh = static_cast<CqShared *>(node.ptr(off));
  cq->capacity = capacity;
  cq->channel = channel;
  cq->wc_flags = ex ? ex->wc_flags : 0;
  ring_init(&cq->sh->ring, capacity, kCqSlotSize);
  cq->sh->channel = EventFd{channel ? channel->wfd : -1};
  cq->sh->async = ctx->async_events();
  cq->sh->handle = reinterpret_cast<uint64_t>(&cq->ibv);
  cq->sh->fence.store(membarrier_registered() ? kFenceNone : kFenceAlways);
  cq->ibv.cqe = cqe;  // it holds more (capacity); applications size their work by this
  init_cq_ex(cq);
  node.add_cq(cq);
  ctx->users++;
  return cq;
}

int destroy_cq(Cq *cq) {
  if (cq->users.load()) return EBUSY;
  cq->ctx->node->remove_cq(cq);
  cq->ctx->node->give_quota(Quota::cq);
  cq->ctx->node->free(cq->off);
  cq->ctx->users--;
  delete cq;
  return 0;
}

int poll_cq(Cq *cq, int n, ibv_wc *wc) {
  if (n < 0) return -EINVAL;
  int i = 0;
  uint64_t pos;
  if (mpsc_peek(&cq->sh->ring, &pos)) {  // an empty poll (a spinning waiter) skips this
    // An application behind on its completions takes them first: serving more requests
    // now would only take more of its receives (RNR) before it can post them again.
    std::lock_guard<SpinLock> g(cq->poll_mu);
    while (i < n && take(cq, &wc[i])) ++i;
  }
  if (n && i == n) {
    cq->ctx->node->polled_after_arm();
    return i;
  }
  cq->ctx->node->poll_progress();
  {
    std::lock_guard<SpinLock> g(cq->poll_mu);
    while (i < n && take(cq, &wc[i])) ++i;
  }
  if (i) cq->ctx->node->polled_after_arm();
  return i;
}

bool cq_pending(Cq *cq) {
  uint64_t pos;
  // Records in the node's lanes become completions when a poll serves them.
  return mpsc_peek(&cq->sh->ring, &pos) != nullptr || cq->ctx->node->lanes_waiting();
}

int req_notify_cq(Cq *cq, bool solicited_only) {
  CqShared *sh = cq->sh;
  sh->armed.store(solicited_only ? kArmSolicited : kArmNext, std::memory_order_seq_cst);
  if (sh->fence.load(std::memory_order_acquire) != kFenceAlways) {
    // Producers that skipped their fence published before the barrier they
    // pass now (the caller's poll after arming sees it) or see the arm after.
    sh->fence.store(kFenceComing, std::memory_order_seq_cst);
    if (!barrier_all_threads() && sh->channel.fd >= 0) {
      // No barrier to be had: one event now, perhaps for nothing (the caller
      // polls, finds nothing and arms again), rather than one missed; the
      // producers fence from now on (they see kFenceComing).
      uint32_t a = sh->armed.load(std::memory_order_relaxed);
      if (a != kDisarmed && sh->armed.compare_exchange_strong(a, kDisarmed)) {
        uint64_t handle = sh->handle;
        raise_event(cq->ctx->node->fab(), sh->channel, &handle, sizeof handle);
      }
    }
    sh->fence.store(kFenceAlways, std::memory_order_release);
  }
  // Completions come from what peers post (requests, answers): they must
  // ring this node while it sleeps on the event.
  cq->ctx->node->stop_polling();
  return 0;
}

int resize_cq(Cq *cq, int cqe) {
  if (cqe < 1 || static_cast<uint32_t>(cqe) >= kMaxCqe) return EINVAL;
  std::lock_guard<SpinLock> g(cq->poll_mu);
  if (ring_count(&cq->sh->ring) > static_cast<uint64_t>(cqe)) return EINVAL;
  if (static_cast<uint32_t>(cqe) < cq->capacity) {
    cq->ibv.cqe = cqe;
    return 0;
  }
  // A larger ring moves the CQ; peers find it through the QPs that use it,
  // so that is only possible while none does.
  if (cq->users.load()) return ENOMEM;
  Node &node = *cq->ctx->node;
  uint32_t capacity = pow2_at_least(cqe + 1);
  Off off = alloc_ring(node, capacity);
  if (!off) return ENOMEM;
  auto *sh = static_cast<CqShared *>(node.ptr(off));
  sh->channel = cq->sh->channel;
  sh->async = cq->sh->async;
  sh->handle = cq->sh->handle;
  sh->armed.store(cq->sh->armed.load());
  sh->fence.store(cq->sh->fence.load());
  ring_init(&sh->ring, capacity, kCqSlotSize);
  uint64_t from;
  while (RingSlot *old = mpsc_peek(&cq->sh->ring, &from)) {
    uint64_t pos;
    RingSlot *s = mpsc_reserve(&sh->ring, &pos);
    reinterpret_cast<CqSlot *>(s)->e = reinterpret_cast<CqSlot *>(old)->e;
    ring_publish(&sh->ring, s, pos);
    mpsc_pop(&cq->sh->ring, from);
  }
  node.remove_cq(cq);
  node.free(cq->off);
  cq->off = off;
  cq->sh = sh;
  node.add_cq(cq);
  cq->capacity = capacity;
  cq->ibv.cqe = cqe;
  return 0;
}

void cq_discard_qp(Cq *cq, uint32_t qp_num) {
  std::lock_guard<SpinLock> g(cq->poll_mu);
  RingHeader *r = &cq->sh->ring;
  // Every producer of this CQ is a thread of this node; those that could
  // complete for the QP are done (Node::links_barrier, retire_qp), but a
  // slot claimed just before may still be being filled.
  uint64_t tail = r->tail.load(std::memory_order_acquire);
  for (uint64_t pos = r->head.load(std::memory_order_acquire); pos < tail; ++pos) {
    RingSlot *s = ring_slot(r, pos);
    while (ring_seq(r, s, pos) != pos + 1) sched_yield();
    CqEntry &e = reinterpret_cast<CqSlot *>(s)->e;
    if (e.wc.qp_num == qp_num) e.sq_ticket |= CqEntry::kDiscarded;
  }
}

CqEntry *cq_claim(fabric::Fabric &fab, CqShared *cq, uint64_t *pos) {
  RingSlot *s = mpsc_reserve(&cq->ring, pos);
  if (s) return &reinterpret_cast<CqSlot *>(s)->e;
  if (!cq->overflow.exchange(1)) {
    AsyncRecord rec{cq->handle, IBV_EVENT_CQ_ERR, 0};
    raise_event(fab, cq->async, &rec, sizeof rec);
  }
  return nullptr;
}

void cq_commit(fabric::Fabric &fab, CqShared *cq, uint64_t pos, bool solicited) {
  RingSlot *s = ring_slot(&cq->ring, pos);
  const CqEntry &e = reinterpret_cast<CqSlot *>(s)->e;
  bool failed = e.wc.status != IBV_WC_SUCCESS;
  ring_publish(&cq->ring, s, pos);
  if (cq->channel.fd < 0) return;  // no channel: no event to raise
  // Pairs with the seq_cst store in req_notify_cq: either the owner sees the
  // entry when it polls after arming, or we see the arm (kFenceNone: the
  // arm's membarrier is this fence).
  if (cq->fence.load(std::memory_order_relaxed) != kFenceNone)
    std::atomic_thread_fence(std::memory_order_seq_cst);
  else
    std::atomic_signal_fence(std::memory_order_seq_cst);
  uint32_t a = cq->armed.load(std::memory_order_relaxed);
  if (a == kArmNext || (a == kArmSolicited && (solicited || failed))) {
    if (cq->armed.compare_exchange_strong(a, kDisarmed)) {
      uint64_t handle = cq->handle;
      raise_event(fab, cq->channel, &handle, sizeof handle);
    }
  }
}

}  // namespace pcientb::engine
