"""``@register``: the decorator a method's cache class carries, and the table it fills.

Kept apart from ``registry`` (which imports every ``cache/`` module by name to fill this
table, then looks methods up in it) so that a cache module importing ``register`` does
not import the module that imports it back.
"""

from __future__ import annotations

# Method name -> cache class, filled as the cache modules are imported.
REGISTERED: dict[str, type] = {}


def register(cls: type) -> type:
    """Class decorator: make ``cls`` (a ``CompressedCache``) the method ``cls.method``."""
    name = getattr(cls, "method", "")
    if not name:
        raise ValueError(f"{cls.__qualname__} has no 'method' name to register under")
    other = REGISTERED.get(name)
    if other is not None and other is not cls and other.__qualname__ != cls.__qualname__:
        raise ValueError(f"method {name!r} is registered twice ({other.__qualname__}, "
                         f"{cls.__qualname__})")
    if "Options" not in cls.__dict__:
        # Each method owns its options class; a method without options gets its own
        # empty subclass so that error messages name it.
        from veloxquant_mlx.options import MethodOptions

        cls.Options = type(f"{cls.__name__}Options", (MethodOptions,), {})
    cls.Options.method = name
    REGISTERED[name] = cls
    return cls
