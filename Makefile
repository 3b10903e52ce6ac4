# tokenmill: `make demo` and `make test` work on a fresh machine (they create .venv and install what they need).
SHELL := /bin/bash
VENV ?= .venv
PYTHON := $(VENV)/bin/python
HOST_PYTHON ?= python3
# Two installs: the demo needs the runtime only (the runner and the simulator: ~0.7 GB, ~2.5 min cold); make test
# adds the test tools (pytest, moto, kopf, datasets, ruff, mypy, ...: ~1.4 GB). Each is a stamp in the venv.
RUNTIME := $(VENV)/.installed-runtime
INSTALLED := $(VENV)/.installed
DEMO_OUT ?= out/demo

.PHONY: install install-runtime demo test unit integration chart e2e bench clean lint typecheck

$(PYTHON):
	$(HOST_PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip

install-runtime: $(RUNTIME)

$(RUNTIME): pyproject.toml | $(PYTHON)
	$(VENV)/bin/pip install --quiet -e '.[sim]'
	touch $@

install: $(INSTALLED)

$(INSTALLED): pyproject.toml | $(PYTHON)
	$(VENV)/bin/pip install --quiet -e '.[test]'
	touch $@ $(RUNTIME)

## demo: run examples/demo.yaml against the built-in SGLang simulator, from scratch, and print the summary; it
##       installs the runtime dependencies only
demo: install-runtime
	rm -rf $(DEMO_OUT)
	$(VENV)/bin/tokenmill run examples/demo.yaml --out $(DEMO_OUT)

## test: every test, the real-cluster ones included (builds the cluster tools once, cached in ~/.cache/tokenmill);
##       two workers: the real-cluster tests in one (they share its control plane), everything else in both
TEST_WORKERS ?= 2
test: install tools
	$(VENV)/bin/pytest -q -n $(TEST_WORKERS) --dist loadscope

## lint, typecheck: the static checks alone (make test runs both through tests/unit/test_static_checks.py)
lint: install
	$(VENV)/bin/ruff check .

typecheck: install
	$(VENV)/bin/mypy

unit: install
	$(VENV)/bin/pytest -q tests/unit

integration: install
	$(VENV)/bin/pytest -q tests/integration

## chart: Helm chart, alert rules (promtool), dashboard and Argo CD health checks (needs helm and promtool)
chart: install tools
	$(VENV)/bin/pytest -q tests/chart

e2e: install tools
	$(VENV)/bin/pytest -q tests/e2e

bench: install
	$(PYTHON) hack/bench/bench_runner.py
	$(PYTHON) hack/bench/bench_memory.py
	$(PYTHON) hack/bench/bench_sim_capacity.py
	$(PYTHON) hack/bench/bench_planner.py
	$(PYTHON) hack/bench/bench_export.py

clean:
	rm -rf $(VENV) out .pytest_cache

-include hack/cluster.mk
