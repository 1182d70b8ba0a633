"""XQuant's generic path: any attention module, reached through its own call.

The X hook (``cache.xquant_hook``) swaps an attention module's class; for attention it
does not run itself (q/k norms, fused projections, soft-capping, sinks, MLA, ...) the
swapped ``__call__`` is ``x_generic_call``. The cache holds X, and the earlier tokens'
K and V are rematerialized through the module's own code: its original ``__call__`` runs
on their X with a capturing cache at position 0 (its projections, norms and RoPE; the
rest of that call is never evaluated), then the real call attends over the earlier K/V
and the chunk's own, exactly as with mlx_lm's cache. X is stored as is (no latent).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from veloxquant_mlx.cache.base import depend_on_state
from veloxquant_mlx.cache.module_call import ModuleCall, below, bind_call, call_per_row
from veloxquant_mlx.errors import UnsupportedModelError

X_HOOK = "XQuant"  # the name of XQuant's hook on attention and norm modules


class _Identity(nn.Module):
    """The "norm" of a block whose attention takes the residual stream itself."""

    def __call__(self, x: mx.array) -> mx.array:
        return x


class GenericXPath:
    """One layer XQuant reaches through the attention module's own call.

    The cache holds the module's input X (``encode`` is the identity); earlier tokens'
    K and V come from running the module on their X (``_rematerialize``). Without an
    input norm in front of the attention (post-norm blocks such as OLMo 2's), the
    residual stream XQuant-CL chains is X itself.
    """

    latent = False

    def __init__(self, attn: nn.Module, norm: nn.Module | None, latent: bool) -> None:
        self.attn = attn
        self.taps_input = norm is None
        self.norm = _Identity() if norm is None else norm
        self.in_dim = 0  # the module's input width, seen on its first call
        self.residual: mx.array | None = None  # the block input, set by the norm tap
        self.latent_requested = latent
        self.checked = False  # the norm tap checked against the module's input
        self.extra: list[str] = []  # arguments with arrays besides input, mask, cache

    def kept_arrays(self) -> list[mx.array]:
        return []

    @property
    def widths(self) -> tuple[int, ...]:
        return (self.in_dim,)

    def encode(self, x: mx.array) -> list[mx.array]:
        return [x.astype(mx.float32)]

    def normalize(self, h: mx.array) -> mx.array:
        return below(self.norm, X_HOOK).__call__(self.norm, h)

    def rematerialize(self, parts: list[mx.array], dtype: mx.Dtype) -> tuple[mx.array,
                                                                            mx.array]:
        """Keys and values of the tokens stored as ``parts``: the module's own call."""
        base = below(self.attn, X_HOOK)
        call = bind_call(base.__call__, self.attn, (parts[0].astype(dtype),),
                         {"cache": _Capture()}, lambda c: isinstance(c, _Capture))
        keys, values = _rematerialize(call, call.x)
        return keys.astype(dtype), values.astype(dtype)


class _Capture:
    """A cache at position 0 that keeps what the module hands it."""

    attends = False
    offset = 0

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys, self.values = keys, values
        return keys, values

    def make_mask(self, *args: Any, **kwargs: Any) -> Any:
        return None


# Arguments that (in mlx_lm's sources) scale only the queries: the rematerializing call
# gets a neutral 1 instead of the chunk's per-position values.
QUERY_ONLY_ARGUMENTS = ("attn_scale",)


def _rematerialize(call: ModuleCall, x_old: mx.array) -> tuple[mx.array, mx.array]:
    """Earlier tokens' K and V: the module's own call on their X, cached at position 0
    (only what leads to the captured keys and values is ever evaluated)."""
    cap = _Capture()
    changes: dict[str, Any] = {call.x_name: x_old, call.cache_names[0]: cap}
    if call.mask_name is not None:
        changes[call.mask_name] = None
    if "offset" in call.arguments:
        changes["offset"] = 0  # modules that take the position as an argument
    for name in QUERY_ONLY_ARGUMENTS:
        if isinstance(call.arguments.get(name), mx.array):
            changes[name] = mx.array(1.0, x_old.dtype)
    call.run(**changes)
    if cap.keys is None:
        raise RuntimeError("XQuant: the attention module did not hand its cache keys")
    return cap.keys, cap.values


class _XFetch:
    """What a generically hooked module sees of its X-cache in one call: storing the
    chunk's X, it hands back the earlier tokens' K/V followed by the chunk's own."""

    attends = False

    def __init__(self, cache: Any, call: ModuleCall, path: GenericXPath,
                 residual: mx.array | None, row: int | None = None, n: int = 0) -> None:
        rows = slice(None) if row is None else slice(row, row + 1)
        cols = slice(None) if row is None else slice(0, n)
        self._cache, self._call, self._path = cache, call, path
        self._x = call.x[rows, cols]
        self._residual = None if residual is None else residual[rows, cols]
        self.offset = cache.offset

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)

    def _check_tap(self) -> None:
        # XQuant-CL rebuilds X as norm(residual): the tapped norm must be the one
        # whose output this module receives, or the cached X would be another one.
        if self._path.checked or self._path.taps_input or self._cache.method != "xquant_cl":
            return
        if not mx.allclose(self._path.normalize(self._residual), self._x, rtol=1e-3,
                           atol=1e-3).item():
            raise UnsupportedModelError(
                f"xquant_cl cannot run on layer {self._cache.layer.layer_idx}: the block's "
                f"input norm ({type(self._path.norm).__name__}) does not produce what its "
                "attention receives, so the residual stream cannot rebuild X")
        self._path.checked = True

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self._check_tap()
        old = self._cache.update_x(self._x, self._residual, self._path)
        if old is not None:
            k_old, v_old = _rematerialize(self._call, old[0].astype(self._x.dtype))
            keys = mx.concatenate([k_old.astype(keys.dtype), keys], axis=2)
            values = mx.concatenate([v_old.astype(values.dtype), values], axis=2)
        # The layer's output must depend on the stored X (see ``depend_on_state``).
        return tuple(depend_on_state([keys, values], self._cache))

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        raise NotImplementedError("XQuant caches hold X: other layers cannot read their "
                                  "keys and values")


