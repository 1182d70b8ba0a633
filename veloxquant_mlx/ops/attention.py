"""Attention numerics shared by caches that run their own attention.

A cache hands what it holds to :func:`attend_parts` as *parts* laid one after the other
along the token axis (keys and values may be cut at different places, as in KIVI); the
part types and the ``Slot`` form caches hand over are in ``ops.parts``. Which engine runs
a call (the fused CPU op, these MLX paths or ``mx.fast``) is decided by ``ops.dispatch``;
:func:`attend_on_mlx` is this module's engine without asking.

Two paths, neither builds a dequantized copy of the cache or a full score matrix:

- decode (at most ``DECODE_ROWS`` query rows per KV head): each part multiplies its codes
  as floats, ``q @ K^T`` with the codes as the transposed operand (scores come out
  ``[rows, S]``, as softmax reads them; the keys-major ``K @ q^T`` with a transpose back
  was 2-10% slower per layer on this CPU, measured with cold caches), and applies
  scales and biases to the small scores and probabilities. Codes of 2, 4 and 8 bits are
  read as bytes, one float array per position in a byte (``quantize.byte_phases``), so
  nothing is interleaved: the queries are sliced instead. The transient is one part's
  codes as float32, freed within the layer.
- prefill (more rows): key blocks of ``KEY_BLOCK`` tokens with an online softmax; each
  block is decoded on its own, so memory is bounded by a block whatever the context.

The softmax exponent is a compiled polynomial (:func:`exp_nonpositive`, 1.9e-7 relative
error): ``mx.exp`` is scalar on this CPU build and was the largest single cost of decode
attention (docs/cpu-performance.md). For the same reason, attention over dense arrays
(:func:`sdpa`, :func:`masked_softmax`) runs on these kernels on a CPU in float32 where
they are faster than ``mx.fast.scaled_dot_product_attention``; other backends and dtypes
keep MLX's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from veloxquant_mlx.ops import dispatch
from veloxquant_mlx.ops.kernels import on_gpu
from veloxquant_mlx.ops.parts import DensePart, Part, as_part

DECODE_ROWS = 16  # query rows per KV head (heads per group x tokens) of the decode path
KEY_BLOCK = 4096  # most keys per block of the prefill path
BLOCK_FLOATS = 1 << 19  # score floats per block of the prefill path (2 MB)
_LOG2E = 1.4426950408889634
# 2^f on [0, 1): minimax polynomial, highest degree first.
_EXP2 = (1.8775767e-3, 8.9893397e-3, 5.5826318e-2, 2.4015361e-1, 6.9315308e-1, 9.9999994e-1)
FAST_DECODE_KEYS = dispatch.FAST_DECODE_KEYS  # where sdpa leaves mx.fast (ops.dispatch)
_FLOOR = -1e30  # a row max below this is a fully masked row: its output is 0, not NaN
_TINY = 1e-30


def _floor(t: mx.array) -> mx.array:
    """``floor(t)`` for ``-127 <= t <= 0`` as floats: truncation (a cast, vectorized)
    less one where it rounded up. ``mx.floor`` is a scalar loop on this CPU build, 4x
    the cost of the rest of the kernel it sat in (measured)."""
    i = t.astype(mx.int32).astype(mx.float32)
    return mx.where(i > t, i - 1.0, i)


def _exp2_fraction(x: mx.array) -> mx.array:
    """``2^f``, ``f`` the fractional part of ``x * log2(e)`` (clamped at -127)."""
    t = mx.maximum(x * _LOG2E, -127.0)
    f = t - _floor(t)
    p = _EXP2[0] * f + _EXP2[1]
    for c in _EXP2[2:]:
        p = p * f + c
    return p


def _exp2_exponent(x: mx.array) -> mx.array:
    """Float32 bits of ``2^n``, ``n`` the integer part; clamping at -127 makes the
    exponent bits 0, so ``exp(-inf)`` (a masked score) is exactly 0."""
    t = mx.maximum(x * _LOG2E, -127.0)
    return (_floor(t).astype(mx.int32) + 127) << 23


# Shapeless: decode lengths change every step, and a retrace per shape costs ~10 ms.
# Two single-output kernels: a two-output one materializes its intermediates (6x the
# input's memory instead of 2x, measured).
_exp2_kernels = (mx.compile(_exp2_fraction, shapeless=True),
                 mx.compile(_exp2_exponent, shapeless=True))


def exp_nonpositive(x: mx.array) -> mx.array:
    """``exp(x)`` for ``x <= 0`` (or ``-inf``): a compiled ``2^n * p(f)``, max relative
    error 1.9e-7 against ``mx.exp`` (float32); other dtypes use ``mx.exp``."""
    if x.dtype != mx.float32:
        return mx.exp(x)
    fraction, exponent = _exp2_kernels
    return fraction(x) * exponent(x).view(mx.float32)  # a bit view cannot be traced


def causal_mask(n_queries: int, n_keys: int) -> mx.array:
    """Boolean [L, S] mask where the L queries are the last L of the S key positions."""
    q_pos = mx.arange(n_keys - n_queries, n_keys)[:, None]
    k_pos = mx.arange(n_keys)[None]
    return q_pos >= k_pos


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


def grouped_mask(mask: Any, H: int, rep: int, L: int, S: int, start: int = 0,
                 stop: int | None = None) -> mx.array | None:
    """mlx_lm's mask as an array broadcastable to scores ``[B, H, rep, L, stop - start]``
    (key columns ``start:stop`` of ``S``); a 4-D mask ``[B, Hq or 1, L, S]`` is regrouped
    by KV head."""
    stop = S if stop is None else stop
    mask = fit_mask(mask, L, S)
    if mask is None:
        return None
    if isinstance(mask, str):
        # A constant, not arange nodes: those made MLX evaluate every key block of the
        # prefill path at once (peak 3x higher, measured).
        return mx.array(np.arange(S - L, S)[:, None] >= np.arange(start, stop)[None])
    if mask.ndim == 4:
        mask = _by_kv_head(mask, H, rep)
    return mask if (start, stop) == (0, S) else mask[..., start:stop]


def _by_kv_head(mask: mx.array, H: int, rep: int) -> mx.array:
    """A 4-D mask ``[B, Hq or 1, L, S]`` as ``[B, H or 1, rep or 1, L, S]``."""
    return (mask[:, :, None] if mask.shape[1] == 1
            else mask.reshape(mask.shape[0], H, rep, *mask.shape[2:]))


def _apply_mask(scores: mx.array, mask: mx.array | None) -> mx.array:
    if mask is None:
        return scores
    if mask.dtype == mx.bool_:
        return mx.where(mask, scores, -mx.inf)
    return scores + mask.astype(scores.dtype)


def own_kernels(dtype: mx.Dtype) -> bool:
    """Whether attention over dense arrays of ``dtype`` runs on this module's kernels:
    float32 on a CPU, where MLX's softmax exponent is a scalar loop."""
    return dtype == mx.float32 and not on_gpu()


