"""The glue to mlx_lm: attention routing, the build-time probe, and model introspection.

Routing: mlx_lm's attention layers call a module-level ``scaled_dot_product_attention``
imported by name from ``mlx_lm.models.base`` into each model module. Routing replaces
that name in the loaded model modules with a wrapper that hands the call to
``cache.attend(queries, scale, mask)`` when the cache ``attends``, and to the original
function otherwise, so models, ``generate``, ``stream_generate`` and ``batch_generate``
run unmodified. ``uninstall_attention_routing`` puts the original back.

Probe: ``probe_model`` runs a two-token prompt chunk and one decode step through the
model with a counting stand-in in every KV cache slot of ``model.make_cache()``
(graph construction; a layer's keys are evaluated only when it hands attention keys
other than the ones its cache returned). Per slot it learns the real KV shapes, the
module that updates the cache, the modules that read it, and how the layer attends:
through the routed function over exactly what its cache returned (*routable*), or
otherwise: attention computed by hand or by ``mx.fast`` directly, keys tiled, rebuilt
or cast after the cache, attention sinks, float score biases, K/V shared with other
layers. No layer name (``k_proj``, ``qkv_proj``, ``c_attn``, ...) is needed.

A layer that is not routable cannot use a cache's ``attend``. For methods that can
rebuild their keys and values (``keys_and_values``), ``check_attention_routing`` installs a
reconstruction hook on the modules that touch that layer's cache: they see a view
whose ``update_and_fetch`` and ``keys_and_values`` return a transient dense
reconstruction (the stored form stays compressed) and attend over it themselves.
Methods that only attend over their own form get ``UnsupportedModelError`` naming the
layer and the feature. This module imports the rest of the package only lazily:
caches are duck-typed.

Plan: ``plan_slots`` turns one probe and a resolved method (``registry.resolve``) into
the slots the method compresses, each with its ``LayerInfo`` and how (the method's own
cache, or a ring over it on a sliding-window layer), after the checks above.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base as mlx_base
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from veloxquant_mlx.cache.base import LayerInfo, depend_on_state
from veloxquant_mlx.cache.module_call import (
    below,
    bind_call,
    call_per_row,
    hook_module,
    hook_names,
    original_class,
    unhook_module,
)
from veloxquant_mlx.cache.sliding import sliding_mode
from veloxquant_mlx.errors import Refusal, UnsupportedModelError

if TYPE_CHECKING:
    from veloxquant_mlx.registry import Resolved

__all__ = ["AttentionLayout", "SlotProbe", "UnsupportedModelError", "attention_layout",
           "attention_module", "attention_routing", "bind_routing", "check_attention_routing",
           "install_attention_routing", "install_reconstruction", "layer_infos", "method_caps",
           "model_layers", "model_name", "plan_slots", "probe_model", "reconstruction_installed",
           "rope_params", "routed_scaled_dot_product_attention", "routing_installed",
           "uninstall_attention_routing", "uninstall_reconstruction"]

_ORIGINAL_SDPA = mlx_base.scaled_dot_product_attention
_PATCHED: dict[str, Any] = {}
# Who needs routing: a count per model (weakly referenced) and per process (``None``:
# code that builds caches by hand). The modules stay patched while any lease is held,
# so detaching one model never changes another model's attention.
_LEASES: dict[int, list[Any]] = {}  # id -> [weakref to the model or None, count]
_PROCESS = 0


def routed_scaled_dot_product_attention(
    queries: mx.array,
    keys: Any,
    values: Any,
    cache: Any,
    scale: float,
    mask: Any,
    sinks: mx.array | None = None,
) -> mx.array:
    """Drop-in for mlx_lm's ``scaled_dot_product_attention`` that honours ``attend``.

    The output depends on what the cache holds after the step (``mx.depends``), so
    evaluating the logits also materializes the new codes and frees the chunk's
    full-precision keys and values, whether or not the caller evaluates the state.
    """
    if getattr(cache, "attends", False):
        if sinks is not None:
            raise NotImplementedError(
                f"{type(cache).__name__} does not support attention sinks (gpt-oss style)"
            )
        return depend_on_state(cache.attend(queries, scale=scale, mask=mask), cache)
    return _ORIGINAL_SDPA(queries, keys, values, cache=cache, scale=scale, mask=mask,
                          sinks=sinks)


def _model_modules(model: nn.Module | None) -> list[str]:
    """Loaded mlx_lm model modules (and the model's own classes' modules) that call
    mlx_lm's attention function by name."""
    names = {
        name for name, mod in list(sys.modules.items())
        # Not base itself: modules imported later would copy the wrapper from it, and
        # uninstalling could not find them.
        if name.startswith("mlx_lm.models.") and name != "mlx_lm.models.base"
        and mod is not None
    }
    if model is not None:
        names |= {type(m).__module__ for m in (model, *(x for _, x in model.named_modules()))}
    return sorted(n for n in names if getattr(sys.modules.get(n), "scaled_dot_product_attention",
                                              None) is _ORIGINAL_SDPA)


