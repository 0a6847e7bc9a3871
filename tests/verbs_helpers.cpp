#include "verbs_helpers.hpp"

#include <arpa/inet.h>
#include <dirent.h>
#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

namespace {

const char *wc_opcode_name(ibv_wc_opcode opcode) {
  switch (opcode) {
    case IBV_WC_SEND:
      return "IBV_WC_SEND";
    case IBV_WC_RDMA_WRITE:
      return "IBV_WC_RDMA_WRITE";
    case IBV_WC_RDMA_READ:
      return "IBV_WC_RDMA_READ";
    case IBV_WC_COMP_SWAP:
      return "IBV_WC_COMP_SWAP";
    case IBV_WC_FETCH_ADD:
      return "IBV_WC_FETCH_ADD";
    case IBV_WC_BIND_MW:
      return "IBV_WC_BIND_MW";
    case IBV_WC_LOCAL_INV:
      return "IBV_WC_LOCAL_INV";
    case IBV_WC_TSO:
      return "IBV_WC_TSO";
    case IBV_WC_RECV:
      return "IBV_WC_RECV";
    case IBV_WC_RECV_RDMA_WITH_IMM:
      return "IBV_WC_RECV_RDMA_WITH_IMM";
    default:
      return "?";
  }
}

const char *qp_state_name(ibv_qp_state state) {
  static const char *const names[] = {"RESET", "INIT", "RTR", "RTS",
                                      "SQD",   "SQE",  "ERR", "UNKNOWN"};
  auto i = static_cast<unsigned>(state);
  return i < std::size(names) ? names[i] : "?";
}

}  // namespace

void PrintTo(ibv_wc_status status, std::ostream *os) {
  *os << static_cast<int>(status) << " (" << ibv_wc_status_str(status) << ")";
}
void PrintTo(ibv_wc_opcode opcode, std::ostream *os) {
  *os << static_cast<int>(opcode) << " (" << wc_opcode_name(opcode) << ")";
}
void PrintTo(ibv_qp_state state, std::ostream *os) {
  *os << static_cast<int>(state) << " (IBV_QPS_" << qp_state_name(state) << ")";
}
void PrintTo(ibv_port_state state, std::ostream *os) {
  *os << static_cast<int>(state) << " (" << ibv_port_state_str(state) << ")";
}

