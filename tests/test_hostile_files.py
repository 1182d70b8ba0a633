"""Files from outside: saved caches, configs, kernel choices and tuner journals that are
wrong, and writes that fail halfway.

A saved cache's arrays, meta_state, entries, config and header are mutated at random
(headers rewritten to match, so the checksums pass): loading gives ``PromptCacheError``
or caches that decode to finite logits, never another exception, a crash or NaNs. Config
strings and JSON give ``ConfigError`` or a config. A write that fails leaves the previous
file; a foreign kernels.json or journal is set aside with a warning and rebuilt.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from conftest import PROMPT, small_config
from conftest import run_prefill as prefill
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from veloxquant_mlx import KVCacheBuilder, KVCacheConfig, load_prompt_cache, save_prompt_cache
from veloxquant_mlx.apps.prompt_cache import PromptCacheError, _crc
from veloxquant_mlx.config import ConfigError
from veloxquant_mlx.ops import files, kernels
from veloxquant_mlx.registry import methods
from veloxquant_mlx.testing.tiny import tiny_model

KEY = "veloxquant"
# No shrinking: a failure names its edit, and a broken loader fails in seconds.
SETTINGS = dict(deadline=None, derandomize=True, database=None,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=[HealthCheck.too_slow,
                                       HealthCheck.function_scoped_fixture])


# ---------------------------------------------------------------- saved caches
def _read(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    arrays, meta = mx.load(str(path), return_metadata=True)
    return dict(arrays), json.loads(meta[KEY])


def _write(path: Path, arrays: dict[str, mx.array], header: Any) -> None:
    text = header if isinstance(header, str) else json.dumps(header)
    mx.save_safetensors(str(path), arrays, {KEY: text})


def _descs(node: Any) -> list[dict[str, Any]]:
    if isinstance(node, dict):
        own = [node] if isinstance(node.get("a"), str) else []
        return own + [d for v in node.values() for d in _descs(v)]
    if isinstance(node, list):
        return [d for v in node for d in _descs(v)]
    return []


def _swap(arrays: dict[str, mx.array], header: dict[str, Any], name: str,
          new: mx.array) -> None:
    """Array ``name`` replaced by ``new``, the header written to match (shape, crc)."""
    arrays[name] = new
    for d in _descs(header["layers"]):
        if d["a"] == name:
            d.update(shape=list(new.shape), dtype=str(new.dtype), crc=_crc(new))


def _saved(method: str, folder: Path, model_type: str = "llama", **options: Any
           ) -> tuple[Any, Path]:
    model = tiny_model(model_type)
    caches = KVCacheBuilder.for_model(model, small_config(method, **options))
    prefill(model, caches, PROMPT)
    model(mx.array([[3]]), cache=caches)
    path = folder / f"{method}.safetensors"
    save_prompt_cache(path, caches)
    return model, path


def _outcome(model: Any, path: Path) -> str:
    """``"rejected"`` (PromptCacheError) or ``"decoded"`` (finite logits); else fails."""
    try:
        loaded = load_prompt_cache(path, model=model)
    except PromptCacheError:
        return "rejected"
    for tok in (5, 7):
        logits = model(mx.array([[tok]]), cache=loaded)
    assert mx.isfinite(logits).all().item(), "a loaded file decoded to non-finite logits"
    return "decoded"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 300) | st.floats(allow_nan=False)
    | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=6)


def _array_edit(data: Any, arrays: dict[str, mx.array], header: dict[str, Any]) -> str:
    name = data.draw(st.sampled_from(sorted(arrays)))
    a = arrays[name]
    kind = data.draw(st.sampled_from(["cut", "grow", "dtype", "swap"]))
    axis = data.draw(st.integers(0, a.ndim - 1))
    if kind == "cut" and a.shape[axis] > 1:
        keep = data.draw(st.integers(1, a.shape[axis] - 1))
        new = mx.split(a, [keep], axis=axis)[0]
    elif kind in ("cut", "grow"):
        new = mx.concatenate([a, mx.zeros_like(a)], axis=axis)
    elif kind == "dtype":
        dt = data.draw(st.sampled_from([mx.float16, mx.float32, mx.bfloat16, mx.uint8,
                                        mx.uint32, mx.int32, mx.int8]))
        new = a.astype(dt)
    else:
        new = mx.swapaxes(a, -1, -2) if a.ndim > 1 else a[None]
    _swap(arrays, header, name, new)
    return f"array {name} {kind} {tuple(new.shape)} {new.dtype}"


def _header_edit(data: Any, header: dict[str, Any]) -> str:
    """A random subtree of the header replaced, deleted or retyped."""
    node, path = header, []
    while isinstance(node, (dict, list)) and node and data.draw(st.booleans()):
        key = data.draw(st.sampled_from(sorted(node) if isinstance(node, dict)
                                        else list(range(len(node)))))
        if not isinstance(node[key], (dict, list)) or not node[key]:
            break
        path.append(key)
        node = node[key]
    if not isinstance(node, (dict, list)) or not node:
        return "no edit"
    key = data.draw(st.sampled_from(sorted(node) if isinstance(node, dict)
                                    else list(range(len(node)))))
    if data.draw(st.booleans()):
        del node[key]
        return f"deleted {path + [key]}"
    node[key] = data.draw(json_values)
    return f"set {path + [key]} = {node[key]!r:.40}"


def _meta_edit(data: Any, header: dict[str, Any]) -> str:
    layers = [e for e in header["layers"] if e.get("meta_state")]
    entry = data.draw(st.sampled_from(layers))
    k = data.draw(st.integers(0, len(entry["meta_state"]) - 1))
    entry["meta_state"][k] = data.draw(
        st.integers(-2, 300).map(str) | st.sampled_from(["", "x", "1.5", "0,0"]))
    return f"meta_state[{k}] = {entry['meta_state'][k]!r}"


def _shape_edit(data: Any, header: dict[str, Any]) -> str:
    """Entry counts, layer infos and the config: what the arrays must agree with."""
    kind = data.draw(st.sampled_from(["entries", "info", "option", "method"]))
    if kind == "entries":
        n = data.draw(st.integers(0, 6))
        header["layers"] = (header["layers"] * 2)[:n]
        if data.draw(st.booleans()):
            header["model"]["n_layers"] = n
        return f"{n} entries"
    if kind == "info":
        entry = data.draw(st.sampled_from([e for e in header["layers"] if "layer_info" in e]))
        field = data.draw(st.sampled_from(sorted(entry["layer_info"])))
        entry["layer_info"][field] = data.draw(st.integers(-1, 70) | json_values)
        return f"layer_info {field} = {entry['layer_info'][field]!r:.40}"
    if kind == "method":
        header["config"]["method"] = data.draw(st.sampled_from(sorted(methods())))
        return f"config method {header['config']['method']}"
    options = header["config"]["options"]
    if not options:
        return "no options"
    name = data.draw(st.sampled_from(sorted(options)))
    options[name] = data.draw(st.sampled_from([None, 0, 1, 2, 3, 4, 8, 16, 32, 64, 2.5,
                                               "dense", "affine", True]))
    return f"option {name} = {options[name]!r}"


def test_hostile_saved_caches(method: str, tmp_path: Path) -> None:
    _hostile(method, *_saved(method, tmp_path), 25)


@pytest.mark.parametrize("method", ["affine", "turboquant"])
def test_hostile_saved_rings(method: str, tmp_path: Path) -> None:
    # Gemma 3's sliding-window layers hold a ring over the method's cache.
    _hostile(method, *_saved(method, tmp_path, "gemma3_text"), 20)


def _hostile(method: str, model: Any, path: Path, examples: int) -> None:
    arrays0, header0 = _read(path)
    bad = path.with_name("bad.safetensors")
    seen: Counter[str] = Counter()

    @settings(max_examples=examples, **SETTINGS)
    @given(data=st.data())
    def run(data: Any) -> None:
        arrays, header = dict(arrays0), copy.deepcopy(header0)
        kind = data.draw(st.sampled_from(["array", "array", "meta", "shape", "header"]))
        if kind == "array":
            what = _array_edit(data, arrays, header)
        elif kind == "meta":
            what = _meta_edit(data, header)
        elif kind == "shape":
            what = _shape_edit(data, header)
        else:
            what = _header_edit(data, header)
        _write(bad, arrays, header)
        try:
            seen[_outcome(model, bad)] += 1
        except Exception as exc:
            raise AssertionError(f"{method}: {what}: {exc!r}") from exc

    run()
    print(f"{method}: {sum(seen.values())} hostile files, {dict(seen)}")
    assert seen["rejected"] >= 10


def test_every_array_cut_or_retyped(method: str, tmp_path: Path) -> None:
    """Each saved array in turn with a head fewer, a width fewer, or another dtype (the
    header rewritten to match): refused, or harmless (finite logits)."""
    model, path = _saved(method, tmp_path)
    arrays0, header0 = _read(path)
    bad = tmp_path / "bad.safetensors"
    seen: Counter[str] = Counter()
    for name, a in sorted(arrays0.items()):
        edits = {"uint32": a.astype(mx.uint32)}
        if a.ndim > 1 and a.shape[1] > 1:
            edits["a head fewer"] = a[:, :-1]
        if a.shape[-1] > 1:
            edits["a width fewer"] = a[..., :-1]
        for what, new in edits.items():
            arrays, header = dict(arrays0), copy.deepcopy(header0)
            _swap(arrays, header, name, new)
            _write(bad, arrays, header)
            try:
                seen[_outcome(model, bad)] += 1
            except Exception as exc:
                raise AssertionError(f"{method}: array {name} {what}: {exc!r}") from exc
    print(f"{method}: {sum(seen.values())} edited arrays, {dict(seen)}")
    assert seen["rejected"] >= len(arrays0)


@pytest.fixture()
def affine_64(tmp_path: Path) -> tuple[Any, Path]:
    """The reported case: affine with a window of 64 over 80 tokens (16 coded)."""
    model = tiny_model("llama")
    caches = KVCacheBuilder.for_model(model, KVCacheConfig("affine", bits=4, group_size=32,
                                                           window=64))
    prefill(model, caches, PROMPT + PROMPT)
    path = tmp_path / "a.safetensors"
    save_prompt_cache(path, caches)
    return model, path


def _edit(path: Path, out: Path, arrays_edit: Any = None, header_edit: Any = None) -> Path:
    arrays, header = _read(path)
    if arrays_edit:
        arrays_edit(arrays, header)
    if header_edit:
        header_edit(header)
    _write(out, arrays, header)
    return out


def test_reported_cases_are_named_errors(affine_64: tuple[Any, Path], tmp_path: Path) -> None:
    model, path = affine_64
    out = tmp_path / "x.safetensors"

    def fewer_heads(arrays: dict[str, mx.array], header: dict[str, Any]) -> None:
        for d in _descs(header["layers"][1]["state"]):
            a = arrays[d["a"]]
            if a.dtype == mx.float16 and a.shape[-1] == 1:  # scales and biases
                _swap(arrays, header, d["a"], a[:, :1])
    with pytest.raises(PromptCacheError, match=r"layer 1 \(affine\): state entry 2 \(keys token segment\), "
                       r"array 1: \(1, 1, 16, 1\).*expected \(1, 2, 16, 1\)"):
        load_prompt_cache(_edit(path, out, fewer_heads), model=model)

    def two_entries(h: dict[str, Any]) -> None:
        h["layers"] = h["layers"][:2]
    with pytest.raises(PromptCacheError, match="2 layer entries, expected one per layer"):
        load_prompt_cache(_edit(path, out, header_edit=two_entries), model=model)

    def offset_3(h: dict[str, Any]) -> None:
        h["layers"][0]["meta_state"][0] = "3"
    with pytest.raises(PromptCacheError, match="layer 0 .*80 tokens; the saved offset is 3"):
        load_prompt_cache(_edit(path, out, header_edit=offset_3), model=model)

    def bits_8(h: dict[str, Any]) -> None:
        h["config"]["options"]["bits"] = 8
    with pytest.raises(PromptCacheError, match=r"layer 0 .*keys token segment.*array 0: \(1, 2, 16, 4\) "
                       r"mlx.core.uint32, expected \(1, 2, 16, 8\)"):
        load_prompt_cache(_edit(path, out, header_edit=bits_8), model=model)

    for broken in ({"layers": 3}, {"layers": [1, 2, 3, 4]}, {"config": []},
                   {"model": {"n_layers": "4"}}):
        with pytest.raises(PromptCacheError):
            load_prompt_cache(_edit(path, out, header_edit=lambda h, b=broken: h.update(b)),
                              model=model)


# ---------------------------------------------------------------- configs
spec_keys = st.sampled_from(["bits", "group_size", "window", "rank", "k_bits", "sink",
                             "capacity", "max_ctx", "window_dtype", "rotate", "layers",
                             "store", "", "x"])
spec_values = st.one_of(
    st.integers(-5, 10 ** 12).map(str), st.sampled_from(["none", "true", "2.5", "nan", "",
                                                        "float16", "affine"]),
    st.builds(lambda a, b, o: f"{a}-{b}:{o}", st.integers(-2, 10 ** 9),
              st.integers(-2, 10 ** 9), st.sampled_from(["bits=8", "window=4+bits=3",
                                                        "x=1", "bits", ""])),
    st.text(alphabet="0123456789-:/+=abx", max_size=12))


@settings(max_examples=150, **SETTINGS)
@given(method=st.sampled_from([*methods(), "bogus", ""]),
       items=st.lists(st.tuples(spec_keys, spec_values), max_size=3),
       raw=st.text(max_size=20))
def test_hostile_config_strings(method: str, items: list[tuple[str, str]], raw: str) -> None:
    for spec in (f"{method}:" + ",".join(f"{k}={v}" for k, v in items), f"{method}:{raw}"):
        t0 = time.perf_counter()
        try:
            KVCacheConfig.from_string(spec)
        except ConfigError:
            pass
        assert time.perf_counter() - t0 < 2.0, spec


@settings(max_examples=150, **SETTINGS)
@given(data=json_values | st.fixed_dictionaries(
    {"method": st.sampled_from([*methods(), "bogus"]) | json_values,
     "options": st.dictionaries(spec_keys, json_values, max_size=3) | json_values},
    optional={"max_ctx": json_values, "layers": json_values | st.dictionaries(
        st.sampled_from(["0", "1-3", "0-99999999", "-1"]) | st.integers(-1, 10 ** 9),
        st.dictionaries(spec_keys, json_values, max_size=2), max_size=2)}))
def test_hostile_config_json(data: Any, tmp_path_factory: Any) -> None:
    path = tmp_path_factory.getbasetemp() / "hostile-config.json"
    path.write_text(json.dumps(data))
    for read in (lambda: KVCacheConfig.from_dict(data), lambda: KVCacheConfig.from_file(path)):
        try:
            read()
        except ConfigError:
            pass


@pytest.mark.parametrize("content", [b"\xff\xfe\x00", b"[" * 100000, b"{", b""])
def test_a_config_file_that_is_not_json_is_a_config_error(content: bytes,
                                                           tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match="is not valid JSON"):
        KVCacheConfig.from_file(path)


def test_a_huge_layer_range_is_refused_fast() -> None:
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match="names layer 1000000: layer indices are below"):
        KVCacheConfig.from_string("affine:layers=0-1000000:bits=8")
    assert time.perf_counter() - t0 < 1.0
    with pytest.raises(ConfigError, match="names layer 9: the model has 4 layers"):
        KVCacheConfig("affine", layers="9:bits=8").check_layers(4)


# ---------------------------------------------------------------- writes
_FILL = """
import resource, signal, sys
sys.path.insert(0, {tests!r})
from conftest import run_prefill
import mlx.core as mx
from veloxquant_mlx import KVCacheBuilder, KVCacheConfig, save_prompt_cache
from veloxquant_mlx.testing.tiny import tiny_model
model = tiny_model("llama")
caches = KVCacheBuilder.for_model(model, KVCacheConfig("none"))
run_prefill(model, caches, list(range(1, 120)))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit: EFBIG, no kill
resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
try:
    save_prompt_cache({path!r}, caches)
