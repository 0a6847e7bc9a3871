// Checks of the two-process harness itself: a failure on either side must
// fail the test and never hang it. Most of these tests are meant to FAIL; CTest
// registers them with WILL_FAIL (see CMakeLists.txt), one process each.
#include <signal.h>
#include <unistd.h>

#include <array>
#include <string>
#include <thread>

#include "verbs_helpers.hpp"

namespace pcientb::test {
namespace {

TEST(HarnessMustFail, ChildAssertion) {
  two_process([](Channel &ch) { ch.wait(); },
              [](Channel &) { ASSERT_TRUE(false) << "on purpose"; });
}

TEST(HarnessMustFail, ChildExpectationThenNormalEnd) {
  two_process([](Channel &ch) { ch.wait(); },
              [](Channel &ch) {
                EXPECT_EQ(1, 2) << "on purpose";
                ch.signal();
              });
}

TEST(HarnessMustFail, ChildCrash) {
  two_process([](Channel &ch) { ch.wait(); }, [](Channel &) { raise(SIGSEGV); });
}

TEST(HarnessMustFail, ChildExceptionFromAHelper) {
  two_process([](Channel &ch) { ch.wait(); },
              [](Channel &) { throw SetupError("ibv_something: on purpose"); });
}

TEST(HarnessMustFail, ChildHangsWhileTheParentWaits) {
  two_process([](Channel &ch) { ch.wait(1000ms); }, [](Channel &) { pause(); });
}

TEST(HarnessMustFail, ChildHangsAfterTheParentIsDone) {
  two_process([](Channel &) {}, [](Channel &) { pause(); }, {.child_grace = 1000ms});
}

TEST(HarnessMustFail, ParentHangsInABlockingCall) {
  two_process([](Channel &) { pause(); }, [](Channel &ch) { ch.wait(); }, {.deadline = 2s});
}

TEST(HarnessMustFail, ParentAssertionWhileTheChildWaits) {
  two_process([](Channel &) { FAIL() << "on purpose"; }, [](Channel &ch) { ch.wait(); });
}

// These must pass.

TEST(Harness, ExchangeAndBarrier) {
  two_process(
      [](Channel &ch) {
        EXPECT_EQ(ch.exchange(1), 2);
        ch.barrier();
      },
      [](Channel &ch) {
        EXPECT_EQ(ch.exchange(2), 1);
        ch.barrier();
      });
}

TEST(Harness, ChildKilledByTheTestIsNotAFailure) {
  two_process(
      [](Channel &ch) {
        ch.wait();
        ch.kill_peer();
      },
      [](Channel &ch) {
        ch.signal();
        pause();
      });
}

TEST(Harness, BothSidesSeeTheSameFabric) {
  two_process(
      [](Channel &ch) {
        std::string mine = getenv("PCIENTB_FABRIC");
        auto theirs = ch.recv<std::array<char, 64>>();
        EXPECT_EQ(mine, theirs.data());
      },
      [](Channel &ch) {
        std::array<char, 64> name{};
        std::string env = getenv("PCIENTB_FABRIC");
        env.copy(name.data(), name.size() - 1);
        ch.send(name);
      });
}

}  // namespace
}  // namespace pcientb::test