namespace pcientb::test {

// ---- resources ----------------------------------------------------------------

ContextPtr open_device() {
  use_private_fabric();
  int num = 0;
  ibv_device **list = ibv_get_device_list(&num);
  if (!list) throw_errno("ibv_get_device_list", errno);
  ibv_device *device = nullptr;
  for (int i = 0; i < num; ++i)
    if (std::strcmp(ibv_get_device_name(list[i]), kDeviceName) == 0) device = list[i];
  if (!device) {
    ibv_free_device_list(list);
    throw SetupError("pcientb0 is not in ibv_get_device_list() (is libpcientb-preload.so linked?)");
  }
  ibv_context *ctx = ibv_open_device(device);
  int err = errno;
  ibv_free_device_list(list);
  if (!ctx) throw_errno("ibv_open_device(pcientb0)", err);
  return ContextPtr(ctx);
}

PdPtr alloc_pd(ibv_context *ctx) {
  ibv_pd *pd = ibv_alloc_pd(ctx);
  if (!pd) throw_errno("ibv_alloc_pd", errno);
  return PdPtr(pd);
}

MrPtr reg_mr(ibv_pd *pd, void *addr, size_t length, int access) {
  ibv_mr *mr = ibv_reg_mr(pd, addr, length, access);
  if (!mr) throw_errno("ibv_reg_mr", errno);
  return MrPtr(mr);
}

CqPtr create_cq(ibv_context *ctx, int cqe, ibv_comp_channel *channel) {
  ibv_cq *cq = ibv_create_cq(ctx, cqe, nullptr, channel, 0);
  if (!cq) throw_errno("ibv_create_cq", errno);
  return CqPtr(cq);
}

CqPtr create_cq_ex(ibv_context *ctx, int cqe, uint64_t wc_flags, ibv_cq_ex **ex,
                   ibv_comp_channel *channel) {
  ibv_cq_init_attr_ex attr{};
  attr.cqe = static_cast<uint32_t>(cqe);
  attr.channel = channel;
  attr.wc_flags = wc_flags;
  ibv_cq_ex *cq = ibv_create_cq_ex(ctx, &attr);
  if (!cq) throw_errno("ibv_create_cq_ex", errno);
  *ex = cq;
  return CqPtr(ibv_cq_ex_to_cq(cq));
}

CompChannelPtr create_comp_channel(ibv_context *ctx) {
  ibv_comp_channel *channel = ibv_create_comp_channel(ctx);
  if (!channel) throw_errno("ibv_create_comp_channel", errno);
  return CompChannelPtr(channel);
}

QpPtr create_qp(ibv_pd *pd, ibv_qp_init_attr attr) {
  ibv_qp *qp = ibv_create_qp(pd, &attr);
  if (!qp) throw_errno("ibv_create_qp", errno);
  return QpPtr(qp);
}

ibv_qp_init_attr rc_qp_attr(ibv_cq *cq, uint32_t max_wr, uint32_t max_sge) {
  ibv_qp_init_attr attr{};
  attr.send_cq = cq;
  attr.recv_cq = cq;
  attr.qp_type = IBV_QPT_RC;
  attr.cap.max_send_wr = max_wr;
  attr.cap.max_recv_wr = max_wr;
  attr.cap.max_send_sge = max_sge;
  attr.cap.max_recv_sge = max_sge;
  attr.cap.max_inline_data = 64;
  return attr;
}

ibv_qp_init_attr ud_qp_attr(ibv_cq *cq, uint32_t max_wr, uint32_t max_sge) {
  ibv_qp_init_attr attr = rc_qp_attr(cq, max_wr, max_sge);
  attr.qp_type = IBV_QPT_UD;
  return attr;
}

Node::Node() : ctx(open_device()) {
  if (int rc = ibv_query_port(ctx.get(), kPort, &port)) throw_errno("ibv_query_port", rc);
  if (int rc = ibv_query_gid(ctx.get(), kPort, 0, &gid))
    throw_errno("ibv_query_gid", rc < 0 ? errno : rc);
  pd = alloc_pd(ctx.get());
}

Buffer::Buffer(ibv_pd *pd, size_t size, int access)
    : bytes(size, 0), mr(reg_mr(pd, bytes.data(), size, access)) {}

ibv_sge Buffer::sge(size_t offset, uint32_t length) const {
  return ibv_sge{addr(offset), length, mr->lkey};
}

// ---- QP state transitions -------------------------------------------------------

ibv_qp_attr init_attr(int access) {
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_INIT;
  attr.pkey_index = 0;
  attr.port_num = kPort;
  attr.qp_access_flags = static_cast<unsigned>(access);
  return attr;
}

ibv_qp_attr rtr_attr(const Endpoint &remote, const RcParams &params) {
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_RTR;
  attr.path_mtu = params.mtu;
  attr.dest_qp_num = remote.qpn;
  attr.rq_psn = remote.psn;
  attr.max_dest_rd_atomic = params.rd_atomic;
  attr.min_rnr_timer = params.min_rnr_timer;
  attr.ah_attr.dlid = remote.lid;
  attr.ah_attr.sl = 0;
  attr.ah_attr.src_path_bits = 0;
  attr.ah_attr.port_num = kPort;
  if (params.grh) {
    attr.ah_attr.is_global = 1;
    attr.ah_attr.grh.dgid = remote.gid;
    attr.ah_attr.grh.sgid_index = 0;
    attr.ah_attr.grh.hop_limit = 1;
  }
  return attr;
}

ibv_qp_attr rts_attr(uint32_t sq_psn, const RcParams &params) {
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_RTS;
  attr.timeout = params.timeout;
  attr.retry_cnt = params.retry_cnt;
  attr.rnr_retry = params.rnr_retry;
  attr.sq_psn = sq_psn;
  attr.max_rd_atomic = params.rd_atomic;
  return attr;
}

ibv_qp_attr state_attr(ibv_qp_state state) {
  ibv_qp_attr attr{};
  attr.qp_state = state;
  return attr;
}

int modify_qp(ibv_qp *qp, ibv_qp_attr attr, int mask) {
  return ibv_modify_qp(qp, &attr, mask);
}

void rc_to_rts(ibv_qp *qp, const Endpoint &local, const Endpoint &remote, const RcParams &params) {
  rc_to_init(qp, params);
  rc_init_to_rts(qp, local, remote, params);
}

void rc_to_init(ibv_qp *qp, const RcParams &params) {
  if (int rc = modify_qp(qp, init_attr(params.access), kInitMask))
    throw_errno("modify_qp RESET->INIT", rc);
}

void rc_init_to_rts(ibv_qp *qp, const Endpoint &local, const Endpoint &remote,
                    const RcParams &params) {
  if (int rc = modify_qp(qp, rtr_attr(remote, params), kRtrMask))
    throw_errno("modify_qp INIT->RTR", rc);
  if (int rc = modify_qp(qp, rts_attr(local.psn, params), kRtsMask))
    throw_errno("modify_qp RTR->RTS", rc);
}

void ud_to_rts(ibv_qp *qp, uint32_t qkey, uint32_t sq_psn) {
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_INIT;
  attr.pkey_index = 0;
  attr.port_num = kPort;
  attr.qkey = qkey;
  if (int rc = modify_qp(qp, attr, kUdInitMask)) throw_errno("modify_qp UD RESET->INIT", rc);
  if (int rc = modify_qp(qp, state_attr(IBV_QPS_RTR), IBV_QP_STATE))
    throw_errno("modify_qp UD INIT->RTR", rc);
  attr = state_attr(IBV_QPS_RTS);
  attr.sq_psn = sq_psn;
  if (int rc = modify_qp(qp, attr, kUdRtsMask)) throw_errno("modify_qp UD RTR->RTS", rc);
}

ibv_qp_state query_state(ibv_qp *qp) {
  ibv_qp_attr attr{};
  ibv_qp_init_attr init{};
  if (int rc = ibv_query_qp(qp, &attr, IBV_QP_STATE, &init)) throw_errno("ibv_query_qp", rc);
  return attr.qp_state;
}

AhPtr create_ah(ibv_pd *pd, const Endpoint &remote, bool grh) {
  ibv_ah_attr attr{};
  attr.dlid = remote.lid;
  attr.port_num = kPort;
  if (grh) {
    attr.is_global = 1;
    attr.grh.dgid = remote.gid;
    attr.grh.sgid_index = 0;
    attr.grh.hop_limit = 1;
  }
  ibv_ah *ah = ibv_create_ah(pd, &attr);
  if (!ah) throw_errno("ibv_create_ah", errno);
  return AhPtr(ah);
}

// ---- work requests ----------------------------------------------------------

SendWr::SendWr(ibv_wr_opcode opcode, uint64_t wr_id, int flags) {
  wr.opcode = opcode;
  wr.wr_id = wr_id;
  wr.send_flags = static_cast<unsigned>(flags);
}

SendWr &SendWr::sge(ibv_sge s) {
  sges.push_back(s);
  return *this;
}

SendWr &SendWr::sge(const void *addr, uint32_t length, uint32_t lkey) {
  return sge(ibv_sge{reinterpret_cast<uintptr_t>(addr), length, lkey});
}

SendWr &SendWr::flags(int flags) {
  wr.send_flags = static_cast<unsigned>(flags);
  return *this;
}

SendWr &SendWr::remote(uint64_t addr, uint32_t rkey) {
  if (wr.opcode == IBV_WR_ATOMIC_CMP_AND_SWP || wr.opcode == IBV_WR_ATOMIC_FETCH_AND_ADD) {
    wr.wr.atomic.remote_addr = addr;
    wr.wr.atomic.rkey = rkey;
  } else {
    wr.wr.rdma.remote_addr = addr;
    wr.wr.rdma.rkey = rkey;
  }
  return *this;
}

SendWr &SendWr::imm(uint32_t host_order_imm) {
  wr.imm_data = htonl(host_order_imm);
  return *this;
}

SendWr &SendWr::compare_add(uint64_t value) {
  wr.wr.atomic.compare_add = value;
  return *this;
}

SendWr &SendWr::swap(uint64_t value) {
  wr.wr.atomic.swap = value;
  return *this;
}

SendWr &SendWr::ud(ibv_ah *ah, uint32_t remote_qpn, uint32_t remote_qkey) {
  wr.wr.ud.ah = ah;
  wr.wr.ud.remote_qpn = remote_qpn;
  wr.wr.ud.remote_qkey = remote_qkey;
  return *this;
}

int SendWr::post(ibv_qp *qp, ibv_send_wr **bad) {
  wr.sg_list = sges.empty() ? nullptr : sges.data();
  wr.num_sge = static_cast<int>(sges.size());
  wr.next = nullptr;
  ibv_send_wr *bad_wr = nullptr;
  int rc = ibv_post_send(qp, &wr, &bad_wr);
  if (bad) *bad = bad_wr;
  return rc;
}

RecvWr::RecvWr(uint64_t wr_id) {
  wr.wr_id = wr_id;
}

RecvWr &RecvWr::sge(ibv_sge s) {
  sges.push_back(s);
  return *this;
}

int RecvWr::post(ibv_qp *qp, ibv_recv_wr **bad) {
  wr.sg_list = sges.empty() ? nullptr : sges.data();
  wr.num_sge = static_cast<int>(sges.size());
  wr.next = nullptr;
  ibv_recv_wr *bad_wr = nullptr;
  int rc = ibv_post_recv(qp, &wr, &bad_wr);
  if (bad) *bad = bad_wr;
  return rc;
}

int RecvWr::post(ibv_srq *srq, ibv_recv_wr **bad) {
  wr.sg_list = sges.empty() ? nullptr : sges.data();
  wr.num_sge = static_cast<int>(sges.size());
  wr.next = nullptr;
  ibv_recv_wr *bad_wr = nullptr;
  int rc = ibv_post_srq_recv(srq, &wr, &bad_wr);
  if (bad) *bad = bad_wr;
  return rc;
}

// ---- completions ------------------------------------------------------------

namespace {

// Polls until `done` or the deadline: spins briefly, then naps, so two
// polling processes do not starve each other on a small machine.
template <class Done>
bool poll_until(std::chrono::milliseconds timeout, Done done) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  for (unsigned spins = 0;; ++spins) {
    if (done()) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    if (spins > 200) std::this_thread::sleep_for(50us);
  }
}

}  // namespace

