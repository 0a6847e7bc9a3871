// SPDX-License-Identifier: GPL-2.0
/*
 * pcientb.ko: memory regions, and the moves into and out of them.
 *
 * A registration pins the process's pages (ib_umem_get: counted in the process's pinned
 * memory, against RLIMIT_MEMLOCK) and maps them for DMA by the NT function, whose
 * requester ID the peer's reads and writes carry when they come through the bridge. Its
 * lkey and rkey are index << 8 | a key byte: the index names the region in the device's
 * table, and the key byte is the index's generation, advanced by each registration there,
 * so that a key kept after ibv_dereg_mr names no region for the next 255 registrations of
 * that index (indexes are also handed out cyclically: 65535 before one comes back). The
 * access rights are the emulated device's: the four of IB and relaxed ordering (the other
 * optional bits and huge-page advice are hints, ignored); memory windows and zero-based
 * regions are refused (on-demand ones uverbs refuses).
 *
 * PCIENTB_METHOD_MOVE (uapi/pcientb-abi.h) moves bytes between a caller's memory and a
 * region of a node of this host, checked here (the region is that node's, bounds,
 * rights): the fabric's one-sided write and read between the nodes of one host, a CPU
 * copy; or of a node across the bridge (pcientb_bridge.c, which the region table there
 * tells where a region's pages are). A move holds a reference on the region; deregistration waits
 * for the moves under way, so none reaches the pages after ibv_dereg_mr returned.
 */
#include <linux/highmem.h>
#include <linux/rcupdate.h>
#include <linux/refcount.h>
#include <linux/sched/signal.h>
#include <linux/slab.h>
#include <linux/uaccess.h>
#include <rdma/ib_umem.h>

#define UVERBS_MODULE_NAME pcientb
#include <rdma/uverbs_named_ioctl.h>

#include "pcientb_ib.h"
#include "pcientb-abi.h"

#define PCIENTB_MR_ACCESS                                                                          \
	(IB_ACCESS_LOCAL_WRITE | IB_ACCESS_REMOTE_WRITE | IB_ACCESS_REMOTE_READ |                  \
	 IB_ACCESS_REMOTE_ATOMIC | IB_ACCESS_OPTIONAL | IB_ACCESS_HUGETLB)

struct pcientb_mr {
	struct ib_mr ibmr;
	struct ib_umem *umem;
	u32 lid; /* its context's: the node whose window it is */
	int access;
	u64 *pages; /* the physical address of each page: what the peer host's moves read */
	refcount_t refs; /* the table's, and one per move under way */
	struct completion unused; /* the last reference went */
	struct rcu_head rcu;
};

static void mr_put(struct pcientb_mr *mr)
{
	if (refcount_dec_and_test(&mr->refs))
		complete(&mr->unused);
}

/*
 * The peer host's nodes reach the region through the bridge: the list of its pages'
 * addresses goes into the bridge's region table. A region whose list the allocator cannot
 * give in one piece (over 2 GiB) stays out of the peer's reach (its moves get ENOENT).
 */
static void export(struct pcientb_ib *dev, struct pcientb_mr *mr)
{
	size_t n = ib_umem_num_pages(mr->umem), i = 0;
	struct sg_page_iter it;

	if (!dev->bridge)
		return;
	mr->pages = kmalloc_array(n, sizeof(*mr->pages), GFP_KERNEL | __GFP_NOWARN);
	if (!mr->pages)
		return;
	for_each_sgtable_page(&mr->umem->sgt_append.sgt, &it, 0)
	{
		if (i == n)
			break;
		mr->pages[i++] = page_to_phys(sg_page_iter_page(&it));
	}
	pcientb_bridge_export(dev, mr->ibmr.lkey >> 8, mr->ibmr.lkey, mr->lid, mr->access,
			      mr->ibmr.iova, mr->ibmr.length, ib_umem_offset(mr->umem), mr->pages);
}

