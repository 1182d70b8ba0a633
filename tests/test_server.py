"""``veloxquant serve``: limits, admission, cancellation, fairness and a short load test.

Server tests run a real server process on 127.0.0.1 with a tiny random llama written to a
temporary folder (word-level tokenizer: every ``wN`` word is one token).
"""

from __future__ import annotations

import gc
import http.client
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import mlx.core as mx
import psutil
import pytest

from veloxquant_mlx import KVCacheBuilder, KVCacheConfig
from veloxquant_mlx.apps.server import check_loopback, free_port
from veloxquant_mlx.apps.server_limits import (
    ClientGone,
    KVBudget,
    KVCost,
    QueueFull,
    QueueTimeout,
    Ticket,
    measure_kv_cost,
    parse_size,
)
from veloxquant_mlx.eval import loadtest

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

    from veloxquant_mlx.testing.tiny import tiny_config, tiny_model

    model = tiny_model("llama")
    save_model(folder, model)
    save_config(tiny_config("llama"), folder / "config.json")
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
        loadtest.stop_process(proc)


# ---- units: sizes, the cost line, the budget ----
def test_parse_size_and_flag_errors(capsys: pytest.CaptureFixture) -> None:
    from veloxquant_mlx.cli import main

    assert parse_size("2GB") == 2 * 10**9
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("1.5M") == 1_500_000
    assert parse_size("4096") == 4096
    for bad in ("2XB", "-1MB", "0", "lots"):
        with pytest.raises(ValueError, match=f"--max-kv-memory='{bad}' is not allowed"):
            parse_size(bad)
    for flags, message in ((["--max-kv-memory", "2XB"], "--max-kv-memory='2XB' is not allowed"),
                           (["--prefill-share", "1.5"], "--prefill-share='1.5' is not allowed: "
                            "float >= 0.05 and <= 1.0"),
                           (["--max-queue", "-1"], "--max-queue='-1' is not allowed"),
                           (["--max-request-bytes", "0"], "--max-request-bytes='0' is not "
                            "allowed"),
                           (["--request-timeout", "0.5"], "--request-timeout='0.5' is not "
                            "allowed: float >= 1.0"),
                           (["--max-connections", "0"], "--max-connections='0' is not "
                            "allowed")):
        with pytest.raises(SystemExit) as exit_info:
            main(["serve", "--method", "none", *flags])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


def test_kv_cost_reserves_a_growth_step_and_compares_with_dense() -> None:
    cost = KVCost("kivi:bits=4", per_token=1000.0, fixed=5000, dense_per_token=4000.0)
    assert cost.bytes_for(100) == 5000 + 1000 * (100 + 256)
    for budget in (10**6, 3 * 10**6 + 17):
        n = cost.tokens_within(budget)
        assert cost.bytes_for(n) <= budget < cost.bytes_for(n + 1)
    assert cost.tokens_within(1000) == 0
    assert "kivi:bits=4 fits 4.0x the tokens of dense (4.0 KB per token)" in cost.describe()


def test_budget_fifo_queue_full_timeout_and_hang_up() -> None:
    budget = KVBudget(100, max_queue=1, queue_timeout=5.0)
    first = Ticket(need=60, prompt_tokens=1, max_tokens=1)
    budget.acquire(first, gone=lambda: False)
    assert budget.reserved == 60
    second = Ticket(need=60, prompt_tokens=1, max_tokens=1)
    waiter = threading.Thread(target=budget.acquire, args=(second, lambda: False))
    waiter.start()
    time.sleep(0.3)
    assert second.state == "queued" and budget.queued == 1
    with pytest.raises(QueueFull):  # the one queue place is taken
        budget.acquire(Ticket(need=10, prompt_tokens=1, max_tokens=1), gone=lambda: False)
    first.handler_done()  # nothing tracked: handler done releases
    waiter.join(timeout=5)
    assert second.state == "admitted" and budget.reserved == 60
    short = KVBudget(100, max_queue=2, queue_timeout=0.3)
    short.acquire(Ticket(need=80, prompt_tokens=1, max_tokens=1), gone=lambda: False)
    t0 = time.monotonic()
    with pytest.raises(QueueTimeout):
        short.acquire(Ticket(need=80, prompt_tokens=1, max_tokens=1), gone=lambda: False)
    assert 0.25 < time.monotonic() - t0 < 2
    with pytest.raises(ClientGone):
        short.acquire(Ticket(need=80, prompt_tokens=1, max_tokens=1), gone=lambda: True)
    assert short.queued == 0 and short.reserved == 80


