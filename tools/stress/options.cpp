#include "options.hpp"

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>

namespace stress {
namespace {

constexpr uint64_t kLargestMaxSize = 64ull << 20;  // each process keeps ~40 buffers of it

// --help: what the tool does (before the options) and how to read its result
// (after them); the options' lines are generated from their declarations.
const char kDescription[] =
    R"(pcientb-stress - soak test of pcientb0: traffic, verification and chaos

    Forks N worker processes, each a node of the emulated fabric with its own
    LID. Each worker connects M RC QPs to random workers (itself included) and
    has one UD QP. Each RC QP posts random operations: SEND, SEND with
    immediate, RDMA WRITE (followed by a SEND telling the target what to check),
    RDMA WRITE with immediate, RDMA READ, FETCH_AND_ADD and CMP_AND_SWP, of
    random sizes 0..SIZE in lists of 1..max_sge SGEs from several MRs, some
    unsignaled, some inline; targets receive on an SRQ or on the QP's own
    receive queue. UD datagrams of 24..4096 bytes go to random workers.

    Every byte reported delivered is checked: the target checks SEND payloads
    and written regions against the pattern of that message and checks that
    messages arrive exactly once and in order; the initiator checks READ
    results and the old value returned by every atomic, and the target checks
    the final value of each atomic word when a connection closes cleanly.

    Meanwhile (chaos) the controller SIGKILLs a random worker every --kill-ms
    on average and starts a replacement, and every worker, every --churn-ms on
    average, does one of: destroy and re-create one of its QPs (cleanly or with
    work outstanding), destroy or fail a QP other workers send to, deregister
    and re-register an MR others write to or read from, or overrun a CQ.

    An error completion is "expected" when the shared directory shows its
    cause (the peer was killed, the peer's QP was destroyed, the MR was
    re-registered, the CQ was overrun) and it is the status an HCA gives for
    that cause; anything else is "unexpected".

    A final report gives operations by opcode, bytes, chaos counts and errors
    by class, then the lines
        lost N, corrupted N, hung N
        unexpected N
    The exit status is 0 only if all four are 0.
)";
const char kFooter[] =
    R"(    Chaos events (--chaos): qp-clean, qp-abrupt (re-create an initiator QP after
    draining it / with work outstanding), target-destroy, target-error (destroy /
    move to ERR a QP others send to), mr-window, mr-read (re-register the MR others
    WRITE and do atomics on / READ), cq-overrun.

EXIT STATUS
    0 no loss, corruption, hang or unexpected error; 1 otherwise; 2 usage error.

EXAMPLES
    pcientb-stress --seconds 60
    pcientb-stress --ops 1000000 --procs 6 --qps 6
    pcientb-stress --procs 2 --kill-ms 0 --churn-ms 0 --max-size 64K
    pcientb-run pcientb-stress --seconds 30
)";

// "a,b,c" -> the OR of each name's bit in `names`.
CLI::Validator name_list(std::vector<std::pair<std::string, uint32_t>> names) {
  return CLI::Validator(
      [names](std::string &v) {
        uint32_t mask = 0;
        std::string known;
        for (const auto &[name, bit] : names) known += (known.empty() ? "" : ", ") + name;
        size_t pos = 0;
        for (;;) {
          size_t comma = v.find(',', pos);
          std::string item = v.substr(pos, comma == std::string::npos ? comma : comma - pos);
          uint32_t bit = 0;
          for (const auto &[name, value] : names)
            if (item == name) bit = value;
          if (!bit) return "unknown name '" + item + "' (" + known + ")";
          mask |= bit;
          if (comma == std::string::npos) break;
          pos = comma + 1;
        }
        v = std::to_string(mask);
        return std::string();
      },
      "LIST");
}

}  // namespace

std::string format_bytes(double bytes) {
  const char *units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) {
    bytes /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.1f %s", bytes, units[u]);
  return buf;
}