def _patch(model: nn.Module | None) -> list[str]:
    names = _model_modules(model)
    for name in names:
        mod = sys.modules[name]
        _PATCHED[name] = mod.scaled_dot_product_attention
        mod.scaled_dot_product_attention = routed_scaled_dot_product_attention
    return names


def _unpatch_if_unused() -> None:
    """Put mlx_lm's function back once no model and no process lease needs routing."""
    if _PROCESS or any(_lease_alive(key) for key in list(_LEASES)):
        return
    for name, original in list(_PATCHED.items()):
        mod = sys.modules.get(name)
        if mod is not None:
            mod.scaled_dot_product_attention = original
        del _PATCHED[name]


def _lease_alive(key: int) -> bool:
    entry = _LEASES.get(key)
    if entry is None:
        return False
    if entry[0]() is None:  # the model is gone
        del _LEASES[key]
        return False
    return entry[1] > 0


def _model_gone(key: int) -> None:
    _LEASES.pop(key, None)
    _unpatch_if_unused()


def install_attention_routing(model: nn.Module | None = None) -> list[str]:
    """Route attention through ``cache.attend`` in every loaded mlx_lm model module.

    Takes a lease for ``model`` (held until ``uninstall_attention_routing(model)``,
    ``KVCacheBuilder.detach(model)`` or the model's garbage collection) or, without a
    model, for the process. Returns the names of the modules patched by this call.
    Caches without ``attend`` see no change at all.
    """
    global _PROCESS
    if model is None:
        _PROCESS += 1
    else:
        key = id(model)
        if not _lease_alive(key):
            _LEASES[key] = [weakref.ref(model, lambda _r, k=key: _model_gone(k)), 0]
        _LEASES[key][1] += 1
    return _patch(model)


def uninstall_attention_routing(model: nn.Module | None = None, everything: bool = False
                                ) -> None:
    """Release ``model``'s routing leases (without a model: the process's).

    mlx_lm's original function comes back once no lease is left; other models'
    routing is untouched. ``everything`` drops every lease (tests).
    """
    global _PROCESS
    if everything:
        _LEASES.clear()
        _PROCESS = 0
    elif model is None:
        _PROCESS = 0
    else:
        _LEASES.pop(id(model), None)
    _unpatch_if_unused()


def routing_check(model: nn.Module) -> Callable[[], bool]:
    """A check that ``model``'s routing lease is still held (caches call it per step:
    a cache of a detached model must fail loudly, not attend over its chunk alone)."""
    key = id(model)
    return lambda: _lease_alive(key)


def bind_routing(model: nn.Module, layers: list[Any]) -> None:
    """Take ``model``'s routing lease and give each compressed layer its check."""
    install_attention_routing(model)
    check = routing_check(model)
    for info in layers:
        info.routing = check


