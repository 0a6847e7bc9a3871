#include "references.hpp"

#include <linux/futex.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <new>

namespace pcientb::bench {

double now_s() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

void reap_child(pid_t pid, double timeout_s) {
  const double deadline = now_s() + timeout_s;
  int status;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (now_s() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return;
    }
    usleep(100);
  }
}

bool SpinWait::slow_check() {
  const double now = now_s();
  if (since_ == 0) since_ = now;
  const double waited = now - since_;
  if (waited > 20e-6) sched_yield();
  return timeout_s_ >= 0 && waited > timeout_s_;
}

Buffer::Buffer(size_t size) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t len = (size + page - 1) / page * page;
  void *p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return;
  // The benchmark forks peers while buffers live; they need none of them, and copy-on-write
  // faults would land in the timed loops.
  madvise(p, len, MADV_DONTFORK);
  memset(p, 0x5a, len);
  data_ = static_cast<uint8_t *>(p);
  size_ = len;
}

Buffer::~Buffer() {
  if (data_) munmap(data_, size_);
}

double time_memcpy(const Buffer &dst, const Buffer &src, size_t size, uint64_t count) {
  uint8_t *d = dst.data();
  const uint8_t *s = src.data();
  const double t0 = now_s();
  for (uint64_t i = 0; i < count; i++) {
    memcpy(d, s, size);
    // Keep the copy: the compiler may not drop or merge it.
    asm volatile("" : : "r"(d) : "memory");
  }
  return now_s() - t0;
}

// The two flags sit on separate cache lines so each side writes only its own; `awake` is the
// futex the child sleeps on between measurements.
struct ShmPingPong::Flags {
  alignas(64) std::atomic<uint64_t> ping;
  alignas(64) std::atomic<uint64_t> pong;
  alignas(64) std::atomic<uint32_t> awake;
};
static_assert(offsetof(ShmPingPong::Flags, pong) == 64);
static_assert(offsetof(ShmPingPong::Flags, awake) == 128);
static_assert(std::atomic<uint64_t>::is_always_lock_free);
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t));

namespace {

constexpr uint64_t kStop = ~uint64_t{0};
constexpr uint64_t kSleep = kStop - 1;
constexpr double kAnswerTimeout_s = 5;

// Shared (not FUTEX_PRIVATE) futex operations: the page is shared between processes.
void futex_wait(std::atomic<uint32_t> *word, uint32_t value) {
  syscall(SYS_futex, reinterpret_cast<uint32_t *>(word), FUTEX_WAIT, value, nullptr, nullptr, 0);
}
void futex_wake(std::atomic<uint32_t> *word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t *>(word), FUTEX_WAKE, 1, nullptr, nullptr, 0);
}

// The child: answers every new ping; after answering kSleep it blocks until `awake` is set again.
[[noreturn]] void answer_pings(ShmPingPong::Flags *flags) {
  uint64_t seen = kSleep;
  SpinWait wait(-1);
  for (;;) {
    const uint64_t v = flags->ping.load(std::memory_order_acquire);
    if (v == seen) {
      if (v != kSleep)
        wait.expired();
      else if (flags->awake.load(std::memory_order_acquire) == 0)
        futex_wait(&flags->awake, 0);
      continue;
    }
    if (v == kStop) _exit(0);
    seen = v;
    flags->pong.store(v, std::memory_order_release);
    wait.progress();
  }
}

}  // namespace

std::unique_ptr<ShmPingPong> ShmPingPong::start(std::string *err) {
  void *page =
      mmap(nullptr, sizeof(Flags), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (page == MAP_FAILED) {
    *err = std::string("mmap(MAP_SHARED): ") + strerror(errno);
    return nullptr;
  }
  auto *flags = new (page) Flags{};
  flags->ping.store(kSleep);  // the child starts asleep
  flags->pong.store(kSleep);
  const pid_t parent = getpid();
  fflush(nullptr);
  const pid_t pid = fork();
  if (pid < 0) {
    *err = std::string("fork: ") + strerror(errno);
    munmap(page, sizeof(Flags));
    return nullptr;
  }
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(1);
    answer_pings(flags);
  }
  return std::unique_ptr<ShmPingPong>(new ShmPingPong(flags, pid));
}

ShmPingPong::~ShmPingPong() {
  flags_->ping.store(kStop, std::memory_order_release);
  flags_->awake.store(1, std::memory_order_release);
  futex_wake(&flags_->awake);
  reap_child(pid_, 1);
  munmap(flags_, sizeof(Flags));
}

double ShmPingPong::round_trips(uint64_t n) {
  if (!awake_) {
    flags_->awake.store(1, std::memory_order_release);
    futex_wake(&flags_->awake);
    awake_ = true;
  }
  const double t0 = now_s();
  for (uint64_t i = 0; i < n; i++) {
    const uint64_t s = ++seq_;
    SpinWait wait(kAnswerTimeout_s);
    flags_->ping.store(s, std::memory_order_release);
    while (flags_->pong.load(std::memory_order_acquire) != s)
      if (wait.expired()) return -1;
  }
  return now_s() - t0;
}

double ShmPingPong::half_rtt(uint64_t batches, uint64_t per_batch, std::vector<double> *samples) {
  if (round_trips(1000) < 0) return -1;  // wakes the child and warms both sides up
  double total = 0;
  for (uint64_t i = 0; i < batches; i++) {
    const double t = round_trips(per_batch);
    if (t < 0) return -1;
    total += t;
    if (samples) samples->push_back(t / static_cast<double>(per_batch));
  }
  return total / static_cast<double>(batches * per_batch) / 2;
}

void ShmPingPong::sleep() {
  if (!awake_) return;
  flags_->ping.store(kSleep, std::memory_order_release);
  SpinWait wait(kAnswerTimeout_s);
  while (flags_->pong.load(std::memory_order_acquire) != kSleep)
    if (wait.expired()) break;
  flags_->awake.store(0, std::memory_order_release);
  awake_ = false;
}

}  // namespace pcientb::bench
