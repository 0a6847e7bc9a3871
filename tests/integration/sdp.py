#!/usr/bin/env python3
"""Integration tests of the SDP socket layer (libpcientb-sdp.so, run by the
build's pcientb-sdp) with unmodified programs from Debian: iperf3, sockperf,
qperf, curl against `python3 -m http.server`, netcat-openbsd, and a verifying
Python pair (Python's socket module calls libc's socket/connect/send/recv, so
the layer takes its sockets like any program's).

  sdp.py CASE

Every process run under pcientb-sdp gets a PCIENTB_SDP_STATS file of its own,
and each case checks its `conn ... path=... reason=... bcopy_tx= ...` lines
(one per connection, written at close or at exit), so that a silent fallback to
TCP cannot pass a case meant for SDP: SDP cases want every line path=sdp and
the BCopy + ZCopy bytes at least what the tool says it moved; fallback cases
want path=tcp with the expected reason.

Cases (two processes each, on a free port, each bounded by ITEST_TIMEOUT):
  iperf3             iperf3 -s -1 / iperf3 -c -t 2, both under pcientb-sdp; -J
                     figures: bytes > 0 on the receiving side, the sender's
                     bytes <= its connections' tx, the receiver's <= their rx;
                     control + data connections all path=sdp
  iperf3.reverse     the same with -R (the server sends)
  iperf3.parallel    the same with -P 4 (5 connections a side)
  sockperf.ping_pong sockperf server --tcp (stopped with SIGINT: it never
                     exits) / ping-pong -t 2 -m 64: avg latency > 0, sent and
                     received messages x 64 within the client's tx/rx
  sockperf.throughput  throughput -t 2 -m 1400: message rate > 0, messages
                     x 1400 within the client's tx
  redis              redis-server (epoll, one thread) / redis-benchmark -c 8 -n 20000
                     -t set,get --csv: both rates > 0; then redis-cli sets a 2 MiB
                     value and gets it back, equal; every client connection path=sdp
  memcached          memcached / memcaslap -t 2s -c 4: TPS > 0; every client
                     connection path=sdp with at least the bytes it reports
  asyncio            asyncio echo server / client with 8 connections x 300 random-size
                     messages, every echo checked; client connections path=sdp
  many               the asyncio echo server / many_conns.py: 1,000 connections at once
                     from one process, then 4 x 250 at once, every echo checked (64 KiB
                     rings); every client connection path=sdp
  churn              the asyncio echo server / churn.py: 10,000 connect, 64-byte echo,
                     close; from the first 1,000 to the end neither process grows
                     beyond the layer's buffer pool, pcientb-stat shows no QP or MR of
                     the server left, 32 idle connections cost < 5% of a core; every
                     connection path=sdp
  nginx              nginx (master + worker, user root when root) serving a 1 MiB
                     file: ab -k -n 2000 -c 4 without failures, then a Python
                     download, equal;
                     client connections path=sdp
  qperf.tcp_bw       qperf -lp PORT (stopped with SIGTERM) / qperf -lp PORT
                     127.0.0.1 -t 2 -vvs -m 64K tcp_bw: bw > 0, send_msgs x 64 KiB
                     within the client's tx (64 KiB sends: the ZCopy threshold)
  qperf.tcp_lat      ... -m 64 tcp_lat: latency > 0, loc_send/recv_msgs x 64
  curl               python3 -m http.server serving a 4 MiB random file, curl
                     -o; sha256 equal; server tx and client rx >= 4 MiB, sdp
  netcat             nc -l > out / nc -N < in, both under pcientb-sdp: 4 MiB one
                     way, equal bytes, path=sdp (skipped without netcat-openbsd)
  process.MODE       a server that hands its connection to another process
                     (process_model.py: system, popen, inetd, cgi, reexec, fork,
                     daemon, shell, subprocess): 4 MiB up, 2 MiB down, every byte checked by the
                     process that reads it; all lines path=sdp
  pingpong.verify    the Python pair below: 100,000 messages of random sizes
                     1 B..64 KiB each way at once (a sender thread beside the
                     receiving loop), sends split at random points, receives of
                     random sizes; every byte checked against a seeded PRNG
                     stream; both halves closed by shutdown(SHUT_WR) then EOF
  pingpong.verify_zcopy  the same, 20,000 messages, --zcopy-thresh 4096: zcopy
                     bytes > 0 each way
  fallback.nc_client preloaded server, plain client (no preload): (a) the
                     client speaks first (`nc -N`, or Python without nc), (b) the
                     server speaks first (a plain Python client that waits for
                     it); 1 MiB each way verified; server path=tcp reason=peer_no_sdp
  fallback.nc_server plain server, preloaded client: (a) the server speaks first
                     (`nc -N -l`, or Python), (b) the client speaks first (a plain
                     Python server that waits for it); client path=tcp
                     reason=peer_no_sdp
  fallback.other_fabric  both preloaded, server and client on different
                     PCIENTB_FABRIC: data verified, both path=tcp with
                     reason=other_fabric or peer_no_sdp (a layer on another fabric
                     is, from this one, no layer: which of the two a side reports
                     depends on when it finds out); also an nc pair when nc is
                     installed
  fallback.ring_sizes  both preloaded, PCIENTB_SDP_RING 1 MiB on one side and
                     4 MiB on the other (each way round): data verified, both
                     path=tcp (the side that finds the peer's ring larger than its
                     own ends the handshake)
  selftest           the stats parser and checks on made-up lines (no process)

Environment (set by tests/integration/CMakeLists.txt):
  PCIENTB_SDP     the launcher (build-tree bin/pcientb-sdp)
  PCIENTB_FABRIC  the fabric of the preloaded processes (other_fabric adds a
                  second one)
  ITEST_TIMEOUT   seconds each process may run (default 60)
Also read:
  SDP_ITEST_SEED  base seed of the Python pair's streams (default: random; the
                  seed is printed, so that a failure can be replayed)
  PCIENTB_SDP_ITEST_SHIM=1  harness check against a launcher that only execs
                  its command (plain TCP, no stats): stats problems are printed,
                  not failed. Never set by CTest.

Exit status: 0 pass, 1 fail, 77 skip (a tool is not installed).
"""

import argparse
import atexit
import hashlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import itest
from itest import fail, log

LOOP = "127.0.0.1"
SHIM = os.environ.get("PCIENTB_SDP_ITEST_SHIM") == "1"
ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")


def sdp_launcher():
    run = os.environ.get("PCIENTB_SDP")
    if not run or not os.access(run, os.X_OK):
        print(f"[itest] PCIENTB_SDP={run!r} is not an executable launcher", flush=True)
        sys.exit(1)
    return run


# --- Stats lines (PCIENTB_SDP_STATS) -------------------------------------------------
# conn pid=<pid> prog=<comm> role=<client|server> path=<sdp|tcp> reason=<word>
#   bcopy_tx=<bytes> bcopy_rx=<bytes> zcopy_tx=<bytes> zcopy_rx=<bytes> [more key=value]
# prog is the kernel's comm, which may hold spaces: it runs up to " role=".
CONN_RE = re.compile(r"^conn pid=(\d+) prog=(.*?) role=(\S+) path=(\S+) reason=(\S+)"
                     r"((?: \w+=\S*)*)\s*$")
BYTE_KEYS = ("bcopy_tx", "bcopy_rx", "zcopy_tx", "zcopy_rx")
# total pid=<pid> prog=<comm> conns=<n> sdp=<n> tcp=<n> bcopy_tx=.. bcopy_rx=.. zcopy_tx=..
#   zcopy_rx=.. tcp_reasons=<reason>:<n>[,...]|-      (one per process, at exit)
TOTAL_RE = re.compile(r"^total pid=(\d+) prog=(.*?) conns=(\d+) sdp=(\d+) tcp=(\d+)"
                      r" bcopy_tx=(\d+) bcopy_rx=(\d+) zcopy_tx=(\d+) zcopy_rx=(\d+)"
                      r" tcp_reasons=(\S+)\s*$")


