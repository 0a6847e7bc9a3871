#!/usr/bin/env python3
"""Integration tests with unmodified MPI programs on pcientb0, via pcientb-mpirun.

  mpi.py netpipe openmpi|mpich     NetPIPE (NPopenmpi / NPmpich2), 2 ranks
  mpi.py hpcc                      HPC Challenge (hpcc, Open MPI), 2 ranks, N=1000
  mpi.py mpi4py NP [rc|ud]         mpi4py_check.py (Open MPI), NP ranks
  mpi.py launcher                  pcientb-mpirun's command lines and usage errors

Every job runs through the build's pcientb-mpirun on this test's fabric, with
UCX_LOG_LEVEL=info and PCIENTB_STATS. Checks, besides each program's own
results: exit status 0 within ITEST_TIMEOUT (past it the whole session is
killed), no error lines, every UCX endpoint lane of every rank on pcientb0
(ep_cfg lines), and the provider's counters: every rank on pcientb0, and at
least the payload the program is known to have moved posted as SEND, RDMA
WRITE or RDMA READ.
"""

import math
import os
import re
import shutil
import subprocess
import sys
import tempfile

import itest
from itest import fail, log

HERE = os.path.dirname(os.path.abspath(__file__))
MAX_SIZE = 4 << 20
NP_REPEATS = 50
# NetPIPE 3.7 times every size in 3 trials of `times` round trips (its TRIALS;
# confirmed by counting MPI_Send payloads with a PMPI shim: 2 x 3 x times x size).
NP_TRIALS = 3
NP_LINE = re.compile(r"^\s*(\d+):\s+(\d+) bytes\s+(\d+) times -->\s+(.*?)\s*$", re.MULTILINE)


def run_job(name, args, *, stats, cwd=None, mpi="openmpi", np=2, tls="rc"):
    """One MPI job; returns the Proc after checking exit status, errors and UCX lanes."""
    argv = [itest.mpi_launcher(), "--mpi", mpi, "--fabric", itest.fabric(), "--tls", tls,
            "-n", str(np), "--"] + args
    env = {"UCX_LOG_LEVEL": "info", **stats.env()}
    job = itest.Proc(name, argv, env=env, cwd=cwd, launch=False)
    job.wait()
    if job.rc != 0:
        job.dump()
        fail(f"{name}: {job.status()}")
    log(f"{name}: {job.status()}")
    itest.check_no_errors([job], allow=itest.UCX_INFO_ALLOWED)
    # Each rank prints its endpoints (one per peer or per configuration).
    itest.check_ucx_lanes([job], min_lines=np)
    return job


