#!/usr/bin/env python3
"""The SDP layer (pcientb-sdp) beside kernel TCP loopback, one tool (sockbench), same run.

usage: sdp_bench.py [OUTPUT_DIR] [--quick] [--reps N] [--seconds S] [--only PHASES]
                    [--launcher PATH] [--sockbench PATH] [--no-sdp]

  OUTPUT_DIR      default ./results/sdp; receives sdp-bench.json (every run and the medians),
                  sdp-bench.md (tables, ratios, targets; also printed), sdp-bench.log (every
                  command line and the programs' stderr), sdp-stats.txt (the layer's
                  PCIENTB_SDP_STATS lines) and the plots sdp-stream.png, sdp-latency.png,
                  sdp-zcopy.png (bench/plot.py; skipped with a message without matplotlib)
  --quick         a smoke run (under a minute): one repetition, short points, fewer sizes
  --reps N        repetitions of every measurement (default 3; --quick: 1); figures are
                  medians over them
  --seconds S     duration of one stream point (default 1.0; --quick: 0.15); in the zcopy
                  phase's auto runs, the timed seconds of each leg
  --slice S       one slice of the auto runs (default 0.1; --quick: 0.05)
  --only PHASES   a comma-separated subset of stream,latency,zcopy (default: all three)
  --launcher P    pcientb-sdp (default: $PCIENTB_SDP_LAUNCHER, build/bin/pcientb-sdp, PATH)
  --sockbench P   sockbench (default: $SOCKBENCH, build/bin/sockbench, PATH)
  --no-sdp        run the "SDP" legs as plain kernel TCP too (a dry run of the driver without
                  the layer; the path checks are off and every report says so)

Three phases, each point measured under pcientb-sdp (server and client, one fabric) and plain
(kernel TCP loopback), the two legs alternating point by point (and which goes first alternating
by repetition), so that the machine's fast and slow spells hit both:

  stream   the PCIe socket paper's Table 3 sweep: one connection, blocking send() of 1 B .. 4 MiB
           for S seconds; MB/s (10^6 B/s) and CPU s/GB (client + server), SDP/TCP ratio
  latency  ping-pong 1 B .. 64 KiB, median and p99 one-way (RTT/2), SDP/TCP, beside the
           shared-memory ping-pong reference (sockbench refs, bench/references.hpp)
  zcopy    SDP only: BCopy (PCIENTB_SDP_ZCOPY_THRESH=0) against ZCopy (=1: every blocking send
           goes zero-copy), 1, 2, 4, 8 connections, 4 KiB .. 4 MiB: MB/s, CPU s/GB, the
           crossover size per connection count, beside memcpy (sockbench refs); and the
           adaptive threshold (auto) against every fixed threshold over the sweep, measured
           on the same connections in one run per point (sockbench stream --legs 0,1,auto:
           the three take turns in slices of --slice seconds, S seconds each), because
           separate one-second runs of one and the same code differ by 10-30% on this VM

Targets (reported, not enforced): stream >= 64 KiB at >= 3x TCP; 1-byte writes >= 20x TCP;
64-byte ping-pong latency <= 0.1x TCP; ZCopy (1 connection) >= 0.7x memcpy at 4 MiB; ZCopy CPU
per byte at 8 connections (4 MiB) <= 0.3x BCopy's; auto never below 0.9x the better fixed
choice at any point, and above the best single fixed threshold over the sweep (issue 12).

Every SDP-leg run must report path "sdp" (getsockopt PCIENTB_SDP_STATS) and the TCP leg
"unknown" (no layer); the ZCopy leg must have moved its bytes by ZCopy and the BCopy leg none;
the layer's stats file must account for the bytes the SDP legs moved. Exit status 0 when every
point has its figures and every check passed, 1 otherwise (missed targets do not fail the run).
"""
import argparse
import json
import math
import os
import re
import selectors
import shutil
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

KiB, MiB = 1 << 10, 1 << 20
STREAM_SIZES = [1, 16, 64, 256, KiB, 4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, MiB, 4 * MiB]
PP_SIZES = [1 << i for i in range(17)]  # 1 B .. 64 KiB
ZC_CONNS = [1, 2, 4, 8]
ZC_SIZES = [4 * KiB << i for i in range(11)]  # 4 KiB .. 4 MiB
QUICK_STREAM_SIZES = [1, 64, 64 * KiB, 4 * MiB]
QUICK_PP_SIZES = [1, 64, 64 * KiB]
QUICK_ZC_CONNS = [1, 8]
QUICK_ZC_SIZES = [4 * KiB, 64 * KiB, 4 * MiB]
PHASES = ("stream", "latency", "zcopy")

# The legs: (name, launched under pcientb-sdp, extra environment).
LEGS = {"sdp": (True, {}), "tcp": (False, {}),
        "bcopy": (True, {"PCIENTB_SDP_ZCOPY_THRESH": "0"}),
        "zcopy": (True, {"PCIENTB_SDP_ZCOPY_THRESH": "1"}),
        # auto beside the fixed thresholds on the same connections (sockbench stream --legs):
        # the client sets each leg's threshold per socket; the receiver offers no buffers
        # (threshold 0), whatever the leg, so all legs are Read ZCopy where they go zero-copy.
        "slices": (True, {"PCIENTB_SDP_ZCOPY_THRESH": "0"})}
