"""Differential tests: every method against a same-numerics mlx_lm reference, step by step.

A hypothesis state machine drives a method's caches on a tiny model through random
sequences of what users combine: prefill chunks of random size, decode steps, plain
``model(chunk, cache=caches)`` calls whose state nobody evaluates, trims, save/load
round trips, batches (merge, a step, filter, extract), caches of a second model built
and detached. mlx_lm's own caches are fed the same tokens (``testing.reference``: they
hold what the method's declared round trip gives, and evict what it evicts), and every
step's logits must agree within the method's declared bound: at lossless settings the
reference is mlx_lm's plain ``KVCache``, at compressing settings the differences left
are routing, layout and bookkeeping, not the method's intended loss. After every step
the allocator's reading must stay within what the caches declare.

A deliberately broken cache must make the machine fail (the last tests): the bounds are
tight enough to catch a dropped token or a stale window.
"""

from __future__ import annotations

import tempfile
from functools import cache
from pathlib import Path
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import lossless_config, small_config
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from mlx_lm.models.cache import trim_prompt_cache

from veloxquant_mlx import (
    KVCacheBuilder,
    KVCacheConfig,
    cache_stats,
    load_prompt_cache,
    save_prompt_cache,
)
from veloxquant_mlx.cache.base import NotTrimmableError
from veloxquant_mlx.cache.kept import Ring
from veloxquant_mlx.memory import active_bytes, no_buffer_cache
from veloxquant_mlx.registry import get_method
from veloxquant_mlx.testing.reference import (
    reference_bound,
    reference_caches,
    relative_error,
)
from veloxquant_mlx.testing.tiny import tiny_model

TOKEN = st.integers(1, 127)  # the tiny llama's vocabulary is 128
MAX_TOKENS = 120  # below every method's max_ctx and the buffers' first growth


class Mismatch(AssertionError):
    """The method's logits left its declared bound around the reference."""


class MemoryMismatch(AssertionError):
    """The allocator holds more than the caches declare."""


# The precisions users run: float32 (the CPU's fast path), bfloat16 and float16
# activations, and 4-bit MLX-quantized weights with bfloat16 activations (as
# mlx-community ships models). Beyond float32 the reference and the caches round at
# other points (the caches attend in float32 and round their output; mlx_lm attends in
# the model's dtype), so each step may differ by the dtype's rounding through the layers.
PRECISIONS = ("float32", "bfloat16", "float16", "q4")
ROUNDING = {"float32": 0.0, "bfloat16": 0.06, "float16": 0.01, "q4": 0.08}


@cache
def _models(precision: str = "float32") -> tuple[nn.Module, nn.Module]:
    # Both built once, before any baseline reading: their weights are not the caches'.
    models = tiny_model("llama"), tiny_model("llama", seed=1)
    for m in models:
        if precision != "float32":
            m.set_dtype(mx.float16 if precision == "float16" else mx.bfloat16)
        if precision == "q4":
            nn.quantize(m, group_size=32, bits=4)
        mx.eval(m.parameters())
    return models


def _floats(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32))


def _state(caches: list[Any]) -> list[Any]:
    return [c.state for c in caches]


def _one_token(caches: list[Any]) -> int:
    """One float16 token of keys and values per layer: a decode step keeps its window
    as a slice of the window and the new token, which pins one token more than it
    declares (by design: no copy per step; measured with affine's window)."""
    return sum(c.layer.n_kv_heads * (c.layer.head_dim + c.layer.v_head_dim) * 2
               for c in caches)


