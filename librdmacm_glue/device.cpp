#include "device.hpp"

#include <infiniband/verbs.h>

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <mutex>

namespace pcientb::cm {

namespace {

bool open_device(Device *d) {
  int n = 0;
  ibv_device **list = ibv_get_device_list(&n);
  if (list == nullptr) return false;
  ibv_context *ctx = nullptr;
  for (int i = 0; i < n && ctx == nullptr; ++i)
    if (std::strncmp(ibv_get_device_name(list[i]), "pcientb", 7) == 0) {
      ctx = ibv_open_device(list[i]);
      d->guid = ibv_get_device_guid(list[i]);
    }
  ibv_free_device_list(list);
  if (ctx == nullptr) {
    errno = ENODEV;
    return false;
  }
  ibv_device_attr dev{};
  ibv_port_attr port{};
  ibv_gid gid{};
  if (ibv_query_device(ctx, &dev) != 0 || ibv_query_port(ctx, 1, &port) != 0 ||
      ibv_query_gid(ctx, 1, 0, &gid) != 0) {
    ibv_close_device(ctx);
    errno = ENODEV;
    return false;
  }
  d->lid = port.lid;
  d->active_mtu = static_cast<uint8_t>(port.active_mtu);
  d->max_rd_atomic = static_cast<uint8_t>(dev.max_qp_init_rd_atom);
  d->max_dest_rd_atomic = static_cast<uint8_t>(dev.max_qp_rd_atom);
  std::memcpy(d->gid, gid.raw, sizeof d->gid);
  // ctx stays open for the life of the process: closing it could end the
  // node, and the next context would be a node with another LID.
  return true;
}

}  // namespace

const Device *local_device() {
  static std::mutex mu;
  static Device device;
  static bool opened = false;
  static pid_t opened_by = 0;
  const std::lock_guard<std::mutex> g(mu);
  // A forked child is a node of its own: what its parent opened is not it.
  if (opened && opened_by != getpid()) opened = false;
  if (!opened) {
    device = Device{};
    opened = open_device(&device);
    opened_by = getpid();
  }
  if (!opened) return nullptr;
  return &device;
}

}  // namespace pcientb::cm
