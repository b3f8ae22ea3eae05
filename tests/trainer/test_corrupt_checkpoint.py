"""A truncated or corrupted checkpoint: named by its step, and the previous one used (issue 32).

One smoke run of 20 steps keeps the checkpoints of steps 10 and 20; each test
damages a copy. A resume falls back to step 10 with a warning and moves step
20 aside; `evaluate` names step 20 and offers `--step=10`; when nothing
restores, one error names every step and nothing is moved.
"""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from trainer import loop
from trainer.workdir import checkpoint
from trainer.commands import evaluate as evaluate_command

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(smoke_data_dir, train_steps=20):
  from configs import smoke  # pylint: disable=import-outside-toplevel
  config = smoke.get_config()
  config.data.prepared_dir = smoke_data_dir
  config.train_steps, config.eval_every, config.checkpoint_every = train_steps, 1_000, 10
  config.max_checkpoints, config.eval.max_batches = 2, 1
  config.profile.num_steps = 0
  return config


@pytest.fixture(scope="module")
def trained(tmp_path_factory, smoke_data_dir):
  workdir = str(tmp_path_factory.mktemp("corrupt"))
  loop.train_and_evaluate(_config(smoke_data_dir), workdir)
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["10", "20"]
  return workdir


def _damaged_copy(workdir, tmp_path, steps):
  copy = str(tmp_path / "run")
  shutil.copytree(workdir, copy)
  for step in steps:
    state = os.path.join(copy, "checkpoints", str(step), "state")
    for folder, _, files in os.walk(state):
      for name in files:  # every file of the state cut to half its length
        path = os.path.join(folder, name)
        with open(path, "r+b") as file:
          file.truncate(os.path.getsize(path) // 2)
  return copy


def test_resume_falls_back_to_the_previous_checkpoint(trained, smoke_data_dir, tmp_path,
                                                      capsys):
  copy = _damaged_copy(trained, tmp_path, [20])
  result = loop.train_and_evaluate(_config(smoke_data_dir, train_steps=30), copy)
  out = capsys.readouterr().out
  assert "warning: the checkpoint of step 20 cannot be restored (" in out
  assert "resumed from the checkpoint of step 10" in out
  assert result["step"] == 30
  assert os.listdir(os.path.join(copy, checkpoint.CORRUPTED_DIR)) == ["20"]
  assert "30" in os.listdir(os.path.join(copy, "checkpoints"))


def test_nothing_restores_is_one_error_and_nothing_moves(trained, smoke_data_dir, tmp_path):
  copy = _damaged_copy(trained, tmp_path, [10, 20])
  with pytest.raises(checkpoint.CheckpointError,
                     match=r"^no checkpoint in .* restores into this run's state \(step 20: "
                     r".*; step 10: .*\)") as excinfo:
    loop.train_and_evaluate(_config(smoke_data_dir, train_steps=30), copy)
  assert "\n" not in str(excinfo.value)
  assert sorted(os.listdir(os.path.join(copy, "checkpoints"))) == ["10", "20"]
  assert not os.path.exists(os.path.join(copy, checkpoint.CORRUPTED_DIR))


def test_evaluate_names_the_step_and_offers_the_previous(trained, tmp_path, capsys):
  copy = _damaged_copy(trained, tmp_path, [20])
  status = evaluate_command.main(["evaluate", f"--workdir={copy}", "--checkpoint=latest"])
  lines = [line for line in capsys.readouterr().err.splitlines()
           if line.startswith("bad config")]
  assert status == 2 and len(lines) == 1, lines
  assert lines[0].startswith(f"bad config: the checkpoint of step 20 in {copy}")
  assert lines[0].endswith("pass --step=10 for the previous one")


def _scrambled_copy(workdir, tmp_path, step):
  """A copy whose OCDBT manifests of `step` are random bytes (TensorStore's DATA_LOSS)."""
  copy = str(tmp_path / "scrambled")
  shutil.copytree(workdir, copy)
  state = os.path.join(copy, "checkpoints", str(step), "state")
  for folder, _, files in os.walk(state):
    for name in files:
      if name == "manifest.ocdbt":
        path = os.path.join(folder, name)
        with open(path, "r+b") as file:
          file.write(os.urandom(os.path.getsize(path)))
  return copy


@pytest.mark.parametrize("step", [20, 10])
def test_a_scrambled_checkpoint_is_one_line_without_tensorstore_noise(trained, tmp_path, step):
  """Issue 41: ~100 lines of "RuntimeError: Event loop is closed" tracebacks followed the
  command's one line: TensorStore's reads, still pending when the restore failed, call
  back into orbax's closed loop when their futures are collected (forced here)."""
  copy = _scrambled_copy(trained, tmp_path, step)
  script = textwrap.dedent(f"""
      import gc, sys, time
      sys.path.insert(0, {ROOT!r})
      from trainer.commands import evaluate
      for _ in range(3):  # each time, the reads left pending differ
        status = evaluate.main(["evaluate", "--workdir={copy}", "--step={step}"])
        for _ in range(3):
          gc.collect()
          time.sleep(0.1)
      sys.exit(status)
      """)
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu")
  done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                        timeout=180, check=False)
  lines = done.stderr.splitlines()
  assert done.returncode == 2 and len(lines) == 3, done.stderr[-3000:]
  assert all(line.startswith(f"bad config: the checkpoint of step {step} in {copy}")
             for line in lines), lines
