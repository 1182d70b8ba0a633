"""Decode steps of a batch of conversations, as a server runs them.

``python -m veloxquant_mlx.eval.batchstep --rows 8 --context 700 --methods
"kivi:bits=4;turboquant"``: every row holds about ``context`` tokens of random keys
and values (rows differ by ``spread`` tokens, as conversations do; timings do not depend
on the values) and a step decodes one token for every row. The reference is mlx_lm's
``BatchKVCache``, the dense batch cache ``mlx_lm.server`` decodes with; each method runs
in ``BatchedCache`` as ``veloxquant serve`` builds it (one attention call per layer where
the rows lie side by side). Methods and the reference alternate their order between
rounds; figures are medians over rounds. ``no_kv_ms`` is the model on the same batch
without any cache: the part of a step that no cache changes. Each round appends
``steps`` tokens to every row, so contexts grow by ``rounds * steps`` over a run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from veloxquant_mlx.adapter.builder import KVCacheBuilder
from veloxquant_mlx.adapter.mlx_lm import attention_routing
from veloxquant_mlx.cache.batch import BatchedCache
from veloxquant_mlx.eval.bench import fill_caches
from veloxquant_mlx.eval.perplexity import resolve_methods

REFERENCE = "mlx_lm BatchKVCache"


def row_lengths(rows: int, context: int, spread: int) -> list[int]:
    """``rows`` lengths spread evenly over ``context +- spread / 2``."""
    if rows < 1 or context < 1 or spread < 0:
        raise ValueError(f"rows={rows} and context={context} must be >= 1, "
                         f"spread={spread} >= 0")
    step = spread / max(rows - 1, 1)
    return [max(1, round(context - spread / 2 + i * step)) for i in range(rows)]


def _dense_rows(model: nn.Module, lengths: list[int]) -> list[Any]:
    """mlx_lm's dense batch cache per layer, rows filled with random keys and values."""
    mx.random.seed(0)
    layers = []
    for i, info in enumerate(KVCacheBuilder.layer_infos(model)):
        if info is None:
            raise ValueError(f"layer slot {i} of this model is not a KV cache; the batch "
                             "benchmark needs one in every slot")
        rows = []
        for n in lengths:
            kv = KVCache()
            kv.update_and_fetch(mx.random.normal((1, info.n_kv_heads, n, info.head_dim)),
                                mx.random.normal((1, info.n_kv_heads, n, info.v_head_dim)))
            rows.append(kv)
        merged = KVCache.merge(rows)
        mx.eval(merged.state)
        layers.append(merged)
    return layers


def _timed_steps(model: nn.Module, token: mx.array, caches: Any, steps: int) -> float:
    """Median ms of ``steps`` decode steps, each evaluated as a server does."""
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        mx.eval(model(token, cache=caches))
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def batch_steps(model: nn.Module, specs: Sequence[str] | str, rows: int = 8, context: int = 700,
                spread: int = 100, rounds: int = 6, steps: int = 4) -> list[dict[str, Any]]:
    """Median decode-step ms of a ``rows``-row batch per method, and of the reference;
    ``specs`` as :func:`eval.perplexity.resolve_methods` takes them."""
    lengths = row_lengths(rows, context, spread)
    batches: dict[str, Any] = {REFERENCE: _dense_rows(model, lengths)}
    for m in resolve_methods(specs):
        per_row = [fill_caches(model, m.source, n) for n in lengths]
        batches[m.label] = [BatchedCache(list(col)) for col in zip(*per_row)]
    token = mx.array([[1]] * rows, dtype=mx.int32)
    runs: dict[str, list[float]] = {k: [] for k in [*batches, "no KV cache"]}
    with attention_routing(model):
        for r in range(rounds + 1):  # the first round warms up (compiles kernels)
            order = list(batches) if r % 2 else list(batches)[::-1]
            for label in order:
                ms = _timed_steps(model, token, batches[label], steps)
                if r:
                    runs[label].append(ms)
            ms = _timed_steps(model, token, None, steps)
            if r:
                runs["no KV cache"].append(ms)
    ref = statistics.median(runs[REFERENCE])
    return [{"method": k, "rows": rows, "context": context, "step_ms": statistics.median(v),
             "vs_reference": ref / statistics.median(v)} for k, v in runs.items()]


def markdown(results: list[dict[str, Any]]) -> str:
    """The results as a Markdown table."""
    lines = ["| batch cache | rows x context | step ms | tokens/s vs mlx_lm's |",
             "|---|---|---:|---:|"]
    for r in results:
        lines.append(f"| {r['method']} | {r['rows']} x {r['context']} | "
                     f"{r['step_ms']:.1f} | {r['vs_reference']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Command line: print the table."""
    p = argparse.ArgumentParser(prog="python -m veloxquant_mlx.eval.batchstep")
    p.add_argument("--methods", default="none;kivi:bits=4;turboquant",
                   help="method specs separated by ';' (or by ',' where unambiguous)")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--context", type=int, default=700, help="mean tokens per row")
    p.add_argument("--spread", type=int, default=100, help="longest minus shortest row")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=4, help="decode steps per round")
    args = p.parse_args(argv)
    from veloxquant_mlx.models import load

    model, _ = load()
    print(markdown(batch_steps(model, args.methods, args.rows, args.context,
                               args.spread, args.rounds, args.steps)))


if __name__ == "__main__":
    from veloxquant_mlx.apps.blas import ensure_fast_blas

    ensure_fast_blas()
    main()
