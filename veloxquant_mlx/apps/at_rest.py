"""Saved caches at rest: transform-coded, entropy-coded, restored into any method's caches.

A cache at rest needs no random access, only a fast restore, so it is coded as KVTC
(arXiv 2511.01815) codes it: per layer a PCA basis (its KV heads side by side, or one per
head) calibrated once per model (keys before RoPE, which is undone exactly), bits per
coefficient by reverse water-filling on the coefficients' variance to a bits-per-value
budget (0 bits drops a coefficient), a uniform quantizer with a fitted scale per
coefficient, bit-packed codes and zstandard over them. The first ``sinks`` and the last
``window`` tokens are kept in the cache's dtype when it has 16 bits, else (or on request)
in float16 (``ends_dtype``; in the cache's own dtype and a window as long as the history,
the file is lossless). ``load_at_rest`` decodes dense keys and values and
feeds them, chunk by chunk and layer by layer as a prefill does, to fresh caches built
for any ``KVCacheConfig``. See docs/methods/at-rest.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import zstandard
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from veloxquant_mlx.adapter.builder import KVCacheBuilder
from veloxquant_mlx.cache.base import CompressedCache, LayerInfo, code_pending
from veloxquant_mlx.config import KVCacheConfig
from veloxquant_mlx.errors import PromptCacheError
from veloxquant_mlx.ops.files import replacing
from veloxquant_mlx.ops.kernels import CACHE_ENV
from veloxquant_mlx.ops.transform import (
    MAX_BITS,
    allocate_bits,
    dequantize,
    fit_scales,
    pack_codes,
    pca_basis,
    quantize,
    unpack_codes,
)

__all__ = ["AtRestError", "Calibration", "at_rest_header", "calibrate_at_rest",
           "calibration_path", "file_metadata", "load_at_rest", "load_calibration", "model_identity", "read_at_rest",
           "restore_caches", "save_at_rest"]

FORMAT = "veloxquant-at-rest/2"
_KEY = "veloxquant_at_rest"
_KINDS = ("k", "v")
_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
# numpy has no bfloat16: exact tokens of a bfloat16 cache are stored as their bits.
_EXACT_NP = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}
_ZSTD_LEVEL = 3  # zstandard's default: the bit-packed planes barely compress at any level


class AtRestError(PromptCacheError):
    """An at-rest cache file (or its calibration) is corrupt or does not fit the model."""


# ------------------------------------------------------------------ model identity
def model_identity(model: nn.Module) -> str:
    """A short hash of every parameter's name, shape and dtype and of the bytes of the
    first and last parameters: a calibration holds only for the model it came from."""
    h = hashlib.sha256()
    params = sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0])
    for name, a in params:
        h.update(f"{name}:{tuple(a.shape)}:{a.dtype};".encode())
    for _, a in params[:2] + params[-2:]:
        flat = a.reshape(-1)[: 1 << 18]
        h.update(np.asarray(flat.astype(mx.float32) if flat.dtype == mx.bfloat16
                            else flat).tobytes())
    return h.hexdigest()[:20]


def _slots(model: nn.Module) -> list[LayerInfo]:
    infos = KVCacheBuilder.layer_infos(model)
    if not infos or any(i is None for i in infos):
        raise AtRestError("at-rest caches need a model whose every cache slot is a KV "
                          f"cache its attention uses; slots without one: "
                          f"{[n for n, i in enumerate(infos) if i is None]}")
    return infos  # type: ignore[return-value]


def _rope(x: mx.array, info: LayerInfo, offset: int, inverse: bool) -> mx.array:
    """Apply (or undo: a negated scale turns every angle back) the layer's RoPE."""
    if info.rope_dims is None:
        return x  # a rope this module cannot invert: keys are coded as they are held
    scale = -info.rope_scale if inverse else info.rope_scale
    return mx.fast.rope(x, info.rope_dims, traditional=info.rope_traditional,
                        base=info.rope_base, scale=scale, offset=offset)


