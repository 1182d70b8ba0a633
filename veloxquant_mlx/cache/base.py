"""The cache contract every method implements.

A cache is one object per layer that mlx_lm's models call exactly like its own
``KVCache``: ``update_and_fetch(keys, values)`` with ``[B, n_kv_heads, L, head_dim]``
arrays, ``offset``, ``make_mask``, ``state``/``meta_state``, ``trim``.

Required (abstract): ``update_and_fetch``, ``held_arrays``, ``accounted_bytes`` and
``state``. Optional, with the defaults below: ``attends`` + ``attend`` (attention over
the compressed form, reached through ``adapter.mlx_lm``'s routing; ``update_and_fetch``
then returns only the new chunk), ``keys_and_values``, ``trim``, ``merge`` (batches),
``meta_fields`` (what ``meta_state`` saves) and the declared capabilities below.
"""

from __future__ import annotations

import copy
import copyreg
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache, create_attention_mask

from veloxquant_mlx.cache import finite
from veloxquant_mlx.cache.profile import Profile
from veloxquant_mlx.options import MethodOptions, config_error

if TYPE_CHECKING:
    from veloxquant_mlx.config import KVCacheConfig

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}

# mlx_lm deep-copies caches (prompt-cache reuse, batch splits); caches and their
# coordinators hold mx.Dtype values, which are not deep-copyable by default.
def _dtype_named(name: str) -> mx.Dtype:
    return getattr(mx, name)


copyreg.pickle(mx.Dtype, lambda d: (_dtype_named, (str(d).rpartition(".")[2],)))


# Functions ``(method_cls, config, layer, state, meta_state) -> cache | None`` that
# rebuild a saved layer whose cache wraps the method's own (``cache.sliding`` adds one).
LAYER_RESTORERS: list[Any] = []


BATCH_ONLY = frozenset({"extract", "filter", "extend", "prepare", "finalize"})


class BatchOnlyError(AttributeError, NotImplementedError):
    """A batch-only call (``BATCH_ONLY``) on one sequence's cache."""


class NotTrimmableError(ValueError, NotImplementedError):
    """A cache cannot drop tokens from its end."""


