// libFuzzer target: a hostile peer's writes against a victim node (issue 9,
// item 5). The peer is a bare node of the in-process fake fabric that keeps
// the link protocol (docs/transport.md) by hand, and then writes what the
// input says where the contract lets it write:
//   - request records in the victim's request lane (served by Node::service),
//   - answer records in the victim's answer lane (matched to the victim's WRs),
//   - the victim's mirror of the peer's tables (read by the victim's requester),
// while the victim posts WRs to it and receives. The victim may fail its own
// traffic with this peer; it must not crash (ASan/UBSan), hang, or change a
// byte outside the memory it registered (guard bytes around it).
//
// Input: a sequence of operations, each a byte (op % 6) and its arguments;
// a short input does little, bytes past the end read as 0.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "engine/engine.hpp"
#include "engine_end.hpp"
#include "fake_fabric.hpp"

namespace {
namespace eng = pcientb::engine;
namespace fab = pcientb::fabric;
using pcientb::test::EngineEnd;

constexpr uint32_t kPeerQpn = 0x2001;       // the peer's QP, as the victim knows it
constexpr uint32_t kPeerKey = 5u << 8 | 1;  // the peer's MR in the victim's mirror
constexpr uint32_t kPeerPd = 7;
constexpr size_t kWindow = 64 * 1024;

[[noreturn]] void die(const char *what) {
  fprintf(stderr, "peer_fuzz: %s\n", what);
  abort();
}

// Reads the input as it goes.
struct Input {
  const uint8_t *p;
  size_t n;
  uint8_t u8() { return n ? (--n, *p++) : 0; }
  uint16_t u16() {
    const uint16_t lo = u8();
    return static_cast<uint16_t>(lo | u8() << 8);
  }
  uint32_t u32() {
    const uint32_t lo = u16();
    return lo | uint32_t{u16()} << 16;
  }
  size_t take(void *to, size_t len) {
    len = std::min(len, n);
    memcpy(to, p, len);
    p += len;
    n -= len;
    return len;
  }
};

size_t box_at(uint16_t lid) {
  return offsetof(eng::AreaRoot, links) + lid * sizeof(eng::LinkBox);
}

// A lane of the victim's in the peer's area, consumed by the peer: how far,
// in cells (each record's seq is its position + 1).
uint64_t consume(const uint8_t *area, eng::Off lane, uint32_t cells, uint64_t head) {
  for (;;) {
    const auto *h =
        reinterpret_cast<const eng::RecordHead *>(area + lane + (head % cells) * eng::kCell);
    if (h->seq.load(std::memory_order_acquire) != static_cast<uint32_t>(head + 1)) return head;
    const uint16_t c = h->cells;
    if (c == 0 || c > cells - head % cells) return head;  // the victim's own lanes are sane
    head += c;
  }
}

struct World {
  std::unique_ptr<EngineEnd> victim;
  std::unique_ptr<fab::Fabric> peer;  // the hostile node
  fab::Peer *at_victim = nullptr;     // the victim, as the peer reaches it
  uint8_t *area = nullptr;            // the peer's area
  eng::Off bump = 0;
  // Its link to the victim: its requests there, the victim's answers here.
  eng::LaneOut requests;
  eng::Off answer_lane = 0;
  uint64_t answers_head = 0;
  // The victim's link to it: the victim's requests here, answers there.
  eng::LaneOut answers;
  eng::Off victim_mirror = 0;
  eng::Off request_lane = 0;
  uint64_t requests_head = 0;
  std::unique_ptr<uint8_t[]> window_mem;
  fab::WindowId window;

  eng::Off alloc(size_t bytes) {
    eng::Off at = bump;
    bump += (bytes + 4095) & ~size_t{4095};
    return at;
  }
  void post_box(size_t field, uint64_t v) {
    if (peer->post(*at_victim, box_at(peer->lid()) + field, &v, 8)) die("post to the victim's box");
  }
  eng::LinkBox &my_box() { return reinterpret_cast<eng::AreaRoot *>(area)->links[victim->lid()]; }

