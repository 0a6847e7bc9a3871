#!/usr/bin/env python3
"""Kernel tier 1: pcientb.ko in one QEMU guest (TCG) booting Debian's kernel.

  tier1.py PCIENTB_KO VERBS_CHECK PROVIDER_SO [--keep DIR]

The guest has two ivshmem-doorbell devices on one ivshmem server (NTB ports 0 and 1 of
one kernel, each the other's peer) and an ivshmem-plain device that maps the guest's own
RAM (the memory window: a write at BAR offset X lands at physical address X, as through an
NT window whose inbound translation covers all memory), and the host's root over 9p. Its
/init (busybox) loads ib_core, ib_uverbs and the module, runs each port's debugfs selftest
(link, scratchpads both ways, a doorbell, 64 KiB written through the window and read in
the peer's memory), then, in a chroot of the host's root with the provider PROVIDER_SO,
VERBS_CHECK (verbs_check.c) over both verbs devices (each opened by the provider, queried,
the provider's engine on the kernel fabric: an RC QP's RDMA WRITE and READ to itself;
pcientb.ko's own objects: LIDs, memory regions pinned and unpinned, moves, the nodes' areas,
table, doorbells, doorbell masks on both hosts and watchers; a node whose mask ran out is
rung again) and `ibv_devinfo -v`, then `ibv_rc_pingpong`, `ib_write_bw`
and `ib_read_bw` between two processes on pcientb0 (setup over loopback TCP). It takes port 1's device from the driver and gives it back (port 0's
link goes down, then up, with an event each time, and its selftest passes again; port 0's
bridge is held from looking meanwhile, as if port 1's module were reloaded between two of
its looks, and must then find port 1's new bridge), stops
and restarts port 1's heartbeat (a peer that died without a word: down, then up; a node
of port 0 masked before port 1's host knew it has its mask there, and the end of its mask
while its link was down reaches port 1's host once the link is up again); a
program holding port 0's verbs device meanwhile receives PORT_ERR, PORT_ACTIVE, PORT_ERR,
PORT_ACTIVE, and one holding port 1's gets DEVICE_FATAL when it goes (the unbind does not
wait for it; PORT_ERR may come first); each program's registered region is unpinned when its
device goes. Both verbs devices are checked again, then the
module is unloaded while port 0's program still holds its device (it gets DEVICE_FATAL,
rmmod does not wait), and the kernel's warnings, bugs, oopses and the module's errors
printed from dmesg. Checks: every selftest and verbs check passes, the link states and
events, insmod and rmmod succeed, dmesg holds no warning. Exit 0 pass, 1 fail, 77 skip (no QEMU, no kernel image, or a
module built for another kernel).
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
host $CHECK devices 2
host ibv_devinfo -v
# Two processes, two nodes of pcientb0 (the engine over the kernel fabric), their setup
# over loopback TCP: a server in the background, then its client, retried while the server
# does not listen yet (a busy host slows the guest), each bounded in time.
ip link set lo up 2>/dev/null || ifconfig lo up
pair() {
  say "verbs: pair $1"
  host sh -c "for attempt in 1 2; do
      timeout 90 $2 $3 >/dev/pair-server 2>&1 & i=0
      until timeout 90 $2 $4 127.0.0.1 >/dev/pair-client 2>&1; do
        i=\$((i + 1)); [ \$i -ge 30 ] && break; sleep 1
      done
      wait
      # perftest gives up when its clock check fails on a busy host (r^2 < 0.9): once more.
      grep -q \"Can't produce a report\" /dev/pair-server /dev/pair-client || break
    done
    cat /dev/pair-client /dev/pair-server"
}
pair rc_pingpong "ibv_rc_pingpong -d pcientb0 -n 200 -s 4096 -p 18515"
# perftest's RDMA WRITE and READ: one-sided moves between the two nodes (the module's).
pair ib_write_bw "ib_write_bw -d pcientb0 -s 65536 -n 100 -p 18516"
pair ib_read_bw "ib_read_bw -d pcientb0 -s 65536 -n 100 -p 18517"
# Across the bridge: the server on pcientb1, the client on pcientb0 (the other "host").
pair rc_pingpong_across "ibv_rc_pingpong -n 200 -s 4096 -p 18518" "-d pcientb1" "-d pcientb0"
pair ib_send_lat_across "ib_send_lat -s 64 -n 200 -p 18519" "-d pcientb1" "-d pcientb0"
pair ib_write_bw_across "ib_write_bw -s 65536 -n 100 -p 18520" "-d pcientb1" "-d pcientb0"
pair ib_read_bw_across "ib_read_bw -s 65536 -n 100 -p 18521" "-d pcientb1" "-d pcientb0"
# The PCIe work per operation across the bridge (issue 13's numbers).
# The bridge's system calls meanwhile (posts, rings, moves; both ports): posts are stores
# into the mapped areas of the nodes across, none a system call.
bridge_calls() { cat /sys/kernel/debug/pcientb/*/bridge | awk '{p+=$2; r+=$4; m+=$6} END {print p, r, m}'; }
calls=$(bridge_calls)
say "verbs: pair work_across"
host "$(dirname "$CHECK")/pcientb-perf" --work --max-size 64K --device pcientb0 --peer-device pcientb1
say "verbs: bridge calls $calls $(bridge_calls)"
# Link down and up: port 1's device leaves the driver and comes back.
drv=/sys/bus/pci/drivers/pcientb-ivshmem
set -- /sys/kernel/debug/pcientb/*/
first=$(basename "$1"); second=$(basename "$2")
# The verbs device of an NTB port (its parent is the port's PCI device).
ib_of() {
  for d in /sys/class/infiniband/*; do
    case "$(readlink -f "$d/device")" in */"${1#ntb-}") basename "$d" ;; esac
  done
}
ib_first=$(ib_of "$first"); ib_second=$(ib_of "$second")
say "verbs devices $first=$ib_first $second=$ib_second"
# Until the device goes (rmmod: DEVICE_FATAL).
host $CHECK events "$ib_first" 16 180 /dev/pcientb-ready1 &
watch_first=$!
host $CHECK events "$ib_second" 3 120 /dev/pcientb-ready2 &
watch_second=$!
i=0
while { [ ! -e /dev/pcientb-ready1 ] || [ ! -e /dev/pcientb-ready2 ]; } && [ $i -lt 300 ]; do
  sleep 0.1; i=$((i + 1))
done
[ $i -lt 300 ] || say "verbs: FAIL the event watchers did not start within 30 s"
# pcientb-stat over the module's devices: each watcher's node and its region, and the
# other port's node across the bridge (listed without its objects).
say "verbs: stat"
host "$(dirname "$CHECK")/pcientb-stat" node

state() { cut -d" " -f1 /sys/kernel/debug/pcientb/$first/link; }
# Reports port 0's link once it is $2 (10 s at most: a TCG guest can be slow).
link() {
  i=0
  while [ "$(state)" != "$2" ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
  say "link $1 $(cat /sys/kernel/debug/pcientb/$first/link)"
}
link before up
# Port 0's bridge does not look while port 1's device goes and comes back, as when the
# peer's module is reloaded between two looks: port 0 must find the new bridge (its
# incarnation changed), not go on writing into the old inbox; the last "bridge ok" checks.
hold=/sys/kernel/debug/pcientb/$first/bridge_hold
echo 1 > $hold
echo "${second#ntb-}" > $drv/unbind
link "after unbind" down
wait $watch_second
echo "${second#ntb-}" > $drv/bind
link "after bind" up
echo 0 > $hold
say "selftest again $first"
show /sys/kernel/debug/pcientb/$first/selftest
# A peer that stops without a word (its host died): port 1's heartbeat stops, so port 0's
# link goes down and up while port 1's stays up. Meanwhile a node of port 0, masked, ends
# its mask while its link is down, and port 1's host must see that end once it is up.
beat=/sys/kernel/debug/pcientb-ivshmem/${second#ntb-}/heartbeat
flap=/dev/pcientb-flap
step() { i=0; while [ ! -e "$flap.$1" ] && [ $i -lt 900 ]; do sleep 0.1; i=$((i + 1)); done; }
host $CHECK mask-flap "$ib_first" "$ib_second" $flap &
check_flap=$!
step masked
echo 0 > $beat
link "after silence" down
touch $flap.down
step ended
echo 1 > $beat
link "after heartbeat" up
touch $flap.up
# Then a MASK(0) of port 0's that its bridge drops on the way, as a link blip would.
step remask
echo 1 > /sys/kernel/debug/pcientb/$first/drop_masks
touch $flap.dropped
wait $check_flap
host $CHECK devices 2
# With a context open on a device: rmmod does not wait for it.
if rmmod pcientb; then say "rmmod ok"; else say "rmmod failed"; fi
wait $watch_first
check_dmesg
say "done"
poweroff -f
"""

