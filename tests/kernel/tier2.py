#!/usr/bin/env python3
"""Kernel tier 2: two QEMU guests (TCG) joined as two hosts through an emulated NTB.

  tier2.py PCIENTB_KO VERBS_CHECK PROVIDER_SO [--keep DIR]

Each guest's RAM is a file that the other guest maps as an ivshmem-plain BAR (its memory
window onto the other host: a back-to-back NTB whose inbound translation covers all
memory), and each has one ivshmem-doorbell device on a shared ivshmem server (ports 0
and 1). Both load pcientb.ko and read their port's debugfs "remote" at once (each writes
64 KiB through its window into the other's buffer, rings, and checks what the other
wrote), and check their verbs device through libibverbs and the provider (VERBS_CHECK, as
in tier 1, from the host's root). Both then run `verbs_check across` (one process each,
an RC QP between the hosts set up through a directory both guests share over 9p: WRITE,
SEND and READ both ways, checked), and A goes on streaming 64 KiB WRITEs into B. Then
guest A reads "sink" (keeps a window open until the
link goes down) while a program holds A's verbs device, and guest B reads "source" (writes
through it and rings, in a loop); the host kills B's QEMU mid-stream. Checks: both
"remote" and verbs checks pass; A's link goes down after the kill, within 10 s (its
heartbeat timeout is 3 s), after B's doorbells arrived, and A's program hears PORT_ERR
within that time too, and A's stream into B ends in an error completion (no hang) within
15 s of the kill; A unloads the module (the program then hears DEVICE_FATAL), and its
dmesg holds no warning. Exit 0 pass, 1 fail, 77 skip (as tier1.py).
"""

import os
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import guest  # noqa: E402
from guest import fail  # noqa: E402

INIT = r"""
if insmod /pcientb.ko ivshmem=1; then say "insmod ok"; else say "insmod failed"; fi
d=$(echo /sys/kernel/debug/pcientb/*/)
say "remote $(basename "$d")"
show "$d/remote"
host $CHECK devices 1
ib=$(basename /sys/class/infiniband/*)
# A directory both guests share, where the verbs programs across the hosts meet.
mkdir -p /host/dev/xchg && mount -t 9p -o trans=virtio,version=9p2000.L xchg /host/dev/xchg ||
  say "verbs: FAIL no shared directory"
case "$(cat /proc/cmdline)" in
  *pcientb_role=source*) side=b ;;
  *) side=a ;;
esac
# RDMA between the hosts (one process each, an RC QP), in the background: a then streams
# WRITEs into b until b's host is killed; b waits for that.
host sh -c "$CHECK across $ib $side /dev/xchg | tee /dev/across.log" &
across=$!
i=0
until grep -q "^across ok" /dev/across.log 2>/dev/null || [ $i -ge 1200 ]; do
  sleep 0.1; i=$((i + 1))
done
# (The program's own lines reach the console when it ends: b's never does.)
grep -q "^across ok" /dev/across.log && say "across $side ok"
case "$(cat /proc/cmdline)" in
  *pcientb_role=source*) say "streaming"; show "$d/source" ;;
  *pcientb_role=sink*)
    # Until the device goes (rmmod: DEVICE_FATAL).
    host $CHECK events "$ib" 16 180 /dev/pcientb-ready &
    watch=$!
    i=0
    while [ ! -e /dev/pcientb-ready ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i + 1)); done
    [ $i -lt 300 ] || say "verbs: FAIL the event watcher did not start within 30 s"
    say "sink open"
    show "$d/sink"; say "sink ended" ;;
esac
wait $across
if rmmod pcientb; then say "rmmod ok"; else say "rmmod failed"; fi
[ -n "$watch" ] && wait $watch
check_dmesg
say "done"
poweroff -f
"""

KILL_AFTER_S = 1.5  # of streaming
DOWN_WITHIN_S = 10.0  # the heartbeat's 3 s, and a TCG guest's delays


class Guest:
    """A QEMU process whose marked lines are read as they come, with their times."""

    def __init__(self, name, argv):
        self.name = name
        self.lines = []  # (monotonic time, text)
        self.raw = []
        self.cond = threading.Condition()
        self.p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, errors="replace")
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.p.stdout:
            self.raw.append(line)
            marked = guest.marked(line)
            with self.cond:
                self.lines += [(time.monotonic(), m) for m in marked]
                self.cond.notify_all()

    def wait_line(self, pred, timeout):
        """The time of the first marked line for which pred holds, or None."""
        end = time.monotonic() + timeout
        with self.cond:
            while True:
                for t, text in self.lines:
                    if pred(text):
                        return t
                left = end - time.monotonic()
                if left <= 0 or (self.p.poll() is not None and not self.reader.is_alive()):
                    return None
                self.cond.wait(min(left, 0.2))

    def texts(self):
        with self.cond:
            return [text for _, text in self.lines]

    def finish(self, timeout):
        try:
            self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        self.reader.join(timeout=5)


def main():
    guests = []
    with guest.workspace(__doc__, INIT, "pcientb-kernel2-") as w:
        try:
            run_guests(w, guests)
        finally:
            for g in guests:
                if g.p.poll() is None:
                    g.p.kill()
                    g.p.wait()


