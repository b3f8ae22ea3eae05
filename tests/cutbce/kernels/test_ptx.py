"""Reading ptxas and PTX reports (`cutbce.kernels.gpu.ptx`): no GPU, no compiler needed."""

from cutbce.kernels.gpu import ptx

# A ptxas -v report as Mosaic GPU dumps it (jax 0.12, a kernel that spills): the
# spill figures appear twice, in the warning and in the function's properties.
_SPILLING = """\
ptxas warning : Registers are spilled to local memory in function 'k_mosaic_gpu_kernel', \
236 bytes spill stores, 228 bytes spill loads
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'k_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for k_mosaic_gpu_kernel
    232 bytes stack frame, 236 bytes spill stores, 228 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 232 bytes cumulative stack size, 1 bytes smem
ptxas info    : Compile time = 313.281 ms
"""

_CLEAN = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'k_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for k_mosaic_gpu_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 203 registers, used 16 barriers, 1 bytes smem
"""


def test_spills_are_counted_once():
  assert ptx.parse_ptxas(_SPILLING) == (168, 236 + 228)
  assert ptx.parse_ptxas(_CLEAN) == (203, 0)


def test_ptx_counts_wgmma_shapes_and_mufu_instructions():
  text = """
    wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%f1}, %rd1, %rd2, 1, 1, 1, 0, 1;
    wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%f1}, %rd3, %rd4, 1, 1, 1, 0, 1;
    ex2.approx.ftz.f32 %f2, %f3;
    @%p1 rcp.approx.ftz.f32 %f4, %f2;
    add.f32 %f5, %f4, %f2;
  """
  wgmma, mufu = ptx.parse_ptx(text)
  assert wgmma == {"m64n128k16.f32.bf16.bf16": 2}
  assert mufu == {"ex2": 1, "rcp": 1}
