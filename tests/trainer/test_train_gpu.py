"""The trainer's jitted step with `loss.backend="pallas_triton"` on 8 simulated devices.

Off a GPU the Triton kernels run in Pallas' generic interpreter; 3 steps of
the smoke config on a data=2 x model=4 mesh (table rows split over "model"),
with BCE and with the softmax cross-entropy,
from one initial state on the same batches, dropout off, give the XLA path's
losses, metrics and parameters to float32 rounding (the helpers and
tolerances of test_train_pallas.py).
"""

import jax
import numpy as np
import pytest

from tests.trainer import test_train_pallas as pallas_tests
from trainer import loop
from trainer.config import mesh as config_mesh
from trainer import data as data_lib
from trainer import train as train_lib

MESH = (("data", "model"), (2, 4), ("data", "model"), "model")


def _train(config, data, batches, backend):
  """(initial params, metrics per step, final params) of the steps with `backend`."""
  mesh = config_mesh.make_mesh(config)
  graphdef, tx, schedule, state, shardings = train_lib.create_sharded_state(
      config, num_items=data.num_items, mesh=mesh,
      vocab_shards=config_mesh.vocab_shard_count(config))
  config.loss.backend = backend
  settings = train_lib.step_settings(config, mesh=mesh, num_items=data.num_items)
  step = train_lib.jit_train_step(graphdef, tx, schedule, settings, shardings)
  initial = jax.device_get(state["params"])
  sharding = train_lib.batch_sharding(mesh, config.mesh.token_axes)
  jaxpr = str(jax.make_jaxpr(step)(state, data_lib.to_global_arrays(batches[0], sharding)))
  assert ("cutbce_gpu" in jaxpr) == (backend == "pallas_triton"), backend
  metrics = []
  for batch in batches:
    state, step_metrics = step(state, data_lib.to_global_arrays(batch, sharding))
    metrics.append(jax.device_get(step_metrics))
  return initial, metrics, jax.device_get(state["params"])


@pytest.mark.parametrize("kind", ["bce", "softmax_ce"])
def test_pallas_triton_train_steps_match_xla(smoke_data_dir, tmp_path, kind):
  config = pallas_tests._config(smoke_data_dir, MESH)  # pylint: disable=protected-access
  config.loss.kind = kind
  data = loop.prepare_data(config, str(tmp_path))
  iterator = data_lib.train_iterator(
      data, seq_len=config.seq_len, num_targets=config.num_targets,
      batch_size=config.batch_size, seed=config.seed, num_threads=1,
      prefetch_buffer_size=1)
  batches = [next(iterator) for _ in range(pallas_tests.STEPS)]

  xla_initial, xla_metrics, xla_params = _train(config, data, batches, "xla")
  gpu_initial, gpu_metrics, gpu_params = _train(config, data, batches, "pallas_triton")

  jax.tree.map(np.testing.assert_array_equal, gpu_initial, xla_initial)
  for number, (got, want) in enumerate(zip(gpu_metrics, xla_metrics), start=1):
    assert bool(got["finite"]) and bool(want["finite"]), number
    for name in ("loss", "grad_norm"):
      np.testing.assert_allclose(got[name], want[name], rtol=pallas_tests.LOSS_RTOL,
                                 err_msg=f"step {number}: {name}")
    for name in ("learning_rate", "tokens", "tp", "fp", "fn", "tn"):
      np.testing.assert_array_equal(got[name], want[name], err_msg=f"step {number}: {name}")
  losses = [float(m["loss"]) for m in xla_metrics]
  assert losses[-1] < losses[0], losses

  failed = []

  def check(path, got, want):
    name = jax.tree_util.keystr(path)
    if name.endswith("['attention']['key']['bias']"):
      # Its exact gradient is 0 (a key bias adds the same q . b to every
      # score of a query: softmax-invariant), so what it gets is rounding
      # noise, which differs with the vocabulary's summation order, and Adam
      # turns noise of any size into steps of about the learning rate.
      # (pallas_tpu happens to sum in XLA's order: bit-identical there.)
      bound = 2 * pallas_tests.STEPS * max(float(m["learning_rate"]) for m in xla_metrics)
      ok = np.abs(got - want).max() <= bound
    else:
      ok = np.allclose(got, want, rtol=pallas_tests.PARAM_RTOL, atol=pallas_tests.PARAM_ATOL)
    if not ok:
      failed.append((name, float(np.abs(got - want).max())))

  jax.tree_util.tree_map_with_path(check, gpu_params, xla_params)
  assert not failed, failed
  moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a, np.float64) - b).max()),
                       xla_params, xla_initial)
  assert max(jax.tree.leaves(moved)) > 100 * pallas_tests.PARAM_ATOL, moved
