// SPDX-License-Identifier: GPL-2.0
/*
 * The PEX8749 NT port as a Linux NTB device: the PCI driver, the ntb_dev_ops and the
 * interrupt. The chip's register sequences are in plx_nt.c (tested against a register
 * model, tests/kernel/plx_model); this file only maps BARs, takes the interrupt and
 * serialises.
 *
 * - The NT virtual interface (10b5:87b0 for NT0, 87b1 for NT1), back-to-back with the
 *   peer host's chip. The link interface (NTB-to-root-port mode, 87a0/87a1) is not
 *   driven.
 * - One INTx line for the 16 doorbells and the link errors, level-triggered: the handler
 *   masks the doorbells it reports; the client clears and unmasks them.
 * - Link changes: DL_Down comes as a link error (the link side is set up again there);
 *   a link that comes up is found by polling the link status every PLX_LINK_POLL_MS.
 * - Port numbers: the two sides agree on 0 and 1 once the link is up (plx_nt_order), and
 *   the link is reported up only then; meanwhile peer_port_number answers -EAGAIN.
 */
#include <linux/module.h>
#include <linux/pci.h>
#include <linux/interrupt.h>
#include <linux/workqueue.h>
#include <linux/dma-mapping.h>
#include <linux/ntb.h>
#include <linux/random.h>

#include "pcientb.h"
#include "plx_nt.h"
#include "plx_dma.h"

#define PLX_LINK_POLL_MS 250

struct plx_port {
	struct ntb_dev ntb;
	struct plx_nt nt;
	spinlock_t lock; /* window registers: ops against re-initialisation in the handler */
	struct delayed_work link_work;
	bool link_was_up;
	bool went_down; /* DL_Down seen by the handler, not reported yet */
	int order; /* our NTB port number, 0 or 1; -EAGAIN until the sides agreed */
	bool conflict; /* the peer holds our number too (-EBUSY): the link is not reported up */
};

static struct plx_port *to_port(struct ntb_dev *ntb)
{
	return container_of(ntb, struct plx_port, ntb);
}

/* The link as the hardware has it now. */
static bool plx_link_hw_up(struct plx_port *p, u16 *sta)
{
	*sta = 0;
	pcie_capability_read_word(p->ntb.pdev, PCI_EXP_LNKSTA, sta);
	return plx_nt_link_enabled(&p->nt) && (*sta & PCI_EXP_LNKSTA_NLW);
}

/*
 * The link as last reported (plx_link_work): a client that looks at each event sees the
 * down of a bounce, then the up, though both events come after the link was back.
 */
static u64 plx_link_is_up(struct ntb_dev *ntb, enum ntb_speed *speed, enum ntb_width *width)
{
	struct plx_port *p = to_port(ntb);
	bool up = READ_ONCE(p->link_was_up);
	u16 sta;

	plx_link_hw_up(p, &sta);
	if (speed)
		*speed = up ? sta & PCI_EXP_LNKSTA_CLS : NTB_SPEED_NONE;
	if (width)
		*width = up ? (sta & PCI_EXP_LNKSTA_NLW) >> PCI_EXP_LNKSTA_NLW_SHIFT :
			      NTB_WIDTH_NONE;
	return up;
}

static int plx_link_enable(struct ntb_dev *ntb, enum ntb_speed max_speed, enum ntb_width max_width)
{
	struct plx_port *p = to_port(ntb);

	plx_nt_link_enable(&p->nt, true);
	mod_delayed_work(system_wq, &p->link_work, 0);
	return 0;
}

static int plx_link_disable(struct ntb_dev *ntb)
{
	struct plx_port *p = to_port(ntb);

	plx_nt_link_enable(&p->nt, false);
	mod_delayed_work(system_wq, &p->link_work, 0);
	return 0;
}

/*
 * The NTB API's port number has no error: 0 until the sides agreed (the link is not
 * reported up before), the peer's says -EAGAIN meanwhile.
 */
static int plx_port_number(struct ntb_dev *ntb)
{
	return max(READ_ONCE(to_port(ntb)->order), 0);
}

static int plx_peer_port_count(struct ntb_dev *ntb)
{
	return 1;
}

static int plx_peer_port_number(struct ntb_dev *ntb, int pidx)
{
	int order = READ_ONCE(to_port(ntb)->order);

	if (pidx)
		return -EINVAL;
	return order < 0 ? order : !order;
}

static int plx_peer_port_idx(struct ntb_dev *ntb, int port)
{
	int order = READ_ONCE(to_port(ntb)->order);

	return order >= 0 && port == !order ? 0 : -EINVAL;
}

static int plx_mw_count(struct ntb_dev *ntb, int pidx)
{
	return pidx ? -EINVAL : plx_nt_mw_count(&to_port(ntb)->nt);
}

