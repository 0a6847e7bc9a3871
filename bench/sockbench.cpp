// sockbench: a plain BSD-socket benchmark, so that the SDP layer (pcientb-sdp) and kernel TCP
// are measured by the same unmodified program. Nothing here knows about pcientb0: under
// pcientb-sdp the preloaded layer diverts the sockets, without it they are kernel TCP. The only
// tie to the layer is getsockopt(IPPROTO_TCP, PCIENTB_SDP_STATS), which says which path a
// connection took (it fails on kernel TCP: "unknown").
//
//   sockbench server -p PORT [-b ADDR] [--once]
//   sockbench stream -c HOST -p PORT -s WRITE_SIZE -t SECONDS [-n CONNS] [-r RECV_SIZE]
//                    [--verify] [--nodelay]
//                    [--legs THRESH,THRESH,... [--slice SECONDS] [--warmup SECONDS]]
//   sockbench pingpong -c HOST -p PORT -s SIZE -i ITERS [-w WARMUP]
//   sockbench refs [-s SIZE]... [-t SECONDS] [--pingpong-rounds N]
//
// A client run opens a control connection first and closes it last; the server measures its own
// CPU time (getrusage) between the control connection's start and end marks and sends it back,
// so the client reports the CPU of both ends. Every data connection starts with a 16-byte header
// that says what the server does with it (sink or echo). Results are one JSON line on stdout;
// errors go to stderr and exit 1.
//
// `stream --legs` compares ZCopy thresholds of the layer on the same connections in one run:
// the legs take turns in short slices (setsockopt SDP_ZCOPY_THRESH on every connection), so
// the machine's slow and fast spells, which on a shared VM move a one-second figure by 10-30%,
// fall on every leg alike. Each leg gets SECONDS of timed slices, after --warmup untimed.
//
// `refs` is not a socket test: it prints the references of bench/references.hpp (memcpy per size
// and the shared-memory ping-pong), for bench/sdp_bench.py to set the figures beside.

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <condition_variable>
#include <csignal>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>

#include "references.hpp"

#if __has_include(<pcientb/sdp.h>)
#include <pcientb/sdp.h>
#define SOCKBENCH_STATS_OPT PCIENTB_SDP_STATS
using SdpStats = pcientb_sdp_stats;
#else
// The layout of sdp/include/pcientb/sdp.h, for building before (or without) the layer.
#define SOCKBENCH_STATS_OPT 81
#define SDP_ZCOPY_THRESH 80
#define SDP_ZCOPY_AUTO (-1)
struct SdpStats {
  uint32_t path;  // 0 tcp, 1 sdp, 2 not yet decided
  uint32_t pad;
  uint64_t bcopy_tx, bcopy_rx, zcopy_tx, zcopy_rx;
  uint64_t onesided_tx, registrations, wzcopy_tx, wzcopy_rx, sink_avails;
};
#endif

