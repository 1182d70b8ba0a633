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


def masked_softmax(scores: mx.array, mask: Any = None) -> mx.array:
    """Softmax over the last axis of ``scores`` [..., L, S] after mlx_lm's ``mask``.

    Scores grouped by KV head ([B, H, rep, L, S]) take a 4-D mask [B, Hq or 1, L, S]
    regrouped to match. A boolean mask drops positions; an additive one is added in
    the scores' dtype.
    """
    L, S = scores.shape[-2:]
    mask = fit_mask(mask, L, S)
    if isinstance(mask, str):
        mask = causal_mask(L, S)
    if mask is not None:
        if mask.ndim == 4 and scores.ndim == 5:
            H, rep = scores.shape[1], scores.shape[2]
            mask = (mask[:, :, None] if mask.shape[1] == 1
                    else mask.reshape(mask.shape[0], H, rep, *mask.shape[2:]))
        scores = (mx.where(mask, scores, -mx.inf) if mask.dtype == mx.bool_
                  else scores + mask.astype(scores.dtype))
    return mx.softmax(scores, axis=-1, precise=True)


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
    return masked_softmax(scores, mask).reshape(B, Hq, L, keys.shape[2])


def split_attention(queries: mx.array, parts: list[tuple[Any, Any]], scale: float,
                    mask: Any = None, quantized_matmul: bool = False) -> mx.array:
    """Attention over several key/value parts without concatenating them.

    Each part is ``(keys, values)``: dense ``[B, H, S_i, D]`` arrays (any dtype, cast
    to the query dtype) or ``ops.quantize.Quantized`` codes quantized per token along
    the head dimension. Only the small ``[.., L, S]`` scores are joined, so one softmax
    covers every part and no full-size key/value copy is built. Quantized parts are
    multiplied on their codes with ``mx.quantized_matmul`` when ``quantized_matmul``,
    otherwise, when a token has one group (``group_size == head_dim``) and bits divide
    32, the scale and bias are applied to the small scores instead of to every code:
    ``q . (s c + b) = s (q . c) + b sum(q)`` and ``sum_t p_t (s_t c_t + b_t) =
    (p s) @ c + p @ b``, so the only full-size transient is the codes as floats.
    Other quantized parts are dequantized into a transient.
    """
    from . import quantize as q

    B, Hq, L, D = queries.shape
    first = parts[0][0]
    H = (first.codes if isinstance(first, q.Quantized) else first).shape[1]
    dt = queries.dtype
    qr = (queries * scale).reshape(B, H, Hq // H, L, D)

    def matmul(x: mx.array, part: Any, transpose: bool) -> mx.array:
        if not isinstance(part, q.Quantized):
            w = part.astype(dt)[:, :, None]
            return x @ (w.swapaxes(-1, -2) if transpose else w)
        if quantized_matmul:
            return mx.quantized_matmul(
                x, part.codes[:, :, None], part.scales[:, :, None].astype(dt),
                part.biases[:, :, None].astype(dt), transpose=transpose,
                group_size=part.group_size, bits=part.bits)
        if part.scales.shape[-1] == 1 and 32 % part.bits == 0:
            c = q.code_values(part, dt)[:, :, None]  # [B, H, 1, S, D]
            s = part.scales.astype(dt)[:, :, None]  # [B, H, 1, S, 1]
            b = part.biases.astype(dt)[:, :, None]
            if transpose:  # scores [.., L, S]
                return ((x @ c.swapaxes(-1, -2)) * s.swapaxes(-1, -2)
                        + x.sum(-1, keepdims=True) * b.swapaxes(-1, -2))
            return (x * s.swapaxes(-1, -2)) @ c + x @ b  # [.., L, Dv]
        deq = q.dequantize_unpacked if 32 % part.bits == 0 else q.dequantize
        w = deq(part, dt)[:, :, None]
        return x @ (w.swapaxes(-1, -2) if transpose else w)

    scores = [matmul(qr, k, True) for k, _ in parts]
    sizes = [s.shape[-1] for s in scores]
    scores = scores[0] if len(scores) == 1 else mx.concatenate(scores, axis=-1)
    probs = masked_softmax(scores, mask)
    out, start = None, 0
    for (_, v), n in zip(parts, sizes):
        part = matmul(probs[..., start:start + n], v, False)
        out = part if out is None else out + part
        start += n
    return out.reshape(B, Hq, L, -1)
