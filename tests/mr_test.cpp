// Protection domains and memory regions: registration, keys, re-registration.
#include "verbs_helpers.hpp"

#include <sys/wait.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <thread>

namespace pcientb::test {
namespace {

TEST(Pd, AllocAndDealloc) {
  Node node;
  ibv_pd *pd = ibv_alloc_pd(node.ctx.get());
  ASSERT_NE(pd, nullptr) << std::strerror(errno);
  EXPECT_EQ(pd->context, node.ctx.get());
  EXPECT_EQ(0, ibv_dealloc_pd(pd));
}

TEST(Pd, DeallocWhileAnMrUsesItIsEbusy) {
  Node node;
  ibv_pd *pd = ibv_alloc_pd(node.ctx.get());
  ASSERT_NE(pd, nullptr);
  std::vector<uint8_t> bytes(4096);
  ibv_mr *mr = ibv_reg_mr(pd, bytes.data(), bytes.size(), IBV_ACCESS_LOCAL_WRITE);
  ASSERT_NE(mr, nullptr) << std::strerror(errno);
  EXPECT_EQ(EBUSY, ibv_dealloc_pd(pd));
  EXPECT_EQ(0, ibv_dereg_mr(mr));
  EXPECT_EQ(0, ibv_dealloc_pd(pd));
}

TEST(Pd, DeallocWhileAQpUsesItIsEbusy) {
  Node node;
  ibv_pd *pd = ibv_alloc_pd(node.ctx.get());
  ASSERT_NE(pd, nullptr);
  auto cq = create_cq(node.ctx.get());
  ibv_qp_init_attr attr = rc_qp_attr(cq.get());
  ibv_qp *qp = ibv_create_qp(pd, &attr);
  ASSERT_NE(qp, nullptr) << std::strerror(errno);
  EXPECT_EQ(EBUSY, ibv_dealloc_pd(pd));
  EXPECT_EQ(0, ibv_destroy_qp(qp));
  EXPECT_EQ(0, ibv_dealloc_pd(pd));
}

TEST(Mr, RegisterReportsItsRangeAndDistinctKeys) {
  Node node;
  std::vector<uint8_t> bytes(8192);
  auto mr = reg_mr(node.pd.get(), bytes.data(), bytes.size(), kAllAccess);
  EXPECT_EQ(mr->addr, bytes.data());
  EXPECT_EQ(mr->length, bytes.size());
  EXPECT_EQ(mr->pd, node.pd.get());
  EXPECT_EQ(mr->context, node.ctx.get());
  EXPECT_NE(mr->lkey, mr->rkey);
}

TEST(Mr, TwoRegistrationsOfOneBufferGetDifferentKeys) {
  Node node;
  std::vector<uint8_t> bytes(4096);
  auto a = reg_mr(node.pd.get(), bytes.data(), bytes.size(), kAllAccess);
  auto b = reg_mr(node.pd.get(), bytes.data(), bytes.size(), kAllAccess);
  EXPECT_NE(a->lkey, b->lkey);
  EXPECT_NE(a->rkey, b->rkey);
}

TEST(Mr, KeysOfAFreedMrAreNotReusedByTheNextRegistration) {
  Node node;
  std::vector<uint8_t> bytes(4096);
  ibv_mr *first = ibv_reg_mr(node.pd.get(), bytes.data(), bytes.size(), kAllAccess);
  ASSERT_NE(first, nullptr);
  const uint32_t old_lkey = first->lkey, old_rkey = first->rkey;
  ASSERT_EQ(0, ibv_dereg_mr(first));
  auto next = reg_mr(node.pd.get(), bytes.data(), bytes.size(), kAllAccess);
  EXPECT_NE(next->lkey, old_lkey);
  EXPECT_NE(next->rkey, old_rkey);
}

TEST(Mr, RemoteWriteWithoutLocalWriteIsEinval) {
  Node node;
  std::vector<uint8_t> bytes(4096);
  errno = 0;
  ibv_mr *mr = ibv_reg_mr(node.pd.get(), bytes.data(), bytes.size(), IBV_ACCESS_REMOTE_WRITE);
  EXPECT_EQ(mr, nullptr);
  EXPECT_EQ(errno, EINVAL);
  if (mr) ibv_dereg_mr(mr);
}

TEST(Mr, RemoteAtomicWithoutLocalWriteIsEinval) {
  Node node;
  std::vector<uint8_t> bytes(4096);
  errno = 0;
  ibv_mr *mr = ibv_reg_mr(node.pd.get(), bytes.data(), bytes.size(),
                          IBV_ACCESS_REMOTE_ATOMIC | IBV_ACCESS_REMOTE_READ);
  EXPECT_EQ(mr, nullptr);
  EXPECT_EQ(errno, EINVAL);
  if (mr) ibv_dereg_mr(mr);
}

TEST(Mr, ReadOnlyRegistrationSucceeds) {
  Node node;
  std::vector<uint8_t> bytes(4096);
  auto mr = reg_mr(node.pd.get(), bytes.data(), bytes.size(), IBV_ACCESS_REMOTE_READ);
  EXPECT_NE(mr, nullptr);
}

TEST(Mr, RereqChangeAccessWithRemoteWriteButNoLocalWriteIsRejected) {
  Node node;
  std::vector<uint8_t> bytes(4096);
  auto mr = reg_mr(node.pd.get(), bytes.data(), bytes.size(), IBV_ACCESS_LOCAL_WRITE);
  EXPECT_NE(0, ibv_rereg_mr(mr.get(), IBV_REREG_MR_CHANGE_ACCESS, nullptr, nullptr, 0,
                            IBV_ACCESS_REMOTE_WRITE));
}

// The target takes REMOTE_WRITE away from a registered MR: RDMA READ still
// works, an RDMA WRITE now fails and leaves the memory alone.
TEST(Mr, RereqChangeAccessToReadOnlyMakesRemoteWritesFail) {
  two_process(
      [](Channel &ch) {
        RcEnd a;
        a.connect(ch);
        fill_pattern(a.buf.span(0, 256), 1);
        ASSERT_EQ(0, a.post_write(1, 0, 256, 0));
        EXPECT_EQ(a.wait_wc().status, IBV_WC_SUCCESS);
        ch.signal();  // the first write is in; re-register read-only
        auto rkey = ch.recv<uint32_t>();
        ASSERT_EQ(0, SendWr(IBV_WR_RDMA_READ, 2)
                         .sge(a.sge(4096, 256))
                         .remote(a.raddr(0), rkey)
                         .post(a.qp()));
        ibv_wc wc = a.wait_wc();
        EXPECT_EQ(wc.status, IBV_WC_SUCCESS);
        EXPECT_TRUE(has_pattern(a.buf.span(4096, 256), 1));
        fill_pattern(a.buf.span(0, 256), 2);
        ASSERT_EQ(
            0,
            SendWr(IBV_WR_RDMA_WRITE, 3).sge(a.sge(0, 256)).remote(a.raddr(0), rkey).post(a.qp()));
        wc = a.wait_wc();
        EXPECT_EQ(wc.wr_id, 3u);
        EXPECT_EQ(wc.status, IBV_WC_REM_ACCESS_ERR);
        ch.signal();
      },
      [](Channel &ch) {
        RcEnd b;
        b.connect(ch);
        ch.wait();
        ASSERT_EQ(0, ibv_rereg_mr(b.buf.mr.get(), IBV_REREG_MR_CHANGE_ACCESS, nullptr, nullptr, 0,
                                  IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ));
        ch.send(b.buf.mr->rkey);
        ch.wait();
        EXPECT_TRUE(has_pattern(b.buf.span(0, 256), 1)) << "the refused write changed memory";
      });
}

// The target moves its MR to another buffer: the peer's writes (with the MR's
// rkey after re-registration) land in the new buffer; the old range is no
// longer reachable.
TEST(Mr, RereqChangeTranslationMovesRemoteWritesToTheNewBuffer) {
  two_process(
      [](Channel &ch) {
        RcEnd a;
        a.connect(ch);
        auto moved = ch.recv<Endpoint>();
        fill_pattern(a.buf.span(0, 1024), 3);
        ASSERT_EQ(0, SendWr(IBV_WR_RDMA_WRITE, 1)
                         .sge(a.sge(0, 1024))
                         .remote(moved.addr + 100, moved.rkey)
                         .post(a.qp()));
        EXPECT_EQ(a.wait_wc().status, IBV_WC_SUCCESS);
        ch.barrier();  // the target checked the new buffer
        ASSERT_EQ(0, SendWr(IBV_WR_RDMA_WRITE, 2)
                         .sge(a.sge(0, 64))
                         .remote(a.raddr(0), moved.rkey)
                         .post(a.qp()));
        EXPECT_EQ(a.wait_wc().status, IBV_WC_REM_ACCESS_ERR) << "the old range is still reachable";
        ch.signal();
      },
      [](Channel &ch) {
        RcEnd b;
        b.connect(ch);
        std::vector<uint8_t> other(b.buf.bytes.size(), 0);
        ASSERT_EQ(0, ibv_rereg_mr(b.buf.mr.get(), IBV_REREG_MR_CHANGE_TRANSLATION, nullptr,
                                  other.data(), other.size(), 0));
        EXPECT_EQ(b.buf.mr->addr, other.data());
        EXPECT_EQ(b.buf.mr->length, other.size());
        Endpoint moved = b.local();
        moved.addr = reinterpret_cast<uintptr_t>(other.data());
        moved.rkey = b.buf.mr->rkey;
        ch.send(moved);
        ch.wait();
        EXPECT_TRUE(has_pattern({other.data() + 100, 1024}, 3));
        EXPECT_TRUE(all_bytes_are(b.buf.span(0, b.buf.bytes.size()), 0))
            << "the old buffer was written";
        ch.signal();
        ch.wait();
        EXPECT_TRUE(all_bytes_are(b.buf.span(0, b.buf.bytes.size()), 0))
            << "the old buffer was written";
        // `other` must outlive the MR that now covers it.
        b.buf.mr.reset();
      });
}

TEST(Mr, RemoteWriteToADeregisteredMrFailsWithRemAccessErr) {
  two_process(
      [](Channel &ch) {
        RcEnd a;
        a.connect(ch);
        ch.wait();  // the target deregistered its MR
        ASSERT_EQ(0, a.post_write(1, 0, 64, 0));
        EXPECT_EQ(a.wait_wc().status, IBV_WC_REM_ACCESS_ERR);
        ch.signal();
      },
      [](Channel &ch) {
        RcEnd b;
        b.connect(ch);
        b.buf.mr.reset();
        ch.signal();
        ch.wait();
        EXPECT_TRUE(all_bytes_are(b.buf.span(0, 64), 0));
      });
}

// Once ibv_dereg_mr returns, nothing moves to or from the memory any more, as
// with an HCA: an RDMA WRITE or READ that was under way when the target
// deregistered ends before the call returns. The initiator keeps one 16 MiB
// transfer after another going; the target deregisters in the middle of one.
// - WRITE: the sources alternate between two buffers whose last bytes differ
//   (a WRITE's last bytes land last); the target's last byte must not change
//   after dereg_mr returned.
// - READ: right after dereg_mr returns, the target marks a byte every 64 KiB;
//   no READ may complete with a mark (wherever the copy was, marks lay ahead).
void expect_nothing_moves_after_dereg(ibv_wr_opcode opcode) {
  constexpr size_t kSize = size_t{16} << 20;
  constexpr size_t kMarkEvery = size_t{64} << 10;
  constexpr uint8_t kAfterDereg = 0xee;
  RcOptions options;
  options.buffer_size = 2 * kSize;
  two_process(
      [&](Channel &ch) {
        RcEnd a(options);
        std::fill_n(a.buf.at(0), kSize, 0x11);
        std::fill_n(a.buf.at(kSize), kSize, 0x22);
        a.connect(ch);
        size_t moved = 0, after_dereg = 0;
        for (;; ++moved) {
          const size_t from = opcode == IBV_WR_RDMA_WRITE ? moved % 2 * kSize : 0;
          if (opcode == IBV_WR_RDMA_READ)
            for (size_t at = kMarkEvery; at < kSize; at += kMarkEvery) *a.buf.at(at) = 0;
          ASSERT_EQ(0, opcode == IBV_WR_RDMA_WRITE ? a.post_write(moved, from, kSize, 0)
                                                   : a.post_read(moved, 0, kSize, 0));
          const ibv_wc wc = a.wait_wc();
          if (wc.status != IBV_WC_SUCCESS) {
            EXPECT_EQ(IBV_WC_REM_ACCESS_ERR, wc.status);
            break;
          }
          if (opcode == IBV_WR_RDMA_READ)
            for (size_t at = kMarkEvery; at < kSize; at += kMarkEvery)
              after_dereg += *a.buf.at(at) == kAfterDereg;
          if (moved == 2) ch.signal();  // going (the first ones map and fault pages)
        }
        EXPECT_GT(moved, 2u) << "the target deregistered before the transfers were going";
        EXPECT_EQ(0u, after_dereg) << "bytes written after ibv_dereg_mr were READ";
        ch.signal();
      },
      [&](Channel &ch) {
        RcEnd b(options);
        b.connect(ch);
        ch.wait();
        std::this_thread::sleep_for(5ms);
        b.buf.mr.reset();
        volatile uint8_t *last = b.buf.at(kSize - 1);
        if (opcode == IBV_WR_RDMA_READ)
          for (size_t at = kMarkEvery; at < kSize; at += kMarkEvery) *b.buf.at(at) = kAfterDereg;
        const uint8_t at_dereg = *last;
        ch.wait();  // the initiator's next transfer failed
        std::this_thread::sleep_for(20ms);
        EXPECT_EQ(at_dereg, *last) << "a WRITE landed after ibv_dereg_mr returned";
      });
}

TEST(Mr, NoWriteLandsAfterDeregMrReturns) {
  expect_nothing_moves_after_dereg(IBV_WR_RDMA_WRITE);
}

TEST(Mr, NoReadSeesBytesWrittenAfterDeregMrReturns) {
  expect_nothing_moves_after_dereg(IBV_WR_RDMA_READ);
}

// ---- fork ---------------------------------------------------------------------

// A child forked after a registration gets a private copy of the memory, as
// with any HCA (without ibv_fork_init): what the child writes there, in the
// MR or next to it, never shows in the parent.
void expect_child_writes_stay_private(bool deregister_before_fork) {
  Node node;
  std::vector<uint8_t> bytes(64 * 1024 + 200, 0x11);
  MrPtr mr = reg_mr(node.pd.get(), bytes.data() + 100, 64 * 1024, kAllAccess);
  if (deregister_before_fork) mr.reset();
  two_process(
      [&](Channel &ch) {
        ch.wait();
        EXPECT_TRUE(all_bytes_are(bytes, 0x11)) << "the child's writes reached the parent";
      },
      [&](Channel &ch) {
        std::fill(bytes.begin(), bytes.end(), 0x22);
        ch.signal();
      });
}

TEST(MrFork, RegisteredMemoryIsNotSharedWithAForkedChild) {
  expect_child_writes_stay_private(false);
}

TEST(MrFork, MemoryOfADeregisteredMrIsNotSharedWithAForkedChild) {
  expect_child_writes_stay_private(true);
}

// A child that registers memory of its own (on a device it opened, after its parent had
// registered some) gives its own children private copies too: the memory it moved is
// told apart from its parent's by the child's own pid, not the one its parent knew.
TEST(MrFork, MemoryAChildRegisteredIsNotSharedWithItsOwnChild) {
  Node node;
  std::vector<uint8_t> parents(8192, 0x11);
  MrPtr parent_mr = reg_mr(node.pd.get(), parents.data(), parents.size(), kAllAccess);
  // Under valgrind the child's device, fork and exit take longer than a channel's 20 s: the
  // parent waits as long as the test's deadline lets it.
  two_process([](Channel &ch) { ch.wait(std::chrono::minutes(5)); },
              [](Channel &ch) {
                Node own;
                std::vector<uint8_t> bytes(64 * 1024, 0x11);
                MrPtr mr = reg_mr(own.pd.get(), bytes.data(), bytes.size(), kAllAccess);
                std::fflush(nullptr);
                const pid_t grandchild = fork();
                ASSERT_GE(grandchild, 0) << std::strerror(errno);
                if (grandchild == 0) {
                  std::fill(bytes.begin(), bytes.end(), 0x22);
                  _exit(0);
                }
                int status = 0;
                ASSERT_EQ(grandchild, waitpid(grandchild, &status, 0));
                EXPECT_TRUE(all_bytes_are(bytes, 0x11))
                    << "the grandchild's writes reached the child";
                ch.signal();
              });
}

// Registers and deregisters a few MRs on ordinary heap memory (with heap
// neighbours on the same pages), then churns the heap.
void register_heap_memory_and_churn() {
  Node node;
  std::vector<std::unique_ptr<std::vector<uint8_t>>> buffers;
  for (size_t size : {100, 5000, 70000, 333})
    buffers.push_back(std::make_unique<std::vector<uint8_t>>(size, 1));
  for (auto &b : buffers) reg_mr(node.pd.get(), b->data(), b->size(), kAllAccess).reset();
}

void churn_heap() {
  std::vector<std::unique_ptr<std::string>> junk;
  for (int i = 0; i < 2000; ++i) junk.push_back(std::make_unique<std::string>(i * 37 % 3000, 'x'));
  junk.clear();
}

TEST(MrHeap, HeapStaysConsistentAfterRegisteringHeapMemory) {
  register_heap_memory_and_churn();
  churn_heap();
  register_heap_memory_and_churn();
  churn_heap();
}

// A child forked after the parent registered heap memory can use its heap
// and open the device (as the next test in a gtest binary, or any program
// that forks workers).
TEST(MrFork, AChildCanUseTheHeapAfterTheParentRegisteredHeapMemory) {
  register_heap_memory_and_churn();
  two_process(
      [](Channel &ch) {
        ch.wait();
        churn_heap();
      },
      [](Channel &ch) {
        churn_heap();
        Node node;
        ch.signal();
      });
}

}  // namespace
}  // namespace pcientb::test