def routing_installed(module_name: str | None = None) -> bool:
    """Whether routing is active (in ``module_name``, or anywhere)."""
    if module_name is None:
        return bool(_PATCHED)
    mod = sys.modules.get(module_name)
    return mod is not None and getattr(mod, "scaled_dot_product_attention", None) \
        is routed_scaled_dot_product_attention


@contextmanager
def attention_routing(model: nn.Module | None = None) -> Iterator[None]:
    """``with attention_routing(model): ...`` holds a lease for the block only."""
    global _PROCESS
    install_attention_routing(model)
    try:
        yield
    finally:
        if model is None:
            _PROCESS = max(0, _PROCESS - 1)
        elif _lease_alive(id(model)):
            _LEASES[id(model)][1] -= 1
        _unpatch_if_unused()


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
    """The self-attention module of a block with a ``k_proj``, or None.

    Only the name-based view; ``probe_model`` finds every layer's attention module
    (fused projections included) from the call that updates its cache.
    """
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


def model_name(model: nn.Module) -> str:
    """``model type 'llama'`` (or the class path when the model has no ``args``)."""
    args = getattr(model, "args", None)
    model_type = getattr(args, "model_type", None)
    if model_type is None:  # multimodal wrappers keep the type on their text config
        model_type = getattr(getattr(args, "text_config", None), "model_type", None)
    return f"model type {model_type!r}" if model_type else \
        f"model {type(model).__module__}.{type(model).__name__}"


# ---------------------------------------------------------------- the probe
# How a layer can fail to be routable, as the probe names it in errors.
PROBLEMS: dict[str, str] = {
    "bypass": "does not call mlx_lm's scaled_dot_product_attention (it computes "
              "attention itself or calls mx.fast directly)",
    "keys": "transforms the cached keys/values before attention (tiles, rebuilds or "
            "casts them)",
    "sinks": "passes attention sinks",
    "float_mask": "passes a float score bias as mask",
    "shared": "shares its cache with other layers (they attend over the keys it "
              "returned)",
    "read": "is read by other layers or the model (keys_and_values)",
}


def _received(frame: Any, target: Any) -> bool:
    """Whether the function running in ``frame`` was handed ``target`` as an argument
    (directly, or in ``*args`` / ``**kwargs``; a list of caches does not count)."""
    code = frame.f_code
    n = code.co_argcount + code.co_kwonlyargcount
    names = code.co_varnames
    if any(frame.f_locals.get(v) is target for v in names[:n]):
        return True
    if code.co_flags & 0x04 and any(a is target for a in frame.f_locals.get(names[n], ())):
        return True
    n += bool(code.co_flags & 0x04)
    kwargs = frame.f_locals.get(names[n], {}) if code.co_flags & 0x08 else {}
    return any(v is target for v in kwargs.values())


def _caller(target: Any) -> tuple[nn.Module | None, bool]:
    """The nearest ``nn.Module`` method on the stack above the calling cache method, and
    whether it was handed ``target`` as an argument (a hook can then swap it)."""
    frame = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return None, False
        obj = frame.f_locals.get("self")
        if isinstance(obj, nn.Module):
            return obj, _received(frame, target)
        frame = frame.f_back
    return None, False


