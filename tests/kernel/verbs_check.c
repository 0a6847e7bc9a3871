/*
 * The verbs devices of pcientb.ko as a program sees them through libibverbs and the
 * provider, inside the tier-1 guest (tier1.py runs it in a chroot of the host's root).
 *
 *   verbs_check devices N
 *       every pcientb device: opens it (the provider bound it), checks what device, port,
 *       GID and P_Key queries answer, allocates and frees a PD, registers memory regions
 *       (pinned while registered, keys, rights, bad addresses: check_mrs), moves bytes
 *       between two nodes' regions with pcientb.ko's move (check_moves), the nodes' areas,
 *       node table, doorbells and watchers (check_nodes), the data path through the
 *       provider's engine (check_loopback); a second context of the device is another node
 *       (another LID, in the same port's half of the LID space); expects N devices with
 *       distinct GUIDs, whose ports' LIDs are in different halves; with two, the nodes of
 *       one port reach those of the other across the bridge (check_bridge, check_moves).
 *   verbs_check events DEVICE N SECONDS READY_FILE
 *       opens DEVICE, registers 64 KiB, creates READY_FILE, then prints the device's async
 *       events until N arrived, DEVICE_FATAL (the last there is) or SECONDS passed; after
 *       DEVICE_FATAL the region is unpinned and its deregistration succeeds.
 *   verbs_check across DEVICE a|b DIR
 *       tier 2, one side on each host: an RC QP between them, set up through files in DIR
 *       (a directory both guests share); each WRITEs 64 KiB into the other's region, SENDs,
 *       finds the other's bytes in its own region and READs its own back ("across ok").
 *       Then a streams 64 KiB WRITEs until one completes with an error (the host kills b's
 *       guest): "across error STATUS after N writes"; b waits to be killed.
 *
 * Prints one line per finding ("FAIL ..." for a failed check); exit 0 when all passed.
 */
#include <endian.h>
#include <errno.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <poll.h>
#include <rdma/ib_user_ioctl_cmds.h>
#include <rdma/ib_user_verbs.h>
#include <rdma/rdma_user_ioctl_cmds.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "pcientb-abi.h"

static int failures;

static void fail(const char *dev, const char *what, int err) {
  printf("FAIL %s: %s%s%s\n", dev, what, err ? ": " : "", err ? strerror(err) : "");
  failures++;
}

// This process's pinned memory in KiB (what registrations pin), -1 if unknown.
static long pinned_kib(void) {
  FILE *f = fopen("/proc/self/status", "r");
  char line[256];
  long kib = -1;

  while (f && fgets(line, sizeof line, f))
    if (sscanf(line, "VmPin: %ld kB", &kib) == 1) break;
  if (f) fclose(f);
  return kib;
}

// The pages pinned must be `want` KiB more than `base`.
static void check_pinned(const char *dev, const char *when, long base, long want) {
  const long now_kib = pinned_kib();
  if (now_kib - base != want) {
    printf("FAIL %s: %s: %ld KiB pinned, expected %ld\n", dev, when, now_kib - base, want);
    failures++;
  }
}

// pcientb.ko's own objects, as the kernel fabric uses them: a uverbs context of the
// device opened directly (GET_CONTEXT: a node with its LID, nonce and area), a PD, and
// memory regions, by the core's legacy write() commands. (Through libibverbs the
// provider's engine owns the contexts: these check what the module itself does.)
struct kctx {
  const char *name;
  int cmd_fd;
  int async_fd;
  uint32_t pd;
  struct pcientb_ucontext_resp info;
};

struct kmr {
  struct kctx *ctx;
  uint32_t handle, lkey, rkey;
  void *addr;
  size_t length;
};

// One uverbs write() command: 0 or an errno value.
static int kcmd(int fd, uint32_t command, const void *cmd, size_t len, size_t resp_len) {
  struct ib_uverbs_cmd_hdr hdr = {.command = command,
                                  .in_words = (uint16_t)((sizeof hdr + len) / 4),
                                  .out_words = (uint16_t)(resp_len / 4)};
  char buf[256];

  memcpy(buf, &hdr, sizeof hdr);
  memcpy(buf + sizeof hdr, cmd, len);
  const ssize_t n = write(fd, buf, sizeof hdr + len);
  return n == (ssize_t)(sizeof hdr + len) ? 0 : n < 0 ? errno : EIO;
}

// The node table's size, in whole pages.
#define TABLE_BYTES \
  ((2 * PCIENTB_LIDS_PER_PORT * sizeof(struct pcientb_node_entry) + 4095) & ~(size_t)4095)
// The engine layout this program's raw contexts give (the table publishes it).
#define KCHECK_LAYOUT 0x6b636b31u

// A raw context of `d`: a node of its own (flags 0), or none (PCIENTB_UCONTEXT_NO_NODE: no
// area, LID or doorbell; what is read-only mapped, such as the node table, it maps too).
static struct kctx *kopen_flags(struct ibv_device *d, uint32_t flags) {
  struct kctx *k = calloc(1, sizeof *k);
  char path[128];
  struct {
    struct ib_uverbs_get_context_resp core;
    struct pcientb_ucontext_resp info;
  } r;
  struct {  // the command, then its driver data
    struct ib_uverbs_get_context core;
    struct pcientb_ucontext_req req;
  } gc = {.core = {.response = (uintptr_t)&r}, .req = {.flags = flags, .layout = KCHECK_LAYOUT}};
  struct ib_uverbs_alloc_pd_resp pr;
  struct ib_uverbs_alloc_pd ap = {.response = (uintptr_t)&pr};
  int err;

  if (!k) return NULL;
  k->name = ibv_get_device_name(d);
  snprintf(path, sizeof path, "/dev/infiniband/%s", d->dev_name);
  k->cmd_fd = open(path, O_RDWR | O_CLOEXEC);
  k->async_fd = -1;
  memset(&r, 0, sizeof r);
  err = k->cmd_fd < 0 ? errno
                      : kcmd(k->cmd_fd, IB_USER_VERBS_CMD_GET_CONTEXT, &gc, sizeof gc, sizeof r);
  if (!err) {
    k->async_fd = (int)r.core.async_fd;
    k->info = r.info;
    err = kcmd(k->cmd_fd, IB_USER_VERBS_CMD_ALLOC_PD, &ap, sizeof ap, sizeof pr);
    k->pd = pr.pd_handle;
  }
  if (err) {
    if (k->cmd_fd >= 0) close(k->cmd_fd);
    if (k->async_fd >= 0) close(k->async_fd);
    free(k);
    errno = err;
    return NULL;
  }
  return k;
}

static struct kctx *kopen(struct ibv_device *d) {
  return kopen_flags(d, 0);
}

static void kclose(struct kctx *k) {
  close(k->async_fd);
  close(k->cmd_fd);
  free(k);
}

static struct kmr *kreg_mr(struct kctx *k, void *addr, size_t len, int access) {
  struct ib_uverbs_reg_mr_resp r;
  struct ib_uverbs_reg_mr cmd = {.response = (uintptr_t)&r,
                                 .start = (uintptr_t)addr,
                                 .length = len,
                                 .hca_va = (uintptr_t)addr,
                                 .pd_handle = k->pd,
                                 .access_flags = (uint32_t)access};
  struct kmr *mr = calloc(1, sizeof *mr);
  int err = mr ? kcmd(k->cmd_fd, IB_USER_VERBS_CMD_REG_MR, &cmd, sizeof cmd, sizeof r) : ENOMEM;

  if (err) {
    free(mr);
    errno = err;
    return NULL;
  }
  *mr = (struct kmr){k, r.mr_handle, r.lkey, r.rkey, addr, len};
  return mr;
}

static int kdereg_mr(struct kmr *mr) {
  struct ib_uverbs_dereg_mr cmd = {.mr_handle = mr->handle};
  int err = kcmd(mr->ctx->cmd_fd, IB_USER_VERBS_CMD_DEREG_MR, &cmd, sizeof cmd, 0);

  if (!err) free(mr);
  return err;
}

static int kdealloc_pd(struct kctx *k) {
  struct ib_uverbs_dealloc_pd cmd = {.pd_handle = k->pd};
  return kcmd(k->cmd_fd, IB_USER_VERBS_CMD_DEALLOC_PD, &cmd, sizeof cmd, 0);
}

// A registration that must fail with `want`.
static void check_refused(struct kctx *pd, void *addr, size_t len, int access, int want,
                          const char *what) {
  struct kmr *mr;

  errno = 0;
  mr = kreg_mr(pd, addr, len, access);
  if (mr) {
    printf("FAIL %s: %s was registered\n", pd->name, what);
    failures++;
    kdereg_mr(mr);
  } else if (errno != want) {
    printf("FAIL %s: %s: %s, expected %s\n", pd->name, what, strerror(errno), strerror(want));
    failures++;
  }
}

#define ALL_RIGHTS                                                             \
  (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | \
   IBV_ACCESS_REMOTE_ATOMIC)

