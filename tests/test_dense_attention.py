"""Attention over dense arrays (``ops.attention.sdpa``, ``masked_softmax``): on a CPU in
float32 it runs on the library's kernels (compiled exponent) where they are faster than
``mx.fast.scaled_dot_product_attention``, with the same results; elsewhere MLX's."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.ops import attention

_FAST = mx.fast.scaled_dot_product_attention


def _qkv(L: int, S: int, B: int = 1, Hq: int = 6, H: int = 2, D: int = 32, seed: int = 0
         ) -> tuple[mx.array, mx.array, mx.array]:
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    return (mx.random.normal((B, Hq, L, D), key=k1), mx.random.normal((B, H, S, D), key=k2),
            mx.random.normal((B, H, S, D), key=k3))


def _masks(L: int, S: int) -> dict[str, object]:
    band = mx.array(np.arange(S - L, S)[:, None] - np.arange(S)[None] < 64)
    rng = np.random.default_rng(1)
    per_head = rng.random((1, 6, L, S)) < 0.8
    per_head[..., -1] = True  # every row sees at least its own position
    return {"none": None, "causal": "causal", "band (2-D boolean)": band & mx.array(
        np.arange(S - L, S)[:, None] >= np.arange(S)[None]),
        "per query head (4-D boolean)": mx.array(per_head),
        "additive (4-D, one head)": mx.array(np.where(per_head[:, :1], 0.0, -1e9),
                                             dtype=mx.float32)}


def _route(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Calls that reach mx.fast's kernel, as (queries, keys)."""
    seen: list[tuple[int, int]] = []

    def fast(q, k, v, **kw):
        seen.append((q.shape[2], k.shape[2]))
        return _FAST(q, k, v, **kw)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", fast)
    return seen


@pytest.mark.parametrize("L,S", [(1, attention.FAST_DECODE_KEYS + 300), (3, 200), (40, 300),
                                 (300, 300)])
@pytest.mark.parametrize("mask", list(_masks(1, 1)))
def test_the_cpu_kernels_give_mlx_attention(L: int, S: int, mask: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = _qkv(L, S)
    m = _masks(L, S)[mask]
    want = _FAST(q, k, v, scale=0.2, mask=m)
    seen = _route(monkeypatch)
    got = attention.sdpa(q, k, v, 0.2, m)
    assert seen == []  # these shapes run on the library's kernels
    assert mx.abs(got - want).max().item() < 2e-5


def test_short_decodes_other_dtypes_and_gpus_keep_mlx_kernel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _route(monkeypatch)
    q, k, v = _qkv(1, attention.FAST_DECODE_KEYS)
    attention.sdpa(q, k, v, 0.2)
    q16, k16, v16 = (x.astype(mx.float16) for x in _qkv(8, 300))
    attention.sdpa(q16, k16, v16, 0.2, "causal")
    monkeypatch.setattr(attention, "on_gpu", lambda: True)
    q, k, v = _qkv(8, 300)
    attention.sdpa(q, k, v, 0.2, "causal")
    assert seen == [(1, attention.FAST_DECODE_KEYS), (8, 300), (8, 300)]


def test_masked_softmax_matches_mlx_and_zeroes_fully_masked_rows() -> None:
    scores = mx.random.normal((2, 2, 3, 4, 50), key=mx.random.key(3)) * 8
    mask = mx.array(np.random.default_rng(2).random((2, 6, 4, 50)) < 0.7)
    got = attention.masked_softmax(scores, mask)
    grouped = mask.reshape(2, 2, 3, 4, 50)
    want = mx.softmax(mx.where(grouped, scores, -mx.inf), axis=-1, precise=True)
    assert mx.abs(got - want).max().item() < 1e-6
    none = mx.zeros((2, 6, 4, 50), dtype=mx.bool_)
    assert mx.all(attention.masked_softmax(scores, none) == 0).item()


def test_the_benchmark_compares_both_kernels_and_names_the_choice() -> None:
    from veloxquant_mlx.eval import dense_attention

    rows = dense_attention.compare(shapes=((1, 64), (1, attention.FAST_DECODE_KEYS + 64),
                                           (16, 64)), heads=(4, 2), head_dim=16, layers=2,
                                   repeats=1)
    assert [r["sdpa_takes"] for r in rows] == ["mx.fast", "library", "library"]
    assert all(r["max_abs_err"] < 1e-5 and r["mx_fast_ms"] > 0 and r["library_ms"] > 0
               for r in rows)
    table = dense_attention.markdown(rows)
    assert table.count("\n") == len(rows) + 1 and "| 16 | 64 |" in table


def test_large_score_arrays_keep_mx_softmax(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    softmax = mx.softmax

    def counted(x, *a, **kw):
        calls.append(x.size)
        return softmax(x, *a, **kw)

    monkeypatch.setattr(mx, "softmax", counted)
    attention.masked_softmax(mx.zeros((1, 3, 3, 1, 4096)))  # a decode step's scores
    big = mx.zeros((1, 3, 3, 64, attention.BLOCK_FLOATS // 64))
    attention.masked_softmax(big)
    assert calls == [big.size]


def test_a_prompt_chunks_peak_stays_a_few_key_blocks_whatever_the_context() -> None:
    """Key blocks wait for the previous block's sums (``_blocked``): untied, MLX computed
    every block's scores ahead and the peak grew with the keys (95 MiB at 4096 keys,
    above mx.fast's 76; 43 tied, at 1024 keys as at 4096)."""
    from veloxquant_mlx.memory import transient_peak

    def peak(S: int, fast: bool = False) -> int:
        q, k, v = _qkv(512, S, Hq=9, H=3, D=64)
        mx.eval(q, k, v)
        if fast:
            return transient_peak(lambda: _FAST(q, k, v, scale=0.125, mask="causal"))
        return transient_peak(lambda: attention.sdpa(q, k, v, 0.125, "causal"))

    long = peak(4096)
    assert long <= 1.25 * peak(1024)
    assert long < 0.7 * peak(4096, fast=True)


def test_the_benchmark_refuses_a_bad_repeat_count(capsys: pytest.CaptureFixture[str]) -> None:
    from veloxquant_mlx.eval import dense_attention

    with pytest.raises(SystemExit):
        dense_attention.main(["--repeats", "0"])
    assert "--repeats=0: a whole number of timed calls >= 1" in capsys.readouterr().err
