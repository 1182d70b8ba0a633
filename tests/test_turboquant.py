"""TurboQuant-style rotated quantization: rotation, codebooks, packing, the cache."""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from veloxquant_mlx import ConfigError, KVCacheConfig
from veloxquant_mlx.cache.base import LayerInfo
from veloxquant_mlx.cache.dense import DenseCache
from veloxquant_mlx.cache.turboquant import TurboQuantCache
from veloxquant_mlx.memory import transient_peak
from veloxquant_mlx.ops import codebook as cb
from veloxquant_mlx.ops.attention import sdpa
from veloxquant_mlx.ops.rotation import hadamard, random_rotation


# ---------------------------------------------------------------- rotation
@pytest.mark.parametrize("d", [16, 64, 80, 96])
def test_rotation_is_orthogonal_and_seeded(d: int) -> None:
    r = random_rotation(d, seed=3)
    assert mx.abs(r @ r.T - mx.eye(d)).max().item() < 1e-5
    assert mx.array_equal(r, random_rotation(d, seed=3)).item()
    assert not mx.array_equal(r, random_rotation(d, seed=4)).item()


def test_hadamard_rows_are_orthogonal() -> None:
    h = hadamard(32)
    assert np.allclose(h @ h.T, 32 * np.eye(32))
    with pytest.raises(ValueError, match="power of two"):
        hadamard(24)


def test_rotation_spreads_an_outlier_channel() -> None:
    x = mx.random.normal((2000, 64), key=mx.random.key(0))
    x[:, 5] = x[:, 5] * 30  # one outlier channel, as keys have
    y = x @ random_rotation(64)

    def share(a: mx.array) -> float:
        energy = mx.mean(a * a, axis=0)
        return (mx.max(energy) / mx.sum(energy)).item()

    assert share(x) > 0.9 and share(y) < 0.1


# ---------------------------------------------------------------- codebooks
@pytest.mark.parametrize("bits,mse", [(1, 0.3634), (2, 0.1175), (3, 0.03455), (4, 0.009497)])
def test_lloyd_max_matches_the_known_distortion(bits: int, mse: float) -> None:
    # Known optimal MSE of the b-bit scalar quantizer of N(0, 1) (Max, 1960).
    c, t = cb.lloyd_max(bits)
    assert len(c) == 2 ** bits and len(t) == 2 ** bits - 1
    assert np.allclose(c, -np.array(c[::-1]), atol=1e-9)  # symmetric
    assert abs(cb.codebook_mse(bits) - mse) < 0.01 * mse


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_decoded_levels_are_lloyd_max_within_a_fifth_of_a_percent(bits: int) -> None:
    """Codes decode to a polynomial, not a table: its levels are Lloyd-Max's at 1-2
    bits and lose at most 0.2% of distortion at 3-4 (a cubic would lose 2% at 4 bits),
    and the compiled kernel gives exactly the levels the encoder's thresholds assume."""
    levels, thresholds = cb.centroids(bits)
    assert len(levels) == 2 ** bits and np.all(np.diff(levels) > 0)
    assert np.allclose(thresholds, (np.array(levels[1:]) + levels[:-1]) / 2)
    if bits <= 2:
        assert np.allclose(levels, cb.lloyd_max(bits)[0], atol=1e-6)
    assert cb.codebook_mse(bits, "centroids") <= 1.002 * cb.codebook_mse(bits)
    per = 8 // bits if bits in cb.BYTE_WIDTHS else 1
    codes = mx.arange(2 ** bits).astype(mx.uint8)
    for k in range(per):  # every position of a byte decodes through the same levels
        decoded = cb._phase_kernel(bits, k)(codes << (k * bits))
        assert np.array_equal(np.array(decoded), np.array(levels, dtype=np.float32))


@settings(max_examples=30, deadline=None)
@given(bits=st.integers(1, 8), groups=st.integers(1, 5), seed=st.integers(0, 1000))
def test_bit_planes_round_trip(bits: int, groups: int, seed: int) -> None:
    codes = mx.random.randint(0, 2 ** bits, (3, groups * 8), key=mx.random.key(seed))
    planes = cb.pack_planes(codes, bits)
    assert planes.shape == (3, groups, bits) and planes.dtype == mx.uint8
    assert mx.array_equal(cb.unpack_planes(planes), codes.astype(mx.uint8)).item()


@pytest.mark.parametrize("bits", [2, 2.5, 3, 3.5, 4])
def test_encode_decode_error_is_the_codebook_distortion(bits: float) -> None:
    x = mx.random.normal((4000, 64), key=mx.random.key(1)) * 3.0
    c = cb.encode(x, bits)
    rel = (mx.sum((cb.decode(c) - x) ** 2) / mx.sum(x * x)).item()
    want = np.mean([cb.codebook_mse(b) for n, b in cb.split_bits(bits, 64) for _ in range(n)])
    assert abs(rel - want) < 0.15 * want
    assert sum(a.nbytes for a in c.arrays) == cb.coded_bytes(4000, 64, bits)


