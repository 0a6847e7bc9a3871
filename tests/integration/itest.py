"""Harness for the integration tests: unmodified verbs programs on pcientb0.

Every test runs the real tool (ibv_*_pingpong, perftest, qperf, pyverbs) under
pcientb-run, as a server and a client process on a free TCP port, on the
emulated fabric named by PCIENTB_FABRIC (CTest gives each test its own). Both
processes are bounded in time; on any failure the server is killed and both
outputs are printed.

Environment (set by tests/integration/CMakeLists.txt):
  PCIENTB_RUN     the launcher (build-tree bin/pcientb-run)
  PCIENTB_FABRIC  the fabric this test's processes join
  ITEST_TIMEOUT   seconds each process may run (default 60)

Exit status: 0 pass, 1 fail, 77 skip (a tool is not installed).
"""

import errno
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


def launcher():
    run = os.environ.get("PCIENTB_RUN")
    if not run or not os.access(run, os.X_OK):
        print(f"[itest] PCIENTB_RUN={run!r} is not an executable launcher", flush=True)
        sys.exit(1)
    return run


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

    def __init__(self, name, argv, timeout=None, env=None, cwd=None, launch=True):
        self.name = name
        # Line-buffered stdout (stdbuf), so that what a tool printed before it
        # was killed at its time limit is in the log.
        stdbuf = ["stdbuf", "-oL", "-eL"] if shutil.which("stdbuf") else []
        self.argv = stdbuf + ([launcher(), "--fabric", fabric(), "--"] if launch else []) + list(argv)
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


def error_lines(text, allow=()):
    """Lines of `text` that look like errors, except those matching `allow` regexes."""
    bad = []
    for line in text.splitlines():
        if ERROR_RE.search(line) and not any(re.search(a, line) for a in allow):
            bad.append(line)
    return bad


BIND_ERRORS = re.compile(r"address already in use|couldn'?t listen|bind", re.IGNORECASE)


def run_pair(server_argv, client_argv, *, port_placeholder="{port}", timeout=None,
             server_persists=False, env=None, listen_timeout=30, attempts=3):
    """Start the server, wait until it listens, run the client, then reap both.

    `{port}` in either argv is replaced by a free port. When the server fails to
    bind (another process took the port in between) it is retried on a new port.
    Returns (server, client) Proc objects; raises TestFailure after dumping both
    outputs when either fails (exit status, time limit).
    """
    for attempt in range(attempts):
        port = free_port()
        sub = lambda argv: [a.replace(port_placeholder, str(port)) for a in argv]
        server = Proc("server", sub(server_argv), timeout=timeout, env=env)
        if not server.wait_listening(port, listen_timeout):
            server.kill()
            text = server.output()
            if server.rc not in (None, 0) and BIND_ERRORS.search(text) and attempt + 1 < attempts:
                log(f"server could not use port {port}; retrying on another")
                continue
            server.dump()
            fail(f"server did not start listening on port {port}: {server.status()}")
        client = Proc("client", sub(client_argv), timeout=timeout, env=env)
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
