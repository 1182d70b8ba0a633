"""Low-rank tokens with a factor shared by a group of layers: a stored-form segment kind.

One side (keys or values) of a layer, held per *basis*: the tokens from a basis's
``start`` to the next basis are ``X ~ A @ B + m``, with ``A`` [b, T, r] the token factor
rows (one row per token, shared by every layer of the group and held once: ``GroupRows``),
``B`` [b, r, D] this layer's member factor and ``m`` [b, 1, D] its mean (float16, or
``B`` as affine codes along D). Keys may be stored before RoPE: their dense view is
rotated to its positions.

Bytes: each layer counts its member factors and means; the group's first member (the
*holder*) counts the token factor rows and their decoded transient, so the rows are
counted once per group. ``FactoredForm`` is a layer's whole form (sinks, factors and a
window per side) with the state in xKV's saved order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from veloxquant_mlx.cache.base import LayerInfo
from veloxquant_mlx.cache.segments import Dense, Segment, StoredForm
from veloxquant_mlx.ops import factors as fr
from veloxquant_mlx.ops import quantize as q
from veloxquant_mlx.ops.buffers import Views
from veloxquant_mlx.ops.parts import Slot
from veloxquant_mlx.ops.rope import rotate

FACTOR_DTYPE = mx.float16  # unquantized member factors and means


def member_group(d: int) -> int:
    """Quantization group of a member factor along its width D (64, else 32)."""
    return 64 if d % 64 == 0 else 32


def store_member(x: mx.array, bits: int | None) -> Any:
    """A member factor as float16, or quantized along its last axis."""
    if bits is None:
        return x.astype(FACTOR_DTYPE)
    return q.quantize(x.astype(mx.float32), bits, member_group(x.shape[-1]))


def per_head(a: mx.array, heads: int) -> mx.array:
    """``[b, n, heads * d]`` as ``[b, heads, n, d]`` (a view of a contiguous array)."""
    return a.reshape(*a.shape[:2], heads, -1).transpose(0, 2, 1, 3)


@dataclass
class MemberFactor:
    """One basis of one layer's side: its first position, ``B`` and ``m``, stored rank."""

    start: int
    own: Any  # [b, r, D]: float16 or codes along D (None until a saved state is loaded)
    mean: mx.array | None  # [b, 1, D] float16
    rank: int

    def entries(self) -> list[mx.array]:
        own = self.own.arrays if isinstance(self.own, q.Quantized) else [self.own]
        return [*own, self.mean]

    def heads(self, heads: int) -> tuple[mx.array, mx.array]:
        """``B`` per KV head [b, H, r, hd] and ``m`` per head [b, H, 1, hd], float32."""
        return (per_head(fr.load_rows(self.own), heads),
                per_head(self.mean.astype(mx.float32), heads))


class GroupRows:
    """One side's token factor rows of a group, one entry per basis, held once; with the
    views and the float32 decoding that attention reuses within a forward pass."""

    def __init__(self, bits: int | None) -> None:
        self.bits = bits
        self.rows: list[Any] = []
        self.views = Views()
        self._decoded: dict[int, mx.array] = {}

    def count(self) -> int:
        return sum(fr.rows_count(r) for r in self.rows)

    def add(self, a: mx.array, new_basis: bool) -> None:
        """Rows of the next tokens: a new basis's, or more of the latest basis's."""
        if new_basis:
            self.rows.append(fr.store_rows(a, self.bits))
        else:
            width = fr.rows_width(self.rows[-1])
            new = fr.store_rows(fr.pad_rank(a, width, -1), self.bits)
            self.rows[-1] = fr.append_rows(self.rows[-1], new)
        self.changed()

    def decoded(self, j: int) -> mx.array:
        """Basis ``j``'s rows in float32, decoded once until ``release``."""
        if j not in self._decoded:
            self._decoded[j] = fr.load_rows(self.rows[j])
        return self._decoded[j]

    def release(self) -> None:
        """Drop the float32 rows (end of a forward pass)."""
        self._decoded = {}

    def changed(self) -> None:
        self.views.clear()  # views pin what a change replaced
        self.release()

    def arrays(self) -> list[mx.array]:
        return [a for r in self.rows for a in fr.rows_arrays(r)] + list(self._decoded.values())

    def accounted(self, batch: int) -> int:
        stored = sum(batch * fr.rows_bytes(fr.rows_count(r), fr.rows_width(r), self.bits)
                     for r in self.rows)
        return stored + sum(a.nbytes for a in self._decoded.values())

    def keep(self, bases: int, last: int) -> None:
        """Keep ``bases`` bases, the last with ``last`` rows (copied out)."""
        del self.rows[bases:]
        if self.rows:
            self.rows[-1] = fr.keep_rows(self.rows[-1], last)
        self.changed()

    def entries(self) -> list[mx.array]:
        return [a for r in self.rows for a in fr.rows_arrays(r)]

    def per_basis(self) -> int:
        return 1 if self.bits is None else 3

    def load(self, entries: Sequence[mx.array]) -> None:
        per = self.per_basis()
        self.rows = [fr.rows_from(list(entries[i:i + per]), self.bits)
                     for i in range(0, len(entries), per)]
        self.changed()


