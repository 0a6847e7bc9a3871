#!/usr/bin/env python3
"""Integration test: one module of rdma-core's pyverbs test suite on pcientb0.

  pyverbs_suite.py MODULE          e.g. pyverbs_suite.py qp   (tests.test_qp)

The suite ships with python3-pyverbs in /usr/share/doc/rdma-core/tests, partly
gzip-compressed (Debian compresses docs). It is copied to a temporary
directory, uncompressed, and run with the Python that has pyverbs (Debian's
/usr/bin/python3, or $PCIENTB_PYVERBS_PYTHON) under pcientb-run:

  run_tests.py --dev pcientb0 -v tests.test_MODULE

Every test must pass or skip for a reason in HONEST_SKIPS: a feature pcientb
does not offer, reported as the suite expects (EOPNOTSUPP, or a capability of
0). Any other skip hides a failure (e.g. an RC or UD QP "not supported") and
fails this test, like a failure or an error does.

The suite draws QP attributes at random (tests/utils.py random_qp_init_attr_ex);
the generator is seeded (PCIENTB_PYVERBS_SEED, default 1) so that a run is
reproducible.
"""

import gzip
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter

import itest
from itest import DEVICE, fail, log

SUITE = os.environ.get("PCIENTB_PYVERBS_SUITE", "/usr/share/doc/rdma-core/tests")
PYTHON = os.environ.get("PCIENTB_PYVERBS_PYTHON", "/usr/bin/python3")
SEED = os.environ.get("PCIENTB_PYVERBS_SEED", "1")

# Skip reasons that are honest on pcientb0, with why.
HONEST_SKIPS = [
    (r"^Device memory is not supported$", "no device memory: max_dm_size = 0"),
    (r"^Allocating dmabuf is not supported by ", "no GPU/DRM device on this machine"),
    (r"^Reg MR with MW access is not supported$", "no memory windows: EOPNOTSUPP"),
    (r"^Create memory window of type \d is not supported$", "no memory windows: EOPNOTSUPP"),
    (r"^Create custom mr with additional access flags \d+ is not supported$",
     "MW_BIND access (memory windows): EOPNOTSUPP"),
    (r"^Create XRCD is not supported$", "no XRC: EOPNOTSUPP"),
    (r"^Create UC QP (with|without)( extended)? attrs is not supported$",
     "no UC: ibv_create_qp(UC) fails with EOPNOTSUPP"),
    (r"^To Create RAW QP must be done by root on Ethernet link layer$",
     "link layer is InfiniBand"),
    (r"^Link layer of port=\d+ is InfiniBand , skip RoCE test$", "link layer is InfiniBand"),
    (r"^All gid indices populated, cannot check bad flow$", "gid_tbl_len = 1, GID 0 is set"),
    (r"^Extended QP is not supported on this device$",
     "send op not offered (e.g. IBV_QP_EX_WITH_ATOMIC_WRITE): EOPNOTSUPP"),
]

# unittest -v: "test_x (tests.test_m.Class.test_x) ... ok", or, when the test
# has a docstring, its first line follows on the next line and ends with the
# " ... result".
TEST_RE = re.compile(r"^(test\w*) \(([\w.]+)\)")
RES_RE = re.compile(r" \.\.\. (ok|FAIL|ERROR|skipped '(.*)'|expected failure|unexpected success)$")


def parse_results(out):
    results = []
    current = None
    for line in out.splitlines():
        m = TEST_RE.match(line)
        if m:
            current = m.group(2)
        r = RES_RE.search(line)
        if r and current:
            res = r.group(1)
            results.append((current, "skipped" if r.group(2) is not None else res, r.group(2)))
            current = None
    return results


# run_tests.py with the random generator seeded; as `python3 run_tests.py` would,
# with the suite's directory first on sys.path.
RUNNER = r"""
import os, random, runpy, sys
script = os.path.abspath("run_tests.py")
sys.path.insert(0, os.path.dirname(script))
random.seed(int(sys.argv[1]))
sys.argv = [script] + sys.argv[2:]
runpy.run_path(script, run_name="__main__")
"""


def prepare_suite(dst):
    if not os.path.isdir(SUITE):
        print(f"[itest] SKIP: {SUITE} not found (apt-get install python3-pyverbs)", flush=True)
        sys.exit(itest.SKIP)
    shutil.copytree(SUITE, dst)
    for fn in os.listdir(dst):
        if fn.endswith(".py.gz"):
            path = os.path.join(dst, fn)
            with gzip.open(path, "rb") as src, open(path[:-3], "wb") as out:
                shutil.copyfileobj(src, out)
            os.unlink(path)


def main():
    if len(sys.argv) != 2:
        print(__doc__)
        sys.exit(2)
    module = sys.argv[1]
    if subprocess.run([PYTHON, "-c", "import pyverbs"], capture_output=True).returncode:
        print(f"[itest] SKIP: {PYTHON} cannot import pyverbs (apt-get install python3-pyverbs)",
              flush=True)
        sys.exit(itest.SKIP)

    def run():
        with tempfile.TemporaryDirectory(prefix="pcientb-pyverbs-") as tmp:
            suite = os.path.join(tmp, "tests")
            prepare_suite(suite)
            if not os.path.exists(os.path.join(suite, f"test_{module}.py")):
                fail(f"no module test_{module} in {SUITE}")
            p = itest.Proc(f"pyverbs-{module}",
                           [PYTHON, "-c", RUNNER, SEED, "--dev", DEVICE, "-v",
                            f"tests.test_{module}"],
                           cwd=suite, env={"PYTHONDONTWRITEBYTECODE": "1"})
            p.wait()
            out = p.output()
        p.dump()
        results = parse_results(out)
        if not results:
            fail(f"no test results parsed: {p.status()}")
        counts = Counter()
        bad = []
        for tid, res, why in results:
            if res == "ok":
                counts["pass"] += 1
            elif why is not None:
                honest = next((r for pat, r in HONEST_SKIPS if re.search(pat, why)), None)
                if honest:
                    counts["skip"] += 1
                    log(f"skip {tid}: {why} -- honest: {honest}")
                else:
                    counts["dishonest skip"] += 1
                    bad.append(f"{tid}: skipped '{why}', which pcientb does support")
            else:
                counts[res.lower()] += 1
                bad.append(f"{tid}: {res}")
        log(f"tests.test_{module}: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
        m = re.search(r"^Ran (\d+) tests? in", out, re.MULTILINE)
        if not m or int(m.group(1)) != len(results):
            fail(f"parsed {len(results)} results but the suite says: "
                 f"{m.group(0) if m else 'nothing'} ({p.status()})")
        if bad or p.rc != 0:
            fail(f"tests.test_{module} ({p.status()}):\n  " + "\n  ".join(bad))

    itest.main(run)


if __name__ == "__main__":
    main()
