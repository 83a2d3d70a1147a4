#!/usr/bin/env python3
"""hf_check.py - check that a checkpoint directory loads in Hugging Face transformers.

PURPOSE
    Manual verification that checkpoints written by meshlm (`meshlm init`,
    `meshlm train --export-hf`) are valid transformers checkpoints: loads MODEL_DIR
    with AutoModelForCausalLM (float32, eager attention), reports the model
    class and parameter count, and prints the mean next-token loss and the
    first logprobs on a random (or given) input.

    Exits non-zero if loading reports missing / unexpected / mismatched keys
    (from output_loading_info=True) or if the loss is not finite.

    CI NEVER RUNS THIS SCRIPT (CI has neither torch nor transformers); it needs
    `pip install torch transformers safetensors`.

USAGE
    python3 tools/hf_check.py MODEL_DIR [--ids-json FILE] [--seq-len 24]
                              [--batch 2] [--seed 0] [--show 8] [--double]

    --ids-json FILE  JSON file holding either a list of ints (one row), a list
                     of rows, or an object with an "input_ids" key (e.g. a
                     fixture's expected.json).  Default: random ids.
"""

import argparse
import json
import math
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM


def load_ids(path):
    with open(path) as f:
        obj = json.load(f)
    if isinstance(obj, dict):
        obj = obj["input_ids"]
    if obj and isinstance(obj[0], int):
        obj = [obj]
    return torch.tensor(obj, dtype=torch.long)


def main():
    ap = argparse.ArgumentParser(description="Load a checkpoint with transformers and sanity-check it.")
    ap.add_argument("model_dir")
    ap.add_argument("--ids-json", help="JSON input ids (list, list of lists, or {'input_ids': ...})")
    ap.add_argument("--seq-len", type=int, default=24)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--show", type=int, default=8, help="how many logprobs of row 0 to print")
    ap.add_argument("--double", action="store_true", help="compute in float64 instead of float32")
    args = ap.parse_args()

    dtype = torch.float64 if args.double else torch.float32
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    model, info = AutoModelForCausalLM.from_pretrained(
        args.model_dir, dtype=dtype, attn_implementation="eager",
        output_loading_info=True)
    model.train(False)

    n_params = sum(p.numel() for p in model.parameters())
    cfg = model.config
    # composite (vision-language) configs nest the text model's settings
    text_cfg = cfg.get_text_config()
    print(f"class: {type(model).__name__}  model_type: {cfg.model_type}"
          + (f" (text model: {text_cfg.model_type})" if text_cfg is not cfg else ""))
    print(f"parameters: {n_params} (unique tensors: {len(list(model.parameters()))}), "
          f"tie_word_embeddings={getattr(cfg, 'tie_word_embeddings', None)}, vocab={text_cfg.vocab_size}")
    ok = True
    for k, v in info.items():
        if v:
            print(f"LOADING PROBLEM {k}: {v}")
            ok = False

    if args.ids_json:
        ids = load_ids(args.ids_json)
    else:
        g = torch.Generator().manual_seed(args.seed)
        ids = torch.randint(0, text_cfg.vocab_size, (args.batch, args.seq_len), generator=g)
    if int(ids.max()) >= text_cfg.vocab_size or int(ids.min()) < 0:
        sys.exit(f"input ids out of range for vocab {text_cfg.vocab_size}")

    with torch.no_grad():
        logits = model(input_ids=ids).logits
    lp = torch.log_softmax(logits[:, :-1].double(), dim=-1)
    lp = lp.gather(-1, ids[:, 1:, None])[..., 0]
    loss = -lp.mean().item()
    print(f"input: {tuple(ids.shape)}  mean loss: {loss:.8f}  (ln vocab = {math.log(text_cfg.vocab_size):.4f})")
    print("first logprobs (row 0):", [round(x, 6) for x in lp[0, :args.show].tolist()])
    if not math.isfinite(loss):
        print("loss is not finite")
        ok = False
    if not ok:
        sys.exit(1)
    print("OK")


if __name__ == "__main__":
    main()
