// Commands to pcientb.ko through a uverbs fd: the core's legacy write()
// commands (GET_CONTEXT, ALLOC_PD, REG_MR, ...), which need none of
// libibverbs' private helpers, and the module's driver methods (ioctl,
// uapi/pcientb-abi.h).
#pragma once

#include <rdma/ib_user_ioctl_cmds.h>
#include <rdma/ib_user_ioctl_verbs.h>
#include <rdma/ib_user_verbs.h>
#include <rdma/rdma_user_ioctl_cmds.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "pcientb-abi.h"

namespace pcientb::fabric::kernel {

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

inline uint64_t response_at(const void *resp) {
  return reinterpret_cast<uintptr_t>(resp);
}

// A context on `fd` that is not a node (no LID, area or doorbell): what
// libibverbs' own commands and a view of the node table need. Its async event
// fd is closed; *info (if given) gets the driver's answer. 0 or an errno value.
inline int get_context_without_node(int fd, pcientb_ucontext_resp *info = nullptr) {
  alignas(8) unsigned char r[sizeof(ib_uverbs_get_context_resp) + sizeof(*info)] = {};
  // The command, then its driver data (the core struct ends in a flexible array).
  struct Cmd {
    uint64_t response;
    pcientb_ucontext_req req;
  } cmd{};
  static_assert(sizeof(ib_uverbs_get_context) == offsetof(Cmd, req));
  cmd.response = response_at(r);
  cmd.req.flags = PCIENTB_UCONTEXT_NO_NODE;
  if (int err = execute(fd, IB_USER_VERBS_CMD_GET_CONTEXT, cmd, sizeof r)) return err;
  ib_uverbs_get_context_resp core{};
  std::memcpy(&core, r, sizeof core);
  close(static_cast<int>(core.async_fd));
  if (info) std::memcpy(info, r + sizeof core, sizeof *info);
  return 0;
}

// A driver method of pcientb.ko with its command and, if `out`, its response:
// 0 or an errno value. (An attribute of 8 bytes or less travels in the
// attribute itself.)
template <typename In>
int method(int fd, uint16_t id, const In &in, void *out = nullptr, uint16_t out_len = 0) {
  // The header ends in a flexible array of attributes: built in a buffer.
  alignas(8) unsigned char buf[sizeof(ib_uverbs_ioctl_hdr) + 2 * sizeof(ib_uverbs_attr)] = {};
  auto *hdr = reinterpret_cast<ib_uverbs_ioctl_hdr *>(buf);
  auto *attr = reinterpret_cast<ib_uverbs_attr *>(buf + sizeof *hdr);
  hdr->length = static_cast<uint16_t>(sizeof *hdr + (out ? 2 : 1) * sizeof *attr);
  hdr->object_id = UVERBS_OBJECT_DEVICE;
  hdr->method_id = id;
  hdr->num_attrs = out ? 2 : 1;
  hdr->driver_id = PCIENTB_DRIVER_ID;
  attr[0].attr_id = 1U << UVERBS_ID_NS_SHIFT;  // each method's command
  attr[0].len = sizeof in;
  attr[0].flags = UVERBS_ATTR_F_MANDATORY;
  if constexpr (sizeof in <= sizeof attr[0].data)
    std::memcpy(&attr[0].data, &in, sizeof in);
  else
    attr[0].data = reinterpret_cast<uintptr_t>(&in);
  attr[1].attr_id = (1U << UVERBS_ID_NS_SHIFT) + 1;  // its response
  attr[1].len = out_len;
  attr[1].flags = UVERBS_ATTR_F_MANDATORY;
  attr[1].data = reinterpret_cast<uintptr_t>(out);
  return ioctl(fd, RDMA_VERBS_IOCTL, buf) ? errno : 0;
}

}  // namespace pcientb::fabric::kernel
