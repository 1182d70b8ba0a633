"""Long-context retrieval tasks, generated in-process from a seed.

- ``passkey``: repeated filler sentences with "The pass key is NNNNN. Remember it."
  at a chosen depth; the question asks for the pass key (Mohtashami & Jaggi, 2023).
- ``needle``: natural text (the evaluation corpus) with one "special magic number"
  needle at a depth (needle-in-a-haystack, RULER's single-key form).
- ``needle_multi``: several needles with different keys; the question asks for one
  of them, the others are distractors (RULER's multi-key form).
- ``kv``: a JSON object of random UUID-like keys and values; the question asks for
  the value of one key (key-value retrieval, Liu et al., "Lost in the Middle").

The prompt goes through the tokenizer's chat template when it has one, is prefilled
in chunks like mlx_lm, and the answer is decoded greedily through the caches. A
sample is correct when its answer string appears in the output.

Every method answers the same samples (``samples`` per context, spread round-robin over
the depths, seeds ``seed .. seed + samples - 1``). Accuracy comes with a 95% Wilson
interval; against the dense ``none`` reference (added when missing) the row counts the
samples where the two disagree (method right / dense wrong and the reverse) and gives
the exact McNemar p-value of those discordant pairs: with p >= 0.05 the method and
dense cannot be told apart on these samples.
"""

from __future__ import annotations

import math
import random
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from veloxquant_mlx.adapter.builder import cache_stats
from veloxquant_mlx.adapter.prefill import prefill
from veloxquant_mlx.adapter.retained import measure_retained
from veloxquant_mlx.eval.perplexity import Method, Spec, check_model_context, resolve_methods
from veloxquant_mlx.eval.text import encode, load_text

TASKS = ("passkey", "needle", "needle_multi", "kv")

_FILLER = ("The grass is green. The sky is blue. The sun is yellow. "
           "Here we go. There and back again. ")
_WORDS = ("amber", "basil", "cedar", "delta", "ember", "fjord", "garnet", "harbor", "indigo",
          "juniper", "kettle", "lantern", "meadow", "nickel", "orchid", "pepper", "quartz",
          "raven", "saffron", "timber", "umber", "velvet", "willow", "yarrow", "zephyr")


@dataclass
class Sample:
    """One generated retrieval prompt and its expected answer."""

    task: str
    prompt: str  # the user message (before the chat template)
    answer: str
    context: int
    depth: float
    seed: int
    prompt_tokens: list[int]


def _uuid(rng: random.Random) -> str:
    h = "".join(rng.choice("0123456789abcdef") for _ in range(32))
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _key_name(rng: random.Random) -> str:
    return "-".join(rng.sample(_WORDS, 2))


PROMPT_FORMATS = ("auto", "chat", "plain")


def chat_tokens(tokenizer: Any, message: str, answer_prefix: str = "",
                prompt_format: str = "auto") -> list[int]:
    """Token ids of ``message`` as a user turn, then the assistant's ``answer_prefix``.

    Starting the assistant's turn with the answer's lead-in ("The pass key is") makes
    small chat models answer instead of chatting; the answer itself is generated.
    ``prompt_format``: ``"auto"`` uses the tokenizer's chat template when it has one,
    ``"plain"`` never (a base model, which continues text instead of following turns).
    """
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"prompt_format={prompt_format!r} is not allowed: one of "
                         f"{list(PROMPT_FORMATS)}")
    template = getattr(tokenizer, "chat_template", None)
    if prompt_format == "chat" and not template:
        raise ValueError("prompt_format='chat': this tokenizer has no chat template; "
                         "use 'plain'")
    if template and prompt_format != "plain":
        text = tokenizer.apply_chat_template([{"role": "user", "content": message}],
                                             add_generation_prompt=True, tokenize=False)
        return encode(tokenizer, text + answer_prefix)
    return encode(tokenizer, message + "\n" + answer_prefix)


def _filler_pieces(task: str, rng: random.Random, text: str | None) -> list[str]:
    if task == "passkey":
        return [_FILLER]
    if task == "kv":
        return []  # pairs are generated on demand
    # Sentences: fine-grained enough to fill the context to within a few tokens.
    sents = [x for x in re.split(r"(?<=[.!?])\s+", text or load_text()) if x.strip()]
    start = rng.randrange(len(sents))
    return [x + " " for x in sents[start:] + sents[:start]]