ibv_wc wait_wc(ibv_cq *cq, std::chrono::milliseconds timeout) {
  return wait_wcs(cq, 1, timeout).front();
}

std::vector<ibv_wc> wait_wcs(ibv_cq *cq, size_t n, std::chrono::milliseconds timeout) {
  std::vector<ibv_wc> wcs(n);
  if (n == 0) return wcs;
  size_t got = 0;
  bool ok = poll_until(timeout, [&] {
    int r = ibv_poll_cq(cq, static_cast<int>(std::min<size_t>(n - got, 64)), &wcs[got]);
    if (r < 0) throw SetupError("ibv_poll_cq returned " + std::to_string(r));
    got += static_cast<size_t>(r);
    return got == n;
  });
  if (!ok)
    throw SetupError("only " + std::to_string(got) + " of " + std::to_string(n) +
                     " completions arrived within " + std::to_string(timeout.count()) + " ms");
  return wcs;
}

bool stays_empty(ibv_cq *cq, std::chrono::milliseconds period) {
  ibv_wc wc{};
  bool got = poll_until(period, [&] {
    int r = ibv_poll_cq(cq, 1, &wc);
    if (r < 0) throw SetupError("ibv_poll_cq returned " + std::to_string(r));
    return r > 0;
  });
  return !got;
}