namespace {

using pcientb::bench::now_s;

// --- Errors --------------------------------------------------------------------------------

[[noreturn]] void die(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void die(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("sockbench: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  // exit(), not _exit(): the layer appends its per-connection stats lines at process exit.
  fflush(nullptr);
  exit(1);
}

// --- Wire format ---------------------------------------------------------------------------

constexpr uint32_t kMagic = 0x53424b31;  // "SBK1"
enum Kind : uint8_t { kSink = 1, kEcho = 2, kControl = 3 };
enum Flags : uint8_t { kVerify = 1, kNoDelay = 2 };

// Both ends are this program on one host: native byte order.
struct Header {
  uint32_t magic;
  uint8_t kind;
  uint8_t flags;
  uint16_t reserved;
  uint32_t size;  // sink: recv() size; echo: message size
  uint32_t reserved2;
};
static_assert(sizeof(Header) == 16);

// A sink's answer once the client has shut down its sending side.
struct SinkTrailer {
  uint64_t bytes;
  uint32_t verify_errors;
  uint32_t path;  // the server's view, kPathUnknown if getsockopt failed
};
static_assert(sizeof(SinkTrailer) == 16);

// The control connection's answer to 'E': the server's CPU time since 'S'.
struct CpuTrailer {
  uint64_t user_us;
  uint64_t sys_us;
  uint64_t errors;  // connection errors the server saw during the run
};
static_assert(sizeof(CpuTrailer) == 24);

constexpr uint32_t kPathUnknown = 0xffffffff;
constexpr char kReady = 'R', kStart = 'S', kEnd = 'E';
// Pattern of --verify: stream byte at offset o is o % kPatternPeriod (a prime, so that no
// power-of-two write size lines up with it).
constexpr size_t kPatternPeriod = 251;

// --- Socket helpers ------------------------------------------------------------------------

// Page-aligned, pre-faulted: page faults stay out of the timed loops.
struct Mem {
  explicit Mem(size_t n) : size(std::max<size_t>(n, 1)) {
    void *p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) die("mmap(%zu): %s", size, strerror(errno));
    data = static_cast<uint8_t *>(p);
    memset(data, 0x5a, size);
  }
  ~Mem() { munmap(data, size); }
  Mem(const Mem &) = delete;
  Mem &operator=(const Mem &) = delete;
  uint8_t *data;
  size_t size;
};

// Sends all of buf (blocking send() can return short, e.g. on a signal). False and *err on
// failure.
bool send_all(int fd, const void *buf, size_t len, std::string *err) {
  const auto *p = static_cast<const uint8_t *>(buf);
  while (len > 0) {
    const ssize_t n = send(fd, p, len, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      *err = std::string("send: ") + strerror(errno);
      return false;
    }
    p += n;
    len -= static_cast<size_t>(n);
  }
  return true;
}

// Receives exactly len bytes, looping over short reads (no MSG_WAITALL: the layer need not
// implement it). Returns len, 0 on EOF before the first byte, -1 and *err on failure (EOF in
// the middle too). No poll() timeouts: they would need the layer's poll() on its sockets, and a
// wait that never ends is the Watchdog's to report.
ssize_t recv_exact(int fd, void *buf, size_t len, std::string *err) {
  auto *p = static_cast<uint8_t *>(buf);
  size_t got = 0;
  while (got < len) {
    const ssize_t n = recv(fd, p + got, len - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      *err = std::string("recv: ") + strerror(errno);
      return -1;
    }
    if (n == 0) {
      if (got == 0) return 0;
      *err = "connection closed in the middle of a message (" + std::to_string(got) + " of " +
             std::to_string(len) + " bytes)";
      return -1;
    }
    got += static_cast<size_t>(n);
  }
  return static_cast<ssize_t>(len);
}

// The client's guard against a wait that never ends (a peer or layer that stopped answering):
// names the stage the client is stuck in and exits 1. A stage may last its own time plus 60 s
// ($SOCKBENCH_WATCHDOG_S) without progress() calls.
class Watchdog {
 public:
  Watchdog() : thread_([this] { run(); }) {}
  ~Watchdog() {
    {
      std::lock_guard lock(mu_);
      done_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }
  void stage(const char *what, double expected_s = 0) {
    std::lock_guard lock(mu_);
    what_ = what;
    limit_s_ = expected_s + slack_s_;
    last_ = now_s();
  }
  // Called from one thread at a time (the ping-pong loop): a relaxed store.
  void progress() { ticks_.fetch_add(1, std::memory_order_relaxed); }

 private:
  void run() {
    std::unique_lock lock(mu_);
    uint64_t seen = 0;
    while (!cv_.wait_for(lock, std::chrono::milliseconds(200), [this] { return done_; })) {
      const uint64_t t = ticks_.load(std::memory_order_relaxed);
      if (t != seen) seen = t, last_ = now_s();
      if (now_s() - last_ > limit_s_)
        die("no progress for %.0f s while %s (the peer or the layer stopped answering)",
            now_s() - last_, what_);
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  const char *what_ = "starting";
  static double env_slack_s() {
    const char *e = getenv("SOCKBENCH_WATCHDOG_S");
    return e ? std::max(atof(e), 0.1) : 60;
  }
  const double slack_s_ = env_slack_s();
  double limit_s_ = slack_s_;
  double last_ = now_s();
  std::atomic<uint64_t> ticks_{0};
  std::thread thread_;  // last: starts once the rest is initialized
};

// The layer's view of a connection; path kPathUnknown when the call fails (kernel TCP).
SdpStats sdp_stats(int fd) {
  SdpStats st{};
  socklen_t len = sizeof st;
  if (getsockopt(fd, IPPROTO_TCP, SOCKBENCH_STATS_OPT, &st, &len) != 0 || len < sizeof(uint32_t)) {
    st = SdpStats{};
    st.path = kPathUnknown;
  }
  return st;
}

const char *path_name(uint32_t path) {
  switch (path) {
    case 0:
      return "tcp";
    case 1:
      return "sdp";
    case 2:
      return "undecided";
    case kPathUnknown:
      return "unknown";
    default:
      return "invalid";
  }
}

void set_nodelay(int fd) {
  const int one = 1;
  // Not fatal: a layer may refuse options it handles itself.
  if (setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) != 0)
    fprintf(stderr, "sockbench: note: setsockopt(TCP_NODELAY): %s\n", strerror(errno));
}

int connect_to(const std::string &host, const std::string &port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo *res = nullptr;
  const int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &res);
  if (rc != 0) die("cannot resolve %s port %s: %s", host.c_str(), port.c_str(), gai_strerror(rc));
  std::string last = "no address";
  for (addrinfo *ai = res; ai; ai = ai->ai_next) {
    const int fd = socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol);
    if (fd < 0) {
      last = std::string("socket: ") + strerror(errno);
      continue;
    }
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) {
      freeaddrinfo(res);
      return fd;
    }
    last = std::string("connect: ") + strerror(errno);
    close(fd);
  }
  freeaddrinfo(res);
  die("cannot connect to %s port %s: %s", host.c_str(), port.c_str(), last.c_str());
}

// Connects and sends the header; waits for the server's ready byte, so that a connection counts
// as set up (the layer's negotiation done) before anything is timed.
int open_conn(const std::string &host, const std::string &port, Kind kind, uint8_t flags,
              uint32_t size) {
  const int fd = connect_to(host, port);
  if (kind == kEcho || (flags & kNoDelay)) set_nodelay(fd);
  const Header h{kMagic, kind, flags, 0, size, 0};
  std::string err;
  char ready = 0;
  if (!send_all(fd, &h, sizeof h, &err)) die("sending the header: %s", err.c_str());
  const ssize_t n = recv_exact(fd, &ready, 1, &err);
  if (n <= 0 || ready != kReady)
    die("the server did not accept the connection: %s", n == 0  ? "closed"
                                                        : n < 0 ? err.c_str()
                                                                : "bad answer");
  return fd;
}

double tv_s(const timeval &tv) {
  return static_cast<double>(tv.tv_sec) + static_cast<double>(tv.tv_usec) * 1e-6;
}

struct Cpu {
  double user = 0, sys = 0;
  static Cpu now() {
    rusage ru{};
    getrusage(RUSAGE_SELF, &ru);
    return {tv_s(ru.ru_utime), tv_s(ru.ru_stime)};
  }
  Cpu operator-(const Cpu &o) const { return {user - o.user, sys - o.sys}; }
};

// The client's end of the control connection.
class Control {
 public:
  Control(const std::string &host, const std::string &port)
      : fd_(open_conn(host, port, kControl, 0, 0)) {}
  ~Control() { close(fd_); }
  void start() { exchange(kStart, nullptr); }
  CpuTrailer end() {
    CpuTrailer t{};
    exchange(kEnd, &t);
    return t;
  }

