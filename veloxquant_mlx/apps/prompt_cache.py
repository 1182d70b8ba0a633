"""Compressed prompt caches on disk, and trimming (drop-ins for mlx_lm's helpers).

``save_prompt_cache`` writes one ``.safetensors`` file holding each layer's
``state`` as it is held (codes, factors, window: never a dense reconstruction) and
a JSON header: format version, library version, method, ``KVCacheConfig``, per
layer its class path, ``LayerInfo``, ``meta_state`` and the layout (shape, dtype,
CRC-32) of every array. mlx_lm's own loader looks class names up in its own module,
so these files are read with ``load_prompt_cache`` here, which rebuilds the layers,
wires cross-layer methods to a fresh coordinator (``assign_roles``) and checks the
file against its header and, when given, the model.
"""

from __future__ import annotations

import importlib
import json
import zlib
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from veloxquant_mlx._version import __version__
from veloxquant_mlx.adapter.builder import KVCacheBuilder
from veloxquant_mlx.adapter.mlx_lm import (
    bind_routing,
    check_attention_routing,
    install_attention_routing,
)
from veloxquant_mlx.apps.distributed import (
    rank_path,
    saved_world_hint,
    shard_header,
    shard_mismatch,
)
from veloxquant_mlx.cache.base import CompressedCache, LayerInfo, NotTrimmableError
from veloxquant_mlx.config import KVCacheConfig
from veloxquant_mlx.registry import get_method

__all__ = ["NotTrimmableError", "PromptCacheError", "can_trim_prompt_cache",
           "load_prompt_cache", "read_prompt_cache_header", "save_prompt_cache",
           "trim_prompt_cache"]

FORMAT_VERSION = 1
_KEY = "veloxquant"
_UINT = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}


class PromptCacheError(ValueError):
    """A prompt-cache file is corrupt, truncated or does not fit the model."""


def _crc(a: mx.array) -> int:
    raw = np.asarray(a.view(_UINT[a.itemsize]) if a.dtype == mx.bfloat16 else a)
    return zlib.crc32(np.ascontiguousarray(raw).tobytes())


def _encode(value: Any, prefix: str, arrays: dict[str, mx.array]) -> Any:
    """JSON description of a (nested) state; arrays go to ``arrays`` by name."""
    if isinstance(value, mx.array):
        arrays[prefix] = value
        return {"a": prefix, "shape": list(value.shape), "dtype": str(value.dtype),
                "crc": _crc(value)}
    if isinstance(value, (list, tuple)):
        return {"l": [_encode(v, f"{prefix}.{i}", arrays) for i, v in enumerate(value)]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"v": value}
    raise TypeError(f"cache state entry {prefix} of type {type(value).__name__} is not "
                    "serializable (arrays, lists, numbers, strings, None)")


def _decode(desc: Any, arrays: dict[str, mx.array], where: str) -> Any:
    if "l" in desc:
        return [_decode(d, arrays, where) for d in desc["l"]]
    if "v" in desc:
        return desc["v"]
    name = desc["a"]
    if name not in arrays:
        raise PromptCacheError(f"{where}: array {name!r} is missing from the file")
    a = arrays[name]
    if list(a.shape) != desc["shape"] or str(a.dtype) != desc["dtype"]:
        raise PromptCacheError(
            f"{where}: array {name!r} has shape {tuple(a.shape)} {a.dtype}, the header "
            f"says {tuple(desc['shape'])} {desc['dtype']}"
        )
    if _crc(a) != desc["crc"]:
        raise PromptCacheError(f"{where}: array {name!r} is corrupt (checksum mismatch)")
    return a


def _fingerprint(infos: list[LayerInfo | None]) -> dict[str, Any]:
    live = [i for i in infos if i is not None]
    return {
        "n_layers": len(infos),
        "model_type": live[0].model_type if live else "",
        "n_kv_heads": [i.n_kv_heads if i else None for i in infos],
        "head_dim": [i.head_dim if i else None for i in infos],
    }


