// The engine: what an HCA's firmware does. PD/MR/CQ/SRQ/QP/AH objects, the
// QP state machine, RC and UD semantics, WQE execution, completions and the
// error model, over any fabric backend. It speaks the public verbs types
// (<infiniband/verbs.h>) and knows nothing of libibverbs' private ABI.
//
// Each object starts with its public verbs struct, so the verbs glue hands
// that struct to libibverbs and gets the object back with from_ibv().
//
// Files: context.cpp (node, device queries, async events, progress thread),
// mem.cpp (PD, MR, AH), cq.cpp, srq.cpp, qp.cpp (create/modify/query/destroy),
// requester.cpp (post_send), responder.cpp (what the target side does:
// receive queues, remote-access checks, delivery, requests from peers),
// link.cpp (links to peers: mirrors of their tables, lanes of requests and
// answers; docs/transport.md).
#pragma once

#include <infiniband/verbs.h>

#include <sched.h>
#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "engine/counters.hpp"
#include "engine/layout.hpp"
#include "fabric/fabric.hpp"

namespace pcientb::engine {

struct Context;
struct Qp;
struct Cq;
struct Srq;
struct OutLink;
struct InLink;
uint64_t now_ns();         // CLOCK_MONOTONIC
uint64_t coarse_now_ns();  // CLOCK_MONOTONIC_COARSE: cheaper, a few ms behind

// The fabric this process is on: $PCIENTB_FABRIC, or its value when the
// provider loaded if it is no longer set (servers such as nginx replace their
// environment before they first open the device; the preload library loads
// the provider at start), or "default". A program may still set it before its
// first open. The one reader of the variable (pcientb_fabric_name()).
const char *fabric_name();

// This process on one fabric: shared by every context opened on it.
class Node {
 public:
  static std::shared_ptr<Node> acquire(const char *fabric_name, int *err);
  ~Node();

  fabric::Fabric &fab() { return *fab_; }
  AreaRoot *root() { return root_; }

  // Peer-visible memory in this node's area, zeroed; 0 when there is none.
  Off alloc(size_t bytes);
  void free(Off off);
  // Objects counted against the device's limits (query_device reports them):
  // false when the limit is reached (ENOMEM for the verb).
  bool take_quota(Quota q);
  void give_quota(Quota q);
  void *ptr(Off off) { return at<void>(fab_->area(), off); }

  uint32_t new_pd_id() { return next_pd_.fetch_add(1) + 1; }
  // A connection's number as its requests carry it: unique in the node.
  uint32_t new_epoch() { return next_epoch_.fetch_add(1) + 1; }
  // MR and QP table slots; keys and QPNs are not reused at once.
  int alloc_mr(uint32_t *idx, uint32_t *key);
  void free_mr(uint32_t idx);
  int alloc_qp(Qp *qp, uint32_t *idx, uint32_t *qpn);
  Qp *qp_by_idx(uint32_t idx);

  // Send queue accounting, per QP index: how many WRs the application has
  // retired by polling their completions.
  uint64_t sq_retired(uint32_t idx) const {
    return root_->qp_stats[idx].sq_retired.load(std::memory_order_acquire);
  }
  void retire(uint64_t ticket) {
    root_->qp_stats[ticket >> 48].sq_retired.store(ticket & ((uint64_t{1} << 48) - 1),
                                                   std::memory_order_release);
  }
  void reset_sq(uint32_t idx) {
    root_->qp_stats[idx].sq_retired.store(0, std::memory_order_release);
    root_->qp_stats[idx].sq_posted.set(0);
  }

  // The progress engine: deferred send work (RNR and transport retries,
  // answers' deadlines) and peer liveness. The QP is looked at by `due`
  // (ns, CLOCK_MONOTONIC; 1: now); the progress thread is woken only if it
  // would sleep past that. Qp::sq_mu must not be held.
  void schedule(Qp *qp, uint64_t due = 1);
  // The contexts open on this node, told of device-wide events.
  void attach(Context *ctx);
  void detach(Context *ctx);

