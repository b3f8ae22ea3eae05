"""SASRec: shapes, dtypes, causality, padding and dropout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from trainer import model as model_lib


def make(dtype=jnp.float32, dropout_rate=0.0, vocab_shards=1, num_items=37):
  return model_lib.SASRec(
      num_items=num_items, seq_len=6, dim=16, num_layers=2, num_heads=2, mlp_dim=32,
      dropout_rate=dropout_rate, vocab_shards=vocab_shards, dtype=dtype, rngs=nnx.Rngs(0))


INPUTS = jnp.array([[-1, -1, 3, 4, 5, 6], [1, 2, 3, 4, 5, 36]])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_shapes_and_dtype(dtype):
  model = make(dtype)
  hidden = model(INPUTS)
  assert hidden.shape == (2, 6, 16) and hidden.dtype == dtype
  assert model.item_table.shape == (37, 16) and model.item_table.dtype == dtype
  assert np.isfinite(np.asarray(hidden, np.float32)).all()


def test_causal_future_does_not_change_past():
  model = make()
  changed = INPUTS.at[:, 4:].set(jnp.array([[9, 10], [11, 12]]))
  np.testing.assert_allclose(model(INPUTS)[:, :4], model(changed)[:, :4], atol=1e-5)
  assert not np.allclose(model(INPUTS)[:, 4], model(changed)[:, 4])


def test_padding_keys_are_ignored():
  # Left padding: the valid positions see only valid keys, so replacing the
  # content of the padded prefix (still padding) changes nothing after it.
  model = make()
  a = model(jnp.array([[-1, -1, 3, 4, 5, 6]]))
  b = model(jnp.array([[37, -2, 3, 4, 5, 6]]))  # V and -2 are both padding
  np.testing.assert_allclose(a[:, 2:], b[:, 2:], atol=1e-6)


def test_dropout_is_keyed():
  model = make(dropout_rate=0.3)
  run = lambda seed: model(INPUTS, deterministic=False, rngs=nnx.Rngs(dropout=seed))
  np.testing.assert_array_equal(run(1), run(1))
  assert not np.allclose(run(1), run(2))
  np.testing.assert_array_equal(model(INPUTS), model(INPUTS))


def test_table_padded_for_vocab_shards_and_specs():
  model = make(vocab_shards=4, num_items=37)
  assert model.item_table.shape == (40, 16)
  specs = model_lib.param_partition_specs(nnx.to_pure_dict(nnx.state(model)), "model")
  assert specs["item_embedding"]["embedding"] == jax.sharding.PartitionSpec("model", None)
  assert specs["position_embedding"]["embedding"] == jax.sharding.PartitionSpec()


def test_bad_shape_raises():
  with pytest.raises(ValueError, match="num_heads"):
    model_lib.SASRec(num_items=5, seq_len=4, dim=10, num_layers=1, num_heads=3, mlp_dim=8,
                     rngs=nnx.Rngs(0))
