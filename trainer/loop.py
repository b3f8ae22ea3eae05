"""The training loop: the only place that sees the whole config.

config -> checks -> WORKDIR/config.json (a resume whose config differs in
keys that change the run stops here) -> mesh -> prepared data -> sharded
state (restored when a checkpoint exists) -> steps with progress lines,
checkpoints, evaluations and a profiler trace -> final evaluation.

Checkpoints and the best one. A checkpoint is saved every `checkpoint_every`
steps, at every periodic evaluation (`eval_every`) and at the last step. The
periodic evaluation (on `eval.split`, at most `eval.max_batches` batches) runs
before the save at its step and its metrics go with that checkpoint; at the
last step one such evaluation runs too (or the full one is reused when
`eval.max_batches` is None), so every ranked checkpoint was measured the same
way. The checkpoint manager keeps the latest `max_checkpoints` and the best
by `checkpoint.best_metric` (`trainer/workdir/checkpoint.py`). Saving is
asynchronous; a resume restores straight into the abstract state (shapes and
shardings, `train.plan_sharded_state`), and only a run without a checkpoint
initialises one. How the step loop avoids host syncs yet never saves the
state of a non-finite step: `train_and_evaluate`.

Final evaluation: validation and test over ALL users (`eval.max_batches`
applies only to the periodic ones) for the last step and for the best
checkpoint (restored for it; the same numbers when the last is the best),
printed as one table with rows "best <split>" and "last <split>".
"""

from __future__ import annotations

import math
import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from trainer import data as data_lib, evaluate, model as model_lib, sampled, train as train_lib
from trainer.workdir import checkpoint, fingerprint, lock as workdir_lock, logs, paths
from trainer.config import keys as config_keys, mesh as config_mesh, saved as saved_config, schema
from trainer.data import ids as data_ids, prepare as prepare_lib


class NonFiniteLossError(RuntimeError):
  """The loss or gradient norm became NaN or infinite."""


def prepare_data(config, workdir: str | os.PathLike) -> data_lib.PreparedDataset:
  """Prepares `config.data` into its folder unless already there; opens it on every process.

  Two ways to get the data to every host:

  - one folder (the default): process 0 prepares it (arrays first, the
    manifest last, so a folder with a manifest is complete) while the others
    wait at a barrier, then every process reads it. The folder
    (`data.prepared_dir`, default WORKDIR/data) must be one that every host
    reads: `gs://...`, a shared disk, or the disk of a single machine.
  - `data.prepare_per_host`: every process prepares its own copy into
    `data.prepared_dir` on its local disk (`{process}` there is replaced by
    the process index; processes of one machine naming the same folder take
    turns under `prepare.host_lock` and prepare it once), then a barrier.
    Preparation is deterministic, so every copy is the same data.

  A folder holding the dataset prepared with the same options (source and
  its options, count filters, split and its options) is reused. The run's own
  `WORKDIR/data` holding another preparation is prepared again; an explicit
  `data.prepared_dir` holding one is an error listing the differences
  (`prepare.needs_preparation`).

  Raises:
    schema.ConfigError: an explicit folder holds other data.
    FileNotFoundError: a process finds no data in the folder process 0
      prepared (it is not on storage that every host reads).
  """
  process = jax.process_index()
  folder = config_keys.prepared_folder(config.data.prepared_dir, workdir, process)

  def prepare_unless_there():
    options = dict(source_options=config.data.source_options.to_dict(),
                   min_item_count=config.data.min_item_count, split=config.data.split,
                   split_options=config.data.split_options.to_dict(),
                   num_shards=config.data.prepare_shards)
    try:
      stale = prepare_lib.needs_preparation(
          folder, explicit=config.data.prepared_dir is not None,
          dataset=config.data.dataset, **options)
    except ValueError as error:
      raise schema.ConfigError(f"config.data.prepared_dir={str(folder)!r}: {error}") \
          from error
    if stale:
      logs.say(f"preparing {config.data.dataset} into {folder}")
      name = ("config.data.prepared_dir" if config.data.prepared_dir is not None
              else "WORKDIR/data")  # named if the folder holds files of another writer
      summary = data_lib.prepare_dataset(config.data.dataset, folder, **options,
                                         seq_lens=(config.seq_len,),
                                         memory_limit=config.data.prepare_memory_limit,
                                         name=name)
      logs.say(f"prepared {summary['num_users']} users, {summary['num_items']} items, "
               f"{summary['num_interactions']} interactions")

  if config.data.prepare_per_host:
    with prepare_lib.host_lock(folder):
      prepare_unless_there()
  elif process == 0:
    prepare_unless_there()
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    multihost_utils.sync_global_devices("trainer data prepared")
  try:
    return data_lib.load_prepared(folder)
  except FileNotFoundError as error:
    if process == 0 or config.data.prepare_per_host:
      raise
    raise FileNotFoundError(
        f"process {process}: no prepared data in {folder}, where process 0 prepared it: the "
        "folder must be on storage every host reads (gs://..., a shared disk), or set "
        "config.data.prepare_per_host=True with a local config.data.prepared_dir") from error


