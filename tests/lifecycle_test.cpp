// Nothing left behind: fabrics whose nodes leave or are killed leave no table
// in /dev/shm, and a process that opened and closed devices has the
// descriptors and mappings it had before.
#include <dirent.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <set>
#include <string>

#include "verbs_helpers.hpp"

namespace pcientb::test {
namespace {

std::set<std::string> tables_named(const std::string &prefix) {
  std::set<std::string> names;
  const std::string full = "pcientb." + std::to_string(getuid()) + "." + prefix;
  if (DIR *d = opendir("/dev/shm")) {
    while (dirent *e = readdir(d))
      if (std::strncmp(e->d_name, full.c_str(), full.size()) == 0) names.insert(e->d_name);
    closedir(d);
  }
  return names;
}

// One node on `fabric` doing what the suite's tests do: a QP, a CQ and
// registered memory of its own.
void be_a_node(const std::string &fabric) {
  setenv("PCIENTB_FABRIC", fabric.c_str(), 1);
  Node node;
  RcQp qp(node);
  size_t len = 256 * 1024;
  void *mem = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) throw_errno("mmap", errno);
  std::memset(mem, 1, len);
  MrPtr mr = reg_mr(node.pd.get(), mem, len, kAllAccess);
  reg_mr(node.pd.get(), mem, len / 2, kAllAccess).reset();
  mr.reset();
  munmap(mem, len);
}

// A child that joins `fabric` and stays until it is told to leave (its
// device closed) or killed.
struct ChildNode {
  pid_t pid = -1;
  int go = -1;  // a byte written there tells the child to leave

  explicit ChildNode(const std::string &fabric) {
    int ready[2], leave[2];
    if (pipe(ready) || pipe(leave)) throw_errno("pipe", errno);
    pid = fork();
    if (pid < 0) throw_errno("fork", errno);
    if (pid == 0) {
      close(ready[0]);
      close(leave[1]);
      setenv("PCIENTB_FABRIC", fabric.c_str(), 1);
      {
        Node node;
        RcQp qp(node);
        Buffer buf(node.pd.get(), 64 * 1024);
        char c = 1;
        if (write(ready[1], &c, 1) != 1) _exit(2);
        if (read(leave[0], &c, 1) != 1) _exit(3);
      }  // the device closes: the node leaves
      _exit(0);
    }
    close(ready[1]);
    close(leave[0]);
    go = leave[1];
    char c = 0;
    bool up = read(ready[0], &c, 1) == 1;
    close(ready[0]);
    if (!up) throw SetupError("a node did not start");
  }
  void end(bool kill_it) {
    char c = 1;
    if (kill_it || write(go, &c, 1) != 1) kill(pid, SIGKILL);
    close(go);
    int status = 0;
    waitpid(pid, &status, 0);
  }
};

TEST(Lifecycle, FabricsLeaveNoTableAndAProcessNoDescriptorsOrMappings) {
  const std::string prefix = "lifecycle" + std::to_string(getpid()) + "_";
  be_a_node(prefix + "warmup");  // loads the provider, caches a thread stack
  const Footprint before = footprint();

  for (int i = 0; i < 12; ++i) {
    const std::string fabric = prefix + std::to_string(i);
    ChildNode leaves(fabric), killed(fabric);
    if (i % 3 == 0) be_a_node(fabric);  // this process joins and leaves too
    if (i % 2 == 0) {
      leaves.end(false);
      killed.end(true);  // the last node of the fabric is killed
    } else {
      killed.end(true);
      leaves.end(false);  // the last node leaves after a killed one
    }
  }
  // The next join on any fabric of this user removes the deserted tables.
  be_a_node(prefix + "last");

  EXPECT_EQ(tables_named(prefix), std::set<std::string>{}) << "tables left in /dev/shm";
  const Footprint after = footprint();
  EXPECT_EQ(after.fds, before.fds) << "descriptors left open";
  if (!kSanitizerOwnsMemory) EXPECT_EQ(after.maps, before.maps) << "mappings left";
}

}  // namespace
}  // namespace pcientb::test