def netpipe(mpi):
    tool = {"openmpi": "NPopenmpi", "mpich": "NPmpich2"}[mpi]
    launcher = {"openmpi": "mpirun.openmpi", "mpich": "mpiexec.mpich"}[mpi]
    itest.require_tools(tool, launcher)

    def run():
        tmp = tempfile.mkdtemp(prefix="itest-netpipe-")
        try:
            # Data: NetPIPE's integrity mode compares every message it receives.
            stats = itest.Stats("netpipe-integrity")
            job = run_job("integrity", [tool, "-u", str(MAX_SIZE), "-n", "20", "-i",
                                        "-o", os.path.join(tmp, "integrity.out")],
                          stats=stats, cwd=tmp, mpi=mpi)
            lines = NP_LINE.findall(job.output())
            if len(lines) < 30 or any(r[3] != "Integrity check passed" for r in lines):
                job.dump()
                fail(f"integrity: {len(lines)} sizes, expected >= 30 all 'Integrity check "
                     f"passed'")
            top = int(lines[-1][1])
            if top < MAX_SIZE * 3 // 4:
                fail(f"integrity: largest size {top} B, expected >= 3 MiB")
            log(f"integrity: {len(lines)} sizes {lines[0][1]}..{top} B passed")
            # One trial of round trips is the least that integrity mode moves.
            moved = sum(2 * int(size) * int(times) for _, size, times, _ in lines)
            stats.check(processes=2, min_bytes=moved, what=f"{tool} -i")

            # Performance: 1 B .. 4 MiB, no perturbed sizes, fixed repeats.
            stats = itest.Stats("netpipe")
            job = run_job("netpipe", [tool, "-u", str(MAX_SIZE), "-p", "0",
                                      "-n", str(NP_REPEATS), "-o", os.path.join(tmp, "np.out")],
                          stats=stats, cwd=tmp, mpi=mpi)
            rows = []
            for _, size, times, rest in NP_LINE.findall(job.output()):
                m = re.fullmatch(r"([\d.]+) Mbps in\s+([\d.]+) usec", rest)
                if not m:
                    job.dump()
                    fail(f"netpipe: cannot parse the {size} B line: {rest!r}")
                rows.append((int(size), int(times), float(m.group(1)), float(m.group(2))))
            sizes = [r[0] for r in rows]
            if not rows or sizes[0] != 1 or sizes[-1] != MAX_SIZE or sizes != sorted(set(sizes)):
                job.dump()
                fail(f"netpipe: sizes {sizes}, expected increasing from 1 B to {MAX_SIZE} B")
            for size, times, mbps, usec in rows:
                if times != NP_REPEATS:
                    fail(f"netpipe: {size} B ran {times} times, expected {NP_REPEATS}")
                # > 0, finite, and below 10 Tb/s, which no copy on this machine reaches.
                if not (0 < mbps < 1e7 and 0 < usec and math.isfinite(usec)):
                    fail(f"netpipe: {size} B: {mbps} Mbps in {usec} us is implausible")
            if rows[0][3] > 1000:
                fail(f"netpipe: 1 B latency {rows[0][3]} us")
            log(f"netpipe: {len(rows)} sizes; 1 B {rows[0][3]} us; "
                f"4 MiB {rows[-1][2]:.0f} Mbps in {rows[-1][3]} us")
            moved = sum(2 * NP_TRIALS * size * times for size, times, _, _ in rows)
            stats.check(processes=2, min_bytes=moved,
                        what=f"{tool} ({moved} bytes in {len(rows)} sizes)")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    itest.main(run)


