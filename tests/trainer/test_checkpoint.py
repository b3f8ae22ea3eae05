"""Checkpoints: state and grain iterator together, restored onto the mesh."""

import jax
import numpy as np

from trainer import checkpoint, config_checks, data as data_lib
from trainer import train as train_lib


def _iterator(data_dir):
  return data_lib.train_iterator(data_lib.load_prepared(data_dir), seq_len=16, num_targets=2,
                                 batch_size=4, seed=1, num_threads=1,
                                 prefetch_buffer_size=1)


def test_state_and_iterator_roundtrip(smoke_config, tmp_path):
  from trainer import loop  # pylint: disable=import-outside-toplevel
  smoke_config.mesh.axis_names, smoke_config.mesh.shape = ("data", "model"), (2, 4)
  smoke_config.mesh.vocab_axis = "model"
  data = loop.prepare_data(smoke_config, str(tmp_path))
  mesh = config_checks.make_mesh(smoke_config)
  _, _, _, state, shardings = train_lib.create_sharded_state(
      smoke_config, num_items=data.num_items, mesh=mesh, vocab_shards=4)
  iterator = _iterator(smoke_config.data.prepared_dir)
  for _ in range(3):
    next(iterator)
  manager = checkpoint.make_manager(tmp_path / "checkpoints", max_to_keep=2)
  checkpoint.save(manager, 3, state, iterator)
  expected_batch = next(iterator)

  fresh = _iterator(smoke_config.data.prepared_dir)
  abstract = train_lib.abstract_state(state, shardings)
  restored = checkpoint.restore(manager, checkpoint.latest_step(manager), abstract, fresh)
  manager.close()
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               state, restored)
  table = restored["params"]["item_embedding"]["embedding"]
  assert table.sharding.spec == jax.sharding.PartitionSpec("model", None)
  assert table.shape[0] % 4 == 0 and table.shape[0] >= data.num_items
  batch = next(fresh)
  for key in expected_batch:
    np.testing.assert_array_equal(batch[key], expected_batch[key])


def test_preemption_flag(monkeypatch):
  import os, signal  # pylint: disable=import-outside-toplevel,multiple-imports
  flag = checkpoint.PreemptionFlag()
  try:
    assert not flag.is_set()
    os.kill(os.getpid(), signal.SIGTERM)
    assert flag.is_set()
  finally:
    flag.restore_handler()
