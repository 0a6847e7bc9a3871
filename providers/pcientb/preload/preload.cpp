// libpcientb-preload.so: makes pcientb's emulated devices usable by unmodified
// verbs programs (LD_PRELOAD, normally through tools/pcientb-run).
//
// libibverbs only lists devices that the kernel announces, and a handful of
// its generic calls ask the kernel (uverbs commands on cmd_fd, or sysfs) rather
// than the provider. For a device with no kernel behind it (verbs_device.sysfs
// == NULL, cmd_fd == -1) those calls fail or return zeroes. This library
// interposes exactly those calls: for pcientb objects it answers through the C
// entry points of <pcientb/pcientb.h>; everything else goes to the real
// libibverbs, found with dlvsym(RTLD_NEXT, name, version).
//
// The interposers carry the same symbol versions as libibverbs (preload.map.in),
// so they bind for programs linked against the versioned symbols, and for
// libibverbs' own internal calls, which go through its PLT (e.g.
// ibv_init_ah_from_wc -> ibv_query_gid / ibv_query_gid_type).
//
// Interposed (version):
//   ibv_get_device_list, ibv_free_device_list      (IBVERBS_1.1)  list our devices
//   ibv_create_comp_channel, ibv_destroy_comp_channel (IBVERBS_1.0) uverbs command
//   ibv_query_gid (1.1), _ibv_query_gid_ex, _ibv_query_gid_table (1.11),
//   ibv_query_gid_type (IBVERBS_PRIVATE_<N>; used by ibv_devinfo and pyverbs)
//                                                  uverbs ioctl / sysfs
//   ibv_query_pkey (1.1), ibv_get_pkey_index (1.5) sysfs
//   ibv_get_device_guid (1.1), ibv_get_device_index (1.9) sysfs
//   ibv_import_device (1.10)                       walks the device list assuming
//                                                  sysfs != NULL: ours are hidden
//                                                  from it
//
// And from glibc, for the device node a kernel driver would create: UCX
// (uct_ib_device_is_accessible) skips a verbs device unless
// /dev/infiniband/<dev_name> stat()s as a character device it may open.
//   stat, stat64 (GLIBC_2.33), __xstat, __xstat64, access (GLIBC_2.2.5)
// answer for that path of our own devices only, and only when no real file
// is there (with the kernel module loaded, the real node answers).

#include <dlfcn.h>
#include <pcientb/pcientb.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <unordered_map>

#ifndef PCIENTB_VERBS_PRIVATE_ABI
#error "PCIENTB_VERBS_PRIVATE_ABI must be defined by the build (cmake/VerbsAbi.cmake)"
#endif
#define PCIENTB_STR2(x) #x
#define PCIENTB_STR(x) PCIENTB_STR2(x)
#define PCIENTB_EXPORT __attribute__((visibility("default")))

// libibverbs' private ibv_query_gid_type() reports the sysfs GID type.
enum pcientb_gid_type_sysfs : int {
  PCIENTB_GID_TYPE_SYSFS_IB_ROCE_V1 = 0,
  PCIENTB_GID_TYPE_SYSFS_ROCE_V2 = 1,
};

extern "C" {
// Declared here: not in the public headers.
int ibv_query_gid_type(struct ibv_context *context, uint8_t port_num, unsigned int index,
                       enum pcientb_gid_type_sysfs *type);
}

