"""Mixed precision under a byte budget: per-layer (and keys vs values) code widths.

A short calibration pass on the user's text (a few hundred tokens):

1. **Sensitivity.** One forward and backward pass of the dense model with a zero
   perturbation added to every layer's cached keys and values: the gradient ``g`` of the
   text's loss (summed NLL) with respect to each cached element. To second order a
   perturbation ``d`` of the cache costs ``~ 1/2 sum F d^2`` in loss, with ``F ~ g^2`` the
   diagonal empirical Fisher information (as KVQuant, arXiv 2401.18079, weighs its
   quantization error).
2. **Distortion.** Each layer's captured keys and values go through one cache of the
   method per width (``knob`` value: ``k_bits``, ``v_bits`` or ``bits``), and the real
   reconstruction error ``d`` (``keys_and_values``, rotated back where the method rotates) is
   weighed: ``cost(layer, knob, value) = sum F d^2`` over that knob's stream(s). No
   assumption about the error's distribution, sinks and windows the method keeps in
   full precision included.
3. **Bytes.** Each width's accounted bytes at the target context (one cache per layer
   shape, fed that many tokens).
4. **Allocation.** Minimize the summed cost under the byte budget: a Lagrangian sweep
   (each (layer, knob) picks the value minimizing ``cost + lambda * bytes``; bisection on
   ``lambda``), which is exact on the convex hull of each knob's (bytes, cost) points.

The result is a ``KVCacheConfig`` with per-layer overrides (``KVCacheConfig.layers``);
``veloxquant tune`` measures it like every other candidate (real bytes, paired quality).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, make_prompt_cache

from veloxquant_mlx.adapter.builder import KVCacheBuilder
from veloxquant_mlx.cache.base import LayerInfo
from veloxquant_mlx.cache.rotated import rotated_class, wants_rotation
from veloxquant_mlx.config import KVCacheConfig
from veloxquant_mlx.registry import get_method, methods


@dataclass(frozen=True)
class Ladder:
    """How a method is mixed: shared options and the per-layer knobs with their values
    (ascending width); ``streams`` says what each knob codes."""

    method: str
    base: dict[str, Any]
    knobs: dict[str, tuple[Any, ...]]
    streams: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def config(self, **values: Any) -> KVCacheConfig:
        return KVCacheConfig(self.method, **{**self.base, **values})

    def top(self) -> dict[str, Any]:
        return {k: v[-1] for k, v in self.knobs.items()}


def ladders() -> dict[str, Ladder]:
    """Ladder name -> ladder, from every method's ``precision_ladders`` (``veloxquant
    tune`` calibrates each whose method it considers)."""
    out: dict[str, Ladder] = {}
    for name, cls in methods().items():
        for label, spec in cls.profile.ladders.items():
            if label in out:
                raise ValueError(f"precision ladder {label!r} of method {name!r} is also "
                                 f"one of method {out[label].method!r}")
            out[label] = Ladder(name, **spec)
    return out


class _Perturbed(KVCache):
    """mlx_lm's dense cache with a perturbation added to what it stores."""

    def __init__(self, dk: mx.array, dv: mx.array) -> None:
        super().__init__()
        self.dk, self.dv = dk, dv

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return super().update_and_fetch(keys + self.dk, values + self.dv)


def _caches(model: nn.Module, slots: list[int], deltas: list[mx.array]) -> list[Any]:
    caches = make_prompt_cache(model)
    for j, i in enumerate(slots):
        caches[i] = _Perturbed(deltas[2 * j], deltas[2 * j + 1])
    return caches


def fisher(model: nn.Module, tokens: Sequence[int], infos: list[LayerInfo | None]
           ) -> tuple[list[int], list[mx.array], list[mx.array]]:
    """Compressed slots, their cached keys/values ``[K0, V0, K1, ...]`` on ``tokens`` and
    the squared loss gradients with respect to them (same layout)."""
    slots = [i for i, info in enumerate(infos) if info is not None]
    x = mx.array(list(tokens[:-1]), dtype=mx.int32)[None]
    y = mx.array(list(tokens[1:]), dtype=mx.int32)
    T = x.shape[1]
    zeros = [mx.zeros((1, infos[i].n_kv_heads, T, d), mx.float32)
             for i in slots for d in (infos[i].head_dim, infos[i].v_head_dim)]
    caches = _caches(model, slots, zeros)  # a plain pass: the cached keys/values
    mx.eval(model(x, cache=caches))
    kv = [a[:, :, :T] for i in slots for a in (caches[i].keys, caches[i].values)]
    mx.eval(kv)

    def loss(deltas: list[mx.array]) -> mx.array:
        logits = model(x, cache=_caches(model, slots, deltas))
        return nn.losses.cross_entropy(logits[0].astype(mx.float32), y, reduction="sum")

    grads = mx.grad(loss)(zeros)
    squared = [g.astype(mx.float32) ** 2 for g in grads]
    mx.eval(squared)
    return slots, kv, squared


def _cache_class(config: KVCacheConfig) -> type:
    cls = get_method(config.method)
    return rotated_class(cls) if wants_rotation(config) else cls


def _through_cache(config: KVCacheConfig, info: LayerInfo, keys: mx.array,
                   values: mx.array) -> Any:
    """A cache of ``config`` that has stored ``keys``/``values`` (and attended once, so
    that methods coding at the end of a step have coded them)."""
    cache = _cache_class(config)(config, info)
    cache.owns_rotation = False  # one per model, not per layer: not a layer's bytes
    cache.update_and_fetch(keys, values)
    if cache.attends:
        q = mx.zeros((keys.shape[0], info.n_kv_heads, 1, info.head_dim), keys.dtype)
        cache.attend(q, scale=1.0, mask=None)
    return cache


