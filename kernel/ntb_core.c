// SPDX-License-Identifier: GPL-2.0
/*
 * The part of the Linux NTB core (include/linux/ntb.h) that pcientb needs, for kernels
 * built without CONFIG_NTB (Debian's): hardware drivers register ntb_dev objects, one
 * client (pcientb's transport) is told of each. A kernel with its own NTB core uses that
 * one instead (see Kbuild).
 *
 * Unlike the kernel's core there is no "ntb" bus: devices hang under their PCI device,
 * and every registered client is offered every device, in order of registration.
 */
#include <linux/module.h>
#include <linux/mutex.h>
#include <linux/list.h>
#include <linux/ntb.h>

#include "pcientb.h"

struct ntb_binding {
	struct list_head node;
	struct ntb_dev *ntb;
	struct ntb_client *client; /* the client that took it, or NULL */
};

static DEFINE_MUTEX(ntb_core_lock);
static LIST_HEAD(ntb_devices);
static struct ntb_client *ntb_the_client;

static void ntb_offer(struct ntb_binding *b)
{
	if (!ntb_the_client || b->client)
		return;
	if (!ntb_the_client->ops.probe(ntb_the_client, b->ntb))
		b->client = ntb_the_client;
}

static void ntb_dev_release(struct device *dev)
{
	complete(&dev_ntb(dev)->released);
}

int ntb_register_device(struct ntb_dev *ntb)
{
	struct ntb_binding *b;
	int rc;

	if (!ntb || !ntb->pdev || !ntb_dev_ops_is_valid(ntb->ops))
		return -EINVAL;
	b = kzalloc(sizeof(*b), GFP_KERNEL);
	if (!b)
		return -ENOMEM;
	init_completion(&ntb->released);
	spin_lock_init(&ntb->ctx_lock);
	ntb->ctx = NULL;
	ntb->ctx_ops = NULL;
	device_initialize(&ntb->dev);
	ntb->dev.parent = &ntb->pdev->dev;
	ntb->dev.release = ntb_dev_release;
	rc = dev_set_name(&ntb->dev, "ntb-%s", pci_name(ntb->pdev));
	if (!rc)
		rc = device_add(&ntb->dev);
	if (rc) {
		put_device(&ntb->dev);
		wait_for_completion(&ntb->released);
		kfree(b);
		return rc;
	}
	b->ntb = ntb;
	mutex_lock(&ntb_core_lock);
	list_add_tail(&b->node, &ntb_devices);
	ntb_offer(b);
	mutex_unlock(&ntb_core_lock);
	return 0;
}

void ntb_unregister_device(struct ntb_dev *ntb)
{
	struct ntb_binding *b, *found = NULL;

	mutex_lock(&ntb_core_lock);
	list_for_each_entry(b, &ntb_devices, node) {
		if (b->ntb == ntb) {
			found = b;
			break;
		}
	}
	if (found) {
		if (found->client)
			found->client->ops.remove(found->client, ntb);
		list_del(&found->node);
	}
	mutex_unlock(&ntb_core_lock);
	kfree(found);
	device_unregister(&ntb->dev);
	wait_for_completion(&ntb->released);
}

int __ntb_register_client(struct ntb_client *client, struct module *mod, const char *mod_name)
{
	struct ntb_binding *b;

	if (!client || !ntb_client_ops_is_valid(&client->ops))
		return -EINVAL;
	mutex_lock(&ntb_core_lock);
	if (ntb_the_client) {
		mutex_unlock(&ntb_core_lock);
		return -EBUSY;
	}
	ntb_the_client = client;
	list_for_each_entry(b, &ntb_devices, node)
		ntb_offer(b);
	mutex_unlock(&ntb_core_lock);
	return 0;
}

void ntb_unregister_client(struct ntb_client *client)
{
	struct ntb_binding *b;

	mutex_lock(&ntb_core_lock);
	list_for_each_entry(b, &ntb_devices, node) {
		if (b->client == client) {
			client->ops.remove(client, b->ntb);
			b->client = NULL;
		}
	}
	if (ntb_the_client == client)
		ntb_the_client = NULL;
	mutex_unlock(&ntb_core_lock);
}

int ntb_set_ctx(struct ntb_dev *ntb, void *ctx, const struct ntb_ctx_ops *ctx_ops)
{
	unsigned long irqflags;

	if (!ntb_ctx_ops_is_valid(ctx_ops))
		return -EINVAL;
	if (ntb->ctx_ops)
		return -EINVAL;
	spin_lock_irqsave(&ntb->ctx_lock, irqflags);
	ntb->ctx = ctx;
	ntb->ctx_ops = ctx_ops;
	spin_unlock_irqrestore(&ntb->ctx_lock, irqflags);
	return 0;
}

void ntb_clear_ctx(struct ntb_dev *ntb)
{
	unsigned long irqflags;

	spin_lock_irqsave(&ntb->ctx_lock, irqflags);
	ntb->ctx_ops = NULL;
	ntb->ctx = NULL;
	spin_unlock_irqrestore(&ntb->ctx_lock, irqflags);
}

void ntb_link_event(struct ntb_dev *ntb)
{
	unsigned long irqflags;

	spin_lock_irqsave(&ntb->ctx_lock, irqflags);
	if (ntb->ctx_ops && ntb->ctx_ops->link_event)
		ntb->ctx_ops->link_event(ntb->ctx);
	spin_unlock_irqrestore(&ntb->ctx_lock, irqflags);
}

void ntb_db_event(struct ntb_dev *ntb, int vector)
{
	unsigned long irqflags;

	spin_lock_irqsave(&ntb->ctx_lock, irqflags);
	if (ntb->ctx_ops && ntb->ctx_ops->db_event)
		ntb->ctx_ops->db_event(ntb->ctx, vector);
	spin_unlock_irqrestore(&ntb->ctx_lock, irqflags);
}

void ntb_msg_event(struct ntb_dev *ntb)
{
	unsigned long irqflags;

	spin_lock_irqsave(&ntb->ctx_lock, irqflags);
	if (ntb->ctx_ops && ntb->ctx_ops->msg_event)
		ntb->ctx_ops->msg_event(ntb->ctx);
	spin_unlock_irqrestore(&ntb->ctx_lock, irqflags);
}

int ntb_default_port_number(struct ntb_dev *ntb)
{
	switch (ntb->topo) {
	case NTB_TOPO_PRI:
	case NTB_TOPO_B2B_USD:
		return NTB_PORT_PRI_USD;
	case NTB_TOPO_SEC:
	case NTB_TOPO_B2B_DSD:
		return NTB_PORT_SEC_DSD;
	default:
		return 0;
	}
}

int ntb_default_peer_port_count(struct ntb_dev *ntb)
{
	return NTB_DEF_PEER_CNT;
}

int ntb_default_peer_port_number(struct ntb_dev *ntb, int pidx)
{
	if (pidx != NTB_DEF_PEER_IDX)
		return -EINVAL;
	return ntb_default_port_number(ntb) == NTB_PORT_PRI_USD ? NTB_PORT_SEC_DSD :
								  NTB_PORT_PRI_USD;
}

int ntb_default_peer_port_idx(struct ntb_dev *ntb, int port)
{
	return port == ntb_default_peer_port_number(ntb, NTB_DEF_PEER_IDX) ? NTB_DEF_PEER_IDX :
									     -EINVAL;
}
