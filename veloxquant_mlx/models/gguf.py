"""Convert a llama-architecture GGUF file into an mlx_lm model folder.

Files whose tensors are all F32/F16/Q4_0/Q4_1/Q8_0 are read with ``mx.load`` (the
quantized ones come back as MLX affine quantized triples). Other files (K-quants,
BF16, Q5_0/Q5_1) are read here: a small header scan locates each tensor and the
``gguf`` package (llama.cpp's gguf-py) dequantizes its blocks. ``mx.load`` must not
see those files: it returns Q4_K wrong without an error, and Q6_K/BF16 as float16.

The conversion writes weights, ``config.json`` and a tokenizer rebuilt from the
GGUF metadata into a cache folder that ``mlx_lm.load`` can open, so the expensive
part (tokenizer build, dequantization) happens once.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import mlx.core as mx
import numpy as np

# Bump when the written folder changes so old caches are not reused. Version 1
# took K-quant files through mx.load, which decodes Q4_K wrongly; version 2 gave every
# byte-level BPE file SmolLM's pre-tokenizer.
CONVERTER_VERSION = 3

DTYPES = ("float32", "float16", "bfloat16", "keep")

# GGUF per-block tensor names -> mlx_lm llama names.
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|scales|biases|bias)$")
_TOP_RE = re.compile(r"^([a-z_]+)\.(weight|scales|biases|bias)$")

# SmolLM2's ChatML, for SmolLM files that carry no tokenizer.chat_template.
_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
_TRIPLE = ("weight", "scales", "biases")


class GGUFError(ValueError):
    """The GGUF file cannot be converted (architecture, tensor names...)."""


def map_tensor_name(name: str) -> str:
    """mlx_lm llama name of a GGUF tensor (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``); quantized suffixes are kept."""
    if m := _BLOCK_RE.match(name):
        layer, part, suffix = m.groups()
        if part in _BLOCK_NAMES:
            return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{suffix}"
    elif m := _TOP_RE.match(name):
        part, suffix = m.groups()
        if part in _TOP_NAMES:
            return f"{_TOP_NAMES[part]}.{suffix}"
    allowed = ", ".join([*_TOP_NAMES, *(f"blk.N.{p}" for p in _BLOCK_NAMES)])
    raise GGUFError(f"GGUF tensor {name!r} has no llama counterpart; known: {allowed}")


def _scalar(v: Any) -> Any:
    # Metadata scalars come back as 0-d mx.arrays.
    return v.item() if isinstance(v, mx.array) else v


# --- reading GGUF files ----------------------------------------------------------

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


def _check_types(infos: list[TensorInfo], path: str) -> None:
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
    """One tensor as ``[dense]`` or, for ``dtype="keep"``, ``[weight, scales, biases]``."""
    kind = info.type_name
    f.seek(info.offset)
    raw = np.frombuffer(f.read(info.n_bytes()), dtype=np.uint8)
    if kind in ("F32", "F16"):
        out = mx.array(raw.view(np.float32 if kind == "F32" else np.float16))
        out = out.reshape(info.shape)
        return [out if dtype == "keep" else out.astype(getattr(mx, dtype))]
    if kind == "BF16":
        # bfloat16 is the top half of a float32.
        f32 = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        out = mx.array(f32.reshape(info.shape))
        return [out.astype(mx.bfloat16 if dtype == "keep" else getattr(mx, dtype))]
    rows = int(np.prod(info.shape[:-1]))
    blocks = raw.reshape(rows, -1)
    step = max(1, _CHUNK // info.shape[-1])
    pieces = []
    for r in range(0, rows, step):
        pieces.append(_convert_rows(info, blocks[r : r + step], dtype))
        mx.eval(pieces[-1])
    parts = [mx.concatenate(p, axis=0) if len(p) > 1 else p[0] for p in zip(*pieces)]
    return [a.reshape(*info.shape[:-1], a.shape[-1]) for a in parts]


def read_gguf(
    path: str | os.PathLike, dtype: str = "keep"
) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Tensors and metadata of a llama GGUF file, under their GGUF names.

    Quantized tensors come back as ``name.weight/.scales/.biases`` MLX affine triples
    when ``dtype="keep"`` (exact for every type but Q6_K, which is re-quantized to 8
    bits); otherwise files that ``mx.load`` cannot decode are dequantized straight
    to ``dtype``. Raises for a missing file, a non-llama model, a tokenizer that
    cannot be rebuilt exactly, or unsupported tensor types.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not allowed: one of {', '.join(DTYPES)}")
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    meta, infos = scan_gguf(p)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise GGUFError(
            f"GGUF {str(path)!r} has architecture {arch!r}; only 'llama' is supported "
            "(other models: pass an mlx_lm model folder or Hugging Face repo id)"
        )
    tokenizer_kind(meta, f"GGUF {str(path)!r}")  # before any tensor is read
    _check_types(infos, str(path))
    if all(i.type_name in _MX_NATIVE for i in infos):
        weights, meta = mx.load(str(p), return_metadata=True)
        return weights, meta
    for info in infos:
        map_tensor_name(info.name)  # fail on a foreign tensor before the slow part
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
    with open(p, "rb") as f:
        for info in infos:
            parts = _read_tensor(f, info, dtype)
            mx.eval(parts)  # one tensor's temporaries at a time
            if len(parts) == 1:
                weights[info.name] = parts[0]
            else:
                base = info.name.removesuffix(".weight")
                weights.update((f"{base}.{s}", a) for s, a in zip(_TRIPLE, parts))
    return weights, meta


def config_from_metadata(meta: dict[str, Any], tied: bool) -> dict[str, Any]:
    """mlx_lm llama ``config.json`` from the ``llama.*`` GGUF metadata keys."""

    def get(key: str, default: Any = None) -> Any:
        v = meta.get(f"llama.{key}", default)
        if v is None:
            raise GGUFError(f"GGUF metadata lacks 'llama.{key}', needed for the config")
        return _scalar(v)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    vocab = meta.get("llama.vocab_size")
    if vocab is None:
        vocab = len(meta["tokenizer.ggml.tokens"])
    config = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "vocab_size": int(_scalar(vocab)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        # llama.cpp's converter permutes q/k rows into the interleaved-pair layout.
        "rope_traditional": True,
        "tie_word_embeddings": tied,
    }
    if "tokenizer.ggml.eos_token_id" in meta:
        config["eos_token_id"] = int(_scalar(meta["tokenizer.ggml.eos_token_id"]))
    if "tokenizer.ggml.bos_token_id" in meta:
        config["bos_token_id"] = int(_scalar(meta["tokenizer.ggml.bos_token_id"]))
    return config


def convert_weights(
    weights: dict[str, mx.array], config: dict[str, Any], dtype: str
) -> tuple[dict[str, mx.array], dict[str, Any] | None]:
    """Rename GGUF tensors; dequantize them to ``dtype`` unless it is ``"keep"``.

    Returns the weights and the ``quantization`` config entry (``None`` when dense).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not allowed: one of {', '.join(DTYPES)}")
    in_dims = {
        "o_proj": config["num_attention_heads"] * config["head_dim"],
        "down_proj": config["intermediate_size"],
    }
    out: dict[str, mx.array] = {}
    quant: dict[str, Any] | None = None
    for name, w in weights.items():
        if name.endswith((".scales", ".biases")):
            continue
        new = map_tensor_name(name)
        base = name[: -len(".weight")]
        if f"{base}.scales" in weights:
            scales, biases = weights[f"{base}.scales"], weights[f"{base}.biases"]
            module = new.rsplit(".", 2)[-2]
            n_in = in_dims.get(module, config["hidden_size"])
            group = n_in // scales.shape[-1]
            bits = w.shape[-1] * 32 // n_in
            if dtype == "keep":
                prefix = new[: -len(".weight")]
                out[new], out[f"{prefix}.scales"], out[f"{prefix}.biases"] = w, scales, biases
                quant = quant or {"group_size": group, "bits": bits}
                if (group, bits) != (quant["group_size"], quant["bits"]):
                    quant[prefix] = {"group_size": group, "bits": bits}
                continue
            w = mx.dequantize(w, scales, biases, group_size=group, bits=bits)
        if dtype != "keep":
            w = w.astype(getattr(mx, dtype))
        out[new] = w
    return out, quant


