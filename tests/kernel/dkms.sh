#!/usr/bin/env bash
# tests/kernel/dkms.sh SRC_DIR VERSION: kernel/dkms.conf names VERSION (the project's) and DKMS
# builds pcientb.ko from SRC_DIR for the newest kernel with a build directory, in trees of
# its own (nothing is added to the system's DKMS tree). CTest: kernel.dkms. Exit 77
# (skipped) without dkms or kernel headers.
set -uo pipefail
src=$1 version=$2
if ! command -v dkms >/dev/null 2>&1; then
  echo "kernel.dkms: no dkms (apt-get install dkms); skipped"
  exit 77
fi
build_dir="$(compgen -G "/lib/modules/*/build" | sort -V | tail -1)"
[[ -n "$build_dir" ]] || { echo "kernel.dkms: no kernel headers; skipped"; exit 77; }
kver="$(basename "$(dirname "$build_dir")")"
grep -qx "PACKAGE_VERSION=\"$version\"" "$src/dkms.conf" ||
  { echo "kernel.dkms: dkms.conf does not name version $version"; exit 1; }
t="$(mktemp -d)"
trap 'rm -rf "$t"' EXIT
mkdir -p "$t/src/pcientb-$version" "$t/tree"
cp -r "$src"/dkms.conf "$src"/Kbuild "$src"/Makefile "$src"/*.c "$src"/*.h "$src"/uapi "$t/src/pcientb-$version/"
dkms=(dkms --sourcetree "$t/src" --dkmstree "$t/tree")
"${dkms[@]}" add -m pcientb -v "$version" || exit 1
"${dkms[@]}" build -m pcientb -v "$version" -k "$kver" || {
  cat "$t/tree/pcientb/$version/build/make.log" 2>/dev/null
  exit 1
}
log="$t/tree/pcientb/$version/build/make.log"
if [[ -f "$log" ]] && grep -qiE "warning:|error:" "$log"; then
  cat "$log"
  echo "kernel.dkms: the DKMS build printed warnings"
  exit 1
fi
ko="$t/tree/pcientb/$version/$kver/$(uname -m)/module/pcientb.ko"
[[ -f "$ko" ]] || { echo "kernel.dkms: DKMS built no $ko"; exit 1; }
echo "kernel.dkms: DKMS built pcientb $version for $kver"
