"""What eviction keeps, as segments: a store's kinds, a reserve buffer, a bounded ring.

Eviction (SnapKV, StreamingLLM) decides *which* tokens stay; the ``store`` option
decides *how* they are held, so the two stack: ``snapkv:capacity=512,store=codebook``.

- ``"dense"``: the window dtype, as the methods always did;
- ``"affine"``: MLX affine codes per token in groups of ``group_size`` channels
  (``TokenCodes``);
- ``"codebook"``: TurboQuant's Lloyd-Max codes of rotated vectors with a float16 norm
  per vector (``CodebookCodes``), 1-4 bits in halves. The codes assume rotated vectors,
  so the builder rotates a cache with this store (``cache.rotated``).

Every store is per token, so keeping a chosen set of tokens is a gather on the token
axis (:func:`keep_chosen`) and a bounded window is a ring written in place
(:class:`Ring`): kept tokens are never coded twice. :class:`KeptForm` is the stored
form with what eviction adds: arrays held beside the keys and values, entries a saved
layout lists only while held, and tokens trim may not cut.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from veloxquant_mlx.cache.base import NotTrimmableError
from veloxquant_mlx.cache.segments import (
    Buffered,
    CodebookCodes,
    Layout,
    Segment,
    StoredForm,
    TokenCodes,
)
from veloxquant_mlx.ops import codebook as cb
from veloxquant_mlx.ops import quantize as q
from veloxquant_mlx.ops.buffers import owned
from veloxquant_mlx.ops.parts import Slot

STORES = ("dense", "affine", "codebook")
CODEBOOK_BITS = (1, 1.5, 2, 2.5, 3, 3.5, 4)


# ---- the store option ----
def check_store_options(opts: Any) -> None:
    """The ``store``, ``k_bits``, ``v_bits`` and ``group_size`` fields of an eviction
    method's options (``MethodOptions`` checks; bits only matter for a quantized store)."""
    opts.check_choice("store", STORES)
    opts.check_int("group_size", q.AFFINE_GROUP_SIZES)
    allowed = q.AFFINE_BITS if opts.store == "affine" else CODEBOOK_BITS
    for name in ("k_bits", "v_bits"):
        value = getattr(opts, name)
        if opts.store != "dense" and (isinstance(value, bool) or value not in allowed):
            raise opts.error(name, f"one of {list(allowed)} for store={opts.store!r}")


def store_needs_rotation(opts: Any) -> bool:
    """Codebook codes assume rotated vectors: the builder rotates such a cache (an
    eviction method's ``Profile.needs_rotation``)."""
    return opts.store == "codebook"


def store_curve_tags(opts: Any) -> list[str]:
    """A quantized store puts the method on another bytes-to-quality curve."""
    return [] if opts.store == "dense" else [f"store={opts.store}"]


def check_store_fits(opts: Any, k_dim: int, v_dim: int, where: str) -> None:
    """A ``ConfigError`` naming what of the layer the options' store does not fit."""
    for name, d in (("head_dim", k_dim), ("v_head_dim", v_dim)):
        if opts.store == "affine" and d % opts.group_size:
            raise opts.error("group_size", f"a divisor of {name}={d} of {where}")
        if opts.store == "codebook":
            try:
                for bits in (opts.k_bits, opts.v_bits):
                    cb.split_bits(bits, d)
            except ValueError as exc:
                raise opts.error("store", f"'affine' or 'dense' for {where}: {exc}") from None
            if d % 8:
                raise opts.error("store", f"'affine' or 'dense' for {where}: codebook codes "
                                 f"need {name}={d} to be a multiple of 8")


def store_codes(opts: Any, bits: float, dim: int) -> Buffered:
    """The segment a quantized store codes one side in (``dim`` wide, ``bits``)."""
    if opts.store == "affine":
        return TokenCodes(int(bits), opts.group_size, dim, dtype=mx.float32)
    return CodebookCodes(bits, dim)  # bytes: bit planes decode 6x slower (loaded: kept)


