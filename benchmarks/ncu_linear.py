"""Launches to profile one at a time under Nsight Compute: torch_tma's linear kernel and cuBLAS, cold caches.

    ncu --clock-control none --nvtx --nvtx-include "profile/" --csv --metrics gpu__time_duration.sum,\
dram__bytes_read.sum,launch__registers_per_thread,launch__occupancy_limit_registers,\
launch__occupancy_limit_shared_mem python benchmarks/ncu_linear.py [--options share1,share2]

ncu serialises kernels and (by default) flushes the caches before each, so gpu__time_duration is one launch on
its own from a cold L2: no PDL overlap, no previous kernel. For each N x K (4096x4096, 4096x14336) and M (1, 16,
64): REPEATS launches of each named KernelOptions variant of ours and of F.linear, with a torch.cuda.synchronize()
between, inside the NVTX range "profile". Each variant's result is checked against float64 first, outside it.
"""

import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_linear import check_close  # noqa: E402

SHAPES = [(4096, 4096), (4096, 14336)]
MS = (1, 16, 64)
REPEATS = 3


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--options", default="share1,share2", help="comma-separated: share1, share2, share3")
    args = parser.parse_args()
    import cutlass
    import torch_tma
    from torch_tma.kernels import linear

    base = linear.DEFAULT_OPTIONS
    variants = {name: base._replace(smem_share=int(name[-1])) for name in args.options.split(",")}
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    cache = torch_tma.default_cache(torch.device("cuda"))
    partials = torch.empty(sm_count * 2 * 2 * linear.M_PADS[-1] * linear.TILE_N, dtype=torch.float32, device="cuda")
    arrivals = torch.zeros(linear.ARRIVAL_WORDS, dtype=torch.int32, device="cuda")
    for n, k in SHAPES:
        weight = (torch.randn(n, k, device="cuda") / math.sqrt(k)).to(torch.bfloat16)
        wmap = cache.get(weight, linear.weight_box(n, k, weight.dtype), swizzle=linear.weight_swizzle(weight.dtype),
                         l2_promotion=linear.DEFAULT_L2_PROMOTION).ptr
        for m in MS:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            for name, o in variants.items():
                compiled = linear.compile_kernel(cutlass.BFloat16, linear.m_pad(m), False, "", o)
                launch = lambda: compiled(x, weight, None, out, partials, arrivals, wmap,  # noqa: E731
                                          linear.grid_size(n, k, sm_count, o))
                out.fill_(math.nan)
                launch()
                check_close(out, x, weight, f"{name} {n}x{k} M={m}")
                profiled(launch, f"ours {name} {n}x{k} M={m}")
            profiled(lambda: F.linear(x, weight), f"cublas {n}x{k} M={m}")


def profiled(launch, label):
    """REPEATS launches inside the NVTX range that ncu is told to profile, each waited for."""
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("profile")
    for _ in range(REPEATS):
        launch()
        torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()
    print(f"{label}: {REPEATS} launches", flush=True)


if __name__ == "__main__":
    main()
