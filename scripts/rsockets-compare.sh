#!/usr/bin/env bash
# rsockets over pcientb0 (rdma_cm from librdmacm_glue) beside kernel TCP loopback, with one tool
# (rstream, rdmacm-utils) in the same run: latency and bandwidth, 64 B .. 1 MiB, alternating
# repetitions, medians and ratios (bench/rsockets_compare.py).
#
# usage: scripts/rsockets-compare.sh [OUTPUT_DIR] [--reps N]
#   OUTPUT_DIR defaults to ./results/rsockets; --reps N repetitions (default 3).
set -euo pipefail
case "${1:-}" in
  -h | --help) sed -n '2,7p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
esac
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
exec python3 "$repo/bench/rsockets_compare.py" "$@"
