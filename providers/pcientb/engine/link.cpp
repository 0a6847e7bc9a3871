// Links: how a node reaches a peer without ever loading from the peer's
// memory (docs/transport.md).
//
// Node A asks node B for a link: it allocates, in its own area, a zeroed
// Mirror (for B's MR and QP tables) and a lane for B's answers, writes their
// offsets, its nonce and a new `asked` number (last) into its box in B's
// area, and rings B's doorbell. B's progress thread allocates a lane for A's
// requests in its own area, pushes every live entry of its tables into the
// mirror with posted writes, and answers in its box in A's area (`served`,
// last). From then on B pushes each change of an entry to every linked peer
// before the verb that made the change returns.
#include <cerrno>
#include <cstring>
#include <vector>

#include "engine/responder.hpp"

namespace pcientb::engine {
namespace {

size_t box_off(uint16_t lid) {
  return offsetof(AreaRoot, links) + size_t{lid} * sizeof(LinkBox);
}

// The owner-side view of a QP entry, as the mirror holds it.
struct QpWords {
  uint32_t qpn, state, type, pd, access, dest_qpn, dest_lid;
};
static_assert(sizeof(QpWords) == sizeof(QpMirror) - offsetof(QpMirror, qpn));

// A successful SEND's answer (and the receive completions it covers) is held while the
// requests after it are served, so that a run of them costs one answer; but a tick of the
// coarse clock at most: a request whose bytes are pulled may take long (a pull across the
// bridge on a busy host), and the requester, its window full, waits for answers meanwhile.
constexpr uint64_t kAnswerHoldNs = 1000000;
// An application's thread (a poll) serves requests this long at most (a tick of the
// coarse clock); then the progress thread does.
constexpr uint64_t kServeBudgetNs = 1000000;

uint32_t seq_of(uint64_t pos) {
  return static_cast<uint32_t>(pos + 1);
}

// The next record of a lane of this node, checked to lie in the lane;
// nullptr when there is none (or the producer wrote nonsense: then the lane
// stops, which only hurts the producer's own traffic).
// *cells: its size, read once (the producer may write the head again: only
// this checked value is used).
const RecordHead *lane_peek(void *area, const LaneIn &l, uint16_t *cells = nullptr) {
  // Relaxed: a thread may look (without the consumer's lock) whether there
  // is anything before it takes the lock.
  const uint64_t head = __atomic_load_n(&l.head, __ATOMIC_RELAXED);
  uint64_t cell = head % l.cells;
  auto *h = at<const RecordHead>(area, l.lane + cell * kCell);
  if (h->seq.load(std::memory_order_acquire) != seq_of(head)) return nullptr;
  const uint16_t n = __atomic_load_n(&h->cells, __ATOMIC_RELAXED);
  if (n == 0 || n > l.cells - cell) return nullptr;
  if (cells) *cells = n;
  return h;
}

// Tells the producer how far the lane was taken, a quarter of it at a time
// (what is not told yet never keeps it from more than a quarter).
bool lane_credit(fabric::Fabric &fab, fabric::Peer &producer, LaneIn &l) {
  if (l.head - l.posted < l.cells / 4) return false;
  fab.post(producer, l.taken_at, &l.head, 8);
  l.posted = l.head;
  return true;
}

// Whether a record of len bytes fits in the lane now (with the pad before it).
bool lane_room(const LaneOut &l, size_t len) {
  const uint64_t n = (len + kCell - 1) / kCell, at = l.tail % l.cells;
  const uint64_t pad = at + n > l.cells ? l.cells - at : 0;
  return l.tail + pad + n - l.taken->load(std::memory_order_acquire) <= l.cells;
}

}  // namespace

bool lane_put(fabric::Fabric &fab, fabric::Peer &peer, LaneOut &l, RecordHead *rec, size_t len,
              const Gather *after, uint64_t *pos) {
  size_t total = len;
  if (after)
    for (uint32_t i = 0; i < after->n; ++i) total += after->len[i];
  if (!lane_room(l, total)) return false;
  const auto n = static_cast<uint16_t>((total + kCell - 1) / kCell);
  uint64_t at = l.tail % l.cells;
  uint64_t pad = at + n > l.cells ? l.cells - at : 0;
  if (pad) {
    RecordHead p{};
    p.type = kRecPad;
    p.cells = static_cast<uint16_t>(pad);
    p.seq.store(seq_of(l.tail), std::memory_order_relaxed);
    fab.post(peer, l.lane + at * kCell, &p, sizeof p);  // one word: seq, type, cells
    l.tail += pad;
    at = 0;
  }
  rec->cells = n;
  const uint32_t seq = seq_of(l.tail);
  const size_t off = l.lane + at * kCell;
  // The record, then its seq: the consumer sees it whole or not at all. The
  // bytes after it go from where they are (no copy into a staging record).
  fab.post(peer, off + sizeof rec->seq, reinterpret_cast<const uint8_t *>(rec) + sizeof rec->seq,
           len - sizeof rec->seq);
  if (after) {
    size_t pos = off + len;
    for (uint32_t i = 0; i < after->n; pos += after->len[i++])
      if (after->len[i]) fab.post(peer, pos, after->ptr[i], after->len[i]);
  }
  fab.post(peer, off, &seq, sizeof seq);
  if (pos) *pos = l.tail;
  l.tail += n;
  return true;
}

OutLink *Node::link(fabric::Peer &peer) {
  OutLink *l = out_[peer.lid()].load(std::memory_order_acquire);
  if (l && l->nonce == peer.nonce()) {
    if (l->up.load(std::memory_order_acquire)) return l;
  } else {
    // A new peer at this LID (the old one died, or none was asked yet).
    std::lock_guard<std::mutex> g(links_mu_);
    l = out_[peer.lid()].load(std::memory_order_relaxed);
    if (!l || l->nonce != peer.nonce()) {
      auto made = std::make_unique<OutLink>();
      made->peer = &peer;
      made->nonce = peer.nonce();
      made->mirror = alloc(sizeof(Mirror));
      made->answers.lane = alloc(size_t{kAnswerCells} * kCell);
      if (!made->mirror || !made->answers.lane) {
        free(made->mirror);
        free(made->answers.lane);
        return nullptr;
      }
      made->answers.cells = kAnswerCells;
      made->answers.taken_at = box_off(fab_->lid()) + offsetof(LinkBox, answers_taken);
      made->requests.cells = kRequestCells;
      made->requests.taken = &root_->links[peer.lid()].requests_taken;
      made->asked = ++asks_;
      const uint64_t me = fab_->nonce(), mirror = made->mirror, answers = made->answers.lane,
                     asked = made->asked, none = 0;
      const size_t box = box_off(fab_->lid());
      // A count left by an earlier node at this LID would be taken for ours.
      fab_->post(peer, box + offsetof(LinkBox, answers_taken), &none, 8);
      fab_->post(peer, box + offsetof(LinkBox, nonce), &me, 8);
      fab_->post(peer, box + offsetof(LinkBox, mirror), &mirror, 8);
      fab_->post(peer, box + offsetof(LinkBox, answer_lane), &answers, 8);
      fab_->post(peer, box + offsetof(LinkBox, asked), &asked, 8);  // last: the ask itself
      l = made.get();
      out_all_.push_back(std::move(made));
      out_[peer.lid()].store(l, std::memory_order_release);
      uint32_t top = links_top_.load(std::memory_order_relaxed);
      if (peer.lid() + 1u > top) links_top_.store(peer.lid() + 1u, std::memory_order_release);
      fab_->doorbell(peer, false);
    }
  }
  // Served? The peer posts its answer last.
  const LinkBox &b = root_->links[peer.lid()];
  if (b.served.load(std::memory_order_acquire) != l->asked ||
      b.served_nonce.load(std::memory_order_relaxed) != fab_->nonce())
    return nullptr;
  std::lock_guard<SpinLock> g(l->req_mu);
  if (!l->requests.lane) {
    Off lane = b.request_lane.load(std::memory_order_relaxed);
    // Checked by every post against the peer's area; a lane must be whole cells.
    if (!lane || lane % kCell) return nullptr;
    l->requests.lane = lane;
  }
  l->up.store(true, std::memory_order_release);
  return l;
}

void Node::push_mr_to(const InLink &to, uint32_t idx) {
  const MrShared &e = root_->mrs[idx];
  MrShared v;
  uint32_t key = e.key.load(std::memory_order_acquire);
  memcpy(reinterpret_cast<uint8_t *>(&v) + sizeof v.key,
         reinterpret_cast<const uint8_t *>(&e) + sizeof e.key, sizeof v - sizeof v.key);
  const size_t at = to.mirror + offsetof(Mirror, mrs) + size_t{idx} * sizeof(MrShared);
  const uint32_t none = 0;
  // Key 0 while the entry changes (mr_check's rule), then the new key.
  fab_->post(*to.peer, at, &none, 4);
  if (!key) return;
  fab_->post(*to.peer, at + sizeof v.key, reinterpret_cast<const uint8_t *>(&v) + sizeof v.key,
             sizeof v - sizeof v.key);
  fab_->post(*to.peer, at, &key, 4);
}

void Node::push_qp_to(const InLink &to, uint32_t idx) {
  const QpShared &q = root_->qps[idx];
  QpWords v{q.qpn.load(std::memory_order_acquire),
            q.state.load(std::memory_order_acquire),
            q.type,
            q.pd,
            q.access,
            q.dest_qpn,
            q.dest_lid};
  const size_t at = to.mirror + offsetof(Mirror, qps) + size_t{idx} * sizeof(QpMirror);
  const uint32_t odd = push_seq_ + 1, even = push_seq_ + 2;
  push_seq_ += 2;
  fab_->post(*to.peer, at + offsetof(QpMirror, seq), &odd, 4);
  fab_->post(*to.peer, at + offsetof(QpMirror, qpn), &v, sizeof v);
  fab_->post(*to.peer, at + offsetof(QpMirror, seq), &even, 4);
}

void Node::push_mr(uint32_t idx) {
  std::lock_guard<std::mutex> g(links_mu_);
  for (uint32_t lid = 1, top = links_top_.load(); lid < top; ++lid)
    if (InLink *l = in_[lid].load(std::memory_order_relaxed); l && !l->peer->dead())
      push_mr_to(*l, idx);
}

void Node::push_qp(uint32_t idx) {
  std::lock_guard<std::mutex> g(links_mu_);
  for (uint32_t lid = 1, top = links_top_.load(); lid < top; ++lid)
    if (InLink *l = in_[lid].load(std::memory_order_relaxed); l && !l->peer->dead())
      push_qp_to(*l, idx);
}

void Node::serve_links() {
  for (uint16_t lid = 1; lid < kMaxLinks; ++lid) {
    const LinkBox &b = root_->links[lid];
    uint64_t asked = b.asked.load(std::memory_order_acquire);
    if (!asked) continue;
    uint64_t nonce = b.nonce.load(std::memory_order_relaxed);
    Off mirror = b.mirror.load(std::memory_order_relaxed);
    Off answers = b.answer_lane.load(std::memory_order_relaxed);
    std::lock_guard<std::mutex> g(links_mu_);
    Seen &seen = seen_[lid];
    if (seen.nonce == nonce && seen.asked == asked) continue;
    // What a peer wrote is checked before use: the asker must be the node
    // that holds the LID now (if not yet known here, the ask is looked at
    // again on the next doorbell); its offsets are checked by every post.
    fabric::Peer *peer = fab_->peer(lid);
    if (!peer || peer->nonce() != nonce) continue;
    seen = Seen{nonce, asked};
    if (!mirror || mirror % alignof(Mirror) || !answers || answers % kCell) continue;
    auto l = std::make_unique<InLink>();
    l->peer = peer;
    l->nonce = nonce;
    l->mirror = mirror;
    l->requests.lane = alloc(size_t{kRequestCells} * kCell);
    if (!l->requests.lane) continue;  // no memory: the asker times out
    l->requests.cells = kRequestCells;
    l->requests.taken_at = box_off(fab_->lid()) + offsetof(LinkBox, requests_taken);
    l->answers.lane = answers;
    l->answers.cells = kAnswerCells;
    l->answers.taken = &b.answers_taken;
    // A new link at a LID: the old one's peer is gone (or asked again).
    InLink *raw = l.get();
    in_all_.push_back(std::move(l));
    in_[lid].store(raw, std::memory_order_release);
    if (lid + 1u > links_top_.load(std::memory_order_relaxed))
      links_top_.store(lid + 1u, std::memory_order_release);
    // From here on, changes are pushed (under links_mu_): then everything.
    // The entries in use are found in private memory: reading the tables of
    // the area would fault in every page of them (shared memory holes).
    std::vector<uint32_t> mrs, qps;
    {
      std::lock_guard<std::mutex> t(mu_);
      for (uint32_t i = 1; i < kMaxMrs; ++i)
        if (mr_gen_[i] & 0x80) mrs.push_back(i);
      for (uint32_t i = 1; i < kMaxQps; ++i)
        if (qps_[i].load(std::memory_order_relaxed)) qps.push_back(i);
    }
    for (uint32_t i : mrs) push_mr_to(*raw, i);
    for (uint32_t i : qps) push_qp_to(*raw, i);
    const size_t box = box_off(fab_->lid());
    const Off requests = raw->requests.lane;
    const uint64_t none = 0;
    fab_->post(*peer, box + offsetof(LinkBox, requests_taken), &none, 8);
    fab_->post(*peer, box + offsetof(LinkBox, served_nonce), &nonce, 8);
    fab_->post(*peer, box + offsetof(LinkBox, request_lane), &requests, 8);
    fab_->post(*peer, box + offsetof(LinkBox, served), &asked, 8);
    fab_->doorbell(*peer, false);
  }
}

void Node::serve_requests(InLink &l, OutLink *out, bool polled) {
  void *area = fab_->area();
  // Nothing there (the common case of a poll): no locked instruction. A
  // thread that finds the lock taken leaves: the holder looks again after
  // it lets go.
  bool stopped = false;
  while (lane_peek(area, l.requests) && l.mu.try_lock()) {
    if (!serve_requests_locked(l, out, polled ? &stopped : nullptr))
      return;  // no room to answer: the peer's credit rings
    if (stopped) {
      // The rest is the progress thread's (it may have found the lock taken, and left).
      wake();
      return;
    }
  }
}

bool Node::serve_requests_locked(InLink &l, OutLink *out, bool *stopped) {
  void *area = fab_->area();
  bool answered = false, room = true;
  // A SEND's success acknowledges every request of its QP before it (as an
  // IB ACK does): of a run of them, only the last is posted. The receive
  // completions of the requests an answer covers are published after it.
  AnswerRecord held{};
  bool holding = false;
  uint64_t held_since = 0;
  const uint64_t start = stopped ? coarse_now_ns() : 0;
  bool served = false;
  // Filled as requests are served, not constructed up front (64 of them
  // cost a small SEND's serve as much again).
  union Held {
    Receipt r;
    Held() {}  // NOLINT(modernize-use-equals-default): r stays unconstructed
  } done[64];
  uint32_t n_done = 0;
  auto put = [&](AnswerRecord &a) {
    lane_put(*fab_, *l.peer, l.answers, &a.head, sizeof a);
    answered = true;
  };
  auto flush = [&] {
    for (uint32_t i = 0; i < n_done; ++i) receipt_claim(*this, done[i].r);
    if (holding) put(held);
    holding = false;
    for (uint32_t i = 0; i < n_done; ++i) receipt_publish(*this, done[i].r);
    n_done = 0;
  };
  uint16_t cells;
  while (const RecordHead *h = lane_peek(area, l.requests, &cells)) {
    // The peer's answers that came meanwhile go first (they were posted
    // before this request: see service()).
    if (out && lane_peek(area, out->answers)) {
      flush();
      take_answers(*out, true);
    }
    if (h->type != kRecPad) {
      if (holding || (stopped && served)) {
        const uint64_t now = coarse_now_ns();
        if (stopped && served && now - start >= kServeBudgetNs) {
          *stopped = true;
          break;
        }
        if (holding && now - held_since >= kAnswerHoldNs) {
          flush();
          fab_->doorbell(*l.peer);  // a requester that sleeps takes it now
          answered = false;
        }
      }
      // No room to answer (the one held, and this one): the rest waits
      // (answers never wait for requests).
      if (!(room = lane_room(l.answers, 2 * kCell))) break;
      served = true;
      AnswerRecord a{};
      Receipt r;
      const bool send = h->type == kRecSend;
      const bool answer = serve_request(*this, *l.peer, *h, cells, &a, &r);
      if (answer && send && a.status == IBV_WC_SUCCESS) {
        if (holding && held.head.qpn != a.head.qpn) flush();
        memcpy(static_cast<void *>(&held), &a, sizeof a);
        if (!holding) held_since = coarse_now_ns();
        holding = true;
        new (&done[n_done++].r) Receipt(r);
        if (n_done == std::size(done)) flush();
      } else {
        flush();
        if (answer) put(a);
        commit_receipt(*this, r);
      }
    }
    __atomic_store_n(&l.requests.head, l.requests.head + cells, __ATOMIC_RELAXED);
  }
  flush();
  lane_credit(*fab_, *l.peer, l.requests);  // a requester short of room tries again
  l.mu.unlock();
  if (answered) fab_->doorbell(*l.peer);
  return room;
}

void Node::take_answers(OutLink &l, bool wait) {
  void *area = fab_->area();
  if (wait) {
    l.ans_mu.lock();
    take_answers_locked(l);
  }
  // As serve_requests: the holder of the lock looks again after it lets go.
  while (lane_peek(area, l.answers) && l.ans_mu.try_lock()) take_answers_locked(l);
}

void Node::take_answers_locked(OutLink &l) {
  void *area = fab_->area();
  uint16_t cells;
  while (const RecordHead *h = lane_peek(area, l.answers, &cells)) {
    if (h->type == kRecAnswer && cells == 1) {
      AnswerRecord a;
      memcpy(reinterpret_cast<uint8_t *>(&a) + sizeof a.head.seq,
             reinterpret_cast<const uint8_t *>(h) + sizeof h->seq, sizeof a - sizeof a.head.seq);
      // Only this link's QPs: a QP with that number, connected to the peer.
      Qp *qp = qp_by_idx(a.head.qpn & (kMaxQps - 1));
      if (qp && qp->ibv && qp->ibv->qp_num == a.head.qpn) qp_answer(qp, *l.peer, a);
    }
    __atomic_store_n(&l.answers.head, l.answers.head + cells, __ATOMIC_RELAXED);
  }
  // The peer may hold requests back for want of room to answer them.
  bool credited = lane_credit(*fab_, *l.peer, l.answers);
  l.ans_mu.unlock();
  if (credited) fab_->doorbell(*l.peer);
}

bool Node::answers_waiting(const OutLink &l) {
  return l.up.load(std::memory_order_acquire) && lane_peek(fab_->area(), l.answers) != nullptr;
}

bool Node::lanes_waiting() {
  void *area = fab_->area();
  for (uint32_t lid = 1, top = links_top_.load(std::memory_order_acquire); lid < top; ++lid) {
    if (InLink *l = in_[lid].load(std::memory_order_acquire);
        l && !l->peer->dead() && lane_peek(area, l->requests))
      return true;
    if (OutLink *l = out_[lid].load(std::memory_order_acquire); l && answers_waiting(*l))
      return true;
  }
  return false;
}

void Node::links_barrier() {
  // Every link ever made: a thread may still serve one replaced at its LID.
  std::vector<OutLink *> outs;
  std::vector<InLink *> ins;
  {
    std::lock_guard<std::mutex> g(links_mu_);
    for (auto &l : out_all_) outs.push_back(l.get());
    for (auto &l : in_all_) ins.push_back(l.get());
  }
  for (OutLink *l : outs) {
    l->ans_mu.lock();
    l->ans_mu.unlock();
  }
  for (InLink *l : ins) {
    l->mu.lock();
    l->mu.unlock();
  }
  // A thread that found a lock taken here left what it saw to the holder (this thread),
  // which does not look: the progress thread looks instead.
  wake();
}

void Node::service(bool polled) {
  void *area = fab_->area();
  for (uint32_t lid = 1, top = links_top_.load(std::memory_order_acquire); lid < top; ++lid) {
    InLink *in = in_[lid].load(std::memory_order_acquire);
    if (in && in->peer->dead()) in = nullptr;
    // Answers first: a peer answers a request before its program can reply
    // to it, so a send completion comes before the reply's receive, as an
    // HCA's ACK does (perftest's event mode polls the send CQ after any
    // event). Requests seen means the answers posted before them are seen:
    // those are taken, waiting for a thread that takes them meanwhile.
    const bool requests = in && lane_peek(area, in->requests);
    OutLink *out = out_[lid].load(std::memory_order_acquire);
    if (out && !out->up.load(std::memory_order_acquire)) out = nullptr;
    if (out) take_answers(*out, requests);
    if (requests) serve_requests(*in, out, polled);
  }
}

}  // namespace pcientb::engine
