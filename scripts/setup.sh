#!/usr/bin/env bash
# scripts/setup.sh: set up a Debian 12 machine for pcientb and run the main job.
#
#   scripts/setup.sh                 install dependencies (apt), build (preset
#                                    "default"), install (cmake --install build:
#                                    provider, preload, pcientb-run under /usr and
#                                    /etc), then run the main job (scripts/main-job.sh)
#   scripts/setup.sh --deps-only     install dependencies only
#   scripts/setup.sh --check-deps    exit 0 if every dependency is installed
#   scripts/setup.sh --no-main-job   everything but the main job
#   scripts/setup.sh --deb           dependencies, build, then the Debian package
#                                    build/deb/pcientb_<version>_<arch>.deb
#                                    (scripts/package.sh; prints its path); no
#                                    install: apt install ./pcientb_*.deb
#
# Needs root (or sudo) for apt-get and the install step. Non-interactive.

set -euo pipefail

# Every Debian package the project builds, tests or benchmarks with (gdb: tests print the
# stacks of a process that hangs).
PACKAGES=(
  build-essential g++ cmake ninja-build pkg-config binutils git python3
  libibverbs-dev ibverbs-utils ibverbs-providers rdma-core
  perftest qperf python3-pyverbs python3-matplotlib
  ucx-utils openmpi-bin mpich netpipe-openmpi netpipe-mpich2 hpcc python3-mpi4py
  librdmacm-dev rdmacm-utils libfabric-bin
  iperf3 sockperf curl netcat-openbsd redis-server redis-tools
  nginx memcached libmemcached-tools apache2-utils
  googletest libgtest-dev libgmock-dev libbenchmark-dev
  clang-format clang-tidy shellcheck clang libclang-rt-14-dev
  dpkg-dev file fakeroot gdb
  libcli11-dev libfmt-dev groff-base
  linux-headers-amd64 linux-image-amd64 qemu-system-x86 busybox-static cpio kmod dkms
)

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
say() { echo "setup: $*"; }

as_root() {
  if [[ $EUID -eq 0 ]]; then
    "$@"
  elif command -v sudo >/dev/null 2>&1; then
    sudo -n "$@" || { echo "setup: '$*' needs root (sudo failed)" >&2; exit 1; }
  else
    echo "setup: '$*' needs root; run as root or install sudo" >&2
    exit 1
  fi
}

missing_packages() {
  local p
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q '^install ok installed$' ||
      echo "$p"
  done
}

install_deps() {
  local missing
  mapfile -t missing < <(missing_packages)
  if [[ ${#missing[@]} -eq 0 ]]; then
    say "all ${#PACKAGES[@]} dependencies are installed"
    return 0
  fi
  say "installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  as_root apt-get update -q
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
    -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold "${missing[@]}"
  mapfile -t missing < <(missing_packages)
  if [[ ${#missing[@]} -ne 0 ]]; then
    echo "setup: still missing after apt-get install: ${missing[*]}" >&2
    exit 1
  fi
}

build() {
  cd "$root"
  say "configuring and building (preset default, build/)"
  cmake --preset default
  cmake --build --preset default
}

build_and_install() {
  build
  say "installing (cmake --install build)"
  as_root cmake --install build
  if command -v ldconfig >/dev/null 2>&1; then as_root ldconfig || true; fi
}

build_package() {
  build
  say "building the Debian package (scripts/package.sh build build/deb)"
  "$root/scripts/package.sh" "$root/build" "$root/build/deb"
}

run_main_job() {
  cd "$root"
  if [[ -x scripts/main-job.sh || -f scripts/main-job.sh ]]; then
    say "running the main job (scripts/main-job.sh)"
    bash scripts/main-job.sh
  else
    say "note: scripts/main-job.sh does not exist yet; no main job to run."
    say "      pcientb is installed: try 'pcientb-run ibv_devinfo -v'."
  fi
}

mode="all"
case "${1:-}" in
  "") ;;
  --deps-only) mode="deps" ;;
  --check-deps) mode="check" ;;
  --no-main-job) mode="nomain" ;;
  --deb) mode="deb" ;;
  -h | --help) sed -n '2,17p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "setup: unknown option '$1' (see --help)" >&2; exit 2 ;;
esac

case "$mode" in
  check)
    mapfile -t missing < <(missing_packages)
    [[ ${#missing[@]} -eq 0 ]] || { echo "setup: missing: ${missing[*]}"; exit 1; }
    ;;
  deps) install_deps ;;
  nomain) install_deps; build_and_install ;;
  deb) install_deps; build_package ;;
  all) install_deps; build_and_install; run_main_job ;;
esac
