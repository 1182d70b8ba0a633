"""TurboQuant on sliding-window layers: a compressed ring (``cache.sliding``).

On a tiny Gemma 3 (window 16, every other layer local) the local layers get a ring over
TurboQuant's codes. Its logits must equal the same-numerics reference (mlx_lm's cache
holding what the method's declared round trip gives, attending with the model's own
sliding mask) over prompts several windows long, further chunks, decode steps, trims
and save/load (the differential state machine, run on this model), and its allocator
reading must stay bounded by the window, not by the context.
"""

from __future__ import annotations

import tempfile
from functools import cache
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import test_differential
from conftest import small_config
from test_differential import Mismatch, run_machine

from veloxquant_mlx import KVCacheBuilder, KVCacheConfig, load_prompt_cache, save_prompt_cache
from veloxquant_mlx.cache.base import NotTrimmableError
from veloxquant_mlx.cache.sliding import SlidingCache
from veloxquant_mlx.cache.turboquant import TurboQuantCache
from veloxquant_mlx.memory import active_bytes, no_buffer_cache
from veloxquant_mlx.testing.reference import reference_bound, reference_caches, relative_error
from veloxquant_mlx.testing.tiny import tiny_model

WINDOW = 16  # the tiny gemma3_text's sliding window


@cache
def _gemma(precision: str = "float32") -> tuple[nn.Module, nn.Module]:
    return tiny_model("gemma3_text"), tiny_model("gemma3_text", seed=1)


def _tokens(n: int, seed: int = 0) -> list[int]:
    return [(i * 37 + 11 + seed) % 120 + 1 for i in range(n)]


def _rings(caches: list) -> list[SlidingCache]:
    return [c for c in caches if isinstance(c, SlidingCache)]


def _run(model: nn.Module, caches: list, ref: list, chunks: list[list[int]]) -> float:
    """The largest relative logit error against the reference over ``chunks``."""
    worst = 0.0
    for chunk in chunks:
        x = mx.array([chunk])
        got = model(x, cache=caches)
        mx.eval(got, [c.state for c in caches])
        worst = max(worst, relative_error(np.array(got), np.array(model(x, cache=ref))))
    return worst


@pytest.mark.parametrize("opts", [dict(window=8), dict(window=8, k_bits=2, v_bits=2),
                                  dict(window=4, block=1, sink=20)])
def test_turboquant_rings_equal_the_same_numerics_reference(opts: dict) -> None:
    """A prompt of five windows, a second chunk and decode steps: every local layer is a
    ring over codes that has dropped its old tokens, and the logits stay within the
    declared bound of the reference (code flips: 1/16 at 4 bits, 1/4 at 2; measured at
    most 3e-3 here, where a ring that cuts its float16 window is off by 0.12 at 4 bits
    and 0.67 at 2 in the decode steps). ``sink=20``: more sinks than the window, which
    a local layer caps at ``W - 1``."""
    model, _ = _gemma()
    caches = KVCacheBuilder.for_model(model, KVCacheConfig("turboquant", **opts))
    ref = reference_caches(model, caches)
    tokens = _tokens(110)
    chunks = [tokens[:80], tokens[80:101]] + [[t] for t in tokens[101:]]
    err = _run(model, caches, ref, chunks)
    KVCacheBuilder.detach(model)
    rings = _rings(caches)
    assert len(rings) == 2 and all(type(c.inner) is TurboQuantCache for c in rings)
    assert all(isinstance(c, TurboQuantCache) for c in caches if c not in rings)
    assert err <= reference_bound(caches, len(tokens)), err
    assert all(c.start > 0 and c.inner.codes[0].n > 0 for c in rings)


