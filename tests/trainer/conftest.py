"""Fixtures of the trainer tests.

Data: the real ML-100k file and tiny datasets. Training: the smoke config and
its prepared data.
"""

import jax
import numpy as np
import pytest

from configs import smoke

from trainer.data import movielens, prepare, sources, storage


@pytest.fixture(scope="session")
def ml100k_raw() -> sources.Interactions:
  """ML-100k read from the registry wheel (cached in the data cache dir)."""
  try:
    return movielens.load_ml_100k()
  except movielens.RegistryUnavailableError as error:
    pytest.skip(f"ML-100k wheel unavailable: {error}")


def _make_interactions(rows, **kwargs) -> sources.Interactions:
  user, item, timestamp = (np.array(column, np.int64) for column in zip(*rows))
  return sources.Interactions(user=user, item=item, timestamp=timestamp,
                              **kwargs)


@pytest.fixture
def make_interactions():
  """Builds Interactions from ``[(user, item, timestamp), ...]`` (file order)."""
  return _make_interactions


@pytest.fixture
def synthetic_prepared(tmp_path):
  """A small synthetic dataset prepared with leave-one-out, opened."""
  out = tmp_path / "synthetic"
  prepare.prepare_dataset(
      "synthetic", out, split="loo",
      source_options=dict(num_users=60, num_items=300,
                          interactions_per_user=30, seed=3),
      seq_lens=(8,))
  return storage.load_prepared(out)



@pytest.fixture(scope="session", autouse=True)
def compilation_cache(tmp_path_factory):
  """Persistent compilation cache: the many short runs compile each step once."""
  jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("jax_cache")))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


@pytest.fixture(scope="session")
def smoke_data_dir(tmp_path_factory):
  """A prepared copy of the smoke dataset shared by every test."""
  return str(tmp_path_factory.mktemp("smoke_data"))


@pytest.fixture
def smoke_config(smoke_data_dir):
  """The smoke config, unlocked, with a short schedule and shared data."""
  config = smoke.get_config()
  config.data.prepared_dir = smoke_data_dir
  config.train_steps = 20
  config.eval_every = 1_000
  config.checkpoint_every = 10
  config.log_every = 5
  config.eval.max_batches = 1
  config.profile.num_steps = 0
  return config
