"""SIGTERM during a run: save and stop at a step, or stop at once; never ignored.

`PreemptionNotice` answers, at the top of every step, whether to save the
state and stop (a preemption, a maintenance event, a user's SIGTERM), with
the same answer on every process. Outside the step loop (`disarm`: the
final evaluation) a SIGTERM stops the process at once, and so does a second
one in the loop. A SIGTERM that finds the main thread blocked in native
code (where no Python handler can run) ends the process after a grace
period (`_Watchdog`): no input makes the trainer need kill -9 (issue 41).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import jax
import numpy as np
import orbax.checkpoint as ocp

# How long a SIGTERM may wait for the main thread before the process is ended.
STOP_GRACE_SECONDS = 30.0

def _preemption_sync_manager_running() -> bool:
  """Whether JAX's preemption sync manager runs in this process.

  It starts with `jax.distributed.initialize()` unless the config
  `jax_enable_preemption_service` is off. `jax._src.distributed` is private;
  the public `reached_preemption_sync_point` answers False both without a
  distributed client and before any notice, so it cannot tell.
  """
  try:
    from jax._src import distributed  # pylint: disable=import-outside-toplevel
  except ImportError:  # pragma: no cover
    return False
  state = distributed.global_state
  return state.client is not None and getattr(state, "preemption_sync_manager", None) is not None


class PreemptionNotice:
  """Whether to save and stop before the step `step`: the same answer on every process.

  Every process must take part in a checkpoint, so all of them stop at the
  same step. Three ways, chosen when it is made (`mode`):

  "sync_point": `jax.distributed` is initialised and its preemption sync
    manager runs (the default). The coordination service's notifier catches
    SIGTERM in C++ (on Cloud TPU this is how a preemption or, with
    Autocheckpoint enabled, a maintenance event is announced), tells every
    process, and agrees on the step after the largest one any process has
    reached. `reached(step)` is orbax's `CheckpointManager.reached_preemption`
    (`multihost_utils.reached_preemption_sync_point`): a local lookup, no
    collective; it must be called at every step, with the same step numbers
    on every process. No Python handler is installed (it would replace the
    notifier's).
  "local": one process and no sync manager (`python -m trainer.main` without
    coordinator flags, the tests). A Python SIGTERM handler sets a flag that
    `reached` reads: nothing to agree on, no collective.
  "combined": several processes but the preemption service is off
    (`jax_enable_preemption_service=False`). The Python handler's flags are
    combined (logical or, one `process_allgather`) only at steps that are
    multiples of `combine_every`, where the loop reads metrics anyway; the
    stop comes up to `combine_every - 1` steps after the signal.
  """

  def __init__(self, *, combine_every: int = 1, grace_seconds: float = STOP_GRACE_SECONDS):
    self._combine_every = max(int(combine_every), 1)
    self._set = False
    self._previous = None
    self._watchdog = None
    self.armed, self.stage = True, "training"
    if _preemption_sync_manager_running():
      self.mode = "sync_point"
    else:
      self.mode = "local" if jax.process_count() == 1 else "combined"
      self._previous = signal.signal(signal.SIGTERM, self._handle)
      self._watchdog = _Watchdog(grace_seconds)

  def disarm(self, stage: str) -> None:
    """From now on (`stage`: what runs) a SIGTERM stops the process at once: no step will
    come to save at."""
    self.armed, self.stage = False, stage

  def _handle(self, signum, frame):
    del frame
    if self._watchdog is not None:
      self._watchdog.answered()
    if self.armed and not self._set:
      self._set = True  # the loop saves and stops before the next step
      return
    why = "a second SIGTERM" if self.armed else f"SIGTERM during {self.stage}"
    print(f"{why}: stopped at once (status {128 + signum}); the last committed checkpoint is "
          "kept", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)

  def reached(self, step: int) -> bool:
    """True when the loop must save the state of `step` and stop (call at every step)."""
    if self.mode == "sync_point":
      return ocp.multihost.reached_preemption(step)
    if self.mode == "local":
      return self._set
    if step % self._combine_every:
      return False
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    return bool(np.any(multihost_utils.process_allgather(np.array(self._set))))

  def close(self) -> None:
    """Puts back the SIGTERM handler found at start (if one was replaced)."""
    if self._watchdog is not None:
      self._watchdog.close()
      self._watchdog = None
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
      self._previous = None



class _Watchdog:
  """Ends the process when a SIGTERM finds the main thread blocked in native code.

  A Python signal handler runs only when the main thread next runs Python;
  one waiting inside XLA (a `device_get` of a state whose creation failed on
  another thread, issue 41) never does, so the SIGTERM would be ignored and
  only kill -9 would end the process. Python's C-level handler also writes
  the signal's number to the wakeup fd (`signal.set_wakeup_fd`) from any
  state of the main thread; this daemon thread reads it, and when the Python
  handler has not run `grace_seconds` later, prints one line and ends the
  process with status 143 (`os._exit`: the main thread cannot unwind).
  Committed checkpoints are whole (orbax's rename), so nothing is lost but
  the steps since the last one.
  """

  def __init__(self, grace_seconds: float):
    self._grace = float(grace_seconds)
    self._read, self._write = os.pipe()
    os.set_blocking(self._write, False)
    self._answers = 0
    self._closed = threading.Event()
    try:
      self._old_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
    except ValueError:  # not the main thread: no watchdog (a library caller's thread)
      self._old_fd = None
      os.close(self._read)
      os.close(self._write)
      self._read = self._write = None
      return
    self._thread = threading.Thread(target=self._watch, name="sigterm-watchdog", daemon=True)
    try:
      self._thread.start()
    except RuntimeError:  # no thread to be had (a process at its memory limit): no watchdog
      signal.set_wakeup_fd(self._old_fd)
      os.close(self._read)
      os.close(self._write)
      self._read = self._write = None

  def answered(self) -> None:
    """Called by the Python handler: the main thread runs Python."""
    self._answers += 1

  def _watch(self) -> None:
    while not self._closed.is_set():
      try:
        data = os.read(self._read, 64)
      except OSError:
        return
      if not data or self._closed.is_set():
        return
      if signal.SIGTERM not in data:
        continue
      answers = self._answers
      if self._closed.wait(self._grace):
        return
      if self._answers == answers:
        print(f"SIGTERM: the main thread did not answer for {self._grace:.0f} s (waiting "
              "inside the runtime); ending the process (status 143) without a checkpoint of "
              "this step", file=sys.stderr, flush=True)
        os._exit(128 + signal.SIGTERM)  # pylint: disable=protected-access

  def close(self) -> None:
    if self._read is None:
      return
    self._closed.set()
    signal.set_wakeup_fd(self._old_fd)
    os.write(self._write, b"\0")  # wakes the reader to see `_closed`
    self._thread.join(timeout=5)
    os.close(self._write)
    os.close(self._read)
    self._read = None
