#!/usr/bin/env bash
# MPI benchmark: NetPIPE (NPopenmpi, Open MPI over UCX) latency and bandwidth from 1 B to 4 MiB,
# over pcientb0 and, in the same run, over UCX shared memory and over TCP loopback; then a
# table, a CSV and a plot of the three with the ratios pcientb/sm and pcientb/tcp, and a summary
# against the targets (8-byte latency <= 1.2x shared memory; bandwidth >= 1.0x shared memory at
# every size >= 64 KiB).
#
# usage: scripts/mpi-bench.sh [OUTPUT_DIR] [--runs N]
#   OUTPUT_DIR defaults to ./results/mpi; it receives np-<path>.<run>.out (NetPIPE's own
#   output), np-<path>.<run>.log (the job's output, with UCX's ep_cfg lines), pcientb-stats.txt,
#   mpi-bench.csv, table.txt and mpi-bench.png.
#   --runs N: run the three sweeps N times, alternating, and keep each size's best (default 1).
# Finds pcientb-mpirun in $PCIENTB_MPIRUN, the build tree (build/) or $PATH.
set -euo pipefail

usage() { sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

out=./results/mpi
runs=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --runs) [[ $# -ge 2 && "$2" =~ ^[1-9][0-9]*$ ]] || { usage >&2; exit 2; }; runs=$2; shift 2 ;;
    -*) echo "mpi-bench: unknown option '$1'" >&2; usage >&2; exit 2 ;;
    *) out=$1; shift ;;
  esac
done

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$here")

mpirun_pcientb=""
for c in "${PCIENTB_MPIRUN:-}" "$repo/build/bin/pcientb-mpirun" "$(command -v pcientb-mpirun || true)"; do
  [[ -n "$c" && -x "$c" ]] && { mpirun_pcientb=$c; break; }
done
[[ -n "$mpirun_pcientb" ]] || {
  echo "mpi-bench: pcientb-mpirun not found; build it (cmake --preset default &&" \
    "cmake --build build) or set PCIENTB_MPIRUN" >&2
  exit 1
}
for tool in mpirun.openmpi NPopenmpi; do
  command -v "$tool" >/dev/null || {
    echo "mpi-bench: $tool not found (apt-get install openmpi-bin netpipe-openmpi)" >&2
    exit 1
  }
done
python=""
for c in /usr/bin/python3 "$(command -v python3 || true)"; do
  [[ -n "$c" && -x "$c" ]] && "$c" -c 'import matplotlib' 2>/dev/null && { python=$c; break; }
done
[[ -n "$python" ]] || { echo "mpi-bench: needs python3 with matplotlib (apt-get install python3-matplotlib)" >&2; exit 1; }

mkdir -p "$out"
out=$(cd "$out" && pwd)
rm -f "$out"/np-*.out "$out"/np-*.log "$out/pcientb-stats.txt"
# NetPIPE: 1 B .. 4 MiB, no perturbed sizes (powers of 2 and 1.5x); it calibrates the
# repeats of each size itself.
np_args=(NPopenmpi -u 4194304 -p 0)
if [[ $EUID -eq 0 ]]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
# UCX names the transports of every endpoint (ep_cfg lines in the .log files).
export UCX_LOG_LEVEL=info

run_one() { # path run
  local path=$1 run=$2 log="$out/np-$1.$2.log" o="$out/np-$1.$2.out"
  echo "mpi-bench: [$run/$runs] NetPIPE over $path" >&2
  case "$path" in
    pcientb)
      PCIENTB_STATS="$out/pcientb-stats.txt" \
        "$mpirun_pcientb" --fabric "mpibench$$" -v -n 2 "${np_args[@]}" -o "$o" >"$log" 2>&1 ;;
    # Open MPI's pml ucx declines when none of its preferred transports (pml_ucx_tls:
    # rc_verbs, ud_verbs, mlx5...) is allowed; "any" lets it run on sm and tcp.
    sm)
      mpirun.openmpi -np 2 --mca pml ucx --mca pml_ucx_tls any --mca pml_ucx_devices any \
        -x UCX_TLS=sm,self -x UCX_LOG_LEVEL "${np_args[@]}" -o "$o" >"$log" 2>&1 ;;
    tcp)
      mpirun.openmpi -np 2 --mca pml ucx --mca pml_ucx_tls any --mca pml_ucx_devices any \
        -x UCX_TLS=tcp -x UCX_NET_DEVICES=lo -x UCX_LOG_LEVEL "${np_args[@]}" -o "$o" \
        >"$log" 2>&1 ;;
  esac || {
    echo "mpi-bench: NetPIPE over $path failed; its output ($log):" >&2
    tail -30 "$log" >&2
    exit 1
  }
  grep -h 'ep_cfg' "$log" | sed 's/.*\(ep_cfg.*\)/\1/' | sort -u | sed "s/^/mpi-bench:   $path: /" >&2
}

for ((run = 1; run <= runs; run++)); do
  for path in pcientb sm tcp; do
    run_one "$path" "$run"
  done
done

"$python" "$repo/bench/mpi_bench.py" "$out" | tee "$out/table.txt"