def make_sample(tokenizer: Any, task: str, context: int, depth: float = 0.5, seed: int = 0,
                n_needles: int = 4, text: str | None = None,
                prompt_format: str = "auto") -> Sample:
    """A ``task`` prompt of about ``context`` tokens (never more) with its answer.

    ``depth`` in [0, 1] places the queried needle (0: start, 1: end of the haystack).
    The same arguments always give the same prompt.
    """
    if task not in TASKS:
        raise ValueError(f"task={task!r} is not allowed: one of {list(TASKS)}")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth={depth} is not allowed: a number in [0, 1]")
    if n_needles < 1:
        raise ValueError(f"n_needles={n_needles} is not allowed: an integer >= 1")
    rng = random.Random(f"{task}:{seed}:{context}:{depth}")
    needles, question, prefix, answer = _needles(task, rng, n_needles)
    intro, piece_gen = _haystack(task, rng, text)

    def tokens(message: str) -> list[int]:
        return chat_tokens(tokenizer, message, prefix, prompt_format)

    def build(n: int) -> str:
        pieces = piece_gen(n)
        # Queried needle at the depth; distractors spread evenly over the haystack.
        slots = [round(depth * n)] + [round((i + 0.5) * n / len(needles))
                                      for i in range(len(needles) - 1)]
        for pos, needle in sorted(zip(slots, needles), key=lambda t: -t[0]):
            pieces.insert(pos, needle)
        body = "".join(pieces)
        if task == "kv":
            body = "{" + body.rstrip(", \n") + "}\n"
        return f"{intro}\n\n{body}\n{question}"

    base = len(tokens(build(0)))
    if base > context:
        raise ValueError(
            f"context={context} is too short for task {task!r}: the prompt without "
            f"filler already takes {base} tokens"
        )
    # Grow the haystack by doubling, then bisect the piece count that fits.
    lo, hi = 0, 1
    while len(tokens(build(hi))) <= context:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if len(tokens(build(mid))) <= context:
            lo = mid
        else:
            hi = mid
    prompt = build(lo)
    return Sample(task, prompt, answer, context, depth, seed, tokens(prompt))


def _needles(task: str, rng: random.Random,
             n_needles: int) -> tuple[list[str], str, str, str]:
    if task == "passkey":
        key = str(rng.randrange(10000, 100000))
        return ([f"The pass key is {key}. Remember it. {key} is the pass key. "],
                "What is the pass key?", "The pass key is", key)
    if task == "kv":
        keys = [_uuid(rng) for _ in range(n_needles)]
        vals = [_uuid(rng) for _ in range(n_needles)]
        return ([f'"{k}": "{v}", ' for k, v in zip(keys, vals)],
                f'What is the value associated with the key "{keys[0]}"? Answer with the '
                "value only.", f'The value associated with the key "{keys[0]}" is "', vals[0])
    count = 1 if task == "needle" else n_needles
    names: list[str] = []
    while len(names) < count:
        name = _key_name(rng)
        if name not in names:
            names.append(name)
    values = [str(rng.randrange(1_000_000, 10_000_000)) for _ in names]
    return ([f"The special magic number for {k} is: {v}. " for k, v in zip(names, values)],
            f"What is the special magic number for {names[0]} mentioned in the provided "
            "text?", f"The special magic number for {names[0]} is:", values[0])


def _haystack(task: str, rng: random.Random, text: str | None):
    if task == "passkey":
        intro = ("There is an important piece of information hidden inside a lot of "
                 "irrelevant text. Find it and memorize it.")
    elif task == "kv":
        intro = "Extract the value corresponding to the specified key in the JSON object below."
    else:
        intro = ("Some special magic numbers are hidden within the following text. Make sure "
                 "to memorize them. I will quiz you about the numbers afterwards.")
    pieces = _filler_pieces(task, rng, text)
    kv_seed = rng.random()

    def gen(n: int) -> list[str]:
        if task == "kv":
            r = random.Random(kv_seed)
            return [f'"{_uuid(r)}": "{_uuid(r)}", ' for _ in range(n)]
        return [pieces[i % len(pieces)] for i in range(n)]

    return intro, gen


def greedy_generate(model: nn.Module, prompt_tokens: Sequence[int], caches: list[Any],
                    max_tokens: int = 16, eos: Sequence[int] = (), chunk: int = 512) -> list[int]:
    """Greedy decoding through ``caches`` (prompt prefilled in chunks of ``chunk``)."""
    logits = prefill(model, caches, prompt_tokens, chunk)
    out: list[int] = []
    token = mx.argmax(logits[0]).item()
    while True:
        if token in eos:
            break
        out.append(token)
        if len(out) >= max_tokens:
            break
        logits = model(mx.array([[token]]), cache=caches)
        token = mx.argmax(logits[0, -1]).item()
    return out


def _eos_ids(tokenizer: Any) -> set[int]:
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids:
        return set(ids)
    one = getattr(tokenizer, "eos_token_id", None)
    return {one} if one is not None else set()