# --- tokenizer -------------------------------------------------------------------

# Split regexes of the Hugging Face tokenizers that llama.cpp's pre-tokenizer names
# stand for, as their tokenizer.json writes them. llama.cpp's src/llama-vocab.cpp spells
# the contractions '[sS] instead of (?i:'s): the two differ only on Unicode case folds
# of non-ASCII letters ("a'ſx"), where this follows the model's own tokenizer.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2 differs from Llama 3 only in taking digits one at a time.
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


@dataclass(frozen=True)
class TokenizerKind:
    """How one tokenizer family normalizes, splits and frames text."""

    split: str | None = None  # BPE Split regex; None: SmolLM's digits, then GPT-2's regex
    nfc: bool = False  # NFC-normalize first (Qwen2's normalizer)
    ignore_merges: bool = False  # a word that is itself a token stays whole (Llama 3)
    add_bos: bool = False  # llama.cpp's default; tokenizer.ggml.add_bos_token overrides
    clean_spaces: bool = False  # llama.cpp's clean_spaces, used when decoding
    sentencepiece: bool = False  # scores instead of merges, "▁" for spaces, byte fallback


_SMOLLM = TokenizerKind()
_LLAMA3 = TokenizerKind(_LLAMA3_SPLIT, ignore_merges=True, add_bos=True, clean_spaces=True)
_QWEN2 = TokenizerKind(_QWEN2_SPLIT, nfc=True)
_SENTENCEPIECE = TokenizerKind(add_bos=True, sentencepiece=True)
# tokenizer.ggml.pre values (llama.cpp's names) rebuilt exactly for tokenizer.ggml.model
# "gpt2". llama.cpp maps more names onto these regexes, but their Hugging Face
# tokenizers may normalize or merge differently, so they are refused.
BPE_PRE_TOKENIZERS: dict[str, TokenizerKind] = {
    "smollm": _SMOLLM,
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "qwen2": _QWEN2,
}
SUPPORTED_TOKENIZERS = (
    "tokenizer.ggml.model 'gpt2' (byte-level BPE) with tokenizer.ggml.pre "
    + ", ".join(repr(p) for p in BPE_PRE_TOKENIZERS)
    + "; tokenizer.ggml.model 'llama' (SentencePiece) with distinct scores and byte tokens"
)
# GGUF token types: 2 unknown and 3 control are special, 4 user-defined is added whole.
_SPECIAL_TYPES, _USER_DEFINED = (2, 3), 4
_BYTE_TOKENS = tuple(f"<0x{b:02X}>" for b in range(256))


