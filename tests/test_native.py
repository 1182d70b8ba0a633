"""The fused CPU decode attention (``csrc/`` through ``ops.native``): for every
stored form it reads, the result of MLX's ops within float tolerance; the forms and calls
it does not take fall through to MLX's ops; bad calls are refused naming what is wrong.

``make test`` builds the extension (``scripts/setup.sh``), so these tests require it: a
failed build fails them instead of hiding behind a skip."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from enum import IntEnum
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

import veloxquant_mlx.ops
from veloxquant_mlx.ops import attention, native
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

B, H, D = 2, 2, 64


def test_the_extension_is_built_and_loads() -> None:
    assert native._native is not None, native.status()
    assert native.available()
    assert native.status().startswith("fused")


def _normal(n: int, seed: int, d: int = D) -> mx.array:
    return mx.random.normal((B, H, n, d), key=mx.random.key(seed))


def _counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Calls of the fused op from now on: one entry each, its projected parts."""
    calls: list[int] = []
    real = native._native.decode_attention

    def spy(q: mx.array, arrays: list, parts: list[native.PartSpec], *a: object) -> mx.array:
        calls.append(sum(1 for p in parts if p.projection is not None))
        return real(q, arrays, parts, *a)

    monkeypatch.setattr(native._native, "decode_attention", spy)
    return calls


def _both(monkeypatch: pytest.MonkeyPatch, queries: mx.array, keys: list, values: list,
          mask: object = None) -> tuple[mx.array, mx.array, int]:
    """(fused, MLX's ops, fused op calls) for one decode attention."""
    calls = _counted(monkeypatch)
    fused = attention.attend_parts(queries, keys, values, 0.125, mask)
    monkeypatch.setenv(native.ENV, "0")
    plain = attention.attend_parts(queries, keys, values, 0.125, mask)
    monkeypatch.delenv(native.ENV)
    return fused, plain, len(calls)


def _close(a: mx.array, b: mx.array) -> float:
    return (mx.abs(a - b).max() / mx.abs(b).max()).item()