# ---------------------------------------------------------------- the cache
def _cache(**opts) -> TurboQuantCache:
    return TurboQuantCache(KVCacheConfig("turboquant", **opts), LayerInfo(n_kv_heads=2,
                                                                          head_dim=64))


def _kv(n: int, seed: int, outlier: bool = False) -> tuple[mx.array, mx.array, mx.array]:
    keys = mx.random.split(mx.random.key(seed), 3)
    q, k, v = (mx.random.normal((1, h, n, 64), key=kk) for h, kk in zip((4, 2, 2), keys))
    if outlier:
        k[..., 3] = k[..., 3] * 20
    return q, k, v


def _attention_error(cache, q, k, v, prefill: int) -> float:
    """Relative error of every step's attention output against dense attention."""
    ref = DenseCache(KVCacheConfig(), cache.layer)
    outs, wants = [], []
    for s, e in [(0, prefill)] + [(i, i + 1) for i in range(prefill, k.shape[2])]:
        cache.update_and_fetch(k[:, :, s:e], v[:, :, s:e])
        rk, rv = ref.update_and_fetch(k[:, :, s:e], v[:, :, s:e])
        mask = "causal" if e - s > 1 else None
        outs.append(cache.attend(q[:, :, s:e], 0.125, mask))
        wants.append(sdpa(q[:, :, s:e], rk, rv, 0.125, mask))
    a, b = mx.concatenate(outs, axis=2), mx.concatenate(wants, axis=2)
    return (mx.linalg.norm((a - b).reshape(-1)) / mx.linalg.norm(b.reshape(-1))).item()


def test_more_bits_less_error_and_affine_8_bits_is_lossless() -> None:
    q, k, v = _kv(80, 2)
    errs = {b: _attention_error(_cache(k_bits=b, v_bits=b, window=0, sink=0), q, k, v, 40)
            for b in (2, 3, 4)}
    assert errs[4] < errs[3] < errs[2] < 0.5
    lossless = _cache(quantizer="affine", k_bits=8, v_bits=8, window=0, sink=0)
    assert _attention_error(lossless, q, k, v, 40) < 0.01


def test_float_codes_cost_what_they_declare_and_lose_about_the_codebook() -> None:
    # nvfp4 on rotated vectors: E2M1 levels with an E4M3 scale per 16 channels lose about
    # what the 4-bit Lloyd-Max codebook does (both well under 3 bits' loss), at 36 bytes
    # per 64-wide vector (32 of codes, 4 of scales) against the codebook's 34.
    q, k, v = _kv(80, 2)
    errs = {}
    for spec in (dict(), dict(quantizer="float"), dict(k_bits=3, v_bits=3)):
        c = _cache(window=0, sink=0, **spec)
        errs[spec.get("quantizer", f"codebook{spec.get('k_bits', 4)}")] = \
            _attention_error(c, q, k, v, 40)
        if spec.get("quantizer") == "float":
            assert c.nbytes == c.accounted_bytes()
            assert c.codes[0].accounted(1, 2) == 2 * c.codes[0].buf.slots * (32 + 4)
    assert errs["float"] < 1.3 * errs["codebook4"] and errs["float"] < errs["codebook3"]
    eight = _cache(quantizer="float", k_bits=8, v_bits=8, window=0, sink=0)
    assert _attention_error(eight, q, k, v, 40) < 0.4 * errs["float"]  # measured 0.28x


def test_rotation_is_what_makes_outlier_keys_cheap() -> None:
    q, k, v = _kv(80, 3, outlier=True)
    errs = {}
    for rotate in (True, False):
        c = _cache(k_bits=3, v_bits=3, window=0, sink=0, rotate=rotate)
        _attention_error(c, q, k, v, 40)
        dk, _ = c.keys_and_values()
        # Without rotation the outlier channel sits far outside the N(0, 1) codebook
        # (about 7 standard units) and is clipped; rotated, it is spread over all 64.
        errs[rotate] = (mx.linalg.norm((dk - k).reshape(-1))
                        / mx.linalg.norm(k.reshape(-1))).item()
    assert errs[True] < 0.5 * errs[False]


@pytest.mark.parametrize("block", [1, 16])
def test_sinks_and_window_stay_exact_and_bytes_are_what_is_declared(block: int) -> None:
    q, k, v = _kv(70, 4)
    c = _cache(k_bits=3, v_bits=2, sink=4, window=16, block=block)
    _attention_error(c, q, k, v, 30)
    dk, dv = c.keys_and_values()
    # Sinks and the window are float16 copies of the (rotated, then unrotated) input.
    for got, want in ((dk, k), (dv, v)):
        assert mx.abs(got[:, :, :4] - want[:, :, :4]).max().item() < 1e-2
        assert mx.abs(got[:, :, -16:] - want[:, :, -16:]).max().item() < 1e-2
    # Tokens leave the window in whole blocks: 50 past the sinks and the window.
    n_coded = 50 - 50 % block
    assert c.codes[0].buf.n == n_coded and c.window[0].n == 70 - 4 - n_coded
    assert c.nbytes == c.accounted_bytes()
    per_token = cb.coded_bytes(1, 64, 3) + cb.coded_bytes(1, 64, 2)
    assert c.codes[0].buf.nbytes() + c.codes[1].buf.nbytes() == \
        2 * c.codes[0].buf.slots * per_token


