"""How an eviction cache stores the keys and values it keeps: dense, affine or codebook.

Eviction (SnapKV, StreamingLLM) decides *which* tokens stay; a store decides *how* they
are held, so the two stack: ``snapkv:capacity=512,store=codebook,k_bits=3,v_bits=3``.

- ``"dense"``: the window dtype (float16 by default), as the methods always did;
- ``"affine"``: MLX affine codes per token, in groups of ``group_size`` channels
  (the ``TokenCodes`` segment kind as a codec); attention multiplies them packed or
  reads them as floats in blocks, as ``ops.kernels`` chose;
- ``"codebook"``: TurboQuant's Lloyd-Max codes of rotated vectors with a float16 norm
  per vector (``ops.codebook``), 1-4 bits in halves. The codes assume rotated vectors,
  so the builder rotates a cache with this store (``cache.rotated``).

Every stored form is per token, so a block of tokens is a flat list of arrays with the
token on axis 2 (the keys' arrays, then the values'), and slicing, gathering and
writing a slot are exact on any of them: kept tokens are never coded twice.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from veloxquant_mlx.cache.restore_check import check_arrays
from veloxquant_mlx.cache.segments import CodebookCodes, TokenCodes
from veloxquant_mlx.ops import codebook as cb
from veloxquant_mlx.ops import quantize as q
from veloxquant_mlx.ops.buffers import TokenBuffer, owned

STORES = ("dense", "affine", "codebook")
CODEBOOK_BITS = (1, 1.5, 2, 2.5, 3, 3.5, 4)
Block = list[mx.array]


def check_store_options(opts: Any) -> None:
    """The ``store``, ``k_bits``, ``v_bits`` and ``group_size`` fields of an eviction
    method's options (``MethodOptions`` checks; bits only matter for a quantized store)."""
    opts.check_choice("store", STORES)
    opts.check_int("group_size", q.AFFINE_GROUP_SIZES)
    allowed = q.AFFINE_BITS if opts.store == "affine" else CODEBOOK_BITS
    for name in ("k_bits", "v_bits"):
        value = getattr(opts, name)
        if opts.store != "dense" and (isinstance(value, bool) or value not in allowed):
            raise opts.error(name, f"one of {list(allowed)} for store={opts.store!r}")


class StoreCapabilities:
    """What an eviction method with a ``store`` option declares (put it before
    ``CompressedCache`` in the bases)."""

    @classmethod
    def needs_rotation(cls, opts: Any) -> bool:
        """Codebook codes assume rotated vectors: the builder rotates such a cache."""
        return opts.store == "codebook"

    @classmethod
    def curve_tags(cls, opts: Any) -> list[str]:
        """A quantized store puts the method on another bytes-to-quality curve."""
        return [] if opts.store == "dense" else [f"store={opts.store}"]


def make_store(opts: Any, k_dim: int, v_dim: int, dtype: mx.Dtype, where: str
               ) -> TokenStore:
    """The options' store for a layer, or a ``ConfigError`` naming what does not fit."""
    for name, d in (("head_dim", k_dim), ("v_head_dim", v_dim)):
        if opts.store == "affine" and d % opts.group_size:
            raise opts.error("group_size", f"a divisor of {name}={d} of {where}")
        if opts.store == "codebook":
            try:
                for bits in (opts.k_bits, opts.v_bits):
                    cb.split_bits(bits, d)
            except ValueError as exc:
                raise opts.error("store", f"'affine' or 'dense' for {where}: {exc}") from None
            if d % 8:
                raise opts.error("store", f"'affine' or 'dense' for {where}: codebook codes "
                                 f"need {name}={d} to be a multiple of 8")
    return TokenStore(opts.store, opts.k_bits, opts.v_bits, opts.group_size, k_dim, v_dim,
                      dtype)


