// SPDX-License-Identifier: GPL-2.0
/*
 * pcientb.ko: the nodes of this host. Each context is a node (pcientb_ib.c gives it its
 * LID): it has an area, memory where the engine keeps what its peers post to it, which the
 * node and its peers on this host map through their uverbs fds (chunks of physically
 * contiguous pages, so that a peer host can reach them through its window too; the area
 * outlives the node while a peer still maps it); an entry in the node table that every
 * context maps read-only (alive, nonce: what a peer looks at around each transfer, with no
 * system call); a doorbell (an eventfd the node gives, which PCIENTB_METHOD_RING counts);
 * and watchers (PCIENTB_METHOD_WATCH: files that poll readable once the node is gone).
 * A node of the host across the bridge is mapped too, chunk by chunk through the window
 * (PCIENTB_MMAP_REMOTE), and those mappings are emptied when it goes (remote_unmap).
 */
#include <linux/anon_inodes.h>
#include <linux/eventfd.h>
#include <linux/file.h>
#include <linux/fs.h>
#include <linux/mm.h>
#include <linux/path.h>
#include <linux/mmap_lock.h>
#include <linux/sched/mm.h>
#include <linux/poll.h>
#include <linux/module.h>
#include <linux/shmem_fs.h>
#include <linux/slab.h>
#include <linux/vmalloc.h>

#define UVERBS_MODULE_NAME pcientb
#include <rdma/uverbs_named_ioctl.h>

#include "pcientb.h"
#include "pcientb_ib.h"
#include "pcientb-abi.h"

static unsigned int area_mb = 16;
module_param(area_mb, uint, 0444);
MODULE_PARM_DESC(area_mb, "Size of each node's area in MiB (4..64; the engine's tables take ~4)");

/*
 * A node's area (pcientb_ib.h): zeroed, its chunks mapped one after the other. Its pages are split,
 * and mappings take references on them: the memory stays while a peer maps it, freed by the kernel
 * when the last mapping goes, with no code of this module (which may be gone by then: rmmod does
 * not wait for processes). A mapping's file is a placeholder that holds neither the context (a
 * process that maps a node must not keep it from dying) nor this module.
 */

static struct file *area_placeholder;

size_t pcientb_area_size(void)
{
	return round_up((size_t)clamp(area_mb, 4U, PCIENTB_AREA_MB_MAX), PCIENTB_CHUNK_BYTES >> 20)
	       << 20;
}

/* The area's last holder lets go: pages still mapped go with their last mapping. */
static void area_free(struct pcientb_area *area)
{
	unsigned int i;
	unsigned long j;

	for (i = 0; i < area->chunks; i++)
		for (j = 0; j < PCIENTB_CHUNK_PAGES; j++)
			put_page(nth_page(area->chunk[i], j));
	kvfree(area);
}

static struct pcientb_area *area_alloc(void)
{
	unsigned int n = pcientb_area_size() / PCIENTB_CHUNK_BYTES;
	struct pcientb_area *area = kvzalloc(struct_size(area, chunk, n), GFP_KERNEL);
	struct page *page;

	if (!area)
		return NULL;
	kref_init(&area->ref);
	for (; area->chunks < n; area->chunks++) {
		page = alloc_pages(GFP_KERNEL | __GFP_ZERO | __GFP_NOWARN | __GFP_RETRY_MAYFAIL,
				   PCIENTB_CHUNK_ORDER);
		if (!page) {
			area_free(area);
			return NULL;
		}
		split_page(page, PCIENTB_CHUNK_ORDER);
		area->chunk[area->chunks] = page;
	}
	return area;
}

static void area_release(struct kref *ref)
{
	area_free(container_of(ref, struct pcientb_area, ref));
}

void pcientb_area_put(struct pcientb_area *area)
{
	kref_put(&area->ref, area_release);
}

/* Maps the area at the start of `vma` (shared, at most its size). */
static int area_mmap(struct pcientb_area *area, struct vm_area_struct *vma)
{
	unsigned long len = vma->vm_end - vma->vm_start, off, n, j;
	struct page **pages;
	unsigned int i;
	int rc = 0;

	if (len > (unsigned long)area->chunks * PCIENTB_CHUNK_BYTES || !(vma->vm_flags & VM_SHARED))
		return -EINVAL;
	pages = kvmalloc_array(PCIENTB_CHUNK_PAGES, sizeof(*pages), GFP_KERNEL);
	if (!pages)
		return -ENOMEM;
	vma_set_file(vma, area_placeholder);
	vma->vm_flags |= VM_DONTEXPAND | VM_DONTDUMP;
	for (i = 0, off = 0; off < len && !rc; i++, off += PCIENTB_CHUNK_BYTES) {
		n = min_t(unsigned long, len - off, PCIENTB_CHUNK_BYTES) >> PAGE_SHIFT;
		for (j = 0; j < n; j++)
			pages[j] = nth_page(area->chunk[i], j);
		rc = vm_insert_pages(vma, vma->vm_start + off, pages, &n);
	}
	kvfree(pages);
	return rc; /* on failure the caller's munmap takes what was mapped */
}

