// The SDP socket layer's internals: configuration, the per-connection state, and the
// functions each file provides. Data flows: interpose.cpp (libc entry points, fd table)
// -> handshake.cpp (who gets SDP) -> stream.cpp (the byte stream over one RC QP)
// -> link.cpp (verbs resources); multiplex.cpp makes poll/select/epoll see SDP readiness.
#pragma once

#include <infiniband/verbs.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

#include <atomic>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "adaptive.hpp"
#include "pcientb/sdp.h"

namespace sdp {

// ---- config.cpp --------------------------------------------------------------------------
struct Config {
  bool enabled = true;  // PCIENTB_SDP=off takes nothing
  bool log = false;     // PCIENTB_SDP_LOG=1
  // PCIENTB_SDP_ZCOPY_THRESH: bytes, 0 (never), or `auto` (SDP_ZCOPY_AUTO, adaptive.cpp).
  // See NOTES.md for the crossover here.
  // 2 MiB: the best single threshold of scripts/sdp-bench.sh's sweep (1-8 connections).
  int zcopy_thresh = 2 << 20;
  uint32_t ring_bytes = 1u << 20;  // PCIENTB_SDP_RING (receive ring per direction)
  int spin_us = 50;                // PCIENTB_SDP_SPIN_US: busy-poll before sleeping (least)
  std::string fabric;              // the provider's (pcientb_fabric_name)
  // The fabric as discovery names carry it: the name, or a hash of a long one (an abstract
  // socket name holds 107 bytes, and a cut one could meet another fabric's).
  std::string fabric_tag;
  std::string stats_path;  // PCIENTB_SDP_STATS
};
const Config &config();
// A function the provider exports (pcientb.h), or nullptr: it is loaded by libibverbs or
// the preload library, not linked, so it is found by name.
void *provider_symbol(const char *name);

enum class Role { kServer, kClient };
// Whether the switch rules give this connection to SDP. `reason` names the rule that
// decided when the answer is no.
bool rules_allow(Role role, const sockaddr *addr, socklen_t len, const char **reason);

void logf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void die_internal(const char *what);

// ---- link.cpp: verbs resources of one connection -----------------------------------------
// What one side tells the other in the handshake.
struct LinkInfo {
  uint8_t gid[16];
  uint32_t lid;
  uint32_t qpn;
  uint32_t psn;
  uint32_t ring_rkey;
  uint64_t ring_addr;
  uint32_t ring_bytes;
  uint32_t ack_rkey;
  uint64_t ack_addr;
  uint32_t recv_depth;
  uint32_t uid;  // fabrics are per user: the ends must run as the same one
};

// Counters a receiver returns to its sender (written into the sender's ack slot).
struct AckBlock {
  uint64_t consumed;      // ring bytes of the sender's stream this side has consumed
  uint64_t polled;        // write-with-immediate completions this side has reaped
  uint64_t zc_done;       // SrcAvail advertisements of the sender fully read by this side
  uint64_t cancel;        // receiver -> sender: the SrcAvail seq whose cancel was answered
  uint64_t cancel_bytes;  // how much of that SrcAvail had been read when cancelled
  uint64_t cancel_req;    // sender -> receiver: please stop reading SrcAvail seq <= this
  // Write ZCopy: the receive buffer this side offers the sender (SinkAvail; seq 0: none),
  // and `at`, the ring bytes of the sender's stream it had received then: the sender may
  // write into it only if it has sent nothing since. The check word tells a block torn by
  // the next ack's write from a whole one.
  uint64_t sink_seq;
  uint64_t sink_addr;
  uint32_t sink_rkey;
  uint32_t sink_len;
  uint64_t sink_at;
  uint64_t sink_check;
};

// The ack page of a link: the peer's acks, this side's ack source, then the claim word of
// this side's SinkAvail (changed by atomics only: seq = open, | kSinkTaken = the sender
// claimed it by RDMA compare-and-swap, | kSinkWithdrawn = this side took it back), then
// where this side's own claim of the peer's SinkAvail returns the old value.
struct AckPage {
  AckBlock ack[2];
  uint64_t sink_claim;
  uint64_t claim_result;
};
constexpr uint64_t kSinkTaken = 1ull << 63;
constexpr uint64_t kSinkWithdrawn = 1ull << 62;

struct CqGroup;
struct Inbox;

struct Link {
  CqGroup *group = nullptr;             // the CQ and channel it shares with other links (link.cpp)
  Inbox *inbox = nullptr;               // its completions, taken from the group's CQ
  ibv_comp_channel *channel = nullptr;  // the group's
  ibv_cq *cq = nullptr;                 // the group's: poll it through link_poll() only
  ibv_qp *qp = nullptr;
  char *ring = nullptr;  // this side's receive ring (the peer writes into it)
  ibv_mr *ring_mr = nullptr;
  char *mirror = nullptr;  // what this side writes into the peer's ring is staged here
  ibv_mr *mirror_mr = nullptr;
  int kick_fd = -1;         // eventfd: wakes this socket's other sleepers when one took a wakeup
  AckPage *page = nullptr;  // ack[0] written by the peer, ack[1] this side's ack source
  ibv_mr *ack_mr = nullptr;
  // Windows this side exposed (pcientb_sdp_expose): registered until the link goes, since
  // the peer may write into one until it has seen the next.
  std::vector<ibv_mr *> window_mrs;
  uint32_t ring_bytes = 0;
  uint32_t recv_depth = 0;
  uint32_t send_depth = 0;
  uint32_t max_inline = 0;
  LinkInfo local{};
  LinkInfo remote{};
};

// Creates the QP and buffers, joins a CQ group; fills link.local. False (errno set) on
// failure. `sleepers`: the owner's count of threads asleep on it (woken by its kick when
// another thread takes its completions from the shared CQ).
bool link_create(Link &link, std::atomic<int> *sleepers);
// Whether this process can open pcientb0 (opens it the first time): a socket is offered to
// SDP only then, since a peer that saw the offer expects the handshake.
bool link_device_usable();
// Moves the QP to RTS toward link.remote and posts the receives.
bool link_connect(Link &link);
void link_destroy(Link &link);
bool link_post_recvs(Link &link, uint32_t n);
// Up to max completions of this link (polling the group's CQ for all its links).
int link_poll(Link &link, ibv_wc *wc, int max);
// Takes what every group's CQ holds into the links' inboxes (CQs that the provider says are
// empty are not polled).
void link_dispatch_all();
// Consumes the wakeups of the link's group, or of the group whose completion channel is
// channel_fd (non-blocking), and hands what woke them to the inboxes.
void link_drain(Link &link);
void link_drain_channel(int channel_fd);
// Whether the link's inbox holds completions, without a lock (true if it has none yet).
bool link_has_news(const Link &link);
// Whether this side may offer its receive buffers (Write ZCopy): the device's atomics are
// atomic with the CPU's (a pcientb device's are, whatever it says: see link.cpp), so
// taking an offer back by a local compare-and-swap races fairly with the sender's claim.
bool link_sink_ok();
// Registers user memory for one zero-copy transfer (the provider caches what it moved, so
// registering the same buffer again is cheap; a cache here would go stale when the program
// frees and maps again at the same address).
ibv_mr *reg_user(void *addr, size_t len);

// ---- stream.cpp: the byte stream of one SDP connection -----------------------------------
struct Sock;

// Blocking/non-blocking send and receive of a connected SDP socket; return bytes or -1/errno.
ssize_t stream_send(Sock &s, const iovec *iov, int iovcnt, int flags);
ssize_t stream_recv(Sock &s, const iovec *iov, int iovcnt, int flags);
// Readiness as poll() reports it (POLLIN/POLLOUT/POLLRDHUP/POLLHUP/POLLERR), after progress.
// *changes: s.mu.changes() as this call left it (see SockMutex).
// *on_tcp: the connection went back to TCP (stream_leave, then the kernel serves it).
short stream_poll(Sock &s, uint64_t *changes = nullptr, bool *on_tcp = nullptr);
// Arms the socket's CQ so that the next arrival raises its channel. Returns the CQ it armed
// (nullptr: no link yet), which the caller compares with stream_cq after its last look,
// and in *channel_fd the channel to sleep on, read with it (another thread may end the link
// meanwhile).
ibv_cq *stream_arm(Sock &s, int *channel_fd = nullptr);
// The socket's CQ now: a last look before sleeping may have created the link (a handshake
// it advanced), whose CQ nobody armed and whose channel nobody watches.
ibv_cq *stream_cq(Sock &s);
// The kernel reported the socket's own descriptor readable (hup: its end closed): has the
// peer closed it?
void stream_check_peer(Sock &s, bool hup = false);
// Consumes a kick (another thread took this socket's wakeup).
void stream_take_kick(Sock &s);
int stream_shutdown(Sock &s, int how);
// True when the connection lingers (see stream_linger_wait): its link and descriptor stay.
bool stream_close(Sock &s);
// Hands the connection back to TCP (this process stops being its SDP end while the kernel
// socket lives on: in a forked child, or in this process after exec), then closes the link.
void stream_revert(Sock &s);
// Returned by stream_send/stream_recv: the call belongs to the kernel (the peer handed the
// connection back to TCP); the caller leaves the layer first when stream_on_tcp() says so.
constexpr ssize_t kServedByKernel = -2;
// Whether the peer's hand-back is complete here (its records before it all consumed).
bool stream_on_tcp(Sock &s);
// The layer lets go of a connection that went back to TCP; true for the one call that did
// (it then forgets the socket).
bool stream_leave(Sock &s);
// Closed connections whose peer has not read everything stay (their rings, their TCP
// socket) until it has, or handed them back, or 10 s passed: the flusher thread sees to
// them; at exit the process waits for them up to wait_ms.
void stream_linger_wait(int wait_ms);
int stream_fionread(Sock &s);
// Extended sockets (pcientb/sdp.h): 0, or -1 with errno.
int stream_expose(Sock &s, void *addr, uint64_t len);
int stream_write_window(Sock &s, const void *addr, uint64_t len, uint64_t offset);
// Has the flusher thread post this socket's coalesced sends soon (s.mu held).
void flusher_add(Sock &s);

// ---- handshake.cpp -------------------------------------------------------------------------
// Listener side: marks the port as served by SDP on this fabric.
void handshake_listen(Sock &s);
// Client side, before the kernel connect: decides whether to try SDP and if so binds and
// leaves the marker. After a successful connect, sends Hello.
void handshake_before_connect(Sock &s, const sockaddr *addr, socklen_t len);
void handshake_after_connect(Sock &s);
// Server side, on a freshly accepted socket: SDP pending, or TCP.
void handshake_accepted(Sock &s);
// Moves the handshake on: sends Hello, reads Hello, Accept/Decline or Confirm as far as
// what has arrived allows, without waiting. Returns false with errno EAGAIN when the peer's
// next message has not come yet (its program has not used the connection).
bool handshake_progress(Sock &s);
// Before exec, for a socket the new image keeps: a handshake this image started is ended
// (abandoned, or finished within a bounded wait); true when it ended as SDP.
bool handshake_before_exec(Sock &s);
// At start, over the descriptors inherited from the previous image (exec): a socket a
// client with the layer negotiates over, or a listener, is taken up as accept() or listen()
// would; a client socket whose handshake that image abandoned gets its marker back.
void handshake_adopt(const std::vector<int> &fds);
void handshake_forget(Sock &s);  // closes the listener mark / client marker

// ---- processes (process.cpp) ---------------------------------------------------------------
// Forks this process descends through: a child's count is one more than its parent's was.
// Bumped in the child's fork handler (no heap: the provider has not yet made the child's
// registered memory private then). What a socket made or negotiated in another generation
// belongs to an ancestor.
extern std::atomic<uint32_t> g_fork_gen;
// Bumped whenever another process may have got this one's descriptors (fork, spawn, a
// vfork()ed child's exec): a socket made before the last bump may be held elsewhere.
extern std::atomic<uint64_t> g_share_epoch;

// ---- the socket ---------------------------------------------------------------------------
constexpr int kThreshUnset = INT_MIN;  // a socket's threshold: the configured one

enum class State {
  kCandidate,  // a TCP socket the layer may still take (not connected)
  kListener,
  // The handshake runs at the first use of the connection, in the process that uses it: a
  // server that forks a child per connection has the child negotiate, with its own QP.
  kClientPending,  // connected, client's marker held, Hello not sent yet
  kServerPending,  // accepted from a client with the layer, Hello not read yet
  kClientHello,    // client sent Hello, waits for Accept/Decline
  kServerWait,     // server sent Accept, waits for the client's Confirm
  kSdp,
};

// A socket's lock, counting its releases: whoever saw the socket idle (epoll's scan) knows
// without the lock whether anything may have changed since. The count is written under the
// lock (a plain store): the data path pays no locked instruction for it.
class SockMutex {
 public:
  void lock() { m_.lock(); }
  bool try_lock() { return m_.try_lock(); }
  void unlock() {
    changes_.store(changes_.load(std::memory_order_relaxed) + 1, std::memory_order_release);
    m_.unlock();
  }
  uint64_t changes() const { return changes_.load(std::memory_order_acquire); }

