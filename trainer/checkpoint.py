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
"""

from __future__ import annotations

import os
import signal

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp


def make_manager(directory: str | os.PathLike, max_to_keep: int) -> ocp.CheckpointManager:
  """A CheckpointManager over `directory` with items "state" and "data"."""
  options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep, create=True, enable_async_checkpointing=False)
  return ocp.CheckpointManager(os.path.abspath(directory), options=options,
                               item_names=("state", "data"))


def save(manager: ocp.CheckpointManager, step: int, state, iterator) -> None:
  """Saves state and iterator position at `step` (no-op if `step` exists)."""
  if step in manager.all_steps():
    return
  manager.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state),
      data=grain.checkpoint.CheckpointSave(iterator)), force=True)
  manager.wait_until_finished()


def latest_step(manager: ocp.CheckpointManager) -> int | None:
  return manager.latest_step()


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
