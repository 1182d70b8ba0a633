"""Convert a GGUF file into an mlx_lm model folder.

Architectures: llama (also Mistral's files), gemma3, qwen2, qwen3 and phi3, each by
its converter in ``gguf_families``; any other is refused before a tensor is read.
Tensors are read by ``gguf_read`` (every type in ``SUPPORTED_TYPES``), the tokenizer
is rebuilt from the metadata by ``gguf_tokenizer``.

The conversion writes weights, ``config.json`` and the tokenizer into a cache folder
that ``mlx_lm.load`` can open, so the expensive part (tokenizer build,
dequantization) happens once.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx

from veloxquant_mlx.models.gguf_families import (
    FAMILIES,
    SUPPORTED_ARCHS,
    Family,
    Meta,
    base_config,
    convert_weights,
    family_of,
    model_config,
)
from veloxquant_mlx.models.gguf_read import (
    _AFFINE_BITS,
    _GGML_TYPES,
    DTYPES,
    SUPPORTED_TYPES,
    GGUFError,
    TensorInfo,
    check_dtype,
    check_types,
    read_tensors,
    scan_gguf,
)
from veloxquant_mlx.models.gguf_tokenizer import (
    BPE_PRE_TOKENIZERS,
    GEMMA_CHAT_TEMPLATE,
    SUPPORTED_TOKENIZERS,
    TokenizerKind,
    build_tokenizer,
    tokenizer_kind,
)
from veloxquant_mlx.ops.files import replacing, write_text

__all__ = [
    "BPE_PRE_TOKENIZERS", "CONVERTER_VERSION", "DTYPES", "FAMILIES", "GEMMA_CHAT_TEMPLATE",
    "SUPPORTED_ARCHS", "SUPPORTED_TOKENIZERS", "SUPPORTED_TYPES", "Family", "GGUFError",
    "Meta", "TensorInfo", "TokenizerKind", "_AFFINE_BITS", "_GGML_TYPES", "base_config",
    "build_tokenizer", "cache_dir_for", "cache_root", "cached_conversion",
    "config_from_metadata", "convert_gguf", "convert_weights", "family_of",
    "is_valid_cache", "map_tensor_name", "model_config", "read_gguf", "scan_gguf",
    "tokenizer_kind",
]  # fmt: skip

# Bump when the written folder changes so old caches are not reused. Version 1
# took K-quant files through mx.load, which decodes Q4_K wrongly; version 2 gave every
# byte-level BPE file SmolLM's pre-tokenizer.
CONVERTER_VERSION = 3

_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def map_tensor_name(name: str) -> str:
    """mlx_lm llama name of a GGUF tensor (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``); quantized suffixes are kept."""
    return FAMILIES["llama"].tensor_name(name)


def config_from_metadata(meta: dict[str, Any], tied: bool) -> dict[str, Any]:
    """mlx_lm ``config.json`` of the file's family from its ``{arch}.*`` metadata."""
    return model_config(meta, tied)


def read_gguf(
    path: str | os.PathLike, dtype: str = "keep"
) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Tensors and metadata of a GGUF file of a supported family, under GGUF names.

    Quantized tensors come back as ``name.weight/.scales/.biases`` MLX affine triples
    when ``dtype="keep"`` (exact for every type but Q6_K, which is re-quantized to 8
    bits); otherwise block-quantized tensors are dequantized straight to ``dtype``
    (dense ones keep their stored dtype until ``convert_weights``). Raises for a
    missing file, an unsupported architecture, a tokenizer that cannot be rebuilt
    exactly, unsupported tensor types or tensors the family has no place for, all
    before any tensor is read.
    """
    check_dtype(dtype)
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    meta, infos = scan_gguf(p)
    family = family_of(meta, f"GGUF {str(path)!r}")
    tokenizer_kind(meta, f"GGUF {str(path)!r}")
    check_types(infos, str(path))
    family.check_names([i.name for i in infos])
    return read_tensors(p, infos, dtype), meta


def convert_gguf(path: str | os.PathLike, out_dir: str | os.PathLike, dtype: str) -> Path:
    """Write an mlx_lm model folder for the GGUF at ``path`` into ``out_dir``."""
    weights, meta = read_gguf(path, dtype)
    family = family_of(meta)
    config = model_config(meta, tied="output.weight" not in weights)
    if family.undo is not None:
        weights = family.undo(weights, config, Meta(meta))
    new, quant = convert_weights(weights, config, dtype, family)
    if quant is not None:
        config["quantization"] = quant
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Each file whole or not at all: a failed write keeps a folder's previous files.
    with replacing(out / "model.safetensors") as tmp:
        mx.save_safetensors(str(tmp), new, metadata={"format": "mlx"})
    build_tokenizer(meta).save_pretrained(str(out))
    if not (out / "tokenizer_config.json").is_file():
        raise GGUFError(f"tokenizer save wrote no tokenizer_config.json in {out}")
    write_text(out / "config.json", json.dumps(config, indent=2))
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
