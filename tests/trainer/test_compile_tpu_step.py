"""The trainer's steps for configs/yambda50m_v6e8.py, compiled by XLA:TPU (no TPU attached).

What `tests/cutbce/sharding` checks of the op on simulated CPU devices, checked
here on the TPU compiler's program, after XLA:TPU's own passes: the loss's
Pallas kernels are in it, no collective sits inside a loop, hidden states are
all-gathered over the vocab axis and dh reduce-scattered back, and no array
has T x V elements (T tokens per chip, V rows per vocab shard). The
evaluation (ranks) step is compiled beside it. The default test uses a
smaller batch and catalog than the config's (one compile of each step,
about a minute on 2 cores); the `slow` one compiles the paper's shape on
v6e-8 and v5e-8 with "auto" and "dense".
"""

import re

import numpy as np
import pytest

from configs import yambda50m_v6e8
from cutbce.kernels import compiler
from cutbce.kernels import tpu as tpu_kernels
from cutbce.sharding import hlo
from trainer.commands import compile as compile_lib
from trainer.config import mesh as config_mesh

pytestmark = pytest.mark.skipif(compiler.libtpu_missing_reason() is not None,
                                reason="libtpu missing: pip install 'cutbce[tpu]'")


def _largest_array(text: str) -> int:
  sizes = [int(np.prod([int(d) for d in m.group(1).split(",")]))
           for m in re.finditer(r"\b(?:f32|bf16|s32|pred)\[([\d,]+)\]", text)]
  return max(sizes)


def _compiled_steps(topology: str, *, batch: int, vocab: int, backend: str):
  config = yambda50m_v6e8.get_config()
  config.batch_size = batch
  config.loss.backend = backend
  devices = compiler.topology_devices(topology)
  config_mesh.check_config(config, devices=devices)
  mesh = config_mesh.make_mesh(config, devices)
  programs = compile_lib.step_programs(config, num_items=vocab, mesh=mesh)
  compiled = {}
  with compiler.planning_for(devices):
    for name in ("train", "eval"):
      jitted, args = programs[name]
      compiled[name] = jitted.lower(*args).compile()
  return config, compiled


def _check_cut_step(config, compiled, *, vocab: int):
  train = compiled["train"].as_text()
  kernels = [k.split("_bt")[0] for k in compiler.mosaic_kernels(compiled["train"])]
  assert kernels == ["cutbce_backward"], kernels  # the one-pass kernel, once
  report = hlo.collective_report(train)
  assert not report.in_loop, report
  assert "all-gather" in report.ops and "reduce-scatter" in report.ops, report
  # Tokens per chip after the all-gather over "model": batch x N / data shards.
  tokens = config.batch_size * config.seq_len // config.mesh.shape[0]
  rows = -(-vocab // config.mesh.shape[1])
  largest = _largest_array(train)
  assert largest < tokens * rows // 4, (largest, tokens, rows)
  eval_kernels = [k.split("_bt")[0] for k in compiler.mosaic_kernels(compiled["eval"])]
  # The targets' and excluded ids' logits read from the rank tiles (exact ties), in
  # groups of MAX_RANK_TARGETS ids per kernel, then the one rank-count pass.
  ids = (config.compile.eval_targets or config.num_targets) + (
      config.compile.eval_exclude or config.seq_len)
  groups = -(-ids // tpu_kernels.MAX_RANK_TARGETS)
  assert sorted(eval_kernels) == ["cutbce_rank_logits"] * groups + ["cutbce_ranks"], eval_kernels
  assert not hlo.collective_report(compiled["eval"].as_text()).in_loop


def test_the_v6e8_train_and_eval_steps_compile_with_collectives_outside_the_loop():
  config, compiled = _compiled_steps("v6e-8", batch=16, vocab=131_071, backend="auto")
  _check_cut_step(config, compiled, vocab=131_071)


@pytest.mark.slow
@pytest.mark.parametrize("topology", ["v6e-8", "v5e-8"])
def test_the_papers_step_compiles_on_8_chips_auto_and_dense(topology):
  vocab = 876_939
  config, compiled = _compiled_steps(topology, batch=64, vocab=vocab, backend="auto")
  _check_cut_step(config, compiled, vocab=vocab)
  _, dense = _compiled_steps(topology, batch=64, vocab=vocab, backend="dense")
  assert not compiler.mosaic_kernels(dense["train"])  # dense logits under XLA
  assert not hlo.collective_report(dense["train"].as_text()).in_loop
  cut_peak = compiler.peak_bytes(compiled["train"].memory_analysis())
  dense_peak = compiler.peak_bytes(dense["train"].memory_analysis())
  assert cut_peak < dense_peak / 5, (cut_peak, dense_peak)
