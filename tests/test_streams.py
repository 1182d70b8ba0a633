"""A batch's decode step spread over CPU streams (``ops.streams``): each group of rows is
attended on its own stream, and the rows come back in their order."""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx
import pytest
from test_batch_attention import PROMPTS, TOLERANCE, _max_error, _rows

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.adapter.mlx_lm import attention_routing
from veloxquant_mlx.cache.batch import BatchedCache
from veloxquant_mlx.cache.stored import StoredFormCache
from veloxquant_mlx.eval.bench import fill_caches
from veloxquant_mlx.memory import transient_peak
from veloxquant_mlx.ops import batch_parts, native, streams
from veloxquant_mlx.testing.tiny import tiny_model


@pytest.mark.parametrize("raw", ["0", "-2", "two", "1.5"])
def test_a_bad_stream_count_is_refused_by_name(raw: str, monkeypatch: pytest.MonkeyPatch
                                               ) -> None:
    monkeypatch.setenv(streams.ENV, raw)
    with pytest.raises(ValueError, match=f"{streams.ENV}={raw!r}.*>= 1"):
        streams.stream_count()


def test_the_stream_count_follows_the_cores_and_the_setting(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(streams.ENV, raising=False)
    assert streams.stream_count() == max(1, min(os.cpu_count() or 1, streams.MAX_STREAMS))
    monkeypatch.setenv(streams.ENV, "3")
    assert streams.stream_count() == 3


def test_a_gpu_keeps_one_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    # The device spreads each kernel itself; a bad setting is still refused there.
    monkeypatch.setattr(streams, "on_gpu", lambda: True)
    monkeypatch.setenv(streams.ENV, "2")
    assert streams.stream_count() == 1
    assert [(a, b) for a, b, _ in streams.spread(8)] == [(0, 8)]
    monkeypatch.setenv(streams.ENV, "0")
    with pytest.raises(ValueError, match=streams.ENV):
        streams.stream_count()


@pytest.mark.parametrize("rows, n, want", [(8, 2, [(0, 4), (4, 8)]), (3, 2, [(0, 2), (2, 3)]),
                                           (2, 4, [(0, 1), (1, 2)]), (5, 1, [(0, 5)])])
def test_rows_are_cut_into_near_equal_consecutive_groups(rows: int, n: int,
                                                          want: list[tuple[int, int]]) -> None:
    assert streams.groups(rows, n) == want


def test_each_group_of_rows_attends_on_its_own_stream(monkeypatch: pytest.MonkeyPatch
                                                      ) -> None:
    monkeypatch.setenv(streams.ENV, "2")
    seen: list[tuple[int, Any]] = []
    original = StoredFormCache._attend_rows.__func__

    def recorded(cls: type, rows: list[Any], queries: mx.array, scale: float) -> Any:
        seen.append((len(rows), mx.default_stream(mx.cpu)))
        return original(cls, rows, queries, scale)

    monkeypatch.setattr(StoredFormCache, "_attend_rows", classmethod(recorded))
    model = tiny_model("llama", seed=3)
    assert _max_error(model, "turboquant") <= TOLERANCE
    # Every layer of every step: a group of 2 rows, then one of 1, on two streams.
    assert {n for n, _ in seen} == {2, 1} and len(seen) % 2 == 0
    assert all(a[1] != b[1] for a, b in zip(seen[::2], seen[1::2])), seen[:4]
    assert all(s == seen[0][1] for _, s in seen[::2])


def test_groups_handed_back_out_of_order_are_seen(monkeypatch: pytest.MonkeyPatch) -> None:
    # The rows of the groups are put back in order; a split that concatenated the groups
    # in another order would give each sequence another sequence's attention.
    monkeypatch.setenv(streams.ENV, "2")
    model = tiny_model("llama", seed=3)
    assert _max_error(model, "turboquant") <= TOLERANCE
    cut = streams.groups
    monkeypatch.setattr(streams, "groups", lambda rows, n: cut(rows, n)[::-1])
    assert len(PROMPTS) > 2
    assert _max_error(model, "turboquant") > 100 * TOLERANCE



def _step_peak(model: Any, batch: list[BatchedCache]) -> float:
    """A decode step's transient bytes, in layers' worth of the batch's held bytes."""
    token = mx.array([[1]] * len(batch[0].caches), dtype=mx.int32)
    with attention_routing(model):
        mx.eval(model(token, cache=batch))
        peak = max(transient_peak(lambda: model(token, cache=batch)) for _ in range(2))
    return peak / (sum(c.nbytes for c in batch) / len(batch))


@pytest.mark.parametrize("cpu_streams", ["1", "2"])
def test_a_batch_step_lays_out_a_layers_rows_only_when_the_layer_attends(
        cpu_streams: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """8 rows of about 600 tokens of TurboQuant codes over 16 layers shaped like the
    embedded model's: a step's transient stays about one layer's float blocks (5.5-5.8
    layers of codes). Untied from the layer's queries, the rows' layout could run at any
    time, and MLX laid out later layers ahead: 13 layers of codes on one stream here,
    80-91 MiB against 29 MiB tied in a step of the embedded model (8 rows of 3000)."""
    monkeypatch.setenv(streams.ENV, cpu_streams)
    model = tiny_model("llama", seed=1, num_hidden_layers=16, num_attention_heads=9,
                       num_key_value_heads=3, head_dim=64, hidden_size=192)
    rows = [fill_caches(model, KVCacheConfig("turboquant"), n, chunk=n)
            for n in range(600, 440, -20)]
    batch = [BatchedCache(list(col)) for col in zip(*rows)]
    assert _step_peak(model, batch) < 8  # each row in the fused CPU kernel: no layout
    monkeypatch.setenv(native.ENV, "0")  # the padded layout (GPU backends, other codes)
    assert _step_peak(model, batch) < 8
    if cpu_streams == "1":
        monkeypatch.setattr(batch_parts, "_tied", lambda rows, after: rows)
        assert _step_peak(model, batch) > 10


def test_a_failing_group_leaves_the_default_stream_as_it_was(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(streams.ENV, "2")
    model = tiny_model("llama", seed=3)
    layers = [BatchedCache.merge(list(col)) for col in zip(*_rows(model, "turboquant"))]
    before = mx.default_stream(mx.cpu)

    def fails(self: BatchedCache, queries: mx.array, scale: float, start: int,
              stop: int) -> mx.array:
        if start:
            raise RuntimeError("second group")
        return mx.zeros((stop - start, *queries.shape[1:]), queries.dtype)

    monkeypatch.setattr(BatchedCache, "_attend_group", fails)
    with pytest.raises(RuntimeError, match="second group"):
        model(mx.array([[1]] * len(PROMPTS)), cache=layers)
    assert mx.default_stream(mx.cpu) == before
