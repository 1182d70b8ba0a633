"""Real retained memory (MLX's allocator) against what each method declares.

Every reading is ``memory.active_bytes()`` (after ``gc.collect()`` and
``mx.clear_cache()``) minus the reading before the caches were built: the bytes the
caches and whatever the method installed on the model keep alive. It is compared with
``cache_stats(caches)["held_bytes"]`` (the declaration) right after the prefill and
after the decode steps where something completes: real <= 1.05 x declared.

The tests run with MLX's buffer cache off (``mx.set_cache_limit(0)``): with it on, the
allocator may hand a new small array a free buffer up to twice its size, which is the
allocator's slack, not something a method keeps. The model is sized so that a kept
slice pins a parent at least 16 KiB larger than itself (MLX reuses a donated buffer up
to 16 KiB larger instead of copying), so each pin that a fix removes shows.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import pytest
from conftest import run_prefill, small_config

from veloxquant_mlx import KVCacheBuilder, KVCacheConfig, cache_stats
from veloxquant_mlx.adapter.prefill import prefill
from veloxquant_mlx.cache import (
    affine,
    kivi,
    minicache_coordinator,
    segments,
    snapkv,
    streaming,
    xkv,
    xquant,
    xquant_coordinator,
)
from veloxquant_mlx.cache.batch import BatchedCache, in_cycles
from veloxquant_mlx.memory import active_bytes
from veloxquant_mlx.ops import buffers

BOUND = 1.05
PROMPT, CHUNK, STEPS = 512, 128, 40
# Decode steps read (a reading costs a gc pass): the first (SnapKV evicts), every 8th
# (MiniCache merges its window of 8), 24 (an xKV projection step completes), 32 (a KIVI
# key block of 32 completes).
READ_AT = (1, 8, 16, 24, 32, 40)
TOKENS = [(i * 37 + 11) % 120 + 1 for i in range(PROMPT + STEPS)]


def whole_chunks(model: Any, caches: list[Any], tokens: list[int] | None = None) -> None:
    """The prompt in chunks of ``CHUNK``, the last one several tokens long (as a batch
    prefill or a chat continuation feeds it): what a kept slice of a chunk pins is then
    still alive when the prefill ends."""
    prefill(model, caches, TOKENS[:PROMPT] if tokens is None else tokens, CHUNK,
            last_alone=False)


def readings(model: Any, config: KVCacheConfig, steps: int = STEPS,
             feed: Callable[[Any, list[Any]], None] | None = None) -> list[dict[str, int]]:
    """Real, declared and fp16-equivalent bytes after the prefill and the decode steps
    of ``READ_AT`` (up to ``steps``).

    ``feed`` runs the prompt (default: :func:`whole_chunks`).
    """
    KVCacheBuilder.detach(model)  # a hook from an earlier build is rebuilt, and counted
    base = active_bytes()
    caches = KVCacheBuilder.for_model(model, config)
    (feed or whole_chunks)(model, caches)
    out = []
    for i in range(steps + 1):
        if i:
            logits = model(mx.array([[TOKENS[PROMPT + i - 1]]]), cache=caches)
            mx.eval(logits)
            del logits
        if i == 0 or i in READ_AT or i == steps:
            s = cache_stats(caches)
            out.append({"step": i, "real": active_bytes() - base,
                        "declared": s["held_bytes"], "fp16": s["fp16_bytes"]})
    del caches
    KVCacheBuilder.detach(model)
    return out


def keep_dense_copy(monkeypatch: pytest.MonkeyPatch, cls: type) -> None:
    """Make ``cls`` a deliberately broken cache: beside its compressed form it keeps an
    undeclared copy of every input it stores (keys, or the layer input X for XQuant)."""
    name = "update_x" if hasattr(cls, "update_x") else "update_and_fetch"
    store = getattr(cls, name)

    def hoarding(self: Any, x: mx.array, *rest: Any, **kw: Any) -> Any:
        kept = self.__dict__.get("_dense_copy")  # token axis: -2 for keys and for X
        self._dense_copy = x if kept is None else mx.concatenate([kept, x], axis=-2)
        return store(self, x, *rest, **kw)

    monkeypatch.setattr(cls, name, hoarding)


def worst(points: list[dict[str, int]]) -> tuple[float, dict[str, int]]:
    """The largest real / declared ratio and its reading (step 0: right after prefill)."""
    ratios = [p["real"] / p["declared"] for p in points]
    return max(ratios), points[ratios.index(max(ratios))]


def test_real_memory_within_declared(memory_model: Any, method: str, no_buffer_cache: None) -> None:
    points = readings(memory_model, small_config(method))
    ratio, at = worst(points)
    assert ratio <= BOUND, f"{method}: real / declared = {ratio:.3f} at {at}"
    if method != "none":
        # The run is sized so that the method really compresses (real bytes too).
        assert points[-1]["real"] < 0.9 * points[-1]["fp16"], points[-1]


def test_only_caches_in_cycles_wait_for_a_collection(memory_model: Any, method: str) -> None:
    # The server runs gc.collect() after a request only where ``in_cycles`` says a cache
    # may sit in reference cycles (a collection costs tens of milliseconds with a model
    # loaded). Every other method's caches, their deep copies (kept prompts) and a batch
    # of them must go with their last reference; xkv's do not, so an ``in_cycles`` that
    # always said no would fail here.
    import copy
    import gc
    import weakref

    caches = KVCacheBuilder.for_model(memory_model, small_config(method))
    run_prefill(memory_model, caches, list(range(1, 41)))
    copies = copy.deepcopy(caches)
    batch = [BatchedCache([a, b]) for a, b in zip(caches, copies)]
    refs = [weakref.ref(c) for c in [*caches, *copies, *batch]]
    cycles = in_cycles(batch)
    gc.collect()
    gc.disable()
    try:
        del caches, copies, batch
        alive = sum(r() is not None for r in refs)
    finally:
        gc.enable()
    assert cycles or alive == 0, f"{method}: {alive} caches wait for gc.collect()"


def _no_copy_mx() -> types.SimpleNamespace:
    """``mlx.core`` as a method module sees it, with a ``contiguous`` that does not copy:
    the kept slices that the fixes copy out stay slices (the code before the fixes)."""
    return types.SimpleNamespace(**{**vars(mx), "contiguous": lambda x, *a, **k: x})


# A configuration per fix that copies a slice out; the float32 window makes streaming's
# kept window a slice (a float16 window is a fresh cast anyway).
PINNING = {
    "affine": small_config("affine"),
    "kivi": small_config("kivi"),
    "snapkv": small_config("snapkv"),
    "minicache": small_config("minicache"),
    "xkv": small_config("xkv"),
    "streaming": small_config("streaming", sink=0, window_dtype="float32"),
    "xquant": small_config("xquant", window=8),
}


@pytest.mark.parametrize("name", sorted(PINNING))
def test_kept_slices_would_fail_the_bound(memory_model: Any, name: str, no_buffer_cache: None,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    config = PINNING[name]
    assert worst(readings(memory_model, config, steps=0))[0] <= BOUND
    for module in (affine, kivi, snapkv, streaming, xkv, minicache_coordinator, xquant,
                   segments):
        monkeypatch.setattr(module, "mx", _no_copy_mx())
    # ``owned`` is the copy that never returns a view: undone wherever it is used.
    original = buffers.owned
    for mod_name, module in list(sys.modules.items()):
        if mod_name.startswith("veloxquant_mlx.") and getattr(module, "owned", None) is \
                original:
            monkeypatch.setattr(module, "owned", lambda x: x)
    ratio, at = worst(readings(memory_model, config, steps=0))
    assert ratio > BOUND, f"{name}: a kept slice went unnoticed ({ratio:.3f} at {at})"


def test_xkv_coordinator_state_is_adopted_or_declared(memory_model: Any, no_buffer_cache: None,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    config = small_config("xkv")
    settled = readings(memory_model, config)
    assert worst(settled)[0] <= BOUND
    # Adopting only at each member's next update (no settling after the group's last
    # attention), the coordinator holds published blocks and partials between passes:
    # still honest, as the leader declares them, but more than three times the bytes.
    monkeypatch.setattr(xkv.XKVCache, "_settle_group", lambda self: None)
    late = readings(memory_model, config)
    assert worst(late)[0] <= BOUND
    assert late[0]["real"] > 3 * settled[0]["real"]
    # Undeclared, that coordinator state fails the bound.
    monkeypatch.setattr(xkv.XKVCache, "_coordinator_arrays", lambda self: [])
    ratio, at = worst(readings(memory_model, config))
    assert ratio > BOUND, f"undeclared coordinator state went unnoticed ({ratio:.3f} at {at})"


def test_kivi_completed_key_block_is_evaluated(memory_model: Any, no_buffer_cache: None,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # Step 32 completes a key block of 32: the step's output depends on the new codes
    # (``depend_on_state``), so evaluating its logits evaluates them.
    config = small_config("kivi", bits=2)
    assert worst(readings(memory_model, config))[0] <= BOUND
    # Left lazy, they keep the old codes and the block's float16 keys alive.
    from veloxquant_mlx.adapter import mlx_lm as glue

    monkeypatch.setattr(glue, "depend_on_state", lambda out, cache: out)
    ratio, at = worst(readings(memory_model, config))
    assert ratio > BOUND and at["step"] == 32, (ratio, at)


def test_snapkv_evicts_when_the_last_prompt_token_comes_alone(memory_model: Any,
                                                              no_buffer_cache: None) -> None:
    """mlx_lm's ``generate_step`` feeds all but the last prompt token in chunks and the
    last one alone: SnapKV evicts then, at the end of the prompt, with the last
    ``window`` prompt queries as the observation window (the paper's timing)."""
    def feed(model: Any, caches: list[Any]) -> None:
        prefill(memory_model, caches, mx.array(TOKENS[:PROMPT]), CHUNK)  # the last token alone

    config = small_config("snapkv")
    (fed_whole,) = readings(memory_model, config, steps=0)
    (alone,) = readings(memory_model, config, steps=0, feed=feed)
    assert fed_whole["declared"] >= fed_whole["fp16"]  # all of it held, nothing evicted
    assert alone["real"] <= BOUND * alone["declared"]
    assert alone["real"] < 0.2 * alone["fp16"]


def test_xquant_cl_accumulator_is_released(memory_model: Any, no_buffer_cache: None,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # The running reconstruction handed from layer to layer ([B, T, hidden] float32) is
    # dropped by the last layer of each forward pass ...
    config = small_config("xquant_cl")
    assert worst(readings(memory_model, config, steps=1))[0] <= BOUND
    # ... kept, it would be more than what all the caches hold.
    monkeypatch.setattr(xquant_coordinator.XQuantCoordinator, "release", lambda self: None)
    ratio, at = worst(readings(memory_model, config, steps=1))
    assert ratio > BOUND, f"a kept accumulator went unnoticed ({ratio:.3f} at {at})"
