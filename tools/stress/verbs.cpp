#include "verbs.hpp"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <string>

namespace stress {

void throw_verbs(const char *what, int err) {
  throw VerbsError(std::string(what) + ": " + std::strerror(err ? err : EIO));
}

Node::Node() {
  int n = 0;
  ibv_device **list = ibv_get_device_list(&n);
  if (!list) throw_verbs("ibv_get_device_list", errno);
  ibv_device *device = nullptr;
  // The first: the preload lists the emulated device before a kernel one of that name.
  for (int i = 0; i < n && !device; ++i)
    if (std::strcmp(ibv_get_device_name(list[i]), "pcientb0") == 0) device = list[i];
  if (device) ctx.reset(ibv_open_device(device));
  int err = errno;
  ibv_free_device_list(list);
  if (!device)
    throw VerbsError("pcientb0 is not in the device list (is the preload library linked?)");
  if (!ctx) throw_verbs("ibv_open_device(pcientb0)", err);
  pd.reset(ibv_alloc_pd(ctx.get()));
  if (!pd) throw_verbs("ibv_alloc_pd", errno);
  if (int rc = ibv_query_device(ctx.get(), &dev)) throw_verbs("ibv_query_device", rc);
  ibv_port_attr port{};
  if (int rc = ibv_query_port(ctx.get(), 1, &port)) throw_verbs("ibv_query_port", rc);
  lid = port.lid;
}

CqPtr create_cq(ibv_context *ctx, int cqe) {
  CqPtr cq(ibv_create_cq(ctx, cqe, nullptr, nullptr, 0));
  if (!cq) throw_verbs("ibv_create_cq", errno);
  return cq;
}

QpPtr create_qp(ibv_pd *pd, ibv_qp_init_attr *attr) {
  QpPtr qp(ibv_create_qp(pd, attr));
  if (!qp) throw_verbs("ibv_create_qp", errno);
  return qp;
}

void rc_init(ibv_qp *qp, int access) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = 0;
  a.port_num = 1;
  a.qp_access_flags = access;
  if (int rc = ibv_modify_qp(qp, &a,
                             IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
    throw_verbs("ibv_modify_qp(INIT)", rc);
}

void rc_connect(ibv_qp *qp, const RcPeer &peer, uint32_t sq_psn) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = IBV_MTU_4096;
  a.dest_qp_num = peer.qpn;
  a.rq_psn = peer.psn;
  a.max_dest_rd_atomic = 16;
  a.min_rnr_timer = 1;  // 0.01 ms: receivers repost quickly
  a.ah_attr.dlid = peer.lid;
  a.ah_attr.port_num = 1;
  if (int rc = ibv_modify_qp(qp, &a,
                             IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                 IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
    throw_verbs("ibv_modify_qp(RTR)", rc);
  a = {};
  a.qp_state = IBV_QPS_RTS;
  a.timeout = 10;  // 4.096 us * 2^10 ~ 4 ms
  a.retry_cnt = 3;
  a.rnr_retry = 7;  // forever: a live target always reposts its receives
  a.sq_psn = sq_psn;
  a.max_rd_atomic = 16;
  if (int rc = ibv_modify_qp(qp, &a,
                             IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                                 IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
    throw_verbs("ibv_modify_qp(RTS)", rc);
}

void ud_ready(ibv_qp *qp) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.port_num = 1;
  a.qkey = kUdQkey;
  if (int rc = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY))
    throw_verbs("ibv_modify_qp(UD INIT)", rc);
  a = {};
  a.qp_state = IBV_QPS_RTR;
  if (int rc = ibv_modify_qp(qp, &a, IBV_QP_STATE)) throw_verbs("ibv_modify_qp(UD RTR)", rc);
  a.qp_state = IBV_QPS_RTS;
  a.sq_psn = 0;
  if (int rc = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN))
    throw_verbs("ibv_modify_qp(UD RTS)", rc);
}

int to_error(ibv_qp *qp) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_ERR;
  return ibv_modify_qp(qp, &a, IBV_QP_STATE);
}

ibv_qp_state qp_state(ibv_qp *qp) {
  ibv_qp_attr a{};
  ibv_qp_init_attr init{};
  if (ibv_query_qp(qp, &a, IBV_QP_STATE, &init) != 0) return IBV_QPS_UNKNOWN;
  return a.qp_state;
}

Memory::Memory(size_t size) : size_(size) {
  void *p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw_verbs("mmap", errno);
  data_ = static_cast<uint8_t *>(p);
}

Memory &Memory::operator=(Memory &&o) noexcept {
  if (this != &o) {
    if (data_) munmap(data_, size_);
    data_ = o.data_;
    size_ = o.size_;
    o.data_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}

Memory::~Memory() {
  if (data_) munmap(data_, size_);
}

Region::Region(ibv_pd *pd, size_t size, int access) : mem(size) {
  mr.reset(ibv_reg_mr(pd, mem.data(), size, access));
  if (!mr) throw_verbs("ibv_reg_mr", errno);
}

void Region::reregister(ibv_pd *pd, int access) {
  mr.reset();
  mr.reset(ibv_reg_mr(pd, mem.data(), mem.size(), access));
  if (!mr) throw_verbs("ibv_reg_mr (again)", errno);
}

std::optional<size_t> ByteRing::take(size_t n, size_t align, size_t *cost) {
  if (used_ == 0) head_ = 0;  // empty: start over, so a full-size piece always fits
  size_t start = (head_ + align - 1) & ~(align - 1);
  size_t pad = start - head_;
  if (start + n > size_) {  // wrap: skip the rest of the ring
    pad = size_ - head_;
    start = 0;
  }
  if (used_ + pad + n > size_) return std::nullopt;
  used_ += pad + n;
  head_ = start + n;
  *cost = pad + n;
  return start;
}

std::string status_name(int status) {
  if (status >= 0 && status <= IBV_WC_TM_RNDV_INCOMPLETE)
    return ibv_wc_status_str(static_cast<ibv_wc_status>(status));
  return "status " + std::to_string(status);
}

const char *event_name(ibv_event_type type) {
  return ibv_event_type_str(type);
}

}  // namespace stress
