#!/usr/bin/env bash
# compare_builds.sh OLD_BIN NEW_BIN [FIXTURES_DIR] — a refactor changes no number.
#
# Runs two meshlm binaries (e.g. one built from main before a refactor and
# one after) on every fixture family under tests/fixtures (each directory with
# a config.json and model.safetensors) and compares, byte for byte:
#   - `meshlm logprobs` of the fixture's input_ids, on 1 rank and on tp 2;
#   - three training steps (`meshlm train --steps 3`, AdamW, grad clipping),
#     on 1 rank and on dp_shard 2 x tp 2 with sequence parallelism: the
#     losses and grad norms of --metrics (timing fields dropped) and the
#     exported HF checkpoint's model.safetensors.
# A fixture the old binary cannot load (a family or option it lacks) is
# listed as new and skipped. COMPARE_FLAGS (e.g. "--param-dtype bf16") are
# added to every run of both binaries; COMPARE_MESHES (default "1|4 --tp 2
# --sequence-parallel") lists the training meshes, "|"-separated, each its
# rank count then its flags.
# Prints one line per check (same, DIFFER, or failed where a run failed on
# either side) and exits non-zero when any differ or fail. Not a CTest
# (it needs the old binary); run by hand around a refactor. Each binary runs
# with the libmeshlm.so beside it (LD_LIBRARY_PATH: the build's RUNPATH
# would otherwise load the tree's newest library into the old binary), so
# copy a build's meshlm and libmeshlm.so* together to keep it.
set -uo pipefail
old=${1:?usage: compare_builds.sh OLD_BIN NEW_BIN [FIXTURES_DIR]}
new=${2:?usage: compare_builds.sh OLD_BIN NEW_BIN [FIXTURES_DIR]}
fixtures=${3:-$(dirname "$0")/../tests/fixtures}
read -r -a extra <<< "${COMPARE_FLAGS:-}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 OMP_WAIT_POLICY=passive
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
same=0 differ=0 failed=0

# run WHICH BIN NP ARGS...: BIN's output under $work/WHICH (stderr kept apart)
run() {
  local which=$1 bin=$2 np=$3
  shift 3
  local lib
  lib=$(cd "$(dirname "$bin")" && pwd)
  if [ "$np" = 1 ]; then LD_LIBRARY_PATH=$lib "$bin" "$@" "${extra[@]}"
  else mpirun -np "$np" -x LD_LIBRARY_PATH="$lib" "$bin" "$@" "${extra[@]}"; fi \
    > "$work/$which.stdout" 2> "$work/$which.stderr"
}

# fail SIDE TAG: run TAG failed on SIDE (its last stderr line shown)
fail() {
  failed=$((failed + 1))
  touch "$work/$1/$2.failed"
  echo "FAILED  $1 $2: $(tail -1 "$work/x.stderr")"
}

# check NAME FILE TAG: FILE under old/ and new/ must be equal bytes; a run
# TAG that failed on either side (counted in $failed) is neither same nor
# differ: both sides' placeholders would otherwise compare equal
check() {
  local sides=""
  [ -e "$work/old/$3.failed" ] && sides="old"
  [ -e "$work/new/$3.failed" ] && sides="${sides:+$sides and }new"
  if [ -n "$sides" ]; then
    echo "failed  $1 (the run failed in $sides)"
  elif cmp -s "$work/old/$2" "$work/new/$2"; then
    same=$((same + 1)); echo "same    $1"
  else
    differ=$((differ + 1)); echo "DIFFER  $1"
  fi
}

for dir in "$fixtures"/*/; do
  fx=$(basename "$dir")
  [ -f "$dir/config.json" ] && [ -f "$dir/model.safetensors" ] && [ -f "$dir/expected.json" ] || continue
  python3 - "$dir/expected.json" "$work/$fx.jsonl" <<'EOF'
import json, sys
rows = json.load(open(sys.argv[1]))["input_ids"]
with open(sys.argv[2], "w") as f:
    for r in rows * 4:  # 8 rows: enough for dp 2 x 3 steps of batch 2
        f.write(json.dumps({"input_ids": r}) + "\n")
EOF
  S=$(python3 -c "import json;print(len(json.load(open('$dir/expected.json'))['input_ids'][0]))")
  if ! run x "$old" 1 logprobs --model "$dir" --data "$work/$fx.jsonl" --out "$work/probe.jsonl"; then
    echo "new     $fx (the old binary refuses it: $(grep -m1 error "$work/x.stderr"))"
    continue
  fi
  for side in old new; do
    bin=$old; [ $side = new ] && bin=$new
    mkdir -p "$work/$side"
    for mesh in "1" "2 --tp 2"; do
      np=${mesh%% *}; flags=${mesh#"$np"}; tag=$fx.lp.np$np
      run x "$bin" "$np" logprobs --model "$dir" --data "$work/$fx.jsonl" \
        --out "$work/$side/$tag.jsonl" $flags || fail "$side" "$tag"
    done
    IFS='|' read -ra meshes <<< "${COMPARE_MESHES:-1|4 --tp 2 --sequence-parallel}"
    for k in "${!meshes[@]}"; do
      mesh=${meshes[$k]}; np=${mesh%% *}; flags=${mesh#"$np"}; tag=$fx.train.mesh$k
      rm -rf "$work/$side/$tag.hf"
      run x "$bin" "$np" train --model "$dir" --data "$work/$fx.jsonl" --steps 3 --batch-size 2 \
        --seq-len "$S" --lr 1e-3 --max-grad-norm 1.0 --seed 7 --metrics "$work/$side/$tag.m" \
        --export-hf "$work/$side/$tag.hf" $flags || fail "$side" "$tag"
      python3 - "$work/$side/$tag.m" > "$work/$side/$tag.numbers" <<'EOF'
import json, sys
try:
    for line in open(sys.argv[1]):
        r = json.loads(line)
        print(r["step"], repr(r["loss"]), repr(r["grad_norm"]), repr(r["lr"]), r["skipped"])
except FileNotFoundError:
    print("no metrics")
EOF
      cp "$work/$side/$tag.hf/model.safetensors" "$work/$side/$tag.st" 2>/dev/null || echo none > "$work/$side/$tag.st"
    done
  done
  for np in 1 2; do check "$fx logprobs np $np" "$fx.lp.np$np.jsonl" "$fx.lp.np$np"; done
  for k in "${!meshes[@]}"; do
    check "$fx train [${meshes[$k]}] losses" "$fx.train.mesh$k.numbers" "$fx.train.mesh$k"
    check "$fx train [${meshes[$k]}] weights" "$fx.train.mesh$k.st" "$fx.train.mesh$k"
  done
done
echo "$same same, $differ differ, $failed runs failed"
[ "$differ" -eq 0 ] && [ "$failed" -eq 0 ]
