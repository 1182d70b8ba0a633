"""The prompt cache's disk tier: kept caches that leave RAM, and all of them at shutdown.

``veloxquant serve --prompt-cache-dir DIR`` hands every cache the RAM pool
(``apps.prompt_reuse``) evicts, and every kept one at shutdown and every
``PERIOD_S`` seconds, to a writer thread that saves it as one file per cached prefix
(``Codec``: ``apps.prompt_cache``'s format by default, which checks the file against its
header and the model on load). Files and ``index.json`` are written whole or not at all
(``ops.files``). The index maps a hash of (salt, tokens) to the file, its tokens, bytes,
model identity, config string, ``cache_salt`` and last use; files past
``--prompt-cache-disk-bytes`` go least recently used first.

At start, an index entry without its file is forgotten and a file without an entry is
deleted (a crash between the two writes), never fatal; entries of another model or
config are logged by name and never loaded. A request whose longest exactly shared prefix
is longer on disk than in RAM has that file read at the request's arrival
(``CompressedPromptCache.prefetch``, on its handler thread, off the generation thread)
and decoded into the RAM pool on the generation thread (MLX runs there only), where the
usual exact-prefix rule decides how much of it is reused. Entries are matched
only under their own salt. ``AtRestCodec`` (``--prompt-cache-at-rest``) writes the files
transform-coded (``apps.at_rest``); the loader knows either format by its header.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import re
import threading
import time
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from veloxquant_mlx.errors import PromptCacheError
from veloxquant_mlx.ops.files import set_aside, write_text

__all__ = ["AtRestCodec", "Codec", "DiskTier", "SafetensorsCodec", "model_identity",
           "salt_of"]

INDEX = "index.json"
INDEX_FORMAT = 1
SUFFIX = ".safetensors"
PERIOD_S = 120.0  # how often the writer also saves the kept caches not yet on disk


def read_file(path: Path) -> int:
    """Every byte of ``path`` read (and dropped): the OS keeps them for the next read."""
    n = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            n += len(chunk)
    return n


class Codec(Protocol):
    """How one cached prefix is stored: swap this to change the at-rest format."""

    def save(self, path: Path, caches: list[Any], meta: dict[str, str]) -> None: ...

    def load(self, path: Path, model: Any) -> tuple[list[Any], dict[str, str]]: ...


class SafetensorsCodec:
    """``apps.prompt_cache``'s files: the compressed state as held, checked on load."""

    def save(self, path: Path, caches: list[Any], meta: dict[str, str]) -> None:
        from veloxquant_mlx.apps.prompt_cache import save_prompt_cache

        save_prompt_cache(path, caches, metadata=meta)

    def load(self, path: Path, model: Any) -> tuple[list[Any], dict[str, str]]:
        from veloxquant_mlx.apps.prompt_cache import load_prompt_cache

        return load_prompt_cache(path, model, return_metadata=True)


class AtRestCodec(SafetensorsCodec):
    """Files at rest (``apps.at_rest``, ``--prompt-cache-at-rest``): transform-coded,
    loaded and checked as any saved cache (the loader knows them by their header).

    Without a calibration of the model on this machine, the first history of at least
    ``calibrate_from`` tokens makes one; shorter ones before it are saved as held (a
    basis fitted on a few tokens would code every later file badly)."""

    computes = True  # transform coding runs MLX: written on the generation thread

    def __init__(self, model: Any, bits: float, window: int | None = None,
                 calibrate_from: int = 256) -> None:
        from veloxquant_mlx.apps.prompt_cache import AT_REST_WINDOW

        self.model, self.bits, self.calibrate_from = model, bits, calibrate_from
        self.window = AT_REST_WINDOW if window is None else window

    def save(self, path: Path, caches: list[Any], meta: dict[str, str]) -> None:
        from veloxquant_mlx.apps.at_rest import load_calibration
        from veloxquant_mlx.apps.prompt_cache import save_prompt_cache

        tokens = max((getattr(c, "offset", 0) for c in caches), default=0)
        # Caches that dropped tokens, or that hold a layer's input, cannot come back from
        # keys and values: saved as held.
        whole = not any(getattr(getattr(c, "profile", None), "evicts", False) or getattr(getattr(c, "profile", None), "hooks_module", False)
                        for c in caches)
        if not whole or (tokens < self.calibrate_from and load_calibration(self.model) is None):
            super().save(path, caches, meta)
            return
        save_prompt_cache(path, caches, metadata=meta, at_rest=True, model=self.model,
                          at_rest_bits=self.bits, at_rest_window=self.window)


