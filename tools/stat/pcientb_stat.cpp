// pcientb-stat: what is on the emulated fabrics of this user, and on the
// devices of pcientb.ko ("kernel:pcientbN": this host's nodes), in the manner of
// rdma-tool's `rdma resource show`: nodes, QPs, MRs, CQs, SRQs and traffic
// counters, as text or JSON, once or refreshed (--watch). It reads each node's
// published area read-only (engine/inspect.hpp); the nodes do not notice.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <ctime>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#include "engine/inspect.hpp"
#include "engine/layout.hpp"
#include "fabric/fabric.hpp"

namespace {

using pcientb::engine::Counts;
using pcientb::engine::NodeInfo;
using pcientb::engine::QpInfo;
namespace eng = pcientb::engine;

struct Options {
  std::string object = "node";
  std::vector<std::string> fabrics;
  std::optional<unsigned> lid;
  std::optional<int> pid;
  bool json = false;
  bool dead = false;
  bool per_qp = false;
  std::optional<double> watch;
  unsigned iterations = 0;
};

struct Fabric {
  std::string name;
  std::vector<NodeInfo> nodes;
};

std::vector<Fabric> collect(const Options &o, std::string *err) {
  std::vector<std::string> names = o.fabrics;
  if (names.empty()) {
    names = pcientb::fabric::backend().fabric_names();
    for (auto &k : pcientb::fabric::kernel::kernel_backend().fabric_names()) names.push_back(k);
  }
  std::vector<Fabric> out;
  for (const std::string &name : names) {
    int e = 0;
    auto view = pcientb::fabric::backend_for(name.c_str())
                    .view(name.c_str(), pcientb::engine::kAreaLayout, &e);
    if (!view) {
      // A named fabric must exist; one listed a moment ago may have gone.
      if (!o.fabrics.empty())
        *err += fmt::format("fabric {}: {}\n", name,
                            e == ENOENT   ? "no such fabric"
                            : e == EPROTO ? "its processes use another build of the provider"
                                          : strerror(e));
      continue;
    }
    Fabric f{name, {}};
    for (const auto &v : view->nodes()) {
      if (!v.alive && !o.dead) continue;
      if (o.lid && v.lid != *o.lid) continue;
      if (o.pid && v.pid != *o.pid) continue;
      f.nodes.push_back(eng::inspect_node(v));
    }
    out.push_back(std::move(f));
  }
  return out;
}

std::string guid_str(uint64_t g) {
  return fmt::format("{:04x}:{:04x}:{:04x}:{:04x}", g >> 48, (g >> 32) & 0xffff, (g >> 16) & 0xffff,
                     g & 0xffff);
}

std::string json_str(const std::string &s) {
  std::string r = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\')
      r += '\\', r += static_cast<char>(c);
    else if (c < 0x20)
      r += fmt::format("\\u{:04x}", c);
    else
      r += static_cast<char>(c);
  }
  return r + "\"";
}

// One key/value list, printed as "k v k v" (text) or {"k": v, ...} (JSON).
// Declared once per object, so that both forms list the same fields.
class Fields {
 public:
  Fields &num(const char *k, uint64_t v) { return add(k, fmt::format("{}", v), false); }
  Fields &rate(const char *k, double v) { return add(k, fmt::format("{:.1f}", v), false); }
  Fields &str(const char *k, const std::string &v) { return add(k, v, true); }
  Fields &hex(const char *k, uint64_t v) { return add(k, fmt::format("0x{:x}", v), true); }
  Fields &flag(const char *k, bool v) {
    kv_.push_back({k, v ? "yes" : "no", v ? "true" : "false"});
    return *this;
  }
  Fields &raw_json(const char *k, const std::string &json) {
    kv_.push_back({k, "", json});
    return *this;
  }
  std::string text() const {
    std::string s;
    for (const auto &f : kv_)
      if (!f.text.empty()) s += fmt::format("{}{} {}", s.empty() ? "" : " ", f.key, f.text);
    return s;
  }
  std::string json() const {
    std::string s = "{";
    for (const auto &f : kv_)
      s += fmt::format("{}{}: {}", s.size() > 1 ? ", " : "", json_str(f.key), f.json);
    return s + "}";
  }