def run_guests(w, guests):
    ram = {n: os.path.join(w.dir, f"ram{n}") for n in "AB"}
    t0 = time.monotonic()
    xchg = os.path.join(w.dir, "xchg")
    os.makedirs(xchg, exist_ok=True)
    a = Guest("A", guest.qemu_argv(w.kernel, w.image, ram["A"], ram["B"], [w.sock],
                                   "pcientb_role=sink", hostroot=True, xchg=xchg))
    guests.append(a)
    # A connects first and is port 0; B's QEMU starts once A's device is in.
    while not w.server.peers and a.p.poll() is None and time.monotonic() - t0 < 30:
        time.sleep(0.05)
    b = Guest("B", guest.qemu_argv(w.kernel, w.image, ram["B"], ram["A"], [w.sock],
                                   "pcientb_role=source", hostroot=True, xchg=xchg))
    guests.append(b)

    # B streams once A's window is open: the kill waits for both (A starts a program first).
    streaming = b.wait_line(lambda l: l == "streaming", 120)
    if streaming is not None and a.wait_line(lambda l: l == "sink open", 60) is None:
        streaming = None
    killed = None
    if streaming is not None:
        time.sleep(KILL_AFTER_S)
        if b.p.poll() is None and not any(l.startswith("ok   ") and "windows written" in l
                                          for l in b.texts()):
            b.p.send_signal(signal.SIGKILL)
            killed = time.monotonic()
    down = a.wait_line(lambda l: l.startswith("ok   link down"), 60)
    across_end = a.wait_line(lambda l: l.startswith("verbs: across error")
                             or l.startswith("verbs: FAIL"), 60)
    port_err = a.wait_line(lambda l: l.startswith("verbs: event ") and l.endswith(" PORT_ERR"),
                           30)
    a.finish(60)
    b.finish(10)
    for g in guests:
        print("\n".join(f"[guest {g.name}] {l}" for l in g.texts()))
    print(f"[kernel] two guests ran {time.monotonic() - t0:.1f} s")

    problems = []
    for g in guests:
        if g.texts().count("PASS") != 1:
            problems.append(f"guest {g.name}: 'remote' did not pass")
        verbs = [l for l in g.texts() if l.startswith("verbs: ")]
        bad = [v for v in verbs if v.startswith("verbs: FAIL") or "warning" in v.lower()]
        if bad or "verbs: devices 1" not in verbs:
            problems.append(f"guest {g.name}: verbs device not checked: {bad}")
    events = [l.split()[3] for l in a.texts() if l.startswith("verbs: event ")]
    # The provider's engine announces the port at open, then passes the module's events on.
    if events != ["PORT_ACTIVE", "PORT_ERR", "DEVICE_FATAL"]:
        problems.append(f"A's program heard {events}: expected PORT_ACTIVE at open, PORT_ERR, "
                        "then DEVICE_FATAL")
    elif killed is not None and port_err is not None:
        print(f"[kernel] A's program heard PORT_ERR {port_err - killed:.2f} s after the kill")
        if not 0 <= port_err - killed <= DOWN_WITHIN_S:
            problems.append(f"A's PORT_ERR came {port_err - killed:.1f} s after the kill")
    # RDMA across the hosts: both sides' checks, then A's stream into B ends in an error
    # completion once B's host is gone (its link down, 3 s), not in a hang.
    for g in guests:
        if f"across {g.name.lower()} ok" not in g.texts():
            problems.append(f"guest {g.name}: RDMA across the hosts did not pass")
    if "verbs: across streaming" not in a.texts():
        problems.append("guest A did not stream RDMA WRITEs into B")
    ended = [l for l in a.texts() if l.startswith("verbs: across error")]
    if killed is not None and across_end is not None and ended:
        print(f"[kernel] A's stream into B ended {across_end - killed:.2f} s after the kill: "
              f"{ended[0][len('verbs: '):]}")
        if not 0 <= across_end - killed <= DOWN_WITHIN_S + 5:
            problems.append(f"A's stream ended {across_end - killed:.1f} s after the kill")
    elif killed is not None:
        problems.append("A's stream into B did not end in an error completion after the kill")
    if killed is None:
        problems.append("guest B never streamed, or stopped before it was killed")
    elif down is None:
        problems.append("guest A never saw its link go down after B was killed")
    else:
        took = down - killed
        print(f"[kernel] A's link went down {took:.2f} s after B was killed")
        if took < 0:
            problems.append(f"A's link went down {-took:.1f} s before B was killed")
        elif took > DOWN_WITHIN_S:
            problems.append(f"A's link went down {took:.1f} s after the kill "
                            f"(at most {DOWN_WITHIN_S} s)")
    texts = a.texts()
    sink = [l for l in texts if l.startswith("ok   link down after")]
    if sink and sink[0].split()[4] == "0":
        problems.append("A saw no doorbell of B's stream")
    for want in ("rmmod ok", "done"):
        if want not in texts:
            problems.append(f"guest A: no '{want}'")
    if any(l.startswith("dmesg:") for l in texts):
        problems.append("guest A: dmesg lines of warnings")
    if problems:
        fail("; ".join(problems),
             "".join(a.raw[-60:]) + "".join(b.raw[-40:]) if not texts else "")
    print("[kernel] PASS")


if __name__ == "__main__":
    main()
