"""Harness for the integration tests: unmodified verbs programs on pcientb0.

Every test runs the real tool (ibv_*_pingpong, perftest, qperf, pyverbs) under
pcientb-run, as a server and a client process on a free TCP port, on the
emulated fabric named by PCIENTB_FABRIC (CTest gives each test its own). Both
processes are bounded in time; on any failure the server is killed and both
outputs are printed.

Environment (set by tests/integration/CMakeLists.txt):
  PCIENTB_RUN     the launcher (build-tree bin/pcientb-run)
  PCIENTB_MPIRUN  the MPI launcher (build-tree bin/pcientb-mpirun)
  PCIENTB_FABRIC  the fabric this test's processes join
  ITEST_TIMEOUT   seconds each process may run (default 60)

Exit status: 0 pass, 1 fail, 77 skip (a tool is not installed).
"""

import atexit
import errno
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

SKIP = 77
DEVICE = "pcientb0"

# Lines that mean something went wrong, in any tool's output.
ERROR_RE = re.compile(
    r"error|fail|couldn'?t|could not|unable|invalid|not supported|unsupported|"
    r"abort|segmentation|core dumped|\btimed? ?out\b|mismatch|wrong|corrupt|"
    r"cannot|can't|denied|refused|unexpected|panic|assert",
    re.IGNORECASE,
)


class TestFailure(Exception):
    pass


def log(msg):
    print(f"[itest] {msg}", flush=True)


def fail(msg):
    raise TestFailure(msg)


def require_tools(*names):
    """Exit with the CTest skip code when a tool is not installed."""
    missing = [n for n in names if shutil.which(n) is None]
    if missing:
        print(f"[itest] SKIP: not installed: {' '.join(missing)}", flush=True)
        sys.exit(SKIP)


def _launcher_from(var):
    run = os.environ.get(var)
    if not run or not os.access(run, os.X_OK):
        print(f"[itest] {var}={run!r} is not an executable launcher", flush=True)
        sys.exit(1)
    return run


def launcher():
    return _launcher_from("PCIENTB_RUN")


def mpi_launcher():
    return _launcher_from("PCIENTB_MPIRUN")


def fabric():
    f = os.environ.get("PCIENTB_FABRIC")
    if not f:
        f = f"itest_{os.getpid()}"
        os.environ["PCIENTB_FABRIC"] = f
    return f


def default_timeout():
    return float(os.environ.get("ITEST_TIMEOUT", "60"))


