"""Builds ``veloxquant_mlx.ops._native``, the fused CPU attention kernel of ``csrc/``,
with MLX's own setuptools machinery (``mlx.extension.CMakeExtension`` / ``CMakeBuild``);
pyproject.toml holds the metadata. ``pip install .`` builds it into the wheel,
``pip install -e .`` (scripts/setup.sh) and ``python setup.py build_ext --inplace`` beside
``ops/native.py``. Without a compiler or CMake, or when the build fails, the install goes on
without it and says so once: attention then runs on MLX's ops and ``native.status()`` says
why. A built module has ``_native.json`` beside it: the hash of the sources and the MLX it
was built from, which tests/test_build.py checks against the checkout and the venv.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import warnings
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"
NAME = "veloxquant_mlx.ops._native"
STAMP = "_native.json"
SOURCES = ("CMakeLists.txt", "*.cpp", "*.h", "*.hpp")
HOW = ("to get it, install a C++20 compiler and CMake >= 3.25, then reinstall from source "
       "(pip install -e . or make setup in a checkout; pip install -v shows the build)")

try:
    from mlx.extension import CMakeBuild, CMakeExtension
    NO_MLX = ""
except ImportError as e:  # a build without isolation in an environment that lacks MLX
    CMakeBuild, CMakeExtension = build_ext, None  # type: ignore[assignment,misc]
    NO_MLX = f"MLX is not installed where it builds ({e})"


def source_hash(csrc: Path = CSRC) -> str:
    """SHA-256 of the kernel's sources (names and bytes): what a built module came from."""
    digest = hashlib.sha256()
    files = sorted({p for pattern in SOURCES for p in Path(csrc).glob(pattern)})
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def build_info() -> dict[str, str]:
    """What ``_native.json`` records: the sources' hash and the MLX and nanobind built with."""
    return {"sources": source_hash(), "mlx": metadata.version("mlx"),
            "nanobind": metadata.version("nanobind")}


def extensions() -> list[Extension]:
    """The one extension, optional: a failed build leaves the package pure Python."""
    if CMakeExtension is None:
        ext = Extension(NAME, sources=[])
    else:
        ext = CMakeExtension(NAME, sourcedir=str(CSRC))
    ext.optional = True
    return [ext]


def warn(why: str, kept: Path | None = None) -> None:
    """The one warning of a build without the kernel: a UserWarning, which pip (25 on)
    shows without -v; a print from a build backend it shows only with -v."""
    if kept is None:
        verb, then = "built", "attention will run on MLX's ops (same results, slower on a CPU)"
    else:  # in place: the earlier module still loads, perhaps built from other sources
        verb, then = "rebuilt", f"the earlier build {kept} stays (_native.json: from what)"
    warnings.warn(f"veloxquant_mlx: the fused CPU attention kernel was not {verb} ({why}); "
                  f"{then}; {HOW}.", UserWarning, stacklevel=2)


def _failure(error: Exception) -> str:
    if isinstance(error, subprocess.CalledProcessError):
        step = "build" if "--build" in error.cmd else "configure"
        return f"the CMake {step} step failed with exit status {error.returncode}"
    return f"CMake could not run: {error}"


def _fresh_build_dir(where: Path) -> None:
    """Empties a CMake build directory configured for another interpreter, MLX or nanobind
    (pip's isolated build environments come and go; a stale cache points into them)."""
    found = [importlib.util.find_spec(name) for name in ("mlx", "nanobind")]
    key = json.dumps([sys.executable, os.environ.get("CXX"),
                      *(list(f.submodule_search_locations or [f.origin]) if f else None
                        for f in found)])
    mark = where / "veloxquant-build-env.json"
    if where.exists() and (not mark.exists() or mark.read_text() != key):
        shutil.rmtree(where)
    where.mkdir(parents=True, exist_ok=True)
    mark.write_text(key)


