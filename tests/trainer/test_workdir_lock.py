"""A workdir that cannot be used, or that another trainer holds, is one line (issue 32).

`trainer/workdir/lock.py`: a path that is a file, a directory that cannot be
written, and a second trainer on a live workdir stop `trainer.main` with exit
status 2 and one line before anything is written; a trainer killed with
SIGKILL leaves no stuck lock.
"""

import os
import signal
import socket
import subprocess
import sys

import pytest

from trainer.workdir import paths, lock as workdir_lock

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
           JAX_PLATFORMS="cpu")
HOLD = ("import sys, time; from trainer.workdir import lock as workdir_lock; "
        "workdir_lock.acquire(sys.argv[1]); print('held', flush=True); time.sleep(600)")


def _main(workdir):
  return subprocess.run(
      [sys.executable, "-m", "trainer.main", "--config=configs/smoke.py", f"--workdir={workdir}"],
      cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300, check=False)


def _lines(stderr: str) -> list[str]:
  return [line for line in stderr.splitlines() if not line.startswith(("E0000", "WARNING: All"))]


def test_a_workdir_that_is_a_file_is_one_line(tmp_path):
  path = tmp_path / "run"
  path.write_text("not a folder")
  with pytest.raises(workdir_lock.WorkdirError, match=r"a directory \(this path is a file\)"):
    workdir_lock.acquire(path)
  with pytest.raises(workdir_lock.WorkdirError, match=r"cannot create it"):
    workdir_lock.acquire(path / "below")
  result = _main(path)
  assert result.returncode == 2, result.stderr[-2000:]
  assert _lines(result.stderr) == [
      f"bad workdir: --workdir={path}: a directory (this path is a file)"]


def test_a_workdir_that_cannot_be_written_is_one_line(tmp_path, monkeypatch):
  def refuse(*args, **kwargs):
    raise PermissionError(13, "Permission denied")
  monkeypatch.setattr(paths, "open", refuse, raising=False)
  with pytest.raises(workdir_lock.WorkdirError,
                     match=rf"^--workdir={tmp_path}: not writable \(Permission denied\)$"):
    workdir_lock.acquire(tmp_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_workdir_is_one_line(tmp_path):
  tmp_path.chmod(0o555)
  try:
    result = _main(tmp_path)
  finally:
    tmp_path.chmod(0o755)
  assert result.returncode == 2
  assert _lines(result.stderr) == [
      f"bad workdir: --workdir={tmp_path}: not writable (Permission denied)"]


def test_a_second_trainer_is_refused_naming_the_holder(tmp_path):
  lock = workdir_lock.acquire(tmp_path)
  try:
    result = _main(tmp_path)
  finally:
    lock.release()
  assert result.returncode == 2, result.stderr[-2000:]
  lines = _lines(result.stderr)
  assert len(lines) == 1, lines
  assert lines[0].startswith(f"bad workdir: --workdir={tmp_path} is in use by another "
                             f"trainer (pid {os.getpid()} on host {socket.gethostname()}, since ")
  assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "config.json").exists()
  # Released: the same process (or another) takes it again.
  workdir_lock.acquire(tmp_path).release()


def test_a_killed_trainer_leaves_no_stuck_lock(tmp_path):
  holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(workdir_lock.WorkdirError, match=rf"pid {holder.pid} on host"):
      workdir_lock.acquire(tmp_path)
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=60)
  lock = workdir_lock.acquire(tmp_path)  # the kernel dropped the dead holder's flock
  assert workdir_lock.holder(tmp_path)["pid"] == os.getpid()
  lock.release()
