"""Test setup shared by every test file.

Eight simulated CPU devices (set before jax is imported, appended to any
XLA_FLAGS already given), a `--runslow` option (tests marked `slow` are
skipped unless it is passed), the GPU kernels' tests skipped on a TPU host,
and jax 0.12's fix to Pallas' interpreter cache on older jax
(`_cache_interpreted_kernel_bodies`).
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
  _cache_interpreted_kernel_bodies()


def _cache_interpreted_kernel_bodies():
  """Pallas' interpreter on jax < 0.12 compiles a kernel's body afresh for each
  thread of each CTA: it hands `jax.jit` a new closure per call, which no cache
  recognises (jax 0.12 made it a top-level function "so that caching works
  properly"). Interpreted warp-specialized Mosaic GPU kernels (three threads a
  CTA) took 8x longer for it. The same fix, where it is missing; numerics are
  untouched (the same jaxpr runs)."""
  import jax  # pylint: disable=import-outside-toplevel
  from jax import core as jax_core  # pylint: disable=import-outside-toplevel
  try:
    from jax._src.pallas.mosaic.interpret import thread_map  # pylint: disable=import-outside-toplevel
  except ImportError:
    return
  if hasattr(thread_map, "_run"):  # jax >= 0.12
    return

  def run(jaxpr, consts, *args):
    jax_core.eval_jaxpr(jaxpr, consts, *args)

  def run_jaxpr(jaxpr, consts, *args):
    jax.jit(run, static_argnums=(0,)).trace(jaxpr, consts, *args).lower().compile()(consts, *args)

  thread_map._run_jaxpr = run_jaxpr  # pylint: disable=protected-access


# Names of tests that run the GPU kernels (a backend parameter or the test's
# own name): compiled on a GPU, interpreted on a CPU, refused on a TPU host.
_GPU_KERNEL_NAMES = ("pallas_gpu", "pallas_triton", "gpu_kernels")


def pytest_collection_modifyitems(config, items):
  import jax  # pylint: disable=import-outside-toplevel
  skip_gpu = pytest.mark.skip(reason="runs the GPU kernels, which a TPU host refuses")
  on_tpu = jax.default_backend() == "tpu"
  skip_slow = pytest.mark.skip(reason="slow: pass --runslow to run")
  for item in items:
    if on_tpu and any(name in item.name for name in _GPU_KERNEL_NAMES):
      item.add_marker(skip_gpu)
    if "slow" in item.keywords and not config.getoption("--runslow"):
      item.add_marker(skip_slow)
