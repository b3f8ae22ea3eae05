"""config.model.item_bias: a learned logit bias per item, through loss, ranking and export.

One smoke run with the bias on a 2 x 4 mesh whose "model" axis splits the
table and the bias by rows; then the bias is trained, exported, and the
ranks use it. The initial value (-log V) and the row sharding are checked on
a model whose 301 items are padded to 304 rows for 4 shards.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trainer import loop, model as model_lib, train as train_lib
from trainer.commands import export, workdir as workdir_lib


def test_bias_starts_at_minus_log_v_and_shards_like_the_table_rows():
  model = model_lib.SASRec(num_items=301, seq_len=4, dim=8, num_layers=1, num_heads=2,
                           mlp_dim=8, vocab_shards=4, item_bias=True, rngs=nnx.Rngs(0))
  np.testing.assert_array_equal(model.output_bias, np.full(304, -math.log(301), np.float32))
  specs = model_lib.param_partition_specs(nnx.state(model, nnx.Param), "model")
  assert specs["item_bias"]["bias"].get_value() == jax.sharding.PartitionSpec("model")
  assert model_lib.SASRec(num_items=3, seq_len=4, dim=8, num_layers=0, num_heads=1,
                          mlp_dim=8, rngs=nnx.Rngs(0)).output_bias is None


@pytest.fixture(scope="module")
def biased_run(tmp_path_factory, smoke_data_dir):
  from configs import smoke  # pylint: disable=import-outside-toplevel
  config = smoke.get_config()
  config.data.prepared_dir = smoke_data_dir
  config.model.item_bias = True
  config.mesh.axis_names, config.mesh.shape = ("data", "model"), (2, 4)
  config.mesh.token_axes, config.mesh.vocab_axis = ("data", "model"), "model"
  config.train_steps, config.checkpoint_every, config.eval_every = 10, 10, 1_000
  config.eval.max_batches, config.profile.num_steps = 1, 0
  workdir = str(tmp_path_factory.mktemp("biased"))
  return workdir, config, loop.train_and_evaluate(config, workdir)


def test_bias_is_trained_exported_and_ranks_with_it(biased_run, tmp_path):
  workdir, config, result = biased_run
  assert np.isfinite(result["final_loss"])
  run = workdir_lib.open_run(workdir, which="latest", say=lambda line: None)
  bias = np.asarray(run.params["item_bias"]["bias"])
  num_items = run.data.num_items
  assert bias.shape == (num_items,) and not np.allclose(bias, -math.log(num_items))
  out = tmp_path / "export"
  assert export.main(["export", f"--workdir={workdir}", f"--out={out}",
                      "--checkpoint=latest"]) == 0
  np.testing.assert_array_equal(export.load_export(out).item_bias, bias)
  # The ranking uses the bias: the same ranks as NumPy with it, not without it.
  model = nnx.merge(run.graphdef, run.params)
  inputs = jnp.asarray(np.tile(np.arange(config.seq_len, dtype=np.int32), (8, 1)))
  targets = np.arange(8, dtype=np.int32)[:, None]
  hidden = np.asarray(model(inputs)[:, -1], np.float64)  # [8, D]
  table = np.asarray(model.item_table, np.float64)[:num_items]
  logits = hidden @ table.T + bias  # [8, V]
  want = 1 + (logits > logits[np.arange(8), targets[:, 0]][:, None]).sum(-1)
  ranks = train_lib.cutbce_sharding.sharded_target_ranks(
      model(inputs)[:, -1], model.item_table, jnp.asarray(targets), bias=model.output_bias,
      mesh=run.settings.mesh, token_axes=run.settings.token_axes,
      vocab_axis=run.settings.vocab_axis, num_items=num_items)
  np.testing.assert_array_equal(np.asarray(ranks)[:, 0], want)
  unbiased = 1 + (logits - bias > (logits - bias)[np.arange(8), targets[:, 0]][:, None]).sum(-1)
  assert (unbiased != want).any()
