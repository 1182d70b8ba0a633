"""Speculative decoding (mlx_lm's ``draft_model``) through every registered method.

mlx_lm verifies the draft's tokens in one forward pass of the model and trims the
rejected ones from the model's cache (``trim_prompt_cache``). A method whose caches say
they are trimmable must generate the same tokens with a draft as without one, at the
settings under which it keeps everything (``LOSSLESS_OPTIONS``); any other is refused
before generation starts, and trimming it raises ``NotTrimmableError``. New methods and
methods that become trimmable are picked up from the registry.
"""

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from conftest import PROMPT, lossless_config
from mlx_lm.models.cache import make_prompt_cache

from veloxquant_mlx import KVCacheBuilder
from veloxquant_mlx.apps.prompt_cache import NotTrimmableError, trim_prompt_cache
from veloxquant_mlx.testing.tiny import tiny_model

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """A word-level tokenizer over the tiny models' 128 ids (``t0`` .. ``t127``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(128)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t127")


class Draft(nn.Module):
    """The model itself as a draft, with its logits negated on the calls where
    ``wrong(call)``: its greedy token is then the model's least likely one."""

    def __init__(self, model: nn.Module, wrong: Any) -> None:
        super().__init__()
        self.inner, self.wrong, self.calls = model, wrong, 0

    @property
    def layers(self) -> list[Any]:
        return self.inner.layers

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        self.calls += 1
        logits = self.inner(inputs, cache=cache)
        return -logits if self.wrong(self.calls) else logits


@pytest.fixture(scope="module")
def models() -> dict[str, Any]:
    model = tiny_model("llama")
    draft = tiny_model("llama", seed=0)  # the same weights, its own caches
    return {"model": model,
            "right": Draft(draft, lambda call: False),  # every draft token accepted
            "alternating": Draft(draft, lambda call: call % 2 == 0),  # some rejected
            "wrong": Draft(draft, lambda call: True)}  # every draft token rejected


def generate(model: Any, tokenizer: Any, caches: list[Any], draft: Any = None
             ) -> list[tuple[int, bool]]:
    """Greedy tokens (and whether the draft proposed them) from ``mlx_lm``."""
    kwargs: dict[str, Any] = dict(max_tokens=NEW_TOKENS, prompt_cache=caches)
    if draft is not None:
        kwargs.update(draft_model=draft, num_draft_tokens=3)
    return [(r.token, r.from_draft) for r in
            mlx_lm.stream_generate(model, tokenizer, mx.array(PROMPT), **kwargs)]


@pytest.mark.parametrize("draft", ["right", "alternating", "wrong"])
def test_draft_model_gives_the_same_tokens(method: str, draft: str, models: dict[str, Any],
                                           tokenizer: Any, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    model, config = models["model"], lossless_config(method)
    plain = [t for t, _ in generate(model, tokenizer, KVCacheBuilder.for_model(model, config))]
    caches = KVCacheBuilder.for_model(model, config)
    both = caches + make_prompt_cache(models[draft])
    if not all(c.is_trimmable() for c in caches):
        with pytest.raises(ValueError, match="trimmable"):
            generate(model, tokenizer, both, models[draft])
        with pytest.raises(NotTrimmableError, match="not trimmable"):
            trim_prompt_cache(caches, 1)
        return
    trims: list[int] = []
    for cls in {type(c) for c in caches}:
        original = cls.trim
        monkeypatch.setattr(cls, "trim", lambda self, n, f=original: trims.append(n) or
                            f(self, n))
    spec = generate(model, tokenizer, both, models[draft])
    assert [t for t, _ in spec] == plain
    accepted = sum(d for _, d in spec)
    rejected = sum(n > 0 for n in trims) // len(caches)  # verify passes with rejections
    if draft == "right":  # verify passes of several tokens, nothing rejected
        assert accepted >= NEW_TOKENS // 2 and rejected == 0
    elif draft == "alternating":  # some accepted, the rest trimmed
        assert 0 < accepted < NEW_TOKENS and rejected >= 2
    else:
        assert accepted == 0 and rejected >= NEW_TOKENS // 2
    KVCacheBuilder.detach(model)