def test_turboquant_rings_through_the_differential_machine(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The differential state machine (random chunks, decode steps, plain calls, trims,
    save/load, batches, a second model's caches) on the tiny Gemma 3."""
    monkeypatch.setattr(test_differential, "_models", _gemma)
    run_machine(small_config("turboquant"), examples=6, steps=12)


def test_a_ring_refuses_trims_once_it_dropped_and_reloads_exactly() -> None:
    """Trims are exact while no token has left a ring and refused after; a saved ring
    reloads to the same next logits."""
    model, _ = _gemma()
    cfg = KVCacheConfig("turboquant", window=8)
    caches = KVCacheBuilder.for_model(model, cfg)
    ref = reference_caches(model, caches)
    _run(model, caches, ref, [_tokens(12)])
    assert all(c.is_trimmable() for c in caches)
    assert all(c.trim(3) == 3 and c.offset == 9 for c in caches)
    for c in ref:
        c.trim(3)
    err = _run(model, caches, ref, [_tokens(60, seed=5), [7], [9]])
    assert err <= reference_bound(caches, 69), err
    assert all(c.start > 0 and not c.is_trimmable() for c in _rings(caches))
    with pytest.raises(NotTrimmableError):
        _rings(caches)[0].trim(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "caches.safetensors"
        save_prompt_cache(path, caches)
        loaded = load_prompt_cache(path, model=model)
    assert [c.meta_state for c in loaded] == [c.meta_state for c in caches]
    x = mx.array([[5, 6, 8]])
    want, got = model(x, cache=caches), model(x, cache=loaded)
    KVCacheBuilder.detach(model)
    assert mx.array_equal(want, got).item()


def test_a_ring_holds_bytes_bounded_by_the_window() -> None:
    """Past the window, a local layer's tokens and bytes stop growing, and the
    allocator holds no more than the caches declare (the rings' dropped codes freed)."""
    model, _ = _gemma()
    KVCacheBuilder.detach(model)
    cfg = KVCacheConfig("turboquant", window=8)
    o = cfg.options
    tokens = _tokens(400)
    with no_buffer_cache():
        base = active_bytes()
        caches = KVCacheBuilder.for_model(model, cfg)
        held, real = [], []
        for i in range(0, len(tokens), 50):
            mx.eval(model(mx.array([tokens[i:i + 50]]), cache=caches),
                    [c.state for c in caches])
            held.append(sum(a.nbytes for c in _rings(caches) for a in c.held_arrays()))
            real.append(active_bytes() - base)
        KVCacheBuilder.detach(model)
        rings = _rings(caches)
        full = [c for c in caches if c not in rings]
        full_bytes = sum(a.nbytes for c in full for a in c.held_arrays())
        # The ring's block (W / 4), the float16 window with its block, the last chunk.
        most = WINDOW + WINDOW // 4 + o.window + o.block + 50
        assert all(c.inner.offset <= most for c in rings), [c.inner.offset for c in rings]
        assert held[-1] <= held[2] * 1.05, held  # no growth from 150 to 400 tokens
        # Everything alive is what the caches hold (full layers grow with the context).
        assert real[-1] <= 1.05 * (held[-1] + full_bytes) + 4096, (real[-1], held[-1])
        # The full-attention layers hold all 400 tokens, the rings under a quarter of it.
        assert held[-1] < full_bytes / 3, (held[-1], full_bytes)


def _drop_counting_what_was_asked(self: SlidingCache) -> None:
    droppable = self.offset - self.window + 1 - self.start
    if droppable >= self.block:
        self.inner.drop_oldest(droppable)
        self.start += droppable  # the bug: TurboQuant keeps its float16 window


def _drop_the_window_too(self: TurboQuantCache, n: int) -> None:
    self._commit()
    self.stored.drop_front(n)  # the bug: cuts the float16 window, whose commits shift
    self.offset -= n


@pytest.mark.parametrize("where,broken", [
    (SlidingCache, ("_drop_old", _drop_counting_what_was_asked)),
    (TurboQuantCache, ("drop_oldest", _drop_the_window_too)),
])
def test_the_machine_catches_a_broken_ring(monkeypatch: pytest.MonkeyPatch, where: type,
                                           broken: tuple) -> None:
    monkeypatch.setattr(test_differential, "_models", _gemma)
    monkeypatch.setattr(where, *broken)
    with pytest.raises(Mismatch):
        run_machine(small_config("turboquant", k_bits=2, v_bits=2), examples=6, steps=12,
                    shrink=False)