def test_reservation_lasts_until_tracked_caches_are_garbage() -> None:
    class Cache:
        pass

    budget = KVBudget(100, max_queue=0, queue_timeout=1.0)
    ticket = Ticket(need=70, prompt_tokens=1, max_tokens=1)
    budget.acquire(ticket, gone=lambda: False)
    caches = [Cache(), Cache()]
    ticket.track(caches)
    ticket.handler_done()
    assert budget.reserved == 70  # the caches are still alive
    caches.pop()
    gc.collect()
    assert budget.reserved == 70
    caches.clear()
    gc.collect()
    assert budget.reserved == 0 and ticket.state == "released"


def test_measured_cost_is_the_allocator_reading() -> None:
    from veloxquant_mlx.testing.tiny import UNIT_SIZES, tiny_model

    model = tiny_model("llama", seed=1)
    dense = measure_kv_cost(model, KVCacheConfig(method="none"), probe=256, chunk=128)
    # float32 K and V of every layer, per token: what MLX really holds for a dense cache.
    dims = UNIT_SIZES
    per_token = dims["num_hidden_layers"] * dims["num_key_value_heads"] * 2 * dims["head_dim"] * 4
    assert dense.per_token == per_token and dense.fixed == 0
    kivi = measure_kv_cost(model, KVCacheConfig(method="kivi", bits=4, group_size=32),
                           probe=256, chunk=128)
    assert 0 < kivi.per_token < per_token / 3
    assert kivi.dense_per_token == per_token and kivi.dense_ratio() > 3
    assert kivi.probe_bytes[1] > kivi.probe_bytes[0] > 0


# ---- the batch generator, in process ----
def _batch_generator(model: Any, share: float = 0.5, stock: bool = False, step: int = 64
                     ) -> Any:
    from mlx_lm.generate import BatchGenerator

    from veloxquant_mlx.apps.server_batch import ServerBatchGenerator

    cls = BatchGenerator if stock else type("G", (ServerBatchGenerator,), {"prefill_share": share})
    return cls(model, completion_batch_size=8, prefill_batch_size=4, prefill_step_size=step)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return [(i * 17 + seed) % 120 + 1 for i in range(n)]


@pytest.mark.parametrize("stock", [False, True])
def test_moving_to_generation_moves_caches_not_copies(stock: bool) -> None:
    from veloxquant_mlx.testing.tiny import tiny_model

    model = tiny_model("llama", seed=2)
    cfg = KVCacheConfig(method="kivi", bits=4, group_size=32)
    long_c, short_c = (KVCacheBuilder.for_model(model, cfg) for _ in range(2))
    gen = _batch_generator(model, stock=stock)
    _, short_uid = gen.insert([_prompt(600), _prompt(10, 3)], max_tokens=[4, 20],
                              caches=[long_c, short_c])
    for _ in range(20):
        gen.next()
        if short_uid in gen._generation_batch.uids:
            break
    row = gen._generation_batch.uids.index(short_uid)
    moved = [c.caches[row] for c in gen._generation_batch.prompt_cache]
    still = [c.caches[0] for c in gen._prompt_batch.prompt_cache]
    same = all(a is b for a, b in zip(moved, short_c)) and all(
        a is b for a, b in zip(still, long_c))
    # mlx_lm deep-copies the whole prefill batch when a prompt finishes; the server moves.
    assert same is (not stock)


