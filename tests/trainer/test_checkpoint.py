"""Checkpoints: state and grain iterator together, restored onto the mesh; asynchronous
saves; the ways a preemption notice arrives."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import grain
import jax
import jax.numpy as jnp
import numpy as np
from orbax.checkpoint._src.path import async_path, atomicity

from trainer import data as data_lib
from trainer.workdir import checkpoint
from trainer.config import mesh as config_mesh
from trainer import train as train_lib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _iterator(data_dir):
  return data_lib.train_iterator(data_lib.load_prepared(data_dir), seq_len=16, num_targets=2,
                                 batch_size=4, seed=1, num_threads=1,
                                 prefetch_buffer_size=1)


def test_state_and_iterator_roundtrip(smoke_config, tmp_path):
  from trainer import loop  # pylint: disable=import-outside-toplevel
  smoke_config.mesh.axis_names, smoke_config.mesh.shape = ("data", "model"), (2, 4)
  smoke_config.mesh.vocab_axis = "model"
  data = loop.prepare_data(smoke_config, str(tmp_path))
  mesh = config_mesh.make_mesh(smoke_config)
  plan = train_lib.plan_sharded_state(smoke_config, num_items=data.num_items, mesh=mesh,
                                      vocab_shards=4)
  state = plan.init()
  iterator = _iterator(smoke_config.data.prepared_dir)
  for _ in range(3):
    next(iterator)
  manager = checkpoint.make_manager(tmp_path / "checkpoints", max_to_keep=2)
  checkpoint.save(manager, 3, state, iterator)
  expected_batch = next(iterator)

  fresh = _iterator(smoke_config.data.prepared_dir)
  # Restored straight into the abstract state: shapes, dtypes and shardings only.
  assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(plan.abstract))
  restored = checkpoint.restore(manager, checkpoint.latest_step(manager), plan.abstract, fresh)
  manager.close()
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               state, restored)
  table = restored["params"]["item_embedding"]["embedding"]
  assert table.sharding.spec == jax.sharding.PartitionSpec("model", None)
  assert table.shape[0] % 4 == 0 and table.shape[0] >= data.num_items
  batch = next(fresh)
  for key in expected_batch:
    np.testing.assert_array_equal(batch[key], expected_batch[key])


def _slow_commits(monkeypatch, seconds):
  """Orbax's commit (the rename of `<step>.orbax-checkpoint-tmp`) waits `seconds` first."""
  real_finalize = atomicity.AtomicRenameTemporaryPath.finalize

  async def finalize(self):
    await asyncio.sleep(seconds)
    await real_finalize(self)

  monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", finalize)


def test_save_is_asynchronous_and_committed_by_rename(tmp_path, monkeypatch):
  _slow_commits(monkeypatch, 1.0)
  manager = checkpoint.make_manager(tmp_path, 2, save_interval_steps=10)
  state = {"x": jnp.arange(1000.0)}
  iterator = iter(grain.MapDataset.range(4).to_iter_dataset())
  start = time.perf_counter()
  checkpoint.save(manager, 10, state, iterator, wait=False)
  assert time.perf_counter() - start < 0.9  # Returned before the commit.
  assert sorted(os.listdir(tmp_path)) == ["10.orbax-checkpoint-tmp"]
  assert manager.is_saving_in_progress() and checkpoint.latest_step(manager) == 10
  reader = checkpoint.make_manager(tmp_path, None)  # Another process's view: not committed.
  assert checkpoint.latest_step(reader) is None
  reader.close()
  checkpoint.save(manager, 10, state, iterator)  # Already saved: only waits.
  assert sorted(os.listdir(tmp_path)) == ["10"] and not manager.is_saving_in_progress()
  # save_interval_steps: orbax's FixedIntervalPolicy (and the preemption sync
  # point), without its InitialSavePolicy.
  assert [step for step in range(1, 31) if manager.should_save(step)] == [20, 30]
  manager.close()


