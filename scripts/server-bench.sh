#!/usr/bin/env bash
# Real servers under pcientb-sdp beside kernel TCP loopback, in the same run (issue 12):
# redis-server + redis-benchmark (-P 1, -P 16, 50 clients), memcached + memcaslap, nginx + ab
# (keep-alive 4 KiB and 1 MiB, and a connection per request); alternating repetitions,
# medians, SDP/TCP ratios against the targets, markdown and JSON (bench/server_bench.py).
#
# usage: scripts/server-bench.sh [OUTPUT_DIR] [--reps N] [--only redis,memcached,nginx]
#                                [--quick] [--launcher PATH]
#   OUTPUT_DIR defaults to ./results/servers; --quick: a smoke run (about a minute). Finds
#   build/bin/pcientb-sdp (or pcientb-sdp on $PATH). The full run takes about 5 minutes.
set -euo pipefail

case "${1:-}" in
  -h | --help) sed -n '2,10p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
esac
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
exec python3 "$repo/bench/server_bench.py" "$@"
