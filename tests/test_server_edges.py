"""``veloxquant serve`` at its edges: hostile requests, a soak, local-only access, the
``openai`` client, ``cache_salt`` and a failing generation loop that keeps serving.

One server process on 127.0.0.1 with the tiny model of ``test_server`` serves the
HTTP tests; the generation-loop test runs mlx_lm's loop in this process.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import socket
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from test_server import ROOT, _wait_ready, write_tiny_model

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.apps.server import free_port
from veloxquant_mlx.apps.server_limits import LimitError
from veloxquant_mlx.apps.server_requests import HostPolicy, validate_body
from veloxquant_mlx.eval import loadtest

APP = "http://app.example:3000"
MAX_BODY = 32_000
MAX_CONNECTIONS = 12
VOCAB = 128  # the tiny model's logits
GOOD = {"messages": [{"role": "user", "content": "w1 w2 w3"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    folder = tmp_path_factory.mktemp("tiny")
    write_tiny_model(folder)
    port = free_port()
    log = folder / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "veloxquant_mlx", "serve", "--model", str(folder),
             "--port", str(port), "--method", "none", "--max-tokens", "4",
             "--max-request-bytes", str(MAX_BODY), "--request-timeout", "2",
             "--max-connections", str(MAX_CONNECTIONS), "--allow-origin", APP,
             "--max-kv-memory", "50MB"],
            cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=out, stderr=out)
        try:
            _wait_ready(port, proc)
            yield port, folder
            assert proc.poll() is None, log.read_text()[-3000:]
        finally:
            loadtest.stop_process(proc)


def _request(port: int, method: str, path: str, body: Any = None, raw: bytes | None = None,
             headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        conn.request(method, path, body=data, headers={"Content-Type": "application/json",
                                                       **(headers or {})})
        resp = conn.getresponse()
        text = resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, (
            json.loads(text) if text else None)
    finally:
        conn.close()


def _chat(port: int, body: Any, **kw: Any) -> tuple[int, dict[str, str], Any]:
    return _request(port, "POST", "/v1/chat/completions", body, **kw)


def _alive(port: int) -> None:
    status, _, reply = _chat(port, GOOD)
    assert status == 200 and reply["usage"]["completion_tokens"] >= 1, reply


def _bad(**fields: Any) -> dict[str, Any]:
    return {**GOOD, **fields}


def _msgs(messages: Any) -> dict[str, Any]:
    return {"messages": messages, "max_tokens": 3}


# (body, the field the refusal must name); each must be refused 4xx, never crash.
HOSTILE: list[tuple[Any, str]] = [
    (_bad(logit_bias={"100000000": 5}), "logit_bias"),  # segfaulted MLX's scatter
    (_bad(logit_bias={str(VOCAB): 1}), "logit_bias"),
    (_bad(logit_bias={"-1": 1}), "logit_bias"),
    (_bad(logit_bias={"abc": 1}), "logit_bias"),
    (_bad(logit_bias={"5": "x"}), "logit_bias[5]"),
    (_bad(logit_bias={"5": 1e9}), "logit_bias[5]"),
    (_bad(logit_bias=[1, 2]), "logit_bias"),
    (_bad(stop=5), "stop"),  # killed the generation thread
    (_bad(stop=[1, 2]), "stop"), (_bad(stop=[""]), "stop"), (_bad(stop={"a": 1}), "stop"),
    (_bad(max_tokens=0), "max_tokens"), (_bad(max_tokens="5"), "max_tokens"),
    (_bad(max_tokens=2.5), "max_tokens"), (_bad(max_tokens=True), "max_tokens"),
    (_bad(max_completion_tokens=-1), "max_completion_tokens"),
    (_bad(temperature=-1), "temperature"), (_bad(temperature="hot"), "temperature"),
    (_bad(top_p=1.5), "top_p"), (_bad(top_k=VOCAB), "top_k"), (_bad(top_k=-3), "top_k"),
    (_bad(min_p=2), "min_p"), (_bad(repetition_penalty=-1), "repetition_penalty"),
    (_bad(repetition_context_size=-5), "repetition_context_size"),
    (_bad(presence_penalty="a"), "presence_penalty"),
    (_bad(frequency_penalty=1e300 * 10), "frequency_penalty"),
    (_bad(xtc_threshold=0.9), "xtc_threshold"), (_bad(n=2), "n"), (_bad(seed=-1), "seed"),
    (_bad(seed="x"), "seed"), (_bad(logprobs="yes"), "logprobs"),
    (_bad(top_logprobs=50), "top_logprobs"), (_bad(stream="yes"), "stream"),
    (_bad(stream=True, stream_options={"include_usage": "y"}), "stream_options.include_usage"),
    (_bad(stream_options=[1]), "stream_options"), (_bad(model=5), "model"),
    (_bad(model="other"), "model"), (_bad(draft_model="x"), "draft_model"),
    (_bad(adapters="x"), "adapters"), (_bad(cache_salt=""), "cache_salt"),
    (_bad(cache_salt=7), "cache_salt"), (_bad(chat_template_kwargs=[1]), "chat_template_kwargs"),
    (_bad(tools="x"), "tools"),
    (_msgs(None), "messages"), (_msgs([]), "messages"), (_msgs("w1"), "messages"),
    (_msgs([1]), "messages[0]"), (_msgs([{"content": "w1"}]), "messages[0].role"),
    (_msgs([{"role": "user"}]), "messages[0].content"),
    (_msgs([{"role": "user", "content": 5}]), "messages[0].content"),
    (_msgs([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages[0].content[0]"),
    ([1, 2], "body"), ("text", "body"), (None, "body"),
]
# Raw bodies and headers: (raw body, extra headers, expected status).
HOSTILE_RAW: list[tuple[bytes, dict[str, str], int]] = [
    (b'{"messages": [', {}, 400), (b"\xff\xfe", {}, 400),
    (b'{"messages": [{"role": "user", "content": "w1"}], "temperature": NaN}', {}, 400),
    (b'{"messages": [{"role": "user", "content": "w1"}], "top_p": Infinity}', {}, 400),
    (b"{}", {"Content-Length": "-4"}, 400), (b"{}", {"Content-Length": "abc"}, 400),
    (b"x" * (MAX_BODY + 1), {}, 413),
]


def test_hostile_requests_are_refused_4xx_naming_the_field(server: tuple[int, Path]) -> None:
    port, _ = server
    for body, param in HOSTILE:
        status, _, reply = _chat(port, body) if body is not None else _chat(port, None, raw=b"null")
        assert 400 <= status < 500, (body, status, reply)
        error = reply["error"]
        assert error["param"] == param and param.split("[")[0].split(".")[0] in error["message"], (
            body, reply)
        assert error["type"] == "invalid_request_error" and error["code"], reply
    for raw, headers, expected in HOSTILE_RAW:
        status, _, reply = _chat(port, None, raw=raw, headers=headers)
        assert status == expected and reply["error"]["message"], (raw[:60], status, reply)
    status, _, reply = _request(port, "POST", "/v1/other", GOOD)
    assert status == 404 and reply["error"]["param"] == "path"
    # Without Content-Length (mlx_lm needs it): a clear 411, not a hang.
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"POST /v1/chat/completions HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n\r\n"
                  .encode())
        assert s.recv(100).startswith(b"HTTP/1.0 411")
    cases = len(HOSTILE) + len(HOSTILE_RAW) + 2
    print(f"hostile requests: {cases} cases, each refused 4xx, 0 crashes")
    assert cases >= 60
    _alive(port)
    assert _request(port, "GET", "/health")[0] == 200
    # Null means "not given" (mlx_lm refused a null max_tokens with its own error).
    status, _, reply = _chat(port, dict(GOOD, max_tokens=None, temperature=None, stop=None,
                                        logit_bias=None, seed=None))
    assert status == 200 and reply["choices"][0]["message"]["content"], reply


def test_a_stalled_body_is_cut_off_and_connections_are_bounded(server: tuple[int, Path]) -> None:
    port, _ = server
    # A body that never comes: the handler gives up after --request-timeout (2 s).
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"POST /v1/chat/completions HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n"
                  "Content-Length: 100\r\n\r\n{".encode())
        t0 = time.monotonic()
        assert s.recv(100) == b"" and time.monotonic() - t0 < 8
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10)
            for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.3)  # every idle connection holds a handler thread now
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            assert s.recv(200).startswith(b"HTTP/1.0 503")
    finally:
        for s in idle:
            s.close()
    time.sleep(0.3)
    _alive(port)


def test_foreign_host_and_origin_are_refused(server: tuple[int, Path]) -> None:
    port, _ = server
    for headers, param in (({"Host": f"evil.example:{port}"}, "Host"),
                           ({"Host": f"127.0.0.1:{port + 1}"}, "Host"),
                           ({"Origin": "http://evil.example"}, "Origin"),
                           ({"Origin": "null"}, "Origin")):
        for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                             ("OPTIONS", "/v1/chat/completions")):
            status, reply_headers, reply = _request(port, method, path, GOOD, headers=headers)
            assert status == 403 and reply["error"]["param"] == param, (headers, reply)
            assert "access-control-allow-origin" not in reply_headers
    # Local names are answered, without any CORS header.
    for host in (f"localhost:{port}", f"[::1]:{port}", f"LOCALHOST:{port}"):
        status, reply_headers, _ = _chat(port, GOOD, headers={"Host": host})
        assert status == 200 and "access-control-allow-origin" not in reply_headers
    # The origin named by --allow-origin: answered, with its CORS headers; preflight too.
    status, reply_headers, _ = _chat(port, GOOD, headers={"Origin": APP})
    assert status == 200 and reply_headers["access-control-allow-origin"] == APP
    status, reply_headers, _ = _request(port, "OPTIONS", "/v1/chat/completions",
                                        headers={"Origin": APP})
    assert status == 204 and reply_headers["access-control-allow-origin"] == APP
    assert "POST" in reply_headers["access-control-allow-methods"]


def test_openai_client_models_chat_stream_and_completions(server: tuple[int, Path]) -> None:
    openai = pytest.importorskip("openai")
    port, folder = server
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="local",
                           max_retries=0, timeout=60)
    models = [m.id for m in client.models.list()]
    assert models == [str(folder)]
    assert client.models.retrieve(models[0]).id == models[0]
    messages = [{"role": "user", "content": "w5 w6 w7"}]
    chat = client.chat.completions.create(model=models[0], messages=messages, max_tokens=3)
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 3
    chunks = list(client.chat.completions.create(
        model=models[0], messages=messages, max_tokens=3, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.split() == chat.choices[0].message.content.split()  # temperature 0
    assert chunks[-1].usage.completion_tokens == 3 and chunks[-1].usage.prompt_tokens == 8
    done = client.completions.create(model="default_model", prompt="w1 w2 w3", max_tokens=2)
    assert done.choices[0].text and done.usage.completion_tokens == 2
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.chat.completions.create(model=models[0], messages=messages,
                                       logit_bias={"100000000": 5})


def test_cache_salt_keeps_kept_caches_apart(server: tuple[int, Path]) -> None:
    port, _ = server
    body = {"messages": [{"role": "user", "content": " ".join(
        f"w{i}" for i in range(60, 100))}], "max_tokens": 2}

    def cached(salt: str | None) -> int:
        status, _, reply = _chat(port, dict(body, **({"cache_salt": salt} if salt else {})))
        assert status == 200, reply
        return reply["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("alice") == 0
    # Another salt, or none, never starts from (or learns of) alice's conversation; the
    # unsalted requests of the other tests share the template's "<|im_start|> user".
    assert cached("bob") == 0 and cached(None) <= 2
    assert cached("alice") >= 40 and cached("bob") >= 40 and cached(None) >= 40


def test_soak_interleaves_bad_and_good_requests(server: tuple[int, Path]) -> None:
    port, _ = server
    rng = random.Random(0)
    plan = [(rng.random() < 0.5, rng.randrange(len(HOSTILE))) for _ in range(96)]
    deadline = time.monotonic() + 40

    def run(item: tuple[bool, int]) -> str:
        good, k = item
        if time.monotonic() > deadline:
            return "late"
        body = dict(GOOD, max_tokens=2 + k % 3) if good else HOSTILE[k][0]
        status, _, reply = _chat(port, body) if body is not None else _chat(
            port, None, raw=b"null")
        if good:
            return "ok" if status == 200 and reply["choices"] else f"good got {status}"
        return "refused" if 400 <= status < 500 and reply["error"]["message"] else \
            f"bad got {status}"

    with ThreadPoolExecutor(6) as pool:
        outcomes = list(pool.map(run, plan))
    assert set(outcomes) <= {"ok", "refused"}, [o for o in outcomes if o not in ("ok", "refused")]
    assert outcomes.count("ok") == sum(good for good, _ in plan) >= 20
    _alive(port)
    counters = loadtest.get_json(port, "/limits")[1]["counters"]
    assert counters["failed"] == 0 and counters["bad_request"] >= outcomes.count("refused")


# ---- in this process: no server ----
def test_validate_body_normalizes_and_names_fields() -> None:
    out = validate_body({"messages": [{"role": "user", "content": "hi"}], "stop": "x",
                         "xtc_probability": 0, "logit_bias": {" 7": 2}, "stream": True,
                         "stream_options": {}, "max_tokens": None, "top_k": None},
                        "chat", VOCAB)
    assert out["stop"] == ["x"] and out["xtc_probability"] == 0.0
    assert "max_tokens" not in out and "top_k" not in out  # null: not given
    assert out["logit_bias"] == {"7": 2.0} and out["stream_options"] == {"include_usage": False}
    with pytest.raises(LimitError, match="prompt=None is not allowed") as e:
        validate_body({}, "text", VOCAB)
    assert e.value.status == 400 and e.value.body()["error"]["param"] == "prompt"


def test_host_policy() -> None:
    policy = HostPolicy.local("127.0.0.1", 8080, [APP + "/"])
    assert policy.host_refusal("127.0.0.1:8080") is None
    assert policy.host_refusal("[::1]:8080") is None and policy.host_refusal(None)
    assert policy.host_refusal("127.0.0.1") and policy.host_refusal("attacker.example:8080")
    assert policy.origin_refusal(None) is None and policy.origin_refusal(APP) is None
    assert policy.origin_refusal("http://localhost:8080") is None  # same origin
    assert policy.origin_refusal("https://app.example:3000")
    assert HostPolicy.local("::1", 80).host_refusal("[::1]") is None


def _generation_args(stop_words: list[Any], top_logprobs: int = -1) -> Any:
    from mlx_lm import server as s

    return s.GenerationArguments(
        model=s.ModelDescription("default_model", "default_model", None),
        sampling=s.SamplingArguments(0.0, 1.0, 0, 0.0, 0.0, 0.1),
        logits=s.LogitsProcessorArguments(None, 0.0, 20, 0.0, 20, 0.0, 20),
        stop_words=stop_words, max_tokens=3, num_draft_tokens=3, logprobs=False,
        top_logprobs=top_logprobs, seed=None, chat_template_kwargs=None)


FAULT = 7  # top_logprobs that makes the loop's response step raise (injected below)


def _inject_step_fault(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure inside mlx_lm's loop, after the request's context went out: the loop
    formats top log-probs for every generated token."""
    from mlx_lm import server as mlx_server

    original = mlx_server._format_top_logprobs

    def faulty(logprobs: Any, top_n: int, tokenizer: Any) -> Any:
        if top_n == FAULT:
            raise RuntimeError("injected step fault")
        return original(logprobs, top_n, tokenizer)

    monkeypatch.setattr(mlx_server, "_format_top_logprobs", faulty)


