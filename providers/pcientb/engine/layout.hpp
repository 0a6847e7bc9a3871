// Peer-visible layouts: what lives in a node's area and is read or written by
// other nodes. One definition, used by the owner and by its peers.
#pragma once

#include <infiniband/verbs.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "engine/counters.hpp"
#include "fabric/fabric.hpp"

namespace pcientb::engine {

using Off = uint64_t;  // offset in a node's area; 0 means none

constexpr uint32_t kMaxMrs = 16384;  // MR index is 14 bits of a key
constexpr uint32_t kMaxQps = 4096;   // QP index is the low 12 bits of a QPN
constexpr size_t kAreaPage = 4096;   // the area is handed out in pages

// Limits of the objects that live outside the tables, per node.
enum class Quota { pd, cq, srq, ah };
constexpr int kQuotas = 4;
constexpr uint32_t kMaxPds = 1 << 20, kMaxCqs = 4096, kMaxSrqs = 4096, kMaxAhs = 65536;
constexpr uint32_t kQuotaLimit[kQuotas] = {kMaxPds, kMaxCqs, kMaxSrqs, kMaxAhs};
constexpr uint32_t kMaxSge = 16;
constexpr uint32_t kMaxInline = 512;
constexpr uint32_t kMinInline = 64;  // what every QP takes inline, whatever it asked
constexpr uint32_t kMaxQpWr = 16384;
constexpr uint32_t kMaxCqe = 1u << 20;
constexpr uint32_t kMaxSrqWr = 32768;
constexpr uint32_t kMtu = 4096;
constexpr uint32_t kGrhBytes = 40;
constexpr uint32_t kMaxRdAtom = 16;

// A bounded multi-producer multi-consumer ring (sequence number per slot): no
// locks, so a peer that dies cannot leave one held. A slot starts with its
// sequence number, stored less the slot's index so that zeroed memory is an
// empty ring; the payload follows.
struct alignas(64) RingHeader {
  alignas(64) std::atomic<uint64_t> tail;  // producers
  std::atomic<uint64_t> head_seen;         // producers of an MPSC ring: head, as last read
  alignas(64) std::atomic<uint64_t> head;  // consumers
  alignas(64) uint32_t mask;
  uint32_t slot_size;
};
static_assert(sizeof(RingHeader) == 192);

struct RingSlot {
  std::atomic<uint64_t> seq;
};

// The slot for `pos`, in the slots that follow the header.
inline RingSlot *ring_slot(RingHeader *r, uint64_t pos) {
  return reinterpret_cast<RingSlot *>(reinterpret_cast<uint8_t *>(r + 1) +
                                      (pos & r->mask) * r->slot_size);
}
inline uint64_t ring_seq(RingHeader *r, RingSlot *s, uint64_t pos) {
  return s->seq.load(std::memory_order_acquire) + (pos & r->mask);
}
inline void ring_set_seq(RingHeader *r, RingSlot *s, uint64_t pos, uint64_t seq) {
  s->seq.store(seq - (pos & r->mask), std::memory_order_release);
}

// On zeroed memory of ring_bytes(capacity, slot_size); capacity a power of 2.
inline void ring_init(RingHeader *r, uint32_t capacity, uint32_t slot_size) {
  r->mask = capacity - 1;
  r->slot_size = slot_size;
  r->head.store(0, std::memory_order_relaxed);
  r->tail.store(0, std::memory_order_release);
}

// The smallest power of 2 that is at least n: a ring's capacity.
inline uint32_t pow2_at_least(uint32_t n) {
  uint32_t c = 1;
  while (c < n) c <<= 1;
  return c;
}

inline size_t ring_bytes(uint32_t capacity, uint32_t slot_size) {
  return sizeof(RingHeader) + size_t{capacity} * slot_size;
}

inline void ring_publish(RingHeader *r, RingSlot *s, uint64_t pos) {
  ring_set_seq(r, s, pos, pos + 1);
}

// Takes the oldest published slot to read; nullptr when empty. Give it back
// with ring_release once read.
inline RingSlot *ring_take(RingHeader *r, uint64_t *pos_out) {
  uint64_t pos = r->head.load(std::memory_order_relaxed);
  for (;;) {
    RingSlot *s = ring_slot(r, pos);
    auto dif = static_cast<int64_t>(ring_seq(r, s, pos) - (pos + 1));
    if (dif == 0) {
      if (r->head.compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed)) {
        *pos_out = pos;
        return s;
      }
    } else if (dif < 0) {
      return nullptr;
    } else {
      pos = r->head.load(std::memory_order_relaxed);
    }
  }
}
inline void ring_release(RingHeader *r, RingSlot *s, uint64_t pos) {
  ring_set_seq(r, s, pos, pos + r->mask + 1);
}
// Empties a ring; positions go on from `base` (>= every position used so far),
// so that a peer's earlier view of the tail never covers a new slot.
inline void ring_reinit_at(RingHeader *r, uint64_t base) {
  for (uint64_t pos = base; pos < base + r->mask + 1; ++pos)
    ring_set_seq(r, ring_slot(r, pos), pos, pos);
  r->head.store(base, std::memory_order_relaxed);
  r->tail.store(base, std::memory_order_release);
}
// A ring with one consumer at a time (a CQ: its owner, under the poll lock)
// and any number of producers (local and remote senders). Producers judge
// room by the consumer's head (read only when their last reading of it is
// used up) and the consumer never writes a slot: an entry moves one line
// between the nodes, once.
inline RingSlot *mpsc_reserve(RingHeader *r, uint64_t *pos_out) {
  const uint64_t capacity = uint64_t{r->mask} + 1;
  uint64_t pos = r->tail.load(std::memory_order_relaxed);
  for (;;) {
    if (pos - r->head_seen.load(std::memory_order_acquire) >= capacity) {
      uint64_t head = r->head.load(std::memory_order_acquire);
      r->head_seen.store(head, std::memory_order_release);
      if (pos - head >= capacity) return nullptr;
    }
    // seq_cst: ordered with a QP's destroy (complete_with); on x86 the same
    // instruction as a relaxed one.
    if (r->tail.compare_exchange_weak(pos, pos + 1, std::memory_order_seq_cst,
                                      std::memory_order_relaxed))
      break;
  }
  *pos_out = pos;
  return ring_slot(r, pos);
}
// The consumer's next published slot, or nullptr; mpsc_pop it once read.
inline RingSlot *mpsc_peek(RingHeader *r, uint64_t *pos_out) {
  uint64_t pos = r->head.load(std::memory_order_relaxed);
  RingSlot *s = ring_slot(r, pos);
  if (ring_seq(r, s, pos) != pos + 1) return nullptr;
  *pos_out = pos;
  return s;
}
inline void mpsc_pop(RingHeader *r, uint64_t pos) {
  r->head.store(pos + 1, std::memory_order_release);  // after the slot was read
}

