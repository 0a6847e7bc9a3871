#!/usr/bin/env bash
# pcientb0 against UCX's shared-memory transport (posix), measured in the same run: put_lat,
# am_lat and put_bw at 8 B, 64 KiB and 4 MiB with ucx_perftest over posix, beside perftest
# (ib_write_lat, ib_send_lat, ib_write_bw) and ucx_perftest over rc_verbs on pcientb0,
# alternating, medians and ratios in a table, a CSV and a plot (bench/ucx_compare.py).
#
# usage: scripts/ucx-compare.sh [OUTPUT_DIR] [--reps N] [--quick]
#   OUTPUT_DIR defaults to ./results/ucx; --reps N repetitions (default 5); --quick: a short
#   smoke run. Finds pcientb-run in $PCIENTB_RUN, the build tree (build/) or $PATH.
set -euo pipefail

case "${1:-}" in
  -h | --help) sed -n '2,9p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
esac
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# Debian's python3-matplotlib lives with /usr/bin/python3; without it there is no plot.
python=$(command -v python3 || echo /usr/bin/python3)
/usr/bin/python3 -c 'import matplotlib' 2>/dev/null && python=/usr/bin/python3
exec "$python" "$repo/bench/ucx_compare.py" "$@"
