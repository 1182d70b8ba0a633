"""The prompt cache's disk tier (``apps.disk_tier``) under the server's RAM pool.

Requests are served in process as mlx_lm.server's generation loop serves them
(tests/test_server_reuse.py's ``turn``); RAM entries are evicted with ``trim_to`` and
the writer thread is waited for with ``flush``. Settings are each method's lossless
ones, so a restored cache must give exactly the tokens of one never evicted.

Run as a script on the embedded model, it prints a ~4k-token conversation's restore
from disk against its prefill (seconds, ratio) and its file's bytes against fp16::

    python tests/test_disk_tier.py --method kivi:bits=4 --method turboquant
    python tests/test_disk_tier.py --method kivi:bits=4 --tokens 1024 --at-rest 3
"""

from __future__ import annotations

import contextlib
import logging
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import pytest
from test_server_reuse import KEY, SYSTEM, Provider, generator, turn, words

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.apps import disk_tier as disk_mod
from veloxquant_mlx.apps import prompt_cache as prompt_cache_mod
from veloxquant_mlx.apps.disk_tier import INDEX, AtRestCodec, DiskTier, model_identity
from veloxquant_mlx.apps.prompt_reuse import CompressedPromptCache
from veloxquant_mlx.apps.server_salt import SaltedPromptCache
from veloxquant_mlx.registry import get_method


@pytest.fixture(scope="module")
def model() -> Any:
    from veloxquant_mlx.testing.tiny import tiny_model

    return tiny_model("llama", seed=5)


def lossless(method: str) -> KVCacheConfig:
    return KVCacheConfig(method, **get_method(method).profile.lossless)


def tier(folder: Path, model: Any, config: KVCacheConfig, max_bytes: int | None = None,
         name: str = "tiny") -> DiskTier:
    return DiskTier(folder, max_bytes, model_identity(model, name), config.to_string())


def pool_over(folder: Path, model: Any, config: KVCacheConfig, cls: type = CompressedPromptCache,
              **kwargs: Any) -> CompressedPromptCache:
    return cls(Provider(model), config, disk=tier(folder, model, config, **kwargs))


def evict_all(pool: CompressedPromptCache) -> None:
    pool.trim_to(n_sequences=0)
    pool.disk.flush()
    assert len(pool) == 0


def states(caches: list[Any]) -> list[mx.array]:
    from mlx.utils import tree_flatten

    return [a for _, a in tree_flatten([c.state for c in caches])]


@pytest.mark.parametrize("method", ["none", "kivi", "turboquant", "xkv"])
def test_a_restored_cache_gives_what_a_never_evicted_one_gives(
        model: Any, method: str, tmp_path: Path) -> None:
    config = lossless(method)
    kept_pool, gen = CompressedPromptCache(Provider(model), config), generator(model)
    pool = pool_over(tmp_path, model, config)
    first = [SYSTEM, words(10, 1)]
    _, _, kept = turn(kept_pool, gen, first)
    assert turn(pool, gen, first)[2] == kept
    evict_all(pool)
    # One file: the conversation's entry holds its system prompt's exactly (dropped).
    assert [len(e["tokens"]) for e in pool.disk.entries.values()] == [len(kept)]
    nxt = kept + [7]
    restored, rest = pool.fetch_nearest_cache(KEY, nxt)
    never, rest_never = kept_pool.fetch_nearest_cache(KEY, nxt)
    assert rest == rest_never == [7] and pool.counters["from_disk"] == 1
    for a, b in zip(states(restored), states(never), strict=True):
        if isinstance(b, mx.array):
            assert a.dtype == b.dtype and mx.array_equal(a, b).item(), method
        else:
            assert a == b, method
    del restored, never
    second = [SYSTEM, kept[len(SYSTEM):] + words(6, 2)]
    answer, reused, _ = turn(pool, gen, second)
    assert (answer, reused) == turn(kept_pool, gen, second)[:2]
    assert reused == len(kept)
    pool.close_disk()