def sdpa_on_own_kernels(dtype: mx.Dtype, n_queries: int, n_keys: int) -> bool:
    """Whether :func:`sdpa` runs this module's kernels for these shapes (else mx.fast):
    the dispatcher's table for one sequence of dense arrays."""
    s = dispatch.Situation(
        backend="gpu" if on_gpu() else "cpu", dtype="float32" if dtype == mx.float32 else "other",
        extension="off", mask="unmasked", queries="step" if n_queries == 1 else "chunk", rows="one",
        parts="arrays", store="short" if n_keys <= FAST_DECODE_KEYS else "long")
    return dispatch.decide(s) == dispatch.PARTS


def masked_softmax(scores: mx.array, mask: Any = None) -> mx.array:
    """Softmax over the last axis of ``scores`` [..., L, S] after mlx_lm's ``mask``.

    Scores grouped by KV head ([B, H, rep, L, S]) take a 4-D mask [B, Hq or 1, L, S]
    regrouped to match. A boolean mask drops positions; an additive one is added in
    the scores' dtype. On a CPU in float32, score arrays of at most ``BLOCK_FLOATS``
    (decode steps) take :func:`exp_nonpositive`, and there a row with every position
    masked gets zeros (``mx.softmax``: NaN).
    """
    L, S = scores.shape[-2:]
    mask = fit_mask(mask, L, S)
    if isinstance(mask, str):
        mask = causal_mask(L, S)
    if mask is not None and mask.ndim == 4 and scores.ndim == 5:
        mask = _by_kv_head(mask, scores.shape[1], scores.shape[2])
    scores = _apply_mask(scores, mask)
    # Large score arrays (prompt chunks) keep mx.softmax: one op, where the compiled
    # exponent's intermediates raised xKV's prefill peak from 312 to 727 MiB (measured).
    if not own_kernels(scores.dtype) or scores.size > BLOCK_FLOATS:
        return mx.softmax(scores, axis=-1, precise=True)
    e, den = _row_exp(scores)
    return e / mx.maximum(den, _TINY)


def _row_exp(scores: mx.array) -> tuple[mx.array, mx.array]:
    """``exp(scores - row max)`` and its row sums; a fully masked row gives zeros."""
    m = mx.maximum(scores.max(axis=-1, keepdims=True), _FLOOR)
    e = exp_nonpositive(scores - m)
    return e, e.sum(axis=-1, keepdims=True)