@pytest.mark.parametrize("drop", [3, 25, 58])
def test_trim_drops_exactly_the_last_tokens(drop: int) -> None:
    q, k, v = _kv(60, 5)
    c = _cache(k_bits=3, v_bits=3, window=8)
    _attention_error(c, q, k, v, 20)
    before = c.keys_and_values()
    held = c.nbytes
    assert c.is_trimmable() and c.trim(drop) == drop and c.offset == 60 - drop
    after = c.keys_and_values()
    for a, b in zip(after, before):
        assert a.shape[2] == 60 - drop
        # The kept tokens unchanged: the same codes, un-rotated by a matmul over fewer
        # rows (which may round differently); a wrong token would be off by O(1).
        assert mx.allclose(a, b[:, :, :60 - drop], rtol=1e-6, atol=1e-6).item()
    assert c.nbytes < held  # the dropped tokens are released
    c.update_and_fetch(k[:, :, :1], v[:, :, :1])  # and the cache goes on
    assert c.offset == 61 - drop


@pytest.mark.parametrize("opts,match", [
    (dict(k_bits=5), r"turboquant.k_bits=5.*codebook"),
    (dict(v_bits=2.5, quantizer="affine"), r"turboquant.v_bits=2.5.*affine"),
    (dict(quantizer="lattice"), r"turboquant.quantizer='lattice'"),
    (dict(quantizer="float", k_bits=6), r"turboquant.k_bits=6.*\[4, 8\].*float"),
    (dict(window=-1), r"turboquant.window=-1"),
    (dict(block=0), r"turboquant.block=0"),
    (dict(rotate="yes"), r"turboquant.rotate='yes'"),
])
def test_bad_options_name_the_field(opts: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        KVCacheConfig("turboquant", **opts)


def test_head_dims_the_quantizer_cannot_take_are_refused() -> None:
    with pytest.raises(ConfigError, match="head_dim=20 is not a multiple of 8"):
        TurboQuantCache(KVCacheConfig("turboquant"), LayerInfo(head_dim=20))
    with pytest.raises(ConfigError, match="affine needs head_dim"):
        TurboQuantCache(KVCacheConfig("turboquant", quantizer="affine"),
                        LayerInfo(head_dim=16))
    with pytest.raises(ConfigError, match="float codes need head_dim=48"):
        TurboQuantCache(KVCacheConfig("turboquant", quantizer="float"),
                        LayerInfo(head_dim=48))


def test_rotation_is_freed_with_the_last_cache_that_holds_it() -> None:
    """One rotation array is shared by the caches alive at once and not kept by the
    process after them (held helper state must not outlive its use)."""
    import gc
    import weakref

    from veloxquant_mlx.ops.rotation import shared_rotation

    first = shared_rotation(48, 7)
    assert shared_rotation(48, 7) is first
    ref = weakref.ref(first)
    del first
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_centroid_phases_equal_the_whole_byte_kernel(bits: int) -> None:
    """Byte phases decoded one kernel each are the values the whole-byte kernel gives
    (what ``decode`` scales)."""
    x = mx.random.normal((1, 2, 40, 64), key=mx.random.key(bits))
    c = cb.encode(x, bits, packing="bytes")
    per = 8 // bits
    whole = cb._centroid_kernel(bits, per)(c.parts[0])
    phases = cb.centroid_phases(c)
    assert [(f, s) for _, f, s in phases] == [(k, per) for k in range(per)]
    assert all(mx.array_equal(a, w).item() for (a, _, _), w in zip(phases, whole))


def test_a_phase_decodes_in_one_fused_pass() -> None:
    """A 4-bit byte phase's kernel (TurboQuant's default width) allocates its output and
    nothing else: written as ``t * t`` the square stopped MLX's shapeless compile from
    fusing the polynomial, and the kernel held an intermediate as large as its output
    (peak 2.0x, and 1.5x the time)."""
    bits = 4
    c = cb.encode(mx.random.normal((1, 4, 16384, 64), key=mx.random.key(3)), bits,
                  packing="bytes")
    mx.eval(c.arrays)
    out_bytes = c.parts[0].size * 4
    peaks = [transient_peak(partial(cb._phase_kernel(bits, k), c.parts[0]))
             for k in range(8 // bits)]
    assert max(peaks) < 1.1 * out_bytes, (peaks, out_bytes)
