"""Tiny random models of every mlx_lm architecture, and how each reaches its KV cache.

``ARCHITECTURES`` maps each mlx_lm model type (the module name under
``mlx_lm.models``) to a small argument dict: ``build_tiny`` turns it into a random
``Model(ModelArgs.from_dict(args))`` in milliseconds. Layer kinds that matter for KV
caching are kept (a sliding-window and a global layer for hybrid-window models, a
recurrent and an attention layer for recurrent hybrids, KV-sharing layers, ...).
``ModelArgs.from_dict`` drops keys a type does not declare, so the dicts share a base.

``SURVEY`` records, per type, how its attention reaches the cache: the attention path
(by the module-level ``scaled_dot_product_attention`` name that routing replaces, by
``mx.fast.scaled_dot_product_attention`` directly, or computed by hand), the K/V
projections, the caches ``make_cache()`` returns, special features, and whether the
model runs a prefill + greedy decode with mlx_lm's own cache (mlx_lm 0.32.2), plus
whether the type is *routable*: every attention call reaches the module-level name with
the layer's own cache and the keys that cache returned. ``ATTENTION_KIND`` and
``routable()`` are the short forms. The survey was written from the model sources and
is checked against running models by ``scripts/survey_architectures.py``, which also
renders ``docs/architecture-survey.md``. ``list_model_types()`` lists the installed
mlx_lm's types, so types a newer mlx_lm adds show up in ``uncatalogued_model_types()``.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import pkgutil
import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

# Modules of mlx_lm.models that are helpers, not architectures (no Model/ModelArgs).
NOT_ARCHITECTURES: dict[str, str] = {
    "activations": "activation functions",
    "base": "BaseModelArgs, masks, scaled_dot_product_attention",
    "bitlinear_layers": "BitNet linear layers",
    "cache": "KV / recurrent cache classes",
    "gated_delta": "gated delta-rule kernels",
    "mla": "MultiLinear helper for MLA models",
    "pipeline": "pipeline-parallel mixin",
    "rope_utils": "RoPE variants",
    "ssm": "Mamba SSM kernels",
    "switch_layers": "mixture-of-experts layers",
}

# ------------------------------------------------------------------ the catalog
_B: dict[str, Any] = {  # llama-style sizes most types share
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
_MOE: dict[str, Any] = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
# DeepSeek-style MLA sizes (latent rank 32, rope part 8, nope part 16).
_MLA: dict[str, Any] = {
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
}
_DSV3: dict[str, Any] = {
    **_B,
    **_MLA,
    "moe_intermediate_size": 32,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "num_key_value_heads": 4,
}
_SW2 = ["sliding_attention", "full_attention"]
_GEMMA4_TEXT: dict[str, Any] = {
    **_B, "model_type": "gemma4_text", "num_hidden_layers": 4, "global_head_dim": 32,
    "vocab_size_per_layer_input": 256, "num_kv_shared_layers": 2,
    "hidden_size_per_layer_input": 16, "sliding_window": 4, "layer_types": _SW2 * 2,
}
_MISTRAL_ROPE: dict[str, Any] = {
    "rope_theta": 10000.0, "rope_type": "default", "llama_4_scaling_beta": 0.1,
    "original_max_position_embeddings": 512,
}
_LFM2: dict[str, Any] = {
    **_B, "model_type": "lfm2", "norm_eps": 1e-5, "conv_bias": False, "conv_L_cache": 3,
    "block_dim": 64, "block_multiple_of": 16, "block_ffn_dim_multiplier": 1.0,
    "block_auto_adjust_ff_dim": False, "layer_types": ["conv", "full_attention"],
}
_QWEN35: dict[str, Any] = {
    **_B, "model_type": "qwen3_5", "linear_num_value_heads": 4, "linear_num_key_heads": 2,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "full_attention_interval": 2,
    "rope_parameters": {"type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0,
                        "partial_rotary_factor": 0.5},
}
_LONGCAT: dict[str, Any] = {
    **_B, **_MLA, "model_type": "longcat_flash", "attention_method": "MLA",
    "zero_expert_type": "identity", "ffn_hidden_size": 128, "moe_topk": 2,
    "expert_ffn_hidden_size": 32, "n_routed_experts": 4, "zero_expert_num": 1,
    "num_layers": 1, "routed_scaling_factor": 1.0, "mla_scale_q_lora": True,
    "mla_scale_kv_lora": True, "attention_bias": False,
}

ARCHITECTURES: dict[str, dict[str, Any]] = {
    "Klear": {**_B, **_MOE, "model_type": "Klear", "attention_bias": False,
              "mlp_only_layers": [0], "decoder_sparse_step": 1, "n_shared_experts": 1,
              "norm_topk_prob": True},
    # Two KV layers, then one layer that attends over the last KV layer's K/V.
    "afm7": {"model_type": "afm7", "vocab_size": 256, "hidden_dim": 64, "num_layers": 3,
             "num_kv_reuse_layers": 1, "num_heads": 4, "num_kv_heads": 2},
    "afmoe": {**_B, **_MOE, "model_type": "afmoe", "layer_types": _SW2,
              "num_dense_layers": 1, "num_shared_experts": 1, "sliding_window": 4},
    "apertus": {**_B, "model_type": "apertus", "mlp_bias": False, "attention_bias": False,
                "post_norm": False, "qk_norm": True},
    "baichuan_m1": {**_B, "model_type": "baichuan_m1", "sliding_window": 4,
                    "sliding_window_layers": [0], "conv_window": 2},
    "bailing_hybrid": {**_B, **_MOE, **_MLA, "model_type": "bailing_hybrid",
                       "num_shared_experts": 1, "n_group": 1, "topk_group": 1,
                       "first_k_dense_replace": 1, "layer_group_size": 2,
                       "group_norm_size": 1, "routed_scaling_factor": 1.0},
    "bailing_moe": {**_B, **_MOE, "model_type": "bailing_moe", "num_shared_experts": 1,
                    "norm_topk_prob": True, "first_k_dense_replace": 1},
    "bailing_moe_linear": {**_B, **_MOE, "model_type": "bailing_moe_linear",
                           "num_shared_experts": 1, "norm_topk_prob": True,
                           "first_k_dense_replace": 1, "layer_group_size": 2,
                           "group_norm_size": 1},
    "bailing_moe_v3": {**_B, **_MOE, **_MLA, "model_type": "bailing_moe_v3",
                       "moe_shared_expert_intermediate_size": 32, "num_shared_experts": 1,
                       "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
                       "layer_group_size": 2, "short_conv_kernel_size": 4},
    "bitnet": {**_B, "model_type": "bitnet"},
    "cohere": {**_B, "model_type": "cohere"},
    # sliding_window_pattern 2: layer 0 sliding (RoPE), layer 1 global (no RoPE).
    "cohere2": {**_B, "model_type": "cohere2", "sliding_window": 4,
                "sliding_window_pattern": 2},
    "dbrx": {"model_type": "dbrx", "vocab_size": 256, "d_model": 64, "n_layers": 2,
             "n_heads": 4,
             "attn_config": {"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
             "ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2}},
    "deepseek": {**_B, "model_type": "deepseek", "moe_intermediate_size": 32,
                 "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
                 "first_k_dense_replace": 1},
    "deepseek_v2": {**_DSV3, "model_type": "deepseek_v2",
                    "rope_scaling": {"factor": 1.0, "type": "yarn"}},
    "deepseek_v3": {**_DSV3, "model_type": "deepseek_v3"},
    "deepseek_v32": {**_DSV3, "model_type": "deepseek_v32", "index_head_dim": 16,
                     "index_n_heads": 2, "index_topk": 4},
    # Layer 0 keeps only its sliding window; layer 1 also compresses groups of
    # four tokens and indexes them (top-k sparse attention with sinks).
    "deepseek_v41": {"model_type": "deepseek_v41", "vocab_size": 256, "hidden_size": 64,
                     "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 32,
                     "q_lora_rank": 32, "qk_rope_head_dim": 8, "o_groups": 2,
                     "o_lora_rank": 16, "moe_intermediate_size": 32, "n_routed_experts": 4,
                     "num_experts_per_tok": 2, "sliding_window": 4, "compress_ratios": [0, 4],
                     "kv_source_layer_ids": [1], "index_source_layer_ids": [1],
                     "index_n_heads": 2, "index_head_dim": 16, "index_topk": 2,
                     "max_position_embeddings": 512, "hc_mult": 2, "hc_sinkhorn_iters": 2},
    "dots1": {**_B, "model_type": "dots1", "first_k_dense_replace": 1,
              "moe_intermediate_size": 32, "n_routed_experts": 4, "n_shared_experts": 1,
              "norm_topk_prob": True, "num_experts_per_tok": 2, "routed_scaling_factor": 1.0},
    "ernie4_5": {**_B, "model_type": "ernie4_5", "use_bias": False},
    "ernie4_5_moe": {**_B, "model_type": "ernie4_5_moe", "use_bias": False,
                     "moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": 32,
                     "moe_layer_start_index": 1},
    "exaone": {**_B, "model_type": "exaone", "num_layers": 2, "layer_norm_epsilon": 1e-5},
    "exaone4": {**_B, "model_type": "exaone4", "rope_scaling": None, "sliding_window": 4,
                "sliding_window_pattern": "LG"},
    "exaone_moe": {**_B, **_MOE, "model_type": "exaone_moe", "num_shared_experts": 1,
                   "sliding_window": 4, "layer_types": _SW2, "is_moe_layer": [False, True]},
    "falcon_h1": {**_B, "model_type": "falcon_h1", "mamba_d_ssm": 64, "mamba_n_heads": 4,
                  "mamba_d_head": 16, "mamba_d_state": 16, "mamba_chunk_size": 8},
    "gear": {**_B, "model_type": "gear", "num_hidden_layers": 3, "sliding_window": 4,
             "layer_types": ["conv_mixer", "sliding_attention", "full_attention"]},
    "gemma": {**_B, "model_type": "gemma"},
    "gemma2": {**_B, "model_type": "gemma2"},
    "gemma3": {"model_type": "gemma3", "vocab_size": 256,
               "text_config": {**_B, "model_type": "gemma3_text", "sliding_window": 4,
                               "sliding_window_pattern": 2}},
    "gemma3_text": {**_B, "model_type": "gemma3_text", "sliding_window": 4,
                    "sliding_window_pattern": 2, "query_pre_attn_scalar": 16},
    # Two layers own K/V (sliding, global); the last two read those caches.
    "gemma3n": {"model_type": "gemma3n", "text_config": {
        **_B, "model_type": "gemma3n", "num_hidden_layers": 4, "num_kv_shared_layers": 2,
        "vocab_size_per_layer_input": 256, "sliding_window": 4,
        "rope_local_base_freq": 10000.0, "final_logit_softcapping": 30.0,
        "layer_types": _SW2 * 2, "activation_sparsity_pattern": [0.0] * 4,
        "hidden_size_per_layer_input": 16, "altup_num_inputs": 2, "altup_coef_clip": 120.0,
        "altup_correct_scale": True, "altup_active_idx": 0, "laurel_rank": 8}},
    "gemma4": {"model_type": "gemma4", "vocab_size": 256, "text_config": _GEMMA4_TEXT},
    "gemma4_text": {**_GEMMA4_TEXT, "model_type": "gemma4_text"},
    "glm": {**_B, "model_type": "glm"},
    "glm4": {**_B, "model_type": "glm4", "attention_bias": False,
             "partial_rotary_factor": 0.5},
    "glm4_moe": {**_B, "model_type": "glm4_moe", "moe_intermediate_size": 32,
                 "norm_topk_prob": True, "n_group": 1, "topk_group": 1, "n_shared_experts": 1,
                 "n_routed_experts": 4, "routed_scaling_factor": 1.0, "num_experts_per_tok": 2,
                 "first_k_dense_replace": 1, "rope_scaling": None, "use_qk_norm": True,
                 "attention_bias": False, "partial_rotary_factor": 0.5},
    "glm4_moe_lite": {**_DSV3, "model_type": "glm4_moe_lite"},
    "glm_moe_dsa": {**_DSV3, "model_type": "glm_moe_dsa", "index_head_dim": 16,
                    "index_n_heads": 2, "index_topk": 4, "routed_scaling_factor": 1.0,
                    "topk_method": "noaux_tc", "scoring_func": "sigmoid",
                    "norm_topk_prob": True, "moe_layer_freq": 1, "attention_bias": False,
                    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}},
    "gpt2": {"model_type": "gpt2", "n_ctx": 512, "n_embd": 64, "n_head": 4, "n_layer": 2,
             "n_positions": 512, "layer_norm_epsilon": 1e-5, "vocab_size": 256},
    "gpt_bigcode": {"model_type": "gpt_bigcode", "n_embd": 64, "n_layer": 2, "n_inner": 128,
                    "n_head": 4, "n_positions": 512, "layer_norm_epsilon": 1e-5,
                    "vocab_size": 256},
    "gpt_neox": {**_B, "model_type": "gpt_neox", "layer_norm_eps": 1e-5,
                 "rotary_emb_base": 10000, "rotary_pct": 0.25},
    "gpt_oss": {**_B, "model_type": "gpt_oss", "num_local_experts": 4,
                "num_experts_per_tok": 2, "sliding_window": 4, "layer_types": _SW2},
    "gptj": {"model_type": "gptj", "n_embd": 64, "vocab_size": 256, "n_positions": 512,
             "n_head": 4, "rotary_dim": 8, "n_layer": 2},
    "granite": {**_B, "model_type": "granite", "logits_scaling": 1.0,
                "attention_multiplier": 0.25, "embedding_multiplier": 1.0,
                "residual_multiplier": 1.0, "attention_bias": False, "mlp_bias": False},
    "granitemoe": {**_B, "model_type": "granitemoe", "logits_scaling": 1.0,
                   "attention_multiplier": 0.25, "embedding_multiplier": 1.0,
                   "residual_multiplier": 1.0, "attention_bias": False,
                   "num_local_experts": 4, "num_experts_per_tok": 2},
    "granitemoehybrid": {**_B, "model_type": "granitemoehybrid", "attention_bias": False,
                         "embedding_multiplier": 1.0, "attention_multiplier": 0.25,
                         "logits_scaling": 1.0, "residual_multiplier": 1.0,
                         "layer_types": ["mamba", "attention"], "mamba_n_heads": 4,
                         "mamba_d_head": 16, "mamba_proj_bias": False, "mamba_d_state": 16,
                         "mamba_d_conv": 4, "mamba_n_groups": 1, "mamba_conv_bias": True},
    "helium": {**_B, "model_type": "helium", "attention_bias": False, "mlp_bias": False},
    # Cross-layer attention: layer 1 reuses layer 0's K/V projections.
    "hunyuan": {**_B, "model_type": "hunyuan", "attention_bias": False, "moe_topk": 2,
                "num_experts": 4, "num_shared_expert": 1, "use_mixed_mlp_moe": True,
                "use_qk_norm": True, "use_cla": True, "cla_share_factor": 2,
                "moe_intermediate_size": 32,
                "rope_scaling": {"alpha": 1.0, "factor": 1.0, "type": "dynamic"}},
    "hunyuan_v1_dense": {**_B, "model_type": "hunyuan_v1_dense",
                         "rope_scaling": {"alpha": 1.0, "factor": 1.0, "type": "dynamic"}},
    "internlm2": {**_B, "model_type": "internlm2"},
    "internlm3": {**_B, "model_type": "internlm3"},
    "iquestloopcoder": {**_B, "model_type": "iquestloopcoder", "loop_window_size": 4},
    "jamba": {**_B, **_MOE, "model_type": "jamba", "attn_layer_offset": 1,
              "attn_layer_period": 2, "expert_layer_offset": 1, "expert_layer_period": 2,
              "mamba_d_conv": 4, "mamba_d_state": 8, "mamba_expand": 2},
    "kimi_k25": {"model_type": "kimi_k25", "text_config": {**_DSV3, "model_type": "kimi_k25"}},
    "kimi_k3": {"model_type": "kimi_k3", "text_config": {
        **_B, **_MLA, "model_type": "kimi_linear", "num_key_value_heads": 4,
        "linear_attn_config": {"num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4,
                               "kda_layers": [1]},
        "num_experts": 4, "num_experts_per_token": 2, "moe_intermediate_size": 32,
        "first_k_dense_replace": 1}},
    "kimi_linear": {**_B, **_MLA, "model_type": "kimi_linear", "num_key_value_heads": 4,
                    "linear_attn_config": {"num_heads": 4, "head_dim": 16,
                                           "short_conv_kernel_size": 4, "kda_layers": [1]},
                    "model_max_length": 512, "num_experts": 4, "num_experts_per_token": 2,
                    "moe_intermediate_size": 32, "first_k_dense_replace": 1},
    "kimi_vl": {"model_type": "kimi_vl", "text_config": {**_DSV3}},
    "laguna": {**_B, **_MOE, "model_type": "laguna", "sliding_window": 4,
               "layer_types": _SW2, "shared_expert_intermediate_size": 32},
    "lfm2": _LFM2,
    "lfm2-vl": {"model_type": "lfm2-vl", "text_config": _LFM2},
    "lfm2_moe": {**_B, **_MOE, "model_type": "lfm2_moe", "norm_topk_prob": True,
                 "use_expert_bias": True, "num_dense_layers": 1, "norm_eps": 1e-5,
                 "conv_bias": False, "conv_L_cache": 3,
                 "layer_types": ["conv", "full_attention"]},
    "lille-130m": {"model_type": "lille-130m", "block_size": 512, "layer_norm_eps": 1e-5,
                   "n_embd": 64, "n_head": 4, "n_kv_heads": 2, "n_layer": 2,
                   "rope_theta": 10000.0, "vocab_size": 256},
    "llama": {**_B, "model_type": "llama"},
    # Four layers: three chunked-attention RoPE layers, then one global no-RoPE layer.
    "llama4": {"model_type": "llama4", "text_config": {
        **_B, "model_type": "llama4", "num_hidden_layers": 4, "attention_bias": False,
        "attention_chunk_size": 4, "interleave_moe_layer_step": 2,
        "intermediate_size_mlp": 128, "num_experts_per_tok": 1, "num_local_experts": 2,
        "rope_scaling": None, "use_qk_norm": True}},
    "llama4_text": {**_B, "model_type": "llama4_text", "num_hidden_layers": 4,
                    "intermediate_size_mlp": 128, "no_rope_layers": [1, 1, 1, 0],
                    "use_qk_norm": True},
    "longcat_flash": _LONGCAT,
    "longcat_flash_ngram": {**_LONGCAT, "model_type": "longcat_flash_ngram",
                            "ngram_vocab_size_ratio": 2, "emb_neighbor_num": 2,
                            "emb_split_num": 2},
    "mamba": {"model_type": "mamba", "vocab_size": 256, "hidden_size": 64,
              "intermediate_size": 128, "state_size": 8, "num_hidden_layers": 2,
              "conv_kernel": 4, "use_bias": False, "use_conv_bias": True, "time_step_rank": 8},
    "mamba2": {"model_type": "mamba2", "num_heads": 8, "head_dim": 16, "vocab_size": 256,
               "hidden_size": 64, "intermediate_size": 128, "state_size": 16,
               "num_hidden_layers": 2, "layer_norm_epsilon": 1e-5, "conv_kernel": 4,
               "n_groups": 1, "use_bias": False, "use_conv_bias": True,
               "tie_word_embeddings": True, "time_step_limit": [0.0, float("inf")],
               "time_step_rank": 8},
    "mellum": {**_B, **_MOE, "model_type": "mellum", "norm_topk_prob": True,
               "sliding_window": 4, "layer_types": _SW2,
               "rope_parameters": {"full_attention": {"rope_theta": 10000.0},
                                   "sliding_attention": {"rope_theta": 10000.0}}},
    "mimo": {**_B, "model_type": "mimo"},
    "mimo_v2_flash": {**_B, "model_type": "mimo_v2_flash", "num_experts_per_tok": 2,
                      "hybrid_layer_pattern": [1, 0], "moe_layer_freq": [0, 1],
                      "add_swa_attention_sink_bias": True,
                      "add_full_attention_sink_bias": False, "sliding_window_size": 4,
                      "moe_intermediate_size": 32, "n_shared_experts": None,
                      "n_routed_experts": 4, "routed_scaling_factor": None,
                      "topk_method": "noaux_tc", "scoring_func": "sigmoid",
                      "norm_topk_prob": True, "n_group": 1, "topk_group": 1,
                      "layernorm_epsilon": 1e-5, "swa_rope_theta": 10000.0,
                      "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2,
                      "v_head_dim": 16, "swa_head_dim": 16, "swa_v_head_dim": 16,
                      "partial_rotary_factor": 0.5},
    "minicpm": {**_B, "model_type": "minicpm", "dim_model_base": 64, "scale_depth": 1.4,
                "scale_emb": 12.0},
    "minicpm3": {**_B, **_MLA, "model_type": "minicpm3", "dim_model_base": 64,
                 "scale_depth": 1.4, "scale_emb": 12.0, "num_key_value_heads": 4,
                 "rope_scaling": {"original_max_position_embeddings": 512}},
    "minimax": {**_B, "model_type": "minimax", "num_experts_per_tok": 2,
                "num_local_experts": 4, "shared_intermediate_size": 32, "rotary_dim": 8},
    # Layer 0 is a block-sparse layer (indexer), layer 1 a full-attention layer.
    "minimax_m3_vl": {"model_type": "minimax_m3_vl", "text_config": {
        **_B, "model_type": "minimax_m3", "dense_intermediate_size": 128,
        "shared_intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2,
        "moe_layer_freq": [0, 1], "layer_types": ["sparse_attention", "full_attention"],
        "index_n_heads": 2, "index_head_dim": 16, "index_block_size": 2,
        "index_topk_blocks": 1}},
    "ministral3": {**_B, "model_type": "ministral3", "sliding_window": 4, "layer_types": _SW2,
                   "rope_parameters": _MISTRAL_ROPE},
    "mistral3": {"model_type": "mistral3", "text_config": {**_B, "model_type": "mistral"}},
    "mistral4": {**_DSV3, "model_type": "mistral4", "norm_topk_prob": True,
                 "routed_scaling_factor": 1.0, "rope_parameters": _MISTRAL_ROPE},
    "mixtral": {**_B, "model_type": "mixtral", "num_local_experts": 4,
                "num_experts_per_tok": 2},
    "muse_glimmer": {**_B, "model_type": "muse_glimmer", "sliding_window": 4,
                     "layer_types": _SW2},
    "muse_spark": {"model_type": "muse_spark", "text_config": {
        **_B, "post_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 10000.0},
        "layer_rope_theta": [10000.0, 0], "layer_types": _SW2, "sliding_window": 4,
        "final_logit_softcapping": 30.0, "output_multiplier": 1.0, "num_local_experts": 4,
        "num_experts_per_tok": 2, "moe_hidden_size": 64, "moe_intermediate_size": 32}},
    "nanbeige": {**_B, "model_type": "nanbeige"},
    "nanochat": {**_B, "model_type": "nanochat", "num_key_value_heads": 4},
    "nemotron": {**_B, "model_type": "nemotron", "hidden_act": "relu2", "norm_eps": 1e-5,
                 "partial_rotary_factor": 0.5},
    # Layer 1's attention is a no-op (no cache): make_cache skips it.
    "nemotron-nas": {**_B, "model_type": "nemotron-nas", "block_configs": [
        {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 1.0}},
        {"attention": {"no_op": True}, "ffn": {"ffn_mult": 1.0}}]},
    "nemotron_h": {**_B, "model_type": "nemotron_h", "attention_bias": False,
                   "mamba_num_heads": 4, "mamba_head_dim": 16, "mamba_proj_bias": False,
                   "ssm_state_size": 16, "conv_kernel": 4, "n_groups": 1, "mlp_bias": False,
                   "layer_norm_epsilon": 1e-5, "use_bias": False, "use_conv_bias": True,
                   "hybrid_override_pattern": ["M", "*", "-"]},
    "olmo": {"model_type": "olmo", "d_model": 64, "n_layers": 2, "mlp_hidden_size": 256,
             "n_heads": 4, "vocab_size": 256, "embedding_size": 256},
    "olmo2": {**_B, "model_type": "olmo2"},
    "olmo3": {**_B, "model_type": "olmo3", "sliding_window": 4,
              "layer_types": ["sliding_attention", "full_attention"]},
    "olmo_hybrid": {**_B, "model_type": "olmo_hybrid", "linear_num_key_heads": 2,
                    "linear_num_value_heads": 2, "linear_key_head_dim": 16,
                    "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
                    "linear_allow_neg_eigval": True, "attention_bias": False,
                    "layer_types": ["linear_attention", "full_attention"]},
    "olmoe": {**_B, **_MOE, "model_type": "olmoe"},
    "openelm": {"model_type": "openelm", "head_dim": 16, "num_transformer_layers": 2,
                "model_dim": 64, "vocab_size": 256, "ffn_dim_divisor": 16,
                "num_query_heads": [4, 4], "num_kv_heads": [2, 2],
                "ffn_multipliers": [1.0, 1.0]},
    "phi": {**_B, "model_type": "phi", "num_key_value_heads": 4,
            "partial_rotary_factor": 0.5, "layer_norm_eps": 1e-5},
    "phi3": {**_B, "model_type": "phi3"},
    # Layer 0 uses block-sparse attention (computed by hand), layer 1 dense. The
    # vocabulary must reach 100352: the model writes -inf at fixed token ids up to
    # 100351, and mlx does not bounds-check that scatter (it corrupts the heap).
    "phi3small": {**_B, "model_type": "phi3small", "vocab_size": 100352,
                  "dense_attention_every_n_layers": 2, "ff_intermediate_size": 128,
                  "gegelu_limit": 20.0, "layer_norm_epsilon": 1e-5, "blocksparse_block_size": 32,
                  "blocksparse_num_local_blocks": 2, "blocksparse_vert_stride": 2},
    "phimoe": {**_B, "model_type": "phimoe", "num_local_experts": 4,
               "num_experts_per_tok": 2},
    "phixtral": {"model_type": "phixtral", "num_vocab": 256, "model_dim": 64,
                 "num_heads": 4, "num_layers": 2, "rotary_dim": 8, "num_experts_per_tok": 2,
                 "num_local_experts": 4},
    "pixtral": {"model_type": "pixtral", "text_config": {**_B, "model_type": "llama"}},
    # n_shared_head 2: two K/V heads, tiled to the four query heads after the cache.
    "plamo": {**_B, "model_type": "plamo", "n_shared_head": 2},
    "plamo2": {**_B, "model_type": "plamo2", "hidden_size_per_head": 16,
               "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_num_heads": 4,
               "mamba_step": 2, "mamba_chunk_size": 8},
    "plamo3": {**_B, "model_type": "plamo3", "window_size": 4,
               "sliding_window_pattern": 2},
    # One 2-bit Hadamard-packed linear (zero weights until a pack is loaded).
    "prism_hadamard_qwen35": {"model_type": "prism_hadamard_qwen35",
                              "text_config": _QWEN35, "schema_version": 1,
                              "tensor_namespace": "mlx-lm-text",
                              "quantization": {"bits": 2, "group_size": 128,
                                               "mode": "affine"},
                              "modules": [{"path": "model.layers.1.mlp.down_proj",
                                           "embedding": False, "dtype": "float16",
                                           "block": 0}]},
    "qwen": {**_B, "model_type": "qwen", "kv_channels": 16, "layer_norm_epsilon": 1e-6},
    "qwen2": {**_B, "model_type": "qwen2"},
    "qwen2_moe": {**_B, **_MOE, "model_type": "qwen2_moe",
                  "shared_expert_intermediate_size": 32},
    "qwen2_vl": {"model_type": "qwen2_vl", "text_config": {**_B, "model_type": "qwen2"}},
    "qwen3": {**_B, "model_type": "qwen3"},
    "qwen3_5": {"model_type": "qwen3_5", "text_config": _QWEN35},
    "qwen3_5_moe": {"model_type": "qwen3_5_moe", "text_config": {
        **_QWEN35, **_MOE, "shared_expert_intermediate_size": 32}},
    "qwen3_moe": {**_B, **_MOE, "model_type": "qwen3_moe", "decoder_sparse_step": 1,
                  "mlp_only_layers": [0], "norm_topk_prob": True},
    "qwen3_next": {**_B, **_MOE, "model_type": "qwen3_next", "linear_num_value_heads": 4,
                   "linear_num_key_heads": 2, "linear_key_head_dim": 16,
                   "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
                   "decoder_sparse_step": 1, "shared_expert_intermediate_size": 32,
                   "mlp_only_layers": [0], "partial_rotary_factor": 0.5,
                   "full_attention_interval": 2},
    "qwen3_vl": {"model_type": "qwen3_vl", "text_config": {**_B, "model_type": "qwen3"}},
    "qwen3_vl_moe": {"model_type": "qwen3_vl_moe",
                     "text_config": {**_B, **_MOE, "model_type": "qwen3_moe",
                                     "decoder_sparse_step": 1, "mlp_only_layers": [0],
                                     "norm_topk_prob": True}},
    "recurrent_gemma": {**_B, "model_type": "recurrent_gemma", "attention_bias": False,
                        "conv1d_width": 4, "logits_soft_cap": 30.0,
                        "attention_window_size": 4, "num_key_value_heads": 1,
                        "block_types": ["recurrent", "attention"]},
    "rwkv7": {"model_type": "rwkv7", "vocab_size": 256, "hidden_size": 64,
              "intermediate_size": 128, "norm_eps": 1e-5, "head_dim": 16,
              "num_hidden_layers": 2, "a_low_rank_dim": 8, "v_low_rank_dim": 8,
              "gate_low_rank_dim": 8, "decay_low_rank_dim": 8},
    "seed_oss": {**_B, "model_type": "seed_oss"},
    "smollm3": {**_B, "model_type": "smollm3", "num_hidden_layers": 2,
                "no_rope_layer_interval": 2},
    "solar_open": {**_B, "model_type": "solar_open", "moe_intermediate_size": 32,
                   "n_shared_experts": 1, "n_routed_experts": 4, "routed_scaling_factor": 1.0,
                   "num_experts_per_tok": 2, "first_k_dense_replace": 1,
                   "norm_topk_prob": True, "partial_rotary_factor": 1.0},
    "spark2_5": {**_B, "model_type": "spark2_5", "sliding_window": 4, "layer_types": _SW2,
                 "rope_parameters": {"sliding_attention": {"rope_theta": 10000.0},
                                     "full_attention": {"rope_theta": 10000.0,
                                                        "partial_rotary_factor": 0.5}}},
    "stablelm": {**_B, "model_type": "stablelm", "use_qkv_bias": False,
                 "partial_rotary_factor": 0.25, "layer_norm_eps": 1e-5},
    "starcoder2": {**_B, "model_type": "starcoder2"},
    "step3p5": {**_B, "model_type": "step3p5", "num_attention_groups": 2,
                "sliding_window": 4, "layer_types": _SW2, "moe_num_experts": 4,
                "moe_top_k": 2, "moe_intermediate_size": 32, "share_expert_dim": 32},
    "talkie": {**_B, "model_type": "talkie"},
    "telechat3": {**_B, "model_type": "telechat3"},
    "youtu_llm": {**_B, **_MLA, "model_type": "youtu_llm", "num_key_value_heads": 4},
}


# ------------------------------------------------------------------ building
def _models_dir() -> Path:
    spec = importlib.util.find_spec("mlx_lm.models")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("mlx_lm is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


# A module is an architecture when it declares ModelArgs and defines (or re-exports) Model.
_ARGS_RE = re.compile(r"^class ModelArgs\b", re.M)
_MODEL_RE = re.compile(r"^class Model\b|^from \.\S+ import .*\bModel\b", re.M)


def list_model_types() -> list[str]:
    """Every model type of the installed mlx_lm, catalogued or not.

    Read from the sources, not by importing them: importing some modules has side
    effects (``olmo`` exits the process when ``hf_olmo`` is missing).
    """
    out = []
    for info in pkgutil.iter_modules([str(_models_dir())]):
        if info.name.startswith("_") or info.name in NOT_ARCHITECTURES:
            continue
        src = (_models_dir() / f"{info.name}.py").read_text(encoding="utf-8")
        if _ARGS_RE.search(src) and _MODEL_RE.search(src):
            out.append(info.name)
    return sorted(out, key=str.lower)


def uncatalogued_model_types() -> list[str]:
    """Model types of the installed mlx_lm that ``ARCHITECTURES`` lacks."""
    return [t for t in list_model_types() if t not in ARCHITECTURES]


def _import_model_module(model_type: str) -> types.ModuleType:
    name = f"mlx_lm.models.{model_type}"
    stub = None
    # olmo.py imports hf_olmo only to check it is installed and calls sys.exit(1)
    # without it; the model code never uses it, so an empty stand-in is enough.
    if model_type == "olmo" and importlib.util.find_spec("hf_olmo") is None:
        stub = sys.modules.setdefault("hf_olmo", types.ModuleType("hf_olmo"))
    try:
        return importlib.import_module(name)
    except SystemExit as e:  # a module that exits on import must not end the caller
        raise ImportError(f"importing {name} called sys.exit({e.code})") from e
    finally:
        if stub is not None and sys.modules.get("hf_olmo") is stub:
            del sys.modules["hf_olmo"]


# Widths doubled by ``build_tiny(..., wide=True)``: hidden sizes and head dims under
# every name the catalog uses (head counts, layer counts and vocabularies stay).
_WIDTH_KEYS = frozenset({
    "hidden_size", "head_dim", "d_model", "n_embd", "model_dim", "hidden_dim",
    "kv_channels", "hidden_size_per_head", "swa_head_dim", "swa_v_head_dim", "v_head_dim",
    "qk_nope_head_dim", "kv_lora_rank", "q_lora_rank", "global_head_dim",
    "linear_key_head_dim", "linear_value_head_dim", "index_head_dim", "mamba_d_head",
    "block_dim", "mamba_d_ssm", "rotary_dim", "mamba_head_dim", "dim_model_base",
})


def _widened(value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    out = {}
    for k, v in value.items():
        if isinstance(v, int) and not isinstance(v, bool) and k in _WIDTH_KEYS:
            out[k] = 2 * v
        elif k == "qk_rope_head_dim" and isinstance(v, int):
            out[k] = 4 * v  # MLA: the cached RoPE key part becomes 32 wide too
        else:
            out[k] = _widened(v)
    return out


# Mixture-of-experts top-k names, and the expert counts they can be raised to.
_TOPK_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_top_k",
              "moe_topk")
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


# mlx_lm's llama4 routes every token to exactly one expert.
_TOP1_ONLY = frozenset({"llama4"})


def _all_experts(value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    out = {k: _all_experts(v) for k, v in value.items()}
    counts = [v for k, v in out.items() if k in _EXPERT_KEYS and isinstance(v, int)]
    for k in _TOPK_KEYS:
        if counts and isinstance(out.get(k), int):
            out[k] = max(counts)
    return out


def tiny_args(model_type: str, wide: bool = False, all_experts: bool = False
              ) -> dict[str, Any]:
    """A fresh copy of the catalog's argument dict (see ``build_tiny``)."""
    if model_type not in ARCHITECTURES:
        raise KeyError(f"model type {model_type!r} is not in the catalog "
                       f"({len(ARCHITECTURES)} types; see ARCHITECTURES)")
    args = copy.deepcopy(ARCHITECTURES[model_type])
    args = _widened(args) if wide else args
    return _all_experts(args) if all_experts and model_type not in _TOP1_ONLY else args