struct ib_mr *pcientb_reg_user_mr(struct ib_pd *ibpd, u64 start, u64 length, u64 iova, int access,
				  struct ib_udata *udata)
{
	struct pcientb_ib *dev = to_dev(ibpd->device);
	struct pcientb_mr *mr;
	u32 index, key;
	int rc;

	/* uverbs checked that remote write and atomic come with local write. */
	if (udata->inlen || udata->outlen)
		return ERR_PTR(-EINVAL);
	if (access & ~PCIENTB_MR_ACCESS)
		return ERR_PTR(-EOPNOTSUPP);
	if (!length || length > PCIENTB_MAX_MR_SIZE)
		return ERR_PTR(-EINVAL);
	mr = kzalloc(sizeof(*mr), GFP_KERNEL);
	if (!mr)
		return ERR_PTR(-ENOMEM);
	/* uverbs' PDs are user objects: the region is the node's that owns the PD. */
	mr->lid = container_of(ibpd->uobject->context, struct pcientb_ucontext, ibuc)->lid;
	mr->access = access;
	refcount_set(&mr->refs, 1);
	init_completion(&mr->unused);
	mr->umem = ib_umem_get(ibpd->device, start, length, access);
	if (IS_ERR(mr->umem)) {
		rc = PTR_ERR(mr->umem);
		goto free;
	}
	/* The slot is reserved (NULL), keyed, then filled: no move finds a region unkeyed. */
	rc = xa_alloc_cyclic(&dev->mrs, &index, NULL, XA_LIMIT(1, PCIENTB_MAX_MR - 1),
			     &dev->next_mr, GFP_KERNEL);
	if (rc < 0) {
		rc = rc == -EBUSY ? -ENOMEM : rc; /* max_mr regions exist */
		goto release;
	}
	key = ++dev->mr_gens[index]; /* the index is ours alone until stored */
	mr->ibmr.lkey = index << 8 | key;
	mr->ibmr.rkey = mr->ibmr.lkey;
	/* uverbs sets ibmr.iova and .length once this returns: a move checks its own copy. */
	mr->ibmr.iova = iova;
	mr->ibmr.length = length;
	xa_store(&dev->mrs, index, mr, GFP_KERNEL); /* into the reserved slot: cannot fail */
	export(dev, mr);
	return &mr->ibmr;

release:
	ib_umem_release(mr->umem);
free:
	kfree(mr);
	return ERR_PTR(rc);
}

int pcientb_dereg_mr(struct ib_mr *ibmr, struct ib_udata *udata)
{
	struct pcientb_mr *mr = container_of(ibmr, struct pcientb_mr, ibmr);

	if (mr->pages)
		pcientb_bridge_unexport(to_dev(ibmr->device), ibmr->lkey >> 8, ibmr->lkey);
	xa_erase(&to_dev(ibmr->device)->mrs, ibmr->lkey >> 8);
	mr_put(mr);
	wait_for_completion(&mr->unused); /* the moves under way */
	ib_umem_release(mr->umem);
	kfree(mr->pages);
	kfree_rcu(mr, rcu); /* a lookup may still be looking at it */
	return 0;
}

/* The region `key` of node `lid`, referenced; NULL if there is none. */
static struct pcientb_mr *mr_get(struct pcientb_ib *dev, u32 lid, u32 key)
{
	struct pcientb_mr *mr;

	rcu_read_lock();
	mr = xa_load(&dev->mrs, key >> 8);
	if (mr && (mr->ibmr.lkey != key || mr->lid != lid || !refcount_inc_not_zero(&mr->refs)))
		mr = NULL;
	rcu_read_unlock();
	return mr;
}

