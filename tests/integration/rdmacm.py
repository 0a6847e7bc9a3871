#!/usr/bin/env python3
"""Integration tests of rdma_cm on pcientb0 (librdmacm_glue), with unmodified
programs from Debian's rdmacm-utils, perftest and libfabric-bin.

  rdmacm.py CASE

Cases (two processes each unless said otherwise):
  rping            rping -C 1000 -V (data verified by rping)
  rping.own_qp     rping -q: the program creates and moves its own QP
                   (CONNECT_RESPONSE, rdma_establish)
  ucmatose         4 connections, 100 messages each
  ucmatose.migrate the same with rdma_migrate_id (-m)
  ucmatose.ipv6    over ::1
  udaddy           UD: SIDR, 4 endpoints
  rdma_server      rdma_server/rdma_client (synchronous ids, rdma_create_ep)
  rdma_xserver     rdma_xserver/rdma_xclient (RC)
  cmtime           100 connections set up and torn down, timed
  rstream          rsockets: blocking, then -T n (non-blocking + poll)
  riostream        rsockets with riowrite (RDMA writes into mapped buffers, whose
                   last byte each side polls and rewrites at once: a WRITE must
                   store each byte once, the last ones last; 100,000 ping-pongs
                   of 64 B among its tests)
  ib_write_bw      perftest -R; also ib_read_bw, ib_send_lat
  ib_read_bw
  ib_send_lat
  fi_msg           libfabric verbs fi_pingpong -e msg (also dgram, rdm)
  fi_dgram
  fi_rdm
  no_listener      a connect to a port nobody listens on is REJECTED at once
  peer_death       the server is SIGKILLed mid-run: the client sees
                   DISCONNECTED and exits within a second, no hang
  mckey            multicast is refused with a clear error (EOPNOTSUPP)
  rsockets.iperf3  iperf3 under `pcientb-run --rsockets` (Debian's librspreload with
                   libpcientb-rscompat.so in front): one stream each way (-R) and two
                   (-P 2), -J figures checked, the bytes in the provider's counters
  rsockets.sockperf  sockperf ping-pong and throughput (TCP) under --rsockets
  rsockets.compat  libpcientb-rscompat.so alone leaves kernel sockets as they are:
                   AF_UNIX keeps EISCONN and EOPNOTSUPP, select() and poll() on pipes
                   and TCP sockets report, time out and fail (EBADF) as the kernel's,
                   also waits long enough to go in slices, with and without a timeout
  io_demo          UCX's io_demo (ucx-utils) over UCX's rdmacm connection manager on
                   rc_verbs: 8 KiB writes, then writes and reads of 1 B to 1 MiB (eager
                   and rendezvous) with the TAG API and with the AM API and -z, the data
                   checked by io_demo (-q). Both sides get the same -d: io_demo sizes
                   its buffers by its own -d (default 4096) and splits a message into
                   receives of that size, so a server without it never completes a
                   larger write, on any transport (NOTES.md)
"""

import os
import re
import signal
import socket
import sys
import time

import itest
from itest import fail, log

RSOCKETS = ["--rsockets"]  # pcientb-run's option: librspreload and its compat library

PS_TCP, PS_UDP = 0x106, 0x111


def cm_pair(server_argv, client_argv, *, ps=PS_TCP, **kw):
    """Server first (until its rdma_cm listener is up), then the client."""
    return itest.run_pair(server_argv, client_argv,
                          ready=lambda proc, p, t: proc.wait_cm_listening(p, ps, t), **kw)


def expect(proc, pattern, what):
    m = re.search(pattern, proc.output(), re.MULTILINE)
    if not m:
        proc.dump()
        fail(f"{proc.name}: {what} (no match for {pattern!r})")
    return m