def parse_total_line(line):
    """A dict of a total line's fields, or None if it is not a well-formed one."""
    m = TOTAL_RE.match(line)
    if not m:
        return None
    total = {"pid": int(m.group(1)), "prog": m.group(2), "conns": int(m.group(3)),
             "sdp": int(m.group(4)), "tcp": int(m.group(5))}
    for i, key in enumerate(BYTE_KEYS):
        total[key] = int(m.group(6 + i))
    total["tcp_reasons"] = {}
    if m.group(10) != "-":
        for item in m.group(10).split(","):
            why, _, n = item.rpartition(":")
            if not why or not n.isdigit():
                return None
            total["tcp_reasons"][why] = int(n)
    return total


def parse_conn_line(line):
    """A dict of the line's fields, or None if it is not a well-formed conn line."""
    m = CONN_RE.match(line)
    if not m:
        return None
    conn = {"pid": int(m.group(1)), "prog": m.group(2), "role": m.group(3),
            "path": m.group(4), "reason": m.group(5)}
    for key, value in re.findall(r" (\w+)=(\S*)", m.group(6)):
        conn[key] = int(value) if value.isdigit() else value
    if not all(isinstance(conn.get(k), int) for k in BYTE_KEYS):
        return None
    conn["tx"] = conn["bcopy_tx"] + conn["zcopy_tx"]
    conn["rx"] = conn["bcopy_rx"] + conn["zcopy_rx"]
    return conn


class SdpStats:
    """The PCIENTB_SDP_STATS file of one process (and any child it forks)."""

    def __init__(self, name, path=None):
        self.name = name
        if path is None:
            fd, path = tempfile.mkstemp(prefix=f"pcientb-sdp-stats-{name}-", suffix=".txt")
            os.close(fd)
            atexit.register(lambda: os.path.exists(path) and os.unlink(path))
        self.path = path

    def raw(self):
        with open(self.path) as f:
            return [line.rstrip("\n") for line in f if line.strip()]

    def conns(self):
        conns = []
        for line in self.raw():
            if line.startswith("total "):
                continue  # totals(): checked against these lines by check_totals()
            conn = parse_conn_line(line)
            if conn is None:
                fail(f"{self.name}: malformed line in {self.path} (PCIENTB_SDP_STATS): {line!r}")
            conns.append(conn)
        return conns

    def totals(self):
        totals = []
        for line in self.raw():
            if not line.startswith("total "):
                continue
            total = parse_total_line(line)
            if total is None:
                fail(f"{self.name}: malformed total line in {self.path}: {line!r}")
            totals.append(total)
        return totals

    def summary(self, conns):
        paths = {}
        for c in conns:
            key = c["path"] if c["path"] == "sdp" else f"{c['path']}({c['reason']})"
            paths[key] = paths.get(key, 0) + 1
        return " ".join([f"{len(conns)} conns"] + [f"{k}={v}" for k, v in sorted(paths.items())]
                        + [f"{k}={sum(c[k] for c in conns)}" for k in BYTE_KEYS]
                        + [f"total_lines={len(self.totals())}"])


def _report(problems, stats, proc=None):
    if not problems:
        return
    msg = f"{stats.name} stats: " + "; ".join(problems)
    if SHIM:
        log(f"SHIM, not enforced: {msg}")
        return
    print(f"----- {stats.path}")
    for line in stats.raw():
        print(f"  {line}")
    if proc is not None:
        proc.dump()
    fail(msg)


def totals_problems(stats, proc=None):
    """Each total line (a process writes one at exit, and an image one at exec) against the
    conn lines its process wrote since its previous total line: their counts and sums.
    `proc`, when it exited normally and wrote conn lines, must have written one."""
    problems = []
    pending, totaled = {}, set()
    for line in stats.raw():
        if not line.startswith("total "):
            c = parse_conn_line(line)
            if c is not None:
                pending.setdefault(c["pid"], []).append(c)
            continue
        t = parse_total_line(line)
        if t is None:
            problems.append(f"malformed total line {line!r}")
            continue
        pid = t["pid"]
        mine = pending.pop(pid, [])
        totaled.add(pid)
        want = {"conns": len(mine), "sdp": sum(c["path"] == "sdp" for c in mine),
                "tcp": sum(c["path"] != "sdp" for c in mine)}
        for key in BYTE_KEYS:
            want[key] = sum(c[key] for c in mine)
        reasons = {}
        for c in mine:
            if c["path"] != "sdp":
                reasons[c["reason"]] = reasons.get(c["reason"], 0) + 1
        bad = [f"{k}={t[k]} (lines: {v})" for k, v in want.items() if t[k] != v]
        if t["tcp_reasons"] != reasons:
            bad.append(f"tcp_reasons={t['tcp_reasons']} (lines: {reasons})")
        if bad:
            problems.append(f"pid {pid} total line disagrees with its conn lines: "
                            + ", ".join(bad))
    if (proc is not None and proc.rc == 0 and proc.pid not in totaled
            and proc.pid in pending):
        problems.append(f"{proc.name} (pid {proc.pid}) exited without its total line")
    return problems


def check_sdp(stats, *, conns=1, tx=0, rx=0, zcopy=False, required=True, proc=None,
              what="the tool"):
    """At least `conns` lines, every one path=sdp, and BCopy+ZCopy bytes of at least
    `tx` sent and `rx` received over them (what the tool says it moved). `zcopy`:
    both zcopy_tx and zcopy_rx > 0. `required=False`: no lines is fine (a server
    stopped by a signal may write none), but any line there must be right."""
    got = stats.conns()
    log(f"{stats.name} stats: {stats.summary(got)}")
    problems = []
    if not got and not required:
        return got
    if len(got) < conns:
        problems.append(f"{len(got)} conn lines, expected >= {conns}"
                        + (" (the layer saw no connection: not preloaded?)" if not got else ""))
    fallbacks = [c for c in got if c["path"] != "sdp"]
    if fallbacks:
        reasons = sorted({f"{c['path']}/{c['reason']}" for c in fallbacks})
        problems.append(f"{len(fallbacks)} connection(s) not on SDP: {', '.join(reasons)}")
    sdp = [c for c in got if c["path"] == "sdp"]
    sent, received = sum(c["tx"] for c in sdp), sum(c["rx"] for c in sdp)
    if sent < tx:
        problems.append(f"bcopy_tx+zcopy_tx {sent} < {tx} bytes {what} sent: data went elsewhere")
    if received < rx:
        problems.append(f"bcopy_rx+zcopy_rx {received} < {rx} bytes {what} received: data went "
                        f"elsewhere")
    if zcopy:
        for key in ("zcopy_tx", "zcopy_rx"):
            if sum(c[key] for c in sdp) == 0:
                problems.append(f"{key}=0: no ZCopy transfer")
    problems += totals_problems(stats, proc)
    _report(problems, stats, proc)
    return got


def check_tcp(stats, reasons, *, conns=1, proc=None):
    """At least `conns` lines, every one path=tcp with a reason in `reasons` and no
    BCopy/ZCopy bytes."""
    got = stats.conns()
    log(f"{stats.name} stats: {stats.summary(got)}")
    problems = []
    if len(got) < conns:
        problems.append(f"{len(got)} conn lines, expected >= {conns}"
                        + (" (the layer saw no connection: not preloaded?)" if not got else ""))
    for c in got:
        if c["path"] != "tcp":
            problems.append(f"path={c['path']} (expected the fallback, path=tcp)")
        elif c["reason"] not in reasons:
            problems.append(f"reason={c['reason']} (expected {'|'.join(sorted(reasons))})")
        if c["tx"] or c["rx"]:
            problems.append(f"a path={c['path']} connection with BCopy/ZCopy bytes "
                            f"(tx={c['tx']} rx={c['rx']})")
    problems += totals_problems(stats, proc)
    _report(problems, stats, proc)
    return got


# --- Processes ------------------------------------------------------------------------


