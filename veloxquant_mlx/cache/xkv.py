"""Over 500 lines: one method file; XKVCache is one state, its coordinator is apart.

``xkv``: cross-layer SVD of the KV cache (xKV, Chang et al., arXiv 2503.18893).

Adjacent layers are grouped (``group_layers`` = G). Each member's keys (before RoPE
by default) and values are ``[b, S, D]`` matrices, D = n_kv_heads * head_dim. A
*basis* is one truncated SVD of the member concatenation ``[S, G*D]`` per stream
(after per-column mean removal), run by the model's shared ``XKVCoordinator``: a
token factor ``A`` [S, r] shared by the group and a factor ``B_i`` [r, D] per member,
``X_i ~ A @ B_i + mean_i``.

Which tokens get a basis (the paper fits one SVD to the whole prefill):

- the first ``sink`` tokens are never compressed (attention sinks, kept as received);
- prompt chunks (updates of ``STEP`` tokens or more) wait in the window; every complete
  ``block`` of them gets its own basis, and at the end of the prompt (the next update
  of fewer tokens) the rest gets one too when it is the first or at least half a block;
- every other token (the prompt's short rest, decode tokens) is projected onto the
  latest basis in steps of ``STEP`` (least squares over the whole group, solved once
  by the coordinator from per-member partials): it costs only its shared token factor.

Each cache holds its sinks, a full-precision window of tokens not yet compressed,
its member factors and means per basis, and (the group leader, member 0, only) the
shared token factors, one row per token, so each is counted once per model.

Timeline: mlx_lm calls layers 0..L-1 in order. When a unit (a basis block or a
projection step) is complete, every member publishes it in the same forward pass; it
stays in every member's window for that pass's attention and moves to factors right
after the group's last member has attended (or at the member's next update), so the
coordinator holds nothing between forward passes.

Attention: values in factor space (``out = (p A) B_i + (sum p) mean_i``); keys stored
after RoPE also (``scores = (q B_i^T) A^T + q mean_i``); keys stored before RoPE are
rebuilt into a transient per basis and rotated for their positions. The token
factors are decoded once per forward pass and group (the leader keeps the float32
transient until the group's last member has attended).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from veloxquant_mlx.cache.base import CompressedCache, LayerInfo, NotTrimmableError
from veloxquant_mlx.cache.numerics import WINDOW_ROUNDING, StoredNumerics, dense_loss
from veloxquant_mlx.cache.restore_check import FLOATS, flat_state, require_dtypes
from veloxquant_mlx.cache.xkv_coordinator import XKVCoordinator
from veloxquant_mlx.ops import factors as fr
from veloxquant_mlx.ops import native
from veloxquant_mlx.ops import quantize as q
from veloxquant_mlx.ops.attention import masked_softmax
from veloxquant_mlx.ops.buffers import Views, owned
from veloxquant_mlx.ops.parts import DensePart, shared_by_heads, token_codes
from veloxquant_mlx.ops.rope import rotate, unrotate
from veloxquant_mlx.ops.rope import tables as rope_tables
from veloxquant_mlx.options import MethodOptions, config_error
from veloxquant_mlx.register import register

if TYPE_CHECKING:
    from veloxquant_mlx.config import KVCacheConfig

FACTOR_DTYPE = mx.float16  # unquantized factors and means are stored in float16
STREAMS = ("keys", "values")
STEP = 32  # tokens per projection step; updates this long or longer are prompt chunks


def _member_group(d: int) -> int:
    """Quantization group of a member factor along its width D (64, else 32)."""
    return 64 if d % 64 == 0 else 32


def _store(x: mx.array, bits: int | None, group: int) -> Any:
    """Keep a member factor as float16, or quantized along its last axis."""
    if bits is None:
        return x.astype(FACTOR_DTYPE)
    return q.quantize(x.astype(mx.float32), bits, group)


def _load(x: Any) -> mx.array:
    return fr.load_rows(x)  # codes along the last axis, read through a byte view


def _arrays(x: Any) -> list[mx.array]:
    return x.arrays if isinstance(x, q.Quantized) else [x]


def _per_head(a: mx.array, heads: int) -> mx.array:
    """``[b, n, heads * d]`` as ``[b, heads, n, d]`` (a view of a contiguous array)."""
    return a.reshape(*a.shape[:2], heads, -1).transpose(0, 2, 1, 3)


def _bytes(n_values: int, bits: int | None, group: int) -> int:
    if bits is None:
        return 2 * n_values
    return q.quantized_bytes(n_values, bits, group)


@dataclass(frozen=True)
class XKVOptions(MethodOptions):
    """xKV (Chang et al., 2025, https://arxiv.org/abs/2503.18893).

    group_layers: adjacent layers sharing one SVD (G); rank_k / rank_v: ranks of the
    key / value factors (``None``: from ``energy_threshold``, the fraction of squared
    singular mass kept); block: most tokens of one basis (one joint SVD); factor_bits:
    quantize the factors (``None``: float16); pre_rope: compress keys before RoPE
    (``False``: after it, scored in factor space, faster); grouping: ``"contiguous"`` or
    ``"cka"`` (layers grouped by measured similarity); window: recent tokens kept in
    full precision; sink: first tokens kept in full precision (attention sinks).
    """

    group_layers: int = 4
    rank_k: int | None = None
    rank_v: int | None = None
    energy_threshold: float = 0.95
    block: int = 2048
    factor_bits: int | None = None
    pre_rope: bool = True
    grouping: str = "contiguous"
    window: int = 0
    sink: int = 4

    def __post_init__(self) -> None:
        self.check_int("group_layers", minimum=1)
        self.check_int("block", minimum=1)
        self.check_int("window", minimum=0)
        self.check_int("sink", minimum=0)
        for name in ("rank_k", "rank_v"):
            self.check_int(name, minimum=1, optional=True)
            if getattr(self, name) is not None and getattr(self, name) > self.block:
                raise self.error(name, f"<= block={self.block} (tokens per SVD)")
        self.check_number("energy_threshold", 0.0, 1.0)
        if self.energy_threshold == 0.0:
            raise self.error("energy_threshold", "a number in (0, 1]")
        self.check_int("factor_bits", q.AFFINE_BITS, optional=True)
        self.check_bool("pre_rope")
        self.check_choice("grouping", ("contiguous", "cka"))


@dataclass
class Basis:
    """One SVD of the group: where its tokens start and this member's share of it."""

    start: int
    # stream -> (member factor [b, r, D] (padded rank when coded), mean [b, 1, D], rank)
    parts: dict[str, tuple[Any, mx.array, int]] = field(default_factory=dict)


@register
class XKVCache(CompressedCache):
    """One layer's share of a group's cross-layer SVDs, plus sinks and a window."""

    method = "xkv"
    family = "low-rank (cross-layer)"
    paper = "xKV, Chang et al., 2025 (arXiv 2503.18893)"
    stores = "shared token factor per layer group + per-layer factors + fp sinks/window"
    cross_layer = True
    Options = XKVOptions
    attends = True
    rotatable = True
    meta_fields = ("offset", "batch_size", "win_start", "n_sink")

    @classmethod
    def stored_numerics(cls, config: KVCacheConfig, layer: LayerInfo) -> StoredNumerics:
        """Dense: one SVD spans the layers of a group. Full rank (ranks of at least
        ``block``, float16 factors) keeps everything up to float16 rounding; otherwise
        nothing is compressed within the sinks and the window, and the loss on the tiny
        llama (block 16, 95% of the energy) is up to 0.017 (bound 0.05)."""
        o = config.layer_options(layer.layer_idx)
        full = o.factor_bits is None and min(o.rank_k or 0, o.rank_v or 0) >= o.block
        return dense_loss(WINDOW_ROUNDING if full else 0.05,
                          lossless_until=o.sink + o.window)

    def __init__(self, config: KVCacheConfig, layer: LayerInfo | None = None) -> None:
        super().__init__(config, layer)
        info, opts = self.layer, self.opts
        self.block = opts.block
        self.window = opts.window
        self.sink = opts.sink
        self.factor_bits = opts.factor_bits
        self.ranks = {"keys": opts.rank_k, "values": opts.rank_v}
        self.pre_rope = opts.pre_rope and info.rope_dims is not None
        self.d_k = info.n_kv_heads * info.head_dim
        self.d_v = info.n_kv_heads * info.v_head_dim
        self._check_layer()
        # A basis per later block only pays when a block holds at least twice the
        # group's width (its member factors cost G*r*D; a block of n tokens, n*r):
        # smaller blocks fit once and project the rest.
        self.refit = self.block >= 2 * info.group_size * max(self.d_k, self.d_v)
        if info.coordinator is None:
            info.coordinator = XKVCoordinator(max_ctx=config.max_ctx)
        self.leader: XKVCache = self
        self.members: list[XKVCache] = [self]  # leader only: the group, in member order
        self.sink_k: mx.array | None = None  # the first tokens, never compressed
        self.sink_v: mx.array | None = None
        self.n_sink = 0
        self.win_k: mx.array | None = None
        self.win_v: mx.array | None = None
        self.win_start = 0  # position of the window's first token
        self.pending: list[tuple[str, int, int]] = []  # (kind, start, n) published
        self.bases: list[Basis] = []
        # Leader only: stream -> token factor rows [b, T_j, r_j] per basis.
        self.shared: dict[str, list[Any]] = {s: [] for s in STREAMS}
        # Column means of a published, not yet adopted SVD block (tiny).
        self.means: dict[tuple[str, int], mx.array] = {}
        self.prompt = False  # the last update was a prompt chunk
        self.compute_dtype = mx.float32
        # Leader only: decoded token factors of the forward pass in progress.
        self._decoded: dict[tuple[str, int], mx.array] = {}
        self._views = Views()  # the fused op's views of the factors, kept between steps

    def _check_layer(self) -> None:
        # A rank above the group's width G*D keeps that width (every SVD is capped by
        # it and by its tokens: see ``_unit_rank``), so one setting fits every model.
        info = self.layer
        if self.factor_bits is not None:
            for d in (self.d_k, self.d_v):
                if d % 32:
                    raise config_error(
                        "factor_bits", self.factor_bits,
                        f"None for layer {info.layer_idx}: its width D={d} is not a "
                        "multiple of 32, the smallest quantization group", self.method)

    @classmethod
    def tune_grid(cls, context: int) -> list[dict[str, Any]]:
        # G=4, 4-bit factors (measured best at equal bytes) from about 12x to about 3x,
        # one basis over the prompt; keys before RoPE (quality) or after it (speed).
        grid = [dict(rank_k=r, rank_v=r, factor_bits=4, block=max(context, 1024))
                for r in (128, 192, 256, 384, 512)]
        grid += [dict(rank_k=r, rank_v=r, factor_bits=4, pre_rope=False,
                      block=max(context, 1024)) for r in (256, 384)]
        return grid

    @classmethod
    def rotation_refusal(cls, opts: Any) -> str | None:
        if not opts.pre_rope:
            return None
        return (f"False while {cls.method}.pre_rope=True: keys stored before RoPE would be "
                "rotated by position, and a fixed rotation does not commute with RoPE "
                "(set pre_rope=false)")

    @classmethod
    def small_options(cls) -> dict[str, Any]:
        return dict(group_layers=2, block=16, window=8)

    @classmethod
    def lossless_options(cls) -> dict[str, Any]:
        return dict(group_layers=2, block=16, rank_k=16, rank_v=16, window=32)

    @classmethod
    def assign_roles(cls, layers: list[LayerInfo], config: KVCacheConfig, model: Any) -> None:
        opts = config.options
        G = opts.group_layers
        if opts.grouping == "cka" and model is not None:
            groups = cka_groups(model, layers, G, opts.pre_rope)
        else:
            # Contiguous (also when loading a saved cache: the saved roles win).
            groups = contiguous_groups(layers, G)
        coordinator = XKVCoordinator(max_ctx=config.max_ctx)
        for gid, members in enumerate(groups):
            for m, i in enumerate(members):
                info = layers[i]
                info.group_id, info.member_idx, info.group_size = gid, m, len(members)
                info.coordinator = coordinator

    @classmethod
    def after_build(cls, caches: list[CompressedCache], config: KVCacheConfig,
                    model: Any) -> None:
        link_groups(caches)

    # ---- mlx_lm protocol ----
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.check_input(keys, values)
        self.batch_size = keys.shape[0]
        self.compute_dtype = keys.dtype
        self._adopt()
        wdt = self.window_dtype(keys.dtype)
        k, v = keys.astype(wdt), values.astype(wdt)
        take = min(max(self.sink - self.n_sink, 0), k.shape[2])
        if take:
            # Copies: a kept slice would pin the whole chunk.
            sk, sv = owned(k[:, :, :take]), owned(v[:, :, :take])
            self.sink_k = sk if self.sink_k is None else mx.concatenate([self.sink_k, sk], 2)
            self.sink_v = sv if self.sink_v is None else mx.concatenate([self.sink_v, sv], 2)
            self.n_sink += take
            self.win_start += take
            # Copies too: the rest of the chunk, kept in the window, would pin the sinks' part.
            k, v = owned(k[:, :, take:]), owned(v[:, :, take:])
        if k.shape[2]:
            self.win_k = k if self.win_k is None else mx.concatenate([self.win_k, k], 2)
            self.win_v = v if self.win_v is None else mx.concatenate([self.win_v, v], 2)
        self.offset += keys.shape[2]
        big = keys.shape[2] >= STEP
        self._publish(big)
        self.prompt = big
        return keys, values

    def _matrices(self, start: int, n: int) -> dict[str, mx.array]:
        """Window tokens ``start .. start+n`` as ``[b, n, D]`` (keys un-rotated)."""
        info = self.layer
        i = start - self.win_start
        k = self.win_k[:, :, i:i + n].astype(mx.float32)
        v = self.win_v[:, :, i:i + n].astype(mx.float32)
        if self.pre_rope:
            k = unrotate(k, info.rope_dims, info.rope_base, info.rope_traditional,
                         info.rope_scale, start)
        out = {}
        for stream, x in (("keys", k), ("values", v)):
            B, H, S, hd = x.shape
            out[stream] = x.transpose(0, 2, 1, 3).reshape(B, S, H * hd)
        return out

    def _publish(self, big: bool) -> None:
        """Publish complete basis blocks, the prompt's rest at its end, and (outside
        prompt chunks) complete projection steps beyond the kept recent ``window``."""
        nxt = self.win_start + sum(n for _, _, n in self.pending)
        ready = self.offset - self.window - nxt
        fitted = bool(self.bases) or any(k == "basis" for k, _, _ in self.pending)
        while ready >= self.block and (self.refit or not fitted):
            self._publish_basis(nxt, self.block)
            nxt, ready, fitted = nxt + self.block, ready - self.block, True
        if self.prompt and not big and ready >= STEP and \
                (not fitted or (self.refit and 2 * ready >= self.block)):
            self._publish_basis(nxt, ready)  # the end of the prompt: its rest
            return
        if (big and self.refit) or not self.bases or \
                any(k == "basis" for k, _, _ in self.pending):
            return  # prompt chunks wait for a block; a new basis is adopted first
        n = (ready // STEP) * STEP
        if n > 0:
            self._publish_projection(nxt, n)

    def _publish_basis(self, start: int, n: int) -> None:
        info, coord = self.layer, self.layer.coordinator
        for stream, x in self._matrices(start, n).items():
            mean = x.mean(axis=1, keepdims=True)
            self.means[stream, start] = mean
            coord.publish_member_keys(info.group_id, info.member_idx, start, n, x - mean,
                                      stream=stream)
        self.pending.append(("basis", start, n))

    def _publish_projection(self, start: int, n: int) -> None:
        info, coord = self.layer, self.layer.coordinator
        basis = self.bases[-1]
        for stream, x in self._matrices(start, n).items():
            own, mean, _ = basis.parts[stream]
            b = _load(own)
            coord.publish_projection(info.group_id, info.member_idx, start, n,
                                     (x - mean.astype(mx.float32)) @ b.swapaxes(-1, -2),
                                     b @ b.swapaxes(-1, -2), stream=stream)
        self.pending.append(("projection", start, n))

    def _unit_rank(self, stream: str, n: int) -> int | None:
        rank = self.ranks[stream]
        d = self.d_k if stream == "keys" else self.d_v
        return None if rank is None else min(rank, n, self.layer.group_size * d)

    def _fetch(self, kind: str, start: int, n: int) -> dict[str, Any] | None:
        """The coordinator's result of a published unit for both streams, or None."""
        info, coord = self.layer, self.layer.coordinator
        if kind == "basis":  # both streams' SVDs side by side
            return coord.get_shared_bases(
                info.group_id, start, info.group_size,
                {stream: self._unit_rank(stream, n) for stream in STREAMS},
                self.opts.energy_threshold)
        got = {}
        for stream in STREAMS:
            got[stream] = coord.get_projection(info.group_id, start, info.group_size,
                                               stream=stream)
            if got[stream] is None:
                if stream == "values":
                    raise RuntimeError(
                        f"xkv layer {info.layer_idx}: key factor of tokens {start} "
                        "ready without its value factor")
                return None
        return got

    def _adopt(self) -> None:
        """Move published units whose shared factor exists from the window to factors."""
        while self.pending:
            kind, start, n = self.pending[0]
            got = self._fetch(kind, start, n)
            if got is None:
                return
            if kind == "basis":
                basis = Basis(start)
                for stream in STREAMS:
                    A, Bs, _ = got[stream]
                    own = Bs[self.layer.member_idx]
                    width = fr.padded_rank(own.shape[-2], self.factor_bits)
                    own = fr.pad_rank(own, width, -2)
                    d = own.shape[-1]
                    basis.parts[stream] = (
                        _store(own, self.factor_bits, _member_group(d)),
                        self.means.pop((stream, start)).astype(FACTOR_DTYPE), width)
                    self.leader._share(stream, kind, start, A)
                self.bases.append(basis)
            else:
                for stream in STREAMS:
                    self.leader._share(stream, kind, start, got[stream])
            self.pending.pop(0)
            self._drop_window(n)
            mx.eval(*self.held_arrays())

    def _drop_window(self, n: int) -> None:
        """The window's first ``n`` tokens are compressed now."""
        if n >= self.win_k.shape[2]:
            self.win_k = self.win_v = None
        else:
            # Copies (once per adopted unit): slices would pin the whole old window.
            self.win_k = owned(self.win_k[:, :, n:])
            self.win_v = owned(self.win_v[:, :, n:])
        self.win_start += n

    def _settle_group(self) -> None:
        """Every member adopts what the group published in this forward pass.

        Run by the group's last member after its attention, when every member has
        attended: the adoption each member's next update would do, done earlier (its
        state is not read in between), so the coordinator's raw blocks and projection
        partials and the adopted tokens' windows do not outlive the forward pass.
        """
        self.leader._decoded = {}
        for member in self.leader.members:
            member._adopt()

    def _share(self, stream: str, kind: str, start: int, A: mx.array) -> None:
        """Leader: store the group's token factor rows of a unit once."""
        segments = self.shared[stream]
        have = self._compressed_end(stream)
        if start < have:
            return  # an earlier member of the group already stored it
        if start != have:
            raise RuntimeError(f"xkv group {self.layer.group_id}: token factor of tokens "
                               f"{start}.. arrived after tokens up to {have}")
        if kind == "basis":
            rows = fr.store_rows(A, self.factor_bits)
            segments.append(rows)
        else:
            width = fr.rows_width(segments[-1])
            rows = fr.store_rows(fr.pad_rank(A, width, -1), self.factor_bits)
            segments[-1] = fr.append_rows(segments[-1], rows)
        self._decoded = {}
        self._forget_views()

    def _compressed_end(self, stream: str) -> int:
        """Leader: position after the last token with a shared token factor."""
        return self.n_sink + sum(fr.rows_count(s) for s in self.shared[stream])

    # ---- reading the factors ----
    def _decoded_rows(self, stream: str, j: int) -> mx.array:
        """Leader: basis ``j``'s token factor rows in float32, decoded once per pass."""
        key = (stream, j)
        if key not in self._decoded:
            self._decoded[key] = fr.load_rows(self.shared[stream][j])
        return self._decoded[key]

    def _spans(self) -> list[tuple[int, int, int]]:
        """(basis index, first position, this member's compressed tokens) of each basis
        with compressed tokens."""
        out = []
        for j, basis in enumerate(self.bases):
            end = self.bases[j + 1].start if j + 1 < len(self.bases) else self.win_start
            if end > basis.start:
                out.append((j, basis.start, end - basis.start))
        return out

    def _member(self, stream: str, j: int) -> tuple[mx.array, mx.array]:
        """Basis ``j``'s member factor per KV head [b, H, r, hd] and mean per head
        [b, H, 1, hd], float32 transients."""
        H = self.layer.n_kv_heads
        own, mean, _ = self.bases[j].parts[stream]
        return _per_head(_load(own), H), _per_head(mean.astype(mx.float32), H)

    def _member_part(self, stream: str, j: int) -> tuple[Any, mx.array] | None:
        """Basis ``j``'s member factor as a part ``[b, H, r, hd]`` and its mean
        ``[b, H, 1, hd]``, views of the stored arrays for the fused op to apply itself;
        None where a head's slice is not whole groups (then MLX applies them)."""
        own, mean, _ = self.bases[j].parts[stream]
        return self._views.get(("member", stream, j), (own, mean),
                               lambda: self._member_view(own, mean))

    def _member_view(self, own: Any, mean: mx.array) -> tuple[Any, mx.array] | None:
        H = self.layer.n_kv_heads
        mh = _per_head(mean, H)
        if not isinstance(own, q.Quantized):
            return DensePart(_per_head(own, H)), mh
        head_dim = mean.shape[-1] // H
        if head_dim % own.group_size or own.bits not in q.BYTE_BITS:
            return None
        return token_codes(q.Quantized(*(_per_head(a, H) for a in own.arrays), own.bits,
                                       own.group_size)), mh

    def _basis_parts(self, stream: str, cached: bool = False
                     ) -> list[tuple[int, mx.array, mx.array, mx.array]]:
        """Per basis with compressed tokens: its first position, the token factor rows
        [b, n, r] of this member's compressed tokens, the member factor per KV head
        [b, H, r, hd] and the mean per head [b, H, 1, hd], float32 transients."""
        out = []
        for j, start, n in self._spans():
            if cached:
                a = self.leader._decoded_rows(stream, j)
            else:
                a = fr.load_rows(self.leader.shared[stream][j])
            if a.shape[-2] != n:
                a = a[..., :n, :]
            out.append((start, a, *self._member(stream, j)))
        return out

    def _rows_part(self, stream: str, j: int, n: int) -> Any:
        """Basis ``j``'s first ``n`` token factor rows as stored, one part shared by the
        KV heads (for the fused kernel; no copy)."""
        rows = self.leader.shared[stream][j]
        return self._views.get(("rows", stream, j, n), (rows,),
                               lambda: shared_by_heads(rows, self.layer.n_kv_heads, n))

    def _forget_views(self) -> None:
        """Every member drops its views of the group's factors (they pin what a store
        change replaced)."""
        for member in self.leader.members:
            member._views.clear()

    def _rebuilt_keys(self, start: int, a: mx.array, bh: mx.array, mh: mx.array,
                      rotated: bool = True) -> mx.array:
        """Keys [b, H, n, hd] of one basis's tokens, rotated to their positions when
        stored before RoPE (unless not ``rotated``; a transient). One matmul for every
        head: a batch of one per head ran at half its speed on the CPU."""
        b, H, r, hd = bh.shape
        k = (a @ bh.transpose(0, 2, 1, 3).reshape(b, r, H * hd)).reshape(b, -1, H, hd)
        k = k.transpose(0, 2, 1, 3) + mh
        if self.pre_rope and rotated:
            info = self.layer
            k = rotate(k, info.rope_dims, info.rope_base, info.rope_traditional,
                       info.rope_scale, start)
        return k

    def dense_kv(self, dtype: mx.Dtype | None = None) -> tuple[mx.array, mx.array]:
        """Transient dense keys/values: sinks, the factors' tokens (keys rotated back to
        their positions) and the window (layers that attend by themselves)."""
        ks = [] if self.sink_k is None else [self.sink_k.astype(mx.float32)]
        vs = [] if self.sink_v is None else [self.sink_v.astype(mx.float32)]
        for (start, a, bh, mh), (_, av, bv, mv) in zip(self._basis_parts("keys"),
                                                       self._basis_parts("values")):
            ks.append(self._rebuilt_keys(start, a, bh, mh))
            vs.append(av[:, None] @ bv + mv)
        if self.win_k is not None:
            ks.append(self.win_k.astype(mx.float32))
            vs.append(self.win_v.astype(mx.float32))
        dtype = dtype or self.compute_dtype
        return (mx.concatenate(ks, axis=2).astype(dtype),
                mx.concatenate(vs, axis=2).astype(dtype))

    # ---- attention ----
    def attend(self, queries: mx.array, scale: float, mask=None) -> mx.array:
        out = self._fused(queries, scale, mask)
        if out is None:
            out = self._attend_ops(queries, scale, mask)
        info = self.layer
        if info.member_idx == info.group_size - 1:
            self._settle_group()
        return out

    def _fused(self, queries: mx.array, scale: float, mask: Any) -> mx.array | None:
        """The attention in one fused CPU op (``ops.native``), the token factors read as
        codes (values in factor space, and keys too when stored after RoPE); None where
        the op does not run (then MLX's ops)."""
        B, Hq, L, hd = queries.shape
        H, hv = self.layer.n_kv_heads, self.layer.v_head_dim
        causal = native.causal_for(queries, mask, H, self.offset)
        if causal is None or not self.bases:
            return None
        qh = (queries * scale).reshape(B, H, Hq // H * L, hd)
        qs, keys, values, factors = [qh], [], [], []
        width, out_width = hd, hv
        if self.sink_k is not None:
            keys.append(DensePart(self.sink_k))
            values.append(DensePart(self.sink_v))
        for j, start, n in self._spans():
            part, projected = self._key_part(qh, j, start, n, width)
            keys.append(part)
            if projected is not None:  # q B^T made here, read at dims width:
                qs.append(projected)
                width += projected.shape[-1]
            member = self._member_part("values", j)
            if member is not None:  # B_v and m_v applied by the op
                values.append(native.Placed(self._rows_part("values", j, n), project=member[0],
                                            mean=member[1]))
                continue
            bv, mv = self._member("values", j)
            values.append(native.Placed(self._rows_part("values", j, n), ooff=out_width,
                                        mass=True))
            factors += [bv, mv]
            out_width += bv.shape[-2] + 1
        if self.win_k is not None:
            keys.append(DensePart(self.win_k))
            values.append(DensePart(self.win_v))
        o = native.decode(mx.concatenate(qs, axis=-1) if len(qs) > 1 else qh, keys, values,
                          causal)
        if o is None:
            return None
        out = o
        if factors:  # each basis's columns are p a then its mass: one product with [B; m]
            out = o[..., :hv] + o[..., hv:] @ mx.concatenate(factors, axis=-2)
        return out.reshape(B, Hq, L, hv).astype(queries.dtype)

    def _key_part(self, qh: mx.array, j: int, start: int, n: int, width: int
                  ) -> tuple[native.Placed, mx.array | None]:
        """Basis ``j``'s keys for the fused op, and the projected queries ``q B^T`` it
        reads at query dims ``width:`` where the op cannot project them itself."""
        rows, member = self._rows_part("keys", j, n), self._member_part("keys", j)
        if self.pre_rope:
            info = self.layer
            tables = rope_tables(start, info.rope_dims, info.rope_base,
                                 info.rope_traditional, info.rope_scale)
            if member is not None and native.rebuildable(rows, member[0]):
                # rebuilt a few tokens at a time, rotated and scored by the op
                return native.Placed(rows, project=member[0], mean=member[1], rope=tables), None
            bh, mh = self._member("keys", j)  # rebuilt here, rotated by the op
            a = self.leader._decoded_rows("keys", j)
            return native.Placed(
                DensePart(self._rebuilt_keys(start, a[..., :n, :], bh, mh, False)),
                rope=tables), None
        if member is not None:
            return native.Placed(rows, project=member[0], mean=member[1]), None
        bh, mh = self._member("keys", j)
        return (native.Placed(rows, qoff=width, shift=qh @ mh.swapaxes(-1, -2)),
                qh @ bh.swapaxes(-1, -2))

    def _attend_ops(self, queries: mx.array, scale: float, mask: Any) -> mx.array:
        """The attention on MLX's ops (factor-space products, keys rebuilt per basis
        when stored before RoPE)."""
        info = self.layer
        B, Hq, L, hd = queries.shape
        H = info.n_kv_heads
        qh = (queries.astype(mx.float32) * scale).reshape(B, H, Hq // H, L, hd)
        key_parts = self._basis_parts("keys", cached=True)
        value_parts = self._basis_parts("values", cached=True)
        scores = []
        if self.sink_k is not None:
            scores.append(qh @ self.sink_k.astype(mx.float32)[:, :, None].swapaxes(-1, -2))
        for start, a, bh, mh in key_parts:
            if self.pre_rope:
                k = self._rebuilt_keys(start, a, bh, mh)
                scores.append(qh @ k[:, :, None].swapaxes(-1, -2))
            else:
                scores.append(factor_scores(qh, a, bh, mh))
        if self.win_k is not None:
            scores.append(qh @ self.win_k.astype(mx.float32)[:, :, None].swapaxes(-1, -2))
        sizes = [s.shape[-1] for s in scores]
        p = masked_softmax(scores[0] if len(scores) == 1 else
                           mx.concatenate(scores, axis=-1), mask)
        dense = [x for x in (self.sink_v, self.win_v) if x is not None]
        parts: list[Any] = ([dense.pop(0)] if self.sink_v is not None else []) + \
            [(a, bh, mh) for _, a, bh, mh in value_parts] + dense
        out, i = None, 0
        for part, n in zip(parts, sizes):
            pe = p[..., i:i + n]
            if isinstance(part, tuple):
                o = factor_values(pe, *part)
            else:
                o = pe @ part.astype(mx.float32)[:, :, None]
            out = o if out is None else out + o
            i += n
        return out.reshape(B, Hq, L, -1).astype(queries.dtype)

    def decode_flops(self) -> int:
        """One query's attention as ``attend`` runs it: per basis, keys rebuilt from
        their factors (``n r H D``, stored before RoPE) or scores in factor space
        (``Hq (D r + r n)``); values always in factor space (``Hq (n r + r Dv)``);
        sinks and window densely."""
        info, hq = self.layer, self.query_heads()
        hd, hv, total, factored = info.head_dim, info.v_head_dim, 0, 0
        for j, basis in enumerate(self.bases):
            end = self.bases[j + 1].start if j + 1 < len(self.bases) else self.win_start
            n, rk, rv = end - basis.start, basis.parts["keys"][2], basis.parts["values"][2]
            if n <= 0:
                continue
            keys = (n * rk * info.n_kv_heads * hd + hq * n * hd if self.pre_rope
                    else hq * (hd * rk + rk * n))
            total += keys + hq * (n * rv + rv * hv)
            factored += n
        total += hq * (self.offset - factored) * (hd + hv)
        return 2 * max(self.batch_size, 1) * total

    # ---- storage accounting ----
    def _coordinator_arrays(self) -> list[mx.array]:
        """Leader: what the coordinator still holds for the group (published blocks and
        partials not consumed, results not handed to every member): counted once."""
        if self.layer.member_idx != 0 or self.layer.coordinator is None:
            return []
        return self.layer.coordinator.group_arrays(self.layer.group_id)

    def held_arrays(self) -> list[mx.array]:
        out = self._coordinator_arrays()
        out.extend(a for a in (self.sink_k, self.sink_v, self.win_k, self.win_v)
                   if a is not None)
        for basis in self.bases:
            for own, mean, _ in basis.parts.values():
                out.extend(_arrays(own))
                out.append(mean)
        for segments in self.shared.values():
            for rows in segments:
                out.extend(fr.rows_arrays(rows))
        out.extend(self.means.values())
        out.extend(self._decoded.values())
        return out

    def accounted_bytes(self) -> int:
        b = max(self.batch_size, 1)
        total = sum(a.nbytes for a in (self.sink_k, self.sink_v, self.win_k, self.win_v)
                    if a is not None)
        for basis in self.bases:
            for stream, (_, _, r) in basis.parts.items():
                d = self.d_k if stream == "keys" else self.d_v
                total += _bytes(b * r * d, self.factor_bits, _member_group(d)) + 2 * b * d
        for segments in self.shared.values():
            for rows in segments:
                total += b * fr.rows_bytes(fr.rows_count(rows), fr.rows_width(rows),
                                           self.factor_bits)
        total += sum(a.nbytes for a in self._coordinator_arrays())
        total += sum(a.nbytes for a in self._decoded.values())
        return total + sum(m.nbytes for m in self.means.values())

    # ---- trimming ----
    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the last ``n`` tokens: window tokens, then token factor rows (each row is
        one token's, so the kept tokens are held exactly as before), then sinks. A
        basis whose tokens are all dropped goes with them."""
        n = max(0, min(n, self.offset))
        keep = self.offset - n
        if self.pending:
            self._adopt()
        if self.pending:
            raise NotTrimmableError(
                f"xkv layer {self.layer.layer_idx}: tokens published in an unfinished "
                "forward pass (not every member of its group has run); finish the pass "
                "before trimming")
        if keep >= self.win_start:
            held = keep - self.win_start
            if self.win_k is not None and held < self.win_k.shape[2]:
                self.win_k = owned(self.win_k[:, :, :held]) if held else None
                self.win_v = owned(self.win_v[:, :, :held]) if held else None
        else:
            self.win_k = self.win_v = None
            self._trim_compressed(keep)
        self.offset = keep
        self.leader._decoded = {}
        self._forget_views()
        if self.layer.member_idx == 0:
            self.layer.coordinator.rewind(self.layer.group_id, self.win_start,
                                          self.win_start - self.n_sink)
        return n

    def _trim_compressed(self, keep: int) -> None:
        """Keep the compressed tokens (and sinks) before position ``keep``."""
        if keep < self.n_sink:
            self.sink_k = owned(self.sink_k[:, :, :keep]) if keep else None
            self.sink_v = owned(self.sink_v[:, :, :keep]) if keep else None
            self.n_sink = keep
        while self.bases and self.bases[-1].start >= max(keep, self.n_sink):
            self.bases.pop()
            if self.layer.member_idx == 0:
                for segments in self.shared.values():
                    segments.pop()
        if self.layer.member_idx == 0 and self.bases:
            for segments in self.shared.values():
                segments[-1] = fr.keep_rows(segments[-1], keep - self.bases[-1].start)
        self.win_start = keep

    # ---- save / load ----
    @property
    def state(self):
        arrays: list[Any] = [self.sink_k, self.sink_v, self.win_k, self.win_v]
        for basis in self.bases:
            for stream in STREAMS:
                own, mean, _ = basis.parts[stream]
                arrays.extend(_arrays(own))
                arrays.append(mean)
        for stream in STREAMS:
            for rows in self.shared[stream]:
                arrays.extend(fr.rows_arrays(rows))
        return arrays

    def check_state(self) -> None:
        """Restored dtypes (``cache.restore_check``; the dense view checks the shapes):
        windows and factors are floats, factor codes (``factor_bits``) uint32."""
        require_dtypes("windows", [self.sink_k, self.sink_v, self.win_k, self.win_v])
        codes = (*FLOATS, mx.uint32) if self.factor_bits is not None else FLOATS
        require_dtypes("factors", [a for _, a in flat_state(self.state)[4:]], codes)

    @state.setter
    def state(self, v) -> None:
        v = list(v)
        self.sink_k, self.sink_v, self.win_k, self.win_v = v[:4]
        i = 4
        per = 1 if self.factor_bits is None else 3

        def take() -> list[mx.array]:
            nonlocal i
            i += per
            return v[i - per:i]

        for basis in self.bases:
            for stream, d in (("keys", self.d_k), ("values", self.d_v)):
                got = take()
                own = got[0] if per == 1 else q.Quantized(*got, self.factor_bits,
                                                          _member_group(d))
                basis.parts[stream] = (own, v[i], basis.parts[stream][2])
                i += 1
        for stream in STREAMS:
            self.shared[stream] = [fr.rows_from(take(), self.factor_bits)
                                   for _ in self.shared[stream]]
        self._views.clear()

    @property
    def meta_state(self):
        bases = ";".join(f"{b.start}:{b.parts['keys'][2]}:{b.parts['values'][2]}"
                         for b in self.bases)
        return (*CompressedCache.meta_state.fget(self), bases,
                str(len(self.shared["keys"])))

    @meta_state.setter
    def meta_state(self, v) -> None:
        if len(v) != 6 or ":" in v[3]:
            raise ValueError(
                "xkv: this saved cache has the layout of an earlier veloxquant (one basis, "
                "token factors coded along tokens); it cannot be loaded: build the "
                "prompt cache again")
        CompressedCache.meta_state.fset(self, v)
        # Units published but not adopted are published again to the fresh coordinator.
        self.pending, self.means, self._decoded = [], {}, {}
        self._views.clear()
        self.bases = []
        for item in filter(None, v[4].split(";")):
            start, rk, rv = (int(x) for x in item.split(":"))
            self.bases.append(Basis(start, {"keys": (None, None, rk),
                                            "values": (None, None, rv)}))
        self.shared = {s: [None] * int(v[5]) for s in STREAMS}


def factor_scores(qh: mx.array, a: mx.array, bh: mx.array, mh: mx.array) -> mx.array:
    """Scores ``q . (A B + m)`` of keys held as factors, in factor space.

    ``qh`` [b, H, rep, L, hd] (scaled queries grouped by KV head), ``a`` [b, n, r],
    ``bh`` [b, H, r, hd], ``mh`` [b, H, 1, hd]; returns [b, H, rep, L, n]. One matmul
    of every query head against the token factor (shared by the heads).
    """
    B, H, rep, L, hd = qh.shape
    qb = qh.reshape(B, H, rep * L, hd) @ bh.swapaxes(-1, -2)  # [b, H, rep*L, r]
    s = qb.reshape(B, H * rep * L, -1) @ a.swapaxes(-1, -2)
    return s.reshape(B, H, rep, L, -1) + qh @ mh[:, :, None].swapaxes(-1, -2)


def factor_values(p: mx.array, a: mx.array, bh: mx.array, mh: mx.array) -> mx.array:
    """``p @ (A B + m)`` in factor space: ``(p A) B + (sum p) m``, [b, H, rep, L, hd]."""
    B, H, rep, L, n = p.shape
    pa = p.reshape(B, H * rep * L, n) @ a  # [b, H*rep*L, r]
    out = pa.reshape(B, H, rep * L, -1) @ bh
    return out.reshape(B, H, rep, L, -1) + p.sum(axis=-1, keepdims=True) * mh[:, :, None]
def _kv_shape(info: LayerInfo) -> tuple[int, int, int]:
    return (info.n_kv_heads, info.head_dim, info.v_head_dim)


def contiguous_groups(layers: list[LayerInfo], G: int) -> list[list[int]]:
    """Runs of up to ``G`` consecutive layers (indices into ``layers``) of one KV shape.

    ``layers`` holds only the layers xKV compresses, so layers of another kind in
    between (recurrent, sliding-window) are skipped; a shape change starts a group.
    """
    groups: list[list[int]] = []
    for i, info in enumerate(layers):
        last = groups[-1] if groups else None
        if last and len(last) < G and _kv_shape(layers[last[0]]) == _kv_shape(info):
            last.append(i)
        else:
            groups.append([i])
    return groups


def linear_cka(x: mx.array, y: mx.array) -> float:
    """Linear CKA of two ``[S, D]`` activations (1 = same up to rotation and scale)."""
    x = x - x.mean(axis=0)
    y = y - y.mean(axis=0)
    num = (y.T @ x).square().sum()
    den = mx.sqrt((x.T @ x).square().sum() * (y.T @ y).square().sum())
    return (num / mx.maximum(den, 1e-30)).item()


def cka_groups(model: Any, layers: list[LayerInfo], G: int, pre_rope: bool = True,
               n_tokens: int = 256, seed: int = 0) -> list[list[int]]:
    """Groups of ``G`` layers (indices into ``layers``) by the CKA similarity of their
    keys on a calibration prompt run through a dense cache.

    The prompt is ``n_tokens`` pseudo-random token ids (fixed seed; no tokenizer is
    at hand when caches are built). Greedy: the first layer not yet grouped seeds a
    group and takes the ``G - 1`` ungrouped layers most similar to it. Groups need
    not be contiguous; members are ordered by layer index (the leader is the first).
    """
    from mlx_lm.models.cache import make_prompt_cache

    vocab = getattr(getattr(model, "args", None), "vocab_size", 256)
    tokens = mx.random.randint(0, vocab, (1, n_tokens), key=mx.random.key(seed))
    caches = make_prompt_cache(model)
    model(tokens, cache=caches)
    feats = []
    for info in layers:
        k = caches[info.layer_idx].keys[..., :n_tokens, :].astype(mx.float32)
        if pre_rope and info.rope_dims is not None:
            k = unrotate(k, info.rope_dims, info.rope_base, info.rope_traditional,
                         info.rope_scale, 0)
        feats.append(k[0].transpose(1, 0, 2).reshape(n_tokens, -1))
    n = len(layers)
    sim = [[linear_cka(feats[i], feats[j]) if i != j else 1.0 for j in range(n)]
           for i in range(n)]
    free = list(range(n))
    groups = []
    while free:
        seed_layer = free.pop(0)
        same = [j for j in free if _kv_shape(layers[j]) == _kv_shape(layers[seed_layer])]
        best = sorted(same, key=lambda j: -sim[seed_layer][j])[:G - 1]
        free = [j for j in free if j not in best]
        groups.append(sorted([seed_layer, *best]))
    return groups


def link_groups(caches: list[CompressedCache]) -> None:
    """Point every member of a group at its leader (member 0), who holds the shared
    token factors and the group's members in order."""
    leaders = {c.layer.group_id: c for c in caches
               if isinstance(c, XKVCache) and c.layer.member_idx == 0}
    for leader in leaders.values():
        leader.members = []
    for c in sorted((c for c in caches if isinstance(c, XKVCache)),
                    key=lambda c: c.layer.member_idx):
        if c.layer.group_id not in leaders:
            raise ValueError(f"xkv group {c.layer.group_id} has no member 0")
        c.leader = leaders[c.layer.group_id]
        c.leader.members.append(c)