 private:
  void exchange(char what, CpuTrailer *out) {
    std::string err;
    if (!send_all(fd_, &what, 1, &err)) die("control connection: %s", err.c_str());
    char echo = 0;
    ssize_t n = out ? recv_exact(fd_, out, sizeof *out, &err) : recv_exact(fd_, &echo, 1, &err);
    if (n <= 0 || (!out && echo != what))
      die("control connection: %s", n < 0 ? err.c_str() : n == 0 ? "closed" : "bad answer");
  }
  int fd_;
};

// --- Server --------------------------------------------------------------------------------

std::atomic<bool> g_stop{false};

void on_signal(int) {
  g_stop.store(true);
}

struct ServerState {
  std::mutex mu;
  int active = 0;              // connection threads still running
  uint64_t finished_runs = 0;  // control connections that ended
  std::atomic<uint64_t> errors{0};
};

void serve_sink(int fd, const Header &h, ServerState &st) {
  const size_t rsize = std::max<uint32_t>(h.size, 1);
  const bool verify = h.flags & kVerify;
  Mem buf(rsize);
  std::unique_ptr<Mem> pattern;
  if (verify) {
    pattern = std::make_unique<Mem>(rsize + kPatternPeriod);
    for (size_t i = 0; i < pattern->size; i++) pattern->data[i] = i % kPatternPeriod;
  }
  uint64_t bytes = 0;
  uint32_t bad = 0;
  for (;;) {
    const ssize_t n = recv(fd, buf.data, rsize, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      fprintf(stderr, "sockbench server: sink recv: %s\n", strerror(errno));
      st.errors++;
      return;
    }
    if (n == 0) break;
    if (verify && !bad &&
        memcmp(buf.data, pattern->data + bytes % kPatternPeriod, static_cast<size_t>(n)) != 0) {
      fprintf(stderr,
              "sockbench server: sink: data mismatch in the %zd bytes at offset %" PRIu64 "\n", n,
              bytes);
      bad = 1;
      st.errors++;
    }
    bytes += static_cast<uint64_t>(n);
  }
  const SinkTrailer t{bytes, bad, sdp_stats(fd).path};
  std::string err;
  if (!send_all(fd, &t, sizeof t, &err)) {
    fprintf(stderr, "sockbench server: sink trailer: %s\n", err.c_str());
    st.errors++;
  }
}

void serve_echo(int fd, const Header &h, ServerState &st) {
  if (h.flags & kNoDelay) set_nodelay(fd);
  Mem buf(h.size);
  std::string err;
  for (;;) {
    const ssize_t n = recv_exact(fd, buf.data, h.size, &err);
    if (n == 0) return;
    if (n < 0 || !send_all(fd, buf.data, h.size, &err)) {
      fprintf(stderr, "sockbench server: echo: %s\n", err.c_str());
      st.errors++;
      return;
    }
  }
}

void serve_control(int fd, ServerState &st) {
  Cpu start = Cpu::now();
  uint64_t errors_at_start = st.errors.load();
  std::string err;
  for (;;) {
    char what = 0;
    const ssize_t n = recv_exact(fd, &what, 1, &err);
    if (n == 0) break;
    bool ok = n > 0;
    if (ok && what == kStart) {
      start = Cpu::now();
      errors_at_start = st.errors.load();
      ok = send_all(fd, &what, 1, &err);
    } else if (ok && what == kEnd) {
      const Cpu d = Cpu::now() - start;
      const CpuTrailer t{static_cast<uint64_t>(std::llround(d.user * 1e6)),
                         static_cast<uint64_t>(std::llround(d.sys * 1e6)),
                         st.errors.load() - errors_at_start};
      ok = send_all(fd, &t, sizeof t, &err);
    } else if (ok) {
      err = "unknown control byte";
      ok = false;
    }
    if (!ok) {
      fprintf(stderr, "sockbench server: control: %s\n", err.c_str());
      st.errors++;
      break;
    }
  }
  std::lock_guard lock(st.mu);
  st.finished_runs++;
}

void serve_conn(int fd, ServerState &st) {
  Header h{};
  std::string err;
  const ssize_t n = recv_exact(fd, &h, sizeof h, &err);
  if (n != sizeof h || h.magic != kMagic || h.kind < kSink || h.kind > kControl) {
    fprintf(stderr, "sockbench server: bad connection header: %s\n",
            n < 0    ? err.c_str()
            : n == 0 ? "closed"
                     : "not a sockbench client");
    st.errors++;
  } else if (!send_all(fd, &kReady, 1, &err)) {
    fprintf(stderr, "sockbench server: %s\n", err.c_str());
    st.errors++;
  } else if (h.kind == kSink) {
    serve_sink(fd, h, st);
  } else if (h.kind == kEcho) {
    serve_echo(fd, h, st);
  } else {
    serve_control(fd, st);
  }
  close(fd);
  std::lock_guard lock(st.mu);
  st.active--;
}

int run_server(const std::string &bind_addr, const std::string &port, bool once) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo *res = nullptr;
  const int rc =
      getaddrinfo(bind_addr.empty() ? nullptr : bind_addr.c_str(), port.c_str(), &hints, &res);
  if (rc != 0) die("cannot resolve %s: %s", bind_addr.c_str(), gai_strerror(rc));
  // IPv4 first when no address is given: clients connect to 127.0.0.1.
  addrinfo *ai = res;
  for (addrinfo *a = res; a; a = a->ai_next)
    if (a->ai_family == AF_INET) {
      ai = a;
      break;
    }
  const int lfd = socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol);
  if (lfd < 0) die("socket: %s", strerror(errno));
  const int one = 1;
  setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (bind(lfd, ai->ai_addr, ai->ai_addrlen) != 0)
    die("bind port %s: %s", port.c_str(), strerror(errno));
  freeaddrinfo(res);
  if (listen(lfd, 128) != 0) die("listen: %s", strerror(errno));
  sockaddr_storage ss{};
  socklen_t sl = sizeof ss;
  getsockname(lfd, reinterpret_cast<sockaddr *>(&ss), &sl);
  const int bound =
      ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6 *>(&ss)->sin6_port
                                     : reinterpret_cast<sockaddr_in *>(&ss)->sin_port);
  // The driver reads this line to learn the port (-p 0) and that the server listens.
  printf("sockbench: listening on port %d\n", bound);
  fflush(stdout);

  // No SA_RESTART: poll() returns on SIGTERM, and the server exits normally (the layer's exit
  // handlers run).
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);

  ServerState st;
  for (;;) {
    {
      std::lock_guard lock(st.mu);
      if (once && st.finished_runs > 0) break;
    }
    if (g_stop.load()) break;
    pollfd pfd{lfd, POLLIN, 0};
    const int r = poll(&pfd, 1, 100);
    if (r < 0 && errno != EINTR) die("poll: %s", strerror(errno));
    if (r <= 0) continue;
    const int fd = accept(lfd, nullptr, nullptr);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED || errno == EAGAIN) continue;
      die("accept: %s", strerror(errno));
    }
    {
      std::lock_guard lock(st.mu);
      st.active++;
    }
    std::thread([fd, &st] { serve_conn(fd, st); }).detach();
  }
  close(lfd);
  // Connection threads use `st`: wait for them (briefly, when stopped by a signal).
  const double deadline = now_s() + (g_stop.load() ? 5 : 60);
  for (;;) {
    {
      std::lock_guard lock(st.mu);
      if (st.active == 0) break;
    }
    if (now_s() > deadline) die("connections still open at exit");
    usleep(1000);
  }
  if (st.errors.load()) {
    fprintf(stderr, "sockbench server: %" PRIu64 " connection error(s)\n", st.errors.load());
    return 1;
  }
  return 0;
}