def _dense(cache: Any, slot: int) -> tuple[mx.array, mx.array]:
    """The keys/values ``[1, H, N, D]`` a layer cache holds, in its dtype."""
    if getattr(getattr(cache, "profile", None), "evicts", False):  # its keys no longer sit at positions 0..N-1
        raise AtRestError(f"layer {slot}: a {type(cache).__name__} has evicted tokens; "
                          "at-rest caches save whole histories (restore into it instead)")
    if hasattr(cache, "keys_and_values"):
        k, v = cache.keys_and_values()
    elif isinstance(getattr(cache, "keys", None), mx.array) and \
            type(cache).__name__ == "KVCache":
        k, v = cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]
    elif isinstance(getattr(cache, "keys", None), mx.array) and \
            type(cache).__name__ == "RotatingKVCache":
        k, v = _ring_tokens(cache, slot)
    else:
        raise AtRestError(f"layer {slot}: a {type(cache).__name__} has no dense keys and "
                          "values to save (expected mlx_lm's KVCache or a veloxquant cache)")
    if k.ndim != 4 or k.shape[0] != 1:
        raise AtRestError(f"layer {slot}: keys of shape {tuple(k.shape)}; at-rest caches "
                          "hold one sequence ([1, heads, tokens, head_dim])")
    if k.dtype not in _DTYPES.values():
        raise AtRestError(f"layer {slot}: keys of dtype {k.dtype}; expected one of "
                          f"{sorted(_DTYPES)}")
    return k, v


def held_layers(caches: list[Any], infos: list[LayerInfo]) -> list[tuple[mx.array, mx.array]]:
    """Per layer the keys/values ``[1, H, n, D]`` a restore needs, oldest first: every
    token of a full-attention layer; of a sliding-window layer of ``W``, the newest
    ``W - 1`` it holds (all a later query can reach besides itself)."""
    out = []
    for slot, (cache, info) in enumerate(zip(caches, infos)):
        k, v = _dense(cache, slot)
        if info.sliding_window is not None and k.shape[2] > info.sliding_window - 1:
            keep = max(info.sliding_window - 1, 1)
            k, v = k[:, :, -keep:], v[:, :, -keep:]
        out.append((k, v))
    return out


def _ring_tokens(cache: Any, slot: int) -> tuple[mx.array, mx.array]:
    """The tokens mlx_lm's sliding-window ring holds, oldest first (the newest ones of
    the history), read from its public state as its own temporal order reads them."""
    keys, values, offset, keep, _, idx = cache.state
    if keep:
        raise AtRestError(f"layer {slot}: a RotatingKVCache that keeps its first {keep} "
                          "tokens; at-rest caches save sliding windows without sinks")

    def ordered(x: mx.array) -> mx.array:
        if idx == x.shape[2]:
            return x
        if idx < offset:
            return mx.concatenate([x[..., idx:, :], x[..., :idx, :]], axis=2)
        return x[..., :idx, :]

    return ordered(keys), ordered(values)


def _spans(held: list[int], sinks: int, window: int) -> list[tuple[int, int, int, int]]:
    """Per layer (tokens held, sinks, window, position of its first token): a layer that
    holds the whole history keeps its first ``sinks`` exact; a sliding-window layer
    holds only the newest tokens, so it has no sinks."""
    n = max(held, default=0)
    out = []
    for h in held:
        start = n - h
        s = min(sinks, h) if start == 0 else 0
        out.append((h, s, min(window, h - s), start))
    return out


def _check_held(held: Any, n: int, infos: list[LayerInfo]) -> list[int]:
    """The header's per-layer token counts (files without one: every layer holds all
    ``n``). Only a sliding-window layer may hold fewer, and never fewer than its window
    less one: restored, the padding before them must stay outside every later window."""
    if held is None:
        return [n] * len(infos)
    if not isinstance(held, list) or len(held) != len(infos) or not all(
            isinstance(h, int) and not isinstance(h, bool) and 0 <= h <= n for h in held):
        raise AtRestError(f"header 'held' {held!r:.120} is not one count in 0..{n} per "
                          f"layer ({len(infos)} layers)")
    for slot, (h, info) in enumerate(zip(held, infos)):
        w = info.sliding_window
        if h < n and (w is None or h < min(n, w - 1)):
            raise AtRestError(f"layer {slot} holds {h} of {n} tokens, but it is "
                              + ("not a sliding-window layer" if w is None else
                                 f"a sliding window of {w}: at least {min(n, w - 1)}"))
    return held


