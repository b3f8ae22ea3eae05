# Two entry points that work on a fresh machine (Python >= 3.11 on PATH):
#   make train   installs into .venv and runs the main job
#   make test    installs into .venv and runs the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: install test test-all train bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,bench]'
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest tests -q $(PYTEST_ARGS)

test-all: install
	$(PY) -m pytest tests -q --runslow $(PYTEST_ARGS)

train: install
	$(PY) benchmarks/loss_bench.py --vocab 16384 131072 --repeats 2 --out runs/loss_bench

bench: install
	$(PY) benchmarks/loss_bench.py

clean:
	rm -rf $(VENV) runs .pytest_cache
