"""Load test of ``veloxquant serve`` on 127.0.0.1: limits, queue, cancellation, latency.

``python -m veloxquant_mlx.eval.loadtest --method none --method kivi:bits=4 ...`` starts
one server per method with the same ``--max-kv-memory`` (one after the other, so they
do not compete for the CPU) and runs, against each:

1. **Capacity.** ``fits + max_queue + 2`` concurrent streaming "conversations" of
   ``--conversation-tokens`` tokens (prompt + max_tokens). The server admits as many as
   its measured KV cost fits in the budget; the next ``max_queue`` wait and the rest get
   429 with ``Retry-After``. Then every admitted client hangs up: the server must cancel
   them (before their next prefill step) and release their reservations, after which
   the queued ones are admitted and hang up too.
2. **Mixed load.** One full conversation (streaming) plus ``--requests`` requests from
   ``--clients`` concurrent clients: short and medium prompts, streaming and not, bad
   inputs (malformed JSON, no messages, ``max_tokens: -5``, a string temperature, a
   prompt past the context) and clients that hang up mid-stream or mid-prefill. Every
   request must be answered correctly or refused clearly (a JSON error; 429/503 with
   ``Retry-After``); the server must stay up and its real KV memory (MLX's allocator,
   ``GET /limits``) within the budget. Latency p50/p95 and tokens/s are reported.

Everything is bounded: each request has a socket timeout, each phase a deadline, the
whole run ``--timeout`` seconds; servers are stopped at the end of each method.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from veloxquant_mlx.apps.server import free_port

# Common English words that SmolLM2's tokenizer encodes as one token each (with the
# leading space), so a prompt of n words is about n tokens.
ENGLISH = (
    "the of and to in is that it was for on are as with his they at be this from have or "
    "by one had not but what all were when we there can an your which their said if do "
    "will each about how up out them then she many some so these would other into has more "
    "her two like him see time could no make than first been who now people my made over "
    "did down only way find use may water long little very after words called just where "
    "most know get through back much before go good new write our used me man too any day "
    "same right look think also around another came come work three word must because does "
    "part even place well such here take why things help put years different away again off "
    "went old number great tell men say small every found still between name should home big "
    "give air line set own under read last never us left end along while might next sound "
    "below saw something thought both few those always looked show large often together"
).split()


@dataclass
class Spec:
    """One request of the scenario and what must come back."""

    kind: str
    body: dict[str, Any] | None
    raw: bytes | None = None
    stream: bool = False
    expect: int = 200
    hang_up: float | None = None  # seconds (non-streaming) or 0: after the first chunk
    timeout: float = 300.0


@dataclass
class Result:
    kind: str
    outcome: str  # ok | rejected (expected 400) | refused | cancelled | failed
    status: int | None = None
    latency_s: float = 0.0
    ttft_s: float | None = None
    tokens: int = 0
    detail: str = ""


def words(n: int, vocab: Sequence[str], seed: int = 0) -> str:
    return " ".join(vocab[(seed * 31 + i * 7) % len(vocab)] for i in range(max(n, 0)))


def chat(text: str, max_tokens: int | None, stream: bool = False, **extra: Any) -> dict:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": text}], "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    body.update(extra)
    return body


def get_json(port: int, path: str, timeout: float = 10.0) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


# ---- one request ----
def _check_json_reply(data: dict) -> tuple[bool, int, str]:
    choice = (data.get("choices") or [{}])[0]
    usage = data.get("usage") or {}
    content = (choice.get("message") or {}).get("content")
    ok = (isinstance(content, str) and bool(content)
          and choice.get("finish_reason") in ("stop", "length")
          and usage.get("completion_tokens", 0) >= 1)
    return ok, int(usage.get("completion_tokens", 0)), "" if ok else f"bad reply {data!r:.200}"


def _read_stream(resp: http.client.HTTPResponse, t0: float, hang_up: bool
                 ) -> tuple[str, float | None, int, str]:
    """``(outcome, ttft, completion tokens, detail)`` of an event stream."""
    ttft, chunks, tokens, finish = None, 0, 0, None
    while True:
        line = resp.readline()
        if not line:
            return "failed", ttft, tokens, "stream ended without [DONE]"
        line = line.strip()
        if not line.startswith(b"data:"):
            continue  # blank separators and ": keepalive" comments
        payload = line[5:].strip()
        if payload == b"[DONE]":
            ok = chunks > 0 and finish in ("stop", "length") and tokens >= 1
            return ("ok" if ok else "failed"), ttft, tokens, "" if ok else "no content/usage"
        event = json.loads(payload)
        tokens = int((event.get("usage") or {}).get("completion_tokens", tokens))
        choice = (event.get("choices") or [{}])[0]
        finish = choice.get("finish_reason") or finish
        if (choice.get("delta") or {}).get("content"):
            chunks += 1
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            if hang_up:
                return "cancelled", ttft, 0, "hung up after the first chunk"


def _refusal(resp: http.client.HTTPResponse, spec: Spec) -> tuple[str, str]:
    raw = resp.read()
    try:
        error = json.loads(raw).get("error")
    except (ValueError, AttributeError):
        error = None
    if isinstance(error, dict):  # OpenAI's shape: {"error": {"message", "type", ...}}
        error = error.get("message")
    if not (isinstance(error, str) and error):
        return "failed", f"{resp.status} without a JSON error: {raw[:200]!r}"
    if resp.status in (429, 503):
        ok = (resp.getheader("Retry-After") or "").isdigit()
        return ("refused" if ok else "failed"), error[:300]
    if resp.status == 400:
        return ("rejected" if spec.expect == 400 else "refused"), error[:300]
    return "failed", f"{resp.status}: {error[:300]}"


def run_one(port: int, spec: Spec) -> Result:
    """Send ``spec``; classify what came back (never raises)."""
    t0 = time.perf_counter()
    data = spec.raw if spec.raw is not None else json.dumps(spec.body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=spec.timeout)
    try:
        conn.request("POST", "/v1/chat/completions", body=data,
                     headers={"Content-Type": "application/json"})
        if spec.hang_up and not spec.stream:
            conn.sock.settimeout(spec.hang_up)
        try:
            resp = conn.getresponse()
        except TimeoutError:
            if spec.hang_up and not spec.stream:
                return Result(spec.kind, "cancelled", None, time.perf_counter() - t0,
                              detail=f"hung up after {spec.hang_up} s")
            raise
        return _classify(spec, resp, t0)
    except (OSError, http.client.HTTPException, ValueError) as e:
        return Result(spec.kind, "failed", None, time.perf_counter() - t0,
                      detail=f"{type(e).__name__}: {e}")
    finally:
        conn.close()


def _classify(spec: Spec, resp: http.client.HTTPResponse, t0: float) -> Result:
    if resp.status != 200:
        outcome, detail = _refusal(resp, spec)
        return Result(spec.kind, outcome, resp.status, time.perf_counter() - t0, detail=detail)
    if spec.expect != 200:
        return Result(spec.kind, "failed", 200, time.perf_counter() - t0,
                      detail="accepted a request that must be refused")
    if spec.stream:
        outcome, ttft, chunks, detail = _read_stream(resp, t0, spec.hang_up == 0)
        return Result(spec.kind, outcome, 200, time.perf_counter() - t0, ttft, chunks, detail)
    ok, tokens, detail = _check_json_reply(json.loads(resp.read()))
    latency = time.perf_counter() - t0
    return Result(spec.kind, "ok" if ok else "failed", 200, latency, latency, tokens, detail)


# ---- the server ----
class ServerProcess:
    """``veloxquant serve`` in a subprocess on 127.0.0.1, stopped when the block ends."""

    def __init__(self, method: str, max_kv_memory: str, model: str | None = None,
                 extra: Sequence[str] = (), log_path: Path | None = None,
                 start_timeout: float = 600.0) -> None:
        self.port = free_port()
        self.cmd = [sys.executable, "-m", "veloxquant_mlx", "serve", "--host", "127.0.0.1",
                    "--port", str(self.port), "--method", method,
                    "--max-kv-memory", str(max_kv_memory), *extra]
        if model:
            self.cmd += ["--model", model]
        self.log_path = log_path
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (root, os.environ.get("PYTHONPATH", "")) if p))
        self._log = open(self.log_path or os.devnull, "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(self.cmd, cwd=root, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        end = time.monotonic() + self.start_timeout
        while time.monotonic() < end:
            if not self.alive():
                raise RuntimeError(f"server exited with {self.proc.returncode}: "
                                   f"{self.log_tail()}")
            try:
                if get_json(self.port, "/health", timeout=2)[0] == 200:
                    return
            except (OSError, ValueError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server did not start within {self.start_timeout:g} s")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 3000) -> str:
        if self.log_path is None or not Path(self.log_path).exists():
            return "(no log)"
        return Path(self.log_path).read_bytes()[-n:].decode(errors="replace")

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
        self._log.close()


def stop_process(proc: subprocess.Popen, timeout: float = 20.0) -> None:
    """Terminate ``proc`` if it still runs; kill it when it ignores that for ``timeout`` s."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)


