"""Compressed prompt caches kept across requests: mlx_lm's ``LRUPromptCache`` for the server.

``CompressedPromptCache`` is mlx_lm's ``LRUPromptCache`` (its token trie, its typed LRU
order, its byte counters, its insertion that drops the prefixes of a trimmable cache,
only those the cache can be cut to exactly here) with what compressed caches and a
shared KV budget need:

- **What a request starts from.** The longest kept prefix of its prompt that leaves at
  least one token to prefill (the last position's logits are computed, never stored). A
  kept cache whose tokens extend the prompt, or diverge from it, is deep-copied and
  trimmed to the common prefix only when every layer says ``is_trimmable()`` and the
  trim succeeds (a method may refuse a cut, e.g. inside an evicted keep-set); otherwise a
  cache is reused only when its tokens are an exact prefix of the prompt. A copy's size
  must equal the shared prefix, so no request sees a state beyond an exactly shared
  token prefix. Nothing else matching: fresh caches from ``KVCacheBuilder.for_model``.
- **Trimmed reuse is exact.** A cache trimmed to ``m`` tokens must hold what a fresh
  cache holds after the same prompt steps cut at ``m`` (a *fresh prefill* of the
  prefix: its tokens in the server's prompt chunks counted from the first token), so
  nothing computed over another conversation's tokens (a scale, a statistic, a basis)
  and no other float/coded split survives. ``exact_prefix`` gives the longest such
  ``m`` up to the shared prefix; a shorter one is reused and the rest of the prompt is
  prefilled (0: the entry is not reused, and the refusing methods are logged by name).
  Which cut each method allows: docs/usage.md ("Which methods reuse how").
- **Copies.** Kept caches and the caches handed out are deep copies made in one
  ``copy.deepcopy`` of the whole layer list, so a cross-layer method's coordinator
  travels with its sequence and the copy's layers share one new coordinator, never the
  original's (``LayerInfo.__deepcopy__``). MLX arrays are immutable: a copy shares the
  buffers until either side writes, so copying costs almost nothing.
- **Memory.** A kept entry is charged what a request of its tokens reserves (the
  allocator-measured line of ``server_limits.KVCost``), or its declared bytes if more.
  Entries count in ``--max-kv-memory`` (``KVBudget.keeper``); a finished request hands
  its entry's share of its reservation over instead of reserving twice. An admitted
  request that needs room evicts entries least recently used first, never one pinned by
  an admitted request that has not copied it yet, and its own intended entry only as a
  last resort. ``--prompt-cache-size`` / ``--prompt-cache-bytes`` bound the entries.
- **Disk.** With a ``DiskTier`` (``apps.disk_tier``, ``--prompt-cache-dir``) an evicted
  entry (or one that did not fit) is handed to its writer thread, and so is every kept
  one at ``persist_kept`` (shutdown, periodically). A request whose prompt shares a
  longer prefix with a file than with any RAM entry loads that file into the pool
  first; the rules above then decide, as for any RAM entry, how much is reused. The
  file is read at the request's arrival (``match``, on its handler thread), so the
  generation thread keeps stepping the other requests meanwhile and then decodes it from
  the page cache (MLX runs on the generation thread only).
"""

from __future__ import annotations

import copy
import gc
import logging
import math
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Collection
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

from veloxquant_mlx.cache.base import CompressedCache, NotTrimmableError
from veloxquant_mlx.cache.batch import in_cycles
from veloxquant_mlx.cache.numerics import Stream
from veloxquant_mlx.config import KVCacheConfig

DEFAULT_ENTRIES = 10  # mlx_lm.server's --prompt-cache-size default
_NO_LIMIT = 1 << 63

Key = tuple[Any, tuple[int, ...]]


class RequestCaches(list):
    """One request's layer caches, carrying its KV reservation through mlx_lm."""

    ticket: Any = None


def _holds(cache: list[Any], n: int) -> bool:
    """Every layer that counts its tokens holds exactly ``n`` of them."""
    return all(c.offset == n for c in cache if isinstance(getattr(c, "offset", None), int))


