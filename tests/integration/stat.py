#!/usr/bin/env python3
"""Integration test of pcientb-stat: a pyverbs program sets up a known state on its
node (two RC QPs connected to each other, MRs, CQs, an SRQ, a UD QP) and moves a known
amount of traffic, including a failed WRITE (bad rkey) and the flushes after it, having
cleared its environment first (as nginx does); then
pcientb-stat, run from outside, must show exactly that, in text and JSON; after the
program exits, its fabric must be gone from the listing.

  stat.py            (PCIENTB_STAT: the pcientb-stat to test)
"""

import json
import os
import subprocess
import sys

import itest
from itest import DEVICE, fail, log

PYTHON = os.environ.get("PCIENTB_PYVERBS_PYTHON", "/usr/bin/python3")

# The worker: prints one JSON line describing what it made, waits for a line on
# stdin, then exits (closing everything).
WORKER = r"""
import json, os, sys
# As nginx does: the environment goes before the device is opened. The node must still
# join the fabric the process was started on (the provider keeps $PCIENTB_FABRIC from load).
os.environ.clear()
from pyverbs.device import Context
from pyverbs.pd import PD
from pyverbs.mr import MR
from pyverbs.cq import CQ
from pyverbs.srq import SRQ, SrqInitAttr, SrqAttr
from pyverbs.qp import QP, QPCap, QPInitAttr, QPAttr
from pyverbs.addr import AHAttr
from pyverbs.wr import SGE, SendWR, RecvWR
import pyverbs.enums as e

ctx = Context(name=sys.argv[1])
lid = ctx.query_port(1).lid
pd = PD(ctx)
acc = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
mr_a = MR(pd, 65536, acc)
mr_b = MR(pd, 65536, acc)
mr_ro = MR(pd, 4096, e.IBV_ACCESS_LOCAL_WRITE)
cq_a = CQ(ctx, 100)
cq_b = CQ(ctx, 100)
srq = SRQ(pd, SrqInitAttr(SrqAttr(max_wr=64, max_sge=1)))

def rc_qp(cq, use_srq):
    init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, sq_sig_all=0, cap=QPCap(max_send_wr=32, max_recv_wr=16, max_send_sge=1, max_recv_sge=1))
    if use_srq:
        init.srq = srq
    return QP(pd, init)

qa = rc_qp(cq_a, False)
qb = rc_qp(cq_b, True)
ud = QP(pd, QPInitAttr(qp_type=e.IBV_QPT_UD, scq=cq_a, rcq=cq_a, cap=QPCap(max_send_wr=8, max_recv_wr=8)))

def connect(q, dest):
    a = QPAttr(qp_state=e.IBV_QPS_INIT)
    a.qp_access_flags = acc
    a.pkey_index = 0
    a.port_num = 1
    q.modify(a, e.IBV_QP_STATE | e.IBV_QP_PKEY_INDEX | e.IBV_QP_PORT | e.IBV_QP_ACCESS_FLAGS)
    a = QPAttr(qp_state=e.IBV_QPS_RTR)
    a.path_mtu = e.IBV_MTU_1024
    a.dest_qp_num = dest
    a.rq_psn = 0
    a.max_dest_rd_atomic = 1
    a.min_rnr_timer = 1
    a.ah_attr = AHAttr(dlid=lid, port_num=1)
    q.modify(a, e.IBV_QP_STATE | e.IBV_QP_AV | e.IBV_QP_PATH_MTU | e.IBV_QP_DEST_QPN | e.IBV_QP_RQ_PSN | e.IBV_QP_MAX_DEST_RD_ATOMIC | e.IBV_QP_MIN_RNR_TIMER)
    a = QPAttr(qp_state=e.IBV_QPS_RTS)
    a.timeout = 14
    a.retry_cnt = 7
    a.rnr_retry = 7
    a.sq_psn = 0
    a.max_rd_atomic = 1
    q.modify(a, e.IBV_QP_STATE | e.IBV_QP_TIMEOUT | e.IBV_QP_RETRY_CNT | e.IBV_QP_RNR_RETRY | e.IBV_QP_SQ_PSN | e.IBV_QP_MAX_QP_RD_ATOMIC)

connect(qa, qb.qp_num)
connect(qb, qa.qp_num)

def poll(cq, n):
    got = []
    while len(got) < n:
        k, wcs = cq.poll(n - len(got))
        got += wcs[:k]
    return got

# SRQ: 10 receives posted; qa SENDs 3 of 100 bytes to qb: 7 stay posted.
for i in range(10):
    srq.post_recv(RecvWR(wr_id=i, num_sge=1, sg=[SGE(mr_b.buf, 4096, mr_b.lkey)]))
def send(op, length, rkey=0, raddr=0, signaled=True):
    wr = SendWR(wr_id=1, opcode=op, num_sge=1, sg=[SGE(mr_a.buf, length, mr_a.lkey)],
                send_flags=e.IBV_SEND_SIGNALED if signaled else 0)
    if rkey:
        wr.set_wr_rdma(rkey, raddr)
    qa.post_send(wr)
for i in range(3):
    send(e.IBV_WR_SEND, 100)
# 4 WRITEs of 1000 bytes (one unsignaled), 2 READs of 500.
for i in range(4):
    send(e.IBV_WR_RDMA_WRITE, 1000, mr_b.rkey, mr_b.buf, signaled=(i != 3))
for i in range(2):
    send(e.IBV_WR_RDMA_READ, 500, mr_b.rkey, mr_b.buf)
sent = poll(cq_a, 8)
got = poll(cq_b, 3)
assert all(w.status == 0 for w in sent + got), [w.status for w in sent + got]
# qb's own receive side must stay quiet from here on; qa: a WRITE with a bad rkey fails
# (remote access error), the next WR is flushed.
send(e.IBV_WR_RDMA_WRITE, 8, mr_ro.rkey, mr_ro.buf)
send(e.IBV_WR_SEND, 8)
bad = poll(cq_a, 2)
print(json.dumps({"lid": lid, "qa": qa.qp_num, "qb": qb.qp_num, "ud": ud.qp_num,
                  "mrs": [[m.lkey, m.rkey, m.length] for m in (mr_a, mr_b, mr_ro)],
                  "bad": [w.status for w in bad],
                  "sent": [(w.opcode, w.status) for w in sent]}), flush=True)
sys.stdin.readline()
"""


