"""Put a fast BLAS in front of the reference BLAS that the ``mlx[cpu]`` wheel bundles.

The Linux ``mlx[cpu]`` wheel links netlib's reference BLAS (about 6 GFLOP/s on a
float32 matmul here). Preloading an optimized ``libblas.so.3`` (OpenBLAS or BLIS)
with ``LD_PRELOAD`` interposes ``sgemm`` & co. without rebuilding MLX (about
190 GFLOP/s). ``LD_PRELOAD`` is only read when a process starts, so the current
process re-executes itself once with the variable set.

Call :func:`ensure_fast_blas` first thing in a program, before ``mlx.core`` is
imported (work done before it is thrown away by the re-exec).
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import platform
import sys
import warnings
from typing import Any

from veloxquant_mlx.apps.malloc import tune_malloc

ENV_BLAS = "VELOXQUANT_BLAS"  # explicit path of the library to preload
ENV_DISABLE = "VELOXQUANT_NO_FAST_BLAS"  # "1" turns the whole mechanism off
ENV_GUARD = "VELOXQUANT_BLAS_REEXEC"  # set in the re-executed child: never loop

# Debian/Ubuntu multiarch locations: the optimized libblas.so.3 variants first,
# then whatever the "libblas.so.3" alternative points to (checked to be fast).
_CANDIDATES = {
    "x86_64": [
        "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
        "/usr/lib/x86_64-linux-gnu/openblas-openmp/libblas.so.3",
        "/usr/lib/x86_64-linux-gnu/openblas-serial/libblas.so.3",
        "/usr/lib/x86_64-linux-gnu/blis-pthread/libblas.so.3",
        "/usr/lib/x86_64-linux-gnu/blis-openmp/libblas.so.3",
        "/usr/lib/x86_64-linux-gnu/blis-serial/libblas.so.3",
        "/usr/lib64/libopenblasp.so.0",
        "/usr/lib64/libopenblas.so.0",
    ],
    "aarch64": [
        "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
        "/usr/lib/aarch64-linux-gnu/openblas-openmp/libblas.so.3",
        "/usr/lib/aarch64-linux-gnu/openblas-serial/libblas.so.3",
        "/usr/lib/aarch64-linux-gnu/blis-pthread/libblas.so.3",
        "/usr/lib/aarch64-linux-gnu/blis-openmp/libblas.so.3",
        "/usr/lib/aarch64-linux-gnu/blis-serial/libblas.so.3",
        "/usr/lib64/libopenblasp.so.0",
        "/usr/lib64/libopenblas.so.0",
    ],
}
_FAST_NAMES = ("openblas", "blis", "mkl")

INSTALL_HINT = "sudo apt-get install libopenblas0-pthread"

logger = logging.getLogger(__name__)
_warned = False


def _is_fast(path: str) -> bool:
    """Whether a library path (after symlinks) belongs to an optimized BLAS."""
    real = os.path.realpath(path).lower()
    return any(name in real for name in _FAST_NAMES)


def find_fast_blas() -> str | None:
    """Path of an optimized ``libblas.so.3`` to preload, or ``None``.

    ``VELOXQUANT_NO_FAST_BLAS=1`` disables the search; ``VELOXQUANT_BLAS=/path``
    overrides it (returned as is when the file exists). Only Linux x86_64/aarch64.
    """
    if os.environ.get(ENV_DISABLE, "") not in ("", "0"):
        return None
    override = os.environ.get(ENV_BLAS)
    if override:
        if os.path.isfile(override):
            return override
        warnings.warn(
            f"{ENV_BLAS}={override!r} is not a file; expected the path of a "
            "libblas.so.3 (OpenBLAS or BLIS). Searching the usual places instead.",
            stacklevel=2,
        )
    if sys.platform != "linux":
        return None
    arch = platform.machine()
    candidates = list(_CANDIDATES.get(arch, []))
    # The system alternative may point at OpenBLAS/BLIS under another directory.
    triplet = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu"}.get(arch)
    if triplet:
        candidates.append(f"/usr/lib/{triplet}/libblas.so.3")
    for path in candidates:
        if os.path.isfile(path) and _is_fast(path):
            return path
    return None


def uses_cpu_backend() -> bool:
    """Whether the installed MLX runs on its CPU backend (Linux ``mlx[cpu]``).

    Decided from the installed distributions, so ``mlx.core`` is not imported.
    """
    if sys.platform != "linux":
        return False
    names = set()
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        names.add(name)
    if any(n.startswith("mlx-cuda") for n in names):
        return False
    return "mlx-cpu" in names or "mlx" in names


def _preloaded(env: dict[str, str] | os._Environ[str]) -> list[str]:
    # LD_PRELOAD accepts both spaces and colons as separators.
    raw = env.get("LD_PRELOAD", "")
    return [p for p in raw.replace(":", " ").split() if p]


def reexec_env(lib: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of the re-executed process: ``lib`` first in LD_PRELOAD."""
    new = dict(os.environ if env is None else env)
    rest = [p for p in _preloaded(new) if p != lib]
    new["LD_PRELOAD"] = " ".join([lib, *rest])
    new[ENV_GUARD] = "1"
    return new


