# One place that knows how to set air up on a fresh machine.
# `make demo` and `make test` are the README's first two commands.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is for the ranks, not the launcher; pin the CPU wheel so CI never pulls a CUDA build.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.stamp-setup

.PHONY: setup demo test test-gpu lint bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)" -e ".[dev,ray,examples]"
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	AIR_HOME=$${AIR_HOME:-$(CURDIR)/.air-home} $(PY) examples/quickstart/ddp_cpu.py

# GPU tests run only on a GPU machine: `make test-gpu` there.
test: setup
	$(PY) -m pytest -q --durations=15 -m "not gpu" tests

test-gpu: setup
	$(PY) -m pytest -q -m gpu tests

lint: setup
	$(PY) -m ruff check src tests

clean:
	rm -rf $(VENV) .air-home .pytest_cache
