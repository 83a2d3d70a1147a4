#!/usr/bin/env python3
"""gen_fixtures.py - generate the Hugging Face reference fixtures for meshlm tests.

PURPOSE
    meshlm must reproduce Hugging Face transformers numerically.  This script
    builds tiny random models with transformers, saves them exactly as
    `save_pretrained(dir, safe_serialization=True)` writes them (float32), and
    records a float64 reference (logprobs, loss, parameter gradients) that the
    C tests compare against.

    CI NEVER RUNS THIS SCRIPT (CI has neither torch nor transformers).  It is
    run once by hand on a machine with `pip install torch transformers
    safetensors` and its output under tests/fixtures/ is committed.

USAGE
    python3 tools/gen_fixtures.py --out tests/fixtures [--only NAME ...]

OUTPUT (one directory per fixture NAME under --out)
    NAME/config.json         as written by save_pretrained (float32 model)
    NAME/model.safetensors   as written by save_pretrained (float32 weights)
    NAME/grads.safetensors   d loss / d param for every named parameter that
                             receives a gradient, under the name it has in
                             model.safetensors (e.g. model.layers.0.self_attn.
                             q_proj.weight), computed in float64, stored as
                             float32.  For tied models there is no
                             lm_head.weight entry: the embedding gradient
                             contains both uses.
    NAME/expected.json       {"input_ids": [[S ints] x B],
                              "loss_mask": [[S 0/1] x B]   (only if masked),
                              "loss": float,
                              "logprobs": [[S-1 floats] x B],
                              "text_prefix": str           (only gemma3_vlm)}

FIXTURES
    llama_tied     LlamaForCausalLM, tied, llama3 rope scaling, vocab 256
    llama_untied   LlamaForCausalLM, untied, linear rope factor 2, vocab 300
    qwen2          Qwen2ForCausalLM, qkv biases, untied, vocab 301, loss mask
    qwen3          Qwen3ForCausalLM, q_norm/k_norm (RMSNorm over head_dim,
                   before RoPE), no biases, tied, rope_theta 1e6, vocab 302,
                   loss mask
    gemma3         Gemma3ForCausalLM (model_type gemma3_text), tied, vocab 256,
                   layer_types [sliding_attention, full_attention] with
                   sliding_window 8 (< S), full layers rope_theta 1e6 + linear
                   factor 2, sliding layers rope_theta 1e4 unscaled,
                   query_pre_attn_scalar 24 (!= head_dim 16), gelu_pytorch_tanh,
                   no softcapping.  Input ids avoid pad_token_id 0.
    gemma3_vlm     Gemma3ForConditionalGeneration: the gemma3 text config under
                   text_config plus a 1-layer SigLIP vision tower (hidden 16,
                   image 28, patch 14, no head) and mm_tokens_per_image 4;
                   boi/eoi/image token ids 253/254/255.  Text-only inputs (no
                   pixel_values) drawn from 1..252, so neither pad 0 nor the
                   image/boi/eoi ids occur.

    llama_h9kv3    LlamaForCausalLM with SmolLM2-135M's head grouping: 9 heads,
                   3 KV heads, head_dim 8, hidden 72, tied, vocab 256 (tp 2
                   and 4 split the heads unevenly and share kv heads)
    gemma3_h4kv1   the gemma3 config with Gemma-3-270M's grouping: 4 heads,
                   1 KV head (every tp > 1 replicates it)

    mistral        MistralForCausalLM, untied, sliding_window 8 (< S) on every
                   layer, head_dim from hidden/heads, vocab 257, loss mask
    llama_yarn     LlamaForCausalLM, untied, vocab 258, rope_parameters yarn:
                   factor 4, original_max_position_embeddings 16 (< S),
                   max_position_embeddings 64, beta_fast 8, beta_slow 0.5,
                   truncate false (a fractional ramp), attention_factor from
                   the default formula (0.1 ln 4 + 1)
    llama_dynamic  LlamaForCausalLM, tied, vocab 259, rope_parameters dynamic
                   factor 2 with max_position_embeddings 16 (< S): transformers'
                   dynamic_rope_update recomputes inv_freq for seq_len
                   max(position_ids) + 1 = S = 24 (NTK base scaling)
    llama_longrope LlamaForCausalLM, untied, vocab 261, rope_parameters
                   longrope: short/long factors of head_dim/2 in [1, 1.5] /
                   [1, 2], original_max_position_embeddings 16 (< S, so the
                   long factors), max_position_embeddings 64, no factor and no
                   attention_factor (both from the defaults: 64/16, then
                   sqrt(1 + ln 4 / ln 16))
    qwen3_moe      Qwen3MoeForCausalLM, 3 layers: layer 0 dense (mlp_only_layers,
                   intermediate 64), layers 1-2 sparse: 8 experts of 16, top 2,
                   norm_topk_prob true; output_router_logits true with
                   router_aux_loss_coef 0.25, so loss and gradients include
                   0.25 x load_balancing_loss_func (expected.json also gives
                   "aux_loss"); hidden 32, head_dim 8, tied, vocab 303, mask
    mixtral        MixtralForCausalLM, 2 sparse layers of 4 experts (w1/w3/w2,
                   intermediate 32), top 2 (always renormalized),
                   sliding_window 8 (< S), no aux term, untied, vocab 262
    qwen3_moe_window  Qwen3MoeForCausalLM, 2 layers: decoder_sparse_step 2 (layer
                   0 dense, intermediate 32; layer 1 sparse: 4 experts of 16,
                   top 2), norm_topk_prob false, use_sliding_window with
                   sliding_window 8 (< S) on every layer, no aux term, untied,
                   vocab 264, mask
                   Both: the router's top-k has a margin of 1e-4 on every token
                   (checked), and save_pretrained writes the experts one by one
                   (mlp.experts.N.gate_proj.weight, block_sparse_moe.experts.
                   N.w1.weight), the names grads.safetensors uses.
    qwen2_moe      Qwen2MoeForCausalLM, 2 layers: layer 0 dense (mlp_only_layers,
                   intermediate 48), layer 1 sparse: 8 experts of 16, top 2,
                   norm_topk_prob false (Qwen2-MoE's default), a shared expert
                   of 24 (shared_expert_intermediate_size) gated by
                   sigmoid(shared_expert_gate); q/k/v biases (qkv_bias),
                   output_router_logits true with router_aux_loss_coef 0.25,
                   untied, vocab 305, mask
    qwen3_moe_b4, mixtral_b4  qwen3_moe and mixtral with B=4 (other seeds):
                   four data-parallel ranks hold one sequence each (expert
                   parallelism over 4 ranks: tests/mpi/CMakeLists.txt)

    phi3           Phi3ForCausalLM (fused self_attn.qkv_proj and
                   mlp.gate_up_proj in the checkpoint), untied, vocab 260,
                   rope longrope as llama_longrope's (its own factors) with
                   Phi-3's top-level original_max_position_embeddings 16,
                   max_position_embeddings 64, partial_rotary_factor 1.0

    All other sizes: hidden 64, intermediate 160, 2 layers, 4 heads, 2 KV
    heads, head_dim 16; B=2, S=24.

ROPE NOTES (transformers 5.23 modeling_rope_utils.py)
    The fixtures with a RoPE that depends on the forward's length (dynamic,
    longrope) are checked when generating: after the reference forward the
    rotary embedding's inv_freq is the one computed for seq_len = S (dynamic:
    base * (factor * S / max_position_embeddings - (factor - 1)) ** (hd /
    (hd - 2)); longrope: 1 / (long_factor * base ** (2i / hd))), and yarn's
    attention scaling is the default formula's.

DEFINITIONS (hold exactly, in float64)
    logprobs[b][t] = log_softmax(logits[b, t])[input_ids[b][t+1]], t = 0..S-2
    loss = mean over all (b, t), t in 0..S-2, with (no mask or
           loss_mask[b][t+1] == 1), of -logprobs[b][t]
    i.e. HF labels = input_ids with -100 where the mask is 0, standard shift,
    mean reduction over non-ignored targets across the whole batch; for a
    config with output_router_logits (qwen3_moe) plus router_aux_loss_coef x
    load_balancing_loss_func(router logits of every sparse layer, no
    attention mask), as *ForCausalLM.forward adds it (checked against HF's
    own loss with labels).

    The reference is computed by reloading the saved checkpoint with
    from_pretrained(dtype=float64, attn_implementation="eager"), so the
    expected values correspond bit-for-bit to the committed float32 weights.
    (HF computes some pieces in float32 even then: RoPE inv_freq/angles/
    cos/sin, the RMSNorm normalisation (Gemma3: the whole norm incl. 1 + w)
    and the attention softmax; the logprobs therefore differ from an all-
    float64 evaluation by up to ~5e-7.)

    Weights are re-initialised with a larger scale than HF's default 0.02 so
    that logits are far from uniform: linear/embedding weights ~ N(0, 0.1^2),
    norm weights 1 + 0.1*N(0,1), biases 0.1*N(0,1).  Exception: Gemma3RMSNorm
    computes x_hat * (1 + w), so its weights (input_layernorm,
    post_attention_layernorm, pre_feedforward_layernorm,
    post_feedforward_layernorm, self_attn.q_norm/k_norm, model.norm, and the
    projector's mm_soft_emb_norm) are 0.1*N(0,1), i.e. scale 1 + 0.1*N(0,1).
    Qwen3's q_norm/k_norm are plain RMSNorms (1 + 0.1*N(0,1)).

GEMMA3 NOTES (transformers 5.x modeling_gemma3.py)
    - embeddings are multiplied by sqrt(hidden_size) = 8 (exact here);
      the lm_head (tied) uses the unscaled embedding matrix
    - attention scores are scaled by query_pre_attn_scalar**-0.5 = 24**-0.5,
      not head_dim**-0.5; q_norm/k_norm are applied per head before RoPE
    - sliding layers: query i attends key j iff 0 <= i - j < sliding_window
      (i.e. the window holds sliding_window keys including i itself)
    - each layer: x += post_attention_layernorm(attn(input_layernorm(x)));
      x += post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))
    - config.json records rope_parameters per layer type:
      {"full_attention": {...}, "sliding_attention": {...}}

GEMMA3_VLM NOTES
    save_pretrained writes the original Hub layout, not the module names:
    model.language_model.X is stored as language_model.model.X,
    model.vision_tower.X as vision_tower.X, model.multi_modal_projector.X as
    multi_modal_projector.X (from_pretrained maps them back).  grads.safetensors
    uses the stored names and holds only the text tower (every tensor whose
    name starts with expected.json's "text_prefix" = "language_model.model.";
    lm_head is tied): the vision tower and projector get no gradient from
    text-only inputs and have no entry.  The text tower alone, run as a
    Gemma3ForCausalLM, reproduces the logits (checked when generating).
"""

