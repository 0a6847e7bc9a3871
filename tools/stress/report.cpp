#include "report.hpp"

#include <infiniband/verbs.h>

#include <cinttypes>
#include <cstdio>

namespace stress {
namespace {

// The counters of every slot, added up.
struct Totals {
  uint64_t ops[kOpCount] = {}, op_errors[kOpCount] = {};
  uint64_t bytes = 0, verified_bytes = 0, messages = 0;
  uint64_t ud_sent = 0, ud_received = 0, ud_reordered = 0;
  uint64_t connections = 0, recreate_clean = 0, recreate_abrupt = 0;
  uint64_t target_destroyed = 0, target_errored = 0, mr_reregs = 0, cq_overruns = 0;
  uint64_t discarded = 0, unverified_write_bytes = 0;
  uint64_t expected[kReasonCount] = {}, flushed[kReasonCount] = {}, events[kReasonCount] = {};
  uint64_t unexpected_status[kStatusSlots] = {}, anomalies[kAnomalyCount] = {};
  uint64_t lost = 0, corrupted = 0, duplicated = 0, hung = 0;

  uint64_t total_ops() const {
    uint64_t n = 0;
    for (int i = 0; i < kOpCount; ++i) n += ops[i] + op_errors[i];
    return n;
  }
  uint64_t unexpected() const {
    uint64_t n = 0;
    for (uint64_t v : unexpected_status) n += v;
    for (uint64_t v : anomalies) n += v;
    return n;
  }
};

Totals sum(const Directory &dir) {
  Totals t;
  for (int s = 0; s < dir.procs; ++s) {
    const Counters &c = dir.slots[s].counters;
    for (int i = 0; i < kOpCount; ++i) {
      t.ops[i] += get(c.ops[i]);
      t.op_errors[i] += get(c.op_errors[i]);
    }
    t.bytes += get(c.bytes);
    t.verified_bytes += get(c.verified_bytes);
    t.messages += get(c.messages);
    t.ud_sent += get(c.ud_sent);
    t.ud_received += get(c.ud_received);
    t.ud_reordered += get(c.ud_reordered);
    t.connections += get(c.connections);
    t.recreate_clean += get(c.qp_recreations_clean);
    t.recreate_abrupt += get(c.qp_recreations_abrupt);
    t.target_destroyed += get(c.target_qp_destroyed);
    t.target_errored += get(c.target_qp_errored);
    t.mr_reregs += get(c.mr_reregistrations);
    t.cq_overruns += get(c.cq_overruns);
    t.discarded += get(c.discarded);
    t.unverified_write_bytes += get(c.unverified_write_bytes);
    for (int r = 0; r < kReasonCount; ++r) {
      t.expected[r] += get(c.expected[r]);
      t.flushed[r] += get(c.flushed[r]);
      t.events[r] += get(c.expected_events[r]);
    }
    for (int i = 0; i < kStatusSlots; ++i) t.unexpected_status[i] += get(c.unexpected_status[i]);
    for (int i = 0; i < kAnomalyCount; ++i) t.anomalies[i] += get(c.anomalies[i]);
    t.lost += get(c.lost);
    t.corrupted += get(c.corrupted);
    t.duplicated += get(c.duplicated);
    t.hung += get(c.hung);
  }
  t.hung += get(dir.hung_workers);
  return t;
}

const char *wc_status_enum(int status) {
  static const char *names[] = {"IBV_WC_SUCCESS",
                                "IBV_WC_LOC_LEN_ERR",
                                "IBV_WC_LOC_QP_OP_ERR",
                                "IBV_WC_LOC_EEC_OP_ERR",
                                "IBV_WC_LOC_PROT_ERR",
                                "IBV_WC_WR_FLUSH_ERR",
                                "IBV_WC_MW_BIND_ERR",
                                "IBV_WC_BAD_RESP_ERR",
                                "IBV_WC_LOC_ACCESS_ERR",
                                "IBV_WC_REM_INV_REQ_ERR",
                                "IBV_WC_REM_ACCESS_ERR",
                                "IBV_WC_REM_OP_ERR",
                                "IBV_WC_RETRY_EXC_ERR",
                                "IBV_WC_RNR_RETRY_EXC_ERR",
                                "IBV_WC_LOC_RDD_VIOL_ERR",
                                "IBV_WC_REM_INV_RD_REQ_ERR",
                                "IBV_WC_REM_ABORT_ERR",
                                "IBV_WC_INV_EECN_ERR",
                                "IBV_WC_INV_EEC_STATE_ERR",
                                "IBV_WC_FATAL_ERR",
                                "IBV_WC_RESP_TIMEOUT_ERR",
                                "IBV_WC_GENERAL_ERR",
                                "IBV_WC_TM_ERR",
                                "IBV_WC_TM_RNDV_INCOMPLETE"};
  if (status >= 0 && status < static_cast<int>(sizeof names / sizeof names[0]))
    return names[status];
  return "(other status)";
}

// The status an HCA reports for each cause, as the report names it.
const char *prescribed(Reason r) {
  switch (r) {
    case Reason::kPeerKilled:
      return "IBV_WC_RETRY_EXC_ERR";
    case Reason::kPeerQpGone:
      return "IBV_WC_RETRY_EXC_ERR";
    case Reason::kMrReregistered:
      return "IBV_WC_REM_ACCESS_ERR";
    case Reason::kCqOverrun:
      return "IBV_EVENT_CQ_ERR / IBV_EVENT_QP_FATAL";
    case Reason::kOwnQpFailed:
      return "IBV_WC_WR_FLUSH_ERR / IBV_EVENT_QP_LAST_WQE_REACHED";
  }
  return "";
}

double gib(uint64_t bytes) {
  return bytes / double(1ull << 30);
}

void print_expected(const Totals &t) {
  uint64_t total = 0;
  for (int r = 0; r < kReasonCount; ++r) total += t.expected[r] + t.flushed[r] + t.events[r];
  std::printf("expected errors (cause shown by the directory, status as prescribed): %" PRIu64 "\n",
              total);
  for (int r = 0; r < kReasonCount; ++r) {
    if (!t.expected[r] && !t.flushed[r] && !t.events[r]) continue;
    std::printf("  %-28s %8" PRIu64 " first errors, %8" PRIu64 " flushed, %6" PRIu64
                " async events   (%s)\n",
                reason_name(static_cast<Reason>(r)), t.expected[r], t.flushed[r], t.events[r],
                prescribed(static_cast<Reason>(r)));
  }
}

void print_unexpected(const Totals &t) {
  std::printf("unexpected errors: %" PRIu64 "\n", t.unexpected());
  for (int i = 0; i < kStatusSlots; ++i)
    if (t.unexpected_status[i])
      std::printf("  %-50s %8" PRIu64 "\n", wc_status_enum(i), t.unexpected_status[i]);
  for (int i = 0; i < kAnomalyCount; ++i)
    if (t.anomalies[i])
      std::printf("  %-50s %8" PRIu64 "\n", anomaly_name(static_cast<Anomaly>(i)), t.anomalies[i]);
}

}  // namespace

void print_header(const Options &opt) {
  std::printf("pcientb-stress: %d processes x %d RC QPs (+1 UD QP each), sizes 0..%s, seed %" PRIu64
              ", fabric %s\n",
              opt.procs, opt.qps, format_bytes(static_cast<double>(opt.max_size)).c_str(), opt.seed,
              opt.fabric.c_str());
  std::printf(
      "  stop after %s%s%s; SIGKILL every %s; chaos every %s per process; hang after %d ms\n",
      opt.ops ? (std::to_string(opt.ops) + " operations").c_str() : "",
      opt.ops && opt.seconds > 0 ? " or " : "",
      opt.seconds > 0 ? (std::to_string(static_cast<long>(opt.seconds)) + " s").c_str() : "",
      opt.kill_ms ? (std::to_string(opt.kill_ms) + " ms").c_str() : "(never)",
      opt.churn_ms ? (std::to_string(opt.churn_ms) + " ms").c_str() : "(never)", opt.hang_ms);
  std::fflush(stdout);
}

void print_progress(const Directory &dir, double seconds) {
  Totals t = sum(dir);
  uint64_t ops = t.total_ops();
  std::fprintf(stderr,
               "pcientb-stress: %5.0f s  %" PRIu64 " ops (%.0f/s)  %.2f GiB  kills %" PRIu64
               "  QP re-creations %" PRIu64 "  MR re-registrations %" PRIu64
               "  CQ overruns %" PRIu64 "  | lost %" PRIu64 ", corrupted %" PRIu64 ", hung %" PRIu64
               ", unexpected %" PRIu64 "\n",
               seconds, ops, seconds > 0 ? ops / seconds : 0.0, gib(t.bytes), get(dir.kills),
               t.recreate_clean + t.recreate_abrupt + t.target_destroyed + t.target_errored,
               t.mr_reregs, t.cq_overruns, t.lost, t.corrupted, t.hung, t.unexpected());
}

int print_report(const Directory &dir, const Options &opt, double seconds) {
  Totals t = sum(dir);
  uint64_t ops = t.total_ops();
  std::printf("\n=== pcientb-stress report (%.1f s)\n", seconds);
  std::printf("processes: %d slots, %" PRIu64 " started, %" PRIu64 " SIGKILLed by chaos, %" PRIu64
              " crashed\n",
              opt.procs, get(dir.started), get(dir.kills), get(dir.crashes));
  std::printf("chaos: QP re-creations %" PRIu64 " (%" PRIu64 " drained first, %" PRIu64
              " with work outstanding); target QPs destroyed %" PRIu64 ", moved to ERR %" PRIu64
              "; MR re-registrations %" PRIu64 "; CQ overruns %" PRIu64 "\n",
              t.recreate_clean + t.recreate_abrupt, t.recreate_clean, t.recreate_abrupt,
              t.target_destroyed, t.target_errored, t.mr_reregs, t.cq_overruns);
  std::printf("RC connections: %" PRIu64 "\n", t.connections);
  std::printf("operations: %" PRIu64 " (%.0f/s), %.2f GiB moved (%.0f MiB/s), %.2f GiB verified\n",
              ops, seconds > 0 ? ops / seconds : 0.0, gib(t.bytes),
              seconds > 0 ? t.bytes / seconds / (1 << 20) : 0.0, gib(t.verified_bytes));
  std::printf("  %-10s %12s %10s\n", "opcode", "ok", "failed");
  for (int i = 0; i < kOpCount; ++i)
    std::printf("  %-10s %12" PRIu64 " %10" PRIu64 "\n", op_name(static_cast<Op>(i)), t.ops[i],
                t.op_errors[i]);
  std::printf("RC messages checked by their target: %" PRIu64
              "; acknowledged, then destroyed "
              "unpolled with their target QP (on purpose): %" PRIu64
              "; WRITE bytes whose manifest failed (not checked): %" PRIu64 "\n",
              t.messages, t.discarded, t.unverified_write_bytes);
  std::printf("UD datagrams: %" PRIu64 " sent, %" PRIu64 " received and checked, %" PRIu64
              " dropped (not an error), %" PRIu64 " out of order\n",
              t.ud_sent, t.ud_received, t.ud_sent > t.ud_received ? t.ud_sent - t.ud_received : 0,
              t.ud_reordered);
  print_expected(t);
  print_unexpected(t);
  if (t.duplicated)
    std::printf("(corrupted includes %" PRIu64 " duplicated messages)\n", t.duplicated);
  std::printf("lost %" PRIu64 ", corrupted %" PRIu64 ", hung %" PRIu64 "\n", t.lost, t.corrupted,
              t.hung);
  std::printf("unexpected %" PRIu64 "\n", t.unexpected());
  bool pass = t.lost == 0 && t.corrupted == 0 && t.hung == 0 && t.unexpected() == 0;
  std::printf("result: %s\n", pass ? "PASS" : "FAIL");
  std::fflush(stdout);
  return pass ? 0 : 1;
}

}  // namespace stress
