"""The at-rest cache format: transform coding round trip, exact ends, bit budget,
hostile files, and restores into other methods' caches."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import make_prompt_cache

from veloxquant_mlx.adapter.builder import KVCacheBuilder, cache_stats
from veloxquant_mlx.apps.at_rest import (
    AtRestError,
    calibrate_at_rest,
    load_at_rest,
    read_at_rest,
    restore_caches,
    save_at_rest,
)
from veloxquant_mlx.config import KVCacheConfig
from veloxquant_mlx.ops.transform import (
    GAUSS_STEP,
    SCALE_CHOICES,
    allocate_bits,
    dequantize,
    fit_scales,
    pca_basis,
    quantize,
)
from veloxquant_mlx.testing.tiny import tiny_model

N_TOKENS, SINKS, WINDOW = 160, 4, 16


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    """A tiny llama, its calibration, and dense caches of a 160-token history."""
    mp = pytest.MonkeyPatch()
    mp.setenv("VELOXQUANT_CACHE_DIR", str(tmp_path_factory.mktemp("calib")))
    model = tiny_model("llama")
    rng = np.random.default_rng(1)
    cal = calibrate_at_rest(model, rng.integers(0, 128, 192).tolist(), joint_heads=False)
    tokens = rng.integers(0, 128, N_TOKENS).tolist()
    caches = make_prompt_cache(model)
    model(mx.array(tokens)[None], cache=caches)
    mx.eval([c.state for c in caches])
    yield model, cal, caches, rng.integers(0, 128, 8).tolist(), tokens
    mp.undo()


def _kv(caches):
    return [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :]) for c in caches]


def _rel(a: mx.array, b: mx.array) -> float:
    return float(mx.linalg.norm(a - b) / mx.linalg.norm(b))


def test_high_bits_round_trip_is_tight(setup, tmp_path) -> None:
    model, cal, caches, *_ = setup
    path = tmp_path / "c.safetensors"
    stats = save_at_rest(path, model, caches, bits=8, sinks=SINKS, window=WINDOW)
    assert stats["tokens"] == N_TOKENS and stats["bytes"] == path.stat().st_size
    restored = read_at_rest(path, model)
    # 8-bit Gaussian-step quantization of decorrelated coefficients: ~0.9% error.
    for (k, v), (k0, v0) in zip(restored, _kv(caches)):
        assert _rel(k, k0) < 0.015 and _rel(v, v0) < 0.015
    # Fewer bits: larger error, smaller file (the budget is really spent).
    small = save_at_rest(path, model, caches, bits=1, sinks=SINKS, window=WINDOW)
    assert small["bytes"] < 0.5 * stats["bytes"]
    k1, _ = read_at_rest(path, model)[0]
    assert 0.05 < _rel(k1, _kv(caches)[0][0]) < 0.9


def test_joint_head_basis_round_trip(setup, tmp_path) -> None:
    model, _, caches, *_ = setup
    joint = calibrate_at_rest(model, list(range(128)) * 2, save=False)
    assert joint.arrays["0.k.basis"].shape == (1, 64, 64)  # 2 heads x 32 side by side
    path = tmp_path / "c.safetensors"
    save_at_rest(path, model, caches, bits=8, sinks=SINKS, window=WINDOW, calibration=joint)
    for (k, v), (k0, v0) in zip(read_at_rest(path, model, calibration=joint), _kv(caches)):
        assert _rel(k, k0) < 0.015 and _rel(v, v0) < 0.015
    with pytest.raises(AtRestError, match="calibration"):
        read_at_rest(path, model)  # coded with another calibration than the saved one


def test_sinks_and_window_exact(setup, tmp_path) -> None:
    model, _, caches, *_ = setup
    path = tmp_path / "c.safetensors"
    save_at_rest(path, model, caches, bits=0.5, sinks=SINKS, window=WINDOW)
    for (k, v), (k0, v0) in zip(read_at_rest(path, model), _kv(caches)):
        for got, ref in ((k, k0), (v, v0)):
            # A float32 cache's ends are kept in float16 unless asked otherwise.
            exact = ref.astype(mx.float16).astype(mx.float32)
            assert got.dtype == ref.dtype
            assert mx.array_equal(got[:, :, :SINKS], exact[:, :, :SINKS])
            assert mx.array_equal(got[:, :, -WINDOW:], exact[:, :, -WINDOW:])
            assert _rel(got[:, :, SINKS:-WINDOW], ref[:, :, SINKS:-WINDOW]) > 0.05


def test_saved_bits_respect_budget(setup, tmp_path) -> None:
    model, _, caches, *_ = setup
    path = tmp_path / "c.safetensors"
    for bits in (0.5, 1.5, 3):
        save_at_rest(path, model, caches, bits=bits, sinks=SINKS, window=WINDOW)
        arrays = mx.load(str(path))
        for name, a in arrays.items():
            if name.endswith(".bits"):
                assert int(np.asarray(a, dtype=np.int64).sum()) == round(bits * a.size)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0.0, 1e3), min_size=1, max_size=40), st.integers(0, 400))
def test_allocation_budget_and_order(var: list[float], total: int) -> None:
    v = np.array(var)
    bits = allocate_bits(v, total)
    assert bits.sum() <= total and bits.min() >= 0 and bits.max() <= 8
    assert bits[v == 0].sum() == 0  # a constant coefficient gets nothing
    live = int((v > 0).sum())
    assert bits.sum() == min(total, 8 * live)  # the budget is spent while it can be
    order = np.argsort(-v, kind="stable")
    assert np.all(np.diff(bits[order]) <= 0)  # more variance, never fewer bits
    # Water-filling: moving one bit from any coefficient to any other never lowers the
    # distortion sum(v * 4**-bits); the last bit given gains at least the next one would.
    given_gain = np.where(bits > 0, v * 4.0 ** -(bits - 1), np.inf)
    next_gain = np.where(bits < 8, v * 4.0 ** -bits, 0.0)
    assert given_gain.min() >= next_gain.max() * (1 - 1e-9)


def test_quantizer_and_basis_round_trip() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(500, 16)) @ rng.normal(size=(16, 16))
    mean, basis, var = pca_basis(x)
    assert np.allclose(basis.T @ basis, np.eye(16), atol=1e-4)
    assert np.all(np.diff(var) <= 1e-6)
    c = (x - mean) @ basis
    bits = np.full(16, 6)
    back = dequantize(quantize(c, bits, c.std(0)), bits, c.std(0), 500)
    assert np.linalg.norm(back - c) / np.linalg.norm(c) < 0.04



def test_fitted_scales_never_worse_and_help_heavy_tails() -> None:
    x = np.random.default_rng(0).standard_t(3, size=(1000, 8))  # outliers, as keys have
    bits, std = np.full(8, 5), x.std(0)

    def err(scale: np.ndarray) -> float:
        return float(np.linalg.norm(dequantize(quantize(x, bits, scale), bits, scale, 1000) - x))

    fitted = fit_scales(x, bits, std)
    assert err(fitted) < 0.8 * err(std)
    assert np.all(fitted >= std)


def test_restore_into_two_methods(setup, tmp_path) -> None:
    model, _, caches, follow, _ = setup
    path = tmp_path / "c.safetensors"
    save_at_rest(path, model, caches, bits=8, sinks=SINKS, window=WINDOW)
    ref = model(mx.array(follow)[None], cache=restore_caches(model, _kv(caches)))
    for config in (None, KVCacheConfig(method="kivi", bits=4), KVCacheConfig(method="xkv")):
        restored = load_at_rest(path, model, config)
        assert all(c.offset == N_TOKENS for c in restored)
        # As if prefilled from the original K/V into the same method.
        direct = restore_caches(model, _kv(caches), config)
        a = model(mx.array(follow)[None], cache=restored)
        b = model(mx.array(follow)[None], cache=direct)
        assert float(mx.abs(a - b).max()) < 0.05 * float(mx.abs(ref).max())



def test_restored_cache_holds_what_a_prefill_holds(setup) -> None:
    """The last chunk is coded at the end of a restore, as a prefill's attention codes it."""
    model, _, caches, *_ = setup
    config = KVCacheConfig(method="kivi", bits=4)
    restored = restore_caches(model, _kv(caches), config)
    direct = KVCacheBuilder.for_model(model, config)
    model(mx.array(setup[4])[None], cache=direct)
    mx.eval([c.state for c in direct])
    assert cache_stats(restored)["held_bytes"] == cache_stats(direct)["held_bytes"]
    assert cache_stats(restored)["held_bytes"] < 0.75 * cache_stats(restored)["fp16_bytes"]