import argparse
import copy
import json
import math
import os
import shutil
import sys

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import (AutoModelForCausalLM, Gemma3Config,
                          Gemma3ForCausalLM, Gemma3ForConditionalGeneration,
                          Gemma3TextConfig, LlamaConfig, LlamaForCausalLM,
                          MistralConfig, MistralForCausalLM, MixtralConfig,
                          MixtralForCausalLM, Phi3Config, Phi3ForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM, Qwen2MoeConfig,
                          Qwen2MoeForCausalLM, SiglipVisionConfig)
from transformers.core_model_loading import revert_weight_conversion
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

B, S = 2, 24

LLAMA_BASE = dict(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=256,
    attention_bias=False,
    mlp_bias=False,
)

GEMMA3_TEXT = dict(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    query_pre_attn_scalar=24,          # deliberately != head_dim
    sliding_window=8,                  # < S, so the window matters
    layer_types=["sliding_attention", "full_attention"],
    rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0,
                           "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
    hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    final_logit_softcapping=None,
    attn_logit_softcapping=None,
    attention_bias=False,
)

# the mixture-of-experts fixtures' attention (narrower than LLAMA_BASE so the
# experts fit the size budget: < 600 KB a fixture)
MOE_SMALL = dict(
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
)

# a sparse layer's k-th and (k+1)-th router probabilities differ by at least
# this in the float64 reference, so that meshlm's fp32 routing (rounding
# ~1e-7) picks the same experts
ROUTER_MARGIN = 1e-4

