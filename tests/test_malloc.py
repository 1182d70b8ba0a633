"""glibc malloc thresholds: MLX's CPU transients reuse pages instead of faulting in new ones."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from veloxquant_mlx.apps import malloc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Six 12 MiB transients alive at once, then freed, at every step (as a decode step's
# decoded blocks are); page faults counted over 10 steps after a warm-up.
_PROBE = textwrap.dedent(
    """
    import resource, sys
    from veloxquant_mlx.apps.malloc import tune_malloc
    print(tune_malloc())
    import mlx.core as mx
    x = mx.ones((3 * 2**20,))
    mx.eval(x)
    def step():
        mx.eval([x * float(i) for i in range(6)])
    for _ in range(3):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        step()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)


def _faults(**env: str) -> tuple[bool, int]:
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("MALLOC_") and k != malloc.ENV_DISABLE}
    out = subprocess.run([sys.executable, "-c", _PROBE], env={**base, **env, "PYTHONPATH": ROOT},
                         capture_output=True, text=True, check=True).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not malloc.applies(), reason="glibc only")
def test_tuned_steps_fault_in_no_new_pages() -> None:
    tuned, with_tuning = _faults()
    off, without = _faults(**{malloc.ENV_DISABLE: "1"})
    assert tuned and not off
    # Untuned, the freed transients go back to the kernel at every step: 10 steps x 72 MiB
    # of fresh pages is about 184k faults (306,880 measured). Tuned: the pages are reused.
    assert without > 50_000, without
    assert with_tuning < without / 100, (with_tuning, without)


def test_child_env_carries_the_thresholds_where_they_apply(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    monkeypatch.delenv(malloc.ENV_DISABLE, raising=False)
    env = malloc.child_env({"A": "1"})
    assert env["A"] == "1"
    if malloc.applies():
        assert env["MALLOC_MMAP_THRESHOLD_"] == str(malloc.MMAP_BYTES)
        assert env["MALLOC_TRIM_THRESHOLD_"] == str(malloc.TRIM_BYTES)
    monkeypatch.setenv(malloc.ENV_DISABLE, "1")
    assert malloc.child_env({"A": "1"}) == {"A": "1"}
    assert malloc.tune_malloc() is False
