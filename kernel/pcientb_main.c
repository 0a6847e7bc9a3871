// SPDX-License-Identifier: GPL-2.0
/*
 * pcientb.ko: the module and its NTB client.
 *
 * The client takes every NTB device the hardware drivers register, enables its link and
 * counts its doorbells and link events (debugfs pcientb/<device>/link: "up|down EVENTS").
 * debugfs pcientb/<device>/selftest runs, toward the device's peer
 * port when both are in this kernel (the one-guest test), what the transport will rely
 * on: scratchpads both ways, a doorbell, and a write through the peer's memory window
 * that lands where the peer's inbound translation points.
 */
#include <linux/module.h>
#include <linux/debugfs.h>
#include <linux/delay.h>
#include <linux/dma-mapping.h>
#include <linux/io.h>
#include <linux/ktime.h>
#include <linux/list.h>
#include <linux/mutex.h>
#include <linux/ntb.h>
#include <linux/seq_file.h>
#include <linux/wait.h>

#include "pcientb.h"

#define PCIENTB_SELFTEST_BYTES (64 * 1024)
#define PCIENTB_WAIT_MS 2000

struct pcientb_port {
	struct list_head node;
	struct ntb_dev *ntb;
	struct dentry *dir;
	atomic_t db_events[BITS_PER_LONG];
	atomic_t link_events;
	wait_queue_head_t wq;
};

static DEFINE_MUTEX(ports_lock);
static LIST_HEAD(ports);
static struct dentry *debug_root;

static void port_link_event(void *ctx)
{
	struct pcientb_port *port = ctx;

	atomic_inc(&port->link_events);
	wake_up_all(&port->wq);
}

static void port_db_event(void *ctx, int vector)
{
	struct pcientb_port *port = ctx;
	u64 bits = ntb_db_vector_mask(port->ntb, vector);

	if (vector >= 0 && vector < BITS_PER_LONG)
		atomic_inc(&port->db_events[vector]);
	ntb_db_clear(port->ntb, bits);
	wake_up_all(&port->wq);
}

static const struct ntb_ctx_ops port_ctx_ops = {
	.link_event = port_link_event,
	.db_event = port_db_event,
};

/* The port of this kernel that is `port`'s peer, if any. Called with ports_lock held. */
static struct pcientb_port *peer_of(struct pcientb_port *port)
{
	int want = ntb_peer_port_number(port->ntb, 0);
	struct pcientb_port *p;

	list_for_each_entry(p, &ports, node)
		if (p != port && ntb_port_number(p->ntb) == want)
			return p;
	return NULL;
}

static bool link_up(struct pcientb_port *p)
{
	return ntb_link_is_up(p->ntb, NULL, NULL) != 0;
}

static int selftest_spads(struct seq_file *s, struct pcientb_port *a, struct pcientb_port *b)
{
	u32 token = get_random_u32();

	ntb_spad_write(a->ntb, 0, token);
	ntb_peer_spad_write(b->ntb, 0, 1, ~token);
	if (ntb_peer_spad_read(b->ntb, 0, 0) != token || ntb_spad_read(a->ntb, 1) != ~token) {
		seq_puts(
			s,
			"FAIL scratchpads: a value written on one side is not read on the other\n");
		return -EIO;
	}
	seq_printf(s, "ok   scratchpads (%d per port)\n", ntb_spad_count(a->ntb));
	return 0;
}

/* Rings doorbell bit 0 of b from a: microseconds until b's event, or -1. */
static s64 ring_peer(struct pcientb_port *a, struct pcientb_port *b)
{
	int before = atomic_read(&b->db_events[0]);
	ktime_t t0 = ktime_get();

	ntb_peer_db_set(a->ntb, BIT_ULL(0));
	if (!wait_event_timeout(b->wq, atomic_read(&b->db_events[0]) != before,
				msecs_to_jiffies(PCIENTB_WAIT_MS)))
		return -1;
	return ktime_us_delta(ktime_get(), t0);
}

static int selftest_doorbell(struct seq_file *s, struct pcientb_port *a, struct pcientb_port *b)
{
	s64 us = ring_peer(a, b);

	if (us < 0) {
		seq_puts(s, "FAIL doorbell: the peer saw no doorbell event\n");
		return -EIO;
	}
	seq_printf(s, "ok   doorbell (%lld us to the peer's event)\n", us);
	return 0;
}

