"""A sweep over method settings: quality (perplexity) and speed/memory, written to disk.

``run_sweep`` scores every spec with :func:`evaluate_methods` at one context, runs
:func:`bench_methods` at each bench context, and writes ``bench.json`` (rows, command
line, library versions, seeds), ``bench.md`` (tables) and ``bench.png`` (memory ratio
vs perplexity change, Pareto front) into ``out_dir``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.nn as nn

from .bench import bench_methods
from .perplexity import Spec, evaluate_methods, parse_specs
from .report import EVAL_COLUMNS, _fmt, _mib, markdown_table, plot_tradeoff, run_record, write_json
from .text import encode, load_text

# --quick: short context, one window, few decode steps (a few minutes on 2 cores).
QUICK = {"contexts": (512,), "eval_context": 512, "predict": 64, "windows": 1,
         "decode_steps": 16, "repeats": 3}
FULL = {"contexts": (512, 2048, 4096), "eval_context": 2048, "predict": 256, "windows": 2,
        "decode_steps": 32, "repeats": 3}

BENCH_COLUMNS = [
    ("method", "method", None),
    ("context", "context", None),
    ("held MiB", "held_bytes", _mib),
    ("fp16 MiB", "fp16_bytes", _mib),
    ("held/fp16", "mem_ratio", None),
    ("accounted/held", "accounted_over_held", None),
    ("prefill tok/s", "prefill_tok_s", lambda v: _fmt(v, 1)),
    ("prefill/dense", "prefill_ratio", lambda v: _fmt(v, 2)),
    ("decode tok/s", "decode_tok_s", lambda v: _fmt(v, 1)),
    ("decode/dense", "decode_ratio", lambda v: _fmt(v, 2)),
    ("MLX peak MiB", "peak_mem_bytes", _mib),
    ("RSS MiB", "rss_bytes", _mib),
]


def run_sweep(model: nn.Module, tokenizer: Any, specs: Sequence[Spec] | str,
              out_dir: str | Path = "bench-out", quick: bool = False,
              contexts: Sequence[int] | None = None, eval_context: int | None = None,
              predict: int | None = None, windows: int | None = None,
              decode_steps: int | None = None, repeats: int | None = None,
              text: str | None = None, text_path: str | None = None, seed: int = 0,
              chunk: int = 512, argv: list[str] | None = None,
              progress: bool = True) -> dict[str, Any]:
    """Run quality + speed for every spec; write JSON, Markdown and PNG; return the record."""
    p = dict(QUICK if quick else FULL)
    given = {"contexts": contexts, "eval_context": eval_context, "predict": predict,
             "windows": windows, "decode_steps": decode_steps, "repeats": repeats}
    p.update({k: v for k, v in given.items() if v is not None})
    parse_specs(specs)  # every spec is checked before anything runs
    if text is None:
        text = load_text(text_path)
    quality = evaluate_methods(model, tokenizer, specs, p["eval_context"], p["predict"],
                               p["windows"], text=text, seed=seed, chunk=chunk,
                               progress=progress)
    tokens = encode(tokenizer, text)
    speed = bench_methods(model, tokens, specs, p["contexts"], p["decode_steps"],
                          p["repeats"], chunk, progress=progress)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    record = run_record(argv, seed=seed, params={k: (list(v) if isinstance(v, tuple) else v)
                                                 for k, v in p.items()},
                        text=text_path or "stdlib docstrings", quality=quality, speed=speed)
    write_json(out / "bench.json", record)
    png = plot_tradeoff(quality, out / "bench.png",
                        title=f"memory vs perplexity (context {p['eval_context']})")
    md = sweep_markdown(record, png.name)
    (out / "bench.md").write_text(md)
    record["files"] = {"json": str(out / "bench.json"), "md": str(out / "bench.md"),
                       "png": str(png)}
    return record


def sweep_markdown(record: dict[str, Any], png_name: str = "bench.png") -> str:
    """The Markdown report of a sweep record."""
    p = record["params"]
    return "\n".join([
        f"Command: `{record['command']}`",
        "",
        f"Quality: context {p['eval_context']}, {p['predict']} predicted tokens, "
        f"{p['windows']} window(s), seed {record['seed']}.",
        "",
        markdown_table(record["quality"], EVAL_COLUMNS),
        "",
        f"Speed and memory: {p['decode_steps']} decode steps, median of {p['repeats']} "
        "interleaved repeats.",
        "",
        markdown_table(record["speed"], BENCH_COLUMNS),
        "",
        f"![memory vs perplexity]({png_name})",
        "",
    ])
