// SPDX-License-Identifier: GPL-2.0
/*
 * PEX8749 NT port: the register sequences (see plx_nt.h). No locking here: the glue
 * serialises set-up and window changes; doorbell and scratchpad registers are single
 * writes the chip applies atomically (set/clear registers, never read-modify-write).
 */
#include "plx_nt.h"

static u32 nt_base(const struct plx_nt *nt)
{
	return nt->ntx ? PLX_NT1_BASE : PLX_NT0_BASE;
}

/* The virtual interface (ours) and the link interface of our NT function. */
static u32 rd_virt(const struct plx_nt *nt, u32 off)
{
	return plx_rd(nt->regs, nt_base(nt) + off);
}

static void wr_virt(const struct plx_nt *nt, u32 off, u32 val)
{
	plx_wr(nt->regs, nt_base(nt) + off, val);
}

static void wr_link(const struct plx_nt *nt, u32 off, u32 val)
{
	plx_wr(nt->regs, nt_base(nt) + PLX_LINK_IF + off, val);
}

/* A 64-bit register pair, or its low half for a 32-bit BAR. */
static void wr_link_addr(const struct plx_nt *nt, u32 off, u64 val, bool is64)
{
	wr_link(nt, off, (u32)val);
	if (is64)
		wr_link(nt, off + 4, (u32)(val >> 32));
}

/* The peer chip's registers, through the B2B window's lower part. */
static void __iomem *peer_regs(const struct plx_nt *nt)
{
	return nt->mw[nt->b2b_mw].virt;
}

static bool is_pow2(u64 v)
{
	return v && !(v & (v - 1));
}

int plx_nt_identify(struct plx_nt *nt, void __iomem *regs, u32 nt_id)
{
	u32 cfg, alut;

	*nt = (struct plx_nt){ .regs = regs, .b2b_mw = -1 };
	/* The link interface faces a root port (NTB-to-root-port mode): not driven. */
	if (nt_id & PLX_NT_ID_LINK)
		return -EOPNOTSUPP;
	nt->ntx = nt_id & PLX_NT_ID_NT1;
	cfg = plx_rd(regs, PLX_PORT_CFG);
	nt->port = (cfg >> (nt->ntx ? 16 : 8)) & 0x1f;
	alut = cfg >> 30;
	if (alut == 3)
		nt->alut = 1; /* both NTs: 128 entries each */
	else
		nt->alut = (alut & (1u << nt->ntx)) ? 2 : 0;
	return 0;
}

int plx_nt_add_mw(struct plx_nt *nt, int bar, bool is64, u64 phys, u64 size)
{
	struct plx_mw *m;

	if (nt->mw_count == PLX_MAX_MWS || bar < 2 || bar > (is64 ? 4 : 5) ||
	    (nt->mw_count && bar <= nt->mw[nt->mw_count - 1].bar + nt->mw[nt->mw_count - 1].is64))
		return -EINVAL;
	/* A link BAR is a power of two of at least 1 MiB; the B2B part needs 256 KiB. */
	if (!is_pow2(size) || size < PLX_MIN_BAR)
		return -EINVAL;
	m = &nt->mw[nt->mw_count++];
	*m = (struct plx_mw){ .bar = bar, .is64 = is64, .phys = phys, .size = size };
	return 0;
}

int plx_nt_add_requester(struct plx_nt *nt, u8 bus, u8 dev)
{
	if (nt->rid_count == PLX_MAX_RIDS || dev > 31)
		return -ENOSPC;
	nt->rids[nt->rid_count++] = (u16)(bus << 8 | dev << 3);
	return 0;
}

/* The window's memory part: the B2B window's starts after the peer's registers. */
static u64 mw_off(const struct plx_nt *nt, int i)
{
	return i == nt->b2b_mw ? nt->b2b_off : 0;
}

static bool mw_alut(const struct plx_nt *nt, int i)
{
	return nt->alut && nt->mw[i].bar == 2;
}

static u64 alut_entries(const struct plx_nt *nt)
{
	return 128ull * nt->alut;
}

/* Entry e of the link-to-virtual A-LUT (lo; hi at +0x400, permissions at +0x800). */
static u32 alut_reg(const struct plx_nt *nt, u32 e)
{
	u32 table = 1 + (nt->alut == 1 ? 2 * nt->ntx : 0);

	return PLX_ALUT(table * 0x1000 * nt->alut + e * 4 + (e >= 128 ? 0xe00 : 0));
}

/*
 * Writes window i's inbound side: the link BAR the peer's accesses hit (sized to the
 * translation, or disabled), where they go, and the A-LUT.
 */
