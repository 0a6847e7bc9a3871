#!/usr/bin/env python3
"""Integration test with one perftest tool (Debian's perftest, unmodified).

  perftest.py TOOL [OPTIONS...]     e.g. perftest.py ib_write_bw -q 4
  perftest.py --valgrind TOOL ...   both sides under valgrind memcheck: any
                                    error in the provider fails the test

Runs `TOOL -d pcientb0 -p PORT OPTIONS` as the server and the same plus
`localhost` as the client, then checks: both exit 0, no error lines, a result
table with sensible figures (> 0) for every message size asked for, and the
settings the options ask for (number of QPs, sizes, iterations, units).
"""

import os
import re
import sys

import itest
from itest import DEVICE, fail, log

# perftest prints this for every device whose vendor_part_id is not in its
# table (ib_dev_name() -> UNKNOWN): it only means "no inline by default".
ALLOWED = [r"^Device not recognized to implement inline feature\. Disabling it$"]

NUM = r"[-+]?\d+(?:\.\d+)?"

# valgrind's own notes ("--pid-- WARNING: unhandled syscall: 434": pidfd_open,
# which the provider does without).
VALGRIND_NOTES = [r"^--\d+-- "]
VALGRIND = ["valgrind", "-q", "--error-exitcode=99",
            "--suppressions=" + os.path.join(os.path.dirname(__file__), "valgrind.supp")]


def parse_table(out):
    """Rows of the result table: (header, [list of floats per row])."""
    header = None
    rows = []
    for line in out.splitlines():
        if re.match(r"^\s*#bytes\s", line):
            header = line.split()
            continue
        if header and re.match(rf"^\s*\d+\s+\d+(\s+{NUM})+\s*$", line):
            rows.append([float(x) for x in line.split()])
    return header, rows


def option_value(opts, short, long=None):
    for i, o in enumerate(opts):
        if o == short and i + 1 < len(opts):
            return opts[i + 1]
        if long and o.startswith(long + "="):
            return o.split("=", 1)[1]
    return None


def check_results(p, tool, opts):
    out = p.output()
    header, rows = parse_table(out)
    if not rows:
        return False
    is_bw = tool.endswith("_bw")
    atomic = tool.startswith("ib_atomic")
    text_header = " ".join(header)
    if is_bw:
        unit = "Gb/sec" if "--report_gbits" in opts else "MB/sec"
        if f"BW average[{unit}]" not in text_header:
            fail(f"{p.name}: expected BW in {unit}: {text_header}")
    for r in rows:
        size, iters = int(r[0]), int(r[1])
        if iters <= 0:
            fail(f"{p.name}: {size} bytes: {iters} iterations")
        if is_bw:
            peak, avg, rate = r[2], r[3], r[4]
            # perftest prints BW with two decimals: a short run of tiny messages
            # that met one scheduling stall can print 0.00 while its rate is real.
            scale = 8e6 / 1e9 if unit == "Gb/sec" else 1e6 / 2**20
            rounds_to_zero = size * rate * scale < 0.01
            if rate <= 0 or peak < 0 or (avg <= 0 and not rounds_to_zero):
                fail(f"{p.name}: {size} bytes: BW average {avg}, MsgRate {rate}: not > 0")
        else:
            t_min, t_max, t_typ, t_avg = r[2], r[3], r[4], r[5]
            if t_avg <= 0 or t_typ <= 0 or t_max < t_min or t_min < 0:
                fail(f"{p.name}: {size} bytes: t_min {t_min} t_max {t_max} "
                     f"t_typical {t_typ} t_avg {t_avg}: implausible")
    sizes = [int(r[0]) for r in rows]
    if "-a" in opts:
        expected = [2**i for i in range(1, 24)]
        # A passive RDMA WRITE/READ server reports only the last size.
        passive = p.name == "server" and len(sizes) == 1 and sizes[0] == expected[-1]
        if sizes != expected and not passive:
            fail(f"{p.name}: -a ran sizes {sizes}, expected 2..2^23")
    elif atomic:
        if sizes != [8]:
            fail(f"{p.name}: atomic size {sizes}, expected [8]")
    else:
        want = option_value(opts, "-s", "--size")
        if want and sizes != [int(want)]:
            fail(f"{p.name}: size {sizes}, expected [{want}]")
    n = option_value(opts, "-n", "--iters")
    if n and "-a" not in opts:
        got = [int(r[1]) for r in rows]
        if got != [int(n)]:
            fail(f"{p.name}: iterations {got}, expected {n}")
    log(f"{p.name}: {text_header}")
    for r in rows:
        log(f"{p.name}: " + "  ".join(f"{v:g}" for v in r))
    return True


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        sys.exit(2)
    args = sys.argv[1:]
    wrap, allowed = [], ALLOWED
    if args[0] == "--valgrind":
        itest.require_tools("valgrind")
        wrap, allowed, args = VALGRIND, ALLOWED + VALGRIND_NOTES, args[1:]
    tool, opts = args[0], args[1:]
    itest.require_tools(tool)

    def run():
        base = wrap + [tool, "-d", DEVICE, "-p", "{port}"] + opts
        server, client = itest.run_pair(base, base + ["localhost"])
        itest.check_no_errors([server, client], allow=allowed)
        # The client always reports; the server too in the BW tests (and in
        # the send/write ping-pong latency tests). Whoever reports is checked.
        if not check_results(client, tool, opts):
            client.dump()
            fail("client printed no result table")
        server_reports = check_results(server, tool, opts)
        if tool.endswith("_bw") and not server_reports and "-b" in opts:
            server.dump()
            fail("server printed no result table in bidirectional mode")
        q = option_value(opts, "-q", "--qp")
        if q:
            for p in (server, client):
                m = re.search(r"Number of qps\s*:\s*(\d+)", p.output())
                if not m or m.group(1) != q:
                    fail(f"{p.name}: expected 'Number of qps : {q}'")
        if "-e" in opts or "--events" in opts:
            # perftest has no banner line for -e; the run itself must have used
            # the completion channel: nothing to parse, the pass is the check.
            pass

    itest.main(run)


if __name__ == "__main__":
    main()
