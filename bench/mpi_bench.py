#!/usr/bin/env python3
"""Tables, ratios and a plot of scripts/mpi-bench.sh's NetPIPE runs (Open MPI over UCX):
pcientb0 against UCX shared memory (sm) and TCP loopback (tcp), all measured in the same run.

usage: mpi_bench.py OUTDIR
  reads   OUTDIR/np-{pcientb,sm,tcp}.<run>.out (NetPIPE -o: bytes, Mbps, one-way seconds;
          with several runs each size keeps its best), OUTDIR/pcientb-stats.txt
  writes  OUTDIR/mpi-bench.csv, OUTDIR/mpi-bench.png; prints the table and the summary
Latency is NetPIPE's one-way time (half the round trip); bandwidth is in MB/s (10^6 B/s).
"""
import csv
import glob
import math
import os
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plot import size_axis, size_label  # noqa: E402

PATHS = (("pcientb", "pcientb0 (rc_verbs)", "o"), ("sm", "UCX shared memory", "s"),
         ("tcp", "TCP loopback", "^"))
LAT_TARGET_SIZE, LAT_TARGET = 8, 1.2  # 8-byte latency <= 1.2x shared memory
BW_TARGET_FROM, BW_TARGET = 64 << 10, 1.0  # bandwidth >= 1.0x shared memory from 64 KiB


def read_runs(outdir, path):
    """{size: (best one-way us, best MB/s)} over every run of `path`."""
    files = sorted(glob.glob(os.path.join(outdir, f"np-{path}.*.out")))
    if not files:
        sys.exit(f"mpi_bench.py: no {outdir}/np-{path}.*.out")
    best = {}
    for name in files:
        with open(name) as f:
            for line in f:
                words = line.split()
                if len(words) < 3:
                    continue
                size, mbps, sec = int(words[0]), float(words[1]), float(words[2])
                lat, bw = sec * 1e6, mbps / 8  # Mbps = 10^6 bit/s
                old = best.get(size)
                best[size] = (lat, bw) if old is None else (min(old[0], lat), max(old[1], bw))
    return best


def stats_totals(outdir):
    path = os.path.join(outdir, "pcientb-stats.txt")
    if not os.path.exists(path):
        return None
    totals = {}
    with open(path) as f:
        for line in f:
            for key, value in re.findall(r"(\w+)=(\d+)", line):
                if key not in ("pid", "lid"):
                    totals[key] = totals.get(key, 0) + int(value)
    return totals


