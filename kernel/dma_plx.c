// SPDX-License-Identifier: GPL-2.0
/*
 * The PEX87xx DMA engine (10b5:87d0, one channel per PCI function) as a dmaengine
 * DMA_MEMCPY provider: what a client such as ntb_transport, or pcientb's data path,
 * asks for with dma_request_channel(); without one a client copies with the CPU. The
 * ring and its registers are plx_dma.c (tested against the register model); this file is
 * the dmaengine contract: cookies, callbacks (invoked without the ring lock, so that they
 * may submit more), the interrupt, and teardown. Debian's kernel does not build the
 * upstream plx_dma driver, so the same device is ours here.
 */
#include <linux/module.h>
#include <linux/pci.h>
#include <linux/interrupt.h>
#include <linux/dmaengine.h>
#include <linux/dma-mapping.h>
#include <linux/slab.h>

#include "pcientb.h"
#include "plx_dma.h"

#define PLX_DMA_RING 256

struct plx_dma_chan {
	struct dma_device dd;
	struct dma_chan chan;
	struct pci_dev *pdev;
	void __iomem *regs;
	int irq;
	spinlock_t lock; /* the ring (prep, submit, kick, reap) and the flags below */
	struct plx_dma hw;
	struct plx_dma_desc *ring;
	dma_addr_t ring_dma;
	u32 *len;
	struct dma_async_tx_descriptor *txd; /* one per slot */
	struct tasklet_struct reap_task;
	atomic_t status; /* interrupt status bits the tasklet has not handled */
	bool active; /* channel resources allocated */
	bool removed; /* the device is going: no new channel resources */
	bool gone; /* its registers are unmapped: no access */
};

static struct plx_dma_chan *to_chan(struct dma_chan *chan)
{
	return container_of(chan, struct plx_dma_chan, chan);
}

/* Completes what the engine finished, oldest first; callbacks run unlocked. */
static void plx_dma_reap_all(struct plx_dma_chan *c)
{
	for (;;) {
		struct dma_async_tx_descriptor *txd;
		dma_async_tx_callback_result cb_result;
		dma_async_tx_callback cb;
		struct dmaengine_result res;
		enum plx_dma_result r;
		void *param;
		u32 residue;
		int slot;

		spin_lock_bh(&c->lock);
		slot = c->active ? plx_dma_reap(&c->hw, &r, &residue) : -EAGAIN;
		if (slot < 0) {
			spin_unlock_bh(&c->lock);
			return;
		}
		txd = &c->txd[slot];
		/* Cookies are given at prep, in slot order: completions come in that order. */
		c->chan.completed_cookie = txd->cookie;
		txd->cookie = 0;
		dma_descriptor_unmap(txd);
		cb = txd->callback;
		cb_result = txd->callback_result;
		param = txd->callback_param;
		txd->callback = NULL;
		txd->callback_result = NULL;
		spin_unlock_bh(&c->lock);

		res.residue = residue;
		res.result = r == PLX_DMA_OK	       ? DMA_TRANS_NOERROR :
			     r == PLX_DMA_READ_FAILED  ? DMA_TRANS_READ_FAILED :
			     r == PLX_DMA_WRITE_FAILED ? DMA_TRANS_WRITE_FAILED :
							 DMA_TRANS_ABORTED;
		if (cb_result)
			cb_result(param, &res);
		else if (cb)
			cb(param);
	}
}

static void plx_dma_reap_task(struct tasklet_struct *t)
{
	struct plx_dma_chan *c = from_tasklet(c, t, reap_task);

	/* A failed descriptor stopped the engine: the ones after it run now. */
	if (atomic_xchg(&c->status, 0) & PLX_DMA_INTR_ERROR) {
		spin_lock_bh(&c->lock);
		if (c->active && !c->gone)
			plx_dma_kick(&c->hw); /* nothing once stopped */
		spin_unlock_bh(&c->lock);
	}
	plx_dma_reap_all(c);
}

/* Takes no lock: the interrupt status register is the handler's alone. */
static irqreturn_t plx_dma_isr(int irq, void *data)
{
	struct plx_dma_chan *c = data;
	u16 status;

	if (!READ_ONCE(c->active) || READ_ONCE(c->gone))
		return IRQ_NONE;
	status = plx_dma_irq(&c->hw);
	if (!status)
		return IRQ_NONE;
	atomic_or(status, &c->status);
	tasklet_schedule(&c->reap_task);
	return IRQ_HANDLED;
}

static dma_cookie_t plx_dma_tx_submit(struct dma_async_tx_descriptor *txd)
{
	struct plx_dma_chan *c = to_chan(txd->chan);
	dma_cookie_t cookie;

	spin_lock_bh(&c->lock);
	cookie = txd->cookie;
	plx_dma_submit(&c->hw, txd - c->txd);
	spin_unlock_bh(&c->lock);
	return cookie;
}

