#!/usr/bin/env bash
# make install's tree works for a user: the library, header and meshlm.pc
# installed under a prefix (cmake --install of this build), the README's C
# example (examples/policy.c, through meshlm_mpi.h) compiled with `pkg-config
# --cflags --libs meshlm` and run on one rank and on two; meshlm.h compiled with
# no mpi.h reachable; the installed CLI runs.
set -euo pipefail
source "$(dirname "$0")/common.sh"
meshlm=$1 src=$2
build=$(dirname "$meshlm")
TMP=$work
prefix="$TMP/prefix"
cmake --install "$build" --prefix "$prefix" > "$TMP/install.log"
export PKG_CONFIG_PATH="$prefix/lib/pkgconfig:$prefix/lib64/pkgconfig:${PKG_CONFIG_PATH:-}"
flags=$(pkg-config --cflags --libs meshlm)
libdir=$(pkg-config --variable=libdir meshlm)
cc -Wall -Werror "$src/examples/policy.c" $flags -Wl,-rpath,"$libdir" -o "$TMP/policy"
# meshlm.h needs no MPI: it compiles where any mpi.h on the path is an error
mkdir -p "$TMP/no_mpi"
echo '#error "meshlm.h included mpi.h"' > "$TMP/no_mpi/mpi.h"
if echo '#include <meshlm/meshlm.h>' | cc -std=c11 -Wall -Werror -fsyntax-only -I"$TMP/no_mpi" \
    -I"$(pkg-config --variable=includedir meshlm)" -x c - 2> "$TMP/no_mpi.log"; then
  ok "meshlm.h compiles without mpi.h"
else
  cat "$TMP/no_mpi.log"; bad "meshlm.h needs mpi.h"
fi
# only the API is exported
if nm -D --defined-only "$libdir/libmeshlm.so" | awk '$2 == "T" && $3 !~ /^meshlm_/ { b = 1; print "exported: " $3 } END { exit b }'; then
  ok "only meshlm_* exported"
else
  bad "symbols beyond the API exported"
fi
"$prefix/bin/meshlm" init --arch llama --preset tiny --out "$TMP/model" > /dev/null
one=$("$TMP/policy" "$TMP/model")
two=$(mpirun -np 2 "$TMP/policy" "$TMP/model")
echo "1 rank: $one"
echo "2 ranks: $two"
if [[ $one == "loss "* && $two == "loss "* ]]; then ok "the example runs"; else bad "the example printed no result"; fi
# the same two sequences on each of two data-parallel ranks: the same mean loss
if [[ ${one%% grad*} == "${two%% grad*}" ]]; then ok "1 and 2 ranks: the same loss"; else bad "loss differs: '$one' vs '$two'"; fi
finish
