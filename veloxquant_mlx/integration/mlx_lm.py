"""The glue to mlx_lm: attention routing, its build-time check, and model introspection.

mlx_lm's attention layers call a module-level ``scaled_dot_product_attention``
imported by name from ``mlx_lm.models.base`` into each model module. Routing
replaces that name in the loaded model modules with a wrapper that hands the
call to ``cache.attend(queries, scale, mask)`` when the cache ``attends``, and to the
original function otherwise, so models, ``generate``, ``stream_generate`` and
``batch_generate`` run unmodified. ``uninstall_attention_routing`` puts the
original back.

Some models compute attention themselves or call the MLX kernel directly; a cache
that returns only the new chunk would then be attended to that chunk alone.
``check_attention_routing`` runs a two-token probe through the model at build time
(graph construction only, nothing is computed) and raises ``UnsupportedModelError``
naming the model and layer when a probed layer's attention does not reach ``attend``.
This module imports nothing from the rest of the package: caches are duck-typed.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base as mlx_base
from mlx_lm.models.cache import KVCache, make_prompt_cache

_ORIGINAL_SDPA = mlx_base.scaled_dot_product_attention
_PATCHED: dict[str, Any] = {}
_ACTIVE = False


def routed_scaled_dot_product_attention(
    queries: mx.array,
    keys: Any,
    values: Any,
    cache: Any,
    scale: float,
    mask: Any,
    sinks: mx.array | None = None,
) -> mx.array:
    """Drop-in for mlx_lm's ``scaled_dot_product_attention`` that honours ``attend``."""
    if getattr(cache, "attends", False):
        if sinks is not None:
            raise NotImplementedError(
                f"{type(cache).__name__} does not support attention sinks (gpt-oss style)"
            )
        return cache.attend(queries, scale=scale, mask=mask)
    return _ORIGINAL_SDPA(queries, keys, values, cache=cache, scale=scale, mask=mask,
                          sinks=sinks)


def _model_modules() -> list[str]:
    return [
        name for name, mod in list(sys.modules.items())
        # Not base itself: modules imported later would copy the wrapper from it, and
        # uninstalling could not find them.
        if name.startswith("mlx_lm.models.") and name != "mlx_lm.models.base"
        and mod is not None
        and getattr(mod, "scaled_dot_product_attention", None) is _ORIGINAL_SDPA
    ]


def install_attention_routing(model: nn.Module | None = None) -> list[str]:
    """Route attention through ``cache.attend`` in every loaded mlx_lm model module.

    Returns the names of the modules patched by this call. Idempotent. Caches without
    ``attend`` see no change at all.
    """
    global _ACTIVE
    _ACTIVE = True
    names = _model_modules()
    if model is not None:
        for m in (type(model), *(type(x) for _, x in model.named_modules())):
            mod_name = m.__module__
            mod = sys.modules.get(mod_name)
            if mod is not None and getattr(mod, "scaled_dot_product_attention", None) \
                    is _ORIGINAL_SDPA and mod_name not in names:
                names.append(mod_name)
    for name in names:
        mod = sys.modules[name]
        _PATCHED[name] = mod.scaled_dot_product_attention
        mod.scaled_dot_product_attention = routed_scaled_dot_product_attention
    return names


def uninstall_attention_routing() -> None:
    """Put mlx_lm's original attention function back everywhere it was replaced."""
    global _ACTIVE
    _ACTIVE = False
    for name, original in list(_PATCHED.items()):
        mod = sys.modules.get(name)
        if mod is not None:
            mod.scaled_dot_product_attention = original
        del _PATCHED[name]


def routing_installed(module_name: str | None = None) -> bool:
    """Whether routing is active (in ``module_name``, or anywhere)."""
    if module_name is None:
        return _ACTIVE
    mod = sys.modules.get(module_name)
    return mod is not None and getattr(mod, "scaled_dot_product_attention", None) \
        is routed_scaled_dot_product_attention


@contextmanager
def attention_routing(model: nn.Module | None = None) -> Iterator[None]:
    """``with attention_routing(model): ...`` installs routing and removes it after."""
    was_active = _ACTIVE
    install_attention_routing(model)
    try:
        yield
    finally:
        if not was_active:
            uninstall_attention_routing()


# ---------------------------------------------------------------- introspection
@dataclass
class AttentionLayout:
    """Shape facts of one attention layer, read from the model itself."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    v_head_dim: int
    rope: Any  # the layer's RoPE module (or None)


def model_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of an mlx_lm model."""
    layers = getattr(model, "layers", None)
    if layers is None and hasattr(model, "model"):
        layers = getattr(model.model, "layers", None)
    if layers is None:
        raise ValueError(
            f"model {type(model).__module__}.{type(model).__name__} has no 'layers': "
            "KVCacheBuilder needs an mlx_lm model with transformer blocks"
        )
    return list(layers)


def attention_module(block: nn.Module) -> nn.Module | None:
    """The self-attention module of a block, or None (recurrent / MLP-only blocks)."""
    for name in ("self_attn", "attention", "attn", "mixer"):
        mod = getattr(block, name, None)
        if isinstance(mod, nn.Module) and hasattr(mod, "k_proj"):
            return mod
    return None


def _out_features(linear: nn.Module) -> int:
    # Rows are the outputs for Linear and QuantizedLinear alike (only columns are packed).
    return linear.weight.shape[0]