# ---- segment kinds and operations ----
class DenseBuffer(Buffered):
    """Full-precision tokens in a buffer written in place (the reserve of every
    per-token kind), cast to ``dtype`` (``None``: the input's)."""

    kind = "dense"

    def __init__(self, dim: int, dtype: mx.Dtype | None = None) -> None:
        super().__init__()
        self.dim, self.dtype = dim, dtype
        self.held_dtype = dtype or mx.float16  # what the tokens are held in, once seen

    def encode(self, x: mx.array) -> list[mx.array]:
        x = x if self.dtype is None else x.astype(self.dtype)
        self.held_dtype = x.dtype
        return [x]

    def adopt(self, entries: Sequence[mx.array]) -> None:
        self.held_dtype = entries[0].dtype

    def token_bytes(self) -> int:
        return self.dim * self.held_dtype.size

    def slot_of(self, arrays: list[mx.array]) -> Slot:
        return Slot("dense", arrays[:1], arrays[0].shape[2] if arrays else 0)

    def dense(self, dtype: mx.Dtype) -> mx.array:
        x = self.buf.used()[0]
        return x if x.dtype == dtype else x.astype(dtype)


def keep_chosen(segment: Buffered, idx: mx.array, start: int, stop: int) -> None:
    """Of the held tokens ``start:stop``, keep per head only ``idx`` ``[B, H, n]``
    (relative to ``start``, sorted); the tokens before and after stay. Exact on every
    per-token kind; the result is held without a reserve."""
    held = segment.buf.used()
    kept = []
    for a in held:
        i = idx.reshape(*idx.shape, *([1] * (a.ndim - 3)))
        chosen = mx.take_along_axis(a[:, :, start:stop], i, axis=2)
        pieces = [a[:, :, :start]] if start else []
        pieces.append(chosen)
        if stop < a.shape[2]:
            pieces.append(a[:, :, stop:])
        kept.append(pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=2))
    segment.buf.load(kept)


def without_token(slot: Slot, i: int) -> list[Slot]:
    """A per-token slot as the slots before and after its token ``i`` (views)."""
    cut = [(0, i), (i + 1, slot.n)]
    return [Slot(slot.kind, [a[:, :, lo:hi] for a in slot.arrays], hi - lo, slot.meta,
                 slot.packed) for lo, hi in cut if hi > lo]


class Ring(Segment):
    """At most ``keep + size`` tokens of one per-token kind (``codec``): the first
    ``keep`` ever stored stay, the ``size`` most recent after them are a ring. A single
    token arriving when it is full is written over the oldest in place; anything else
    puts the ring back in time order. Attention reads it in slot order (a single query
    sees every held token; their order does not matter to it); ``state`` and the dense
    view are in time order, so a loaded ring starts at slot 0."""

    def __init__(self, codec: Buffered, keep: int, size: int) -> None:
        self.codec, self.keep_n, self.size = codec, keep, size
        self.kind, self.n_state = codec.kind, codec.n_state
        self.held: list[mx.array] | None = None
        self.start = 0  # ring slot of the oldest recent token (0 unless it wrapped)

    @property
    def n(self) -> int:
        return 0 if self.held is None else self.held[0].shape[2]

    @property
    def full(self) -> bool:
        return self.n == self.keep_n + self.size

    @property
    def oldest(self) -> int:
        """The slot of the oldest recent token."""
        return self.keep_n + self.start

    def arrays(self) -> list[mx.array]:
        return list(self.held or [])

    def accounted(self, batch: int, heads: int) -> int:
        return batch * heads * self.n * self.codec.token_bytes() if self.n else 0

    def _in_time(self) -> list[mx.array] | None:
        if not self.start or self.held is None:
            return self.held
        s, r = self.keep_n, self.keep_n + self.start
        return [mx.concatenate([a[:, :, :s], a[:, :, r:], a[:, :, s:r]], axis=2)
                for a in self.held]

    def append(self, x: mx.array) -> None:
        L = x.shape[2]
        if L == 1 and self.full:
            i = self.oldest
            for a, y in zip(self.held, self.codec.encode(x)):
                a[:, :, i:i + 1] = y
            self.start = (self.start + 1) % self.size
            return
        fill = max(0, min(self.keep_n - self.n, L))  # the first tokens complete `keep`
        recent = x[:, :, fill:][:, :, -self.size:]
        pieces = [p for p in (self._in_time(), self._encoded(x[:, :, :fill]),
                              self._encoded(recent)) if p]
        joined = [mx.concatenate(xs, axis=2) if len(xs) > 1 else xs[0]
                  for xs in zip(*pieces)]
        n, cap = joined[0].shape[2], self.keep_n + self.size
        if n > cap:  # the oldest recent tokens go; a slice would pin the rest
            k = self.keep_n
            joined = [mx.concatenate([a[:, :, :k], a[:, :, n - self.size:]], axis=2) if k
                      else owned(a[:, :, n - self.size:]) for a in joined]
        elif len(pieces) == 1 and recent.shape[2] < L - fill:
            joined = [owned(a) for a in joined]  # a slice of the chunk would pin it
        self.held, self.start = joined, 0

    def _encoded(self, x: mx.array) -> list[mx.array] | None:
        return self.encode(x) if x.shape[2] else None

    def encode(self, x: mx.array) -> list[mx.array]:
        """``x`` ``[B, H, L, D]`` as the ring stores it (the codec's arrays)."""
        return self.codec.encode(x)

    def slot(self, packed: bool | None = None) -> Slot:
        slot = self.codec.slot_of(self.arrays())
        if packed is None or packed == slot.packed:
            return slot
        return Slot(slot.kind, slot.arrays, slot.n, slot.meta, packed)

    def dense(self, dtype: mx.Dtype) -> mx.array:
        return self.codec.slot_of(self._in_time()).part().dense(0, self.n, dtype)

    def drop_front(self, n: int) -> None:
        held = self._in_time()
        self.held = None if held is None or n >= self.n else \
            [owned(a[:, :, n:]) for a in held] if n else held
        self.start = 0

    def keep(self, n: int) -> None:
        if n < self.n:
            held = self._in_time()
            self.held = [owned(a[:, :, :n]) for a in held] if n > 0 else None
            self.start = 0

    def state(self) -> list[mx.array | None]:
        held = self._in_time()
        return list(held) if held is not None else [None] * self.n_state

    def load(self, entries: Sequence[mx.array | None]) -> None:
        self.held = None if entries[0] is None else list(entries)
        self.start = 0
        if self.held is not None:
            self.codec.adopt(self.held)


