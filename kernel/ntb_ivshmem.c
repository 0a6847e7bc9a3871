// SPDX-License-Identifier: GPL-2.0
/*
 * An NTB hardware driver over QEMU's ivshmem (PCI 1af4:1110), so that the module runs, and
 * is tested, in guests without NTB hardware.
 *
 * - A port is an ivshmem-doorbell device (BAR0 registers, BAR1 MSI-X, BAR2 memory shared
 *   with the peer port, which the ivshmem server numbers 0 and 1). BAR2 holds each port's
 *   scratchpads, link word and window translation; the peer is the other number.
 * - Doorbells are MSI-X vectors: writing (peer << 16) | vector to the Doorbell register
 *   raises that vector in the peer. The last vector carries link changes; the others are
 *   doorbell bits.
 * - The link is up while both ports have enabled it and the peer's heartbeat (a counter it
 *   advances every IVS_BEAT_MS) moves: a peer whose guest died is down within
 *   IVS_DEAD_BEATS beats, as an NT port whose partner lost power. debugfs
 *   pcientb-ivshmem/<device>/heartbeat (0 or 1) stops and restarts a port's heartbeat, to
 *   test that without killing a guest.
 * - The memory windows (two, each with its own translation) are one ivshmem-plain device
 *   that maps the RAM behind the peer (in a
 *   one-guest test, the guest's own RAM file): BAR offset = the peer's physical address
 *   (below the PCI hole, without an IOMMU: DMA address = physical address), as an NT window
 *   whose inbound translation covers all memory. mw_set_trans publishes the inbound address
 *   and size; the peer's outbound window starts there, so unlike an NT port's aperture it
 *   moves with the peer's translation and exists only once the peer has set one. And it
 *   cannot be revoked: a peer that mapped it can write there after mw_clear_trans. Clients
 *   free a window only when the peer is done with it or gone.
 * - Events (link, doorbells) always come from the interrupt handler or the heartbeat, never
 *   from within an ops call: enabling the link or unmasking a pending doorbell rings this
 *   port's own vector.
 * - Only with the module parameter ivshmem=1: ivshmem devices serve other purposes, and
 *   this driver writes their shared memory.
 */
#include <linux/module.h>
#include <linux/debugfs.h>
#include <linux/pci.h>
#include <linux/workqueue.h>
#include <linux/interrupt.h>
#include <linux/io.h>
#include <linux/ntb.h>

#include "pcientb.h"

static bool ivshmem;
module_param(ivshmem, bool, 0444);
MODULE_PARM_DESC(ivshmem, "Drive QEMU ivshmem devices as NTB ports (test guests)");

#define IVS_VENDOR 0x1af4
#define IVS_DEVICE 0x1110

/* BAR0 registers (QEMU docs/specs/ivshmem-spec.rst) */
#define IVS_REG_IVPOSITION 0x08
#define IVS_REG_DOORBELL 0x0c

#define IVS_VECTORS 4
#define IVS_LINK_VECTOR (IVS_VECTORS - 1)
#define IVS_DB_BITS IVS_LINK_VECTOR
#define IVS_SPADS 16
/* Windows over the one BAR, each with a translation of its own (a PEX8749 has two too). */
#define IVS_WINDOWS 2
#define IVS_MAGIC 0x70636e74 /* "pcnt" */
#define IVS_BEAT_MS 50
#define IVS_DEAD_BEATS 60 /* 3 s: a TCG guest on a busy host can stall for a second */

/* One port's part of the shared BAR2, written by its owner only. */
struct ivs_port_area {
	__le32 magic; /* IVS_MAGIC while the port's link is enabled */
	__le32 spad[IVS_SPADS];
	struct {
		__le32 lo, hi; /* inbound translation: where the peer's writes land */
		__le32 size;
	} mw[IVS_WINDOWS];
	__le32 beat; /* advanced every IVS_BEAT_MS while the port's driver runs */
};

struct ivs_shared {
	struct ivs_port_area port[2];
};

