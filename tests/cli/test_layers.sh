#!/usr/bin/env bash
# The source tree keeps the layering docs/ARCHITECTURE.md declares: its
# ```layers block lists, per directory of src/, the directories its files may
# include from ("dir: allowed ..."; a directory may always include itself),
# and file rules "glob !header" that forbid one header to some files (e.g.
# parallel/tp*: not parallel/fsdp.h). Every #include "x/..." of every file
# under src/ is checked; a violation names the file, the line and the rule.
# Usage: test_layers.sh MESHLM SRC_DIR (the CLI tests' arguments; MESHLM unused)
set -uo pipefail
src=$2
doc=$src/docs/ARCHITECTURE.md
[ -f "$doc" ] || { echo "FAIL no $doc"; exit 1; }
rules=$(awk '/^```layers$/{on=1; next} /^```$/{on=0} on' "$doc")
[ -n "$rules" ] || { echo "FAIL $doc has no \`\`\`layers block"; exit 1; }
fail=0 checked=0
declare -A allowed
while read -r left right; do
  case "$left" in
    *:) allowed[${left%:}]=" ${left%:} $right " ;;
  esac
done <<< "$rules"
cd "$src" || exit 1
while IFS= read -r f; do
  dir=$(echo "$f" | cut -d/ -f2)
  if [ -z "${allowed[$dir]+x}" ]; then
    echo "FAIL $f: directory src/$dir is not in $doc's layers block"; fail=$((fail + 1)); continue
  fi
  while IFS=: read -r line inc; do
    to=${inc%%/*}
    checked=$((checked + 1))
    case "${allowed[$dir]}" in
      *" $to "*) ;;
      *) echo "FAIL $f:$line includes $inc: src/$dir may include only from:${allowed[$dir]}"
         fail=$((fail + 1)) ;;
    esac
  done < <(grep -n '^#include "[a-z_]*/' "$f" | sed -E 's/^([0-9]+):#include "([^"]+)".*/\1:\2/')
done < <(git ls-files 'src/*.c' 'src/*.h' 'src/*.cu' 'src/*.cuh' 2>/dev/null || find src -name '*.[ch]' -o -name '*.cu' -o -name '*.cuh')
# file rules: "glob !header"
while read -r glob forbid; do
  [ "${forbid#!}" != "$forbid" ] || continue
  header=${forbid#!}
  for f in src/$glob; do
    [ -f "$f" ] || continue
    checked=$((checked + 1))
    if grep -q "^#include \"$header\"" "$f"; then
      echo "FAIL $f includes $header, which the rule '$glob $forbid' forbids"; fail=$((fail + 1))
    fi
  done
done <<< "$rules"
echo "$checked includes checked, $fail violations"
[ "$fail" -eq 0 ]
