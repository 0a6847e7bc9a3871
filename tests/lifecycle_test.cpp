// Nothing left behind: fabrics whose nodes leave or are killed leave no table
// in /dev/shm, and a process that opened and closed devices has the
// descriptors and mappings it had before.
#include <dirent.h>
#include <fcntl.h>
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

// Whether a child process can open pcientb0 on `fabric`: 0 if it can, else the errno of the
// failed ibv_open_device.
int child_open_errno(const std::string &fabric) {
  pid_t pid = fork();
  if (pid < 0) throw_errno("fork", errno);
  if (pid == 0) {
    setenv("PCIENTB_FABRIC", fabric.c_str(), 1);
    int n = 0;
    ibv_device **list = ibv_get_device_list(&n);
    ibv_device *dev = nullptr;
    for (int i = 0; i < n && !dev; ++i)  // the first: the emulated one
      if (!strcmp(ibv_get_device_name(list[i]), "pcientb0")) dev = list[i];
    if (!dev) _exit(100);
    ibv_context *ctx = ibv_open_device(dev);
    const int e = ctx ? 0 : errno;
    if (ctx) ibv_close_device(ctx);
    ibv_free_device_list(list);
    _exit(e > 0 && e < 100 ? e : (ctx ? 0 : 101));
  }
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 102;
}

// Processes of two builds whose area layouts differ would misread each other's memory: a
// join while nodes of another build live is refused (EPROTO); a table such nodes left when
// killed is taken over.
TEST(Lifecycle, AFabricWhoseNodesAreOfAnotherBuildIsRefusedWhileTheyLive) {
  use_private_fabric();  // now, so that the children keep the fabric named here
  const std::string fabric = "lifecycle_build" + std::to_string(getpid());
  const std::string table = "/dev/shm/pcientb." + std::to_string(getuid()) + "." + fabric;
  ChildNode other(fabric);
  int fd = open(table.c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0) << table << ": " << strerror(errno);
  constexpr off_t kLayoutAt = 12;  // TableFile: magic, max_nodes, layout
  uint32_t layout = 0;
  ASSERT_EQ(pread(fd, &layout, sizeof layout, kLayoutAt), ssize_t(sizeof layout));
  ASSERT_NE(layout, 0u);
  const uint32_t foreign = layout ^ 0x5a5a5a5au;  // as if `other` were of another build
  ASSERT_EQ(pwrite(fd, &foreign, sizeof foreign, kLayoutAt), ssize_t(sizeof foreign));
  EXPECT_EQ(child_open_errno(fabric), EPROTO);
  ASSERT_EQ(pwrite(fd, &layout, sizeof layout, kLayoutAt), ssize_t(sizeof layout));
  EXPECT_EQ(child_open_errno(fabric), 0) << "the same build joins";
  ASSERT_EQ(pwrite(fd, &foreign, sizeof foreign, kLayoutAt), ssize_t(sizeof foreign));
  close(fd);
  other.end(true);  // killed: its table stays, with no live node
  EXPECT_EQ(child_open_errno(fabric), 0) << "a deserted table of another build is taken over";
}

}  // namespace
}  // namespace pcientb::test