  // Takes a QP out of the tables and of the progress engine, for good; its
  // traffic stays counted (NodeStats::gone).
  void retire_qp(Qp *qp);
  // CQs and SRQs are listed in the area's directories for management tools.
  void add_cq(Cq *cq);
  void remove_cq(Cq *cq);
  void add_srq(Srq *srq);
  void remove_srq(Srq *srq);
  // What this node's QPs, live and gone, have moved.
  void traffic(QpStats *sum);
  // Appends the node's traffic to $PCIENTB_STATS (a path, or "stderr"), once:
  // when the node leaves the fabric, or at exit.
  void report_traffic();  // with nodes_mu (context.cpp)
  void watch(fabric::Peer *peer);
  // What a thread polling a CQ does for the node: runs deferred work that is
  // due (a sender that polls retries on time even when the progress thread
  // gets no CPU), keeps the doorbell masked (peers need not ring a node that
  // polls) and takes what peers posted to its lanes.
  void poll_progress() {
    // Every 64th poll renews the mask and looks at the clock for work that
    // is due: a clock read per poll would cost a poll loop, and a node that
    // polls now and then is simply rung. Per thread (a shared count would
    // bounce between polling threads); initial-exec: no __tls_get_addr call
    // (the provider is dlopen'd).
    uint64_t due = next_due_ns_.load(std::memory_order_relaxed);
    if (due == 1) {
      run_due();
    } else if (++polls_ % 64 == 0) {
      fab_->polling();
      // The mask promises peers that this node looks at its lanes when it ends: a progress
      // thread that planned its sleep before the mask came would sleep past it (the fence
      // pairs with progress_loop's).
      std::atomic_thread_fence(std::memory_order_seq_cst);
      if (uint64_t quiet = fab_->quiet_until_ns();
          quiet && looks_at_ns_.load(std::memory_order_relaxed) > quiet)
        wake();
      if (due && due <= now_ns()) run_due();
    }
    service(true);
  }
  // This thread is about to sleep on a completion event (it armed a CQ):
  // peers ring from now on, or what they post would wait for the mask's end.
  void stop_polling() {
    polls_ = 1;  // its next polls before it sleeps do not mask again
    unmasked_ = true;
    // The progress thread would take them only when the mask it planned for runs out.
    if (fab_->not_polling()) service(true);
  }
  // A poll after this thread armed a CQ took completions: it is not going to sleep on them,
  // so its next poll masks the doorbell again (else peers ring, waking the progress thread,
  // for the 63 polls until the usual renewal).
  void polled_after_arm() {
    if (!unmasked_) return;
    unmasked_ = false;
    polls_ = 63;
  }

  // --- links (link.cpp): reaching a peer without reading its memory ---
  // The link to `peer` once the peer has served it (its tables mirrored
  // here, lanes both ways); nullptr until then (the first call asks the
  // peer, and rings its doorbell). Valid until the node goes.
  OutLink *link(fabric::Peer &peer);
  // Takes what peers wrote to this node's lanes: requests are executed and
  // answered, answers handed to their QPs. Any thread, any time; cheap when
  // there is nothing. polled: an application's thread (a poll), which serves
  // requests for about a millisecond at most, then leaves the rest to the
  // progress thread: requests may keep coming while slow ones are served (pulls
  // across the bridge), and the application must get back to its completions
  // to post its receives again (else the requester meets RNR and goes back).
  void service(bool polled = false);
  // Returns once no thread serves a request of, or hands an answer to, a
  // QP it found before now: a QP taken out of the tables (retire_qp) is
  // then safe to free.
  void links_barrier();
  // This node's MR / QP entry `idx` changed: pushed to every peer that
  // keeps a mirror of this node's tables. Call after the change.
  void push_mr(uint32_t idx);
  void push_qp(uint32_t idx);
  // Serves what peers asked in this node's link boxes (on a doorbell).
  void serve_links();
  // Whether answers wait in the link's lane, not taken yet.
  bool answers_waiting(const OutLink &l);
  // Whether requests or answers of any peer wait in this node's lanes.
  bool lanes_waiting();

