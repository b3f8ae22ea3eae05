"""The training loop on 8 simulated devices: loss falls, resume is exact, SIGTERM."""

import json
import os
import signal

import jax
import numpy as np
import pytest

from trainer import loop
from trainer import train as train_lib


def read_metrics(workdir, kind="train"):
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    records = [json.loads(line) for line in f]
  return [r for r in records if r["kind"] == kind]


@pytest.fixture(scope="module")
def one_go(tmp_path_factory, smoke_data_dir):
  """20 smoke steps in one run: `(workdir, result)`."""
  from configs import smoke  # pylint: disable=import-outside-toplevel
  config = smoke.get_config()
  config.data.prepared_dir = smoke_data_dir
  config.train_steps, config.eval_every, config.checkpoint_every = 20, 1_000, 10
  config.eval.max_batches = 1
  workdir = str(tmp_path_factory.mktemp("one_go"))
  return workdir, loop.train_and_evaluate(config, workdir)


def test_smoke_loss_falls_on_8_devices(one_go):
  workdir, result = one_go
  assert jax.device_count() == 8
  losses = [r["loss"] for r in read_metrics(workdir)]
  assert result["step"] == 20 and not result["preempted"]
  assert len(losses) == 4 and losses[-1] < 0.8 * losses[0], losses
  assert set(result["eval"]) == {"validation", "test"}
  for name in ("recall@10", "ndcg@50", "hit@100", "mrr"):
    assert 0.0 <= result["eval"]["test"][name] <= 1.0
  assert "recall@10" in result["table"]
  assert os.listdir(os.path.join(workdir, "tensorboard"))


def test_ten_plus_restart_plus_ten_equals_twenty(one_go, smoke_config, tmp_path):
  workdir_once, result_once = one_go
  workdir = str(tmp_path)
  smoke_config.train_steps = 10
  first = loop.train_and_evaluate(smoke_config, workdir)
  assert first["step"] == 10
  smoke_config.train_steps = 20
  second = loop.train_and_evaluate(smoke_config, workdir)
  assert second["step"] == 20
  jax.tree.map(np.testing.assert_array_equal, loop.final_params(workdir_once),
               loop.final_params(workdir))
  assert second["final_loss"] == result_once["final_loss"]
  assert second["eval"] == result_once["eval"]
  once = {r["step"]: r["loss"] for r in read_metrics(workdir_once)}
  split = {r["step"]: r["loss"] for r in read_metrics(workdir)}
  assert once == split


def test_sigterm_saves_and_restart_continues(smoke_config, tmp_path, monkeypatch):
  workdir = str(tmp_path)
  real_jit = train_lib.jit_train_step

  def jit_with_sigterm(*args, **kwargs):
    step_fn = real_jit(*args, **kwargs)
    calls = {"n": 0}

    def step(state, batch):
      calls["n"] += 1
      if calls["n"] == 7:  # SIGTERM arrives while step 7 runs.
        os.kill(os.getpid(), signal.SIGTERM)
      return step_fn(state, batch)

    return step

  monkeypatch.setattr(train_lib, "jit_train_step", jit_with_sigterm)
  result = loop.train_and_evaluate(smoke_config, workdir)
  assert result["preempted"] and result["step"] == 7
  assert sorted(int(s) for s in os.listdir(os.path.join(workdir, "checkpoints"))) == [7]
  monkeypatch.setattr(train_lib, "jit_train_step", real_jit)
  result = loop.train_and_evaluate(smoke_config, workdir)
  assert result["step"] == 20 and not result["preempted"]
  steps = [r["step"] for r in read_metrics(workdir)]
  assert steps == [5, 10, 15, 20]


def test_nan_loss_stops_and_keeps_last_good_checkpoint(smoke_config, tmp_path, monkeypatch):
  workdir = str(tmp_path)
  real_jit = train_lib.jit_train_step

  def jit_with_nan(*args, **kwargs):
    step_fn = real_jit(*args, **kwargs)
    calls = {"n": 0}

    def step(state, batch):
      calls["n"] += 1
      state, metrics = step_fn(state, batch)
      if calls["n"] == 13:
        metrics = dict(metrics, loss=np.float32(np.nan), finite=np.bool_(False))
      return state, metrics

    return step

  monkeypatch.setattr(train_lib, "jit_train_step", jit_with_nan)
  with pytest.raises(loop.NonFiniteLossError, match="step 13 are not finite.*checkpoint is step 10"):
    loop.train_and_evaluate(smoke_config, workdir)
  assert sorted(int(s) for s in os.listdir(os.path.join(workdir, "checkpoints"))) == [10]
