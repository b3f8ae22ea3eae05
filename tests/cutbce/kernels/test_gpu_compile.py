"""The Pallas Triton kernels (`backend="pallas_triton"`) through XLA:GPU and Triton for H100 / H200, with no GPU attached.

`cutbce.kernels.gpu.compiled.compile_loss` compiles `value_and_grad(cut_bce)`
(and `target_ranks`) for the one device of a `1x1x1` CUDA topology described
by the project's target config: Triton lowers and compiles every kernel for
sm_90 as it would on the GPU. Over a grid of shapes (D, dtype, ragged T and
V up to 10^7, L, bias, exclude, num_items, variants, one and two passes) the
compiled program holds the expected Triton kernels and no buffer of T x V
elements; its temporaries, but for the float32 [V, D] gradient, do not grow
with V (the same at V and 8 V).
Numerics are checked in interpret mode (test_gpu.py); nothing runs here.

Needs jax's CUDA plugin (`make test-gpu`: the `gpu` extra in .venv-gpu);
skipped with one line without it.
"""

import os

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import re  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from cutbce.kernels.gpu import compiled as gpu_compiled  # noqa: E402
from cutbce.kernels.gpu import targets  # noqa: E402

pytestmark = pytest.mark.skipif(not targets.cuda_plugin_available(),
                                reason="jax's CUDA plugin missing: make test-gpu")

MIB = 2**20


def _largest_buffer(hlo_text: str) -> tuple[int, str]:
  """(elements, text) of the largest array shape in an HLO module's text."""
  best = (0, "")
  for match in re.finditer(r"\b(?:f32|bf16|s32|pred|f16|u32|s8|u8)\[([\d,]+)\]", hlo_text):
    size = int(np.prod([int(d) for d in match.group(1).split(",")]))
    best = max(best, (size, match.group(0)))
  return best


def _check_no_token_by_vocab_buffer(compiled, tokens, vocab, dim):
  size, shape = _largest_buffer(compiled.as_text())
  bound = max(tokens * vocab // 8, 2 * vocab * dim, 4 * tokens * dim)
  assert size <= bound, f"{shape} has {size:,} elements; T x V = {tokens * vocab:,}"


# (target, T, V, D, dtype, L, bias, exclude, num_items, variant, reduction)
CASES = [
    ("h100", 4096, 131_072, 128, "bfloat16", 1, True, 0, None, {}, "mean"),
    ("h200", 4103, 131_071, 64, "bfloat16", 8, False, 5, 131_000, {"label_smoothing": 0.1},
     "mean"),
    ("h100", 513, 50_001, 256, "float32", 8, True, 3, None,
     {"logit_soft_cap": 30.0, "focal_gamma": 2.0}, "none"),
    ("h200", 3001, 300_007, 50, "float32", 1, True, 0, 299_999, {"pos_weight": 4.0}, "sum"),
    pytest.param(("h100", 8192, 10_000_019, 128, "bfloat16", 8, False, 0, None, {}, "mean"),
                 marks=pytest.mark.slow),
]
IDS = [f"{c[0]}-T{c[1]}-V{c[2]}-D{c[3]}-{c[4]}-L{c[5]}-{c[10]}"
       for c in (getattr(case, "values", (case,))[0] for case in CASES)]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_loss_gradients_and_ranks_compile_for_hopper(case):
  target, tokens, vocab, dim, dtype, num_targets, bias, exclude, num_items, variant, reduction = case
  shapes = dict(tokens=tokens, vocab=vocab, dim=dim, dtype=jnp.dtype(dtype),
                num_targets=num_targets, bias=bias, num_exclude=exclude, num_items=num_items)
  loss = gpu_compiled.compile_loss(target, "pallas_triton", reduction=reduction, **shapes, **variant)
  ranks = gpu_compiled.compile_loss(target, "pallas_triton", ranks=True, **shapes)
  kernels = sorted(name.split("_bt")[0] for name in targets.triton_kernels(loss))
  if reduction == "none":  # two passes: forward, then dh and dE
    assert kernels == ["cutbce_gpu_de", "cutbce_gpu_dh", "cutbce_gpu_forward"], kernels
  else:  # one pass: dh (with the loss sums) and dE
    assert kernels == ["cutbce_gpu_de", "cutbce_gpu_dh"], kernels
  # The rank counts, and the targets' logits read from the same tiles (exact ties).
  assert sorted(n.split("_bt")[0] for n in targets.triton_kernels(ranks)) == [
      "cutbce_gpu_rank_logits", "cutbce_gpu_ranks"]
  _check_no_token_by_vocab_buffer(loss, tokens, vocab, dim)
  _check_no_token_by_vocab_buffer(ranks, tokens, vocab, dim)


# (target, T, V, D, dtype, L, bias, exclude, num_items, options)
SOFTMAX_CASES = [
    ("h100", 4096, 131_072, 128, "bfloat16", 8, True, 0, None, {}),
    ("h200", 1031, 1_000_003, 64, "float32", 4, False, 5, 999_999,
     {"label_smoothing": 0.1, "target_reduction": "mean"}),
]


@pytest.mark.parametrize("case", SOFTMAX_CASES, ids=lambda c: f"{c[0]}-T{c[1]}-V{c[2]}-{c[4]}")
def test_softmax_ce_compiles_for_hopper(case):
  target, tokens, vocab, dim, dtype, num_targets, bias, exclude, num_items, options = case
  loss = gpu_compiled.compile_loss(
      target, "pallas_triton", kind="softmax_ce", tokens=tokens, vocab=vocab, dim=dim,
      dtype=jnp.dtype(dtype), num_targets=num_targets, bias=bias, num_exclude=exclude,
      num_items=num_items, **options)
  kernels = sorted(name.split("_bt")[0] for name in targets.triton_kernels(loss))
  assert kernels == ["cutbce_gpu_softmax_de", "cutbce_gpu_softmax_dh",
                     "cutbce_gpu_softmax_forward"], kernels
  _check_no_token_by_vocab_buffer(loss, tokens, vocab, dim)


@pytest.mark.parametrize("target", ["h100", "h200"])
def test_temp_memory_is_flat_in_vocab_and_far_below_dense(target):
  shapes = dict(tokens=4096, dim=128, dtype=jnp.bfloat16, num_targets=8)
  temp = {}
  for backend, vocab in (("pallas_triton", 131_072), ("pallas_triton", 1_048_576),
                         ("xla", 131_072), ("dense", 131_072)):
    compiled = gpu_compiled.compile_loss(target, backend, vocab=vocab, **shapes)
    temp[backend, vocab] = compiled.memory_analysis().temp_size_in_bytes
  # The one temporary that grows with V is the float32 [V, D] table gradient
  # (the contract's f32 dE, cast to bf16 at the end; the XLA path has it too).
  # Everything else is flat: 8x the catalog changes it by less than 1 MiB.
  rest = {vocab: temp["pallas_triton", vocab] - 4 * vocab * 128 for vocab in (131_072, 1_048_576)}
  assert abs(rest[1_048_576] - rest[131_072]) <= MIB, temp
  assert rest[131_072] <= 4 * 4096 * 128 * 8, temp  # a few f32 [T, D] blocks at most
  small = temp["pallas_triton", 131_072]
  one_logit_array = 4 * 4096 * 131_072
  assert temp["dense", 131_072] >= one_logit_array, temp
  assert small < one_logit_array / 16, temp
