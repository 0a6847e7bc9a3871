// What the CM tells peers and librdmacm about this process's pcientb device,
// read through the public verbs API.
#pragma once

#include <cstdint>

namespace pcientb::cm {

struct Device {
  uint64_t guid = 0;  // as ibv_get_device_guid() returns it (network order)
  uint8_t gid[16] = {};
  uint16_t lid = 0;
  uint8_t active_mtu = 0;  // enum ibv_mtu
  uint8_t max_rd_atomic = 0;
  uint8_t max_dest_rd_atomic = 0;
};

// Opens the first pcientb device of this process once and keeps it open: the
// fabric node (and its LID) is the one the program's own contexts share.
// Called without the CM's lock held: opening a device takes the provider's
// locks, which fork handlers take before the CM's.
void open_local_device();

// What open_local_device() found in this process; nullptr when there is none.
const Device *local_device();

}  // namespace pcientb::cm
