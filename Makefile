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
