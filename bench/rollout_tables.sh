#!/usr/bin/env bash
# Issue 31's decode tables in one run: for each real checkpoint (SmolLM2-135M-Instruct and
# Gemma-3-270M, made by tools/real_models.sh) and dtype (fp32; bf16: meshlm's param_dtype bf16,
# transformers' model in torch.bfloat16, llama.cpp's bf16 GGUF), batches 1 / 8 / 64 of PROMPT-token
# prompts each continued by NEW tokens, one process on every core:
#   meshlm       bench/generate_throughput.py --impls new (Policy.generate, continuous batching)
#   transformers the same script's --impls torch (generate(), do_sample, use_cache)
#   llama.cpp    bench/llamacpp_peer.sh (llama-batched-bench on the model's GGUF) when
#                LLAMA_BATCHED_BENCH names the binary and REAL/<model>-<f32|bf16>.gguf exists
#                (llama.cpp's convert_hf_to_gguf.py --outtype f32|bf16 of REAL/<model>-fp32)
# meshlm and transformers alternate per batch (one process each), llama.cpp follows per dtype, so
# the ratios come from one run on one machine. Prints the CPU, the load average before and after,
# and the tables. Figures for notes; nothing here is asserted.
# usage: bench/rollout_tables.sh [MODELS [DTYPES [BATCHES [PROMPT [NEW]]]]]
#        (defaults "smollm2-135m gemma3-270m"  fp32,bf16  1,8,64  128  256; REAL=/work/real)
set -euo pipefail
cd "$(dirname "$0")/.."
models=${1:-smollm2-135m gemma3-270m} dtypes=${2:-fp32,bf16} batches=${3:-1,8,64}
prompt=${4:-128} new=${5:-256}
real=${REAL:-/work/real}
[ -f build/libmeshlm.so ] || { echo "rollout_tables.sh: build/libmeshlm.so missing (make)" >&2; exit 1; }
echo "rollout_tables.sh $(date -u +%FT%TZ): $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores;" \
  "flags: $(grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_bf16' /proc/cpuinfo | sort -u | tr '\n' ' ')"
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
for m in $models; do
  dir=$real/$m-fp32
  [ -f "$dir/config.json" ] || { echo "$m: $dir missing (tools/real_models.sh)"; continue; }
  for d in ${dtypes//,/ }; do
    echo
    echo "## $m $d, prompt $prompt, $new new tokens"
    python3 bench/generate_throughput.py --model "$dir" --impls new,torch --dtypes "$d" \
      --batches "$batches" --prompt "$prompt" --new "$new" --no-step | tail -n +2
    gguf=$real/$m-$([ "$d" = fp32 ] && echo f32 || echo bf16).gguf
    if [ -n "${LLAMA_BATCHED_BENCH:-}" ] && [ -f "$gguf" ]; then
      bench/llamacpp_peer.sh "$LLAMA_BATCHED_BENCH" "$gguf" "$batches" "$prompt" "$new" "$(nproc)"
    else
      echo "llama.cpp: skipped (LLAMA_BATCHED_BENCH unset or $gguf missing)"
    fi
  done
done
echo
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