def tokenizer_kind(meta: dict[str, Any], where: str = "GGUF") -> TokenizerKind:
    """The tokenizer family of GGUF metadata, if this converter rebuilds it exactly.

    Raises GGUFError naming the file's tokenizer model and pre-tokenizer otherwise:
    a wrong pre-tokenizer gives wrong token ids without any error.
    """
    model = _scalar(meta.get("tokenizer.ggml.model"))
    pre = _scalar(meta.get("tokenizer.ggml.pre"))
    if model == "gpt2" and pre in BPE_PRE_TOKENIZERS:
        return BPE_PRE_TOKENIZERS[pre]
    if model == "llama":
        _sentencepiece_merges(meta, where)  # raises where the merge order is not exact
        return _SENTENCEPIECE
    if model == "gpt2":
        found = f"pre-tokenizer {pre!r}" if pre is not None else "no tokenizer.ggml.pre"
        what = f"byte-level BPE tokenizer with {found}"
    else:
        what = f"tokenizer model {model!r}"
    raise GGUFError(
        f"{where} has a {what}, which this converter cannot rebuild exactly; supported: "
        f"{SUPPORTED_TOKENIZERS} (for other models pass an mlx_lm model folder or "
        "Hugging Face repo id)"
    )


def _token_types(meta: dict[str, Any], n: int) -> list[int]:
    types = meta.get("tokenizer.ggml.token_type")
    return types.tolist() if isinstance(types, mx.array) else [1] * n


