"""Tiny random models for unit tests, on top of the architecture catalogue.

``tiny_model(model_type)`` is the catalogue's model of that type (``architectures``)
at the unit tests' sizes (``UNIT_SIZES``: four layers, head width 32 so that groups of
32 fit, a 128-token vocabulary): big enough for cross-layer methods and quantization
groups, small enough to build in milliseconds. Types that mlx_lm runs with another
type's module (``mistral`` with ``llama``) are built as mlx_lm loads them.
"""

from __future__ import annotations

from typing import Any

import mlx.nn as nn

from veloxquant_mlx.testing.architectures import build_tiny

UNIT_SIZES: dict[str, Any] = dict(
    hidden_size=128, num_hidden_layers=4, intermediate_size=256, num_attention_heads=4,
    num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=128, rope_theta=10000.0,
    head_dim=32, tie_word_embeddings=True, max_position_embeddings=4096,
)
# Per type, what the unit sizes need besides (a window the tests' prompts cross).
_TYPE_SIZES: dict[str, dict[str, Any]] = {
    "gemma3_text": dict(sliding_window=16, sliding_window_pattern=2, query_pre_attn_scalar=32,
                        rope_local_base_freq=10000.0),
}


def _module_type(model_type: str) -> str:
    from mlx_lm.utils import MODEL_REMAPPING

    return MODEL_REMAPPING.get(model_type, model_type)


def tiny_config(model_type: str = "llama", **overrides: Any) -> dict[str, Any]:
    """The arguments ``tiny_model`` builds from (what a ``config.json`` of it holds)."""
    return {**UNIT_SIZES, **_TYPE_SIZES.get(model_type, {}), **overrides,
            "model_type": model_type}


def tiny_model(model_type: str = "llama", seed: int = 0, **overrides: Any) -> nn.Module:
    """A random ``model_type`` model at the unit sizes, ``overrides`` applied; the
    weights come from mlx's generator seeded with ``seed``."""
    return build_tiny(_module_type(model_type), seed,
                      overrides=tiny_config(model_type, **overrides))
