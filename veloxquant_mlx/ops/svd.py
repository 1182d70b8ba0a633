"""Truncated SVD numerics (float32, CPU).

MLX's ``mx.linalg.svd`` runs only on the CPU stream and always builds the full
square token factor, which is slow for tall matrices (measured: 0.63 s for
[2048, 768]). The eigendecomposition of the smaller Gram matrix gives the same
leading factors much faster (0.08 s for [2048, 768]); leading singular values are
accurate in float32 and only the truncated tail loses precision.

The eigendecomposition runs with OpenBLAS limited to one thread when OpenBLAS is
loaded (``LD_PRELOAD``): LAPACK's many synchronisation points make it collapse on
a shared machine (measured, 2 cores under load: ``eigh`` of [768, 768] 1.5-8 s with
the default threads, 0.08 s with one). Several matrices' eigendecompositions (xKV's keys
and values of a block) run side by side, each on its own CPU stream.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx


def _openblas() -> tuple | None:
    try:
        lib = ctypes.CDLL(None)
        return lib.openblas_get_num_threads, lib.openblas_set_num_threads
    except (AttributeError, OSError):
        return None


_OPENBLAS = _openblas()


@contextmanager
def single_thread_blas() -> Iterator[None]:
    """Run the enclosed (evaluated) MLX ops with OpenBLAS on one thread."""
    if _OPENBLAS is None:
        yield
        return
    get, set_ = _OPENBLAS
    before = get()
    set_(1)
    try:
        yield
    finally:
        set_(before)


_STREAMS: list[mx.Stream] = []  # CPU streams the eigendecompositions run on side by side


def _eighs(gs: list[mx.array]) -> list[tuple[mx.array, mx.array]]:
    """``eigh`` of each symmetric matrix, two at a time on their own CPU streams (MLX runs
    each stream on its own thread; LAPACK on one thread each): xKV's keys and values of
    a block took 82 ms one after the other, 43-52 ms side by side (a throwaway script)."""
    if not _STREAMS:
        _STREAMS.extend(mx.new_stream(mx.cpu) for _ in range(2))
    mx.eval(gs)  # the Gram products with BLAS's threads, before LAPACK runs on one
    with single_thread_blas():
        out = [mx.linalg.eigh(g, stream=_STREAMS[i % len(_STREAMS)]) for i, g in enumerate(gs)]
        mx.eval(out)
    return out


def rank_for_energy(s: mx.array, energy: float) -> int:
    """Smallest r whose squared singular values reach ``energy`` of their total.

    ``s`` is [..., n] in descending order; batched inputs take the largest r over
    the batch so that every sequence keeps at least ``energy``.
    """
    e = mx.cumsum(s.astype(mx.float32) ** 2, axis=-1)
    total = e[..., -1:]
    # Count the prefix sums still below the target; r is one past them.
    below = (e < energy * total * (1 - 1e-6)).astype(mx.int32).sum(axis=-1)
    r = int(mx.max(below).item()) + 1
    return max(1, min(r, s.shape[-1]))


def truncated_svd(x: mx.array, rank: int | None = None,
                  energy: float = 0.95) -> tuple[mx.array, mx.array, mx.array]:
    """Leading singular triplets of ``x`` [..., S, D]: ``(U [..., S, r], s [..., r],
    Vt [..., r, D])`` with ``x ~ U diag(s) Vt``.

    ``rank`` fixes r (must be <= min(S, D)); otherwise r comes from ``energy``.
    """
    return truncated_svds([x], [rank], energy)[0]


def truncated_svds(xs: list[mx.array], ranks: list[int | None], energy: float = 0.95
                   ) -> list[tuple[mx.array, mx.array, mx.array]]:
    """:func:`truncated_svd` of each matrix, their eigendecompositions side by side."""
    xs = [x.astype(mx.float32) for x in xs]
    grams = []
    for x, rank in zip(xs, ranks, strict=True):
        S, D = x.shape[-2], x.shape[-1]
        if rank is not None and not 1 <= rank <= min(S, D):
            raise ValueError(f"rank={rank} must be in [1, min(S={S}, D={D})]")
        grams.append(x.swapaxes(-1, -2) @ x if S > D else x @ x.swapaxes(-1, -2))
    return [_triple(x, w, v, rank, energy) for x, rank, (w, v) in zip(xs, ranks, _eighs(grams))]


def _triple(x: mx.array, w: mx.array, v: mx.array, rank: int | None, energy: float
            ) -> tuple[mx.array, mx.array, mx.array]:
    """The triple of ``x`` from its Gram matrix's eigenpairs (ascending eigenvalues): of
    ``x^T x`` for a tall ``x``, else of ``x x^T``."""
    s = mx.sqrt(mx.maximum(w[..., ::-1], 0.0))
    r = rank if rank is not None else rank_for_energy(s, energy)
    vr = v[..., :, ::-1][..., :, :r]
    s = s[..., :r]
    if x.shape[-2] > x.shape[-1]:
        u = (x @ vr) / mx.maximum(s, 1e-12)[..., None, :]
        return u, s, vr.swapaxes(-1, -2)
    vt = (vr.swapaxes(-1, -2) @ x) / mx.maximum(s, 1e-12)[..., :, None]
    return vr, s, vt
