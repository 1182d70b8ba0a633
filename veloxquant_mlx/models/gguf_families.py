"""One converter per GGUF model family: tensor names, ``config.json`` and llama.cpp's
layout undone, onto the matching mlx_lm model.

llama.cpp's ``convert_hf_to_gguf.py`` writes each family its own way:

- ``llama`` (Mistral's files say ``llama`` too): q/k rows permuted for interleaved
  rope pairs. The rows are kept and the model uses ``rope_traditional=True``, which
  computes the same logits as the unpermuted rows with the default rope, and is the
  layout the embedded model's saved caches hold. Llama 3.1-style rope scaling comes
  as a ``rope_freqs`` tensor, turned back into mlx_lm's ``llama3`` settings.
- ``qwen2``: q/k/v biases; ``qwen3``: per-head q/k RMS norms and its own head_dim.
- ``phi3``: fused ``attn_qkv`` (or q/k/v apart, fused here) and ``ffn_up`` holding
  gate and up; partial rope; longrope factors as ``rope_factors_*`` tensors.
- ``gemma3``: every norm weight stored with +1 added; sliding-window layers with
  every 6th global (llama.cpp's fixed pattern) and their own rope base; rope scaling
  only on the global layers; tied embeddings.

None of them permutes rows but llama (the others use llama.cpp's NEOX rope, which
is mlx_lm's default).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from veloxquant_mlx.models.gguf_read import (
    GGUFError,
    check_dtype,
    meta_float,
    meta_int,
    meta_str,
    meta_strings,
    where,
)

Weights = dict[str, mx.array]

_LLAMA_BLOCKS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GEMMA3_BLOCKS = {
    **{k: v for k, v in _LLAMA_BLOCKS.items() if k != "ffn_norm"},
    **_QK_NORMS,
    # Gemma norms the attention output and the MLP input and output apart.
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_PHI3_BLOCKS = {
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_up": "mlp.gate_up_proj",  # gate rows first, then up (llama.cpp's fused SwiGLU)
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|scales|biases|bias)$")
_TOP_RE = re.compile(r"^([a-z_]+)\.(weight|scales|biases|bias)$")


class Meta:
    """The ``{arch}.*`` metadata of one file, with errors that name the key."""

    def __init__(self, meta: dict[str, Any]) -> None:
        self.meta = meta
        self.arch = str(meta.get("general.architecture"))

    def get(self, key: str, default: Any = ...) -> Any:
        v = self.meta.get(f"{self.arch}.{key}")
        if isinstance(v, mx.array) and v.ndim == 0:
            v = v.item()  # mx.load's scalars; arrays (per-layer values) stay arrays
        if v is None:
            if default is ...:
                raise GGUFError(
                    f"{where(self.meta)}: metadata lacks '{self.arch}.{key}', needed for "
                    "the config"
                )
            return default
        return v

    def get_int(self, key: str, default: Any = ..., lo: int = 1) -> Any:
        """An integer of at least ``lo`` (sizes and counts: 1), or ``default``."""
        v = self.meta.get(f"{self.arch}.{key}")
        if isinstance(v, mx.array) and v.ndim >= 1:
            raise GGUFError(
                f"{where(self.meta)}: '{self.arch}.{key}' is a per-layer array "
                f"({v.tolist()}); this converter takes one value for all layers"
            )
        if v is None and default is ...:
            self.get(key)  # the error that names the missing key
        return meta_int(self.meta, f"{self.arch}.{key}", default, lo=lo)

    def get_float(self, key: str, default: Any = ...) -> Any:
        """A finite number, or ``default``."""
        if self.meta.get(f"{self.arch}.{key}") is None and default is ...:
            self.get(key)
        return meta_float(self.meta, f"{self.arch}.{key}", default)


@dataclass(frozen=True)
class Family:
    """How one GGUF architecture becomes an mlx_lm model."""

    arch: str
    model_type: str
    blocks: dict[str, str]  # GGUF block tensor -> module under model.layers.N
    config: Callable[[Meta, dict[str, Any]], None]  # adds the family's config entries
    undo: Callable[[Weights, dict[str, Any], Meta], Weights] | None = None
    extra: frozenset[str] = field(default_factory=frozenset)  # tensors ``undo`` consumes

    def tensor_name(self, name: str) -> str:
        """mlx_lm name of a GGUF tensor (``blk.3.attn_q.weight`` ->
        ``model.layers.3.self_attn.q_proj.weight``); quantized suffixes are kept."""
        if m := _BLOCK_RE.match(name):
            layer, part, suffix = m.groups()
            if part in self.blocks:
                return f"model.layers.{layer}.{self.blocks[part]}.{suffix}"
        elif m := _TOP_RE.match(name):
            part, suffix = m.groups()
            if part in _TOP_NAMES:
                return f"{_TOP_NAMES[part]}.{suffix}"
        allowed = ", ".join([*_TOP_NAMES, *(f"blk.N.{p}" for p in self.blocks)])
        raise GGUFError(
            f"GGUF tensor {name!r} has no {self.arch} counterpart; known: {allowed}"
        )

    def check_names(self, names: list[str]) -> None:
        """Raise for a tensor this family cannot place, before any tensor is read."""
        for name in names:
            if _part(name) not in self.extra:
                self.tensor_name(name)


def _part(name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``attn_q``; ``rope_freqs.weight`` -> ``rope_freqs``."""
    m = _BLOCK_RE.match(name) or _TOP_RE.match(name)
    return m.groups()[-2] if m else name


