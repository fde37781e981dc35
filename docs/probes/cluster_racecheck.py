"""One launch of each kind of cluster-split build, small enough for compute-sanitizer's racecheck.

    compute-sanitizer --tool racecheck python docs/probes/cluster_racecheck.py [--n N --k K --case M:CLUSTER_K ...]

The test suite's cluster tests launch hundreds of kernels; under racecheck a single one of those tests did not
finish in 230 s. This launches three builds once each on a 512 x 1024 weight (4 row tiles,
16 blocks of 64 columns): partials in a buffer of their own (M=1, 4 CTAs per tile), and partials received in CTA 0's
drained ring (M=64, 3 CTAs; M=16, 8 CTAs). Each output is checked against the float64 reference; exit status 1
on a wrong result. The references are computed on the CPU. Each step prints the seconds since the start, so a run
cut short shows whether it stopped in the compile, the launch or the check. On the H200 (2026-12-03) it completes
without the tool and did not finish in 230 s under racecheck; with `--n 128 --k 256 --case 1:2` (one tile, 2 CTAs)
it compiled in 0.5 s, launched, and printed nothing more before a 439 s timeout stopped it (docs/validation.md).
"""

import argparse
import math
import sys
import time

import torch

import torch_tma
from torch_tma.kernels import linear

CASES = [(1, 4), (64, 3), (16, 8)]  # (M, cluster_k)


def main(argv=None) -> int:
    import cutlass

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=512, help="weight rows")
    parser.add_argument("--k", type=int, default=1024, help="weight columns")
    parser.add_argument("--case", action="append", metavar="M:CLUSTER_K",
                        help="M and CTAs per cluster, repeatable (default: 1:4 64:3 16:8)")
    args = parser.parse_args(argv)
    cases = [tuple(int(v) for v in c.split(":")) for c in args.case] if args.case else CASES
    n, k = args.n, args.k
    start = time.perf_counter()

    def say(text):
        print(f"[{time.perf_counter() - start:7.1f} s] {text}", flush=True)

    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    ws = linear._workspace(0)
    failed = False
    for m, cluster_k in cases:
        options = linear.DEFAULT_OPTIONS._replace(cluster_k=cluster_k)
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        weight = (torch.randn(n, k, device="cuda") / math.sqrt(k)).to(torch.bfloat16)
        out = torch.full((m, n), math.nan, dtype=torch.bfloat16, device="cuda")
        weight_map = torch_tma.default_cache(weight.device).get(
            weight, linear.weight_box(n, k, weight.dtype), swizzle=linear.weight_swizzle(weight.dtype),
            l2_promotion=linear.DEFAULT_L2_PROMOTION,
        )
        say(f"M={m} cluster_k={cluster_k} {n}x{k}: compiling")
        compiled = linear.compile_kernel(cutlass.BFloat16, linear.m_pad(m), False, "", options)
        say("compiled; launching")
        compiled(x, weight, None, out, ws.partials, ws.arrivals, weight_map.ptr, linear.grid_size(n, k, sm_count, options))
        torch.cuda.synchronize()
        say("kernel done")
        # references on the CPU, so that racecheck sees no other GPU kernel than ours (it reports hazards in
        # cuBLAS's own kernels: docs/validation.md)
        x, weight = x.cpu(), weight.cpu()
        ref = linear.linear_ref(x, weight, None)
        error = (out.cpu().double() - ref).abs().max().item()
        ok = error <= 2 * (torch.nn.functional.linear(x, weight).double() - ref).abs().max().item() + 1e-2
        failed |= not ok
        say(f"M={m} cluster_k={cluster_k} partials in ring: {linear.partials_in_ring(linear.m_pad(m), cluster_k)} "
            f"max error {error:.3g} {'ok' if ok else 'WRONG'}")
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