def _sentencepiece_merges(meta: dict[str, Any], where: str) -> list[tuple[str, str]]:
    """BPE merges that make Hugging Face's BPE encode as SentencePiece does.

    SentencePiece (and llama.cpp) repeatedly merge the adjacent pair whose union is
    the best-scoring token. Listing every split of every such token, best score
    first, gives the same result as long as no two mergeable tokens share a score
    (ties go leftmost there, by rank here) and no token can be merged from a character
    that is not a token (there it can, here it falls back to bytes). Raises otherwise.
    """
    tokens = list(meta["tokenizer.ggml.tokens"])
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None:
        raise GGUFError(f"{where}: SentencePiece vocabulary without tokenizer.ggml.scores")
    scores = np.asarray(scores, dtype=np.float64).tolist()
    vocab = set(tokens)
    if missing := [b for b in _BYTE_TOKENS if b not in vocab]:
        raise GGUFError(f"{where}: SentencePiece vocabulary lacks byte token {missing[0]}")
    best: dict[float, str] = {}
    ranked = []
    for t, s, k in zip(tokens, scores, _token_types(meta, len(tokens))):
        if k in _SPECIAL_TYPES or k == _USER_DEFINED or len(t) < 2:
            continue  # matched whole before merging, or never a merge
        splits = []
        for left, right in ((t[:i], t[i:]) for i in range(1, len(t))):
            if left in vocab and right in vocab:
                splits.append((left, right))
            elif all(p in vocab or len(p) == 1 for p in (left, right)):
                stray = left if left not in vocab else right
                raise GGUFError(
                    f"{where}: SentencePiece token {t!r} can be merged from the character "
                    f"{stray!r}, which is not a token itself"
                )
        if not splits:
            continue
        if s in best:
            raise GGUFError(
                f"{where}: SentencePiece tokens {best[s]!r} and {t!r} share the score {s}, "
                "and Hugging Face's BPE cannot break that tie as SentencePiece does"
            )
        best[s] = t
        ranked.append((-s, splits))
    ranked.sort(key=lambda r: r[0])
    return [pair for _, splits in ranked for pair in splits]


def _bpe_merges(meta: dict[str, Any]) -> list[tuple[str, str]]:
    merges = meta.get("tokenizer.ggml.merges")
    if merges is None:
        raise GGUFError("GGUF byte-level BPE tokenizer lacks tokenizer.ggml.merges")
    out = []
    for m in merges:
        # Split as llama.cpp does: at the first space after the first character.
        at = m.find(" ", 1)
        if at < 0:
            raise GGUFError(f"GGUF merge {m!r} is not two tokens separated by a space")
        out.append((m[:at], m[at + 1 :]))
    return out


def _bpe_tokenizer(meta: dict[str, Any], kind: TokenizerKind, vocab: dict[str, int]) -> Any:
    """The ``tokenizers`` model, normalizer, pre-tokenizer and decoder of ``kind``."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    merges = _bpe_merges(meta)
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=kind.ignore_merges)
    )
    if kind.split is None:
        first = pre_tokenizers.Digits(individual_digits=True)
    else:
        first = pre_tokenizers.Split(Regex(kind.split), behavior="isolated", invert=False)
    # With a Split first, ByteLevel only maps bytes; otherwise it applies GPT-2's regex.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [first, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=kind.split is None)]
    )
    if kind.nfc:
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_tokenizer(meta: dict[str, Any], tokens: list[str]) -> Any:
    """SentencePiece BPE as llama.cpp runs it: each text between special tokens gets a
    leading space (unless tokenizer.ggml.add_space_prefix is false), spaces become
    "▁", and the whole piece is merged by score, unknown characters falling back to
    byte tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    merges = _sentencepiece_merges(meta, "GGUF")
    unk = tokens[int(_scalar(meta.get("tokenizer.ggml.unknown_token_id", 0)))]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, byte_fallback=True))
    prefix = bool(_scalar(meta.get("tokenizer.ggml.add_space_prefix", True)))
    steps = [normalizers.Prepend("▁")] if prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    unsteps = [decoders.Strip(" ", 1, 0)] if prefix else []
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *unsteps]
    )
    return tok


def _framing(meta: dict[str, Any], tokens: list[str], kind: TokenizerKind) -> Any:
    """Post-processor (or None): byte-level offsets for BPE, plus BOS/EOS where
    llama.cpp adds them."""
    from tokenizers import processors

    ends: list[tuple[str, int] | None] = []
    for end, default in (("bos", kind.add_bos), ("eos", False)):
        if not bool(_scalar(meta.get(f"tokenizer.ggml.add_{end}_token", default))):
            ends.append(None)
            continue
        i = meta.get(f"tokenizer.ggml.{end}_token_id")
        if i is None:
            raise GGUFError(f"GGUF asks to add a {end} token but has no {end}_token_id")
        ends.append((tokens[int(_scalar(i))], int(_scalar(i))))
    steps = [] if kind.sentencepiece else [processors.ByteLevel(trim_offsets=False)]
    if not any(ends):
        return steps[0] if steps else None
    named = [e for e in ends if e]
    if any(":" in t for t, _ in named):
        # TemplateProcessing reads "text:type_id"; a ':' in the token would be misread.
        raise GGUFError(f"GGUF bos/eos token of {named} contains ':'")

    def framed(seq: str, type_id: int) -> list[str]:
        pieces = [ends[0] and ends[0][0], f"${seq}", ends[1] and ends[1][0]]
        return [f"{p}:{type_id}" for p in pieces if p]

    template = processors.TemplateProcessing(
        single=framed("A", 0),
        pair=framed("A", 0) + framed("B", 1),
        special_tokens=list(dict.fromkeys(named)),
    )
    return processors.Sequence([*steps, template])