 private:
  Node() = default;
  void describe();  // fills AreaRoot::stats' identity
  void progress_loop();
  void run_due();
  uint64_t run_pending_locked();  // with prog_mu_; the next deadline, or 0
  void wake();
  void on_peer_death(fabric::Peer *peer);
  void on_device_events();
  static void report_all_at_exit();
  static void before_fork();
  static void after_fork_in_parent();
  static void after_fork_in_child();
  void park_progress(bool park);
  struct Seen {
    uint64_t nonce = 0, asked = 0;  // the last ask of a LID's box looked at
  };
  void push_mr_to(const InLink &to, uint32_t idx);  // with links_mu_
  void push_qp_to(const InLink &to, uint32_t idx);
  // out: the link to the same peer, whose answers are taken before requests
  // that came after them.
  void serve_requests(InLink &l, OutLink *out, bool polled = false);
  // With l.mu; false: no room to answer. stopped (polled only): set when the
  // poll's time ran out with requests left.
  bool serve_requests_locked(InLink &l, OutLink *out, bool *stopped = nullptr);
  // wait: even if another thread takes them now (then they are taken on return).
  void take_answers(OutLink &l, bool wait = false);
  void take_answers_locked(OutLink &l);  // with l.ans_mu

  std::unique_ptr<fabric::Fabric> fab_;
  pid_t pid_ = 0;
  AreaRoot *root_ = nullptr;
  fabric::Peer *self_ = nullptr;
  std::atomic<uint32_t> next_pd_{0};
  std::atomic<uint32_t> next_epoch_{0};

  std::mutex mu_;          // tables and allocator
  Off bump_ = 0;           // the area above is untouched, but for
  size_t kept_above_ = 0;  // ... this much just above it: freed, zeroed, still resident
  std::map<Off, size_t> used_, free_at_;           // blocks by offset
  std::set<std::pair<size_t, Off>> free_by_size_;  // free blocks, smallest first
  std::atomic<uint32_t> quota_[kQuotas] = {};
  uint32_t next_mr_ = 1, next_qp_ = 1;
  uint8_t mr_gen_[kMaxMrs] = {};
  uint16_t qp_gen_[kMaxQps] = {};
  std::atomic<Qp *> qps_[kMaxQps] = {};  // read without mu_ (qp_by_idx)
  std::set<Cq *> cqs_;
  std::set<Srq *> srqs_;
  std::string stats_to_;
  bool reported_ = false;

  // Links by the peer's LID: out_ those this node asked for, in_ those
  // peers asked of it. A link replaced (the peer died, another took its
  // LID) stays allocated until the node goes: lock-free readers may hold it.
  std::mutex links_mu_;  // changing the links, and every push
  std::atomic<OutLink *> out_[kMaxLinks] = {};
  std::atomic<InLink *> in_[kMaxLinks] = {};
  std::atomic<uint32_t> links_top_{0};  // 1 + the highest LID with a link
  std::vector<std::unique_ptr<OutLink>> out_all_;
  std::vector<std::unique_ptr<InLink>> in_all_;
  std::map<uint16_t, Seen> seen_;
  uint64_t asks_ = 0;      // LinkBox::asked of the last ask
  uint32_t push_seq_ = 0;  // QpMirror::seq of the next push, less 1

