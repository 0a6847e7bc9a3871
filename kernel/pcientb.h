/* SPDX-License-Identifier: GPL-2.0 */
/*
 * pcientb.ko: RDMA verbs over PCIe non-transparent bridges.
 *
 * Layers (one file each): ntb_core.c, the Linux NTB API's core where the kernel has none;
 * ntb_ivshmem.c, an NTB hardware driver over QEMU's ivshmem (how the module runs in test
 * guests); ntb_plx.c, the NTB hardware driver of the PEX8749's NT port, whose register
 * sequences are plx_nt.c; dma_plx.c, the PEX87xx DMA engine as a dmaengine provider, its
 * ring plx_dma.c; pcientb_ib.c, the verbs device of each port, pcientb_mem.c its memory
 * regions, pcientb_node.c its nodes, pcientb_bridge.c the nodes across the bridge
 * (pcientb_ib.h what they share; uapi/pcientb-abi.h is what the device shares with
 * the provider); pcientb_main.c, the module and its NTB client.
 */
#ifndef PCIENTB_KERNEL_PCIENTB_H
#define PCIENTB_KERNEL_PCIENTB_H

#include <linux/pci.h>

struct ntb_dev;
struct pcientb_ib;

int pcientb_ivshmem_init(void);
void pcientb_ivshmem_exit(void);
int pcientb_plx_init(void);
void pcientb_plx_exit(void);
int pcientb_plx_dma_init(void);
void pcientb_plx_dma_exit(void);

int pcientb_areas_init(void);
void pcientb_areas_exit(void);
/* The doorbell bit by which a port's module tells the peer's to look at its inbox. */
#define PCIENTB_DB_BRIDGE 2
/* link: a link event (every mask of ours is written again), else the peer's doorbell. */
void pcientb_bridge_kick(struct pcientb_ib *dev, bool link);
struct dentry;
void pcientb_bridge_debugfs(struct pcientb_ib *dev, struct dentry *dir);
struct pcientb_ib *pcientb_ib_add(struct ntb_dev *ntb);
void pcientb_ib_link_event(struct pcientb_ib *dev);
void pcientb_ib_remove(struct pcientb_ib *dev);

#endif
