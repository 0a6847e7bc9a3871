// The PEX8749 register model (plx_model.hpp), and plx_rd/plx_wr for kernel/plx_nt.c.
#include "plx_model.hpp"

#include <algorithm>
#include <cstring>

#include "plx_nt_user.h"

namespace plx_model {
namespace {
constexpr uint32_t kDbSet = 0xc4c, kDbClear = 0xc50, kDbMaskSet = 0xc54, kDbMaskClear = 0xc58;
constexpr uint32_t kLinkErr = 0xfe0, kLinkErrMask = 0xfe4, kAlutCtl = 0xc94;
constexpr uint32_t kAlutOn = 0x10000000, kCmdMem = 0x2;
constexpr uint32_t kAlutBase = 0x38000, kAlutEnd = 0x3c000;
constexpr uint32_t kDlDown = 0x4;

uint32_t port_control(int port) {
  return ((static_cast<uint32_t>(port) & ~7u) << 12) + 0x208;
}
}  // namespace

Chip::Chip(int ntx_, int port_, unsigned alut_bits, uint64_t ram_base_, size_t ram_size)
    : ntx(ntx_), port(port_), ram_base(ram_base_), ram(ram_size), regs(kRegs / 4) {
  regs[0x360 / 4] = (static_cast<uint32_t>(port) << (ntx ? 16 : 8)) | (alut_bits << 30);
  regs[port_control(port) / 4] = 1u << (port & 7);  // the link starts disabled
  regs[(nt_base() + kLinkErrMask) / 4] = 0xf;       // and its errors masked
  regs[(nt_base() + 0xc90) / 4] = 0x0208;           // the NT function: bus 2, device 1
  for (int i = 0; i < 6; ++i) bar_map[i] = Mapping{this, i};
  dma.chip = this;
}

uint32_t Chip::read(uint32_t off) {
  const uint32_t v = nt_base();
  if (!present) return ~0u;  // surprise removal: reads return all ones
  if (off == v + kDbSet || off == v + kDbClear) return db;
  if (off == v + kDbMaskSet || off == v + kDbMaskClear) return db_mask;
  if (off == v + kLinkErr) return link_err;
  return regs[off / 4];
}

void Chip::write(uint32_t off, uint32_t val) {
  const uint32_t v = nt_base();
  writes.emplace_back(off, val);
  if (off == v + kDbSet) {
    db |= val & 0xffff;
  } else if (off == v + kDbClear) {
    db &= ~val;
  } else if (off == v + kDbMaskSet) {
    db_mask |= val & 0xffff;
  } else if (off == v + kDbMaskClear) {
    db_mask &= ~val;
  } else if (off == v + kLinkErr) {
    link_err &= ~val;
  } else {
    regs[off / 4] = val;
    if (off == port_control(port) && fabric) fabric->update();
  }
}

bool Chip::irq() const {
  return (db & ~db_mask & 0xffff) || (link_err & ~reg(nt_base() + kLinkErrMask) & 0xf);
}

bool Chip::link_enabled() const {
  return !(reg(port_control(port)) & (1u << (port & 7)));
}

void Chip::add_bar(int n, bool is64, uint64_t phys, uint64_t size) {
  bars.push_back(Bar{n, is64, phys, size});
}

const Chip::Bar *Chip::bar(int n) const {
  for (const Bar &b : bars)
    if (b.bar == n) return &b;
  return nullptr;
}

uint8_t *Chip::ram_at(uint64_t addr, size_t len) {
  if (addr < ram_base || addr - ram_base > ram.size() || len > ram.size() - (addr - ram_base))
    return nullptr;
  return ram.data() + (addr - ram_base);
}

unsigned Chip::alut() const {
  const uint32_t bits = reg(0x360) >> 30;
  if (bits == 3) return 1;
  return (bits & (1u << ntx)) ? 2 : 0;
}

// The link-to-virtual A-LUT: 256 entries in two blocks of 128 (the second 0x1000 on),
// or, when both NTs have one, 128 entries in NTx's own block.
uint32_t Chip::alut_reg(uint32_t e) const {
  if (alut() == 2) return kAlutBase + 0x2000 + (e < 128 ? 4 * e : 0x1000 + 4 * (e - 128));
  return kAlutBase + 0x1000 * (1 + 2 * static_cast<uint32_t>(ntx)) + 4 * e;
}

void Chip::reset_link_side() {
  std::fill(regs.begin() + link_base() / 4, regs.begin() + (link_base() + 0x1000) / 4, 0);
  std::fill(regs.begin() + kAlutBase / 4, regs.begin() + kAlutEnd / 4, 0);
}

bool Chip::host_write(int n, uint64_t off, const void *src, size_t len) {
  return outbound(n, off, const_cast<void *>(src), len, true);
}

bool Chip::host_read(int n, uint64_t off, void *dst, size_t len) {
  return outbound(n, off, dst, len, false);
}

// The virtual interface's requester-ID LUT: 16 entries (bus, device, enable) from 0xD94.
// The index of the requester's entry (its requests cross the link as device `index` of
// bus 0, function passed through), or -1.
int Chip::lut_index(uint16_t rid) const {
  for (uint32_t i = 0; i < 16; ++i) {
    const uint32_t e = (reg(nt_base() + 0xd94 + (i / 2) * 4) >> (16 * (i % 2))) & 0xffff;
    if ((e & 1) && (e & 0xfff8) == (rid & 0xfff8)) return static_cast<int>(i);
  }
  return -1;
}

// The link interface's requester-ID LUT (32 entries from 0xDB4): whether a requester that
// crossed as device `dev` of bus 0 is let in.
bool Chip::lets_in(int dev) const {
  for (uint32_t i = 0; i < 32; ++i) {
    const uint32_t e = (reg(link_base() + 0xdb4 + (i / 2) * 4) >> (16 * (i % 2))) & 0xffff;
    if ((e & 1) && (e & 0xfff8) == static_cast<uint32_t>(dev) << 3) return true;
  }
  return false;
}

bool Chip::outbound(int n, uint64_t off, void *dst, size_t len, bool write, uint16_t rid) {
  const Bar *b = bar(n);
  const uint32_t v = nt_base();
  auto drop = [&] {
    ++counts.dropped;
    if (!write) std::memset(dst, 0xff, len);
    return false;
  };
  if (!b || off > b->size || len > b->size - off) return drop();
  // Out of this host only if the requester-ID LUT lets the requester out (the CPU: the
  // root complex, 0:0.0), the link is up and no outbound A-LUT is on (not modelled).
  const int crossed = lut_index(rid);
  if (crossed < 0 || !fabric->link_up() || (reg(link_base() + kAlutCtl) & kAlutOn)) return drop();
  uint64_t to = reg(v + 0xc3c + (n - 2) * 4);
  if (b->is64) to |= uint64_t{reg(v + 0xc3c + (n - 2) * 4 + 4)} << 32;
  if (!peer->inbound(to + off, dst, len, write, crossed)) return drop();
  ++counts.delivered;
  return true;
}

// Link BAR j (2..5) as its setup and address registers make it (size 0: disabled).
Chip::LinkBar Chip::link_bar(int j) const {
  const uint32_t l = link_base(), setup = reg(l + 0xe8 + (j - 2) * 4);
  LinkBar b{};
  b.is64 = setup & 0x4;
  uint64_t mask = setup & ~0xfffffull;
  mask |= b.is64 ? uint64_t{reg(l + 0xe8 + (j - 1) * 4)} << 32 : 0xffffffff00000000ull;
  b.base = reg(l + 0x10 + 4 * j) & ~0xfull;
  if (b.is64) b.base |= uint64_t{reg(l + 0x14 + 4 * j)} << 32;
  if ((mask & 0xfff00000ull) || (b.is64 && (mask >> 32))) b.size = ~mask + 1;
  return b;
}

bool Chip::inbound(uint64_t addr, void *buf, size_t len, bool write, int dev) {
  const uint32_t l = link_base(), v = nt_base();
  auto refuse = [&] {
    ++counts.dropped;
    return false;
  };
  if (!(reg(l + 0x04) & kCmdMem) || !lets_in(dev)) return refuse();
  // Which BARs claim the address (bases masked to their size); more than one is a
  // misconfiguration the access does not survive.
  int claims = 0;
  {
    const uint32_t t = reg(l + 0xe4);
    uint64_t b0 = reg(l + 0x10) & ~0xfull;
    if (t == 3) b0 |= uint64_t{reg(l + 0x14)} << 32;
    claims += (t == 2 || t == 3) && addr >= (b0 & ~uint64_t{kRegs - 1}) &&
              addr - (b0 & ~uint64_t{kRegs - 1}) < kRegs;
    for (int j = 2; j <= 5; ++j) {
      const LinkBar b = link_bar(j);
      claims += b.size && (addr & ~(b.size - 1)) == (b.base & ~(b.size - 1));
      if (b.is64) ++j;
    }
  }
  if (claims > 1) return refuse();
  // Link BAR0: this chip's registers (32-bit accesses).
  const uint32_t type = reg(l + 0xe4);
  if (type == 2 || type == 3) {
    uint64_t base = reg(l + 0x10) & ~0xfull;
    if (type == 3) base |= uint64_t{reg(l + 0x14)} << 32;
    if (addr >= base && addr - base < kRegs) {
      const auto off = static_cast<uint32_t>(addr - base);
      if (len != 4 || off % 4) return refuse();
      uint32_t val;
      if (write) {
        std::memcpy(&val, buf, 4);
        this->write(off, val);
      } else {
        val = read(off);
        std::memcpy(buf, &val, 4);
      }
      ++counts.delivered;
      return true;
    }
  }
  for (int j = 2; j <= 5; ++j) {
    const LinkBar lb = link_bar(j);
    const bool is64 = lb.is64;
    const uint64_t base = lb.base, size = lb.size;
    const int next = is64 ? j + 1 : j;
    if (!size || addr < base || addr - base >= size) {  // disabled, or not its address
      j = next;
      continue;
    }
    const uint64_t off = addr - base;
    if (len > size - off) return refuse();
    auto *bytes = static_cast<uint8_t *>(buf);
    if (j == 2 && (reg(v + kAlutCtl) & kAlutOn)) {
      // Each entry's piece: its own address and permission (bit 0 read, bit 1 write).
      if (!alut()) return refuse();  // turned on in a chip that has none
      const uint64_t esize = size / (128ull * alut());
      for (uint64_t done = 0; done < len;) {
        const auto e = static_cast<uint32_t>((off + done) / esize);
        const uint64_t in = (off + done) % esize, n = std::min<uint64_t>(len - done, esize - in);
        if (!(reg(alut_reg(e) + 0x800) & (write ? 2u : 1u))) return refuse();
        const uint64_t at = (reg(alut_reg(e)) | uint64_t{reg(alut_reg(e) + 0x400)} << 32) + in;
        uint8_t *p = ram_at(at, n);
        if (!p) return refuse();
        write ? std::memcpy(p, bytes + done, n) : std::memcpy(bytes + done, p, n);
        done += n;
      }
      return true;
    }
    uint64_t at = reg(l + 0xc3c + (j - 2) * 4);
    if (is64) at |= uint64_t{reg(l + 0xc3c + (j - 1) * 4)} << 32;
    uint8_t *p = ram_at(at + off, len);
    if (!p) return refuse();
    write ? std::memcpy(p, bytes, len) : std::memcpy(bytes, p, len);
    return true;
  }
  return refuse();
}

Fabric::Fabric(unsigned alut_bits_a, unsigned alut_bits_b, int ntx, uint64_t b_ram)
    : a(ntx, ntx ? 17 : 8, alut_bits_a, 0x100000000ull, 32u << 20),
      b(ntx, ntx ? 17 : 8, alut_bits_b, b_ram, 32u << 20) {
  a.peer = &b;
  b.peer = &a;
  a.fabric = b.fabric = this;
}

bool Fabric::link_up() const {
  return cable_in && a.link_enabled() && b.link_enabled();
}

void Fabric::set_cable(bool in) {
  cable_in = in;
  update();
}

void Fabric::update() {
  const bool up = link_up();
  if (was_up && !up) {
    for (Chip *c : {&a, &b}) {
      c->link_err |= kDlDown;
      c->reset_link_side();
    }
  }
  was_up = up;
}

// ---- DMA engine ----------------------------------------------------------------------

namespace {
constexpr uint16_t kPause = 0x1, kAbort = 0x2, kStart = 0x8, kModeBits = 0x4 | (3 << 5);
constexpr uint16_t kDescInvalid = 0x100, kPauseDone = 0x200, kAbortDone = 0x400;
constexpr uint16_t kStatusBits = kDescInvalid | kPauseDone | kAbortDone | 0x1000;
constexpr uint16_t kIntError = 0x1, kIntInvDesc = 0x2, kIntDone = 0x4, kIntAbortDone = 0x8;
constexpr uint32_t kValid = 0x80000000u, kIrqWhenDone = 0x40000000u, kLenMask = 0x7ffffff;
constexpr uint32_t kWbOk = 0x40000000u, kWbReadFail = 0x20000000u, kWbWriteFail = 0x10000000u;
}  // namespace

uint32_t Dma::read(uint32_t off, int bytes) {
  switch (off) {
    case 0x214:
      return ring_lo;
    case 0x218:
      return ring_hi;
    case 0x21c:
      return next;
    case 0x220:
      return count;
    case 0x234:
      return prefetch;
    case 0x238: {
      const uint32_t c = mode | status | (running ? kStart : 0);
      return bytes == 4 ? c | uint32_t{ctrl2} << 16 : c;
    }
    case 0x23a:
      return ctrl2;
    case 0x23c:
      return bytes == 4 ? intr_ctrl | uint32_t{intr_status} << 16 : intr_ctrl;
    case 0x23e:
      return intr_status;
    default:
      return 0;
  }
}

void Dma::write(uint32_t off, uint32_t val, int bytes) {
  switch (off) {
    case 0x214:
      ring_lo = val;
      break;
    case 0x218:
      ring_hi = val;
      break;
    case 0x21c:
      next = val;
      break;
    case 0x220:
      count = val;
      break;
    case 0x234:
      prefetch = val;
      break;
    case 0x238:
      if (bytes == 4) ctrl2 = static_cast<uint16_t>(val >> 16);
      control(static_cast<uint16_t>(val));
      break;
    case 0x23c:
      intr_ctrl = static_cast<uint16_t>(val);
      if (bytes == 4) intr_status &= ~static_cast<uint16_t>(val >> 16);
      break;
    case 0x23e:
      intr_status &= ~static_cast<uint16_t>(val);
      break;
    default:
      break;
  }
}

void Dma::control(uint16_t v) {
  status &= ~(v & kStatusBits);
  mode = v & kModeBits;
  if ((v & kPause) && !stuck) {
    running = false;
    status |= kPauseDone;
  }
  if ((v & kAbort) && !stuck) {
    running = false;
    status |= kAbortDone;
    intr_status |= kIntAbortDone;
  }
  if ((v & kStart) && !(v & (kPause | kAbort))) running = true;
  if (running && !manual) step(1 << 30);
}

bool Dma::irq() const {
  return intr_status & (kIntDone | (intr_ctrl & (kIntError | kIntInvDesc | kIntAbortDone)));
}

// Host memory, or a window BAR of this host: then through the NT port.
bool Dma::access(uint64_t addr, void *buf, size_t len, bool write) {
  if (uint8_t *p = chip->ram_at(addr, len)) {
    write ? std::memcpy(p, buf, len) : std::memcpy(buf, p, len);
    return true;
  }
  for (const Chip::Bar &b : chip->bars)
    if (addr >= b.phys && addr - b.phys < b.size)
      return chip->outbound(b.bar, addr - b.phys, buf, len, write, rid);
  return false;
}

int Dma::step(int budget) {
  int n = 0;
  while (running && n < budget) {
    if (!count || next < ring_lo || next >= ring_lo + 16ull * count || (next - ring_lo) % 16) {
      running = false;
      intr_status |= kIntInvDesc;
      break;
    }
    const uint64_t at = uint64_t{ring_hi} << 32 | next;
    uint8_t *d = chip->ram_at(at, 16);
    uint32_t flags = 0;
    if (d) std::memcpy(&flags, d, 4);
    if (!d || !(flags & kValid)) {  // the ring is empty here: the engine waits
      running = false;
      status |= kDescInvalid;
      break;
    }
    uint16_t dst_hi, src_hi;
    uint32_t dst_lo, src_lo;
    std::memcpy(&dst_hi, d + 4, 2);
    std::memcpy(&src_hi, d + 6, 2);
    std::memcpy(&dst_lo, d + 8, 4);
    std::memcpy(&src_lo, d + 12, 4);
    const uint32_t len = flags & kLenMask;
    std::vector<uint8_t> buf(len);
    uint32_t wb;
    if (!access(uint64_t{src_hi} << 32 | src_lo, buf.data(), len, false))
      wb = kWbReadFail;
    else if (!access(uint64_t{dst_hi} << 32 | dst_lo, buf.data(), len, true))
      wb = kWbWriteFail;
    else
      wb = kWbOk | len;
    if (mode & 0x4) std::memcpy(d, &wb, 4);  // write-back: VALID clear
    next = next + 16 >= ring_lo + 16ull * count ? ring_lo : next + 16;
    ++n;
    ++ran;
    if (!(wb & kWbOk)) {
      running = false;
      intr_status |= kIntError;
      break;
    }
    if (flags & kIrqWhenDone) intr_status |= kIntDone;
  }
  return n;
}

}  // namespace plx_model

