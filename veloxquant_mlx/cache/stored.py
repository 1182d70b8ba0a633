"""``StoredFormCache``: a cache whose storage is one declared ``StoredForm``.

A method that subclasses it builds its form in ``__init__`` (``self.stored``: key and
value segments in token order, ``cache.segments``) and writes ``update_and_fetch``
(which segment each new token goes to) and, if it codes tokens only after they were
attended in full precision, ``_commit``. Everything else comes from the form: held and
accounted bytes, ``state`` (the form's state order is the saved layout), attention over
the segments without a dense copy (on the engine ``ops.dispatch`` picks), the dense view for
layers that attend by themselves, exact ``trim`` and ring drops of the oldest tokens.

"Code the new tokens after they are attended" is one mechanism: ``attend`` runs over the
form, then calls ``_commit``; ``begin`` (the start of every ``update_and_fetch``) commits
what a step that never attended left behind, so a layer that bypasses ``attend`` or a
harness that only updates leaves the cache consistent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import mlx.core as mx

from veloxquant_mlx.cache.base import CompressedCache, check_input, require_built
from veloxquant_mlx.cache.segments import StoredForm
from veloxquant_mlx.ops import dispatch, kernels
from veloxquant_mlx.ops.attention import attend_on_mlx, decodes_at_once
from veloxquant_mlx.ops.batch_parts import batch_slots, heads_major, rows_major
from veloxquant_mlx.ops.parts import Slot, slot_parts

if TYPE_CHECKING:
    from veloxquant_mlx.cache.base import LayerInfo
    from veloxquant_mlx.config import KVCacheConfig


class StoredFormCache(CompressedCache):
    """Bytes, state, attention, dense view, trim and ring drops from ``self.stored``."""

    attends = True
    # Multiply packed codes with ``mx.quantized_matmul`` (True) or read them as floats in
    # bounded blocks (False); None: the path ``ops.kernels`` measured fastest here.
    use_quantized_matmul: ClassVar[bool | None] = None
    compute_dtype = mx.float32
    # Attention runs in this dtype, the output cast back (None: the queries'). float32:
    # every path (the fused op, packed codes, float blocks) then rounds only the output,
    # so bfloat16 and float16 models get one answer too (bfloat16 float blocks differed
    # from packed codes by 2.6e-2 of a block's output, float32 by one output rounding).
    attend_dtype: ClassVar[mx.Dtype | None] = mx.float32

    def __init__(self, config: KVCacheConfig, layer: LayerInfo | None = None) -> None:
        super().__init__(config, layer)
        self.stored = StoredForm([], [])
        # Per-head rotations the keys and values are stored in (None: as received):
        # queries turn like keys, the output and the dense view turn back.
        self.basis: tuple[mx.array | None, mx.array | None] = (None, None)

    def shared_arrays(self) -> list[mx.array]:
        """What the cache holds beside its form (a rotation one layer declares)."""
        return []

    def _constants(self) -> list[mx.array]:
        return [r for r in self.basis if r is not None] + super()._constants()

    # ---- what a method writes ----
    def _commit(self) -> None:
        """Code what the last step attended in full precision (default: nothing)."""

    def begin(self, keys: mx.array, values: mx.array) -> None:
        """Start of ``update_and_fetch``: checks, the previous step's pending tokens
        committed, and the bookkeeping of the new chunk."""
        check_input(self, keys, values)
        self._commit()
        self.batch_size = keys.shape[0]
        self.compute_dtype = keys.dtype
        self.offset += keys.shape[2]

    # ---- derived from the form ----
    def held_arrays(self) -> list[mx.array]:
        return self.stored.arrays() + self.shared_arrays()

    def accounted_bytes(self) -> int:
        form = self.stored.accounted(max(self.batch_size, 1), self.layer.n_kv_heads)
        return form + sum(a.nbytes for a in self.shared_arrays())

    @property
    def state(self) -> list[Any]:
        return self.stored.state()

    @state.setter
    def state(self, v: list[Any]) -> None:
        require_built(self)
        self.stored.load(v)

    def attention_slots(self) -> tuple[list[Slot], list[Slot]]:
        return self.stored.slots(self.use_quantized_matmul)

    def _turn_in(self, queries: mx.array) -> mx.array:
        rk = self.basis[0]
        qr = queries if self.attend_dtype is None else queries.astype(self.attend_dtype)
        return qr if rk is None else qr @ rk

    def _turn_out(self, out: mx.array, dtype: mx.Dtype) -> mx.array:
        rv = self.basis[1]
        return (out if rv is None else out @ rv.T).astype(dtype)

    def attend(self, queries: mx.array, scale: float, mask: Any = None) -> mx.array:
        qr = self._turn_in(queries)
        keys, values = self.attention_slots()
        parts = slot_parts(keys), slot_parts(values)
        engine = dispatch.route(qr, dispatch.part_kind(*parts), mask, self.layer.n_kv_heads,
                                sum(p.n for p in parts[0]), label=self._label())
        out = (dispatch.fused_rows(qr, scale, [parts], mask) if engine == dispatch.FUSED
               else None)
        if out is None:
            blocked = not decodes_at_once(qr.shape[1], self.layer.n_kv_heads, qr.shape[2])
            out = attend_on_mlx(qr, _parts(keys, qr, blocked), _parts(values, qr, blocked),
                                scale, mask)
        self._commit()  # the new tokens were attended in full precision: code them now
        return self._turn_out(out, queries.dtype)

    def _label(self) -> str:
        return f"{type(self).__name__} layer {self.layer.layer_idx}"

    @classmethod
    def _attend_rows(cls, rows: list[Any], queries: mx.array, scale: float
                    ) -> mx.array | None:
        """One attention call for one decode query per row (``cache.batch``): one fused
        op, or the rows' segments padded side by side (``ops.batch_parts``), as
        ``ops.dispatch`` picks. None when they cannot lie side by side (other classes,
        options or bases)."""
        first = rows[0]
        if any(type(r) is not type(first)
               or any(a is not b for a, b in zip(r.basis, first.basis)) for r in rows):
            return None
        if not decodes_at_once(queries.shape[1], first.layer.n_kv_heads, queries.shape[2]):
            return None
        slots = [r.attention_slots() for r in rows]
        qr = first._turn_in(queries)
        parts = [tuple(slot_parts(s) for s in kv) for kv in slots]
        kind = dispatch.part_kind([p for k, _ in parts for p in k],
                                  [p for _, v in parts for p in v])
        engine = dispatch.route(qr, kind, None, first.layer.n_kv_heads,
                                sum(p.n for p in parts[0][0]), len(rows),
                                label=f"{first._label()} x {len(rows)} rows")
        out = dispatch.fused_rows(qr, scale, parts) if engine == dispatch.FUSED else None
        if out is None and engine != dispatch.ROWS:
            out = _padded(rows, slots, qr, scale)
        if out is None:
            return None
        for r in rows:
            r._commit()
        return first._turn_out(out, queries.dtype)

    def keys_and_values(self, dtype: mx.Dtype | None = None) -> tuple[mx.array, mx.array]:
        """Transient dense keys/values: every segment decoded, in token order (and
        turned back from the stored basis)."""
        dtype = dtype or self.compute_dtype
        if all(r is None for r in self.basis):
            return self.stored.keys_and_values(dtype)
        k, v = self.stored.keys_and_values(mx.float32)
        k, v = ((x if r is None else x @ r.T).astype(dtype)
                for x, r in zip((k, v), self.basis))
        return k, v

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens; kept tokens stay exactly as held. A method whose
        ``is_trimmable`` says no (e.g. after evicting) gets ``NotTrimmableError``."""
        if not self.is_trimmable():
            return super().trim(n)
        n = max(0, min(self.offset, n))
        if n:
            self._commit()
            self.stored.trim(n)
            self.offset -= n
        return n

    def drop_oldest(self, n: int) -> None:
        """Forget the ``n`` oldest tokens (a multiple of ``ring_alignment``): codes are
        sliced, never re-quantized (sliding-window rings, ``cache.sliding``)."""
        self._commit()
        self.stored.drop_front(n)
        self.offset -= n


