"""The Mosaic GPU kernels compiled for H100 / H200 with no GPU attached: what the PTX says.

`compile_loss` compiles `value_and_grad(cut_bce)` with `backend="pallas_gpu"`
for one GPU of a target (XLA:GPU and Mosaic GPU, ptxas for sm_90a);
`cutbce.kernels.gpu.ptx` reads each kernel's PTX and ptxas report. At two
shapes per dtype the checks are the ones a fast fused kernel must pass:

- tensor cores: the dots are `wgmma` on bfloat16 operands (float32 inputs as
  bfloat16 pieces, never TF32 and never FMA loops), float32 accumulators;
- each logit made once per tile: the sweep issues exactly one logit dot and
  one dh dot per tile, the table kernel one logit dot and one dE dot;
- at most 2 special-function (MUFU) instructions per logit: one ex2 and one
  rcp (softplus' log is a polynomial, sigmoid shares the exponential);
- registers within 255 and no spills (`max_spill_bytes`: none anywhere but
  jax 0.12's float32 dE kernel with a bias, a few bytes);
- no buffer of T x V elements in the compiled program.

Needs jax's CUDA plugin and ptxas (`make test-gpu`); skipped with one line
without them. Numerics are checked in the interpreter (test_mosaic.py).
"""

import os

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import re  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from cutbce.kernels.gpu import compiled as gpu_compiled  # noqa: E402
from cutbce.kernels.gpu import pieces as gpu_pieces  # noqa: E402
from cutbce.kernels.gpu import ptx, targets  # noqa: E402

pytestmark = pytest.mark.skipif(not targets.cuda_plugin_available(),
                                reason="jax's CUDA plugin missing: make test-gpu")

# ptxas spills nothing (the planner takes the widest sweep tile it compiled
# without spills, `mosaic_plan.spill_free_values`) but in jax 0.12's float32
# dE kernel where a bias is added (20-64 B, spill stores + loads counted once:
# one reload per token tile in its loop, read from the SASS; jax 0.10.2: 0 B;
# docs/kernels.md, "Compiled for sm_90a").
F32_TABLE_SPILL_BYTES = 64


def max_spill_bytes(kernel: str, dtype: str) -> int:
  return F32_TABLE_SPILL_BYTES if dtype == "float32" and "table_grad" in kernel else 0

# (target, T, V, D, dtype, L, bias, exclude, num_items)
CASES = [
    ("h200", 2048, 131_072, 64, "bfloat16", 4, True, 2, None),
    ("h100", 4103, 300_007, 128, "bfloat16", 8, False, 0, 299_999),
    ("h200", 2048, 131_072, 64, "float32", 1, True, 0, None),
    ("h100", 1031, 50_001, 50, "float32", 4, False, 3, 50_000),
]


def _compile(case, reduction="mean"):
  target, tokens, vocab, dim, dtype, num_targets, bias, exclude, num_items = case
  return ptx.compile_with_reports(lambda: gpu_compiled.compile_loss(
      target, "pallas_gpu", tokens=tokens, vocab=vocab, dim=dim, dtype=jnp.dtype(dtype),
      num_targets=num_targets, bias=bias, num_exclude=exclude, num_items=num_items,
      reduction=reduction))


def _largest_buffer(hlo_text: str) -> int:
  sizes = [int(np.prod([int(d) for d in m.group(1).split(",")]))
           for m in re.finditer(r"\b(?:f32|bf16|s32|pred)\[([\d,]+)\]", hlo_text)]
  return max(sizes)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-T{c[1]}-V{c[2]}-D{c[3]}-{c[4]}")
