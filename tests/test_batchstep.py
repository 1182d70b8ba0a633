"""The batch decode-step benchmark (``eval.batchstep``) on a tiny model."""

from __future__ import annotations

import pytest

from veloxquant_mlx.eval import batchstep
from veloxquant_mlx.testing.tiny import tiny_model


def test_row_lengths_spread_around_the_context() -> None:
    assert batchstep.row_lengths(3, 100, 20) == [90, 100, 110]
    assert batchstep.row_lengths(1, 50, 0) == [50]
    with pytest.raises(ValueError, match="spread=-1"):
        batchstep.row_lengths(2, 10, -1)


def test_every_batch_cache_is_timed_against_mlx_lms(monkeypatch: pytest.MonkeyPatch
                                                    ) -> None:
    model = tiny_model("llama", seed=1)
    seen: list[int] = []
    steps = batchstep._timed_steps

    def counted(model, token, caches, n):  # the batch really has one row per sequence
        seen.append(token.shape[0])
        return steps(model, token, caches, n)

    monkeypatch.setattr(batchstep, "_timed_steps", counted)
    # The command line's string, split as every other benchmark splits it.
    rows = batchstep.batch_steps(model, "kivi:bits=4,turboquant", rows=3, context=40,
                                 spread=10, rounds=1, steps=1)
    labels = [r["method"] for r in rows]
    assert labels[0] == batchstep.REFERENCE
    assert {"kivi:bits=4", "turboquant"} <= set(labels)
    assert labels[-1] == "no KV cache"
    assert set(seen) == {3}
    ref = next(r for r in rows if r["method"] == batchstep.REFERENCE)
    assert ref["vs_reference"] == 1.0
    assert all(r["step_ms"] > 0 for r in rows)
    table = batchstep.markdown(rows)
    assert "| kivi:bits=4 | 3 x 40 |" in table
