"""The mlx_lm adapter: attention routing, the build-time probe, cache building and the prefill loop."""
