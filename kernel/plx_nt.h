/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The PEX8749 (PLX/Broadcom PEX87xx) NT port's hardware logic, apart from the PCI and NTB
 * glue (ntb_plx.c): every register sequence the driver issues is here, so that the same
 * file is compiled into a userspace test against a register model of the chip
 * (tests/kernel/plx_model). The register facts are beside their names below.
 *
 * What is driven: the NT function's virtual interface (the host side) in back-to-back
 * mode, two chips whose link interfaces face each other. The last memory window's lower
 * half (all of it, if under 2 MiB) reaches the peer chip's registers (doorbells,
 * scratchpads); the other windows, and that window's upper half, are memory windows whose
 * inbound translation the client sets. BAR2 can use the A-LUT, which splits it into 128 or
 * 256 entries with permissions: windows need not be aligned to their size there, and the
 * peer reaches exactly the entries that were set. Without the A-LUT a window is a power of
 * two of at least 1 MiB, aligned to its size (the link BAR is sized to it: the chip has no
 * limit registers). 16 doorbells on one interrupt (INTx: the chip raises MSI only on a
 * 0 -> non-zero change), 8 scratchpads per side.
 *
 * mw_get_align reports 1 MiB (or an A-LUT entry) for both address and size alignment;
 * without the A-LUT a translation must also be a power of two aligned to its own size,
 * which the NTB API cannot say: 1 MiB satisfies both, and anything else is refused
 * (-EINVAL), never rounded.
 */
#ifndef PCIENTB_KERNEL_PLX_NT_H
#define PCIENTB_KERNEL_PLX_NT_H

#ifdef __KERNEL__
#include <linux/types.h>
#include <linux/errno.h>
#include <linux/io.h>
#include <linux/delay.h>

static inline u32 plx_rd(void __iomem *base, u32 off)
{
	return ioread32(base + off);
}

static inline void plx_wr(void __iomem *base, u32 off, u32 val)
{
	iowrite32(val, base + off);
}

static inline u16 plx_rd16(void __iomem *base, u32 off)
{
	return ioread16(base + off);
}

static inline void plx_wr16(void __iomem *base, u32 off, u16 val)
{
	iowrite16(val, base + off);
}

/* Waits between register polls, in process context. */
static inline void plx_delay_us(unsigned int us)
{
	usleep_range(us, 2 * us);
}
#else
#include "plx_nt_user.h" /* the register model's plx_rd/plx_wr, kernel types */
#endif

#define PLX_VENDOR 0x10b5
#define PLX_MAX_MWS 4 /* BAR2..5 */
#define PLX_SPADS 8
/* The last scratchpad holds the order word (below); clients get the others. */
#define PLX_ORDER_SPAD (PLX_SPADS - 1)
#define PLX_CLIENT_SPADS (PLX_SPADS - 1)
#define PLX_DBS 16
#define PLX_DB_MASK ((1ull << PLX_DBS) - 1)
#define PLX_MIN_BAR (1ull << 20) /* link BARs: at least 1 MiB */
#define PLX_MAX_RIDS 14 /* requester-ID LUT entries after the root complex and the NT */

/* The NT function's BAR0 maps the chip's 256 KiB register space. */
#define PLX_REGS_SIZE 0x40000
#define PLX_NT0_BASE 0x3e000
#define PLX_NT1_BASE 0x3c000
#define PLX_LINK_IF 0x1000 /* the link interface's registers, after the virtual one's */

/* In the NT function's configuration space (and at its interface base in BAR0). */
#define PLX_CFG_NT_ID 0xc8c /* bit 0: NT1; bit 31: link interface */
#define PLX_NT_ID_NT1 0x1
#define PLX_NT_ID_LINK 0x80000000u