def host_address():
    """A non-loopback IPv4 address of this host (libfabric's verbs skips loopback)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent
            addr = s.getsockname()[0]
        if not addr.startswith("127."):
            return addr
    except OSError:
        pass
    for name in socket.gethostbyname_ex(socket.gethostname())[2]:
        if not name.startswith("127."):
            return name
    return None


def rstream_figures(proc):
    rows = re.findall(r"^\S+\s+\S+\s+\S+\s+\S+\s+\S+\s+[\d.]+s\s+([\d.]+)\s+([\d.]+)\s*$",
                      proc.output(), re.MULTILINE)
    if not rows or any(float(gbps) <= 0 for gbps, _ in rows):
        proc.dump()
        fail(f"{proc.name}: no transfer figures")
    return rows


def io_demo_runs(loop):
    itest.require_tools("io_demo")
    runs = (("8 KiB writes", ["-d", "8192", "-o", "write", "-i", "32"], []),
            ("1 B-1 MiB, TAG API", ["-d", "1:1048576", "-o", "write,read", "-i", "64"], []),
            ("1 B-1 MiB, AM API, -z", ["-d", "1:1048576", "-o", "write,read", "-i", "64"],
             ["-A", "-z"]))
    # What io_demo prints as it ends: the client cancels its pending IO-message
    # receive; the server sees the client leave and cancels its own. UCX's rdmacm
    # listener looks for the kernel's rdma_ucm sysctl (a DIAG line).
    allow = itest.UCX_INFO_ALLOWED + [r"iomsg receive request \S+ failed: Request canceled",
                                      r"Connection reset by remote peer",
                                      r"unable to read max_backlog value from /proc/sys/net/"]
    for what, client_opts, both in runs:
        stats = itest.Stats("io_demo")
        env = {"UCX_NET_DEVICES": "pcientb0:1", "UCX_TLS": "rc_v",
               "UCX_SOCKADDR_TLS_PRIORITY": "rdmacm", "UCX_LOG_LEVEL": "info", **stats.env()}
        port = itest.free_port()
        # The server must know the sizes too (-d): see the docstring.
        size = ["-d", client_opts[client_opts.index("-d") + 1]]
        s = itest.Proc("server", ["io_demo", "-p", str(port), "-q", "-s", "1"] + size + both,
                       env=env)
        c = None
        try:
            if not s.wait_cm_listening(port):
                s.dump()
                fail(f"io_demo server did not listen on port {port}: {s.status()}")
            c = itest.Proc("client", ["io_demo", loop, "-p", str(port), "-q", "-s", "1"]
                           + client_opts + both, env=env)
            c.wait()
            s.kill(signal.SIGINT)  # io_demo's server runs until SIGINT, then cleans up
        finally:
            for p in (c, s):
                if p is not None:
                    p.kill()
        if c.rc != 0 or s.rc != 0:
            s.dump()
            c.dump()
            fail(f"io_demo {what}: server {s.status()}, client {c.status()}")
        expect(c, r"Client exit with status 'OK'", f"io_demo {what} did not end OK")
        itest.check_no_errors([s, c], allow=allow)
        itest.check_ucx_lanes([s, c])
        stats.check(processes=2, min_bytes=1, what=f"io_demo {what}")
        log(f"io_demo {what}: {c.status()}")


def rsockets_iperf3(loop):
    itest.require_tools("iperf3")
    # One stream each way, and two (more would meet librdmacm 44's connection-service
    # thread, which loses track of its descriptors beyond 4 rsockets: NOTES.md).
    for extra in ([], ["-R"], ["-P", "2"]):
        stats = itest.Stats("rsockets-iperf3")
        s, c = cm_pair(["iperf3", "-s", "-1", "-p", "{port}", "-J"],
                       ["iperf3", "-c", loop, "-p", "{port}", "-t", "1", "-J"] + extra,
                       env=stats.env(), launch_opts=RSOCKETS)
        # -t 1: a wait for a connection that rsockets misses costs 5 s (rscompat's sliced waits).
        if c.elapsed > 6:
            fail(f"iperf3 {' '.join(extra)} -t 1 took {c.elapsed:.1f} s")
        moved = {}
        for proc in (s, c):
            end = itest.iperf3_json(proc)["end"]
            sender = (proc is c) != ("-R" in extra)
            key = "sum_sent" if sender else "sum_received"
            moved[proc.name] = int(end[key]["bytes"])
            log(f"iperf3 {' '.join(extra)} {proc.name}: {key} {moved[proc.name]} bytes, "
                f"{end[key]['bits_per_second'] / 1e9:.2f} Gbit/s")
        if min(moved.values()) <= 0:
            fail(f"iperf3 {' '.join(extra)}: nothing moved: {moved}")
        # rsockets moves a stream's bytes with RDMA WRITEs: the provider posted them all.
        stats.check(processes=2, min_bytes=moved["client"], what=f"iperf3 {' '.join(extra)}")


def rsockets_sockperf(loop):
    itest.require_tools("sockperf")
    for kind, size in (("ping-pong", 64), ("throughput", 1400)):
        stats = itest.Stats("rsockets-sockperf")
        s, c = cm_pair(["sockperf", "server", "--tcp", "-i", loop, "-p", "{port}"],
                       ["sockperf", kind, "--tcp", "-i", loop, "-p", "{port}", "-t", "1",
                        "-m", str(size)],
                       env=stats.env(), launch_opts=RSOCKETS, server_persists=True)
        itest.check_no_errors([c])
        sent = int(expect(c, r"SentMessages=(\d+)" if kind == "ping-pong"
                          else r"Total of (\d+) messages sent", "no message count")[1])
        figure = expect(c, r"Summary: (Latency is [\d.]+ usec|BandWidth is [\d.]+ MBps)",
                        "no summary")[1]
        log(f"sockperf {kind}: {figure}, {sent} messages of {size} B")
        if sent <= 0:
            fail(f"sockperf {kind}: no message sent")
        # The server is stopped by a signal and may write no counters: the client's suffice.
        stats.check(processes=1, min_bytes=sent * size, what=f"sockperf {kind}")


COMPAT_CHECK = r"""
import errno, os, select, socket, threading, time
def fails(fn, code):
    try:
        fn()
    except OSError as e:
        assert e.errno == code, (fn, e)
        return
    raise AssertionError(f"{fn} did not fail with {errno.errorcode[code]}")