  void setup() {
    pcientb::test::fake::install();
    victim = std::make_unique<EngineEnd>("victim", kWindow);
    int err = 0;
    peer = fab::backend().open("hostile", eng::kAreaLayout, &err);
    if (!peer) die("open the peer");
    at_victim = peer->peer(victim->lid());
    area = static_cast<uint8_t *>(peer->area());
    bump = (sizeof(eng::AreaRoot) + 4095) & ~size_t{4095};
    window_mem = std::make_unique<uint8_t[]>(kWindow);
    if (peer->expose(window_mem.get(), kWindow, &window)) die("expose");

    // 1. The peer asks the victim for a link, and the victim serves it.
    const eng::Off mirror_here = alloc(sizeof(eng::Mirror));
    answer_lane = alloc(size_t{eng::kAnswerCells} * eng::kCell);
    post_box(offsetof(eng::LinkBox, answers_taken), 0);
    post_box(offsetof(eng::LinkBox, nonce), peer->nonce());
    post_box(offsetof(eng::LinkBox, mirror), mirror_here);
    post_box(offsetof(eng::LinkBox, answer_lane), answer_lane);
    post_box(offsetof(eng::LinkBox, asked), 1);
    for (int i = 0; my_box().served.load() != 1; ++i) {
      if (i > 100000) die("the victim never served the link");
      victim->node().serve_links();
    }
    requests.lane = my_box().request_lane.load();
    requests.cells = eng::kRequestCells;
    requests.taken = &my_box().requests_taken;

    // 2. The victim's QP connects to the peer (its RTR asks for a link);
    // the peer serves that ask with a mirror the fuzzer then rewrites.
    if (victim->connect(peer->lid(), kPeerQpn)) die("connect");
    for (int i = 0; !my_box().asked.load(); ++i)
      if (i > 100000000) die("the victim never asked for a link");
    victim_mirror = my_box().mirror.load();
    answers.lane = my_box().answer_lane.load();
    answers.cells = eng::kAnswerCells;
    answers.taken = &my_box().answers_taken;
    request_lane = alloc(size_t{eng::kRequestCells} * eng::kCell);
    write_mirror();
    post_box(offsetof(eng::LinkBox, requests_taken), 0);
    post_box(offsetof(eng::LinkBox, served_nonce), my_box().nonce.load());
    post_box(offsetof(eng::LinkBox, request_lane), request_lane);
    post_box(offsetof(eng::LinkBox, served), my_box().asked.load());
    peer->doorbell(*at_victim, false);
  }

  // The mirror as an honest peer would push it: its QP, connected to the
  // victim's, and one MR over its window.
  void write_mirror() {
    eng::QpMirror q{};
    q.qpn = kPeerQpn;
    q.state = IBV_QPS_RTS;
    q.type = IBV_QPT_RC;
    q.pd = kPeerPd;
    q.access = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
    q.dest_qpn = victim->qpn();
    q.dest_lid = victim->lid();
    peer->post(*at_victim, qp_entry(), &q, sizeof q);
    eng::MrShared m{};
    m.key = kPeerKey;
    m.pd = kPeerPd;
    m.access = q.access.load();
    m.addr = m.va = reinterpret_cast<uint64_t>(window_mem.get());
    m.length = kWindow;
    m.window = window;
    peer->post(*at_victim, mr_entry(), &m, sizeof m);
  }
  size_t qp_entry() const {
    return victim_mirror + offsetof(eng::Mirror, qps) +
           (kPeerQpn & (eng::kMaxQps - 1)) * sizeof(eng::QpMirror);
  }
  size_t mr_entry() const {
    return victim_mirror + offsetof(eng::Mirror, mrs) + (kPeerKey >> 8) * sizeof(eng::MrShared);
  }

  // The peer takes what the victim put in its lanes here, and says so.
  void credit() {
    uint64_t h = consume(area, request_lane, eng::kRequestCells, requests_head);
    if (h != requests_head) post_box(offsetof(eng::LinkBox, requests_taken), requests_head = h);
    h = consume(area, answer_lane, eng::kAnswerCells, answers_head);
    if (h != answers_head) post_box(offsetof(eng::LinkBox, answers_taken), answers_head = h);
  }
  void serve() {
    credit();
    victim->node().service();
    credit();
  }

