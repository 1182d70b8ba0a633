"""How the fused CPU kernel is built: setup.py declares it with MLX's own setuptools
machinery, the module the package loads is the one built from this checkout's csrc/ against
this venv's MLX, and without it (or when the build cannot run) the package says why.
No full build here (minutes): the fallback is driven with CMake off the PATH.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import warnings
from importlib import metadata
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import tomllib
from mlx.extension import CMakeBuild, CMakeExtension
from setuptools import Distribution

import veloxquant_mlx.ops
from veloxquant_mlx.ops import native

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def setup_py() -> ModuleType:
    spec = importlib.util.spec_from_file_location("veloxquant_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not __main__: defines, does not run setup()
    return module


def test_setup_declares_the_kernel_with_mlx_extension(setup_py: ModuleType) -> None:
    (ext,) = setup_py.extensions()
    assert isinstance(ext, CMakeExtension)
    assert ext.name == "veloxquant_mlx.ops._native"
    assert Path(ext.sourcedir) == ROOT / "csrc"
    assert ext.optional  # a failed build leaves the install pure Python
    assert issubclass(setup_py.BuildNative, CMakeBuild)


def test_build_requirements_name_the_runtime_mlx_range() -> None:
    """pip builds in an isolated environment: its MLX must be the range the package runs
    with (another release's C++ ABI may differ), plus the nanobind MLX was built with."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    requires = data["build-system"]["requires"]
    runtime_mlx = [d for d in data["project"]["dependencies"] if d.startswith("mlx")
                   and not d.startswith("mlx-lm")]
    assert runtime_mlx and all(d in requires for d in runtime_mlx), (runtime_mlx, requires)
    assert "nanobind==3.0.1" in requires


def test_the_loaded_module_was_built_from_this_csrc_against_this_mlx(
        setup_py: ModuleType) -> None:
    assert native._native is not None, native.status()
    built = Path(native._native.__file__)
    assert built.parent == Path(veloxquant_mlx.ops.__file__).parent
    stamp = built.parent / setup_py.STAMP
    assert stamp.exists(), f"{built} has no {stamp.name}: not built by setup.py; " \
                           "rebuild with pip install -e . (make setup)"
    info = json.loads(stamp.read_text())
    assert info["sources"] == setup_py.source_hash(ROOT / "csrc"), \
        "csrc/ changed since the kernel was built: rebuild with pip install -e . (make setup)"
    assert info["mlx"] == metadata.version("mlx")
    assert info["nanobind"] == "3.0.1"


def test_the_source_hash_follows_every_source(setup_py: ModuleType, tmp_path: Path) -> None:
    # The sources by concern and their shared headers, each a part of what was built.
    names = ("CMakeLists.txt", "decode.cpp", "parts.h")
    for name in names:
        (tmp_path / name).write_text("int f();\n")
    (tmp_path / "notes.txt").write_text("not a source\n")
    before = setup_py.source_hash(tmp_path)
    (tmp_path / "notes.txt").write_text("edited\n")
    assert setup_py.source_hash(tmp_path) == before
    for name in names:
        (tmp_path / name).write_text((tmp_path / name).read_text() + "// edit\n")
        assert setup_py.source_hash(tmp_path) != before
        before = setup_py.source_hash(tmp_path)


def test_cmake_builds_every_source_file() -> None:
    # The extension is split by concern: a file left out of the list would link without
    # its kernels (a missing symbol at import) or be hashed without being built.
    text = (ROOT / "csrc" / "CMakeLists.txt").read_text()
    listed = set(re.search(r"set\(VELOXQUANT_SOURCES([^)]*)\)", text).group(1).split())
    assert listed == {p.name for p in (ROOT / "csrc").glob("*.cpp")}


def _fallback_build(setup_py: ModuleType, tmp_path: Path,
                    monkeypatch: pytest.MonkeyPatch) -> tuple[Any, str]:
    """build_ext --inplace in ``tmp_path`` with no cmake on the PATH."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv("MLX_DIR", "")  # CMakeBuild sets it: restored afterwards
    dist = Distribution({"name": "veloxquant_mlx", "ext_modules": setup_py.extensions(),
                         "cmdclass": {"build_ext": setup_py.BuildNative}})
    cmd = dist.get_command_obj("build_ext")
    cmd.build_lib, cmd.build_temp, cmd.inplace = str(tmp_path / "lib"), str(tmp_path / "t"), 1
    cmd.ensure_finalized()
    return cmd, Path(cmd.get_ext_fullpath(setup_py.NAME)).name


def test_without_cmake_the_build_warns_once_and_installs_no_module(
        setup_py: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cmd, filename = _fallback_build(setup_py, tmp_path, monkeypatch)
    earlier = tmp_path / "lib" / "veloxquant_mlx" / "ops"  # a build directory's last build
    earlier.mkdir(parents=True)
    for name in (filename, setup_py.STAMP):
        (earlier / name).write_text("from an earlier build")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cmd.run()
    ours = [w for w in caught if "veloxquant_mlx" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    assert issubclass(ours[0].category, UserWarning)  # what pip relays from a backend
    said = [str(ours[0].message)]
    assert "CMake could not run" in said[0] and "MLX's ops" in said[0]
    assert "install a C++20 compiler and CMake" in said[0]
    assert not list(tmp_path.rglob("_native*")), "a module or stamp left for the wheel"
    assert not (tmp_path / "t" / setup_py.NAME).exists(), "CMake's cache of the failure kept"
    assert not any(Path(p).name == filename for p in cmd.get_outputs())


def test_a_failed_rebuild_in_place_says_it_keeps_the_earlier_one(
        setup_py: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cmd, filename = _fallback_build(setup_py, tmp_path, monkeypatch)
    earlier = tmp_path / "veloxquant_mlx" / "ops" / filename
    earlier.parent.mkdir(parents=True)
    earlier.write_bytes(b"an earlier build")
    with pytest.warns(UserWarning, match=r"not rebuilt \(CMake could not run.*earlier build"):
        cmd.run()
    assert earlier.read_bytes() == b"an earlier build"


def test_a_missing_module_reports_why_and_how(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(veloxquant_mlx.ops, "_native", raising=False)
    monkeypatch.setitem(sys.modules, "veloxquant_mlx.ops._native", None)  # ImportError
    ext, why = native._load()
    assert ext is None
    assert why.startswith("not built") and "compiler" in why and "pip install" in why
    monkeypatch.setattr(native, "_native", None)
    monkeypatch.setattr(native, "_why", why)
    assert native.status() == f"MLX ops (the fused CPU kernel is {why})"
    assert not native.available()


def test_a_module_of_another_mlx_reports_why(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuses(*args: object) -> None:
        raise TypeError("incompatible function arguments")

    # Its part kinds and fields are this checkout's: only the call tells it apart.
    other = SimpleNamespace(decode_attention=refuses, **native.described_by(native._native))
    monkeypatch.setattr(veloxquant_mlx.ops, "_native", other, raising=False)
    ext, why = native._load()
    assert ext is None
    assert why.startswith("built for another MLX (TypeError)") and "pip install" in why