def test_input_caching_method_is_refused(setup, tmp_path) -> None:
    model, _, caches, *_ = setup
    path = tmp_path / "c.safetensors"
    save_at_rest(path, model, caches, bits=2, sinks=SINKS, window=WINDOW)
    with pytest.raises(AtRestError, match="cannot be restored from keys and values"):
        load_at_rest(path, model, KVCacheConfig(method="xquant"))


def _rewrite(path, mutate) -> None:
    arrays, meta = mx.load(str(path), return_metadata=True)
    header = json.loads(meta["veloxquant_at_rest"])
    mutate(arrays, header)
    mx.save_safetensors(str(path), arrays, {"veloxquant_at_rest": json.dumps(header)})


def _fix_crc(arrays, header) -> None:
    import zlib

    header["crc"] = {n: zlib.crc32(np.asarray(a).tobytes()) for n, a in arrays.items()}


@pytest.mark.parametrize("case,match", [
    ("truncated", "not a readable at-rest cache"),
    ("flipped", "checksum mismatch"),
    ("shapes", "layer shapes"),
    ("bits_shape", r"0\.k\.bits.*expected"),
    ("codes_short", r"code bytes, expected|corrupt compressed"),
    ("bits_high", "bits above"),
    ("tokens", "non-negative integers"),
    ("huge", "takes at most 4096"),
    ("format", "is not 'veloxquant-at-rest/2'"),
])
def test_hostile_files_get_named_errors(setup, tmp_path, case: str, match: str) -> None:
    model, _, caches, *_ = setup
    path = tmp_path / "c.safetensors"
    save_at_rest(path, model, caches, bits=2, sinks=SINKS, window=WINDOW)
    if case == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif case == "flipped":
        data = bytearray(path.read_bytes())
        data[-5] ^= 0xFF  # inside the last array's bytes
        path.write_bytes(bytes(data))
    else:
        def mutate(arrays, header):
            if case == "shapes":
                header["shapes"][0][0] += 1
            elif case == "bits_shape":
                arrays["0.k.bits"] = arrays["0.k.bits"][:1]
            elif case == "codes_short":
                arrays["1.v.codes"] = arrays["1.v.codes"][:-3]
            elif case == "bits_high":
                arrays["0.v.bits"] = mx.full(arrays["0.v.bits"].shape, 9, mx.uint8)
            elif case == "tokens":
                header["tokens"] = -1
            elif case == "huge":
                header["tokens"] = 1 << 30
            else:
                header["format"] = "something-else/9"
            _fix_crc(arrays, header)
        _rewrite(path, mutate)
    with pytest.raises(AtRestError, match=match):
        read_at_rest(path, model)


