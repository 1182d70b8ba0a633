"""The runs behind ``veloxquant eval`` and ``veloxquant bench``, written to disk.

``run_eval``: paired quality (perplexity task) or retrieval accuracy of every method at
each context of a list, with real memory; one JSON record with everything needed to
re-plot (per-window and per-block stats, command line, versions, seeds).

``run_sweep`` (``bench``): speed and real memory at each bench context
(:func:`bench_methods`) and paired quality at one context (:func:`evaluate_quality`);
and the peak over the weights on mlx_lm's own path beside mlx_lm's dense and 4-bit caches
at each bench context (:func:`peak_rows`; ``eval`` adds the same table at each of its
contexts); writes ``bench.json``, ``bench.md`` (tables) and ``bench.png`` (real memory ratio vs
perplexity change and vs KL, 95% intervals as error bars) into ``out_dir``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.nn as nn

from veloxquant_mlx.eval.bench import bench_methods, peak_rows
from veloxquant_mlx.eval.perplexity import Spec, resolve_methods
from veloxquant_mlx.eval.quality import evaluate_quality
from veloxquant_mlx.eval.report import (
    EVAL_COLUMNS,
    RETRIEVAL_COLUMNS,
    _fmt,
    _mib,
    markdown_table,
    plot_tradeoff,
    run_record,
    write_json,
)
from veloxquant_mlx.eval.text import encode, load_text

# bench --quick: about a minute on the embedded model (2 idle cores).
QUICK = {"contexts": (512,), "eval_context": 512, "predict": 64, "windows": 2, "block": 16,
         "n_boot": 1000, "decode_steps": 16, "repeats": 3}
FULL = {"contexts": (512, 2048, 4096), "eval_context": 2048, "predict": 256, "windows": 8,
        "block": 32, "n_boot": 2000, "decode_steps": 32, "repeats": 3}

# eval: windows None = 8 up to 2k context, 4 beyond (quality.default_windows).
EVAL_QUICK = {"contexts": (512,), "predict": 64, "windows": 2, "block": 16, "n_boot": 1000,
              "samples": 6, "memory_steps": 8}
EVAL_FULL = {"contexts": (2048,), "predict": 256, "windows": None, "block": 32,
             "n_boot": 2000, "samples": 20, "memory_steps": 16}

BENCH_COLUMNS = [
    ("method", "method", None),
    ("context", "context", None),
    ("real MiB", "real_bytes", _mib),
    ("real MiB after decode", "real_decode_bytes", _mib),
    ("real/fp16", "mem_ratio", None),
    ("declared MiB", "held_bytes", _mib),
    ("real/declared", "real_over_declared", None),
    ("declared/fp16", "declared_ratio", None),
    ("prefill tok/s", "prefill_tok_s", lambda v: _fmt(v, 1)),
    ("prefill/dense", "prefill_ratio", lambda v: _fmt(v, 2)),
    ("decode tok/s", "decode_tok_s", lambda v: _fmt(v, 1)),
    ("decode/dense", "decode_ratio", lambda v: _fmt(v, 2)),
    ("GFLOPs/step", "step_flops", lambda v: _fmt(v / 1e9, 2)),
    ("roofline limit", "roofline_limit", lambda v: _fmt(v, 2)),
    ("of limit", "of_limit", lambda v: _fmt(v, 2)),
    ("steady/dense", "steady_ratio", lambda v: _fmt(v, 2)),
    ("steady of limit", "steady_of_limit", lambda v: _fmt(v, 2)),
    ("serial limit", "serial_limit", lambda v: _fmt(v, 2)),
    ("of serial", "of_serial", lambda v: _fmt(v, 2)),
    ("bound ms/step", "bound_step_s", lambda v: _fmt(v * 1e3, 1)),
    ("of bound", "of_bound", lambda v: _fmt(v, 2)),
    ("MLX peak MiB", "peak_mem_bytes", _mib),
    ("peak over base MiB", "peak_over_base_bytes", _mib),
    ("RSS MiB", "rss_bytes", _mib),
]

PEAK_COLUMNS = [
    ("method", "method", None),
    ("context", "context", None),
    ("peak MiB", "peak_bytes", _mib),
    ("retained MiB", "retained_bytes", _mib),
    ("working MiB", "working_bytes", _mib),
    ("peak/mlx_lm:dense", "peak_over_dense", lambda v: _fmt(v, 2)),
]


def peak_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The peak table and its caption (nothing without rows)."""
    if not rows:
        return []
    r = rows[0]
    return [f"Peak on mlx_lm's own path (generate_step with prompt_cache=, prompt step "
            f"{r['prefill_step']}, {r['decode_steps']} greedy tokens): peak = "
            "mx.get_peak_memory() over the prompt and the tokens, retained = bytes alive "
            "after them, both over the weights (MLX's buffer cache off); working = peak - "
            "retained. mlx_lm:dense and mlx_lm:q4 are mlx_lm's KVCache and "
            "QuantizedKVCache(bits=4, group_size=64) in the same run.",
            "", markdown_table(rows, PEAK_COLUMNS), ""]


