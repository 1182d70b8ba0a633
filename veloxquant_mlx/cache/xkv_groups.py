"""Which layers share one xKV basis: contiguous runs, or groups by measured similarity."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from veloxquant_mlx.cache.base import LayerInfo
from veloxquant_mlx.ops.rope import unrotate


def _kv_shape(info: LayerInfo) -> tuple[int, int, int]:
    return (info.n_kv_heads, info.head_dim, info.v_head_dim)


def contiguous_groups(layers: list[LayerInfo], G: int) -> list[list[int]]:
    """Runs of up to ``G`` consecutive layers (indices into ``layers``) of one KV shape.

    ``layers`` holds only the layers xKV compresses, so layers of another kind in
    between (recurrent, sliding-window) are skipped; a shape change starts a group.
    """
    groups: list[list[int]] = []
    for i, info in enumerate(layers):
        last = groups[-1] if groups else None
        if last and len(last) < G and _kv_shape(layers[last[0]]) == _kv_shape(info):
            last.append(i)
        else:
            groups.append([i])
    return groups


def linear_cka(x: mx.array, y: mx.array) -> float:
    """Linear CKA of two ``[S, D]`` activations (1 = same up to rotation and scale)."""
    x = x - x.mean(axis=0)
    y = y - y.mean(axis=0)
    num = (y.T @ x).square().sum()
    den = mx.sqrt((x.T @ x).square().sum() * (y.T @ y).square().sum())
    return (num / mx.maximum(den, 1e-30)).item()


def cka_groups(model: Any, layers: list[LayerInfo], G: int, pre_rope: bool = True,
               n_tokens: int = 256, seed: int = 0) -> list[list[int]]:
    """Groups of ``G`` layers (indices into ``layers``) by the CKA similarity of their
    keys on a calibration prompt run through a dense cache.

    The prompt is ``n_tokens`` pseudo-random token ids (fixed seed; no tokenizer is
    at hand when caches are built). Greedy: the first layer not yet grouped seeds a
    group and takes the ``G - 1`` ungrouped layers most similar to it. Groups need
    not be contiguous; members are ordered by layer index (the leader is the first).
    """
    from mlx_lm.models.cache import make_prompt_cache

    vocab = getattr(getattr(model, "args", None), "vocab_size", 256)
    tokens = mx.random.randint(0, vocab, (1, n_tokens), key=mx.random.key(seed))
    caches = make_prompt_cache(model)
    model(tokens, cache=caches)
    feats = []
    for info in layers:
        k = caches[info.layer_idx].keys[..., :n_tokens, :].astype(mx.float32)
        if pre_rope and info.rope_dims is not None:
            k = unrotate(k, info.rope_dims, info.rope_base, info.rope_traditional,
                         info.rope_scale, 0)
        feats.append(k[0].transpose(1, 0, 2).reshape(n_tokens, -1))
    n = len(layers)
    sim = [[linear_cka(feats[i], feats[j]) if i != j else 1.0 for j in range(n)]
           for i in range(n)]
    free = list(range(n))
    groups = []
    while free:
        seed_layer = free.pop(0)
        same = [j for j in free if _kv_shape(layers[j]) == _kv_shape(layers[seed_layer])]
        best = sorted(same, key=lambda j: -sim[seed_layer][j])[:G - 1]
        free = [j for j in free if j not in best]
        groups.append(sorted([seed_layer, *best]))
    return groups