def _eval_batches(data, config, split: str):
  return iter(evaluate.eval_batches(data, split, seq_len=config.seq_len,
                                    global_batch_size=config.eval_batch_size,
                                    filter_seen=config.eval.filter_seen))


def check_config(config, workdir: str, manager, allow_config_change: bool) -> None:
  """On a resume, checks what changed against WORKDIR/config.json (writes nothing).

  Raises:
    schema.ConfigError: resuming would change the run (see
      `trainer.config.saved.check_resume`) and `allow_config_change` is False.
  """
  if checkpoint.latest_step(manager) is not None:
    for line in saved_config.check_resume(workdir, config, process_count=jax.process_count(),
                                          allow_change=allow_config_change):
      logs.say(line)


def record_config(config, workdir: str) -> None:
  """Writes WORKDIR/config.json: only once the state it describes is built or restored.

  So a change that `--allow_config_change` lets through but the checkpoint
  cannot take (another `model.dim`) leaves the run's config as it was.
  """
  if jax.process_index() == 0:
    saved_config.write(workdir, config, process_count=jax.process_count())


class Trainer:
  """Holds what the loop needs between steps (one run of `train_and_evaluate`)."""

  def __init__(self, config, workdir: str, *, allow_config_change: bool = False):
    config_mesh.check_config(config, workdir=workdir)
    self.config = config
    self.workdir = paths.as_path(workdir)
    # A writable directory no other live trainer holds, before anything is written.
    self.lock = workdir_lock.acquire(workdir, process_index=jax.process_index())
    try:
      self.manager = checkpoint.make_manager(self.workdir / "checkpoints",
                                             config.max_checkpoints,
                                             best_metric=config.checkpoint.best_metric,
                                             save_interval_steps=config.checkpoint_every,
                                             cleanup_tmp=True)
    except BaseException:
      self.lock.release()
      raise
    try:
      self._build(config, workdir, allow_config_change)
    except BaseException:
      # Close the manager (its threads) before the error ends the process: an
      # open one logs a traceback from orbax at interpreter shutdown.
      self.manager.close()
      self.lock.release()
      raise

  def _build(self, config, workdir: str, allow_config_change: bool):
    """Everything after the checkpoint manager: config record, mesh, data, steps, state."""
    check_config(config, workdir, self.manager, allow_config_change)
    self.mesh = config_mesh.make_mesh(config)
    logs.say(config_mesh.describe_mesh(self.mesh))
    advice = sampled.recipe_advice(config.loss.kind, bool(config.model.get("item_bias", False)))
    if advice:
      logs.say(advice)
    self.data = prepare_data(config, workdir)
    # No training window or no user to evaluate: one line now, not NaN after training.
    data_lib.check_trainable(self.data, seq_len=config.seq_len,
                             train_windows=config.data.get("train_windows", "all"),
                             eval_splits=(config.eval.split, "test"))
    # Before anything of the catalog's size is allocated (its fingerprint, the state).
    config_mesh.check_state_fits(config, self.data.num_items)
    resuming = checkpoint.latest_step(self.manager) is not None
    # A resume refuses re-prepared data whose items moved rows (fingerprint.py).
    prepared = config_keys.prepared_folder(config.data.prepared_dir, workdir,
                                           jax.process_index())
    data_fingerprint = (fingerprint.check(workdir, self.data.item_ids, prepared) if resuming
                        else fingerprint.of(self.data.item_ids))
    num_items = self.data.num_items
    vocab_shards = config_mesh.vocab_shard_count(config)
    # Shapes and shardings only: the state is built below, restored or initialised.
    plan = train_lib.plan_sharded_state(config, num_items=num_items, mesh=self.mesh,
                                        vocab_shards=vocab_shards)
    self.graphdef, tx, schedule, self.shardings = (plan.graphdef, plan.tx, plan.schedule,
                                                   plan.shardings)
    self.settings = train_lib.step_settings(config, mesh=self.mesh, num_items=num_items)
    # loss.sampler="popularity": the training counts, once, as the step's sampler table.
    tables = train_lib.sampler_tables(
        self.settings, lambda: sampled.global_train_item_counts(self.data),
        model_lib.padded_vocab_size(num_items, vocab_shards))
    self.train_step = train_lib.jit_train_step(self.graphdef, tx, schedule, self.settings,
                                               self.shardings, tables)
    eval_settings = self.settings._replace(backend=config.eval.backend)
    self.eval_step = evaluate.jit_eval_step(
        self.graphdef, eval_settings, self.shardings["params"],
        filter_seen=config.eval.filter_seen, ks=tuple(config.eval.ks))
    self.batch_sharding = train_lib.batch_sharding(self.mesh, config.mesh.token_axes)
    self.iterator = data_lib.train_iterator(
        self.data, seq_len=config.seq_len, num_targets=config.num_targets,
        batch_size=config.batch_size // jax.process_count(), seed=config.seed,
        num_threads=config.data.num_threads,
        prefetch_buffer_size=config.data.prefetch_buffer_size,
        train_windows=config.data.get("train_windows", "all"))
    latest = checkpoint.latest_step(self.manager)
    if latest is None:
      self.state = plan.init()
    else:  # Straight into the target shardings; no fresh state is ever built.
      # The newest checkpoint that reads; a corrupted one is named and skipped.
      self.state, latest = checkpoint.restore_newest(self.manager, plan.abstract,
                                                     self.iterator, say=logs.say)
      logs.say(f"resumed from the checkpoint of step {latest}")
    record_config(config, workdir)
    if jax.process_index() == 0:
      fingerprint.record(workdir, data_fingerprint)
    self.writer = logs.MetricWriter(workdir)

  def to_global(self, batch):
    data_ids.check_int32(batch)  # jit would wrap wider ids (trainer/data/ids.py)
    return data_lib.to_global_arrays(batch, self.batch_sharding)

  def step_number(self) -> int:
    return int(jax.device_get(self.state["step"]))

  def save(self, step: int, metrics: dict[str, float] | None = None, *,
           wait: bool = False) -> None:
    """Checkpoints the current state at `step`, asynchronously unless `wait`.

    The state must be known finite (see `train_and_evaluate`): the caller
    checks the step's flag first.
    """
    # A full disk is one line before orbax writes anything, not its threads' errors.
    checkpoint.check_free_space(self.workdir / "checkpoints", step, self.state,
                                latest=checkpoint.latest_step(self.manager))
    checkpoint.save(self.manager, step, self.state, self.iterator, metrics, wait=wait)

  def run_eval(self, step: int, split: str, *, periodic: bool = True,
               best_step: int | None = None) -> dict[str, float]:
    """Metrics of `split`: at most `eval.max_batches` batches when `periodic`, else every user.

    Args:
      step: the step logged with the metrics.
      split: "validation" or "test".
      periodic: an evaluation during training (`eval.max_batches` applies).
      best_step: evaluate the params of this step's checkpoint instead of the
        current ones (logged as kind "best/<split>" with "checkpoint_step").
    """
    params = self.state["params"] if best_step is None else self.best_params(best_step)
    metrics = evaluate.evaluate(
        self.eval_step, params, _eval_batches(self.data, self.config, split), self.to_global,
        max_batches=self.config.eval.max_batches if periodic else None)
    kind = f"eval/{split}"
    if best_step is not None:
      kind, metrics["checkpoint_step"] = f"best/{split}", float(best_step)
    self.writer.write(step, kind, metrics)
    shown = "  ".join(f"{name} {metrics[name]:.4f}" for name in
                      ("recall@10", "ndcg@10", "hit@10", "mrr") if name in metrics)
    logs.say(f"{kind} step {step}: {shown}  ({int(metrics['num_users'])} users)")
    return metrics

  def best_params(self, step: int):
    """The params of the checkpoint of `step`, on the train state's shardings."""
    abstract = train_lib.abstract_state(self.state["params"], self.shardings["params"])
    return checkpoint.restore_params(self.workdir / "checkpoints", step, abstract)

  def final_evaluation(self, step: int) -> dict:
    """Saves the last checkpoint (ranked) and evaluates it and the best over every user.

    Returns:
      {"last": {split: metrics}, "best": {split: metrics} or None,
       "best_step": int or None}.
    """
    config = self.config
    last = {}
    if config.eval.max_batches is None:  # The periodic evaluation is the full one.
      last[config.eval.split] = self.run_eval(step, config.eval.split, periodic=False)
      ranked = last[config.eval.split]
    else:
      ranked = self.run_eval(step, config.eval.split)
    self.save(step, ranked)
    for split in ("validation", "test"):
      if split not in last:
        last[split] = self.run_eval(step, split, periodic=False)
    # Every save committed before the best is looked up (its metrics are read
    # from the committed checkpoint) or read back.
    self.manager.wait_until_finished()
    best_step = checkpoint.best_step(self.manager)
    if best_step is None or best_step == step:
      return {"last": last, "best": None if best_step is None else last, "best_step": best_step}
    best = {split: self.run_eval(step, split, periodic=False, best_step=best_step)
            for split in ("validation", "test")}
    return {"last": last, "best": best, "best_step": best_step}