extern "C" u32 plx_rd(void *base, u32 off) {
  auto *m = static_cast<plx_model::Mapping *>(base);
  if (m->bar == plx_model::kDmaBar) return m->chip->dma.read(off, 4);
  if (m->bar == 0) return off < plx_model::kRegs && off % 4 == 0 ? m->chip->read(off) : ~0u;
  uint32_t v;
  m->chip->host_read(m->bar, off, &v, 4);
  return v;
}

extern "C" void plx_wr(void *base, u32 off, u32 val) {
  auto *m = static_cast<plx_model::Mapping *>(base);
  if (m->bar == plx_model::kDmaBar) return m->chip->dma.write(off, val, 4);
  if (m->bar == 0) {
    if (off < plx_model::kRegs && off % 4 == 0) m->chip->write(off, val);
    return;
  }
  m->chip->host_write(m->bar, off, &val, 4);
}

// 16-bit accesses: the DMA engine's control and interrupt registers only.
extern "C" u16 plx_rd16(void *base, u32 off) {
  auto *m = static_cast<plx_model::Mapping *>(base);
  return m->bar == plx_model::kDmaBar ? static_cast<u16>(m->chip->dma.read(off, 2)) : 0xffff;
}

extern "C" void plx_wr16(void *base, u32 off, u16 val) {
  auto *m = static_cast<plx_model::Mapping *>(base);
  if (m->bar == plx_model::kDmaBar) m->chip->dma.write(off, val, 2);
}

// The model runs synchronously: waiting changes nothing.
extern "C" void plx_delay_us(unsigned int) {}
