"""Reading GGUF files: the header, the tensor table and every tensor type the
converter takes.

Files whose tensors are all F32/F16/Q4_0/Q4_1/Q8_0 are read with ``mx.load`` (the
quantized ones come back as MLX affine quantized triples). Other files (K-quants,
BF16, Q5_0/Q5_1) are read here: a small header scan locates each tensor and the
``gguf`` package (llama.cpp's gguf-py) dequantizes its blocks. ``mx.load`` must not
see those files: it returns Q4_K wrong without an error, and Q6_K/BF16 as float16.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

import mlx.core as mx
import numpy as np

from veloxquant_mlx.errors import GGUFError

DTYPES = ("float32", "float16", "bfloat16", "keep")
TRIPLE = ("weight", "scales", "biases")


def scalar(v: Any) -> Any:
    """A metadata scalar as a Python value (they come back as 0-d mx.arrays)."""
    return v.item() if isinstance(v, mx.array) and v.ndim == 0 else v


# Metadata numbers the converter takes (sizes, ids, counts) fit mlx_lm's int32 config.
_MAX_INT = (1 << 31) - 1


class Metadata(dict):
    """A GGUF file's metadata (a plain dict to its users) that knows the file, so
    that errors about its values can name it."""

    path: str = ""


def where(meta: dict[str, Any]) -> str:
    """``GGUF 'file'`` for metadata read from a file, else ``GGUF``."""
    path = getattr(meta, "path", "")
    return f"GGUF {path!r}" if path else "GGUF"


def _shown(v: Any) -> str:
    text = repr(v.tolist() if isinstance(v, mx.array) else v)
    return text if len(text) <= 60 else text[:57] + "..."


def _bad(meta: dict[str, Any], key: str, v: Any, expected: str) -> GGUFError:
    kind = "array" if isinstance(v, (list, mx.array)) else type(v).__name__
    return GGUFError(f"{where(meta)}: metadata {key}={_shown(v)} ({kind}); expected {expected}")


def meta_int(meta: dict[str, Any], key: str, default: Any = ..., lo: int = 0,
             hi: int = _MAX_INT) -> Any:
    """``meta[key]`` as an int in ``lo..hi``; ``default`` when absent (GGUFError if none)."""
    v = scalar(meta.get(key))
    if v is None:
        if default is ...:
            raise GGUFError(f"{where(meta)}: metadata lacks {key!r}, an integer the "
                            "conversion needs")
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(meta, key, v, "an integer")
    if not lo <= v <= hi:
        raise _bad(meta, key, v, f"an integer from {lo} to {hi}")
    return v


def meta_float(meta: dict[str, Any], key: str, default: Any = ...) -> Any:
    """``meta[key]`` as a finite float; ``default`` when absent (GGUFError if none)."""
    v = scalar(meta.get(key))
    if v is None:
        if default is ...:
            raise GGUFError(f"{where(meta)}: metadata lacks {key!r}, a number the "
                            "conversion needs")
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _bad(meta, key, v, "a finite number")
    return float(v)


def meta_str(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    """``meta[key]`` as a string; ``default`` when absent."""
    v = meta.get(key)
    if v is None:
        return default
    if not isinstance(v, str):
        raise _bad(meta, key, v, "a string")
    return v


def meta_bool(meta: dict[str, Any], key: str, default: bool) -> bool:
    """``meta[key]`` as a bool (GGUF bools; 0/1 integers are taken too)."""
    v = scalar(meta.get(key))
    if v is None:
        return default
    if isinstance(v, bool) or (isinstance(v, int) and v in (0, 1)):
        return bool(v)
    raise _bad(meta, key, v, "a bool")


def meta_strings(meta: dict[str, Any], key: str) -> list[str] | None:
    """``meta[key]`` as a list of strings; None when absent."""
    v = meta.get(key)
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(t, str) for t in v):
        raise _bad(meta, key, v, "an array of strings")
    return v


def meta_numbers(meta: dict[str, Any], key: str, n: int) -> list[float] | None:
    """``meta[key]`` as ``n`` finite numbers; None when absent."""
    v = meta.get(key)
    if v is None:
        return None
    if not isinstance(v, mx.array) or v.ndim != 1 or v.shape[0] != n or v.dtype == mx.bool_:
        raise _bad(meta, key, v, f"an array of {n} numbers")
    out = v.astype(mx.float32).tolist()
    if not all(math.isfinite(x) for x in out):
        raise _bad(meta, key, v, f"an array of {n} finite numbers")
    return out


def check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not allowed: one of {', '.join(DTYPES)}")



# GGML tensor types this loader reads: id -> (name, elements per block, bytes per block).
_GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    30: ("BF16", 1, 2),
}
SUPPORTED_TYPES = tuple(name for name, _, _ in _GGML_TYPES.values())
# Types mx.load decodes exactly; a file with only these keeps the mx.load path.
_MX_NATIVE = frozenset({"F32", "F16", "Q4_0", "Q4_1", "Q8_0"})
# Block types that are an affine grid per 32 weights (scale * code + bias), so they
# become MLX quantized triples without loss: name -> bits.
_AFFINE_BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8, "Q4_K": 4, "Q5_K": 5}
# Q6_K has one scale per 16 weights, finer than MLX's smallest group (32); "keep"
# re-quantizes it to 8 bits, which adds about 0.7 % RMS weight error (6-bit would add 2 %).
_Q6K_KEEP = {"group_size": 64, "bits": 8}

_GGUF_MAGIC = b"GGUF"
# GGUF metadata value types: id -> struct format (8 = string and 9 = array are special).
_SCALAR_FMT = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
    10: "<Q", 11: "<q", 12: "<d",
}  # fmt: skip
_NP_TYPES = {
    0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
    6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float32,
}  # fmt: skip


@dataclass(frozen=True)
class TensorInfo:
    """One tensor entry of a GGUF header."""

    name: str
    type_id: int
    shape: tuple[int, ...]  # numpy order: rows first, the contiguous axis last
    offset: int  # absolute byte offset in the file

    @property
    def type_name(self) -> str:
        if self.type_id in _GGML_TYPES:
            return _GGML_TYPES[self.type_id][0]
        try:
            from gguf import GGMLQuantizationType

            return GGMLQuantizationType(self.type_id).name
        except (ImportError, ValueError):
            return f"unknown type id {self.type_id}"

    def n_bytes(self) -> int:
        _, block, size = _GGML_TYPES[self.type_id]
        # Python ints: a header's dims must not wrap around as np.prod's int64 does.
        return math.prod(self.shape) // block * size


# GGML tensors have at most 4 dims; MLX's dims are int32; an element count past
# 2**56 is no real file's.
_MAX_DIMS, _MAX_DIM, _MAX_ELEMENTS = 4, (1 << 31) - 1, 1 << 56
# Smallest bytes of one metadata entry (key length, type id, one value byte) and of
# one tensor entry (name length, dims count, one dim, type, offset): a count that
# cannot fit in what is left of the file is refused before anything is allocated.
_MIN_KV, _MIN_TENSOR = 8 + 4 + 1, 8 + 4 + 8 + 4 + 8


class _Header:
    """Sequential reader of the GGUF header (little-endian, versions 2 and 3).

    ``where`` names the entry being read, for the errors; ``mx_load_unsafe`` says why
    ``mx.load`` must not read this file (it crashes on float64 values and raises on
    strings that are not UTF-8), empty when it may.
    """

    def __init__(self, buf: mmap.mmap, path: str) -> None:
        self.buf, self.pos, self.path = buf, 0, path
        self.where, self.mx_load_unsafe = "the header", ""

    def error(self, what: str) -> GGUFError:
        return GGUFError(f"GGUF {self.path!r}: {self.where}: {what}")

    def left(self) -> int:
        return len(self.buf) - self.pos

    def unpack(self, fmt: str) -> Any:
        try:
            (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error:
            raise self.error("the file is truncated (header ends early)") from None
        self.pos += struct.calcsize(fmt)
        return v

    def count(self, what: str, min_size: int) -> int:
        """A count of ``what`` entries of at least ``min_size`` bytes that must fit."""
        n = self.unpack("<Q")
        if n * min_size > self.left():
            raise self.error(f"claims {n} {what}, more than the {self.left()} bytes left in "
                             "the file can hold (truncated or corrupt header)")
        return n

    def string(self) -> str:
        n = self.count("string bytes", 1)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            self.mx_load_unsafe = "a string that is not UTF-8"
            return raw.decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind == 8:
            return self.string()
        if kind in _SCALAR_FMT:
            if kind == 12:
                self.mx_load_unsafe = "a float64 value"
            return self.unpack(_SCALAR_FMT[kind])
        if kind != 9:
            raise self.error(f"value of unknown type {kind}; known: 0-12 (GGUF's value types)")
        item = self.unpack("<I")
        if item == 9:
            raise self.error("an array of arrays, which no supported model's metadata uses")
        if item != 8 and item not in _SCALAR_FMT:
            raise self.error(f"array of unknown item type {item}; known: 0-8, 10-12")
        if item == 12:
            self.mx_load_unsafe = "a float64 value"
        size = np.dtype(_SCALAR_FMT[item]).itemsize if item in _SCALAR_FMT else 8
        n = self.count("array items", size)
        if item == 8:
            return [self.string() for _ in range(n)]
        # Numeric arrays come back as mx.arrays, as mx.load returns them.
        dt = np.dtype(_SCALAR_FMT[item])
        end = self.pos + n * dt.itemsize
        # A copy: a view would keep the mmap from closing.
        a = np.frombuffer(self.buf[self.pos : end], dtype=dt)
        self.pos = end
        with np.errstate(over="ignore"):  # float64 values past float32 become inf
            return mx.array(a.astype(_NP_TYPES[item]))

    def metadata(self, n_kv: int) -> Metadata:
        meta = Metadata()
        meta.path = self.path
        for i in range(n_kv):
            self.where = f"metadata entry {i}"
            key = self.string()
            self.where = f"metadata key {key!r}"
            if key in meta:
                raise self.error("appears twice")
            meta[key] = self.value(self.unpack("<I"))
        return meta

    def tensor(self, i: int) -> tuple[str, int, tuple[int, ...], int]:
        self.where = f"tensor entry {i}"
        name = self.string()
        self.where = f"tensor {name!r}"
        n_dims = self.unpack("<I")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise self.error(f"has {n_dims} dimensions; GGML tensors have 1 to {_MAX_DIMS}")
        dims = tuple(self.unpack("<Q") for _ in range(n_dims))
        if not 1 <= min(dims) <= max(dims) <= _MAX_DIM or math.prod(dims) > _MAX_ELEMENTS:
            raise self.error(f"has dims {list(dims)}; expected each from 1 to {_MAX_DIM} and "
                             f"at most {_MAX_ELEMENTS} elements in all")
        type_id, offset = self.unpack("<I"), self.unpack("<Q")
        return name, type_id, tuple(reversed(dims)), offset


def _alignment(meta: dict[str, Any], path: str) -> int:
    align = meta.get("general.alignment", 32)
    if isinstance(align, bool) or not isinstance(align, int) or align < 1 or align & (align - 1):
        raise GGUFError(f"GGUF {path!r}: general.alignment={align!r}; expected a power of "
                        "two (an integer; 32 when absent)")
    return align


def _check_tensors(infos: list[TensorInfo], size: int, path: str) -> None:
    """Each tensor's data is aligned, inside the file, and its name is its own."""
    names: set[str] = set()
    for info in infos:
        if info.name in names:
            raise GGUFError(f"GGUF {path!r}: tensor {info.name!r} appears twice")
        names.add(info.name)
        if info.type_id in _GGML_TYPES and info.offset + info.n_bytes() > size:
            raise GGUFError(
                f"GGUF {path!r} is truncated (tensor {info.name!r}: {info.n_bytes()} bytes at "
                f"offset {info.offset}, the file has {size})"
            )


