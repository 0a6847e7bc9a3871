// What the glue's files share: the QP wrapper (struct verbs_qp is private ABI)
// and the ibv_wr_* send API installed on it.
#pragma once

#include <vector>

#include "engine/engine.hpp"
#include "glue/verbs_abi.h"

namespace pcientb::glue {

struct GlueQp {
  verbs_qp vqp;  // first: libibverbs casts struct ibv_qp * to it
  engine::Qp *qp;
  std::vector<engine::SendWqe> *batch;  // between wr_start and wr_complete
  int batch_err;
};

inline GlueQp *glue_qp(ibv_qp *qp) {
  return reinterpret_cast<GlueQp *>(qp);
}

constexpr uint64_t kSupportedSendOps =
    IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM | IBV_QP_EX_WITH_SEND |
    IBV_QP_EX_WITH_SEND_WITH_IMM | IBV_QP_EX_WITH_RDMA_READ | IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP |
    IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD;

// Installs the ibv_wr_* functions for the operations in send_ops_flags.
void init_qp_ex(GlueQp *g, uint64_t send_ops_flags);

}  // namespace pcientb::glue
