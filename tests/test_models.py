"""The embedded model loader: GGUF conversion, tokenizer, disk cache, errors.

Integration tests use the real SmolLM2-135M-Instruct GGUF at short context; unit
tests use a tiny llama GGUF written with ``mx.save_gguf``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest

from veloxquant_mlx import models
from veloxquant_mlx.models import gguf

# Plain expository English, about 95 tokens.
PARAGRAPH = (
    "Water is one of the most important substances on Earth. All living things "
    "need water to survive. Plants use water to make their own food through a "
    "process called photosynthesis. Animals drink water to stay healthy, and "
    "people use water for drinking, cooking, cleaning, and growing crops. Most of "
    "the water on Earth is found in the oceans, where it is too salty to drink. "
    "Only a small part of the water on our planet is fresh water that people can use."
)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory):
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("vq-cache")
        mp.setenv("VELOXQUANT_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def smollm(cache_dir: Path):
    assert not any(cache_dir.iterdir())
    model, tokenizer = models.load()
    return model, tokenizer


# --- the real embedded model -------------------------------------------------


@pytest.mark.slow
def test_default_model_is_found():
    path = models.default_model_path()
    assert path.name == models.DEFAULT_MODEL and path.stat().st_size > 50_000_000


@pytest.mark.slow
def test_perplexity_of_english(smollm):
    model, tokenizer = smollm
    ids = mx.array(tokenizer.encode(PARAGRAPH))[None]
    assert 80 <= ids.shape[1] <= 120
    logits = model(ids[:, :-1]).astype(mx.float32)
    ppl = mx.exp(nn.losses.cross_entropy(logits, ids[:, 1:]).mean()).item()
    assert ppl < 15, ppl


@pytest.mark.slow
def test_cpu_default_is_dense_float32(smollm):
    model, _ = smollm
    if mx.default_device() != mx.cpu:
        pytest.skip("GPU default keeps the weights quantized")
    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q, nn.Linear) and q.weight.dtype == mx.float32


@pytest.mark.slow
def test_tokenizer_round_trip(smollm):
    _, tokenizer = smollm
    text = "Hello, world!\n\n  Two spaces, a tab\tand 2024 digits.\nEnd."
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    # Digits are split one by one, as in SmolLM2's own tokenizer.
    assert len(tokenizer.encode("2024")) == 4
    # Control tokens are single special tokens.
    assert tokenizer.encode("<|im_end|>") == [tokenizer.eos_token_id]
    assert tokenizer.eos_token == "<|im_end|>"


@pytest.mark.slow
def test_generate_with_chat_template(smollm):
    model, tokenizer = smollm
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    text = tokenizer.decode(prompt)
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    out = mlx_lm.generate(model, tokenizer, prompt=prompt, max_tokens=20)
    assert "Paris" in out


@pytest.mark.slow
def test_second_load_uses_cache(smollm, cache_dir: Path, monkeypatch):
    folders = [p for p in cache_dir.iterdir()]
    assert len(folders) == 1 and not folders[0].name.startswith(".")
    assert gguf.is_valid_cache(folders[0])

    def no_conversion(*args, **kwargs):
        raise AssertionError("the second load converted the GGUF again")

    monkeypatch.setattr(gguf, "convert_gguf", no_conversion)
    folder, fresh = gguf.cached_conversion(models.default_model_path(), "float32")
    assert folder == folders[0] and not fresh
    model, tokenizer = models.load(dtype="float32")
    assert tokenizer.encode("Paris") == smollm[1].encode("Paris")


# --- a tiny llama GGUF ---------------------------------------------------------


def _byte_chars() -> list[str]:
    # GPT-2's byte -> printable character table (byte-level BPE alphabet).
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def write_tiny_gguf(path: Path, arch: str = "llama") -> Path:
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + _byte_chars() + ["he", "Ġt", "Ġthe"]
    merges = ["h e", "Ġ t", "Ġt he"]
    vocab, hidden, ffn, layers, heads, kv, hd = len(tokens), 32, 64, 2, 4, 2, 8
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    mx.random.seed(0)

    def w(*shape):
        return mx.random.normal(shape) * 0.1

    arrays = {"token_embd.weight": w(vocab, hidden), "output_norm.weight": mx.ones(hidden)}
    for i in range(layers):
        arrays.update(
            {
                f"blk.{i}.attn_q.weight": w(heads * hd, hidden),
                f"blk.{i}.attn_k.weight": w(kv * hd, hidden),
                f"blk.{i}.attn_v.weight": w(kv * hd, hidden),
                f"blk.{i}.attn_output.weight": w(hidden, heads * hd),
                f"blk.{i}.ffn_gate.weight": w(ffn, hidden),
                f"blk.{i}.ffn_up.weight": w(ffn, hidden),
                f"blk.{i}.ffn_down.weight": w(hidden, ffn),
                f"blk.{i}.attn_norm.weight": mx.ones(hidden),
                f"blk.{i}.ffn_norm.weight": mx.ones(hidden),
            }
        )
    u32 = mx.uint32
    meta = {
        "general.architecture": arch,
        f"{arch}.embedding_length": mx.array(hidden, dtype=u32),
        f"{arch}.feed_forward_length": mx.array(ffn, dtype=u32),
        f"{arch}.block_count": mx.array(layers, dtype=u32),
        f"{arch}.attention.head_count": mx.array(heads, dtype=u32),
        f"{arch}.attention.head_count_kv": mx.array(kv, dtype=u32),
        f"{arch}.rope.dimension_count": mx.array(hd, dtype=u32),
        f"{arch}.context_length": mx.array(256, dtype=u32),
        f"{arch}.rope.freq_base": mx.array(10000.0),
        f"{arch}.attention.layer_norm_rms_epsilon": mx.array(1e-5),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": mx.array(types, dtype=mx.int32),
        "tokenizer.ggml.bos_token_id": mx.array(1, dtype=u32),
        "tokenizer.ggml.eos_token_id": mx.array(2, dtype=u32),
    }
    mx.save_gguf(str(path), arrays, meta)
    return path


@pytest.fixture
def tiny_gguf(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("VELOXQUANT_CACHE_DIR", str(tmp_path / "cache"))
    return write_tiny_gguf(tmp_path / "tiny.gguf")


def test_tiny_gguf_converts_and_runs(tiny_gguf: Path):
    model, tokenizer = models.load(str(tiny_gguf))
    args = model.args
    assert (args.num_hidden_layers, args.hidden_size, args.num_key_value_heads) == (2, 32, 2)
    assert args.rope_traditional and args.tie_word_embeddings
    ids = tokenizer.encode("the cat\nhe")
    assert tokenizer.decode(ids) == "the cat\nhe"
    logits = model(mx.array(ids)[None])
    assert logits.shape == (1, len(ids), args.vocab_size)
    # Converted weights equal the GGUF tensors under their mlx_lm names.
    src = mx.load(str(tiny_gguf))
    got = model.model.layers[1].mlp.down_proj.weight
    assert mx.array_equal(got, src["blk.1.ffn_down.weight"])


def test_mlx_folder_is_delegated_to_mlx_lm(tiny_gguf: Path):
    folder, _ = gguf.cached_conversion(tiny_gguf, "float32")
    model, tokenizer = models.load(str(folder))
    assert model.args.num_hidden_layers == 2
    assert tokenizer.decode(tokenizer.encode("the cat")) == "the cat"


def test_tiny_gguf_dtype(tiny_gguf: Path):
    model, _ = models.load(str(tiny_gguf), dtype="float16")
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == mx.float16
    with pytest.raises(ValueError, match="dtype='int8'.*float32"):
        models.load(str(tiny_gguf), dtype="int8")


def test_corrupt_cache_is_rebuilt(tiny_gguf: Path):
    folder, fresh = gguf.cached_conversion(tiny_gguf, "float32")
    assert fresh
    # No temporary folder is left next to the cache.
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]
    (folder / "config.json").write_text("{not json")
    assert not gguf.is_valid_cache(folder)
    folder2, fresh = gguf.cached_conversion(tiny_gguf, "float32")
    assert folder2 == folder and fresh and gguf.is_valid_cache(folder)
    os.remove(folder / "tokenizer.json")
    model, _ = models.load(str(tiny_gguf), dtype="float32")
    assert gguf.is_valid_cache(folder)
    assert json.loads((folder / "config.json").read_text())["model_type"] == "llama"
    # Truncated weights pass the quick check but fail to load: rebuilt once.
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    model, _ = models.load(str(tiny_gguf), dtype="float32")
    assert weights.stat().st_size > 1000


def test_interrupted_conversion_leaves_no_cache(tiny_gguf: Path, monkeypatch):
    def interrupted(meta):
        raise KeyboardInterrupt  # e.g. Ctrl-C after the weights were written

    monkeypatch.setattr(gguf, "build_tokenizer", interrupted)
    with pytest.raises(KeyboardInterrupt):
        gguf.cached_conversion(tiny_gguf, "float32")
    root = gguf.cache_root()
    assert not root.exists() or list(root.iterdir()) == []


def test_cache_key_follows_file_changes(tiny_gguf: Path):
    a = gguf.cache_dir_for(tiny_gguf, "float32")
    assert gguf.cache_dir_for(tiny_gguf, "keep") != a
    os.utime(tiny_gguf, ns=(1, 1))
    assert gguf.cache_dir_for(tiny_gguf, "float32") != a


# --- names and errors ----------------------------------------------------------


@pytest.mark.parametrize(
    "src, dst",
    [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("token_embd.scales", "model.embed_tokens.scales"),
        ("output_norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("blk.12.attn_k.biases", "model.layers.12.self_attn.k_proj.biases"),
        ("blk.3.attn_v.weight", "model.layers.3.self_attn.v_proj.weight"),
        ("blk.3.attn_output.weight", "model.layers.3.self_attn.o_proj.weight"),
        ("blk.29.ffn_gate.weight", "model.layers.29.mlp.gate_proj.weight"),
        ("blk.29.ffn_up.weight", "model.layers.29.mlp.up_proj.weight"),
        ("blk.29.ffn_down.weight", "model.layers.29.mlp.down_proj.weight"),
        ("blk.1.attn_norm.weight", "model.layers.1.input_layernorm.weight"),
        ("blk.1.ffn_norm.weight", "model.layers.1.post_attention_layernorm.weight"),
    ],
)
def test_map_tensor_name(src: str, dst: str):
    assert models.map_tensor_name(src) == dst


@pytest.mark.parametrize(
    "name", ["rope_freqs.weight", "blk.0.attn_qkv.weight", "blk.x.attn_q.weight"]
)
def test_map_tensor_name_unknown(name: str):
    with pytest.raises(models.GGUFError, match="no llama counterpart"):
        models.map_tensor_name(name)


def test_an_unsupported_gguf_family_is_rejected(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("VELOXQUANT_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "falcon.gguf", arch="falcon")
    with pytest.raises(models.GGUFError, match="'falcon'; supported: llama"):
        models.load(str(path))


def test_missing_gguf_path(tmp_path: Path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf.*does not exist"):
        models.load(str(missing))
    with pytest.raises(FileNotFoundError, match="no-model.*does not exist.*repo id"):
        models.load(str(tmp_path / "no-model"))
