"""Evaluation against a brute-force NumPy ranking on a tiny model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import cutbce
from trainer import evaluate
from trainer.config import mesh as config_mesh
from tests.cutbce import np_reference
from trainer import train as train_lib


@pytest.mark.parametrize("filter_seen,vocab_axis", [(True, None), (False, None), (True, "model")])
def test_eval_matches_numpy_ranking(smoke_config, filter_seen, vocab_axis):
  config = smoke_config
  config.mesh.axis_names, config.mesh.shape = ("data", "model"), (2, 4)
  config.mesh.token_axes, config.mesh.vocab_axis = ("data",), vocab_axis
  mesh = config_mesh.make_mesh(config)
  num_items, batch, seq_len, num_targets, num_exclude = 29, 8, 16, 3, 5
  vocab_shards = config_mesh.vocab_shard_count(config)
  model = train_lib.make_model(config.model, num_items=num_items, seq_len=seq_len,
                               vocab_shards=vocab_shards, seed=3)
  graphdef, params = nnx.split(model)
  params = nnx.to_pure_dict(params)
  rng = np.random.default_rng(0)
  inputs = rng.integers(0, num_items, (batch, seq_len)).astype(np.int32)
  inputs[:, :4] = num_items  # left padding, as the pipeline does
  targets = rng.integers(-1, num_items, (batch, num_targets)).astype(np.int32)
  targets[:, 0] = rng.integers(0, num_items, batch)  # every row has a target
  exclude = rng.integers(-1, num_items, (batch, num_exclude)).astype(np.int32)
  weights = np.ones(batch, np.float32)
  weights[-1] = 0.0  # a padding row of the last eval batch
  settings = train_lib.StepSettings(
      mesh=mesh, token_axes=("data",), vocab_axis=vocab_axis, num_items=num_items, seed=0,
      backend="xla", vocab_reduction="sum")
  shardings = train_lib.state_shardings({"params": params}, mesh, vocab_axis)["params"]
  step = evaluate.jit_eval_step(graphdef, settings, shardings, filter_seen=filter_seen,
                                ks=(1, 5, 10))
  sharding = train_lib.batch_sharding(mesh, ("data",))
  batch_arrays = {k: jax.device_put(v, sharding) for k, v in dict(
      inputs=inputs, targets=targets, exclude=exclude, weights=weights).items()}
  got = evaluate.combine([step(jax.device_put(params, shardings), batch_arrays)])

  hidden = np.asarray(model(jnp.asarray(inputs))[:, -1], np.float64)
  table = np.asarray(model.item_table, np.float64)[:num_items]
  want_ranks = np_reference.ranks(hidden[:-1], table, targets[:-1],
                                  exclude=exclude[:-1] if filter_seen else None)
  want = jax.device_get(cutbce.rank_metrics(jnp.asarray(want_ranks), ks=(1, 5, 10)))
  assert got["num_users"] == batch - 1
  for name in ("recall@1", "ndcg@5", "hit@10", "recall@10", "mrr"):
    np.testing.assert_allclose(got[name], float(want[name]), rtol=1e-5, err_msg=name)


def test_numpy_ranks_by_hand():
  hidden = np.array([[1.0, 0.0]])
  table = np.array([[3.0, 0], [2.0, 0], [1.0, 0], [0.0, 0]])
  # Item 0 is excluded, so item 1 ranks first and item 2 second.
  np.testing.assert_array_equal(
      np_reference.ranks(hidden, table, np.array([[2, 1, -1]]), exclude=np.array([[0, -1]])),
      [[2, 1, 0]])


def test_format_table():
  table = evaluate.format_table({"test": {"recall@10": 0.5, "mrr": 0.25, "num_users": 3}})
  assert "recall@10" in table and "0.5000" in table and "test" in table


class _OnDevice:
  """A metric value that counts as on the device until the host reads it."""

  def __init__(self, value, ledger):
    self.value, self.ledger = value, ledger
    ledger["queued"] += 1
    ledger["most"] = max(ledger["most"], ledger["queued"])

  def __array__(self, dtype=None, copy=None):
    if not getattr(self, "read", False):
      self.read = True
      self.ledger["queued"] -= 1
    return np.asarray(self.value, dtype=dtype)


@pytest.mark.parametrize("num_batches,in_flight", [(625, 2), (79, 1), (3, 4)])
def test_evaluation_keeps_a_bounded_number_of_steps_in_flight(num_batches, in_flight):
  """Issue 41: 625 small batches were all queued before one was read; XLA's CPU
  rendezvous timed out and aborted the process. Never more than `in_flight` now."""
  ledger = {"queued": 0, "most": 0}
  rng = np.random.default_rng(num_batches)
  values = [(float(rng.random()), float(rng.integers(1, 9))) for _ in range(num_batches)]

  def step_fn(params, batch):
    del params
    ndcg, rows = values[batch["inputs"]]
    # One value of each step (its weight) counts the step as queued until read.
    return {"ndcg@10": ndcg, "num_rows": _OnDevice(rows, ledger)}

  batches = ({"inputs": i, "targets": 0, "exclude": 0, "weights": 0}
             for i in range(num_batches))
  got = evaluate.evaluate(step_fn, None, batches, lambda batch: batch, in_flight=in_flight)
  assert ledger["most"] == min(in_flight, num_batches)
  assert ledger["queued"] == 0
  want = sum(v * r for v, r in values) / sum(r for _, r in values)
  np.testing.assert_allclose(got["ndcg@10"], want, rtol=1e-12)
  assert got["num_users"] == sum(r for _, r in values)
