"""Checks on what reaches ``veloxquant serve`` before anything is queued.

- ``validate_body``: every field mlx_lm's handler reads from a completion request, of
  the right type and in range, so that nothing a client sends can fail inside the
  generation thread (an out-of-vocabulary ``logit_bias`` id made MLX's scatter write out
  of bounds; a ``stop`` that is not text raised in the thread, which then refused every
  later request). A bad field is a ``LimitError`` (400) that names it.
- ``HostPolicy``: the ``Host`` and ``Origin`` a local server answers (DNS rebinding and
  cross-site pages are refused 403) and the CORS headers it sends (none unless
  ``--allow-origin`` names the origin).
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from veloxquant_mlx.apps.server_limits import LimitError

Check = Callable[[str, Any], Any]
MAX_REQUEST_BYTES = 4 << 20  # --max-request-bytes
REQUEST_TIMEOUT_S = 60.0  # --request-timeout
MAX_CONNECTIONS = 64  # --max-connections
MAX_STOP_WORDS = 16
MAX_SALT_CHARS = 256
MAX_TOP_LOGPROBS = 10  # mlx_lm's handler refuses more than 11
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a bias value
ROLES = ("system", "developer", "user", "assistant", "tool")


def field_error(name: str, value: Any, expected: str) -> LimitError:
    """A 400 naming the field, the value received (shortened) and what is expected."""
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return LimitError(400, "invalid_field", f"{name}={shown} is not allowed: {expected}",
                      name=name)


def _number(lo: float | None = None, hi: float | None = None) -> Check:
    """A finite JSON number (not a boolean) in [lo, hi]; returned as float."""
    bounds = ", ".join(t for t in (f">= {lo:g}" if lo is not None else "",
                                   f"<= {hi:g}" if hi is not None else "") if t)
    expected = "a finite number" + (f" {bounds}" if bounds else "")

    def check(name: str, value: Any) -> float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok or not math.isfinite(value) or (lo is not None and value < lo) or (
                hi is not None and value > hi):
            raise field_error(name, value, expected)
        return float(value)
    return check


def _integer(lo: int, hi: int | None = None, also: Sequence[int] = ()) -> Check:
    """A JSON integer (not a boolean, not 2.0) in [lo, hi], or one of ``also``."""
    expected = f"an integer >= {lo}" + (f" and <= {hi}" if hi is not None else "") + (
        "".join(f" or {a}" for a in also))

    def check(name: str, value: Any) -> int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        if not ok or (value not in also and (value < lo or (hi is not None and value > hi))):
            raise field_error(name, value, expected)
        return value
    return check


def _typed(kind: type, expected: str) -> Check:
    """A value of exactly ``kind`` (JSON's type), else an error saying ``expected``."""
    def check(name: str, value: Any) -> Any:
        if not isinstance(value, kind):
            raise field_error(name, value, expected)
        return value
    return check


_boolean, _text = _typed(bool, "true or false"), _typed(str, "a string")
_object, _list = _typed(dict, "an object"), _typed(list, "a list")


def _only(*allowed: Any) -> Check:
    def check(name: str, value: Any) -> Any:
        if value not in allowed:
            raise field_error(name, value, "not supported here: omit it" if allowed == (None,)
                              else "one of " + ", ".join(map(repr, allowed)))
        return value
    return check


def _stop(name: str, value: Any) -> list[str]:
    words = [value] if isinstance(value, str) else value
    if not isinstance(words, list) or not 1 <= len(words) <= MAX_STOP_WORDS or not all(
            isinstance(w, str) and w for w in words):
        raise field_error(name, value, "a non-empty string or a list of 1 to "
                          f"{MAX_STOP_WORDS} non-empty strings")
    return words


def _salt(name: str, value: Any) -> str:
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_SALT_CHARS:
        raise field_error(name, value, f"a string of 1 to {MAX_SALT_CHARS} characters")
    return value


def _stream_options(name: str, value: Any) -> dict[str, bool]:
    if not isinstance(value, dict) or not set(value) <= {"include_usage"}:
        raise field_error(name, value, 'an object {"include_usage": true|false}')
    return {"include_usage": _boolean(f"{name}.include_usage",
                                      value.get("include_usage", False))}



# Fields mlx_lm's handler reads (and ``n``, ``cache_salt``): how each is checked. Null
# means "not given" for every one of them, as in mlx_lm.
FIELDS: dict[str, Check] = {
    "stream": _boolean, "stream_options": _stream_options, "model": _text,
    "draft_model": _only(None, "default_model"), "num_draft_tokens": _integer(0, 64),
    "max_tokens": _integer(1), "max_completion_tokens": _integer(1),
    "temperature": _number(0, 100), "top_p": _number(0, 1), "min_p": _number(0, 1),
    "repetition_penalty": _number(0, 100), "repetition_context_size": _integer(0, 1 << 20),
    "presence_penalty": _number(-100, 100), "presence_context_size": _integer(0, 1 << 20),
    "frequency_penalty": _number(-100, 100), "frequency_context_size": _integer(0, 1 << 20),
    "xtc_probability": _number(0, 1), "xtc_threshold": _number(0, 0.5),
    "logprobs": _boolean, "top_logprobs": _integer(0, MAX_TOP_LOGPROBS, also=(-1,)),
    "seed": _integer(0, (1 << 63) - 1), "n": _only(1), "stop": _stop,
    "cache_salt": _salt, "chat_template_kwargs": _object, "role_mapping": _object,
    "tools": _list, "adapters": _text,
}
# mlx_lm takes these as floats only (an integer 0 is refused by its own check).
FLOAT_FIELDS = ("xtc_probability", "xtc_threshold")


def validate_body(body: Any, kind: str, vocab_size: int) -> dict[str, Any]:
    """The request ``body`` checked field by field; a normalized copy, else ``LimitError``.

    ``kind``: ``"chat"`` (``messages``) or ``"text"`` (``prompt``). ``vocab_size``: the
    width of the model's logits (``logit_bias`` and ``top_k`` index into it).
    """
    if not isinstance(body, dict):
        raise LimitError(400, "invalid_body", "the request body must be a JSON object",
                         name="body")
    # Null is "not given" (mlx_lm would read a null max_tokens as its value and refuse).
    out = {k: v for k, v in body.items()
           if not (v is None and (k in FIELDS or k in ("top_k", "logit_bias")))}
    for name, check in FIELDS.items():
        if name in out:
            out[name] = check(name, out[name])
    for name in FLOAT_FIELDS:
        if name in out:
            out[name] = float(out[name])
    if "top_k" in out:
        out["top_k"] = _integer(0, vocab_size - 1)("top_k", out["top_k"])
    if "logit_bias" in out:
        out["logit_bias"] = _logit_bias(out["logit_bias"], vocab_size)
    if kind == "chat":
        out["messages"] = _messages(out.get("messages"))
    else:
        out["prompt"] = _prompt(out.get("prompt"))
    return out


def _logit_bias(value: Any, vocab_size: int) -> dict[str, float]:
    """Token ids (JSON object keys) inside the vocabulary, finite bounded values."""
    if not isinstance(value, dict) or len(value) > vocab_size:
        raise field_error("logit_bias", value, "an object of token id -> bias")
    out = {}
    for key, bias in value.items():
        token = key.strip() if isinstance(key, str) else ""
        digits = token.isascii() and token.isdigit() and len(token) <= 12
        if not (digits and int(token) < vocab_size):
            raise LimitError(400, "invalid_field", f"logit_bias key {str(key)[:40]!r} is not "
                             "allowed: a token id, an integer from 0 to "
                             f"{vocab_size - 1} (the model's vocabulary)", name="logit_bias")
        out[str(int(token))] = _number(-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)(
            f"logit_bias[{token}]", bias)
    return out


def _prompt(value: Any) -> str:
    if not isinstance(value, str):
        raise field_error("prompt", value, "a string (the text to complete)")
    return value


def _messages(value: Any) -> list[dict[str, Any]]:
    """A non-empty list of ``{"role", "content"}`` with text content (no images)."""
    if not isinstance(value, list) or not value:
        raise field_error("messages", value, 'a non-empty list of {"role", "content"} objects')
    for i, message in enumerate(value):
        name = f"messages[{i}]"
        if not isinstance(message, dict):
            raise field_error(name, message, 'an object {"role", "content"}')
        if message.get("role") not in ROLES:
            raise field_error(f"{name}.role", message.get("role"), "one of " + ", ".join(ROLES))
        _content(f"{name}.content", message.get("content"), message)
    return value


def _content(name: str, content: Any, message: dict) -> None:
    """Text, a list of text parts, or null beside tool calls."""
    if isinstance(content, str) or (content is None and message.get("tool_calls")):
        return
    if not isinstance(content, list):
        raise field_error(name, content, "a string or a list of text parts")
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text"
                and isinstance(part.get("text"), str)):
            raise field_error(f"{name}[{j}]", part, 'a text part {"type": "text", "text": '
                              '"..."} (images are not supported)')