def test_a_restart_serves_the_next_turn_from_disk(model: Any, tmp_path: Path) -> None:
    config = lossless("kivi")
    pool, gen = pool_over(tmp_path, model, config), generator(model)
    _, _, kept = turn(pool, gen, [[1] + words(19, 1)])
    pool.close_disk()  # shutdown: every kept cache is written
    assert [len(e["tokens"]) for e in pool.disk.entries.values()] == [len(kept)]
    again = pool_over(tmp_path, model, config)
    assert len(again) == 0 and len(again.disk.entries) == 1
    nxt = [kept + words(5, 2)]
    answer, reused, _ = turn(again, gen, nxt)
    assert reused == len(kept) and again.counters["from_disk"] == 1
    assert answer == turn(CompressedPromptCache(Provider(model), config, max_size=0), gen,
                          nxt)[0]
    # A branch after a restart: the file is reused only as far as it is exact.
    third = pool_over(tmp_path, model, config)
    assert turn(third, gen, [kept[:15] + words(4, 3)])[1] == 15
    assert third.counters["trimmed"] == 1
    again.close_disk()
    third.close_disk()


def test_the_disk_budget_drops_the_least_recently_used_file(model: Any,
                                                           tmp_path: Path) -> None:
    config = lossless("kivi")
    pool, gen = pool_over(tmp_path, model, config), generator(model)
    kept = {c: turn(pool, gen, [[c] + words(19, c)])[2] for c in (1, 2, 3)}
    evict_all(pool)
    sizes = sorted(e["bytes"] for e in pool.disk.entries.values())
    pool.disk.close()
    # Room for two conversations' files, not three.
    budget = sizes[-1] + sizes[-2] + 1
    small = pool_over(tmp_path, model, config, max_bytes=budget)
    assert small.disk.nbytes == sum(sizes)  # opening never deletes within the index
    turn(small, gen, [kept[1] + [9]])  # conversation 1 becomes the most recent
    assert small.counters["from_disk"] == 1
    one = next(e for e in small.disk.entries.values() if e["tokens"][0] == 1)
    small.disk.put(None, [4] + words(19, 4), small.disk.codec.load(
        tmp_path / one["file"], model)[0])
    firsts = {e["tokens"][0] for e in small.disk.entries.values()}
    assert small.disk.nbytes <= budget and 1 in firsts and 4 in firsts and 2 not in firsts
    small.close_disk()