def save_prompt_cache(path: str | Path, caches: list[Any],
                      metadata: dict[str, str] | None = None) -> None:
    """Save a model's caches (compressed form as held) to a ``.safetensors`` file."""
    arrays: dict[str, mx.array] = {}
    layers, config = [], None
    for i, c in enumerate(caches):
        cls = type(c)
        entry: dict[str, Any] = {"class": f"{cls.__module__}:{cls.__qualname__}",
                                 "state": _encode(c.state, f"{i}", arrays)}
        if isinstance(c, CompressedCache):
            if config is not None and c.config != config:
                raise ValueError(f"layer {i} was built with a different KVCacheConfig "
                                 "than the layers before it")
            config = c.config
            entry["layer_info"] = c.layer.to_dict()
            entry["meta_state"] = list(c.meta_state)
        elif hasattr(c, "meta_state"):
            entry["meta_state"] = list(c.meta_state)
        layers.append(entry)
    if config is None:
        raise ValueError("save_prompt_cache: no veloxquant cache among the layers; use "
                         "mlx_lm.models.cache.save_prompt_cache for plain mlx_lm caches")
    infos = [c.layer if isinstance(c, CompressedCache) else None for c in caches]
    header = {
        "format_version": FORMAT_VERSION,
        "library_version": __version__,
        "method": config.method,
        "config": config.to_dict(),
        "model": _fingerprint(infos),
        "layers": layers,
        "metadata": dict(metadata or {}),
        # Under mlx.launch each rank saves its own shard to its own file.
        "shard": shard_header(),
    }
    path = rank_path(path)
    if not arrays:  # safetensors needs at least one tensor
        arrays["_empty"] = mx.zeros((0,), mx.uint8)
    mx.eval(list(arrays.values()))
    mx.save_safetensors(str(path), arrays, {_KEY: json.dumps(header)})