// --- Clients -------------------------------------------------------------------------------

struct ClientOptions {
  std::string host = "127.0.0.1", port;
  size_t size = 0;
  size_t recv_size = 0;
  double seconds = 1;
  int conns = 1;
  std::vector<std::string> legs;  // stream: ZCopy thresholds taking turns ("auto" or bytes)
  double slice = 0.1, legs_warmup = 0.5;
  uint64_t iters = 10000;
  int64_t warmup = -1;
  bool verify = false, nodelay = false;
  std::vector<size_t> sizes;  // refs
  uint64_t pingpong_rounds = 20000;
};

// Sums connection paths: one word if all agree, "mixed" otherwise.
std::string join_paths(const std::vector<uint32_t> &paths) {
  std::string p = paths.empty() ? "unknown" : path_name(paths[0]);
  for (uint32_t x : paths)
    if (std::string(path_name(x)) != p) return "mixed";
  return p;
}

void print_sdp_stats(const std::vector<SdpStats> &v) {
  uint64_t s[5] = {};
  bool any = false;
  for (const SdpStats &x : v) {
    if (x.path == kPathUnknown) continue;
    any = true;
    s[0] += x.bcopy_tx, s[1] += x.bcopy_rx, s[2] += x.zcopy_tx, s[3] += x.zcopy_rx;
    s[4] += x.wzcopy_tx;  // of zcopy_tx: written into buffers the receiver offered
  }
  if (any)
    printf(",\"sdp_stats\":{\"bcopy_tx\":%" PRIu64 ",\"bcopy_rx\":%" PRIu64 ",\"zcopy_tx\":%" PRIu64
           ",\"zcopy_rx\":%" PRIu64 ",\"wzcopy_tx\":%" PRIu64 "}",
           s[0], s[1], s[2], s[3], s[4]);
}

// The thresholds of --legs as setsockopt(SDP_ZCOPY_THRESH) takes them.
// -1 (SDP_ZCOPY_AUTO) for "auto", else bytes; -2 if it is neither.
int leg_threshold(const std::string &leg) {
  if (leg == "auto") return SDP_ZCOPY_AUTO;
  char *end = nullptr;
  errno = 0;
  const long t = strtol(leg.c_str(), &end, 10);
  return leg.empty() || *end || errno || t < 0 || t > INT32_MAX ? -2 : static_cast<int>(t);
}

std::vector<int> leg_thresholds(const std::vector<std::string> &legs) {
  std::vector<int> v;
  v.reserve(legs.size());
  for (const std::string &l : legs) v.push_back(leg_threshold(l));
  return v;
}

// The order of the legs' turns: a round in which every leg follows every other leg exactly
// once (an Euler circuit of the complete directed graph), because a slice pays for what the
// slice before it left (a ring full of the other path's data, its last send still running).
std::vector<size_t> turn_order(size_t legs) {
  if (legs == 1) return {0};
  std::vector<std::vector<size_t>> next(legs);
  for (size_t a = 0; a < legs; a++)
    for (size_t b = legs; b-- > 0;)
      if (b != a) next[a].push_back(b);
  std::vector<size_t> path{0}, circuit;
  while (!path.empty()) {
    const size_t v = path.back();
    if (next[v].empty()) {
      circuit.push_back(v);
      path.pop_back();
    } else {
      path.push_back(next[v].back());
      next[v].pop_back();
    }
  }
  circuit.pop_back();  // the circuit ends where it began
  std::reverse(circuit.begin(), circuit.end());
  return circuit;
}

