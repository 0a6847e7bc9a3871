// Protection domains, memory regions and address handles.
#include <cerrno>
#include <cstring>

#include "engine/engine.hpp"

namespace pcientb::engine {
namespace {

constexpr int kSupportedAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                                 IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC |
                                 IBV_ACCESS_RELAXED_ORDERING;

int check_access(int access) {
  if (access & ~kSupportedAccess) return EOPNOTSUPP;
  // IB: remote write or atomic access needs local write.
  if ((access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) &&
      !(access & IBV_ACCESS_LOCAL_WRITE))
    return EINVAL;
  return 0;
}

void fill_entry(const Mr *mr, MrShared &s) {
  s.pd = mr->pd->id;
  s.access = static_cast<uint32_t>(mr->access);
  s.addr = mr->iova;
  s.va = reinterpret_cast<uint64_t>(mr->addr);
  s.length = mr->length;
  s.window = mr->window;
}

// Publishes an MR's table entry under a fresh key; fills the keys.
int publish(Mr *mr, Node &node) {
  uint32_t idx, key;
  if (int e = node.alloc_mr(&idx, &key)) return e;
  MrShared &s = node.root()->mrs[idx];
  fill_entry(mr, s);
  s.key.store(key, std::memory_order_release);
  node.push_mr(idx);
  mr->idx = idx;
  mr->lkey = key;
  mr->rkey = key | kRkeyBit;
  return 0;
}

}  // namespace

Pd *alloc_pd(Context *ctx, int *err) {
  if (!ctx->node->take_quota(Quota::pd)) {
    *err = ENOMEM;
    return nullptr;
  }
  auto *pd = new (std::nothrow) Pd{};
  if (!pd) {
    ctx->node->give_quota(Quota::pd);
    *err = ENOMEM;
    return nullptr;
  }
  pd->ibv.context = ctx->ibv;
  pd->ctx = ctx;
  pd->id = ctx->node->new_pd_id();
  ctx->users++;
  return pd;
}

int dealloc_pd(Pd *pd) {
  if (pd->users.load()) return EBUSY;
  pd->ctx->node->give_quota(Quota::pd);
  pd->ctx->users--;
  delete pd;
  return 0;
}

Mr *reg_mr(Pd *pd, void *addr, size_t length, uint64_t iova, int access, int *err) {
  if ((*err = check_access(access))) return nullptr;
  if (!addr && length) {
    *err = EINVAL;
    return nullptr;
  }
  Node &node = *pd->ctx->node;
  auto *mr = new Mr{pd, 0, 0, 0, addr, length, iova, access, {}};
  if ((*err = node.fab().expose(addr, length, &mr->window))) {
    delete mr;
    return nullptr;
  }
  if ((*err = publish(mr, node))) {
    node.fab().unexpose(mr->window);
    delete mr;
    return nullptr;
  }
  pd->users++;
  return mr;
}

int rereg_mr(Mr *mr, int flags, Pd *pd, void *addr, size_t length, int access) {
  if (flags &
      ~(IBV_REREG_MR_CHANGE_TRANSLATION | IBV_REREG_MR_CHANGE_PD | IBV_REREG_MR_CHANGE_ACCESS))
    return EINVAL;
  if ((flags & IBV_REREG_MR_CHANGE_ACCESS) && check_access(access)) return EINVAL;
  if ((flags & IBV_REREG_MR_CHANGE_PD) && !pd) return EINVAL;
  if ((flags & IBV_REREG_MR_CHANGE_TRANSLATION) && !addr && length) return EINVAL;
  Node &node = *mr->pd->ctx->node;
  fabric::WindowId window = mr->window;
  if (flags & IBV_REREG_MR_CHANGE_TRANSLATION) {
    if (int e = node.fab().expose(addr, length, &window)) return e;
  }
  // The MR keeps its keys, as on an HCA. They stop working while it changes.
  MrShared &s = node.root()->mrs[mr->idx];
  s.key.store(0, std::memory_order_release);
  node.push_mr(mr->idx);
  if (flags & IBV_REREG_MR_CHANGE_TRANSLATION) {
    node.fab().unexpose(mr->window);
    mr->window = window;
    mr->iova += reinterpret_cast<uint64_t>(addr) - reinterpret_cast<uint64_t>(mr->addr);
    mr->addr = addr;
    mr->length = length;
  }
  if (flags & IBV_REREG_MR_CHANGE_PD) {
    mr->pd->users--;
    mr->pd = pd;
    mr->pd->users++;
  }
  if (flags & IBV_REREG_MR_CHANGE_ACCESS) mr->access = access;
  fill_entry(mr, s);
  s.key.store(mr->lkey, std::memory_order_release);
  node.push_mr(mr->idx);
  return 0;
}

int dereg_mr(Mr *mr) {
  Node &node = *mr->pd->ctx->node;
  node.free_mr(mr->idx);
  node.push_mr(mr->idx);  // peers' mirrors lose the key before the window goes
  node.fab().unexpose(mr->window);
  mr->pd->users--;
  delete mr;
  return 0;
}

Ah *create_ah(Pd *pd, const ibv_ah_attr *attr, int *err) {
  if (!attr || (attr->port_num != 1 && attr->port_num != 0) || attr->dlid == 0 ||
      (attr->is_global && attr->grh.sgid_index != 0)) {
    *err = EINVAL;
    return nullptr;
  }
  if (!pd->ctx->node->take_quota(Quota::ah)) {
    *err = ENOMEM;
    return nullptr;
  }
  auto *ah = new Ah{};
  ah->ibv.context = pd->ctx->ibv;
  ah->ibv.pd = &pd->ibv;
  ah->pd = pd;
  ah->attr = *attr;
  // Asks for the link to the destination now: up by the first datagram.
  Node &node = *pd->ctx->node;
  if (fabric::Peer *peer = node.fab().peer(attr->dlid)) {
    ah->peer.store(peer, std::memory_order_relaxed);
    node.link(*peer);
  }
  pd->users++;
  return ah;
}

int destroy_ah(Ah *ah) {
  ah->pd->ctx->node->give_quota(Quota::ah);
  ah->pd->users--;
  delete ah;
  return 0;
}

}  // namespace pcientb::engine