static int plx_mw_get_align(struct ntb_dev *ntb, int pidx, int widx, resource_size_t *addr_align,
			    resource_size_t *size_align, resource_size_t *size_max)
{
	u64 a, s, m;
	int rc;

	if (pidx)
		return -EINVAL;
	rc = plx_nt_mw_get_align(&to_port(ntb)->nt, widx, &a, &s, &m);
	if (rc)
		return rc;
	if (addr_align)
		*addr_align = a;
	if (size_align)
		*size_align = s;
	if (size_max)
		*size_max = m;
	return 0;
}

static int plx_mw_set_trans(struct ntb_dev *ntb, int pidx, int widx, dma_addr_t addr,
			    resource_size_t size)
{
	struct plx_port *p = to_port(ntb);
	unsigned long flags;
	int rc;

	if (pidx)
		return -EINVAL;
	spin_lock_irqsave(&p->lock, flags);
	rc = plx_nt_mw_set_trans(&p->nt, widx, addr, size);
	spin_unlock_irqrestore(&p->lock, flags);
	return rc;
}

static int plx_mw_clear_trans(struct ntb_dev *ntb, int pidx, int widx)
{
	return plx_mw_set_trans(ntb, pidx, widx, 0, 0);
}

static int plx_peer_mw_count(struct ntb_dev *ntb)
{
	return plx_nt_mw_count(&to_port(ntb)->nt);
}

static int plx_peer_mw_get_addr(struct ntb_dev *ntb, int widx, phys_addr_t *base,
				resource_size_t *size)
{
	u64 b, s;
	int rc = plx_nt_peer_mw_get_addr(&to_port(ntb)->nt, widx, &b, &s);

	if (rc)
		return rc;
	if (base)
		*base = b;
	if (size)
		*size = s;
	return 0;
}

static u64 plx_db_valid_mask(struct ntb_dev *ntb)
{
	return PLX_DB_MASK;
}

static int plx_db_vector_count(struct ntb_dev *ntb)
{
	return 1;
}

static u64 plx_db_vector_mask(struct ntb_dev *ntb, int db_vector)
{
	return db_vector ? 0 : PLX_DB_MASK;
}

static u64 plx_db_read(struct ntb_dev *ntb)
{
	return plx_nt_db_read(&to_port(ntb)->nt);
}

static int plx_db_clear(struct ntb_dev *ntb, u64 db_bits)
{
	plx_nt_db_clear(&to_port(ntb)->nt, db_bits);
	return 0;
}

static u64 plx_db_read_mask(struct ntb_dev *ntb)
{
	return plx_nt_db_read_mask(&to_port(ntb)->nt);
}

static int plx_db_set_mask(struct ntb_dev *ntb, u64 db_bits)
{
	plx_nt_db_set_mask(&to_port(ntb)->nt, db_bits);
	return 0;
}

static int plx_db_clear_mask(struct ntb_dev *ntb, u64 db_bits)
{
	plx_nt_db_clear_mask(&to_port(ntb)->nt, db_bits);
	return 0;
}

static int plx_peer_db_set(struct ntb_dev *ntb, u64 db_bits)
{
	if (db_bits & ~PLX_DB_MASK)
		return -EINVAL;
	plx_nt_peer_db_set(&to_port(ntb)->nt, db_bits);
	return 0;
}

static int plx_spad_count(struct ntb_dev *ntb)
{
	return PLX_CLIENT_SPADS;
}

static u32 plx_spad_read(struct ntb_dev *ntb, int sidx)
{
	u32 v = 0;

	plx_nt_spad_read(&to_port(ntb)->nt, sidx, &v);
	return v;
}

static int plx_spad_write(struct ntb_dev *ntb, int sidx, u32 val)
{
	return plx_nt_spad_write(&to_port(ntb)->nt, sidx, val);
}

static u32 plx_peer_spad_read(struct ntb_dev *ntb, int pidx, int sidx)
{
	u32 v = 0;

	if (!pidx)
		plx_nt_peer_spad_read(&to_port(ntb)->nt, sidx, &v);
	return v;
}

static int plx_peer_spad_write(struct ntb_dev *ntb, int pidx, int sidx, u32 val)
{
	return pidx ? -EINVAL : plx_nt_peer_spad_write(&to_port(ntb)->nt, sidx, val);
}

