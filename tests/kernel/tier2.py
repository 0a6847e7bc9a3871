#!/usr/bin/env python3
"""Kernel tier 2: two QEMU guests (TCG) joined as two hosts through an emulated NTB.

  tier2.py PCIENTB_KO [--keep DIR]

Each guest's RAM is a file that the other guest maps as an ivshmem-plain BAR (its memory
window onto the other host: a back-to-back NTB whose inbound translation covers all
memory), and each has one ivshmem-doorbell device on a shared ivshmem server (ports 0
and 1). Both load pcientb.ko and read their port's debugfs "remote" at once (each writes
64 KiB through its window into the other's buffer, rings, and checks what the other
wrote). Then guest A reads "sink" (keeps a window open until the link goes down) and guest
B reads "source" (writes through it and rings, in a loop); the host kills B's QEMU
mid-stream. Checks: both "remote" PASS; A's link goes down after the kill, within 10 s
(its heartbeat timeout is 3 s), after B's doorbells arrived; A unloads the module, and its dmesg
holds no warning. Exit 0 pass, 1 fail, 77 skip (as tier1.py).
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
case "$(cat /proc/cmdline)" in
  *pcientb_role=source*) say "streaming"; show "$d/source" ;;
  *pcientb_role=sink*) show "$d/sink"; say "sink ended" ;;
esac
if rmmod pcientb; then say "rmmod ok"; else say "rmmod failed"; fi
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
    a = Guest("A", guest.qemu_argv(w.kernel, w.image, ram["A"], ram["B"], [w.sock],
                                   "pcientb_role=sink"))
    guests.append(a)
    # A connects first and is port 0; B's QEMU starts once A's device is in.
    while not w.server.peers and a.p.poll() is None and time.monotonic() - t0 < 30:
        time.sleep(0.05)
    b = Guest("B", guest.qemu_argv(w.kernel, w.image, ram["B"], ram["A"], [w.sock],
                                   "pcientb_role=source"))
    guests.append(b)

    streaming = b.wait_line(lambda l: l == "streaming", 120)
    killed = None
    if streaming is not None:
        time.sleep(KILL_AFTER_S)
        if b.p.poll() is None and not any(l.startswith("ok   ") and "windows written" in l
                                          for l in b.texts()):
            b.p.send_signal(signal.SIGKILL)
            killed = time.monotonic()
    down = a.wait_line(lambda l: l.startswith("ok   link down"), 60)
    a.finish(60)
    b.finish(10)
    for g in guests:
        print("\n".join(f"[guest {g.name}] {l}" for l in g.texts()))
    print(f"[kernel] two guests ran {time.monotonic() - t0:.1f} s")

    problems = []
    for g in guests:
        if g.texts().count("PASS") != 1:
            problems.append(f"guest {g.name}: 'remote' did not pass")
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
