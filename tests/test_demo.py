"""The demo's memory table (``make demo``): allocator bytes of the dense and a compressed cache."""

from __future__ import annotations

from veloxquant_mlx.apps.demo import memory_table
from veloxquant_mlx.config import KVCacheConfig
from veloxquant_mlx.testing.tiny import UNIT_SIZES, tiny_model


def test_the_memory_table_reads_what_the_allocator_holds() -> None:
    model = tiny_model("llama", head_dim=64)  # mlx_lm's 4-bit cache groups 64 values
    dense, packed = KVCacheConfig(), KVCacheConfig.from_string("affine:bits=2,group_size=32,window=32")
    rows = memory_table(model, [dense, packed, "mlx_lm:q4"], context=256)
    assert [r["method"] for r in rows] == ["none", "affine:bits=2,group_size=32,window=32",
                                           "mlx_lm:q4"]
    # Dense: float32 K and V of every layer and KV head, 256 tokens (one growth step).
    d = UNIT_SIZES
    assert rows[0]["real_bytes"] == (d["num_hidden_layers"] * d["num_key_value_heads"] * 2
                                     * 64 * 4 * 256)
    assert 0 < rows[1]["real_bytes"] < 0.3 * rows[0]["real_bytes"]
    assert rows[1]["held_bytes"] > 0 and rows[1]["ratio"] < rows[0]["ratio"]
    # The peak over the weights holds at least what the caches keep (the prompt's working
    # set on top: tests/test_peak.py bounds it).
    for r in rows:
        assert r["peak_bytes"] >= r["real_bytes"] > 0
