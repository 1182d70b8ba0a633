"""What SnapKV adds to the peak on the prompt path: the pending prompt held once, in the
window dtype, and a compression whose transient is one head's window scores.

SnapKV must see the whole prompt before it evicts (docs/methods/snapkv.md, "Memory
during the prompt"), so the prompt's keys and values are held until the first
single-token step; the tests here hold that part to its bytes and the compression's
transient to one KV head's keys as floats plus one query head's window scores.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache import LayerInfo
from veloxquant_mlx.cache.snapkv import SnapKVCache, window_votes
from veloxquant_mlx.memory import active_bytes, no_buffer_cache, transient_peak
from veloxquant_mlx.ops.attention import BLOCK_FLOATS, attention_weights

HQ, HKV, D, WINDOW = 8, 2, 64, 32
CHUNK = 256


def _normal(shape: tuple[int, ...], seed: int) -> mx.array:
    return mx.random.normal(shape, key=mx.random.key(seed))


def _prefilled(n: int) -> SnapKVCache:
    """A layer's cache after ``n`` prompt tokens in chunks (not compressed yet)."""
    c = SnapKVCache(KVCacheConfig("snapkv", capacity=256, window=WINDOW),
                    LayerInfo(n_kv_heads=HKV, head_dim=D))
    for i in range(0, n, CHUNK):
        k, v, q = (_normal((1, h, CHUNK, D), 3 * i + j) for j, h in enumerate((HKV, HKV, HQ)))
        c.update_and_fetch(k, v)
        mx.eval(c.attend(q, 0.125, "causal"), c.state)
    return c


@pytest.mark.parametrize("hq,hkv,w,n", [(8, 2, 32, 2048), (8, 2, 32, 3000), (4, 1, 1, 700),
                                        (9, 3, 4, 500), (2, 2, 16, 40000)])
def test_window_votes_are_the_whole_score_arrays_bit_for_bit(hq: int, hkv: int, w: int,
                                                             n: int) -> None:
    """Head by head, on both softmax paths (score arrays below and above BLOCK_FLOATS),
    the votes equal those of every head's weights at once: the same tokens are kept."""
    obs = 3 * _normal((1, hq, w, D), n)
    keys = _normal((1, hkv, n, D), n + 1).astype(mx.float16)
    start, stop = 3, n - w
    whole = attention_weights(obs, keys, 0.125, "causal")[..., start:stop].sum(axis=2)
    assert mx.array_equal(window_votes(obs, keys, 0.125, start, stop), whole).item()


def test_pending_prompt_is_held_once_in_the_window_dtype() -> None:
    """Before compression the layer keeps its tokens' keys and values in float16 (with
    the counted reserve) and the window's queries, nothing else: no float copy, no chunk
    pinned by a slice."""
    n = 4 * CHUNK
    with no_buffer_cache():
        base = active_bytes()
        c = _prefilled(n)
        real = active_bytes() - base
    held = c.held[0].buf.arrays[0]
    assert held.dtype == mx.float16 and not c.compressed
    tokens = c.held[0].buf.slots
    assert n <= tokens <= n + n // 16
    expected = tokens * HKV * 2 * D * 2 + HQ * WINDOW * D * 4
    assert c.accounted_bytes() == expected
    assert abs(real - expected) <= 1 << 16  # allocator rounding, far below a copy


@pytest.mark.parametrize("n", [2048, 2304])
def test_compression_transient_is_one_heads_window_scores(n: int) -> None:
    """The first single-token step evicts; what it allocates beyond the held prompt is
    one KV head's keys as floats and a few copies of one query head's window scores
    (``n * (4 * D + 4 * 4 * WINDOW)`` bytes), where every head's scores at once (the
    whole ``[Hq, W, n]`` array and the keys of every head as floats) were several times
    that."""
    assert (HQ * WINDOW * n > BLOCK_FLOATS) == (n > 2048)  # both softmax paths
    with no_buffer_cache():
        c = _prefilled(n)
        k, v, q = _normal((1, HKV, 1, D), 1), _normal((1, HKV, 1, D), 2), _normal((1, HQ, 1, D), 3)
        mx.eval(k, v, q)
        c.update_and_fetch(k, v)
        peak = transient_peak(lambda: c.attend(q, 0.125))
    assert c.compressed and c.evicted == n + 1 - WINDOW - 256
    one_head = n * (4 * D + 4 * 4 * WINDOW)
    every_head = n * (4 * HKV * D + 4 * HQ * WINDOW)
    assert peak <= one_head + (256 << 10) < every_head