/*
 * What remote_unmap needs to reach every mapping of a remote node: the processes that
 * mapped it (their mms: to wait for an mmap() under way) and the files they mapped it
 * through (the uverbs device node's: whose mappings of the node's range are emptied). An
 * exited process is forgotten; a file is kept while the node lives (a mapping may outlive
 * the process that made it in another, e.g. one it passed its fd to).
 */
struct pcientb_mapper {
	struct list_head list;
	struct mm_struct *mm; /* mmgrab()bed */
};

struct pcientb_mapped_file {
	struct list_head list;
	struct address_space *mapping;
	struct path path; /* holds the mapping's inode, and its mount */
};

static void mapper_free(struct pcientb_mapper *m)
{
	list_del(&m->list);
	mmdrop(m->mm);
	kfree(m);
}

static void mapped_file_free(struct pcientb_mapped_file *f)
{
	list_del(&f->list);
	path_put(&f->path);
	kfree(f);
}

/* Notes who maps `node`, and through which file (under map_mu). */
static int mapper_note(struct pcientb_node *node, struct vm_area_struct *vma)
{
	struct pcientb_mapper *m, *next, *mine = NULL;
	struct pcientb_mapped_file *f;

	list_for_each_entry_safe(m, next, &node->mappers, list) {
		if (m->mm == vma->vm_mm)
			mine = m;
		else if (!atomic_read(&m->mm->mm_users))
			mapper_free(m); /* exited: nothing of it maps the node any more */
	}
	if (!mine) {
		mine = kmalloc(sizeof(*mine), GFP_KERNEL);
		if (!mine)
			return -ENOMEM;
		mine->mm = vma->vm_mm;
		mmgrab(mine->mm);
		list_add(&mine->list, &node->mappers);
	}
	list_for_each_entry(f, &node->mapped_files, list)
		if (f->mapping == vma->vm_file->f_mapping)
			return 0;
	f = kmalloc(sizeof(*f), GFP_KERNEL);
	if (!f)
		return -ENOMEM;
	f->mapping = vma->vm_file->f_mapping;
	f->path = vma->vm_file->f_path;
	path_get(&f->path);
	list_add(&f->list, &node->mapped_files);
	return 0;
}

/*
 * Maps chunk `chunk` of remote `node`'s area, write-combined through the window. uverbs
 * keeps the mapping (rdma_user_mmap_io): once emptied (remote_unmap, or the device's
 * removal), a store faults in a page of the caller's file instead (zeroed when first
 * given; shared by all such mappings of that file). A forked child does not inherit it.
 */
static int remote_mmap(struct ib_ucontext *ibuc, struct pcientb_node *node, unsigned int chunk,
		       struct vm_area_struct *vma)
{
	int rc;

	if (chunk >= node->chunks || vma->vm_end - vma->vm_start != PCIENTB_CHUNK_BYTES ||
	    !(vma->vm_flags & VM_SHARED))
		return -EINVAL;
	mutex_lock(&node->map_mu);
	rc = READ_ONCE(node->dead) ? -ENOENT : mapper_note(node, vma);
	if (!rc) {
		vma->vm_flags |= VM_DONTCOPY;
		rc = rdma_user_mmap_io(ibuc, vma, PHYS_PFN(node->window + node->chunk_off[chunk]),
				       PCIENTB_CHUNK_BYTES, pgprot_writecombine(vma->vm_page_prot),
				       NULL);
	}
	mutex_unlock(&node->map_mu);
	return rc;
}

/*
 * Empties every mapping of remote `node` (dead already, so none is added): before the
 * bridge tells the peer host that nothing here writes the node's area any more. A mapping
 * is in its file's tree only once its mmap() has finished, which holds the process's mmap
 * lock: taking that lock waits for an mmap() that found the node alive.
 */