@dataclass(frozen=True)
class HostPolicy:
    """Which ``Host`` and ``Origin`` headers a server bound to ``host:port`` answers."""

    hosts: frozenset[str]
    origins: frozenset[str]

    @classmethod
    def local(cls, host: str, port: int, allow_origins: Iterable[str] = ()) -> HostPolicy:
        """Loopback names (and the bound ``host``) with the port; the named origins."""
        names = {"127.0.0.1", "localhost", "[::1]", _bracketed(host)}
        hosts = {f"{n}:{port}" for n in names} | (names if port == 80 else set())
        return cls(frozenset(h.lower() for h in hosts),
                   frozenset(normalize_origin(o) for o in allow_origins))

    def refusal(self, host: str | None, origin: str | None) -> tuple[str, str] | None:
        """``(header, why)`` for a request to refuse (403); ``None``: answered."""
        why = self.host_refusal(host)
        if why is not None:
            return "Host", why
        why = self.origin_refusal(origin)
        return None if why is None else ("Origin", why)

    def host_refusal(self, host: str | None) -> str | None:
        """Why a request with this ``Host`` header is refused (``None``: accepted)."""
        if host is None:
            return "the Host header is missing"
        if host.strip().lower() not in self.hosts:
            return (f"Host {host!r} is not this local server's name (one of "
                    f"{', '.join(sorted(self.hosts))}); refused against DNS rebinding")
        return None

    def origin_refusal(self, origin: str | None) -> str | None:
        """Why a request from this ``Origin`` is refused (``None``: accepted)."""
        if origin is None or self.cors_allowed(origin):
            return None
        parts = urlsplit(origin.strip())
        if parts.scheme == "http" and parts.netloc.lower() in self.hosts:
            return None  # a page served from this very address
        return (f"Origin {origin!r} is not allowed: web pages of other sites cannot use this "
                "server; start it with --allow-origin ORIGIN to let one in")

    def cors_allowed(self, origin: str | None) -> bool:
        return origin is not None and normalize_origin(origin) in self.origins


def normalize_origin(origin: str) -> str:
    """``"HTTP://App.Example:3000/"`` -> ``"http://app.example:3000"``."""
    return origin.strip().rstrip("/").lower()


def _bracketed(host: str) -> str:
    try:
        return f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    except ValueError:
        return host
