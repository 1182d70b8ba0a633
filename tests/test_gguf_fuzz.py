"""Malformed GGUF files: every one gives a GGUFError naming what is wrong, never a
crash, a raw exception or a huge allocation.

Two small valid llama files (one of ``mx.load`` types, one that the loader reads
itself) are written with gguf-py; Hypothesis mutates them: header numbers set to
boundary values (counts, lengths, type ids, dims, offsets), truncations, byte noise,
metadata values replaced by values of any type (arrays of arrays included), deeply
nested arrays, ``general.alignment`` values and rewritten tensor entries. Each mutant
goes through everything ``convert_gguf`` does short of writing files: the header
scan, the family's config and undo, the tensors and the tokenizer.
"""

from __future__ import annotations

import struct
import tracemalloc
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from veloxquant_mlx.errors import GGUFError
from veloxquant_mlx.models import gguf as vgguf
from veloxquant_mlx.models.gguf_families import Meta, convert_weights, family_of, model_config
from veloxquant_mlx.models.gguf_tokenizer import build_tokenizer

ggufpy = pytest.importorskip("gguf")
from test_gguf import add_tiny_tokenizer, write_family  # noqa: E402  (tests/ is on sys.path)

T = ggufpy.GGMLQuantizationType
HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 32, 64, 2, 1, 262
CASES = 600
# A mutant may take this much more memory than its file holds, at most (Python and
# NumPy allocations, and MLX's peak): a header that claims terabytes must not get them.
MEMORY_BOUND = 64 << 20

SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
          10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
BOUNDARY = [0, 1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 30, 31, 32, 39, 255, 256, 0x7FFF, 0xFFFF,
            0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 1 << 32, (1 << 62), (1 << 63) - 1, 1 << 63,
            (1 << 64) - 1]  # fmt: skip


