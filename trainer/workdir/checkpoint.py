"""Checkpoints: train state and grain iterator state saved together with orbax.

Each checkpoint `WORKDIR/checkpoints/<step>/` holds two items:

  state: the train state (`trainer.train.TrainState`), restored onto the
         current mesh from abstract arrays carrying the target shardings;
  data:  the grain training iterator's position (one file per process), so a
         resumed run reads exactly the batches an uninterrupted one would.

`latest_step` + `restore` give auto-resume; `restore` reads each array
straight onto its target sharding, so a resumed run never holds a fresh
state beside the restored one.

Asynchronous saving (orbax's default, as its authors intend): `save` returns
once the arrays are copied to host memory (orbax copies device arrays to the
host before it returns, so the next step may donate the state), and a
background thread writes them. Orbax writes a step into
`<step>.orbax-checkpoint-tmp/` and renames it to `<step>/` only once
every item is written (the commit; orbax's `atomicity` module has the
variants for other file systems), so a process killed mid-write leaves a
temporary folder that `latest_step` never lists and the previous checkpoint
stays the latest; the trainer's manager deletes such leftovers when it
starts (`cleanup_tmp=True`). Old checkpoints are deleted only after the new
one is committed. `save(..., wait=True)` (or `manager.wait_until_finished()`)
returns once the checkpoint is committed: the trainer waits on preemption,
before restoring the best checkpoint, and before it exits (`manager.close()`).

When to save: `make_manager(..., save_interval_steps=n)` gives orbax the
decision policy `AnySavePolicy([FixedIntervalPolicy(n),
PreemptionCheckpointingPolicy()])`, so `manager.should_save(step)` is true
every n steps and at JAX's preemption sync point (see `PreemptionNotice`);
orbax's `InitialSavePolicy` (a save at the first step) is left out.

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

import contextlib
import gc
import logging
import math
import os
import sys
import threading
import warnings

import grain
import jax
import orbax.checkpoint as ocp

from trainer.workdir import paths
from trainer.workdir.preemption import PreemptionNotice  # noqa: F401  (where the loop finds it)
from trainer.config.schema import ConfigError


def metric_fn(best_metric: str):
  """`metrics -> float`: the value of `best_metric` (-inf when a checkpoint lacks it)."""

  def value(metrics) -> float:
    return float(metrics.get(best_metric, -math.inf))

  return value


def make_manager(directory: str | os.PathLike, max_to_keep: int | None,
                 best_metric: str | None = None, *, save_interval_steps: int | None = None,
                 cleanup_tmp: bool = False) -> ocp.CheckpointManager:
  """An asynchronous CheckpointManager over `directory` with items "state" and "data".

  Args:
    directory: the checkpoints folder (`WORKDIR/checkpoints`).
    max_to_keep: the latest checkpoints kept (None: all).
    best_metric: also keep the checkpoint with the highest value of this
      rank metric among those saved with metrics (None: latest ones only).
    save_interval_steps: `manager.should_save(step)` is true every this many
      steps and at the preemption sync point (None: only at the latter;
      `save` always saves).
    cleanup_tmp: delete the temporary folders of saves that never committed
      (a killed process) when the manager starts. Only the training run's
      manager does; a reader (evaluate, export) must not, as a run may be
      writing into one.
  """
  policies = ocp.checkpoint_managers
  save_policies = [policies.PreemptionCheckpointingPolicy()]
  if save_interval_steps is not None:
    save_policies.insert(0, policies.FixedIntervalPolicy(save_interval_steps))
  common = dict(create=True, enable_async_checkpointing=True, cleanup_tmp_directories=cleanup_tmp,
                save_decision_policy=policies.AnySavePolicy(save_policies))
  if best_metric is None:
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, **common)
  else:
    best = metric_fn(best_metric)
    options = ocp.CheckpointManagerOptions(
        best_fn=best, best_mode="max", keep_checkpoints_without_metrics=False,
        preservation_policy=policies.AnyPreservationPolicy([
            policies.LatestN(n=max_to_keep),
            policies.BestN(get_metric_fn=best, reverse=False, n=1,
                           keep_checkpoints_without_metrics=False)]), **common)
  manager = ocp.CheckpointManager(paths.as_path(directory), options=options,
                                  item_names=("state", "data"))
  if cleanup_tmp:
    _await_tmp_cleanup(manager)
  return manager


def _await_tmp_cleanup(manager: ocp.CheckpointManager) -> None:
  """Returns once the manager's start-up deletion of temporary folders is done.

  Orbax runs that deletion in a background thread and waits for it only in
  `save`; `close()` does not. A run that stops before its first save (bad
  data, a config error) would exit with the thread still running, and orbax
  logs a traceback ("cannot schedule new futures after interpreter shutdown")
  at interpreter shutdown. Waiting here costs one listing of the folder. The
  future is orbax's private attribute, read with a default so that a release
  that renames it only loses the wait.
  """
  pending = getattr(manager, "_cleanup_tmp_directory_future", None)
  if pending is not None:
    pending.result()


def save(manager: ocp.CheckpointManager, step: int, state, iterator,
         metrics: dict[str, float] | None = None, *, wait: bool = True) -> None:
  """Saves state and iterator position at `step` (no save if `step` exists).

  Args:
    manager: from `make_manager`.
    step: the step number.
    state: the train state.
    iterator: the grain training iterator.
    metrics: the periodic evaluation's metrics at `step`, ranked for the best
      checkpoint (None: a checkpoint that is never "best").
    wait: return once the checkpoint is committed on disk (also when `step`
      was saved before and is still being written). False: return once the
      state is copied to host memory and the iterator position taken; the
      write goes on in the background (a previous one still running is
      waited for first, by orbax).
  """
  if step not in manager.all_steps():
    manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=grain.checkpoint.CheckpointSave(iterator)), force=True,
        metrics=None if metrics is None else {k: float(v) for k, v in metrics.items()})
  if wait:
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
  path = paths.as_path(directory) / str(step) / "state"
  with quiet_native_errors(), ocp.PyTreeCheckpointer() as checkpointer:
    restored = checkpointer.restore(path, args=ocp.args.PyTreeRestore(
        item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
        partial_restore=True))
  return restored["params"]


class _QuietStderr:
  """sys.stderr less the tracebacks of late TensorStore callbacks.

  A failed read of a damaged checkpoint leaves TensorStore reads pending;
  each calls back into orbax's event loop after orbax closed it, from a
  native thread, during the restore and at any later time (when its future
  is collected), and prints a "RuntimeError: Event loop is closed"
  traceback through sys.stderr: ~100 lines after the command's one line
  (issue 41). The threads interleave their writes, so each thread's text is
  held apart: a traceback is kept until its last line and dropped when that
  line is the closed loop's; anything else is passed on whole. The main
  thread writes straight through. Set up for a restore; kept for the rest of
  the process once one failed (the callbacks come late), else taken down.
  """

  _HEADING = "Traceback (most recent call last):"
  _CLOSED = "RuntimeError: Event loop is closed"

  def __init__(self, stream):
    self._stream = stream
    self._lock = threading.Lock()
    self._text: dict[int, str] = {}  # thread -> its written text not yet a whole line
    self._traceback: dict[int, list[str]] = {}  # thread -> the traceback it is writing

  def write(self, text: str) -> int:
    if threading.current_thread() is threading.main_thread():
      return self._stream.write(text)
    thread = threading.get_ident()
    with self._lock:
      *lines, self._text[thread] = (self._text.pop(thread, "") + text).split("\n")
      for line in lines:
        self._line(thread, line)
    return len(text)

  def _line(self, thread: int, line: str) -> None:
    held = self._traceback.get(thread)
    if held is None and line != self._HEADING:
      self._stream.write(line + "\n")
    elif held is None or line.startswith((" ", "\t")):
      self._traceback.setdefault(thread, []).append(line)
    else:  # the exception's line ends the traceback
      del self._traceback[thread]
      if line != self._CLOSED:
        self._stream.write("\n".join(held + [line]) + "\n")

  def flush(self) -> None:
    with self._lock:  # what other threads began and left unfinished, outside a traceback
      for thread, text in list(self._text.items()):
        if text and thread not in self._traceback and not self._HEADING.startswith(text):
          self._stream.write(self._text.pop(thread))
    self._stream.flush()

  def __getattr__(self, name):  # encoding, fileno, isatty, ...: the stream's own
    return getattr(self._stream, name)


_NEVER_AWAITED = r"coroutine '.*' was never awaited"


def _unretrieved_reads(record: logging.LogRecord) -> bool:
  """Drops asyncio's "Future/Task exception was never retrieved" (with the read's
  traceback) for the reads a failed restore abandoned; everything else passes."""
  return "exception was never retrieved" not in str(record.msg).partition("\n")[0]


@contextlib.contextmanager
def quiet_native_errors():
  """A failed block (a damaged checkpoint's restore) leaves no TensorStore noise on stderr.

  The failure itself is raised, and named in one line, by the caller
  (`_QuietStderr` drops the late callbacks' tracebacks from then on, filters
  asyncio's reports of the reads and coroutines it abandoned).
  """
  if isinstance(sys.stderr, _QuietStderr) and getattr(quiet_native_errors, "kept", False):
    yield  # one failed already: the filter stays
    return
  stream, asyncio_logger = sys.stderr, logging.getLogger("asyncio")
  sys.stderr = _QuietStderr(stream)
  # From the start: the reads a failing restore abandons may be collected (and
  # reported) before its exception reaches this block.
  asyncio_logger.addFilter(_unretrieved_reads)
  try:
    with warnings.catch_warnings():
      warnings.filterwarnings("ignore", _NEVER_AWAITED, RuntimeWarning)
      try:
        yield
      except BaseException:
        quiet_native_errors.kept = True
        gc.collect()  # the failed reads call back as their futures are collected
        raise
  except BaseException:
    warnings.filterwarnings("ignore", _NEVER_AWAITED, RuntimeWarning)  # for the late ones
    raise
  if getattr(quiet_native_errors, "kept", False):
    return
  asyncio_logger.removeFilter(_unretrieved_reads)
  if isinstance(sys.stderr, _QuietStderr):
    sys.stderr = stream


def restore(manager: ocp.CheckpointManager, step: int, abstract_state, iterator):
  """Restores the state onto the shardings of `abstract_state`; `iterator` in place.

  Returns:
    The restored train state.
  """
  with quiet_native_errors():  # a damaged one: the caller names it, without the noise
    restored = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        data=grain.checkpoint.CheckpointRestore(iterator)))
  return restored.state


class DiskFullError(Exception):
  """Too little free space for the next checkpoint: one line, checked before writing."""


def check_free_space(directory, step: int, state, *, latest: int | None) -> None:
  """Raises `DiskFullError` when the file system of `directory` cannot hold a checkpoint.

  A checkpoint holds every array of the state once (orbax writes them
  uncompressed), so it needs up to the state's bytes, plus 1 MiB of metadata
  and the iterator's position. Checked by a single process on a local
  folder only (processes of a multi-host run would have to agree to skip a
  save; object storage has no free-space figure). Without this check a full
  disk shows as hundreds of lines of orbax and tensorstore errors from its
  writer threads, the cause somewhere among them.
  """
  if paths.is_remote(directory) or jax.process_count() > 1:
    return
  import shutil  # pylint: disable=import-outside-toplevel
  folder = os.fspath(directory)
  while not os.path.isdir(folder):
    folder = os.path.dirname(folder) or "."
  free = shutil.disk_usage(folder).free
  need = sum(int(leaf.nbytes) for leaf in jax.tree.leaves(state)) + 2**20
  if free < need:
    kept = (f"the checkpoint of step {latest} is whole" if latest is not None
            else "no checkpoint was saved yet")
    raise DiskFullError(
        f"no space for the checkpoint of step {step}: {free / 2**20:,.1f} MiB free on the "
        f"file system of {directory}, a checkpoint needs up to {need / 2**20:,.1f} MiB; "
        f"{kept}: free space (or lower max_checkpoints) and resume")


class CheckpointError(Exception):
  """No checkpoint of the run can be restored: one line naming each step tried."""


CORRUPTED_DIR = "corrupted_checkpoints"  # beside checkpoints/: what a fallback set aside


def cause(error: BaseException) -> str:
  """The first line of an orbax / tensorstore error, short enough for one line."""
  text = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
  text = f"{type(error).__name__}: {text}" if text else type(error).__name__
  return text if len(text) <= 200 else text[:197] + "..."


def stored_param_shapes(directory: str | os.PathLike, step: int) -> dict[str, tuple] | None:
  """`{key path: shape}` of the params saved in the checkpoint of `step`, from its metadata.

  None when the metadata cannot be read (a damaged checkpoint: the restore
  that follows names it).
  """
  path = paths.as_path(directory) / str(step) / "state"
  handler = ocp.StandardCheckpointHandler()  # the checkpointer warns on a step's item folder
  try:
    with quiet_native_errors():  # a damaged one: no TensorStore noise
      params = handler.metadata(path)["params"]
  except Exception:  # pylint: disable=broad-except  (orbax raises many kinds)
    return None
  finally:
    handler.close()
  return _shapes(params)


def _shapes(tree) -> dict[str, tuple]:
  def name(part):
    return str(getattr(part, "key", getattr(part, "idx", getattr(part, "name", part))))

  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {"/".join(name(part) for part in path): tuple(leaf.shape) for path, leaf in leaves
          if hasattr(leaf, "shape")}


ITEM_TABLE = "item_embedding/embedding"  # the `[V_padded, D]` table (trainer/model.py)


def check_param_shapes(directory: str | os.PathLike, step: int, abstract_params) -> None:
  """Refuses, in one line, a checkpoint whose params have other shapes than this run's.

  Run before a restore, so that changed data or a changed model is named for
  what it is, not reported as an orbax shape error or taken for a corrupted
  checkpoint. An item table with another row count means the prepared data
  holds another number of items than the run was trained on (raw data
  changed, then prepared again).

  Raises:
    ConfigError: the item table's rows, or another param's shape, differ.
  """
  stored = stored_param_shapes(directory, step)
  if stored is None:
    return
  wanted = _shapes(abstract_params)
  table = (stored.get(ITEM_TABLE), wanted.get(ITEM_TABLE))
  if None not in table and table[0][0] != table[1][0]:
    raise ConfigError(
        f"the checkpoint of step {step} holds an item table of {table[0][0]:,} rows and this "
        f"run's prepared data has {table[1][0]:,} (item count changed from {table[0][0]:,} to "
        f"{table[1][0]:,}, rows rounded up to the vocab shards): the raw data changed since "
        "the run was prepared. Restore the raw data the run was prepared from, or start a new "
        "workdir")
  for key in sorted(set(stored) | set(wanted)):
    if stored.get(key) != wanted.get(key):
      raise ConfigError(
          f"the checkpoint of step {step} holds params/{key} of shape {stored.get(key)} and "
          f"this run's config builds {wanted.get(key)}: the model's shape changed since the "
          "checkpoint; resume with the run's config (WORKDIR/config.json) or start a new "
          "workdir")


def restore_newest(manager: ocp.CheckpointManager, abstract_state, iterator, *,
                   say=print) -> tuple[object, int]:
  """Restores the newest checkpoint that reads; returns `(state, step)`.

  A checkpoint whose files are truncated or corrupted (orbax commits a step
  only once it is written, so this is damage after the fact: a disk error, a
  copy cut short) is named with its step, and the previous one is tried. When
  an older one restores, the unreadable newer ones are moved to
  WORKDIR/corrupted_checkpoints/<step> (kept for inspection, out of the
  manager's way, so training can save those steps again) and a warning says
  so. With several processes nothing is moved (they would race): the error
  names the step to set aside by hand.

  Raises:
    ConfigError: a checkpoint's params have other shapes than `abstract_state`'s
      (`check_param_shapes`: the item count or the model changed).
    CheckpointError: no checkpoint restores (each step and its cause named;
      a config whose shapes differ from the checkpoints' fails here too, and
      then nothing is moved).
  """
  directory = paths.as_path(manager.directory)
  failed = []
  for step in sorted(manager.all_steps(), reverse=True):
    # Other shapes are another run's data or model, not damage: one line, nothing moved.
    check_param_shapes(directory, step, abstract_state["params"])
    try:
      state = restore(manager, step, abstract_state, iterator)
    except Exception as error:  # pylint: disable=broad-except  (orbax raises many kinds)
      failed.append((step, cause(error)))
      if jax.process_count() > 1:
        raise CheckpointError(
            f"the checkpoint of step {step} in {directory} cannot be restored "
            f"({failed[-1][1]}); move {directory / str(step)} aside to resume from the "
            "previous one") from None
      say(f"warning: the checkpoint of step {step} cannot be restored ({failed[-1][1]}); "
          "trying the previous one")
      continue
    if failed:
      aside = directory.parent / CORRUPTED_DIR
      aside.mkdir(parents=True, exist_ok=True)
      for bad, _ in failed:
        (directory / str(bad)).rename(aside / str(bad))
      manager.reload()
      say(f"warning: resumed from the checkpoint of step {step}, the newest that restores; "
          f"unreadable step(s) {', '.join(str(bad) for bad, _ in failed)} moved to {aside}")
    return state, step
  tried = "; ".join(f"step {bad}: {why}" for bad, why in failed)
  raise CheckpointError(f"no checkpoint in {directory} restores into this run's state "
                        f"({tried}): corrupted files, or a config whose shapes differ "
                        "from the checkpoints'")
