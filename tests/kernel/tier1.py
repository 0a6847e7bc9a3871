#!/usr/bin/env python3
"""Kernel tier 1: pcientb.ko in one QEMU guest (TCG) booting Debian's kernel.

  tier1.py PCIENTB_KO [--keep DIR]

The guest has two ivshmem-doorbell devices on one ivshmem server (NTB ports 0 and 1 of
one kernel, each the other's peer) and an ivshmem-plain device that maps the guest's own
RAM (the memory window: a write at BAR offset X lands at physical address X, as through an
NT window whose inbound translation covers all memory). Its /init (busybox) loads the
module, runs each port's debugfs selftest (link, scratchpads both ways, a doorbell, 64 KiB
written through the window and read in the peer's memory), takes port 1's device from the
driver and gives it back (port 0's link goes down, then up, with an event each time, and
its selftest passes again), stops and restarts port 1's heartbeat (a peer that died
without a word: down, then up), unloads the module, and prints the kernel's warnings, bugs,
oopses and the module's errors from dmesg. Checks: every selftest PASS, the link states,
insmod and rmmod succeed, dmesg holds no warning. Exit 0 pass, 1 fail, 77 skip (no QEMU,
no kernel image, or a module built for another kernel).
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ivshmem_server import IvshmemServer  # noqa: E402

SKIP = 77
GUEST_RAM_MB = 256
MARK = "pcientb-guest:"

INIT = r"""#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mount -t debugfs debugfs /sys/kernel/debug
say() { echo "MARK $*"; }
if insmod /pcientb.ko; then say "insmod ok"; else say "insmod failed"; fi
for d in /sys/kernel/debug/pcientb/*/; do
  say "selftest $(basename "$d")"
  cat "$d/selftest" | sed "s/^/MARK   /"
done
# Link down and up: port 1's device leaves the driver and comes back.
drv=/sys/bus/pci/drivers/pcientb-ivshmem
set -- /sys/kernel/debug/pcientb/*/
first=$(basename "$1"); second=$(basename "$2")
say "link before $(cat /sys/kernel/debug/pcientb/$first/link)"
echo "${second#ntb-}" > $drv/unbind
sleep 1
say "link after unbind $(cat /sys/kernel/debug/pcientb/$first/link)"
echo "${second#ntb-}" > $drv/bind
sleep 1
say "link after bind $(cat /sys/kernel/debug/pcientb/$first/link)"
# A peer that stops without a word (its host died): port 1's heartbeat stops.
beat=/sys/kernel/debug/pcientb-ivshmem/${second#ntb-}/heartbeat
echo 0 > $beat
sleep 1
say "link after silence $(cat /sys/kernel/debug/pcientb/$first/link)"
echo 1 > $beat
sleep 1
say "link after heartbeat $(cat /sys/kernel/debug/pcientb/$first/link)"
say "selftest again $first"
cat /sys/kernel/debug/pcientb/$first/selftest | sed "s/^/MARK   /"
if rmmod pcientb; then say "rmmod ok"; else say "rmmod failed"; fi
bad="WARNING:|BUG:|Oops|Call Trace|general protection|UBSAN|KASAN|kmemleak|corruption"
dmesg | grep -E "$bad|pcientb.*(error|fail)" | grep -v "module verification failed" |
  sed "s/^/MARK dmesg: /"
say "done"
poweroff -f
""".replace("MARK", MARK)


def skip(why):
    print(f"[kernel] skipped: {why}")
    sys.exit(SKIP)


def fail(why, output=""):
    if output:
        print(output)
    print(f"[kernel] FAIL: {why}")
    sys.exit(1)


def vermagic(ko):
    out = subprocess.run(["modinfo", "-F", "vermagic", ko], capture_output=True, text=True)
    return out.stdout.split()[0] if out.returncode == 0 and out.stdout.split() else None


def build_initramfs(work, ko):
    root = os.path.join(work, "root")
    for d in ("bin", "proc", "sys", "dev"):
        os.makedirs(os.path.join(root, d))
    shutil.copy("/bin/busybox", os.path.join(root, "bin", "busybox"))
    shutil.copy(ko, os.path.join(root, "pcientb.ko"))
    init = os.path.join(root, "init")
    with open(init, "w") as f:
        f.write(INIT)
    os.chmod(init, 0o755)
    image = os.path.join(work, "initramfs.cpio")
    files = subprocess.run(["find", "."], cwd=root, capture_output=True, text=True,
                           check=True).stdout
    with open(image, "wb") as out:
        subprocess.run(["cpio", "-o", "-H", "newc", "--quiet"], cwd=root, input=files.encode(),
                       stdout=out, check=True)
    return image


def main():
    args = sys.argv[1:]
    if not args:
        print(__doc__)
        sys.exit(2)
    ko = os.path.abspath(args[0])
    keep = args[args.index("--keep") + 1] if "--keep" in args else None
    qemu = shutil.which("qemu-system-x86_64")
    if not qemu:
        skip("qemu-system-x86_64 not installed (apt-get install qemu-system-x86)")
    if not os.path.exists("/bin/busybox") or not shutil.which("cpio"):
        skip("busybox-static or cpio not installed")
    if not os.path.exists(ko):
        fail(f"{ko} was not built (make -C kernel)")
    release = vermagic(ko)
    kernel = f"/boot/vmlinuz-{release}" if release else None
    if not kernel or not os.path.exists(kernel):
        skip(f"no /boot/vmlinuz-{release} for the module's kernel "
             "(apt-get install linux-image-amd64)")

    work = keep or tempfile.mkdtemp(prefix="pcientb-kernel-")
    os.makedirs(work, exist_ok=True)
    server = None
    try:
        image = build_initramfs(work, ko)
        ram = os.path.join(work, "ram")
        sock = os.path.join(work, "ivshmem.sock")
        server = IvshmemServer(sock, size=1 << 20, vectors=4).start()
        backing = f"size={GUEST_RAM_MB}M,mem-path={ram},share=on"
        argv = [qemu, "-accel", "tcg", "-cpu", "max", "-smp", "1", "-m", f"{GUEST_RAM_MB}M",
                "-nographic", "-no-reboot", "-kernel", kernel, "-initrd", image,
                "-append", "console=ttyS0 quiet panic=-1",
                # Guest RAM in a file, mapped a second time as the window device's BAR.
                "-object", f"memory-backend-file,id=ram,{backing}",
                "-machine", "pc,memory-backend=ram",
                "-object", f"memory-backend-file,id=win,{backing}",
                "-device", "ivshmem-plain,memdev=win"]
        for i in range(2):
            argv += ["-chardev", f"socket,path={sock},id=ivs{i}",
                     "-device", f"ivshmem-doorbell,chardev=ivs{i},vectors=4"]
        t0 = time.monotonic()
        try:
            run = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                 timeout=int(os.environ.get("PCIENTB_KERNEL_TIMEOUT", "240")))
        except subprocess.TimeoutExpired as e:
            out = e.stdout or b""
            fail("the guest did not power off in time",
                 out.decode(errors="replace") if isinstance(out, bytes) else out)
        took = time.monotonic() - t0
        out = run.stdout + run.stderr
        lines = [l.split(MARK, 1)[1].strip() for l in out.splitlines() if MARK in l]
        print("\n".join(f"[guest] {l}" for l in lines))
        print(f"[kernel] guest ran {took:.1f} s (QEMU exit {run.returncode})")
        problems = []
        for want in ("insmod ok", "rmmod ok", "done"):
            if want not in lines:
                problems.append(f"no '{want}'")
        ports = [l for l in lines if l.startswith("selftest ntb-")]
        passes = sum(1 for l in lines if l == "PASS")
        if len(ports) != 2 or passes != 3:
            problems.append(f"{len(ports)} ports, {passes} selftests passed (expected 2 and 3)")
        # The link as port 0 sees it: up; down once its peer's device left; up when it came
        # back; down when the peer's heartbeat stopped; up when it beat again. Every change
        # is at least one link event.
        steps = ("before", "after unbind", "after bind", "after silence", "after heartbeat")
        link = {m.group(1): (m.group(2), int(m.group(3))) for m in
                (re.match(r"link (\w+(?: \w+)?) (up|down) (\d+)$", l) for l in lines) if m}
        states = [link.get(k, ("?", 0))[0] for k in steps]
        events = [link.get(k, ("?", 0))[1] for k in steps]
        if states != ["up", "down", "up", "down", "up"] or events != sorted(set(events)):
            problems.append(f"link states {states}, events {events}: expected up, down, up, "
                            "down, up, each change an event")
        dmesg = [l for l in lines if l.startswith("dmesg:")]
        if dmesg:
            problems.append(f"{len(dmesg)} dmesg lines of warnings")
        if problems:
            fail("; ".join(problems), out if not lines else "")
        print("[kernel] PASS")
    finally:
        if server:
            server.stop()
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