def start(name, argv, *, sdp=True, fab=None, opts=(), env=None, cwd=None, stdin=None,
          stdout=None):
    """Start `argv` under pcientb-sdp (sdp=True; fabric `fab`, launcher options `opts`)
    with a stats file of its own (proc.stats), or plain (no preload, proc.stats None).
    stdin/stdout: files for the program's standard input/output (else /dev/null and
    the process's log)."""
    full_env = {"PYTHONUNBUFFERED": "1"}
    full_env.update(env or {})
    stats = None
    if sdp:
        stats = SdpStats(name)
        full_env["PCIENTB_SDP_STATS"] = stats.path
        argv = [sdp_launcher(), "--fabric", fab or itest.fabric(), *opts, "--", *argv]
    if stdin or stdout:
        # The shell redirects and execs the launcher: nothing but the program is preloaded.
        full_env.update(ITEST_STDIN=stdin or "/dev/null")
        redirect = ' < "$ITEST_STDIN"' + (' > "$ITEST_STDOUT"' if stdout else "")
        if stdout:
            full_env["ITEST_STDOUT"] = stdout
        argv = ["sh", "-c", 'exec "$@"' + redirect, "sh", *argv]
    proc = itest.Proc(name, argv, env=full_env, cwd=cwd, launch=False)
    proc.stats = stats
    return proc


def session_pids(sid):
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    rest = f.read().rsplit(")", 1)[1].split()
                if int(rest[3]) == sid:
                    pids.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return pids


def wait_listening(proc, port, timeout=30):
    """True once a process of proc's session listens on TCP `port`. Checked in /proc,
    not by connecting: a probe connection would add a conn line to the stats."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        inodes = itest._listening_inodes(port)
        if inodes and any(inodes & itest._process_sockets(p) for p in session_pids(proc.pid)):
            return True
        time.sleep(0.02)
    return False


def run_pair(server_argv, client_argv, *, server=None, client=None, stop=None, attempts=3):
    """Server (until it listens), then client; `{port}` in either argv is the port.

    server/client: start() options of each side. stop: None when the server exits
    by itself once the client is done, else the signal that stops it (it is killed
    if it has not exited 5 s later). Returns (server, client, port); on a failure
    both are killed and both outputs printed."""
    for attempt in range(attempts):
        port = itest.free_port()
        sub = lambda argv: [a.replace("{port}", str(port)) for a in argv]
        s = start("server", sub(server_argv), **(server or {}))
        c = None
        try:
            if not wait_listening(s, port):
                s.kill()
                if (s.rc not in (None, 0) and itest.BIND_ERRORS.search(s.output())
                        and attempt + 1 < attempts):
                    log(f"server could not use port {port}; retrying on another")
                    continue
                s.dump()
                fail(f"server did not start listening on port {port}: {s.status()}")
            c = start("client", sub(client_argv), **(client or {}))
            c.wait()
            if stop is not None:
                crashed = s.poll() not in (None, 0)  # ended before it was asked to
                s.kill(stop)
                if s.rc == -signal.SIGKILL:
                    log(f"server did not exit on signal {stop}: killed (its stats lines are lost)")
            elif c.rc == 0:
                s.wait()
            else:
                s.wait(timeout=2)
        finally:  # nothing left running, whatever failed
            for p in (c, s):
                if p is not None:
                    p.kill()
        if c.rc != 0 or (s.rc != 0 if stop is None else crashed):
            s.dump()
            c.dump()
            fail(f"server {s.status()}, client {c.status()}")
        log(f"server {s.status()}, client {c.status()}")
        return s, c, port
    fail("no usable port")


def output(proc):
    return ANSI_RE.sub("", proc.output())


def expect(proc, regex, what):
    m = re.search(regex, output(proc), re.MULTILINE)
    if not m:
        proc.dump()
        fail(f"{proc.name}: {what} (no match for {regex!r})")
    return m


def dump_all(*procs):
    for p in procs:
        if p is not None:
            p.dump()


# --- The Python pair: seeded streams, verified byte by byte ----------------------------
# A direction's stream is a pattern of PATTERN_LEN bytes from Random(seed), repeated.
# PATTERN_LEN is prime and much longer than a chunk (<= 64 KiB), so a lost, repeated or
# misplaced chunk, or a ring wrapping at a power of two, never lines up with the pattern
# again. The message sizes come from the same seed, so the receiver knows how many bytes
# to expect; split points and receive sizes come from the seed too, so a seed replays
# a run (the scheduling aside).
PATTERN_LEN = 1048573
MAX_CHUNK = 65536
_patterns = {}


def pattern(seed):
    """The stream's pattern, extended by MAX_CHUNK so that a chunk never wraps."""
    if seed not in _patterns:
        p = random.Random(seed ^ 0x5D5).randbytes(PATTERN_LEN)
        _patterns[seed] = p + p[:MAX_CHUNK]
    return _patterns[seed]


def message_sizes(seed, msgs=0, total=0):
    """Sizes 1..64 KiB, log-uniform (each octave, 1-2 B .. 32-64 KiB, as likely: ~5.9 KB
    on average), the extremes first; `msgs` of them, or as many as make `total` bytes
    (the last one cut)."""
    rng = random.Random(seed)
    fixed = [1, MAX_CHUNK, MAX_CHUNK - 1, 2]
    count = sent = 0
    while (msgs and count < msgs) or (total and sent < total):
        size = fixed[count] if count < len(fixed) else min(int(2 ** rng.uniform(0, 16.0001)),
                                                           MAX_CHUNK)
        if total:
            size = min(size, total - sent)
        yield size
        count += 1
        sent += size


def stream_total(seed, msgs=0, total=0):
    return sum(message_sizes(seed, msgs, total)) if msgs else total


def write_stream_file(path, seed, total):
    pat = pattern(seed)
    with open(path, "wb") as f:
        off = 0
        while off < total:
            n = min(MAX_CHUNK, total - off)
            o = off % PATTERN_LEN
            f.write(pat[o:o + n])
            off += n


def check_stream_file(path, seed, total, what):
    with open(path, "rb") as f:
        data = f.read()
    pat = pattern(seed)
    for off in range(0, max(len(data), total), MAX_CHUNK):
        o = off % PATTERN_LEN
        n = min(MAX_CHUNK, total - off) if off < total else 0
        if data[off:off + MAX_CHUNK] != pat[o:o + n]:
            got = data[off:off + MAX_CHUNK]
            first = next((i for i in range(min(len(got), n)) if got[i] != pat[o + i]),
                         min(len(got), n))
            fail(f"{what}: {len(data)} bytes, expected {total}; first difference at byte "
                 f"{off + first}")
    log(f"{what}: {total} bytes, all as sent")


class Mismatch(Exception):
    pass


