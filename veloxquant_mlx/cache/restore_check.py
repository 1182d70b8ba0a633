"""A restored cache checked against its layer and config before anything reads it.

A saved file is data from outside: arrays cut to fewer heads, tokens that disagree with
the offset, codes of another width than the config's ``bits`` would make a decode raise
deep inside an op, attend over garbage, or make the fused CPU kernel read out of bounds.
``check_restored(cache)`` runs once per loaded layer (``load_prompt_cache``) and raises
``ValueError`` naming the state entry and what was expected. One mechanism serves every
method, with no evaluation of any array (shapes only, from lazily built graphs):

1. ``meta_state``: no negative count, option-named fields equal to the options; every
   array of ``state``: a dtype caches store, the batch on axis 0;
2. a stored form (``cache.segments``): each segment's arrays have exactly the shapes and
   integer dtypes that the segment's own encoder gives for zeros of
   ``[batch, heads, tokens, head dim]`` (the tokens read from the array itself), so the
   config's bits and group size, the layer's heads and widths are all checked at once;
3. the method's profile's ``check_restored`` where it declares one (stores outside the segments);
4. its dense view (``keys_and_values``, built lazily, never evaluated): ``[batch, heads, n,
   head dim]`` with ``n == offset`` (``n <= offset`` for caches that evict or ring).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from veloxquant_mlx.cache.base import CompressedCache
from veloxquant_mlx.cache.segments import ChannelCodes, Dense, Segment, StoredForm
from veloxquant_mlx.ops import quantize as q

__all__ = ["FLOATS", "STORED_DTYPES", "check_arrays", "check_meta", "check_restored",
           "flat_state", "require_dtypes"]

# Floats, codes (signed or not), and int32 positions (indices a method checks against
# what it holds); a segment's own encoder then says which of them each entry must be.
STORED_DTYPES = (mx.float16, mx.bfloat16, mx.float32, mx.uint8, mx.uint16, mx.uint32,
                 mx.int8, mx.int16, mx.int32)
FLOATS = (mx.float16, mx.bfloat16, mx.float32)


def flat_state(state: Any, prefix: str = "") -> list[tuple[str, mx.array]]:
    """Every array of a (nested) state with its entry name (``"3"``, ``"4.1"``)."""
    if isinstance(state, mx.array):
        return [(prefix, state)]
    if isinstance(state, (list, tuple)):
        return [x for i, s in enumerate(state)
                for x in flat_state(s, f"{prefix}.{i}" if prefix else str(i))]
    return []


def _dtype_ok(got: mx.Dtype, want: mx.Dtype) -> bool:
    # Floats may be saved in another float width (a window dtype); codes never change.
    return got in FLOATS if want in FLOATS else got == want


def check_arrays(what: str, got: Sequence[Any], template: Sequence[mx.array]) -> None:
    """``got`` has the count, shapes and dtypes of ``template`` (lazy arrays: shapes only);
    arrays the template gives one float dtype (scales and biases) share theirs."""
    if len(got) != len(template):
        raise ValueError(f"{what}: {len(got)} arrays, expected {len(template)}")
    same: dict[Any, mx.Dtype] = {}
    for i, (a, t) in enumerate(zip(got, template)):
        if not isinstance(a, mx.array):
            raise ValueError(f"{what}, array {i}: {type(a).__name__}, expected an array "
                             f"{tuple(t.shape)} {t.dtype}")
        if tuple(a.shape) != tuple(t.shape) or not _dtype_ok(a.dtype, t.dtype) or \
                same.setdefault(t.dtype, a.dtype) != a.dtype:
            raise ValueError(f"{what}, array {i}: {tuple(a.shape)} {a.dtype}, expected "
                             f"{tuple(t.shape)} {same.get(t.dtype, t.dtype)}")


def require_dtypes(what: str, arrays: Sequence[Any], allowed: Sequence[mx.Dtype] = FLOATS
                   ) -> None:
    """Every array of ``arrays`` (None skipped) has one of the ``allowed`` dtypes (floats:
    an integer array read as floats attends over values that were never keys)."""
    for i, a in enumerate(arrays):
        if a is not None and a.dtype not in allowed:
            raise ValueError(f"{what}, array {i}: {a.dtype}, expected one of "
                             f"{[str(d) for d in allowed]}")


def check_meta(cache: Any) -> None:
    """Saved ``meta_state`` fields: counts >= 0, and those named like an option (a
    window, a group size) equal to what a fresh cache of the same config and layer sets
    (the options, or the layer's form of them): the stored form was built from those."""
    fields = [n for n in cache.meta_fields if n in cache.opts.field_names()]
    fresh = type(cache)(cache.config, cache.layer) if fields and \
        getattr(cache, "inner", None) is None else None
    for name in cache.meta_fields:
        value = getattr(cache, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value < 0:
            raise ValueError(f"meta_state {name}={value}, expected >= 0")
        if fresh is not None and name in fields and value != getattr(fresh, name):
            raise ValueError(f"meta_state {name}={value!r}; the saved config and layer "
                             f"give {getattr(fresh, name)!r}")


def _tokens(s: Segment, entries: list[Any], what: str) -> int:
    first = entries[0]
    if not isinstance(first, mx.array) or first.ndim < 4:  # 5-D: codes in bit planes
        shape = tuple(first.shape) if isinstance(first, mx.array) else type(first).__name__
        raise ValueError(f"{what}: {shape}, expected an array [batch, heads, tokens, ...]")
    if isinstance(s, ChannelCodes):  # codes [B, H, D, n * bits / 32]: tokens from scales
        last = entries[1]
        return last.shape[-1] * s.group_size if isinstance(last, mx.array) else 0
    return first.shape[2]


def _template(s: Segment, batch: int, heads: int, dim: int, n: int) -> list[mx.array]:
    """What the segment's own encoder stores for ``n`` tokens (a graph, not evaluated)."""
    if isinstance(s, Dense):
        return [mx.zeros((batch, heads, n, dim), s.dtype or mx.float16)]
    zeros = mx.zeros((batch, heads, n, dim), mx.float32)
    if isinstance(s, ChannelCodes):
        return q.quantize_tokens(zeros, s.bits, s.group_size).arrays
    return s.encode(zeros)


def check_form(form: StoredForm, batch: int, heads: int, dims: tuple[int, int]) -> None:
    """Each segment's loaded arrays against what it encodes (``check_restored`` 2)."""
    side_of = {id(s): (side, dim) for side, segs, dim in
               (("keys", form.keys, dims[0]), ("values", form.values, dims[1]))
               for s in segs}
    index = 0
    for entry in form.layout:
        group = entry if isinstance(entry, tuple) else (entry,)
        for j, s in enumerate(group):
            side, dim = side_of[id(s)]
            entries = s.state()
            name = f"{index}.{j}" if isinstance(entry, tuple) else str(index)
            what = f"state entry {name} ({side} {s.kind} segment)"
            if getattr(s, "checked_by_cache", False):
                continue  # a share of a store kept across layers: its profile's ``check_restored`` checks it
            if any(e is not None for e in entries):
                n = _tokens(s, entries, what)
                check_arrays(what, entries, _template(s, batch, heads, dim, n))
        index += 1 if isinstance(entry, tuple) else entry.n_state


def _check_basics(cache: Any) -> None:
    arrays = flat_state(cache.state)
    for name, a in arrays:
        if a.dtype not in STORED_DTYPES:
            raise ValueError(f"state entry {name}: dtype {a.dtype}, expected one of "
                             f"{[str(d) for d in STORED_DTYPES]}")
        if a.ndim < 2 or a.shape[0] != cache.batch_size:
            raise ValueError(f"state entry {name}: shape {tuple(a.shape)}, expected the "
                             f"batch size {cache.batch_size} on axis 0")
    if arrays and cache.offset <= 0:
        raise ValueError(f"offset {cache.offset} with {len(arrays)} arrays held, expected "
                         "an offset > 0")


def _check_dense_view(cache: Any, ring: bool) -> None:
    if type(cache).keys_and_values is CompressedCache.keys_and_values or cache.offset <= 0 \
            or cache.profile.hooks_module:
        # No dense view (eviction), or one the layer's module computes (XQuant runs the
        # module's own call, whose arguments a restore does not have): ``check_restored``.
        return
    try:
        k, v = cache.keys_and_values()
    except (ValueError, IndexError, TypeError) as exc:
        raise ValueError(f"the saved arrays do not rebuild keys and values ({exc})") from None
    layer = cache.layer
    n = k.shape[2] if k.ndim == 4 else -1
    want = ((cache.batch_size, layer.n_kv_heads, n, layer.head_dim),
            (cache.batch_size, layer.n_kv_heads, n, layer.v_head_dim))
    if (tuple(k.shape), tuple(v.shape)) != want:
        raise ValueError(f"keys {tuple(k.shape)} and values {tuple(v.shape)} rebuilt from "
                         f"the saved arrays, expected {want[0]} and {want[1]}")
    if n > cache.offset or (n != cache.offset and not (cache.profile.evicts or ring)):
        raise ValueError(f"the saved arrays hold {n} tokens; the saved offset is "
                         f"{cache.offset}")


def _check_ring(ring: Any, inner: Any) -> None:
    """A ring (``cache.sliding``): its inner cache holds the tokens from ``start`` on,
    the last chunk among them."""
    start, last = ring.start, ring.last_chunk
    if start < 0 or start + inner.offset != ring.offset or \
            (ring.offset > 0 and not 0 < last <= inner.offset):
        raise ValueError(f"ring start {start}, last chunk {last} and {inner.offset} tokens "
                         f"held do not add up to the offset {ring.offset}")


def check_restored(cache: Any) -> None:
    """Raise ``ValueError`` unless ``cache``'s restored state fits its layer and config."""
    check_meta(cache)
    _check_basics(cache)
    layer = cache.layer
    form = getattr(cache, "stored", None)
    if isinstance(form, StoredForm):
        check_form(form, cache.batch_size, layer.n_kv_heads,
                   (layer.head_dim, layer.v_head_dim))
    inner = getattr(cache, "inner", None)  # a sliding ring holds a method's cache
    if inner is not None:
        check_restored(inner)
        _check_ring(cache, inner)
    if isinstance(cache, CompressedCache):
        type(cache).profile.check_restored(cache)
    _check_dense_view(cache, ring=inner is not None)
