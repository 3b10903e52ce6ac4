# tokenmill: `make demo` and `make test` work on a fresh machine (they create .venv and install what they need).
SHELL := /bin/bash
VENV ?= .venv
PYTHON := $(VENV)/bin/python
HOST_PYTHON ?= python3
INSTALLED := $(VENV)/.installed
DEMO_OUT ?= out/demo

.PHONY: install demo test unit integration chart e2e bench clean lint typecheck

install: $(INSTALLED)

$(INSTALLED): pyproject.toml
	$(HOST_PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[test]'
	touch $@

## demo: run examples/demo.yaml against the built-in SGLang simulator, from scratch, and print the summary
demo: install
	rm -rf $(DEMO_OUT)
	$(VENV)/bin/tokenmill run examples/demo.yaml --out $(DEMO_OUT)

## test: every test, the real-cluster ones included (builds the cluster tools once, cached in ~/.cache/tokenmill)
test: install tools
	$(VENV)/bin/pytest -q

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
