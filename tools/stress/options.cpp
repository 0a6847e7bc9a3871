#include "options.hpp"

#include <getopt.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <utility>

namespace stress {
namespace {

constexpr uint64_t kLargestMaxSize = 64ull << 20;  // each process keeps ~40 buffers of it

const char kManual[] = R"(NAME
    pcientb-stress - soak test of pcientb0: traffic, verification and chaos

SYNOPSIS
    pcientb-stress [--procs N] [--qps M] [--ops N] [--seconds S] [--max-size SIZE]
                   [--seed N] [--kill-ms MS] [--churn-ms MS] [--chaos LIST]
                   [--srq PERCENT] [--hang-ms MS] [--fabric NAME] [--quiet] [--verbose]

DESCRIPTION
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

OPTIONS
    -p, --procs N       worker processes, 1..64 (default 4)
    -q, --qps M         RC QPs each worker initiates, 1..32 (default 4)
    -n, --ops N         stop after N operations (k/M/G: x1000); 0 = no limit
    -t, --seconds S     stop after S seconds (default 60 when --ops is not given)
    -s, --max-size SIZE largest message, WRITE and READ, 1..64M; K/M/G suffixes
                        are binary (default 4M)
        --seed N        random seed (default: from the clock; printed)
    -k, --kill-ms MS    mean time between SIGKILLs of a worker; 0 = none (3000)
    -c, --churn-ms MS   mean time between chaos events per worker; 0 = none (500)
        --chaos LIST    which events a worker chooses from, comma-separated (all):
                        qp-clean, qp-abrupt (re-create an initiator QP after
                        draining it / with work outstanding), target-destroy,
                        target-error (destroy / move to ERR a QP others send
                        to), mr-window, mr-read (re-register the MR others
                        WRITE and do atomics on / READ), cq-overrun
        --srq PERCENT   share of the QPs a worker accepts that receive on its SRQ
                        rather than on their own receive queue (50)
        --hang-ms MS    a worker, WR or handshake silent this long is hung (20000)
    -f, --fabric NAME   emulated fabric (default $PCIENTB_FABRIC, else a private
                        one, "stress-<pid>")
        --quiet         no progress line on stderr
    -v, --verbose       also log every expected error and chaos event
    -h, --help          this manual

EXIT STATUS
    0 no loss, corruption, hang or unexpected error; 1 otherwise; 2 usage error.

EXAMPLES
    pcientb-stress --seconds 60
    pcientb-stress --ops 1000000 --procs 6 --qps 6
    pcientb-stress --procs 2 --kill-ms 0 --churn-ms 0 --max-size 64K
    pcientb-run pcientb-stress --seconds 30
)";

[[noreturn]] void usage_error(const char *fmt, const char *value) {
  std::fprintf(stderr, "pcientb-stress: ");
  std::fprintf(stderr, fmt, value);
  std::fprintf(stderr, "\nTry 'pcientb-stress --help' for more information.\n");
  std::exit(2);
}

// Plain decimal, optionally with a suffix; `unit` is 1000 or 1024.
std::optional<uint64_t> parse_with_suffix(const std::string &text, uint64_t unit) {
  if (text.empty() || text[0] < '0' || text[0] > '9') return std::nullopt;
  errno = 0;
  char *end = nullptr;
  unsigned long long value = std::strtoull(text.c_str(), &end, 10);
  if (errno != 0) return std::nullopt;
  uint64_t scale = 1;
  std::string suffix(end);
  if (suffix.size() > 1 && (suffix.back() == 'B' || suffix.back() == 'b')) suffix.pop_back();
  if (suffix == "k" || suffix == "K") {
    scale = unit;
  } else if (suffix == "m" || suffix == "M") {
    scale = unit * unit;
  } else if (suffix == "g" || suffix == "G") {
    scale = unit * unit * unit;
  } else if (!suffix.empty()) {
    return std::nullopt;
  }
  if (value > UINT64_MAX / scale) return std::nullopt;
  return value * scale;
}

long parse_int(const char *option, const char *text, long lo, long hi) {
  char *end = nullptr;
  errno = 0;
  long v = std::strtol(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || v < lo || v > hi) {
    char msg[160];
    std::snprintf(msg, sizeof msg, "%s: '%%s' is not an integer in %ld..%ld", option, lo, hi);
    usage_error(msg, text);
  }
  return v;
}

// "a,b,c" -> the OR of each name's bit in `names`; usage error on an unknown name.
uint32_t parse_list(const char *option, const char *text,
                    std::initializer_list<std::pair<const char *, uint32_t>> names) {
  uint32_t mask = 0;
  std::string list(text);
  size_t pos = 0;
  for (;;) {
    size_t comma = list.find(',', pos);
    std::string item =
        list.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    uint32_t bit = 0;
    std::string known;
    for (const auto &[name, value] : names) {
      if (item == name) bit = value;
      known += known.empty() ? name : std::string(", ") + name;
    }
    if (!bit) {
      char msg[400];
      std::snprintf(msg, sizeof msg, "%s: unknown name '%%s' (%s)", option, known.c_str());
      usage_error(msg, item.c_str());
    }
    mask |= bit;
    if (comma == std::string::npos) return mask;
    pos = comma + 1;
  }
}

uint32_t parse_inject(const char *text) {
  return parse_list("--inject", text,
                    {{"corrupt", kInjectCorrupt},
                     {"lose", kInjectLose},
                     {"read", kInjectRead},
                     {"atomic", kInjectAtomic},
                     {"hang", kInjectHang}});
}

}  // namespace

