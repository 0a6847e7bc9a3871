// SPDX-License-Identifier: GPL-2.0
/*
 * pcientb.ko: memory regions.
 *
 * A registration pins the process's pages (ib_umem_get: counted in the process's pinned
 * memory, against RLIMIT_MEMLOCK) and maps them for DMA by the NT function, whose
 * requester ID the peer's reads and writes carry when they come through the bridge. Its
 * lkey and rkey are index << 8 | a key byte: the index names the region in the device's
 * table (where the data path will check keys, bounds and rights before a move), and the
 * key byte advances with each registration, so that a key kept after ibv_dereg_mr does not
 * name whatever is registered at that index next (indexes are also handed out cyclically).
 * The access rights are the emulated device's: the four of IB and relaxed ordering
 * (the other optional bits are hints, ignored); memory windows, zero-based and on-demand
 * regions are refused.
 */
#include <linux/slab.h>
#include <rdma/ib_umem.h>

#include "pcientb_ib.h"

#define PCIENTB_MR_ACCESS                                                                          \
	(IB_ACCESS_LOCAL_WRITE | IB_ACCESS_REMOTE_WRITE | IB_ACCESS_REMOTE_READ |                  \
	 IB_ACCESS_REMOTE_ATOMIC | IB_ACCESS_OPTIONAL)

struct pcientb_mr {
	struct ib_mr ibmr;
	struct ib_umem *umem;
};

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
	mr->umem = ib_umem_get(ibpd->device, start, length, access);
	if (IS_ERR(mr->umem)) {
		rc = PTR_ERR(mr->umem);
		goto free;
	}
	rc = xa_alloc_cyclic(&dev->mrs, &index, mr, XA_LIMIT(1, PCIENTB_MAX_MR - 1), &dev->next_mr,
			     GFP_KERNEL);
	if (rc < 0) {
		rc = rc == -EBUSY ? -ENOMEM : rc; /* max_mr regions exist */
		goto release;
	}
	key = (u8)atomic_inc_return(&dev->mr_key);
	mr->ibmr.lkey = index << 8 | key;
	mr->ibmr.rkey = mr->ibmr.lkey;
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

	xa_erase(&to_dev(ibmr->device)->mrs, ibmr->lkey >> 8);
	ib_umem_release(mr->umem);
	kfree(mr);
	return 0;
}

void pcientb_mem_init(struct pcientb_ib *dev)
{
	xa_init_flags(&dev->mrs, XA_FLAGS_ALLOC1);
	atomic_set(&dev->mr_key, 0);
}

/* After unregistering: uverbs deregistered every region of every context. */
void pcientb_mem_destroy(struct pcientb_ib *dev)
{
	WARN_ON(!xa_empty(&dev->mrs));
	xa_destroy(&dev->mrs);
}