 private:
  struct Kv {
    std::string key, text, json;
  };
  Fields &add(const char *k, const std::string &v, bool quoted) {
    kv_.push_back({k, v, quoted ? json_str(v) : v});
    return *this;
  }
  std::vector<Kv> kv_;
};

std::string node_name(const Fabric &f, const NodeInfo &n) {
  return fmt::format("{}/{}", f.name, n.lid);
}

void owner(Fields &x, const NodeInfo &n) {
  x.num("pid", static_cast<uint64_t>(n.pid)).str("comm", n.comm);
}

// Counters, and per second since `before` when there is a before.
void counters(Fields &x, const Counts &c, const Counts *before, double dt, uint64_t doorbells,
              const uint64_t *doorbells_before) {
  auto both = [&](const char *k, uint64_t now, uint64_t then) {
    x.num(k, now);
    if (before && dt > 0) x.rate(fmt::format("{}/s", k).c_str(), double(now - then) / dt);
  };
  const Counts zero;
  const Counts &b = before ? *before : zero;
  both("tx_packets", c.tx_packets(), b.tx_packets());
  both("tx_bytes", c.tx_data(), b.tx_data());
  both("rx_packets", c.rx_packets(), b.rx_packets());
  both("rx_bytes", c.rx_data(), b.rx_data());
  for (int i = 0; i < eng::kTxKinds; ++i) {
    x.num(fmt::format("{}_ops", eng::kTxNames[i]).c_str(), c.tx_ops[i]);
    x.num(fmt::format("{}_bytes", eng::kTxNames[i]).c_str(), c.tx_bytes[i]);
  }
  for (int i = 0; i < eng::kRxKinds; ++i) {
    x.num(fmt::format("{}_ops", eng::kRxNames[i]).c_str(), c.rx_ops[i]);
    x.num(fmt::format("{}_bytes", eng::kRxNames[i]).c_str(), c.rx_bytes[i]);
  }
  x.num("rnr_retries", c.rnr_retries).num("transport_retries", c.transport_retries);
  if (doorbells_before)
    both("doorbells", doorbells, *doorbells_before);
  else if (doorbells != UINT64_MAX)
    x.num("doorbells", doorbells);
  x.num("errors", c.errors()).num("flushed", c.flushed());
  // Completions by status other than success, send and receive side.
  for (int s = 1; s < eng::kWcStatuses; ++s) {
    if (c.tx_status[s]) x.num(fmt::format("tx_{}", eng::wc_status_name(s)).c_str(), c.tx_status[s]);
    if (c.rx_status[s]) x.num(fmt::format("rx_{}", eng::wc_status_name(s)).c_str(), c.rx_status[s]);
  }
}

Fields node_fields(const Fabric &f, const NodeInfo &n) {
  Fields x;
  x.str("node", node_name(f, n)).str("fabric", f.name).num("lid", n.lid);
  x.num("pid", static_cast<uint64_t>(n.pid)).str("comm", n.comm).flag("alive", n.alive);
  if (n.error) return x.str("error", strerror(n.error)), x;
  if (n.guid) x.str("guid", guid_str(n.guid));
  x.num("qps", n.qps.size())
      .num("mrs", n.mrs.size())
      .num("cqs", n.cqs.size())
      .num("srqs", n.srqs.size());
  return x;
}

Fields qp_fields(const Fabric &f, const NodeInfo &n, const QpInfo &q) {
  Fields x;
  x.str("node", node_name(f, n)).num("lqpn", q.qpn).str("type", eng::qp_type_name(q.type));
  x.str("state", eng::qp_state_name(q.state));
  if (q.dest_lid) x.num("rlid", q.dest_lid);
  if (q.dest_qpn) x.num("rqpn", q.dest_qpn);
  x.num("pd", q.pd).num("sq_used", q.sq_used).num("sq_depth", q.sq_depth);
  if (q.srq >= 0)
    x.num("srqn", n.srqs[q.srq].id);
  else
    x.num("rq_used", q.rq_used).num("rq_depth", q.rq_depth);
  x.num("pid", static_cast<uint64_t>(n.pid)).str("comm", n.comm);
  return x;
}

