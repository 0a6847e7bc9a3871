#!/usr/bin/env bash
# The SDP layer (pcientb-sdp) beside kernel TCP loopback, one tool (sockbench) in the same run:
# stream throughput over the PCIe socket paper's Table 3 write sizes (1 B .. 4 MiB), ping-pong
# latency 1 B .. 64 KiB beside the shared-memory ping-pong, and BCopy against ZCopy for 1, 2, 4,
# 8 connections (4 KiB .. 4 MiB) beside memcpy; alternating repetitions, medians, ratios,
# targets, JSON, markdown and plots (bench/sdp_bench.py, bench/plot.py).
#
# usage: scripts/sdp-bench.sh [OUTPUT_DIR] [--quick] [--reps N] [--seconds S] [--only PHASES]
#                             [--launcher PATH] [--sockbench PATH] [--no-sdp]
#   OUTPUT_DIR defaults to ./results/sdp; --quick: a smoke run (under a minute); --no-sdp: both
#   legs on kernel TCP (tests the driver without the layer). Finds build/bin/sockbench and
#   build/bin/pcientb-sdp (or $SOCKBENCH, $PCIENTB_SDP_LAUNCHER, $PATH). The full run takes
#   about 10 minutes; bench/sdp_bench.py --help has the details.
set -euo pipefail

case "${1:-}" in
  -h | --help) sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
esac
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# Debian's python3-matplotlib lives with /usr/bin/python3; without it there is no plot.
python=$(command -v python3 || echo /usr/bin/python3)
/usr/bin/python3 -c 'import matplotlib' 2>/dev/null && python=/usr/bin/python3
exec "$python" "$repo/bench/sdp_bench.py" "$@"
