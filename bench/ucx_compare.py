#!/usr/bin/env python3
"""pcientb0 against UCX's shared-memory transport (posix), measured in the same run.

usage: ucx_compare.py [OUTPUT_DIR] [--reps N] [--quick]
  OUTPUT_DIR  default ./results/ucx; receives ucx-compare.md (the table and the summary, also
              printed), ucx-compare.csv (medians, ratios and every repetition's figure),
              ucx-compare.png (the plot; skipped with a message without matplotlib) and
              ucx-compare.log (every command line and, for a failed run, both outputs)
  --reps N    repetitions of every measurement (default 5; --quick: 1); each figure is the
              median over them
  --quick     a short smoke run: one repetition, a tenth of the iterations

Three tests at 8 B, 64 KiB and 4 MiB, each run by three programs, two processes each:

  test     UCX posix (reference)             pcientb0, perftest   pcientb0, ucx_perftest
  put_lat  ucx_perftest -x posix -d memory   ib_write_lat         -x rc_verbs -d pcientb0:1
  am_lat   (same)                            ib_send_lat          (same)
  put_bw   (same)                            ib_write_bw          (same)

UCT active messages stop at 8 KiB on both transports (am_bcopy), so am_lat above that is UCP's
ucp_am_lat, with UCX_TLS=posix,self against UCX_TLS=rc_v. UCT put uses the short layout on
posix (a store into the mapped peer segment, any size) and zcopy above 64 B on rc_verbs (its
put_short limit). The three programs of one test and size run one after the other, and the
whole set is repeated --reps times, so that the reference and pcientb0 alternate and share
this VM's fast and slow spells. pcientb0 programs run under pcientb-run ($PCIENTB_RUN, else
build/bin/pcientb-run, else pcientb-run on PATH) on a fabric of their own; the reference runs
without it. Latency is one-way (half the round trip; perftest's t_typical, ucx_perftest's
50th percentile); bandwidth is MB/s (10^6 B/s; both tools print 2^20 B/s, converted).
Ratios are pcientb0 / posix: latency targets <= 1.0x, bandwidth >= 1.0x.

Exit status 0 when every test and size has a median from all three programs, 1 otherwise.
"""
import argparse
import contextlib
import csv
import functools
import math
import os
import shutil
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tests", "integration"))
import itest  # noqa: E402
import perftest  # noqa: E402  (its result-table parser and checks)
import ucx_perftest  # noqa: E402  (its Final: line parser)

SIZES = ((8, "8 B"), (64 << 10, "64 KiB"), (4 << 20, "4 MiB"))
# test: (latency or bandwidth, perftest tool on pcientb0)
TESTS = {"put_lat": ("lat", "ib_write_lat"), "am_lat": ("lat", "ib_send_lat"),
         "put_bw": ("bw", "ib_write_bw")}
SIDES = (("posix", "UCX posix (shared memory)", "0.55"),
         ("perftest", "pcientb0, perftest", "tab:blue"),
         ("rc_verbs", "pcientb0, ucx_perftest rc_verbs", "tab:orange"))
UCT_AM_MAX = 8 << 10       # am_bcopy: 8256 B on posix, 8255 B on rc_verbs
RC_PUT_SHORT_MAX = 64      # rc_verbs put_short on pcientb0 (ucx_info -d)
MIB_TO_MB = 1.048576       # both tools print MB/sec as 2^20 B/s
UCT_DEVICE = {"posix": ["-x", "posix", "-d", "memory"],
              "rc_verbs": ["-x", "rc_verbs", "-d", f"{itest.DEVICE}:1"]}
UCX_ENV = {"posix": {"UCX_TLS": "posix,self"},
           "rc_verbs": {"UCX_TLS": "rc_v", "UCX_NET_DEVICES": f"{itest.DEVICE}:1"}}
UCP_LANES = {"posix": ("posix/memory", "self/memory0"), "rc_verbs": itest.PCIENTB_LANES}
TARGET = {"lat": "<= 1.0x", "bw": ">= 1.0x"}
# UCP at UCX_LOG_LEVEL=info reports (DIAG) that it found no rdma_cm: ENOENT under pcientb-run,
# ENODEV without it (the reference).
UCX_ALLOWED = itest.UCX_INFO_ALLOWED + [r"rdma_create_event_channel failed: No such device"]


