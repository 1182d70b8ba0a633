"""Reading GGUF files: the header, the tensor table and every tensor type the
converter takes.

Files whose tensors are all F32/F16/Q4_0/Q4_1/Q8_0 are read with ``mx.load`` (the
quantized ones come back as MLX affine quantized triples). Other files (K-quants,
BF16, Q5_0/Q5_1) are read here: a small header scan locates each tensor and the
``gguf`` package (llama.cpp's gguf-py) dequantizes its blocks. ``mx.load`` must not
see those files: it returns Q4_K wrong without an error, and Q6_K/BF16 as float16.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

import mlx.core as mx
import numpy as np

DTYPES = ("float32", "float16", "bfloat16", "keep")
TRIPLE = ("weight", "scales", "biases")


class GGUFError(ValueError):
    """The GGUF file cannot be converted (architecture, tensor names...)."""


def scalar(v: Any) -> Any:
    """A metadata scalar as a Python value (they come back as 0-d mx.arrays)."""
    return v.item() if isinstance(v, mx.array) else v


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
        return int(np.prod(self.shape)) // block * size


class _Header:
    """Sequential reader of the GGUF header (little-endian, versions 2 and 3)."""

    def __init__(self, buf: mmap.mmap, path: str) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def unpack(self, fmt: str) -> Any:
        try:
            (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error:
            raise GGUFError(f"GGUF {self.path!r} is truncated (header ends early)") from None
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise GGUFError(f"GGUF {self.path!r} is truncated (header ends early)")
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, kind: int) -> Any:
        if kind == 8:
            return self.string()
        if kind in _SCALAR_FMT:
            return self.unpack(_SCALAR_FMT[kind])
        if kind != 9:
            raise GGUFError(f"GGUF {self.path!r} has a metadata value of unknown type {kind}")
        item, n = self.unpack("<I"), self.unpack("<Q")
        if item in _SCALAR_FMT:
            # Numeric arrays come back as mx.arrays, as mx.load returns them.
            dt = np.dtype(_SCALAR_FMT[item])
            end = self.pos + n * dt.itemsize
            if end > len(self.buf):
                raise GGUFError(f"GGUF {self.path!r} is truncated (header ends early)")
            # A copy: a view would keep the mmap from closing.
            a = np.frombuffer(self.buf[self.pos : end], dtype=dt)
            self.pos = end
            return mx.array(a.astype(_NP_TYPES[item]))
        return [self.value(item) for _ in range(n)]


def scan_gguf(path: str | os.PathLike) -> tuple[dict[str, Any], list[TensorInfo]]:
    """Metadata and tensor table of a GGUF file, without reading any tensor data.

    Metadata scalars are Python values, numeric arrays ``mx.array``, string arrays
    lists. Takes about 0.1 s where ``gguf.GGUFReader`` takes 7 s (49k-token vocab).
    """
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
        n_tensors, n_kv = h.unpack("<Q"), h.unpack("<Q")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = h.string()
            meta[key] = h.value(h.unpack("<I"))
        raw = []
        for _ in range(n_tensors):
            name = h.string()
            dims = [h.unpack("<Q") for _ in range(h.unpack("<I"))]
            raw.append((name, h.unpack("<I"), tuple(reversed(dims)), h.unpack("<Q")))
        align = int(meta.get("general.alignment", 32))
        start = -(-h.pos // align) * align
        size = len(buf)
    infos = [TensorInfo(n, t, shape, start + off) for n, t, shape, off in raw]
    for info in infos:
        if info.type_id in _GGML_TYPES and info.offset + info.n_bytes() > size:
            raise GGUFError(f"GGUF {str(path)!r} is truncated (tensor {info.name!r})")
    return meta, infos


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
    scale, bias = _affine_grid(info.type_name, blocks.reshape(-1, block_bytes))
    rows, cols = values.shape
    v = values.reshape(-1, 32)
    s, b = scale[:, None], bias[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.where(s != 0, np.rint((v - b) / s), 0.0)
    codes = np.clip(codes, 0, (1 << bits) - 1)
    # The codes come from gguf's dequantization and the grid from the headers: they
    # must agree, or the header reading above is wrong for this type.
    err = np.abs(codes * s + b - v).max(initial=0.0)
    tol = 1e-5 * (np.abs(s).max(initial=0.0) * (1 << bits) + np.abs(b).max(initial=0.0))
    if not err <= tol:
        raise GGUFError(f"tensor {info.name!r} ({info.type_name}) is not the expected grid")
    return [
        _pack_codes(codes.astype(np.uint8).reshape(rows, cols), bits),
        scale.reshape(rows, cols // 32).astype(np.float16),
        bias.reshape(rows, cols // 32).astype(np.float16),
    ]


def _convert_rows(info: TensorInfo, blocks: np.ndarray, dtype: str) -> list[mx.array]:
    """Rows of a block-quantized tensor: ``[dense]`` or ``[weight, scales, biases]``."""
    from gguf import GGMLQuantizationType, quants

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
    if all(i.type_name in _MX_NATIVE for i in infos):
        return mx.load(str(path))
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