struct ivs_port {
	struct ntb_dev ntb;
	void __iomem *regs;
	struct ivs_shared __iomem *shm;
	u32 id;
	int irq[IVS_VECTORS]; /* Linux IRQ of each MSI-X vector; 0 until requested */
	u64 db_pending;
	u64 db_mask;
	spinlock_t db_lock; /* db_pending, db_mask */
	struct delayed_work beat_work;
	u32 peer_beat; /* the peer's heartbeat when it last moved */
	int stale; /* beats since it last moved */
	bool peer_alive;
	bool beating; /* false: this port's heartbeat is stopped (debugfs) */
	struct dentry *dir;
};

/* The memory-window device (ivshmem-plain), shared by the ports of this guest. */
static struct pci_dev *ivs_window;
static struct dentry *ivs_debug_root;

static struct ivs_port *to_port(struct ntb_dev *ntb)
{
	return container_of(ntb, struct ivs_port, ntb);
}

static struct ivs_port_area __iomem *own_area(struct ivs_port *p)
{
	return &p->shm->port[p->id];
}

static struct ivs_port_area __iomem *peer_area(struct ivs_port *p)
{
	return &p->shm->port[p->id ^ 1];
}

static void ring(struct ivs_port *p, int vector)
{
	iowrite32(((p->id ^ 1) << 16) | vector, p->regs + IVS_REG_DOORBELL);
}

/* An event for this port, delivered by its own interrupt handler. */
static void ring_self(struct ivs_port *p, int vector)
{
	iowrite32((p->id << 16) | vector, p->regs + IVS_REG_DOORBELL);
}

static u64 ivs_link_is_up(struct ntb_dev *ntb, enum ntb_speed *speed, enum ntb_width *width)
{
	struct ivs_port *p = to_port(ntb);
	bool up = ioread32(&own_area(p)->magic) == IVS_MAGIC &&
		  ioread32(&peer_area(p)->magic) == IVS_MAGIC && READ_ONCE(p->peer_alive);

	if (speed)
		*speed = up ? NTB_SPEED_GEN3 : NTB_SPEED_NONE;
	if (width)
		*width = up ? NTB_WIDTH_8 : NTB_WIDTH_NONE;
	return up ? 1 : 0;
}

static int ivs_link_enable(struct ntb_dev *ntb, enum ntb_speed max_speed, enum ntb_width max_width)
{
	struct ivs_port *p = to_port(ntb);

	iowrite32(IVS_MAGIC, &own_area(p)->magic);
	ring(p, IVS_LINK_VECTOR);
	ring_self(p, IVS_LINK_VECTOR);
	return 0;
}

static int ivs_link_disable(struct ntb_dev *ntb)
{
	struct ivs_port *p = to_port(ntb);

	iowrite32(0, &own_area(p)->magic);
	ring(p, IVS_LINK_VECTOR);
	ring_self(p, IVS_LINK_VECTOR);
	return 0;
}

/* The window's BAR length, 0 without a window device (read once per call). */
static resource_size_t window_len(void)
{
	struct pci_dev *w = READ_ONCE(ivs_window);

	return w ? pci_resource_len(w, 2) : 0;
}

static int ivs_mw_count(struct ntb_dev *ntb, int pidx)
{
	return pidx == 0 && window_len() ? IVS_WINDOWS : 0;
}

static int ivs_mw_get_align(struct ntb_dev *ntb, int pidx, int widx, resource_size_t *addr_align,
			    resource_size_t *size_align, resource_size_t *size_max)
{
	resource_size_t len = window_len();

	if (pidx != 0 || widx < 0 || widx >= IVS_WINDOWS || !len)
		return -EINVAL;
	if (addr_align)
		*addr_align = PAGE_SIZE;
	if (size_align)
		*size_align = PAGE_SIZE;
	if (size_max)
		*size_max = min_t(resource_size_t, len, U32_MAX & PAGE_MASK);
	return 0;
}