def iterations(kind, size, quick):
    """Iterations per run: about 0.1-0.3 s of traffic each on this machine."""
    n = {("lat", 8): 10000, ("lat", 64 << 10): 2000, ("lat", 4 << 20): 200,
         ("bw", 8): 100000, ("bw", 64 << 10): 20000, ("bw", 4 << 20): 500}[(kind, size)]
    return max(n // 10, 20) if quick else n


def ucx_test(test, size):
    """(ucx_perftest test name, UCP or not) for a test and size."""
    if test == "am_lat" and size > UCT_AM_MAX:
        return "ucp_am_lat", True
    return test, False


def meets(kind, ratio):
    return ratio <= 1.0 if kind == "lat" else ratio >= 1.0


@contextlib.contextmanager
def bare_processes():
    """itest.run_pair starts both sides under pcientb-run; the reference runs without it."""
    proc = itest.Proc
    itest.Proc = functools.partial(proc, launch=False)
    try:
        yield
    finally:
        itest.Proc = proc


def run_ucx(side, test, size, n, stats):
    name, ucp = ucx_test(test, size)
    args = ["-t", name, "-s", str(size), "-n", str(n), "-w", str(max(n // 10, 10))]
    env = dict(UCX_ENV[side])
    if ucp:
        env["UCX_LOG_LEVEL"] = "info"  # ep_cfg lines: the lanes UCX chose
    else:
        args = UCT_DEVICE[side] + args
        if side == "rc_verbs" and test.startswith("put") and size > RC_PUT_SHORT_MAX:
            args += ["-D", "zcopy"]
    if side == "rc_verbs":
        env.update(stats.env())
    pair = functools.partial(itest.run_pair, ["ucx_perftest", "-p", "{port}"] + args,
                             ["ucx_perftest", "127.0.0.1", "-p", "{port}"] + args, env=env)
    if side == "posix":
        with bare_processes():
            server, client = pair()
    else:
        server, client = pair()
    itest.check_no_errors([server, client], allow=UCX_ALLOWED)
    if ucp:
        itest.check_ucx_lanes([server, client], allowed=UCP_LANES[side], min_lines=2)
    m = ucx_perftest.FINAL_RE.search(client.output())
    if not m or int(m.group(1)) != n:
        client.dump()
        itest.fail(f"ucx_perftest {' '.join(args)}: no 'Final:' line for {n} iterations")
    typical, bw = float(m.group(2)), float(m.group(5))
    return typical if TESTS[test][0] == "lat" else bw * MIB_TO_MB


def run_perftest(test, size, n, stats):
    kind, tool = TESTS[test]
    opts = ["-s", str(size), "-n", str(n)]
    base = [tool, "-d", itest.DEVICE, "-p", "{port}"] + opts
    server, client = itest.run_pair(base, base + ["localhost"], env=stats.env())
    itest.check_no_errors([server, client], allow=perftest.ALLOWED)
    if not perftest.check_results(client, tool, opts):
        client.dump()
        itest.fail(f"{tool}: client printed no result table")
    row = perftest.parse_table(client.output())[1][0]
    return row[4] if kind == "lat" else row[3] * MIB_TO_MB  # t_typical, BW average


def moved_bytes(test, size, n):
    """Bytes one run moves at least: latency tests are ping-pongs (each side sends n)."""
    return (2 if TESTS[test][0] == "lat" else 1) * n * size


def measure(args, log_file):
    """{(test, size, side): [figure per repetition]}; failed runs leave no figure."""
    stats = itest.Stats("ucx-compare")
    figures = {}
    expected_bytes, runs = 0, 0
    cases = [(t, s) for t in TESTS for s, _ in SIZES]
    total = args.reps * len(cases) * len(SIDES)
    done = 0
    for rep in range(1, args.reps + 1):
        for test, size in cases:
            kind = TESTS[test][0]
            n = iterations(kind, size, args.quick)
            for side, _, _ in SIDES:
                done += 1
                what = f"[{done}/{total}] rep {rep} {test} {size_label(size)} {side}"
                start = time.monotonic()
                try:
                    with contextlib.redirect_stdout(log_file):
                        itest.log(f"--- {what}, {n} iterations")
                        if side == "perftest":
                            value = run_perftest(test, size, n, stats)
                        else:
                            value = run_ucx(side, test, size, n, stats)
                except itest.TestFailure as e:
                    print(f"ucx-compare: {what}: FAILED: {e} (see {log_file.name})",
                          file=sys.stderr, flush=True)
                    continue
                figures.setdefault((test, size, side), []).append(value)
                if side != "posix":
                    runs += 1
                    expected_bytes += moved_bytes(test, size, n)
                unit = "us" if kind == "lat" else "MB/s"
                print(f"ucx-compare: {what}: {value:.4g} {unit} "
                      f"({time.monotonic() - start:.1f} s)", file=sys.stderr, flush=True)
    traffic = None
    try:
        with contextlib.redirect_stdout(log_file):
            totals = stats.check(processes=2 * runs, min_bytes=expected_bytes,
                                 what="the pcientb0 runs")
        payload = sum(totals[f"{k}_bytes"] for k in itest.PAYLOAD_KINDS)
        traffic = (f"pcientb0 traffic (PCIENTB_STATS): {2 * runs} processes, "
                   f"{payload / 1e9:.2f} GB posted (at least the {expected_bytes / 1e9:.2f} GB "
                   f"the measured iterations move), errors {totals['errors']}")
    except itest.TestFailure as e:
        traffic = f"pcientb0 traffic (PCIENTB_STATS): CHECK FAILED: {e}"
    return figures, traffic


def size_label(size):
    return dict(SIZES)[size]


def summarize(figures, reps):
    """Rows of medians and ratios, one per test and size."""
    rows = []
    for test, (kind, tool) in TESTS.items():
        for size, label in SIZES:
            r = {"test": test, "size_bytes": size, "size": label,
                 "unit": "us" if kind == "lat" else "MB/s", "perftest_tool": tool,
                 "ucx_test": ucx_test(test, size)[0], "target": TARGET[kind]}
            for side, _, _ in SIDES:
                vals = figures.get((test, size, side), [])
                r[f"{side}_median"] = statistics.median(vals) if vals else None
                r[f"{side}_runs"] = vals
            for side in ("perftest", "rc_verbs"):
                ok = r[f"{side}_median"] is not None and r["posix_median"]
                r[f"{side}_x_posix"] = r[f"{side}_median"] / r["posix_median"] if ok else None
            rows.append(r)
    return rows


def fmt(v, unit):
    if v is None:
        return "n/a"
    return f"{v:.3f}" if unit == "us" else f"{v:.0f}"


def ratio_cell(kind, ratio):
    return "n/a" if ratio is None else f"{ratio:.2f}x {'ok' if meets(kind, ratio) else 'NO'}"


def table(rows, reps, traffic):
    lines = [f"pcientb0 against UCX posix shared memory, medians of {reps} alternating "
             f"repetition(s); latency one-way us (lower is better), bandwidth MB/s (10^6 B/s, "
             f"higher is better); ratio = pcientb0 / UCX posix", "",
             "| test | size | UCX posix | pcientb0 perftest | ratio | pcientb0 ucx_perftest "
             "rc_verbs | ratio | target |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        kind = TESTS[r["test"]][0]
        name = f"{r['test']} ({r['unit']}; {r['perftest_tool']}"
        name += f", {r['ucx_test']})" if r["ucx_test"] != r["test"] else ")"
        cells = [name, r["size"], fmt(r["posix_median"], r["unit"])]
        for side in ("perftest", "rc_verbs"):
            cells += [fmt(r[f"{side}_median"], r["unit"]), ratio_cell(kind, r[f"{side}_x_posix"])]
        lines.append("| " + " | ".join(cells + [r["target"]]) + " |")
    lines.append("")
    for side, label in (("perftest", "perftest"), ("rc_verbs", "ucx_perftest rc_verbs")):
        met = [r for r in rows if r[f"{side}_x_posix"] is not None
               and meets(TESTS[r["test"]][0], r[f"{side}_x_posix"])]
        missed = [f"{r['test']} {r['size']}" for r in rows if r not in met]
        lines.append(f"pcientb0 with {label}: target met in {len(met)} of {len(rows)} rows"
                     + (f"; not met: {', '.join(missed)}" if missed else ""))
    lines.append(traffic)
    return "\n".join(lines)


def write_csv(rows, path):
    fields = ["test", "size_bytes", "unit", "perftest_tool", "ucx_test", "posix_median",
              "perftest_median", "rc_verbs_median", "perftest_x_posix", "rc_verbs_x_posix",
              "target", "posix_runs", "perftest_runs", "rc_verbs_runs"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ";".join(f"{x:.6g}" for x in v) if isinstance(v, list)
                        else f"{v:.6g}" if isinstance(v, float) else v for k, v in r.items()})


def plot(rows, reps, path):
    try:
        import matplotlib
    except ImportError:
        return ("ucx_compare.py: no plot: matplotlib is not installed for "
                f"{sys.executable} (apt-get install python3-matplotlib)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(TESTS), figsize=(17, 5.6))
    width = 0.26
    for ax, (test, (kind, tool)) in zip(axes, TESTS.items()):
        these = [r for r in rows if r["test"] == test]
        for i, (side, label, color) in enumerate(SIDES):
            xs = [j + (i - 1) * width for j in range(len(these))]
            vals = [r[f"{side}_median"] or math.nan for r in these]
            bars = ax.bar(xs, vals, width, label=label, color=color)
            if side == "posix":
                continue
            for bar, r in zip(bars, these):
                ratio = r[f"{side}_x_posix"]
                if ratio is not None:
                    ax.annotate(f"{ratio:.2f}x", (bar.get_x() + width / 2, bar.get_height()),
                                ha="center", va="bottom", fontsize=8,
                                color="green" if meets(kind, ratio) else "red")
        ax.set_yscale("log")
        ax.set_xticks(range(len(these)))
        ax.set_xticklabels([r["size"] for r in these])
        ax.set_xlabel("message size")
        if kind == "lat":
            ax.set_ylabel("one-way latency (us), lower is better")
        else:
            ax.set_ylabel("bandwidth (MB/s, 10^6 B/s), higher is better")
        big = [r["ucx_test"] for r in these if r["ucx_test"] != test]
        ax.set_title(f"{test} (perftest: {tool}{'; large: ' + big[-1] if big else ''})\n"
                     f"ratio pcientb0 / posix, target {TARGET[kind]}", fontsize=10)
        ax.grid(True, axis="y", which="major", alpha=0.3)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=len(SIDES),
               fontsize=9)
    fig.suptitle("pcientb0 (emulated NTB fabric) against UCX posix shared memory, two processes "
                 f"on one host, medians of {reps} alternating repetition(s)")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=100)
    return f"ucx_compare.py: wrote {path}"


def find_launcher():
    for c in (os.environ.get("PCIENTB_RUN"), os.path.join(REPO, "build", "bin", "pcientb-run"),
              shutil.which("pcientb-run")):
        if c and os.access(c, os.X_OK):
            return c
    sys.exit("ucx_compare.py: pcientb-run not found; build it (cmake --preset default && "
             "cmake --build build) or set PCIENTB_RUN")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("outdir", nargs="?", default="./results/ucx")
    ap.add_argument("--reps", type=int)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.reps is None:
        args.reps = 1 if args.quick else 5
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    missing = [t for t in ["ucx_perftest"] + [tool for _, tool in TESTS.values()]
               if shutil.which(t) is None]
    if missing:
        sys.exit(f"ucx_compare.py: not installed: {' '.join(missing)} "
                 "(apt-get install ucx-utils perftest)")
    os.environ["PCIENTB_RUN"] = find_launcher()
    os.environ.setdefault("PCIENTB_FABRIC", f"ucx_compare_{os.getpid()}")
    os.environ.setdefault("ITEST_TIMEOUT", "120")
    os.makedirs(args.outdir, exist_ok=True)
    out = lambda name: os.path.join(args.outdir, name)  # noqa: E731

    with open(out("ucx-compare.log"), "w") as log_file:
        figures, traffic = measure(args, log_file)
    rows = summarize(figures, args.reps)
    text = table(rows, args.reps, traffic)
    print(text)
    with open(out("ucx-compare.md"), "w") as f:
        f.write(text + "\n")
    write_csv(rows, out("ucx-compare.csv"))
    print(f"\nucx_compare.py: wrote {out('ucx-compare.md')} and {out('ucx-compare.csv')}")
    print(plot(rows, args.reps, out("ucx-compare.png")))
    incomplete = [f"{r['test']} {r['size']} {side}" for r in rows for side, _, _ in SIDES
                  if r[f"{side}_median"] is None]
    if incomplete:
        print(f"ucx_compare.py: INCOMPLETE, no figure for: {', '.join(incomplete)}",
              file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
