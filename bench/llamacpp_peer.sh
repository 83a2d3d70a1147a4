#!/usr/bin/env bash
# llama.cpp's batched generation on the shapes bench/generate_throughput.py measures meshlm
# on, for the comparison issue 31 asks for: llama-batched-bench (llama.cpp's own benchmark
# of B sequences decoding together, each with its own KV cache: -npl B) on a GGUF of the
# same model — SmolLM2-135M converted from the HF checkpoint by llama.cpp's
# convert_hf_to_gguf.py (--outtype f32 or bf16, the dtypes meshlm computes in) — B prompts of
# PROMPT tokens, NEW generated tokens each (greedy: llama-batched-bench samples nothing,
# it times the forwards), THREADS threads. Prints per batch:
#   llama.cpp TYPE B b: prefill P tokens/s, decode D tokens/s (B·NEW tokens over the decode time)
# from the table llama-batched-bench prints (S_PP, S_TG). Figures for notes; nothing is
# asserted. llama.cpp is not a dependency of meshlm: build it where you measure (its
# llama-batched-bench target) and pass the binary.
# usage: bench/llamacpp_peer.sh LLAMA_BATCHED_BENCH GGUF [BATCHES [PROMPT [NEW [THREADS]]]]
#        (defaults 1,8,64  128  256  $(nproc))
set -euo pipefail
[ $# -ge 2 ] || { sed -n '2,13p' "$0" >&2; exit 2; }
bin=$1 gguf=$2 batches=${3:-1,8,64} prompt=${4:-128} new=${5:-256} threads=${6:-$(nproc)}
[ -x "$bin" ] || { echo "llamacpp_peer.sh: $bin: not an executable" >&2; exit 2; }
[ -f "$gguf" ] || { echo "llamacpp_peer.sh: $gguf: no such file" >&2; exit 2; }
maxb=$(tr ',' '\n' <<< "$batches" | sort -n | tail -n 1)
ctx=$((maxb * (prompt + new) + 16))
type=$(basename "$gguf" .gguf | sed -E 's/.*-//')
# the table's rows: | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
"$bin" -m "$gguf" -c "$ctx" -b 2048 -ub 512 -npp "$prompt" -ntg "$new" -npl "$batches" \
  -t "$threads" -tb "$threads" 2> /dev/null |
  awk -F'|' -v t="$type" 'NF > 10 && $2 ~ /^ *[0-9]+ *$/ {
    gsub(/ /, ""); printf "llama.cpp %s B %s: prefill %.1f tokens/s, decode %.1f tokens/s\n", t, $4, $7, $9 }'