class EarlyStopping:
  """`checkpoint.patience`: training stops at the evaluation that finds
  `checkpoint.best_metric` not risen in `patience` evaluations (`patience *
  eval_every` steps since its best). The best is read back from the kept
  checkpoints' metrics on a resume, so a run that stopped early stays stopped
  when run again (it is evaluated again, not trained on).
  """

  def __init__(self, config, best: tuple[int, float] | None):
    self.patience = config.checkpoint.patience
    self.metric = config.checkpoint.best_metric
    self.window = None if self.patience is None else self.patience * config.eval_every
    self.best = best  # (step, value) of the best evaluation so far

  @classmethod
  def resume(cls, config, manager: ocp.CheckpointManager) -> EarlyStopping:
    step = checkpoint.best_step(manager) if config.checkpoint.patience is not None else None
    best = None if step is None else (
        step, checkpoint.metric_fn(config.checkpoint.best_metric)(manager.metrics(step)))
    return cls(config, best)

  def update(self, step: int, metrics: dict[str, float]) -> bool:
    """Takes the evaluation at `step`; whether training stops there."""
    if self.window is None:
      return False
    value = checkpoint.metric_fn(self.metric)(metrics)
    if self.best is None or value > self.best[1]:
      self.best = (step, value)
    return self.stopped(step)

  def stopped(self, step: int) -> bool:
    return self.window is not None and self.best is not None and (
        step - self.best[0] >= self.window)

  def reason(self, step: int) -> str:
    best_step, value = self.best
    return (f"early stopping at step {step}: validation {self.metric} has not risen since step "
            f"{best_step} ({value:.4f}), {self.patience} evaluations (checkpoint.patience)")


