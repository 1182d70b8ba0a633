"""Compressed prompt caches on disk, and trimming (drop-ins for mlx_lm's helpers).

``save_prompt_cache`` writes one ``.safetensors`` file holding each layer's
``state`` as it is held (codes, factors, window: never a dense reconstruction) and
a JSON header: format version, library version, method, ``KVCacheConfig``, per
layer its class path, ``LayerInfo``, ``meta_state`` and the layout (shape, dtype,
CRC-32) of every array. mlx_lm's own loader looks class names up in its own module,
so these files are read with ``load_prompt_cache`` here, which rebuilds the layers,
wires cross-layer methods to a fresh coordinator (``assign_roles``) and checks the
file against its header and, when given, the model. Before anything reads a restored
layer, its arrays are checked against the layer and the config
(``cache.restore_check``); any mismatch, malformed header included, is a
``PromptCacheError`` naming the layer, the entry and what was expected. A save goes to a
temporary file renamed over the target once complete (``ops.files``).

``save_prompt_cache(..., at_rest=True, model=model)`` writes the at-rest format instead
(``apps.at_rest``: transform-coded, its own header holding the method, config and
metadata); ``load_prompt_cache`` recognises such a file by its header and restores it
into the saved method's caches, checked against the model as any file is.
"""

from __future__ import annotations

import importlib
import json
import math
import zlib
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache

from veloxquant_mlx._version import __version__
from veloxquant_mlx.adapter.builder import KVCacheBuilder
from veloxquant_mlx.adapter.mlx_lm import (
    bind_routing,
    check_attention_routing,
    install_attention_routing,
)
from veloxquant_mlx.apps import at_rest
from veloxquant_mlx.apps.distributed import (
    rank_path,
    saved_world_hint,
    shard_header,
    shard_mismatch,
)
from veloxquant_mlx.cache.base import CompressedCache, LayerInfo, NotTrimmableError, restore_saved
from veloxquant_mlx.cache.restore_check import (
    STORED_DTYPES,
    check_meta,
    check_restored,
    flat_state,
)
from veloxquant_mlx.config import KVCacheConfig
from veloxquant_mlx.errors import PromptCacheError  # re-exported: its old import path
from veloxquant_mlx.ops.files import replacing
from veloxquant_mlx.registry import get_method

__all__ = ["NotTrimmableError", "PromptCacheError", "can_trim_prompt_cache",
           "load_prompt_cache", "read_prompt_cache_header", "save_prompt_cache",
           "trim_prompt_cache"]

FORMAT_VERSION = 1
_KEY = "veloxquant"
_UINT = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}


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


