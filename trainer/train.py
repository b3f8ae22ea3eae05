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
`loss.backend="dense"` the dense-logits reference `cutbce.dense_softmax_ce`),
or a sampled loss (below).

The sampled baselines (`"sampled_softmax"`, `"gbce"`, `"in_batch"`,
`trainer/sampled.py`) score each position against its targets and k
negatives only: drawn uniformly or by training popularity (the int32
cumulative counts passed to the step as an array, `sampler_tables`) or
taken from the batch's targets, per batch or per position, with an
optional logQ correction. Their rows come from the vocab-sharded table
through `sampled.take_rows`, one `shard_map` (T x k x D multiply-adds and k
or T x k rows gathered per step; no pass over the catalog, the table never
gathered whole).

With `config.loss.exclude="window"`, every position's negatives leave out the
items of its own training window (`window_exclude`): the ids are passed to
the op as `exclude` of `[B, 1, E]`, one row of E = N + L ids shared by the
window's positions (targets stay targets), no pass over the catalog.

Dropout keys are `fold_in(key(seed), step)`, so the state holds no random
state and a resumed run draws exactly the masks of an uninterrupted one;
the sampled losses' negatives come from `fold_in` of the same step key
(`sampled.NEGATIVES_STREAM`), so a resumed run draws the same negatives too.
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
from trainer import sampled as sampled_lib
from trainer.config.schema import ConfigError

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
      item_bias=bool(model_config.get("item_bias", False)),
      block=model_config.get("block", "pre_ln"), positions=model_config.get("positions", "window"),
      init=model_config.get("init", "flax"), embedding_std=model_config.get("embedding_std"),
      scale_embeddings=bool(model_config.get("scale_embeddings", True)),
      output_table=model_config.get("output_table", "tied"), rngs=nnx.Rngs(params=seed),
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
  """Clip by global norm (unless None), then AdamW; weight decay on matrices, not embeddings."""

  def decay_mask(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x.ndim >= 2 and not any(
            "embedding" in str(getattr(k, "key", "")) for k in path),
        params)

  clip = optimizer_config.get("clip_norm", None)
  return optax.chain(
      optax.identity() if clip is None else optax.clip_by_global_norm(clip),
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
  sampled: sampled_lib.SampledLoss | None = None  # the sampled kinds' settings (else None)


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
      sampled=sampled_settings(loss, num_items), **loss_variants(loss))


def sampled_settings(loss_config, num_items: int) -> sampled_lib.SampledLoss | None:
  """The `SampledLoss` of `config.loss` for the sampled kinds, else None.

  Raises:
    ConfigError: gbce with k >= V (alpha = k / (V - 1) past 1), one line.
  """
  if loss_config.kind not in sampled_lib.SAMPLED_KINDS:
    return None
  defaults = sampled_lib.SampledLoss._field_defaults
  settings = sampled_lib.SampledLoss(
      kind=loss_config.kind, num_negatives=loss_config.get("num_negatives", 128),
      target_reduction=loss_config.target_reduction,
      exclude_window=loss_config.get("exclude", "none") == "window",
      **{name: loss_config.get(name, defaults[name])
         for name in ("sampler", "logq", "gbce_t", "negatives_per")})
  if settings.kind == "gbce" and settings.num_negatives >= num_items:
    raise ConfigError(
        f"config.loss.num_negatives={settings.num_negatives}: at most V - 1 = {num_items - 1} "
        f"with gbce, the other items of the {num_items:,} the prepared data holds (alpha = "
        "k / (V - 1) is at most 1); every item as a negative is config.loss.kind='bce'")
  return settings


def needs_item_counts(settings: StepSettings) -> bool:
  """Whether the step takes the popularity sampler's table (`sampler_tables`)."""
  return (settings.sampled is not None and settings.sampled.kind != "in_batch"
          and settings.sampled.sampler == "popularity")


def sampler_tables(settings: StepSettings, item_counts, rows: int):
  """The step's third argument: int32 `[rows]` cumulative item counts, or None.

  Args:
    settings: the step's settings.
    item_counts: int `[V]` training counts (`sampled.global_train_item_counts`),
      or a callable returning them (called only when needed).
    rows: the table's padded row count.
  """
  if not needs_item_counts(settings):
    return None
  counts = item_counts() if callable(item_counts) else item_counts
  replicated = NamedSharding(settings.mesh, P())
  return jax.device_put(sampled_lib.cumulative_counts(counts, rows), replicated)


EXCLUDE_CHOICES = ("none", "window")