except OSError as exc:
    print("write failed:", exc)
    sys.exit(3)
"""


def test_a_save_past_the_disk_limit_keeps_the_previous_file(tmp_path: Path) -> None:
    _, path = _saved("affine", tmp_path)
    before = path.read_bytes()
    script = _FILL.format(tests=str(Path(__file__).parent), limit=len(before) + 4096,
                          path=str(path))
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 3, run.stdout + run.stderr  # the bigger save did fail
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temporary left
    load_prompt_cache(path)


def _writers(tmp_path: Path) -> dict[str, tuple[Path, Any]]:
    from veloxquant_mlx.eval import tune
    from veloxquant_mlx.models import gguf

    cfg = KVCacheConfig("affine", bits=8)
    return {
        "config": (tmp_path / "c.json", lambda p: cfg.to_file(p)),
        "journal": (tmp_path / "j.json", lambda p: tune.Journal(p, "f").put("k", 1.0)),
        "text": (tmp_path / "t.json", lambda p: gguf.write_text(p, "{}")),
        "safetensors": (tmp_path / "w.safetensors",
                        lambda p: save_prompt_cache(p, _one_cache())),
    }


def _one_cache() -> list[Any]:
    model = tiny_model("llama")
    caches = KVCacheBuilder.for_model(model, KVCacheConfig("none"))
    prefill(model, caches, PROMPT[:8])
    return caches


@pytest.mark.parametrize("writer", ["config", "journal", "text", "safetensors"])
def test_a_failed_write_keeps_the_previous_file(writer: str, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    path, write = _writers(tmp_path)[writer]
    previous = b'{"fingerprint": "f", "entries": {}}'  # a journal reads it first
    path.write_bytes(previous)

    def full_disk(fd: int) -> None:
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write(path)
    assert path.read_bytes() == previous
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    monkeypatch.undo()
    write(path)
    assert path.read_bytes() != previous


def test_concurrent_writers_get_their_own_temporary(tmp_path: Path) -> None:
    target = tmp_path / "k.json"
    with files.replacing(target) as a, files.replacing(target) as b:
        assert a != b and a.parent == b.parent == tmp_path and a.suffix == ".json"
        a.write_text("1")
        b.write_text("2")
    assert target.read_text() == "1"  # the last to finish wins, whole


# ---------------------------------------------------------------- rebuilt files
FOREIGN = ["[]", '"text"', "{not json", '{"k": 1}', '{"k": {"path": "bogus"}}',
           '{"k": {"path": "packed", "ms": [1]}}']


@pytest.mark.parametrize("content", FOREIGN)
def test_a_foreign_kernels_file_is_set_aside_and_rebuilt(
        content: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path))
    (tmp_path / "kernels.json").write_text(content)
    key = kernels._class_key("token", 4, 32, 64, "key")
    with pytest.warns(RuntimeWarning, match="kernels.json.*moved aside") as caught:
        assert kernels._recorded(key) is None
    assert len(caught) == 1
    aside = [p.name for p in tmp_path.iterdir() if ".bad-" in p.name]
    assert len(aside) == 1 and (tmp_path / aside[0]).read_text() == content
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # rebuilt: no second warning
        kernels._record(key, kernels.Choice("packed", "measured", {"packed": 1.0}))
        assert kernels._recorded(key).path == "packed"


@pytest.mark.parametrize("content", [*FOREIGN, '{"fingerprint": 3, "entries": {}}',
                                     '{"fingerprint": "f", "entries": []}'])
def test_a_foreign_journal_is_set_aside_and_rebuilt(content: str, tmp_path: Path) -> None:
    from veloxquant_mlx.eval import tune

    path = tmp_path / "run.partial.json"
    path.write_text(content)
    with pytest.warns(RuntimeWarning, match="journal|JSON"):
        journal = tune.Journal(path, "f")
    assert journal.get("k") is None
    journal.put("k", 2.0)
    assert tune.Journal(path, "f").get("k") == 2.0
    assert len([p for p in tmp_path.iterdir() if ".bad-" in p.name]) == 1