def peer_main(argv):
    """`sdp.py _peer`: one side of the Python pair (see the module docstring)."""
    ap = argparse.ArgumentParser(prog="sdp.py _peer")
    side = ap.add_mutually_exclusive_group(required=True)
    side.add_argument("--listen", type=int, metavar="PORT")
    side.add_argument("--connect", type=int, metavar="PORT")
    ap.add_argument("--tx", required=True, metavar="SEED:MSGS:BYTES",
                    help="what this side sends: MSGS messages, or BYTES bytes (MSGS 0)")
    ap.add_argument("--rx", required=True, metavar="SEED:MSGS:BYTES", help="what the peer sends")
    ap.add_argument("--wait-first", action="store_true",
                    help="send nothing before the first byte from the peer")
    ap.add_argument("--close-after-eof", action="store_true",
                    help="shut down only after the peer's EOF (nc exits at EOF from the "
                         "network); default: shutdown(SHUT_WR) once all is sent")
    a = ap.parse_args(argv)
    tx_seed, tx_msgs, tx_bytes = (int(x) for x in a.tx.split(":"))
    rx_seed, rx_msgs, rx_bytes = (int(x) for x in a.rx.split(":"))
    rx_total = stream_total(rx_seed, rx_msgs, rx_bytes)
    pattern(tx_seed), pattern(rx_seed)  # before the clock starts

    if a.listen is not None:
        with socket.create_server((LOOP, a.listen)) as ls:
            sock, _ = ls.accept()
    else:
        sock = socket.create_connection((LOOP, a.connect))
    start = time.monotonic()
    first_byte = threading.Event()
    result = {"sent": 0, "msgs_sent": 0, "received": 0, "sends": 0, "recvs": 0}
    errors = []

    def sender():
        try:
            if a.wait_first and not first_byte.wait(timeout=120):
                raise Mismatch("no byte from the peer within 120 s")
            pat = memoryview(pattern(tx_seed))
            rng = random.Random(tx_seed * 7 + 5)
            off = 0
            for size in message_sizes(tx_seed, tx_msgs, tx_bytes):
                # A message goes in 1..3 send() calls, split at random points.
                cuts = sorted(rng.sample(range(1, size), min(rng.randint(0, 2), size - 1)))
                for lo, hi in zip([0] + cuts, cuts + [size]):
                    o = off % PATTERN_LEN
                    sock.sendall(pat[o:o + hi - lo])
                    off += hi - lo
                    result["sends"] += 1
                    result["sent"] = off
                result["msgs_sent"] += 1
            if not a.close_after_eof:
                sock.shutdown(socket.SHUT_WR)
        except Exception as e:  # reported by the main thread
            errors.append(f"send: {type(e).__name__}: {e}")

    t = threading.Thread(target=sender)
    t.start()
    try:
        pat = pattern(rx_seed)
        rng = random.Random(rx_seed * 7 + 3)
        off = 0
        while off < rx_total:
            # Receives of random sizes: half of them as much as a message can hold.
            want = MAX_CHUNK if rng.random() < 0.5 else rng.randint(1, MAX_CHUNK)
            data = sock.recv(min(want, rx_total - off))
            result["recvs"] += 1
            if not data:
                raise Mismatch(f"EOF after {off} of {rx_total} bytes")
            o = off % PATTERN_LEN
            if data != pat[o:o + len(data)]:
                i = next(i for i in range(len(data)) if data[i] != pat[o + i])
                raise Mismatch(f"byte {off + i} of the stream is {data[i]:#04x}, expected "
                               f"{pat[o + i]:#04x} (receive of {len(data)} at {off})")
            off += len(data)
            result["received"] = off
            first_byte.set()
        extra = sock.recv(MAX_CHUNK)
        if extra:
            raise Mismatch(f"{len(extra)} bytes past the expected {rx_total}")
    except Exception as e:
        errors.append(f"recv: {type(e).__name__}: {e}")
        first_byte.set()
        try:  # unblocks the sender too
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
    t.join()
    if not errors and a.close_after_eof:
        sock.shutdown(socket.SHUT_WR)
    sock.close()
    result["elapsed"] = round(time.monotonic() - start, 3)
    print("peer-result " + json.dumps(result), flush=True)
    for e in errors:
        print(f"peer: FAILED: {e}", file=sys.stderr, flush=True)
    sys.exit(1 if errors else 0)


def peer_argv(role, port, tx, rx, *, wait_first=False, close_after_eof=False):
    argv = [sys.executable, os.path.abspath(__file__), "_peer",
            "--listen" if role == "server" else "--connect", port,
            "--tx", ":".join(map(str, tx)), "--rx", ":".join(map(str, rx))]
    if wait_first:
        argv.append("--wait-first")
    if close_after_eof:
        argv.append("--close-after-eof")
    return argv


def peer_result(proc):
    m = re.search(r"^peer-result (\{.*\})$", proc.output(), re.MULTILINE)
    if not m:
        proc.dump()
        fail(f"{proc.name}: no peer-result line")
    return json.loads(m.group(1))


def base_seed():
    seed = int(os.environ.get("SDP_ITEST_SEED") or random.randrange(1, 1 << 30))
    log(f"seed {seed} (SDP_ITEST_SEED={seed} replays these streams)")
    return seed


def tmpdir():
    d = tempfile.mkdtemp(prefix="itest-sdp-")
    atexit.register(shutil.rmtree, d, True)
    return d


# --- Cases ------------------------------------------------------------------------------


def case_iperf3(extra, streams):
    itest.require_tools("iperf3")
    s, c, _ = run_pair(["iperf3", "-s", "-1", "-p", "{port}", "-J"],
                       ["iperf3", "-c", LOOP, "-p", "{port}", "-t", "2", "-J"] + extra)
    reverse = "-R" in extra
    for proc in (s, c):
        doc = itest.iperf3_json(proc)
        connected = len(doc.get("start", {}).get("connected", []))
        if connected != streams:
            proc.dump()
            fail(f"{proc.name}: {connected} data streams, expected {streams}")
        end = doc["end"]
        # Each side's own count: sum_sent on the sender, sum_received on the receiver.
        sender = end["sum_sent"].get("sender", (proc is c) != reverse)
        key = "sum_sent" if sender else "sum_received"
        moved = int(end[key]["bytes"])
        log(f"{proc.name}: {'sent' if sender else 'received'} {moved} bytes "
            f"({end[key]['bits_per_second'] / 1e9:.2f} Gbit/s)")
        if moved <= 0:
            proc.dump()
            fail(f"{proc.name}: {key}.bytes = {moved}")
        # The control connection and one per stream.
        check_sdp(proc.stats, conns=1 + streams, tx=moved if sender else 0,
                  rx=0 if sender else moved, proc=proc, what=f"iperf3 ({proc.name})")


def case_sockperf(kind):
    itest.require_tools("sockperf")
    server = ["sockperf", "server", "--tcp", "-p", "{port}", "-i", LOOP]
    if kind == "ping_pong":
        size = 64
        client = ["sockperf", "ping-pong", "--tcp", "-p", "{port}", "-i", LOOP, "-t", "2",
                  "-m", str(size)]
    else:
        size = 1400
        client = ["sockperf", "throughput", "--tcp", "-p", "{port}", "-i", LOOP, "-t", "2",
                  "-m", str(size)]
    # The server never exits by itself; on SIGINT it ends its loop and exits 0.
    s, c, _ = run_pair(server, client, stop=signal.SIGINT)
    itest.check_no_errors([c])
    if kind == "ping_pong":
        m = expect(c, r"\[Total Run\] RunTime=[\d.]+ sec; Warm up time=\d+ msec; "
                      r"SentMessages=(\d+); ReceivedMessages=(\d+)", "no [Total Run] line")
        sent, received = int(m.group(1)), int(m.group(2))
        lat = float(expect(c, r"Summary: Latency is ([\d.]+) usec", "no latency")[1])
        log(f"sockperf ping-pong: avg latency {lat} usec, {sent} sent, {received} received")
        if lat <= 0 or received <= 0:
            c.dump()
            fail(f"latency {lat} usec, {received} messages received")
        check_sdp(c.stats, tx=sent * size, rx=received * size, proc=c, what="sockperf")
    else:
        sent = int(expect(c, r"Total of (\d+) messages sent", "no message count")[1])
        rate = float(expect(c, r"Summary: Message Rate is ([\d.]+) \[msg/sec\]", "no rate")[1])
        bw = expect(c, r"Summary: BandWidth is ([\d.]+) MBps", "no bandwidth")[1]
        log(f"sockperf throughput: {rate:.0f} msg/s, {bw} MB/s, {sent} messages")
        if rate <= 0 or sent <= 0:
            c.dump()
            fail(f"message rate {rate}, {sent} messages sent")
        check_sdp(c.stats, tx=sent * size, proc=c, what="sockperf")
    # Its connection closes when the client's does, so its line is normally there.
    check_sdp(s.stats, required=False, proc=s, what="sockperf server")


QPERF_FIGURE = re.compile(r"^\s+(\w+)\s+=\s+([\d.,]+)\s*(\S*)\s*$", re.MULTILINE)


