"""One answer, whatever computes it: the fused CPU extension, MLX's packed path
(``mx.quantized_matmul``, what Metal and CUDA run) and MLX's float blocks, on the same
stored codes and the same inputs (``testing.paths``: each block of the model also runs on
copies of its cache under the other paths).

Every registered method runs at its compressing settings (``profile.small``) over
prompt chunks of 1, 37 and 300 tokens after held codes, decode steps, a 2048-token
chunk, and a batch of conversations of different lengths; every block's output on
every path agrees within 1e-4 of the largest value (measured: at most 2.1e-6). The
suite forces one path elsewhere (``tests/conftest.py``); here each runs explicitly.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from conftest import SMALL_OPTIONS

from veloxquant_mlx import KVCacheBuilder, KVCacheConfig
from veloxquant_mlx.cache.batch import BatchedCache
from veloxquant_mlx.ops import native
from veloxquant_mlx.ops.parts import PackedCodes
from veloxquant_mlx.registry import methods
from veloxquant_mlx.testing.paths import shadow_paths
from veloxquant_mlx.testing.tiny import tiny_model

TOLERANCE = 1e-4
# bfloat16 and float16 models attend in float32 (``StoredFormCache.attend_dtype``) and
# round the block's output: paths may differ by a few roundings of the output dtype
# (measured: 5.4e-3 in bfloat16, 1.7e-3 in float16; float blocks in bfloat16 differed
# from packed codes by 2.6e-2 before attention moved to float32).
LOW_PRECISION = {"bfloat16": 8 * 2.0 ** -8, "float16": 8 * 2.0 ** -11}
# Where a method's compressing settings keep what the fused op cannot read (float
# factors, merged or evicted float stores), a setting of it that reaches the op.
FUSED_SETTINGS = {
    "xkv": "xkv:group_layers=2,block=64,rank_k=32,rank_v=32,factor_bits=4",
}
# Methods whose compressing settings are read by the fused op on these models.
READ_BY_THE_OP = {"affine", "kivi", "turboquant", "xquant", "xkv"}


def _spec(method: str) -> str:
    if method in FUSED_SETTINGS:
        return FUSED_SETTINGS[method]
    opts = SMALL_OPTIONS.get(method, {})
    return method + (":" + ",".join(f"{k}={v}" for k, v in opts.items()) if opts else "")


def _model(head_dim: int, layers: int = 4, dtype: str = "float32") -> Any:
    # Three query heads per KV head, as the embedded model (9 / 3).
    model = tiny_model("llama", head_dim=head_dim, num_attention_heads=6,
                       num_key_value_heads=2, hidden_size=6 * head_dim, num_hidden_layers=layers)
    model.set_dtype(getattr(mx, dtype))
    return model


def _fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = native._native.decode_attention

    def spy(*a: Any) -> mx.array:
        calls.append(1)
        return real(*a)

    monkeypatch.setattr(native._native, "decode_attention", spy)
    return calls


def _run(model: Any, spec: str, chunks: list[int], seed: int = 3) -> float:
    """The worst relative difference between paths over a plain loop of ``chunks``; every
    logit finite."""
    tokens = mx.random.randint(0, 128, (1, sum(chunks)), key=mx.random.key(seed))
    caches = KVCacheBuilder.for_model(model, KVCacheConfig.from_string(spec))
    with shadow_paths(model) as shadow:
        start = 0
        for n in chunks:
            logits = model(tokens[:, start:start + n], cache=caches)
            assert mx.isfinite(logits).all().item(), f"{spec}: non-finite logits"
            start += n
    assert shadow.calls, "no block ran"
    return shadow.worst()


@pytest.mark.parametrize("head_dim,dtype", [(32, "float32"), (64, "float32"),
                                            (64, "bfloat16"), (64, "float16")])
def test_every_path_gives_one_answer(method: str, head_dim: int, dtype: str,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # Single tokens, a chat-sized chunk, a long chunk over held codes, then decode steps.
    calls = _fused_calls(monkeypatch)
    worst = _run(_model(head_dim, dtype=dtype), _spec(method), [1, 1, 37, 300, 1, 1, 1])
    assert worst < LOW_PRECISION.get(dtype, TOLERANCE)
    if method in READ_BY_THE_OP and (head_dim, dtype) == (64, "float32"):
        assert calls, f"{method}: the fused op never ran, so nothing was compared with it"


def test_a_2048_token_chunk_gives_one_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    # mlx_lm's default prompt step: blocked attention over the chunk's own codes
    # (affine keeps no float window), then decode steps over them in the op.
    calls = _fused_calls(monkeypatch)
    worst = _run(_model(64, layers=2), _spec("affine").replace("window=4", "window=0"),
                 [2048, 1, 1])
    assert worst < TOLERANCE and calls


@pytest.mark.parametrize("method", sorted(READ_BY_THE_OP - {"xquant"}))
def test_batch_rows_give_one_answer(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A server's decode step over conversations of different lengths: per-row parts in
    # one op, MLX's padded layout on the other paths.
    model = _model(64)
    config = KVCacheConfig.from_string(_spec(method))
    rows = []
    for n in (90, 150, 47):
        caches = KVCacheBuilder.for_model(model, config)
        mx.eval(model(mx.random.randint(0, 128, (1, n), key=mx.random.key(n)), cache=caches))
        rows.append(caches)
    layers = [BatchedCache.merge(list(col)) for col in zip(*rows)]
    calls = _fused_calls(monkeypatch)
    with shadow_paths(model) as shadow:
        mx.eval(model(mx.array([[5], [6], [7]]), cache=layers))
    assert shadow.worst() < TOLERANCE and calls


def test_a_wrong_path_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    # The bound is not loose: a fused op 0.1% off, or packed codes scored 0.1% off, fails it.
    model, spec = _model(64), _spec("affine")
    real = native._native.decode_attention
    monkeypatch.setattr(native._native, "decode_attention", lambda *a: real(*a) * 1.001)
    assert _run(model, spec, [37, 1, 1]) > TOLERANCE
    monkeypatch.undo()
    scores = PackedCodes.key_scores
    monkeypatch.setattr(PackedCodes, "key_scores", lambda self, q: scores(self, q) * 1.001)
    assert _run(model, spec, [37, 1, 1]) > TOLERANCE


def test_the_registry_is_covered() -> None:
    # A new method is compared on every path with no edit here (conftest parametrizes
    # ``method`` over the registry); the op-reading list names only registered methods.
    assert READ_BY_THE_OP <= set(methods())
