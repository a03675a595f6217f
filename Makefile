# Two commands do all set-up on a fresh clone:
#   make demo   - rewrite a built-in example and measure its memory
#   make test   - run the test suite (what CI runs)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The versions CI tests (torch==2.13.0, ...): pins for this install only,
# kept out of the published extras. `make install CONSTRAINTS=` drops them.
CONSTRAINTS ?= constraints-ci.txt
export TF_CPP_MIN_LOG_LEVEL ?= 3
# The demo needs graphckpt, Keras and one backend only: JAX, the smallest
# (README, "Install": about 0.7 GB, against 2.2 GB with TensorFlow).
# `make demo DEMO_BACKEND=tensorflow` (or torch) runs it on another one.
DEMO_BACKEND ?= jax

# Everything the tests need (the `test` and `bench` extras: TensorFlow, JAX,
# PyTorch, keras-hub, ...): what `make test`, and so CI, installs.
$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,bench]" $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
	touch $@

# What the demo needs, and nothing else.
$(VENV)/.installed-$(DEMO_BACKEND): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[$(DEMO_BACKEND)]" $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
	touch $@

.PHONY: install demo lint test test-slow test-keras-versions bench
install: $(VENV)/.installed

demo: $(VENV)/.installed-$(DEMO_BACKEND)
	KERAS_BACKEND=$(DEMO_BACKEND) $(VENV)/bin/graphckpt demo

# The linter runs first (`make lint`). The full suite runs on TensorFlow; the
# tests marked `backends` run again under JAX and PyTorch, and on TensorFlow
# with the oldest Keras of pyproject's range, each in its own pytest process
# (Keras fixes the backend at import). Every run goes on even if an earlier
# one failed.
OTHER_BACKENDS ?= jax torch
# The oldest Keras of pyproject's range (the venv has the newest), put first
# on the path (keras-hub 0.32 itself needs a newer Keras: its tests run on
# the newest only).
KERAS_OLDEST ?= 3.15.0
OLDEST_DIR := .keras-$(KERAS_OLDEST)
OLDEST_TESTS = PYTHONPATH=$(OLDEST_DIR) KERAS_BACKEND=tensorflow $(PY) -m pytest -q -m "backends and not slow" \
	--ignore tests/test_keras_hub.py

$(OLDEST_DIR)/.installed: $(VENV)/.installed
	$(PY) -m pip install -q --no-deps --target $(OLDEST_DIR) keras==$(KERAS_OLDEST)
	touch $@

test: install lint $(OLDEST_DIR)/.installed
	@status=0; \
	echo "== KERAS_BACKEND=tensorflow: full suite =="; \
	KERAS_BACKEND=tensorflow $(PY) -m pytest -q || status=1; \
	for b in $(OTHER_BACKENDS); do \
	  echo "== KERAS_BACKEND=$$b: tests marked 'backends' =="; \
	  KERAS_BACKEND=$$b $(PY) -m pytest -q -m "backends and not slow" || status=1; \
	done; \
	echo "== Keras $$(PYTHONPATH=$(OLDEST_DIR) $(PY) -c 'from importlib.metadata import version; print(version("keras"))'), tensorflow: tests marked 'backends' =="; \
	$(OLDEST_TESTS) || status=1; \
	exit $$status

# ruff, configured in pyproject.toml (pinned in constraints-ci.txt).
lint: install
	$(VENV)/bin/ruff check graphckpt tests benchmarks

test-slow: install
	$(PY) -m pytest -q -m slow

# Only the two Keras runs of `make test`: the oldest, then the newest.
test-keras-versions: $(OLDEST_DIR)/.installed
	$(OLDEST_TESTS)
	KERAS_BACKEND=tensorflow $(PY) -m pytest -q -m "backends and not slow"

bench: install
	$(PY) benchmarks/run_all.py
