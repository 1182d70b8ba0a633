"""GGUF files of every tensor type the loader reads, written here with gguf-py.

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

import json
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from veloxquant_mlx import models
from veloxquant_mlx.models import gguf as vgguf

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
    w.add_tokenizer_model("gpt2")
    w.add_token_list(TOKENS)
    w.add_token_merges(["h e", "Ġ t", "Ġt he"])
    w.add_token_types([3] * len(SPECIALS) + [1] * (VOCAB - len(SPECIALS)))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
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
    monkeypatch.setattr(vgguf, "_CHUNK", 3 * 256)
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
        ["generate", "--model", str(path), "--prompt", "the", "-m", "4", "--no-chat"]
    )
    assert cli.cmd_generate(args) == 0
    assert "method=none" in capsys.readouterr().err
