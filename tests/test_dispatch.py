"""One attention dispatcher (``ops.dispatch``): the engine it picks for each kind of part,
dtype, shape and backend; one answer whichever engine is forced on the same stored codes;
the table the docs and ``veloxquant bench --kernels`` show is the code's; the fused op has
one caller; the debug switch names each layer's engine."""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from conftest import small_config
from test_paths import _fused_calls

from veloxquant_mlx import KVCacheBuilder
from veloxquant_mlx.cache.stored import StoredFormCache
from veloxquant_mlx.eval import kernel_table
from veloxquant_mlx.ops import attention, dispatch, native
from veloxquant_mlx.ops import codebook as cb
from veloxquant_mlx.ops import fpcodes as fp
from veloxquant_mlx.ops import quantize as q
from veloxquant_mlx.ops.parts import (
    ChannelCodes,
    DensePart,
    FloatCodes,
    PackedCodes,
    coded_part,
    token_codes,
)
from veloxquant_mlx.testing.tiny import tiny_model

ROOT = Path(__file__).resolve().parent.parent
B, H, D, N = 1, 2, 64, 96
TOLERANCE = 1e-4
# Each kind of part (keys; values alike, per-channel codes hold keys only) and what the
# dispatcher calls it.
FORMS: dict[str, tuple[Callable[[mx.array], Any], str]] = {
    "dense": (DensePart, "dense"),
    "token codes": (lambda x: token_codes(q.quantize(x, 4, 32)), "read"),
    "channel codes": (lambda x: ChannelCodes(q.quantize_tokens(x, 4, 32)), "read"),
    "codebook": (lambda x: coded_part(cb.encode(x, 4, "bytes")), "read"),
    "float codes": (lambda x: FloatCodes(fp.encode(x, "mxfp4"), packed=False), "unread"),
    "packed": (lambda x: PackedCodes(q.quantize(x, 4, 32)), "read"),
}
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def _normal(n: int, seed: int) -> mx.array:
    return mx.random.normal((B, H, n, D), key=mx.random.key(seed))


def _parts(form: str) -> tuple[list[Any], list[Any]]:
    make = FORMS[form][0]
    value = FORMS["token codes"][0] if form == "channel codes" else make
    return [make(_normal(N, 1))], [value(_normal(N, 2))]