class _ProbeCache(KVCache):
    """Stands in for a compressed cache in the probe: records how the slot is used."""

    attends = True

    def __init__(self, slot: int) -> None:
        super().__init__()
        self.slot = slot
        self.updates = 0
        self.attended = 0
        self.shape: tuple[int, int, int] | None = None  # n_kv_heads, head_dim, v_head_dim
        self.returned: tuple[mx.array, mx.array] | None = None
        self.problems: set[str] = set()
        self.owner: nn.Module | None = None  # the module that updates the cache
        self.readers: list[nn.Module] = []  # other modules that touch it
        self.unhookable: list[nn.Module] = []  # touch it without being handed it
        self.mask_windows: set[int] = set()  # window sizes the model asked masks for
        self._updating = False

    def touch(self, found: tuple[nn.Module | None, bool], reads_only: bool = False) -> None:
        module, received = found
        if module is None:
            return
        if not received and not reads_only:
            self.unhookable.append(module)
        if module is not self.owner and all(m is not module for m in self.readers):
            self.readers.append(module)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.updates += 1
        self.shape = (keys.shape[1], keys.shape[3], values.shape[3])
        found = _caller(self)
        if self.owner is None:
            self.owner = found[0]
        elif found[0] is not self.owner:
            self.problems.add("shared")
        self.touch(found)
        self._updating = True
        # Everything held, as mlx_lm's cache returns it: a layer that attends by itself
        # then runs (shapes fit) and is recognized by the keys it hands attention.
        self.returned = super().update_and_fetch(keys, values)
        self._updating = False
        return self.returned

    def make_mask(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("window_size") is not None:
            self.mask_windows.add(int(kwargs["window_size"]))
        return super().make_mask(*args, **kwargs)

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        if not self._updating:  # KVCache's own update reads it too
            self.problems.add("read")
            # Compressed caches answer this themselves (a dense reconstruction).
            self.touch(_caller(self), reads_only=True)
        return super().keys_and_values()


def _same(a: Any, b: mx.array) -> bool:
    """Whether attention got ``b`` itself (or a same-valued copy, e.g. a dtype cast)."""
    if a is b:
        return True
    if not isinstance(a, mx.array) or a.shape != b.shape:
        return False
    return bool(mx.array_equal(a.astype(b.dtype), b).item())


_PROBES: list[_ProbeCache] = []


def _probing_sdpa(queries: mx.array, keys: Any, values: Any, cache: Any, scale: float,
                  mask: Any, sinks: mx.array | None = None) -> mx.array:
    if isinstance(cache, _ProbeCache):
        cache.attended += 1
        cache.touch(_caller(cache))
        if cache.returned is None or not _same(keys, cache.returned[0]) or \
                not _same(values, cache.returned[1]):
            cache.problems.add("keys")
        if sinks is not None:
            cache.problems.add("sinks")
        if isinstance(mask, mx.array) and mask.dtype != mx.bool_:
            cache.problems.add("float_mask")
    for p in _PROBES:
        # Another layer (or a call with cache=None) attending over this slot's keys.
        if p is not cache and p.returned is not None and \
                (keys is p.returned[0] or values is p.returned[1]):
            p.problems.add("shared")
    return _ORIGINAL_SDPA(queries, keys, values, cache=None, scale=scale, mask=mask,
                          sinks=sinks)


@dataclass
class SlotProbe:
    """What the probe learned about one cache slot of ``model.make_cache()``."""

    slot: int
    cache: Any  # the model's own cache of this slot
    updates: int = 0
    attended: int = 0
    shape: tuple[int, int, int] | None = None
    problems: frozenset[str] = frozenset()
    owner: nn.Module | None = field(default=None, repr=False)
    readers: list[nn.Module] = field(default_factory=list, repr=False)
    # Modules that update or attend over this slot's cache without being handed it as
    # an argument (they pick it from the model's cache list): no hook can reach them.
    unhookable: list[nn.Module] = field(default_factory=list, repr=False)
    # Windows the model's sliding masks use (read off make_mask calls on any slot).
    mask_windows: frozenset[int] = frozenset()

    @property
    def window(self) -> int | None:
        """The attention window of a sliding-window slot (``RotatingKVCache``)."""
        return self.cache.max_size if type(self.cache) is RotatingKVCache else None

    @property
    def window_agrees(self) -> bool:
        """Whether the model's sliding masks use the window this slot's ring keeps
        (plamo3's mask lets a query see one token more than its RotatingKVCache holds,
        so mlx_lm's cached output depends on its ring's quirks)."""
        return self.window is None or self.mask_windows <= {self.window}

    @property
    def used(self) -> bool:
        return self.updates > 0 and self.shape is not None

    @property
    def routable(self) -> bool:
        """Attention reaches ``attend`` with this slot's cache, over what it returned."""
        return self.used and not self.problems

    def describe(self) -> str:
        return "; ".join(PROBLEMS[p] for p in sorted(self.problems))

    def modules(self) -> list[nn.Module]:
        """Every module that touches this slot's cache (its owner first)."""
        return ([self.owner] if self.owner is not None else []) + list(self.readers)


def _probe_slots(caches: list[Any]) -> dict[int, _ProbeCache]:
    # Plain and sliding-window KV slots; recurrent, chunked, list and model-specific
    # caches keep the model's own cache and are not probed.
    return {i: _ProbeCache(i) for i, c in enumerate(caches)
            if type(c) in (KVCache, RotatingKVCache)}


@contextmanager
def _probing(model: nn.Module, probes: list[_ProbeCache]) -> Iterator[None]:
    """Routing with ``_probing_sdpa`` in place of the routed function (no lease: the
    build takes one after the probe)."""
    _patch(model)
    names = [n for n in _PATCHED if sys.modules.get(n) is not None]
    for n in names:
        sys.modules[n].scaled_dot_product_attention = _probing_sdpa
    _PROBES[:] = probes
    try:
        yield
    finally:
        _PROBES.clear()
        for n in names:
            sys.modules[n].scaled_dot_product_attention = routed_scaled_dot_product_attention
        _unpatch_if_unused()


def probe_model(model: nn.Module) -> list[SlotProbe | None]:
    """Run a prompt chunk and a decode step with a probe in every KV slot of
    ``model.make_cache()``: one ``SlotProbe`` per slot (``None`` for other caches)."""
    caches = make_prompt_cache(model)
    own = list(caches)
    probes = _probe_slots(caches)
    for i, p in probes.items():
        caches[i] = p
    with _probing(model, list(probes.values())):
        try:
            model(mx.array([[0, 1]]), cache=caches)  # lazy: builds the graph only
            model(mx.array([[1]]), cache=caches)
        except Exception as exc:
            raise UnsupportedModelError(
                f"found no plain full-attention layers in {model_name(model)}: a two-token "
                f"probe through its KV caches failed ({type(exc).__name__}: {exc})",
                Refusal.PROBE_FAILED) from exc
    out: list[SlotProbe | None] = [None] * len(caches)
    windows = frozenset(w for p in probes.values() for w in p.mask_windows)
    for i, p in probes.items():
        problems = set(p.problems)
        if p.updates and p.attended < p.updates:
            problems.add("bypass")
        out[i] = SlotProbe(i, own[i], p.updates, p.attended, p.shape, frozenset(problems),
                           p.owner, p.readers, p.unhookable, windows)
    return out


# ---------------------------------------------------------------- reconstruction
class _DenseView:
    """A compressed cache as a layer that attends by itself sees it.

    ``update_and_fetch`` stores the chunk in the compressed form and returns a
    transient dense reconstruction of everything held; ``keys_and_values`` returns the
    same without storing; ``attends`` is False, so attention runs over those arrays.
    Everything else is the cache's own.
    """

    attends = False

    def __init__(self, cache: Any) -> None:
        object.__setattr__(self, "_cache", cache)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._cache, name, value)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        out = self._cache.update_and_fetch(keys, values)
        if getattr(self._cache, "attends", False):
            out = self._cache.keys_and_values(keys.dtype)
        # Caches that return dense keys already, too: the layer's output must depend on
        # the stored form, or the chunk's full-precision copy stays alive with it.
        return tuple(depend_on_state(list(out), self._cache))

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        return self._cache.keys_and_values()


