"""libtpu's start-up probe is quiet on a machine without a TPU (trainer/libtpu_env.py)."""

import os
import subprocess
import sys

import pytest

from trainer import libtpu_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _pci(tmp_path, *vendors):
  for index, vendor in enumerate(vendors):
    device = tmp_path / f"0000:00:{index:02x}.0"
    device.mkdir(parents=True)
    (device / "vendor").write_text(vendor + "\n")
  return str(tmp_path)


def test_set_only_without_a_tpu_chip_and_without_a_users_setting(tmp_path):
  no_tpu = _pci(tmp_path / "cpu", "0x8086", "0x10de")  # Intel, NVIDIA
  environ = {}
  assert libtpu_env.quiet_probe_without_tpu(environ, pci_devices=no_tpu)
  assert environ == libtpu_env.QUIET
  tpu = _pci(tmp_path / "tpu", "0x8086", libtpu_env.GOOGLE_PCI_VENDOR)
  environ = {}
  assert not libtpu_env.quiet_probe_without_tpu(environ, pci_devices=tpu)
  assert environ == {}
  for name in libtpu_env.SLICE_VARIABLES:  # someone describes a slice: untouched
    environ = {name: "1"}
    assert not libtpu_env.quiet_probe_without_tpu(environ, pci_devices=no_tpu)
    assert environ == {name: "1"}


def _libtpu_env() -> dict:
  """This environment as a fresh CPU machine's: jax may probe libtpu, no slice set."""
  env = {name: value for name, value in os.environ.items()
         if name not in libtpu_env.SLICE_VARIABLES and name != "JAX_PLATFORMS"}
  # Another process of the suite may hold libtpu's host lock; a held lock
  # stops the probe before the lines this test looks for.
  env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
  return env


@pytest.mark.skipif(libtpu_env.has_tpu_chip(), reason="a TPU is attached: libtpu finds it")
def test_a_command_on_a_cpu_machine_prints_no_libtpu_lines(tmp_path):
  """Its one `bad config:` line only; jax's backends (the TPU probe among them) start first."""
  result = subprocess.run(
      [sys.executable, "-m", "trainer.main", "--config=configs/smoke.py",
       f"--workdir={tmp_path}", "--config.mesh.shape=(3,)"],
      cwd=ROOT, env=_libtpu_env(), capture_output=True, text=True, timeout=120)
  assert result.returncode == 2, result.stderr[-2000:]
  lines = result.stderr.splitlines()
  assert len(lines) == 1 and lines[0].startswith("bad config: config.mesh.shape=(3,)"), lines


@pytest.mark.skipif(libtpu_env.has_tpu_chip(), reason="a TPU is attached: libtpu finds it")
def test_the_deviceless_compile_path_still_describes_multi_host_slices():
  """With the quiet settings, libtpu still builds a 4-host slice's devices for compiling."""
  pytest.importorskip("libtpu")
  script = ("from trainer import libtpu_env; assert libtpu_env.quiet_probe_without_tpu(); "
            "from cutbce.kernels import compiler; "
            "devices = compiler.topology_devices('v6e-16'); "
            "print(len(devices), sorted({d.process_index for d in devices}))")
  env = dict(_libtpu_env(), JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.split("\n")[0] == "16 [0, 1, 2, 3]"
  assert "E0000" not in result.stderr and "host bounds" not in result.stderr, result.stderr