  std::mutex prog_mu_;
  std::condition_variable parked_cv_;
  bool park_ = false, parked_ = false;  // the progress thread, over fork()
  std::set<Qp *> pending_;
  std::atomic<uint64_t> next_due_ns_{0};
  static inline thread_local uint32_t polls_ __attribute__((tls_model("initial-exec"))) = 0;
  static inline thread_local bool unmasked_ __attribute__((tls_model("initial-exec"))) = false;
  uint64_t sleep_until_ns_ = 0;  // when the progress thread wakes by itself, with prog_mu_
  // When the progress thread looks at the lanes next by itself (UINT64_MAX: when rung).
  std::atomic<uint64_t> looks_at_ns_{UINT64_MAX};
  std::mutex watch_mu_;  // watched_ (after prog_mu_ when both are held)
  std::set<fabric::Peer *> watched_;
  std::set<Context *> contexts_;
  bool lost_ = false;
  uint64_t membership_checked_ns_ = 0;
  int wake_fd_ = -1;
  bool stop_ = false;
  std::thread progress_;
};

// A lock for the short critical sections of the data path: unlocking is a
// plain store, and a waiter spins briefly, then yields the CPU.
class SpinLock {
 public:
  void lock() {
    while (held_.exchange(true, std::memory_order_acquire))
      for (int spins = 0; held_.load(std::memory_order_relaxed); ++spins)
        if (spins > 100) {
          sched_yield();
          spins = 0;
        }
  }
  bool try_lock() {
    return !held_.load(std::memory_order_relaxed) &&
           !held_.exchange(true, std::memory_order_acquire);
  }
  void unlock() { held_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool> held_{false};
};

// A lane's producer side: the lane is in the peer's area.
struct LaneOut {
  Off lane = 0;  // 0: none yet
  uint32_t cells = 0;
  uint64_t tail = 0;                             // cells produced
  const std::atomic<uint64_t> *taken = nullptr;  // the consumer's count, in this node's box
};
// A lane's consumer side: the lane is in this node's area.
struct LaneIn {
  Off lane = 0;
  uint32_t cells = 0;
  uint64_t head = 0;    // cells taken
  uint64_t posted = 0;  // head as last told to the producer
  size_t taken_at = 0;  // where the producer reads it: our box in its area
};

// A link this node asked for: it sends requests to the peer and takes the
// peer's answers.
struct OutLink {
  fabric::Peer *peer = nullptr;
  uint64_t nonce = 0;  // the peer's
  uint64_t asked = 0;
  Off mirror = 0;               // of the peer's tables, here
  std::atomic<bool> up{false};  // served: mirror full, request lane known
  SpinLock req_mu;
  LaneOut requests;
  SpinLock ans_mu;
  LaneIn answers;
};
// A link a peer asked of this node: the node keeps the peer's mirror of its
// tables, takes the peer's requests and answers them.
struct InLink {
  fabric::Peer *peer = nullptr;
  uint64_t nonce = 0;
  Off mirror = 0;  // in the peer's area
  SpinLock mu;     // taking requests and producing answers
  LaneIn requests;
  LaneOut answers;
};

struct Channel {
  ibv_comp_channel ibv;  // calloc'd: libibverbs may free() it
  int wfd;
};

struct Context {
  // On the fabric `fabric` (fabric_name() if nullptr).
  static Context *open(int *err, const char *fabric = nullptr);
  ~Context();

  int query_device(ibv_device_attr_ex *attr, size_t attr_size);
  int query_port(uint8_t port, ibv_port_attr *attr);
  int query_gid(uint32_t port, uint32_t index, ibv_gid_entry *entry);
  int query_pkey(uint8_t port, int index, __be16 *pkey);
  Channel *create_channel(int *err);
  static int destroy_channel(Channel *ch);
  // Queues a record for ibv_get_async_event() of this context.
  void raise_async(uint64_t element, ibv_event_type type);
  EventFd async_events() const { return {async_wfd}; }

