"""Which path attention takes over each kind of stored codes, chosen by measurement.

Per-token affine codes (``"token"``), per-channel codes (``"channel"``: KIVI's keys
stored as K^T) and microscaled float codes (``"float"``: ``nvfp4`` and friends,
``ops.fpcodes``) can be multiplied two ways:

- ``"packed"``: ``mx.quantized_matmul`` on the packed words (a fused kernel on every
  backend; ``transpose=False`` for per-channel keys);
- ``"floats"``: the codes read as float arrays (one per position in a byte), the scales
  applied to the small scores and probabilities, in token blocks of ``BLOCK`` so the
  transient stays a block's size whatever the context.

Which is faster depends on the backend, the width, the group and the side: on this Linux
CPU build the fused kernel multiplies per-token codes fast as values (``p @ V``, the
quantized axis is the output's) and slowly as keys (``q @ K^T`` reduces along it). The
choice is made per *shape class* (kind, bits, group size, head dim, side: ``"key"`` or
``"value"``): measured once on first use on the CPU, and cached on disk with the MLX
version and the device (``~/.cache/veloxquant_mlx/kernels.json``, or
``$VELOXQUANT_CACHE_DIR``; written whole or not at all, and set aside with a warning,
then rebuilt, when it is not a file of choices); ``veloxquant bench
--calibrate-kernels`` measures every class up front and ``--kernels`` prints the table. On a GPU backend the default is the
fused path without measuring (not measured here: no Apple silicon, and MLX's CUDA wheel
does not fit the device machine), unless a calibration run on that machine recorded
otherwise. ``VELOXQUANT_KERNELS=floats|packed`` forces one path everywhere.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from veloxquant_mlx.ops import fpcodes as fp
from veloxquant_mlx.ops import quantize as q
from veloxquant_mlx.ops.files import set_aside, write_text

PATHS = ("floats", "packed")
KINDS = ("token", "channel", "float")
SIDES = ("key", "value")
ENV = "VELOXQUANT_KERNELS"
CACHE_ENV = "VELOXQUANT_CACHE_DIR"
BLOCK = 2048  # tokens the float path decodes at once (1024: 4x the ops at 4k, measured slower)
MEASURE_TOKENS = 4096  # a store long enough that the kernel, not the call, is timed
# Read between two timed calls, so each starts with cold CPU caches as in a model's
# step (whose weights evict the cache): timed warm, the float path's transient stayed in
# cache and won where the fused kernel was faster in the model (measured).
EVICT_BYTES = 64 << 20
ROWS = 4  # query rows per KV head in the measurement (a decode step of grouped heads)
HEADS = 4
# The classes ``--calibrate-kernels`` measures up front (others: on first use);
# per-channel codes hold keys only (KIVI).
DEFAULT_CLASSES = [(kind, bits, group, dim, side) for kind in ("token", "channel")
                   for bits in (2, 4, 8) for group in (32, 64) for dim in (64, 128)
                   for side in (SIDES if kind == "token" else ("key",))]
DEFAULT_CLASSES += [("float", bits, group, dim, side) for bits, group in fp.MODES
                    for dim in (64, 128) for side in SIDES]
Class = tuple[str, int, int, int, str]


@dataclass(frozen=True)
class Choice:
    """The path of one shape class, how it was decided, and the timings (ms)."""

    path: str
    source: str  # "measured", "recorded", "default (not measured)", "forced"
    ms: dict[str, float]


def device_key() -> str:
    """What a measurement holds for: the MLX version, the device type, the machine."""
    return f"mlx-{mx.__version__}-{mx.default_device().type.name}-{platform.machine()}"


def on_gpu() -> bool:
    return mx.default_device().type == mx.DeviceType.gpu


def _cache_file() -> Path:
    root = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "veloxquant_mlx"
    return Path(root) / "kernels.json"


_MEMO: dict[str, Choice] = {}


def _class_key(kind: str, bits: int, group: int, dim: int, side: str) -> str:
    return f"{device_key()}/{kind}:{bits}:{group}:{dim}:{side}"


def _valid_entry(entry: Any) -> bool:
    ms = entry.get("ms", {}) if isinstance(entry, dict) else None
    return (isinstance(entry, dict) and entry.get("path") in PATHS and isinstance(ms, dict)
            and all(isinstance(k, str) and isinstance(v, (int, float))
                    and not isinstance(v, bool) for k, v in ms.items()))


def _load_choices() -> dict[str, Any]:
    """The recorded choices; a file that is not what ``_record`` writes (corrupt JSON, a
    foreign shape) is set aside with one warning and rebuilt, never fatal."""
    path = _cache_file()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return {}  # absent or unreadable: measured again
    try:
        data = json.loads(text)
    except ValueError as exc:
        set_aside(path, f"not valid JSON: {exc}")
        return {}
    if not isinstance(data, dict) or not all(_valid_entry(e) for e in data.values()):
        set_aside(path, "not a JSON object of {class: {path, ms}} kernel choices")
        return {}
    return data


def _recorded(key: str) -> Choice | None:
    entry = _load_choices().get(key)
    if entry is None:
        return None
    return Choice(entry["path"], "recorded", dict(entry.get("ms", {})))


def _record(key: str, choice: Choice) -> None:
    data = _load_choices()
    data[key] = {"path": choice.path, "ms": choice.ms}
    try:
        # Whole or not at all: concurrent processes never read half a file.
        write_text(_cache_file(), json.dumps(data, indent=1, sort_keys=True))
    except OSError:
        pass  # a read-only home: the choice still holds for this process


def forced() -> str | None:
    """The path ``VELOXQUANT_KERNELS`` forces, or None (``auto``)."""
    value = os.environ.get(ENV, "auto")
    if value == "auto":
        return None
    if value not in PATHS:
        raise ValueError(f"{ENV}={value!r}: one of 'auto', {', '.join(map(repr, PATHS))}")
    return value


def choose(kind: str, bits: int, group: int, dim: int, side: str = "key") -> Choice:
    """The path attention takes over codes of this shape class on one side."""
    force = forced()
    if force is not None:
        return Choice(force, "forced", {})
    if side not in SIDES:
        raise ValueError(f"side={side!r}: one of {SIDES}")
    key = _class_key(kind, bits, group, dim, side)
    if key not in _MEMO:
        choice = _recorded(key)
        if choice is None and on_gpu():
            choice = Choice("packed", "default (not measured)", {})
        if choice is None:
            choice = measure(kind, bits, group, dim, side)
            _record(key, choice)
        _MEMO[key] = choice
    return _MEMO[key]


def packed(kind: str, bits: int, group: int, dim: int, side: str = "key") -> bool:
    """Whether codes of this class are multiplied packed (``mx.quantized_matmul``)."""
    return choose(kind, bits, group, dim, side).path == "packed"


def _parts(kind: str, bits: int, group: int, dim: int) -> dict[str, Any]:
    from veloxquant_mlx.ops.parts import Slot

    x = mx.random.normal((1, HEADS, MEASURE_TOKENS, dim), key=mx.random.key(0))
    if kind == "float":
        mode = fp.MODES[bits, group]
        arrays, meta = fp.encode(x, mode).arrays, (mode,)
    else:
        quantize = q.quantize if kind == "token" else q.quantize_tokens
        arrays, meta = quantize(x, bits, group).arrays, (bits, group)
    mx.eval(arrays)
    out = {}
    for path in PATHS:
        slot = Slot(kind, arrays, MEASURE_TOKENS, meta, path == "packed")
        out[path] = [s.part() for s in (slot.blocks(BLOCK) if path == "floats" else [slot])]
    return out


def measure(kind: str, bits: int, group: int, dim: int, side: str = "key",
            repeats: int = 7) -> Choice:
    """Time both paths on a synthetic store (median of ``repeats``, interleaved): the
    key scores or the value product."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: one of {KINDS}")
    if side not in SIDES or (kind == "channel" and side != "key"):
        raise ValueError(f"side={side!r}: one of {SIDES} (per-channel codes hold keys)")
    parts = _parts(kind, bits, group, dim)
    qr = mx.random.normal((1, HEADS, ROWS, dim), key=mx.random.key(1))
    p = mx.random.uniform(shape=(1, HEADS, ROWS, MEASURE_TOKENS), key=mx.random.key(2))

    def step(path: str) -> None:
        outs, start = [], 0
        for part in parts[path]:
            outs.append(part.key_scores(qr) if side == "key"
                        else part.value_product(p[..., start:start + part.n]))
            start += part.n
        mx.eval(outs)

    flush = mx.zeros((EVICT_BYTES // 4,), mx.float32) if not on_gpu() else None
    times: dict[str, list[float]] = {path: [] for path in PATHS}
    for path in PATHS:
        step(path)  # compile and warm up
    for _ in range(repeats):
        for path in PATHS:
            if flush is not None:
                mx.eval(flush.sum())
            t = time.perf_counter()
            step(path)
            times[path].append((time.perf_counter() - t) * 1e3)
    ms = {path: round(statistics.median(v), 4) for path, v in times.items()}
    return Choice(min(ms, key=ms.get), "measured", ms)


def calibrate(classes: list[Class] | None = None) -> list[tuple[Class, Choice]]:
    """Measure every class (default: ``DEFAULT_CLASSES``) now and record the choices."""
    out = []
    for cls in classes or DEFAULT_CLASSES:
        choice = measure(*cls)
        key = _class_key(*cls)
        _record(key, choice)
        _MEMO[key] = choice
        out.append((cls, choice))
    return out


def table(classes: list[Class] | None = None) -> list[tuple[Class, Choice]]:
    """What each class uses now (measuring the ones not decided yet)."""
    return [(cls, choose(*cls)) for cls in classes or DEFAULT_CLASSES]
