"""Test setup shared by every test file.

Eight simulated CPU devices (set before jax is imported, appended to any
XLA_FLAGS already given), and a `--runslow` option: tests marked `slow` are
skipped unless it is passed.
"""

import os

_DEVICE_FLAG = "--xla_force_host_platform_device_count=8"
if _DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = " ".join(
      flag for flag in (os.environ.get("XLA_FLAGS", ""), _DEVICE_FLAG) if flag
  )

import pytest  # noqa: E402


def pytest_addoption(parser):
  parser.addoption(
      "--runslow", action="store_true", default=False, help="also run tests marked slow"
  )


def pytest_configure(config):
  config.addinivalue_line("markers", "slow: slow test, skipped unless --runslow")


def pytest_collection_modifyitems(config, items):
  if config.getoption("--runslow"):
    return
  skip_slow = pytest.mark.skip(reason="slow: pass --runslow to run")
  for item in items:
    if "slow" in item.keywords:
      item.add_marker(skip_slow)
