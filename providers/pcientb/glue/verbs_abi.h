/* libibverbs' private provider ABI, version 34 (rdma-core v43..v46), declared
 * here because Debian installs no <infiniband/driver.h>. Written from the
 * layouts in shared/research/rdma-core-provider-abi.md and checked against
 * rdma-core v44.0. Only the verbs glue includes this file.
 */
#ifndef PCIENTB_GLUE_VERBS_ABI_H
#define PCIENTB_GLUE_VERBS_ABI_H

#include <infiniband/verbs.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
#include <atomic>
using abi_atomic_int = std::atomic<int>;
extern "C" {
#else
typedef atomic_int abi_atomic_int;
#endif

#if defined(PCIENTB_VERBS_PRIVATE_ABI) && PCIENTB_VERBS_PRIVATE_ABI != 34
#error "pcientb's verbs glue is written for libibverbs private ABI 34"
#endif

struct verbs_sysfs_dev;

enum verbs_match_kind {
  VERBS_MATCH_SENTINEL = 0,
  VERBS_MATCH_PCI = 1,
  VERBS_MATCH_MODALIAS = 2,
  VERBS_MATCH_DRIVER_ID = 3,
};

struct verbs_match_ent {
  void *driver_data;
  union {
    const char *modalias;
    uint64_t driver_id;
  } u;
  uint16_t vendor;
  uint16_t device;
  uint8_t kind;
};

struct verbs_device_ops {
  const char *name;
  uint32_t match_min_abi_version;
  uint32_t match_max_abi_version;
  const struct verbs_match_ent *match_table;
  const struct verbs_device_ops **static_providers;
  bool (*match_device)(struct verbs_sysfs_dev *sysfs_dev);
  struct verbs_context *(*alloc_context)(struct ibv_device *device, int cmd_fd, void *private_data);
  struct verbs_context *(*import_context)(struct ibv_device *device, int cmd_fd);
  struct verbs_device *(*alloc_device)(struct verbs_sysfs_dev *sysfs_dev);
  void (*uninit_device)(struct verbs_device *device);
};

struct abi_list_node {
  struct abi_list_node *next, *prev;
};

struct verbs_device {
  struct ibv_device device; /* first */
  const struct verbs_device_ops *ops;
  abi_atomic_int refcount;
  struct abi_list_node entry;
  struct verbs_sysfs_dev *sysfs;
  uint64_t core_support;
};

enum ibv_mr_type {
  IBV_MR_TYPE_MR,
  IBV_MR_TYPE_NULL_MR,
  IBV_MR_TYPE_IMPORTED_MR,
  IBV_MR_TYPE_DMABUF_MR,
};

struct verbs_mr {
  struct ibv_mr ibv_mr;
  enum ibv_mr_type mr_type;
  int access;
};

enum { VERBS_QP_XRCD = 1 << 0, VERBS_QP_EX = 1 << 1 };

struct verbs_qp {
  union {
    struct ibv_qp qp;
    struct ibv_qp_ex qp_ex;
  };
  uint32_t comp_mask;
  void *xrcd;
};

/* The ops a provider gives verbs_set_ops(): 76 pointers in alphabetical order.
 * Those pcientb does not implement are left NULL and typed loosely. */
typedef void (*abi_unused_op)(void);
struct verbs_context_ops {
  abi_unused_op advise_mr, alloc_dm, alloc_mw, alloc_null_mr, alloc_parent_domain;
  struct ibv_pd *(*alloc_pd)(struct ibv_context *context);
  abi_unused_op alloc_td;
  void (*async_event)(struct ibv_context *context, struct ibv_async_event *event);
  abi_unused_op attach_counters_point_flow, attach_mcast, bind_mw, close_xrcd;
  void (*cq_event)(struct ibv_cq *cq);
  struct ibv_ah *(*create_ah)(struct ibv_pd *pd, struct ibv_ah_attr *attr);
  abi_unused_op create_counters;
  struct ibv_cq *(*create_cq)(struct ibv_context *context, int cqe,
                              struct ibv_comp_channel *channel, int comp_vector);
  struct ibv_cq_ex *(*create_cq_ex)(struct ibv_context *context,
                                    struct ibv_cq_init_attr_ex *init_attr);
  abi_unused_op create_flow, create_flow_action_esp;
  struct ibv_qp *(*create_qp)(struct ibv_pd *pd, struct ibv_qp_init_attr *attr);
  struct ibv_qp *(*create_qp_ex)(struct ibv_context *context, struct ibv_qp_init_attr_ex *attr);
  abi_unused_op create_rwq_ind_table;
  struct ibv_srq *(*create_srq)(struct ibv_pd *pd, struct ibv_srq_init_attr *attr);
  abi_unused_op create_srq_ex, create_wq, dealloc_mw;
  int (*dealloc_pd)(struct ibv_pd *pd);
  abi_unused_op dealloc_td;
  int (*dereg_mr)(struct verbs_mr *vmr);
  int (*destroy_ah)(struct ibv_ah *ah);
  abi_unused_op destroy_counters;
  int (*destroy_cq)(struct ibv_cq *cq);
  abi_unused_op destroy_flow, destroy_flow_action;
  int (*destroy_qp)(struct ibv_qp *qp);
  abi_unused_op destroy_rwq_ind_table;
  int (*destroy_srq)(struct ibv_srq *srq);
  abi_unused_op destroy_wq, detach_mcast;
  void (*free_context)(struct ibv_context *context);
  abi_unused_op free_dm, get_srq_num, import_dm, import_mr, import_pd, modify_cq,
      modify_flow_action_esp;
  int (*modify_qp)(struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask);
  abi_unused_op modify_qp_rate_limit;
  int (*modify_srq)(struct ibv_srq *srq, struct ibv_srq_attr *attr, int attr_mask);
  abi_unused_op modify_wq, open_qp, open_xrcd;
  int (*poll_cq)(struct ibv_cq *cq, int num_entries, struct ibv_wc *wc);
  int (*post_recv)(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad_wr);
  int (*post_send)(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad_wr);
  abi_unused_op post_srq_ops;
  int (*post_srq_recv)(struct ibv_srq *srq, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad_wr);
  int (*query_device_ex)(struct ibv_context *context, const struct ibv_query_device_ex_input *input,
                         struct ibv_device_attr_ex *attr, size_t attr_size);
  abi_unused_op query_ece;
  int (*query_port)(struct ibv_context *context, uint8_t port_num, struct ibv_port_attr *attr);
  int (*query_qp)(struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask,
                  struct ibv_qp_init_attr *init_attr);
  abi_unused_op query_qp_data_in_order, query_rt_values;
  int (*query_srq)(struct ibv_srq *srq, struct ibv_srq_attr *attr);
  abi_unused_op read_counters, reg_dm_mr, reg_dmabuf_mr;
  struct ibv_mr *(*reg_mr)(struct ibv_pd *pd, void *addr, size_t length, uint64_t hca_va,
                           int access);
  int (*req_notify_cq)(struct ibv_cq *cq, int solicited_only);
  int (*rereg_mr)(struct verbs_mr *vmr, int flags, struct ibv_pd *pd, void *addr, size_t length,
                  int access);
  int (*resize_cq)(struct ibv_cq *cq, int cqe);
  abi_unused_op set_ece, unimport_dm, unimport_mr, unimport_pd;
};

void verbs_register_driver_34(const struct verbs_device_ops *ops);
void *_verbs_init_and_alloc_context(struct ibv_device *device, int cmd_fd, size_t alloc_size,
                                    struct verbs_context *context_offset, uint32_t driver_id);
void verbs_uninit_context(struct verbs_context *context);
void verbs_set_ops(struct verbs_context *vctx, const struct verbs_context_ops *ops);

#ifdef __cplusplus
}
static_assert(sizeof(struct verbs_context_ops) == 76 * sizeof(void *),
              "verbs_context_ops must hold 76 pointers");
static_assert(offsetof(struct verbs_device, sysfs) == sizeof(struct ibv_device) + 32,
              "verbs_device layout");
#endif
#endif