static int ivs_mw_set_trans(struct ntb_dev *ntb, int pidx, int widx, dma_addr_t addr,
			    resource_size_t size)
{
	struct ivs_port *p = to_port(ntb);
	resource_size_t max;

	if (ivs_mw_get_align(ntb, pidx, widx, NULL, NULL, &max))
		return -EINVAL;
	/* The peer's window maps this RAM from address 0, as far as ours maps the peer's. */
	if (!IS_ALIGNED(addr, PAGE_SIZE) || !IS_ALIGNED(size, PAGE_SIZE) || !size || size > max ||
	    addr > window_len() - size)
		return -EINVAL;
	iowrite32(0, &own_area(p)->mw[widx].size);
	iowrite32(lower_32_bits(addr), &own_area(p)->mw[widx].lo);
	iowrite32(upper_32_bits(addr), &own_area(p)->mw[widx].hi);
	iowrite32(size, &own_area(p)->mw[widx].size);
	return 0;
}

static int ivs_mw_clear_trans(struct ntb_dev *ntb, int pidx, int widx)
{
	if (pidx != 0 || widx < 0 || widx >= IVS_WINDOWS)
		return -EINVAL;
	iowrite32(0, &own_area(to_port(ntb))->mw[widx].size);
	return 0;
}

static int ivs_peer_mw_count(struct ntb_dev *ntb)
{
	return window_len() ? IVS_WINDOWS : 0;
}

/* The outbound window: the peer's inbound translation, once the peer has set one. */
static int ivs_peer_mw_get_addr(struct ntb_dev *ntb, int widx, phys_addr_t *base,
				resource_size_t *size)
{
	struct ivs_port_area __iomem *peer = peer_area(to_port(ntb));
	struct pci_dev *w = READ_ONCE(ivs_window);
	resource_size_t bar;
	u32 len;
	u64 addr;

	if (widx < 0 || widx >= IVS_WINDOWS || !w)
		return -EINVAL;
	bar = pci_resource_len(w, 2);
	/* The peer writes size 0, the address, then the size: a size read before and after
	 * the address that agree make a consistent pair. */
	len = ioread32(&peer->mw[widx].size);
	addr = ((u64)ioread32(&peer->mw[widx].hi) << 32) | ioread32(&peer->mw[widx].lo);
	if (!len || ioread32(&peer->mw[widx].size) != len || len > bar || addr > bar - len)
		return -ENOLINK;
	if (base)
		*base = pci_resource_start(w, 2) + addr;
	if (size)
		*size = len;
	return 0;
}

static u64 ivs_db_valid_mask(struct ntb_dev *ntb)
{
	return BIT_ULL(IVS_DB_BITS) - 1;
}

static int ivs_db_vector_count(struct ntb_dev *ntb)
{
	return IVS_DB_BITS;
}

static u64 ivs_db_vector_mask(struct ntb_dev *ntb, int db_vector)
{
	return db_vector >= 0 && db_vector < IVS_DB_BITS ? BIT_ULL(db_vector) : 0;
}

static u64 ivs_db_read(struct ntb_dev *ntb)
{
	return READ_ONCE(to_port(ntb)->db_pending);
}

static int ivs_db_clear(struct ntb_dev *ntb, u64 db_bits)
{
	struct ivs_port *p = to_port(ntb);
	unsigned long flags;

	spin_lock_irqsave(&p->db_lock, flags);
	p->db_pending &= ~db_bits;
	spin_unlock_irqrestore(&p->db_lock, flags);
	return 0;
}

static u64 ivs_db_read_mask(struct ntb_dev *ntb)
{
	return READ_ONCE(to_port(ntb)->db_mask);
}

static int ivs_db_set_mask(struct ntb_dev *ntb, u64 db_bits)
{
	struct ivs_port *p = to_port(ntb);
	unsigned long flags;

	if (db_bits & ~ivs_db_valid_mask(ntb))
		return -EINVAL;
	spin_lock_irqsave(&p->db_lock, flags);
	p->db_mask |= db_bits;
	spin_unlock_irqrestore(&p->db_lock, flags);
	return 0;
}

