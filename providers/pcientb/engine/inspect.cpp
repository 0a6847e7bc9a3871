// Decoding a node's area for management tools: see inspect.hpp. The area is
// another process's memory that changes as we read it: every offset found in
// it is checked against the area's size before it is followed.
#include "engine/inspect.hpp"

#include <infiniband/verbs.h>

#include <cstring>

#include "engine/layout.hpp"

namespace pcientb::engine {
namespace {

template <typename T>
const T *at_checked(const fabric::NodeView &v, Off off) {
  if (off == 0 || off >= v.area_size || v.area_size - off < sizeof(T)) return nullptr;
  return reinterpret_cast<const T *>(static_cast<const uint8_t *>(v.area) + off);
}

uint64_t used_of(const RingHeader &r, uint64_t consumed) {
  uint64_t tail = r.tail.load(std::memory_order_acquire);
  return tail > consumed ? tail - consumed : 0;
}

}  // namespace

void Counts::add(const QpStats &s) {
  add_counts(*this, s);
}

void Counts::add(const Counts &c) {
  add_counts(*this, c);
}

uint64_t Counts::errors() const {
  uint64_t n = 0;
  for (int s = IBV_WC_SUCCESS + 1; s < kWcStatuses; ++s)
    if (s != IBV_WC_WR_FLUSH_ERR) n += tx_status[s] + rx_status[s];
  return n;
}
uint64_t Counts::flushed() const {
  return tx_status[IBV_WC_WR_FLUSH_ERR] + rx_status[IBV_WC_WR_FLUSH_ERR];
}
uint64_t Counts::tx_packets() const {
  uint64_t n = 0;
  for (uint64_t v : tx_ops) n += v;
  return n;
}
uint64_t Counts::rx_packets() const {
  return rx_ops[0] + rx_ops[1];
}
uint64_t Counts::tx_data() const {
  uint64_t n = 0;
  for (uint64_t v : tx_bytes) n += v;
  return n;
}
uint64_t Counts::rx_data() const {
  return rx_bytes[0] + rx_bytes[1];
}

NodeInfo inspect_node(const fabric::NodeView &v) {
  NodeInfo n;
  n.lid = v.lid;
  n.pid = v.pid;
  n.alive = v.alive;
  n.error = v.error;
  if (!v.area || v.area_size < sizeof(AreaRoot)) return n;
  const auto *root = static_cast<const AreaRoot *>(v.area);
  if (root->magic != kAreaMagic) {  // joined, not yet set up: nothing to show
    n.error = EAGAIN;
    return n;
  }
  const NodeStats &st = root->stats;
  n.comm.assign(st.comm, strnlen(st.comm, sizeof st.comm));
  n.guid = st.guid;
  n.started_ns = st.started_ns;
  n.doorbells = st.doorbells.load(std::memory_order_relaxed);
  n.total.add(st.gone);

  for (uint32_t i = 0; i < kMaxSrqs; ++i) {
    const auto *rq = at_checked<RqShared>(v, root->srq_dir[i].load(std::memory_order_acquire));
    if (!rq) continue;
    SrqInfo s;
    s.id = i;
    s.slots = rq->ring.mask + 1;
    s.max_sge = rq->max_sge;
    s.limit = rq->limit.load(std::memory_order_relaxed);
    s.used = used_of(rq->ring, rq->released.load(std::memory_order_acquire));
    n.srqs.push_back(s);
  }
  for (uint32_t i = 0; i < kMaxCqs; ++i) {
    const auto *cq = at_checked<CqShared>(v, root->cq_dir[i].load(std::memory_order_acquire));
    if (!cq) continue;
    CqInfo c;
    c.id = i;
    c.slots = cq->ring.mask + 1;
    c.used = used_of(cq->ring, cq->ring.head.load(std::memory_order_acquire));
    c.armed = cq->armed.load(std::memory_order_relaxed);
    c.overflow = cq->overflow.load(std::memory_order_relaxed) != 0;
    n.cqs.push_back(c);
  }
  for (uint32_t i = 0; i < kMaxMrs; ++i) {
    const MrShared &m = root->mrs[i];
    uint32_t key = m.key.load(std::memory_order_acquire);
    if (!key) continue;
    n.mrs.push_back({key, key | kRkeyBit, m.pd, m.access, m.addr, m.length});
  }
  for (uint32_t i = 0; i < kMaxQps; ++i) {
    const QpShared &q = root->qps[i];
    const QpStats &s = root->qp_stats[i];
    uint32_t qpn = q.qpn.load(std::memory_order_acquire);
    if (!qpn || s.qpn.load(std::memory_order_relaxed) != qpn) continue;
    QpInfo p;
    p.qpn = qpn;
    p.type = q.type;
    p.state = q.state.load(std::memory_order_relaxed);
    p.pd = q.pd;
    p.dest_lid = q.dest_lid;
    p.dest_qpn = q.dest_qpn;
    p.sq_depth = s.sq_depth;
    p.rq_depth = s.rq_depth;
    uint64_t posted = s.sq_posted.get(), retired = s.sq_retired.load(std::memory_order_acquire);
    p.sq_used = posted > retired ? posted - retired : 0;
    if (const auto *rq = at_checked<RqShared>(v, q.rq))
      p.rq_used = used_of(rq->ring, rq->released.load(std::memory_order_acquire));
    for (size_t k = 0; k < n.srqs.size(); ++k)
      if (q.srq && root->srq_dir[n.srqs[k].id].load(std::memory_order_relaxed) == q.srq)
        p.srq = static_cast<int>(k);
    p.counts.add(s);
    n.total.add(p.counts);
    n.qps.push_back(p);
  }
  return n;
}

const char *qp_type_name(uint32_t type) {
  switch (type) {
    case IBV_QPT_RC:
      return "RC";
    case IBV_QPT_UC:
      return "UC";
    case IBV_QPT_UD:
      return "UD";
    case IBV_QPT_RAW_PACKET:
      return "RAW_PACKET";
    case IBV_QPT_XRC_SEND:
      return "XRC_SEND";
    case IBV_QPT_XRC_RECV:
      return "XRC_RECV";
    default:
      return "?";
  }
}

const char *qp_state_name(uint32_t state) {
  static const char *const names[] = {"RESET", "INIT", "RTR", "RTS", "SQD", "SQE", "ERR"};
  return state < sizeof names / sizeof names[0] ? names[state] : "?";
}

const char *wc_status_name(int status) {
  static const char *const names[] = {"success",
                                      "loc_len_err",
                                      "loc_qp_op_err",
                                      "loc_eec_op_err",
                                      "loc_prot_err",
                                      "wr_flush_err",
                                      "mw_bind_err",
                                      "bad_resp_err",
                                      "loc_access_err",
                                      "rem_inv_req_err",
                                      "rem_access_err",
                                      "rem_op_err",
                                      "retry_exc_err",
                                      "rnr_retry_exc_err",
                                      "loc_rdd_viol_err",
                                      "rem_inv_rd_req_err",
                                      "rem_abort_err",
                                      "inv_eecn_err",
                                      "inv_eec_state_err",
                                      "fatal_err",
                                      "resp_timeout_err",
                                      "general_err",
                                      "tm_err",
                                      "tm_rndv_incomplete"};
  static_assert(sizeof names / sizeof names[0] == kWcStatuses);
  return status >= 0 && status < kWcStatuses ? names[status] : "?";
}

std::string access_names(uint32_t access) {
  static const std::pair<uint32_t, const char *> bits[] = {
      {IBV_ACCESS_LOCAL_WRITE, "LW"}, {IBV_ACCESS_REMOTE_WRITE, "RW"},
      {IBV_ACCESS_REMOTE_READ, "RR"}, {IBV_ACCESS_REMOTE_ATOMIC, "RA"},
      {IBV_ACCESS_MW_BIND, "MW"},     {IBV_ACCESS_ZERO_BASED, "ZB"},
      {IBV_ACCESS_ON_DEMAND, "OD"},   {IBV_ACCESS_RELAXED_ORDERING, "RO"}};
  std::string s;
  for (auto [bit, name] : bits)
    if (access & bit) s += (s.empty() ? "" : "|") + std::string(name);
  return s.empty() ? "-" : s;
}

}  // namespace pcientb::engine