def _is_compressed(obj: Any) -> bool:
    """A veloxquant cache, or a batch of them (``BatchedCache``)."""
    rows = getattr(obj, "caches", None)
    if isinstance(rows, list) and hasattr(obj, "take_rows"):
        return bool(rows) and _is_compressed(rows[0])
    return hasattr(obj, "held_arrays") and hasattr(obj, "keys_and_values") and \
        not isinstance(obj, _DenseView)


_RECON = "Reconstructing"


def _reconstructing_call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    call = bind_call(below(self, _RECON).__call__, self, args, kwargs, _is_compressed)
    base = original_class(self)
    cache = call.cache
    if cache is None:
        lists = [v for v in call.arguments.values() if isinstance(v, (list, tuple))]
        if any(hasattr(c, "take_rows") for v in lists for c in v):
            raise NotImplementedError(
                f"{base.__module__}.{base.__name__} reads layers' caches itself (K/V shared "
                "between layers): a batch of compressed caches cannot serve it; generate "
                "one sequence at a time on this model")
        return call.run()
    if hasattr(cache, "take_rows"):  # a batch of per-sequence caches
        return call_per_row(call, cache, lambda c, i, n: _DenseView(c),
                            f"{base.__module__}.{base.__name__}")
    return call.run(**{n: _DenseView(call.arguments[n]) for n in call.cache_names})