static int selftest_window(struct seq_file *s, struct pcientb_port *a, struct pcientb_port *b)
{
	struct device *dev = &b->ntb->pdev->dev;
	resource_size_t size = PCIENTB_SELFTEST_BYTES;
	phys_addr_t base;
	resource_size_t got;
	void __iomem *out;
	dma_addr_t dma;
	u8 *in;
	size_t i;
	int rc = -EIO;

	if (ntb_mw_count(b->ntb, 0) < 1) {
		seq_puts(s, "FAIL window: no memory window\n");
		return -EIO;
	}
	in = dma_alloc_coherent(dev, size, &dma, GFP_KERNEL);
	if (!in)
		return -ENOMEM;
	memset(in, 0, size);
	if (ntb_mw_set_trans(b->ntb, 0, 0, dma, size) ||
	    ntb_peer_mw_get_addr(a->ntb, 0, &base, &got) || got != size) {
		seq_puts(
			s,
			"FAIL window: the translation set by one side is not the other's window\n");
		goto free;
	}
	out = ioremap_wc(base, size);
	if (!out) {
		rc = -ENOMEM;
		goto clear;
	}
	for (i = 0; i < size; i += 4)
		iowrite32(0x9e3779b9u * (u32)(i / 4 + 1), out + i);
	wmb(); /* the data, then the doorbell that announces it */
	iounmap(out);
	if (ring_peer(a, b) < 0) {
		seq_puts(s, "FAIL window: the peer saw no doorbell after the write\n");
		goto clear;
	}
	for (i = 0; i < size; i += 4) {
		if (*(u32 *)(in + i) != 0x9e3779b9u * (u32)(i / 4 + 1)) {
			seq_printf(s,
				   "FAIL window: byte %zu of the peer's buffer is not what was "
				   "written\n",
				   i);
			goto clear;
		}
	}
	seq_printf(s,
		   "ok   window (%llu KiB written through the window, read in the peer's memory)\n",
		   (unsigned long long)size >> 10);
	rc = 0;
clear:
	ntb_mw_clear_trans(b->ntb, 0, 0);
free:
	dma_free_coherent(dev, size, in, dma);
	return rc;
}

static int selftest_show(struct seq_file *s, void *unused)
{
	struct pcientb_port *a = s->private, *b;
	int rc;

	mutex_lock(&ports_lock);
	b = peer_of(a);
	if (!b) {
		seq_puts(s, "FAIL no peer port in this kernel\n");
		rc = 0;
		goto out;
	}
	if (!wait_event_timeout(a->wq, link_up(a), msecs_to_jiffies(PCIENTB_WAIT_MS)) ||
	    !link_up(b)) {
		seq_puts(s, "FAIL link: not up on both ports\n");
		goto out;
	}
	seq_puts(s, "ok   link up\n");
	rc = selftest_spads(s, a, b);
	if (!rc)
		rc = selftest_doorbell(s, a, b);
	if (!rc)
		rc = selftest_window(s, a, b);
	if (!rc)
		seq_puts(s, "PASS\n");
out:
	mutex_unlock(&ports_lock);
	return 0;
}
DEFINE_SHOW_ATTRIBUTE(selftest);

/* The link as the port sees it, and how many link events it has had. */
static int link_show(struct seq_file *s, void *unused)
{
	struct pcientb_port *port = s->private;

	seq_printf(s, "%s %d\n", link_up(port) ? "up" : "down", atomic_read(&port->link_events));
	return 0;
}
DEFINE_SHOW_ATTRIBUTE(link);

static int pcientb_probe(struct ntb_client *client, struct ntb_dev *ntb)
{
	struct pcientb_port *port;
	int rc;

	port = kzalloc(sizeof(*port), GFP_KERNEL);
	if (!port)
		return -ENOMEM;
	port->ntb = ntb;
	init_waitqueue_head(&port->wq);
	rc = ntb_set_ctx(ntb, port, &port_ctx_ops);
	if (rc) {
		kfree(port);
		return rc;
	}
	port->dir = debugfs_create_dir(dev_name(&ntb->dev), debug_root);
	debugfs_create_file("selftest", 0400, port->dir, port, &selftest_fops);
	debugfs_create_file("link", 0400, port->dir, port, &link_fops);
	mutex_lock(&ports_lock);
	list_add_tail(&port->node, &ports);
	mutex_unlock(&ports_lock);
	ntb_link_enable(ntb, NTB_SPEED_AUTO, NTB_WIDTH_AUTO);
	return 0;
}

static void pcientb_remove(struct ntb_client *client, struct ntb_dev *ntb)
{
	struct pcientb_port *port = ntb->ctx;

	ntb_link_disable(ntb);
	ntb_clear_ctx(ntb);
	debugfs_remove_recursive(port->dir);
	mutex_lock(&ports_lock);
	list_del(&port->node);
	mutex_unlock(&ports_lock);
	kfree(port);
}

static struct ntb_client pcientb_client = {
	.ops = {
		.probe = pcientb_probe,
		.remove = pcientb_remove,
	},
};

static int __init pcientb_init(void)
{
	int rc;

	debug_root = debugfs_create_dir("pcientb", NULL);
	rc = ntb_register_client(&pcientb_client);
	if (rc)
		goto err;
	rc = pcientb_ivshmem_init();
	if (rc) {
		ntb_unregister_client(&pcientb_client);
		goto err;
	}
	return 0;
err:
	debugfs_remove_recursive(debug_root);
	return rc;
}

static void __exit pcientb_exit(void)
{
	pcientb_ivshmem_exit();
	ntb_unregister_client(&pcientb_client);
	debugfs_remove_recursive(debug_root);
}

module_init(pcientb_init);
module_exit(pcientb_exit);
MODULE_DESCRIPTION("RDMA verbs over PCIe non-transparent bridges");
MODULE_LICENSE("GPL");