def model_identity(model: Any, name: str) -> str:
    """``name`` and a fingerprint of the model's cache layers and first weights: two
    models of one shape but other weights differ too."""
    from veloxquant_mlx.adapter.builder import KVCacheBuilder

    infos = [i.to_dict() if i is not None else None for i in KVCacheBuilder.layer_infos(model)]
    digest = hashlib.sha256(json.dumps(infos, sort_keys=True, default=str).encode())
    leaves = tree_flatten(model.parameters())
    if leaves:
        sample = leaves[0][1].reshape(-1)[:256].astype(mx.float32)
        digest.update(np.asarray(sample).tobytes())
    return f"{name}#{digest.hexdigest()[:16]}"


def salt_of(model_key: Any) -> str | None:
    """The ``cache_salt`` inside a pool key (``server_salt.salted``'s shape), else None."""
    if isinstance(model_key, tuple) and len(model_key) == 3 and model_key[1] == "cache_salt":
        return str(model_key[2])
    return None


# A cached prefix's file, or the temporary ``ops.files.replacing`` writes it through.
_OURS = re.compile(r"(\.)?[0-9a-f]{32}(\.[0-9]+-[0-9a-f]{12}\.tmp)?\.safetensors")


def _name(salt: str | None, tokens: list[int]) -> str:
    return hashlib.sha256(json.dumps([salt, tokens]).encode()).hexdigest()[:32]


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class DiskTier:
    """One folder of cached prefixes for one model and config, within ``max_bytes``."""

    def __init__(self, folder: str | Path, max_bytes: int | None, identity: str,
                 config: str, codec: Codec | None = None) -> None:
        self.folder, self.max_bytes = Path(folder), max_bytes
        self.identity, self.config = identity, config
        self.codec: Codec = codec if codec is not None else SafetensorsCodec()
        self.lock = threading.RLock()
        self._index_lock = threading.Lock()
        self.counters = dict.fromkeys(("written", "write_failed", "restored", "refused",
                                       "evicted"), 0)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.entries: dict[str, dict[str, Any]] = self._read_index()
        self._clean()
        self._queue: queue.Queue = queue.Queue()
        self._closed = False
        self.periodic: Any = None
        self._writer = threading.Thread(target=self._write_loop, name="prompt-cache-disk",
                                        daemon=True)
        self._writer.start()

    # ---- the index ----
    def _read_index(self) -> dict[str, dict[str, Any]]:
        path = self.folder / INDEX
        if not path.is_file():
            return {}
        try:
            data = json.loads(path.read_text("utf-8"))
            entries = data["entries"] if data.get("format") == INDEX_FORMAT else None
            if not isinstance(entries, dict):
                raise ValueError(f"format {data.get('format')!r}, expected {INDEX_FORMAT}")
            return {k: e for k, e in entries.items() if isinstance(e, dict)
                    and isinstance(e.get("file"), str) and isinstance(e.get("tokens"), list)}
        except (OSError, ValueError, AttributeError, KeyError) as exc:
            set_aside(path, f"not a prompt-cache index: {exc}")
            return {}

    def _write_index(self) -> None:
        # The writer and the generation thread both write it: one at a time, or an older
        # text could replace a newer one.
        with self._index_lock:
            with self.lock:
                text = json.dumps({"format": INDEX_FORMAT, "entries": self.entries})
            write_text(self.folder / INDEX, text)

    def _clean(self) -> None:
        """Forget entries without a file, delete files without an entry (a crash between
        the two writes) and temporaries left by a killed write; log other models' entries."""
        known = {e["file"] for e in self.entries.values()}
        for path in self.folder.iterdir():
            # Only names this tier writes: a folder shared with other files keeps them.
            if _OURS.fullmatch(path.name) and path.name not in known:
                path.unlink(missing_ok=True)
        for key, e in list(self.entries.items()):
            if not (self.folder / e["file"]).is_file():
                logging.warning("prompt cache disk: %s is in the index but missing; "
                                "forgotten", e["file"])
                del self.entries[key]
            elif (e.get("model"), e.get("config")) != (self.identity, self.config):
                logging.warning("prompt cache disk: %s was saved for model %s, config %s; "
                                "this server has %s, %s: skipped, never loaded", e["file"],
                                e.get("model"), e.get("config"), self.identity, self.config)
        self._write_index()

    @property
    def nbytes(self) -> int:
        with self.lock:
            return sum(int(e.get("bytes", 0)) for e in self.entries.values())

    def _ours(self, e: dict[str, Any], salt: str | None) -> bool:
        return (e.get("model"), e.get("config"), e.get("salt")) == (
            self.identity, self.config, salt)

    # ---- reading (the generation thread) ----
    def lookup(self, salt: str | None, probe: list[int], better_than: int,
               whole: bool = False) -> dict[str, Any] | None:
        """The entry of ``salt`` sharing the longest prefix (> ``better_than``) with
        ``probe``, for this model and config (``whole``: only entries whose every token
        is in that prefix, reused without a cut); its ``common`` is that length."""
        best, best_n = None, better_than
        with self.lock:
            for e in self.entries.values():
                if self._ours(e, salt):
                    n = _common(e["tokens"], probe)
                    if n > best_n and (not whole or n == len(e["tokens"])):
                        best, best_n = dict(e), n
        return None if best is None else {**best, "common": best_n}

    def warm(self, entry: dict[str, Any]) -> bool:
        """Read ``entry``'s file once, off the generation thread, so that its load there
        comes from the page cache; plain file reads only (no MLX work)."""
        try:
            read_file(self.folder / entry["file"])
        except OSError:
            return False
        return True

    def read(self, entry: dict[str, Any], model: Any) -> list[Any] | None:
        """The caches of ``entry``; None (logged by name, entry dropped) when its file is
        unreadable or was saved for another model or config."""
        path = self.folder / entry["file"]
        try:
            caches, meta = self.codec.load(path, model)
            have = (meta.get("model"), meta.get("config"), meta.get("salt", ""))
            want = (self.identity, self.config, entry.get("salt") or "")
            if have != want:
                raise PromptCacheError(f"{str(path)!r} was saved for model {have[0]}, config "
                                       f"{have[1]}; expected {want[0]}, {want[1]}")
        except (PromptCacheError, OSError) as exc:
            self.counters["refused"] += 1
            logging.warning("prompt cache disk: refused %s: %s", entry["file"], exc)
            self._forget(_name(entry.get("salt"), entry["tokens"]))
            return None
        self.counters["restored"] += 1
        self._touch(_name(entry.get("salt"), entry["tokens"]))
        return caches

    def _touch(self, key: str) -> None:
        with self.lock:
            if key in self.entries:
                self.entries[key]["last_use"] = time.time()
        self._write_index()

    def _forget(self, key: str) -> None:
        with self.lock:
            e = self.entries.pop(key, None)
        if e is not None:
            (self.folder / e["file"]).unlink(missing_ok=True)
            self._write_index()

    # ---- writing (the writer thread) ----
    def submit(self, salt: str | None, tokens: list[int], caches: list[Any],
               cache_type: str = "assistant") -> None:
        """Save ``caches`` (of ``tokens``) later, on the writer thread; a codec that
        computes with MLX (at rest) writes now, on the caller's thread: MLX runs on the
        generation thread only (two threads evaluating at once can crash the process)."""
        if getattr(self.codec, "computes", False):
            self.put(salt, list(tokens), list(caches), cache_type)
            return
        if self._closed:  # after shutdown nothing would write it: dropped, as without disk
            logging.info("prompt cache disk: closed; a cache of %d tokens is not written",
                         len(tokens))
            return
        self._queue.put((salt, list(tokens), list(caches), cache_type))

    def flush(self) -> None:
        """Wait until everything submitted so far is written (or has failed)."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the writer (later submissions are dropped)."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        self._queue.put(None)
        self._writer.join()

    def _write_loop(self) -> None:
        while True:
            try:
                job = self._queue.get(timeout=PERIOD_S)
            except queue.Empty:
                # Kept caches go to disk now and then, unless writing them computes with
                # MLX (at rest): that happens on the generation thread only.
                if self.periodic is not None and not getattr(self.codec, "computes", False):
                    self.periodic()
                continue
            try:
                if job is None:
                    return
                self.put(*job)
            except Exception as exc:  # a failed write must not stop later ones
                self.counters["write_failed"] += 1
                logging.warning("prompt cache disk: a cache of %d tokens was not written "
                                "(%s); the index and other files are unchanged",
                                len(job[1]), exc)
            finally:
                self._queue.task_done()

    def put(self, salt: str | None, tokens: list[int], caches: list[Any],
            cache_type: str = "assistant") -> None:
        """Write one cached prefix, then the index; then evict past the budget."""
        key = _name(salt, tokens)
        with self.lock:
            known = key in self.entries
        if known:
            self._touch(key)
            return
        meta = {"model": self.identity, "config": self.config, "salt": salt or ""}
        path = self.folder / f"{key}{SUFFIX}"
        self.codec.save(path, caches, meta)
        with self.lock:
            self.entries[key] = {"file": path.name, "tokens": tokens,
                                 "bytes": path.stat().st_size, "model": self.identity,
                                 "config": self.config, "salt": salt,
                                 "cache_type": cache_type, "last_use": time.time()}
        self.counters["written"] += 1
        self._evict()
        self._write_index()

    def _evict(self) -> None:
        """Least recently used files go until the folder fits ``max_bytes``."""
        if self.max_bytes is None:
            return
        with self.lock:
            order = sorted(self.entries, key=lambda k: self.entries[k].get("last_use", 0))
            gone = []
            while order and self.nbytes > self.max_bytes:
                gone.append(self.entries.pop(order.pop(0)))
        for e in gone:
            self.counters["evicted"] += 1
            (self.folder / e["file"]).unlink(missing_ok=True)