def install_reconstruction(modules: list[nn.Module]) -> None:
    """Hand ``modules`` dense views of the compressed caches they are called with
    (``module_call.hook_module``: reversible, weights untouched). Idempotent."""
    for mod in modules:
        if _RECON not in hook_names(mod):
            hook_module(mod, _reconstructing_call, _RECON)


def reconstruction_installed(model: nn.Module) -> bool:
    """Whether some module of ``model`` has the reconstruction hook."""
    return any(_RECON in hook_names(m) for m in model.modules())


def uninstall_reconstruction(model: nn.Module) -> None:
    """Remove the reconstruction hook from every module of ``model`` (others stay)."""
    for mod in model.modules():
        unhook_module(mod, _RECON)


# ---------------------------------------------------------------- the routing check
_WARNED: set[tuple[str, str]] = set()


# Probe problems where the layer's attention is code of its own (not mlx_lm's function
# with the cache's mask): nothing says where it takes positions from.
HAND_ATTENTION = frozenset({"bypass", "read"})


class MethodCaps(NamedTuple):
    """What routing needs to know of a cache class."""

    attends: bool  # it attends itself (``attend``)
    rebuilds: bool  # it can hand a dense view of its keys and values (``keys_and_values``)
    hooks: bool  # it takes over the owning module's call (``hooks_module``)
    evicts: bool  # it holds fewer tokens than it has seen (``evicts``)


def method_caps(cls: type) -> MethodCaps:
    """The routing capabilities a cache class declares."""
    from veloxquant_mlx.cache.base import CompressedCache

    return MethodCaps(bool(cls.attends), cls.keys_and_values is not CompressedCache.keys_and_values,
                      bool(cls.profile.hooks_module), bool(cls.profile.evicts))


def _method_caps(method: str) -> MethodCaps:
    from veloxquant_mlx.registry import get_method

    return method_caps(get_method(method))


def _where(probes: list[SlotProbe]) -> str:
    mods = {f"{original_class(m).__module__}.{original_class(m).__name__}"
            for p in probes for m in p.modules()[:1]}
    return ", ".join(sorted(mods)) or "?"


def _refusal(model: nn.Module, method: str, bad: list[SlotProbe], why: str,
             reason: Refusal) -> UnsupportedModelError:
    problems = "; ".join(sorted({p.describe() for p in bad}))
    return UnsupportedModelError(
        f"method {method!r} cannot run on {model_name(model)}: the attention of layer(s) "
        f"{[p.slot for p in bad]} ({_where(bad)}) {problems}; {why} (silently wrong "
        "output otherwise).", reason)


def _check_own_hook(model: nn.Module, method: str, probes: list[SlotProbe],
                    reconstructs: bool) -> None:
    """A method that takes over the owning module's call (XQuant's X hook) serves the
    model's attention there, whatever it is. Other code that reads the cache gets a
    rebuilt copy where the method can make one (a batch of them is refused)."""
    stuck = [p for p in probes if p.unhookable]
    if stuck:
        raise _refusal(model, method, stuck, "the code that runs it takes the cache from "
                       "the model's cache list rather than as an argument, so no hook can "
                       "reach it", Refusal.UNHOOKABLE)
    read = [p for p in probes if "read" in p.problems]
    if read and not reconstructs:
        raise _refusal(model, method, read, f"{method!r} holds the layer input, not K/V, "
                       "and cannot rebuild the keys and values for other layers to read",
                       Refusal.NO_RECONSTRUCTION)
    readers = [m for p in read for m in p.readers if m is not model]
    install_reconstruction(readers)  # they read through a view; batches refused clearly


