import os
import sys

from veloxquant_mlx.integration.blas import preload_for_pytest

# Unit tests import the tiny in-process models from this folder.
sys.path.insert(0, os.path.dirname(__file__))


def pytest_configure(config):
    # Re-run pytest with an optimized BLAS preloaded (MLX's Linux CPU wheel bundles the
    # slow reference BLAS); a no-op on macOS and where none is installed.
    preload_for_pytest(config)