# --- config entries ---------------------------------------------------------------


def base_config(meta: dict[str, Any], tied: bool) -> dict[str, Any]:
    """The entries every family's mlx_lm ``ModelArgs`` shares, from ``{arch}.*``."""
    m = Meta(meta)
    hidden, heads = m.get_int("embedding_length"), m.get_int("attention.head_count")
    vocab = m.get_int("vocab_size", None)
    if vocab is None:
        tokens = meta_strings(meta, "tokenizer.ggml.tokens")
        if not tokens:
            raise GGUFError(f"GGUF metadata has neither {m.arch}.vocab_size nor "
                            "tokenizer.ggml.tokens, which give the vocabulary size")
        vocab = len(tokens)
    config = {
        "hidden_size": hidden,
        "num_hidden_layers": m.get_int("block_count"),
        "intermediate_size": m.get_int("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": m.get_int("attention.head_count_kv", heads),
        "head_dim": m.get_int("attention.key_length", hidden // heads),
        "rms_norm_eps": m.get_float("attention.layer_norm_rms_epsilon", 1e-5),
        "vocab_size": vocab,
        "max_position_embeddings": m.get_int("context_length", 2048),
        "rope_theta": m.get_float("rope.freq_base", 10000.0),
        "tie_word_embeddings": tied,
    }
    values = m.get_int("attention.value_length", config["head_dim"])
    if values != config["head_dim"]:
        raise GGUFError(
            f"GGUF {m.arch}.attention.value_length={values} differs from key_length="
            f"{config['head_dim']}; mlx_lm's {m.arch} takes one head size"
        )
    for end in ("eos", "bos"):
        if f"tokenizer.ggml.{end}_token_id" in meta:
            config[f"{end}_token_id"] = meta_int(meta, f"tokenizer.ggml.{end}_token_id")
    return config


def _scaling_type(m: Meta) -> str | None:
    """``{arch}.rope.scaling.type``, ``None`` when absent or llama.cpp's "no scaling"."""
    from gguf import RopeScalingType

    kind = meta_str(m.meta, f"{m.arch}.rope.scaling.type")
    return None if kind == RopeScalingType.NONE.value else kind


def _rope_scaling(m: Meta) -> dict[str, Any] | None:
    kind = _scaling_type(m)
    if kind is None:
        return None
    if kind == "linear":
        return {"type": "linear", "factor": m.get_float("rope.scaling.factor")}
    raise GGUFError(
        f"GGUF {m.arch}.rope.scaling.type={kind!r} is not supported; allowed: absent, "
        "no scaling, 'linear' (and Llama 3's rope_freqs tensor)"
    )


def _rope_dims(m: Meta, config: dict[str, Any]) -> int:
    return m.get_int("rope.dimension_count", config["head_dim"])


def _whole_head_rope(m: Meta, config: dict[str, Any]) -> None:
    dims = _rope_dims(m, config)
    if dims != config["head_dim"]:
        raise GGUFError(
            f"GGUF {m.arch}.rope.dimension_count={dims} is not the head size "
            f"{config['head_dim']}; mlx_lm's {m.arch} rotates whole heads"
        )


def _head_dim_from_width(m: Meta, config: dict[str, Any]) -> None:
    # These mlx_lm models derive the head size from hidden_size / heads.
    derived = config["hidden_size"] // config["num_attention_heads"]
    if config["head_dim"] != derived:
        raise GGUFError(
            f"GGUF {m.arch}.attention.key_length={config['head_dim']} is not "
            f"embedding_length / head_count = {derived}, which mlx_lm's {m.arch} assumes"
        )


def _llama_config(m: Meta, config: dict[str, Any]) -> None:
    config["head_dim"] = m.get_int("attention.key_length", _rope_dims(m, config))
    _whole_head_rope(m, config)
    # llama.cpp's converter permutes q/k rows into the interleaved-pair layout.
    config.update(rope_traditional=True, rope_scaling=_rope_scaling(m))


def _qwen2_config(m: Meta, config: dict[str, Any]) -> None:
    _head_dim_from_width(m, config)
    _whole_head_rope(m, config)
    config["rope_scaling"] = _rope_scaling(m)


def _qwen3_config(m: Meta, config: dict[str, Any]) -> None:
    _whole_head_rope(m, config)
    config["rope_scaling"] = _rope_scaling(m)


def _phi3_config(m: Meta, config: dict[str, Any]) -> None:
    _head_dim_from_width(m, config)
    config["partial_rotary_factor"] = _rope_dims(m, config) / config["head_dim"]
    # Longrope comes as the rope_factors_long/short tensors (``_phi3_undo``).
    if _scaling_type(m) not in (None, "longrope", "su"):
        raise GGUFError(
            f"GGUF phi3.rope.scaling.type={_scaling_type(m)!r} is not supported; allowed: "
            "absent, no scaling, 'longrope' (with rope_factors_long/short tensors)"
        )


# Gemma 3 in llama.cpp: every 6th layer global, the others local with base 10000.
_GEMMA3_PATTERN, _GEMMA3_LOCAL_BASE = 6, 10000.0


def _gemma3_pattern(m: Meta, layers: int) -> int:
    """Layers per global layer: llama.cpp's 6, or the file's per-layer flags."""
    flags = m.get("attention.sliding_window_pattern", None)
    if flags is None:
        return _GEMMA3_PATTERN if m.get_int("attention.sliding_window", None, lo=0) else 1
    if not isinstance(flags, mx.array) or flags.ndim != 1:
        return m.get_int("attention.sliding_window_pattern")
    sliding = [bool(f) for f in flags.tolist()]
    period = next((i + 1 for i, s in enumerate(sliding) if not s), len(sliding) + 1)
    if period > layers or sliding != [(i + 1) % period != 0 for i in range(layers)]:
        raise GGUFError(
            f"GGUF gemma3.attention.sliding_window_pattern={sliding} is not one global "
            "layer every N layers, the only pattern mlx_lm's gemma3_text builds"
        )
    return period


def _gemma3_config(m: Meta, config: dict[str, Any]) -> None:
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if m.get_float(key, None):
            raise GGUFError(
                f"GGUF gemma3.{key}={m.get(key)}: mlx_lm's gemma3_text has no "
                "soft-capping, so the converted model would differ; allowed: absent or 0"
            )
    _whole_head_rope(m, config)
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    # llama.cpp's own rule: the 27B model (62 layers) scales queries by the width per
    # head; the others by head_dim. A file's attention.scale overrides both.
    scalar_ = config["hidden_size"] / heads if layers == 62 else config["head_dim"]
    if (scale := m.get_float("attention.scale", None)) is not None:
        if scale <= 0:
            raise GGUFError(f"GGUF gemma3.attention.scale={scale}; expected a positive number")
        scalar_ = scale**-2
    config.update(
        query_pre_attn_scalar=scalar_,
        sliding_window=m.get_int("attention.sliding_window", config["max_position_embeddings"]),
        sliding_window_pattern=_gemma3_pattern(m, layers),
        rope_local_base_freq=m.get_float("rope.freq_base_swa", _GEMMA3_LOCAL_BASE),
        rope_scaling=_rope_scaling(m),  # mlx_lm applies it to the global layers only
    )
    tokens = meta_strings(m.meta, "tokenizer.ggml.tokens") or []
    if "<end_of_turn>" in tokens and "eos_token_id" in config:
        # A chat turn ends with <end_of_turn>, which generation must stop at too.
        config["eos_token_id"] = [config["eos_token_id"], tokens.index("<end_of_turn>")]


# --- layouts undone (on GGUF names, before renaming) ----------------------------


def llama3_factors(dims: int, base: float, scaling: dict[str, Any]) -> np.ndarray:
    """Llama 3.1's per-frequency wavelength factors, as llama.cpp stores them in
    ``rope_freqs``: 1 for short wavelengths, ``factor`` for long ones, smooth between."""
    factor, orig = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelen = 2 * math.pi * base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    smooth = (orig / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < orig / high, 1.0, np.where(wavelen > orig / low, factor, mid))


def _llama3_scaling(factors: mx.array, config: dict[str, Any], m: Meta) -> dict[str, Any]:
    """mlx_lm's ``llama3`` rope settings that give the file's ``rope_freqs`` exactly."""
    got = np.array(factors.astype(mx.float32), dtype=np.float64)
    scaling = {
        "rope_type": "llama3",
        "factor": float(got.max()),
        # Llama 3.1 / 3.2 / 3.3 all use these; a file that does not is refused below.
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": m.get_int("rope.scaling.original_context_length", 8192),
    }
    want = llama3_factors(config["head_dim"], config["rope_theta"], scaling)
    if got.shape != want.shape or not np.allclose(got, want, rtol=1e-4):
        raise GGUFError(
            "GGUF tensor rope_freqs.weight is not Llama 3's rope scaling with factor "
            f"{scaling['factor']}, low/high frequency factors 1 and 4 and original "
            f"context {scaling['original_max_position_embeddings']}; only that is taken"
        )
    return scaling


def _llama_undo(weights: Weights, config: dict[str, Any], m: Meta) -> Weights:
    if "rope_freqs.weight" in weights:
        weights = dict(weights)
        config["rope_scaling"] = _llama3_scaling(weights.pop("rope_freqs.weight"), config, m)
    return weights


def _gemma3_undo(weights: Weights, config: dict[str, Any], m: Meta) -> Weights:
    # llama.cpp stores Gemma's norm weights w as 1 + w; mlx_lm adds the 1 itself.
    out = dict(weights)
    for name, w in weights.items():
        if name.endswith("norm.weight"):
            if f"{name.removesuffix('.weight')}.scales" in weights:
                raise GGUFError(f"GGUF norm tensor {name!r} is quantized; expected F32/F16")
            out[name] = w.astype(mx.float32) - 1.0
    return out


def _group_bits(name: str, w: mx.array, scales: mx.array, n_in: int) -> tuple[int, int]:
    """Group size and bits of an MLX quantized triple whose rows take ``n_in`` inputs
    (the width the metadata gives): a file whose tensors do not fit it is refused."""
    groups, words = scales.shape[-1] if scales.ndim else 0, w.shape[-1] if w.ndim else 0
    group = n_in // groups if groups else 0
    bits = words * 32 // n_in if n_in else 0
    if not groups or group * groups != n_in or bits not in (2, 3, 4, 5, 6, 8) \
            or bits * n_in != words * 32 or w.ndim != 2 or scales.shape[:-1] != w.shape[:-1]:
        raise GGUFError(
            f"GGUF tensor {name!r} ({words} packed words, {groups} groups per row) does not "
            f"fit rows of {n_in} inputs, the width the metadata gives"
        )
    return group, bits


def _dense(weights: Weights, base: str, n_in: int) -> mx.array:
    """``base``'s weight as a dense array (dequantized from its MLX triple if need be)."""
    w = weights.pop(f"{base}.weight")
    if f"{base}.scales" not in weights:
        return w.astype(mx.float32)
    scales, biases = weights.pop(f"{base}.scales"), weights.pop(f"{base}.biases")
    group, bits = _group_bits(base, w, scales, n_in)
    return mx.dequantize(w, scales, biases, group_size=group, bits=bits)


def _fuse(weights: Weights, parts: list[str], into: str, n_in: int) -> None:
    """Stack the rows of separate projections into the fused one mlx_lm has, where the
    file has the first of them apart."""
    if f"{parts[0]}.weight" not in weights:
        return
    missing = [p for p in parts if f"{p}.weight" not in weights]
    if missing:
        raise GGUFError(f"GGUF has {parts[0]!r} but not {missing[0]!r}, to fuse into {into!r}")
    triples = all(f"{p}.scales" in weights for p in parts)
    widths = {(weights[f"{p}.weight"].shape[-1], weights[f"{p}.scales"].shape[-1])
              for p in parts} if triples else set()  # fmt: skip
    if triples and len(widths) == 1 and all(weights[f"{p}.weight"].ndim == 2 for p in parts):
        # Same bits and group size: quantized rows stack as they are.
        for s in ("weight", "scales", "biases"):
            weights[f"{into}.{s}"] = mx.concatenate([weights.pop(f"{p}.{s}") for p in parts])
        return
    dense = [_dense(weights, p, n_in) for p in parts]
    if any(d.ndim != 2 or d.shape[-1] != n_in for d in dense):
        raise GGUFError(f"GGUF tensors {parts} have shapes {[d.shape for d in dense]}; fusing "
                        f"them into {into!r} takes matrices of {n_in} inputs")
    weights[f"{into}.weight"] = mx.concatenate(dense)


def _phi3_undo(weights: Weights, config: dict[str, Any], m: Meta) -> Weights:
    weights = dict(weights)
    long_, short = (weights.pop(f"rope_factors_{k}.weight", None) for k in ("long", "short"))
    if (long_ is None) != (short is None):
        raise GGUFError("GGUF phi3 file has only one of rope_factors_long / rope_factors_short")
    if long_ is None and _scaling_type(m) is not None:
        raise GGUFError(
            f"GGUF phi3.rope.scaling.type={_scaling_type(m)!r} without rope_factors_long/"
            "short tensors, which carry the factors"
        )
    if long_ is not None:
        config["rope_scaling"] = {
            "type": "longrope",
            "long_factor": long_.astype(mx.float32).tolist(),
            "short_factor": short.astype(mx.float32).tolist(),
        }
        config["original_max_position_embeddings"] = m.get_int(
            "rope.scaling.original_context_length"
        )
    hidden = config["hidden_size"]
    for i in range(config["num_hidden_layers"]):
        b = f"blk.{i}."
        _fuse(weights, [b + "attn_q", b + "attn_k", b + "attn_v"], b + "attn_qkv", hidden)
        _fuse(weights, [b + "ffn_gate", b + "ffn_up"], b + "ffn_up", hidden)
    return weights


FAMILIES: dict[str, Family] = {
    f.arch: f
    for f in (
        Family("llama", "llama", _LLAMA_BLOCKS, _llama_config, _llama_undo,
               frozenset({"rope_freqs"})),
        Family("qwen2", "qwen2", _LLAMA_BLOCKS, _qwen2_config),
        Family("qwen3", "qwen3", {**_LLAMA_BLOCKS, **_QK_NORMS}, _qwen3_config),
        Family("phi3", "phi3", _PHI3_BLOCKS, _phi3_config, _phi3_undo,
               frozenset({"attn_q", "attn_k", "attn_v", "ffn_gate", "rope_factors_long",
                          "rope_factors_short"})),
        Family("gemma3", "gemma3_text", _GEMMA3_BLOCKS, _gemma3_config, _gemma3_undo),
    )
}  # fmt: skip
# What the refusal of any other architecture lists.
SUPPORTED_ARCHS = "llama (also Mistral's files), gemma3, qwen2, qwen3, phi3"


def family_of(meta: dict[str, Any], where: str = "GGUF") -> Family:
    """The converter of a file's ``general.architecture``; GGUFError naming it if none."""
    arch = meta_str(meta, "general.architecture")
    if arch not in FAMILIES:
        raise GGUFError(
            f"{where} has architecture {arch!r}; supported: {SUPPORTED_ARCHS} (other "
            "models: pass an mlx_lm model folder or Hugging Face repo id)"
        )
    return FAMILIES[arch]


def model_config(meta: dict[str, Any], tied: bool) -> dict[str, Any]:
    """The mlx_lm ``config.json`` of a file, before its tensors adjust it (``undo``)."""
    family = family_of(meta)
    config = {"model_type": family.model_type, **base_config(meta, tied)}
    family.config(Meta(meta), config)
    return {k: v for k, v in config.items() if v is not None}  # mlx_lm's defaults


# --- renaming and the quantization config -----------------------------------------


def _input_width(module: str, config: dict[str, Any]) -> int:
    if module == "o_proj":
        return config["num_attention_heads"] * config["head_dim"]
    if module == "down_proj":
        return config["intermediate_size"]
    return config["hidden_size"]


def convert_weights(
    weights: Weights, config: dict[str, Any], dtype: str, family: Family | None = None
) -> tuple[Weights, dict[str, Any] | None]:
    """Rename GGUF tensors (after ``family.undo``); dequantize them to ``dtype`` unless
    it is ``"keep"``. Returns the weights and the ``quantization`` config entry
    (``None`` when dense). ``family`` defaults to llama."""
    check_dtype(dtype)
    family = family or FAMILIES["llama"]
    out: Weights = {}
    quant: dict[str, Any] | None = None
    for name, w in weights.items():
        if name.endswith((".scales", ".biases")):
            continue
        new = family.tensor_name(name)
        base = name.removesuffix(".weight")
        if f"{base}.scales" not in weights:
            out[new] = w if dtype == "keep" else w.astype(getattr(mx, dtype))
            continue
        scales, biases = weights[f"{base}.scales"], weights[f"{base}.biases"]
        n_in = _input_width(new.rsplit(".", 2)[-2], config)
        group, bits = _group_bits(name, w, scales, n_in)
        if dtype != "keep":
            w = mx.dequantize(w, scales, biases, group_size=group, bits=bits)
            out[new] = w.astype(getattr(mx, dtype))
            continue
        prefix = new.removesuffix(".weight")
        out[new], out[f"{prefix}.scales"], out[f"{prefix}.biases"] = w, scales, biases
        quant = quant or {"group_size": group, "bits": bits}
        if (group, bits) != (quant["group_size"], quant["bits"]):
            quant[prefix] = {"group_size": group, "bits": bits}
    return out, quant