# ---------------------------------------------------------------- the valid files
def _write_base(path: Path, bf16: bool) -> bytes:
    """A one-layer llama, matrices Q8_0 (``mx.load`` reads it) or with one BF16 matrix
    (the loader's own reader and gguf-py's dequantization)."""
    rng = np.random.default_rng(0)
    w = ggufpy.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    add_tiny_tokenizer(w)
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,),
              "blk.0.attn_norm.weight": (HIDDEN,), "blk.0.ffn_norm.weight": (HIDDEN,),
              "blk.0.attn_q.weight": (HIDDEN, HIDDEN), "blk.0.attn_k.weight": (16, HIDDEN),
              "blk.0.attn_v.weight": (16, HIDDEN), "blk.0.attn_output.weight": (HIDDEN, HIDDEN),
              "blk.0.ffn_gate.weight": (FFN, HIDDEN), "blk.0.ffn_up.weight": (FFN, HIDDEN),
              "blk.0.ffn_down.weight": (HIDDEN, FFN)}  # fmt: skip
    for name, shape in shapes.items():
        x = (rng.standard_normal(shape) / 4).astype(np.float32)
        kind = T.BF16 if bf16 and name == "blk.0.attn_q.weight" else T.Q8_0
        if x.ndim == 1:
            w.add_tensor(name, x)
        else:
            w.add_tensor(name, ggufpy.quants.quantize(x, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


@dataclass
class Layout:
    """A GGUF file cut into its parts, and where each number of its header is."""

    kvs: list[bytes]
    tensors: list[bytes]
    blob: bytes  # the tensor data, from the aligned data start
    fields: list[tuple[int, str]]  # (position, struct format)


def _layout(data: bytes) -> Layout:
    pos, fields = 8, []

    def take(fmt: str) -> int:
        nonlocal pos
        fields.append((pos, fmt))
        (v,) = struct.unpack_from(fmt, data, pos)
        pos += struct.calcsize(fmt)
        return v

    def value(kind: int) -> None:
        nonlocal pos
        if kind == 8:
            n = take("<Q")  # before the +=, which would read pos first
            pos += n
        elif kind == 9:
            item, n = take("<I"), take("<Q")
            for _ in range(n):
                value(item)
        else:
            take(SCALAR[kind])

    n_tensors, n_kv = take("<Q"), take("<Q")
    kvs, tensors = [], []
    for _ in range(n_kv):
        start = pos
        n = take("<Q")
        pos += n
        value(take("<I"))
        kvs.append(data[start:pos])
    for _ in range(n_tensors):
        start = pos
        n = take("<Q")
        pos += n
        for _ in range(take("<I")):
            take("<Q")
        take("<I")
        take("<Q")
        tensors.append(data[start:pos])
    return Layout(kvs, tensors, data[-(-pos // 32) * 32:], fields)


def _assemble(kvs: list[bytes], tensors: list[bytes], blob: bytes, align: int = 32) -> bytes:
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs))
    head += b"".join(kvs) + b"".join(tensors)
    return head + b"\0" * (-len(head) % align) + blob


def _string(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def _kv(key: str, kind: int, payload: bytes) -> bytes:
    return _string(key.encode()) + struct.pack("<I", kind) + payload


def _key_of(kv: bytes) -> str:
    (n,) = struct.unpack_from("<Q", kv)
    return kv[8:8 + n].decode()


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[bytes, Layout]]:
    folder = tmp_path_factory.mktemp("gguf_fuzz")
    out = {}
    for label, bf16 in (("mx.load", False), ("own reader", True)):
        data = _write_base(folder / f"{label}.gguf", bf16)
        out[label] = (data, _layout(data))
    # Families whose converters do more: Gemma 3's per-layer flags and norm offsets,
    # Phi-3's q/k/v fused here and its longrope factor tensors.
    for label, case, kind in (("gemma3", "gemma3-flags", "Q8_0"),
                              ("phi3", "phi3-split-longrope", "F32")):
        write_family(folder / f"{label}.gguf", case, kind)
        data = (folder / f"{label}.gguf").read_bytes()
        out[label] = (data, _layout(data))
    return out


# ---------------------------------------------------------------- what is done with it
def _convert(path: Path, dtype: str) -> None:
    """``convert_gguf`` without the files it writes."""
    weights, meta = vgguf.read_gguf(path, dtype)
    family = family_of(meta)
    config = model_config(meta, tied="output.weight" not in weights)
    if family.undo is not None:
        weights = family.undo(weights, config, Meta(meta))
    new, _ = convert_weights(weights, config, dtype, family)
    mx.eval(list(new.values()))
    build_tokenizer(meta)


def _outcome(path: Path, dtype: str) -> str:
    """``"converted"`` or ``"refused"``; anything else fails the test."""
    mx.reset_peak_memory()
    held = mx.get_active_memory()  # what earlier tests in this process still hold
    tracemalloc.start()
    try:
        _convert(path, dtype)
        return "converted"
    except GGUFError as e:
        text = str(e)
        assert text and "Traceback" not in text
        return "refused"
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        budget = MEMORY_BOUND + 4 * path.stat().st_size
        assert peak < budget, f"{peak / 2**20:.0f} MiB of Python/NumPy memory"
        grown = mx.get_peak_memory() - held
        assert grown < budget, f"{grown / 2**20:.0f} MiB in MLX"


# ---------------------------------------------------------------- mutations
def _number(width_fmt: str) -> st.SearchStrategy[bytes]:
    size = struct.calcsize(width_fmt)
    mask = (1 << (8 * size)) - 1
    return st.one_of(st.sampled_from(BOUNDARY), st.integers(0, mask)).map(
        lambda v: (v & mask).to_bytes(size, "little"))


@st.composite
def _value(draw: st.DrawFn, depth: int = 0) -> tuple[int, bytes]:
    """Any metadata value: (type id, its bytes)."""
    kind = draw(st.sampled_from([*SCALAR, 8, 8, 9, 9] if depth < 2 else [*SCALAR, 8]))
    if kind == 8:
        # Names the converter acts on: other families, SentencePiece, rope scalings.
        names = st.sampled_from([b"linear", b"llama", b"gemma3", b"phi3", b"qwen2", b"qwen3",
                                 b"gpt2", b"smollm", b"longrope", b"<|im_end|>"])
        return kind, _string(draw(st.binary(max_size=12) | names))
    if kind in SCALAR:
        size = struct.calcsize(SCALAR[kind])
        return kind, draw(st.sampled_from(BOUNDARY)).to_bytes(16, "little")[:size]
    items = draw(st.lists(_value(depth + 1), max_size=4))
    item = items[0][0] if items else draw(st.sampled_from([4, 8, 9]))
    items = [p for k, p in items if k == item]
    count = draw(st.sampled_from([len(items)] * 3 + [len(items) + 1, 1 << 40, (1 << 64) - 1]))
    return kind, struct.pack("<IQ", item, count) + b"".join(items)


KEYS = ["general.alignment", "general.architecture", "llama.block_count",
        "llama.embedding_length", "llama.attention.head_count", "llama.vocab_size",
        "llama.attention.key_length", "llama.rope.dimension_count",
        "llama.rope.scaling.type", "llama.rope.scaling.factor", "llama.context_length",
        "llama.attention.layer_norm_rms_epsilon", "tokenizer.ggml.tokens",
        "tokenizer.ggml.merges", "tokenizer.ggml.model", "tokenizer.ggml.pre",
        "tokenizer.ggml.token_type", "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.add_bos_token", "tokenizer.ggml.scores"]  # fmt: skip


class Mutant(bytes):
    """A mutated file; Hypothesis shows how it was made, not its bytes."""

    how: str = ""

    def __repr__(self) -> str:
        return f"Mutant({self.how}, {len(self)} bytes)"


@st.composite
def _mutant(draw: st.DrawFn, data: bytes, lay: Layout) -> Mutant:
    how, out, note = _mutation(draw, data, lay)
    m = Mutant(out)
    m.how = f"{how}: {note}"
    return m


def _mutation(draw: st.DrawFn, data: bytes, lay: Layout) -> tuple[str, bytes, str]:
    how = draw(st.sampled_from(["field", "field", "truncate", "noise", "retype", "retype",
                                "nested", "alignment", "tensor", "tensor"]))
    if how == "field":
        pos, fmt = draw(st.sampled_from(lay.fields))
        new = draw(_number(fmt))
        return how, data[:pos] + new + data[pos + len(new):], f"{fmt} at {pos} = {new.hex()}"
    if how == "truncate":
        end = draw(st.integers(0, len(data) - 1))
        return how, data[:end], f"at {end}"
    if how == "noise":
        out = bytearray(data)
        for _ in range(draw(st.integers(1, 4))):
            out[draw(st.integers(8, len(data) - len(lay.blob) - 1))] = draw(st.integers(0, 255))
        return how, bytes(out), "header bytes"
    if how == "tensor":
        return _tensor_mutation(draw, lay)
    key = {"alignment": "general.alignment"}.get(how) or draw(st.sampled_from(KEYS))
    align = 32
    if how == "nested":  # arrays of arrays, deep enough to exhaust a recursive reader
        depth = draw(st.sampled_from([2, 3, 64, 5000, 60000]))
        kind, payload = 9, struct.pack("<IQ", 9, 1) * (depth - 1) + struct.pack("<IQ", 4, 0)
        note = f"{key} nested {depth} deep"
    elif how == "alignment":
        kind = draw(st.sampled_from([4, 4, 4, 5, 10, 6, 8]))
        n = draw(st.sampled_from([0, 1, 2, 3, 8, 24, 64, 4096, 1 << 31, (1 << 32) - 1]))
        size = struct.calcsize(SCALAR.get(kind, "<Q"))
        payload = (_string(str(n).encode()) if kind == 8 else struct.pack("<f", n)
                   if kind == 6 else (n % (1 << 8 * size)).to_bytes(size, "little"))
        align = 64 if n == 64 and kind not in (6, 8) else 32
        note = f"type {kind} value {n}"
    else:
        kind, payload = draw(_value())
        note = f"{key} = type {kind} {payload[:40].hex()}"
    kvs = [kv for kv in lay.kvs if _key_of(kv) != key] + [_kv(key, kind, payload)]
    return how, _assemble(kvs, lay.tensors, lay.blob, align), note


def _tensor_mutation(draw: st.DrawFn, lay: Layout) -> tuple[str, bytes, str]:
    tensors = list(lay.tensors)
    i = draw(st.integers(0, len(tensors) - 1))
    name = tensors[i][8:8 + struct.unpack_from("<Q", tensors[i])[0]]
    dims = draw(st.lists(st.sampled_from(BOUNDARY[:14] + [1 << 32, 1 << 62, (1 << 64) - 1]),
                         max_size=6))
    kind = draw(st.sampled_from([0, 1, 8, 30, 2, 12, 14, 16, 39, 99, (1 << 32) - 1]))
    offset = draw(st.sampled_from([0, 1, 31, 32, len(lay.blob), len(lay.blob) - 32,
                                   (1 << 63), (1 << 64) - 1]))
    tensors[i] = (_string(name) + struct.pack("<I", len(dims))
                  + b"".join(struct.pack("<Q", d) for d in dims)
                  + struct.pack("<IQ", kind, offset))
    note = f"{name.decode()} dims {dims} type {kind} offset {offset}"
    return "tensor", _assemble(lay.kvs, tensors, lay.blob), note


# ---------------------------------------------------------------- the tests
def test_the_valid_files_convert(bases, tmp_path: Path):
    for label, (data, lay) in bases.items():
        path = tmp_path / "f.gguf"
        path.write_bytes(_assemble(lay.kvs, lay.tensors, lay.blob))
        assert path.read_bytes() == data  # the cutting and re-assembling is exact
        assert _outcome(path, "keep") == "converted", label
        assert _outcome(path, "float16") == "converted", label


def test_mutated_files_are_refused_by_name(bases, tmp_path: Path):
    tally: Counter[str] = Counter()
    path = tmp_path / "mutant.gguf"

    @settings(max_examples=CASES, deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate, Phase.shrink],
              suppress_health_check=list(HealthCheck))
    @seed(46)
    @given(st.data())
    def one(data: st.DataObject) -> None:
        label = data.draw(st.sampled_from(sorted(bases)))
        mutant = data.draw(_mutant(*bases[label]))
        path.write_bytes(mutant)
        outcome = _outcome(path, data.draw(st.sampled_from(["keep", "float16"])))
        tally[mutant.how.split(":")[0], outcome] += 1

    one()
    by_how = {how: sum(n for (h, _), n in tally.items() if h == how) for how, _ in tally}
    refused = sum(n for (_, o), n in tally.items() if o == "refused")
    print(f"gguf fuzz: {sum(tally.values())} cases, {refused} refused with GGUFError, "
          f"{sum(tally.values()) - refused} converted, 0 crashes; by mutation: {by_how}")
    assert refused > CASES // 2  # most mutations break the file: the fuzzing reached them


# ---------------------------------------------------------------- named cases
def _with_kv(lay: Layout, key: str, kind: int, payload: bytes, align: int = 32) -> bytes:
    kvs = [kv for kv in lay.kvs if _key_of(kv) != key] + [_kv(key, kind, payload)]
    return _assemble(kvs, lay.tensors, lay.blob, align)


def _with_tensor(lay: Layout, i: int, dims: list[int], kind: int, offset: int) -> bytes:
    tensors = list(lay.tensors)
    name = tensors[i][8:8 + struct.unpack_from("<Q", tensors[i])[0]]
    tensors[i] = (_string(name) + struct.pack("<I", len(dims))
                  + b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", kind, offset))
    return _assemble(lay.kvs, tensors, lay.blob)


def _count(data: bytes, at: int, n: int) -> bytes:
    return data[:at] + struct.pack("<Q", n) + data[at + 8:]


# (what, how the valid file is changed, the words the error must hold)
NAMED = [
    ("alignment 0", lambda d, lay: _with_kv(lay, "general.alignment", 4, struct.pack("<I", 0)),
     r"general.alignment=0; expected a power of two"),
    ("alignment 24", lambda d, lay: _with_kv(lay, "general.alignment", 4, struct.pack("<I", 24)),
     r"general.alignment=24; expected a power of two"),
    ("alignment a string", lambda d, lay: _with_kv(lay, "general.alignment", 8, _string(b"32")),
     r"general.alignment='32'; expected a power of two"),
    ("arrays of arrays, 60000 deep", lambda d, lay: _with_kv(
        lay, "x.deep", 9, struct.pack("<IQ", 9, 1) * 59999 + struct.pack("<IQ", 4, 0)),
     r"metadata key 'x.deep': an array of arrays"),
    ("dims whose product wraps int64", lambda d, lay: _with_tensor(
        lay, 0, [1 << 32, 1 << 32], 0, 0), r"tensor 'token_embd.weight': has dims"),
    ("a zero dim", lambda d, lay: _with_tensor(lay, 0, [32, 0], 8, 0),
     r"tensor 'token_embd.weight': has dims \[32, 0\]"),
    ("five dims", lambda d, lay: _with_tensor(lay, 0, [32, 2, 2, 2, 2], 0, 0),
     r"has 5 dimensions; GGML tensors have 1 to 4"),
    ("a truncated file", lambda d, lay: d[:len(d) - 100], r"is truncated \(tensor"),
    ("a truncated header", lambda d, lay: d[:300], r"truncated"),
    ("a tensor count of 2**63", lambda d, lay: _count(d, 8, 1 << 63),
     r"claims 9223372036854775808 tensors, more than the"),
    ("a metadata count of 2**64-1", lambda d, lay: _count(d, 16, (1 << 64) - 1),
     r"claims 18446744073709551615 metadata entries"),
    ("an array count of 2**40", lambda d, lay: _with_kv(
        lay, "x.big", 9, struct.pack("<IQ", 8, 1 << 40)),
     r"metadata key 'x.big': claims 1099511627776 array items"),
    ("a tensor offset past the end", lambda d, lay: _with_tensor(
        lay, 0, [32, 262], 8, (1 << 64) - 32), r"is truncated \(tensor 'token_embd.weight'"),
    ("a misaligned tensor offset", lambda d, lay: _with_tensor(lay, 0, [32, 262], 8, 1),
     r"tensor 'token_embd.weight' starts at data offset 1, not a multiple of the alignment"),
    ("an unknown value type", lambda d, lay: _with_kv(lay, "x.odd", 13, b"\0" * 8),
     r"metadata key 'x.odd': value of unknown type 13"),
    ("an unknown tensor type", lambda d, lay: _with_tensor(lay, 0, [32, 262], 99, 0),
     r"'token_embd.weight' has type unknown type id 99"),
    ("a key twice", lambda d, lay: _assemble(lay.kvs + lay.kvs[:1], lay.tensors, lay.blob),
     r"metadata key 'general.architecture': appears twice"),
    ("block_count a string", lambda d, lay: _with_kv(lay, "llama.block_count", 8,
                                                     _string(b"linear")),
     r"llama.block_count='linear' \(str\); expected an integer"),
    ("head_count 0", lambda d, lay: _with_kv(lay, "llama.attention.head_count", 4,
                                             struct.pack("<I", 0)),
     r"llama.attention.head_count=0 \(int\); expected an integer from 1"),
    ("tokens not strings", lambda d, lay: _with_kv(lay, "tokenizer.ggml.tokens", 9,
                                                   struct.pack("<IQI", 4, 1, 7)),
     r"tokenizer.ggml.tokens=\[7\] \(array\); expected an array of strings"),
    ("a float64 value (mx.load crashes on it)", lambda d, lay: _with_kv(
        lay, "x.f64", 12, struct.pack("<d", 1.5)), None),
]


@pytest.mark.parametrize(("what", "change", "said"), NAMED, ids=[n[0] for n in NAMED])
def test_named_malformations(what, change, said, bases, tmp_path: Path):
    data, lay = bases["mx.load"]
    path = tmp_path / "bad.gguf"
    path.write_bytes(change(data, lay))
    if said is None:  # a valid file after all: it converts, through the reader that can
        assert _outcome(path, "keep") == "converted"
        return
    with pytest.raises(GGUFError, match=said) as err:
        _convert(path, "keep")
    assert repr(str(path)) in str(err.value)  # every one names the file
    assert _outcome(path, "float16") == "refused"  # and within the memory bound