class Factored(Segment):
    """One layer's side held as bases of low-rank factors (see the module docstring).

    ``rows`` is the group's ``GroupRows`` (the holder's, shared by every member);
    ``holder``: this layer counts, saves and trims them. ``rope``: keys stored before
    RoPE, rotated to their positions in the dense view. Bases are added as the group's
    SVDs arrive (``add_basis``, ``extend``), never from dense tokens (``append``).
    """

    kind = "factored"

    def __init__(self, dim: int, heads: int, bits: int | None, holder: bool,
                 rope: LayerInfo | None = None) -> None:
        self.dim, self.heads, self.bits = dim, heads, bits
        self.rows = GroupRows(bits)
        self.holder = holder
        self.rope = rope
        self.bases: list[MemberFactor] = []
        self.count = 0
        self.views = Views()  # views of the member factors, kept between steps
        # Told ``(end, kept)`` after a trim cut factored tokens: the position after the
        # last one kept and how many are kept (the group's source forgets the rest).
        self.on_cut: Callable[[int, int], None] | None = None

    # ---- what the method writes ----
    def add_basis(self, start: int, own: mx.array, mean: mx.array) -> None:
        """A new basis from ``start``: this layer's ``B`` [b, r, D] and ``m`` [b, 1, D]
        (the rank padded to whole code groups when coded)."""
        width = fr.padded_rank(own.shape[-2], self.bits)
        own = fr.pad_rank(own, width, -2)
        self.bases.append(MemberFactor(start, store_member(own, self.bits),
                                       mean.astype(FACTOR_DTYPE), width))
        self.views.clear()

    def extend(self, n: int) -> None:
        """The next ``n`` tokens now have token factor rows."""
        self.count += n

    def spans(self) -> list[tuple[int, int, int]]:
        """(basis index, first position, tokens) of each basis holding tokens."""
        out = []
        end = self.bases[0].start + self.count if self.bases else 0
        for j, basis in enumerate(self.bases):
            stop = self.bases[j + 1].start if j + 1 < len(self.bases) else end
            if stop > basis.start:
                out.append((j, basis.start, stop - basis.start))
        return out

    # ---- the segment ----
    @property
    def n(self) -> int:
        return self.count

    @property
    def n_state(self) -> int:  # type: ignore[override]
        return len(self.entries()) + len(self.row_entries())

    def arrays(self) -> list[mx.array]:
        own = [a for b in self.bases for a in b.entries()]
        return own + (self.rows.arrays() if self.holder else [])

    def accounted(self, batch: int, heads: int) -> int:
        total = 0
        for b in self.bases:
            values = batch * b.rank * self.dim
            total += (2 * values if self.bits is None else
                      q.quantized_bytes(values, self.bits, member_group(self.dim)))
            total += 2 * batch * self.dim  # the mean
        return total + (self.rows.accounted(batch) if self.holder else 0)

    def append(self, x: mx.array) -> None:
        raise TypeError("factored tokens come from the group's SVD: add_basis and extend")

    def slot(self, packed: bool | None = None) -> Slot:
        raise TypeError("factored tokens are attended in factor space by their cache")

    def rebuilt(self, j: int, start: int, n: int, rotated: bool = True,
                cached: bool = False) -> mx.array:
        """Basis ``j``'s ``n`` tokens as float32 [b, H, n, hd] (a transient); keys stored
        before RoPE rotated to their positions unless not ``rotated``. ``cached``: the
        rows decoded once per forward pass (attention), not just for this call."""
        rows = self.rows.decoded(j) if cached else fr.load_rows(self.rows.rows[j])
        return self._rebuild(j, rows[..., :n, :], start, rotated)

    def block(self, j: int, lo: int, hi: int) -> mx.array:
        """Basis ``j``'s tokens ``lo:hi`` (counted from its start) as float32
        [b, H, hi - lo, hd], rotated to their positions when stored before RoPE, decoded
        from their own rows only: a block of the prompt path, whatever the context."""
        rows = self.rows.rows[j]
        if isinstance(rows, q.Quantized):
            rows = q.Quantized(*(a[..., lo:hi, :] for a in rows.arrays), rows.bits,
                               rows.group_size)
        else:
            rows = rows[..., lo:hi, :]
        return self._rebuild(j, fr.load_rows(rows), self.bases[j].start + lo, True)

    def _rebuild(self, j: int, a: mx.array, start: int, rotated: bool) -> mx.array:
        """``a @ B + m`` of basis ``j`` per head for token factor rows ``a`` [b, n, r]
        of positions ``start ..``; keys stored before RoPE rotated unless not ``rotated``."""
        bh, mh = self.bases[j].heads(self.heads)
        if self.side == "value":
            return a[:, None] @ bh + mh
        # One matmul for every head: a batch of one per head ran at half its speed.
        b, H, r, hd = bh.shape
        k = (a @ bh.transpose(0, 2, 1, 3).reshape(b, r, H * hd)).reshape(b, -1, H, hd)
        k = k.transpose(0, 2, 1, 3) + mh
        if self.rope is not None and rotated:
            info = self.rope
            k = rotate(k, info.rope_dims, info.rope_base, info.rope_traditional,
                       info.rope_scale, start)
        return k

    def dense(self, dtype: mx.Dtype) -> mx.array:
        xs = [self.rebuilt(j, start, n) for j, start, n in self.spans()]
        x = xs[0] if len(xs) == 1 else mx.concatenate(xs, axis=2)
        return x.astype(dtype)

    def drop_front(self, n: int) -> None:
        raise TypeError("factored tokens share their rows across a group: no front drops")

    def keep(self, n: int) -> None:
        if n >= self.count or not self.bases:
            return
        end = self.bases[0].start + n
        while self.bases and self.bases[-1].start >= end:
            self.bases.pop()
        if self.holder:
            self.rows.keep(len(self.bases), end - self.bases[-1].start if self.bases else 0)
        self.count = n
        self.views.clear()
        if self.on_cut is not None:
            self.on_cut(end, n)

    def entries(self) -> list[mx.array | None]:
        """The member factors' state entries, basis by basis."""
        return [a for b in self.bases for a in b.entries()]

    def row_entries(self) -> list[mx.array]:
        return self.rows.entries() if self.holder else []

    def state(self) -> list[mx.array | None]:
        return self.entries() + self.row_entries()

    def expect(self, bases: Sequence[tuple[int, int]], rows: int) -> None:
        """The layout a saved state has (``(start, rank)`` per basis, ``rows`` entries
        of token factor rows), before ``load``."""
        self.bases = [MemberFactor(start, None, None, rank) for start, rank in bases]
        if self.holder:
            self.rows.rows = [None] * rows
            self.rows.changed()
        self.views.clear()

    def per_basis(self) -> int:
        return 2 if self.bits is None else 4

    def load_basis(self, j: int, entries: Sequence[mx.array]) -> None:
        """Basis ``j``'s member factor and mean from ``per_basis`` saved entries."""
        *own, mean = entries
        basis = self.bases[j]
        basis.own = own[0] if self.bits is None else q.Quantized(
            *own, self.bits, member_group(self.dim))
        basis.mean = mean

    def load(self, entries: Sequence[mx.array | None]) -> None:
        per = self.per_basis()
        for j in range(len(self.bases)):
            self.load_basis(j, entries[j * per:(j + 1) * per])
        if self.holder:
            self.rows.load(entries[len(self.bases) * per:])
        self.views.clear()


