#include "controller.hpp"

#include "directory.hpp"
#include "pattern.hpp"
#include "report.hpp"
#include "worker.hpp"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace stress {
namespace {

constexpr uint64_t kTickUs = 10000;
constexpr uint64_t kProgressNs = 5000 * kMs;

class Controller {
 public:
  explicit Controller(const Options &opt)
      : opt_(opt), dir_(create_directory(opt.procs)), rng_(mix(opt.seed ^ 0xc0117011e5ull)) {}
  int run();

 private:
  struct Proc {
    pid_t pid = 0;
    uint64_t respawn_ns = 0;  // when a dead slot gets its replacement
  };

  void spawn(int slot);
  void reap();
  void respawn_due();
  void maybe_kill();
  void check_hangs();
  void maybe_stop();
  void progress(bool force);
  bool any_running() const;
  void kill_slot(int slot);
  Life life(int slot) const {
    return static_cast<Life>(dir_->slots[slot].life.load(std::memory_order_acquire));
  }

  Options opt_;
  Directory *dir_;
  Rng rng_;
  Proc procs_[kMaxProcs];
  uint64_t start_ns_ = 0, next_kill_ns_ = 0, next_progress_ns_ = 0, drain_deadline_ns_ = 0;
};

int Controller::run() {
  setenv("PCIENTB_FABRIC", opt_.fabric.c_str(), 1);
  print_header(opt_);
  start_ns_ = now_ns();
  next_progress_ns_ = start_ns_ + kProgressNs;
  if (opt_.kill_ms > 0)
    next_kill_ns_ = start_ns_ + static_cast<uint64_t>(rng_.exponential(opt_.kill_ms) * kMs);
  for (int s = 0; s < opt_.procs; ++s) spawn(s);
  for (;;) {
    reap();
    auto phase = static_cast<RunPhase>(dir_->phase.load());
    if (phase == RunPhase::kRun) {
      respawn_due();
      maybe_kill();
      maybe_stop();
    } else if (!any_running()) {
      break;
    } else if (now_ns() > drain_deadline_ns_) {
      for (int s = 0; s < opt_.procs; ++s) {
        if (!procs_[s].pid) continue;
        bump(dir_->hung_workers);
        std::fprintf(stderr, "pcientb-stress: w%d.g%u did not finish the drain; waiting for: %s\n",
                     s, dir_->slots[s].generation.load(), dir_->slots[s].waiting);
        kill_slot(s);
      }
    }
    check_hangs();
    progress(false);
    usleep(kTickUs);
  }
  double seconds = (now_ns() - start_ns_) / 1e9;
  return print_report(*dir_, opt_, seconds);
}

void Controller::spawn(int slot) {
  WorkerSlot &s = dir_->slots[slot];
  uint32_t gen = s.generation.load() + 1;
  s.heartbeat_ns.store(now_ns());
  s.accepting.store(0);
  s.generation.store(gen, std::memory_order_release);
  s.life.store(static_cast<uint32_t>(Life::kStarting), std::memory_order_release);
  std::fflush(stdout);
  std::fflush(stderr);
  pid_t pid = fork();
  if (pid < 0) {
    std::perror("pcientb-stress: fork");
    std::exit(1);
  }
  if (pid == 0) {
    s.pid.store(getpid());
    int status = run_worker(*dir_, opt_, slot, gen);
    std::fflush(stderr);
    std::exit(status);
  }
  s.pid.store(pid);
  procs_[slot] = Proc{pid, 0};
  bump(dir_->started);
}

void Controller::reap() {
  int status;
  pid_t pid;
  while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
    int slot = -1;
    for (int s = 0; s < opt_.procs; ++s)
      if (procs_[s].pid == pid) slot = s;
    if (slot < 0) continue;
    WorkerSlot &s = dir_->slots[slot];
    Life l = life(slot);
    bool finished = WIFEXITED(status) && WEXITSTATUS(status) == 0 && l == Life::kDone;
    if (l != Life::kDying && !finished) {
      bump(dir_->crashes);
      bump(s.counters.anomalies[static_cast<int>(Anomaly::kWorkerCrash)]);
      if (WIFSIGNALED(status)) {
        std::fprintf(stderr, "pcientb-stress: w%d.g%u (pid %d) died of signal %d (%s)\n", slot,
                     s.generation.load(), pid, WTERMSIG(status), strsignal(WTERMSIG(status)));
      } else {
        std::fprintf(stderr, "pcientb-stress: w%d.g%u (pid %d) exited with status %d\n", slot,
                     s.generation.load(), pid, WEXITSTATUS(status));
      }
    }
    if (!finished) s.life.store(static_cast<uint32_t>(Life::kDead), std::memory_order_release);
    procs_[slot].pid = 0;
    procs_[slot].respawn_ns = now_ns() + (50 + rng_.below(200)) * kMs;
  }
}

