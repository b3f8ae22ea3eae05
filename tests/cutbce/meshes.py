"""Meshes for the sharded tests, which skip where too few devices are attached.

Here (tests/conftest.py) a CPU host simulates eight devices; one TPU chip is
one device, so a test that needs a mesh of several is skipped there, saying so.
"""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from jax.sharding import Mesh


def mesh(shape: tuple[int, ...], axes: tuple[str, ...] = ("data", "model"), axis_types=None) -> Mesh:
  """A mesh of the first prod(shape) devices; skips the test where fewer are attached."""
  need = math.prod(shape)
  if jax.device_count() < need:
    pytest.skip(f"a {shape} mesh needs {need} devices; {jax.device_count()} attached")
  return Mesh(np.array(jax.devices()[:need]).reshape(shape), axes, axis_types=axis_types)
