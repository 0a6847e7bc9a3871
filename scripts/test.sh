#!/usr/bin/env bash
# scripts/test.sh: build and run every test, in the default and the ASan builds (ASan without
# the benchmarks, lint, packaging and the longest integration runs: CMakePresets.json), and the
# verbs and verbs-tool tests again in strict mode (PCIENTB_NTB_STRICT=1, the default build),
# then the libFuzzer target (clang, ASan + UBSan) for PCIENTB_FUZZ_SECONDS (60).
#
#   scripts/test.sh               presets "default" (build/), "strict" (build/), "asan" (build-asan/)
#                                 and "fuzz" (build-fuzz/)
#   scripts/test.sh tsan          any presets of CMakePresets.json
#
# Installs missing dependencies first (scripts/setup.sh --deps-only). Ends with
# the line "N passed, N failed" (tests of all presets, counted from CTest's JUnit
# report; skipped and disabled tests are neither, and a test CTest could not run
# is a failure; a preset that fails to configure or build, or whose CTest run
# leaves no report, counts as one failure). Exit status 0 only if nothing failed.
# Limits: ctest --timeout 300 per test, at most PCIENTB_TEST_TIME_LIMIT seconds
# (default 900) per preset.

set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root" || exit 1

if ! scripts/setup.sh --check-deps >/dev/null 2>&1; then
  echo "test: dependencies missing; installing them (scripts/setup.sh --deps-only)"
  scripts/setup.sh --deps-only || { echo "0 passed, 1 failed"; exit 1; }
fi

presets=("$@")
[[ ${#presets[@]} -gt 0 ]] || presets=(default strict asan fuzz)
time_limit="${PCIENTB_TEST_TIME_LIMIT:-900}"
jobs="${PCIENTB_TEST_JOBS:-2}"

# junit_counts FILE: "passed failed skipped" from CTest's JUnit report, then the
# names of the failed tests, one a line. CTest marks a test "notrun" both when it
# is skipped (SKIP_RETURN_CODE, SKIP_REGULAR_EXPRESSION) and when it cannot run
# (no executable, a failed fixture): the latter are failures, as in its summary.
junit_counts() {
  python3 - "$1" <<'EOF'
import sys
import xml.etree.ElementTree as ET

passed, failed, skipped, names = 0, 0, 0, []
for case in ET.parse(sys.argv[1]).getroot().iter("testcase"):
    status = case.get("status")
    skip = case.find("skipped")
    reason = skip.get("message", "") if skip is not None else ""
    if status == "run":
        passed += 1
    elif status == "disabled" or (
        status == "notrun" and reason.startswith(("SKIP_RETURN_CODE", "SKIP_REGULAR_EXPRESSION"))
    ):
        skipped += 1
    else:
        failed += 1
        names.append(case.get("name", "?"))
print(passed, failed, skipped)
for name in names:
    print(name)
EOF
}

passed=0
failed=0
summary=()
logdir="$(mktemp -d)"
trap 'rm -rf "$logdir"' EXIT

started=$SECONDS
for preset in "${presets[@]}"; do
  echo "=== [$preset] configure + build ($((SECONDS - started)) s so far)"
  if ! cmake --preset "$preset"; then
    failed=$((failed + 1)); summary+=("$preset: configure FAILED"); continue
  fi
  if ! cmake --build --preset "$preset" -j "$jobs"; then
    failed=$((failed + 1)); summary+=("$preset: build FAILED"); continue
  fi

  echo "=== [$preset] ctest ($((SECONDS - started)) s so far)"
  env_extra=()
  case "$preset" in
    asan) env_extra=(ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:halt_on_error=1}"
                     UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}") ;;
    # die_after_fork=0: a forked child opens the device, which starts a thread.
    tsan) env_extra=(TSAN_OPTIONS="${TSAN_OPTIONS:-halt_on_error=1:die_after_fork=0:suppressions=$root/tests/tsan.supp}") ;;
  esac
  junit="$logdir/$preset.junit.xml"
  rm -f "$junit"
  timeout --kill-after=30 "$time_limit" \
    env "${env_extra[@]}" ctest --preset "$preset" --output-on-failure -j "$jobs" --timeout 300 \
    --output-junit "$junit"
  rc=$?

  counts=""
  [[ -s "$junit" ]] && counts="$(junit_counts "$junit")"
  if [[ -n "$counts" ]]; then
    read -r npass nfail nskip <<<"$(head -1 <<<"$counts")"
    passed=$((passed + npass))
    failed=$((failed + nfail))
    line="$preset: $npass passed, $nfail failed, $nskip skipped"
    [[ $nfail -eq 0 ]] || line+=" ($(tail -n +2 <<<"$counts" | paste -sd ' ' -))"
    [[ $((npass + nfail + nskip)) -gt 0 ]] || line="$preset: no tests"
    summary+=("$line")
    # CTest failed although no test did (e.g. it stopped early): one failure.
    if [[ $rc -ne 0 && $nfail -eq 0 ]]; then
      failed=$((failed + 1)); summary+=("$preset: ctest exit $rc")
    fi
  else
    failed=$((failed + 1))
    if [[ $rc -eq 124 || $rc -eq 137 ]]; then
      summary+=("$preset: ctest exceeded ${time_limit}s")
    else
      summary+=("$preset: ctest FAILED (exit $rc, no JUnit report)")
    fi
  fi
done

echo "=== summary ($((SECONDS - started)) s in all)"
printf '  %s\n' "${summary[@]}"
echo "$passed passed, $failed failed"
[[ $failed -eq 0 ]]