def window_exclude(inputs, targets, num_items: int):
  """int32 `[B, 1, N + L]`: every item of a training window, one row its N positions share.

  A window's items are its inputs and the last position's targets (the inputs
  shifted by one, plus the L - 1 items after the window); padding (inputs
  equal to V, targets -1) becomes -1. Passed as `exclude`, the user's own
  window items are neither positives nor negatives, except each position's
  own targets, which stay targets (the op's contract). One row per window,
  not per position: the op then gathers and masks per window (N times less
  work on the softmax's XLA path).
  """
  inputs = jnp.where(inputs < num_items, inputs, -1)
  return jnp.concatenate([inputs, targets[:, -1, :]], axis=-1)[:, None, :]  # [B, 1, N + L]


def _loss_and_stats(params, graphdef, batch, dropout_key, settings: StepSettings,
                    cumulative=None):
  """The step's loss and `cutbce.Stats`; `dropout_key` is the step key (negatives too)."""
  model = nnx.merge(graphdef, params)
  hidden = model(batch["inputs"], deterministic=False, rngs=nnx.Rngs(dropout=dropout_key))
  table = model.item_table  # [V_padded, D]: rows past num_items split the table evenly
  if settings.sampled is not None:
    key = jax.random.fold_in(dropout_key, sampled_lib.NEGATIVES_STREAM)
    window = None
    if settings.sampled.exclude_window:  # [B, N + L]: a sequence's inputs and last targets
      window = window_exclude(batch["inputs"], batch["targets"], settings.num_items)[:, -1]
    negatives = sampled_lib.draw_negatives(key, settings.sampled, batch["targets"],
                                           num_items=settings.num_items, cumulative=cumulative,
                                           window=window)
    layout = sampled_lib.RowLayout(settings.mesh, settings.token_axes, settings.vocab_axis)
    return sampled_lib.sampled_loss(hidden, table, batch["targets"], batch["weights"],
                                    negatives, bias=model.output_bias,
                                    num_items=settings.num_items, loss=settings.sampled,
                                    layout=layout)
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


def train_step(state, batch, cumulative=None, *, graphdef, tx, schedule,
               settings: StepSettings):
  """One optimizer step. Returns `(new_state, metrics)`; metrics are float32 scalars.

  `cumulative`: the popularity sampler's int32 `[V_padded]` table
  (`sampler_tables`), only for the sampled kinds with `loss.sampler="popularity"`.
  """
  dropout_key = jax.random.fold_in(jax.random.key(settings.seed), state["step"])
  grad_fn = jax.value_and_grad(_loss_and_stats, has_aux=True)
  (loss, stats), grads = grad_fn(state["params"], graphdef, batch, dropout_key, settings,
                                 cumulative)
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


def jit_train_step(graphdef, tx, schedule, settings: StepSettings, shardings,
                   tables=None) -> Callable:
  """The jitted step `(state, batch) -> (state, metrics)`: explicit shardings, state donated.

  Args:
    graphdef, tx, schedule, settings, shardings: the model, optimizer and step.
    tables: the popularity sampler's table (`sampler_tables`; a
      ShapeDtypeStruct will do for `.lower`), required when
      `needs_item_counts(settings)`; it is bound to the step, which then
      passes it as the jitted function's third argument.

  Raises:
    ValueError: the step needs `tables` and none was given.
  """
  if needs_item_counts(settings) and tables is None:
    raise ValueError("config.loss.sampler='popularity' needs the item counts: pass "
                     "tables=sampler_tables(settings, counts, rows) to jit_train_step")
  replicated = NamedSharding(settings.mesh, P())
  step = functools.partial(train_step, graphdef=graphdef, tx=tx, schedule=schedule,
                           settings=settings)
  batch = batch_sharding(settings.mesh, settings.token_axes)
  if not needs_item_counts(settings):
    return jax.jit(step, in_shardings=(shardings, batch), out_shardings=(shardings, replicated),
                   donate_argnums=(0,))
  jitted = jax.jit(step, in_shardings=(shardings, batch, replicated),
                   out_shardings=(shardings, replicated), donate_argnums=(0,))
  return BoundStep(jitted, tables)


class BoundStep(NamedTuple):
  """A jitted step with its sampler table bound: called and lowered as `(state, batch)`."""
  jitted: Any
  tables: Any

  def __call__(self, state, batch):
    return self.jitted(state, batch, self.tables)

  def lower(self, state, batch):
    return self.jitted.lower(state, batch, self.tables)


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