static int ivs_db_clear_mask(struct ntb_dev *ntb, u64 db_bits)
{
	struct ivs_port *p = to_port(ntb);
	unsigned long flags;
	u64 fire;
	int v;

	if (db_bits & ~ivs_db_valid_mask(ntb))
		return -EINVAL;
	spin_lock_irqsave(&p->db_lock, flags);
	fire = p->db_pending & db_bits & p->db_mask;
	p->db_mask &= ~db_bits;
	spin_unlock_irqrestore(&p->db_lock, flags);
	/* What came while masked interrupts now, as a hardware doorbell would. */
	for (v = 0; v < IVS_DB_BITS; v++)
		if (fire & BIT_ULL(v))
			ring_self(p, v);
	return 0;
}

static int ivs_peer_db_set(struct ntb_dev *ntb, u64 db_bits)
{
	struct ivs_port *p = to_port(ntb);
	int v;

	if (db_bits & ~ivs_db_valid_mask(ntb))
		return -EINVAL;
	for (v = 0; v < IVS_DB_BITS; v++)
		if (db_bits & BIT_ULL(v))
			ring(p, v);
	return 0;
}

static int ivs_spad_count(struct ntb_dev *ntb)
{
	return IVS_SPADS;
}

static u32 ivs_spad_read(struct ntb_dev *ntb, int sidx)
{
	if (sidx < 0 || sidx >= IVS_SPADS)
		return 0;
	return ioread32(&own_area(to_port(ntb))->spad[sidx]);
}

static int ivs_spad_write(struct ntb_dev *ntb, int sidx, u32 val)
{
	if (sidx < 0 || sidx >= IVS_SPADS)
		return -EINVAL;
	iowrite32(val, &own_area(to_port(ntb))->spad[sidx]);
	return 0;
}

static u32 ivs_peer_spad_read(struct ntb_dev *ntb, int pidx, int sidx)
{
	if (pidx != 0 || sidx < 0 || sidx >= IVS_SPADS)
		return 0;
	return ioread32(&peer_area(to_port(ntb))->spad[sidx]);
}

static int ivs_peer_spad_write(struct ntb_dev *ntb, int pidx, int sidx, u32 val)
{
	if (pidx != 0 || sidx < 0 || sidx >= IVS_SPADS)
		return -EINVAL;
	iowrite32(val, &peer_area(to_port(ntb))->spad[sidx]);
	return 0;
}

static const struct ntb_dev_ops ivs_ops = {
	.link_is_up = ivs_link_is_up,
	.link_enable = ivs_link_enable,
	.link_disable = ivs_link_disable,
	.mw_count = ivs_mw_count,
	.mw_get_align = ivs_mw_get_align,
	.mw_set_trans = ivs_mw_set_trans,
	.mw_clear_trans = ivs_mw_clear_trans,
	.peer_mw_count = ivs_peer_mw_count,
	.peer_mw_get_addr = ivs_peer_mw_get_addr,
	.db_valid_mask = ivs_db_valid_mask,
	.db_vector_count = ivs_db_vector_count,
	.db_vector_mask = ivs_db_vector_mask,
	.db_read = ivs_db_read,
	.db_clear = ivs_db_clear,
	.db_read_mask = ivs_db_read_mask,
	.db_set_mask = ivs_db_set_mask,
	.db_clear_mask = ivs_db_clear_mask,
	.peer_db_set = ivs_peer_db_set,
	.spad_count = ivs_spad_count,
	.spad_read = ivs_spad_read,
	.spad_write = ivs_spad_write,
	.peer_spad_read = ivs_peer_spad_read,
	.peer_spad_write = ivs_peer_spad_write,
};