  std::shared_ptr<Node> node;
  ibv_context *ibv = nullptr;  // set by the glue
  int async_rfd = -1;
  int async_wfd = -1;
  std::atomic<int> users{0};
};

struct Pd {
  ibv_pd ibv;
  Context *ctx;
  uint32_t id;
  std::atomic<int> users{0};
};

struct Mr {
  Pd *pd;
  uint32_t idx;
  uint32_t lkey, rkey;
  void *addr;
  size_t length;
  uint64_t iova;
  int access;
  fabric::WindowId window;
};

struct Ah {
  ibv_ah ibv;
  Pd *pd;
  ibv_ah_attr attr;
  std::atomic<fabric::Peer *> peer{nullptr};  // resolved on first use
};

struct Cq {
  ibv_cq_ex ibv;  // begins with the layout of struct ibv_cq
  Context *ctx;
  Off off;
  CqShared *sh;
  uint32_t capacity;
  Channel *channel;
  SpinLock poll_mu;
  std::atomic<int> users{0};
  ibv_wc cur;  // the entry the extended poll API is on
  uint64_t wc_flags;
  uint32_t dir;  // its entry in AreaRoot::cq_dir
};

struct Srq {
  ibv_srq ibv;
  Context *ctx;
  Pd *pd;
  Off off;
  RqShared *sh;
  uint32_t max_wr, max_sge;
  SpinLock mu;
  std::atomic<int> users{0};
  uint32_t dir;  // its entry in AreaRoot::srq_dir
};

// A send WR as the requester keeps it while it cannot complete yet: its
// fields (copied as one block: member by member, a move cost a small SEND
// a tenth of its time), then what it owns.
struct SendFields {
  uint64_t wr_id;
  ibv_wr_opcode opcode;
  unsigned int flags;
  __be32 imm;
  uint32_t num_sge;
  ibv_sge sge[kMaxSge];
  uint64_t remote_addr;
  uint32_t rkey;
  uint64_t compare_add, swap;
  Ah *ah;
  uint32_t remote_qpn, remote_qkey;
  uint64_t seq;  // its number in the send queue, from 1
  int rnr_left, retry_left;
  uint64_t not_before_ns;
  // Once sent (in Qp::sent):
  uint32_t psn = 0;
  bool done = false;  // answered (or executed here): complete with status/byte_len
  ibv_wc_status status = IBV_WC_SUCCESS;
  uint32_t byte_len = 0;
  uint64_t deadline_ns = 0;  // the answer must come by then
  // A request whose bytes the target pulls: its position in the link's
  // request lane (cells) + 1, until it is withdrawn or answered; 0: none.
  uint64_t rec_pos = 0;
  // Inline data the WR holds itself, once the caller's buffer may be gone:
  // then sge[0] gives its length (one piece) and SendWqe::held() where it
  // is. Short data in place: a heap block per small SEND cost it a tenth of
  // its time.
  bool holds_inline = false;
  uint8_t held_small_[64];
};
static_assert(std::is_trivially_copyable_v<SendFields>);

struct SendWqe : SendFields {
  SendWqe() = default;
  SendWqe(SendWqe &&o) noexcept : SendFields(o), held_(std::move(o.held_)) {}
  SendWqe &operator=(SendWqe &&o) noexcept {
    SendFields::operator=(o);  // trivial: a block copy
    held_ = std::move(o.held_);
    return *this;
  }
  const uint8_t *held() const { return held_.empty() ? held_small_ : held_.data(); }
  // Takes n pieces (address, length) as the WR's inline data.
  template <typename Piece>
  void hold_inline(const Piece *pieces, size_t n) {
    size_t total = 0;
    for (size_t i = 0; i < n; ++i) total += pieces[i].length;
    held_.clear();
    if (total > sizeof held_small_) held_.resize(total);
    auto *to = const_cast<uint8_t *>(held());
    for (size_t i = 0, at = 0; i < n; at += pieces[i++].length)
      if (pieces[i].length) memcpy(to + at, bytes_at(pieces[i].addr), pieces[i].length);
    flags |= IBV_SEND_INLINE;
    num_sge = 1;
    sge[0] = ibv_sge{0, static_cast<uint32_t>(total), 0};
    holds_inline = true;
  }

 private:
  static const void *bytes_at(uint64_t addr) { return reinterpret_cast<const void *>(addr); }
  static const void *bytes_at(const void *addr) { return addr; }
  std::vector<uint8_t> held_;
};

// A double-ended queue of send WRs in one ring that grows to the QP's
// depth and then allocates nothing (std::deque takes a block per WR of this
// size). Popped slots keep their moved-from WR until reused.
class WqeQueue {
 public:
  bool empty() const { return n_ == 0; }
  size_t size() const { return n_; }
  SendWqe &operator[](size_t i) { return v_[(head_ + i) & (v_.size() - 1)]; }
  const SendWqe &operator[](size_t i) const { return v_[(head_ + i) & (v_.size() - 1)]; }
  SendWqe &front() { return (*this)[0]; }
  SendWqe &back() { return (*this)[n_ - 1]; }
  void push_back(SendWqe &&w) {
    grow();
    ++n_;
    back() = std::move(w);
  }
  void push_front(SendWqe &&w) {
    grow();
    head_ = (head_ - 1) & (v_.size() - 1);
    ++n_;
    front() = std::move(w);
  }
  void pop_front() {
    head_ = (head_ + 1) & (v_.size() - 1);
    --n_;
  }
  void pop_back() { --n_; }
  void clear() { head_ = n_ = 0; }

  struct Iter {
    WqeQueue *q;
    size_t i;
    SendWqe &operator*() const { return (*q)[i]; }
    Iter &operator++() {
      ++i;
      return *this;
    }
    bool operator!=(const Iter &o) const { return i != o.i; }
  };
  Iter begin() { return {this, 0}; }
  Iter end() { return {this, n_}; }

