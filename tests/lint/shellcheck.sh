#!/usr/bin/env bash
# tests/lint/shellcheck.sh [SOURCE_DIR]: shellcheck over every shell script of the
# repository (default: the one this script is in). CTest: lint.shellcheck.
#
# A shell script is a file whose first line is an sh/bash/dash/ksh shebang
# (#!/bin/sh, #!/bin/bash, #!/usr/bin/env bash, ...), or whose name ends in .sh or
# .bash; the files are those of tests/lint/files.sh (git's, else all outside build
# trees). Exit status 0 if shellcheck reports nothing, 1 if it reports anything,
# 77 (CTest: skipped) if shellcheck is not installed. $SHELLCHECK names the binary.

set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
src="$(cd "${1:-$here/../..}" && pwd)" || exit 1
# shellcheck source=tests/lint/files.sh
source "$here/files.sh"

shellcheck="${SHELLCHECK:-shellcheck}"
if ! command -v "$shellcheck" >/dev/null 2>&1; then
  echo "lint.shellcheck: SKIP: $shellcheck not found (apt-get install shellcheck)"
  exit 77
fi

shebang='^#![[:space:]]*([^[:space:]]*/)?(env[[:space:]]+(-S[[:space:]]+)?)?(ba|da|k)?sh([[:space:]]|$)'
scripts=()
while IFS= read -r f; do
  case "$f" in
    *.sh | *.bash) scripts+=("$f"); continue ;;
  esac
  first="$(LC_ALL=C head -c 256 "$src/$f" 2>/dev/null | head -n 1 | tr -d '\0')"
  [[ "$first" =~ $shebang ]] && scripts+=("$f")
done < <(lint_files "$src")

if [[ ${#scripts[@]} -eq 0 ]]; then
  echo "lint.shellcheck: no shell scripts found under $src"
  exit 1
fi
echo "lint.shellcheck: $("$shellcheck" --version | sed -n 's/^version: /shellcheck /p'), ${#scripts[@]} scripts:"
printf '  %s\n' "${scripts[@]}"
cd "$src" || exit 1
if "$shellcheck" --format=gcc --external-sources "${scripts[@]}"; then
  echo "lint.shellcheck: OK"
else
  echo "lint.shellcheck: FAIL (fix the script, or add '# shellcheck disable=SCnnnn' with a comment saying why)"
  exit 1
fi