# The link as port 0 sees it: up; down once its peer's device left; up when it came back;
# down when the peer's heartbeat stopped; up when it beat again.
LINK_STEPS = ("before", "after unbind", "after bind", "after silence", "after heartbeat")
LINK_STATES = ["up", "down", "up", "down", "up"]
# What a program holding port 0's verbs device hears of those changes.
FIRST_EVENTS = ["PORT_ERR", "PORT_ACTIVE"] * 2


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
    verbs = [l[len("verbs: "):] for l in lines if l.startswith("verbs: ")]
    # (pcientb-stat lists a node across the bridge with "error Object is remote".)
    failed = [v for v in verbs if v.startswith("FAIL") or "warning" in v.lower()
              or "error" in v.lower() and not v.endswith(" error Object is remote")]
    if failed:
        problems.append("verbs: " + "; ".join(failed))
    # What each pair printed, after its "pair NAME" line.
    pairs, current = {}, None
    for v in verbs:
        if v.startswith("pair "):
            current = v.split()[1]
            pairs[current] = []
        elif current:
            pairs[current].append(v)
    # Each pair's result lines, on one port and across the bridge: both pingpong processes
    # moved 200 x 4 KiB each way, perftest's client and server printed 100 x 64 KiB, and
    # ib_send_lat its 200 x 64 B (on one side at least).
    pingpong, bw = r"1638400 bytes in [\d.]+ seconds", r"\s*65536\s+100\s+[\d.]+\s+[\d.]+"
    lat = r"\s*64\s+200\s+[\d.]+\s+[\d.]+"
    for name, line, ok in (("rc_pingpong", pingpong, {2}), ("ib_write_bw", bw, {2}),
                           ("ib_read_bw", bw, {2}), ("rc_pingpong_across", pingpong, {2}),
                           ("ib_send_lat_across", lat, {1, 2}),
                           ("ib_write_bw_across", bw, {2}), ("ib_read_bw_across", bw, {2})):
        got = [v for v in pairs.get(name, []) if re.match(line, v)]
        if len(got) not in ok:
            problems.append(f"pair {name}: {len(got)} result lines, expected {sorted(ok)}")
    # pcientb-perf --work across the bridge: a row per operation and size.
    rows = [v for v in pairs.get("work_across", [])
            if re.match(r"(WRITE|READ|SEND)\s+\d+ \w+(\s+[\d.]+){8}$", v)]
    if len(rows) != 9:
        problems.append(f"pcientb-perf --work across the bridge: {len(rows)} of 9 rows")
    # Its target polls: its doorbell is masked, a SEND rings it rarely (1.00 unmasked).
    rung = [float(v.split()[5]) for v in rows if v.startswith("SEND")]
    if len(rung) != 3 or max(rung) >= 0.9:
        problems.append(f"pcientb-perf --work across the bridge: a SEND rang {rung} doorbells "
                        "of a polling target (expected under 0.9; 1.00 unmasked)")
    calls = [v.split()[2:] for v in verbs if v.startswith("bridge calls ")]
    if len(calls) != 1 or len(calls[0]) != 6:
        problems.append(f"the bridge's system calls were not read: {calls}")
    else:
        posts, rings, moves = (int(b) - int(a) for a, b in zip(calls[0][:3], calls[0][3:]))
        if posts != 0 or rings <= 0 or moves <= 0:
            problems.append(f"pcientb-perf --work across the bridge made {posts} post, {rings} "
                            f"ring and {moves} move system calls (expected none, some, some)")
    for dev in ("pcientb0", "pcientb1"):
        nodes = [v for v in verbs if v.startswith(f"node kernel:{dev}/")]
        if not any(" alive yes " in v and v.endswith(" mrs 1 cqs 0 srqs 0") for v in nodes) or \
                not any(v.endswith(" error Object is remote") for v in nodes):
            problems.append(f"pcientb-stat on kernel:{dev}: {nodes}")
    if "mask flap ok" not in verbs:
        problems.append("a node's mask over a link flap seen by one side: no 'mask flap ok'")
    if "mask lost ok" not in verbs:
        problems.append("a MASK(0) write lost on its way: no 'mask lost ok'")
    if [v for v in verbs if v == "bridge ok"] != ["bridge ok", "bridge ok"]:
        problems.append("the nodes of the two ports did not reach each other, before and after")
    if [v for v in verbs if v.startswith("devices ")] != ["devices 2", "devices 2"]:
        problems.append("the verbs devices were not both checked, before and after")
    # ibv_devinfo itself lists both, bound to the provider (no warning above).
    hcas = sorted(v.split()[1] for v in verbs if v.startswith("hca_id:"))
    if len(hcas) != 2 or not all(h.startswith("pcientb") for h in hcas):
        problems.append(f"ibv_devinfo listed {hcas}: expected two pcientb devices")
    ib = re.search(r"^verbs devices ntb-\S+=(pcientb\d+) ntb-\S+=(pcientb\d+)$", "\n".join(lines),
                   re.M)
    if not ib:
        problems.append("no verbs device found for each NTB port")
    else:
        first, second = ib.groups()
        # Then the module goes (its link may go down first).
        # The provider's engine announces the port at open (PORT_ACTIVE), then passes on
        # the module's events.
        got = [v.split()[2] for v in verbs if v.startswith(f"event {first} ")]
        if got not in (["PORT_ACTIVE"] + FIRST_EVENTS + ["DEVICE_FATAL"],
                       ["PORT_ACTIVE"] + FIRST_EVENTS + ["PORT_ERR", "DEVICE_FATAL"]):
            problems.append(f"{first}'s async events {got}: expected {FIRST_EVENTS}, then "
                            "DEVICE_FATAL at rmmod")
        # Its link may go down before the device does.
        got = [v.split()[2] for v in verbs if v.startswith(f"event {second} ")]
        if got not in (["PORT_ACTIVE", "DEVICE_FATAL"], ["PORT_ACTIVE", "PORT_ERR", "DEVICE_FATAL"]):
            problems.append(f"{second}'s async events {got}: expected DEVICE_FATAL last, "
                            "after PORT_ERR at most")
        # Each watcher's region was unpinned when its device went.
        for dev in (first, second):
            if f"events {dev} region unpinned" not in verbs:
                problems.append(f"{dev}'s watcher did not see its region unpinned at DEVICE_FATAL")
    dmesg = [l for l in lines if l.startswith("dmesg:")]
    if dmesg:
        problems.append(f"{len(dmesg)} dmesg lines of warnings")
    return problems


def main():
    with guest.workspace(__doc__, INIT, "pcientb-kernel-") as w:
        ram = os.path.join(w.dir, "ram")
        # Both ports on one server; the window is the guest's own RAM.
        argv = guest.qemu_argv(w.kernel, w.image, ram, ram, [w.sock, w.sock], hostroot=True)
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
