// The byte stream of one SDP connection over its RC QP.
//
// Each side owns a receive ring that only the peer writes, by RDMA WRITE WITH IMMEDIATE: a
// write carries whole records (16-byte header, payload padded to 16) and its immediate says
// how many ring bytes it adds, so the completion is what tells the receiver. Records: DATA
// (BCopy payload), SRC_AVAIL (Read ZCopy: the sink RDMA-READs the source's buffer), FIN
// (no more data: shutdown or close), PAD (skip to the ring's start), REVERT (the connection
// goes back to TCP, see stream_revert), WINDOW (a buffer the peer may RDMA-WRITE into:
// extended sockets, pcientb_sdp_expose), WR_COMPL (Write ZCopy: this many bytes were written
// into the buffer the receiver offered).
// A DATA record's arg says how far its sender had consumed the other direction's stream:
// request/response traffic learns from each answer that its ring was read to the end, with
// no ack. A sender that knows so starts its next DATA record at the ring's start (rewinds)
// instead of walking through every page of the ring: the pages stay warm (a page touched the
// first time costs a fault on both sides, ~10 us on these VMs). The rest of the ring is
// skipped: a pad in the mirror, never written into the peer's ring; the first write at the
// start carries kImmRewind, and the receiver, which has read everything before (the
// sender's condition), moves its positions past the ring's end. The sender counts the skip
// as read at once: no record is ever read there, so its credit stays whole.
// The receiver returns credits with an ack: a write with immediate kImmAck of an AckBlock
// into the sender's ack slot (ring bytes consumed, immediates reaped, SrcAvails read, cancel
// answers, the receive buffer it offers). A sender never has more ring bytes or immediates
// outstanding than the peer has room for, so no write ever meets a full ring or an empty
// receive queue.
// Write ZCopy: a blocking recv with nothing to deliver offers its buffer in an ack
// (SinkAvail), with the ring position it had reached. A blocking send that has sent nothing
// since claims it by RDMA compare-and-swap on the receiver's claim word, RDMA-WRITEs into it
// and puts a WR_COMPL record where its next record goes. The receiver goes by the first
// record there: WR_COMPL means its buffer holds the bytes, anything else that the offer was
// not taken, and it takes the offer back by a compare-and-swap of its own; one that fails
// means a claim won, and the WR_COMPL is on its way (see sink_resolve).
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <optional>
#include <thread>
#include <vector>

#include "bulk_copy.hpp"
#include "sdp.hpp"
#include "spin.hpp"

namespace sdp {

using pcientb::bulk_copy;

uint64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
}

namespace {

enum RecType : uint8_t {
  kData = 1,
  kPad = 2,
  kSrcAvail = 3,
  kFin = 4,
  kRevert = 5,
  kWindow = 6,
  kWrCompl = 7,  // arg: the SinkAvail's seq; payload: the bytes written (uint64_t)
};
enum RecFlag : uint8_t { kWantAck = 1 };
struct Rec {
  uint32_t len;  // payload bytes
  uint8_t type;
  uint8_t flags;
  uint16_t rsv;
  uint64_t arg;  // SRC_AVAIL: its sequence number
};
static_assert(sizeof(Rec) == 16);
struct SrcAvail {  // also a WINDOW's payload
  uint64_t addr;
  uint32_t rkey;
  uint32_t len;
};
// Completions told apart by their wr_id (the ring's writes count unsignaled posts there): a
// one-sided write, a claim of the peer's SinkAvail, a write into it.
constexpr uint64_t kWindowWrite = 1ull << 63;
constexpr uint64_t kClaim = 1ull << 62;
constexpr uint64_t kSinkWrite = 1ull << 61;
constexpr uint64_t kWrComplBytes = 32;  // the record and its payload
// REVERT's payload: how far the side handing back had consumed the other's stream (a record
// position, and the bytes of that record already delivered or read).
struct RevertAt {
  uint64_t rx_pos;
  uint64_t rec_off;
};

constexpr uint32_t kImmAck = 0x80000000u;
constexpr uint32_t kImmRewind = 0x80000000u;  // with ring bytes (never 0): a rewind before them
constexpr uint64_t kRewindAt = 16384;         // a ring position from which a record rewinds
constexpr uint64_t kCoalesceBytes = 16384;
constexpr uint32_t kBurstImmediate = 4;
constexpr uint64_t kRound = 16;

uint64_t round16(uint64_t n) {
  return (n + kRound - 1) & ~(kRound - 1);
}

uint64_t credit_bytes(const Sock &s) {
  return s.link.remote.ring_bytes - (s.tx_pos - s.peer_consumed);
}
uint64_t credit_msgs(const Sock &s) {
  const uint64_t peer = s.link.remote.recv_depth - (s.tx_msgs - s.peer_polled);
  // The send queue needs room too: its WRs are freed as their completions are polled, which
  // can come after the peer's ack of the messages (their answers still on the way).
  uint64_t sq = s.link.send_depth > s.sq_used ? s.link.send_depth - s.sq_used : 0;
  if (s.wz_claiming) sq -= std::min<uint64_t>(sq, 1);  // the claim's write goes next
  return std::min(peer, sq);
}
// Data (and zero-copy advertisements) leave room for a FIN and a REVERT, so that close never
// waits on a peer that does not read: the ring bytes of each with a pad before it.
constexpr uint64_t kFinReserve = 96;
uint64_t data_credit(const Sock &s) {
  uint64_t c = credit_bytes(s);
  return c > kFinReserve ? c - kFinReserve : 0;
}

bool flush(Sock &s, bool fin = false);
void linger_add(Sock &s);  // below, with the flusher

void set_error(Sock &s, int err) {
  if (!s.error) {
    s.error = err;
    logf("fd %d: connection broken (%s)", s.fd, strerror(err));
  }
}

// Posts one write with immediate of `len` bytes from `src` (mirror or ack source) to the
// peer at `remote`. Signals one post in 64 so the send queue is reaped.
bool post_write(Sock &s, const void *src, uint32_t lkey, uint32_t len, uint64_t remote,
                uint32_t rkey, uint32_t imm) {
  Link &l = s.link;
  ibv_sge sge{reinterpret_cast<uintptr_t>(src), len, lkey};
  ibv_send_wr wr{};
  wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
  wr.imm_data = htonl(imm);
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.wr.rdma.remote_addr = remote;
  wr.wr.rdma.rkey = rkey;
  if (len <= l.max_inline) wr.send_flags |= IBV_SEND_INLINE;
  ++s.unsignaled;
  const bool last = s.force_signal;
  const bool signaled = s.unsignaled >= 64 || s.sq_used + 1 >= l.send_depth / 2 || last;
  if (signaled) {
    s.force_signal = false;
    wr.send_flags |= IBV_SEND_SIGNALED;
    wr.wr_id = s.unsignaled;
    s.unsignaled = 0;
  }
  ibv_send_wr *bad = nullptr;
  if (int e = ibv_post_send(l.qp, &wr, &bad)) {
    set_error(s, e == ENOMEM ? EIO : ECONNRESET);
    return false;
  }
  if (signaled) {
    ++s.signaled_posted;
    if (last) s.last_write_no = s.signaled_posted;
  }
  ++s.sq_used;
  ++s.tx_msgs;
  return true;
}

uint64_t sink_check(const AckBlock &a) {
  return (a.sink_seq * 0x9e3779b97f4a7c15ull) ^ a.sink_addr ^
         ((uint64_t(a.sink_rkey) << 32 | a.sink_len) * 31) ^ (a.sink_at * 0xff51afd7ed558ccdull) ^
         0x5344505f53494e4bull;
}

// Posts a signaled work request whose completion (told apart by `tag`) stands for the
// unsignaled posts before it. 0, or the error of ibv_post_send.
int post_signaled(Sock &s, ibv_send_wr &wr, uint64_t tag) {
  wr.send_flags |= IBV_SEND_SIGNALED;
  wr.wr_id = tag | (s.unsignaled + 1);
  ibv_send_wr *bad = nullptr;
  int rc = ibv_post_send(s.link.qp, &wr, &bad);
  if (rc == 0) {
    s.unsignaled = 0;
    ++s.sq_used;
    ++s.signaled_posted;
  }
  return rc;
}

void fill_ack(Sock &s) {
  AckBlock &a = s.link.page->ack[1];
  a.consumed = s.rx_pos;
  a.polled = s.polled;
  a.zc_done = s.zc_done;
  a.cancel_req = s.cancel_req;
  a.sink_seq = s.sink.seq;
  a.sink_addr = s.sink.addr;
  a.sink_rkey = s.sink.rkey;
  a.sink_len = s.sink.len;
  a.sink_at = s.sink.at;
  a.sink_check = sink_check(a);
}

bool send_ack(Sock &s) {
  if (!s.link.qp || inherited(s) || s.tx_tcp) return false;
  if (s.error || credit_msgs(s) < 1) {
    s.ack_wanted = true;  // sent when credits come back
    return false;
  }
  fill_ack(s);
  const Link &l = s.link;
  // Inline: the source may change for the next ack before the fabric reads it.
  if (!post_write(s, &l.page->ack[1], l.ack_mr->lkey, sizeof(AckBlock), l.remote.ack_addr,
                  l.remote.ack_rkey, kImmAck))
    return false;
  s.acked_consumed = s.rx_pos;
  s.acked_polled = s.polled;
  s.ack_wanted = false;
  return true;
}

// After the peer's FIN too: a peer that shut down only its sending side still receives,
// and its acks need this side's receives back.
void maybe_ack(Sock &s) {
  const Link &l = s.link;
  if (s.ack_wanted || s.rx_pos - s.acked_consumed >= l.ring_bytes / 4 ||
      s.polled - s.acked_polled >= l.recv_depth / 4)
    send_ack(s);
}

// The peer asked to cancel its SrcAvails up to peer_cancel_req: answer with how much of the
// one being read (at the ring's head) was read. Never while a READ of it is in flight.
void answer_cancel(Sock &s) {
  if (s.peer_cancel_req <= s.cancel_answered || s.reads_pending) return;
  uint64_t bytes = 0;
  if (s.rx_pos < s.rx_produced) {
    const Rec *r =
        reinterpret_cast<const Rec *>(s.link.ring + (s.rx_pos & (s.link.ring_bytes - 1)));
    // Only the advertisement being cancelled counts (an older one may still wait at the
    // head to be skipped, with its own progress in rec_off).
    if (r->type == kSrcAvail && r->arg == s.peer_cancel_req) bytes = s.rec_off;
  }
  s.skip_src_upto = s.peer_cancel_req;
  s.cancel_answered = s.peer_cancel_req;
  logf("fd %d: peer cancels SrcAvail %llu: %llu bytes were read", s.fd,
       (unsigned long long)s.peer_cancel_req, (unsigned long long)bytes);
  AckBlock &a = s.link.page->ack[1];
  a.cancel = s.cancel_answered;
  a.cancel_bytes = bytes;
  s.ack_wanted = true;
  send_ack(s);
}

void take_revert(Sock &s);

// A WINDOW record takes effect where it is in the stream: when the program reads past it (a
// write after reading "use this window" goes where the exposing side meant, even if a newer
// window has arrived since). The first one also when it reaches the ring's head, so that a
// side that only writes gets a window.
void take_window(Sock &s, const char *payload) {
  SrcAvail w;
  memcpy(&w, payload, sizeof w);
  s.peer_win_addr = w.addr;
  s.peer_win_rkey = w.rkey;
  s.peer_win_len = w.len;
}

// Consumes the records at the ring's head that carry no bytes and change nothing there: PADs,
// and the first WINDOW when no window is in effect.
void skip_empty_records(Sock &s) {
  const Link &l = s.link;
  const uint64_t mask = l.ring_bytes - 1;
  while (s.rx_pos < s.rx_produced && s.rec_off == 0 && s.rx_pos != s.revert_at) {
    const Rec *r = reinterpret_cast<const Rec *>(l.ring + (s.rx_pos & mask));
    if (r->type == kWindow && !s.peer_win_len)
      take_window(s, l.ring + ((s.rx_pos + kRound) & mask));
    else if (r->type != kPad)
      break;
    s.rx_pos += kRound + round16(r->len);
  }
}

// The first record from the ring's head that a receive would return something for (DATA,
// SRC_AVAIL, FIN, REVERT): WINDOWs and PADs before it are not news (poll, peek, and the
// checks of what the peer does next look past them), or nullptr.
const Rec *data_head(const Sock &s) {
  const uint64_t mask = s.link.ring_bytes - 1;
  for (uint64_t pos = s.rx_pos; pos < s.rx_produced;) {
    const Rec *r = reinterpret_cast<const Rec *>(s.link.ring + (pos & mask));
    if ((r->type != kWindow && r->type != kPad) || pos == s.revert_at) return r;
    pos += kRound + round16(r->len);
  }
  return nullptr;
}

// Reaps completions: immediates (ring bytes or acks), send-queue progress, errors. Returns
// how many it took.
int progress(Sock &s) {
  Link &l = s.link;
  // A fork()ed child's copy must not take the parent's completions (the CQ is shared memory).
  if (!l.cq || inherited(s)) return 0;
  int took = 0;
  ibv_wc wc[32];
  uint32_t recvs = 0;
  bool writes_failed = false;
  for (;;) {
    int n = link_poll(l, wc, 32);
    if (n <= 0) break;
    took += n;
    for (int i = 0; i < n; ++i) {
      const ibv_wc &w = wc[i];
      if (w.status != IBV_WC_SUCCESS) {
        if (w.opcode == IBV_WC_RDMA_READ || (w.opcode & IBV_WC_RECV) == 0) {
          // Send-queue entries: the signaled one stands for the unsignaled before it.
          if (w.status != IBV_WC_WR_FLUSH_ERR || w.wr_id) {
            s.sq_used = 0;
            s.signaled_done = s.signaled_posted;
          }
          if (s.reads_pending) --s.reads_pending;
        }
        // A READ's bytes are lost with the peer's buffer. Writes and receives failing after
        // the peer handed the connection back are expected (its ring went): the REVERT
        // before them, found below, says so.
        if (w.wr_id & kWindowWrite) {  // its writer learns of it (stream_write_window)
          s.window_writes = 0;
          s.window_failed = true;
        }
        if (w.wr_id & kClaim) s.claims_pending = 0;
        if (w.wr_id & kSinkWrite) {
          s.wz_writes = 0;
          s.wz_failed = true;
        }
        if (w.opcode == IBV_WC_RDMA_READ)
          set_error(s, ECONNRESET);
        else
          writes_failed = true;
        // Flushes follow the first error by the hundred: they say nothing more.
        if (s.revert_at == ~0ull && w.status != IBV_WC_WR_FLUSH_ERR)
          logf("fd %d: completion %s", s.fd, ibv_wc_status_str(w.status));
        continue;
      }
      if ((w.opcode & IBV_WC_RECV) == 0) ++s.signaled_done;  // in order: see wait_last_write
      if (w.opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
        ++s.polled;
        ++recvs;
        uint32_t imm = ntohl(w.imm_data);
        if (imm == kImmAck) {
          // The ack slot is written by the peer: read it once, as it is now.
          __atomic_thread_fence(__ATOMIC_ACQUIRE);
          AckBlock a;
          memcpy(&a, const_cast<const AckBlock *>(&l.page->ack[0]), sizeof a);
          s.peer_consumed = std::max<uint64_t>(s.peer_consumed, a.consumed);
          s.peer_polled = std::max<uint64_t>(s.peer_polled, a.polled);
          s.peer_zc_done = std::max<uint64_t>(s.peer_zc_done, a.zc_done);
          if (a.cancel > s.peer_cancel) {
            s.peer_cancel = a.cancel;
            s.peer_cancel_bytes = a.cancel_bytes;
          }
          s.peer_cancel_req = std::max<uint64_t>(s.peer_cancel_req, a.cancel_req);
          if (a.sink_check == sink_check(a))  // else torn by the next ack: that one tells
            s.peer_sink = {a.sink_seq, a.sink_addr, a.sink_at, a.sink_rkey, a.sink_len};
        } else {
          if (imm & kImmRewind) {  // past the ring's end, unread (see top)
            const uint64_t skip = l.ring_bytes - (s.rx_produced & (l.ring_bytes - 1));
            if (s.rx_pos != s.rx_produced || s.rec_off) set_error(s, EPROTO);
            if (s.rx_scan == s.rx_produced) s.rx_scan += skip;
            s.rx_pos += skip;
            s.acked_consumed += skip;  // the sender counted it read itself
            s.rx_produced += skip;
            imm &= ~kImmRewind;
          }
          s.rx_produced += imm;
        }
      } else if (w.opcode == IBV_WC_RDMA_READ) {
        --s.reads_pending;
        s.sq_used -= std::min<uint32_t>(s.sq_used, uint32_t(w.wr_id));
      } else if (w.wr_id & kWindowWrite) {
        --s.window_writes;
        s.sq_used -= std::min<uint32_t>(s.sq_used, uint32_t(w.wr_id));
      } else if (w.wr_id & kClaim) {
        --s.claims_pending;
        s.sq_used -= std::min<uint32_t>(s.sq_used, uint32_t(w.wr_id));
      } else if (w.wr_id & kSinkWrite) {
        --s.wz_writes;
        s.sq_used -= std::min<uint32_t>(s.sq_used, uint32_t(w.wr_id));
      } else {
        s.sq_used -= std::min<uint32_t>(s.sq_used, uint32_t(w.wr_id));
      }
    }
  }
  if (recvs && !link_post_recvs(l, recvs)) writes_failed = true;
  // A FIN is reported by poll (POLLRDHUP) as soon as it arrives, before recv reaches it.
  while (s.revert_at == ~0ull && s.rx_scan < s.rx_produced) {
    const Rec *r = reinterpret_cast<const Rec *>(l.ring + (s.rx_scan & (l.ring_bytes - 1)));
    if (r->type == kFin) s.fin_arrived = true;
    if (r->type == kRevert) {
      s.revert_at = s.rx_scan;
      take_revert(s);
      break;
    }
    s.rx_scan += kRound + round16(r->len);
  }
  if (writes_failed && s.revert_at == ~0ull) set_error(s, ECONNRESET);
  skip_empty_records(s);
  if (s.tx_tcp) return took;  // no acks into a ring that is going
  if (s.peer_cancel_req > s.cancel_answered) answer_cancel(s);
  // A side that only sends still reaps the peer's acks: it must say so, or the peer runs
  // out of receives to ack into.
  if (s.ack_wanted || s.polled - s.acked_polled >= l.recv_depth / 4) send_ack(s);
  return took;
}

// A busy poller must learn of a peer that died without a FIN, but a system call per empty
// non-blocking receive doubles the cost of every read-until-EAGAIN loop (an event-driven
// server ends each read so): one look per tick of the coarse clock (1-4 ms). Blocking
// waits and poll/select/epoll watch the kernel socket themselves.
bool peer_check_due(Sock &s) {
  timespec t{};
  clock_gettime(CLOCK_MONOTONIC_COARSE, &t);
  const int64_t ms = int64_t(t.tv_sec) * 1000 + t.tv_nsec / 1000000;
  if (ms == s.peer_checked_ms) return false;
  s.peer_checked_ms = ms;
  return true;
}

// The kernel socket of an SDP connection carries nothing after the handshake: readable
// means the peer's process closed it, or died; or, when it holds data, that a process the
// peer forked writes there, and the peer's REVERT follows (stream_revert).
void check_peer(Sock &s, bool hup = false) {
  if (s.peer_gone) return;
  char c;
  ssize_t r = real().recvfrom(s.fd, &c, 1, MSG_PEEK | MSG_DONTWAIT, nullptr, nullptr);
  if (r > 0 && s.state == State::kSdp && s.revert_at == ~0ull && !s.tcp_early) {
    s.tcp_early = true;
    logf("fd %d: data on the TCP socket before the peer's REVERT", s.fd);
  }
  if (r > 0 && hup && s.tcp_early && s.revert_at == ~0ull) {
    // Every holder closed its end, and the side that had the connection never handed it
    // back (it died): what it had not read is lost.
    s.peer_gone = true;
    progress(s);
    logf("fd %d: the peer's end closed without handing the connection back", s.fd);
    return;
  }
  if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
    s.peer_gone = true;
    progress(s);  // whatever it wrote before closing is in the CQ by now
    if (!s.peer_fin) logf("fd %d: peer closed its socket without FIN", s.fd);
  }
}

