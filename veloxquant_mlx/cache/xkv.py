"""``xkv``: cross-layer SVD of the KV cache (xKV, Chang et al., arXiv 2503.18893).

Adjacent layers are grouped (``xkv_group_size`` = G). Each member's keys (before
RoPE by default) and values are ``[b, S, D]`` matrices, D = n_kv_heads * head_dim.
The group's first ``xkv_block`` tokens get one truncated SVD of the member
concatenation ``[S, G*D]`` per stream (after per-column mean removal) through the
model's shared ``XKVCoordinator``: a token factor ``A`` [S, r] shared by the group
and a factor ``B_i`` [r, D] per member, ``X_i ~ A @ B_i + mean_i``.

Later tokens are projected onto the held member factors in steps of ``STEP``
tokens (least squares over the whole group, solved once by the coordinator from
per-member partials), so they cost only their shared token factor, ``r`` values
per token per group. Each cache holds only: its member factors and means, a
full-precision window of tokens not yet compressed, and (the group leader, member
0, only) the shared token factors, so each is counted once per model.

Timeline: mlx_lm calls layers 0..L-1 in order. When a unit (the SVD block or a
projection step) is complete, every member publishes it in the same forward pass;
it stays in every member's window for that pass's attention and moves to factors
right after the group's last member has attended (or on the member's next update),
so the coordinator holds nothing between forward passes.

Attention: values in factor space (``out = (p A) B_i + (sum p) mean_i``); keys
stored after RoPE also (``scores = (q B_i^T) A``); keys stored before RoPE are
rebuilt into a transient tensor and rotated for their positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ..config import KVCacheConfig
from ..ops import quantize as q
from ..ops.attention import masked_softmax
from ..ops.rope import rotate, unrotate
from ..options import MethodOptions, config_error
from ..registry import register
from .base import CompressedCache, LayerInfo
from .xkv_coordinator import XKVCoordinator

FACTOR_DTYPE = mx.float16  # unquantized factors and means are stored in float16
STREAMS = ("keys", "values")
STEP = 32  # tokens per projection step (and quantization group of the token factor)


def _member_group(d: int) -> int:
    """Quantization group of a member factor along its width D (64, else 32)."""
    return 64 if d % 64 == 0 else 32


def _store(x: mx.array, bits: int | None, group: int) -> Any:
    """Keep a factor as float16, or quantized along its last axis."""
    if bits is None:
        return x.astype(FACTOR_DTYPE)
    return q.quantize(x.astype(mx.float32), bits, group)


def _load(x: Any) -> mx.array:
    if isinstance(x, q.Quantized):
        return q.dequantize(x, mx.float32)
    return x.astype(mx.float32)


def _arrays(x: Any) -> list[mx.array]:
    return x.arrays if isinstance(x, q.Quantized) else [x]


def _append(held: Any, part: Any) -> Any:
    """Token factors [b, r, T] grow along their last (token) axis."""
    if held is None:
        return part
    if isinstance(part, q.Quantized):
        return q.concat_packed([held, part])
    return mx.concatenate([held, part], axis=-1)


def _bytes(n_values: int, bits: int | None, group: int) -> int:
    if bits is None:
        return 2 * n_values
    return q.quantized_bytes(n_values, bits, group)


@dataclass(frozen=True)
class XKVOptions(MethodOptions):
    """xKV (Chang et al., 2025, https://arxiv.org/abs/2503.18893).

    group_layers: adjacent layers sharing one SVD (G); rank_k / rank_v: ranks of the
    key / value factors (``None``: from ``energy_threshold``, the fraction of squared
    singular mass kept); block: tokens of the group's basis block (one joint SVD),
    later tokens are projected onto that basis in steps of 32; factor_bits: quantize
    the factors (``None``: float16); pre_rope: compress keys before RoPE; grouping:
    ``"contiguous"`` or ``"cka"`` (layers grouped by measured similarity); window:
    recent tokens kept in full precision.
    """

    group_layers: int = 4
    rank_k: int | None = None
    rank_v: int | None = None
    energy_threshold: float = 0.95
    block: int = 1024
    factor_bits: int | None = None
    pre_rope: bool = True
    grouping: str = "contiguous"
    window: int = 0

    legacy_names = {"xkv_group_size": "group_layers"}

    def __post_init__(self) -> None:
        self.check_int("group_layers", minimum=1)
        self.check_int("block", minimum=1)
        self.check_int("window", minimum=0)
        for name in ("rank_k", "rank_v"):
            self.check_int(name, minimum=1, optional=True)
            if getattr(self, name) is not None and getattr(self, name) > self.block:
                raise self.error(name, f"<= block={self.block} (tokens per SVD)")
        self.check_number("energy_threshold", 0.0, 1.0)
        if self.energy_threshold == 0.0:
            raise self.error("energy_threshold", "a number in (0, 1]")
        self.check_int("factor_bits", q.AFFINE_BITS, optional=True)
        if self.factor_bits is not None and self.block % STEP:
            raise self.error("block", f"a multiple of {STEP} when factor_bits is set (the "
                             f"token factor is quantized in groups of {STEP} tokens)")
        self.check_bool("pre_rope")
        self.check_choice("grouping", ("contiguous", "cka"))


@register
class XKVCache(CompressedCache):
    """One layer's share of a group's cross-layer SVD, plus a full-precision window."""

    method = "xkv"
    family = "low-rank (cross-layer)"
    paper = "xKV, Chang et al., 2025 (arXiv 2503.18893)"
    stores = "shared token factor per layer group + per-layer factors + fp window"
    cross_layer = True
    Options = XKVOptions
    attends = True
    meta_fields = ("offset", "batch_size", "win_start")

    def __init__(self, config: KVCacheConfig, layer: LayerInfo | None = None) -> None:
        super().__init__(config, layer)
        info, opts = self.layer, self.opts
        self.block = opts.block
        self.window = opts.window
        self.factor_bits = opts.factor_bits
        self.ranks = {"keys": opts.rank_k, "values": opts.rank_v}
        self.pre_rope = opts.pre_rope and info.rope_dims is not None
        self.d_k = info.n_kv_heads * info.head_dim
        self.d_v = info.n_kv_heads * info.v_head_dim
        self._check_layer()
        if info.coordinator is None:
            info.coordinator = XKVCoordinator(max_ctx=config.max_ctx)
        self.leader: XKVCache = self
        self.members: list[XKVCache] = [self]  # leader only: the group, in member order
        self.win_k: mx.array | None = None
        self.win_v: mx.array | None = None
        self.win_start = 0  # position of the window's first token (= tokens compressed)
        self.pending: list[tuple[int, int]] = []  # (start, n) published, not adopted
        # Own member factor, mean and rank per stream, once the group's SVD is done.
        self.basis: dict[str, tuple[Any, mx.array, int]] = {}
        # Leader only: stream -> shared token factor of all compressed tokens [b, r, T].
        self.shared: dict[str, Any] = {}
        # Column means of a published, not yet adopted SVD block (tiny).
        self.means: dict[str, mx.array] = {}
        self.compute_dtype = mx.float32

    def _check_layer(self) -> None:
        info = self.layer
        for name, d in (("rank_k", self.d_k), ("rank_v", self.d_v)):
            rank = getattr(self.opts, name)
            if rank is not None and rank > info.group_size * d:
                raise config_error(
                    name, rank, f"<= G*D = {info.group_size}*{d} = {info.group_size * d} "
                    f"for the group of layer {info.layer_idx}", self.method)
        if self.factor_bits is not None:
            for d in (self.d_k, self.d_v):
                if d % 32:
                    raise config_error(
                        "factor_bits", self.factor_bits,
                        f"None for layer {info.layer_idx}: its width D={d} is not a "
                        "multiple of 32, the smallest quantization group", self.method)

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
        if self.win_k is None:
            self.win_k, self.win_v = keys.astype(wdt), values.astype(wdt)
        else:
            self.win_k = mx.concatenate([self.win_k, keys.astype(wdt)], axis=2)
            self.win_v = mx.concatenate([self.win_v, values.astype(wdt)], axis=2)
        self.offset += keys.shape[2]
        self._publish()
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

    def _publish(self) -> None:
        """Publish the SVD block, then every complete projection step beyond the
        kept recent ``window``."""
        info, coord = self.layer, self.layer.coordinator
        nxt = self.win_start + sum(n for _, n in self.pending)
        ready = self.offset - self.window - nxt
        if nxt == 0:
            if ready < self.block:
                return
            for stream, x in self._matrices(0, self.block).items():
                mean = x.mean(axis=1, keepdims=True)
                self.means[stream] = mean
                coord.publish_member_keys(info.group_id, info.member_idx, 0, self.block,
                                          x - mean, stream=stream)
            self.pending.append((0, self.block))
            return
        if not self.basis:
            return  # the basis is not adopted yet; project once it is
        n = (ready // STEP) * STEP
        if n <= 0:
            return
        for stream, x in self._matrices(nxt, n).items():
            own, mean, _ = self.basis[stream]
            b = _load(own)
            coord.publish_projection(info.group_id, info.member_idx, nxt, n,
                                     (x - mean.astype(mx.float32)) @ b.swapaxes(-1, -2),
                                     b @ b.swapaxes(-1, -2), stream=stream)
        self.pending.append((nxt, n))

    def _adopt(self, follow_up: bool = True) -> None:
        """Move published units whose shared factor exists from the window to factors;
        then (``follow_up``) publish what the adopted basis lets project."""
        info, coord = self.layer, self.layer.coordinator
        while self.pending:
            start, n = self.pending[0]
            got = {}
            for stream in STREAMS:
                if start == 0:
                    got[stream] = coord.get_shared_basis(
                        info.group_id, 0, info.group_size, self.ranks[stream],
                        self.opts.energy_threshold, stream=stream)
                else:
                    got[stream] = coord.get_projection(info.group_id, start,
                                                       info.group_size, stream=stream)
                if got[stream] is None:
                    if stream == "values":
                        raise RuntimeError(
                            f"xkv layer {info.layer_idx}: key factor of tokens {start} "
                            "ready without its value factor")
                    return
            for stream in STREAMS:
                if start == 0:
                    A, Bs, _ = got[stream]
                    own = Bs[info.member_idx]
                    d = own.shape[-1]
                    self.basis[stream] = (_store(own, self.factor_bits, _member_group(d)),
                                          self.means.pop(stream).astype(FACTOR_DTYPE),
                                          own.shape[-2])
                else:
                    A = got[stream]
                self.leader._share(stream, start, A)
            self.pending.pop(0)
            # Copies (once per adopted unit): slices would pin the whole old window.
            self.win_k = mx.contiguous(self.win_k[:, :, n:])
            self.win_v = mx.contiguous(self.win_v[:, :, n:])
            self.win_start += n
            mx.eval(*self.held_arrays())
        # A basis adopted just now lets tokens already in the window be projected.
        if follow_up and self.basis and not self.pending:
            self._publish()

    def _settle_group(self) -> None:
        """Every member adopts what the group published in this forward pass.

        Run by the group's last member after its attention, when every member has
        attended: the adoption each member's next update would do, done earlier (its
        state is not read in between), so the coordinator's raw blocks and projection
        partials and the adopted tokens' windows do not outlive the forward pass.
        Follow-up units are left to the next update, as before.
        """
        for member in self.leader.members:
            member._adopt(follow_up=False)

    def _share(self, stream: str, start: int, A: mx.array) -> None:
        """Leader: append the group's token factor once (stored transposed [b, r, S])."""
        held = self.shared.get(stream)
        have = 0 if held is None else self._shared_tokens(stream)
        if start < have:
            return  # an earlier member of the group already stored it
        if start != have:
            raise RuntimeError(f"xkv group {self.layer.group_id}: token factor of tokens "
                               f"{start}.. arrived after {have} tokens")
        self.shared[stream] = _append(held, _store(A.swapaxes(-1, -2), self.factor_bits, STEP))

    def _shared_tokens(self, stream: str) -> int:
        f = self.shared[stream]
        return f.scales.shape[-1] * f.group_size if isinstance(f, q.Quantized) \
            else f.shape[-1]

    # ---- attention ----
    def _factors(self, stream: str) -> tuple[mx.array, mx.array, mx.array]:
        """Token factor [b, r, T] (compressed tokens only), member factor per KV head
        [b, H, r, hd] and mean per head [b, H, 1, hd], float32."""
        H = self.layer.n_kv_heads
        a = _load(self.leader.shared[stream])[..., :self.win_start]
        own, mean, _ = self.basis[stream]
        b = _load(own)
        bh = b.reshape(b.shape[0], b.shape[1], H, -1).transpose(0, 2, 1, 3)
        mh = mean.astype(mx.float32).reshape(b.shape[0], 1, H, -1).transpose(0, 2, 1, 3)
        return a, bh, mh

    def dense_kv(self, dtype: mx.Dtype | None = None) -> tuple[mx.array, mx.array]:
        """Transient dense keys/values: the factors' tokens (keys rotated back to their
        positions) followed by the window (layers that attend by themselves)."""
        info, Tc = self.layer, self.win_start
        ks, vs = [], []
        if Tc:
            ak, bk, mk = self._factors("keys")
            k = ak.swapaxes(-1, -2)[:, None] @ bk + mk
            if self.pre_rope:
                k = rotate(k, info.rope_dims, info.rope_base, info.rope_traditional,
                           info.rope_scale, 0)
            av, bv, mv = self._factors("values")
            ks.append(k)
            vs.append(av.swapaxes(-1, -2)[:, None] @ bv + mv)
        ks.append(self.win_k.astype(mx.float32))
        vs.append(self.win_v.astype(mx.float32))
        dtype = dtype or self.compute_dtype
        return (mx.concatenate(ks, axis=2).astype(dtype),
                mx.concatenate(vs, axis=2).astype(dtype))

    def attend(self, queries: mx.array, scale: float, mask=None) -> mx.array:
        info = self.layer
        dtype = queries.dtype
        B, Hq, L, hd = queries.shape
        H = info.n_kv_heads
        rep = Hq // H
        qh = (queries.astype(mx.float32) * scale).reshape(B, H, rep, L, hd)
        win_k = self.win_k.astype(mx.float32)[:, :, None]
        win_v = self.win_v.astype(mx.float32)[:, :, None]
        Tc = self.win_start
        scores_w = qh @ win_k.swapaxes(-1, -2)
        if Tc:
            ak, bk, mk = self._factors("keys")
            if self.pre_rope:
                k = (ak.swapaxes(-1, -2)[:, None] @ bk + mk)  # [B, H, Tc, hd], transient
                k = rotate(k, info.rope_dims, info.rope_base, info.rope_traditional,
                           info.rope_scale, 0)
                scores_c = qh @ k[:, :, None].swapaxes(-1, -2)
            else:
                qb = qh @ bk[:, :, None].swapaxes(-1, -2)  # [B, H, rep, L, r]
                scores_c = qb @ ak[:, None, None] + qh @ mk[:, :, None].swapaxes(-1, -2)
            scores = mx.concatenate([scores_c, scores_w], axis=-1)
        else:
            scores = scores_w
        p = masked_softmax(scores, mask)
        out = p[..., Tc:] @ win_v
        if Tc:
            av, bv, mv = self._factors("values")
            pc = p[..., :Tc]
            out = out + (pc @ av.swapaxes(-1, -2)[:, None, None]) @ bv[:, :, None] \
                + pc.sum(axis=-1, keepdims=True) * mv[:, :, None]
        out = out.reshape(B, Hq, L, -1).astype(dtype)
        if info.member_idx == info.group_size - 1:
            self._settle_group()
        return out

    # ---- storage accounting ----
    def _coordinator_arrays(self) -> list[mx.array]:
        """Leader: what the coordinator still holds for the group (published blocks and
        partials not consumed, results not handed to every member): counted once."""
        if self.layer.member_idx != 0 or self.layer.coordinator is None:
            return []
        return self.layer.coordinator.group_arrays(self.layer.group_id)

    def held_arrays(self) -> list[mx.array]:
        out = self._coordinator_arrays()
        out.extend(a for a in (self.win_k, self.win_v) if a is not None)
        for own, mean, _ in self.basis.values():
            out.extend(_arrays(own))
            out.append(mean)
        for factor in self.shared.values():
            out.extend(_arrays(factor))
        out.extend(self.means.values())
        return out

    def accounted_bytes(self) -> int:
        b = max(self.batch_size, 1)
        total = 0
        if self.win_k is not None:
            total += self.win_k.nbytes + self.win_v.nbytes
        for stream, d in (("keys", self.d_k), ("values", self.d_v)):
            if stream in self.basis:
                r = self.basis[stream][2]
                total += _bytes(b * r * d, self.factor_bits, _member_group(d)) + 2 * b * d
            if stream in self.shared:
                r = self.leader.basis[stream][2]
                total += _bytes(b * r * self._shared_tokens(stream), self.factor_bits, STEP)
        total += sum(a.nbytes for a in self._coordinator_arrays())
        return total + sum(m.nbytes for m in self.means.values())

    # ---- save / load ----
    @property
    def state(self):
        arrays: list[Any] = [self.win_k, self.win_v]
        for stream in STREAMS:
            if stream in self.basis:
                own, mean, _ = self.basis[stream]
                arrays.extend(_arrays(own))
                arrays.append(mean)
            if stream in self.shared:
                arrays.extend(_arrays(self.shared[stream]))
        return arrays

    @state.setter
    def state(self, v) -> None:
        v = list(v)
        self.win_k, self.win_v = v[0], v[1]
        i = 2

        def take(group):
            nonlocal i
            if self.factor_bits is None:
                i += 1
                return v[i - 1]
            i += 3
            return q.Quantized(*v[i - 3:i], self.factor_bits, group)

        for stream, d in (("keys", self.d_k), ("values", self.d_v)):
            if stream in self.basis:
                own = take(_member_group(d))
                self.basis[stream] = (own, v[i], self.basis[stream][2])
                i += 1
            if stream in self.shared:
                self.shared[stream] = take(STEP)

    @property
    def meta_state(self):
        ranks = ";".join(f"{s}:{self.basis[s][2]}" for s in STREAMS if s in self.basis)
        shared = ";".join(s for s in STREAMS if s in self.shared)
        return (*CompressedCache.meta_state.fget(self), ranks, shared)

    @meta_state.setter
    def meta_state(self, v) -> None:
        CompressedCache.meta_state.fset(self, v)
        # Units published but not adopted are published again to the fresh coordinator.
        self.pending, self.means = [], {}
        self.basis = {}
        for item in filter(None, v[3].split(";")):
            stream, r = item.split(":")
            self.basis[stream] = (None, None, int(r))
        self.shared = {s: None for s in filter(None, v[4].split(";"))}


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
