// Shared receive queues: one receive queue that several QPs of a node draw
// from; the limit event is raised when a message takes it below the limit.
#include <algorithm>
#include <cerrno>

#include "engine/responder.hpp"

namespace pcientb::engine {
namespace {
// SRQs get room to grow in place: an untouched ring costs no memory.
constexpr uint32_t kMinSrqCapacity = 1024;
}  // namespace

Srq *create_srq(Pd *pd, ibv_srq_init_attr *a, int *err) {
  ibv_srq_attr &s = a->attr;
  if (s.max_wr < 1 || s.max_wr >= kMaxSrqWr || s.max_sge < 1 || s.max_sge > kMaxSge ||
      s.srq_limit > s.max_wr) {
    *err = EINVAL;
    return nullptr;
  }
  Node &node = *pd->ctx->node;
  uint32_t capacity = pow2_at_least(std::max(s.max_wr + 1, kMinSrqCapacity));
  if (!node.take_quota(Quota::srq)) {
    *err = ENOMEM;
    return nullptr;
  }
  Off off = rq_create(node, capacity, s.max_sge, pd->id);
  if (!off) {
    node.give_quota(Quota::srq);
    *err = ENOMEM;
    return nullptr;
  }
  auto *srq = new Srq{};
  srq->ibv.context = pd->ctx->ibv;
  srq->ctx = pd->ctx;
  srq->pd = pd;
  srq->off = off;
  srq->sh = static_cast<RqShared *>(node.ptr(off));
  srq->max_wr = s.max_wr;
  srq->max_sge = s.max_sge;
  srq->sh->is_srq = 1;
  srq->sh->async = pd->ctx->async_events();
  srq->sh->handle = reinterpret_cast<uint64_t>(&srq->ibv);
  srq->sh->limit.store(s.srq_limit);
  node.add_srq(srq);
  pd->users++;
  return srq;
}

int modify_srq(Srq *srq, const ibv_srq_attr *a, int mask) {
  if (mask & ~(IBV_SRQ_MAX_WR | IBV_SRQ_LIMIT)) return EINVAL;
  std::lock_guard<SpinLock> g(srq->mu);
  uint32_t max_wr = srq->max_wr;
  if (mask & IBV_SRQ_MAX_WR) {
    // Grows in place within its ring; never below what it holds.
    if (a->max_wr < 1 || a->max_wr > srq->sh->ring.mask || a->max_wr < ring_count(&srq->sh->ring))
      return EINVAL;
    max_wr = a->max_wr;
  }
  if ((mask & IBV_SRQ_LIMIT) && a->srq_limit > max_wr) return EINVAL;
  srq->max_wr = max_wr;
  if (mask & IBV_SRQ_LIMIT) srq->sh->limit.store(a->srq_limit);
  return 0;
}

int query_srq(Srq *srq, ibv_srq_attr *a) {
  a->max_wr = srq->max_wr;
  a->max_sge = srq->max_sge;
  a->srq_limit = srq->sh->limit.load();
  return 0;
}

int destroy_srq(Srq *srq) {
  if (srq->users.load()) return EBUSY;
  srq->ctx->node->remove_srq(srq);
  srq->ctx->node->give_quota(Quota::srq);
  srq->ctx->node->free(srq->off);
  srq->pd->users--;
  delete srq;
  return 0;
}

int post_srq_recv(Srq *srq, const ibv_recv_wr *wr, ibv_recv_wr **bad) {
  std::lock_guard<SpinLock> g(srq->mu);
  return rq_post(srq->sh, srq->max_wr, wr, bad);
}

}  // namespace pcientb::engine
