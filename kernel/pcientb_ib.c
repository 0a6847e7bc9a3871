// SPDX-License-Identifier: GPL-2.0
/*
 * pcientb.ko: the verbs device. Each NTB port is an ib_device "pcientb<N>" registered with
 * uverbs under PCIENTB_DRIVER_ID, so that libibverbs lists it with no preload and binds it
 * to libpcientb-rdmav34.so.
 *
 * What it serves: device and port queries, user contexts (each a node of the fabric with a
 * LID of its own, pcientb_node.c; or, asked so, a context without a node), protection
 * domains and memory regions (pcientb_mem.c); the port is ACTIVE while the NTB link is up,
 * and each change of the link is an async event (IB_EVENT_PORT_ACTIVE / IB_EVENT_PORT_ERR).
 * It has no queue pairs or completion queues of its own (max_qp = max_cq = 0): the
 * provider's engine keeps them in the process, on the kernel fabric that the nodes' services
 * make (providers/pcientb/fabric/kernel, docs/kernel.md).
 */
#include <linux/ntb.h>
#include <linux/random.h>
#include <linux/pci.h>

#include "pcientb.h"
#include "pcientb_ib.h"
#include "pcientb-abi.h"

struct pcientb_pd {
	struct ib_pd ibpd;
};

static bool port_active(struct pcientb_ib *dev)
{
	return ntb_link_is_up(dev->ntb, NULL, NULL) != 0;
}

static int pcientb_query_device(struct ib_device *ibdev, struct ib_device_attr *attr,
				struct ib_udata *udata)
{
	struct pci_dev *pdev = to_dev(ibdev)->ntb->pdev;

	if (udata->inlen || udata->outlen)
		return -EINVAL;
	memset(attr, 0, sizeof(*attr));
	attr->sys_image_guid = ibdev->node_guid;
	attr->vendor_id = pdev->vendor;
	attr->vendor_part_id = pdev->device;
	attr->hw_ver = pdev->revision;
	attr->page_size_cap = PAGE_SIZE;
	attr->max_pd = PCIENTB_MAX_PD;
	attr->max_mr = PCIENTB_MAX_MR - 1; /* index 0 is no region's */
	attr->max_mr_size = PCIENTB_MAX_MR_SIZE;
	attr->max_pkeys = 1;
	attr->device_cap_flags = IB_DEVICE_PORT_ACTIVE_EVENT;
	return 0;
}

static int pcientb_query_port(struct ib_device *ibdev, u32 port, struct ib_port_attr *attr)
{
	bool up = port_active(to_dev(ibdev));

	/* ib_query_port() cleared *attr. */
	attr->state = up ? IB_PORT_ACTIVE : IB_PORT_DOWN;
	/* The link is enabled from probe on: down means it waits for the peer. */
	attr->phys_state = up ? IB_PORT_PHYS_STATE_LINK_UP : IB_PORT_PHYS_STATE_POLLING;
	attr->max_mtu = IB_MTU_4096;
	attr->active_mtu = IB_MTU_4096;
	attr->gid_tbl_len = 1;
	attr->pkey_tbl_len = 1;
	attr->max_msg_sz = 1u << 31;
	attr->max_vl_num = 1;
	attr->subnet_timeout = 18;
	/* A PEX8749 link is PCIe Gen3 x8, about 64 Gb/s: reported as 4X FDR (56 Gb/s). */
	attr->active_width = IB_WIDTH_4X;
	attr->active_speed = IB_SPEED_FDR;
	return 0;
}

static int pcientb_get_port_immutable(struct ib_device *ibdev, u32 port,
				      struct ib_port_immutable *immutable)
{
	/* No MADs, no IB CM: connections are made by the provider (and its rdma_cm glue). */
	immutable->pkey_tbl_len = 1;
	immutable->gid_tbl_len = 1;
	immutable->core_cap_flags = 0;
	immutable->max_mad_size = 0;
	return 0;
}

static int pcientb_query_gid(struct ib_device *ibdev, u32 port, int index, union ib_gid *gid)
{
	if (index != 0)
		return -EINVAL;
	gid->global.subnet_prefix = cpu_to_be64(0xfe80000000000000ULL);
	gid->global.interface_id = ibdev->node_guid;
	return 0;
}

static int pcientb_query_pkey(struct ib_device *ibdev, u32 port, u16 index, u16 *pkey)
{
	if (index != 0)
		return -EINVAL;
	*pkey = 0xffff;
	return 0;
}

