"""Evaluation text: English prose available on every machine, and token windows.

The default corpus is the docstrings of the Python standard library, read from the
source files with ``ast`` (nothing is imported, so no module side effects), in sorted
file order, with code-like paragraphs (doctests, tables, signatures) dropped. The
same Python version gives the same text on every machine.
"""

from __future__ import annotations

import ast
import functools
import random
import re
import sysconfig
from pathlib import Path
from typing import Any

# Fraction of a paragraph's characters that must be letters, spaces or plain
# punctuation for it to count as prose.
_PROSE_FRACTION = 0.9
_PROSE_CHARS = re.compile(r"[A-Za-z ,.;:'\"()\-?!]")


def _is_prose(paragraph: str) -> bool:
    if len(paragraph) < 80 or ">>>" in paragraph or "::" in paragraph:
        return False
    if paragraph.count("(") > 3 or "_" in paragraph or "=" in paragraph:
        return False
    words = paragraph.split()
    if len(words) < 12:
        return False
    good = len(_PROSE_CHARS.findall(paragraph))
    return good / len(paragraph) >= _PROSE_FRACTION


def _docstrings(source: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    nodes = [tree] + [
        n for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    ]
    out = []
    for node in nodes:
        doc = ast.get_docstring(node, clean=True)
        if doc:
            out.append(doc)
    return out


def _paragraphs(doc: str) -> list[str]:
    paras = []
    for block in re.split(r"\n\s*\n", doc):
        # Indented blocks are code or option lists, not prose.
        if any(line.startswith((" ", "\t")) for line in block.splitlines()):
            continue
        text = " ".join(block.split())
        if _is_prose(text):
            paras.append(text)
    return paras


@functools.lru_cache(maxsize=4)
def stdlib_text(max_chars: int = 500_000) -> str:
    """Prose paragraphs from the standard library's docstrings, deterministic order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p for p in root.rglob("*.py")
        if not any(part in ("test", "tests", "idle_test", "site-packages", "lib2to3")
                   for part in p.relative_to(root).parts)
    )
    seen: set[str] = set()
    paras: list[str] = []
    total = 0
    for path in files:
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for doc in _docstrings(source):
            for para in _paragraphs(doc):
                if para in seen:
                    continue
                seen.add(para)
                paras.append(para)
                total += len(para) + 2
        if total >= max_chars:
            break
    return "\n\n".join(paras)


def load_text(path: str | None = None) -> str:
    """The user's text file, or the standard-library docstring corpus."""
    if path is None:
        return stdlib_text()
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"--text {str(path)!r}: no such file")
    text = p.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise ValueError(f"--text {str(path)!r} is empty")
    return text


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens (BOS is not part of the windows)."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    # The Rust tokenizer directly: fast, and no "longer than the model" warning.
    backend = getattr(inner, "backend_tokenizer", None)
    if backend is not None:
        return list(backend.encode(text, add_special_tokens=False).ids)
    try:
        return list(inner.encode(text, add_special_tokens=False))
    except TypeError:
        return list(inner.encode(text))


def token_windows(tokens: list[int], length: int, windows: int, seed: int = 0) -> list[list[int]]:
    """``windows`` non-overlapping slices of ``length`` tokens, chosen by ``seed``.

    The slots are the consecutive non-overlapping slices of the text; the seed picks
    which ones (in text order), so every method is scored on the same windows.
    """
    if windows < 1:
        raise ValueError(f"windows={windows} is not allowed: an integer >= 1")
    if length < 2:
        raise ValueError(f"window length {length} is not allowed: at least 2 tokens")
    slots = len(tokens) // length
    if slots < windows:
        raise ValueError(
            f"the text has {len(tokens)} tokens: too short for {windows} window(s) of "
            f"{length} tokens (context + predict); need at least {windows * length} "
            "tokens: pass a longer --text, or lower --windows / --context / --predict"
        )
    picked = sorted(random.Random(seed).sample(range(slots), windows))
    return [tokens[s * length:(s + 1) * length] for s in picked]
