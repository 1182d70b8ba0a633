"""Random calls of the fused CPU kernel's three entry points (``csrc/``): each is
refused with a ValueError or TypeError naming the problem, or, where it is valid, gives a
finite result equal to MLX's ops on the same arrays; no call crashes the process.

Hypothesis draws valid calls (shapes, dtypes, bit widths, group sizes, placements, strided
views, thread counts, causal chunks) and perturbs most of them in one place (an axis, a
dtype, a field of a part's description, a count, a stride past the buffer), plus wholly
random ones. The loop
runs in a child process: a segfault fails the test instead of ending pytest, and the case
that crashed is named. ``VELOXQUANT_FUZZ_CASES`` sets the number of cases (default 400),
``VELOXQUANT_FUZZ_SEED`` the seed."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from veloxquant_mlx.ops import native

CASES = int(os.environ.get("VELOXQUANT_FUZZ_CASES", "400"))
SEED = int(os.environ.get("VELOXQUANT_FUZZ_SEED", "20261206"))
FLOATS = [mx.float32, mx.float16, mx.bfloat16]
ANY_DTYPES = [*FLOATS, mx.uint8, mx.uint16, mx.uint32, mx.int32, mx.int8, mx.bool_]
ODD_INTS = [-1, 0, 1, 2, 3, 4, 5, 7, 8, 16, 31, 32, 33, 64, 65536, 65537, 2**31 - 1, -2**31]


def test_random_calls_are_refused_or_match_mlx() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp) / "case.txt"
        # The child imports this checkout's package, as pytest does.
        root = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [root, *filter(None, [os.environ.get("PYTHONPATH")])])}
        child = subprocess.run([sys.executable, __file__, str(CASES), str(SEED), str(where)],
                               capture_output=True, text=True, timeout=900, env=env)
        case = where.read_text() if where.exists() else "(none started)"
    out = child.stdout.strip().splitlines()
    assert child.returncode == 0, (f"exit {child.returncode} (-11: a segfault) in the case\n"
                                   f"{case}\n{child.stderr[-4000:]}")
    print(out[-1])  # fuzz: N cases, V valid, R refused, 0 crashes
    words = out[-1].split()
    ran, valid, refused = int(words[1]), int(words[3]), int(words[5])
    assert ran >= CASES // 2 and valid >= ran // 10 and refused >= ran // 4, out[-1]


# ---------------------------------------------------------------- MLX's reading of a call
def _levels(codes: mx.array, bits: int) -> mx.array:
    """Codes packed from the low bits up, each word in order, as float levels."""
    per = codes.dtype.size * 8 // bits
    shifts = (mx.arange(per) * bits).astype(codes.dtype)
    lv = (codes[..., None] >> shifts) & ((1 << bits) - 1)
    return lv.reshape(*codes.shape[:-1], codes.shape[-1] * per).astype(mx.float32)


def _grouped(lv: mx.array, s: mx.array, z: mx.array | None, group: int) -> mx.array:
    g = lv.reshape(*s.shape, group) * s.astype(mx.float32)[..., None]
    if z is not None:
        g = g + z.astype(mx.float32)[..., None]
    return g.reshape(lv.shape)


def _stored_rows(f: native.Form, take: Any) -> mx.array:
    """A stored form's rows [B, H, n, d] in float32, its arrays taken in the op's order."""
    kind, bits, group, has_z, has_t = f.kind, f.bits, f.group, f.biases, f.table
    a = take()
    if kind == 0:
        return a.astype(mx.float32)
    s = take()
    z = take() if has_z else None
    lv = _levels(a, bits)
    if has_t:
        lv = mx.take(take(), lv.astype(mx.uint32))
    if kind == 1:
        return _grouped(lv, s, z, group)
    return _grouped(lv, s, z, group).swapaxes(-1, -2)  # channel: [B, H, D, n] stored


def _rotated(x: mx.array, inv: mx.array, start: mx.array, pairs: bool) -> mx.array:
    half = inv.shape[-1]
    pos = start.reshape(()).astype(mx.float32) + mx.arange(x.shape[2], dtype=mx.float32)
    ang = pos[:, None] * inv.reshape(1, half)
    c, s = mx.cos(ang), mx.sin(ang)
    if pairs:
        u, v = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
        turned = mx.stack([u * c - v * s, u * s + v * c], axis=-1).reshape(*u.shape[:-1], 2 * half)
    else:
        u, v = x[..., :half], x[..., half:2 * half]
        turned = mx.concatenate([u * c - v * s, u * s + v * c], axis=-1)
    return mx.concatenate([turned, x[..., 2 * half:]], axis=-1)


def _placed_part(sp: native.PartSpec, take: Any) -> tuple[mx.array, mx.array | None]:
    """A part's rows (projected and rotated as the op reads them) and its shift."""
    x = _stored_rows(sp.form, take)
    shift = take() if sp.shift else None
    rot = (take(), take()) if sp.rotate else None
    if sp.projection is not None:
        p = _stored_rows(sp.projection, take)
        x = x @ p + take().astype(mx.float32)
    if rot is not None:
        x = _rotated(x, *rot, sp.pairs)
    return x, shift


