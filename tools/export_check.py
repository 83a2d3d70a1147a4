#!/usr/bin/env python3
"""export_check.py - check a `meshlm export` checkpoint with Hugging Face transformers.

PURPOSE
    `meshlm export` (and `meshlm train --export-hf`) write a trained model as
    an HF checkpoint together with the rest of the model the run started
    from: its architecture and config.json (a Gemma3ForConditionalGeneration
    stays one), its tokenizer / generation / processor files, the tensors
    meshlm does not train (the vision tower and projector of a VLM) byte for
    byte, and each trained tensor in the source's dtype (--export-dtype
    source|fp32|bf16).  This script:
      - loads EXPORT_DIR with transformers (AutoModelForCausalLM, eager
        attention, computed in float64), refusing missing / unexpected /
        mismatched keys, and checks that the class it built is config.json's
        architectures[0];
      - reads the safetensors headers and checks that config.json's dtype
        ("dtype" or "torch_dtype") is the dtype of the trained (text) tensors,
        or --expect-dtype when given;
      - with --source SRC_DIR (the model the run was trained from): every
        tensor of SRC_DIR is in the export (a tied lm_head aside), every one
        outside the text tower byte-identical with the same dtype, and every
        tokenizer / generation / chat-template / processor file of SRC_DIR
        copied byte for byte; with --lr0 (a run trained with --lr 0) the text
        tower too, up to the export's dtype (a bf16 export of fp32 weights
        must equal them rounded to nearest even, as torch's .to(bfloat16));
      - computes for each line of DATA.jsonl ({"input_ids": [ints]}) the
        per-token log-probs lp[t] = log_softmax(logits[t])[input_ids[t+1]],
        t = 0..S-2, and compares them with meshlm's output for the same data
        (MESHLM.jsonl, `meshlm logprobs --model EXPORT_DIR`: {"logprobs":
        [S-1 floats]} per line).  With --write FILE it records the HF
        log-probs in meshlm's JSONL format.

    CI NEVER RUNS THIS SCRIPT (CI has neither torch nor transformers); it needs
    `pip install torch transformers safetensors`.  CI's tests/cli/test_export.sh
    checks the same properties with meshlm's own tools.

USAGE
    python3 tools/export_check.py EXPORT_DIR DATA.jsonl MESHLM.jsonl
        [--source SRC_DIR [--lr0]] [--expect-dtype float32|bfloat16|float16]
        [--tol 1e-5] [--write FIXTURE.jsonl]

CHECKING A TRAINED EXPORT BY HAND
    build/meshlm logprobs --model HF_DIR --data DATA.jsonl --out lp.jsonl
    python3 tools/export_check.py HF_DIR DATA.jsonl lp.jsonl --source MODEL_DIR
    for HF_DIR from `meshlm export` or `meshlm train --model MODEL_DIR
    --export-hf`.  The VLM case: MODEL_DIR a Gemma3ForConditionalGeneration
    checkpoint (e.g. google/gemma-3-4b-it); the bf16 case: a bf16 source with
    the default --export-dtype source, or --export-dtype bf16 with
    --expect-dtype bfloat16.

TOLERANCE
    Here meshlm (fp32 compute of the exported weights) and HF (float64) score
    the same weights: --tol defaults to 1e-5 abs, a by-hand check; the CI
    tests use the derived bounds of tests/tolerance.h instead.
"""

import argparse
import fnmatch
import json
import os
import sys

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

# the files meshlm copies from the source (src/ckpt/hf_source.c k_patterns)
COPIED = ["tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
          "*.tiktoken", "spiece.model", "generation_config.json", "chat_template*",
          "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json"]
# the vision-language layouts' untrained towers (legacy and transformers 5 names)
OTHER_TOWERS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                "model.multi_modal_projector.")


def is_text(name):
    """A key of the text tower (what meshlm trains)."""
    return not name.startswith(OTHER_TOWERS)


SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
TORCH_NAMES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def weight_files(d):
    index = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return sorted({os.path.join(d, v) for v in json.load(f)["weight_map"].values()})
    return [os.path.join(d, "model.safetensors")]


def tensors(d):
    """{name: (dtype name, shape, raw tensor)} of a checkpoint directory."""
    out = {}
    for path in weight_files(d):
        with safe_open(path, framework="pt") as f:
            for k in f.keys():
                t = f.get_tensor(k)
                dt = next(n for n, v in SAFETENSORS_DTYPES.items() if v == t.dtype) \
                    if t.dtype in SAFETENSORS_DTYPES.values() else str(t.dtype)
                out[k] = (dt, tuple(t.shape), t)
    return out


def config_dtype(cfg):
    v = cfg.get("dtype", cfg.get("torch_dtype"))
    return TORCH_NAMES.get(v, v)


def check_dtypes(export, cfg, expect, problems):
    text = {dt for k, (dt, _, _) in export.items() if is_text(k)}
    want = TORCH_NAMES.get(expect, expect) if expect else config_dtype(cfg)
    print(f"trained tensors' dtypes {sorted(text)}, config.json dtype {config_dtype(cfg)}")
    if text != {want}:
        problems.append(f"trained tensors are {sorted(text)}, expected {want}")
    if expect and config_dtype(cfg) != want:
        problems.append(f"config.json says {config_dtype(cfg)}, expected {want}")


