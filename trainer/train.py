"""Train state, optimizer and the jitted, sharded train step.

The train state is a plain pytree `{"step": int32 [], "params": nested dict of
the SASRec parameters, "opt_state": optax state}`; the model's graph
definition stays outside. One `jax.jit` step takes the state and a global
batch with explicit in/out shardings, donates the state, and returns the new
state and float32 metrics (loss, gradient norm, learning rate and the
confusion counts of `cut_bce(..., return_stats=True)`).

Shardings: the batch is split on its leading axis over `mesh.token_axes`; the
item table (and its optimizer moments) by rows over `mesh.vocab_axis`;
everything else replicated. The loss is `cutbce.sharding.sharded_cut_bce`
(`config.loss.kind="bce"`), or the full-catalog softmax cross-entropy
`cutbce.sharding.sharded_cut_softmax_ce` (`"softmax_ce"`; with
`loss.backend="dense"` the dense-logits reference `cutbce.dense_softmax_ce`).

With `config.loss.exclude="window"`, every position's negatives leave out the
items of its own training window (`window_exclude`): the ids are passed to
the op as `exclude` (targets stay targets), which costs a gather of E = N + L
table rows per position (T x E x D values in the forward and the same in
the backward's scatter), no pass over the catalog.

Dropout keys are `fold_in(key(seed), step)`, so the state holds no random
state and a resumed run draws exactly the masks of an uninterrupted one.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from cutbce import sharding as cutbce_sharding
from trainer import model as model_lib

TrainState = dict  # {"step": int32 [], "params": dict, "opt_state": optax state}


# --------------------------------------------------------------------------- #
# Model, optimizer and state.                                                  #
# --------------------------------------------------------------------------- #


def make_model(model_config, *, num_items: int, seq_len: int, vocab_shards: int,
               seed: int) -> model_lib.SASRec:
  return model_lib.SASRec(
      num_items=num_items, seq_len=seq_len, dim=model_config.dim,
      num_layers=model_config.num_layers, num_heads=model_config.num_heads,
      mlp_dim=model_config.mlp_dim, dropout_rate=model_config.dropout_rate,
      vocab_shards=vocab_shards, dtype=jnp.dtype(model_config.dtype),
      item_bias=bool(model_config.get("item_bias", False)), rngs=nnx.Rngs(params=seed),
  )


def learning_rate_schedule(optimizer_config, train_steps: int) -> optax.Schedule:
  """Linear warm-up from 0, then constant or cosine decay to 0 at `train_steps`."""
  peak = optimizer_config.learning_rate
  warmup = max(int(optimizer_config.warmup_steps), 1)
  if optimizer_config.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(train_steps, warmup + 1))
  if optimizer_config.schedule == "constant":
    return optax.join_schedules(
        [optax.linear_schedule(0.0, peak, warmup), optax.constant_schedule(peak)], [warmup])
  raise ValueError(
      f"config.optimizer.schedule={optimizer_config.schedule!r}; expected 'constant' or 'cosine'")


def make_optimizer(optimizer_config, train_steps: int) -> optax.GradientTransformation:
  """Clip by global norm, then AdamW; weight decay on matrices but not the embeddings."""

  def decay_mask(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x.ndim >= 2 and not any(
            "embedding" in str(getattr(k, "key", "")) for k in path),
        params)

  return optax.chain(
      optax.clip_by_global_norm(optimizer_config.clip_norm),
      optax.adamw(learning_rate_schedule(optimizer_config, train_steps),
                  b1=optimizer_config.b1, b2=optimizer_config.b2,
                  weight_decay=optimizer_config.weight_decay, mask=decay_mask),
  )


def init_state(model: model_lib.SASRec, tx: optax.GradientTransformation):
  """`(graphdef, state)` of a freshly initialised model."""
  graphdef, params = nnx.split(model)
  params = nnx.to_pure_dict(params)
  state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}
  return graphdef, state


def state_shardings(state, mesh: Mesh, vocab_axis: str | None):
  """NamedShardings of the train state: table rows (and moments) on `vocab_axis`."""
  specs = model_lib.param_partition_specs(state, vocab_axis)
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)


def batch_sharding(mesh: Mesh, token_axes) -> NamedSharding:
  """Leading (batch) axis split over the token axes, other axes replicated."""
  return NamedSharding(mesh, P(tuple(token_axes)))


# --------------------------------------------------------------------------- #
# The train step.                                                              #
# --------------------------------------------------------------------------- #


class StepSettings(NamedTuple):
  """What the step needs besides the state and batch (hashable, static)."""
  mesh: Mesh
  token_axes: tuple[str, ...]
  vocab_axis: str | None
  num_items: int
  seed: int
  backend: str
  vocab_reduction: str
  loss_kind: str = "bce"  # "bce" (`sharded_cut_bce`) or "softmax_ce" (`sharded_cut_softmax_ce`)
  target_reduction: str = "sum"  # softmax_ce: a position's targets added or averaged
  # Loss variants of `cutbce.cut_bce` (config.loss); the defaults are plain BCE.
  pos_weight: float | None = None
  label_smoothing: float = 0.0
  logit_soft_cap: float | None = None
  focal_gamma: float | None = None
  focal_alpha: float | None = None
  one_pass: bool | None = None  # `cut_bce`'s one_pass (None: when the reduction allows)
  exclude: str = "none"  # "window": each position's negatives leave out its window's items


LOSS_VARIANTS = ("pos_weight", "label_smoothing", "logit_soft_cap", "focal_gamma",
                 "focal_alpha", "one_pass")


def loss_variants(loss_config) -> dict:
  """The StepSettings fields of `config.loss`'s variants and `one_pass` (keys absent: off)."""
  defaults = StepSettings._field_defaults
  return {name: loss_config.get(name, defaults[name]) for name in LOSS_VARIANTS}


