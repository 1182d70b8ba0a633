"""Which engine runs a layer's attention, decided in one place.

A cache describes what attention reads (its parts, dense arrays or factors), the
queries and the mask; :func:`route` sums them up as a :class:`Situation`, looks it up in
``TABLE`` (the first matching row wins) and names the engine; the caller runs it. The
fused CPU extension (``ops.native``) is reached only through :func:`fused_decode` and
:func:`fused_rows`. ``veloxquant bench --kernels`` prints the table and
docs/cpu-performance.md shows it (a test keeps the two equal).

Forcing an engine: ``VELOXQUANT_NATIVE=0`` turns the extension off and
``VELOXQUANT_KERNELS=packed|floats`` makes the ``parts`` engine read every code one way
(``FORCING`` and :func:`forcing` set both for a named engine). Seeing the choice: the
logger ``veloxquant_mlx.dispatch`` at DEBUG (or ``VELOXQUANT_DISPATCH_LOG=1``) names the
engine and the situation of each call.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import mlx.core as mx

from veloxquant_mlx.ops import kernels, native
from veloxquant_mlx.ops.kernels import on_gpu

FUSED, PARTS, SDPA, PADDED, ROWS, FACTOR = "fused", "parts", "sdpa", "padded", "rows", "factor"
ENGINES: dict[str, str] = {
    FUSED: "the fused CPU extension (ops.native): one op per layer, codes read as codes",
    PARTS: "MLX ops over the parts (ops.attention): each kind of codes packed "
           "(mx.quantized_matmul) or read as float blocks, per shape class (ops.kernels)",
    SDPA: "mx.fast.scaled_dot_product_attention over dense arrays",
    PADDED: "the batch rows' parts padded side by side (ops.batch_parts), then parts",
    ROWS: "each batch row on its own, through this table again",
    FACTOR: "the cache's own MLX ops in factor space (low-rank keys and values)",
}
# A decode over at most this many dense keys stays on mx.fast's kernel on the CPU, faster
# there; the library's kernels win from 1.5k keys and on prompt chunks
# (``eval.dense_attention``).
FAST_DECODE_KEYS = 1024
# Each engine as the environment that forces it (the extension off for the others).
FORCING: dict[str, dict[str, str]] = {
    FUSED: {native.ENV: "1", kernels.ENV: "floats"},
    "packed": {native.ENV: "0", kernels.ENV: "packed"},
    "floats": {native.ENV: "0", kernels.ENV: "floats"},
}
LOG_ENV = "VELOXQUANT_DISPATCH_LOG"
log = logging.getLogger("veloxquant_mlx.dispatch")


class Situation(NamedTuple):
    """What the table reads of one attention call (a tuple: built and hashed per layer
    call, so it stays cheap)."""

    backend: str  # "cpu" | "gpu"
    dtype: str  # the queries': "float32" | "other"
    extension: str  # the fused op: "on" | "off" (not built, or VELOXQUANT_NATIVE=0)
    mask: str  # "unmasked" (a single query's causal mask too) | "causal" | "array"
    queries: str  # "step" (one query) | "chunk" (within the op's rows and scores) | "long"
    rows: str  # "one" sequence | "batch" of sequences, each over its own parts
    parts: str  # "arrays" | "dense" | "read" (the op reads each) | "unread" | "factors"
    store: str  # "short" (at most FAST_DECODE_KEYS keys) | "long"


@dataclass(frozen=True)
class Rule:
    """One row of the table: the engine where every named field takes a listed value."""

    engine: str
    when: tuple[tuple[str, tuple[str, ...]], ...]
    why: str

    def matches(self, s: Situation) -> bool:
        return all(getattr(s, name) in allowed for name, allowed in self.when)


def _rule(engine: str, why: str, **when: str | tuple[str, ...]) -> Rule:
    return Rule(engine, tuple((k, (v,) if isinstance(v, str) else v) for k, v in when.items()),
                why)


_FUSED_RUNS = {"backend": "cpu", "dtype": "float32", "extension": "on"}
TABLE: tuple[Rule, ...] = (
    _rule(FUSED, "one op, no float copy of a store", **_FUSED_RUNS, rows="one",
          parts=("read", "factors"), mask=("unmasked", "causal"), queries=("step", "chunk")),
    _rule(FUSED, "one op for the batch, no padded copy", **_FUSED_RUNS, rows="batch",
          parts=("read", "dense", "arrays"), mask="unmasked", queries="step"),
    _rule(FACTOR, "low-rank parts the op does not take", parts="factors"),
    _rule(PADDED, "one call for the batch", rows="batch", parts=("read", "unread", "dense"),
          queries="step"),
    _rule(ROWS, "padding rows of arrays would copy every row's cache", rows="batch"),
    _rule(SDPA, "MLX's kernel on a GPU", parts="arrays", backend="gpu"),
    _rule(SDPA, "MLX's kernel for bfloat16 and float16", parts="arrays", dtype="other"),
    _rule(SDPA, "mx.fast is faster on a short store", parts="arrays", queries="step",
          store="short"),
    _rule(PARTS, "the rest: bounded blocks, BLAS, the compiled exponent"),
)


@functools.lru_cache(maxsize=512)
def decide(s: Situation) -> str:
    """The engine of the first row of ``TABLE`` that ``s`` matches."""
    return next(r.engine for r in TABLE if r.matches(s))


def part_kind(keys: Sequence[Any], values: Sequence[Any]) -> str:
    """``"dense"`` (every part an array), ``"read"`` (the fused op reads each part's
    stored form) or ``"unread"``."""
    forms = [p.stored() for p in (*keys, *values)]
    if any(f is None for f in forms):
        return "unread"
    return "dense" if all(f[0] == "dense" for f in forms) else "read"


def _mask(mask: Any, n_queries: int) -> str:
    if mask is None or (isinstance(mask, str) and n_queries == 1):
        return "unmasked"
    return "causal" if isinstance(mask, str) else "array"


def _queries(n_queries: int, rows: int, n_keys: int) -> str:
    if n_queries == 1:
        return "step"
    fits = rows <= native.CHUNK_ROWS and rows * n_keys <= native.CHUNK_SCORES
    return "chunk" if fits else "long"


def situation(queries: mx.array, parts: str, mask: Any, heads: int, n_keys: int,
              rows: int = 1, gpu: bool | None = None) -> Situation:
    """The situation of ``queries`` ``[B, Hq, L, D]`` over ``n_keys`` keys of ``heads``
    KV heads (per batch row where ``rows`` > 1); ``gpu``: the caller's backend check."""
    _, Hq, L, _ = queries.shape
    return Situation(
        backend="gpu" if (on_gpu() if gpu is None else gpu) else "cpu",
        dtype="float32" if queries.dtype == mx.float32 else "other",
        extension="on" if native.available() else "off", mask=_mask(mask, L),
        queries=_queries(L, Hq // heads * L, n_keys), rows="batch" if rows > 1 else "one",
        parts=parts, store="short" if n_keys <= FAST_DECODE_KEYS else "long")


def route(queries: mx.array, parts: str, mask: Any, heads: int, n_keys: int,
          rows: int = 1, label: str = "", gpu: bool | None = None) -> str:
    """The engine for this call (:func:`situation`, :func:`decide`), logged at DEBUG
    under ``label`` (the caller's name for its layer)."""
    s = situation(queries, parts, mask, heads, n_keys, rows, gpu)
    engine = decide(s)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s: %s (%s)", label or "attention", engine,
                  ", ".join(f"{k}={v}" for k, v in s._asdict().items()))
    return engine