def _coded(s: Stream, n: int) -> int:
    """Tokens of ``n`` that stream ``s`` holds coded once its last step committed."""
    if s.roundtrip is None:
        return 0
    c = n - s.sink - s.keep
    return max(0, c - c % s.block)


def _stream_prefix(s: Stream, held: int, keep: int) -> int:
    """The longest ``m <= keep`` at which ``s`` cut from ``held`` tokens to ``m`` splits
    sinks, coded and held tokens as a fresh prefill of ``m`` does, and reads each kept
    token as it does."""
    coded = _coded(s, held)
    if coded == 0 or keep >= held:
        return keep  # nothing coded: every token is held as it was received
    sinks = min(keep, s.sink)  # a cut among the sinks leaves only sinks, never coded
    if s.commit != "next" and s.keep:
        # Coded as soon as stored: a chunk's tokens read the codes of those after the
        # cut, so only the uncut cache is a fresh one's.
        return sinks
    if keep >= s.sink + coded + s.keep:
        return keep  # the cut lies in the residual and leaves the coded part whole
    if s.keep or keep <= s.sink:
        return sinks  # a fresh prefill of a shorter prefix holds some coded ones uncoded
    # Codes without residual: whole commit blocks, never a group cut (its kept tokens
    # would come back decoded with scales taken over the dropped ones).
    unit = math.lcm(s.block, s.trim_group)
    return s.sink + (keep - s.sink) // unit * unit


def layer_prefix(cache: Any, keep: int) -> int:
    """The longest prefix ``<= keep`` of one layer's tokens that, trimmed to, it holds as a
    fresh prefill of that prefix would: a method's own ``reusable_prefix``, else what its
    declared numerics (``cache.numerics``) say; a layer whose numerics depend on more
    than each token (merges, bases, scores) is exact only while it compressed nothing."""
    cache = getattr(cache, "inner", cache)  # a sliding ring that never dropped
    if not isinstance(cache, CompressedCache):
        return keep  # mlx_lm's own caches hold tokens as received
    own = type(cache).profile.reusable_prefix(cache, keep)
    if own is not None:
        return min(keep, int(own))
    held = cache.offset
    if keep >= held:
        return keep
    numerics = type(cache).profile.stored_numerics(cache.config, cache.layer)
    if not numerics.exact:
        limit = numerics.lossless_until
        return keep if limit is not None and held <= limit else 0
    if numerics.evict is not None and held > sum(numerics.evict):
        return 0
    return min(_stream_prefix(numerics.keys, held, keep),
               _stream_prefix(numerics.values, held, keep))


def exact_prefix(cache: list[Any], keep: int) -> tuple[int, list[str]]:
    """The longest prefix ``<= keep`` that every layer of ``cache``, trimmed to it, holds
    as a fresh prefill would, and the methods that shortened it."""
    limiting: list[str] = []
    while keep > 0:
        cut = {id(c): layer_prefix(c, keep) for c in cache}
        short = min(cut.values())
        if short >= keep:
            break
        limiting += [str(getattr(c, "method", type(c).__name__)) for c in cache
                     if cut[id(c)] < keep]
        keep = short
    return keep, sorted(set(limiting))


def _finished(ticket: Any) -> bool:
    # The batch generator marks a request that stopped generating before mlx_lm inserts it.
    return ticket is not None and ticket.stop_progress is not None and not ticket.cancelled


