"""Random orthogonal rotations of head vectors (randomized Hadamard transform).

Rotating every key, value and query of a head by the same orthogonal ``R`` keeps
attention exact (``(q R)(k R)^T = q k^T``; outputs computed over rotated values are
rotated back once with ``R^T``) while spreading outlier channels over all coordinates,
so that each coordinate of a rotated vector is close to Gaussian with variance
``|x|^2 / d`` whatever the input: a fixed scalar quantizer fits every vector.

``R = diag(s) H / sqrt(d)`` (random signs ``s`` then a Walsh-Hadamard matrix) when ``d``
is a power of two, a random orthogonal matrix (QR of a Gaussian) otherwise; seeded, so
the same rotation is rebuilt for a saved cache.
"""

from __future__ import annotations

import weakref
from functools import lru_cache

import mlx.core as mx
import numpy as np


def hadamard(n: int) -> np.ndarray:
    """The ``n x n`` Walsh-Hadamard matrix (Sylvester), entries +-1; ``n`` a power of 2."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard: n={n} is not a power of two")
    h = np.ones((1, 1), dtype=np.float64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


@lru_cache(maxsize=32)
def _rotation_np(d: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if d & (d - 1) == 0:
        signs = rng.choice([-1.0, 1.0], size=d)
        return signs[:, None] * hadamard(d) / np.sqrt(d)
    q, r = np.linalg.qr(rng.standard_normal((d, d)))
    return q * np.sign(np.diag(r))[None, :]  # the sign fix makes it Haar-distributed


def random_rotation(d: int, seed: int = 0) -> mx.array:
    """A seeded ``[d, d]`` float32 orthogonal matrix (rotate with ``x @ R``)."""
    if d < 1:
        raise ValueError(f"random_rotation: d={d} must be >= 1")
    return mx.array(_rotation_np(d, seed).astype(np.float32))


_LIVE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def shared_rotation(d: int, seed: int = 0) -> mx.array:
    """The ``[d, d]`` rotation for ``(d, seed)``, one array for every cache that holds it
    at once; it is freed with the last of them (nothing outlives the caches)."""
    rot = _LIVE.get((d, seed))
    if rot is None:
        rot = random_rotation(d, seed)
        mx.eval(rot)
        _LIVE[(d, seed)] = rot
    return rot