def check_attention_routing(model: nn.Module, layer_ids: list[int], method: str,
                            probes: list[SlotProbe | None] | None = None,
                            caps: MethodCaps | None = None, stacklevel: int = 3) -> list[int]:
    """Make every slot in ``layer_ids`` attend correctly, or raise.

    Routable slots need nothing. Others get the reconstruction hook when the method
    can rebuild its keys and values (returns those slots, after a one-time warning; a
    cache that does not attend itself returns dense keys already, and the hook serves
    batches one row at a time); otherwise ``UnsupportedModelError`` names the layers
    and what their attention does. A method with its own hook (XQuant) is checked for
    what that hook cannot serve. ``caps``: ``method_caps`` of the method's class, read
    from the registry when None; ``stacklevel``: the warning's, as ``warnings.warn``'s
    counted from here (the default names the caller's caller: the builder's user).
    """
    if probes is None:
        probes = probe_model(model)
    unused = [i for i in layer_ids if probes[i] is None or not probes[i].used]
    if unused:
        raise UnsupportedModelError(
            f"{model_name(model)}: cache slot(s) {unused} are not used as KV caches by "
            f"the model's attention, so method {method!r} cannot compress them",
            Refusal.UNUSED_SLOT)
    bad = [probes[i] for i in layer_ids if not probes[i].routable]
    caps = _method_caps(method) if caps is None else caps
    attends, reconstructs, own_hook = caps.attends, caps.rebuilds, caps.hooks
    if own_hook:  # the method serves the owning modules' calls itself (XQuant)
        _check_own_hook(model, method, [probes[i] for i in layer_ids], reconstructs)
        return []
    if not bad:
        return []
    stuck = [p for p in bad if p.unhookable]
    if stuck:
        raise _refusal(model, method, stuck, "the code that runs it takes the cache from "
                       "the model's cache list rather than as an argument, so no dense "
                       "reconstruction can be handed to it", Refusal.UNHOOKABLE)
    if not reconstructs:
        raise _refusal(model, method, bad, f"{method!r} attends over its own compressed "
                       "form only and has no dense reconstruction to hand such a layer. "
                       "Methods that rebuild their keys and values (affine, kivi, ...) "
                       "run on this model", Refusal.NO_RECONSTRUCTION)
    by_hand = [p for p in bad if p.problems & HAND_ATTENTION]
    if caps.evicts and by_hand:
        raise _refusal(model, method, by_hand, f"{method!r} evicts tokens, and attention "
                       "computed by hand over a dense view may take positions or its mask "
                       "from the number of keys it is handed (afm7 and phi3small do), "
                       "which eviction changes", Refusal.EVICTED_POSITIONS)
    # The model itself may read a cache (e.g. afm7): it gets the caches' own
    # ``keys_and_values``, a dense reconstruction already.
    install_reconstruction([m for p in bad for m in p.modules() if m is not model])
    key = (model_name(model), method)
    if attends and key not in _WARNED:  # caches that do not attend return dense K/V
        _WARNED.add(key)
        warnings.warn(
            f"{model_name(model)}: the attention of layer(s) {[p.slot for p in bad]} "
            f"{'; '.join(sorted({p.describe() for p in bad}))}; method {method!r} hands "
            "those layers a transient dense reconstruction of its compressed cache at "
            "every step (the stored form stays compressed). See docs/models.md.",
            stacklevel=stacklevel)
    return [p.slot for p in bad]