# ------------------------------------------------------------------ calibration
@dataclass
class Calibration:
    """Per slot and kind (``"k"``/``"v"``): mean ``[G, W]`` and basis ``[G, W, W]``, one
    per KV head (G = H, W = D) or one over the layer's heads side by side (G = 1,
    W = H * D)."""

    identity: str
    arrays: dict[str, np.ndarray]

    @property
    def digest(self) -> str:
        crc = 0
        for name in sorted(self.arrays):
            crc = zlib.crc32(name.encode() + self.arrays[name].tobytes(), crc)
        return f"{self.identity}-{crc:08x}"


def calibration_path(model: nn.Module) -> Path:
    """Where this machine keeps the model's calibration (beside the kernel choices)."""
    root = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "veloxquant_mlx"
    return Path(root) / model_identity(model) / "at_rest_calibration.safetensors"


def _groups(x: np.ndarray, g: int) -> np.ndarray:
    """``[H, N, D]`` as ``g`` groups ``[g, N, H * D / g]``: per head, or heads side by side."""
    H, N, D = x.shape
    return x if g == H else x.transpose(1, 0, 2).reshape(1, N, H * D)


def _heads(y: np.ndarray, H: int, D: int) -> np.ndarray:
    """``_groups`` undone: ``[H, N, D]``."""
    return y if y.shape[0] == H else y.reshape(y.shape[1], H, D).transpose(1, 0, 2)


def _calibrate_from(model: nn.Module, layers: list[tuple[mx.array, mx.array]],
                    joint_heads: bool = True) -> Calibration:
    infos = _slots(model)
    arrays: dict[str, np.ndarray] = {}
    n = max((k.shape[2] for k, _ in layers), default=0)
    for slot, ((k, v), info) in enumerate(zip(layers, infos)):
        k = _rope(k, info, n - k.shape[2], inverse=True)  # a ring holds the newest
        for kind, x in zip(_KINDS, (k, v)):
            x = np.asarray(x[0])  # [H, N, D]
            x = _groups(x, 1 if joint_heads else x.shape[0])
            parts = [pca_basis(x[h]) for h in range(x.shape[0])]
            arrays[f"{slot}.{kind}.mean"] = np.stack([p[0] for p in parts])
            arrays[f"{slot}.{kind}.basis"] = np.stack([p[1] for p in parts])
    return Calibration(model_identity(model), arrays)


def calibrate_at_rest(model: nn.Module, tokens: list[int], chunk: int = 512,
                      save: bool = True, joint_heads: bool = True) -> Calibration:
    """PCA bases of the keys (before RoPE) and values ``model`` makes over ``tokens``
    (a short calibration text, a few hundred tokens or more): one basis per layer over
    all its KV heads side by side (``joint_heads``, measured better on SmolLM2) or one
    per head; saved atomically to ``calibration_path(model)`` when ``save``."""
    if len(tokens) < 16:
        raise ValueError(f"calibrate_at_rest: {len(tokens)} tokens; at least 16 expected")
    caches = make_prompt_cache(model)
    for s in range(0, len(tokens), chunk):
        model(mx.array(tokens[s: s + chunk])[None], cache=caches)
        mx.eval([c.state for c in caches])
    cal = _calibrate_from(model, [_dense(c, i) for i, c in enumerate(caches)], joint_heads)
    if save:
        path = calibration_path(model)
        with replacing(path) as tmp:
            mx.save_safetensors(str(tmp), {n: mx.array(a) for n, a in cal.arrays.items()},
                                {_KEY: json.dumps({"identity": cal.identity})})
    return cal