def test_other_model_is_refused(setup, tmp_path) -> None:
    model, _, caches, *_ = setup
    path = tmp_path / "c.safetensors"
    save_at_rest(path, model, caches, bits=2, sinks=SINKS, window=WINDOW)
    with pytest.raises(AtRestError, match="was saved from model"):
        read_at_rest(path, tiny_model("llama", seed=3), calibration=setup[1])


def test_bfloat16_ends_are_kept_bit_for_bit(setup, tmp_path) -> None:
    model, _, caches, *_ = setup
    half = make_prompt_cache(model)
    for c, (k, v) in zip(half, _kv(caches)):
        c.update_and_fetch(k.astype(mx.bfloat16), v.astype(mx.bfloat16))
    path = tmp_path / "c.safetensors"
    save_at_rest(path, model, half, bits=2, sinks=SINKS, window=WINDOW)
    for (k, _), c in zip(read_at_rest(path, model), half):
        ref = c.keys[..., : c.offset, :]
        assert k.dtype == mx.bfloat16
        assert mx.array_equal(k[:, :, -WINDOW:], ref[:, :, -WINDOW:])


# ---- save_prompt_cache(at_rest=True) / load_prompt_cache ----
def _states(caches) -> list:
    from mlx.utils import tree_flatten

    return [a for _, a in tree_flatten([c.state for c in caches])]


