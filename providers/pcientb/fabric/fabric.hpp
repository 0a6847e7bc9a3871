// The fabric: what the engine needs from "the wire", and nothing more.
//
// A node is one process attached to a fabric. Each node owns a segment: memory
// every peer can reach (the engine keeps its peer-visible tables and rings
// there). Registered memory is exposed through windows; a peer moves bytes
// to and from a window without the owner's CPU, as a DMA engine through an NT
// window does. Doorbells wake a sleeping owner. The emulated backend
// (fabric/emu) implements this between processes on one machine; the kernel
// backend implements it over pcientb.ko.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace pcientb::fabric {

// Names a window in its owner's segment; stored by the engine in MR entries.
struct WindowId {
  uint32_t index = 0;
  uint32_t gen = 0;
};

class Peer {
 public:
  virtual ~Peer() = default;
  uint16_t lid() const { return lid_; }
  uint64_t nonce() const { return nonce_; }
  // No access to the peer's memory is offered but post() and the window
  // moves: as through an NT window, nothing of a peer is loaded from.
  // Cheap; set once the fabric has seen the peer die.
  bool dead() const { return dead_.load(std::memory_order_acquire); }
  void mark_dead() { dead_.store(true, std::memory_order_release); }
  // Whether the peer lives now (its life word, where the fabric has one):
  // one load, inline, asked around every transfer.
  bool live() {
    if (dead()) return false;
    if (!life_ || life_->load(std::memory_order_acquire) == life_value_) return true;
    mark_dead();
    return false;
  }

 protected:
  uint16_t lid_ = 0;
  uint64_t nonce_ = 0;
  std::atomic<bool> dead_{false};
  const std::atomic<uint32_t> *life_ = nullptr;  // set by the fabric at attach
  uint32_t life_value_ = 0;
};

// The PCIe-level work a process did through its fabric, the input of a
// hardware timing model: posted writes to peers' control memory (boxes,
// mirrors, lanes), node doorbells rung, and one-sided moves of the DMA role
// (a descriptor per contiguous piece).
struct Work {
  uint64_t posts = 0, post_bytes = 0;
  uint64_t doorbells = 0;
  uint64_t dma_writes = 0, dma_write_bytes = 0;
  uint64_t dma_reads = 0, dma_read_bytes = 0;
  // Loads from a peer's memory outside the DMA role: the emulated backend's
  // looks at a peer's doorbell mask (on an NTB the receiving port applies
  // it). Zero in strict mode (PCIENTB_NTB_STRICT=1), where peers are always
  // rung. (The peer's life word stands for the NT port's link state, a local
  // register on hardware: not counted.)
  uint64_t remote_reads = 0;
};

// Status of a data movement: ok, the window is not (or no longer) there, or
// the peer is gone.
enum class MoveStatus { ok, bad_window, peer_dead };

class Fabric {
 public:
  virtual ~Fabric() = default;

  virtual uint16_t lid() const = 0;
  // This node's incarnation, as its peers know it (Peer::nonce).
  virtual uint64_t nonce() const = 0;
  virtual uint64_t node_guid() const = 0;
  virtual const char *name() const = 0;

  // This node's engine area (peer-reachable) and its size.
  virtual void *area() = 0;
  virtual size_t area_size() const = 0;
  // [off, off + len) of the area (whole pages) is no longer used: it reads as
  // zeros from then on, and its memory goes back unless `reuse` (the engine
  // expects to allocate it again soon: keeping it saves faulting it in).
  virtual void discard(size_t off, size_t len, bool reuse) = 0;

  // Whether this node still holds its place on the fabric (a system call);
  // false once its entry was removed or taken: the device is lost.
  virtual bool member() = 0;

  // The peer with this LID (this node itself included), attached on first
  // use; nullptr if no live node has it. Stays valid until the fabric dies.
  virtual Peer *peer(uint16_t lid) = 0;
  // Whether the peer lives now; marks it dead if not (Peer::live, or what
  // else the backend knows). No system call.
  virtual bool check_alive(Peer &peer) = 0;
  // A descriptor that becomes readable when the peer dies, for poll().
  virtual int death_fd(Peer &peer) = 0;

  // Memory registration: make [addr, addr+len) reachable by peers.
  virtual int expose(void *addr, size_t len, WindowId *out) = 0;
  virtual void unexpose(WindowId id) = 0;

  // One-sided movement between local memory and [raddr, raddr+len) of a
  // peer's window. Bounds and rights are the engine's to check beforehand.
  virtual MoveStatus write(Peer &peer, WindowId w, uint64_t raddr, const void *src, size_t len) = 0;
  virtual MoveStatus read(Peer &peer, WindowId w, uint64_t raddr, void *dst, size_t len) = 0;

