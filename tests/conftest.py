"""Shared test settings: method settings for tiny models, a prefill, and the method list.

A test that takes an argument named ``method`` and does not parametrize it itself runs
once per registered method, so a new method is picked up with no edit here.
"""

import os
import sys
from typing import Any

import mlx.core as mx
import pytest

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.adapter.prefill import prefill
from veloxquant_mlx.apps.blas import preload_for_pytest
from veloxquant_mlx.registry import methods

# Unit tests import the tiny in-process models from this folder.
sys.path.insert(0, os.path.dirname(__file__))

# Options that make each method compress something within a few dozen tokens of a tiny
# model (head_dim 32, 4 layers); a method not listed runs with its defaults.
SMALL_OPTIONS: dict[str, dict[str, Any]] = {
    "affine": dict(bits=4, group_size=32, window=4),
    "kivi": dict(bits=4, group_size=32, window=32),
    "streaming": dict(window=16, sink=2),
    "snapkv": dict(capacity=16, window=4),
    "xkv": dict(group_layers=2, block=16, window=8),
    "minicache": dict(window=8),
    "xquant": dict(bits=4, group_size=32),
    "xquant_cl": dict(bits=4, group_size=32),
    "turboquant": dict(window=8),
}

# Settings under which a method keeps (nearly) everything of a 40-token prompt: 8-bit
# codes, eviction that evicts nothing, full-rank factors, merging that merges nothing.
LOSSLESS_OPTIONS: dict[str, dict[str, Any]] = {
    "affine": dict(bits=8, group_size=32),
    "kivi": dict(bits=4, group_size=32, window=128),
    "streaming": dict(window=1000),
    "snapkv": dict(capacity=1000),
    "xkv": dict(group_layers=2, block=16, rank_k=16, rank_v=16, window=32),
    "minicache": dict(window=1000),
    "xquant": dict(bits=8, group_size=32),
    "xquant_cl": dict(bits=8, group_size=32),
    "turboquant": dict(quantizer="affine", k_bits=8, v_bits=8),
}

PROMPT = [(i * 37 + 11) % 120 + 1 for i in range(40)]


def pytest_configure(config):
    # Re-run pytest with an optimized BLAS preloaded (MLX's Linux CPU wheel bundles the
    # slow reference BLAS); a no-op on macOS and where none is installed.
    preload_for_pytest(config)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "method" not in metafunc.fixturenames:
        return
    for marker in metafunc.definition.iter_markers("parametrize"):
        names = marker.args[0]
        if "method" in (names.replace(" ", "").split(",") if isinstance(names, str) else names):
            return
    metafunc.parametrize("method", list(methods()))


def small_config(method: str, **extra: Any) -> KVCacheConfig:
    """``method`` with ``SMALL_OPTIONS``; a method that cannot be built fails the test."""
    return KVCacheConfig(method, **{**SMALL_OPTIONS.get(method, {}), **extra})


def lossless_config(method: str, **extra: Any) -> KVCacheConfig:
    return KVCacheConfig(method, **{**LOSSLESS_OPTIONS.get(method, {}), **extra})


def run_prefill(model: Any, caches: list[Any], tokens: list[int], chunk: int = 16) -> mx.array:
    """The package's prefill with ``tokens`` in fixed chunks of ``chunk`` (the last token
    with the last chunk, not alone as mlx_lm feeds it); the last position's logits."""
    return prefill(model, caches, tokens, chunk, last_alone=False)


def prefill_then_decode(model: Any, caches: list[Any], tokens: mx.array, n: int,
                        chunk: int | None = None) -> mx.array:
    """Every position's logits: the first ``n`` of ``tokens`` (``[B, T]``) in chunks of
    ``chunk`` (default: one chunk), then one decode step per remaining token."""
    outs = [prefill(model, caches, tokens[:, :n], chunk or n, last_alone=False,
                    all_logits=True)]
    outs += [model(tokens[:, t:t + 1], cache=caches) for t in range(n, tokens.shape[1])]
    return mx.concatenate(outs, axis=1)
