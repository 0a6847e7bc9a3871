#!/usr/bin/env python3
"""rsockets over pcientb0 beside kernel TCP, with the same tool in the same run.

rstream (rdmacm-utils) runs its standard tests (64 B .. 1 MiB, latency and
bandwidth) once over rsockets on pcientb0 (rdma_cm from librdmacm_glue, under
pcientb-run) and once over kernel TCP loopback (`rstream -T s`), alternating
for --reps repetitions; the table gives medians and the ratio rsockets/TCP
(for usec/xfer lower is better, for Gb/s higher). Writes rsockets.csv in
OUTPUT_DIR.

usage: rsockets_compare.py [OUTPUT_DIR] [--reps N]
"""

import csv
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

ROW = re.compile(r"^(\S+)\s+\S+\s+\S+\s+\S+\s+\S+\s+[\d.]+s\s+([\d.]+)\s+([\d.]+)\s*$")


def launcher():
    for cand in (os.environ.get("PCIENTB_RUN"),
                 os.path.join(os.path.dirname(__file__), "..", "build", "bin", "pcientb-run"),
                 shutil.which("pcientb-run")):
        if cand and os.access(cand, os.X_OK):
            return os.path.abspath(cand)
    sys.exit("rsockets_compare: no pcientb-run (build first, or set PCIENTB_RUN)")


def run_pair(prefix, extra, port):
    """One rstream server/client pair; {test: (gbps, usec)} from the client."""
    server = subprocess.Popen(prefix + ["rstream", "-b", "127.0.0.1", "-p", str(port)] + extra,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(0.5)
    try:
        client = subprocess.run(prefix + ["rstream", "-s", "127.0.0.1", "-p", str(port)] + extra,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                timeout=120)
    finally:
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
    if client.returncode != 0:
        sys.exit(f"rstream {' '.join(extra)} failed:\n{client.stdout}")
    rows = {}
    for line in client.stdout.splitlines():
        m = ROW.match(line)
        if m:
            rows[m.group(1)] = (float(m.group(2)), float(m.group(3)))
    if not rows:
        sys.exit(f"rstream printed no results:\n{client.stdout}")
    return rows


def main():
    args = sys.argv[1:]
    reps = 3
    if "--reps" in args:
        i = args.index("--reps")
        reps = int(args[i + 1])
        del args[i:i + 2]
    out_dir = args[0] if args else "results/rsockets"
    os.makedirs(out_dir, exist_ok=True)
    if not shutil.which("rstream"):
        sys.exit("rsockets_compare: rstream not found (apt-get install rdmacm-utils)")
    run = launcher()
    os.environ.setdefault("PCIENTB_FABRIC", f"rsockets_compare_{os.getpid()}")
    samples = {"rsockets": {}, "tcp": {}}
    port = 7000 + os.getpid() % 1000
    for rep in range(reps):
        for kind in ("rsockets", "tcp"):  # alternated: the machine's noise hits both
            port += 1
            rows = (run_pair([run, "--"], [], port) if kind == "rsockets"
                    else run_pair([], ["-T", "s"], port))
            for test, value in rows.items():
                samples[kind].setdefault(test, []).append(value)
    tests = [t for t in samples["rsockets"] if t in samples["tcp"]]
    lines = []
    header = f"{'test':<8} {'rsockets':>22} {'kernel TCP':>22} {'ratio':>8}"
    lines.append(header)
    with open(os.path.join(out_dir, "rsockets.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["test", "metric", "rsockets", "tcp", "ratio"])
        for t in tests:
            lat = t.endswith("_lat")
            idx, unit = (1, "us/xfer") if lat else (0, "Gb/s")
            r = statistics.median(v[idx] for v in samples["rsockets"][t])
            k = statistics.median(v[idx] for v in samples["tcp"][t])
            ratio = r / k if k else float("nan")
            lines.append(f"{t:<8} {r:>14.2f} {unit:<7} {k:>14.2f} {unit:<7} {ratio:>7.2f}x")
            w.writerow([t, unit, r, k, f"{ratio:.3f}"])
    print(f"rstream, medians of {reps} alternating runs (ratio = rsockets / kernel TCP; "
          "us/xfer: lower is better, Gb/s: higher is better)")
    print("\n".join(lines))
    print(f"CSV: {os.path.join(out_dir, 'rsockets.csv')}")


if __name__ == "__main__":
    main()
