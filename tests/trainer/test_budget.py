"""Sizes that cannot fit are refused up front, in one line (`trainer/config/budget.py`).

Issue 32, bad #8: `--config.seq_len=100000000` and `recommend --batch_size=100000000`
were OOM-killed with no message, `trainer.compile` with a batch of 2^40 aborted
inside XLA.
"""

import os
import subprocess
import sys
import types

import pytest

from configs import smoke
from cutbce.kernels import compiler
from trainer.commands import recommend
from trainer.config import budget, keys as config_keys, mesh as config_mesh, schema

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GIB = 2**30


def _check(memory, **changes):
  config = smoke.get_config().to_dict()
  config.update(changes)
  config_keys.check(config, config_keys.Context(device_count=8, memory_bytes=memory))


def test_smoke_config_fits():
  _check(1 * GIB)
  _check(None)


@pytest.mark.parametrize("key,value", [("seq_len", 100_000_000), ("batch_size", 2**40),
                                       ("eval_batch_size", 2**36)])
def test_absurd_sizes_are_one_line_naming_the_key(key, value):
  with pytest.raises(schema.ConfigError, match=rf"^config\.{key}={value}: at most [\d,]+ here "):
    _check(16 * GIB, **{key: value})


def test_the_key_further_over_its_limit_is_named():
  # seq_len alone past the memory bound: no batch would fit, so seq_len is named.
  with pytest.raises(schema.ConfigError, match=r"^config\.seq_len=100000: at most"):
    _check(1 * GIB, seq_len=100_000)
  with pytest.raises(schema.ConfigError, match=r"^config\.batch_size=16777216: at most"):
    _check(1 * GIB, batch_size=2**24)


def test_the_limit_named_is_the_largest_that_fits():
  model = budget.Model(dim=16, num_layers=1, num_heads=2, mlp_dim=32, dtype_bytes=4)
  sizes = dict(targets=2, shards=8, local_devices=8, memory=GIB, training=True)
  key, tail = budget.check_sizes(model, sizes={"batch": 16, "seq_len": 10**6},
                                 blame=("batch", "seq_len"), **sizes)
  assert key == "seq_len"
  largest = int(tail.split()[2].replace(",", ""))
  assert budget.fits(model, batch=16, seq_len=largest, **sizes)
  assert not budget.fits(model, batch=16, seq_len=largest + 1, **sizes)
  assert "outgrow the 1.0 GiB" in tail


def test_int32_bound_holds_without_a_memory_figure():
  # trainer.compile checks no memory (its compiler reports the fit), only int32 indices.
  with pytest.raises(schema.ConfigError, match=r"^config\.batch_size=1099511627776: at most "
                     r"67,108,863 here \(past it .* overflow int32 indices"):
    _check(None, batch_size=2**40)
  _check(None, batch_size=2**25)


def test_check_config_knows_this_hosts_memory():
  config = smoke.get_config()
  config.seq_len = 100_000_000
  with pytest.raises(schema.ConfigError, match=r"^config\.seq_len=100000000: at most"):
    config_mesh.check_config(config, device_count=8)
  assert budget.memory_bytes() > 0


def _run(seq_len=16, num_users=200, batch=64):
  config = smoke.get_config()
  config.seq_len = seq_len
  mesh = types.SimpleNamespace(shape={"data": 8})
  settings = types.SimpleNamespace(mesh=mesh, token_axes=("data",))
  return types.SimpleNamespace(config=config, settings=settings, batch_size=batch), num_users


def test_recommend_batch_is_clamped_to_the_users():
  run, users = _run()
  assert recommend._batch_size(run, 100_000_000, num_users=users) == 200
  assert recommend._batch_size(run, None, num_users=users) == 64
  assert recommend._batch_size(run, 1, num_users=users) == 8
  assert recommend._batch_size(run, None, num_users=3) == 8


def test_recommend_batch_over_memory_is_one_line(monkeypatch):
  monkeypatch.setattr(budget, "memory_bytes", lambda: 1024 * 2**20)
  run, users = _run(seq_len=1_000, num_users=10**6)
  with pytest.raises(schema.ConfigError, match=r"^--batch_size=100000000: at most [\d,]+ here "):
    recommend._batch_size(run, 100_000_000, num_users=users)


@pytest.mark.skipif(compiler.libtpu_missing_reason() is not None, reason="no libtpu")
def test_compile_with_a_batch_of_2_to_the_40_is_one_line():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)  # the slice's devices, not simulated CPU ones
  result = subprocess.run(
      [sys.executable, "-m", "trainer.compile", "--config=configs/smoke.py", "--topology=v6e-8",
       "--num_items=300", f"--config.batch_size={2**40}"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 2, result.stderr[-2000:]
  assert f"bad config: config.batch_size={2**40}: at most" in result.stderr
  assert "Traceback" not in result.stderr
