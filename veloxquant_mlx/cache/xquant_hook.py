"""The X hook: XQuant's way into mlx_lm attention layers.

XQuant caches a layer's attention input X instead of K and V, but mlx_lm's cache
interface only ever sees K and V. The hook swaps the class of each attention
instance (and of its block's input norm) for a subclass for as long as it is
installed (``cache.xquant.install_x_hook``; ``uninstall_x_hook`` restores the original
classes); any cache without ``update_x`` falls through to the original ``__call__``.
The parameter tree and weights are untouched. Two paths:

- llama, mistral and qwen2 attention (``XProjection``): the hook runs the attention
  itself, keys rebuilt with the model's ``k_proj`` (or from the latent of the K/V
  projections, ``latent``) and values attended in factor space. It holds no copy of a
  weight where the model's own (float) weight can be read in place.
- every other attention (``GenericXPath``, in ``cache.xquant_generic``: q/k norms, fused
  projections, soft-capping, sinks, MLA, ...): the cache holds X, and the earlier
  tokens' K and V are rematerialized through the module's own code (X stored as is, no
  latent).

A prompt chunk attends a key block at a time where the library's blocked kernels run
(``XProjection.attend``): each block's keys (and values) are rebuilt from the stored
form as the block is read, so no key or value of every held token exists at once.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from veloxquant_mlx.cache.base import depend_on_state
from veloxquant_mlx.cache.layer_inputs import rows_count, rows_of, whole
from veloxquant_mlx.cache.module_call import below, original_class
from veloxquant_mlx.cache.xquant_generic import X_HOOK
from veloxquant_mlx.ops import dispatch, native, rope
from veloxquant_mlx.ops import factors as fr
from veloxquant_mlx.ops.attention import (
    attend_on_mlx,
    decodes_at_once,
    fit_mask,
    masked_softmax,
    sdpa,
    sdpa_on_own_kernels,
)
from veloxquant_mlx.ops.parts import DensePart, RangePart, shared_by_heads


def weight_in_out(linear: nn.Module) -> mx.array:
    """``[in, out]`` float32 weight of a linear layer.

    A float32 ``nn.Linear`` gives a transposed view of its own weight (no new memory);
    a quantized or half-precision one gives a dequantized float32 copy.
    """
    if isinstance(linear, nn.QuantizedLinear):
        w = mx.dequantize(linear.weight, linear.scales, linear.get("biases"),
                          group_size=linear.group_size, bits=linear.bits,
                          mode=getattr(linear, "mode", "affine"))
    else:
        w = linear.weight
    return w.astype(mx.float32).T


def _bias(linear: nn.Module) -> mx.array | None:
    return linear.get("bias") if "bias" in linear else None


def _principal(w: mx.array) -> tuple[mx.array, mx.array]:
    """``V [out, out]`` and ``S [out]`` of the thin SVD ``w [in, out] = U S V^T``."""
    # The SVD of w^T [out, in] gives V as its (small) left factor; its large right
    # factor is dropped whole, so nothing keeps that buffer alive.
    v, s, _ = mx.linalg.svd(w.T, stream=mx.cpu)
    return v, s


class XProjection:
    """One layer's K/V path as XQuant rematerializes it.

    Without ``latent`` the cache holds X; keys are the model's own ``k_proj(X)``.
    With ``latent`` (GQA models, where X is wider than K and V together) it holds
    ``Z_k = X U_k`` and ``Z_v = X U_v`` of the SVDs ``W = U S V^T``, computed from the
    projections as ``(X W) V / S``; keys are rebuilt as ``(Z_k S) V_k^T + b_k``. Only
    ``V`` [out, out] and ``S`` per stream are held (exact: full rank of ``W``).
    """

    def __init__(self, attn: nn.Module, norm: nn.Module | None, latent: bool) -> None:
        self.attn = attn
        self.norm = norm
        self.n_kv_heads = attn.n_kv_heads
        self.bk, self.bv = _bias(attn.k_proj), _bias(attn.v_proj)
        wk, wv = weight_in_out(attn.k_proj), weight_in_out(attn.v_proj)
        self.in_dim, k_out = wk.shape
        v_out = wv.shape[1]
        self.v_dim = v_out // self.n_kv_heads
        self.residual: mx.array | None = None  # the block input, set by the norm tap
        self.latent_requested = latent
        self.latent = latent and k_out + v_out < self.in_dim
        if self.latent:
            self.vk, self.sk = _principal(wk)
            self.vv, self.sv = _principal(wv)
            self.wv = None
            held = [self.vk, self.sk, self.vv, self.sv]
        else:
            self.wv = wv  # factor-space values need W_v per KV head
            # A view of the model's own float32 weight costs nothing extra.
            held = [] if _is_view(attn.v_proj) else [wv]
            mx.eval(wv)
        # Computed once here: left lazy, the SVD would run inside the first forward pass.
        mx.eval(*held)
        self._held = held

    def kept_arrays(self) -> list[mx.array]:
        """Arrays this projection keeps alive beyond the model's own weights."""
        return list(self._held)

    @property
    def widths(self) -> tuple[int, ...]:
        """Widths of the arrays the cache holds per token."""
        if self.latent:
            return (self.vk.shape[0], self.vv.shape[0])
        return (self.in_dim,)

    def encode(self, x: mx.array) -> list[mx.array]:
        """What the cache stores of ``x`` (X itself, or its two latents), float32."""
        x = x.astype(mx.float32)
        if not self.latent:
            return [x]
        k, v = self.attn.k_proj(x).astype(mx.float32), self.attn.v_proj(x).astype(mx.float32)
        if self.bk is not None:
            k = k - self.bk
        if self.bv is not None:
            v = v - self.bv
        return [(k @ self.vk) / self.sk, (v @ self.vv) / self.sv]

    def normalize(self, h: mx.array) -> mx.array:
        """The block's input norm of ``h``, without the residual tap (every held token's,
        at each step: a plain RMS norm runs in one fused op where it can)."""
        if original_class(self.norm) is nn.RMSNorm:
            fused = native.rms_norm(h, self.norm.weight, self.norm.eps)
            if fused is not None:
                return fused
        return below(self.norm, X_HOOK).__call__(self.norm, h)

    def _heads(self, y: mx.array) -> mx.array:
        B, L, _ = y.shape
        return y.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)

    def _value_factor(self) -> mx.array:
        """``[w, out]`` factor with ``V = Z R_v + b_v``."""
        if not self.latent:
            return self.wv
        return self.sv[:, None] * self.vv.T

    def keys(self, parts: list[Any]) -> mx.array:
        """Pre-RoPE ``[B, n_kv_heads, S, head_dim]`` keys from ``encode``'s form (floats,
        or the cache's codes of it)."""
        if self.latent:
            # Z diag(s) V^T with the scales on the small factor: no pass over Z.
            k = fr.load_rows(parts[0]) @ (self.sk[:, None] * self.vk.T)
            k = k if self.bk is None else k + self.bk
        else:
            k = self.attn.k_proj(fr.load_rows(parts[0])).astype(mx.float32)
        return self._heads(k)

    def values(self, parts: list[Any]) -> mx.array:
        """``[B, n_kv_heads, S, v_head_dim]`` values from ``encode``'s form."""
        v = fr.load_rows(parts[-1]) @ self._value_factor()
        return self._heads(v if self.bv is None else v + self.bv)

    def rematerialize(self, parts: list[mx.array], dtype: mx.Dtype) -> tuple[mx.array,
                                                                            mx.array]:
        """Keys (RoPE from position 0) and values of the tokens stored as ``parts``."""
        keys = rope.apply(self.attn.rope, self.keys(parts))
        return keys.astype(dtype), self.values(parts).astype(dtype)

    def factored_pays(self, n_queries: int) -> bool:
        """Whether ``(P Z) R_v`` costs fewer flops than ``P (Z R_v)`` for ``Z [S, w]``.

        Per held token: ``n_queries * w`` against ``w * H * Dv + n_queries * Dv``.
        True for decode steps, false for long prefill chunks.
        """
        w = self.widths[-1]
        return n_queries * w < w * self.n_kv_heads * self.v_dim + n_queries * self.v_dim

    def attend(self, queries: mx.array, segments: list[tuple[int, list[Any]]],
               scale: float, mask: Any) -> mx.array:
        """Attention of RoPE'd ``queries`` over the tokens held in ``segments``: each is
        ``(first position, stored form)`` of consecutive tokens (the coded tokens, the
        window, the chunk itself), in order; the coded tokens' form may be their codes
        (``ops.quantize.Quantized``), decoded where read.

        Where it pays, the segments are never joined and the values never
        rematerialized: keys are rebuilt and rotated per segment, scores joined (small),
        the probabilities multiply each segment's stored form ``Z`` first and the small
        factor ``R_v`` once after, and the bias passes through unchanged because each
        row of probabilities sums to one. A prompt chunk the fused op does not take
        attends a key block at a time where MLX's kernels would (:meth:`_blocked`).
        """
        B, Hq, L, D = queries.shape
        fused = self._fused(queries, segments, scale, mask)
        if fused is not None:
            return fused
        if self._in_blocks(queries, segments):
            return self._blocked(queries, segments, scale, mask)
        segments = [(start, [whole(p) for p in parts]) for start, parts in segments]
        raw = [(start, self.keys(parts)) for start, parts in segments]  # before RoPE
        keys = [rope.apply(self.attn.rope, k, start) for start, k in raw]
        if not self.factored_pays(Hq * L):
            k = keys[0] if len(keys) == 1 else mx.concatenate(keys, axis=2)
            v = [self.values(parts) for _, parts in segments]
            return sdpa(queries, k, v[0] if len(v) == 1 else mx.concatenate(v, axis=2),
                        scale, mask)
        H = keys[0].shape[1]
        rep = Hq // H
        q = (queries.astype(mx.float32) * scale).reshape(B, H, rep * L, D)
        scores = [q @ k.astype(mx.float32).swapaxes(-1, -2) for k in keys]
        sizes = [s.shape[-1] for s in scores]
        scores = scores[0] if len(scores) == 1 else mx.concatenate(scores, axis=-1)
        probs = masked_softmax(scores.reshape(B, H, rep, L, -1), mask)
        probs = probs.reshape(B, H * rep * L, -1)
        mixed, i = None, 0
        for (_, parts), n in zip(segments, sizes):
            part = probs[..., i:i + n] @ fr.load_rows(parts[-1])
            mixed = part if mixed is None else mixed + part
            i += n
        return self._from_factor_space(mixed.reshape(B, H, rep * L, -1), queries)

    def _in_blocks(self, queries: mx.array, segments: list[tuple[int, list[Any]]]) -> bool:
        """Whether a prompt chunk attends a key block at a time: always in factor space
        (else every score over the held tokens exists at once), else where the dense
        attention would run the library's blocked kernels (a CPU in float32)."""
        B, Hq, L, _ = queries.shape
        if decodes_at_once(Hq, self.n_kv_heads, L):
            return False
        n = sum(rows_count(parts[0]) for _, parts in segments)
        return self.factored_pays(Hq * L) or sdpa_on_own_kernels(queries.dtype, L, n)

    def _blocked(self, queries: mx.array, segments: list[tuple[int, list[Any]]], scale: float,
                 mask: Any) -> mx.array:
        """Blocked attention (``ops.attention``'s prompt path) over parts that rebuild
        each key block from the stored form as it is read, rotated as over the whole
        segment: no key or value of every held token exists at once. Values are rebuilt
        the same way, or where the factor pays, the block's stored value form goes in
        and ``R_v`` is applied once after."""
        B, Hq, L, _ = queries.shape
        H = self.n_kv_heads
        factored = self.factored_pays(Hq * L)
        value = self._stored_values if factored else self._values_of
        keys, values = [], []
        for start, parts in segments:
            n = rows_count(parts[0])
            keys.append(_rebuilt(n, H, partial(self._rotated, start, parts)))
            values.append(_rebuilt(n, H, partial(value, parts)))
        mask = fit_mask(mask, L, sum(k.n for k in keys))
        if not factored:
            return attend_on_mlx(queries, keys, values, scale, mask)
        mixed = attend_on_mlx(queries.astype(mx.float32), keys, values, scale, mask)
        return self._from_factor_space(mixed.reshape(B, H, Hq // H * L, -1), queries)

    def _rotated(self, start: int, parts: list[Any], a: int, b: int) -> mx.array:
        """Keys of tokens ``a:b`` of a segment whose first position is ``start``, rotated
        over a run that starts on the segment's grid of ``rope.FINE`` positions and is
        long enough to take the same RoPE path as the whole segment: each key comes out
        bit for bit as rotated with all of them."""
        lo, hi = _rope_run(a, b, rows_count(parts[0]))
        k = rope.apply(self.attn.rope, self.keys([rows_of(parts[0], lo, hi)]), start + lo)
        return k if (lo, hi) == (a, b) else k[:, :, a - lo:b - lo]

    def _values_of(self, parts: list[Any], a: int, b: int) -> mx.array:
        return self.values([rows_of(parts[-1], a, b)])

    def _stored_values(self, parts: list[Any], a: int, b: int) -> mx.array:
        """The stored value form of tokens ``a:b`` for every KV head (a broadcast view)."""
        z = fr.load_rows(rows_of(parts[-1], a, b))[:, None]
        return mx.broadcast_to(z, (z.shape[0], self.n_kv_heads, *z.shape[2:]))

    def _key_part(self, start: int, parts: list[Any], batch: int) -> Any:
        """A segment's keys for the fused op: where the model's RoPE is a plain ``nn.RoPE``
        and the key factor is float, the stored rows with each head's factor (``Z M_h +
        b_h``, rebuilt and rotated by the op a few tokens at a time); else keys rebuilt
        here, rotated by the op as it reads them (or by the model's RoPE module)."""
        H = self.n_kv_heads
        rows = shared_by_heads(parts[0], H)
        tables = rope.module_tables(self.attn.rope, start)
        factor = self._key_factor(batch)
        if tables is not None and factor is not None and native.rebuildable(rows, factor[0]):
            return native.Placed(rows, project=factor[0], mean=factor[1], rope=tables)
        k = self.keys(parts)
        return (DensePart(rope.apply(self.attn.rope, k, start)) if tables is None
                else native.Placed(DensePart(k), rope=tables))

    def _key_factor(self, batch: int) -> tuple[DensePart, mx.array] | None:
        """``M`` of the keys ``Z M + b`` per KV head ``[batch, H, w, D]`` (views, no copy)
        and ``b`` per head ``[batch, H, 1, D]``; None where ``k_proj`` is not a float
        matrix (a quantized model's keys come from its own layer)."""
        if self.latent:
            m = self.sk[:, None] * self.vk.T
        elif _is_view(self.attn.k_proj):
            m = weight_in_out(self.attn.k_proj)
        else:
            return None
        return self._per_head(m, self.bk, batch)

    def _per_head(self, m: mx.array, bias: mx.array | None, batch: int
                  ) -> tuple[DensePart, mx.array]:
        """A factor ``[w, H * d]`` per KV head ``[batch, H, w, d]`` and its bias per head
        ``[batch, H, 1, d]`` (zeros without), views for the fused op."""
        H, w = self.n_kv_heads, m.shape[0]
        per_head = m.reshape(w, H, -1).transpose(1, 0, 2)[None]
        d = per_head.shape[-1]
        bias = bias if bias is not None else mx.zeros((H * d,), mx.float32)
        return (DensePart(mx.broadcast_to(per_head, (batch, H, w, d))),
                mx.broadcast_to(bias.reshape(1, H, 1, d), (batch, H, 1, d)))

    def _from_factor_space(self, mixed: mx.array, queries: mx.array) -> mx.array:
        """Outputs ``[B, Hq, L, Dv]`` from the probabilities' products with the stored
        value form, ``mixed`` ``[B, H, rows, w]``: its factor per KV head, then the bias."""
        B, Hq, L, _ = queries.shape
        H = mixed.shape[1]
        rv = self._value_factor()
        rv_heads = rv.reshape(rv.shape[0], H, self.v_dim).transpose(1, 0, 2)
        out = mixed @ rv_heads
        if self.bv is not None:
            out = out + self.bv.reshape(H, 1, -1)
        return out.reshape(B, Hq, L, -1).astype(queries.dtype)

    def _fused(self, queries: mx.array, segments: list[tuple[int, list[Any]]], scale: float,
               mask: Any) -> mx.array | None:
        """The attention in one fused CPU op (asked of ``ops.dispatch``): each segment's keys
        (:meth:`_key_part`), the stored value form as parts shared by the KV heads (codes
        read as codes) that carry ``R_v`` and ``b_v`` per head (the op adds ``(p Z_v)
        R_v + b_v``); None where it does not run (then MLX's ops)."""
        B, Hq, L, D = queries.shape
        H = self.n_kv_heads
        declined = None if self.factored_pays(Hq * L) else "the values' factor costs less first"
        n_keys = sum(rows_count(parts[0]) for _, parts in segments)
        causal = dispatch.fused_causal(queries, mask, H, n_keys, declined=declined)
        if causal is None:
            return None
        segments = [(start, [whole(p) for p in parts]) for start, parts in segments]
        rows = [shared_by_heads(parts[-1], H) for _, parts in segments]
        key_parts = [self._key_part(start, parts, B) for start, parts in segments]
        factor, bias = self._per_head(self._value_factor(), self.bv, B)
        values = [native.Placed(v, project=factor, mean=bias) for v in rows]
        q = (queries * scale).reshape(B, H, Hq // H * L, D)
        out = dispatch.fused_decode(q, key_parts, values, causal)
        return None if out is None else out.reshape(B, Hq, L, -1).astype(queries.dtype)


def _rope_run(a: int, b: int, n: int) -> tuple[int, int]:
    """The run of a segment's ``n`` tokens to rotate for tokens ``a:b``: it starts on a
    multiple of ``rope.FINE`` and holds at least ``2 * rope.FINE`` tokens, as a whole
    segment of that length would (``rope.rotate`` picks its path by the length)."""
    span = 2 * rope.FINE
    if n < span:
        return 0, n
    lo = max(0, min(a, max(b, span) - span)) // rope.FINE * rope.FINE
    return lo, max(b, lo + span)


def _is_view(linear: nn.Module) -> bool:
    """Whether ``weight_in_out(linear)`` is a view of the layer's own weight."""
    return not isinstance(linear, nn.QuantizedLinear) and linear.weight.dtype == mx.float32


def _projection(attn: nn.Module, cache: Any) -> XProjection:
    """The cache's own projection, not the one installed last: caches of another XQuant
    setting built later on the same model (``latent`` or not) change the hook's."""
    return getattr(cache, "proj", None) or attn._xquant


def _x_attention(attn: nn.Module, x: mx.array, residual: mx.array | None, cache: Any,
                 mask: Any) -> mx.array:
    """One sequence batch through an X-cache: ``[B, L, n_heads * v_head_dim]``."""
    proj = _projection(attn, cache)
    B, L, _ = x.shape
    queries = attn.q_proj(x).reshape(B, L, attn.n_heads, -1).transpose(0, 2, 1, 3)
    start = cache.offset
    queries = attn.rope(queries, offset=start)
    # The stored form of the earlier tokens, then the chunk itself with its exact X.
    segments = cache.update_x(x, residual, proj, False)
    segments.append((start, proj.encode(x)))
    out = depend_on_state(proj.attend(queries, segments, attn.scale, mask), cache)
    return out.transpose(0, 2, 1, 3).reshape(B, L, -1)


def _x_attention_batched(attn: nn.Module, x: mx.array, residual: mx.array | None,
                         batch: Any) -> mx.array:
    """A ``BatchedCache`` of X-caches: each row attends over its own cache.

    Rows are right-padded; each gets only its real tokens (the batch cache's count)
    and zeros at padded positions, whose outputs are never used.
    """
    B, L, _ = x.shape
    outs = []
    for i, (c, r) in enumerate(zip(batch.caches, batch.take_rows(L))):
        out = None
        if r:
            res = None if residual is None else residual[i:i + 1, :r]
            out = _x_attention(attn, x[i:i + 1, :r], res, c, "causal" if r > 1 else None)
        if r < L:
            width = attn.n_heads * _projection(attn, c).v_dim
            pad = mx.zeros((1, L - r, width), x.dtype)
            out = pad if out is None else mx.concatenate([out.astype(x.dtype), pad], axis=1)
        outs.append(out)
    return mx.concatenate(outs, axis=0)


def x_attention_call(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
    rows = getattr(cache, "caches", None)  # a BatchedCache of per-sequence caches
    batched = bool(rows) and hasattr(rows[0], "update_x")
    proj: XProjection = self._xquant
    # Taken in every call: the norm tap's block input must not outlive the step (with
    # another cache, e.g. mlx_lm's, it would stay pinned until the next XQuant step).
    residual, proj.residual = proj.residual, None
    if not batched and getattr(cache, "update_x", None) is None:
        return below(self, X_HOOK).__call__(self, x, mask, cache)
    if batched:
        out = _x_attention_batched(self, x, residual, cache)
    else:
        out = _x_attention(self, x, residual, cache, mask)
    return self.o_proj(out.astype(x.dtype))


def x_norm_call(self, x: mx.array) -> mx.array:
    self._xquant_target.residual = x  # XQuant-CL caches the block input (residual stream)
    return below(self, X_HOOK).__call__(self, x)


def _rebuilt(n: int, heads: int, build: Callable[[int, int], mx.array]) -> RangePart:
    """``n`` tokens rebuilt from their stored form by ``build(a, b)`` (``[B, heads,
    b - a, D]``) for the tokens a key block reads: the blocked prompt path never holds
    them all at once."""
    def read(a: int, b: int, dtype: mx.Dtype) -> mx.array:
        x = build(a, b)
        return x if x.dtype == dtype else x.astype(dtype)

    return RangePart(n, heads, read)
