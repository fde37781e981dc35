"""Is the op's cuBLAS fallback slower than F.linear, or is it the order of the measurements?

    python docs/probes/fallback_order.py [--n 57344 --k 8192 --m 64]

In two bench_linear runs (2026-12-03) torch.ops.tma.linear at 57344x8192, M=64 (above the crossover, so the op
calls F.linear) timed 0.945-0.948x of F.linear back to back, and 1.00x in situ. The two run the same cuBLAS call on
the same weights. This times both with bench_linear's own graph timing, alternating, several times in one process,
after one graph of the kernel as in the benchmark. If the gap follows the position and not the provider, the
benchmark's order is the cause.

--after-kernel: each round first times the kernel in situ (bench_linear.in_situ_time_us, what the benchmark times just
before the op), then both providers, the first of them alternating between rounds: is the one timed right after the
kernel the slow one, whichever it is?
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))

import bench_linear  # noqa: E402


def main(argv=None) -> int:
    import torch_tma
    from torch_tma.kernels import linear

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=57344)
    parser.add_argument("--k", type=int, default=8192)
    parser.add_argument("--m", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--after-kernel", action="store_true", help="time the kernel in situ before every round")
    args = parser.parse_args(argv)
    stream = torch.cuda.Stream()
    shape = bench_linear.Shape("probe", args.n, args.k, linear, torch_tma.default_cache(torch.device("cuda")))
    x = torch.randn(args.m, args.k, dtype=bench_linear.DTYPE, device="cuda")
    out = torch.empty(args.m, args.n, dtype=bench_linear.DTYPE, device="cuda")
    print(f"{args.n}x{args.k} M={args.m}, {len(shape.weights)} weight copies, {shape.calls} calls per graph; "
          f"the op falls back: {linear.unsupported_reason(x, shape.weights[0], None)}")
    p50 = bench_linear.graph_time_us(shape.ours(x, out, linear.DEFAULT_L2_PROMOTION), stream)[1]
    print(f"kernel first (as in the benchmark): {p50:.2f} us")
    for i in range(args.rounds):
        if args.after_kernel:
            situ = bench_linear.in_situ_time_us(shape.ours(x, out, linear.DEFAULT_L2_PROMOTION), x, stream)[1]
            print(f"round {i} kernel in situ {situ:8.2f} us", flush=True)
        for name, calls in (("op", shape.op(x)), ("F.linear", shape.cublas(x))) if i % 2 == 0 else \
                           (("F.linear", shape.cublas(x)), ("op", shape.op(x))):
            print(f"round {i} {name:9s} {bench_linear.graph_time_us(calls, stream)[1]:8.2f} us", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