def _reference(q: mx.array, arrays: list, parts: list[native.PartSpec], counts: list[int],
               causal: int) -> mx.array:
    """The op's result with MLX's ops: each row set's scores, softmax, placed values."""
    it = iter(arrays)
    outs, first = [], 0
    plans = len(counts) // 2
    for i in range(plans):
        qi = q if plans == 1 else q[i:i + 1]
        nk, nv = counts[2 * i], counts[2 * i + 1]
        scores, vals = [], []
        for j in range(first, first + nk + nv):
            sp = parts[j]
            x, shift = _placed_part(sp, lambda: next(it))
            if j < first + nk:
                sc = qi[..., sp.qoff:sp.qoff + x.shape[-1]] @ x.swapaxes(-1, -2)
                scores.append(sc if shift is None else sc + shift)
            else:
                vals.append((sp, x))
        first += nk + nv
        sc = mx.concatenate(scores, axis=-1)
        R, S = sc.shape[2], sc.shape[3]
        if causal:
            seen = S - causal + 1 + mx.arange(R) % causal
            sc = mx.where(mx.arange(S)[None] < seen[:, None], sc, -mx.inf)
        p = mx.softmax(sc, axis=-1)
        width = max(sp.ooff + x.shape[-1] + sp.mass for sp, x in vals)
        out, t = mx.zeros((*p.shape[:3], width)), 0
        for sp, x in vals:
            pj = p[..., t:t + x.shape[2]]
            t += x.shape[2]
            out[..., sp.ooff:sp.ooff + x.shape[-1]] += pj @ x
            if sp.mass:
                out[..., sp.ooff + x.shape[-1]] += pj.sum(-1)
        outs.append(out)
    return outs[0] if plans == 1 else mx.concatenate(outs, axis=0)


def _decoded(codes: mx.array, scales: mx.array, biases: mx.array, bits: int, group: int,
             plus: mx.array | None = None) -> mx.array:
    out = _grouped(_levels(codes, bits), scales, biases, group)
    return out if plus is None else out + plus


def _expected(fn: str, args: list) -> mx.array:
    if fn == "decode_attention":
        q, arrays, parts, counts, _, causal = args
        return _reference(q, arrays, parts, counts, causal)
    if fn == "floats_of":
        codes, s, z, bits, group, _, plus = args
        return _decoded(codes, s, z, bits, group, plus)
    x, w, eps, _ = args
    return mx.fast.rms_norm(x, w.astype(mx.float32), eps)


# ---------------------------------------------------------------- valid calls
VIEWS = ["plain", "transposed", "sliced", "reversed", "heads", "one head"]


