"""config.loss.kind="softmax_ce": the trainer on `sharded_cut_softmax_ce`.

The op itself is tested against a float64 oracle in tests/cutbce/test_softmax.py
and on every mesh in tests/cutbce/sharding/test_softmax_mesh.py. Here: the
trainer's jitted step with the cut op equals the step with the dense-logits
reference (`loss.backend="dense"`) from one initial state on the same batches,
and a smoke run learns on a mesh that splits the table.
"""

import json

import jax
import numpy as np
import pytest

from configs import smoke
from trainer import loop
from trainer.config import mesh as config_mesh
from trainer import data as data_lib
from trainer import train as train_lib


def _loss_and_grads(config, data, batch, backend, target_reduction):
  """The step's loss, stats and parameter gradients with `backend` (dropout off)."""
  mesh = config_mesh.make_mesh(config)
  graphdef, _, _, state, _ = train_lib.create_sharded_state(
      config, num_items=data.num_items, mesh=mesh,
      vocab_shards=config_mesh.vocab_shard_count(config))
  config.loss.update(kind="softmax_ce", backend=backend, label_smoothing=0.1,
                     target_reduction=target_reduction)
  config_mesh.check_config(config)
  settings = train_lib.step_settings(config, mesh=mesh, num_items=data.num_items)
  sharding = train_lib.batch_sharding(mesh, config.mesh.token_axes)

  def loss(params, batch):
    return train_lib._loss_and_stats(  # pylint: disable=protected-access
        params, graphdef, batch, jax.random.key(0), settings)

  fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
  (value, stats), grads = fn(state["params"], data_lib.to_global_arrays(batch, sharding))
  return jax.device_get((value, stats, grads))


@pytest.mark.parametrize("target_reduction", ["sum", "mean"])
def test_cut_loss_and_gradients_equal_the_dense_reference_in_the_step(smoke_data_dir, tmp_path,
                                                                     target_reduction):
  config = smoke.get_config()
  config.data.prepared_dir = smoke_data_dir
  config.model.item_bias = True
  config.model.dropout_rate = 0.0
  config.mesh.axis_names, config.mesh.shape = ("data", "model"), (2, 4)
  config.mesh.token_axes, config.mesh.vocab_axis = ("data", "model"), "model"
  config_mesh.check_config(config)
  data = loop.prepare_data(config, str(tmp_path))
  iterator = data_lib.train_iterator(
      data, seq_len=config.seq_len, num_targets=config.num_targets,
      batch_size=config.batch_size, seed=config.seed, num_threads=1, prefetch_buffer_size=1)
  batch = next(iterator)
  cut, dense = (_loss_and_grads(config, data, batch, b, target_reduction)
                for b in ("xla", "dense"))
  np.testing.assert_allclose(cut[0], dense[0], rtol=1e-6)
  if target_reduction == "mean":  # The key reaches the op: averaging lowers the loss.
    summed = _loss_and_grads(config, data, batch, "dense", "sum")
    assert cut[0] < 0.95 * summed[0]
  np.testing.assert_allclose(np.array(cut[1]), np.array(dense[1]), rtol=1e-6)
  # Float32 sums in another order: 1e-5 of the largest gradient entry anywhere (some
  # gradients, e.g. of the attention's key bias, are 0 up to rounding in both).
  largest = max(float(np.abs(np.asarray(g)).max()) for g in jax.tree.leaves(dense[2]))
  leaves = zip(jax.tree.leaves_with_path(cut[2]), jax.tree.leaves(dense[2]))
  for (path, got), want in leaves:
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4,
                               atol=1e-5 * largest, err_msg=jax.tree_util.keystr(path))