void kick_sleepers(Sock &s) {
  if (s.sleepers > 0 && s.link.kick_fd >= 0) {
    uint64_t one = 1;
    (void)!syscall(SYS_write, s.link.kick_fd, &one, sizeof one);
  }
}

// Writes what the backlog holds to the kernel socket without waiting; true once it is empty
// (then a FIN this side had sent goes as TCP's, and sleepers look again).
bool drain_backlog(Sock &s) {
  while (s.backlog_off < s.backlog.size()) {
    ssize_t n =
        real().sendto(s.fd, s.backlog.data() + s.backlog_off, s.backlog.size() - s.backlog_off,
                      MSG_DONTWAIT | MSG_NOSIGNAL, nullptr, 0);
    if (n > 0) {
      s.backlog_off += size_t(n);
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return false;
    logf("fd %d: %zu bytes to send again over TCP lost (%s)", s.fd,
         s.backlog.size() - s.backlog_off, strerror(errno));
    set_error(s, ECONNRESET);
    break;
  }
  const bool had = !s.backlog.empty();
  std::string().swap(s.backlog);
  s.backlog_off = 0;
  if (had) {
    if (s.fin_sent) real().shutdown(s.fd, SHUT_WR);
    kick_sleepers(s);
  }
  return true;
}

// The peer handed the connection back to TCP (stream_revert there): what it had not
// consumed of this side's stream goes again over TCP, in order, from this side's mirror (and
// a zero-copy send still waiting, from its buffer), ahead of everything this side sends from
// now on. It goes into a backlog written without waiting (drain_backlog, by this side's
// calls and the flusher): the process that goes on with the connection may write before it
// reads. Records before the REVERT are still delivered from the ring.
void take_revert(Sock &s) {
  RevertAt at;
  memcpy(&at, s.link.ring + ((s.revert_at + kRound) & (s.link.ring_bytes - 1)), sizeof at);
  s.tx_tcp = true;
  s.pend_rec = ~0ull;
  s.peer_win_len = 0;  // no one-sided writes over TCP
  const Link &l = s.link;
  const uint64_t R = l.remote.ring_bytes;
  // Records start at the peer's acknowledged position (a record boundary, <= at.rx_pos).
  for (uint64_t q = s.peer_consumed; q < s.tx_pos;) {
    const Rec r = *reinterpret_cast<const Rec *>(l.mirror + (q & (R - 1)));
    const char *payload = l.mirror + (q & (R - 1)) + kRound;
    const uint64_t next = q + kRound + round16(r.len);
    const uint64_t off = q == at.rx_pos ? at.rec_off : 0;
    if (next <= at.rx_pos) {
      // Consumed whole: a zero-copy advertisement among them was read (its ack may not
      // have come), unless this side had asked to cancel it.
      if (r.type == kSrcAvail && r.arg > s.cancel_req)
        s.peer_zc_done = std::max(s.peer_zc_done, r.arg);
    } else if (r.type == kData && off < r.len) {
      s.backlog.append(payload + off, r.len - off);
    } else if (r.type == kSrcAvail && r.arg == s.zc_waiting && r.arg > s.peer_cancel) {
      // Its send() waits (zc_waiting), so the buffer is the program's as advertised: the
      // rest is copied, and the send is done.
      SrcAvail sa;
      memcpy(&sa, payload, sizeof sa);
      if (off < sa.len)
        s.backlog.append(reinterpret_cast<const char *>(sa.addr) + off, sa.len - off);
      s.peer_zc_done = r.arg;
    } else if (r.type == kWrCompl) {
      // Written into the buffer the peer offered, which its hand-back waits for and counts
      // as read unless the connection broke: the bytes are not in this side's memory any
      // more, and the stream over TCP would have a hole. It ends instead.
      logf(
          "fd %d: the peer handed the connection back without taking its offered buffer's "
          "bytes: the connection is reset",
          s.fd);
      s.backlog.clear();
      real().shutdown(s.fd, SHUT_RDWR);
      set_error(s, ECONNRESET);
      break;
    }
    q = next;
  }
  logf("fd %d: the peer handed the connection back to TCP; %zu bytes it had not read go again",
       s.fd, s.backlog.size());
  if (s.backlog.empty() && s.fin_sent) real().shutdown(s.fd, SHUT_WR);
  if (!drain_backlog(s)) flusher_add(s);
  kick_sleepers(s);  // a zero-copy send asleep in another thread is done
}

bool revert_at_head(const Sock &s) {
  return s.rx_pos == s.revert_at;
}

bool rx_ready(const Sock &s) {
  return data_head(s) || s.peer_fin;
}

bool fin_at_head(const Sock &s) {
  const Rec *r = data_head(s);
  return r && r->type == kFin;
}

// Room for a record of `bytes` (after the FIN reserve), and writes for it beyond an ack's
// and a FIN's.
bool tx_ready(const Sock &s, uint64_t bytes) {
  return data_credit(s) >= bytes && credit_msgs(s) >= 4 && !s.wz_claiming;
}

// Waits, with s.mu held through `lk` (released while sleeping), until ready() or the
// connection breaks. Busy-polls first: for `spin` (which learns whether the wait then slept,
// and whether it timed out), else for spin_us; never past the timeout. Returns 0; EINTR when
// a signal came (and the call does not restart); EAGAIN when timeout_ns (> 0) passed; EBADF
// when another thread closed the socket meanwhile (or it went back to TCP: the caller looks at
// s.state).
template <class Ready>
int wait_until(Sock &s, SockLock &lk, Ready ready, int64_t timeout_ns = 0,
               WaitSpin *spin = nullptr) {
  if (!s.link.qp) return EBADF;
  flush(s);
  signal_wait_begins();
  const uint64_t start = now_ns();
  uint64_t spin_end = start + uint64_t(spin ? spin->ns() : SpinWindow::least());
  if (timeout_ns > 0) spin_end = std::min(spin_end, start + uint64_t(timeout_ns));
  // Between looks a pause, and a yield of the CPU now and then (as epoll's spin does): a
  // yield per look was a system call that what arrived meanwhile waited for, ~1.5 us of a
  // 64-byte ping-pong's 2 us here.
  constexpr uint64_t kYieldEveryNs = 16000;
  uint64_t yield_due = start + kYieldEveryNs;
  for (uint64_t now = start; now < spin_end; now = now_ns()) {
    progress(s);
    if (ready() || s.error) return 0;
    lk.unlock();
    if (now >= yield_due) {
      sched_yield();
      yield_due = now + kYieldEveryNs;
    } else {
      __builtin_ia32_pause();
    }
    lk.lock();
    if (!s.link.qp) return EBADF;
    if (signal_interrupts()) return EINTR;
  }
  if (spin) spin->sleeping(int64_t(spin_end));
  // A group's CQ wakes its sleepers for every link's completions. A sleeper woken for
  // other links only sleeps unarmed for a while (64 us, doubling to 1 ms): the threads
  // using those links take this socket's completions too and kick it, and arming again
  // would wake it for their next one (and unmask the node's doorbell). After that while it
  // arms again, which bounds the wait when nobody polls.
  uint64_t unarmed_ns = 0;
  bool arm = true;
  for (;;) {
    // Counted as asleep before the last look: another thread that takes this socket's
    // completions from the shared CQ from now on kicks it.
    ++s.sleepers;
    flush(s);
    if (arm) {
      // Armed without the lock: arming may serve the node's requests for up to a
      // millisecond, and a group's CQ lives as long as the process.
      ibv_cq *cq = s.link.cq;
      lk.unlock();
      ibv_req_notify_cq(cq, 0);
      lk.lock();
      if (!s.link.qp || s.link.cq != cq) {
        --s.sleepers;
        return EBADF;
      }
    }
    progress(s);
    if (ready() || s.error) {
      --s.sleepers;
      return 0;
    }
    if (s.peer_gone) {  // its process closed the socket (after a FIN) or died (without)
      --s.sleepers;
      set_error(s, s.peer_fin || s.fin_arrived ? EPIPE : ECONNRESET);
      return 0;
    }
    int64_t wait_ns = arm ? 100000000 : int64_t(unarmed_ns);
    if (timeout_ns > 0) {
      int64_t left = int64_t(start) + timeout_ns - int64_t(now_ns());
      if (left <= 0) {
        --s.sleepers;
        if (signal_interrupts()) return EINTR;  // a handler ran while it armed the CQ
        if (spin) spin->timed_out = true;
        return EAGAIN;
      }
      wait_ns = std::min(wait_ns, left);
    }
    const timespec ts{time_t(wait_ns / 1000000000), long(wait_ns % 1000000000)};
    pollfd p[3] = {{s.link.kick_fd, POLLIN, 0},
                   {s.fd, short(s.tcp_early ? POLLRDHUP : POLLIN | POLLRDHUP), 0},
                   {s.link.channel->fd, POLLIN, 0}};
    if (signal_interrupts()) {  // a handler ran meanwhile, outside the sleep
      --s.sleepers;
      return EINTR;
    }
    lk.unlock();
    int r = real().ppoll(p, arm ? 3 : 2, &ts, nullptr);
    int err = errno;
    lk.lock();
    --s.sleepers;
    if (!s.link.qp) return EBADF;
    // As the kernel restarts a socket call after a handler with SA_RESTART (signals.cpp).
    if (r < 0 && err == EINTR && !signal_restarts()) return EINTR;
    if (p[0].revents) stream_take_kick(s);
    if (p[1].revents) check_peer(s, p[1].revents & (POLLRDHUP | POLLHUP | POLLERR));
    if (arm && p[2].revents) {
      link_drain(s.link);
      const int took = progress(s);
      if (ready() || s.error) return 0;
      if (!took && !p[0].revents) {  // the wakeup was other links'
        unarmed_ns = std::clamp<uint64_t>(2 * unarmed_ns, 64000, 1000000);
        arm = false;
        continue;
      }
    }
    if (r == 0 && !arm) {
      arm = true;  // nobody kicked meanwhile: look for itself
    } else if (p[0].revents || (arm && p[2].revents)) {
      unarmed_ns = 0, arm = true;  // this socket's own completions came
    }
  }
}

// wait_until, busy-polling for the thread's spin window first (spin.hpp), which learns from
// how the wait ended: for the waits that follow a peer's pace (data of a stream, a zero-copy
// send's sink copying), where a sleep just before the event costs its wake.
template <class Ready>
int wait_adaptive(Sock &s, SockLock &lk, Ready ready, int64_t timeout_ns = 0) {
  WaitSpin spin;
  return wait_until(s, lk, ready, timeout_ns, &spin);
}

// A cursor over an iovec array.
struct IoCursor {
  const iovec *iov;
  int cnt;
  int i = 0;
  size_t off = 0;
  IoCursor(const iovec *v, int c) : iov(v), cnt(c) { skip_empty(); }
  void skip_empty() {
    while (i < cnt && off >= iov[i].iov_len) {
      ++i;
      off = 0;
    }
  }
  bool done() const { return i >= cnt; }
  char *ptr() const { return static_cast<char *>(iov[i].iov_base) + off; }
  size_t seg_left() const { return iov[i].iov_len - off; }
  void advance(size_t n) {
    off += n;
    skip_empty();
  }
  size_t copy_in(char *dst, size_t n) {  // from the iovecs into dst
    size_t done_ = 0;
    while (done_ < n && !done()) {
      size_t k = std::min(n - done_, seg_left());
      bulk_copy(dst + done_, ptr(), k);
      done_ += k;
      advance(k);
    }
    return done_;
  }
  size_t copy_out(const char *src, size_t n) {  // from src into the iovecs
    size_t done_ = 0;
    while (done_ < n && !done()) {
      size_t k = std::min(n - done_, seg_left());
      bulk_copy(ptr(), src + done_, k);
      done_ += k;
      advance(k);
    }
    return done_;
  }
};

size_t iov_total(const iovec *iov, int cnt) {
  size_t t = 0;
  for (int i = 0; i < cnt; ++i) t += iov[i].iov_len;
  return t;
}

// Ring bytes this side needs credit for to place a record of `rec` bytes now (a pad to the
// ring's start first when it does not fit before the end).
uint64_t need_bytes(const Sock &s, uint64_t rec) {
  const uint64_t R = s.link.remote.ring_bytes;
  const uint64_t contiguous = R - (s.tx_pos & (R - 1));
  return contiguous < std::max<uint64_t>(rec, 2 * kRound) ? contiguous + rec : rec;
}

// Posts what the mirror holds beyond what was posted (coalesced small sends, pads): one
// write with immediate per contiguous stretch. False when credits for the writes are short
// (the data stays pending: the next call or the flusher thread posts it). Writes for an ack
// (and, unless this is the FIN's flush, for the FIN) are kept.
bool flush(Sock &s, bool fin) {
  if (s.tx_posted == s.tx_pos) return true;
  if (!s.link.qp || inherited(s) || s.tx_tcp) return false;
  Link &l = s.link;
  const uint64_t R = l.remote.ring_bytes;
  const uint64_t first = s.tx_posted & (R - 1);
  const bool wraps = first + (s.tx_pos - s.tx_posted) > R;
  // Data leaves writes for an ack and for a FIN's flush (two when it wraps); the FIN takes
  // what it needs.
  if (credit_msgs(s) < (wraps ? 2u : 1u) + (fin ? 0u : 3u)) return false;
  const bool signal_last = s.force_signal;  // close waits for the last write, not a pad's
  s.force_signal = false;
  if (s.pend_rec != ~0ull) {
    Rec *rec = reinterpret_cast<Rec *>(l.mirror + (s.pend_rec & (R - 1)));
    // Ask for an ack while this side can still send: the receiver acks such a record at once.
    if (credit_bytes(s) < R / 2 || credit_msgs(s) < l.remote.recv_depth / 2) rec->flags |= kWantAck;
    s.pend_rec = ~0ull;
  }
  while (s.tx_posted < s.tx_pos) {
    const uint64_t off = s.tx_posted & (R - 1);
    const uint64_t n = std::min<uint64_t>(s.tx_pos - s.tx_posted, R - off);
    if (s.tx_posted == s.skip_at) {  // the receiver puts this pad in place itself
      s.tx_posted += n;
      continue;
    }
    const uint32_t rewind =
        s.skip_at != ~0ull && s.tx_posted == s.skip_at + (R - (s.skip_at & (R - 1))) ? kImmRewind
                                                                                     : 0;
    if (s.tx_posted + n == s.tx_pos) s.force_signal = signal_last;
    if (!post_write(s, l.mirror + off, l.mirror_mr->lkey, uint32_t(n), l.remote.ring_addr + off,
                    l.remote.ring_rkey, uint32_t(n) | rewind))
      return false;
    s.tx_posted += n;
    if (rewind) s.skip_at = ~0ull;
  }
  return true;
}

// Places a pad to the ring's end in the mirror (posted with what follows).
bool put_pad(Sock &s, bool fin = false) {
  const uint64_t R = s.link.remote.ring_bytes;
  const uint64_t off = s.tx_pos & (R - 1);
  const uint64_t contiguous = R - off;
  if ((fin ? credit_bytes(s) : data_credit(s)) < contiguous) return false;
  Rec *pad = reinterpret_cast<Rec *>(s.link.mirror + off);
  *pad = Rec{uint32_t(contiguous - kRound), kPad, 0, 0, 0};
  s.pend_rec = ~0ull;
  s.tx_pos += contiguous;
  return true;
}

// BCopy: copies up to `want` bytes from cur into the mirror, growing the pending DATA record
// (a new one when there is none, it is full, or it would pass the ring's end). Returns the
// bytes taken (0: credits are short).
size_t append_data(Sock &s, IoCursor &cur, size_t want) {
  if (s.wz_claiming) return 0;
  Link &l = s.link;
  const uint64_t R = l.remote.ring_bytes;
  const uint64_t cap = R / 4;  // a record this big is posted: acks must flow back
  for (;;) {
    if (s.pend_rec == ~0ull) {
      const uint64_t off = s.tx_pos & (R - 1);
      // Read to the end: rewind (see top).
      if (off >= kRewindAt && s.peer_consumed == s.tx_pos && s.tx_posted == s.tx_pos &&
          s.skip_at == ~0ull && put_pad(s)) {
        s.skip_at = s.tx_pos - (R - off);
        s.peer_consumed = s.tx_pos;
        continue;
      }
      if (R - off < 2 * kRound) {
        if (!put_pad(s)) return 0;
        continue;
      }
      if (data_credit(s) < 2 * kRound) return 0;
      Rec *rec = reinterpret_cast<Rec *>(l.mirror + off);
      *rec = Rec{0, kData, 0, 0, s.rx_pos};  // arg: how far this side has read (see top)
      s.pend_rec = s.tx_pos;
      s.tx_pos += kRound;
    }
    const uint64_t at = s.pend_rec & (R - 1);
    Rec *rec = reinterpret_cast<Rec *>(l.mirror + at);
    const uint64_t len = rec->len;
    const uint64_t limit = std::min<uint64_t>(R - at - kRound, cap);
    // Growing to len + n moves tx_pos by round16(len + n) - round16(len): within credits.
    const uint64_t room = std::min<uint64_t>(limit, round16(len) + data_credit(s));
    if (room <= len) {
      if (len < limit) return 0;  // credits are short
      s.pend_rec = ~0ull;         // full: the next bytes start a new record
      continue;
    }
    const size_t n = std::min<uint64_t>(want, room - len);
    cur.copy_in(l.mirror + at + kRound + len, n);
    rec->len = uint32_t(len + n);
    s.tx_pos = s.pend_rec + kRound + round16(len + n);
    if (rec->len >= cap) s.pend_rec = ~0ull;
    return n;
  }
}

// Writes one control record (SRC_AVAIL, FIN) after whatever is pending, and posts it all.
// False when credits are short (wait for need_bytes()) or only a pad went. A FIN may use
// the reserve kept for it.
bool put_record(Sock &s, uint8_t type, uint64_t arg, const void *payload, size_t len) {
  if (s.wz_claiming) return false;
  Link &l = s.link;
  const bool fin = type == kFin || type == kRevert;  // they may use the reserve
  const uint64_t R = l.remote.ring_bytes;
  const uint64_t off = s.tx_pos & (R - 1);
  const uint64_t rec_bytes = kRound + round16(len);
  if (R - off < std::max<uint64_t>(rec_bytes, 2 * kRound)) {
    put_pad(s, fin);
    return false;
  }
  if (!s.link.qp || inherited(s) || s.tx_tcp) return false;
  if ((fin ? credit_bytes(s) : data_credit(s)) < rec_bytes || credit_msgs(s) < (fin ? 2u : 4u))
    return false;
  s.pend_rec = ~0ull;
  Rec *rec = reinterpret_cast<Rec *>(l.mirror + off);
  *rec = Rec{uint32_t(len), type, 0, 0, arg};
  if (len) bulk_copy(l.mirror + off + kRound, payload, len);
  s.tx_pos += rec_bytes;
  return flush(s, fin);
}

void raise_sigpipe(int flags) {
  if (!(flags & MSG_NOSIGNAL)) pthread_kill(pthread_self(), SIGPIPE);
}

// A send on a broken connection: ECONNRESET once when the peer vanished without closing
// (as TCP reports the reset), EPIPE (and SIGPIPE) from then on.
ssize_t send_failed(Sock &s, size_t sent, int flags) {
  if (sent) return ssize_t(sent);
  if (s.error == ECONNRESET && !s.peer_fin && !s.fin_arrived && !s.reset_reported) {
    s.reset_reported = true;
    errno = ECONNRESET;
    return -1;
  }
  errno = EPIPE;
  raise_sigpipe(flags);
  return -1;
}

// Whether the peer's next record for this side is a zero-copy advertisement: the peer is
// blocked in its own zero-copy send.
bool peer_src_at_head(const Sock &s) {
  const Rec *r = data_head(s);
  return r && r->type == kSrcAvail && r->arg > s.skip_src_upto;
}

// Read ZCopy, source side: advertise the buffer, wait until the sink has read it. The wait
// is cancelled (SrcAvailCancel) by a signal, and when the peer is itself blocked sending
// zero copy to this side (both would wait for ever): the rest then goes BCopy.
// Returns bytes the sink read, -2 when the buffer cannot be registered, -1/errno.
ssize_t zcopy_send(Sock &s, SockLock &lk, void *buf, size_t len, int flags, bool *interrupted) {
  ibv_mr *mr = reg_user(buf, len);
  if (!mr) return -2;
  ++s.stats.registrations;
  const uint64_t seq = ++s.src_seq;
  SrcAvail sa{reinterpret_cast<uintptr_t>(buf), mr->rkey, uint32_t(len)};
  int err = 0;
  bool posted = false;
  while (!err && !s.error && !posted && !s.tx_tcp) {
    if (!tx_ready(s, need_bytes(s, 2 * kRound)))
      err = wait_until(s, lk, [&] { return tx_ready(s, need_bytes(s, 2 * kRound)) || s.tx_tcp; });
    if (err || s.error || s.tx_tcp) break;
    posted = put_record(s, kSrcAvail, seq, &sa, sizeof sa);
  }
  size_t done = 0;
  if (posted) {
    s.zc_waiting = seq;
    const uint64_t patience = now_ns() + 1000000;  // 1 ms before suspecting a deadlock
    err = wait_adaptive(s, lk, [&] {
      return s.peer_zc_done >= seq || (peer_src_at_head(s) && now_ns() > patience);
    });
    if (s.peer_zc_done >= seq) {
      done = len;
    } else if (!s.error && s.link.qp) {
      // The sink must stop reading before the buffer goes back to the program.
      logf("fd %d: zero-copy send of %zu bytes cancelled (%s)", s.fd, len,
           err == EINTR ? "signal" : "the peer sends zero copy too");
      s.cancel_req = seq;
      s.ack_wanted = true;
      send_ack(s);
      while (!s.error && s.link.qp && !s.tx_tcp && s.peer_zc_done < seq && s.peer_cancel < seq)
        wait_until(s, lk,
                   [&] { return s.peer_zc_done >= seq || s.peer_cancel >= seq || s.tx_tcp; });
      done = s.peer_zc_done >= seq ? len : s.peer_cancel >= seq ? s.peer_cancel_bytes : 0;
      logf("fd %d: cancel of %llu answered: %zu of %zu bytes read (zc_done %llu cancel %llu)", s.fd,
           (unsigned long long)seq, done, len, (unsigned long long)s.peer_zc_done,
           (unsigned long long)s.peer_cancel);
    }
  }
  s.zc_waiting = 0;
  ibv_dereg_mr(mr);
  s.stats.zcopy_tx += done;
  *interrupted = err == EINTR;
  if (done || s.error == 0) return ssize_t(done);
  return send_failed(s, 0, flags);
}

// Places the WR_COMPL record of SinkAvail `seq` (a pad before it if needed) in the mirror;
// its ring bytes were counted before the claim. Returns the ring position after it.
uint64_t place_wr_compl(Sock &s, uint64_t seq, uint64_t count) {
  const uint64_t R = s.link.remote.ring_bytes;
  if (R - (s.tx_pos & (R - 1)) < kWrComplBytes) put_pad(s);
  char *at = s.link.mirror + (s.tx_pos & (R - 1));
  *reinterpret_cast<Rec *>(at) = Rec{sizeof count, kWrCompl, 0, 0, seq};
  memcpy(at + kRound, &count, sizeof count);
  s.pend_rec = ~0ull;
  s.tx_pos += kWrComplBytes;
  return s.tx_pos;
}

// Write ZCopy, source side: the peer's blocking recv offers a buffer, and this side has
// sent nothing since the offer (its stream is where the peer's was then). Claims it, writes
// up to `len` bytes of `buf` into it, and puts the WR_COMPL record there, with nothing else
// of this side entering the stream between (wz_claiming). Returns the bytes written (0: not
// taken, the caller sends them another way), or -1 when the connection broke or was closed
// meanwhile.
ssize_t wz_send(Sock &s, SockLock &lk, const void *buf, size_t len) {
  const Sock::SinkAvail sa = s.peer_sink;
  if (!sa.seq || sa.seq <= s.sink_tried || sa.at != s.tx_pos || !sa.len || s.tx_tcp || s.error ||
      s.wz_claiming)
    return 0;
  // Ring bytes for the record (and a pad before it), and room in the send queue for the
  // claim and the write.
  if (data_credit(s) < need_bytes(s, kWrComplBytes) || s.sq_used + 2 >= s.link.send_depth) return 0;
  s.sink_tried = sa.seq;
  const size_t n = std::min<size_t>(len, sa.len);
  ibv_mr *mr = reg_user(const_cast<void *>(buf), n);
  if (!mr) return 0;
  ++s.stats.registrations;
  AckPage *page = s.link.page;
  page->claim_result = 0;
  ibv_sge csge{reinterpret_cast<uintptr_t>(&page->claim_result), 8, s.link.ack_mr->lkey};
  ibv_send_wr cas{};
  cas.opcode = IBV_WR_ATOMIC_CMP_AND_SWP;
  cas.sg_list = &csge;
  cas.num_sge = 1;
  cas.wr.atomic.remote_addr = s.link.remote.ack_addr + offsetof(AckPage, sink_claim);
  cas.wr.atomic.rkey = s.link.remote.ack_rkey;
  cas.wr.atomic.compare_add = sa.seq;
  cas.wr.atomic.swap = sa.seq | kSinkTaken;
  if (post_signaled(s, cas, kClaim)) {
    set_error(s, ECONNRESET);
    ibv_dereg_mr(mr);
    return -1;
  }
  ++s.claims_pending;
  s.wz_claiming = true;
  // The peer's CPU answers (a target executes atomics): waited for without the lock.
  while (s.claims_pending && !s.error && s.link.qp)
    wait_until(s, lk, [&] { return !s.claims_pending; });
  bool claimed =
      s.link.qp && !s.error && __atomic_load_n(&page->claim_result, __ATOMIC_ACQUIRE) == sa.seq;
  uint64_t end = 0;
  if (claimed) {
    s.wz_failed = false;
    ibv_sge sge{reinterpret_cast<uintptr_t>(buf), uint32_t(n), mr->lkey};
    ibv_send_wr wr{};
    wr.opcode = IBV_WR_RDMA_WRITE;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.wr.rdma.remote_addr = sa.addr;
    wr.wr.rdma.rkey = sa.rkey;
    if (post_signaled(s, wr, kSinkWrite) == 0) {
      ++s.wz_writes;
      // After the write on the same QP: the peer sees the record once the bytes are in place.
      end = place_wr_compl(s, sa.seq, n);
    } else {
      // No record for bytes that were not written; the peer, waiting for one, learns of the
      // end from the TCP socket.
      set_error(s, ECONNRESET);
      real().shutdown(s.fd, SHUT_RDWR);
    }
  }
  s.wz_claiming = false;
  kick_sleepers(s);  // senders that waited for the claim
  if (!claimed) {
    ibv_dereg_mr(mr);
    if (!s.link.qp) return -1;
    logf("fd %d: SinkAvail %llu not claimed (%s)", s.fd, (unsigned long long)sa.seq,
         s.error ? "connection broken" : "taken back");
    return s.error ? -1 : 0;
  }
  // Posted as credits allow, and the write complete: the buffer is the program's again.
  while (!s.error && s.link.qp && (s.wz_writes || s.tx_posted < end))
    wait_until(s, lk, [&] {
      flush(s);
      return !s.wz_writes && s.tx_posted >= end;
    });
  ibv_dereg_mr(mr);
  if (!s.link.qp || s.wz_writes || s.wz_failed) return -1;
  s.stats.zcopy_tx += n;
  s.stats.wzcopy_tx += n;
  return ssize_t(n);  // written, even if the connection broke after
}

// The process's: its sockets' sends are measured together.
AutoThreshold &auto_threshold() {
  static AutoThreshold process_wide(logf);
  return process_wide;
}

// One blocking send of at least kAutoMinBytes on a socket whose threshold is `auto`: which
// path to take (zcopy()), and that it completed by a path (done(); a send that does not say
// so, failed or partly sent by the other path, is not counted). Called with the socket's lock.
class AutoSend {
 public:
  AutoSend(Sock &s, size_t len, uint32_t weight)
      : s_(s), send_(auto_threshold().begin(len, now_ns(), weight)) {}
  ~AutoSend() { auto_threshold().end(send_); }
  AutoSend(const AutoSend &) = delete;
  AutoSend &operator=(const AutoSend &) = delete;
  bool zcopy() const { return send_.zcopy; }
  void done(size_t sent, bool went_zcopy) {
    // Until the socket's stream has gone round the ring once, BCopy writes ring pages for the
    // first time (tx_pos counts a rewind's skip too).
    const bool cold = s_.tx_pos < s_.link.remote.ring_bytes;
    if (auto_threshold().completed(send_, sent, went_zcopy, now_ns(), s_.auto_epoch != send_.epoch,
                                   cold))
      s_.auto_epoch = send_.epoch;
  }

 private:
  Sock &s_;
  const AutoThreshold::Send send_;
};

}  // namespace

