"""A finished (or running) training run opened from its workdir, for the commands.

`open_run(workdir)` rebuilds what `trainer.evaluate`, `trainer.recommend` and
`trainer.export` need from what the run left there:

  WORKDIR/config.json          the config (`trainer.config.saved`)
  WORKDIR/checkpoints/<step>/  the params of the chosen checkpoint (only the
                               params are read: no optimizer state, no iterator)
  the prepared data            `config.data.prepared_dir` or WORKDIR/data

The workdir may be local or `gs://...` (every path is an `etils.epath`
path). The commands run as one process, so a `data.prepared_dir` holding
`{process}` is read as process 0's copy.

The mesh is the run's when its size equals the devices present; otherwise
(say a run of 8 simulated devices evaluated on one CPU) every device goes on
one "data" axis and the item table is replicated. Either way the table keeps
the run's row count (`num_items` rounded up for its vocab axis), and rows past
`num_items` are never ranked or returned.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from etils import epath
from flax import nnx
from jax.sharding import AxisType, Mesh

from trainer import data as data_lib
from trainer.workdir import checkpoint, fingerprint, paths
from trainer.config import keys as config_keys, mesh as config_mesh, saved as saved_config
from trainer import train as train_lib
from trainer.config.schema import ConfigError


class TrainedRun(NamedTuple):
  """The parts of a run the commands use.

  Attributes:
    workdir: the run's directory.
    config: its config (from config.json).
    data: the prepared dataset (memory-mapped).
    graphdef: the SASRec graph definition.
    params: the parameters of the chosen checkpoint, on `settings.mesh`.
    param_shardings: their shardings.
    settings: mesh, axes, `num_items` and the evaluation backend.
    batch_size: global evaluation batch, a multiple of the token shards.
    step: the checkpoint's step.
    which: "best", "latest" or "step" (chosen by `--step`).
    data_dir: the folder of the prepared data.
  """

  workdir: str
  config: Any
  data: data_lib.PreparedDataset
  graphdef: Any
  params: Any
  param_shardings: Any
  settings: train_lib.StepSettings
  batch_size: int
  step: int
  which: str
  data_dir: str


def checkpoints_dir(workdir: str | os.PathLike) -> epath.Path:
  """`WORKDIR/checkpoints` (a local workdir made absolute, `gs://...` as given)."""
  return paths.as_path(workdir) / "checkpoints"


def choose_step(workdir: str, best_metric: str | None, which: str = "best",
                step: int | None = None, say: Callable[[str], None] = print) -> tuple[int, str]:
  """The checkpoint step to read: `step`, else the best or the latest.

  Returns:
    `(step, "step" | "best" | "latest")`.

  Raises:
    ConfigError: no checkpoint at all, or `step` is not one of them.
  """
  manager = checkpoint.make_manager(checkpoints_dir(workdir), None, best_metric=best_metric)
  try:
    steps = sorted(manager.all_steps())
    if not steps:
      raise ConfigError(f"--workdir={workdir!r}: a run with a checkpoint; "
                        f"{checkpoints_dir(workdir)} holds none yet")
    if step is not None:
      if step not in steps:
        raise ConfigError(f"--step={step}: a step with a checkpoint in "
                          f"{checkpoints_dir(workdir)}: {', '.join(map(str, steps))}")
      return step, "step"
    if which == "best":
      best = checkpoint.best_step(manager)
      if best is not None:
        return best, "best"
      say(f"no best checkpoint in {checkpoints_dir(workdir)} (checkpoint.best_metric="
          f"{best_metric!r}, or no evaluation was saved with one): using the latest")
    return steps[-1], "latest"
  finally:
    manager.close()


def _unreadable(workdir, step: int, error: BaseException) -> str:
  """One line: the checkpoint of `step` cannot be read, and the previous one to try."""
  manager = checkpoint.make_manager(checkpoints_dir(workdir), None)
  try:
    older = [s for s in manager.all_steps() if s < step]
  finally:
    manager.close()
  offer = (f"pass --step={max(older)} for the previous one" if older
           else "no older checkpoint is kept")
  return (f"the checkpoint of step {step} in {checkpoints_dir(workdir)} cannot be read "
          f"({checkpoint.cause(error)}): corrupted files, or a config whose shapes differ; "
          f"{offer}")


def command_mesh(config, say: Callable[[str], None] = print
                 ) -> tuple[Mesh, tuple[str, ...], str | None]:
  """`(mesh, token_axes, vocab_axis)`: the run's mesh, or all devices on one data axis."""
  if math.prod(config.mesh.shape) == jax.device_count():
    return (config_mesh.make_mesh(config), tuple(config.mesh.token_axes),
            config.mesh.vocab_axis)
  run_mesh = dict(zip(config.mesh.axis_names, config.mesh.shape))
  say(f"the run's mesh {run_mesh} needs {math.prod(config.mesh.shape)} devices and "
      f"{jax.device_count()} are present: using mesh {{'data': {jax.device_count()}}} with "
      "the item table replicated")
  mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(AxisType.Auto,))
  return mesh, ("data",), None


