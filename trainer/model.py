"""SASRec in Flax NNX: a causal transformer over item sequences.

The item embedding table `[V, D]` is both the input embedding and the output
table that `cutbce` scores hidden states against, so the model returns hidden
states `[B, N, D]`, never logits. Positions are learned. Every block is, with
`block="pre_ln"` (the default, a pre-LayerNorm transformer with GELU),

    x = x + Dropout(SelfAttention(LayerNorm(x)), causal, padding keys masked)
    x = x + Dropout(FeedForward(LayerNorm(x)))

or, with `block="sasrec"`, the block of the original SASRec code that
SASRec+ trains (Kang & McAuley's TensorFlow code as ported to PyTorch, read
to learn, not copied): only the queries are normalized, the keys and values
read the stream as it is, and each residual starts from the normalized
stream; the feed-forward is ReLU with dropout inside; LayerNorm eps 1e-8:

    q = LayerNorm(x);  x = q + SelfAttention(q, x, x)
    y = LayerNorm(x);  x = y + Dropout(Linear(ReLU(Dropout(Linear(y)))))

Both end with a final LayerNorm. Input ids outside [0, V) are padding (the
data pipeline pads on the left with V): their embedding is zero and no other
position attends to them. Position embeddings are indexed by the slot in the
window (`positions="window"`: the newest item is always slot N - 1) or from
the window's first item (`positions="from_first"`: 0, 1, ... as in
implementations that pad on the right).

Parameters are float32; `dtype` sets the compute dtype (float32 or bfloat16)
of activations and of the returned hidden states. Dropout takes its key from
the `rngs` argument of `__call__` (`nnx.Rngs(dropout=key)`), so the model
holds no random state and the train step derives the key from the step number:
a resumed run draws the same masks as an uninterrupted one.

Sharding: `param_partition_specs` puts the item tables' rows on the vocab axis
of the mesh and replicates everything else.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

# Names of the attributes holding the item tables (the input embedding, and the
# output table where it is separate); sharding and the loss find them by name.
ITEM_EMBEDDING = "item_embedding"
OUTPUT_EMBEDDING = "output_embedding"


def padded_vocab_size(num_items: int, vocab_shards: int) -> int:
  """Table rows: `num_items` rounded up to a multiple of the vocab axis size.

  A mesh can only split an array evenly, so the table gets up to
  `vocab_shards - 1` extra rows. They are never inputs or targets, and the
  loss and evaluation pass them as excluded ids, so they are neither
  negatives nor ranked.
  """
  return -(-num_items // vocab_shards) * vocab_shards


BLOCKS = ("pre_ln", "sasrec")
POSITIONS = ("window", "from_first")
TABLES = ("tied", "separate")


INITS = ("flax", "sasrec_plus", "pytorch")
SASREC_PLUS_STD = 0.02  # SASRec+ (and GPT-2): normal(0.02) for embeddings and linear layers


def _torch_linear(fan_in: int) -> dict:
  """PyTorch's `nn.Linear` defaults: kernel and bias uniform in +-1 / sqrt(fan_in)."""
  bound = fan_in ** -0.5
  uniform = lambda key, shape, dtype=jnp.float32: jax.random.uniform(
      key, shape, dtype, -bound, bound)
  return {"kernel_init": uniform, "bias_init": uniform}


def _initializers(init: str, fan_in: int) -> dict:
  """A linear layer's kernel and bias initializers under scheme `init` (SASRec's docstring)."""
  if init == "sasrec_plus":
    return {"kernel_init": nnx.initializers.normal(stddev=SASREC_PLUS_STD),
            "bias_init": nnx.initializers.zeros}
  if init == "pytorch":
    return _torch_linear(fan_in)
  return {}