def attention_layout(attn: nn.Module, args: Any = None) -> AttentionLayout:
    """Heads and head dims of ``attn`` from its attributes and projection shapes."""
    n_heads = getattr(attn, "n_heads", None) or getattr(attn, "num_heads", None) or \
        getattr(args, "num_attention_heads", None)
    n_kv_heads = getattr(attn, "n_kv_heads", None) or getattr(attn, "num_key_value_heads", None) \
        or getattr(args, "num_key_value_heads", None) or n_heads
    k_out = _out_features(attn.k_proj)
    v_out = _out_features(attn.v_proj) if hasattr(attn, "v_proj") else k_out
    # The projection's width is the ground truth (some models keep an unrelated head_dim).
    head_dim = k_out // n_kv_heads
    return AttentionLayout(int(n_heads), int(n_kv_heads), int(head_dim),
                           int(v_out // n_kv_heads), getattr(attn, "rope", None))


def rope_params(rope: Any) -> dict[str, Any]:
    """dims/base/traditional/scale of an ``nn.RoPE`` (empty for other rope kinds)."""
    if isinstance(rope, nn.RoPE):
        return {"rope_dims": rope.dims, "rope_base": float(rope.base),
                "rope_traditional": bool(rope.traditional), "rope_scale": float(rope.scale)}
    return {}


# ---------------------------------------------------------------- routing check
class UnsupportedModelError(ValueError):
    """A method cannot run on this model (or layer) without giving wrong output."""


class _ProbeCache(KVCache):
    """Stands in for a compressed cache in the routing check: counts the calls."""

    attends = True

    def __init__(self) -> None:
        super().__init__()
        self.updates = 0
        self.attended = 0
        self.returned: tuple[mx.array, mx.array] | None = None
        self.foreign_keys = False  # attention was handed keys this cache did not return
        self.shape: tuple[int, int, int] | None = None  # n_kv_heads, head_dim, v_head_dim

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.updates += 1
        self.shape = (keys.shape[1], keys.shape[3], values.shape[3])
        super().update_and_fetch(keys, values)
        self.returned = (keys, values)  # as compressed caches do: only the new chunk
        return keys, values

    def attend(self, queries: mx.array, scale: float, mask: Any = None) -> mx.array:
        self.attended += 1
        k, v = self.keys[..., :self.offset, :], self.values[..., :self.offset, :]
        mask = None if queries.shape[2] == 1 else mask
        return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask)


def _probing_sdpa(queries: mx.array, keys: Any, values: Any, cache: Any, scale: float,
                  mask: Any, sinks: mx.array | None = None) -> mx.array:
    # A model that reshapes, tiles or joins the returned keys before attention expects
    # attention over *those* keys; ``attend`` would silently ignore the change.
    if isinstance(cache, _ProbeCache) and cache.returned is not None and (
            keys is not cache.returned[0] or values is not cache.returned[1]):
        cache.foreign_keys = True
    return routed_scaled_dot_product_attention(queries, keys, values, cache, scale, mask,
                                               sinks)


@contextmanager
def _probing(model: nn.Module) -> Iterator[None]:
    """Routing with ``_probing_sdpa`` in place of the routed function."""
    install_attention_routing(model)
    names = [n for n in _PATCHED if sys.modules.get(n) is not None]
    for n in names:
        sys.modules[n].scaled_dot_product_attention = _probing_sdpa
    try:
        yield
    finally:
        for n in names:
            sys.modules[n].scaled_dot_product_attention = routed_scaled_dot_product_attention


def _probe_problem(probe: _ProbeCache) -> str | None:
    if probe.updates == 0:
        return "never uses its own cache"
    if probe.attended < probe.updates:
        return "does not call mlx_lm's scaled_dot_product_attention"
    if probe.foreign_keys:
        return "transforms the cached keys/values before attention"
    return None


def probe_layers(model: nn.Module, layer_ids: list[int]) -> dict[int, _ProbeCache]:
    """Run a prompt chunk and a decode step through ``model`` with probe caches on
    ``layer_ids``: what each layer really hands its cache, and how it attends."""
    caches = make_prompt_cache(model)
    probes = {i: _ProbeCache() for i in layer_ids}
    for i, probe in probes.items():
        caches[i] = probe
    with _probing(model):
        try:
            model(mx.array([[0, 1]]), cache=caches)  # lazy: builds the graph only
            model(mx.array([[1]]), cache=caches)
        except Exception as exc:
            raise UnsupportedModelError(
                f"could not check how {_model_name(model)} uses its KV caches (a two-token "
                f"probe failed: {type(exc).__name__}: {exc})") from exc
    return probes


def check_attention_routing(model: nn.Module, layer_ids: list[int], method: str,
                            probes: dict[int, _ProbeCache] | None = None) -> None:
    """Raise ``UnsupportedModelError`` unless every layer in ``layer_ids`` attends over
    exactly what its cache returned, through the routed function."""
    if probes is None:
        probes = probe_layers(model, layer_ids)
    bad = {i: _probe_problem(probes[i]) for i in layer_ids if _probe_problem(probes[i])}
    if bad:
        i, problem = next(iter(bad.items()))
        attn = attention_module(model_layers(model)[i])
        where = f"{type(attn).__module__}.{type(attn).__name__}" if attn is not None else "?"
        raise UnsupportedModelError(
            f"method {method!r} cannot run on {_model_name(model)}: the attention of "
            f"layer(s) {sorted(bad)} ({where}) {problem}, so a compressed cache would be "
            "bypassed (silently wrong output). Supported: attention that calls mlx_lm's "
            "scaled_dot_product_attention over the cache's keys and values; the dense "
            "method 'none' runs on every model.")


def _model_name(model: nn.Module) -> str:
    model_type = getattr(getattr(model, "args", None), "model_type", None)
    return f"model type {model_type!r}" if model_type else \
        f"model {type(model).__module__}.{type(model).__name__}"
