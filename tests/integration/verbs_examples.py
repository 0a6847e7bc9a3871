#!/usr/bin/env python3
"""Integration tests with rdma-core's example programs (Debian ibverbs-utils).

  verbs_examples.py devices
  verbs_examples.py devinfo
  verbs_examples.py pingpong TOOL [OPTIONS...]   e.g. pingpong ibv_rc_pingpong -e
  verbs_examples.py uc_unsupported
"""

import os
import re
import subprocess
import sys

import itest
from itest import DEVICE, fail, log

PYVERBS_PYTHON = os.environ.get("PCIENTB_PYVERBS_PYTHON", "/usr/bin/python3")


def test_devices():
    itest.require_tools("ibv_devices")
    p = itest.Proc("ibv_devices", ["ibv_devices"], timeout=20)
    p.wait()
    out = p.output()
    p.dump()
    if p.rc != 0:
        fail(f"ibv_devices: {p.status()}")
    m = re.search(rf"^\s*{DEVICE}\s+([0-9a-f]{{16}})\s*$", out, re.MULTILINE)
    if not m:
        fail(f"ibv_devices does not list {DEVICE} with a node GUID")
    if int(m.group(1), 16) == 0:
        fail("node GUID is zero")
    itest.check_no_errors([p])


def _field(out, name):
    m = re.search(rf"^\s*{re.escape(name)}:\s*(.+?)\s*$", out, re.MULTILINE)
    if not m:
        fail(f"ibv_devinfo -v prints no '{name}'")
    return m.group(1)


def test_devinfo():
    itest.require_tools("ibv_devinfo")
    # Plain listing first: it must open and query the device too.
    plain = itest.Proc("ibv_devinfo", ["ibv_devinfo", "-d", DEVICE], timeout=20)
    plain.wait()
    if plain.rc != 0 or f"hca_id:\t{DEVICE}" not in plain.output():
        plain.dump()
        fail(f"ibv_devinfo -d {DEVICE}: {plain.status()}")
    p = itest.Proc("ibv_devinfo-v", ["ibv_devinfo", "-v", "-d", DEVICE], timeout=20)
    p.wait()
    out = p.output()
    p.dump()
    if p.rc != 0:
        fail(f"ibv_devinfo -v: {p.status()}")
    # "X not supported" lines are capabilities ibv_devinfo reports, not errors.
    itest.check_no_errors([p, plain], allow=[r"^\s*[\w ]+ not supported$"])
    checks = {
        "vendor_id": lambda v: v == "0x10b5",
        "vendor_part_id": lambda v: v == "34633",
        "transport": lambda v: v.startswith("InfiniBand"),
        "phys_port_cnt": lambda v: int(v) >= 1,
        "state": lambda v: v.startswith("PORT_ACTIVE"),
        "phys_state": lambda v: v.startswith("LINK_UP"),
        "link_layer": lambda v: v == "InfiniBand",
        "port_lid": lambda v: int(v, 0) > 0,
        "max_qp_rd_atom": lambda v: int(v) > 0,  # ib_read_bw, pyverbs atomic
        "gid_tbl_len": lambda v: int(v) > 0,  # pyverbs, UCX
        "pkey_tbl_len": lambda v: int(v) > 0,
        "num_comp_vectors": lambda v: int(v) >= 1,  # -e in perftest
        "active_mtu": lambda v: v.startswith(("1024", "2048", "4096")),
    }
    for name, ok in checks.items():
        value = _field(out, name)
        if not ok(value):
            fail(f"ibv_devinfo -v: {name} = {value!r} is not what consumers need")
        log(f"{name} = {value}")
    gids = re.findall(r"GID\[\s*(\d+)\]:\s*([0-9a-f:]+)", out)
    if not gids:
        fail("ibv_devinfo -v prints no GID")
    idx, gid = gids[0]
    if idx != "0" or int(gid.replace(":", ""), 16) == 0:
        fail(f"GID[{idx}] = {gid}: GID 0 must be non-zero")
    log(f"GID[0] = {gid}")


PP_BYTES = re.compile(r"(\d+) bytes in ([\d.]+) seconds = ([\d.]+) Mbit/sec")
PP_ITERS = re.compile(r"(\d+) iters in ([\d.]+) seconds = ([\d.]+) usec/iter")
PP_ADDR = re.compile(r"(local|remote) address:\s+LID 0x([0-9a-f]+), QPN 0x([0-9a-f]+)")


