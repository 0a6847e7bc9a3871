#include "directory.hpp"

#include <sys/mman.h>

#include <cstdio>
#include <cstdlib>
#include <new>

namespace stress {

const char *op_name(Op op) {
  static const char *names[kOpCount] = {"SEND", "SEND_IMM",  "WRITE",    "WRITE_IMM",
                                        "READ", "FETCH_ADD", "CMP_SWAP", "UD_SEND"};
  return names[static_cast<int>(op)];
}

const char *reason_name(Reason r) {
  static const char *names[kReasonCount] = {"peer killed", "peer QP destroyed or failed",
                                            "MR re-registered", "CQ overrun",
                                            "own QP failed on purpose"};
  return names[static_cast<int>(r)];
}

const char *anomaly_name(Anomaly a) {
  static const char *names[kAnomalyCount] = {
      "success after an error on the same QP",
      "second non-flush error on a failed QP",
      "async event without a cause",
      "overrun CQ raised no IBV_EVENT_CQ_ERR",
      "verbs call failed",
      "worker crashed",
      "handshake refused or timed out",
      "completion for no outstanding WR",
      "QP not in ERR after an error completion",
      "success for a WR posted to a dead process",
      "SRQ QP in ERR: no IBV_EVENT_QP_LAST_WQE_REACHED",
      "receive repost refused below max_wr (ENOMEM)",
  };
  return names[static_cast<int>(a)];
}

const char *doing_name(Doing d) {
  static const char *names[] = {"starting",      "main loop",
                                "ibv_post_send", "ibv_post_recv",
                                "ibv_poll_cq",   "creating a verbs object",
                                "ibv_modify_qp", "destroying a verbs object",
                                "ibv_reg_mr",    "ibv_dereg_mr",
                                "async event",   "CQ overrun scenario",
                                "draining",      "exiting",
                                "injected hang"};
  return names[static_cast<int>(d)];
}

Directory *create_directory(int procs) {
  void *p =
      mmap(nullptr, sizeof(Directory), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    std::perror("pcientb-stress: mmap of the directory");
    std::exit(1);
  }
  auto *dir = new (p) Directory();
  dir->procs = procs;
  return dir;
}

bool generation_gone(const Directory &dir, int slot, uint32_t gen) {
  const WorkerSlot &s = dir.slots[slot];
  if (s.generation.load(std::memory_order_acquire) != gen) return true;
  auto life = static_cast<Life>(s.life.load(std::memory_order_acquire));
  return life == Life::kDying || life == Life::kDead || life == Life::kDone || life == Life::kEmpty;
}

}  // namespace stress