/*
 * Takes a slot and its cookie (in slot order, which is completion order); tx_submit
 * gives it to the engine once the slots before it are given. A prepared descriptor must
 * be submitted: one that never is holds back those after it.
 */
static struct dma_async_tx_descriptor *plx_dma_prep_memcpy(struct dma_chan *chan, dma_addr_t dst,
							   dma_addr_t src, size_t len,
							   unsigned long flags)
{
	struct plx_dma_chan *c = to_chan(chan);
	struct dma_async_tx_descriptor *txd = NULL;
	dma_cookie_t cookie;
	int slot;

	spin_lock_bh(&c->lock);
	if (!c->active || len > PLX_DMA_MAX_LEN)
		goto out;
	slot = plx_dma_prep(&c->hw, dst, src, len, flags & DMA_PREP_INTERRUPT);
	if (slot < 0)
		goto out;
	cookie = chan->cookie + 1;
	if (cookie < DMA_MIN_COOKIE)
		cookie = DMA_MIN_COOKIE;
	chan->cookie = cookie;
	txd = &c->txd[slot];
	txd->cookie = cookie;
	txd->flags = flags;
out:
	spin_unlock_bh(&c->lock);
	return txd;
}

static void plx_dma_issue_pending(struct dma_chan *chan)
{
	struct plx_dma_chan *c = to_chan(chan);

	spin_lock_bh(&c->lock);
	if (c->active && !c->gone)
		plx_dma_kick(&c->hw);
	spin_unlock_bh(&c->lock);
}

/* Reaps (and calls back) what finished, as other drivers' tx_status do. */
static enum dma_status plx_dma_tx_status(struct dma_chan *chan, dma_cookie_t cookie,
					 struct dma_tx_state *state)
{
	enum dma_status st = dma_async_is_complete(cookie, chan->completed_cookie, chan->cookie);

	if (st != DMA_COMPLETE) {
		plx_dma_reap_all(to_chan(chan));
		st = dma_async_is_complete(cookie, chan->completed_cookie, chan->cookie);
	}
	dma_set_tx_state(state, chan->completed_cookie, chan->cookie, 0);
	return st;
}

static int plx_dma_alloc_chan_resources(struct dma_chan *chan)
{
	struct plx_dma_chan *c = to_chan(chan);
	struct device *dev = &c->pdev->dev;
	int i, rc = -ENOMEM;

	c->ring =
		dma_alloc_coherent(dev, PLX_DMA_RING * sizeof(*c->ring), &c->ring_dma, GFP_KERNEL);
	c->len = kcalloc(PLX_DMA_RING, sizeof(*c->len), GFP_KERNEL);
	c->txd = kcalloc(PLX_DMA_RING, sizeof(*c->txd), GFP_KERNEL);
	if (!c->ring || !c->len || !c->txd)
		goto free;
	for (i = 0; i < PLX_DMA_RING; i++) {
		dma_async_tx_descriptor_init(&c->txd[i], chan);
		c->txd[i].tx_submit = plx_dma_tx_submit;
	}
	pci_set_master(c->pdev); /* cut after an engine that did not stop */
	chan->cookie = DMA_MIN_COOKIE;
	chan->completed_cookie = DMA_MIN_COOKIE;
	atomic_set(&c->status, 0);
	spin_lock_bh(&c->lock);
	rc = c->removed ? -ENODEV :
			  plx_dma_init(&c->hw, c->regs, c->ring, c->ring_dma, PLX_DMA_RING, c->len);
	c->active = !rc;
	spin_unlock_bh(&c->lock);
	if (rc)
		goto free;
	return PLX_DMA_RING;
free:
	kfree(c->txd);
	kfree(c->len);
	if (c->ring)
		dma_free_coherent(dev, PLX_DMA_RING * sizeof(*c->ring), c->ring, c->ring_dma);
	c->ring = NULL;
	return rc;
}

/*
 * Stops the engine (once; may sleep): no new work, then the engine paused or aborted, or
 * its bus mastering cut if it does neither; then what it did not run completes as aborted.
 */
static void plx_dma_halt(struct plx_dma_chan *c)
{
	bool engine;

	spin_lock_bh(&c->lock);
	engine = c->active && !c->gone && !c->hw.stopped;
	c->hw.stopped = true; /* no more preps or kicks */
	spin_unlock_bh(&c->lock);
	if (engine && plx_dma_stop(&c->hw)) {
		dev_err(&c->pdev->dev, "DMA engine did not stop: bus mastering off\n");
		pci_clear_master(c->pdev);
	}
	synchronize_irq(c->irq);
	tasklet_kill(&c->reap_task);
	plx_dma_reap_all(c);
}