def scan_gguf(path: str | os.PathLike) -> tuple[dict[str, Any], list[TensorInfo]]:
    """Metadata and tensor table of a GGUF file, without reading any tensor data.

    Metadata scalars are Python values, numeric arrays ``mx.array``, string arrays
    lists. Takes about 0.1 s where ``gguf.GGUFReader`` takes 7 s (49k-token vocab).
    A malformed header (counts that do not fit, unknown types, arrays of arrays, dims
    past 4 or 2**56 elements, bad alignment, tensors outside the file) is a GGUFError
    naming the file and the entry.
    """
    meta, infos, _ = _scan(path)
    return meta, infos


def _scan(path: str | os.PathLike) -> tuple[dict[str, Any], list[TensorInfo], str]:
    """``scan_gguf``, and why ``mx.load`` must not read the file (empty: it may)."""
    with open(path, "rb") as f:
        if f.read(4) != _GGUF_MAGIC:
            raise GGUFError(f"{str(path)!r} is not a GGUF file (no GGUF magic)")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    with buf:
        h = _Header(buf, str(path))
        h.pos = 4
        version = h.unpack("<I")
        if version not in (2, 3):
            raise GGUFError(
                f"GGUF {str(path)!r} has version {version}; only little-endian versions "
                "2 and 3 are supported"
            )
        n_tensors, n_kv = h.count("tensors", _MIN_TENSOR), h.count("metadata entries", _MIN_KV)
        meta = h.metadata(n_kv)
        raw = [h.tensor(i) for i in range(n_tensors)]
        align = _alignment(meta, str(path))
        start = -(-h.pos // align) * align
        size = len(buf)
    for name, _, _, off in raw:
        if off % align:
            raise GGUFError(f"GGUF {str(path)!r}: tensor {name!r} starts at data offset "
                            f"{off}, not a multiple of the alignment {align}")
    infos = [TensorInfo(n, t, shape, start + off) for n, t, shape, off in raw]
    _check_tensors(infos, size, str(path))
    return meta, infos, h.mx_load_unsafe


def check_types(infos: list[TensorInfo], path: str) -> None:
    bad = [i for i in infos if i.type_id not in _GGML_TYPES]
    if bad:
        more = f" (and {len(bad) - 1} more tensors of unsupported types)" if len(bad) > 1 else ""
        raise GGUFError(
            f"GGUF {path!r}: tensor {bad[0].name!r} has type {bad[0].type_name}, which "
            f"this loader cannot read{more}; supported types: {', '.join(SUPPORTED_TYPES)}"
        )
    for i in infos:
        block = _GGML_TYPES[i.type_id][1]
        if i.shape and i.shape[-1] % block:
            raise GGUFError(
                f"GGUF {path!r}: tensor {i.name!r} ({i.type_name}) has rows of "
                f"{i.shape[-1]} values, not a multiple of its block size {block}"
            )


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit sub-block scales and mins of Q4_K/Q5_K blocks ``(n, 12)`` bytes."""
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    # Sub-blocks 0-3 sit in the low 6 bits of a (scales) and b (mins); 4-7 take their
    # low 4 bits from c and their top 2 bits from the spare top bits of a and b.
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _affine_grid(kind: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Scale and bias of every 32-weight group, in order, from the block headers."""

    def f16(at: int) -> np.ndarray:
        return blocks[:, at : at + 2].copy().view(np.float16)[:, 0].astype(np.float32)

    if kind in ("Q4_K", "Q5_K"):
        sc, mn = _k_scales(blocks[:, 4:16])
        return (f16(0)[:, None] * sc).ravel(), (-f16(2)[:, None] * mn).ravel()
    d = f16(0)
    if kind in ("Q4_1", "Q5_1"):
        return d, f16(2)
    # Symmetric types store code - offset: Q4_0 (0..15) - 8, Q5_0 - 16, Q8_0 int8.
    return d, -{"Q4_0": 8.0, "Q5_0": 16.0, "Q8_0": 128.0}[kind] * d


def _pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """MLX's affine layout: codes as one little-endian bit stream, read as uint32."""
    rows, cols = codes.shape
    c = codes.reshape(rows, cols // 32, 32).astype(np.uint32)
    words = np.zeros((rows, cols // 32, bits), dtype=np.uint32)
    for i in range(32):
        word, shift = divmod(i * bits, 32)
        # uint32 shifts drop the bits that spill over; those go to the next word.
        words[:, :, word] |= c[:, :, i] << np.uint32(shift)
        if shift + bits > 32:
            words[:, :, word + 1] |= c[:, :, i] >> np.uint32(32 - shift)
    return words.reshape(rows, cols // 32 * bits)


def _to_affine(info: TensorInfo, blocks: np.ndarray, values: np.ndarray) -> list[np.ndarray]:
    """Exact MLX (weight, scales, biases) of rows of an affine block type (groups of 32)."""
    bits = _AFFINE_BITS[info.type_name]
    block_bytes = _GGML_TYPES[info.type_id][2]
    rows, cols = values.shape
    v = values.reshape(-1, 32)
    # Corrupt blocks may hold inf/NaN scales: they fail the check below, not warn.
    with np.errstate(all="ignore"):
        scale, bias = _affine_grid(info.type_name, blocks.reshape(-1, block_bytes))
        s, b = scale[:, None], bias[:, None]
        codes = np.clip(np.where(s != 0, np.rint((v - b) / s), 0.0), 0, (1 << bits) - 1)
        # The codes come from gguf's dequantization and the grid from the headers: they
        # must agree, or the header reading above is wrong for this type.
        err = np.abs(codes * s + b - v).max(initial=0.0)
        tol = 1e-5 * (np.abs(s).max(initial=0.0) * (1 << bits) + np.abs(b).max(initial=0.0))
    if not err <= tol:
        raise GGUFError(f"tensor {info.name!r} ({info.type_name}) is not the expected grid")
    with np.errstate(over="ignore"):  # as the check above: corrupt scales, no warning
        return [
            _pack_codes(codes.astype(np.uint8).reshape(rows, cols), bits),
            scale.reshape(rows, cols // 32).astype(np.float16),
            bias.reshape(rows, cols // 32).astype(np.float16),
        ]


def _convert_rows(info: TensorInfo, blocks: np.ndarray, dtype: str) -> list[mx.array]:
    """Rows of a block-quantized tensor: ``[dense]`` or ``[weight, scales, biases]``."""
    from gguf import GGMLQuantizationType, quants

    with np.errstate(all="ignore"):  # corrupt blocks decode to inf/NaN, not warnings
        values = quants.dequantize(blocks, GGMLQuantizationType(info.type_id))
    values = np.asarray(values, dtype=np.float32).reshape(blocks.shape[0], info.shape[-1])
    if dtype != "keep":
        return [mx.array(values).astype(getattr(mx, dtype))]
    if info.type_name in _AFFINE_BITS:
        return [mx.array(a) for a in _to_affine(info, blocks, values)]
    return list(mx.quantize(mx.array(values).astype(mx.float16), **_Q6K_KEEP))


# Weights converted at a time: bounds the float32 temporaries of large tensors.
_CHUNK = 1 << 22


def _read_tensor(f: BinaryIO, info: TensorInfo, dtype: str) -> list[mx.array]:
    """One tensor as ``[dense]`` or, for ``dtype="keep"``, ``[weight, scales, biases]``;
    dense F32/F16/BF16 tensors come back in their stored dtype."""
    kind = info.type_name
    f.seek(info.offset)
    raw = np.frombuffer(f.read(info.n_bytes()), dtype=np.uint8)
    # Dense tensors keep their stored dtype: the family converters may still do
    # arithmetic on them (Gemma's norm offset) before the cast to ``dtype``.
    if kind in ("F32", "F16"):
        out = mx.array(raw.view(np.float32 if kind == "F32" else np.float16))
        return [out.reshape(info.shape)]
    if kind == "BF16":
        # bfloat16 is the top half of a float32.
        f32 = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        return [mx.array(f32.reshape(info.shape)).astype(mx.bfloat16)]
    rows = int(np.prod(info.shape[:-1]))
    blocks = raw.reshape(rows, -1)
    step = max(1, _CHUNK // info.shape[-1])
    pieces = []
    for r in range(0, rows, step):
        pieces.append(_convert_rows(info, blocks[r : r + step], dtype))
        mx.eval(pieces[-1])
    parts = [mx.concatenate(p, axis=0) if len(p) > 1 else p[0] for p in zip(*pieces)]
    return [a.reshape(*info.shape[:-1], a.shape[-1]) for a in parts]


def read_tensors(
    path: str | os.PathLike, infos: list[TensorInfo], dtype: str
) -> dict[str, mx.array]:
    """The tensors of ``infos`` under their GGUF names; a quantized one becomes
    ``name.weight/.scales/.biases`` when ``dtype="keep"``.

    Files of ``mx.load`` types only are read by ``mx.load``; the others need the
    ``gguf`` package for their block types.
    """
    check_dtype(dtype)
    # mx.load crashes on some headers it does not need (float64 values): those files
    # take the reader below, which reads every type.
    if all(i.type_name in _MX_NATIVE for i in infos) and not _scan(path)[2]:
        try:
            return mx.load(str(path))
        except (ValueError, RuntimeError, UnicodeDecodeError) as e:
            raise GGUFError(f"GGUF {str(path)!r}: mx.load cannot read it: {e}") from e
    try:
        import gguf  # noqa: F401
    except ImportError as e:
        # Only the block types are decoded by the gguf package.
        if any(_GGML_TYPES[i.type_id][1] > 1 for i in infos):
            types = sorted({i.type_name for i in infos} - {"F32", "F16", "BF16"})
            raise GGUFError(
                f"GGUF {str(path)!r} has {', '.join(types)} tensors, which need the "
                "'gguf' package: pip install gguf"
            ) from e
    weights: dict[str, mx.array] = {}
    with open(path, "rb") as f:
        for info in infos:
            parts = _read_tensor(f, info, dtype)
            mx.eval(parts)  # one tensor's temporaries at a time
            if len(parts) == 1:
                weights[info.name] = parts[0]
            else:
                base = info.name.removesuffix(".weight")
                weights.update((f"{base}.{s}", a) for s, a in zip(TRIPLE, parts))
    return weights