def _read(path: str | Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    path = str(path)
    if not Path(path).is_file():
        raise FileNotFoundError(f"prompt cache file {path!r} does not exist")
    try:
        arrays, meta = mx.load(path, return_metadata=True)
    except Exception as exc:  # mlx raises RuntimeError/ValueError on bad headers
        raise PromptCacheError(f"{path!r} is not a readable safetensors file (truncated "
                               f"or corrupt): {exc}") from exc
    if _KEY not in meta:
        raise PromptCacheError(f"{path!r} is not a veloxquant prompt cache (no "
                               f"{_KEY!r} header); mlx_lm files load with mlx_lm's loader")
    try:
        header = json.loads(meta[_KEY])
    except json.JSONDecodeError as exc:
        raise PromptCacheError(f"{path!r}: corrupt header ({exc})") from exc
    version = header.get("format_version")
    if version != FORMAT_VERSION:
        raise PromptCacheError(f"{path!r}: format version {version!r} is not supported "
                               f"(this library reads {FORMAT_VERSION})")
    return arrays, header


def _check_model(header: dict[str, Any], model: Any, path: str) -> list[LayerInfo | None]:
    live = KVCacheBuilder.layer_infos(model)
    saved, have = header["model"], _fingerprint(live)
    if saved["n_layers"] != have["n_layers"]:
        raise PromptCacheError(
            f"{path!r} was saved for a different model: n_layers={saved['n_layers']} in "
            f"the file, {have['n_layers']} in the given model"
        )
    for key in ("n_kv_heads", "head_dim"):
        for i, (a, b) in enumerate(zip(saved[key], have[key])):
            if a is not None and a != b:
                raise PromptCacheError(
                    f"{path!r} was saved for a different model: layer {i} {key}={a} in "
                    f"the file, {b} in the given model"
                )
    return live


def load_prompt_cache(path: str | Path, model: Any = None,
                      return_metadata: bool = False) -> Any:
    """Load caches saved by :func:`save_prompt_cache` (every method, every layer kind).

    With ``model`` the file is checked against the model's shape and the caches get
    the live attention modules; attention routing is installed either way.
    """
    arrays, header = _read_for_rank(path)
    where = str(rank_path(path))
    try:
        config = KVCacheConfig.from_dict(header["config"])
        entries = header["layers"]
        method_cls = get_method(config.method)
        live = _check_model(header, model, where) if model is not None else None
        idx = [i for i, e in enumerate(entries) if "layer_info" in e]
        infos = []
        for i in idx:
            info = LayerInfo(**entries[i]["layer_info"])
            if live is not None and live[i] is not None:
                info.attention, info.block = live[i].attention, live[i].block
            infos.append(info)
        saved_roles = [(x.group_id, x.member_idx, x.group_size) for x in infos]
        # A fresh coordinator per loaded model; the saved roles stay authoritative.
        method_cls.assign_roles(infos, config, model)
        for info, roles in zip(infos, saved_roles):
            info.group_id, info.member_idx, info.group_size = roles
    except PromptCacheError:
        raise
    except (KeyError, TypeError) as exc:
        raise PromptCacheError(f"{where}: malformed header ({exc!r})") from exc

    caches: list[Any] = []
    by_layer = dict(zip(idx, infos))
    for i, entry in enumerate(entries):
        here = f"{where} layer {i}"
        state = _decode(entry["state"], arrays, here)
        try:
            if i in by_layer:
                cache = method_cls.from_saved(config, by_layer[i], state,
                                              tuple(entry["meta_state"]))
            else:
                cache = _rebuild_foreign(entry, state)
        except PromptCacheError:
            raise
        except Exception as exc:
            raise PromptCacheError(f"{here}: cannot rebuild {entry.get('class')} from the "
                                   f"saved state ({exc!r})") from exc
        caches.append(cache)
    compressed = [caches[i] for i in idx]
    if model is not None and method_cls.attends:
        check_attention_routing(model, idx, config.method)
    method_cls.after_build(compressed, config, model)
    if model is None:
        install_attention_routing()  # no model to lease for: the process holds it
    else:
        bind_routing(model, [c.layer for c in compressed])
    if return_metadata:
        return caches, header["metadata"]
    return caches


def _rebuild_foreign(entry: dict[str, Any], state: Any) -> Any:
    """A layer that kept mlx_lm's own cache (e.g. sliding-window layers)."""
    module_name, _, cls_name = entry["class"].partition(":")
    if not module_name.startswith("mlx_lm."):
        raise PromptCacheError(f"refusing to import {entry['class']!r}: only mlx_lm cache "
                               "classes are rebuilt from a file")
    cls = getattr(importlib.import_module(module_name), cls_name)
    cache = cls.from_state(tuple(state) if isinstance(state, list) else state)
    if "meta_state" in entry:
        cache.meta_state = tuple(entry["meta_state"])
    return cache


def _read_for_rank(path: str | Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """This rank's file (``rank_path``), checked against the job's world size and rank."""
    own = rank_path(path)
    if not own.is_file():
        hint = saved_world_hint(path)
        if hint is not None:
            raise PromptCacheError(hint)
    arrays, header = _read(own)
    problem = shard_mismatch(header.get("shard"))
    if problem is not None:
        raise PromptCacheError(f"{str(own)!r}: {problem}")
    return arrays, header


def read_prompt_cache_header(path: str | Path) -> dict[str, Any]:
    """The JSON header of a saved prompt cache (method, config, model, layers, shard)."""
    return _read(rank_path(path))[1]


def can_trim_prompt_cache(caches: list[Any]) -> bool:
    """Whether every layer can drop tokens from its end."""
    return all(c.is_trimmable() for c in caches)


def trim_prompt_cache(caches: list[Any], num_tokens: int) -> int:
    """Drop the last ``num_tokens`` tokens of every layer; returns how many were dropped.

    Unlike mlx_lm's helper (which returns 0), caches that cannot be trimmed raise
    ``NotTrimmableError`` naming the layers.
    """
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"trim_prompt_cache: num_tokens={num_tokens!r} is not allowed: "
                         "an integer >= 0")
    bad = [f"{i} ({type(c).__name__})" for i, c in enumerate(caches) if not c.is_trimmable()]
    if bad:
        raise NotTrimmableError(f"prompt cache is not trimmable: layers {', '.join(bad)} "
                                "cannot drop tokens from their end")
    if not caches:
        return 0
    return [c.trim(num_tokens) for c in caches][0]
