"""``xkv``: cross-layer SVD of the KV cache (xKV, Chang et al., arXiv 2503.18893).

Adjacent layers are grouped (``xkv_group_size`` = G). For every complete block of
``xkv_block`` tokens, each member publishes its keys (before RoPE by default) and
values, ``[b, S, D]`` with D = n_kv_heads * head_dim and the per-column mean
removed, to the model's shared ``XKVCoordinator``. One truncated SVD of the
concatenation ``[S, G*D]`` per stream gives a token factor ``A`` [S, r] shared by
the group and a factor ``B_i`` [r, D] per member: ``X_i ~ A @ B_i + mean_i``.

Each cache holds only its compressed form: its own member factors and means per
block, a full-precision window of the tokens not yet compressed, and (the group
leader, member 0, only) the shared token factors, so each is counted once per
model. Other members read the shared factors through their link to the leader.

Timeline: mlx_lm calls layers 0..L-1 in order. When a block is complete, every
member publishes it in the same forward pass; the block stays in every member's
window and is moved to factors on the member's next update, when all members have
published and the basis exists. Attention rebuilds keys and values from the
factors into a transient tensor (keys re-rotated for their positions) and runs
the dense kernel over them and the window.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..config import KVCacheConfig, config_error
from ..ops import quantize as q
from ..ops.attention import sdpa
from ..ops.rope import rotate, unrotate
from .base import CompressedCache, LayerInfo, require_int
from .xkv_coordinator import XKVCoordinator

FACTOR_DTYPE = mx.float16  # unquantized factors and means are stored in float16
STREAMS = ("keys", "values")


def _factor_group(n: int) -> int:
    """Quantization group along an axis of length ``n`` (64, else 32)."""
    return 64 if n % 64 == 0 else 32


def _store(x: mx.array, bits: int | None) -> Any:
    """Keep a factor as float16, or quantized along its last axis."""
    if bits is None:
        return x.astype(FACTOR_DTYPE)
    return q.quantize(x.astype(mx.float32), bits, _factor_group(x.shape[-1]))


def _load(x: Any) -> mx.array:
    if isinstance(x, q.Quantized):
        return q.dequantize(x, mx.float32)
    return x.astype(mx.float32)


def _arrays(x: Any) -> list[mx.array]:
    return x.arrays if isinstance(x, q.Quantized) else [x]


def _bytes(n_values: int, bits: int | None, axis_len: int) -> int:
    if bits is None:
        return 2 * n_values
    return q.quantized_bytes(n_values, bits, _factor_group(axis_len))


class XKVCache(CompressedCache):
    """One layer's share of a group's cross-layer SVD, plus a full-precision window."""

    method = "xkv"

    def __init__(self, config: KVCacheConfig, layer: LayerInfo | None = None) -> None:
        super().__init__(config, layer)
        info = self.layer
        self.block = config.xkv_block
        self.window = config.get("window", 0)
        self.bits = config.xkv_factor_bits
        self.ranks = {"keys": config.xkv_rank_k, "values": config.xkv_rank_v}
        self.pre_rope = bool(config.xkv_pre_rope) and info.rope_dims is not None
        self.d_k = info.n_kv_heads * info.head_dim
        self.d_v = info.n_kv_heads * info.v_head_dim
        for name, d in (("xkv_rank_k", self.d_k), ("xkv_rank_v", self.d_v)):
            rank = getattr(config, name)
            if rank is not None and rank > info.group_size * d:
                raise config_error(
                    name, rank, f"<= G*D = {info.group_size}*{d} = {info.group_size * d} "
                    f"for the group of layer {info.layer_idx}")
        if self.bits is not None:
            for d in (self.d_k, self.d_v):
                if d % 32:
                    raise config_error(
                        "xkv_factor_bits", self.bits,
                        f"None for layer {info.layer_idx}: its width D={d} is not a "
                        "multiple of 32, the smallest quantization group")
        if info.coordinator is None:
            info.coordinator = XKVCoordinator(max_ctx=config.max_ctx)
        self.leader: XKVCache = self
        self.win_k: mx.array | None = None
        self.win_v: mx.array | None = None
        self.win_start = 0  # position of the window's first token (= tokens compressed)
        self.pending: list[tuple[int, int]] = []  # (start, n) published, not adopted
        # Compressed blocks: start, n, and per stream (own factor, mean, rank).
        self.blocks: list[dict[str, Any]] = []
        # Leader only: (stream, start) -> shared token factor, stored transposed [b, r, S].
        self.shared: dict[tuple[str, int], Any] = {}
        # Column means of published blocks (tiny), kept until the block is adopted.
        self.means: dict[tuple[str, int], mx.array] = {}
        self.compute_dtype = mx.float32

    # ---- configuration ----
    @classmethod
    def validate_config(cls, config: KVCacheConfig) -> None:
        require_int("xkv_group_size", config.xkv_group_size, minimum=1)
        require_int("xkv_block", config.xkv_block, minimum=1)
        require_int("window", config.get("window", 0), minimum=0)
        for name in ("xkv_rank_k", "xkv_rank_v"):
            rank = getattr(config, name)
            if rank is None:
                continue
            require_int(name, rank, minimum=1)
            if rank > config.xkv_block:
                raise config_error(name, rank,
                                   f"<= xkv_block={config.xkv_block} (tokens per SVD)")
        if config.xkv_factor_bits is not None:
            require_int("xkv_factor_bits", config.xkv_factor_bits, q.AFFINE_BITS)
            if config.xkv_block % 32:
                raise config_error(
                    "xkv_block", config.xkv_block,
                    "a multiple of 32 when xkv_factor_bits is set (the token factor is "
                    "quantized in groups along the tokens of a block)")
        if not isinstance(config.xkv_pre_rope, bool):
            raise config_error("xkv_pre_rope", config.xkv_pre_rope, "True or False")
        if config.xkv_grouping not in ("contiguous", "cka"):
            raise config_error("xkv_grouping", config.xkv_grouping,
                               "'contiguous' or 'cka'")

    @classmethod
    def assign_roles(cls, layers: list[LayerInfo], config: KVCacheConfig, model: Any) -> None:
        if config.xkv_grouping == "cka":
            raise NotImplementedError(
                "KVCacheConfig.xkv_grouping='cka' is not implemented in this build; "
                "use 'contiguous'")
        G = config.xkv_group_size
        coordinator = XKVCoordinator(max_ctx=config.max_ctx)
        n = len(layers)
        for i, info in enumerate(layers):
            gid = i // G
            info.group_id, info.member_idx = gid, i % G
            info.group_size = min(G, n - gid * G)  # a shorter last group is fine
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

    def _publish(self) -> None:
        """Publish every complete block beyond the kept recent ``window``."""
        info, coord = self.layer, self.layer.coordinator
        nxt = self.win_start + sum(n for _, n in self.pending)
        while self.offset - nxt >= self.block + self.window:
            i = nxt - self.win_start
            k = self.win_k[:, :, i:i + self.block].astype(mx.float32)
            v = self.win_v[:, :, i:i + self.block].astype(mx.float32)
            if self.pre_rope:
                k = unrotate(k, info.rope_dims, info.rope_base, info.rope_traditional,
                             info.rope_scale, nxt)
            for stream, x in (("keys", k), ("values", v)):
                B, H, S, hd = x.shape
                x = x.transpose(0, 2, 1, 3).reshape(B, S, H * hd)
                mean = x.mean(axis=1, keepdims=True)
                self.means[(stream, nxt)] = mean
                coord.publish_member_keys(info.group_id, info.member_idx, nxt, S, x - mean,
                                          stream=stream)
            self.pending.append((nxt, self.block))
            nxt += self.block

    def _adopt(self) -> None:
        """Move published blocks whose basis exists from the window to factors."""
        info, coord = self.layer, self.layer.coordinator
        while self.pending:
            start, n = self.pending[0]
            got = {}
            for stream in STREAMS:
                got[stream] = coord.get_shared_basis(
                    info.group_id, start, info.group_size, self.ranks[stream],
                    self.config.xkv_energy_threshold, stream=stream)
                if got[stream] is None:
                    if stream == "values":
                        raise RuntimeError(
                            f"xkv layer {info.layer_idx}: key basis of block {start} "
                            "ready without its value basis")
                    return
            record: dict[str, Any] = {"start": start, "n": n}
            for stream in STREAMS:
                A, Bs, _ = got[stream]
                self.leader._share(stream, start, A)
                own = Bs[info.member_idx]
                record[stream] = (_store(own, self.bits),
                                  self.means.pop((stream, start)).astype(FACTOR_DTYPE),
                                  own.shape[-2])
            self.blocks.append(record)
            self.pending.pop(0)
            self.win_k, self.win_v = self.win_k[:, :, n:], self.win_v[:, :, n:]
            self.win_start += n
            mx.eval(*self.held_arrays())

    def _share(self, stream: str, start: int, A: mx.array) -> None:
        """Leader: keep the group's token factor once (transposed [b, r, S])."""
        if (stream, start) not in self.shared:
            self.shared[(stream, start)] = _store(A.swapaxes(-1, -2), self.bits)

    # ---- attention ----
    def dense_kv(self, dtype: mx.Dtype | None = None) -> tuple[mx.array, mx.array]:
        """Transient dense keys/values: blocks rebuilt from factors, then the window."""
        dtype = dtype or self.compute_dtype
        info = self.layer
        B, H = self.win_k.shape[0], info.n_kv_heads
        parts: dict[str, list[mx.array]] = {"keys": [], "values": []}
        for rec in self.blocks:
            for stream in STREAMS:
                own, mean, _ = rec[stream]
                a = _load(self.leader.shared[(stream, rec["start"])]).swapaxes(-1, -2)
                parts[stream].append(a @ _load(own) + mean.astype(mx.float32))
        out = []
        for stream, win, hd in (("keys", self.win_k, info.head_dim),
                                ("values", self.win_v, info.v_head_dim)):
            if not parts[stream]:
                out.append(win.astype(dtype))
                continue
            x = mx.concatenate(parts[stream], axis=1) if len(parts[stream]) > 1 \
                else parts[stream][0]
            x = x.reshape(B, x.shape[1], H, hd).transpose(0, 2, 1, 3)
            if stream == "keys" and self.pre_rope:
                x = rotate(x, info.rope_dims, info.rope_base, info.rope_traditional,
                           info.rope_scale, 0)
            out.append(mx.concatenate([x.astype(dtype), win.astype(dtype)], axis=2))
        return out[0], out[1]

    def attend(self, queries: mx.array, scale: float, mask=None) -> mx.array:
        keys, values = self.dense_kv(mx.float32 if queries.dtype == mx.float32
                                     else queries.dtype)
        return sdpa(queries, keys, values, scale, mask)

    # ---- storage accounting ----
    def held_arrays(self) -> list[mx.array]:
        out = [a for a in (self.win_k, self.win_v) if a is not None]
        for rec in self.blocks:
            for stream in STREAMS:
                own, mean, _ = rec[stream]
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
        for rec in self.blocks:
            for stream, d in (("keys", self.d_k), ("values", self.d_v)):
                r = rec[stream][2]
                total += _bytes(b * r * d, self.bits, d) + 2 * b * d
        for stream, start in self.shared:
            r = self._shared_rank(stream, start)
            total += _bytes(b * r * self.block, self.bits, self.block)
        return total + sum(m.nbytes for m in self.means.values())

    def _shared_rank(self, stream: str, start: int) -> int:
        f = self.shared[(stream, start)]
        return (f.scales if isinstance(f, q.Quantized) else f).shape[-2]

    # ---- save / load ----
    @property
    def state(self):
        arrays: list[Any] = [self.win_k, self.win_v]
        for rec in self.blocks:
            for stream in STREAMS:
                own, mean, _ = rec[stream]
                arrays.extend(_arrays(own))
                arrays.append(mean)
        for key in sorted(self.shared):
            arrays.extend(_arrays(self.shared[key]))
        return arrays

    @state.setter
    def state(self, v) -> None:
        v = list(v)
        self.win_k, self.win_v = v[0], v[1]
        i = 2
        width = 1 if self.bits is None else 3

        def take():
            nonlocal i
            part = v[i:i + width]
            i += width
            if self.bits is None:
                return part[0]
            return q.Quantized(*part, self.bits, _factor_group(
                part[0].shape[-1] * 32 // self.bits))

        for rec in self.blocks:
            for stream in STREAMS:
                own = take()
                mean = v[i]
                i += 1
                rec[stream] = (own, mean, rec[stream][2])
        for key in sorted(self.shared):
            self.shared[key] = take()

    @property
    def meta_state(self):
        blocks = ";".join(f"{r['start']}:{r['n']}:{r['keys'][2]}:{r['values'][2]}"
                          for r in self.blocks)
        shared = ";".join(f"{s}:{t}" for s, t in sorted(self.shared))
        return (*super().meta_state, str(self.win_start), blocks, shared)

    @meta_state.setter
    def meta_state(self, v) -> None:
        self.offset, self.batch_size, self.win_start = int(v[0]), int(v[1]), int(v[2])
        self.blocks = []
        for item in filter(None, v[3].split(";")):
            start, n, rk, rv = (int(x) for x in item.split(":"))
            self.blocks.append({"start": start, "n": n, "keys": (None, None, rk),
                                "values": (None, None, rv)})
        self.shared = {}
        for item in filter(None, v[4].split(";")):
            stream, start = item.split(":")
            self.shared[(stream, int(start))] = None


def link_groups(caches: list[CompressedCache]) -> None:
    """Point every member of a group at its leader (member 0), who holds the shared
    token factors."""
    leaders = {c.layer.group_id: c for c in caches
               if isinstance(c, XKVCache) and c.layer.member_idx == 0}
    for c in caches:
        if isinstance(c, XKVCache):
            if c.layer.group_id not in leaders:
                raise ValueError(f"xkv group {c.layer.group_id} has no member 0")
            c.leader = leaders[c.layer.group_id]