class CacheMachine(RuleBasedStateMachine):
    """One method's caches and their reference on the tiny llama (see the module)."""

    config: ClassVar[KVCacheConfig]
    precision: ClassVar[str] = "float32"

    def __init__(self) -> None:
        super().__init__()
        self.model, self.other = _models(self.precision)
        KVCacheBuilder.detach(self.model)
        KVCacheBuilder.detach(self.other)
        self.base = active_bytes()
        self.caches = KVCacheBuilder.for_model(self.model, self.config)
        self.ref = reference_caches(self.model, self.caches)
        self.most = 0  # the most tokens the caches have held
        first = self.caches[0]
        self.batchable = type(first).profile.batching
        self.steps: list[str] = []

    @property
    def offset(self) -> int:
        return self.ref[0].offset

    # ---- helpers ----
    def _check(self, got: mx.array, want: mx.array, what: str,
               caches: list[Any] | None = None, most: int | None = None) -> None:
        self.steps.append(what)
        self.most = max(self.most, self.offset)
        bound = reference_bound(caches or self.caches, most or self.most)
        bound += ROUNDING[self.precision]
        if not np.isfinite(got).all():
            raise Mismatch(f"{self.config} in {self.precision}: {what}: non-finite logits "
                           f"after {self.steps}")
        err = relative_error(got, want)
        if not err <= bound:
            raise Mismatch(f"{self.config} in {self.precision}: {what}: logits off by "
                           f"{err:.3g} of their scale "
                           f"(bound {bound:.3g}) after {self.steps}")

    def _step(self, tokens: list[int], what: str, evaluate_state: bool = True) -> None:
        x = mx.array([tokens])
        got = self.model(x, cache=self.caches)
        if evaluate_state:
            mx.eval(got, _state(self.caches))
        else:
            mx.eval(got)  # what a plain loop does: the state only through the logits
        got = _floats(got)
        self._check(got, _floats(self.model(x, cache=self.ref)), f"{what}({len(tokens)})")

    # ---- rules ----
    @initialize(tokens=st.lists(TOKEN, min_size=2, max_size=14))
    def prompt(self, tokens: list[int]) -> None:
        # Every example starts with a prompt, so that each rule can run from its first step.
        self._step(tokens, "prefill")

    @precondition(lambda self: self.offset < MAX_TOKENS)
    @rule(tokens=st.lists(TOKEN, min_size=2, max_size=14))
    def prefill(self, tokens: list[int]) -> None:
        self._step(tokens, "prefill")

    @precondition(lambda self: self.offset < MAX_TOKENS)
    @rule(token=TOKEN)
    def decode(self, token: int) -> None:
        self._step([token], "decode")

    @precondition(lambda self: self.offset < MAX_TOKENS)
    @rule(tokens=st.lists(TOKEN, min_size=1, max_size=6))
    def plain(self, tokens: list[int]) -> None:
        """``logits = model(chunk, cache=caches); mx.eval(logits)``: nothing else."""
        self._step(tokens, "plain", evaluate_state=False)

    @precondition(lambda self: self.offset > 1 and
                  all(c.is_trimmable() for c in self.caches))
    @rule(n=st.integers(1, 8))
    def trim(self, n: int) -> None:
        n = min(n, self.offset - 1)
        before = [c.offset for c in self.caches]
        try:
            trimmed = trim_prompt_cache(self.caches, n)
        except NotTrimmableError:
            # A refusal (SnapKV's keep-set) must leave every cache as it was.
            assert [c.offset for c in self.caches] == before
            self.steps.append(f"trim({n}) refused")
            return
        assert trimmed == n and [c.offset for c in self.caches] == [b - n for b in before]
        trim_prompt_cache(self.ref, n)
        self.steps.append(f"trim({n})")
        # The kept copies are lazy until the next step evaluates them, as it would.
        mx.eval(_state(self.caches))

    @precondition(lambda self: self.offset > 0)
    @rule()
    def save_and_load(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "caches.safetensors"
            save_prompt_cache(path, self.caches)
            loaded = load_prompt_cache(path, model=self.model)
        assert [c.meta_state for c in loaded] == [c.meta_state for c in self.caches]
        self.caches = loaded
        self.steps.append("save/load")
        mx.eval(_state(self.caches))

    @precondition(lambda self: self.offset > 0 and self.batchable and
                  self.offset < MAX_TOKENS)
    @rule(prompt=st.lists(TOKEN, min_size=2, max_size=10), a=TOKEN, b=TOKEN)
    def batch(self, prompt: list[int], a: int, b: int) -> None:
        """Merge with a second sequence, one step for both, then filter and extract."""
        theirs = KVCacheBuilder.for_model(self.model, self.config)
        their_ref = reference_caches(self.model, theirs)
        x = mx.array([prompt])
        mx.eval(self.model(x, cache=theirs), _state(theirs))
        self.model(x, cache=their_ref)
        merged = [type(c).merge([c, t]) for c, t in zip(self.caches, theirs)]
        got = self.model(mx.array([[a], [b]]), cache=merged)
        mx.eval(got, _state(merged))
        got = _floats(got)
        self._check(got[:1], _floats(self.model(mx.array([[a]]), cache=self.ref)),
                    "batch row 0")
        self._check(got[1:], _floats(self.model(mx.array([[b]]), cache=their_ref)),
                    "batch row 1", theirs, len(prompt) + 1)
        for m in merged:
            m.filter([0])
        self.caches = [m.extract(0) for m in merged]

    @precondition(lambda self: self.offset > 0 and self.offset < MAX_TOKENS)
    @rule(tokens=st.lists(TOKEN, min_size=2, max_size=8), token=TOKEN)
    def second_model(self, tokens: list[int], token: int) -> None:
        """Caches of another model, used and detached, leave these alone."""
        theirs = KVCacheBuilder.for_model(self.other, self.config)
        x = mx.array([tokens])
        got = self.other(x, cache=theirs)
        mx.eval(got, _state(theirs))
        self._check(_floats(got),
                    _floats(self.other(x, cache=reference_caches(self.other, theirs))),
                    "second model", theirs, len(tokens))
        KVCacheBuilder.detach(self.other)
        del theirs
        self._step([token], "decode after the second model's detach")

    # ---- invariants ----
    @invariant()
    def offsets_agree(self) -> None:
        assert all(c.offset == self.offset for c in self.caches), \
            ([c.offset for c in self.caches], self.offset)

    @invariant()
    def allocator_within_declared(self) -> None:
        real = active_bytes() - self.base
        held = cache_stats(self.caches)["held_bytes"]
        if real > 1.05 * held + _one_token(self.caches):
            raise MemoryMismatch(f"{self.config}: {real} bytes alive, {held} declared, "
                                 f"after {self.steps}")

    def teardown(self) -> None:
        KVCacheBuilder.detach(self.model)


def run_machine(config: KVCacheConfig, examples: int, steps: int,
                shrink: bool = True, precision: str = "float32") -> None:
    """The machine over ``config`` with a fixed seed (reproducible in CI); ``shrink``
    reduces a failing case to a short one (slow: off where a failure is expected)."""
    machine = type(f"Machine_{config.method}", (CacheMachine,),
                   {"config": config, "precision": precision})
    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if shrink else [])
    with no_buffer_cache():
        run_state_machine_as_test(machine, settings=settings(
            max_examples=examples, stateful_step_count=steps, deadline=None,
            derandomize=True, database=None, print_blob=False, phases=phases,
            suppress_health_check=list(HealthCheck)))