// The slices of a --legs run: `warm_passes` untimed turns of each leg, the last of them the
// round's last leg (so that the first timed turn follows it as in every round), then rounds
// of turn_order until each leg has had at least `per_leg` timed slices.
struct Slice {
  size_t leg;
  bool timed;
};
std::vector<Slice> plan_slices(size_t legs, size_t warm_passes, size_t per_leg) {
  std::vector<Slice> v;
  if (!legs) return v;
  const std::vector<size_t> round = turn_order(legs);
  for (size_t w = 0; w < warm_passes; w++)
    for (size_t l = 1; l <= legs; l++) v.push_back({(round.back() + l) % legs, false});
  const size_t turns = round.size() / legs;  // of each leg per round
  for (size_t r = 0; r < (per_leg + turns - 1) / turns; r++)
    for (size_t l : round) v.push_back({l, true});
  return v;
}

int run_stream(const ClientOptions &o) {
  const size_t size = o.size;
  const uint32_t rsize =
      static_cast<uint32_t>(o.recv_size ? o.recv_size : std::max<size_t>(size, 256 << 10));
  const uint8_t flags = (o.verify ? kVerify : 0) | (o.nodelay ? kNoDelay : 0);
  const std::vector<int> thresh = leg_thresholds(o.legs);
  const size_t nlegs = thresh.size();
  const size_t per_leg =
      nlegs ? static_cast<size_t>(std::max(1.0, std::ceil(o.seconds / o.slice - 1e-9))) : 0;
  // Untimed first: for about half a second after its start a run is slower here (in runs of
  // one leg against itself, the first timed slices after one untimed pass of 0.2 s came out
  // 2-3% slower than the rest; after 0.6 s, no difference).
  const size_t warm_passes =
      nlegs ? static_cast<size_t>(std::max(
                  1.0, std::ceil(o.legs_warmup / (static_cast<double>(nlegs) * o.slice) - 1e-9)))
            : 0;
  const std::vector<Slice> slices = plan_slices(nlegs, warm_passes, per_leg);
  Watchdog wd;
  wd.stage("connecting");
  Control ctl(o.host, o.port);

  // What one connection moved in one leg's timed slices, and for how long: from its first
  // send in a slice to its first send in the next, so that a send that began in a slice
  // counts there whole, with its time.
  struct LegCount {
    uint64_t bytes = 0, bcopy_tx = 0, zcopy_tx = 0;
    double secs = 0;
  };
  struct Conn {
    int fd = -1;
    uint64_t sent = 0;
    SinkTrailer trailer{};
    SdpStats stats{};
    std::vector<LegCount> legs;
    std::string err;
  };
  std::vector<Conn> conns(static_cast<size_t>(o.conns));
  for (Conn &c : conns) {
    c.fd = open_conn(o.host, o.port, kSink, flags, rsize);
    c.legs.resize(nlegs);
  }

  std::atomic<int> ready{0};
  std::atomic<bool> go{false}, stop{false}, failed{false};
  std::atomic<size_t> slice_now{0};  // index into `slices` (with --legs)
  std::vector<std::thread> threads;
  for (Conn &c : conns) {
    threads.emplace_back([&, &c = c] {
      // With --verify, the write at stream offset o starts at pattern offset o % period.
      Mem buf(size + (o.verify ? kPatternPeriod : 0));
      if (o.verify)
        for (size_t i = 0; i < buf.size; i++) buf.data[i] = i % kPatternPeriod;
      ready++;
      while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
      // A send counts for the slice it began in; the layer's counters are read at each turn.
      size_t k = SIZE_MAX;
      SdpStats at_turn{};
      double turned = 0;
      auto close_slice = [&](const SdpStats &now, double t) {
        if (k == SIZE_MAX || !slices[k].timed) return;
        LegCount &lc = c.legs[slices[k].leg];
        lc.bcopy_tx += now.bcopy_tx - at_turn.bcopy_tx;
        lc.zcopy_tx += now.zcopy_tx - at_turn.zcopy_tx;
        lc.secs += t - turned;
      };
      // At least one write per connection, however late this thread gets a core.
      bool ok = true;
      do {
        if (nlegs) {
          const size_t n = slice_now.load(std::memory_order_acquire);
          if (n != k) {
            const SdpStats now = sdp_stats(c.fd);
            const double t = now_s();
            close_slice(now, t);
            if (k == SIZE_MAX || slices[n].leg != slices[k].leg) {
              const int th = thresh[slices[n].leg];
              if (setsockopt(c.fd, IPPROTO_TCP, SDP_ZCOPY_THRESH, &th, sizeof th) != 0) {
                c.err = std::string("setsockopt(SDP_ZCOPY_THRESH): ") + strerror(errno) +
                        " (--legs needs the layer: run under pcientb-sdp)";
                ok = false;
                break;
              }
            }
            k = n, at_turn = now, turned = t;
          }
        }
        ok = send_all(c.fd, buf.data + (o.verify ? c.sent % kPatternPeriod : 0), size, &c.err);
        if (ok) {
          c.sent += size;
          if (nlegs && slices[k].timed) c.legs[slices[k].leg].bytes += size;
        }
      } while (ok && !stop.load(std::memory_order_relaxed));
      if (ok && nlegs) close_slice(sdp_stats(c.fd), now_s());
      // The server counts until EOF, then answers with its count.
      if (ok && shutdown(c.fd, SHUT_WR) != 0) {
        c.err = std::string("shutdown(SHUT_WR): ") + strerror(errno);
        ok = false;
      }
      if (ok) {
        const ssize_t n = recv_exact(c.fd, &c.trailer, sizeof c.trailer, &c.err);
        if (n == 0) c.err = "the server closed without its byte count";
        if (n <= 0) ok = false;
      }
      if (ok) c.stats = sdp_stats(c.fd);
      if (!ok && c.err.empty()) c.err = "failed";
      if (!ok) failed = true;
    });
  }
  while (ready.load() < o.conns) std::this_thread::yield();

  auto sleep_until = [](double until) {
    for (double left; (left = until - now_s()) > 0;) {
      const timespec ts{static_cast<time_t>(left),
                        static_cast<long>((left - std::floor(left)) * 1e9)};
      nanosleep(&ts, nullptr);
    }
  };
  ctl.start();
  const double planned = nlegs ? static_cast<double>(slices.size()) * o.slice : o.seconds;
  wd.stage("streaming", planned);
  const Cpu cpu0 = Cpu::now();
  const double t0 = now_s();
  go.store(true, std::memory_order_release);
  if (nlegs) {
    for (size_t n = 0; n < slices.size() && !failed.load(); n++) {
      if (n) slice_now.store(n, std::memory_order_release);
      sleep_until(t0 + static_cast<double>(n + 1) * o.slice);
    }
  } else {
    sleep_until(t0 + o.seconds);
  }
  stop.store(true, std::memory_order_relaxed);
  wd.stage(
      "finishing the last send() and waiting for the server's byte counts "
      "(after shutdown(SHUT_WR))");
  for (std::thread &t : threads) t.join();
  const double secs = now_s() - t0;
  const Cpu cpu = Cpu::now() - cpu0;
  // A failed connection explains a failed control exchange better than the other way round.
  for (size_t i = 0; i < conns.size(); i++)
    if (!conns[i].err.empty()) die("stream connection %zu: %s", i, conns[i].err.c_str());
  wd.stage("waiting for the server's CPU time");
  const CpuTrailer srv = ctl.end();

  uint64_t bytes = 0;
  std::vector<uint32_t> paths;
  std::vector<SdpStats> stats;
  for (size_t i = 0; i < conns.size(); i++) {
    Conn &c = conns[i];
    if (c.trailer.verify_errors) die("stream connection %zu: the server received wrong data", i);
    if (c.trailer.bytes != c.sent)
      die("stream connection %zu: sent %" PRIu64 " bytes, the server received %" PRIu64, i, c.sent,
          c.trailer.bytes);
    bytes += c.trailer.bytes;
    paths.push_back(c.stats.path);
    stats.push_back(c.stats);
    close(c.fd);
  }
  if (srv.errors) die("the server reported %" PRIu64 " connection error(s)", srv.errors);
  const double srv_cpu =
      (static_cast<double>(srv.user_us) + static_cast<double>(srv.sys_us)) * 1e-6;
  const double total_cpu = cpu.user + cpu.sys + srv_cpu;
  printf("{\"mode\":\"stream\",\"size\":%zu,\"recv_size\":%u,\"conns\":%d,\"bytes\":%" PRIu64
         ",\"seconds\":%.6f,\"MBps\":%.3f,\"cpu_user_s\":%.6f,\"cpu_sys_s\":%.6f,"
         "\"server_cpu_user_s\":%.6f,\"server_cpu_sys_s\":%.6f,\"cpu_s_per_GB\":%.6g,"
         "\"verified\":%s,\"path\":\"%s\"",
         size, rsize, o.conns, bytes, secs, static_cast<double>(bytes) / secs / 1e6, cpu.user,
         cpu.sys, static_cast<double>(srv.user_us) * 1e-6, static_cast<double>(srv.sys_us) * 1e-6,
         total_cpu / (static_cast<double>(bytes) / 1e9), o.verify ? "true" : "false",
         join_paths(paths).c_str());
  print_sdp_stats(stats);
  if (nlegs) {
    printf(R"(,"slice_s":%.3f,"legs":[)", o.slice);
    for (size_t l = 0; l < nlegs; l++) {
      // The connections' rates add up; seconds: the connections' mean.
      LegCount sum;
      double rate = 0;
      for (const Conn &c : conns) {
        const LegCount &lc = c.legs[l];
        sum.bytes += lc.bytes;
        sum.bcopy_tx += lc.bcopy_tx;
        sum.zcopy_tx += lc.zcopy_tx;
        sum.secs += lc.secs / static_cast<double>(conns.size());
        if (lc.secs > 0) rate += static_cast<double>(lc.bytes) / lc.secs;
      }
      printf("%s{\"thresh\":\"%s\",\"seconds\":%.6f,\"bytes\":%" PRIu64
             ",\"MBps\":%.3f,\"bcopy_tx\":%" PRIu64 ",\"zcopy_tx\":%" PRIu64 "}",
             l ? "," : "", o.legs[l].c_str(), sum.secs, sum.bytes, rate / 1e6, sum.bcopy_tx,
             sum.zcopy_tx);
    }
    printf("]");
  }
  printf("}\n");
  return 0;
}