def test_a_failing_request_ends_alone_and_the_loop_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request that cannot be served (a ``stop`` that is not text, as the HTTP checks
    would refuse) fails alone before it joins the batch; a failure inside a batch step
    ends the requests of that loop and the loop starts again. The next are served."""
    from mlx_lm.server import CompletionRequest

    from veloxquant_mlx.apps.server import _provider_class, add_serve_arguments, build_server_args
    from veloxquant_mlx.apps.server_http import GenerationFailed, LimitedResponseGenerator
    from veloxquant_mlx.apps.server_limits import ServerLimits
    from veloxquant_mlx.apps.server_salt import SaltedPromptCache

    write_tiny_model(tmp_path)
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--model", str(tmp_path), "--max-tokens", "3"])
    limits = ServerLimits(KVCacheConfig(), max_kv_memory=10**8, probe=16, chunk=64)
    provider = _provider_class()(build_server_args(args))
    generator = LimitedResponseGenerator(provider, SaltedPromptCache(
        provider, KVCacheConfig(), limits, max_size=4), limits)
    limits.ready.wait(60)
    assert generator.start_error is None
    _inject_step_fault(monkeypatch)
    request = CompletionRequest("text", "w1 w2 w3", [], None, None)
    try:
        with pytest.raises(GenerationFailed, match="request failed: ValueError"):
            generator.generate(request, _generation_args([5]))
        assert generator.failures == 0  # the loop never saw it fail
        _, tokens = generator.generate(request, _generation_args([], top_logprobs=FAULT))
        with pytest.raises(GenerationFailed, match="generation failed: RuntimeError"):
            list(tokens)
        for _ in range(2):
            _, tokens = generator.generate(request, _generation_args(["w9"]))
            assert len(list(tokens)) == 3
        assert generator.failures == 1 and generator.generation_available()
        _failures_over_http(generator, monkeypatch)
        assert generator.failures == 3 and generator.limits.counters["failed"] == 4
    finally:
        generator.stop_and_join()


def _failures_over_http(generator: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The handler's answers: a request failed before its context (a ``stop`` that is
    not text; the checks that refuse it are switched off for this) and one failed by its
    loop after it (the injected fault), streaming or not."""
    from veloxquant_mlx.apps import server_http

    monkeypatch.setattr(server_http, "validate_body", lambda body, kind, vocab: body)
    server_class, handler_class = server_http.bind_http()
    httpd = server_class(("127.0.0.1", 0), lambda *a, **k: handler_class(generator, *a, **k))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    port = httpd.server_address[1]
    try:
        for fault, message in (({"stop": 5}, "request failed: TypeError"),
                               ({"top_logprobs": FAULT}, "generation failed: RuntimeError")):
            status, _, reply = _chat(port, {**GOOD, **fault})
            assert status == 500 and reply["error"]["code"] == "generation_failed", reply
            assert reply["error"]["message"].startswith(message), reply
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("POST", "/v1/chat/completions",
                         json.dumps({**GOOD, **fault, "stream": True}))
            resp = conn.getresponse()
            text = resp.read().decode()
            conn.close()
            if "stop" in fault:  # nothing was streamed yet: a plain 500
                assert resp.status == 500 and message in text, text
            else:  # the stream had begun: an error event ends it
                assert resp.status == 200 and f'data: {{"error": {{"message": "{message}' \
                    in text and text.endswith("data: [DONE]\n\n"), text
        _alive(port)
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_salted_pool_matches_and_keeps_per_salt() -> None:
    """Admission's ``match`` (which pins the entry a request will start from) and the
    generation thread's fetch both see only the request's own salt."""
    from types import SimpleNamespace

    import mlx.core as mx

    from veloxquant_mlx.apps.server_limits import Ticket
    from veloxquant_mlx.apps.server_salt import SaltedPromptCache
    from veloxquant_mlx.testing.tiny import tiny_model

    model = tiny_model("llama")
    provider = SimpleNamespace(model_key=("tiny", None, None), model=model)
    pool = SaltedPromptCache(provider, KVCacheConfig(), None, max_size=4)
    tokens = list(range(1, 40))
    pool.pending_ticket = Ticket(need=0, prompt_tokens=39, max_tokens=1, salt="a")
    caches, rest = pool.fetch_nearest_cache(provider.model_key, tokens)
    model(mx.array([rest]), cache=list(caches))
    pool.insert_cache(provider.model_key, tokens, list(caches))
    longer = tokens + [5]
    assert pool.match(longer, salt="a") is not None
    assert pool.match(longer) is None and pool.match(longer, salt="b") is None
    for salt, reused in (("b", 0), (None, 0), ("a", 39)):
        pool.pending_ticket = Ticket(need=0, prompt_tokens=40, max_tokens=1, salt=salt)
        assert len(longer) - len(pool.fetch_nearest_cache(provider.model_key, longer)[1]) \
            == reused