@dataclass
class LayerInfo:
    """What a layer's cache knows of its place in the model (``KVCacheBuilder.for_model``)."""

    layer_idx: int = 0
    n_layers: int = 1
    n_kv_heads: int = 1
    head_dim: int = 64
    v_head_dim: int | None = None
    # Cross-layer roles (group id, position in the group, group size).
    group_id: int = 0
    member_idx: int = 0
    group_size: int = 1
    # RoPE of the layer (for caches that store keys before rotation).
    rope_dims: int | None = None
    rope_base: float = 10000.0
    rope_traditional: bool = False
    rope_scale: float = 1.0
    # Sliding-window layer (mlx_lm's RotatingKVCache): its attention window in tokens.
    sliding_window: int | None = None
    # Not saved: live objects injected by the builder.
    coordinator: Any = field(default=None, repr=False, compare=False)
    attention: Any = field(default=None, repr=False, compare=False)
    block: Any = field(default=None, repr=False, compare=False)
    model_type: str = ""
    # Injected by the adapter: False once the model's attention no longer reaches it.
    routing: Any = field(default=None, repr=False, compare=False)

    LIVE: ClassVar[tuple[str, ...]] = ("coordinator", "attention", "block", "routing")

    def __post_init__(self) -> None:
        if self.v_head_dim is None:
            self.v_head_dim = self.head_dim

    def to_dict(self) -> dict[str, Any]:
        """Serializable part (no live objects)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in self.LIVE}

    def __deepcopy__(self, memo: dict) -> LayerInfo:
        # Copying a cache must not copy the model: share the live modules (weights), but
        # copy the coordinator (per-sequence state).
        out = copy.copy(self)
        memo[id(self)] = out
        out.coordinator = copy.deepcopy(self.coordinator, memo)
        return out


def _meta_str(value: Any) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, (tuple, list)):
        return ",".join(map(str, value))
    return str(value)


class CompressedCache(_BaseCache, ABC):
    """Base class of every veloxquant cache (one per layer); see the module docstring."""

    method: ClassVar[str] = ""  # the registry name
    Options: ClassVar[type[MethodOptions]] = MethodOptions
    # What the method declares beside the cache: registry facts, what the builder may do
    # with it, tests' and the tuner's options (``cache.profile``).
    profile: ClassVar[Profile] = Profile()
    # Runs attention over its own form (``attend``); ``update_and_fetch`` then returns
    # only the new chunk.
    attends: ClassVar[bool] = False
    # What ``meta_state`` saves: attribute -> how it is parsed back from its string.
    meta_fields: ClassVar[dict[str, Callable[[str], Any]]] = {"offset": int, "batch_size": int}

    def __init__(self, config: KVCacheConfig, layer: LayerInfo | None = None) -> None:
        self.config = config
        self.layer = layer or LayerInfo()
        # The layer's own options (``KVCacheConfig.layers`` overrides), saved or built.
        self.opts = config.layer_options(self.layer.layer_idx)
        self.offset = 0
        self.batch_size = 0

    def __deepcopy__(self, memo: dict) -> CompressedCache:
        memo.update({id(a): a for a in self._constants()})
        out = memo[id(self)] = object.__new__(type(self))
        out.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return out

    # ---- required ----
    @abstractmethod
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store a chunk; return dense keys/values, or the chunk itself when ``attends``."""

    @abstractmethod
    def held_arrays(self) -> list[mx.array]:
        """Every array this cache keeps alive (compressed form, window, installed state)."""

    @abstractmethod
    def accounted_bytes(self) -> int:
        """Bytes the method's own storage formula gives for what is held."""

    @property
    @abstractmethod
    def state(self) -> Any:
        """Arrays (possibly nested lists) that rebuild the cache with ``meta_state``."""

    @state.setter
    @abstractmethod
    def state(self, v: Any) -> None: ...

    # ---- optional capabilities ----
    def attend(self, queries: mx.array, scale: float, mask: Any = None) -> mx.array:
        """Attention of ``queries`` over everything held (only when ``attends``)."""
        raise NotImplementedError(f"{type(self).__name__} ({self.method!r}) does not run "
                                  "its own attention")

    def keys_and_values(self, dtype: mx.Dtype | None = None) -> tuple[mx.array, mx.array]:
        """A transient dense copy of the keys/values held: mlx_lm's call for reading a
        cache without updating it (models whose layers share K/V), diagnostics, and
        layers whose attention does not reach ``attend`` (``adapter.mlx_lm``)."""
        raise NotImplementedError(f"{type(self).__name__} ({self.method!r}) has no dense "
                                  "reconstruction of its keys and values")

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        raise NotTrimmableError(f"{type(self).__name__} ({self.method!r}) of layer "
                                f"{self.layer.layer_idx} is not trimmable: "
                                f"{type(self).profile.trim_refusal(self)}")

    @classmethod
    def merge(cls, caches: list[Any]) -> Any:
        """One batch cache over per-sequence caches (mlx_lm's ``_merge_caches``)."""
        if not cls.profile.batching:
            raise NotImplementedError(
                f"method {cls.method!r} does not support batch merging: generate one "
                "sequence at a time")
        from veloxquant_mlx.cache.batch import BatchedCache

        return BatchedCache.merge(caches)

    def __getattr__(self, name: str) -> Any:
        # mlx_lm's batch-only calls get an error that says what to do instead; they are
        # not members, so ``hasattr`` still tells a merged batch from a sequence's cache.
        if name in BATCH_ONLY:
            raise BatchOnlyError(
                f"{type(self).__name__} ({self.method!r}): {name} is defined on a merged "
                "batch cache; merge per-sequence caches first with merge([...])")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # ---- storage accounting ----
    @property
    def nbytes(self) -> int:
        """Bytes of the distinct arrays held (what the cache declares it costs)."""
        seen: set[int] = set()
        total = 0
        for a in self.held_arrays():
            if a is None or id(a) in seen:
                continue
            seen.add(id(a))
            total += a.nbytes
        return total

    # ---- optional hooks, private to the cache package (batches, coding) ----
    def _commit(self) -> None:
        """Code what the last step attended in full precision (default: nothing)."""

    def _incoming(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array] | None:
        """The per-sequence-independent part of ``update_and_fetch`` (a rotation, a cast) or
        None; a batch computes it once and passes each row its slice as ``incoming=``."""
        return None

    def _constants(self) -> list[mx.array]:
        """Immutable arrays (rotations) that deep copies share: copies still batch."""
        return []

    @classmethod
    def _attend_rows(cls, rows: list[Any], queries: mx.array, scale: float
                     ) -> mx.array | None:
        """One decode call over a batch's rows (``cache.batch``), or None: per row."""
        return None

    # ---- mlx_lm protocol ----
    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        return create_attention_mask(N, offset=self.offset, return_array=return_array,
                                     window_size=window_size)

    @property
    def meta_state(self) -> tuple[str, ...]:
        return tuple(_meta_str(getattr(self, name)) for name in self.meta_fields)

    @meta_state.setter
    def meta_state(self, v: tuple[str, ...]) -> None:
        if len(v) < len(self.meta_fields):
            raise ValueError(f"{type(self).__name__}: meta_state has {len(v)} entries, "
                             f"expected {len(self.meta_fields)} ({', '.join(self.meta_fields)})")
        for name, text in zip(self.meta_fields, v):
            setattr(self, name, self.meta_fields[name](text))