def case_redis():
    """redis-server (epoll, one thread, many connections) and redis-benchmark, both under
    the layer, then redis-cli SET/GET of a 1 MiB value checked byte for byte."""
    itest.require_tools("redis-server", "redis-benchmark", "redis-cli")
    server = ["redis-server", "--port", "{port}", "--bind", LOOP, "--save", "",
              "--appendonly", "no"]
    d = tmpdir()
    value = os.urandom(1 << 20).hex().encode()  # 2 MiB of text: redis-cli -x takes stdin
    src, out = os.path.join(d, "value"), os.path.join(d, "got")
    with open(src, "wb") as f:
        f.write(value)
    # -c 8: eight connections on one event loop; --csv: one parsable line per test. Then a
    # large value set and read back by redis-cli (a shell's children inherit the preload).
    cli = f"redis-cli -h {LOOP} -p {{port}}"
    client = ["sh", "-c",
              f"redis-benchmark -h {LOOP} -p {{port}} -c 8 -n 20000 -t set,get --csv && "
              f"{cli} -x set big < {src} && {cli} --raw get big > {out}"]
    s, c, port = run_pair(server, client, stop=signal.SIGTERM)
    with open(out, "rb") as f:
        got = f.read()
    if got.rstrip(b"\n") != value:
        fail(f"redis-cli get returned {len(got)} bytes, not the {len(value)} set")
    rates = dict(re.findall(r'^"(SET|GET)","([\d.]+)"', c.output(), re.MULTILINE))
    log(f"redis-benchmark: {rates} requests/s")
    if set(rates) != {"SET", "GET"} or min(float(v) for v in rates.values()) <= 0:
        c.dump()
        fail(f"redis-benchmark reported {rates}")
    check_sdp(c.stats, conns=10, tx=len(value), rx=len(value), proc=c, what="redis clients")
    check_sdp(s.stats, required=False, proc=s, what="redis-server")


def case_memcached():
    """memcached (libevent/epoll, 2 threads) and memcaslap (libmemcached-tools' memaslap)
    with 4 connections for 2 s, both under the layer: a rate > 0, every client connection
    path=sdp with at least what memcaslap says it wrote and read."""
    itest.require_tools("memcached", "memcaslap")
    user = ["-u", "root"] if os.geteuid() == 0 else []
    s, c, _ = run_pair(["memcached", *user, "-p", "{port}", "-l", LOOP, "-t", "2", "-U", "0"],
                       ["memcaslap", "-s", f"{LOOP}:{{port}}", "-t", "2s", "-T", "1", "-c", "4"],
                       stop=signal.SIGTERM)
    itest.check_no_errors([c])
    out = output(c)
    tps = re.search(r"Run time: [\d.]+s Ops: (\d+) TPS: (\d+)", out)
    written = re.search(r"^written_bytes: (\d+)", out, re.MULTILINE)
    read = re.search(r"^read_bytes: (\d+)", out, re.MULTILINE)
    if not tps or int(tps.group(2)) <= 0 or not written or not read:
        c.dump()
        fail("memcaslap reported no operations")
    log(f"memcaslap: {tps.group(1)} ops, {tps.group(2)} TPS")
    check_sdp(c.stats, conns=4, tx=int(written.group(1)), rx=int(read.group(1)), proc=c,
              what="memcaslap")
    check_sdp(s.stats, required=False, proc=s, what="memcached")


def case_nginx():
    """nginx (master and a worker process, epoll, sendfile) serving a 1 MiB random file:
    ab -k (2,000 requests, 4 connections) and a Python download, all under the layer; ab
    reports no failure, the downloaded copy is equal, every connection path=sdp. nginx clears its environment
    before its first connection opens the device; as root its worker stays root (a fabric
    is per user: a worker that drops to nobody is declined, to TCP)."""
    itest.require_tools("nginx", "ab")
    d = tmpdir()
    size = 1 << 20
    data = os.urandom(size)
    os.makedirs(os.path.join(d, "html"))
    os.makedirs(os.path.join(d, "logs"))
    with open(os.path.join(d, "html", "f"), "wb") as f:
        f.write(data)
    conf = os.path.join(d, "nginx.conf")
    with open(conf, "w") as f:
        f.write(("user root;\n" if os.geteuid() == 0 else "") +
                "daemon off;\nworker_processes 1;\n"
                f"error_log {d}/logs/error.log;\npid {d}/nginx.pid;\n"
                "events { worker_connections 256; }\n"
                "http { access_log off; sendfile on;\n"
                f"  client_body_temp_path {d}; proxy_temp_path {d}; fastcgi_temp_path {d};\n"
                f"  uwsgi_temp_path {d}; scgi_temp_path {d};\n"
                f"  server {{ listen {LOOP}:PORT; root {d}/html; }} }}\n")
    out = os.path.join(tmpdir(), "download")
    url = f"http://{LOOP}:{{port}}/f"
    s, c, _ = run_pair(
        ["sh", "-c", f'sed "s/PORT/{{port}}/" {conf} > {conf}.run && '
                     f'exec nginx -p {d} -c {conf}.run'],
        # The checked copy by Python, not curl: Debian's curl hangs with libasan preloaded.
        ["sh", "-c", f"ab -k -n 2000 -c 4 {url} && {sys.executable} -c "
                     f"'import urllib.request as u; open(\"{out}\", \"wb\").write("
                     f"u.build_opener(u.ProxyHandler({{}})).open(\"{url}\").read())'"],
        stop=signal.SIGQUIT)
    text = output(c)
    done = re.search(r"^Complete requests:\s+(\d+)", text, re.MULTILINE)
    failed = re.search(r"^Failed requests:\s+(\d+)", text, re.MULTILINE)
    rate = re.search(r"^Requests per second:\s+([\d.]+)", text, re.MULTILINE)
    if not done or int(done.group(1)) != 2000 or not failed or int(failed.group(1)) != 0:
        dump_all(s, c)
        fail("ab did not complete 2000 requests without failure")
    log(f"ab -k: {rate.group(1) if rate else '?'} requests/s")
    with open(out, "rb") as f:
        if hashlib.sha256(f.read()).digest() != hashlib.sha256(data).digest():
            fail("the downloaded copy of the file differs")
    check_sdp(c.stats, conns=5, rx=2000 * size, proc=c, what="ab and the download")
    check_sdp(s.stats, required=False, proc=s, what="nginx")


def case_asyncio():
    """A Python asyncio echo server and a client with 8 connections at once, 300 messages of
    random sizes each, every echo checked (asyncio_echo.py): all connections path=sdp with at
    least the bytes echoed."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "asyncio_echo.py")
    s, c, _ = run_pair([sys.executable, script, "server", "{port}"],
                       [sys.executable, script, "client", "{port}", "8", "300", "7"],
                       stop=signal.SIGTERM)
    m = re.search(r"^asyncio-result (\{.*\})$", output(c), re.MULTILINE)
    if c.rc != 0 or not m:
        dump_all(s, c)
        fail(f"asyncio client: {c.status()}")
    r = json.loads(m.group(1))
    log(f"asyncio: {r['conns']} connections, {r['tx']} bytes echoed and checked")
    check_sdp(c.stats, conns=8, tx=r["tx"], rx=r["rx"], proc=c, what="the asyncio client")
    check_sdp(s.stats, required=False, proc=s, what="the asyncio server")


def case_process(mode):
    """A server that hands its connection to another process (process_model.py MODE): the
    client's 4 MiB and the server's 2 MiB answer are checked byte by byte by whichever
    process reads them, and the client reads the server's end. The client's connection is
    SDP (then back on TCP where a process let go of it); the server's processes' lines are
    SDP too, and each image's total line (at exit, exec or daemon()) agrees with them."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "process_model.py")
    s, c, _ = run_pair([sys.executable, script, "server", mode, "{port}"],
                       [sys.executable, script, "client", "{port}"])
    if "process-result ok" not in output(c):
        dump_all(s, c)
        fail(f"process_model client ({mode}): {c.status()}")
    if mode == "daemon":  # the daemon goes on after the server's first process exited
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(
                t["prog"] == "python3" and t["pid"] != s.pid for t in s.stats.totals()):
            time.sleep(0.05)
    check_sdp(c.stats, proc=c, what="the client")
    check_sdp(s.stats, proc=s, what="the server's processes")