def resolve_params(defaults: dict[str, Any], **given: Any) -> dict[str, Any]:
    """``defaults`` with every given (not ``None``) value in its place."""
    p = dict(defaults)
    p.update({k: v for k, v in given.items() if v is not None})
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in p.items()}


# ------------------------------------------------------------------ eval
def run_eval(model: nn.Module, tokenizer: Any, specs: Sequence[Spec] | str,
             task: str = "ppl", params: dict[str, Any] | None = None, *,
             text: str | None = None, text_name: str | None = None, seed: int = 0,
             chunk: int = 512, recon: bool = False, depths: Sequence[float] = (0.1, 0.3,
             0.5, 0.7, 0.9), n_needles: int = 4, max_tokens: int = 16,
             argv: list[str] | None = None, progress: bool = True,
             prompt_format: str = "auto", peak: bool = True) -> dict[str, Any]:
    """Quality or retrieval of every method at each of ``params["contexts"]``.

    ``params``: ``EVAL_FULL`` keys (contexts, predict, windows, block, n_boot, samples,
    memory_steps); missing ones take the ``EVAL_FULL`` values. ``peak``: also the peak
    table per context (one more run per method and of mlx_lm's caches at each context).
    """
    from veloxquant_mlx.eval.retrieval import evaluate_retrieval

    p = resolve_params(EVAL_FULL, **(params or {}))
    resolve_methods(specs)  # every spec is checked before anything runs
    text = load_text() if text is None else text
    results = []
    tokens = encode(tokenizer, text)
    if task == "ppl":
        for ctx in p["contexts"]:
            results.append(evaluate_quality(
                model, tokenizer, specs, ctx, p["predict"], p["windows"], tokens=tokens,
                seed=seed, chunk=chunk, block=p["block"], n_boot=p["n_boot"],
                memory_steps=p["memory_steps"], recon=recon, progress=progress))
    else:
        for ctx in p["contexts"]:
            rows = evaluate_retrieval(model, tokenizer, specs, task, ctx, list(depths),
                                      p["samples"], seed, n_needles, max_tokens, chunk,
                                      text=text, progress=progress,
                                      prompt_format=prompt_format)
            results.append({"context": ctx, "samples": p["samples"], "depths": list(depths),
                            "rows": rows})
    if peak:
        _add_peaks(model, tokens, specs, results, progress)
    return run_record(argv, task=task, seed=seed, params=p, text=text_name or
                      "stdlib docstrings", chunk=chunk, results=results)


def _add_peaks(model: nn.Module, tokens: list[int], specs: Sequence[Spec] | str,
               results: list[dict[str, Any]], progress: bool) -> None:
    """Each result gets the peak table at its context (``peak``); not on a sharded run,
    where one rank's peak is not the method's."""
    from veloxquant_mlx.apps.distributed import world

    if world() is not None:
        return
    for res in results:
        if res["context"] <= len(tokens):
            res["peak"] = peak_rows(model, tokens, specs, [res["context"]],
                                    progress=progress)


def eval_markdown(record: dict[str, Any]) -> str:
    """One titled table per context of a ``run_eval`` record."""
    out = [f"Command: `{record['command']}`", ""]
    for res in record["results"]:
        if record["task"] == "ppl":
            out.append(f"Perplexity task: context {res['context']}, {res['predict']} "
                       f"predicted tokens x {res['windows']} windows, seed {res['seed']}; "
                       f"95% intervals: paired bootstrap over blocks of {res['block']} "
                       f"tokens ({res['n_boot']} resamples). Memory: real = allocator "
                       "bytes after prefill; declared = cache_stats held bytes.")
            table = markdown_table(res["rows"], EVAL_COLUMNS)
        else:
            out.append(f"Task {record['task']}: context {res['context']}, {res['samples']} "
                       f"samples per method (depths {res['depths']}), seed {record['seed']}; "
                       "the same samples for every method.")
            table = markdown_table(res["rows"], RETRIEVAL_COLUMNS)
        out += ["", table, ""] + peak_markdown(res.get("peak", []))
    return "\n".join(out)


# ------------------------------------------------------------------ bench
def _borrow_memory(quality: list[dict[str, Any]], speed: list[dict[str, Any]],
                   context: int) -> None:
    """Quality rows take the real memory that bench measured at the same context."""
    keys = ("real_bytes", "real_decode_bytes", "held_bytes", "accounted_bytes", "fp16_bytes",
            "mem_ratio", "mem_ratio_decode", "declared_ratio", "real_over_declared")
    by = {r["method"]: r for r in speed if r["context"] == context}
    for r in quality:
        if r["method"] in by:
            r.update({k: by[r["method"]][k] for k in keys})


