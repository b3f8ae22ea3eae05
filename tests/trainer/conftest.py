"""Fixtures of the trainer tests: the smoke config and its prepared data."""

import jax
import pytest

from configs import smoke


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