Options parse_options(int argc, char **argv) {
  Options o;
  CLI::App app{kDescription, "pcientb-stress"};
  app.footer(kFooter);
  app.get_formatter()->column_width(26);
  constexpr int kDay = 86400000;
  app.add_option("-p,--procs", o.procs, "Worker processes")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  app.add_option("-q,--qps", o.qps, "RC QPs each worker initiates")
      ->check(CLI::Range(1, 32))
      ->capture_default_str();
  app.add_option("-n,--ops", o.ops, "Stop after N operations (k/M/G: x1000); 0 = no limit")
      ->transform(CLI::AsSizeValue(true));  // k = 1000
  app.add_option("-t,--seconds", o.seconds, "Stop after S seconds (default 60 without --ops)")
      ->check(CLI::Validator(
          [](std::string &v) {
            char *end = nullptr;
            double s = std::strtod(v.c_str(), &end);
            return *end == 0 && s > 0 && s <= 1e7
                       ? std::string()
                       : "'" + v + "' is not a positive number of seconds";
          },
          "S"));
  app.add_option("-s,--max-size", o.max_size,
                 "Largest message, WRITE and READ, 1..64M; K/M/G (KiB...) binary (default 4M)")
      ->transform(CLI::AsSizeValue(false))  // K = 1024
      ->check(CLI::Range(uint64_t{1}, kLargestMaxSize).description("1..64M"));
  app.add_option("--seed", o.seed, "Random seed (default: from the clock; printed)");
  app.add_option("-k,--kill-ms", o.kill_ms, "Mean time between SIGKILLs of a worker; 0 = none")
      ->check(CLI::Range(0, kDay))
      ->capture_default_str();
  app.add_option("-c,--churn-ms", o.churn_ms, "Mean time between chaos events per worker; 0 = none")
      ->check(CLI::Range(0, kDay))
      ->capture_default_str();
  CLI::Validator chaos_names = name_list({{"qp-clean", kChaosQpClean},
                                          {"qp-abrupt", kChaosQpAbrupt},
                                          {"target-destroy", kChaosTargetDestroy},
                                          {"target-error", kChaosTargetError},
                                          {"mr-window", kChaosMrWindow},
                                          {"mr-read", kChaosMrRead},
                                          {"cq-overrun", kChaosCqOverrun}});
  app.add_option("--chaos", o.chaos,
                 "Events a worker chooses from, comma-separated, or all: qp-clean, qp-abrupt, "
                 "target-destroy, target-error, mr-window, mr-read, cq-overrun (see below)")
      ->transform(CLI::Validator(
          [chaos_names](std::string &v) {
            if (v != "all") return chaos_names(v);
            v = std::to_string(kChaosAll);
            return std::string();
          },
          "LIST"))
      ->default_str("all");
  app.add_option("--srq", o.srq_percent,
                 "Share (%) of accepted QPs that receive on the worker's SRQ")
      ->check(CLI::Range(0, 100))
      ->capture_default_str();
  app.add_option("--hang-ms", o.hang_ms, "A worker, WR or handshake silent this long is hung")
      ->check(CLI::Range(500, kDay))
      ->capture_default_str();
  app.add_option("-f,--fabric", o.fabric,
                 "Emulated fabric (default $PCIENTB_FABRIC, else a private one, stress-<pid>)")
      ->check(CLI::Validator(
          [](std::string &v) { return v.empty() ? "empty name" : std::string(); }, "NAME"));
  app.add_flag("--quiet", o.quiet, "No progress line on stderr");
  app.add_flag("-v,--verbose", o.verbose, "Also log every expected error and chaos event");
  // Self-test only (README "Soak test"): not in --help.
  app.add_option("--inject", o.inject)
      ->transform(name_list({{"corrupt", kInjectCorrupt},
                             {"lose", kInjectLose},
                             {"read", kInjectRead},
                             {"atomic", kInjectAtomic},
                             {"hang", kInjectHang}}))
      ->group("");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError &e) {
    std::exit(app.exit(e) == 0 ? 0 : 2);
  }
  if (!app.count("--seconds") && o.ops == 0) o.seconds = 60;
  if (!app.count("--seed")) {
    o.seed = static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count()) ^
             (static_cast<uint64_t>(getpid()) << 32);
  }
  if (o.fabric.empty()) {
    const char *env = std::getenv("PCIENTB_FABRIC");
    o.fabric = env && *env ? env : "stress-" + std::to_string(getpid());
  }
  return o;
}

}  // namespace stress