static void remote_unmap(struct pcientb_node *node)
{
	const loff_t start = PCIENTB_MMAP_REMOTE(node->lid, 0) << PAGE_SHIFT;
	const loff_t len = (loff_t)PCIENTB_MMAP_REMOTE_CHUNKS * PCIENTB_MMAP_REMOTE_STRIDE
			   << PAGE_SHIFT;
	struct pcientb_mapped_file *f, *next_f;
	struct pcientb_mapper *m, *next;

	mutex_lock(&node->map_mu); /* an mmap() that saw the node alive has left remote_mmap */
	mutex_unlock(&node->map_mu);
	list_for_each_entry(m, &node->mappers, list) {
		mmap_read_lock(m->mm);
		mmap_read_unlock(m->mm);
	}
	list_for_each_entry(f, &node->mapped_files, list)
		unmap_mapping_range(f->mapping, start, len, 1);
	list_for_each_entry_safe(m, next, &node->mappers, list)
		mapper_free(m);
	list_for_each_entry_safe(f, next_f, &node->mapped_files, list)
		mapped_file_free(f);
}

static void node_release(struct kref *ref)
{
	struct pcientb_node *node = container_of(ref, struct pcientb_node, ref);
	struct pcientb_mapped_file *f, *next_f;
	struct pcientb_mapper *m, *next;

	list_for_each_entry_safe(m, next, &node->mappers, list)
		mapper_free(m);
	list_for_each_entry_safe(f, next_f, &node->mapped_files, list)
		mapped_file_free(f);

	if (node->area)
		pcientb_area_put(node->area);
	kfree_rcu(node, rcu);
}

void pcientb_node_put(struct pcientb_node *node)
{
	kref_put(&node->ref, node_release);
}

/* Node `lid` of this device (of this host, or across the bridge), referenced; NULL if none. */
struct pcientb_node *pcientb_node_get(struct pcientb_ib *dev, u32 lid)
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

static struct pcientb_node *node_new(u32 lid, u64 nonce)
{
	struct pcientb_node *node = kzalloc(sizeof(*node), GFP_KERNEL);

	if (!node)
		return NULL;
	kref_init(&node->ref);
	node->lid = lid;
	node->nonce = nonce;
	init_waitqueue_head(&node->watchers);
	spin_lock_init(&node->lock);
	mutex_init(&node->map_mu);
	INIT_LIST_HEAD(&node->mappers);
	INIT_LIST_HEAD(&node->mapped_files);
	return node;
}

/* Makes `node` the live node of its LID: in the xarray, then in the node table. */
static int node_enter(struct pcientb_ib *dev, struct pcientb_node *node)
{
	struct pcientb_node_entry *e = table_entry(dev, node->lid);
	int rc = xa_err(xa_store(&dev->nodes, node->lid, node, GFP_KERNEL));

	if (rc)
		return rc;
	/*
	 * The nonce, then the life that makes the entry valid. No earlier node's mask: a node
	 * across the bridge had its word zeroed before the bridge acked it (pcientb_bridge.c).
	 */
	if (node->area)
		WRITE_ONCE(dev->masks[node->lid], 0);
	WRITE_ONCE(e->chunks, node->area ? node->area->chunks : node->chunks);
	WRITE_ONCE(e->layout, node->layout);
	WRITE_ONCE(e->nonce, node->nonce);
	smp_wmb();
	WRITE_ONCE(e->life, (u32)node->nonce | 1);
	return 0;
}

/* The node is gone: the table says so, watchers wake, its doorbell is let go. */
static void node_leave(struct pcientb_ib *dev, struct pcientb_node *node)
{
	struct eventfd_ctx *db;

	WRITE_ONCE(table_entry(dev, node->lid)->life, 0);
	WRITE_ONCE(dev->masks[node->lid], 0);
	xa_cmpxchg(&dev->nodes, node->lid, node, NULL, GFP_KERNEL);
	WRITE_ONCE(node->dead, true);
	wake_up_all(&node->watchers);
	spin_lock(&node->lock);
	db = node->doorbell;
	node->doorbell = NULL;
	spin_unlock(&node->lock);
	if (db)
		eventfd_ctx_put(db);
}

int pcientb_node_add(struct pcientb_ib *dev, struct pcientb_ucontext *uc, u64 nonce, u32 layout)
{
	struct pcientb_node *node = node_new(uc->lid, nonce);
	int rc;

	if (!node)
		return -ENOMEM;
	node->layout = layout;
	node->area = area_alloc();
	if (!node->area) {
		kfree(node);
		return -ENOMEM;
	}
	rc = node_enter(dev, node);
	if (rc) {
		pcientb_node_put(node);
		return rc;
	}
	uc->node = node;
	pcientb_bridge_publish(dev, node, true);
	return 0;
}