def _method_caches(model, config: KVCacheConfig, tokens: list[int]) -> list:
    caches = KVCacheBuilder.for_model(model, config)
    model(mx.array(tokens)[None], cache=caches)
    mx.eval(_states(caches))
    return caches


def test_prompt_cache_at_rest_round_trip(setup, tmp_path) -> None:
    from veloxquant_mlx.apps.prompt_cache import (
        load_prompt_cache,
        read_prompt_cache_header,
        save_prompt_cache,
    )

    model, _, _, follow, tokens = setup
    config = KVCacheConfig(method="kivi", bits=4)
    caches = _method_caches(model, config, tokens)
    path = tmp_path / "c.safetensors"
    save_prompt_cache(path, caches, {"who": "me"}, at_rest=True, model=model, at_rest_bits=6)
    assert path.stat().st_size < 0.85 * cache_stats(caches)["fp16_bytes"]
    header = read_prompt_cache_header(path)
    assert header["format"] == "veloxquant-at-rest/2" and header["saved"]["method"] == "kivi"
    loaded, meta = load_prompt_cache(path, model, return_metadata=True)
    assert meta == {"who": "me"}
    # Restored into the live method's stored form, holding the whole history.
    assert [type(c) for c in loaded] == [type(c) for c in caches]
    assert all(c.config == config and c.offset == N_TOKENS for c in loaded)
    assert cache_stats(loaded)["held_bytes"] == cache_stats(caches)["held_bytes"]
    a = model(mx.array(follow)[None], cache=loaded)
    b = model(mx.array(follow)[None], cache=caches)
    assert float(mx.abs(a - b).max()) < 0.05 * float(mx.abs(b).max())


def test_prompt_cache_at_rest_refuses_another_model_by_name(setup, tmp_path) -> None:
    from veloxquant_mlx.apps.prompt_cache import (
        PromptCacheError,
        load_prompt_cache,
        save_prompt_cache,
    )
    from veloxquant_mlx.errors import PromptCacheError as Shared

    assert PromptCacheError is Shared and issubclass(AtRestError, Shared)
    model, _, _, _, tokens = setup
    caches = _method_caches(model, KVCacheConfig(method="kivi", bits=4), tokens)
    path = tmp_path / "c.safetensors"
    save_prompt_cache(path, caches, at_rest=True, model=model)
    with pytest.raises(PromptCacheError, match="was saved from model .* not this one"):
        load_prompt_cache(path, tiny_model("llama", seed=3))
    with pytest.raises(PromptCacheError, match="saved at rest: load it with its model"):
        load_prompt_cache(path)
    with pytest.raises(ValueError, match="needs the model"):
        save_prompt_cache(path, caches, at_rest=True)

    def bad_config(arrays, header):
        header["saved"]["config"]["bits"] = 99
    _rewrite(path, bad_config)
    with pytest.raises(PromptCacheError, match="saved config is not valid"):
        load_prompt_cache(path, model)


