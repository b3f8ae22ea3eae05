"""Reliability: real `python -m trainer.main` processes killed and restarted.

Every test compares the final parameters of an interrupted and restarted run
with those of one uninterrupted run of the same config (module fixture),
bit for bit: on CPU with dropout off the steps are deterministic, and a
resume restores the state and the grain iterator position exactly.

- kill -9 at a random step after the first checkpoint: the restart resumes
  from the last committed checkpoint.
- kill -9 in the middle of an asynchronous save (its commit made slow): the
  uncommitted `<step>.orbax-checkpoint-tmp` folder is never restored, the
  previous checkpoint is, and the restarted trainer removes the leftover.
- SIGTERM under `jax.distributed` (one process with coordinator flags, one
  device): the preemption notice comes from JAX's preemption sync point; the
  run saves, exits 0, and the restart continues exactly.
- SIGTERM to one of two processes (2 x 4 devices): both save the same step
  and exit 0.

Each runs two to three trainer processes (10-30 s each on 2 CPU cores), so
all are marked slow.
"""

import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest

from trainer import loop
from trainer.workdir import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN_STEPS, CHECKPOINT_EVERY = 200, 20

# Commits of step folders past FIRST_FAST_STEP wait `SLOW_COMMIT_SECONDS` (run in
# the trainer process before `trainer.main`): a save that stays uncommitted.
SLOW_COMMIT = textwrap.dedent("""
    import asyncio, os, runpy, sys
    from orbax.checkpoint._src.path import atomicity
    real_finalize = atomicity.AtomicRenameTemporaryPath.finalize
    first_fast_step = int(os.environ["FIRST_FAST_STEP"])

    async def finalize(self):
      name = self._final_path.name
      if name.isdigit() and int(name) > first_fast_step:
        await asyncio.sleep(float(os.environ["SLOW_COMMIT_SECONDS"]))
      await real_finalize(self)

    atomicity.AtomicRenameTemporaryPath.finalize = finalize
    sys.argv[0] = "trainer.main"
    runpy.run_module("trainer.main", run_name="__main__")
    """)


def _command(workdir, data_dir, *extra):
  return ["-m", "trainer.main", "--config=configs/smoke.py", f"--workdir={workdir}",
          f"--config.data.prepared_dir={data_dir}", "--config.model.dropout_rate=0",
          f"--config.train_steps={TRAIN_STEPS}", f"--config.checkpoint_every={CHECKPOINT_EVERY}",
          "--config.eval_every=100", "--config.log_every=25", "--config.eval.max_batches=1",
          "--config.profile.num_steps=0", *extra]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  """8 simulated devices and a compilation cache shared by the trainer processes."""
  cache = str(tmp_path_factory.mktemp("reliability_jax_cache"))
  return dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
              JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
              JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")


def _run(args, env, timeout=300):
  done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=timeout, check=False)
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
  return done.stdout


def _start(args, env, log_path):
  log = open(log_path, "w", encoding="utf-8")  # pylint: disable=consider-using-with
  return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=log,
                          stderr=subprocess.STDOUT, text=True)


def _wait_for(predicate, process, log_path, what, timeout=240):
  deadline = time.time() + timeout
  while not predicate():
    assert process.poll() is None, f"exited ({process.returncode}) before {what}:\n" + \
        log_path.read_text()[-3000:]
    assert time.time() < deadline, f"no {what} after {timeout} s"
    time.sleep(0.01)


def _committed_steps(checkpoints):
  return sorted(int(name) for name in os.listdir(checkpoints) if name.isdigit()) \
      if os.path.isdir(checkpoints) else []


def _assert_same_params(want, workdir):
  got = loop.final_params(str(workdir))
  jax.tree.map(np.testing.assert_array_equal, want, got)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, smoke_data_dir, env):
  """The final params of one uninterrupted run."""
  workdir = tmp_path_factory.mktemp("uninterrupted")
  _run(_command(workdir, smoke_data_dir), env)
  assert _committed_steps(workdir / "checkpoints")[-1] == TRAIN_STEPS
  return loop.final_params(str(workdir))


@pytest.mark.slow
def test_kill_9_at_a_random_step_then_restart_is_exact(reference, smoke_data_dir, env, tmp_path):
  seed = int(os.environ.get("RELIABILITY_SEED", time.time_ns() % 1_000_000))
  delay = random.Random(seed).uniform(0.0, 2.5)
  workdir, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoints"
  process = _start(_command(workdir, smoke_data_dir), env, tmp_path / "first.log")
  _wait_for(lambda: _committed_steps(checkpoints), process, tmp_path / "first.log",
            "a committed checkpoint")
  time.sleep(delay)
  assert process.poll() is None, f"seed {seed}: finished before the kill"
  process.send_signal(signal.SIGKILL)
  assert process.wait(timeout=60) == -signal.SIGKILL
  last = _committed_steps(checkpoints)[-1]
  assert CHECKPOINT_EVERY <= last < TRAIN_STEPS, (seed, os.listdir(checkpoints))
  output = _run(_command(workdir, smoke_data_dir), env)
  assert f"resumed from the checkpoint of step {last}" in output, (seed, output[-2000:])
  assert not [name for name in os.listdir(checkpoints) if "tmp" in name]
  _assert_same_params(reference, workdir)