def test_tensor_cores_one_logit_per_tile_two_mufu_per_logit(case):
  _, tokens, vocab, dim, dtype, *_ = case
  compiled, reports = _compile(case)
  sweep = [r for name, r in reports.items() if name.startswith("cutbce_mosaic_sweep_loss_dh")]
  table = [r for name, r in reports.items() if name.startswith("cutbce_mosaic_table_grad")]
  assert len(sweep) == 1 and len(table) == 1, sorted(reports)
  sweep, table = sweep[0], table[0]
  # Warp-specialized (one producer, two consumer warpgroups) at all four shapes.
  assert sweep.name.endswith("_ws") and table.name.endswith("_ws"), (sweep.name, table.name)
  block_v = int(re.search(r"_bv(\d+)_", sweep.name).group(1))
  dim_padded = -(-dim // 64) * 64
  products = len(gpu_pieces.PRODUCTS[3 if dtype == "float32" else 1])
  for report in (sweep, table):
    # Tensor cores only, on bfloat16 operands, float32 accumulation.
    assert report.wgmma and all(k.endswith(".f32.bf16.bf16") for k in report.wgmma), report
    assert report.registers <= 255
    assert report.spill_bytes <= max_spill_bytes(report.name, dtype), report
  # One logit dot ([64, block_v], K = Dp) and one dh dot ([64, Dp], K = block_v) per tile.
  assert sweep.wgmma_count() == products * (dim_padded // 16 + block_v // 16), sweep
  assert sweep.wgmma_count(f"m64n{block_v}k16") >= products * dim_padded // 16, sweep
  # The table kernel: one logit dot ([64, 64], K = Dp) and one dE dot ([64, Dp], K = 64).
  assert table.wgmma_count() == products * (dim_padded // 16 + 64 // 16), table
  # MUFU per logit: the PTX of one tile, over the logits one thread holds.
  for report, logits_per_thread in ((sweep, 64 * block_v // 128), (table, 64 * 64 // 128)):
    assert report.mufu_count / logits_per_thread <= 2, report
    assert set(report.mufu) <= {"ex2", "rcp"}, report
  assert _largest_buffer(compiled.as_text()) <= max(tokens * vocab // 8, 2 * vocab * dim), case


def test_two_passes_compile_a_forward_only_sweep():
  _, reports = _compile(("h200", 1024, 65_536, 64, "bfloat16", 2, True, 0, None),
                        reduction="none")
  names = sorted(re.sub(r"(_bv\d+)?_s\d+(_ws)?$", "", name) for name in reports)
  assert names == ["cutbce_mosaic_sweep_dh", "cutbce_mosaic_sweep_loss",
                   "cutbce_mosaic_table_grad"], names
  # bf16 at D = 64: all three kernels warp-specialized (a producer, two consumers).
  assert all(name.endswith("_ws") for name in reports), sorted(reports)
  forward = next(r for n, r in reports.items() if n.startswith("cutbce_mosaic_sweep_loss"))
  # The loss alone: one logit dot per tile, one exp and one reciprocal per logit.
  block_v = int(re.search(r"_bv(\d+)_", forward.name).group(1))
  assert forward.wgmma_count() == 64 // 16, forward
  assert forward.mufu_count / (64 * block_v // 128) <= 2, forward
  assert all(report.spill_bytes == 0 for report in reports.values()), reports


def test_temp_memory_is_flat_in_vocab():
  shapes = dict(tokens=2048, dim=64, dtype=jnp.bfloat16, num_targets=4)
  temp = {}
  for vocab in (131_072, 1_048_576):
    compiled = gpu_compiled.compile_loss("h200", "pallas_gpu", vocab=vocab, **shapes)
    temp[vocab] = compiled.memory_analysis().temp_size_in_bytes
  # What grows with V is the float32 [V, D] table gradient (and its dense
  # part before the sparse one is added): 2 x 4 V D bytes at most.
  rest = {vocab: temp[vocab] - 2 * 4 * vocab * 64 for vocab in temp}
  assert rest[1_048_576] - rest[131_072] <= 1 << 20, temp
  assert temp[131_072] < 4 * 2048 * 131_072 / 16, temp  # far below one f32 logit array


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_softmax_kernels_one_exp_per_logit(dtype):
  _, reports = ptx.compile_with_reports(lambda: gpu_compiled.compile_loss(
      "h200", "pallas_gpu", kind="softmax_ce", tokens=2048, vocab=262_147, dim=64,
      dtype=jnp.dtype(dtype), num_targets=4, bias=True, num_exclude=3, num_items=262_144,
      label_smoothing=0.1))
  names = sorted(re.sub(r"(_bv\d+)?_s\d+(_ws)?$", "", name) for name in reports)
  assert names == ["cutbce_mosaic_softmax_sweep_dh", "cutbce_mosaic_softmax_sweep_loss",
                   "cutbce_mosaic_softmax_table_grad"], names
  for name, report in reports.items():
    assert report.wgmma and all(k.endswith(".f32.bf16.bf16") for k in report.wgmma), report
    assert report.spill_bytes <= max_spill_bytes(name, dtype), report
    block_v = int(re.search(r"_bv(\d+)_", name).group(1)) if "_bv" in name else 64
    logits_per_thread = 64 * block_v // 128
    # exp(x - m) per logit, and the forward's rescale exp(m - m') per row (2 rows a thread).
    assert set(report.mufu) <= {"ex2"}, report
    assert report.mufu_count <= logits_per_thread + 2, report
