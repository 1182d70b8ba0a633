"""Attention numerics shared by caches that run their own attention."""

from __future__ import annotations

from typing import Any

import mlx.core as mx


def causal_mask(n_queries: int, n_keys: int) -> mx.array:
    """Boolean [L, S] mask where the L queries are the last L of the S key positions."""
    q = mx.arange(n_keys - n_queries, n_keys)[:, None]
    k = mx.arange(n_keys)[None]
    return q >= k


def fit_mask(mask: Any, n_queries: int, n_keys: int) -> Any:
    """Adapt mlx_lm's mask to a cache that holds ``n_keys`` positions.

    ``"causal"`` and ``None`` carry over (the kernel aligns causal masks to the end);
    an array mask wider than the held keys keeps its last ``n_keys`` columns.
    """
    if mask is None or isinstance(mask, str):
        if mask == "causal" and n_queries == 1:
            return None
        return mask
    if mask.shape[-1] != n_keys:
        mask = mask[..., -n_keys:]
    return mask


def sdpa(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
         mask: Any = None) -> mx.array:
    """Grouped-query attention over dense keys/values (cast to the query dtype)."""
    if keys.dtype != queries.dtype:
        keys = keys.astype(queries.dtype)
    if values.dtype != queries.dtype:
        values = values.astype(queries.dtype)
    mask = fit_mask(mask, queries.shape[2], keys.shape[2])
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def attention_weights(queries: mx.array, keys: mx.array, scale: float,
                      mask: Any = None) -> mx.array:
    """Softmax attention probabilities [B, Hq, L, S] (for scoring, e.g. SnapKV)."""
    B, Hq, L, D = queries.shape
    Hkv = keys.shape[1]
    rep = Hq // Hkv
    q = queries.reshape(B, Hkv, rep, L, D).astype(mx.float32)
    scores = (q * scale) @ keys.astype(mx.float32)[:, :, None].swapaxes(-1, -2)
    S = keys.shape[2]
    mask = fit_mask(mask, L, S)
    if isinstance(mask, str):
        mask = causal_mask(L, S)
    if mask is not None:
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, -mx.inf)
        else:
            scores = scores + mask
    probs = mx.softmax(scores, axis=-1, precise=True)
    return probs.reshape(B, Hq, L, S)
