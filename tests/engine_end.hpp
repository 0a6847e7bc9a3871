// One RC end driven through the engine's own API (no libibverbs, no glue):
// a context on its own node of the fabric now installed (tests use the
// in-process fake, fake_fabric.hpp), a PD, a CQ, a QP, and a registered
// buffer with guard bytes around it that nothing may touch.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/engine.hpp"

namespace pcientb::test {

class EngineEnd {
 public:
  static constexpr size_t kGuard = 4096;
  static constexpr uint8_t kGuardByte = 0xa5;

  // A node of its own: `fabric` names it (every name is a new node of the
  // fake fabric). Throws std::runtime_error if a verb fails.
  EngineEnd(const char *fabric, size_t buffer_size, uint32_t depth = 64);
  ~EngineEnd();
  EngineEnd(const EngineEnd &) = delete;
  EngineEnd &operator=(const EngineEnd &) = delete;

  uint16_t lid() const { return lid_; }
  uint32_t qpn() const { return handle_.qp_num; }
  uint8_t *buf() { return mem_.data() + kGuard; }
  size_t size() const { return mem_.size() - 2 * kGuard; }
  uint32_t lkey() const { return mr_->lkey; }
  uint32_t rkey() const { return mr_->rkey; }
  engine::Node &node() { return *ctx_->node; }
  engine::Qp *qp() { return qp_; }

  // RESET -> INIT -> RTR -> RTS towards (lid, qpn); a QP in any state is
  // reset first. Returns the first modify_qp error, 0 on success.
  int connect(uint16_t lid, uint32_t qpn, uint8_t timeout = 14, uint8_t retry_cnt = 7,
              uint8_t min_rnr_timer = 1);
  int post_recv(uint64_t wr_id, size_t off, uint32_t len);
  // A WR on the buffer: opcode, [off, off + len) here, remote address and key.
  int post_send(uint64_t wr_id, ibv_wr_opcode opcode, size_t off, uint32_t len,
                uint64_t remote_addr = 0, uint32_t rkey = 0);
  // Completions polled so far, then up to `n` more within `ms` (0: what is there).
  std::vector<ibv_wc> poll(size_t n, int ms = 0);
  ibv_qp_state state();
  // Deregisters the buffer (verbs on it fail from then on).
  void deregister();
  // Whether the guard bytes around the registered buffer are untouched.
  bool guards_intact() const;

 private:
  std::vector<uint8_t> mem_;
  engine::Context *ctx_ = nullptr;
  engine::Pd *pd_ = nullptr;
  engine::Cq *cq_ = nullptr;
  engine::Mr *mr_ = nullptr;
  engine::Qp *qp_ = nullptr;
  ibv_qp handle_{};  // what the glue's struct ibv_qp gives the engine
  uint16_t lid_ = 0;
};

}  // namespace pcientb::test
