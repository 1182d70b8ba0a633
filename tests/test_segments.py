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

from veloxquant_mlx.cache.base import NotTrimmableError
from veloxquant_mlx.cache.kept import DenseBuffer, KeptForm, Ring, keep_chosen
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
    decoded = form.keys_and_values(mx.float32)[0]
    form.trim(40)  # 40 tokens stay: one whole group and 8 tokens of the next
    assert form.tokens() == (40, 40)
    assert codes.n == 32 and residual.n == 8
    k, v = form.keys_and_values(mx.float32)
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
    k, v = form.keys_and_values(mx.float32)
    got = attend_parts(qr, *form.parts(), 0.2, None)
    assert mx.allclose(got, sdpa(qr, k, v, 0.2), atol=1e-5).item()


def test_state_order_must_name_every_segment() -> None:
    a, b = Dense(), Dense()
    with pytest.raises(ValueError, match="every key and value segment"):
        StoredForm([a], [b], state_order=[a])
    form = StoredForm([a], [b], state_order=[b, a])
    with pytest.raises(ValueError, match="takes 2"):
        form.load([None])


# ---- what eviction keeps (``cache.kept``) ----
chunks = st.lists(st.tuples(st.integers(1, 9), st.booleans()), min_size=1, max_size=12)


@pytest.mark.parametrize("kind", ["dense", "token"])
@settings(max_examples=25, deadline=None, derandomize=True)
@given(steps=chunks)
def test_a_ring_keeps_the_first_and_the_most_recent_tokens(
        kind: str, steps: list[tuple[int, bool]]) -> None:
    keep, size = 2, 5

    def make() -> Ring:
        return Ring(DenseBuffer(D) if kind == "dense" else TokenCodes(4, 32, D), keep, size)

    ring, seen = make(), []
    for seed, (k, reload) in enumerate(steps):
        x = _tokens(k, seed)
        ring.append(x)
        seen.append(_roundtrip(kind, x))
        if reload:  # saved in time order, loaded at slot 0
            loaded = make()
            loaded.load(ring.state())
            ring = loaded
        whole = mx.concatenate(seen, axis=2)
        n = whole.shape[2]
        want = whole if n <= keep + size else mx.concatenate(
            [whole[:, :, :keep], whole[:, :, n - size:]], axis=2)
        assert ring.n == want.shape[2]
        assert mx.array_equal(ring.dense(mx.float32), want).item()
        assert ring.accounted(B, H) == sum(a.nbytes for a in ring.arrays())


def test_a_full_ring_takes_a_token_in_place_over_the_oldest() -> None:
    ring = Ring(DenseBuffer(D), 1, 3)
    ring.append(_tokens(4, 0))
    held = ring.arrays()[0]
    x = _tokens(1, 1)
    ring.append(x)
    assert ring.arrays()[0] is held and ring.start == 1  # written in place
    assert mx.array_equal(held[:, :, 1:2], x).item()
    assert mx.array_equal(ring.dense(mx.float32)[:, :, -1:], x).item()  # time order


def test_keep_chosen_gathers_each_heads_tokens_and_keeps_the_rest() -> None:
    seg = DenseBuffer(D)
    x = _tokens(12, 3)
    seg.append(x[:, :, :7])
    seg.append(x[:, :, 7:])
    idx = mx.array([[[0, 3], [1, 4]]])  # per head, of tokens 2:8
    keep_chosen(seg, idx, 2, 8)
    got = seg.dense(mx.float32)
    assert got.shape[2] == 2 + 2 + 4 and seg.buf.slots == seg.n  # no reserve
    assert mx.array_equal(got[:, :, :2], x[:, :, :2]).item()
    assert mx.array_equal(got[0, 0, 2:4], x[0, 0, mx.array([2, 5])]).item()
    assert mx.array_equal(got[0, 1, 2:4], x[0, 1, mx.array([3, 6])]).item()
    assert mx.array_equal(got[:, :, 4:], x[:, :, 8:]).item()


def test_a_kept_form_saves_what_it_holds_and_refuses_to_cut_pinned_tokens() -> None:
    k, v, aside = DenseBuffer(D), DenseBuffer(D), Dense()
    form = KeptForm([k], [v], aside=[aside], optional=[k, v, aside])
    assert form.state() == []  # empty: no entries, as the layout always saved it
    x = _tokens(10, 4)
    k.append(x)
    v.append(x)
    assert len(form.state()) == 2
    aside.set(x[:, :, -3:], copy=True)
    assert len(form.state()) == 3 and form.arrays()[-1] is aside.x
    segs = DenseBuffer(D), DenseBuffer(D), Dense()
    other = KeptForm([segs[0]], [segs[1]], aside=[segs[2]], optional=segs)
    other.load(form.state()[:2])  # a layout without the aside entry still loads
    assert other.tokens() == (10, 10) and other.aside[0].n == 0
    form.trim(2)  # the aside segment follows the end of the stream
    assert form.tokens() == (8, 8) and aside.n == 1
    form.pinned = (6, "only {tail} of {n} (pinned {pinned})")
    with pytest.raises(NotTrimmableError, match=r"only 2 of 3 \(pinned 6\)"):
        form.trim(3)
    form.trim(2)
    assert form.tokens() == (6, 6) and aside.n == 0
    with pytest.raises(ValueError, match="takes 3"):
        form.load([None, None, None, None])