a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
fails(lambda: a.sendto(b"x", "/nonexistent"), errno.EISCONN)
fails(lambda: a.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 232), errno.EOPNOTSUPP)
r, w = os.pipe()
assert select.select([r], [w], [], 0) == ([], [w], [])
t0 = time.monotonic()
assert select.select([r], [], [], 0.2) == ([], [], [])
assert time.monotonic() - t0 >= 0.2
os.write(w, b"y")
assert select.select([r], [], [], 5) == ([r], [], [])
os.read(r, 1)
# Waits long enough to be cut in slices (librspreload's placeholder, /dev/null, in the set
# makes it look like an rsocket; asked for POLLPRI it is never ready): without a timeout
# and with one, select and poll.
devnull = os.open("/dev/null", os.O_RDONLY)
def write_later():
    time.sleep(0.1)
    os.write(w, b"z")
for wait in (lambda: select.select([r], [], [devnull]),
             lambda: select.select([r], [], [devnull], 10)[0]):
    threading.Thread(target=write_later).start()
    t0 = time.monotonic()
    got = wait()
    assert got in (([r], [], []), [r]), got
    assert time.monotonic() - t0 >= 0.09
    os.read(r, 1)
p = select.poll()
p.register(r, select.POLLIN)
p.register(devnull, select.POLLPRI)
t0 = time.monotonic()
assert p.poll(50) == [] and time.monotonic() - t0 >= 0.05
threading.Thread(target=write_later).start()
assert p.poll() == [(r, select.POLLIN)]
os.read(r, 1)
os.close(w)
fails(lambda: select.select([w], [], [], 0), errno.EBADF)
srv = socket.create_server(("127.0.0.1", 0))
cli = socket.create_connection(srv.getsockname())
conn, _ = srv.accept()
assert cli.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 232)[0] == 1  # ESTABLISHED
cli.sendall(b"z")
idle, _ = os.pipe()
assert select.select([idle, conn], [], [], 5)[0] == [conn]
print("compat: kernel sockets unchanged")
"""


def rsockets_compat():
    lib = os.path.join(os.path.dirname(itest.launcher()), "..", "lib", "libpcientb-rscompat.so")
    if not os.path.exists(lib):
        fail(f"{lib} was not built")
    # Preloaded by pcientb-run (PCIENTB_RUN_BEFORE), which puts a sanitizer build's runtime
    # first and does not load it itself.
    p = itest.Proc("compat", [sys.executable, "-c", COMPAT_CHECK],
                   env={"PCIENTB_RUN_BEFORE": os.path.abspath(lib)})
    p.wait()
    if p.rc != 0:
        p.dump()
        fail(f"kernel sockets behave differently under libpcientb-rscompat.so: {p.status()}")
    expect(p, r"^compat: kernel sockets unchanged$", "the check did not finish")


def run_case(case):
    loop = "127.0.0.1"
    if case == "rping":
        itest.require_tools("rping")
        s, c = cm_pair(["rping", "-s", "-a", loop, "-p", "{port}", "-C", "1000", "-V"],
                       ["rping", "-c", "-a", loop, "-p", "{port}", "-C", "1000", "-V"])
        itest.check_no_errors([s, c])
    elif case == "rping.own_qp":
        itest.require_tools("rping")
        s, c = cm_pair(["rping", "-s", "-q", "-a", loop, "-p", "{port}", "-C", "100", "-V"],
                       ["rping", "-c", "-q", "-a", loop, "-p", "{port}", "-C", "100", "-V"])
        itest.check_no_errors([s, c])
    elif case.startswith("ucmatose"):
        itest.require_tools("ucmatose")
        addr = "::1" if case.endswith("ipv6") else loop
        extra = ["-m"] if case.endswith("migrate") else []
        args = ["-p", "{port}", "-c", "4", "-C", "100"] + extra
        s, c = cm_pair(["ucmatose", "-b", addr] + args, ["ucmatose", "-s", addr] + args)
        for p in (s, c):
            expect(p, r"^return status 0$", "did not complete")
    elif case == "udaddy":
        itest.require_tools("udaddy")
        # udaddy has no port option: its port is fixed (7174), the fabric is the test's own.
        s, c = cm_pair(["udaddy", "-b", loop, "-c", "4"], ["udaddy", "-s", loop, "-c", "4"],
                       ps=PS_UDP, port=7174)
        for p in (s, c):
            expect(p, r"^return status 0$", "did not complete")
    elif case == "rdma_server":
        itest.require_tools("rdma_server", "rdma_client")
        s, c = cm_pair(["rdma_server", "-s", loop, "-p", "{port}"],
                       ["rdma_client", "-s", loop, "-p", "{port}"])
        expect(s, r"rdma_server: end 0", "did not end with 0")
        expect(c, r"rdma_client: end 0", "did not end with 0")
    elif case == "rdma_xserver":
        itest.require_tools("rdma_xserver", "rdma_xclient")
        s, c = cm_pair(["rdma_xserver", "-p", "{port}"],
                       ["rdma_xclient", "-s", loop, "-p", "{port}"])
        expect(s, r"rdma_xserver: end 0", "did not end with 0")
        expect(c, r"rdma_xclient: end 0", "did not end with 0")
    elif case == "cmtime":
        itest.require_tools("cmtime")
        s, c = cm_pair(["cmtime", "-b", loop, "-p", "{port}"],
                       ["cmtime", "-s", loop, "-p", "{port}", "-c", "100"], server_persists=True)
        for step in ("resolve addr", "resolve route", "create qp", "connect", "disconnect",
                     "destroy"):
            expect(c, rf"^{step}\s*:\s+[\d.]+", f"no '{step}' timing")
        itest.check_no_errors([c])
    elif case in ("rstream", "riostream"):
        itest.require_tools(case)
        for opts in ([], ["-T", "n"]) if case == "rstream" else ([],):
            args = ["-p", "{port}"] + opts
            s, c = cm_pair([case, "-b", loop] + args, [case, "-s", loop] + args)
            itest.check_no_errors([s, c])
            for gbps, usec in rstream_figures(c):
                log(f"{case} {' '.join(opts)}: {gbps} Gb/s, {usec} us/xfer")
    elif case in ("ib_write_bw", "ib_read_bw", "ib_send_lat"):
        itest.require_tools(case)
        extra = ["-n", "1000"] if case == "ib_send_lat" else ["-D", "1"]
        s, c = cm_pair([case, "-R", "-F", "-p", "{port}"] + extra,
                       [case, "-R", "-F", "-p", "{port}"] + extra + [loop])
        itest.check_no_errors([s, c], allow=[r"Conflicting CPU frequency"])
        expect(c, r"^\s*\d+\s+\d+\s+[\d.]+\s+[\d.]+", "printed no result line")
    elif case.startswith("fi_"):
        itest.require_tools("fi_pingpong")
        addr = host_address()
        if addr is None:
            log("no non-loopback IPv4 address: libfabric's verbs provider has nothing to use")
            sys.exit(77)
        ep = case[3:]
        args = ["-p", "verbs", "-e", ep, "-I", "200", "-S", "4096", "-c"]
        s, c = itest.run_pair(["fi_pingpong", "-B", "{port}"] + args,
                              ["fi_pingpong", "-P", "{port}"] + args + [addr])
        itest.check_no_errors([s, c])
        expect(c, r"^4k\s+200\s+=200\s+", "did not move 200 x 4 KiB")
    elif case == "no_listener":
        itest.require_tools("rping")
        c = itest.Proc("client", ["rping", "-c", "-a", loop, "-p", str(itest.free_port()),
                                  "-C", "10"])
        c.wait()
        if c.rc == 0 or c.elapsed > 5:
            c.dump()
            fail(f"a connect with no listener: {c.status()} (expected a prompt failure)")
        expect(c, r"RDMA_CM_EVENT_REJECTED", "was not REJECTED")
    elif case == "peer_death":
        itest.require_tools("rping")
        port = itest.free_port()
        s = itest.Proc("server", ["rping", "-s", "-a", loop, "-p", str(port), "-C", "100000000"])
        c = None
        try:
            if not s.wait_cm_listening(port):
                s.dump()
                fail("server did not listen")
            c = itest.Proc("client", ["rping", "-c", "-a", loop, "-p", str(port), "-C", "100000000"])
            time.sleep(1.5)
            if c.poll() is not None:
                c.dump()
                fail(f"client ended before the server was killed: {c.status()}")
            s.kill(signal.SIGKILL)
            killed_at = time.monotonic()
            c.wait(timeout=10)
            if c.rc is None:
                c.dump()
                fail("client still running 10 s after its server was killed")
            took = time.monotonic() - killed_at
            log(f"client ended {took:.3f}s after the server's SIGKILL: {c.status()}")
            expect(c, r"DISCONNECT EVENT|RDMA_CM_EVENT_DISCONNECTED|completion.*error|status",
                   "did not report the disconnection")
            if took > 2:
                fail(f"client took {took:.1f}s to notice its peer's death")
        finally:  # nothing left running, whatever failed
            for p in (c, s):
                if p is not None:
                    p.kill()
    elif case == "io_demo":
        io_demo_runs(loop)
    elif case == "rsockets.iperf3":
        rsockets_iperf3(loop)
    elif case == "rsockets.sockperf":
        rsockets_sockperf(loop)
    elif case == "rsockets.compat":
        rsockets_compat()
    elif case == "mckey":
        itest.require_tools("mckey")
        c = itest.Proc("client", ["mckey", "-m", "224.0.0.1", "-b", loop, "-s", "-C", "1"])
        c.wait()
        if c.rc == 0:
            c.dump()
            fail("mckey succeeded: pcientb has no multicast")
        expect(c, r"join.*Operation not supported", "no clear error for multicast")
    else:
        print(__doc__)
        sys.exit(2)


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        sys.exit(2)
    itest.main(lambda: run_case(sys.argv[1]))


if __name__ == "__main__":
    main()
