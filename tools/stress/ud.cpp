#include "ud.hpp"

#include <cinttypes>
#include <cstring>

namespace stress {
namespace {

constexpr int kReceives = 64;
constexpr uint32_t kSendWr = 64;
constexpr uint64_t kMtu = 4096;
constexpr uint64_t kSlotBytes = kGrh + kMtu;
constexpr uint64_t kRecvFlag = 1ull << 63;  // wr_id of a receive
constexpr uint32_t kMagic = 0x55445354;

struct Header {
  uint32_t magic, slot, gen, len;
  uint64_t seq;
};
static_assert(sizeof(Header) == 24);

}  // namespace

UdEndpoint::UdEndpoint(Env &env)
    : env_(env),
      recv_(env.node->pd.get(), kReceives * kSlotBytes, IBV_ACCESS_LOCAL_WRITE),
      staging_(env.node->pd.get(), 64 * 1024, 2) {
  cq_ = create_cq(env_.node->ctx.get(), kReceives + kSendWr);
  ibv_qp_init_attr attr{};
  attr.send_cq = attr.recv_cq = cq_.get();
  attr.qp_type = IBV_QPT_UD;
  attr.cap = {kSendWr, kReceives, env_.send_sge, 1, 0};
  qp_ = create_qp(env_.node->pd.get(), &attr);
  ud_ready(qp_.get());
  for (int i = 0; i < kReceives; ++i)
    if (int rc = post_receive(i)) throw_verbs("ibv_post_recv (UD)", rc);
}

UdEndpoint::~UdEndpoint() {
  qp_.reset();
  ahs_.clear();
  cq_.reset();
}

int UdEndpoint::post_receive(int slot) {
  ibv_sge sge{recv_.addr(slot * kSlotBytes), static_cast<uint32_t>(kSlotBytes), recv_.mr->lkey};
  ibv_recv_wr wr{};
  wr.wr_id = kRecvFlag | static_cast<uint64_t>(slot);
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr *bad = nullptr;
  env_.doing(Doing::kPostRecv, 2000);
  return ibv_post_recv(qp_.get(), &wr, &bad);
}

// A repost refused although fewer than max_recv_wr receives are outstanding
// (a provider bug, counted once): the slot is posted again later.
void UdEndpoint::repost(int slot) {
  int rc = post_receive(slot);
  if (rc == 0) return;
  env_.anomaly(Anomaly::kRepostRefused,
               "UD ibv_post_recv after polling a receive completion: %s (%zu of %d receives "
               "waiting to be posted again)",
               std::strerror(rc), deferred_.size() + 1, kReceives);
  deferred_.push_back(slot);
}

bool UdEndpoint::step() {
  ibv_wc wcs[32];
  env_.doing(Doing::kPollCq, 2000);
  int n = ibv_poll_cq(cq_.get(), 32, wcs);
  if (n < 0) env_.anomaly(Anomaly::kVerbsCall, "UD ibv_poll_cq returned %d", n);
  for (int i = 0; i < n; ++i) on_completion(wcs[i]);
  while (!deferred_.empty() && post_receive(deferred_.back()) == 0) deferred_.pop_back();
  bool sent = false;
  if (!stopping_ && env_.phase() == RunPhase::kRun && outstanding_.size() < kSendWr &&
      env_.rng.chance(20))
    sent = send_one();
  return n > 0 || sent;
}

ibv_ah *UdEndpoint::ah_for(uint16_t lid) {
  auto it = ahs_.find(lid);
  if (it != ahs_.end()) return it->second.get();
  ibv_ah_attr attr{};
  attr.dlid = lid;
  attr.port_num = 1;
  env_.doing(Doing::kCreate, 2000);
  AhPtr ah(ibv_create_ah(env_.node->pd.get(), &attr));
  if (!ah) {
    env_.anomaly(Anomaly::kVerbsCall, "ibv_create_ah(lid %u): %s", lid, std::strerror(errno));
    return nullptr;
  }
  return ahs_.emplace(lid, std::move(ah)).first->second.get();
}

bool UdEndpoint::send_one() {
  int target = static_cast<int>(env_.rng.below(env_.dir.procs));
  WorkerSlot &t = env_.slot_of(target);
  if (static_cast<Life>(t.life.load(std::memory_order_acquire)) != Life::kReady) return false;
  uint16_t lid = static_cast<uint16_t>(t.lid);
  uint32_t qpn = t.ud_qpn;
  if (env_.opt.ops && env_.dir.ops_posted.load(std::memory_order_relaxed) >= env_.opt.ops)
    return false;
  ibv_ah *ah = ah_for(lid);
  if (!ah) return false;
  uint64_t len = sizeof(Header) + env_.rng.below(kMtu - sizeof(Header) + 1);
  Sent sent{};
  auto mark = staging_.mark();
  if (!staging_.take(env_.rng, len, env_.send_sge, 1, &sent.layout)) return false;
  uint64_t seq = next_seq_++;
  staging_.fill(sent.layout, datagram_seed(env_.slot, env_.gen, seq));
  Header h{kMagic, static_cast<uint32_t>(env_.slot), env_.gen, static_cast<uint32_t>(len), seq};
  const auto *hb = reinterpret_cast<const uint8_t *>(&h);
  for (size_t i = 0; i < sizeof h; ++i) *staging_.byte_at(sent.layout, i) = hb[i];

  ibv_sge sges[kMaxPieces];
  ibv_send_wr wr{};
  wr.wr_id = sent.id = next_id_++;
  wr.opcode = IBV_WR_SEND;
  wr.num_sge = staging_.sges(sent.layout, sges);
  wr.sg_list = sges;
  sent.signaled = since_signal_ >= 15 || env_.rng.chance(25);
  since_signal_ = sent.signaled ? 0 : since_signal_ + 1;
  wr.send_flags = sent.signaled ? IBV_SEND_SIGNALED : 0;
  wr.wr.ud.ah = ah;
  wr.wr.ud.remote_qpn = qpn;
  wr.wr.ud.remote_qkey = kUdQkey;
  ibv_send_wr *bad = nullptr;
  env_.doing(Doing::kPostSend, 2000);
  if (int rc = ibv_post_send(qp_.get(), &wr, &bad)) {
    env_.anomaly(Anomaly::kVerbsCall, "UD ibv_post_send: %s", std::strerror(rc));
    staging_.restore(std::move(mark));
    return false;
  }
  env_.dir.ops_posted.fetch_add(1, std::memory_order_relaxed);
  outstanding_.push_back(sent);
  return true;
}

void UdEndpoint::on_completion(const ibv_wc &wc) {
  if (wc.wr_id & kRecvFlag) {
    int slot = static_cast<int>(wc.wr_id & ~kRecvFlag);
    if (wc.status == IBV_WC_SUCCESS) {
      check_datagram(wc, slot);
    } else {
      env_.unexpected_status(wc.status, "UD receive completed with %s",
                             status_name(wc.status).c_str());
    }
    repost(slot);
    return;
  }
  // A send: it and the unsignaled ones before it are done.
  while (!outstanding_.empty() && outstanding_.front().id <= wc.wr_id) {
    Sent &s = outstanding_.front();
    bool own = s.id == wc.wr_id;
    ibv_wc_status status = own ? wc.status : IBV_WC_SUCCESS;
    if (status == IBV_WC_SUCCESS) {
      bump(env_.cnt.ops[static_cast<int>(Op::kUdSend)]);
      bump(env_.cnt.bytes, s.layout.length);
      bump(env_.cnt.ud_sent);
    } else {
      bump(env_.cnt.op_errors[static_cast<int>(Op::kUdSend)]);
      env_.unexpected_status(status, "UD send of %" PRIu64 " B completed with %s", s.layout.length,
                             status_name(status).c_str());
    }
    staging_.give(s.layout);
    outstanding_.pop_front();
  }
}

void UdEndpoint::check_datagram(const ibv_wc &wc, int slot) {
  const uint8_t *p = recv_.at(slot * kSlotBytes) + kGrh;
  Header h;
  std::memcpy(&h, p, sizeof h);
  if (wc.byte_len < kGrh + sizeof h || h.magic != kMagic ||
      h.slot >= static_cast<uint32_t>(env_.dir.procs) || wc.byte_len != kGrh + h.len) {
    env_.corrupted("UD datagram of %u B (with GRH): bad header (magic 0x%08x, slot %u, len %u)",
                   wc.byte_len, h.magic, h.slot, h.len);
    return;
  }
  uint64_t seed = datagram_seed(static_cast<int>(h.slot), h.gen, h.seq);
  size_t bad = find_mismatch(p + sizeof h, h.len - sizeof h, seed, sizeof h);
  if (bad != kNoMismatch) {
    env_.corrupted("UD datagram %" PRIu64
                   " from w%u.g%u (%u B): byte %zu is 0x%02x, expected 0x%02x",
                   h.seq, h.slot, h.gen, h.len, bad + sizeof h, p[sizeof h + bad],
                   pattern_byte(seed, sizeof h + bad));
    return;
  }
  Source &src = sources_[h.slot];
  if (src.gen != h.gen) src = Source{h.gen, 0};
  if (h.seq + 1 == src.next) {
    bump(env_.cnt.duplicated);
    env_.corrupted("UD datagram %" PRIu64 " from w%u.g%u arrived twice", h.seq, h.slot, h.gen);
    return;
  }
  if (h.seq < src.next) bump(env_.cnt.ud_reordered);
  src.next = std::max(src.next, h.seq + 1);
  bump(env_.cnt.ud_received);
  bump(env_.cnt.verified_bytes, h.len);
}

}  // namespace stress
