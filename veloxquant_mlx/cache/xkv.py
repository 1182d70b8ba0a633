"""``xkv``: cross-layer SVD of the KV cache (xKV, Chang et al., arXiv 2503.18893).

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

Storage is a stored form (``cache.factored.FactoredForm``): per side, the sinks, the
factored tokens (this layer's member factors and means per basis; the group leader,
member 0, also holds the shared token factor rows, so each is counted once per model)
and a full-precision window of tokens not yet compressed. Bytes, state, the dense view
and trim come from the form; this module decides which tokens go where.

Timeline: mlx_lm calls layers 0..L-1 in order. When a unit (a basis block or a
projection step) is complete, every member publishes it in the same forward pass; it
stays in every member's window for that pass's attention and moves to factors right
after the group's last member has attended (or at the member's next update), so the
coordinator holds nothing between forward passes.

Attention runs in factor space (``cache.xkv_attention``). The token factors are
decoded once per forward pass and group (the leader keeps the float32 transient until
the group's last member has attended); the groups are chosen in ``cache.xkv_groups``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from veloxquant_mlx.cache.base import CompressedCache, LayerInfo, window_dtype
from veloxquant_mlx.cache.factored import Factored, FactoredForm
from veloxquant_mlx.cache.numerics import WINDOW_ROUNDING, StoredNumerics, dense_loss
from veloxquant_mlx.cache.profile import Profile
from veloxquant_mlx.cache.restore_check import FLOATS, flat_state, require_dtypes
from veloxquant_mlx.cache.segments import Dense
from veloxquant_mlx.cache.stored import StoredFormCache
from veloxquant_mlx.cache.xkv_attention import FactorAttention, factor_flops
from veloxquant_mlx.cache.xkv_coordinator import XKVCoordinator
from veloxquant_mlx.cache.xkv_groups import cka_groups, contiguous_groups, linear_cka
from veloxquant_mlx.ops import factors as fr
from veloxquant_mlx.ops import quantize as q
from veloxquant_mlx.ops.buffers import owned
from veloxquant_mlx.ops.rope import unrotate
from veloxquant_mlx.options import MethodOptions, config_error
from veloxquant_mlx.register import register

if TYPE_CHECKING:
    from veloxquant_mlx.config import KVCacheConfig

__all__ = ["XKVCache", "XKVOptions", "link_groups", "linear_cka"]

STREAMS = ("keys", "values")
STEP = 32  # tokens per projection step; updates this long or longer are prompt chunks


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


def _stored_numerics(config: KVCacheConfig, layer: LayerInfo) -> StoredNumerics:
    """Dense: one SVD spans the layers of a group. Full rank (ranks of at least
    ``block``, float16 factors) keeps everything up to float16 rounding; otherwise
    nothing is compressed within the sinks and the window, and the loss on the tiny
    llama (block 16, 95% of the energy) is up to 0.017 (bound 0.05)."""
    o = config.layer_options(layer.layer_idx)
    full = o.factor_bits is None and min(o.rank_k or 0, o.rank_v or 0) >= o.block
    return dense_loss(WINDOW_ROUNDING if full else 0.05,
                      lossless_until=o.sink + o.window)


def _tune_grid(context: int) -> list[dict[str, Any]]:
    # G=4, 4-bit factors (measured best at equal bytes) from about 12x to about 3x,
    # one basis over the prompt; keys before RoPE (quality) or after it (speed).
    grid = [dict(rank_k=r, rank_v=r, factor_bits=4, block=max(context, 1024))
            for r in (128, 192, 256, 384, 512)]
    grid += [dict(rank_k=r, rank_v=r, factor_bits=4, pre_rope=False,
                  block=max(context, 1024)) for r in (256, 384)]
    return grid


def _rotation_refusal(opts: Any) -> str | None:
    if not opts.pre_rope:
        return None
    return ("False while xkv.pre_rope=True: keys stored before RoPE would be "
            "rotated by position, and a fixed rotation does not commute with RoPE "
            "(set pre_rope=false)")


def _assign_roles(layers: list[LayerInfo], config: KVCacheConfig, model: Any) -> None:
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


def _check_restored(cache: Any) -> None:
    """Restored dtypes (``cache.restore_check``; the dense view checks the shapes):
    windows and factors are floats, factor codes (``factor_bits``) uint32; keys and
    values hold as many sink and window tokens."""
    runs = [s.x for s in (*cache.sinks, *cache.windows)]
    require_dtypes("windows", runs)
    codes = (*FLOATS, mx.uint32) if cache.factor_bits is not None else FLOATS
    require_dtypes("factors", [a for _, a in flat_state(cache.state)[4:]], codes)
    for name, (k, v) in (("sink", cache.sinks), ("window", cache.windows)):
        if k.n != v.n:
            raise ValueError(f"{name} keys hold {k.n} tokens, values {v.n}")
    if cache._saved_sink is not None and cache.n_sink != cache._saved_sink:
        raise ValueError(f"{cache.n_sink} sink tokens held; the saved count is "
                         f"{cache._saved_sink}")
    starts = [start for start, _, _ in cache.bases]
    if starts and (starts[0] != cache.n_sink or starts != sorted(set(starts))):
        raise ValueError(f"bases start at {starts}, after {cache.n_sink} sink tokens")


def _trim_refusal(cache: Any) -> str:
    return ("tokens of an unfinished forward pass wait for the other layers of their group; "
            "finish the pass (evaluate the model's output) before trimming")


@register
class XKVCache(FactorAttention, StoredFormCache):
    """One layer's share of a group's cross-layer SVDs, plus sinks and a window."""

    method = "xkv"
    Options = XKVOptions
    profile = Profile(
        trim_refusal=_trim_refusal,
        decode_flops=factor_flops,
        check_restored=_check_restored,
        family="low-rank (cross-layer)",
        paper="xKV, Chang et al., 2025 (arXiv 2503.18893)",
        stores="shared token factor per layer group + per-layer factors + fp sinks/window",
        cross_layer=True,
        rotatable=True,
        stored_numerics=_stored_numerics,
        assign_roles=_assign_roles,
        after_build=lambda caches, config, model: link_groups(caches),
        tune_grid=_tune_grid,
        rotation_refusal=_rotation_refusal,
        small=dict(group_layers=2, block=16, window=8),
        lossless=dict(group_layers=2, block=16, rank_k=16, rank_v=16, window=32),
    )
    attends = True
    meta_fields = {"offset": int, "batch_size": int, "win_start": int, "n_sink": int}

    def __init__(self, config: KVCacheConfig, layer: LayerInfo | None = None) -> None:
        super().__init__(config, layer)
        info, opts = self.layer, self.opts
        self.block, self.window, self.sink = opts.block, opts.window, opts.sink
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
        self._declare_form()
        self.pending: list[tuple[str, int, int]] = []  # (kind, start, n) published
        # Column means of a published, not yet adopted SVD block (tiny).
        self.means: dict[tuple[str, int], mx.array] = {}
        self.prompt = False  # the last update was a prompt chunk
        self._saved_sink: int | None = None  # the sink count a restored meta_state gave

    def _declare_form(self) -> None:
        """Sinks, factored tokens and a window per side; the leader holds the group's
        token factor rows (``link_groups`` points the members at them)."""
        info = self.layer
        holder = info.member_idx == 0
        H = info.n_kv_heads
        self.factors = {"keys": Factored(self.d_k, H, self.factor_bits, holder,
                                         info if self.pre_rope else None),
                        "values": Factored(self.d_v, H, self.factor_bits, holder)}
        if holder:
            self.factors["keys"].on_cut = self._rewind
        self.sinks = (Dense(), Dense())  # the first tokens, never compressed
        self.windows = (Dense(), Dense())  # tokens not yet compressed
        self.stored = FactoredForm(self.sinks, (self.factors["keys"], self.factors["values"]),
                                   self.windows)

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

    # ---- where the stored form stands ----
    @property
    def n_sink(self) -> int:
        """Sink tokens held."""
        return self.sinks[0].n

    @property
    def win_start(self) -> int:
        """Position of the window's first token (after the sinks and factored tokens)."""
        return self.n_sink + self.factors["keys"].n

    @property
    def bases(self) -> list[tuple[int, int, int]]:
        """``(start, key rank, value rank)`` of each basis held."""
        return [(k.start, k.rank, v.rank)
                for k, v in zip(self.factors["keys"].bases, self.factors["values"].bases)]

    def attention_slots(self) -> tuple[list[Any], list[Any]]:
        return [], []  # attended in factor space, not as slots

    @classmethod
    def _attend_rows(cls, rows: list[Any], queries: mx.array, scale: float
                    ) -> mx.array | None:
        return None  # each row attends in factor space

    # ---- mlx_lm protocol ----
    def _commit(self) -> None:
        self._adopt()  # what the group's coordinator has finished moves to factors

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.begin(keys, values)
        wdt = window_dtype(self.config, keys.dtype)
        k, v = keys.astype(wdt), values.astype(wdt)
        take = min(max(self.sink - self.n_sink, 0), k.shape[2])
        if take:
            # Copies: a kept slice would pin the whole chunk.
            for sink, x in zip(self.sinks, (k, v)):
                sink.append(owned(x[:, :, :take]))
            # Copies too: the rest of the chunk, kept in the window, would pin the sinks' part.
            k, v = owned(k[:, :, take:]), owned(v[:, :, take:])
        if k.shape[2]:
            for window, x in zip(self.windows, (k, v)):
                window.append(x)
        big = keys.shape[2] >= STEP
        self._publish(big)
        self.prompt = big
        return keys, values

    def is_trimmable(self) -> bool:
        """Not while tokens published in an unfinished forward pass wait for the rest of
        their group (finish the pass first)."""
        self._adopt()
        return not self.pending

    def _rewind(self, end: int, kept: int) -> None:
        """Leader, after a trim cut factored tokens: the coordinator forgets what the
        group published from ``end`` on, so those tokens can be published again."""
        self.layer.coordinator.rewind(self.layer.group_id, end, kept)

    # ---- compressing ----
    def _matrices(self, start: int, n: int) -> dict[str, mx.array]:
        """Window tokens ``start .. start+n`` as ``[b, n, D]`` (keys un-rotated)."""
        info = self.layer
        i = start - self.win_start
        k, v = (w.x[:, :, i:i + n].astype(mx.float32) for w in self.windows)
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
        have = bool(self.factors["keys"].bases)
        fitted = have or any(k == "basis" for k, _, _ in self.pending)
        while ready >= self.block and (self.refit or not fitted):
            self._publish_basis(nxt, self.block)
            nxt, ready, fitted = nxt + self.block, ready - self.block, True
        if self.prompt and not big and ready >= STEP and \
                (not fitted or (self.refit and 2 * ready >= self.block)):
            self._publish_basis(nxt, ready)  # the end of the prompt: its rest
            return
        if (big and self.refit) or not have or any(k == "basis" for k, _, _ in self.pending):
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
        for stream, x in self._matrices(start, n).items():
            basis = self.factors[stream].bases[-1]
            b = fr.load_rows(basis.own)
            coord.publish_projection(info.group_id, info.member_idx, start, n,
                                     (x - basis.mean.astype(mx.float32)) @ b.swapaxes(-1, -2),
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
                    raise RuntimeError(f"xkv layer {info.layer_idx}: key factor of tokens "
                                       f"{start} ready without its value factor")
                return None
        return got

    def _adopt(self) -> None:
        """Move published units whose shared factor exists from the window to factors."""
        while self.pending:
            kind, start, n = self.pending[0]
            got = self._fetch(kind, start, n)
            if got is None:
                return
            for stream in STREAMS:
                a = got[stream]
                if kind == "basis":
                    a, own, _ = a
                    self.factors[stream].add_basis(start, own[self.layer.member_idx],
                                                   self.means.pop((stream, start)))
                self.leader._share(stream, kind, start, a)
                self.factors[stream].extend(n)
            self.pending.pop(0)
            for window in self.windows:
                window.take(n)  # a copy of the rest (once per adopted unit)
            mx.eval(*self.held_arrays())

    def _settle_group(self) -> None:
        """Every member adopts what the group published in this forward pass.

        Run by the group's last member after its attention, when every member has
        attended: the adoption each member's next update would do, done earlier (its
        state is not read in between), so the coordinator's raw blocks and projection
        partials and the adopted tokens' windows do not outlive the forward pass.
        """
        for f in self.leader.factors.values():
            f.rows.release()
        for member in self.leader.members:
            member._adopt()

    def _share(self, stream: str, kind: str, start: int, a: mx.array) -> None:
        """Leader: store the group's token factor rows of a unit once."""
        rows = self.factors[stream].rows
        have = self.n_sink + rows.count()
        if start < have:
            return  # an earlier member of the group already stored it
        if start != have:
            raise RuntimeError(f"xkv group {self.layer.group_id}: token factor of tokens "
                               f"{start}.. arrived after tokens up to {have}")
        rows.add(a, kind == "basis")

    # ---- storage beside the form ----
    def _coordinator_arrays(self) -> list[mx.array]:
        """Leader: what the coordinator still holds for the group (published blocks and
        partials not consumed, results not handed to every member): counted once."""
        if self.layer.member_idx != 0 or self.layer.coordinator is None:
            return []
        return self.layer.coordinator.group_arrays(self.layer.group_id)

    def shared_arrays(self) -> list[mx.array]:
        return self._coordinator_arrays() + list(self.means.values())

    # ---- save / load ----

    @property
    def meta_state(self) -> tuple[str, ...]:
        bases = ";".join(f"{start}:{rk}:{rv}" for start, rk, rv in self.bases)
        rows = self.factors["keys"].rows.rows if self.factors["keys"].holder else []
        return (*CompressedCache.meta_state.fget(self), bases, str(len(rows)))

    @meta_state.setter
    def meta_state(self, v: tuple[str, ...]) -> None:
        if len(v) != 6 or ":" in v[3]:
            raise ValueError(
                "xkv: this saved cache has the layout of an earlier veloxquant (one basis, "
                "token factors coded along tokens); it cannot be loaded: build the "
                "prompt cache again")
        self.offset, self.batch_size, win_start, self._saved_sink = (int(x) for x in v[:4])
        if not 0 <= self._saved_sink <= win_start <= self.offset:
            raise ValueError(f"xkv: sinks {self._saved_sink}, window start {win_start} and "
                             f"offset {self.offset} are out of order")
        # Units published but not adopted are published again to the fresh coordinator.
        self.pending, self.means = [], {}
        bases = [_basis_meta(item) for item in filter(None, v[4].split(";"))]
        for i, stream in enumerate(STREAMS):
            f = self.factors[stream]
            f.expect([(b[0], b[i + 1]) for b in bases], int(v[5]))
            f.count = win_start - self._saved_sink


def _basis_meta(item: str) -> tuple[int, int, int]:
    """``start:key rank:value rank`` of one saved basis."""
    start, rk, rv = (int(x) for x in item.split(":"))
    return start, rk, rv


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
        for stream, f in c.factors.items():
            f.rows = c.leader.factors[stream].rows