inline uint64_t ring_count(const RingHeader *r) {
  uint64_t t = r->tail.load(std::memory_order_acquire);
  uint64_t h = r->head.load(std::memory_order_acquire);
  return t > h ? t - h : 0;
}

// Where the owner's process hears of events of an object (completion channel,
// async events): the write end of a pipe of that process. Only the owner's own
// threads raise them (raise_event): nothing here is a peer's to use.
struct EventFd {
  int32_t fd;  // -1: none
};

// --- completion queue ------------------------------------------------------
enum ArmState : uint32_t { kDisarmed = 0, kArmNext = 1, kArmSolicited = 2 };

// What a producer writes into a CQ slot. Every producer is a thread of the
// CQ's own node: a peer's message is completed by the node it reaches.
struct CqEntry {
  ibv_wc wc;
  // A send completion retires its WR and those before it from the send
  // queue once polled: QP index << 48 | the WR's number. 0 for receives.
  // kDiscarded marks an entry that polling skips.
  uint64_t sq_ticket;

  static constexpr uint64_t kDiscarded = uint64_t{1} << 63;
};
struct CqSlot {
  RingSlot hdr;
  CqEntry e;
};
static_assert(sizeof(CqSlot) <= 64);
constexpr uint32_t kCqSlotSize = 64;

struct CqShared {
  std::atomic<uint32_t> armed;
  std::atomic<uint32_t> overflow;
  // Whether a producer fences between publishing an entry and looking at
  // `armed` (cq.cpp, kFence*); all producers are threads of the owner.
  std::atomic<uint32_t> fence;
  EventFd channel;  // completion channel of the owner
  EventFd async;    // async events of the owner's context
  uint64_t handle;  // the owner's struct ibv_cq *
  RingHeader ring;  // slots follow
};