 private:
  std::mutex m_;
  std::atomic<uint64_t> changes_{0};
};
using SockLock = std::unique_lock<SockMutex>;

// ---- signals.cpp: blocked calls and SA_RESTART --------------------------------------------
// Before a wait spins or sleeps: forget the signals this thread saw.
void signal_wait_begins();
// Whether a handler without SA_RESTART ran on this thread since (the wait ends with EINTR).
bool signal_interrupts();
// After the sleep ended with EINTR: whether the call goes on, as the kernel's would (every
// handler that ran on this thread meanwhile has SA_RESTART).
bool signal_restarts();

uint64_t now_ns();  // CLOCK_MONOTONIC (stream.cpp)

struct Sock : std::enable_shared_from_this<Sock> {
  explicit Sock(int fd_, int domain_) : fd(fd_), domain(domain_) {}
  ~Sock();
  SockMutex mu;
  // The layer's own descriptor of the kernel TCP socket (a dup of the program's): the
  // program may dup and close its descriptors in any order. It gives addresses and options,
  // carries the handshake, and says when the peer's process has gone.
  const int fd;
  int refs = 0;  // the program's descriptors naming this socket
  // Let go of by the layer (handed back, left to TCP, closed): never named again, and its
  // descriptor closed once, by whoever set this (under the table's lock).
  bool forgotten = false;
  uint64_t ino = 0;  // the kernel socket's inode: how other processes name it
  pid_t owner = 0;   // the process that negotiated the link
  // A socket an ancestor may hold as an SDP connection (inherited across exec): the kernel
  // serves it here; at its first use the ancestors are asked to hand it back to TCP.
  bool ask_ancestors = false;
  const uint32_t made_gen = g_fork_gen.load(std::memory_order_relaxed);
  const uint64_t made_epoch = g_share_epoch.load(std::memory_order_relaxed);
  // The generation whose handshake made the link (~0u: no link): in a forked child the QP
  // is the parent's, and the child uses the socket as TCP.
  std::atomic<uint32_t> link_gen{~0u};
  const int domain;
  State state = State::kCandidate;
  Role role = Role::kClient;
  bool nonblocking = false;
  int zcopy_thresh = kThreshUnset;  // SDP_ZCOPY_THRESH set on this socket
  uint64_t auto_epoch = 0;          // the last `auto` epoch a send of this socket counted in
  uint32_t auto_unmeasured = 0;     // `auto` sends since the last measured one
  int mark_fd = -1;                 // listener mark or client marker (abstract AF_UNIX name), held
  bool connecting = false;          // a non-blocking connect is in progress (client)
  Link link;