def load_calibration(model: nn.Module) -> Calibration | None:
    """The saved calibration of ``model`` on this machine, or None when there is none."""
    path = calibration_path(model)
    if not path.is_file():
        return None
    try:
        arrays, meta = mx.load(str(path), return_metadata=True)
        identity = json.loads(meta[_KEY])["identity"]
    except Exception as exc:  # a corrupt file: named, with where it is
        raise AtRestError(f"calibration {str(path)!r} is unreadable ({exc}); delete it "
                          "to calibrate again") from exc
    if identity != model_identity(model):
        raise AtRestError(f"calibration {str(path)!r} is for model {identity}, not "
                          f"{model_identity(model)}")
    return Calibration(identity, {n: np.asarray(a) for n, a in arrays.items()})


def _check_calibration(cal: Calibration, infos: list[LayerInfo]) -> None:
    """Every slot's bases fit its heads: ``[G, W, W]`` with G = H (per head) or 1."""
    for slot, info in enumerate(infos):
        for kind, D in zip(_KINDS, (info.head_dim, info.v_head_dim)):
            H = info.n_kv_heads
            basis, mean = cal.arrays.get(f"{slot}.{kind}.basis"), cal.arrays.get(f"{slot}.{kind}.mean")
            ok = [(H, D, D), (1, H * D, H * D)]
            if basis is None or mean is None or basis.shape not in ok or \
                    mean.shape != basis.shape[:2]:
                raise AtRestError(f"calibration {cal.identity}: layer {slot} {kind} basis is "
                                  f"{None if basis is None else basis.shape}; expected one of "
                                  f"{ok} with a matching mean")


# ------------------------------------------------------------------ encoding
def _encode_kind(x: np.ndarray, mean: np.ndarray, basis: np.ndarray,
                 bits: float) -> tuple[dict[str, np.ndarray], int]:
    """Codes of a body ``[H, N, D]``: per group its coefficients, one bit allocation over
    all groups' coefficients; returns the arrays and the raw code bytes."""
    x = _groups(x, basis.shape[0])
    H, N, D = x.shape  # groups, tokens, group width from here on
    coeffs = [(x[h] - mean[h]) @ basis[h] for h in range(H)]
    # The calibration's mean is not this history's: centre each coefficient on its own.
    center = np.stack([c.mean(axis=0) if N else np.zeros(D) for c in coeffs]).astype(np.float32)
    coeffs = [c - center[h] for h, c in enumerate(coeffs)]
    std = np.stack([c.std(axis=0) if N else np.zeros(D) for c in coeffs]).astype(np.float32)
    alloc = allocate_bits(std.reshape(-1) ** 2, int(round(bits * H * D))).reshape(H, D)
    # Stored as "std": the scale the quantizer's step is a multiple of (fitted per column).
    std = np.stack([fit_scales(coeffs[h], alloc[h], std[h]) for h in range(H)])
    codes = np.concatenate([quantize(coeffs[h], alloc[h], std[h]) for h in range(H)])
    raw = pack_codes(codes, alloc[alloc > 0])
    blob = zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(raw.tobytes())
    return {"bits": alloc.astype(np.uint8), "std": std, "center": center,
            "codes": np.frombuffer(blob, dtype=np.uint8)}, raw.size


def _exact(x: mx.array, dtype: str) -> np.ndarray:
    """Tokens kept exactly: ``x`` (float32, upcast from ``dtype``) back in ``dtype``."""
    x = x.astype(_DTYPES[dtype])
    return np.asarray(x.view(mx.uint16) if dtype == "bfloat16" else x)


def _from_exact(a: np.ndarray, dtype: str) -> mx.array:
    x = mx.array(a)
    return (x.view(mx.bfloat16) if dtype == "bfloat16" else x).astype(mx.float32)