static void mw_apply(struct plx_nt *nt, int i)
{
	struct plx_mw *m = &nt->mw[i];
	u64 off = mw_off(nt, i), data = m->size - off, bsize, setup = 0, e, esize;

	if (i == nt->b2b_mw && !off) {
		/* All of it reaches the peer's registers: no memory part, its link BAR off. */
		wr_link_addr(nt, PLX_IF_BAR_SETUP(m->bar), m->is64 ? 0xc : 0, m->is64);
		return;
	}
	if (mw_alut(nt, i))
		bsize = data; /* the entries' permissions bound the access */
	else
		bsize = m->xlat_size; /* 0: disabled */
	if (bsize)
		setup = ~(bsize - 1) & ~0xfffffull;
	if (m->is64)
		setup |= 0xc; /* 64-bit, prefetchable */
	wr_link_addr(nt, PLX_IF_BAR_SETUP(m->bar), setup, m->is64);
	wr_link_addr(nt, PLX_IF_BAR(m->bar),
		     (m->is64 ? PLX_B2B_ADDR(m->bar) : 0x20000000ull * m->bar) + off, m->is64);
	wr_link_addr(nt, PLX_IF_XLAT(m->bar), m->xlat_addr, m->is64);
	if (!mw_alut(nt, i))
		return;
	esize = data / alut_entries(nt);
	for (e = 0; e < alut_entries(nt); e++) {
		u64 at = m->xlat_addr + e * esize;
		u32 reg = alut_reg(nt, (u32)e);

		plx_wr(nt->regs, reg, (u32)at);
		plx_wr(nt->regs, reg + 0x400, (u32)(at >> 32));
		plx_wr(nt->regs, reg + 0x800, e * esize < m->xlat_size ? 0x3 : 0);
	}
	wr_virt(nt, PLX_IF_ALUT_CTL, PLX_ALUT_ON);
}

void plx_nt_init(struct plx_nt *nt)
{
	const struct plx_mw *b = &nt->mw[nt->b2b_mw];
	u32 i;
	int w;

	/* The link BAR0 that the peer's B2B accesses hit: our chip's registers. */
	wr_link(nt, PLX_IF_BAR0_SETUP, b->is64 ? 3 : 2);
	wr_link_addr(nt, PLX_IF_BAR(0),
		     b->is64 ? PLX_B2B_ADDR(b->bar) | 0x4 : 0x20000000ull * b->bar, b->is64);
	/* Our windows' accesses go out at the link-side address of the same BAR. */
	for (w = 0; w < nt->mw_count; w++) {
		const struct plx_mw *m = &nt->mw[w];
		u64 to = m->is64 ? PLX_B2B_ADDR(m->bar) : 0x20000000ull * m->bar;

		wr_virt(nt, PLX_IF_XLAT(m->bar), (u32)to);
		if (m->is64)
			wr_virt(nt, PLX_IF_XLAT(m->bar) + 4, (u32)(to >> 32));
	}
	if (nt->alut)
		wr_link(nt, PLX_IF_ALUT_CTL, 0); /* no A-LUT outbound */
	/* Requesters of the peer's side let in: two entries (bus/device, enable) per dword. */
	for (i = 0; i < 32; i += 2)
		wr_link(nt, PLX_IF_RID_LUT_LINK + i * 2, 0x00010001 | ((i + 1) << 19) | (i << 3));
	/* Ours let out: the root complex (0:0.0), the NT function itself, then the others. */
	wr_virt(nt, PLX_IF_RID_LUT_VIRT, (rd_virt(nt, PLX_IF_RID) << 16) | 0x00010001);
	for (i = 0; i < PLX_MAX_RIDS; i += 2) {
		u32 lo = (int)i < nt->rid_count ? nt->rids[i] | 1u : 0;
		u32 hi = (int)i + 1 < nt->rid_count ? nt->rids[i + 1] | 1u : 0;

		wr_virt(nt, PLX_IF_RID_LUT_VIRT + 4 + i * 2, hi << 16 | lo);
	}
	for (w = 0; w < nt->mw_count; w++)
		mw_apply(nt, w);
	wr_link(nt, PLX_IF_COMMAND, PLX_CMD_MEM | PLX_CMD_MASTER);
	if (nt->order_word) /* kept across a reset of the chip's link side */
		wr_virt(nt, PLX_IF_SPAD(PLX_ORDER_SPAD), nt->order_word);
}

int plx_nt_start(struct plx_nt *nt, void __iomem *b2b_virt)
{
	struct plx_mw *b;

	if (!nt->mw_count || !b2b_virt)
		return -ENODEV;
	nt->b2b_mw = nt->mw_count - 1;
	b = &nt->mw[nt->b2b_mw];
	b->virt = b2b_virt;
	/* Half of the window reaches the peer's registers; under 2 MiB, all of it. */
	nt->b2b_off = b->size >= 2 * PLX_MIN_BAR ? b->size / 2 : 0;
	wr_virt(nt, PLX_IF_DB_MASK_SET, PLX_DB_MASK);
	wr_virt(nt, PLX_IF_DB_CLEAR, PLX_DB_MASK);
	plx_nt_init(nt);
	wr_virt(nt, PLX_IF_LINK_ERR, PLX_LINK_ERR_ALL);
	return 0;
}