  // A record from the input, some of its fields made to name the victim's
  // real objects so that it gets past the first checks.
  void put(eng::LaneOut &lane, Input &in, bool answer) {
    alignas(8) uint8_t rec[eng::kMaxRecordCells * eng::kCell] = {};
    const uint8_t make = in.u8();
    size_t len = sizeof(eng::RecordHead) + in.u16() % (sizeof rec - sizeof(eng::RecordHead) + 1);
    in.take(rec, len);
    auto *h = reinterpret_cast<eng::RecordHead *>(rec);
    if (make & 1) h->qpn = victim->qpn();
    if (make & 2) h->src_qpn = kPeerQpn;
    if (make & 4) h->psn = victim->qp()->next_psn - make % 8;  // one of its last requests
    if (answer) {
      if (make & 8) h->type = eng::kRecAnswer;
      if (make & 16) len = sizeof(eng::AnswerRecord);
    } else {
      if (make & 8) h->type = (make & 128) ? eng::kRecAtomic : eng::kRecSend;
      if (make & 16) {  // the victim's rkey, and an address in its buffer
        auto *s = reinterpret_cast<eng::SendRecord *>(rec);
        auto *a = reinterpret_cast<eng::AtomicRecord *>(rec);
        const uint64_t addr =
            reinterpret_cast<uint64_t>(victim->buf()) + (make & 32 ? 8 : kWindow - 8);
        if (h->type == eng::kRecAtomic) {
          a->rkey = victim->rkey();
          a->addr = addr;
        } else {
          s->rkey = victim->rkey();
          memcpy(rec + sizeof *s, &addr,
                 sizeof addr);  // a WRITE's remote address follows the record
        }
      }
      if (make & 64) {  // pieces in the peer's window
        auto *s = reinterpret_cast<eng::SendRecord *>(rec);
        const size_t header = sizeof *s + eng::send_extra(s->opcode);
        auto *pc = reinterpret_cast<eng::Piece *>(rec + header);
        s->pieces = static_cast<uint16_t>(std::min<uint32_t>(s->pieces, eng::kMaxSge + 1));
        for (uint32_t i = 0; i < s->pieces; ++i) pc[i].window = window;
        len = std::max(len, header + s->pieces * sizeof(eng::Piece));
      }
    }
    eng::lane_put(*peer, *at_victim, lane, h, len);  // full: dropped, as the victim is behind
  }

  void victim_wr(Input &in) {
    static constexpr ibv_wr_opcode kOps[] = {IBV_WR_SEND,
                                             IBV_WR_SEND_WITH_IMM,
                                             IBV_WR_RDMA_WRITE,
                                             IBV_WR_RDMA_WRITE_WITH_IMM,
                                             IBV_WR_RDMA_READ,
                                             IBV_WR_ATOMIC_CMP_AND_SWP,
                                             IBV_WR_ATOMIC_FETCH_AND_ADD};
    const uint8_t op = in.u8();
    const ibv_wr_opcode opcode = kOps[op % std::size(kOps)];
    const bool atomic =
        opcode == IBV_WR_ATOMIC_CMP_AND_SWP || opcode == IBV_WR_ATOMIC_FETCH_AND_ADD;
    const uint32_t len = atomic ? 8 : in.u16() % 4096;
    const uint64_t off = (in.u16() % (kWindow / 8)) * 8;
    const uint64_t remote =
        op & 128 ? in.u32() | uint64_t{in.u32()} << 32
                 : reinterpret_cast<uint64_t>(window_mem.get()) + off % (kWindow - len + 1);
    const uint32_t rkey = op & 64 ? in.u32() : kPeerKey | eng::kRkeyBit;
    victim->post_send(op, opcode, off % (kWindow - len + 1), len, remote, rkey);
  }

  void run(Input in) {
    write_mirror();
    for (uint32_t i = 0; i < 16; ++i) victim->post_recv(i, i * 2048, 2048);
    for (int steps = 0; in.n && steps < 64; ++steps) {
      switch (in.u8() % 6) {
        case 0:
          put(requests, in, false);
          break;
        case 1:
          put(answers, in, true);
          break;
        case 2: {  // the mirror's entries of the peer's QP and MR, rewritten in part
          uint8_t bytes[64];
          const bool qp = in.u8() & 1;
          const size_t size = qp ? sizeof(eng::QpMirror) : sizeof(eng::MrShared);
          const size_t at = in.u8() % size;
          const size_t len = in.take(bytes, std::min<size_t>(in.u8() % 16 + 1, size - at));
          peer->post(*at_victim, (qp ? qp_entry() : mr_entry()) + at, bytes, len);
          break;
        }
        case 3:
          victim_wr(in);
          break;
        case 4:
          victim->post_recv(in.u8(), (in.u8() % 32) * 2048, 2048);
          break;
        default:
          serve();
          victim->poll(0);
          break;
      }
    }
    serve();
    victim->poll(0);
    if (!victim->guards_intact()) die("the victim's memory outside its MR changed");
    // The next input starts from a fresh connection (the lanes go on).
    if (victim->connect(peer->lid(), kPeerQpn)) die("reconnect");
    victim->poll(0);
  }
};

World *world;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!world) {
    world = new World;
    world->setup();
  }
  world->run(Input{data, size});
  return 0;
}