@pytest.mark.parametrize("method", ["none", "kivi"])
def test_prompt_cache_at_rest_lossless_setting_is_equal(setup, tmp_path, method: str) -> None:
    from veloxquant_mlx.apps.prompt_cache import load_prompt_cache, save_prompt_cache
    from veloxquant_mlx.registry import get_method

    model, _, _, follow, tokens = setup
    config = KVCacheConfig(method, **get_method(method).profile.lossless)
    # Within the tokens the lossless options keep whole, so the live caches code nothing.
    caches = _method_caches(model, config, tokens[:100])
    path = tmp_path / "c.safetensors"
    # A window as long as the history: every token kept exactly.
    save_prompt_cache(path, caches, at_rest=True, model=model, at_rest_window=100)
    loaded = load_prompt_cache(path, model)
    for a, b in zip(_states(loaded), _states(caches), strict=True):
        if isinstance(b, mx.array):
            assert a.dtype == b.dtype and mx.array_equal(a, b).item(), method
        else:
            assert a == b, method
    assert mx.array_equal(model(mx.array(follow)[None], cache=loaded),
                          model(mx.array(follow)[None], cache=caches)).item()


def _column_codes(c: np.ndarray, bits: np.ndarray, std: np.ndarray) -> np.ndarray:
    """The quantizer's definition, one coefficient at a time (float32 throughout)."""
    rows = []
    for j in np.flatnonzero(bits > 0):
        b = int(bits[j])
        step = np.float32(max(GAUSS_STEP[b - 1] * float(std[j]), 1e-30))
        q = np.floor(c[:, j] / step + np.float32(2 ** b / 2.0))
        rows.append(np.clip(q, 0, 2 ** b - 1).astype(np.uint8))
    return np.array(rows, dtype=np.uint8).reshape(len(rows), c.shape[0])


def test_whole_array_quantizer_equals_its_column_definition() -> None:
    """``quantize`` and ``fit_scales`` run on every coefficient at once; their codes and
    chosen scales are those of the column-by-column definition, bit for bit."""
    rng = np.random.default_rng(3)
    c = (rng.standard_t(3, size=(300, 24)) * rng.uniform(0.01, 10, 24)).astype(np.float32)
    c[:, 5] = 0
    std = c.std(axis=0).astype(np.float32)
    bits = rng.integers(1, 9, size=24)
    bits[[2, 7]] = 0
    assert np.array_equal(quantize(c, bits, std), _column_codes(c, bits, std))
    scales = fit_scales(c, bits, std)
    for j in np.flatnonzero(bits > 0):
        one = bits[j:j + 1]
        errs = [np.sum((dequantize(_column_codes(c[:, j:j + 1], one, s), one, s, 300)
                        - c[:, j:j + 1]) ** 2)
                for s in (np.array([std[j] * m], np.float32) for m in SCALE_CHOICES)]
        assert scales[j] == np.float32(std[j] * SCALE_CHOICES[int(np.argmin(errs))]), j


@pytest.fixture
def hybrid(tmp_path, monkeypatch):
    """A tiny gemma3_text (two sliding-window layers of 32, two global) after 100 tokens
    fed 16 at a time: its rings hold the newest 35 tokens, its global layers all 100."""
    from veloxquant_mlx.testing.models_table import HYBRID, HYBRID_TOKENS, build_tiny

    monkeypatch.setenv("VELOXQUANT_CACHE_DIR", str(tmp_path / "calib"))
    model = build_tiny(HYBRID[0], wide=True, overrides=HYBRID[1])
    tokens = HYBRID_TOKENS[:100]
    caches = make_prompt_cache(model)
    for s in range(0, len(tokens), 16):
        model(mx.array(tokens[s: s + 16])[None], cache=caches)
    mx.eval(_states(caches))
    return model, caches, HYBRID_TOKENS[100:103]


def _decode(model, caches, follow: list[int]) -> list[mx.array]:
    out = []
    for t in follow:  # one token at a time: the rings turn over
        out.append(model(mx.array([[t]]), cache=caches)[0, -1])
    return out