// --- receive queue (a QP's own, or an SRQ) -----------------------------------
struct RecvWqe {
  RingSlot hdr;
  uint64_t wr_id;
  uint32_t num_sge;
  uint32_t pad;
  ibv_sge sge[];  // max_sge of them
};
inline uint32_t recv_slot_size(uint32_t max_sge) {
  return static_cast<uint32_t>((sizeof(RecvWqe) + max_sge * sizeof(ibv_sge) + 63) & ~size_t{63});
}

struct RqShared {
  uint32_t max_sge;
  uint32_t pd;
  std::atomic<uint32_t> limit;  // SRQ limit; 0 = disarmed
  uint32_t is_srq;
  Off cq;           // an SRQ's completions go to the receiving QP's CQ; unused
  EventFd async;    // where SRQ-limit events go
  uint64_t handle;  // the owner's struct ibv_srq *
  // WQEs consumed so far (taken by a message and done with, flushed or given
  // back), in any order: an SRQ's receives are released in the order their
  // completions are polled, not in the order they were posted.
  alignas(64) std::atomic<uint64_t> released;
  RingHeader ring;  // slots follow
};

// --- memory regions ------------------------------------------------------------
// key = index << 8 | gen (7 bits); the lkey is the key, the rkey has bit 7 set.
constexpr uint32_t kRkeyBit = 0x80;
struct MrShared {
  std::atomic<uint32_t> key;  // 0 = free
  uint32_t pd;
  uint32_t access;
  uint32_t pad;
  uint64_t addr;  // where the MR starts in its own address space (the iova)
  uint64_t length;
  fabric::WindowId window;
  uint64_t va;  // where it starts in its owner's memory
  uint64_t pad2;
};
static_assert(sizeof(MrShared) == 56 || sizeof(MrShared) == 64);

// The owner's virtual address of MR address a.
inline uint64_t va_of(const MrShared &m, uint64_t a) {
  return m.va + (a - m.addr);
}

// --- queue pairs -----------------------------------------------------------------
// qpn = gen << 12 | index; gen never 0, so QPNs 0 and 1 are never handed out.
struct QpShared {
  std::atomic<uint32_t> qpn;    // 0 = free
  std::atomic<uint32_t> state;  // enum ibv_qp_state
  // modify_qp writes these while a serving thread (link setup, a request) reads them.
  std::atomic<uint32_t> type;  // enum ibv_qp_type
  std::atomic<uint32_t> pd;
  std::atomic<uint32_t> access;  // qp_access_flags
  std::atomic<uint32_t> qkey;
  std::atomic<uint32_t> dest_qpn;
  std::atomic<uint16_t> dest_lid;
  std::atomic<uint8_t> min_rnr_timer;
  uint8_t pad;
  Off rq;   // RqShared, or 0 with an SRQ
  Off srq;  // RqShared of the SRQ
  Off rcq;  // CqShared of the receive CQ
  EventFd async;
  uint64_t handle;  // the owner's struct ibv_qp *
  // The receive of a message whose requester died (or whose window went)
  // while its bytes were pulled: it stays taken, as the receive in progress
  // of an HCA's responder, until the QP fails (it completes flushed then).
  uint64_t torn_wr_id;
  std::atomic<uint32_t> torn;
  uint32_t pad2;
};

// --- links: what a node learns of a peer's tables without reading them -------
// Node A links to node B to reach B's QPs and MRs: A gives B a mirror (in
// A's area) and B pushes its tables there with posted writes, then keeps it
// current. A checks rkeys and B's QP state against its own memory.
constexpr uint32_t kMaxLinks = 1025;  // indexed by the peer's LID (1..1024)

// In node X's area at index L: written only by the node with LID L (the
// writer), about the link the writer asks of X and the one X asked of it.
struct alignas(64) LinkBox {
  // The writer asks X for a link:
  std::atomic<uint64_t> nonce;        // the writer's incarnation
  std::atomic<uint64_t> mirror;       // Off of the Mirror of X's tables, in the writer's area
  std::atomic<uint64_t> answer_lane;  // Off of the lane for X's answers, in the writer's area
  std::atomic<uint64_t> asked;        // bumped for a (new) link; written last
  // The writer answers X's ask (X's box at the writer):
  std::atomic<uint64_t> served_nonce;  // X's incarnation it was served for
  std::atomic<uint64_t> request_lane;  // Off of the lane for X's requests, in the writer's area
  std::atomic<uint64_t> served;        // X's `asked` whose full push is done; written last
  // Credits, as cells consumed so far: of X's requests in the writer's
  // lane, and of the answers X wrote to the writer.
  alignas(64) std::atomic<uint64_t> requests_taken;
  alignas(64) std::atomic<uint64_t> answers_taken;
};

