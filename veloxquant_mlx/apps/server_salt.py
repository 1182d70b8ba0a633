"""``cache_salt``: kept caches shared only between requests that carry the same salt.

By default the server's kept caches (``apps.prompt_reuse``) are shared by token prefix
between all clients, and ``usage.prompt_tokens_details.cached_tokens`` tells a caller
how much of its prompt matched a cache someone else's request left. A request with a
``cache_salt`` (vLLM's name for the field) is matched and kept under its own key: the
model key paired with the salt. Requests without one share as before.
"""

from __future__ import annotations

import weakref
from typing import Any

from veloxquant_mlx.apps.prompt_reuse import CompressedPromptCache


def salted(model: Any, salt: str | None) -> Any:
    """The key under which a request with ``salt`` finds and keeps caches."""
    return model if salt is None else (model, "cache_salt", salt)


class SaltedPromptCache(CompressedPromptCache):
    """The server's prompt cache with one namespace of kept caches per ``cache_salt``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The salt of each layer cache handed out, to keep it under that salt later.
        self._salts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.salted_requests = 0

    def match(self, tokens: list[int], salt: str | None = None) -> Any:
        if salt is None:
            return super().match(tokens)
        # The parent's match on a view whose provider names the salted key (handler
        # threads call this while the generation thread uses the pool: nothing swapped).
        view = _Keyed(self, model_provider=_Keyed(
            self.model_provider, model_key=salted(self.model_provider.model_key, salt)))
        return CompressedPromptCache.match(view, tokens)  # type: ignore[arg-type]

    def fetch_nearest_cache(self, model: Any, tokens: list[int]) -> tuple[list[Any], list[int]]:
        salt = getattr(self.pending_ticket, "salt", None)
        caches, rest = super().fetch_nearest_cache(salted(model, salt), tokens)
        if salt is not None:
            self.salted_requests += 1
        for layer in caches:
            try:
                self._salts[layer] = salt
            except TypeError:  # a cache object without weak references: not kept
                pass
        return caches, rest

    def insert_cache(self, model: Any, tokens: list[int], prompt_cache: list[Any], *,
                     cache_type: str = "assistant") -> None:
        salts = {self._salt_of(layer) for layer in prompt_cache}
        if len(salts) == 1 and _UNKNOWN not in salts:
            model = salted(model, salts.pop())
        elif self.salted_requests:
            # Whose caches these are is unknown: keep nothing rather than share them.
            # (No tokens: the parent frees the caches and keeps nothing.)
            tokens = []
        super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)

    def _salt_of(self, layer: Any) -> Any:
        try:
            return self._salts.get(layer, _UNKNOWN)
        except TypeError:
            return _UNKNOWN


class _Keyed:
    """``target`` with some attributes replaced (a read-only view)."""

    def __init__(self, target: Any, **replaced: Any) -> None:
        self.__dict__.update(replaced)
        self._target = target

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)


_UNKNOWN = object()