def _padded(rows: list[Any], slots: list[tuple[list[Slot], list[Slot]]], qr: mx.array,
            scale: float) -> mx.array | None:
    """The rows' slots padded side by side, one call on MLX's ops (``ops.batch_parts``);
    None when they cannot lie side by side."""
    qh = heads_major(qr, rows[0].layer.n_kv_heads)
    batched = batch_slots(slots, after=qh)
    if batched is None:
        return None
    out = attend_on_mlx(qh, _parts(batched.keys, qh), _parts(batched.values, qh), scale,
                        batched.mask, batched.value_index)
    return rows_major(out, len(rows))


def _parts(slots: list[Slot], queries: mx.array, blocked: bool = False) -> list[Any]:
    """Slots as parts. Codes read as floats go in blocks of ``kernels.BLOCK`` tokens, so
    no float copy of a whole store is built, and are read only once the layer's
    ``queries`` exist: nothing else ties a layer's decode to its place in the step, and
    MLX decoded the codes of later layers ahead (a TurboQuant step at 8160 tokens held
    4.3 layers' keys and values as floats at its peak; 0.7 with the tie, measured).
    ``blocked``: the attention runs in key blocks, which read packed codes as floats too,
    so packed slots are tied and cut like the others (untied, MLX's allocator kept 10% of
    an ``affine`` store beyond its bytes after a plain-loop prompt: reused larger blocks)."""
    out = []
    for s in slots:
        if s.kind == "dense" or (s.packed and not blocked) or not s.n:
            out += slot_parts([s])
            continue
        tied = Slot(s.kind, mx.depends(s.arrays, [queries]), s.n, s.meta, s.packed and not blocked)
        out += slot_parts(tied.blocks(kernels.BLOCK))
    return out
