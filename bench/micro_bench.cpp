// Micro-benchmarks of pcientb0 (RDMA WRITE, READ and SEND bandwidth; SEND, WRITE and READ
// latency; the cost of reg_mr + dereg_mr) beside references measured in the same run:
//   Reference_Memcpy        memcpy of the same size between two buffers of that size
//   Reference_ShmPingPong   half round trip of a shared-memory ping-pong between two processes
// The ratios do not lean on those rows alone: each RDMA benchmark measures its reference again
// right beside itself (memcpy of its size just before its loop; the ping-pong just before and
// just after its loop), because on a VM the cost of a cache-line round trip between the two
// vCPUs moves when the host moves them. Bandwidth rows report bytes_per_second,
// memcpy_bytes_per_second and x_memcpy; latency rows report the one-way time (half the round trip;
// READ: the whole operation), pingpong_us and x_pingpong. The ratios the provider aims for are
// summarized at the end.
//
// Each benchmark family forks its peer processes once and keeps them serving requests across
// sizes and iterations; the ping-pong child is forked before the device is opened and sleeps
// on a futex while RDMA is measured.

#include <benchmark/benchmark.h>
#include <infiniband/verbs.h>
#include <sys/mman.h>

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
using pcientb::bench::op_name;
using pcientb::bench::PairOptions;
using pcientb::bench::RdmaPair;
using pcientb::bench::ShmPingPong;

constexpr size_t kMaxSize = size_t{4} << 20;
// Latency rows count one iteration per round but time them in batches of this many
// (KeepRunningBatch): short rounds would otherwise carry the clock's cost and its granularity
// (10 ns on some VMs).
constexpr uint64_t kRoundsPerBatch = 100;
constexpr uint64_t kPingPongBatches = 200;  // beside each latency row

// The final measurement of each RDMA benchmark beside its reference, by "WRITE bw/<size>",
// "SEND lat/<size>", ...: bytes/s against memcpy bytes/s, or one-way seconds against the
// ping-pong half round trip.
struct Measured {
  double value, reference;
};
std::map<std::string, Measured> g_results;
int g_errors = 0;

void skip(benchmark::State &state, const std::string &msg) {
  state.SkipWithError(msg.c_str());
  g_errors++;
}

Buffer &memcpy_src() {
  static Buffer b(kMaxSize);
  return b;
}
Buffer &memcpy_dst() {
  static Buffer b(kMaxSize);
  return b;
}

// memcpy bandwidth at `size` over about `seconds`, after one warm-up copy.
double memcpy_bandwidth(size_t size, double seconds) {
  const uint64_t chunk = std::clamp<uint64_t>((size_t{8} << 20) / size, 1, 1 << 20);
  pcientb::bench::time_memcpy(memcpy_dst(), memcpy_src(), size, 1);
  double t = 0;
  uint64_t n = 0;
  while (t < seconds) {
    t += pcientb::bench::time_memcpy(memcpy_dst(), memcpy_src(), size, chunk);
    n += chunk;
  }
  return static_cast<double>(n * size) / t;
}

// The peer processes of the family now running. Starting the next family stops them first, so
// a spinning peer never competes with another benchmark for a core.
struct Peers {
  std::unique_ptr<ShmPingPong> pingpong;
  std::unique_ptr<RdmaPair> rdma;
};
struct Family {
  std::string name;
  std::unique_ptr<Peers> peers;
  std::string start_error;
};
Family g_family;

std::unique_ptr<Peers> start_peers(bool rdma, size_t dst_offset, std::string *err) {
  auto peers = std::make_unique<Peers>();
  // The ping-pong child first: nothing is forked once this process has opened the device.
  if (!(peers->pingpong = ShmPingPong::start(err))) return nullptr;
  if (!rdma) return peers;
  PairOptions opt;
  opt.max_size = kMaxSize;
  opt.dst_offset = dst_offset;
  if (!(peers->rdma = RdmaPair::start(opt, err))) return nullptr;
  if (!peers->rdma->verify()) {
    *err = "data check failed: " + peers->rdma->error();
    return nullptr;
  }
  return peers;
}

Peers *family_peers(benchmark::State &state, const std::string &family, bool rdma,
                    size_t dst_offset = 0) {
  if (g_family.name != family) {
    g_family = {};
    std::string err;
    auto peers = start_peers(rdma, dst_offset, &err);
    g_family = {family, std::move(peers), err};
  }
  if (!g_family.peers) {
    skip(state, "cannot start the peers: " + g_family.start_error);
    return nullptr;
  }
  return g_family.peers.get();
}

// After a failure the peers are dropped, so the next benchmark starts fresh ones.
void fail(benchmark::State &state, const std::string &msg) {
  skip(state, msg);
  g_family = {};
}

void Reference_Memcpy(benchmark::State &state) {
  const auto size = static_cast<size_t>(state.range(0));
  uint8_t *dst = memcpy_dst().data();
  const uint8_t *src = memcpy_src().data();
  for (auto _ : state) {
    memcpy(dst, src, size);
    benchmark::DoNotOptimize(dst);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * state.range(0));
}