# ---------------------------------------------------------------- the plan
def _blocks_by_member(blocks: list[nn.Module]) -> dict[int, nn.Module]:
    """``id`` of every module inside a transformer block -> the block (the first that
    holds it): one walk of the blocks, not one per slot."""
    out: dict[int, nn.Module] = {}
    for block in blocks:
        for m in (block, *block.modules()):
            out.setdefault(id(m), block)
    return out


def layer_infos(model: nn.Module, probes: list[SlotProbe | None]) -> list[LayerInfo | None]:
    """Shape facts per cache slot of ``model.make_cache()`` from its probe; ``None`` for
    slots that are not KV caches the model's attention uses.

    ``layer_idx`` is the slot index (the layer index wherever the model gives every
    layer one cache); heads and head dims are what the layer really hands its cache.
    """
    try:
        blocks = model_layers(model)
    except ValueError:
        blocks = []
    owner_block = _blocks_by_member(blocks)
    model_type = str(getattr(getattr(model, "args", None), "model_type", "") or "")
    infos: list[LayerInfo | None] = []
    for p in probes:
        if p is None or not p.used:
            infos.append(None)
            continue
        n_kv_heads, head_dim, v_head_dim = p.shape
        infos.append(LayerInfo(
            layer_idx=p.slot, n_layers=len(probes), n_kv_heads=n_kv_heads,
            head_dim=head_dim, v_head_dim=v_head_dim, attention=p.owner,
            block=owner_block.get(id(p.owner)), model_type=model_type,
            sliding_window=p.window, **rope_params(getattr(p.owner, "rope", None)),
        ))
    return infos


def _modes(method_cls: type, probes: list[SlotProbe | None],
           infos: list[LayerInfo | None]) -> dict[int, str]:
    """Slot -> how the method compresses it: ``"full"``, ``"native"`` or ``"ring"``."""
    out: dict[int, str] = {}
    for i, (probe, info) in enumerate(zip(probes, infos)):
        if probe is None or info is None:
            continue
        if probe.window is None:
            if method_cls.profile.supports_layer(probe.cache):
                out[i] = "full"
        elif probe.window_agrees:  # else mlx_lm's own ring: its quirks are the output
            mode = sliding_mode(method_cls, probe.cache)
            if mode is not None:
                out[i] = mode
    return out


def _nothing_to_compress(model: nn.Module, method: str,
                         probes: list[SlotProbe | None]) -> UnsupportedModelError:
    kinds = Counter(type(c).__name__ for c in make_prompt_cache(model))
    have = (f"its cache slots are {', '.join(f'{n} x {k}' for k, n in sorted(kinds.items()))}"
            if kinds else "it has no cache slots")
    unused = [p.slot for p in probes if p is not None and not p.used]
    extra = f"; KV slot(s) {unused} are never used by the model's attention" if unused else ""
    return UnsupportedModelError(
        f"{model_name(model)} has no plain full-attention layers that method {method!r} "
        f"can compress: {have}{extra}. Compressed: plain KV caches (mlx_lm's "
        "KVCache) and, for some methods, sliding-window ones (RotatingKVCache); "
        "recurrent, chunked, list and model-specific caches keep the model's own.",
        Refusal.NO_KV_LAYERS)


def plan_slots(model: nn.Module, method: Resolved, probes: list[SlotProbe | None]
               ) -> dict[int, tuple[LayerInfo, str]]:
    """The slots ``method`` compresses on ``model``: slot -> its layer and mode (see
    ``_modes``), in model order, once the config's overrides and every slot's attention
    routing are checked (reconstruction hooks installed where a layer needs one)."""
    infos = layer_infos(model, probes)
    modes = _modes(method.cls, probes, infos)
    if not modes:
        raise _nothing_to_compress(model, method.name, probes)
    method.check_overrides(modes)
    slots = sorted(modes)
    # The warning names the code that called ``for_model``, two frames above this one.
    check_attention_routing(model, slots, method.name, probes, method_caps(method.cls),
                            stacklevel=4)
    return {i: (infos[i], modes[i]) for i in slots}
