#!/usr/bin/env bash
# meshlm --version and meshlm version print the library's meshlm_version(),
# which is include/meshlm/meshlm.h's MESHLM_VERSION_* (the one source of the
# version); the usage lists the command.
# usage: test_version.sh MESHLM SOURCE_DIR
set -u
meshlm=$1
src=$2
. "$src/tests/cli/common.sh"
part() { sed -n "s/^#define MESHLM_VERSION_$1 \([0-9]*\)$/\1/p" "$src/include/meshlm/meshlm.h"; }
want="meshlm $(part MAJOR).$(part MINOR).$(part PATCH)"
for cmd in --version version; do
  out=$("$meshlm" "$cmd" 2> "$work/err")
  rc=$?
  if [ $rc -eq 0 ] && [ "$out" = "$want" ] && [ ! -s "$work/err" ]; then
    ok "meshlm $cmd: $out"
  else
    bad "meshlm $cmd (exit $rc): '$out', expected '$want'"
  fi
done
if "$meshlm" --help | grep -q "^  version .*meshlm --version"; then
  ok "the usage lists version"
else
  bad "the usage lists version"
fi
finish
