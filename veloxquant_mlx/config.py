"""``KVCacheConfig``: one frozen dataclass with every method's options.

Options that several methods share have one plain name (``bits``, ``group_size``,
``window``); options that belong to one method carry its prefix (``xkv_rank_k``).
The config is validated when it is built: general checks here, method-specific
checks in the method's own ``validate_config`` (found through the registry).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

# Sentinel for "use the method's own default" on options whose meaning is shared.
DEFAULT = None


class ConfigError(ValueError):
    """A config field holds a value the method does not allow."""


def config_error(name: str, value: Any, allowed: str) -> ConfigError:
    """Build the uniform error that names the field, the value and what is allowed."""
    return ConfigError(f"KVCacheConfig.{name}={value!r} is not allowed: {allowed}")


@dataclass(frozen=True)
class KVCacheConfig:
    """How each layer's KV cache is compressed.

    Shared options
    --------------
    method: registered method name (``veloxquant methods`` lists them).
    bits: quantization bits of codes (affine: 2,3,4,5,6,8; kivi: 2,4).
    group_size: quantization group size (affine: 32, 64, 128; kivi: 32 by default).
    window: recent tokens kept in full precision (affine, kivi, xkv, minicache,
        xquant) or the recent-token window (streaming, snapkv observation window);
        ``None`` means the method's default.
    window_dtype: dtype of the full-precision window, ``"float16"``, ``"bfloat16"``,
        ``"float32"`` or ``None`` (the model's compute dtype).
    max_ctx: token budget per layer (and per xKV group); writing beyond it raises.

    xKV (cross-layer SVD)
    ---------------------
    xkv_group_size: adjacent layers sharing one SVD (G).
    xkv_rank_k / xkv_rank_v: ranks of the key / value factors (``None``: from
        ``xkv_energy_threshold``).
    xkv_energy_threshold: fraction of squared singular mass kept when no rank is given.
    xkv_block: tokens of the group's basis block (one joint SVD); later tokens are
        projected onto that basis in steps of 32; tokens not yet compressed stay in
        the full-precision window.
    xkv_factor_bits: quantize the factors to this many bits (``None``: keep float).
    xkv_pre_rope: compress keys before RoPE (the cache undoes and re-applies it).
    xkv_grouping: ``"contiguous"`` or ``"cka"`` (layers grouped by measured similarity).

    KIVI: uses ``bits``, ``group_size`` and ``window`` (the residual length R).

    StreamingLLM
    ------------
    streaming_sink: first tokens always kept (attention sinks).

    SnapKV
    ------
    snapkv_capacity: prompt tokens kept per KV head (besides the observation window).
    snapkv_kernel: pooling kernel over the token axis.
    snapkv_pooling: ``"max"`` or ``"avg"``.

    MiniCache
    ---------
    minicache_start_layer / minicache_end_layer: merged layer range (``None``: from
        the middle of the model to its end).
    minicache_t: SLERP interpolation parameter in [0, 1].
    minicache_retention_threshold: fraction of tokens kept unmerged (most distant
        directions).
    minicache_bits: quantize the merged directions to this many bits (``None``: float).
    minicache_retention: ``"fraction"`` (the most distant fraction of tokens) or
        ``"paper"`` (distance below ``d_min + (d_max - d_min) * threshold``).

    XQuant
    ------
    xquant_latent: for GQA models cache X in the latent space of the SVD of
        the K/V projection weights.
    xquant_anchor_bits: bits of the XQuant-CL anchor layer (``None``: 8).
    """

    method: str = "none"
    bits: int | None = DEFAULT
    group_size: int | None = DEFAULT
    window: int | None = DEFAULT
    window_dtype: str | None = "float16"
    max_ctx: int = 131072

    xkv_group_size: int = 4
    xkv_rank_k: int | None = None
    xkv_rank_v: int | None = None
    xkv_energy_threshold: float = 0.95
    xkv_block: int = 1024
    xkv_factor_bits: int | None = None
    xkv_pre_rope: bool = True
    xkv_grouping: str = "contiguous"

    streaming_sink: int = 4

    snapkv_capacity: int = 1024
    snapkv_kernel: int = 7
    snapkv_pooling: str = "max"

    minicache_start_layer: int | None = None
    minicache_end_layer: int | None = None
    minicache_t: float = 0.5
    minicache_retention_threshold: float = 0.05
    minicache_bits: int | None = None
    minicache_retention: str = "fraction"

    xquant_latent: bool = True
    xquant_anchor_bits: int | None = None

    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        from .registry import get_method

        if not isinstance(self.method, str):
            raise config_error("method", self.method, "a method name string")
        cls = get_method(self.method)
        self._validate_general()
        cls.validate_config(self)

    def _validate_general(self) -> None:
        for name in ("bits", "group_size", "window", "max_ctx"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise config_error(name, value, "an integer")
            if value < 0 or (name != "window" and value == 0):
                raise config_error(name, value, "a positive integer")
        if self.window_dtype not in (None, "float16", "bfloat16", "float32"):
            raise config_error(
                "window_dtype", self.window_dtype,
                "one of 'float16', 'bfloat16', 'float32' or None",
            )
        if not isinstance(self.xkv_energy_threshold, (int, float)) or not (
            0.0 < self.xkv_energy_threshold <= 1.0
        ) or math.isnan(self.xkv_energy_threshold):
            raise config_error(
                "xkv_energy_threshold", self.xkv_energy_threshold,
                "a number in (0, 1]",
            )

    def get(self, name: str, default: Any) -> Any:
        """The value of a shared option, or ``default`` when it is left unset."""
        value = getattr(self, name)
        return default if value is None else value

    def replace(self, **changes: Any) -> KVCacheConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the fields (JSON-serializable), for saved caches and reports."""
        out = dataclasses.asdict(self)
        out.pop("extra", None)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVCacheConfig:
        """Rebuild a config from :meth:`to_dict`; unknown keys are an error."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(
                f"unknown KVCacheConfig field(s) {unknown}; known fields: {sorted(names)}"
            )
        return cls(**data)

    @classmethod
    def from_string(cls, spec: str) -> KVCacheConfig:
        """Parse ``"method:key=value,key=value"`` (the CLI's and sweep's syntax).

        Keys may drop the method prefix: ``"xkv:rank_k=32"`` sets ``xkv_rank_k``.
        """
        method, _, rest = spec.partition(":")
        method = method.strip()
        kwargs: dict[str, Any] = {}
        names = {f.name: f for f in dataclasses.fields(cls) if f.name != "extra"}
        for item in filter(None, (p.strip() for p in rest.split(","))):
            key, sep, raw = item.partition("=")
            if not sep:
                raise ConfigError(f"option {item!r} in {spec!r} is not of the form key=value")
            key = key.strip()
            prefix = method.split("_")[0] + "_"
            if key not in names and prefix + key in names:
                key = prefix + key
            if key not in names:
                raise ConfigError(
                    f"unknown option {key!r} in {spec!r}; known fields: {sorted(names)}"
                )
            kwargs[key] = _parse_value(raw.strip())
        return cls(method=method, **kwargs)


def _parse_value(raw: str) -> Any:
    low = raw.lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw
