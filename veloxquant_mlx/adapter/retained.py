"""What a method's caches really keep alive, read from MLX's allocator.

In the adapter layer: it builds caches with the builder, and the server's memory budget
(``apps.server_limits``) measures with it as the tools (``eval``) do.

``measure_retained`` reads ``memory.active_bytes()`` (``mx.get_active_memory()`` after
``gc.collect()`` and ``mx.clear_cache()``) before the caches exist, right after the
prefill and after the decode steps. The differences are the bytes the caches and everything the method
installed on the model keep alive: buffers a kept slice pins, coordinators, hooks with
their own arrays. ``cache_stats(caches)["held_bytes"]`` (what the caches declare) is
reported beside it as a second opinion; ``real / declared`` far from 1 means the
declaration misses something (or counts something twice).

Nothing of the harness may be alive across a reading and freed before the next one:
the logits of the last step are dropped before each reading, the prompt array is built
before the first, and ``KVCacheBuilder.detach(model)`` runs before the first so that a
hook installed by an earlier build is rebuilt (and counted) inside the interval.

``measure_user_path`` reads the PEAK as a user meets it: the prompt and a few greedy
tokens through mlx_lm's own ``generate_step`` (what ``stream_generate`` runs) with the
caches as ``prompt_cache``; ``MLX_LM_CACHES`` are mlx_lm's dense and 4-bit caches, to
measure beside the methods.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from veloxquant_mlx.adapter.builder import KVCacheBuilder, cache_stats
from veloxquant_mlx.adapter.prefill import prefill
from veloxquant_mlx.config import KVCacheConfig
from veloxquant_mlx.memory import active_bytes, no_buffer_cache

# A config, or a function building the caches (lets tests measure hand-made caches).
CacheSource = KVCacheConfig | Callable[[nn.Module], list[Any]]


def build_caches(model: nn.Module, source: CacheSource) -> list[Any]:
    """The caches of ``source`` for ``model`` (a config goes through the builder)."""
    if isinstance(source, KVCacheConfig):
        return KVCacheBuilder.for_model(model, source)
    return source(model)


def _decode(model: nn.Module, caches: list[Any], token: int, steps: int,
            forced: Sequence[int] | None) -> list[float]:
    """``steps`` single-token decode steps: teacher-forced, or greedy from ``token``;
    the wall seconds of each."""
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        tok = forced[i] if forced is not None else token
        logits = model(mx.array([[tok]], dtype=mx.int32), cache=caches)
        if forced is None:
            token = int(mx.argmax(logits[0, -1]).item())
        else:
            mx.eval(logits)
        del logits
        times.append(time.perf_counter() - t0)
    return times


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def _point(real: int, caches: list[Any], tag: str) -> dict[str, Any]:
    s = cache_stats(caches)
    return {
        f"real_{tag}_bytes": real,
        f"declared_{tag}_bytes": s["held_bytes"],
        f"accounted_{tag}_bytes": s["accounted_bytes"],
        f"fp16_{tag}_bytes": s["fp16_bytes"],
        f"decode_flops_{tag}": s["decode_flops"],
        f"real_over_declared_{tag}": _ratio(real, s["held_bytes"]),
        f"real_over_fp16_{tag}": _ratio(real, s["fp16_bytes"]),
        f"declared_over_fp16_{tag}": _ratio(s["held_bytes"], s["fp16_bytes"]),
    }


def measure_retained(model: nn.Module, config: CacheSource, tokens: Sequence[int],
                     decode_steps: int = 16, chunk: int = 512,
                     decode_tokens: Sequence[int] | None = None) -> dict[str, Any]:
    """Real (allocator) and declared bytes after prefill and after ``decode_steps``.

    ``tokens`` is the prompt. Decode steps are greedy from the prompt's last logits,
    or teacher-forced with ``decode_tokens`` (the same tokens for every method).
    Keys ``real_/declared_/accounted_/fp16_{prefill,decode}_bytes``,
    ``real_over_declared_*``, ``real_over_fp16_*``, ``declared_over_fp16_*``;
    ``residual_bytes``: what stays alive once the caches are dropped and the model
    detached (should be 0); ``prefill_s`` / ``decode_s``: wall seconds of the two
    phases (without the readings); ``step_s``: of each decode step.
    """
    if decode_steps < 0:
        raise ValueError(f"decode_steps={decode_steps} is not allowed: an integer >= 0")
    if decode_tokens is not None and len(decode_tokens) < decode_steps:
        raise ValueError(f"decode_tokens has {len(decode_tokens)} tokens: "
                         f"decode_steps={decode_steps} needs that many")
    with no_buffer_cache():
        return _measure(model, config, tokens, decode_steps, chunk, decode_tokens)


def warm_up(model: nn.Module, config: CacheSource, tokens: list[int], chunk: int) -> None:
    """Run the method once on a short prompt and two decode steps, then drop it: the
    first use of a code path creates process-wide constants (compiled kernels and their
    constant arrays) that are not any cache's bytes. Detaches the model after."""
    KVCacheBuilder.detach(model)
    caches = build_caches(model, config)
    n = max(2, min(len(tokens), chunk, 64))
    prefill(model, caches, mx.array(tokens[:n], dtype=mx.int32), max(1, n // 2))
    for tok in tokens[:2]:
        mx.eval(model(mx.array([[tok]], dtype=mx.int32), cache=caches))
    del caches
    KVCacheBuilder.detach(model)


def _measure(model: nn.Module, config: CacheSource, tokens: Sequence[int], decode_steps: int,
             chunk: int, decode_tokens: Sequence[int] | None) -> dict[str, Any]:
    prompt = mx.array(list(tokens), dtype=mx.int32)
    forced = list(decode_tokens[:decode_steps]) if decode_tokens is not None else None
    warm_up(model, config, list(tokens), chunk)
    base = active_bytes()
    caches = build_caches(model, config)
    t0 = time.perf_counter()
    last = prefill(model, caches, prompt, chunk)
    prefill_s = time.perf_counter() - t0
    # Only a Python int survives the prefill's logits: nothing of them is counted.
    token = int(mx.argmax(last[0]).item())
    del last
    out: dict[str, Any] = {"context": len(tokens), "decode_steps": decode_steps}
    out.update(_point(active_bytes() - base, caches, "prefill"))
    t0 = time.perf_counter()
    step_s = _decode(model, caches, token, decode_steps, forced)
    decode_s = time.perf_counter() - t0
    out.update(_point(active_bytes() - base, caches, "decode"))
    del caches
    KVCacheBuilder.detach(model)
    out.update(prefill_s=prefill_s, decode_s=decode_s, step_s=step_s,
               residual_bytes=active_bytes() - base)
    return out


# ------------------------------------------------------------------ the user's path
# mlx_lm's own caches, measured beside the methods: its dense ``KVCache`` (what
# ``make_prompt_cache`` builds) and its 4-bit ``QuantizedKVCache`` in groups of 64.
def mlx_lm_dense(model: nn.Module) -> list[Any]:
    """mlx_lm's default caches for ``model`` (dense ``KVCache`` for a plain model)."""
    from mlx_lm.models.cache import make_prompt_cache

    return make_prompt_cache(model)


def mlx_lm_q4(model: nn.Module) -> list[Any]:
    """mlx_lm's 4-bit ``QuantizedKVCache`` (group 64) in every layer."""
    from mlx_lm.models.cache import QuantizedKVCache

    return [QuantizedKVCache(group_size=64, bits=4) for _ in range(len(model.layers))]


MLX_LM_CACHES: dict[str, Callable[[nn.Module], list[Any]]] = {
    "mlx_lm:dense": mlx_lm_dense, "mlx_lm:q4": mlx_lm_q4}

USER_PREFILL_STEP = 2048  # mlx_lm's default prompt step (``prefill_step_size``)


def _generate(model: nn.Module, caches: list[Any], prompt: mx.array, steps: int,
              prefill_step: int) -> None:
    """The prompt and ``steps`` greedy tokens through mlx_lm's ``generate_step`` (what
    ``stream_generate`` runs, without the detokenizer), caches passed as ``prompt_cache``."""
    from mlx_lm.generate import generate_step

    gen = generate_step(prompt, model, max_tokens=steps, prompt_cache=caches,
                        prefill_step_size=prefill_step)
    for token, logprobs in gen:
        del token, logprobs
    del gen


def measure_user_path(model: nn.Module, source: CacheSource, tokens: Sequence[int],
                      decode_steps: int = 8,
                      prefill_step: int = USER_PREFILL_STEP) -> dict[str, Any]:
    """Peak and retained bytes of ``source``'s caches on mlx_lm's own generation path.

    Both over the reading before the caches existed (the weights and the prompt array),
    with MLX's buffer cache off so that a recycled buffer hides no allocation:
    ``peak_bytes`` is ``mx.get_peak_memory()`` over the prompt and ``decode_steps``
    greedy steps (reset just before); ``retained_bytes`` what stays alive after them
    (``memory.active_bytes``); ``working_bytes`` their difference, the prompt's and the
    steps' transients. A warm-up run of the method goes first (process-wide constants).
    """
    if decode_steps < 1 or prefill_step < 1:
        raise ValueError(f"decode_steps={decode_steps}, prefill_step={prefill_step}: "
                         "both must be integers >= 1")
    if len(tokens) < 2:
        raise ValueError(f"the prompt has {len(tokens)} tokens: at least 2 are needed")
    with no_buffer_cache():
        KVCacheBuilder.detach(model)
        warm = build_caches(model, source)
        _generate(model, warm, mx.array(list(tokens[:64]), dtype=mx.int32), 2, 32)
        del warm
        KVCacheBuilder.detach(model)
        prompt = mx.array(list(tokens), dtype=mx.int32)
        base = active_bytes()
        mx.reset_peak_memory()
        caches = build_caches(model, source)
        t0 = time.perf_counter()
        _generate(model, caches, prompt, decode_steps, prefill_step)
        seconds = time.perf_counter() - t0
        mx.synchronize()
        peak = mx.get_peak_memory() - base
        retained = active_bytes() - base
        del caches
        KVCacheBuilder.detach(model)
    return {"context": len(tokens), "decode_steps": decode_steps,
            "prefill_step": prefill_step, "peak_bytes": peak, "retained_bytes": retained,
            "working_bytes": peak - retained, "seconds": seconds}
