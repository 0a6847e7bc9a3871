// Configuration from the environment and the switch rules (libsdp style), the decision log
// and the stats lines.
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <fnmatch.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>

#include "sdp.hpp"

extern char *program_invocation_short_name;

namespace sdp {
namespace {

enum class Use { kSdp, kTcp };

struct Rule {
  Use use;
  bool server, client;
  std::string program;
  int family = 0;  // 0: any address
  uint8_t addr[16]{};
  int prefix = 0;
  uint16_t port_lo = 0, port_hi = 65535;
  std::string text;
};

bool parse_addr_port(const std::string &s, Rule &r) {
  std::string addr, ports;
  if (s == "*") return true;
  if (!s.empty() && s[0] == '[') {  // [v6]/prefix:port
    auto close = s.find(']');
    if (close == std::string::npos) return false;
    addr = s.substr(1, close - 1);
    std::string rest = s.substr(close + 1);
    if (!rest.empty() && rest[0] == '/') {
      auto colon = rest.find(':');
      addr += rest.substr(0, colon);
      rest = colon == std::string::npos ? "" : rest.substr(colon);
    }
    if (!rest.empty()) {
      if (rest[0] != ':') return false;
      ports = rest.substr(1);
    }
  } else {
    auto colon = s.rfind(':');
    addr = colon == std::string::npos ? s : s.substr(0, colon);
    if (colon != std::string::npos) ports = s.substr(colon + 1);
  }
  if (!addr.empty() && addr != "*") {
    auto slash = addr.find('/');
    std::string host = addr.substr(0, slash);
    if (inet_pton(AF_INET, host.c_str(), r.addr) == 1) {
      r.family = AF_INET;
      r.prefix = 32;
    } else if (inet_pton(AF_INET6, host.c_str(), r.addr) == 1) {
      r.family = AF_INET6;
      r.prefix = 128;
    } else {
      return false;
    }
    if (slash != std::string::npos) r.prefix = atoi(addr.c_str() + slash + 1);
  }
  if (!ports.empty() && ports != "*") {
    auto dash = ports.find('-');
    r.port_lo = static_cast<uint16_t>(atoi(ports.c_str()));
    r.port_hi = dash == std::string::npos ? r.port_lo
                                          : static_cast<uint16_t>(atoi(ports.c_str() + dash + 1));
  }
  return true;
}

// "use sdp|tcp|both server|client|both <program glob> <addr>[/prefix]:<port>[-port]"
bool parse_rule(const std::string &line, Rule &r) {
  std::istringstream in(line);
  std::string kw, use, side, prog, where;
  if (!(in >> kw >> use >> side >> prog)) return false;
  if (!(in >> where)) where = "*";
  if (kw != "use") return false;
  if (use == "sdp" || use == "both")
    r.use = Use::kSdp;
  else if (use == "tcp")
    r.use = Use::kTcp;
  else
    return false;
  r.server = side == "server" || side == "both";
  r.client = side == "client" || side == "both";
  if (!r.server && !r.client) return false;
  r.program = prog;
  r.text = line;
  return parse_addr_port(where, r);
}

void add_rules(std::vector<Rule> &rules, std::istream &in, const std::string &origin) {
  std::string line;
  int n = 0;
  while (std::getline(in, line, origin == "PCIENTB_SDP_RULES" ? ';' : '\n')) {
    ++n;
    auto hash = line.find('#');
    if (hash != std::string::npos) line.resize(hash);
    auto first = line.find_first_not_of(" \t\r\n");
    if (first == std::string::npos) continue;
    line = line.substr(first, line.find_last_not_of(" \t\r\n") - first + 1);
    Rule r;
    if (parse_rule(line, r)) {
      rules.push_back(r);
    } else {
      fprintf(stderr,
              "pcientb-sdp: %s:%d: ignoring rule '%s' (expected: use sdp|tcp|both "
              "server|client|both <program> <addr>[/prefix]:<port>[-port])\n",
              origin.c_str(), n, line.c_str());
    }
  }
}

void write_totals();  // below

// The provider's fabric: the discovery names must meet the peers the provider reaches.
// Without the provider no socket is offered to SDP (link_device_usable), and the name is moot.
std::string provider_fabric() {
  auto name = reinterpret_cast<const char *(*)()>(provider_symbol("pcientb_fabric_name"));
  return name ? name() : "default";
}

struct State {
  Config cfg;
  std::vector<Rule> rules;
  State() {
    const char *e;
    if ((e = getenv("PCIENTB_SDP")) && (!strcmp(e, "off") || !strcmp(e, "0"))) cfg.enabled = false;
    if ((e = getenv("PCIENTB_SDP_LOG")) && *e && strcmp(e, "0") != 0) cfg.log = true;
    if ((e = getenv("PCIENTB_SDP_ZCOPY_THRESH")) && *e) {
      char *end;
      long v = strtol(e, &end, 0);
      if (!strcmp(e, "auto"))
        cfg.zcopy_thresh = SDP_ZCOPY_AUTO;
      else if (*end == 0 && v >= 0 && v <= INT_MAX)
        cfg.zcopy_thresh = int(v);
      else
        fprintf(stderr, "pcientb-sdp: PCIENTB_SDP_ZCOPY_THRESH=%s ignored (bytes, 0 or auto)\n", e);
    }
    if ((e = getenv("PCIENTB_SDP_SPIN_US")) && *e) cfg.spin_us = atoi(e);
    if ((e = getenv("PCIENTB_SDP_RING")) && *e) {
      long v = strtol(e, nullptr, 0);
      if (v >= 65536 && v <= (1L << 30) && (v & (v - 1)) == 0)
        cfg.ring_bytes = uint32_t(v);
      else
        fprintf(stderr,
                "pcientb-sdp: PCIENTB_SDP_RING=%s ignored (a power of two, 64 KiB..1 GiB)\n", e);
    }
    cfg.fabric = provider_fabric();
    cfg.fabric_tag = cfg.fabric;
    if (cfg.fabric_tag.size() > 48) {
      uint64_t h = 14695981039346656037ull;  // FNV-1a
      for (unsigned char c : cfg.fabric) h = (h ^ c) * 1099511628211ull;
      char tag[24];
      snprintf(tag, sizeof tag, "#%016llx", static_cast<unsigned long long>(h));
      cfg.fabric_tag = tag;
    }
    if ((e = getenv("PCIENTB_SDP_STATS"))) cfg.stats_path = e;
    // Before any connection: runs after the exit handler that closes those still open.
    if (!cfg.stats_path.empty()) atexit(write_totals);
    std::string path = (e = getenv("PCIENTB_SDP_CONFIG")) ? e : "/etc/pcientb/sdp.conf";
    std::ifstream f(path);
    if (f)
      add_rules(rules, f, path);
    else if (getenv("PCIENTB_SDP_CONFIG"))
      fprintf(stderr, "pcientb-sdp: PCIENTB_SDP_CONFIG=%s: %s\n", path.c_str(), strerror(errno));
    if ((e = getenv("PCIENTB_SDP_RULES"))) {
      std::istringstream in(e);
      add_rules(rules, in, "PCIENTB_SDP_RULES");
    }
  }
};

State &state() {
  static State *s = new State();  // never destroyed: used from destructors at exit
  return *s;
}

bool addr_matches(const Rule &r, const sockaddr *sa) {
  if (r.family == 0) return true;
  const uint8_t *a = nullptr;
  uint8_t mapped[4];
  int family = sa->sa_family;
  if (family == AF_INET) {
    a = reinterpret_cast<const uint8_t *>(&reinterpret_cast<const sockaddr_in *>(sa)->sin_addr);
  } else {
    auto *in6 = &reinterpret_cast<const sockaddr_in6 *>(sa)->sin6_addr;
    if (r.family == AF_INET && IN6_IS_ADDR_V4MAPPED(in6)) {
      memcpy(mapped, in6->s6_addr + 12, 4);
      a = mapped;
      family = AF_INET;
    } else {
      a = in6->s6_addr;
    }
  }
  if (family != r.family) return false;
  int bits = r.prefix;
  for (int i = 0; bits > 0; ++i, bits -= 8) {
    uint8_t mask = bits >= 8 ? 0xff : uint8_t(0xff << (8 - bits));
    if ((a[i] & mask) != (r.addr[i] & mask)) return false;
  }
  return true;
}

}  // namespace

const Config &config() {
  return state().cfg;
}

bool rules_allow(Role role, const sockaddr *addr, socklen_t, const char **reason) {
  if (!config().enabled) {
    *reason = "disabled";
    return false;
  }
  uint16_t port =
      ntohs(addr->sa_family == AF_INET ? reinterpret_cast<const sockaddr_in *>(addr)->sin_port
                                       : reinterpret_cast<const sockaddr_in6 *>(addr)->sin6_port);
  for (const Rule &r : state().rules) {
    if (role == Role::kServer ? !r.server : !r.client) continue;
    if (fnmatch(r.program.c_str(), program_invocation_short_name, 0) != 0) continue;
    if (port < r.port_lo || port > r.port_hi) continue;
    if (!addr_matches(r, addr)) continue;
    if (r.use == Use::kTcp) {
      *reason = "rule";
      logf("rule '%s' keeps port %u on TCP", r.text.c_str(), port);
      return false;
    }
    return true;
  }
  return true;
}

void logf(const char *fmt, ...) {
  if (!config().log) return;
  char buf[512];
  int n =
      snprintf(buf, sizeof buf, "pcientb-sdp: [%d %s] ", getpid(), program_invocation_short_name);
  va_list ap;
  va_start(ap, fmt);
  n += vsnprintf(buf + n, sizeof buf - n - 1, fmt, ap);
  va_end(ap);
  if (n > int(sizeof buf) - 2) n = sizeof buf - 2;
  buf[n++] = '\n';
  syscall(SYS_write, 2, buf, n);
}

void die_internal(const char *what) {
  fprintf(stderr, "pcientb-sdp: internal error: %s\n", what);
  abort();
}

namespace {

// Appends a line to the stats file ("stderr": standard error).
void stats_line(const char *line, int n) {
  const std::string &path = config().stats_path;
  if (path == "stderr") {
    syscall(SYS_write, 2, line, n);
    return;
  }
  int fd = static_cast<int>(
      syscall(SYS_openat, AT_FDCWD, path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644));
  if (fd < 0) return;
  syscall(SYS_write, fd, line, n);
  syscall(SYS_close, fd);
}

// This process's connections, summed as their lines are written. A forked child starts
// from zero, at its first use of them (its fork handler must not touch the heap), and an
// image that execs hands on zero (stats_end_image).
struct Totals {
  explicit Totals(uint32_t g) : gen(g) {}
  const uint32_t gen;  // g_fork_gen of the process they count
  std::mutex mu;
  uint64_t conns = 0, sdp = 0;
  uint64_t bytes[4] = {};
  std::map<std::string, uint64_t> tcp_reasons;
};
// Never destroyed (written at exit); those replaced stay reachable through `old` (another
// thread of the parent may have been writing them at fork()).
std::atomic<Totals *> g_totals{new Totals(0)};
struct OldTotals {
  Totals *t;
  OldTotals *next;
};
std::atomic<OldTotals *> old{nullptr};

void replace_totals(Totals *t) {
  Totals *n = new Totals(g_fork_gen.load(std::memory_order_relaxed));
  if (g_totals.compare_exchange_strong(t, n))
    old.store(new OldTotals{t, old.load()});
  else
    delete n;  // another thread replaced them
}

Totals &totals() {
  Totals *t = g_totals.load(std::memory_order_acquire);
  if (t->gen == g_fork_gen.load(std::memory_order_relaxed)) return *t;
  replace_totals(t);
  return *g_totals.load(std::memory_order_acquire);
}

// One line per process at exit, after the connections' own (the layer closes those still
// open from an exit handler registered later, so run earlier).
void write_totals() {
  Totals &t = totals();
  std::lock_guard<std::mutex> lk(t.mu);
  std::string reasons;
  for (const auto &[why, n] : t.tcp_reasons)
    reasons += (reasons.empty() ? "" : ",") + why + ":" + std::to_string(n);
  char line[768];
  int n = snprintf(line, sizeof line,
                   "total pid=%d prog=%s conns=%llu sdp=%llu tcp=%llu bcopy_tx=%llu "
                   "bcopy_rx=%llu zcopy_tx=%llu zcopy_rx=%llu tcp_reasons=%s\n",
                   getpid(), program_invocation_short_name, (unsigned long long)t.conns,
                   (unsigned long long)t.sdp, (unsigned long long)(t.conns - t.sdp),
                   (unsigned long long)t.bytes[0], (unsigned long long)t.bytes[1],
                   (unsigned long long)t.bytes[2], (unsigned long long)t.bytes[3],
                   reasons.empty() ? "-" : reasons.c_str());
  if (n >= int(sizeof line)) n = sizeof line - 1;
  stats_line(line, n);
}

}  // namespace

void stats_end_image() {
  Totals &t = totals();
  bool any;
  {
    std::lock_guard<std::mutex> lk(t.mu);
    any = t.conns != 0;
  }
  // An image without connections (a launcher's shell) says nothing (and loads no config).
  if (!any || config().stats_path.empty()) return;
  write_totals();
  replace_totals(&t);
}

void write_stats(Sock &s) {
  if (s.stats_written) return;
  s.stats_written = true;
  if (config().stats_path.empty()) return;
  const bool sdp = s.stats.path == PCIENTB_SDP_PATH_SDP;
  const char *reason = *s.reason ? s.reason : "-";
  {
    Totals &t = totals();
    std::lock_guard<std::mutex> lk(t.mu);
    ++t.conns;
    if (sdp)
      ++t.sdp;
    else
      ++t.tcp_reasons[reason];
    t.bytes[0] += s.stats.bcopy_tx;
    t.bytes[1] += s.stats.bcopy_rx;
    t.bytes[2] += s.stats.zcopy_tx;
    t.bytes[3] += s.stats.zcopy_rx;
  }
  char line[512];
  int n = snprintf(line, sizeof line,
                   "conn pid=%d prog=%s role=%s path=%s reason=%s bcopy_tx=%llu bcopy_rx=%llu "
                   "zcopy_tx=%llu zcopy_rx=%llu wzcopy_tx=%llu wzcopy_rx=%llu sink_avails=%llu "
                   "held_sends=%llu\n",
                   getpid(), program_invocation_short_name,
                   s.role == Role::kServer ? "server" : "client", sdp ? "sdp" : "tcp", reason,
                   (unsigned long long)s.stats.bcopy_tx, (unsigned long long)s.stats.bcopy_rx,
                   (unsigned long long)s.stats.zcopy_tx, (unsigned long long)s.stats.zcopy_rx,
                   (unsigned long long)s.stats.wzcopy_tx, (unsigned long long)s.stats.wzcopy_rx,
                   (unsigned long long)s.stats.sink_avails, (unsigned long long)s.stats.held_sends);
  if (n >= int(sizeof line)) n = sizeof line - 1;
  stats_line(line, n);
}

}  // namespace sdp