def _decode(desc: Any, arrays: dict[str, mx.array], where: str, depth: int = 0) -> Any:
    if depth > 16:  # states nest a few levels; a deeper one would exhaust the stack
        raise PromptCacheError(f"{where}: state nested deeper than 16 levels")
    if not isinstance(desc, dict) or len(desc.keys() & {"l", "v", "a"}) != 1:
        raise PromptCacheError(f"{where}: malformed state entry {desc!r:.80}, expected "
                               "{'l': [...]}, {'v': value} or {'a': name, 'shape', 'dtype', "
                               "'crc'}")
    if "l" in desc:
        if not isinstance(desc["l"], list):
            raise PromptCacheError(f"{where}: state list {desc['l']!r:.80} is not a list")
        return [_decode(d, arrays, where, depth + 1) for d in desc["l"]]
    if "v" in desc:
        if desc["v"] is not None and not isinstance(desc["v"], (bool, int, float, str)):
            raise PromptCacheError(f"{where}: state value {desc['v']!r:.80} is not a number, "
                                   "string or null")
        return desc["v"]
    name, shape = desc["a"], desc.get("shape")
    if not isinstance(name, str) or not isinstance(shape, list) or \
            not isinstance(desc.get("dtype"), str) or not isinstance(desc.get("crc"), int):
        raise PromptCacheError(f"{where}: malformed array entry {desc!r:.120}, expected a "
                               "name, a shape list, a dtype and a crc")
    if name not in arrays:
        raise PromptCacheError(f"{where}: array {name!r} is missing from the file")
    a = arrays[name]
    if list(a.shape) != shape or str(a.dtype) != desc["dtype"]:
        raise PromptCacheError(
            f"{where}: array {name!r} has shape {tuple(a.shape)} {a.dtype}, the header "
            f"says {tuple(shape)} {desc['dtype']}"
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


# At-rest defaults: 3 bits per value measured KL <= 0.01 on SmolLM2 (docs/methods/at-rest.md).
AT_REST_BITS, AT_REST_WINDOW, AT_REST_SINKS = 3.0, 32, 4


def save_prompt_cache(path: str | Path, caches: list[Any],
                      metadata: dict[str, str] | None = None, *, at_rest: bool = False,
                      model: Any = None, at_rest_bits: float = AT_REST_BITS,
                      at_rest_window: int = AT_REST_WINDOW) -> None:
    """Save a model's caches (compressed form as held) to a ``.safetensors`` file.

    ``at_rest``: transform-coded instead (needs ``model``): ``at_rest_bits`` bits per
    value, the last ``at_rest_window`` tokens kept (float16, or the cache's 16-bit
    dtype); a window at least as long as the history makes it lossless."""
    if at_rest:
        _save_at_rest(path, caches, metadata, model, at_rest_bits, at_rest_window)
        return
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
    # Whole or not at all: a failed write (a full disk) keeps the previous file.
    with replacing(path) as tmp:
        try:
            mx.save_safetensors(str(tmp), arrays, {_KEY: json.dumps(header)})
        except RuntimeError as exc:  # MLX's failed write (a full disk, a size limit)
            raise OSError(f"could not write the prompt cache {str(path)!r} ({exc}); any "
                          "previous file there is kept") from exc


def _shared_config(caches: list[Any]) -> KVCacheConfig | None:
    configs = {c.config for c in caches if isinstance(c, CompressedCache)}
    if len(configs) > 1:
        raise ValueError("the layers were built with different KVCacheConfigs")
    return configs.pop() if configs else None


def _save_at_rest(path: str | Path, caches: list[Any], metadata: dict[str, str] | None,
                  model: Any, bits: float, window: int) -> None:
    if model is None:
        raise ValueError("save_prompt_cache(at_rest=True) needs the model (its identity, "
                         "calibration and layer shapes)")
    config = _shared_config(caches)
    saved = {"method": config.method if config else None,
             "config": config.to_dict() if config else None,
             "metadata": dict(metadata or {}), "library_version": __version__}
    held = max((getattr(c, "offset", 0) for c in caches), default=0)
    # A window over the whole history asks for a lossless file: every token in the
    # cache's own dtype (float32 ones included, which otherwise keep float16 ends).
    exact = "float32" if window + AT_REST_SINKS >= held and _holds_float32(caches) else None
    at_rest.save_at_rest(path, model, caches, bits=bits, sinks=AT_REST_SINKS,
                         window=window, saved=saved, ends_dtype=exact)


def _holds_float32(caches: list[Any]) -> bool:
    first = caches[0] if caches else None
    keys = first.keys_and_values()[0] if hasattr(first, "keys_and_values") else getattr(first, "keys", None)
    return isinstance(keys, mx.array) and keys.dtype == mx.float32


def _saved_config(saved: Any, where: str) -> KVCacheConfig | None:
    """The config an at-rest file's header names (None: mlx_lm's own caches)."""
    if not isinstance(saved, dict) or not isinstance(saved.get("config"), (dict, type(None))):
        raise PromptCacheError(f"{where}: malformed at-rest header (no 'saved' object "
                               "with a config)")
    if saved["config"] is None:
        return None
    try:
        config = KVCacheConfig.from_dict(saved["config"])
    except (ValueError, TypeError) as exc:
        raise PromptCacheError(f"{where}: the saved config is not valid: {exc}") from exc
    if saved.get("method") != config.method:
        raise PromptCacheError(f"{where}: header method {saved.get('method')!r} is not the "
                               f"config's {config.method!r}")
    return config


def _load_at_rest(path: str | Path, header: dict[str, Any], model: Any
                  ) -> tuple[list[Any], dict[str, str]]:
    """An at-rest file restored into its saved method's caches, each layer checked."""
    where = str(path)
    if model is None:
        raise PromptCacheError(f"{where!r} is saved at rest: load it with its model "
                               "(load_prompt_cache(path, model))")
    config = _saved_config(header.get("saved"), where)
    caches = at_rest.load_at_rest(path, model, config)
    for i, c in enumerate(caches):
        if isinstance(c, CompressedCache):
            try:
                check_restored(c)
            except (ValueError, IndexError, TypeError) as exc:
                raise PromptCacheError(f"{where} layer {i} ({c.method}): {exc}") from exc
    metadata = header["saved"].get("metadata")
    ok = isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    return caches, dict(metadata) if ok else {}


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
    except (json.JSONDecodeError, RecursionError) as exc:  # deep nesting: RecursionError
        raise PromptCacheError(f"{path!r}: corrupt header ({exc!r})") from exc
    if not isinstance(header, dict):
        raise PromptCacheError(f"{path!r}: corrupt header (a JSON object is expected)")
    version = header.get("format_version")
    if version != FORMAT_VERSION:
        raise PromptCacheError(f"{path!r}: format version {version!r} is not supported "
                               f"(this library reads {FORMAT_VERSION})")
    return arrays, header


# LayerInfo fields a file may hold: (types allowed, smallest value for numbers).
_INFO_FIELDS: dict[str, tuple[tuple[type, ...], int | None]] = {
    "layer_idx": ((int,), 0), "n_layers": ((int,), 1), "n_kv_heads": ((int,), 1),
    "head_dim": ((int,), 1), "v_head_dim": ((int, type(None)), 1),
    "group_id": ((int,), 0), "member_idx": ((int,), 0), "group_size": ((int,), 1),
    "rope_dims": ((int, type(None)), 1), "rope_base": ((int, float), None),
    "rope_traditional": ((bool,), None), "rope_scale": ((int, float), None),
    "sliding_window": ((int, type(None)), 1), "model_type": ((str,), None),
}


def _layer_info(raw: Any, i: int, n_layers: int, where: str) -> LayerInfo:
    """A saved ``LayerInfo``, every field of the type it has and of this entry's place."""
    if not isinstance(raw, dict):
        raise PromptCacheError(f"{where} layer {i}: layer_info is {type(raw).__name__}, "
                               "expected an object")
    for key, value in raw.items():
        kinds, low = _INFO_FIELDS.get(key, ((), None))
        if not kinds:
            raise PromptCacheError(f"{where} layer {i}: unknown layer_info field {key!r}")
        ok = isinstance(value, kinds) and (bool not in kinds) == (not isinstance(value, bool))
        ok = ok and not (isinstance(value, float) and not math.isfinite(value))
        if not ok or (low is not None and value is not None and value < low):
            raise PromptCacheError(
                f"{where} layer {i}: layer_info {key}={value!r}, expected "
                f"{' or '.join(k.__name__ for k in kinds)}"
                + (f" >= {low}" if low is not None else ""))
    info = LayerInfo(**raw)
    if info.layer_idx != i or info.n_layers != n_layers:
        raise PromptCacheError(f"{where} layer {i}: layer_info says layer {info.layer_idx} "
                               f"of {info.n_layers}, expected layer {i} of {n_layers}")
    return info


def _entries(header: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """The header's layer entries: one per model layer, each of the shape ``save`` writes."""
    model, entries = header["model"], header["layers"]
    n = model.get("n_layers") if isinstance(model, dict) else None
    if isinstance(n, bool) or not isinstance(n, int) or not isinstance(entries, list):
        raise PromptCacheError(f"{where}: malformed header (model.n_layers {n!r} and the "
                               "layer list are expected)")
    if len(entries) != n:
        raise PromptCacheError(f"{where}: {len(entries)} layer entries, expected one per "
                               f"layer of the model (n_layers={n})")
    for i, e in enumerate(entries):
        meta = e.get("meta_state", []) if isinstance(e, dict) else None
        if not isinstance(e, dict) or not isinstance(e.get("class"), str) or \
                "state" not in e or not isinstance(meta, list) or \
                not all(isinstance(m, str) for m in meta):
            raise PromptCacheError(f"{where} layer {i}: malformed entry, expected "
                                   "{'class': str, 'state': ..., 'meta_state': [str]}")
    for key in ("n_kv_heads", "head_dim"):
        if not isinstance(model.get(key), list) or len(model[key]) != n:
            raise PromptCacheError(f"{where}: model.{key} is not a list of {n} entries")
    return entries


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
    for i, (e, info) in enumerate(zip(header["layers"], live)):
        if "layer_info" in e and info is None:
            raise PromptCacheError(f"{path!r} layer {i}: the file holds a compressed cache; "
                                   "the given model's layer has no keys and values to cache")
    return live


def _check_dims(info: LayerInfo, live: LayerInfo | None, saved: dict[str, Any],
                where: str) -> None:
    """A layer's heads and widths: the live model's when given, else the header's."""
    i = info.layer_idx
    want = {k: getattr(live, k) for k in ("n_kv_heads", "head_dim", "v_head_dim")} \
        if live is not None else {k: saved[k][i] for k in ("n_kv_heads", "head_dim")}
    for key, value in want.items():
        if getattr(info, key) != value:
            raise PromptCacheError(f"{where} layer {i}: layer_info {key}="
                                   f"{getattr(info, key)}, expected {value} (the "
                                   f"{'model' if live is not None else 'header'}'s)")


def _plan(header: dict[str, Any], model: Any, where: str) -> tuple[Any, ...]:
    """Config, method class, entries and the compressed layers' infos (roles set)."""
    if not isinstance(header, dict) or not isinstance(header.get("config"), dict):
        raise PromptCacheError(f"{where}: malformed header (no config object)")
    try:
        config = KVCacheConfig.from_dict(header["config"])
    except ValueError as exc:  # ConfigError: named field and what it allows
        raise PromptCacheError(f"{where}: the saved config is not valid: {exc}") from exc
    if header.get("method") != config.method:
        raise PromptCacheError(f"{where}: header method {header.get('method')!r} is not the "
                               f"config's {config.method!r}")
    entries = _entries(header, where)
    method_cls = get_method(config.method)
    live = _check_model(header, model, where) if model is not None else None
    try:
        config.check_layers(len(entries))
    except ValueError as exc:
        raise PromptCacheError(f"{where}: {exc}") from exc
    idx = [i for i, e in enumerate(entries) if "layer_info" in e]
    infos = []
    for i in idx:
        info = _layer_info(entries[i]["layer_info"], i, len(entries), where)
        _check_dims(info, live[i] if live is not None else None, header["model"], where)
        if live is not None and live[i] is not None:
            info.attention, info.block = live[i].attention, live[i].block
        infos.append(info)
    if not infos:
        raise PromptCacheError(f"{where}: no compressed layer among the entries")
    saved_roles = [(x.group_id, x.member_idx, x.group_size) for x in infos]
    # A fresh coordinator per loaded model; the saved roles stay authoritative.
    method_cls.profile.assign_roles(infos, config, model)
    for info, roles in zip(infos, saved_roles):
        info.group_id, info.member_idx, info.group_size = roles
    return config, method_cls, entries, dict(zip(idx, infos))


def _rebuild(i: int, entry: dict[str, Any], arrays: dict[str, mx.array], where: str,
             config: KVCacheConfig, method_cls: type, info: LayerInfo | None) -> Any:
    here = f"{where} layer {i}"
    state = _decode(entry["state"], arrays, here)
    try:
        if info is None:
            return _rebuild_foreign(entry, state)
        cache = restore_saved(method_cls, config, info, state, tuple(entry["meta_state"]))
    except PromptCacheError as exc:
        raise PromptCacheError(f"{here}: {exc}") from exc
    except Exception as exc:
        raise PromptCacheError(f"{here}: cannot rebuild {entry.get('class')} from the "
                               f"saved state ({exc!r})") from exc
    built = f"{type(cache).__module__}:{type(cache).__qualname__}"
    if built != entry["class"]:
        raise PromptCacheError(f"{here}: the entry's class is {entry['class']!r}; the "
                               f"saved config ({config.method!r}) rebuilds {built!r}")
    try:
        check_meta(cache)  # before after_build: a hook binds layers by these fields
    except ValueError as exc:
        raise PromptCacheError(f"{here}: {exc}") from exc
    return cache


def load_prompt_cache(path: str | Path, model: Any = None,
                      return_metadata: bool = False) -> Any:
    """Load caches saved by :func:`save_prompt_cache` (every method, every layer kind).

    With ``model`` the file is checked against the model's shape and the caches get
    the live attention modules; attention routing is installed either way. Every
    restored layer is checked against its layer and config (``cache.restore_check``)
    before anything reads it: a file that does not fit is a ``PromptCacheError``.
    """
    rest = at_rest.at_rest_header(path) if Path(path).is_file() else None
    if rest is not None:
        caches, metadata = _load_at_rest(path, rest, model)
        return (caches, metadata) if return_metadata else caches
    arrays, header = _read_for_rank(path)
    where = str(rank_path(path))
    try:
        config, method_cls, entries, by_layer = _plan(header, model, where)
    except PromptCacheError:
        raise
    except (KeyError, TypeError, IndexError, AttributeError, ValueError) as exc:
        raise PromptCacheError(f"{where}: malformed header ({exc!r})") from exc
    caches = [_rebuild(i, e, arrays, where, config, method_cls, by_layer.get(i))
              for i, e in enumerate(entries)]
    compressed = [caches[i] for i in by_layer]
    if model is not None and method_cls.attends:
        check_attention_routing(model, list(by_layer), config.method)
    try:
        method_cls.profile.after_build(compressed, config, model)
    except (ValueError, ArithmeticError, IndexError, TypeError) as exc:
        raise PromptCacheError(f"{where}: the saved caches do not fit the model ({exc!r})"
                               ) from exc
    for i in by_layer:
        try:
            check_restored(caches[i])
        except (ValueError, IndexError, TypeError) as exc:
            raise PromptCacheError(f"{where} layer {i} ({config.method}): {exc}") from exc
    if model is None:
        install_attention_routing()  # no model to lease for: the process holds it
    else:
        bind_routing(model, [c.layer for c in compressed])
    if return_metadata:
        metadata = header.get("metadata", {})
        return caches, dict(metadata) if isinstance(metadata, dict) else {}
    return caches


def _rebuild_foreign(entry: dict[str, Any], state: Any) -> Any:
    """A layer that kept mlx_lm's own cache (e.g. sliding-window layers)."""
    module_name, _, cls_name = entry["class"].partition(":")
    if not module_name.startswith("mlx_lm."):
        raise PromptCacheError(f"refusing to import {entry['class']!r}: only mlx_lm cache "
                               "classes are rebuilt from a file")
    cls = getattr(importlib.import_module(module_name), cls_name, None)
    if not isinstance(cls, type):
        raise PromptCacheError(f"{entry['class']!r} is not a class of {module_name}")
    held = flat_state(state)
    # mlx_lm's KV caches hold [B, heads, tokens, width]; its recurrent layers' states
    # (ArraysCache: convolution and SSM states) other ranks, all of one batch.
    ndims = range(2, 6) if issubclass(cls, ArraysCache) else (4,)
    for name, a in held:
        if a.ndim not in ndims or a.dtype not in STORED_DTYPES \
                or a.shape[0] != held[0][1].shape[0]:
            shape = "[batch, heads, tokens, width]" if ndims == (4,) else "[batch, ...]"
            raise PromptCacheError(f"state entry {name} of {entry['class']!r}: "
                                   f"{tuple(a.shape)} {a.dtype}, expected a "
                                   f"{'/'.join(map(str, ndims))}-D array {shape} of a "
                                   "stored dtype")
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
    if not isinstance(header.get("shard"), (dict, type(None))):
        raise PromptCacheError(f"{str(own)!r}: malformed header (an object with a 'shard' "
                               "object is expected)")
    problem = shard_mismatch(header.get("shard"))
    if problem is not None:
        raise PromptCacheError(f"{str(own)!r}: {problem}")
    return arrays, header


def read_prompt_cache_header(path: str | Path) -> dict[str, Any]:
    """The JSON header of a saved prompt cache (method, config, model, layers, shard), or
    of an at-rest one (format, tokens, bits, ``saved``: method, config, metadata)."""
    rest = at_rest.at_rest_header(path) if Path(path).is_file() else None
    return rest if rest is not None else _read(rank_path(path))[1]


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