def non_finite_message(loss: float, grad_norm: float, step: int, last_checkpoint: int | None,
                       workdir: str) -> str:
  """The message of `NonFiniteLossError`: the values, the step, where to restart from."""
  if last_checkpoint is None:
    restart = (f"No checkpoint was saved yet (none in {workdir}/checkpoints), so a restart "
               "begins at step 0")
  else:
    restart = f"The last good checkpoint is step {last_checkpoint} in {workdir}/checkpoints"
  return (f"loss {loss} and gradient norm {grad_norm} at step {step} are not finite; "
          f"stopping. {restart}; lower config.optimizer.learning_rate or "
          "config.optimizer.clip_norm and restart")


def _train_metrics(metrics, sums):
  """Adds confusion-count precision and recall to the logged step metrics."""
  out = {name: float(value) for name, value in metrics.items() if name != "finite"}
  tp, fp, fn = sums["tp"], sums["fp"], sums["fn"]
  out["precision"] = tp / (tp + fp) if tp + fp else 0.0
  out["recall"] = tp / (tp + fn) if tp + fn else 0.0
  return out


COUNTS = ("tp", "fp", "fn")  # Summed on device between log steps.


def _zero_counts() -> dict:
  return dict.fromkeys(COUNTS, np.float32(0.0))


@jax.jit
def _add_counts(sums: dict, metrics: dict) -> dict:
  """`sums + metrics` for the confusion counts, on device (one dispatch, no host read)."""
  return {name: sums[name] + metrics[name] for name in COUNTS}