def test_sliding_window_layers_are_saved_and_restored(hybrid, tmp_path) -> None:
    """A model with sliding-window layers: each ring's newest tokens are saved (a lossless
    file keeps them bit for bit), and the restored caches decode what the live ones
    decode; mlx_lm's caches and TurboQuant's rings alike."""
    from veloxquant_mlx.testing.models_table import HYBRID_TOKENS

    model, caches, follow = hybrid
    path = tmp_path / "h.safetensors"
    save_at_rest(path, model, caches, window=1000, ends_dtype="float32")
    # A ring of 32 saves the newest 31 of its 35: all a later query reaches besides itself.
    assert [k.shape[2] for k, _ in read_at_rest(path, model)] == [31, 100, 31, 100]
    restored = load_at_rest(path, model)
    for a, b in zip(_decode(model, restored, follow), _decode(model, caches, follow)):
        assert mx.allclose(a, b, atol=1e-5, rtol=1e-5).item()
    # Into TurboQuant, whose sliding layers keep a ring over their codes.
    config = KVCacheConfig("turboquant")
    into = load_at_rest(path, model, config)
    live = KVCacheBuilder.for_model(model, config)
    model(mx.array(HYBRID_TOKENS[:100])[None], cache=live)
    for a, b in zip(_decode(model, into, follow), _decode(model, live, follow)):
        assert mx.all(mx.isfinite(a)).item() and _rel(a, b) < 0.05, _rel(a, b)


def test_sliding_window_layers_coded_at_rest_keep_their_positions(hybrid, tmp_path) -> None:
    """Coded bodies (8 bits) of a ring's tokens: RoPE is undone and redone at the
    positions they hold (the newest of the history), so a restore decodes close to the
    live caches."""
    model, caches, _ = hybrid
    save_at_rest(tmp_path / "exact.safetensors", model, caches, window=1000,
                 ends_dtype="float32")
    save_at_rest(tmp_path / "coded.safetensors", model, caches, bits=8, sinks=SINKS,
                 window=WINDOW)
    exact = read_at_rest(tmp_path / "exact.safetensors", model)
    for (k, v), (k0, v0) in zip(read_at_rest(tmp_path / "coded.safetensors", model), exact):
        assert _rel(k, k0) < 0.015 and _rel(v, v0) < 0.015, (_rel(k, k0), _rel(v, v0))


@pytest.mark.parametrize("held,match", [
    ([5, 100, 5, 100], "sliding window of 32: at least 31"),
    ([31, 60, 31, 100], "not a sliding-window layer"),
    ([31, 100, 31], "one count in 0..100 per layer"),
])
def test_forged_held_counts_are_refused(hybrid, tmp_path, held, match) -> None:
    """Only a sliding-window layer may hold fewer tokens than the history, and never so
    few that the padding a restore puts before them would come inside its window."""
    model, caches, _ = hybrid
    path = tmp_path / "h.safetensors"
    save_at_rest(path, model, caches, bits=2, sinks=SINKS, window=WINDOW)

    def mutate(arrays, header):
        header["held"] = held
        _fix_crc(arrays, header)
    _rewrite(path, mutate)
    with pytest.raises(AtRestError, match=match):
        read_at_rest(path, model)


@pytest.mark.parametrize("method", ["kivi:bits=4", "turboquant"])
def test_restored_rings_hold_what_a_prefill_holds(hybrid, tmp_path, method: str) -> None:
    """A ring restored from a file is coded as a prefill's attention codes it: no chunk
    is left in full precision (it was, until a first decode step, in every ring)."""
    from veloxquant_mlx.testing.models_table import HYBRID_TOKENS

    model, caches, _ = hybrid
    path = tmp_path / "h.safetensors"
    save_at_rest(path, model, caches, window=1000, ends_dtype="float32")
    config = KVCacheConfig.from_string(method)
    into = load_at_rest(path, model, config)
    live = KVCacheBuilder.for_model(model, config)
    model(mx.array(HYBRID_TOKENS[:100])[None], cache=live)
    mx.eval(_states(live))
    assert cache_stats(into)["held_bytes"] <= cache_stats(live)["held_bytes"]