def build_tiny(model_type: str, seed: int = 0, wide: bool = False,
               all_experts: bool = False, overrides: dict[str, Any] | None = None
               ) -> nn.Module:
    """A tiny random ``Model`` of ``model_type`` from the catalog, parameters evaluated.

    The weights come from mlx's global generator, seeded with ``seed`` (same seed, same
    weights). ``wide`` doubles every width (head dims 32 instead of 16, MLA latents 64
    and RoPE parts 32), so quantizers with groups of 32 apply to every cached width.
    ``all_experts`` routes every token to every expert of a mixture-of-experts model:
    with top-k routing, an error of half a percent in the keys flips expert choices of
    a random tiny model and moves its logits by 10-25%, which says nothing about a
    cache. ``overrides`` replace top-level arguments (e.g. a longer sliding window).
    Raises ``KeyError`` for a type the catalog lacks.
    """
    raw = {**tiny_args(model_type, wide, all_experts), **(overrides or {})}
    module = _import_model_module(model_type)
    # Some ModelArgs write into their nested text_config: never hand them the catalog's.
    args = module.ModelArgs.from_dict(raw)
    mx.random.seed(seed)
    model = module.Model(args)
    mx.eval(model.parameters())
    return model


def cache_kinds(caches: list[Any]) -> list[str]:
    """Class names of ``caches``, ``CacheList`` spelled with its parts."""
    out = []
    for c in caches:
        sub = getattr(c, "caches", None)
        name = type(c).__name__
        out.append(f"{name}({', '.join(cache_kinds(list(sub)))})" if sub else name)
    return out