FORMS: dict[str, Callable[[mx.array], object]] = {
    **{f"token {bits}-bit g{g}": (lambda x, bits=bits, g=g: token_codes(q.quantize(x, bits, g)))
       for bits in (2, 4, 8) for g in (32, 64)},
    **{f"codebook {bits}-bit": (lambda x, bits=bits: coded_part(cb.encode(x, bits, "bytes")))
       for bits in (1, 2, 4)},
    "packed 4-bit": lambda x: PackedCodes(q.quantize(x, 4, 32)),
}
CHANNEL = {f"channel {bits}-bit g{g}": (bits, g) for bits in (2, 4, 8) for g in (32, 64)}


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_token_forms_give_mlx_results(form: str, rows: int,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # 128 stored tokens then a dense window of 37: blocks of 16 lanes end mid-block.
    make = FORMS[form]
    keys = [make(_normal(128, 1)), DensePart(_normal(37, 2))]
    values = [make(_normal(128, 3)), DensePart(_normal(37, 4))]
    queries = mx.random.normal((B, H * rows, 1, D), key=mx.random.key(5))
    fused, plain, calls = _both(monkeypatch, queries, keys, values)
    assert calls == 1
    assert _close(fused, plain) < 2e-5


@pytest.mark.parametrize("mask", ["causal", None])
@pytest.mark.parametrize("chunk", [2, 5, 37])
def test_prompt_chunks_give_mlx_results(chunk: int, mask: str | None,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # A prompt chunk over held codes (a chat's next turn): each of the chunk's tokens sees
    # the keys up to its own. The chunk is the last ``chunk`` of the 37 window tokens.
    keys = [coded_part(cb.encode(_normal(128, 30), 4, "bytes")), DensePart(_normal(37, 31))]
    values = [token_codes(q.quantize(_normal(128, 32), 4, 32)), DensePart(_normal(37, 33))]
    queries = mx.random.normal((B, H * 3, chunk, D), key=mx.random.key(34))
    calls = _counted(monkeypatch)
    fused = native.attend_rows(queries, 0.125, [(keys, values)], mask)
    assert fused is not None and len(calls) == 1
    monkeypatch.setenv(native.ENV, "0")
    plain = attention.attend_parts(queries, keys, values, 0.125, mask)
    assert _close(fused, plain) < 2e-5
    if mask:  # the mask matters: without it the early tokens see later ones
        monkeypatch.delenv(native.ENV)
        unmasked = native.attend_rows(queries, 0.125, [(keys, values)])
        assert _close(unmasked, plain) > 1e-3


def test_a_chunk_past_the_bounds_takes_mlx_ops(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "CHUNK_SCORES", 3 * 8 * 165 - 1)
    keys = [coded_part(cb.encode(_normal(128, 30), 4, "bytes")), DensePart(_normal(37, 31))]
    values = [token_codes(q.quantize(_normal(128, 32), 4, 32)), DensePart(_normal(37, 33))]
    queries = mx.random.normal((B, H * 3, 8, D), key=mx.random.key(34))
    assert native.attend_rows(queries, 0.125, [(keys, values)], "causal") is None
    monkeypatch.setattr(native, "CHUNK_SCORES", 3 * 8 * 165)
    assert native.attend_rows(queries, 0.125, [(keys, values)], "causal") is not None
    monkeypatch.setattr(native, "CHUNK_ROWS", 3 * 8 - 1)  # 3 query heads a KV head x 8
    assert native.attend_rows(queries, 0.125, [(keys, values)], "causal") is None


@pytest.mark.parametrize("form", list(CHANNEL))
def test_channel_keys_cut_apart_from_values_give_mlx_results(
        form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # KIVI: keys quantized per channel in whole groups, values per token, each with its
    # own float residual (float16 here), so key and value parts end at different tokens.
    bits, g = CHANNEL[form]
    k, v = _normal(3 * g + 20, 6), _normal(3 * g + 20, 7)
    keys = [ChannelCodes(q.quantize_tokens(k[:, :, :3 * g], bits, g)),
            DensePart(k[:, :, 3 * g:].astype(mx.float16))]
    values = [token_codes(q.quantize(v[:, :, :3 * g + 16], 4, 32)),
              DensePart(v[:, :, 3 * g + 16:].astype(mx.float16))]
    queries = mx.random.normal((B, H * 3, 1, D), key=mx.random.key(8))
    fused, plain, calls = _both(monkeypatch, queries, keys, values)
    assert calls == 1
    assert _close(fused, plain) < 2e-5


def test_views_into_a_larger_buffer_are_read_at_their_strides(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Caches hand over slices of preallocated buffers: a wrong stride reads other tokens.
    big = q.quantize(_normal(256, 9), 4, 32)
    view = q.Quantized(big.codes[:, :, 40:140], big.scales[:, :, 40:140],
                       big.biases[:, :, 40:140], 4, 32)
    dense = _normal(300, 10)[:, :, 100:150]
    keys = [token_codes(view), DensePart(dense)]
    values = [DensePart(_normal(300, 11)[:, :, 7:107]), DensePart(dense)]
    queries = mx.random.normal((B, H * 2, 1, D), key=mx.random.key(12))
    fused, plain, calls = _both(monkeypatch, queries, keys, values)
    assert calls == 1
    assert _close(fused, plain) < 2e-5


def test_a_wrong_scale_would_be_seen() -> None:
    # The bound above is tight enough to catch a kernel that drops a group's scale.
    qt = q.quantize(_normal(64, 13), 4, 32)
    broken = q.Quantized(qt.codes, qt.scales * mx.array([1.0, 1.01]).astype(qt.scales.dtype),
                         qt.biases, 4, 32)
    queries = mx.random.normal((B, H, 1, D), key=mx.random.key(14))
    values = [DensePart(_normal(64, 15))]
    good = attention.attend_parts(queries, [token_codes(qt)], values, 0.125)
    bad = attention.attend_parts(queries, [token_codes(broken)], values, 0.125)
    assert _close(bad, good) > 2e-5


@pytest.mark.parametrize("case", ["mask", "float16 queries", "float codes", "dense only",
                                  "prompt rows"])
def test_what_it_does_not_take_runs_on_mlx_ops(case: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    keys = [token_codes(q.quantize(_normal(64, 16), 4, 32))]
    values = [DensePart(_normal(64, 17))]
    queries = mx.random.normal((B, H, 1, D), key=mx.random.key(18))
    mask = None
    if case == "mask":
        mask = mx.arange(64)[None] < 50
    elif case == "float16 queries":
        queries = queries.astype(mx.float16)
    elif case == "float codes":
        c = fp.encode(_normal(64, 19), "mxfp4")
        keys = [FloatCodes(c, packed=False)]
    elif case == "dense only":
        keys = [DensePart(_normal(64, 20))]
    else:  # a prompt chunk past the rows the op takes at once
        queries = mx.random.normal((B, H, 20, D), key=mx.random.key(21))
        mask = "causal"
        monkeypatch.setattr(native, "CHUNK_ROWS", 19)
    fused, plain, calls = _both(monkeypatch, queries, keys, values, mask)
    assert calls == 0
    assert _close(fused, plain) == 0.0


def test_no_float_copy_of_the_store_is_allocated() -> None:
    # 16k tokens of 4-bit codes: MLX's float path builds float blocks of the codes; the
    # fused op allocates its output only (its buffers are per head and token-block sized).
    n = 16384
    keys = [ChannelCodes(q.quantize_tokens(_normal(n, 22), 4, 64))]
    values = [token_codes(q.quantize(_normal(n, 23), 4, 64))]
    queries = mx.random.normal((B, H * 3, 1, D), key=mx.random.key(24))
    mx.eval(queries, *keys[0].qt.arrays, *[a for a in values[0].stored()[3]])
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    mx.eval(attention.attend_parts(queries, keys, values, 0.125))
    floats = B * H * n * D * 4
    assert mx.get_peak_memory() - base < floats / 50


def _part(kind: str = "dense", bits: int = 0, group: int = 0, biases: bool = False,
          table: bool = False, **placed: object) -> native.PartSpec:
    return native.PartSpec(native.Form(native.PartKind[kind], bits, group, biases, table),
                           **placed)


DENSE = _part()


def _call(parts: list, arrays: list[mx.array], counts: list[int] | None = None) -> None:
    counts = counts or [1, len(parts) - 1]
    mx.eval(native._native.decode_attention(mx.ones((1, 1, 1, 8)), arrays, parts, counts))


def test_the_part_kinds_and_fields_are_the_extensions(monkeypatch: pytest.MonkeyPatch) -> None:
    # One enumeration: the extension exports its kinds and a part description's fields,
    # ops.native declares the same, and every kind a stored form names is one of them.
    assert native.described_by(native._native) == native.described_by(None)
    assert native._native.part_kinds == {"dense": 0, "token": 1, "channel": 2}
    assert {k.name for k in native.PartKind} == {"dense", "token", "channel"}
    # A kind added on one side only is refused at load (parts would be misread).
    wider = IntEnum("PartKind", {**{k.name: k.value for k in native.PartKind}, "ring": 3})
    monkeypatch.setattr(native, "PartKind", wider)
    ext, why = native._load()
    assert ext is None and why.startswith("built from other sources (its part_kinds differ")
    monkeypatch.undo()
    kinds = {**native._native.part_kinds, "ring": 3}
    other = SimpleNamespace(**{**native.described_by(native._native), "part_kinds": kinds})
    monkeypatch.setattr(veloxquant_mlx.ops, "_native", other, raising=False)
    assert native._load()[1].startswith("built from other sources (its part_kinds differ")


@pytest.mark.parametrize("parts,arrays,message", [
    ([DENSE], [mx.ones((1, 1, 4, 8))], "at least one key part and one value part"),
    ([DENSE] * 2, [mx.ones((1, 1, 4, 8)), mx.ones((1, 1, 5, 8))], "same tokens"),
    ([_part("token", 3, 8), DENSE],
     [mx.zeros((1, 1, 4, 1), mx.uint32), mx.ones((1, 1, 4, 1)), mx.ones((1, 1, 4, 8))],
     r"part 0 \(key part 0\): form.bits must be 1, 2, 4 or 8, got 3"),
    ([_part("token", 4, 8), DENSE],
     [mx.ones((1, 1, 4, 1)), mx.ones((1, 1, 4, 1)), mx.ones((1, 1, 4, 8))],
     "codes must be unsigned"),
    ([DENSE, _part("channel", 4, 8, biases=True)],
     [mx.ones((1, 1, 8, 8)), mx.zeros((1, 1, 8, 1), mx.uint32), mx.ones((1, 1, 8, 1)),
      mx.ones((1, 1, 8, 1))], "channel parts hold keys only"),
    ([DENSE] * 2, [mx.ones((1, 1, 4, 8))], "fewer arrays"),
    # Placements: a value part read at a query offset, a key part with a mass, a shift of
    # the wrong shape, a key part past the end of the query rows.
    ([DENSE, _part(qoff=4)], [mx.ones((1, 1, 4, 8))] * 2,
     "qoff must be 0 and shift false for a value part"),
    ([_part(mass=True), DENSE], [mx.ones((1, 1, 4, 8))] * 2,
     "ooff must be 0 and mass false for a key part"),
    ([_part(shift=True), DENSE],
     [mx.ones((1, 1, 4, 8)), mx.ones((1, 1, 2, 1)), mx.ones((1, 1, 4, 8))],
     "a score shift must be float32"),
    ([_part(qoff=4), DENSE], [mx.ones((1, 1, 4, 8))] * 2, "fit in the query rows"),
    # A rotation: of a value part, wider than the part, with tables of the wrong shape;
    # a pairing without a rotation.
    ([DENSE, _part(rotate=True)],
     [mx.ones((1, 1, 4, 8))] * 2 + [mx.ones((1, 1, 1, 4)), mx.zeros((1, 1, 1, 1), mx.int32)],
     "rotate is for dense or projected key parts"),
    ([_part(rotate=True), DENSE],
     [mx.ones((1, 1, 4, 8)), mx.ones((1, 1, 1, 5)), mx.zeros((1, 1, 1, 1), mx.int32),
      mx.ones((1, 1, 4, 8))], "turns at most the part's dims"),
    ([_part(rotate=True), DENSE],
     [mx.ones((1, 1, 4, 8)), mx.ones((1, 1, 1, 4)), mx.zeros((1, 1, 1, 1)),
      mx.ones((1, 1, 4, 8))], "first position must be int32"),
    ([_part(pairs=True), DENSE], [mx.ones((1, 1, 4, 8))] * 2, r"pairs .* needs rotate"),
    ([_part(rotate=True), DENSE],
     [mx.ones((1, 1, 4, 8)), mx.ones((1, 1, 3, 4)), mx.zeros((1, 1, 1, 1), mx.int32),
      mx.ones((1, 1, 4, 8))], "inverse frequencies must be contiguous float32"),
    # The description itself: each field of its type, by name.
    ([DENSE, _part(bits="4")], [mx.ones((1, 1, 4, 8))] * 2,
     r"part 1: form.bits must be an int, got str"),
    ([DENSE, _part(shift=1)], [mx.ones((1, 1, 4, 8))] * 2,
     r"part 1: shift must be a bool, got int"),
    ([_part(qoff=1 << 40), DENSE], [mx.ones((1, 1, 4, 8))] * 2, "part 0: qoff must fit in 32 bits"),
    ([DENSE, SimpleNamespace(form=DENSE.form, qoff=0)], [mx.ones((1, 1, 4, 8))] * 2,
     r"part 1: no field ooff in a types.SimpleNamespace"),
    ([DENSE, 3], [mx.ones((1, 1, 4, 8))] * 2, r"part 1: no field form in a int"),
    ([_part(kind="dense", bits=4), DENSE], [mx.ones((1, 1, 4, 8))] * 2,
     r"form.bits must be 0 \(false\) for a dense part, got 4"),
    ([replace(DENSE, form=native.Form(7)), DENSE], [mx.ones((1, 1, 4, 8))] * 2,
     r"form.kind must be 0 \(dense\), 1 \(token\), 2 \(channel\), got 7"),
    ([replace(DENSE, projection=native.Form(native.PartKind.token, 2, 32, table=True)), DENSE],
     [mx.ones((1, 1, 4, 8))] * 2, "projection.kind must be dense or token, projection.table false"),
])
def test_bad_calls_are_refused_naming_the_problem(parts: list, arrays: list[mx.array],
                                                  message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _call(parts, arrays)


@pytest.mark.parametrize("counts,message", [
    ([1, 1, 1, 1], "once per batch row"),  # two rows' parts for a batch of one
    ([1], "once per batch row"),
    ([1, 2], "parts must describe the counted parts"),
])
def test_bad_part_counts_are_refused(counts: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _call([DENSE] * 2, [mx.ones((1, 1, 4, 8))] * 2, counts)


def _token_call(codes: mx.array, scales: mx.array, biases: mx.array, threads: int = 1,
                q_: mx.array | None = None) -> mx.array:
    """The op over one token part of 4-bit codes in groups of 32 (keys) and dense values."""
    H, n = codes.shape[1], codes.shape[2]
    q_ = mx.ones((1, H, 1, 64)) if q_ is None else q_
    return native._native.decode_attention(q_, [codes, scales, biases, mx.ones((1, H, n, 64))],
                                           [_part("token", 4, 32, biases=True), DENSE], [1, 1],
                                           threads)


def _past(a: mx.array) -> mx.array:
    """``a``'s shape as a view starting past the end of its buffer."""
    return mx.as_strided(a, a.shape, [int(np.prod(a.shape[i + 1:])) for i in range(a.ndim)],
                         a.size)


def _refusals() -> dict[str, tuple[Callable[[], mx.array], str]]:
    qt = q.quantize(mx.random.normal((1, 4, 2048, 64), key=mx.random.key(70)), 4, 32)
    c, s, z = qt.codes, qt.scales, qt.biases
    dense = mx.ones((1, 1, 4, 8))
    rope = [_part(rotate=True), DENSE]
    tabled = [_part("token", 2, 32, table=True), DENSE]
    small = q.quantize(mx.ones((1, 1, 4, 32)), 2, 32)
    return {
        # Scales and biases of a saved cache with fewer KV heads than its codes: the kernel
        # read past them (a segfault at these shapes).
        "scales of fewer heads": (lambda: _token_call(c, s[:, :2], z[:, :2]),
                                  r"part 0 \(key part 0\): arrays\[1\]: scales "
                                  r"must be 4-D floats with the codes' batch and KV heads"),
        "integer biases": (lambda: _token_call(c, s, z.astype(mx.uint8)), "biases must be floats"),
        "signed codes": (lambda: _token_call(c.astype(mx.int32), s, z), "codes must be unsigned"),
        "codes past their buffer": (lambda: _token_call(_past(c), s, z),
                                    r"arrays\[0\] .* strides run past its buffer"),
        "scales past their buffer": (lambda: _token_call(c, _past(s), z),
                                     r"arrays\[1\] .* strides run past its buffer"),
        "codes strided along a row": (lambda: _token_call(mx.contiguous(c.swapaxes(-1, -2)).swapaxes(-1, -2),
                                                          s, z), "contiguous along its last axis"),
        "no threads": (lambda: _token_call(c, s, z, 0), "threads must be 1 to"),
        "a million threads": (lambda: _token_call(c, s, z, 10**6), "threads must be 1 to"),
        "a dense part with bits": (lambda: native._native.decode_attention(
            mx.ones((1, 1, 1, 8)), [dense, dense], [_part(bits=4)] * 2, [1, 1]),
            r"form.bits must be 0 \(false\) for a dense part"),
        "a projection with a table": (lambda: native._native.decode_attention(
            mx.ones((1, 1, 1, 8)), [dense, dense],
            [replace(DENSE, projection=native.Form(native.PartKind.token, 4, 32, table=True)),
             DENSE], [1, 1]), "projection.table false"),
        "an output offset past any head": (lambda: native._native.decode_attention(
            mx.ones((1, 1, 1, 8)), [dense, dense], [DENSE, _part(ooff=1 << 30)], [1, 1]),
            r"part 1 \(value part 0\): ooff must be 0 to 65536"),
        "no counts": (lambda: native._native.decode_attention(mx.ones((1, 1, 1, 8)), [dense] * 2,
                                                             [DENSE] * 2, []), "counts must be"),
        "scores of broadcast shapes": (lambda: native._native.decode_attention(
            mx.broadcast_to(mx.ones((1, 1, 1, 8)), (1, 1, 1 << 16, 8)),
            [mx.broadcast_to(dense[:, :, :1], (1, 1, 1 << 15, 8))] * 2, [DENSE] * 2, [1, 1]),
            "the scores .* must be at most 2"),
        "a broadcast table": (lambda: native._native.decode_attention(
            mx.ones((1, 1, 1, 32)), [small.codes, small.scales, mx.broadcast_to(mx.ones(1), (4,)),
                                     mx.ones((1, 1, 4, 32))], tabled, [1, 1]),
            r"arrays\[2\] \(a table\) must be contiguous"),
        "broadcast frequencies": (lambda: native._native.decode_attention(
            mx.ones((1, 1, 1, 8)), [dense, mx.broadcast_to(mx.ones((1, 1, 1, 1)), (1, 1, 1, 4)),
                                    mx.zeros((1, 1, 1, 1), mx.int32), dense], rope, [1, 1]),
            "inverse frequencies.* must be contiguous"),
        "decoded rows past their buffer": (lambda: native._native.floats_of(
            _past(small.codes), small.scales, small.biases, 2, 32), "codes .* run past"),
        "float codes to decode": (lambda: native._native.floats_of(
            small.codes.astype(mx.float32), small.scales, small.biases, 2, 32),
            "codes must be unsigned"),
        "rows past their buffer": (lambda: native._native.rms_rows(
            _past(mx.ones((4, 8))), mx.ones(8), 1e-5), "x .* run past its buffer"),
        "a NaN eps": (lambda: native._native.rms_rows(mx.ones((4, 8)), mx.ones(8), float("nan")),
                      "eps must be finite"),
        "rows of broadcast shapes": (lambda: native._native.rms_rows(
            mx.broadcast_to(mx.ones(8), (1 << 28, 8)), mx.ones(8), 1e-5), "x must be at most 2"),
    }


@pytest.mark.parametrize("case", list(_refusals()))
def test_arguments_the_kernels_cannot_read_safely_are_refused(case: str) -> None:
    # Every entry point checks shapes, dtypes and ints as the op is built, strides as it
    # runs, before any task: a ValueError naming the argument, never a read out of bounds.
    call, message = _refusals()[case]
    with pytest.raises(ValueError, match=message):
        mx.eval(call())
    # The process goes on: a valid call right after runs.
    assert mx.all(mx.isfinite(native._native.rms_rows(mx.ones((2, 8)), mx.ones(8), 1e-5))).item()


XKV_AFTER_ROPE = "xkv:group_layers=2,block=64,rank_k=30,rank_v=20,factor_bits=4,pre_rope=False"


@pytest.mark.parametrize("method,head_dim,projected", [
    ("kivi:bits=4,group_size=32", 32, False), ("turboquant", 32, False),
    ("affine:bits=4,group_size=32", 32, False),
    # Factor space: values (and keys after RoPE) read as codes of the token factor; the
    # member factors applied by MLX (a head's slice of a 4-bit member is half a group at
    # head dim 32) or by the op (at head dim 64).
    ("xkv:group_layers=2,block=64,rank_k=32,rank_v=32,factor_bits=4", 32, False),
    (XKV_AFTER_ROPE + ",window=8", 32, False),
    ("xkv:group_layers=2,block=64,rank_k=32,rank_v=32,factor_bits=4", 64, True),
    (XKV_AFTER_ROPE + ",window=8", 64, True),
    # Keys rebuilt from the cached X's codes and rotated in the op, value codes read as
    # codes.
    ("xquant", 32, True)])
def test_the_plain_loop_gives_the_same_logits_fused(method: str, head_dim: int,
                                                    projected: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # The user's loop: a prompt, a second chunk, then one token at a time, no state
    # evaluation.
    from veloxquant_mlx import KVCacheBuilder, KVCacheConfig
    from veloxquant_mlx.testing.tiny import tiny_model

    model = tiny_model("llama", head_dim=head_dim)
    tokens = mx.random.randint(0, 128, (1, 300), key=mx.random.key(25))
    calls = _counted(monkeypatch)

    def run() -> list[mx.array]:
        caches = KVCacheBuilder.for_model(model, KVCacheConfig.from_string(method))
        mx.eval(model(tokens[:, :260], cache=caches))
        out = [model(tokens[:, 260:270], cache=caches)]  # a next turn's chunk over codes
        for i in range(270, 300):
            out.append(model(tokens[:, i:i + 1], cache=caches))
            mx.eval(out[-1])
        return out

    fused = run()
    # The chunk and the 30 steps, and the prompt too where its own tokens are already
    # codes when it attends (affine keeps no float window).
    assert len(calls) in (31 * len(model.layers), 32 * len(model.layers))
    assert any(calls) == projected
    monkeypatch.setenv(native.ENV, "0")
    plain = run()
    assert max(_close(a, b) for a, b in zip(fused, plain)) < 1e-4


def _factored(n: int, r: int, seed: int, bits: int | None, shared: bool = True
              ) -> tuple[object, object, mx.array, mx.array]:
    """A low-rank store ``x = a P_h + m_h``: the token factor ``a`` [B, n, r] (4-bit codes,
    one part every head reads, or a copy per head), each head's ``P_h`` [B, H, r, D] as 4-bit rows or float16
    (``bits`` None) and ``m_h`` [B, H, 1, D] float16; and the dense ``x`` [B, H, n, D]."""
    from veloxquant_mlx.ops.parts import shared_by_heads

    keys = mx.random.split(mx.random.key(seed), 3)
    a = q.quantize(mx.random.normal((B, n, r), key=keys[0]), 4, 32)
    p = mx.random.normal((B, H, r, D), key=keys[1]) / r ** 0.5
    m = (mx.random.normal((B, H, 1, D), key=keys[2]) * 0.3).astype(mx.float16)
    if bits is None:
        p = p.astype(mx.float16)
        proj, p_float = DensePart(p), p.astype(mx.float32)
    else:
        pq = q.quantize(p, bits, 32)
        proj, p_float = token_codes(pq), q.dequantize(pq, mx.float32)
    x = q.dequantize(a, mx.float32)[:, None] @ p_float + m.astype(mx.float32)
    rows = shared_by_heads(a, H)
    if not shared:
        rows = token_codes(q.Quantized(*(mx.contiguous(x) for x in rows.stored()[3]),
                                       mx.contiguous(rows.stored()[4]), 4, 32))
    return rows, proj, m, x


@pytest.mark.parametrize("bits", [4, 8, None])
@pytest.mark.parametrize("n,shared", [(200, True), (native.THREADED_KEYS + 100, True),
                                      (200, False)])
def test_projected_parts_apply_their_factor_and_mean_in_the_op(
        bits: int | None, n: int, shared: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # xKV's keys after RoPE and values: the op projects the queries onto each head's
    # factor (q P^T, plus q . m) and the probabilities' product back ((p a) P + (sum p) m),
    # between a float sink and window; against softmax(q K^T) V over the dense keys.
    monkeypatch.setattr(native, "THREADS", 2)
    rows_k, pk, mk, k = _factored(n, 32, 40, bits, shared)
    rows_v, pv, mv, v = _factored(n, 64, 41, bits, shared)
    sink_k, sink_v, win_k, win_v = (_normal(4, 42 + i) for i in range(4))
    keys = [DensePart(sink_k), native.Placed(rows_k, project=pk, mean=mk), DensePart(win_k)]
    values = [DensePart(sink_v), native.Placed(rows_v, project=pv, mean=mv), DensePart(win_v)]
    queries = mx.random.normal((B, H, 3, D), key=mx.random.key(46)) * 0.125
    calls = _counted(monkeypatch)
    out = native.decode(queries, keys, values)
    assert calls == [2]
    dense_k = mx.concatenate([sink_k, k, win_k], axis=2)
    dense_v = mx.concatenate([sink_v, v, win_v], axis=2)
    want = mx.softmax(queries @ dense_k.swapaxes(-1, -2), axis=-1) @ dense_v
    assert _close(out, want) < 2e-5


@pytest.mark.parametrize("bits,traditional,dims", [
    (4, False, D), (None, True, D), (8, False, D // 2), (4, True, D // 2)])
@pytest.mark.parametrize("n,shared", [(200, True), (native.THREADED_KEYS + 100, True),
                                      (203, False)])
def test_keys_stored_before_rope_are_rebuilt_and_rotated_in_the_op(
        bits: int | None, traditional: bool, dims: int, n: int, shared: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # xKV's default and XQuant: keys a P_h + m_h stored before RoPE, rebuilt a few tokens at
    # a time, rotated to positions 300 on and scored; against attention over the dense keys
    # rotated by MLX's RoPE.
    from veloxquant_mlx.ops import rope

    monkeypatch.setattr(native, "THREADS", 2)
    start = 300
    rows, proj, mean, k = _factored(n, 32, 70, bits, shared)
    v = _normal(n, 71)
    tables = rope.tables(start, dims, 10000.0, traditional, 1.0)
    queries = mx.random.normal((B, H, 3, D), key=mx.random.key(72)) * 0.125
    calls = _counted(monkeypatch)
    got = native.decode(queries, [native.Placed(rows, project=proj, mean=mean, rope=tables)],
                        [DensePart(v)])
    assert calls == [1]
    rotated = mx.fast.rope(k, dims, traditional=traditional, base=10000.0, scale=1.0,
                           offset=start)
    want = mx.softmax(queries @ rotated.swapaxes(-1, -2), axis=-1) @ v
    # The tables' angles round apart from mx.fast.rope's by about 3e-8 x position
    # (ops.rope.angles): at positions past 2000 that alone reaches 2e-5.
    assert _close(got, want) < (2e-5 if n < 1000 else 1e-4)
    # The keys unrotated, or without their mean, are visibly off: the bound catches either.
    mean_at = mx.broadcast_to(mean.astype(mx.float32), k.shape)
    for wrong in (k, rotated - mx.fast.rope(mean_at, dims, traditional=traditional,
                                            base=10000.0, scale=1.0, offset=start)):
        assert _close(mx.softmax(queries @ wrong.swapaxes(-1, -2), axis=-1) @ v, want) > 1e-3


def test_float_rows_are_rebuilt_too() -> None:
    # Rows kept as floats (a window, XQuant-CL's layer input) with a float32 projection of
    # an odd width: the column blocks of the rebuild and its single-column tail.
    from veloxquant_mlx.ops import rope
    from veloxquant_mlx.ops.parts import shared_by_heads

    n, r, width = 45, 24, 40
    a = mx.random.normal((B, n, r), key=mx.random.key(73))
    p = mx.random.normal((B, H, r, width), key=mx.random.key(74)) / r ** 0.5
    m = mx.random.normal((B, H, 1, width), key=mx.random.key(75))
    v = mx.random.normal((B, H, n, 64), key=mx.random.key(76))
    tables = rope.tables(9, width, 10000.0, False, 1.0)
    queries = mx.random.normal((B, H, 2, width), key=mx.random.key(77)) * 0.2
    got = native.decode(queries, [native.Placed(shared_by_heads(a, H), project=DensePart(p),
                                                mean=m, rope=tables)],
                        [token_codes(q.quantize(v, 8, 32))])
    k = mx.fast.rope(a[:, None] @ p + m, width, traditional=False, base=10000.0, scale=1.0,
                     offset=9)
    want = mx.softmax(queries @ k.swapaxes(-1, -2), axis=-1) @ q.dequantize(
        q.quantize(v, 8, 32), mx.float32)
    assert _close(got, want) < 2e-5


@pytest.mark.parametrize("method", [
    "xkv:group_layers=2,block=512,rank_k=64,rank_v=64,factor_bits=4", "xquant"])
def test_keys_stored_before_rope_leave_no_float_transient(
        method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The user's loop at 1100 tokens: a decode step allocates far less than one layer's
    # keys as floats. Rebuilt with MLX's ops (the path taken where the op cannot rebuild),
    # the keys, their decoded factor and their RoPE tables were transients bigger than that.
    # The first step after the prompt is left out: xKV compresses a block there.
    from veloxquant_mlx import KVCacheBuilder, KVCacheConfig
    from veloxquant_mlx.testing.tiny import tiny_model

    def step_peak() -> int:
        model = tiny_model("llama", head_dim=64)
        tokens = mx.random.randint(0, 128, (1, 1102), key=mx.random.key(3))
        caches = KVCacheBuilder.for_model(model, KVCacheConfig.from_string(method))
        for i in range(0, 1100, 512):
            mx.eval(model(tokens[:, i:min(i + 512, 1100)], cache=caches))
        mx.eval(model(tokens[:, 1100:1101], cache=caches))
        mx.synchronize()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        mx.eval(model(tokens[:, 1101:], cache=caches))
        heads = model.layers[0].self_attn.n_kv_heads
        return mx.get_peak_memory() - base, 1100 * heads * 64 * 4

    peak, keys = step_peak()
    assert peak < keys / 4
    monkeypatch.setattr(native, "rebuildable", lambda *parts: False)
    assert step_peak()[0] > keys  # the bound tells the two apart


def test_a_projection_must_match_its_part() -> None:
    # A projection with a row per dim of its part and a mean of its width; a projected
    # part has no shift of its own.
    rows, proj, mean, _ = _factored(8, 32, 47, 4)
    queries = mx.ones((B, H, 1, D))
    for placed, message in [
            (native.Placed(rows, project=DensePart(mx.ones((B, H, 16, D))), mean=mean),
             "one row per dim of its part"),
            (native.Placed(rows, project=proj, mean=mean[..., :32]),
             "mean must be floats"),
            (native.Placed(rows, project=proj, mean=mean, shift=mx.ones((B, H, 1, 1))),
             "shift and mass must be false for a projected part")]:
        with pytest.raises(ValueError, match=message):
            mx.eval(native.decode(queries, [placed], [DensePart(_normal(8, 48))]))


def test_a_long_store_split_across_threads_gives_mlx_results(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "THREADS", 2)
    n = native.THREADED_KEYS + 64
    keys = [ChannelCodes(q.quantize_tokens(_normal(n, 26), 4, 64))]
    values = [coded_part(cb.encode(_normal(n, 27), 4, "bytes"))]
    queries = mx.random.normal((B, H * 3, 1, D), key=mx.random.key(28))
    fused, plain, calls = _both(monkeypatch, queries, keys, values)
    assert calls == 1
    assert _close(fused, plain) < 2e-5


@pytest.mark.parametrize("lengths", [(230, 170, 300), (230, 60, 300)])
@pytest.mark.parametrize("method", ["kivi:bits=4,group_size=32", "turboquant"])
def test_a_batch_attends_each_row_in_the_fused_kernel(method: str, lengths: tuple[int, ...],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # A server's decode step: rows of different lengths, no padded layout or mask; the
    # same logits as each row alone (and as MLX's padded batch: test_batch_attention).
    from veloxquant_mlx import KVCacheBuilder, KVCacheConfig
    from veloxquant_mlx.cache.batch import BatchedCache
    from veloxquant_mlx.ops import streams
    from veloxquant_mlx.testing.tiny import tiny_model

    model = tiny_model("llama", seed=3)
    config = KVCacheConfig.from_string(method)
    # 60 tokens: a row still all in KIVI's float window (128 tokens) rides in the same op.
    prompts = [mx.random.randint(0, 128, (1, n), key=mx.random.key(n)) for n in lengths]

    def rows() -> list[list]:
        out = []
        for p in prompts:
            caches = KVCacheBuilder.for_model(model, config)
            mx.eval(model(p, cache=caches))
            out.append(caches)
        return out

    alone = [model(mx.array([[5]]), cache=c)[0, -1] for c in rows()]
    calls = _counted(monkeypatch)
    layers = [BatchedCache.merge(list(col)) for col in zip(*rows())]
    batched = model(mx.array([[5]] * len(prompts)), cache=layers)[:, -1]
    # One op per layer and group of rows (each group on a CPU stream of its own).
    assert len(calls) == len(streams.spread(len(prompts))) * len(model.layers)
    assert max(_close(b, a) for b, a in zip(batched, alone)) < 1e-4


def _factor(n: int, r: int, seed: int) -> q.Quantized:
    """A token factor [B, 1, n, r] as xKV stores it, one view shared by the H heads."""
    qt = q.quantize(mx.random.normal((B, 1, n, r), key=mx.random.key(seed)), 4, 32)
    return q.Quantized(*(mx.broadcast_to(a, (B, H, *a.shape[2:])) for a in qt.arrays), 4, 32)


@pytest.mark.parametrize("rows", [1, 3])
def test_factor_space_parts_give_the_dense_result(rows: int) -> None:
    # Keys and values x = a B_h + m_h with a token factor a shared by the KV heads: the op
    # scores q B_h^T at its query offset plus the shift q . m_h, and writes p a and the
    # probability mass at its output offset; B_h and m_h applied after it give attention
    # over the rebuilt keys and values.
    n, r, w = 100, 64, 20
    ak, av = _factor(n, r, 40), _factor(n, r, 41)
    bk, bv = _normal(r, 42) / 8, _normal(r, 43) / 8  # [B, H, r, D] per head
    mk, mv = _normal(1, 44), _normal(1, 45)
    win_k, win_v = _normal(w, 46), _normal(w, 47)
    qh = mx.random.normal((B, H, rows, D), key=mx.random.key(48)) * 0.125
    keys = [native.Placed(token_codes(ak), qoff=D, shift=qh @ mk.swapaxes(-1, -2)),
            DensePart(win_k)]
    values = [native.Placed(token_codes(av), ooff=D, mass=True), DensePart(win_v)]
    o = native.decode(mx.concatenate([qh, qh @ bk.swapaxes(-1, -2)], axis=-1), keys, values)
    assert o is not None and o.shape == (B, H, rows, D + r + 1)
    out = o[..., :D] + o[..., D:D + r] @ bv + o[..., D + r:] * mv
    k = mx.concatenate([q.dequantize(ak, mx.float32) @ bk + mk, win_k], axis=2)
    v = mx.concatenate([q.dequantize(av, mx.float32) @ bv + mv, win_v], axis=2)
    want = mx.softmax(qh @ k.swapaxes(-1, -2), axis=-1) @ v
    assert _close(out, want) < 2e-5
    # Without the shift the scores differ visibly: the bound would catch a dropped one.
    keys[0] = native.Placed(token_codes(ak), qoff=D)
    o = native.decode(mx.concatenate([qh, qh @ bk.swapaxes(-1, -2)], axis=-1), keys, values)
    assert _close(o[..., :D] + o[..., D:D + r] @ bv + o[..., D + r:] * mv, want) > 1e-3


@pytest.mark.parametrize("rows", [3, 12])
def test_a_part_shared_by_the_heads_gives_what_each_head_copy_gives(rows: int) -> None:
    # A view with head stride 0 is read once for every head's rows (threads split its
    # tokens): as keys, scored for all heads; as values, after every head's softmax. The
    # same codes copied per head go through each head's own pass.
    n = native.THREADED_KEYS + 40
    shared_k, shared_v = _factor(n, D, 50), _factor(n, D, 51)

    def copied(x: q.Quantized) -> q.Quantized:
        return q.Quantized(*(mx.concatenate([a[:, :1]] * H, axis=1) for a in x.arrays), 4, 32)

    win = _normal(7, 53)
    qh = mx.random.normal((B, H, rows, D), key=mx.random.key(52))

    def run(k: q.Quantized, v: q.Quantized) -> mx.array:
        values = [native.Placed(token_codes(v), ooff=D, mass=True), DensePart(win)]
        return native.decode(qh, [token_codes(k), DensePart(win)], values)

    want = run(copied(shared_k), copied(shared_v))
    assert want.shape == (B, H, rows, 2 * D + 1)
    # Within float32's order of summation (the threads' partial sums).
    assert _close(run(shared_k, copied(shared_v)), want) < 1e-5
    assert _close(run(shared_k, shared_v), want) < 1e-5
    # Another head's codes in place of the shared ones change the result visibly.
    assert _close(run(shared_k, _factor(n, D, 54)), want) > 1e-2


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dims", [D, D // 2])
def test_a_rotated_dense_part_gives_attention_over_rope_keys(traditional: bool,
                                                             dims: int) -> None:
    # Keys rebuilt before RoPE (xKV's default, XQuant) are rotated by the op as it reads
    # them: the same as MLX's RoPE then attention, from position 300 on (partial RoPE too).
    from veloxquant_mlx.ops import rope

    n, start = 70, 300
    k, v = _normal(n, 60), _normal(n, 61)
    qh = mx.random.normal((B, H, 3, D), key=mx.random.key(62)) * 0.125
    tables = rope.tables(start, dims, 10000.0, traditional, 1.0)
    got = native.decode(qh, [native.Placed(DensePart(k), rope=tables)],
                        [token_codes(q.quantize(v, 8, 32))])
    rotated = mx.fast.rope(k, dims, traditional=traditional, base=10000.0, scale=1.0,
                           offset=start)
    want = native.decode(qh, [DensePart(rotated)], [token_codes(q.quantize(v, 8, 32))])
    assert _close(got, want) < 2e-5
    # Unrotated keys differ visibly: the bound would catch a rotation left out.
    plain = native.decode(qh, [DensePart(k)], [token_codes(q.quantize(v, 8, 32))])
    assert _close(plain, want) > 1e-3


@pytest.mark.parametrize("start", [0, 123_457])
def test_the_ops_angles_are_those_of_the_librarys_rope(start: int) -> None:
    # The op makes cos and sin as ops.rope.angles does (angle addition), each angle turned
    # on from an exactly computed one at most seven times. The table rounds each product
    # position x frequency once, about 3e-8 x position (ops.rope.angles), which the turns
    # do not: that is the bound, 2e-5 near position 0, and a position off is far outside.
    from veloxquant_mlx.ops import rope

    n = 700
    k, v = _normal(n, 63), _normal(n, 64)
    qh = mx.random.normal((B, H, 3, D), key=mx.random.key(65)) * 0.125
    tables = rope.tables(start, D, 10000.0, False, 1.0)
    values = [token_codes(q.quantize(v, 8, 32))]
    got = native.decode(qh, [native.Placed(DensePart(k), rope=tables)], values)
    want = native.decode(qh, [DensePart(rope._rotate_by_table(k, D, 10000.0, False, 1.0,
                                                               start))], values)
    bound = 1e-5 + 3e-8 * (start + n)
    assert _close(got, want) < bound
    off = native.decode(qh, [DensePart(rope._rotate_by_table(k, D, 10000.0, False, 1.0,
                                                               start + 1))], values)
    assert _close(off, want) > 10 * bound


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("scales", [mx.float16, mx.float32])
def test_token_codes_decode_to_mlx_values(bits: int, group: int, scales: mx.Dtype) -> None:
    # The one-op decoding of token-coded rows (ops.factors.load_rows on the CPU) gives
    # what MLX's dequantize gives, on a long store (two threads) and a view into one.
    x = mx.random.normal((2, 1, native.THREADED_VALUES // 256 + 7, 256), key=mx.random.key(60))
    qt = q.quantize(x, bits, group)
    qt = q.Quantized(qt.codes, qt.scales.astype(scales), qt.biases.astype(scales), bits, group)
    want = q.dequantize(qt, mx.float32)
    got = native.floats_of(qt)
    assert got is not None and got.shape == want.shape and got.dtype == mx.float32
    assert mx.array_equal(got, want)
    view = q.Quantized(*(mx.broadcast_to(a[:, :, 5:40], (2, 3, 35, a.shape[-1]))
                         for a in qt.arrays), bits, group)
    assert mx.array_equal(native.floats_of(view), q.dequantize(view, mx.float32))
    # A wrong bias would be seen: the bound is exact equality.
    off = q.Quantized(qt.codes, qt.scales, qt.biases + 0.001, bits, group)
    assert not mx.array_equal(native.floats_of(off), want)


def test_token_codes_the_op_cannot_decode_take_mlx_ops() -> None:
    qt = q.quantize(mx.random.normal((4, 64)), 4, 32)
    odd = q.Quantized(qt.codes, qt.scales, qt.biases, 4, 8)  # groups of 8: not whole blocks
    assert native.floats_of(odd) is None
    with pytest.raises(ValueError, match="group must divide the row"):
        native._native.floats_of(qt.codes, qt.scales, qt.biases, 4, 24)


def test_decoded_rows_add_what_they_are_given() -> None:
    # XQuant-CL sums a layer's decoded deltas onto the layer before's reconstruction.
    qt = q.quantize(mx.random.normal((1, 300, 256), key=mx.random.key(61)), 4, 32)
    base = mx.random.normal((1, 300, 256), key=mx.random.key(62))
    got = native.floats_of(qt, plus=base)
    assert got is not None
    assert _close(got, base + q.dequantize(qt, mx.float32)) < 1e-6
    assert native.floats_of(qt, plus=base[:, :1]) is None  # a broadcast takes MLX's add


def test_the_rms_norm_gives_mlx_values() -> None:
    # XQuant-CL normalizes every held token's reconstruction at each step.
    x = mx.random.normal((2, native.THREADED_VALUES // 500, 500), key=mx.random.key(63))
    w = mx.random.normal((500,), key=mx.random.key(64))
    for rows in (x, x[:, 3:40]):  # a long store (two threads) and a view into one
        got = native.rms_norm(rows, w, 1e-5)
        assert got is not None and _close(got, mx.fast.rms_norm(rows, w, 1e-5)) < 1e-5
    assert _close(native.rms_norm(x, w * 2, 1e-5), mx.fast.rms_norm(x, w, 1e-5)) > 0.5
    assert native.rms_norm(x.astype(mx.float16), w, 1e-5) is None  # float32 rows only