static irqreturn_t ivs_irq(int irq, void *data)
{
	struct ivs_port *p = data;
	bool report;
	int v = 0;

	while (v < IVS_VECTORS && p->irq[v] != irq)
		v++;
	if (v == IVS_VECTORS)
		return IRQ_NONE;
	if (v == IVS_LINK_VECTOR) {
		ntb_link_event(&p->ntb);
		return IRQ_HANDLED;
	}
	spin_lock(&p->db_lock);
	p->db_pending |= BIT_ULL(v);
	report = !(p->db_mask & BIT_ULL(v));
	spin_unlock(&p->db_lock);
	if (report)
		ntb_db_event(&p->ntb, v);
	return IRQ_HANDLED;
}

static void ivs_beat(struct work_struct *work)
{
	struct ivs_port *p = container_of(to_delayed_work(work), struct ivs_port, beat_work);
	u32 peer = ioread32(&peer_area(p)->beat);
	bool alive = READ_ONCE(p->peer_alive);

	if (READ_ONCE(p->beating))
		iowrite32(ioread32(&own_area(p)->beat) + 1, &own_area(p)->beat);
	if (peer != p->peer_beat) {
		p->peer_beat = peer;
		p->stale = 0;
		WRITE_ONCE(p->peer_alive, true);
	} else if (++p->stale >= IVS_DEAD_BEATS) {
		WRITE_ONCE(p->peer_alive, false);
	}
	if (alive != READ_ONCE(p->peer_alive))
		ntb_link_event(&p->ntb);
	schedule_delayed_work(&p->beat_work, msecs_to_jiffies(IVS_BEAT_MS));
}

static int heartbeat_get(void *data, u64 *val)
{
	*val = READ_ONCE(((struct ivs_port *)data)->beating);
	return 0;
}

static int heartbeat_set(void *data, u64 val)
{
	WRITE_ONCE(((struct ivs_port *)data)->beating, val != 0);
	return 0;
}
DEFINE_DEBUGFS_ATTRIBUTE(heartbeat_fops, heartbeat_get, heartbeat_set, "%llu\n");

static void ivs_free_irqs(struct ivs_port *p)
{
	int v;

	for (v = 0; v < IVS_VECTORS; v++)
		if (p->irq[v])
			free_irq(p->irq[v], p);
	pci_free_irq_vectors(p->ntb.pdev);
}

static int ivs_probe_port(struct pci_dev *pdev)
{
	struct ivs_port *p;
	int rc, v;

	p = devm_kzalloc(&pdev->dev, sizeof(*p), GFP_KERNEL);
	if (!p)
		return -ENOMEM;
	p->regs = pcim_iomap_table(pdev)[0];
	p->shm = pcim_iomap_table(pdev)[2];
	if (pci_resource_len(pdev, 2) < sizeof(struct ivs_shared))
		return -ENOSPC;
	p->id = ioread32(p->regs + IVS_REG_IVPOSITION);
	if (p->id > 1) {
		dev_err(&pdev->dev, "ivshmem peer number %u: only 0 and 1 make a pair\n", p->id);
		return -ENODEV;
	}
	/* What an earlier driver left (a guest that died with its link up) says nothing now;
	 * and only a heartbeat that moves from here on makes the peer alive. */
	memset_io(own_area(p), 0, sizeof(struct ivs_port_area));
	p->peer_beat = ioread32(&peer_area(p)->beat);
	spin_lock_init(&p->db_lock);
	INIT_DELAYED_WORK(&p->beat_work, ivs_beat);
	p->beating = true;
	p->ntb.pdev = pdev;
	p->ntb.topo = p->id ? NTB_TOPO_B2B_DSD : NTB_TOPO_B2B_USD;
	p->ntb.ops = &ivs_ops;
	pci_set_drvdata(pdev, p);
	/* The verbs device maps memory regions for this function (no bounce buffers). */
	rc = dma_set_mask_and_coherent(&pdev->dev, DMA_BIT_MASK(64));
	if (rc)
		return rc;
	/* MSI-X messages are DMA writes: without bus mastering QEMU drops them. */
	pci_set_master(pdev);
	rc = pci_alloc_irq_vectors(pdev, IVS_VECTORS, IVS_VECTORS, PCI_IRQ_MSIX);
	if (rc < 0)
		return rc;
	/* The core first, so that no event finds it uninitialised; what rings meanwhile waits
	 * in the vector's pending bit until its handler is there. */
	rc = ntb_register_device(&p->ntb);
	if (rc)
		goto free_vectors;
	for (v = 0; v < IVS_VECTORS; v++) {
		rc = request_irq(pci_irq_vector(pdev, v), ivs_irq, 0, "pcientb-ivshmem", p);
		if (rc)
			goto unregister;
		p->irq[v] = pci_irq_vector(pdev, v);
	}
	schedule_delayed_work(&p->beat_work, 0);
	p->dir = debugfs_create_dir(pci_name(pdev), ivs_debug_root);
	debugfs_create_file_unsafe("heartbeat", 0600, p->dir, p, &heartbeat_fops);
	dev_info(&pdev->dev, "NTB port %u over ivshmem, %llu KiB shared\n", p->id,
		 (unsigned long long)pci_resource_len(pdev, 2) >> 10);
	return 0;

unregister:
	ntb_unregister_device(&p->ntb);
free_vectors:
	ivs_free_irqs(p);
	return rc;
}