# ------------------------------------------------------------------ the survey
# Attention paths. Routing replaces the module-level name; the other paths bypass it.
PATHS: dict[str, str] = {
    "module": "calls the module-level scaled_dot_product_attention name (routable by "
              "replacing it in the module)",
    "fast": "calls mx.fast.scaled_dot_product_attention directly",
    "manual": "computes attention itself (matmul + softmax)",
    "mixed": "some layers one way, some another",
    "none": "no attention (recurrent only)",
}
FEATURES: dict[str, str] = {
    "sliding_window": "some layers attend over a window (RotatingKVCache)",
    "chunked": "chunked local attention (ChunkedKVCache)",
    "sinks": "attention sinks: a learned per-head logit passed as sinks= (gpt-oss style)",
    "kv_shared": "some layers attend over K/V that another layer (or pass) cached",
    "kv_proj_shared": "layers share K/V projections but each caches its own copy",
    "qk_norm": "per-head norm of queries and keys",
    "qk_norm (optional)": "per-head norm of queries and keys when the config asks",
    "no_rope": "no rotary position embedding in any attention layer",
    "no_rope_layers": "some attention layers skip RoPE",
    "mla_latent_cache": "MLA caching the latent and the RoPE key; attention gets a float "
                        "score bias as mask and, in prefill, keys rebuilt from the latent",
    "mla_expanded_cache": "MLA expanding the latent to per-head K and V before caching",
    "recurrent_layers": "recurrent / linear-attention / conv layers with ArraysCache state",
    "sparse_indexer": "an indexer picks which cached keys each query sees (DSA-style)",
    "block_sparse": "block-sparse attention layers",
    "softcap": "tanh soft-capping of attention logits",
    "softcap (optional)": "tanh soft-capping of attention logits when the config asks",
    "kv_conv": "a short causal convolution over K and V before caching",
    "kv_tiled": "K/V heads tiled to the query heads (h -> h mod n_kv), not grouped",
    "uneven_caches": "make_cache() does not return one cache per entry of model.layers",
    "custom_cache": "the model's own cache class",
}


