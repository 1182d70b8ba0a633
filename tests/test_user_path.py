"""Promises on the user's own path: a plain ``model()`` loop, and two models in one process.

The plain loop is ``logits = model(chunk, cache=caches); mx.eval(logits)`` with no
evaluation of the caches' state (mlx_lm's ``generate`` evaluates it; a notebook, a
custom loop or a draft model usually does not). Memory is MLX's allocator after
``gc.collect()`` + ``mx.clear_cache()`` with the buffer cache off, against the reading
before the caches existed, taken after a warm-up run of the same method so that
process-wide constants (compiled kernels, their constant arrays) are not counted as cache
bytes.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from conftest import small_config

from veloxquant_mlx import KVCacheBuilder, cache_stats
from veloxquant_mlx.adapter import mlx_lm as glue
from veloxquant_mlx.cache import base as cache_base
from veloxquant_mlx.memory import active_bytes
from veloxquant_mlx.testing.tiny import tiny_model

BOUND = 1.05
CHUNK, STEPS = 512, 16
TOKENS = [(i * 37 + 11) % 120 + 1 for i in range(2 * CHUNK + STEPS)]


def plain_loop(model: Any, caches: list[Any], steps: int) -> list[tuple[int, int]]:
    """Two prompt chunks and ``steps`` decode steps, each only ``mx.eval(logits)``;
    (real, declared) bytes after the prompt and after the decode steps (real: the
    allocator's reading, the reading before the caches not yet subtracted)."""
    for start in (0, CHUNK):
        logits = model(mx.array([TOKENS[start:start + CHUNK]]), cache=caches)
        mx.eval(logits)
        del logits
    out = [(active_bytes(), cache_stats(caches)["held_bytes"])]
    for i in range(steps):
        logits = model(mx.array([[TOKENS[2 * CHUNK + i]]]), cache=caches)
        mx.eval(logits)
        del logits
    out.append((active_bytes(), cache_stats(caches)["held_bytes"]))
    return out


def readings(model: Any, method: str, steps: int = STEPS) -> list[tuple[int, int]]:
    KVCacheBuilder.detach(model)
    config = small_config(method)
    # Warm-up: the first use of a code path creates process-wide constants.
    warm = KVCacheBuilder.for_model(model, config)
    plain_loop(model, warm, 2)
    del warm
    KVCacheBuilder.detach(model)
    base = active_bytes()
    caches = KVCacheBuilder.for_model(model, config)
    points = [(real - base, declared) for real, declared in plain_loop(model, caches, steps)]
    del caches
    KVCacheBuilder.detach(model)
    return points


def test_plain_loop_memory_is_what_the_caches_declare(memory_model: Any, method: str,
                                                      no_buffer_cache: None) -> None:
    for when, (real, declared) in zip(("after the prompt", "after decode"),
                                      readings(memory_model, method)):
        assert real <= BOUND * declared, f"{method} {when}: real {real} / declared {declared}"


def test_without_the_state_edge_the_plain_loop_keeps_chunks(memory_model: Any, no_buffer_cache: None,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """The bound above fails without ``depend_on_state``: the lazy codes keep the chunk."""
    monkeypatch.setattr(glue, "depend_on_state", lambda out, cache: out)
    monkeypatch.setattr(cache_base, "depend_on_state", lambda out, cache: out)
    real, declared = readings(memory_model, "kivi", steps=0)[0]
    assert real > BOUND * declared, (real, declared)


def _prefill_logits(model: Any, caches: list[Any], tokens: list[int]) -> mx.array:
    logits = model(mx.array([tokens]), cache=caches)
    mx.eval(logits)
    return logits


def test_detaching_another_model_leaves_this_one_untouched(method: str) -> None:
    """Model A's output is the same whether or not model B was built and detached."""
    a, b = tiny_model("llama"), tiny_model("llama", seed=1)
    config = small_config(method)
    prompt, more = TOKENS[:40], TOKENS[40:48]
    alone = KVCacheBuilder.for_model(a, config)
    want = [_prefill_logits(a, alone, prompt), _prefill_logits(a, alone, more)]
    del alone
    KVCacheBuilder.detach(a)

    caches_a = KVCacheBuilder.for_model(a, config)
    got = [_prefill_logits(a, caches_a, prompt)]
    caches_b = KVCacheBuilder.for_model(b, config)
    _prefill_logits(b, caches_b, prompt)
    KVCacheBuilder.detach(b)
    got.append(_prefill_logits(a, caches_a, more))
    for w, g in zip(want, got):
        assert mx.allclose(w, g, atol=1e-5).item(), (method, mx.abs(w - g).max().item())
    if any(getattr(c, "attends", False) for c in caches_b):
        with pytest.raises(RuntimeError, match="detached|not installed"):
            _prefill_logits(b, caches_b, more)  # B's caches fail loudly now
    KVCacheBuilder.detach(a)


def test_the_old_global_detach_would_break_the_other_model() -> None:
    """What the lease prevents: with detach removing routing for every model, A's caches
    attend over the new chunk alone (silently wrong logits)."""
    a = tiny_model("llama")
    config = small_config("affine")
    alone = KVCacheBuilder.for_model(a, config)
    _prefill_logits(a, alone, TOKENS[:40])
    want = _prefill_logits(a, alone, TOKENS[40:48])
    caches_a = KVCacheBuilder.for_model(a, config)
    _prefill_logits(a, caches_a, TOKENS[:40])
    for info in {id(c.layer): c.layer for c in caches_a}.values():
        info.routing = None  # no check: the silent failure itself
    glue.uninstall_attention_routing(everything=True)
    got = _prefill_logits(a, caches_a, TOKENS[40:48])
    glue.install_attention_routing()  # the process lease other tests rely on
    assert not mx.allclose(want, got, atol=1e-2).item()
    KVCacheBuilder.detach(a)
