#!/usr/bin/env bash
# scripts/test.sh: build and run every test, in the default and the ASan builds.
#
#   scripts/test.sh               presets "default" (build/) and "asan" (build-asan/)
#   scripts/test.sh tsan          any presets of CMakePresets.json
#
# Installs missing dependencies first (scripts/setup.sh --deps-only). Ends with
# the line "N passed, N failed" (tests of all presets; a preset that fails to
# configure or build counts as one failure). Exit status 0 only if nothing failed.
# Limits: ctest --timeout 300 per test, at most PCIENTB_TEST_TIME_LIMIT seconds
# (default 900) per preset.

set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

if ! scripts/setup.sh --check-deps >/dev/null 2>&1; then
  echo "test: dependencies missing; installing them (scripts/setup.sh --deps-only)"
  scripts/setup.sh --deps-only || { echo "0 passed, 1 failed"; exit 1; }
fi

presets=("$@")
[[ ${#presets[@]} -gt 0 ]] || presets=(default asan)
time_limit="${PCIENTB_TEST_TIME_LIMIT:-900}"
jobs="${PCIENTB_TEST_JOBS:-2}"

passed=0
failed=0
summary=()
logdir="$(mktemp -d)"
trap 'rm -rf "$logdir"' EXIT

for preset in "${presets[@]}"; do
  echo "=== [$preset] configure + build"
  if ! cmake --preset "$preset"; then
    failed=$((failed + 1)); summary+=("$preset: configure FAILED"); continue
  fi
  if ! cmake --build --preset "$preset" -j "$jobs"; then
    failed=$((failed + 1)); summary+=("$preset: build FAILED"); continue
  fi

  echo "=== [$preset] ctest"
  env_extra=()
  case "$preset" in
    asan) env_extra=(ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:halt_on_error=1}"
                     UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}") ;;
    # die_after_fork=0: a forked child opens the device, which starts a thread.
    tsan) env_extra=(TSAN_OPTIONS="${TSAN_OPTIONS:-halt_on_error=1:die_after_fork=0:suppressions=$root/tests/tsan.supp}") ;;
  esac
  log="$logdir/$preset.log"
  timeout --kill-after=30 "$time_limit" \
    env "${env_extra[@]}" ctest --preset "$preset" --output-on-failure -j "$jobs" --timeout 300 \
    2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}

  line="$(grep -E '^[0-9]+% tests passed, [0-9]+ tests? failed out of [0-9]+' "$log" | tail -1)"
  if [[ -n "$line" ]]; then
    total="$(sed -E 's/.* out of ([0-9]+).*/\1/' <<<"$line")"
    nfail="$(sed -E 's/.*, ([0-9]+) tests? failed.*/\1/' <<<"$line")"
    passed=$((passed + total - nfail))
    failed=$((failed + nfail))
    summary+=("$preset: $((total - nfail)) passed, $nfail failed")
  elif [[ $rc -eq 0 ]] || grep -q 'No tests were found' "$log"; then
    summary+=("$preset: no tests")
  else
    failed=$((failed + 1))
    if [[ $rc -eq 124 || $rc -eq 137 ]]; then
      summary+=("$preset: ctest exceeded ${time_limit}s")
    else
      summary+=("$preset: ctest FAILED (exit $rc)")
    fi
  fi
  if [[ $rc -ne 0 && -n "$line" && "$nfail" -eq 0 ]]; then
    failed=$((failed + 1)); summary+=("$preset: ctest exit $rc")
  fi
done

echo "=== summary"
printf '  %s\n' "${summary[@]}"
echo "$passed passed, $failed failed"
[[ $failed -eq 0 ]]