class CompressedPromptCache(LRUPromptCache):
    """mlx_lm's prompt cache for compressed caches, inside the server's KV budget."""

    def __init__(self, model_provider: Any, config: KVCacheConfig, limits: Any = None,
                 max_size: int = DEFAULT_ENTRIES, max_bytes: int | None = None,
                 disk: Any = None) -> None:
        super().__init__()
        self.disk = disk  # a DiskTier, or None: evicted entries are gone
        # mlx_lm's insertion evicts to its limits without knowing pins: ours apply after it.
        self.max_size = self.max_bytes = _NO_LIMIT
        self.entry_limit, self.byte_limit = max_size, max_bytes
        self.model_provider, self.config, self.limits = model_provider, config, limits
        self.budget = limits.budget if limits is not None else None
        self.lock = self.budget.lock if self.budget is not None else threading.RLock()
        self.pending_ticket: Any = None  # set by the generation thread before a fetch
        self._pins: Counter[Key] = Counter()
        self._held_out = 0  # entries ``_evict`` holds out of the LRU order while it runs
        # Evicted caches, freed by the generation thread (where mlx_lm frees caches).
        self._dropped: list[list[Any]] = []
        self._owners: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.counters = dict.fromkeys(("requests", "reused", "reused_tokens", "trimmed",
                                       "limited", "kept", "not_kept", "evicted",
                                       "from_disk", "prefetched", "finished"), 0)
        if self.budget is not None:
            self.budget.keeper = self

    def __len__(self) -> int:
        return len(self._lru) + self._held_out

    # ---- finding the entry to start from ----
    def _plan(self, model: Any, tokens: list[int]) -> list[tuple[list[int], int]]:
        """Entries worth copying, best first, each with the tokens it would keep."""
        probe = tokens[:-1]  # the last token is always prefilled
        if self.entry_limit <= 0 or not probe:
            return []
        found = self._trie.search(model, probe)
        exact = probe if found.exact is not None else (found.shorter or [])
        plan = []
        if found.longer is not None and found.common_prefix > len(exact):
            plan.append((found.longer, found.common_prefix))
        if exact:
            plan.append((exact, len(exact)))
        return plan

    def _usable(self, model: Any, key: list[int], keep: int, log: bool = False) -> int:
        """Tokens of entry ``key`` a request sharing its first ``keep`` reuses exactly."""
        cache = self._trie.get(model, key).prompt_cache
        if keep == len(key):
            return keep
        if not can_trim_prompt_cache(cache):
            return 0
        exact, limiting = exact_prefix(cache, keep)
        if exact < keep and log:
            self.counters["limited"] += 1
            logging.info("prompt cache: %s cannot be cut to %d shared tokens as a fresh "
                         "prefill holds them; %d reused", ", ".join(limiting), keep, exact)
        return exact

    def _ranked(self, model: Any, tokens: list[int],
                log: bool = False) -> list[tuple[list[int], int]]:
        """Planned entries with the tokens each reuses exactly, most tokens first."""
        found = [(key, self._usable(model, key, keep, log))
                 for key, keep in self._plan(model, tokens)]
        return sorted([f for f in found if f[1] > 0], key=lambda f: -f[1])

    def _copy(self, model: Any, key: list[int], keep: int) -> list[Any] | None:
        """A deep copy of entry ``key`` cut to its first ``keep`` tokens (a length
        ``_usable`` gave), or ``None``."""
        entry = self._trie.get(model, key)
        cache = copy.deepcopy(entry.prompt_cache)
        if keep < len(key):
            try:
                if trim_prompt_cache(cache, len(key) - keep) != len(key) - keep:
                    return None
            except NotTrimmableError:
                return None
            self.counters["trimmed"] += 1
        if not _holds(cache, keep):
            logging.warning("prompt cache: an entry of %d tokens does not hold them; "
                            "not reused", len(key))
            return None
        self._touch(model, key, entry.cache_type)
        return cache

    def _touch(self, model: Any, key: list[int], cache_type: str) -> None:
        """A reused entry becomes the most recently used of its kind."""
        self._lru.remove(model, key)
        self._lru.push(model, key, cache_type)

    def match(self, tokens: list[int]) -> Key | None:
        """The entry a request of ``tokens`` would start from (admission pins it), a file
        of the disk tier loaded first when it shares more (``prefetch``)."""
        model = self.model_provider.model_key
        self.prefetch(model, list(tokens))
        with self.lock:
            for key, _ in self._ranked(model, list(tokens)):
                return model, tuple(key)
        return None

    def fetch_nearest_cache(self, model: Any, tokens: list[int]) -> tuple[list[Any], list[int]]:
        ticket, self.pending_ticket = self.pending_ticket, None
        tokens = list(tokens)
        cache, keep = None, 0
        self._free_dropped()
        with self.lock:
            self.unpin(ticket)
            self.counters["requests"] += 1
            ranked = self._ranked(model, tokens) if self.disk is not None else []
        if self.disk is not None:
            self._restore(model, tokens, ranked[0][1] if ranked else 0)
        with self.lock:
            for key, n in self._ranked(model, tokens, log=True):
                cache = self._copy(model, key, n)
                if cache is not None:
                    keep = n
                    self.counters["reused"] += 1
                    self.counters["reused_tokens"] += n
                    break
        if cache is None:
            cache = self._fresh()
        else:
            logging.info("prompt cache: %d of %d prompt tokens reused", keep, len(tokens))
        return self._attach(RequestCaches(cache), ticket), tokens[keep:]

    def prefetch(self, model: Any, tokens: list[int]) -> None:
        """At a request's arrival (a handler thread): the disk tier's files sharing a
        longer prefix with ``tokens`` than any RAM entry are read here, off the
        generation thread, which then decodes them from the page cache (MLX runs there
        only: two threads evaluating at once can crash the process)."""
        from veloxquant_mlx.apps.disk_tier import salt_of

        if self.disk is None or self.entry_limit <= 0 or len(tokens) < 2:
            return
        with self.lock:
            ranked = self._ranked(model, tokens)
        in_ram, read = ranked[0][1] if ranked else 0, False
        for whole in (False, True):
            found = self.disk.lookup(salt_of(model), tokens[:-1], in_ram, whole)
            read = (found is not None and self.disk.warm(found)) or read
        if read:
            with self.lock:
                self.counters["prefetched"] += 1

    def _restore(self, model: Any, tokens: list[int], in_ram: int) -> bool:
        """Load the files that give ``tokens`` more than the ``in_ram`` tokens a RAM
        entry gives into the pool as entries; whether one was read."""
        from veloxquant_mlx.apps.disk_tier import salt_of

        if self.entry_limit <= 0 or len(tokens) < 2:
            return False
        loaded = False
        # The longest shared prefix first; when it cannot be cut to what it shares
        # exactly, also the longest file that is a prefix as a whole (a turn's prompt
        # without the answer its client re-tokenized differently).
        for whole in (False, True):
            found = self.disk.lookup(salt_of(model), tokens[:-1], in_ram, whole)
            if found is None:
                continue
            key = list(found["tokens"])
            with self.lock:
                there = self._has((model, tuple(key)))
            if not there:
                loaded = self._load(model, found) or loaded
            with self.lock:
                if self._has((model, tuple(key))):
                    in_ram = max(in_ram, self._usable(model, key, found["common"]))
        return loaded

    def _load(self, model: Any, found: dict[str, Any]) -> bool:
        """Read one disk entry into the pool."""
        caches = self.disk.read(found, self.model_provider.model)
        if caches is None:
            return False
        with self.lock:
            self._keep(model, list(found["tokens"]), caches,
                       found.get("cache_type") or "assistant", None)
            self.counters["from_disk"] += 1
        return True

    def _spill(self, model: Any, tokens: list[int], entry: Any) -> None:
        """An entry leaving RAM goes to disk (on the disk tier's writer thread)."""
        if self.disk is not None:
            from veloxquant_mlx.apps.disk_tier import salt_of

            self.disk.submit(salt_of(model), tokens, entry.prompt_cache, entry.cache_type)

    def persist_kept(self) -> None:
        """Hand every kept entry to the disk tier (at shutdown, and periodically)."""
        if self.disk is None:
            return
        with self.lock:
            kept = [(m, list(t)) for lru in self._lru._lrus.values() for m, t in lru]
            for m, t in kept:
                self._spill(m, t, self._trie.get(m, t))

    def close_disk(self) -> None:
        """Write every kept entry to disk and wait for the writer (at shutdown)."""
        if self.disk is not None:
            self.persist_kept()
            self.disk.close()
            logging.info("prompt cache disk: closed with %d files; %s", len(self.disk.entries),
                         ", ".join(f"{k} {v}" for k, v in self.disk.counters.items()))

    def _fresh(self) -> list[Any]:
        from veloxquant_mlx.adapter.builder import KVCacheBuilder

        return KVCacheBuilder.for_model(self.model_provider.model, self.config)

    def _attach(self, caches: RequestCaches, ticket: Any) -> RequestCaches:
        layers = [c for c in caches if isinstance(c, CompressedCache)]
        if ticket is not None:
            caches.ticket = ticket
            # The reservation lasts until these objects are garbage (they move, never copy).
            ticket.track(layers)
            if layers:
                self._owners[layers[0]] = ticket
        return caches

    # ---- keeping finished and segment caches ----
    def insert_cache(self, model: Any, tokens: list[int], prompt_cache: list[Any], *,
                     cache_type: str = "assistant") -> None:
        tokens = list(tokens)
        cycles = in_cycles(prompt_cache)
        try:
            if self.entry_limit > 0 and tokens and _holds(prompt_cache, len(tokens)):
                ticket = self._owner(prompt_cache)
                # A snapshot: a segment's caches are still being filled by their request.
                kept = copy.deepcopy(list(prompt_cache))
                with self.lock:
                    self._keep(model, tokens, kept, cache_type, ticket)
        finally:
            # mlx_lm's list is a fresh one per call: emptying it drops the request's own
            # objects now (cross-layer caches sit in reference cycles), as before reuse.
            prompt_cache.clear()
            self._free_dropped()
            if cycles:
                gc.collect()
            mx.clear_cache()
            if self.limits is not None:
                self.limits.sample_real()
            if cache_type == "assistant":  # a request's last insert: its cache is settled
                with self.lock:
                    self.counters["finished"] += 1

    def _owner(self, cache: list[Any]) -> Any:
        first = next((c for c in cache if isinstance(c, CompressedCache)), None)
        return None if first is None else self._owners.get(first)

    def _keep(self, model: Any, tokens: list[int], kept: list[Any], cache_type: str,
              ticket: Any) -> None:
        charge = self._charge(kept, len(tokens))
        moved = 0
        if self.budget is not None and _finished(ticket):
            moved = self.budget.transfer(ticket, charge)
        self._insert(model, tokens, kept, cache_type)
        entry = self._trie.get(model, tokens)
        self._n_bytes += charge - entry.nbytes
        self._n_bytes_by_type[cache_type] += charge - entry.nbytes
        entry.nbytes = charge
        # Entries give way to the entry and byte limits (mlx_lm's), never to a snapshot's
        # budget: a finished request's entry was paid by its reservation; a running
        # request's snapshot is kept only in room that is free.
        self._evict(self._within_counts, protect={(model, tuple(tokens))})
        if self._within_counts() and self._fits_budget():
            self.counters["kept"] += 1
            if self.budget is not None:
                self.budget.note_held()
            return
        logging.info("prompt cache: an entry of %d tokens is not kept (%d entries of %d, "
                     "%d pinned, budget %s)", len(tokens), len(self), self.entry_limit,
                     sum(self._pins.values()), "fits" if self._fits_budget() else "full")
        self._spill(model, tokens, self._trie.get(model, tokens))
        self._pop(model, tokens)
        self.counters["not_kept"] += 1
        if moved:
            self.budget.transfer(ticket, -moved)

    def _insert(self, model: Any, tokens: list[int], kept: list[Any], cache_type: str) -> None:
        """mlx_lm's insertion (its entry, byte counters and LRU order; the limits are
        ours), but of the entries of the prefixes of a trimmable cache, which mlx_lm
        drops, only those that ``kept`` cut to them holds exactly: a prefix it cannot be
        cut to exactly keeps its own entry, where it was in the LRU order."""
        entry = LRUPromptCache.CacheEntry(kept, sum(c.nbytes for c in kept), cache_type)
        self._n_bytes += entry.nbytes
        self._n_bytes_by_type[cache_type] += entry.nbytes
        prev = self._trie.add(model, tokens, entry)
        if prev is not None:
            self._n_bytes -= prev.nbytes
            self._n_bytes_by_type[prev.cache_type] -= prev.nbytes
            self._lru.remove(model, tokens)
        self._lru.push(model, tokens, cache_type)
        if not can_trim_prompt_cache(kept):
            return
        for n, old in self._trie.pop_prefixes(model, tokens):
            if exact_prefix(kept, n)[0] == n:
                self._lru.remove(model, tokens[:n])
                self._drop(old)
            else:
                self._trie.add(model, tokens[:n], old)

    def _charge(self, cache: list[Any], n_tokens: int) -> int:
        declared = sum(getattr(c, "nbytes", 0) or 0 for c in cache)
        cost = getattr(self.limits, "cost", None)
        return max(declared, cost.bytes_for(n_tokens) if cost is not None else 0)

    def _within_counts(self) -> bool:
        return len(self) <= self.entry_limit and (
            self.byte_limit is None or self.nbytes <= self.byte_limit)

    def _fits_budget(self) -> bool:
        return self.budget is None or self.budget.reserved + self.nbytes <= self.budget.budget

    # ---- eviction ----
    def _pop(self, model: Any, tokens: list[int]) -> None:
        self._lru.remove(model, tokens)
        self._drop(self._trie.pop(model, tokens))

    def _drop(self, entry: Any) -> None:
        self._n_bytes -= entry.nbytes
        self._n_bytes_by_type[entry.cache_type] -= entry.nbytes
        self._dropped.append(entry.prompt_cache)

    def _free_dropped(self) -> None:
        with self.lock:
            dropped, self._dropped = self._dropped, []
        if any(in_cycles(d) for d in dropped):
            del dropped
            gc.collect()  # cross-layer caches sit in reference cycles

    def _evict(self, done: Callable[[], bool], protect: Collection[Key] = ()) -> None:
        """Drop entries in mlx_lm's LRU order until ``done()``, skipping pinned ones."""
        skipped = []
        while not done() and len(self._lru):
            model, tokens = self._lru.pop()
            key = (model, tuple(tokens))
            if self._pins[key] or key in protect:
                skipped.append((model, tokens))
                self._held_out += 1  # still kept: ``done`` must count it
                continue
            entry = self._trie.pop(model, tokens)
            self._spill(model, tokens, entry)
            self._drop(entry)
            self.counters["evicted"] += 1
        # Back at the old end of their kind's queue, in their order.
        self._held_out -= len(skipped)
        for model, tokens in reversed(skipped):
            kind = self._trie.get(model, tokens).cache_type
            self._lru._lrus[kind].appendleft((model, tokens))

    def trim_to(self, *, n_sequences: int | None = None, n_bytes: int | None = None) -> None:
        n_sequences = _NO_LIMIT if n_sequences is None else max(0, n_sequences)
        n_bytes = _NO_LIMIT if n_bytes is None else max(0, n_bytes)
        with self.lock:
            self._evict(lambda: len(self) <= n_sequences and self.nbytes <= n_bytes)

    # ---- the budget's side (handler threads, under the budget's lock) ----
    def make_room(self, ticket: Any) -> None:
        """Evict until ``ticket`` fits: its own intended entry last."""
        budget = self.budget

        def fits() -> bool:
            return budget.reserved + self.nbytes + ticket.need <= budget.budget

        with self.lock:
            own = {ticket.reuse_key} if ticket.reuse_key is not None else set()
            self._evict(fits, protect=own)
            if not fits() and own:
                self._evict(fits)  # then it starts from a fresh cache

    def _has(self, key: Key) -> bool:
        try:
            self._trie.get(key[0], list(key[1]))
        except KeyError:
            return False
        return True

    def pin(self, ticket: Any) -> None:
        """An admitted request will copy its entry: not evicted until it has."""
        with self.lock:
            key = ticket.reuse_key
            if key is not None and not ticket.pinned and self._has(key):
                self._pins[key] += 1
                ticket.pinned = True

    def unpin(self, ticket: Any) -> None:
        if ticket is None:
            return
        with self.lock:
            if ticket.pinned:
                ticket.pinned = False
                self._pins[ticket.reuse_key] -= 1
                if self._pins[ticket.reuse_key] <= 0:
                    del self._pins[ticket.reuse_key]

    def snapshot(self) -> dict[str, Any]:
        """What ``GET /limits`` reports under ``prompt_cache``."""
        with self.lock:
            return {"entries": len(self), "kept_bytes": self.nbytes,
                    "max_entries": self.entry_limit, "max_bytes": self.byte_limit,
                    "pinned": sum(self._pins.values()), "by_type": self.stats_by_type(),
                    "counters": dict(self.counters)}