# ---- the fused extension's only callers
def fused_causal(queries: mx.array, mask: Any, heads: int, n_keys: int,
                 label: str = "factors", declined: str | None = None) -> int | None:
    """The fused op's ``causal`` for ``queries`` ``[B, Hq, L, D]`` in factor space (low-rank
    caches) over ``n_keys`` keys of ``heads`` KV heads, where the table picks the op; None
    where it picks the cache's own factor-space ops, or where the cache ``declined`` the
    op (why, in words: the log names the factor engine and the reason)."""
    if declined is not None:
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s: %s (the cache declines the fused op: %s)", label, FACTOR, declined)
        return None
    if route(queries, "factors", mask, heads, n_keys, label=label) != FUSED:
        return None
    return native.causal_for(queries, mask, heads, n_keys)


def fused_decode(q: mx.array, keys: Sequence[Any], values: Sequence[Any], causal: int = 0
                 ) -> mx.array | None:
    """Softmax attention of scaled queries ``[B, H, rows, D]`` over key and value parts
    (``native.Placed`` included) in one fused op, ``[B, H, rows, Dv]``; None where it
    does not run."""
    return native.decode(q, keys, values, causal)


def fused_rows(queries: mx.array, scale: float,
               rows: Sequence[tuple[Sequence[Any], Sequence[Any]]], mask: Any = None
               ) -> mx.array | None:
    """Attention of unscaled ``queries`` ``[B, Hq, L, D]``, batch row ``i`` over its own
    ``(keys, values)`` parts, ``[B, Hq, L, Dv]``, in one fused op; None where it does not
    run."""
    return native.attend_rows(queries, scale, rows, mask)


# ---- forcing, logging, the printed table
@contextmanager
def forcing(engine: str) -> Iterator[None]:
    """Run the body with ``engine`` forced (``FORCING``: its environment set, then
    restored)."""
    saved = {k: os.environ.get(k) for k in FORCING[engine]}
    os.environ.update(FORCING[engine])
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _log_from_env() -> None:
    """``VELOXQUANT_DISPATCH_LOG=1``: the decisions at DEBUG on standard error."""
    if os.environ.get(LOG_ENV, "0") not in ("", "0") and not log.handlers:
        log.addHandler(logging.StreamHandler())
        log.setLevel(logging.DEBUG)


_log_from_env()


def markdown() -> str:
    """``TABLE`` as Markdown: one row per rule, ``any`` where a field is not read."""
    names = list(Situation._fields)
    lines = ["| engine | " + " | ".join(names) + " | why |",
             "|---" * (len(names) + 2) + "|"]
    for r in TABLE:
        when = dict(r.when)
        cells = [" or ".join(when[n]) if n in when else "any" for n in names]
        lines.append(f"| {r.engine} | " + " | ".join(cells) + f" | {r.why} |")
    return "\n".join(lines)


def engines_markdown() -> str:
    """What each engine is, as a Markdown list."""
    return "\n".join(f"- `{name}`: {what}" for name, what in ENGINES.items())