def test_trainer_runs_it_on_a_mesh_that_splits_the_table(tmp_path, smoke_data_dir):
  from configs import smoke  # pylint: disable=import-outside-toplevel
  config = smoke.get_config()
  config.data.prepared_dir = smoke_data_dir
  config.loss.kind = "softmax_ce"
  config.model.item_bias = True
  config.mesh.axis_names, config.mesh.shape = ("data", "model"), (2, 4)
  config.mesh.token_axes, config.mesh.vocab_axis = ("data", "model"), "model"
  config.train_steps, config.checkpoint_every, config.eval_every = 12, 12, 1_000
  config.eval.max_batches, config.profile.num_steps, config.log_every = 1, 0, 1
  result = loop.train_and_evaluate(config, str(tmp_path))
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  records = [r for r in map(json.loads, lines) if r["kind"] == "train"]
  losses = [r["loss"] for r in records]
  assert np.isfinite(result["final_loss"]) and len(losses) == 12
  # A fresh model's softmax is near uniform over the 300 items: l_t ~ (#targets) log V,
  # with 1 to num_targets targets per position.
  assert 0.9 * np.log(300) < losses[0] < 1.1 * config.num_targets * np.log(300)
  assert min(losses[-3:]) < losses[0]
  assert all(r["tp"] + r["fp"] + r["fn"] + r["tn"] > 0 for r in records)


def test_window_exclude_lists_each_windows_items_for_every_position():
  v = 10
  inputs = np.array([[v, v, 3, 4], [5, 6, 7, 5]], np.int32)
  targets = np.array([[[-1, -1], [3, 4], [4, 2], [2, -1]],
                      [[6, 7], [7, 5], [5, 1], [1, 9]]], np.int32)
  got = np.asarray(train_lib.window_exclude(inputs, targets, v))
  assert got.shape == (2, 1, 6)  # one row a window, shared by its 4 positions
  np.testing.assert_array_equal(got[0, 0], [-1, -1, 3, 4, 2, -1])
  np.testing.assert_array_equal(got[1, 0], [5, 6, 7, 5, 1, 9])


@pytest.mark.parametrize("kind", ["softmax_ce", "bce"])
def test_window_exclusion_in_the_step_equals_the_dense_reference(smoke_data_dir, tmp_path,
                                                                 kind):
  """loss.exclude="window": the cut step on a 2x4 mesh (table split) equals the
  dense-logits reference with the same exclusion, and removing the window's
  items from the negatives changes the loss (it reaches the op)."""
  config = smoke.get_config()
  config.data.prepared_dir = smoke_data_dir
  config.model.dropout_rate = 0.0
  config.mesh.axis_names, config.mesh.shape = ("data", "model"), (2, 4)
  config.mesh.token_axes, config.mesh.vocab_axis = ("data", "model"), "model"
  data = loop.prepare_data(config, str(tmp_path))
  batch = next(data_lib.train_iterator(
      data, seq_len=config.seq_len, num_targets=config.num_targets,
      batch_size=config.batch_size, seed=config.seed, num_threads=1, prefetch_buffer_size=1,
      train_windows="last"))
  mesh = config_mesh.make_mesh(config)
  graphdef, _, _, state, _ = train_lib.create_sharded_state(
      config, num_items=data.num_items, mesh=mesh,
      vocab_shards=config_mesh.vocab_shard_count(config))
  sharding = train_lib.batch_sharding(mesh, config.mesh.token_axes)
  results = {}
  for backend, exclude in (("xla", "window"), ("dense", "window"), ("xla", "none")):
    config.loss.update(kind=kind, backend=backend, exclude=exclude)
    settings = train_lib.step_settings(config, mesh=mesh, num_items=data.num_items)
    assert settings.exclude == exclude

    def loss(params, batch, settings=settings):
      return train_lib._loss_and_stats(  # pylint: disable=protected-access
          params, graphdef, batch, jax.random.key(0), settings)

    fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
    (value, _), grads = fn(state["params"], data_lib.to_global_arrays(batch, sharding))
    results[backend, exclude] = jax.device_get((value, grads))
  cut, dense = results["xla", "window"], results["dense", "window"]
  np.testing.assert_allclose(cut[0], dense[0], rtol=1e-6)
  largest = max(float(np.abs(np.asarray(g)).max()) for g in jax.tree.leaves(dense[1]))
  for got, want in zip(jax.tree.leaves(cut[1]), jax.tree.leaves(dense[1])):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4,
                               atol=1e-5 * largest)
  # Fewer negatives, a smaller loss (a few window items among V = 300 at init).
  assert cut[0] < results["xla", "none"][0] - 1e-4
