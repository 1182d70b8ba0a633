"""``veloxquant serve``: a real server process on 127.0.0.1 with a tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from veloxquant_mlx.integration.server import check_loopback, free_port

ROOT = Path(__file__).resolve().parents[1]
WORDS = ["<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system"] + [
    f"w{i}" for i in range(122)
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def write_tiny_model(folder: Path) -> None:
    """A random llama + word-level tokenizer in mlx_lm's folder format."""
    from mlx_lm.utils import save_config, save_model
    from tokenizers import Tokenizer, models, pre_tokenizers

    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_models import BASE, tiny_model

    model = tiny_model("llama")
    save_model(folder, model)
    save_config(dict(BASE, model_type="llama"), folder / "config.json")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
        "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE,
    }))


def _post(port: int, body: dict, timeout: float = 60) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _wait_ready(port: int, proc: subprocess.Popen, timeout: float = 90) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError("server did not start")


def test_check_loopback() -> None:
    for ok in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        check_loopback(ok)
    for bad in ("0.0.0.0", "192.168.1.10", "example.com"):
        with pytest.raises(ValueError, match="loopback"):
            check_loopback(bad)


def test_serve_rejects_non_loopback_host() -> None:
    from veloxquant_mlx.cli import main

    with pytest.raises(ValueError, match="--host='0.0.0.0'"):
        main(["serve", "--host", "0.0.0.0", "--method", "none"])


def test_serve_bad_method_option_names_field(capsys: pytest.CaptureFixture) -> None:
    from veloxquant_mlx.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--method", "affine", "--bits", "7"])
    assert exit_info.value.code == 2
    assert "affine.bits=7 is not allowed: one of [2, 3, 4, 5, 6, 8]" in capsys.readouterr().err


@pytest.mark.parametrize("method_args", [["--method", "affine", "--bits", "8",
                                          "--group-size", "32"]])
def test_server_concurrent_chats_and_memory(tmp_path: Path, method_args: list[str]) -> None:
    write_tiny_model(tmp_path)
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-m", "veloxquant_mlx", "serve", "--model", str(tmp_path),
         "--host", "127.0.0.1", "--port", str(port), "--max-tokens", "8", *method_args],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        _wait_ready(port, proc)
        ps = psutil.Process(proc.pid)
        warm = _post(port, {"messages": [{"role": "user", "content": "w1 w2"}],
                            "max_tokens": 4})
        assert warm["choices"][0]["message"]["content"].strip()
        baseline = ps.memory_info().rss
        bodies = [{"messages": [{"role": "user", "content": " ".join(
            f"w{(i * 7 + j) % 120}" for j in range(20 + 15 * i))}], "max_tokens": 8}
            for i in range(4)]
        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda b: _post(port, b), bodies * 2))
        for r in replies:
            msg = r["choices"][0]["message"]
            assert msg["role"] == "assistant"
            assert msg["content"].strip()
            assert r["usage"]["completion_tokens"] >= 1
        # Same prompt, greedy: the same answer whoever else was in the batch.
        for a, b in zip(replies[:4], replies[4:]):
            assert a["choices"][0]["message"]["content"] == \
                b["choices"][0]["message"]["content"]
        time.sleep(1.0)
        after = ps.memory_info().rss
        assert after - baseline < 64 * 2**20, (baseline, after)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
