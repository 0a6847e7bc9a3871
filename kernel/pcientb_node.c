// SPDX-License-Identifier: GPL-2.0
/*
 * pcientb.ko: the nodes of this host. Each context is a node (pcientb_ib.c gives it its
 * LID): it has an area, shared memory where the engine keeps what its peers post to it,
 * which the node and its peers on this host map through their uverbs fds (a shmem file:
 * sparse, and it outlives the node while a peer still maps it); an entry in the node
 * table that every context maps read-only (alive, nonce: what a peer looks at around each
 * transfer, with no system call); a doorbell (an eventfd the node gives, which
 * PCIENTB_METHOD_RING counts); and watchers (PCIENTB_METHOD_WATCH: files that poll
 * readable once the node is gone). Across the bridge the same services will come from the
 * peer host's module (docs/kernel.md); these serve the nodes of one host.
 */
#include <linux/anon_inodes.h>
#include <linux/eventfd.h>
#include <linux/file.h>
#include <linux/fs.h>
#include <linux/mm.h>
#include <linux/poll.h>
#include <linux/shmem_fs.h>
#include <linux/slab.h>
#include <linux/vmalloc.h>

#define UVERBS_MODULE_NAME pcientb
#include <rdma/uverbs_named_ioctl.h>

#include "pcientb_ib.h"
#include "pcientb-abi.h"

struct pcientb_node {
	struct kref ref;
	u32 lid;
	u64 nonce;
	struct file *area; /* shmem, PCIENTB_AREA_SIZE */
	bool dead;
	wait_queue_head_t watchers;
	spinlock_t lock; /* doorbell */
	struct eventfd_ctx *doorbell;
	struct rcu_head rcu;
};

static void node_release(struct kref *ref)
{
	struct pcientb_node *node = container_of(ref, struct pcientb_node, ref);

	fput(node->area);
	kfree_rcu(node, rcu);
}

static void node_put(struct pcientb_node *node)
{
	kref_put(&node->ref, node_release);
}

/* Node `lid` of this device, referenced; NULL if none lives. */
static struct pcientb_node *node_get(struct pcientb_ib *dev, u32 lid)
{
	struct pcientb_node *node;

	rcu_read_lock();
	node = xa_load(&dev->nodes, lid);
	if (node && !kref_get_unless_zero(&node->ref))
		node = NULL;
	rcu_read_unlock();
	return node;
}

static struct pcientb_node_entry *table_entry(struct pcientb_ib *dev, u32 lid)
{
	return &((struct pcientb_node_entry *)dev->table)[lid];
}

int pcientb_node_add(struct pcientb_ib *dev, struct pcientb_ucontext *uc, u64 nonce)
{
	struct pcientb_node_entry *e = table_entry(dev, uc->lid);
	struct pcientb_node *node = kzalloc(sizeof(*node), GFP_KERNEL);
	int rc;

	if (!node)
		return -ENOMEM;
	kref_init(&node->ref);
	node->lid = uc->lid;
	node->nonce = nonce;
	init_waitqueue_head(&node->watchers);
	spin_lock_init(&node->lock);
	/* VM_NORESERVE: sparse, as the emulated fabric's areas (pages cost once written). */
	node->area = shmem_file_setup("pcientb-area", PCIENTB_AREA_SIZE, VM_NORESERVE);
	if (IS_ERR(node->area)) {
		rc = PTR_ERR(node->area);
		kfree(node);
		return rc;
	}
	rc = xa_err(xa_store(&dev->nodes, uc->lid, node, GFP_KERNEL));
	if (rc) {
		node_put(node);
		return rc;
	}
	/* The nonce, then the life that makes the entry valid. */
	WRITE_ONCE(e->nonce, nonce);
	smp_wmb();
	WRITE_ONCE(e->life, (u32)nonce | 1);
	uc->node = node;
	return 0;
}

void pcientb_node_remove(struct pcientb_ib *dev, struct pcientb_ucontext *uc)
{
	struct pcientb_node *node = uc->node;
	struct eventfd_ctx *db;

	WRITE_ONCE(table_entry(dev, uc->lid)->life, 0);
	xa_erase(&dev->nodes, uc->lid);
	WRITE_ONCE(node->dead, true);
	wake_up_all(&node->watchers);
	spin_lock(&node->lock);
	db = node->doorbell;
	node->doorbell = NULL;
	spin_unlock(&node->lock);
	if (db)
		eventfd_ctx_put(db);
	node_put(node);
}

