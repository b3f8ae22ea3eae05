"""The training loop: the only place that sees the whole config.

config -> checks -> mesh -> prepared data -> sharded state (restored when a
checkpoint exists) -> steps with progress lines, checkpoints, evaluations and
a profiler trace -> final evaluation on validation and test.
"""

from __future__ import annotations

import math
import os
import pathlib

import jax
import numpy as np
import orbax.checkpoint as ocp

from trainer import checkpoint, config_checks, config_schema, data as data_lib, evaluate, logs
from trainer import train as train_lib
from trainer.data import prepare as prepare_lib


class NonFiniteLossError(RuntimeError):
  """The loss or gradient norm became NaN or infinite."""


def prepare_data(config, workdir: str) -> data_lib.PreparedDataset:
  """Prepares `config.data` into its folder (process 0) unless already there."""
  folder = pathlib.Path(config_schema.prepared_folder(config.data.prepared_dir, workdir))
  if jax.process_index() == 0:
    if not prepare_lib.is_prepared(folder, dataset=config.data.dataset, seq_len=config.seq_len):
      logs.say(f"preparing {config.data.dataset} into {folder}")
      summary = data_lib.prepare_dataset(
          config.data.dataset, folder, min_item_count=config.data.min_item_count,
          split=config.data.split, split_options=config.data.split_options.to_dict(),
          source_options=dict(config.data.source_options), seq_lens=(config.seq_len,))
      logs.say(f"prepared {summary['num_users']} users, {summary['num_items']} items, "
               f"{summary['num_interactions']} interactions")
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    multihost_utils.sync_global_devices("trainer data prepared")
  return data_lib.load_prepared(folder)


def _eval_batches(data, config, split: str):
  per_process = config.eval_batch_size // jax.process_count()
  dataset = data_lib.eval_dataset(
      data, split, seq_len=config.seq_len, batch_size=per_process,
      max_exclude=None if config.eval.filter_seen else 1)
  return iter(dataset)


class Trainer:
  """Holds what the loop needs between steps (one run of `train_and_evaluate`)."""

  def __init__(self, config, workdir: str):
    config_checks.check_config(config, workdir=workdir)
    self.config = config
    self.workdir = workdir
    self.mesh = config_checks.make_mesh(config)
    logs.say(config_checks.describe_mesh(self.mesh))
    self.data = prepare_data(config, workdir)
    num_items = self.data.num_items
    vocab_shards = config_checks.vocab_shard_count(config)
    (self.graphdef, tx, schedule, self.state,
     self.shardings) = train_lib.create_sharded_state(
         config, num_items=num_items, mesh=self.mesh, vocab_shards=vocab_shards)
    self.settings = train_lib.StepSettings(
        mesh=self.mesh, token_axes=tuple(config.mesh.token_axes),
        vocab_axis=config.mesh.vocab_axis, num_items=num_items, seed=config.seed,
        backend=config.loss.backend, vocab_reduction=config.loss.vocab_reduction,
        **train_lib.loss_variants(config.loss))
    self.train_step = train_lib.jit_train_step(self.graphdef, tx, schedule, self.settings,
                                               self.shardings)
    eval_settings = self.settings._replace(backend=config.eval.backend)
    self.eval_step = evaluate.jit_eval_step(
        self.graphdef, eval_settings, self.shardings["params"],
        filter_seen=config.eval.filter_seen, ks=tuple(config.eval.ks))
    self.batch_sharding = train_lib.batch_sharding(self.mesh, config.mesh.token_axes)
    self.iterator = data_lib.train_iterator(
        self.data, seq_len=config.seq_len, num_targets=config.num_targets,
        batch_size=config.batch_size // jax.process_count(), seed=config.seed,
        num_threads=config.data.num_threads,
        prefetch_buffer_size=config.data.prefetch_buffer_size)
    self.manager = checkpoint.make_manager(os.path.join(workdir, "checkpoints"),
                                           config.max_checkpoints)
    latest = checkpoint.latest_step(self.manager)
    if latest is not None:
      abstract = train_lib.abstract_state(self.state, self.shardings)
      self.state = checkpoint.restore(self.manager, latest, abstract, self.iterator)
      logs.say(f"resumed from the checkpoint of step {latest}")
    self.writer = logs.MetricWriter(workdir)

  def to_global(self, batch):
    return data_lib.to_global_arrays(batch, self.batch_sharding)

  def step_number(self) -> int:
    return int(jax.device_get(self.state["step"]))

  def save(self, step: int) -> None:
    checkpoint.save(self.manager, step, self.state, self.iterator)

  def run_eval(self, step: int, split: str) -> dict[str, float]:
    metrics = evaluate.evaluate(self.eval_step, self.state["params"],
                                _eval_batches(self.data, self.config, split), self.to_global,
                                max_batches=self.config.eval.max_batches)
    self.writer.write(step, f"eval/{split}", metrics)
    shown = "  ".join(f"{name} {metrics[name]:.4f}" for name in
                      ("recall@10", "ndcg@10", "hit@10", "mrr") if name in metrics)
    logs.say(f"eval {split} step {step}: {shown}  ({int(metrics['num_users'])} users)")
    return metrics


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