def run_sweep(model: nn.Module, tokenizer: Any, specs: Sequence[Spec] | str,
              out_dir: str | Path = "bench-out", quick: bool = False,
              contexts: Sequence[int] | None = None, eval_context: int | None = None,
              predict: int | None = None, windows: int | None = None,
              decode_steps: int | None = None, repeats: int | None = None,
              text: str | None = None, text_path: str | None = None, seed: int = 0,
              chunk: int = 512, argv: list[str] | None = None,
              progress: bool = True) -> dict[str, Any]:
    """Run speed + memory and quality for every spec; write JSON, Markdown and PNG."""
    p = resolve_params(QUICK if quick else FULL, contexts=contexts, eval_context=eval_context,
                       predict=predict, windows=windows, decode_steps=decode_steps,
                       repeats=repeats)
    resolve_methods(specs)  # every spec is checked before anything runs
    if text is None:
        text = load_text(text_path)
    tokens = encode(tokenizer, text)
    speed = bench_methods(model, tokens, specs, p["contexts"], p["decode_steps"],
                          p["repeats"], chunk, progress=progress)
    peak = peak_rows(model, tokens, specs, p["contexts"], progress=progress)
    # windows=0: speed and memory only (the quality part is skipped).
    quality = {"rows": [], "pairs": []} if p["windows"] == 0 else _quality(
        model, tokenizer, specs, p, tokens, speed, seed, chunk, progress)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    record = run_record(argv, seed=seed, params=p, text=text_path or "stdlib docstrings",
                        quality=quality["rows"], pairs=quality["pairs"], speed=speed,
                        peak=peak)
    write_json(out / "bench.json", record)
    record["files"] = {"json": str(out / "bench.json"), "md": str(out / "bench.md"),
                       "png": "(no plot: quality skipped)"}
    png_name = None
    if quality["rows"]:
        png = plot_tradeoff(quality["rows"], out / "bench.png",
                            title=f"real memory vs quality (context {p['eval_context']})")
        png_name, record["files"]["png"] = png.name, str(png)
    (out / "bench.md").write_text(sweep_markdown(record, png_name))
    return record


def _quality(model: nn.Module, tokenizer: Any, specs: Sequence[Spec] | str,
             p: dict[str, Any], tokens: list[int], speed: list[dict[str, Any]], seed: int,
             chunk: int, progress: bool) -> dict[str, Any]:
    """The quality part of a sweep; memory borrowed from bench at a shared context."""
    shared = p["eval_context"] in p["contexts"]
    quality = evaluate_quality(model, tokenizer, specs, p["eval_context"], p["predict"],
                               p["windows"], tokens=tokens, seed=seed, chunk=chunk,
                               block=p["block"], n_boot=p["n_boot"],
                               memory_steps=None if shared else p["decode_steps"],
                               progress=progress)
    if shared:
        _borrow_memory(quality["rows"], speed, p["eval_context"])
    return quality


def sweep_markdown(record: dict[str, Any], png_name: str | None = "bench.png") -> str:
    """The Markdown report of a sweep record (no quality part when it was skipped)."""
    p = record["params"]
    out = [f"Command: `{record['command']}`", ""]
    if record["quality"]:
        out += [
            f"Quality: context {p['eval_context']}, {p['predict']} predicted tokens x "
            f"{p['windows']} window(s), seed {record['seed']}; 95% intervals: paired "
            f"bootstrap over blocks of {p['block']} tokens ({p['n_boot']} resamples).",
            "", markdown_table(record["quality"], EVAL_COLUMNS), ""]
    out += [
        f"Speed and memory: {p['decode_steps']} decode steps, median of {p['repeats']} "
        "interleaved repeats. real = bytes MLX's allocator keeps alive for the caches "
        "(after prefill / after the decode steps); declared = cache_stats held bytes; "
        "MLX peak = mx.get_peak_memory() over prefill and decode, peak over base = the "
        "same minus what was alive before (the weights); roofline limit = the decode/dense "
        "a step bound by its bytes (weights + KV) or its FLOPs (matmuls + attention), at "
        "this machine's measured read and matmul rates, would reach; of limit = "
        "decode/dense over it; serial limit = the same with the weights' matmuls and the "
        "attention each bound on its own and added (a CPU runs one op after the other), "
        "of serial = decode/dense over it; bound ms/step = that serial bound in "
        "milliseconds, of bound = it over the measured mean step, against the machine "
        "rather than dense (docs/cpu-performance.md).",
        "", markdown_table(record["speed"], BENCH_COLUMNS), ""]
    out += peak_markdown(record.get("peak", []))
    if png_name:
        out += [f"![real memory vs quality]({png_name})", ""]
    return "\n".join(out)


def write_eval_outputs(record: dict[str, Any], json_path: str | None,
                       plot_path: str | None) -> list[str]:
    """Write the eval record's JSON and (perplexity task) plot; the paths written."""
    written = []
    if json_path:
        written.append(str(write_json(json_path, record)))
    if plot_path and record["task"] == "ppl":
        for res in record["results"]:
            path = Path(plot_path)
            if len(record["results"]) > 1:
                path = path.with_name(f"{path.stem}-{res['context']}{path.suffix}")
            written.append(str(plot_tradeoff(
                res["rows"], path, title=f"real memory vs quality (context {res['context']})")))
    return written
