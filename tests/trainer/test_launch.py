"""Launchers: tpu_vm.sh against a stand-in gcloud, local.sh processes and failures."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from tests.trainer import test_train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _stand_in(tmp_path, name, body):
  folder = tmp_path / "bin"
  folder.mkdir(exist_ok=True)
  path = folder / name
  path.write_text("#!/usr/bin/env bash\n" + body)
  path.chmod(0o755)
  return folder


def test_tpu_vm_runs_gcloud_on_every_worker(tmp_path):
  record = tmp_path / "calls.txt"
  folder = _stand_in(tmp_path, "gcloud", f'printf "%s\\n" "$*" >> {record}\n')
  env = dict(os.environ, PATH=f"{folder}:{os.environ['PATH']}")
  result = subprocess.run(
      ["launch/tpu_vm.sh", "--tpu=my-v6e", "--zone=us-east5-b", "--project=p", "--",
       "--config=configs/yambda50m_v6e8.py", "--workdir=gs://b/run", "--config.seed=3"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
  assert result.returncode == 0, result.stderr
  calls = record.read_text().splitlines()
  assert len(calls) == 4
  assert calls[0].startswith("compute tpus tpu-vm scp ")
  assert all("--worker=all" in call and "--zone=us-east5-b" in call for call in calls)
  assert all(call.startswith("compute tpus tpu-vm ssh my-v6e") for call in calls[1:])
  assert "pip install" in calls[1]
  assert "libtpu_lockfile" in calls[2]
  assert ("python3 -m trainer.main --distributed --config=configs/yambda50m_v6e8.py "
          "--workdir=gs://b/run --config.seed=3") in calls[3]


def test_tpu_vm_dry_run_prints_and_runs_nothing(tmp_path):
  record = tmp_path / "calls.txt"
  folder = _stand_in(tmp_path, "gcloud", f'echo called >> {record}\n')
  env = dict(os.environ, PATH=f"{folder}:{os.environ['PATH']}")
  result = subprocess.run(
      ["launch/tpu_vm.sh", "--tpu=t", "--zone=z", "--dry-run", "--", "--config=c.py",
       "--workdir=w"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
  assert result.returncode == 0, result.stderr
  assert not record.exists()
  lines = result.stdout.splitlines()
  assert len(lines) == 4 and all(line.startswith("gcloud compute tpus tpu-vm") for line in lines)


def test_tpu_vm_needs_tpu_and_zone():
  result = subprocess.run(["launch/tpu_vm.sh", "--", "--config=c.py"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
  assert result.returncode == 2 and "--tpu=NAME and --zone=ZONE" in result.stderr


def test_local_stops_everyone_when_one_process_fails(tmp_path):
  # A stand-in python: process 1 fails at once, the others would run forever.
  marker = tmp_path / "stopped"
  fake = _stand_in(tmp_path, "fakepython", f"""
for arg in "$@"; do
  case "$arg" in --process_id=*) id=${{arg#*=}} ;; esac
done
if [[ $id == 1 ]]; then echo "process 1 fails" >&2; exit 7; fi
trap 'echo $id >> {marker}; exit 143' TERM
while true; do sleep 0.1; done
""")
  env = dict(os.environ, PYTHON=str(fake / "fakepython"))
  result = subprocess.run(
      ["launch/local.sh", "-p", "3", "-k", "2", "--", "--config=configs/smoke.py",
       f"--workdir={tmp_path / 'run'}"], cwd=ROOT, env=env, capture_output=True, text=True,
      timeout=60)
  assert result.returncode == 7, (result.stdout, result.stderr)
  assert "stopping the others" in result.stderr
  assert sorted(marker.read_text().split()) == ["0", "2"]
  assert "process 1 fails" in (tmp_path / "run" / "logs" / "process_1.log").read_text()


@pytest.mark.slow
def test_two_processes_of_four_devices_match_one_of_eight(tmp_path, smoke_data_dir):
  """2 x 4 devices over loopback trains the same parameters as 1 x 8.

  The two processes' rows make the same global batch in another row order
  (process 0's rows first), so dropout is off: with it, masks follow rows.
  """
  from trainer import loop  # pylint: disable=import-outside-toplevel
  from configs import smoke  # pylint: disable=import-outside-toplevel
  flags = ["--config=configs/smoke.py", "--config.train_steps=10",
           "--config.model.dropout_rate=0.0",
           "--config.eval.max_batches=1", f"--config.data.prepared_dir={smoke_data_dir}"]
  multi = tmp_path / "multi"
  env = dict(os.environ, PYTHON=sys.executable)
  env.pop("XLA_FLAGS", None)
  result = subprocess.run(["launch/local.sh", "-p", "2", "-k", "4", "--", *flags,
                           f"--workdir={multi}"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  config = smoke.get_config()
  config.train_steps, config.eval.max_batches = 10, 1
  config.model.dropout_rate = 0.0
  config.data.prepared_dir = smoke_data_dir
  single = loop.train_and_evaluate(config, str(tmp_path / "single"))
  assert jax.device_count() == 8 and single["step"] == 10
  single_params = loop.final_params(str(tmp_path / "single"))
  multi_params = loop.final_params(str(multi))
  for block in single_params["blocks"]:
    # The attention key bias gets no gradient (softmax ignores a shift shared
    # by all keys): its only "gradient" is rounding noise, which Adam scales
    # up to full-size steps. It is the one parameter left out.
    del single_params["blocks"][block]["attention"]["key"]["bias"]
    del multi_params["blocks"][block]["attention"]["key"]["bias"]
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4),
               single_params, multi_params)
  for one, two in zip(test_train.read_metrics(str(tmp_path / "single")),
                      test_train.read_metrics(str(multi))):
    assert one["step"] == two["step"]
    np.testing.assert_allclose(one["loss"], two["loss"], rtol=1e-5)