static const struct ntb_dev_ops plx_ops = {
	.link_is_up = plx_link_is_up,
	.link_enable = plx_link_enable,
	.link_disable = plx_link_disable,
	.port_number = plx_port_number,
	.peer_port_count = plx_peer_port_count,
	.peer_port_number = plx_peer_port_number,
	.peer_port_idx = plx_peer_port_idx,
	.mw_count = plx_mw_count,
	.mw_get_align = plx_mw_get_align,
	.mw_set_trans = plx_mw_set_trans,
	.mw_clear_trans = plx_mw_clear_trans,
	.peer_mw_count = plx_peer_mw_count,
	.peer_mw_get_addr = plx_peer_mw_get_addr,
	.db_valid_mask = plx_db_valid_mask,
	.db_vector_count = plx_db_vector_count,
	.db_vector_mask = plx_db_vector_mask,
	.db_read = plx_db_read,
	.db_clear = plx_db_clear,
	.db_read_mask = plx_db_read_mask,
	.db_set_mask = plx_db_set_mask,
	.db_clear_mask = plx_db_clear_mask,
	.peer_db_set = plx_peer_db_set,
	.spad_count = plx_spad_count,
	.spad_read = plx_spad_read,
	.spad_write = plx_spad_write,
	.peer_spad_read = plx_peer_spad_read,
	.peer_spad_write = plx_peer_spad_write,
};

static irqreturn_t plx_irq(int irq, void *data)
{
	struct plx_port *p = data;
	u64 db;
	u32 err;
	int rc;

	spin_lock(&p->lock);
	rc = plx_nt_isr(&p->nt, &db, &err);
	spin_unlock(&p->lock);
	if (rc)
		return IRQ_NONE;
	if (db)
		ntb_db_event(&p->ntb, 0);
	if (err & PLX_LINK_ERR_DL_DOWN) {
		dev_info(&p->ntb.pdev->dev, "link down\n");
		WRITE_ONCE(p->went_down, true);
		mod_delayed_work(system_wq, &p->link_work, 0);
	} else if (err) {
		dev_warn_ratelimited(&p->ntb.pdev->dev, "link errors 0x%x\n", err);
	}
	return db || err ? IRQ_HANDLED : IRQ_NONE;
}

/*
 * Agrees on the port numbers with the peer (each poll while the link is up: a conflict is
 * seen, and ends, there). Whether the link may be reported up: only with a number that
 * the peer does not hold too.
 */
static bool plx_order(struct plx_port *p)
{
	int rc = plx_nt_order(&p->nt);

	if (rc >= 0 && p->order < 0) {
		WRITE_ONCE(p->order, rc);
		dev_info(&p->ntb.pdev->dev, "NTB port %d of the pair\n", rc);
	} else if (rc == -ENOTUNIQ) {
		plx_nt_order_init(&p->nt, get_random_u32()); /* the peer drew the same tag */
	}
	if ((rc == -EBUSY) != p->conflict) {
		p->conflict = rc == -EBUSY;
		if (p->conflict)
			dev_err(&p->ntb.pdev->dev,
				"peer holds NTB port %d too: link down until one side reloads "
				"pcientb\n",
				p->order);
	}
	return p->order >= 0 && !p->conflict;
}

/* Reports each change of the link (up comes only from here). */
static void plx_link_work(struct work_struct *work)
{
	struct plx_port *p = container_of(to_delayed_work(work), struct plx_port, link_work);
	bool up;
	u16 sta;

	/* Down and up again before this ran: clients still hear of the down first. */
	if (xchg(&p->went_down, false) && p->link_was_up) {
		WRITE_ONCE(p->link_was_up, false);
		ntb_link_event(&p->ntb);
	}
	up = plx_link_hw_up(p, &sta) && plx_order(p);
	if (up != p->link_was_up) {
		WRITE_ONCE(p->link_was_up, up);
		ntb_link_event(&p->ntb);
	}
	schedule_delayed_work(&p->link_work, msecs_to_jiffies(PLX_LINK_POLL_MS));
}

