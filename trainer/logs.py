"""Training logs: progress lines, `WORKDIR/metrics.jsonl` and TensorBoard events.

Only process 0 writes files; every process may print. Each JSONL line is one
object with `step`, a `kind` ("train" or "eval/<split>") and the metric names.
"""

from __future__ import annotations

import json
import os
import time

import jax
from absl import logging


def format_duration(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  hours, rest = divmod(seconds, 3600)
  minutes, seconds = divmod(rest, 60)
  return f"{hours}:{minutes:02d}:{seconds:02d}"


class MetricWriter:
  """Writes scalars to `metrics.jsonl` and TensorBoard (process 0 only)."""

  def __init__(self, workdir: str):
    self._enabled = jax.process_index() == 0
    self._jsonl = None
    self._tensorboard = None
    if self._enabled:
      os.makedirs(workdir, exist_ok=True)
      self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a", encoding="utf-8")
      try:
        import tensorboardX  # pylint: disable=import-outside-toplevel
        self._tensorboard = tensorboardX.SummaryWriter(os.path.join(workdir, "tensorboard"))
      except ImportError:  # pragma: no cover
        logging.warning("tensorboardX is not installed: no TensorBoard event files")

  def write(self, step: int, kind: str, metrics: dict[str, float]) -> None:
    if not self._enabled:
      return
    record = {"step": int(step), "kind": kind}
    record.update({name: float(value) for name, value in metrics.items()})
    self._jsonl.write(json.dumps(record) + "\n")
    self._jsonl.flush()
    if self._tensorboard is not None:
      for name, value in metrics.items():
        self._tensorboard.add_scalar(f"{kind}/{name}", float(value), int(step))
      self._tensorboard.flush()

  def close(self) -> None:
    if self._jsonl is not None:
      self._jsonl.close()
    if self._tensorboard is not None:
      self._tensorboard.close()


class Progress:
  """Rates and ETA between progress lines."""

  def __init__(self, start_step: int, total_steps: int, global_batch: int):
    self._total = total_steps
    self._batch = global_batch
    self._last_step = start_step
    self._last_time = time.perf_counter()

  def line(self, step: int, loss: float, extra: str = "") -> tuple[str, dict[str, float]]:
    now = time.perf_counter()
    elapsed = max(now - self._last_time, 1e-9)
    steps_per_second = (step - self._last_step) / elapsed
    self._last_step, self._last_time = step, now
    eta = (self._total - step) / steps_per_second if steps_per_second > 0 else 0.0
    rates = {"steps_per_second": steps_per_second,
             "examples_per_second": steps_per_second * self._batch}
    text = (f"step {step}/{self._total}  loss {loss:.4f}  {steps_per_second:.2f} steps/s  "
            f"{rates['examples_per_second']:.1f} examples/s  ETA {format_duration(eta)}{extra}")
    return text, rates


def say(message: str) -> None:
  """Logs on every process (absl) and prints on process 0 (stdout)."""
  logging.info("%s", message)
  if jax.process_index() == 0:
    print(message, flush=True)