def _array_arguments(call: ModuleCall) -> list[str]:
    """Names of arguments other than input, mask and cache that carry arrays."""
    def arrays(v: Any) -> bool:
        if isinstance(v, (list, tuple)):
            return any(arrays(x) for x in v)
        return isinstance(v, mx.array)

    skip = {"self", call.x_name, call.mask_name, *call.cache_names, *QUERY_ONLY_ARGUMENTS}
    return [n for n, v in call.arguments.items() if n not in skip and arrays(v)]


def _is_x_cache(obj: Any) -> bool:
    rows = getattr(obj, "caches", None)
    if isinstance(rows, list) and hasattr(obj, "take_rows"):
        return bool(rows) and hasattr(rows[0], "update_x")
    return hasattr(obj, "update_x")


def x_generic_call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    base = below(self, X_HOOK)
    call = bind_call(base.__call__, self, args, kwargs, _is_x_cache)
    path: GenericXPath = self._xquant
    cache = call.cache
    if cache is None:
        path.in_dim = call.x.shape[-1]
        path.extra = _array_arguments(call)
        return call.run()
    residual, path.residual = path.residual, None
    if path.taps_input:
        residual = call.x
    if hasattr(cache, "take_rows"):  # a batch of per-sequence caches: one row at a time
        return call_per_row(call, cache,
                            lambda c, i, n: _XFetch(c, call, path, residual, i, n),
                            f"{base.__module__}.{base.__name__}")
    return call.run(**{call.cache_names[0]: _XFetch(cache, call, path, residual)})