void Reference_ShmPingPong(benchmark::State &state) {
  Peers *peers = family_peers(state, "pingpong", false);
  if (!peers) return;
  while (state.KeepRunningBatch(kRoundsPerBatch)) {
    const double t = peers->pingpong->round_trips(kRoundsPerBatch);
    if (t < 0) return fail(state, "the ping-pong child stopped answering");
    state.SetIterationTime(t / 2);
  }
}

// Messages per iteration: enough that one pipeline drain per iteration does not matter.
uint64_t batch_for(size_t size) {
  return std::clamp<uint64_t>((size_t{32} << 20) / size, 8, 4096);
}

// dst_offset: the destination sits that far past a page (see PairOptions), as a malloc'd one.
void Rdma_Bandwidth(benchmark::State &state, Op op, size_t dst_offset = 0) {
  const std::string shifted = dst_offset ? "+" + std::to_string(dst_offset) : "";
  Peers *peers =
      family_peers(state, std::string("bandwidth/") + op_name(op) + shifted, true, dst_offset);
  if (!peers) return;
  RdmaPair &pair = *peers->rdma;
  const auto size = static_cast<size_t>(state.range(0));
  const uint64_t batch = batch_for(size);
  const double reference = memcpy_bandwidth(size, 0.02);
  double total = 0;
  for (auto _ : state) {
    const double s = pair.bandwidth(op, size, batch);
    if (s < 0) return fail(state, pair.error());
    state.SetIterationTime(s);
    total += s;
  }
  const double bytes = static_cast<double>(state.iterations() * batch * size);
  const double bw = bytes / total;
  g_results[std::string(op_name(op)) + " bw/" + std::to_string(size) + shifted] = {bw, reference};
  state.SetBytesProcessed(static_cast<int64_t>(bytes));
  state.counters["msgs_per_iter"] = static_cast<double>(batch);
  state.counters["memcpy_bytes_per_second"] =
      benchmark::Counter(reference, benchmark::Counter::kDefaults, benchmark::Counter::kIs1024);
  state.counters["x_memcpy"] = bw / reference;
}

void Rdma_Latency(benchmark::State &state, Op op) {
  Peers *peers = family_peers(state, std::string("latency/") + op_name(op), true);
  if (!peers) return;
  RdmaPair &pair = *peers->rdma;
  ShmPingPong &pp = *peers->pingpong;
  const auto size = static_cast<size_t>(state.range(0));
  // WRITE and SEND rounds are ping-pongs (one-way = half); a READ round is one operation.
  const double part = op == Op::read ? 1.0 : 0.5;

  const double pp_before = pp.half_rtt(kPingPongBatches, kRoundsPerBatch);
  pp.sleep();
  if (pp_before < 0) return fail(state, "the ping-pong child stopped answering");
  // KeepRunningBatch runs whole batches: max_iterations rounded up.
  const auto batches =
      (static_cast<uint64_t>(state.max_iterations) + kRoundsPerBatch - 1) / kRoundsPerBatch;
  if (!pair.lat_begin(op, size, batches * kRoundsPerBatch)) return fail(state, pair.error());
  double total = 0;
  while (state.KeepRunningBatch(kRoundsPerBatch)) {
    const double t = pair.rounds(kRoundsPerBatch);
    if (t < 0) return fail(state, pair.error());
    state.SetIterationTime(t * part);
    total += t * part;
  }
  if (!pair.lat_end()) return fail(state, pair.error());
  const double pp_after = pp.half_rtt(kPingPongBatches, kRoundsPerBatch);
  pp.sleep();
  if (pp_after < 0) return fail(state, "the ping-pong child stopped answering");

  // The faster of the two references: the stricter ratio.
  const double reference = std::min(pp_before, pp_after);
  const double one_way = total / static_cast<double>(state.iterations());
  g_results[std::string(op_name(op)) + " lat/" + std::to_string(size)] = {one_way, reference};
  state.counters["pingpong_us"] = reference * 1e6;
  state.counters["x_pingpong"] = one_way / reference;
}

