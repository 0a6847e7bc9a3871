// The verbs glue: the only code that knows libibverbs' private provider ABI.
// It turns libibverbs' calls into engine calls and back, in the order of the
// ops table: device and context, queries, PD, MR, AH, CQ, SRQ, QP, then the
// data path, the ops table, the emulated device list and registration.
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <set>
#include <string>

#include "engine/engine.hpp"
#include "engine/inspect.hpp"
#include "fabric/kernel/uverbs.hpp"
#include "glue/glue.hpp"
#include "glue/verbs_abi.h"
#include "pcientb-abi.h"
#include "pcientb/pcientb.h"

#define PCIENTB_EXPORT extern "C" __attribute__((visibility("default")))

namespace pcientb::glue {
namespace {

using namespace pcientb::engine;

struct GlueContext {
  Context *eng;
  verbs_context vctx;  // ends with struct ibv_context: must come last
};

struct GlueMr {
  verbs_mr vmr;
  Mr *mr;
};

template <typename T, typename M>
T *container_of(M *p, M T::*member) {
  return reinterpret_cast<T *>(reinterpret_cast<char *>(p) -
                               reinterpret_cast<size_t>(&(static_cast<T *>(nullptr)->*member)));
}

Context *ctx_of(ibv_context *c) {
  return reinterpret_cast<GlueContext *>(reinterpret_cast<char *>(c) -
                                         offsetof(GlueContext, vctx.context))
      ->eng;
}

// Returns p, or NULL with errno set from err.
template <typename T>
T *or_errno(T *p, int err) {
  if (!p) errno = err ? err : ENOMEM;
  return p;
}

std::mutex channels_mu;
std::set<ibv_comp_channel *> channels;

// ---- queries ---------------------------------------------------------------

int query_device_ex(ibv_context *c, const ibv_query_device_ex_input *input,
                    ibv_device_attr_ex *attr, size_t attr_size) {
  if (input && input->comp_mask) return EINVAL;
  return ctx_of(c)->query_device(attr, attr_size);
}

int query_port(ibv_context *c, uint8_t port, ibv_port_attr *attr) {
  return ctx_of(c)->query_port(port, attr);
}

void async_event(ibv_context *, ibv_async_event *) {}

// ---- PD, MR, AH ---------------------------------------------------------------

ibv_pd *alloc_pd(ibv_context *c) {
  int err = 0;
  Pd *pd = engine::alloc_pd(ctx_of(c), &err);
  return or_errno(pd ? &pd->ibv : nullptr, err);
}

int dealloc_pd(ibv_pd *pd) {
  return engine::dealloc_pd(from_ibv<Pd>(pd));
}

void fill_mr(GlueMr *g) {
  ibv_mr &m = g->vmr.ibv_mr;
  Mr *mr = g->mr;
  m.context = mr->pd->ctx->ibv;
  m.pd = &mr->pd->ibv;
  m.addr = mr->addr;
  m.length = mr->length;
  m.handle = mr->idx;
  m.lkey = mr->lkey;
  m.rkey = mr->rkey;
  g->vmr.mr_type = IBV_MR_TYPE_MR;
  g->vmr.access = mr->access;
}

// With ibv_fork_init(), libibverbs marked the range MADV_DONTFORK before
// calling us, so that children do not get registered memory; registration
// may have moved the pages (fabric/emu), and a move does not keep that mark.
// libibverbs asks the kernel (a netlink socket) at each ibv_is_fork_initialized(), ~2 us here;
// the answer is fixed once any registration has passed ibv_dontfork_range (ibv_fork_init()
// after that fails), as every one that reaches us has. An atomic, not a guarded static: a
// fork() during another thread's first look would leave the child waiting on the guard.
bool fork_init_enabled() {
  static std::atomic<int> enabled{-1};
  int e = enabled.load(std::memory_order_relaxed);
  if (e < 0) enabled.store(e = ibv_is_fork_initialized() == IBV_FORK_ENABLED);
  return e != 0;
}

void keep_from_children(void *addr, size_t length) {
  if (length == 0 || !fork_init_enabled()) return;
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t a = reinterpret_cast<uintptr_t>(addr) & ~(page - 1);
  const uintptr_t b = (reinterpret_cast<uintptr_t>(addr) + length + page - 1) & ~(page - 1);
  madvise(reinterpret_cast<void *>(a), b - a, MADV_DONTFORK);
}

ibv_mr *reg_mr(ibv_pd *pd, void *addr, size_t length, uint64_t hca_va, int access) {
  auto *g = static_cast<GlueMr *>(calloc(1, sizeof(GlueMr)));
  if (!g) return or_errno<ibv_mr>(nullptr, ENOMEM);
  int err = 0;
  g->mr = engine::reg_mr(from_ibv<Pd>(pd), addr, length, hca_va, access, &err);
  if (!g->mr) {
    free(g);
    return or_errno<ibv_mr>(nullptr, err);
  }
  keep_from_children(addr, length);
  fill_mr(g);
  return &g->vmr.ibv_mr;
}

int rereg_mr(verbs_mr *vmr, int flags, ibv_pd *pd, void *addr, size_t length, int access) {
  auto *g = reinterpret_cast<GlueMr *>(vmr);
  int err = engine::rereg_mr(g->mr, flags, pd ? from_ibv<Pd>(pd) : nullptr, addr, length, access);
  if (err) {
    errno = err;
    return err == EINVAL || err == EOPNOTSUPP ? IBV_REREG_MR_ERR_INPUT : IBV_REREG_MR_ERR_CMD;
  }
  if (flags & IBV_REREG_MR_CHANGE_TRANSLATION) keep_from_children(addr, length);
  fill_mr(g);
  return 0;
}

int dereg_mr(verbs_mr *vmr) {
  auto *g = reinterpret_cast<GlueMr *>(vmr);
  if (int err = engine::dereg_mr(g->mr)) return err;
  free(g);
  return 0;
}

ibv_ah *create_ah(ibv_pd *pd, ibv_ah_attr *attr) {
  int err = 0;
  Ah *ah = engine::create_ah(from_ibv<Pd>(pd), attr, &err);
  return or_errno(ah ? &ah->ibv : nullptr, err);
}

int destroy_ah(ibv_ah *ah) {
  return engine::destroy_ah(from_ibv<Ah>(ah));
}

// ---- CQ -----------------------------------------------------------------------

Channel *channel_of(ibv_comp_channel *ch, int *err) {
  if (!ch) return nullptr;
  std::lock_guard<std::mutex> g(channels_mu);
  if (!channels.count(ch)) *err = EINVAL;
  return reinterpret_cast<Channel *>(ch);
}

ibv_cq_ex *create_cq_common(ibv_context *c, int cqe, ibv_comp_channel *ch, int vector,
                            const ibv_cq_init_attr_ex *ex) {
  int err = 0;
  Channel *channel = channel_of(ch, &err);
  if (vector < 0 || vector >= c->num_comp_vectors) err = EINVAL;
  if (err) return or_errno<ibv_cq_ex>(nullptr, err);
  Cq *cq = engine::create_cq(ctx_of(c), cqe, channel, ex, &err);
  return or_errno(cq ? &cq->ibv : nullptr, err);
}

ibv_cq *create_cq(ibv_context *c, int cqe, ibv_comp_channel *ch, int vector) {
  return ibv_cq_ex_to_cq(create_cq_common(c, cqe, ch, vector, nullptr));
}

ibv_cq_ex *create_cq_ex(ibv_context *c, ibv_cq_init_attr_ex *attr) {
  return create_cq_common(c, static_cast<int>(attr->cqe), attr->channel,
                          static_cast<int>(attr->comp_vector), attr);
}

int destroy_cq(ibv_cq *cq) {
  return engine::destroy_cq(from_ibv<Cq>(cq));
}
int resize_cq(ibv_cq *cq, int cqe) {
  return engine::resize_cq(from_ibv<Cq>(cq), cqe);
}
void cq_event(ibv_cq *) {}

// ---- SRQ ----------------------------------------------------------------------

ibv_srq *create_srq(ibv_pd *pd, ibv_srq_init_attr *attr) {
  int err = 0;
  Srq *srq = engine::create_srq(from_ibv<Pd>(pd), attr, &err);
  return or_errno(srq ? &srq->ibv : nullptr, err);
}

int modify_srq(ibv_srq *srq, ibv_srq_attr *attr, int mask) {
  return engine::modify_srq(from_ibv<Srq>(srq), attr, mask);
}
int query_srq(ibv_srq *srq, ibv_srq_attr *attr) {
  return engine::query_srq(from_ibv<Srq>(srq), attr);
}
int destroy_srq(ibv_srq *srq) {
  return engine::destroy_srq(from_ibv<Srq>(srq));
}

// ---- QP -------------------------------------------------------------------------

ibv_qp *create_qp_ex(ibv_context *c, ibv_qp_init_attr_ex *attr) {
  if (!(attr->comp_mask & IBV_QP_INIT_ATTR_PD) || !attr->pd)
    return or_errno<ibv_qp>(nullptr, EINVAL);
  if ((attr->comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS) &&
      (attr->send_ops_flags & ~kSupportedSendOps))
    return or_errno<ibv_qp>(nullptr, EOPNOTSUPP);
  auto *g = static_cast<GlueQp *>(calloc(1, sizeof(GlueQp)));
  if (!g) return or_errno<ibv_qp>(nullptr, ENOMEM);
  int err = 0;
  g->qp = engine::create_qp(ctx_of(c), attr, &err);
  if (!g->qp) {
    free(g);
    return or_errno<ibv_qp>(nullptr, err);
  }
  ibv_qp &q = g->vqp.qp;
  q.context = c;
  q.qp_context = attr->qp_context;
  q.pd = attr->pd;
  q.send_cq = attr->send_cq;
  q.recv_cq = attr->recv_cq;
  q.srq = attr->srq;
  q.qp_num = g->qp->sh->qpn.load();
  q.handle = g->qp->idx;
  q.qp_type = attr->qp_type;
  q.state = IBV_QPS_RESET;
  q.events_completed = 0;
  pthread_mutex_init(&q.mutex, nullptr);
  pthread_cond_init(&q.cond, nullptr);
  if (attr->comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS) {
    g->vqp.comp_mask |= VERBS_QP_EX;
    init_qp_ex(g, attr->send_ops_flags);
  }
  engine::set_qp_handle(g->qp, &q);
  return &q;
}

ibv_qp *create_qp(ibv_pd *pd, ibv_qp_init_attr *attr) {
  ibv_qp_init_attr_ex ex{};
  memcpy(&ex, attr, sizeof *attr);
  ex.comp_mask = IBV_QP_INIT_ATTR_PD;
  ex.pd = pd;
  ibv_qp *qp = create_qp_ex(pd->context, &ex);
  if (qp) attr->cap = ex.cap;
  return qp;
}

int modify_qp(ibv_qp *qp, ibv_qp_attr *attr, int mask) {
  return engine::modify_qp(glue_qp(qp)->qp, attr, mask);
}

int query_qp(ibv_qp *qp, ibv_qp_attr *attr, int mask, ibv_qp_init_attr *init) {
  return engine::query_qp(glue_qp(qp)->qp, attr, mask, init);
}

int destroy_qp(ibv_qp *qp) {
  GlueQp *g = glue_qp(qp);
  if (int err = engine::destroy_qp(g->qp)) return err;
  pthread_mutex_destroy(&qp->mutex);
  pthread_cond_destroy(&qp->cond);
  delete g->batch;
  free(g);
  return 0;
}

// ---- data path ---------------------------------------------------------------

int post_send(ibv_qp *qp, ibv_send_wr *wr, ibv_send_wr **bad) {
  return engine::post_send(glue_qp(qp)->qp, wr, bad);
}
int post_recv(ibv_qp *qp, ibv_recv_wr *wr, ibv_recv_wr **bad) {
  return engine::post_recv(glue_qp(qp)->qp, wr, bad);
}
int post_srq_recv(ibv_srq *srq, ibv_recv_wr *wr, ibv_recv_wr **bad) {
  return engine::post_srq_recv(from_ibv<Srq>(srq), wr, bad);
}
int poll_cq(ibv_cq *cq, int n, ibv_wc *wc) {
  return engine::poll_cq(from_ibv<Cq>(cq), n, wc);
}
int req_notify_cq(ibv_cq *cq, int solicited_only) {
  return engine::req_notify_cq(from_ibv<Cq>(cq), solicited_only != 0);
}

// ---- context -----------------------------------------------------------------

void free_context(ibv_context *c) {
  auto *g = reinterpret_cast<GlueContext *>(reinterpret_cast<char *>(c) -
                                            offsetof(GlueContext, vctx.context));
  delete g->eng;
  verbs_uninit_context(&g->vctx);
  free(g);
}

const verbs_context_ops kOps = [] {
  verbs_context_ops o{};
  o.alloc_pd = alloc_pd;
  o.async_event = async_event;
  o.cq_event = cq_event;
  o.create_ah = create_ah;
  o.create_cq = create_cq;
  o.create_cq_ex = create_cq_ex;
  o.create_qp = create_qp;
  o.create_qp_ex = create_qp_ex;
  o.create_srq = create_srq;
  o.dealloc_pd = dealloc_pd;
  o.dereg_mr = dereg_mr;
  o.destroy_ah = destroy_ah;
  o.destroy_cq = destroy_cq;
  o.destroy_qp = destroy_qp;
  o.destroy_srq = destroy_srq;
  o.free_context = free_context;
  o.modify_qp = modify_qp;
  o.modify_srq = modify_srq;
  o.poll_cq = poll_cq;
  o.post_recv = post_recv;
  o.post_send = post_send;
  o.post_srq_recv = post_srq_recv;
  o.query_device_ex = query_device_ex;
  o.query_port = query_port;
  o.query_qp = query_qp;
  o.query_srq = query_srq;
  o.reg_mr = reg_mr;
  o.req_notify_cq = req_notify_cq;
  o.rereg_mr = rereg_mr;
  o.resize_cq = resize_cq;
  return o;
}();

verbs_device *as_verbs(ibv_device *d) {
  return reinterpret_cast<verbs_device *>(d);
}

// Devices from sysfs are pcientb.ko's; the emulated one has none.
bool is_kernel_device(ibv_device *d) {
  return as_verbs(d)->sysfs != nullptr;
}

// The engine on the emulated fabric, or for a device of pcientb.ko on the
// kernel fabric "kernel:<device>" (the nodes of this host, through the module).
verbs_context *alloc_context(ibv_device *dev, int cmd_fd, void *) {
  const bool kernel = is_kernel_device(dev);
  auto *g = static_cast<GlueContext *>(
      _verbs_init_and_alloc_context(dev, cmd_fd, sizeof(GlueContext),
                                    reinterpret_cast<verbs_context *>(offsetof(GlueContext, vctx)),
                                    kernel ? PCIENTB_DRIVER_ID : 0));
  if (!g) return nullptr;
  // libibverbs' own commands on a kernel device's fd (its GID queries) need a
  // context there; the node is the engine's (the kernel fabric opens its own,
  // whose contexts raise the events).
  int err = kernel ? fabric::kernel::get_context_without_node(cmd_fd) : 0;
  const std::string fabric = std::string("kernel:") + dev->name;
  if (!err) g->eng = Context::open(&err, kernel ? fabric.c_str() : nullptr);
  if (!g->eng) {
    fprintf(stderr, "pcientb: %s: cannot join the %s fabric: %s\n", dev->name,
            kernel ? "kernel" : "emulated", strerror(err));
    verbs_uninit_context(&g->vctx);
    free(g);
    errno = err;
    return nullptr;
  }
  ibv_context &c = g->vctx.context;
  g->eng->ibv = &c;
  c.async_fd = g->eng->async_rfd;
  c.num_comp_vectors = 1;
  verbs_set_ops(&g->vctx, &kOps);
  return &g->vctx;
}

// ---- devices and registration ---------------------------------------------------

void uninit_device(verbs_device *dev) {
  free(dev);
}

// A device of pcientb.ko (the emulated one comes from pcientb_emu_device_list()).
verbs_device *alloc_device(verbs_sysfs_dev *) {
  return static_cast<verbs_device *>(calloc(1, sizeof(verbs_device)));
}

// pcientb.ko's devices: by driver id (netlink discovery), by name where only
// sysfs is read (it carries no driver id).
const verbs_match_ent kMatchTable[] = {{.driver_data = nullptr,
                                        .u = {.driver_id = PCIENTB_DRIVER_ID},
                                        .vendor = 0,
                                        .device = 0,
                                        .kind = VERBS_MATCH_DRIVER_ID},
                                       {.driver_data = nullptr,
                                        .u = {.modalias = "rdma_device:*Npcientb*"},
                                        .vendor = 0,
                                        .device = 0,
                                        .kind = VERBS_MATCH_MODALIAS},
                                       {}};

const verbs_device_ops kDeviceOps = {
    .name = "pcientb",
    .match_min_abi_version = PCIENTB_UVERBS_ABI_VERSION,
    .match_max_abi_version = PCIENTB_UVERBS_ABI_VERSION,
    .match_table = kMatchTable,
    .static_providers = nullptr,
    .match_device = nullptr,
    .alloc_context = alloc_context,
    .import_context = nullptr,
    .alloc_device = alloc_device,
    .uninit_device = uninit_device,
};

__attribute__((constructor)) void register_driver() {
  verbs_register_driver_34(&kDeviceOps);
}

}  // namespace
}  // namespace pcientb::glue

