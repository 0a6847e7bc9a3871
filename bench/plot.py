#!/usr/bin/env python3
"""Plot pcientb-perf's CSV: bandwidth against message size beside memcpy, and latency beside
the shared-memory ping-pong, both references from the same run. With `sdp`, plot
bench/sdp_bench.py's results instead: SDP against kernel TCP (stream throughput, ping-pong
latency) and BCopy against ZCopy, into OUT_DIR/sdp-{stream,latency,zcopy}.png.

usage: plot.py RESULTS.csv OUT.png
       plot.py sdp SDP-BENCH.json OUT_DIR
"""
import csv
import json
import math
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator  # noqa: E402


def size_label(n, _pos=None):
    n = int(round(n))
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def read_rows(path):
    with open(path, newline="") as f:
        rows = [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]
    if not rows:
        sys.exit(f"plot.py: {path} has no rows")
    return rows


def size_axis(ax, sizes):
    ax.set_xscale("log", base=2)
    ticks = [s for s in sizes if int(math.log2(s)) % 2 == 0] or sizes
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(FuncFormatter(size_label))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.tick_params(axis="x", labelrotation=45)
    ax.set_xlabel("message size")
    ax.grid(True, which="major", alpha=0.3)


def main(argv):
    if len(argv) == 4 and argv[1] == "sdp":
        return plot_sdp(argv[2], argv[3])
    if len(argv) != 3:
        sys.exit(__doc__.strip())
    rows = read_rows(argv[1])
    sizes = [r["size_bytes"] for r in rows]
    col = lambda name: [r[name] for r in rows]  # noqa: E731
    big = rows[-1]

    fig, (bw, lat) = plt.subplots(1, 2, figsize=(14, 5.5))

    bw.plot(sizes, col("memcpy_MBps"), "k--", label="memcpy (reference)")
    series = (("write", "RDMA WRITE", "o"), ("read", "RDMA READ", "s"), ("send", "SEND", "^"))
    for name, label, marker in series:
        bw.plot(sizes, col(f"{name}_MBps"), marker=marker, ms=4, label=label)
    bw.set_yscale("log")
    bw.set_ylabel("bandwidth (MB/s, 10^6 B/s)")
    bw.set_title(
        f"Bandwidth; at {size_label(big['size_bytes'])}: WRITE {big['write_x_memcpy']:.2f}x, "
        f"READ {big['read_x_memcpy']:.2f}x, SEND {big['send_x_memcpy']:.2f}x memcpy",
        fontsize=10,
    )
    size_axis(bw, sizes)
    bw.legend()

    lat.plot(sizes, col("pingpong_half_rtt_us"), "k--",
             label="shared-memory ping-pong half RTT (reference)")
    lat.plot(sizes, col("write_lat_us"), marker="o", ms=4,
             label="RDMA WRITE one-way (ib_write_lat)")
    lat.plot(sizes, col("read_lat_us"), marker="s", ms=4, label="RDMA READ (ib_read_lat)")
    lat.plot(sizes, col("send_lat_us"), marker="^", ms=4, label="SEND one-way (ib_send_lat)")
    lat.set_yscale("log")
    lat.set_ylabel("latency (us)")
    small = next((r for r in rows if r["size_bytes"] == 8), None)
    title = "Latency"
    if small:
        title += (
            f"; at 8 B: SEND {small['send_lat_x_pingpong']:.1f}x, "
            f"WRITE {small['write_lat_x_pingpong']:.1f}x ping-pong"
        )
    lat.set_title(title, fontsize=10)
    size_axis(lat, sizes)
    lat.legend(fontsize=8)

    fig.suptitle("pcientb0 over the emulated NTB fabric, two processes "
                 "(references from the same run)")
    fig.tight_layout()
    fig.savefig(argv[2], dpi=110)
    print(f"plot.py: wrote {argv[2]}")


# --- sdp_bench.py's results ------------------------------------------------------------------

SDP_STYLE = {"sdp": ("SDP (pcientb-sdp)", "tab:blue", "o"),
             "tcp": ("kernel TCP loopback", "tab:gray", "s")}


