#include "fabric/work.hpp"

#include <ctime>
#include <mutex>
#include <vector>

namespace pcientb::fabric {
namespace {
// Never destroyed: threads may count while the process exits, and a leak
// checker sees the slots reachable. A thread's slot outlives it.
std::mutex &work_mu = *new std::mutex;
std::vector<WorkSlot *> &work_slots = *new std::vector<WorkSlot *>;
}  // namespace

thread_local WorkSlot *work_slot __attribute__((tls_model("initial-exec"))) = nullptr;

// A thread's first count: out of line, so that a count is a few instructions.
__attribute__((noinline)) WorkSlot *new_work_slot() {
  work_slot = new WorkSlot;
  std::lock_guard<std::mutex> g(work_mu);
  work_slots.push_back(work_slot);
  return work_slot;
}

Work work_done() {
  uint64_t v[kWorkKinds] = {};
  std::lock_guard<std::mutex> g(work_mu);
  for (const WorkSlot *s : work_slots)
    for (int k = 0; k < kWorkKinds; ++k) v[k] += s->v[k].load(std::memory_order_relaxed);
  return Work{v[kPosts],         v[kPostBytes], v[kDoorbells],    v[kDmaWrites],
              v[kDmaWriteBytes], v[kDmaReads],  v[kDmaReadBytes], v[kRemoteReads]};
}

uint64_t mono_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000u + uint64_t(ts.tv_nsec);
}

}  // namespace pcientb::fabric
