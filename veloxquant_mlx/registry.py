"""Method registry: every cache class decorated with ``@register`` under ``cache/``.

A method is one module in ``veloxquant_mlx/cache/`` whose cache class carries
``@register``; the registry imports the modules of that package by name the first
time a method is looked up, so adding a method touches no other file.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

_METHODS: dict[str, type] = {}
_DISCOVERED = False
_PACKAGE = "veloxquant_mlx.cache"


def register(cls: type) -> type:
    """Class decorator: make ``cls`` (a ``CompressedCache``) the method ``cls.method``."""
    name = getattr(cls, "method", "")
    if not name:
        raise ValueError(f"{cls.__qualname__} has no 'method' name to register under")
    other = _METHODS.get(name)
    if other is not None and other is not cls and other.__qualname__ != cls.__qualname__:
        raise ValueError(f"method {name!r} is registered twice ({other.__qualname__}, "
                         f"{cls.__qualname__})")
    if "Options" not in cls.__dict__:
        # Each method owns its options class; a method without options gets its own
        # empty subclass so that error messages name it.
        from veloxquant_mlx.options import MethodOptions

        cls.Options = type(f"{cls.__name__}Options", (MethodOptions,), {})
    cls.Options.method = name
    _METHODS[name] = cls
    return cls


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
    return dict(sorted(_METHODS.items(), key=lambda kv: kv[1].family != "reference"))


def get_method(name: str) -> type:
    """The cache class of method ``name``; unknown names list the known ones."""
    found = methods().get(name)
    if found is None:
        from veloxquant_mlx.options import config_error

        raise config_error("method", name, f"one of {sorted(_METHODS)}")
    return found


def list_methods() -> list[dict[str, Any]]:
    """Each method's name, family, paper, what it stores and its option names."""
    return [
        {
            "name": name,
            "family": cls.family,
            "paper": cls.paper,
            "stores": cls.stores,
            "cross_layer": "yes" if cls.cross_layer else "no",
            "options": cls.Options.field_names(),
        }
        for name, cls in methods().items()
    ]