std::optional<uint64_t> parse_size(const std::string &text) {
  return parse_with_suffix(text, 1024);
}

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
  enum { kSeed = 1000, kHangMs, kQuiet, kInject, kChaos, kSrq };
  static const option kLong[] = {
      {"procs", required_argument, nullptr, 'p'},
      {"qps", required_argument, nullptr, 'q'},
      {"ops", required_argument, nullptr, 'n'},
      {"seconds", required_argument, nullptr, 't'},
      {"max-size", required_argument, nullptr, 's'},
      {"seed", required_argument, nullptr, kSeed},
      {"kill-ms", required_argument, nullptr, 'k'},
      {"churn-ms", required_argument, nullptr, 'c'},
      {"chaos", required_argument, nullptr, kChaos},
      {"srq", required_argument, nullptr, kSrq},
      {"hang-ms", required_argument, nullptr, kHangMs},
      {"fabric", required_argument, nullptr, 'f'},
      {"quiet", no_argument, nullptr, kQuiet},
      {"verbose", no_argument, nullptr, 'v'},
      {"help", no_argument, nullptr, 'h'},
      {"inject", required_argument, nullptr, kInject},  // self-test only; not in --help
      {nullptr, 0, nullptr, 0},
  };
  Options o;
  bool seed_given = false, seconds_given = false;
  opterr = 0;
  int c;
  while ((c = getopt_long(argc, argv, ":p:q:n:t:s:k:c:f:vh", kLong, nullptr)) != -1) {
    switch (c) {
      case 'p':
        o.procs = static_cast<int>(parse_int("--procs", optarg, 1, 64));
        break;
      case 'q':
        o.qps = static_cast<int>(parse_int("--qps", optarg, 1, 32));
        break;
      case 'n': {
        auto v = parse_with_suffix(optarg, 1000);
        if (!v) usage_error("--ops: '%s' is not a count (digits, optional k/M/G)", optarg);
        o.ops = *v;
        break;
      }
      case 't': {
        char *end = nullptr;
        double s = std::strtod(optarg, &end);
        if (end == optarg || *end != '\0' || !(s > 0) || s > 1e7)
          usage_error("--seconds: '%s' is not a positive number of seconds", optarg);
        o.seconds = s;
        seconds_given = true;
        break;
      }
      case 's': {
        auto v = parse_size(optarg);
        if (!v) usage_error("--max-size: '%s' is not a size (digits, optional K/M/G)", optarg);
        if (*v == 0) usage_error("--max-size: '%s' must be at least 1 byte", optarg);
        if (*v > kLargestMaxSize)
          usage_error(
              "--max-size: '%s' is more than 64M (each process keeps about 40 buffers "
              "of this size)",
              optarg);
        o.max_size = *v;
        break;
      }
      case kSeed: {
        auto v = parse_with_suffix(optarg, 1);
        if (!v) usage_error("--seed: '%s' is not a non-negative integer", optarg);
        o.seed = *v;
        seed_given = true;
        break;
      }
      case 'k':
        o.kill_ms = static_cast<int>(parse_int("--kill-ms", optarg, 0, 86400000));
        break;
      case 'c':
        o.churn_ms = static_cast<int>(parse_int("--churn-ms", optarg, 0, 86400000));
        break;
      case kChaos:
        o.chaos = std::strcmp(optarg, "all") == 0
                      ? kChaosAll
                      : parse_list("--chaos", optarg,
                                   {{"qp-clean", kChaosQpClean},
                                    {"qp-abrupt", kChaosQpAbrupt},
                                    {"target-destroy", kChaosTargetDestroy},
                                    {"target-error", kChaosTargetError},
                                    {"mr-window", kChaosMrWindow},
                                    {"mr-read", kChaosMrRead},
                                    {"cq-overrun", kChaosCqOverrun}});
        break;
      case kSrq:
        o.srq_percent = static_cast<int>(parse_int("--srq", optarg, 0, 100));
        break;
      case kHangMs:
        o.hang_ms = static_cast<int>(parse_int("--hang-ms", optarg, 500, 86400000));
        break;
      case 'f':
        if (!*optarg) usage_error("--fabric: empty name%s", "");
        o.fabric = optarg;
        break;
      case kQuiet:
        o.quiet = true;
        break;
      case 'v':
        ++o.verbose;
        break;
      case kInject:
        o.inject = parse_inject(optarg);
        break;
      case 'h':
        std::fputs(kManual, stdout);
        std::exit(0);
      case ':':
        usage_error("option '%s' needs a value", argv[optind - 1]);
      default:
        usage_error("unknown option '%s'", argv[optind - 1]);
    }
  }
  if (optind < argc) usage_error("unexpected argument '%s'", argv[optind]);
  if (!seconds_given && o.ops == 0) o.seconds = 60;
  if (!seed_given) {
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