def start_echo_server(env=None):
    """The asyncio echo server (asyncio_echo.py) under the layer, once it listens: (proc,
    port). A port taken meanwhile is retried on another."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "asyncio_echo.py")
    for _ in range(3):
        port = itest.free_port()
        s = start("server", [sys.executable, script, "server", str(port)], env=env)
        if wait_listening(s, port):
            return s, port
        s.kill()
    s.dump()
    fail(f"echo server did not listen on port {port}: {s.status()}")


def case_churn(cycles=10000, idle=32):
    """10,000 connect/echo/close cycles of a Python client against the asyncio echo server
    (churn.py), both under the layer: after the first tenth nothing of either process may
    grow but the layer's pool of closed connections' buffers (16 sets at most: 48
    descriptors and mappings, 40 MiB of resident memory with slack) and a few CQ groups
    (when more connections overlap than before: a loaded machine), no QP or MR
    of theirs may be left on the fabric (pcientb-stat), and every connection is SDP. Then
    `idle` connections left idle 2 s may cost either process at most 5% of a core."""
    here = os.path.dirname(os.path.abspath(__file__))
    s, port = start_echo_server()
    c = start("client", [sys.executable, os.path.join(here, "churn.py"), str(port), str(cycles),
                         str(s.pid), str(idle)])
    c.wait()
    m = re.search(r"^churn-result (\{.*\})$", output(c), re.MULTILINE)
    if c.rc != 0 or not m:
        s.kill()
        dump_all(s, c)
        fail(f"churn client: {c.status()}")
    r = json.loads(m.group(1))
    log(f"churn: {cycles} connections in {r['seconds']:.1f} s "
        f"({r['seconds'] / cycles * 1e6:.0f} us each); samples {r['samples']}; "
        f"{idle} idle connections for 2 s cost {r['idle_cpu']} of a core")
    problems = []
    for side, used in r["idle_cpu"].items():
        if used > 0.05:  # spinning would be ~1.0
            problems.append(f"{side}: {used:.3f} of a core with {idle} idle connections")
    for side in ("client", "server"):
        warm, end = r["samples"]["warm"][side], r["samples"]["end"][side]
        # The layer keeps the buffers of up to 16 closed connections (ring, mirror, ack: each
        # registered, a memfd of the provider's), filled as far as connections overlapped:
        # a server that closes late fills more of it later. That much may grow, no more.
        pool = "/memfd:pcientb-mr-N (deleted)"
        # CQ groups (8 connections each, link.cpp) live as long as the process: one more
        # for each 8 connections open at once beyond the peak before `warm` (more when the
        # machine is loaded and closes lag), each with a completion channel (a pipe).
        groups = 8  # pipes: churn.py POOL_KINDS, which it waits for
        grew = {k: v - warm["fd_kinds"].get(k, 0) for k, v in end["fd_kinds"].items()
                if v > warm["fd_kinds"].get(k, 0)}
        if (grew.get(pool, 0) > 16 * 3 or grew.get("pipe:[N]", 0) > groups
                or any(k not in (pool, "pipe:[N]") for k in grew)):
            problems.append(f"{side}: descriptors {warm['fds']} -> {end['fds']} ({grew})")
        if end["maps"] > warm["maps"] + 16 * 3 + 4 + groups:
            problems.append(f"{side}: mappings {warm['maps']} -> {end['maps']}")
        # ASan keeps freed memory in its quarantine (resident); leaks are LSan's, at exit.
        if end["rss_kib"] > warm["rss_kib"] + 40 * 1024 and not os.environ.get(
                "PCIENTB_ITEST_SANITIZE"):
            problems.append(f"{side}: resident memory {warm['rss_kib']} -> {end['rss_kib']} KiB")
    # What the server (alive, every connection closed) still holds on the fabric.
    stat = os.environ.get("PCIENTB_STAT")
    if stat:
        for obj in ("qp", "mr"):
            for _ in range(30):  # the server closes its ends as it sees the client's
                p = subprocess.run([stat, obj, "--fabric", itest.fabric(), "--pid", str(s.pid),
                                    "-j"], capture_output=True, text=True, timeout=30)
                held = json.loads(p.stdout) if p.returncode == 0 else []
                if not held:
                    break
                time.sleep(0.1)
            log(f"pcientb-stat {obj} of the server: {len(held)} left")
            if p.returncode != 0 or held:
                problems.append(f"server: {len(held)} {obj}(s) left after every connection closed "
                                f"(pcientb-stat rc {p.returncode}): {str(held)[:300]}")
    else:
        problems.append("PCIENTB_STAT is not set: QPs and MRs left behind go unchecked")
    s.kill(signal.SIGTERM)
    check_sdp(c.stats, conns=cycles + idle, tx=r["tx"], rx=r["tx"], proc=c,
              what="the churn client")
    if problems:
        dump_all(s, c)
        fail("; ".join(problems))


def case_many(conns=1000, procs=4):
    """`conns` connections at once from one process, then conns/procs from each of `procs`
    processes at once, to one asyncio echo server (one event loop), every byte checked
    (many_conns.py). Rings of 64 KiB (PCIENTB_SDP_RING) keep 2,000 ring pairs small. Every
    client connection path=sdp."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = {"PCIENTB_SDP_RING": "65536"}
    s, port = start_echo_server(env)
    client = [sys.executable, os.path.join(here, "many_conns.py"), str(port)]
    try:
        for n, k in ((conns, 1), (conns // procs, procs)):
            cs = [start(f"client{i}", client + [str(n)], env=env) for i in range(k)]
            for c in cs:
                c.wait()
            for c in cs:
                m = re.search(r"^many-result (\{.*\})$", output(c), re.MULTILINE)
                if c.rc != 0 or not m:
                    dump_all(s, *cs)
                    fail(f"{c.name}: {c.status()}")
                r = json.loads(m.group(1))
                log(f"{k} x {n}: {c.name} opened {n} in {r['open_seconds']:.2f} s, a round on "
                    f"all at once {r['round_seconds'] * 1e3:.0f} ms, {r['rss_kib'] / n:.0f} KiB "
                    f"resident per connection")
                check_sdp(c.stats, conns=n, tx=r["tx"], rx=r["tx"], proc=c,
                          what=f"{c.name} ({n} connections)")
    finally:
        s.kill(signal.SIGTERM)


def case_qperf(test):
    itest.require_tools("qperf")
    size, msg_opt = {"tcp_bw": (65536, "64K"), "tcp_lat": (64, "64")}[test]
    # qperf serves until stopped and ignores SIGINT.
    s, c, _ = run_pair(["qperf", "-lp", "{port}"],
                       ["qperf", "-lp", "{port}", LOOP, "-t", "2", "-vvs", "-m", msg_opt, test],
                       stop=signal.SIGTERM)
    itest.check_no_errors([c])
    out = output(c)
    if not re.search(rf"^{test}:\s*$", out, re.MULTILINE):
        c.dump()
        fail(f"qperf printed no '{test}:' section")
    fig = {name: (float(value.replace(",", "")), unit)
           for name, value, unit in QPERF_FIGURE.findall(out)}
    main = "bw" if test == "tcp_bw" else "latency"
    for name in (main, "msg_rate"):
        if name not in fig or fig[name][0] <= 0:
            c.dump()
            fail(f"{test}: {name} missing or not > 0")
        log(f"{test}: {name} = {fig[name][0]} {fig[name][1]}")
    if test == "tcp_bw":  # the client sends
        tx, rx = fig["send_msgs"][0] * size, 0
    else:
        tx, rx = fig["loc_send_msgs"][0] * size, fig["loc_recv_msgs"][0] * size
    # The control connection and the test's data connection.
    check_sdp(c.stats, conns=2, tx=int(tx), rx=int(rx), proc=c, what=f"qperf {test}")
    check_sdp(s.stats, required=False, proc=s, what="qperf server")


def case_curl():
    itest.require_tools("curl")
    d = tmpdir()
    size = 4 << 20
    data = os.urandom(size)
    with open(os.path.join(d, "file"), "wb") as f:
        f.write(data)
    out = os.path.join(tmpdir(), "download")
    limit = str(max(int(itest.default_timeout()) - 5, 5))
    s, c, _ = run_pair(
        [sys.executable, "-m", "http.server", "{port}", "--bind", LOOP, "--directory", d],
        # --noproxy: an http_proxy in the environment must not take the request elsewhere.
        ["curl", "-s", "-S", "--noproxy", "*", "--max-time", limit, "-o", out,
         "http://127.0.0.1:{port}/file"],
        stop=signal.SIGINT)  # http.server exits 0 on KeyboardInterrupt
    itest.check_no_errors([c])
    with open(out, "rb") as f:
        got = f.read()
    want_sum, got_sum = hashlib.sha256(data).hexdigest(), hashlib.sha256(got).hexdigest()
    if got_sum != want_sum:
        dump_all(s, c)
        fail(f"download: {len(got)} bytes sha256 {got_sum}, expected {size} bytes {want_sum}")
    log(f"download: {size} bytes, sha256 {got_sum[:16]}... equal")
    check_sdp(c.stats, rx=size, proc=c, what="curl")
    check_sdp(s.stats, tx=size, proc=s, what="http.server")


def nc_one_way(seed, size, server=None, client=None):
    """`nc -l > out` and `nc -N < in`: `size` bytes one way, checked. The listener's
    stdin is empty (without -N it keeps reading); the client shuts its write half at
    the end of its input and exits at the listener's EOF."""
    d = tmpdir()
    src, dst = os.path.join(d, "in"), os.path.join(d, "out")
    write_stream_file(src, seed, size)
    s, c, _ = run_pair(["nc", "-l", LOOP, "{port}"], ["nc", "-N", LOOP, "{port}"],
                       server=dict(server or {}, stdout=dst), client=dict(client or {}, stdin=src))
    check_stream_file(dst, seed, size, "nc -l output")
    return s, c


def case_netcat():
    itest.require_tools("nc")
    size = 4 << 20
    s, c = nc_one_way(base_seed(), size)
    check_sdp(c.stats, tx=size, proc=c, what="nc")
    check_sdp(s.stats, rx=size, proc=s, what="nc -l")


def case_pingpong(msgs, zcopy):
    seed = base_seed()
    tx_c, tx_s = (2 * seed + 1, msgs, 0), (2 * seed + 2, msgs, 0)
    opts = ["--zcopy-thresh", "4096"] if zcopy else []
    s, c, _ = run_pair(peer_argv("server", "{port}", tx_s, tx_c),
                       peer_argv("client", "{port}", tx_c, tx_s),
                       server={"opts": opts}, client={"opts": opts})
    results = {}
    for proc in (s, c):
        r = results[proc.name] = peer_result(proc)
        log(f"{proc.name}: sent {r['sent']} bytes in {r['msgs_sent']} messages "
            f"({r['sends']} sends), received {r['received']} ({r['recvs']} receives), "
            f"{r['elapsed']} s")
        if r["msgs_sent"] != msgs:
            fail(f"{proc.name} sent {r['msgs_sent']} messages, expected {msgs}")
    if results["server"]["sent"] != results["client"]["received"] or \
            results["client"]["sent"] != results["server"]["received"]:
        fail(f"sent/received differ: {results}")
    for proc in (s, c):
        r = results[proc.name]
        check_sdp(proc.stats, tx=r["sent"], rx=r["received"], zcopy=zcopy, proc=proc,
                  what="the pair")


def speaks_first_pair(*, preloaded, speaker, size, seed, use_nc, fab_server=None,
                      fab_client=None, env_server=None, env_client=None):
    """One fallback run, 1 MiB each way verified. preloaded: "server", "client" or
    "both" (then on fab_server / fab_client, with env_server / env_client added to
    each side's environment); speaker: which side sends first (the other waits for
    its first byte). use_nc: the plain speaker is nc."""
    d = tmpdir()
    tx_s, tx_c = (2 * seed + 2, 0, size), (2 * seed + 1, 0, size)
    sides = {"server": {"sdp": preloaded in ("server", "both"), "fab": fab_server,
                        "env": env_server},
             "client": {"sdp": preloaded in ("client", "both"), "fab": fab_client,
                        "env": env_client}}
    nc_side = speaker if use_nc and not sides[speaker]["sdp"] else None
    files = {}
    argv = {}
    for role, tx, rx in (("server", tx_s, tx_c), ("client", tx_c, tx_s)):
        if role == nc_side:
            src, dst = os.path.join(d, f"{role}.in"), os.path.join(d, f"{role}.out")
            write_stream_file(src, tx[0], size)
            files[role] = (dst, rx[0])
            sides[role].update(stdin=src, stdout=dst)
            argv[role] = ["nc", "-N"] + (["-l"] if role == "server" else []) + [LOOP, "{port}"]
        else:
            # Against nc the Python side closes last (nc exits at EOF from the network,
            # possibly with input unsent); against Python the speaker closes first.
            argv[role] = peer_argv(role, "{port}", tx, rx, wait_first=(role != speaker),
                                   close_after_eof=(nc_side is not None or role != speaker))
    log(f"--- {preloaded} preloaded, the {speaker} speaks first"
        + (f" (nc as the {nc_side})" if nc_side else ""))
    s, c, _ = run_pair(argv["server"], argv["client"], server=sides["server"],
                       client=sides["client"])
    for proc in (s, c):
        if proc.name == nc_side:
            dst, rx_seed = files[proc.name]
            check_stream_file(dst, rx_seed, size, f"{proc.name} (nc) output")
        else:
            r = peer_result(proc)
            log(f"{proc.name}: sent {r['sent']}, received {r['received']} verified, "
                f"{r['elapsed']} s")
            if r["sent"] != size or r["received"] != size:
                fail(f"{proc.name}: sent {r['sent']}, received {r['received']}, expected {size}")
    return s, c


def case_fallback(kind):
    seed, size = base_seed(), 1 << 20
    use_nc = shutil.which("nc") is not None
    if not use_nc:
        log("nc not installed (netcat-openbsd): plain Python in its place")
    if kind == "nc_client":
        for speaker in ("client", "server"):
            s, _ = speaks_first_pair(preloaded="server", speaker=speaker, size=size,
                                     seed=seed, use_nc=use_nc)
            check_tcp(s.stats, {"peer_no_sdp"}, proc=s)
    elif kind == "nc_server":
        for speaker in ("server", "client"):
            _, c = speaks_first_pair(preloaded="client", speaker=speaker, size=size,
                                     seed=seed, use_nc=use_nc)
            check_tcp(c.stats, {"peer_no_sdp"}, proc=c)
    elif kind == "other_fabric":
        here, there = itest.fabric(), itest.fabric() + "_other"
        # Either reason: before connecting, a side looks for the peer's layer on its own
        # fabric (none: peer_no_sdp); a handshake that gets as far as comparing fabric
        # names says other_fabric.
        reasons = {"other_fabric", "peer_no_sdp"}
        for speaker in ("client", "server"):
            s, c = speaks_first_pair(preloaded="both", speaker=speaker, size=size, seed=seed,
                                     use_nc=False, fab_server=here, fab_client=there)
            for proc in (s, c):
                check_tcp(proc.stats, reasons, proc=proc)
        if use_nc:
            log("--- nc -l and nc -N on different fabrics")
            s, c = nc_one_way(seed, size, server={"fab": here}, client={"fab": there})
            for proc in (s, c):
                check_tcp(proc.stats, reasons, proc=proc)
    elif kind == "ring_sizes":
        # Rings of different sizes (PCIENTB_SDP_RING on one side only): whichever side
        # finds the peer's ring larger than its own ends the handshake.
        small, big = {"PCIENTB_SDP_RING": str(1 << 20)}, {"PCIENTB_SDP_RING": str(4 << 20)}
        for env_s, env_c, reasons in ((small, big, {"verbs_setup_failed", "declined"}),
                                      (big, small, {"verbs_setup_failed", "peer_abandoned"})):
            s, c = speaks_first_pair(preloaded="both", speaker="client", size=size, seed=seed,
                                     use_nc=False, env_server=env_s, env_client=env_c)
            for proc in (s, c):
                check_tcp(proc.stats, reasons, proc=proc)
    else:
        usage()


def case_selftest():
    """The checks reject what they must, on made-up stats files."""
    global SHIM
    SHIM = False  # enforced here whatever the environment says
    d = tmpdir()

    def stats(lines):
        path = os.path.join(d, f"s{len(os.listdir(d))}")
        with open(path, "w") as f:
            f.write("".join(line + "\n" for line in lines))
        return SdpStats("selftest", path)

    def rejects(fn, *args, **kw):
        try:
            fn(*args, **kw)
        except itest.TestFailure as e:
            log(f"rejected as it should: {e}")
            return
        fail(f"{fn.__name__}{args} {kw} passed")

    sdp = ("conn pid=10 prog=iperf3 role=client path=sdp reason=ok bcopy_tx=1000 bcopy_rx=10 "
           "zcopy_tx=500 zcopy_rx=0")
    tcp = ("conn pid=10 prog=python3 role=server path=tcp reason=peer_no_sdp bcopy_tx=0 "
           "bcopy_rx=0 zcopy_tx=0 zcopy_rx=0")
    odd = ("conn pid=11 prog=my prog role=server path=sdp reason=ok bcopy_tx=1 bcopy_rx=2 "
           "zcopy_tx=3 zcopy_rx=4 extra=x")
    c = parse_conn_line(odd)
    if not c or c["prog"] != "my prog" or c["tx"] != 4 or c["rx"] != 6 or c["extra"] != "x":
        fail(f"parse_conn_line({odd!r}) = {c}")
    for bad in ("conn pid=1 prog=x role=client path=sdp reason=ok bcopy_tx=1",
                "pcientb-sdp: something", "conn pid=x prog=a role=b path=sdp reason=ok "
                "bcopy_tx=1 bcopy_rx=1 zcopy_tx=1 zcopy_rx=1"):
        if parse_conn_line(bad) is not None:
            fail(f"parse_conn_line accepted {bad!r}")
    check_sdp(stats([sdp]), tx=1500, rx=10)
    check_sdp(stats([]), required=False)
    rejects(check_sdp, stats([]))  # nothing preloaded: no lines at all
    rejects(check_sdp, stats([sdp, tcp]))  # a silent fallback among SDP connections
    rejects(check_sdp, stats([tcp]))
    rejects(check_sdp, stats([sdp]), tx=1501)  # bytes that went elsewhere
    rejects(check_sdp, stats([sdp]), rx=11)
    rejects(check_sdp, stats([sdp]), conns=2)
    rejects(check_sdp, stats([sdp]), zcopy=True)  # zcopy_rx=0
    rejects(check_sdp, stats([tcp]), required=False)
    rejects(stats([sdp, "garbage"]).conns)
    check_tcp(stats([tcp]), {"peer_no_sdp"})
    rejects(check_tcp, stats([tcp]), {"other_fabric"})
    rejects(check_tcp, stats([sdp]), {"ok"})
    rejects(check_tcp, stats([]), {"peer_no_sdp"})
    rejects(check_tcp, stats([tcp.replace("bcopy_tx=0", "bcopy_tx=5")]), {"peer_no_sdp"})
    # Total lines: what each process's conn lines add up to.
    total = ("total pid=10 prog=iperf3 conns=2 sdp=1 tcp=1 bcopy_tx=1000 bcopy_rx=10 "
             "zcopy_tx=500 zcopy_rx=0 tcp_reasons=peer_no_sdp:1")
    t = parse_total_line(total)
    if not t or t["conns"] != 2 or t["tcp_reasons"] != {"peer_no_sdp": 1}:
        fail(f"parse_total_line({total!r}) = {t}")
    if totals_problems(stats([sdp, tcp, total])):
        fail("a total line that agrees with its conn lines was refused")
    for wrong in (total.replace("conns=2", "conns=3"), total.replace("zcopy_tx=500", "zcopy_tx=5"),
                  total.replace("peer_no_sdp:1", "rule:1"), total.replace("pid=10", "pid=11")):
        if not totals_problems(stats([sdp, tcp, wrong])):
            fail(f"a wrong total line passed: {wrong!r}")
    if not totals_problems(stats([sdp, tcp, total, total])):
        fail("two total lines of one process passed")
    at_exec = ("total pid=10 prog=iperf3 conns=1 sdp=1 tcp=0 bcopy_tx=1000 bcopy_rx=10 "
               "zcopy_tx=500 zcopy_rx=0 tcp_reasons=-")
    at_exit = ("total pid=10 prog=python3 conns=1 sdp=0 tcp=1 bcopy_tx=0 bcopy_rx=0 "
               "zcopy_tx=0 zcopy_rx=0 tcp_reasons=peer_no_sdp:1")
    if totals_problems(stats([sdp, at_exec, tcp, at_exit])):
        fail("an image's total line at exec, then the next image's at exit, was refused")
    rejects(stats([sdp, total.replace("tcp_reasons=peer_no_sdp:1", "tcp_reasons=")]).totals)

    class Exited:
        name, pid, rc = "client", 10, 0

    if not totals_problems(stats([sdp]), Exited()):
        fail("a process that exited normally without its total line passed")
    # The streams: what one side writes the other checks, and a changed byte shows.
    path = os.path.join(d, "stream")
    total = stream_total(7, msgs=1000)
    sizes = list(message_sizes(7, msgs=1000))
    if len(sizes) != 1000 or min(sizes) < 1 or max(sizes) > MAX_CHUNK or sizes[:2] != [1, 65536]:
        fail(f"message sizes out of range: {min(sizes)}..{max(sizes)}, {len(sizes)}")
    write_stream_file(path, 7, total)
    check_stream_file(path, 7, total, "stream file")
    with open(path, "r+b") as f:
        f.seek(total // 2)
        b = f.read(1)
        f.seek(total // 2)
        f.write(bytes([b[0] ^ 1]))
    rejects(check_stream_file, path, 7, total, "changed stream file")
    rejects(check_stream_file, path, 7, total + 1, "short stream file")


CASES = {
    "iperf3": lambda: case_iperf3([], 1),
    "iperf3.reverse": lambda: case_iperf3(["-R"], 1),
    "iperf3.parallel": lambda: case_iperf3(["-P", "4"], 4),
    "sockperf.ping_pong": lambda: case_sockperf("ping_pong"),
    "sockperf.throughput": lambda: case_sockperf("throughput"),
    "redis": case_redis,
    "memcached": case_memcached,
    "asyncio": case_asyncio,
    "churn": case_churn,
    "many": case_many,
    "nginx": case_nginx,
    "qperf.tcp_bw": lambda: case_qperf("tcp_bw"),
    "qperf.tcp_lat": lambda: case_qperf("tcp_lat"),
    "curl": case_curl,
    "netcat": case_netcat,
    "pingpong.verify": lambda: case_pingpong(100000, zcopy=False),
    "pingpong.verify_zcopy": lambda: case_pingpong(20000, zcopy=True),
    "fallback.nc_client": lambda: case_fallback("nc_client"),
    "fallback.nc_server": lambda: case_fallback("nc_server"),
    "fallback.other_fabric": lambda: case_fallback("other_fabric"),
    "fallback.ring_sizes": lambda: case_fallback("ring_sizes"),
    "selftest": case_selftest,
}
for _mode in ("system", "popen", "inetd", "cgi", "reexec", "fork", "daemon", "shell",
              "subprocess"):
    CASES[f"process.{_mode}"] = lambda m=_mode: case_process(m)


def usage():
    print(__doc__)
    sys.exit(2)


def main():
    if len(sys.argv) >= 2 and sys.argv[1] == "_peer":
        peer_main(sys.argv[2:])
        return
    if len(sys.argv) != 2 or sys.argv[1] not in CASES:
        usage()
    case = CASES[sys.argv[1]]
    if sys.argv[1] != "selftest":
        sdp_launcher()  # says what is missing before anything starts
        if SHIM:
            log("PCIENTB_SDP_ITEST_SHIM=1: stats checks are printed, not enforced")
    itest.main(case)


if __name__ == "__main__":
    main()
