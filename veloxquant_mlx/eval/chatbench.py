"""Chat benchmark: conversations whose every turn resends the whole history.

``N`` conversations of ``T`` turns run at once against a server on 127.0.0.1: each starts
with the same system prompt, each turn adds a short user message and the answer of the
previous turn (what a chat client sends back), so histories grow and a server that
reuses finished caches prefills only what is new. For every turn index: time to first
token and turn latency (p50 / p95 over the conversations); over the run: completion
tokens per second, the KV bytes the server holds (``veloxquant serve``: the allocator's
reading, ``/limits``) and the conversations it keeps warm. Each ``veloxquant serve``
method runs beside ``mlx_lm.server`` (dense caches and its own prompt cache) on the same
model, one server after the other. Bounded: every request has a timeout, the run a
deadline.

    python -m veloxquant_mlx.eval.chatbench --method kivi:bits=4 --method none \\
        --conversations 8 --turns 4 --plot chat.png

``--overflow R``: conversations outliving RAM and a restart. ``N`` conversations, each
opening with its own long document, take their turns round robin (every conversation's
turn ``t`` before any turn ``t + 1``), so with room for ``R`` kept caches every next turn
finds its conversation evicted. Three runs of one method: the disk tier
(``--prompt-cache-dir``, the server restarted before turn ``--restart-at``), the same
without it (evicted and restarted conversations are prefilled again) and warm RAM reuse
(room for all, no restart); and ``mlx_lm.server`` with the same room in RAM and the
same restart. Per turn: latency p50 / p95, the share of prompt tokens
served from a cache, and whether each answer equals the warm run's (nothing lost or
mixed between conversations: a restored cache is the kept one)::

    python -m veloxquant_mlx.eval.chatbench --overflow 8 --conversations 40 --turns 4
"""

from __future__ import annotations

import argparse
import http.client
import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from veloxquant_mlx.config import KVCacheConfig
from veloxquant_mlx.eval.loadtest import (
    ENGLISH,
    ServerProcess,
    get_json,
    percentile,
    post_json,
    words,
)
from veloxquant_mlx.eval.serverbench import MlxLmServer, model_folder

REFERENCE = "mlx_lm.server"
DENSE = KVCacheConfig().to_string()  # the dense cache of veloxquant serve


@dataclass
class Turn:
    conversation: int
    index: int
    ttft_s: float | None
    latency_s: float
    tokens: int
    prompt_chars: int
    ok: bool
    detail: str = ""


@dataclass
class ChatConfig:
    conversations: int = 8
    turns: int = 4
    system_words: int = 400
    user_words: int = 30
    max_tokens: int = 32
    timeout: float = 600.0
    deadline: float = 3600.0
    extra: list[str] = field(default_factory=list)  # more ``veloxquant serve`` flags


def stream_turn(port: int, messages: list[dict[str, str]], max_tokens: int,
                timeout: float) -> tuple[float | None, int, str, str]:
    """One streamed chat request: ``(ttft, completion tokens, content, error)``."""
    body = {"messages": messages, "max_tokens": max_tokens, "stream": True,
            "temperature": 0.0, "stream_options": {"include_usage": True}}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t0, ttft, tokens, text = time.perf_counter(), None, 0, []
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return None, 0, "", f"HTTP {resp.status}: {resp.read()[:200]!r}"
        for line in resp:
            line = line.strip()
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            event = json.loads(line[5:])
            tokens = int((event.get("usage") or {}).get("completion_tokens", tokens))
            piece = ((event.get("choices") or [{}])[0].get("delta") or {}).get("content")
            if piece:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                text.append(piece)
        return ttft, tokens, "".join(text), ""
    except (OSError, http.client.HTTPException, ValueError) as e:
        return ttft, tokens, "".join(text), f"{type(e).__name__}: {e}"
    finally:
        conn.close()