def stat(*args, expect_rc=0):
    argv = [os.environ["PCIENTB_STAT"], *args]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    log(f"$ {' '.join(argv)} -> {p.returncode}\n{p.stdout}{p.stderr}")
    if p.returncode != expect_rc:
        fail(f"{' '.join(argv)} exited {p.returncode}, expected {expect_rc}: {p.stderr}")
    return p.stdout


def one(rows, what, **match):
    found = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    if len(found) != 1:
        fail(f"{what}: expected one row with {match}, got {len(found)}: {rows}")
    return found[0]


def expect(row, what, **values):
    for k, v in values.items():
        if row.get(k) != v:
            fail(f"{what}: {k} = {row.get(k)!r}, expected {v!r} (row: {row})")


def test():
    if subprocess.run([PYTHON, "-c", "import pyverbs"], capture_output=True).returncode:
        print(f"[itest] SKIP: {PYTHON} cannot import pyverbs", flush=True)
        sys.exit(itest.SKIP)
    fab = itest.fabric()
    worker = subprocess.Popen([itest.launcher(), PYTHON, "-c", WORKER, DEVICE],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = worker.stdout.readline()
        if not line:
            fail(f"the pyverbs worker exited {worker.wait()} before setting up")
        made = json.loads(line)
        log(f"worker: {made}")
        # REM_ACCESS_ERR (10) then WR_FLUSH_ERR (5).
        if made["bad"] != [10, 5]:
            fail(f"the bad-rkey WRITE completed {made['bad']}, expected [10, 5]")
        node = f"{fab}/{made['lid']}"

        nodes = json.loads(stat("-f", fab, "--json"))
        n = one(nodes, "node", node=node)
        expect(n, "node", alive=True, pid=worker.pid, qps=3, mrs=3, cqs=2, srqs=1,
               comm="python3")
        text = stat("-f", fab)
        if f"node {node} fabric {fab} lid {made['lid']} pid {worker.pid}" not in text:
            fail("the text form does not start the node's line as 'node FABRIC/LID fabric ... pid'")

        qps = json.loads(stat("qp", "-f", fab, "-j"))
        qa = one(qps, "qp qa", lqpn=made["qa"])
        expect(qa, "qp qa", type="RC", state="ERR", rlid=made["lid"], rqpn=made["qb"],
               sq_depth=32, rq_depth=16, rq_used=0)
        qb = one(qps, "qp qb", lqpn=made["qb"])
        expect(qb, "qp qb", type="RC", state="RTS", srqn=0)
        ud = one(qps, "qp ud", lqpn=made["ud"])
        expect(ud, "qp ud", type="UD", state="RESET")

        mrs = json.loads(stat("mr", "-f", fab, "-j"))
        for lkey, rkey, length in made["mrs"]:
            m = one(mrs, "mr", lkey=hex(lkey))
            expect(m, "mr", rkey=hex(rkey), length=length)
        expect(one(mrs, "mr ro", lkey=hex(made["mrs"][2][0])), "mr ro", access="LW")
        expect(one(mrs, "mr a", lkey=hex(made["mrs"][0][0])), "mr a", access="LW|RW|RR")

        srqs = json.loads(stat("srq", "-f", fab, "-j"))
        expect(one(srqs, "srq", node=node), "srq", used=7, max_sge=1)
        cqs = json.loads(stat("cq", "-f", fab, "-j"))
        if sorted(c["used"] for c in cqs) != [0, 0]:
            fail(f"every completion was polled, yet the CQs show {cqs}")

        ctrs = json.loads(stat("counters", "--qp", "-f", fab, "-j"))
        c = one(ctrs, "counters qa", lqpn=made["qa"])
        # 3 SENDs of 100 B, 4 WRITEs of 1000 B (one unsignaled), 2 READs of 500 B; then the
        # failed WRITE and the flushed SEND count as errors, not as traffic.
        expect(c, "counters qa", send_ops=3, send_bytes=300, write_ops=4, write_bytes=4000,
               read_ops=2, read_bytes=1000, atomic_ops=0, tx_packets=9, tx_bytes=5300,
               rx_packets=0, errors=1, flushed=1, tx_rem_access_err=1, tx_wr_flush_err=1)
        c = one(ctrs, "counters qb", lqpn=made["qb"])
        expect(c, "counters qb", recv_ops=3, recv_bytes=300, rx_packets=3, tx_packets=0,
               errors=0)
        total = one(ctrs, "counters of the node", node=node, lqpn=None)
        expect(total, "node counters", tx_packets=9, rx_packets=3, tx_bytes=5300,
               rx_bytes=300, errors=1)
        # Watch mode: two rounds, rates on the second.
        watch = stat("counters", "-f", fab, "--watch", "0.1", "-n", "2")
        if watch.count("pcientb-stat ") != 2 or "tx_bytes/s 0.0" not in watch:
            fail("--watch -n 2 does not refresh twice with rates (idle node: 0.0/s)")
    finally:
        if worker.poll() is None:
            worker.stdin.write("\n")
            worker.stdin.flush()
        rc = worker.wait(timeout=30)
    if rc != 0:
        fail(f"the pyverbs worker exited {rc}")
    # The last node left: the fabric is gone.
    out = stat("-f", fab, expect_rc=1)
    if out.strip():
        fail(f"a fabric whose last node left still lists: {out}")
    # Bad command lines: an error and status 2.
    stat("--lid", "0", expect_rc=2)
    stat("--watch", "abc", expect_rc=2)
    stat("frobnicate", expect_rc=2)


if __name__ == "__main__":
    itest.main(test)