# the sizes of LLAMA_BASE without its RoPE and length keys (Mistral, Phi-3)
SMALL = {k: LLAMA_BASE[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                     "num_attention_heads", "num_key_value_heads",
                                     "rms_norm_eps")}


def longrope_factors(seed):
    """short_factor in [1, 1.5], long_factor in [1, 2], head_dim/2 each, 3 decimals."""
    g = torch.Generator().manual_seed(seed)
    half = LLAMA_BASE["head_dim"] // 2
    short = (1.0 + 0.5 * torch.rand(half, generator=g, dtype=torch.float64)).tolist()
    long = (1.0 + torch.rand(half, generator=g, dtype=torch.float64)).tolist()
    return [round(x, 3) for x in short], [round(x, 3) for x in long]


# ids the gemma3_vlm fixture reserves at the top of its 256-token vocabulary
GEMMA3_VLM_BOI, GEMMA3_VLM_EOI, GEMMA3_VLM_IMAGE = 253, 254, 255

FIXTURES = [
    dict(
        name="llama_tied",
        cls=LlamaForCausalLM,
        config=lambda: LlamaConfig(
            **LLAMA_BASE,
            vocab_size=256,
            tie_word_embeddings=True,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        seed=1001,
        mask=False,
    ),
    dict(
        name="llama_untied",
        cls=LlamaForCausalLM,
        config=lambda: LlamaConfig(
            **LLAMA_BASE,
            vocab_size=300,
            tie_word_embeddings=False,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
        ),
        seed=1002,
        mask=False,
    ),
    dict(
        name="qwen2",
        cls=Qwen2ForCausalLM,
        config=lambda: Qwen2Config(
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=301,
            tie_word_embeddings=False,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            use_sliding_window=False,
        ),
        seed=1003,
        mask=True,
    ),
    dict(
        name="qwen3",
        cls=Qwen3ForCausalLM,
        config=lambda: Qwen3Config(
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=302,
            tie_word_embeddings=True,
            attention_bias=False,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            use_sliding_window=False,
        ),
        seed=1004,
        mask=True,
    ),
    dict(
        name="gemma3",
        cls=Gemma3ForCausalLM,
        config=lambda: Gemma3TextConfig(**copy.deepcopy(GEMMA3_TEXT)),
        seed=1005,
        mask=False,
        gemma=True,
        # 0 is pad_token_id: nn.Embedding(padding_idx=0) drops its lookup gradient
        id_range=(1, 256),
    ),
    dict(
        name="gemma3_vlm",
        cls=Gemma3ForConditionalGeneration,
        config=lambda: Gemma3Config(
            text_config=Gemma3TextConfig(**copy.deepcopy(GEMMA3_TEXT)),
            vision_config=SiglipVisionConfig(
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=28,
                patch_size=14,
                vision_use_head=False,
            ),
            mm_tokens_per_image=4,
            boi_token_index=GEMMA3_VLM_BOI,
            eoi_token_index=GEMMA3_VLM_EOI,
            image_token_index=GEMMA3_VLM_IMAGE,
            tie_word_embeddings=True,
        ),
        seed=1006,
        mask=False,
        gemma=True,
        # excludes pad 0 and boi/eoi/image 253..255
        id_range=(1, GEMMA3_VLM_BOI),
        # prefix of the text tower in model.safetensors / grads.safetensors
        # (save_pretrained writes the original Hub layout, see the docstring)
        text_prefix="language_model.model.",
    ),
    dict(
        name="llama_h9kv3",
        cls=LlamaForCausalLM,
        config=lambda: LlamaConfig(
            **{**LLAMA_BASE, "hidden_size": 72, "num_attention_heads": 9,
               "num_key_value_heads": 3, "head_dim": 8},
            vocab_size=256,
            tie_word_embeddings=True,
        ),
        seed=1007,
        mask=False,
    ),
    dict(
        name="gemma3_h4kv1",
        cls=Gemma3ForCausalLM,
        config=lambda: Gemma3TextConfig(
            **{**copy.deepcopy(GEMMA3_TEXT), "num_key_value_heads": 1}),
        seed=1008,
        mask=False,
        gemma=True,
        id_range=(1, 256),
    ),
    dict(
        name="mistral",
        cls=MistralForCausalLM,
        config=lambda: MistralConfig(
            **SMALL,
            vocab_size=257,
            sliding_window=8,          # < S, so the window matters; every layer
            tie_word_embeddings=False,
            max_position_embeddings=256,
        ),
        seed=1009,
        mask=True,
        window=8,
    ),
    dict(
        name="llama_yarn",
        cls=LlamaForCausalLM,
        config=lambda: LlamaConfig(
            **{**LLAMA_BASE, "max_position_embeddings": 64},
            vocab_size=258,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 16, "beta_fast": 8.0,
                             "beta_slow": 0.5, "truncate": False},
        ),
        seed=1010,
        mask=False,
    ),
    dict(
        name="llama_dynamic",
        cls=LlamaForCausalLM,
        config=lambda: LlamaConfig(
            **{**LLAMA_BASE, "max_position_embeddings": 16},   # < S: the NTK scaling applies
            vocab_size=259,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
        ),
        seed=1011,
        mask=False,
    ),
    dict(
        name="llama_longrope",
        cls=LlamaForCausalLM,
        config=lambda: LlamaConfig(
            **{**LLAMA_BASE, "max_position_embeddings": 64},
            vocab_size=261,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                             "short_factor": longrope_factors(1012)[0],
                             "long_factor": longrope_factors(1012)[1],
                             "original_max_position_embeddings": 16},
        ),
        seed=1012,
        mask=True,
    ),
    dict(
        name="phi3",
        cls=Phi3ForCausalLM,
        config=lambda: Phi3Config(
            **SMALL,
            vocab_size=260,
            tie_word_embeddings=False,
            max_position_embeddings=64,
            original_max_position_embeddings=16,   # Phi-3 keeps it top-level
            partial_rotary_factor=1.0,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                             "short_factor": longrope_factors(1013)[0],
                             "long_factor": longrope_factors(1013)[1]},
            pad_token_id=None,         # Phi3Config's 32000 is outside the vocabulary
            eos_token_id=2,            # likewise its eos 32000
            sliding_window=None,
        ),
        seed=1013,
        mask=False,
    ),
    dict(
        name="qwen3_moe",
        cls=Qwen3MoeForCausalLM,
        config=lambda: Qwen3MoeConfig(
            **MOE_SMALL,
            num_hidden_layers=3,
            intermediate_size=64,      # the dense layer's MLP
            moe_intermediate_size=16,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[0],       # layer 0 dense, layers 1 and 2 sparse
            output_router_logits=True,  # the aux term joins the loss
            router_aux_loss_coef=0.25,  # large, so the aux gradient is visible
            vocab_size=303,
            tie_word_embeddings=True,
            rope_theta=1000000.0,
            use_sliding_window=False,
        ),
        seed=1019,
        mask=True,
        moe=True,
    ),
    dict(
        name="mixtral",
        cls=MixtralForCausalLM,
        config=lambda: MixtralConfig(
            **MOE_SMALL,
            num_hidden_layers=2,
            intermediate_size=32,      # each expert's
            num_local_experts=4,
            num_experts_per_tok=2,
            output_router_logits=False,
            vocab_size=262,
            tie_word_embeddings=False,
            sliding_window=8,          # < S: every layer slides
            bos_token_id=1,
            eos_token_id=2,
        ),
        seed=1015,
        mask=False,
        moe=True,
        window=8,
    ),
    dict(
        name="qwen2_moe",
        cls=Qwen2MoeForCausalLM,
        config=lambda: Qwen2MoeConfig(
            **MOE_SMALL,
            num_hidden_layers=2,
            intermediate_size=48,      # the dense layer's MLP
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,      # Qwen2-MoE's default: the top-k probabilities as they are
            mlp_only_layers=[0],       # layer 0 dense, layer 1 sparse
            qkv_bias=True,
            output_router_logits=True,  # the aux term joins the loss
            router_aux_loss_coef=0.25,  # large, so the aux gradient is visible
            vocab_size=305,
            tie_word_embeddings=False,
            use_sliding_window=False,
        ),
        seed=1024,
        mask=True,
        moe=True,
    ),
    dict(
        name="qwen3_moe_window",
        cls=Qwen3MoeForCausalLM,
        config=lambda: Qwen3MoeConfig(
            **MOE_SMALL,
            num_hidden_layers=2,
            intermediate_size=32,      # the dense layer's MLP
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=False,      # the top-k probabilities as they are
            decoder_sparse_step=2,     # layer 0 dense, layer 1 sparse
            output_router_logits=False,
            vocab_size=264,
            tie_word_embeddings=False,
            use_sliding_window=True,
            sliding_window=8,          # < S: every layer slides
        ),
        seed=1020,
        mask=True,
        moe=True,
        window=8,
    ),
]


