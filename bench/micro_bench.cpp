// Micro-benchmarks of pcientb0 (RDMA WRITE, READ and SEND bandwidth; SEND, WRITE and READ
// latency) beside the references measured in the same run: memcpy of the same size, and a
// shared-memory ping-pong between two processes. Bandwidth runs report bytes/s and x_memcpy
// (against Reference_Memcpy of the same size); latency runs report the one-way time (half the
// round trip; READ: the whole operation) and x_pingpong (against Reference_ShmPingPong). A
// summary of the ratios the provider aims for is printed at the end.
//
// Each benchmark family forks its peer process once and keeps it serving requests across
// sizes and iterations.

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>

#include "rdma_pair.hpp"
#include "references.hpp"

namespace {

using pcientb::bench::Buffer;
using pcientb::bench::now_s;
using pcientb::bench::Op;
using pcientb::bench::PairOptions;
using pcientb::bench::RdmaPair;
using pcientb::bench::ShmPingPong;

constexpr size_t kMaxSize = size_t{4} << 20;

// The final measurement of each benchmark, for the ratios: bytes/s by "memcpy/<size>",
// "WRITE/<size>", ...; one-way seconds by "pingpong", "SEND/<size>", ...
std::map<std::string, double> g_bandwidth;
std::map<std::string, double> g_one_way;
int g_errors = 0;

std::string key(const char *what, size_t size) {
  return std::string(what) + "/" + std::to_string(size);
}

void skip(benchmark::State &state, const std::string &msg) {
  state.SkipWithError(msg.c_str());
  g_errors++;
}

// The peer process of the family now running. Starting the next family stops it first, so a
// spinning peer never competes with another benchmark for a core.
struct FamilyPeer {
  std::string family;
  std::shared_ptr<void> peer;
  std::string start_error;
};
FamilyPeer g_peer;

template <class T, class Start>
T *family_peer(benchmark::State &state, const std::string &family, Start start) {
  if (g_peer.family != family) {
    g_peer = {};
    std::string err;
    std::shared_ptr<T> peer = start(&err);
    g_peer = {family, peer, err};
  }
  if (!g_peer.peer) {
    skip(state, "cannot start the peer: " + g_peer.start_error);
    return nullptr;
  }
  return static_cast<T *>(g_peer.peer.get());
}

RdmaPair *rdma_peer(benchmark::State &state, const std::string &family) {
  return family_peer<RdmaPair>(state, family, [](std::string *err) -> std::shared_ptr<RdmaPair> {
    PairOptions opt;
    opt.max_size = kMaxSize;
    std::shared_ptr<RdmaPair> pair = RdmaPair::start(opt, err);
    if (pair && !pair->verify()) {
      *err = "data check failed: " + pair->error();
      pair.reset();
    }
    return pair;
  });
}

// A failed RDMA peer is dropped, so the next benchmark starts a fresh one.
void drop_peer() {
  g_peer = {};
}

void Reference_Memcpy(benchmark::State &state) {
  static Buffer src(kMaxSize), dst(kMaxSize);
  const auto size = static_cast<size_t>(state.range(0));
  const double t0 = now_s();
  for (auto _ : state) {
    memcpy(dst.data(), src.data(), size);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  const double bytes = static_cast<double>(state.iterations()) * static_cast<double>(size);
  g_bandwidth[key("memcpy", size)] = bytes / (now_s() - t0);
  state.SetBytesProcessed(state.iterations() * state.range(0));
}

void Reference_ShmPingPong(benchmark::State &state) {
  auto *pp = family_peer<ShmPingPong>(
      state, "pingpong",
      [](std::string *err) -> std::shared_ptr<ShmPingPong> { return ShmPingPong::start(err); });
  if (!pp) return;
  double total = 0;
  for (auto _ : state) {
    const double rtt = pp->round_trip();
    if (rtt < 0) {
      skip(state, "the ping-pong child stopped answering");
      drop_peer();
      return;
    }
    state.SetIterationTime(rtt / 2);
    total += rtt / 2;
  }
  g_one_way["pingpong"] = total / static_cast<double>(state.iterations());
}

// Messages per iteration: enough that one pipeline drain per iteration does not matter.
uint64_t batch_for(size_t size) {
  return std::clamp<uint64_t>((size_t{32} << 20) / size, 8, 4096);
}

void Rdma_Bandwidth(benchmark::State &state, Op op) {
  RdmaPair *pair = rdma_peer(state, std::string("bandwidth/") + pcientb::bench::op_name(op));
  if (!pair) return;
  const auto size = static_cast<size_t>(state.range(0));
  const uint64_t batch = batch_for(size);
  double total = 0;
  for (auto _ : state) {
    const double s = pair->bandwidth(op, size, batch);
    if (s < 0) {
      skip(state, pair->error());
      drop_peer();
      return;
    }
    state.SetIterationTime(s);
    total += s;
  }
  const double bytes = static_cast<double>(state.iterations() * batch * size);
  const double bw = bytes / total;
  g_bandwidth[key(pcientb::bench::op_name(op), size)] = bw;
  state.SetBytesProcessed(static_cast<int64_t>(bytes));
  state.counters["msgs_per_iter"] = static_cast<double>(batch);
  if (auto ref = g_bandwidth.find(key("memcpy", size)); ref != g_bandwidth.end())
    state.counters["x_memcpy"] = bw / ref->second;
}

void Rdma_Latency(benchmark::State &state, Op op) {
  RdmaPair *pair = rdma_peer(state, std::string("latency/") + pcientb::bench::op_name(op));
  if (!pair) return;
  const auto size = static_cast<size_t>(state.range(0));
  // WRITE and SEND rounds are ping-pongs (one-way = half); a READ round is one operation.
  const double part = op == Op::read ? 1.0 : 0.5;
  if (!pair->lat_begin(op, size, static_cast<uint64_t>(state.max_iterations))) {
    skip(state, pair->error());
    drop_peer();
    return;
  }
  double total = 0;
  for (auto _ : state) {
    const double rtt = pair->round_trip();
    if (rtt < 0) {
      skip(state, pair->error());
      drop_peer();
      return;
    }
    state.SetIterationTime(rtt * part);
    total += rtt * part;
  }
  if (!pair->lat_end()) {
    skip(state, pair->error());
    drop_peer();
    return;
  }
  const double one_way = total / static_cast<double>(state.iterations());
  g_one_way[key(pcientb::bench::op_name(op), size)] = one_way;
  if (auto ref = g_one_way.find("pingpong"); ref != g_one_way.end())
    state.counters["x_pingpong"] = one_way / ref->second;
}

// References first: the RDMA benchmarks take their ratios from them.
// Real time, like the manual (wall-clock) time of the RDMA benchmarks.
BENCHMARK(Reference_Memcpy)->RangeMultiplier(4)->Range(8, kMaxSize)->UseRealTime();
BENCHMARK(Reference_ShmPingPong)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(Rdma_Bandwidth, write, Op::write)
    ->RangeMultiplier(4)
    ->Range(8, kMaxSize)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(Rdma_Bandwidth, read, Op::read)
    ->RangeMultiplier(4)
    ->Range(8, kMaxSize)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(Rdma_Bandwidth, send, Op::send)
    ->RangeMultiplier(4)
    ->Range(8, kMaxSize)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(Rdma_Latency, send, Op::send)
    ->Arg(8)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(Rdma_Latency, write, Op::write)
    ->Arg(8)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(Rdma_Latency, read, Op::read)
    ->Arg(8)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

// One line of the summary, a / b, if both were measured; target 0 means none. Bandwidths are
// printed in GB/s (10^9 B/s), one-way times in us.
void ratio_line(const char *what, bool bandwidth, const std::string &a, const std::string &b,
                double target = 0, bool at_least = true) {
  const auto &m = bandwidth ? g_bandwidth : g_one_way;
  auto x = m.find(a), y = m.find(b);
  if (x == m.end() || y == m.end()) return;
  const double r = x->second / y->second, scale = bandwidth ? 1e-9 : 1e6;
  printf("  %-52s %9.3f / %9.3f %s = %6.2fx", what, x->second * scale, y->second * scale,
         bandwidth ? "GB/s" : "us  ", r);
  if (target > 0)
    printf("   target %s %.1fx: %s", at_least ? ">=" : "<=", target,
           (at_least ? r >= target : r <= target) ? "met" : "MISSED");
  printf("\n");
}

void print_summary() {
  if (g_bandwidth.empty() && g_one_way.empty()) return;
  const std::string big = std::to_string(kMaxSize);
  printf("\nRatios against the references measured in this run:\n");
  ratio_line("RDMA WRITE 4 MiB bandwidth / memcpy 4 MiB", true, "WRITE/" + big, "memcpy/" + big,
             0.9, true);
  ratio_line("RDMA READ 4 MiB bandwidth / memcpy 4 MiB", true, "READ/" + big, "memcpy/" + big, 0.9,
             true);
  ratio_line("SEND 4 MiB bandwidth / memcpy 4 MiB", true, "SEND/" + big, "memcpy/" + big);
  ratio_line("SEND 8 B one-way latency / ping-pong half RTT", false, "SEND/8", "pingpong", 3,
             false);
  ratio_line("RDMA WRITE 8 B one-way latency / ping-pong half RTT", false, "WRITE/8", "pingpong", 6,
             false);
  ratio_line("RDMA READ 8 B latency / ping-pong half RTT", false, "READ/8", "pingpong");
}

}  // namespace

int main(int argc, char **argv) {
  pcientb::bench::use_private_fabric("pcientb-bench");
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  g_peer = {};
  print_summary();
  benchmark::Shutdown();
  if (g_errors) fprintf(stderr, "%d benchmark(s) failed\n", g_errors);
  return g_errors ? 1 : 0;
}