def main(argv):
    if len(argv) != 2:
        sys.exit(__doc__.strip())
    outdir = argv[1]
    data = {p: read_runs(outdir, p) for p, _, _ in PATHS}
    sizes = sorted(set.intersection(*(set(d) for d in data.values())))
    if not sizes:
        sys.exit("mpi_bench.py: the three runs have no message size in common")

    rows = []
    for s in sizes:
        r = {"size_bytes": s}
        for p, _, _ in PATHS:
            r[f"{p}_lat_us"], r[f"{p}_MBps"] = data[p][s]
        for ref in ("sm", "tcp"):
            r[f"lat_pcientb_x_{ref}"] = r["pcientb_lat_us"] / r[f"{ref}_lat_us"]
            r[f"bw_pcientb_x_{ref}"] = r["pcientb_MBps"] / r[f"{ref}_MBps"]
        rows.append(r)
    with open(os.path.join(outdir, "mpi-bench.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})

    print("NetPIPE (NPopenmpi) over Open MPI + UCX, 2 ranks; latency = one-way us, "
          "bandwidth = MB/s; ratio = pcientb / other")
    print(f"{'size':>9} | {'lat pcientb':>11} {'sm':>8} {'tcp':>8} {'x sm':>6} {'x tcp':>6} | "
          f"{'BW pcientb':>10} {'sm':>9} {'tcp':>9} {'x sm':>6} {'x tcp':>6}")
    for r in rows:
        print(f"{size_label(r['size_bytes']):>9} | {r['pcientb_lat_us']:11.3f} "
              f"{r['sm_lat_us']:8.3f} {r['tcp_lat_us']:8.3f} {r['lat_pcientb_x_sm']:6.2f} "
              f"{r['lat_pcientb_x_tcp']:6.2f} | {r['pcientb_MBps']:10.1f} {r['sm_MBps']:9.1f} "
              f"{r['tcp_MBps']:9.1f} {r['bw_pcientb_x_sm']:6.2f} {r['bw_pcientb_x_tcp']:6.2f}")

    # --- Summary against the targets ---------------------------------------------------
    print("\nSummary (targets: 8-byte latency <= 1.2x UCX shared memory; bandwidth >= 1.0x "
          "UCX shared memory at every size >= 64 KiB)")
    small = next((r for r in rows if r["size_bytes"] == LAT_TARGET_SIZE), None)
    met = 0
    if small is None:
        print(f"  latency: no {LAT_TARGET_SIZE}-byte point")
    else:
        ok = small["lat_pcientb_x_sm"] <= LAT_TARGET
        met += ok
        print(f"  8-byte latency: pcientb {small['pcientb_lat_us']:.3f} us, sm "
              f"{small['sm_lat_us']:.3f} us, tcp {small['tcp_lat_us']:.3f} us -> "
              f"{small['lat_pcientb_x_sm']:.2f}x sm (target <= {LAT_TARGET}x): "
              f"{'MET' if ok else 'NOT MET'}; {small['lat_pcientb_x_tcp']:.2f}x tcp")
    big = [r for r in rows if r["size_bytes"] >= BW_TARGET_FROM]
    if big:
        worst = min(big, key=lambda r: r["bw_pcientb_x_sm"])
        below = [size_label(r["size_bytes"]) for r in big if r["bw_pcientb_x_sm"] < BW_TARGET]
        ok = not below
        met += ok
        print(f"  bandwidth >= 64 KiB: pcientb/sm from {worst['bw_pcientb_x_sm']:.2f}x (at "
              f"{size_label(worst['size_bytes'])}) to "
              f"{max(r['bw_pcientb_x_sm'] for r in big):.2f}x (target >= {BW_TARGET}x at every "
              f"size): {'MET' if ok else 'NOT MET, below at ' + ', '.join(below)}")
        at4m = big[-1]
        print(f"  at {size_label(at4m['size_bytes'])}: pcientb {at4m['pcientb_MBps']:.0f} MB/s, "
              f"sm {at4m['sm_MBps']:.0f} MB/s, tcp {at4m['tcp_MBps']:.0f} MB/s "
              f"({at4m['bw_pcientb_x_tcp']:.1f}x tcp)")
    print(f"  targets met: {met} of 2")
    totals = stats_totals(outdir)
    if totals:
        payload = sum(totals.get(f"{k}_bytes", 0) for k in ("send", "write", "read"))
        print(f"  pcientb0 traffic (PCIENTB_STATS, both ranks): {payload / 1e9:.2f} GB posted "
              f"(send {totals.get('send_bytes', 0)}, write {totals.get('write_bytes', 0)}, "
              f"read {totals.get('read_bytes', 0)} bytes), errors {totals.get('errors', 0)}")
    else:
        print("  pcientb0 traffic: no pcientb-stats lines (provider without PCIENTB_STATS?)")

    # --- Plot ---------------------------------------------------------------------------
    fig, (bw, lat, ratio) = plt.subplots(1, 3, figsize=(19, 5.8))
    ticks = [s for s in sizes if s & (s - 1) == 0]  # powers of 2 (NetPIPE adds 1.5x sizes)
    for p, label, marker in PATHS:
        bw.plot(sizes, [data[p][s][1] for s in sizes], marker=marker, ms=3.5, label=label)
        lat.plot(sizes, [data[p][s][0] for s in sizes], marker=marker, ms=3.5, label=label)
    bw.set_yscale("log")
    bw.set_ylabel("bandwidth (MB/s, 10^6 B/s)")
    last = rows[-1]
    bw.set_title(f"Bandwidth; at {size_label(last['size_bytes'])}: pcientb "
                 f"{last['pcientb_MBps'] / 1000:.1f} GB/s = {last['bw_pcientb_x_sm']:.2f}x sm, "
                 f"{last['bw_pcientb_x_tcp']:.1f}x tcp", fontsize=10)
    size_axis(bw, ticks)
    bw.legend(fontsize=9)
    lat.set_yscale("log")
    lat.set_ylabel("one-way latency (us)")
    title = "Latency"
    if small:
        title += (f"; at 8 B: pcientb {small['pcientb_lat_us']:.2f} us = "
                  f"{small['lat_pcientb_x_sm']:.2f}x sm, {small['lat_pcientb_x_tcp']:.2f}x tcp")
    lat.set_title(title, fontsize=10)
    size_axis(lat, ticks)
    lat.legend(fontsize=9)

    ratio.plot(sizes, [r["bw_pcientb_x_sm"] for r in rows], marker="o", ms=3.5,
               label="bandwidth pcientb / sm")
    ratio.plot(sizes, [r["lat_pcientb_x_sm"] for r in rows], marker="s", ms=3.5,
               label="latency pcientb / sm")
    ratio.axhline(1.0, color="0.6", lw=0.6)
    ratio.plot([BW_TARGET_FROM, sizes[-1]], [BW_TARGET, BW_TARGET], "g--", lw=2.5,
               label="target: bandwidth >= 1.0x sm from 64 KiB")
    ratio.plot([LAT_TARGET_SIZE], [LAT_TARGET], "rv", ms=9, label="target: 8 B latency <= 1.2x sm")
    ratio.set_yscale("log", base=2)
    lo = min(min(r["bw_pcientb_x_sm"], r["lat_pcientb_x_sm"]) for r in rows)
    hi = max(max(r["bw_pcientb_x_sm"], r["lat_pcientb_x_sm"]) for r in rows)
    ratio.set_ylim(2 ** math.floor(math.log2(min(lo, 0.5))), 2 ** math.ceil(math.log2(max(hi, 2))))
    ratio.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ratio.set_ylabel("pcientb0 / UCX shared memory")
    ratio.set_title("Ratios against shared memory (same run)", fontsize=10)
    size_axis(ratio, ticks)
    ratio.legend(fontsize=8)

    fig.suptitle("MPI (Open MPI 4.1 + UCX 1.13) ping-pong over pcientb0, beside UCX shared "
                 "memory and TCP loopback, 2 ranks on one host")
    fig.tight_layout()
    png = os.path.join(outdir, "mpi-bench.png")
    fig.savefig(png, dpi=100)
    print(f"\nmpi_bench.py: wrote {os.path.join(outdir, 'mpi-bench.csv')} and {png}")


if __name__ == "__main__":
    main(sys.argv)