/* The uverbs fd's mmap: the context's area, the node table, or a node's area by LID. */
int pcientb_mmap(struct ib_ucontext *ibuc, struct vm_area_struct *vma)
{
	struct pcientb_ucontext *uc = container_of(ibuc, struct pcientb_ucontext, ibuc);
	struct pcientb_ib *dev = to_dev(ibuc->device);
	unsigned long off = vma->vm_pgoff, len = vma->vm_end - vma->vm_start;
	struct pcientb_node *node;
	int rc;

	if (off == PCIENTB_MMAP_TABLE) {
		if (vma->vm_flags & VM_WRITE)
			return -EPERM;
		vma->vm_flags &= ~VM_MAYWRITE;
		return remap_vmalloc_range(vma, dev->table, 0);
	}
	if (off == PCIENTB_MMAP_AREA) {
		node = uc->node;
		if (!node)
			return -EINVAL;
		kref_get(&node->ref);
	} else if (off >= PCIENTB_MMAP_PEER(0) && off < PCIENTB_MMAP_PEER(PCIENTB_LIDS)) {
		node = node_get(dev, off - PCIENTB_MMAP_PEER(0));
		if (!node)
			return -ENOENT;
	} else {
		return -EINVAL;
	}
	rc = -EINVAL;
	if (len <= PCIENTB_AREA_SIZE && (vma->vm_flags & VM_SHARED)) {
		/* The mapping is the area's shmem file's from now on (as DRM's shmem objects). */
		vma->vm_pgoff = 0;
		vma_set_file(vma, node->area);
		rc = call_mmap(vma->vm_file, vma);
	}
	node_put(node);
	return rc;
}

static int UVERBS_HANDLER(PCIENTB_METHOD_RING)(struct uverbs_attr_bundle *attrs)
{
	struct ib_ucontext *ibuc = ib_uverbs_get_ucontext(attrs);
	struct pcientb_ring cmd;
	struct pcientb_node *node;
	int rc;

	if (IS_ERR(ibuc))
		return PTR_ERR(ibuc);
	rc = uverbs_copy_from(&cmd, attrs, PCIENTB_ATTR_RING_CMD);
	if (rc)
		return rc;
	if (cmd.reserved || cmd.lid >= PCIENTB_LIDS)
		return -EINVAL;
	node = node_get(to_dev(ibuc->device), cmd.lid);
	if (!node)
		return -ENOENT;
	spin_lock(&node->lock);
	if (node->doorbell)
		eventfd_signal(node->doorbell, 1);
	spin_unlock(&node->lock);
	node_put(node);
	return 0;
}

static int UVERBS_HANDLER(PCIENTB_METHOD_DOORBELL)(struct uverbs_attr_bundle *attrs)
{
	struct ib_ucontext *ibuc = ib_uverbs_get_ucontext(attrs);
	struct eventfd_ctx *db = NULL, *old;
	struct pcientb_doorbell cmd;
	struct pcientb_node *node;
	int rc;

	if (IS_ERR(ibuc))
		return PTR_ERR(ibuc);
	rc = uverbs_copy_from(&cmd, attrs, PCIENTB_ATTR_DOORBELL_CMD);
	if (rc)
		return rc;
	if (cmd.reserved || cmd.fd < -1)
		return -EINVAL;
	if (cmd.fd >= 0) {
		db = eventfd_ctx_fdget(cmd.fd);
		if (IS_ERR(db))
			return PTR_ERR(db);
	}
	node = container_of(ibuc, struct pcientb_ucontext, ibuc)->node;
	if (!node) {
		if (db)
			eventfd_ctx_put(db);
		return -EINVAL;
	}
	spin_lock(&node->lock);
	old = node->doorbell;
	node->doorbell = db;
	spin_unlock(&node->lock);
	if (old)
		eventfd_ctx_put(old);
	return 0;
}

/* A watcher: its file holds the node (NULL: it was gone already). */
static __poll_t watch_poll(struct file *file, poll_table *wait)
{
	struct pcientb_node *node = file->private_data;

	if (!node)
		return EPOLLIN | EPOLLRDNORM;
	poll_wait(file, &node->watchers, wait);
	return READ_ONCE(node->dead) ? EPOLLIN | EPOLLRDNORM : 0;
}