// A socket another thread closed meanwhile: as the kernel answers for a closed descriptor.
ssize_t closed_meanwhile() {
  errno = EBADF;
  return -1;
}

// The peer handed the connection back: the kernel takes this side's bytes once the backlog
// has gone (a blocking send waits for that, a non-blocking one says EAGAIN).
ssize_t send_after_backlog(Sock &s, SockLock &lk, bool block) {
  for (;;) {
    if (drain_backlog(s)) return kServedByKernel;
    if (!block) {
      errno = EAGAIN;
      return -1;
    }
    pollfd p{s.fd, POLLOUT, 0};
    lk.unlock();
    real().poll(&p, 1, 100);
    lk.lock();
    if (!s.link.qp) return s.state == State::kSdp ? closed_meanwhile() : kServedByKernel;
  }
}

ssize_t stream_send(Sock &s, const iovec *iov, int iovcnt, int flags) {
  SockLock lk(s.mu);
  if (!s.link.qp) return s.state == State::kSdp ? closed_meanwhile() : kServedByKernel;
  const bool block = !s.nonblocking && !(flags & MSG_DONTWAIT);
  if (s.fin_sent) {
    errno = EPIPE;
    raise_sigpipe(flags);
    return -1;
  }
  if (inherited(s)) return kServedByKernel;
  if (s.tx_tcp) return send_after_backlog(s, lk, block);
  // Completions are reaped when credits run short: a send that fits costs no poll.
  if (s.error) return send_failed(s, 0, flags);
  const size_t total = iov_total(iov, iovcnt);
  if (total == 0) return 0;
  // Zero copy needs one buffer and a caller that waits for the peer to read it.
  const int thresh = zcopy_threshold(s);
  const bool may_zcopy = block && iovcnt == 1 && total <= (1u << 31);
  std::optional<AutoSend> choice;
  bool zcopy = may_zcopy && thresh > 0 && total >= size_t(thresh);
  if (may_zcopy && thresh == SDP_ZCOPY_AUTO && total >= kAutoMinBytes) {
    if (const uint32_t weight =
            auto_threshold().measures(total, s.auto_epoch, s.auto_unmeasured, &zcopy))
      zcopy = choice.emplace(s, total, weight).zcopy();
  }
  size_t sent = 0;
  if (zcopy) {
    char *buf = static_cast<char *>(iov[0].iov_base);
    progress(s);  // the peer's offer of a receive buffer comes in an ack
    ssize_t w = wz_send(s, lk, buf, total);
    if (w < 0) return s.link.qp ? send_failed(s, 0, flags) : closed_meanwhile();
    sent = size_t(w);
    bool interrupted = false;
    ssize_t r = sent < total ? zcopy_send(s, lk, buf + sent, total - sent, flags, &interrupted) : 0;
    if (r >= 0 && sent + size_t(r) == total && choice) choice->done(total, true);
    if (r == -1) return sent ? ssize_t(sent) : r;
    if (r >= 0) {
      sent += size_t(r);
      if (sent == total) return ssize_t(total);
      if (interrupted) {
        if (sent) return ssize_t(sent);
        errno = EINTR;
        return -1;
      }
    }
  }
  IoCursor cur(iov, iovcnt);
  cur.advance(sent);
  while (sent < total) {
    if (!s.link.qp || s.tx_tcp) {
      if (sent) return ssize_t(sent);
      return s.link.qp || s.state != State::kSdp ? kServedByKernel : closed_meanwhile();
    }
    if (s.fin_sent) {  // shut down by another thread while this one waited
      if (sent) break;
      errno = EPIPE;
      raise_sigpipe(flags);
      return -1;
    }
    if (s.error) return send_failed(s, sent, flags);
    size_t n = append_data(s, cur, total - sent);
    s.stats.bcopy_tx += n;
    sent += n;
    if (n) continue;
    // The ring is full as far as this side knows: post what is pending, learn of acks.
    flush(s);
    progress(s);
    if (tx_ready(s, need_bytes(s, 2 * kRound))) continue;
    if (!block) {
      if (sent) break;
      errno = EAGAIN;
      return -1;
    }
    if (int e = wait_until(
            s, lk, [&] { return tx_ready(s, need_bytes(s, 2 * kRound)) || s.tx_tcp; },
            s.snd_timeo_ns)) {
      if (sent) break;
      if (s.state != State::kSdp) return kServedByKernel;
      errno = e;  // EINTR, EAGAIN (SO_SNDTIMEO), EBADF (closed by another thread)
      return -1;
    }
  }
  // Small sends in a burst (no receive or poll between them) coalesce: posted when enough
  // is pending, else by the next call on the socket that may wait (a receive, a poll, a
  // blocking send) or, within ~50 us, the flusher thread. The first ones of a burst go at
  // once: a request is never held back from its answer. A large send goes whole, also the
  // tail it appended after waiting for credits (held, it woke the flusher thread per send:
  // a 64 KiB stream ran at a third of its speed).
  if (++s.burst <= kBurstImmediate || total >= kCoalesceBytes ||
      s.tx_pos - s.tx_posted >= kCoalesceBytes)
    flush(s);
  if (s.tx_posted != s.tx_pos && !s.tx_tcp) {
    ++s.stats.held_sends;
    flusher_add(s);
  }
  if (choice && sent == total) choice->done(sent, false);
  return ssize_t(sent);
}

