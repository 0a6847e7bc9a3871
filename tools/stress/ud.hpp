// The worker's UD QP: datagrams of 24..4096 bytes (a header naming the
// sender, then a pattern) to random workers. Datagrams are unreliable: one
// that finds no receive posted (or a dead target) is dropped, which is
// counted but is not an error. Every datagram that arrives is checked, and a
// datagram that arrives twice is a corruption.
#ifndef PCIENTB_STRESS_UD_HPP
#define PCIENTB_STRESS_UD_HPP

#include "env.hpp"
#include "staging.hpp"

#include <deque>
#include <unordered_map>
#include <vector>

namespace stress {

class UdEndpoint {
 public:
  explicit UdEndpoint(Env &env);
  ~UdEndpoint();
  bool step();
  void stop() { stopping_ = true; }
  uint32_t qpn() const { return qp_->qp_num; }
  bool owns(const ibv_qp *qp) const { return qp_.get() == qp; }

 private:
  struct Sent {
    uint64_t id;
    bool signaled;
    Layout layout;
  };
  struct Source {
    uint32_t gen = 0;
    uint64_t next = 0;  // the sequence number expected next
  };

  int post_receive(int slot);  // ibv_post_recv's value
  void repost(int slot);
  bool send_one();
  ibv_ah *ah_for(uint16_t lid);
  void on_completion(const ibv_wc &wc);
  void check_datagram(const ibv_wc &wc, int slot);

  Env &env_;
  CqPtr cq_;
  QpPtr qp_;
  Region recv_;
  Staging staging_;
  std::unordered_map<uint16_t, AhPtr> ahs_;
  std::deque<Sent> outstanding_;
  std::vector<int> deferred_;  // receive slots to post again
  Source sources_[kMaxProcs];
  uint64_t next_seq_ = 0, next_id_ = 1;
  int since_signal_ = 0;
  bool stopping_ = false;
};

}  // namespace stress

#endif