def test_compressing_settings_match_the_same_numerics_reference(method: str) -> None:
    run_machine(small_config(method), examples=4, steps=10)


def test_lossless_settings_match_mlx_lm(method: str) -> None:
    run_machine(lossless_config(method), examples=2, steps=10)


# bfloat16 runs with the 4-bit weights (``q4``), as mlx-community's models do.
@pytest.mark.parametrize("precision", ["float16", "q4"])
def test_compressing_settings_in_the_precisions_users_run(method: str, precision: str
                                                          ) -> None:
    run_machine(small_config(method), examples=1, steps=8, precision=precision)


# ---------------------------------------------------------------- broken caches
def _trim_drops_the_oldest(cls: type) -> Any:
    def trim(self: Any, n: int) -> int:
        n = min(self.offset, n)
        for segment in (*self.stored.keys, *self.stored.values):
            segment.drop_front(n)  # the bug: drop the oldest tokens instead of the newest
        self.offset -= n
        return n
    return trim


def _ring_never_advances(original: Any) -> Any:
    def append(self: Any, x: mx.array) -> None:
        start, in_place = self.start, x.shape[2] == 1 and self.full
        original(self, x)
        if in_place:
            self.start = start  # the bug: every decode step overwrites the same slot
    return append


@pytest.mark.parametrize("precision", ["float32", "q4"])
def test_the_machine_catches_a_trim_that_drops_the_oldest_tokens(
        monkeypatch: pytest.MonkeyPatch, precision: str) -> None:
    cls = get_method("none")
    monkeypatch.setattr(cls, "trim", _trim_drops_the_oldest(cls))
    with pytest.raises(Mismatch):
        run_machine(KVCacheConfig("none"), examples=6, steps=12, shrink=False,
                    precision=precision)


@pytest.mark.parametrize("precision", ["float32", "q4"])
def test_the_machine_catches_a_stale_streaming_window(
        monkeypatch: pytest.MonkeyPatch, precision: str) -> None:
    monkeypatch.setattr(Ring, "append", _ring_never_advances(Ring.append))
    with pytest.raises(Mismatch):
        run_machine(small_config("streaming"), examples=6, steps=12, shrink=False,
                    precision=precision)
