#include "rdma_pair.hpp"

#include <dlfcn.h>
#include <infiniband/verbs.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>

#include "references.hpp"

namespace pcientb::bench {

const char *op_name(Op op) {
  static const char *const names[] = {"WRITE", "READ", "SEND"};
  return names[static_cast<uint32_t>(op)];
}

void use_private_fabric(const char *prefix) {
  if (getenv("PCIENTB_FABRIC")) return;
  char name[96];
  snprintf(name, sizeof name, "%s-%d-%lx", prefix, static_cast<int>(getpid()),
           static_cast<unsigned long>(time(nullptr)));
  setenv("PCIENTB_FABRIC", name, 1);
}

namespace {

std::string format(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
std::string format(const char *fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return buf;
}

// What the two sides tell each other once, over the socketpair, to connect.
struct Hello {
  int32_t status;  // 0, or setup failed and msg says why
  uint16_t lid;
  uint8_t mtu;  // enum ibv_mtu
  uint8_t link_layer;
  uint32_t qpn;
  uint32_t psn;
  uint32_t rkey;
  uint32_t rd_atom;
  uint64_t addr;  // start of [receive region | send region]
  uint8_t gid[16];
  char msg[200];
};

// A request to the peer, and its answer(s).
enum Kind : uint32_t { kQuit, kSendBandwidth, kLatency, kChecksum, kFill };
struct Cmd {
  uint32_t kind;
  uint32_t op;
  uint64_t size;
  uint64_t count;
  uint64_t arg;
};
struct Reply {
  int32_t status;
  uint32_t reserved;
  uint64_t value;
  char msg[200];
};

bool write_all(int fd, const void *p, size_t n) {
  const auto *b = static_cast<const uint8_t *>(p);
  while (n) {
    const ssize_t r = send(fd, b, n, MSG_NOSIGNAL);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    b += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

// Waits until fd is readable; false after timeout_s.
bool readable(int fd, double timeout_s) {
  pollfd p{fd, POLLIN, 0};
  for (;;) {
    const int r = poll(&p, 1, static_cast<int>(timeout_s * 1000));
    if (r < 0 && errno == EINTR) continue;
    return r > 0;
  }
}

// Reads exactly n bytes. Gives up after timeout_s without data (timeout_s < 0: never). With
// spin, polls the socket without sleeping, for answers that end a timed section.
enum class ReadResult { ok, closed, timeout };
ReadResult read_all(int fd, void *p, size_t n, double timeout_s, bool spin) {
  auto *b = static_cast<uint8_t *>(p);
  double last = now_s();
  while (n) {
    if (!spin && timeout_s >= 0 && !readable(fd, timeout_s)) return ReadResult::timeout;
    const ssize_t r = recv(fd, b, n, spin ? MSG_DONTWAIT : 0);
    if (r > 0) {
      b += r;
      n -= static_cast<size_t>(r);
      last = now_s();
      continue;
    }
    if (r == 0) return ReadResult::closed;
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return ReadResult::closed;
    if (timeout_s >= 0 && now_s() - last > timeout_s) return ReadResult::timeout;
  }
  return ReadResult::ok;
}

void copy_msg(char (&dst)[200], const std::string &s) {
  snprintf(dst, sizeof dst, "%s", s.c_str());
}

uint8_t pattern_byte(size_t i, uint64_t seed) {
  return static_cast<uint8_t>(i * 131 + (i >> 9) + seed * 7);
}
void fill_pattern(uint8_t *p, size_t n, uint64_t seed) {
  for (size_t i = 0; i < n; i++) p[i] = pattern_byte(i, seed);
}
uint64_t checksum(const uint8_t *p, size_t n) {
  uint64_t h = 0xcbf29ce484222325;  // FNV-1a
  for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3;
  return h;
}

uint8_t load_acquire(uint8_t *p) {
  return std::atomic_ref<uint8_t>(*p).load(std::memory_order_acquire);
}
void store_release(uint8_t *p, uint8_t v) {
  std::atomic_ref<uint8_t>(*p).store(v, std::memory_order_release);
}

}  // namespace

// One side's verbs objects: device, PD, a send and a receive CQ, an RC QP and one MR over
// [receive region | send region]. RDMA WRITEs and SENDs land in the receive region, READs fetch
// from the send region.
struct RdmaPair::Endpoint {
  explicit Endpoint(const PairOptions &o) : opt(o) {}
  ~Endpoint();

  bool fail(const std::string &msg) {
    if (err.empty()) err = msg;
    return false;
  }
  uint8_t *recv_region() const { return buf->data(); }
  uint8_t *send_region() const { return buf->data() + opt.max_size; }

  bool open();
  Hello hello() const;
  bool connect(const Hello &peer);
  bool post_recv(uint32_t n);
  bool post(Op op, size_t size, bool signaled, bool inl, uint64_t wr_id, size_t dst_offset = 0);
  int poll(ibv_cq *cq, ibv_wc *wc, int n);
  bool wait_one(ibv_cq *cq, ibv_wc *wc, const char *what);
  bool stream(Op op, size_t size, uint64_t count);
  bool receive(size_t size, uint64_t count);
  bool wait_byte(uint8_t *p, uint8_t v, const char *what);

  PairOptions opt;
  ibv_context *ctx = nullptr;
  ibv_pd *pd = nullptr;
  ibv_cq *scq = nullptr;
  ibv_cq *rcq = nullptr;
  ibv_qp *qp = nullptr;
  ibv_mr *mr = nullptr;
  std::unique_ptr<Buffer> buf;
  ibv_port_attr port{};
  uint32_t max_inline = 0;
  uint32_t rd_atom = 1;
  uint32_t psn = 0;
  uint32_t remote_rkey = 0;
  uint64_t remote_addr = 0;
  std::string err;
};

RdmaPair::Endpoint::~Endpoint() {
  if (qp) ibv_destroy_qp(qp);
  if (mr) ibv_dereg_mr(mr);
  if (scq) ibv_destroy_cq(scq);
  if (rcq) ibv_destroy_cq(rcq);
  if (pd) ibv_dealloc_pd(pd);
  if (ctx) ibv_close_device(ctx);
}

bool RdmaPair::Endpoint::open() {
  int n = 0;
  ibv_device **list = ibv_get_device_list(&n);
  if (!list) return fail(format("ibv_get_device_list: %s", strerror(errno)));
  ibv_device *dev = nullptr;
  std::string seen;
  for (int i = 0; i < n; i++) {
    seen += std::string(seen.empty() ? "" : ", ") + ibv_get_device_name(list[i]);
    if (strcmp(ibv_get_device_name(list[i]), opt.device) == 0) dev = list[i];
  }
  if (dev) ctx = ibv_open_device(dev);
  const int open_errno = errno;
  ibv_free_device_list(list);
  if (!dev)
    return fail(format("no device %s in ibv_get_device_list() (has: %s)", opt.device,
                       seen.empty() ? "none" : seen.c_str()));
  if (!ctx) return fail(format("ibv_open_device(%s): %s", opt.device, strerror(open_errno)));

  ibv_device_attr dattr{};
  if (int rc = ibv_query_device(ctx, &dattr))
    return fail(format("ibv_query_device: %s", strerror(rc)));
  if (int rc = ibv_query_port(ctx, 1, &port))
    return fail(format("ibv_query_port(1): %s", strerror(rc)));
  if (port.state != IBV_PORT_ACTIVE)
    return fail(format("port 1 is %s, not ACTIVE", ibv_port_state_str(port.state)));
  if (dattr.max_qp_wr > 0) {
    opt.tx_depth = std::min<uint32_t>(opt.tx_depth, dattr.max_qp_wr);
    opt.rx_depth = std::min<uint32_t>(opt.rx_depth, dattr.max_qp_wr);
  }
  if (dattr.max_cqe > 0) {
    opt.tx_depth = std::min<uint32_t>(opt.tx_depth, dattr.max_cqe);
    opt.rx_depth = std::min<uint32_t>(opt.rx_depth, dattr.max_cqe);
  }
  opt.signal_every = std::clamp<uint32_t>(opt.signal_every, 1, opt.tx_depth);
  rd_atom = std::max(1, std::min({16, dattr.max_qp_rd_atom, dattr.max_qp_init_rd_atom}));

  if (!(pd = ibv_alloc_pd(ctx))) return fail(format("ibv_alloc_pd: %s", strerror(errno)));
  if (!(scq = ibv_create_cq(ctx, static_cast<int>(opt.tx_depth), nullptr, nullptr, 0)))
    return fail(format("ibv_create_cq(%u): %s", opt.tx_depth, strerror(errno)));
  if (!(rcq = ibv_create_cq(ctx, static_cast<int>(opt.rx_depth), nullptr, nullptr, 0)))
    return fail(format("ibv_create_cq(%u): %s", opt.rx_depth, strerror(errno)));
  buf = std::make_unique<Buffer>(2 * opt.max_size);
  if (!*buf) return fail(format("cannot map %zu bytes", 2 * opt.max_size));
  mr = ibv_reg_mr(pd, buf->data(), 2 * opt.max_size,
                  IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
  if (!mr) return fail(format("ibv_reg_mr(%zu B): %s", 2 * opt.max_size, strerror(errno)));

  // Small latency messages go inline where the device allows it, as in perftest's *_lat.
  ibv_qp_init_attr init{};
  init.send_cq = scq;
  init.recv_cq = rcq;
  init.qp_type = IBV_QPT_RC;
  init.cap.max_send_wr = opt.tx_depth;
  init.cap.max_recv_wr = opt.rx_depth;
  init.cap.max_send_sge = 1;
  init.cap.max_recv_sge = 1;
  init.cap.max_inline_data = 64;
  if (!(qp = ibv_create_qp(pd, &init))) {
    init.cap.max_inline_data = 0;
    if (!(qp = ibv_create_qp(pd, &init)))
      return fail(
          format("ibv_create_qp(RC, %u/%u WRs): %s", opt.tx_depth, opt.rx_depth, strerror(errno)));
  }
  max_inline = init.cap.max_inline_data;

  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = 0;
  a.port_num = 1;
  a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  if (int rc = ibv_modify_qp(qp, &a,
                             IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
    return fail(format("ibv_modify_qp(INIT): %s", strerror(rc)));
  srand48(getpid() ^ static_cast<long>(time(nullptr)));
  psn = static_cast<uint32_t>(lrand48()) & 0xffffff;
  return post_recv(opt.rx_depth);
}

Hello RdmaPair::Endpoint::hello() const {
  Hello h{};
  h.lid = port.lid;
  h.mtu = static_cast<uint8_t>(port.active_mtu);
  h.link_layer = port.link_layer;
  h.qpn = qp->qp_num;
  h.psn = psn;
  h.rkey = mr->rkey;
  h.rd_atom = rd_atom;
  h.addr = reinterpret_cast<uintptr_t>(buf->data());
  ibv_gid gid{};
  if (ibv_query_gid(ctx, 1, 0, &gid) == 0) memcpy(h.gid, gid.raw, sizeof h.gid);
  return h;
}

bool RdmaPair::Endpoint::connect(const Hello &peer) {
  remote_rkey = peer.rkey;
  remote_addr = peer.addr;
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = std::min(port.active_mtu, static_cast<ibv_mtu>(peer.mtu));
  a.dest_qp_num = peer.qpn;
  a.rq_psn = peer.psn;
  a.max_dest_rd_atomic = static_cast<uint8_t>(rd_atom);
  a.min_rnr_timer = 12;
  a.ah_attr.dlid = peer.lid;
  a.ah_attr.port_num = 1;
  if (port.link_layer == IBV_LINK_LAYER_ETHERNET || peer.lid == 0) {
    a.ah_attr.is_global = 1;
    memcpy(a.ah_attr.grh.dgid.raw, peer.gid, sizeof peer.gid);
    a.ah_attr.grh.hop_limit = 1;
  }
  if (int rc = ibv_modify_qp(qp, &a,
                             IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                 IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
    return fail(
        format("ibv_modify_qp(RTR, dlid %u, qpn %u): %s", peer.lid, peer.qpn, strerror(rc)));
  a = {};
  a.qp_state = IBV_QPS_RTS;
  a.timeout = 14;
  a.retry_cnt = 7;
  a.rnr_retry = 7;
  a.sq_psn = psn;
  a.max_rd_atomic = static_cast<uint8_t>(std::min(rd_atom, peer.rd_atom));
  if (int rc = ibv_modify_qp(qp, &a,
                             IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                                 IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
    return fail(format("ibv_modify_qp(RTS): %s", strerror(rc)));
  return true;
}

bool RdmaPair::Endpoint::post_recv(uint32_t n) {
  ibv_sge sge{reinterpret_cast<uintptr_t>(recv_region()), static_cast<uint32_t>(opt.max_size),
              mr->lkey};
  ibv_recv_wr wr{};
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr *bad = nullptr;
  for (uint32_t i = 0; i < n; i++)
    if (int rc = ibv_post_recv(qp, &wr, &bad))
      return fail(format("ibv_post_recv: %s", strerror(rc)));
  return true;
}

bool RdmaPair::Endpoint::post(Op op, size_t size, bool signaled, bool inl, uint64_t wr_id,
                              size_t dst_offset) {
  static const ibv_wr_opcode opcodes[] = {IBV_WR_RDMA_WRITE, IBV_WR_RDMA_READ, IBV_WR_SEND};
  // WRITE and SEND go from our send region to the peer's receive region; READ fetches the
  // peer's send region into our receive region.
  uint8_t *local = op == Op::read ? recv_region() + dst_offset : send_region();
  ibv_sge sge{reinterpret_cast<uintptr_t>(local), static_cast<uint32_t>(size), mr->lkey};
  ibv_send_wr wr{};
  wr.wr_id = wr_id;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = opcodes[static_cast<uint32_t>(op)];
  wr.send_flags = (signaled ? IBV_SEND_SIGNALED : 0) | (inl ? IBV_SEND_INLINE : 0);
  wr.wr.rdma.remote_addr = remote_addr + (op == Op::read ? opt.max_size : dst_offset);
  wr.wr.rdma.rkey = remote_rkey;
  ibv_send_wr *bad = nullptr;
  if (int rc = ibv_post_send(qp, &wr, &bad))
    return fail(format("ibv_post_send(%s, %zu B): %s", op_name(op), size, strerror(rc)));
  return true;
}

int RdmaPair::Endpoint::poll(ibv_cq *cq, ibv_wc *wc, int n) {
  const int got = ibv_poll_cq(cq, n, wc);
  if (got < 0) {
    fail(format("ibv_poll_cq returned %d", got));
    return -1;
  }
  for (int i = 0; i < got; i++)
    if (wc[i].status != IBV_WC_SUCCESS) {
      fail(format("%s completion with status %s (%d), opcode %d, vendor_err 0x%x",
                  cq == scq ? "send" : "receive", ibv_wc_status_str(wc[i].status), wc[i].status,
                  wc[i].opcode, wc[i].vendor_err));
      return -1;
    }
  return got;
}

bool RdmaPair::Endpoint::wait_one(ibv_cq *cq, ibv_wc *wc, const char *what) {
  SpinWait spin(opt.timeout_s);
  for (;;) {
    const int n = poll(cq, wc, 1);
    if (n < 0) return false;
    if (n == 1) return true;
    if (spin.expired()) return fail(format("no %s completion within %.0f s", what, opt.timeout_s));
  }
}

bool RdmaPair::Endpoint::wait_byte(uint8_t *p, uint8_t v, const char *what) {
  SpinWait spin(opt.timeout_s);
  while (load_acquire(p) != v)
    if (spin.expired())
      return fail(format("%s: last byte never became %u within %.0f s (is %u)", what, v,
                         opt.timeout_s, load_acquire(p)));
  return true;
}

bool RdmaPair::Endpoint::stream(Op op, size_t size, uint64_t count) {
  // Each signaled WR's wr_id is the number of WRs its completion retires.
  uint64_t posted = 0, done = 0, last_signaled = 0;
  ibv_wc wc[16];
  SpinWait spin(opt.timeout_s);
  while (done < count) {
    while (posted < count && posted - done < opt.tx_depth) {
      posted++;
      const bool signaled = posted % opt.signal_every == 0 || posted == count;
      if (!post(op, size, signaled, false, signaled ? posted - last_signaled : 0,
                op == Op::send ? 0 : opt.dst_offset))
        return false;
      if (signaled) last_signaled = posted;
    }
    const int n = poll(scq, wc, 16);
    if (n < 0) return false;
    for (int i = 0; i < n; i++) done += wc[i].wr_id;
    if (n)
      spin.progress();
    else if (spin.expired())
      return fail(format("%s %zu B: %lu of %lu WRs completed, then nothing for %.0f s", op_name(op),
                         size, static_cast<unsigned long>(done), static_cast<unsigned long>(count),
                         opt.timeout_s));
  }
  return true;
}

bool RdmaPair::Endpoint::receive(size_t size, uint64_t count) {
  ibv_wc wc[16];
  uint64_t got = 0;
  SpinWait spin(opt.timeout_s);
  while (got < count) {
    const int n = poll(rcq, wc, 16);
    if (n < 0) return false;
    for (int i = 0; i < n; i++)
      if (wc[i].opcode != IBV_WC_RECV || wc[i].byte_len != size)
        return fail(
            format("receive completion opcode %d, byte_len %u; expected IBV_WC_RECV (%d), %zu",
                   wc[i].opcode, wc[i].byte_len, IBV_WC_RECV, size));
    if (n) {
      got += static_cast<uint64_t>(n);
      spin.progress();
      if (!post_recv(static_cast<uint32_t>(n))) return false;
    } else if (spin.expired()) {
      return fail(format("SEND %zu B: received %lu of %lu, then nothing for %.0f s", size,
                         static_cast<unsigned long>(got), static_cast<unsigned long>(count),
                         opt.timeout_s));
    }
  }
  return true;
}

namespace {

// The peer: serves requests until told to quit or the parent goes away.
class Peer {
 public:
  Peer(int fd, const PairOptions &opt) : fd_(fd), ep_(opt) {}

  int run() {
    Hello mine{};
    if (!ep_.open()) {
      mine.status = -1;
      copy_msg(mine.msg, ep_.err);
    } else {
      mine = ep_.hello();
    }
    Hello theirs{};
    if (!write_all(fd_, &mine, sizeof mine) ||
        read_all(fd_, &theirs, sizeof theirs, -1, false) != ReadResult::ok || mine.status ||
        theirs.status)
      return 1;
    const bool ok = ep_.connect(theirs);
    answer(ok);
    if (!ok) return 1;
    for (;;) {
      Cmd c{};
      if (read_all(fd_, &c, sizeof c, -1, false) != ReadResult::ok || c.kind == kQuit) return 0;
      serve(c);
    }
  }

 private:
  bool answer(bool ok, uint64_t value = 0) {
    Reply r{};
    r.status = ok ? 0 : -1;
    r.value = value;
    if (!ok) copy_msg(r.msg, ep_.err);
    return write_all(fd_, &r, sizeof r);
  }

  void serve(const Cmd &c) {
    const auto op = static_cast<Op>(c.op);
    const size_t size = std::min<size_t>(c.size, ep_.opt.max_size);
    switch (c.kind) {
      case kSendBandwidth:
        answer(true);
        answer(ep_.receive(size, c.count));
        break;
      case kLatency:
        if (op == Op::write) store_release(ep_.recv_region() + size - 1, 0);
        answer(true);
        answer(op == Op::write ? write_echo(size, c.count) : send_echo(size, c.count));
        break;
      case kChecksum:  // where the last bandwidth() of `op` landed
        answer(true,
               checksum(ep_.recv_region() + (op == Op::write ? ep_.opt.dst_offset : 0), size));
        break;
      case kFill:
        fill_pattern(ep_.send_region(), size, c.arg);
        answer(true);
        break;
      default:
        answer(ep_.fail(format("unknown request %u", c.kind)));
    }
  }

  bool write_echo(size_t size, uint64_t rounds) {
    uint8_t *in = ep_.recv_region() + size - 1;
    uint8_t *out = ep_.send_region() + size - 1;
    const bool inl = size <= ep_.max_inline;
    ibv_wc wc;
    for (uint64_t r = 1; r <= rounds; r++) {
      const auto seq = static_cast<uint8_t>(r);
      if (!ep_.wait_byte(in, seq, "WRITE latency (peer)")) return false;
      *out = seq;
      if (!ep_.post(Op::write, size, true, inl, 1) || !ep_.wait_one(ep_.scq, &wc, "WRITE"))
        return false;
    }
    return true;
  }

  bool send_echo(size_t size, uint64_t rounds) {
    const bool inl = size <= ep_.max_inline;
    ibv_wc wc;
    for (uint64_t r = 0; r < rounds; r++) {
      if (!ep_.wait_one(ep_.rcq, &wc, "receive")) return false;
      if (wc.byte_len != size)
        return ep_.fail(format("SEND latency: received %u B, expected %zu", wc.byte_len, size));
      if (!ep_.post(Op::send, size, true, inl, 1) || !ep_.post_recv(1) ||
          !ep_.wait_one(ep_.scq, &wc, "SEND"))
        return false;
    }
    return true;
  }

  int fd_;
  RdmaPair::Endpoint ep_;
};

}  // namespace

RdmaPair::RdmaPair(int fd, pid_t pid, const PairOptions &opt)
    : fd_(fd), pid_(pid), opt_(opt), ep_(std::make_unique<Endpoint>(opt)) {}

std::unique_ptr<RdmaPair> RdmaPair::start(const PairOptions &opt, std::string *err) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv)) {
    *err = format("socketpair: %s", strerror(errno));
    return nullptr;
  }
  const pid_t parent = getpid();
  fflush(nullptr);
  const pid_t pid = fork();
  if (pid < 0) {
    *err = format("fork: %s", strerror(errno));
    close(sv[0]);
    close(sv[1]);
    return nullptr;
  }
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(1);
    close(sv[0]);
    int rc;
    {
      PairOptions peer_opt = opt;
      if (opt.peer_device) peer_opt.device = opt.peer_device;
      Peer peer(sv[1], peer_opt);
      rc = peer.run();
    }
    _exit(rc);
  }
  close(sv[1]);
  std::unique_ptr<RdmaPair> pair(new RdmaPair(sv[0], pid, opt));
  Endpoint &ep = *pair->ep_;

  Hello mine{};
  if (!ep.open()) {
    mine.status = -1;
    copy_msg(mine.msg, ep.err);
  } else {
    mine = ep.hello();
  }
  Hello theirs{};
  if (!write_all(pair->fd_, &mine, sizeof mine)) {
    *err = "peer exited during setup";
    return nullptr;
  }
  switch (read_all(pair->fd_, &theirs, sizeof theirs, opt.timeout_s, false)) {
    case ReadResult::ok:
      break;
    case ReadResult::closed:
      *err = "peer exited during setup";
      return nullptr;
    case ReadResult::timeout:
      *err = format("peer sent no connection details within %.0f s", opt.timeout_s);
      return nullptr;
  }
  if (mine.status) {
    *err = ep.err;
    return nullptr;
  }
  if (theirs.status) {
    *err = std::string("peer: ") + theirs.msg;
    return nullptr;
  }
  if (!ep.connect(theirs)) {
    *err = ep.err;
    return nullptr;
  }
  if (!pair->reply("connect", false, nullptr)) {
    *err = pair->err_;
    return nullptr;
  }
  return pair;
}

RdmaPair::~RdmaPair() {
  ep_.reset();
  Cmd quit{};
  quit.kind = kQuit;
  write_all(fd_, &quit, sizeof quit);
  close(fd_);
  reap_child(pid_, opt_.timeout_s);
}

bool RdmaPair::work(uint64_t out[8]) {
  // The provider is loaded by libibverbs, not linked: its own entry point, found as a user would.
  using Query = int (*)(ibv_context *, uint64_t *);
  static Query query = [] {
    void *lib = dlopen("libpcientb-rdmav34.so", RTLD_NOW | RTLD_NOLOAD);
    return lib ? reinterpret_cast<Query>(dlsym(lib, "pcientb_query_work")) : nullptr;
  }();
  return query && ep_ && query(ep_->ctx, out) == 0;  // struct pcientb_work: eight uint64_t
}

uint32_t RdmaPair::max_inline() const {
  return ep_->max_inline;
}

bool RdmaPair::fail(const std::string &msg) {
  if (err_.empty()) err_ = msg;
  return false;
}

bool RdmaPair::reply(const char *what, bool spin, uint64_t *value) {
  Reply r{};
  switch (read_all(fd_, &r, sizeof r, opt_.timeout_s, spin)) {
    case ReadResult::ok:
      break;
    case ReadResult::closed:
      return fail(format("peer exited (%s)", what));
    case ReadResult::timeout:
      return fail(format("peer did not answer (%s) within %.0f s", what, opt_.timeout_s));
  }
  if (r.status) return fail(format("peer (%s): %s", what, r.msg));
  if (value) *value = r.value;
  return true;
}

bool RdmaPair::request(uint32_t kind, Op op, size_t size, uint64_t count, uint64_t arg,
                       uint64_t *value) {
  Cmd c{kind, static_cast<uint32_t>(op), size, count, arg};
  if (!write_all(fd_, &c, sizeof c)) return fail("peer exited");
  return reply("request", false, value);
}

double RdmaPair::bandwidth(Op op, size_t size, uint64_t count) {
  if (!err_.empty()) return -1;
  size = std::min(size, opt_.max_size);
  if (op == Op::send && !request(kSendBandwidth, op, size, count, 0, nullptr)) return -1;
  const double t0 = now_s();
  if (!ep_->stream(op, size, count)) return fail(ep_->err), -1;
  if (op == Op::send && !reply("SEND bandwidth", true, nullptr)) return -1;
  return now_s() - t0;
}

bool RdmaPair::lat_begin(Op op, size_t size, uint64_t rounds) {
  if (!err_.empty()) return false;
  lat_op_ = op;
  lat_size_ = std::clamp<size_t>(size, 1, opt_.max_size);
  lat_seq_ = 0;
  if (op == Op::read) return true;
  if (op == Op::write) store_release(ep_->recv_region() + lat_size_ - 1, 0);
  return request(kLatency, op, lat_size_, rounds, 0, nullptr);
}

double RdmaPair::rounds(uint64_t n) {
  Endpoint &ep = *ep_;
  const size_t size = lat_size_;
  const bool inl = size <= ep.max_inline && lat_op_ != Op::read;
  uint8_t *out = ep.send_region() + size - 1, *in = ep.recv_region() + size - 1;
  ibv_wc wc;
  bool ok = true;
  const double t0 = now_s();
  for (uint64_t i = 0; ok && i < n; i++) {
    switch (lat_op_) {
      case Op::write:
        *out = ++lat_seq_;
        ok = ep.post(Op::write, size, true, inl, 1) && ep.wait_one(ep.scq, &wc, "WRITE") &&
             ep.wait_byte(in, lat_seq_, "WRITE latency");
        break;
      case Op::send:
        ok = ep.post(Op::send, size, true, inl, 1) && ep.wait_one(ep.rcq, &wc, "receive") &&
             ep.post_recv(1) && ep.wait_one(ep.scq, &wc, "SEND");
        break;
      case Op::read:
        ok = ep.post(Op::read, size, true, false, 1) && ep.wait_one(ep.scq, &wc, "READ");
        break;
    }
  }
  const double t = now_s() - t0;
  if (!ok) return fail(ep.err), -1;
  return t;
}

bool RdmaPair::lat_end() {
  if (!err_.empty()) return false;
  return lat_op_ == Op::read || reply("latency", false, nullptr);
}

bool RdmaPair::verify() {
  const size_t sizes[] = {5, 65539, opt_.max_size};
  uint64_t seed = 1;
  for (size_t size : sizes) {
    size = std::min(size, opt_.max_size);
    uint64_t sum = 0;
    fill_pattern(ep_->send_region(), size, ++seed);
    const uint64_t want_write = checksum(ep_->send_region(), size);
    if (bandwidth(Op::write, size, 1) < 0 || !request(kChecksum, Op::write, size, 0, 0, &sum))
      return false;
    if (sum != want_write)
      return fail(
          format("RDMA WRITE of %zu B completed but the peer's buffer holds other data", size));

    if (!request(kFill, Op::read, size, 0, ++seed, nullptr) || bandwidth(Op::read, size, 1) < 0)
      return false;
    const uint8_t *got = ep_->recv_region() + opt_.dst_offset;
    for (size_t i = 0; i < size; i++)
      if (got[i] != pattern_byte(i, seed))
        return fail(format("RDMA READ of %zu B completed but byte %zu is 0x%02x, expected 0x%02x",
                           size, i, got[i], pattern_byte(i, seed)));

    fill_pattern(ep_->send_region(), size, ++seed);
    const uint64_t want_send = checksum(ep_->send_region(), size);
    if (bandwidth(Op::send, size, 1) < 0 || !request(kChecksum, Op::send, size, 0, 0, &sum))
      return false;
    if (sum != want_send)
      return fail(
          format("SEND of %zu B completed but the peer's receive buffer holds other data", size));
  }
  return true;
}

}  // namespace pcientb::bench
