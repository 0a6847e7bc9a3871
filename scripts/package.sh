#!/usr/bin/env bash
# scripts/package.sh: the Debian package pcientb_<version>_<arch>.deb (CPack's DEB
# generator, cmake/Packaging.cmake).
#
#   scripts/package.sh [BUILD_DIR [OUT_DIR]]
#       package a configured and built tree (default build/) into OUT_DIR (default
#       BUILD_DIR/deb), replacing any pcientb_*.deb there; the last line printed is
#       the path of the package. scripts/setup.sh --deb builds, then calls this.
#   scripts/package.sh --check DEB
#       check a package: contents, control fields, conffiles, installed paths in the
#       launchers; then install, remove and purge it in a private dpkg root (dpkg
#       --root) and check what is left after each step. The system is not touched.
#   scripts/package.sh --test BUILD_DIR
#       both, in a temporary directory of its own, and check that --check rejects the
#       package with its provider taken out (the CTest test package.deb).
#
# Exit status 0 if all is well, 1 if not, 77 if the check cannot run here (no dpkg;
# not root and no fakeroot). $CPACK names the cpack to use.

set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
say() { echo "package: $*" >&2; }
die() { echo "package: $*" >&2; exit 1; }

# --- Build ---------------------------------------------------------------------
# build_deb BUILD_DIR OUT_DIR: prints the path of the new package.
build_deb() {
  local build=$1 out=$2 stage deb
  [[ -f "$build/CPackConfig.cmake" ]] ||
    die "$build has no CPackConfig.cmake: configure it first (cmake --preset default), with CMAKE_INSTALL_PREFIX=/usr"
  command -v "${CPACK:-cpack}" >/dev/null 2>&1 || die "cpack not found (CMake)"
  if grep -qE '^PCIENTB_SANITIZE:[A-Z]+=.+' "$build/CMakeCache.txt" 2>/dev/null; then
    say "note: $build is a sanitizer build (PCIENTB_SANITIZE): its package is for testing"
  fi
  mkdir -p "$out" || die "cannot create $out"
  out="$(cd "$out" && pwd)"
  # cpack stages under its -B directory: a fresh one per run, so runs never collide.
  stage="$(mktemp -d "$out/.cpack.XXXXXX")" || die "cannot create a directory in $out"
  if ! "${CPACK:-cpack}" --config "$build/CPackConfig.cmake" -G DEB -B "$stage" >&2; then
    rm -rf "$stage"; die "cpack failed"
  fi
  deb="$(find "$stage" -maxdepth 1 -name 'pcientb_*.deb' -print -quit)"
  [[ -n "$deb" ]] || { rm -rf "$stage"; die "cpack made no pcientb_*.deb"; }
  find "$out" -maxdepth 1 -name 'pcientb_*.deb' -delete
  mv "$deb" "$out/" || { rm -rf "$stage"; die "cannot move the package to $out"; }
  rm -rf "$stage"
  echo "$out/$(basename "$deb")"
}

# --- Check ---------------------------------------------------------------------
errors=0
bad() { echo "package: FAIL: $*" >&2; errors=$((errors + 1)); }

# Regular files and symlinks of the package, as ./path.
deb_files() { dpkg-deb --fsys-tarfile "$1" | tar -t | grep -v '/$'; }