struct Prev {
  Counts counts;
  uint64_t doorbells = 0;
};
using PrevKey = std::tuple<std::string, uint16_t, int32_t, uint32_t>;  // fabric, lid, pid, qpn

void show(const Options &o, const std::vector<Fabric> &fabrics, std::map<PrevKey, Prev> *prev,
          double dt) {
  std::vector<Fields> rows;
  std::map<PrevKey, Prev> now;
  for (const Fabric &f : fabrics) {
    if (o.object == "fabric") {
      unsigned alive = 0;
      for (const NodeInfo &n : f.nodes) alive += n.alive;
      rows.push_back(
          Fields().str("fabric", f.name).num("nodes", f.nodes.size()).num("alive", alive));
      continue;
    }
    for (const NodeInfo &n : f.nodes) {
      if (o.object == "node") rows.push_back(node_fields(f, n));
      if (n.error) continue;
      if (o.object == "qp")
        for (const QpInfo &q : n.qps) rows.push_back(qp_fields(f, n, q));
      if (o.object == "mr")
        for (const auto &m : n.mrs) {
          Fields x;
          x.str("node", node_name(f, n)).hex("lkey", m.lkey).hex("rkey", m.rkey);
          x.hex("iova", m.addr).num("length", m.length).str("access", eng::access_names(m.access));
          x.num("pd", m.pd).num("pid", static_cast<uint64_t>(n.pid)).str("comm", n.comm);
          rows.push_back(x);
        }
      if (o.object == "cq")
        for (const auto &c : n.cqs) {
          static const char *const armed[] = {"no", "next", "solicited"};
          Fields x;
          x.str("node", node_name(f, n)).num("cqn", c.id).num("slots", c.slots).num("used", c.used);
          x.str("armed", c.armed < 3 ? armed[c.armed] : "?").flag("overflow", c.overflow);
          owner(x, n);
          rows.push_back(x);
        }
      if (o.object == "srq")
        for (const auto &s : n.srqs) {
          Fields x;
          x.str("node", node_name(f, n))
              .num("srqn", s.id)
              .num("slots", s.slots)
              .num("used", s.used);
          x.num("limit", s.limit).num("max_sge", s.max_sge);
          owner(x, n);
          rows.push_back(x);
        }
      if (o.object == "counters") {
        PrevKey key{f.name, n.lid, n.pid, 0};
        now[key] = {n.total, n.doorbells};
        auto it = prev ? prev->find(key) : prev->end();
        const Prev *p = prev && it != prev->end() ? &it->second : nullptr;
        Fields x;
        x.str("node", node_name(f, n));
        counters(x, n.total, p ? &p->counts : nullptr, dt, n.doorbells,
                 p ? &p->doorbells : nullptr);
        owner(x, n);
        rows.push_back(x);
        if (o.per_qp)
          for (const QpInfo &q : n.qps) {
            PrevKey qkey{f.name, n.lid, n.pid, q.qpn};
            now[qkey] = {q.counts, 0};
            auto qit = prev->find(qkey);
            const Prev *qp = qit != prev->end() ? &qit->second : nullptr;
            Fields y;
            y.str("node", node_name(f, n)).num("lqpn", q.qpn);
            counters(y, q.counts, qp ? &qp->counts : nullptr, dt, UINT64_MAX, nullptr);
            owner(y, n);
            rows.push_back(y);
          }
      }
    }
  }
  if (prev) *prev = std::move(now);
  if (o.json) {
    std::string s = "[";
    for (size_t i = 0; i < rows.size(); ++i) s += (i ? ",\n " : "") + rows[i].json();
    fmt::print("{}]\n", s);
  } else {
    for (const Fields &r : rows) fmt::print("{}\n", r.text());
  }
  std::fflush(stdout);
}