def reinit_(model, gen, gemma=False):
    """Write larger-scale random values into every (unique) parameter.

    gemma=True: Gemma3RMSNorm computes x_hat * (1 + w), so its weights get
    0.1*N(0,1) (scale 1 + w ~ 1 + 0.1*N(0,1), like the other families); the
    name test is not used for them.  Other parameters as without gemma.
    """
    gemma_norms = set()
    if gemma:
        for mname, mod in model.named_modules():
            if isinstance(mod, Gemma3RMSNorm):
                gemma_norms.add(mname + ".weight")
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if name in gemma_norms:
                val = 0.1 * noise
            elif name.endswith("norm.weight"):
                val = 1.0 + 0.1 * noise
            elif name.endswith(".bias"):
                val = 0.1 * noise
            else:
                val = 0.1 * noise
            p.copy_(val.to(p.dtype))


def save_model(model, out_dir):
    try:
        model.save_pretrained(out_dir, safe_serialization=True)
    except TypeError:
        # newer transformers dropped the argument (safetensors is the only format)
        model.save_pretrained(out_dir)


def check_norm_init(fx, model):
    """Every text-tower norm weight (incl. q_norm/k_norm) got the reinit."""
    gemma = fx.get("gemma", False)
    n = 0
    for pname, p in model.named_parameters():
        if not pname.endswith("norm.weight") or ".vision_tower." in pname:
            continue
        if "multi_modal_projector" in pname:
            continue
        centre = 0.0 if gemma else 1.0
        assert abs(p.mean().item() - centre) < 0.3 and p.std().item() > 0.01, pname
        n += 1
    cfg = model.config.get_text_config()
    if gemma:    # input, post_attention, pre/post_feedforward, q_norm, k_norm
        per_layer = 6
    elif fx["cls"] in (Qwen3ForCausalLM, Qwen3MoeForCausalLM):  # input, post_attention, q/k_norm
        per_layer = 4
    else:        # input, post_attention
        per_layer = 2
    want = cfg.num_hidden_layers * per_layer + 1
    assert n == want, (fx["name"], n, want)


