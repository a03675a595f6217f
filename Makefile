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

.PHONY: install demo lint test test-slow test-keras-versions test-keras-nightly test-torch-newest bench
install: $(VENV)/.installed

demo: $(VENV)/.installed-$(DEMO_BACKEND)
	KERAS_BACKEND=$(DEMO_BACKEND) $(VENV)/bin/graphckpt demo

# The linter runs first (`make lint`). The full suite runs on TensorFlow; the
# tests marked `backends` run again under JAX and PyTorch, and on TensorFlow
# with the oldest Keras of pyproject's range and with keras-nightly, each in
# its own pytest process (Keras fixes the backend at import), in two lanes
# at once (.ci/lanes.sh says which run goes in which lane). Every run
# goes on even if an earlier one failed.
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

# Keras's next release (keras-nightly, imported as `keras`), first on the
# path as the oldest is, with the TensorFlow of the venv (not keras-hub 0.32,
# which imports a name the nightly moved): what breaks there breaks for
# users at the next release. Pinned to one build so
# that CI fails on graphckpt's changes, not on a new nightly; move the pin
# forward to test a newer one (`--pre` finds the newest:
# `make test-keras-nightly KERAS_NIGHTLY=keras-nightly`).
KERAS_NIGHTLY ?= keras-nightly==3.16.0.dev2026102704
NIGHTLY_DIR := .keras-nightly
NIGHTLY_TESTS = PYTHONPATH=$(NIGHTLY_DIR) KERAS_BACKEND=tensorflow $(PY) -m pytest -q -m "backends and not slow" \
	--ignore tests/test_keras_hub.py

$(NIGHTLY_DIR)/.installed: $(VENV)/.installed Makefile
	rm -rf $(NIGHTLY_DIR)
	$(PY) -m pip install -q --pre --no-deps --target $(NIGHTLY_DIR) "$(KERAS_NIGHTLY)"
	touch $@

KERAS_VERSION = $(PY) -c 'from importlib.metadata import version; print(version("keras"))'

test: install lint $(OLDEST_DIR)/.installed $(NIGHTLY_DIR)/.installed
	.ci/lanes.sh $(PY) $(OLDEST_DIR) $(NIGHTLY_DIR) $(OTHER_BACKENDS)

# ruff, configured in pyproject.toml (pinned in constraints-ci.txt).
lint: install
	$(VENV)/bin/ruff check graphckpt tests benchmarks

test-slow: install
	$(PY) -m pytest -q -m slow

# Only the Keras runs of `make test`: the oldest, the newest, the nightly.
test-keras-versions: $(OLDEST_DIR)/.installed $(NIGHTLY_DIR)/.installed
	$(OLDEST_TESTS)
	KERAS_BACKEND=tensorflow $(PY) -m pytest -q -m "backends and not slow"
	$(NIGHTLY_TESTS)

test-keras-nightly: $(NIGHTLY_DIR)/.installed
	$(NIGHTLY_TESTS)

# The tests marked `backends` on PyTorch's newest release (CI pins 2.13.0,
# whose CPU build lies on this machine's disk). PyPI has only its CUDA build
# for Linux x86_64: with its NVIDIA libraries 5.3 GB and 2 minutes to
# install, so it is run by hand, not by `make test`. PIP_CONFIG_FILE=/dev/null
# skips a pip configuration that caps torch (this workplace's machines have one).
TORCH_NEWEST ?= torch==2.15.0
TORCH_DIR := .torch-newest

$(TORCH_DIR)/.installed: $(VENV)/.installed
	PIP_CONFIG_FILE=/dev/null $(PY) -m pip install -q --target $(TORCH_DIR) "$(TORCH_NEWEST)"
	touch $@

test-torch-newest: $(TORCH_DIR)/.installed
	PYTHONPATH=$(TORCH_DIR) KERAS_BACKEND=torch $(PY) -m pytest -q -m "backends and not slow"

bench: install
	$(PY) benchmarks/run_all.py
