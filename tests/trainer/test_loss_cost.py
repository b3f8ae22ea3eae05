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
