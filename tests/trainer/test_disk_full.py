"""A full disk is one line, the cause first, before orbax writes anything (issue 32).

`checkpoint.check_free_space` runs before each save of a single-process run
on a local folder; `trainer.main` prints `disk full: ...` and exits 1.
"""

import collections
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from trainer.workdir import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
Usage = collections.namedtuple("Usage", "total used free")


def test_too_little_space_for_a_checkpoint_is_one_line(tmp_path, monkeypatch):
  state = {"params": np.zeros((1024, 256), np.float32)}  # 1 MiB
  monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10 * 2**20, 9 * 2**20, 2**20))
  with pytest.raises(checkpoint.DiskFullError,
                     match=r"^no space for the checkpoint of step 20: 1.0 MiB free on the file "
                     r"system of .*checkpoints, a checkpoint needs up to 2.0 MiB; the "
                     r"checkpoint of step 10 is whole"):
    checkpoint.check_free_space(tmp_path / "checkpoints", 20, state, latest=10)
  monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10 * 2**20, 0, 10 * 2**20))
  checkpoint.check_free_space(tmp_path / "checkpoints", 20, state, latest=10)


def test_remote_folders_are_not_checked(monkeypatch):
  monkeypatch.setattr(shutil, "disk_usage", lambda path: pytest.fail("looked at a local disk"))
  checkpoint.check_free_space("gs://bucket/run/checkpoints", 10, {"x": np.zeros(8)}, latest=None)


def _mount_small_tmpfs(folder) -> bool:
  if os.geteuid() != 0 or shutil.which("mount") is None:
    return False
  result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(folder)],
                          capture_output=True, check=False)
  return result.returncode == 0


def test_trainer_on_a_full_disk_prints_the_cause_in_one_line(tmp_path, smoke_data_dir):
  small = tmp_path / "small"
  small.mkdir()
  if not _mount_small_tmpfs(small):
    pytest.skip("cannot mount a small tmpfs here (needs root)")
  try:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, "-m", "trainer.main", "--config=configs/smoke.py",
         f"--workdir={small / 'run'}", f"--config.data.prepared_dir={smoke_data_dir}",
         "--config.profile.num_steps=0", "--config.train_steps=12"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
  finally:
    subprocess.run(["umount", str(small)], check=False)
  lines = [line for line in result.stderr.splitlines()
           if not line.startswith(("E0000", "WARNING: All log"))]
  assert result.returncode == 1, result.stderr[-3000:]
  assert len(lines) == 1 and lines[0].startswith(
      "disk full: no space for the checkpoint of step 10: "), lines
