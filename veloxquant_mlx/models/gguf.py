"""Convert a llama-architecture GGUF file into an mlx_lm model folder.

``mx.load`` reads GGUF natively (Q4_0/Q4_1/Q8_0 come back as MLX affine quantized
triples). The conversion writes weights, ``config.json`` and a tokenizer rebuilt
from the GGUF metadata into a cache folder that ``mlx_lm.load`` can open, so the
expensive part (tokenizer build, dequantization) happens once.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx

# Bump when the written folder changes so old caches are not reused.
CONVERTER_VERSION = 1

DTYPES = ("float32", "float16", "bfloat16", "keep")

# GGUF per-block tensor names -> mlx_lm llama names.
_BLOCK_NAMES = {
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
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|scales|biases|bias)$")
_TOP_RE = re.compile(r"^([a-z_]+)\.(weight|scales|biases|bias)$")

# Byte-level BPE as in SmolLM2's own tokenizer.json; special tokens are matched
# before this runs.
_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


class GGUFError(ValueError):
    """The GGUF file cannot be converted (architecture, tensor names...)."""


def map_tensor_name(name: str) -> str:
    """mlx_lm llama name of a GGUF tensor (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``); quantized suffixes are kept."""
    if m := _BLOCK_RE.match(name):
        layer, part, suffix = m.groups()
        if part in _BLOCK_NAMES:
            return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{suffix}"
    elif m := _TOP_RE.match(name):
        part, suffix = m.groups()
        if part in _TOP_NAMES:
            return f"{_TOP_NAMES[part]}.{suffix}"
    allowed = ", ".join([*_TOP_NAMES, *(f"blk.N.{p}" for p in _BLOCK_NAMES)])
    raise GGUFError(f"GGUF tensor {name!r} has no llama counterpart; known: {allowed}")


def _scalar(v: Any) -> Any:
    # Metadata scalars come back as 0-d mx.arrays.
    return v.item() if isinstance(v, mx.array) else v


def read_gguf(path: str | os.PathLike) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Tensors and metadata of a GGUF file; raises for a missing file or non-llama."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    weights, meta = mx.load(str(p), return_metadata=True)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise GGUFError(
            f"GGUF {str(path)!r} has architecture {arch!r}; only 'llama' is supported "
            "(other models: pass an mlx_lm model folder or Hugging Face repo id)"
        )
    return weights, meta


def config_from_metadata(meta: dict[str, Any], tied: bool) -> dict[str, Any]:
    """mlx_lm llama ``config.json`` from the ``llama.*`` GGUF metadata keys."""

    def get(key: str, default: Any = None) -> Any:
        v = meta.get(f"llama.{key}", default)
        if v is None:
            raise GGUFError(f"GGUF metadata lacks 'llama.{key}', needed for the config")
        return _scalar(v)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    vocab = meta.get("llama.vocab_size")
    if vocab is None:
        vocab = len(meta["tokenizer.ggml.tokens"])
    config = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "vocab_size": int(_scalar(vocab)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        # llama.cpp's converter permutes q/k rows into the interleaved-pair layout.
        "rope_traditional": True,
        "tie_word_embeddings": tied,
    }
    if "tokenizer.ggml.eos_token_id" in meta:
        config["eos_token_id"] = int(_scalar(meta["tokenizer.ggml.eos_token_id"]))
    if "tokenizer.ggml.bos_token_id" in meta:
        config["bos_token_id"] = int(_scalar(meta["tokenizer.ggml.bos_token_id"]))
    return config


def convert_weights(
    weights: dict[str, mx.array], config: dict[str, Any], dtype: str
) -> tuple[dict[str, mx.array], dict[str, Any] | None]:
    """Rename GGUF tensors; dequantize them to ``dtype`` unless it is ``"keep"``.

    Returns the weights and the ``quantization`` config entry (``None`` when dense).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not allowed: one of {', '.join(DTYPES)}")
    in_dims = {
        "o_proj": config["num_attention_heads"] * config["head_dim"],
        "down_proj": config["intermediate_size"],
    }
    out: dict[str, mx.array] = {}
    quant: dict[str, Any] | None = None
    for name, w in weights.items():
        if name.endswith((".scales", ".biases")):
            continue
        new = map_tensor_name(name)
        base = name[: -len(".weight")]
        if f"{base}.scales" in weights:
            scales, biases = weights[f"{base}.scales"], weights[f"{base}.biases"]
            module = new.rsplit(".", 2)[-2]
            n_in = in_dims.get(module, config["hidden_size"])
            group = n_in // scales.shape[-1]
            bits = w.shape[-1] * 32 // n_in
            if dtype == "keep":
                prefix = new[: -len(".weight")]
                out[new], out[f"{prefix}.scales"], out[f"{prefix}.biases"] = w, scales, biases
                quant = quant or {"group_size": group, "bits": bits}
                if (group, bits) != (quant["group_size"], quant["bits"]):
                    quant[prefix] = {"group_size": group, "bits": bits}
                continue
            w = mx.dequantize(w, scales, biases, group_size=group, bits=bits)
        if dtype != "keep":
            w = w.astype(getattr(mx, dtype))
        out[new] = w
    return out, quant