void pcientb_node_remove(struct pcientb_ib *dev, struct pcientb_ucontext *uc)
{
	struct pcientb_node *node = uc->node;

	node_leave(dev, node);
	pcientb_bridge_publish(dev, node, false);
	pcientb_node_put(node);
}

/* A node of the host across the bridge, as its module published it (pcientb_bridge.c). */
int pcientb_remote_add(struct pcientb_ib *dev, u32 lid, u64 nonce, u32 layout, unsigned int chunks,
		       const u64 *chunk_off, phys_addr_t window)
{
	struct pcientb_node *node = node_new(lid, nonce);
	int rc;

	if (!node)
		return -ENOMEM;
	node->layout = layout;
	node->window = window;
	node->chunks = chunks;
	memcpy(node->chunk_off, chunk_off, chunks * sizeof(*chunk_off));
	rc = node_enter(dev, node);
	if (rc)
		kfree(node);
	return rc;
}

void pcientb_remote_remove(struct pcientb_ib *dev, struct pcientb_node *node)
{
	mutex_lock(&node->map_mu);
	node_leave(dev, node);
	mutex_unlock(&node->map_mu);
	remote_unmap(node);
	pcientb_node_put(node);
}

/* Wakes the node: its doorbell eventfd counts one. */
void pcientb_node_signal(struct pcientb_node *node)
{
	spin_lock(&node->lock);
	if (node->doorbell)
		eventfd_signal(node->doorbell, 1);
	spin_unlock(&node->lock);
}

/* The uverbs fd's mmap: the context's area, the node table, or a node's area by LID. */
int pcientb_mmap(struct ib_ucontext *ibuc, struct vm_area_struct *vma)
{
	struct pcientb_ucontext *uc = container_of(ibuc, struct pcientb_ucontext, ibuc);
	struct pcientb_ib *dev = to_dev(ibuc->device);
	unsigned long off = vma->vm_pgoff, chunk;
	struct pcientb_node *node;
	int rc;

	if (off == PCIENTB_MMAP_TABLE) {
		if (vma->vm_flags & VM_WRITE)
			return -EPERM;
		vma->vm_flags &= ~VM_MAYWRITE;
		return remap_vmalloc_range(vma, dev->table, 0);
	}
	if (off == PCIENTB_MMAP_MASKS) {
		if ((vma->vm_flags & VM_WRITE) || vma->vm_end - vma->vm_start != PAGE_SIZE)
			return -EPERM;
		vma->vm_flags &= ~VM_MAYWRITE;
		vma->vm_flags |= VM_DONTEXPAND;
		/* The mapping holds the page: it may outlive the device. */
		return vm_insert_page(vma, vma->vm_start, dev->masks_page);
	}
	if (off == PCIENTB_MMAP_AREA) {
		node = uc->node;
		if (!node)
			return -EINVAL;
		kref_get(&node->ref);
	} else if (off >= PCIENTB_MMAP_PEER(0) && off < PCIENTB_MMAP_PEER(PCIENTB_LIDS)) {
		node = pcientb_node_get(dev, off - PCIENTB_MMAP_PEER(0));
		if (!node)
			return -ENOENT;
	} else if (off >= PCIENTB_MMAP_REMOTE(0, 0) && off < PCIENTB_MMAP_REMOTE(PCIENTB_LIDS, 0) &&
		   (off - PCIENTB_MMAP_REMOTE(0, 0)) % PCIENTB_MMAP_REMOTE_STRIDE == 0) {
		chunk = (off - PCIENTB_MMAP_REMOTE(0, 0)) / PCIENTB_MMAP_REMOTE_STRIDE;
		node = pcientb_node_get(dev, chunk / PCIENTB_MMAP_REMOTE_CHUNKS);
		if (!node)
			return -ENOENT;
		/* A node of this host is mapped whole (PCIENTB_MMAP_PEER). */
		rc = node->area ? -EINVAL :
				  remote_mmap(ibuc, node, chunk % PCIENTB_MMAP_REMOTE_CHUNKS, vma);
		pcientb_node_put(node);
		return rc;
	} else {
		return -EINVAL;
	}
	/* A node across the bridge is mapped by chunks (PCIENTB_MMAP_REMOTE). */
	rc = node->area ? area_mmap(node->area, vma) : -EREMOTE;
	pcientb_node_put(node);
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
	node = pcientb_node_get(to_dev(ibuc->device), cmd.lid);
	if (!node)
		return -ENOENT;
	rc = 0;
	if (node->area)
		pcientb_node_signal(node);
	else
		rc = pcientb_bridge_ring(to_dev(ibuc->device), node);
	pcientb_node_put(node);
	return rc;
}

