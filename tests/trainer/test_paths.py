"""`gs://` workdirs and data: the URI reaches every writer intact, and a run resumes from it.

No network: `gs://` is a fake bucket store, a folder of this machine, put
where each library looks it up:

- `etils.epath` (the trainer's files, orbax's metadata, grain's iterator
  state) reads `gs://` through fsspec's "gs"/"gcs" filesystem: fsspec's own
  `DirFileSystem` over the local disk is registered under those names
  (`_Buckets`, rooted at the store's folder), as gcsfs would be;
- orbax writes arrays with TensorStore, whose spec for a `gs://` path
  (`gcs_utils.get_kvstore_for_gcs`) becomes a `file` spec for the same
  place in the store, and orbax's bucket-layout query (hierarchical
  namespace, a Google Cloud call) answers "no";
- `jax.profiler.start_trace` (native code: no Python file system to mock)
  only records the directory it is given.

Every path each of them is handed is recorded, so the tests can check that
the string arrived as `gs://bucket/...`, never as a local path.
"""

import doctest
import importlib
import os

import fsspec
import jax
import numpy as np
import pytest
from etils.epath import backend as epath_backend
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem
from orbax.checkpoint._src.path import gcs_utils

from trainer import loop
from trainer.workdir import logs, paths
from trainer.config import keys as config_keys, saved as saved_config
from trainer.commands import workdir as workdir_lib
from trainer.data import prepare, storage

BUCKET = "gs://bucket"


class _Buckets(DirFileSystem):
  """`gs://BUCKET/KEY` as the file `ROOT/BUCKET/KEY` (parents made, as a bucket needs none)."""

  protocol = ("gs", "gcs")
  cachable = False
  root = ""
  opened: list = []

  def __init__(self, **options):
    super().__init__(path=self.root, fs=LocalFileSystem(auto_mkdir=True), **options)

  def open(self, path, *args, **kwargs):
    type(self).opened.append(path)
    return super().open(path, *args, **kwargs)


class FakeGcs:
  """What the fake store recorded: files opened, TensorStore specs made, traces started."""

  def __init__(self, root):
    self.root = root
    self.opened = _Buckets.opened
    self.tensorstore = []
    self.traces = []

  def local(self, uri: str) -> str:
    """Where `gs://bucket/key` lies on this machine."""
    return os.path.join(self.root, uri[len("gs://"):])


@pytest.fixture
def fake_gcs(tmp_path, monkeypatch):
  root = str(tmp_path / "gcs")
  os.makedirs(root)
  monkeypatch.setattr(_Buckets, "root", root)
  monkeypatch.setattr(_Buckets, "opened", [])
  fake = FakeGcs(root)
  registry = importlib.import_module("fsspec.registry")._registry
  for name in _Buckets.protocol:
    monkeypatch.setitem(registry, name, _Buckets)
  filesystems = type(epath_backend.fsspec_backend)._get_filesystem
  filesystems.cache_clear()  # epath keeps the filesystem it made for "gcs"

  def kvstore(path):
    fake.tensorstore.append(path)
    bucket, key = gcs_utils.parse_gcs_path(path, add_trailing_slash=False)
    return {"driver": "file", "path": os.path.join(root, bucket) + "/" + key}

  monkeypatch.setattr(gcs_utils, "get_kvstore_for_gcs", kvstore)
  monkeypatch.setattr(gcs_utils, "is_hierarchical_namespace_enabled", lambda path: False)
  monkeypatch.setattr(jax.profiler, "start_trace",
                      lambda log_dir, **kwargs: fake.traces.append(str(log_dir)))
  monkeypatch.setattr(jax.profiler, "stop_trace", lambda: None)
  from tensorboardX import record_writer  # pylint: disable=import-outside-toplevel
  monkeypatch.setitem(record_writer.REGISTERED_FACTORIES, "gs",
                      record_writer.REGISTERED_FACTORIES.get("gs"))
  # Anything written relative to the working directory (a "gs:" folder) shows here.
  cwd = tmp_path / "cwd"
  cwd.mkdir()
  monkeypatch.chdir(cwd)
  yield fake
  filesystems.cache_clear()
  assert not os.listdir(cwd), "a gs:// path was used as a local one"


def test_docstring_examples():
  for module in (paths, config_keys):
    assert doctest.testmod(module).failed == 0


def test_fake_store_is_what_fsspec_and_epath_give_for_gs(fake_gcs):
  assert isinstance(fsspec.filesystem("gcs"), _Buckets)
  target = paths.as_path(f"{BUCKET}/a/b.txt")
  target.write_text("x")
  assert open(fake_gcs.local(f"{BUCKET}/a/b.txt"), encoding="utf-8").read() == "x"
  assert [str(p) for p in target.parent.iterdir()] == [f"{BUCKET}/a/b.txt"]