using namespace pcientb::glue;
using namespace pcientb::engine;

// The device node of the one emulated device (dev_path; UCX looks for it).
constexpr const char kEmuDevicePath[] = "/dev/infiniband/uverbs-pcientb0";

// The emulated device: the same object in every list of a process (as
// libibverbs keeps a device while it exists), since librdmacm tells devices
// apart by pointer and a new one per list would make it reopen the device
// under programs that hold its contexts (libfabric). A forked child is a node
// of its own, with another GUID: it gets a new object, which librdmacm then
// takes for a new device. Devices are never freed (contexts may hold them).
verbs_device *emu_device() {
  static std::mutex mu;
  static verbs_device *dev = nullptr;
  static pid_t owner = 0;
  const std::lock_guard<std::mutex> g(mu);
  if (dev && owner == getpid()) return dev;
  auto *v = static_cast<verbs_device *>(calloc(1, sizeof(verbs_device)));
  if (!v) return nullptr;
  ibv_device &d = v->device;
  d.node_type = IBV_NODE_CA;
  d.transport_type = IBV_TRANSPORT_IB;
  snprintf(d.name, sizeof d.name, "pcientb0");
  snprintf(d.dev_name, sizeof d.dev_name, "uverbs-pcientb0");
  snprintf(d.dev_path, sizeof d.dev_path, "%s", kEmuDevicePath);
  snprintf(d.ibdev_path, sizeof d.ibdev_path, "/sys/class/infiniband/pcientb0");
  v->ops = &kDeviceOps;
  v->refcount.store(1);  // the provider's, never dropped
  v->entry.next = v->entry.prev = &v->entry;
  dev = v;
  owner = getpid();
  return dev;
}

