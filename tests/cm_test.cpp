// rdma_cm on pcientb0 (librdmacm_glue), through unmodified librdmacm: the
// errors and events a program gets from the kernel's rdma_cm, across two
// processes where it matters.
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <pthread.h>
#include <rdma/rdma_cma.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "two_process.hpp"

namespace pcientb::test {
namespace {

sockaddr_in ipv4(const char *ip, uint16_t port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  inet_pton(AF_INET, ip, &a.sin_addr);
  return a;
}

sockaddr *sa(sockaddr_in &a) {
  return reinterpret_cast<sockaddr *>(&a);
}

uint16_t bound_port(rdma_cm_id *id) {
  return ntohs(reinterpret_cast<sockaddr_in *>(rdma_get_local_addr(id))->sin_port);
}

struct Cm {
  rdma_event_channel *ch = nullptr;
  rdma_cm_id *id = nullptr;
  explicit Cm(rdma_port_space ps = RDMA_PS_TCP) {
    use_private_fabric();
    ch = rdma_create_event_channel();
    if (ch == nullptr) throw_errno("rdma_create_event_channel", errno);
    if (rdma_create_id(ch, &id, nullptr, ps) != 0) throw_errno("rdma_create_id", errno);
  }
  ~Cm() {
    if (id != nullptr) rdma_destroy_id(id);
    rdma_destroy_event_channel(ch);
  }
  std::string last_private;  // of the last event expect() took
  Cm(const Cm &) = delete;
  Cm &operator=(const Cm &) = delete;

  // Resolves address and route to 127.0.0.1:port.
  void resolve(uint16_t port) {
    sockaddr_in dst = ipv4("127.0.0.1", port);
    ASSERT_EQ(rdma_resolve_addr(id, nullptr, sa(dst), 1000), 0);
    ASSERT_EQ(expect(RDMA_CM_EVENT_ADDR_RESOLVED), 0);
    ASSERT_EQ(rdma_resolve_route(id, 1000), 0);
    ASSERT_EQ(expect(RDMA_CM_EVENT_ROUTE_RESOLVED), 0);
  }

  // Listens on 127.0.0.1 and an ephemeral port, which it returns.
  uint16_t listen() {
    sockaddr_in addr = ipv4("127.0.0.1", 0);
    if (rdma_bind_addr(id, sa(addr)) != 0) throw_errno("rdma_bind_addr", errno);
    if (rdma_listen(id, 4) != 0) throw_errno("rdma_listen", errno);
    return bound_port(id);
  }

