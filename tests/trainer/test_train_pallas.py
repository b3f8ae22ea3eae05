"""The trainer's jitted step with the Pallas kernels on 8 simulated devices (issue 16).

`backend="pallas_tpu"` inside the step's shard_map used to hang on all 8
simulated CPU devices (see docs/kernels.md, "Pallas kernels inside shard_map
on simulated CPU devices"). Off a TPU the kernels run in Pallas' generic
interpreter; here 3 steps of the smoke config from one initial state on the
same batches, dropout off, give the XLA path's losses, metrics and
parameters to float32 rounding.
"""

import jax
import numpy as np
import pytest

from configs import smoke
from trainer import loop
from trainer.config import mesh as config_mesh
from trainer import data as data_lib
from trainer import train as train_lib

STEPS = 3
# Float32 rounding: the two backends may sum the vocabulary in different
# orders. Measured on jax 0.10.2 CPU: both meshes bit-identical (losses,
# gradient norms, confusion counts and parameters), so these leave room for
# another XLA version's summation order, far below the 3 steps' updates
# (asserted > 100 * PARAM_ATOL).
LOSS_RTOL = 1e-5
PARAM_ATOL, PARAM_RTOL = 1e-5, 1e-5

# (mesh axis_names, shape, token_axes, vocab_axis): the smoke mesh (data=8,
# table replicated) and a 2 x 4 mesh with the table split by rows over
# "model" (which also splits the tokens).
MESHES = [
    (("data",), (8,), ("data",), None),
    (("data", "model"), (2, 4), ("data", "model"), "model"),
]


def _config(prepared_dir, mesh):
  config = smoke.get_config()
  config.data.prepared_dir = prepared_dir
  config.mesh.axis_names, config.mesh.shape, config.mesh.token_axes, config.mesh.vocab_axis = mesh
  config.model.dropout_rate = 0.0  # the same step with either backend
  config.optimizer.warmup_steps = 1  # full learning rate from the second step on
  config_mesh.check_config(config)
  return config


def _train(config, data, batches, backend):
  """The steps on `batches` from the config's initial state.

  Returns (initial params, metrics per step, final params), all on the host.
  """
  mesh = config_mesh.make_mesh(config)
  graphdef, tx, schedule, state, shardings = train_lib.create_sharded_state(
      config, num_items=data.num_items, mesh=mesh,
      vocab_shards=config_mesh.vocab_shard_count(config))
  settings = train_lib.StepSettings(
      mesh=mesh, token_axes=tuple(config.mesh.token_axes), vocab_axis=config.mesh.vocab_axis,
      num_items=data.num_items, seed=config.seed, backend=backend,
      vocab_reduction=config.loss.vocab_reduction)
  step = train_lib.jit_train_step(graphdef, tx, schedule, settings, shardings)
  initial = jax.device_get(state["params"])
  sharding = train_lib.batch_sharding(mesh, config.mesh.token_axes)
  jaxpr = str(jax.make_jaxpr(step)(state, data_lib.to_global_arrays(batches[0], sharding)))
  assert ("pallas_call" in jaxpr) == (backend == "pallas_tpu"), backend
  metrics = []
  for batch in batches:
    state, step_metrics = step(state, data_lib.to_global_arrays(batch, sharding))
    metrics.append(jax.device_get(step_metrics))
  return initial, metrics, jax.device_get(state["params"])


@pytest.mark.parametrize("mesh", MESHES, ids=["data8", "data2xmodel4"])
def test_pallas_train_steps_match_xla(smoke_data_dir, tmp_path, mesh):
  config = _config(smoke_data_dir, mesh)
  data = loop.prepare_data(config, str(tmp_path))
  iterator = data_lib.train_iterator(
      data, seq_len=config.seq_len, num_targets=config.num_targets,
      batch_size=config.batch_size, seed=config.seed, num_threads=1,
      prefetch_buffer_size=1)
  batches = [next(iterator) for _ in range(STEPS)]

  xla_initial, xla_metrics, xla_params = _train(config, data, batches, "xla")
  pallas_initial, pallas_metrics, pallas_params = _train(config, data, batches, "pallas_tpu")

  jax.tree.map(np.testing.assert_array_equal, pallas_initial, xla_initial)
  for number, (got, want) in enumerate(zip(pallas_metrics, xla_metrics), start=1):
    assert bool(got["finite"]) and bool(want["finite"]), number
    for name in ("loss", "grad_norm"):
      np.testing.assert_allclose(got[name], want[name], rtol=LOSS_RTOL,
                                 err_msg=f"step {number}: {name}")
    # Weights are 0 or 1: the counts are small integers, summed exactly.
    for name in ("learning_rate", "tokens", "tp", "fp", "fn", "tn"):
      np.testing.assert_array_equal(got[name], want[name], err_msg=f"step {number}: {name}")
  losses = [float(m["loss"]) for m in xla_metrics]
  assert losses[-1] < losses[0], losses  # the steps did something

  def check(path, got, want):
    np.testing.assert_allclose(got, want, rtol=PARAM_RTOL, atol=PARAM_ATOL,
                               err_msg=jax.tree_util.keystr(path))

  jax.tree_util.tree_map_with_path(check, pallas_params, xla_params)
  moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a, np.float64) - b).max()),
                       xla_params, xla_initial)
  assert max(jax.tree.leaves(moved)) > 100 * PARAM_ATOL, moved  # tolerance << the updates
