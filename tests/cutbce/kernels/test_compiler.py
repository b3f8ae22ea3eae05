"""`cutbce.kernels.compiler`: named slices and what the TPU compiler reports, parsed."""

import re

import jax.numpy as jnp
import pytest

from cutbce.kernels import compiler, tiling
from cutbce.kernels.tiling import TilePlan

NO_LIBTPU = compiler.libtpu_missing_reason() is not None


def test_scoped_vmem_is_read_from_mosaics_error():
  message = ("RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom: ... Scoped allocation with "
             "size 11.52M and limit 8.00M exceeded scoped vmem limit by 3.52M.")
  # Rounded up to the message's precision: a limit of this many bytes is enough.
  assert compiler.scoped_vmem_bytes(message) == round(11.52 * 2**20) + 2**20 // 100
  assert compiler.scoped_vmem_bytes("Scoped allocation with size 640K and") == 640 * 1024 + 10
  assert compiler.scoped_vmem_bytes("INTERNAL: something else") is None


def test_hbm_shortfall_is_read_from_xla_tpus_error():
  message = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
             "temporaries (67.40G) exceeds available HBM (15.75G)")
  need, have = compiler.hbm_shortfall(message)
  assert (need, have) == (round(67.40 * 2**30), round(15.75 * 2**30))
  assert compiler.hbm_shortfall("Ran out of memory in memory space hbm. Used 20.10G of "
                                "15.75G hbm. Exceeded") == (round(20.1 * 2**30),
                                                           round(15.75 * 2**30))
  assert compiler.hbm_shortfall("Scoped allocation with size 11.52M") is None


def test_unknown_topology_lists_the_known_ones_in_one_line():
  with pytest.raises(ValueError) as error:
    compiler.topology("v7x-9")
  message = str(error.value)
  assert "\n" not in message and "v6e-8" in message and "v5e-16" in message
  with pytest.raises(ValueError, match="num_slices must be a positive int"):
    compiler.topology_devices("v6e-8", num_slices=0)


def test_topologies_name_their_chips_and_hosts():
  assert compiler.topology("v6e-8").chips == 8 and compiler.topology("v6e-8").hosts == 1
  assert compiler.topology("v5e-16").hosts == 4
  for spec in compiler.TOPOLOGIES.values():
    tiling.chip_spec(spec.chip)  # every chip is one the planner knows


def test_target_chip_rejects_an_unknown_chip_and_nests():
  with pytest.raises(ValueError, match="chip must be one of"):
    with tiling.target_chip("v9z"):
      pass
  with tiling.target_chip("v6e"):
    with tiling.target_chip("v5p"):
      assert tiling.chip_spec().name == "v5p"
    assert tiling.chip_spec().name == "v6e"
  assert tiling.chip_spec().name == tiling.DEFAULT_CHIP


@pytest.mark.skipif(NO_LIBTPU, reason="libtpu missing: pip install 'cutbce[tpu]'")
@pytest.mark.parametrize("name,count,kind", [("v5e-8", 8, "TPU v5 lite"),
                                             ("v6e-16", 16, "TPU v6 lite"),
                                             ("v5p-8", 4, "TPU v5"),
                                             ("tpu7x-8", 8, "TPU7x")])
def test_topology_devices_are_the_slices_chips(name, count, kind):
  devices = compiler.topology_devices(name)
  assert len(devices) == count and devices[0].device_kind == kind
  assert compiler.chip_of(devices[0]) == compiler.topology(name).chip
  assert len(compiler.topology_devices(name, num_slices=2)) == 2 * count


@pytest.mark.skipif(NO_LIBTPU, reason="libtpu missing: pip install 'cutbce[tpu]'")
def test_a_slice_libtpu_does_not_know_is_one_clear_error(monkeypatch):
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel

  def unknown(**kwargs):
    raise ValueError(f"Unknown topology {kwargs['topology_name']}\nmore lines")

  monkeypatch.setattr(topologies, "get_topology_desc", unknown)
  with pytest.raises(RuntimeError) as error:
    compiler.topology_devices("tpu7x-8")
  message = str(error.value)
  assert "\n" not in message and "tpu7x:2x2x1" in message and "libtpu" in message
  assert "jax 0.12.0.1" in message and "Unknown topology" in message


