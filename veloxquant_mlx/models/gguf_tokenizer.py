"""The tokenizer of a GGUF file, rebuilt from its ``tokenizer.ggml.*`` metadata.

Only tokenizers that can be rebuilt exactly are: byte-level BPE with a known
pre-tokenizer, and SentencePiece BPE whose scores order the merges unambiguously.
Anything else is refused (``tokenizer_kind``), since a wrong pre-tokenizer gives
wrong token ids without any error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from veloxquant_mlx.models.gguf_read import (
    GGUFError,
    meta_bool,
    meta_int,
    meta_numbers,
    meta_str,
    meta_strings,
    where,
)

# SmolLM2's ChatML, for SmolLM files that carry no tokenizer.chat_template.
_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Gemma's turn format, for Gemma 3 files without a template: the assistant's role is
# "model", and a system message has no turn of its own (it opens the first user turn).
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% set system = namespace(text='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{% set system.text = system.text + message['content'] + '\\n\\n' %}"
    "{% else %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + system.text + message['content'] | trim "
    "+ '<end_of_turn>\\n' }}{% set system.text = '' %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


# Split regexes of the Hugging Face tokenizers that llama.cpp's pre-tokenizer names
# stand for, as their tokenizer.json writes them. llama.cpp's src/llama-vocab.cpp spells
# the contractions '[sS] instead of (?i:'s): the two differ only on Unicode case folds
# of non-ASCII letters ("a'ſx"), where this follows the model's own tokenizer.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2 differs from Llama 3 only in taking digits one at a time.
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


@dataclass(frozen=True)
class TokenizerKind:
    """How one tokenizer family normalizes, splits and frames text."""

    split: str | None = None  # BPE Split regex; None: SmolLM's digits, then GPT-2's regex
    nfc: bool = False  # NFC-normalize first (Qwen2's normalizer)
    ignore_merges: bool = False  # a word that is itself a token stays whole (Llama 3)
    add_bos: bool = False  # llama.cpp's default; tokenizer.ggml.add_bos_token overrides
    clean_spaces: bool = False  # llama.cpp's clean_spaces, used when decoding
    sentencepiece: bool = False  # scores instead of merges, "▁" for spaces, byte fallback


_SMOLLM = TokenizerKind()
_LLAMA3 = TokenizerKind(_LLAMA3_SPLIT, ignore_merges=True, add_bos=True, clean_spaces=True)
_QWEN2 = TokenizerKind(_QWEN2_SPLIT, nfc=True)
_SENTENCEPIECE = TokenizerKind(add_bos=True, sentencepiece=True)
# tokenizer.ggml.pre values (llama.cpp's names) rebuilt exactly for tokenizer.ggml.model
# "gpt2". llama.cpp maps more names onto these regexes, but their Hugging Face
# tokenizers may normalize or merge differently, so they are refused.
BPE_PRE_TOKENIZERS: dict[str, TokenizerKind] = {
    "smollm": _SMOLLM,
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "qwen2": _QWEN2,
}
SUPPORTED_TOKENIZERS = (
    "tokenizer.ggml.model 'gpt2' (byte-level BPE) with tokenizer.ggml.pre "
    + ", ".join(repr(p) for p in BPE_PRE_TOKENIZERS)
    + "; tokenizer.ggml.model 'llama' (SentencePiece) with distinct scores and byte tokens"
)
# GGUF token types: 2 unknown and 3 control are special, 4 user-defined is added whole.
_SPECIAL_TYPES, _USER_DEFINED = (2, 3), 4
_BYTE_TOKENS = tuple(f"<0x{b:02X}>" for b in range(256))


def tokenizer_kind(meta: dict[str, Any], where: str = "GGUF") -> TokenizerKind:
    """The tokenizer family of GGUF metadata, if this converter rebuilds it exactly.

    Raises GGUFError naming the file's tokenizer model and pre-tokenizer otherwise:
    a wrong pre-tokenizer gives wrong token ids without any error.
    """
    model = meta_str(meta, "tokenizer.ggml.model")
    pre = meta_str(meta, "tokenizer.ggml.pre")
    if model == "gpt2" and pre in BPE_PRE_TOKENIZERS:
        return BPE_PRE_TOKENIZERS[pre]
    if model == "llama":
        _sentencepiece_merges(meta, where)  # raises where the merge order is not exact
        return _SENTENCEPIECE
    if model == "gpt2":
        found = f"pre-tokenizer {pre!r}" if pre is not None else "no tokenizer.ggml.pre"
        what = f"byte-level BPE tokenizer with {found}"
    else:
        what = f"tokenizer model {model!r}"
    raise GGUFError(
        f"{where} has a {what}, which this converter cannot rebuild exactly; supported: "
        f"{SUPPORTED_TOKENIZERS} (for other models pass an mlx_lm model folder or "
        "Hugging Face repo id)"
    )


def _tokens(meta: dict[str, Any]) -> list[str]:
    tokens = meta_strings(meta, "tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFError(f"{where(meta)}: metadata has no tokenizer.ggml.tokens; the "
                        "tokenizer needs them")
    return tokens


def _token_types(meta: dict[str, Any], n: int) -> list[int]:
    types = meta.get("tokenizer.ggml.token_type")
    if types is None:
        return [1] * n
    if not isinstance(types, mx.array) or types.shape != (n,) or not mx.issubdtype(
            types.dtype, mx.integer):
        raise GGUFError(f"{where(meta)}: metadata tokenizer.ggml.token_type is not {n} "
                        "integers, one per token")
    return types.tolist()


def _token_id(meta: dict[str, Any], key: str, tokens: list[str], default: Any = None) -> Any:
    """``tokenizer.ggml.{key}_token_id``: an index into ``tokens``, or ``default``."""
    return meta_int(meta, f"tokenizer.ggml.{key}_token_id", default, hi=len(tokens) - 1)


def _sentencepiece_merges(meta: dict[str, Any], where: str) -> list[tuple[str, str]]:
    """BPE merges that make Hugging Face's BPE encode as SentencePiece does.

    SentencePiece (and llama.cpp) repeatedly merge the adjacent pair whose union is
    the best-scoring token. Listing every split of every such token, best score
    first, gives the same result as long as no two mergeable tokens share a score
    (ties go leftmost there, by rank here) and no token can be merged from a character
    that is not a token (there it can, here it falls back to bytes). Raises otherwise.
    """
    tokens = _tokens(meta)
    scores = meta_numbers(meta, "tokenizer.ggml.scores", len(tokens))
    if scores is None:
        raise GGUFError(f"{where}: SentencePiece vocabulary without tokenizer.ggml.scores")
    vocab = set(tokens)
    if missing := [b for b in _BYTE_TOKENS if b not in vocab]:
        raise GGUFError(f"{where}: SentencePiece vocabulary lacks byte token {missing[0]}")
    best: dict[float, str] = {}
    ranked = []
    for t, s, k in zip(tokens, scores, _token_types(meta, len(tokens))):
        if k in _SPECIAL_TYPES or k == _USER_DEFINED or len(t) < 2:
            continue  # matched whole before merging, or never a merge
        splits = []
        for left, right in ((t[:i], t[i:]) for i in range(1, len(t))):
            if left in vocab and right in vocab:
                splits.append((left, right))
            elif all(p in vocab or len(p) == 1 for p in (left, right)):
                stray = left if left not in vocab else right
                raise GGUFError(
                    f"{where}: SentencePiece token {t!r} can be merged from the character "
                    f"{stray!r}, which is not a token itself"
                )
        if not splits:
            continue
        if s in best:
            raise GGUFError(
                f"{where}: SentencePiece tokens {best[s]!r} and {t!r} share the score {s}, "
                "and Hugging Face's BPE cannot break that tie as SentencePiece does"
            )
        best[s] = t
        ranked.append((-s, splits))
    ranked.sort(key=lambda r: r[0])
    return [pair for _, splits in ranked for pair in splits]


def _bpe_merges(meta: dict[str, Any]) -> list[tuple[str, str]]:
    merges = meta_strings(meta, "tokenizer.ggml.merges")
    if merges is None:
        raise GGUFError(f"{where(meta)}: byte-level BPE tokenizer lacks tokenizer.ggml.merges")
    out = []
    for m in merges:
        # Split as llama.cpp does: at the first space after the first character.
        at = m.find(" ", 1)
        if at < 0:
            raise GGUFError(f"GGUF merge {m!r} is not two tokens separated by a space")
        out.append((m[:at], m[at + 1 :]))
    return out


def _bpe_tokenizer(meta: dict[str, Any], kind: TokenizerKind, vocab: dict[str, int]) -> Any:
    """The ``tokenizers`` model, normalizer, pre-tokenizer and decoder of ``kind``."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    merges = _bpe_merges(meta)
    tok = _made(lambda: Tokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=kind.ignore_merges)
    ))
    if kind.split is None:
        first = pre_tokenizers.Digits(individual_digits=True)
    else:
        first = pre_tokenizers.Split(Regex(kind.split), behavior="isolated", invert=False)
    # With a Split first, ByteLevel only maps bytes; otherwise it applies GPT-2's regex.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [first, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=kind.split is None)]
    )
    if kind.nfc:
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_tokenizer(meta: dict[str, Any], tokens: list[str]) -> Any:
    """SentencePiece BPE as llama.cpp runs it: each text between special tokens gets a
    leading space (unless tokenizer.ggml.add_space_prefix is false), spaces become
    "▁", and the whole piece is merged by score, unknown characters falling back to
    byte tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    merges = _sentencepiece_merges(meta, "GGUF")
    unk = tokens[_token_id(meta, "unknown", tokens, 0)]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = _made(lambda: Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=unk, byte_fallback=True)))
    prefix = meta_bool(meta, "tokenizer.ggml.add_space_prefix", True)
    steps = [normalizers.Prepend("▁")] if prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    unsteps = [decoders.Strip(" ", 1, 0)] if prefix else []
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *unsteps]
    )
    return tok


def _framing(meta: dict[str, Any], tokens: list[str], kind: TokenizerKind) -> Any:
    """Post-processor (or None): byte-level offsets for BPE, plus BOS/EOS where
    llama.cpp adds them."""
    from tokenizers import processors

    ends: list[tuple[str, int] | None] = []
    for end, default in (("bos", kind.add_bos), ("eos", False)):
        if not meta_bool(meta, f"tokenizer.ggml.add_{end}_token", default):
            ends.append(None)
            continue
        i = _token_id(meta, end, tokens)
        if i is None:
            raise GGUFError(f"GGUF asks to add a {end} token but has no {end}_token_id")
        ends.append((tokens[i], i))
    steps = [] if kind.sentencepiece else [processors.ByteLevel(trim_offsets=False)]
    if not any(ends):
        return steps[0] if steps else None
    named = [e for e in ends if e]
    if any(":" in t for t, _ in named):
        # TemplateProcessing reads "text:type_id"; a ':' in the token would be misread.
        raise GGUFError(f"GGUF bos/eos token of {named} contains ':'")

    def framed(seq: str, type_id: int) -> list[str]:
        pieces = [ends[0] and ends[0][0], f"${seq}", ends[1] and ends[1][0]]
        return [f"{p}:{type_id}" for p in pieces if p]

    template = processors.TemplateProcessing(
        single=framed("A", 0),
        pair=framed("A", 0) + framed("B", 1),
        special_tokens=list(dict.fromkeys(named)),
    )
    return processors.Sequence([*steps, template])


def build_tokenizer(meta: dict[str, Any]) -> Any:
    """A ``transformers.PreTrainedTokenizerFast`` rebuilt from ``tokenizer.ggml.*``.

    Raises GGUFError for a tokenizer it cannot rebuild exactly (see ``tokenizer_kind``).
    """
    from transformers import PreTrainedTokenizerFast

    kind = tokenizer_kind(meta)
    tokens = _tokens(meta)
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        dup = next(t for i, t in enumerate(tokens) if vocab[t] != i)
        raise GGUFError(f"GGUF vocabulary holds the token {dup!r} twice")
    if kind.sentencepiece:
        tok = _sentencepiece_tokenizer(meta, tokens)
    else:
        tok = _bpe_tokenizer(meta, kind, vocab)
    if (framing := _made(lambda: _framing(meta, tokens, kind))) is not None:
        tok.post_processor = framing
    types = _token_types(meta, len(tokens))
    _made(lambda: _add_whole_tokens(tok, tokens, types))

    def token_of(key: str) -> str | None:
        i = _token_id(meta, key, tokens)
        return None if i is None else tokens[i]

    arch = meta_str(meta, "general.architecture", "llama")
    return _made(lambda: PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=token_of("bos"),
        eos_token=token_of("eos"),
        unk_token=token_of("unknown"),
        pad_token=token_of("padding"),
        chat_template=meta_str(meta, "tokenizer.chat_template") or _fallback_template(arch, kind),
        clean_up_tokenization_spaces=kind.clean_spaces,
        model_max_length=meta_int(meta, f"{arch}.context_length", 2048, lo=1),
    ))


def _made(build: Any) -> Any:
    """``build()``; the tokenizers library's own errors on odd vocabularies or merges
    (a merge of a token that is not in the vocabulary...) become a GGUFError."""
    try:
        return build()
    except GGUFError:
        raise
    except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception from Rust
        raise GGUFError(f"GGUF tokenizer metadata cannot be built: {e}") from e


def _add_whole_tokens(tok: Any, tokens: list[str], types: list[int]) -> None:
    """Special and user-defined tokens, which llama.cpp matches in the raw text
    before splitting it."""
    from tokenizers import AddedToken

    special = [t for t, k in zip(tokens, types) if k in _SPECIAL_TYPES]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    user = [AddedToken(t, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED]
    if user:
        tok.add_tokens(user)


def _fallback_template(arch: str, kind: TokenizerKind) -> str | None:
    """The chat template of a file that carries none: ChatML for SmolLM2, Gemma's turns
    for Gemma 3; other models get none rather than a guess."""
    if arch == "gemma3":
        return GEMMA_CHAT_TEMPLATE
    return _CHAT_TEMPLATE if kind is _SMOLLM else None