// Memory regions: a registration pins its pages until it is deregistered (or its context
// closes), its lkey = rkey is a key of its own (one kept after deregistration names no
// later region), read-only memory registers for remote reads, and what cannot be
// registered is refused with the errno a user expects.
static void check_mrs(struct ibv_device *d) {
  const char *name = ibv_get_device_name(d);
  const size_t len = 1 << 20;
  const long base = pinned_kib();
  char *buf = malloc(len);
  struct kctx *pd = kopen(d);
  struct kmr *a, *b, *c;

  if (!buf || !pd || base < 0) {
    fail(name, "a context, a buffer and VmPin in /proc/self/status", errno);
    free(buf);
    if (pd) kclose(pd);
    return;
  }
  memset(buf, 1, len);
  a = kreg_mr(pd, buf, len, ALL_RIGHTS);
  if (!a) {
    fail(name, "registering of 1 MiB", errno);
    free(buf);
    kclose(pd);
    return;
  }
  if (a->lkey != a->rkey || a->lkey < 256 || a->addr != buf || a->length != len) {
    printf("FAIL %s: region lkey %#x rkey %#x addr %p length %zu\n", name, a->lkey, a->rkey,
           a->addr, a->length);
    failures++;
  }
  /* The buffer's pages, whole: malloc's 1 MiB need not start on a page. */
  const long pages_kib =
      (long)((((uintptr_t)buf + len + 4095) & ~4095UL) - ((uintptr_t)buf & ~4095UL)) / 1024;
  check_pinned(name, "1 MiB registered", base, pages_kib);
  b = kreg_mr(pd, buf, len, IBV_ACCESS_LOCAL_WRITE);
  if (!b)
    fail(name, "a second ibv_reg_mr of the same buffer", errno);
  else if (b->lkey == a->lkey)
    fail(name, "two regions have the same key", 0);
  errno = 0;
  if (kdealloc_pd(pd) != EBUSY) fail(name, "a PD with regions was freed (EBUSY expected)", 0);
  const uint32_t old_a = a->lkey, old_b = b ? b->lkey : 0;
  if (kdereg_mr(a)) fail(name, "deregistering", errno);
  if (b && kdereg_mr(b)) fail(name, "deregistering of the second", errno);
  check_pinned(name, "both regions deregistered", base, 0);
  c = kreg_mr(pd, buf, len, IBV_ACCESS_REMOTE_READ);
  if (!c)
    fail(name, "registering after deregistration", errno);
  else if (c->lkey == old_a || c->lkey == old_b)
    fail(name, "a new region took a key that was deregistered", 0);
  if (c) kdereg_mr(c);

  /* Read-only memory registers for local reads and remote reads, not for writes. */
  char *ro = mmap(NULL, 65536, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (ro == MAP_FAILED) {
    fail(name, "mmap", errno);
  } else {
    c = kreg_mr(pd, ro, 65536, IBV_ACCESS_REMOTE_READ);
    if (!c)
      fail(name, "registering of read-only memory for remote reads", errno);
    else
      kdereg_mr(c);
    check_refused(pd, ro, 65536, IBV_ACCESS_LOCAL_WRITE, EFAULT,
                  "read-only memory for local writes");
    munmap(ro, 65536);
    check_refused(pd, ro, 65536, IBV_ACCESS_REMOTE_READ, EFAULT, "unmapped memory");
  }
  check_refused(pd, buf, len, IBV_ACCESS_REMOTE_WRITE, EINVAL, "remote write without local write");
  check_refused(pd, buf, len, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_MW_BIND, EOPNOTSUPP,
                "a region for memory windows");
  check_pinned(name, "after the refused registrations", base, 0);

  /* A context that closes with regions registered unpins them. */
  struct kctx *ctx = kopen(d);
  struct kctx *pd2 = ctx;
  if (!pd2 || !kreg_mr(pd2, buf, len, IBV_ACCESS_LOCAL_WRITE))
    fail(name, "a region of another context", errno);
  else
    check_pinned(name, "another context's region", base, pages_kib);
  if (ctx) kclose(ctx);
  check_pinned(name, "a context closed with a region", base, 0);
  if (kdealloc_pd(pd)) fail(name, "freeing the PD", errno);
  kclose(pd);
  free(buf);
}

// pcientb.ko's move (uapi/pcientb-abi.h) issued by `ctx`: 0 or an errno value.
// A driver method of pcientb.ko (uapi/pcientb-abi.h) issued by `ctx`, with its command
// (`in`) and, if `out`, a response: 0 or an errno value. (An attribute of 8 bytes or less
// travels in the attribute itself.)
static int method(struct kctx *ctx, uint16_t id, const void *in, uint16_t in_len, void *out,
                  uint16_t out_len) {
  struct {
    struct ib_uverbs_ioctl_hdr hdr;
    struct ib_uverbs_attr attr[2];
  } req;

  memset(&req, 0, sizeof req);
  req.hdr.length = sizeof req.hdr + (out ? 2 : 1) * sizeof(struct ib_uverbs_attr);
  req.hdr.object_id = UVERBS_OBJECT_DEVICE;
  req.hdr.method_id = id;
  req.hdr.num_attrs = out ? 2 : 1;
  req.hdr.driver_id = PCIENTB_DRIVER_ID;
  req.attr[0].attr_id = 1U << 12;  // the command: each method's first attribute
  req.attr[0].len = in_len;
  req.attr[0].flags = UVERBS_ATTR_F_MANDATORY;
  if (in_len <= 8)
    memcpy(&req.attr[0].data, in, in_len);
  else
    req.attr[0].data = (uintptr_t)in;
  req.attr[1].attr_id = (1U << 12) + 1;  // the response
  req.attr[1].len = out_len;
  req.attr[1].flags = UVERBS_ATTR_F_MANDATORY;
  req.attr[1].data = (uintptr_t)out;
  return ioctl(ctx->cmd_fd, RDMA_VERBS_IOCTL, &req) ? errno : 0;
}

static int move(struct kctx *ctx, uint32_t lid, uint32_t window, uint64_t raddr, void *addr,
                uint64_t length, uint32_t dir) {
  struct pcientb_move cmd = {.lid = lid,
                             .window = window,
                             .raddr = raddr,
                             .addr = (uintptr_t)addr,
                             .length = length,
                             .dir = dir};
  return method(ctx, PCIENTB_METHOD_MOVE, &cmd, sizeof cmd, NULL, 0);
}

static void check_move(const char *dev, const char *what, int got, int want) {
  if (got != want) {
    printf("FAIL %s: move %s: %s, expected %s\n", dev, what, got ? strerror(got) : "done",
           want ? strerror(want) : "done");
    failures++;
  }
}

static uint16_t lid_of(struct kctx *ctx) {
  return (uint16_t)ctx->info.lid;
}

static int table_says(const struct pcientb_node_entry *table, uint32_t lid, uint64_t nonce,
                      int alive, double seconds);
static void *map(struct kctx *ctx, size_t len, int prot, int flags, unsigned long page);

// Two nodes, of one device or across the bridge (A on `da`, B on `db`): B writes into
// and reads from A's region through the kernel's move, which checks that the region is
// A's, its bounds and rights; and refuses what names no region (a wrong key, another
// node, a region deregistered or of a closed node).
static void check_moves(struct ibv_device *da, struct ibv_device *db) {
  const char *name = ibv_get_device_name(db);
  enum { kRegion = 200000, kLen = 70000, kAt = 5000 };
  struct kctx *a = kopen(da), *b = kopen(db);
  struct kctx *pa = a;
  char *abuf = calloc(1, kRegion + 100), *region = abuf + 100;  // not page-aligned
  char *rbuf = calloc(1, 4096), *src = malloc(kLen), *dst = malloc(kLen);
  struct kmr *mr = NULL, *ro = NULL;
  int i;

  if (!b || !pa || !abuf || !rbuf || !src || !dst) {
    fail(name, "two contexts, a PD and buffers", errno);
    goto out;
  }
  mr = kreg_mr(pa, region, kRegion,
               IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
  ro = kreg_mr(pa, rbuf, 4096, IBV_ACCESS_REMOTE_READ);
  if (!mr || !ro) {
    fail(name, "regions for the moves", errno);
    goto out;
  }
  const uint16_t la = lid_of(a), lb = lid_of(b);
  const uint64_t base = (uintptr_t)region;
  if (da != db) {  // B's host learns of A a moment after A came
    const struct pcientb_node_entry *table =
        map(b, TABLE_BYTES, PROT_READ, MAP_SHARED, PCIENTB_MMAP_TABLE);
    if (table == MAP_FAILED || !table_says(table, la, a->info.nonce, 1, 5))
      fail(name, "node A does not show alive across the bridge", errno);
    if (table != MAP_FAILED) munmap((void *)table, TABLE_BYTES);
  }
  for (i = 0; i < kLen; i++) src[i] = (char)(i * 13 + 1);
  memset(rbuf, 0x5a, 4096);

  check_move(name, "into A's region", move(b, la, mr->rkey, base + kAt, src, kLen, 0), 0);
  if (memcmp(region + kAt, src, kLen) != 0 || region[kAt - 1] || region[kAt + kLen])
    fail(name, "the move did not land exactly where it was aimed", 0);
  check_move(name, "out of A's region", move(b, la, mr->rkey, base + kAt, dst, kLen, 1), 0);
  if (memcmp(dst, src, kLen) != 0) fail(name, "the read did not bring the bytes back", 0);
  check_move(name, "by A into its own region", move(a, la, mr->rkey, base, src, 10, 0), 0);
  check_move(name, "out of a region without remote read",
             move(b, la, ro->rkey, (uintptr_t)rbuf, dst, 4096, 1), 0);
  if (memcmp(dst, rbuf, 4096) != 0) fail(name, "the read-only region's bytes", 0);

  check_move(name, "with a wrong key", move(b, la, mr->rkey ^ 1, base, src, 8, 0), ENOENT);
  check_move(name, "to another node", move(b, lb, mr->rkey, base, src, 8, 0), ENOENT);
  check_move(name, "past the end", move(b, la, mr->rkey, base + kRegion - 4, src, 8, 0), ERANGE);
  check_move(name, "before the start", move(b, la, mr->rkey, base - 1, src, 8, 1), ERANGE);
  check_move(name, "of nothing", move(b, la, mr->rkey, base, src, 0, 0), EINVAL);
  check_move(name, "of a bad direction", move(b, la, mr->rkey, base, src, 8, 7), EINVAL);
  check_move(name, "into a region without remote write",
             move(b, la, ro->rkey, (uintptr_t)rbuf, src, 8, 0), EACCES);
  check_move(name, "from a bad address", move(b, la, mr->rkey, base, (void *)16, 8, 0), EFAULT);
  if (rbuf[0] != 0x5a) fail(name, "a refused move changed the region", 0);

  const uint32_t key = mr->rkey;
  if (kdereg_mr(mr)) fail(name, "deregistering", errno);
  mr = NULL;
  check_move(name, "into a deregistered region", move(b, la, key, base, src, 8, 0), ENOENT);
  const uint32_t ro_key = ro->rkey;
  kclose(a);  // its regions go with it
  a = NULL;
  ro = NULL;
  check_move(name, "out of a closed node's region", move(b, la, ro_key, (uintptr_t)rbuf, dst, 8, 1),
             ENOENT);
out:
  if (mr) kdereg_mr(mr);
  if (ro) kdereg_mr(ro);
  if (a) kclose(a);
  if (b) kclose(b);
  free(abuf);
  free(rbuf);
  free(src);
  free(dst);
}

static int ring(struct kctx *ctx, uint32_t lid) {
  struct pcientb_ring cmd = {.lid = lid};
  return method(ctx, PCIENTB_METHOD_RING, &cmd, sizeof cmd, NULL, 0);
}

static int set_doorbell(struct kctx *ctx, int fd) {
  struct pcientb_doorbell cmd = {.fd = fd};
  return method(ctx, PCIENTB_METHOD_DOORBELL, &cmd, sizeof cmd, NULL, 0);
}

// A watcher of node `lid` of incarnation `nonce` (-1 and errno on failure).
static int watch(struct kctx *ctx, uint32_t lid, uint64_t nonce) {
  struct pcientb_watch cmd = {.lid = lid, .nonce = nonce};
  struct pcientb_watch_resp resp = {.fd = -1};
  int err = method(ctx, PCIENTB_METHOD_WATCH, &cmd, sizeof cmd, &resp, sizeof resp);
  errno = err;
  return err ? -1 : resp.fd;
}

static double now(void) {
  struct timespec t;

  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

// Whether `fd` polls readable within `ms`.
static int readable(int fd, int ms) {
  struct pollfd p = {.fd = fd, .events = POLLIN};
  return poll(&p, 1, ms) == 1 && (p.revents & POLLIN);
}

static void *map(struct kctx *ctx, size_t len, int prot, int flags, unsigned long page) {
  return mmap(NULL, len, prot, flags, ctx->cmd_fd, (off_t)(page * 4096));
}

static void check_map_refused(const char *dev, const char *what, void *p, int want) {
  if (p != MAP_FAILED) {
    printf("FAIL %s: %s was mapped\n", dev, what);
    failures++;
  } else if (errno != want) {
    printf("FAIL %s: %s: %s, expected %s\n", dev, what, strerror(errno), strerror(want));
    failures++;
  }
}

static int post(struct kctx *ctx, uint32_t lid, uint64_t off, const void *buf, size_t len) {
  struct pcientb_post cmd = {.lid = lid, .offset = off, .addr = (uintptr_t)buf, .length = len};
  return method(ctx, PCIENTB_METHOD_POST, &cmd, sizeof cmd, NULL, 0);
}

// Whether node `lid` reads alive in `table` (with `nonce`, if not 0) within `seconds`:
// what the peer host's module publishes arrives by its doorbell, a moment later.
static int table_says(const struct pcientb_node_entry *table, uint32_t lid, uint64_t nonce,
                      int alive, double seconds) {
  const double end = now() + seconds;
  do {
    const int live = __atomic_load_n(&table[lid].life, __ATOMIC_ACQUIRE) != 0 &&
                     (!nonce || __atomic_load_n(&table[lid].nonce, __ATOMIC_ACQUIRE) == nonce);
    if (live == alive) return 1;
    usleep(10 * 1000);
  } while (now() < end);
  return 0;
}

// Across the bridge: a node of one port and a node of its peer port (the other "host").
// Each sees the other in its node table; posts (PCIENTB_METHOD_POST, or stores into a
// mapping of its area's chunks through the window) land in the other's area; rings wake
// its doorbell; a watcher wakes when it goes, and the mappings of it are emptied then.
static void check_bridge(struct ibv_device *da, struct ibv_device *db) {
  const char *name = ibv_get_device_name(da);
  struct kctx *a = kopen(da), *b = kopen(db);
  const struct pcientb_node_entry *table = MAP_FAILED;
  char *own = MAP_FAILED, *rem[2] = {MAP_FAILED, MAP_FAILED};
  size_t area_size = 0;
  int efd = eventfd(0, EFD_NONBLOCK), w = -1;
  uint64_t count = 0;
  char msg[300];

  if (!a || !b || efd < 0) {
    fail(name, "a context on each of two ports, and an eventfd", errno);
    goto out;
  }
  const uint16_t la = lid_of(a), lb = lid_of(b);
  area_size = a->info.area_size;
  table = map(b, TABLE_BYTES, PROT_READ, MAP_SHARED, PCIENTB_MMAP_TABLE);
  own = map(a, a->info.area_size, PROT_READ | PROT_WRITE, MAP_SHARED, PCIENTB_MMAP_AREA);
  if (table == MAP_FAILED || own == MAP_FAILED) {
    fail(name, "mapping B's node table and A's area", errno);
    goto out;
  }
  if (!table_says(table, la, a->info.nonce, 1, 5)) {
    printf("FAIL %s: the node table of %s does not show node %u of the other port alive\n", name,
           ibv_get_device_name(db), la);
    failures++;
    goto out;
  }
  check_map_refused(name, "a node across the bridge whole",
                    map(b, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, PCIENTB_MMAP_PEER(la)),
                    EREMOTE);
  // Its area by chunks, write-combined through the window: stores land in A's area.
  const size_t chunk = b->info.chunk_bytes;
  const uint32_t chunks = table[la].chunks;
  if (table[la].layout != KCHECK_LAYOUT) {
    printf("FAIL %s: the table says layout %08x for a node across the bridge, not %08x\n", name,
           table[la].layout, KCHECK_LAYOUT);
    failures++;
  }
  if (!chunk || chunks != a->info.area_size / chunk || chunks < 2) {
    printf("FAIL %s: the table says %u chunks of %zu bytes for an area of %llu\n", name, chunks,
           chunk, (unsigned long long)a->info.area_size);
    failures++;
    goto out;
  }
  check_map_refused(name, "a chunk across the bridge, not whole",
                    map(b, 4096, PROT_WRITE, MAP_SHARED, PCIENTB_MMAP_REMOTE(la, 0)), EINVAL);
  check_map_refused(name, "a chunk across the bridge, private",
                    map(b, chunk, PROT_WRITE, MAP_PRIVATE, PCIENTB_MMAP_REMOTE(la, 0)), EINVAL);
  check_map_refused(name, "a chunk past the area across the bridge",
                    map(b, chunk, PROT_WRITE, MAP_SHARED, PCIENTB_MMAP_REMOTE(la, chunks)), EINVAL);
  check_map_refused(name, "a node of its own host by chunks",
                    map(b, chunk, PROT_WRITE, MAP_SHARED, PCIENTB_MMAP_REMOTE(lb, 0)), EINVAL);
  check_map_refused(name, "a chunk of a LID no node has",
                    map(b, chunk, PROT_WRITE, MAP_SHARED, PCIENTB_MMAP_REMOTE((la & 512) | 511, 0)),
                    ENOENT);
  for (int i = 0; i < 2; i++) {
    rem[i] = map(b, chunk, PROT_READ | PROT_WRITE, MAP_SHARED, PCIENTB_MMAP_REMOTE(la, i));
    if (rem[i] == MAP_FAILED) {
      fail(name, "mapping a chunk of a node across the bridge", errno);
      goto out;
    }
  }
  // A forked child does not inherit them (its pages would outlive the parent's record).
  pid_t child = fork();
  if (child == 0) {
    unsigned char v;
    _exit(mincore(rem[0], 4096, &v) == -1 && errno == ENOMEM ? 0 : 1);
  }
  int status = -1;
  if (child < 0 || waitpid(child, &status, 0) != child || !WIFEXITED(status) ||
      WEXITSTATUS(status) != 0)
    fail(name, "a forked child has the mapping of a node across the bridge", 0);
  for (int i = 0; i < 2; i++) memcpy(rem[i] + 8 * i + 1, msg + 5, 100);
  __builtin_ia32_sfence();
  for (int i = 0; i < 2; i++)
    if (memcmp(own + i * chunk + 8 * i + 1, msg + 5, 100) != 0) {
      printf("FAIL %s: stores into chunk %d mapped across the bridge are not in A's area\n", name,
             i);
      failures++;
    }
  // Posts: bytes of every alignment, across a chunk's end (4 MiB), and a whole piece.
  for (size_t i = 0; i < sizeof msg; i++) msg[i] = (char)(i * 7 + 1);
  const uint64_t at[] = {4096 + 3, (4u << 20) - 150, 65536};
  for (int i = 0; i < 3; i++)
    if (post(b, la, at[i], msg, sizeof msg)) fail(name, "a post across the bridge", errno);
  for (int i = 0; i < 3; i++)
    if (memcmp(own + at[i], msg, sizeof msg) != 0) {
      printf("FAIL %s: a post across the bridge at %llu is not in A's area\n", name,
             (unsigned long long)at[i]);
      failures++;
    }
  if (post(b, la, a->info.area_size - 8, msg, 16) != EFAULT)
    fail(name, "a post past the area's end did not fail (EFAULT)", 0);
  if (post(b, lb, 0, msg, 8) != EINVAL)
    fail(name, "a post to a node of its own host did not fail (EINVAL)", 0);
  if (post(b, (la & 512) | 511, 0, msg, 8) != ENOENT)
    fail(name, "a post to a LID no node has did not fail (ENOENT)", 0);
  // Rings.
  if (set_doorbell(a, efd)) fail(name, "PCIENTB_METHOD_DOORBELL", errno);
  if (ring(b, la)) fail(name, "ringing across the bridge", errno);
  if (!readable(efd, 5000) || read(efd, &count, sizeof count) != sizeof count || !count)
    fail(name, "a ring across the bridge did not reach the node's doorbell within 5 s", 0);
  // A watcher across the bridge, and the table, when A goes.
  w = watch(b, la, a->info.nonce);
  if (w < 0) {
    fail(name, "watching a node across the bridge", errno);
    goto out;
  }
  if (readable(w, 0)) fail(name, "a watcher of a live node across the bridge is readable", 0);
  // A's area stays mapped here: its pages stay too, and show a store that still reaches them.
  kclose(a);
  a = NULL;
  if (!readable(w, 5000)) fail(name, "a watcher across the bridge was not woken within 5 s", 0);
  if (!table_says(table, la, 0, 0, 5))
    fail(name, "the node table still shows a node gone across the bridge", 0);
  if (post(b, la, 0, msg, 8) != ENOENT || ring(b, la) != ENOENT)
    fail(name, "a post or ring to a node gone across the bridge did not fail (ENOENT)", 0);
  // Its mappings were emptied before the peer could reuse the area (the table says gone
  // first, the emptying follows at once): a store now lands in a page of this file's.
  usleep(200 * 1000);
  for (int i = 0; i < 2; i++) {
    memcpy(rem[i] + 8 * i + 1, msg + 50, 100);
    __builtin_ia32_sfence();
    if (memcmp(own + i * chunk + 8 * i + 1, msg + 50, 100) == 0)
      fail(name, "a store into the mapping of a node gone across the bridge reached its area", 0);
    if (memcmp(rem[i] + 8 * i + 1, msg + 50, 100) != 0)
      fail(name, "a store into the mapping of a node gone did not stay in its page", 0);
  }
  check_map_refused(name, "a chunk of a node gone across the bridge",
                    map(b, chunk, PROT_WRITE, MAP_SHARED, PCIENTB_MMAP_REMOTE(la, 0)), ENOENT);
out:
  for (int i = 0; i < 2; i++)
    if (rem[i] != MAP_FAILED) munmap(rem[i], b->info.chunk_bytes);
  if (w >= 0) close(w);
  if (efd >= 0) close(efd);
  if (own != MAP_FAILED) munmap(own, area_size);
  if (table != MAP_FAILED) munmap((void *)table, TABLE_BYTES);
  if (a) kclose(a);
  if (b) kclose(b);
}

// The nodes of one device: each node's area, mapped by itself and by its peers (what one
// writes the other reads, a new one reads as zeros), the node table (read-only:
// alive and nonce of each LID), doorbells (a ring counts one on the node's eventfd) and
// watchers (readable once the node they watch is gone, at once for one already gone).
static void check_nodes(struct ibv_device *d) {
  const char *name = ibv_get_device_name(d);
  const size_t len = 1 << 20;
  struct kctx *a = kopen(d), *b = kopen(d);
  const struct pcientb_node_entry *table = MAP_FAILED;
  char *own = MAP_FAILED, *peer = MAP_FAILED;
  int efd = eventfd(0, EFD_NONBLOCK), w = -1, w_old = -1;
  uint64_t count = 0;

  if (!a || !b || efd < 0) {
    fail(name, "two contexts and an eventfd", errno);
    goto out;
  }
  const uint16_t la = lid_of(a), lb = lid_of(b);
  table = map(b, TABLE_BYTES, PROT_READ, MAP_SHARED, PCIENTB_MMAP_TABLE);
  if (table == MAP_FAILED) {
    fail(name, "mapping the node table", errno);
    goto out;
  }
  const uint64_t nonce_a = table[la].nonce;
  if (!table[la].life || !table[lb].life || !nonce_a || nonce_a == table[lb].nonce ||
      table[la].life != ((uint32_t)nonce_a | 1) || table[1023].life ||
      table[la].layout != KCHECK_LAYOUT) {
    printf("FAIL %s: node table: LID %u life %#x nonce %#llx layout %08x, LID %u life %#x\n", name,
           la, table[la].life, (unsigned long long)nonce_a, table[la].layout, lb, table[lb].life);
    failures++;
  }
  check_map_refused(name, "the node table for writing",
                    map(b, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, PCIENTB_MMAP_TABLE), EPERM);

  own = map(a, len, PROT_READ | PROT_WRITE, MAP_SHARED, PCIENTB_MMAP_AREA);
  peer = map(b, len, PROT_READ | PROT_WRITE, MAP_SHARED, PCIENTB_MMAP_PEER(la));
  if (own == MAP_FAILED || peer == MAP_FAILED) {
    fail(name, "mapping A's area by A and by B", errno);
    goto out;
  }
  // A new node's area is zeroed memory (the module allocates it whole).
  for (size_t i = 0; i < len; i += 4096 - 8)
    if (own[i] != 0) {
      fail(name, "A's new area holds data that A did not write", 0);
      break;
    }
  strcpy(own + 12345, "from A");
  strcpy(peer + 500000, "from B");
  if (strcmp(peer + 12345, "from A") != 0 || strcmp(own + 500000, "from B") != 0)
    fail(name, "A's area is not the same memory for A and for B", 0);
  check_map_refused(name, "an area mapped privately",
                    map(b, 4096, PROT_READ, MAP_PRIVATE, PCIENTB_MMAP_PEER(la)), EINVAL);
  check_map_refused(name, "past the area's end",
                    map(b, a->info.area_size + 4096, PROT_READ, MAP_SHARED, PCIENTB_MMAP_PEER(la)),
                    EINVAL);
  check_map_refused(name, "the area of a LID no node has",
                    map(b, 4096, PROT_READ, MAP_SHARED, PCIENTB_MMAP_PEER(1023)), ENOENT);

  if (set_doorbell(a, efd)) fail(name, "PCIENTB_METHOD_DOORBELL", errno);
  if (ring(b, la) || ring(b, la)) fail(name, "ringing A", errno);
  if (read(efd, &count, sizeof count) != sizeof count || count != 2) {
    printf("FAIL %s: A's doorbell counted %llu rings, expected 2\n", name,
           (unsigned long long)count);
    failures++;
  }
  if (ring(b, 1023) != ENOENT) fail(name, "ringing a LID no node has did not fail (ENOENT)", 0);
  if (set_doorbell(a, -1) || ring(b, la) || readable(efd, 0))
    fail(name, "a ring after the doorbell was taken back", 0);

  w = watch(b, la, nonce_a);
  w_old = watch(b, la, nonce_a ^ 1);
  if (w < 0 || w_old < 0) {
    fail(name, "PCIENTB_METHOD_WATCH", errno);
    goto out;
  }
  if (readable(w, 0)) fail(name, "a watcher of a live node is readable", 0);
  if (!readable(w_old, 0)) fail(name, "a watcher of another incarnation is not readable", 0);
  // A process already waiting in poll() is woken when A goes.
  const pid_t waiter = fork();
  if (waiter == 0) {
    // Its copies of A's descriptors would keep A open.
    for (int fd = 3; fd < 1024; fd++)
      if (fd != w) close(fd);
    // poll() looks once more when it times out: only an early wake is a wake.
    const double start = now();
    _exit(readable(w, 5000) && now() - start < 3 ? 0 : 1);
  }
  usleep(200 * 1000);
  munmap(own, len);
  own = MAP_FAILED;
  kclose(a);
  a = NULL;
  int status = -1;
  if (waiter < 0 || waitpid(waiter, &status, 0) != waiter || status != 0)
    fail(name, "a watcher waiting in poll() was not woken when A closed", 0);
  if (!readable(w, 0)) fail(name, "A's watcher is not readable after A closed", 0);
  if (table[la].life) fail(name, "the node table says A lives after it closed", 0);
  if (strcmp(peer + 12345, "from A") != 0)
    fail(name, "A's area as B maps it changed after A closed", 0);
  if (ring(b, la) != ENOENT) fail(name, "ringing a closed node did not fail (ENOENT)", 0);
out:
  if (w >= 0) close(w);
  if (w_old >= 0) close(w_old);
  if (efd >= 0) close(efd);
  if (own != MAP_FAILED) munmap(own, len);
  if (peer != MAP_FAILED) munmap(peer, len);
  if (table != MAP_FAILED) munmap((void *)table, TABLE_BYTES);
  if (a) kclose(a);
  if (b) kclose(b);
}

// The half of the LID space a LID is in (its port's: 1-511 or 513-1023), -1 for none.
static int lid_half(uint16_t lid) {
  return lid && lid % 512 && lid < 1024 ? lid / 512 : -1;
}

// Each context of pcientb.ko is a node: another context of the device, open meanwhile,
// is another LID of the same half; a LID is free again once its context closed (the
// kernel hands out the lowest free one).
static void check_lids(struct ibv_device *d) {
  const char *name = ibv_get_device_name(d);
  struct kctx *a = kopen(d), *b = kopen(d);

  if (!a || !b) {
    fail(name, "two contexts of pcientb.ko", errno);
  } else if (a->info.lid == b->info.lid || lid_half(a->info.lid) < 0 ||
             lid_half(a->info.lid) != lid_half(b->info.lid) || a->info.nonce == b->info.nonce) {
    printf("FAIL %s: two contexts have LIDs %u and %u (distinct, same half expected)\n", name,
           a->info.lid, b->info.lid);
    failures++;
  } else {
    const uint32_t freed = b->info.lid;
    kclose(b);
    b = kopen(d);
    if (!b || b->info.lid != freed) {
      printf("FAIL %s: a context closed with LID %u, the next one got %u (a LID not freed?)\n",
             name, freed, b ? b->info.lid : 0);
      failures++;
    }
  }
  if (a) kclose(a);
  if (b) kclose(b);
}

// One work request on `qp`, completed on `cq` within 5 s: 0 or a failure described.
static const char *run_wr(struct ibv_qp *qp, struct ibv_cq *cq, struct ibv_send_wr *wr) {
  struct ibv_send_wr *bad;
  struct ibv_wc wc;
  const double end = now() + 5;
  int n = 0;

  if (ibv_post_send(qp, wr, &bad)) return "ibv_post_send";
  while ((n = ibv_poll_cq(cq, 1, &wc)) == 0 && now() < end) usleep(100);
  if (n != 1) return "no completion within 5 s";
  return wc.status == IBV_WC_SUCCESS ? NULL : ibv_wc_status_str(wc.status);
}

// RESET -> INIT -> RTR -> RTS of an RC QP toward (dlid, dqpn): 0 or ibv_modify_qp's error.
// retry: the transport and RNR retry counts (7: as long as it takes).
static int rc_connect(struct ibv_qp *qp, uint16_t dlid, uint32_t dqpn, uint8_t retry) {
  struct ibv_qp_attr init = {.qp_state = IBV_QPS_INIT,
                             .port_num = 1,
                             .qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ};
  struct ibv_qp_attr rtr = {.qp_state = IBV_QPS_RTR,
                            .path_mtu = IBV_MTU_4096,
                            .dest_qp_num = dqpn,
                            .max_dest_rd_atomic = 1,
                            .min_rnr_timer = 12,
                            .ah_attr = {.dlid = dlid, .port_num = 1}};
  struct ibv_qp_attr rts = {.qp_state = IBV_QPS_RTS,
                            .timeout = 14,
                            .retry_cnt = retry,
                            .rnr_retry = retry,
                            .max_rd_atomic = 1};
  return ibv_modify_qp(qp, &init,
                       IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) ||
         ibv_modify_qp(qp, &rtr,
                       IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                           IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER) ||
         ibv_modify_qp(qp, &rts,
                       IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                           IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
}

// The data path through the provider's engine over the kernel fabric: an RC queue pair
// connected to itself (the node is its own peer) writes into and reads from its region.
static void check_loopback(struct ibv_context *ctx, const char *name, uint16_t lid) {
  enum { kSize = 65536, kLen = 4096, kAt = 32768 };
  struct ibv_pd *pd = ibv_alloc_pd(ctx);
  struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
  char *buf = calloc(1, kSize);
  struct ibv_mr *mr =
      pd && buf
          ? ibv_reg_mr(pd, buf, kSize,
                       IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ)
          : NULL;
  struct ibv_qp_init_attr ia = {
      .send_cq = cq,
      .recv_cq = cq,
      .qp_type = IBV_QPT_RC,
      .cap = {.max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1}};
  struct ibv_qp *qp = mr && cq ? ibv_create_qp(pd, &ia) : NULL;
  const char *why = NULL;
  int i;

  if (!qp) {
    fail(name, "a PD, a CQ, a region and an RC QP", errno);
    goto out;
  }
  if (rc_connect(qp, lid, qp->qp_num, 7)) {
    fail(name, "connecting the QP to itself", errno);
    goto out;
  }
  for (i = 0; i < kLen; i++) buf[i] = (char)(i * 7 + 3);
  struct ibv_sge sge = {.addr = (uintptr_t)buf, .length = kLen, .lkey = mr->lkey};
  struct ibv_send_wr wr = {.sg_list = &sge,
                           .num_sge = 1,
                           .opcode = IBV_WR_RDMA_WRITE,
                           .send_flags = IBV_SEND_SIGNALED,
                           .wr.rdma = {.remote_addr = (uintptr_t)buf + kAt, .rkey = mr->rkey}};
  if ((why = run_wr(qp, cq, &wr)) || memcmp(buf + kAt, buf, kLen) != 0) {
    printf("FAIL %s: an RDMA WRITE to itself: %s\n", name, why ? why : "the bytes differ");
    failures++;
    goto out;
  }
  sge.addr = (uintptr_t)buf + 2 * kLen;
  wr.opcode = IBV_WR_RDMA_READ;
  if ((why = run_wr(qp, cq, &wr)) || memcmp(buf + 2 * kLen, buf, kLen) != 0) {
    printf("FAIL %s: an RDMA READ from itself: %s\n", name, why ? why : "the bytes differ");
    failures++;
  }
out:
  if (qp) ibv_destroy_qp(qp);
  if (mr) ibv_dereg_mr(mr);
  if (cq) ibv_destroy_cq(cq);
  if (pd) ibv_dealloc_pd(pd);
  free(buf);
}

// A node of another build of the provider (here a raw context, whose layout the table
// says is KCHECK_LAYOUT) is not reached: the engine's WRITE to it fails, and the provider
// says why on stderr (captured here).
static void check_other_layout(struct ibv_context *ctx, struct ibv_device *d, const char *name) {
  struct kctx *other = kopen(d);
  struct ibv_pd *pd = ibv_alloc_pd(ctx);
  struct ibv_cq *cq = ibv_create_cq(ctx, 4, NULL, NULL, 0);
  static char buf[64];
  struct ibv_mr *mr = pd ? ibv_reg_mr(pd, buf, sizeof buf, IBV_ACCESS_LOCAL_WRITE) : NULL;
  struct ibv_qp_init_attr ia = {
      .send_cq = cq,
      .recv_cq = cq,
      .qp_type = IBV_QPT_RC,
      .cap = {.max_send_wr = 1, .max_recv_wr = 1, .max_send_sge = 1, .max_recv_sge = 1}};
  struct ibv_qp *qp = mr && cq ? ibv_create_qp(pd, &ia) : NULL;
  char said[4096] = "";
  int err_fd = -1, saved = -1, pipe_fds[2] = {-1, -1};
  const char *why = NULL;

  if (!other || !qp) {
    fail(name, "a raw context, and a PD, CQ, region and RC QP", errno);
    goto out;
  }
  // The provider looks for the peer when the QP connects (RTR).
  // Into a pipe (the root is read-only here), read once the WRITE has failed.
  fflush(stderr);
  if (pipe(pipe_fds) == 0) {
    err_fd = pipe_fds[0];
    fcntl(err_fd, F_SETFL, O_NONBLOCK);
  }
  saved = dup(2);
  if (err_fd < 0 || saved < 0 || dup2(pipe_fds[1], 2) < 0) {
    fail(name, "capturing stderr", errno);
    goto out;
  }
  if (rc_connect(qp, lid_of(other), 1, 1)) {
    fail(name, "connecting a QP to the raw context", errno);
    goto out;
  }
  struct ibv_sge sge = {.addr = (uintptr_t)buf, .length = 8, .lkey = mr->lkey};
  struct ibv_send_wr wr = {.sg_list = &sge,
                           .num_sge = 1,
                           .opcode = IBV_WR_RDMA_WRITE,
                           .send_flags = IBV_SEND_SIGNALED,
                           .wr.rdma = {.remote_addr = 4096, .rkey = 0x100}};
  why = run_wr(qp, cq, &wr);
  fflush(stderr);
  dup2(saved, 2);
  close(saved);
  saved = -1;
  close(pipe_fds[1]);
  pipe_fds[1] = -1;
  const ssize_t got = read(err_fd, said, sizeof said - 1);
  said[got > 0 ? got : 0] = 0;
  if (!why) fail(name, "a WRITE to a node of another build succeeded", 0);
  if (!strstr(said, "runs another build of the pcientb provider")) {
    printf("FAIL %s: the provider did not say the other node runs another build: %s\n", name, said);
    failures++;
  }
out:
  if (saved >= 0) {
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
  }
  if (err_fd >= 0) close(err_fd);
  if (pipe_fds[1] >= 0) close(pipe_fds[1]);
  if (qp) ibv_destroy_qp(qp);
  if (mr) ibv_dereg_mr(mr);
  if (cq) ibv_destroy_cq(cq);
  if (pd) ibv_dealloc_pd(pd);
  if (other) kclose(other);
}

static int set_mask(struct kctx *ctx, uint32_t quiet) {
  struct pcientb_mask cmd = {.quiet = quiet};
  return method(ctx, PCIENTB_METHOD_MASK, &cmd, sizeof cmd, NULL, 0);
}

// Whether the word of `lid` in the masks page `m` reads `want` within `seconds`.
static int mask_says(const uint32_t *m, uint32_t lid, uint32_t want, double seconds) {
  const double end = now() + seconds;
  while (__atomic_load_n(&m[lid], __ATOMIC_ACQUIRE) != want)
    if (now() > end) return 0;
  return 1;
}

// Doorbell masks (PCIENTB_MMAP_MASKS, read-only): node A's MASK shows in the masks page of
// its own host (C's view) and of the host across (B's); when MASK(0) returns, both read 0
// at once (across: written and flushed); a node that goes leaves no mask behind.
static void check_masks(struct ibv_device *da, struct ibv_device *db) {
  const char *name = ibv_get_device_name(da);
  // The viewers are not nodes: a guest's memory holds few areas (contiguous chunks).
  struct kctx *a = kopen(da), *b = kopen_flags(db, PCIENTB_UCONTEXT_NO_NODE),
              *c = kopen_flags(da, PCIENTB_UCONTEXT_NO_NODE);
  const uint32_t *here = MAP_FAILED, *there = MAP_FAILED;

  if (!a || !b || !c) {
    fail(name, "two contexts on a port and one on its peer", errno);
    goto out;
  }
  const uint16_t la = lid_of(a);
  here = map(c, 4096, PROT_READ, MAP_SHARED, PCIENTB_MMAP_MASKS);
  there = map(b, 4096, PROT_READ, MAP_SHARED, PCIENTB_MMAP_MASKS);
  if (here == MAP_FAILED || there == MAP_FAILED) {
    fail(name, "mapping the masks on both hosts", errno);
    goto out;
  }
  check_map_refused(name, "the masks writable",
                    map(c, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, PCIENTB_MMAP_MASKS), EPERM);
  check_map_refused(name, "the masks and a page past them",
                    map(c, 8192, PROT_READ, MAP_SHARED, PCIENTB_MMAP_MASKS), EPERM);
  // Once the peer host knows A (else A's going would not reach the peer's word: a word
  // of a LID the peer never knew may stay set, which no ringer reads, and the next node of
  // that LID finds zeroed).
  const struct pcientb_node_entry *table =
      map(b, TABLE_BYTES, PROT_READ, MAP_SHARED, PCIENTB_MMAP_TABLE);
  const int known = table != MAP_FAILED && table_says(table, la, a->info.nonce, 1, 10);
  if (table != MAP_FAILED) munmap((void *)table, TABLE_BYTES);
  if (!known) {
    fail(name, "the peer host does not know the node within 10 s", 0);
    goto out;
  }
  if (here[la] || there[la]) fail(name, "a new node's mask is set", 0);
  for (int round = 0; round < 3; round++) {
    if (set_mask(a, 1) || !mask_says(here, la, 1, 5) || !mask_says(there, la, 1, 5)) {
      fail(name, "a node's mask did not show on both hosts within 5 s", errno);
      goto out;
    }
    if (set_mask(a, 0) || here[la] || there[la]) {
      printf("FAIL %s: a mask's end is not seen when MASK returns (this host %u, across %u)\n",
             name, here[la], there[la]);
      failures++;
      goto out;
    }
  }
  struct pcientb_mask bad = {.quiet = 1, .reserved = 1};
  if (method(a, PCIENTB_METHOD_MASK, &bad, sizeof bad, NULL, 0) != EINVAL)
    fail(name, "MASK with its reserved word set did not fail (EINVAL)", 0);
  if (set_mask(c, 1) != EINVAL) fail(name, "MASK on a context that is no node did not fail", 0);
  // Gone while masked: nobody may leave its LID's next node unrung.
  if (set_mask(a, 1) || !mask_says(there, la, 1, 5)) fail(name, "masking again", errno);
  kclose(a);
  a = NULL;
  if (here[la]) fail(name, "a node that went masked left its mask set on its own host", 0);
  if (!mask_says(there, la, 0, 10))
    fail(name, "a node that went masked left its mask set across the bridge (10 s)", 0);
out:
  if (here != MAP_FAILED) munmap((void *)here, 4096);
  if (there != MAP_FAILED) munmap((void *)there, 4096);
  if (a) kclose(a);
  if (b) kclose(b);
  if (c) kclose(c);
}

// The provider's masks, across the bridge in one process: node 1 polls (its doorbell masked,
// seen in the masks page), then stops without arming a CQ; its progress thread ends the mask
// when it runs out, so a SEND from node 0 after that rings it and is served. A mask left
// standing would leave the SEND unserved (no completion, or retries exceeded).
static void check_mask_ends(struct ibv_device *da, struct ibv_device *db) {
  const char *name = ibv_get_device_name(db);
  struct ibv_context *ctx[2] = {ibv_open_device(da), ibv_open_device(db)};
  struct ibv_pd *pd[2] = {0};
  struct ibv_cq *cq[2] = {0};
  struct ibv_mr *mr[2] = {0};
  struct ibv_qp *qp[2] = {0};
  struct ibv_port_attr port[2];
  static char buf[2][4096];
  char what[80];
  struct kctx *view = kopen_flags(da, PCIENTB_UCONTEXT_NO_NODE);
  struct kctx *view1 = kopen_flags(db, PCIENTB_UCONTEXT_NO_NODE);
  const uint32_t *own =  // the masks of db's own host
      view1 ? map(view1, 4096, PROT_READ, MAP_SHARED, PCIENTB_MMAP_MASKS) : MAP_FAILED;
  const uint32_t *masks =
      view ? map(view, 4096, PROT_READ, MAP_SHARED, PCIENTB_MMAP_MASKS) : MAP_FAILED;
  int i;

  for (i = 0; i < 2; i++) {
    if (!ctx[i]) break;
    pd[i] = ibv_alloc_pd(ctx[i]);
    cq[i] = ibv_create_cq(ctx[i], 16, NULL, NULL, 0);
    mr[i] = pd[i] ? ibv_reg_mr(pd[i], buf[i], sizeof buf[i], IBV_ACCESS_LOCAL_WRITE) : NULL;
    struct ibv_qp_init_attr ia = {
        .send_cq = cq[i],
        .recv_cq = cq[i],
        .qp_type = IBV_QPT_RC,
        .cap = {.max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1}};
    qp[i] = mr[i] && cq[i] ? ibv_create_qp(pd[i], &ia) : NULL;
    if (!qp[i] || ibv_query_port(ctx[i], 1, &port[i])) break;
  }
  if (i < 2 || masks == MAP_FAILED || own == MAP_FAILED) {
    snprintf(what, sizeof what, "%s on port %d",
             i < 2 ? "a context, PD, CQ, region and RC QP" : "the masks", i);
    fail(name, what, errno);
    goto out;
  }
  if (rc_connect(qp[0], port[1].lid, qp[1]->qp_num, 3) ||
      rc_connect(qp[1], port[0].lid, qp[0]->qp_num, 3)) {
    fail(name, "connecting the QPs across the bridge", errno);
    goto out;
  }
  struct ibv_sge rsge = {.addr = (uintptr_t)buf[1], .length = 64, .lkey = mr[1]->lkey};
  struct ibv_recv_wr rwr = {.sg_list = &rsge, .num_sge = 1}, *bad_r;
  struct ibv_sge ssge = {.addr = (uintptr_t)buf[0], .length = 64, .lkey = mr[0]->lkey};
  struct ibv_send_wr swr = {
      .sg_list = &ssge, .num_sge = 1, .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED};
  struct ibv_wc wc;
  for (int round = 0; round < 4; round++) {
    if (ibv_post_recv(qp[1], &rwr, &bad_r)) {
      fail(name, "posting a receive", errno);
      goto out;
    }
    // Node 1 polls for 20 ms (the first round also links the nodes: no mask is looked for).
    int masked = 0;
    const double end = now() + 0.02;
    while (now() < end) {
      ibv_poll_cq(cq[1], 1, &wc);
      masked |= __atomic_load_n(&masks[port[1].lid], __ATOMIC_ACQUIRE) != 0;
    }
    if (round > 0 && !masked) fail(name, "a node that polled 20 ms did not mask its doorbell", 0);
    // It stops without arming: its mask runs out (1 ms), and the progress thread ends it.
    usleep(50 * 1000);
    if (!mask_says(masks, port[1].lid, 0, 2)) {
      printf(
          "FAIL %s: a node that stopped polling is still masked 2 s later (round %d, own host"
          " %u)\n",
          name, round, own[port[1].lid]);
      failures++;
    }
    buf[0][0] = (char)round;
    // Rung, it is served at once; unrung, only when its progress thread looks by itself
    // (its membership check, every second).
    const double sent = now();
    const char *why = run_wr(qp[0], cq[0], &swr);
    if (!why && now() - sent > 0.5) why = "over 0.5 s (was it rung?)";
    if (why) {
      printf("FAIL %s: a SEND across to a node whose mask ran out: %s\n", name, why);
      failures++;
      goto out;
    }
    const double wc_end = now() + 5;
    int n;
    while ((n = ibv_poll_cq(cq[1], 1, &wc)) == 0 && now() < wc_end) usleep(100);
    if (n != 1 || wc.status || wc.opcode != IBV_WC_RECV || buf[1][0] != (char)round) {
      fail(name, "the SEND's receive completion across", 0);
      goto out;
    }
  }
out:
  for (i = 0; i < 2; i++) {
    if (qp[i]) ibv_destroy_qp(qp[i]);
    if (mr[i]) ibv_dereg_mr(mr[i]);
    if (cq[i]) ibv_destroy_cq(cq[i]);
    if (pd[i]) ibv_dealloc_pd(pd[i]);
    if (ctx[i]) ibv_close_device(ctx[i]);
  }
  if (masks != MAP_FAILED) munmap((void *)masks, 4096);
  if (own != MAP_FAILED) munmap((void *)own, 4096);
  if (view) kclose(view);
  if (view1) kclose(view1);
}

// A device as a program sees it through libibverbs: the provider's engine, on the
// kernel fabric of the device (a process is one node); then what pcientb.ko itself does.
// The tier 1 script's steps, by files: `prefix.step` made by one side, waited for by the other.
static void step_done(const char *prefix, const char *step) {
  char path[256];
  snprintf(path, sizeof path, "%s.%s", prefix, step);
  const int fd = open(path, O_CREAT | O_WRONLY, 0644);
  if (fd >= 0) close(fd);
}

static int step_waited(const char *prefix, const char *step, double seconds) {
  char path[256];
  snprintf(path, sizeof path, "%s.%s", prefix, step);
  const double end = now() + seconds;
  while (access(path, F_OK) != 0) {
    if (now() > end) return 0;
    usleep(20 * 1000);
  }
  return 1;
}

// A MASK(0) lost on its way, as posted writes are in a link blip neither side sees as down
// (the script sets the bridge's debugfs drop_masks between the steps "remask" and "dropped":
// the next MASK write is dropped): the flush reads the old 1 back, and the bridge writes the
// word again. Else the peer's nodes would leave node `n` unrung.
static void mask_lost(struct kctx *n, const uint32_t *there, const char *name, const char *prefix) {
  const uint16_t ln = lid_of(n);
  if (set_mask(n, 1) || !mask_says(there, ln, 1, 5)) {
    fail(name, "a mask set across the bridge (5 s)", errno);
    return;
  }
  step_done(prefix, "remask");
  if (!step_waited(prefix, "dropped", 60)) {
    fail(name, "the script did not set drop_masks within 60 s", 0);
    return;
  }
  if (set_mask(n, 0))
    fail(name, "MASK(0)", errno);
  else if (!mask_says(there, ln, 0, 10))
    fail(name, "a MASK(0) lost on its way is not written again across the bridge (10 s)", 0);
  else
    printf("mask lost ok\n");
}

// Doorbell masks over a link flap that only one side sees (the script stops port B's
// heartbeat: port A's link goes down and up, B's stays up, and B keeps A's nodes):
// node N of A masks, and its word across reads 1; while A's link is down, N ends its mask,
// which cannot reach B then, and a new node N2 comes and masks; once the link is up
// again, N's word across must read 0 (else B's nodes would leave N unrung), and N2's 1
// (B zeroes a word when it adds the node, after which A's module must write it again).
static int mask_flap(const char *name_a, const char *name_b, const char *prefix) {
  struct ibv_device **list = ibv_get_device_list(NULL), *da = NULL, *db = NULL;
  for (int i = 0; list && list[i]; i++) {
    if (strcmp(ibv_get_device_name(list[i]), name_a) == 0) da = list[i];
    if (strcmp(ibv_get_device_name(list[i]), name_b) == 0) db = list[i];
  }
  struct kctx *n = da ? kopen(da) : NULL, *n2 = NULL;
  // A mask before the peer host knows N (its work item adds N after a doorbell).
  const int masked = n && set_mask(n, 1) == 0;
  // A node on B too: A's bridge is down once B's node has left A's table.
  struct kctx *b = db ? kopen(db) : NULL;
  const uint32_t *there = MAP_FAILED;
  const struct pcientb_node_entry *table = MAP_FAILED, *here = MAP_FAILED;

  if (!n || !b || !masked) {
    fail(name_a, "a node masked on one port and a node on its peer", errno);
    goto out;
  }
  const uint16_t ln = lid_of(n), lb = lid_of(b);
  there = map(b, 4096, PROT_READ, MAP_SHARED, PCIENTB_MMAP_MASKS);
  table = map(b, TABLE_BYTES, PROT_READ, MAP_SHARED, PCIENTB_MMAP_TABLE);
  here = map(n, TABLE_BYTES, PROT_READ, MAP_SHARED, PCIENTB_MMAP_TABLE);
  if (there == MAP_FAILED || table == MAP_FAILED || here == MAP_FAILED) {
    fail(name_b, "mapping the masks and the node tables", errno);
    goto out;
  }
  if (!table_says(table, ln, n->info.nonce, 1, 10) || !table_says(here, lb, b->info.nonce, 1, 10)) {
    fail(name_a, "the two hosts do not know each other's node within 10 s", 0);
    goto out;
  }
  if (!mask_says(there, ln, 1, 5)) {
    fail(name_a, "a mask set before the peer host knew the node is not set there (5 s)", 0);
    goto out;
  }
  step_done(prefix, "masked");
  if (!step_waited(prefix, "down", 60) || !table_says(here, lb, b->info.nonce, 0, 10)) {
    fail(name_a, "the link and the bridge did not go down within 70 s", 0);
    goto out;
  }
  if (set_mask(n, 0)) {
    fail(name_a, "MASK(0) while the link is down", errno);
    goto out;
  }
  // Else this check checks nothing: the end reached the peer although the link was down.
  if (!there[ln]) fail(name_a, "the peer's word of the node changed while the link was down", 0);
  // A node that comes and masks while the link is down: the peer learns of it only later.
  n2 = kopen(da);
  if (!n2 || set_mask(n2, 1)) {
    fail(name_a, "a node masked while the link is down", errno);
    goto out;
  }
  step_done(prefix, "ended");
  if (!step_waited(prefix, "up", 60)) {
    fail(name_a, "the link did not come up within 60 s", 0);
    goto out;
  }
  if (!mask_says(there, ln, 0, 10))
    fail(name_a, "a mask ended while the link was down still stands across it after (10 s)", 0);
  else if (!table_says(table, ln, n->info.nonce, 1, 0))
    fail(name_a, "the peer host lost the node over the flap", 0);
  else if (!table_says(table, lid_of(n2), n2->info.nonce, 1, 10) ||
           !mask_says(there, lid_of(n2), 1, 10))
    fail(name_a, "a node masked while the link was down is not masked across it after (10 s)", 0);
  else {
    printf("mask flap ok\n");
    mask_lost(n, there, name_a, prefix);
  }
out:
  step_done(prefix, "masked");  // the script never waits for nothing
  step_done(prefix, "ended");
  step_done(prefix, "remask");
  if (there != MAP_FAILED) munmap((void *)there, 4096);
  if (table != MAP_FAILED) munmap((void *)table, TABLE_BYTES);
  if (here != MAP_FAILED) munmap((void *)here, TABLE_BYTES);
  if (n) kclose(n);
  if (n2) kclose(n2);
  if (b) kclose(b);
  if (list) ibv_free_device_list(list);
  return failures ? 1 : 0;
}

static int check_device(struct ibv_device *d, __be64 *guid, int *half) {
  const char *name = ibv_get_device_name(d);
  struct ibv_context *ctx = ibv_open_device(d);
  struct ibv_device_attr attr = {0};
  struct ibv_port_attr port;
  union ibv_gid gid;
  __be16 pkey = 0;
  int before = failures, rc;

  if (!ctx) {
    fail(name, "ibv_open_device", errno);
    return -1;
  }
  rc = ibv_query_device(ctx, &attr);
  if (rc)
    fail(name, "ibv_query_device", rc);
  else if (attr.phys_port_cnt != 1 || attr.max_pd <= 0 || attr.max_qp <= 0 || attr.max_mr <= 0 ||
           !attr.node_guid || attr.node_guid != ibv_get_device_guid(d)) {
    printf(
        "FAIL %s: device attributes: %u ports, max_pd %d, max_qp %d, max_mr %d, GUID %#llx "
        "(the module's %#llx)\n",
        name, attr.phys_port_cnt, attr.max_pd, attr.max_qp, attr.max_mr,
        (unsigned long long)be64toh(attr.node_guid),
        (unsigned long long)be64toh(ibv_get_device_guid(d)));
    failures++;
  }
  *guid = attr.node_guid;
  rc = ibv_query_port(ctx, 1, &port);
  if (rc || port.state != IBV_PORT_ACTIVE || port.link_layer != IBV_LINK_LAYER_INFINIBAND ||
      lid_half(port.lid) < 0)
    fail(name, "port attributes (ACTIVE, InfiniBand, a LID)", rc);
  *half = rc ? -1 : lid_half(port.lid);
  const uint16_t lid = rc ? 0 : port.lid;
  // Another context of this process is the same node.
  struct ibv_context *again = ibv_open_device(d);
  struct ibv_port_attr port2;
  if (!again || ibv_query_port(again, 1, &port2) || port2.lid != lid)
    fail(name, "a second context of the process is another node", 0);
  if (again) ibv_close_device(again);
  if (ibv_query_port(ctx, 2, &port) == 0) fail(name, "port 2 answered", 0);
  rc = ibv_query_gid(ctx, 1, 0, &gid);
  if (rc)
    fail(name, "ibv_query_gid", errno);
  else if (be64toh(gid.global.subnet_prefix) != 0xfe80000000000000ULL ||
           gid.global.interface_id != attr.node_guid)
    fail(name, "GID 0 is not fe80::<node GUID>", 0);
  rc = ibv_query_pkey(ctx, 1, 0, &pkey);
  if (rc || be16toh(pkey) != 0xffff) fail(name, "P_Key 0 is not 0xffff", rc ? errno : 0);
  check_loopback(ctx, name, lid);
  check_other_layout(ctx, d, name);
  check_lids(d);
  check_mrs(d);
  check_moves(d, d);
  check_nodes(d);
  rc = ibv_close_device(ctx);
  if (rc) fail(name, "ibv_close_device", errno);
  if (failures == before)
    printf(
        "device %s ok guid %016llx lid %u port ACTIVE loopback ok lids ok mr ok move ok "
        "nodes ok\n",
        name, (unsigned long long)be64toh(attr.node_guid), lid);
  return failures == before ? 0 : -1;
}

static int devices(int want) {
  int n = 0, i, j, found = 0;
  struct ibv_device **list = ibv_get_device_list(&n);
  __be64 guids[16];
  int halves[16];

  if (!list) {
    fail("-", "ibv_get_device_list", errno);
    return 1;
  }
  for (i = 0; i < n; i++) {
    if (strncmp(ibv_get_device_name(list[i]), "pcientb", 7) != 0 || found == 16) continue;
    if (check_device(list[i], &guids[found], &halves[found]) == 0)
      for (j = 0; j < found; j++) {
        if (guids[j] == guids[found]) fail(ibv_get_device_name(list[i]), "GUID not unique", 0);
        if (halves[j] == halves[found])
          fail(ibv_get_device_name(list[i]), "LIDs in the same half as another port's", 0);
      }
    found++;
  }
  if (found == 2 && failures == 0) {
    const int before = failures;
    struct ibv_device *d[2];
    int k = 0;
    for (i = 0; i < n && k < 2; i++)
      if (strncmp(ibv_get_device_name(list[i]), "pcientb", 7) == 0) d[k++] = list[i];
    check_bridge(d[0], d[1]);
    check_bridge(d[1], d[0]);
    check_moves(d[0], d[1]);
    check_moves(d[1], d[0]);
    check_masks(d[0], d[1]);
    check_masks(d[1], d[0]);
    check_mask_ends(d[0], d[1]);
    if (failures == before) printf("bridge ok\n");
  }
  ibv_free_device_list(list);
  if (found != want) {
    printf("FAIL %d pcientb devices, expected %d\n", found, want);
    failures++;
  }
  printf("devices %d\n", found);
  return failures ? 1 : 0;
}

static const char *event_name(enum ibv_event_type e) {
  switch (e) {
    case IBV_EVENT_PORT_ACTIVE:
      return "PORT_ACTIVE";
    case IBV_EVENT_PORT_ERR:
      return "PORT_ERR";
    case IBV_EVENT_DEVICE_FATAL:
      return "DEVICE_FATAL";
    default:
      return ibv_event_type_str(e);
  }
}

static int events(const char *name, int want, double seconds, const char *ready) {
  struct ibv_device **list = ibv_get_device_list(NULL);
  struct ibv_context *ctx = NULL;
  int i, got = 0, fd, fatal = 0;
  double end;
  static char region[65536];
  struct ibv_pd *pd;
  struct ibv_mr *mr = NULL;
  long base;

  for (i = 0; list && list[i]; i++)
    if (strcmp(ibv_get_device_name(list[i]), name) == 0) ctx = ibv_open_device(list[i]);
  if (list) ibv_free_device_list(list);
  if (!ctx) {
    fail(name, "cannot open", errno);
    return 1;
  }
  base = pinned_kib();
  pd = ibv_alloc_pd(ctx);
  if (pd) mr = ibv_reg_mr(pd, region, sizeof region, IBV_ACCESS_LOCAL_WRITE);
  if (!mr) fail(name, "a PD and a region of 64 KiB", errno);
  fd = open(ready, O_CREAT | O_WRONLY, 0644);
  if (fd >= 0) close(fd);
  end = now() + seconds;
  while (got < want && now() < end) {
    struct pollfd p = {.fd = ctx->async_fd, .events = POLLIN};
    struct ibv_async_event e;

    if (poll(&p, 1, (int)((end - now()) * 1000) + 1) <= 0) continue;
    if (ibv_get_async_event(ctx, &e)) break;
    printf("event %s %s\n", name, event_name(e.event_type));
    ibv_ack_async_event(&e);
    got++;
    if (e.event_type == IBV_EVENT_DEVICE_FATAL) {
      fatal = 1;
      break;
    }
  }
  printf("events %s %d\n", name, got);
  /*
   * The device went (DEVICE_FATAL): the kernel unpins the region as it disassociates the
   * context (shortly after the event), and deregistering what it freed succeeds.
   */
  for (i = 0; fatal && mr && pinned_kib() != base && i < 50; i++) usleep(100 * 1000);
  const int before = failures;
  if (mr && fatal) check_pinned(name, "regions after DEVICE_FATAL", base, 0);
  if (mr && ibv_dereg_mr(mr)) fail(name, "ibv_dereg_mr", errno);
  if (pd && ibv_dealloc_pd(pd)) fail(name, "ibv_dealloc_pd", errno);
  if (mr && fatal && failures == before) printf("events %s region unpinned\n", name);
  ibv_close_device(ctx);
  return failures ? 1 : 0;
}

// What each side of `across` tells the other (a file in the shared directory).
struct hello {
  uint32_t lid, qpn, psn, rkey;
  uint64_t addr;
};

static uint8_t across_byte(char role, size_t i) {
  return (uint8_t)(i * (role == 'a' ? 31 : 57) + (role == 'a' ? 3 : 11));
}

// The next completion of `cq` within `seconds`: 1, or 0 with none.
static int next_wc(struct ibv_cq *cq, struct ibv_wc *wc, double seconds) {
  const double end = now() + seconds;
  int n;
  while ((n = ibv_poll_cq(cq, 1, wc)) == 0 && now() < end) usleep(200);
  return n == 1;
}

static int across(const char *name, const char *role_s, const char *dir) {
  enum { kRegion = 1 << 20, kLen = 65536, kRecv = 512 * 1024, kRead = 768 * 1024 };
  const char role = role_s[0], other = role == 'a' ? 'b' : 'a';
  struct ibv_device **list = ibv_get_device_list(NULL);
  struct ibv_context *ctx = NULL;
  char path[512], tmp[520];
  struct hello mine = {0}, theirs = {0};
  struct ibv_wc wc;
  int i;

  for (i = 0; list && list[i]; i++)
    if (strcmp(ibv_get_device_name(list[i]), name) == 0) ctx = ibv_open_device(list[i]);
  if (list) ibv_free_device_list(list);
  if (!ctx || (role != 'a' && role != 'b')) {
    fail(name, "cannot open (or role not a or b)", errno);
    return 1;
  }
  uint8_t *buf = aligned_alloc(4096, kRegion);
  struct ibv_pd *pd = ibv_alloc_pd(ctx);
  struct ibv_cq *cq = ibv_create_cq(ctx, 256, NULL, NULL, 0);
  struct ibv_mr *mr = buf && pd ? ibv_reg_mr(pd, buf, kRegion, ALL_RIGHTS) : NULL;
  struct ibv_qp_init_attr qia = {
      .send_cq = cq,
      .recv_cq = cq,
      .qp_type = IBV_QPT_RC,
      .cap = {.max_send_wr = 64, .max_recv_wr = 64, .max_send_sge = 1, .max_recv_sge = 1}};
  struct ibv_qp *qp = mr && cq ? ibv_create_qp(pd, &qia) : NULL;
  struct ibv_port_attr port;
  if (!qp || ibv_query_port(ctx, 1, &port)) {
    fail(name, "a PD, CQ, region and RC QP", errno);
    return 1;
  }
  memset(buf, 0, kRegion);
  mine = (struct hello){
      .lid = port.lid, .qpn = qp->qp_num, .psn = 1, .rkey = mr->rkey, .addr = (uintptr_t)buf};
  snprintf(path, sizeof path, "%s/%c.hello", dir, role);
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  FILE *f = fopen(tmp, "w");
  if (!f || fwrite(&mine, sizeof mine, 1, f) != 1 || fclose(f) || rename(tmp, path)) {
    fail(name, "writing the hello file", errno);
    return 1;
  }
  snprintf(path, sizeof path, "%s/%c.hello", dir, other);
  const double end = now() + 120;
  for (;;) {
    f = fopen(path, "r");
    if (f && fread(&theirs, sizeof theirs, 1, f) == 1) break;
    if (f) fclose(f);
    f = NULL;
    if (now() > end) {
      fail(name, "no hello from the other host within 120 s", 0);
      return 1;
    }
    usleep(100 * 1000);
  }
  fclose(f);
  struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT,
                          .port_num = 1,
                          .qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ};
  int rc =
      ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
  a = (struct ibv_qp_attr){.qp_state = IBV_QPS_RTR,
                           .path_mtu = IBV_MTU_4096,
                           .dest_qp_num = theirs.qpn,
                           .rq_psn = theirs.psn,
                           .max_dest_rd_atomic = 1,
                           .min_rnr_timer = 12,
                           .ah_attr = {.dlid = (uint16_t)theirs.lid, .port_num = 1}};
  rc = rc ? rc
          : ibv_modify_qp(qp, &a,
                          IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                              IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
  a = (struct ibv_qp_attr){.qp_state = IBV_QPS_RTS,
                           .timeout = 14,
                           .retry_cnt = 7,
                           .rnr_retry = 7,
                           .sq_psn = mine.psn,
                           .max_rd_atomic = 1};
  rc = rc ? rc
          : ibv_modify_qp(qp, &a,
                          IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                              IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
  struct ibv_sge rsge = {.addr = (uintptr_t)buf + kRecv, .length = 4096, .lkey = mr->lkey};
  struct ibv_recv_wr rwr = {.sg_list = &rsge, .num_sge = 1}, *bad_r;
  rc = rc ? rc : ibv_post_recv(qp, &rwr, &bad_r);
  if (rc) {
    fail(name, "connecting the QP across the hosts", rc);
    return 1;
  }
  // My bytes into the other's region (a's at 0, b's at 128 KiB), then a SEND after them.
  const size_t mine_at = role == 'a' ? 0 : 131072, theirs_at = role == 'a' ? 131072 : 0;
  uint8_t *src = buf + kRead - kLen;  // a staging area of my own region
  for (size_t k = 0; k < kLen; k++) src[k] = across_byte(role, k);
  struct ibv_sge sge = {.addr = (uintptr_t)src, .length = kLen, .lkey = mr->lkey};
  struct ibv_send_wr wr = {.sg_list = &sge,
                           .num_sge = 1,
                           .opcode = IBV_WR_RDMA_WRITE,
                           .send_flags = IBV_SEND_SIGNALED,
                           .wr.rdma = {.remote_addr = theirs.addr + mine_at, .rkey = theirs.rkey}};
  struct ibv_send_wr *bad;
  const char *what = NULL;
  int got_send = 0, sent = 0, wrote = 0;
  if (ibv_post_send(qp, &wr, &bad)) what = "posting an RDMA WRITE across";
  // The other's SEND may come first (it wrote sooner): a receive completion is noted.
  while (!what && !wrote) {
    if (!next_wc(cq, &wc, 30) || wc.status)
      what = "an RDMA WRITE across";
    else if (wc.opcode == IBV_WC_RECV)
      got_send = 1;
    else
      wrote = 1;
  }
  struct ibv_sge ssge = {.addr = (uintptr_t)src, .length = 8, .lkey = mr->lkey};
  struct ibv_send_wr swr = {
      .sg_list = &ssge, .num_sge = 1, .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED};
  if (!what && ibv_post_send(qp, &swr, &bad)) what = "a SEND across";
  while (!what && (!got_send || !sent)) {
    if (!next_wc(cq, &wc, 30) || wc.status) {
      what = !got_send && !sent ? "neither the other's SEND nor mine completed"
             : !got_send        ? "the other's SEND did not arrive"
                                : "my SEND did not complete";
      break;
    }
    if (wc.opcode == IBV_WC_RECV)
      got_send = 1;
    else
      sent = 1;
  }
  if (!what)
    for (size_t k = 0; k < kLen; k++)
      if (buf[theirs_at + k] != across_byte(other, k)) {
        what = "the other host's WRITE is not in my region";
        break;
      }
  // Mine, read back from the other's region.
  sge = (struct ibv_sge){.addr = (uintptr_t)buf + kRead, .length = kLen, .lkey = mr->lkey};
  wr.opcode = IBV_WR_RDMA_READ;
  if (!what && (ibv_post_send(qp, &wr, &bad) || !next_wc(cq, &wc, 30) || wc.status))
    what = "an RDMA READ across";
  if (!what && memcmp(buf + kRead, src, kLen) != 0) what = "the READ did not bring my bytes back";
  if (what) {
    printf("FAIL %s: across: %s (%s)\n", name, what,
           wc.status ? ibv_wc_status_str(wc.status) : "-");
    return 1;
  }
  printf("across ok\n");
  if (role == 'b') {
    for (;;) pause();  // the other host streams into my region until my guest is killed
  }
  // Stream WRITEs into b until one fails: b's host is killed under it.
  wr.opcode = IBV_WR_RDMA_WRITE;
  sge = (struct ibv_sge){.addr = (uintptr_t)src, .length = kLen, .lkey = mr->lkey};
  unsigned long n = 0;
  for (;;) {
    if (ibv_post_send(qp, &wr, &bad)) {
      fail(name, "posting a WRITE while streaming", errno);
      return 1;
    }
    if (!next_wc(cq, &wc, 30)) {
      printf("FAIL %s: across: no completion within 30 s after %lu writes\n", name, n);
      return 1;
    }
    if (wc.status) break;
    if (++n == 1) printf("across streaming\n");
  }
  printf("across error %s after %lu writes\n", ibv_wc_status_str(wc.status), n);
  return 0;
}

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (argc == 3 && strcmp(argv[1], "devices") == 0) return devices(atoi(argv[2]));
  if (argc == 6 && strcmp(argv[1], "events") == 0)
    return events(argv[2], atoi(argv[3]), atof(argv[4]), argv[5]);
  if (argc == 5 && strcmp(argv[1], "across") == 0) return across(argv[2], argv[3], argv[4]);
  if (argc == 5 && strcmp(argv[1], "mask-flap") == 0) return mask_flap(argv[2], argv[3], argv[4]);
  fprintf(stderr,
          "usage: verbs_check devices N | events DEVICE N SECONDS READY_FILE | across DEVICE "
          "a|b DIR | mask-flap DEVICE PEER_DEVICE STEP_PREFIX\n");
  return 2;
}