def step_settings(config, *, mesh: Mesh, num_items: int) -> StepSettings:
  """The train step's settings from a run config (`config.loss`, `config.mesh`)."""
  loss = config.loss
  return StepSettings(
      mesh=mesh, token_axes=tuple(config.mesh.token_axes), vocab_axis=config.mesh.vocab_axis,
      num_items=num_items, seed=config.seed, backend=loss.backend,
      vocab_reduction=loss.vocab_reduction, loss_kind=loss.kind,
      target_reduction=loss.target_reduction, exclude=loss.get("exclude", "none"),
      **loss_variants(loss))


EXCLUDE_CHOICES = ("none", "window")


def window_exclude(inputs, targets, num_items: int):
  """int32 `[B, N, N + L]`: every item of a training window, for each of its positions.

  A window's items are its inputs and the last position's targets (the inputs
  shifted by one, plus the L - 1 items after the window); padding (inputs
  equal to V, targets -1) becomes -1. Passed as `exclude`, the user's own
  window items are neither positives nor negatives, except each position's
  own targets, which stay targets (the op's contract).
  """
  inputs = jnp.where(inputs < num_items, inputs, -1)
  items = jnp.concatenate([inputs, targets[:, -1, :]], axis=-1)  # [B, N + L]
  return jnp.broadcast_to(items[:, None, :], (*inputs.shape, items.shape[-1]))


def _loss_and_stats(params, graphdef, batch, dropout_key, settings: StepSettings):
  model = nnx.merge(graphdef, params)
  hidden = model(batch["inputs"], deterministic=False, rngs=nnx.Rngs(dropout=dropout_key))
  table = model.item_table  # [V_padded, D]: rows past num_items split the table evenly
  if settings.exclude not in EXCLUDE_CHOICES:
    raise ValueError(f"loss.exclude={settings.exclude!r}; expected one of {EXCLUDE_CHOICES}")
  exclude = None
  if settings.exclude == "window":
    exclude = window_exclude(batch["inputs"], batch["targets"], settings.num_items)
  common = dict(mesh=settings.mesh, token_axes=settings.token_axes,
                vocab_axis=settings.vocab_axis, bias=model.output_bias, exclude=exclude,
                num_items=settings.num_items, return_stats=True, backend=settings.backend)
  if settings.loss_kind == "softmax_ce":
    return cutbce_sharding.sharded_cut_softmax_ce(
        hidden, table, batch["targets"], batch["weights"],
        label_smoothing=settings.label_smoothing, target_reduction=settings.target_reduction,
        **common)
  return cutbce_sharding.sharded_cut_bce(
      hidden, table, batch["targets"], batch["weights"],
      vocab_reduction=settings.vocab_reduction,
      **{name: getattr(settings, name) for name in LOSS_VARIANTS}, **common)


