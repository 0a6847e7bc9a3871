/* An ordinary verbs program, linked against libibverbs' versioned symbols and
 * knowing nothing of pcientb. Run under pcientb-run, it must find a pcientb
 * device and get answers from every call the preload library interposes.
 * Exit status 0 when all checks pass; each failure is printed. */
#include <endian.h>
#include <errno.h>
#include <infiniband/verbs.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static int failures;

#define CHECK(cond, ...)                                   \
  do {                                                     \
    if (!(cond)) {                                         \
      fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                        \
      fputc('\n', stderr);                                 \
      ++failures;                                          \
    }                                                      \
  } while (0)

static void check_context(struct ibv_context *ctx) {
  struct ibv_device_attr dev_attr;
  struct ibv_port_attr port_attr;
  union ibv_gid gid;
  struct ibv_gid_entry entry;
  struct ibv_gid_entry table[64];
  struct ibv_comp_channel *channel;
  __be16 pkey = 0;
  ssize_t n;
  int rc;

  rc = ibv_query_device(ctx, &dev_attr);
  CHECK(rc == 0, "ibv_query_device: %d", rc);
  CHECK(dev_attr.phys_port_cnt >= 1, "phys_port_cnt %u", (unsigned)dev_attr.phys_port_cnt);
  rc = ibv_query_port(ctx, 1, &port_attr);
  CHECK(rc == 0, "ibv_query_port: %d", rc);

  memset(&gid, 0xa5, sizeof(gid));
  rc = ibv_query_gid(ctx, 1, 0, &gid);
  CHECK(rc == 0, "ibv_query_gid: %d (errno %d)", rc, errno);

  rc = ibv_query_gid_ex(ctx, 1, 0, &entry, 0);
  CHECK(rc == 0 || rc == ENODATA, "ibv_query_gid_ex: %d", rc);
  if (rc == 0) CHECK(memcmp(&entry.gid, &gid, sizeof(gid)) == 0, "gid_ex differs from query_gid");

  n = ibv_query_gid_table(ctx, table, sizeof(table) / sizeof(table[0]), 0);
  CHECK(n >= 0, "ibv_query_gid_table: %zd", n);
  printf("gid table entries: %zd\n", n);

  rc = ibv_query_pkey(ctx, 1, 0, &pkey);
  CHECK(rc == 0, "ibv_query_pkey: %d (errno %d)", rc, errno);
  if (rc == 0) {
    rc = ibv_get_pkey_index(ctx, 1, pkey);
    CHECK(rc == 0, "ibv_get_pkey_index(pkey at index 0) = %d", rc);
  }

  channel = ibv_create_comp_channel(ctx);
  CHECK(channel != NULL, "ibv_create_comp_channel: errno %d", errno);
  if (channel) {
    CHECK(channel->fd >= 0, "comp channel fd %d", channel->fd);
    rc = ibv_destroy_comp_channel(channel);
    CHECK(rc == 0, "ibv_destroy_comp_channel: %d", rc);
  }
}

int main(void) {
  struct ibv_device **list;
  int num = -1, i, found = 0;

  list = ibv_get_device_list(&num);
  CHECK(list != NULL, "ibv_get_device_list: errno %d (%s)", errno, strerror(errno));
  if (!list) return 1;
  for (i = 0; i < num; ++i) {
    const char *name = ibv_get_device_name(list[i]);
    struct ibv_context *ctx;

    printf("device %d: %s guid %016llx index %d\n", i, name,
           (unsigned long long)be64toh(ibv_get_device_guid(list[i])),
           ibv_get_device_index(list[i]));
    if (strncmp(name, "pcientb", 7) != 0) continue;
    ++found;
    ctx = ibv_open_device(list[i]);
    CHECK(ctx != NULL, "ibv_open_device(%s): errno %d", name, errno);
    if (!ctx) continue;
    check_context(ctx);
    CHECK(ibv_close_device(ctx) == 0, "ibv_close_device");
  }
  CHECK(list[num] == NULL, "list not NULL-terminated");
  CHECK(found >= 1, "no pcientb device listed (is libpcientb-preload.so preloaded?)");
  ibv_free_device_list(list);

  /* A second list must be independent of the first. */
  list = ibv_get_device_list(NULL);
  CHECK(list != NULL, "second ibv_get_device_list");
  if (list) ibv_free_device_list(list);

  printf("%s\n", failures ? "preload smoke: FAILED" : "preload smoke: ok");
  return failures ? 1 : 0;
}
