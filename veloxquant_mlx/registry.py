"""Method registry: every cache class decorated with ``@register`` under ``cache/``.

A method is one module in ``veloxquant_mlx/cache/`` whose cache class carries
``@register`` (``veloxquant_mlx.register``); the registry imports the modules of that
package by name the first time a method is looked up, so adding a method touches no
other file.

``resolve(config)`` is the builder's one look-up: the class it builds (the method's own,
rotated where the config asks, ``cache.rotated``), and ``Resolved.build`` puts one cache
of it, or a sliding-window ring around one (``cache.sliding``), in each planned slot.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from veloxquant_mlx.cache.rotated import rotated_class, wants_rotation
from veloxquant_mlx.cache.sliding import SlidingCache
from veloxquant_mlx.options import ConfigError
from veloxquant_mlx.register import REGISTERED

if TYPE_CHECKING:
    from veloxquant_mlx.cache.base import LayerInfo
    from veloxquant_mlx.config import KVCacheConfig

_DISCOVERED = False
_PACKAGE = "veloxquant_mlx.cache"


def _discover() -> None:
    global _DISCOVERED
    if _DISCOVERED:
        return
    package = importlib.import_module(_PACKAGE)
    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{_PACKAGE}.{info.name}")
    _DISCOVERED = True


def methods() -> dict[str, type]:
    """Every registered method name and its cache class (the reference ``none`` first)."""
    _discover()
    return dict(sorted(REGISTERED.items(), key=lambda kv: kv[1].profile.family != "reference"))


def get_method(name: str) -> type:
    """The cache class of method ``name``; unknown names list the known ones."""
    found = methods().get(name)
    if found is None:
        from veloxquant_mlx.options import config_error

        raise config_error("method", name, f"one of {sorted(REGISTERED)}")
    return found


def reference() -> str:
    """The reference method's name: the dense cache (family ``reference``) that every
    other method is measured against and that a config without a method uses."""
    return next(name for name, cls in methods().items() if cls.profile.family == "reference")


def recommended() -> str:
    """The near-lossless method the demo and the README recommend (the one method class
    that declares ``recommended``)."""
    return next(name for name, cls in methods().items() if cls.profile.recommended)


def list_methods() -> list[dict[str, Any]]:
    """Each method's name, family, paper, what it stores and its option names."""
    return [
        {
            "name": name,
            "family": cls.profile.family,
            "paper": cls.profile.paper,
            "stores": cls.profile.stores,
            "cross_layer": "yes" if cls.profile.cross_layer else "no",
            "options": cls.Options.field_names(),
        }
        for name, cls in methods().items()
    ]


# A slot's mode: the method's own cache (``"full"``, ``"native"`` on a sliding-window
# layer) or a ring around one (``"ring"``); per-layer options need the former.
OWN_CACHE_MODES = ("full", "native")


@dataclass(frozen=True)
class Resolved:
    """A config's method, looked up once: the class the builder makes and the config
    (options and per-layer overrides) every cache of it is made with."""

    config: KVCacheConfig
    cls: type

    @property
    def name(self) -> str:
        return self.config.method

    def check_overrides(self, modes: dict[int, str]) -> None:
        """Per-layer overrides must name slots the method compresses as plain layers (a
        sliding-window ring slices its inner cache by the method's shared options)."""
        own = sorted(i for i, m in modes.items() if m in OWN_CACHE_MODES)
        bad = sorted(set(self.config.layer_overrides()) - set(own))
        if bad:
            raise ConfigError(
                f"KVCacheConfig.layers overrides layer(s) {bad}, which method "
                f"{self.name!r} does not compress as full layers on this model; the "
                f"layers it does: {own}")

    def build(self, caches: list[Any], slots: dict[int, tuple[LayerInfo, str]],
              model: Any) -> list[Any]:
        """``caches`` (the model's own, one per slot) with ``slots`` (slot -> its layer
        and mode) replaced by caches of the method, in model order."""
        order = sorted(slots)
        layers = [slots[i][0] for i in order]
        # Cross-layer methods assign groups and inject their shared coordinator.
        self.cls.profile.assign_roles(layers, self.config, model)
        for i, info in zip(order, layers):
            caches[i] = SlidingCache(self.cls, self.config, info) if slots[i][1] == "ring" \
                else self.cls(self.config, info)
        self.cls.profile.after_build([caches[i] for i in order], self.config, model)
        return caches


def resolve(config: KVCacheConfig) -> Resolved:
    """The class ``config``'s caches are made of: its method's, rotated when the config
    asks (``rotate=True``, or options whose codes assume rotated vectors)."""
    cls = get_method(config.method)
    return Resolved(config, rotated_class(cls) if wants_rotation(config, cls) else cls)