/* Chip registers (BAR0 offsets). */
#define PLX_PORT_CFG 0x360 /* NT0 port: bits 12:8, NT1: 20:16; A-LUT: bits 31:30 */
#define PLX_PORT_CONTROL(port) ((((port) & ~7u) << 12) + 0x208) /* bit port&7: link off */
#define PLX_ALUT(idx) (0x38000 + (idx))

/* Interface registers (offsets from the interface's base). */
#define PLX_IF_BAR(bar) (0x10 + 4 * (bar))
#define PLX_IF_COMMAND 0x04
#define PLX_IF_BAR0_SETUP 0xe4 /* 2: 32-bit, 3: 64-bit */
#define PLX_IF_BAR_SETUP(bar) (0xe8 + ((bar)-2) * 4)
#define PLX_IF_XLAT(bar) (0xc3c + ((bar)-2) * 4) /* where the BAR's accesses go */
#define PLX_IF_DB_SET 0xc4c /* virtual interface's doorbells */
#define PLX_IF_DB_CLEAR 0xc50
#define PLX_IF_DB_MASK_SET 0xc54
#define PLX_IF_DB_MASK_CLEAR 0xc58
#define PLX_IF_SPAD(i) (0xc6c + 4 * (i))
#define PLX_IF_RID 0xc90 /* the interface's own requester ID */
#define PLX_IF_ALUT_CTL 0xc94
#define PLX_ALUT_ON 0x10000000u
#define PLX_IF_RID_LUT_VIRT 0xd94 /* requesters let through, two per dword */
#define PLX_IF_RID_LUT_LINK 0xdb4
#define PLX_IF_LINK_ERR 0xfe0 /* virtual interface: link error status, write 1 to clear */
#define PLX_IF_LINK_ERR_MASK 0xfe4
#define PLX_LINK_ERR_ALL 0xf
#define PLX_LINK_ERR_DL_DOWN 0x4 /* the link went down: the link interface was reset */

/*
 * The order word: a driver runs on this side (magic), its random tag (24 bits), and the
 * NTB port number it took (0 or 1) once decided, plus one; 0 while undecided.
 */
#define PLX_ORDER_MAGIC 0xa4u
#define PLX_ORDER_MAGIC_MASK 0xfcu
#define PLX_ORDER_PORT_MASK 0x3u
#define PLX_ORDER_TAG_SHIFT 8

#define PLX_CMD_MEM 0x2
#define PLX_CMD_MASTER 0x4

/* Link-side addresses of window BARs in back-to-back mode: one 2^61 slot per BAR. */
#define PLX_B2B_ADDR(bar) (0x2000000000000000ull * (bar))

struct plx_mw {
	int bar; /* 2..5 */
	bool is64;
	u64 phys; /* where the host sees the BAR */
	u64 size;
	void __iomem *virt; /* mapped, for the B2B window only (the peer's registers) */
	u64 xlat_addr, xlat_size; /* the inbound translation the client set (0 size: none) */
};

struct plx_nt {
	void __iomem *regs; /* BAR0 */
	unsigned int ntx; /* 0: NT0, 1: NT1 */
	unsigned int port; /* the chip port of the NT function */
	unsigned int alut; /* A-LUT entries / 128 (0: none) */
	struct plx_mw mw[PLX_MAX_MWS];
	int mw_count;
	int b2b_mw; /* the window that reaches the peer chip's registers */
	u64 b2b_off; /* where that window's memory part starts (0: none) */
	u16 rids[PLX_MAX_RIDS]; /* more requesters let out (DMA functions): bus << 8 | dev << 3 */
	int rid_count;
	u32 order_word; /* ours, in PLX_ORDER_SPAD */
};