def _view(x: mx.array, how: str) -> mx.array:
    """The values of ``x`` [B, H, n, d] read through other strides (all valid views)."""
    if how == "transposed":  # stored [.., d, n]: the last axis strided
        return mx.contiguous(x.swapaxes(-1, -2)).swapaxes(-1, -2)
    if how == "sliced":  # a window of a longer buffer
        return mx.concatenate([x[:, :, :1], x, x[:, :, :1]], axis=2)[:, :, 1:1 + x.shape[2]]
    if how == "reversed":  # negative token stride
        return mx.contiguous(x[:, :, ::-1])[:, :, ::-1]
    if how == "one head":  # head stride 0: read once for every head
        return mx.broadcast_to(x[:, :1], x.shape)
    if how == "heads":  # every other head of a buffer of twice the heads
        B, H, n, d = x.shape
        return mx.stack([x, x], axis=2).reshape(B, 2 * H, n, d)[:, ::2]
    return x


def _normal(rng: np.random.Generator, shape: tuple, scale: float = 1.0) -> mx.array:
    return mx.array((rng.standard_normal(shape) * scale).astype(np.float32))


def _random_array(rng: np.random.Generator, shape: tuple, dtype: mx.Dtype) -> mx.array:
    if dtype in FLOATS:
        return _normal(rng, shape).astype(dtype)
    if dtype == mx.bool_:
        return mx.array(rng.integers(0, 2, shape).astype(bool))
    return mx.array(rng.integers(0, 256, shape).astype(np.uint8)).astype(dtype)


def _codes(rng: np.random.Generator, shape: tuple, wide: bool) -> mx.array:
    if wide:
        return mx.array(rng.integers(0, 2**32, shape, dtype=np.uint32))
    return mx.array(rng.integers(0, 256, shape, dtype=np.uint8))


