// A pcientb device of the kernel (pcientb.ko): its contexts, queries, PDs and MRs
// are the kernel's, reached by uverbs commands written to the context's cmd_fd (the
// legacy write() ABI, which needs none of libibverbs' private command helpers).
// The data path (QPs, CQs) waits for the engine's kernel fabric backend
// (docs/kernel.md); until then those verbs fail with EOPNOTSUPP, libibverbs'
// answer for an op the provider does not set.
#include <rdma/ib_user_verbs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "glue/glue.hpp"
#include "glue/verbs_abi.h"
#include "pcientb-abi.h"

namespace pcientb::glue {
namespace {

struct KernelContext {
  pcientb_ucontext_resp info;
  verbs_context vctx;  // ends with struct ibv_context: must come last
};

KernelContext *kctx_of(ibv_context *c) {
  return reinterpret_cast<KernelContext *>(reinterpret_cast<char *>(c) -
                                           offsetof(KernelContext, vctx.context));
}

// Writes one uverbs command (header, then `cmd`); the kernel writes up to
// `resp_size` bytes of response where `cmd` says (its first word, if any).
// 0 or an errno value.
template <typename Cmd>
int execute(int fd, uint32_t command, const Cmd &cmd, size_t resp_size) {
  static_assert(sizeof(Cmd) % 4 == 0, "uverbs counts commands in 32-bit words");
  ib_uverbs_cmd_hdr hdr{};
  hdr.command = command;
  hdr.in_words = static_cast<uint16_t>((sizeof hdr + sizeof cmd) / 4);
  hdr.out_words = static_cast<uint16_t>(resp_size / 4);
  unsigned char buf[sizeof hdr + sizeof cmd];
  std::memcpy(buf, &hdr, sizeof hdr);
  std::memcpy(buf + sizeof hdr, &cmd, sizeof cmd);
  const ssize_t n = write(fd, buf, sizeof buf);
  if (n == static_cast<ssize_t>(sizeof buf)) return 0;
  return n < 0 ? errno : EIO;
}

// A destroy command's error, as libibverbs' own commands read it: EIO means the
// device was disassociated (DEVICE_FATAL) and the kernel has freed the object
// already, so the caller's copy goes too.
int destroy_error(int err) {
  return err == EIO ? 0 : err;
}

uint64_t response_at(const void *resp) {
  return reinterpret_cast<uintptr_t>(resp);
}

int query_device_ex(ibv_context *c, const ibv_query_device_ex_input *input,
                    ibv_device_attr_ex *attr, size_t attr_size) {
  if (input && input->comp_mask) return EINVAL;
  ib_uverbs_query_device_resp r{};
  ib_uverbs_query_device cmd{};
  cmd.response = response_at(&r);
  if (int err = execute(c->cmd_fd, IB_USER_VERBS_CMD_QUERY_DEVICE, cmd, sizeof r)) return err;
  ibv_device_attr_ex a{};
  ibv_device_attr &d = a.orig_attr;
  snprintf(d.fw_ver, sizeof d.fw_ver, "%u.%u.%03u", unsigned((r.fw_ver >> 32) & 0xffff),
           unsigned((r.fw_ver >> 16) & 0xffff), unsigned(r.fw_ver & 0xffff));
  d.node_guid = r.node_guid;
  d.sys_image_guid = r.sys_image_guid;
  d.max_mr_size = r.max_mr_size;
  d.page_size_cap = r.page_size_cap;
  d.vendor_id = r.vendor_id;
  d.vendor_part_id = r.vendor_part_id;
  d.hw_ver = r.hw_ver;
  d.max_qp = static_cast<int>(r.max_qp);
  d.max_qp_wr = static_cast<int>(r.max_qp_wr);
  d.device_cap_flags = r.device_cap_flags;
  d.max_sge = static_cast<int>(r.max_sge);
  d.max_sge_rd = static_cast<int>(r.max_sge_rd);
  d.max_cq = static_cast<int>(r.max_cq);
  d.max_cqe = static_cast<int>(r.max_cqe);
  d.max_mr = static_cast<int>(r.max_mr);
  d.max_pd = static_cast<int>(r.max_pd);
  d.max_qp_rd_atom = static_cast<int>(r.max_qp_rd_atom);
  d.max_ee_rd_atom = static_cast<int>(r.max_ee_rd_atom);
  d.max_res_rd_atom = static_cast<int>(r.max_res_rd_atom);
  d.max_qp_init_rd_atom = static_cast<int>(r.max_qp_init_rd_atom);
  d.max_ee_init_rd_atom = static_cast<int>(r.max_ee_init_rd_atom);
  d.atomic_cap = static_cast<ibv_atomic_cap>(r.atomic_cap);
  d.max_ee = static_cast<int>(r.max_ee);
  d.max_rdd = static_cast<int>(r.max_rdd);
  d.max_mw = static_cast<int>(r.max_mw);
  d.max_raw_ipv6_qp = static_cast<int>(r.max_raw_ipv6_qp);
  d.max_raw_ethy_qp = static_cast<int>(r.max_raw_ethy_qp);
  d.max_mcast_grp = static_cast<int>(r.max_mcast_grp);
  d.max_mcast_qp_attach = static_cast<int>(r.max_mcast_qp_attach);
  d.max_total_mcast_qp_attach = static_cast<int>(r.max_total_mcast_qp_attach);
  d.max_ah = static_cast<int>(r.max_ah);
  d.max_fmr = static_cast<int>(r.max_fmr);
  d.max_map_per_fmr = static_cast<int>(r.max_map_per_fmr);
  d.max_srq = static_cast<int>(r.max_srq);
  d.max_srq_wr = static_cast<int>(r.max_srq_wr);
  d.max_srq_sge = static_cast<int>(r.max_srq_sge);
  d.max_pkeys = r.max_pkeys;
  d.local_ca_ack_delay = r.local_ca_ack_delay;
  d.phys_port_cnt = r.phys_port_cnt;
  a.device_cap_flags_ex = d.device_cap_flags;
  a.phys_port_cnt_ex = d.phys_port_cnt;
  std::memcpy(attr, &a, std::min(attr_size, sizeof a));
  return 0;
}

int query_port(ibv_context *c, uint8_t port, ibv_port_attr *attr) {
  ib_uverbs_query_port_resp r{};
  ib_uverbs_query_port cmd{};
  cmd.response = response_at(&r);
  cmd.port_num = port;
  if (int err = execute(c->cmd_fd, IB_USER_VERBS_CMD_QUERY_PORT, cmd, sizeof r)) return err;
  // libibverbs cleared *attr, which may be an older, shorter struct than ours.
  attr->state = static_cast<ibv_port_state>(r.state);
  attr->max_mtu = static_cast<ibv_mtu>(r.max_mtu);
  attr->active_mtu = static_cast<ibv_mtu>(r.active_mtu);
  attr->gid_tbl_len = static_cast<int>(r.gid_tbl_len);
  attr->port_cap_flags = r.port_cap_flags;
  attr->max_msg_sz = r.max_msg_sz;
  attr->bad_pkey_cntr = r.bad_pkey_cntr;
  attr->qkey_viol_cntr = r.qkey_viol_cntr;
  attr->pkey_tbl_len = r.pkey_tbl_len;
  attr->lid = r.lid;
  attr->sm_lid = r.sm_lid;
  attr->lmc = r.lmc;
  attr->max_vl_num = r.max_vl_num;
  attr->sm_sl = r.sm_sl;
  attr->subnet_timeout = r.subnet_timeout;
  attr->init_type_reply = r.init_type_reply;
  attr->active_width = r.active_width;
  attr->active_speed = r.active_speed;
  attr->phys_state = r.phys_state;
  attr->link_layer = r.link_layer;
  attr->flags = r.flags;
  // Each context is a node with a LID of its own (as each process on the emulated fabric).
  attr->lid = static_cast<uint16_t>(kctx_of(c)->info.lid);
  return 0;
}

ibv_pd *alloc_pd(ibv_context *c) {
  auto *pd = static_cast<ibv_pd *>(calloc(1, sizeof(ibv_pd)));
  if (!pd) {
    errno = ENOMEM;
    return nullptr;
  }
  ib_uverbs_alloc_pd_resp r{};
  ib_uverbs_alloc_pd cmd{};
  cmd.response = response_at(&r);
  if (int err = execute(c->cmd_fd, IB_USER_VERBS_CMD_ALLOC_PD, cmd, sizeof r)) {
    free(pd);
    errno = err;
    return nullptr;
  }
  pd->context = c;
  pd->handle = r.pd_handle;
  return pd;
}

int dealloc_pd(ibv_pd *pd) {
  ib_uverbs_dealloc_pd cmd{};
  cmd.pd_handle = pd->handle;
  if (int err = destroy_error(execute(pd->context->cmd_fd, IB_USER_VERBS_CMD_DEALLOC_PD, cmd, 0)))
    return err;
  free(pd);
  return 0;
}

// The kernel pins the pages and keys the region; libibverbs fills in context, PD,
// address and length once this returns.
ibv_mr *reg_mr(ibv_pd *pd, void *addr, size_t length, uint64_t hca_va, int access) {
  auto *vmr = static_cast<verbs_mr *>(calloc(1, sizeof(verbs_mr)));
  if (!vmr) {
    errno = ENOMEM;
    return nullptr;
  }
  ib_uverbs_reg_mr_resp r{};
  ib_uverbs_reg_mr cmd{};
  cmd.response = response_at(&r);
  cmd.start = reinterpret_cast<uintptr_t>(addr);
  cmd.length = length;
  cmd.hca_va = hca_va;
  cmd.pd_handle = pd->handle;
  cmd.access_flags = static_cast<uint32_t>(access);
  if (int err = execute(pd->context->cmd_fd, IB_USER_VERBS_CMD_REG_MR, cmd, sizeof r)) {
    free(vmr);
    errno = err;
    return nullptr;
  }
  vmr->ibv_mr.handle = r.mr_handle;
  vmr->ibv_mr.lkey = r.lkey;
  vmr->ibv_mr.rkey = r.rkey;
  vmr->mr_type = IBV_MR_TYPE_MR;
  vmr->access = access;
  return &vmr->ibv_mr;
}

int dereg_mr(verbs_mr *vmr) {
  ib_uverbs_dereg_mr cmd{};
  cmd.mr_handle = vmr->ibv_mr.handle;
  if (int err =
          destroy_error(execute(vmr->ibv_mr.context->cmd_fd, IB_USER_VERBS_CMD_DEREG_MR, cmd, 0)))
    return err;
  free(vmr);
  return 0;
}

void free_context(ibv_context *c) {
  KernelContext *k = kctx_of(c);
  verbs_uninit_context(&k->vctx);  // closes cmd_fd: the kernel drops the context
  free(k);
}

const verbs_context_ops kKernelOps = [] {
  verbs_context_ops o{};
  o.alloc_pd = alloc_pd;
  o.dealloc_pd = dealloc_pd;
  o.dereg_mr = dereg_mr;
  o.free_context = free_context;
  o.query_device_ex = query_device_ex;
  o.query_port = query_port;
  o.reg_mr = reg_mr;
  return o;
}();

// The kernel's context for this process: GET_CONTEXT gives the async event fd
// and, after the core answer, pcientb.ko's own (pcientb_ucontext_resp).
int get_context(int cmd_fd, ib_uverbs_get_context_resp *core, pcientb_ucontext_resp *info) {
  alignas(8) unsigned char r[sizeof *core + sizeof *info] = {};
  ib_uverbs_get_context cmd{};
  cmd.response = response_at(r);
  if (int err = execute(cmd_fd, IB_USER_VERBS_CMD_GET_CONTEXT, cmd, sizeof r)) return err;
  std::memcpy(core, r, sizeof *core);
  std::memcpy(info, r + sizeof *core, sizeof *info);  // the driver data follow the core answer
  return 0;
}

}  // namespace

verbs_context *alloc_kernel_context(ibv_device *dev, int cmd_fd) {
  auto *k = static_cast<KernelContext *>(_verbs_init_and_alloc_context(
      dev, cmd_fd, sizeof(KernelContext),
      reinterpret_cast<verbs_context *>(offsetof(KernelContext, vctx)), PCIENTB_DRIVER_ID));
  if (!k) return nullptr;
  ibv_context &c = k->vctx.context;
  ib_uverbs_get_context_resp core{};
  int err = get_context(cmd_fd, &core, &k->info);
  if (!err) c.async_fd = static_cast<int>(core.async_fd);  // closed with the context
  if (!err && (k->info.magic != PCIENTB_UCONTEXT_MAGIC ||
               k->info.abi_version != PCIENTB_UVERBS_ABI_VERSION)) {
    fprintf(stderr, "pcientb: %s: pcientb.ko speaks ABI %u, this provider %u\n", dev->name,
            k->info.magic == PCIENTB_UCONTEXT_MAGIC ? k->info.abi_version : 0,
            PCIENTB_UVERBS_ABI_VERSION);
    err = EPROTO;
  }
  if (err) {
    if (err != EPROTO)
      fprintf(stderr, "pcientb: %s: no kernel context: %s\n", dev->name, strerror(err));
    verbs_uninit_context(&k->vctx);
    free(k);
    errno = err;
    return nullptr;
  }
  c.num_comp_vectors = static_cast<int>(core.num_comp_vectors);
  verbs_set_ops(&k->vctx, &kKernelOps);
  return &k->vctx;
}

}  // namespace pcientb::glue
