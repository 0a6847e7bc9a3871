"""What the kernel tests' QEMU guests have in common: Debian's kernel (the one the module
was built for), a busybox initramfs with pcientb.ko, the kernel's RDMA core modules it needs
and a test's /init, guest RAM in a file (so that another device can map it as an NT
window), ivshmem devices, optionally the host's root over virtio-9p (read-only: programs of
the host run in the guest in a chroot), and the lines the guest marks for the host.

The guest's /init prints `MARK text` lines (MARK below); the host reads them from the
serial console.
"""

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import types

from ivshmem_server import IvshmemServer

SKIP = 77
MARK = "pcientb-guest:"
# Each node's area is 16 MiB of 4 MiB blocks (pcientb.ko's chunks): with 256 MiB, a guest
# whose memory was fragmented by a few programs could not give four nodes at once.
GUEST_RAM_MB = 512
IVSHMEM_VECTORS = 4
# Loaded in this order before the test's /init body: pcientb.ko needs ib_core, and
# ib_uverbs gives its devices to programs (/dev/infiniband/uverbsN).
RDMA_MODULES = ["drivers/infiniband/core/ib_core.ko", "drivers/infiniband/core/ib_uverbs.ko"]
# The host's root over virtio-9p.
HOSTROOT_MODULES = ["drivers/virtio/virtio_ring.ko", "drivers/virtio/virtio.ko",
                    "drivers/virtio/virtio_pci_modern_dev.ko",
                    "drivers/virtio/virtio_pci_legacy_dev.ko", "drivers/virtio/virtio_pci.ko",
                    "fs/netfs/netfs.ko", "fs/fscache/fscache.ko", "net/9p/9pnet.ko",
                    "net/9p/9pnet_virtio.ko", "fs/9p/9p.ko"]

# Shell helpers every /init starts with: mounts, `say`, and the dmesg check.
INIT_HEAD = r"""#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mount -t debugfs debugfs /sys/kernel/debug
say() { echo "MARK $*"; }
show() { sed "s/^/MARK   /" "$1"; }
check_dmesg() {
  bad="WARNING:|BUG:|Oops|Call Trace|general protection|UBSAN|KASAN|kmemleak|corruption"
  bad="$bad|INFO: task|Poison overwritten|Redzone|Object padding"
  dmesg | grep -E "$bad|pcientb.*(error|fail)" | grep -v "module verification failed" |
    sed "s/^/MARK dmesg: /"
}
for m in $(cat /modules/order); do insmod /modules/$m || say "insmod $m failed"; done
# The host's root at /host (when the guest has it), with /proc, /sys and /dev of the guest
# (/dev is where programs there may write: the build tree under test may be in /tmp).
if [ -e /modules/9p.ko ]; then
  mkdir -p /host
  if mount -t 9p -o trans=virtio,version=9p2000.L,ro hostroot /host; then
    for d in proc sys dev; do mount -o bind /$d /host/$d; done
  else
    say "no host root"
  fi
fi
""".replace("MARK", MARK)


# With the host's root: `host CMD...` runs a program of the host in a chroot, with the
# provider under test only (RDMAV_DRIVERS), its output marked "verbs: "; $CHECK is the
# verbs_check program.
VERBS_HEAD = r"""
[ -d /host/etc/libibverbs.d ] && mount -t tmpfs tmpfs /host/etc/libibverbs.d
host() { chroot /host /usr/bin/env RDMAV_DRIVERS="@DRIVER@" "$@" 2>&1 | sed "s/^/MARK verbs: /"; }
CHECK="@CHECK@"
[ -x "/host$CHECK" ] || say "verbs: FAIL no $CHECK in the host's root as the guest sees it"
"""


def skip(why):
    print(f"[kernel] skipped: {why}")
    sys.exit(SKIP)


def fail(why, output=""):
    if output:
        print(output)
    print(f"[kernel] FAIL: {why}")
    sys.exit(1)


def check_host(ko):
    """The kernel image the module was built for; skips when the host cannot run a guest."""
    if not shutil.which("qemu-system-x86_64"):
        skip("qemu-system-x86_64 not installed (apt-get install qemu-system-x86)")
    if not os.path.exists("/bin/busybox") or not shutil.which("cpio"):
        skip("busybox-static or cpio not installed")
    if not os.path.exists(ko):
        fail(f"{ko} was not built (make -C kernel)")
    out = subprocess.run(["modinfo", "-F", "vermagic", ko], capture_output=True, text=True)
    release = out.stdout.split()[0] if out.returncode == 0 and out.stdout.split() else None
    kernel = f"/boot/vmlinuz-{release}" if release else None
    if not kernel or not os.path.exists(kernel):
        skip(f"no /boot/vmlinuz-{release} for the module's kernel "
             "(apt-get install linux-image-amd64)")
    return kernel