static int ivs_probe(struct pci_dev *pdev, const struct pci_device_id *id)
{
	bool doorbell;
	int rc;

	rc = pcim_enable_device(pdev);
	if (rc)
		return rc;
	/* The doorbell variant has MSI-X (BAR1); the plain one is the memory window. */
	doorbell = pci_resource_len(pdev, 1) != 0;
	if (!doorbell) {
		if (READ_ONCE(ivs_window))
			return -EBUSY;
		rc = pci_request_region(pdev, 2, "pcientb-ivshmem");
		if (rc)
			return rc;
		WRITE_ONCE(ivs_window, pdev);
		dev_info(&pdev->dev, "NTB memory window over ivshmem, %llu MiB\n",
			 (unsigned long long)pci_resource_len(pdev, 2) >> 20);
		return 0;
	}
	rc = pcim_iomap_regions(pdev, BIT(0) | BIT(2), "pcientb-ivshmem");
	if (rc)
		return rc;
	return ivs_probe_port(pdev);
}

static void ivs_remove(struct pci_dev *pdev)
{
	struct ivs_port *p = pci_get_drvdata(pdev);

	if (!p) {
		if (READ_ONCE(ivs_window) == pdev)
			WRITE_ONCE(ivs_window, NULL);
		return;
	}
	debugfs_remove_recursive(p->dir);
	ntb_unregister_device(&p->ntb);
	cancel_delayed_work_sync(&p->beat_work);
	memset_io(own_area(p), 0, sizeof(struct ivs_port_area));
	ivs_free_irqs(p);
}

/* No MODULE_DEVICE_TABLE: an ivshmem device must not load this module by itself. */
static const struct pci_device_id ivs_ids[] = { { PCI_DEVICE(IVS_VENDOR, IVS_DEVICE) }, { 0 } };

static struct pci_driver ivs_driver = {
	.name = "pcientb-ivshmem",
	.id_table = ivs_ids,
	.probe = ivs_probe,
	.remove = ivs_remove,
};

int pcientb_ivshmem_init(void)
{
	int rc;

	if (!ivshmem)
		return 0;
	ivs_debug_root = debugfs_create_dir("pcientb-ivshmem", NULL);
	rc = pci_register_driver(&ivs_driver);
	if (rc) {
		debugfs_remove_recursive(ivs_debug_root);
		ivshmem = false;
	}
	return rc;
}

void pcientb_ivshmem_exit(void)
{
	if (!ivshmem)
		return;
	pci_unregister_driver(&ivs_driver);
	debugfs_remove_recursive(ivs_debug_root);
}