def free_port():
    """A TCP port free on both 127.0.0.1 and ::1 right now (the kernel picks it)."""
    for _ in range(20):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s6:
                s6.bind(("::1", port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                continue  # taken on ::1: a client resolving localhost may go there
        return port
    fail("could not find a free TCP port")


def _listening_inodes(port):
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    local, state, inode = fields[1], fields[3], fields[9]
                    if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                        inodes.add(inode)
        except FileNotFoundError:
            pass
    return inodes


def _process_sockets(pid):
    socks = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                socks.add(target[8:-1])
    except OSError:
        pass
    return socks


class Proc:
    """A tool run under pcientb-run in its own process group, output to a file."""

    def __init__(self, name, argv, timeout=None, env=None, cwd=None, launch=True, launch_opts=()):
        self.name = name
        # Line-buffered stdout (stdbuf), so that what a tool printed before it
        # was killed at its time limit is in the log.
        stdbuf = ["stdbuf", "-oL", "-eL"] if shutil.which("stdbuf") else []
        run = [launcher(), "--fabric", fabric(), *launch_opts, "--"] if launch else []
        self.argv = stdbuf + run + list(argv)
        self.timeout = timeout if timeout is not None else default_timeout()
        self.out = tempfile.TemporaryFile(mode="w+", prefix=f"itest-{name}-")
        self.timed_out = False
        self.killed = False
        full_env = dict(os.environ)
        if env:
            full_env.update(env)
        log(f"{name}: {' '.join(self.argv)}")
        self.start = time.monotonic()
        self.p = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=self.out,
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=cwd,
            start_new_session=True,
        )
        self.pid = self.p.pid
        self.rc = None
        self.elapsed = None

    def remaining(self):
        return self.timeout - (time.monotonic() - self.start)

    def poll(self):
        if self.rc is None:
            rc = self.p.poll()
            if rc is not None:
                self._done(rc)
        return self.rc

    def _done(self, rc):
        self.rc = rc
        self.elapsed = time.monotonic() - self.start

    def wait(self, timeout=None):
        """Wait for exit; past its time limit the whole group is killed."""
        limit = self.remaining() if timeout is None else min(timeout, self.remaining())
        try:
            self._done(self.p.wait(timeout=max(limit, 0)))
        except subprocess.TimeoutExpired:
            if timeout is not None and timeout < self.remaining():
                return None
            self.timed_out = True
            self.kill()
        return self.rc

    def kill(self, sig=signal.SIGKILL):
        if self.rc is not None:
            return
        self.killed = True
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            pass
        try:
            self._done(self.p.wait(timeout=5))
        except subprocess.TimeoutExpired:
            os.killpg(self.pid, signal.SIGKILL)
            self._done(self.p.wait())
        # MPI launchers put their ranks in process groups of their own; the
        # session (start_new_session) still holds them all.
        kill_session(self.pid)

    def stop(self):
        """Ask a server that never exits by itself (qperf) to stop: TERM, then KILL."""
        if self.rc is None:
            self.kill(signal.SIGTERM)

    def output(self):
        self.out.seek(0)
        return self.out.read()

    def status(self):
        if self.timed_out:
            return f"timed out after {self.timeout:.0f}s (killed)"
        if self.rc is None:
            return "running"
        if self.rc < 0:
            return f"killed by signal {-self.rc}"
        return f"exit {self.rc} after {self.elapsed:.2f}s"

    def dump(self):
        print(f"----- {self.name}: {' '.join(self.argv)} [{self.status()}]")
        sys.stdout.write(self.output())
        print(f"----- end of {self.name}", flush=True)

    def wait_cm_listening(self, port, ps=0x106, timeout=None):
        """True once a pcientb rdma_cm listener is on (port space, port) of this
        fabric (librdmacm_glue: an abstract AF_UNIX name that listens)."""
        name = f"@pcientb-cm/{fabric()}/{ps:x}/{port}"
        deadline = time.monotonic() + (timeout if timeout is not None else 30)
        while time.monotonic() < deadline:
            if self.poll() is not None:
                return False
            with open("/proc/net/unix") as f:
                for line in f:
                    fields = line.split()
                    if len(fields) >= 8 and fields[7] == name and fields[3] == "00010000":
                        return True
            time.sleep(0.02)
        return False

    def wait_listening(self, port, timeout=None):
        """True once this process listens on TCP `port` (it owns the socket)."""
        deadline = time.monotonic() + (timeout if timeout is not None else 30)
        while time.monotonic() < deadline:
            if self.poll() is not None:
                return False
            inodes = _listening_inodes(port)
            if inodes and (inodes & _process_sockets(self.pid)):
                return True
            time.sleep(0.02)
        return False


def kill_session(sid):
    """SIGKILL every process left in session `sid` (the group leader may be gone)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # Fields after the command name (which may hold spaces): state ppid pgrp session
                rest = f.read().rsplit(")", 1)[1].split()
            if int(rest[3]) == sid:
                os.kill(int(entry), signal.SIGKILL)
        except (OSError, IndexError, ValueError):
            pass


def error_lines(text, allow=()):
    """Lines of `text` that look like errors, except those matching `allow` regexes."""
    bad = []
    for line in text.splitlines():
        if ERROR_RE.search(line) and not any(re.search(a, line) for a in allow):
            bad.append(line)
    return bad


BIND_ERRORS = re.compile(r"address already in use|couldn'?t listen|bind", re.IGNORECASE)


def run_pair(server_argv, client_argv, *, port_placeholder="{port}", timeout=None,
             server_persists=False, env=None, listen_timeout=30, attempts=3, port=None,
             ready=None, launch_opts=()):
    """Start the server, wait until it listens, run the client, then reap both.

    `{port}` in either argv is replaced by `port`, or a free port; `launch_opts` go to
    pcientb-run (e.g. --rsockets). When the
    server fails to bind (another process took the port in between) it is
    retried on a new port. `ready(server, port, timeout)` says when the server
    listens (default: on that TCP port). Returns (server, client) Proc objects;
    raises TestFailure after dumping both outputs when either fails (exit
    status, time limit).
    """
    ready = ready or (lambda proc, p, t: proc.wait_listening(p, t))
    for attempt in range(attempts):
        port = port or free_port()
        sub = lambda argv: [a.replace(port_placeholder, str(port)) for a in argv]
        server = Proc("server", sub(server_argv), timeout=timeout, env=env,
                      launch_opts=launch_opts)
        if not ready(server, port, listen_timeout):
            server.kill()
            text = server.output()
            if server.rc not in (None, 0) and BIND_ERRORS.search(text) and attempt + 1 < attempts:
                log(f"server could not use port {port}; retrying on another")
                port = None
                continue
            server.dump()
            fail(f"server did not start listening on port {port}: {server.status()}")
        client = Proc("client", sub(client_argv), timeout=timeout, env=env,
                      launch_opts=launch_opts)
        client.wait()
        if server_persists:
            server.stop()
        elif client.rc == 0:
            server.wait()
        else:
            # The client failed: give the server a moment to report, then kill it.
            server.wait(timeout=2)
            server.kill()
        ok = client.rc == 0 and (server_persists or server.rc == 0)
        if not ok:
            server.dump()
            client.dump()
            fail(f"server {server.status()}, client {client.status()}")
        log(f"server {server.status()}, client {client.status()}")
        return server, client
    fail("no usable port")


def check_no_errors(procs, allow=()):
    for p in procs:
        bad = error_lines(p.output(), allow)
        if bad:
            p.dump()
            fail(f"{p.name} reported errors:\n  " + "\n  ".join(bad))


def iperf3_json(proc):
    """The JSON document (-J) iperf3 printed; fails on none or on its error."""
    text = proc.output()
    i = text.find("{")
    try:
        doc, _ = json.JSONDecoder().raw_decode(text[i:]) if i >= 0 else (None, 0)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        proc.dump()
        fail(f"{proc.name}: no JSON document (-J) in the output")
    if doc.get("error"):
        proc.dump()
        fail(f"{proc.name}: iperf3 error: {doc['error']}")
    return doc


# --- Provider traffic counters (PCIENTB_STATS) --------------------------------------
# With PCIENTB_STATS=<file>, every process appends one line per node of the fabric
# when the node leaves it (or at exit):
#   pcientb-stats pid=P fabric=F lid=L send_ops=N send_bytes=N write_ops=N
#     write_bytes=N read_ops=N read_bytes=N atomic_ops=N recv_ops=N recv_bytes=N errors=N
# (the provider also prints atomic_bytes; other counters it may add are kept too).
# Tests that claim traffic went over pcientb0 sum these over the run's processes.

STATS_COUNTERS = ("send_ops", "send_bytes", "write_ops", "write_bytes", "read_ops",
                  "read_bytes", "atomic_ops", "recv_ops", "recv_bytes", "errors")
# Payload-carrying operations: each byte a program moves is posted once, by the
# sender (SEND, WRITE) or by the reader (READ); recv_bytes would count SENDs twice.
PAYLOAD_KINDS = ("send", "write", "read")


def parse_stats_line(line):
    """{"pid":, "fabric":, "lid":, counter: int, ...}, or None if `line` is malformed."""
    words = line.split()
    if not words or words[0] != "pcientb-stats":
        return None
    fields = {}
    for w in words[1:]:
        key, eq, value = w.partition("=")
        if not eq or not key or key in fields:
            return None
        if key == "fabric":
            fields[key] = value
        elif value.isdigit():
            fields[key] = int(value)
        else:
            return None
    required = ("pid", "fabric", "lid") + STATS_COUNTERS
    return fields if all(k in fields for k in required) else None


class Stats:
    """The PCIENTB_STATS file of one run; pass env() to the processes of that run."""

    def __init__(self, name="run"):
        fd, self.path = tempfile.mkstemp(prefix=f"pcientb-stats-{name}-", suffix=".txt")
        os.close(fd)
        atexit.register(lambda: os.path.exists(self.path) and os.unlink(self.path))

    def env(self):
        return {"PCIENTB_STATS": self.path}

    def lines(self):
        with open(self.path) as f:
            return [line.rstrip("\n") for line in f if line.startswith("pcientb-stats")]

    def nodes(self):
        """Parsed lines of this test's fabric (see parse_stats_line)."""
        nodes = []
        for line in self.lines():
            node = parse_stats_line(line)
            if node is None:
                fail(f"malformed pcientb-stats line in {self.path} (expected pid= fabric= "
                     f"lid= {'= '.join(STATS_COUNTERS)}=): {line!r}")
            if node["fabric"] == fabric():
                nodes.append(node)
        return nodes

    def check(self, *, processes, min_bytes=0, min_ops=None, max_errors=0, what="the run"):
        """Fail unless `processes` distinct processes reported, the payload bytes they
        posted (SEND + WRITE + READ) add up to at least `min_bytes`, each op class in
        `min_ops` ({"write": n, "atomic": n, ...}) reached its count, and at most
        `max_errors` error completions were seen. Returns the totals."""
        nodes = self.nodes()
        if not nodes:
            other = self.lines()
            fail(f"no pcientb-stats lines for fabric {fabric()} in {self.path} "
                 f"(PCIENTB_STATS; {len(other)} lines of other fabrics): the provider wrote no "
                 f"traffic counters, so nothing shows that {what} went over pcientb0")
        totals = {c: sum(n[c] for n in nodes) for c in STATS_COUNTERS}
        pids = {n["pid"] for n in nodes}
        payload = sum(totals[f"{k}_bytes"] for k in PAYLOAD_KINDS)
        log("pcientb-stats: " + f"{len(nodes)} nodes, {len(pids)} processes: "
            + " ".join(f"{c}={totals[c]}" for c in STATS_COUNTERS))
        problems = []
        if len(pids) < processes:
            problems.append(f"counters from {len(pids)} processes, expected {processes}: a "
                            f"process never opened pcientb0 or did not leave the fabric")
        if payload < min_bytes:
            problems.append(f"payload bytes posted (send+write+read) {payload} < {min_bytes} "
                            f"that {what} moved: traffic went elsewhere")
        for kind, n in (min_ops or {}).items():
            if totals[f"{kind}_ops"] < n:
                problems.append(f"{kind}_ops {totals[f'{kind}_ops']} < {n} expected for {what}")
        if max_errors is not None and totals["errors"] > max_errors:
            problems.append(f"errors={totals['errors']} (at most {max_errors} allowed)")
        if problems:
            for line in self.lines():
                print(f"  {line}")
            fail("pcientb-stats: " + "; ".join(problems))
        return totals


# --- UCX's own account of the transports it chose (UCX_LOG_LEVEL=info) ---------------
# UCX prints, per endpoint configuration, the lanes and their transport/device:
#   ucp_worker.c:1763 UCX  INFO    ep_cfg[0]: tag(rc_verbs/pcientb0:1) rma(rc_verbs/pcientb0:1)
EP_CFG_RE = re.compile(r"\bep_cfg\[\d+\]: (.*)$")
PCIENTB_LANES = ("rc_verbs/pcientb0:1", "ud_verbs/pcientb0:1")
# With UCX_LOG_LEVEL=info UCX also reports (DIAG) that it has no rdma_cm: pcientb
# offers none (connections are set up by UCX's own wireup over the transport).
UCX_INFO_ALLOWED = [r"rdma_create_event_channel failed: No such file or directory",
                    r"failed to open CM on component rdmacm"]


def check_ucx_lanes(procs, allowed=PCIENTB_LANES, min_lines=1):
    """Every ep_cfg lane of every process uses one of `allowed`; returns the lane lines."""
    found = []
    for p in procs:
        for line in p.output().splitlines():
            m = EP_CFG_RE.search(line)
            if not m:
                continue
            found.append(m.group(1).strip())
            lanes = re.findall(r"(\w+)\(([^)]*)\)", m.group(1))
            if not lanes:
                fail(f"{p.name}: cannot parse UCX lanes: {line}")
            for _, resources in lanes:
                for res in resources.split():
                    if res not in allowed:
                        p.dump()
                        fail(f"{p.name}: UCX used {res} (not pcientb0): {line.strip()}")
    if len(found) < min_lines:
        for p in procs:
            p.dump()
        fail(f"UCX printed {len(found)} ep_cfg lines (UCX_LOG_LEVEL=info), expected "
             f">= {min_lines}")
    for lanes in sorted(set(found)):
        log(f"UCX lanes: {lanes}")
    return found


def main(fn):
    """Run test function `fn()`; map TestFailure to exit status 1."""
    start = time.monotonic()
    try:
        fn()
    except TestFailure as e:
        print(f"[itest] FAIL: {e}", flush=True)
        sys.exit(1)
    log(f"PASS ({time.monotonic() - start:.1f}s)")
    sys.exit(0)
