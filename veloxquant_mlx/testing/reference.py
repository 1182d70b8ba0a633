"""Same-numerics references: mlx_lm's own cache holding what a method's stored form gives.

``reference_caches(model, caches)`` returns, for caches built by ``KVCacheBuilder``, one
mlx_lm cache per layer that a differential test feeds the same tokens: for a layer the
method compresses, a :class:`ReferenceCache` (a subclass of mlx_lm's ``KVCache``) that
follows the method's declaration (``stored_numerics``, ``cache.numerics``); for a layer
the method leaves to mlx_lm, a fresh cache of mlx_lm's own kind. The model attends with
mlx_lm's own attention and masks over it, so a difference between the two is the
method's routing, layout or bookkeeping, not its intended loss.

A method without a declaration is expected to hold its keys and values as received
(``DEFAULT``: dense, exact).

The reference keeps its tokens in NumPy, outside MLX's allocator: a test that reads
``mx.get_active_memory()`` sees the compressed caches only.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache

from veloxquant_mlx.cache.base import CompressedCache
from veloxquant_mlx.cache.numerics import StoredNumerics, Stream
from veloxquant_mlx.cache.sliding import SlidingCache

DEFAULT = StoredNumerics()


def numerics_of(cache: CompressedCache) -> StoredNumerics:
    """The declaration of ``cache``'s method for its layer (``DEFAULT`` without one)."""
    cls = cache.method_cls if isinstance(cache, SlidingCache) else type(cache)
    declare = getattr(getattr(cls, "profile", None), "stored_numerics", None)
    return DEFAULT if declare is None else declare(cache.config, cache.layer)


def _np(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32))


class _Tokens:
    """One stream of one layer: sinks, committed (round-tripped) and residual tokens."""

    def __init__(self, spec: Stream) -> None:
        self.spec = spec
        self.parts: list[np.ndarray | None] = [None, None, None]  # sink, committed, residual

    def _n(self, i: int) -> int:
        return 0 if self.parts[i] is None else self.parts[i].shape[2]

    def _cat(self, i: int, x: np.ndarray) -> None:
        if x.shape[2]:
            old = self.parts[i]
            self.parts[i] = x if old is None else np.concatenate([old, x], axis=2)

    def _commit(self) -> None:
        n = self.spec.to_commit(self._n(2))
        if not n:
            return
        block = self.parts[2][:, :, :n]
        rt = self.spec.roundtrip
        self._cat(1, block if rt is None else _np(rt(mx.array(block))))
        self.parts[2] = self.parts[2][:, :, n:]

    def append(self, x: mx.array, offset: int) -> None:
        self._commit()  # what the last step left for the next update ("next")
        spec, L = self.spec, x.shape[2]
        now = spec.commit == "append" or (spec.commit == "next_chunk" and L == 1)
        s = max(0, min(spec.sink - offset, L))
        held = _np(x if spec.hold is None else spec.hold(x))
        self._cat(0, held[:, :, :s])
        if now and spec.fresh_from_input and not self._n(2):
            # Coded straight from the input: only what stays is held.
            n = spec.to_commit(L - s)
            if n:
                rt = spec.roundtrip
                block = x[:, :, s:s + n]
                self._cat(1, _np(block if rt is None else rt(block)))
            self._cat(2, held[:, :, s + n:])
            return
        self._cat(2, held[:, :, s:])
        if now:
            self._commit()

    def dense(self) -> mx.array:
        return mx.array(np.concatenate([p for p in self.parts if p is not None], axis=2))

    def trim(self, n: int) -> None:
        """Drop the last ``n`` tokens: residual, then committed groups, then sinks."""
        cut = min(n, self._n(2))
        self.parts[2] = self.parts[2][:, :, :self._n(2) - cut] if cut else self.parts[2]
        n -= cut
        if n and self._n(1):
            keep = max(0, self._n(1) - n)
            n -= self._n(1) - keep
            whole = keep - keep % self.spec.trim_group
            # The kept tokens of a cut group go back to the residual as they were read
            # (then held in the window dtype).
            back = self.parts[1][:, :, whole:keep]
            hold = self.spec.hold
            self.parts[2] = back if hold is None or not back.shape[2] else \
                _np(hold(mx.array(back)))
            self.parts[1] = self.parts[1][:, :, :whole]
        if n and self._n(0):
            self.parts[0] = self.parts[0][:, :, :max(0, self._n(0) - n)]