def sdpa(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
         mask: Any = None, label: str = "") -> mx.array:
    """Grouped-query attention over dense keys/values (cast to the query dtype), on the
    engine ``ops.dispatch`` picks: this module's kernels (:func:`attend_on_mlx`) or
    ``mx.fast.scaled_dot_product_attention``."""
    if keys.dtype != queries.dtype:
        keys = keys.astype(queries.dtype)
    if values.dtype != queries.dtype:
        values = values.astype(queries.dtype)
    L, S = queries.shape[2], keys.shape[2]
    mask = fit_mask(mask, L, S)
    engine = dispatch.route(queries, "arrays", mask, keys.shape[1], S, label=label or "sdpa",
                            gpu=on_gpu())
    if engine == dispatch.PARTS:
        return attend_on_mlx(queries, [DensePart(keys)], [DensePart(values)], scale, mask)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def attention_weights(queries: mx.array, keys: mx.array, scale: float,
                      mask: Any = None) -> mx.array:
    """Softmax attention probabilities [B, Hq, L, S] (for scoring, e.g. SnapKV)."""
    B, Hq, L, D = queries.shape
    Hkv = keys.shape[1]
    rep = Hq // Hkv
    qr = queries.reshape(B, Hkv, rep, L, D).astype(mx.float32)
    scores = (qr * scale) @ keys.astype(mx.float32)[:, :, None].swapaxes(-1, -2)
    return masked_softmax(scores, mask).reshape(B, Hq, L, keys.shape[2])


