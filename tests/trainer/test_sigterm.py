"""No input makes a command hang or need kill -9 (issue 41, bad cause 1).

A state too large for the devices once left the main thread waiting inside
XLA for a state whose creation had failed on another thread, with SIGTERM
caught by the preemption handler that could never run. Reproduced here by a
main thread blocked in native code (a second `pthread_mutex_lock` of a
mutex it holds: no Python signal handler runs meanwhile), in a subprocess each.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BLOCK = """
import ctypes
libc = ctypes.CDLL(None)
mutex = ctypes.create_string_buffer(64)  # zeroed: PTHREAD_MUTEX_INITIALIZER (glibc)
libc.pthread_mutex_lock(mutex)
print("blocked", flush=True)
libc.pthread_mutex_lock(mutex)  # again, same thread: waits forever in native code
"""


def _start(body: str, *, block: bool = False) -> subprocess.Popen:
  """Runs `body` (then, if `block`, a main thread stuck in native code) in a subprocess."""
  script = (f"import sys\nsys.path.insert(0, {ROOT!r})\n" + textwrap.dedent(body)
            + (BLOCK if block else ""))
  process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert process.stdout.readline().strip() in ("blocked", "ready"), process.stderr.read()
  return process


def _stopped(process: subprocess.Popen, within: float) -> tuple[int, list[str]]:
  start = time.monotonic()
  try:
    process.wait(timeout=within)
  except subprocess.TimeoutExpired:
    process.kill()
    process.wait()
    pytest.fail(f"still running {within:.0f} s after SIGTERM (needed kill -9)")
  assert time.monotonic() - start < within
  return process.returncode, process.stderr.read().strip().splitlines()


@pytest.mark.parametrize("armed", [True, False])
def test_sigterm_ends_a_process_whose_main_thread_is_stuck(armed):
  process = _start(f"""
      from trainer.workdir import preemption
      notice = preemption.PreemptionNotice(grace_seconds=1.0)
      if not {armed}:
        notice.disarm("the final evaluation")
      """, block=True)
  time.sleep(0.5)
  process.send_signal(signal.SIGTERM)
  status, lines = _stopped(process, within=20)
  assert status == 143, lines
  assert lines[-1].startswith("SIGTERM: the main thread did not answer for 1 s"), lines


def test_sigterm_outside_the_step_loop_stops_at_once_and_a_second_one_too():
  process = _start("""
      import time
      from trainer.workdir import preemption
      notice = preemption.PreemptionNotice(grace_seconds=60.0)
      notice.disarm("the final evaluation")
      print("ready", flush=True)
      time.sleep(600)
      """)
  process.send_signal(signal.SIGTERM)
  status, lines = _stopped(process, within=10)
  assert status == 143 and lines[-1].startswith(
      "SIGTERM during the final evaluation: stopped at once (status 143)"), lines
  process = _start("""
      import time
      from trainer.workdir import preemption
      notice = preemption.PreemptionNotice(grace_seconds=60.0)
      print("ready", flush=True)
      while not notice.reached(0):  # the loop: the first SIGTERM asks for a save
        time.sleep(0.05)
      print("saving", flush=True)
      time.sleep(600)  # a save that never ends: the second SIGTERM stops it
      """)
  process.send_signal(signal.SIGTERM)
  assert process.stdout.readline().strip() == "saving"
  process.send_signal(signal.SIGTERM)
  status, lines = _stopped(process, within=10)
  assert status == 143 and lines[-1].startswith("a second SIGTERM: stopped at once"), lines


def test_a_failure_on_another_thread_ends_the_process():
  process = _start("""
      import threading
      from trainer.commands import cli
      cli.end_on_thread_failure()
      def build():
        raise MemoryError("RESOURCE_EXHAUSTED: could not allocate the state")
      threading.Timer(0.5, build).start()
      """, block=True)
  status, lines = _stopped(process, within=20)
  assert status == 1, lines
  assert lines == ["error on thread Thread-1: MemoryError: RESOURCE_EXHAUSTED: could not "
                   "allocate the state; stopping"], lines