namespace {

bool fd_readable(int fd, std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    pollfd pfd{fd, POLLIN, 0};
    int r = ::poll(&pfd, 1, static_cast<int>(std::max<int64_t>(left.count(), 0)));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw_errno("poll", errno);
    return r > 0;
  }
}

}  // namespace

ibv_cq *wait_cq_event(ibv_comp_channel *channel, std::chrono::milliseconds timeout) {
  if (!fd_readable(channel->fd, timeout)) return nullptr;
  ibv_cq *cq = nullptr;
  void *cq_context = nullptr;
  if (ibv_get_cq_event(channel, &cq, &cq_context)) throw_errno("ibv_get_cq_event", errno);
  ibv_ack_cq_events(cq, 1);
  return cq;
}

std::optional<ibv_async_event> wait_async_event(ibv_context *ctx,
                                                std::chrono::milliseconds timeout) {
  if (!fd_readable(ctx->async_fd, timeout)) return std::nullopt;
  ibv_async_event event{};
  if (ibv_get_async_event(ctx, &event)) throw_errno("ibv_get_async_event", errno);
  ibv_async_event copy = event;
  ibv_ack_async_event(&event);
  return copy;
}

std::optional<ibv_async_event> wait_async_event_of(ibv_context *ctx, ibv_event_type type,
                                                   std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    auto event = wait_async_event(ctx, std::max(left, 0ms));
    if (!event || event->event_type == type) return event;
  }
}

