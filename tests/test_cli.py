"""The ``veloxquant`` command line: ``generate`` against the installed mlx_lm.generate's
own parser, the old flat method flags refused with their new spelling, a run end to end
on a tiny model folder, and ``doctor``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
import pytest
from test_server import write_tiny_model

from veloxquant_mlx import KVCacheConfig, cli
from veloxquant_mlx.apps import doctor
from veloxquant_mlx.apps.generate import mlx_lm_parser
from veloxquant_mlx.options import ConfigError
from veloxquant_mlx.testing.tiny import tiny_model


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny llama with a word-level chat tokenizer, in mlx_lm's folder format."""
    out = tmp_path_factory.mktemp("tiny-llama")
    write_tiny_model(out)
    return out


@pytest.fixture()
def no_reexec(monkeypatch: pytest.MonkeyPatch) -> None:
    from veloxquant_mlx.apps import blas

    monkeypatch.setattr(blas, "ensure_fast_blas", lambda argv=None: None)


def generate_parser() -> argparse.ArgumentParser:
    sub = next(a for a in cli.build_parser()._actions
               if isinstance(a, argparse._SubParsersAction))
    return sub.choices["generate"]


def _sample_value(action: argparse.Action) -> list[str]:
    """Command-line words giving ``action`` a value other than its default."""
    if action.nargs == 0:
        return []
    if action.type is int:
        return ["7"]
    if action.type is float:
        return ["0.25"]
    if action.dest == "verbose":
        return ["False"]
    return ["a", "b"] if action.nargs == "+" else ["x.json" if "config" in action.dest
                                                   else "x"]


def test_every_mlx_lm_generate_flag_parses_as_in_mlx_lm() -> None:
    ours, theirs = generate_parser(), mlx_lm_parser()
    flags = [(flag, a) for a in theirs._actions for flag in a.option_strings
             if a.dest != "help"]
    assert len(flags) > 30  # the installed parser was read, not an empty one
    for flag, action in flags:
        assert flag in ours._option_string_actions, flag
        argv = [flag, *_sample_value(action)]
        mine, want = vars(ours.parse_args(argv)), vars(theirs.parse_args(argv))
        assert mine[action.dest] == want[action.dest], (flag, mine[action.dest])
        # Every other flag of mlx_lm's keeps mlx_lm's default (the model: the embedded one).
        assert {k: mine[k] for k in want} == want, flag
    # The older bare --verbose still parses, as --verbose True.
    assert ours.parse_args(["--verbose"]).verbose is True
    assert ours.parse_args(["--kv", "kivi:bits=2"]).kv == "kivi:bits=2"


