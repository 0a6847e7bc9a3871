// SPDX-License-Identifier: GPL-2.0
/*
 * PEX87xx DMA engine: ring set-up, descriptors, completions, stop (see plx_dma.h). The
 * caller serialises prep, submit, kick, reap and stop (one lock per channel; stop may sleep
 * between its register accesses, with no lock needed once the channel refuses preps);
 * plx_dma_irq only touches the interrupt status register.
 */
#include "plx_dma.h"

#define PLX_DMA_STOP_US 1000000 /* how long a pause, then an abort, may take */
#define PLX_DMA_POLL_US 100
#define PLX_DMA_READY 0x80000000u /* in len[]: submitted, not given to the engine yet */

static void ctrl(struct plx_dma *d, u16 bits)
{
	plx_wr16(d->regs, PLX_DMA_CTRL, bits | PLX_DMA_CTRL_CLEAR);
}

static bool ctrl_wait(struct plx_dma *d, u16 done)
{
	int us;

	for (us = 0; us < PLX_DMA_STOP_US; us += PLX_DMA_POLL_US) {
		if (plx_rd16(d->regs, PLX_DMA_CTRL) & done)
			return true;
		plx_delay_us(PLX_DMA_POLL_US);
	}
	return false;
}

int plx_dma_init(struct plx_dma *d, void __iomem *regs, struct plx_dma_desc *ring, u64 ring_dma,
		 u32 count, u32 *len)
{
	u32 i;

	if (!count || count > PLX_DMA_RING_MAX || (count & (count - 1)) || (ring_dma & 63) ||
	    ring_dma > PLX_DMA_MAX_ADDR)
		return -EINVAL;
	*d = (struct plx_dma){
		.regs = regs, .ring = ring, .ring_dma = ring_dma, .count = count, .len = len
	};
	for (i = 0; i < count; i++)
		WRITE_ONCE(ring[i].flags_len, 0);
	wmb(); /* the ring is empty before the engine may look at it */
	ctrl(d, 0);
	plx_wr(regs, PLX_DMA_RING_ADDR, (u32)ring_dma);
	plx_wr(regs, PLX_DMA_RING_ADDR_HI, (u32)(ring_dma >> 32));
	plx_wr(regs, PLX_DMA_RING_NEXT, (u32)ring_dma);
	plx_wr(regs, PLX_DMA_RING_COUNT, count);
	plx_wr(regs, PLX_DMA_PREFETCH, PLX_DMA_PREFETCH_FOUR);
	plx_wr16(regs, PLX_DMA_INTR_CTRL, PLX_DMA_INTR_ERROR | PLX_DMA_INTR_INV_DESC);
	return 0;
}

int plx_dma_prep(struct plx_dma *d, u64 dst, u64 src, u32 len, bool irq)
{
	struct plx_dma_desc *desc;
	u32 slot;

	if (d->stopped)
		return -EIO;
	if (!len || len > PLX_DMA_MAX_LEN || dst > PLX_DMA_MAX_ADDR || src > PLX_DMA_MAX_ADDR)
		return -EINVAL;
	if (d->head - d->tail == d->count)
		return -ENOSPC;
	slot = d->head++ & (d->count - 1);
	desc = &d->ring[slot];
	desc->dst_lo = cpu_to_le32((u32)dst);
	desc->dst_hi = cpu_to_le16((u16)(dst >> 32));
	desc->src_lo = cpu_to_le32((u32)src);
	desc->src_hi = cpu_to_le16((u16)(src >> 32));
	/* Not VALID yet: the engine may be running the slots before it. */
	WRITE_ONCE(desc->flags_len, cpu_to_le32(len | (irq ? PLX_DMA_DESC_IRQ : 0)));
	d->len[slot] = len;
	return (int)slot;
}

void plx_dma_submit(struct plx_dma *d, int slot)
{
	u32 mask = d->count - 1;

	/* Prepared slots are those from `given` (free running) to `head`. */
	if (slot < 0 || (u32)slot >= d->count ||
	    (((u32)slot - d->given) & mask) >= d->head - d->given)
		return;
	d->len[slot] |= PLX_DMA_READY;
	/* The engine takes slots in ring order: submitted ones go as soon as those before do. */
	wmb(); /* the descriptors, then the bits that give them to the engine */
	while (d->given != d->head && (d->len[d->given & mask] & PLX_DMA_READY)) {
		struct plx_dma_desc *desc = &d->ring[d->given & mask];

		d->len[d->given & mask] &= ~PLX_DMA_READY;
		WRITE_ONCE(desc->flags_len,
			   cpu_to_le32(le32_to_cpu(desc->flags_len) | PLX_DMA_DESC_VALID));
		d->given++;
	}
}

void plx_dma_kick(struct plx_dma *d)
{
	if (d->stopped)
		return;
	wmb(); /* VALID bits before the start */
	ctrl(d, PLX_DMA_CTRL_WRITE_BACK | PLX_DMA_CTRL_OFF_CHIP | PLX_DMA_CTRL_START);
}

int plx_dma_reap(struct plx_dma *d, enum plx_dma_result *res, u32 *residue)
{
	u32 slot, f, moved;

	if (d->tail == d->head)
		return -EAGAIN;
	slot = d->tail & (d->count - 1);
	f = le32_to_cpu(READ_ONCE(d->ring[slot].flags_len));
	/* Still the engine's, or prepared and not given to it: not done, unless stopped. */
	if (d->tail == d->given || (f & PLX_DMA_DESC_VALID)) {
		if (!d->stopped)
			return -EAGAIN;
		*res = PLX_DMA_ABORTED;
		*residue = d->len[slot];
	} else {
		if (f & PLX_DMA_WB_OK)
			*res = PLX_DMA_OK;
		else if (f & PLX_DMA_WB_WRITE_FAIL)
			*res = PLX_DMA_WRITE_FAILED;
		else
			*res = PLX_DMA_READ_FAILED;
		moved = f & PLX_DMA_MAX_LEN;
		*residue = d->len[slot] - (moved < d->len[slot] ? moved : d->len[slot]);
	}
	d->tail++;
	return (int)slot;
}

u16 plx_dma_irq(struct plx_dma *d)
{
	u16 s = plx_rd16(d->regs, PLX_DMA_INTR_STATUS);

	if (!s || s == 0xffff) /* nothing, or the device is gone */
		return 0;
	plx_wr16(d->regs, PLX_DMA_INTR_STATUS, s);
	return s;
}

int plx_dma_stop(struct plx_dma *d)
{
	int rc = 0;

	d->stopped = true;
	if (plx_rd16(d->regs, PLX_DMA_CTRL)) {
		ctrl(d, PLX_DMA_CTRL_PAUSE);
		if (!ctrl_wait(d, PLX_DMA_CTRL_PAUSE_DONE)) {
			ctrl(d, PLX_DMA_CTRL_ABORT);
			if (!ctrl_wait(d, PLX_DMA_CTRL_ABORT_DONE))
				rc = -ETIMEDOUT; /* it may still write the ring: keep it */
		}
	}
	plx_wr16(d->regs, PLX_DMA_INTR_CTRL, 0);
	plx_wr16(d->regs, PLX_DMA_INTR_STATUS, 0xffff);
	plx_wr(d->regs, PLX_DMA_RING_COUNT, 0);
	plx_wr(d->regs, PLX_DMA_RING_ADDR, 0);
	plx_wr(d->regs, PLX_DMA_RING_ADDR_HI, 0);
	plx_wr(d->regs, PLX_DMA_RING_NEXT, 0);
	return rc;
}