static int pcientb_alloc_ucontext(struct ib_ucontext *ibuc, struct ib_udata *udata)
{
	struct pcientb_ucontext *uc = container_of(ibuc, struct pcientb_ucontext, ibuc);
	struct pcientb_ib *dev = to_dev(ibuc->device);
	/*
	 * The two ports of a bridge have different numbers, so their halves differ. A PEX8749
	 * pair agrees on them once its link is up (ntb_plx.c); before, no LID can be given.
	 */
	int port = ntb_port_number(dev->ntb), peer = ntb_peer_port_number(dev->ntb, 0);
	u32 base = (port & 1) * PCIENTB_LIDS_PER_PORT;
	struct pcientb_ucontext_resp resp = {
		.magic = PCIENTB_UCONTEXT_MAGIC,
		.abi_version = PCIENTB_UVERBS_ABI_VERSION,
		.port = port,
		.peer_port = peer,
		.nonce = get_random_u64(),
		.table_entries = PCIENTB_LIDS,
		.area_size = pcientb_area_size(),
		.chunk_bytes = PCIENTB_CHUNK_BYTES,
	};
	int lid, rc;

	struct pcientb_ucontext_req req = {};

	/* A provider of another ABI asks for less: it is refused, not half answered. */
	if (udata->outlen < sizeof(resp))
		return -EINVAL;
	if (udata->inlen) {
		rc = ib_copy_from_udata(&req, udata, min(udata->inlen, sizeof(req)));
		if (rc)
			return rc;
		if (req.flags & ~PCIENTB_UCONTEXT_NO_NODE)
			return -EINVAL;
	}
	if (req.flags & PCIENTB_UCONTEXT_NO_NODE)
		return ib_copy_to_udata(udata, &resp, sizeof(resp)); /* LID 0: no node */
	if (port < 0 || peer < 0)
		return -EAGAIN;
	lid = ida_alloc_range(&dev->lids, base + 1, base + PCIENTB_LIDS_PER_PORT - 1, GFP_KERNEL);
	if (lid < 0)
		return lid == -ENOSPC ? -EUSERS : lid;
	uc->lid = lid;
	resp.lid = lid;
	rc = pcientb_node_add(dev, uc, resp.nonce, req.layout);
	if (rc)
		goto free_lid;
	rc = ib_copy_to_udata(udata, &resp, sizeof(resp));
	if (rc)
		goto remove;
	return 0;

remove:
	pcientb_node_remove(dev, uc);
free_lid:
	ida_free(&dev->lids, lid);
	return rc;
}

static void pcientb_dealloc_ucontext(struct ib_ucontext *ibuc)
{
	struct pcientb_ucontext *uc = container_of(ibuc, struct pcientb_ucontext, ibuc);

	if (!uc->node) /* a context without a node */
		return;
	pcientb_node_remove(to_dev(ibuc->device), uc);
	ida_free(&to_dev(ibuc->device)->lids, uc->lid);
}

/*
 * Set so that a port removed under open contexts (unbind, surprise removal, rmmod) does
 * not wait for their processes to exit: uverbs frees their objects through the ops
 * above and sends each IB_EVENT_DEVICE_FATAL. What a context maps of this host is memory
 * (areas, the node table): the mappings hold their pages, so nothing needs revoking here
 * (the node table stops changing; its entries read as they were). Its mappings of remote
 * areas, window pages, uverbs empties itself (rdma_user_mmap_io), after the bridge's
 * removal of the remote nodes has emptied them already.
 */
static void pcientb_disassociate_ucontext(struct ib_ucontext *ibuc)
{
}

static int pcientb_alloc_pd(struct ib_pd *ibpd, struct ib_udata *udata)
{
	struct pcientb_ib *dev = to_dev(ibpd->device);

	if (atomic_inc_return(&dev->pds) > PCIENTB_MAX_PD) {
		atomic_dec(&dev->pds);
		return -ENOMEM;
	}
	return 0;
}

static int pcientb_dealloc_pd(struct ib_pd *ibpd, struct ib_udata *udata)
{
	atomic_dec(&to_dev(ibpd->device)->pds);
	return 0;
}

/* The driver methods (uverbs ioctls on the device object). */
static const struct uapi_definition pcientb_defs[] = {
	UAPI_DEF_CHAIN(pcientb_mem_defs),
	UAPI_DEF_CHAIN(pcientb_node_defs),
	UAPI_DEF_CHAIN(pcientb_bridge_defs),
	{},
};

static const struct ib_device_ops pcientb_ib_ops = {
	.owner = THIS_MODULE,
	.driver_id = PCIENTB_DRIVER_ID,
	.uverbs_abi_ver = PCIENTB_UVERBS_ABI_VERSION,

	.alloc_pd = pcientb_alloc_pd,
	.alloc_ucontext = pcientb_alloc_ucontext,
	.dealloc_pd = pcientb_dealloc_pd,
	.dealloc_ucontext = pcientb_dealloc_ucontext,
	.dereg_mr = pcientb_dereg_mr,
	.disassociate_ucontext = pcientb_disassociate_ucontext,
	.get_port_immutable = pcientb_get_port_immutable,
	.mmap = pcientb_mmap,
	.query_device = pcientb_query_device,
	.query_gid = pcientb_query_gid,
	.query_pkey = pcientb_query_pkey,
	.query_port = pcientb_query_port,
	.reg_user_mr = pcientb_reg_user_mr,

	INIT_RDMA_OBJ_SIZE(ib_pd, pcientb_pd, ibpd),
	INIT_RDMA_OBJ_SIZE(ib_ucontext, pcientb_ucontext, ibuc),
};