def _attention_initializers(init: str, dim: int) -> dict:
  """Attention projections under scheme `init`.

  "sasrec_plus": PyTorch's MultiheadAttention, whose stacked `[3D, D]`
  query, key and value projection is Xavier uniform (variance
  2 / (D + 3D) = 1 / (2D)), biases 0, and whose output projection is an
  `nn.Linear` that SASRec+ re-initializes normal(0.02). "pytorch": four
  `nn.Linear` layers with PyTorch's defaults (gSASRec's attention).
  """
  if init == "sasrec_plus":
    return {"kernel_init": nnx.initializers.variance_scaling(0.5, "fan_in", "uniform"),
            "out_kernel_init": nnx.initializers.normal(stddev=SASREC_PLUS_STD),
            "bias_init": nnx.initializers.zeros}
  if init == "pytorch":
    return _torch_linear(dim)
  return {}


class FeedForward(nnx.Module):
  """Position-wise `D -> hidden_dim -> D`: GELU, or ReLU with dropout on its input."""

  def __init__(self, dim: int, hidden_dim: int, *, activation: str = "gelu",
               dropout_rate: float = 0.0, init: str = "flax", dtype, rngs: nnx.Rngs):
    self.up = nnx.Linear(dim, hidden_dim, dtype=dtype, rngs=rngs, **_initializers(init, dim))
    self.down = nnx.Linear(hidden_dim, dim, dtype=dtype, rngs=rngs,
                           **_initializers(init, hidden_dim))
    self.activation = activation
    self.dropout = nnx.Dropout(dropout_rate)

  def __call__(self, x, *, deterministic: bool = True, rngs=None):  # [B, N, D] -> [B, N, D]
    y = self.up(x)
    if self.activation == "gelu":
      return self.down(jax.nn.gelu(y))
    y = self.dropout(y, deterministic=deterministic, rngs=rngs)
    return self.down(jax.nn.relu(y))