def _decodes_per_prefill_step(share: float) -> float:
    from veloxquant_mlx.testing.tiny import tiny_model

    model = tiny_model("llama", seed=3)
    cfg = KVCacheConfig(method="none")
    gen = _batch_generator(model, share=share, step=128)
    long_uid, short_uid = gen.insert(
        [_prompt(1200), _prompt(8, 5)], max_tokens=[2, 400],
        caches=[KVCacheBuilder.for_model(model, cfg) for _ in range(2)])
    prefill_steps = decodes = 0
    while long_uid not in gen._generation_batch.uids:
        prompt_r, gen_r = gen.next()
        prefill_steps += any(r.uid == long_uid for r in prompt_r)
        decodes += sum(r.uid == short_uid for r in gen_r)
        if any(r.uid == short_uid and r.finish_reason for r in gen_r):
            break
    return decodes / max(prefill_steps, 1)


def _chunk_per_prompt(gen: Any, uids: list[int], steps: int = 3) -> int:
    """The most prompt tokens any of ``uids`` advanced in one step."""
    done = dict.fromkeys(uids, 0)
    most = 0
    for _ in range(steps):
        for r in gen.next()[0]:
            if r.uid in done and isinstance(r.progress, tuple):
                most = max(most, r.progress[0] - done[r.uid])
                done[r.uid] = r.progress[0]
    return most


def test_prompts_split_the_chunk_only_while_others_decode() -> None:
    from veloxquant_mlx.testing.tiny import tiny_model

    model = tiny_model("llama", seed=3)
    cfg = KVCacheConfig(method="none")
    caches = lambda: KVCacheBuilder.for_model(model, cfg)  # noqa: E731
    gen = _batch_generator(model, step=128)
    # Nobody generating: each prompt gets a whole chunk per step (not 128 / 2).
    alone = gen.insert([_prompt(600), _prompt(600, 1)], max_tokens=[2, 2],
                       caches=[caches(), caches()])
    assert _chunk_per_prompt(gen, alone) == 128
    gen = _batch_generator(model, share=1.0, step=128)
    talker, = gen.insert([_prompt(8, 5)], max_tokens=[400], caches=[caches()])
    while talker not in gen._generation_batch.uids:
        gen.next()
    # A sequence decodes: the chunk is shared, so a step stays about one chunk.
    waiting = gen.insert([_prompt(600), _prompt(600, 1)], max_tokens=[2, 2],
                         caches=[caches(), caches()])
    assert _chunk_per_prompt(gen, waiting) == 64


def test_prefill_share_gives_decoders_their_time() -> None:
    # mlx_lm's own interleaving: one decode step per prompt chunk.
    assert _decodes_per_prefill_step(1.0) <= 1.5
    # Prompts get at most a fifth of the time: several decode steps per chunk.
    assert _decodes_per_prefill_step(0.2) >= 3


def test_cancelled_prompt_is_dropped_before_its_next_step() -> None:
    from veloxquant_mlx.apps.server import RequestCaches
    from veloxquant_mlx.testing.tiny import tiny_model

    class Ctx:
        stopped = False

        def stop(self) -> None:
            self.stopped = True

    model = tiny_model("llama", seed=4)
    gen = _batch_generator(model, step=32)
    caches = RequestCaches(KVCacheBuilder.for_model(model, KVCacheConfig(method="none")))
    caches.ticket = ticket = Ticket(need=1, prompt_tokens=400, max_tokens=4)
    ticket.ctx = Ctx()
    (uid,) = gen.insert([_prompt(400)], max_tokens=[4], caches=[caches])
    for _ in range(3):
        gen.next()
    ticket.cancel()
    assert ticket.ctx.stopped
    prompt_r, _ = gen.next()
    assert [r.uid for r in prompt_r] == [uid]  # reported once, so mlx_lm drops its records
    assert uid not in gen._prompt_batch.uids and uid not in gen._tickets
    assert ticket.stop_progress == ticket.cancel_progress == (96, 0)
    del caches
    gc.collect()
    mx.clear_cache()


# ---- a real server with a small budget ----
VOCAB = [f"w{i}" for i in range(120)]
TEMPLATE_TOKENS = 5  # <|im_start|> user ... <|im_end|> <|im_start|> assistant
SERVER_FLAGS = ["--method", "kivi", "--bits", "4", "--group-size", "32", "--max-kv-memory",
                "1.2MB", "--max-queue", "1", "--queue-timeout", "2", "--prefill-step-size", "32"]


