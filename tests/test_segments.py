"""Segment kinds of a stored form (``cache.segments``) against plain arrays.

Each kind is driven through random appends, front drops, end trims and a state round
trip, and its dense view is compared with a plain list of the same tokens passed
through the kind's own quantize-dequantize: exact, so any bookkeeping error shows.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from veloxquant_mlx.cache.segments import (
    ChannelCodes,
    Dense,
    FloatCodes,
    StoredForm,
    TokenCodes,
)
from veloxquant_mlx.ops import fpcodes as fp
from veloxquant_mlx.ops import quantize as q
from veloxquant_mlx.ops.attention import attend_parts, sdpa

B, H, D = 1, 2, 32


def _tokens(n: int, seed: int) -> mx.array:
    return mx.random.normal((B, H, n, D), key=mx.random.key(seed))


def _roundtrip(kind: str, x: mx.array) -> mx.array:
    """What the kind gives back for ``x`` (per token, or per channel in groups of 32 tokens)."""
    if kind == "dense":
        return x
    if kind == "token":
        return q.dequantize(q.quantize(x, 4, 32), mx.float32)
    if kind == "float":
        return fp.decode(fp.encode(x, "nvfp4"))
    return q.dequantize_tokens(q.quantize_tokens(x, 4, 32), mx.float32)


def _make(kind: str):
    return {"dense": lambda: Dense(mx.float32), "token": lambda: TokenCodes(4, 32, D),
            "channel": lambda: ChannelCodes(4, 32, D),
            "float": lambda: FloatCodes("nvfp4", D)}[kind]()


ops = st.lists(st.tuples(st.sampled_from(["append", "drop", "keep", "reload"]),
                         st.integers(1, 3)), min_size=1, max_size=8)


@pytest.mark.parametrize("kind", ["dense", "token", "channel", "float"])
@settings(max_examples=25, deadline=None, derandomize=True)
@given(steps=ops)
def test_a_segment_holds_exactly_its_tokens(kind: str, steps: list[tuple[str, int]]) -> None:
    seg, ref, seed = _make(kind), [], 0
    unit = seg.align  # tokens come and go in whole groups for per-channel codes
    for op, k in steps:
        if op == "append":
            seed += 1
            x = _tokens(k * (unit if kind == "channel" else 3), seed)
            seg.append(x)
            ref.append(_roundtrip(kind, x))
        elif op == "drop" and seg.n:
            n = min(seg.n, k * unit)
            seg.drop_front(n)
            whole = mx.concatenate(ref, axis=2)[:, :, n:]
            ref = [whole] if whole.shape[2] else []
        elif op == "keep" and seg.n:
            n = max(0, seg.n - k * unit)
            seg.keep(n)
            whole = mx.concatenate(ref, axis=2)[:, :, :n]
            ref = [whole] if n else []
        elif op == "reload":
            fresh = _make(kind)
            fresh.load(seg.state())
            seg = fresh
        want = sum(r.shape[2] for r in ref)
        assert seg.n == want
        if want:
            assert mx.array_equal(seg.dense(mx.float32), mx.concatenate(ref, axis=2)).item()
        # Declared bytes cover what is held (a reserve included), nothing more.
        assert seg.accounted(B, H) >= sum(a.nbytes for a in seg.arrays()) * 0.9


def test_a_cut_key_group_returns_to_the_dense_segment_after_it() -> None:
    codes, residual = ChannelCodes(4, 32, D), Dense(mx.float32)
    values = Dense(mx.float32)
    form = StoredForm([codes, residual], [values])
    x = _tokens(80, 1)
    codes.append(x[:, :, :64])
    residual.append(x[:, :, 64:])
    values.append(x)
    decoded = form.dense_kv(mx.float32)[0]
    form.trim(40)  # 40 tokens stay: one whole group and 8 tokens of the next
    assert form.tokens() == (40, 40)
    assert codes.n == 32 and residual.n == 8
    k, v = form.dense_kv(mx.float32)
    assert mx.allclose(k, decoded[:, :, :40], atol=1e-6).item()
    assert mx.array_equal(v, x[:, :, :40]).item()


def test_attention_over_the_form_is_attention_over_its_dense_view() -> None:
    keys, window = TokenCodes(8, 32, D), Dense(mx.float32)
    form = StoredForm([keys, window], [TokenCodes(8, 32, D), Dense(mx.float32)])
    x, y = _tokens(40, 2), _tokens(40, 3)
    form.keys[0].append(x[:, :, :32])
    form.keys[1].append(x[:, :, 32:])
    form.values[0].append(y[:, :, :32])
    form.values[1].append(y[:, :, 32:])
    qr = mx.random.normal((B, 2 * H, 1, D), key=mx.random.key(4))
    k, v = form.dense_kv(mx.float32)
    got = attend_parts(qr, *form.parts(), 0.2, None)
    assert mx.allclose(got, sdpa(qr, k, v, 0.2), atol=1e-5).item()


def test_state_order_must_name_every_segment() -> None:
    a, b = Dense(), Dense()
    with pytest.raises(ValueError, match="every key and value segment"):
        StoredForm([a], [b], state_order=[a])
    form = StoredForm([a], [b], state_order=[b, a])
    with pytest.raises(ValueError, match="takes 2"):
        form.load([None])