 private:
  void grow() {
    if (n_ < v_.size()) return;
    std::vector<SendWqe> bigger(std::max<size_t>(16, 2 * v_.size()));
    for (size_t i = 0; i < n_; ++i) bigger[i] = std::move((*this)[i]);
    v_.swap(bigger);
    head_ = 0;
  }
  std::vector<SendWqe> v_;  // a power of 2 of them
  size_t head_ = 0, n_ = 0;
};

// The verbs glue wraps a QP (struct verbs_qp is private ABI) and points
// `ibv` at the struct ibv_qp it hands out.
struct Qp {
  ibv_qp *ibv = nullptr;
  Context *ctx;
  Pd *pd;
  Cq *scq, *rcq;
  Srq *srq;
  uint32_t idx;
  QpShared *sh;
  Off rq_off;
  RqShared *rq;
  ibv_qp_cap cap;
  bool sig_all;
  ibv_qp_attr attr{};  // what modify set, for query
  int attr_mask_seen = 0;
  fabric::Peer *peer = nullptr;    // RC destination, from RTR
  OutLink *link = nullptr;         // to peer, once up
  const Mirror *mirror = nullptr;  // of peer's tables, once linked
  uint64_t peer_nonce = 0;
  uint32_t epoch = 0;  // the connection, as requests name it (bumped at RTR)
  // As a target: 0, or the epoch << 32 | PSN of the request refused for want
  // of a receive (RNR); until it comes again, later ones are dropped.
  std::atomic<uint64_t> resume{0};

  SpinLock sq_mu;    // posting and executing sends
  SpinLock rq_mu;    // posting receives
  WqeQueue backlog;  // WRs waiting for RNR/transport retries or RTS
  // WRs executed and not completed yet, in order: waiting for the target's
  // answer, or done and waiting for those before them.
  WqeQueue sent;
  uint32_t unanswered = 0;  // of those: requests waiting for their answer
  uint32_t next_psn = 0;    // of the last request, never 0
  uint64_t sq_posted = 0;   // WRs posted since RESET
  bool drain_notify = false;
  bool errored = false;  // entered ERR since RESET (its events raised), with sq_mu
  // A WR failed here behind requests not answered yet: nothing more goes out
  // (the QP fails when the answers reach it), with sq_mu.
  bool halted = false;
  // Since when nothing could be put on the link (not up yet, or its lane full), with
  // sq_mu; 0 while things go out.
  uint64_t busy_since_ns = 0;
  // When the progress thread looks at the QP at the latest (0: it does not),
  // with sq_mu: a request that needs a look no sooner asks for none (a
  // SEND per round trip asked for one each time, under Node::prog_mu_).
  uint64_t watched_at = 0;
  bool retired = false;  // taken out of the tables for destruction, with Node::prog_mu_
  QpStats *stats;        // its slot of AreaRoot::qp_stats