/* Set-up: identify, windows (in BAR order), then plx_nt_start. */
int plx_nt_identify(struct plx_nt *nt, void __iomem *regs, u32 nt_id);
int plx_nt_add_mw(struct plx_nt *nt, int bar, bool is64, u64 phys, u64 size);
/* A requester (bus, device; any function) whose accesses may cross: a DMA engine's. */
int plx_nt_add_requester(struct plx_nt *nt, u8 bus, u8 dev);
int plx_nt_start(struct plx_nt *nt, void __iomem *b2b_virt); /* doorbells masked */
void plx_nt_irq_on(struct plx_nt *nt); /* link errors raise the interrupt: after request_irq */
void plx_nt_init(struct plx_nt *nt); /* the static configuration, also after DL_Down */
void plx_nt_stop(struct plx_nt *nt);

/* Memory windows, numbered for the client (the B2B window's memory part last). */
int plx_nt_mw_count(const struct plx_nt *nt);
int plx_nt_mw_get_align(const struct plx_nt *nt, int idx, u64 *addr_align, u64 *size_align,
			u64 *size_max);
int plx_nt_mw_set_trans(struct plx_nt *nt, int idx, u64 addr, u64 size);
int plx_nt_mw_clear_trans(struct plx_nt *nt, int idx);
int plx_nt_peer_mw_get_addr(const struct plx_nt *nt, int idx, u64 *phys, u64 *size);

/* Doorbells and scratchpads. */
u64 plx_nt_db_read(struct plx_nt *nt);
void plx_nt_db_clear(struct plx_nt *nt, u64 bits);
u64 plx_nt_db_read_mask(struct plx_nt *nt);
void plx_nt_db_set_mask(struct plx_nt *nt, u64 bits);
void plx_nt_db_clear_mask(struct plx_nt *nt, u64 bits);
void plx_nt_peer_db_set(struct plx_nt *nt, u64 bits);
/* Scratchpads 0..PLX_CLIENT_SPADS-1 (the order word's is the driver's). */
int plx_nt_spad_read(struct plx_nt *nt, int idx, u32 *val);
int plx_nt_spad_write(struct plx_nt *nt, int idx, u32 val);
int plx_nt_peer_spad_read(struct plx_nt *nt, int idx, u32 *val);
int plx_nt_peer_spad_write(struct plx_nt *nt, int idx, u32 val);

/*
 * The two sides' NTB port numbers, 0 and 1, which back-to-back chips do not give: each
 * side's LIDs come from its number's half, so the two must differ. At start a side
 * writes its order word (undecided, with a random tag of 24 bits: plx_nt_order_init);
 * once the link is up plx_nt_order reads the peer's, in one read (a decision made from
 * one consistent word on each side cannot disagree): a peer that has decided leaves the
 * other number, else the lower tag takes 0; either way the number is written into our
 * word, and kept while the driver runs (its contexts hold LIDs of that half), so a peer
 * that reloads takes the other one. Returns the number, or -EAGAIN (no peer word: the
 * link is down or no driver runs there), -ENOTUNIQ (the same tag: the caller draws
 * another), -EBUSY (both sides hold the same number: a peer that decided against another
 * host; ours is kept). plx_nt_order_clear takes the word back when the driver goes.
 */
void plx_nt_order_init(struct plx_nt *nt, u32 tag);
int plx_nt_order(struct plx_nt *nt);
void plx_nt_order_clear(struct plx_nt *nt);

/* The link: enabled at the chip's port control; up when LNKSTA has a width (glue). */
bool plx_nt_link_enabled(struct plx_nt *nt);
void plx_nt_link_enable(struct plx_nt *nt, bool on);
/*
 * The link error bits that were set (cleared now). On DL_Down the static configuration and
 * the windows' translations are written again (the chip reset the link interface); the
 * caller reports a link event.
 */
u32 plx_nt_link_errors(struct plx_nt *nt);
/*
 * The interrupt handler's work: *db, the doorbells pending and unmasked (masked now, as
 * the line is level-triggered: the client clears and unmasks them), *errs as above.
 * -ENODEV: the registers read as all ones (the device is gone).
 */
int plx_nt_isr(struct plx_nt *nt, u64 *db, u32 *errs);

#endif
