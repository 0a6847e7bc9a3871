#!/usr/bin/env python3
"""Real servers under pcientb-sdp beside kernel TCP loopback (issue 12, item 3).

Each workload runs an unmodified server and its load generator from Debian twice per
repetition: both under pcientb-sdp (one fabric), and both plain (kernel TCP loopback), the two
legs alternating (which goes first alternates by repetition) so that the machine's fast and
slow spells hit both. Figures are medians over the repetitions; the ratio is SDP / TCP.

  redis       redis-server; redis-benchmark -c 50 -n N -t set,get, -P 1 and -P 16
  memcached   memcached -t 2; memcaslap -T 1 -c 8 for S seconds (TPS)
  nginx       nginx (master + 1 worker, sendfile); ab -k -c 8: a 4 KiB file and a 1 MiB file
              (requests/s), and ab without keep-alive (a connection per request) on 4 KiB

Targets (issue 12; reported, not enforced): redis-benchmark -P 1 >= 2x TCP, memcached >= 2x,
nginx >= 1.5x (ab -k).

Every SDP-leg run must have taken every client connection onto SDP (the layer's statistics
file: conn lines of the load generator with path=sdp, none with path=tcp); a run that did not,
or whose generator failed or reported errors, counts as a failure and gives no figure. Exit
status 0 when every point has its figures and every check passed, 1 otherwise.

usage: scripts/server-bench.sh [OUTPUT_DIR] [--reps N] [--only W1,W2] [--quick]
                               [--launcher PATH]
  OUTPUT_DIR defaults to ./results/servers; --quick: one repetition of short runs (a smoke
  run, about a minute); the full run takes about 5 minutes. Writes server-bench.md and
  server-bench.json.
"""
import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
LOOP = "127.0.0.1"


class RunFailed(Exception):
    pass


def free_port():
    with socket.socket() as s:
        s.bind((LOOP, 0))
        return s.getsockname()[1]


def listening(port):
    """Whether some process listens on TCP `port` (/proc/net/tcp: no connection is made, so
    the server's layer sees nothing)."""
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                return True
    return False


# ---- workloads -----------------------------------------------------------------------------
# Each: the server's argv, the client's argv (templates: {port}, {dir}), how to stop the
# server, how to read the client's figures (name -> higher is better), and its errors.

def redis_client(pipeline, n):
    return ["redis-benchmark", "-h", LOOP, "-p", "{port}", "-c", "50", "-n", str(n),
            "-t", "set,get", "-P", str(pipeline), "--csv"]


def parse_redis(out, prefix):
    rates = dict(re.findall(r'^"(SET|GET)","([\d.]+)"', out, re.MULTILINE))
    if set(rates) != {"SET", "GET"}:
        raise RunFailed(f"redis-benchmark printed no SET/GET rates: {out[-300:]!r}")
    return {f"{prefix} {k}": float(v) for k, v in rates.items()}


def parse_memcaslap(out, _):
    m = re.search(r"Run time: [\d.]+s Ops: (\d+) TPS: (\d+)", out)
    if not m or int(m.group(2)) <= 0:
        raise RunFailed(f"memcaslap reported no operations: {out[-300:]!r}")
    return {"TPS": float(m.group(2))}


def parse_ab(out, prefix):
    done = re.search(r"^Complete requests:\s+(\d+)", out, re.MULTILINE)
    failed = re.search(r"^Failed requests:\s+(\d+)", out, re.MULTILINE)
    rate = re.search(r"^Requests per second:\s+([\d.]+)", out, re.MULTILINE)
    if not (done and failed and rate) or int(failed.group(1)) != 0:
        raise RunFailed(f"ab failed: {out[-400:]!r}")
    return {f"{prefix} req/s": float(rate.group(1))}


def nginx_setup(d):
    os.makedirs(os.path.join(d, "html"), exist_ok=True)
    os.makedirs(os.path.join(d, "logs"), exist_ok=True)
    with open(os.path.join(d, "html", "4k"), "wb") as f:
        f.write(os.urandom(4096))
    with open(os.path.join(d, "html", "1m"), "wb") as f:
        f.write(os.urandom(1 << 20))