def knob_costs(ladder: Ladder, info: LayerInfo, kv: tuple[mx.array, mx.array],
               f: tuple[mx.array, mx.array]) -> dict[str, list[float]]:
    """Per knob, the Fisher-weighted squared error of each of its values (the other
    knobs at their widest)."""
    out: dict[str, list[float]] = {}
    for knob, values in ladder.knobs.items():
        streams = ladder.streams.get(knob, ("keys", "values"))
        costs = []
        for value in values:
            cfg = ladder.config(**{**ladder.top(), knob: value})
            back = _through_cache(cfg, info, *kv).keys_and_values(mx.float32)
            cost = sum(((b - x) ** 2 * w).sum() for s, b, x, w in
                       zip(("keys", "values"), back, kv, f) if s in streams)
            costs.append(float(cost.item()))
        out[knob] = costs
    return out


def knob_bytes(ladder: Ladder, info: LayerInfo, context: int) -> dict[str, list[int]]:
    """Per knob, the accounted bytes each value adds over the narrowest, at ``context``
    tokens; ``"base"``: the bytes with every knob at its narrowest."""
    k = mx.zeros((1, info.n_kv_heads, context, info.head_dim), mx.float32)
    v = mx.zeros((1, info.n_kv_heads, context, info.v_head_dim), mx.float32)
    low = {kn: vals[0] for kn, vals in ladder.knobs.items()}
    base = _through_cache(ladder.config(**low), info, k, v).accounted_bytes()
    out: dict[str, list[int]] = {"base": [base]}
    for knob, values in ladder.knobs.items():
        out[knob] = [_through_cache(ladder.config(**{**low, knob: val}), info, k, v)
                     .accounted_bytes() - base for val in values]
    return out


@dataclass
class Calibration:
    """What the calibration pass measured, per compressed slot."""

    ladder: Ladder
    slots: list[int]
    costs: list[dict[str, list[float]]]
    nbytes: list[dict[str, list[int]]]
    fp16_bytes: int  # of the compressed slots at the context
    fixed_bytes: int = 0  # held once per model whatever the widths (a rotation)

    def allocate(self, budget: float) -> dict[int, dict[str, int]]:
        """Per slot, the knob value indices that minimize the cost within ``budget`` x
        fp16 (the narrowest everywhere when even that does not fit)."""
        target = budget * self.fp16_bytes - self.fixed_bytes - \
            sum(b["base"][0] for b in self.nbytes)
        lo, hi = 0.0, 1.0
        while self._bytes(self._choose(hi)) > target and hi < 1e30:
            hi *= 16
        for _ in range(60):  # lambda: cost per byte; more lambda, fewer bytes
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self._bytes(self._choose(mid)) > target else (lo, mid)
        return self._choose(hi)

    def _choose(self, lam: float) -> dict[int, dict[str, int]]:
        return {slot: {knob: min(range(len(c)), key=lambda j: c[j] + lam * b[knob][j])
                       for knob, c in cost.items()}
                for slot, cost, b in zip(self.slots, self.costs, self.nbytes)}

    def _bytes(self, choice: dict[int, dict[str, int]]) -> int:
        return sum(b[knob][j] for b, pick in zip(self.nbytes, choice.values())
                   for knob, j in pick.items())

    def config(self, budget: float) -> KVCacheConfig:
        """The mixed config for ``budget``: the commonest width shared, the rest per layer."""
        picks = self.allocate(budget)
        values = {slot: {k: self.ladder.knobs[k][j] for k, j in p.items()}
                  for slot, p in picks.items()}
        shared = {}
        for knob in self.ladder.knobs:
            column = [v[knob] for v in values.values()]
            shared[knob] = max(set(column), key=column.count)
        overrides = {slot: {k: x for k, x in v.items() if x != shared[k]}
                     for slot, v in values.items()}
        layers = {s: o for s, o in overrides.items() if o} or None
        return self.ladder.config(**shared, layers=layers)


def calibrate(model: nn.Module, tokens: Sequence[int], ladder: Ladder,
              context: int) -> Calibration:
    """The calibration pass on ``tokens`` (a few hundred) for a ``context``-token cache."""
    infos = KVCacheBuilder.layer_infos(model)
    KVCacheBuilder.detach(model)  # the pass runs the dense model itself
    slots, kv, f = fisher(model, tokens, infos)
    costs, nbytes, fp16 = [], [], 0
    shapes: dict[tuple[int, int, int], dict[str, list[int]]] = {}
    for j, slot in enumerate(slots):
        info = infos[slot]
        costs.append(knob_costs(ladder, info, (kv[2 * j], kv[2 * j + 1]),
                                (f[2 * j], f[2 * j + 1])))
        shape = (info.n_kv_heads, info.head_dim, info.v_head_dim)
        if shape not in shapes:
            shapes[shape] = knob_bytes(ladder, info, context)
        nbytes.append(shapes[shape])
        fp16 += context * info.n_kv_heads * (info.head_dim + info.v_head_dim) * 2
    return Calibration(ladder, slots, costs, nbytes, fp16, _fixed_bytes(ladder, infos[slots[0]]))


def _fixed_bytes(ladder: Ladder, info: LayerInfo) -> int:
    """What the method holds once per model (its rotation), declared by one layer."""
    cache = _cache_class(ladder.config(**ladder.top()))(ladder.config(**ladder.top()), info)
    cache.owns_rotation = True
    owned = cache.accounted_bytes()
    cache.owns_rotation = False
    return owned - cache.accounted_bytes()