def test_prepared_data_in_a_bucket_is_read_into_memory(fake_gcs, tmp_path):
  options = dict(split="loo", seq_lens=(8,), source_options=dict(
      num_users=40, num_items=100, interactions_per_user=20, seed=1))
  folder = f"{BUCKET}/prepared"
  prepare.prepare_dataset("synthetic", folder, **options)
  prepare.prepare_dataset("synthetic", tmp_path / "local", **options)
  remote, local = storage.load_prepared(folder), storage.load_prepared(tmp_path / "local")
  assert str(remote.path) == folder and prepare.has_manifest(folder)
  assert isinstance(local.items, np.memmap) and not isinstance(remote.items, np.memmap)
  for name in storage.ARRAYS:
    np.testing.assert_array_equal(getattr(remote, name), getattr(local, name))
  assert remote.manifest == local.manifest
  assert sorted(os.listdir(fake_gcs.local(folder))) == sorted(
      [storage.MANIFEST] + [f"{name}.npy" for name in storage.ARRAYS])
  assert all(path.startswith(f"{folder}/") for path in fake_gcs.opened)


def test_metrics_in_a_bucket_continue_after_a_restart(fake_gcs):
  for step in (1, 2):
    writer = logs.MetricWriter(f"{BUCKET}/run")
    writer.write(step, "train", {"loss": 1.0 / step})
    writer.close()
  lines = paths.as_path(f"{BUCKET}/run/metrics.jsonl").read_text().splitlines()
  assert [line.split(",")[0] for line in lines] == ['{"step": 1', '{"step": 2']
  events = os.listdir(fake_gcs.local(f"{BUCKET}/run/tensorboard"))  # named by the second
  assert events and all(name.startswith("events.out.tfevents") for name in events)
  assert all(os.path.getsize(fake_gcs.local(f"{BUCKET}/run/tensorboard/{name}")) > 0
             for name in events)


def test_a_run_in_a_bucket_resumes_and_equals_a_local_run(fake_gcs, smoke_config, tmp_path):
  """6 steps in gs://bucket/run (data, checkpoints, logs, profile there), 3 more after a
  restart: the parameters and losses of 9 steps in one go in a local folder."""
  workdir = f"{BUCKET}/run"
  smoke_config.train_steps, smoke_config.checkpoint_every, smoke_config.log_every = 6, 3, 3
  smoke_config.profile.start_step, smoke_config.profile.num_steps = 1, 1
  local = smoke_config.copy_and_resolve_references()
  smoke_config.data.prepared_dir = None  # gs://bucket/run/data
  assert loop.train_and_evaluate(smoke_config, workdir)["step"] == 6
  smoke_config.train_steps = 9
  resumed = loop.train_and_evaluate(smoke_config, workdir)
  local.train_steps, local.profile.num_steps = 9, 0
  once = loop.train_and_evaluate(local, str(tmp_path / "local"))
  assert resumed["step"] == 9 and resumed["final_loss"] == once["final_loss"]
  jax.tree.map(np.testing.assert_array_equal, loop.final_params(workdir),
               loop.final_params(str(tmp_path / "local")))
  metrics = [line for line in paths.as_path(f"{workdir}/metrics.jsonl").read_text()
             .splitlines() if '"kind": "train"' in line]
  assert len(metrics) == 3  # steps 3 and 6, then 9 after the restart

  # Every writer got the gs:// path as given.
  assert fake_gcs.traces == [f"{workdir}/profile"]
  assert fake_gcs.tensorstore and all(
      path.startswith(f"{workdir}/checkpoints/") for path in fake_gcs.tensorstore)
  assert all(path.startswith(f"{workdir}/") for path in fake_gcs.opened), fake_gcs.opened
  for prefix in ("data/manifest.json", "data/.items.npy.tmp", "checkpoints/6/", "checkpoints/9/",
                 "metrics.jsonl", "tensorboard/events.out.tfevents", ".config.json.tmp"):
    assert any(path.startswith(f"{workdir}/{prefix}") for path in fake_gcs.opened), prefix
  stored = os.listdir(fake_gcs.local(workdir))
  assert {"config.json", "metrics.jsonl", "checkpoints", "data", "tensorboard"} <= set(stored)
  assert saved_config.read(workdir).train_steps == 9
  # The commands after training read the run from the bucket too.
  run = workdir_lib.open_run(workdir, which="latest", say=lambda line: None)
  assert run.step == 9 and run.data.num_items == 300