PCIENTB_EXPORT ibv_device **pcientb_emu_device_list(int *num) {
  auto **list = static_cast<ibv_device **>(calloc(2, sizeof(ibv_device *)));
  verbs_device *dev = emu_device();
  if (!list || !dev) {
    free(list);
    errno = ENOMEM;
    return nullptr;
  }
  dev->refcount.fetch_add(1);
  list[0] = &dev->device;
  if (num) *num = 1;
  return list;
}

PCIENTB_EXPORT void pcientb_put_device(ibv_device *d) {
  verbs_device *dev = as_verbs(d);
  if (dev->refcount.fetch_sub(1) == 1) uninit_device(dev);
}

// The emulated device only: the preload serves its calls (a kernel device's
// go to the kernel, as any HCA's).
PCIENTB_EXPORT int pcientb_owns_device(ibv_device *d) {
  return d && as_verbs(d)->ops == &kDeviceOps && !is_kernel_device(d);
}

PCIENTB_EXPORT int pcientb_owns_context(ibv_context *c) {
  return c && pcientb_owns_device(c->device);
}

namespace {
// A context of the engine: of the emulated device or of one of pcientb.ko's (which the
// preload does not route, so pcientb_owns_device leaves them out).
bool engine_context(ibv_context *c) {
  return c && as_verbs(c->device)->ops == &kDeviceOps;
}
}  // namespace