def initramfs(work, ko, init_body, release, hostroot=False):
    """A cpio archive with busybox, the module, the kernel's modules it needs (and those of
    a host root over 9p) and INIT_HEAD + init_body as /init."""
    root = os.path.join(work, "root")
    for d in ("bin", "proc", "sys", "dev", "modules"):
        os.makedirs(os.path.join(root, d), exist_ok=True)
    shutil.copy("/bin/busybox", os.path.join(root, "bin", "busybox"))
    shutil.copy(ko, os.path.join(root, "pcientb.ko"))
    names = []
    for rel in RDMA_MODULES + (HOSTROOT_MODULES if hostroot else []):
        path = f"/lib/modules/{release}/kernel/{rel}"
        if not os.path.exists(path):
            skip(f"no {path} (apt-get install linux-image-amd64)")
        shutil.copy(path, os.path.join(root, "modules"))
        names.append(os.path.basename(rel))
    with open(os.path.join(root, "modules", "order"), "w") as f:
        f.write("\n".join(names) + "\n")
    init = os.path.join(root, "init")
    with open(init, "w") as f:
        f.write(INIT_HEAD + init_body.replace("MARK", MARK))
    os.chmod(init, 0o755)
    image = os.path.join(work, "initramfs.cpio")
    files = subprocess.run(["find", "."], cwd=root, capture_output=True, text=True,
                           check=True).stdout
    with open(image, "wb") as out:
        subprocess.run(["cpio", "-o", "-H", "newc", "--quiet"], cwd=root, input=files.encode(),
                       stdout=out, check=True)
    return image


def qemu_argv(kernel, image, ram, window, doorbells, append="", hostroot=False, xchg=None):
    """One TCG guest whose RAM is the file `ram`, with the file `window` (a RAM file, its own
    or another guest's) as an ivshmem-plain BAR, an ivshmem-doorbell device on each
    server socket of `doorbells`, the host's root read-only over 9p if asked, and the host
    directory `xchg` read-write over 9p (tag xchg) if given."""
    backing = f"size={GUEST_RAM_MB}M,share=on,mem-path="
    argv = ["qemu-system-x86_64", "-accel", "tcg", "-cpu", "max", "-smp", "1",
            "-m", f"{GUEST_RAM_MB}M", "-nographic", "-no-reboot", "-kernel", kernel,
            "-initrd", image,
            # SLUB checks and poisoning: Debian's kernel has no KASAN or lockdep.
            "-append", " ".join(["console=ttyS0 quiet panic=-1 slub_debug=FZPU init_on_free=1",
                                 append]).strip(),
            "-object", f"memory-backend-file,id=ram,{backing}{ram}",
            "-machine", "pc,memory-backend=ram",
            "-object", f"memory-backend-file,id=win,{backing}{window}",
            "-device", "ivshmem-plain,memdev=win"]
    for i, sock in enumerate(doorbells):
        argv += ["-chardev", f"socket,path={sock},id=ivs{i}",
                 "-device", f"ivshmem-doorbell,chardev=ivs{i},vectors={IVSHMEM_VECTORS}"]
    if hostroot:
        argv += ["-virtfs", "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,"
                 "multidevs=remap"]
    if xchg:
        argv += ["-virtfs", f"local,path={xchg},mount_tag=xchg,security_model=none"]
    return argv


def marked(text):
    """The lines the guest marked, without the mark."""
    return [line.split(MARK, 1)[1].strip() for line in text.splitlines() if MARK in line]


@contextlib.contextmanager
def workspace(doc, init_body, prefix):
    """For `tierN.py PCIENTB_KO VERBS_CHECK PROVIDER_SO [--keep DIR]`: checks the host,
    builds the initramfs with VERBS_HEAD + init_body (the guests get the host's root) and
    starts an ivshmem server; yields them (kernel, image, dir, sock, server). Everything
    goes when the test ends, but a --keep directory."""
    args = sys.argv[1:]
    keep = args[args.index("--keep") + 1] if "--keep" in args else None
    if keep:
        args = args[:args.index("--keep")] + args[args.index("--keep") + 2:]
    if len(args) != 3:
        print(doc)
        sys.exit(2)
    ko, check, provider = (os.path.abspath(a) for a in args)
    if not provider.endswith("-rdmav34.so"):
        fail(f"{provider} is not a provider library (lib<name>-rdmav34.so)")
    # RDMAV_DRIVERS names a provider by its path without the suffix.
    head = VERBS_HEAD.replace("@CHECK@", check).replace("@DRIVER@",
                                                        provider[:-len("-rdmav34.so")])
    init_body = head + init_body
    kernel = check_host(ko)
    release = os.path.basename(kernel)[len("vmlinuz-"):]
    # The guests' RAM files: in memory, not written back to a disk.
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    work = keep or tempfile.mkdtemp(prefix=prefix, dir=shm)
    os.makedirs(work, exist_ok=True)
    server = None
    try:
        image = initramfs(work, ko, init_body, release, hostroot=True)
        sock = os.path.join(work, "ivshmem.sock")
        server = IvshmemServer(sock, size=1 << 20, vectors=IVSHMEM_VECTORS).start()
        yield types.SimpleNamespace(kernel=kernel, image=image, dir=work, sock=sock,
                                    server=server)
    finally:
        if server:
            server.stop()
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