# check_contents DEB: what the package holds, its control fields and conffiles.
check_contents() {
  local deb=$1 ma arch files f want page n sec ctl
  arch="$(dpkg --print-architecture)"
  ma="$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || gcc -print-multiarch 2>/dev/null)"
  [[ -n "$ma" ]] || { bad "cannot tell the multiarch triplet (dpkg-architecture, gcc)"; return; }
  files="$(deb_files "$deb")" || { bad "$deb: dpkg-deb cannot read it"; return; }

  has() { grep -qxE "$1" <<<"$files"; }
  has "\./usr/lib/$ma/libibverbs/libpcientb-rdmav[0-9]+\.so" ||
    bad "no provider ./usr/lib/$ma/libibverbs/libpcientb-rdmav<N>.so (where libibverbs loads providers)"
  for want in ./etc/libibverbs.d/pcientb.driver \
    "./usr/lib/$ma/libpcientb-preload.so" "./usr/lib/$ma/libpcientb-sdp.so" ./etc/pcientb/sdp.conf \
    "./usr/lib/$ma/libpcientb-rscompat.so" \
    ./usr/bin/pcientb-run ./usr/bin/pcientb-mpirun ./usr/bin/pcientb-sdp \
    ./usr/bin/pcientb-perf ./usr/bin/sockbench ./usr/share/pcientb/plot.py; do
    grep -qxF "$want" <<<"$files" || bad "missing $want"
  done
  # Every manual page of man/ (if present), installed as manN/<page> or <page>.gz.
  for page in "$root"/man/*.[1-9]; do
    [[ -f "$page" ]] || continue
    n="$(basename "$page")"; sec="${n##*.}"
    has "\./usr/share/man/man$sec/${n//./\\.}(\.gz)?" || bad "missing man page ./usr/share/man/man$sec/$n"
  done
  # Only /usr and /etc, nothing of the tests or the benchmarks' build-only artifacts.
  while IFS= read -r f; do
    case "$f" in
      ./usr/local/*) bad "file under /usr/local: $f" ;;
      ./usr/* | ./etc/*) ;;
      *) bad "file outside /usr and /etc: $f" ;;
    esac
    case "${f##*/}" in
      *_test | *_smoke | *micro_bench* | stress_repro_* | *.a | *.o | \
        *gtest* | *gmock* | CTestTestfile.cmake | *.cmake)
        bad "test or build-only file: $f" ;;
    esac
  done <<<"$files"

  # Control fields. Depends comes from dpkg-shlibdeps (libc6, libibverbs1) plus
  # ibverbs-providers.
  ctl="$(dpkg-deb -f "$deb")" || { bad "$deb: no control file"; return; }
  [[ "$(dpkg-deb -f "$deb" Package)" == pcientb ]] || bad "Package is not pcientb"
  [[ "$(dpkg-deb -f "$deb" Architecture)" == "$arch" ]] || bad "Architecture is not $arch"
  for want in libc6 libibverbs1 ibverbs-providers; do
    grep -qE "^Depends:.*(^|[ ,])$want( |,|$)" <<<"$ctl" || bad "Depends lacks $want"
  done
  for want in Version Maintainer Section Description; do
    [[ -n "$(dpkg-deb -f "$deb" "$want")" ]] || bad "no $want field"
  done

  # Every file under /etc is a conffile, and every conffile is in the package.
  local ctrl="$work/control.$$"
  rm -rf "$ctrl"; dpkg-deb -e "$deb" "$ctrl" || { bad "cannot extract the control area"; return; }
  touch "$ctrl/conffiles"
  while IFS= read -r f; do
    [[ "$f" == ./etc/* ]] || continue
    grep -qxF "${f#.}" "$ctrl/conffiles" || bad "${f#.} is not a conffile"
  done <<<"$files"
  while IFS= read -r f; do
    [[ -z "$f" ]] || grep -qxF ".$f" <<<"$files" || bad "conffile $f is not in the package"
  done <"$ctrl/conffiles"
  for f in preinst prerm; do
    [[ ! -e "$ctrl/$f" ]] || bad "unexpected maintainer script $f"
  done
  rm -rf "$ctrl"

  # The launchers carry the installed paths, not the build tree's.
  local x="$work/data.$$"
  rm -rf "$x"
  if ! { mkdir -p "$x" && dpkg-deb -x "$deb" "$x"; }; then bad "cannot extract the package"; return; fi
  grep -q "/usr/lib/$ma/libpcientb-preload.so" "$x/usr/bin/pcientb-run" 2>/dev/null ||
    bad "pcientb-run does not preload /usr/lib/$ma/libpcientb-preload.so"
  grep -q "/usr/lib/$ma/libpcientb-sdp.so" "$x/usr/bin/pcientb-sdp" 2>/dev/null ||
    bad "pcientb-sdp does not use /usr/lib/$ma/libpcientb-sdp.so"
  grep -q "/usr/bin/pcientb-run" "$x/usr/bin/pcientb-mpirun" 2>/dev/null ||
    bad "pcientb-mpirun does not run /usr/bin/pcientb-run"
  if grep -rlI -e '/_CPack_Packages/' -e 'CMakeFiles' "$x" >/dev/null 2>&1; then
    bad "build-tree paths in: $(grep -rlI -e '/_CPack_Packages/' -e 'CMakeFiles' "$x" | sed "s|^$x||" | tr '\n' ' ')"
  fi
  if command -v readelf >/dev/null 2>&1 && [[ -f "$x/usr/lib/$ma/libpcientb-preload.so" ]]; then
    readelf -d "$x/usr/lib/$ma/libpcientb-preload.so" | grep -qF "[/usr/lib/$ma/libibverbs]" ||
      bad "libpcientb-preload.so's RUNPATH is not /usr/lib/$ma/libibverbs (it finds the provider there)"
  fi
  rm -rf "$x"
}

# Everything under the private root but dpkg's own database and log.
tree_of() { (cd "$1" && find . -path ./var/lib/dpkg -prune -o -print | LC_ALL=C sort); }

# check_install DEB: install, remove and purge in a private dpkg root.
check_install() {
  local deb=$1 r="$work/root" before status f conffiles listed
  local -a dpkg_r
  if ! { mkdir -p "$r/var/lib/dpkg/info" "$r/var/lib/dpkg/updates" "$r/var/lib/dpkg/triggers" &&
    : >"$r/var/lib/dpkg/status" && : >"$r/var/lib/dpkg/available"; }; then
    bad "cannot create the private dpkg root $r"; return
  fi
  before="$(tree_of "$r")"
  # Maintainer scripts (the package's do nothing) run without chroot: the private
  # root has no shell. Dependencies are not installed there. dpkg wants ldconfig on
  # the PATH (it never runs it here: triggers have no one to run them in this root).
  dpkg_r=(dpkg --root="$r" --log="$work/dpkg.log" --force-script-chrootless --force-depends
          --force-unsafe-io)
  [[ $EUID -eq 0 ]] || dpkg_r=(fakeroot "${dpkg_r[@]}")
  export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"

  say "install into the private root $r"
  "${dpkg_r[@]}" -i "$deb" >&2 || { bad "dpkg -i failed"; return; }
  status="$("${dpkg_r[@]}" -s pcientb 2>/dev/null | sed -n 's/^Status: //p')"
  [[ "$status" == "install ok installed" ]] || bad "after dpkg -i: status '$status'"
  # The files are as the package's md5sums say.
  "${dpkg_r[@]}" --verify pcientb >&2 || bad "dpkg --verify: files differ from the package's md5sums"
  listed="$("${dpkg_r[@]}" -L pcientb)"
  while IFS= read -r f; do
    f="${f#.}"
    [[ -e "$r$f" || -L "$r$f" ]] || bad "not installed: $f"
    grep -qxF "$f" <<<"$listed" || bad "dpkg -L does not list $f"
  done < <(deb_files "$deb")

  # The installed provider and preload load and list pcientb0 (a quick look, with the
  # private root's libraries; skipped without ibv_devices).
  local ma
  ma="$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || gcc -print-multiarch 2>/dev/null)"
  if command -v ibv_devices >/dev/null 2>&1 && [[ -n "$ma" ]]; then
    if ! PCIENTB_PRELOAD="$r/usr/lib/$ma/libpcientb-preload.so" \
      LD_LIBRARY_PATH="$r/usr/lib/$ma/libibverbs:$r/usr/lib/$ma" PCIENTB_FABRIC="pkgtest_$$" \
      timeout 30 "$r/usr/bin/pcientb-run" ibv_devices 2>&1 | grep -q pcientb0; then
      bad "the installed pcientb-run ibv_devices does not list pcientb0"
    fi
  fi

  # An edited conffile survives remove; purge takes it (and everything else).
  conffiles="$(cat "$r/var/lib/dpkg/info/pcientb.conffiles" 2>/dev/null)"
  echo "# edited after install" >>"$r/etc/pcientb/sdp.conf"
  say "remove"
  "${dpkg_r[@]}" -r pcientb >&2 || { bad "dpkg -r failed"; return; }
  status="$("${dpkg_r[@]}" -s pcientb 2>/dev/null | sed -n 's/^Status: //p')"
  [[ "$status" == "deinstall ok config-files" ]] || bad "after dpkg -r: status '$status'"
  while IFS= read -r f; do
    f="${f#.}"
    [[ -e "$r$f" || -L "$r$f" ]] || continue
    grep -qxF "$f" <<<"$conffiles" || bad "left after dpkg -r: $f"
  done < <(deb_files "$deb")
  grep -q '^# edited after install' "$r/etc/pcientb/sdp.conf" 2>/dev/null ||
    bad "dpkg -r did not keep the edited conffile /etc/pcientb/sdp.conf"

  say "purge"
  "${dpkg_r[@]}" -P pcientb >&2 || { bad "dpkg -P failed"; return; }
  status="$("${dpkg_r[@]}" -s pcientb 2>/dev/null | sed -n 's/^Status: //p')"
  [[ -z "$status" || "$status" == "unknown ok not-installed" ]] ||
    bad "after dpkg -P: status '$status'"
  if [[ "$(tree_of "$r")" != "$before" ]]; then
    bad "left after dpkg -P: $(diff <(echo "$before") <(tree_of "$r") | sed -n 's/^> //p' | tr '\n' ' ')"
  fi
  if compgen -G "$r/var/lib/dpkg/info/pcientb.*" >/dev/null; then
    bad "dpkg's database still has pcientb.* files"
  fi
}

# check_deb DEB: contents, then (if they are right) install, remove and purge.
check_deb() {
  local deb=$1 real_before real_after
  [[ -f "$deb" ]] || die "no such package: $deb"
  errors=0
  check_contents "$deb"
  if [[ $errors -ne 0 ]]; then
    say "$deb: $errors problem(s) in the package; not installed"
    return 1
  fi
  if [[ $EUID -ne 0 ]] && ! command -v fakeroot >/dev/null 2>&1; then
    say "SKIP: installing into a private dpkg root needs root or fakeroot"
    return 77
  fi
  # The system's own pcientb (if any) must be left as it was.
  real_before="$(dpkg-query -W -f='${Status} ${Version}' pcientb 2>/dev/null)"
  check_install "$deb"
  real_after="$(dpkg-query -W -f='${Status} ${Version}' pcientb 2>/dev/null)"
  [[ "$real_before" == "$real_after" ]] || bad "the system's pcientb changed: '$real_before' -> '$real_after'"
  if [[ $errors -ne 0 ]]; then
    say "$deb: $errors problem(s)"
    return 1
  fi
  say "$deb: contents, conffiles, install, remove and purge OK"
}

need_dpkg() {
  local t
  for t in dpkg dpkg-deb dpkg-query tar; do
    command -v "$t" >/dev/null 2>&1 || { say "SKIP: $t not found"; exit 77; }
  done
}

new_work() {
  work="$(mktemp -d "${TMPDIR:-/tmp}/pcientb-package.XXXXXX")" || die "mktemp failed"
  trap 'rm -rf "$work"' EXIT
}

case "${1:-}" in
  -h | --help) sed -n '2,19p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
  --check)
    [[ $# -eq 2 ]] || die "usage: scripts/package.sh --check DEB"
    need_dpkg; new_work
    check_deb "$2"; exit $?
    ;;
  --test)
    [[ $# -eq 2 ]] || die "usage: scripts/package.sh --test BUILD_DIR"
    need_dpkg; new_work
    deb="$(build_deb "$2" "$work/out")" || exit 1
    say "built $deb"
    want="$(sed -n 's/^set(CPACK_PACKAGE_VERSION "\(.*\)")$/\1/p' "$2/CPackConfig.cmake")"
    got="$(dpkg-deb -f "$deb" Version)"
    [[ "$got" == "$want" ]] || { say "FAIL: Version '$got', the project's is '$want'"; exit 1; }
    check_deb "$deb"; rc=$?
    [[ $rc -eq 0 ]] || exit "$rc"
    # The check must be able to fail: the same package without its provider.
    say "negative check: the package without its provider must be rejected"
    mkdir -p "$work/broken"
    dpkg-deb -R "$deb" "$work/broken/tree" || die "dpkg-deb -R failed"
    find "$work/broken/tree" -name 'libpcientb-rdmav*.so' -delete
    sed -i '/libpcientb-rdmav[0-9]*\.so$/d' "$work/broken/tree/DEBIAN/md5sums"
    dpkg-deb --root-owner-group -b "$work/broken/tree" "$work/broken/pcientb_broken.deb" >/dev/null ||
      die "dpkg-deb -b failed"
    out="$( (check_deb "$work/broken/pcientb_broken.deb") 2>&1)" && {
      echo "$out" >&2; say "FAIL: the package without its provider passed the check"; exit 1; }
    grep -q 'no provider' <<<"$out" || {
      echo "$out" >&2; say "FAIL: the check failed, but not on the missing provider"; exit 1; }
    say "negative check OK: $(grep -m1 'no provider' <<<"$out" | sed 's/^package: //')"
    say "PASS"
    ;;
  -*) die "unknown option '$1' (see --help)" ;;
  *)
    build="${1:-$root/build}"
    [[ -d "$build" ]] || die "no build tree $build (scripts/setup.sh --deb builds one)"
    build="$(cd "$build" && pwd)"
    out="${2:-$build/deb}"
    deb="$(build_deb "$build" "$out")" || exit 1
    say "built $deb"
    say "install: sudo apt install $deb    remove: sudo apt remove pcientb (purge: apt purge pcientb)"
    echo "$deb"
    ;;
esac