def nginx_server(d, port):
    conf = os.path.join(d, f"nginx-{port}.conf")
    with open(conf, "w") as f:
        f.write(("user root;\n" if os.geteuid() == 0 else "") +
                "daemon off;\nworker_processes 1;\n"
                f"error_log {d}/logs/error.log;\npid {d}/nginx-{port}.pid;\n"
                "events { worker_connections 1024; }\n"
                "http { access_log off; sendfile on; keepalive_requests 1000000;\n"
                f"  client_body_temp_path {d}; proxy_temp_path {d}; fastcgi_temp_path {d};\n"
                f"  uwsgi_temp_path {d}; scgi_temp_path {d};\n"
                f"  server {{ listen {LOOP}:{port}; root {d}/html; }} }}\n")
    return ["nginx", "-p", d, "-c", conf]


def workloads(quick):
    n_redis = 20000 if quick else 100000
    secs = "1s" if quick else "3s"
    n_ab = 2000 if quick else 20000
    user = ["-u", "root"] if os.geteuid() == 0 else []
    redis_server = ["redis-server", "--port", "{port}", "--bind", LOOP, "--save", "",
                    "--appendonly", "no"]
    return {
        "redis": {
            "tools": ["redis-server", "redis-benchmark"],
            "server": redis_server, "stop": signal.SIGTERM,
            "clients": [("-P 1", redis_client(1, n_redis), parse_redis, 50),
                        ("-P 16", redis_client(16, n_redis * 4), parse_redis, 50)],
            "target": ("-P 1 GET", 2.0), "target2": ("-P 1 SET", 2.0)},
        "memcached": {
            "tools": ["memcached", "memcaslap"],
            "server": ["memcached", *user, "-p", "{port}", "-l", LOOP, "-t", "2", "-U", "0"],
            "stop": signal.SIGTERM,
            "clients": [("", ["memcaslap", "-s", f"{LOOP}:{{port}}", "-t", secs, "-T", "1",
                              "-c", "8"], parse_memcaslap, 8)],
            "target": ("TPS", 2.0)},
        "nginx": {
            "tools": ["nginx", "ab"], "setup": nginx_setup,
            "server": nginx_server, "stop": signal.SIGQUIT,
            "clients": [("4 KiB -k", ["ab", "-k", "-n", str(n_ab), "-c", "8",
                                      f"http://{LOOP}:{{port}}/4k"], parse_ab, 8),
                        ("1 MiB -k", ["ab", "-k", "-n", str(n_ab // 10), "-c", "8",
                                      f"http://{LOOP}:{{port}}/1m"], parse_ab, 8),
                        ("4 KiB new connection each", ["ab", "-n", str(n_ab // 4), "-c", "8",
                                                       f"http://{LOOP}:{{port}}/4k"],
                         parse_ab, n_ab // 4)],
            "target": ("4 KiB -k req/s", 1.5), "target2": ("1 MiB -k req/s", 1.5)},
    }


# ---- running -------------------------------------------------------------------------------

class Bench:
    def __init__(self, args):
        self.args = args
        self.dir = tempfile.mkdtemp(prefix="pcientb-server-bench.")
        self.fabric = f"server_bench_{os.getpid()}"
        self.log_file = open(os.path.join(args.outdir, "server-bench.log"), "w")
        self.runs, self.failures = [], []
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith("PCIENTB_SDP") and k != "LD_PRELOAD"}

    def log(self, msg):
        self.log_file.write(msg + "\n")
        self.log_file.flush()

    def progress(self, msg):
        print(f"server-bench: {msg}", flush=True)
        self.log(msg)

    def cmd(self, leg, argv, stats):
        if leg == "tcp":
            return argv, dict(self.env)
        env = dict(self.env, PCIENTB_SDP_STATS=stats)
        return [self.args.launcher, "--fabric", self.fabric, "--"] + argv, env

    def run_point(self, rep, wl_name, wl, leg):
        port = free_port()
        stats = os.path.join(self.dir, f"stats-{wl_name}-{leg}-{rep}")
        fill = lambda a: [x.format(port=port, dir=self.dir) for x in a]  # noqa: E731
        server_argv = (wl["server"](self.dir, port) if callable(wl["server"])
                       else fill(wl["server"]))
        argv, env = self.cmd(leg, server_argv, stats)
        self.log(f"$ [{leg} server] {' '.join(argv)}")
        srv = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self.log_file,
                               stderr=self.log_file, env=env, start_new_session=True)
        figures = {}
        try:
            deadline = time.monotonic() + 30
            while not listening(port):
                if srv.poll() is not None or time.monotonic() > deadline:
                    raise RunFailed(f"the server did not listen (exit {srv.poll()})")
                time.sleep(0.05)
            for label, client, parse, conns in wl["clients"]:
                argv, env = self.cmd(leg, fill(client), stats)
                self.log(f"$ [{leg}] {' '.join(argv)}")
                start = time.monotonic()
                try:
                    p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True,
                                       text=True, env=env, timeout=300,
                                       start_new_session=True)
                except subprocess.TimeoutExpired:
                    raise RunFailed(f"{label or wl_name}: no result within 300 s") from None
                self.log(p.stdout[-3000:] + p.stderr[-2000:])
                if p.returncode != 0:
                    raise RunFailed(f"{label or wl_name}: exit {p.returncode}: "
                                    f"{p.stderr.strip()[-300:]}")
                got = parse(p.stdout + p.stderr, label)
                figures.update(got)
                self.log(f"{label}: {got} ({time.monotonic() - start:.1f} s)")
        finally:
            if srv.poll() is None:
                srv.send_signal(wl["stop"])
            try:
                srv.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(srv.pid, signal.SIGKILL)
                srv.wait()
        if leg == "sdp":
            self.check_sdp(stats, wl)
        return figures

    def check_sdp(self, stats, wl):
        """Every connection of the load generators went SDP."""
        clients = {os.path.basename(c[1][0])[:15] for c in wl["clients"]}
        paths = {"sdp": 0, "tcp": 0}
        try:
            with open(stats) as f:
                for line in f:
                    m = re.match(r"conn pid=\d+ prog=(\S+) role=client path=(\w+)", line)
                    if m and m.group(1) in clients:
                        paths[m.group(2)] += 1
        except FileNotFoundError:
            pass
        if paths["sdp"] == 0 or paths["tcp"]:
            raise RunFailed(f"the load generator's connections: {paths['sdp']} SDP, "
                            f"{paths['tcp']} TCP (all must be SDP)")

    def run(self):
        wls = workloads(self.args.quick)
        for name in self.args.only:
            wl = wls[name]
            missing = [t for t in wl["tools"] if not shutil.which(t)]
            if missing:
                self.failures.append(f"{name}: not installed: {', '.join(missing)} "
                                     "(scripts/setup.sh --deps-only)")
                self.progress(self.failures[-1])
                continue
            if "setup" in wl:
                wl["setup"](self.dir)
            for rep in range(1, self.args.reps + 1):
                legs = ["sdp", "tcp"] if rep % 2 else ["tcp", "sdp"]
                for leg in legs:
                    run = {"workload": name, "rep": rep, "leg": leg}
                    try:
                        run["figures"] = self.run_point(rep, name, wl, leg)
                        self.progress(f"rep {rep} {name} {leg}: " + ", ".join(
                            f"{k or name} {v:,.0f}" for k, v in run["figures"].items()))
                    except RunFailed as e:
                        run["error"] = str(e)
                        self.failures.append(f"rep {rep} {name} {leg}: {e}")
                        self.progress(f"rep {rep} {name} {leg}: FAILED: {e}")
                    self.runs.append(run)


def summarize(runs, only, quick):
    wls = workloads(quick)
    rows, targets = [], []
    for name in only:
        metrics = []
        for r in runs:
            if r["workload"] == name and "figures" in r:
                metrics += [m for m in r["figures"] if m not in metrics]
        for m in metrics:
            vals = {leg: [r["figures"][m] for r in runs if r["workload"] == name
                          and r["leg"] == leg and m in r.get("figures", {})]
                    for leg in ("sdp", "tcp")}
            med = {leg: statistics.median(v) if v else None for leg, v in vals.items()}
            ratio = med["sdp"] / med["tcp"] if med["sdp"] and med["tcp"] else None
            rows.append({"workload": name, "metric": m, "sdp": med["sdp"], "tcp": med["tcp"],
                         "ratio": ratio, "sdp_runs": vals["sdp"], "tcp_runs": vals["tcp"]})
        for key in ("target", "target2"):
            if key in wls[name]:
                metric, goal = wls[name][key]
                row = next((r for r in rows if r["workload"] == name and r["metric"] == metric),
                           None)
                value = row["ratio"] if row else None
                targets.append({"workload": name, "metric": metric, "value": value,
                                "goal": goal, "met": None if value is None else value >= goal})
    return rows, targets


def markdown(rows, targets, meta, failures):
    f = lambda v, spec=",.0f": "n/a" if v is None else format(v, spec)  # noqa: E731
    L = ["# Real servers: pcientb-sdp beside kernel TCP loopback", "",
         f"{meta['date']}, {meta['reps']} alternating repetition(s)"
         f"{' (--quick)' if meta['quick'] else ''}; medians; load average {meta['load']} "
         f"at start ({os.cpu_count()} CPUs). Server and load generator both under "
         "pcientb-sdp (one fabric) in the SDP leg, both plain in the TCP leg.", "",
         "## Targets", "", "| workload | metric | SDP / TCP | goal | met |",
         "| --- | --- | ---: | ---: | --- |"]
    for t in targets:
        met = "n/a" if t["met"] is None else ("yes" if t["met"] else "NO")
        L.append(f"| {t['workload']} | {t['metric']} | {f(t['value'], '.2f')}x | "
                 f">= {t['goal']}x | {met} |")
    L += ["", "## Figures (higher is better)", "",
          "| workload | metric | SDP | TCP | SDP / TCP |", "| --- | --- | ---: | ---: | ---: |"]
    for r in rows:
        L.append(f"| {r['workload']} | {r['metric']} | {f(r['sdp'])} | {f(r['tcp'])} | "
                 f"{f(r['ratio'], '.2f')}x |")
    L += ["", "## Checks", ""]
    if failures:
        L += [f"- {len(failures)} failure(s):"] + [f"  - {x}" for x in failures]
    else:
        L.append("- every run completed; every load-generator connection of the SDP legs "
                 "was on SDP")
    return "\n".join(L) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 2)[2])
    ap.add_argument("outdir", nargs="?", default="./results/servers")
    ap.add_argument("--reps", type=int)
    ap.add_argument("--only", default="redis,memcached,nginx")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--launcher")
    args = ap.parse_args()
    args.only = [w.strip() for w in args.only.split(",") if w.strip()]
    if not args.only or any(w not in workloads(False) for w in args.only):
        ap.error("--only takes a comma-separated subset of redis,memcached,nginx")
    args.reps = args.reps or (1 if args.quick else 3)
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    if not args.launcher:
        built = os.path.join(REPO, "build", "bin", "pcientb-sdp")
        args.launcher = built if os.access(built, os.X_OK) else shutil.which("pcientb-sdp")
    if not args.launcher:
        sys.exit("server_bench.py: pcientb-sdp not found; build the project "
                 "(scripts/setup.sh) or pass --launcher")
    os.makedirs(args.outdir, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "reps": args.reps,
            "quick": args.quick, "load": os.getloadavg()[0], "launcher": args.launcher}
    bench = Bench(args)
    try:
        bench.run()
    finally:
        shutil.rmtree(bench.dir, ignore_errors=True)
    rows, targets = summarize(bench.runs, args.only, args.quick)
    with open(os.path.join(args.outdir, "server-bench.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "targets": targets, "runs": bench.runs,
                   "failures": bench.failures}, f, indent=1)
    md = markdown(rows, targets, meta, bench.failures)
    with open(os.path.join(args.outdir, "server-bench.md"), "w") as f:
        f.write(md)
    print(md)
    print(f"server_bench.py: wrote {args.outdir}/server-bench.md, server-bench.json")
    sys.exit(1 if bench.failures else 0)


if __name__ == "__main__":
    main()
