/* One-sided writes over an SDP socket (pcientb/sdp.h), with the stream as the fallback.
 *
 *   pcientb-sdp sdp_onesided_example [bytes]
 *
 * The process forks: the parent (the server) exposes a buffer on the accepted connection and
 * says so; the child (the client) writes a pattern into it in pieces at their offsets with
 * pcientb_sdp_write(), then sends one byte, 'D', through the stream: since a write is ordered
 * with the stream, the server finds the data in place when the byte arrives, and checks it.
 * Without the layer (or on a connection that is not SDP) pcientb_sdp_expose() fails with
 * ENOPROTOOPT, and the same pieces go through the stream, as (offset, length, bytes).
 * Prints how the bytes went (ending in "ok"), and exits 0 when every byte is right.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <pcientb/sdp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

static unsigned char byte_at(uint64_t i) {
  return (unsigned char)((i * 2654435761u) >> 13);
}

static int io_all(int fd, void *buf, size_t n, int sending) {
  char *p = buf;
  while (n) {
    ssize_t k = sending ? send(fd, p, n, MSG_NOSIGNAL) : recv(fd, p, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return -1;
    p += k;
    n -= (size_t)k;
  }
  return 0;
}

static int client(uint16_t port, size_t size) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a) != 0) return 1;
  char mode;
  if (io_all(fd, &mode, 1, 0) != 0) return 1; /* 'W': a window is exposed; 'S': the stream */
  unsigned char *data = malloc(size);
  for (size_t i = 0; i < size; ++i) data[i] = byte_at(i);
  /* Pieces of growing size, from the end of the buffer to its start. */
  size_t end = size;
  for (size_t piece = 1000; end > 0; piece = piece * 3 / 2) {
    size_t n = piece < end ? piece : end;
    uint64_t off = end - n;
    if (mode == 'W') {
      if (pcientb_sdp_write(fd, data + off, n, off) != 0) {
        perror("pcientb_sdp_write");
        return 1;
      }
    } else {
      uint64_t head[2] = {off, n};
      if (io_all(fd, head, sizeof head, 1) != 0 || io_all(fd, data + off, n, 1) != 0) return 1;
    }
    end = off;
  }
  uint64_t done[2] = {UINT64_MAX, 0};
  if (mode == 'W' ? io_all(fd, "D", 1, 1) : io_all(fd, done, sizeof done, 1)) return 1;
  char verdict = 0;
  if (io_all(fd, &verdict, 1, 0) != 0) return 1;
  close(fd);
  free(data);
  return verdict == 'Y' ? 0 : 1;
}

static char result[200];

static int server(int lfd, size_t size) {
  int fd = accept(lfd, NULL, NULL);
  if (fd < 0) return 1;
  unsigned char *buf = calloc(1, size);
  const int windowed = pcientb_sdp_expose(fd, buf, size) == 0;
  if (!windowed && errno != ENOPROTOOPT) perror("pcientb_sdp_expose");
  if (io_all(fd, windowed ? "W" : "S", 1, 1) != 0) return 1;
  if (windowed) {
    char d;
    if (io_all(fd, &d, 1, 0) != 0 || d != 'D') return 1;
  } else {
    for (;;) {
      uint64_t head[2];
      if (io_all(fd, head, sizeof head, 0) != 0) return 1;
      if (head[0] == UINT64_MAX) break;
      if (head[0] > size || head[1] > size - head[0] || io_all(fd, buf + head[0], head[1], 0))
        return 1;
    }
  }
  size_t bad = 0;
  for (size_t i = 0; i < size; ++i) bad += buf[i] != byte_at(i);
  struct pcientb_sdp_stats st = {0};
  socklen_t len = sizeof st;
  getsockopt(fd, IPPROTO_TCP, PCIENTB_SDP_STATS, &st, &len);
  if (io_all(fd, bad ? "N" : "Y", 1, 1) != 0) return 1;
  snprintf(result, sizeof result, "onesided example: %zu bytes %s, %zu wrong (path %s)", size,
           windowed ? "by one-sided writes" : "through the stream", bad,
           st.path == PCIENTB_SDP_PATH_SDP ? "sdp" : "tcp");
  close(fd);
  free(buf);
  return bad ? 1 : 0;
}

int main(int argc, char **argv) {
  size_t size = argc > 1 ? strtoull(argv[1], NULL, 0) : 4u << 20;
  int lfd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t al = sizeof a;
  if (lfd < 0 || bind(lfd, (struct sockaddr *)&a, sizeof a) != 0 || listen(lfd, 1) != 0 ||
      getsockname(lfd, (struct sockaddr *)&a, &al) != 0) {
    perror("listen");
    return 1;
  }
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) _exit(client(ntohs(a.sin_port), size));
  int rc = server(lfd, size);
  int status = 0;
  waitpid(pid, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    fprintf(stderr, "onesided example: the client failed (status %d)\n", status);
    rc = 1;
  }
  printf("%s: %s\n", result[0] ? result : "onesided example", rc ? "FAILED" : "ok");
  return rc;
}
