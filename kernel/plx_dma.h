/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The PEX87xx DMA engine (PCI 10b5:87d0, one channel per function): its register
 * sequences and descriptor ring, apart from the dmaengine glue (dma_plx.c), so that the
 * same file runs in the userspace test against the register model (tests/kernel/plx_model).
 *
 * The ring lives in host memory: 16-byte descriptors (length in bits 26:0, so at most
 * 128 MiB - 1 each; VALID bit 31, interrupt-when-done bit 30; 48-bit source and
 * destination). The engine runs the valid descriptors from its next pointer on and writes
 * each one back with VALID clear, a status (success, read failed, write failed) and the
 * bytes it moved. Descriptors complete in ring order. A failed descriptor stops the
 * engine (an assumption the register model shares): the next kick goes on after it. Through an NT
 * window the engine writes to the peer, if the NT port's requester-ID LUT lets the DMA function out
 * (plx_nt.h).
 */
#ifndef PCIENTB_KERNEL_PLX_DMA_H
#define PCIENTB_KERNEL_PLX_DMA_H

#include "plx_nt.h" /* plx_rd/plx_wr and the kernel types */

#define PLX_DMA_DEVICE 0x87d0

/* Registers (BAR0 of the DMA function). */
#define PLX_DMA_RING_ADDR 0x214
#define PLX_DMA_RING_ADDR_HI 0x218
#define PLX_DMA_RING_NEXT 0x21c
#define PLX_DMA_RING_COUNT 0x220
#define PLX_DMA_PREFETCH 0x234
#define PLX_DMA_PREFETCH_FOUR 8
#define PLX_DMA_CTRL 0x238 /* 16 bits; CTRL2 above it */
#define PLX_DMA_CTRL_PAUSE 0x1
#define PLX_DMA_CTRL_ABORT 0x2
#define PLX_DMA_CTRL_WRITE_BACK 0x4
#define PLX_DMA_CTRL_START 0x8
#define PLX_DMA_CTRL_OFF_CHIP (2 << 5) /* descriptors in host memory */
#define PLX_DMA_CTRL_DESC_INVALID 0x100 /* status bits, written 1 to clear */
#define PLX_DMA_CTRL_PAUSE_DONE 0x200
#define PLX_DMA_CTRL_ABORT_DONE 0x400
#define PLX_DMA_CTRL_IMM_PAUSE_DONE 0x1000
#define PLX_DMA_CTRL_CLEAR                                                                         \
	(PLX_DMA_CTRL_DESC_INVALID | PLX_DMA_CTRL_PAUSE_DONE | PLX_DMA_CTRL_ABORT_DONE |           \
	 PLX_DMA_CTRL_IMM_PAUSE_DONE)
#define PLX_DMA_INTR_CTRL 0x23c /* 16 bits */
#define PLX_DMA_INTR_STATUS 0x23e /* 16 bits, written 1 to clear */
#define PLX_DMA_INTR_ERROR 0x1
#define PLX_DMA_INTR_INV_DESC 0x2
#define PLX_DMA_INTR_DESC_DONE 0x4
#define PLX_DMA_INTR_ABORT_DONE 0x8

/* Descriptors. */
#define PLX_DMA_RING_MAX 2048
#define PLX_DMA_MAX_LEN 0x7ffffff
#define PLX_DMA_DESC_VALID 0x80000000u
#define PLX_DMA_DESC_IRQ 0x40000000u
#define PLX_DMA_WB_OK 0x40000000u
#define PLX_DMA_WB_READ_FAIL 0x20000000u
#define PLX_DMA_WB_WRITE_FAIL 0x10000000u
#define PLX_DMA_MAX_ADDR ((1ull << 48) - 1)

struct plx_dma_desc {
	__le32 flags_len;
	__le16 dst_hi;
	__le16 src_hi;
	__le32 dst_lo;
	__le32 src_lo;
};

enum plx_dma_result {
	PLX_DMA_OK,
	PLX_DMA_READ_FAILED,
	PLX_DMA_WRITE_FAILED,
	PLX_DMA_ABORTED, /* never run: the channel stopped first */
};

struct plx_dma {
	void __iomem *regs;
	struct plx_dma_desc *ring; /* count entries, 64-byte aligned, coherent */
	u64 ring_dma;
	u32 count; /* a power of two, at most PLX_DMA_RING_MAX */
	u32 head, given, tail; /* free running: next to prepare, to give, to reap */
	u32 *len; /* count entries: each slot's length as posted */
	bool stopped;
};

int plx_dma_init(struct plx_dma *d, void __iomem *regs, struct plx_dma_desc *ring, u64 ring_dma,
		 u32 count, u32 *len);
/* A descriptor in the next slot, not yet given to the engine: its slot, or -ENOSPC. */
int plx_dma_prep(struct plx_dma *d, u64 dst, u64 src, u32 len, bool irq);
/*
 * Submits prepared slot `slot`: it goes to the engine once every slot before it has gone
 * (slots may be submitted in any order; one never submitted holds back those after it).
 * Kick starts the engine on what was given.
 */
void plx_dma_submit(struct plx_dma *d, int slot);
void plx_dma_kick(struct plx_dma *d);
/* The oldest finished slot (its result and the bytes not moved), or -EAGAIN. */
int plx_dma_reap(struct plx_dma *d, enum plx_dma_result *res, u32 *residue);
/*
 * From the interrupt handler: the status bits, cleared (0: none, or the device is gone).
 * After PLX_DMA_INTR_ERROR the engine has stopped after the failed descriptor: the caller
 * kicks it again, outside the handler, to run the ones after it.
 */
u16 plx_dma_irq(struct plx_dma *d);
/*
 * Pauses the engine (then aborts it), disables its interrupts and forgets the ring: what
 * was not run is reaped as ABORTED. -ETIMEDOUT: the engine did not stop, and may still
 * write the ring and the buffers: the caller must cut its bus mastering before it reaps.
 */
int plx_dma_stop(struct plx_dma *d);

#endif