// --- lanes: messages between linked nodes --------------------------------------
// A lane is a ring of 64-byte cells in its consumer's area with one producer.
// A record takes whole cells and never wraps (a pad record fills the end);
// its head's `seq` is its position + 1 (in cells, low 32 bits) and lands
// last, in a post of its own: a record is there when its seq is. The
// consumer posts how many cells it has taken into its box at the producer.
// Answers have lanes of their own: a node takes answers whatever it holds,
// so requests waiting for room to answer cannot deadlock two nodes.
constexpr uint32_t kCell = 64;
constexpr uint32_t kRequestCells = 2048;  // 128 KiB
constexpr uint32_t kAnswerCells = 1024;   // 64 KiB

enum RecordType : uint16_t { kRecPad = 1, kRecAtomic, kRecAnswer, kRecSend, kRecDatagram };

struct RecordHead {
  std::atomic<uint32_t> seq;
  uint16_t type;
  uint16_t cells;
  uint32_t qpn;      // requests: the target QP; answers: the requester's QP
  uint32_t psn;      // the requester's number of the request (never 0)
  uint32_t src_qpn;  // requests: the requester's QP
  // Requests: the requester QP's connection (bumped at each RTR): a target
  // that went back for a PSN forgets that when a new connection talks.
  uint32_t epoch;
};
static_assert(sizeof(RecordHead) == 24);

struct AtomicRecord {
  RecordHead head;
  uint32_t rkey;
  uint32_t op;  // IBV_WR_ATOMIC_CMP_AND_SWP or IBV_WR_ATOMIC_FETCH_AND_ADD
  uint64_t addr;
  uint64_t compare_add;
  uint64_t swap;
};
static_assert(sizeof(AtomicRecord) <= kCell);

// A SEND (with immediate) or an RDMA WRITE with immediate, executed by the
// target: it takes the receive from its own queue, places the bytes and
// completes into its own CQ. A WRITE's remote address (8 bytes) follows the
// record; then the bytes (inline) or, with `pieces` > 0, the pieces of the
// requester's windows that the target pulls them from. 40 bytes: a SEND of
// up to 24 bytes (UCX's and MPI's small messages) arrives in one cache line,
// one transfer between the cores, not two.
constexpr uint32_t kMaxRecordCells = 16;
struct SendRecord {
  RecordHead head;
  uint8_t opcode;  // IBV_WR_SEND, IBV_WR_SEND_WITH_IMM, IBV_WR_RDMA_WRITE_WITH_IMM
  uint8_t solicited;
  uint16_t pieces;  // 0: the bytes are inline; kPiecesPlaced: the requester placed them
  uint32_t byte_len;
  __be32 imm;
  uint32_t rkey;  // WRITE with immediate
};
static_assert(sizeof(SendRecord) == 40);
// A WRITE with immediate whose bytes the requester wrote through the window before it.
constexpr uint16_t kPiecesPlaced = 0xffff;
// What follows a SendRecord before its bytes or pieces.
constexpr size_t send_extra(uint32_t opcode) {
  return opcode == IBV_WR_RDMA_WRITE_WITH_IMM ? sizeof(uint64_t) : 0;
}
// Where pulled bytes are: a piece of a window of the requester.
struct Piece {
  fabric::WindowId window;
  uint64_t va;
  uint64_t len;
};
constexpr uint32_t kRecordInline = kMaxRecordCells * kCell - sizeof(SendRecord) - sizeof(uint64_t);
static_assert(sizeof(SendRecord) + sizeof(uint64_t) + (kMaxSge + 1) * sizeof(Piece) <=
              kMaxRecordCells * kCell);

// A UD datagram: inline, with the GRH the requester built when its AH had one.
struct DatagramRecord {
  RecordHead head;
  uint32_t qkey;
  uint32_t solicited;
  __be32 imm;
  uint32_t flags;  // kDgImm, kDgGrh
  uint32_t byte_len;
  uint32_t pad;
  uint8_t grh[kGrhBytes];
};
enum DatagramFlags : uint32_t { kDgImm = 1, kDgGrh = 2 };
static_assert(sizeof(DatagramRecord) % 8 == 0);