/*
 * The function's device serial number (an EUI-64: a PEX switch has one, shared by its NT
 * functions) with the function and NTB port numbers in its low bits: unique across hosts.
 * Without one: PLX's OUI (00:10:b5), then the PCI domain, bus, function and port: unique in
 * this host.
 */
static __be64 node_guid(struct ntb_dev *ntb)
{
	struct pci_dev *pdev = ntb->pdev;
	int number = ntb_port_number(ntb);
	u64 port = number < 0 ? 0 : number & 0xff; /* a PEX pair's is not known yet */
	u64 dsn = pci_get_dsn(pdev);

	if (dsn)
		return cpu_to_be64(dsn ^ ((u64)pdev->devfn << 8 | port));
	return cpu_to_be64(0x0010b5ULL << 40 | (u64)(pci_domain_nr(pdev->bus) & 0xffff) << 24 |
			   (u64)pdev->bus->number << 16 | (u64)pdev->devfn << 8 | port);
}

struct pcientb_ib *pcientb_ib_add(struct ntb_dev *ntb)
{
	struct pcientb_ib *dev;
	int rc;

	dev = ib_alloc_device(pcientb_ib, ibdev);
	if (!dev)
		return ERR_PTR(-ENOMEM);
	dev->ntb = ntb;
	ida_init(&dev->lids);
	rc = pcientb_mem_init(dev);
	if (rc)
		goto lids;
	rc = pcientb_nodes_init(dev);
	if (rc)
		goto mem;
	rc = pcientb_bridge_init(dev);
	if (rc)
		goto nodes;
	dev->ibdev.node_type = RDMA_NODE_IB_CA;
	dev->ibdev.phys_port_cnt = 1;
	dev->ibdev.num_comp_vectors = 1;
	dev->ibdev.node_guid = node_guid(ntb);
	dev->ibdev.dev.parent = &ntb->pdev->dev;
	dev->ibdev.driver_def = pcientb_defs;
	strscpy(dev->ibdev.node_desc, "pcientb", sizeof(dev->ibdev.node_desc));
	dev->active = port_active(dev);
	ib_set_device_ops(&dev->ibdev, &pcientb_ib_ops);
	/* Regions are mapped for the NT function: the peer's accesses come with its ID. */
	rc = ib_register_device(&dev->ibdev, "pcientb%d", &ntb->pdev->dev);
	if (rc)
		goto bridge;
	dev_info(&ntb->dev, "verbs device %s\n", dev_name(&dev->ibdev.dev));
	pcientb_bridge_kick(dev, false); /* the link may be up already */
	return dev;

bridge:
	pcientb_bridge_destroy(dev);
nodes:
	pcientb_nodes_destroy(dev);
mem:
	pcientb_mem_destroy(dev);
lids:
	ida_destroy(&dev->lids);
	ib_dealloc_device(&dev->ibdev);
	return ERR_PTR(rc);
}

/*
 * Called with the NTB's ctx_lock held (any context): the port follows the link. An NTB link
 * event carries no state: a driver that reports a bounce only once it is over (the link
 * reads up at both events) is not heard here; ntb_plx.c answers link_is_up with what it
 * reported. A peer that restarted is for the node table's nonces to find (docs/kernel.md).
 */
void pcientb_ib_link_event(struct pcientb_ib *dev)
{
	struct ib_event event = {
		.device = &dev->ibdev,
		.element.port_num = 1,
	};
	bool up = port_active(dev);

	pcientb_bridge_kick(dev, true);
	if (up == dev->active)
		return;
	dev->active = up;
	event.event = up ? IB_EVENT_PORT_ACTIVE : IB_EVENT_PORT_ERR;
	ib_dispatch_event(&event);
}

/*
 * After the NTB context is cleared: no link event reaches the device any more, and
 * unregistering flushes those already dispatched (ib_cache_cleanup_one).
 */
void pcientb_ib_remove(struct pcientb_ib *dev)
{
	ib_unregister_device(&dev->ibdev);
	pcientb_bridge_destroy(dev);
	pcientb_nodes_destroy(dev);
	pcientb_mem_destroy(dev);
	ida_destroy(&dev->lids);
	ib_dealloc_device(&dev->ibdev);
}