class Block(nnx.Module):
  """One causal transformer block, `kind` "pre_ln" or "sasrec" (the module docstring)."""

  def __init__(self, dim: int, num_heads: int, mlp_dim: int, dropout_rate: float, *,
               kind: str = "pre_ln", init: str = "flax", dtype, rngs: nnx.Rngs):
    self.kind = kind
    epsilon = 1e-8 if kind == "sasrec" else 1e-6
    self.attention_norm = nnx.LayerNorm(dim, epsilon=epsilon, dtype=dtype, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(
        num_heads=num_heads, in_features=dim, dtype=dtype, dropout_rate=dropout_rate,
        broadcast_dropout=False, decode=False, keep_rngs=False, rngs=rngs,
        **_attention_initializers(init, dim),
    )
    self.mlp_norm = nnx.LayerNorm(dim, epsilon=epsilon, dtype=dtype, rngs=rngs)
    self.mlp = FeedForward(dim, mlp_dim, activation="relu" if kind == "sasrec" else "gelu",
                           dropout_rate=dropout_rate, init=init, dtype=dtype, rngs=rngs)
    self.dropout = nnx.Dropout(dropout_rate)

  def __call__(self, x, mask, *, deterministic: bool, rngs):
    """x `[B, N, D]`; mask bool `[B, 1, N, N]` (query, key)."""
    if self.kind == "sasrec":
      query = self.attention_norm(x)
      x = query + self.attention(query, x, x, mask=mask, deterministic=deterministic,
                                 rngs=rngs)
      y = self.mlp_norm(x)
      z = self.mlp(y, deterministic=deterministic, rngs=rngs)
      return y + self.dropout(z, deterministic=deterministic, rngs=rngs)
    y = self.attention(self.attention_norm(x), mask=mask, deterministic=deterministic,
                       rngs=rngs)
    x = x + self.dropout(y, deterministic=deterministic, rngs=rngs)
    y = self.mlp(self.mlp_norm(x))
    return x + self.dropout(y, deterministic=deterministic, rngs=rngs)


class ItemBias(nnx.Module):
  """A learned logit offset b_v per item, `[V_padded]` float32.

  Initialised to `init` for every item: -log V makes every sigmoid about
  1 / V at the start, close to the fraction of positives, so the first steps
  do not spend themselves pushing every logit down.
  """

  def __init__(self, rows: int, init: float):
    self.bias = nnx.Param(jnp.full((rows,), init, jnp.float32))


class SASRec(nnx.Module):
  """Self-attentive sequential recommender returning hidden states.

  Args:
    num_items: catalog size V (valid ids are [0, V)).
    seq_len: maximum sequence length N (number of learned positions).
    dim: hidden size D.
    num_layers, num_heads, mlp_dim: transformer shape.
    dropout_rate: dropout on embeddings, attention weights and residual branches.
    vocab_shards: size of the mesh axis splitting the table; the table has
      `padded_vocab_size(num_items, vocab_shards)` rows.
    item_bias: also learn a logit bias per item (`ItemBias`, initialised at
      -log V), passed to the loss, the ranking and top-k as `bias`.
    block: "pre_ln" or "sasrec" (the module docstring).
    positions: "window" or "from_first" (the module docstring).
    init: the initializers. "flax": embeddings normal(D^-1/2), linear layers
      flax's defaults; "sasrec_plus" (SASRec+'s code): embeddings, linear
      layers and the attention's output normal(0.02), biases 0, the query /
      key / value projections as PyTorch's MultiheadAttention makes them;
      "pytorch" (gSASRec's code: PyTorch's defaults): embeddings normal(1),
      linear kernels and biases uniform in +-1 / sqrt(fan_in).
    embedding_std: the standard deviation of the item, position and output
      tables' normal initializer, over the one `init` names (None: keep it);
      the linear layers keep `init`'s, so the two can be set apart.
    scale_embeddings: multiply the input item embeddings by sqrt(D) (SASRec
      and SASRec+ do; gSASRec does not).
    output_table: "tied" (the input embedding table scores the items) or
      "separate" (a second `[V, D]` table, `output_embedding`, as gSASRec's
      default; sharded by rows like the first).
    dtype: compute dtype (jnp.float32 or jnp.bfloat16); parameters stay float32.
    rngs: parameter initialisation keys (`nnx.Rngs(params=...)`).
  """

  def __init__(self, *, num_items: int, seq_len: int, dim: int, num_layers: int,
               num_heads: int, mlp_dim: int, dropout_rate: float = 0.0,
               vocab_shards: int = 1, dtype=jnp.float32, item_bias: bool = False,
               block: str = "pre_ln", positions: str = "window", init: str = "flax",
               embedding_std: float | None = None, scale_embeddings: bool = True,
               output_table: str = "tied", rngs: nnx.Rngs):
    if num_items < 1 or seq_len < 1 or dim < 1 or num_layers < 0:
      raise ValueError(
          f"SASRec needs num_items, seq_len, dim >= 1 and num_layers >= 0, got "
          f"num_items={num_items}, seq_len={seq_len}, dim={dim}, num_layers={num_layers}")
    if dim % num_heads:
      raise ValueError(f"dim={dim} is not divisible by num_heads={num_heads}")
    for name, value, choices in (("block", block, BLOCKS), ("positions", positions, POSITIONS),
                                 ("init", init, INITS), ("output_table", output_table, TABLES)):
      if value not in choices:
        raise ValueError(f"SASRec {name}={value!r}: one of {choices}")
    if embedding_std is not None and not embedding_std > 0:
      raise ValueError(f"SASRec embedding_std={embedding_std!r}: a positive float, or None")
    self.num_items = num_items
    self.dim = dim
    self.dtype = dtype
    self.positions = positions
    self.scale_embeddings = scale_embeddings
    std = {"flax": dim ** -0.5, "sasrec_plus": SASREC_PLUS_STD, "pytorch": 1.0}[init]
    std = std if embedding_std is None else embedding_std
    embedding_init = nnx.initializers.normal(stddev=std)
    rows = padded_vocab_size(num_items, vocab_shards)
    setattr(self, ITEM_EMBEDDING, nnx.Embed(rows, dim, dtype=dtype,
                                            embedding_init=embedding_init, rngs=rngs))
    self.position_embedding = nnx.Embed(seq_len, dim, dtype=dtype,
                                        embedding_init=embedding_init, rngs=rngs)
    self.embedding_dropout = nnx.Dropout(dropout_rate)
    self.blocks = nnx.List([
        Block(dim, num_heads, mlp_dim, dropout_rate, kind=block, init=init, dtype=dtype,
              rngs=rngs)
        for _ in range(num_layers)
    ])
    self.final_norm = nnx.LayerNorm(dim, epsilon=1e-8 if block == "sasrec" else 1e-6,
                                    dtype=dtype, rngs=rngs)
    if output_table == "separate":
      setattr(self, OUTPUT_EMBEDDING, nnx.Embed(rows, dim, dtype=dtype,
                                                embedding_init=embedding_init, rngs=rngs))
    if item_bias:
      self.item_bias = ItemBias(padded_vocab_size(num_items, vocab_shards),
                                -math.log(num_items))

  @property
  def item_table(self) -> jax.Array:
    """The `[V_padded, D]` output table (the input embedding unless separate), compute dtype."""
    table = getattr(self, OUTPUT_EMBEDDING, None)
    table = getattr(self, ITEM_EMBEDDING) if table is None else table
    return table.embedding[...].astype(self.dtype)

  @property
  def output_bias(self) -> jax.Array | None:
    """The `[V_padded]` float32 item bias of the logits, or None without one."""
    bias = getattr(self, "item_bias", None)
    return None if bias is None else bias.bias[...]

  def __call__(self, inputs, *, deterministic: bool = True, rngs: nnx.Rngs | None = None):
    """Hidden states of a batch of item sequences.

    Args:
      inputs: int `[B, N]` item ids; ids outside [0, V) are padding.
      deterministic: disables dropout when True.
      rngs: `nnx.Rngs(dropout=key)`, required when `deterministic` is False.

    Returns:
      `[B, N, D]` hidden states in the compute dtype (zero-masked padding
      positions are still returned; their loss weights are 0).
    """
    valid = (inputs >= 0) & (inputs < self.num_items)  # [B, N]
    ids = jnp.where(valid, inputs, 0)
    x = getattr(self, ITEM_EMBEDDING)(ids)
    if self.scale_embeddings:
      x = x * jnp.asarray(self.dim ** 0.5, self.dtype)
    x = x * valid[..., None].astype(self.dtype)
    if self.positions == "from_first":  # 0 at the window's first item (padding: 0, unused)
      positions = jnp.maximum(jnp.cumsum(valid, axis=-1) - 1, 0)
    else:
      positions = jnp.arange(inputs.shape[-1])[None]
    x = x + self.position_embedding(positions)
    x = self.embedding_dropout(x, deterministic=deterministic, rngs=rngs)
    causal = nnx.make_causal_mask(inputs, dtype=jnp.bool_)  # [B, 1, N, N]
    # Padding keys are masked, except that every query sees itself: no row of
    # the mask is empty, and a padding position depends on nothing but itself.
    itself = jnp.eye(inputs.shape[-1], dtype=jnp.bool_)[None, None]  # [1, 1, N, N]
    mask = causal & (valid[:, None, None, :] | itself)
    for block in self.blocks:
      x = block(x, mask, deterministic=deterministic, rngs=rngs)
    return self.final_norm(x)


def param_partition_specs(params: nnx.State, vocab_axis: str | None) -> nnx.State:
  """PartitionSpecs for a state shaped like the model's parameters.

  The item tables `[V, D]` and the item bias `[V]` (and any array in the tree
  under the same paths, such as optimizer moments) are split by rows over
  `vocab_axis`; everything else is replicated.
  """

  def spec(path, leaf):
    if vocab_axis is None:
      return P()
    names = {getattr(k, "key", getattr(k, "name", None)) for k in path}
    ndim = getattr(leaf, "ndim", 0)
    if names & {ITEM_EMBEDDING, OUTPUT_EMBEDDING} and ndim == 2:
      return P(vocab_axis, None)
    if "item_bias" in names and ndim == 1:
      return P(vocab_axis)
    return P()

  return jax.tree_util.tree_map_with_path(spec, params)