// reg_mr + dereg_mr of `size` bytes beside memcpy of the same size. "again": the same buffer
// each time, as MPI without a registration cache does for every rendezvous; "fresh": memory
// the process has just mapped and written, as the first registration of a buffer.
void Registration(benchmark::State &state, bool fresh) {
  g_family = {};  // no peer process: only this one's node
  const auto size = static_cast<size_t>(state.range(0));
  ibv_device **list = ibv_get_device_list(nullptr);
  ibv_context *ctx = list && list[0] ? ibv_open_device(list[0]) : nullptr;
  ibv_pd *pd = ctx ? ibv_alloc_pd(ctx) : nullptr;
  auto map = [&] {
    void *p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p != MAP_FAILED) memset(p, 1, size);
    return p;
  };
  void *buf = pd ? map() : MAP_FAILED;
  if (buf == MAP_FAILED) {
    skip(state, "cannot open pcientb0 or map memory");
  } else {
    const int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
    ibv_dereg_mr(ibv_reg_mr(pd, buf, size, access));  // "again" starts registered once
    double total = 0;
    for (auto _ : state) {
      if (fresh) {
        munmap(buf, size);
        if ((buf = map()) == MAP_FAILED) return skip(state, "cannot map memory");
      }
      const double t0 = pcientb::bench::now_s();
      ibv_mr *mr = ibv_reg_mr(pd, buf, size, access);
      if (!mr || ibv_dereg_mr(mr)) return skip(state, "reg_mr/dereg_mr failed");
      const double t = pcientb::bench::now_s() - t0;
      state.SetIterationTime(t);
      total += t;
    }
    const double reference = size / memcpy_bandwidth(std::min(size, kMaxSize), 0.02);
    const double each = total / static_cast<double>(state.iterations());
    g_results[std::string(fresh ? "REG fresh/" : "REG again/") + std::to_string(size)] = {
        each, reference};
    state.counters["memcpy_us"] = reference * 1e6;
    state.counters["x_memcpy"] = each / reference;
    munmap(buf, size);
  }
  if (pd) ibv_dealloc_pd(pd);
  if (ctx) ibv_close_device(ctx);
  if (list) ibv_free_device_list(list);
}

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
// Destinations 16 bytes past a page: glibc's memcpy is ~20x slower there on AMD Zen (REP MOVSB
// with (dst - src) mod 4096 in 1..31), which the fabric's copies must avoid.
BENCHMARK_CAPTURE(Rdma_Bandwidth, write_dst16, Op::write, 16)
    ->RangeMultiplier(16)
    ->Range(4096, kMaxSize)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(Rdma_Bandwidth, read_dst16, Op::read, 16)
    ->RangeMultiplier(16)
    ->Range(4096, kMaxSize)
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
// Last: this process opens the device, and the families above fork before it does.
BENCHMARK_CAPTURE(Registration, again, false)
    ->RangeMultiplier(16)
    ->Range(4096, size_t{64} << 20)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(Registration, fresh, true)
    ->RangeMultiplier(16)
    ->Range(4096, size_t{64} << 20)
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

// One line of the summary if `key` was measured; target 0 means none.
void ratio_line(const char *what, const std::string &key, double target = 0, bool at_least = true) {
  auto it = g_results.find(key);
  if (it == g_results.end()) return;
  const auto [value, reference] = it->second;
  const bool bandwidth = key.find(" bw/") != std::string::npos;  // else seconds
  const double r = value / reference, scale = bandwidth ? 1e-9 : 1e6;
  printf("  %-52s %8.3f / %8.3f %s = %6.2fx", what, value * scale, reference * scale,
         bandwidth ? "GB/s" : "us  ", r);
  if (target > 0)
    printf("   target %s %.1fx: %s", at_least ? ">=" : "<=", target,
           (at_least ? r >= target : r <= target) ? "met" : "MISSED");
  printf("\n");
}

void print_summary() {
  if (g_results.empty()) return;
  const std::string big = std::to_string(kMaxSize);
  printf("\nRatios against the references measured beside each benchmark in this run\n");
  printf("(bandwidth in GB/s = 10^9 B/s against memcpy; latency in us against the ping-pong;\n");
  printf(" registration in us against memcpy of the same size):\n");
  ratio_line("RDMA WRITE 4 MiB bandwidth / memcpy 4 MiB", "WRITE bw/" + big, 0.9, true);
  ratio_line("RDMA READ 4 MiB bandwidth / memcpy 4 MiB", "READ bw/" + big, 0.9, true);
  ratio_line("SEND 4 MiB bandwidth / memcpy 4 MiB", "SEND bw/" + big);
  for (const char *op : {"WRITE", "READ"})
    for (size_t size : {size_t{4} << 10, size_t{64} << 10}) {
      const std::string label = std::string("RDMA ") + op + " " + std::to_string(size >> 10) +
                                " KiB, destination 16 B past a page / memcpy";
      ratio_line(label.c_str(), std::string(op) + " bw/" + std::to_string(size) + "+16", 0.5);
    }
  ratio_line("SEND 8 B one-way latency / ping-pong half RTT", "SEND lat/8", 3, false);
  ratio_line("RDMA WRITE 8 B one-way latency / ping-pong half RTT", "WRITE lat/8", 6, false);
  ratio_line("RDMA READ 8 B latency / ping-pong half RTT", "READ lat/8");
  for (size_t size : {size_t{4} << 10, size_t{64} << 10, size_t{1} << 20, size_t{64} << 20}) {
    const std::string n = std::to_string(size);
    const std::string label = std::to_string(size >> 10) + " KiB";
    ratio_line(("reg+dereg " + label + " again / memcpy").c_str(), "REG again/" + n,
               size == (size_t{1} << 20) ? 3 : 0, false);
    ratio_line(("reg+dereg " + label + " fresh memory / memcpy").c_str(), "REG fresh/" + n);
  }
}

}  // namespace

int main(int argc, char **argv) {
  pcientb::bench::use_private_fabric("pcientb-bench");
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  g_family = {};
  print_summary();
  benchmark::Shutdown();
  if (g_errors) fprintf(stderr, "%d benchmark(s) failed\n", g_errors);
  return g_errors ? 1 : 0;
}