# ------------------------------------------------------------------ attention
def decodes_at_once(n_query_heads: int, n_kv_heads: int, n_queries: int) -> bool:
    """Whether :func:`attend_parts` takes its decode path (all scores at once)."""
    return (n_query_heads // n_kv_heads) * n_queries <= DECODE_ROWS


def attend_parts(queries: mx.array, keys: Sequence[Part], values: Sequence[Part],
                 scale: float, mask: Any = None,
                 value_index: mx.array | None = None, label: str = "") -> mx.array:
    """Attention of ``queries`` ``[B, Hq, L, D]`` over key parts and value parts that
    each cover the same tokens in order; ``mask`` as mlx_lm passes it. Returns
    ``[B, Hq, L, Dv]``; a query row with every key masked gets zeros. The engine is the
    one ``ops.dispatch`` picks: the fused CPU op or :func:`attend_on_mlx` (which takes
    ``value_index``)."""
    if value_index is None:
        engine = dispatch.route(queries, dispatch.part_kind(keys, values), mask,
                                keys[0].heads, sum(k.n for k in keys), label=label,
                                gpu=on_gpu())
        out = (dispatch.fused_rows(queries, scale, [(keys, values)], mask)
               if engine == dispatch.FUSED else None)
        if out is not None:
            return out
    return attend_on_mlx(queries, keys, values, scale, mask, value_index)


def attend_on_mlx(queries: mx.array, keys: Sequence[Part], values: Sequence[Part],
                  scale: float, mask: Any = None,
                  value_index: mx.array | None = None) -> mx.array:
    """:func:`attend_parts` on MLX's ops (the ``parts`` engine): each part multiplies as
    it holds its codes (packed or float blocks). ``value_index`` (broadcasting to
    ``[B, H, 1, S_v]``): value position -> key position (``S``: none), for batches whose
    key and value layouts differ (``ops.batch_parts``); decode path only."""
    B, Hq, L, D = queries.shape
    H = keys[0].heads
    qr = (queries * scale).reshape(B, H, Hq // H, L, D)
    if decodes_at_once(Hq, H, L):
        out = _decode(qr, keys, values, mask, value_index)
    elif value_index is not None:
        raise ValueError(f"value_index needs the decode path: {Hq // H} query heads per "
                         f"KV head x {L} queries > {DECODE_ROWS}")
    else:
        out = _blocked(qr, keys, values, mask)
    return out.reshape(B, Hq, L, -1)


def _through(e: mx.array, value_index: mx.array) -> mx.array:
    """Probabilities ``[B, H, rows, S]`` read at the key position of each value position
    (a zero column for padding); ``value_index`` broadcasts to ``[B, H, 1, S_v]``."""
    B, H, rows, _ = e.shape
    e = mx.concatenate([e, mx.zeros((B, H, rows, 1), e.dtype)], axis=-1)
    idx = mx.broadcast_to(value_index, (B, H, rows, value_index.shape[-1]))
    return mx.take_along_axis(e, idx, axis=-1)


def _decode(qr: mx.array, keys: Sequence[Part], values: Sequence[Part],
            mask: Any, value_index: mx.array | None = None) -> mx.array:
    B, H, rep, L, D = qr.shape
    rows = rep * L
    q = qr.reshape(B, H, rows, D)
    s = [k.key_scores(q) for k in keys]
    s = s[0] if len(s) == 1 else mx.concatenate(s, axis=-1)  # [B, H, rows, S]
    S = s.shape[-1]
    s = _apply_mask(s.reshape(B, H, rep, L, S), grouped_mask(mask, H, rep, L, S))
    e, den = _row_exp(s)
    e = e.reshape(B, H, rows, S)
    if value_index is not None:
        e = _through(e, value_index)
        S = e.shape[-1]
    out, start = None, 0
    for v in values:
        p = e if v.n == S else e[..., start:start + v.n]
        o = v.value_product(p)
        out = o if out is None else out + o
        start += v.n
    return out.reshape(B, H, rep, L, -1) / mx.maximum(den, _TINY)


def gather_tokens(parts: Sequence[Part], start: int, stop: int, dtype: mx.Dtype
                  ) -> mx.array:
    """Tokens ``start:stop`` across consecutive parts, as one array of ``dtype``."""
    pieces, offset = [], 0
    for p in parts:
        lo, hi = max(start, offset), min(stop, offset + p.n)
        if lo < hi:
            pieces.append(p.dense(lo - offset, hi - offset, dtype))
        offset += p.n
    return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=2)


def _settle(*arrays: mx.array) -> None:
    """Evaluate small arrays now: a lazy mask built from ``arange`` nodes made MLX
    evaluate every key block at once, and on the CPU MLX allocates each operation's
    output when it queues it, far ahead of the computation, so a block's running sums
    are settled before the next block's scores are queued. Not possible while a
    function is being compiled; then they stay lazy."""
    try:
        mx.eval(*arrays)
    except (RuntimeError, ValueError):
        pass


def _key_block(rows: int) -> int:
    """Keys per block for ``rows`` query rows: a score block of about ``BLOCK_FLOATS``
    (each of the few block-sized transients stays small), a multiple of 128."""
    return max(128, min(KEY_BLOCK, (BLOCK_FLOATS // max(rows, 1)) // 128 * 128))


def _blocked(qr: mx.array, keys: Sequence[Part], values: Sequence[Part],
             mask: Any) -> mx.array:
    """Online softmax over key blocks: no full score matrix and no decoded copy of the
    cache, only block-sized transients. Each block's scores wait for the previous
    block's running sums: untied, MLX computed the blocks' scores ahead of the sums and
    held several at once (a prompt chunk of 512 queries over 4096 keys peaked at 95 MiB,
    42 MiB tied; a 4096-token prefill of the embedded model with ``kivi:bits=4`` at 249
    MiB over the weights, 166 tied, and no slower; measured)."""
    B, H, rep, L, D = qr.shape
    S = sum(k.n for k in keys)
    step, gpu = _key_block(B * H * rep * L), on_gpu()
    if isinstance(mask, mx.array):
        _settle(mask)
    m = den = acc = None
    for t0 in range(0, S, step):
        t1 = min(S, t0 + step)
        q = qr if acc is None else mx.depends([qr], [acc, den])[0]
        kb = gather_tokens(keys, t0, t1, qr.dtype)
        s = q @ kb[:, :, None].swapaxes(-1, -2)  # [B, H, rep, L, block]
        # A causal block that every query sees whole needs no mask.
        if not (mask == "causal" and t1 <= S - L + 1):
            s = _apply_mask(s, grouped_mask(mask, H, rep, L, S, t0, t1))
        m_new = mx.maximum(s.max(axis=-1, keepdims=True), _FLOOR)
        if m is not None:
            m_new = mx.maximum(m, m_new)
        e = exp_nonpositive(s - m_new)
        del s
        pv = e @ gather_tokens(values, t0, t1, qr.dtype)[:, :, None]
        if m is None:
            den, acc = e.sum(axis=-1, keepdims=True), pv
        else:
            # mx.exp on this small array: the compiled kernel here raised the peak 3x
            # (measured; it changes the order MLX evaluates the blocks in).
            c = mx.exp(m - m_new)
            den, acc = den * c + e.sum(axis=-1, keepdims=True), acc * c + pv
        m = m_new
        if step < S and not gpu:
            _settle(acc, den, m)
    return acc / mx.maximum(den, _TINY)


def split_attention(queries: mx.array, parts: list[tuple[Any, Any]], scale: float,
                    mask: Any = None, quantized_matmul: bool = False) -> mx.array:
    """Attention over several key/value parts without concatenating them.

    Each part is ``(keys, values)`` covering the same tokens: dense ``[B, H, S_i, D]``
    arrays (any dtype, cast to the query dtype), ``ops.quantize.Quantized`` codes
    quantized per token along the head dimension (multiplied with
    ``mx.quantized_matmul`` when ``quantized_matmul``), or parts of this module. See
    :func:`attend_parts`.
    """
    keys = [as_part(k, quantized_matmul) for k, _ in parts]
    values = [as_part(v, quantized_matmul) for _, v in parts]
    return attend_parts(queries, keys, values, scale, mask)
