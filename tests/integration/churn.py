#!/usr/bin/env python3
"""Connect/close churn against an echo server, for integration.sdp.churn (sdp.py).

  churn.py PORT CYCLES SERVER_PID IDLE

Opens, uses (a 64-byte echo, checked) and closes CYCLES connections one after another.
After a tenth of them (the pools and caches of the layer are warm by then) and at the end
it samples its own and the server's descriptors, mappings and resident memory from /proc.
Then it opens IDLE connections, echoes once on each, and leaves them idle for 2 s, during
which it measures the CPU time both processes use (utime + stime). It prints
"churn-result {json}" with the samples, the connections made, the seconds they took and
the idle CPU (a fraction of one core). The checks are the caller's.
"""

import json
import os
import re
import socket
import struct
import subprocess
import sys
import time

# A connection that stalls fails with its number (the layer honours SO_RCVTIMEO) instead of
# running into the test's time limit silently.
STALL_S = 30


def sample(pid):
    with open(f"/proc/{pid}/status") as f:
        rss = int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))
    with open(f"/proc/{pid}/maps") as f:
        maps = sum(1 for _ in f)
    kinds = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            kind = re.sub(r"[0-9]+", "N", os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
        kinds[kind] = kinds.get(kind, 0) + 1
    return {"fds": sum(kinds.values()), "maps": maps, "rss_kib": rss, "fd_kinds": kinds}


# What may grow for good after the first tenth (sdp.py case_churn checks the same): the layer's
# pool of 16 closed connections' buffer sets (3 memfds each) and CQ groups (a pipe each: 2
# descriptors).
POOL_KINDS = {"/memfd:pcientb-mr-N (deleted)": 16 * 3, "pipe:[N]": 8}


def settled(warm, now):
    """Whether `now` holds nothing beyond `warm` but what POOL_KINDS allows."""
    return all(n <= warm["fd_kinds"].get(k, 0) + POOL_KINDS.get(k, 0)
               for k, n in now["fd_kinds"].items())


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def echo(s, msg, what):
    s.sendall(msg)
    got = b""
    while len(got) < len(msg):
        chunk = s.recv(len(msg) - len(got))
        if not chunk:
            raise RuntimeError(f"{what}: EOF after {len(got)} bytes")
        got += chunk
    if got != msg:
        raise RuntimeError(f"{what}: echo differs")


def stall_report(server):
    """What the fabric shows of both processes' QPs and CQs while a connection stalls
    (pcientb-stat, when the caller names it in PCIENTB_STAT), and the server's descriptors
    with what its epoll sets watch: a CQ entry nobody polls beside an unarmed CQ, or a
    completion channel missing from the set, says which wakeup was lost."""
    stat = os.environ.get("PCIENTB_STAT")
    if not stat:
        return
    for pid in (os.getpid(), server):
        for obj in ("qp", "cq", "counters"):
            p = subprocess.run([stat, obj, "--pid", str(pid)], capture_output=True, text=True,
                               timeout=30)
            print(f"stall: pcientb-stat {obj} --pid {pid}:\n{p.stdout}{p.stderr}", flush=True)
    # The server's descriptors and what its epoll sets watch (tfd: descriptor, data: tag).
    for fd in sorted(os.listdir(f"/proc/{server}/fd"), key=int):
        try:
            what = os.readlink(f"/proc/{server}/fd/{fd}")
            info = open(f"/proc/{server}/fdinfo/{fd}").read() if "eventpoll" in what else ""
        except OSError:
            continue
        print(f"stall: server fd {fd} -> {what}\n{info}", flush=True)


def main():
    if len(sys.argv) != 5:
        print(__doc__)
        sys.exit(2)
    port, cycles, server, idle = map(int, sys.argv[1:5])
    msg = bytes(range(64))
    warm = max(1, cycles // 10)
    samples = {}
    start = time.monotonic()
    for i in range(cycles):
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", STALL_S, 0))
            try:
                echo(s, msg, f"connection {i}")
            except OSError as e:
                stall_report(server)
                raise RuntimeError(f"connection {i} (local port {s.getsockname()[1]}): no echo "
                                   f"within {STALL_S} s ({e})") from None
        if (i + 1) % 1000 == 0:
            print(f"churn: {i + 1} connections, {time.monotonic() - start:.1f} s", flush=True)
        if i + 1 == warm:
            time.sleep(0.2)  # the server's side of the last connection closes too
            samples["warm"] = {"client": sample(os.getpid()), "server": sample(server)}
    seconds = time.monotonic() - start
    # The last connections end late on a loaded machine (the server closes its end as it sees
    # the client's close; a side whose data the peer has not read yet lingers): wait (20 s at
    # most) until neither process holds more than the caller allows to grow (POOL_KINDS).
    deadline = time.monotonic() + 20
    while (not (settled(samples["warm"]["client"], sample(os.getpid()))
                and settled(samples["warm"]["server"], sample(server)))
           and time.monotonic() < deadline):
        time.sleep(0.05)
    samples["end"] = {"client": sample(os.getpid()), "server": sample(server)}
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(idle)]
    for i, s in enumerate(held):
        echo(s, msg, f"idle connection {i}")
    time.sleep(0.2)  # past the layer's busy-poll
    before = (time.monotonic(), cpu_seconds(os.getpid()), cpu_seconds(server))
    time.sleep(2)
    after = (time.monotonic(), cpu_seconds(os.getpid()), cpu_seconds(server))
    wall = after[0] - before[0]
    idle_cpu = {"client": (after[1] - before[1]) / wall, "server": (after[2] - before[2]) / wall}
    for s in held:
        s.close()
    print("churn-result " + json.dumps({"conns": cycles + idle, "warm_after": warm,
                                        "seconds": seconds, "tx": (cycles + idle) * len(msg),
                                        "samples": samples, "idle": idle,
                                        "idle_cpu": idle_cpu}),
          flush=True)


if __name__ == "__main__":
    main()