  // Transmit side: what this side has put into the peer's ring.
  uint64_t tx_pos = 0;        // ring bytes written into the mirror (records included)
  uint64_t tx_posted = 0;     // ring bytes whose writes are posted (the rest coalesces)
  uint64_t pend_rec = ~0ull;  // position of the DATA record small sends still append to
  uint64_t skip_at = ~0ull;   // a rewind's pad, not yet passed by tx_posted (stream.cpp)
  bool in_flush_list = false;
  bool force_signal = false;     // the next post is signaled (close waits for it)
  uint64_t signaled_posted = 0;  // signaled send-queue posts, and their completions polled:
  uint64_t signaled_done = 0;    // in order, so post n has landed once signaled_done >= n
  uint64_t last_write_no = 0;    // the FIN's or REVERT's post (wait_last_write)
  bool reset_reported = false;   // ECONNRESET was returned once; EPIPE from then on
  int64_t rcv_timeo_ns = 0, snd_timeo_ns = 0;  // SO_RCVTIMEO / SO_SNDTIMEO (0: none)
  std::atomic<int> sleepers{0};  // threads asleep in the kernel on this socket's wakeups
  uint32_t burst = 0;            // sends since the last receive or poll
  uint64_t tx_msgs = 0;          // write-with-immediate operations posted
  uint64_t peer_consumed = 0;    // from the peer's acks
  uint64_t peer_polled = 0;
  uint64_t peer_zc_done = 0;
  uint64_t src_seq = 0;     // SrcAvail advertisements sent
  uint64_t zc_waiting = 0;  // the one whose send() waits for the peer to read it (0: none)
  uint32_t unsignaled = 0;  // posts since the last signaled one
  uint32_t sq_used = 0;     // posted and not known complete
  bool fin_sent = false;
  // The peer handed the connection back to TCP: this side's sends go to the kernel socket,
  // after the backlog (what the peer had not read, sent again; written without waiting).
  std::atomic<bool> tx_tcp{false};
  std::string backlog;
  size_t backlog_off = 0;
  uint64_t linger_until_ns = 0;   // closed with data the peer has not read: kept until then
  bool linger_closed_fd = false;  // the lingering's end closed fd (under mu)

