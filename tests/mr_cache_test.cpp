// Registration as UCX and MPI use it: the same memory registered again and
// again (the provider's registration cache), memory unmapped and mapped anew
// at a registered address; and the traffic counters that show which device
// carried a program's bytes. (ibv_fork_init: process_wide_test.cpp.)
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>

#include <pcientb/pcientb.h>

#include "own_memfds.hpp"
#include "verbs_helpers.hpp"

namespace pcientb::test {
namespace {

constexpr size_t kLen = size_t{1} << 20;

// Anonymous memory of its own (not the heap), so a test can unmap it and map
// new memory at the same address.
uint8_t *map_anon(size_t len, void *at = nullptr) {
  int flags = MAP_PRIVATE | MAP_ANONYMOUS | (at ? MAP_FIXED : 0);
  void *p = mmap(at, len, PROT_READ | PROT_WRITE, flags, -1, 0);
  if (p == MAP_FAILED) throw_errno("mmap", errno);
  return static_cast<uint8_t *>(p);
}

// The initiator's side of the tests below: reads the target's advertised
// range and expects `value` everywhere, then writes pattern 7 over it.
void read_then_write(Channel &ch, uint8_t value) {
  RcOptions o;
  o.buffer_size = kLen;
  RcEnd a(o);
  a.connect(ch);
  auto target = ch.recv<Endpoint>();
  ASSERT_EQ(0, SendWr(IBV_WR_RDMA_READ, 1)
                   .sge(a.sge(0, kLen))
                   .remote(target.addr, target.rkey)
                   .post(a.qp()));
  ASSERT_EQ(a.wait_wc().status, IBV_WC_SUCCESS);
  EXPECT_TRUE(all_bytes_are(a.buf.span(0, kLen), value)) << "the read did not reach the memory";
  fill_pattern(a.buf.span(0, kLen), 7);
  ASSERT_EQ(0, SendWr(IBV_WR_RDMA_WRITE, 2)
                   .sge(a.sge(0, kLen))
                   .remote(target.addr, target.rkey)
                   .post(a.qp()));
  ASSERT_EQ(a.wait_wc().status, IBV_WC_SUCCESS);
  ch.barrier();
}

// The target's side: advertises [mem, mem + kLen) under mr and expects the
// initiator's pattern there afterwards.
void expose_and_check(Channel &ch, RcEnd &b, uint8_t *mem, ibv_mr *mr) {
  Endpoint e = b.local();
  e.addr = reinterpret_cast<uintptr_t>(mem);
  e.rkey = mr->rkey;
  ch.send(e);
  ch.barrier();
  EXPECT_TRUE(has_pattern({mem, kLen}, 7)) << "the write did not reach the memory";
}

TEST(MrCache, MemoryRegisteredAgainIsReachedWithItsCurrentContents) {
  two_process([](Channel &ch) { read_then_write(ch, 0x33); },
              [](Channel &ch) {
                RcEnd b;
                b.connect(ch);
                uint8_t *mem = map_anon(kLen);
                std::memset(mem, 0x11, kLen);
                for (int i = 0; i < 3; ++i) reg_mr(b.node.pd.get(), mem, kLen, kAllAccess).reset();
                std::memset(mem, 0x33, kLen);
                MrPtr mr = reg_mr(b.node.pd.get(), mem, kLen, kAllAccess);
                expose_and_check(ch, b, mem, mr.get());
                mr.reset();
                munmap(mem, kLen);
              });
}

// Memory registered, its registration released (cached), the memory unmapped and new memory
// mapped at the same address (`flags`: private or shared anonymous), filled with `value` and
// registered: the peer must reach the new memory.
void registered_again_after_remap(int flags, uint8_t value) {
  two_process([value](Channel &ch) { read_then_write(ch, value); },
              [flags, value](Channel &ch) {
                RcEnd b;
                b.connect(ch);
                uint8_t *mem = map_anon(kLen);
                std::memset(mem, 0x11, kLen);
                reg_mr(b.node.pd.get(), mem, kLen, kAllAccess).reset();
                ASSERT_EQ(0, munmap(mem, kLen));
                void *p = mmap(mem, kLen, PROT_READ | PROT_WRITE, flags | MAP_ANONYMOUS | MAP_FIXED,
                               -1, 0);
                ASSERT_EQ(p, static_cast<void *>(mem));
                std::memset(mem, value, kLen);
                MrPtr mr = reg_mr(b.node.pd.get(), mem, kLen, kAllAccess);
                expose_and_check(ch, b, mem, mr.get());
                mr.reset();
                munmap(mem, kLen);
              });
}

// free() and malloc() of large buffers do this: the old pages go, new ones
// come at the same address. A registration must reach the new pages.
TEST(MrCache, MemoryMappedAnewWhereAnMrWasIsReachedNotTheOldPages) {
  registered_again_after_remap(MAP_PRIVATE, 0x22);
}

// Shared memory mapped there instead: its pages are present and shared like the chunk's
// that the old registration moved there (pagemap cannot tell them apart), and a
// registration must still reach them.
TEST(MrCache, SharedMemoryMappedAnewWhereAnMrWasIsReachedNotTheOldPages) {
  registered_again_after_remap(MAP_SHARED, 0x55);
}

// An MR keeps the pages it was registered on (as an HCA keeps them pinned);
// a new registration of new memory at that address reaches the new memory.
TEST(MrCache, NewMemoryUnderALiveMrIsReachedByANewRegistration) {
  two_process([](Channel &ch) { read_then_write(ch, 0x44); },
              [](Channel &ch) {
                RcEnd b;
                b.connect(ch);
                uint8_t *mem = map_anon(kLen);
                std::memset(mem, 0x11, kLen);
                MrPtr old_mr = reg_mr(b.node.pd.get(), mem, kLen, kAllAccess);
                ASSERT_EQ(mem, map_anon(kLen, mem));  // replaces the registered pages
                std::memset(mem, 0x44, kLen);
                MrPtr mr = reg_mr(b.node.pd.get(), mem, kLen, kAllAccess);
                expose_and_check(ch, b, mem, mr.get());
                mr.reset();
                old_mr.reset();
                munmap(mem, kLen);
              });
}

// Memory mapped anew where an MR was, not touched since: its holes say nothing
// about whose pages they are, and a registration must reach the new memory.
TEST(MrCache, UntouchedMemoryMappedAnewWhereAnMrWasIsReachedNotTheOldPages) {
  two_process([](Channel &ch) { read_then_write(ch, 0); },
              [](Channel &ch) {
                RcEnd b;
                b.connect(ch);
                uint8_t *mem = map_anon(kLen);
                mem[0] = 0x11;
                reg_mr(b.node.pd.get(), mem, kLen, kAllAccess).reset();
                mem[kLen / 2] = 0x11;  // through the moved mapping, onto the old chunk
                ASSERT_EQ(0, munmap(mem, kLen));
                ASSERT_EQ(mem, map_anon(kLen, mem));
                MrPtr mr = reg_mr(b.node.pd.get(), mem, kLen, kAllAccess);
                expose_and_check(ch, b, mem, mr.get());
                mr.reset();
                munmap(mem, kLen);
              });
}

// ---- what registration costs in the emulated fabric ---------------------------------

// Registration moves the pages onto the fabric's shared memory: only those that
// hold data are copied (allocating shared pages); pages never touched stay
// holes, which read as zeros, until used. A connection's fresh 1 MiB ring cost
// ~4 ms to register when every page was copied.
TEST(MrCache, RegisteringUntouchedMemoryCopiesOnlyThePagesThatHoldData) {
  use_private_fabric();
  ContextPtr ctx = open_device();
  PdPtr pd = alloc_pd(ctx.get());
  constexpr size_t kBig = size_t{16} << 20;
  uint8_t *mem = map_anon(kBig);
  madvise(mem, kBig, MADV_NOHUGEPAGE);  // a touch would fill 2 MiB, all of it data then
  mem[0] = 0x5a;
  mem[kBig / 2 + 100] = 0xa5;
  MrPtr mr = reg_mr(pd.get(), mem, kBig, kAllAccess);
  const ino_t moved = mapped_inode(mem, kBig);
  const auto memfds = own_memfds();
  ASSERT_TRUE(memfds.count(moved)) << "not moved onto the fabric's memory";
  EXPECT_LE(memfds.at(moved).st_blocks * 512, 2 * 4096)
      << "bytes of shared memory allocated for 2 pages used";
  EXPECT_EQ(mem[0], 0x5a);
  EXPECT_EQ(mem[kBig / 2 + 100], 0xa5);
  size_t nonzero = 0;
  for (size_t i = 0; i < kBig; i += 4096 / 4) nonzero += mem[i] != 0;
  EXPECT_EQ(nonzero, 1u);  // mem[0]; the other byte is off the stride
  mr.reset();
  munmap(mem, kBig);
}

// Registering that memory again finds it still moved although most of its pages
// are holes (checked by its mapping, not by pages present), so nothing is moved
// again: the same memfd stays mapped there.
TEST(MrCache, MemoryWithHolesRegisteredAgainIsNotMovedAgain) {
  use_private_fabric();
  ContextPtr ctx = open_device();
  PdPtr pd = alloc_pd(ctx.get());
  uint8_t *mem = map_anon(kLen);
  mem[0] = 1;
  reg_mr(pd.get(), mem, kLen, kAllAccess).reset();
  const ino_t first = mapped_inode(mem, kLen);
  ASSERT_NE(first, 0u);
  MrPtr mr = reg_mr(pd.get(), mem, kLen, kAllAccess);
  EXPECT_EQ(mapped_inode(mem, kLen), first);
  EXPECT_EQ(mem[0], 1);
  mr.reset();
  munmap(mem, kLen);
}

// ---- traffic counters -----------------------------------------------------------

// key=value fields of the $PCIENTB_STATS line written by process `pid`.
std::map<std::string, uint64_t> stats_of(const std::string &path, pid_t pid) {
  std::ifstream in(path);
  std::string line;
  std::map<std::string, uint64_t> fields;
  while (std::getline(in, line)) {
    if (line.find("pcientb-stats pid=" + std::to_string(pid) + " ") != 0) continue;
    std::istringstream words(line);
    std::string w;
    while (words >> w)
      if (auto eq = w.find('='); eq != std::string::npos && w.compare(0, 6, "fabric"))
        fields[w.substr(0, eq)] = std::strtoull(w.c_str() + eq + 1, nullptr, 10);
  }
  return fields;
}

// Registration moves the pages under the buffer onto shared memory. Another
// thread storing into the same page meanwhile (heap data next to a small
// buffer) must not lose a store: each of its stores is checked afterwards.
TEST(MrCache, StoresByAnotherThreadIntoAPageBeingRegisteredAreKept) {
  use_private_fabric();
  ContextPtr ctx = open_device();
  PdPtr pd = alloc_pd(ctx.get());
  constexpr size_t kSlots = 4096 / sizeof(uint64_t) - 8;  // the buffer takes the last 64 B
  int lost_rounds = 0;
  for (int round = 0; round < 100; ++round) {
    uint8_t *page = map_anon(4096);
    auto *slots = reinterpret_cast<volatile uint64_t *>(page);
    std::atomic<bool> started{false};
    std::thread writer([&] {
      for (size_t i = 0; i < kSlots; ++i) {
        slots[i] = i + 1;
        if (i == 0) started.store(true, std::memory_order_release);
        // ~1 ms in all: longer than a registration, so stores fall in the move.
        for (int spin = 0; spin < 1000; ++spin) std::atomic_signal_fence(std::memory_order_seq_cst);
      }
    });
    while (!started.load(std::memory_order_acquire)) {
    }
    ibv_mr *mr = ibv_reg_mr(pd.get(), page + 4096 - 64, 64, IBV_ACCESS_LOCAL_WRITE);
    writer.join();
    ASSERT_NE(mr, nullptr) << std::strerror(errno);
    size_t lost = 0;
    for (size_t i = 0; i < kSlots; ++i) lost += slots[i] != i + 1;
    lost_rounds += lost != 0;
    ibv_dereg_mr(mr);
    munmap(page, 4096);
  }
  EXPECT_EQ(lost_rounds, 0) << "rounds of 100 in which a store was lost";
}

TEST(Counters, EachNodeReportsWhatItsWorkRequestsMovedWhenItLeaves) {
  char path[] = "/tmp/pcientb-stats-XXXXXX";
  int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  close(fd);
  setenv("PCIENTB_STATS", path, 1);
  pid_t initiator = getpid();
  pid_t target = 0;
  two_process(
      [&](Channel &ch) {
        RcEnd a;
        a.connect(ch);
        target = ch.peer_pid();
        ASSERT_EQ(0, a.post_write(1, 0, 3000, 0));
        ASSERT_EQ(0, a.post_write(2, 0, 3000, 4096, 0));  // unsignaled counts too
        ASSERT_EQ(0, a.post_read(3, 8192, 1000, 0));
        ASSERT_EQ(0, a.post_send(4, 0, 100));
        ASSERT_EQ(0, SendWr(IBV_WR_ATOMIC_FETCH_AND_ADD, 5)
                         .sge(a.sge(16384, 8))
                         .remote(a.raddr(0), a.rkey())
                         .compare_add(1)
                         .post(a.qp()));
        EXPECT_EQ(wait_wcs(a.cq(), 4).size(), 4u);
        // The same counters, asked in the process (pcientb_query_port_counters).
        pcientb_port_counters pc{};
        ASSERT_EQ(0, pcientb_query_port_counters(a.node.ctx.get(), 1, &pc));
        EXPECT_EQ(pc.port_xmit_packets, 5u);
        EXPECT_EQ(pc.port_xmit_data, 3000u + 3000u + 1000u + 100u + 8u);
        EXPECT_EQ(pc.port_rcv_packets, 0u);
        EXPECT_EQ(pc.errors, 0u);
        EXPECT_EQ(EINVAL, pcientb_query_port_counters(a.node.ctx.get(), 2, &pc));
        ch.barrier();
      },
      [](Channel &ch) {
        RcEnd b;
        ASSERT_EQ(0, b.post_recv(1, 0, 4096));
        b.connect(ch);
        EXPECT_EQ(b.wait_wc().status, IBV_WC_SUCCESS);
        pcientb_port_counters pc{};
        ASSERT_EQ(0, pcientb_query_port_counters(b.node.ctx.get(), 1, &pc));
        EXPECT_EQ(pc.port_rcv_packets, 1u);
        EXPECT_EQ(pc.port_rcv_data, 100u);
        EXPECT_EQ(pc.port_xmit_packets, 0u);
        ch.barrier();
      });
  unsetenv("PCIENTB_STATS");
  auto a = stats_of(path, initiator);
  auto b = stats_of(path, target);
  unlink(path);
  ASSERT_FALSE(a.empty()) << "no line from the initiator";
  ASSERT_FALSE(b.empty()) << "no line from the target";
  EXPECT_EQ(a["write_ops"], 2u);
  EXPECT_EQ(a["write_bytes"], 6000u);
  EXPECT_EQ(a["read_ops"], 1u);
  EXPECT_EQ(a["read_bytes"], 1000u);
  EXPECT_EQ(a["send_ops"], 1u);
  EXPECT_EQ(a["send_bytes"], 100u);
  EXPECT_EQ(a["atomic_ops"], 1u);
  EXPECT_EQ(a["errors"], 0u);
  EXPECT_EQ(b["recv_ops"], 1u);
  EXPECT_EQ(b["recv_bytes"], 100u);
  EXPECT_EQ(b["write_ops"] + b["read_ops"] + b["send_ops"], 0u);
}

}  // namespace
}  // namespace pcientb::test