static void plx_dma_free_chan_resources(struct dma_chan *chan)
{
	struct plx_dma_chan *c = to_chan(chan);

	plx_dma_halt(c);
	spin_lock_bh(&c->lock);
	c->active = false;
	spin_unlock_bh(&c->lock);
	dma_free_coherent(&c->pdev->dev, PLX_DMA_RING * sizeof(*c->ring), c->ring, c->ring_dma);
	c->ring = NULL;
	kfree(c->txd);
	kfree(c->len);
	c->txd = NULL;
	c->len = NULL;
}

static void plx_dma_release(struct dma_device *dd)
{
	struct plx_dma_chan *c = container_of(dd, struct plx_dma_chan, dd);

	put_device(&c->pdev->dev);
	kfree(c);
}

static int plx_dma_probe(struct pci_dev *pdev, const struct pci_device_id *id)
{
	struct plx_dma_chan *c;
	int rc;

	rc = pcim_enable_device(pdev);
	if (rc)
		return rc;
	rc = dma_set_mask_and_coherent(&pdev->dev, DMA_BIT_MASK(48));
	if (rc)
		return rc;
	rc = pcim_iomap_regions(pdev, BIT(0), "pcientb-plx-dma");
	if (rc)
		return rc;
	rc = pci_alloc_irq_vectors(pdev, 1, 1, PCI_IRQ_ALL_TYPES);
	if (rc < 0)
		return rc;
	pci_set_master(pdev);
	c = kzalloc(sizeof(*c), GFP_KERNEL);
	if (!c) {
		rc = -ENOMEM;
		goto vectors;
	}
	c->pdev = pdev;
	c->regs = pcim_iomap_table(pdev)[0];
	c->irq = pci_irq_vector(pdev, 0);
	spin_lock_init(&c->lock);
	tasklet_setup(&c->reap_task, plx_dma_reap_task);
	rc = request_irq(c->irq, plx_dma_isr, IRQF_SHARED, "pcientb-plx-dma", c);
	if (rc)
		goto free;
	INIT_LIST_HEAD(&c->dd.channels);
	dma_cap_set(DMA_MEMCPY, c->dd.cap_mask);
	c->dd.copy_align = DMAENGINE_ALIGN_1_BYTE;
	c->dd.dev = get_device(&pdev->dev);
	c->dd.device_alloc_chan_resources = plx_dma_alloc_chan_resources;
	c->dd.device_free_chan_resources = plx_dma_free_chan_resources;
	c->dd.device_prep_dma_memcpy = plx_dma_prep_memcpy;
	c->dd.device_issue_pending = plx_dma_issue_pending;
	c->dd.device_tx_status = plx_dma_tx_status;
	c->dd.device_release = plx_dma_release;
	c->chan.device = &c->dd;
	list_add_tail(&c->chan.device_node, &c->dd.channels);
	rc = dma_async_device_register(&c->dd);
	if (rc) {
		put_device(&pdev->dev);
		free_irq(c->irq, c);
		goto free;
	}
	pci_set_drvdata(pdev, c);
	dev_info(&pdev->dev, "PEX DMA channel, ring of %d\n", PLX_DMA_RING);
	return 0;
free:
	kfree(c);
vectors:
	pci_free_irq_vectors(pdev);
	return rc;
}

static void plx_dma_remove(struct pci_dev *pdev)
{
	struct plx_dma_chan *c = pci_get_drvdata(pdev);

	spin_lock_bh(&c->lock);
	c->removed = true; /* no new channel resources */
	spin_unlock_bh(&c->lock);
	plx_dma_halt(c); /* a client still holding the channel gets its work aborted */
	free_irq(c->irq, c);
	spin_lock_bh(&c->lock);
	c->gone = true; /* the registers go with the device */
	spin_unlock_bh(&c->lock);
	dma_async_device_unregister(&c->dd); /* c is freed by plx_dma_release */
	pci_free_irq_vectors(pdev);
}

static const struct pci_device_id plx_dma_ids[] = {
	{ .vendor = PLX_VENDOR,
	  .device = PLX_DMA_DEVICE,
	  .subvendor = PCI_ANY_ID,
	  .subdevice = PCI_ANY_ID,
	  .class = PCI_CLASS_SYSTEM_OTHER << 8, /* as the chip's DMA functions report */
	  .class_mask = 0xffffff },
	{ 0 }
};
MODULE_DEVICE_TABLE(pci, plx_dma_ids);

static struct pci_driver plx_dma_driver = {
	.name = "pcientb-plx-dma",
	.id_table = plx_dma_ids,
	.probe = plx_dma_probe,
	.remove = plx_dma_remove,
};

int pcientb_plx_dma_init(void)
{
	return pci_register_driver(&plx_dma_driver);
}

void pcientb_plx_dma_exit(void)
{
	pci_unregister_driver(&plx_dma_driver);
}