namespace {

constexpr const char *kV1_0 = "IBVERBS_1.0";
constexpr const char *kV1_1 = "IBVERBS_1.1";
constexpr const char *kV1_5 = "IBVERBS_1.5";
constexpr const char *kV1_9 = "IBVERBS_1.9";
constexpr const char *kV1_10 = "IBVERBS_1.10";
constexpr const char *kV1_11 = "IBVERBS_1.11";
constexpr const char *kPrivate = "IBVERBS_PRIVATE_" PCIENTB_STR(PCIENTB_VERBS_PRIVATE_ABI);
constexpr const char *kGlibc2_2_5 = "GLIBC_2.2.5";
constexpr const char *kGlibc2_33 = "GLIBC_2.33";

// The next definition of a libibverbs function after this library.
template <typename Fn>
Fn *next_symbol(const char *name, const char *version) {
  void *sym = dlvsym(RTLD_NEXT, name, version);
  if (sym == nullptr) {
    std::fprintf(stderr, "pcientb-preload: no %s@%s after the preload library: %s\n", name, version,
                 dlerror());
  }
  return reinterpret_cast<Fn *>(sym);
}

// Resolved once, on first use (thread-safe static initialisation).
// NOLINTBEGIN(bugprone-macro-parentheses): fn is a function name
#define PCIENTB_REAL(fn, version)                                                 \
  ([]() {                                                                         \
    static decltype(&fn) const real_fn = next_symbol<decltype(fn)>(#fn, version); \
    return real_fn;                                                               \
  }())
// NOLINTEND(bugprone-macro-parentheses)

// Set while a real libibverbs call that walks the device list runs on this
// thread: our devices (sysfs == NULL) must not appear in that list.
thread_local bool t_real_devices_only = false;

class RealDevicesOnly {
 public:
  RealDevicesOnly() : saved_(t_real_devices_only) { t_real_devices_only = true; }
  ~RealDevicesOnly() { t_real_devices_only = saved_; }
  RealDevicesOnly(const RealDevicesOnly &) = delete;
  RealDevicesOnly &operator=(const RealDevicesOnly &) = delete;

 private:
  bool saved_;
};

// Lists handed out by ibv_get_device_list() that contain our devices, mapped to
// the real libibverbs list whose devices they also contain (may be NULL), which
// must go back to the real ibv_free_device_list(). Never destroyed: lists may
// be freed from atexit handlers.
struct ListRegistry {
  std::mutex lock;
  std::unordered_map<ibv_device **, ibv_device **> real_of;
};

ListRegistry &registry() {
  static auto *r = new ListRegistry;  // NOLINT(cppcoreguidelines-owning-memory)
  return *r;
}

bool ours(ibv_context *ctx) {
  return ctx != nullptr && pcientb_owns_context(ctx) != 0;
}
bool ours(ibv_device *dev) {
  return dev != nullptr && pcientb_owns_device(dev) != 0;
}

void put_all(ibv_device **list) {
  for (ibv_device **d = list; *d != nullptr; ++d) pcientb_put_device(*d);
}

// The GID entry of one of our contexts; 0 or an errno value (ENODATA: empty).
int query_gid_entry(ibv_context *ctx, uint32_t port, uint32_t index, ibv_gid_entry *entry) {
  *entry = ibv_gid_entry{};
  return pcientb_query_gid_ex(ctx, port, index, entry);
}

// A uverbs device node as the kernel would create it: character device 231,
// minor 192 + index, read-write for everyone (udev's rdma rules).
template <typename Stat>
int fake_device_node(const char *path, Stat *st) {
  const int index = pcientb_device_node_index(path);
  if (index < 0) return -1;
  std::memset(st, 0, sizeof(*st));
  st->st_mode = S_IFCHR | 0666;
  st->st_rdev = makedev(231, 192 + index);
  st->st_nlink = 1;
  st->st_uid = 0;
  st->st_gid = 0;
  st->st_blksize = 4096;
  return 0;
}

// Runs the real call; for ENOENT on one of our device nodes, answers instead.
template <typename Stat, typename Real>
int stat_or_fake(const char *path, Stat *st, Real &&real) {
  const int rc = real();
  if (rc == 0 || errno != ENOENT) return rc;
  const int saved = errno;
  if (fake_device_node(path, st) == 0) return 0;
  errno = saved;
  return rc;
}

}  // namespace

extern "C" {

// --- Device list ----------------------------------------------------------------

PCIENTB_EXPORT struct ibv_device **ibv_get_device_list(int *num_devices) {
  auto *real_get = PCIENTB_REAL(ibv_get_device_list, kV1_1);
  auto *real_free = PCIENTB_REAL(ibv_free_device_list, kV1_1);
  if (num_devices != nullptr) *num_devices = 0;

  int n_real = 0;
  ibv_device **real_list = real_get != nullptr ? real_get(&n_real) : nullptr;
  // Without RDMA in the kernel the real call fails (ENOSYS): ours still count.
  const int real_errno = real_get != nullptr ? errno : ENOSYS;
  if (t_real_devices_only) {
    if (real_list != nullptr && num_devices != nullptr) *num_devices = n_real;
    return real_list;
  }
  if (real_list == nullptr) n_real = 0;
  // pcientb.ko's devices (kernel:<device> fabrics) replace the emulated fabric: where one
  // exists, the emulated pcientb0 would only shadow it.
  for (int i = 0; i < n_real; ++i)
    if (std::strncmp(real_list[i]->name, "pcientb", 7) == 0) {
      if (num_devices != nullptr) *num_devices = n_real;
      return real_list;
    }

  int n_ours = 0;
  ibv_device **our_list = pcientb_emu_device_list(&n_ours);
  if (our_list == nullptr || n_ours == 0) {
    if (our_list != nullptr) std::free(our_list);
    if (real_list == nullptr) {
      errno = real_errno;
      return nullptr;
    }
    if (num_devices != nullptr) *num_devices = n_real;
    return real_list;  // not registered: ibv_free_device_list passes it through
  }

  // Ours first: programs that take the first device (ibv_rc_pingpong,
  // perftest without -d) should use pcientb0 when run under pcientb-run.
  const size_t n_total = static_cast<size_t>(n_ours) + static_cast<size_t>(n_real);
  // NOLINTNEXTLINE(bugprone-sizeof-expression): an array of pointers
  auto *list = static_cast<ibv_device **>(std::calloc(n_total + 1, sizeof(ibv_device *)));
  bool registered = false;
  if (list != nullptr) {
    std::copy_n(our_list, n_ours, list);
    if (n_real > 0) std::copy_n(real_list, n_real, list + n_ours);
    try {
      const std::lock_guard<std::mutex> guard(registry().lock);
      registry().real_of.emplace(list, real_list);
      registered = true;
    } catch (const std::bad_alloc &) {
      registered = false;
    }
  }
  if (!registered) {
    put_all(our_list);
    std::free(our_list);
    std::free(list);
    if (real_list != nullptr && real_free != nullptr) real_free(real_list);
    errno = ENOMEM;
    return nullptr;
  }
  std::free(our_list);  // its references now live in `list`
  if (num_devices != nullptr) *num_devices = n_ours + n_real;
  return list;
}

PCIENTB_EXPORT void ibv_free_device_list(struct ibv_device **list) {
  auto *real_free = PCIENTB_REAL(ibv_free_device_list, kV1_1);
  if (list == nullptr) return;

  bool found = false;
  ibv_device **real_list = nullptr;
  {
    const std::lock_guard<std::mutex> guard(registry().lock);
    auto it = registry().real_of.find(list);
    if (it != registry().real_of.end()) {
      found = true;
      real_list = it->second;
      registry().real_of.erase(it);
    }
  }
  if (!found) {
    if (real_free != nullptr) real_free(list);
    return;
  }
  for (ibv_device **d = list; *d != nullptr; ++d) {
    if (ours(*d)) pcientb_put_device(*d);
  }
  if (real_list != nullptr && real_free != nullptr) real_free(real_list);
  std::free(list);
}

PCIENTB_EXPORT __be64 ibv_get_device_guid(struct ibv_device *device) {
  if (ours(device)) return pcientb_device_guid(device);
  auto *real = PCIENTB_REAL(ibv_get_device_guid, kV1_1);
  return real != nullptr ? real(device) : 0;
}

PCIENTB_EXPORT int ibv_get_device_index(struct ibv_device *device) {
  if (ours(device)) return pcientb_device_index(device);
  auto *real = PCIENTB_REAL(ibv_get_device_index, kV1_9);
  return real != nullptr ? real(device) : -1;
}

PCIENTB_EXPORT struct ibv_context *ibv_import_device(int cmd_fd) {
  auto *real = PCIENTB_REAL(ibv_import_device, kV1_10);
  if (real == nullptr) {
    errno = EOPNOTSUPP;
    return nullptr;
  }
  // It looks the fd's char device up in ibv_get_device_list(), reading
  // sysfs->sysfs_cdev of every entry: keep ours out of that list.
  const RealDevicesOnly real_only;
  return real(cmd_fd);
}

// --- Completion channels ----------------------------------------------------------

PCIENTB_EXPORT struct ibv_comp_channel *ibv_create_comp_channel(struct ibv_context *context) {
  if (ours(context)) return pcientb_create_comp_channel(context);
  auto *real = PCIENTB_REAL(ibv_create_comp_channel, kV1_0);
  if (real == nullptr) {
    errno = ENOSYS;
    return nullptr;
  }
  return real(context);
}

PCIENTB_EXPORT int ibv_destroy_comp_channel(struct ibv_comp_channel *channel) {
  if (channel != nullptr && pcientb_owns_comp_channel(channel) != 0) {
    return pcientb_destroy_comp_channel(channel);
  }
  auto *real = PCIENTB_REAL(ibv_destroy_comp_channel, kV1_0);
  return real != nullptr ? real(channel) : ENOSYS;
}

// --- GIDs -------------------------------------------------------------------------

PCIENTB_EXPORT int ibv_query_gid(struct ibv_context *context, uint8_t port_num, int index,
                                 union ibv_gid *gid) {
  if (!ours(context)) {
    auto *real = PCIENTB_REAL(ibv_query_gid, kV1_1);
    if (real == nullptr) {
      errno = ENOSYS;
      return -1;
    }
    return real(context, port_num, index, gid);
  }
  if (index < 0) {
    errno = EINVAL;
    return -1;
  }
  ibv_gid_entry entry{};
  const int rc = query_gid_entry(context, port_num, static_cast<uint32_t>(index), &entry);
  if (rc == ENODATA) {  // an empty table slot reads as the zero GID
    std::memset(gid, 0, sizeof(*gid));
    return 0;
  }
  if (rc != 0) {
    errno = rc;
    return -1;
  }
  std::memcpy(gid, &entry.gid, sizeof(*gid));
  return 0;
}

// NOLINTNEXTLINE(bugprone-reserved-identifier): libibverbs' exported name
PCIENTB_EXPORT int _ibv_query_gid_ex(struct ibv_context *context, uint32_t port_num,
                                     uint32_t gid_index, struct ibv_gid_entry *entry,
                                     uint32_t flags, size_t entry_size) {
  if (!ours(context)) {
    auto *real = PCIENTB_REAL(_ibv_query_gid_ex, kV1_11);
    return real != nullptr ? real(context, port_num, gid_index, entry, flags, entry_size)
                           : EOPNOTSUPP;
  }
  if (flags != 0) return EOPNOTSUPP;
  if (entry == nullptr || entry_size == 0) return EINVAL;
  ibv_gid_entry full{};
  const int rc = query_gid_entry(context, port_num, gid_index, &full);
  if (rc != 0) return rc;
  std::memset(entry, 0, entry_size);
  std::memcpy(entry, &full, entry_size < sizeof(full) ? entry_size : sizeof(full));
  return 0;
}

// All non-empty GID entries of all ports, packed at entry_size strides. Returns
// their number or a negative errno value.
// NOLINTNEXTLINE(bugprone-reserved-identifier): libibverbs' exported name
PCIENTB_EXPORT ssize_t _ibv_query_gid_table(struct ibv_context *context,
                                            struct ibv_gid_entry *entries, size_t max_entries,
                                            uint32_t flags, size_t entry_size) {
  if (!ours(context)) {
    auto *real = PCIENTB_REAL(_ibv_query_gid_table, kV1_11);
    return real != nullptr ? real(context, entries, max_entries, flags, entry_size) : -EOPNOTSUPP;
  }
  if (flags != 0) return -EOPNOTSUPP;
  if (entry_size == 0 || (entries == nullptr && max_entries != 0)) return -EINVAL;

  ibv_device_attr dev_attr{};
  const int drc = ibv_query_device(context, &dev_attr);
  if (drc != 0) return -drc;
  size_t count = 0;
  auto *out = reinterpret_cast<unsigned char *>(entries);
  for (uint32_t port = 1; port <= dev_attr.phys_port_cnt; ++port) {
    ibv_port_attr port_attr{};
    const int prc = ibv_query_port(context, static_cast<uint8_t>(port), &port_attr);
    if (prc != 0) return -prc;
    for (int index = 0; index < port_attr.gid_tbl_len; ++index) {
      ibv_gid_entry entry{};
      const int rc = query_gid_entry(context, port, static_cast<uint32_t>(index), &entry);
      if (rc == ENODATA) continue;
      if (rc != 0) return -rc;
      if (count == max_entries) return -EINVAL;  // as the kernel: the table does not fit
      unsigned char *slot = out + count * entry_size;
      std::memset(slot, 0, entry_size);
      std::memcpy(slot, &entry, entry_size < sizeof(entry) ? entry_size : sizeof(entry));
      ++count;
    }
  }
  return static_cast<ssize_t>(count);
}

PCIENTB_EXPORT int ibv_query_gid_type(struct ibv_context *context, uint8_t port_num,
                                      unsigned int index, enum pcientb_gid_type_sysfs *type) {
  if (!ours(context)) {
    auto *real = PCIENTB_REAL(ibv_query_gid_type, kPrivate);
    if (real == nullptr) {
      errno = ENOSYS;
      return -1;
    }
    return real(context, port_num, index, type);
  }
  ibv_gid_entry entry{};
  const int rc = query_gid_entry(context, port_num, index, &entry);
  if (rc == ENODATA) {
    *type = PCIENTB_GID_TYPE_SYSFS_IB_ROCE_V1;
    return 0;
  }
  if (rc != 0) {
    errno = rc;
    return -1;
  }
  *type = entry.gid_type == IBV_GID_TYPE_ROCE_V2 ? PCIENTB_GID_TYPE_SYSFS_ROCE_V2
                                                 : PCIENTB_GID_TYPE_SYSFS_IB_ROCE_V1;
  return 0;
}

// --- P_Keys -----------------------------------------------------------------------

PCIENTB_EXPORT int ibv_query_pkey(struct ibv_context *context, uint8_t port_num, int index,
                                  __be16 *pkey) {
  if (!ours(context)) {
    auto *real = PCIENTB_REAL(ibv_query_pkey, kV1_1);
    if (real == nullptr) {
      errno = ENOSYS;
      return -1;
    }
    return real(context, port_num, index, pkey);
  }
  const int rc = pcientb_query_pkey(context, port_num, index, pkey);
  if (rc != 0) {
    errno = rc;
    return -1;
  }
  return 0;
}

PCIENTB_EXPORT int ibv_get_pkey_index(struct ibv_context *context, uint8_t port_num, __be16 pkey) {
  if (!ours(context)) {
    auto *real = PCIENTB_REAL(ibv_get_pkey_index, kV1_5);
    if (real == nullptr) {
      errno = ENOSYS;
      return -1;
    }
    return real(context, port_num, pkey);
  }
  constexpr int kMaxPkeyTable = 1 << 16;
  for (int index = 0; index < kMaxPkeyTable; ++index) {
    __be16 value = 0;
    const int rc = pcientb_query_pkey(context, port_num, index, &value);
    if (rc != 0) {
      errno = rc;
      return -1;
    }
    if (value == pkey) return index;
  }
  errno = ENOENT;
  return -1;
}

// --- Device nodes (glibc) -------------------------------------------------------

PCIENTB_EXPORT int stat(const char *path, struct stat *st) {
  auto *real = PCIENTB_REAL(stat, kGlibc2_33);
  return stat_or_fake(path, st, [&] { return real != nullptr ? real(path, st) : -1; });
}

PCIENTB_EXPORT int stat64(const char *path, struct stat64 *st) {
  auto *real = PCIENTB_REAL(stat64, kGlibc2_33);
  return stat_or_fake(path, st, [&] { return real != nullptr ? real(path, st) : -1; });
}

// Programs built against glibc < 2.33 call these for stat().
// NOLINTNEXTLINE(bugprone-reserved-identifier): glibc's exported name
PCIENTB_EXPORT int __xstat(int ver, const char *path, struct stat *st) {
  using Fn = int(int, const char *, struct stat *);
  static Fn *const real = next_symbol<Fn>("__xstat", kGlibc2_2_5);
  return stat_or_fake(path, st, [&] { return real != nullptr ? real(ver, path, st) : -1; });
}

// NOLINTNEXTLINE(bugprone-reserved-identifier): glibc's exported name
PCIENTB_EXPORT int __xstat64(int ver, const char *path, struct stat64 *st) {
  using Fn = int(int, const char *, struct stat64 *);
  static Fn *const real = next_symbol<Fn>("__xstat64", kGlibc2_2_5);
  return stat_or_fake(path, st, [&] { return real != nullptr ? real(ver, path, st) : -1; });
}

PCIENTB_EXPORT int access(const char *path, int mode) {
  auto *real = PCIENTB_REAL(access, kGlibc2_2_5);
  const int rc = real != nullptr ? real(path, mode) : -1;
  if (rc == 0 || errno != ENOENT || pcientb_device_node_index(path) < 0) return rc;
  if (mode & X_OK) {
    errno = EACCES;
    return -1;
  }
  return 0;
}

}  // extern "C"