@pytest.mark.slow
def test_kill_9_during_an_asynchronous_save_keeps_the_previous(reference, smoke_data_dir, env,
                                                               tmp_path):
  workdir, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoints"
  slow_env = dict(env, FIRST_FAST_STEP=str(CHECKPOINT_EVERY), SLOW_COMMIT_SECONDS="600")
  process = _start(["-c", SLOW_COMMIT, *_command(workdir, smoke_data_dir)[2:]], slow_env,
                   tmp_path / "first.log")
  partial = checkpoints / f"{2 * CHECKPOINT_EVERY}.orbax-checkpoint-tmp"
  _wait_for(partial.exists, process, tmp_path / "first.log", "the second save")
  time.sleep(0.5)  # Training goes on while the save is uncommitted.
  assert process.poll() is None
  process.send_signal(signal.SIGKILL)
  assert process.wait(timeout=60) == -signal.SIGKILL
  names = sorted(os.listdir(checkpoints))
  assert names == [str(CHECKPOINT_EVERY), partial.name], names
  assert sorted(os.listdir(partial)) and not (partial / "commit_success.txt").exists()
  reader = checkpoint.make_manager(checkpoints, None)  # As evaluate/export would see it.
  assert checkpoint.latest_step(reader) == CHECKPOINT_EVERY
  reader.close()
  output = _run(_command(workdir, smoke_data_dir), env)
  assert f"resumed from the checkpoint of step {CHECKPOINT_EVERY}" in output, output[-2000:]
  assert not partial.exists()
  assert not [name for name in os.listdir(checkpoints) if "tmp" in name]
  _assert_same_params(reference, workdir)


def _free_port() -> int:
  with socket.socket() as probe:
    probe.bind(("localhost", 0))
    return probe.getsockname()[1]


@pytest.mark.slow
def test_sigterm_at_jax_preemption_sync_point_then_restart_is_exact(smoke_data_dir, env,
                                                                     tmp_path):
  """On one device: under jax.distributed the CPU collectives are gloo's, whose sums
  round differently from the in-process ones, so 8 devices would not compare exactly.

  JAX agrees on the sync point asynchronously (its coordination service), so
  the interrupted run has no step limit in sight (a short run could end before
  the agreed step on a loaded machine); the resumed run and the uninterrupted
  one then stop 25 steps after the saved step (a constant schedule: the step
  limit does not change the trajectory)."""
  one_device = {key: value for key, value in env.items() if key != "XLA_FLAGS"}
  mesh = "--config.mesh.shape=(1,)"
  workdir = tmp_path / "run"

  def distributed(steps):
    return _command(workdir, smoke_data_dir, mesh, f"--config.train_steps={steps}",
                    f"--coordinator_address=localhost:{_free_port()}", "--num_processes=1",
                    "--process_id=0")

  log_path = tmp_path / "first.log"
  process = _start(distributed(100_000), one_device, log_path)
  _wait_for(lambda: log_path.exists() and "step 25/" in log_path.read_text(), process,
            log_path, "the first progress line")
  process.send_signal(signal.SIGTERM)
  assert process.wait(timeout=120) == 0, log_path.read_text()[-3000:]
  output = log_path.read_text()
  saved = _committed_steps(workdir / "checkpoints")[-1]
  assert (f"SIGTERM: saved the checkpoint of step {saved} and stopped (preemption notice: "
          "sync_point)") in output, output[-3000:]
  output = _run(distributed(saved + 25), one_device)
  assert f"resumed from the checkpoint of step {saved}" in output
  _run(_command(tmp_path / "uninterrupted", smoke_data_dir, mesh,
                f"--config.train_steps={saved + 25}"), one_device)
  _assert_same_params(loop.final_params(str(tmp_path / "uninterrupted")), workdir)


@pytest.mark.slow
def test_sigterm_to_one_of_two_processes_stops_both_at_one_step(smoke_data_dir, env, tmp_path):
  """2 processes x 4 devices: only process 1 gets SIGTERM; JAX's preemption sync point
  makes both save the same step together and exit 0 (no collective per step)."""
  four_devices = dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=4")
  port, workdir = _free_port(), tmp_path / "run"
  logs_ = [tmp_path / f"process_{i}.log" for i in range(2)]
  processes = [_start(_command(workdir, smoke_data_dir, "--config.train_steps=100000",
                               f"--coordinator_address=localhost:{port}", "--num_processes=2",
                               f"--process_id={i}"), four_devices, logs_[i]) for i in range(2)]
  try:
    _wait_for(lambda: "step 25/" in logs_[0].read_text(), processes[0], logs_[0],
              "the first progress line")
    processes[1].send_signal(signal.SIGTERM)
    codes = [process.wait(timeout=180) for process in processes]
  finally:
    for process in processes:
      if process.poll() is None:
        process.kill()
  assert codes == [0, 0], [log.read_text()[-2000:] for log in logs_]
  saved = _committed_steps(workdir / "checkpoints")[-1]
  assert (f"SIGTERM: saved the checkpoint of step {saved} and stopped (preemption notice: "
          "sync_point)") in logs_[0].read_text()
  data_files = os.listdir(workdir / "checkpoints" / str(saved) / "data")
  assert {"process_0-of-2.json", "process_1-of-2.json"} <= set(data_files)
