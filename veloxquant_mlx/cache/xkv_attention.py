"""xKV's attention over its stored form, in factor space (``XKVCache``'s half that reads).

Values in factor space (``out = (p A) B_i + (sum p) m_i``); keys stored after RoPE also
(``scores = (q B_i^T) A^T + q m_i``); keys stored before RoPE are rebuilt into a transient
per basis and rotated for their positions. The fused CPU op (through ``ops.dispatch``)
reads the token factors as codes where it can; MLX's ops run the rest, prompt chunks on
the library's blocked path (keys and values rebuilt one key block at a time), so the
prompt's working set does not grow with the context.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from veloxquant_mlx.cache.factored import Factored, per_head
from veloxquant_mlx.cache.step_cost import query_heads
from veloxquant_mlx.ops import dispatch, native
from veloxquant_mlx.ops import quantize as q
from veloxquant_mlx.ops.attention import attend_on_mlx, decodes_at_once, masked_softmax
from veloxquant_mlx.ops.parts import DensePart, RangePart, shared_by_heads, token_codes
from veloxquant_mlx.ops.rope import tables as rope_tables


def factor_flops(cache: Any) -> int:
    """One query's attention as ``attend`` runs it: per basis, keys rebuilt from
    their factors (``n r H D``, stored before RoPE) or scores in factor space
    (``Hq (D r + r n)``); values always in factor space (``Hq (n r + r Dv)``);
    sinks and window densely."""
    info, hq = cache.layer, query_heads(cache)
    hd, hv, total, factored = info.head_dim, info.v_head_dim, 0, 0
    fk, fv = cache.factors["keys"], cache.factors["values"]
    for j, _, n in fk.spans():
        rk, rv = fk.bases[j].rank, fv.bases[j].rank
        keys = (n * rk * info.n_kv_heads * hd + hq * n * hd if cache.pre_rope
                else hq * (hd * rk + rk * n))
        total += keys + hq * (n * rv + rv * hv)
        factored += n
    total += hq * (cache.offset - factored) * (hd + hv)
    return 2 * max(cache.batch_size, 1) * total


class FactorAttention:
    """Attention of an xKV layer; the cache supplies ``factors``, ``sinks``, ``windows``,
    ``layer``, ``offset``, ``pre_rope`` and ``_settle_group`` (run by the group's last
    member once it has attended)."""

    factors: dict[str, Factored]
    layer: Any
    offset: int
    pre_rope: bool

    def attend(self, queries: mx.array, scale: float, mask: Any = None) -> mx.array:
        out = self._fused(queries, scale, mask)
        if out is None:
            out = self._attend_ops(queries, scale, mask)
        info = self.layer
        if info.member_idx == info.group_size - 1:
            self._settle_group()
        return out

    def _member(self, stream: str, j: int) -> tuple[mx.array, mx.array]:
        """Basis ``j``'s member factor per KV head [b, H, r, hd] and mean per head
        [b, H, 1, hd], float32 transients."""
        return self.factors[stream].bases[j].heads(self.layer.n_kv_heads)

    def _member_part(self, stream: str, j: int) -> tuple[Any, mx.array] | None:
        """Basis ``j``'s member factor as a part ``[b, H, r, hd]`` and its mean
        ``[b, H, 1, hd]``, views of the stored arrays for the fused op to apply itself;
        None where a head's slice is not whole groups (then MLX applies them)."""
        f = self.factors[stream]
        basis = f.bases[j]
        return f.views.get(("member", j), (basis.own, basis.mean),
                           lambda: self._member_view(basis.own, basis.mean))

    def _member_view(self, own: Any, mean: mx.array) -> tuple[Any, mx.array] | None:
        H = self.layer.n_kv_heads
        mh = per_head(mean, H)
        if not isinstance(own, q.Quantized):
            return DensePart(per_head(own, H)), mh
        head_dim = mean.shape[-1] // H
        if head_dim % own.group_size or own.bits not in q.BYTE_BITS:
            return None
        return token_codes(q.Quantized(*(per_head(a, H) for a in own.arrays), own.bits,
                                       own.group_size)), mh

    def _rows_part(self, stream: str, j: int, n: int) -> Any:
        """Basis ``j``'s first ``n`` token factor rows as stored, one part shared by the
        KV heads (for the fused kernel; no copy)."""
        group = self.factors[stream].rows
        rows = group.rows[j]
        return group.views.get(("rows", j, n), (rows,),
                               lambda: shared_by_heads(rows, self.layer.n_kv_heads, n))

    def _fused(self, queries: mx.array, scale: float, mask: Any) -> mx.array | None:
        """The attention in one fused CPU op, the token factors read as codes (values in
        factor space, and keys too when stored after RoPE); None where the op does not
        run (then MLX's ops)."""
        B, Hq, L, hd = queries.shape
        H, hv = self.layer.n_kv_heads, self.layer.v_head_dim
        declined = None if self.factors["keys"].bases else "no factored tokens yet"
        causal = dispatch.fused_causal(queries, mask, H, self.offset, declined=declined)
        if causal is None:
            return None
        qh = (queries * scale).reshape(B, H, Hq // H * L, hd)
        qs, keys, values, factors = [qh], [], [], []
        width, out_width = hd, hv
        (sk, sv), (wk, wv) = self.sinks, self.windows
        if sk.n:
            keys.append(DensePart(sk.x))
            values.append(DensePart(sv.x))
        for j, start, n in self.factors["keys"].spans():
            part, projected = self._key_part(qh, j, start, n, width)
            keys.append(part)
            if projected is not None:  # q B^T made here, read at dims width:
                qs.append(projected)
                width += projected.shape[-1]
            member = self._member_part("values", j)
            if member is not None:  # B_v and m_v applied by the op
                values.append(native.Placed(self._rows_part("values", j, n), project=member[0],
                                            mean=member[1]))
                continue
            bv, mv = self._member("values", j)
            values.append(native.Placed(self._rows_part("values", j, n), ooff=out_width,
                                        mass=True))
            factors += [bv, mv]
            out_width += bv.shape[-2] + 1
        if wk.n:
            keys.append(DensePart(wk.x))
            values.append(DensePart(wv.x))
        o = dispatch.fused_decode(mx.concatenate(qs, axis=-1) if len(qs) > 1 else qh, keys,
                                  values, causal)
        if o is None:
            return None
        out = o
        if factors:  # each basis's columns are p a then its mass: one product with [B; m]
            out = o[..., :hv] + o[..., hv:] @ mx.concatenate(factors, axis=-2)
        return out.reshape(B, Hq, L, hv).astype(queries.dtype)

    def _key_part(self, qh: mx.array, j: int, start: int, n: int, width: int
                  ) -> tuple[native.Placed, mx.array | None]:
        """Basis ``j``'s keys for the fused op, and the projected queries ``q B^T`` it
        reads at query dims ``width:`` where the op cannot project them itself."""
        rows, member = self._rows_part("keys", j, n), self._member_part("keys", j)
        if self.pre_rope:
            info = self.layer
            tables = rope_tables(start, info.rope_dims, info.rope_base,
                                 info.rope_traditional, info.rope_scale)
            if member is not None and native.rebuildable(rows, member[0]):
                # rebuilt a few tokens at a time, rotated and scored by the op
                return native.Placed(rows, project=member[0], mean=member[1], rope=tables), None
            keys = self.factors["keys"].rebuilt(j, start, n, rotated=False, cached=True)
            return native.Placed(DensePart(keys), rope=tables), None  # rotated by the op
        if member is not None:
            return native.Placed(rows, project=member[0], mean=member[1]), None
        bh, mh = self._member("keys", j)
        return (native.Placed(rows, qoff=width, shift=qh @ mh.swapaxes(-1, -2)),
                qh @ bh.swapaxes(-1, -2))

    def _attend_blocked(self, queries: mx.array, scale: float, mask: Any) -> mx.array:
        """A prompt chunk's attention on the library's blocked path (``ops.attention``):
        an online softmax over key blocks, each block's factored keys and values rebuilt
        from their own rows, so no score row or rebuilt copy spans the context."""
        (sk, sv), (wk, wv) = self.sinks, self.windows
        keys, values = ([DensePart(sk.x)], [DensePart(sv.x)]) if sk.n else ([], [])
        for j, _, n in self.factors["keys"].spans():
            keys.append(_factor_blocks(self.factors["keys"], j, n))
            values.append(_factor_blocks(self.factors["values"], j, n))
        if wk.n:
            keys.append(DensePart(wk.x))
            values.append(DensePart(wv.x))
        out = attend_on_mlx(queries.astype(mx.float32), keys, values, scale, mask)
        return out.astype(queries.dtype)

    def _attend_ops(self, queries: mx.array, scale: float, mask: Any) -> mx.array:
        """The attention on MLX's ops: decode steps in factor space (keys rebuilt per
        basis when stored before RoPE), prompt chunks in key blocks."""
        info = self.layer
        B, Hq, L, hd = queries.shape
        H = info.n_kv_heads
        if not decodes_at_once(Hq, H, L):
            return self._attend_blocked(queries, scale, mask)
        qh = (queries.astype(mx.float32) * scale).reshape(B, H, Hq // H, L, hd)
        fk, fv = self.factors["keys"], self.factors["values"]
        (sk, sv), (wk, wv) = self.sinks, self.windows
        spans = fk.spans()
        scores = []
        if sk.n:
            scores.append(qh @ sk.x.astype(mx.float32)[:, :, None].swapaxes(-1, -2))
        for j, start, n in spans:
            if self.pre_rope:
                k = fk.rebuilt(j, start, n, cached=True)
                scores.append(qh @ k[:, :, None].swapaxes(-1, -2))
            else:
                scores.append(factor_scores(qh, fk.rows.decoded(j)[..., :n, :],
                                            *self._member("keys", j)))
        if wk.n:
            scores.append(qh @ wk.x.astype(mx.float32)[:, :, None].swapaxes(-1, -2))
        sizes = [s.shape[-1] for s in scores]
        p = masked_softmax(scores[0] if len(scores) == 1 else
                           mx.concatenate(scores, axis=-1), mask)
        parts: list[Any] = [sv.x] if sv.n else []
        parts += [(fv.rows.decoded(j)[..., :n, :], *self._member("values", j))
                  for j, _, n in spans]
        parts += [wv.x] if wv.n else []
        out, i = None, 0
        for part, n in zip(parts, sizes):
            pe = p[..., i:i + n]
            if isinstance(part, tuple):
                o = factor_values(pe, *part)
            else:
                o = pe @ part.astype(mx.float32)[:, :, None]
            out = o if out is None else out + o
            i += n
        return out.reshape(B, Hq, L, -1).astype(queries.dtype)


def factor_scores(qh: mx.array, a: mx.array, bh: mx.array, mh: mx.array) -> mx.array:
    """Scores ``q . (A B + m)`` of keys held as factors, in factor space.

    ``qh`` [b, H, rep, L, hd] (scaled queries grouped by KV head), ``a`` [b, n, r],
    ``bh`` [b, H, r, hd], ``mh`` [b, H, 1, hd]; returns [b, H, rep, L, n]. One matmul
    of every query head against the token factor (shared by the heads).
    """
    B, H, rep, L, hd = qh.shape
    qb = qh.reshape(B, H, rep * L, hd) @ bh.swapaxes(-1, -2)  # [b, H, rep*L, r]
    s = qb.reshape(B, H * rep * L, -1) @ a.swapaxes(-1, -2)
    return s.reshape(B, H, rep, L, -1) + qh @ mh[:, :, None].swapaxes(-1, -2)


def factor_values(p: mx.array, a: mx.array, bh: mx.array, mh: mx.array) -> mx.array:
    """``p @ (A B + m)`` in factor space: ``(p A) B + (sum p) m``, [b, H, rep, L, hd]."""
    B, H, rep, L, n = p.shape
    pa = p.reshape(B, H * rep * L, n) @ a  # [b, H*rep*L, r]
    out = pa.reshape(B, H, rep * L, -1) @ bh
    return out.reshape(B, H, rep, L, -1) + p.sum(axis=-1, keepdims=True) * mh[:, :, None]


def _factor_blocks(side: Factored, j: int, n: int) -> RangePart:
    """Basis ``j``'s ``n`` tokens of one side, each key block rebuilt from its own token
    factor rows."""
    return RangePart(n, side.heads, lambda a, b, dt: side.block(j, a, b).astype(dt))
