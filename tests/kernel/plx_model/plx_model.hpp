// A register-level model of two PEX8749 chips whose NT link interfaces face each other
// (back-to-back), each with a host on its NT virtual interface: what kernel/plx_nt.c is
// tested against. It models what the driver depends on:
// - each chip's 256 KiB register space (the NT function's BAR0), with the doorbell
//   set/clear/mask registers, write-1-to-clear link error status, and plain storage
//   elsewhere (every write is logged);
// - a host's access to one of its window BARs: let out only if the virtual interface's
//   requester-ID LUT lets the root complex out, translated by the virtual-to-link
//   translation, and taken by the peer chip's link interface if its memory decoding is
//   on, its requester-ID LUT lets the requester in, and a link BAR (BAR0: the chip's
//   registers; BAR2..5: sized by their setup registers) claims the address; then the
//   link BAR's translation, or for BAR2 with the A-LUT on the entry's address and
//   permission, names host memory; what names nothing is dropped (a read returns ones);
// - the link: up while both chips' ports are enabled (port control) and the cable is in;
//   going down sets DL_Down in both virtual interfaces' link error status and resets
//   the link interfaces' registers and the A-LUT (the driver must write them again);
// - INTx: asserted while a doorbell bit is set and unmasked, or a link error unmasked;
// - each chip's DMA engine (one channel, its own BAR0): the descriptor ring in host
//   memory, run from the next pointer while descriptors are valid, written back with
//   status and bytes moved; reads and writes go to host memory, or through the NT port
//   when they address a window BAR (then as the DMA function's requester ID, which the
//   NT's requester-ID LUT must let out); a failed descriptor stops the engine and raises
//   the error interrupt; pause and abort; a "manual" mode runs descriptors only when the
//   test steps it, and a "stuck" engine ignores pause and abort.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace plx_model {

constexpr uint32_t kRegs = 0x40000;

struct Chip;
struct Fabric;

// What a driver maps: a host's BAR0 (its chip's registers), one of its window BARs, or
// (kDmaBar) the DMA function's BAR0.
constexpr int kDmaBar = -1;
struct Mapping {
  Chip *chip;
  int bar;
};

// The DMA engine of a chip.
struct Dma {
  uint32_t read(uint32_t off, int bytes);
  void write(uint32_t off, uint32_t val, int bytes);
  bool irq() const;
  int step(int budget);  // runs up to `budget` descriptors; how many ran

  Chip *chip = nullptr;
  uint16_t rid = 0x0310;  // requester ID: bus 3, device 2
  bool manual = false, stuck = false;
  uint32_t ring_lo = 0, ring_hi = 0, next = 0, count = 0, prefetch = 0;
  uint16_t mode = 0, status = 0, ctrl2 = 0, intr_ctrl = 0, intr_status = 0;
  bool running = false;
  uint64_t ran = 0;

 private:
  void control(uint16_t v);
  bool access(uint64_t addr, void *buf, size_t len, bool write);
};

struct Counts {
  uint64_t dropped = 0;  // accesses that reached nothing (or were refused)
  uint64_t delivered = 0;
};

struct Chip {
  Chip(int ntx, int port, unsigned alut_bits, uint64_t ram_base, size_t ram_size);

  // The NT function's configuration dword 0xC8C (identification).
  uint32_t nt_id() const { return ntx ? 1u : 0u; }
  uint32_t nt_base() const { return ntx ? 0x3c000 : 0x3e000; }
  uint32_t link_base() const { return nt_base() + 0x1000; }

  // Register accesses from this chip's host (BAR0) or from the peer (link BAR0).
  uint32_t read(uint32_t off);
  void write(uint32_t off, uint32_t val);
  uint32_t reg(uint32_t off) const { return regs[off / 4]; }

  // The host's window BARs, as its BIOS would have sized and placed them.
  void add_bar(int bar, bool is64, uint64_t phys, uint64_t size);
  struct Bar {
    int bar;
    bool is64;
    uint64_t phys, size;
  };
  const Bar *bar(int n) const;

  // The host's CPU writes or reads through window BAR `bar` at `off`.
  bool host_write(int bar, uint64_t off, const void *src, size_t len);
  bool host_read(int bar, uint64_t off, void *dst, size_t len);

  bool irq() const;
  bool link_enabled() const;
  uint8_t *ram_at(uint64_t addr, size_t len);

  Mapping regs_map{this, 0};
  Mapping bar_map[6]{};
  Mapping dma_map{this, kDmaBar};
  Dma dma;
  int ntx, port;
  uint64_t ram_base;
  std::vector<uint8_t> ram;
  std::vector<Bar> bars;
  std::vector<uint32_t> regs;
  std::vector<std::pair<uint32_t, uint32_t>> writes;  // (offset, value) from the host
  uint32_t db = 0, db_mask = 0, link_err = 0;
  Chip *peer = nullptr;
  Fabric *fabric = nullptr;
  bool present = true;  // false: surprise removal
  Counts counts;

 private:
  friend struct Fabric;
  friend struct Dma;
  // An access through window BAR `bar` by requester `rid` (bus << 8 | device << 3).
  bool outbound(int bar, uint64_t off, void *buf, size_t len, bool write, uint16_t rid = 0);
  struct LinkBar {
    uint64_t base, size;
    bool is64;
  };
  LinkBar link_bar(int j) const;
  int lut_index(uint16_t rid) const;
  bool lets_in(int dev) const;
  // An access that arrived at this chip's link interface.
  bool inbound(uint64_t link_addr, void *buf, size_t len, bool write, int dev);
  unsigned alut() const;
  uint32_t alut_reg(uint32_t e) const;
  void reset_link_side();
};

// Two hosts and their chips, back to back.
struct Fabric {
  // Both chips' NTs are NTx `ntx` (port 8, or 17 for NT1); B's memory starts at b_ram.
  Fabric(unsigned alut_bits_a, unsigned alut_bits_b, int ntx = 0, uint64_t b_ram = 0x200000000ull);
  bool link_up() const;
  // Pulls or plugs the cable; a link that goes down reports DL_Down on both sides.
  void set_cable(bool in);
  // Call after any change of port control: a link that went down reports DL_Down.
  void update();

  bool cable_in = true;
  bool was_up = false;
  Chip a, b;
};

}  // namespace plx_model
