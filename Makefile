# The two commands of the README: `make demo` runs the main job, `make test` runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first: the CPU build (a local file on the dev machines); an unpinned torch pulls CUDA.
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m hypic.cli demo

test: install
	$(PY) -m ruff check hypic tests scripts
	$(PY) -m pytest -q tests

.PHONY: install demo test
