// Thin helpers over the public verbs API: owning handles, QP transitions,
// registered memory and a FIFO byte ring for WR buffers.
#ifndef PCIENTB_STRESS_VERBS_HPP
#define PCIENTB_STRESS_VERBS_HPP

#include <infiniband/verbs.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>

namespace stress {

// A verbs call failed where the tool cannot go on with that object.
struct VerbsError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
[[noreturn]] void throw_verbs(const char *what, int err);

template <class T, int (*Destroy)(T *)>
struct Destroyer {
  void operator()(T *p) const {
    if (p) Destroy(p);
  }
};
template <class T, int (*Destroy)(T *)>
using Handle = std::unique_ptr<T, Destroyer<T, Destroy>>;

using ContextPtr = Handle<ibv_context, ibv_close_device>;
using PdPtr = Handle<ibv_pd, ibv_dealloc_pd>;
using MrPtr = Handle<ibv_mr, ibv_dereg_mr>;
using CqPtr = Handle<ibv_cq, ibv_destroy_cq>;
using QpPtr = Handle<ibv_qp, ibv_destroy_qp>;
using SrqPtr = Handle<ibv_srq, ibv_destroy_srq>;
using AhPtr = Handle<ibv_ah, ibv_destroy_ah>;

inline constexpr int kRemoteAccess =
    IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
inline constexpr int kAllAccess = IBV_ACCESS_LOCAL_WRITE | kRemoteAccess;
inline constexpr uint32_t kUdQkey = 0x5eed;
inline constexpr size_t kGrh = 40;

// The device, its limits and one PD.
struct Node {
  Node();  // opens pcientb0 (throws VerbsError)
  ContextPtr ctx;
  PdPtr pd;
  ibv_device_attr dev{};
  uint16_t lid = 0;
};

CqPtr create_cq(ibv_context *ctx, int cqe);
// Creates the QP; `attr->cap` gets the capacities it was given.
QpPtr create_qp(ibv_pd *pd, ibv_qp_init_attr *attr);

struct RcPeer {
  uint16_t lid;
  uint32_t qpn, psn;
};
// RESET -> INIT with the given remote access flags.
void rc_init(ibv_qp *qp, int access);
// INIT -> RTR -> RTS towards `peer`, sending from `sq_psn`.
void rc_connect(ibv_qp *qp, const RcPeer &peer, uint32_t sq_psn);
void ud_ready(ibv_qp *qp);
// ibv_modify_qp to ERR; the errno value.
int to_error(ibv_qp *qp);
ibv_qp_state qp_state(ibv_qp *qp);

// Page-aligned anonymous memory, unmapped at destruction.
class Memory {
 public:
  Memory() = default;
  explicit Memory(size_t size);
  Memory(Memory &&o) noexcept { *this = std::move(o); }
  Memory &operator=(Memory &&o) noexcept;
  ~Memory();
  uint8_t *data() const { return data_; }
  size_t size() const { return size_; }

 private:
  uint8_t *data_ = nullptr;
  size_t size_ = 0;
};

// Registered memory: the pages and their MR.
struct Region {
  Region() = default;
  Region(ibv_pd *pd, size_t size, int access);
  void reregister(ibv_pd *pd, int access);  // ibv_dereg_mr + ibv_reg_mr of the same pages
  Memory mem;
  MrPtr mr;
  uint8_t *at(size_t off) const { return mem.data() + off; }
  uint64_t addr(size_t off = 0) const { return reinterpret_cast<uintptr_t>(mem.data()) + off; }
};

// A ring of bytes released in the order they were taken (as the WRs of one
// send queue complete). `cost` includes the padding skipped at the wrap.
class ByteRing {
 public:
  explicit ByteRing(size_t size = 0) : size_(size) {}
  std::optional<size_t> take(size_t n, size_t align, size_t *cost);
  void give(size_t cost) { used_ -= cost; }
  void reset() { used_ = head_ = 0; }
  size_t used() const { return used_; }

 private:
  size_t size_, head_ = 0, used_ = 0;
};

std::string status_name(int status);
const char *event_name(ibv_event_type type);

}  // namespace stress

#endif