def check_source(export_dir, export, src_dir, cfg, lr0, problems):
    src = tensors(src_dir)
    tied = cfg.get("tie_word_embeddings", cfg.get("text_config", {}).get("tie_word_embeddings"))
    carried = same = 0
    for k, (dt, shape, t) in src.items():
        if k not in export:
            if not (tied and k.endswith("lm_head.weight")):
                problems.append(f"source tensor {k} missing from the export")
            continue
        edt, eshape, et = export[k]
        if eshape != shape:
            problems.append(f"{k}: shape {eshape} in the export, {shape} in the source")
        elif not is_text(k):
            carried += 1
            if edt != dt or not torch.equal(et.view(torch.uint8), t.view(torch.uint8)):
                problems.append(f"{k}: not carried over byte for byte ({edt} vs {dt})")
        elif lr0:
            want = t.to(SAFETENSORS_DTYPES[edt]) if edt in SAFETENSORS_DTYPES else t
            if not torch.equal(et.view(torch.uint8), want.view(torch.uint8)):
                problems.append(f"{k}: the export's {edt} tensor is not the source's {dt} tensor "
                                f"converted (round to nearest even)")
            same += 1
    extra = sorted(set(export) - set(src))
    if extra:
        problems.append(f"tensors not in the source: {extra[:5]}")
    files = [f for f in sorted(os.listdir(src_dir)) if any(fnmatch.fnmatch(f, p) for p in COPIED)]
    for f in files:
        a, b = os.path.join(src_dir, f), os.path.join(export_dir, f)
        if not os.path.exists(b) or open(a, "rb").read() != open(b, "rb").read():
            problems.append(f"{f}: not copied byte for byte")
    print(f"source {src_dir}: {carried} untrained tensors carried, {same} trained compared (--lr0), "
          f"{len(files)} files {files}")


def hf_logprobs(model, ids):
    x = torch.tensor([ids], dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=x).logits.double()
    lp = torch.log_softmax(logits[0, :-1], dim=-1)
    return lp.gather(-1, x[0, 1:, None])[:, 0].tolist()


def main():
    ap = argparse.ArgumentParser(description="HF transformers vs meshlm log-probs of an exported checkpoint.")
    ap.add_argument("export_dir")
    ap.add_argument("data_jsonl")
    ap.add_argument("meshlm_jsonl")
    ap.add_argument("--source", help="the model directory the run was trained from")
    ap.add_argument("--lr0", action="store_true", help="the run trained with --lr 0: trained tensors "
                    "must equal the source's, converted to the export's dtype")
    ap.add_argument("--expect-dtype", help="dtype of the trained tensors and config.json "
                    "(float32, bfloat16, float16); default: config.json's")
    ap.add_argument("--tol", type=float, default=1e-5, help="max abs difference allowed (default 1e-5)")
    ap.add_argument("--write", help="write HF's log-probs here (meshlm logprobs JSONL format)")
    args = ap.parse_args()

    problems = []
    with open(os.path.join(args.export_dir, "config.json")) as f:
        cfg = json.load(f)
    export = tensors(args.export_dir)
    check_dtypes(export, cfg, args.expect_dtype, problems)
    if args.source:
        check_source(args.export_dir, export, args.source, cfg, args.lr0, problems)

    model, info = AutoModelForCausalLM.from_pretrained(
        args.export_dir, dtype=torch.float64, attn_implementation="eager", output_loading_info=True)
    model.train(False)
    loading = {k: v for k, v in info.items() if v}
    if loading:
        problems.append(f"loading problems: {loading}")
    if type(model).__name__ != cfg["architectures"][0]:
        problems.append(f"transformers built a {type(model).__name__}, config.json says "
                        f"{cfg['architectures'][0]}")

    data, mine = read_jsonl(args.data_jsonl), read_jsonl(args.meshlm_jsonl)
    if len(data) != len(mine):
        sys.exit(f"{len(data)} data lines but {len(mine)} meshlm lines")
    worst, rows = 0.0, []
    for i, (d, m) in enumerate(zip(data, mine)):
        ref = hf_logprobs(model, d["input_ids"])
        got = m["logprobs"]
        if len(got) != len(ref):
            sys.exit(f"line {i + 1}: meshlm has {len(got)} log-probs, expected {len(ref)}")
        diff = max(abs(a - b) for a, b in zip(got, ref))
        worst = max(worst, diff)
        print(f"line {i + 1}: {len(ref)} tokens, mean lp {sum(ref) / len(ref):.6f}, max abs diff {diff:.3g}")
        rows.append(ref)
    print(f"{type(model).__name__}: max abs difference meshlm vs HF {worst:.3g} (tol {args.tol:g})")
    if args.write:
        with open(args.write, "w") as f:
            for ref in rows:
                f.write(json.dumps({"logprobs": [float(f"{v:.9g}") for v in ref]}) + "\n")
        print(f"wrote {args.write}")
    if worst > args.tol:
        problems.append(f"log-probs differ by {worst:.3g} > {args.tol:g}")
    for p in problems:
        print(f"PROBLEM: {p}")
    if problems:
        sys.exit(1)


if __name__ == "__main__":
    main()
