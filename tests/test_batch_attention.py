"""One attention call over a batch: each decode step of a ``BatchedCache`` whose rows lay
their stored segments side by side gives what each row gives alone.

The reference is the same method's own caches decoding one sequence at a time (the same
stored form, so the comparison is exact at compressing settings too): a padding,
masking or key/value layout error in the batched call shows as a difference.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from conftest import small_config

from veloxquant_mlx import KVCacheBuilder
from veloxquant_mlx.cache import stored
from veloxquant_mlx.cache.base import CompressedCache
from veloxquant_mlx.cache.batch import BatchedCache
from veloxquant_mlx.ops import batch_parts, native, streams
from veloxquant_mlx.testing.tiny import tiny_model

# Different lengths, so every segment is padded differently per row.
PROMPTS = [[(i * 13 + 5 * j) % 120 + 1 for i in range(n)] for j, n in enumerate((45, 9, 70))]
STEPS = [[(7 * s + j) % 120 + 1 for j in range(len(PROMPTS))] for s in range(4)]
TOLERANCE = 1e-4


def _rows(model: Any, method: str, **extra: Any) -> list[list[Any]]:
    """Per sequence: its caches after its prompt, fed alone."""
    config = small_config(method, **extra)
    rows = []
    for prompt in PROMPTS:
        caches = KVCacheBuilder.for_model(model, config)
        mx.eval(model(mx.array([prompt]), cache=caches))
        rows.append(caches)
    return rows


def _alone(model: Any, rows: list[list[Any]]) -> list[mx.array]:
    out = []
    for step in STEPS:
        logits = [model(mx.array([[t]]), cache=c)[0, -1] for t, c in zip(step, rows)]
        out.append(mx.stack(logits))
    return out


def _batched(model: Any, rows: list[list[Any]]) -> list[mx.array]:
    layers = [BatchedCache.merge(list(col)) for col in zip(*rows)]
    return [model(mx.array([[t] for t in step]), cache=layers)[:, -1] for step in STEPS]


def _max_error(model: Any, method: str, **extra: Any) -> float:
    KVCacheBuilder.detach(model)
    want = _alone(model, _rows(model, method, **extra))
    got = _batched(model, _rows(model, method, **extra))
    KVCacheBuilder.detach(model)
    return max(mx.abs(g - w).max().item() for g, w in zip(got, want))


def _groups() -> int:
    """Groups of rows a decode step attends in (one per CPU stream)."""
    return len(streams.groups(len(PROMPTS), streams.stream_count()))


@pytest.mark.parametrize("cpu_streams,fused", [("1", "1"), ("2", "1"), ("1", "0")])
def test_a_batch_decodes_in_one_call_as_each_row_alone(method: str, cpu_streams: str,
                                                       fused: str,
                                                       monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    # fused "1": rows whose parts the fused CPU kernel reads attend each their own in it;
    # "0": every class lays its rows side by side (the path GPU backends take).
    monkeypatch.setenv(streams.ENV, cpu_streams)
    monkeypatch.setenv(native.ENV, fused)
    model = tiny_model("llama", seed=3)
    calls = {"at_once": 0}
    at_once = BatchedCache._attend_at_once

    def counted(self: BatchedCache, queries: mx.array, scale: float, *rows: int) -> Any:
        out = at_once(self, queries, scale, *rows)
        calls["at_once"] += out is not None
        return out

    monkeypatch.setattr(BatchedCache, "_attend_at_once", counted)
    probe = KVCacheBuilder.for_model(model, small_config(method))
    cls = type(next(c for c in probe if isinstance(c, CompressedCache)))
    if not cls.profile.batching:
        pytest.skip(f"{method} refuses batches (tests/test_batch.py checks the refusal)")
    assert _max_error(model, method) <= TOLERANCE
    # The rows' class says whether it lays its segments side by side: then every layer of
    # every decode step took the one-call path, once per group of rows. Rows handing
    # dense K/V to the batch take it in the fused kernel (one dense part per row) where a
    # group holds more than one row (one row alone: MLX's attention is faster), else
    # attend row by row; a class that hooks the module attends by itself.
    # Classes that keep the stored form's batched call (an override returning None
    # attends row by row).
    rows = getattr(cls, "_attend_rows", None)
    batches = rows is not None and rows.__func__ is stored.StoredFormCache._attend_rows.__func__
    groups = streams.groups(len(PROMPTS), streams.stream_count())
    if not cls.attends and not cls.profile.hooks_module:  # rows hand dense K/V to the batch
        multi = sum(stop - start > 1 for start, stop in groups)
        want = len(STEPS) * len(probe) * multi if fused == "1" else 0
    elif batches:
        want = len(STEPS) * len(probe) * len(groups)
    else:
        want = 0
    assert calls["at_once"] == want, (method, calls, want)


def test_the_value_layout_matters_when_keys_and_values_are_cut_apart(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # KIVI codes keys in blocks and values one token at a time: rows of different
    # lengths then have different key and value layouts. Dropping the value index
    # (reading the values' probabilities at the keys' positions) is visibly wrong.
    monkeypatch.setenv(native.ENV, "0")  # the fused kernel attends each row's own parts
    model = tiny_model("llama", seed=3)
    assert _max_error(model, "kivi") <= TOLERANCE
    stacked = batch_parts.batch_slots

    def no_index(rows: Any, after: Any = None) -> Any:
        out = stacked(rows, after)
        if out is not None and out.value_index is not None:
            out.value_index = out.value_index * 0 + mx.arange(out.value_index.shape[-1])
        return out

    monkeypatch.setattr(stored, "batch_slots", no_index)
    assert _max_error(model, "kivi") > 100 * TOLERANCE


@pytest.mark.parametrize("method", ["turboquant", "kivi", "affine"])
def test_copies_of_kept_caches_still_decode_in_one_call(method: str,
                                                        monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    # The server's prompt cache hands out deep copies of kept caches; rows whose stored
    # basis (a rotation) was copied per row would no longer match by identity and fall
    # back to attending one row at a time at every step.
    import copy

    model = tiny_model("llama", seed=3)
    extra = {"rotate": True} if method == "affine" else {}
    KVCacheBuilder.detach(model)
    rows = [copy.deepcopy(r) for r in _rows(model, method, **extra)]
    calls = {"at_once": 0, "per_row": 0}
    at_once = BatchedCache._attend_at_once

    def counted(self: BatchedCache, queries: mx.array, scale: float, *rows: int) -> Any:
        out = at_once(self, queries, scale, *rows)
        calls["at_once" if out is not None else "per_row"] += 1
        return out

    monkeypatch.setattr(BatchedCache, "_attend_at_once", counted)
    want = _alone(model, _rows(model, method, **extra))
    got = _batched(model, rows)
    KVCacheBuilder.detach(model)
    want_calls = len(STEPS) * len(rows[0]) * _groups()
    assert calls["per_row"] == 0 and calls["at_once"] == want_calls, calls
    assert max(mx.abs(g - w).max().item() for g, w in zip(got, want)) <= TOLERANCE


@pytest.mark.parametrize("method, extra", [("turboquant", {}), ("kivi", {}),
                                           ("kivi", {"rotate": True}),
                                           ("affine", {"rotate": True})])
def test_a_batch_turns_its_new_tokens_once_per_layer(method: str, extra: dict,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # What every row makes of its new tokens alike (rotation, cast) is computed once for
    # the batch and sliced per row; rows handed each other's slices would decode wrong.
    model = tiny_model("llama", seed=3)
    probe = KVCacheBuilder.for_model(model, small_config(method, **extra))
    cls = type(next(c for c in probe if isinstance(c, CompressedCache)))
    calls = {"calls": 0, "rows": 0}
    original = cls._incoming

    def counted(self: Any, keys: mx.array, values: mx.array) -> Any:
        calls["calls"] += 1
        calls["rows"] += keys.shape[0]
        return original(self, keys, values)

    monkeypatch.setattr(cls, "_incoming", counted)
    layers = [BatchedCache.merge(list(col)) for col in zip(*_rows(model, method, **extra))]
    calls.update(calls=0, rows=0)
    for step in STEPS:
        mx.eval(model(mx.array([[t] for t in step]), cache=layers))
    # One call per layer and step, of all rows (row by row it would be one per row).
    assert calls == {"calls": len(STEPS) * len(layers),
                     "rows": len(STEPS) * len(layers) * len(PROMPTS)}, calls
    assert _max_error(model, method, **extra) <= TOLERANCE

    shared = BatchedCache._incoming

    def shifted(self: BatchedCache, keys: mx.array, values: mx.array) -> Any:
        out = shared(self, keys, values)
        return None if out is None else tuple(mx.roll(x, 1, axis=0) for x in out)

    monkeypatch.setattr(BatchedCache, "_incoming", shifted)
    assert _max_error(model, method, **extra) > 100 * TOLERANCE