volatile sig_atomic_t stop = 0;

}  // namespace

int main(int argc, char **argv) {
  Options o;
  CLI::App app{
      "pcientb-stat: what is on this user's emulated pcientb fabrics, and on pcientb.ko's "
      "devices (fabrics kernel:pcientbN): nodes (LID, GUID, pid, program), their QPs, MRs, "
      "CQs and SRQs, and traffic counters, in the manner of `rdma resource show`. Reads "
      "each node's published state read-only.",
      "pcientb-stat"};
  app.add_option("object", o.object,
                 "What to list: fabric, node (default), qp, mr, cq, srq or counters")
      ->check(CLI::IsMember({"fabric", "node", "qp", "mr", "cq", "srq", "counters"}));
  app.add_option("-f,--fabric", o.fabrics, "Only this fabric (repeatable); default: all of them");
  app.add_option("-l,--lid", o.lid, "Only the node with this LID")->check(CLI::Range(1u, 65535u));
  app.add_option("-p,--pid", o.pid, "Only nodes of this process")->check(CLI::Range(1, INT32_MAX));
  app.add_flag("-j,--json", o.json, "JSON: an array with one object per line of the text form");
  app.add_flag("-q,--qp", o.per_qp, "counters: one line per QP too, after its node's");
  app.add_flag("-d,--dead", o.dead, "Also nodes whose process died without leaving the fabric");
  app.add_option("-w,--watch", o.watch,
                 "Refresh every SECONDS like top; counters then also show rates per second")
      ->expected(0, 1)
      ->default_str("1")
      ->check(CLI::Validator(
          [](std::string &v) {
            char *end = nullptr;
            const double s = strtod(v.c_str(), &end);
            return *end == 0 && s >= 0.05 && s <= 3600
                       ? std::string()
                       : "not a number of seconds in [0.05, 3600]: " + v;
          },
          "SECONDS"));
  app.add_option("-n,--iterations", o.iterations,
                 "With --watch: stop after N refreshes (0: never)");
  app.footer(
      "Nodes are named FABRIC/LID. Counters: tx_* what the node's requesters completed (SEND, "
      "RDMA WRITE, READ, atomics; bytes moved by a READ count at its requester), rx_* the "
      "receive completions it polled; errors counts completions in error (flushes apart); "
      "doorbells the completion and event notifications it rang. Exit status: 0, 1 when a "
      "named fabric does not exist, 2 on a bad command line. See pcientb-stat(1).");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError &e) {
    return app.exit(e) == 0 ? 0 : 2;  // 2: a bad command line, as documented
  }
  // --watch without a value: every second.
  if (app.count("--watch") && !o.watch) o.watch = 1.0;

  std::map<PrevKey, Prev> prev;
  std::signal(SIGINT, [](int) { stop = 1; });
  std::signal(SIGTERM, [](int) { stop = 1; });
  auto last = std::chrono::steady_clock::now();
  for (unsigned round = 1;; ++round) {
    std::string err;
    std::vector<Fabric> fabrics = collect(o, &err);
    auto t = std::chrono::steady_clock::now();
    double dt = std::chrono::duration<double>(t - last).count();
    last = t;
    if (o.watch && isatty(STDOUT_FILENO)) fmt::print("\033[H\033[2J");
    if (o.watch) {
      time_t wall = time(nullptr);
      char when[32];
      strftime(when, sizeof when, "%H:%M:%S", localtime(&wall));
      if (!o.json) fmt::print("pcientb-stat {} every {:.2f} s (round {})\n", when, *o.watch, round);
    }
    show(o, fabrics, &prev, round > 1 ? dt : 0);
    if (!err.empty()) {
      fmt::print(stderr, "pcientb-stat: {}", err);
      return 1;
    }
    if (!o.watch || stop || (o.iterations && round >= o.iterations)) break;
    std::this_thread::sleep_for(std::chrono::duration<double>(*o.watch));
    if (stop) break;
  }
  return 0;
}
