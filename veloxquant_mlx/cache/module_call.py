"""Calling an mlx_lm attention module on its own arguments, one batch row at a time.

Hooks that take over how an attention module uses its cache (the dense reconstruction
view of ``adapter.mlx_lm``, XQuant's X hook) need the module's input, mask and
cache from calls whose signatures differ a little between families
(``x, mask=None, cache=None, ...``). ``bind_call`` names them from the signature;
``call_per_row`` runs a batch of per-sequence caches (``BatchedCache``) one row at a
time over each row's real tokens, with the mask that row would get alone, and pads the
outputs back to the batch's shape (padded positions are never used).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import mlx.core as mx

_MASK_NAMES = ("mask", "attention_mask")


class ModuleCall:
    """One call of an attention module, with its input, mask and cache named."""

    def __init__(self, base_call: Callable[..., Any], module: Any, args: tuple[Any, ...],
                 kwargs: dict[str, Any], is_cache: Callable[[Any], bool]) -> None:
        self.base_call = base_call
        bound = inspect.signature(base_call).bind(module, *args, **kwargs)
        bound.apply_defaults()
        self.arguments = dict(bound.arguments)
        names = list(self.arguments)
        self.x_name = names[1]  # the first argument after ``self``
        self.mask_name = next((n for n in _MASK_NAMES if n in self.arguments), None)
        self.cache_names = [n for n in names[1:] if is_cache(self.arguments[n])]

    @property
    def x(self) -> mx.array:
        return self.arguments[self.x_name]

    @property
    def mask(self) -> Any:
        return None if self.mask_name is None else self.arguments[self.mask_name]

    @property
    def cache(self) -> Any:
        return self.arguments[self.cache_names[0]] if self.cache_names else None

    def run(self, **changes: Any) -> Any:
        """Call the module's original ``__call__`` with some arguments replaced."""
        args = {**self.arguments, **changes}
        params = inspect.signature(self.base_call).parameters
        pos, kw = [], {}
        for name, p in params.items():
            if name not in args:
                continue
            if p.kind == p.VAR_POSITIONAL:
                pos.extend(args[name])
            elif p.kind == p.VAR_KEYWORD:
                kw.update(args[name])
            elif p.kind == p.KEYWORD_ONLY:
                kw[name] = args[name]
            else:
                pos.append(args[name])
        return self.base_call(*pos, **kw)


def bind_call(base_call: Callable[..., Any], module: Any, args: tuple[Any, ...],
              kwargs: dict[str, Any], is_cache: Callable[[Any], bool]) -> ModuleCall:
    """Name the input (first argument), mask and cache(s) of a module call."""
    return ModuleCall(base_call, module, args, kwargs, is_cache)


def _batched_arrays(call: ModuleCall, B: int) -> list[str]:
    skip = {call.x_name, call.mask_name, *call.cache_names}
    return [n for n, v in call.arguments.items()
            if n not in skip and isinstance(v, mx.array) and v.ndim and v.shape[0] == B]


def call_per_row(call: ModuleCall, batch: Any, row_cache: Callable[[Any, int, int], Any],
                 where: str) -> mx.array:
    """Run ``call`` once per row of ``batch`` (a ``BatchedCache``) over its real tokens.

    ``row_cache(cache, row, n_real)`` turns a row's cache into what the module gets
    (e.g. a dense view).
    """
    x = call.x
    B, L = x.shape[0], x.shape[1]
    if _batched_arrays(call, B) or (L > 1 and call.mask_name is None):
        raise NotImplementedError(
            f"{where} takes other per-row arguments (or no mask): a batch of compressed "
            "caches cannot be run one row at a time on it; generate one sequence at a "
            "time on this model")
    outs = []
    for i, (cache, r) in enumerate(zip(batch.caches, batch.take_rows(L))):
        out = None
        if r:
            changes = {call.x_name: x[i:i + 1, :r], call.cache_names[0]: row_cache(cache, i, r)}
            if call.mask_name is not None:  # the mask this row would get alone
                changes[call.mask_name] = None if call.mask is None or r == 1 else \
                    cache.make_mask(r, return_array=True)
            out = call.run(**changes)
            if not isinstance(out, mx.array):
                raise NotImplementedError(f"{where} returns {type(out).__name__}, not one "
                                          "array: batches of compressed caches are not "
                                          "supported on it")
        if r < L:
            shape = (1, L - r, *(out.shape[2:] if out is not None else x.shape[2:]))
            pad = mx.zeros(shape, x.dtype if out is None else out.dtype)
            out = pad if out is None else mx.concatenate([out, pad], axis=1)
        outs.append(out)
    return mx.concatenate(outs, axis=0)


# ---- hooks: the one way a build takes over a module's call ----
# A hooked module's class is swapped for a subclass with another ``__call__`` (weights
# and everything else untouched). Hooks stack: each hook class records the class below
# it and its name, so any hook can be found and removed without knowing the others.
_HOOK_CLASSES: dict[tuple[type, Callable[..., Any], str], type] = {}


def _chain(module: Any) -> list[type]:
    """The hook classes on ``module``, the top one first."""
    out, cls = [], type(module)
    while "_vq_hook" in cls.__dict__:
        out.append(cls)
        cls = cls.__dict__["_vq_base"]
    return out


def original_class(module: Any) -> type:
    """The class ``module`` had before any hook (its own class when not hooked)."""
    chain = _chain(module)
    return chain[-1].__dict__["_vq_base"] if chain else type(module)


def hook_names(module: Any) -> list[str]:
    """The names of the hooks on ``module``, the top one first."""
    return [c.__dict__["_vq_hook"] for c in _chain(module)]


def below(module: Any, name: str) -> type:
    """The class under hook ``name`` (call its ``__call__`` to run what was there); the
    module's own class when it has no such hook."""
    for cls in _chain(module):
        if cls.__dict__["_vq_hook"] == name:
            return cls.__dict__["_vq_base"]
    return type(module)


def _subclass(base: type, call: Callable[..., Any], name: str) -> type:
    cls = _HOOK_CLASSES.get((base, call, name))
    if cls is None:
        cls = type(f"{name}{base.__name__}", (base,),
                   {"__call__": call, "_vq_base": base, "_vq_hook": name, "_vq_call": call})
        _HOOK_CLASSES[base, call, name] = cls
    return cls


def hook_module(module: Any, call: Callable[..., Any], name: str) -> None:
    """Make ``call`` the ``__call__`` of ``module``, above its other hooks (an earlier
    hook of the same name is replaced). ``call`` reaches what was there through
    ``below(self, name).__call__``."""
    unhook_module(module, name)
    module.__class__ = _subclass(type(module), call, name)


def unhook_module(module: Any, name: str | None = None) -> bool:
    """Remove hook ``name`` from ``module`` (every hook when ``None``); the others stay."""
    chain = _chain(module)
    keep = [c for c in chain if name is not None and c.__dict__["_vq_hook"] != name]
    if len(keep) == len(chain):
        return False
    cls = original_class(module)
    for c in reversed(keep):
        cls = _subclass(cls, c.__dict__["_vq_call"], c.__dict__["_vq_hook"])
    module.__class__ = cls
    return True
