"""Every private name of mlx_lm the package reaches, in one place.

The server and the caches subclass mlx_lm's classes and override or read their private
members; a new mlx_lm may rename any of them without notice. ``PRIVATE_NAMES`` lists
each one (``tests/test_deps.py`` checks that the package's source uses no other, and
that the installed mlx_lm still has every one), so a version bump is checked here
rather than found by a server that fails on its first request.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
import textwrap
from types import ModuleType
from typing import Any

# (mlx_lm module, name or Class.attr, why the package needs it).
PRIVATE_NAMES: tuple[tuple[str, str, str], ...] = (
    ("mlx_lm.models.cache", "_BaseCache",
     "base of the compressed caches: mlx_lm's helpers take them as its own caches"),
    ("mlx_lm.models.cache", "LRUPromptCache._trie",
     "the compressed prompt cache looks up and pops entries in mlx_lm's token trie"),
    ("mlx_lm.models.cache", "LRUPromptCache._lru",
     "eviction order: the compressed prompt cache pushes, removes and pops its entries"),
    ("mlx_lm.models.cache", "LRUPromptCache.CacheOrder._lrus",
     "an entry kept by the byte budget goes back to the old end of its queue"),
    ("mlx_lm.models.cache", "LRUPromptCache._n_bytes",
     "entry sizes are the compressed bytes, charged on the base's counter"),
    ("mlx_lm.models.cache", "LRUPromptCache._n_bytes_by_type",
     "the same charge per cache type, which the base's stats report"),
    ("mlx_lm.generate", "BatchGenerator._next",
     "the server's fair interleaving of prefill and decode wraps one batch step"),
    ("mlx_lm.generate", "BatchGenerator._prompt_batch",
     "replaced by a prompt batch that moves caches instead of copying them"),
    ("mlx_lm.generate", "BatchGenerator._generation_batch",
     "whether a decode step waits, and the caches checked for reference cycles"),
    ("mlx_lm.generate", "BatchGenerator._unprocessed_sequences",
     "queued prompts: their order, cancellation and the work left to prefill"),
    ("mlx_lm.generate", "BatchGenerator._counters",
     "prompt time of a step: the decode credit the prefill share earns"),
    ("mlx_lm.server", "_run_http_server",
     "starts mlx_lm's HTTP server with the limited handler and our generator"),
    ("mlx_lm.server", "_make_sampler",
     "a request's sampler is built once on the handler thread, so bad settings fail early"),
    ("mlx_lm.server", "_make_logits_processors",
     "the same dry run for the request's logits processors"),
    ("mlx_lm.server", "ResponseGenerator._make_state_machine",
     "the same dry run for the request's stop sequences"),
    ("mlx_lm.server", "ModelProvider._load",
     "models load through veloxquant_mlx.models.load; sharded under mlx.launch"),
    ("mlx_lm.server", "ResponseGenerator._generate",
     "the generation thread runs with the server's BatchGenerator bound in"),
    ("mlx_lm.server", "ResponseGenerator._tokenize",
     "requests are tokenized on the handler thread, before admission"),
    ("mlx_lm.server", "ResponseGenerator._await_response",
     "waits for a response while watching the client and the generation thread"),
    ("mlx_lm.server", "ResponseGenerator._generation_thread",
     "tells the generation thread from a handler thread"),
    ("mlx_lm.server", "ResponseGenerator._time_budget",
     "a shorter intake budget, so short requests are not held behind a prefill"),
    ("mlx_lm.server", "ResponseGenerator._share_request",
     "under mlx.launch, leaves rank 0's unpicklable request parts out of what is sent"),
    ("mlx_lm.server", "ResponseGenerator._generation_failed",
     "a follower rank exits non-zero when its generation thread failed"),
    ("mlx_lm.server", "ResponseGenerator._next_request",
     "records the requests a generation loop took, to fail only those if it fails"),
    ("mlx_lm.server", "ResponseGenerator._stop",
     "a loop failure while stopping is not recovered from"),
    ("mlx_lm.server", "ResponseGenerator._is_distributed",
     "a loop failure under mlx.launch is fatal: ranks would not agree on a retry"),
    ("mlx_lm.server", "APIHandler._set_cors_headers",
     "no CORS header unless the server's allowed origins name the request's"),
    ("mlx_lm.server", "APIHandler._set_completion_headers",
     "the limited handler's own JSON refusals send mlx_lm's headers"),
    ("mlx_lm.tokenizer_utils", "TokenizerWrapper._tokenizer",
     "the Hugging Face tokenizer inside: its model_max_length and fast backend"),
)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


@functools.cache
def class_private_names(cls: type) -> frozenset[str]:
    """Private names one class defines itself: in its body, or as ``self._x`` in its
    methods (instance attributes exist only in the source until an instance is made)."""
    names = {n for n in vars(cls) if _is_private(n)}
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return frozenset(names)
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    for item in body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(item):
                if (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                        and sub.value.id == "self" and _is_private(sub.attr)):
                    names.add(sub.attr)
    return frozenset(names)


def _module(name: str) -> ModuleType | None:
    """One of the mlx_lm modules the list names (imported here, statically, so the
    package's import graph sees them); None for any other."""
    import mlx_lm.generate
    import mlx_lm.models.cache
    import mlx_lm.server
    import mlx_lm.tokenizer_utils  # noqa: F401

    return sys.modules.get(name) if name.startswith("mlx_lm.") else None


def _resolve(module: str, dotted: str) -> Any:
    obj: Any = _module(module)
    if obj is None:
        raise AttributeError(module)
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def has_private_name(module: str, name: str) -> bool:
    """Whether the installed mlx_lm still defines ``module``'s ``name`` (``Class.attr``
    for a member: defined by the class or an mlx_lm class it derives from)."""
    owner, _, attr = name.rpartition(".")
    try:
        if not owner:
            return hasattr(_module(module) or object(), attr)
        cls = _resolve(module, owner)
    except AttributeError:
        return False
    if not inspect.isclass(cls):
        return False
    return any(attr in class_private_names(k) for k in inspect.getmro(cls)
               if k.__module__.startswith("mlx_lm"))


def missing_private_names() -> list[str]:
    """``module:name`` of every listed private name the installed mlx_lm lacks."""
    return [f"{m}:{n}" for m, n, _ in PRIVATE_NAMES if not has_private_name(m, n)]
