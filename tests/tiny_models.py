"""Tiny random mlx_lm models built in-process (no download), for fast unit tests."""

from __future__ import annotations

import importlib

import mlx.core as mx
import mlx.nn as nn

BASE = dict(
    hidden_size=128, num_hidden_layers=4, intermediate_size=256, num_attention_heads=4,
    num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=128, rope_theta=10000.0,
    head_dim=32, tie_word_embeddings=True, max_position_embeddings=4096,
)


def tiny_model(model_type: str = "llama", seed: int = 0, **overrides) -> nn.Module:
    """A random model of ``model_type`` (llama, qwen2, gemma3_text, mistral, ...)."""
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    params = dict(BASE, model_type=model_type)
    if model_type == "gemma3_text":
        params.update(sliding_window=16, sliding_window_pattern=2, query_pre_attn_scalar=32,
                      rope_local_base_freq=10000.0)
    params.update(overrides)
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(params))
    mx.eval(model.parameters())
    return model
