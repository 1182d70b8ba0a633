"""Measure the at-rest format: bytes on disk, quality after a restore, save/restore time.

``python -m veloxquant_mlx.eval.at_rest`` (OpenBLAS preloaded on Linux) calibrates on one
slice of the text, prefills a ``--context``-token history from another with mlx_lm's
dense caches, saves it at rest at each bits budget and window, restores it into dense
caches and scores the next ``--predict`` tokens teacher-forced against the uncompressed
conversation: mean KL(reference || restored) and top-1 agreement, each with a 95%
bootstrap interval over tokens. It also reports the live compressed forms
(``kivi:bits=4``, ``turboquant``) of the same history, and a re-prefill's time.
Prints one JSON object (``--out`` writes it too).
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from veloxquant_mlx.adapter.builder import KVCacheBuilder, cache_stats
from veloxquant_mlx.apps.at_rest import (
    Calibration,
    calibrate_at_rest,
    held_layers,
    load_at_rest,
    restore_caches,
    save_at_rest,
)
from veloxquant_mlx.eval.perplexity import parse_specs
from veloxquant_mlx.eval.quality import bootstrap_ci
from veloxquant_mlx.eval.text import encode, load_text


def prefill(model: nn.Module, tokens: list[int], caches: list[Any], chunk: int = 512) -> float:
    """Seconds to run ``tokens`` through ``model`` into ``caches``."""
    t0 = time.perf_counter()
    for s in range(0, len(tokens), chunk):
        model(mx.array(tokens[s: s + chunk])[None], cache=caches)
        mx.eval([c.state for c in caches])
    return time.perf_counter() - t0


def next_token_scores(model: nn.Module, caches: list[Any], follow: list[int]) -> mx.array:
    """Log-probabilities ``[T, V]`` of the teacher-forced tokens after ``caches``."""
    logits = model(mx.array(follow)[None], cache=caches)[0].astype(mx.float32)
    out = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.eval(out)
    return out


def compare(ref: mx.array, got: mx.array) -> dict[str, Any]:
    """Mean KL(ref || got) and top-1 agreement over tokens, with 95% bootstrap intervals."""
    kl = np.asarray(mx.sum(mx.exp(ref) * (ref - got), axis=-1))
    agree = np.asarray(mx.argmax(ref, axis=-1) == mx.argmax(got, axis=-1)).astype(np.float64)
    return {"kl": float(kl.mean()), "kl_ci95": list(bootstrap_ci(kl)),
            "top1": float(agree.mean()), "top1_ci95": list(bootstrap_ci(agree))}


def live_forms(model: nn.Module, dense: list[Any], follow: list[int], ref: mx.array,
               specs: str) -> list[dict[str, Any]]:
    """Bytes the live compressed caches of ``specs`` hold for the same history, and their
    KL/top-1: built from the dense keys/values as a prefill feeds them (no forward pass:
    the held form is the same, and a lossy method's prefill would also perturb deeper
    layers' inputs, which a restore does not)."""
    layers = held_layers(dense, KVCacheBuilder.layer_infos(model))
    rows = []
    for label, config in parse_specs(specs):
        caches = restore_caches(model, layers, config)
        stats = cache_stats(caches)
        rows.append({"method": label, "held_bytes": stats["held_bytes"],
                     "fp16_bytes": stats["fp16_bytes"],
                     "ratio_vs_fp16": round(stats["fp16_bytes"] / stats["held_bytes"], 2),
                     **compare(ref, next_token_scores(model, caches, follow))})
        print(json.dumps(rows[-1]), flush=True)
        KVCacheBuilder.detach(model)
    return rows


def frontier(model: nn.Module, dense: list[Any], follow: list[int], ref: mx.array,
             cal: Calibration, bits_list: list[float], windows: list[int],
             sinks: int) -> list[dict[str, Any]]:
    """One row per (window, bits): size, ratio, KL/top-1 and save/restore seconds."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "at_rest.safetensors"
        for window in windows:
            for bits in bits_list:
                stats = save_at_rest(path, model, dense, bits=bits, sinks=sinks,
                                     window=window, calibration=cal)
                t0 = time.perf_counter()
                restored = load_at_rest(path, model, None, calibration=cal)
                mx.eval([c.state for c in restored])
                restore_s = time.perf_counter() - t0
                got = next_token_scores(model, restored, follow)
                rows.append({"window": window, "sinks": sinks, "bits": bits,
                             "bytes": stats["bytes"], "ratio_vs_fp16": round(stats["ratio"], 2),
                             "save_s": round(stats["seconds"], 2),
                             "restore_s": round(restore_s, 2), **compare(ref, got)})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m veloxquant_mlx.eval.at_rest",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model (default: the embedded SmolLM2)")
    p.add_argument("--text", default=None, help="text file (default: stdlib docstrings)")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--predict", type=int, default=128)
    p.add_argument("--calibrate", type=int, default=1024, help="calibration tokens")
    p.add_argument("--bits", default="0.5,1,2,3,4")
    p.add_argument("--windows", default="32")
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--per-head", action="store_true",
                   help="one basis per KV head (default: one per layer over all its heads)")
    p.add_argument("--live", default="kivi:bits=4,turboquant",
                   help="live methods to compare ('' for none)")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the measurement; print and return the JSON report."""
    from veloxquant_mlx.models import load

    a = _args(argv)
    model, tokenizer = load(a.model)
    ids = encode(tokenizer, load_text(a.text))
    need = a.calibrate + a.context + a.predict
    if len(ids) < need:
        raise ValueError(f"the text has {len(ids)} tokens; {need} are needed")
    # Calibration and conversation come from disjoint parts of the text.
    cal_ids, conv = ids[: a.calibrate], ids[len(ids) // 2:][: a.context + a.predict]
    history, follow = conv[: a.context], conv[a.context:]
    t0 = time.perf_counter()
    cal = calibrate_at_rest(model, cal_ids, save=False, joint_heads=not a.per_head)
    calibrate_s = time.perf_counter() - t0
    dense = make_prompt_cache(model)
    prefill_s = prefill(model, history, dense)
    ref = next_token_scores(model, copy.deepcopy(dense), follow)
    report: dict[str, Any] = {
        "context": a.context, "predict": a.predict, "calibrate_tokens": a.calibrate,
        "joint_heads": not a.per_head,
        "calibrate_s": round(calibrate_s, 2), "reprefill_s": round(prefill_s, 2),
    }
    print(json.dumps(report), flush=True)  # a long run killed later still reports these
    bits = [float(b) for b in a.bits.split(",") if b]
    report["frontier"] = frontier(model, dense, follow, ref, cal, bits,
                                  [int(w) for w in a.windows.split(",")], a.sinks)
    report["live"] = live_forms(model, dense, follow, ref, a.live) if a.live else []
    print(json.dumps(report, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1), encoding="utf-8")
    return report


if __name__ == "__main__":
    main()
