"""Compressed caches inside mlx_lm's ``BatchGenerator`` / ``batch_generate``.

mlx_lm merges the per-sequence caches of a layer into one batch cache
(``cache.merge([...])``), right-pads prompts of different lengths
(``prepare(lengths=..., right_padding=...)``), and later ``filter``s, ``extend``s
and ``extract``s sequences. Compressed forms (codes, factors, evicted sets) do not
pad or concatenate generically, so a ``BatchedCache`` keeps each sequence's own
compressed cache:

- ``update_and_fetch`` hands row ``i`` only its real (unpadded) tokens;
- a decode step (one token per row) attends every row in one call where the rows'
  class can lay its stored segments side by side (``_attend_rows``: stored forms,
  ``cache.stored``; padded per segment, a mask per row); rows that return dense keys
  and values attend one by one (padding them would copy each row's whole cache). On a
  CPU the rows go in groups, one call per group, each on a CPU stream of its own
  (``ops.streams``), so the step's elementwise work uses more than one core;
- otherwise ``attend`` runs each row's queries over that row's cache with a causal
  mask and zero-fills the padded query positions (their outputs are never used);
- ``offset`` is a per-sequence array, so RoPE places every row at its own position.

Each sequence's caches were built by ``KVCacheBuilder.for_model`` for that sequence,
so cross-layer methods keep one coordinator per sequence. Nothing is ever expanded
to a dense cache.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache

from veloxquant_mlx.cache import finite
from veloxquant_mlx.cache.step_cost import layer_stats
from veloxquant_mlx.ops import dispatch, streams
from veloxquant_mlx.ops.attention import sdpa
from veloxquant_mlx.ops.parts import DensePart


def in_cycles(caches: Any) -> bool:
    """Whether any of these layer caches (a batch's rows included) may sit in reference
    cycles, so that only ``gc.collect()`` frees them: cross-layer methods share state
    between layers. Other caches go with their last reference, and a collection (tens of
    milliseconds with a model loaded) is not worth running for them."""
    for c in caches:
        rows = c.caches if isinstance(c, BatchedCache) else [c]
        if any(getattr(getattr(r, "profile", None), "cross_layer", False) for r in rows):
            return True
    return False


def _alike(a: Any, b: Any) -> bool:
    """Same class, config and shared constants (rotations): they turn new tokens alike."""
    if type(a) is not type(b) or a.config != b.config:
        return False
    ka, kb = a._constants(), b._constants()
    return len(ka) == len(kb) and all(x is y for x, y in zip(ka, kb))


class BatchedCache(_BaseCache):
    """One layer's batch of independent per-sequence caches (an mlx_lm cache itself).

    It holds nothing of its own: bytes, state and stats are its rows'.
    """

    attends = True

    def __init__(self, caches: list[Any]) -> None:
        if not caches:
            raise ValueError("BatchedCache needs at least one per-sequence cache")
        self.caches = list(caches)
        self._pending: list[int] | None = None  # real prompt tokens still to come per row
        self._real: list[int] = []  # real tokens per row in the current chunk
        self._dense: list[Any] = []  # transient k/v of caches without ``attend``

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchedCache:
        flat: list[Any] = []
        for c in caches:
            flat.extend(c.caches if isinstance(c, BatchedCache) else [c])
        return cls(flat)

    # ---- the model's view ----
    @property
    def offset(self) -> mx.array:
        return mx.array([c.offset for c in self.caches])

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        # ``attend`` builds each row's causal mask itself.
        return None if N == 1 else "causal"

    def take_rows(self, L: int) -> list[int]:
        """Real (unpadded) tokens of each row in the next chunk of ``L`` positions."""
        if self._pending is None:
            return [L] * len(self.caches)
        real = [min(p, L) for p in self._pending]
        self._pending = [p - r for p, r in zip(self._pending, real)]
        return real

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if keys.shape[0] != len(self.caches):
            raise ValueError(
                f"batch cache holds {len(self.caches)} sequences but keys have batch "
                f"size {keys.shape[0]}"
            )
        self._real = self.take_rows(keys.shape[2])
        self._dense = []
        # One finiteness check for the whole chunk (padding is computed from real
        # tokens, so finite too), then none per row: each would wait for the layer.
        if keys.shape[2] > 1:
            finite.require(keys, values, f"a batch of {len(self.caches)} sequences")
        shared = self._incoming(keys, values)
        rows = self._row_chunks([keys, values] + list(shared or ()))
        with finite.checked():
            for c, r, row in zip(self.caches, self._real, rows):
                kv = None
                if r:
                    kv = c.update_and_fetch(*row[:2]) if shared is None else c.update_and_fetch(
                        *row[:2], incoming=tuple(row[2:]))
                self._dense.append(None if c.attends else kv)
        return keys, values

    def _row_chunks(self, arrays: list[mx.array]) -> list[list[mx.array]]:
        """Per row, its real tokens of each of ``arrays`` ``[B, H, L, D]``. Whole rows
        come from one split per array (a decode step: one operation instead of one slice
        per row, and each operation costs microseconds whatever its size)."""
        L = arrays[0].shape[2]
        if all(r == L for r in self._real) and len(self.caches) > 1:
            per_array = [mx.split(a, len(self.caches), axis=0) for a in arrays]
            return [list(row) for row in zip(*per_array)]
        return [[a[i:i + 1, :, :r] for a in arrays] for i, r in enumerate(self._real)]

    def _incoming(self, keys: mx.array, values: mx.array) -> tuple[mx.array, ...] | None:
        """What every row would make of its tokens alike (``_incoming``), computed once
        for the batch, when the rows are of one class, config and constants."""
        first = self.caches[0]
        hook = getattr(first, "_incoming", None)
        if hook is None or not all(_alike(first, c) for c in self.caches[1:]):
            return None
        return hook(keys, values)

    def _attend_at_once(self, queries: mx.array, scale: float, start: int = 0,
                        stop: int | None = None) -> mx.array | None:
        """A decode step of rows ``start:stop`` in one call, where their class lays
        their stored forms side by side (``_attend_rows``); None otherwise."""
        rows = self.caches[start:stop]
        first = rows[0]
        if (queries.shape[2] != 1 or any(r != 1 for r in self._real[start:stop])
                or any(type(c) is not type(first) for c in rows)):
            return None
        # Rows returning dense keys and values attend in one op where ``ops.dispatch``
        # picks the fused CPU kernel, else one by one: padding them side by side copies
        # every row's whole cache at every step (8 rows of 700 tokens: 236 ms a step against 196 ms row by row,
        # medians of 30 in alternating order).
        dense = self._dense[start:stop]
        if all(d is not None for d in dense):
            if len(rows) == 1:  # one row alone: its own attention (sdpa)
                return None
            q = queries[start:stop]
            engine = dispatch.route(q, "arrays", None, dense[0][0].shape[1],
                                    dense[0][0].shape[2], len(rows),
                                    label=f"{type(first).__name__} x {len(rows)} rows")
            if engine != dispatch.FUSED:
                return None
            return dispatch.fused_rows(q, scale, [([DensePart(k)], [DensePart(v)])
                                                  for k, v in dense])
        if any(d is not None for d in dense):
            return None
        return type(first)._attend_rows(rows, queries[start:stop], scale)

    def attend(self, queries: mx.array, scale: float, mask: Any = None) -> mx.array:
        # A decode step's groups of rows run on CPU streams of their own (``ops.streams``:
        # its elementwise work would use one core); a prompt chunk stays on one stream,
        # so two rows' prefill transients never live at once.
        if queries.shape[2] == 1:
            outs = []
            for start, stop, stream in streams.spread(len(self.caches)):
                with streams.on(stream):
                    outs.append(self._attend_group(queries, scale, start, stop))
        else:
            outs = [self._attend_group(queries, scale, 0, len(self.caches))]
        self._dense = []
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)

    def _attend_group(self, queries: mx.array, scale: float, start: int, stop: int
                      ) -> mx.array:
        out = self._attend_at_once(queries, scale, start, stop)
        if out is not None:
            return out
        return mx.concatenate([self._attend_row(i, queries, scale)
                               for i in range(start, stop)], axis=0)

    def _attend_row(self, i: int, queries: mx.array, scale: float) -> mx.array:
        """Row ``i``'s queries over its own cache; padded query positions get zeros."""
        _, Hq, L, _ = queries.shape
        c, r = self.caches[i], self._real[i]
        q = queries[i:i + 1, :, :r]
        row_mask = "causal" if r > 1 else None
        if r == 0:
            out = None
        elif self._dense[i] is None:
            out = c.attend(q, scale=scale, mask=row_mask)
        else:
            k, v = self._dense[i]
            out = sdpa(q, k, v, scale, row_mask)
        if out is None or r < L:
            Dv = out.shape[3] if out is not None else queries.shape[3]
            pad = mx.zeros((1, Hq, L - r, Dv), queries.dtype)
            out = pad if out is None else mx.concatenate([out, pad], axis=2)
        return out

    # ---- BatchGenerator hooks ----
    def prepare(self, *, left_padding: list[int] | None = None,
                lengths: list[int] | None = None,
                right_padding: list[int] | None = None) -> None:
        if left_padding is not None and any(left_padding):
            raise NotImplementedError(
                "BatchedCache does not take left padding: compressed caches are padded "
                "on the right (prepare(lengths=..., right_padding=...))"
            )
        if lengths is not None:
            self._pending = [int(n) for n in lengths]

    def finalize(self) -> None:
        self._pending = None

    def filter(self, batch_indices: list[int]) -> None:
        self.caches = [self.caches[i] for i in batch_indices]

    def extend(self, other: BatchedCache) -> None:
        if not isinstance(other, BatchedCache):
            raise TypeError(f"cannot extend a BatchedCache with {type(other).__name__}")
        self.caches.extend(other.caches)

    def extract(self, idx: int) -> Any:
        return self.caches[idx]

    # ---- bookkeeping ----
    def size(self) -> int:
        return max((c.size() for c in self.caches), default=0)

    def empty(self) -> bool:
        return all(c.empty() for c in self.caches)

    def is_trimmable(self) -> bool:
        return all(c.is_trimmable() for c in self.caches)

    def trim(self, n: int) -> int:
        return [c.trim(n) for c in self.caches][0] if self.caches else 0

    def held_arrays(self) -> list[mx.array]:
        return [a for c in self.caches for a in c.held_arrays()]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    def stats(self) -> dict[str, Any]:
        """The rows' stats summed (held, accounted and fp16-equivalent bytes, FLOPs)."""
        rows = [layer_stats(c) for c in self.caches]
        out = {k: sum(r.get(k, 0) for r in rows)
               for k in ("held_bytes", "accounted_bytes", "fp16_bytes", "decode_flops")}
        out["ratio"] = out["held_bytes"] / out["fp16_bytes"] if out["fp16_bytes"] else 0.0
        return out

    @property
    def state(self) -> list[Any]:
        return [c.state for c in self.caches]

    @state.setter
    def state(self, v: Any) -> None:
        raise NotImplementedError("a BatchedCache is not saved; save each sequence's caches")