def train_step(state, batch, *, graphdef, tx, schedule, settings: StepSettings):
  """One optimizer step. Returns `(new_state, metrics)`; metrics are float32 scalars."""
  dropout_key = jax.random.fold_in(jax.random.key(settings.seed), state["step"])
  grad_fn = jax.value_and_grad(_loss_and_stats, has_aux=True)
  (loss, stats), grads = grad_fn(state["params"], graphdef, batch, dropout_key, settings)
  updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
  params = optax.apply_updates(state["params"], updates)
  grad_norm = optax.tree.norm(grads)
  metrics = {
      "loss": loss,
      "grad_norm": grad_norm,
      "learning_rate": jnp.asarray(schedule(state["step"]), jnp.float32),
      "finite": jnp.isfinite(loss) & jnp.isfinite(grad_norm),
      "tokens": jnp.sum(batch["weights"]),
  }
  for name in ("tp", "fp", "fn", "tn"):
    metrics[name] = jnp.asarray(getattr(stats, name), jnp.float32)
  new_state = {"step": state["step"] + 1, "params": params, "opt_state": opt_state}
  return new_state, metrics


def jit_train_step(graphdef, tx, schedule, settings: StepSettings, shardings) -> Callable:
  """The jitted step: explicit in/out shardings, state donated."""
  replicated = NamedSharding(settings.mesh, P())
  step = functools.partial(train_step, graphdef=graphdef, tx=tx, schedule=schedule,
                           settings=settings)
  return jax.jit(
      step,
      in_shardings=(shardings, batch_sharding(settings.mesh, settings.token_axes)),
      out_shardings=(shardings, replicated),
      donate_argnums=(0,),
  )


class StatePlan(NamedTuple):
  """The train state before it exists: what to build it from, or restore it into."""
  graphdef: Any
  tx: optax.GradientTransformation
  schedule: optax.Schedule
  abstract: Any  # ShapeDtypeStructs of the state, each with its target sharding
  shardings: Any  # NamedShardings of the state
  init: Callable[[], TrainState]  # builds a fresh state on the mesh (jitted)


def plan_sharded_state(config, *, num_items: int, mesh: Mesh, vocab_shards: int) -> StatePlan:
  """Shapes, dtypes and shardings of the train state, with nothing allocated.

  `plan.abstract` is the restore target of a checkpoint (orbax reads each
  array straight onto its sharding); `plan.init()` initialises the state under
  `jax.jit` with the target shardings as outputs, so each device only
  materialises its own rows of the table. Resuming never calls `init`, so the
  host and devices never hold a fresh state and a restored one at once.
  """
  tx = make_optimizer(config.optimizer, config.train_steps)
  schedule = learning_rate_schedule(config.optimizer, config.train_steps)

  def new_model():
    return make_model(config.model, num_items=num_items, seq_len=config.seq_len,
                      vocab_shards=vocab_shards, seed=config.seed)

  def init():
    return init_state(new_model(), tx)[1]

  graphdef = nnx.graphdef(nnx.eval_shape(new_model))
  shapes = jax.eval_shape(init)
  shardings = state_shardings(shapes, mesh, config.mesh.vocab_axis)
  return StatePlan(graphdef=graphdef, tx=tx, schedule=schedule,
                   abstract=abstract_state(shapes, shardings), shardings=shardings,
                   init=jax.jit(init, out_shardings=shardings))


def create_sharded_state(config, *, num_items: int, mesh: Mesh, vocab_shards: int):
  """`(graphdef, tx, schedule, state, shardings)`, a fresh state placed on the mesh."""
  plan = plan_sharded_state(config, num_items=num_items, mesh=mesh, vocab_shards=vocab_shards)
  return plan.graphdef, plan.tx, plan.schedule, plan.init(), plan.shardings


def abstract_state(state: Any, shardings: Any):
  """ShapeDtypeStructs with shardings, the restore target of a checkpoint."""
  return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s), state, shardings)