# The legs of a slices run, in sockbench's --legs terms (0: BCopy only, 1: every send ZCopy).
SLICE_LEGS = (("bcopy", "0"), ("zcopy", "1"), ("auto", "auto"))
# Variables of the layer that would change what a leg measures; each leg sets its own.
LAYER_ENV = ("PCIENTB_SDP", "PCIENTB_SDP_CONFIG", "PCIENTB_SDP_ZCOPY_THRESH", "PCIENTB_SDP_LOG",
             "LD_PRELOAD")

STATS_RE = re.compile(r"^conn (.*)$")


class RunFailed(Exception):
    pass


def size_label(n):
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def median(values):
    return statistics.median(values) if values else None


def ratio(a, b):
    return a / b if a is not None and b else None


def find_program(explicit, env_var, name):
    for cand in (explicit, os.environ.get(env_var), os.path.join(REPO, "build", "bin", name),
                 shutil.which(name)):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return os.path.abspath(cand)
    return None


def loadavg():
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


class Bench:
    def __init__(self, args, out_dir):
        self.args = args
        self.out = lambda name: os.path.join(out_dir, name)  # noqa: E731
        self.log_file = open(self.out("sdp-bench.log"), "w")
        self.stats_path = self.out("sdp-stats.txt")
        open(self.stats_path, "w").close()
        self.fabric = os.environ.get("PCIENTB_FABRIC") or f"sdp_bench_{os.getpid()}"
        self.runs = []       # every client run: dict
        self.refs = []       # every refs run: dict
        self.failures = []   # text of every failed run or check
        self.servers = {}    # leg -> (Popen, port)
        self.base_env = {k: v for k, v in os.environ.items() if k not in LAYER_ENV}
        self.base_env["PCIENTB_FABRIC"] = self.fabric
        dropped = [k for k in LAYER_ENV if k in os.environ]
        if dropped:
            self.log(f"not passed to the legs (each sets its own): {', '.join(dropped)}")

    def log(self, msg):
        self.log_file.write(msg.rstrip("\n") + "\n")
        self.log_file.flush()

    def progress(self, msg):
        print(f"sdp-bench: {msg}", file=sys.stderr, flush=True)

    # --- processes -------------------------------------------------------------------------

    def leg_cmd(self, leg, argv):
        under_sdp, extra = LEGS[leg]
        env = dict(self.base_env)
        env.update(extra)
        if under_sdp and not self.args.no_sdp:
            env["PCIENTB_SDP_STATS"] = self.stats_path
            return [self.args.launcher, "--fabric", self.fabric, "--"] + argv, env
        return argv, env

    def start_server(self, leg):
        argv, env = self.leg_cmd(leg, [self.args.sockbench, "server", "-p", "0",
                                       "-b", "127.0.0.1"])
        self.log(f"$ [{leg} server] {' '.join(argv)}")
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=self.log_file, env=env, start_new_session=True)
        port = None
        sel = selectors.DefaultSelector()
        sel.register(p.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + 30
        buf = b""
        while port is None and time.monotonic() < deadline:
            if not sel.select(timeout=max(deadline - time.monotonic(), 0)):
                break
            chunk = os.read(p.stdout.fileno(), 4096)
            if not chunk:
                break
            buf += chunk
            m = re.search(rb"sockbench: listening on port (\d+)\n", buf)
            if m:
                port = int(m.group(1))
        sel.close()
        if port is None:
            self.kill(p)
            self.log(f"[{leg} server] stdout: {buf.decode(errors='replace')}")
            raise RunFailed(f"the {leg} server did not start listening "
                            f"(exit {p.returncode}; see {self.log_file.name})")
        self.log(f"[{leg} server] pid {p.pid}, port {port}")
        self.servers[leg] = (p, port)
        return port

    def server_port(self, leg):
        if leg in self.servers:
            p, port = self.servers[leg]
            if p.poll() is None:
                return port
            self.failures.append(f"the {leg} server exited (status {p.returncode}); restarted")
            self.progress(self.failures[-1])
            del self.servers[leg]
        return self.start_server(leg)

    def kill(self, p):
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()

    def stop_servers(self):
        """SIGTERM: the server exits normally, so the layer writes its stats lines."""
        for leg, (p, _) in list(self.servers.items()):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
            try:
                rc = p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill(p)
                rc = "killed after SIGTERM did not stop it"
            self.log(f"[{leg} server] stopped: exit {rc}")
            if rc != 0:
                self.failures.append(f"the {leg} server ended with status {rc} (it reports "
                                     f"connection errors; see {self.log_file.name})")
            p.stdout.close()
        self.servers.clear()

    def client(self, leg, mode_args, timeout):
        port = self.server_port(leg)
        argv, env = self.leg_cmd(leg, [self.args.sockbench] + mode_args[:1] +
                                 ["-c", "127.0.0.1", "-p", str(port)] + mode_args[1:])
        self.log(f"$ [{leg}] {' '.join(argv)}")
        try:
            p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                               env=env, timeout=timeout, start_new_session=True)
        except subprocess.TimeoutExpired as e:
            # run() killed the client; its children (if any) share its session.
            raise RunFailed(f"no result within {timeout:.0f} s: {e.stderr or ''}") from None
        if p.stderr:
            self.log(p.stderr)
        if p.returncode != 0:
            raise RunFailed(f"exit {p.returncode}: {p.stderr.strip()[-500:]}")
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        if not lines:
            raise RunFailed(f"no JSON result; stdout: {p.stdout[-500:]!r}")
        self.log(lines[-1])
        return json.loads(lines[-1])

    # --- measurements ----------------------------------------------------------------------

    def check_path(self, leg, result):
        if self.args.no_sdp:
            return
        want = "sdp" if LEGS[leg][0] else "unknown"
        if result.get("path") != want:
            raise RunFailed(f"path {result.get('path')!r}, expected {want!r}"
                            + (" (the layer did not take the connection)" if want == "sdp"
                               else " (a layer is loaded in the plain leg)"))
        if leg in ("bcopy", "zcopy"):
            st = result.get("sdp_stats") or {}
            moved = st.get("bcopy_tx", 0) + st.get("zcopy_tx", 0)
            if leg == "bcopy" and st.get("zcopy_tx", 0):
                raise RunFailed(f"ZCopy threshold 0, yet zcopy_tx={st['zcopy_tx']}")
            if leg == "zcopy" and not st.get("zcopy_tx"):
                raise RunFailed(f"ZCopy threshold 1, yet zcopy_tx=0 (bcopy_tx={moved})")
        if leg == "slices":
            legs = result.get("legs") or []
            if [g.get("thresh") for g in legs] != [t for _, t in SLICE_LEGS]:
                raise RunFailed(f"legs {[g.get('thresh') for g in legs]}, expected "
                                f"{[t for _, t in SLICE_LEGS]}")
            for (name, t), g in zip(SLICE_LEGS, legs):
                if not g["bytes"] or not g["seconds"] > 0:
                    raise RunFailed(f"leg {t} moved nothing in its slices")
                if name == "bcopy" and g["zcopy_tx"]:
                    raise RunFailed(f"leg 0 (BCopy only), yet zcopy_tx={g['zcopy_tx']}")
                if name == "zcopy" and not g["zcopy_tx"]:
                    raise RunFailed("leg 1 (every send ZCopy), yet zcopy_tx=0")

    def measure(self, phase, rep, leg, size, conns=1):
        what = f"rep {rep} {phase} {leg} {size_label(size)}" + (f" x{conns}" if conns > 1 else "")
        a = self.args
        if phase == "latency":
            iters = a.pp_iters
            mode = ["pingpong", "-s", str(size), "-i", str(iters), "-w", str(max(iters // 10, 50))]
            timeout = 120
        else:
            mode = ["stream", "-s", str(size), "-t", str(a.seconds), "-n", str(conns)]
            timeout = a.seconds + 90
            if leg == "slices":
                mode += ["--legs", ",".join(t for _, t in SLICE_LEGS),
                         "--slice", str(a.slice)]
                timeout += len(SLICE_LEGS) * (a.seconds + a.slice)
        start = time.monotonic()
        run = {"phase": phase, "rep": rep, "leg": leg, "size": size, "conns": conns}
        try:
            r = self.client(leg, mode, timeout)
            run["rejected_result"] = r  # kept for the record; figures only from checked runs
            self.check_path(leg, r)
            run["result"] = run.pop("rejected_result")
            fig = (f"{r['lat_us_median']:.2f} us (p99 {r['lat_us_p99']:.2f})"
                   if phase == "latency" else
                   ", ".join(f"{n} {g['MBps']:.1f} MB/s"
                             for (n, _), g in zip(SLICE_LEGS, r["legs"]))
                   if leg == "slices" else
                   f"{r['MBps']:.1f} MB/s, {r['cpu_s_per_GB']:.3g} CPU s/GB")
            self.progress(f"{what}: {fig} ({time.monotonic() - start:.1f} s)")
        except RunFailed as e:
            run["error"] = str(e)
            self.failures.append(f"{what}: {e}")
            self.progress(f"{what}: FAILED: {e}")
            self.log(f"FAILED: {what}: {e}")
        self.runs.append(run)

    def measure_refs(self, rep, purpose, sizes):
        """purpose: "pingpong" (the latency phase keeps the ping-pong) or "memcpy"."""
        argv = [self.args.sockbench, "refs", "-t", str(self.args.ref_seconds),
                "--pingpong-rounds", str(self.args.ref_rounds)]
        for s in sizes:
            argv += ["-s", str(s)]
        self.log(f"$ [refs] {' '.join(argv)}")
        ref = {"rep": rep, "purpose": purpose, "memcpy_MBps": {}}
        try:
            p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                               env=self.base_env, timeout=120)
            self.log(p.stdout + p.stderr)
            if p.returncode != 0:
                raise RunFailed(f"exit {p.returncode}: {p.stderr.strip()[-300:]}")
            for line in p.stdout.splitlines():
                r = json.loads(line)
                if r["mode"] == "shm_pingpong":
                    ref["shm_half_rtt_us"] = r["half_rtt_us"]
                elif r["mode"] == "memcpy":
                    ref["memcpy_MBps"][r["size"]] = r["MBps"]
        except (RunFailed, subprocess.TimeoutExpired, ValueError, KeyError) as e:
            self.failures.append(f"rep {rep} references: {e}")
            self.progress(self.failures[-1])
        self.refs.append(ref)
        return ref

    def run(self):
        a = self.args
        order = lambda rep, legs: legs if rep % 2 else legs[::-1]  # noqa: E731
        for rep in range(1, a.reps + 1):
            if "stream" in a.only or "latency" in a.only:
                if "stream" in a.only:
                    for size in a.stream_sizes:
                        for leg in order(rep, ["sdp", "tcp"]):
                            self.measure("stream", rep, leg, size)
                if "latency" in a.only:
                    # The reference just before the points it stands beside.
                    ref = self.measure_refs(rep, "pingpong", [4 * KiB])
                    if "shm_half_rtt_us" in ref:
                        self.progress(f"rep {rep} shared-memory ping-pong: "
                                      f"{ref['shm_half_rtt_us']:.3f} us")
                    for size in a.pp_sizes:
                        for leg in order(rep, ["sdp", "tcp"]):
                            self.measure("latency", rep, leg, size)
                self.stop_servers()
            if "zcopy" in a.only:
                ref = self.measure_refs(rep, "memcpy", sorted(set(a.zc_sizes) | {4 * MiB}))
                if 4 * MiB in ref["memcpy_MBps"]:
                    self.progress(f"rep {rep} memcpy 4 MiB: {ref['memcpy_MBps'][4 * MiB]:.0f} MB/s")
                for conns in a.zc_conns:
                    for size in a.zc_sizes:
                        # Without the layer there is no threshold to set (--no-sdp).
                        legs = ["bcopy", "zcopy"] + ([] if a.no_sdp else ["slices"])
                        for leg in order(rep, legs):
                            self.measure("zcopy", rep, leg, size, conns)
                self.stop_servers()

    # --- the layer's own account -----------------------------------------------------------

    def check_stats_file(self):
        """Sums the layer's PCIENTB_SDP_STATS lines of sockbench's client connections; they
        must account for at least the bytes the SDP-leg clients sent."""
        if self.args.no_sdp:
            return {"checked": False, "text": "layer stats: not checked (--no-sdp)"}
        sent = 0
        for run in self.runs:
            r = run.get("result")
            if not r or not LEGS[run["leg"]][0]:
                continue
            if r["mode"] == "stream":
                sent += r["bytes"]
            else:
                sent += (r["iters"] + r["warmup"]) * r["size"]
        lines, paths, reasons, tx = 0, {}, {}, 0
        malformed = []
        with open(self.stats_path) as f:
            for line in f:
                m = STATS_RE.match(line.strip())
                if not m:
                    continue
                fields = dict(w.partition("=")[::2] for w in m.group(1).split())
                try:
                    lines += 1
                    paths[fields["path"]] = paths.get(fields["path"], 0) + 1
                    if fields["path"] != "sdp":
                        reasons[fields.get("reason", "?")] = reasons.get(fields.get("reason", "?"),
                                                                         0) + 1
                    if fields.get("role") == "client" and fields["path"] == "sdp":
                        tx += int(fields["bcopy_tx"]) + int(fields["zcopy_tx"])
                except (KeyError, ValueError):
                    malformed.append(line.strip())
        text = (f"layer stats ({os.path.basename(self.stats_path)}): {lines} connection lines "
                f"({', '.join(f'{k}: {v}' for k, v in sorted(paths.items())) or 'none'}); "
                f"client SDP bytes sent {tx / 1e9:.3f} GB, the SDP-leg clients sent "
                f"{sent / 1e9:.3f} GB")
        problems = []
        if malformed:
            problems.append(f"{len(malformed)} malformed line(s), e.g. {malformed[0]!r}")
        if tx < sent:
            problems.append("the layer accounts for fewer bytes than were sent")
        if reasons:
            problems.append("fallbacks to TCP: "
                            + ", ".join(f"{k} x{v}" for k, v in sorted(reasons.items())))
        if problems:
            text += "; CHECK FAILED: " + "; ".join(problems)
            self.failures.append(text)
        return {"checked": True, "lines": lines, "paths": paths, "fallback_reasons": reasons,
                "client_sdp_tx_bytes": tx, "sdp_leg_sent_bytes": sent, "ok": not problems,
                "text": text}


# --- summaries -------------------------------------------------------------------------------

def figures(runs, phase, leg, size, conns, key):
    return [r["result"][key] for r in runs
            if r["phase"] == phase and r["leg"] == leg and r["size"] == size
            and r["conns"] == conns and "result" in r]


def summarize(bench, args):
    runs = bench.runs
    res = {}
    res["stream"] = []
    for size in args.stream_sizes if "stream" in args.only else []:
        row = {"size": size}
        for leg in ("sdp", "tcp"):
            mbps = figures(runs, "stream", leg, size, 1, "MBps")
            cpu = figures(runs, "stream", leg, size, 1, "cpu_s_per_GB")
            row[f"{leg}_MBps"], row[f"{leg}_MBps_runs"] = median(mbps), mbps
            row[f"{leg}_cpu_s_per_GB"] = median(cpu)
        row["ratio"] = ratio(row["sdp_MBps"], row["tcp_MBps"])
        res["stream"].append(row)

    # Each reference from the runs it was taken beside.
    shm = [r["shm_half_rtt_us"] for r in bench.refs
           if r["purpose"] == "pingpong" and "shm_half_rtt_us" in r]
    res["shm_half_rtt_us"] = median(shm)
    res["latency"] = []
    for size in args.pp_sizes if "latency" in args.only else []:
        row = {"size": size}
        for leg in ("sdp", "tcp"):
            lat = figures(runs, "latency", leg, size, 1, "lat_us_median")
            row[f"{leg}_us"], row[f"{leg}_us_runs"] = median(lat), lat
            row[f"{leg}_p99_us"] = median(figures(runs, "latency", leg, size, 1, "lat_us_p99"))
        row["ratio"] = ratio(row["sdp_us"], row["tcp_us"])
        row["sdp_x_shm"] = ratio(row["sdp_us"], res["shm_half_rtt_us"])
        res["latency"].append(row)

    memcpy = {}
    for r in bench.refs:
        if r["purpose"] != "memcpy":
            continue
        for size, v in r["memcpy_MBps"].items():
            memcpy.setdefault(size, []).append(v)
    res["memcpy_MBps"] = {size: median(v) for size, v in sorted(memcpy.items())}
    res["zcopy"], res["crossover"] = [], {}
    for conns in args.zc_conns if "zcopy" in args.only else []:
        rows = []
        for size in args.zc_sizes:
            row = {"conns": conns, "size": size}
            for leg in ("bcopy", "zcopy"):
                row[f"{leg}_MBps"] = median(figures(runs, "zcopy", leg, size, conns, "MBps"))
                row[f"{leg}_cpu_s_per_GB"] = median(
                    figures(runs, "zcopy", leg, size, conns, "cpu_s_per_GB"))
                st = [r["result"].get("sdp_stats") for r in runs if r["phase"] == "zcopy"
                      and r["leg"] == leg and r["size"] == size and r["conns"] == conns
                      and "result" in r and r["result"].get("sdp_stats")]
                moved = sum(s["bcopy_tx"] + s["zcopy_tx"] for s in st)
                row[f"{leg}_zcopy_share"] = (sum(s["zcopy_tx"] for s in st) / moved
                                             if moved else None)
                # Of the ZCopy bytes, those written into buffers the receiver offered.
                zc = sum(s["zcopy_tx"] for s in st)
                row[f"{leg}_wzcopy_share"] = (sum(s.get("wzcopy_tx", 0) for s in st) / zc
                                              if zc else None)
            row["zcopy_share"] = row.pop("zcopy_zcopy_share")
            row["wzcopy_share"] = row.pop("zcopy_wzcopy_share")
            row.update(slices_row(runs, size, conns))
            row["bw_ratio"] = ratio(row["zcopy_MBps"], row["bcopy_MBps"])
            row["cpu_ratio"] = ratio(row["zcopy_cpu_s_per_GB"], row["bcopy_cpu_s_per_GB"])
            row["zcopy_x_memcpy"] = ratio(row["zcopy_MBps"], res["memcpy_MBps"].get(size))
            rows.append(row)
        res["zcopy"] += rows
        res["crossover"][conns] = crossover(rows)
    res["auto"] = auto_against_fixed(res["zcopy"])
    res["targets"] = targets(res)
    return res


def slices_row(runs, size, conns):
    """auto beside the fixed choices at one point, from the runs in which they took turns on
    the same connections: per run each leg's MB/s; auto / the better of BCopy and ZCopy in
    that run, and its median over the runs."""
    sl = [r["result"]["legs"] for r in runs if r["phase"] == "zcopy" and r["leg"] == "slices"
          and r["size"] == size and r["conns"] == conns and "result" in r]
    legs = [dict(zip((n for n, _ in SLICE_LEGS), run)) for run in sl]
    row = {"slice_runs": [{n: g["MBps"] for n, g in run.items()} for run in legs]}
    for name, _ in SLICE_LEGS:
        row[f"slice_{name}_MBps"] = median([run[name]["MBps"] for run in legs])
    row["auto_MBps"] = row.pop("slice_auto_MBps")
    row["auto_x_better"] = median([run["auto"]["MBps"] / max(run["bcopy"]["MBps"],
                                                             run["zcopy"]["MBps"])
                                   for run in legs])
    moved = sum(run["auto"]["bcopy_tx"] + run["auto"]["zcopy_tx"] for run in legs)
    row["auto_zcopy_share"] = (sum(run["auto"]["zcopy_tx"] for run in legs) / moved
                               if moved else None)
    return row


def crossover(rows):
    """The smallest size from which ZCopy's bandwidth stays >= BCopy's, and a log-scale
    interpolation of where the ratio crosses 1 just below it."""
    pts = [(r["size"], r["bw_ratio"]) for r in rows if r["bw_ratio"] is not None]
    if not pts:
        return {"size": None, "estimate": None, "text": "n/a (no figures)"}
    first = None
    for i in range(len(pts)):
        if all(q >= 1 for _, q in pts[i:]):
            first = i
            break
    if first is None:
        return {"size": None, "estimate": None,
                "text": f"none: BCopy is faster up to {size_label(pts[-1][0])}"}
    if first == 0:
        return {"size": pts[0][0], "estimate": None,
                "text": f"<= {size_label(pts[0][0])} (ZCopy never slower)"}
    (s0, q0), (s1, q1) = pts[first - 1], pts[first]
    est = 2 ** (math.log2(s0) + (1 - q0) / (q1 - q0) * (math.log2(s1) - math.log2(s0)))
    return {"size": s1, "estimate": est,
            "text": f"{size_label(s1)} (interpolated {est / KiB:.0f} KiB)"}


def auto_against_fixed(rows):
    """The threshold `auto` against every fixed threshold T of the sweep (a send of at least
    T goes ZCopy: its figure at a point is the ZCopy leg's from T up, BCopy's below; T = inf
    is BCopy only), all from the runs in which auto, BCopy and ZCopy took turns: at each point
    the median over the runs of (MB/s / the better fixed choice in that run); the geometric
    mean of that over the points, and auto's worst point."""
    pts = [r for r in rows if r.get("slice_runs")]
    if not pts:
        return None
    def score(pick):
        return math.exp(statistics.fmean(
            math.log(median([pick(run, r["size"]) / max(run["bcopy"], run["zcopy"])
                             for run in r["slice_runs"]])) for r in pts))
    fixed = {}
    for t in sorted({r["size"] for r in pts}) + [math.inf]:
        fixed[t] = score(lambda run, size, t=t: run["zcopy"] if size >= t else run["bcopy"])
    best_t = max(fixed, key=fixed.get)
    worst = min(pts, key=lambda r: r["auto_x_better"])
    return {"auto_score": score(lambda run, size: run["auto"]),
            "fixed_scores": {("inf" if t == math.inf else t): v for t, v in fixed.items()},
            "best_fixed": "inf" if best_t == math.inf else best_t,
            "best_fixed_score": fixed[best_t],
            "worst": {"conns": worst["conns"], "size": worst["size"],
                      "ratio": worst["auto_x_better"]}}


def targets(res):
    out = []

    def add(name, value, goal, op, note=""):
        met = None if value is None else (value >= goal if op == ">=" else value <= goal)
        out.append({"target": name, "value": value, "goal": f"{op} {goal}x", "met": met,
                    "note": note})

    big = [r for r in res["stream"] if r["size"] >= 64 * KiB]
    if big:
        worst = min((r for r in big if r["ratio"] is not None), key=lambda r: r["ratio"],
                    default=None)
        add("stream throughput, writes >= 64 KiB, SDP / TCP",
            worst["ratio"] if worst else None, 3, ">=",
            f"worst at {size_label(worst['size'])}" if worst else "")
    one = next((r for r in res["stream"] if r["size"] == 1), None)
    if one:
        add("stream throughput 1 B writes, SDP / TCP", one["ratio"], 20, ">=")
    lat = next((r for r in res["latency"] if r["size"] == 64), None)
    if lat:
        add("ping-pong latency 64 B (median one-way), SDP / TCP", lat["ratio"], 0.1, "<=")
    z1 = next((r for r in res["zcopy"] if r["conns"] == 1 and r["size"] == 4 * MiB), None)
    if z1:
        add("ZCopy bandwidth 4 MiB (1 connection) / memcpy 4 MiB", z1["zcopy_x_memcpy"], 0.7,
            ">=")
    z8 = next((r for r in res["zcopy"] if r["conns"] == 8 and r["size"] == 4 * MiB), None)
    if z8:
        add("CPU s/GB at 8 connections (4 MiB), ZCopy / BCopy", z8["cpu_ratio"], 0.3, "<=")
    a = res.get("auto")
    if a:
        w = a["worst"]
        add("ZCopy threshold auto, worst point / the better fixed choice there", w["ratio"],
            0.9, ">=", f"at {size_label(w['size'])} x{w['conns']}")
        best = a["best_fixed"]
        add("ZCopy threshold auto / the best single fixed threshold (geometric mean over the "
            "sweep)", a["auto_score"] / a["best_fixed_score"], 1, ">=",
            f"best fixed: {'BCopy only' if best == 'inf' else size_label(best)}")
    return out


def fmt(v, spec=".1f", none="n/a"):
    return none if v is None else format(v, spec)


def markdown(res, meta, traffic, failures):
    L = []
    L.append("# SDP benchmarks: pcientb-sdp beside kernel TCP loopback (sockbench)")
    L.append("")
    if meta["no_sdp"]:
        L.append("**DRY RUN (--no-sdp): both legs are kernel TCP; the \"SDP\", \"BCopy\" and "
                 "\"ZCopy\" columns are not the layer.**")
        L.append("")
    L.append(f"{meta['date']}, {meta['reps']} alternating repetition(s)"
             f"{' (--quick)' if meta['quick'] else ''}, stream points {meta['seconds']} s, "
             f"ping-pong {meta['pp_iters']} round trips; medians over repetitions; "
             f"load average {meta['load_start']} at start, {meta['load_end']} at the end "
             f"({meta['cpus']} CPUs). MB/s = 10^6 B/s; CPU s/GB = client + server CPU "
             f"seconds per 10^9 bytes.")
    L.append("")
    L.append("## Targets")
    L.append("")
    L.append("| target | measured | goal | met |")
    L.append("| --- | ---: | ---: | --- |")
    for t in res["targets"]:
        met = "n/a" if t["met"] is None else ("yes" if t["met"] else "NO")
        note = f" ({t['note']})" if t["note"] else ""
        L.append(f"| {t['target']}{note} | {fmt(t['value'], '.3f')}x | {t['goal']} | {met} |")
    if res["stream"]:
        L += ["", "## Stream throughput (the paper's Table 3 sweep), one connection", "",
              "| write size | SDP MB/s | TCP MB/s | SDP / TCP | SDP CPU s/GB | TCP CPU s/GB |",
              "| ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in res["stream"]:
            L.append(f"| {size_label(r['size'])} | {fmt(r['sdp_MBps'])} | {fmt(r['tcp_MBps'])} "
                     f"| {fmt(r['ratio'], '.2f')}x | {fmt(r['sdp_cpu_s_per_GB'], '.3g')} | "
                     f"{fmt(r['tcp_cpu_s_per_GB'], '.3g')} |")
    if res["latency"]:
        L += ["", "## Ping-pong latency, one-way (RTT/2), us", "",
              f"Shared-memory ping-pong reference (half RTT, bench/references): "
              f"{fmt(res['shm_half_rtt_us'], '.3f')} us.", "",
              "| size | SDP median | SDP p99 | TCP median | TCP p99 | SDP / TCP | SDP / shm |",
              "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in res["latency"]:
            L.append(f"| {size_label(r['size'])} | {fmt(r['sdp_us'], '.2f')} | "
                     f"{fmt(r['sdp_p99_us'], '.2f')} | {fmt(r['tcp_us'], '.2f')} | "
                     f"{fmt(r['tcp_p99_us'], '.2f')} | {fmt(r['ratio'], '.3f')}x | "
                     f"{fmt(r['sdp_x_shm'], '.1f')}x |")
    if res["zcopy"]:
        L += ["", "## Zero-copy SDP: BCopy (threshold 0), ZCopy (threshold 1) and auto", "",
              "BCopy and ZCopy: runs of their own (their CPU is that run's). auto: runs in which "
              "auto, BCopy and ZCopy took turns on the same connections (slices of "
              f"{meta['slice']} s, {meta['seconds']} s each; the receiver offers no buffers "
              "there, so their ZCopy is Read ZCopy only); auto / better is the median over "
              "those runs of auto / the better of the other two in the same run.", "",
              "memcpy reference (bench/references): "
              + ", ".join(f"{size_label(s)} {v:.0f} MB/s"
                          for s, v in res["memcpy_MBps"].items() if s in (64 * KiB, 4 * MiB)),
              ""]
        L.append("| conns | size | BCopy MB/s | ZCopy MB/s | Z / B | ZCopy / memcpy | "
                 "BCopy CPU s/GB | ZCopy CPU s/GB | Z / B CPU | ZCopy share | of it Write ZCopy | "
                 "auto MB/s | BCopy, ZCopy beside it | auto / better | auto's ZCopy share |")
        L.append("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
                 "| ---: | ---: | ---: | ---: |")
        pct = lambda v: "n/a" if v is None else f"{100 * v:.0f}%"  # noqa: E731
        for r in res["zcopy"]:
            L.append(f"| {r['conns']} | {size_label(r['size'])} | {fmt(r['bcopy_MBps'])} | "
                     f"{fmt(r['zcopy_MBps'])} | {fmt(r['bw_ratio'], '.2f')}x | "
                     f"{fmt(r['zcopy_x_memcpy'], '.2f')}x | "
                     f"{fmt(r['bcopy_cpu_s_per_GB'], '.3g')} | "
                     f"{fmt(r['zcopy_cpu_s_per_GB'], '.3g')} | {fmt(r['cpu_ratio'], '.2f')}x | "
                     f"{pct(r['zcopy_share'])} | {pct(r.get('wzcopy_share'))} | "
                     f"{fmt(r['auto_MBps'])} | {fmt(r['slice_bcopy_MBps'])}, "
                     f"{fmt(r['slice_zcopy_MBps'])} | "
                     f"{fmt(r['auto_x_better'], '.2f')}x | {pct(r['auto_zcopy_share'])} |")
        L += ["", "Crossover (smallest size from which ZCopy's bandwidth stays >= BCopy's):", ""]
        for conns, c in res["crossover"].items():
            L.append(f"- {conns} connection{'s' if conns > 1 else ''}: {c['text']}")
        a = res.get("auto")
        if a:
            L += ["", "Threshold `auto` against fixed thresholds, from the runs where they took "
                  "turns (geometric mean over the sweep of MB/s / the better fixed choice at "
                  "each point; 1.0 = always the better):",
                  "", f"- auto: {a['auto_score']:.3f}"]
            L += [f"- fixed {'BCopy only' if t == 'inf' else size_label(t)}: {v:.3f}"
                  for t, v in a["fixed_scores"].items()]
    L += ["", "## Checks", "", f"- {traffic['text']}"]
    if failures:
        L.append(f"- {len(failures)} failure(s):")
        L += [f"  - {f}" for f in failures]
    else:
        L.append("- every run completed; SDP legs on path sdp, TCP legs without the layer"
                 if not meta["no_sdp"] else "- every run completed (paths not checked)")
    return "\n".join(L) + "\n"


def make_plots(results, out_dir):
    """bench/plot.py sdp, with this Python or else Debian's (python3-matplotlib)."""
    pythons = [sys.executable] + (["/usr/bin/python3"] if os.path.exists("/usr/bin/python3")
                                  and os.path.realpath(sys.executable) != "/usr/bin/python3"
                                  else [])
    last = ""
    for py in pythons:
        p = subprocess.run([py, os.path.join(HERE, "plot.py"), "sdp", results, out_dir],
                           capture_output=True, text=True)
        if p.returncode == 0:
            return p.stdout.strip()
        last = (p.stdout + p.stderr).strip().splitlines()[-1:] or ["?"]
        last = f"{py}: {last[0]}"
    return (f"sdp_bench.py: no plots ({last}); apt-get install python3-matplotlib, then "
            f"bench/plot.py sdp {results} {out_dir}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 2)[2])
    ap.add_argument("outdir", nargs="?", default="./results/sdp")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int)
    ap.add_argument("--seconds", type=float)
    ap.add_argument("--slice", type=float)
    ap.add_argument("--only", default=",".join(PHASES))
    ap.add_argument("--launcher")
    ap.add_argument("--sockbench")
    ap.add_argument("--no-sdp", action="store_true")
    args = ap.parse_args()
    args.only = [p.strip() for p in args.only.split(",") if p.strip()]
    if not args.only or any(p not in PHASES for p in args.only):
        ap.error(f"--only takes a comma-separated subset of {','.join(PHASES)}")
    if args.reps is None:
        args.reps = 1 if args.quick else 3
    if args.seconds is None:
        args.seconds = 0.15 if args.quick else 1.0
    if args.reps < 1 or not args.seconds > 0:
        ap.error("--reps must be >= 1 and --seconds > 0")
    args.stream_sizes = QUICK_STREAM_SIZES if args.quick else STREAM_SIZES
    args.pp_sizes = QUICK_PP_SIZES if args.quick else PP_SIZES
    args.zc_conns = QUICK_ZC_CONNS if args.quick else ZC_CONNS
    args.zc_sizes = QUICK_ZC_SIZES if args.quick else ZC_SIZES
    args.pp_iters = 1000 if args.quick else 5000
    args.ref_seconds = 0.02 if args.quick else 0.1
    if args.slice is None:
        args.slice = 0.05 if args.quick else 0.1
    if not args.slice > 0:
        ap.error("--slice must be > 0")
    args.ref_rounds = 2000 if args.quick else 20000

    args.sockbench = find_program(args.sockbench, "SOCKBENCH", "sockbench")
    if not args.sockbench:
        sys.exit("sdp_bench.py: sockbench not found; build it (cmake --build build --target "
                 "sockbench) or pass --sockbench / set SOCKBENCH")
    if not args.no_sdp:
        args.launcher = find_program(args.launcher, "PCIENTB_SDP_LAUNCHER", "pcientb-sdp")
        if not args.launcher:
            sys.exit("sdp_bench.py: pcientb-sdp not found; build it or pass --launcher / set "
                     "PCIENTB_SDP_LAUNCHER (--no-sdp runs both legs on kernel TCP)")
    os.makedirs(args.outdir, exist_ok=True)

    bench = Bench(args, args.outdir)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "argv": sys.argv,
            "quick": args.quick, "reps": args.reps, "seconds": args.seconds, "slice": args.slice,
            "pp_iters": args.pp_iters, "phases": args.only, "no_sdp": args.no_sdp,
            "sockbench": args.sockbench, "launcher": args.launcher, "fabric": bench.fabric,
            "cpus": os.cpu_count(), "load_start": loadavg()}
    bench.log(f"sdp_bench.py: {json.dumps(meta)}")
    start = time.monotonic()
    try:
        bench.run()
    except KeyboardInterrupt:
        bench.failures.append("interrupted")
    finally:
        bench.stop_servers()
    meta["load_end"] = loadavg()
    meta["elapsed_s"] = round(time.monotonic() - start, 1)
    traffic = bench.check_stats_file()
    res = summarize(bench, args)
    # Points that have no figure for one of their legs.
    for phase, rows, keys in (("stream", res["stream"], ("sdp_MBps", "tcp_MBps")),
                              ("latency", res["latency"], ("sdp_us", "tcp_us")),
                              ("zcopy", res["zcopy"], ("bcopy_MBps", "zcopy_MBps"))):
        for r in rows:
            missing = [k.split("_")[0] for k in keys if r[k] is None]
            if missing:
                bench.failures.append(f"{phase} {size_label(r['size'])}"
                                      + (f" x{r['conns']}" if "conns" in r else "")
                                      + f": no figure for {', '.join(missing)}")
    text = markdown(res, meta, traffic, bench.failures)
    print(text, end="")
    out = bench.out
    with open(out("sdp-bench.md"), "w") as f:
        f.write(text)
    doc = {"meta": meta, "summary": res, "traffic": traffic, "failures": bench.failures,
           "references": bench.refs, "runs": bench.runs}
    with open(out("sdp-bench.json"), "w") as f:
        json.dump(doc, f, indent=1)
    print(f"\nsdp_bench.py: wrote {out('sdp-bench.md')}, {out('sdp-bench.json')} "
          f"({meta['elapsed_s']} s)")
    print(make_plots(out("sdp-bench.json"), args.outdir))
    bench.log_file.close()
    if bench.failures:
        print(f"sdp_bench.py: {len(bench.failures)} failure(s); see sdp-bench.md and "
              f"{out('sdp-bench.log')}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