@pytest.fixture(scope="module")
def kivi_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    folder = tmp_path_factory.mktemp("tiny")
    write_tiny_model(folder)
    port = free_port()
    with open(folder / "serve.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "veloxquant_mlx", "serve", "--model", str(folder), "--port",
             str(port), "--log-level", "INFO", *SERVER_FLAGS],
            cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=log, stderr=log)
        try:
            _wait_ready(port, proc)
            yield port
            assert proc.poll() is None, (folder / "serve.log").read_text()[-3000:]
        finally:
            loadtest.stop_process(proc)


def _limits(port: int) -> dict:
    return loadtest.get_json(port, "/limits")[1]


def _settle(port: int, timeout: float = 30) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        snap = _limits(port)
        if not (snap["active_requests"] or snap["queued_requests"] or snap["reserved_bytes"]):
            return snap
        time.sleep(0.1)
    raise AssertionError(f"requests did not finish: {snap}")


def _open(port: int, body: dict, timeout: float = 60) -> tuple[http.client.HTTPConnection,
                                                                http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json"})
    return conn, conn.getresponse()


def _ask(port: int, n_words: int, max_tokens: int | None, **extra: Any
         ) -> tuple[int, dict, dict]:
    conn, resp = _open(port, loadtest.chat(loadtest.words(n_words, VOCAB), max_tokens, **extra))
    try:
        return resp.status, dict(resp.getheaders()), json.loads(resp.read())
    finally:
        conn.close()


def test_context_and_memory_limits_refuse_clearly(kivi_server: int) -> None:
    port = kivi_server
    before = _settle(port)["counters"]
    status, _, reply = _ask(port, 4090, 100)
    assert status == 400 and reply["error"]["code"] == "context_length_exceeded"
    assert reply["error"]["type"] == "invalid_request_error"
    assert "prompt of 4095 tokens + max_tokens 100 = 4195 tokens exceeds --max-context=4096 " \
           "(the model's maximum, model config max_position_embeddings)" \
           in reply["error"]["message"]
    assert reply["limit"]["prompt_tokens"] == 4095 and reply["limit"]["max_context"] == 4096
    cost = _limits(port)["kv_cost"]
    status, _, reply = _ask(port, 3500, 300)
    assert status == 400 and reply["error"]["code"] == "kv_memory_exceeded", reply
    facts = reply["limit"]
    assert facts["requested_tokens"] == 3805 and facts["max_kv_memory"] == 1_200_000
    assert facts["required_bytes"] > 1_200_000
    assert facts["bytes_per_token"] == cost["bytes_per_token"] > 0
    assert "--max-kv-memory=1.2 MB" in reply["error"]["message"]
    assert cost["method"] == "kivi:bits=4"
    assert f"kivi:bits=4 fits {cost['fits_x_dense']:.1f}x the tokens of dense" \
        in reply["error"]["message"]
    for extra, field in (({"model": "other"}, "model="), ({"seed": 1, "temperature": 0.7},
                                                        "seed=1")):
        status, _, reply = _ask(port, 5, 4, **extra)
        assert status == 400 and reply["error"]["message"].startswith(field), reply
        assert reply["error"]["param"] == field.split("=")[0], reply
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "", "max_tokens": 3}))
    resp = conn.getresponse()
    assert resp.status == 400 and json.loads(resp.read())["error"]["code"] == "empty_prompt"
    conn.close()
    after = _settle(port)["counters"]
    delta = {k: after[k] - before[k] for k in after}
    assert delta["refused_context"] == 1 and delta["refused_memory"] == 1
    assert delta["bad_request"] == 3 and delta["requests"] == 5
    assert delta["admitted"] == 0  # none of them reached the generator


def _hold(port: int, n_words: int, max_tokens: int) -> tuple[http.client.HTTPResponse, int]:
    """A streaming request that is admitted and then left unread (open while the
    response object lives: the server speaks HTTP/1.0, so it owns the socket)."""
    _, resp = _open(port, loadtest.chat(loadtest.words(n_words, VOCAB), max_tokens, True))
    return resp, resp.status


