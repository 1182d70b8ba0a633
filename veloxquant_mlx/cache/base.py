"""The cache contract every method implements.

A cache is one object per layer that mlx_lm's models call exactly like its own
``KVCache``: ``update_and_fetch(keys, values)`` with ``[B, n_kv_heads, L, head_dim]``
arrays, ``offset``, ``make_mask``, ``state``/``meta_state``, ``trim``.

Required (abstract): ``update_and_fetch``, ``held_arrays``, ``accounted_bytes`` and
``state``. Optional, with the defaults below: ``attends`` + ``attend`` (attention over
the compressed form, reached through ``adapter.mlx_lm``'s routing; ``update_and_fetch``
then returns only the new chunk), ``dense_kv``, ``trim``, ``merge`` (batches),
``meta_fields`` (what ``meta_state`` saves) and the declared capabilities below.
"""

from __future__ import annotations

import copy
import copyreg
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar

import mlx.core as mx
from mlx_lm.models.cache import KVCache, _BaseCache, create_attention_mask

from veloxquant_mlx.cache import finite
from veloxquant_mlx.cache.step_cost import StepCost
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


class CompressedCache(StepCost, _BaseCache, ABC):
    """Base class of every veloxquant cache (one per layer); see the module docstring."""

    # Registry facts (``veloxquant methods``), set by each method class.
    method: ClassVar[str] = ""
    family: ClassVar[str] = ""
    paper: ClassVar[str] = "-"
    stores: ClassVar[str] = ""
    cross_layer: ClassVar[bool] = False
    Options: ClassVar[type[MethodOptions]] = MethodOptions
    # Capabilities. ``recommended``: the near-lossless setting the demo and README show.
    recommended: ClassVar[bool] = False
    attends: ClassVar[bool] = False
    supports_batching: ClassVar[bool] = True
    # Keys/values meet attention only in dot products: the builder may rotate them.
    rotatable: ClassVar[bool] = False
    meta_fields: ClassVar[tuple[str, ...]] = ("offset", "batch_size")
    # How a meta field is parsed back from its string (default: int).
    meta_types: ClassVar[dict[str, Any]] = {}

    # ---- declared capabilities ----
    # All shared code may know of a method (tests/test_capabilities.py).
    # Takes over the owning module's call with a hook of its own (XQuant's ``update_x``).
    hooks_module: ClassVar[bool] = False
    min_layers: ClassVar[int] = 1  # fewest layers it compresses (a pair needs two)
    # Holds fewer tokens than it saw (eviction): self-attending layers are refused.
    evicts: ClassVar[bool] = False
    # This layer holds what the method keeps once per model (``after_build``: a rotation).
    owns_rotation: bool = False
    # Drops its oldest tokens exactly (``drop_oldest``): a sliding ring may wrap it.
    drops_front: ClassVar[bool] = False

    @classmethod
    def ring_alignment(cls, opts: Any) -> int:
        return 1

    @classmethod
    def attend_rows(cls, rows: list[Any], queries: mx.array, scale: float
                    ) -> mx.array | None:
        """One decode call over a batch's rows (``cache.batch``), or None: per row."""
        return None

    def commit(self) -> None:
        """Code what the last step attended in full precision (default: nothing)."""

    def check_state(self) -> None:
        """Restored arrays outside the stored form, checked (``cache.restore_check``)."""

    def reusable_prefix(self, keep: int) -> int | None:
        """Longest exact cut ``<= keep`` for reuse; None: as ``stored_numerics`` says."""
        return None

    def drop_oldest(self, n: int) -> None:
        """Forget the ``n`` oldest tokens (whole ``ring_alignment`` units), never re-coding."""
        raise NotImplementedError(f"method {self.method!r} cannot drop its oldest tokens")

    @classmethod
    def needs_rotation(cls, opts: Any) -> bool:
        """The options' codes assume rotated vectors: the builder rotates the caches."""
        return False

    @classmethod
    def rotation_refusal(cls, opts: Any) -> str | None:
        """Why ``rotate=True`` is wrong with these options of a ``rotatable`` method."""
        return None

    @classmethod
    def replicated_by_tensor_parallelism(cls, opts: Any, kv_width: int, hidden: int
                                         ) -> str | None:
        """What every tensor-parallel rank holds whole (``None``: its own heads only)."""
        return None

    @classmethod
    def curve_tags(cls, opts: Any) -> list[str]:
        """Options that put it on another bytes-to-quality curve (``veloxquant tune``)."""
        return []

    @classmethod
    def precision_ladders(cls) -> dict[str, dict[str, Any]]:
        """``eval.mixed`` ladders: name -> ``{"base": options, "knobs": {option: widths
        ascending}, "streams": {option: ("keys", "values")}}``."""
        return {}

    @classmethod
    def small_options(cls) -> dict[str, Any]:
        """Options that compress a tiny model's 40-token prompt (head_dim 32, 4 layers)."""
        return {}

    @classmethod
    def lossless_options(cls) -> dict[str, Any]:
        """Options that keep (nearly) everything of a 40-token prompt (tests)."""
        return {}

    @classmethod
    def few_layer_options(cls) -> dict[str, Any]:
        """Options added on models of one or two layers, so it still compresses."""
        return {}

    @classmethod
    def stored_numerics(cls, config: KVCacheConfig, layer: LayerInfo) -> Any:
        """Its numerics for the tests' same-numerics reference (``cache.numerics``)."""
        from veloxquant_mlx.cache.numerics import StoredNumerics
        return StoredNumerics()  # nothing coded or evicted

    def attention_slots(self) -> tuple[list[Any], list[Any]]:
        """Key and value parts (``ops.attention.Slot``) decode attention multiplies."""
        return [], []

    def __init__(self, config: KVCacheConfig, layer: LayerInfo | None = None) -> None:
        self.config = config
        self.layer = layer or LayerInfo()
        # The layer's own options (``KVCacheConfig.layers`` overrides), saved or built.
        self.opts = config.layer_options(self.layer.layer_idx)
        self.offset = 0
        self.batch_size = 0

    def constants(self) -> list[mx.array]:
        """Immutable arrays (rotations) that deep copies share: copies still batch."""
        return []

    def __deepcopy__(self, memo: dict) -> CompressedCache:
        memo.update({id(a): a for a in self.constants()})
        out = memo[id(self)] = object.__new__(type(self))
        out.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return out

    # ---- required ----
    @abstractmethod
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store a chunk; return dense keys/values, or the chunk itself when ``attends``."""

    def incoming(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array] | None:
        """The per-sequence-independent part of ``update_and_fetch`` (a rotation, a cast) or
        None; a batch computes it once and passes each row its slice as ``incoming=``."""
        return None

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

    # ---- building (class-level hooks of the builder) ----
    @classmethod
    def supports_layer(cls, layer_cache: Any) -> bool:
        """Whether this method replaces the model's own cache of this layer.

        Plain full-attention layers use mlx_lm's ``KVCache``; sliding-window and
        recurrent layers keep their own cache unless a method overrides this.
        """
        return type(layer_cache) is KVCache

    @classmethod
    def assign_roles(cls, layers: list[LayerInfo], config: KVCacheConfig, model: Any) -> None:
        """Set group ids / member indices and inject coordinators (cross-layer methods).

        ``layers`` are the layers this method compresses, in model order. The default
        makes every layer its own group of one.
        """
        for i, info in enumerate(layers):
            info.group_id, info.member_idx, info.group_size = i, 0, 1

    @classmethod
    def after_build(cls, caches: list[CompressedCache], config: KVCacheConfig,
                    model: Any) -> None:
        """Hook run once all caches of a model are built (link pairs, install hooks)."""

    @classmethod
    def detach(cls, model: Any) -> None:
        """Remove whatever ``after_build`` installed on ``model`` (default: nothing)."""

    @classmethod
    def tune_grid(cls, context: int) -> list[dict[str, Any]]:
        """Option sets ``veloxquant tune`` tries at ``context`` tokens, spanning the
        method's useful range of compression (default: none, the method is not tuned)."""
        return []

    @classmethod
    def from_saved(cls, config: KVCacheConfig, layer: LayerInfo, state: Any,
                   meta_state: tuple[str, ...]) -> CompressedCache:
        """Rebuild a saved cache: ``meta_state`` first (it says how ``state`` is laid out).

        ``layer`` already carries the roles and the fresh coordinator that
        ``assign_roles`` injected.
        """
        for restore in LAYER_RESTORERS:  # e.g. a sliding-window ring over this method
            cache = restore(cls, config, layer, state, meta_state)
            if cache is not None:
                return cache
        cache = cls(config, layer)
        cache.meta_state = meta_state
        cache.state = state
        return cache

    # ---- optional capabilities ----
    def attend(self, queries: mx.array, scale: float, mask: Any = None) -> mx.array:
        """Attention of ``queries`` over everything held (only when ``attends``)."""
        raise NotImplementedError(f"{type(self).__name__} ({self.method!r}) does not run "
                                  "its own attention")

    def dense_kv(self, dtype: mx.Dtype | None = None) -> tuple[mx.array, mx.array]:
        """A transient dense copy of the keys/values held (diagnostics, and layers whose
        attention does not reach ``attend``: see ``adapter.mlx_lm``)."""
        raise NotImplementedError(f"{type(self).__name__} ({self.method!r}) has no dense "
                                  "reconstruction of its keys and values")

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        """mlx_lm's name for reading a cache without updating it (models whose layers
        share K/V call it): a transient dense reconstruction, as ``dense_kv``."""
        return self.dense_kv()

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        raise NotTrimmableError(
            f"{type(self).__name__} ({self.method!r}) is not trimmable: its compressed "
            "form cannot drop tokens from the end")

    @classmethod
    def merge(cls, caches: list[Any]) -> Any:
        """One batch cache over per-sequence caches (mlx_lm's ``_merge_caches``)."""
        if not cls.supports_batching:
            raise NotImplementedError(
                f"method {cls.method!r} does not support batch merging: generate one "
                "sequence at a time")
        from veloxquant_mlx.cache.batch import BatchedCache

        return BatchedCache.merge(caches)

    def _batch_only(self, name: str) -> NotImplementedError:
        return NotImplementedError(
            f"{type(self).__name__} ({self.method!r}): {name} is defined on a merged "
            "batch cache; merge per-sequence caches first with merge([...])")

    def extract(self, idx: int) -> Any:
        raise self._batch_only("extract")

    def filter(self, batch_indices: list[int]) -> None:
        raise self._batch_only("filter")

    def extend(self, other: Any) -> None:
        raise self._batch_only("extend")

    def prepare(self, **kwargs: Any) -> None:
        raise self._batch_only("prepare")

    def finalize(self) -> None:
        raise self._batch_only("finalize")

    # ---- storage accounting ----
    def step_arrays(self) -> list[mx.array]:
        """What a step's attention output must depend on (``depend_on_state``): what
        this cache holds; a cross-layer cache adds what its step changed in the group."""
        return self.held_arrays()

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

    def fp16_bytes(self) -> int:
        """Bytes a dense float16 cache (mlx_lm's for this layer: a local layer's holds
        its window at most) would hold for the same tokens."""
        width = self.layer.n_kv_heads * (self.layer.head_dim + self.layer.v_head_dim)
        return max(self.batch_size, 1) * self.window_tokens() * width * 2


    def stats(self) -> dict[str, Any]:
        """Held bytes, accounted bytes, fp16-equivalent bytes, tokens and ratio."""
        held = self.nbytes
        fp16 = self.fp16_bytes()
        return {
            "method": self.method,
            "layer": self.layer.layer_idx,
            "tokens": self.offset,
            "held_bytes": held,
            "accounted_bytes": self.accounted_bytes(),
            "fp16_bytes": fp16,
            "ratio": (held / fp16) if fp16 else 0.0,
            "decode_flops": self.decode_flops(),
        }

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
            setattr(self, name, self.meta_types.get(name, int)(text))

    # ---- helpers for subclasses ----
    def window_dtype(self, compute_dtype: mx.Dtype) -> mx.Dtype:
        """Dtype of the full-precision window (config ``window_dtype``)."""
        name = self.config.window_dtype
        return compute_dtype if name is None else DTYPES[name]

    def check_input(self, keys: mx.array, values: mx.array) -> None:
        """Shapes must match the layer this cache was built for; values must be finite."""
        if keys.ndim != 4 or values.ndim != 4:
            raise ValueError(
                f"{self.method}: keys/values must be [B, n_kv_heads, L, head_dim], got "
                f"keys {tuple(keys.shape)} and values {tuple(values.shape)}")
        B, H, L, D = keys.shape
        if H != self.layer.n_kv_heads or D != self.layer.head_dim:
            raise ValueError(
                f"{self.method} cache of layer {self.layer.layer_idx}: keys shape "
                f"{tuple(keys.shape)} does not match n_kv_heads={self.layer.n_kv_heads}, "
                f"head_dim={self.layer.head_dim}")
        if values.shape[:3] != (B, H, L) or values.shape[3] != self.layer.v_head_dim:
            raise ValueError(
                f"{self.method} cache of layer {self.layer.layer_idx}: values shape "
                f"{tuple(values.shape)} does not match keys {tuple(keys.shape)} / "
                f"v_head_dim={self.layer.v_head_dim}")
        self.check_routing()
        if self.batch_size and B != self.batch_size:
            raise ValueError(f"{self.method}: batch size changed from {self.batch_size} to {B}")
        # Prompt chunks only: a check per decode step would force a sync in every layer.
        if L > 1 and not finite.already_checked():
            finite.require(keys, values, f"{self.method} cache of layer {self.layer.layer_idx}")
        self.check_budget(L)

    def check_routing(self) -> None:
        """A cache that runs its own attention returns only the new chunk: used after its
        model was detached, the model would attend over that chunk alone."""
        if self.attends and self.layer.routing is not None and not self.layer.routing():
            raise RuntimeError(
                f"{self.method} cache of layer {self.layer.layer_idx} was built for a model "
                "that has since been detached (KVCacheBuilder.detach): its attention no "
                "longer reaches the cache; build new caches for it")

    def check_budget(self, n_new: int) -> None:
        """Writing ``n_new`` more tokens must stay within ``KVCacheConfig.max_ctx``."""
        if self.offset + n_new > self.config.max_ctx:
            raise ValueError(
                f"{self.method} cache of layer {self.layer.layer_idx}: {self.offset + n_new} "
                f"tokens exceed KVCacheConfig.max_ctx={self.config.max_ctx}")


def depend_on_state(outputs: Any, cache: Any) -> Any:
    """``outputs`` (an array or a list) made to depend on every array ``cache`` holds.

    A step's codes are lazy arrays that the logits do not need; without this edge,
    ``mx.eval(logits)`` leaves them unevaluated and their graph keeps the chunk's
    full-precision keys and values alive until something evaluates the state.
    """
    arrays = getattr(cache, "step_arrays", cache.held_arrays)()
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
