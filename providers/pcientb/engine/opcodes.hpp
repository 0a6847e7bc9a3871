// The send opcodes the engine supports, in one table: what each completes
// as, what it needs and consumes at the target, and where it is allowed.
// The checks (check_wqe), the requester and the traffic counters read it
// instead of switching on the opcode.
#pragma once

#include <infiniband/verbs.h>

#include <cstdint>
#include <iterator>
#include <optional>

namespace pcientb::engine {

// QP types, as a set.
enum QpTypes : uint8_t { kOnRc = 1, kOnUd = 2 };

struct OpInfo {
  ibv_wr_opcode wr;
  ibv_wc_opcode wc;                      // the requester's completion
  std::optional<ibv_wc_opcode> recv_wc;  // the target's, when it consumes a receive WQE
  int remote_access;                     // IBV_ACCESS_REMOTE_* the target must allow, or 0
  bool imm;                              // carries immediate data
  bool local_dest;                       // the local SGEs receive data: never inline
  uint8_t qp_types;                      // QpTypes where it may be posted
};

// Indexed by the opcode: the supported ones are 0..6 in <infiniband/verbs.h>.
inline constexpr OpInfo kOpInfo[] = {
    {.wr = IBV_WR_RDMA_WRITE,
     .wc = IBV_WC_RDMA_WRITE,
     .recv_wc = std::nullopt,
     .remote_access = IBV_ACCESS_REMOTE_WRITE,
     .imm = false,
     .local_dest = false,
     .qp_types = kOnRc},
    {.wr = IBV_WR_RDMA_WRITE_WITH_IMM,
     .wc = IBV_WC_RDMA_WRITE,
     .recv_wc = IBV_WC_RECV_RDMA_WITH_IMM,
     .remote_access = IBV_ACCESS_REMOTE_WRITE,
     .imm = true,
     .local_dest = false,
     .qp_types = kOnRc},
    {.wr = IBV_WR_SEND,
     .wc = IBV_WC_SEND,
     .recv_wc = IBV_WC_RECV,
     .remote_access = 0,
     .imm = false,
     .local_dest = false,
     .qp_types = kOnRc | kOnUd},
    {.wr = IBV_WR_SEND_WITH_IMM,
     .wc = IBV_WC_SEND,
     .recv_wc = IBV_WC_RECV,
     .remote_access = 0,
     .imm = true,
     .local_dest = false,
     .qp_types = kOnRc | kOnUd},
    {.wr = IBV_WR_RDMA_READ,
     .wc = IBV_WC_RDMA_READ,
     .recv_wc = std::nullopt,
     .remote_access = IBV_ACCESS_REMOTE_READ,
     .imm = false,
     .local_dest = true,
     .qp_types = kOnRc},
    {.wr = IBV_WR_ATOMIC_CMP_AND_SWP,
     .wc = IBV_WC_COMP_SWAP,
     .recv_wc = std::nullopt,
     .remote_access = IBV_ACCESS_REMOTE_ATOMIC,
     .imm = false,
     .local_dest = true,
     .qp_types = kOnRc},
    {.wr = IBV_WR_ATOMIC_FETCH_AND_ADD,
     .wc = IBV_WC_FETCH_ADD,
     .recv_wc = std::nullopt,
     .remote_access = IBV_ACCESS_REMOTE_ATOMIC,
     .imm = false,
     .local_dest = true,
     .qp_types = kOnRc},
};

constexpr bool op_table_is_indexed() {
  for (unsigned i = 0; i < std::size(kOpInfo); ++i)
    if (static_cast<unsigned>(kOpInfo[i].wr) != i) return false;
  return true;
}
static_assert(op_table_is_indexed(), "kOpInfo[op].wr must be op");

constexpr bool op_supported(ibv_wr_opcode op) {
  return static_cast<unsigned>(op) < std::size(kOpInfo);
}
// The entry of a supported opcode; nullptr for any other value.
constexpr const OpInfo *op_info(ibv_wr_opcode op) {
  return op_supported(op) ? &kOpInfo[op] : nullptr;
}

constexpr bool op_allowed_on(const OpInfo &op, ibv_qp_type type) {
  switch (type) {
    case IBV_QPT_RC:
      return op.qp_types & kOnRc;
    case IBV_QPT_UD:
      return op.qp_types & kOnUd;
    default:
      return false;
  }
}

constexpr bool is_atomic(const OpInfo &op) {
  return op.remote_access == IBV_ACCESS_REMOTE_ATOMIC;
}

}  // namespace pcientb::engine
