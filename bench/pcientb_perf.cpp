// pcientb-perf: the main measurement. Runs a two-node emulated fabric (this process and one
// forked peer, each a node on pcientb0) and measures RDMA WRITE, READ and SEND bandwidth and
// latency over the message sizes of the PCIe socket paper's Table 3 (1 B .. 4 MiB), beside the
// memcpy and shared-memory ping-pong references measured in the same run. Prints a table on
// stdout, progress on stderr, and writes the table as CSV (bench/plot.py draws it).
//
// Each row carries its own references, measured right beside its RDMA figures: memcpy of the
// row's size just before its bandwidth points, and the ping-pong just before and just after its
// latency points (the faster of the two counts). On a VM the cost of a cache-line round trip
// between the two vCPUs moves when the host moves them, so a reference taken minutes apart
// would not be a reference.

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "rdma_pair.hpp"
#include "references.hpp"

namespace {

using pcientb::bench::Buffer;
using pcientb::bench::now_s;
using pcientb::bench::Op;
using pcientb::bench::op_name;
using pcientb::bench::PairOptions;
using pcientb::bench::RdmaPair;
using pcientb::bench::ShmPingPong;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr Op kOps[] = {Op::write, Op::read, Op::send};

struct Options {
  std::string csv = "pcientb-perf.csv";
  size_t max_size = size_t{4} << 20;
  double seconds = 0.8;                // budget of a bandwidth point; latency points get half
  uint64_t bytes = uint64_t{1} << 30;  // a bandwidth point stops early after moving this much
  uint64_t max_rounds = 1000000;       // a latency point stops early after this many rounds
  uint64_t pingpong_rounds = 20000;
  bool work = false;
  std::string device = "pcientb0", peer_device;  // peer_device empty: device
};

// One table row. Bandwidth in bytes/s; latency in seconds, one-way for WRITE and SEND (half a
// ping-pong round trip, as ib_write_lat and ib_send_lat report), whole operation for READ.
struct Row {
  size_t size = 0;
  double bw[3] = {kNaN, kNaN, kNaN};
  double memcpy_bw = kNaN;
  double lat[3] = {kNaN, kNaN, kNaN};
  double pingpong = kNaN;  // half round trip
};

std::string size_str(size_t n) {
  char b[32];
  if (n >= (size_t{1} << 20) && n % (size_t{1} << 20) == 0)
    snprintf(b, sizeof b, "%zu MiB", n >> 20);
  else if (n >= 1024 && n % 1024 == 0)
    snprintf(b, sizeof b, "%zu KiB", n >> 10);
  else
    snprintf(b, sizeof b, "%zu B", n);
  return b;
}

double median(std::vector<double> v) {
  if (v.empty()) return kNaN;
  std::nth_element(v.begin(), v.begin() + static_cast<long>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

// Runs chunk(count) -> seconds (< 0 on error) until the time or byte budget is spent, after one
// untimed warm-up chunk. Returns bytes/s, NaN on error.
template <class Chunk>
double measure_bandwidth(const Options &o, size_t size, uint64_t max_chunk, Chunk chunk) {
  const uint64_t count = std::clamp<uint64_t>((size_t{32} << 20) / size, 1, max_chunk);
  if (chunk(std::min<uint64_t>(count, 64)) < 0) return kNaN;
  double t = 0;
  uint64_t bytes = 0;
  while (t < o.seconds && bytes < o.bytes) {
    const double s = chunk(count);
    if (s < 0) return kNaN;
    t += s;
    bytes += count * size;
  }
  return static_cast<double>(bytes) / t;
}

// Median seconds of one round (see RdmaPair::lat_begin) over sessions that fill the budget,
// after an untimed warm-up session. Rounds are timed in batches of up to 100 (about 20 us), so
// the clock's cost and granularity stay out of short rounds; the median is over batches.
double measure_latency(const Options &o, RdmaPair &pair, Op op, size_t size) {
  constexpr uint64_t kWarmup = 100;
  if (!pair.lat_begin(op, size, kWarmup)) return kNaN;
  const double warm = pair.rounds(kWarmup);
  if (warm < 0 || !pair.lat_end()) return kNaN;
  const auto batch = static_cast<uint64_t>(std::clamp(20e-6 / (warm / kWarmup), 1.0, 100.0));
  const double budget = o.seconds / 2;
  std::vector<double> samples;
  double spent = 0;
  while (spent < budget && samples.size() * batch < o.max_rounds) {
    const auto batches =
        static_cast<uint64_t>(std::clamp((budget - spent) / (warm / kWarmup * batch), 1.0, 1000.0));
    if (!pair.lat_begin(op, size, batches * batch)) return kNaN;
    for (uint64_t i = 0; i < batches; i++) {
      const double t = pair.rounds(batch);
      if (t < 0) return kNaN;
      samples.push_back(t / static_cast<double>(batch));
      spent += t;
    }
    if (!pair.lat_end()) return kNaN;
  }
  return median(std::move(samples));
}

// Median half round trip of the ping-pong, timed in batches of 100 like the latency points; the
// child sleeps again afterwards. NaN on error.
double measure_pingpong(const Options &o, ShmPingPong &pp) {
  std::vector<double> samples;
  const bool ok = pp.half_rtt(std::max<uint64_t>(o.pingpong_rounds / 100, 1), 100, &samples) >= 0;
  pp.sleep();
  return ok ? median(std::move(samples)) / 2 : kNaN;
}

// The peer of every RDMA measurement; restarted after a failure so one bad point does not
// spoil the rest of the table.
class Peer {
 public:
  explicit Peer(const Options &o) {
    opt_.max_size = o.max_size;
    opt_.device = o.device.c_str();
    if (!o.peer_device.empty()) opt_.peer_device = o.peer_device.c_str();
  }

  RdmaPair *get(std::string *err) {
    if (pair_ && pair_->error().empty()) return pair_.get();
    pair_.reset();
    pair_ = RdmaPair::start(opt_, err);
    if (pair_ && !pair_->verify()) {
      *err = "data check failed: " + pair_->error();
      pair_.reset();
    }
    return pair_.get();
  }

 private:
  PairOptions opt_;
  std::unique_ptr<RdmaPair> pair_;
};

// The 1-minute load average and the number of CPUs: both sides of every measurement spin, so
// other work on the machine shows up as inflated latencies.
std::string machine_load() {
  double load = -1;
  if (FILE *f = fopen("/proc/loadavg", "r")) {
    if (fscanf(f, "%lf", &load) != 1) load = -1;
    fclose(f);
  }
  char b[96];
  snprintf(b, sizeof b, "load average %.2f on %ld CPUs", load, sysconf(_SC_NPROCESSORS_ONLN));
  return b;
}

// The table's columns after the size, declared once for the table and the CSV.
struct Column {
  const char *head;  // in the table
  const char *csv;   // in the CSV header
  int width, prec, csv_prec;
  double (*get)(const Row &);
};
constexpr Column kColumns[] = {
    {"WRITE MB/s", "write_MBps", 11, 1, 3, [](const Row &r) { return r.bw[0] / 1e6; }},
    {"READ MB/s", "read_MBps", 11, 1, 3, [](const Row &r) { return r.bw[1] / 1e6; }},
    {"SEND MB/s", "send_MBps", 11, 1, 3, [](const Row &r) { return r.bw[2] / 1e6; }},
    {"memcpy MB/s", "memcpy_MBps", 11, 1, 3, [](const Row &r) { return r.memcpy_bw / 1e6; }},
    {"WRITE x", "write_x_memcpy", 7, 3, 4, [](const Row &r) { return r.bw[0] / r.memcpy_bw; }},
    {"READ x", "read_x_memcpy", 7, 3, 4, [](const Row &r) { return r.bw[1] / r.memcpy_bw; }},
    {"SEND x", "send_x_memcpy", 7, 3, 4, [](const Row &r) { return r.bw[2] / r.memcpy_bw; }},
    {"WRITE us", "write_lat_us", 9, 3, 4, [](const Row &r) { return r.lat[0] * 1e6; }},
    {"READ us", "read_lat_us", 9, 3, 4, [](const Row &r) { return r.lat[1] * 1e6; }},
    {"SEND us", "send_lat_us", 9, 3, 4, [](const Row &r) { return r.lat[2] * 1e6; }},
    {"pp us", "pingpong_half_rtt_us", 7, 3, 4, [](const Row &r) { return r.pingpong * 1e6; }},
    {"WRITE/pp", "write_lat_x_pingpong", 8, 2, 3,
     [](const Row &r) { return r.lat[0] / r.pingpong; }},
    {"SEND/pp", "send_lat_x_pingpong", 8, 2, 3, [](const Row &r) { return r.lat[2] / r.pingpong; }},
};

void print_table(FILE *f, const std::vector<Row> &rows, const std::string &load_start,
                 const std::string &load_end) {
  std::vector<double> pp;
  for (const Row &r : rows) pp.push_back(r.pingpong);
  const auto [lo, hi] = std::minmax_element(pp.begin(), pp.end());
  fmt::print(f,
             "pcientb-perf: RDMA over the emulated NTB fabric (pcientb0) between two processes\n");
  fmt::print(f, "machine: {} before, {} after\n", load_start, load_end);
  fmt::print(
      f, "shared-memory ping-pong half round trip, measured beside each row: {:.3f} .. {:.3f} us\n",
      *lo * 1e6, *hi * 1e6);
  fmt::print(f, "bandwidth in MB/s (10^6 B/s); x = ratio to memcpy of the same size (the row's)\n");
  fmt::print(
      f, "latency in us: WRITE and SEND one-way (half a ping-pong round trip, as ib_write_lat\n");
  fmt::print(f,
             "and ib_send_lat), READ the whole operation; /pp = ratio to the row's ping-pong\n\n");
  fmt::print(f, "{:>9}", "size");
  for (const Column &c : kColumns) fmt::print(f, " {:>{}}", c.head, c.width);
  fmt::print(f, "\n");
  for (const Row &r : rows) {
    fmt::print(f, "{:>9}", size_str(r.size));
    for (const Column &c : kColumns) fmt::print(f, " {:>{}.{}f}", c.get(r), c.width, c.prec);
    fmt::print(f, "\n");
  }
}

bool write_csv(const std::string &path, const std::vector<Row> &rows) {
  FILE *f = fopen(path.c_str(), "w");
  if (!f) return false;
  fmt::print(f, "size_bytes");
  for (const Column &c : kColumns) fmt::print(f, ",{}", c.csv);
  fmt::print(f, "\n");
  for (const Row &r : rows) {
    fmt::print(f, "{}", r.size);
    for (const Column &c : kColumns) fmt::print(f, ",{:.{}f}", c.get(r), c.csv_prec);
    fmt::print(f, "\n");
  }
  return fclose(f) == 0;
}

// The targets the provider aims for, as ratios against this run's references.
void print_targets(const std::vector<Row> &rows) {
  const Row &big = rows.back();
  const Row *small = nullptr;
  for (const Row &r : rows)
    if (r.size == 8) small = &r;
  const std::string bs = size_str(big.size);
  auto line = [](const std::string &what, double r, double target, bool at_least) {
    const bool met = at_least ? r >= target : r <= target;
    printf("  %-52s %7.2fx   target %s %.1fx   %s\n", what.c_str(), r,
           at_least ? ">=" : "<=", target, met ? "met" : "MISSED");
  };
  printf("\ntargets (ratios against the references of this run):\n");
  line("RDMA WRITE " + bs + " bandwidth / memcpy " + bs, big.bw[0] / big.memcpy_bw, 0.9, true);
  line("RDMA READ " + bs + " bandwidth / memcpy " + bs, big.bw[1] / big.memcpy_bw, 0.9, true);
  if (small) {
    line("SEND 8 B one-way latency / ping-pong half RTT", small->lat[2] / small->pingpong, 3,
         false);
    line("RDMA WRITE 8 B one-way latency / ping-pong half RTT", small->lat[0] / small->pingpong, 6,
         false);
  }
}

// The command line; exits with status 0 after --help, 2 after a bad value.
Options parse(int argc, char **argv) {
  Options o;
  bool quick = false;
  CLI::App app{
      "Measures RDMA WRITE, READ and SEND bandwidth and latency between two processes on the "
      "emulated fabric (pcientb0) from 1 B up to --max-size, beside memcpy and a shared-memory "
      "ping-pong measured in the same run. Table on stdout, progress on stderr.",
      "pcientb-perf"};
  app.add_option("--csv", o.csv, "Write the table as CSV to FILE")
      ->option_text("FILE")
      ->capture_default_str();
  app.add_option("--max-size", o.max_size,
                 "Largest message, a power of 2: bytes, or with a suffix K, M, G (KiB, MiB, GiB; "
                 "powers of 1024)")
      ->option_text("SIZE")
      ->transform(CLI::AsSizeValue(false))
      ->check(CLI::Validator(
          [](std::string &v) {
            const unsigned long long n = std::stoull(v);
            return n && !(n & (n - 1)) ? std::string() : "not a power of 2: " + v;
          },
          "POWER OF 2"))
      ->default_str("4M");
  app.add_option("--seconds", o.seconds,
                 "Time budget of a bandwidth point; latency points get half (the whole run takes "
                 "about 60 x S seconds)")
      ->option_text("S")
      ->check(CLI::Validator(
          [](std::string &v) {
            char *end = nullptr;
            const double s = strtod(v.c_str(), &end);
            return *end == 0 && s > 0 && std::isfinite(s)
                       ? std::string()
                       : "not a positive number of seconds: " + v;
          },
          "SECONDS > 0"))
      ->capture_default_str();
  app.add_flag("--quick", quick, "Sizes up to 64 KiB and a tiny budget (smoke test)");
  app.add_flag("--work", o.work,
               "Instead of the table: the fabric work (posts, doorbells, DMA) per operation of "
               "the initiating process, for 8 B, 4 KiB and --max-size");
  app.add_option("--device", o.device, "The device of the measuring process")
      ->capture_default_str();
  app.add_option("--peer-device", o.peer_device,
                 "The device of its peer (default: the same; pcientb.ko's two ports: across "
                 "the bridge)");
  app.footer("PCIENTB_FABRIC names the fabric; unset, a name private to this run is used.");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError &e) {
    exit(app.exit(e) == 0 ? 0 : 2);
  }
  if (quick) {
    if (!app.count("--max-size")) o.max_size = 64 * 1024;
    if (!app.count("--seconds")) o.seconds = 0.01;
    o.bytes = 16 << 20;
    o.max_rounds = 1000;
    o.pingpong_rounds = 1000;
  }
  return o;
}

// --work: what the initiator did through the fabric per operation (pcientb_query_work), over a
// stream of operations of each kind and size.
int print_work(const Options &o, Peer &peer) {
  const char *names[8] = {"posts",    "post B", "doorbells", "DMA wr",
                          "DMA wr B", "DMA rd", "DMA rd B",  "rem reads"};
  printf("%-6s %8s", "op", "size");
  for (const char *n : names) printf(" %10s", n);
  printf("   (per operation, initiator side)\n");
  std::string err;
  for (size_t size : {size_t{8}, size_t{4096}, o.max_size}) {
    for (Op op : kOps) {
      RdmaPair *pair = peer.get(&err);
      const uint64_t n = size >= (size_t{1} << 20) ? 16 : 1000;
      uint64_t before[8], after[8];
      if (!pair || !pair->work(before) || pair->bandwidth(op, size, n) < 0 || !pair->work(after)) {
        fprintf(stderr, "pcientb-perf: %s %zu B: %s\n", op_name(op), size,
                pair ? pair->error().c_str() : err.c_str());
        return 1;
      }
      printf("%-6s %8s", op_name(op), size_str(size).c_str());
      for (int k = 0; k < 8; ++k) printf(" %10.2f", double(after[k] - before[k]) / double(n));
      printf("\n");
    }
  }
  // What the initiator's counts leave out (docs/transport.md).
  printf(
      "A SEND is a record posted to the target's lane, its bytes inside up to 976 B; larger\n"
      "ones the target pulls (DMA reads at the target), and its answers are the target's posts:\n"
      "neither is in these counts. rem reads: loads of a peer's doorbell mask (0 when strict).\n");
  return 0;
}

// Measures one row: memcpy and the three bandwidths, then the ping-pong, the three latencies and
// the ping-pong again. Failed points are NaN and counted in *failures.
Row measure_row(const Options &o, size_t size, Peer &peer, ShmPingPong &pp, const Buffer &src,
                const Buffer &dst, int *failures) {
  Row r;
  r.size = size;
  std::string err;
  auto report = [&](const char *what, Op op, RdmaPair *pair) {
    fprintf(stderr, "  %s %s at %s failed: %s\n", op_name(op), what, size_str(size).c_str(),
            pair ? pair->error().c_str() : err.c_str());
    ++*failures;
  };
  r.memcpy_bw = measure_bandwidth(
      o, size, 1 << 20, [&](uint64_t n) { return pcientb::bench::time_memcpy(dst, src, size, n); });
  for (int k = 0; k < 3; k++) {
    RdmaPair *pair = peer.get(&err);
    if (pair)
      r.bw[k] = measure_bandwidth(o, size, 65536,
                                  [&](uint64_t n) { return pair->bandwidth(kOps[k], size, n); });
    if (std::isnan(r.bw[k])) report("bandwidth", kOps[k], pair);
  }
  const double pp_before = measure_pingpong(o, pp);
  for (int k = 0; k < 3; k++) {
    RdmaPair *pair = peer.get(&err);
    if (pair) r.lat[k] = measure_latency(o, *pair, kOps[k], size) * (kOps[k] == Op::read ? 1 : 0.5);
    if (std::isnan(r.lat[k])) report("latency", kOps[k], pair);
  }
  const double pp_after = measure_pingpong(o, pp);
  // The faster of the two: the stricter ratio.
  r.pingpong = std::fmin(pp_before, pp_after);
  if (std::isnan(r.pingpong)) {
    fprintf(stderr, "  ping-pong reference at %s failed\n", size_str(size).c_str());
    ++*failures;
  } else if (std::fmax(pp_before, pp_after) > 1.5 * r.pingpong) {
    fprintf(stderr,
            "  note: the ping-pong reference moved during this row: %.3f us, then %.3f us\n",
            pp_before * 1e6, pp_after * 1e6);
  }
  return r;
}

}  // namespace

int main(int argc, char **argv) {
  const Options o = parse(argc, argv);
  pcientb::bench::use_private_fabric("pcientb-perf");
  const double start = now_s();
  const std::string load_start = machine_load();
  fprintf(stderr, "pcientb-perf: fabric %s, sizes 1 B .. %s, %s\n", getenv("PCIENTB_FABRIC"),
          size_str(o.max_size).c_str(), load_start.c_str());

  // The ping-pong child first: nothing is forked once this process has opened the device.
  std::string err;
  std::unique_ptr<ShmPingPong> pp = ShmPingPong::start(&err);
  if (!pp) {
    fprintf(stderr, "pcientb-perf: cannot start the ping-pong reference: %s\n", err.c_str());
    return 1;
  }
  fprintf(stderr, "starting the peer node and checking the data path ...\n");
  Peer peer(o);
  if (!peer.get(&err)) {
    fprintf(stderr, "pcientb-perf: cannot set up RDMA between two processes: %s\n", err.c_str());
    return 1;
  }

  if (o.work) return print_work(o, peer);

  Buffer src(o.max_size), dst(o.max_size);
  std::vector<size_t> sizes;
  for (size_t s = 1; s <= o.max_size; s *= 2) sizes.push_back(s);
  std::vector<Row> rows;
  int failures = 0;
  for (size_t i = 0; i < sizes.size(); i++) {
    const double t0 = now_s();
    const Row r = measure_row(o, sizes[i], peer, *pp, src, dst, &failures);
    fprintf(stderr, "[%2zu/%zu] %7s  MB/s: WRITE %8.1f READ %8.1f SEND %8.1f memcpy %8.1f", i + 1,
            sizes.size(), size_str(r.size).c_str(), r.bw[0] / 1e6, r.bw[1] / 1e6, r.bw[2] / 1e6,
            r.memcpy_bw / 1e6);
    fprintf(stderr, " | us: WRITE %.2f READ %.2f SEND %.2f pp %.3f  (%.1f s)\n", r.lat[0] * 1e6,
            r.lat[1] * 1e6, r.lat[2] * 1e6, r.pingpong * 1e6, now_s() - t0);
    rows.push_back(r);
  }

  print_table(stdout, rows, load_start, machine_load());
  print_targets(rows);
  if (!write_csv(o.csv, rows)) {
    fprintf(stderr, "pcientb-perf: cannot write %s: %s\n", o.csv.c_str(), strerror(errno));
    return 1;
  }
  // On stdout, after the table: a pipe (main-job's tee) keeps it in order.
  printf("pcientb-perf: wrote %s (%.0f s)\n", o.csv.c_str(), now_s() - start);
  if (failures)
    fprintf(stderr, "pcientb-perf: %d measurement(s) failed (NaN in the table)\n", failures);
  return failures ? 1 : 0;
}