// The target's answer to a request: its status (IBV_WC_SUCCESS, or the
// error the requester completes with; kAnswerRetry: the QP was not there or
// not ready; kAnswerRnr: no receive posted, `value` is the RNR timer code,
// and the target drops the QP's later requests until this PSN comes again)
// and, for an atomic, the old value.
constexpr uint32_t kAnswerRetry = 0xffff;
constexpr uint32_t kAnswerRnr = 0xfffe;
// Not an answer: the request's WRs were withdrawn by its requester (its
// record voided) while the target served it; nothing is answered.
constexpr uint32_t kAnswerNone = 0xfffd;
struct AnswerRecord {
  RecordHead head;
  uint32_t status;
  uint32_t pad;
  uint64_t value;
};
static_assert(sizeof(AnswerRecord) <= kCell);

// A peer's QP as its owner pushes it (seqlock: odd while changing).
struct QpMirror {
  std::atomic<uint32_t> seq;
  std::atomic<uint32_t> qpn;  // 0: no QP
  std::atomic<uint32_t> state;
  std::atomic<uint32_t> type;
  std::atomic<uint32_t> pd;
  std::atomic<uint32_t> access;
  std::atomic<uint32_t> dest_qpn;
  std::atomic<uint32_t> dest_lid;
};
static_assert(sizeof(QpMirror) == 32);

// A peer's tables, in the linking node's area, written only by that peer.
// MR entries follow MrShared's rule: key 0 while an entry changes.
struct Mirror {
  MrShared mrs[kMaxMrs];
  QpMirror qps[kMaxQps];
};

// The root of a node's area: fixed tables, then allocations. `stats`,
// `qp_stats` and the directories of CQs and SRQs are what the node shows of
// itself to management tools (engine/inspect.hpp); peers never use them.
struct AreaRoot {
  uint64_t magic;
  uint64_t pad[7];
  MrShared mrs[kMaxMrs];
  QpShared qps[kMaxQps];
  NodeStats stats;
  QpStats qp_stats[kMaxQps];
  std::atomic<Off> cq_dir[kMaxCqs];    // CqShared of each live CQ; 0: free
  std::atomic<Off> srq_dir[kMaxSrqs];  // RqShared of each live SRQ
  LinkBox links[kMaxLinks];
};
constexpr uint64_t kAreaMagic = 0x70636e7461726531ULL;

// The format of what peers read and write in a node's area, as a number: the fabric refuses
// to mix nodes whose builds differ in it (each would misread the other's memory). Bump
// kAreaRevision for a change of meaning that no size below shows.
constexpr uint32_t kAreaRevision = 8;
constexpr uint32_t area_layout() {
  const uint64_t parts[] = {kAreaRevision,
                            sizeof(AreaRoot),
                            sizeof(MrShared),
                            sizeof(QpShared),
                            sizeof(RqShared),
                            sizeof(CqShared),
                            sizeof(CqEntry),
                            kCqSlotSize,
                            sizeof(RecvWqe),
                            sizeof(RingHeader),
                            sizeof(SendRecord),
                            sizeof(DatagramRecord),
                            kMaxRecordCells,
                            kMaxQps,
                            kMaxMrs,
                            offsetof(AreaRoot, qps),
                            sizeof(LinkBox),
                            sizeof(QpMirror),
                            sizeof(AtomicRecord),
                            sizeof(AnswerRecord),
                            kRequestCells,
                            kAnswerCells,
                            offsetof(AreaRoot, links)};
  uint32_t h = 2166136261u;  // FNV-1a
  for (uint64_t p : parts)
    for (int i = 0; i < 8; ++i) h = (h ^ uint8_t(p >> (8 * i))) * 16777619u;
  return h;
}
constexpr uint32_t kAreaLayout = area_layout();

template <typename T>
T *at(void *area, Off off) {
  return off ? reinterpret_cast<T *>(static_cast<uint8_t *>(area) + off) : nullptr;
}

// What an async event record is, as libibverbs reads it from async_fd.
struct AsyncRecord {
  uint64_t element;
  uint32_t event_type;
  uint32_t reserved;
};
static_assert(sizeof(AsyncRecord) == 16);

}  // namespace pcientb::engine