def _warn_missing() -> None:
    global _warned
    if _warned:
        return
    _warned = True
    msg = (
        "No optimized BLAS found: MLX's CPU backend will use the reference BLAS "
        "bundled with the mlx[cpu] wheel (~30x slower float32 matmuls). "
        f"Install OpenBLAS with `{INSTALL_HINT}` or set {ENV_BLAS}=/path/to/libblas.so.3; "
        f"{ENV_DISABLE}=1 silences this."
    )
    logger.warning(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)


def ensure_fast_blas(argv: list[str] | None = None) -> None:
    """Re-execute the current process with an optimized BLAS preloaded.

    No-op off Linux, when MLX does not use its CPU backend, when disabled, when the
    library is already preloaded, or in the child of a previous re-exec. ``argv``:
    the arguments after the interpreter (default: ``sys.orig_argv[1:]``, which
    keeps ``-m module`` and interpreter flags). Does not return when it re-execs.
    Also sets glibc's malloc thresholds for MLX's CPU transients (``apps.malloc``).
    """
    tune_malloc()
    if sys.platform != "linux" or os.environ.get(ENV_GUARD):
        return
    if os.environ.get(ENV_DISABLE, "") not in ("", "0"):
        return
    if not uses_cpu_backend():
        return
    lib = find_fast_blas()
    if lib is None:
        _warn_missing()
        return
    if lib in _preloaded(os.environ):
        return
    if argv is None:
        argv = list(getattr(sys, "orig_argv", [sys.executable, *sys.argv])[1:])
    if "mlx.core" in sys.modules:
        logger.info("mlx.core was imported before ensure_fast_blas(); re-executing")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv], reexec_env(lib))


def preload_for_pytest(config: Any = None) -> None:
    """Re-exec pytest with a fast BLAS; call from ``pytest_configure(config)``.

    pytest redirects file descriptors 1/2 while it configures; the captured output
    is flushed and the descriptors restored first, so the re-executed pytest
    writes to the terminal.
    """
    tune_malloc()  # every process of the run, xdist workers included
    if sys.platform != "linux" or os.environ.get(ENV_GUARD):
        return
    # pytest-xdist workers inherit the controller's (already re-executed) env.
    if os.environ.get("PYTEST_XDIST_WORKER") or hasattr(config, "workerinput"):
        return
    lib = find_fast_blas() if uses_cpu_backend() else None
    if lib is None or lib in _preloaded(os.environ):
        if lib is None and uses_cpu_backend():
            _warn_missing()
        return
    if config is not None:
        capman = config.pluginmanager.getplugin("capturemanager")
        if capman is not None:
            capman.stop_global_capturing()
    ensure_fast_blas()


def blas_status() -> dict[str, Any]:
    """Which BLAS libraries this process has mapped (from ``/proc/self/maps``).

    ``active`` is the library whose ``sgemm`` wins: the preloaded one when it is
    mapped, else the first BLAS library mapped. ``fast`` tells if it is optimized.
    """
    status: dict[str, Any] = {
        "platform": f"{sys.platform}-{platform.machine()}",
        "ld_preload": _preloaded(os.environ),
        "libraries": [],
        "active": None,
        "fast": None,
    }
    if sys.platform == "darwin":
        # MLX on macOS links Accelerate (and runs on Metal); nothing to preload.
        status.update(active="Accelerate", fast=True)
        return status
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return status
    libs: list[str] = []
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) < 6:
            continue
        path = parts[5]
        base = os.path.basename(path).lower()
        if any(k in base for k in ("blas", "blis", "mkl_rt")) and path not in libs:
            libs.append(path)
    status["libraries"] = libs
    real_preload = {os.path.realpath(p) for p in status["ld_preload"]}
    active = next((p for p in libs if os.path.realpath(p) in real_preload), None)
    if active is None:
        # numpy's scipy_openblas exports prefixed symbols: it never serves MLX.
        mlx_side = [p for p in libs if "scipy_openblas" not in os.path.basename(p)]
        active = next((p for p in mlx_side if "mlx" in p), mlx_side[0] if mlx_side else None)
    status["active"] = active
    status["fast"] = bool(active and _is_fast(active))
    return status
