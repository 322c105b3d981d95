# torch-dtorch developer entry points. `make demo` and `make test` install everything they need.
SHELL := /bin/bash
.DEFAULT_GOAL := test

# Tests, demos and apps never reach a model hub.
export HF_HUB_OFFLINE := 1

VENV  := .venv
PY    := $(VENV)/bin/python
PIP   := $(PY) -m pip
STAMP := $(VENV)/.stamp
# The torch build the venv is made with (a local CPU wheel on the project machines). pyproject.toml only
# states the supported range, so installing the project afterwards never replaces it.
TORCH_PIN := torch==2.13.0
# python3.11 if present, else python3.
PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)

.PHONY: venv demo test test-process lint fmt bench soak cov clean

venv: $(STAMP)

$(STAMP): pyproject.toml setup.cfg
	@test -x $(PY) || { echo "creating $(VENV) with $(PYTHON)"; $(PYTHON) -m venv $(VENV); }
	$(PIP) install '$(TORCH_PIN)'
	$(PIP) install -e '.[dev]'
	@# the native eager fast path and worker loop, built once now rather than by the first import (fall back if they cannot be)
	$(PY) -c "import logging; logging.basicConfig(level=logging.INFO); from torch_dtorch.device import native; from torch_dtorch.runtime import native_replay; native.load(); native_replay.extension()"
	@touch $@

demo: venv
	$(VENV)/bin/dtorch diffuse --model flux --mesh cp=2 --steps 4 --height 64 --width 64 --out demo.png

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

fmt: venv
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# pytest exits 5 when it collects no test: that is a failure here, never a silent pass.
# TEST_WORKERS pytest-xdist processes share the suite (2 = the CI machine's cores; 0 runs it in this process).
TEST_WORKERS ?= 2
test: venv lint
	@rc=0; $(PY) -m pytest -q -n $(TEST_WORKERS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests -- failing" >&2; exit 1; fi; \
	exit $$rc

# The whole eager suite with one worker process per device (cluster mode) instead of threads (~4 min on 2 cores).
test-process: venv
	DTORCH_TEST_MODE=process $(PY) -m pytest -q -n 2 tests/eager tests/cluster tests/training

cov: venv
	$(VENV)/bin/coverage run -m pytest -q
	$(VENV)/bin/coverage report

# fault and load table (docs/reliability.md): fuzz, soak memory slope, worker/controller kills, bad input, flood
soak: venv
	$(PY) bench/reliability.py

bench: venv
	@shopt -s nullglob; files=(bench/*.py); \
	if [ $${#files[@]} -eq 0 ]; then echo "make bench: no benchmarks in bench/ yet"; exit 0; fi; \
	for f in "$${files[@]}"; do echo "== $$f"; $(PY) "$$f" || exit $$?; done

clean:
	rm -rf build dist *.egg-info .mypy_cache .ruff_cache .pytest_cache .hypothesis .coverage
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -exec rm -rf {} +