  // Receive side: the records the peer wrote into this side's ring.
  uint64_t rx_produced = 0;  // ring bytes announced by the peer's immediates
  uint64_t rx_pos = 0;       // ring bytes consumed (whole records)
  uint64_t rx_scan = 0;      // records looked at for a FIN (poll reports it before recv)
  bool fin_arrived = false;
  uint64_t revert_at = ~0ull;  // ring position of the peer's REVERT (nothing follows it)
  uint64_t peer_win_addr = 0, peer_win_len = 0;  // the window the peer exposed (len 0: none)
  uint32_t peer_win_rkey = 0;
  uint32_t window_writes = 0;  // one-sided writes posted, not complete
  bool window_failed = false;  // one of them completed in error
  // The kernel socket holds data before the peer's REVERT arrived (its forked child writes):
  // watched for its end only, or the waits would spin.
  std::atomic<bool> tcp_early{false};
  uint32_t rec_off = 0;  // payload bytes of the record at rx_pos already delivered
  uint64_t polled = 0;   // immediates reaped
  uint64_t acked_consumed = 0, acked_polled = 0;
  uint64_t zc_done = 0;  // SrcAvails of the peer fully read
  bool ack_wanted = false;
  bool peer_fin = false;
  bool rd_shut = false;
  uint32_t reads_pending = 0;    // RDMA READs posted by this side, not complete
  uint64_t peer_cancel_req = 0;  // the peer cancelled its SrcAvails up to this seq
  uint64_t cancel_answered = 0;
  uint64_t skip_src_upto = 0;  // cancelled SrcAvails of the peer: skip when reached
  uint64_t cancel_req = 0;     // this side's cancel request (in its acks)
  uint64_t peer_cancel = 0, peer_cancel_bytes = 0;  // the peer's answer

