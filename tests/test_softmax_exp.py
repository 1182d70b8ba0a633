"""The softmax exponent (``ops.attention.exp_nonpositive``): a compiled ``2^n * p(f)``
whose floor is a truncation corrected where it rounded up (``mx.floor`` is a scalar loop
on the CPU build)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.ops import attention


def _inputs() -> mx.array:
    spread = -mx.abs(mx.random.normal((1 << 16,), key=mx.random.key(0))) * 40
    # Every multiple of 1/512 down to -130 (ln 2 steps land on integers of t there) and
    # the edges: zeros, a tiny value, masked scores and a huge negative.
    grid = -mx.arange(0, 130, 1 / 512)
    edges = mx.array([0.0, -0.0, -1e-30, -mx.inf, -1e30, -np.log(2.0), -2 * np.log(2.0)])
    return mx.concatenate([spread, grid, edges])


def _relative_error(x: mx.array) -> float:
    """Largest relative error against ``mx.exp`` where the result is a normal float
    (below ``2^-125`` the exponent bits are clamped)."""
    got, want = attention.exp_nonpositive(x), mx.exp(x)
    normal = want > 2.0 ** -125
    return mx.where(normal, mx.abs(got - want) / mx.where(normal, want, 1.0), 0.0).max().item()


def test_the_exponent_matches_exp_within_its_stated_error() -> None:
    x = _inputs()
    assert _relative_error(x) <= 2e-7
    got = attention.exp_nonpositive(x)
    assert mx.abs(got - mx.exp(x)).max().item() <= 2e-7
    assert got[-4].item() == 0.0 and got[-3].item() == 0.0  # masked scores weigh nothing


def test_the_floor_is_exact_on_integers_and_halfway_points() -> None:
    t = mx.concatenate([-mx.arange(0, 128, 0.25), mx.array([-1e-7, -126.9999])])
    assert mx.array_equal(attention._floor(t), mx.floor(t)).item()


@pytest.mark.parametrize("broken", ["trunc", "ceil"])
def test_a_wrong_floor_is_caught(broken: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Truncation alone (toward zero) or a ceiling puts the fraction in (-1, 0], where
    # the polynomial of 2^f on [0, 1) is extrapolated: 3e-3 relative error and more.
    wrong = {"trunc": lambda t: t.astype(mx.int32).astype(mx.float32),
             "ceil": lambda t: -mx.floor(-t)}[broken]
    monkeypatch.setattr(attention, "_floor", wrong)
    # New functions to compile: MLX keeps the traces of the module's own by identity.
    monkeypatch.setattr(attention, "_exp2_kernels", tuple(
        mx.compile(lambda x, f=f: f(x), shapeless=True)
        for f in (attention._exp2_fraction, attention._exp2_exponent)))
    assert _relative_error(_inputs()) > 1e-4
