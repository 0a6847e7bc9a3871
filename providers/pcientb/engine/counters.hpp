// Traffic counters: what a node's work moved, by kind. Each set has one
// writer at a time (a QP's requester under sq_mu, a CQ's poller under
// poll_mu), so counting is a plain add with no locked instruction on the data
// path; whoever reports sums the sets (Node::traffic).
#pragma once

#include <infiniband/verbs.h>

#include <atomic>
#include <cstdint>

#include "engine/opcodes.hpp"

namespace pcientb::engine {

enum class Traffic : uint8_t { send, write, read, atomic, recv, none };
constexpr int kTrafficKinds = 5;
constexpr const char *kTrafficNames[kTrafficKinds] = {"send", "write", "read", "atomic", "recv"};

// What a WR moves, from the remote right it needs: none means a message.
// Unsupported opcodes move nothing.
constexpr Traffic traffic_of(ibv_wr_opcode op) {
  // By index, not op_info(): GCC does not fold a pointer test under -fsanitize.
  if (!op_supported(op)) return Traffic::none;
  switch (kOpInfo[op].remote_access) {
    case IBV_ACCESS_REMOTE_WRITE:
      return Traffic::write;
    case IBV_ACCESS_REMOTE_READ:
      return Traffic::read;
    case IBV_ACCESS_REMOTE_ATOMIC:
      return Traffic::atomic;
    default:
      return Traffic::send;
  }
}
static_assert(traffic_of(IBV_WR_SEND_WITH_IMM) == Traffic::send &&
              traffic_of(IBV_WR_RDMA_WRITE_WITH_IMM) == Traffic::write &&
              traffic_of(IBV_WR_RDMA_READ) == Traffic::read &&
              traffic_of(IBV_WR_ATOMIC_FETCH_AND_ADD) == Traffic::atomic &&
              traffic_of(IBV_WR_SEND_WITH_INV) == Traffic::none);

struct Counters {
  std::atomic<uint64_t> ops[kTrafficKinds] = {};
  std::atomic<uint64_t> bytes[kTrafficKinds] = {};
  std::atomic<uint64_t> errors{0};  // completions in error, flushes not counted

  void count(Traffic t, uint64_t len) {
    if (t == Traffic::none) return;
    bump(ops[static_cast<int>(t)], 1);
    bump(bytes[static_cast<int>(t)], len);
  }
  void count_error() { bump(errors, 1); }
  void add_to(Counters &sum) const {
    for (int i = 0; i < kTrafficKinds; ++i) {
      bump(sum.ops[i], ops[i].load(std::memory_order_relaxed));
      bump(sum.bytes[i], bytes[i].load(std::memory_order_relaxed));
    }
    bump(sum.errors, errors.load(std::memory_order_relaxed));
  }

 private:
  static void bump(std::atomic<uint64_t> &c, uint64_t n) {
    c.store(c.load(std::memory_order_relaxed) + n, std::memory_order_relaxed);
  }
};

}  // namespace pcientb::engine
