#!/usr/bin/env python3
"""Write the issue-34 benchmark's Qwen3-MoE model (~139M parameters) with transformers.

A Qwen3MoeForCausalLM of the shape issue 34 asks for ("a Qwen3-MoE-shaped model
of ~100-200M total parameters, 8-16 experts, top-2"), randomly initialised by
transformers (its _init_weights, seed 0) and saved with save_pretrained (fp32,
the per-expert layout meshlm reads):

  hidden 512, 8 layers (all sparse), 8 heads of 64 with 2 KV heads (q/k norms),
  16 experts of moe_intermediate_size 512, top 2, norm_topk_prob true (as the
  released Qwen3-MoE checkpoints), no load-balancing term (output_router_logits
  false), vocab 32000, untied embeddings, max_position_embeddings 4096.

Prints one line with the total parameter count and the active one per token
(embeddings, attention, norms, the router and top_k of the experts per layer,
lm_head), counted from the model's tensors.

usage: bench/moe_model.py --out DIR
"""
import argparse


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="output directory (config.json + model.safetensors)")
    a = p.parse_args()
    import torch
    import transformers
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=64, intermediate_size=1536,
                         moe_intermediate_size=512, num_experts=16, num_experts_per_tok=2,
                         norm_topk_prob=True, output_router_logits=False, vocab_size=32000,
                         tie_word_embeddings=False, max_position_embeddings=4096,
                         use_sliding_window=False, mlp_only_layers=[], decoder_sparse_step=1)
    model = Qwen3MoeForCausalLM(cfg).to(torch.float32)
    model.config.dtype = torch.float32
    model.save_pretrained(a.out)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - experts + experts * cfg.num_experts_per_tok // cfg.num_experts
    print(f"moe_model: wrote {a.out}: Qwen3-MoE, {total / 1e6:.1f}M parameters in all, "
          f"{active / 1e6:.1f}M active per token ({cfg.num_experts} experts, top "
          f"{cfg.num_experts_per_tok}; experts {experts / 1e6:.1f}M)")


if __name__ == "__main__":
    main()
