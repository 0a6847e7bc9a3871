// A hostile peer: a node that writes nonsense wherever the transport lets it
// write (its box at the victim, its request lane there) hurts only its own
// traffic. The victim (verbs, through the provider) serves its own loopback
// connection throughout and afterwards, and none of its memory changes that
// it did not register for the hostile node. The hostile side drives the
// engine directly (the static pcientb::engine), as a buggy or malicious
// provider on another host could.
#include <unistd.h>
#include <atomic>
#include <cstring>
#include <random>
#include <string>
#include <thread>

#include "engine/engine.hpp"
#include "verbs_helpers.hpp"

namespace pcientb::test {
namespace {

namespace eng = pcientb::engine;

void attack(uint16_t victim_lid, uint32_t victim_qpn, uint64_t victim_addr, uint32_t victim_rkey) {
  int err = 0;
  std::shared_ptr<eng::Node> node = eng::Node::acquire(getenv("PCIENTB_FABRIC"), &err);
  ASSERT_TRUE(node) << "cannot join the fabric: " << strerror(err);
  fabric::Fabric &fab = node->fab();
  fabric::Peer *victim = fab.peer(victim_lid);
  ASSERT_NE(victim, nullptr);
  eng::OutLink *link = nullptr;
  auto deadline = std::chrono::steady_clock::now() + 10s;
  while (!(link = node->link(*victim)) && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(1ms);
  ASSERT_NE(link, nullptr) << "the victim never served the link";

  std::mt19937_64 rnd(7);
  uint8_t junk[512];
  // Records of every type, size and content, some naming the victim's real QP
  // with its real rkey and address (atomics, SENDs and WRITEs with immediate
  // the victim must refuse: that QP is not connected to us).
  for (int i = 0; i < 3000; ++i) {
    for (auto &b : junk) b = static_cast<uint8_t>(rnd());
    auto *h = reinterpret_cast<eng::RecordHead *>(junk);
    h->type = static_cast<uint16_t>(rnd() % 8);
    if (i % 3 == 0) {
      auto *a = reinterpret_cast<eng::AtomicRecord *>(junk);
      a->head.type = eng::kRecAtomic;
      a->head.qpn = victim_qpn;
      a->rkey = victim_rkey;
      a->addr = victim_addr + (rnd() % 64) * 8;
      a->op = i % 2 ? IBV_WR_ATOMIC_FETCH_AND_ADD : IBV_WR_ATOMIC_CMP_AND_SWP;
    } else if (i % 3 == 1) {
      // A WRITE with immediate or a SEND into the victim's QP, inline,
      // pulled from windows that are not there, or claimed placed already.
      auto *r = reinterpret_cast<eng::SendRecord *>(junk);
      r->head.type = eng::kRecSend;
      r->head.qpn = victim_qpn;
      r->opcode = static_cast<uint8_t>(i % 2 ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_SEND);
      r->rkey = victim_rkey;
      const uint64_t remote_addr = victim_addr + rnd() % 512;  // read for a WRITE only
      memcpy(junk + sizeof *r, &remote_addr, sizeof remote_addr);
      r->byte_len = static_cast<uint32_t>(rnd() % 600);
      r->pieces = rnd() % 4 == 3 ? eng::kPiecesPlaced : static_cast<uint16_t>(rnd() % 3);
    }
    size_t len = sizeof(eng::RecordHead) + rnd() % (sizeof junk - sizeof(eng::RecordHead));
    std::lock_guard<eng::SpinLock> g(link->req_mu);
    if (!eng::lane_put(fab, *victim, link->requests, h, len))
      break;  // full: the victim stopped taking
    if (i % 64 == 0) fab.doorbell(*victim);
  }
  // A record whose head claims more cells than the lane has.
  {
    eng::RecordHead h{};
    h.type = eng::kRecAtomic;
    h.cells = 0xffff;
    uint32_t seq = static_cast<uint32_t>(link->requests.tail + 1);
    size_t at = link->requests.lane + (link->requests.tail % link->requests.cells) * eng::kCell;
    fab.post(*victim, at + sizeof seq, reinterpret_cast<uint8_t *>(&h) + sizeof seq,
             sizeof h - sizeof seq);
    fab.post(*victim, at, &seq, sizeof seq);
  }
  // Its box at the victim: asks for links with mirrors and lanes outside our
  // area, misaligned, or over the victim's own memory offsets.
  const size_t box = offsetof(eng::AreaRoot, links) + size_t{fab.lid()} * sizeof(eng::LinkBox);
  for (int i = 0; i < 200; ++i) {
    uint64_t v[5] = {i % 2 ? fab.nonce() : rnd(), rnd() % (uint64_t{4} << 30),
                     (rnd() % 4096) * 64 + (i % 3), rnd(), rnd()};
    fab.post(*victim, box, v, sizeof v);
    uint64_t asked = 100 + i;
    fab.post(*victim, box + offsetof(eng::LinkBox, asked), &asked, 8);
    fab.doorbell(*victim, false);
  }
  std::this_thread::sleep_for(200ms);  // let the victim chew on it
}

TEST(Hostile, NonsenseFromAPeerHurtsOnlyItsOwnTraffic) {
  struct Target {
    uint16_t lid;
    uint32_t qpn;
    uint64_t addr;
    uint32_t rkey;
  };
  two_process(
      [](Channel &ch) {  // the victim: a loopback connection of its own
        Node node;
        Buffer buf{node.pd.get(), 64 * 1024};
        Buffer canary{node.pd.get(), 4096, IBV_ACCESS_LOCAL_WRITE};  // not for peers
        fill_pattern(canary.span(0, 4096), 3);
        RcQp qa(node), qb(node);
        Endpoint ea = qa.endpoint(node, buf), eb = qb.endpoint(node, buf);
        rc_init_to_rts(qa.qp.get(), ea, eb);
        rc_init_to_rts(qb.qp.get(), eb, ea);
        auto fetch_add = [&](uint64_t id) {
          return SendWr(IBV_WR_ATOMIC_FETCH_AND_ADD, id)
              .sge(buf.sge(8192, 8))
              .remote(buf.addr(0), buf.mr->rkey)
              .compare_add(1)
              .post(qa.qp.get());
        };
        ASSERT_EQ(0, fetch_add(1));
        ASSERT_EQ(wait_wc(qa.cq.get()).status, IBV_WC_SUCCESS);
        ch.send(Target{node.lid(), qb.qp->qp_num, buf.addr(0), buf.mr->rkey});
        // Our own traffic goes on while the attack lasts, and after it.
        std::atomic<bool> stop{false};
        std::atomic<uint64_t> done{1};
        std::thread traffic([&] {
          while (!stop.load()) {
            if (fetch_add(done.load() + 1) != 0) return;
            if (wait_wc(qa.cq.get()).status != IBV_WC_SUCCESS) return;
            done.fetch_add(1);
          }
        });
        ch.wait(60s);  // the attack is over
        uint64_t after = done.load();
        while (done.load() < after + 100 && done.load() >= after) std::this_thread::sleep_for(1ms);
        stop.store(true);
        traffic.join();
        EXPECT_GE(done.load(), after + 100) << "our own atomics stopped";
        uint64_t word;
        memcpy(&word, buf.at(0), 8);
        EXPECT_EQ(word, done.load());  // only our own atomics landed
        EXPECT_TRUE(has_pattern(canary.span(0, 4096), 3));
        for (size_t i = 8; i < 512; ++i) EXPECT_EQ(buf.bytes[i], 0) << "byte " << i;
      },
      [](Channel &ch) {  // the hostile node
        auto t = ch.recv<Target>();
        attack(t.lid, t.qpn, t.addr, t.rkey);
        ch.signal();
      });
}

// The emulated fabric's posts land byte for byte whatever their offset and length: a record's
// body starts mid-word (after its seq), and the words after that are stored whole.
TEST(Hostile, PostsLandExactlyAtEveryOffsetAndLength) {
  const std::string name = "hostile_post_" + std::to_string(getpid());
  int err = 0;
  std::shared_ptr<eng::Node> node = eng::Node::acquire(name.c_str(), &err);
  ASSERT_TRUE(node) << "cannot join the fabric: " << strerror(err);
  fabric::Fabric &fab = node->fab();
  fabric::Peer *self = fab.peer(fab.lid());
  ASSERT_NE(self, nullptr);
  constexpr size_t kSpan = 512;
  const eng::Off off = node->alloc(kSpan);
  ASSERT_NE(off, 0u);
  auto *area = static_cast<uint8_t *>(node->ptr(off));
  uint8_t src[kSpan];
  for (size_t i = 0; i < kSpan; ++i) src[i] = static_cast<uint8_t>(i * 7 + 1);
  for (size_t start = 0; start < 16; ++start)
    for (size_t len : {0, 1, 2, 3, 4, 5, 7, 8, 9, 11, 12, 13, 15, 16, 17, 60, 64, 100, 300}) {
      const uint8_t *from = src + (start * 3) % 8;  // the source misaligned too
      memset(area, 0xee, kSpan);
      ASSERT_EQ(0, fab.post(*self, off + start, from, len));
      ASSERT_EQ(0, memcmp(area + start, from, len)) << "offset " << start << " length " << len;
      for (size_t k = 0; k < start; ++k) ASSERT_EQ(area[k], 0xee) << "before, length " << len;
      for (size_t k = start + len; k < kSpan; ++k) ASSERT_EQ(area[k], 0xee) << "after";
    }
  node->free(off);
}

}  // namespace
}  // namespace pcientb::test
