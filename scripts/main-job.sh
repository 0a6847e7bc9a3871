#!/usr/bin/env bash
# The main job: runs a two-node emulated fabric and prints a table of RDMA WRITE, READ and SEND
# bandwidth and latency from 1 B to 4 MiB beside the memcpy and shared-memory ping-pong
# references measured in the same run, then plots bandwidth against size. Then the socket
# layer beside kernel TCP loopback (scripts/sdp-bench.sh: stream sweep, latency, BCopy/ZCopy).
#
# usage: scripts/main-job.sh [OUTPUT_DIR] [pcientb-perf options...]
#   OUTPUT_DIR defaults to ./results; it receives perf.csv, table.txt and bandwidth.png, and
#   sdp/ (sdp-bench.md, .json, plots). Options after it go to pcientb-perf (see
#   pcientb-perf --help), e.g. --seconds 1. PCIENTB_MAIN_JOB_SDP=0 skips the socket part.
# Finds pcientb-perf in $PCIENTB_PERF, the build tree (build/, build-asan/) or $PATH.
set -euo pipefail

case "${1:-}" in
  -h | --help) sed -n '2,12p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
  "" | -*) out=./results ;;
  *) out=$1; shift ;;
esac
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$here")

find_perf() {
  local c
  for c in "${PCIENTB_PERF:-}" "$repo/build/bin/pcientb-perf" \
    "$repo/build-asan/bin/pcientb-perf"; do
    [ -n "$c" ] && [ -x "$c" ] && { echo "$c"; return; }
  done
  command -v pcientb-perf || true
}

perf=$(find_perf)
if [ -z "$perf" ]; then
  echo "main-job: pcientb-perf not found; build it first:" >&2
  echo "  cmake --preset default && cmake --build build" >&2
  exit 1
fi

plot=""
for c in "$repo/bench/plot.py" "$(dirname "$perf")/../share/pcientb/plot.py"; do
  [ -f "$c" ] && { plot=$c; break; }
done

# Debian's python3-matplotlib lives with /usr/bin/python3; another python3 may come first.
python=""
for c in /usr/bin/python3 "$(command -v python3 || true)"; do
  [ -n "$c" ] && [ -x "$c" ] && "$c" -c 'import matplotlib' 2>/dev/null && { python=$c; break; }
done

mkdir -p "$out"
echo "main-job: $perf -> $out" >&2
rm -f "$out/perf.csv"
set +e
"$perf" --csv "$out/perf.csv" "$@" | tee "$out/table.txt"
status=${PIPESTATUS[0]}
set -e
# A failed point leaves NaN in its row; the rest is still worth a plot.
[ -f "$out/perf.csv" ] || exit "$status"

if [ -z "$plot" ] || [ -z "$python" ]; then
  echo "main-job: no plot: needs bench/plot.py and a python3 with matplotlib" \
    "(apt-get install python3-matplotlib)" >&2
  exit 1
fi
"$python" "$plot" "$out/perf.csv" "$out/bandwidth.png" || status=1

if [ "${PCIENTB_MAIN_JOB_SDP:-1}" != 0 ]; then
  echo "main-job: the SDP socket layer beside kernel TCP -> $out/sdp" >&2
  "$here/sdp-bench.sh" "$out/sdp" || status=1
fi
exit "$status"