static int plx_probe(struct pci_dev *pdev, const struct pci_device_id *id)
{
	struct pci_dev *dma;
	struct plx_port *p;
	void __iomem *b2b;
	u32 nt_id;
	int rc, bar, i;

	p = devm_kzalloc(&pdev->dev, sizeof(*p), GFP_KERNEL);
	if (!p)
		return -ENOMEM;
	rc = pcim_enable_device(pdev);
	if (rc)
		return rc;
	rc = pcim_iomap_regions(pdev, BIT(0), "pcientb-plx");
	if (rc)
		return rc;
	pci_read_config_dword(pdev, PLX_CFG_NT_ID, &nt_id);
	rc = plx_nt_identify(&p->nt, pcim_iomap_table(pdev)[0], nt_id);
	if (rc) {
		dev_info(&pdev->dev, "NT link interface (NTB to root port): not driven\n");
		return -ENODEV;
	}
	for (bar = 2; bar <= 5; bar++) {
		unsigned long flags = pci_resource_flags(pdev, bar);
		bool is64 = flags & IORESOURCE_MEM_64;

		if (!(flags & IORESOURCE_MEM) || !pci_resource_len(pdev, bar))
			continue;
		if (plx_nt_add_mw(&p->nt, bar, is64, pci_resource_start(pdev, bar),
				  pci_resource_len(pdev, bar)))
			dev_warn(&pdev->dev, "BAR%d (%llu bytes) cannot be a window: skipped\n",
				 bar, (unsigned long long)pci_resource_len(pdev, bar));
		if (is64)
			bar++;
	}
	if (!p->nt.mw_count) {
		dev_err(&pdev->dev, "no memory window BAR: the chip's EEPROM enables none\n");
		return -ENODEV;
	}
	/* The windows are ours (released with the device: pcim); clients map them. */
	for (i = 0; i < p->nt.mw_count; i++) {
		rc = pci_request_region(pdev, p->nt.mw[i].bar, "pcientb-plx");
		if (rc)
			return rc;
	}
	/*
	 * The chip's DMA engines write through the windows: the NT must let them out. Which
	 * DMA functions are this chip's is not known here: every one in the PCI domain, each
	 * (bus, device) once (functions share an entry).
	 */
	for (dma = pci_get_device(PLX_VENDOR, PLX_DMA_DEVICE, NULL); dma;
	     dma = pci_get_device(PLX_VENDOR, PLX_DMA_DEVICE, dma)) {
		u16 rid = (u16)(dma->bus->number << 8 | PCI_SLOT(dma->devfn) << 3);

		if (pci_domain_nr(dma->bus) != pci_domain_nr(pdev->bus))
			continue;
		for (i = 0; i < p->nt.rid_count && p->nt.rids[i] != rid; i++)
			;
		if (i == p->nt.rid_count &&
		    plx_nt_add_requester(&p->nt, dma->bus->number, PCI_SLOT(dma->devfn)))
			dev_warn(&pdev->dev, "no room to let DMA function %s out\n", pci_name(dma));
	}
	/* The B2B window's first 256 KiB are the peer chip's registers. */
	b2b = pcim_iomap(pdev, p->nt.mw[p->nt.mw_count - 1].bar, PLX_REGS_SIZE);
	if (!b2b)
		return -ENOMEM;
	rc = dma_set_mask_and_coherent(&pdev->dev, DMA_BIT_MASK(64));
	if (rc)
		return rc;
	pci_set_master(pdev);
	spin_lock_init(&p->lock);
	INIT_DELAYED_WORK(&p->link_work, plx_link_work);
	rc = plx_nt_start(&p->nt, b2b);
	if (rc)
		return rc;
	p->order = -EAGAIN;
	plx_nt_order_init(&p->nt, get_random_u32());
	p->ntb.pdev = pdev;
	p->ntb.topo = NTB_TOPO_CROSSLINK; /* two chips, symmetric */
	p->ntb.ops = &plx_ops;
	pci_set_drvdata(pdev, p);
	rc = ntb_register_device(&p->ntb);
	if (rc)
		goto stop;
	rc = request_irq(pdev->irq, plx_irq, IRQF_SHARED, "pcientb-plx", p);
	if (rc)
		goto unregister;
	plx_nt_irq_on(&p->nt);
	schedule_delayed_work(&p->link_work, 0);
	dev_info(&pdev->dev, "PEX NT%u virtual interface, port %u, %d windows, %u A-LUT entries\n",
		 p->nt.ntx, p->nt.port, plx_nt_mw_count(&p->nt), 128 * p->nt.alut);
	return 0;

unregister:
	ntb_unregister_device(&p->ntb);
	cancel_delayed_work_sync(&p->link_work); /* a client may have enabled the link */
stop:
	plx_nt_stop(&p->nt);
	return rc;
}

static void plx_remove(struct pci_dev *pdev)
{
	struct plx_port *p = pci_get_drvdata(pdev);
	unsigned long flags;

	ntb_unregister_device(&p->ntb);
	/* Masked first (and the windows closed), so the line is quiet when it is freed. */
	spin_lock_irqsave(&p->lock, flags);
	plx_nt_stop(&p->nt);
	spin_unlock_irqrestore(&p->lock, flags);
	free_irq(pdev->irq, p); /* the handler no longer schedules the link work */
	cancel_delayed_work_sync(&p->link_work);
	plx_nt_order_clear(&p->nt); /* a peer that comes reads no number of ours */
}

static const struct pci_device_id plx_ids[] = {
	{ PCI_DEVICE(PLX_VENDOR, 0x87b0) }, /* NT0 virtual interface */
	{ PCI_DEVICE(PLX_VENDOR, 0x87b1) }, /* NT1 virtual interface */
	{ 0 }
};
MODULE_DEVICE_TABLE(pci, plx_ids);

static struct pci_driver plx_driver = {
	.name = "pcientb-plx",
	.id_table = plx_ids,
	.probe = plx_probe,
	.remove = plx_remove,
};

int pcientb_plx_init(void)
{
	return pci_register_driver(&plx_driver);
}

void pcientb_plx_exit(void)
{
	pci_unregister_driver(&plx_driver);
}
