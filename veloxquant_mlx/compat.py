"""What veloxquant_mlx 0.1 wrote and accepted, read in one place.

0.1 had one flat ``KVCacheConfig`` holding every method's options: ``bits``,
``group_size`` and ``window`` unprefixed (shared), the others prefixed with their
method (``xkv_rank_k``, ``minicache_t``). It saved that flat dict, every field, into
prompt caches and config files, and took the same names as keywords, in
``method:key=value`` specs and as CLI flags (``--xkv-rank-k``). The rest of the package
knows only the current names; ``config`` and ``cli`` ask this module what an 0.1
spelling means:

- ``field_name(options_cls, key)``: the option field ``key`` names, current or 0.1;
- ``flag_aliases(options_cls)``: the 0.1 spellings of a method's fields, for the CLI;
- ``upgrade_config_dict(data)``: a flat 0.1 dict in today's ``to_dict`` form. Other
  methods' fields are dropped (0.1 ignored them too); a field of the method itself that
  today's options cannot hold, with a value other than 0.1's default, and anything 0.1
  never wrote are a ``ConfigError`` naming them.

A saved cache whose stored arrays changed layout since 0.1 (xKV) is refused by its own
cache class, whose ``meta_state`` tells the two layouts apart.
"""

from __future__ import annotations

from typing import Any

from veloxquant_mlx.options import ConfigError, MethodOptions

# 0.1's shared option names (no method prefix).
UNPREFIXED = ("bits", "group_size", "window")
# 0.1 names that are not ``<method>_<field>`` of today's field.
RENAMED: dict[str, dict[str, str]] = {
    "xkv": {"xkv_group_size": "group_layers"},
    "minicache": {"minicache_bits": "bits"},
}
# Every field of 0.1's flat config and its default (``None``: the method's default).
FIELDS_01: dict[str, Any] = {
    "method": "none", "bits": None, "group_size": None, "window": None,
    "window_dtype": "float16", "max_ctx": 131072, "extra": {},
    "xkv_group_size": 4, "xkv_rank_k": None, "xkv_rank_v": None,
    "xkv_energy_threshold": 0.95, "xkv_block": 1024, "xkv_factor_bits": None,
    "xkv_pre_rope": True, "xkv_grouping": "contiguous",
    "streaming_sink": 4,
    "snapkv_capacity": 1024, "snapkv_kernel": 7, "snapkv_pooling": "max",
    "minicache_start_layer": None, "minicache_end_layer": None, "minicache_t": 0.5,
    "minicache_retention_threshold": 0.05, "minicache_bits": None,
    "minicache_retention": "fraction",
    "xquant_latent": True, "xquant_anchor_bits": None,
}
SHARED_01 = ("method", "max_ctx", "window_dtype")


def _prefix(options_cls: type[MethodOptions]) -> str:
    return options_cls.method.split("_")[0] + "_"


def field_name(options_cls: type[MethodOptions], key: str) -> str | None:
    """The field of ``options_cls`` that ``key`` names: itself, its 0.1 name
    (``<method>_<field>``, or a renamed one) or ``None``."""
    names = options_cls.field_names()
    if key in names:
        return key
    renamed = RENAMED.get(options_cls.method, {})
    if key in renamed:
        return renamed[key]
    prefix = _prefix(options_cls)
    if key.startswith(prefix) and key[len(prefix):] in names:
        return key[len(prefix):]
    return None


def current_names(options_cls: type[MethodOptions], values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with 0.1 option names replaced by today's (unknown names kept, for the
    options class to refuse by name)."""
    return {field_name(options_cls, k) or k: v for k, v in values.items()}


def flag_aliases(options_cls: type[MethodOptions]) -> dict[str, str]:
    """0.1 flag names (underscored) -> field: ``xkv_rank_k`` for every field 0.1 spelled
    with a prefix, and the renamed ones."""
    out = {_prefix(options_cls) + f: f for f in options_cls.field_names() if f not in UNPREFIXED}
    out.update(RENAMED.get(options_cls.method, {}))
    return out


def upgrade_config_dict(data: dict[str, Any]) -> dict[str, Any]:
    """A flat 0.1 config dict as ``KVCacheConfig.to_dict`` writes one today."""
    from veloxquant_mlx.registry import get_method

    unknown = sorted(set(data) - set(FIELDS_01))
    if unknown:
        raise ConfigError(f"unknown KVCacheConfig field {', '.join(map(repr, unknown))} in a "
                          "saved config (neither today's form, with 'options', nor 0.1's "
                          "flat one)")
    if data.get("extra"):
        raise ConfigError(f"the 0.1 config field 'extra' ({data['extra']!r}) is not "
                          "supported: remove it or rebuild the config")
    method = data.get("method", FIELDS_01["method"])
    opts_cls = get_method(method).Options
    options = {}
    for key, value in data.items():
        if key in (*SHARED_01, "extra") or value is None:
            continue  # None meant "the method's default" in 0.1
        name = field_name(opts_cls, key)
        if name is not None:
            options[name] = value
        elif key.startswith(_prefix(opts_cls)) and value != FIELDS_01[key]:
            raise ConfigError(f"the 0.1 option {key}={value!r} of method {method!r} is not "
                              f"supported any more; its options are {opts_cls.field_names()}")
    shared = {k: data[k] for k in ("max_ctx", "window_dtype") if k in data}
    return {"method": method, **shared, "options": options}
