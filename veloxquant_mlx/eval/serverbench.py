"""Server throughput: ``veloxquant serve`` with compressed caches vs ``mlx_lm.server``.

Both servers run on 127.0.0.1 in subprocesses on the same model (the embedded model's
converted folder by default) with the same CPU BLAS, one after the other. For each
concurrency level ``c`` (1, 4, 8 by default) ``c`` clients send ``rounds * c`` chat
requests of the same prompt length and ``max_tokens``; the table gives completion
tokens per second over the wall time, latency p50 / p95, and the servers' resident
memory (for ours also the real KV bytes read between batch steps, ``/limits``).
Bounded: every request has a timeout and the run a deadline.

    python -m veloxquant_mlx.eval.serverbench --method kivi:bits=4 --method affine:bits=4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from veloxquant_mlx.apps.malloc import child_env
from veloxquant_mlx.eval.loadtest import (
    ENGLISH,
    ServerProcess,
    Spec,
    chat,
    get_json,
    run_specs,
    summarize,
    words,
)

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"


def model_folder() -> str:
    """The embedded model converted to an mlx_lm folder (what ``load()`` reads)."""
    from veloxquant_mlx.models import cached_conversion, default_model_path

    folder, _ = cached_conversion(default_model_path(), "float32")
    return str(folder)


class MlxLmServer(ServerProcess):
    """mlx_lm's own server (dense caches) on 127.0.0.1, the baseline."""

    def __init__(self, model: str, log_path: Path | None = None) -> None:
        from veloxquant_mlx.registry import reference

        super().__init__(reference(), "0", model=None, log_path=log_path)
        self.cmd = [sys.executable, "-m", "mlx_lm.server", "--model", model,
                    "--host", "127.0.0.1", "--port", str(self.port)]

    def __enter__(self) -> MlxLmServer:
        # Our CLI preloads the fast BLAS and sets malloc's thresholds itself; give
        # mlx_lm's server the same process.
        extra = child_env({})
        if Path(OPENBLAS).exists() and "LD_PRELOAD" not in os.environ:
            extra["LD_PRELOAD"] = OPENBLAS
        saved = {k: os.environ.get(k) for k in extra}
        os.environ.update(extra)
        try:
            return super().__enter__()
        finally:
            for k, v in saved.items():
                if v is None:
                    del os.environ[k]
                else:
                    os.environ[k] = v


def _rss(proc: subprocess.Popen | None) -> int | None:
    try:
        import psutil

        return psutil.Process(proc.pid).memory_info().rss if proc else None
    except Exception:
        return None


def _level(server: ServerProcess, clients: int, rounds: int, prompt_words: int,
           max_tokens: int, deadline: float) -> dict[str, Any]:
    specs = [Spec("short", chat(words(prompt_words, ENGLISH, seed=i), max_tokens),
                  timeout=600.0) for i in range(rounds * clients)]
    results, wall, peaks = run_specs(server.port, specs, clients, deadline)
    row = summarize(results, wall)
    row.update(clients=clients, rss_bytes=_rss(server.proc),
               kv_real_peak_bytes=peaks.get("kv_real_bytes"))
    return row


def bench_server(label: str, server: ServerProcess, levels: Sequence[int], rounds: int,
                 prompt_words: int, max_tokens: int, deadline: float) -> list[dict[str, Any]]:
    rows = []
    with server:
        for c in levels:
            row = _level(server, c, rounds, prompt_words, max_tokens, deadline)
            row["server"] = label
            if label != "mlx_lm.server":
                row["limits"] = get_json(server.port, "/limits")[1].get("kv_cost")
            rows.append(row)
    return rows


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    base = {r["clients"]: r["tokens_per_s"] for r in rows if r["server"] == "mlx_lm.server"}
    out = ["| server | clients | ok / failed | tokens/s | vs mlx_lm.server | p50 s | p95 s "
           "| RSS MiB | real KV peak MiB |", "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = r["tokens_per_s"] / base[r["clients"]] if base.get(r["clients"]) else None
        kv = r.get("kv_real_peak_bytes")
        out.append(
            f"| {r['server']} | {r['clients']} | {r['ok']} / {r['failed']} | "
            f"{r['tokens_per_s']:.2f} | {'-' if ratio is None else f'{ratio:.2f}'} | "
            f"{r['latency_p50_s'] or 0:.1f} | {r['latency_p95_s'] or 0:.1f} | "
            f"{(r['rss_bytes'] or 0) / 2**20:.0f} | {'-' if kv is None else f'{kv / 2**20:.1f}'} |")
    return "\n".join(out)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m veloxquant_mlx.eval.serverbench",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--method", action="append", default=None,
                   help="compressed method for veloxquant serve (repeatable)")
    p.add_argument("--levels", default="1,4,8", help="concurrent clients per level")
    p.add_argument("--rounds", type=int, default=2, help="requests per client per level")
    p.add_argument("--prompt-words", type=int, default=300)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-kv-memory", default="1GB")
    p.add_argument("--deadline", type=float, default=3600.0, help="seconds for the run")
    p.add_argument("--json", default=None)
    p.add_argument("--log-dir", default=None)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    levels = [int(x) for x in args.levels.split(",") if x.strip()]
    folder = model_folder()
    deadline = time.monotonic() + args.deadline
    logs = Path(args.log_dir) if args.log_dir else None
    if logs:
        logs.mkdir(parents=True, exist_ok=True)

    def log(name: str) -> Path | None:
        return logs / f"{name}.log" if logs else None

    rows = bench_server("mlx_lm.server", MlxLmServer(folder, log("mlx_lm")), levels,
                        args.rounds, args.prompt_words, args.max_tokens, deadline)
    for method in args.method or ["kivi:bits=4"]:
        server = ServerProcess(method, args.max_kv_memory, model=folder,
                               log_path=log(method.replace(":", "_")))
        rows += bench_server(f"veloxquant {method}", server, levels, args.rounds,
                             args.prompt_words, args.max_tokens, deadline)
    print(markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"argv": sys.argv, "rows": rows}, indent=2,
                                              default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
