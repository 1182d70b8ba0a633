"""The fused CPU decode attention (``csrc/``), when it is built.

On a CPU, the decode path of :func:`ops.attention.attend_parts` costs about a hundred
MLX ops per layer over a compressed cache, each a few microseconds and a pass over
memory. The extension does the whole decode attention of a layer in one op: scores of
every key part, softmax, product with every value part, the codes unpacked a few words
at a time (no float copy of a store). ``pip install`` builds it through
``mlx.extension`` (``setup.py``; ``make test`` and ``make demo`` do, through
``scripts/setup.sh``, and ``python setup.py build_ext --inplace`` rebuilds it in a
checkout); without it, or with
``VELOXQUANT_NATIVE=0``, attention runs on MLX's ops as before: the same results within
float tolerance, slower on a CPU. It is a CPU kernel: on a GPU backend MLX's ops run.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, fields
from enum import IntEnum
from typing import Any

import mlx.core as mx

from veloxquant_mlx.ops import quantize as q
from veloxquant_mlx.ops.kernels import on_gpu

ENV = "VELOXQUANT_NATIVE"
# Threads of one op over a long store (heads split between them): 2 measured 2-4% faster
# per decode step of the embedded model at 4096 tokens on 2 cores; short stores keep one
# (starting a thread costs tens of microseconds).
THREADS = min(2, os.cpu_count() or 1)
THREADED_KEYS = 2048
# A prompt chunk runs in the op up to CHUNK_ROWS query rows per KV head (heads per group
# x tokens) and CHUNK_SCORES scores (rows x keys, held at once); longer chunks take MLX's
# blocked path (bounded blocks, BLAS). A chunk over 1000 held tokens of the embedded
# model, fused against MLX's ops: 64 tokens (192 rows) 0.39-0.50 s against 0.44-0.60 s;
# 170 tokens a tie; 512 tokens (1536 rows) 4.2 against 3.85 s for turboquant.
CHUNK_ROWS = 256
CHUNK_SCORES = 1 << 21


class PartKind(IntEnum):
    """The kinds of part the op reads, named as ``stored()`` names them (``ops.parts``). The
    extension exports the same table (``_native.part_kinds``, ``csrc/parts.h``'s ``kKinds``):
    a build that differs is refused at load, and tests/test_native.py checks the two."""

    dense = 0
    token = 1
    channel = 2


@dataclass(slots=True)
class Form:
    """A stored form as the op reads it (``csrc/parts.h``'s ``Form``): its kind, the codes'
    bit width and group (0 for dense rows), whether biases and a table of levels follow its
    codes and scales."""

    kind: PartKind
    bits: int = 0
    group: int = 0
    biases: bool = False
    table: bool = False


@dataclass(slots=True)
class PartSpec:
    """One part of a call as the op reads it (``csrc/parts.h``'s ``PartSpec``; the extension
    refuses a missing field or one of the wrong type by its name). Its arrays follow one
    another in the call's list in this order: the form's (dense rows; or codes, scales, then
    biases and table where the form has them), the score shift ``[B, H, rows, 1]`` with
    ``shift``, RoPE's inverse frequencies and first position with ``rotate`` (``pairs``: it
    pairs neighbouring dims), then with ``projection`` that form's arrays and the mean.
    ``qoff`` and ``ooff``: the query and output dims where the part sits (:class:`Placed`);
    ``mass``: its probability mass goes to the output dim after its own."""

    form: Form
    qoff: int = 0
    ooff: int = 0
    shift: bool = False
    mass: bool = False
    rotate: bool = False
    pairs: bool = False
    projection: Form | None = None


def described_by(ext: Any) -> dict[str, Any]:
    """The part kinds and description fields of ``ext`` (the extension) or, given None,
    of this module: the two must be equal."""
    if ext is not None:
        return {name: getattr(ext, name, None)
                for name in ("part_kinds", "part_fields", "form_fields")}
    return {"part_kinds": {k.name: k.value for k in PartKind},
            "part_fields": tuple(f.name for f in fields(PartSpec)),
            "form_fields": tuple(f.name for f in fields(Form))}


@dataclass
class Placed:
    """A part read in factor space (low-rank caches, ``x = a B + m``): as keys, its scores
    use dims ``qoff:qoff + D`` of the query rows (the cache passes ``q B^T`` there) plus
    ``shift`` ``[B, H, rows, 1]`` (``q . m``); as values, ``p @ a`` goes to output dims
    ``ooff:ooff + D`` and, with ``mass``, the part's probability mass to dim ``ooff + D``
    (the cache applies ``B`` and ``m`` after the op). A dense key part with ``rope``
    (``ops.rope.Tables``) is rotated to its positions as the op reads it. With ``project``
    (a part ``[B, H, r, Dp]`` holding ``B`` per head, dense or token rows) and ``mean``
    (``[B, H, 1, Dp]``), the op applies ``B`` and ``m`` itself: a key part projects query
    dims ``qoff:qoff + Dp`` and adds ``q . m``; a value part adds ``(p @ a) B + (sum p) m``
    to output dims ``ooff:ooff + Dp`` (no shift or mass then). A key part with both
    ``project`` and ``rope`` holds keys stored before RoPE: the op rebuilds ``a B + m`` a
    few tokens at a time and rotates them (:func:`rebuildable` says which forms).
    The kernel only: no MLX path reads it."""

    part: Any
    qoff: int = 0
    ooff: int = 0
    shift: mx.array | None = None
    mass: bool = False
    rope: Any = None
    project: Any = None
    mean: mx.array | None = None

    @property
    def n(self) -> int:
        return self.part.n

    @property
    def heads(self) -> int:
        return self.part.heads

    def stored(self) -> Any:
        return self.part.stored()


def _load() -> tuple[Any, str]:
    """The extension and why it is not usable (empty when it is)."""
    try:  # built by setup.py: into the wheel, or in place by pip install -e
        from veloxquant_mlx.ops import _native as ext  # type: ignore[attr-defined]
    except ImportError:
        return None, "not built (no C++ compiler or CMake at install, or the build " \
                     "failed; pip install -v shows why): install them, then reinstall " \
                     "from source (pip install -e . in a checkout)"
    ours, theirs = described_by(None), described_by(ext)
    differ = [name for name in ours if theirs[name] != ours[name]]
    if differ:
        return None, f"built from other sources (its {', '.join(differ)} differ from " \
                     "ops/native.py's): reinstall from source to rebuild it (pip install " \
                     "-e . in a checkout)"
    # An MLX built with another nanobind ABI would refuse mx.array arguments.
    try:
        one = mx.ones((1, 1, 1, 4))
        codes = mx.zeros((1, 1, 1, 1), dtype=mx.uint32)
        token = PartSpec(Form(PartKind.token, 8, 4, biases=True))
        mx.eval(ext.decode_attention(one, [codes, one[..., :1], one[..., :1], one],
                                     [token, PartSpec(Form(PartKind.dense))], [1, 1], 1))
    except (TypeError, ValueError, RuntimeError) as e:
        return None, f"built for another MLX ({e.__class__.__name__}): reinstall from " \
                     "source to rebuild it (pip install -e . in a checkout)"
    return ext, ""


_native, _why = _load()


def available() -> bool:
    """Whether the extension is built and not switched off (``VELOXQUANT_NATIVE=0``)."""
    return _native is not None and os.environ.get(ENV, "1") != "0"


def status() -> str:
    """One line for reports: whether decode attention runs fused, and why not."""
    if _native is None:
        return f"MLX ops (the fused CPU kernel is {_why})"
    if not available():
        return f"MLX ops ({ENV}=0)"
    return "fused CPU kernel (csrc/)"


def _form(part: Any) -> tuple[Form, list[mx.array]] | None:
    """A part's stored form as the op reads it and its arrays; None where the op reads no
    such form."""
    stored = getattr(part, "stored", None)
    form = stored() if stored is not None else None
    if form is None:
        return None
    kind, bits, group, arrs, biases, table = form
    return (Form(PartKind[kind], int(bits), int(group), biases is not None, table is not None),
            [*arrs, *([biases] if biases is not None else []),
             *([table] if table is not None else [])])


def _described(parts: Sequence[Any]) -> tuple[list[PartSpec], list[mx.array]] | None:
    specs: list[PartSpec] = []
    arrays: list[mx.array] = []
    for p in parts:
        form = _form(p)
        project = getattr(p, "project", None)
        projection = _form(project) if project is not None else (None, [])
        if form is None or projection is None:
            return None
        (own, arrs), (proj, proj_arrs) = form, projection
        shift, rope = getattr(p, "shift", None), getattr(p, "rope", None)
        # The frequencies give the rotated dims; `pairs` says how they pair.
        specs.append(PartSpec(own, int(getattr(p, "qoff", 0)), int(getattr(p, "ooff", 0)),
                              shift is not None, bool(getattr(p, "mass", False)),
                              rope is not None, rope is not None and bool(rope.traditional),
                              proj))
        arrays += [*arrs, *([shift] if shift is not None else []),
                   *([rope.inv, rope.start] if rope is not None else []),
                   *([*proj_arrs, p.mean] if project is not None else [])]
    return specs, arrays


def rebuildable(*parts: Any) -> bool:
    """Whether the op rebuilds keys from these parts (a token factor and its projection):
    dense, or token codes without a table in groups of a multiple of 16 dims (the op
    decodes a row 16 values at a time)."""
    forms = [_form(p) for p in parts]
    return all(f is not None and (f[0].kind == PartKind.dense or
                                  (not f[0].table and f[0].group % 16 == 0))
               for f in forms)


def usable(dtype: mx.Dtype) -> bool:
    """Whether the kernel can run for queries of ``dtype`` here: built, on, a CPU,
    float32."""
    return available() and dtype == mx.float32 and not on_gpu()


# Rows decoded or normalized on two threads from this many values (a layer's token
# factor at 4096 tokens is 1.5M; a member factor, 74K, takes one).
THREADED_VALUES = 1 << 18


def _threads(values: int) -> int:
    return THREADS if values >= THREADED_VALUES else 1


def floats_of(x: Any, plus: mx.array | None = None) -> mx.array | None:
    """Float32 ``codes * scales + biases`` of token-coded rows (``ops.quantize.Quantized``
    along the last axis) in one op, plus ``plus`` (float32, their shape) if given;
    ``None`` where it does not run (then MLX's ops). On the CPU MLX's path is several ops
    of a few microseconds each and a pass apiece: this is one pass, the codes spread into
    lanes a block at a time."""
    if not usable(mx.float32) or x.bits not in q.BYTE_BITS or x.group_size % 16:
        return None
    width = x.codes.shape[-1] * x.codes.itemsize * 8 // x.bits
    if plus is not None and (plus.dtype != mx.float32 or
                             tuple(plus.shape) != (*x.codes.shape[:-1], width)):
        return None
    return _native.floats_of(x.codes, x.scales, x.biases, x.bits, x.group_size,
                             _threads(x.codes.size * 32 // x.bits), plus)


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array | None:
    """``mx.fast.rms_norm`` of float32 rows in one op (on the CPU MLX runs it as several,
    its sum the slowest: 4 against 1.7 ms over 4096 rows of 576); ``None`` where it does
    not run."""
    if not usable(x.dtype) or weight.ndim != 1 or weight.shape[0] != x.shape[-1]:
        return None
    return _native.rms_rows(x, weight, eps, _threads(x.size))


def _plan(keys: Sequence[Any], values: Sequence[Any]
          ) -> tuple[list[PartSpec], list[mx.array], list[int]] | None:
    """Part descriptions, arrays and part counts of one sequence's parts; None where the kernel reads
    a part's form no more."""
    k, v = _described(keys), _described(values)
    if k is None or v is None:
        return None
    return k[0] + v[0], k[1] + v[1], [len(keys), len(values)]


def _run(q: mx.array, plans: list[tuple[list[PartSpec], list[mx.array], list[int]]],
         n_keys: int, causal: int = 0) -> mx.array:
    specs = [s for p in plans for s in p[0]]
    arrays = [a for p in plans for a in p[1]]
    counts = [c for p in plans for c in p[2]]
    # A decode step's few rows per head count as one; a chunk's rows each score every key.
    work = n_keys * (q.shape[2] if causal else 1)
    long = q.shape[0] * q.shape[1] > 1 and work >= THREADED_KEYS
    return _native.decode_attention(q, arrays, specs, counts, THREADS if long else 1, causal)


def decode(q: mx.array, keys: Sequence[Any], values: Sequence[Any], causal: int = 0
           ) -> mx.array | None:
    """Softmax attention of scaled queries ``q`` ``[B, H, rows, D]`` (float32) over the
    key and value parts, normalized, ``[B, H, rows, Dv]``; ``None`` where the extension
    is off or a part's stored form is not one it reads (then MLX's ops run).
    ``causal`` > 0: the rows are (query head, token) of a chunk of that many tokens, the
    last keys, each seeing the keys up to its own."""
    plan = _plan(keys, values) if usable(q.dtype) else None
    # Over dense parts only, MLX's matmuls (BLAS) are faster.
    if plan is None or all(s.form.kind == PartKind.dense for s in plan[0]):
        return None
    return _run(q, [plan], sum(p.n for p in keys), causal)


def decode_rows(q: mx.array, rows: Sequence[tuple[Sequence[Any], Sequence[Any]]]
                ) -> mx.array | None:
    """:func:`decode` where each batch row of ``q`` attends its own key and value parts
    (each of batch 1): one op for a batch of conversations. ``None`` unless the kernel
    reads every row's parts (a row still all in its float window included: one op for
    the batch beats that row on MLX's ops beside it)."""
    if not usable(q.dtype):
        return None
    plans = []
    for keys, values in rows:
        plan = _plan(keys, values)
        if plan is None:
            return None
        plans.append(plan)
    return _run(q, plans, sum(p.n for keys, _ in rows for p in keys))


def chunk_mask(mask: Any, n_queries: int) -> int | None:
    """mlx_lm's ``mask`` for a chunk of ``n_queries`` as :func:`decode`'s ``causal``;
    None for a mask the kernel does not apply (arrays: padded batches)."""
    if mask is None:
        return 0
    if isinstance(mask, str) and mask == "causal":
        return 0 if n_queries == 1 else n_queries
    return None


def causal_for(queries: mx.array, mask: Any, heads: int, n_keys: int) -> int | None:
    """:func:`decode`'s ``causal`` for ``queries`` ``[B, Hq, L, D]`` over ``n_keys`` keys
    of ``heads`` KV heads; None where the op does not take them (off, a GPU, float16,
    mask arrays, a prompt chunk past ``CHUNK_ROWS`` or ``CHUNK_SCORES``)."""
    B, Hq, L, D = queries.shape
    causal = chunk_mask(mask, L)
    if not usable(queries.dtype) or causal is None:
        return None
    n_rows = Hq // heads * L
    if L > 1 and (n_rows > CHUNK_ROWS or n_rows * n_keys > CHUNK_SCORES):
        return None
    return causal


def attend_rows(queries: mx.array, scale: float,
                rows: Sequence[tuple[Sequence[Any], Sequence[Any]]], mask: Any = None
                ) -> mx.array | None:
    """Attention of ``queries`` ``[B, Hq, L, D]``, each batch row over its own key and
    value parts, ``[B, Hq, L, Dv]``: one op (:func:`decode_rows`; one row: :func:`decode`,
    which also takes a prompt chunk within ``CHUNK_ROWS`` and ``CHUNK_SCORES``, causal or
    not).
    None where the kernel does not run."""
    B, Hq, L, D = queries.shape
    H = rows[0][0][0].heads
    causal = causal_for(queries, mask, H, sum(p.n for p in rows[0][0]))
    if causal is None or (causal and len(rows) > 1):
        return None
    q = (queries * scale).reshape(B, H, Hq // H * L, D)
    out = decode(q, *rows[0], causal) if len(rows) == 1 else decode_rows(q, rows)
    return None if out is None else out.reshape(B, Hq, L, -1)