  // The next event, which must be `want`; its status is returned. Waits in
  // poll() on the channel's descriptor, as event loops do.
  int expect(rdma_cm_event_type want,
             std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
    pollfd p{ch->fd, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(timeout.count())) != 1) throw SetupError("no CM event");
    rdma_cm_event *e = nullptr;
    if (rdma_get_cm_event(ch, &e) != 0) throw_errno("rdma_get_cm_event", errno);
    EXPECT_EQ(e->event, want) << rdma_event_str(e->event) << " instead of " << rdma_event_str(want);
    const int status = e->status;
    // The event's private data goes with the ack: keep a copy.
    const void *pd = e->param.conn.private_data;
    last_private.assign(pd != nullptr ? static_cast<const char *>(pd) : "",
                        pd != nullptr ? e->param.conn.private_data_len : 0);
    rdma_ack_cm_event(e);
    return status;
  }
};

TEST(Cm, DeviceNodeIsACharacterDevice) {
  Cm cm;
  struct stat st {};
  ASSERT_EQ(fstat(cm.ch->fd, &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode));
}

TEST(Cm, BindingAPortTwiceIsAddressInUse) {
  Cm a, b;
  sockaddr_in addr = ipv4("127.0.0.1", 0);
  ASSERT_EQ(rdma_bind_addr(a.id, sa(addr)), 0);
  const uint16_t port = bound_port(a.id);
  EXPECT_GE(port, 32768);
  sockaddr_in same = ipv4("127.0.0.1", port);
  EXPECT_EQ(rdma_bind_addr(b.id, sa(same)), -1);
  EXPECT_EQ(errno, EADDRINUSE);
  // The id that failed is still usable.
  sockaddr_in other = ipv4("127.0.0.1", 0);
  EXPECT_EQ(rdma_bind_addr(b.id, sa(other)), 0);
  EXPECT_NE(bound_port(b.id), port);
}

TEST(Cm, APortIsTakenFabricWide) {
  two_process(
      [](Channel &ch) {
        const auto port = ch.recv<uint16_t>();
        Cm cm;
        sockaddr_in addr = ipv4("127.0.0.1", port);
        EXPECT_EQ(rdma_bind_addr(cm.id, sa(addr)), -1);
        EXPECT_EQ(errno, EADDRINUSE);
        ch.signal();
      },
      [](Channel &ch) {
        Cm cm;
        ch.send(cm.listen());
        ch.wait();
      });
}

TEST(Cm, AnAddressOfAnotherHostCannotBeBound) {
  Cm cm;
  sockaddr_in addr = ipv4("198.51.100.7", 0);  // TEST-NET-2: never this host's
  EXPECT_EQ(rdma_bind_addr(cm.id, sa(addr)), -1);
  EXPECT_EQ(errno, EADDRNOTAVAIL);
}

TEST(Cm, AnUnreachableDestinationIsAnAddressError) {
  Cm cm;
  sockaddr_in dst = ipv4("198.51.100.7", 7471);
  ASSERT_EQ(rdma_resolve_addr(cm.id, nullptr, sa(dst), 1000), 0);
  EXPECT_EQ(cm.expect(RDMA_CM_EVENT_ADDR_ERROR), -EHOSTUNREACH);
}

TEST(Cm, ANonBlockingChannelSaysEagainAndPollsReady) {
  Cm cm;
  ASSERT_EQ(fcntl(cm.ch->fd, F_SETFL, fcntl(cm.ch->fd, F_GETFL) | O_NONBLOCK), 0);
  rdma_cm_event *e = nullptr;
  EXPECT_EQ(rdma_get_cm_event(cm.ch, &e), -1);
  EXPECT_EQ(errno, EAGAIN);
  pollfd p{cm.ch->fd, POLLIN, 0};
  EXPECT_EQ(poll(&p, 1, 0), 0);
  sockaddr_in dst = ipv4("127.0.0.1", 7471);
  ASSERT_EQ(rdma_resolve_addr(cm.id, nullptr, sa(dst), 1000), 0);
  EXPECT_EQ(poll(&p, 1, 1000), 1);
  ASSERT_EQ(rdma_get_cm_event(cm.ch, &e), 0);
  EXPECT_EQ(e->event, RDMA_CM_EVENT_ADDR_RESOLVED);
  ASSERT_NE(cm.id->verbs, nullptr);
  EXPECT_STREQ(ibv_get_device_name(cm.id->verbs->device), "pcientb0");
  rdma_ack_cm_event(e);
  EXPECT_EQ(poll(&p, 1, 0), 0);  // nothing left
}

// The descriptor behaves as the kernel's for an event loop (libfabric, UCX):
// epoll reports it readable while events wait, and a dup of it is the same
// channel (commands and events through either).
TEST(Cm, EpollSeesEventsAndADupIsTheSameChannel) {
  Cm cm;
  const int ep = epoll_create1(EPOLL_CLOEXEC);
  ASSERT_GE(ep, 0);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ASSERT_EQ(epoll_ctl(ep, EPOLL_CTL_ADD, cm.ch->fd, &ev), 0);
  epoll_event out{};
  EXPECT_EQ(epoll_wait(ep, &out, 1, 0), 0);
  const int original = cm.ch->fd;
  const int copy = dup(original);
  ASSERT_GE(copy, 0);
  cm.ch->fd = copy;  // librdmacm now writes its commands to the dup
  sockaddr_in dst = ipv4("127.0.0.1", 7471);
  ASSERT_EQ(rdma_resolve_addr(cm.id, nullptr, sa(dst), 1000), 0);
  EXPECT_EQ(epoll_wait(ep, &out, 1, 2000), 1);  // registered with the original
  EXPECT_EQ(cm.expect(RDMA_CM_EVENT_ADDR_RESOLVED), 0);
  EXPECT_EQ(epoll_wait(ep, &out, 1, 0), 0);
  struct stat st {};
  ASSERT_EQ(fstat(copy, &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode));
  close(original);
  ASSERT_EQ(rdma_resolve_route(cm.id, 1000), 0);  // the channel lives on in the dup
  EXPECT_EQ(cm.expect(RDMA_CM_EVENT_ROUTE_RESOLVED), 0);
  close(ep);
}

// A request waits a second for a listener (perftest -R listens and connects at
// once after an out-of-band sync), then is rejected as by a CM with no such service.
TEST(Cm, ConnectingToNobodyIsRejectedAfterAGrace) {
  Cm cm;
  ASSERT_NO_FATAL_FAILURE(cm.resolve(9));  // nobody listens on the fabric's port 9
  rdma_conn_param p{};
  const auto start = std::chrono::steady_clock::now();
  ASSERT_EQ(rdma_connect(cm.id, &p), 0);
  EXPECT_EQ(cm.expect(RDMA_CM_EVENT_REJECTED), 8);  // IB_CM_REJ_INVALID_SERVICE_ID
  const auto waited = std::chrono::steady_clock::now() - start;
  EXPECT_GE(waited, std::chrono::milliseconds(900));
  EXPECT_LT(waited, std::chrono::seconds(5));
}

TEST(Cm, AListenerThatComesWithinTheGraceGetsTheRequest) {
  Cm server, client;
  sockaddr_in addr = ipv4("127.0.0.1", 0);
  ASSERT_EQ(rdma_bind_addr(server.id, sa(addr)), 0);
  ASSERT_NO_FATAL_FAILURE(client.resolve(bound_port(server.id)));
  rdma_conn_param p{};
  ASSERT_EQ(rdma_connect(client.id, &p), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  ASSERT_EQ(rdma_listen(server.id, 4), 0);
  rdma_cm_event *ev = nullptr;
  pollfd pf{server.ch->fd, POLLIN, 0};
  ASSERT_EQ(poll(&pf, 1, 5000), 1);
  ASSERT_EQ(rdma_get_cm_event(server.ch, &ev), 0);
  ASSERT_EQ(ev->event, RDMA_CM_EVENT_CONNECT_REQUEST);
  rdma_cm_id *child = ev->id;
  rdma_ack_cm_event(ev);
  ASSERT_EQ(rdma_reject(child, nullptr, 0), 0);
  EXPECT_EQ(client.expect(RDMA_CM_EVENT_REJECTED), 28);  // IB_CM_REJ_CONSUMER_DEFINED
  rdma_destroy_id(child);
}

TEST(Cm, PrivateDataBeyondTheRequestsRoomIsInvalid) {
  Cm cm;
  ASSERT_NO_FATAL_FAILURE(cm.resolve(9));  // nobody listens on the fabric's port 9
  char data[57] = {};
  rdma_conn_param p{};
  p.private_data = data;
  p.private_data_len = sizeof data;  // a REQ carries 56 after rdma_cm's header
  EXPECT_EQ(rdma_connect(cm.id, &p), -1);
  EXPECT_EQ(errno, EINVAL);
}

// Request, reply, ready-to-use with private data both ways; then disconnect:
// both sides see DISCONNECTED once.
TEST(Cm, ConnectAcceptAndDisconnectCarryPrivateData) {
  two_process(
      [](Channel &ch) {
        const auto port = ch.recv<uint16_t>();
        Cm cm;
        cm.resolve(port);
        if (::testing::Test::HasFatalFailure()) return;
        ibv_qp_init_attr qa{};
        qa.qp_type = IBV_QPT_RC;
        qa.cap = {4, 4, 1, 1, 0};
        ASSERT_EQ(rdma_create_qp(cm.id, nullptr, &qa), 0);
        char req[56];
        std::memset(req, 'q', sizeof req);
        rdma_conn_param p{};
        p.private_data = req;
        p.private_data_len = sizeof req;
        p.retry_count = 7;
        p.rnr_retry_count = 7;
        ASSERT_EQ(rdma_connect(cm.id, &p), 0);
        ASSERT_EQ(cm.expect(RDMA_CM_EVENT_ESTABLISHED), 0);
        ASSERT_GE(cm.last_private.size(), 100u);
        EXPECT_EQ(cm.last_private.substr(0, 100), std::string(100, 'r'));
        ibv_qp_attr a{};
        ibv_qp_init_attr ia{};
        ASSERT_EQ(ibv_query_qp(cm.id->qp, &a, IBV_QP_STATE, &ia), 0);
        EXPECT_EQ(a.qp_state, IBV_QPS_RTS);
        ch.wait();  // the server disconnects
        EXPECT_EQ(cm.expect(RDMA_CM_EVENT_DISCONNECTED), 0);
        EXPECT_EQ(rdma_disconnect(cm.id), 0);  // after the peer's: still fine
        rdma_destroy_qp(cm.id);
      },
      [](Channel &ch) {
        Cm listener;
        ch.send(listener.listen());
        rdma_cm_event *ev = nullptr;
        pollfd pf{listener.ch->fd, POLLIN, 0};
        ASSERT_EQ(poll(&pf, 1, 10000), 1);
        ASSERT_EQ(rdma_get_cm_event(listener.ch, &ev), 0);
        ASSERT_EQ(ev->event, RDMA_CM_EVENT_CONNECT_REQUEST);
        rdma_cm_id *child = ev->id;
        EXPECT_EQ(ev->listen_id, listener.id);
        ASSERT_GE(ev->param.conn.private_data_len, 56);
        EXPECT_EQ(std::string(static_cast<const char *>(ev->param.conn.private_data), 56),
                  std::string(56, 'q'));
        rdma_ack_cm_event(ev);
        ibv_qp_init_attr qa{};
        qa.qp_type = IBV_QPT_RC;
        qa.cap = {4, 4, 1, 1, 0};
        ASSERT_EQ(rdma_create_qp(child, nullptr, &qa), 0);
        char rep[100];
        std::memset(rep, 'r', sizeof rep);
        rdma_conn_param p{};
        p.private_data = rep;
        p.private_data_len = sizeof rep;
        ASSERT_EQ(rdma_accept(child, &p), 0);
        ASSERT_EQ(poll(&pf, 1, 10000), 1);
        ASSERT_EQ(rdma_get_cm_event(listener.ch, &ev), 0);
        EXPECT_EQ(ev->event, RDMA_CM_EVENT_ESTABLISHED);
        rdma_ack_cm_event(ev);
        ASSERT_EQ(rdma_disconnect(child), 0);
        ch.signal();
        ASSERT_EQ(poll(&pf, 1, 10000), 1);
        ASSERT_EQ(rdma_get_cm_event(listener.ch, &ev), 0);
        EXPECT_EQ(ev->event, RDMA_CM_EVENT_DISCONNECTED);
        rdma_ack_cm_event(ev);
        rdma_destroy_qp(child);
        rdma_destroy_id(child);
      });
}

// A server that dies with the request unanswered: the client hears of it
// within a second, not after the CM's retries.
TEST(Cm, APeerThatDiesMidHandshakeMakesTheConnectionUnreachable) {
  two_process(
      [](Channel &ch) {
        const auto port = ch.recv<uint16_t>();
        Cm cm;
        cm.resolve(port);
        if (::testing::Test::HasFatalFailure()) return;
        rdma_conn_param p{};
        ASSERT_EQ(rdma_connect(cm.id, &p), 0);
        ch.wait();  // the server has the request
        ch.kill_peer();
        const auto start = std::chrono::steady_clock::now();
        EXPECT_EQ(cm.expect(RDMA_CM_EVENT_UNREACHABLE), -ETIMEDOUT);
        EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(1));
      },
      [](Channel &ch) {
        Cm listener;
        ch.send(listener.listen());
        listener.expect(RDMA_CM_EVENT_CONNECT_REQUEST);
        ch.signal();
        pause();
      });
}

// As with the kernel's rdma_cm: a forked child cannot use its parent's ids,
// and can make its own.
TEST(Cm, AForkedChildUsesIdsOfItsOwnOnly) {
  Cm cm;
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    sockaddr_in addr = ipv4("127.0.0.1", 0);
    const bool inherited_refused = rdma_bind_addr(cm.id, sa(addr)) == -1 && errno == EINVAL;
    rdma_event_channel *ch = rdma_create_event_channel();
    rdma_cm_id *id = nullptr;
    const bool own_works = ch != nullptr && rdma_create_id(ch, &id, nullptr, RDMA_PS_TCP) == 0 &&
                           rdma_bind_addr(id, sa(addr)) == 0;
    _exit(inherited_refused && own_works ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  sockaddr_in addr = ipv4("127.0.0.1", 0);
  EXPECT_EQ(rdma_bind_addr(cm.id, sa(addr)), 0);  // the parent's still works
}

// A write() that has begun holds its file, as in the kernel: a thread closing
// the channel's descriptor while another asks for an event (rping's main and
// event threads at exit) makes that command neither fail nor end. It fails
// only as a write to a closed descriptor (EBADF), or when a signal ends the
// wait (EINTR); never with EINVAL.
TEST(Cm, ClosingTheChannelUnderAWaitingGetEventLeavesItWaiting) {
  use_private_fabric();
  struct sigaction sa_usr1 {};
  sa_usr1.sa_handler = [](int) {};  // no SA_RESTART: the wait returns EINTR
  struct sigaction old {};
  ASSERT_EQ(sigaction(SIGUSR1, &sa_usr1, &old), 0);
  int still_waiting = 0;
  for (int round = 0; round < 100; ++round) {
    rdma_event_channel *ch = rdma_create_event_channel();
    ASSERT_NE(ch, nullptr);
    const int fd = ch->fd;
    std::atomic<int> result{0};  // 0: the command runs; else its errno
    std::atomic<bool> started{false};
    std::thread waiter([&] {
      // GET_EVENT as librdmacm writes it (rdma_user_cm.h, which cannot be
      // included with rdma_cma.h).
      struct {
        uint32_t cmd = 12;  // RDMA_USER_CM_CMD_GET_EVENT
        uint16_t in = sizeof(uint64_t);
        uint16_t out = 512;
        uint64_t response = 0;
      } c;
      alignas(8) char resp[512];
      c.response = reinterpret_cast<uintptr_t>(resp);
      started.store(true);
      const ssize_t n = write(fd, &c, sizeof c);
      result.store(n < 0 ? errno : -1);
    });
    while (!started.load()) {
    }
    // Close from just before the write begins to well after it waits.
    const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(round * 300);
    while (std::chrono::steady_clock::now() < until) {
    }
    close(fd);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (result.load() == 0) ++still_waiting;
    while (result.load() == 0) {
      pthread_kill(waiter.native_handle(), SIGUSR1);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    waiter.join();
    free(ch);  // its descriptor is closed already
    const int err = result.load();
    ASSERT_TRUE(err == EBADF || err == EINTR) << "round " << round << ": " << std::strerror(err);
  }
  EXPECT_GT(still_waiting, 0);  // some rounds closed under a waiting command
  sigaction(SIGUSR1, &old, nullptr);
}

TEST(Cm, MulticastIsNotSupported) {
  Cm cm(RDMA_PS_UDP);
  sockaddr_in group = ipv4("224.0.0.1", 0);
  ASSERT_EQ(rdma_resolve_addr(cm.id, nullptr, sa(group), 1000), 0);
  ASSERT_EQ(cm.expect(RDMA_CM_EVENT_ADDR_RESOLVED), 0);
  EXPECT_EQ(rdma_join_multicast(cm.id, sa(group), nullptr), -1);
  EXPECT_EQ(errno, EOPNOTSUPP);
}

}  // namespace
}  // namespace pcientb::test
