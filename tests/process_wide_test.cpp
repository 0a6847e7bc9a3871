// What a program may do to the whole process, as UCX does: call
// ibv_fork_init(), and hook libc's mremap(). Its own executable, since both
// last for the process; ibv_fork_init() must come before any registration, so
// its test comes first (CTest runs each test in a process of its own anyway).
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdarg>
#include <cstring>

#include "verbs_helpers.hpp"

namespace {
std::atomic<int> hook_calls{0};
void *decoy = nullptr;  // where a move through the hook ends up
}  // namespace

extern "C" void *mremap(void *old_address, size_t old_size, size_t new_size, int flags, ...) {
  hook_calls++;
  long r = syscall(SYS_mremap, old_address, old_size, new_size, flags, decoy);
  return r == -1 ? MAP_FAILED : reinterpret_cast<void *>(r);
}

namespace pcientb::test {
namespace {

constexpr size_t kLen = 256 * 1024;

uint8_t *map_anon(size_t len) {
  void *p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw_errno("mmap", errno);
  return static_cast<uint8_t *>(p);
}

// ---- ibv_fork_init ------------------------------------------------------------

// Whether [p, p + len) is mapped at all in this process.
bool mapped(const void *p, size_t len) {
  return msync(const_cast<void *>(p), len, MS_ASYNC) == 0;
}

// Forks; the child exits 0 when check() holds for it.
template <class Check>
::testing::AssertionResult holds_in_child(Check check) {
  pid_t pid = fork();
  if (pid == 0) _exit(check() ? 0 : 1);
  int status = 0;
  if (pid < 0 || waitpid(pid, &status, 0) != pid) return ::testing::AssertionFailure() << "fork";
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "child status " << status;
}

// With ibv_fork_init(), a child does not get registered memory at all (as
// with an HCA: libibverbs marks it MADV_DONTFORK); once deregistered, the
// child gets its own copy again.
TEST(MrForkInit, AChildGetsNoRegisteredMemoryAndAPrivateCopyOnceDeregistered) {
  ASSERT_EQ(0, ibv_fork_init());
  Node node;
  uint8_t *mem = map_anon(kLen);
  std::memset(mem, 0x11, kLen);
  MrPtr mr = reg_mr(node.pd.get(), mem, kLen, kAllAccess);
  EXPECT_TRUE(holds_in_child([&] { return !mapped(mem, kLen); }))
      << "the child got registered memory";
  mr.reset();
  EXPECT_TRUE(holds_in_child([&] {
    if (!mapped(mem, kLen) || mem[kLen - 1] != 0x11) return false;
    std::memset(mem, 0x22, kLen);
    return true;
  }));
  EXPECT_TRUE(all_bytes_are({mem, kLen}, 0x11)) << "the child's writes reached the parent";
  munmap(mem, kLen);
}

// ---- a UCX-style mremap hook -----------------------------------------------------

// The hook replaces libc's mremap for the whole process (above): with four
// arguments, MREMAP_FIXED's target is whatever a stale register holds.
// Registration must not go through it: the registered pages stay at the
// buffer's address, nothing else is replaced, and a peer's writes land there.

TEST(MremapHook, RegistrationDoesNotGoThroughAHookedMremap) {
  decoy = map_anon(kLen);
  std::memset(decoy, 0x5d, kLen);
  two_process(
      [](Channel &ch) {
        RcEnd a;
        a.connect(ch);
        auto target = ch.recv<Endpoint>();
        fill_pattern(a.buf.span(0, 4096), 9);
        for (size_t off = 0; off < kLen; off += 4096)
          ASSERT_EQ(0, SendWr(IBV_WR_RDMA_WRITE, off)
                           .sge(a.sge(0, 4096))
                           .remote(target.addr + off, target.rkey)
                           .post(a.qp()));
        for (size_t off = 0; off < kLen; off += 4096) ASSERT_EQ(a.wait_wc().status, IBV_WC_SUCCESS);
        ch.barrier();
      },
      [](Channel &ch) {
        RcEnd b;
        b.connect(ch);
        uint8_t *bytes = map_anon(kLen);
        void *mem = bytes;
        std::memset(bytes, 0x11, kLen);
        MrPtr mr = reg_mr(b.node.pd.get(), mem, kLen, kAllAccess);
        EXPECT_TRUE(all_bytes_are({bytes, kLen}, 0x11)) << "registration changed the buffer";
        Endpoint e = b.local();
        e.addr = reinterpret_cast<uintptr_t>(mem);
        e.rkey = mr->rkey;
        ch.send(e);
        ch.barrier();
        for (size_t off = 0; off < kLen; off += 4096)
          ASSERT_TRUE(has_pattern({bytes + off, 4096}, 9)) << "at offset " << off;
        EXPECT_TRUE(all_bytes_are({static_cast<uint8_t *>(decoy), kLen}, 0x5d))
            << "a mapping that is not the buffer was replaced";
        EXPECT_EQ(hook_calls.load(), 0) << "registration called libc's mremap";
      });
}

}  // namespace
}  // namespace pcientb::test
