#include "references.hpp"

#include <sched.h>
#include <sys/mman.h>
#include <sys/prctl.h>
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

// The two flags sit on separate cache lines so each side writes only its own.
struct ShmPingPong::Flags {
  alignas(64) std::atomic<uint64_t> ping;
  alignas(64) std::atomic<uint64_t> pong;
};
static_assert(offsetof(ShmPingPong::Flags, pong) == 64);
static_assert(std::atomic<uint64_t>::is_always_lock_free);

namespace {
constexpr uint64_t kStop = ~uint64_t{0};
constexpr double kAnswerTimeout_s = 5;
}  // namespace

std::unique_ptr<ShmPingPong> ShmPingPong::start(std::string *err) {
  void *page =
      mmap(nullptr, sizeof(Flags), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (page == MAP_FAILED) {
    *err = std::string("mmap(MAP_SHARED): ") + strerror(errno);
    return nullptr;
  }
  auto *flags = new (page) Flags{};
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    *err = std::string("fork: ") + strerror(errno);
    munmap(page, sizeof(Flags));
    return nullptr;
  }
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(1);
    uint64_t seen = 0;
    SpinWait wait(-1);
    for (;;) {
      const uint64_t v = flags->ping.load(std::memory_order_acquire);
      if (v == seen) {
        wait.expired();
        continue;
      }
      if (v == kStop) _exit(0);
      seen = v;
      flags->pong.store(v, std::memory_order_release);
      wait.progress();
    }
  }
  return std::unique_ptr<ShmPingPong>(new ShmPingPong(flags, pid));
}

ShmPingPong::~ShmPingPong() {
  flags_->ping.store(kStop, std::memory_order_release);
  const double deadline = now_s() + 1;
  int status;
  while (waitpid(pid_, &status, WNOHANG) == 0) {
    if (now_s() > deadline) {
      kill(pid_, SIGKILL);
      waitpid(pid_, &status, 0);
      break;
    }
    usleep(100);
  }
  munmap(flags_, sizeof(Flags));
}

double ShmPingPong::round_trip() {
  const uint64_t s = ++seq_;
  SpinWait wait(kAnswerTimeout_s);
  const double t0 = now_s();
  flags_->ping.store(s, std::memory_order_release);
  while (flags_->pong.load(std::memory_order_acquire) != s)
    if (wait.expired()) return -1;
  return now_s() - t0;
}

}  // namespace pcientb::bench
