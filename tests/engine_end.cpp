#include "engine_end.hpp"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>

namespace pcientb::test {
namespace eng = pcientb::engine;

namespace {
void check(bool ok, const char *what, int err) {
  if (!ok) throw std::runtime_error(std::string(what) + ": " + strerror(err));
}
}  // namespace

EngineEnd::EngineEnd(const char *fabric, size_t buffer_size, uint32_t depth)
    : mem_(buffer_size + 2 * kGuard, kGuardByte) {
  int err = 0;
  // The one way to name a context's fabric (engine::fabric_name()).
  setenv("PCIENTB_FABRIC", fabric, 1);
  ctx_ = eng::Context::open(&err);
  check(ctx_, "open", err);
  lid_ = ctx_->node->fab().lid();
  pd_ = eng::alloc_pd(ctx_, &err);
  check(pd_, "alloc_pd", err);
  cq_ = eng::create_cq(ctx_, static_cast<int>(4 * depth), nullptr, nullptr, &err);
  check(cq_, "create_cq", err);
  memset(buf(), 0, size());
  const int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
                     IBV_ACCESS_REMOTE_ATOMIC;
  mr_ = eng::reg_mr(pd_, buf(), size(), reinterpret_cast<uint64_t>(buf()), access, &err);
  check(mr_, "reg_mr", err);
  ibv_qp_init_attr_ex a{};
  a.qp_type = IBV_QPT_RC;
  a.send_cq = reinterpret_cast<ibv_cq *>(&cq_->ibv);
  a.recv_cq = a.send_cq;
  a.cap.max_send_wr = depth;
  a.cap.max_recv_wr = depth;
  a.cap.max_send_sge = 4;
  a.cap.max_recv_sge = 1;
  a.cap.max_inline_data = 256;
  a.comp_mask = IBV_QP_INIT_ATTR_PD;
  a.pd = &pd_->ibv;
  qp_ = eng::create_qp(ctx_, &a, &err);
  check(qp_, "create_qp", err);
  handle_.pd = a.pd;
  handle_.send_cq = a.send_cq;
  handle_.recv_cq = a.recv_cq;
  handle_.qp_num = qp_->sh->qpn.load();
  handle_.qp_type = IBV_QPT_RC;
  eng::set_qp_handle(qp_, &handle_);
}

EngineEnd::~EngineEnd() {
  if (qp_) eng::destroy_qp(qp_);
  if (mr_) eng::dereg_mr(mr_);
  if (cq_) eng::destroy_cq(cq_);
  if (pd_) eng::dealloc_pd(pd_);
  delete ctx_;
}

int EngineEnd::connect(uint16_t lid, uint32_t qpn, uint8_t timeout, uint8_t retry_cnt,
                       uint8_t min_rnr_timer) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RESET;
  if (int e = eng::modify_qp(qp_, &a, IBV_QP_STATE)) return e;
  a = {};
  a.qp_state = IBV_QPS_INIT;
  a.port_num = 1;
  a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
  if (int e = eng::modify_qp(qp_, &a,
                             IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
    return e;
  a = {};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = IBV_MTU_4096;
  a.dest_qp_num = qpn;
  a.rq_psn = 1;
  a.max_dest_rd_atomic = 16;
  a.min_rnr_timer = min_rnr_timer;
  a.ah_attr.dlid = lid;
  a.ah_attr.port_num = 1;
  if (int e = eng::modify_qp(qp_, &a,
                             IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                 IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
    return e;
  a = {};
  a.qp_state = IBV_QPS_RTS;
  a.sq_psn = 1;
  a.timeout = timeout;
  a.retry_cnt = retry_cnt;
  a.rnr_retry = 7;
  a.max_rd_atomic = 16;
  return eng::modify_qp(qp_, &a,
                        IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                            IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC);
}

int EngineEnd::post_recv(uint64_t wr_id, size_t off, uint32_t len) {
  ibv_sge sge{reinterpret_cast<uint64_t>(buf() + off), len, lkey()};
  ibv_recv_wr wr{};
  wr.wr_id = wr_id;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr *bad = nullptr;
  return eng::post_recv(qp_, &wr, &bad);
}

int EngineEnd::post_send(uint64_t wr_id, ibv_wr_opcode opcode, size_t off, uint32_t len,
                         uint64_t remote_addr, uint32_t rkey) {
  ibv_sge sge{reinterpret_cast<uint64_t>(buf() + off), len, lkey()};
  ibv_send_wr wr{};
  wr.wr_id = wr_id;
  wr.opcode = opcode;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  if (opcode == IBV_WR_ATOMIC_CMP_AND_SWP || opcode == IBV_WR_ATOMIC_FETCH_AND_ADD) {
    wr.wr.atomic.remote_addr = remote_addr;
    wr.wr.atomic.rkey = rkey;
    wr.wr.atomic.compare_add = 1;
  } else {
    wr.wr.rdma.remote_addr = remote_addr;
    wr.wr.rdma.rkey = rkey;
  }
  ibv_send_wr *bad = nullptr;
  return eng::post_send(qp_, &wr, &bad);
}

std::vector<ibv_wc> EngineEnd::poll(size_t n, int ms) {
  std::vector<ibv_wc> got;
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  for (;;) {
    ibv_wc wc[16];
    int k = eng::poll_cq(cq_, 16, wc);
    for (int i = 0; i < k; ++i) got.push_back(wc[i]);
    if (k > 0) continue;
    if (got.size() >= n || std::chrono::steady_clock::now() >= until) return got;
    std::this_thread::yield();
  }
}

void EngineEnd::deregister() {
  if (mr_) eng::dereg_mr(mr_);
  mr_ = nullptr;
}

ibv_qp_state EngineEnd::state() {
  return qp_->state();
}

bool EngineEnd::guards_intact() const {
  for (size_t i = 0; i < kGuard; ++i)
    if (mem_[i] != kGuardByte || mem_[mem_.size() - 1 - i] != kGuardByte) return false;
  return true;
}

}  // namespace pcientb::test
