#include "device.hpp"

#include <infiniband/verbs.h>

#include <unistd.h>

#include <atomic>
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

struct Opened {
  std::mutex mu;
  Device device;
  std::atomic<pid_t> by{0};  // the process that opened it (a forked child opens its own)
  bool ok = false;
};

Opened &opened() {
  static auto *o = new Opened;  // never destroyed: the CM's service thread may ask during exit()
  return *o;
}

}  // namespace

void open_local_device() {
  Opened &o = opened();
  if (o.by.load(std::memory_order_acquire) == getpid()) return;
  const std::lock_guard<std::mutex> g(o.mu);
  if (o.by.load(std::memory_order_relaxed) == getpid()) return;
  o.device = Device{};
  o.ok = open_device(&o.device);
  o.by.store(getpid(), std::memory_order_release);
}

const Device *local_device() {
  Opened &o = opened();
  if (o.by.load(std::memory_order_acquire) != getpid() || !o.ok) return nullptr;
  return &o.device;
}

}  // namespace pcientb::cm