class BuildNative(CMakeBuild):  # type: ignore[misc,valid-type]
    """``CMakeBuild`` that records what it built and, when it cannot build, warns and
    leaves the extension out instead of failing the install."""

    def run(self) -> None:
        self.skipped: list[str] = []
        self.in_place = bool(self.inplace or getattr(self, "editable_mode", False))
        # setuptools' run, not CMakeBuild's: that one copies the whole built package
        # directory over the checkout, stale .py files of an earlier build included.
        build_ext.run(self)

    def build_extension(self, ext: Extension) -> None:
        if NO_MLX:
            return self._skip(ext, NO_MLX)
        _fresh_build_dir(Path(self.build_temp) / ext.name)
        saved = os.environ.get("CMAKE_ARGS")
        # In place, the module runs with the venv's MLX (pip may build against another
        # environment's): its library directory, unless a space would split CMAKE_ARGS.
        lib = Path(sysconfig.get_paths()["platlib"]) / "mlx" / "lib"
        if self.in_place and " " not in str(lib):
            os.environ["CMAKE_ARGS"] = f"{saved or ''} -DVELOXQUANT_MLX_RPATH={lib}".strip()
        try:
            super().build_extension(ext)
        except (OSError, subprocess.CalledProcessError) as e:
            return self._skip(ext, _failure(e))
        finally:
            if saved is None:
                os.environ.pop("CMAKE_ARGS", None)
            else:
                os.environ["CMAKE_ARGS"] = saved
        stamp = Path(self.get_ext_fullpath(ext.name)).parent / STAMP
        stamp.write_text(json.dumps(build_info(), indent=1) + "\n", encoding="utf-8")

    def _skip(self, ext: Extension, why: str) -> None:
        self.skipped.append(ext.name)
        # CMake caches what it found, a missing compiler too: the next try starts afresh.
        shutil.rmtree(Path(self.build_temp) / ext.name, ignore_errors=True)
        built = Path(self.get_ext_fullpath(ext.name))  # an earlier build's, else in the wheel
        built.unlink(missing_ok=True)
        (built.parent / STAMP).unlink(missing_ok=True)
        build_py = self.get_finalized_command("build_py")
        kept = Path(self._get_inplace_equivalent(build_py, ext)[0])
        warn(why, kept if self.in_place and kept.exists() else None)

    def copy_extensions_to_source(self) -> None:
        build_py = self.get_finalized_command("build_py")
        for ext in self.extensions:
            if ext.name in self.skipped:
                continue
            inplace, regular = (Path(p) for p in self._get_inplace_equivalent(build_py, ext))
            self.copy_file(str(regular), str(inplace), level=self.verbose)
            self.copy_file(str(regular.parent / STAMP), str(inplace.parent / STAMP),
                           level=self.verbose)

    def _names(self, skipped: bool) -> set[str]:
        """File names of the extensions that were (not) left out."""
        left_out = set(getattr(self, "skipped", []))
        return {Path(self.get_ext_filename(self.get_ext_fullname(e.name))).name
                for e in self.extensions if (e.name in left_out) == skipped}

    def _get_output_mapping(self) -> Iterator[tuple[str, str]]:
        """In place (pip install -e): the built modules and their stamps, not a left-out one."""
        skipped, built = self._names(True), self._names(False)
        for regular, inplace in super()._get_output_mapping():
            if Path(regular).name in skipped:
                continue
            yield regular, inplace
            if Path(regular).name in built:
                yield (str(Path(regular).parent / STAMP), str(Path(inplace).parent / STAMP))

    def get_outputs(self) -> list[str]:
        if self.inplace:  # setuptools lists the mapping above
            return list(super().get_outputs())
        skipped, built = self._names(True), self._names(False)
        outputs = [p for p in super().get_outputs() if Path(p).name not in skipped]
        return outputs + [str(Path(p).parent / STAMP) for p in outputs if Path(p).name in built]


def main() -> Any:
    return setup(ext_modules=extensions(), cmdclass={"build_ext": BuildNative})


if __name__ == "__main__":
    main()