PCIENTB_EXPORT int pcientb_owns_comp_channel(ibv_comp_channel *ch) {
  std::lock_guard<std::mutex> g(channels_mu);
  return channels.count(ch) ? 1 : 0;
}

PCIENTB_EXPORT ibv_comp_channel *pcientb_create_comp_channel(ibv_context *c) {
  int err = 0;
  Channel *ch = ctx_of(c)->create_channel(&err);
  if (!ch) {
    errno = err;
    return nullptr;
  }
  std::lock_guard<std::mutex> g(channels_mu);
  channels.insert(&ch->ibv);
  return &ch->ibv;
}

PCIENTB_EXPORT int pcientb_destroy_comp_channel(ibv_comp_channel *ch) {
  std::lock_guard<std::mutex> g(channels_mu);
  if (!channels.count(ch)) return EINVAL;
  ibv_context *c = ch->context;
  pthread_mutex_lock(&c->mutex);  // libibverbs counts the channel's CQs under it
  int err = Context::destroy_channel(reinterpret_cast<Channel *>(ch));
  pthread_mutex_unlock(&c->mutex);
  if (!err) channels.erase(ch);
  return err;
}

PCIENTB_EXPORT int pcientb_query_gid_ex(ibv_context *c, uint32_t port, uint32_t index,
                                        ibv_gid_entry *entry) {
  return ctx_of(c)->query_gid(port, index, entry);
}

