#!/usr/bin/env python3
"""Integration test with qperf (Debian's qperf, unmodified).

  qperf.py TEST [QPERF OPTIONS...]    e.g. qperf.py rc_rdma_read_bw -m 64K

The server is `qperf -lp PORT` (it serves until stopped), the client
`qperf -lp PORT localhost -t 1 [OPTIONS] TEST`. Checks: the client exits 0,
prints no error, and every figure it reports (bw, latency, msg_rate,
send_bw/recv_bw) is > 0.
"""

import re
import sys

import itest
from itest import fail, log

UNITS = {
    "bytes/sec": 1, "KB/sec": 1e3, "MB/sec": 1e6, "GB/sec": 1e9,
    "ns": 1e-9, "us": 1e-6, "ms": 1e-3, "sec": 1,
    "/sec": 1, "K/sec": 1e3, "M/sec": 1e6, "G/sec": 1e9,
}


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        sys.exit(2)
    test, opts = sys.argv[1], sys.argv[2:]
    itest.require_tools("qperf")

    def run():
        server, client = itest.run_pair(
            ["qperf", "-lp", "{port}"],
            ["qperf", "-lp", "{port}", "localhost", "-t", "1"] + opts + [test],
            server_persists=True)
        itest.check_no_errors([server, client])
        out = client.output()
        if not re.search(rf"^{re.escape(test)}:\s*$", out, re.MULTILINE):
            client.dump()
            fail(f"qperf printed no '{test}:' section")
        figures = re.findall(r"^\s+(\w+)\s+=\s+([\d.]+)\s+(\S+)\s*$", out, re.MULTILINE)
        if not figures:
            client.dump()
            fail(f"{test}: no figures")
        for name, value, unit in figures:
            log(f"{test}: {name} = {value} {unit}")
            if float(value) <= 0:
                client.dump()
                fail(f"{test}: {name} = {value} {unit} is not > 0")
            if unit not in UNITS:
                fail(f"{test}: unknown unit {unit!r} for {name}")

    itest.main(run)


if __name__ == "__main__":
    main()