def build_tokenizer(meta: dict[str, Any]) -> Any:
    """A ``transformers.PreTrainedTokenizerFast`` rebuilt from ``tokenizer.ggml.*``.

    Raises GGUFError for a tokenizer it cannot rebuild exactly (see ``tokenizer_kind``).
    """
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    kind = tokenizer_kind(meta)
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        dup = next(t for i, t in enumerate(tokens) if vocab[t] != i)
        raise GGUFError(f"GGUF vocabulary holds the token {dup!r} twice")
    types = _token_types(meta, len(tokens))
    if kind.sentencepiece:
        tok = _sentencepiece_tokenizer(meta, tokens)
    else:
        tok = _bpe_tokenizer(meta, kind, vocab)
    if (framing := _framing(meta, tokens, kind)) is not None:
        tok.post_processor = framing
    # llama.cpp matches special and user-defined tokens in the raw text before splitting.
    special = [t for t, k in zip(tokens, types) if k in _SPECIAL_TYPES]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    user = [AddedToken(t, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED]
    if user:
        tok.add_tokens(user)

    def token_of(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if i is None else tokens[int(_scalar(i))]

    # The ChatML fallback is SmolLM2's; other models without a template get none.
    fallback = _CHAT_TEMPLATE if kind is _SMOLLM else None
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=token_of("bos"),
        eos_token=token_of("eos"),
        unk_token=token_of("unknown"),
        pad_token=token_of("padding"),
        chat_template=meta.get("tokenizer.chat_template") or fallback,
        clean_up_tokenization_spaces=kind.clean_spaces,
        model_max_length=int(_scalar(meta.get("llama.context_length", 2048))),
    )


def convert_gguf(path: str | os.PathLike, out_dir: str | os.PathLike, dtype: str) -> Path:
    """Write an mlx_lm model folder for the GGUF at ``path`` into ``out_dir``."""
    weights, meta = read_gguf(path, dtype)
    tied = "output.weight" not in weights
    config = config_from_metadata(meta, tied)
    new, quant = convert_weights(weights, config, dtype)
    if quant is not None:
        config["quantization"] = quant
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), new, metadata={"format": "mlx"})
    build_tokenizer(meta).save_pretrained(str(out))
    if not (out / "tokenizer_config.json").is_file():
        raise GGUFError(f"tokenizer save wrote no tokenizer_config.json in {out}")
    with open(out / "config.json", "w") as f:
        json.dump(config, f, indent=2)
    return out


def cache_root() -> Path:
    """``$VELOXQUANT_CACHE_DIR`` or ``~/.cache/veloxquant_mlx``."""
    env = os.environ.get("VELOXQUANT_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "veloxquant_mlx"


def cache_dir_for(path: str | os.PathLike, dtype: str) -> Path:
    """Cache folder of one GGUF file: keyed on path, size, mtime, dtype, version."""
    p = Path(path).resolve()
    st = p.stat()
    key = f"{p}|{st.st_size}|{st.st_mtime_ns}|{dtype}|{CONVERTER_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / f"{p.stem}-{digest}"


def is_valid_cache(folder: Path) -> bool:
    """Cheap check that a cache folder is complete (files present, JSON parses)."""
    try:
        for name in _FILES:
            if not (folder / name).is_file():
                return False
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            with open(folder / name) as f:
                json.load(f)
        return (folder / "model.safetensors").stat().st_size > 0
    except (OSError, ValueError):
        return False


def cached_conversion(path: str | os.PathLike, dtype: str) -> tuple[Path, bool]:
    """The cache folder for ``path``, converting first if needed.

    Returns ``(folder, converted_now)``. The conversion is written to a temporary
    sibling folder and renamed into place, so an interrupted run leaves no partial
    cache; an invalid existing folder is removed and rebuilt.
    """
    if not Path(path).is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    folder = cache_dir_for(path, dtype)
    if is_valid_cache(folder):
        return folder, False
    if folder.exists():
        shutil.rmtree(folder, ignore_errors=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary folder
    try:
        convert_gguf(path, tmp, dtype)
        try:
            os.rename(tmp, folder)
        except OSError:
            # Another process finished the same conversion first: use theirs.
            if not is_valid_cache(folder):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder, True