class KeptForm(StoredForm):
    """A ``StoredForm`` with what eviction adds.

    ``aside``: segments held, counted and saved (after the layout) beside the keys and
    values but never attended (SnapKV's observation-window queries); they follow the end
    of the token stream, so ``trim`` cuts them too. ``optional``: segments whose entries
    ``state`` leaves out while they are empty (layouts that list only what is held); a
    loaded state may lack them, from the last one back. ``pinned``: how many of the
    oldest tokens ``trim`` refuses to cut (chosen per head) and the refusal, a format
    string of ``tail``, ``n`` and ``pinned``.
    """

    def __init__(self, keys: list[Segment], values: list[Segment],
                 state_order: Layout | None = None, aside: Sequence[Segment] = (),
                 optional: Sequence[Segment] = ()) -> None:
        super().__init__(keys, values, state_order)
        self.aside = list(aside)
        self.order = [*self.order, *self.aside]
        self.optional = {id(s) for s in optional}
        self.pinned: tuple[int, str] = (0, "")

    def _saved(self) -> list[Any]:
        return [*self.layout, *self.aside]

    def state(self) -> list[Any]:
        out: list[Any] = []
        for e in self._saved():
            if isinstance(e, tuple):
                out.append([x for s in e for x in s.state()] if any(s.n for s in e)
                           else None)
            elif e.n or id(e) not in self.optional:
                out += e.state()
        return out

    def load(self, entries: Sequence[Any]) -> None:
        saved = self._saved()
        sizes = [1 if isinstance(e, tuple) else e.n_state for e in saved]
        lacking = sum(sizes) - len(entries)
        for e, size in zip(reversed(saved), reversed(sizes)):
            if lacking <= 0 or isinstance(e, tuple) or id(e) not in self.optional:
                break
            lacking -= size
        if lacking:
            raise ValueError(f"state has {len(entries)} entries; this stored form takes "
                             f"{sum(sizes)} ({', '.join(s.kind for s in self.order)})")
        entries = [*entries, *[None] * (sum(sizes) - len(entries))]
        n_layout = sum(sizes[:len(self.layout)])
        super().load(entries[:n_layout])
        i = n_layout
        for s in self.aside:
            s.load(entries[i:i + s.n_state])
            i += s.n_state

    def trim(self, n: int) -> None:
        pinned, refusal = self.pinned
        tail = self.tokens()[0] - pinned
        if n > tail:
            raise NotTrimmableError(refusal.format(tail=tail, n=n, pinned=pinned))
        super().trim(n)
        for s in self.aside:
            s.keep(max(0, s.n - n))
