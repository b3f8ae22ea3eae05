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


# --------------------------------------------------------------------------- #
# The state: parameters, gradients, AdamW moments (issue 41, bad cause 1)      #
# --------------------------------------------------------------------------- #


def _main_under(limit_bytes, *overrides, workdir):
  """`python -m trainer.main` on the smoke config under `ulimit -v` (RLIMIT_AS)."""
  script = ("import resource, runpy, sys\n"
            f"resource.setrlimit(resource.RLIMIT_AS, ({limit_bytes}, resource.RLIM_INFINITY))\n"
            f"sys.argv = ['trainer.main', '--config=configs/smoke.py', '--workdir={workdir}', "
            f"*{list(overrides)!r}]\n"
            "runpy.run_module('trainer.main', run_name='__main__')\n")
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=180, check=False)


@pytest.mark.parametrize("dim", [1_000_000, 8_192])
def test_a_model_whose_state_cannot_fit_is_one_line_before_any_work(tmp_path, dim):
  """dim 1,000,000 under an 8 GB limit once hung after preparing the data, SIGTERM ignored."""
  done = _main_under(8 * GIB, f"--config.model.dim={dim}", "--config.model.num_heads=1",
                     workdir=tmp_path)
  assert done.returncode == 2, done.stderr[-3000:]
  assert done.stdout == "" and len(done.stderr.splitlines()) == 1, done.stderr[-3000:]
  assert done.stderr.startswith(
      f"bad config: config.model.dim={dim}: a model whose state fits this host: the model's "
      "parameters, gradients and AdamW moments (float32, 16 bytes per parameter) need at "
      "least "), done.stderr
  assert "this host's devices hold 8.0 GiB" in done.stderr  # the stated limit, not the RAM
  assert not (tmp_path / "data").exists() and not (tmp_path / "checkpoints").exists()


def test_the_item_table_is_counted_once_the_catalog_is_known():
  config = smoke.get_config()
  memory = budget.memory_bytes()
  rows = memory // (16 * config.model.dim * 8)  # 8 devices' copies of the table fill it
  config_mesh.check_state_fits(config, rows // 4)
  with pytest.raises(schema.ConfigError, match=(
      rf"^config\.model\.dim={config.model.dim}: a model whose state fits this host: .* need "
      rf"at least .* per device x 8 devices \({rows * 2:,} items x {config.model.dim}; .*split "
      r"the item table over a vocab axis")):
    config_mesh.check_state_fits(config, rows * 2)
  assert budget.state_bytes(budget.Model.of_config(config.model), num_items=rows * 2,
                            seq_len=config.seq_len, vocab_shards=8) < memory // 8


def test_the_stated_host_limit_caps_the_memory(monkeypatch):
  import resource  # pylint: disable=import-outside-toplevel
  real = resource.getrlimit
  monkeypatch.setattr(resource, "getrlimit", lambda which: (
      (3 * GIB, resource.RLIM_INFINITY) if which == resource.RLIMIT_AS else real(which)))
  assert budget.host_memory_bytes() == min(3 * GIB, os.sysconf("SC_PAGE_SIZE")
                                           * os.sysconf("SC_PHYS_PAGES"))


@pytest.mark.parametrize("kind,negatives_per,k,memory,why", [
    ("in_batch", "batch", 2**31 - 1, None, "overflow int32 indices"),
    ("gbce", "position", 10**9, 64 * GIB, "logits and gathered rows outgrow the 64.0 GiB"),
    ("sampled_softmax", "batch", 5 * 10**6, 8 * GIB, "sampled logits outgrow the 8.0 GiB"),
])
def test_absurd_sampled_negatives_are_one_line(kind, negatives_per, k, memory, why):
  """Issue 41: 1e9 negatives per position, or 2^31 - 1 in-batch, asked XLA for terabytes."""
  with pytest.raises(schema.ConfigError, match=(
      rf"^config\.loss\.num_negatives={k}: at most [0-9,]+ here \(past it .*{why}")):
    _check(memory, loss={**smoke.get_config().loss.to_dict(), "kind": kind,
                         "num_negatives": k, "negatives_per": negatives_per,
                         "vocab_reduction": "sum"})
  _check(memory, loss={**smoke.get_config().loss.to_dict(), "kind": kind,  # a sane k passes
                       "num_negatives": 1024, "negatives_per": negatives_per,
                       "vocab_reduction": "sum"})


@pytest.mark.parametrize("num_items", [10**8, 2 * 10**9 - 1])
def test_a_synthetic_catalog_past_the_hosts_memory_is_one_line(tmp_path, capsys, monkeypatch,
                                                              num_items):
  """Issue 41: `num_items=2e9` failed inside numpy (MemoryError traceback)."""
  from trainer.data import __main__ as data_cli  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(budget, "host_memory_bytes", lambda: GIB)  # a stated 1 GiB host
  status = data_cli.main(["--dataset", "synthetic", "--num-users", "10", "--num-items",
                          str(num_items), "--interactions-per-user", "5", "--out",
                          str(tmp_path / "out")])
  lines = capsys.readouterr().err.splitlines()
  assert status == 2 and lines == [
      f"bad config: num_items={num_items}: at most 67,108,864 on this host (preparing keeps 16 "
      f"bytes per item, the raw id of every item and its copy: "
      f"{budget.gib(16 * num_items)}, and this host's memory is 1.0 GiB)"], lines
  assert not (tmp_path / "out").exists()


def test_a_separate_output_table_counts_twice():
  config = smoke.get_config()
  tied = budget.Model.of_config(config.model)
  config.model.output_table = "separate"
  separate = budget.Model.of_config(config.model)
  flat = {f"model.{name}": value for name, value in config.model.items()}
  assert budget.Model.of(flat) == separate and separate.tables == 2 and tied.tables == 1
  sizes = dict(num_items=10**6, seq_len=config.seq_len, vocab_shards=4)
  assert (budget.param_count(separate, **sizes) - budget.param_count(tied, **sizes)
          == 10**6 // 4 * config.model.dim)
