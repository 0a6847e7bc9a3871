#!/usr/bin/env python3
"""rsockets and our socket layer over pcientb0 beside kernel TCP, with the same tool
in the same run.

rstream (rdmacm-utils) runs its standard tests (64 B .. 1 MiB, latency and
bandwidth) over rsockets on pcientb0 (rdma_cm from librdmacm_glue, under
pcientb-run), over plain sockets (`rstream -T s`) under pcientb-sdp (the SDP
socket layer; its --stats lines must show every connection on SDP), and over
kernel TCP loopback (`rstream -T s`), alternating for --reps repetitions; the
table gives medians and the ratios to TCP (for usec/xfer lower is better, for
Gb/s higher). Writes rsockets.csv in OUTPUT_DIR.

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


def launcher(name, var):
    for cand in (os.environ.get(var),
                 os.path.join(os.path.dirname(__file__), "..", "build", "bin", name),
                 shutil.which(name)):
        if cand and os.access(cand, os.X_OK):
            return os.path.abspath(cand)
    sys.exit(f"rsockets_compare: no {name} (build first, or set {var})")


def check_sdp(stats_path):
    """Every connection of the SDP leg went over SDP (the layer's total lines)."""
    with open(stats_path) as f:
        totals = [line for line in f if line.startswith("total ")]
    os.unlink(stats_path)
    if not totals or any(" tcp=0 " not in t or " sdp=0 " in t for t in totals):
        sys.exit("rsockets_compare: the SDP leg did not run on SDP:\n" + "".join(totals))


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
    run = launcher("pcientb-run", "PCIENTB_RUN")
    sdp = launcher("pcientb-sdp", "PCIENTB_SDP")
    os.environ.setdefault("PCIENTB_FABRIC", f"rsockets_compare_{os.getpid()}")
    kinds = ("rsockets", "sdp", "tcp")
    samples = {k: {} for k in kinds}
    port = 7000 + os.getpid() % 1000
    stats = os.path.join(out_dir, f".sdp-stats-{os.getpid()}")
    for rep in range(reps):
        for kind in kinds:  # alternated: the machine's noise hits all of them
            port += 1
            if kind == "rsockets":
                rows = run_pair([run, "--"], [], port)
            elif kind == "sdp":
                rows = run_pair([sdp, "--stats", stats, "--"], ["-T", "s"], port)
                check_sdp(stats)
            else:
                rows = run_pair([], ["-T", "s"], port)
            for test, value in rows.items():
                samples[kind].setdefault(test, []).append(value)
    tests = [t for t in samples["rsockets"] if all(t in samples[k] for k in kinds)]
    lines = [f"{'test':<8} {'rsockets':>18} {'SDP':>18} {'kernel TCP':>18} "
             f"{'rsockets/TCP':>13} {'SDP/TCP':>8}"]
    with open(os.path.join(out_dir, "rsockets.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["test", "metric", "rsockets", "sdp", "tcp", "rsockets_ratio", "sdp_ratio"])
        for t in tests:
            lat = t.endswith("_lat")
            idx, unit = (1, "us/xfer") if lat else (0, "Gb/s")
            r, d, k = (statistics.median(v[idx] for v in samples[kind][t]) for kind in kinds)
            rr, dr = (x / k if k else float("nan") for x in (r, d))
            lines.append(f"{t:<8} {r:>10.2f} {unit:<7} {d:>10.2f} {unit:<7} {k:>10.2f} {unit:<7} "
                         f"{rr:>12.2f}x {dr:>7.2f}x")
            w.writerow([t, unit, r, d, k, f"{rr:.3f}", f"{dr:.3f}"])
    print(f"rstream, medians of {reps} alternating runs (ratios to kernel TCP; "
          "us/xfer: lower is better, Gb/s: higher is better)")
    print("\n".join(lines))
    print(f"CSV: {os.path.join(out_dir, 'rsockets.csv')}")


if __name__ == "__main__":
    main()
