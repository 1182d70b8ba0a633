"""RoPE by angle addition (long runs on the CPU) equals MLX's own within the rounding of
a float32 angle, and ``unrotate`` undoes the model's own rotation."""

import mlx.core as mx
import pytest

from veloxquant_mlx.ops import rope

CASES = [  # length, offset, rotated dims, scale, base
    (1020, 4, 64, 1.0, 100000.0),
    (600, 7000, 64, 0.25, 10000.0),  # far positions: angles of thousands of radians
    (70, 3, 32, 1.0, 10000.0),  # partial rotary: the last 32 dims pass through
    (7, 8000, 64, 1.0, 1e6),  # a short run: mx.fast.rope itself
]


@pytest.mark.parametrize("traditional", [True, False])
@pytest.mark.parametrize("length,offset,dims,scale,base", CASES)
def test_rotate_equals_mlx_fast_rope(length: int, offset: int, dims: int, scale: float,
                                     base: float, traditional: bool) -> None:
    x = mx.random.normal((1, 3, length, 64), key=mx.random.key(length)) * 5
    want = mx.fast.rope(x, dims, traditional=traditional, base=base, scale=scale,
                        offset=offset)
    got = rope.rotate(x, dims, base, traditional, scale, offset)
    assert got.shape == x.shape and got.dtype == x.dtype
    # A float32 angle near position p is good to about 6e-8 p radians.
    bound = 1e-5 + 6e-8 * (offset + length) * mx.abs(x).max().item()
    assert mx.abs(got - want).max().item() < bound
    back = rope.unrotate(want, dims, base, traditional, scale, offset)
    assert mx.abs(back - x).max().item() < 2e-5  # the model's rotation undone exactly
    if dims < 64:
        assert mx.array_equal(got[..., dims:], x[..., dims:])


def test_angles_by_addition_are_the_angles() -> None:
    """cos/sin of every position from the coarse and fine tables, against numpy's
    float64 cos/sin of the exact angles, at far positions and a length that is not a
    multiple of the fine step."""
    import numpy as np

    cos, sin = rope.angles(1000, 7000, 64, 10000.0, 0.5)
    inv = 10000.0 ** (-np.arange(32) / 32)
    theta = (np.arange(7000, 8000) * 0.5)[:, None] * inv[None, :]
    assert cos.shape == (1000, 32)
    assert np.abs(np.array(cos) - np.cos(theta)).max() < 1e-3
    assert np.abs(np.array(sin) - np.sin(theta)).max() < 1e-3
    near, _ = rope.angles(100, 0, 64, 10000.0, 1.0)
    t0 = np.arange(100)[:, None] * inv[None, :]
    assert np.abs(np.array(near) - np.cos(t0)).max() < 1e-5
