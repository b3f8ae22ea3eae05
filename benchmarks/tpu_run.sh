#!/bin/bash
# On a TPU machine with no registry: install the carried wheels (.whl-tpu,
# from `python benchmarks/tpu_run.py wheels`) and pyarrow and tensorstore from
# the machine's own index into /tmp/site (after the machine's jax on
# PYTHONPATH), then `tpu_run.py device` with the arguments given, writing
# under /tmp/tpu_run and packing the JSON and logs into $OUT/tpu_run.tar.gz.
set -u
# A child of an earlier call on a warm machine that hangs in the TPU runtime's
# teardown can still hold the chip (a later process then waits in
# CreateTpuSystemState until cut): stop it first.
if pkill -f "benchmarks/(tpu_run|exclude_bench|ml1m_quality|float32_functions|sampled_logits)\.py"; then
  echo "stopped a process of an earlier call that still held the chip"
  sleep 5
fi
SITE=/tmp/site
if [ ! -f "$SITE/.installed" ]; then
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps \
    --no-compile --no-cache-dir --upgrade --target "$SITE" .whl-tpu/*.whl || exit
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-deps --only-binary=:all: \
    --no-cache-dir --index-url file:///opt/pypi/simple --target "$SITE/big" pyarrow tensorstore \
    || exit
  touch "$SITE/.installed"
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$SITE:$SITE/big:$PWD"
export PYTHONUNBUFFERED=1
python3 benchmarks/tpu_run.py device --out /tmp/tpu_run --bundle "${OUT:-/tmp}/tpu_run.tar.gz" "$@"
