"""The chat benchmark's client side against a stand-in server on 127.0.0.1: every turn
resends the whole history with the previous answers, and the table reads per turn."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from veloxquant_mlx.eval import chatbench


class _Echo(BaseHTTPRequestHandler):
    seen: list = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append(body["messages"])
        self.answer(f"answer-{len(body['messages'])}")

    def answer(self, answer: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for piece in (answer[:3], answer[3:]):
            event = {"choices": [{"delta": {"content": piece}}]}
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
        usage = {"choices": [{"delta": {}, "finish_reason": "stop"}],
                 "usage": {"completion_tokens": 2}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())

    def log_message(self, *args) -> None:
        pass


def test_each_turn_resends_the_history_with_the_answers() -> None:
    _Echo.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        cfg = chatbench.ChatConfig(conversations=3, turns=3, system_words=5, user_words=4)
        turns, wall = chatbench.run_chats(server.server_address[1], cfg)
    finally:
        server.shutdown()
    assert len(turns) == 9 and all(t.ok and t.tokens == 2 for t in turns)
    # Turn t of a conversation sends the system prompt, t + 1 user messages and the t
    # answers the server gave before, in order.
    longest = max(_Echo.seen, key=len)
    assert [m["role"] for m in longest] == ["system", "user", "assistant", "user",
                                            "assistant", "user"]
    assert longest[2]["content"] == "answer-2" and longest[4]["content"] == "answer-4"
    assert len({m[0]["content"] for m in _Echo.seen}) == 1  # one shared system prompt
    row = chatbench.summarize("stand-in", turns, wall, None)
    assert sorted(row["by_turn"]) == [0, 1, 2] and row["failed"] == 0
    table = chatbench.markdown([{**row, "server": chatbench.REFERENCE}, row])
    assert table.count("| stand-in | 3 |") == 1 and "1.00" in table


class _Keeper(_Echo):
    """Keeps the last ``capacity`` prompts (LRU) and counts reused tokens as a server's
    ``/limits`` does; a prompt's tokens are its words."""

    capacity, lru, reused = 3, [], 0

    def do_GET(self) -> None:  # noqa: N802
        body = json.dumps({"prompt_cache": {"entries": len(self.lru),
                                            "counters": {"reused_tokens": self.reused}},
                           "kept_bytes": 10 * len(self.lru), "max_kv_memory": 100}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # noqa: N802
        n = int(self.headers["Content-Length"])
        prompt = json.loads(self.rfile.read(n))["messages"][0]["content"]
        cls = type(self)
        if prompt in cls.lru:
            cls.reused += len(prompt.split())
            cls.lru.remove(prompt)
        cls.lru = (cls.lru + [prompt])[-cls.capacity:]
        self.answer("ok")


def test_warm_conversations_are_the_ones_served_from_their_kept_cache() -> None:
    _Keeper.lru, _Keeper.reused = [], 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Keeper)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        got = chatbench.warm_conversations(type("S", (), {"port": port})(),
                                           chatbench.WarmConfig(conversations=5, tokens=80))
    finally:
        server.shutdown()
    # Five sent, three kept: only those three come back from their caches.
    assert (got["kept"], got["verified"]) == (3, 3)
    assert got["kept_bytes"] == 30 and got["cold_s_p50"] is not None
    table = chatbench.warm_markdown([{"server": "none", **got},
                                     {"server": "kivi", **{**got, "kept": 6}}],
                                    chatbench.WarmConfig(5, 80))
    assert "| kivi | 6 | 3 | 2.00 |" in table


def test_overflowed_and_restarted_conversations_come_back_from_disk(tmp_path) -> None:
    """Tiny model: three conversations, room for one kept cache, a restart before the
    third turn. Every answer of the disk-tier run equals the warm run's (a restored
    conversation's tokens are the never-evicted ones'), and its later turns are served
    from disk."""
    from test_server import WORDS, write_tiny_model

    write_tiny_model(tmp_path)
    cfg = chatbench.OverflowConfig(conversations=3, turns=3, ram_entries=1, restart_at=2,
                                   document_words=40, user_words=6, max_tokens=6,
                                   timeout=120, model=str(tmp_path), vocab=WORDS[6:],
                                   extra=["--prefill-step-size", "32"])
    warm, disk, *_ = chatbench.overflow_modes(cfg)
    runs = chatbench.overflow_bench(cfg, "kivi:bits=4", "64MB", modes=[warm, disk],
                                    log_dir=tmp_path)
    logs = "\n".join(p.read_text()[-2000:] for p in sorted(tmp_path.glob("overflow-*.log")))
    ref = {(r["conversation"], r["turn"]): r for r in runs[0]["turns"]}
    turns = runs[1]["turns"]
    assert len(turns) == 9 and all(r["ok"] for r in turns)
    for r in turns:
        assert r["answer"] == ref[(r["conversation"], r["turn"])]["answer"], r
        if r["turn"] > 0:  # the whole previous history came from a cache
            previous = ref[(r["conversation"], r["turn"] - 1)]
            assert r["cached_tokens"] >= previous["prompt_tokens"], (r, logs)
    before, after = runs[1]["counters"]
    # At least one read per restored turn (a prefetched entry that a late insert evicts
    # before its fetch is read again).
    assert before["from_disk"] >= 2 and after["from_disk"] >= 3, runs[1]["counters"]
    table = chatbench.overflow_markdown(runs, cfg)
    assert "| disk tier | 3 (restarted) |" in table and "3 / 3" in table