# ------------------------------------------------------------------ statistics
def wilson_interval(correct: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (sensible at 0/n and n/n too)."""
    if n < 1:
        return (float("nan"), float("nan"))
    z = statistics.NormalDist().inv_cdf(0.5 + level / 2.0)
    p = correct / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1.0 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value of ``b`` vs ``c`` discordant pairs."""
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0 ** n
    return min(1.0, 2.0 * tail)


# ------------------------------------------------------------------ evaluation
def make_samples(tokenizer: Any, task: str, context: int, depths: Sequence[float],
                 samples: int, seed: int = 0, n_needles: int = 4,
                 text: str | None = None, prompt_format: str = "auto") -> list[Sample]:
    """``samples`` prompts: depths round-robin, seeds ``seed, seed + 1, ...``."""
    if samples < 1:
        raise ValueError(f"samples={samples} is not allowed: an integer >= 1")
    if not depths:
        raise ValueError("depths is empty: give at least one depth in [0, 1]")
    return [make_sample(tokenizer, task, context, depths[i % len(depths)], seed + i,
                        n_needles, text, prompt_format) for i in range(samples)]


def _answers(model: nn.Module, tokenizer: Any, method: Method, items: list[Sample],
             max_tokens: int, chunk: int, bar: Any) -> tuple[list[dict[str, Any]], dict]:
    eos = _eos_ids(tokenizer)
    results, stats = [], {}
    for item in items:
        caches = method.build(model)
        output = tokenizer.decode(greedy_generate(model, item.prompt_tokens, caches,
                                                  max_tokens, eos, chunk))
        stats = cache_stats(caches)
        results.append({"depth": item.depth, "seed": item.seed, "answer": item.answer,
                        "output": output, "correct": item.answer in output})
        bar.update(1)
    return results, stats


def _retrieval_row(method: Method, task: str, context: int, results: list[dict[str, Any]],
                   ref: list[dict[str, Any]], stats: dict, mem: dict | None,
                   level: float) -> dict[str, Any]:
    n = len(results)
    correct = sum(r["correct"] for r in results)
    only_m = sum(r["correct"] and not d["correct"] for r, d in zip(results, ref))
    only_d = sum(d["correct"] and not r["correct"] for r, d in zip(results, ref))
    by_depth: dict[float, list[bool]] = {}
    for r in results:
        by_depth.setdefault(r["depth"], []).append(r["correct"])
    p = mcnemar_exact(only_m, only_d)
    row = {
        "method": method.label, "config": method.config_dict(), "task": task,
        "context": context, "n": n, "correct": correct, "accuracy": correct / n,
        "accuracy_ci": list(wilson_interval(correct, n, level)),
        "disagree_with_dense": only_m + only_d, "only_method_right": only_m,
        "only_dense_right": only_d, "mcnemar_p": p,
        "verdict": "reference" if results is ref else
        ("cannot be told apart" if p >= 1.0 - level else
         ("worse" if only_d > only_m else "better")),
        "by_depth": {str(d): sum(v) / len(v) for d, v in by_depth.items()},
        "declared_ratio": stats.get("ratio", float("nan")), "samples": results,
    }
    if mem:
        # Both figures from the same measurement (the first sample's prompt).
        row.update(real_bytes=mem["real_prefill_bytes"], held_bytes=mem["declared_prefill_bytes"],
                   fp16_bytes=mem["fp16_prefill_bytes"], mem_ratio=mem["real_over_fp16_prefill"],
                   declared_ratio=mem["declared_over_fp16_prefill"],
                   real_over_declared=mem["real_over_declared_prefill"], memory=mem)
    return row


def evaluate_retrieval(model: nn.Module, tokenizer: Any, specs: Sequence[Spec] | str,
                       task: str = "passkey", context: int = 2048,
                       depths: Sequence[float] = (0.1, 0.3, 0.5, 0.7, 0.9), samples: int = 20,
                       seed: int = 0, n_needles: int = 4, max_tokens: int = 16,
                       chunk: int = 512, text: str | None = None, progress: bool = False,
                       memory: bool = True, level: float = 0.95,
                       prompt_format: str = "auto") -> list[dict[str, Any]]:
    """Accuracy of each method on the same ``samples`` generated prompts (exact match).

    One row per method, the dense reference first; see the module doc for the
    interval and the paired comparison. ``memory``: also measure the real bytes each
    method keeps after the first sample's prompt and ``max_tokens`` decode steps.
    """
    from tqdm.auto import tqdm

    methods = resolve_methods(specs)
    check_model_context(model, context + max_tokens, "context + max_tokens")
    items = make_samples(tokenizer, task, context, list(depths), samples, seed, n_needles,
                         text, prompt_format)
    bar = tqdm(total=len(items) * len(methods), disable=not progress,
               desc=f"{task} {context}", leave=False)
    runs = {m.label: _answers(model, tokenizer, m, items, max_tokens, chunk, bar)
            for m in methods}
    bar.close()
    mems = {m.label: measure_retained(model, m.source, items[0].prompt_tokens, max_tokens,
                                      chunk) for m in methods} if memory else {}
    ref = runs[methods[0].label][0]
    return [_retrieval_row(m, task, context, runs[m.label][0], ref, runs[m.label][1],
                           mems.get(m.label), level) for m in methods]
