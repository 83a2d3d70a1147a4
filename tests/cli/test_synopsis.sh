#!/usr/bin/env bash
# The README's CLI block (the ```synopsis fence) is what `meshlm --synopsis`
# prints from the commands' flag tables, so a flag added without the README
# fails here; `meshlm CMD --synopsis` prints that command's lines of it.
# usage: test_synopsis.sh MESHLM SOURCE_DIR
set -u
meshlm=$1
src=$2
. "$src/tests/cli/common.sh"
sed -n '/^```synopsis$/,/^```$/p' "$src/README.md" | sed '1d;$d' > "$work/readme"
if "$meshlm" --synopsis > "$work/synopsis" 2> "$work/err" && [ ! -s "$work/err" ]; then
  ok "meshlm --synopsis: $(wc -l < "$work/synopsis") lines"
else
  bad "meshlm --synopsis failed"
fi
if [ -s "$work/readme" ] && diff -u "$work/readme" "$work/synopsis" > "$work/diff"; then
  ok "README.md's synopsis block is meshlm --synopsis"
else
  bad "README.md's synopsis block differs from meshlm --synopsis (paste its output into the block):"
  head -40 "$work/diff"
fi
for cmd in init train logprobs plan export tokenize version; do
  "$meshlm" "$cmd" --synopsis > "$work/one" 2> "$work/err"
  # its lines, each a line of the block
  if grep -q "^meshlm $cmd\( \|$\)" "$work/one" &&
      [ "$(grep -cFxf "$work/synopsis" "$work/one")" -eq "$(wc -l < "$work/one")" ]; then
    ok "meshlm $cmd --synopsis: its lines of the block"
  else
    bad "meshlm $cmd --synopsis: $(head -1 "$work/one")"
  fi
  # every flag --help lists
  missing=
  for flag in $("$meshlm" "$cmd" --help | sed -n 's/^  \(--[a-z0-9-]*\).*/\1/p'); do
    grep -q -- "$flag\([] ]\|$\)" "$work/one" || missing="$missing $flag"
  done
  if [ -z "$missing" ]; then ok "meshlm $cmd: every flag of --help in its synopsis"
  else bad "meshlm $cmd: flags of --help missing from its synopsis:$missing"; fi
done
# with several ranks, one block
mpiexec -n 2 "$meshlm" --synopsis > "$work/mpi" 2> "$work/err"
if cmp -s "$work/mpi" "$work/synopsis"; then
  ok "mpiexec -n 2 meshlm --synopsis: printed once"
else
  bad "mpiexec -n 2 meshlm --synopsis printed another block"
fi
finish