@pytest.mark.parametrize("argv, spelling", [
    ("--method kivi --bits 2", "use --kv kivi:bits=2"),
    ("--method kivi:bits=4 --window 64", "use --kv kivi:bits=4,window=64"),
    ("--method turboquant --k-bits 3 --turboquant-seed 5",
     "use --kv turboquant:k_bits=3,seed=5"),
    ("--config best.json", "use --kv-config best.json"),
    ("--method xkv --xkv-rank-k 64 --no-chat", "use --kv xkv:rank_k=64 --ignore-chat-template"),
    ("--max-ctx 4096", "use --kv METHOD:max_ctx=4096"),
])
def test_old_flags_are_refused_with_the_new_spelling(argv: str, spelling: str,
                                                     capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        cli.build_parser().parse_args(["generate", *argv.split()])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: veloxquant generate") and spelling in err, err


def test_every_old_option_flag_is_refused(capsys: pytest.CaptureFixture) -> None:
    parser, mlx_flags = cli.build_parser(), set(mlx_lm_parser()._option_string_actions)
    flags = {"--method", "--config"} | {
        "--" + n.replace("_", "-") for field, (_, aliases, _) in cli._option_flags().items()
        for n in (field, *aliases)}
    flags -= mlx_flags  # --seed: mlx_lm's sampling seed now
    assert {"--t", "--kernel", "--pooling", "--retention", "--store", "--bits"} <= flags
    for flag in sorted(flags):
        with pytest.raises(SystemExit):
            parser.parse_args(["generate", flag, "1"])
        assert "--kv" in capsys.readouterr().err, flag


def _spy(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Records what ``mlx_lm.generate`` is called with, and calls it."""
    seen: dict[str, Any] = {}
    real = mlx_lm.generate

    def spy(model: Any, tokenizer: Any, prompt: Any, **kwargs: Any) -> str:
        seen.update(kwargs, prompt=tokenizer.decode(prompt))
        return real(model, tokenizer, prompt, **kwargs)

    monkeypatch.setattr(mlx_lm, "generate", spy)
    return seen


def test_generate_runs_end_to_end_on_a_tiny_model(folder: Path, no_reexec: None,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture) -> None:
    seen = _spy(monkeypatch)
    assert cli.main(["generate", "--model", str(folder), "--kv", "turboquant", "--temp", "0.7",
                     "--top-p", "0.9", "--system-prompt", "w1 w2", "--prompt", "w3 w4",
                     "-m", "5", "--seed", "3"]) == 0
    out, err = capsys.readouterr()
    # mlx_lm's verbose default: the text between its rules, then its speeds.
    assert out.count("==========") == 2 and "Generation: 5 tokens" in out, out
    assert "[veloxquant] method=turboquant held=" in err and "ratio=" in err, err
    assert seen["prompt"].split() == ["<|im_start|>", "system", "w1", "w2", "<|im_end|>",
                                      "<|im_start|>", "user", "w3", "w4", "<|im_end|>",
                                      "<|im_start|>", "assistant"]
    assert {type(c).__name__ for c in seen["prompt_cache"]} == {"TurboQuantCache"}
    assert seen["max_tokens"] == 5 and seen["draft_model"] is None
    # The sampler samples (at temperature 0 it would always pick the first token).
    draws = {seen["sampler"](mx.zeros((1, 8))).item() for _ in range(40)}
    assert len(draws) > 1, draws


def test_generate_quiet_prints_the_text_only(folder: Path, no_reexec: None,
                                            capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["generate", "--model", str(folder), "--prompt", "w3", "-m", "3",
                     "--ignore-chat-template", "--verbose", "F"]) == 0
    out, err = capsys.readouterr()
    assert "==========" not in out and out.strip(), out
    assert "method=none" in err


def test_prompt_cache_file_is_loaded_and_checked(folder: Path, no_reexec: None,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    from veloxquant_mlx import KVCacheBuilder, KVCacheConfig, models, save_prompt_cache

    model, _ = models.load(str(folder))
    config = KVCacheConfig("kivi", bits=4, group_size=32)
    caches = KVCacheBuilder.for_model(model, config)
    model(mx.array([[6 + i for i in range(20)]]), cache=caches)
    path = tmp_path / "prefix.safetensors"
    save_prompt_cache(path, caches, metadata={"model": str(folder)})
    seen = _spy(monkeypatch)
    # No --model: the file's metadata names it, as with mlx_lm.generate.
    assert cli.main(["generate", "--prompt-cache-file", str(path), "--prompt", "w3",
                     "-m", "2", "--verbose", "False"]) == 0
    assert "method=kivi" in capsys.readouterr().err
    assert all(c.offset >= 20 for c in seen["prompt_cache"])
    # Only what follows the cached prefix is prompted: the user turn's end onwards.
    assert seen["prompt"].split()[0] == "w3", seen["prompt"]
    with pytest.raises(SystemExit):
        cli.main(["generate", "--prompt-cache-file", str(path), "--kv", "turboquant"])
    assert "holds caches of 'kivi:bits=4', not 'turboquant'" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--kv-bits", "4"], "use --kv affine:bits=4,group_size=64"),
    (["--kv", "kivi", "--max-kv-size", "64"], "method 'kivi' keeps its own"),
    (["--image", "a.png"], "--image: veloxquant generate runs text prompts only"),
    (["--kv", "kivi:bits=9"], "kivi.bits=9"),
    (["--kv", "kivi", "--kv-config", "{cfg}"], "names method 'kivi' but --kv-config"),
    (["--chat-template-config", "{x"], "--chat-template-config is not a JSON object"),
])
def test_generate_refuses_by_name(argv: list[str], message: str, folder: Path,
                                  no_reexec: None, tmp_path: Path,
                                  capsys: pytest.CaptureFixture) -> None:
    from veloxquant_mlx import KVCacheConfig

    KVCacheConfig("turboquant").to_file(tmp_path / "c.json")
    argv = [a.replace("{cfg}", str(tmp_path / "c.json")) for a in argv]
    with pytest.raises(SystemExit) as info:
        cli.main(["generate", "--model", str(folder), "-m", "1", *argv])
    err = capsys.readouterr().err
    assert info.value.code == 2 and message in err and err.count("\n") == 1, err


def test_kv_config_with_a_spec_of_its_method_overrides_its_options(tmp_path: Path) -> None:
    from veloxquant_mlx import KVCacheConfig
    from veloxquant_mlx.apps.generate import generate_config

    KVCacheConfig("kivi", bits=2, window=64).to_file(tmp_path / "c.json")
    args = generate_parser().parse_args(["--kv-config", str(tmp_path / "c.json"),
                                         "--kv", "kivi:bits=4"])
    assert generate_config(args) == KVCacheConfig("kivi", bits=4, window=64)


def test_max_kv_size_bounds_the_dense_cache(folder: Path, no_reexec: None,
                                           monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture) -> None:
    seen = _spy(monkeypatch)
    assert cli.main(["generate", "--model", str(folder), "--max-kv-size", "8", "--prompt",
                     " ".join(f"w{i}" for i in range(20)), "-m", "2",
                     "--verbose", "False"]) == 0
    assert {c.max_size for c in seen["prompt_cache"]} == {8}
    assert "method=none" in capsys.readouterr().err


def test_draft_model_runs_where_the_caches_trim_and_is_refused_where_not(
        folder: Path, no_reexec: None, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    from veloxquant_mlx.cache.turboquant import TurboQuantCache

    seen = _spy(monkeypatch)
    argv = ["generate", "--model", str(folder), "--draft-model", str(folder), "--kv",
            "turboquant", "--prompt", "w5 w6", "-m", "4", "--verbose", "False"]
    assert cli.main(argv) == 0
    assert seen["draft_model"] is not None and seen["num_draft_tokens"] == 3
    capsys.readouterr()
    monkeypatch.setattr(TurboQuantCache, "is_trimmable", lambda self: False)
    with pytest.raises(SystemExit):
        cli.main(argv)
    assert "--draft-model: method 'turboquant' cannot drop the draft tokens" in \
        capsys.readouterr().err


# ---------------------------------------------------------------- doctor
def test_doctor_reports_versions_platform_and_each_method(folder: Path, no_reexec: None,
                                                          capsys: pytest.CaptureFixture
                                                          ) -> None:
    from veloxquant_mlx.ops import native
    from veloxquant_mlx.registry import methods

    cli.main(["doctor", "--model", str(folder)])
    out = capsys.readouterr().out
    for name in ("python", "mlx", "mlx-lm"):
        assert any(line.split()[:1] == [name] for line in out.splitlines()), name
    assert mlx_lm.__version__ in out and mx.__version__ in out
    assert f"fused extension: {native.status()}" in out
    assert f"device: {mx.default_device()}" in out and "BLAS: " in out
    assert all(f"  {kind} codes: " in out for kind in ("token", "channel", "float"))
    assert "slots 0-3: KVCache (full attention)" in out
    rows = {line.split()[0]: line.split()[1] for line in out.split("methods (")[1]
            .splitlines()[1:]}
    assert set(rows) == set(methods())
    assert rows["none"] == "dense" and rows["kivi"] == "compress"
    assert rows["affine"] == "refuse"  # group 64 does not divide the head width of 32


def test_doctor_says_what_is_left_dense_and_what_is_refused() -> None:
    lines = doctor.model_lines(tiny_model("gemma3_text"))
    snapkv = next(line for line in lines if line.split()[:1] == ["snapkv"])
    assert "compresses slots 1, 3; leaves slots 0, 2: RotatingKVCache (sliding window 16)" \
        in snapkv and "no sliding-window form" in snapkv
    for ring in ("kivi", "turboquant"):  # a ring over their codes on the sliding layers
        line = next(line for line in lines if line.split()[:1] == [ring])
        assert "compresses slots 0-3" in line and "leaves" not in line
    lines = doctor.model_lines(tiny_model("mamba"))
    assert "slots 0-3: ArraysCache (not a KV cache: the model's own)" in lines[1]
    assert all(" refuse " in line and "no plain full-attention layers" in line
               for line in lines[3:]), lines


def test_doctor_flags_a_version_outside_the_declared_range(monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture
                                                           ) -> None:
    ranges = doctor.declared_ranges(
        ['mlx>=0.29; platform_system == "Nowhere"', "mlx[cpu]>=99", "mlx-lm>=0.1,<1",
         'pytest; extra == "dev"'], ">=3.10")
    assert ranges == {"python": ">=3.10", "mlx": ">=99", "mlx-lm": "<1,>=0.1"}
    lines = doctor.version_lines(ranges, {"python": "3.11.7", "mlx": "0.32.4",
                                          "mlx-lm": "0.32.2"})
    assert [line.split()[-1] for line in lines[1:]] == ["ok", "range", "ok"]
    assert doctor.OUTSIDE in lines[2]
    monkeypatch.setattr(doctor, "declared_ranges", lambda: ranges)
    assert doctor.run_doctor(with_model=False) == 1
    assert doctor.OUTSIDE in capsys.readouterr().out


def _serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in cli.build_parser()._actions
               if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


# A value per mlx_lm.server flag that takes one (the rest are switches).
SERVER_VALUES = {"--model": "m", "--adapter-path": "a", "--host": "127.0.0.1", "--port": "8081",
                 "--allowed-origins": "http://localhost:3000", "--draft-model": "d",
                 "--num-draft-tokens": "2", "--log-level": "INFO", "--chat-template": "t",
                 "--temp": "0.5", "--top-p": "0.9", "--top-k": "5", "--min-p": "0.1",
                 "--max-tokens": "9", "--chat-template-args": '{"enable_thinking": false}',
                 "--decode-concurrency": "2", "--prompt-concurrency": "2",
                 "--prefill-step-size": "64", "--prompt-cache-size": "3",
                 "--prompt-cache-bytes": "1GB", "--kv-bits": "4", "--kv-group-size": "32",
                 "--quantized-kv-start": "0"}


def test_serve_accepts_every_flag_of_mlx_lm_server() -> None:
    from veloxquant_mlx.apps.server_flags import mlx_lm_server_flags, refuse_unsupported

    flags = mlx_lm_server_flags()
    assert len(flags) > 20 and "--top-p" in flags  # the reader found mlx_lm's parser
    parser = _serve_parser()
    for flag in flags:
        argv = [flag] + ([SERVER_VALUES[flag]] if flag in SERVER_VALUES else [])
        args = parser.parse_args(argv)
        if flag in ("--adapter-path", "--draft-model", "--kv-bits", "--pipeline"):
            with pytest.raises(ConfigError, match=flag):
                refuse_unsupported(args)
        else:
            refuse_unsupported(args)
    args = parser.parse_args(["--top-p", "0.9", "--allowed-origins", "http://a:1", "http://b:2",
                              "--kv", "kivi:bits=4"])
    from veloxquant_mlx.apps.server import allowed_origins, build_server_args
    from veloxquant_mlx.apps.server_flags import kv_config

    assert build_server_args(args).top_p == 0.9
    assert allowed_origins(args) == ["http://a:1", "http://b:2"]
    assert kv_config(args, KVCacheConfig()).to_string() == "kivi:bits=4"
