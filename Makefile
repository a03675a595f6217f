# Two commands do all set-up on a fresh clone:
#   make demo   - rewrite a built-in example and measure its memory
#   make test   - run the test suite (what CI runs)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
export TF_CPP_MIN_LOG_LEVEL ?= 3

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,bench]"
	touch $@

.PHONY: install demo test test-slow bench
install: $(VENV)/.installed

demo: install
	$(VENV)/bin/graphckpt demo

test: install
	$(PY) -m pytest -q

test-slow: install
	$(PY) -m pytest -q -m slow

bench: install
	$(PY) benchmarks/run_all.py