def _expected(kind: str, dtype: str, shape: str, backend: str) -> str:
    """The engine each situation should get, written out apart from the table."""
    fused_here = backend == "cpu" and dtype == "float32"
    if shape == "batch rows":
        return dispatch.FUSED if fused_here and kind != "unread" else dispatch.PADDED
    return dispatch.FUSED if fused_here and kind == "read" else dispatch.PARTS


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
@pytest.mark.parametrize("shape", ["decode", "prompt chunk", "batch rows"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("form", list(FORMS))
def test_the_engine_for_each_part_kind_dtype_shape_and_backend(
        form: str, dtype: str, shape: str, backend: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    for module in (dispatch, attention):  # a GPU backend, simulated
        monkeypatch.setattr(module, "on_gpu", lambda: backend == "gpu")
    keys, values = _parts(form)
    kind = dispatch.part_kind(keys, values)
    assert kind == FORMS[form][1]
    L, mask = (5, "causal") if shape == "prompt chunk" else (1, None)
    queries = mx.random.normal((B, 3 * H, L, D), key=mx.random.key(3)).astype(DTYPES[dtype])
    rows = 2 if shape == "batch rows" else 1
    want = _expected(kind, dtype, shape, backend)
    assert dispatch.route(queries, kind, mask, H, N, rows) == want
    if rows == 1:  # and the engine it names is the one that runs
        calls = _fused_calls(monkeypatch)
        mx.eval(attention.attend_parts(queries, keys, values, 0.125, mask))
        assert len(calls) == (want == dispatch.FUSED)


def test_dense_arrays_factors_and_long_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    step = mx.zeros((1, 6, 1, D))
    chunk = mx.zeros((1, 6, 200, D))  # 600 rows per KV head: past the op's CHUNK_ROWS
    assert dispatch.route(step, "arrays", None, H, dispatch.FAST_DECODE_KEYS) == dispatch.SDPA
    assert dispatch.route(step, "arrays", None, H, 4096) == dispatch.PARTS
    assert dispatch.route(chunk, "arrays", "causal", H, 300) == dispatch.PARTS
    assert dispatch.route(chunk, "read", "causal", H, 300) == dispatch.PARTS
    assert dispatch.route(step, "read", mx.ones((1, 1, 1, 40)) > 0, H, 40) == dispatch.PARTS
    assert dispatch.fused_causal(chunk[:, :, :8], "causal", H, 300) == 8
    assert dispatch.fused_causal(chunk, "causal", H, 300) is None
    monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
    assert dispatch.route(step, "arrays", None, H, 4096) == dispatch.SDPA
    assert dispatch.fused_causal(step, None, H, 300) is None
    monkeypatch.setenv(native.ENV, "0")
    monkeypatch.setattr(dispatch, "on_gpu", lambda: False)
    assert dispatch.route(step, "factors", None, H, 300) == dispatch.FACTOR


def _layer_cache(method: str) -> tuple[StoredFormCache, mx.array]:
    """Layer 1's cache of ``method`` after a 70-token prompt, and queries for it."""
    model = tiny_model("llama", head_dim=64, num_attention_heads=6, num_key_value_heads=2,
                       hidden_size=384, num_hidden_layers=2)
    caches = KVCacheBuilder.for_model(model, small_config(method))
    mx.eval(model(mx.random.randint(0, 128, (1, 70), key=mx.random.key(4)), cache=caches))
    KVCacheBuilder.detach(model)
    assert isinstance(caches[1], StoredFormCache)
    return caches[1], mx.random.normal((1, 6, 5, 64), key=mx.random.key(5))


def _worst(cache: StoredFormCache, queries: mx.array, mask: Any,
           monkeypatch: pytest.MonkeyPatch) -> tuple[float, set[str]]:
    """The largest relative difference between engines forced on copies of ``cache``,
    and the engines the dispatcher named for them."""
    outs, named = {}, set()
    route = dispatch.route

    def spy(*a: Any, **k: Any) -> str:
        named.add(route(*a, **k))
        return route(*a, **k)

    monkeypatch.setattr(dispatch, "route", spy)
    for engine in dispatch.FORCING:
        with dispatch.forcing(engine):
            outs[engine] = copy.deepcopy(cache).attend(queries, 0.125, mask)
    ref = outs[dispatch.FUSED]
    scale = mx.abs(ref).max().item()
    return max(mx.abs(o - ref).max().item() / scale for o in outs.values()), named


@pytest.mark.parametrize("method", ["affine", "kivi", "turboquant"])
@pytest.mark.parametrize("L,mask", [(1, None), (5, "causal")])
def test_every_forced_engine_gives_one_answer(method: str, L: int, mask: Any,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    cache, queries = _layer_cache(method)
    calls = _fused_calls(monkeypatch)
    worst, named = _worst(cache, queries[:, :, :L], mask, monkeypatch)
    assert worst < TOLERANCE
    assert named == {dispatch.FUSED, dispatch.PARTS} and calls  # each engine really ran


def test_an_engine_a_tenth_of_a_percent_off_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    cache, queries = _layer_cache("affine")
    real = native._native.decode_attention
    monkeypatch.setattr(native._native, "decode_attention", lambda *a: real(*a) * 1.001)
    assert _worst(cache, queries, "causal", monkeypatch)[0] > TOLERANCE
    monkeypatch.undo()
    scores = PackedCodes.key_scores
    monkeypatch.setattr(PackedCodes, "key_scores", lambda self, x: scores(self, x) * 1.001)
    assert _worst(cache, queries[:, :, :1], None, monkeypatch)[0] > TOLERANCE


def test_the_docs_and_the_bench_show_the_code_s_table() -> None:
    doc = (ROOT / "docs" / "cpu-performance.md").read_text(encoding="utf-8")
    shown = re.search(r"<!-- dispatch table -->\n(.*?)\n<!-- end dispatch table -->", doc, re.S)
    assert shown is not None, "docs/cpu-performance.md lost its dispatch table"
    assert shown.group(1) == f"{dispatch.markdown()}\n\n{dispatch.engines_markdown()}"
    assert dispatch.markdown() in "\n".join(kernel_table.engine_lines())
    assert {r.engine for r in dispatch.TABLE} == set(dispatch.ENGINES)
    assert dispatch.TABLE[-1].when == ()  # every situation gets an engine


def test_the_fused_op_has_one_caller() -> None:
    entry = re.compile(r"native\.(decode|attend_rows|decode_rows)\(")
    callers = [p.relative_to(ROOT).as_posix() for p in (ROOT / "veloxquant_mlx").rglob("*.py")
               if p.name != "native.py" and entry.search(p.read_text(encoding="utf-8"))]
    assert callers == ["veloxquant_mlx/ops/dispatch.py"]


def test_the_debug_switch_names_each_layer_s_engine(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv(dispatch.LOG_ENV, "1")
    level, handlers = dispatch.log.level, list(dispatch.log.handlers)
    try:
        dispatch.log.handlers.clear()
        dispatch._log_from_env()
        cache, queries = _layer_cache("affine")
        mx.eval(cache.attend(queries[:, :, :1], 0.125))
    finally:
        dispatch.log.handlers[:] = handlers
        dispatch.log.setLevel(level)
    err = capsys.readouterr().err
    assert "AffineCache layer 0: fused (backend=cpu, dtype=float32" in err
    assert "AffineCache layer 1: fused" in err


def test_the_logger_at_debug_reports_without_the_variable(
        caplog: pytest.LogCaptureFixture) -> None:
    keys, values = _parts("float codes")
    with caplog.at_level(logging.DEBUG, logger=dispatch.log.name):
        attention.attend_parts(mx.zeros((B, 3 * H, 1, D)), keys, values, 0.125,
                               label="probe")
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["probe: parts"]


def test_a_cache_that_declines_the_fused_op_is_logged_as_its_own_engine(
        caplog: pytest.LogCaptureFixture) -> None:
    """xKV before it has factored a token attends in its own ops: the log says so, not
    "fused" (which the table alone would pick for a float32 decode on the CPU)."""
    model = tiny_model("llama", num_hidden_layers=2)
    caches = KVCacheBuilder.for_model(model, small_config("xkv"))
    with caplog.at_level(logging.DEBUG, logger=dispatch.log.name):
        mx.eval(model(mx.array([[1, 2, 3, 4, 5]]), cache=caches))
        mx.eval(model(mx.array([[6]]), cache=caches))
    KVCacheBuilder.detach(model)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("factors:")]
    assert said and all(m.startswith("factors: factor (the cache declines the fused op: "
                                     "no factored tokens yet)") for m in said), said
