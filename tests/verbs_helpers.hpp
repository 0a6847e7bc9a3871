// Small helpers over the public verbs API (<infiniband/verbs.h> only), so a
// test reads like the behaviour it checks: RAII handles, the QP state
// transitions, work-request builders, polling with deadlines, data patterns,
// and the usual "one side of a connection" bundles (RcEnd, UdEnd).
#ifndef PCIENTB_TESTS_VERBS_HELPERS_HPP
#define PCIENTB_TESTS_VERBS_HELPERS_HPP

#include "two_process.hpp"

#include <gtest/gtest.h>
#include <infiniband/verbs.h>

#include <chrono>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <ostream>
#include <span>
#include <vector>

// Readable gtest output for verbs enums (found by ADL in the global namespace).
void PrintTo(ibv_wc_status status, std::ostream *os);
void PrintTo(ibv_wc_opcode opcode, std::ostream *os);
void PrintTo(ibv_qp_state state, std::ostream *os);
void PrintTo(ibv_port_state state, std::ostream *os);

namespace pcientb::test {

inline constexpr std::chrono::milliseconds kTimeout = 10s;  // any single verbs wait
inline constexpr uint8_t kPort = 1;
inline constexpr const char *kDeviceName = "pcientb0";

inline constexpr int kRemoteAll =
    IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
inline constexpr int kAllAccess = IBV_ACCESS_LOCAL_WRITE | kRemoteAll;

// ---- RAII handles -------------------------------------------------------------

template <class T, auto Destroy>
struct Destroyer {
  void operator()(T *p) const {
    if (p) Destroy(p);
  }
};
template <class T, auto Destroy>
using Handle = std::unique_ptr<T, Destroyer<T, Destroy>>;

using ContextPtr = Handle<ibv_context, ibv_close_device>;
using PdPtr = Handle<ibv_pd, ibv_dealloc_pd>;
using MrPtr = Handle<ibv_mr, ibv_dereg_mr>;
using CqPtr = Handle<ibv_cq, ibv_destroy_cq>;
using QpPtr = Handle<ibv_qp, ibv_destroy_qp>;
using SrqPtr = Handle<ibv_srq, ibv_destroy_srq>;
using AhPtr = Handle<ibv_ah, ibv_destroy_ah>;
using CompChannelPtr = Handle<ibv_comp_channel, ibv_destroy_comp_channel>;

// Opens pcientb0 on this process's private fabric (throws SetupError).
ContextPtr open_device();
// Each of these throws SetupError when the verb fails.
PdPtr alloc_pd(ibv_context *ctx);
MrPtr reg_mr(ibv_pd *pd, void *addr, size_t length, int access);
CqPtr create_cq(ibv_context *ctx, int cqe = 256, ibv_comp_channel *channel = nullptr);
// An extended CQ (ibv_create_cq_ex) reporting `wc_flags`; *ex gets its ibv_cq_ex.
CqPtr create_cq_ex(ibv_context *ctx, int cqe, uint64_t wc_flags, ibv_cq_ex **ex,
                   ibv_comp_channel *channel = nullptr);
CompChannelPtr create_comp_channel(ibv_context *ctx);
QpPtr create_qp(ibv_pd *pd, ibv_qp_init_attr attr);
ibv_qp_init_attr rc_qp_attr(ibv_cq *cq, uint32_t max_wr = 64, uint32_t max_sge = 4);
ibv_qp_init_attr ud_qp_attr(ibv_cq *cq, uint32_t max_wr = 64, uint32_t max_sge = 4);

// This process's node on the fabric: the opened device, its port 1, a PD.
struct Node {
  Node();
  ContextPtr ctx;
  ibv_port_attr port{};
  ibv_gid gid{};
  PdPtr pd;
  uint16_t lid() const { return port.lid; }
};

// A registered buffer (zero-filled).
struct Buffer {
  Buffer(ibv_pd *pd, size_t size, int access = kAllAccess);
  std::vector<uint8_t> bytes;
  MrPtr mr;
  uint8_t *at(size_t offset) { return bytes.data() + offset; }
  std::span<uint8_t> span(size_t offset, size_t length) { return {at(offset), length}; }
  uint64_t addr(size_t offset = 0) const {
    return reinterpret_cast<uintptr_t>(bytes.data()) + offset;
  }
  ibv_sge sge(size_t offset, uint32_t length) const;
};

// ---- connection info and QP state transitions -----------------------------

// What one side tells the other (plain bytes over the channel).
struct Endpoint {
  uint16_t lid = 0;
  uint32_t qpn = 0;
  uint32_t psn = 0;
  uint32_t rkey = 0;
  uint64_t addr = 0;
  uint64_t length = 0;
  uint32_t qkey = 0;
  ibv_gid gid{};
};

struct RcParams {
  int access = kRemoteAll;  // qp_access_flags
  ibv_mtu mtu = IBV_MTU_4096;
  uint8_t timeout = 10;  // 4.096 us * 2^10 ~ 4 ms
  uint8_t retry_cnt = 3;
  uint8_t rnr_retry = 7;  // 7 = retry forever
  uint8_t min_rnr_timer = 1;
  uint8_t rd_atomic = 16;  // max_rd_atomic and max_dest_rd_atomic
  bool grh = false;        // address the peer with a GRH (is_global = 1)
};

// The masks the IB spec requires for each RC transition.
inline constexpr int kInitMask =
    IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
inline constexpr int kRtrMask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
inline constexpr int kRtsMask = IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                                IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC;
// ... and for UD.
inline constexpr int kUdInitMask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY;
inline constexpr int kUdRtsMask = IBV_QP_STATE | IBV_QP_SQ_PSN;

ibv_qp_attr init_attr(int access);
ibv_qp_attr rtr_attr(const Endpoint &remote, const RcParams &params = {});
ibv_qp_attr rts_attr(uint32_t sq_psn, const RcParams &params = {});
ibv_qp_attr state_attr(ibv_qp_state state);

// ibv_modify_qp's return value (0 or an errno value).
int modify_qp(ibv_qp *qp, ibv_qp_attr attr, int mask);
// RESET -> INIT -> RTR -> RTS (throws SetupError naming the step that failed).
void rc_to_rts(ibv_qp *qp, const Endpoint &local, const Endpoint &remote,
               const RcParams &params = {});
// The same in two steps: RESET -> INIT, and later INIT -> RTR -> RTS.
void rc_to_init(ibv_qp *qp, const RcParams &params = {});
void rc_init_to_rts(ibv_qp *qp, const Endpoint &local, const Endpoint &remote,
                    const RcParams &params = {});
void ud_to_rts(ibv_qp *qp, uint32_t qkey, uint32_t sq_psn = 0);
ibv_qp_state query_state(ibv_qp *qp);

// An address handle for the peer's port (LID routed, or with a GRH).
AhPtr create_ah(ibv_pd *pd, const Endpoint &remote, bool grh = false);

// ---- work requests ----------------------------------------------------------

// Builds and posts one send work request:
//   SendWr(IBV_WR_RDMA_WRITE, 7).sge(buf.sge(0, 64)).remote(peer.addr, peer.rkey).post(qp)
struct SendWr {
  explicit SendWr(ibv_wr_opcode opcode, uint64_t wr_id = 0, int flags = IBV_SEND_SIGNALED);
  SendWr &sge(ibv_sge s);
  SendWr &sge(const void *addr, uint32_t length, uint32_t lkey);
  SendWr &flags(int flags);
  SendWr &remote(uint64_t addr, uint32_t rkey);
  SendWr &imm(uint32_t host_order_imm);
  SendWr &compare_add(uint64_t compare_add);
  SendWr &swap(uint64_t swap);
  SendWr &ud(ibv_ah *ah, uint32_t remote_qpn, uint32_t remote_qkey);
  // ibv_post_send's return value; *bad (when given) gets bad_wr.
  int post(ibv_qp *qp, ibv_send_wr **bad = nullptr);