def _encode_layer(k: mx.array, v: mx.array, info: LayerInfo, slot: int, cal: Calibration,
                  bits: float, span: tuple[int, int, int, int],
                  dtype: str) -> dict[str, np.ndarray]:
    N, s, w, start = span
    out: dict[str, np.ndarray] = {}
    for kind, x in zip(_KINDS, (k, v)):
        out[f"{slot}.{kind}.sinks"] = _exact(x[0, :, :s], dtype)
        out[f"{slot}.{kind}.window"] = _exact(x[0, :, N - w:], dtype)
        body = x[:, :, s: N - w]
        if kind == "k":
            body = _rope(body, info, start + s, inverse=True)
        arrays, _ = _encode_kind(np.asarray(body[0]), cal.arrays[f"{slot}.{kind}.mean"],
                                 cal.arrays[f"{slot}.{kind}.basis"], bits)
        out.update({f"{slot}.{kind}.{n}": a for n, a in arrays.items()})
    return out


def save_at_rest(path: str | Path, model: nn.Module, caches: list[Any], bits: float = 1.0,
                 sinks: int = 4, window: int = 128,
                 calibration: Calibration | None = None,
                 saved: dict[str, Any] | None = None,
                 ends_dtype: str | None = None) -> dict[str, Any]:
    """Write ``caches`` (one sequence, any method's) to ``path`` in the at-rest format.

    ``bits`` is the budget in bits per coded value (tokens between the sinks and the
    window); ``calibration`` defaults to the model's saved one, else one made from these
    caches (and saved); ``saved`` goes into the header as it is (``save_prompt_cache``'s
    method, config and metadata); ``ends_dtype``: the dtype of the sinks and the window
    (default: the cache's when it has 16 bits, else float16). Returns stats: tokens, bytes on disk, fp16 bytes,
    ratio, seconds.
    """
    if not 0 <= bits <= MAX_BITS or sinks < 0 or window < 0:
        raise ValueError(f"save_at_rest: bits {bits} must be in 0..{MAX_BITS}, sinks {sinks} "
                         f"and window {window} >= 0")
    t0 = time.perf_counter()
    infos = _slots(model)
    if len(caches) != len(infos):
        raise AtRestError(f"{len(caches)} caches for a model with {len(infos)} cache slots")
    dense = held_layers(caches, infos)
    dtype = str(dense[0][0].dtype).split(".")[-1] if dense else "float32"
    ends = ends_dtype or (dtype if dtype != "float32" else "float16")
    if ends not in _DTYPES:
        raise ValueError(f"save_at_rest: ends_dtype {ends!r} is not one of {sorted(_DTYPES)}")
    dense = [(k.astype(mx.float32), v.astype(mx.float32)) for k, v in dense]
    held = [k.shape[2] for k, _ in dense]
    n = max(held, default=0)
    _check_held(held, n, infos)  # only sliding-window layers hold fewer tokens
    cal = calibration or load_calibration(model)
    if cal is None:
        cal = _calibrate_from(model, dense)
        with replacing(calibration_path(model)) as tmp:
            mx.save_safetensors(str(tmp), {m: mx.array(a) for m, a in cal.arrays.items()},
                                {_KEY: json.dumps({"identity": cal.identity})})
    _check_calibration(cal, infos)
    arrays: dict[str, np.ndarray] = {}
    for slot, ((k, v), info, span) in enumerate(zip(dense, infos,
                                                     _spans(held, sinks, window))):
        arrays.update(_encode_layer(k, v, info, slot, cal, bits, span, ends))
    header = {"format": FORMAT, "identity": model_identity(model),
              "calibration": cal.digest, "tokens": n, "held": held, "sinks": sinks,
              "window": window,
              "bits": bits, "dtype": dtype, "ends_dtype": ends, "shapes": [[i.n_kv_heads, i.head_dim, i.v_head_dim] for i in infos],
              "crc": {m: zlib.crc32(a.tobytes()) for m, a in arrays.items()},
              "saved": dict(saved or {})}
    with replacing(path) as tmp:
        mx.save_safetensors(str(tmp), {m: mx.array(a) for m, a in arrays.items()},
                            {_KEY: json.dumps(header)})
    size = Path(path).stat().st_size
    fp16 = sum(2 * (k.size + v.size) for k, v in dense)
    return {"tokens": n, "bytes": size, "fp16_bytes": fp16, "ratio": fp16 / max(size, 1),
            "bits_per_value_on_disk": 8 * size / max(fp16 // 2, 1),
            "seconds": time.perf_counter() - t0}


# ------------------------------------------------------------------ reading
_HEADER_LIMIT = 1 << 26  # a safetensors header past 64 MiB is not one this library wrote


def file_metadata(path: str | Path) -> dict[str, str]:
    """A safetensors file's ``__metadata__``, read from its header alone; {} when the
    file is not a readable safetensors file (its own reader then names what is wrong)."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 0 < size <= _HEADER_LIMIT:
                return {}
            meta = json.loads(f.read(size)).get("__metadata__")
    except (OSError, ValueError, AttributeError, RecursionError):
        return {}
    return meta if isinstance(meta, dict) else {}


def at_rest_header(path: str | Path) -> dict[str, Any] | None:
    """The header of an at-rest file; None when ``path`` is not one."""
    raw = file_metadata(path).get(_KEY)
    if raw is None:
        return None
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise AtRestError(f"{str(path)!r}: corrupt at-rest header ({exc!r:.80})") from exc
    if not isinstance(header, dict):
        raise AtRestError(f"{str(path)!r}: corrupt at-rest header (a JSON object is expected)")
    return header


def _read(path: str | Path, model: nn.Module,
          cal: Calibration) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    path = str(path)
    if not Path(path).is_file():
        raise FileNotFoundError(f"at-rest cache file {path!r} does not exist")
    try:
        loaded, meta = mx.load(path, return_metadata=True)
        header = json.loads(meta[_KEY])
    except Exception as exc:  # mlx raises RuntimeError/ValueError on bad files
        raise AtRestError(f"{path!r} is not a readable at-rest cache (truncated, corrupt "
                          f"or another kind of file): {exc!r:.200}") from exc
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise AtRestError(f"{path!r}: format {header.get('format') if isinstance(header, dict) else header!r:.60} "
                          f"is not {FORMAT!r}")
    if header.get("identity") != model_identity(model):
        raise AtRestError(f"{path!r} was saved from model {header.get('identity')!r}, not "
                          f"this one ({model_identity(model)})")
    if header.get("calibration") != cal.digest:
        raise AtRestError(f"{path!r} was coded with calibration {header.get('calibration')!r}; "
                          f"this machine has {cal.digest!r} (copy the model's "
                          "at_rest_calibration.safetensors with the file)")
    arrays = {n: np.asarray(a) for n, a in loaded.items()}
    crc = header.get("crc")
    if not isinstance(crc, dict) or set(crc) != set(arrays):
        raise AtRestError(f"{path!r}: the arrays in the file are not those its header lists")
    for name, a in arrays.items():
        if zlib.crc32(a.tobytes()) != crc[name]:
            raise AtRestError(f"{path!r}: array {name!r} is corrupt (checksum mismatch)")
    return arrays, header


def _expect(arrays: dict[str, np.ndarray], name: str, shape: tuple[int, ...],
            dtype: Any) -> np.ndarray:
    a = arrays.get(name)
    if a is None or a.shape != shape or a.dtype != np.dtype(dtype):
        got = "missing" if a is None else f"{a.shape} {a.dtype}"
        raise AtRestError(f"array {name!r} is {got}; expected {shape} {np.dtype(dtype)}")
    return a


def _check_header(header: dict[str, Any], infos: list[LayerInfo],
                  limit: int) -> list[tuple[int, int, int, int]]:
    n, s, w = header.get("tokens"), header.get("sinks"), header.get("window")
    if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 31
               for x in (n, s, w)):
        raise AtRestError(f"header tokens/sinks/window {n!r}/{s!r}/{w!r} are not "
                          "non-negative integers")
    shapes = [[i.n_kv_heads, i.head_dim, i.v_head_dim] for i in infos]
    if header.get("shapes") != shapes:
        raise AtRestError(f"header layer shapes {header.get('shapes')!r:.120} do not match "
                          f"the model's {shapes!r:.120}")
    if n > limit:  # a forged count would make the restore allocate without bound
        raise AtRestError(f"header says {n} tokens; this model takes at most {limit}")
    held = _check_held(header.get("held"), n, infos)
    spans = _spans(held, s, w)
    if held and max(held) != n:
        raise AtRestError(f"header says {n} tokens but its layers hold at most {max(held)}")
    return spans


def _max_tokens(model: nn.Module) -> int:
    """The model's context length where its config states one, else 2**20 tokens."""
    args = getattr(model, "args", None)
    n = getattr(args, "max_position_embeddings", None) or \
        getattr(getattr(args, "text_config", None), "max_position_embeddings", None)
    return int(n) if isinstance(n, int) and n > 0 else 1 << 20


def _decode_kind(arrays: dict[str, np.ndarray], cal: Calibration, pre: str, H: int, D: int,
                 nb: int) -> np.ndarray:
    """The body ``[H, nb, D]`` of one kind of one layer from its codes."""
    out_heads = (H, D)
    mean, basis = cal.arrays[f"{pre}.mean"], cal.arrays[f"{pre}.basis"]
    H, D = basis.shape[:2]  # the calibration's groups and their width
    bits = _expect(arrays, f"{pre}.bits", (H, D), np.uint8)
    std = _expect(arrays, f"{pre}.std", (H, D), np.float32)
    center = _expect(arrays, f"{pre}.center", (H, D), np.float32)
    if bits.max(initial=0) > MAX_BITS or not (np.isfinite(std).all() and
                                              np.isfinite(center).all()):
        raise AtRestError(f"{pre}: bits above {MAX_BITS} or non-finite scales")
    blob = arrays.get(f"{pre}.codes")
    if blob is None or blob.dtype != np.uint8 or blob.ndim != 1:
        raise AtRestError(f"array {pre}.codes is missing or not a uint8 byte string")
    want = int(bits.astype(np.int64).sum()) * ((nb + 7) // 8)
    try:
        raw = zstandard.ZstdDecompressor().decompress(blob.tobytes(), max_output_size=want)
    except zstandard.ZstdError as exc:
        raise AtRestError(f"{pre}.codes: corrupt compressed codes ({exc})") from exc
    if len(raw) != want:
        raise AtRestError(f"{pre}.codes: {len(raw)} code bytes, expected {want}")
    widths = bits[bits > 0].astype(np.int64)
    codes = unpack_codes(np.frombuffer(raw, dtype=np.uint8).reshape(int(widths.sum()),
                                                                     (nb + 7) // 8),
                         widths, nb)
    out, at = np.empty((H, nb, D), dtype=np.float32), 0
    for h in range(H):
        k = int((bits[h] > 0).sum())
        c = dequantize(codes[at: at + k], bits[h], std[h], nb)
        at += k
        out[h] = (c + center[h]) @ basis[h].T + mean[h]
    return _heads(out, *out_heads)


def _decode_layer(arrays: dict[str, np.ndarray], cal: Calibration, slot: int, info: LayerInfo,
                  span: tuple[int, int, int, int], dtype: str) -> list[mx.array]:
    n, s, w, start = span
    out = []
    for kind, D in zip(_KINDS, (info.head_dim, info.v_head_dim)):
        pre, H = f"{slot}.{kind}", info.n_kv_heads
        sinks = _expect(arrays, f"{pre}.sinks", (H, s, D), _EXACT_NP[dtype])
        win = _expect(arrays, f"{pre}.window", (H, w, D), _EXACT_NP[dtype])
        body = mx.array(_decode_kind(arrays, cal, pre, H, D, n - s - w))[None]
        if kind == "k":
            body = _rope(body, info, start + s, inverse=False)
        out.append(mx.concatenate([_from_exact(sinks, dtype)[None], body,
                                   _from_exact(win, dtype)[None]], axis=2))
    return out


def read_at_rest(path: str | Path, model: nn.Module,
                 calibration: Calibration | None = None) -> list[tuple[mx.array, mx.array]]:
    """The dense keys/values ``[1, H, N, D]`` per layer of an at-rest file, in its dtype."""
    peek = at_rest_header(path) if Path(path).is_file() else None
    if peek is not None and peek.get("identity") != model_identity(model):
        # Named before any calibration is looked for: the model is what is wrong.
        raise AtRestError(f"{str(path)!r} was saved from model {peek.get('identity')!r}, "
                          f"not this one ({model_identity(model)})")
    cal = calibration or load_calibration(model)
    if cal is None:
        raise AtRestError(f"no at-rest calibration for this model at "
                          f"{str(calibration_path(model))!r}; copy it with the file")
    infos = _slots(model)
    _check_calibration(cal, infos)
    arrays, header = _read(path, model, cal)
    spans = _check_header(header, infos, _max_tokens(model))
    name, ends = header.get("dtype"), header.get("ends_dtype")
    if name not in _DTYPES or ends not in _DTYPES:
        raise AtRestError(f"{str(path)!r}: cache dtype {name!r:.40} or ends dtype "
                          f"{ends!r:.40} is not one of {sorted(_DTYPES)}")
    try:
        return [tuple(x.astype(_DTYPES[name]) for x in
                      _decode_layer(arrays, cal, i, info, span, ends))
                for i, (info, span) in enumerate(zip(infos, spans))]  # type: ignore[misc]
    except AtRestError as exc:
        raise AtRestError(f"{str(path)!r}: {exc}") from exc


def restore_caches(model: nn.Module, layers: list[tuple[mx.array, mx.array]],
                   config: KVCacheConfig | None = None, chunk: int = 512) -> list[Any]:
    """Fresh caches for ``config`` (None: mlx_lm's own) fed ``layers``' keys/values
    chunk by chunk, every layer per chunk in model order, as a prefill feeds them."""
    caches = make_prompt_cache(model) if config is None else \
        KVCacheBuilder.for_model(model, config)
    for i, cache in enumerate(caches):
        if getattr(getattr(cache, "profile", None), "hooks_module", False):
            KVCacheBuilder.detach(model)
            raise AtRestError(f"layer {i}: method {cache.method!r} caches the layer's input, "
                              "not its keys and values: it cannot be restored from keys and "
                              "values (prefill the history again)")
    n = max((k.shape[2] for k, _ in layers), default=0)
    for s in range(0, n, chunk):
        for cache, (k, v) in zip(caches, layers):
            cache.update_and_fetch(*(_span_of(x, n, s, min(s + chunk, n)) for x in (k, v)))
        mx.eval([c.state for c in caches])
    for cache in caches:
        # No attention ran here, so code the last chunk now (``code_pending``), or it
        # would sit in full precision.
        if isinstance(cache, CompressedCache):
            code_pending(cache)
    mx.eval([c.state for c in caches])
    return caches


def _span_of(x: mx.array, n: int, a: int, b: int) -> mx.array:
    """Positions ``a..b-1`` of a layer holding the newest ``x.shape[2]`` of ``n`` tokens.
    A sliding-window layer's older positions are padded with its oldest token: its ring
    drops them, and no later window reaches them (finite, so a masked score times it
    stays 0)."""
    start = n - x.shape[2]
    if a >= start:
        return x[:, :, a - start: b - start]
    pad = mx.repeat(x[:, :, :1], min(b, start) - a, axis=2)
    return pad if b <= start else mx.concatenate([pad, x[:, :, : b - start]], axis=2)


def load_at_rest(path: str | Path, model: nn.Module, config: KVCacheConfig | None = None,
                 calibration: Calibration | None = None, chunk: int = 512) -> list[Any]:
    """Caches of ``config``'s method (None: mlx_lm's ``KVCache``) holding the history of
    an at-rest file, as if prefilled from its decoded keys/values."""
    return restore_caches(model, read_at_rest(path, model, calibration), config, chunk)