def window_loss(fx, out_dir, ref, input_ids, window):
    """The fixture's unmasked mean loss with the config's sliding_window replaced."""
    cfg = type(ref.config).from_pretrained(out_dir)
    cfg.get_text_config().sliding_window = window
    moe_kw = {"experts_implementation": "eager"} if fx.get("moe") else {}
    wide = fx["cls"].from_pretrained(out_dir, config=cfg, dtype=torch.float64,
                                     attn_implementation="eager", **moe_kw)
    with torch.no_grad():
        wl = wide(input_ids=input_ids).logits
    lsm = torch.log_softmax(wl[:, :-1, :], dim=-1)
    return -lsm.gather(-1, input_ids[:, 1:].unsqueeze(-1)).mean().item()


def check_gemma3(fx, out_dir, ref, input_ids, loss):
    """Gemma3 fixtures: config round trip, rope / scaling / window semantics."""
    is_vlm = fx["cls"] is Gemma3ForConditionalGeneration
    with open(os.path.join(out_dir, "config.json")) as f:
        cj = json.load(f)
    tj = cj["text_config"] if is_vlm else cj
    assert tj["layer_types"] == GEMMA3_TEXT["layer_types"], tj["layer_types"]
    assert tj["sliding_window"] == GEMMA3_TEXT["sliding_window"]
    assert tj["query_pre_attn_scalar"] == GEMMA3_TEXT["query_pre_attn_scalar"]
    rp = tj["rope_parameters"]
    assert rp["full_attention"] == {"rope_type": "linear", "factor": 2.0,
                                    "rope_theta": 1000000.0}, rp
    assert rp["sliding_attention"] == {"rope_type": "default",
                                       "rope_theta": 10000.0}, rp

    lm = ref.model.language_model if is_vlm else ref.model
    hd = GEMMA3_TEXT["head_dim"]
    k = torch.arange(0, hd, 2, dtype=torch.float64) / hd
    want_local = 1.0 / (10000.0 ** k)
    want_global = 1.0 / (1000000.0 ** k) / 2.0
    got_local = lm.rotary_emb.sliding_attention_inv_freq.double()
    got_global = lm.rotary_emb.full_attention_inv_freq.double()
    assert torch.allclose(got_local, want_local, rtol=1e-6, atol=0), got_local
    assert torch.allclose(got_global, want_global, rtol=1e-6, atol=0), got_global
    assert lm.rotary_emb.sliding_attention_attention_scaling == 1.0
    assert lm.rotary_emb.full_attention_attention_scaling == 1.0
    for layer in lm.layers:
        assert layer.self_attn.scaling == GEMMA3_TEXT["query_pre_attn_scalar"] ** -0.5
    assert float(lm.embed_tokens.embed_scale) == GEMMA3_TEXT["hidden_size"] ** 0.5

    # attention pattern: layer 0 sliding, layer 1 full causal
    with torch.no_grad():
        out = ref(input_ids=input_ids, output_attentions=True)
    W = GEMMA3_TEXT["sliding_window"]
    i = torch.arange(S)[:, None]
    j = torch.arange(S)[None, :]
    allowed = {"sliding_attention": (j <= i) & (i - j < W),
               "full_attention": j <= i}
    for li, lt in enumerate(GEMMA3_TEXT["layer_types"]):
        nz = out.attentions[li] > 0  # [B, H, S, S]
        assert torch.equal(nz, allowed[lt].expand_as(nz)), (li, lt)

    # the window changes the result
    wide_loss = window_loss(fx, out_dir, ref, input_ids, 64)
    assert abs(wide_loss - loss) > 1e-4 * abs(loss), (wide_loss, loss)

    if is_vlm:
        # token_type_ids of zeros (text only) change nothing
        with torch.no_grad():
            a = ref(input_ids=input_ids).logits
            b = ref(input_ids=input_ids, token_type_ids=torch.zeros_like(input_ids)).logits
        assert torch.equal(a, b)
        # the text tower alone, as a Gemma3ForCausalLM, gives the same logits
        text = Gemma3ForCausalLM(ref.config.get_text_config()).to(torch.float64)
        sd = {kk[len("model.language_model."):]: v
              for kk, v in ref.state_dict().items()
              if kk.startswith("model.language_model.")}
        missing, unexpected = text.model.load_state_dict(sd, strict=False)
        assert not unexpected and all(m.endswith("inv_freq") or m.endswith("embed_scale")
                                      for m in missing), (missing, unexpected)
        text.tie_weights()
        assert text.lm_head.weight.data_ptr() == text.model.embed_tokens.weight.data_ptr()
        text.train(False)
        with torch.no_grad():
            c = text(input_ids=input_ids).logits
        assert torch.allclose(a, c, rtol=0, atol=1e-12), (a - c).abs().max()
    return wide_loss