def restore_saved(cls: type[CompressedCache], config: KVCacheConfig, layer: LayerInfo,
                  state: Any, meta_state: tuple[str, ...]) -> CompressedCache:
    """A saved layer of method class ``cls`` rebuilt: ``meta_state`` first (it says how
    ``state`` is laid out). ``layer`` already carries the roles and the fresh coordinator
    that ``assign_roles`` injected; a registered restorer (a rotated class, a
    sliding-window ring over the method) takes the layer where it applies."""
    for restore in LAYER_RESTORERS:
        cache = restore(cls, config, layer, state, meta_state)
        if cache is not None:
            return cache
    cache = cls(config, layer)
    cache.meta_state = meta_state
    cache.state = state
    return cache


def code_pending(cache: CompressedCache) -> None:
    """Code what ``cache`` holds in full precision until its next attention (a restore
    that fed it chunks without attending them; a prefill's attention does it itself)."""
    cache._commit()


def window_dtype(config: KVCacheConfig, compute_dtype: mx.Dtype) -> mx.Dtype:
    """Dtype of a full-precision window (config ``window_dtype``; None: as computed)."""
    name = config.window_dtype
    return compute_dtype if name is None else DTYPES[name]


def check_input(cache: CompressedCache, keys: mx.array, values: mx.array) -> None:
    """A chunk's shapes must match the layer ``cache`` was built for, its values be
    finite, its model still route attention to it, and its tokens fit ``max_ctx``."""
    info, name = cache.layer, cache.method
    if keys.ndim != 4 or values.ndim != 4:
        raise ValueError(
            f"{name}: keys/values must be [B, n_kv_heads, L, head_dim], got "
            f"keys {tuple(keys.shape)} and values {tuple(values.shape)}")
    B, H, L, D = keys.shape
    if H != info.n_kv_heads or D != info.head_dim:
        raise ValueError(
            f"{name} cache of layer {info.layer_idx}: keys shape {tuple(keys.shape)} does "
            f"not match n_kv_heads={info.n_kv_heads}, head_dim={info.head_dim}")
    if values.shape[:3] != (B, H, L) or values.shape[3] != info.v_head_dim:
        raise ValueError(
            f"{name} cache of layer {info.layer_idx}: values shape "
            f"{tuple(values.shape)} does not match keys {tuple(keys.shape)} / "
            f"v_head_dim={info.v_head_dim}")
    _check_routing(cache)
    if cache.batch_size and B != cache.batch_size:
        raise ValueError(f"{name}: batch size changed from {cache.batch_size} to {B}")
    # Prompt chunks only: a check per decode step would force a sync in every layer.
    if L > 1 and not finite.already_checked():
        finite.require(keys, values, f"{name} cache of layer {info.layer_idx}")
    check_budget(cache, L)


def _check_routing(cache: CompressedCache) -> None:
    """A cache that runs its own attention returns only the new chunk: used after its
    model was detached, the model would attend over that chunk alone."""
    info = cache.layer
    if cache.attends and info.routing is not None and not info.routing():
        raise RuntimeError(
            f"{cache.method} cache of layer {info.layer_idx} was built for a model that "
            "has since been detached (KVCacheBuilder.detach): its attention no longer "
            "reaches the cache; build new caches for it")


def check_budget(cache: CompressedCache, n_new: int) -> None:
    """Writing ``n_new`` more tokens must stay within ``KVCacheConfig.max_ctx``."""
    if cache.offset + n_new > cache.config.max_ctx:
        raise ValueError(
            f"{cache.method} cache of layer {cache.layer.layer_idx}: "
            f"{cache.offset + n_new} tokens exceed KVCacheConfig.max_ctx="
            f"{cache.config.max_ctx}")


def require_built(cache: CompressedCache) -> None:
    """A cache adopts a saved state only once built with its config and layer (mlx_lm's
    ``from_state`` skips ``__init__``)."""
    if "stored" not in cache.__dict__:
        raise TypeError(
            f"{type(cache).__name__} needs its config and layer to adopt a saved state: "
            "rebuild it with restore_saved(cls, config, layer, state, meta_state) or "
            "veloxquant_mlx.load_prompt_cache")


def depend_on_state(outputs: Any, cache: Any) -> Any:
    """``outputs`` (an array or a list) made to depend on every array ``cache`` holds.

    A step's codes are lazy arrays that the logits do not need; without this edge,
    ``mx.eval(logits)`` leaves them unevaluated and their graph keeps the chunk's
    full-precision keys and values alive until something evaluates the state.
    """
    compressed = isinstance(cache, CompressedCache)  # else a batch: its rows' arrays
    arrays = type(cache).profile.step_arrays(cache) if compressed else cache.held_arrays()
    held = [a for a in arrays if a is not None]
    return mx.depends(outputs, held) if held else outputs


def require_group_divides(layer: LayerInfo, group_size: int, owner: str = "KVCacheConfig"
                          ) -> None:
    """``group_size`` must divide the layer's key and value head dims."""
    for name, d in (("head_dim", layer.head_dim), ("v_head_dim", layer.v_head_dim)):
        if d % group_size:
            divisors = [g for g in (32, 64, 128) if d % g == 0]
            raise config_error(
                "group_size", group_size,
                f"a divisor of {name}={d} of layer {layer.layer_idx} (one of {divisors})",
                owner)
