"""Checkpoints: train state and grain iterator state saved together with orbax.

Each checkpoint `WORKDIR/checkpoints/<step>/` holds two items:

  state: the train state (`trainer.train.TrainState`), restored onto the
         current mesh from abstract arrays carrying the target shardings;
  data:  the grain training iterator's position (one file per process), so a
         resumed run reads exactly the batches an uninterrupted one would.

`latest_step` + `restore` give auto-resume. `PreemptionFlag` turns SIGTERM into
a flag the loop polls: it saves a checkpoint at the current step and exits 0.
Saving is synchronous: a checkpoint on disk is complete before the loop
moves on (or exits), which is what preemption and NaN handling rely on.

Best checkpoint. A checkpoint saved with `metrics` (the rank metrics of the
periodic evaluation at its step) stores them beside its items (orbax's
`metrics` item). One manager keeps both the latest `max_to_keep` checkpoints
and the best one by `best_metric` (every rank metric is higher-better), with
orbax's own preservation policies,

    AnyPreservationPolicy([LatestN(max_to_keep),
                           BestN(n=1, keep_checkpoints_without_metrics=False)])

and `best_fn` set on the options so that orbax writes the metrics and
`best_step` ranks them. No second manager (`WORKDIR/best`) is needed: one
directory, one step numbering, and the best checkpoint is a full one (state
and data iterator) that can be resumed from like any other.
"""

from __future__ import annotations

import math
import os
import signal

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp


def metric_fn(best_metric: str):
  """`metrics -> float`: the value of `best_metric` (-inf when a checkpoint lacks it)."""

  def value(metrics) -> float:
    return float(metrics.get(best_metric, -math.inf))

  return value


def make_manager(directory: str | os.PathLike, max_to_keep: int | None,
                 best_metric: str | None = None) -> ocp.CheckpointManager:
  """A CheckpointManager over `directory` with items "state" and "data".

  Args:
    directory: the checkpoints folder (`WORKDIR/checkpoints`).
    max_to_keep: the latest checkpoints kept (None: all).
    best_metric: also keep the checkpoint with the highest value of this
      rank metric among those saved with metrics (None: latest ones only).
  """
  if best_metric is None:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=True, enable_async_checkpointing=False)
  else:
    policies = ocp.checkpoint_managers
    best = metric_fn(best_metric)
    options = ocp.CheckpointManagerOptions(
        create=True, enable_async_checkpointing=False, best_fn=best, best_mode="max",
        keep_checkpoints_without_metrics=False,
        preservation_policy=policies.AnyPreservationPolicy([
            policies.LatestN(n=max_to_keep),
            policies.BestN(get_metric_fn=best, reverse=False, n=1,
                           keep_checkpoints_without_metrics=False)]))
  return ocp.CheckpointManager(os.path.abspath(directory), options=options,
                               item_names=("state", "data"))


def save(manager: ocp.CheckpointManager, step: int, state, iterator,
         metrics: dict[str, float] | None = None) -> None:
  """Saves state and iterator position at `step` (no-op if `step` exists).

  Args:
    manager: from `make_manager`.
    step: the step number.
    state: the train state.
    iterator: the grain training iterator.
    metrics: the periodic evaluation's metrics at `step`, ranked for the best
      checkpoint (None: a checkpoint that is never "best").
  """
  if step in manager.all_steps():
    return
  manager.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state),
      data=grain.checkpoint.CheckpointSave(iterator)), force=True,
      metrics=None if metrics is None else {k: float(v) for k, v in metrics.items()})
  manager.wait_until_finished()


def latest_step(manager: ocp.CheckpointManager) -> int | None:
  return manager.latest_step()


def best_step(manager: ocp.CheckpointManager) -> int | None:
  """The kept checkpoint with the best metric; None when none was saved with metrics
  (or the manager keeps no best one)."""
  # Without a best_fn orbax answers the latest step, which then has no metrics.
  best = manager.best_step()
  return best if best is not None and manager.metrics(best) is not None else None


def restore_params(directory: str | os.PathLike, step: int, abstract_params):
  """Only the params of the checkpoint `step` (no optimizer state, no iterator).

  Args:
    directory: the checkpoints folder.
    step: a step saved there.
    abstract_params: ShapeDtypeStructs with the target shardings (any mesh).

  Returns:
    The params, placed as `abstract_params` says.
  """
  item = {"params": abstract_params}
  path = os.path.join(os.path.abspath(directory), str(step), "state")
  with ocp.PyTreeCheckpointer() as checkpointer:
    restored = checkpointer.restore(path, args=ocp.args.PyTreeRestore(
        item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
        partial_restore=True))
  return restored["params"]


def restore(manager: ocp.CheckpointManager, step: int, abstract_state, iterator):
  """Restores the state onto the shardings of `abstract_state`; `iterator` in place.

  Returns:
    The restored train state.
  """
  restored = manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract_state),
      data=grain.checkpoint.CheckpointRestore(iterator)))
  return restored.state


class PreemptionFlag:
  """Set by SIGTERM; `is_set()` agrees across processes.

  Every process must take part in a checkpoint, so when one process receives
  the signal all of them stop at the same step: the flag is combined over
  processes (logical or) each time it is read.
  """

  def __init__(self):
    self._set = False
    self._previous = signal.signal(signal.SIGTERM, self._handle)

  def _handle(self, signum, frame):
    del signum, frame
    self._set = True

  def is_set(self) -> bool:
    if jax.process_count() == 1:
      return self._set
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    flags = multihost_utils.process_allgather(np.array(self._set))
    return bool(np.any(flags))

  def restore_handler(self) -> None:
    signal.signal(signal.SIGTERM, self._previous)