  // Write ZCopy, sink side: the receive buffer a blocking recv offers the peer (seq 0: none).
  struct SinkAvail {
    uint64_t seq = 0, addr = 0, at = 0;
    uint32_t rkey = 0, len = 0;
  } sink;
  uint64_t sink_made = 0;  // SinkAvails made
  // One the link's end (close, hand-back by another thread) found taken: its bytes, placed,
  // for the recv that offered it.
  uint64_t sink_ended_seq = 0, sink_ended_bytes = 0;
  // Source side: the peer's offer (from its acks), the last one this side tried to claim.
  SinkAvail peer_sink;
  uint64_t sink_tried = 0;
  uint32_t claims_pending = 0;  // this side's compare-and-swaps not complete
  uint32_t wz_writes = 0;       // this side's writes into the peer's offered buffer, not complete
  bool wz_failed = false;       // one of them completed in error
  // From a claim until its WR_COMPL is placed: nothing else enters the ring (tx_ready,
  // put_record and append_data say no), while the claimer waits without the lock.
  bool wz_claiming = false;
  // The last record with data of the peer's that this side took was zero copy (SrcAvail,
  // WR_COMPL): its large sends block, and a waiting recv offers its buffer (else a program
  // of small messages into a big buffer would register it at every wait).
  bool peer_zcopy = false;
  // The last record with data this side took came zero copy (a SrcAvail read whole, a
  // WR_COMPL; any DATA ends it): a receive that waits registers its buffer before it spins.
  bool zc_last = false;
  // A receive is in a READ of the peer's buffer, its ring position in its own hands (the
  // lock released): other receives take nothing until it has stored it.
  bool rx_busy = false;