static int watch_release(struct inode *inode, struct file *file)
{
	if (file->private_data)
		node_put(file->private_data);
	return 0;
}

static const struct file_operations watch_fops = {
	.owner = THIS_MODULE,
	.poll = watch_poll,
	.release = watch_release,
	.llseek = noop_llseek,
};

static int UVERBS_HANDLER(PCIENTB_METHOD_WATCH)(struct uverbs_attr_bundle *attrs)
{
	struct ib_ucontext *ibuc = ib_uverbs_get_ucontext(attrs);
	struct pcientb_watch_resp resp = {};
	struct pcientb_watch cmd;
	struct pcientb_node *node;
	struct file *file;
	int rc, fd;

	if (IS_ERR(ibuc))
		return PTR_ERR(ibuc);
	rc = uverbs_copy_from(&cmd, attrs, PCIENTB_ATTR_WATCH_CMD);
	if (rc)
		return rc;
	if (cmd.reserved || cmd.lid >= PCIENTB_LIDS)
		return -EINVAL;
	node = node_get(to_dev(ibuc->device), cmd.lid);
	if (node && node->nonce != cmd.nonce) { /* another incarnation: the one asked for is gone */
		node_put(node);
		node = NULL;
	}
	fd = get_unused_fd_flags(O_CLOEXEC);
	if (fd < 0) {
		rc = fd;
		goto put;
	}
	file = anon_inode_getfile("[pcientb-watch]", &watch_fops, node, O_RDONLY | O_CLOEXEC);
	if (IS_ERR(file)) {
		rc = PTR_ERR(file);
		goto put_fd;
	}
	resp.fd = fd;
	rc = uverbs_copy_to(attrs, PCIENTB_ATTR_WATCH_RESP, &resp, sizeof(resp));
	if (rc) {
		fput(file); /* releases the node */
		put_unused_fd(fd);
		return rc;
	}
	fd_install(fd, file);
	return 0;

put_fd:
	put_unused_fd(fd);
put:
	if (node)
		node_put(node);
	return rc;
}

DECLARE_UVERBS_NAMED_METHOD(PCIENTB_METHOD_RING,
			    UVERBS_ATTR_PTR_IN(PCIENTB_ATTR_RING_CMD,
					       UVERBS_ATTR_TYPE(struct pcientb_ring),
					       UA_MANDATORY));
DECLARE_UVERBS_NAMED_METHOD(PCIENTB_METHOD_DOORBELL,
			    UVERBS_ATTR_PTR_IN(PCIENTB_ATTR_DOORBELL_CMD,
					       UVERBS_ATTR_TYPE(struct pcientb_doorbell),
					       UA_MANDATORY));
DECLARE_UVERBS_NAMED_METHOD(PCIENTB_METHOD_WATCH,
			    UVERBS_ATTR_PTR_IN(PCIENTB_ATTR_WATCH_CMD,
					       UVERBS_ATTR_TYPE(struct pcientb_watch),
					       UA_MANDATORY),
			    UVERBS_ATTR_PTR_OUT(PCIENTB_ATTR_WATCH_RESP,
						UVERBS_ATTR_TYPE(struct pcientb_watch_resp),
						UA_MANDATORY));

ADD_UVERBS_METHODS(pcientb_node_methods, UVERBS_OBJECT_DEVICE, &UVERBS_METHOD(PCIENTB_METHOD_RING),
		   &UVERBS_METHOD(PCIENTB_METHOD_DOORBELL), &UVERBS_METHOD(PCIENTB_METHOD_WATCH));

const struct uapi_definition pcientb_node_defs[] = {
	UAPI_DEF_CHAIN_OBJ_TREE(UVERBS_OBJECT_DEVICE, &pcientb_node_methods),
	{},
};

int pcientb_nodes_init(struct pcientb_ib *dev)
{
	xa_init(&dev->nodes);
	dev->table = vmalloc_user(PCIENTB_LIDS * sizeof(struct pcientb_node_entry));
	return dev->table ? 0 : -ENOMEM;
}

/* After unregistering: every context is gone. */
void pcientb_nodes_destroy(struct pcientb_ib *dev)
{
	WARN_ON(!xa_empty(&dev->nodes));
	xa_destroy(&dev->nodes);
	vfree(dev->table);
}