def _in_thread(fn: Callable[..., Any], *args: Any) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    thread.start()
    return thread, out


def _wait_for(port: int, key: str, value: int, timeout: float = 20) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        snap = _limits(port)
        if snap[key] == value:
            return snap
        time.sleep(0.05)
    raise AssertionError(f"{key} never became {value}: {snap}")


def test_queue_admits_after_release_and_refuses_with_retry_after(kivi_server: int) -> None:
    port = kivi_server
    holder, status = _hold(port, 200, 1800)  # about 0.8 MB of the 1.2 MB
    assert status == 200
    waiter, got = _in_thread(_ask, port, 1200, 8)  # needs 0.5 MB more: waits in the queue
    _wait_for(port, "queued_requests", 1)
    status, headers, reply = _ask(port, 10, 4)  # the one queue place is taken
    assert status == 429 and reply["error"]["code"] == "kv_memory_busy"
    assert "--max-queue=1" in reply["error"]["message"] and int(headers["Retry-After"]) >= 1
    holder.close()  # hang up: the holder is cancelled and its bytes come back
    waiter.join(timeout=60)
    status, _, reply = got[0]
    assert status == 200 and reply["choices"][0]["message"]["content"]
    assert reply["usage"]["prompt_tokens"] == 1205
    holder, status = _hold(port, 200, 1800)
    assert status == 200
    t0 = time.monotonic()
    status, headers, reply = _ask(port, 1200, 8)  # waits --queue-timeout=2 s, then 503
    assert status == 503 and reply["error"]["code"] == "kv_memory_timeout"
    assert 1.8 < time.monotonic() - t0 < 10 and int(headers["Retry-After"]) >= 1
    holder.close()
    snap = _settle(port)
    assert snap["peak_queued_requests"] == 1 and snap["peak_reserved_bytes"] <= 1_200_000
    assert snap["counters"]["refused_busy"] >= 1 and snap["counters"]["refused_timeout"] >= 1


def _last_cancel(port: int) -> tuple[dict, dict]:
    snap = _settle(port)
    return snap, snap["cancelled_recent"][-1]


def test_disconnect_stops_prefill_and_generation_and_frees_memory(kivi_server: int) -> None:
    port = kivi_server
    conn, resp = _open(port, loadtest.chat(loadtest.words(2500, VOCAB), 8, True))
    assert resp.status == 200 and resp.readline().startswith(b": keepalive")
    resp.close()  # mid-prefill, streaming (the response owns the HTTP/1.0 socket)
    snap, cancel = _last_cancel(port)
    assert cancel["prompt_tokens"] == 2505
    assert cancel["prefilled_at_stop"] - cancel["prefilled_at_cancel"] <= 32  # one chunk
    assert cancel["prefilled_at_stop"] < 2505
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=0.4)
    conn.request("POST", "/v1/chat/completions", headers={"Content-Type": "application/json"},
                 body=json.dumps(loadtest.chat(loadtest.words(2500, VOCAB), 8)).encode())
    with pytest.raises(TimeoutError):
        conn.getresponse()
    conn.close()  # mid-prefill, not streaming
    snap, cancel = _last_cancel(port)
    assert cancel["prefilled_at_stop"] - cancel["prefilled_at_cancel"] <= 32
    assert cancel["prefilled_at_stop"] < 2505
    conn, resp = _open(port, loadtest.chat(loadtest.words(20, VOCAB), 3000, True))
    chunks = 0
    while chunks < 3:
        chunks += resp.readline().startswith(b"data:")
    resp.close()  # mid-generation
    snap, cancel = _last_cancel(port)
    assert cancel["generated_at_stop"] - cancel["generated_at_cancel"] <= 1
    assert cancel["generated_at_stop"] < 100
    assert snap["counters"]["cancelled"] >= 3
    # The caches are gone: real memory is back at the idle baseline.
    assert abs(snap["kv_real_bytes"]) < 64 * 1024, snap