class _Quick(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        pass


def test_an_interrupt_as_a_handler_starts_reaches_the_server_loop(monkeypatch) -> None:
    """A signal that lands while a handler thread starts used to release that thread's
    connection slot twice: the ValueError replaced the interrupt, and socketserver
    swallowed it, so the server ran on until a SIGKILL lost its unsaved caches."""
    from veloxquant_mlx.apps.server_http import bind_http

    server_class, _ = bind_http(max_connections=2)
    httpd = server_class(("127.0.0.1", 0), _Quick)
    start = threading.Thread.start

    def start_then_interrupt(thread: threading.Thread) -> None:
        start(thread)
        thread.join()  # the handler ran and gave its slot back
        raise KeyboardInterrupt

    a, b = socket.socketpair()
    try:
        monkeypatch.setattr(threading.Thread, "start", start_then_interrupt)
        with pytest.raises(KeyboardInterrupt):
            httpd.process_request(a, ("127.0.0.1", 1))
        monkeypatch.undo()
        assert httpd._slots._value == 2  # every slot free, none released twice
    finally:
        b.close()
        httpd.server_close()


def test_sigterm_stops_the_server_loop_between_requests() -> None:
    """SIGTERM shuts the HTTP loop down from another thread: ``serve_forever`` returns
    normally (then ``serve`` drains the generation loop and saves the kept caches)."""
    import signal

    from veloxquant_mlx.apps.server import _stop_on_signals
    from veloxquant_mlx.apps.server_http import bind_http

    server_class, _ = bind_http()
    httpd = server_class(("127.0.0.1", 0), _Quick)
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM))
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are installed from the main thread only")
    try:
        _stop_on_signals(server_class)
        assert signal.getsignal(signal.SIGTERM) is not handlers[0]  # or SIGTERM ends us
        timer.start()
        t0 = time.monotonic()
        httpd.serve_forever(poll_interval=0.05)  # an interrupt here would fail the test
        assert time.monotonic() - t0 < 30
    finally:
        timer.cancel()
        signal.signal(signal.SIGTERM, handlers[0])
        signal.signal(signal.SIGINT, handlers[1])
        httpd.server_close()
