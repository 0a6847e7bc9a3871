// What a node shows of itself, decoded from its area as a management tool
// sees it (through fabric::FabricView, mapped read-only): identity, QPs, MRs,
// CQs, SRQs and traffic counters (engine/counters.hpp). A snapshot taken
// while the node runs: each figure is exact, the set of them a moment apart.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/counters.hpp"
#include "fabric/fabric.hpp"

namespace pcientb::engine {

// QpStats as plain numbers.
struct Counts {
  uint64_t tx_ops[kTxKinds] = {}, tx_bytes[kTxKinds] = {};
  uint64_t rnr_retries = 0, transport_retries = 0;
  uint64_t tx_status[kWcStatuses] = {};
  uint64_t rx_ops[kRxKinds] = {}, rx_bytes[kRxKinds] = {};
  uint64_t rx_status[kWcStatuses] = {};

  void add(const QpStats &s);
  void add(const Counts &c);
  // Completions in error, flushes not counted (those follow an error).
  uint64_t errors() const;
  uint64_t flushed() const;
  uint64_t tx_packets() const;
  uint64_t rx_packets() const;
  uint64_t tx_data() const;  // bytes
  uint64_t rx_data() const;
};

struct QpInfo {
  uint32_t qpn = 0, type = 0, state = 0, pd = 0;
  uint16_t dest_lid = 0;
  uint32_t dest_qpn = 0;
  uint64_t sq_used = 0, rq_used = 0;  // WRs outstanding
  uint32_t sq_depth = 0, rq_depth = 0;
  int srq = -1;  // index into NodeInfo::srqs, or -1
  Counts counts;
};
struct MrInfo {
  uint32_t lkey = 0, rkey = 0, pd = 0, access = 0;
  uint64_t addr = 0, length = 0;
};
struct CqInfo {
  uint32_t id = 0;  // its directory entry
  uint32_t slots = 0;
  uint64_t used = 0;   // entries not yet polled
  uint32_t armed = 0;  // enum ArmState
  bool overflow = false;
};
struct SrqInfo {
  uint32_t id = 0;
  uint32_t slots = 0, max_sge = 0, limit = 0;
  uint64_t used = 0;  // WQEs posted and not consumed
};

struct NodeInfo {
  uint16_t lid = 0;
  int32_t pid = 0;
  bool alive = false;
  int error = 0;  // why nothing but the above is known (an errno value)
  std::string comm;
  uint64_t guid = 0, started_ns = 0, doorbells = 0;
  std::vector<QpInfo> qps;
  std::vector<MrInfo> mrs;
  std::vector<CqInfo> cqs;
  std::vector<SrqInfo> srqs;
  Counts total;  // of the node: live QPs and those destroyed
};

NodeInfo inspect_node(const fabric::NodeView &v);

const char *qp_type_name(uint32_t type);
const char *qp_state_name(uint32_t state);
const char *wc_status_name(int status);  // short, as in ibv_wc_status_str
std::string access_names(uint32_t access);

}  // namespace pcientb::engine
