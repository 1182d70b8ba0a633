"""What a method's stored keys and values look like to attention (its declaration).

Each method declares, with a classmethod ``stored_numerics(config, layer)``, the numerics
of what it stores, so that a *same-numerics reference* can be built outside it
(``veloxquant_mlx.testing.reference``): mlx_lm's own cache, fed the same keys and values,
holding what the method's own round trip (quantize then dequantize, a cast) gives for
each token, evicting what the method evicts. Differences between the method and that
reference are then routing, layout or bookkeeping errors, not the method's intended
loss.

A stream (keys or values) of a layer is a sequence of tokens in three parts: the first
``sink`` tokens (never coded), the *committed* tokens (coded: attention reads
``roundtrip(x)`` for them) and the *residual* (the most recent tokens, held as
received). Tokens move from the residual to the committed part in blocks, at a point of
the step the method chooses (``commit``). This models per-token codes (affine, values of
KIVI, TurboQuant) and per-channel blocks over tokens (KIVI's keys) exactly.

A method whose numerics depend on more than its own tokens (cross-layer SVDs and
merges, X-rematerialization, score-based eviction) declares ``exact=False``: its
reference is dense (nothing coded, nothing evicted) and ``bound`` is its stated loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from veloxquant_mlx.ops import quantize as q

RoundTrip = Callable[[mx.array], mx.array]

# Relative logit error (max |diff| / max |logit|) that float32 reordering alone gives on
# the tiny test models: attention over codes sums in another order than over dense K/V.
FLOAT_ROUNDING = 1e-4
# What holding tokens in the float16 window dtype gives against a dense float32
# reference that does not emulate it (measured: up to 6e-4 on the tiny llama).
WINDOW_ROUNDING = 1e-3


@dataclass(frozen=True)
class Stream:
    """How one stream (keys or values) of a layer is held, token by token.

    roundtrip: what attention reads for a block of committed tokens ``[B, H, n, D]``
    (``None``: the tokens as received). keep: residual tokens never committed (the most
    recent ones). block: tokens are committed in multiples of ``block``. commit:
    ``"append"`` (a chunk's tokens leave the residual as soon as it is stored, before
    the chunk attends), ``"next"`` (at the start of the next update: a chunk attends
    over itself as received) or ``"next_chunk"`` (``"next"`` after a chunk of several
    tokens, ``"append"`` after a single one). hold: what attention reads for a sink or
    residual token (a cast to the window dtype; ``None``: as received); committed
    tokens are round-tripped from it. sink: the first tokens, never
    committed. trim_group: trimming into the committed part drops whole groups of this
    many tokens; the kept tokens of a cut group return to the residual as they were read.
    fresh_from_input: tokens committed by the chunk that brought them, into an empty
    residual, are coded from the input rather than from their held copy.
    """

    roundtrip: RoundTrip | None = None
    keep: int = 0
    block: int = 1
    commit: str = "append"
    hold: RoundTrip | None = None
    sink: int = 0
    trim_group: int = 1
    fresh_from_input: bool = False

    def to_commit(self, n_residual: int) -> int:
        """How many of ``n_residual`` residual tokens leave it now."""
        n = n_residual - self.keep
        return max(0, n - n % self.block)


@dataclass(frozen=True)
class StoredNumerics:
    """A layer's stored numerics; see the module docstring.

    evict: ``(sink, window)``: the layer attends over its first ``sink`` tokens and the
    ``window`` most recent positions up to each query (StreamingLLM), ``None``: nothing
    is evicted. exact: the reference reproduces everything the method does, and
    ``bound`` is float rounding; otherwise the reference is dense and ``bound`` the
    method's stated loss on the tiny test models, measured (see each declaration).
    lossless_until: a method with a dense reference keeps every token (in the window
    dtype) while it has held at most this many: until then ``WINDOW_ROUNDING`` applies.
    """

    keys: Stream = field(default_factory=Stream)
    values: Stream = field(default_factory=Stream)
    evict: tuple[int, int] | None = None
    exact: bool = True
    bound: float = FLOAT_ROUNDING
    lossless_until: int | None = None

    def bound_after(self, most_tokens: int) -> float:
        """The bound once the layer has held at most ``most_tokens`` tokens at a time."""
        if not self.exact and self.lossless_until is not None and \
                most_tokens <= self.lossless_until:
            return WINDOW_ROUNDING
        return self.bound


def code_flips(bits: float, gain: float) -> float:
    """Bound for a method that holds ``bits``-bit codes, emulated exactly: the model's
    K/V differ from the reference's by float rounding (attention sums in another
    order), which moves a value lying at a code boundary (or a float16 scale) by one
    step, ``2^-bits`` of its range; the tiny models carry a step into the logits by up
    to ``gain`` times that (measured per method, see its declaration)."""
    return gain * 2.0 ** -bits


def affine_roundtrip(bits: int, group_size: int) -> RoundTrip:
    """Per-token affine codes along the head dim (float16 scales), as ``ops.quantize``."""
    return lambda x: q.dequantize(q.quantize(x.astype(mx.float32), bits, group_size))


def channel_roundtrip(bits: int, group_size: int) -> RoundTrip:
    """Per-channel affine codes over groups of ``group_size`` tokens (KIVI's keys)."""
    return lambda x: q.dequantize_tokens(q.quantize_tokens(x.astype(mx.float32), bits,
                                                           group_size))


def cast(dtype_name: str | None) -> RoundTrip | None:
    """Storage in the window dtype ``dtype_name`` (``None``: as received)."""
    if dtype_name is None:
        return None
    dtype = getattr(mx, dtype_name)
    return lambda x: x.astype(dtype).astype(x.dtype)


def dense_loss(bound: float, lossless_until: int | None = None) -> StoredNumerics:
    """A method whose reference is dense: ``bound`` is its loss (see ``StoredNumerics``)."""
    return StoredNumerics(exact=False, bound=bound, lossless_until=lossless_until)
