// pcientb-perf: the main measurement. Runs a two-node emulated fabric (this process and one
// forked peer, each a node on pcientb0) and measures RDMA WRITE, READ and SEND bandwidth and
// latency over the message sizes of the PCIe socket paper's Table 3 (1 B .. 4 MiB), beside the
// memcpy and shared-memory ping-pong references measured in the same run. Prints a table on
// stdout, progress on stderr, and writes the table as CSV (bench/plot.py draws it).

#include <getopt.h>
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
  double seconds = 0.35;               // budget per bandwidth point; latency points get half
  uint64_t bytes = uint64_t{1} << 29;  // a bandwidth point stops early after moving this much
};

// One table row. Bandwidth in bytes/s; latency in seconds, one-way for WRITE and SEND (half a
// ping-pong round trip, as ib_write_lat and ib_send_lat report), whole operation for READ.
struct Row {
  size_t size = 0;
  double bw[3] = {kNaN, kNaN, kNaN};
  double memcpy_bw = kNaN;
  double lat[3] = {kNaN, kNaN, kNaN};
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
// after an untimed warm-up session. NaN on error.
double measure_latency(const Options &o, RdmaPair &pair, Op op, size_t size) {
  constexpr uint64_t kWarmup = 32, kMaxRounds = 20000;
  const double budget = o.seconds / 2;
  double warm = 0;
  if (!pair.lat_begin(op, size, kWarmup)) return kNaN;
  for (uint64_t i = 0; i < kWarmup; i++) {
    const double t = pair.round_trip();
    if (t < 0) return kNaN;
    warm += t;
  }
  if (!pair.lat_end()) return kNaN;
  std::vector<double> samples;
  const double estimate = warm / kWarmup;
  double spent = 0;
  while (spent < budget && samples.size() < kMaxRounds) {
    const auto rounds = static_cast<uint64_t>(std::clamp((budget - spent) / estimate, 1.0, 5000.0));
    if (!pair.lat_begin(op, size, rounds)) return kNaN;
    for (uint64_t i = 0; i < rounds; i++) {
      const double t = pair.round_trip();
      if (t < 0) return kNaN;
      samples.push_back(t);
      spent += t;
    }
    if (!pair.lat_end()) return kNaN;
  }
  return median(std::move(samples));
}

double measure_pingpong(const Options &o, std::string *err) {
  std::unique_ptr<ShmPingPong> pp = ShmPingPong::start(err);
  if (!pp) return kNaN;
  std::vector<double> samples;
  for (int i = 0; i < 1000; i++)  // warm-up
    pp->round_trip();
  const double t0 = now_s();
  while (samples.size() < 100000 && now_s() - t0 < o.seconds) {
    const double t = pp->round_trip();
    if (t < 0) {
      *err = "the ping-pong child stopped answering";
      return kNaN;
    }
    samples.push_back(t);
  }
  return median(std::move(samples)) / 2;
}

// The peer of every RDMA measurement; restarted after a failure so one bad point does not
// spoil the rest of the table.
class Peer {
 public:
  explicit Peer(const Options &o) { opt_.max_size = o.max_size; }

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

// What the table says about the run itself: the ping-pong reference is measured before and after
// the sizes, and the smaller (less disturbed) half round trip is the one the ratios use.
struct RunInfo {
  double pingpong_start = kNaN, pingpong_end = kNaN;
  std::string load_start, load_end;
  double pingpong() const { return std::fmin(pingpong_start, pingpong_end); }
};

void print_table(FILE *f, const std::vector<Row> &rows, const RunInfo &run) {
  const double pingpong = run.pingpong();
  fprintf(f, "pcientb-perf: RDMA over the emulated NTB fabric (pcientb0) between two processes\n");
  fprintf(f, "reference latency: shared-memory ping-pong half round trip %.3f us ", pingpong * 1e6);
  fprintf(f, "(%.3f before, %.3f after the sizes)\n", run.pingpong_start * 1e6,
          run.pingpong_end * 1e6);
  fprintf(f, "machine: %s before, %s after\n", run.load_start.c_str(), run.load_end.c_str());
  fprintf(f, "bandwidth in MB/s (10^6 B/s); x = ratio to memcpy of the same size, same run\n");
  fprintf(f,
          "latency in us: WRITE and SEND one-way (half a ping-pong round trip, as ib_write_lat\n");
  fprintf(f,
          "and ib_send_lat), READ the whole operation; /pp = ratio to the ping-pong reference\n\n");
  fprintf(f, "%9s %11s %11s %11s %11s %7s %7s %7s %9s %9s %9s %8s %8s\n", "size", "WRITE MB/s",
          "READ MB/s", "SEND MB/s", "memcpy MB/s", "WRITE x", "READ x", "SEND x", "WRITE us",
          "READ us", "SEND us", "WRITE/pp", "SEND/pp");
  for (const Row &r : rows)
    fprintf(f, "%9s %11.1f %11.1f %11.1f %11.1f %7.3f %7.3f %7.3f %9.3f %9.3f %9.3f %8.2f %8.2f\n",
            size_str(r.size).c_str(), r.bw[0] / 1e6, r.bw[1] / 1e6, r.bw[2] / 1e6,
            r.memcpy_bw / 1e6, r.bw[0] / r.memcpy_bw, r.bw[1] / r.memcpy_bw, r.bw[2] / r.memcpy_bw,
            r.lat[0] * 1e6, r.lat[1] * 1e6, r.lat[2] * 1e6, r.lat[0] / pingpong,
            r.lat[2] / pingpong);
}

bool write_csv(const std::string &path, const std::vector<Row> &rows, double pingpong) {
  FILE *f = fopen(path.c_str(), "w");
  if (!f) return false;
  fprintf(f,
          "size_bytes,"
          "write_MBps,read_MBps,send_MBps,memcpy_MBps,"
          "write_x_memcpy,read_x_memcpy,send_x_memcpy,"
          "write_lat_us,read_lat_us,send_lat_us,pingpong_half_rtt_us,"
          "write_lat_x_pingpong,send_lat_x_pingpong\n");
  for (const Row &r : rows)
    fprintf(f, "%zu,%.3f,%.3f,%.3f,%.3f,%.4f,%.4f,%.4f,%.4f,%.4f,%.4f,%.4f,%.3f,%.3f\n", r.size,
            r.bw[0] / 1e6, r.bw[1] / 1e6, r.bw[2] / 1e6, r.memcpy_bw / 1e6, r.bw[0] / r.memcpy_bw,
            r.bw[1] / r.memcpy_bw, r.bw[2] / r.memcpy_bw, r.lat[0] * 1e6, r.lat[1] * 1e6,
            r.lat[2] * 1e6, pingpong * 1e6, r.lat[0] / pingpong, r.lat[2] / pingpong);
  return fclose(f) == 0;
}

// The targets the provider aims for, as ratios against this run's references.
void print_targets(const std::vector<Row> &rows, double pingpong) {
  const Row &big = rows.back();
  const Row *small = nullptr;
  for (const Row &r : rows)
    if (r.size == 8) small = &r;
  const std::string bs = size_str(big.size);
  auto line = [](const std::string &what, double r, double target, bool at_least) {
    const bool met = at_least ? r >= target : r <= target;
    printf("  %-50s %7.2fx   target %s %.1fx   %s\n", what.c_str(), r,
           at_least ? ">=" : "<=", target, met ? "met" : "MISSED");
  };
  printf("\ntargets (ratios against the references of this run):\n");
  line("RDMA WRITE " + bs + " bandwidth / memcpy " + bs, big.bw[0] / big.memcpy_bw, 0.9, true);
  line("RDMA READ " + bs + " bandwidth / memcpy " + bs, big.bw[1] / big.memcpy_bw, 0.9, true);
  if (small) {
    line("SEND 8 B one-way latency / ping-pong half RTT", small->lat[2] / pingpong, 3, false);
    line("RDMA WRITE 8 B one-way latency / ping-pong half RTT", small->lat[0] / pingpong, 6, false);
  }
}

void usage(FILE *f) {
  fprintf(
      f,
      "usage: pcientb-perf [--csv FILE] [--max-size BYTES] [--seconds S] [--quick]\n"
      "Measures RDMA WRITE, READ and SEND bandwidth and latency between two processes on the\n"
      "emulated fabric (pcientb0) from 1 B to 4 MiB, beside memcpy and a shared-memory ping-pong\n"
      "measured in the same run. Table on stdout, progress on stderr.\n"
      "  --csv FILE        write the table as CSV to FILE (default pcientb-perf.csv)\n"
      "  --max-size BYTES  largest message, a power of 2 (default 4194304)\n"
      "  --seconds S       time budget of one bandwidth point; latency points get half (default "
      "0.35)\n"
      "  --quick           sizes up to 64 KiB and a tiny budget (smoke test)\n"
      "PCIENTB_FABRIC names the fabric; unset, a name private to this run is used.\n");
}

bool parse(int argc, char **argv, Options *o) {
  static const option longopts[] = {
      {"csv", required_argument, nullptr, 'c'},     {"max-size", required_argument, nullptr, 'm'},
      {"seconds", required_argument, nullptr, 's'}, {"quick", no_argument, nullptr, 'q'},
      {"help", no_argument, nullptr, 'h'},          {nullptr, 0, nullptr, 0}};
  for (int c; (c = getopt_long(argc, argv, "c:m:s:qh", longopts, nullptr)) != -1;) {
    switch (c) {
      case 'c':
        o->csv = optarg;
        break;
      case 'm':
        o->max_size = strtoull(optarg, nullptr, 0);
        break;
      case 's':
        o->seconds = strtod(optarg, nullptr);
        break;
      case 'q':
        o->max_size = 64 * 1024;
        o->seconds = 0.01;
        o->bytes = 16 << 20;
        break;
      case 'h':
        usage(stdout);
        exit(0);
      default:
        usage(stderr);
        return false;
    }
  }
  if (optind != argc || o->max_size == 0 || (o->max_size & (o->max_size - 1)) ||
      !(o->seconds > 0)) {
    usage(stderr);
    return false;
  }
  return true;
}

}  // namespace

int main(int argc, char **argv) {
  Options o;
  if (!parse(argc, argv, &o)) return 2;
  pcientb::bench::use_private_fabric("pcientb-perf");
  const double start = now_s();
  RunInfo run;
  run.load_start = machine_load();
  fprintf(stderr, "pcientb-perf: fabric %s, sizes 1 B .. %s, %s\n", getenv("PCIENTB_FABRIC"),
          size_str(o.max_size).c_str(), run.load_start.c_str());

  std::string err;
  fprintf(stderr, "reference: shared-memory ping-pong between two processes ...\n");
  run.pingpong_start = measure_pingpong(o, &err);
  if (std::isnan(run.pingpong_start)) {
    fprintf(stderr, "pcientb-perf: ping-pong reference failed: %s\n", err.c_str());
    return 1;
  }
  fprintf(stderr, "  half round trip %.3f us\n", run.pingpong_start * 1e6);

  fprintf(stderr, "starting the peer node and checking the data path ...\n");
  Peer peer(o);
  if (!peer.get(&err)) {
    fprintf(stderr, "pcientb-perf: cannot set up RDMA between two processes: %s\n", err.c_str());
    return 1;
  }

  Buffer src(o.max_size), dst(o.max_size);
  std::vector<size_t> sizes;
  for (size_t s = 1; s <= o.max_size; s *= 2) sizes.push_back(s);
  std::vector<Row> rows;
  int failures = 0;
  for (size_t i = 0; i < sizes.size(); i++) {
    const double t0 = now_s();
    Row r;
    r.size = sizes[i];
    r.memcpy_bw = measure_bandwidth(o, r.size, 1 << 20, [&](uint64_t n) {
      return pcientb::bench::time_memcpy(dst, src, r.size, n);
    });
    for (int k = 0; k < 3; k++) {
      RdmaPair *pair = peer.get(&err);
      if (pair)
        r.bw[k] = measure_bandwidth(
            o, r.size, 65536, [&](uint64_t n) { return pair->bandwidth(kOps[k], r.size, n); });
      if (std::isnan(r.bw[k])) {
        fprintf(stderr, "  %s bandwidth at %s failed: %s\n", op_name(kOps[k]),
                size_str(r.size).c_str(), pair ? pair->error().c_str() : err.c_str());
        failures++;
      }
    }
    for (int k = 0; k < 3; k++) {
      RdmaPair *pair = peer.get(&err);
      if (pair)
        r.lat[k] = measure_latency(o, *pair, kOps[k], r.size) * (kOps[k] == Op::read ? 1 : 0.5);
      if (std::isnan(r.lat[k])) {
        fprintf(stderr, "  %s latency at %s failed: %s\n", op_name(kOps[k]),
                size_str(r.size).c_str(), pair ? pair->error().c_str() : err.c_str());
        failures++;
      }
    }
    fprintf(stderr, "[%2zu/%zu] %7s  MB/s: WRITE %8.1f READ %8.1f SEND %8.1f memcpy %8.1f", i + 1,
            sizes.size(), size_str(r.size).c_str(), r.bw[0] / 1e6, r.bw[1] / 1e6, r.bw[2] / 1e6,
            r.memcpy_bw / 1e6);
    fprintf(stderr, " | us: WRITE %.2f READ %.2f SEND %.2f  (%.1f s)\n", r.lat[0] * 1e6,
            r.lat[1] * 1e6, r.lat[2] * 1e6, now_s() - t0);
    rows.push_back(r);
  }

  fprintf(stderr, "reference again: shared-memory ping-pong ...\n");
  run.pingpong_end = measure_pingpong(o, &err);
  run.load_end = machine_load();
  if (std::isnan(run.pingpong_end))
    fprintf(stderr, "pcientb-perf: ping-pong reference failed: %s\n", err.c_str());

  print_table(stdout, rows, run);
  print_targets(rows, run.pingpong());
  if (!write_csv(o.csv, rows, run.pingpong())) {
    fprintf(stderr, "pcientb-perf: cannot write %s: %s\n", o.csv.c_str(), strerror(errno));
    return 1;
  }
  fprintf(stderr, "pcientb-perf: wrote %s (%.0f s)\n", o.csv.c_str(), now_s() - start);
  if (failures)
    fprintf(stderr, "pcientb-perf: %d measurement(s) failed (NaN in the table)\n", failures);
  return failures ? 1 : 0;
}