def test_short_request_runs_during_a_long_prefill(kivi_server: int) -> None:
    port = kivi_server
    events: dict[str, float] = {}

    def long_request() -> None:
        conn, resp = _open(port, loadtest.chat(loadtest.words(2600, VOCAB), 4, True), 120)
        for line in iter(resp.readline, b""):
            if line.startswith(b": keepalive"):
                events.setdefault("long_prefilling", time.monotonic())
            elif line.startswith(b"data:") and b'"content"' in line:
                events.setdefault("long_first_token", time.monotonic())
        events["long_done"] = time.monotonic()
        conn.close()

    thread, _ = _in_thread(long_request)
    end = time.monotonic() + 30
    while "long_prefilling" not in events and time.monotonic() < end:
        time.sleep(0.01)
    status, _, reply = _ask(port, 10, 8)
    events["short_done"] = time.monotonic()
    thread.join(timeout=120)
    assert status == 200 and reply["usage"]["completion_tokens"] == 8
    assert events["short_done"] < events["long_first_token"] <= events["long_done"], events
    _settle(port)


def test_max_context_above_the_models_is_refused_at_start(tmp_path: Path) -> None:
    write_tiny_model(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "veloxquant_mlx", "serve", "--model", str(tmp_path), "--port",
         str(free_port()), "--method", "none", "--max-context", "100000"],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, timeout=120)
    assert proc.returncode == 2, proc.stderr.decode()[-2000:]
    assert "--max-context=100000 is not allowed: at most 4096, the model's maximum " \
           "(model config max_position_embeddings)" in proc.stderr.decode()


def test_load_scenario_dense_vs_compressed(tmp_path: Path) -> None:
    """The load test, small: every request answered or refused clearly, memory in budget."""
    write_tiny_model(tmp_path)
    cfg = loadtest.LoadConfig(
        methods=["none", "kivi:bits=4"], max_kv_memory="3MB", model=str(tmp_path),
        conversation_tokens=1024, requests=12, clients=3, max_queue=2, prefill_step_size=64,
        timeout=180, vocab=VOCAB, log_dir=tmp_path)
    rows = loadtest.run_load_test(cfg)
    for row in rows:
        cap, mixed = row["capacity"], row["mixed"]
        assert not row["crashed"] and mixed["failed"] == 0, (row, row["mixed"]["failures"])
        assert row["within_budget"] and row["released_after"], row
        assert row["kv_real_peak_bytes"] <= row["peak_reserved_bytes"] <= 3_000_000
        # As many conversations as the measured cost fits were admitted at once; of the
        # rest, max_queue waited and two were refused with a Retry-After.
        assert cap["fits_observed"] == cap["fits_expected"] >= 1, cap
        assert cap["refused_429"] == 2 and cap["other"] == 0, cap
        assert cap["retry_after_given"] and cap["released"], cap
        assert cap["admitted_total"] == cap["fits_expected"] + 2
        assert mixed["rejected"] == 5  # the five kinds of bad input, each a clear 400
        assert mixed["ok"] >= 6 and mixed["latency_p95_s"] is not None
    dense, kivi = rows
    assert kivi["capacity"]["fits_observed"] >= 3 * dense["capacity"]["fits_observed"]
    table = loadtest.markdown_table(rows)
    assert "| `kivi:bits=4` |" in table and "1024-token conversations" in table


def test_a_burst_of_connections_is_not_reset(kivi_server: int) -> None:
    """40 clients at once all get an answer, here a context refusal (the handlers render
    4000-word prompts while more clients connect; mlx_lm's listen backlog is 5)."""
    body = loadtest.chat(loadtest.words(4100, VOCAB), 8)

    def ask(_: int) -> int | str:
        try:
            return loadtest.post_json(kivi_server, body, timeout=60)[0]
        except OSError as e:
            return f"{type(e).__name__}: {e}"

    with ThreadPoolExecutor(40) as pool:
        answers = list(pool.map(ask, range(40)))
    assert answers == [400] * 40, [a for a in answers if a != 400][:3]