double percentile(const std::vector<double> &sorted, double q) {
  const size_t i = static_cast<size_t>(std::ceil(q * static_cast<double>(sorted.size())));
  return sorted[std::min(sorted.size() - 1, i == 0 ? 0 : i - 1)];
}

int run_pingpong(const ClientOptions &o) {
  const size_t size = o.size;
  Watchdog wd;
  wd.stage("connecting");
  Control ctl(o.host, o.port);
  const int fd = open_conn(o.host, o.port, kEcho, kNoDelay, static_cast<uint32_t>(size));
  Mem out(size), in(size);
  std::string err;
  // Each message carries its sequence number at both ends, checked in the echo: a reordered,
  // stale or torn message fails the run.
  auto stamp = [&](uint64_t seq) {
    if (size >= 8) {
      memcpy(out.data, &seq, 8);
      memcpy(out.data + size - 8, &seq, 8);
    } else {
      out.data[0] = static_cast<uint8_t>(seq);
    }
  };
  auto round_trip = [&](uint64_t seq) {
    stamp(seq);
    if (!send_all(fd, out.data, size, &err)) die("pingpong: %s", err.c_str());
    const ssize_t n = recv_exact(fd, in.data, size, &err);
    if (n <= 0) die("pingpong: %s", n == 0 ? "the server closed the connection" : err.c_str());
    wd.progress();
    if (memcmp(in.data, out.data, std::min<size_t>(size, 8)) != 0 ||
        (size >= 8 && memcmp(in.data + size - 8, out.data + size - 8, 8) != 0))
      die("pingpong: round trip %" PRIu64 " came back with other data", seq);
  };
  const uint64_t warmup =
      o.warmup >= 0 ? static_cast<uint64_t>(o.warmup) : std::max<uint64_t>(o.iters / 10, 100);
  uint64_t seq = 0;
  wd.stage("in a round trip (echo)");
  for (uint64_t i = 0; i < warmup; i++) round_trip(++seq);

  ctl.start();
  std::vector<double> rtt(o.iters);
  const Cpu cpu0 = Cpu::now();
  const double t0 = now_s();
  for (uint64_t i = 0; i < o.iters; i++) {
    const double a = now_s();
    round_trip(++seq);
    rtt[i] = now_s() - a;
  }
  const double secs = now_s() - t0;
  const Cpu cpu = Cpu::now() - cpu0;
  const SdpStats st = sdp_stats(fd);
  close(fd);
  wd.stage("waiting for the server's CPU time");
  const CpuTrailer srv = ctl.end();
  if (srv.errors) die("the server reported %" PRIu64 " connection error(s)", srv.errors);
  std::sort(rtt.begin(), rtt.end());
  double sum = 0;
  for (double x : rtt) sum += x;
  printf("{\"mode\":\"pingpong\",\"size\":%zu,\"iters\":%" PRIu64 ",\"warmup\":%" PRIu64
         ",\"seconds\":%.6f,\"lat_us_median\":%.4f,\"lat_us_p99\":%.4f,\"lat_us_mean\":%.4f,"
         "\"lat_us_min\":%.4f,\"cpu_user_s\":%.6f,\"cpu_sys_s\":%.6f,\"server_cpu_user_s\":%.6f,"
         "\"server_cpu_sys_s\":%.6f,\"path\":\"%s\"",
         size, o.iters, warmup, secs, percentile(rtt, 0.5) / 2 * 1e6,
         percentile(rtt, 0.99) / 2 * 1e6, sum / static_cast<double>(rtt.size()) / 2 * 1e6,
         rtt.front() / 2 * 1e6, cpu.user, cpu.sys, static_cast<double>(srv.user_us) * 1e-6,
         static_cast<double>(srv.sys_us) * 1e-6, path_name(st.path));
  print_sdp_stats({st});
  printf("}\n");
  return 0;
}

