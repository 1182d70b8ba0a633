"""Compressed caches on models sharded over mlx.distributed: real ``mlx.launch`` jobs.

Every job runs ``mlx.launch --backend ring`` on 127.0.0.1 with a bounded timeout. The
launcher's stdin is kept open: at end-of-file it spins a core, and on 2 shared cores
every collective then takes about 35 ms instead of about 1 ms.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import distributed_worker as worker
import mlx.core as mx
import psutil
import pytest

from veloxquant_mlx.apps import distributed as dist
from veloxquant_mlx.apps.prompt_cache import (
    PromptCacheError,
    load_prompt_cache,
    read_prompt_cache_header,
)
from veloxquant_mlx.models import load
from veloxquant_mlx.options import ConfigError
from veloxquant_mlx.testing.tiny import tiny_model

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
WORKER = str(Path(worker.__file__).resolve())
# Logprob agreement with the single process: float sums in another order, except where
# the ranks store something else at 8 bits: XQuant's tensor-parallel ranks store their own
# K/V latents where one process stores X, and XQuant-CL anchors on each pipeline rank's
# first layer.
TOLERANCE = {("tensor", "xquant"): 5e-2, ("pipeline", "xquant_cl"): 1e-2}


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive free ports on 127.0.0.1 (the ring's ports)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            socks = []
            for p in range(base, base + n):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError("no free consecutive ports")


def launch(n: int, args: list[str], timeout: float, env: tuple[str, ...] = ()
           ) -> tuple[str, str, float]:
    """Run ``args`` on ``n`` ranks (``env``: ``NAME=value`` for every rank); stdout,
    stderr and seconds. Killed at ``timeout``."""
    cmd = [str(BIN / "mlx.launch"), "--backend", "ring", "-n", str(n), "--starting-port",
           str(free_ports(n)), *(f"--env={e}" for e in env), "--python", sys.executable,
           "--", *args]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=out, stderr=err,
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        finally:
            proc.stdin.close()
        took = time.monotonic() - start
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode()
    assert took < timeout, f"mlx.launch ran past {timeout} s:\n{stdout[-2000:]}\n{stderr[-4000:]}"
    return stdout, stderr, took


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("distributed")
    return {kind: worker.write_tiny_model(base / kind, kind) for kind in ("llama", "qwen2")}


# ---------------------------------------------------------------- planning, in-process
def test_plan_names_both_requirements_and_the_head_counts() -> None:
    model = tiny_model("llama", hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                       head_dim=64, intermediate_size=1536)
    with pytest.raises(dist.ShardingError) as info:
        dist.plan_sharding(model, 2)
    text = str(info.value)
    for part in ("9 query heads", "3 KV heads", "over 2 ranks", "tensor parallelism needs",
                 "pipeline parallelism needs", "PipelineMixin", "[1, 3]"):
        assert part in text, (part, text)
    plan = dist.plan_sharding(model, 3, rank=1)
    assert (plan.mode, plan.n_heads, plan.n_kv_heads) == ("tensor", 9, 3)
    assert "3 of 9 query heads and 1 of 3 KV heads" in plan.describe()
    assert dist.plan_sharding(model, 1).mode == "single"
    with pytest.raises(ConfigError, match="mode='ring'"):
        dist.plan_sharding(model, 3, mode="ring")


def test_plan_falls_back_to_pipeline_where_heads_do_not_divide() -> None:
    model = tiny_model("qwen2", hidden_size=96, num_attention_heads=3, num_key_value_heads=3,
                       num_hidden_layers=5)
    plans = [dist.plan_sharding(model, 2, rank=r) for r in (0, 1)]
    assert [p.mode for p in plans] == ["pipeline", "pipeline"]
    # mlx_lm gives rank 0 the last layers; the low ranks get the extra layer.
    assert [(p.layer_start, p.layer_end) for p in plans] == [(2, 5), (0, 2)]
    with pytest.raises(dist.ShardingError, match="tensor parallelism needs") as info:
        dist.plan_sharding(model, 2, mode="tensor")
    assert "pipeline parallelism" not in str(info.value)


def test_bad_shard_mode_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dist.ENV_SHARD, "data")
    with pytest.raises(ConfigError, match="VELOXQUANT_SHARD='data' is not allowed"):
        dist.shard_model(tiny_model("llama"), group=None)


def test_rank_files(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert dist.rank_path(tmp_path / "c.safetensors") == tmp_path / "c.safetensors"

    class Group:
        def rank(self) -> int:
            return 1

        def size(self) -> int:
            return 2

    monkeypatch.setattr(dist, "world", lambda: Group())
    assert dist.rank_path(tmp_path / "c.safetensors").name == "c.rank1-of-2.safetensors"
    assert dist.rank_path(tmp_path / "c.rank0-of-2.safetensors").name == \
        "c.rank1-of-2.safetensors"
    assert dist.shard_mismatch(None).startswith("saved by rank 0 of a job of 1 rank(s)")
    assert dist.shard_mismatch({"world_size": 2, "rank": 0, "mode": "tensor"}) == \
        "saved by rank 0; this is rank 1"


def test_xquant_replication_warning() -> None:
    model = tiny_model("llama", **worker.DIMS)
    plan = dist.ShardPlan("tensor", 0, 2, 4, 8, 4, 0, 4)
    for method in ("xquant_cl", "xquant:latent=false"):
        warning = dist.replication_warning(model, method, plan)
        assert "caches the layer input X" in warning
        assert "each of the 2 ranks holds the whole cache" in warning
    # Latents of the K/V projections (256 wide here, X is 512): nothing replicated.
    assert dist.replication_warning(model, "xquant", plan) is None
    assert dist.replication_warning(model, "kivi", plan) is None


# ---------------------------------------------------------------- mlx.launch jobs
def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return float(mx.abs(mx.array(a) - mx.array(b)).max().item())


def _check_rank(kind: str, method: str, got: dict[str, Any], ref: dict[str, Any]) -> None:
    where = f"{kind} {method}"
    assert got["tokens"] == ref["tokens"], where
    assert _max_diff(got["logprobs"], ref["logprobs"]) < TOLERANCE.get((kind, method), 1e-3), \
        where
    ratio = got["retained"] / ref["retained"]
    if kind == "tensor" and method == "xquant_cl":
        # X is replicated (documented, warned): about 1, against 0.5 for a sharded X. A
        # launched rank keeps 8-20 KB beyond the caches' 189 KB here (seen with the fused
        # ops on and off: 196,864-208,896 bytes), so 1.1 failed now and then.
        assert 0.9 < ratio < 1.15, (where, ratio)
    elif kind == "tensor" and method == "xquant":
        assert 0.2 < ratio < 0.45, (where, ratio)  # latents and their factors shrink too
    else:
        assert 0.4 < ratio < 0.75, (where, ratio)  # "about half"; a full replica is 1.0


def test_methods_sharded_and_a_rank_lost(folders: dict[str, Path], tmp_path: Path) -> None:
    stdout, stderr, _ = launch(2, [WORKER, "methods", str(tmp_path), str(folders["llama"]),
                                   str(folders["qwen2"])], timeout=300)
    ranks = []
    for r in (0, 1):
        assert (tmp_path / f"rank{r}.json").is_file(), stderr[-4000:]
        ranks.append(json.loads((tmp_path / f"rank{r}.json").read_text()))
    ref = {"tensor": worker.run_methods(load(str(folders["llama"]))[0], pipeline=False),
           "pipeline": worker.run_methods(load(str(folders["qwen2"]))[0], pipeline=True)}
    assert "tensor parallel over 2 ranks" in stderr and "pipeline parallel" in stderr
    for rank in ranks:
        assert rank["probe_sum"] == 3.0  # the lone probe ran no collective
        for kind in ("tensor", "pipeline"):
            assert set(rank[kind]) == set(ref[kind])
            for method, got in rank[kind].items():
                _check_rank(kind, method, got, ref[kind][method])
    assert [r["pipeline_layers"] for r in ranks] == [[2, 4], [0, 2]]
    _check_saved_files(tmp_path, ranks)
    for rank in ranks:  # every rank got the error, naming each rank's config
        assert "cache config differs across the 2 ranks" in rank["mismatch"]
        assert re.search(r'rank 0: \{.*"bits": 4.*rank 1: \{.*"bits": 2', rank["mismatch"])
    # Then rank 1 left with status 0: rank 0 ended the job by itself, with a clear error.
    assert "[rank 0/2] veloxquant: error: lost the connection to another rank" in stderr
    assert "Node with rank 0 exited with code 1" in stderr
    assert "never told" not in stdout


def _check_saved_files(folder: Path, ranks: list[dict[str, Any]]) -> None:
    for r, rank in enumerate(ranks):
        saved = rank["saved"]
        assert saved["same_state"]
        assert saved["offsets"] == [len(worker.PROMPT) + 2] * worker.LAYERS["llama"]
        assert saved["files"] == ["kivi.rank0-of-2.safetensors", "kivi.rank1-of-2.safetensors"]
        header = read_prompt_cache_header(folder / f"kivi.rank{r}-of-2.safetensors")
        assert header["shard"] == {"world_size": 2, "rank": r, "mode": "tensor"}
    with pytest.raises(PromptCacheError, match=r"come from jobs of \[2\] rank"):
        load_prompt_cache(folder / "kivi.safetensors")
    with pytest.raises(PromptCacheError, match="job of 2 rank.*this job runs 1 rank"):
        load_prompt_cache(folder / "kivi.rank1-of-2.safetensors")


def _held(stderr: str, rank: str) -> int:
    m = re.search(rf"{rank}\[veloxquant\] method=kivi held=(\d+) B", stderr)
    assert m, stderr[-3000:]
    return int(m.group(1))


@pytest.mark.parametrize("kind, shard", [("llama", "auto"), ("qwen2", "pipeline")])
def test_cli_generate_under_mlx_launch(folders: dict[str, Path], kind: str, shard: str,
                                       capsys: pytest.CaptureFixture) -> None:
    from veloxquant_mlx.cli import main

    args = ["generate", "--model", str(folders[kind]), "--kv", "kivi:bits=4,group_size=32",
            "--prompt", " ".join(f"w{i}" for i in range(1, 60)), "--max-tokens", "12",
            "--verbose", "False"]  # the text only: speeds differ between the runs
    assert main(args) == 0
    single = capsys.readouterr()
    stdout, stderr, _ = launch(2, [str(BIN / "veloxquant"), *args], timeout=120,
                               env=(f"{dist.ENV_SHARD}={shard}",))
    assert stdout == single.out and single.out.strip(), (stdout, single.out, stderr[-3000:])
    assert "error" not in stderr, stderr[-3000:]  # e.g. a rank left with work pending
    one = _held(single.err, "")
    for r in (0, 1):
        assert 0.45 < _held(stderr, rf"\[rank {r}/2\] ") / one < 0.55


def _wait_ready(port: int, proc: subprocess.Popen, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, "the job ended before serving"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"no server on port {port} after {timeout} s")


def test_serve_under_mlx_launch(folders: dict[str, Path], tmp_path: Path) -> None:
    port = free_ports(1)
    dist_port = free_ports(2)
    while port in (dist_port, dist_port + 1):
        dist_port = free_ports(2)
    cmd = [str(BIN / "mlx.launch"), "--backend", "ring", "-n", "2", "--starting-port",
           str(dist_port), "--python", sys.executable, "--", str(BIN / "veloxquant"), "serve",
           "--model", str(folders["llama"]), "--method", "kivi", "--bits", "4",
           "--group-size", "32", "--port", str(port), "--max-tokens", "6"]
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    with open(tmp_path / "err", "wb") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                stderr=err, start_new_session=True, env=env)
    try:
        try:
            _wait_ready(port, proc, timeout=150)
        except TimeoutError:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.send_signal(signal.SIGABRT)  # each rank's Python stacks, into the log
            time.sleep(2)
            raise AssertionError((tmp_path / "err").read_text()[-8000:]) from None
        body = {"messages": [{"role": "user", "content": "w1 w2 w3 w4"}], "max_tokens": 6}
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            reply = json.loads(r.read())
    finally:
        with contextlib.suppress(ProcessLookupError):  # the launcher may be gone already
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdin.close()
    log = (tmp_path / "err").read_text()
    assert reply["choices"][0]["message"]["content"].strip(), reply
    assert reply["usage"]["completion_tokens"] >= 1
    assert "[rank 0/2] [veloxquant] serving method=kivi" in log
    assert "[rank 1/2] [veloxquant] serving" not in log  # HTTP is rank 0's alone
