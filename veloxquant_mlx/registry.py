"""Method registry: every cache class decorated with ``@register`` under ``cache/``.

A method is one module in ``veloxquant_mlx/cache/`` whose cache class carries
``@register`` (``veloxquant_mlx.register``); the registry imports the modules of that
package by name the first time a method is looked up, so adding a method touches no
other file.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from veloxquant_mlx.register import REGISTERED

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
    return dict(sorted(REGISTERED.items(), key=lambda kv: kv[1].family != "reference"))


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
    return next(name for name, cls in methods().items() if cls.family == "reference")


def recommended() -> str:
    """The near-lossless method the demo and the README recommend (the one method class
    that declares ``recommended``)."""
    return next(name for name, cls in methods().items() if cls.recommended)


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