// --- References ----------------------------------------------------------------------------

int run_refs(const ClientOptions &o) {
  using pcientb::bench::Buffer;
  // The ping-pong child first, before the large buffers exist.
  std::string err;
  std::unique_ptr<pcientb::bench::ShmPingPong> pp = pcientb::bench::ShmPingPong::start(&err);
  if (!pp) die("cannot start the ping-pong reference: %s", err.c_str());
  std::vector<double> samples;
  if (pp->half_rtt(std::max<uint64_t>(o.pingpong_rounds / 100, 1), 100, &samples) < 0)
    die("the ping-pong reference child stopped answering");
  pp->sleep();
  std::sort(samples.begin(), samples.end());
  printf(
      "{\"mode\":\"shm_pingpong\",\"rounds\":%zu,\"half_rtt_us\":%.4f,\"half_rtt_us_min\":%.4f}\n",
      samples.size() * 100, percentile(samples, 0.5) / 2 * 1e6, samples.front() / 2 * 1e6);
  fflush(stdout);

  size_t biggest = 1;
  for (size_t s : o.sizes) biggest = std::max(biggest, s);
  Buffer src(biggest), dst(biggest);
  if (!src || !dst) die("cannot map two buffers of %zu bytes", biggest);
  for (size_t s : o.sizes) {
    // As pcientb-perf: chunks of about 32 MiB, an untimed warm-up, then chunks for the budget.
    const uint64_t count = std::clamp<uint64_t>((size_t{32} << 20) / s, 1, 1 << 20);
    pcientb::bench::time_memcpy(dst, src, s, std::min<uint64_t>(count, 64));
    double t = 0;
    uint64_t bytes = 0;
    while (t < o.seconds) {
      t += pcientb::bench::time_memcpy(dst, src, s, count);
      bytes += count * s;
    }
    printf("{\"mode\":\"memcpy\",\"size\":%zu,\"MBps\":%.3f}\n", s,
           static_cast<double>(bytes) / t / 1e6);
  }
  return 0;
}

// --- Command line --------------------------------------------------------------------------

