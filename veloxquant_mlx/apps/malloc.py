"""Keep MLX's CPU transients out of fresh pages: glibc malloc thresholds for decode.

MLX's CPU backend allocates every array with ``malloc`` and keeps no buffer cache of its
own (``mx.get_cache_memory()`` stays at zero there). glibc serves a block larger than its
mmap threshold (128 KiB at start, raised up to 32 MiB as such blocks are freed) with a
fresh ``mmap`` and returns it to the kernel on ``free``, and trims the heap's free top
above its trim threshold: a decode step that decodes codes to floats in blocks of a few
MiB then pays page faults for every block of every layer at every step. Measured: one
TurboQuant layer's attention over 8 laid rows of 3000 tokens, 9,923 page faults and
27.7 ms per call with glibc's defaults, 72 faults and 11.0 ms with these thresholds.

The price is that up to ``TRIM_BYTES`` of freed memory stays mapped to the process (its
RSS), ready for the next step, as MLX's own buffer cache keeps freed buffers on a GPU.
What MLX counts as active memory does not change. ``VELOXQUANT_NO_MALLOC_TUNING=1``
leaves glibc's defaults.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

ENV_DISABLE = "VELOXQUANT_NO_MALLOC_TUNING"
MMAP_BYTES = 32 * 2**20  # glibc's largest mmap threshold on 64-bit
TRIM_BYTES = 128 * 2**20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # malloc.h
# The same settings for a child process (glibc reads them at start).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_BYTES),
              "MALLOC_TRIM_THRESHOLD_": str(TRIM_BYTES)}


def applies() -> bool:
    """Whether this process runs on glibc and the tuning is not turned off."""
    return (sys.platform == "linux" and platform.libc_ver()[0] == "glibc"
            and os.environ.get(ENV_DISABLE, "") in ("", "0"))


def tune_malloc() -> bool:
    """Set the thresholds for this process (see the module docstring); whether it did."""
    if not applies():
        return False
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_BYTES)
                    and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_BYTES))
    except (OSError, AttributeError):
        return False


def child_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the same thresholds for a child process (where they apply)."""
    return {**env, **MALLOC_ENV} if applies() else dict(env)