@dataclass(frozen=True)
class Survey:
    """How one model type's attention reaches its KV cache (mlx_lm 0.32.2).

    ``projections``: ``"separate"`` (K and V projections of their own), ``"fused"`` (one
    projection for Q, K and V), ``"mla"`` (a low-rank KV latent), ``"other"`` or
    ``"none"``. ``routable``: every attention call goes through the module-level name,
    with the calling layer's own cache, over the keys and values that cache returned and
    with a plain (None / "causal" / boolean) mask and no sinks, so a cache's ``attend``
    sees all it needs. ``caches``: the distinct kinds ``make_prompt_cache`` returns, in
    order, ``CacheList`` spelled with its parts. ``runs``: "yes" when an 8-token
    prefill and 4 greedy decode steps run with mlx_lm's own cache, else why not.
    """

    path: str
    projections: str
    caches: tuple[str, ...]
    features: tuple[str, ...] = ()
    routable: bool = True
    runs: str = "yes"
    note: str = ""


_KV = ("KVCache",)
_SWA = ("RotatingKVCache", "KVCache")
_REC = ("ArraysCache", "KVCache")
_METAL = "no: needs Metal (mx.fast.metal_kernel); the CPU build cannot run it"

SURVEY: dict[str, Survey] = {
    "Klear": Survey("module", "separate", _KV, ("qk_norm",)),
    "afm7": Survey(
        "module", "fused", _KV, ("kv_shared", "qk_norm", "uneven_caches"), routable=False,
        note="the last num_kv_reuse_layers layers have no cache: they attend with "
             "cache=None over keys_and_values() of the last KV layer's cache; K/V are "
             "fake-quantized to 8 bits before caching"),
    "afmoe": Survey("module", "separate", _SWA, ("sliding_window", "qk_norm",
                                                   "no_rope_layers"),
                    note="global layers have no RoPE; gated output"),
    "apertus": Survey("module", "separate", _KV, ("qk_norm (optional)",)),
    "baichuan_m1": Survey(
        "module", "fused", ("CacheList(ArraysCache, RotatingKVCache)",
                            "CacheList(ArraysCache, KVCache)"),
        ("sliding_window", "kv_conv"),
        note="W_pack; K/V go through a 2-tap causal conv (last K/V kept in the "
             "CacheList's ArraysCache) before RoPE and caching; attention gets the "
             "CacheList's KV cache"),
    "bailing_hybrid": Survey(
        "module", "mla", _REC, ("mla_latent_cache", "recurrent_layers", "qk_norm"),
        routable=False, note="linear-attention (GLA) layers plus MLA layers"),
    "bailing_moe": Survey("module", "fused", _KV, ("qk_norm (optional)",)),
    "bailing_moe_linear": Survey("module", "fused", _REC,
                                 ("recurrent_layers", "qk_norm (optional)"),
                                 note="linear-attention (GLA) layers plus softmax layers"),
    "bailing_moe_v3": Survey("module", "mla", _REC, ("mla_latent_cache",
                                                     "recurrent_layers"),
                             routable=False, note="KDA linear layers plus MLA layers"),
    "bitnet": Survey("module", "separate", _KV, routable=True, runs=_METAL,
                     note="BitLinear projections run a Metal kernel"),
    "cohere": Survey("module", "separate", _KV, ("qk_norm (optional)",)),
    "cohere2": Survey("module", "separate", _SWA, ("sliding_window", "no_rope_layers"),
                      note="global layers have no RoPE"),
    "dbrx": Survey("module", "fused", _KV, note="Wqkv, clipped to clip_qkv"),
    "deepseek": Survey("module", "separate", _KV),
    "deepseek_v2": Survey("module", "mla", _KV, ("mla_expanded_cache",)),
    "deepseek_v3": Survey("module", "mla", _KV, ("mla_latent_cache",), routable=False),
    "deepseek_v32": Survey(
        "module", "mla", ("CacheList(KVCache, KVCache)",),
        ("mla_latent_cache", "sparse_indexer"), routable=False,
        note="the indexer keeps its keys in the CacheList's second KVCache; attention is "
             "handed the CacheList itself; reassigns cache[0].keys"),
    "deepseek_v41": Survey(
        "fast", "other", ("LayerCache",), ("sinks", "sliding_window", "sparse_indexer",
                                           "custom_cache"),
        routable=False,
        note="one shared K=V latent (kv_proj, one head); its own LayerCache holds a "
             "sliding window plus compressed groups and index keys; sparse top-k "
             "attention with sinks by mx.fast.scaled_dot_product_attention directly"),
    "dots1": Survey("module", "separate", _KV, ("qk_norm",)),
    "ernie4_5": Survey("module", "separate", _KV),
    "ernie4_5_moe": Survey("module", "separate", _KV),
    "exaone": Survey("module", "separate", _KV),
    "exaone4": Survey("module", "separate", _SWA, ("sliding_window", "qk_norm",
                                                     "no_rope_layers"),
                      note="global layers have no RoPE when a sliding pattern is set"),
    "exaone_moe": Survey("module", "separate", _SWA, ("sliding_window", "qk_norm",
                                                        "no_rope_layers"),
                         note="only sliding layers use RoPE"),
    "falcon_h1": Survey("module", "separate", ("CacheList(ArraysCache, KVCache)",),
                        ("recurrent_layers",),
                        note="every layer runs Mamba2 and attention in parallel; "
                             "attention gets the CacheList's KVCache"),
    "gear": Survey(
        "module", "separate", ("ArraysCache", "RotatingKVCache", "KVCache"),
        ("sliding_window", "recurrent_layers", "qk_norm", "softcap (optional)"),
        note="conv-mixer layers (gated K/V convolution, no softmax) plus sliding and "
             "full attention; with attn_logit_softcapping set the attention layers "
             "compute soft-capped attention themselves (manual, bypassing the name)"),
    "gemma": Survey("module", "separate", _KV),
    "gemma2": Survey("manual", "separate", _KV, ("softcap",), routable=False,
                     note="attention computed in the model: matmul, tanh soft-capping "
                          "(attn_logit_softcapping), softmax"),
    "gemma3": Survey("module", "separate", _SWA, ("sliding_window", "qk_norm")),
    "gemma3_text": Survey("module", "separate", _SWA, ("sliding_window", "qk_norm")),
    "gemma3n": Survey(
        "module", "separate", _SWA,
        ("sliding_window", "kv_shared", "qk_norm", "uneven_caches"), routable=False,
        note="the last num_kv_shared_layers layers have no cache: they read the owner "
             "layer's cache with keys_and_values() and hand that cache to attention. "
             "Uncached (cache=None) they use their own K/V projections instead, so "
             "cached and uncached logits differ"),
    "gemma4": Survey(
        "module", "separate", _SWA,
        ("sliding_window", "kv_shared", "qk_norm", "uneven_caches"), routable=False,
        note="KV-shared layers get the owner layer's update_and_fetch output and call "
             "attention with cache=None; full layers may use K as V (attention_k_eq_v)"),
    "gemma4_text": Survey(
        "module", "separate", _SWA,
        ("sliding_window", "kv_shared", "qk_norm", "uneven_caches"), routable=False,
        note="as gemma4"),
    "glm": Survey("module", "separate", _KV),
    "glm4": Survey("module", "separate", _KV),
    "glm4_moe": Survey("module", "separate", _KV, ("qk_norm (optional)",)),
    "glm4_moe_lite": Survey("module", "mla", _KV, ("mla_latent_cache",), routable=False),
    "glm_moe_dsa": Survey(
        "module", "mla", ("CacheList(KVCache, KVCache)",),
        ("mla_latent_cache", "sparse_indexer"), routable=False,
        note="deepseek_v32's model under GLM's config"),
    "gpt2": Survey("module", "fused", _KV, ("no_rope",), note="learned positions"),
    "gpt_bigcode": Survey("module", "fused", _KV, ("no_rope",),
                          note="learned positions; multi-query"),
    "gpt_neox": Survey("module", "fused", _KV),
    "gpt_oss": Survey("module", "separate", _SWA, ("sliding_window", "sinks"),
                      routable=False,
                      note="per-head sinks passed to the module-level function"),
    "gptj": Survey("module", "separate", _KV),
    "granite": Survey("module", "separate", _KV),
    "granitemoe": Survey("module", "separate", _KV),
    "granitemoehybrid": Survey("module", "separate", _REC, ("recurrent_layers",),
                               note="Mamba2 layers plus attention layers (NoPE when "
                                    "position_embedding_type is 'nope')"),
    "helium": Survey("module", "separate", _KV),
    "hunyuan": Survey("module", "separate", _KV, ("kv_proj_shared", "qk_norm (optional)"),
                      note="cross-layer attention: layers share K/V projections in "
                           "groups of cla_share_factor; every layer caches its own copy"),
    "hunyuan_v1_dense": Survey("module", "separate", _KV, ("qk_norm",)),
    "internlm2": Survey("module", "fused", _KV),
    "internlm3": Survey("module", "separate", _KV),
    "iquestloopcoder": Survey(
        "module", "separate", ("KVCache", "RotatingKVCache"),
        ("sliding_window", "kv_shared", "uneven_caches"), routable=False,
        note="two passes over the layers, two caches per layer; pass 2 gates a global "
             "attention over pass 1's K/V (called with pass 2's windowed cache) with a "
             "local one over its own"),
    "jamba": Survey("module", "separate", _REC, ("recurrent_layers", "no_rope"),
                    note="Mamba layers plus attention layers without RoPE"),
    "kimi_k25": Survey("module", "mla", _KV, ("mla_latent_cache",), routable=False,
                       note="deepseek_v3's text model"),
    "kimi_k3": Survey("module", "mla", _REC, ("mla_latent_cache", "recurrent_layers",
                                              "no_rope"),
                      routable=False, note="KDA linear layers plus NoPE MLA layers"),
    "kimi_linear": Survey("module", "mla", _REC, ("mla_latent_cache", "recurrent_layers",
                                                  "no_rope"),
                          routable=False, note="KDA linear layers plus NoPE MLA layers"),
    "kimi_vl": Survey("module", "mla", _KV, ("mla_latent_cache",), routable=False,
                      note="deepseek_v3's text model"),
    "laguna": Survey("module", "separate", _SWA, ("sliding_window", "qk_norm"),
                     note="per-layer head counts; gated output"),
    "lfm2": Survey("module", "separate", _REC, ("recurrent_layers", "qk_norm"),
                   note="short-conv layers plus attention layers"),
    "lfm2-vl": Survey("module", "separate", _REC, ("recurrent_layers", "qk_norm"),
                      note="lfm2's text model"),
    "lfm2_moe": Survey("module", "separate", _REC, ("recurrent_layers", "qk_norm"),
                       note="short-conv layers plus attention layers"),
    "lille-130m": Survey("module", "fused", _KV),
    "llama": Survey("module", "separate", _KV, note="sliding layers when layer_types "
                                                     "says so (RotatingKVCache)"),
    "llama4": Survey("module", "separate", ("ChunkedKVCache", "KVCache"),
                     ("chunked", "no_rope_layers", "qk_norm (optional)"),
                     note="three chunked RoPE layers, then one global NoPE layer with "
                          "attention-temperature tuning"),
    "llama4_text": Survey("module", "separate", _KV, ("no_rope_layers",
                                                      "qk_norm (optional)")),
    "longcat_flash": Survey(
        "module", "mla", ("CacheList(KVCache, KVCache)",), ("mla_latent_cache",),
        routable=False, note="two MLA attentions per layer, one CacheList entry each"),
    "longcat_flash_ngram": Survey(
        "module", "mla", ("ArraysCache", "CacheList(KVCache, KVCache)"),
        ("mla_latent_cache", "uneven_caches"), routable=False,
        note="longcat_flash plus a leading ArraysCache of n-gram token history (not a "
             "layer)"),
    "mamba": Survey("none", "none", ("ArraysCache",), ("recurrent_layers",),
                    routable=False),
    "mamba2": Survey("none", "none", ("ArraysCache",), ("recurrent_layers",),
                     routable=False),
    "mellum": Survey("module", "separate", _SWA, ("sliding_window", "qk_norm")),
    "mimo": Survey("module", "separate", _KV),
    "mimo_v2_flash": Survey("module", "separate", _SWA, ("sliding_window", "sinks"),
                            routable=False,
                            note="sink biases on sliding and/or full layers by config"),
    "minicpm": Survey("module", "separate", _KV),
    "minicpm3": Survey("module", "mla", _KV, ("mla_expanded_cache",)),
    "minimax": Survey("module", "separate", _KV, ("qk_norm (optional)",)),
    "minimax_m3_vl": Survey(
        "module", "separate", ("CacheList(KVCache, KVCache)", "CacheList(KVCache)"),
        ("sparse_indexer", "qk_norm (optional)"),
        note="sparse layers keep indexer keys in the CacheList's second KVCache and "
             "pass a boolean block top-k mask; attention gets the first KVCache, whose "
             ".keys the model reassigns (mx.depends)"),
    "ministral3": Survey("module", "separate", _SWA, ("sliding_window",)),
    "mistral3": Survey("module", "separate", _KV, note="llama, ministral3 or mistral4 "
                                                       "text model by text_config"),
    "mistral4": Survey("module", "mla", _KV, ("mla_latent_cache",), routable=False,
                       note="prefill attends over keys rebuilt from the latent, decode "
                            "over the latent with a float score bias"),
    "mixtral": Survey("module", "separate", _KV),
    "muse_glimmer": Survey("module", "separate", _SWA, ("sliding_window", "qk_norm",
                                                        "no_rope_layers"),
                           note="full layers have no RoPE; gated output"),
    "muse_spark": Survey("module", "fused", _SWA, ("sliding_window", "qk_norm",
                                                   "no_rope_layers"),
                         runs=_METAL,
                         note="qkvg_proj; q/k norm + RoPE is a Metal kernel; the vision "
                              "tower (not cached) calls mx.fast directly"),
    "nanbeige": Survey("module", "separate", _KV),
    "nanochat": Survey("module", "separate", _KV, ("qk_norm",)),
    "nemotron": Survey("module", "separate", _KV),
    "nemotron-nas": Survey("module", "separate", _KV, ("uneven_caches",),
                           note="layers whose attention is a no-op get no cache"),
    "nemotron_h": Survey("module", "separate", _REC, ("recurrent_layers", "no_rope",
                                                      "uneven_caches"),
                         note="Mamba2, attention (no RoPE) and MLP/MoE-only layers; "
                              "MLP-only layers get no cache"),
    "olmo": Survey("manual", "fused", _KV, routable=False,
                   runs="no: prefill fails in mlx_lm (olmo.py adds the 'causal' mask "
                        "string to the scores); single-token steps run",
                   note="att_proj; attention computed in the model (matmul + softmax); "
                        "imports hf_olmo only to check it is installed"),
    "olmo2": Survey("module", "separate", _KV, ("qk_norm",)),
    "olmo3": Survey("module", "separate", _SWA, ("sliding_window", "qk_norm")),
    "olmo_hybrid": Survey("module", "separate", _REC, ("recurrent_layers", "qk_norm"),
                          note="Gated DeltaNet layers plus attention layers"),
    "olmoe": Survey("module", "separate", _KV, ("qk_norm",)),
    "openelm": Survey("module", "fused", _KV, ("qk_norm (optional)",),
                      note="per-layer head counts"),
    "phi": Survey("module", "separate", _KV),
    "phi3": Survey("module", "fused", _KV),
    "phi3small": Survey(
        "mixed", "fused", _KV, ("block_sparse",), routable=False,
        note="every dense_attention_every_n_layers-th layer (from 0) computes "
             "block-sparse attention itself, the rest call the module-level name; the "
             "block-sparse path adds the boolean causal mask as numbers, so a query sees "
             "later tokens of its block and cached and uncached logits differ"),
    "phimoe": Survey("module", "separate", _KV),
    "phixtral": Survey("module", "fused", _KV),
    "pixtral": Survey("module", "separate", _KV, note="llama's text model"),
    "plamo": Survey("module", "separate", _KV, ("kv_tiled",), routable=False,
                    note="mx.tile repeats the K/V heads n_shared_head times after the "
                         "cache, so query head h uses KV head h mod n_kv"),
    "plamo2": Survey("fast", "fused", _REC, ("recurrent_layers", "qk_norm"),
                     routable=False,
                     note="Mamba layers plus attention layers that call "
                          "mx.fast.scaled_dot_product_attention directly"),
    "plamo3": Survey("module", "fused", _SWA, ("sliding_window", "qk_norm"),
                     note="the sliding mask allows window + 1 keys but the "
                          "RotatingKVCache keeps window, so cached and uncached logits "
                          "differ once a sequence passes the window"),
    "prism_hadamard_qwen35": Survey("module", "separate", _REC,
                                    ("recurrent_layers", "qk_norm"),
                                    note="qwen3_5 with 2-bit Hadamard-packed linears"),
    "qwen": Survey("module", "fused", _KV),
    "qwen2": Survey("module", "separate", _KV),
    "qwen2_moe": Survey("module", "separate", _KV),
    "qwen2_vl": Survey("module", "separate", _KV, note="qwen2's text model"),
    "qwen3": Survey("module", "separate", _KV, ("qk_norm",)),
    "qwen3_5": Survey("module", "separate", _REC, ("recurrent_layers", "qk_norm"),
                      note="Gated DeltaNet layers plus gated attention layers"),
    "qwen3_5_moe": Survey("module", "separate", _REC, ("recurrent_layers", "qk_norm"),
                          note="as qwen3_5"),
    "qwen3_moe": Survey("module", "separate", _KV, ("qk_norm",)),
    "qwen3_next": Survey("module", "separate", _REC, ("recurrent_layers", "qk_norm"),
                         note="Gated DeltaNet layers plus gated attention layers"),
    "qwen3_vl": Survey("module", "separate", _KV, ("qk_norm",), note="qwen3's text model"),
    "qwen3_vl_moe": Survey("module", "separate", _KV, ("qk_norm",),
                           note="qwen3_moe's text model"),
    "recurrent_gemma": Survey("module", "separate", ("ArraysCache", "RotatingKVCache"),
                              ("sliding_window", "recurrent_layers"),
                              note="RG-LRU layers plus local (windowed) attention"),
    "rwkv7": Survey("none", "none", ("ArraysCache",), ("recurrent_layers",),
                    routable=False),
    "seed_oss": Survey("module", "separate", _KV),
    "smollm3": Survey("module", "separate", _KV, ("no_rope_layers",),
                      note="every no_rope_layer_interval-th layer has no RoPE"),
    "solar_open": Survey("module", "separate", _KV, ("qk_norm (optional)",),
                         note="glm4_moe's model"),
    "spark2_5": Survey("module", "fused", _SWA, ("sliding_window",),
                       note="q_k_v_proj; head-wise output gate"),
    "stablelm": Survey("module", "separate", _KV, ("qk_norm (optional)",),
                       note="casts queries and keys to float32 after the cache"),
    "starcoder2": Survey("module", "separate", _KV),
    "step3p5": Survey("module", "separate", _SWA, ("sliding_window", "qk_norm"),
                      note="head-wise output gate"),
    "talkie": Survey("module", "separate", _KV, ("qk_norm",),
                     note="q/k norm after RoPE, per-head query gain"),
    "telechat3": Survey("module", "separate", _KV),
    "youtu_llm": Survey("module", "mla", _KV, ("mla_expanded_cache",)),
}

# The attention path of each catalogued type, for code that only needs that.
ATTENTION_KIND: dict[str, str] = {t: s.path for t, s in SURVEY.items()}


def routable(model_type: str) -> bool:
    """Whether replacing the module-level name reaches all of ``model_type``'s attention."""
    entry = SURVEY.get(model_type)
    return entry is not None and entry.routable