static int UVERBS_HANDLER(PCIENTB_METHOD_MASK)(struct uverbs_attr_bundle *attrs)
{
	struct ib_ucontext *ibuc = ib_uverbs_get_ucontext(attrs);
	struct pcientb_node *node;
	struct pcientb_mask cmd;
	struct pcientb_ib *dev;
	int rc;

	if (IS_ERR(ibuc))
		return PTR_ERR(ibuc);
	rc = uverbs_copy_from(&cmd, attrs, PCIENTB_ATTR_MASK_CMD);
	if (rc)
		return rc;
	node = container_of(ibuc, struct pcientb_ucontext, ibuc)->node;
	if (cmd.reserved || !node)
		return -EINVAL;
	dev = to_dev(ibuc->device);
	WRITE_ONCE(dev->masks[node->lid], cmd.quiet ? 1 : 0);
	pcientb_bridge_mask(dev, node->lid, cmd.quiet ? 1 : 0);
	/* A mask's end is seen by every ringer before the caller looks at its lanes. */
	smp_mb();
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
		pcientb_node_put(file->private_data);
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
	node = pcientb_node_get(to_dev(ibuc->device), cmd.lid);
	if (node && node->nonce != cmd.nonce) { /* another incarnation: the one asked for is gone */
		pcientb_node_put(node);
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
		pcientb_node_put(node);
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
DECLARE_UVERBS_NAMED_METHOD(PCIENTB_METHOD_MASK,
			    UVERBS_ATTR_PTR_IN(PCIENTB_ATTR_MASK_CMD,
					       UVERBS_ATTR_TYPE(struct pcientb_mask),
					       UA_MANDATORY));
DECLARE_UVERBS_NAMED_METHOD(PCIENTB_METHOD_WATCH,
			    UVERBS_ATTR_PTR_IN(PCIENTB_ATTR_WATCH_CMD,
					       UVERBS_ATTR_TYPE(struct pcientb_watch),
					       UA_MANDATORY),
			    UVERBS_ATTR_PTR_OUT(PCIENTB_ATTR_WATCH_RESP,
						UVERBS_ATTR_TYPE(struct pcientb_watch_resp),
						UA_MANDATORY));

ADD_UVERBS_METHODS(pcientb_node_methods, UVERBS_OBJECT_DEVICE, &UVERBS_METHOD(PCIENTB_METHOD_RING),
		   &UVERBS_METHOD(PCIENTB_METHOD_DOORBELL), &UVERBS_METHOD(PCIENTB_METHOD_WATCH),
		   &UVERBS_METHOD(PCIENTB_METHOD_MASK));

const struct uapi_definition pcientb_node_defs[] = {
	UAPI_DEF_CHAIN_OBJ_TREE(UVERBS_OBJECT_DEVICE, &pcientb_node_methods),
	{},
};

/* At module load: a file of the kernel's (shmem, empty), nothing of which is this module's. */
int pcientb_areas_init(void)
{
	area_placeholder = shmem_file_setup("pcientb-area", 0, VM_NORESERVE);
	return PTR_ERR_OR_ZERO(area_placeholder);
}

/* Mappings that outlive the module keep the file: this drops the module's reference. */
void pcientb_areas_exit(void)
{
	fput(area_placeholder);
}

int pcientb_nodes_init(struct pcientb_ib *dev)
{
	xa_init(&dev->nodes);
	static_assert(PCIENTB_LIDS * sizeof(*dev->masks) <= PAGE_SIZE);
	dev->table = vmalloc_user(PCIENTB_LIDS * sizeof(struct pcientb_node_entry));
	/* Below 4 GiB: the peer writes it through a window that may cover no more. */
	dev->masks_page = alloc_page(GFP_KERNEL | __GFP_ZERO | GFP_DMA32);
	if (!dev->table || !dev->masks_page) {
		vfree(dev->table);
		if (dev->masks_page)
			__free_page(dev->masks_page);
		return -ENOMEM;
	}
	dev->masks = page_address(dev->masks_page);
	return 0;
}

/* After unregistering: every context is gone. */
void pcientb_nodes_destroy(struct pcientb_ib *dev)
{
	WARN_ON(!xa_empty(&dev->nodes));
	xa_destroy(&dev->nodes);
	vfree(dev->table);
	put_page(dev->masks_page); /* the mappings left hold it */
}