def test_uncommitted_save_is_never_restored_and_the_trainer_removes_it(tmp_path):
  manager = checkpoint.make_manager(tmp_path, None)
  iterator = iter(grain.MapDataset.range(4).to_iter_dataset())
  checkpoint.save(manager, 5, {"x": jnp.zeros(3)}, iterator)
  manager.close()
  partial = tmp_path / "10.orbax-checkpoint-tmp"  # What a process killed mid-save leaves.
  (partial / "state").mkdir(parents=True)
  (partial / "state" / "half_written").write_bytes(b"\0" * 10)
  reader = checkpoint.make_manager(tmp_path, None)
  assert checkpoint.latest_step(reader) == 5 and reader.all_steps() == [5]
  reader.close()
  assert partial.exists()  # Readers leave it: a live run may be writing there.
  trainer_manager = checkpoint.make_manager(tmp_path, None, cleanup_tmp=True)
  assert checkpoint.latest_step(trainer_manager) == 5
  checkpoint.save(trainer_manager, 6, {"x": jnp.ones(3)}, iterator)
  trainer_manager.close()
  assert sorted(os.listdir(tmp_path)) == ["5", "6"]


def test_trainer_manager_returns_after_removing_leftovers(tmp_path, monkeypatch):
  """Orbax deletes leftovers in a thread that `close()` never waits for; a run
  that stopped before its first save then logged a traceback at exit."""
  real_rmtree = async_path.rmtree

  async def slow_rmtree(path):
    await asyncio.sleep(0.5)
    await real_rmtree(path)

  monkeypatch.setattr(async_path, "rmtree", slow_rmtree)
  partial = tmp_path / "10.orbax-checkpoint-tmp"
  (partial / "state").mkdir(parents=True)
  manager = checkpoint.make_manager(tmp_path, None, cleanup_tmp=True)
  assert not partial.exists()
  manager.close()


def test_preemption_notice_local_sigterm():
  previous = signal.getsignal(signal.SIGTERM)
  notice = checkpoint.PreemptionNotice()
  try:
    assert notice.mode == "local"  # One process, no jax.distributed.
    assert not notice.reached(0)
    os.kill(os.getpid(), signal.SIGTERM)
    assert notice.reached(1) and notice.reached(2)
  finally:
    notice.close()
  assert signal.getsignal(signal.SIGTERM) is previous


def test_preemption_notice_combined_only_every_n_steps(monkeypatch):
  """Several processes without JAX's preemption service: flags combined every n steps."""
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  gathered = []

  def allgather(flag):
    gathered.append(bool(flag))
    return np.array([flag, False])  # This process's flag and another one's.

  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(multihost_utils, "process_allgather", allgather)
  notice = checkpoint.PreemptionNotice(combine_every=5)
  try:
    assert notice.mode == "combined"
    assert [notice.reached(step) for step in range(1, 11)] == [False] * 10
    assert gathered == [False, False]  # Steps 5 and 10 only.
    os.kill(os.getpid(), signal.SIGTERM)
    assert [notice.reached(step) for step in range(11, 16)] == [False] * 4 + [True]
  finally:
    notice.close()


def _free_port() -> int:
  with socket.socket() as probe:
    probe.bind(("localhost", 0))
    return probe.getsockname()[1]


def test_preemption_notice_at_jax_sync_point():
  """Under jax.distributed (one process here) SIGTERM reaches JAX's preemption notifier,
  not a Python handler, and `reached` is true at exactly one step after it."""
  script = textwrap.dedent(f"""
      import json, os, signal, sys, time
      sys.path.insert(0, {ROOT!r})
      import jax
      jax.distributed.initialize(coordinator_address="localhost:{_free_port()}",
                                 num_processes=1, process_id=0)
      from trainer.workdir import checkpoint
      notice = checkpoint.PreemptionNotice()
      assert notice.mode == "sync_point", notice.mode
      assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # No Python handler.
      reached = []
      for step in range(400):
        if step == 3:
          os.kill(os.getpid(), signal.SIGTERM)  # Caught in C++: the process lives on.
        if notice.reached(step):
          reached.append(step)
        if reached and step > reached[0] + 3:
          break
        time.sleep(0.02)
      notice.close()
      print("reached", json.dumps(reached))
      """)
  done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        timeout=120, check=False, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert done.returncode == 0, done.stderr[-3000:]
  reached = json.loads(done.stdout.split("reached", 1)[1])
  assert len(reached) == 1 and reached[0] > 3, done.stdout
