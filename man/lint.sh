#!/usr/bin/env bash
# lint.sh DIR: checks the manual pages in DIR (files named *.1 .. *.9). CTest runs it as
# man.lint (man/CMakeLists.txt).
#
# For every page:
#   - groff -man -Tutf8 -ww -z must print nothing (any warning or error fails);
#   - the source must be ASCII (other characters are written as roff escapes);
#   - .TH must name the page as its file does (pcientb-run.1: .TH PCIENTB-RUN 1);
#   - every pcientb page its SEE ALSO names must exist in DIR, except the ones in
#     `pending` below (pages announced before they are written).
# Fails when DIR holds no page at all. Exits 77 (CTest: skipped) when groff is missing.

set -euo pipefail

# Pages other pages may name before they exist (none now).
pending=()

prog="man/lint.sh"
if [[ $# -ne 1 || ! -d "$1" ]]; then
  echo "usage: $prog DIR" >&2
  exit 2
fi
dir="$1"
groff="${GROFF:-groff}"
if ! command -v "$groff" >/dev/null 2>&1; then
  echo "$prog: $groff not found (apt-get install groff-base); skipped" >&2
  exit 77
fi

shopt -s nullglob
pages=("$dir"/*.[1-9])
if [[ ${#pages[@]} -eq 0 ]]; then
  echo "$prog: no manual page (*.1 .. *.9) in $dir" >&2
  exit 1
fi

failures=0
fail() {
  echo "$prog: $*" >&2
  failures=$((failures + 1))
}

is_pending() {
  local p
  for p in "${pending[@]}"; do
    [[ "$p" == "$1" ]] && return 0
  done
  return 1
}

# The SEE ALSO section of a page as plain text: roff font escapes removed, \- as -.
see_also() {
  awk '
    /^\.SH/ { in_see = ($0 ~ /^\.SH[ \t]+"?SEE ALSO"?[ \t]*$/); next }
    in_see { print }
  ' "$1" | sed -e 's/\\-/-/g' -e 's/\\f[BIRP]//g' -e 's/\\f(..//g' -e 's/\\f\[[^]]*\]//g'
}

for page in "${pages[@]}"; do
  name="$(basename "$page")"

  out="$("$groff" -man -Tutf8 -ww -z "$page" 2>&1)" || true
  if [[ -n "$out" ]]; then
    fail "$name: groff reports:"
    printf '%s\n' "$out" | sed 's/^/    /' >&2
  fi

  if LC_ALL=C grep -n $'[\x80-\xff]' "$page" >/dev/null; then
    fail "$name: non-ASCII characters (use roff escapes such as \\(em):"
    LC_ALL=C grep -n $'[\x80-\xff]' "$page" | sed 's/^/    /' >&2
  fi

  th="$(awk '$1 == ".TH" { print $2, $3; exit }' "$page")"
  want="${name%.*} ${name##*.}"
  if [[ "${th,,}" != "${want,,}" ]]; then
    fail "$name: .TH says '${th}', the file name says '${want^^}'"
  fi

  refs="$(see_also "$page" |
    grep -oE 'pcientb[A-Za-z0-9._-]*[[:space:]]*\([1-9][a-z]*\)' || true)"
  if [[ -z "$(see_also "$page")" ]]; then
    fail "$name: no SEE ALSO section"
  fi
  while IFS= read -r ref; do
    [[ -n "$ref" ]] || continue
    ref_name="${ref%%(*}"
    ref_name="${ref_name%"${ref_name##*[![:space:]]}"}"
    ref_sect="${ref##*(}"
    ref_sect="${ref_sect%)}"
    target="$ref_name.$ref_sect"
    if [[ ! -f "$dir/$target" ]] && ! is_pending "$target"; then
      fail "$name: SEE ALSO names $ref_name($ref_sect), but $dir/$target does not exist"
    fi
  done <<<"$refs"
done

if [[ $failures -gt 0 ]]; then
  echo "$prog: $failures problem(s) in ${#pages[@]} page(s)" >&2
  exit 1
fi
echo "$prog: ${#pages[@]} page(s) clean: ${pages[*]##*/}"
