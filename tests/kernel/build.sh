#!/usr/bin/env bash
# tests/kernel/build.sh SRC_DIR OUT_DIR: builds pcientb.ko from SRC_DIR (kernel/) in OUT_DIR
# (kbuild writes next to the sources, so they are copied there first) with W=1, and fails
# on any warning. CTest: kernel.build (the fixture of the guest tests). Exit 77 (skipped)
# without a kernel build directory (linux-headers-amd64).
set -uo pipefail
src=$1 out=$2
if ! compgen -G "/lib/modules/*/build" >/dev/null; then
  echo "kernel.build: no /lib/modules/*/build (apt-get install linux-headers-amd64); skipped"
  exit 77
fi
mkdir -p "$out"
cp -r "$src"/Makefile "$src"/Kbuild "$src"/*.c "$src"/*.h "$src"/uapi "$out"/ || exit 1
log="$(make -C "$out" 2>&1)"
rc=$?
echo "$log"
if [[ $rc -ne 0 ]]; then
  echo "kernel.build: make failed (exit $rc)"
  exit 1
fi
if grep -qiE "warning:|error:" <<<"$log"; then
  echo "kernel.build: the build printed warnings (W=1 must be clean)"
  exit 1
fi
[[ -f "$out/pcientb.ko" ]] || { echo "kernel.build: no pcientb.ko"; exit 1; }
echo "kernel.build: $out/pcientb.ko, no warnings"