class FactoredForm(StoredForm):
    """A layer's keys and values: sinks, factored tokens, then a window, per side.

    The state keeps xKV's saved order: sinks and windows (keys, values), then each
    basis's member factor and mean (keys, then values), then the holder's token factor
    rows (keys, then values). ``layout`` lists the dense runs (the restore check reads
    them as any form's); the cache checks the factors' entries.
    """

    def __init__(self, sinks: tuple[Dense, Dense], factors: tuple[Factored, Factored],
                 windows: tuple[Dense, Dense]) -> None:
        (sk, sv), (fk, fv), (wk, wv) = sinks, factors, windows
        super().__init__([sk, fk, wk], [sv, fv, wv], [sk, sv, wk, wv, fk, fv])
        self.layout = [sk, sv, wk, wv]
        self.sinks, self.factors, self.windows = sinks, factors, windows

    def state(self) -> list[Any]:
        fk, fv = self.factors
        out: list[Any] = [s.x for s in (*self.sinks, *self.windows)]
        for bk, bv in zip(fk.bases, fv.bases):
            out += bk.entries() + bv.entries()
        return out + fk.row_entries() + fv.row_entries()

    def load(self, entries: Sequence[Any]) -> None:
        fk, fv = self.factors
        row_counts = [len(f.rows.rows) * f.rows.per_basis() if f.holder else 0
                      for f in self.factors]
        own = [f.per_basis() for f in self.factors]
        need = 4 + len(fk.bases) * sum(own) + sum(row_counts)
        if len(entries) != need or len(fk.bases) != len(fv.bases):
            raise ValueError(f"state has {len(entries)} entries; this xkv form takes {need} "
                             f"(4 dense runs, {len(fk.bases)} bases, token factor rows)")
        for s, x in zip((*self.sinks, *self.windows), entries[:4]):
            s.load([x])
        i = 4
        for j in range(len(fk.bases)):
            for f, per in zip(self.factors, own):
                f.load_basis(j, entries[i:i + per])
                i += per
        for f, count in zip(self.factors, row_counts):
            if f.holder:
                f.rows.load(entries[i:i + count])
            f.views.clear()
            i += count
