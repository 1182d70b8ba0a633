"""``KVCacheConfig.rotate``: any method's cache, over keys and values rotated per head.

Rotating every key, value and query of a head by one orthogonal ``R`` leaves attention
exact: scores are dot products (``(q R)(k R)^T = q k^T``) and an output computed over
rotated values is rotated back once (``out R^T``). What changes is what the method
stores: after a random rotation (a randomized Hadamard transform, ``ops.rotation``) the
channels of a vector are close to i.i.d. Gaussian, so outlier channels no longer set the
scale of a whole quantization group (QuaRot, TurboQuant arXiv 2504.19874).

``rotated_class(cls)`` is a subclass of the method's own cache class, so everything that
looks at the class (cross-layer roles and links, sliding-window rings, saved caches,
batches) sees the method itself; the subclass only:

- rotates keys and values before the method stores them (``update_and_fetch``, and
  ``_incoming``, which a batch computes once for its rows);
- rotates the queries the same way and the attention output back (``attend``);
- rotates a dense reconstruction back (``keys_and_values``), except while the method's own
  ``attend`` reads it (MiniCache attends over its reconstruction);
- declares the rotation once per model: one seeded matrix per head width, shared by every
  layer of the process, held by the first layer's cache (``after_build``), a flag that
  ``meta_state`` carries so a rebuilt or loaded cache keeps it.

Methods declare that they can take it with ``rotatable = True``: their attention meets
the stored keys only in dot products with queries, and refuse it for options where it
would be wrong with ``rotation_refusal`` (xKV's keys stored before RoPE: RoPE and a fixed
rotation do not commute; ``KVCacheConfig`` refuses it).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from veloxquant_mlx.cache.base import LAYER_RESTORERS, CompressedCache, LayerInfo, restore_saved
from veloxquant_mlx.ops.rotation import shared_rotation

if TYPE_CHECKING:
    from veloxquant_mlx.config import KVCacheConfig

SEED = 0
_CLASSES: dict[type, type] = {}


def wants_rotation(config: KVCacheConfig, method_cls: type | None = None) -> bool:
    """Whether the builder rotates this config's caches: ``rotate=True``, or options whose
    codes assume rotated vectors (the method's ``needs_rotation``: codebook stores).
    ``method_cls``: the method's class where the caller has it (else looked up)."""
    cls = config.method_class if method_cls is None else method_cls
    return config.rotate or cls.profile.needs_rotation(config.options)


def _turn(x: mx.array, rot: mx.array) -> mx.array:
    return (x.astype(mx.float32) @ rot).astype(x.dtype)


class RotatedMixin:
    """The rotation around a method's cache (see the module doc)."""

    rotated = True

    def __init__(self, config: KVCacheConfig, layer: LayerInfo | None = None) -> None:
        super().__init__(config, layer)
        self.rot_k = shared_rotation(self.layer.head_dim, SEED)
        self.rot_v = shared_rotation(self.layer.v_head_dim, SEED)
        self.owns_rotation = False
        self._raw = False  # inside the method's own attend: its reconstruction stays rotated

    def _constants(self) -> list[mx.array]:
        return [self.rot_k, self.rot_v, *super()._constants()]

    def _method_turns(self) -> bool:
        """Whether the method has an ``_incoming`` hook of its own."""
        return super()._incoming.__func__ is not CompressedCache._incoming

    def _incoming(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """The chunk rotated, then what the method makes of it alike (a batch computes
        this once for all its rows)."""
        k, v = _turn(keys, self.rot_k), _turn(values, self.rot_v)
        return super()._incoming(k, v) if self._method_turns() else (k, v)

    def update_and_fetch(self, keys: mx.array, values: mx.array,
                         incoming: tuple[mx.array, mx.array] | None = None
                         ) -> tuple[mx.array, mx.array]:
        turned = incoming or self._incoming(keys, values)
        if self._method_turns():  # it stores ``turned``; ``keys`` for shape and dtype
            return super().update_and_fetch(keys, values, incoming=turned)
        return super().update_and_fetch(*turned)

    def attend(self, queries: mx.array, scale: float, mask: Any = None) -> mx.array:
        self._raw = True
        try:
            out = super().attend(_turn(queries, self.rot_k), scale, mask)
        finally:
            self._raw = False
        return _turn(out, self.rot_v.T)

    @classmethod
    def _attend_rows(cls, rows: list[Any], queries: mx.array, scale: float
                    ) -> mx.array | None:
        first = rows[0]
        out = super()._attend_rows(rows, _turn(queries, first.rot_k), scale)
        return None if out is None else _turn(out, first.rot_v.T)

    def _dense_back(self, dtype: mx.Dtype | None = None) -> tuple[mx.array, mx.array]:
        keys, values = super().keys_and_values(dtype)
        if self._raw:
            return keys, values
        return _turn(keys, self.rot_k.T), _turn(values, self.rot_v.T)

    # ---- the rotation, declared once ----
    def _rotations(self) -> list[mx.array]:
        if not self.owns_rotation:
            return []
        return list({id(r): r for r in (self.rot_k, self.rot_v)}.values())

    def held_arrays(self) -> list[mx.array]:
        return super().held_arrays() + self._rotations()

    def accounted_bytes(self) -> int:
        return super().accounted_bytes() + sum(r.nbytes for r in self._rotations())

    @property
    def meta_state(self) -> tuple[str, ...]:
        return (*super().meta_state, str(int(self.owns_rotation)))

    @meta_state.setter
    def meta_state(self, v: tuple[str, ...]) -> None:
        super(RotatedMixin, type(self)).meta_state.fset(self, tuple(v[:-1]))
        self.owns_rotation = v[-1] == "1"


def _declared_once(profile: Any) -> Any:
    """The method's ``after_build``, then the rotation declared by the first layer."""
    def after_build(caches: list[CompressedCache], config: KVCacheConfig, model: Any) -> None:
        profile.after_build(caches, config, model)
        first_layer_owns(caches)
    return after_build


def first_layer_owns(caches: list[CompressedCache], *_: Any) -> None:
    """A rotation shared by every layer is held, and counted, by the first layer only."""
    for i, c in enumerate(caches):
        getattr(c, "inner", c).owns_rotation = i == 0  # a ring holds the cache inside


def rotated_class(cls: type) -> type:
    """``cls`` with the rotation around it (one class per method, made once)."""
    if getattr(cls, "rotated", False):
        return cls
    if cls not in _CLASSES:
        profile = dataclasses.replace(cls.profile, stores=f"{cls.profile.stores}; rotated "
                                      "per head", after_build=_declared_once(cls.profile))
        body: dict[str, Any] = {"__module__": __name__, "profile": profile}
        if cls.keys_and_values is not CompressedCache.keys_and_values:  # only where the method has one
            body["keys_and_values"] = RotatedMixin._dense_back
        name = f"Rotated{cls.__name__}"
        _CLASSES[cls] = type(name, (RotatedMixin, cls), body)
        globals()[name] = _CLASSES[cls]  # importable by name (pickle, saved class paths)
    return _CLASSES[cls]


def _restore(method_cls: type, config: KVCacheConfig, layer: LayerInfo, state: Any,
             meta_state: tuple[str, ...]) -> CompressedCache | None:
    """A saved layer of a rotated config comes back rotated (rings included)."""
    if wants_rotation(config) and not getattr(method_cls, "rotated", False):
        return restore_saved(rotated_class(method_cls), config, layer, state, meta_state)
    return None


LAYER_RESTORERS.insert(0, _restore)  # before the sliding-window ring's, which it wraps