  ibv_send_wr wr{};
  std::vector<ibv_sge> sges;
};

struct RecvWr {
  explicit RecvWr(uint64_t wr_id = 0);
  RecvWr &sge(ibv_sge s);
  int post(ibv_qp *qp, ibv_recv_wr **bad = nullptr);
  int post(ibv_srq *srq, ibv_recv_wr **bad = nullptr);

  ibv_recv_wr wr{};
  std::vector<ibv_sge> sges;
};

// ---- completions ------------------------------------------------------------

// The next completion; throws SetupError when none comes within `timeout`.
ibv_wc wait_wc(ibv_cq *cq, std::chrono::milliseconds timeout = kTimeout);
// The next n completions; throws SetupError when fewer come within `timeout`.
std::vector<ibv_wc> wait_wcs(ibv_cq *cq, size_t n, std::chrono::milliseconds timeout = kTimeout);
// True when nothing is completed on cq for `period`.
bool stays_empty(ibv_cq *cq, std::chrono::milliseconds period = 300ms);

// The CQ of the next completion event on `channel` (acknowledged already),
// or nullptr when none comes within `timeout`. Sleeps in poll() on the fd.
ibv_cq *wait_cq_event(ibv_comp_channel *channel, std::chrono::milliseconds timeout = kTimeout);
// The next async event (acknowledged already), or nothing within `timeout`.
std::optional<ibv_async_event> wait_async_event(ibv_context *ctx,
                                                std::chrono::milliseconds timeout = kTimeout);
// The next async event of `type`, skipping (and acknowledging) any other, such
// as the unaffiliated IBV_EVENT_PORT_ACTIVE; or nothing within `timeout`.
std::optional<ibv_async_event> wait_async_event_of(ibv_context *ctx, ibv_event_type type,
                                                   std::chrono::milliseconds timeout = kTimeout);

// ---- data -----------------------------------------------------------------------

// A byte pattern that differs per seed and per offset.
uint8_t pattern_byte(uint32_t seed, size_t offset);
void fill_pattern(std::span<uint8_t> bytes, uint32_t seed, size_t first_offset = 0);
// Checks every byte; the failure names the first wrong offset.
::testing::AssertionResult has_pattern(std::span<const uint8_t> bytes, uint32_t seed,
                                       size_t first_offset = 0);
::testing::AssertionResult all_bytes_are(std::span<const uint8_t> bytes, uint8_t value);

bool is_one_of(int value, std::initializer_list<int> allowed);

// ---- what this process holds ---------------------------------------------------

// Open descriptors, mappings and resident memory (KiB): what a leak shows in.
struct Footprint {
  size_t fds, maps;
  long rss_kib;
};
Footprint footprint();
// Under a sanitizer, mappings and resident memory are its allocator's (ASan
// keeps freed memory in quarantine, and maps more as it goes): only the
// descriptors compare; its own leak check covers memory.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool kSanitizerOwnsMemory = true;
#else
inline constexpr bool kSanitizerOwnsMemory = false;
#endif

// ---- one side of a connection -------------------------------------------------

struct RcOptions {
  size_t buffer_size = 64 * 1024;
  int mr_access = kAllAccess;
  RcParams params;
  uint32_t max_send_wr = 64;
  uint32_t max_recv_wr = 64;
  uint32_t max_sge = 4;
  uint32_t max_inline = 64;
  int cqe = 0;  // 0: room for both queues
  bool sq_sig_all = false;
  uint64_t send_ops_flags = 0;  // non-zero: created with ibv_create_qp_ex
  bool comp_channel = false;    // the CQ reports to a completion channel
  uint64_t cq_ex_wc_flags = 0;  // non-zero: the CQ is made with ibv_create_cq_ex
};

// An RC QP with one CQ for both queues, on a node. It is created in INIT, so
// receives can be posted before connecting (as ibv_rc_pingpong does).
struct RcQp {
  RcQp(Node &node, const RcOptions &options = {}, ibv_srq *srq = nullptr);
  CompChannelPtr channel;  // only with RcOptions::comp_channel
  CqPtr cq;
  ibv_cq_ex *cq_ex = nullptr;  // only with RcOptions::cq_ex_wc_flags
  QpPtr qp;
  uint32_t psn;
  Endpoint remote;
  // Our connection info, advertising `buffer` for remote access.
  Endpoint endpoint(const Node &node, const Buffer &buffer) const;
  // Exchanges endpoints over the channel, brings the QP from INIT to RTS
  // and waits until the peer's QP is in RTS too.
  void connect(Channel &ch, const Endpoint &local, const RcParams &params);
};

// The usual side of an RC test: node, one registered buffer, one RC QP.
struct RcEnd {
  explicit RcEnd(const RcOptions &options = {});
  RcOptions options;
  Node node;
  Buffer buf;
  RcQp rc;

