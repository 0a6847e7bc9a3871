# tests/lint/files.sh: sourced by the lint scripts. lint_files DIR prints the files of
# the repository at DIR, one a line, relative to DIR: those git tracks (and still exist)
# plus untracked ones it does not ignore; without git (or outside a work tree), every
# file but those under .git, build trees (a directory with a CMakeCache.txt, or named
# build, build-*, out) and CPack's staging directories.
# shellcheck shell=bash

lint_have_git() {
  command -v git >/dev/null 2>&1 && git -C "$1" rev-parse --is-inside-work-tree >/dev/null 2>&1
}

lint_files() {
  local dir=$1 f
  if lint_have_git "$dir"; then
    git -C "$dir" ls-files -z --cached --others --exclude-standard |
      while IFS= read -r -d '' f; do
        [[ -f "$dir/$f" && ! -L "$dir/$f" ]] && printf '%s\n' "$f"
      done | LC_ALL=C sort -u
  else
    (cd "$dir" && find . \( -name .git -o -name build -o -name 'build-*' -o -name out \
      -o -name _CPack_Packages -o -exec test -e '{}/CMakeCache.txt' \; \) -prune \
      -o -type f -print | sed 's|^\./||' | LC_ALL=C sort)
  fi
}