namespace {

// Registers `local`, posts one signaled RDMA READ or WRITE of `len` bytes between it and the
// peer's memory at (remote, rkey), and waits until it completed (counted in *pending; the
// completion is told apart by `tag` in its wr_id). 0, or an errno.
int rdma_and_wait(Sock &s, SockLock &lk, ibv_wr_opcode op, void *local, size_t len, uint64_t remote,
                  uint32_t rkey, uint64_t tag, uint32_t *pending, ibv_mr *held = nullptr) {
  const auto a = reinterpret_cast<uintptr_t>(local);
  const auto h = held ? reinterpret_cast<uintptr_t>(held->addr) : 0;
  const bool reuse = held && a >= h && a + len <= h + held->length;
  ibv_mr *mr = reuse ? held : reg_user(local, len);
  if (!mr) return ENOMEM;
  if (!reuse) ++s.stats.registrations;
  ibv_sge sge{reinterpret_cast<uintptr_t>(local), uint32_t(len), mr->lkey};
  ibv_send_wr wr{};
  wr.opcode = op;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.wr.rdma.remote_addr = remote;
  wr.wr.rdma.rkey = rkey;
  int rc = post_signaled(s, wr, tag);
  if (rc == 0) {
    ++*pending;
    while (*pending && !s.error && s.link.qp) wait_until(s, lk, [&] { return *pending == 0; });
    rc = !s.link.qp ? EBADF : s.error;  // EBADF: closed by another thread
  }
  if (!reuse) ibv_dereg_mr(mr);
  return rc;
}

// RDMA-READs up to `n` bytes of the SrcAvail at the ring's head into `dst` (through `held`
// when it covers them).
ssize_t zcopy_read(Sock &s, SockLock &lk, const SrcAvail &sa, uint32_t off, char *dst, size_t n,
                   ibv_mr *held = nullptr) {
  int rc = rdma_and_wait(s, lk, IBV_WR_RDMA_READ, dst, n, sa.addr + off, sa.rkey, 0,
                         &s.reads_pending, held);
  if (rc && rc != EBADF) set_error(s, rc);
  return rc ? -1 : ssize_t(n);
}

// Delivers what the ring holds into `cur` (without consuming it when peek). Returns bytes.
// `held`: a registration of the caller's buffer a READ may use (see RecvMr).
size_t deliver(Sock &s, SockLock &lk, IoCursor &cur, bool peek, ibv_mr *held = nullptr) {
  // Another thread's receive is in a READ, with its position in its own hands: nothing to
  // take until it has stored it.
  if (s.rx_busy) return 0;
  bool busy = false;  // this call's READ made it so
  Link &l = s.link;
  const uint64_t mask = l.ring_bytes - 1;
  uint64_t pos = s.rx_pos;
  uint32_t off = s.rec_off;  // DATA: payload bytes delivered; SRC_AVAIL: bytes read
  size_t total = 0;
  // What the ring holds arrived whole (its writes completed): it is delivered even after the
  // connection broke (a peer that closed may have made this side's last ack fail).
  while (!cur.done() && pos < s.rx_produced) {
    const Rec rec = *reinterpret_cast<const Rec *>(l.ring + (pos & mask));
    const char *payload = l.ring + (pos & mask) + kRound;
    bool consumed = false;
    if (rec.type == kData) {
      size_t n = cur.copy_out(payload + off, rec.len - off);
      off += uint32_t(n);
      total += n;
      if (!peek) {
        s.stats.bcopy_rx += n;
        if (rec.flags & kWantAck) s.ack_wanted = true;
        s.peer_consumed = std::max(s.peer_consumed, std::min(rec.arg, s.tx_posted));
        // A large send that went BCopy (non-blocking): no offer for such a peer. A small
        // header before a large payload does not count.
        const int thresh = zcopy_threshold(s);
        if (thresh > 0 && rec.len >= uint32_t(thresh)) s.peer_zcopy = false;
        s.zc_last = false;
      }
      consumed = off == rec.len;
      if (!consumed) break;  // the caller's buffer is full
    } else if (rec.type == kPad) {
      consumed = true;
    } else if (rec.type == kWindow) {
      if (!peek) take_window(s, payload);
      consumed = true;
    } else if (rec.type == kRevert) {
      break;  // the rest comes over TCP
    } else if (rec.type == kWrCompl && rec.arg == s.sink.seq) {
      break;  // for the recv of another thread that offered its buffer (sink_resolve)
    } else if (rec.type == kFin) {
      if (total || peek) break;
      s.peer_fin = true;
      s.ack_wanted = true;  // a sender lingering after close learns that all was read
      kick_sleepers(s);     // another thread's receive waits: it returns 0 too
      pos += kRound;
      off = 0;
      break;
    } else if (rec.type == kSrcAvail) {
      SrcAvail sa;
      memcpy(&sa, payload, sizeof sa);
      if (rec.arg <= s.skip_src_upto) {
        consumed = true;  // cancelled by the source
      } else if (s.error || (peek && total)) {
        break;
      } else if (peek) {
        // Read it where it would go, and leave the advertisement as it is.
        size_t n = std::min<size_t>(sa.len - off, cur.seg_left());
        s.rx_busy = busy = true;
        if (zcopy_read(s, lk, sa, off, cur.ptr(), n) == ssize_t(n)) total += n;
        break;
      } else {
        size_t n = std::min<size_t>(sa.len - off, cur.seg_left());
        // Counted as read before the READ: a cancel answered meanwhile must include it.
        s.rx_pos = pos;
        s.rec_off = off + uint32_t(n);
        s.rx_busy = busy = true;
        if (zcopy_read(s, lk, sa, off, cur.ptr(), n, held) < 0) {
          s.rec_off = off;
          break;
        }
        cur.advance(n);
        total += n;
        s.stats.zcopy_rx += n;
        s.peer_zcopy = true;
        off += uint32_t(n);
        if (rec.arg <= s.skip_src_upto) {
          consumed = true;  // cancelled while reading: the answer counted this read
        } else if (off == sa.len) {
          s.zc_last = true;
          s.zc_done = std::max(s.zc_done, rec.arg);
          s.ack_wanted = true;  // the source's send() is waiting for this
          consumed = true;
        }
      }
    } else {
      set_error(s, EPROTO);
      break;
    }
    if (!consumed) continue;
    pos += kRound + round16(rec.len);
    off = 0;
    // A large receive acks as it goes: the sender refills the ring while this one copies
    // out the rest (acked at the end only, a 1 MiB receive left a 1 MiB sender idle).
    if (!peek && pos - s.acked_consumed >= l.ring_bytes / 4) {
      s.rx_pos = pos;
      s.rec_off = 0;
      maybe_ack(s);
    }
  }
  if (!peek) {
    s.rx_pos = pos;
    s.rec_off = off;
    maybe_ack(s);
  }
  if (busy) {
    s.rx_busy = false;
    kick_sleepers(s);  // another thread's receive waited for this one
  }
  return total;
}

// Whether a receive can take what the ring's head holds now: not while another thread's
// receive is in a READ (rx_busy), nor the WR_COMPL of another thread's offer.
bool rx_takeable(const Sock &s) {
  if (s.rx_pos >= s.rx_produced || s.rx_busy || !s.link.ring) return false;
  const Rec *r = reinterpret_cast<const Rec *>(s.link.ring + (s.rx_pos & (s.link.ring_bytes - 1)));
  return !(r->type == kWrCompl && s.sink.seq && r->arg == s.sink.seq);
}

// Whether the WR_COMPL of SinkAvail `seq` is at the ring's head.
bool wr_compl_at_head(const Sock &s, uint64_t seq) {
  if (s.rx_pos >= s.rx_produced || s.rec_off) return false;
  const Rec *r = reinterpret_cast<const Rec *>(s.link.ring + (s.rx_pos & (s.link.ring_bytes - 1)));
  return r->type == kWrCompl && r->arg == seq;
}

// Consumes the WR_COMPL of SinkAvail `seq` (the open one) at the ring's head: *n, the
// bytes now in the offered buffer.
bool take_wr_compl(Sock &s, uint64_t seq, uint64_t *n) {
  if (!wr_compl_at_head(s, seq) || s.sink.seq != seq) return false;
  const uint64_t mask = s.link.ring_bytes - 1;
  const Rec *r = reinterpret_cast<const Rec *>(s.link.ring + (s.rx_pos & mask));
  memcpy(n, s.link.ring + ((s.rx_pos + kRound) & mask), sizeof *n);
  if (*n == 0 || *n > s.sink.len) {
    set_error(s, EPROTO);
    return false;
  }
  s.rx_pos += kRound + round16(r->len);
  s.sink = {};
  s.peer_zcopy = true;
  s.zc_last = true;
  kick_sleepers(s);  // another thread's receive waited behind this record
  s.stats.zcopy_rx += *n;
  s.stats.wzcopy_rx += *n;
  maybe_ack(s);
  return true;
}

// Takes SinkAvail `seq` back: true, or false when the peer claimed it (its WR_COMPL is on
// the way). Another thread may have taken it back already.
bool sink_withdraw(Sock &s, uint64_t seq) {
  uint64_t expect = seq;
  __atomic_compare_exchange_n(&s.link.page->sink_claim, &expect, seq | kSinkWithdrawn, false,
                              __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  if (expect == (seq | kSinkTaken)) return false;
  if (s.sink.seq == seq) s.sink = {};
  return true;
}

// After the wait of a recv that offered its buffer (SinkAvail `seq`): the bytes the peer
// wrote into it, or 0 when the offer was not taken (and is taken back now). The first
// record after the offer decides: the peer claims only with nothing sent since, and puts
// WR_COMPL next, with its lock held from the claim.
uint64_t sink_resolve(Sock &s, SockLock &lk, uint64_t seq) {
  bool claimed = false;
  for (;;) {
    if (s.sink_ended_seq == seq) return s.sink_ended_bytes;  // see sink_end
    if (!s.link.qp) return 0;
    progress(s);
    uint64_t n = 0;
    if (take_wr_compl(s, seq, &n)) return n;
    if (!claimed && sink_withdraw(s, seq)) {
      kick_sleepers(s);  // another receive may take what came instead
      return 0;
    }
    claimed = true;
    if (s.error) {  // the peer's write cannot come any more
      s.sink = {};
      return 0;
    }
    wait_until(s, lk, [&] { return wr_compl_at_head(s, seq); });
  }
}

// Whether a blocking recv that is about to wait may register its buffer: all it had is
// delivered, and no offer of this socket is out.
bool recv_may_register(const Sock &s, const IoCursor &cur, bool peek) {
  return !peek && !cur.done() && s.link.qp && s.state == State::kSdp && !s.tx_tcp && !s.error &&
         s.revert_at == ~0ull && s.rx_pos == s.rx_produced && !s.sink.seq;
}

// Whether it offers its buffer (Write ZCopy): one offer at a time per socket, and only to a
// peer whose large sends are blocking ones.
bool sink_may_offer(const Sock &s, const IoCursor &cur, bool peek) {
  const int thresh = zcopy_threshold(s);
  return recv_may_register(s, cur, peek) && thresh > 0 && cur.seg_left() >= size_t(thresh) &&
         s.peer_zcopy && link_sink_ok();
}

// Whether it registers its buffer before it spins: in a zero-copy stream (the last data it
// took came so), the next SrcAvail is READ into it, whatever this side's own threshold.
bool recv_registers_first(const Sock &s, const IoCursor &cur, bool peek) {
  constexpr size_t kLeast = 64 << 10;  // smaller: the READ's own registration costs ~3 us
  return s.zc_last && recv_may_register(s, cur, peek) && cur.seg_left() >= kLeast;
}

// The registration of a recv's buffer that its offer made: when the peer did not take the
// offer (in a stream its SrcAvail is usually on its way), the READ of that SrcAvail into
// the same buffer uses it, instead of registering the buffer again on its critical path.
// Held for one recv call only (the program may free the buffer after it); released after
// the call set its errno.
struct RecvMr {
  ibv_mr *mr = nullptr;
  void hold(ibv_mr *m) {
    if (mr) {
      const int e = errno;
      ibv_dereg_mr(mr);
      errno = e;
    }
    mr = m;
  }
  ~RecvMr() { hold(nullptr); }
  bool covers(const char *p, size_t len) const {
    const auto *a = mr ? static_cast<const char *>(mr->addr) : nullptr;
    return a && p >= a && p + len <= a + mr->length;
  }
};

// A blocking recv with nothing to deliver: waits as wait_adaptive does, and once the spin is
// over (data that comes within it is on its way already), offers its buffer (the part `cur`
// points at) to the peer's sends. *placed: the bytes the peer wrote there. The buffer's
// registration is left in `keep`, made for the offer, or before the spin in a zero-copy
// stream (recv_registers_first), where the READ of the SrcAvail that comes (usually within
// the spin) uses it, off its critical path (~10 us for 4 MiB); one an earlier wait of the
// same call made is used again (by an offer only where it begins at the offered bytes: the
// peer's key reaches no byte this call already took).
int sink_wait(Sock &s, SockLock &lk, IoCursor &cur, size_t *placed, RecvMr &keep) {
  auto arrived = [&] { return s.rx_pos < s.rx_produced || s.rd_shut || s.peer_fin; };
  int64_t timeout = s.rcv_timeo_ns;
  // Registering moves pages on the emulated fabric: an offer of a huge buffer is cut (the
  // rest of a MSG_WAITALL receive is offered again after the first part).
  constexpr size_t kSinkMax = 8 << 20;
  const uint32_t len = uint32_t(std::min<size_t>(cur.seg_left(), kSinkMax));
  // One made by an earlier wait of this call that covers the buffer's rest is kept, through
  // the spin at least.
  auto registered = [&](bool to_offer) -> ibv_mr * {
    if (keep.covers(cur.ptr(), len) && (!to_offer || keep.mr->addr == cur.ptr())) return keep.mr;
    keep.hold(nullptr);
    ibv_mr *mr = reg_user(cur.ptr(), len);
    if (mr) ++s.stats.registrations;
    keep.hold(mr);
    return mr;
  };
  if (recv_registers_first(s, cur, false))
    registered(false);
  else if (!keep.covers(cur.ptr(), len))
    keep.hold(nullptr);
  // The spin is the thread's, which learns from this wait as from wait_adaptive's.
  WaitSpin spin;
  auto ended = [&](int e) {
    spin.timed_out = e == EAGAIN;
    return e;
  };
  if (spin.ns() > 0) {
    const bool user_first = timeout > 0 && timeout <= spin.ns();
    int e = wait_until(s, lk, arrived, user_first ? timeout : spin.ns(), &spin);
    if (e != EAGAIN || user_first) return ended(e);
    if (timeout > 0) timeout -= spin.ns();
  }
  ibv_mr *mr = sink_may_offer(s, cur, false) ? registered(true) : nullptr;
  if (!mr) {
    keep.hold(nullptr);  // not through a wait of unbounded length
    return ended(wait_until(s, lk, arrived, timeout));
  }
  ++s.stats.sink_avails;
  const uint64_t seq = ++s.sink_made;
  __atomic_store_n(&s.link.page->sink_claim, seq, __ATOMIC_SEQ_CST);
  s.sink = {seq, reinterpret_cast<uintptr_t>(cur.ptr()), s.rx_produced, mr->rkey, len};
  s.ack_wanted = true;
  send_ack(s);
  int e = ended(wait_until(s, lk, arrived, timeout));
  *placed = sink_resolve(s, lk, seq);
  return *placed ? 0 : e;
}

// The link ends (close, hand-back) while a recv of another thread offers its buffer: the
// offer is taken back, or, when the peer claimed it, its bytes are waited for (the peer
// holds nothing else back meanwhile; the wait ends if the connection breaks) and kept for
// that recv, as read.
void sink_end(Sock &s, SockLock &lk) {
  const uint64_t seq = s.sink.seq;
  if (!seq || !s.link.qp || sink_withdraw(s, seq)) return;
  const uint64_t end = now_ns() + 5000000000ull;
  while (s.link.qp && !s.error && s.sink.seq == seq && !wr_compl_at_head(s, seq) && now_ns() < end)
    wait_until(
        s, lk, [&] { return wr_compl_at_head(s, seq) || s.sink.seq != seq; }, 100000000);
  if (s.link.qp && !s.error && s.sink.seq == seq && !wr_compl_at_head(s, seq)) {
    // The claimer is stopped or gone quiet: the buffer's bytes are not known, and the
    // connection ends rather than go on without them.
    logf("fd %d: the peer claimed SinkAvail %llu and wrote nothing in 5 s: reset", s.fd,
         (unsigned long long)seq);
    set_error(s, ECONNRESET);
    real().shutdown(s.fd, SHUT_RDWR);
  }
  uint64_t n = 0;
  if (s.link.qp && s.sink.seq == seq && take_wr_compl(s, seq, &n)) {
    s.sink_ended_seq = seq;
    s.sink_ended_bytes = n;
  }
  if (s.sink.seq == seq) s.sink = {};
}

}  // namespace

ssize_t stream_recv(Sock &s, const iovec *iov, int iovcnt, int flags) {
  SockLock lk(s.mu);
  if (!s.link.qp) return s.state == State::kSdp ? closed_meanwhile() : kServedByKernel;
  if (inherited(s)) return kServedByKernel;  // a forked child's copy: TCP's
  const bool block = !s.nonblocking && !(flags & MSG_DONTWAIT);
  const bool peek = flags & MSG_PEEK;
  const size_t want = iov_total(iov, iovcnt);
  IoCursor cur(iov, iovcnt);
  size_t got = 0;
  RecvMr held;  // released (with the lock still held) when the call returns
  flush(s);     // a request waiting to coalesce goes before its answer is awaited
  s.burst = 0;
  for (;;) {
    if (s.rd_shut) return ssize_t(got);
    progress(s);
    size_t n = deliver(s, lk, cur, peek, held.mr);
    got += n;
    if (!s.link.qp) {  // closed by another thread during a READ
      if (got) return ssize_t(got);
      return s.state == State::kSdp ? closed_meanwhile() : kServedByKernel;
    }
    if (got == want || (got && !(flags & MSG_WAITALL)) || (got && peek)) return ssize_t(got);
    if (s.peer_fin || want == 0 || (peek && fin_at_head(s))) return ssize_t(got);
    if (revert_at_head(s)) {
      if (!got) return kServedByKernel;
      if (!(flags & MSG_WAITALL)) return ssize_t(got);
      // The rest comes over TCP: a MSG_WAITALL receive waits for it there.
      std::vector<iovec> rest;
      for (; !cur.done(); cur.advance(cur.seg_left())) rest.push_back({cur.ptr(), cur.seg_left()});
      msghdr m{};
      m.msg_iov = rest.data();
      m.msg_iovlen = rest.size();
      const int fd = s.fd;
      held.hold(nullptr);
      lk.unlock();
      ssize_t k = real().recvmsg(fd, &m, flags);
      lk.lock();
      return ssize_t(got) + std::max<ssize_t>(k, 0);
    }
    if (s.error) {
      if (got) return ssize_t(got);
      errno = s.error;
      return -1;
    }
    if (!block) {
      if (got) return ssize_t(got);
      if (peer_check_due(s)) check_peer(s);
      if (s.peer_gone && s.rx_pos == s.rx_produced) {
        set_error(s, s.peer_fin || s.fin_arrived ? EPIPE : ECONNRESET);
        if (s.error == ECONNRESET) {
          errno = ECONNRESET;
          return -1;
        }
        return 0;
      }
      errno = EAGAIN;
      return -1;
    }
    size_t placed = 0;
    int e;
    if (sink_may_offer(s, cur, peek) || recv_registers_first(s, cur, peek)) {
      e = sink_wait(s, lk, cur, &placed, held);
    } else {
      held.hold(nullptr);  // not through a wait of unbounded length
      e = wait_adaptive(
          s, lk, [&] { return rx_takeable(s) || s.rd_shut || s.peer_fin; }, s.rcv_timeo_ns);
    }
    cur.advance(placed);
    got += placed;
    if (placed && !s.link.qp) return ssize_t(got);  // closed by another thread after
    if (placed) continue;
    if (e) {  // EINTR, EAGAIN (SO_RCVTIMEO), EBADF (closed by another thread)
      if (got) return ssize_t(got);
      if (s.state != State::kSdp) return kServedByKernel;
      errno = e;
      return -1;
    }
    if (s.peer_gone && !rx_ready(s) && !s.peer_fin && !s.fin_arrived) set_error(s, ECONNRESET);
  }
}

short stream_poll(Sock &s, uint64_t *changes, bool *on_tcp) {
  SockLock lk(s.mu);
  if (changes) *changes = s.mu.changes() + 1;  // with this call's own release
  if (!s.link.qp) return POLLNVAL;
  if (inherited(s)) return POLLERR | POLLHUP;
  flush(s);
  s.burst = 0;
  progress(s);
  if (revert_at_head(s) && !s.peer_fin && drain_backlog(s)) {  // the kernel answers now
    if (on_tcp) *on_tcp = true;
    return 0;
  }
  short r = 0;
  if (s.tx_tcp && drain_backlog(s)) {  // the kernel socket takes this side's bytes now
    pollfd p{s.fd, POLLOUT, 0};
    if (real().poll(&p, 1, 0) > 0 && (p.revents & POLLOUT)) r |= POLLOUT;
  }
  if (rx_ready(s) || s.rd_shut) r |= POLLIN;
  if (s.peer_fin || s.fin_arrived) r |= POLLRDHUP;
  if (s.fin_sent ||
      (!s.tx_tcp && tx_ready(s, std::min<uint64_t>(s.link.remote.ring_bytes / 4, 65536))))
    r |= POLLOUT;
  // The peer's end of the kernel socket is looked at when the kernel reports it readable
  // (stream_check_peer from the multiplexers), not here: no system call per idle socket.
  if (s.peer_gone) set_error(s, s.peer_fin || s.fin_arrived ? EPIPE : ECONNRESET);
  // A peer that closed after its FIN leaves a readable end and writes that fail (EPIPE), as
  // TCP does; a reset is an error.
  if (s.error == EPIPE)
    r |= POLLIN | POLLOUT;
  else if (s.error)
    r |= POLLERR | POLLHUP | POLLIN;
  if ((s.peer_fin || s.fin_arrived) && s.fin_sent) r |= POLLHUP;
  return r;
}

void stream_check_peer(Sock &s, bool hup) {
  std::lock_guard<SockMutex> lk(s.mu);
  if (s.link.qp) check_peer(s, hup);
}

ibv_cq *stream_arm(Sock &s, int *channel_fd) {
  ibv_cq *cq;
  {
    std::lock_guard<SockMutex> lk(s.mu);
    cq = s.link.cq;
    if (channel_fd) *channel_fd = cq ? s.link.channel->fd : -1;  // the group's: never closed
  }
  // Armed without the socket's lock, as in wait_until.
  if (cq) ibv_req_notify_cq(cq, 0);
  return cq;
}

ibv_cq *stream_cq(Sock &s) {
  std::lock_guard<SockMutex> lk(s.mu);
  return s.link.cq;
}

// The last sleeper out resets the kick: one that wakes earlier must not hide it from the
// others (they are woken together, and look at the descriptor again).
void stream_take_kick(Sock &s) {
  uint64_t v;
  if (s.link.kick_fd >= 0 && s.sleepers == 0)
    (void)!syscall(SYS_read, s.link.kick_fd, &v, sizeof v);
}

// Extended sockets: the WINDOW record tells the peer where it may write (ordered with the
// stream); earlier windows stay registered until the link goes (link.window_mrs).
int stream_expose(Sock &s, void *addr, uint64_t len) {
  SockLock lk(s.mu);
  if (!s.link.qp || s.state != State::kSdp || inherited(s)) {
    errno = ENOPROTOOPT;
    return -1;
  }
  if (len > UINT32_MAX || (len && !addr)) {
    errno = EINVAL;
    return -1;
  }
  SrcAvail w{reinterpret_cast<uintptr_t>(addr), 0, uint32_t(len)};
  if (len) {
    ibv_mr *mr = reg_user(addr, len);
    if (!mr) {
      errno = ENOMEM;
      return -1;
    }
    ++s.stats.registrations;
    s.link.window_mrs.push_back(mr);
    w.rkey = mr->rkey;
  }
  for (;;) {
    if (s.tx_tcp || s.error) {
      errno = s.error ? s.error : EOPNOTSUPP;
      return -1;
    }
    if (tx_ready(s, need_bytes(s, 2 * kRound)) && put_record(s, kWindow, 0, &w, sizeof w)) return 0;
    if (int e =
            wait_until(s, lk, [&] { return tx_ready(s, need_bytes(s, 2 * kRound)) || s.tx_tcp; })) {
      errno = s.state == State::kSdp ? e : EOPNOTSUPP;
      return -1;
    }
  }
}

// A one-sided write: an RDMA WRITE into the peer's window, posted after everything this side
// sent before it and waited for, so that what it sends next arrives after the data.
int stream_write_window(Sock &s, const void *addr, uint64_t len, uint64_t offset) {
  SockLock lk(s.mu);
  if (!s.link.qp || s.state != State::kSdp || inherited(s)) {
    errno = ENOPROTOOPT;
    return -1;
  }
  const bool block = !s.nonblocking;
  auto can_write = [&] {
    return s.peer_win_len && s.tx_posted == s.tx_pos && s.sq_used + 2 < s.link.send_depth &&
           !s.wz_claiming;
  };
  for (;;) {
    progress(s);
    if (s.tx_tcp || s.error) {
      errno = s.error ? s.error : EOPNOTSUPP;
      return -1;
    }
    flush(s);  // what was sent before the write goes before it
    if (can_write()) break;
    if (!block) {
      errno = EAGAIN;
      return -1;
    }
    if (int e = wait_until(
            s, lk, [&] { return can_write() || s.tx_tcp; }, s.snd_timeo_ns)) {
      errno = s.state == State::kSdp ? e : EOPNOTSUPP;
      return -1;
    }
  }
  if (offset > s.peer_win_len || len > s.peer_win_len - offset || (len && !addr)) {
    errno = EINVAL;
    return -1;
  }
  if (len == 0) return 0;
  s.window_failed = false;
  int rc = rdma_and_wait(s, lk, IBV_WR_RDMA_WRITE, const_cast<void *>(addr), len,
                         s.peer_win_addr + offset, s.peer_win_rkey, kWindowWrite, &s.window_writes);
  if (!rc && s.window_failed) rc = s.tx_tcp ? EOPNOTSUPP : s.error ? s.error : ECONNRESET;
  if (rc) {
    errno = rc == EBADF && s.state != State::kSdp ? EOPNOTSUPP : rc;
    return -1;
  }
  s.stats.onesided_tx += len;
  return 0;
}

int stream_fionread(Sock &s) {
  std::lock_guard<SockMutex> lk(s.mu);
  if (!s.link.qp || inherited(s)) return 0;
  progress(s);
  if (revert_at_head(s)) {  // the rest is the kernel's
    int n = 0;
    return real().ioctl(s.fd, FIONREAD, &n) == 0 ? n : 0;
  }
  const uint64_t mask = s.link.ring_bytes - 1;
  uint64_t n = 0;
  uint32_t off = s.rec_off;
  for (uint64_t pos = s.rx_pos; pos < s.rx_produced;) {
    const Rec *r = reinterpret_cast<const Rec *>(s.link.ring + (pos & mask));
    if (r->type == kRevert) break;
    if (r->type == kData) n += r->len - off;
    if (r->type == kSrcAvail) {
      SrcAvail sa;
      memcpy(&sa, s.link.ring + (pos & mask) + kRound, sizeof sa);
      if (r->arg > s.skip_src_upto) n += sa.len - off;
    }
    pos += kRound + round16(r->len);
    off = 0;
  }
  return int(std::min<uint64_t>(n, INT32_MAX));
}

namespace {

// Puts a FIN or a REVERT after everything pending. Credits always hold them (kFinReserve);
// only the peer's acks for the writes can be missing for a moment: waits up to wait_ms.
bool send_control(Sock &s, SockLock &lk, uint8_t type, int wait_ms) {
  if (s.error || s.state != State::kSdp) return false;
  const size_t len = type == kRevert ? sizeof(RevertAt) : 0;
  const uint64_t end = now_ns() + uint64_t(wait_ms) * 1000000;
  while (!s.error && !s.tx_tcp && now_ns() < end) {
    progress(s);
    if (credit_bytes(s) >= need_bytes(s, kRound + round16(len)) && credit_msgs(s) >= 2 &&
        !s.wz_claiming) {
      // Where this side is now, taken under the lock with the record.
      const RevertAt at{s.rx_pos, s.rec_off};
      s.force_signal = true;  // the last write: close waits for its completion
      if (put_record(s, type, 0, &at, len)) return true;
      s.force_signal = false;
      continue;  // that was a pad
    }
    lk.unlock();
    usleep(100);
    lk.lock();
    if (!s.link.qp) return false;
    check_peer(s);
    if (s.peer_gone) return false;
  }
  return false;
}

// FIN: the peer reads end of stream after everything sent before it.
bool send_fin(Sock &s, SockLock &lk, int wait_ms) {
  if (s.fin_sent) return true;
  if (s.tx_tcp && s.link.qp) {  // the connection is TCP's now
    s.fin_sent = real().shutdown(s.fd, SHUT_WR) == 0;
    return s.fin_sent;
  }
  s.fin_sent = send_control(s, lk, kFin, wait_ms);
  return s.fin_sent;
}

// After the last write was posted: waits (1 s at most) until it landed, so that it is in the
// peer's ring before the QP goes: until its own completion, the signaled post numbered
// last_write_no (completions come in order; sq_used may stay above 0 for unsignaled acks
// posted after it). The lock stays held: nothing may follow a FIN or REVERT (another
// thread's send). It lands when the peer's progress thread has placed it: each look
// yields, so that on two cores that thread runs.
void wait_last_write(Sock &s) {
  const uint64_t end = now_ns() + 1000000000ull;
  while (s.signaled_done < s.last_write_no && !s.error && !s.peer_gone && now_ns() < end) {
    progress(s);
    if (s.signaled_done >= s.last_write_no) break;
    check_peer(s);
    sched_yield();
  }
}

}  // namespace

int stream_shutdown(Sock &s, int how) {
  SockLock lk(s.mu);
  if (how == SHUT_RD || how == SHUT_RDWR) {
    s.rd_shut = true;
    if (s.sleepers > 0) {  // a receive asleep in another thread returns 0, as on Linux
      uint64_t one = 1;
      (void)!syscall(SYS_write, s.link.kick_fd, &one, sizeof one);
    }
  }
  if (how == SHUT_WR || how == SHUT_RDWR) send_fin(s, lk, 5000);
  return 0;
}

bool stream_close(Sock &s) {
  SockLock lk(s.mu);
  if (!s.link.qp) return false;  // closed already (at exit, or by another descriptor's close)
  sink_end(s, lk);
  // A claim of another thread's send in flight: its WR_COMPL goes before the FIN.
  while (s.wz_claiming && s.link.qp && !s.error) wait_until(s, lk, [&] { return !s.wz_claiming; });
  if (!s.link.qp) return false;
  const uint64_t data_end = s.tx_pos;  // what a FIN follows
  if (s.state == State::kSdp && !s.tx_tcp) {
    check_peer(s);
    // A peer whose process closed its socket reads nothing more: no FIN, no wait.
    if (!s.peer_gone && send_fin(s, lk, 1000)) wait_last_write(s);
  }
  write_stats(s);
  // What this side sent is in the peer's ring, which outlives this side's QP, unless the
  // peer hands the connection back to TCP before reading it (it forks and closes): then this
  // side must send it again. So a connection the peer has not read to the end stays a while
  // (not when this side leaves data unread itself: TCP resets such a connection).
  progress(s);
  const bool unread = s.tx_tcp ? !drain_backlog(s) : s.peer_consumed < data_end;
  if (s.state == State::kSdp && unread && s.rx_pos == s.rx_produced && !s.peer_gone && !s.error) {
    s.linger_until_ns = now_ns() + 10000000000ull;
    linger_add(s);
    return true;
  }
  link_destroy(s.link);
  return false;
}

// The REVERT tells the peer how far this side had consumed its stream: the peer sends the
// rest again over TCP, and everything after it. This side's own records are all before the
// REVERT in the peer's ring. What the kernel socket then carries belongs to whichever
// process holds it (the forked child, or the new image after exec).
void stream_revert(Sock &s) {
  SockLock lk(s.mu);
  if (!s.link.qp) return;
  if (s.state == State::kSdp && !inherited(s)) {
    check_peer(s);
    progress(s);
    sink_end(s, lk);
    while (s.wz_claiming && s.link.qp && !s.error)
      wait_until(s, lk, [&] { return !s.wz_claiming; });
    // A READ of the peer's buffer in flight, a zero-copy send of this side the peer is
    // reading, or a write into a buffer the peer offered (other threads) would fail once the
    // QP goes: they end first (1 s at most).
    if (s.reads_pending || s.zc_waiting || s.wz_writes || s.wz_claiming)
      wait_until(
          s, lk,
          [&] { return !s.reads_pending && !s.zc_waiting && !s.wz_writes && !s.wz_claiming; },
          1000000000);
    if (s.tx_tcp) {
      logf("fd %d: both ends handed the connection back; %llu ring bytes unread here are lost",
           s.fd, (unsigned long long)(s.revert_at - s.rx_pos));
      // What the peer had not read goes to the kernel socket before this process lets go.
      const uint64_t end = now_ns() + 2000000000ull;
      while (!drain_backlog(s) && now_ns() < end) {
        pollfd p{s.fd, POLLOUT, 0};
        lk.unlock();
        real().poll(&p, 1, 100);
        lk.lock();
        if (!s.link.qp) return;
      }
    } else if (!s.peer_gone && send_control(s, lk, kRevert, 1000)) {
      wait_last_write(s);
      logf("fd %d: handed back to TCP (had consumed %llu ring bytes)", s.fd,
           (unsigned long long)s.rx_pos);
    } else if (!s.peer_gone && !s.error) {
      logf("fd %d: could not hand the connection back to TCP: closed", s.fd);
      if (send_fin(s, lk, 1000)) wait_last_write(s);
    }
  }
  write_stats(s);
  link_destroy(s.link);
  s.state = State::kCandidate;
}

bool stream_on_tcp(Sock &s) {
  std::lock_guard<SockMutex> lk(s.mu);
  return s.link.qp && s.state == State::kSdp && revert_at_head(s) && !s.peer_fin &&
         drain_backlog(s);
}

bool stream_leave(Sock &s) {
  std::lock_guard<SockMutex> lk(s.mu);
  if (!s.link.qp || s.state != State::kSdp) return false;
  write_stats(s);
  link_destroy(s.link);
  s.state = State::kCandidate;
  return true;
}

namespace {

// The flusher: small sends held to coalesce are posted within about kHoldNs even when the
// program makes no further call on the socket (it blocks elsewhere, or sleeps).
struct Flusher {
  std::mutex mu;
  std::condition_variable cv;
  bool waiting = false;  // on cv: the next add wakes it (else it comes by itself)
  std::vector<std::weak_ptr<Sock>> list;
  std::vector<std::shared_ptr<Sock>> lingering;  // closed: the program holds them no more
};
Flusher *flusher = nullptr;
pid_t flusher_pid = 0;
std::mutex flusher_start_mu;

// Closes the layer's descriptor of a connection whose lingering is over, once, and only
// when the program names the socket no more: a connection ended at exit is still in the
// table, and the program's own close() later closes it (closed here too, that was twice).
void linger_close_fd(Sock &s) {
  if (s.linger_closed_fd || !sock_released(s)) return;
  s.linger_closed_fd = true;
  real().close(s.fd);
}

// One look at a lingering connection (s.mu held): acks, the peer's REVERT and the backlog
// it brings. True when it is over: its link and descriptor are gone.
bool linger_step(Sock &s) {
  if (!s.link.qp) {  // ended meanwhile (a hand-back reverted it): the descriptor is ours yet
    linger_close_fd(s);
    return true;
  }
  progress(s);
  if (s.tx_tcp) drain_backlog(s);
  check_peer(s);
  // Its FIN consumed too (the peer acks it at once): all was read.
  const bool read = s.tx_tcp ? s.backlog.empty() : s.peer_consumed >= s.tx_pos;
  if (!read && !s.error && !s.peer_gone && now_ns() < s.linger_until_ns) return false;
  if (!read)
    logf("fd %d: closed before the peer read %llu ring bytes", s.fd,
         (unsigned long long)(s.tx_pos - s.peer_consumed));
  link_destroy(s.link);
  linger_close_fd(s);
  s.linger_until_ns = 0;
  return true;
}

// Looks at every lingering connection once; true when none is left.
bool linger_round(Flusher *f) {
  std::vector<std::shared_ptr<Sock>> all;
  {
    std::lock_guard<std::mutex> lk(f->mu);
    all = f->lingering;
  }
  std::vector<Sock *> over;
  for (auto &s : all) {
    std::lock_guard<SockMutex> lk(s->mu);
    if (linger_step(*s)) over.push_back(s.get());
  }
  std::lock_guard<std::mutex> lk(f->mu);
  std::erase_if(f->lingering, [&](const std::shared_ptr<Sock> &s) {
    return std::find(over.begin(), over.end(), s.get()) != over.end();
  });
  return f->lingering.empty();
}

void flusher_main(Flusher *f) {
  pthread_setname_np(pthread_self(), "sdp-flusher");
  uint64_t next_linger = 0;
  for (;;) {
    std::vector<std::weak_ptr<Sock>> list;
    {
      std::unique_lock<std::mutex> lk(f->mu);
      f->waiting = true;
      f->cv.wait(lk, [f] { return !f->list.empty() || !f->lingering.empty(); });
      f->waiting = false;
    }
    if (now_ns() >= next_linger) {  // lingering connections: once a millisecond
      linger_round(f);
      next_linger = now_ns() + 1000000;
    }
    // Most held sends are posted by the program's next call; come by once in a while.
    std::this_thread::sleep_for(std::chrono::microseconds(50));
    {
      std::lock_guard<std::mutex> lk(f->mu);
      list.swap(f->list);
    }
    for (auto &w : list) {
      std::shared_ptr<Sock> s = w.lock();
      if (!s) continue;
      std::lock_guard<SockMutex> lk(s->mu);
      s->in_flush_list = false;
      if (!s->link.qp || inherited(*s)) continue;
      if (s->tx_tcp) {  // a backlog to send again over TCP
        if (!drain_backlog(*s)) flusher_add(*s);
        continue;
      }
      if (s->tx_posted == s->tx_pos) continue;
      progress(*s);
      if (!flush(*s)) flusher_add(*s);  // credits short: again later
    }
  }
}

}  // namespace

void flusher_fork_lock(bool lock) {
  if (lock)
    flusher_start_mu.lock();
  else
    flusher_start_mu.unlock();
}

void auto_fork_lock(bool lock) {
  auto_threshold().fork_lock(lock);
}

namespace {

Flusher *the_flusher() {
  std::lock_guard<std::mutex> lk(flusher_start_mu);
  if (flusher_pid != getpid()) {  // first use, or a fork()ed child: a thread of its own
    flusher_pid = getpid();
    flusher = new Flusher();  // the parent's (and its locks) are not this process's
    std::thread(flusher_main, flusher).detach();
  }
  return flusher;
}

void linger_add(Sock &s) {
  Flusher *f = the_flusher();
  std::lock_guard<std::mutex> lk(f->mu);
  f->lingering.push_back(s.shared_from_this());
  if (f->waiting) f->cv.notify_one();
}

}  // namespace

void flusher_add(Sock &s) {
  if (s.in_flush_list) return;
  s.in_flush_list = true;
  Flusher *f = the_flusher();
  std::lock_guard<std::mutex> lk(f->mu);
  f->list.push_back(s.weak_from_this());
  if (f->waiting) f->cv.notify_one();
}

void stream_linger_wait(int wait_ms) {
  Flusher *f;
  {
    std::lock_guard<std::mutex> lk(flusher_start_mu);
    if (flusher_pid != getpid()) return;
    f = flusher;
  }
  const uint64_t end = now_ns() + uint64_t(wait_ms) * 1000000;
  while (!linger_round(f) && now_ns() < end) usleep(1000);
}

}  // namespace sdp