def _abstract_params(config, num_items: int):
  """`(graphdef, params as ShapeDtypeStructs)` of the run's model (its table rows)."""
  vocab_shards = config_mesh.vocab_shard_count(config)

  def model():
    return train_lib.make_model(config.model, num_items=num_items, seq_len=config.seq_len,
                                vocab_shards=vocab_shards, seed=config.seed)

  graphdef = nnx.graphdef(nnx.eval_shape(model))
  abstract = jax.eval_shape(lambda: nnx.to_pure_dict(nnx.split(model())[1]))
  return graphdef, abstract


def open_run(workdir: str, *, which: str = "best", step: int | None = None,
             say: Callable[[str], None] = print) -> TrainedRun:
  """Opens the run in `workdir` at the chosen checkpoint.

  Args:
    workdir: the run's directory.
    which: "best" (falls back to "latest" with a notice) or "latest".
    step: read this step's checkpoint instead.
    say: where notices go.

  Raises:
    ConfigError: no checkpoint, an unknown step, or a config.json that does
      not pass the schema.
    FileNotFoundError: no config.json or no prepared data.
  """
  config = saved_config.read(workdir)
  config_keys.check(config, config_keys.Context(device_count=math.prod(config.mesh.shape)))
  step, which = choose_step(workdir, config.checkpoint.best_metric, which, step, say)
  data_dir = config_keys.prepared_folder(config.data.prepared_dir, workdir)
  data = data_lib.load_prepared(data_dir)
  fingerprint.check(workdir, data.item_ids, data_dir)  # the items the checkpoint's rows name
  mesh, token_axes, vocab_axis = command_mesh(config, say)
  graphdef, abstract = _abstract_params(config, data.num_items)
  shardings = train_lib.state_shardings(abstract, mesh, vocab_axis)
  # Another item count (data re-prepared) is named as such, not as an unreadable checkpoint.
  checkpoint.check_param_shapes(checkpoints_dir(workdir), step, abstract)
  try:
    params = checkpoint.restore_params(checkpoints_dir(workdir), step,
                                       train_lib.abstract_state(abstract, shardings))
  except Exception as error:  # pylint: disable=broad-except  (orbax raises many kinds)
    raise ConfigError(_unreadable(workdir, step, error)) from None
  settings = train_lib.StepSettings(
      mesh=mesh, token_axes=token_axes, vocab_axis=vocab_axis, num_items=data.num_items,
      seed=config.seed, backend=config.eval.backend, vocab_reduction=config.loss.vocab_reduction)
  shards = math.prod(dict(mesh.shape)[axis] for axis in token_axes)
  batch_size = -(-config.eval_batch_size // shards) * shards
  label = {"best": "the best checkpoint", "latest": "the latest checkpoint",
           "step": "the checkpoint"}[which]
  say(f"{workdir}: {label}, step {step}; {data.num_users:,} users, {data.num_items:,} items")
  return TrainedRun(workdir=workdir, config=config, data=data, graphdef=graphdef, params=params,
                    param_shardings=shardings, settings=settings, batch_size=batch_size,
                    step=step, which=which, data_dir=str(data_dir))