def hpcc():
    example = "/usr/share/doc/hpcc/examples/_hpccinf.txt"
    itest.require_tools("hpcc", "mpirun.openmpi")
    if not os.path.exists(example):
        print(f"[itest] SKIP: not installed: {example} (hpcc)", flush=True)
        sys.exit(itest.SKIP)

    def run():
        tmp = tempfile.mkdtemp(prefix="itest-hpcc-")
        try:
            # hpcc reads hpccinf.txt from its working directory: Debian's example
            # (N=1000, NB=80) with a 1 x 2 process grid for 2 ranks.
            with open(example) as f:
                lines = f.read().splitlines()
            grid = {"Ps": "1", "Qs": "2", "Ns": "1000"}
            for i, line in enumerate(lines):
                words = line.split()
                if len(words) >= 2 and words[1] in grid:
                    lines[i] = f"{grid.pop(words[1]):<13}{' '.join(words[1:])}"
            if grid:
                fail(f"{example}: no line for {', '.join(grid)}")
            with open(os.path.join(tmp, "hpccinf.txt"), "w") as f:
                f.write("\n".join(lines) + "\n")
            stats = itest.Stats("hpcc")
            job = run_job("hpcc", ["hpcc"], stats=stats, cwd=tmp)
            try:
                with open(os.path.join(tmp, "hpccoutf.txt")) as f:
                    out = f.read()
            except OSError as e:
                job.dump()
                fail(f"hpcc wrote no hpccoutf.txt: {e}")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

        m = re.search(r"^Begin of Summary section\.$(.*)^End of Summary section\.$", out,
                      re.MULTILINE | re.DOTALL)
        if not m:
            print(out)
            fail("hpccoutf.txt has no summary section")
        summary = dict(re.findall(r"^(\w+)=(\S*)$", m.group(1), re.MULTILINE))

        def num(key):
            try:
                return float(summary[key])
            except (KeyError, ValueError):
                print(out)
                fail(f"hpcc summary: no numeric {key}")

        expect = {"Success": 1, "CommWorldProcs": 2, "HPL_N": 1000, "HPL_nprow": 1,
                  "HPL_npcol": 2, "PTRANS_residual": 0, "MPIRandomAccess_Errors": 0,
                  "MPIRandomAccess_LCG_Errors": 0}
        problems = [f"{k}={summary.get(k)} (expected {v})" for k, v in expect.items()
                    if num(k) != v]
        for key in ("HPL_Tflops", "PTRANS_GBs", "MPIFFT_Gflops", "MinPingPongBandwidth_GBytes",
                    "AvgPingPongLatency_usec", "NaturallyOrderedRingBandwidth_GBytes"):
            if not 0 < num(key) < 1e6:
                problems.append(f"{key}={summary[key]} (expected > 0)")
        if num("MPIFFT_maxErr") > 1e-9:
            problems.append(f"MPIFFT_maxErr={summary['MPIFFT_maxErr']}")
        passed = [int(n) for n in re.findall(r"(\d+) tests? completed and passed residual", out)]
        failed = [int(n) for n in re.findall(r"(\d+) tests? completed and failed residual", out)]
        if not passed or sum(passed) == 0 or not failed or sum(failed) != 0:
            problems.append(f"residual checks: passed {passed}, failed {failed}")
        node_errors = re.findall(r"^Node\(s\) with error (\d+)$", out, re.MULTILINE)
        if any(int(n) for n in node_errors):
            problems.append(f"'Node(s) with error' {node_errors}")
        if problems:
            print(out)
            fail("hpcc: " + "; ".join(problems))
        log("hpcc: Success=1, " + ", ".join(
            f"{k}={summary[k]}" for k in ("HPL_Tflops", "PTRANS_GBs", "AvgPingPongLatency_usec",
                                          "AvgPingPongBandwidth_GBytes")))
        # The latency/bandwidth section measures ping-pongs of the lengths it
        # prints (8 B and 2,000,000 B); each measurement is at least one round trip.
        lengths = [int(n) for n in re.findall(r"^Message Length: (\d+)$", out, re.MULTILINE)]
        if not lengths or max(lengths) < 1000000:
            fail(f"hpcc: ping-pong message lengths {lengths}")
        stats.check(processes=2, min_bytes=sum(2 * n for n in lengths), what="hpcc")

    itest.main(run)


def mpi4py(np, tls):
    python = os.environ.get("PCIENTB_MPI4PY_PYTHON", "/usr/bin/python3")
    itest.require_tools("mpirun.openmpi", python)
    probe = subprocess.run([python, "-c", "import mpi4py"], capture_output=True)
    if probe.returncode != 0:
        print(f"[itest] SKIP: not installed: mpi4py for {python} (python3-mpi4py)", flush=True)
        sys.exit(itest.SKIP)

    def run():
        stats = itest.Stats("mpi4py")
        job = run_job("mpi4py", [python, os.path.join(HERE, "mpi4py_check.py")],
                      stats=stats, np=np, tls=tls)
        out = job.output()
        for part in ("point-to-point", "collectives", "one-sided"):
            # Not anchored to lines: ranks' output may interleave.
            ranks = sorted(int(r) for r in re.findall(rf"mpi4py-check rank=(\d+) ok {part}\b",
                                                      out))
            if ranks != list(range(np)):
                job.dump()
                fail(f"{part}: ranks {ranks} reported ok, expected 0..{np - 1}")
        m = re.search(r"mpi4py-check done ranks=(\d+) remote_bytes=(\d+)\b", out)
        if not m or int(m.group(1)) != np:
            job.dump()
            fail("mpi4py_check.py did not finish on every rank")
        log(f"mpi4py: {np} ranks, point-to-point, collectives and one-sided checked")
        # One-sided goes through osc ucx only if pcientb-mpirun selected it: a
        # UCX rma lane must show up, on pcientb0.
        if not re.search(r"ep_cfg\[\d+\]: .*\brma(_am)?\(", out):
            job.dump()
            fail("no UCX rma lane: one-sided communication did not use UCX (osc ucx)")
        stats.check(processes=np, min_bytes=int(m.group(2)), what="mpi4py_check.py")

    itest.main(run)