void plx_nt_irq_on(struct plx_nt *nt)
{
	wr_virt(nt, PLX_IF_LINK_ERR_MASK, 0);
}

int plx_nt_isr(struct plx_nt *nt, u64 *db, u32 *errs)
{
	u32 raw = rd_virt(nt, PLX_IF_DB_SET);

	*db = 0;
	*errs = 0;
	if (raw == 0xffffffff) /* a read of a device that is gone */
		return -ENODEV;
	*db = raw & PLX_DB_MASK & ~plx_nt_db_read_mask(nt);
	/* The line is level-triggered: what is reported stays masked until the client has
	 * cleared it and unmasks it. */
	if (*db)
		plx_nt_db_set_mask(nt, *db);
	*errs = plx_nt_link_errors(nt);
	return 0;
}

void plx_nt_stop(struct plx_nt *nt)
{
	int w;

	wr_virt(nt, PLX_IF_LINK_ERR_MASK, PLX_LINK_ERR_ALL);
	wr_virt(nt, PLX_IF_DB_MASK_SET, PLX_DB_MASK);
	/* The peer reaches none of our memory once we are gone. */
	for (w = 0; w < nt->mw_count; w++) {
		nt->mw[w].xlat_addr = 0;
		nt->mw[w].xlat_size = 0;
		mw_apply(nt, w);
	}
}

int plx_nt_mw_count(const struct plx_nt *nt)
{
	return nt->b2b_off ? nt->mw_count : nt->mw_count - 1;
}

static int mw_index(const struct plx_nt *nt, int idx)
{
	return idx >= 0 && idx < plx_nt_mw_count(nt) ? idx : -1;
}

int plx_nt_mw_get_align(const struct plx_nt *nt, int idx, u64 *addr_align, u64 *size_align,
			u64 *size_max)
{
	int i = mw_index(nt, idx);
	u64 data, unit;

	if (i < 0)
		return -EINVAL;
	data = nt->mw[i].size - mw_off(nt, i);
	/* Without the A-LUT a translation is a power of two aligned to its size. */
	unit = mw_alut(nt, i) ? data / alut_entries(nt) : PLX_MIN_BAR;
	if (addr_align)
		*addr_align = unit;
	if (size_align)
		*size_align = unit;
	if (size_max)
		*size_max = data;
	return 0;
}

int plx_nt_mw_set_trans(struct plx_nt *nt, int idx, u64 addr, u64 size)
{
	int i = mw_index(nt, idx);
	struct plx_mw *m;
	u64 data, unit;

	if (i < 0)
		return -EINVAL;
	m = &nt->mw[i];
	data = m->size - mw_off(nt, i);
	if (size > data)
		return -EINVAL;
	if (size && mw_alut(nt, i)) {
		unit = data / alut_entries(nt);
		if (addr % unit || size % unit)
			return -EINVAL;
	} else if (size && (!is_pow2(size) || size < PLX_MIN_BAR || addr % size)) {
		return -EINVAL;
	}
	if (!m->is64 && (addr > 0xffffffffull || size > 0x100000000ull - addr))
		return -ERANGE;
	m->xlat_addr = size ? addr : 0;
	m->xlat_size = size;
	mw_apply(nt, i);
	return 0;
}

int plx_nt_mw_clear_trans(struct plx_nt *nt, int idx)
{
	return plx_nt_mw_set_trans(nt, idx, 0, 0);
}

int plx_nt_peer_mw_get_addr(const struct plx_nt *nt, int idx, u64 *phys, u64 *size)
{
	int i = mw_index(nt, idx);

	if (i < 0)
		return -EINVAL;
	if (phys)
		*phys = nt->mw[i].phys + mw_off(nt, i);
	if (size)
		*size = nt->mw[i].size - mw_off(nt, i);
	return 0;
}

u64 plx_nt_db_read(struct plx_nt *nt)
{
	return rd_virt(nt, PLX_IF_DB_SET) & PLX_DB_MASK;
}

void plx_nt_db_clear(struct plx_nt *nt, u64 bits)
{
	wr_virt(nt, PLX_IF_DB_CLEAR, (u32)(bits & PLX_DB_MASK));
}

u64 plx_nt_db_read_mask(struct plx_nt *nt)
{
	return rd_virt(nt, PLX_IF_DB_MASK_SET) & PLX_DB_MASK;
}

void plx_nt_db_set_mask(struct plx_nt *nt, u64 bits)
{
	wr_virt(nt, PLX_IF_DB_MASK_SET, (u32)(bits & PLX_DB_MASK));
}

