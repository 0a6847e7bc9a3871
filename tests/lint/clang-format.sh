#!/usr/bin/env bash
# tests/lint/clang-format.sh [--changed [BASE] | --all] [--fix] [SOURCE_DIR]
#
# clang-format (the repository's .clang-format) on the C/C++ sources (.c .h .cc .cpp
# .cxx .hh .hpp .hxx) of the repository at SOURCE_DIR (default: this script's).
#
#   --changed [BASE]  (default) the files that differ from BASE, in the work tree,
#                     plus new untracked ones. Without BASE: when HEAD is main's
#                     commit (CI checks out main), the last commit's changes (against
#                     its first parent); else the changes since the merge-base with
#                     main (or origin/main). All files when git is not available, or
#                     there is no such base (shallow clone, no main).
#                     Before a commit: tests/lint/clang-format.sh --changed
#   --all             every source (cmake --build build --target format-check)
#   --fix             rewrite the files (clang-format -i) instead of checking them
#                     (cmake --build build --target format: --all --fix)
#
# CTest: lint.clang_format (--changed). Exit status 0 if every file is formatted,
# 1 if not, 77 (CTest: skipped) without clang-format. $CLANG_FORMAT names the binary.

set -uo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=tests/lint/files.sh
source "$here/files.sh"

mode=changed base="" fix=0 src=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --all) mode=all; shift ;;
    --changed)
      mode=changed; shift
      # An optional BASE: anything that names a commit and is not a directory.
      if [[ $# -gt 0 && "$1" != -* && ! -d "$1" ]]; then base=$1; shift; fi
      ;;
    --fix) fix=1; shift ;;
    -h | --help) sed -n '2,19p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "clang-format.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
    *) src=$1; shift ;;
  esac
done
src="$(cd "${src:-$here/../..}" && pwd)" || exit 1
cd "$src" || exit 1

clang_format="${CLANG_FORMAT:-clang-format}"
if ! command -v "$clang_format" >/dev/null 2>&1; then
  echo "lint.clang_format: SKIP: $clang_format not found (apt-get install clang-format)"
  exit 77
fi

is_source() { [[ "$1" =~ \.(c|h|cc|cpp|cxx|hh|hpp|hxx)$ ]]; }

# The commit to compare with, for --changed without BASE; empty: none.
default_base() {
  local main="" ref head
  lint_have_git . || return 0
  for ref in main origin/main; do
    if git rev-parse -q --verify "$ref^{commit}" >/dev/null 2>&1; then main=$ref; break; fi
  done
  [[ -n "$main" ]] || return 0
  head="$(git rev-parse -q --verify 'HEAD^{commit}' 2>/dev/null)" || return 0
  if [[ "$head" == "$(git rev-parse "$main^{commit}")" ]]; then
    git rev-parse -q --verify 'HEAD^1^{commit}' 2>/dev/null || true
  else
    git merge-base HEAD "$main" 2>/dev/null || true
  fi
}

files=()
what="every C/C++ source"
if [[ $mode == changed ]]; then
  if ! lint_have_git .; then
    echo "lint.clang_format: git not available here: checking every file"
  else
    [[ -n "$base" ]] || base="$(default_base)"
    if [[ -z "$base" ]]; then
      echo "lint.clang_format: no main branch, or no parent commit to compare with: checking every file"
    elif ! git rev-parse -q --verify "$base^{commit}" >/dev/null 2>&1; then
      echo "lint.clang_format: '$base' is not a commit" >&2
      exit 2
    else
      what="C/C++ files changed since $(git rev-parse --short "$base")"
      mode=list
      while IFS= read -r f; do
        [[ -f "$f" ]] && is_source "$f" && files+=("$f")
      done < <( { git diff --name-only --diff-filter=d "$base" --
                  git ls-files --others --exclude-standard; } | LC_ALL=C sort -u)
    fi
  fi
fi
if [[ $mode != list ]]; then
  while IFS= read -r f; do
    is_source "$f" && files+=("$f")
  done < <(lint_files .)
fi

echo "lint.clang_format: $("$clang_format" --version | sed 's/^.*version /clang-format /'), ${#files[@]} files ($what)"
[[ ${#files[@]} -gt 0 ]] || exit 0

if [[ $fix -eq 1 ]]; then
  "$clang_format" -i --style=file "${files[@]}"
  exit
fi
bad=()
for f in "${files[@]}"; do
  "$clang_format" --dry-run --Werror --style=file "$f" >/dev/null 2>&1 || bad+=("$f")
done
if [[ ${#bad[@]} -eq 0 ]]; then
  echo "lint.clang_format: OK"
  exit 0
fi
# The first differences of each file, then the list.
for f in "${bad[@]}"; do
  "$clang_format" --dry-run --Werror --style=file "$f" 2>&1 | head -n 12
done
echo "lint.clang_format: FAIL: ${#bad[@]} file(s) not clang-formatted:"
printf '  %s\n' "${bad[@]}"
echo "fix: $clang_format -i ${bad[*]}"
exit 1
