# One place that knows how to set air up on a fresh machine.
# `make demo` and `make test` are the README's first two commands.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is for the ranks, not the launcher.
TORCH_SPEC ?= torch==2.13.0
# On a machine without an NVIDIA GPU, torch comes from PyTorch's CPU wheel index (~200 MB instead of a
# CUDA build of several GB), when that index answers within a few seconds; otherwise (a GPU, no network
# to it, or TORCH_INDEX_URL=) from pip's configured index, as a plain `pip install` would.
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu
STAMP := $(VENV)/.stamp-setup
# The lean install: `pip install -e .` with no extras (mlflow-skinny, no UI server), plus pytest.
VENV_LEAN ?= .venv-lean
LEAN_STAMP := $(VENV_LEAN)/.stamp-lean

.PHONY: setup demo test test-lean test-gpu lint docs docs-serve bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then \
	  echo "setup: NVIDIA GPU found: $(TORCH_SPEC) from pip's configured index"; \
	elif [ -n "$(TORCH_INDEX_URL)" ] && $(PY) -c 'import sys, urllib.request; urllib.request.urlopen(urllib.request.Request(sys.argv[1].rstrip("/") + "/", method="HEAD"), timeout=5)' "$(TORCH_INDEX_URL)" 2>/dev/null; then \
	  echo "setup: no NVIDIA GPU: $(TORCH_SPEC) CPU build from $(TORCH_INDEX_URL)"; \
	  $(PY) -m pip install -q "$(TORCH_SPEC)" --index-url "$(TORCH_INDEX_URL)"; \
	else \
	  echo "setup: no NVIDIA GPU, but the CPU index ('$(TORCH_INDEX_URL)') is unset or did not answer: $(TORCH_SPEC) from pip's configured index"; \
	fi
	$(PY) -m pip install -q "$(TORCH_SPEC)" -e ".[dev,ray,examples,ui,server]"
	touch $(STAMP)

# air's own modules compiled once: with PYTHONDONTWRITEBYTECODE set (as in this project's sessions and CI)
# every supervisor, CLI and rank would compile them again (~0.1 s of CPU each, a few CPU-minutes a suite).
setup: $(STAMP)
	@$(PY) -m compileall -q src > /dev/null
	@[ -x /usr/bin/bwrap ] || echo "setup: note: bubblewrap (/usr/bin/bwrap) is not installed: \`air server\` needs it to wall users' runs in. Install it: sudo apt-get install bubblewrap (Fedora, RHEL: sudo dnf install bubblewrap)"

demo: setup
	AIR_HOME=$${AIR_HOME:-$(CURDIR)/.air-home} $(PY) examples/quickstart/ddp_cpu.py

# pytest-xdist workers for the main tier (CI runs this default). Most of the suite is CPU-bound process
# start-up, but tests also wait (on Slurm, a timeout, a hang): on the 2-core VM 3 workers kept ~1.7 cores
# busy (main tier 29:48), 4 kept ~1.9 (28:24; benchmarks/suite_cpu.py's timeline). In one process
# (TEST_WORKERS=0) it takes over an hour there.
TEST_WORKERS ?= 4
# Workers for the main tier's second phase, the tests marked `ray`: two xdist groups (the session's cluster,
# and the tests with clusters of their own; tests/conftest.py), so two.
RAY_TEST_WORKERS ?= 2
MAIN_PYTEST := $(PY) -m pytest -q --dist loadgroup --durations=15 --ignore=tests/lean

# Everything but GPU tests on the full install and, beside it, the lean install's own run
# (tests/lean need it): tools/test_tiers.sh runs both, reports both, fails if either did, and stops both
# (each tearing its fixtures down, no process left) on SIGTERM, SIGINT or SIGHUP. The main tier runs in two
# phases: the tests marked `ray` after all the others, on a machine they then have to themselves. Ray has
# fixed start-up waits (`ray start` gives up on a node not registered within 30 s; a raylet ended itself when
# its dashboard agent had not written its port within 15 s, until air.backends.ray_cli told it the port),
# which a 2-core machine busy with the rest of the suite overran in CI, however a test retried; run last,
# the Ray tests take about as long as beside the rest, since the suite is CPU-bound either way.
test: setup
	@sh tools/test_tiers.sh $(VENV_LEAN).log "$(MAKE) --no-print-directory test-lean" \
	  "$(MAIN_PYTEST) -n $(TEST_WORKERS) -m 'not gpu and not ray' tests" \
	  "$(MAIN_PYTEST) -n $(RAY_TEST_WORKERS) -m 'ray and not gpu' tests"

$(LEAN_STAMP): pyproject.toml Makefile
	rm -rf $(VENV_LEAN)
	$(PYTHON) -m venv $(VENV_LEAN)
	$(VENV_LEAN)/bin/python -m pip install -q -e . "pytest>=8" "pytest-timeout>=2.3"
	touch $(LEAN_STAMP)

# The tracking tests and tests/lean on `pip install -e .` alone: the embedded store works on
# mlflow-skinny, and `air ui` names the extra it lacks.
test-lean: $(LEAN_STAMP)
	$(VENV_LEAN)/bin/python -m pytest -q -m "not gpu" tests/tracking tests/tracking_runs/test_tracking_end_to_end.py tests/lean

# GPU tests run only on a GPU machine: `make test-gpu` there.
test-gpu: setup
	$(PY) -m pytest -q -m gpu tests

# ruff, then mypy over src/air (settings in pyproject.toml; the cache in .mypy_cache makes reruns fast).
lint: setup
	$(PY) -m ruff check src tests
	$(PY) -m mypy

# The reference site: the generated pages first (docs/gen_reference.py), then a strict build into .site/,
# where a broken link, a missing page or a bad anchor fails (no -q: mkdocs's -q hides them from --strict).
docs: setup
	$(PY) docs/gen_reference.py
	$(VENV)/bin/mkdocs build --strict

# The site served on this machine only (loopback), rebuilt on every edit: search works there (a browser
# does not run the search from file://). DOCS_ADDR=127.0.0.1:8001 for another port.
DOCS_ADDR ?= 127.0.0.1:8000
docs-serve: setup
	$(PY) docs/gen_reference.py
	$(VENV)/bin/mkdocs serve --strict -a $(DOCS_ADDR)

clean:
	rm -rf $(VENV) $(VENV_LEAN) $(VENV_LEAN).log .air-home .pytest_cache .mypy_cache .site