def bytes_for(cost: dict[str, Any], tokens: int) -> int:
    """The server's reservation for ``tokens`` (same rule as ``KVCost.bytes_for``)."""
    return math.ceil(cost["fixed_bytes"] + cost["bytes_per_token"] * (tokens + cost["token_step"]))


def post_json(port: int, body: dict, timeout: float = 60.0) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


def prompt_overhead(port: int, vocab: Sequence[str], max_context: int) -> int:
    """Tokens the chat template adds, read from the server's own context refusal."""
    status, reply = post_json(port, chat(words(100, vocab), max_tokens=max_context))
    facts = reply.get("limit") or {}
    if status != 400 or "prompt_tokens" not in facts:
        raise RuntimeError(f"expected a context refusal with prompt_tokens, got {status} "
                           f"{reply!r:.300}")
    return int(facts["prompt_tokens"]) - 100


# ---- phase 1: how many long conversations fit ----
def _hold(port: int, body: dict, release: threading.Event, out: list, timeout: float) -> None:
    """One long conversation: wait for the verdict; if admitted, hang up on ``release``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        out.append((resp.status, resp.getheader("Retry-After")))
        if resp.status == 200:
            release.wait(timeout)
        else:
            resp.read()
    except (OSError, http.client.HTTPException) as e:
        out.append((None, f"{type(e).__name__}: {e}"))
    finally:
        conn.close()


def _poll(port: int, until: Callable[[dict], bool], deadline: float, every: float = 0.25
          ) -> dict:
    """``GET /limits`` until ``until(snapshot)`` or the deadline; the last snapshot."""
    snap: dict = {}
    while True:
        try:
            snap = get_json(port, "/limits")[1]
        except (OSError, ValueError):
            pass
        if (snap and until(snap)) or time.monotonic() >= deadline:
            return snap
        time.sleep(every)


def capacity_phase(port: int, limits: dict, conv_tokens: int, vocab: Sequence[str],
                   overhead: int, deadline: float, max_tokens: int = 64) -> dict[str, Any]:
    """Concurrent long conversations: how many are admitted at once, and the hang-ups."""
    expected = limits["max_kv_memory"] // bytes_for(limits["kv_cost"], conv_tokens)
    n = min(expected + limits["max_queue"] + 2, 64)
    body = chat(words(conv_tokens - max_tokens - overhead, vocab), max_tokens, stream=True)
    release, out = threading.Event(), []
    wait = max(deadline - time.monotonic(), 1.0)
    threads = [threading.Thread(target=_hold, args=(port, body, release, out, wait), daemon=True)
               for _ in range(n)]
    for t in threads:
        t.start()
    # Every client has its verdict: admitted or refused (in ``out``), or queued.
    full = _poll(port, lambda s: len(out) + s["queued_requests"] >= n,
                 min(deadline, time.monotonic() + 120))
    release.set()
    t0 = time.monotonic()
    done = _poll(port, lambda s: s["active_requests"] == 0 and s["queued_requests"] == 0
                 and s["reserved_bytes"] == 0 and len(out) >= n, deadline)
    released_s = time.monotonic() - t0
    for t in threads:
        t.join(timeout=max(deadline - time.monotonic(), 0.1))
    statuses = [s for s, _ in out]
    steps = [c["prefilled_at_stop"] - c["prefilled_at_cancel"] for c in done["cancelled_recent"]
             if c["prefilled_at_stop"] is not None and c["prefilled_at_cancel"] is not None]
    return {"conversation_tokens": conv_tokens, "sent": n, "fits_expected": expected,
            "fits_observed": full.get("active_requests"), "queued": full.get("queued_requests"),
            "admitted_total": statuses.count(200), "refused_429": statuses.count(429),
            "refused_503": statuses.count(503), "other": n - statuses.count(200)
            - statuses.count(429) - statuses.count(503),
            "retry_after_given": all(r and str(r).isdigit() for s, r in out if s in (429, 503)),
            "reserved_at_capacity": full.get("reserved_bytes"),
            "release_s": released_s, "released": done.get("reserved_bytes") == 0
            and done.get("active_requests") == 0,
            "max_prefill_after_cancel": max(steps, default=None)}


# ---- phase 2: mixed load ----
def mixed_specs(n: int, conv_tokens: int, max_context: int, vocab: Sequence[str],
                overhead: int) -> list[Spec]:
    """One full long conversation first, then ``n`` requests of a fixed cycle of kinds."""
    long_prompt = words(conv_tokens - 64 - overhead, vocab, seed=99)
    specs = [Spec("long", chat(long_prompt, 64, stream=True), stream=True, timeout=1800)]

    def short(i: int, stream: bool = False, **kw: Any) -> Spec:
        return Spec("short", chat(words(20 + 9 * (i % 5), vocab, i), 24, stream), stream=stream,
                    **kw)

    def medium(i: int, stream: bool = False, **kw: Any) -> Spec:
        return Spec("medium", chat(words(300 + 40 * (i % 4), vocab, i), 24, stream),
                    stream=stream, **kw)

    def bad(kind: str, body: dict | None, raw: bytes | None = None) -> Spec:
        return Spec(kind, body, raw=raw, expect=400, timeout=120)

    cycle: list[Callable[[int], Spec]] = [
        lambda i: short(i),
        lambda i: short(i, True),
        lambda i: bad("bad:json", None, b'{"messages": [{"role": "user", "content": "hi"'),
        lambda i: medium(i),
        lambda i: Spec("hangup:stream", chat(words(40, vocab, i), 64, True), stream=True,
                       hang_up=0),
        lambda i: bad("bad:no-messages", {"max_tokens": 8}),
        lambda i: short(i, True),
        lambda i: medium(i, True),
        lambda i: bad("bad:max_tokens", chat("hello", -5)),
        lambda i: Spec("hangup:prefill", chat(words(600, vocab, i), 24), hang_up=0.5),
        lambda i: bad("bad:temperature", chat("hello", 8, temperature="hot")),
        lambda i: bad("bad:context", chat(words(max_context + 50, vocab, i), 8)),
    ]
    specs += [cycle[i % len(cycle)](i) for i in range(n)]
    return specs


def _worker(port: int, todo: queue.Queue, results: list, running: dict,
            deadline: float) -> None:
    me = threading.get_ident()
    while time.monotonic() < deadline:
        try:
            spec = todo.get_nowait()
        except queue.Empty:
            return
        spec.timeout = min(spec.timeout, max(deadline - time.monotonic(), 1.0))
        running[me] = spec
        results.append(run_one(port, spec))
        del running[me]


def _monitor(port: int, stop: threading.Event, peaks: dict) -> None:
    while not stop.wait(0.5):
        try:
            snap = get_json(port, "/limits", timeout=5)[1]
        except (OSError, ValueError):
            continue
        for key in ("kv_real_bytes", "reserved_bytes", "queued_requests", "active_requests"):
            peaks[key] = max(peaks.get(key, 0), snap.get(key) or 0)


def run_specs(port: int, specs: Sequence[Spec], clients: int, deadline: float
              ) -> tuple[list[Result], float, dict]:
    """Run ``specs`` from ``clients`` threads (in order); results, wall time, peaks."""
    todo: queue.Queue = queue.Queue()
    for spec in specs:
        todo.put(spec)
    results: list[Result] = []
    running: dict[int, Spec] = {}
    peaks: dict[str, int] = {}
    stop = threading.Event()
    monitor = threading.Thread(target=_monitor, args=(port, stop, peaks), daemon=True)
    monitor.start()
    t0 = time.perf_counter()
    workers = [threading.Thread(target=_worker, args=(port, todo, results, running, deadline),
                                daemon=True) for _ in range(clients)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=max(deadline - time.monotonic(), 0) + 5)
    wall = time.perf_counter() - t0
    stop.set()
    monitor.join(timeout=10)
    results = list(results)  # late answers of abandoned requests are not counted
    results += [Result(s.kind, "failed", detail="still running at the deadline")
                for s in list(running.values())]
    results += [Result(s.kind, "failed", detail="not run before the deadline")
                for s in list(todo.queue)]
    return results, wall, peaks


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(math.ceil(q * len(ordered)) - 1, 0)]


def summarize(results: Sequence[Result], wall: float) -> dict[str, Any]:
    """Outcome counts, latency percentiles and tokens/s of one mixed run."""
    counts = {k: sum(r.outcome == k for r in results)
              for k in ("ok", "rejected", "refused", "cancelled", "failed")}
    ok = [r for r in results if r.outcome == "ok"]
    short = [r.latency_s for r in ok if r.kind == "short"]
    long = [r for r in ok if r.kind == "long"]
    return {
        "requests": len(results), **counts,
        "latency_p50_s": percentile([r.latency_s for r in ok], 0.5),
        "latency_p95_s": percentile([r.latency_s for r in ok], 0.95),
        "short_p50_s": percentile(short, 0.5), "short_p95_s": percentile(short, 0.95),
        "ttft_p50_s": percentile([r.ttft_s for r in ok if r.ttft_s is not None], 0.5),
        "long_latency_s": long[0].latency_s if long else None,
        "completion_tokens": sum(r.tokens for r in ok),
        "tokens_per_s": sum(r.tokens for r in ok) / wall if wall > 0 else 0.0,
        "wall_s": wall,
        "failures": [asdict(r) for r in results if r.outcome == "failed"][:10],
    }


# ---- one method, then the table ----
@dataclass
class LoadConfig:
    methods: list[str]
    max_kv_memory: str = "256MB"
    model: str | None = None
    conversation_tokens: int = 4096
    requests: int = 24
    clients: int = 4
    max_queue: int = 4
    queue_timeout: float = 120.0
    prefill_step_size: int = 256
    timeout: float = 1200.0
    vocab: list[str] = field(default_factory=lambda: list(ENGLISH))
    server_args: list[str] = field(default_factory=list)
    log_dir: Path | None = None


def _settle(port: int, deadline: float) -> dict:
    return _poll(port, lambda s: s["active_requests"] == 0 and s["reserved_bytes"] == 0
                 and s["queued_requests"] == 0, deadline, every=0.5)


def run_method(method: str, cfg: LoadConfig, deadline: float) -> dict[str, Any]:
    """Capacity and mixed load against one server; the row of the table."""
    extra = ["--max-queue", str(cfg.max_queue), "--queue-timeout", str(cfg.queue_timeout),
             "--prefill-step-size", str(cfg.prefill_step_size), *cfg.server_args]
    log = cfg.log_dir / f"serve-{method.replace(':', '_').replace(',', '_')}.log" \
        if cfg.log_dir else None
    t_start = time.monotonic()
    with ServerProcess(method, cfg.max_kv_memory, cfg.model, extra, log) as server:
        start_s = time.monotonic() - t_start
        limits = get_json(server.port, "/limits")[1]
        overhead = prompt_overhead(server.port, cfg.vocab, limits["max_context"])
        capacity = capacity_phase(server.port, limits, cfg.conversation_tokens, cfg.vocab,
                                  overhead, min(deadline, time.monotonic() + 300))
        specs = mixed_specs(cfg.requests, cfg.conversation_tokens, limits["max_context"],
                            cfg.vocab, overhead)
        results, wall, peaks = run_specs(server.port, specs, cfg.clients, deadline)
        after = _settle(server.port, min(deadline + 60, time.monotonic() + 120))
        healthy = server.alive() and get_json(server.port, "/health")[0] == 200
    return {"method": method, "start_s": start_s, "kv_cost": limits["kv_cost"],
            "max_kv_memory": limits["max_kv_memory"], "max_context": limits["max_context"],
            "capacity": capacity, "mixed": summarize(results, wall), "peaks": peaks,
            "kv_real_peak_bytes": after.get("kv_real_peak_bytes"),
            "peak_reserved_bytes": after.get("peak_reserved_bytes"),
            "kv_real_over_reserved_peak_bytes": after.get("kv_real_over_reserved_peak_bytes"),
            "released_after": after.get("reserved_bytes") == 0
            and after.get("active_requests") == 0,
            "counters": after.get("counters"), "crashed": not healthy,
            "within_budget": (after.get("kv_real_peak_bytes") or 0) <= limits["max_kv_memory"]}


def run_load_test(cfg: LoadConfig) -> list[dict[str, Any]]:
    """Every method in turn, sharing ``cfg.timeout`` seconds evenly."""
    end = time.monotonic() + cfg.timeout
    rows = []
    for i, method in enumerate(cfg.methods):
        share = (end - time.monotonic()) / (len(cfg.methods) - i)
        rows.append(run_method(method, cfg, time.monotonic() + share))
    return rows


def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e6:.1f}"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    head = ("| method | KV bytes/token (measured) | tokens vs dense | "
            "{conv}-token conversations fitting (expected / admitted at once) | "
            "rest of the burst: queued / 429 / errors | "
            "mixed: ok / 400 / 429+503 / hung up / failed | latency p50 / p95 s | "
            "short p50 / p95 s | long conversation s | tokens/s | real KV peak MB / budget | "
            "crashed |")
    lines = [head.format(conv=rows[0]["capacity"]["conversation_tokens"] if rows else "?"),
             "|" + "---|" * 12]
    for r in rows:
        m, c, k = r["mixed"], r["capacity"], r["kv_cost"]
        ratio = k.get("fits_x_dense")
        lines.append(
            f"| `{r['method']}` | {k['bytes_per_token']:.0f} | "
            f"{'-' if ratio is None else f'{ratio:.2f}x'} | {c['fits_expected']} / "
            f"{c['fits_observed']} | {c['queued']} / {c['refused_429']} / {c['other']} | "
            f"{m['ok']} / {m['rejected']} / {m['refused']} / "
            f"{m['cancelled']} / {m['failed']} | {_s(m['latency_p50_s'])} / "
            f"{_s(m['latency_p95_s'])} | {_s(m['short_p50_s'])} / {_s(m['short_p95_s'])} | "
            f"{_s(m['long_latency_s'])} | {m['tokens_per_s']:.2f} | "
            f"{_mb(r['kv_real_peak_bytes'])} / {_mb(r['max_kv_memory'])} | "
            f"{'yes' if r['crashed'] else 'no'} |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m veloxquant_mlx.eval.loadtest",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--method", action="append", dest="methods",
                   help="method spec, repeatable (default: none, kivi:bits=4, affine:bits=4)")
    p.add_argument("--max-kv-memory", default="256MB")
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--conversation-tokens", type=int, default=4096)
    p.add_argument("--requests", type=int, default=24, help="mixed requests per method")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--max-queue", type=int, default=4)
    p.add_argument("--queue-timeout", type=float, default=120.0)
    p.add_argument("--prefill-step-size", type=int, default=256)
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds for the whole run")
    p.add_argument("--vocabulary", type=Path, default=None,
                   help="file of words for prompts (default: one-token English words)")
    p.add_argument("--server-arg", action="append", default=[], dest="server_args",
                   help="extra flag for `veloxquant serve` (repeatable, e.g. --server-arg=--x)")
    p.add_argument("--log-dir", type=Path, default=None, help="keep each server's output")
    p.add_argument("--json", type=Path, default=None, help="write the rows as JSON")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for name in ("conversation_tokens", "requests", "clients", "prefill_step_size"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}={getattr(args, name)} is not "
                             "allowed: a positive integer")
    vocab = args.vocabulary.read_text().split() if args.vocabulary else list(ENGLISH)
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    from veloxquant_mlx.registry import reference

    cfg = LoadConfig(methods=args.methods or [reference(), "kivi:bits=4", "affine:bits=4"],
                     max_kv_memory=args.max_kv_memory, model=args.model,
                     conversation_tokens=args.conversation_tokens, requests=args.requests,
                     clients=args.clients, max_queue=args.max_queue,
                     queue_timeout=args.queue_timeout, prefill_step_size=args.prefill_step_size,
                     timeout=args.timeout, vocab=vocab, server_args=args.server_args,
                     log_dir=args.log_dir)
    t0 = time.perf_counter()
    rows = run_load_test(cfg)
    print(markdown_table(rows))
    print(f"\nwall time {time.perf_counter() - t0:.0f} s", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=str))
    bad = [r["method"] for r in rows if r["crashed"] or r["mixed"]["failed"]
           or r["capacity"]["other"] or not r["within_budget"] or not r["released_after"]]
    if bad:
        print(f"FAILED: {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
