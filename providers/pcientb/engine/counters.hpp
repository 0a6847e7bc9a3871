// Traffic counters and what a node shows of itself. They live in the node's
// area (AreaRoot::stats) so that a management tool (pcientb-stat, through
// engine/inspect.hpp) reads them from outside the process; no peer reads or
// writes them. Every counter has one writer at a time, named beside it, so
// counting is a plain load and store with no locked instruction on the data
// path; a reader may see a count that is a moment old.
#pragma once

#include <infiniband/verbs.h>

#include <atomic>
#include <cstdint>

#include "engine/opcodes.hpp"

namespace pcientb::engine {

// What a requester's WR moves, by the remote right it needs (send: a message).
enum class Traffic : uint8_t { send, write, read, atomic, none };
constexpr int kTxKinds = 4;
constexpr const char *kTxNames[kTxKinds] = {"send", "write", "read", "atomic"};
// What a receiver's completions carry: SENDs, and RDMA WRITEs with immediate.
constexpr int kRxKinds = 2;
constexpr const char *kRxNames[kRxKinds] = {"recv", "recv_write_imm"};
// Completions are counted by status: IBV_WC_SUCCESS .. IBV_WC_TM_RNDV_INCOMPLETE.
constexpr int kWcStatuses = IBV_WC_TM_RNDV_INCOMPLETE + 1;

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

// A counter with one writer: no locked instruction, and readers in other
// threads or processes read it without a data race.
struct Stat {
  std::atomic<uint64_t> v{0};
  void add(uint64_t n) {
    v.store(v.load(std::memory_order_relaxed) + n, std::memory_order_relaxed);
  }
  uint64_t get() const { return v.load(std::memory_order_relaxed); }
  void set(uint64_t n) { v.store(n, std::memory_order_relaxed); }
};

// Per QP, in the slot of its index. Requester fields: with the QP's sq_mu.
// Receiver fields: with the poll_mu of the CQ that the QP's receives go to.
struct alignas(64) QpStats {
  std::atomic<uint32_t> qpn;  // whose counters these are; 0: no QP
  uint32_t type;              // enum ibv_qp_type
  uint32_t sq_depth, rq_depth;
  std::atomic<uint64_t> sq_retired;  // WRs retired by polling (Node::retire)
  Stat sq_posted;                    // WRs posted since RESET
  // Requester: WRs completed (signaled or not), by kind, and their bytes.
  Stat tx_ops[kTxKinds], tx_bytes[kTxKinds];
  Stat rnr_retries, transport_retries;  // attempts repeated after RNR NAK / timeout
  Stat tx_status[kWcStatuses];          // send completions by status, flushes included
  // Receiver: completions polled, by kind, and their bytes.
  Stat rx_ops[kRxKinds], rx_bytes[kRxKinds];
  Stat rx_status[kWcStatuses];  // receive completions by status

  void count_tx(ibv_wr_opcode op, ibv_wc_status status, uint64_t len) {
    tx_status[status < kWcStatuses ? status : 0].add(1);
    Traffic t = traffic_of(op);
    if (status != IBV_WC_SUCCESS || t == Traffic::none) return;
    tx_ops[static_cast<int>(t)].add(1);
    tx_bytes[static_cast<int>(t)].add(len);
  }
  void count_rx(const ibv_wc &wc) {
    rx_status[wc.status < kWcStatuses ? wc.status : 0].add(1);
    if (wc.status != IBV_WC_SUCCESS) return;
    int k = wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM ? 1 : 0;
    rx_ops[k].add(1);
    rx_bytes[k].add(wc.byte_len);
  }
  // Adds the traffic counters (not the identity, not the queue positions) to sum.
  void add_to(QpStats &sum) const;
  void clear();
};

// Per node. Fields other than doorbells: with the node's table lock.
struct NodeStats {
  char comm[16];  // the program, as /proc/<pid>/comm
  int32_t pid;    // of the process that owns the node
  uint16_t lid;
  uint16_t pad;
  uint64_t guid;                    // node GUID, host order
  uint64_t started_ns;              // CLOCK_REALTIME at join
  std::atomic<uint64_t> doorbells;  // rung at peers and at itself (any thread)
  QpStats gone;                     // counters of the QPs destroyed so far
};

// Adds the traffic counters of `from` to `to`: QpStats or plain numbers
// (inspect.hpp's Counts) on either side.
inline uint64_t value_of(const Stat &s) {
  return s.get();
}
inline uint64_t value_of(uint64_t v) {
  return v;
}
inline void accumulate(Stat &to, uint64_t v) {
  to.set(to.get() + v);
}
inline void accumulate(uint64_t &to, uint64_t v) {
  to += v;
}
template <typename To, typename From>
void add_counts(To &to, const From &from) {
  for (int i = 0; i < kTxKinds; ++i) {
    accumulate(to.tx_ops[i], value_of(from.tx_ops[i]));
    accumulate(to.tx_bytes[i], value_of(from.tx_bytes[i]));
  }
  for (int i = 0; i < kRxKinds; ++i) {
    accumulate(to.rx_ops[i], value_of(from.rx_ops[i]));
    accumulate(to.rx_bytes[i], value_of(from.rx_bytes[i]));
  }
  for (int i = 0; i < kWcStatuses; ++i) {
    accumulate(to.tx_status[i], value_of(from.tx_status[i]));
    accumulate(to.rx_status[i], value_of(from.rx_status[i]));
  }
  accumulate(to.rnr_retries, value_of(from.rnr_retries));
  accumulate(to.transport_retries, value_of(from.transport_retries));
}

inline void QpStats::add_to(QpStats &sum) const {
  add_counts(sum, *this);
}

inline void QpStats::clear() {
  Stat *all[] = {&sq_posted, &rnr_retries, &transport_retries};
  for (Stat *s : all) s->set(0);
  for (int i = 0; i < kTxKinds; ++i) tx_ops[i].set(0), tx_bytes[i].set(0);
  for (int i = 0; i < kRxKinds; ++i) rx_ops[i].set(0), rx_bytes[i].set(0);
  for (int i = 0; i < kWcStatuses; ++i) tx_status[i].set(0), rx_status[i].set(0);
  sq_retired.store(0, std::memory_order_relaxed);
}

}  // namespace pcientb::engine