def train_and_evaluate(config, workdir: str) -> dict:
  """Trains `config` in `workdir` (resuming when it holds a checkpoint).

  Returns:
    dict with "step" (last step done), "preempted" (bool), "final_loss"
    and, when training completed, "eval" {split: metrics} and "table".

  Raises:
    NonFiniteLossError: the loss or the gradients became NaN or infinite;
      the last checkpoint on disk is the last good one.
  """
  trainer = Trainer(config, workdir)
  preemption = checkpoint.PreemptionFlag()
  step = trainer.step_number()
  progress = logs.Progress(step, config.train_steps, config.batch_size)
  profile_start = config.profile.start_step
  profile_stop = profile_start + config.profile.num_steps if config.profile.num_steps else -1
  tracing = False
  loss = math.nan
  sums = {"tp": 0.0, "fp": 0.0, "fn": 0.0}
  try:
    while step < config.train_steps:
      if preemption.is_set():
        trainer.save(step)
        logs.say(f"SIGTERM: saved the checkpoint of step {step} and stopped")
        return {"step": step, "preempted": True, "final_loss": loss}
      if step == profile_start and profile_stop > 0:
        jax.profiler.start_trace(os.path.join(workdir, "profile"))
        tracing = True
      batch = trainer.to_global(next(trainer.iterator))
      trainer.state, metrics = trainer.train_step(trainer.state, batch)
      metrics = jax.device_get(metrics)
      if not bool(metrics["finite"]):
        raise NonFiniteLossError(non_finite_message(
            float(metrics["loss"]), float(metrics["grad_norm"]), step + 1,
            checkpoint.latest_step(trainer.manager), workdir))
      step += 1
      loss = float(metrics["loss"])
      for name in sums:
        sums[name] += float(metrics[name])
      if tracing and step == profile_stop:
        jax.profiler.stop_trace()
        tracing = False
      if step % config.log_every == 0 or step == config.train_steps:
        text, rates = progress.line(step, loss)
        logs.say(text)
        trainer.writer.write(step, "train", {**_train_metrics(metrics, sums), **rates})
        sums = dict.fromkeys(sums, 0.0)
      if step % config.checkpoint_every == 0 or step == config.train_steps:
        trainer.save(step)
      if step % config.eval_every == 0 and step != config.train_steps:
        trainer.run_eval(step, config.eval.split)
    results = {split: trainer.run_eval(step, split) for split in ("validation", "test")}
    table = evaluate.format_table(results, tuple(config.eval.ks))
    logs.say("evaluation (full catalog" + (", history excluded" if config.eval.filter_seen
                                            else "") + f") at step {step}:\n{table}")
    return {"step": step, "preempted": False, "final_loss": loss, "eval": results,
            "table": table}
  finally:
    if tracing:
      jax.profiler.stop_trace()
    preemption.restore_handler()
    trainer.writer.close()
    trainer.manager.close()


def final_params(workdir: str):
  """The params of the latest checkpoint in `workdir`, as numpy (any topology)."""
  manager = checkpoint.make_manager(os.path.join(workdir, "checkpoints"), None)
  step = manager.latest_step()
  manager.close()
  path = os.path.join(os.path.abspath(workdir), "checkpoints", str(step), "state")
  with ocp.StandardCheckpointer() as checkpointer:
    metadata = checkpointer.metadata(path).item_metadata
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(
        lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), metadata)
    restored = checkpointer.restore(path, target)
  return jax.tree.map(np.asarray, restored["params"])