def check_window(fx, out_dir, ref, input_ids):
    """Mistral: every layer attends to the last `window` keys; the window matters."""
    W = fx["window"]
    assert ref.config.sliding_window == W
    with torch.no_grad():
        out = ref(input_ids=input_ids, output_attentions=True)
        logits = out.logits
    i = torch.arange(S)[:, None]
    j = torch.arange(S)[None, :]
    for att in out.attentions:
        nz = att > 0
        assert torch.equal(nz, ((j <= i) & (i - j < W)).expand_as(nz))
    lsm = torch.log_softmax(logits[:, :-1, :], dim=-1)
    loss = -lsm.gather(-1, input_ids[:, 1:].unsqueeze(-1)).mean().item()
    wide = window_loss(fx, out_dir, ref, input_ids, 64)
    assert abs(wide - loss) > 1e-4 * abs(loss), (wide, loss)
    return wide


def check_rope(ref):
    """The RoPE the reference ran with, recomputed here in float64 from
    modeling_rope_utils' formulas for seq_len = S (see ROPE NOTES)."""
    cfg = ref.config
    rp = cfg.rope_parameters
    rope = ref.model.rotary_emb
    hd = cfg.hidden_size // cfg.num_attention_heads
    k = torch.arange(0, hd, 2, dtype=torch.float64) / hd
    base = rp["rope_theta"]
    kind = rp["rope_type"]
    if kind == "dynamic":
        M = cfg.max_position_embeddings
        assert S > M
        base = base * (rp["factor"] * S / M - (rp["factor"] - 1)) ** (hd / (hd - 2))
        want, scale = 1.0 / base ** k, 1.0
    elif kind == "longrope":
        orig = rp["original_max_position_embeddings"]
        assert S > orig and orig == 16, rp
        want = 1.0 / (torch.tensor(rp["long_factor"], dtype=torch.float64) * base ** k)
        factor = cfg.max_position_embeddings / orig
        scale = math.sqrt(1 + math.log(factor) / math.log(orig))
    elif kind == "yarn":
        want = None  # the ramp: checked by meshlm's parity with the reference
        scale = 0.1 * math.log(rp["factor"]) + 1.0
    else:
        return
    if want is not None:
        got = rope.inv_freq.double()
        assert torch.allclose(got, want, rtol=1e-6, atol=0), (kind, got, want)
    assert abs(rope.attention_scaling - scale) < 1e-12, (kind, rope.attention_scaling, scale)