// ---- data -----------------------------------------------------------------------

uint8_t pattern_byte(uint32_t seed, size_t offset) {
  uint32_t x = static_cast<uint32_t>(offset) * 2654435761u ^ (seed + 1) * 0x9e3779b9u;
  x ^= x >> 13;
  x *= 0x5bd1e995u;
  x ^= x >> 15;
  return static_cast<uint8_t>(x);
}

void fill_pattern(std::span<uint8_t> bytes, uint32_t seed, size_t first_offset) {
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = pattern_byte(seed, first_offset + i);
}

::testing::AssertionResult has_pattern(std::span<const uint8_t> bytes, uint32_t seed,
                                       size_t first_offset) {
  size_t wrong = 0, first = 0;
  for (size_t i = 0; i < bytes.size(); ++i)
    if (bytes[i] != pattern_byte(seed, first_offset + i) && wrong++ == 0) first = i;
  if (wrong == 0) return ::testing::AssertionSuccess();
  std::ostringstream os;
  os << wrong << " of " << bytes.size() << " bytes differ from pattern " << seed
     << "; the first at offset " << first << " is 0x" << std::hex << int(bytes[first])
     << ", expected 0x" << int(pattern_byte(seed, first_offset + first));
  return ::testing::AssertionFailure() << os.str();
}

::testing::AssertionResult all_bytes_are(std::span<const uint8_t> bytes, uint8_t value) {
  auto it = std::find_if(bytes.begin(), bytes.end(), [&](uint8_t b) { return b != value; });
  if (it == bytes.end()) return ::testing::AssertionSuccess();
  std::ostringstream os;
  os << "byte " << (it - bytes.begin()) << " of " << bytes.size() << " is 0x" << std::hex
     << int(*it) << ", expected 0x" << int(value);
  return ::testing::AssertionFailure() << os.str();
}

bool is_one_of(int value, std::initializer_list<int> allowed) {
  return std::find(allowed.begin(), allowed.end(), value) != allowed.end();
}

// ---- one side of a connection -------------------------------------------------

RcQp::RcQp(Node &node, const RcOptions &options, ibv_srq *srq) {
  if (options.comp_channel) channel = create_comp_channel(node.ctx.get());
  const int cqe =
      options.cqe ? options.cqe : static_cast<int>(options.max_send_wr + options.max_recv_wr + 16);
  if (options.cq_ex_wc_flags)
    cq = create_cq_ex(node.ctx.get(), cqe, options.cq_ex_wc_flags, &cq_ex, channel.get());
  else
    cq = create_cq(node.ctx.get(), cqe, channel.get());
  ibv_qp_init_attr attr = rc_qp_attr(cq.get(), options.max_send_wr, options.max_sge);
  attr.cap.max_recv_wr = srq ? 0 : options.max_recv_wr;
  attr.cap.max_recv_sge = srq ? 0 : options.max_sge;
  attr.cap.max_inline_data = options.max_inline;
  attr.sq_sig_all = options.sq_sig_all;
  attr.srq = srq;
  if (options.send_ops_flags == 0) {
    qp = create_qp(node.pd.get(), attr);
  } else {
    ibv_qp_init_attr_ex ex{};
    ex.qp_type = attr.qp_type;
    ex.send_cq = attr.send_cq;
    ex.recv_cq = attr.recv_cq;
    ex.srq = attr.srq;
    ex.cap = attr.cap;
    ex.sq_sig_all = attr.sq_sig_all;
    ex.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
    ex.pd = node.pd.get();
    ex.send_ops_flags = options.send_ops_flags;
    ibv_qp *raw = ibv_create_qp_ex(node.ctx.get(), &ex);
    if (!raw) throw_errno("ibv_create_qp_ex", errno);
    qp.reset(raw);
  }
  psn = (qp->qp_num * 2654435761u) & 0xffffff;
  rc_to_init(qp.get(), options.params);
}