  int error = 0;                 // sticky: ECONNRESET/EPIPE once the connection broke
  bool peer_gone = false;        // the kernel socket saw the peer's end
  int64_t peer_checked_ms = -1;  // when an empty non-blocking receive last looked at it

  pcientb_sdp_stats stats{PCIENTB_SDP_PATH_PENDING, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  const char *reason = "";
  bool stats_written = false;
};

// The threshold a send on `s` goes by: bytes, 0 (BCopy only) or SDP_ZCOPY_AUTO.
inline int zcopy_threshold(const Sock &s) {
  return s.zcopy_thresh != kThreshUnset ? s.zcopy_thresh : config().zcopy_thresh;
}

// A forked child's copy of a connection (or handshake) whose QP is its parent's.
inline bool inherited(const Sock &s) {
  const uint32_t g = s.link_gen.load(std::memory_order_relaxed);
  return g != ~0u && g != g_fork_gen.load(std::memory_order_relaxed);
}
// Made by this process (not by an ancestor before a fork).
inline bool made_here(const Sock &s) {
  return s.made_gen == g_fork_gen.load(std::memory_order_relaxed);
}
// Another process may hold its kernel socket too: letting go of it hands it back to TCP.
inline bool maybe_shared(const Sock &s) {
  return s.made_epoch != g_share_epoch.load(std::memory_order_relaxed);
}

// Connected and SDP, or negotiating to be.
inline bool sdp_like(const Sock &s) {
  return s.state != State::kCandidate && s.state != State::kListener;
}
inline bool negotiating(const Sock &s) {
  return sdp_like(s) && s.state != State::kSdp;
}

// The fd table (interpose.cpp).
std::shared_ptr<Sock> find_sock(int fd);
// No program descriptor names s any more, nor will: the layer closes s.fd.
bool sock_released(const Sock &s);
void forget_sock(Sock &s);  // the socket stays on the kernel's TCP: the layer lets go of it
// A connection the peer handed back to TCP leaves the layer once what came before is read.
void leave_layer(Sock &s);
void write_stats(Sock &s);
// Before exec or daemon(), which end this process image without its exit handlers: its
// totals line (if it had connections), then zero.
void stats_end_image();
// A connection went SDP: make sure the process's exit closes such connections as TCP's would.
void note_sdp_connection();
// Takes fd into the table (a socket inherited across exec: process.cpp).
std::shared_ptr<Sock> track_fd(int fd, int domain, bool nonblocking);
void alias_fd(int fd, const std::shared_ptr<Sock> &s);  // another descriptor of the socket
// Each socket of the table once, with whether one of its descriptors survives exec.
struct SockUse {
  std::shared_ptr<Sock> s;
  bool survives_exec;
};
std::vector<SockUse> table_snapshot();
void multiplex_forget(Sock &s, bool program_keeps_fd);  // multiplex.cpp

// ---- process.cpp: fork, exec, spawn, daemon ----------------------------------------------
// At load: the state of this process; sockets a previous image left pending are taken up.
void process_start();
// Asks process `owner` (kAncestors: each ancestor) to hand the connection of kernel socket
// `ino` back to TCP: it may hold it as an SDP connection while this process uses the socket.
constexpr pid_t kAncestors = -1;
void ask_hand_back(pid_t owner, uint64_t ino);
// Hands this process's SDP connection `s` back to TCP now; the kernel serves its descriptor
// from then on (another process, or stdio, uses it).
void hand_back_sock(Sock &s);
// The first SDP connection of this process: it takes such requests from now on.
void hand_back_listen();
// A vfork()ed child (memory shared with its parent, descriptors its own): calls it makes on
// descriptors go to the kernel only, the layer's table being its parent's.
bool in_vfork_child();
void multiplex_fork_lock(bool lock);  // the epoll sets, over fork() (multiplex.cpp)
void flusher_fork_lock(bool lock);    // the flusher's start, over fork() (stream.cpp)
void auto_fork_lock(bool lock);       // the `auto` threshold's state, over fork() (stream.cpp)
void process_fork_parent();           // fork handlers: counters only, no heap
void process_fork_child();
// Closes every SDP connection as exit would (FIN, or the hand-back where shared); waits a
// little for connections closed with data the peer has not read.
void close_all_at_exit();

// The real libc functions (interpose.cpp).
struct Real {
  int (*socket)(int, int, int);
  int (*connect)(int, const sockaddr *, socklen_t);
  int (*listen)(int, int);
  int (*accept4)(int, sockaddr *, socklen_t *, int);
  int (*close)(int);
  int (*shutdown)(int, int);
  ssize_t (*read)(int, void *, size_t);
  ssize_t (*write)(int, const void *, size_t);
  ssize_t (*recvmsg)(int, msghdr *, int);
  ssize_t (*sendmsg)(int, const msghdr *, int);
  ssize_t (*recvfrom)(int, void *, size_t, int, sockaddr *, socklen_t *);
  ssize_t (*sendto)(int, const void *, size_t, int, const sockaddr *, socklen_t);
  int (*poll)(struct pollfd *, unsigned long, int);
  int (*epoll_ctl)(int, int, int, struct epoll_event *);
  int (*epoll_wait)(int, struct epoll_event *, int, int);
  int (*fcntl)(int, int, ...);
  int (*ioctl)(int, unsigned long, ...);
  int (*dup)(int);
  int (*dup3)(int, int, int);
  int (*dup2)(int, int);
  int (*getsockopt)(int, int, int, void *, socklen_t *);
  int (*setsockopt)(int, int, int, const void *, socklen_t);
  int (*bind)(int, const sockaddr *, socklen_t);
  ssize_t (*readv)(int, const iovec *, int);
  ssize_t (*writev)(int, const iovec *, int);
  ssize_t (*sendfile)(int, int, off_t *, size_t);
  int (*ppoll)(struct pollfd *, unsigned long, const timespec *, const sigset_t *);
  int (*epoll_pwait)(int, struct epoll_event *, int, int, const sigset_t *);
};
const Real &real();

// Full-length kernel I/O on the TCP socket (handshake messages); -1/errno on failure or EOF
// (ECONNRESET). timeout_ms < 0 waits for ever.
bool tcp_write_all(int fd, const void *buf, size_t len, int timeout_ms);
bool tcp_read_all(int fd, void *buf, size_t len, int timeout_ms);

}  // namespace sdp