  void connect(Channel &ch) { rc.connect(ch, local(), options.params); }
  Endpoint local() const { return rc.endpoint(node, buf); }
  const Endpoint &remote() const { return rc.remote; }
  ibv_qp *qp() const { return rc.qp.get(); }
  ibv_cq *cq() const { return rc.cq.get(); }
  ibv_sge sge(size_t offset, uint32_t length) const { return buf.sge(offset, length); }
  uint64_t raddr(size_t offset) const { return rc.remote.addr + offset; }
  uint32_t rkey() const { return rc.remote.rkey; }

  // Shorthands for the common single-SGE operations on our buffer and the
  // peer's advertised buffer. Each returns ibv_post_send's value.
  int post_recv(uint64_t wr_id, size_t offset, uint32_t length);
  int post_send(uint64_t wr_id, size_t offset, uint32_t length, int flags = IBV_SEND_SIGNALED);
  int post_write(uint64_t wr_id, size_t offset, uint32_t length, size_t remote_offset,
                 int flags = IBV_SEND_SIGNALED);
  int post_read(uint64_t wr_id, size_t offset, uint32_t length, size_t remote_offset,
                int flags = IBV_SEND_SIGNALED);
  ibv_wc wait_wc(std::chrono::milliseconds timeout = kTimeout) {
    return test::wait_wc(cq(), timeout);
  }
};

// The receiving side of a one-message test: posts one 4096-byte receive,
// connects, and expects one successful completion of `byte_len` bytes holding
// pattern `seed`.
void receive_one_message(Channel &ch, const RcOptions &options, uint32_t byte_len, uint32_t seed);

struct UdOptions {
  size_t buffer_size = 64 * 1024;
  uint32_t qkey = 0x11111111;
  uint32_t max_wr = 64;
  uint64_t cq_ex_wc_flags = 0;  // non-zero: the CQ is made with ibv_create_cq_ex
};

// The usual side of a UD test: node, buffer, one UD QP in RTS with one CQ.
struct UdEnd {
  explicit UdEnd(const UdOptions &options = {});
  UdOptions options;
  Node node;
  Buffer buf;
  CqPtr cq;
  ibv_cq_ex *cq_ex = nullptr;  // only with UdOptions::cq_ex_wc_flags
  QpPtr qp;
  Endpoint local() const;
  ibv_wc wait_wc(std::chrono::milliseconds timeout = kTimeout) {
    return test::wait_wc(cq.get(), timeout);
  }
};

// The UD receive buffer layout: 40 bytes for the GRH, then the payload.
inline constexpr size_t kGrhBytes = 40;

}  // namespace pcientb::test

#endif