def _stored(draw: Any, rng: np.random.Generator, kind: str, shape: tuple, bits: int,
            plain: bool = False) -> tuple[native.Form, list[mx.array]]:
    """A stored form of rows [B, H, n, d] (channel: n tokens a multiple of 32 / bits):
    its description and arrays."""
    B, H, n, d = shape
    shared = H > 1 and draw(st.integers(0, 3)) == 0  # a low-rank factor every head reads
    if kind == "dense":
        x = _normal(rng, shape).astype(draw(st.sampled_from(FLOATS)))
        return native.Form(native.PartKind.dense), \
            [_view(x, "one head" if shared else draw(st.sampled_from(VIEWS)))]
    per, along = 32 // bits, d if kind == "token" else n
    group = draw(st.sampled_from([g for g in (per, 2 * per, 16, 32, 64, along)
                                  if g % per == 0 and along % g == 0 and g % (16 if plain else 1) == 0]))
    wide = draw(st.booleans())
    rows = (B, H, n, d * bits // (32 if wide else 8)) if kind == "token" else \
        (B, H, d, n * bits // (32 if wide else 8))
    codes = _codes(rng, rows, wide)
    sdt = draw(st.sampled_from(FLOATS))
    s_shape = (B, H, n, d // group) if kind == "token" else (B, H, d, n // group)
    s = mx.array(rng.uniform(0.5, 1.5, s_shape).astype(np.float32) / 2**bits).astype(sdt)
    if kind == "token" and n and draw(st.booleans()):  # one scale for every token
        s = mx.broadcast_to(s[:, :, :1], s.shape)
    has_z = kind == "channel" or draw(st.booleans())
    has_t = kind == "token" and not plain and bits <= 4 and draw(st.booleans())
    arrays = [_view(codes, draw(st.sampled_from(["plain", "sliced", "heads", "one head"]))),
              _view(s, draw(st.sampled_from(VIEWS)))]
    if has_z:
        arrays.append(_normal(rng, s_shape, 0.1).astype(sdt))
    if shared:
        arrays = [_view(a, "one head") for a in arrays]
    if has_t:
        arrays.append(_normal(rng, (2**bits,)))
    return native.Form(native.PartKind[kind], bits, group, has_z, has_t), arrays


def _tokens(draw: Any, kind: str, bits: int) -> int:
    if kind == "channel":  # whole words of codes along the tokens
        return 32 // bits * draw(st.integers(1, 2))
    return draw(st.integers(0, 20))


def _part(draw: Any, rng: np.random.Generator, role: str, B: int, H: int, R: int,
          n: int, width: int, kind: str, bits: int) -> tuple[native.PartSpec, list[mx.array]]:
    """One key or value part of ``n`` tokens read at ``width`` dims (query or output):
    its stored form, maybe a projection (a rank-32 factor, its B and mean), a rotation
    (keys) and a score shift (keys, unprojected)."""
    project = kind != "channel" and draw(st.integers(0, 5)) == 0
    rotate = role == "key" and (kind == "dense" or project) and draw(st.integers(0, 3)) == 0
    form, arrays = _stored(draw, rng, kind, (B, H, n, 32 if project else width), bits,
                           plain=rotate)
    sp = native.PartSpec(form, rotate=rotate)
    if role == "key" and not project and draw(st.integers(0, 4)) == 0:
        sp.shift = True
        arrays.append(_view(_normal(rng, (B, H, R, 1)), draw(st.sampled_from(VIEWS))))
    if rotate:
        sp.pairs = draw(st.booleans())
        half = draw(st.sampled_from([width // 4, width // 2]))
        inv = mx.array((10000.0 ** -(np.arange(half) / half)).astype(np.float32))
        arrays += [inv.reshape(1, 1, 1, half),
                   mx.array([[[[draw(st.integers(0, 300))]]]], dtype=mx.int32)]
    if project:
        pkind = draw(st.sampled_from(["dense", "token"]))
        sp.projection, proj = _stored(draw, rng, pkind, (B, H, 32, width),
                                      draw(st.sampled_from([2, 4, 8])), plain=True)
        arrays += [*proj, _normal(rng, (B, H, 1, width), 0.3)]
    return sp, arrays


def _splits(rng: np.random.Generator, S: int, parts: int) -> list[int]:
    cuts = sorted(rng.integers(0, S + 1, parts - 1).tolist())
    return [b - a for a, b in zip([0, *cuts], [*cuts, S])]


def _attention_call(draw: Any, rng: np.random.Generator) -> list:
    B, H, R = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    D, extra = draw(st.sampled_from([32, 64])), draw(st.sampled_from([0, 32]))
    parts, arrays, S, placed_any = [], [], 0, False
    for i in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["dense", "token", "channel"]))
        bits = draw(st.sampled_from([1, 2, 4, 8]))
        n = max(_tokens(draw, kind, bits), int(i == 0 and kind != "channel"))
        at = D if extra and i and draw(st.booleans()) else 0  # placed past the head dims
        sp, arr = _part(draw, rng, "key", B, H, R, n, extra if at else D, kind, bits)
        sp.qoff, placed_any = at, placed_any or at > 0
        parts, arrays, S = parts + [sp], arrays + arr, S + n
    extra = extra if placed_any else 0  # else the parts read all the query dims
    n_values, ooff = draw(st.integers(1, 3)), D
    for n in _splits(rng, S, n_values):
        kind = draw(st.sampled_from(["dense", "token"]))
        placed = draw(st.integers(0, 3)) == 0
        sp, arr = _part(draw, rng, "value", B, H, R, n, 32 if placed else D, kind,
                        draw(st.sampled_from([1, 2, 4, 8])))
        if placed:
            sp.mass = sp.projection is None and draw(st.booleans())
            sp.ooff = ooff
            ooff += 32 + sp.mass
        parts, arrays = parts + [sp], arrays + arr
    q = _view(_normal(rng, (B, H, R, D + extra), 0.5), draw(st.sampled_from(VIEWS)))
    counts = [len(parts) - n_values, n_values]
    causal = draw(st.sampled_from([0, *[c for c in range(1, R + 1) if R % c == 0 and c <= S]]))
    if B > 1 and draw(st.booleans()):  # each batch row its own parts: the same, cut apart
        rows = [[a[b:b + 1] if a.ndim == 4 and a.shape[0] == B else a for a in arrays]
                for b in range(B)]
        arrays, parts, counts = [a for r in rows for a in r], parts * B, counts * B
    return ["decode_attention", [q, arrays, parts, counts, draw(st.integers(1, 3)), causal]]


def _floats_call(draw: Any, rng: np.random.Generator) -> list:
    lead = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=3)))
    bits, D = draw(st.sampled_from([1, 2, 4, 8])), draw(st.sampled_from([32, 64, 128]))
    group = draw(st.sampled_from([g for g in (16, 32, 64, 128) if D % g == 0]))
    wide = draw(st.booleans())
    codes = _codes(rng, (*lead, D * bits // (32 if wide else 8)), wide)
    sdt = draw(st.sampled_from(FLOATS))
    s = mx.array(rng.uniform(0.5, 1.5, (*lead, D // group)).astype(np.float32)).astype(sdt)
    z = _normal(rng, (*lead, D // group)).astype(sdt)
    plus = _normal(rng, (*lead, D)) if draw(st.booleans()) else None
    return ["floats_of", [codes, s, z, bits, group, draw(st.integers(1, 2)), plus]]


def _rms_call(draw: Any, rng: np.random.Generator) -> list:
    lead = tuple(draw(st.lists(st.integers(1, 4), min_size=0, max_size=2)))
    D = draw(st.integers(1, 70))
    x = _normal(rng, (*lead, D))
    if lead and draw(st.booleans()):  # rows of a longer buffer
        x = mx.concatenate([x, x], axis=0)[lead[0] // 2:lead[0] // 2 + lead[0]]
    w = _normal(rng, (D,)).astype(draw(st.sampled_from(FLOATS)))
    return ["rms_rows", [x, w, draw(st.sampled_from([1e-5, 1e-6, 0.1])), draw(st.integers(1, 2))]]


# ---------------------------------------------------------------- perturbed and random calls
def _arrays_of(args: list) -> list[tuple[Any, Any]]:
    """(container, index) of every array argument, the decode op's list included."""
    out = [(args, i) for i, a in enumerate(args) if isinstance(a, mx.array)]
    lists = [a for a in args if isinstance(a, list) and a and isinstance(a[0], mx.array)]
    return out + [(lst, i) for lst in lists for i in range(len(lst))]


def _past_buffer(a: mx.array, draw: Any) -> mx.array:
    """A view of ``a``'s buffer reaching past it (a stride or an offset too large)."""
    strides = [int(np.prod(a.shape[i + 1:])) for i in range(a.ndim)]
    if draw(st.booleans()) or a.ndim == 0:
        return mx.as_strided(a, a.shape, strides, a.size)
    ax = draw(st.integers(0, a.ndim - 1))
    strides[ax] = strides[ax] * 2 + 1 if a.shape[ax] > 1 else strides[ax]
    return mx.as_strided(a, a.shape, strides, a.size if a.shape[ax] <= 1 else 0)


def _reshaped(a: mx.array, draw: Any, rng: np.random.Generator) -> mx.array:
    how = draw(st.sampled_from(["axis", "dtype", "ndim", "past", "last", "broadcast"]))
    if how == "axis" and a.ndim:
        ax = draw(st.integers(0, a.ndim - 1))
        shape = list(a.shape)
        shape[ax] = draw(st.sampled_from([0, 1, 2, max(shape[ax] - 1, 0), shape[ax] + 1,
                                          shape[ax] * 2]))
        return _random_array(rng, tuple(shape), a.dtype)
    if how == "dtype":
        return a.astype(draw(st.sampled_from(ANY_DTYPES)))
    if how == "ndim":
        return a[None] if draw(st.booleans()) or a.ndim == 0 else a.reshape(-1)
    if how == "past":
        return _past_buffer(a, draw)
    if how == "last" and a.ndim >= 2:  # strided along its last axis
        return mx.contiguous(a.swapaxes(-1, -2)).swapaxes(-1, -2)
    if how == "broadcast" and a.ndim and a.shape[-1] > 1:
        return mx.broadcast_to(a[..., :1], a.shape)
    return a


def _perturbed(draw: Any, rng: np.random.Generator, call: list) -> list:
    """The call with one thing changed: an array, an int, a list of ints or of arrays."""
    fn, args = call
    args = [list(a) if isinstance(a, list) else a for a in args]
    what = draw(st.sampled_from(["array", "array", "array", "int", "ints", "arrays", "part"]))
    ints = [i for i, a in enumerate(args) if isinstance(a, (int, float)) and a is not None]
    int_lists = [a for a in args if isinstance(a, list) and a and isinstance(a[0], int)]
    if what == "array":
        box, i = draw(st.sampled_from(_arrays_of(args)))
        box[i] = _reshaped(box[i], draw, rng)
    elif what == "int" and ints:
        i = draw(st.sampled_from(ints))
        args[i] = draw(st.sampled_from([*ODD_INTS, args[i] + 1, args[i] - 1]))
    elif what == "ints" and int_lists:
        lst = draw(st.sampled_from(int_lists))
        i = draw(st.integers(0, len(lst) - 1))
        change = draw(st.sampled_from(["set", "drop", "add"]))
        if change == "set":
            lst[i] = draw(st.sampled_from([*ODD_INTS, lst[i] + 1, lst[i] - 1]))
        elif change == "drop":
            del lst[i]
        else:
            lst.insert(i, draw(st.sampled_from(ODD_INTS)))
    elif what == "part" and fn == "decode_attention" and args[2]:
        i = draw(st.integers(0, len(args[2]) - 1))
        args[2][i] = _odd_part(draw, args[2][i])
    elif fn == "decode_attention" and args[1]:
        i = draw(st.integers(0, len(args[1]) - 1))
        if draw(st.booleans()):
            del args[1][i]
        else:
            args[1].insert(i, args[1][i])
    elif fn == "floats_of":
        args[6] = None if args[6] is not None else _normal(rng, (2, 3))
    return [fn, args]


ODD_VALUES = [*ODD_INTS, True, False, None, "4", 1.5, [4]]


def _odd_part(draw: Any, part: native.PartSpec) -> Any:
    """The part's description with one field changed (its own or its form's, a valid
    value or one of the wrong type), or something that is no description."""
    how = draw(st.sampled_from(["field", "field", "form", "projection", "other"]))
    if how == "field":
        name = draw(st.sampled_from([f.name for f in fields(native.PartSpec)][1:]))
        return replace(part, **{name: draw(st.sampled_from(ODD_VALUES))})
    if how in ("form", "projection") and isinstance(part, native.PartSpec):
        form = getattr(part, how) or native.Form(native.PartKind.token, 4, 32)
        name = draw(st.sampled_from([f.name for f in fields(native.Form)]))
        return replace(part, **{how: replace(form, **{name: draw(st.sampled_from(ODD_VALUES))})})
    return draw(st.sampled_from([None, 3, "part", part.form if part else None]))


def _random_part(draw: Any) -> Any:
    some = st.sampled_from(ODD_VALUES)
    if draw(st.integers(0, 5)) == 0:
        return draw(some)
    form = native.Form(*[draw(some) for _ in fields(native.Form)])
    projection = native.Form(*[draw(some) for _ in fields(native.Form)])
    placed = [draw(some) for _ in fields(native.PartSpec)[1:-1]]
    return native.PartSpec(form, *placed, projection if draw(st.booleans()) else None)


def _random_call(draw: Any, rng: np.random.Generator) -> list:
    """Arrays of random shapes and dtypes, random ints: nearly always refused."""
    def arr(max_ndim: int = 5) -> mx.array:
        shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=max_ndim)))
        return _random_array(rng, shape, draw(st.sampled_from(ANY_DTYPES)))

    some = st.sampled_from(ODD_INTS)
    fn = draw(st.sampled_from(["decode_attention", "floats_of", "rms_rows"]))
    if fn == "decode_attention":
        parts = [_random_part(draw) for _ in range(draw(st.integers(0, 3)))]
        return [fn, [arr(), [arr() for _ in range(draw(st.integers(0, 5)))], parts,
                     draw(st.lists(some, max_size=4)), draw(some), draw(some)]]
    if fn == "floats_of":
        return [fn, [arr(), arr(), arr(), draw(some), draw(some), draw(some),
                     arr() if draw(st.booleans()) else None]]
    return [fn, [arr(), arr(), draw(st.floats(allow_nan=True)), draw(some)]]


# ---------------------------------------------------------------- one case, the child's loop
def _described(call: list) -> str:
    def one(a: Any) -> str:
        if isinstance(a, mx.array):
            return f"array{tuple(a.shape)} {a.dtype}"
        if isinstance(a, list):
            return "[" + ", ".join(one(x) for x in a) + "]"
        return repr(a)

    return f"{call[0]}(" + ", ".join(one(a) for a in call[1]) + ")"


def _finite(a: mx.array) -> bool:
    return bool(mx.all(mx.isfinite(a.astype(mx.float32))).item())


def _why_not_finite(fn: str, args: list, want: mx.array) -> str:
    again = getattr(native._native, fn)(*args)
    inputs = all(_finite(box[i]) for box, i in _arrays_of(args) if box[i].dtype in FLOATS)
    return (f"non-finite result of a valid call (inputs finite: {inputs}, MLX's result "
            f"finite: {_finite(want)}, the same call again finite: {_finite(again)})")


def _outcome(call: list) -> str:
    """'refused' (an error naming the problem) or 'valid' (MLX's result); else it fails."""
    fn, args = call
    try:
        out = getattr(native._native, fn)(*args)
        mx.eval(out)
    except (ValueError, TypeError) as e:
        msg = str(e)
        assert msg.startswith("veloxquant native: ") or "incompatible function arguments" in msg, msg
        return "refused"
    want = _expected(fn, args)
    assert out.shape == want.shape, (out.shape, want.shape)
    assert _finite(out), _why_not_finite(fn, args, want)
    err = mx.abs(out - want).max().item() if out.size else 0.0
    assert err <= 2e-4 * max(1.0, mx.abs(want).max().item() if out.size else 0.0), err
    return "valid"


def _call(draw: Any, rng: np.random.Generator) -> list:
    make = draw(st.sampled_from([_attention_call] * 4 + [_floats_call, _rms_call, _random_call]))
    call = make(draw, rng)
    if make is not _random_call and draw(st.integers(0, 9)) < 6:
        call = _perturbed(draw, rng, call)
    return call


def main(cases: int, seed_: int, where: str) -> None:
    tally: Counter[str] = Counter()

    @settings(max_examples=cases, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @seed(seed_)
    @given(st.data())
    def one(data: st.DataObject) -> None:
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
        call = _call(data.draw, rng)
        try:  # inputs MLX itself cannot build are no case
            mx.eval([a for box, i in _arrays_of(call[1]) for a in [box[i]]])
        except (ValueError, RuntimeError):
            tally["skipped"] += 1
            return
        Path(where).write_text(_described(call))
        tally[_outcome(call)] += 1

    one()
    ran = tally["valid"] + tally["refused"]
    print(f"fuzz: {ran} cases, {tally['valid']} valid, {tally['refused']} refused, 0 crashes "
          f"({tally['skipped']} skipped)")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
