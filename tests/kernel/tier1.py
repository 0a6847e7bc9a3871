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
without a word: down, then up), unloads the module, and prints the kernel's warnings,
bugs, oopses and the module's errors from dmesg. Checks: every selftest PASS, the link
states, insmod and rmmod succeed, dmesg holds no warning. Exit 0 pass, 1 fail, 77 skip (no
QEMU, no kernel image, or a module built for another kernel).
"""

import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import guest  # noqa: E402
from guest import fail  # noqa: E402

INIT = r"""
if insmod /pcientb.ko ivshmem=1; then say "insmod ok"; else say "insmod failed"; fi
for d in /sys/kernel/debug/pcientb/*/; do
  say "selftest $(basename "$d")"
  show "$d/selftest"
done
# Link down and up: port 1's device leaves the driver and comes back.
drv=/sys/bus/pci/drivers/pcientb-ivshmem
set -- /sys/kernel/debug/pcientb/*/
first=$(basename "$1"); second=$(basename "$2")
state() { cut -d" " -f1 /sys/kernel/debug/pcientb/$first/link; }
# Reports port 0's link once it is $2 (10 s at most: a TCG guest can be slow).
link() {
  i=0
  while [ "$(state)" != "$2" ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
  say "link $1 $(cat /sys/kernel/debug/pcientb/$first/link)"
}
link before up
echo "${second#ntb-}" > $drv/unbind
link "after unbind" down
echo "${second#ntb-}" > $drv/bind
link "after bind" up
say "selftest again $first"
show /sys/kernel/debug/pcientb/$first/selftest
# A peer that stops without a word (its host died): port 1's heartbeat stops.
beat=/sys/kernel/debug/pcientb-ivshmem/${second#ntb-}/heartbeat
echo 0 > $beat
link "after silence" down
echo 1 > $beat
link "after heartbeat" up
if rmmod pcientb; then say "rmmod ok"; else say "rmmod failed"; fi
check_dmesg
say "done"
poweroff -f
"""

# The link as port 0 sees it: up; down once its peer's device left; up when it came back;
# down when the peer's heartbeat stopped; up when it beat again.
LINK_STEPS = ("before", "after unbind", "after bind", "after silence", "after heartbeat")
LINK_STATES = ["up", "down", "up", "down", "up"]


def check(lines):
    problems = []
    for want in ("insmod ok", "rmmod ok", "done"):
        if want not in lines:
            problems.append(f"no '{want}'")
    ports = [l for l in lines if l.startswith("selftest ntb-")]
    passes = sum(1 for l in lines if l == "PASS")
    if len(ports) != 2 or passes != 3:
        problems.append(f"{len(ports)} ports, {passes} selftests passed (expected 2 and 3)")
    link = {m.group(1): (m.group(2), int(m.group(3))) for m in
            (re.match(r"link (\w+(?: \w+)?) (up|down) (\d+)$", l) for l in lines) if m}
    states = [link.get(k, ("?", 0))[0] for k in LINK_STEPS]
    events = [link.get(k, ("?", 0))[1] for k in LINK_STEPS]
    # Every change is at least one link event.
    if states != LINK_STATES or events != sorted(set(events)):
        problems.append(f"link states {states}, events {events}: expected {LINK_STATES}, "
                        "each change an event")
    dmesg = [l for l in lines if l.startswith("dmesg:")]
    if dmesg:
        problems.append(f"{len(dmesg)} dmesg lines of warnings")
    return problems


def main():
    with guest.workspace(__doc__, INIT, "pcientb-kernel-") as w:
        ram = os.path.join(w.dir, "ram")
        # Both ports on one server; the window is the guest's own RAM.
        argv = guest.qemu_argv(w.kernel, w.image, ram, ram, [w.sock, w.sock])
        t0 = time.monotonic()
        try:
            run = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                 timeout=int(os.environ.get("PCIENTB_KERNEL_TIMEOUT", "240")))
        except subprocess.TimeoutExpired as e:
            out = e.stdout or b""
            fail("the guest did not power off in time",
                 out.decode(errors="replace") if isinstance(out, bytes) else out)
        out = run.stdout + run.stderr
        lines = guest.marked(out)
        print("\n".join(f"[guest] {l}" for l in lines))
        print(f"[kernel] guest ran {time.monotonic() - t0:.1f} s (QEMU exit {run.returncode})")
        problems = check(lines)
        if problems:
            fail("; ".join(problems), out if not lines else "")
        print("[kernel] PASS")


if __name__ == "__main__":
    main()
