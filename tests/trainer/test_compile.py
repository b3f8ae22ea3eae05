"""`python -m trainer.compile`: the trainer's steps compiled for a TPU slice, with no TPU."""

import json
import os
import subprocess
import sys

import pytest

from cutbce.kernels import compiler

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NO_LIBTPU = compiler.libtpu_missing_reason() is not None


def _compile(*flags, timeout=300):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)  # the slice's devices, not simulated CPU ones
  return subprocess.run([sys.executable, "-m", "trainer.compile", *flags], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


def test_an_unknown_topology_is_one_line_listing_the_known_ones():
  result = _compile("--config=configs/smoke.py", "--topology=v7x-9", timeout=120)
  assert result.returncode == 2, result.stderr[-2000:]
  line = result.stderr.strip().splitlines()[-1]
  assert line.startswith("bad config: --topology: unknown TPU topology 'v7x-9'; known: v5e-1")
  assert "v6e-8" in line and "Traceback" not in result.stderr


def test_an_unknown_catalog_size_is_one_line():
  result = _compile("--config=configs/smoke.py", "--topology=v6e-8", timeout=120)
  assert result.returncode == 2
  assert result.stderr.strip().splitlines()[-1] == (
      "bad config: the catalog size is unknown: pass --num_items=V or set "
      "config.compile.num_items")


@pytest.mark.skipif(NO_LIBTPU, reason="libtpu missing: pip install 'cutbce[tpu]'")
def test_steps_that_fit_print_the_table_and_a_json_line():
  result = _compile("--config=configs/smoke.py", "--topology=v6e-8", "--num_items=300",
                    "--config.loss.backend=auto")
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.strip().splitlines()
  summary = json.loads(lines[-1])
  assert summary["fits"] and summary["chip"] == "v6e" and summary["devices"] == 8
  assert [s["step"] for s in summary["steps"]] == ["train", "eval", "top_100"]
  train = summary["steps"][0]
  assert train["mosaic_kernels"] >= 1  # "auto" is Pallas when compiled for a TPU
  assert 0 < train["peak_bytes"] < train["hbm_bytes"] == 34_400_000_000
  assert train["margin_bytes"] == train["hbm_bytes"] - train["peak_bytes"]
  assert lines[0].split()[:4] == ["step", "args", "GiB", "temp"]
  assert "not a timing" in result.stdout
  # Each step's Pallas kernels with the plan chosen for v6e and the compiler's VMEM.
  [kernel] = [k for k in train["kernels"] if k["kernel"] == "backward"]
  assert kernel["block_v"] in (256, 300) and kernel["cores"] == 1, kernel  # V = 300: one tile
  assert 0 < kernel["used_bytes"] <= kernel["limit_bytes"], kernel
  plan_lines = [line for line in lines if line.startswith("train ") and "tiles" in line]
  assert plan_lines and "VMEM used" in plan_lines[0] and "planned" in plan_lines[0], lines


def test_plan_lines_show_tiles_chunks_cores_and_both_vmem_figures():
  from trainer.commands import compile as compile_command  # pylint: disable=import-outside-toplevel
  kernel = {"name": "cutbce_backward_bt256_bv4096_chunk2048_cores2", "kernel": "backward",
            "block_t": 256, "block_v": 4096, "token_chunk": 2048, "cores": 2, "calls": 2,
            "dtype": "bf16", "tokens": 4096, "dim": 128, "limit_bytes": 48 * 2**20,
            "used_bytes": 26 * 2**20}
  text = compile_command.format_plans([{"step": "train", "kernels": [kernel]}])
  line = text.splitlines()[1]
  assert line.startswith("train    backward"), line
  assert "tiles 256 x 4096, 2 chunk(s) of 2048, 2 core(s)" in line, line
  assert "VMEM used 26.0 MiB" in line and "limit 48.0 MiB" in line, line
  assert compile_command.format_plans([{"step": "eval"}]) == ""


@pytest.mark.skipif(NO_LIBTPU, reason="libtpu missing: pip install 'cutbce[tpu]'")
def test_a_step_over_hbm_says_does_not_fit_and_exits_1():
  # Dense logits of 16 x 16 tokens over 3 x 10^7 items: ~43 GiB on a 16 GiB chip.
  result = _compile("--config=configs/smoke.py", "--topology=v5e-1", "--num_items=30000000",
                    "--config.loss.backend=dense", "--config.mesh.shape=(1,)")
  assert result.returncode == 1, result.stderr[-3000:]
  assert "Traceback" not in result.stderr
  summary = json.loads(result.stdout.strip().splitlines()[-1])
  train = summary["steps"][0]
  assert not summary["fits"] and not train["fits"]
  assert train["required_bytes"] > train["available_bytes"] > 15 * 2**30
  assert any(line.startswith("does not fit: the train step needs")
             for line in result.stdout.splitlines())


def test_the_command_defines_no_flag_on_import_so_it_lives_beside_trainer_main():
  """Both define `--config`: importing them in one process (as pytest does) must work."""
  result = subprocess.run([sys.executable, "-c", "import trainer.main, trainer.compile"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize("module", ["trainer.compile", "trainer.main"])
def test_help_exits_0(module):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]
  assert "--config" in result.stdout + result.stderr


@pytest.mark.skipif(NO_LIBTPU, reason="libtpu missing: pip install 'cutbce[tpu]'")
def test_the_popularity_sampler_compiles_with_its_table():
  # The step takes the sampler's cumulative counts as a third, replicated argument.
  result = _compile("--config=configs/smoke.py", "--topology=v6e-8", "--num_items=300",
                    "--config.loss.kind=sampled_softmax", "--config.loss.sampler=popularity",
                    "--config.loss.logq=True", "--config.loss.num_negatives=16")
  assert result.returncode == 0, result.stderr[-3000:]
  summary = json.loads(result.stdout.strip().splitlines()[-1])
  assert summary["steps"][0]["step"] == "train" and summary["fits"]
