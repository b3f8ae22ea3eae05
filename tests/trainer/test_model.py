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


# --------------------------------------------------------------------------- #
# The blocks, positions and initializers (issue 39: the SASRec+ replica).      #
# --------------------------------------------------------------------------- #


def _layer_norm(x, p, eps):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + eps) * p["scale"] + p["bias"]


def _attention(q_in, kv_in, p, mask):
  """PyTorch / flax multi-head attention written out: [N, D] queries, keys and values."""
  project = lambda x, w: np.einsum("nd,dhk->nhk", x, w["kernel"]) + w["bias"]
  q, k, v = project(q_in, p["query"]), project(kv_in, p["key"]), project(kv_in, p["value"])
  scores = np.einsum("qhk,shk->hqs", q, k) / np.sqrt(q.shape[-1])
  scores = np.where(mask[None], scores, -np.inf)
  weights = np.exp(scores - scores.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  out = np.einsum("hqs,shk->qhk", weights, v)
  return np.einsum("qhk,hkd->qd", out, p["out"]["kernel"]) + p["out"]["bias"]


def _reference(model, params, ids, block, positions, scale=True):
  """The model's forward (no dropout) in float64 numpy, from the formulas of trainer/model.py."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  num_items, dim = model.num_items, model.dim
  eps = 1e-8 if block == "sasrec" else 1e-6
  outputs = []
  for row in np.asarray(ids):
    valid = (row >= 0) & (row < num_items)
    x = p["item_embedding"]["embedding"][np.where(valid, row, 0)] * (np.sqrt(dim) if scale else 1)
    x = x * valid[:, None]
    pos = (np.maximum(np.cumsum(valid) - 1, 0) if positions == "from_first"
           else np.arange(len(row)))
    x = x + p["position_embedding"]["embedding"][pos]
    n = len(row)
    mask = np.tril(np.ones((n, n), bool)) & (valid[None, :] | np.eye(n, dtype=bool))
    for b in p["blocks"].values():
      if block == "sasrec":
        q = _layer_norm(x, b["attention_norm"], eps)
        x = q + _attention(q, x, b["attention"], mask)
        y = _layer_norm(x, b["mlp_norm"], eps)
        hidden = np.maximum(y @ b["mlp"]["up"]["kernel"] + b["mlp"]["up"]["bias"], 0)
        x = y + hidden @ b["mlp"]["down"]["kernel"] + b["mlp"]["down"]["bias"]
      else:
        y = _layer_norm(x, b["attention_norm"], eps)
        x = x + _attention(y, y, b["attention"], mask)
        y = _layer_norm(x, b["mlp_norm"], eps)
        hidden = y @ b["mlp"]["up"]["kernel"] + b["mlp"]["up"]["bias"]
        hidden = np.asarray(jax.nn.gelu(hidden))
        x = x + hidden @ b["mlp"]["down"]["kernel"] + b["mlp"]["down"]["bias"]
    outputs.append(_layer_norm(x, p["final_norm"], eps))
  return np.stack(outputs)


def make_variant(block="pre_ln", positions="window", seq_len=6, **kwargs):
  return model_lib.SASRec(
      num_items=37, seq_len=seq_len, dim=16, num_layers=2, num_heads=2, mlp_dim=24,
      block=block, positions=positions, rngs=nnx.Rngs(3), **kwargs)


@pytest.mark.parametrize("block", model_lib.BLOCKS)
@pytest.mark.parametrize("positions", model_lib.POSITIONS)
@pytest.mark.parametrize("scale", [True, False])
def test_each_block_is_the_formula_written_out(block, positions, scale):
  # float64 numpy from the module docstring's formulas, on the model's own
  # (randomized) parameters: padding on the left, a padded id inside the
  # window and the last id of the catalog.
  model = make_variant(block, positions, scale_embeddings=scale)
  params = nnx.to_pure_dict(nnx.state(model))
  params = jax.tree.map(lambda a: a + 0.3 * jax.random.normal(jax.random.key(a.size), a.shape),
                        params)
  nnx.update(model, params)
  ids = jnp.array([[-1, -1, 3, 4, 5, 36], [1, 37, 3, 4, 5, 6]])
  with jax.default_matmul_precision("float32"):
    got = np.asarray(model(ids))
  want = _reference(model, params, ids, block, positions, scale)
  valid = np.asarray((ids >= 0) & (ids < 37))
  np.testing.assert_allclose(got[valid], want[valid], rtol=2e-4, atol=2e-4)


def test_positions_from_first_do_not_depend_on_the_padding():
  # "from_first" counts positions from the window's first item, so a history
  # gives the same hidden states however much padding precedes it; "window"
  # (slots) does not.
  for positions, same in (("from_first", True), ("window", False)):
    model = make_variant("sasrec", positions)
    padded = model(jnp.array([[-1, -1, -1, 3, 4, 5]]))[:, 3:]
    alone = model(jnp.array([[3, 4, 5]]))
    assert np.allclose(padded, alone, atol=1e-5) == same, positions


def test_the_initializers_are_the_named_codes():
  std = lambda a: float(np.std(np.asarray(a)))
  # SASRec+'s code: normal(0.02), and PyTorch's MultiheadAttention input projection.
  params = nnx.to_pure_dict(nnx.state(make_variant("sasrec", init="sasrec_plus", seq_len=512)))
  block = params["blocks"][0]
  for table in (params["item_embedding"]["embedding"], params["position_embedding"]["embedding"],
                block["mlp"]["up"]["kernel"], block["attention"]["out"]["kernel"]):
    assert abs(std(table) - 0.02) < 0.004
  query = np.asarray(block["attention"]["query"]["kernel"])
  assert abs(std(query) - (1 / (2 * 16)) ** 0.5) < 0.03
  assert np.abs(query).max() <= (3 / (2 * 16)) ** 0.5 + 1e-6
  assert not np.any(np.asarray(block["mlp"]["up"]["bias"]))
  # PyTorch's defaults (gSASRec's code): embeddings normal(1), linear layers
  # uniform in +-1/sqrt(fan_in), biases too.
  params = nnx.to_pure_dict(nnx.state(make_variant(init="pytorch", seq_len=512)))
  block = params["blocks"][0]
  assert abs(std(params["position_embedding"]["embedding"]) - 1.0) < 0.05
  for layer, fan_in in ((block["mlp"]["up"], 16), (block["mlp"]["down"], 24),
                        (block["attention"]["key"], 16)):
    for array in (layer["kernel"], layer["bias"]):
      assert np.abs(np.asarray(array)).max() <= fan_in ** -0.5 + 1e-6
    assert abs(std(layer["kernel"]) - (3 * fan_in) ** -0.5) < 0.04
  # flax's: the embeddings normal(D^-1/2).
  default = nnx.to_pure_dict(nnx.state(make_variant(seq_len=512)))
  assert abs(std(default["position_embedding"]["embedding"]) - 0.25) < 0.03


@pytest.mark.parametrize("init", model_lib.INITS)
def test_embedding_std_sets_the_tables_apart_from_the_linear_layers(init):
  std = lambda a: float(np.std(np.asarray(a)))
  kwargs = dict(init=init, seq_len=512, output_table="separate")
  scheme = nnx.to_pure_dict(nnx.state(make_variant(**kwargs)))
  params = nnx.to_pure_dict(nnx.state(make_variant(embedding_std=0.5, **kwargs)))
  for table in ("item_embedding", "position_embedding", "output_embedding"):
    assert abs(std(params[table]["embedding"]) - 0.5) < 0.05, table
  # The linear layers are the scheme's own, draw for draw.
  for scheme_block, block in zip(scheme["blocks"], params["blocks"]):
    jax.tree.map(np.testing.assert_array_equal, scheme_block, block)


def test_a_separate_output_table_scores_the_items():
  tied, separate = make_variant(), make_variant(output_table="separate")
  inputs = np.asarray(nnx.to_pure_dict(nnx.state(separate))["item_embedding"]["embedding"])
  output = np.asarray(nnx.to_pure_dict(nnx.state(separate))["output_embedding"]["embedding"])
  assert output.shape == inputs.shape and not np.allclose(output, inputs)
  np.testing.assert_array_equal(separate.item_table, output)
  np.testing.assert_array_equal(tied.item_table, tied.item_embedding.embedding[...])
  assert not hasattr(tied, "output_embedding")
  specs = model_lib.param_partition_specs(nnx.to_pure_dict(nnx.state(separate)), "model")
  assert specs["output_embedding"]["embedding"] == jax.sharding.PartitionSpec("model", None)


def test_bad_block_positions_init_or_table_raise():
  for kwargs, said in (({"block": "post_ln"}, "block"), ({"positions": "end"}, "positions"),
                       ({"init": "xavier"}, "init"), ({"output_table": "untied"}, "output_table"),
                       ({"embedding_std": 0.0}, "embedding_std")):
    with pytest.raises(ValueError, match=said):
      make_variant(**kwargs)