void Controller::respawn_due() {
  uint64_t now = now_ns();
  for (int s = 0; s < opt_.procs; ++s)
    if (!procs_[s].pid && now >= procs_[s].respawn_ns) spawn(s);
}

// The directory says "dying" before the signal is sent, so a peer whose
// WR fails because of it finds the cause.
void Controller::kill_slot(int slot) {
  dir_->slots[slot].life.store(static_cast<uint32_t>(Life::kDying), std::memory_order_release);
  kill(procs_[slot].pid, SIGKILL);
}

void Controller::maybe_kill() {
  uint64_t now = now_ns();
  if (opt_.kill_ms <= 0 || now < next_kill_ns_) return;
  next_kill_ns_ = now + static_cast<uint64_t>(rng_.exponential(opt_.kill_ms) * kMs);
  int ready[kMaxProcs], n = 0;
  for (int s = 0; s < opt_.procs; ++s)
    if (procs_[s].pid && life(s) == Life::kReady) ready[n++] = s;
  if (n == 0) return;
  int victim = ready[rng_.below(n)];
  kill_slot(victim);
  bump(dir_->kills);
  if (opt_.verbose)
    std::fprintf(stderr, "pcientb-stress: SIGKILL w%d.g%u (pid %d)\n", victim,
                 dir_->slots[victim].generation.load(), procs_[victim].pid);
}

void Controller::check_hangs() {
  uint64_t now = now_ns();
  for (int s = 0; s < opt_.procs; ++s) {
    Life l = life(s);
    if (!procs_[s].pid || (l != Life::kStarting && l != Life::kReady && l != Life::kDraining))
      continue;
    WorkerSlot &w = dir_->slots[s];
    uint64_t beat = w.heartbeat_ns.load(std::memory_order_relaxed);
    if (now < beat || now - beat < static_cast<uint64_t>(opt_.hang_ms) * kMs) continue;
    bump(dir_->hung_workers);
    std::fprintf(stderr,
                 "pcientb-stress: w%d.g%u (pid %d) hung: no heartbeat for %.1f s, in %s (%u); "
                 "oldest wait: %s\n",
                 s, w.generation.load(), procs_[s].pid, (now - beat) / 1e9,
                 doing_name(static_cast<Doing>(w.doing.load())), w.doing_arg.load(), w.waiting);
    kill_slot(s);
  }
}

void Controller::maybe_stop() {
  uint64_t now = now_ns();
  bool time_up = opt_.seconds > 0 && now - start_ns_ >= static_cast<uint64_t>(opt_.seconds * 1e9);
  bool ops_done = opt_.ops > 0 && get(dir_->ops_posted) >= opt_.ops;
  if (!time_up && !ops_done) return;
  dir_->phase.store(static_cast<uint32_t>(RunPhase::kDrain), std::memory_order_release);
  drain_deadline_ns_ = now + 3ull * opt_.hang_ms * kMs;
  // Slots waiting for a replacement stay empty: the drain needs no newcomers.
  if (!opt_.quiet) progress(true);
}

bool Controller::any_running() const {
  for (int s = 0; s < opt_.procs; ++s)
    if (procs_[s].pid) return true;
  return false;
}

void Controller::progress(bool force) {
  uint64_t now = now_ns();
  if (opt_.quiet || (!force && now < next_progress_ns_)) return;
  next_progress_ns_ = now + kProgressNs;
  print_progress(*dir_, (now - start_ns_) / 1e9);
}

}  // namespace

int run_controller(const Options &opt) {
  return Controller(opt).run();
}

}  // namespace stress
