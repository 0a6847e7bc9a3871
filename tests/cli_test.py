#!/usr/bin/env python3
"""Strict command lines of the C++ tools (CLI11): every bad value is an error on
stderr naming the option, with exit status 2; --help exits 0 and lists every option;
sizes take K/M/G (KiB...) suffixes.

  cli_test.py PCIENTB_PERF PCIENTB_STAT PCIENTB_STRESS SOCKBENCH
"""

import csv
import os
import subprocess
import sys
import tempfile

failures = []


def run(argv, timeout=120):
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def bad(tool, args, needle):
    rc, out, err = run([tool, *args])
    name = os.path.basename(tool)
    if rc != 2 or needle not in err:
        failures.append(f"{name} {' '.join(args)}: exit {rc}, stderr {err!r}; "
                        f"expected exit 2 and {needle!r}")
    else:
        print(f"ok   {name} {' '.join(args)} -> 2: {err.splitlines()[0]}")


def helps(tool, options):
    rc, out, _ = run([tool, "--help"])
    name = os.path.basename(tool)
    missing = [o for o in options if o not in out]
    if rc != 0 or missing:
        failures.append(f"{name} --help: exit {rc}, missing {missing}")
    else:
        print(f"ok   {name} --help lists {len(options)} options")


def main():
    perf, stat, stress, sockbench = sys.argv[1:5]

    helps(perf, ["--csv", "--max-size", "--seconds", "--quick"])
    bad(perf, ["--max-size", "4x"], "--max-size")
    bad(perf, ["--max-size", "3K"], "not a power of 2")
    bad(perf, ["--max-size", "0"], "not a power of 2")
    bad(perf, ["--max-size"], "--max-size")
    bad(perf, ["--seconds", "-1"], "--seconds")
    bad(perf, ["--seconds", "1x"], "--seconds")
    bad(perf, ["--bogus"], "--bogus")
    bad(perf, ["stray"], "stray")
    # The size suffix is binary and honoured: 4K is 4096 bytes, the last row.
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "perf.csv")
        rc, out, err = run([perf, "--quick", "--max-size", "4K", "--csv", path], timeout=240)
        if rc != 0:
            failures.append(f"pcientb-perf --quick --max-size 4K: exit {rc}: {err[-2000:]}")
        else:
            with open(path) as f:
                sizes = [int(r["size_bytes"]) for r in csv.DictReader(f)]
            if sizes != [1 << i for i in range(13)]:
                failures.append(f"pcientb-perf --max-size 4K measured sizes {sizes}")
            else:
                print("ok   pcientb-perf --max-size 4K measures 1 B .. 4096 B")

    helps(stat, ["--fabric", "--lid", "--pid", "--json", "--qp", "--dead", "--watch",
                 "--iterations", "counters"])
    bad(stat, ["--lid", "0"], "--lid")
    bad(stat, ["--lid", "x"], "--lid")
    bad(stat, ["--pid", "-3"], "--pid")
    bad(stat, ["--watch", "0"], "--watch")
    bad(stat, ["--iterations", "-1"], "--iterations")
    bad(stat, ["qps"], "qps")

    helps(stress, ["--procs", "--qps", "--ops", "--seconds", "--max-size", "--seed",
                   "--kill-ms", "--churn-ms", "--chaos", "--srq", "--hang-ms", "--fabric",
                   "--quiet", "--verbose"])
    bad(stress, ["--procs", "0"], "--procs")
    bad(stress, ["--max-size", "65M"], "--max-size")
    bad(stress, ["--max-size", "1T"], "--max-size")
    bad(stress, ["--ops", "5q"], "--ops")
    bad(stress, ["--chaos", "qp-clean,nope"], "nope")
    bad(stress, ["--seconds", "0"], "--seconds")
    bad(stress, ["--srq", "101"], "--srq")
    bad(stress, ["--fabric", ""], "--fabric")

    helps(sockbench, ["server", "stream", "pingpong", "refs"])
    bad(sockbench, [], "subcommand")
    bad(sockbench, ["stream", "-c", "h", "-p", "1", "-s", "4x", "-t", "1"], "-s")
    bad(sockbench, ["stream", "-c", "h", "-p", "1", "-s", "4K", "-t", "0"], "-t")
    bad(sockbench, ["stream", "-c", "h", "-p", "1", "-s", "4K", "-t", "1", "-n", "0"], "-n")
    bad(sockbench, ["stream", "-p", "1", "-s", "4K", "-t", "1"], "-c")
    bad(sockbench, ["stream", "-c", "h", "-p", "1", "-s", "4K", "-t", "1", "--legs", "0,x"],
        "--legs")
    bad(sockbench, ["stream", "-c", "h", "-p", "1", "-s", "4K", "-t", "1", "--legs", "-5"],
        "--legs")
    bad(sockbench, ["stream", "-c", "h", "-p", "1", "-s", "4K", "-t", "1", "--legs", ""],
        "--legs")
    bad(sockbench, ["stream", "-c", "h", "-p", "1", "-s", "4K", "-t", "1", "--slice", "0.1"],
        "--legs")
    bad(sockbench, ["stream", "-c", "h", "-p", "1", "-s", "4K", "-t", "1e9", "--legs", "0,auto",
                    "--slice", "0.001"], "--legs")
    bad(sockbench, ["pingpong", "-c", "h", "-p", "1", "-s", "8", "-i", "5x"], "-i")
    bad(sockbench, ["refs", "-s", "2G"], "-s")
    rc, out, err = run([sockbench, "refs", "-s", "4K", "-s", "1M", "-t", "0.02",
                        "--pingpong-rounds", "200"])
    sizes = [l for l in out.splitlines() if '"memcpy"' in l]
    if rc != 0 or len(sizes) != 2 or '"size":4096' not in sizes[0] or '"size":1048576' not in sizes[1]:
        failures.append(f"sockbench refs -s 4K -s 1M: exit {rc}, {out!r} {err!r}")
    else:
        print("ok   sockbench refs -s 4K -s 1M measures 4096 and 1048576")

    for f in failures:
        print(f"FAIL {f}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
