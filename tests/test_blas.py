"""Fast-BLAS preloading: library search, re-exec environment, real subprocess runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from veloxquant_mlx.apps import blas
from veloxquant_mlx.eval import matmul_bench

ROOT = Path(__file__).resolve().parents[1]
ON_LINUX = sys.platform == "linux"
HAS_FAST = ON_LINUX and blas.find_fast_blas() is not None and blas.uses_cpu_backend()
needs_fast = pytest.mark.skipif(not HAS_FAST, reason="no OpenBLAS/BLIS here (or not mlx[cpu])")


def clean_env(**extra: str) -> dict[str, str]:
    """The environment of a fresh process that has not been re-executed yet."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", blas.ENV_GUARD)
           and not k.startswith("PYTEST_")}  # not an xdist worker of the outer run
    env.pop(blas.ENV_DISABLE, None)
    env.pop(blas.ENV_BLAS, None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


@pytest.fixture
def fresh(monkeypatch):
    """This process as if it were not re-executed, with execve recorded."""
    for name in ("LD_PRELOAD", blas.ENV_GUARD, blas.ENV_DISABLE, blas.ENV_BLAS):
        monkeypatch.delenv(name, raising=False)
    calls = []
    monkeypatch.setattr(os, "execve", lambda *a: calls.append(a))
    monkeypatch.setattr(blas, "uses_cpu_backend", lambda: True)
    monkeypatch.setattr(blas, "_warned", False)
    return calls


def test_disable_env(monkeypatch):
    monkeypatch.setenv(blas.ENV_DISABLE, "1")
    monkeypatch.setenv(blas.ENV_BLAS, sys.executable)
    assert blas.find_fast_blas() is None


def test_override_env(monkeypatch, tmp_path: Path):
    lib = tmp_path / "libblas.so.3"
    lib.write_bytes(b"")
    monkeypatch.delenv(blas.ENV_DISABLE, raising=False)
    monkeypatch.setenv(blas.ENV_BLAS, str(lib))
    assert blas.find_fast_blas() == str(lib)


def test_override_missing_file_warns(monkeypatch, tmp_path: Path):
    monkeypatch.delenv(blas.ENV_DISABLE, raising=False)
    monkeypatch.setenv(blas.ENV_BLAS, str(tmp_path / "missing.so"))
    with pytest.warns(UserWarning, match="missing.so.*not a file"):
        found = blas.find_fast_blas()
    assert found != str(tmp_path / "missing.so")


@needs_fast
def test_finds_an_optimized_library(monkeypatch):
    monkeypatch.delenv(blas.ENV_BLAS, raising=False)
    path = blas.find_fast_blas()
    assert path is not None and os.path.isfile(path)
    assert any(k in os.path.realpath(path) for k in ("openblas", "blis"))


def test_reexec_env():
    base = {"LD_PRELOAD": "/a/libx.so:/lib/fast.so /b/liby.so", "HOME": "/h"}
    env = blas.reexec_env("/lib/fast.so", base)
    assert env["LD_PRELOAD"] == "/lib/fast.so /a/libx.so /b/liby.so"
    assert env[blas.ENV_GUARD] == "1" and env["HOME"] == "/h"
    assert base["LD_PRELOAD"] == "/a/libx.so:/lib/fast.so /b/liby.so"  # not mutated
    assert blas.reexec_env("/lib/fast.so", {})["LD_PRELOAD"] == "/lib/fast.so"


@pytest.mark.skipif(not ON_LINUX, reason="Linux only")
def test_ensure_execs_with_preload(fresh, monkeypatch, tmp_path: Path):
    lib = tmp_path / "libopenblas.so.0"
    lib.write_bytes(b"")
    monkeypatch.setenv(blas.ENV_BLAS, str(lib))
    blas.ensure_fast_blas(["-m", "pytest", "-q"])
    assert len(fresh) == 1
    exe, argv, env = fresh[0]
    assert exe == sys.executable and argv == [sys.executable, "-m", "pytest", "-q"]
    assert env["LD_PRELOAD"].split()[0] == str(lib) and env[blas.ENV_GUARD] == "1"


@pytest.mark.skipif(not ON_LINUX, reason="Linux only")
def test_ensure_default_argv_is_the_original_command(fresh, monkeypatch, tmp_path: Path):
    lib = tmp_path / "libblas.so.3"
    lib.write_bytes(b"")
    monkeypatch.setenv(blas.ENV_BLAS, str(lib))
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, "-X", "dev", "-m", "tool", "a"])
    blas.ensure_fast_blas()
    assert fresh[0][1] == [sys.executable, "-X", "dev", "-m", "tool", "a"]