  ibv_qp_state state() const { return static_cast<ibv_qp_state>(sh->state.load()); }
};

// --- verbs, as the glue calls them; errno values returned, 0 on success ---
Pd *alloc_pd(Context *ctx, int *err);
int dealloc_pd(Pd *pd);
Mr *reg_mr(Pd *pd, void *addr, size_t length, uint64_t iova, int access, int *err);
int rereg_mr(Mr *mr, int flags, Pd *pd, void *addr, size_t length, int access);
int dereg_mr(Mr *mr);
Ah *create_ah(Pd *pd, const ibv_ah_attr *attr, int *err);
int destroy_ah(Ah *ah);

Cq *create_cq(Context *ctx, int cqe, Channel *channel, const ibv_cq_init_attr_ex *ex, int *err);
int destroy_cq(Cq *cq);
int poll_cq(Cq *cq, int n, ibv_wc *wc);
// Whether a completion may wait in the CQ: one load, no lock (a hint; see pcientb.h).
bool cq_pending(Cq *cq);
int req_notify_cq(Cq *cq, bool solicited_only);
int resize_cq(Cq *cq, int cqe);
// Drops a QP's completions not yet polled from a CQ (the QP is being reset or
// destroyed).
void cq_discard_qp(Cq *cq, uint32_t qp_num);

Srq *create_srq(Pd *pd, ibv_srq_init_attr *attr, int *err);
int modify_srq(Srq *srq, const ibv_srq_attr *attr, int mask);
int query_srq(Srq *srq, ibv_srq_attr *attr);
int destroy_srq(Srq *srq);
int post_srq_recv(Srq *srq, const ibv_recv_wr *wr, ibv_recv_wr **bad);

Qp *create_qp(Context *ctx, ibv_qp_init_attr_ex *attr, int *err);
int post_wqes(Qp *qp, SendWqe *wqes, size_t n);  // checked WRs (ibv_wr_* API); ENOMEM: none posted
// The rules a send WR must pass to be posted, for ibv_post_send and
// ibv_wr_complete alike (EINVAL otherwise): the QP's state, the opcode and
// the QP's type (opcodes.hpp), the SGE count, inline data (its size; never
// for READ or atomics), a UD WR's AH.
int check_wqe(Qp *qp, ibv_wr_opcode opcode, unsigned int flags, const ibv_sge *sge,
              uint32_t num_sge, bool has_ah);
inline int check_wqe(Qp *qp, const SendWqe &w) {
  return check_wqe(qp, w.opcode, w.flags, w.sge, w.num_sge, w.ah != nullptr);
}
// check_wqe for an ibv_send_wr, and its SGE list is readable.
int check_send_wr(Qp *qp, const ibv_send_wr *wr);
void set_qp_handle(Qp *qp, ibv_qp *ibv);  // the glue's struct ibv_qp
int modify_qp(Qp *qp, const ibv_qp_attr *attr, int mask);
int query_qp(Qp *qp, ibv_qp_attr *attr, int mask, ibv_qp_init_attr *init);
int destroy_qp(Qp *qp);
int post_send(Qp *qp, const ibv_send_wr *wr, ibv_send_wr **bad);
int post_recv(Qp *qp, const ibv_recv_wr *wr, ibv_recv_wr **bad);

// --- inside the engine ---
// Executes deferred WRs of a QP whose turn has come; returns the time (ns,
// CLOCK_MONOTONIC) of its next attempt, or 0 when nothing waits.
uint64_t progress_qp(Qp *qp);
// Moves a QP to ERR from this process: flushes what it holds.
void qp_enter_error(Qp *qp);
// The answer of target `from` to a request of qp (requester.cpp).
void qp_answer(Qp *qp, const fabric::Peer &from, const AnswerRecord &a);
// Posts a record of len bytes, then the bytes `after` gathers (if any),
// into a peer's lane (its head's seq is set here); false when the lane has
// no room (link.cpp).
struct Gather;
bool lane_put(fabric::Fabric &fab, fabric::Peer &peer, LaneOut &l, RecordHead *rec, size_t len,
              const Gather *after = nullptr, uint64_t *pos = nullptr);
// The QP's WRs are withdrawn (it is destroyed, reset or failed: their buffers
// are the program's again): every request of it whose bytes the target pulls
// and that the target has not taken yet is voided in the lane (its PSN set
// to 0, never a request's), so that the target pulls nothing more for it,
// completes none whose pull the withdrawal overtook, and drops the rest of
// the connection after it. With sq_mu held (requester.cpp).
void withdraw_pulls_locked(Qp *qp);
// Adding a completion to a CQ of this node: claim an entry and fill it in
// place, then commit it, which publishes it and raises the completion event
// the CQ is armed for. cq_claim returns nullptr when the CQ overran (after
// CQ_ERR).
CqEntry *cq_claim(fabric::Fabric &fab, CqShared *cq, uint64_t *pos);
void cq_commit(fabric::Fabric &fab, CqShared *cq, uint64_t pos, bool solicited);
// Writes an event record (a CQ handle, an AsyncRecord) for this process's
// ibv_get_cq_event / ibv_get_async_event; counted in the node's statistics.
void raise_event(fabric::Fabric &fab, const EventFd &to, const void *rec, size_t len);
void init_cq_ex(Cq *cq);

template <typename T, typename I>
T *from_ibv(I *p) {
  return reinterpret_cast<T *>(p);
}

}  // namespace pcientb::engine