PCIENTB_EXPORT int pcientb_query_pkey(ibv_context *c, uint8_t port, int index, __be16 *pkey) {
  return ctx_of(c)->query_pkey(port, index, pkey);
}

PCIENTB_EXPORT int pcientb_query_port_counters(ibv_context *c, uint8_t port,
                                               pcientb_port_counters *out) {
  if (!engine_context(c) || port != 1 || !out) return EINVAL;
  pcientb::engine::Node &node = *ctx_of(c)->node;
  auto sum = std::make_unique<pcientb::engine::QpStats>();
  node.traffic(sum.get());
  pcientb::engine::Counts n;
  n.add(*sum);
  *out = pcientb_port_counters{};
  out->port_xmit_data = n.tx_data();
  out->port_xmit_packets = n.tx_packets();
  out->port_rcv_data = n.rx_data();
  out->port_rcv_packets = n.rx_packets();
  out->errors = n.errors();
  out->flushed = n.flushed();
  out->rnr_retries = n.rnr_retries;
  out->transport_retries = n.transport_retries;
  out->doorbells = node.root()->stats.doorbells.load(std::memory_order_relaxed);
  return 0;
}

PCIENTB_EXPORT int pcientb_query_work(ibv_context *c, pcientb_work *out) {
  if (!engine_context(c) || !out) return EINVAL;
  pcientb::fabric::Work w = ctx_of(c)->node->fab().work();
  *out = pcientb_work{w.posts,           w.post_bytes, w.doorbells,      w.dma_writes,
                      w.dma_write_bytes, w.dma_reads,  w.dma_read_bytes, w.remote_reads};
  return 0;
}

PCIENTB_EXPORT const char *pcientb_fabric_name(void) {
  return pcientb::engine::fabric_name();
}

PCIENTB_EXPORT int pcientb_cq_pending(ibv_cq *cq) {
  return cq_pending(from_ibv<Cq>(cq)) ? 1 : 0;
}

PCIENTB_EXPORT __be64 pcientb_device_guid(ibv_device *) {
  return htobe64(pcientb::fabric::backend().node_guid());
}

PCIENTB_EXPORT int pcientb_device_index(ibv_device *) {
  return 0;
}

PCIENTB_EXPORT int pcientb_device_node_index(const char *path) {
  return path && strcmp(path, kEmuDevicePath) == 0 ? 0 : -1;
}
