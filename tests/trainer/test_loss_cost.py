"""benchmarks/loss_cost.py: every loss it times is a valid trainer config, and its memory guard."""

import jax
import pytest

from benchmarks import loss_cost
from trainer import train as train_lib
from trainer.config import mesh as config_mesh


@pytest.mark.parametrize("name", sorted(loss_cost.LOSSES))
def test_each_loss_is_a_valid_config_of_the_v6e_run(name):
  config = loss_cost.loss_config(name, batch=8, seq=32)
  config_mesh.check_config(config)  # the schema's rules, on the 8 test devices
  mesh = config_mesh.make_mesh(config)
  settings = train_lib.step_settings(config, mesh=mesh, num_items=876_939)
  assert settings.loss_kind == loss_cost.LOSSES[name]["kind"]
  assert not train_lib.needs_item_counts(settings)  # uniform: the step takes no table
  if settings.sampled is not None:
    assert settings.sampled.num_negatives == loss_cost.LOSSES[name]["num_negatives"]


def test_state_bytes_counts_each_device_shard():
  # V = 10^7, D = 128: table + two AdamW moments (f32), a quarter per device
  # ("model") and replicated over "data": 2 x 3 x 5.12 GB, 30.7 GB (28.6 GiB).
  step = loss_cost.train_bench.Step(loss_cost.loss_config("ssm_128", batch=8, seq=32),
                                    10_000_000)
  table_all_devices = 10_000_000 * 128 * 4 * 3 * 2
  total = loss_cost.state_bytes(step)
  assert table_all_devices <= total < 1.01 * table_all_devices
  assert len(jax.devices()) == 8


def test_interleaved_times_runs_each_step_on_one_shared_state(monkeypatch):
  """Round 0 warms up (not timed), then `repeats` rounds; the state passes from step to step."""
  config = loss_cost.loss_config("ssm_128", batch=8, seq=32)
  steps = {name: loss_cost.train_bench.Step(config, 1_000) for name in ("a", "b")}
  monkeypatch.setattr(loss_cost.train_bench, "random_batch", lambda step, seed: "batch")
  order = []

  def fake_run(name):
    def run(batch):
      assert batch == "batch" and steps[name].state == len(order)  # the previous step's state
      order.append(name)
      steps[name].state = len(order)
      return float(len(order))
    return run

  for name, step in steps.items():
    step.init = lambda step=step: setattr(step, "state", 0)
    step.run = fake_run(name)
  times, warmups = loss_cost.train_bench.interleaved_times(steps, repeats=2)
  assert order == ["a", "b"] * 3
  assert warmups == {"a": 1.0, "b": 2.0} and times == {"a": [3.0, 5.0], "b": [4.0, 6.0]}
  # Steps whose states differ cannot share one.
  other = loss_cost.train_bench.Step(loss_cost.loss_config("ssm_128", batch=8, seq=32), 2_000)
  with pytest.raises(RuntimeError, match="states differ"):
    loss_cost.train_bench.interleaved_times({"a": steps["a"], "c": other}, repeats=1)
