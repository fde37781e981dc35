"""Launches to profile one at a time under Nsight Compute: torch_tma's linear kernel and cuBLAS.

    ncu --clock-control none --nvtx --nvtx-include "profile/" --csv --metrics gpu__time_duration.sum,\
dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_op_read.sum,lts__t_sector_op_read_hit_rate.pct \
python benchmarks/ncu_linear.py [--variant shipped --variant evict-normal] [--shapes 14336x4096] [--ms 1 16 64]
    python benchmarks/ncu_linear.py --summarize ncu.csv run.log   # ncu --log-file ncu.csv ... > run.log

Each variant is one of benchmarks/sweep_linear.py's (default: "shipped", linear.DEFAULT_OPTIONS), resolved per shape
and M by linear.options_for as the op resolves it, on a descriptor with the op's L2 promotion. ncu serialises
kernels and (by default, --cache-control all) flushes the caches before each, so a profiled launch is one launch on
its own from a cold L2: no PDL overlap, no previous kernel; with --cache-control none the L2 keeps what the launch
before left. For each shape and M: REPEATS launches of each variant and of F.linear, with a torch.cuda.synchronize()
between, inside the NVTX range "profile". Each variant's result is checked against float64 first, outside it.
"""

import argparse
import csv
import lzma
import math
import os
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_linear import DTYPE, check_close  # noqa: E402
import sweep_linear  # noqa: E402

SHAPES = ["4096x4096", "4096x14336"]
MS = (1, 16, 64)
REPEATS = 3
OUR_KERNEL = "kernel_cutlass_kernel_torch_tma"  # how ncu names our kernel's launches


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variant", action="append", help="a sweep_linear variant (repeatable; default shipped)")
    parser.add_argument("--shapes", nargs="+", metavar="NxK", default=SHAPES, help=f"of sweep_linear.SHAPES "
                        f"(default {' '.join(SHAPES)})")
    parser.add_argument("--ms", type=int, nargs="+", default=list(MS), help=f"M values (default {list(MS)})")
    parser.add_argument("--summarize", nargs=2, metavar=("CSV", "LOG"), help="only print a summary of ncu's --csv "
                        "output, its launches named by this script's output of the same run (any machine)")
    args = parser.parse_args()
    if args.summarize:
        summarize(*args.summarize)
        return
    shapes = sweep_linear.select_shapes(parser, args.shapes)
    import cutlass
    import torch_tma
    from torch_tma.kernels import linear

    table = sweep_linear.select_variants(parser, sweep_linear.variants(linear), args.variant or ["shipped"])
    assert torch.cuda.get_device_capability() == (9, 0), "this script is for Hopper (sm_90)"
    device = torch.device("cuda")
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    capacity = linear.cluster_capacity(device.index or 0)
    cache = torch_tma.default_cache(device)
    ctas_per_sm = max(o.ctas_per_sm for o in table.values())
    partials = torch.empty(sm_count * ctas_per_sm * 2 * linear.M_PADS[-1] * linear.TILE_N, dtype=torch.float32,
                           device=device)
    arrivals = torch.zeros(linear.ARRIVAL_WORDS, dtype=torch.int32, device=device)
    for n, k in shapes:
        weight = (torch.randn(n, k, device=device) / math.sqrt(k)).to(DTYPE)
        promotion = linear.default_l2_promotion(device.index or 0, n, k, DTYPE)  # the op's
        wmap = cache.get(weight, linear.weight_box(n, k, DTYPE), swizzle=linear.weight_swizzle(DTYPE),
                         l2_promotion=promotion).ptr
        for m in args.ms:
            x = torch.randn(m, k, dtype=DTYPE, device=device)
            out = torch.empty(m, n, dtype=DTYPE, device=device)
            for name, o in table.items():
                o = linear.options_for(o, n, k, m, sm_count, capacity)
                compiled = linear.compile_kernel(cutlass.BFloat16, linear.m_pad(m), False, "", o)
                num_ctas = linear.grid_size(n, k, sm_count, o)
                launch = lambda: compiled(x, weight, None, out, partials, arrivals, wmap, num_ctas)  # noqa: E731
                out.fill_(math.nan)
                launch()
                check_close(out, x, weight, f"{name} {n}x{k} M={m}")
                profiled(launch, f"ours {name} {n}x{k} M={m} ({num_ctas} CTAs, cluster_k {o.cluster_k}, "
                                 f"{promotion.name})")
            profiled(lambda: F.linear(x, weight), f"cublas {n}x{k} M={m}")


def profiled(launch, label):
    """REPEATS launches inside the NVTX range that ncu is told to profile, each waited for; the line printed names
    them for summarize."""
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("profile")
    for _ in range(REPEATS):
        launch()
        torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()
    print(f"{label}: {REPEATS} launches", flush=True)


def summarize(path, log):
    """One line per profiled label and kernel from ncu's --csv output (the metrics of the module docstring): the
    launches' time range, DRAM bytes read and written, and L2 read hit rate, each as min-max over the launches.

    ncu's CSV lists launches in order but not which call made them; log, this script's output, does ("LABEL: N
    launches" lines, in the same order): N kernels of ours for an "ours" line, and for a "cublas" line every kernel
    up to the next of ours (cuBLAS may launch two per call)."""
    with (lzma.open if path.endswith(".xz") else open)(path, "rt") as f:  # docs/results keeps them as .csv.xz
        rows = [r for r in csv.reader(f) if len(r) > 16 and r[0].isdigit()]
    launches = {}  # ncu's launch ID -> [kernel, {metric: value}], in launch order
    for r in rows:
        launches.setdefault(r[0], [r[6][:48], {}])[1][r[14]] = float(r[16].replace(",", ""))
    ordered = [(m[1], int(m[2])) for m in re.finditer(r"^(.*): (\d+) launches$", Path(log).read_text(), re.M)]
    kernels, labels, i = list(launches.values()), [], 0
    for label, count in ordered:
        start = i
        while i < len(kernels) and (i - start < count if label.startswith("ours")
                                    else not kernels[i][0].startswith(OUR_KERNEL)):
            i += 1
        labels += [label] * (i - start)
    if i != len(kernels):
        raise SystemExit(f"{log} names {i} of the {len(kernels)} launches in {path}: not this run's log")
    groups = {}
    for label, (kernel, metrics) in zip(labels, kernels):
        groups.setdefault((label, kernel), []).append(metrics)
    columns = (("gpu__time_duration.sum", "us", 1e-3), ("dram__bytes_read.sum", "MB read", 1e-6),
               ("dram__bytes_write.sum", "MB written", 1e-6), ("lts__t_sector_op_read_hit_rate.pct", "% L2 hit", 1))
    for (label, kernel), runs in groups.items():
        cells = []
        for metric, unit, scale in columns:
            values = [m[metric] * scale for m in runs if metric in m]
            if values:
                cells.append(f"{min(values):.2f}-{max(values):.2f} {unit}")
        print(f"{label} | {kernel} | {len(runs)} launches | " + " | ".join(cells))


if __name__ == "__main__":
    main()