class NewestStep:
  """The metrics of the newest step, left on device until they are needed.

  `check()` reads only the step's `finite` flag (one scalar) and raises
  `NonFiniteLossError` for a non-finite step; the loop calls it one step
  late (after the next step is dispatched), and at once before anything
  that keeps the state (a checkpoint, an evaluation, the end of training).
  """

  def __init__(self, manager, workdir):
    self._manager, self._workdir = manager, workdir
    self.step, self._metrics, self._checked = None, None, True

  def push(self, step: int, metrics: dict) -> None:
    """The metrics (device arrays) of `step`, just dispatched; the previous ones are checked."""
    assert self._checked, f"step {self.step} was never checked"
    self.step, self._metrics, self._checked = step, metrics, False

  def check(self) -> None:
    """Waits for the newest step; raises NonFiniteLossError if it was not finite."""
    if self._checked:
      return
    if not bool(jax.device_get(self._metrics["finite"])):
      values = jax.device_get({name: self._metrics[name] for name in ("loss", "grad_norm")})
      raise NonFiniteLossError(non_finite_message(
          float(values["loss"]), float(values["grad_norm"]), self.step,
          checkpoint.latest_step(self._manager), self._workdir))
    self._checked = True

  def read(self) -> dict:
    """The newest step's metrics on the host (checked first)."""
    self.check()
    return jax.device_get(self._metrics)

  def loss(self) -> float:
    """The newest step's loss (checked first); NaN when no step ran."""
    if self._metrics is None:
      return math.nan
    self.check()
    return float(jax.device_get(self._metrics["loss"]))


