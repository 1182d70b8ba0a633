"""CPU streams that let a batch's decode attention use more than one core.

MLX runs each operation of the CPU backend on one thread (the stream's); only its
matmuls spread over cores, through BLAS. A batch's decode attention over compressed
rows is mostly elementwise work (codes decoded to floats, softmax), so on a CPU it ran
on one core while the others waited. MLX gives every stream its own thread and runs
operations of different streams at the same time, so :func:`spread` gives each group of
rows its own CPU stream; MLX orders the streams where one reads what another wrote.

Measured on 2 cores (a decode step of SmolLM2-135M over 8 rows of 3000 tokens,
``eval.batchstep``, against mlx_lm's dense batch step): TurboQuant 0.70-0.77 -> 0.80-0.87,
KIVI 4-bit 0.82-0.83 -> 0.88-0.96; at 8 rows of 700 tokens, where the fixed cost of each
operation dominates, little (docs/cpu-performance.md). Splitting a single sequence's
tokens (or its keys and values) across streams gained nothing measurable at 4096
tokens: the work per operation is too small there.

On a GPU the device already runs every kernel across its cores: one stream.
``VELOXQUANT_CPU_STREAMS=<n>`` sets the number of CPU streams (``1``: no split); the
default is the number of cores, at most ``MAX_STREAMS``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx

from veloxquant_mlx.ops.kernels import on_gpu

ENV = "VELOXQUANT_CPU_STREAMS"
MAX_STREAMS = 4  # measured on 2 cores only (4 streams there: 0.69-0.90x the speed of 2)
_STREAMS: list[mx.Stream] = []  # created once: each new stream starts a thread


def stream_count() -> int:
    """How many streams a batch's decode attention is spread over here."""
    raw = os.environ.get(ENV, "")
    n = max(1, min(_cores(), MAX_STREAMS))
    if raw:
        try:
            n = int(raw)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"{ENV}={raw!r}: a whole number of CPU streams >= 1 "
                             "(1 runs a batch's attention on one stream)")
    return 1 if on_gpu() else n


@functools.cache
def _cores() -> int:
    return os.cpu_count() or 1  # a system call each time: about 30 us


def _streams(n: int) -> list[mx.Stream]:
    """The default CPU stream and ``n - 1`` more (kept for the process)."""
    while len(_STREAMS) < n - 1:
        _STREAMS.append(mx.new_stream(mx.cpu))
    return [mx.default_stream(mx.cpu), *_STREAMS[:n - 1]]


def groups(rows: int, n: int) -> list[tuple[int, int]]:
    """``rows`` cut into ``min(n, rows)`` consecutive ranges of near-equal size."""
    n = max(1, min(n, rows))
    cuts = [round(rows * i / n) for i in range(n + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def spread(rows: int) -> list[tuple[int, int, mx.Stream]]:
    """Row ranges ``(start, stop)`` covering ``rows``, each with the CPU stream to build
    its work on (:func:`on`)."""
    ranges = groups(rows, stream_count())
    return [(a, b, s) for (a, b), s in zip(ranges, _streams(len(ranges)))]


@contextmanager
def on(stream: mx.Stream) -> Iterator[None]:
    """Operations built inside run on ``stream`` (the default stream: as they are)."""
    if stream == mx.default_stream(mx.cpu):
        yield
    else:
        with mx.stream(stream):
            yield