  // --- the control path of the transport contract (docs/transport.md) ---
  // A posted write of [src, src+len) to [off, off+len) of the peer's area:
  // what a node may do to a peer's control memory (it never loads from it,
  // nor read-modify-writes it). Posts of one thread land in the order they
  // were made (each post's release orders it after the ones before); the
  // words of one post land in any order, aligned 8-byte words whole.
  // EFAULT: the range is not in the peer's area.
  virtual int post(Peer &peer, size_t off, const void *src, size_t len) = 0;
  // Rings the peer's node doorbell: its doorbell_fd() becomes readable,
  // unless the peer masked it (it polls: see polling()) and the ring is
  // maskable (a link's setup is not: the peer serves it from its doorbell).
  virtual void doorbell(Peer &peer, bool maskable = true) = 0;
  // Threads of this node poll for what peers post (called now and then while
  // they do): peers may leave the doorbell alone (the node's mask) until
  // quiet_until_ns() (CLOCK_MONOTONIC; 0: no mask). Once that is past, the
  // node's progress thread calls quiet_ran_out() with it and, if that ended the
  // mask, looks at its lanes: on the kernel fabric a mask stands until it is
  // ended (peers of the other host do not share this clock); on the emulated one
  // peers read the clock, and nothing is to be ended.
  virtual void polling() = 0;
  virtual uint64_t quiet_until_ns() = 0;
  // Ends the mask if it still runs out at `quiet` (a thread that polled since has
  // renewed it: it stands); true if it ended it.
  virtual bool quiet_ran_out(uint64_t /*quiet*/) { return false; }
  // A thread of this node is going to sleep: peers ring from now on. True if
  // that ended a mask (what a peer posted without ringing waits to be taken).
  virtual bool not_polling() = 0;
  // What this process has done through the fabric so far.
  virtual Work work() const = 0;
  // Readable while this node's doorbell has rung since clear_doorbell().
  virtual int doorbell_fd() = 0;
  virtual void clear_doorbell() = 0;
  // Events of the device under the fabric (pcientb.ko's port going down or
  // up, the device going away): a descriptor readable while one is pending
  // (-1: the backend has none), and the next one, an ibv_event_type value
  // (-1: none pending).
  virtual int device_event_fd() { return -1; }
  virtual int device_event() { return -1; }
};

// A fabric seen from outside, for management tools (pcientb-stat): its nodes
// and their areas as they are now, mapped read-only. It never joins, takes no
// lock a node waits for, and changes nothing.
struct NodeView {
  uint16_t lid = 0;
  int32_t pid = 0;
  bool alive = false;          // the process that joined still runs
  const void *area = nullptr;  // its engine area; nullptr if dead or not reachable
  size_t area_size = 0;
  int error = 0;  // why area is nullptr (an errno value), if alive
};
class FabricView {
 public:
  virtual ~FabricView() = default;
  virtual const char *name() const = 0;
  virtual const std::vector<NodeView> &nodes() const = 0;
};

// ---- backends: which one a process uses is decided in one place ----------------

// A backend: how a process joins a fabric as a node, and how tools see fabrics.
struct Backend {
  const char *name;
  // The fabric `name`, this process joining it as a node. `layout`
  // fingerprints the format of what peers read in a node's area (the
  // engine's); every node of a fabric must have the same, or they would
  // misread each other's memory: a join while nodes of another build live
  // fails with EPROTO (and says so on stderr). nullptr and *err (an errno
  // value) on failure.
  std::unique_ptr<Fabric> (*open)(const char *name, uint32_t layout, int *err);
  // The node GUID this process gets, known before it joins.
  uint64_t (*node_guid)();
  // The names of this user's fabrics, sorted.
  std::vector<std::string> (*fabric_names)();
  // A view of the fabric `name`; nullptr and *err (ENOENT: no such fabric;
  // EPROTO: its nodes' `layout` differs) on failure.
  std::unique_ptr<FabricView> (*view)(const char *name, uint32_t layout, int *err);
};

// The emulated fabric (fabric/emu): processes of one machine.
const Backend &emu_backend();

// The kernel fabric (fabric/kernel): the nodes of one host over pcientb.ko,
// named "kernel:<ib device>".
namespace kernel {
const Backend &kernel_backend();
bool is_kernel_fabric(const char *name);
}  // namespace kernel

// The backend of this process: the one installed, else the emulated one.
const Backend &backend();
// The backend of the fabric `name`: the kernel's for "kernel:<device>" (a
// device of pcientb.ko), else backend().
const Backend &backend_for(const char *name);
// Installs a backend before the process first opens a fabric (tests install
// an in-process fake). The backend must outlive every node.
void install_backend(const Backend &b);

}  // namespace pcientb::fabric