def test_a_file_of_another_model_or_config_is_refused_by_name(
        model: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from veloxquant_mlx.testing.tiny import tiny_model

    config, gen = lossless("kivi"), generator(model)
    pool = pool_over(tmp_path, model, config)
    _, _, kept = turn(pool, gen, [[1] + words(19, 1)])
    pool.close_disk()
    other = tiny_model("llama", seed=6)  # same shapes, other weights
    assert model_identity(other, "tiny") != model_identity(model, "tiny")
    with caplog.at_level(logging.WARNING):
        foreign = pool_over(tmp_path, other, config)
        assert turn(foreign, generator(other), [kept + [5]])[1] == 0
        name = next(iter(pool.disk.entries.values()))["file"]
        assert f"{name} was saved for model tiny#" in caplog.text
        wrong = KVCacheConfig("kivi", bits=2, group_size=32)
        assert turn(pool_over(tmp_path, model, wrong), gen, [kept + [5]])[1] == 0
        assert "skipped, never loaded" in caplog.text
    foreign.close_disk()
    # A file swapped under an entry that the index says is ours: refused on load.
    caplog.clear()
    ours = pool_over(tmp_path, model, config)
    entry = next(e for e in ours.disk.entries.values() if len(e["tokens"]) == len(kept))
    evil = DiskTier(tmp_path / "evil", None, model_identity(other, "tiny"), config.to_string())
    evil.put(None, kept, ours.disk.codec.load(tmp_path / entry["file"], model)[0])
    (tmp_path / "evil" / entry["file"]).replace(tmp_path / entry["file"])
    with caplog.at_level(logging.WARNING):
        assert turn(ours, gen, [kept + [5]])[1] == 0  # prefilled instead
    assert f"refused {entry['file']}" in caplog.text and ours.disk.counters["refused"] == 1
    assert entry["file"] not in {e["file"] for e in ours.disk.entries.values()}
    ours.close_disk()
    evil.close()


def test_a_crash_while_writing_leaves_the_index_and_other_files_loadable(
        model: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config, gen = lossless("kivi"), generator(model)
    pool = pool_over(tmp_path, model, config)
    kept = {c: turn(pool, gen, [[c] + words(19, c)])[2] for c in (1, 2, 3)}
    pool.trim_to(n_sequences=1)  # conversations 1 and 2 to disk
    pool.disk.flush()
    index = (tmp_path / INDEX).read_text()
    real = prompt_cache_mod.replacing

    @contextlib.contextmanager
    def dies_halfway(path: Any) -> Any:
        with real(path) as tmp:
            yield tmp
            tmp.write_bytes(tmp.read_bytes()[: tmp.stat().st_size // 2])
            raise OSError("no space left on device")

    monkeypatch.setattr(prompt_cache_mod, "replacing", dies_halfway)
    evict_all(pool)  # conversation 3's write fails halfway
    assert pool.disk.counters["write_failed"] == 1
    assert (tmp_path / INDEX).read_text() == index
    monkeypatch.undo()
    # Killed between a file and the index write: a file without an entry.
    monkeypatch.setattr(disk_mod, "write_text", lambda *a: (_ for _ in ()).throw(OSError()))
    with pytest.raises(OSError):
        pool.disk.put(None, kept[3], pool.disk.codec.load(
            tmp_path / next(iter(pool.disk.entries.values()))["file"], model)[0])
    monkeypatch.undo()
    (tmp_path / f".{'ab' * 16}.123-0123456789ab.tmp.safetensors").write_bytes(b"half")
    (tmp_path / "model.safetensors").write_bytes(b"someone else's")
    pool.disk.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 6, files  # index, two files, the orphan, the temporary, another's
    after = pool_over(tmp_path, model, config)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [INDEX, "model.safetensors"] + [e["file"] for e in after.disk.entries.values()])
    assert len(after.disk.entries) == 2
    answer, reused, _ = turn(after, gen, [kept[1] + [9]])
    assert reused == len(kept[1])
    assert answer == turn(CompressedPromptCache(Provider(model), config, max_size=0), gen,
                          [kept[1] + [9]])[0]
    # An entry whose file is gone is forgotten at start, never fatal.
    (tmp_path / after.disk.entries[next(iter(after.disk.entries))]["file"]).unlink()
    after.disk.close()
    assert len(pool_over(tmp_path, model, config).disk.entries) == 1


def _salted_turn(pool: SaltedPromptCache, gen: Any, prompt: list[int],
                 salt: str | None) -> tuple[list[int], int, list[int]]:
    # What the pool and the batch generator read of a ``server_limits.Ticket``.
    ticket = SimpleNamespace(salt=salt, pinned=False, stop_progress=None, cancelled=False,
                             ctx=None, generated=0, prompt_done=0, prompt_total=0,
                             track=lambda layers: None)
    return turn(pool, gen, [prompt], ticket=ticket)


def test_salts_never_cross_on_disk(model: Any, tmp_path: Path) -> None:
    config, gen = lossless("kivi"), generator(model)
    pool = pool_over(tmp_path, model, config, cls=SaltedPromptCache)
    prompt = [1] + words(19, 1)
    _, _, kept = _salted_turn(pool, gen, prompt, "alice")
    pool.close_disk()
    assert {e["salt"] for e in pool.disk.entries.values()} == {"alice"}
    again = pool_over(tmp_path, model, config, cls=SaltedPromptCache)
    assert _salted_turn(again, gen, kept + [5], "bob")[1] == 0
    assert _salted_turn(again, gen, kept + [5], None)[1] == 0
    assert again.counters["from_disk"] == 0
    assert _salted_turn(again, gen, kept + [5], "alice")[1] == len(kept)
    again.close_disk()


def test_the_flags_name_what_is_wrong(tmp_path: Path) -> None:
    import argparse

    from veloxquant_mlx.apps.server import add_serve_arguments

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_serve_arguments(parser)
    args = parser.parse_args(["--prompt-cache-dir", str(tmp_path / "d"),
                              "--prompt-cache-disk-bytes", "2MB"])
    assert args.prompt_cache_dir == str(tmp_path / "d") and args.prompt_cache_disk_bytes > 0
    (tmp_path / "file").write_text("x")
    with pytest.raises(argparse.ArgumentError, match="--prompt-cache-dir="):
        parser.parse_args(["--prompt-cache-dir", str(tmp_path / "file" / "sub")])
    assert args.prompt_cache_at_rest is None  # off by default
    assert parser.parse_args(["--prompt-cache-at-rest"]).prompt_cache_at_rest == 3.0
    assert parser.parse_args(["--prompt-cache-at-rest", "1.5"]).prompt_cache_at_rest == 1.5
    with pytest.raises(argparse.ArgumentError, match="--prompt-cache-at-rest='9'"):
        parser.parse_args(["--prompt-cache-at-rest", "9"])


def test_entries_at_rest_are_restored_and_checked_like_any_file(
        model: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    from veloxquant_mlx.apps.at_rest import at_rest_header, calibrate_at_rest
    from veloxquant_mlx.testing.tiny import tiny_model

    monkeypatch.setenv("VELOXQUANT_CACHE_DIR", str(tmp_path / "calibrations"))
    other = tiny_model("llama", seed=6)
    for m in (model, other):
        calibrate_at_rest(m, words(200, 9))
    config, gen = lossless("kivi"), generator(model)

    def at_rest_pool(folder: Path, m: Any) -> CompressedPromptCache:
        # A window longer than the histories: every token kept exactly (lossless).
        disk = DiskTier(folder, None, model_identity(m, "tiny"), config.to_string(),
                        AtRestCodec(m, bits=2, window=64))
        return CompressedPromptCache(Provider(m), config, disk=disk)

    kept_pool, pool = CompressedPromptCache(Provider(model), config), at_rest_pool(tmp_path, model)
    first = [SYSTEM, words(10, 1)]
    _, _, kept = turn(kept_pool, gen, first)
    assert turn(pool, gen, first)[2] == kept
    evict_all(pool)
    entry = next(iter(pool.disk.entries.values()))
    header = at_rest_header(tmp_path / entry["file"])
    assert header is not None and header["saved"]["method"] == "kivi"
    second = [SYSTEM, kept[len(SYSTEM):] + words(6, 2)]
    answer, reused, _ = turn(pool, gen, second)
    assert (answer, reused) == turn(kept_pool, gen, second)[:2]
    assert reused == len(kept) and pool.counters["from_disk"] == 1
    pool.close_disk()
    # Another model's file at rest swapped under our entry: refused by name, prefilled.
    from veloxquant_mlx.adapter.builder import KVCacheBuilder

    evil = at_rest_pool(tmp_path / "evil", other)
    caches = KVCacheBuilder.for_model(other, config)
    other(mx.array(kept)[None], cache=caches)
    evil.disk.put(None, kept, caches)
    evil.close_disk()
    theirs = next(iter(evil.disk.entries.values()))
    assert at_rest_header(tmp_path / "evil" / theirs["file"]) is not None
    ours = at_rest_pool(tmp_path, model)
    mine = next(e for e in ours.disk.entries.values() if e["tokens"] == kept)
    (tmp_path / "evil" / theirs["file"]).replace(tmp_path / mine["file"])
    with caplog.at_level(logging.WARNING):
        assert turn(ours, gen, [kept + [5]])[1] == 0
    assert f"refused {mine['file']}" in caplog.text and "was saved from model" in caplog.text
    assert ours.disk.counters["refused"] == 1
    ours.close_disk()


def test_a_small_pool_keeps_the_newest_conversation_and_spills_the_older(
        model: Any, tmp_path: Path) -> None:
    # Histories past kivi's window: their segments cannot be cut, so each stays an entry.
    config = KVCacheConfig("kivi", bits=4)
    pool = CompressedPromptCache(Provider(model), config, max_size=2,
                                 disk=tier(tmp_path, model, config))
    gen = generator(model)
    kept = [turn(pool, gen, [SYSTEM, words(180, c)])[2] for c in (1, 2)]
    pool.disk.flush()
    assert len(pool) == 2 and pool.counters["not_kept"] == 0
    assert pool.match(kept[1] + [5]) == (KEY, tuple(kept[1]))  # the newest, in RAM
    assert kept[0] in [e["tokens"] for e in pool.disk.entries.values()]
    pool.close_disk()


SLOW_READ_S = 2.0


def test_a_slow_disk_read_does_not_delay_another_requests_tokens(
        model: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The generation loop as mlx_lm.server runs it (this thread): request B decodes
    while request A, whose history is on disk, arrives on its handler thread (admission
    calls ``match``) and is fetched once admitted. The file's read sleeps."""
    config = lossless("kivi")
    pool, gen = pool_over(tmp_path, model, config), generator(model)
    _, _, kept = turn(pool, gen, [[1] + words(19, 1)])
    evict_all(pool)
    real_read, readers = disk_mod.read_file, []

    def slow_read(path: Path) -> int:
        readers.append(threading.current_thread())
        time.sleep(SLOW_READ_S)
        return real_read(path)

    monkeypatch.setattr(disk_mod, "read_file", slow_read)
    cache, rest = pool.fetch_nearest_cache(KEY, [2] + words(19, 2))
    (b,) = gen.insert_segments([[rest]], max_tokens=[40], caches=[cache], all_tokens=[[]])
    del cache
    a_prompt = kept + [7]
    admitted = threading.Event()
    handler = threading.Thread(target=lambda: (pool.match(a_prompt), admitted.set()))
    handler.start()
    stamps, a_rest, b_done = [time.perf_counter()], None, False
    while not b_done or a_rest is None:
        if admitted.is_set() and a_rest is None:
            a_cache, a_rest = pool.fetch_nearest_cache(KEY, a_prompt)
        if b_done:
            time.sleep(0.01)
            continue
        for r in gen.next()[1]:
            if r.uid == b:
                stamps.append(time.perf_counter())
                b_done = r.finish_reason is not None
    handler.join()
    gaps = [y - x for x, y in zip(stamps, stamps[1:])]
    assert len(gaps) == 40 and max(gaps) < SLOW_READ_S / 2, max(gaps)
    assert readers and threading.main_thread() not in readers
    assert a_rest == [7] and pool.counters["prefetched"] == pool.counters["from_disk"] == 1
    del a_cache
    pool.close_disk()


def _measure(model: Any, config: KVCacheConfig, ids: list[int], folder: Path,
             codec: Any = None) -> str:
    from veloxquant_mlx.adapter.builder import KVCacheBuilder
    from veloxquant_mlx.adapter.prefill import prefill

    start = time.perf_counter()
    caches = KVCacheBuilder.for_model(model, config)
    prefill(model, caches, mx.array(ids, dtype=mx.int32), 512)
    mx.eval(states(caches))
    prefill_s = time.perf_counter() - start
    disk = DiskTier(folder, None, model_identity(model, "embedded"), config.to_string(), codec)
    start = time.perf_counter()
    disk.put(None, ids, caches)
    write_s = time.perf_counter() - start
    entry = next(iter(disk.entries.values()))
    start = time.perf_counter()
    restored = disk.read(entry, model)
    assert restored is not None
    mx.eval(states(restored))
    restore_s = time.perf_counter() - start
    probe = mx.array([[ids[-1]]])
    diff = mx.abs(model(probe, cache=restored) - model(probe, cache=caches)).max().item()
    fp16 = sum(2 * i.n_kv_heads * i.head_dim * len(ids) * 2
               for i in KVCacheBuilder.layer_infos(model) if i is not None)
    form = "as held" if codec is None else f"at rest {codec.bits:g} bits"
    return (f"{config.to_string()} ({form}): {len(ids)} tokens; prefill {prefill_s:.2f} s, restore "
            f"{restore_s:.3f} s (ratio {restore_s / prefill_s:.3f}), write {write_s:.3f} s; "
            f"file {entry['bytes'] / 2**20:.1f} MiB vs fp16 {fp16 / 2**20:.1f} MiB "
            f"({entry['bytes'] / fp16:.3f}); next-token logits max |diff| {diff:.1e}")


def _main(argv: list[str]) -> None:
    import argparse

    from veloxquant_mlx.models import load

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", action="append", default=None)
    p.add_argument("--tokens", type=int, default=4096, help="tokens of the conversation")
    p.add_argument("--at-rest", type=float, default=None, metavar="BITS",
                   help="files at rest (--prompt-cache-at-rest BITS), the model calibrated "
                   "first on 1024 tokens of the stdlib-docstring text when it has none")
    args = p.parse_args(argv)
    model, tok = load()
    text = (Path(__file__).parent.parent / "README.md").read_text()
    ids = tok.encode(text * (1 + args.tokens * 5 // max(len(text), 1)))[:args.tokens]
    codec = None
    if args.at_rest is not None:
        from veloxquant_mlx.apps.at_rest import calibrate_at_rest, load_calibration
        from veloxquant_mlx.eval.text import encode, load_text

        if load_calibration(model) is None:
            calibrate_at_rest(model, encode(tok, load_text())[:1024])
        codec = AtRestCodec(model, args.at_rest)
    for spec in args.method or ["kivi:bits=4", "turboquant"]:
        with tempfile.TemporaryDirectory() as folder:
            print(_measure(model, KVCacheConfig.from_string(spec), ids, Path(folder), codec),
                  flush=True)


if __name__ == "__main__":
    _main(sys.argv[1:])


def test_a_restarted_server_serves_the_next_turn_from_disk(tmp_path: Path) -> None:
    from test_server import VOCAB, write_tiny_model

    from veloxquant_mlx.eval import loadtest

    write_tiny_model(tmp_path)
    extra = ["--prefill-step-size", "32", "--prompt-cache-dir", str(tmp_path / "kept")]
    history = [{"role": "user", "content": loadtest.words(60, VOCAB, 2)}]
    with loadtest.ServerProcess("kivi:bits=4", "64MB", str(tmp_path), extra,
                                tmp_path / "serve.log") as server:
        status, first = loadtest.post_json(server.port, {"messages": history, "max_tokens": 8})
        assert status == 200, first
    # Stopped (SIGTERM): its kept cache was written at shutdown.
    assert len(json_index(tmp_path / "kept")) == 1, (tmp_path / "serve.log").read_text()
    history += [first["choices"][0]["message"],
                {"role": "user", "content": loadtest.words(6, VOCAB, 3)}]
    with loadtest.ServerProcess("kivi:bits=4", "64MB", str(tmp_path), extra,
                                tmp_path / "serve2.log") as server:
        status, second = loadtest.post_json(server.port, {"messages": history,
                                                          "max_tokens": 8})
        assert status == 200, second
        snap = loadtest.get_json(server.port, "/limits")[1]["prompt_cache"]["counters"]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first["usage"]["prompt_tokens"] <= cached < second["usage"]["prompt_tokens"]
    assert snap["from_disk"] == 1


def json_index(folder: Path) -> dict[str, Any]:
    import json

    return json.loads((folder / INDEX).read_text())["entries"]
