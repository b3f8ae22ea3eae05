"""config.loss.kind="softmax_ce": the dense full softmax cross-entropy baseline.

`train.dense_softmax_ce` against a float64 NumPy oracle (loss, the gradients
in hidden, table and bias, and the confusion counts) on shapes with padding
ids, repeated ids, ids past `num_items`, zero weights and a padded table; then
one smoke run of the trainer with it on a mesh that splits the table.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from trainer import loop, train as train_lib


def oracle(hidden, table, targets, weights, bias, num_items):
  """Loss, (dh, dE, db) and (tp, fp, fn, tn) in float64, token by token."""
  h = np.asarray(hidden, np.float64).reshape(-1, hidden.shape[-1])
  e = np.asarray(table, np.float64)
  y = np.asarray(targets).reshape(h.shape[0], -1)
  w = np.asarray(weights, np.float64).reshape(-1)
  logits = h @ e.T + np.asarray(bias, np.float64)
  items = logits[:, :num_items]
  d_items = np.zeros_like(items)
  total, counts = 0.0, np.zeros(4)
  for t in range(h.shape[0]):
    kept = sorted({int(i) for i in y[t] if 0 <= i < num_items})
    z = items[t].max()
    p = np.exp(items[t] - z)
    log_z = z + np.log(p.sum())
    p /= p.sum()
    total += w[t] * sum(log_z - items[t, i] for i in kept)
    d_items[t] = w[t] * len(kept) * p
    d_items[t, kept] -= w[t]
    positive = np.zeros(num_items, bool)
    positive[kept] = True
    predicted = items[t] > 0
    counts += w[t] * np.array([np.sum(predicted & positive), np.sum(predicted & ~positive),
                               np.sum(~predicted & positive), np.sum(~predicted & ~positive)])
  weight_sum = w.sum()
  scale = 1.0 / weight_sum if weight_sum else 0.0
  d_logits = np.zeros_like(logits)
  d_logits[:, :num_items] = d_items * scale
  grads = (d_logits @ e).reshape(hidden.shape), d_logits.T @ h, d_logits.sum(0)
  return total * scale, grads, counts


def check(hidden, table, targets, weights, bias, num_items, rtol, grad_rtol=None):
  """Loss and counts within rtol; gradients (in the inputs' dtype) within grad_rtol."""
  grad_rtol = rtol if grad_rtol is None else grad_rtol
  def loss_fn(h, e, b):
    return train_lib.dense_softmax_ce(h, e, targets, weights, bias=b, num_items=num_items)

  (loss, stats), grads = jax.value_and_grad(loss_fn, argnums=(0, 1, 2), has_aux=True)(
      hidden, table, bias)
  want_loss, want_grads, want_counts = oracle(hidden, table, targets, weights, bias, num_items)
  np.testing.assert_allclose(float(loss), want_loss, rtol=rtol, atol=rtol)
  for got, want in zip(grads, want_grads):
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=grad_rtol,
                               atol=grad_rtol * np.abs(want).max())
  np.testing.assert_allclose(np.array(stats), want_counts, rtol=1e-6)


# The loss is f32 arithmetic either way (2e-5); bf16 gradients are rounded to bf16
# (8 bits of mantissa: 2^-8 relative).
@pytest.mark.parametrize("dtype,grad_rtol", [(jnp.float32, 2e-5), (jnp.bfloat16, 2**-8)])
def test_matches_the_float64_oracle_with_padding_repeats_and_zero_weights(dtype, grad_rtol):
  rng = np.random.default_rng(0)
  batch, seq, dim, vocab, num_items, labels = 3, 5, 7, 37, 33, 4
  hidden = jnp.asarray(rng.normal(size=(batch, seq, dim)), dtype)
  table = jnp.asarray(rng.normal(size=(vocab, dim)) * 0.5, dtype)
  bias = jnp.asarray(rng.normal(size=vocab), jnp.float32)
  targets = rng.integers(-1, vocab + 2, size=(batch, seq, labels)).astype(np.int32)
  targets[0, 0] = [4, 4, 4, -1]  # one id, three times
  targets[0, 1] = [-1, -1, -1, -1]  # no target: l_t = 0
  targets[0, 2] = [34, 35, 36, 5]  # padding rows of the table are not items
  weights = rng.uniform(0.5, 2.0, size=(batch, seq)).astype(np.float32)
  weights[1, :2] = 0.0
  # The oracle sees the inputs as the op does (bf16 values, f32 arithmetic).
  check(hidden, table, jnp.asarray(targets), jnp.asarray(weights), bias, num_items, 2e-5,
        grad_rtol)


@settings(max_examples=10, deadline=None)
@given(tokens=st.integers(1, 9), dim=st.integers(1, 6), vocab=st.integers(1, 20),
       labels=st.integers(1, 5), padding=st.integers(0, 3), seed=st.integers(0, 2**31 - 1))
def test_any_shape_matches_the_oracle(tokens, dim, vocab, labels, padding, seed):
  rng = np.random.default_rng(seed)
  num_items = vocab
  rows = vocab + padding
  hidden = jnp.asarray(rng.normal(size=(tokens, dim)), jnp.float32)
  table = jnp.asarray(rng.normal(size=(rows, dim)), jnp.float32)
  bias = jnp.asarray(rng.normal(size=rows), jnp.float32)
  targets = jnp.asarray(rng.integers(-1, rows + 1, size=(tokens, labels)), jnp.int32)
  weights = jnp.asarray(rng.choice([0.0, 0.5, 1.0, 3.0], size=tokens), jnp.float32)
  check(hidden, table, targets, weights, bias, num_items, 2e-5)


def test_without_a_target_or_weight_the_loss_and_gradients_are_zero():
  hidden, table = jnp.ones((2, 3)), jnp.ones((5, 3))
  targets = jnp.array([[1, 2], [-1, -1]], jnp.int32)
  for weights in (jnp.array([0.0, 1.0]), jnp.zeros(2)):
    loss, grads = jax.value_and_grad(
        lambda h, e, w=weights: train_lib.dense_softmax_ce(h, e, targets, w)[0],
        argnums=(0, 1))(hidden, table)
    assert float(loss) == 0.0
    assert all(not np.any(np.asarray(g)) for g in grads)


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