def check_router_margin(name, router_logits, k):
    """Every token's k-th and (k+1)-th router probabilities of every sparse
    layer differ by at least ROUTER_MARGIN (see there)."""
    for layer, lg in enumerate(router_logits):
        top = torch.topk(torch.softmax(lg.double(), dim=-1), k + 1, dim=-1).values
        gap = (top[:, k - 1] - top[:, k]).min().item()
        if gap < ROUTER_MARGIN:
            sys.exit(f"{name}: sparse layer {layer}: top-{k} probability gap {gap:.2e} "
                     f"< {ROUTER_MARGIN}; pick another seed")


# Four sequences of the MoE fixtures: one per rank of a 4-rank data-parallel mesh.
FIXTURES += [
    dict(next(f for f in FIXTURES if f["name"] == base), name=base + "_b4", seed=seed, batch=4)
    for base, seed in (("qwen3_moe", 1023), ("mixtral", 1022))
]


def make_fixture(fx, out_root):
    name = fx["name"]
    out_dir = os.path.join(out_root, name)
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)

    torch.manual_seed(fx["seed"])
    gen = torch.Generator().manual_seed(fx["seed"])
    gemma = fx.get("gemma", False)
    text_prefix = fx.get("text_prefix")

    # ---- float32 model, re-initialised, saved -------------------------------
    config = fx["config"]()
    model = fx["cls"](config).to(torch.float32)
    reinit_(model, gen, gemma=gemma)
    check_norm_init(fx, model)
    model.config.dtype = torch.float32  # recorded in config.json
    save_model(model, out_dir)
    text_config = config.get_text_config()
    vocab = text_config.vocab_size

    # ---- inputs ---------------------------------------------------------------
    lo, hi = fx.get("id_range", (0, vocab))
    assert 0 <= lo < hi <= vocab
    nb = fx.get("batch", B)
    input_ids = torch.randint(lo, hi, (nb, S), generator=gen)
    if gemma:
        special = {text_config.pad_token_id}
        if fx["cls"] is Gemma3ForConditionalGeneration:
            special |= {config.image_token_id, config.boi_token_id, config.eoi_token_id}
        assert not any(int(t) in special for t in input_ids.flatten()), special
    loss_mask = None
    if fx["mask"]:
        loss_mask = (torch.rand((nb, S), generator=gen) < 0.7).long()
        loss_mask[:, 0] = 0
        assert int(loss_mask[:, 1:].sum()) > 0

    # ---- float64 eager reference from the saved checkpoint ------------------
    # the experts' loop over tokens (their default grouped_mm takes no float64)
    moe_kw = {"experts_implementation": "eager"} if fx.get("moe") else {}
    ref, info = AutoModelForCausalLM.from_pretrained(
        out_dir, dtype=torch.float64, attn_implementation="eager",
        output_loading_info=True, **moe_kw)
    bad = {k: v for k, v in info.items() if v}
    if bad:
        sys.exit(f"{name}: loading info not clean: {bad}")
    assert type(ref) is fx["cls"], type(ref)
    ref.train(False)  # dropout is 0 anyway; keep things deterministic
    ref.zero_grad(set_to_none=True)

    moe = fx.get("moe", False)
    out = ref(input_ids=input_ids, output_router_logits=moe)
    logits = out.logits  # [B, S, V] float64
    assert logits.dtype == torch.float64
    if moe:
        check_router_margin(name, out.router_logits, text_config.num_experts_per_tok)
    lsm = torch.log_softmax(logits[:, :-1, :], dim=-1)
    tgt = input_ids[:, 1:]
    logprobs = lsm.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)  # [B, S-1]
    if loss_mask is None:
        sel = torch.ones_like(tgt, dtype=torch.bool)
    else:
        sel = loss_mask[:, 1:].bool()
    loss = -(logprobs[sel]).sum() / sel.sum()
    aux = None
    if moe and text_config.output_router_logits:
        # transformers' load_balancing_loss_func over every sparse layer, no
        # attention mask (no padding), times router_aux_loss_coef, as
        # *ForCausalLM.forward adds it to the loss
        aux = out.aux_loss
        loss = loss + text_config.router_aux_loss_coef * aux

    # cross-check against HF's own loss with -100 labels (HF's loss function
    # upcasts logits to float32, so this only agrees to ~1e-7 relative)
    labels = input_ids.clone()
    if loss_mask is not None:
        labels[loss_mask == 0] = -100
    with torch.no_grad():
        hf_loss = ref(input_ids=input_ids, labels=labels).loss
    assert abs(hf_loss.item() - loss.item()) < 1e-5 * abs(loss.item()), (hf_loss.item(), loss.item())

    loss.backward()

    # gradients, keyed by the names model.safetensors uses: save_pretrained
    # may rename (Gemma3ForConditionalGeneration: model.language_model.X is
    # written as language_model.model.X), so apply the same reverse mapping
    grads, no_grad = {}, []
    for pname, p in ref.named_parameters():
        if p.grad is None:
            # only the vision tower / projector of a VLM may have none
            assert text_prefix is not None, pname
            assert not pname.startswith(("model.language_model.", "lm_head.")), pname
            no_grad.append(pname)
            continue
        grads[pname] = p.grad.detach().to(torch.float32).contiguous()
    grads = dict(revert_weight_conversion(ref, grads))
    saved = load_file(os.path.join(out_dir, "model.safetensors"))
    if text_prefix is None:
        want = set(saved)
    else:
        want = {k for k in saved if k.startswith(text_prefix) or k == "lm_head.weight"}
        assert len(want) + len(no_grad) == len(saved), (len(want), len(no_grad), len(saved))
    if set(grads) != want:
        sys.exit(f"{name}: grad names {sorted(set(grads) ^ want)} "
                 "differ from model.safetensors")
    for k, v in saved.items():
        assert v.dtype == torch.float32, (k, v.dtype)
    for k, v in grads.items():
        assert v.shape == saved[k].shape, (k, v.shape, saved[k].shape)
    if text_config.tie_word_embeddings:
        assert "lm_head.weight" not in grads and "lm_head.weight" not in saved
    if fx["cls"] in (Qwen2ForCausalLM, Qwen2MoeForCausalLM):
        for k, v in saved.items():
            if k.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                assert v.abs().max() > 0, k
    save_file(grads, os.path.join(out_dir, "grads.safetensors"))

    extra = ""
    if gemma:
        wide_loss = check_gemma3(fx, out_dir, ref, input_ids, loss.item())
        extra = f" (loss with sliding_window=64: {wide_loss:.10f})"
    if "window" in fx:
        wide_loss = check_window(fx, out_dir, ref, input_ids)
        extra = f" (unmasked loss with sliding_window=64: {wide_loss:.10f})"
    check_rope(ref)

    expected = {"input_ids": input_ids.tolist()}
    if loss_mask is not None:
        expected["loss_mask"] = loss_mask.tolist()
    expected["loss"] = loss.item()
    if aux is not None:
        expected["aux_loss"] = aux.item()
    expected["logprobs"] = [[float(x) for x in row] for row in logprobs.detach().tolist()]
    if text_prefix is not None:
        expected["text_prefix"] = text_prefix
    with open(os.path.join(out_dir, "expected.json"), "w") as f:
        json.dump(expected, f)
        f.write("\n")

    size = sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir))
    gmax = max(g.abs().max().item() for g in grads.values())
    lp = logprobs.detach()
    print(f"{name:14s} loss={loss.item():.10f} max|grad|={gmax:.4e} "
          f"logprob range=[{lp.min().item():.3f}, {lp.max().item():.3f}] "
          f"params={len(grads)} size={size / 1024:.1f} KiB{extra}")
    if no_grad:
        print(f"{'':14s} no gradient (not in grads.safetensors): {len(no_grad)} "
              "vision tower / projector parameters")
    return size


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="tests/fixtures")
    ap.add_argument("--only", nargs="*", help="fixture names to (re)generate")
    args = ap.parse_args()

    torch.set_default_dtype(torch.float32)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    os.makedirs(args.out, exist_ok=True)
    total = 0
    for fx in FIXTURES:
        if args.only and fx["name"] not in args.only:
            continue
        total += make_fixture(fx, args.out)
    print(f"total {total / 1024:.1f} KiB")
    # all six fixtures together are ~5.2 MiB
    if total > 6 * 1024 * 1024:
        sys.exit("fixtures exceed 6 MB")


if __name__ == "__main__":
    main()
