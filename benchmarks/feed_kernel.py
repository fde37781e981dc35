"""A feed kernel for in-situ timings that asks for a chosen amount of dynamic shared memory.

In situ (bench_linear.in_situ_times_us) a small elementwise kernel on x runs before every linear call, as a norm or an
activation does in a model. torch's own (x *= 1) asks for no shared memory; the linear kernel's builds that take an SM
alone ask for more than half of it (exclusive_sm), a filled ring (ring_fill) for all of it. An SM splits one pool
between L1 and shared memory and the driver picks the split (the carveout) for the kernels it runs, so a feed that asks
for as much shared memory as the linear kernel and one that asks for none tell apart what the switch between them costs
the call after the feed. make_feed(x, smem_bytes) is that feed: x *= scale (scale 1 at run time, so nothing folds away),
one element per thread, launched on torch's current stream with smem_bytes of dynamic shared memory it never touches.
Sweep run 34 (docs/linear.md): after a 227 KiB feed against a 0 KiB one, ours at M=64 took 0.4-1.0 us less and cuBLAS at
4096x14336 M=64 3.06 us more; the filled ring's in-situ loss at M <= 16 stayed.
"""

import functools

import cutlass
import cutlass.cute as cute
from cutlass import Float32

THREADS = 256
MAX_SMEM_KIB = 227  # the most dynamic shared memory a Hopper CTA may ask for


@cute.kernel
def _scale_kernel(x: cute.Tensor, scale: Float32):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    i = bidx * THREADS + tidx
    if i < cute.size(x):
        x[i] = (x[i].to(Float32) * scale).to(x.element_type)


@cute.jit
def _scale(x: cute.Tensor, scale: Float32, stream, smem_bytes: cutlass.Constexpr):
    blocks = (cute.size(x) + THREADS - 1) // THREADS
    _scale_kernel(x, scale).launch(grid=[blocks, 1, 1], block=[THREADS, 1, 1], smem=smem_bytes, stream=stream)


@functools.cache
def compile_feed(smem_bytes: int):
    """x *= scale on a contiguous 1-D bf16 tensor with smem_bytes of dynamic shared memory (sm_90a, TVM-FFI), compiled
    once per size; called as f(x, scale) on torch's current stream."""
    if not 0 <= smem_bytes <= MAX_SMEM_KIB * 1024:
        raise ValueError(f"compile_feed: smem_bytes must be 0..{MAX_SMEM_KIB * 1024} (a Hopper CTA's most), got "
                         f"{smem_bytes}")
    x = cute.runtime.make_fake_tensor(cutlass.BFloat16, (cute.sym_int(),), stride=(1,), assumed_align=16)
    return cute.compile(_scale, x, Float32(1.0), cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
                        smem_bytes, options="--gpu-arch sm_90a --enable-tvm-ffi")


def make_feed(x, smem_bytes: int, scale: float = 1.0):
    """A no-argument call that runs x *= scale (1: the benchmarks' feed; x a contiguous bf16 CUDA tensor) through the
    feed of smem_bytes."""
    if not x.is_contiguous():
        raise ValueError("make_feed: x must be contiguous")
    compiled, flat = compile_feed(smem_bytes), x.view(-1)
    return functools.partial(compiled, flat, scale)
