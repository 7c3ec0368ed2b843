# Two entry points for a fresh machine: `make demo` and `make test`. Both bootstrap one .venv:
# the demo with only what it uses (the core, tqdm, plotly: the `demo` extra), the tests with the
# `dev` extra (a superset: every feature extra and the tools). Each set has its stamp; installing
# dev marks the demo's set installed too, and a demo-only .venv gets the rest on `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
DEMO_STAMP := $(VENV)/.stalwart-demo
DEV_STAMP := $(VENV)/.stalwart-dev

.PHONY: demo docs test lint typecheck unit chaos gpu-check clean

# The demo's installer: uv when it is on PATH (it reads UV_* settings, not pip's config:
# INSTALLER=pip for pip), else pip without byte-compiling every file of torch, half of pip's time
# (the demo's imports compile what they use). No pip upgrade: the venv's own pip installs these.
INSTALLER ?= $(if $(shell command -v uv 2>/dev/null),uv,pip)
DEMO_INSTALL_pip = $(BIN)/pip install -q --no-compile
DEMO_INSTALL_uv = uv pip install -q --python $(BIN)/python

$(DEMO_STAMP): pyproject.toml constraints-dev.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(DEMO_INSTALL_$(INSTALLER)) -c constraints-dev.txt -e '.[demo]'
	touch $(DEMO_STAMP)

$(DEV_STAMP): pyproject.toml constraints-dev.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints-dev.txt -e '.[dev]'
	touch $(DEV_STAMP) $(DEMO_STAMP)

# One run directory holds everything: checkpoints, metrics.jsonl, events, memory, straggler, report.
# The report's charts are interactive (plotly); its PNG copies (matplotlib) are not installed here.
# One CPU thread: the demo's matrices are small, and on a busy 2-core VM two threads ran each
# iteration 8x slower (1509 against 180 ms, the same losses).
DEMO_THREADS ?= 1
demo: $(DEMO_STAMP)
	OMP_NUM_THREADS=$(DEMO_THREADS) $(BIN)/stalwart train --preset tiny --demo --save runs/demo --log-straggler --log-throughput \
		--timing-log-level 1
	$(BIN)/stalwart report --no-png runs/demo
	@echo "Open the report: xdg-open runs/demo/report.html   (macOS: open runs/demo/report.html)"

# API reference from the docstrings (pdoc, installed on demand) into build/docs/index.html.
docs: $(DEV_STAMP)
	$(BIN)/python -c "import pdoc" 2>/dev/null || $(BIN)/pip install -q -c constraints-dev.txt pdoc
	$(BIN)/pdoc --docformat google --no-show-source -o build/docs stalwart
	@echo "API docs: build/docs/index.html"

lint: $(DEV_STAMP)
	$(BIN)/ruff check src tests bench examples
	$(BIN)/ruff format --check src tests bench examples

typecheck: $(DEV_STAMP)
	$(BIN)/mypy

# Two workers on CI's two cores: much of the suite waits on its own subprocesses (torchrun
# rendezvous, hang timeouts, held commits), which the other worker fills. PYTEST_WORKERS=0 runs
# it in one process. worksteal: a worker that runs out of tests takes half of the other's queue,
# so the run does not end on one worker's backlog of slow tests.
PYTEST_WORKERS ?= 2
PYTEST_DIST ?= worksteal
unit: $(DEV_STAMP)
	$(BIN)/python -m pytest -q -m "not gpu" --timeout=600 -n $(PYTEST_WORKERS) \
		$(if $(filter-out 0,$(PYTEST_WORKERS)),--dist $(PYTEST_DIST)) --durations=25 tests

test: lint typecheck unit

chaos: $(DEV_STAMP)
	$(BIN)/python bench/chaos.py --json runs/chaos.json

gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) runs .mypy_cache .ruff_cache .pytest_cache
