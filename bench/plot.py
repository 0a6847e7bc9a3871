#!/usr/bin/env python3
"""Plot pcientb-perf's CSV: bandwidth against message size beside memcpy, and latency beside
the shared-memory ping-pong, both references from the same run.

usage: plot.py RESULTS.csv OUT.png
"""
import csv
import math
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


if __name__ == "__main__":
    main(sys.argv)