def _series(rows, key):
    """(sizes, values) of the rows that have `key`; None values are left out."""
    pts = [(r["size"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def _target_line(ax, xs, y, label):
    ax.plot(xs, [y] * len(xs), color="tab:red", ls=":", lw=1.5, label=label)


def _ratio_labels(ax, xs, ys, good):
    for x, y in zip(xs, ys):
        ax.annotate(f"{y:.2g}x", (x, y), textcoords="offset points", xytext=(0, 5), ha="center",
                    fontsize=7, color="green" if good(x, y) else "red")


def _sdp_stream(res, title, path):
    rows = res["stream"]
    sizes = [r["size"] for r in rows]
    fig, (bw, rat, cpu) = plt.subplots(1, 3, figsize=(18, 5.5))
    for leg, (label, color, marker) in SDP_STYLE.items():
        bw.plot(*_series(rows, f"{leg}_MBps"), marker=marker, ms=4, color=color, label=label)
        cpu.plot(*_series(rows, f"{leg}_cpu_s_per_GB"), marker=marker, ms=4, color=color,
                 label=label)
    bw.set_yscale("log")
    bw.set_ylabel("throughput (MB/s, 10^6 B/s), higher is better")
    bw.set_title("Stream throughput, one connection, blocking send()", fontsize=10)
    cpu.set_yscale("log")
    cpu.set_ylabel("CPU s/GB (client + server), lower is better")
    cpu.set_title("CPU per byte", fontsize=10)
    xs, ys = _series(rows, "ratio")
    rat.plot(xs, ys, marker="o", ms=4, color="tab:blue", label="SDP / TCP")
    big = [s for s in sizes if s >= 64 << 10]
    if big:
        _target_line(rat, big, 3, "target >= 3x (>= 64 KiB)")
    if 1 in sizes:
        rat.plot([1], [20], marker="v", ms=8, color="tab:red", ls="none",
                 label="target >= 20x (1 B)")
    _ratio_labels(rat, xs, ys, lambda x, y: y >= (20 if x == 1 else 3 if x >= 64 << 10 else 0))
    rat.set_yscale("log")
    rat.set_ylabel("SDP / TCP throughput")
    rat.set_title("Ratio, SDP / kernel TCP (same run)", fontsize=10)
    for ax in (bw, rat, cpu):
        size_axis(ax, sizes)
        ax.set_xlabel("write size")
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _sdp_latency(res, title, path):
    rows = res["latency"]
    sizes = [r["size"] for r in rows]
    fig, (lat, rat) = plt.subplots(1, 2, figsize=(14, 5.5))
    for leg, (label, color, marker) in SDP_STYLE.items():
        lat.plot(*_series(rows, f"{leg}_us"), marker=marker, ms=4, color=color,
                 label=f"{label}, median")
        lat.plot(*_series(rows, f"{leg}_p99_us"), ls="--", lw=1, color=color,
                 label=f"{label}, p99")
    if res.get("shm_half_rtt_us"):
        lat.plot(sizes, [res["shm_half_rtt_us"]] * len(sizes), "k--",
                 label="shared-memory ping-pong half RTT (reference)")
    lat.set_yscale("log")
    lat.set_ylabel("one-way latency (us, RTT/2), lower is better")
    lat.set_title("Ping-pong latency, one connection", fontsize=10)
    xs, ys = _series(rows, "ratio")
    rat.plot(xs, ys, marker="o", ms=4, color="tab:blue", label="SDP / TCP")
    if 64 in sizes:
        rat.plot([64], [0.1], marker="^", ms=8, color="tab:red", ls="none",
                 label="target <= 0.1x (64 B)")
    _ratio_labels(rat, xs, ys, lambda x, y: x != 64 or y <= 0.1)
    rat.set_yscale("log")
    rat.set_ylabel("SDP / TCP latency")
    rat.set_title("Ratio, SDP / kernel TCP (same run)", fontsize=10)
    for ax in (lat, rat):
        size_axis(ax, sizes)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _sdp_zcopy(res, title, path):
    rows = res["zcopy"]
    conns = sorted({r["conns"] for r in rows})
    sizes = sorted({r["size"] for r in rows})
    colors = dict(zip(conns, ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown")))
    fig, (bw, cpu, rat) = plt.subplots(1, 3, figsize=(20, 6))
    memcpy = {int(k): v for k, v in res.get("memcpy_MBps", {}).items() if int(k) in sizes}
    if memcpy:
        bw.plot(sorted(memcpy), [memcpy[s] for s in sorted(memcpy)], "k--",
                label="memcpy (reference)")
    if memcpy.get(4 << 20):
        bw.plot([4 << 20], [0.7 * memcpy[4 << 20]], marker="v", ms=8, color="tab:red", ls="none",
                label="target: ZCopy 1 conn >= 0.7x memcpy")
    for n in conns:
        these = [r for r in rows if r["conns"] == n]
        c = colors.get(n)
        for leg, ls, marker in (("bcopy", "-", "o"), ("zcopy", "--", "s")):
            name = f"{'BCopy' if leg == 'bcopy' else 'ZCopy'}, {n} conn"
            bw.plot(*_series(these, f"{leg}_MBps"), ls=ls, marker=marker, ms=4, color=c,
                    label=name)
            cpu.plot(*_series(these, f"{leg}_cpu_s_per_GB"), ls=ls, marker=marker, ms=4,
                     color=c, label=name)
        rat.plot(*_series(these, "bw_ratio"), ls="-", marker="o", ms=4, color=c,
                 label=f"bandwidth, {n} conn")
        rat.plot(*_series(these, "cpu_ratio"), ls="--", marker="s", ms=4, color=c,
                 label=f"CPU s/GB, {n} conn")
        cross = res.get("crossover", {}).get(str(n)) or res.get("crossover", {}).get(n)
        at = cross and (cross.get("estimate") or cross.get("size"))
        if at:
            bw.axvline(at, color=c, ls=":", lw=1)
    bw.set_yscale("log")
    bw.set_ylabel("throughput (MB/s, 10^6 B/s), higher is better")
    bw.set_title("BCopy (threshold 0) against ZCopy (threshold 1); dotted: crossover",
                 fontsize=10)
    cpu.set_yscale("log")
    cpu.set_ylabel("CPU s/GB (client + server), lower is better")
    z8 = next((r for r in rows if r["conns"] == 8 and r["size"] == 4 << 20), None)
    sub = (f"; at 8 conns, 4 MiB: ZCopy/BCopy {z8['cpu_ratio']:.2f}x (target <= 0.3x)"
           if z8 and z8.get("cpu_ratio") is not None else "")
    cpu.set_title("CPU per byte" + sub, fontsize=10)
    rat.axhline(1, color="k", lw=0.8)
    if 8 in conns:
        rat.plot([4 << 20], [0.3], marker="^", ms=8, color="tab:red", ls="none",
                 label="target: CPU <= 0.3x at 8 conns")
    rat.set_yscale("log")
    rat.set_ylabel("ZCopy / BCopy")
    rat.set_title("Ratios, ZCopy / BCopy (bandwidth: above 1 ZCopy wins; CPU: below 1)",
                  fontsize=10)
    for ax in (bw, cpu, rat):
        size_axis(ax, sizes)
        ax.set_xlabel("write size")
        ax.legend(fontsize=7, ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_sdp(results, out_dir):
    with open(results) as f:
        doc = json.load(f)
    res, meta = doc["summary"], doc["meta"]
    what = ("DRY RUN, both legs kernel TCP: " if meta.get("no_sdp") else "")
    title = (f"{what}sockbench, two processes on one host; medians of {meta['reps']} "
             f"alternating repetition(s){' (--quick)' if meta.get('quick') else ''}, "
             f"{meta['date']}")
    done = []
    for key, fn, name in (("stream", _sdp_stream, "sdp-stream.png"),
                          ("latency", _sdp_latency, "sdp-latency.png"),
                          ("zcopy", _sdp_zcopy, "sdp-zcopy.png")):
        if res.get(key):
            fn(res, title, os.path.join(out_dir, name))
            done.append(os.path.join(out_dir, name))
    print(f"plot.py: wrote {', '.join(done) if done else 'nothing (no results)'}")


if __name__ == "__main__":
    main(sys.argv)