@pytest.mark.parametrize("chip", ["v4", "v5p"])
def test_megacore_plans_give_both_tensor_cores_a_chunk(chip):
  for tokens in (200, 4096, 65_536):
    plan = tiling.plan_tiles(tokens, 131_072, 128, "bfloat16", chip=chip)
    assert -(-tokens // plan.token_chunk) >= 2, (chip, tokens, plan)
  # One block_t tile of tokens cannot be split.
  assert tiling.plan_tiles(100, 131_072, 128, "bfloat16", chip=chip).token_chunk >= 100
  # Chips whose devices are one TensorCore keep the single chunk.
  assert tiling.plan_tiles(4096, 131_072, 128, "bfloat16", chip="v6e").token_chunk == 4096


@pytest.mark.skipif(NO_LIBTPU, reason="libtpu missing: pip install 'cutbce[tpu]'")
def test_megacore_kernel_compiles_with_two_parallel_chunks():
  # The kernel's name carries its chunk; its grid's first ("parallel") axis is T / chunk.
  tokens = 4096
  plan = tiling.plan_tiles(tokens, 131_072, 128, "bfloat16", chip="v5p", kernel="forward")
  compiled = compiler.compile_kernel("forward", num_tokens=tokens, vocab=131_072, dim=128,
                                     dtype=jnp.bfloat16, plan=plan,
                                     device=compiler.topology_devices("v5p-8")[0])
  [name] = compiler.mosaic_kernels(compiled)
  chunk = int(re.search(r"_chunk(\d+)", name).group(1))
  assert -(-tokens // chunk) >= 2, name


@pytest.mark.skipif(NO_LIBTPU, reason="libtpu missing: pip install 'cutbce[tpu]'")
@pytest.mark.parametrize("kernel", ["forward", "ranks"])
def test_planned_kernels_compile_for_tpu7x(kernel):
  # One TensorCore of an Ironwood chip: 64 MiB of VMEM, a 256-wide MXU.
  spec = tiling.chip_spec("7x")
  assert spec.vmem_capacity_bytes == 64 * 2**20 and spec.mxu_column_size == 256
  plan = tiling.plan_tiles(4096, 131_072, 128, "bfloat16", chip="7x", kernel=kernel,
                           num_targets=8)
  device = compiler.chip_device("7x")
  assert compiler.chip_of(device) == "7x"
  compiled = compiler.compile_kernel(kernel, num_tokens=4096, vocab=131_072, dim=128,
                                     dtype=jnp.bfloat16, plan=plan, device=device)
  assert len(compiler.mosaic_kernels(compiled)) == 1


def test_fallback_chip_table_matches_jax_where_jax_knows_the_chip():
  for name, fallback in tiling._FALLBACK_CHIPS.items():  # pylint: disable=protected-access
    assert tiling.chip_spec(name) == fallback, name


@pytest.mark.skipif(NO_LIBTPU, reason="libtpu missing: pip install 'cutbce[tpu]'")
@pytest.mark.parametrize("topology,cores", [
    ("v5p-8", 2), ("v4-8", 2), pytest.param("tpu7x-8", 1, marks=pytest.mark.slow)])
def test_compiled_backward_runs_half_the_vocab_sweep_on_each_megacore_tensor_core(topology, cores):
  # 9 vocab tiles (odd: the second core's last step is past V), two token chunks.
  plan = TilePlan(block_v=1024, block_t=256, token_chunk=512, vmem_limit_bytes=12 * 2**20)
  loops = compiler.compiled_kernel_loops("one_pass", topology=topology, num_tokens=1000,
                                         vocab=9_000, dim=128, dtype="bfloat16", plan=plan)
  [(name, trips)] = loops.items()
  tiles = 9
  if cores == 2:
    # Grid (2 "parallel", 5 "arbitrary") split by the compiler: 5 steps per core, not 10.
    assert name.endswith("_cores2"), name
    assert trips == -(-tiles // 2) + 2, (name, trips)
  else:  # TPU7x: one TensorCore per device, the sweep unchanged
    assert "_cores" not in name and trips == tiles + 2, (name, trips)


def test_kernel_loops_reads_the_outermost_loop_of_each_kernel(tmp_path):
  (tmp_path / "17-cutbce_backward_bt8_bv128_chunk16_cores2.3-00-original.txt").write_text(
      "$region0\n    loop: start=0, step=1, limit=7\n        loop: start=0, step=1, limit=2\n")
  (tmp_path / "18-reduce-00-original.txt").write_text("    loop: start=0, step=1, limit=99\n")
  assert compiler.kernel_loops(str(tmp_path)) == {"cutbce_backward_bt8_bv128_chunk16_cores2": 7}
