# Two entry points for a fresh machine: `make demo` and `make test`. Both bootstrap .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.stalwart-installed

.PHONY: demo test lint typecheck unit chaos gpu-check clean

$(STAMP): pyproject.toml constraints-dev.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints-dev.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/stalwart train --preset tiny --demo --save runs/demo/checkpoints --metrics-file runs/demo/metrics.jsonl

lint: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/python -m pytest -q -m "not gpu" --timeout=600 tests

test: lint typecheck unit

chaos: $(STAMP)
	$(BIN)/python bench/chaos.py --json runs/chaos.json

gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) runs .mypy_cache .ruff_cache .pytest_cache