// Sizes: bytes, or with a binary suffix (4K = 4096, also KiB, M, MiB, G, GiB); 1 .. 1 GiB.
template <typename T>  // size_t, or a vector of them
CLI::Option *size_option(CLI::App *app, const char *name, T *v, const char *what) {
  return app->add_option(name, *v, what)
      ->option_text("SIZE")
      ->transform(CLI::AsSizeValue(false))
      ->check(CLI::Range(size_t{1}, size_t{1} << 30).description("1 .. 1 GiB"));
}

CLI::Validator positive_seconds() {
  return CLI::Validator(
      [](std::string &v) {
        char *end = nullptr;
        const double s = strtod(v.c_str(), &end);
        return *end == 0 && s > 0 && std::isfinite(s) ? std::string()
                                                      : "not a positive number of seconds: " + v;
      },
      "SECONDS > 0");
}

}  // namespace

int main(int argc, char **argv) {
  // A peer that closes early must give an error message, not a silent SIGPIPE death.
  signal(SIGPIPE, SIG_IGN);
  ClientOptions o;
  std::string bind_addr;
  bool once = false;
  CLI::App app{
      "A plain-socket benchmark: run it under pcientb-sdp for the SDP layer, without for kernel "
      "TCP. One JSON line per result on stdout.",
      "sockbench"};
  app.require_subcommand(1);
  app.footer("Sizes take a K, M or G suffix (binary: 4K = 4096; KiB.. too). Bad values: exit 2.");

  CLI::App *server = app.add_subcommand(
      "server",
      "Serve each connection in a thread (stream sink or echo, as the client asks); prints "
      "'sockbench: listening on port N'");
  server->add_option("-p", o.port, "Port; 0 picks a free one")->required();
  server->add_option("-b", bind_addr, "Address to bind (default: any)");
  server->add_flag("--once", once, "Exit after one finished client run (else until SIGTERM)");

  CLI::App *stream = app.add_subcommand(
      "stream",
      "CONNS connections, each a thread sending WRITE_SIZE bytes per blocking send() for "
      "SECONDS; the server counts the bytes and reports its CPU time");
  CLI::App *pingpong = app.add_subcommand(
      "pingpong",
      "One connection, SIZE-byte echo round trips after WARMUP untimed ones; median, "
      "p99, mean and min of RTT/2 in us");
  for (CLI::App *c : {stream, pingpong}) {
    c->add_option("-c", o.host, "Server host")->required();
    c->add_option("-p", o.port, "Server port")->required();
    size_option(c, "-s", &o.size, "Bytes per send() (stream) or per message (pingpong)")
        ->required();
  }
  stream->add_option("-t", o.seconds, "Seconds to send")->required()->check(positive_seconds());
  stream->add_option("-n", o.conns, "Connections")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  size_option(stream, "-r", &o.recv_size, "The server's recv() size (default max(SIZE, 256 KiB))");
  stream->add_flag("--verify", o.verify, "The server checks the data (costs CPU)");
  stream->add_flag("--nodelay", o.nodelay, "TCP_NODELAY");
  CLI::Option *legs_opt =
      stream
          ->add_option("--legs", o.legs,
                       "ZCopy thresholds of the layer that take turns on the same connections, a "
                       "slice at a time (auto, or bytes: 0 = BCopy only, 1 = every send ZCopy); "
                       "each gets SECONDS of timed slices after --warmup; MB/s per leg")
          ->delimiter(',')
          ->check(CLI::Validator(
              [](std::string &v) {
                return leg_threshold(v) >= SDP_ZCOPY_AUTO
                           ? std::string()
                           : "not a threshold: " + v + " (auto, or bytes: 0 = BCopy only)";
              },
              "THRESH"));
  stream->add_option("--slice", o.slice, "Seconds of one slice of --legs")
      ->check(positive_seconds())
      ->capture_default_str()
      ->needs(legs_opt);
  stream
      ->add_option("--warmup", o.legs_warmup,
                   "Untimed seconds of --legs first (whole turns of every leg, at least one)")
      ->check(CLI::Range(0.0, 3600.0))
      ->capture_default_str()
      ->needs(legs_opt);
  pingpong->add_option("-i", o.iters, "Timed round trips")
      ->required()
      ->check(CLI::Range(uint64_t{1}, uint64_t{1} << 40));
  pingpong->add_option("-w", o.warmup, "Untimed round trips first (default max(ITERS/10, 100))")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));

  CLI::App *refs = app.add_subcommand(
      "refs",
      "The same-run references of bench/references.hpp: memcpy bandwidth per SIZE and the "
      "shared-memory ping-pong half RTT");
  size_option(refs, "-s", &o.sizes, "A memcpy size (repeatable; default 4M)");
  refs->add_option("-t", o.seconds, "Seconds per memcpy size (default 0.2)")
      ->check(positive_seconds());
  refs->add_option("--pingpong-rounds", o.pingpong_rounds, "Ping-pong round trips")
      ->check(CLI::Range(uint64_t{1}, uint64_t{1} << 40))
      ->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError &e) {
    return app.exit(e) == 0 ? 0 : 2;
  }

  if (server->parsed()) return run_server(bind_addr, o.port, once);
  if (stream->parsed()) {
    if (!o.legs.empty() &&
        (o.seconds / o.slice > 1e6 || o.legs_warmup / o.slice > 1e6 || o.legs.size() > 64)) {
      fprintf(stderr,
              "sockbench: --legs: at most 64 legs and 10^6 slices each (-t and "
              "--warmup over --slice)\n");
      return 2;
    }
    return run_stream(o);
  }
  if (pingpong->parsed()) return run_pingpong(o);
  if (o.sizes.empty()) o.sizes = {size_t{4} << 20};
  if (!refs->count("-t")) o.seconds = 0.2;
  return run_refs(o);
}