class TokenStore:
    """The stored form of keys (``k_dim`` wide) and values (``v_dim`` wide): the dense
    window dtype, or one per-token segment kind per side used as a codec
    (``cache.segments``: affine ``TokenCodes`` or ``CodebookCodes``)."""

    def __init__(self, kind: str, k_bits: float, v_bits: float, group_size: int,
                 k_dim: int, v_dim: int, dtype: mx.Dtype) -> None:
        self.kind, self.dtype, self.group_size = kind, dtype, group_size
        self.bits = (k_bits, v_bits)
        self.dims = (k_dim, v_dim)
        self.codecs = None if kind == "dense" else [
            _codec(kind, b, group_size, d) for b, d in zip(self.bits, self.dims)]
        if self.codecs is not None:
            self.codecs[1].side = "value"
        self.n_k = 1 if self.codecs is None else self.codecs[0].n_state  # keys' arrays

    @property
    def quantized(self) -> bool:
        return self.kind != "dense"

    def encode(self, keys: mx.array, values: mx.array) -> Block:
        """``[B, H, T, D]`` keys and values in the stored form."""
        if self.codecs is None:
            return [keys.astype(self.dtype), values.astype(self.dtype)]
        return [*self.codecs[0].encode(keys), *self.codecs[1].encode(values)]

    def adopt(self, block: Block | None) -> None:
        """Code as a loaded block is coded (saved in bit planes: go on in planes)."""
        if self.codecs is None or not tokens(block):
            return
        for codec, arrays in zip(self.codecs, self._split(block)):
            if isinstance(codec, CodebookCodes):
                codec.packing = cb.packing_of(arrays, codec.widths)

    def _split(self, block: Block) -> tuple[Block, Block]:
        return block[:self.n_k], block[self.n_k:]

    def parts(self, block: Block, dtype: mx.Dtype) -> tuple[Any, Any]:
        """Keys and values as ``split_attention`` takes them: arrays, or parts that
        attention multiplies without a dequantized copy of the block."""
        if self.codecs is None:
            return block[0], block[1]
        k, v = (c.slot_of(arrays).part() for c, arrays in zip(self.codecs, self._split(block)))
        return k, v

    def decode(self, block: Block, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        """A transient dense copy of the block's keys and values."""
        if self.codecs is None:
            return block[0].astype(dtype), block[1].astype(dtype)
        k, v = self.parts(block, dtype)
        return k.dense(0, k.n, dtype), v.dense(0, v.n, dtype)

    def check(self, block: Any, batch: int, heads: int, what: str) -> int:
        """A restored block's tokens; ``ValueError`` unless its arrays are what ``encode``
        stores for that many tokens (``cache.restore_check``: shapes only, not evaluated)."""
        n = _block_tokens(block, what)
        if n:
            zeros = [mx.zeros((batch, heads, n, d), mx.float32) for d in self.dims]
            check_arrays(what, block, self.encode(*zeros))
        return n

    def token_bytes(self) -> int:
        """Bytes of one token of one head (keys and values)."""
        if self.codecs is None:
            return sum(self.dims) * self.dtype.size
        return sum(c.token_bytes() for c in self.codecs)


def _codec(kind: str, bits: float, group_size: int, dim: int) -> CodebookCodes | TokenCodes:
    if kind == "affine":
        return TokenCodes(int(bits), group_size, dim, dtype=mx.float32)
    return CodebookCodes(bits, dim)  # bytes: bit planes decode 6x slower (loaded: kept)


# What a cache holds before it has any options (mlx_lm's ``from_state`` skips __init__);
# never written to: only a quantized store appends codes.
DENSE = TokenStore("dense", 16, 16, 32, 1, 1, mx.float16)
NO_CODES = TokenBuffer()


# ---- blocks: lists of arrays with the token on axis 2 ----
def _block_tokens(block: Any, what: str) -> int:
    if block is None:
        return 0
    # Codes in bit planes add an axis: [batch, heads, tokens, groups, bits].
    if not isinstance(block, (list, tuple)) or not block or \
            not isinstance(block[0], mx.array) or block[0].ndim < 4:
        raise ValueError(f"{what}: expected a list of [batch, heads, tokens, ...] arrays")
    return block[0].shape[2]


def check_dense(block: Any, batch: int, heads: int, dims: tuple[int, int], what: str
                ) -> int:
    """A restored full-precision ``[keys, values]`` block's tokens; ``ValueError`` unless
    both are ``[batch, heads, tokens, dim]`` floats of the layer's widths."""
    n = _block_tokens(block, what)
    if n:
        check_arrays(what, block, [mx.zeros((batch, heads, n, d), mx.float16) for d in dims])
    return n


def tokens(block: Block | None) -> int:
    return 0 if not block else block[0].shape[2]


def cat(*blocks: Block | None) -> Block | None:
    """The blocks one after the other (``None`` and empty ones skipped)."""
    live = [b for b in blocks if tokens(b)]
    if len(live) < 2:
        return live[0] if live else None
    return [mx.concatenate(arrays, axis=2) for arrays in zip(*live)]


def take(block: Block | None, start: int, stop: int | None = None) -> Block | None:
    """Tokens ``start:stop``, copied (a kept slice would pin the whole block)."""
    if not tokens(block):
        return None
    stop = tokens(block) if stop is None else stop
    if stop <= start:
        return None
    return [owned(a[:, :, start:stop]) for a in block]


def gather(block: Block, idx: mx.array) -> Block:
    """Per head, the tokens ``idx`` ``[B, H, n]`` (each head its own tokens)."""
    out = []
    for a in block:
        i = idx.reshape(*idx.shape, *([1] * (a.ndim - 3)))
        out.append(mx.take_along_axis(a, i, axis=2))
    return out


def write(block: Block, slot: int, new: Block) -> None:
    """Overwrite token ``slot`` of ``block`` in place with the one token of ``new``."""
    for a, x in zip(block, new):
        a[:, :, slot:slot + 1] = x


def reorder(block: Block | None, first: int) -> Block | None:
    """A ring unrolled: tokens ``first..end`` then ``0..first`` (time order)."""
    if not first or not tokens(block):
        return block
    return [mx.concatenate([a[:, :, first:], a[:, :, :first]], axis=2) for a in block]
