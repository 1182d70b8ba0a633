"""Test support shipped with the package: tiny random models of every mlx_lm architecture and the architecture table."""