Endpoint RcQp::endpoint(const Node &node, const Buffer &buffer) const {
  Endpoint ep;
  ep.lid = node.lid();
  ep.qpn = qp->qp_num;
  ep.psn = psn;
  ep.rkey = buffer.mr->rkey;
  ep.addr = buffer.addr();
  ep.length = buffer.bytes.size();
  ep.gid = node.gid;
  return ep;
}

void RcQp::connect(Channel &ch, const Endpoint &local, const RcParams &params) {
  remote = ch.exchange(local);
  rc_init_to_rts(qp.get(), local, remote, params);
  ch.barrier();
}

RcEnd::RcEnd(const RcOptions &options_)
    : options(options_),
      buf(node.pd.get(), options.buffer_size, options.mr_access),
      rc(node, options) {}

int RcEnd::post_recv(uint64_t wr_id, size_t offset, uint32_t length) {
  return RecvWr(wr_id).sge(sge(offset, length)).post(qp());
}

int RcEnd::post_send(uint64_t wr_id, size_t offset, uint32_t length, int flags) {
  return SendWr(IBV_WR_SEND, wr_id, flags).sge(sge(offset, length)).post(qp());
}

int RcEnd::post_write(uint64_t wr_id, size_t offset, uint32_t length, size_t remote_offset,
                      int flags) {
  return SendWr(IBV_WR_RDMA_WRITE, wr_id, flags)
      .sge(sge(offset, length))
      .remote(raddr(remote_offset), rkey())
      .post(qp());
}

int RcEnd::post_read(uint64_t wr_id, size_t offset, uint32_t length, size_t remote_offset,
                     int flags) {
  return SendWr(IBV_WR_RDMA_READ, wr_id, flags)
      .sge(sge(offset, length))
      .remote(raddr(remote_offset), rkey())
      .post(qp());
}

UdEnd::UdEnd(const UdOptions &options_)
    : options(options_), buf(node.pd.get(), options.buffer_size) {
  const int cqe = static_cast<int>(2 * options.max_wr + 16);
  if (options.cq_ex_wc_flags)
    cq = create_cq_ex(node.ctx.get(), cqe, options.cq_ex_wc_flags, &cq_ex);
  else
    cq = create_cq(node.ctx.get(), cqe);
  qp = create_qp(node.pd.get(), ud_qp_attr(cq.get(), options.max_wr, 4));
  ud_to_rts(qp.get(), options.qkey);
}

Endpoint UdEnd::local() const {
  Endpoint ep;
  ep.lid = node.lid();
  ep.qpn = qp->qp_num;
  ep.rkey = buf.mr->rkey;
  ep.addr = buf.addr();
  ep.length = buf.bytes.size();
  ep.qkey = options.qkey;
  ep.gid = node.gid;
  return ep;
}

void receive_one_message(Channel &ch, const RcOptions &options, uint32_t byte_len, uint32_t seed) {
  RcEnd b(options);
  ASSERT_EQ(0, b.post_recv(1, 0, 4096));
  b.connect(ch);
  ibv_wc wc = b.wait_wc();
  EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
  EXPECT_EQ(wc.byte_len, byte_len);
  EXPECT_TRUE(has_pattern(b.buf.span(0, byte_len), seed));
}

// ---- what this process holds ---------------------------------------------------

Footprint footprint() {
  Footprint f{0, 0, -1};
  if (DIR *d = opendir("/proc/self/fd")) {
    while (readdir(d)) ++f.fds;
    closedir(d);
  }
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) ++f.maps;
  std::ifstream status("/proc/self/status");
  for (std::string key; status >> key;)
    if (key == "VmRSS:" && status >> f.rss_kib) break;
  return f;
}

}  // namespace pcientb::test
