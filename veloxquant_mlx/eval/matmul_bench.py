"""CPU matmul throughput with and without a fast BLAS preloaded.

``python -m veloxquant_mlx.eval.matmul_bench`` prints a small table. The default
shape (512x576 @ 576x1536) is a SmolLM2-135M MLP projection over 512 tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from veloxquant_mlx.apps import blas

_CHILD_FLAG = "--child"


def matmul_gflops(
    m: int = 512,
    k: int = 576,
    n: int = 1536,
    dtype: str = "float32",
    repeats: int = 20,
) -> float:
    """GFLOP/s of an ``(m, k) @ (k, n)`` matmul on MLX's CPU stream (median of runs)."""
    import mlx.core as mx

    dt = getattr(mx, dtype)
    a = mx.random.normal((m, k)).astype(dt)
    b = mx.random.normal((k, n)).astype(dt)
    mx.eval(a, b)
    for _ in range(3):  # warm-up: thread pools, page faults
        mx.eval(mx.matmul(a, b, stream=mx.cpu))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(mx.matmul(a, b, stream=mx.cpu))
        times.append(time.perf_counter() - t0)
    times.sort()
    return 2.0 * m * k * n / times[len(times) // 2] / 1e9


def _child(repeats: int) -> None:
    # float16 never reaches BLAS on the MLX CPU backend; fewer repeats keep it short.
    out = {
        "float32": matmul_gflops(dtype="float32", repeats=repeats),
        "float16": matmul_gflops(dtype="float16", repeats=max(2, repeats // 5)),
        "blas": blas.blas_status()["active"],
    }
    print(json.dumps(out))


def _run_child(env: dict[str, str], repeats: int) -> dict[str, Any]:
    root = str(Path(__file__).resolve().parents[2])
    env = dict(env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env[blas.ENV_GUARD] = "1"  # the child must not re-exec itself
    cmd = [sys.executable, "-m", "veloxquant_mlx.eval.matmul_bench", _CHILD_FLAG]
    cmd.append(str(repeats))
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def compare_blas(repeats: int = 20) -> dict[str, Any]:
    """Benchmark in two subprocesses: the wheel's own BLAS vs the fast one preloaded.

    Returns ``{"fast_blas": path|None, "reference": {...}, "preloaded": {...}|None,
    "speedup_float32": float|None}``; each run dict has ``float32``/``float16``
    GFLOP/s and the active ``blas`` library.
    """
    base = dict(os.environ)
    lib = blas.find_fast_blas()
    plain = dict(base)
    plain["LD_PRELOAD"] = " ".join(p for p in blas._preloaded(base) if p != lib)
    if not plain["LD_PRELOAD"]:
        del plain["LD_PRELOAD"]
    result: dict[str, Any] = {
        "fast_blas": lib,
        "reference": _run_child(plain, repeats),
        "preloaded": None,
        "speedup_float32": None,
    }
    if lib is not None:
        fast = _run_child(blas.reexec_env(lib, base), repeats)
        result["preloaded"] = fast
        result["speedup_float32"] = fast["float32"] / result["reference"]["float32"]
    return result


def format_table(result: dict[str, Any]) -> str:
    """The result of :func:`compare_blas` as a plain-text table."""
    rows = [("BLAS", "float32 GFLOP/s", "float16 GFLOP/s", "library")]
    for label in ("reference", "preloaded"):
        r = result.get(label)
        if r is not None:
            rows.append((label, f"{r['float32']:.1f}", f"{r['float16']:.1f}", str(r["blas"])))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    if result.get("speedup_float32") is not None:
        lines.append(f"float32 speedup: {result['speedup_float32']:.1f}x")
    else:
        lines.append(f"no fast BLAS found; install one with `{blas.INSTALL_HINT}`")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """CLI entry: print the comparison table (the ``veloxquant bench --matmul`` body)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == _CHILD_FLAG:
        _child(int(argv[1]) if len(argv) > 1 else 20)
        return
    print("matmul 512x576 @ 576x1536 on the MLX CPU stream")
    print(format_table(compare_blas()))


if __name__ == "__main__":
    main()