def build_tokenizer(meta: dict[str, Any]) -> Any:
    """A ``transformers.PreTrainedTokenizerFast`` rebuilt from ``tokenizer.ggml.*``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(
            f"GGUF tokenizer model {kind!r} is not supported; only byte-level BPE 'gpt2'"
        )
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    types = meta.get("tokenizer.ggml.token_type")
    types = types.tolist() if isinstance(types, mx.array) else [1] * len(tokens)

    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    # SmolLM2 splits every digit on its own before byte-level BPE.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # token_type 3 = control (special), 4 = user-defined (added, not special).
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == 3]
    )
    user = [AddedToken(t, normalized=False) for t, k in zip(tokens, types) if k == 4]
    if user:
        tok.add_tokens(user)

    def token_of(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if i is None else tokens[int(_scalar(i))]

    template = meta.get("tokenizer.chat_template") or _CHAT_TEMPLATE
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=token_of("bos"),
        eos_token=token_of("eos"),
        unk_token=token_of("unknown"),
        pad_token=token_of("padding"),
        chat_template=template,
        clean_up_tokenization_spaces=False,
        model_max_length=int(_scalar(meta.get("llama.context_length", 2048))),
    )


def convert_gguf(path: str | os.PathLike, out_dir: str | os.PathLike, dtype: str) -> Path:
    """Write an mlx_lm model folder for the GGUF at ``path`` into ``out_dir``."""
    weights, meta = read_gguf(path)
    tied = "output.weight" not in weights
    config = config_from_metadata(meta, tied)
    new, quant = convert_weights(weights, config, dtype)
    if quant is not None:
        config["quantization"] = quant
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), new, metadata={"format": "mlx"})
    build_tokenizer(meta).save_pretrained(str(out))
    if not (out / "tokenizer_config.json").is_file():
        raise GGUFError(f"tokenizer save wrote no tokenizer_config.json in {out}")
    with open(out / "config.json", "w") as f:
        json.dump(config, f, indent=2)
    return out


def cache_root() -> Path:
    """``$VELOXQUANT_CACHE_DIR`` or ``~/.cache/veloxquant_mlx``."""
    env = os.environ.get("VELOXQUANT_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "veloxquant_mlx"


def cache_dir_for(path: str | os.PathLike, dtype: str) -> Path:
    """Cache folder of one GGUF file: keyed on path, size, mtime, dtype, version."""
    p = Path(path).resolve()
    st = p.stat()
    key = f"{p}|{st.st_size}|{st.st_mtime_ns}|{dtype}|{CONVERTER_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / f"{p.stem}-{digest}"


def is_valid_cache(folder: Path) -> bool:
    """Cheap check that a cache folder is complete (files present, JSON parses)."""
    try:
        for name in _FILES:
            if not (folder / name).is_file():
                return False
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            with open(folder / name) as f:
                json.load(f)
        return (folder / "model.safetensors").stat().st_size > 0
    except (OSError, ValueError):
        return False


def cached_conversion(path: str | os.PathLike, dtype: str) -> tuple[Path, bool]:
    """The cache folder for ``path``, converting first if needed.

    Returns ``(folder, converted_now)``. The conversion is written to a temporary
    sibling folder and renamed into place, so an interrupted run leaves no partial
    cache; an invalid existing folder is removed and rebuilt.
    """
    if not Path(path).is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    folder = cache_dir_for(path, dtype)
    if is_valid_cache(folder):
        return folder, False
    if folder.exists():
        shutil.rmtree(folder, ignore_errors=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary folder
    try:
        convert_gguf(path, tmp, dtype)
        try:
            os.rename(tmp, folder)
        except OSError:
            # Another process finished the same conversion first: use theirs.
            if not is_valid_cache(folder):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder, True