def test_pingpong(tool, opts):
    itest.require_tools(tool)
    base = [tool, "-d", DEVICE, "-p", "{port}"] + opts
    server, client = itest.run_pair(base, base + ["localhost"])
    itest.check_no_errors([server, client])
    addrs = {}
    for p in (server, client):
        out = p.output()
        b, i = PP_BYTES.search(out), PP_ITERS.search(out)
        if not b or not i:
            p.dump()
            fail(f"{p.name}: no throughput/latency summary")
        nbytes, mbit = int(b.group(1)), float(b.group(3))
        iters, usec = int(i.group(1)), float(i.group(3))
        if nbytes <= 0 or mbit <= 0 or iters <= 0 or usec <= 0:
            p.dump()
            fail(f"{p.name}: implausible figures: {b.group(0)} / {i.group(0)}")
        log(f"{p.name}: {b.group(0)}; {i.group(0)}")
        addrs[p.name] = {k: (lid, qpn) for k, lid, qpn in PP_ADDR.findall(out)}
    # Each side must have connected to the other's address.
    for me, other in (("server", "client"), ("client", "server")):
        if addrs[me].get("remote") != addrs[other].get("local"):
            fail(f"{me}'s remote address {addrs[me].get('remote')} is not "
                 f"{other}'s local address {addrs[other].get('local')}")


UC_CHECK = r"""
import errno, sys
from pyverbs.device import Context
from pyverbs.pd import PD
from pyverbs.cq import CQ
from pyverbs.qp import QPCap, QPInitAttr, QP
from pyverbs.pyverbs_error import PyverbsRDMAError
import pyverbs.enums as e
ctx = Context(name=sys.argv[1])
pd = PD(ctx)
cq = CQ(ctx, 16)
attr = QPInitAttr(qp_type=e.IBV_QPT_UC, scq=cq, rcq=cq, cap=QPCap(max_send_wr=4, max_recv_wr=4))
try:
    QP(pd, attr)
except PyverbsRDMAError as ex:
    print(f"create UC QP: errno {ex.error_code} ({errno.errorcode.get(ex.error_code, '?')})")
    sys.exit(0 if ex.error_code == errno.EOPNOTSUPP else 1)
print("create UC QP: succeeded, expected EOPNOTSUPP")
sys.exit(1)
"""


def test_uc_unsupported():
    """UC is not supported: both sides must fail at QP creation, promptly and cleanly."""
    itest.require_tools("ibv_uc_pingpong")
    base = ["ibv_uc_pingpong", "-d", DEVICE, "-p", str(itest.free_port())]
    for name, argv in (("server", base), ("client", base + ["localhost"])):
        p = itest.Proc(name, argv, timeout=20)
        p.wait()
        p.dump()
        if p.timed_out or p.rc is None or p.rc <= 0:
            fail(f"ibv_uc_pingpong {name}: {p.status()}; expected a clean failure (exit 1)")
        if p.elapsed > 5:
            fail(f"ibv_uc_pingpong {name} took {p.elapsed:.1f}s to fail")
        if "Couldn't create QP" not in p.output():
            fail(f"ibv_uc_pingpong {name} did not fail at QP creation")
    # The errno behind "Couldn't create QP" (the tool does not print it).
    if subprocess.run([PYVERBS_PYTHON, "-c", "import pyverbs"], capture_output=True).returncode:
        log(f"{PYVERBS_PYTHON} has no pyverbs: errno of ibv_create_qp(UC) not checked")
        return
    p = itest.Proc("pyverbs-uc", [PYVERBS_PYTHON, "-c", UC_CHECK, DEVICE], timeout=20)
    p.wait()
    p.dump()
    if p.rc != 0:
        fail(f"ibv_create_qp(IBV_QPT_UC) must fail with EOPNOTSUPP: {p.status()}")


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        sys.exit(2)
    case, args = sys.argv[1], sys.argv[2:]
    if case == "devices":
        itest.main(test_devices)
    elif case == "devinfo":
        itest.main(test_devinfo)
    elif case == "pingpong":
        itest.main(lambda: test_pingpong(args[0], args[1:]))
    elif case == "uc_unsupported":
        itest.main(test_uc_unsupported)
    else:
        print(__doc__)
        sys.exit(2)


if __name__ == "__main__":
    main()
