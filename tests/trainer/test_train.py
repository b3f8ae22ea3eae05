"""The training loop on 8 simulated devices: loss falls, resume is exact, SIGTERM."""

import json
import os
import signal
import subprocess
import sys
import time

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
  config.profile.start_step, config.profile.num_steps = 3, 2
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
  assert os.listdir(os.path.join(workdir, "profile"))


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


def test_yambda_train_step_exports_for_tpu():
  """The paper-setting step (876,939 items, 64 x 256 x 8, bf16, 2 x 4 mesh,
  Pallas kernels) lowers for TPU from this CPU host, from abstract arrays."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from configs import yambda50m_v6e8  # pylint: disable=import-outside-toplevel
  from trainer.config import mesh as config_mesh  # pylint: disable=import-outside-toplevel
  config = yambda50m_v6e8.get_config()
  config.loss.backend = "pallas_tpu"
  config_mesh.check_config(config, device_count=8)
  mesh = config_mesh.make_mesh(config)
  num_items, vocab_shards = 876_939, config_mesh.vocab_shard_count(config)
  tx = train_lib.make_optimizer(config.optimizer, config.train_steps)
  schedule = train_lib.learning_rate_schedule(config.optimizer, config.train_steps)

  def new_model():
    return train_lib.make_model(config.model, num_items=num_items, seq_len=config.seq_len,
                                vocab_shards=vocab_shards, seed=0)

  graphdef = nnx.graphdef(nnx.eval_shape(new_model))
  abstract = jax.eval_shape(lambda: train_lib.init_state(new_model(), tx)[1])
  shardings = train_lib.state_shardings(abstract, mesh, config.mesh.vocab_axis)
  settings = train_lib.StepSettings(
      mesh=mesh, token_axes=tuple(config.mesh.token_axes), vocab_axis=config.mesh.vocab_axis,
      num_items=num_items, seed=0, backend="pallas_tpu", vocab_reduction="sum")
  step = train_lib.jit_train_step(graphdef, tx, schedule, settings, shardings)
  batch_sharding = train_lib.batch_sharding(mesh, config.mesh.token_axes)
  b, n, l = config.batch_size, config.seq_len, config.num_targets
  batch = {
      "inputs": jax.ShapeDtypeStruct((b, n), jnp.int32, sharding=batch_sharding),
      "targets": jax.ShapeDtypeStruct((b, n, l), jnp.int32, sharding=batch_sharding),
      "weights": jax.ShapeDtypeStruct((b, n), jnp.float32, sharding=batch_sharding),
  }
  exported = jax.export.export(step, platforms=("tpu",))(
      train_lib.abstract_state(abstract, shardings), batch)
  assert exported.platforms == ("tpu",)
  assert "tpu_custom_call" in exported.mlir_module()


@pytest.mark.slow
def test_sigterm_to_a_running_process_then_restart(tmp_path, smoke_data_dir):
  """A real `python -m trainer.main` gets SIGTERM mid-run, exits 0, and resumes."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  command = [sys.executable, "-m", "trainer.main", "--config=configs/smoke.py",
             f"--workdir={tmp_path}", "--config.train_steps=100000",
             f"--config.data.prepared_dir={smoke_data_dir}", "--config.eval.max_batches=1"]
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
  process = subprocess.Popen(command, cwd=root, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
  metrics = tmp_path / "metrics.jsonl"
  deadline = time.time() + 120
  while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
    assert time.time() < deadline and process.poll() is None
    time.sleep(0.2)
  process.send_signal(signal.SIGTERM)
  output, _ = process.communicate(timeout=120)
  assert process.returncode == 0, output[-2000:]
  saved = max(int(s) for s in os.listdir(tmp_path / "checkpoints"))
  assert f"SIGTERM: saved the checkpoint of step {saved} and stopped" in output
  result = subprocess.run(command[:-3] + [f"--config.train_steps={saved + 5}"] + command[-2:],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  assert f"resumed from the checkpoint of step {saved}" in result.stdout
  assert f"step {saved + 5}/{saved + 5}" in result.stdout


def test_loss_variants_of_the_config_reach_the_loss(monkeypatch):
  """config.loss's variants travel through StepSettings into `sharded_cut_bce`."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from configs import smoke  # pylint: disable=import-outside-toplevel
  config = smoke.get_config()
  config.loss.label_smoothing, config.loss.focal_gamma = 0.1, 2.0
  config.loss.one_pass = False
  variants = train_lib.loss_variants(config.loss)
  assert variants == {"pos_weight": None, "label_smoothing": 0.1, "logit_soft_cap": None,
                      "focal_gamma": 2.0, "focal_alpha": None, "one_pass": False}
  seen = {}

  def fake_loss(*args, **kwargs):
    del args
    seen.update(kwargs)
    return np.float32(0.0), None

  monkeypatch.setattr(train_lib.cutbce_sharding, "sharded_cut_bce", fake_loss)
  model = train_lib.make_model(config.model, num_items=10, seq_len=4, vocab_shards=1, seed=0)
  graphdef, params = nnx.split(model)
  settings = train_lib.StepSettings(mesh=None, token_axes=("data",), vocab_axis=None,
                                    num_items=10, seed=0, backend="xla", vocab_reduction="sum",
                                    **variants)
  batch = {"inputs": np.zeros((2, 4), np.int32), "targets": np.zeros((2, 4, 1), np.int32),
           "weights": np.ones((2, 4), np.float32)}
  train_lib._loss_and_stats(nnx.to_pure_dict(params), graphdef, batch, jax.random.key(0),
                            settings)
  assert {name: seen[name] for name in variants} == variants


def test_each_process_prepares_its_copy_or_reads_process_0s(smoke_config, tmp_path,
                                                            monkeypatch):
  """As process 1: with `data.prepare_per_host` it prepares `{process}` -> its own folder;
  without, it only reads, and a folder process 0 did not fill names both ways out."""
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  smoke_config.data.prepare_per_host = True
  smoke_config.data.prepared_dir = str(tmp_path / "prepared-{process}")
  data = loop.prepare_data(smoke_config, str(tmp_path / "run"))
  assert str(data.path) == str(tmp_path / "prepared-1") and data.num_items == 300
  assert not (tmp_path / "prepared-0").exists()
  smoke_config.data.prepare_per_host = False
  smoke_config.data.prepared_dir = str(tmp_path / "elsewhere")
  with pytest.raises(FileNotFoundError, match=r"^process 1: no prepared data in .*elsewhere, "
                     r"where process 0 prepared it: .*prepare_per_host=True"):
    loop.prepare_data(smoke_config, str(tmp_path / "run"))


def test_clip_norm_none_is_plain_adam():
  # A huge first gradient, then a small one: clipping scales the first down
  # and changes the second update; clip_norm=None leaves AdamW alone.
  import ml_collections  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  from configs import base  # pylint: disable=import-outside-toplevel
  params = {"w": np.zeros(3, np.float32)}
  grads = [{"w": np.array([300.0, -400.0, 0.0], np.float32)},
           {"w": np.array([0.1, 0.2, -0.3], np.float32)}]

  def updates(optimizer_config):
    tx = train_lib.make_optimizer(optimizer_config, 10)
    state, out = tx.init(params), []
    for g in grads:
      u, state = tx.update(g, state, params)
      out.append(np.asarray(u["w"]))
    return out

  config = base.get_config().optimizer
  config.warmup_steps, config.schedule = 0, "constant"
  unclipped = ml_collections.ConfigDict(config.to_dict())
  unclipped.clip_norm = None
  plain = optax.adamw(train_lib.learning_rate_schedule(config, 10), b1=config.b1, b2=config.b2,
                      weight_decay=config.weight_decay)
  state, want = plain.init(params), []
  for g in grads:
    u, state = plain.update(g, state, params)
    want.append(np.asarray(u["w"]))
  for got, expected in zip(updates(unclipped), want):
    np.testing.assert_allclose(got, expected, rtol=1e-6)
  assert not np.allclose(updates(config)[1], want[1], rtol=1e-3)


def test_early_stopping_stops_where_the_metric_stopped_rising_and_stays_stopped(
    smoke_config, tmp_path, monkeypatch):
  """checkpoint.patience = 2, evaluations every 2 steps: validation NDCG@10 last rises
  at step 4, so training stops at step 8 (two evaluations later), the best checkpoint is
  step 4's, and running the command again evaluates without training on."""
  from benchmarks import ml1m_quality  # pylint: disable=import-outside-toplevel
  workdir = str(tmp_path)
  smoke_config.eval_every, smoke_config.checkpoint_every = 2, 2
  smoke_config.checkpoint.best_metric = "ndcg@10"
  smoke_config.checkpoint.patience = 2
  scripted = {2: 0.1, 4: 0.3, 6: 0.2, 8: 0.25, 10: 0.9}  # 10 is never reached
  real_eval = loop.Trainer.run_eval

  def run_eval(self, step, split, *, periodic=True, best_step=None):
    if periodic and best_step is None:  # the periodic ones: the scripted metric
      return {**real_eval(self, step, split), "ndcg@10": scripted[step]}
    return real_eval(self, step, split, periodic=periodic, best_step=best_step)

  monkeypatch.setattr(loop.Trainer, "run_eval", run_eval)
  result = loop.train_and_evaluate(smoke_config, workdir)
  assert result["step"] == 8 and not result["preempted"]
  assert result["best"]["step"] == 4
  assert [r["best_step"] for r in read_metrics(workdir, "early_stop")] == [4]
  assert max(r["step"] for r in read_metrics(workdir)) <= 8
  assert ml1m_quality.finished(workdir, smoke_config.train_steps)

  again = loop.train_and_evaluate(smoke_config, workdir)
  assert again["step"] == 8 and again["best"]["step"] == 4
  assert max(r["step"] for r in read_metrics(workdir)) <= 8
  assert max(int(s) for s in os.listdir(os.path.join(workdir, "checkpoints"))) == 8


def test_patience_needs_a_metric_to_watch(smoke_config, tmp_path):
  from trainer.config import schema  # pylint: disable=import-outside-toplevel
  smoke_config.checkpoint.best_metric = None
  smoke_config.checkpoint.patience = 3
  with pytest.raises(schema.ConfigError, match="checkpoint.patience"):
    loop.train_and_evaluate(smoke_config, str(tmp_path))