def launcher_cli():
    """pcientb-mpirun's contract without running MPI: --dry-run command lines, usage errors."""

    def run():
        mpirun = itest.mpi_launcher()

        def call(*args, env=None):
            r = subprocess.run([mpirun, *args], capture_output=True, text=True,
                               env={**os.environ, **(env or {})}, timeout=30)
            return r.returncode, r.stdout, r.stderr

        rc, out, _ = call("--help")
        if rc != 0 or "SYNOPSIS" not in out or "--mpi openmpi|mpich" not in out:
            fail(f"--help: exit {rc}, no SYNOPSIS/--mpi in:\n{out}")
        run_path = os.environ["PCIENTB_RUN"]
        cases = [
            (("-n", "2", "prog", "a"), {},
             ["mpirun.openmpi -np 2 --mca pml ucx --mca pml_ucx_devices any --mca osc ucx",
              "-x UCX_NET_DEVICES=pcientb0:1 -x UCX_TLS=rc_v",
              # (sanitizer options, when set, are passed on in between)
              "-x PCIENTB_FABRIC=f1 ", f"{run_path} --fabric f1 -- prog a"]),
            (("--mpi", "mpich", "--tls", "ud", "-n", "3", "prog"), {"PCIENTB_STATS": "/x"},
             ["mpiexec.mpich -n 3 -genv UCX_NET_DEVICES pcientb0:1 -genv UCX_TLS ud_v",
              "-genv PCIENTB_FABRIC f1", "-genv PCIENTB_STATS /x",
              f"{run_path} --fabric f1 -- prog"]),
            (("-n", "1000", "prog"), {"UCX_LOG_LEVEL": "info"},
             ["--oversubscribe", "-x UCX_LOG_LEVEL ", "-x UCX_RNDV_THRESH "]),
            # The rendezvous threshold: 16k unless the user set one.
            (("--mpi", "mpich", "-n", "2", "prog"), {},
             ["-genv UCX_RNDV_THRESH 16k "]),
            (("--mpi", "mpich", "-n", "2", "prog"), {"UCX_RNDV_THRESH": "64k"},
             ["-genv UCX_RNDV_THRESH 64k "]),
        ]
        for args, env, want in cases:
            rc, out, err = call("--dry-run", "--fabric", "f1", *args, env=env)
            if rc != 0:
                fail(f"--dry-run {' '.join(args)}: exit {rc}: {err}")
            for w in want:
                if w not in out:
                    fail(f"--dry-run {' '.join(args)}: no {w!r} in:\n{out}")
            if (os.geteuid() == 0) != out.startswith("OMPI_ALLOW_RUN_AS_ROOT=1 ") and \
                    "--mpi" not in args:
                fail(f"root-allow variables wrong for euid {os.geteuid()}: {out}")
        log("--dry-run command lines as documented")
        for args in (("--mpi", "lam", "-n", "2", "p"), ("-n", "0", "p"), ("-n", "2"), ("p",),
                     ("--tls", "dc", "-n", "2", "p"), ("--bogus", "-n", "2", "p"), ("-n",),
                     ("--fabric", "a/b", "-n", "2", "p")):
            rc, out, err = call(*args)
            if rc != 2 or not err.strip():
                fail(f"pcientb-mpirun {' '.join(args)}: exit {rc}, stderr {err!r}; "
                     f"expected exit 2 with a message")
        log("bad usage: exit 2 with a message, 8 cases")

    itest.main(run)


def main():
    args = sys.argv[1:]
    if args[:1] == ["netpipe"] and len(args) == 2 and args[1] in ("openmpi", "mpich"):
        netpipe(args[1])
    elif args == ["hpcc"]:
        hpcc()
    elif args == ["launcher"]:
        launcher_cli()
    elif args[:1] == ["mpi4py"] and len(args) in (2, 3) and args[1].isdigit() and \
            (len(args) == 2 or args[2] in ("rc", "ud")):
        mpi4py(int(args[1]), args[2] if len(args) == 3 else "rc")
    else:
        print(__doc__)
        sys.exit(2)


if __name__ == "__main__":
    main()