def _conversation(port: int, i: int, cfg: ChatConfig, system: str, end: float,
                  out: list[Turn]) -> None:
    messages = [{"role": "system", "content": system}]
    for t in range(cfg.turns):
        if time.monotonic() > end:
            return
        messages.append({"role": "user", "content": words(cfg.user_words, ENGLISH,
                                                           seed=1000 * i + t + 1)})
        t0 = time.perf_counter()
        ttft, tokens, text, error = stream_turn(port, messages, cfg.max_tokens, cfg.timeout)
        out.append(Turn(i, t, ttft, time.perf_counter() - t0, tokens,
                        sum(len(m["content"]) for m in messages), not error and tokens > 0,
                        error))
        if error:
            return
        messages.append({"role": "assistant", "content": text})


def run_chats(port: int, cfg: ChatConfig) -> tuple[list[Turn], float]:
    """Every conversation in its own thread; the turns and the wall time."""
    system = "You are a helpful assistant. Context: " + words(cfg.system_words, ENGLISH)
    end = time.monotonic() + cfg.deadline
    turns: list[Turn] = []
    threads = [threading.Thread(target=_conversation, args=(port, i, cfg, system, end, turns))
               for i in range(cfg.conversations)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return turns, time.perf_counter() - t0


def summarize(label: str, turns: Sequence[Turn], wall: float, limits: dict | None
              ) -> dict[str, Any]:
    ok = [t for t in turns if t.ok]
    by_turn = {}
    for index in sorted({t.index for t in ok}):
        lat = [t.latency_s for t in ok if t.index == index]
        ttft = [t.ttft_s for t in ok if t.index == index and t.ttft_s is not None]
        by_turn[index] = {"latency_p50_s": percentile(lat, 0.5),
                          "latency_p95_s": percentile(lat, 0.95),
                          "ttft_p50_s": percentile(ttft, 0.5), "ttft_p95_s": percentile(ttft, 0.95)}
    return {"server": label, "ok": len(ok), "failed": len(turns) - len(ok),
            "errors": sorted({t.detail for t in turns if t.detail})[:5],
            "wall_s": wall, "tokens_per_s": sum(t.tokens for t in ok) / wall if wall else 0.0,
            "by_turn": by_turn, "limits": limits}


def _limits(server: ServerProcess) -> dict | None:
    try:
        return get_json(server.port, "/limits")[1]
    except (OSError, ValueError):
        return None


def _log_name(kind: str, method: str) -> str:
    return f"{kind}-{method.replace(':', '_').replace(',', '_')}.log"


def bench(methods: Sequence[str], cfg: ChatConfig, max_kv_memory: str,
          log_dir: Path | None = None) -> list[dict[str, Any]]:
    """``mlx_lm.server`` first, then ``veloxquant serve`` per method."""
    model = model_folder()
    servers: list[tuple[str, ServerProcess]] = [
        (REFERENCE, MlxLmServer(model, log_path=log_dir and log_dir / "mlx_lm.log"))]
    for m in methods:
        log = log_dir and log_dir / _log_name("serve", m)
        servers.append((m, ServerProcess(m, max_kv_memory, model=model, extra=cfg.extra,
                                         log_path=log)))
    rows = []
    for label, server in servers:
        with server:
            turns, wall = run_chats(server.port, cfg)
            rows.append(summarize(label, turns, wall,
                                  None if label == REFERENCE else _limits(server)))
    return rows


@dataclass
class WarmConfig:
    """Conversations of ``tokens`` prompt tokens each, sent one after the other."""

    conversations: int = 24
    tokens: int = 4096
    timeout: float = 600.0


def _kept(server: ServerProcess) -> dict[str, Any]:
    return (_limits(server) or {}).get("prompt_cache") or {}


def _kept_settled(server: ServerProcess, timeout: float = 30.0) -> dict[str, Any]:
    """``_kept`` once every request's cache was handed to the pool: an answer reaches
    the client before the generation thread does that, and neither a planned restart nor
    a count of kept entries may cut it short."""
    deadline = time.monotonic() + timeout
    while True:
        kept = _kept(server)
        counters = kept.get("counters", {})
        if (counters.get("finished", 0) >= counters.get("requests", 0)
                or time.monotonic() > deadline):
            return kept
        time.sleep(0.05)


def warm_conversations(server: ServerProcess, cfg: WarmConfig) -> dict[str, Any]:
    """How many finished conversations of ``cfg.tokens`` tokens the server keeps warm.

    Every conversation is sent once (one answer token), then each is sent again, the
    most recently used first, until one is not served from its kept cache (the server's
    reuse counters grew by less than its prompt). ``kept`` is what ``/limits`` listed
    after the first pass (entries charged by the allocator's measure); ``verified``
    shows they are real, and is a lower bound: a re-sent request needs room for itself
    beside the kept ones, so with a full budget it evicts the oldest."""
    n_words = cfg.tokens - 16  # about a token each, the chat template's tokens aside
    prompts = [[{"role": "user", "content": words(n_words, ENGLISH, seed=i + 1)}]
               for i in range(cfg.conversations)]
    cold, warm, verified = [], [], 0
    for messages in prompts:
        t0 = time.perf_counter()
        error = stream_turn(server.port, messages, 1, cfg.timeout)[3]
        if error:
            raise RuntimeError(f"filling the prompt cache failed: {error}")
        cold.append(time.perf_counter() - t0)
    kept = _kept_settled(server)
    entries = int(kept.get("entries", 0))
    for messages in reversed(prompts):
        before = kept.get("counters", {}).get("reused_tokens", 0)
        t0 = time.perf_counter()
        stream_turn(server.port, messages, 1, cfg.timeout)
        seconds = time.perf_counter() - t0
        now = _kept(server)
        if now.get("counters", {}).get("reused_tokens", 0) - before < 0.9 * n_words:
            break  # a cold one prefills in full and evicts: the older ones prove nothing
        verified += 1
        warm.append(seconds)
        kept = now
    limits = _limits(server) or {}
    return {"kept": entries, "verified": verified,
            "cold_s_p50": percentile(cold, 0.5), "warm_s_p50": percentile(warm, 0.5),
            "kept_bytes": limits.get("kept_bytes"),
            "max_kv_memory": limits.get("max_kv_memory")}


def warm_bench(methods: Sequence[str], cfg: WarmConfig, max_kv_memory: str,
               extra: Sequence[str] = (), log_dir: Path | None = None
               ) -> list[dict[str, Any]]:
    """``warm_conversations`` for each method within the same ``--max-kv-memory``."""
    model = model_folder()
    rows = []
    for m in methods:
        log = log_dir and log_dir / _log_name("warm", m)
        flags = ["--prompt-cache-size", str(cfg.conversations + 1), *extra]
        with ServerProcess(m, max_kv_memory, model=model, extra=flags, log_path=log) as srv:
            rows.append({"server": m, **warm_conversations(srv, cfg)})
    return rows


def warm_markdown(rows: Sequence[dict[str, Any]], cfg: WarmConfig) -> str:
    base = next((r for r in rows if r["server"] == DENSE), None)
    out = [f"| method | kept warm after the conversations of {cfg.tokens} tokens "
           "| re-sent and served warm | vs dense (kept) | kept MiB | cold turn p50 s "
           "| warm turn p50 s |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = r["kept"] / base["kept"] if base and base["kept"] else None
        kept = r["kept_bytes"] / 2**20 if r["kept_bytes"] is not None else None
        out.append(f"| {r['server']} | {r['kept']} | {r['verified']} | {_f(ratio)} | {_f(kept)} | "
                   f"{_f(r['cold_s_p50'])} | {_f(r['warm_s_p50'])} |")
    return "\n".join(out)


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    base = next((r for r in rows if r["server"] == REFERENCE), None)
    out = ["| server | turn | TTFT p50 s | TTFT p95 s | latency p50 s | latency p95 s "
           "| latency p50 vs mlx_lm.server |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        for index, t in r["by_turn"].items():
            ref = base and base["by_turn"].get(index, {}).get("latency_p50_s")
            ratio = t["latency_p50_s"] / ref if ref and t["latency_p50_s"] else None
            out.append(f"| {r['server']} | {index + 1} | {_f(t['ttft_p50_s'])} | "
                       f"{_f(t['ttft_p95_s'])} | {_f(t['latency_p50_s'])} | "
                       f"{_f(t['latency_p95_s'])} | {_f(ratio)} |")
    out += ["", "| server | ok / failed | tokens/s | vs mlx_lm.server | wall s |",
            "|---|---|---:|---:|---:|"]
    for r in rows:
        ratio = r["tokens_per_s"] / base["tokens_per_s"] if base and base["tokens_per_s"] \
            else None
        out.append(f"| {r['server']} | {r['ok']} / {r['failed']} | {r['tokens_per_s']:.2f} "
                   f"| {_f(ratio)} | {r['wall_s']:.0f} |")
    return "\n".join(out)


def plot(rows: Sequence[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        idx = sorted(r["by_turn"])
        ax.plot([i + 1 for i in idx], [r["by_turn"][i]["latency_p50_s"] for i in idx],
                marker="o", label=r["server"])
    ax.set_xticks(sorted({i + 1 for r in rows for i in r["by_turn"]}))
    ax.set_xlabel("turn")
    ax.set_ylabel("turn latency p50 (s)")
    ax.set_title("Chat turns: whole history resent each turn")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@dataclass
class OverflowConfig:
    conversations: int = 40
    turns: int = 4
    ram_entries: int = 8
    restart_at: int = 2  # the server restarts before this turn (0-based)
    document_words: int = 300
    user_words: int = 20
    max_tokens: int = 16
    timeout: float = 600.0
    extra: list[str] = field(default_factory=list)
    model: str | None = None  # an mlx_lm folder; None: the embedded model
    vocab: Sequence[str] = tuple(ENGLISH)


@dataclass
class OverflowMode:
    label: str
    entries: int  # --prompt-cache-size
    disk: bool
    restart: bool
    mlx_lm: bool = False  # mlx_lm.server itself (dense caches, no disk tier)


def overflow_modes(cfg: OverflowConfig) -> list[OverflowMode]:
    """Warm RAM reuse (the reference), the disk tier, neither, and mlx_lm.server with
    the same room in RAM."""
    # The reference evicts nothing: room for every entry of every turn (a request keeps
    # up to three: its system and user segments and its whole history).
    return [OverflowMode("warm RAM", 3 * cfg.conversations * cfg.turns + 2, False, False),
            OverflowMode("disk tier", cfg.ram_entries, True, True),
            OverflowMode("no disk", cfg.ram_entries, False, True),
            OverflowMode(REFERENCE, cfg.ram_entries, False, True, mlx_lm=True)]


def _opening(i: int, cfg: OverflowConfig) -> list[dict[str, str]]:
    document = words(cfg.document_words, cfg.vocab, seed=7 * i + 3)
    return [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": f"Conversation {i}. Read this: {document}"}]


def _ask(port: int, messages: list[dict[str, str]], cfg: OverflowConfig) -> dict[str, Any]:
    body = {"messages": messages, "max_tokens": cfg.max_tokens, "temperature": 0.0}
    t0 = time.perf_counter()
    try:
        status, reply = post_json(port, body, cfg.timeout)
    except (OSError, ValueError) as e:
        status, reply = 0, {"error": f"{type(e).__name__}: {e}"}
    row: dict[str, Any] = {"latency_s": time.perf_counter() - t0, "ok": status == 200}
    if status == 200:
        usage = reply.get("usage") or {}
        row.update(answer=reply["choices"][0]["message"]["content"],
                   prompt_tokens=int(usage.get("prompt_tokens", 0)),
                   cached_tokens=int((usage.get("prompt_tokens_details") or {})
                                     .get("cached_tokens", 0)))
    else:
        row.update(answer=None, prompt_tokens=0, cached_tokens=0,
                   error=f"HTTP {status}: {json.dumps(reply)[:200]}")
    return row


def _overflow_server(mode: OverflowMode, method: str, max_kv_memory: str, model: str,
                     extra: list[str], log: Path | None) -> ServerProcess:
    if not mode.mlx_lm:
        return ServerProcess(method, max_kv_memory, model=model, extra=extra, log_path=log)
    server = MlxLmServer(model, log_path=log)
    server.cmd += ["--prompt-cache-size", str(mode.entries)]
    return server


def run_overflow(mode: OverflowMode, cfg: OverflowConfig, method: str, max_kv_memory: str,
                 folder: Path, log_dir: Path | None = None) -> dict[str, Any]:
    """One mode's turns (round robin), restarting the server where the mode says."""
    model = cfg.model or model_folder()
    extra = ["--prompt-cache-size", str(mode.entries), *cfg.extra]
    if mode.disk:
        extra += ["--prompt-cache-dir", str(folder)]
    histories = [_opening(i, cfg) for i in range(cfg.conversations)]
    rows: list[dict[str, Any]] = []
    counters: list[dict[str, Any]] = []
    starts = sorted({0, cfg.restart_at} if mode.restart else {0})
    for n, first in enumerate(starts):
        last = starts[n + 1] if n + 1 < len(starts) else cfg.turns
        log = log_dir and log_dir / f"overflow-{mode.label.replace(' ', '_')}-{n}.log"
        with _overflow_server(mode, method, max_kv_memory, model, extra, log) as server:
            for t in range(first, last):
                for i, history in enumerate(histories):
                    if t > 0:
                        history.append({"role": "user", "content": words(
                            cfg.user_words, cfg.vocab, seed=1000 * i + t)})
                    row = _ask(server.port, history, cfg)
                    rows.append({"conversation": i, "turn": t, **row})
                    history.append({"role": "assistant", "content": row["answer"] or ""})
            counters.append(_kept_settled(server).get("counters", {}))
    return {"mode": mode.label, "turns": rows, "counters": counters}


def overflow_bench(cfg: OverflowConfig, method: str, max_kv_memory: str,
                   log_dir: Path | None = None,
                   modes: Sequence[OverflowMode] | None = None) -> list[dict[str, Any]]:
    """``run_overflow`` for each mode (warm RAM first: the reference), the disk tier's
    files in a fresh folder."""
    import tempfile

    runs = []
    for mode in modes or overflow_modes(cfg):
        with tempfile.TemporaryDirectory(prefix="chatbench-disk-") as folder:
            runs.append(run_overflow(mode, cfg, method, max_kv_memory, Path(folder), log_dir))
    return runs


def overflow_markdown(runs: Sequence[dict[str, Any]], cfg: OverflowConfig) -> str:
    ref = {(r["conversation"], r["turn"]): r for r in runs[0]["turns"]}
    warm = {t: percentile([r["latency_s"] for r in runs[0]["turns"]
                           if r["turn"] == t and r["ok"]], 0.5) for t in range(cfg.turns)}
    out = ["| run | turn | latency p50 s | latency p95 s | vs warm RAM (p50) | prompt "
           "tokens from a cache | answers equal to warm RAM's | failed |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for run in runs:
        for t in range(cfg.turns):
            rows = [r for r in run["turns"] if r["turn"] == t]
            ok = [r for r in rows if r["ok"]]
            lat = [r["latency_s"] for r in ok]
            p50 = percentile(lat, 0.5)
            share = sum(r["cached_tokens"] for r in ok) / max(sum(r["prompt_tokens"]
                                                                 for r in ok), 1)
            same = sum(r["answer"] == ref.get((r["conversation"], t), {}).get("answer")
                       for r in ok)
            ratio = p50 / warm[t] if p50 and warm[t] else None
            mark = " (restarted)" if t == cfg.restart_at and run["mode"] != "warm RAM" else ""
            out.append(f"| {run['mode']} | {t + 1}{mark} | {_f(p50)} | "
                       f"{_f(percentile(lat, 0.95))} | {_f(ratio)} | {share:.0%} | "
                       f"{same} / {len(rows)} | {len(rows) - len(ok)} |")
    return "\n".join(out)


def _main_overflow(args: argparse.Namespace, log_dir: Path | None) -> int:
    if not 1 <= args.overflow < args.conversations or not 0 < args.restart_at < args.turns:
        raise SystemExit(f"--overflow={args.overflow} --restart-at={args.restart_at}: "
                         "--overflow between 1 and --conversations - 1, --restart-at "
                         "between 1 and --turns - 1")
    cfg = OverflowConfig(args.conversations, args.turns, args.overflow, args.restart_at,
                         args.document_words, args.user_words, args.max_tokens,
                         extra=args.serve_arg)
    runs = overflow_bench(cfg, (args.method or ["kivi:bits=4"])[0], args.max_kv_memory,
                          log_dir)
    print(overflow_markdown(runs, cfg))
    for run in runs:
        print(f"{run['mode']}: server counters {run['counters']}")
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1, default=str))
    return 0 if all(r["ok"] for run in runs for r in run["turns"]) else 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m veloxquant_mlx.eval.chatbench",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--method", action="append", default=None,
                   help="method for veloxquant serve (repeatable; default kivi:bits=4)")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-words", type=int, default=400)
    p.add_argument("--user-words", type=int, default=30)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-kv-memory", default="2GB")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="extra flag for veloxquant serve, e.g. --serve-arg=--prompt-cache-size=16")
    p.add_argument("--deadline", type=float, default=3600.0, help="seconds per server")
    p.add_argument("--warm", type=int, default=None, metavar="N",
                   help="instead: N conversations of --warm-tokens each, sent one after "
                   "the other, then again; how many each method keeps warm")
    p.add_argument("--warm-tokens", type=int, default=4096)
    p.add_argument("--overflow", type=int, default=None, metavar="R",
                   help="instead: conversations overflowing R kept caches in RAM and a "
                   "restart; the disk tier against re-prefill and warm RAM reuse")
    p.add_argument("--restart-at", type=int, default=2, help="--overflow: the turn "
                   "(0-based) before which the server restarts")
    p.add_argument("--document-words", type=int, default=300,
                   help="--overflow: words of each conversation's opening document")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--log-dir", default=None)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for name in ("conversations", "turns", "max_tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}={getattr(args, name)}: an "
                             "integer >= 1")
    cfg = ChatConfig(args.conversations, args.turns, args.system_words, args.user_words,
                     args.max_tokens, deadline=args.deadline, extra=args.serve_arg)
    log_dir = Path(args.log_dir) if args.log_dir else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    if args.warm is not None:
        return _main_warm(args, log_dir)
    if args.overflow is not None:
        return _main_overflow(args, log_dir)
    rows = bench(args.method or ["kivi:bits=4"], cfg, args.max_kv_memory, log_dir)
    print(markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    if args.plot:
        plot(rows, args.plot)
    return 0 if all(r["failed"] == 0 for r in rows) else 1


def _main_warm(args: argparse.Namespace, log_dir: Path | None) -> int:
    if args.warm < 1 or args.warm_tokens < 64:
        raise SystemExit(f"--warm={args.warm} --warm-tokens={args.warm_tokens}: --warm "
                         "an integer >= 1, --warm-tokens >= 64")
    cfg = WarmConfig(args.warm, args.warm_tokens)
    rows = warm_bench(args.method or [DENSE, "kivi:bits=4"], cfg, args.max_kv_memory,
                      args.serve_arg, log_dir)
    print(warm_markdown(rows, cfg))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