/* Copies `len` bytes between the caller's `uaddr` and the region's pages from byte `off`. */
static int mr_copy(struct pcientb_mr *mr, u64 off, u64 uaddr, u64 len, bool to_mr)
{
	struct sg_page_iter it;

	for_each_sgtable_page(&mr->umem->sgt_append.sgt, &it, off >> PAGE_SHIFT)
	{
		size_t in_page = off & ~PAGE_MASK, n = min_t(u64, len, PAGE_SIZE - in_page);
		void __user *user = u64_to_user_ptr(uaddr);
		u8 *va = kmap_local_page(sg_page_iter_page(&it));
		unsigned long left = to_mr ? copy_from_user(va + in_page, user, n) :
					     copy_to_user(user, va + in_page, n);

		kunmap_local(va);
		if (left)
			return -EFAULT;
		off += n;
		uaddr += n;
		len -= n;
		if (!len)
			return 0;
		if (fatal_signal_pending(current))
			return -EINTR;
		cond_resched();
	}
	return -EFAULT; /* not reached: the bounds were checked */
}

static int UVERBS_HANDLER(PCIENTB_METHOD_MOVE)(struct uverbs_attr_bundle *attrs)
{
	struct ib_ucontext *ibuc = ib_uverbs_get_ucontext(attrs);
	struct pcientb_node *node;
	struct pcientb_move cmd;
	struct pcientb_mr *mr;
	bool to_mr;
	int rc;

	if (IS_ERR(ibuc))
		return PTR_ERR(ibuc);
	rc = uverbs_copy_from(&cmd, attrs, PCIENTB_ATTR_MOVE_CMD);
	if (rc)
		return rc;
	if (cmd.reserved || cmd.dir > PCIENTB_MOVE_READ || !cmd.length)
		return -EINVAL;
	to_mr = cmd.dir == PCIENTB_MOVE_WRITE;
	node = pcientb_node_get(to_dev(ibuc->device), cmd.lid);
	if (node && !node->area) { /* a node across the bridge */
		rc = pcientb_bridge_move(to_dev(ibuc->device), node, &cmd);
		pcientb_node_put(node);
		return rc;
	}
	if (node)
		pcientb_node_put(node);
	mr = mr_get(to_dev(ibuc->device), cmd.lid, cmd.window);
	if (!mr)
		return -ENOENT;
	if (cmd.raddr < mr->ibmr.iova || cmd.length > mr->ibmr.length ||
	    cmd.raddr - mr->ibmr.iova > mr->ibmr.length - cmd.length)
		rc = -ERANGE;
	else if (!(mr->access & (to_mr ? IB_ACCESS_REMOTE_WRITE : IB_ACCESS_REMOTE_READ)))
		rc = -EACCES;
	else
		rc = mr_copy(mr, cmd.raddr - mr->ibmr.iova + ib_umem_offset(mr->umem), cmd.addr,
			     cmd.length, to_mr);
	mr_put(mr);
	return rc;
}

DECLARE_UVERBS_NAMED_METHOD(PCIENTB_METHOD_MOVE,
			    UVERBS_ATTR_PTR_IN(PCIENTB_ATTR_MOVE_CMD,
					       UVERBS_ATTR_TYPE(struct pcientb_move),
					       UA_MANDATORY));

ADD_UVERBS_METHODS(pcientb_device_methods, UVERBS_OBJECT_DEVICE,
		   &UVERBS_METHOD(PCIENTB_METHOD_MOVE));

const struct uapi_definition pcientb_mem_defs[] = {
	UAPI_DEF_CHAIN_OBJ_TREE(UVERBS_OBJECT_DEVICE, &pcientb_device_methods),
	{},
};

int pcientb_mem_init(struct pcientb_ib *dev)
{
	xa_init_flags(&dev->mrs, XA_FLAGS_ALLOC1);
	dev->mr_gens = kvcalloc(PCIENTB_MAX_MR, sizeof(*dev->mr_gens), GFP_KERNEL);
	return dev->mr_gens ? 0 : -ENOMEM;
}

/* After unregistering: uverbs deregistered every region of every context. */
void pcientb_mem_destroy(struct pcientb_ib *dev)
{
	WARN_ON(!xa_empty(&dev->mrs));
	xa_destroy(&dev->mrs);
	kvfree(dev->mr_gens);
}
