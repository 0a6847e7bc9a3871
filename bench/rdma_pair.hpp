// Two processes joined by an RC queue pair on pcientb0 (or on two devices: the two ports
// of a bridge), for measurement.
//
// RdmaPair::start() forks the peer before either side opens the device; both open it (each
// becomes a node with its own LID), exchange LID/QPN/PSN/rkey/address over a socketpair and
// bring their QPs to RTS. The peer then serves requests over the socketpair until the pair is
// destroyed, so a benchmark forks once and measures many times. Only the public verbs API is
// used, the way perftest uses it: tx depth 128, a signaled WR every 64, completions polled.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace pcientb::bench {

enum class Op : uint32_t { write, read, send };
const char *op_name(Op op);

struct PairOptions {
  const char *device = "pcientb0";
  const char *peer_device = nullptr;  // the forked peer's device (nullptr: `device`)
  size_t max_size = size_t{4} << 20;  // largest message; each side registers 2 * max_size
  uint32_t tx_depth = 128;            // send WRs in flight (perftest -t)
  uint32_t signal_every = 64;         // one signaled WR per this many (perftest --cq-mod)
  uint32_t rx_depth = 512;            // receives kept posted on each side (perftest -r)
  double timeout_s = 10;              // a wait without progress this long is an error
  // bandwidth() WRITEs and READs land this many bytes past the page-aligned start of their
  // destination region (16: where glibc's malloc puts a large block), sources stay aligned.
  size_t dst_offset = 0;
};

// Unless the caller already chose one, sets PCIENTB_FABRIC to a name unique to this run, so
// concurrent runs do not share a fabric. Call before any verbs call.
void use_private_fabric(const char *prefix);

class RdmaPair {
 public:
  // Forks the peer and connects. nullptr and *err on failure.
  static std::unique_ptr<RdmaPair> start(const PairOptions &opt, std::string *err);
  ~RdmaPair();
  RdmaPair(const RdmaPair &) = delete;
  RdmaPair &operator=(const RdmaPair &) = delete;

  // One WRITE, READ and SEND at a few sizes, with the data checked on the other side.
  bool verify();

  // Moves `count` messages of `size` bytes to the peer (READ: from the peer) with tx_depth WRs
  // in flight. Returns the seconds from the first post until every message has landed (for
  // SEND: until the peer has polled every receive completion), or < 0 on error.
  double bandwidth(Op op, size_t size, uint64_t count);

  // A latency session of `rounds` rounds: lat_begin(), then rounds(n) calls that add up to
  // `rounds`, then lat_end(). A WRITE round is ib_write_lat's: write, then poll the last byte of
  // our buffer until the peer's write lands. A SEND round is ib_send_lat's: send, then wait for
  // the peer's send in our receive queue. A READ round is one READ and its completion
  // (ib_read_lat). rounds(n) returns the seconds n rounds took, < 0 on error; timing n rounds at
  // once keeps the clock's cost and granularity (10 ns on some VMs) out of short rounds.
  bool lat_begin(Op op, size_t size, uint64_t rounds);
  double rounds(uint64_t n);
  bool lat_end();

  const std::string &error() const { return err_; }
  uint32_t max_inline() const;
  // The fabric work this (initiating) process has done so far, as pcientb_query_work() counts
  // it: posts, post bytes, doorbells, DMA writes, their bytes, DMA reads, their bytes. False
  // when the provider does not offer it.
  bool work(uint64_t out[8]);

  struct Endpoint;

 private:
  RdmaPair(int fd, pid_t pid, const PairOptions &opt);
  bool fail(const std::string &msg);
  bool request(uint32_t kind, Op op, size_t size, uint64_t count, uint64_t arg, uint64_t *value);
  bool reply(const char *what, bool spin, uint64_t *value);

  int fd_;
  pid_t pid_;
  PairOptions opt_;
  std::unique_ptr<Endpoint> ep_;
  std::string err_;

  Op lat_op_ = Op::write;
  size_t lat_size_ = 0;
  uint8_t lat_seq_ = 0;
};

}  // namespace pcientb::bench