void plx_nt_db_clear_mask(struct plx_nt *nt, u64 bits)
{
	wr_virt(nt, PLX_IF_DB_MASK_CLEAR, (u32)(bits & PLX_DB_MASK));
}

/* The peer chip's virtual interface, at the same NTx as ours. */
void plx_nt_peer_db_set(struct plx_nt *nt, u64 bits)
{
	plx_wr(peer_regs(nt), nt_base(nt) + PLX_IF_DB_SET, (u32)(bits & PLX_DB_MASK));
}

void plx_nt_order_init(struct plx_nt *nt, u32 tag)
{
	nt->order_word = (tag << PLX_ORDER_TAG_SHIFT) | PLX_ORDER_MAGIC;
	wr_virt(nt, PLX_IF_SPAD(PLX_ORDER_SPAD), nt->order_word);
}

void plx_nt_order_clear(struct plx_nt *nt)
{
	nt->order_word = 0;
	wr_virt(nt, PLX_IF_SPAD(PLX_ORDER_SPAD), 0);
}

int plx_nt_order(struct plx_nt *nt)
{
	u32 peer = plx_rd(peer_regs(nt), nt_base(nt) + PLX_IF_SPAD(PLX_ORDER_SPAD));
	u32 mine = nt->order_word & PLX_ORDER_PORT_MASK, theirs = peer & PLX_ORDER_PORT_MASK;
	u32 tag = nt->order_word >> PLX_ORDER_TAG_SHIFT, peer_tag = peer >> PLX_ORDER_TAG_SHIFT;
	int port;

	/*
	 * Ours again, each time: the handler's set-up after DL_Down may have written it as it
	 * was before a decision.
	 */
	wr_virt(nt, PLX_IF_SPAD(PLX_ORDER_SPAD), nt->order_word);
	/* A link that is down reads as ones: no magic either. */
	if (peer == 0xffffffff || (peer & PLX_ORDER_MAGIC_MASK) != PLX_ORDER_MAGIC || theirs > 2)
		return -EAGAIN;
	if (mine)
		return mine == theirs ? -EBUSY : (int)mine - 1;
	if (theirs)
		port = theirs == 1 ? 1 : 0;
	else if (tag == peer_tag)
		return -ENOTUNIQ;
	else
		port = tag > peer_tag;
	nt->order_word |= port + 1;
	wr_virt(nt, PLX_IF_SPAD(PLX_ORDER_SPAD), nt->order_word);
	return port;
}

int plx_nt_spad_read(struct plx_nt *nt, int idx, u32 *val)
{
	if (idx < 0 || idx >= PLX_CLIENT_SPADS)
		return -EINVAL;
	*val = rd_virt(nt, PLX_IF_SPAD(idx));
	return 0;
}

int plx_nt_spad_write(struct plx_nt *nt, int idx, u32 val)
{
	if (idx < 0 || idx >= PLX_CLIENT_SPADS)
		return -EINVAL;
	wr_virt(nt, PLX_IF_SPAD(idx), val);
	return 0;
}

int plx_nt_peer_spad_read(struct plx_nt *nt, int idx, u32 *val)
{
	if (idx < 0 || idx >= PLX_CLIENT_SPADS)
		return -EINVAL;
	*val = plx_rd(peer_regs(nt), nt_base(nt) + PLX_IF_SPAD(idx));
	return 0;
}

int plx_nt_peer_spad_write(struct plx_nt *nt, int idx, u32 val)
{
	if (idx < 0 || idx >= PLX_CLIENT_SPADS)
		return -EINVAL;
	plx_wr(peer_regs(nt), nt_base(nt) + PLX_IF_SPAD(idx), val);
	return 0;
}

bool plx_nt_link_enabled(struct plx_nt *nt)
{
	return !(plx_rd(nt->regs, PLX_PORT_CONTROL(nt->port)) & (1u << (nt->port & 7)));
}

void plx_nt_link_enable(struct plx_nt *nt, bool on)
{
	u32 reg = PLX_PORT_CONTROL(nt->port), v = plx_rd(nt->regs, reg);
	u32 bit = 1u << (nt->port & 7);

	plx_wr(nt->regs, reg, on ? v & ~bit : v | bit);
}

u32 plx_nt_link_errors(struct plx_nt *nt)
{
	u32 raw = rd_virt(nt, PLX_IF_LINK_ERR), v = raw & PLX_LINK_ERR_ALL;

	if (!v || raw == 0xffffffff) /* none, or the device is gone */
		return 0;
	wr_virt(nt, PLX_IF_LINK_ERR, v);
	if (v & PLX_LINK_ERR_DL_DOWN)
		plx_nt_init(nt);
	return v;
}
