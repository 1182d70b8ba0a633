"""``KVCacheConfig``: the method, its options object, and the few truly shared settings.

``KVCacheConfig(method="affine", bits=4)`` builds the method's own options dataclass
(``AffineOptions(bits=4)``) from the keyword values; ``config.options`` holds it. The
string form ``"affine:bits=4,window=32"`` (CLI, sweeps), ``to_dict``/``from_dict`` (saved
caches, JSON) and ``to_file``/``from_file`` round-trip. Configs written by 0.1 (one flat
dict with every method's prefixed fields) still load through ``from_dict`` and 0.1's
option names are still accepted, both through ``compat`` (the one module that knows
0.1); so do configs written before ``rotate`` and ``layers`` existed.

Two shared switches change how a method's caches are built (``builder``):

- ``rotate=True``: keys, values and queries are rotated per head by one seeded random
  orthogonal matrix before the method stores them (``cache.rotated``), for methods whose
  class says ``rotatable``. A method with its own ``rotate`` option (turboquant) gets the
  keyword as that option.
- ``layers``: per-layer option overrides, ``{layer: {option: value}}``, or the compact
  string ``"0-3:bits=4+window=64/10:bits=3"`` (``/`` between groups, ``+`` between
  options; no commas, so it fits in ``method:key=value,...`` specs and CLI flags).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from veloxquant_mlx import compat
from veloxquant_mlx.ops.files import write_text
from veloxquant_mlx.options import ConfigError, MethodOptions, config_error

__all__ = ["ConfigError", "KVCacheConfig", "config_error", "parse_value"]

SHARED_DEFAULTS: dict[str, Any] = {"max_ctx": 131072, "window_dtype": "float16",
                                   "rotate": False, "layers": None}
SHARED = tuple(SHARED_DEFAULTS)
WINDOW_DTYPES = (None, "float16", "bfloat16", "float32")
# Layer indices ``layers`` may name when the model is not known yet: far above any model's
# depth, yet a range up to it stays a few milliseconds (``check_layers`` bounds a model's).
MAX_LAYERS = 4096


def _method_class(method: Any) -> type:
    from veloxquant_mlx.registry import get_method

    if not isinstance(method, str):
        raise config_error("method", method, "a method name string")
    return get_method(method)


@dataclass(frozen=True, init=False)
class KVCacheConfig:
    """How each layer's KV cache is compressed.

    method: registered method name (``veloxquant methods`` lists them); default: the
        reference, dense (``registry.reference()``).
    options: the method's options dataclass; keyword values given to the constructor
        (``bits=4``) fill it, unknown names are an error naming the method's options.
    max_ctx: token budget per layer (and per cross-layer group); writing beyond raises.
    window_dtype: dtype of full-precision windows, ``"float16"``, ``"bfloat16"``,
        ``"float32"`` or ``None`` (the model's compute dtype).
    rotate: rotate keys/values/queries per head before the method stores them (methods
        whose cache class is ``rotatable``; see ``cache.rotated``).
    layers: per-layer option overrides (see the module doc), held as sorted
        ``((layer, ((option, value), ...)), ...)``; ``layer_options(i)`` applies them.
    """

    method: str
    options: MethodOptions
    max_ctx: int
    window_dtype: str | None
    rotate: bool
    layers: tuple[tuple[int, tuple[tuple[str, Any], ...]], ...] | None

    def __init__(self, method: str | None = None, options: MethodOptions | None = None, *,
                 max_ctx: int = SHARED_DEFAULTS["max_ctx"],
                 window_dtype: str | None = SHARED_DEFAULTS["window_dtype"],
                 rotate: bool | None = None, layers: Any = None,
                 **option_values: Any) -> None:
        if method is None:  # the reference (dense) method
            from veloxquant_mlx.registry import reference

            method = reference()
        method_cls = _method_class(method)  # looked up once for every check below
        cls = method_cls.Options
        option_values = compat.current_names(cls, option_values)
        if rotate is not None and "rotate" in cls.field_names():
            option_values["rotate"] = rotate  # the method rotates by itself (turboquant)
            rotate = None
        rotate = SHARED_DEFAULTS["rotate"] if rotate is None else rotate
        if options is None:
            options = cls.from_kwargs(option_values)
        elif not isinstance(options, cls):
            raise config_error("options", options, f"a {cls.__name__} for method {method!r}")
        elif option_values:
            options = cls.from_kwargs(option_values, base=options)
        for name, value in (("method", method), ("options", options), ("max_ctx", max_ctx),
                            ("window_dtype", window_dtype), ("rotate", rotate),
                            ("layers", _layer_overrides(layers, method_cls, options))):
            object.__setattr__(self, name, value)
        if isinstance(max_ctx, bool) or not isinstance(max_ctx, int) or max_ctx < 1:
            raise config_error("max_ctx", max_ctx, "a positive integer")
        if window_dtype not in WINDOW_DTYPES:
            raise config_error("window_dtype", window_dtype,
                               "one of 'float16', 'bfloat16', 'float32' or None")
        if not isinstance(rotate, bool):
            raise config_error("rotate", rotate, "True or False")
        if rotate:
            _check_rotatable(method_cls, options)

    @property
    def method_class(self) -> type:
        """The method's registered cache class (what shared code asks for capabilities)."""
        from veloxquant_mlx.registry import get_method

        return get_method(self.method)

    @property
    def is_reference(self) -> bool:
        """Whether this is the reference method (dense), that others are measured against."""
        from veloxquant_mlx.registry import reference

        return self.method == reference()

    def __getattr__(self, name: str) -> Any:
        # Options read as flat fields (``config.bits``; 0.1 names such as ``xkv_rank_k``).
        if name.startswith("__"):
            raise AttributeError(name)
        options = self.__dict__.get("options")
        field = compat.field_name(type(options), name) if options is not None else None
        if field is None:
            raise AttributeError(f"KVCacheConfig of method {self.__dict__.get('method')!r} "
                                 f"has no field or option {name!r}")
        return getattr(options, field)

    def replace(self, **changes: Any) -> KVCacheConfig:
        """A copy with shared fields and/or options changed (validated again)."""
        shared = {k: changes.pop(k) for k in (*SHARED, "method") if k in changes}
        method = shared.pop("method", self.method)
        options = changes.pop("options", self.options if method == self.method else None)
        return KVCacheConfig(method, options, **{**self._shared(), **shared}, **changes)

    def _shared(self) -> dict[str, Any]:
        # A method with its own ``rotate`` option has no shared one (it is always False).
        return {k: getattr(self, k) for k in SHARED
                if k != "rotate" or "rotate" not in self.options.field_names()}

    def layer_options(self, layer: int) -> MethodOptions:
        """The options of cache slot ``layer``: ``options`` with its overrides applied."""
        override = dict(self.layer_overrides().get(layer, {}))
        return type(self.options).from_kwargs(override, base=self.options) if override \
            else self.options

    def check_layers(self, n_layers: int) -> None:
        """Every per-layer override must name a layer of a model of ``n_layers`` layers."""
        beyond = [i for i, _ in self.layers or () if i >= n_layers]
        if beyond:
            raise ConfigError(f"KVCacheConfig.layers names layer {beyond[0]}: the model has "
                              f"{n_layers} layers (overrides of layers 0 to {n_layers - 1})")

    def layer_overrides(self) -> dict[int, dict[str, Any]]:
        """``{layer: {option: value}}`` of the per-layer overrides (empty without)."""
        return {i: dict(items) for i, items in self.layers or ()}

    # ---- serialization ----
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serializable dict (saved caches, reports, config files)."""
        shared = self._shared()
        if shared["layers"] is None:
            del shared["layers"]  # as written before per-layer overrides existed
        else:
            shared["layers"] = {str(i): o for i, o in self.layer_overrides().items()}
        return {"method": self.method, **shared, "options": self.options.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVCacheConfig:
        """Rebuild from :meth:`to_dict`, or from a 0.1 flat dict; unknown keys are an error."""
        if not isinstance(data, dict):
            raise config_error("config", data, "a JSON object (a dict of KVCacheConfig "
                               "fields)")
        data = dict(data)
        if not isinstance(data.get("method", ""), str):
            raise config_error("method", data["method"], "a method name string")
        if "options" not in data:
            data = compat.upgrade_config_dict(data)
        unknown = sorted(set(data) - {"method", "options", *SHARED})
        if unknown:
            raise ConfigError(f"unknown KVCacheConfig field(s) {unknown}; known fields: "
                              f"['method', 'options', {', '.join(map(repr, SHARED))}]")
        method = data.pop("method", None)
        options = data.pop("options") or {}
        if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
            raise config_error("options", options, "a dict {option name: value}")
        options = _method_class(method or cls().method).Options.from_kwargs(options)
        return cls(method, options, **data)

    def to_string(self) -> str:
        """``method:key=value,...`` with the fields that differ from the defaults."""
        changed = dict(self.options.changed())
        changed.update({k: v for k, v in self._shared().items()
                        if v != SHARED_DEFAULTS[k]})
        if self.layers:
            changed["layers"] = layers_to_string(self.layer_overrides())
        items = ",".join(f"{k}={v}" for k, v in changed.items())
        return self.method + (":" + items if items else "")

    @classmethod
    def from_string(cls, spec: str) -> KVCacheConfig:
        """Parse ``"method:key=value,key=value"`` (the CLI's and sweeps' syntax).

        Keys are the method's option names (``xkv:rank_k=32``); 0.1's prefixed names
        (``xkv:xkv_rank_k=32``) and the shared ``max_ctx`` / ``window_dtype`` work too.
        """
        method, _, rest = spec.partition(":")
        values: dict[str, Any] = {}
        for item in filter(None, (p.strip() for p in rest.split(","))):
            key, sep, raw = item.partition("=")
            if not sep:
                raise ConfigError(f"option {item!r} in {spec!r} is not of the form key=value")
            values[key.strip()] = parse_value(raw.strip())
        return cls(method.strip(), **values)

    def to_file(self, path: str | Path) -> None:
        """Write the config as JSON (what ``--config FILE`` reads)."""
        write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")  # whole or not at all

    @classmethod
    def from_file(cls, path: str | Path) -> KVCacheConfig:
        """Read a JSON config written by :meth:`to_file` (or by ``veloxquant tune``)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file {str(path)!r} does not exist")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, nested too deep
            raise ConfigError(f"config file {str(path)!r} is not valid JSON: {exc}") from exc
        if isinstance(data, dict) and "config" in data and "method" not in data:
            data = data["config"]  # a tuner result file: the chosen config inside
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a JSON object")
        return cls.from_dict(data)


def parse_value(raw: str) -> Any:
    """``"none"`` -> None, ``"true"`` -> True, numbers -> int/float, else the string."""
    low = raw.lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


# ---------------------------------------------------------------- shared switches
def _check_rotatable(cls: type, options: MethodOptions) -> None:
    """``rotate=True`` needs a method whose stored K/V only meet queries in dot products."""
    from veloxquant_mlx.registry import methods

    method = cls.method
    if not cls.profile.rotatable:
        able = sorted(n for n, c in methods().items() if c.profile.rotatable)
        raise config_error("rotate", True, f"False for method {method!r}: it does not "
                           f"attend by dot products over the keys/values it stores (methods "
                           f"that take rotate=True: {able})")
    why = cls.profile.rotation_refusal(options)
    if why is not None:
        raise config_error("rotate", True, why)


def parse_layers(text: str) -> dict[int, dict[str, Any]]:
    """``"0-3:bits=4+window=64/10:bits=3"`` -> ``{0: {...}, 1: ..., 10: {"bits": 3}}``."""
    out: dict[int, dict[str, Any]] = {}
    for group in filter(None, (g.strip() for g in text.split("/"))):
        where, sep, items = group.partition(":")
        if not sep:
            raise ConfigError(f"layers group {group!r} is not of the form "
                              "'LAYERS:key=value+key=value' (LAYERS: 3 or 0-3)")
        values = {}
        for item in filter(None, (p.strip() for p in items.split("+"))):
            key, eq, raw = item.partition("=")
            if not eq:
                raise ConfigError(f"layers option {item!r} in {group!r} is not key=value")
            values[key.strip()] = parse_value(raw.strip())
        for i in _layer_range(where.strip(), group):
            out.setdefault(i, {}).update(values)
    return out


def _layer_range(where: str, group: str) -> range:
    lo, dash, hi = where.partition("-")
    try:
        first, last = int(lo), int(hi if dash else lo)
    except ValueError:
        raise ConfigError(f"layers {where!r} in {group!r} is not a layer index (3) or "
                          "range (0-3)") from None
    if first < 0 or last < first:
        raise ConfigError(f"layers {where!r} in {group!r} is not an increasing range of "
                          "layer indices >= 0")
    if last >= MAX_LAYERS:
        raise ConfigError(f"layers {where!r} in {group!r} names layer {last}: layer indices "
                          f"are below {MAX_LAYERS}")
    return range(first, last + 1)


def layers_to_string(overrides: dict[int, dict[str, Any]]) -> str:
    """The compact form of ``overrides``; runs of layers with equal options as ranges."""
    groups: list[tuple[int, int, str]] = []
    for i in sorted(overrides):
        items = "+".join(f"{k}={v}" for k, v in sorted(overrides[i].items()))
        if groups and groups[-1][1] == i - 1 and groups[-1][2] == items:
            groups[-1] = (groups[-1][0], i, items)
        else:
            groups.append((i, i, items))
    return "/".join(f"{a}{'' if a == b else f'-{b}'}:{items}" for a, b, items in groups)


def _layer_overrides(layers: Any, method_cls: type, options: MethodOptions
                     ) -> tuple[tuple[int, tuple[tuple[str, Any], ...]], ...] | None:
    """Validated, canonical per-layer overrides (sorted; option names resolved)."""
    if layers is None or layers == "" or layers == {} or layers == ():
        return None
    if isinstance(layers, str):
        layers = parse_layers(layers)
    elif isinstance(layers, (tuple, list)):
        try:
            layers = {i: dict(items) for i, items in layers}
        except (TypeError, ValueError):
            raise config_error("layers", layers, "((layer, ((option, value), ...)), ...)"
                               ) from None
    if not isinstance(layers, dict):
        raise config_error("layers", layers, "a dict {layer: {option: value}} or a string "
                           "such as '0-3:bits=4/10:bits=3'")
    method = method_cls.method
    if method_cls.profile.cross_layer:
        raise config_error("layers", layers, f"None for method {method!r}: per-layer "
                           "overrides apply to methods whose layers are independent")
    cls = type(options)
    out = []
    for key, override in layers.items():
        where = str(key)
        if isinstance(key, str):
            idx: Any = _layer_range(where, where)
        elif isinstance(key, int) and not isinstance(key, bool) and 0 <= key < MAX_LAYERS:
            idx = [key]
        else:
            idx = None
        if idx is None or not isinstance(override, dict):
            raise config_error("layers", layers, "{layer index: {option: value}} with "
                               f"indices 0 to {MAX_LAYERS - 1}")
        names = {}
        for name, value in override.items():
            resolved = compat.field_name(cls, name)
            if resolved is None:
                raise ConfigError(f"layers: unknown option {name!r} for method {method!r} "
                                  f"(layer {where}); its options are {cls.field_names()}")
            names[resolved] = value
        try:
            cls.from_kwargs(names, base=options)  # the layer's options must be valid
        except ConfigError as exc:
            raise ConfigError(f"layers[{where}]: {exc}") from None
        items = tuple(sorted(names.items()))
        out.extend((int(i), items) for i in idx)
    return tuple(sorted(out)) or None