def train_and_evaluate(config, workdir: str, *, allow_config_change: bool = False) -> dict:
  """Trains `config` in `workdir` (resuming when it holds a checkpoint).

  The step loop never waits for the device without need. Each iteration
  dispatches step s+1, then reads the `finite` flag of step s (done, or
  about to be: the device already has step s+1 queued) — the one host read
  per step, one step late. Everything else stays on device: the confusion
  counts are summed there (`_add_counts`) and, with the newest step's
  metrics, read only at log steps. Checkpoints are asynchronous: `save`
  returns after orbax's device-to-host copy and the write runs in the
  background while training goes on.

  Non-finite steps. A NaN or infinite loss or gradient norm at step s stops
  the run (NonFiniteLossError naming step s, its values and the last good
  checkpoint) when step s is checked, at the latest while step s+1 runs.
  The state of a step is never kept before its flag is checked: before a
  checkpoint (periodic, evaluation, preemption or last), an evaluation and
  the end of training, the newest step is checked at once (`NewestStep.check`,
  which also waits for it). As every earlier step was checked in an
  earlier iteration, a saved state descends only from finite steps; the
  state after a bad step (and the step computed from it) is dropped.

  Preemption: `checkpoint.PreemptionNotice` at the top of every step (JAX's
  preemption sync point under `jax.distributed`, a local SIGTERM flag in a
  single process); the state is checked, saved, the save waited for, and
  the run returns. During the final evaluation (no step left to save at), or
  at a second SIGTERM, the process stops at once (status 143); a SIGTERM that
  finds the main thread stuck in the runtime ends the process after
  `preemption.STOP_GRACE_SECONDS` (`trainer/workdir/preemption.py`). Saves due
  every `checkpoint_every` steps come from
  `manager.should_save(step)` (orbax's FixedIntervalPolicy and
  PreemptionCheckpointingPolicy). The run waits for every pending save before
  a final evaluation reads the best checkpoint back and before it returns or
  raises (`manager.close()`).

  Args:
    config: the run's ConfigDict.
    workdir: the run's directory.
    allow_config_change: resume even when the config differs from the run's
      WORKDIR/config.json in keys that change the run.

  Returns:
    dict with "step" (last step done), "preempted" (bool), "final_loss"
    and, when training completed, "eval" {split: metrics} of the last step,
    "best" ({"step", "eval": {split: metrics}} of the best checkpoint, or
    None when no checkpoint was ranked) and "table"; every final metric is
    over all users.

  Raises:
    NonFiniteLossError: the loss or the gradients became NaN or infinite;
      the last checkpoint on disk is the last good one.
    schema.ConfigError: a resume that would change the run.
  """
  trainer = Trainer(config, workdir, allow_config_change=allow_config_change)
  preemption = checkpoint.PreemptionNotice(combine_every=config.log_every)
  step = trainer.step_number()
  progress = logs.Progress(step, config.train_steps, config.batch_size)
  profile_start = config.profile.start_step
  profile_stop = profile_start + config.profile.num_steps if config.profile.num_steps else -1
  tracing = False
  newest = NewestStep(trainer.manager, workdir)
  sums = _zero_counts()
  watch = EarlyStopping.resume(config, trainer.manager)
  if step < config.train_steps and watch.stopped(step):
    logs.say(watch.reason(step) + "; stopped before this process: evaluating only")
  try:
    while step < config.train_steps and not watch.stopped(step):
      if preemption.reached(step):
        newest.check()
        trainer.save(step, wait=True)
        logs.say(f"SIGTERM: saved the checkpoint of step {step} and stopped "
                 f"(preemption notice: {preemption.mode})")
        return {"step": step, "preempted": True, "final_loss": newest.loss()}
      if step == profile_start and profile_stop > 0:
        jax.profiler.start_trace(trainer.workdir / "profile")  # a gs:// path too
        tracing = True
      batch = trainer.to_global(next(trainer.iterator))
      trainer.state, metrics = trainer.train_step(trainer.state, batch)
      newest.check()  # Step `step`, one step late: step + 1 is queued behind it.
      step += 1
      newest.push(step, metrics)
      sums = _add_counts(sums, {name: metrics[name] for name in COUNTS})
      if tracing and step == profile_stop:
        jax.profiler.stop_trace()
        tracing = False
      if step % config.log_every == 0 or step == config.train_steps:
        values = newest.read()  # The host reads metrics here only.
        text, rates = progress.line(step, float(values["loss"]))
        logs.say(text)
        trainer.writer.write(step, "train",
                             {**_train_metrics(values, jax.device_get(sums)), **rates})
        sums = _zero_counts()
      if step == config.train_steps:
        newest.check()
        break  # final_evaluation ranks and saves the last checkpoint.
      evaluate_now = step % config.eval_every == 0
      if evaluate_now or trainer.manager.should_save(step):
        newest.check()  # Never evaluate or checkpoint the state of a non-finite step.
        metrics = trainer.run_eval(step, config.eval.split) if evaluate_now else None
        trainer.save(step, metrics)
        if metrics is not None and watch.update(step, metrics):  # the loop ends here
          logs.say(watch.reason(step))
          trainer.writer.write(step, "early_stop", {"best_step": watch.best[0],
                                                    config.checkpoint.best_metric: watch.best[1]})
    preemption.disarm("the final evaluation")  # no step left to save at: a SIGTERM stops
    final = trainer.final_evaluation(step)
    rows = {f"best {split}": metrics for split, metrics in (final["best"] or {}).items()}
    rows.update({f"last {split}": metrics for split, metrics in final["last"].items()})
    table = evaluate.format_table(rows, tuple(config.eval.ks))
    best = ("no best checkpoint" if final["best_step"] is None else
            f"best = step {final['best_step']} by {config.eval.split} "
            f"{config.checkpoint.best_metric}")
    logs.say("evaluation (full catalog" + (", history excluded" if config.eval.filter_seen
                                            else "") + f", every user; {best}, last = step "
             f"{step}):\n{table}")
    return {"step": step, "preempted": False, "final_loss": newest.loss(), "eval": final["last"],
            "best": None if final["best_step"] is None else {
                "step": final["best_step"], "eval": final["best"]},
            "table": table}
  finally:
    if tracing:
      jax.profiler.stop_trace()
    preemption.close()
    trainer.writer.close()
    trainer.manager.close()
    trainer.lock.release()


def final_params(workdir: str | os.PathLike):
  """The params of the latest checkpoint in `workdir`, as numpy (any topology)."""
  checkpoints = paths.as_path(workdir) / "checkpoints"
  manager = checkpoint.make_manager(checkpoints, None)
  step = manager.latest_step()
  manager.close()
  path = checkpoints / str(step) / "state"
  with ocp.StandardCheckpointer() as checkpointer:
    metadata = checkpointer.metadata(path).item_metadata
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(
        lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), metadata)
    restored = checkpointer.restore(path, target)
  return jax.tree.map(np.asarray, restored["params"])