def test_ensure_is_a_noop_when_done_or_disabled(fresh, monkeypatch, tmp_path: Path):
    lib = tmp_path / "libblas.so.3"
    lib.write_bytes(b"")
    monkeypatch.setenv(blas.ENV_BLAS, str(lib))
    monkeypatch.setenv("LD_PRELOAD", f"/x.so {lib}")  # already preloaded
    blas.ensure_fast_blas([])
    monkeypatch.delenv("LD_PRELOAD")
    monkeypatch.setenv(blas.ENV_GUARD, "1")  # we are the re-executed child
    blas.ensure_fast_blas([])
    monkeypatch.delenv(blas.ENV_GUARD)
    monkeypatch.setenv(blas.ENV_DISABLE, "1")
    blas.ensure_fast_blas([])
    monkeypatch.delenv(blas.ENV_DISABLE)
    monkeypatch.setattr(blas, "uses_cpu_backend", lambda: False)  # GPU backend
    blas.ensure_fast_blas([])
    assert fresh == []


@pytest.mark.skipif(not ON_LINUX, reason="Linux only")
def test_missing_library_warns_once_with_apt_hint(fresh, monkeypatch):
    monkeypatch.setattr(blas, "find_fast_blas", lambda: None)
    with pytest.warns(RuntimeWarning, match="apt-get install libopenblas0-pthread"):
        blas.ensure_fast_blas([])
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        blas.ensure_fast_blas([])  # second call: silent
    assert fresh == []


_PROBE = textwrap.dedent(
    """
    import json
    from veloxquant_mlx.apps.blas import ensure_fast_blas, blas_status
    ensure_fast_blas()
    import mlx.core as mx
    mx.eval(mx.matmul(mx.ones((64, 64)), mx.ones((64, 64)), stream=mx.cpu))
    print(json.dumps(blas_status()))
    """
)


def run_probe(env: dict[str, str]) -> dict:
    res = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(res.stdout.strip().splitlines()[-1])


@needs_fast
def test_reexec_loads_openblas_in_a_subprocess():
    status = run_probe(clean_env())
    assert status["fast"] is True
    assert status["active"] == blas.find_fast_blas()
    assert any("openblas" in p or "blis" in p for p in status["libraries"])
    assert status["ld_preload"][0] == blas.find_fast_blas()


@pytest.mark.skipif(not ON_LINUX or not blas.uses_cpu_backend(), reason="mlx[cpu] on Linux")
def test_disabled_subprocess_keeps_the_reference_blas():
    status = run_probe(clean_env(**{blas.ENV_DISABLE: "1"}))
    assert status["fast"] is False and status["ld_preload"] == []
    assert "mlx_cpu.libs" in status["active"]


@needs_fast
def test_preload_for_pytest_reexecs_pytest(tmp_path: Path):
    (tmp_path / "conftest.py").write_text(
        "from veloxquant_mlx.apps.blas import preload_for_pytest\n\n\n"
        "def pytest_configure(config):\n"
        "    preload_for_pytest(config)\n"
    )
    (tmp_path / "test_probe.py").write_text(
        "from veloxquant_mlx.apps.blas import blas_status\n\n\n"
        "def test_fast():\n"
        "    import mlx.core as mx\n"
        "    mx.eval(mx.ones((8, 8)) @ mx.ones((8, 8)))\n"
        "    assert blas_status()['fast'] is True\n"
    )
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        env=clean_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    # The re-executed pytest reports to the terminal (captured fds were restored).
    assert res.returncode == 0, res.stdout + res.stderr
    assert "1 passed" in res.stdout


@pytest.mark.skipif(not ON_LINUX, reason="reads /proc/self/maps")
def test_blas_status_shape():
    status = blas.blas_status()
    assert set(status) >= {"platform", "ld_preload", "libraries", "active", "fast"}
    assert status["platform"].startswith("linux")


@pytest.mark.skipif(not ON_LINUX or not blas.uses_cpu_backend(), reason="mlx[cpu] on Linux")
def test_compare_blas_runs_both_sides():
    result = matmul_bench.compare_blas(repeats=2)
    assert result["reference"]["float32"] > 0 and result["reference"]["float16"] > 0
    assert "mlx_cpu.libs" in result["reference"]["blas"]
    if result["fast_blas"] is not None:
        assert result["preloaded"]["blas"] == result["fast_blas"]
        assert result["speedup_float32"] > 0
    table = matmul_bench.format_table(result)
    assert "float32 GFLOP/s" in table and "reference" in table


def test_matmul_gflops_small():
    assert matmul_bench.matmul_gflops(32, 32, 32, repeats=2) > 0
