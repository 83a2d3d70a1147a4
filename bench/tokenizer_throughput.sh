#!/usr/bin/env bash
# Tokenizer throughput on one core: meshlm's C tokenizer (`meshlm tokenize`,
# its own encode-only MB/s) against HF `tokenizers` on the same records
# (Tokenizer.encode_batch with RAYON_NUM_THREADS=1, and encode in a loop),
# add_special_tokens=True both. Checks that both give the same ids. Figures
# only; not a test.
# usage: bench/tokenizer_throughput.sh [TOKENIZER_DIR [MB]]
#   TOKENIZER_DIR  a directory with tokenizer.json (default: the SmolLM2 fixture)
#   MB             text size, megabytes (default 8): this repository's README,
#                  C sources and tests, repeated, one JSONL record per paragraph
# MESHLM=path picks another binary. Uses /work/venv/bin/python when present (else python3) for tokenizers; its
# rows are skipped without it.
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-$root/tests/fixtures/tokenizer/smollm2}
mb=${2:-8}
meshlm=${MESHLM:-$root/build/meshlm}
py=python3
[ -x /work/venv/bin/python ] && py=/work/venv/bin/python
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
[ -x "$meshlm" ] || { echo "build meshlm first (make)"; exit 1; }

# the text: paragraphs of the repository's prose and code as JSONL records
cat "$root/README.md" "$root"/src/*/*.c "$root"/src/*/*.h "$root"/tests/unit/*.c > "$work/one.txt"
"$py" - "$work/one.txt" "$mb" "$work/in.jsonl" <<'EOF'
import json, sys
text = open(sys.argv[1], encoding="utf-8", errors="replace").read()
paras = [p + "\n\n" for p in text.split("\n\n") if p.strip()]
want, size = float(sys.argv[2]) * 1e6, 0
with open(sys.argv[3], "w", encoding="utf-8") as f:
    while size < want:
        for p in paras:
            f.write(json.dumps({"text": p}, ensure_ascii=False) + "\n")
            size += len(p.encode())
EOF

echo "CPU: $(lscpu | sed -n 's/^Model name: *//p' | head -1); tokenizer: $dir"
taskset -c 0 "$meshlm" tokenize --model "$dir" --data "$work/in.jsonl" --out "$work/ours.jsonl" |
  sed 's/^/meshlm     /'

RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false taskset -c 0 "$py" - "$dir" "$work/in.jsonl" \
  "$work/ours.jsonl" <<'EOF' || echo "tokenizers: skipped (python package tokenizers not found)"
import json, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1] + "/tokenizer.json")
texts = [json.loads(l)["text"] for l in open(sys.argv[2], encoding="utf-8")]
mb = sum(len(t.encode()) for t in texts) / 1e6
t0 = time.perf_counter()
batch = tok.encode_batch(texts, add_special_tokens=True)
t1 = time.perf_counter()
loop = [tok.encode(t, add_special_tokens=True) for t in texts]
t2 = time.perf_counter()
ours = [json.loads(l)["input_ids"] for l in open(sys.argv[3], encoding="utf-8")]
same = ours == [e.ids for e in batch] == [e.ids for e in loop]
print("tokenizers encode_batch (1 thread): %.2f MB at %.1f MB/s" % (mb, mb / (t1 - t0)))
print("tokenizers encode loop:             %.2f MB at %.1f MB/s" % (mb, mb / (t2 - t1)))
print("same ids as meshlm: %s" % ("yes" if same else "NO"))
EOF
