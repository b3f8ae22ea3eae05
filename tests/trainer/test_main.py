"""Config checks and the command line: bad configs fail at start, explained."""

import os
import subprocess
import sys

import pytest

from configs import (base, ml1m, ml1m_best, ml1m_best_bce, ml1m_cpu, ml1m_sasrec_plus, smoke,
                     synthetic_1m, yambda50m_v6e8)
from trainer.config import mesh as config_mesh, schema

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REQUIRED = ("seed", "train_steps", "batch_size", "seq_len", "num_targets", "mesh", "model",
            "optimizer", "data", "loss", "eval_every", "checkpoint_every", "log_every")


@pytest.mark.parametrize("module", [base, smoke, ml1m, ml1m_best, ml1m_best_bce, ml1m_cpu,
                                    ml1m_sasrec_plus, synthetic_1m, yambda50m_v6e8])
def test_every_config_is_complete_and_valid(module):
  config = module.get_config()
  for field in REQUIRED:
    assert field in config, field
  assert "backend" in config.loss and module.__doc__
  devices = 1
  for size in config.mesh.shape:
    devices *= size
  config_mesh.check_config(config, device_count=devices)


def test_yambda_config_is_the_paper_setting():
  config = yambda50m_v6e8.get_config()
  assert (config.batch_size, config.seq_len, config.num_targets) == (64, 256, 8)
  assert config.model.dtype == "bfloat16" and tuple(config.mesh.shape) == (2, 4)


@pytest.mark.parametrize("change,message", [
    (lambda c: setattr(c.mesh, "shape", (4,)),
     r"config.mesh.shape=\(4,\): sizes whose product is the 8 devices present"),
    (lambda c: setattr(c.data, "dataset", "ml-10m"),
     "config.data.dataset='ml-10m': one of 'ml-1m', 'ml-100k', 'yambda', 'synthetic'"),
    (lambda c: setattr(c.loss, "backend", "cuda"), "config.loss.backend='cuda': one of 'auto'"),
    (lambda c: setattr(c, "batch_size", 12),
     "config.batch_size=12: a multiple of the 8 shards of the token axes"),
    (lambda c: setattr(c.mesh, "token_axes", ("batch",)),
     r"config.mesh.token_axes=\('batch',\): a non-empty tuple of names of"),
    (lambda c: setattr(c.mesh, "vocab_axis", "model"),
     "config.mesh.vocab_axis='model': None or a name of"),
    (lambda c: setattr(c.model, "dtype", "float16"), "config.model.dtype='float16': one of"),
    (lambda c: setattr(c, "train_steps", 0), "config.train_steps=0: an integer >= 1"),
])
def test_bad_config_is_explained(change, message):
  config = smoke.get_config()
  change(config)
  with pytest.raises(schema.ConfigError, match="^" + message):
    config_mesh.check_config(config, device_count=8)


def test_main_rejects_a_bad_mesh_before_any_work(tmp_path):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu")
  result = subprocess.run(
      [sys.executable, "-m", "trainer.main", "--config=configs/smoke.py",
       f"--workdir={tmp_path}", "--config.mesh.shape=(4,)"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert result.returncode == 2, result.stderr[-2000:]
  assert result.stderr.splitlines() == [
      "bad config: config.mesh.shape=(4,): sizes whose product is the 8 devices present "
      "(jax.device_count()); (4,) covers 4"]
  assert not os.path.exists(tmp_path / "checkpoints")


def test_main_explains_missing_data_in_one_line(tmp_path):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu")
  empty = tmp_path / "empty_folder"  # exists (the config check passes), holds no parquet
  empty.mkdir()
  result = subprocess.run(
      [sys.executable, "-m", "trainer.main", "--config=configs/yambda50m_v6e8.py",
       f"--workdir={tmp_path / 'work'}", f"--config.data.source_options.path={empty}"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert result.returncode == 2, result.stderr[-2000:]
  assert f"data unavailable: {empty / 'listens.parquet'} not found" in result.stderr
  assert "Traceback" not in result.stderr


def test_a_failed_start_closes_the_checkpoint_manager(tmp_path, monkeypatch):
  """Missing data after the manager exists: it is closed before the error leaves (an open
  one's threads log a traceback from orbax when the process ends)."""
  from trainer import loop  # pylint: disable=import-outside-toplevel
  from trainer.workdir import checkpoint  # pylint: disable=import-outside-toplevel
  from trainer.data import sources  # pylint: disable=import-outside-toplevel
  real_make_manager, closed = checkpoint.make_manager, []

  def make_manager(*args, **kwargs):
    manager = real_make_manager(*args, **kwargs)
    real_close = manager.close
    manager.close = lambda: (closed.append(True), real_close())
    return manager

  def no_data(config, workdir):
    assert not closed  # the manager is open while data is prepared
    raise sources.DataError("listens.parquet not found")

  monkeypatch.setattr(checkpoint, "make_manager", make_manager)
  monkeypatch.setattr(loop, "prepare_data", no_data)
  with pytest.raises(sources.DataError, match="listens.parquet"):
    loop.Trainer(smoke.get_config(), str(tmp_path / "work"))
  assert closed == [True]


def test_main_rejects_a_missing_yambda_folder_before_any_work(tmp_path):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu")
  missing = tmp_path / "no_such_folder"
  result = subprocess.run(
      [sys.executable, "-m", "trainer.main", "--config=configs/yambda50m_v6e8.py",
       f"--workdir={tmp_path / 'work'}", f"--config.data.source_options.path={missing}"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert result.returncode == 2, result.stderr[-2000:]
  assert result.stderr.splitlines() == [
      f"bad config: config.data.source_options.path='{missing}': an existing folder holding "
      f"the Yambda parquet files (nothing is prepared in {tmp_path / 'work' / 'data'} yet, "
      "so the raw files are read)"]
  assert not os.path.exists(tmp_path / "work")


@pytest.mark.parametrize("overrides,line", [
    # None reaches the config: the rule about it speaks (it was "'None': None or an integer").
    (["--config.loss.kind=gbce", "--config.loss.num_negatives=None"],
     "bad config: config.loss.num_negatives=None: an integer >= 1 with config.loss.kind='gbce'"),
    # Accepted as None (the mesh's own line comes next, so the value parsed).
    (["--config.max_checkpoints=None", "--config.loss.pos_weight=None",
      "--config.mesh.shape=(4,)"],
     "bad config: config.mesh.shape=(4,): sizes whose product is the 8 devices present "
     "(jax.device_count()); (4,) covers 4"),
    # A bare tuple of names is two names (it was the one name '(data,model)').
    (["--config.mesh.axis_names=(data,model)", "--config.mesh.shape=(2,4)",
      "--config.mesh.token_axes=data,", "--config.mesh.vocab_axis=model",
      "--config.batch_size=9"],
     "bad config: config.batch_size=9: a multiple of the 2 shards of the token axes"),
])
def test_overrides_take_none_and_bare_tuples_as_meant(tmp_path, overrides, line):
  """Issue 41: `None` could not be given for keys documented as None-able, and
  `--config.mesh.axis_names=(data,model)` became one name."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu")
  result = subprocess.run(
      [sys.executable, "-m", "trainer.main", "--config=configs/smoke.py",
       f"--workdir={tmp_path}", *overrides],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert result.returncode == 2, result.stderr[-2000:]
  lines = result.stderr.splitlines()
  assert len(lines) == 1 and lines[0].startswith(line), lines