class ReferenceCache(KVCache):
    """mlx_lm's ``KVCache`` holding a method's round-tripped tokens (see the module)."""

    def __init__(self, numerics: StoredNumerics) -> None:
        super().__init__()
        self.numerics = numerics
        self.streams = (_Tokens(numerics.keys), _Tokens(numerics.values))

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        for stream, x in zip(self.streams, (keys, values)):
            stream.append(x, self.offset)
        self.offset += keys.shape[2]
        k, v = (s.dense().astype(keys.dtype) for s in self.streams)
        return k, v

    def make_mask(self, N: int, return_array: bool = False,
                  window_size: int | None = None) -> Any:
        if self.numerics.evict is None:
            return super().make_mask(N, return_array=return_array, window_size=window_size)
        # StreamingLLM's band over every position: the first ``sink`` and the ``window``
        # most recent up to each query (evicted tokens are masked, never attended).
        sink, window = self.numerics.evict
        if window_size is not None:
            window = min(window, window_size)
        t = mx.arange(self.offset, self.offset + N)[:, None]
        p = mx.arange(self.offset + N)[None]
        return (p <= t) & ((p < sink) | (p > t - window))

    # mlx_lm's KVCache attributes, read by models whose layers share K/V
    # (``keys_and_values``): transients from the NumPy copy, never stored.
    @property
    def keys(self) -> mx.array | None:
        return self.streams[0].dense() if self.offset else None

    @keys.setter
    def keys(self, v: Any) -> None:
        pass  # KVCache.__init__ sets it; the tokens live in ``streams``

    @property
    def values(self) -> mx.array | None:
        return self.streams[1].dense() if self.offset else None

    @values.setter
    def values(self, v: Any) -> None:
        pass

    @property
    def state(self) -> list[mx.array]:
        return [s.dense() for s in self.streams] if self.offset else []

    @state.setter
    def state(self, v: Any) -> None:
        raise NotImplementedError("a reference cache is not restored from a saved state")

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        for s in self.streams:
            s.trim(n)
        self.offset -= n
        return n

    @property
    def nbytes(self) -> int:
        return 0  # held in NumPy


def reference_caches(model: Any, caches: list[Any]) -> list[Any]:
    """One mlx_lm cache per layer of ``caches`` (built by ``KVCacheBuilder`` for
    ``model``): a :class:`ReferenceCache` where the method compresses the layer, a fresh
    cache of mlx_lm's own kind where it does not."""
    own = make_prompt_cache(model)
    return [ReferenceCache(numerics_of(c)) if isinstance(c, CompressedCache) else o
            for c, o in zip(caches, own)]


def reference_bound(caches: list[Any], most_tokens: int) -> float:
    """The largest declared bound over ``caches`` once they have held at most
    ``most_tokens`` tokens at a time (``StoredNumerics.bound_after``)."""
    decl = [numerics_of(c) for c in caches if isinstance(c, CompressedCache)] or [DEFAULT]
    return max(d.bound_after(most_tokens) for d in decl)


def relative_error(got: Any, want: Any) -> float:
    """max |got - want| / max |want| over the finite logits (the logit scale); ``inf``
    where the non-finite ones (models that mask vocabulary entries) disagree."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    finite = np.isfinite(want)
    if not np.array_equal(finite, np.isfinite(got)) or \
            not np.array_equal(got[~finite], want[~finite], equal_nan=True):
        return float("inf")
    if not finite.any():
        return 0.0
    diff = np.abs(got[finite] - want[finite]).max()
    return float(diff / max(np.abs(want[finite]).max(), 1e-6))
