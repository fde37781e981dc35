"""Sweep of the linear kernel's static options (torch_tma.kernels.linear.KernelOptions) on the H200.

    timeout 300 python benchmarks/sweep_linear.py [--csv PATH] [--variant NAME ...] [--in-situ NAME ...] [--ms M ...]
        [--shapes NxK ...] [--feed-smem-kib KIB]

(--variant and --in-situ repeat: --variant shipped --variant no-lead.)

For each variant (the shipped defaults, where cluster and one-CTA-per-tile launches of at most three quarters of the SMs
trigger the next launch once the TMA warp has issued its last weight load (at M <= 16 three loads before it,
KernelOptions.trigger_lead), but for long runs on the half-SM ring (KernelOptions.exclusive_trigger_grid,
exclusive_max_blocks), and every such launch that fits one CTA per SM asks for more than half an SM's shared memory, so
the next launch's CTAs start only on SMs it leaves free, and keeps the partials its CTAs receive in the half of the SM
their ring leaves (KernelOptions.partials_beside, beside_small); "exclusive-trigger": every such launch that fits one
CTA per SM does, long runs on a half-SM ring too; "half-trigger": the shipped policy before, launches of at most half
the SMs trigger after their last load and share their SMs (load_trigger_grid=0.5); "load-trigger": every cluster and
one-CTA-per-tile build triggers that way and shares its SMs; "no-trigger": none triggers before exit; "no-lead": those
that trigger after their last load do so right after it at every M (shipped: 3 loads before it at M <= 16,
KernelOptions.trigger_lead); "lead-8", "lead-5" and "lead-2": 8, 5 and 2 loads before it at M <= 16; "reduce-cta0": the
cluster split reducing on CTA 0, as shipped before sweep run 24 (shipped now: every CTA sums and stores a share,
KernelOptions.cluster_scatter); "ring-partials": every cluster build's partials in the receiver's drained ring
(KernelOptions.own_partial_bytes=0); "no-beside": launches alone on their SMs receive partials above OWN_PARTIAL_BYTES
in their drained ring, as before sweep run 26 (shipped since: in a buffer in the SM's other half,
KernelOptions.partials_beside); "no-beside-small": smaller partials in a buffer inside the ring's share, as before sweep
run 27 (shipped since: beside it too, the ring gaining their stages, KernelOptions.beside_small); "half-grid": at most 2
CTAs per row tile (cluster_max_k=2); "x-evict-last": x loads marked evict-last in L2; "full-ring": the whole SM's shared
memory for the ring; "full-ring-wgmma2": that and a second stage's wgmma in flight (at every M; shipped only for M=64
runs of 100 blocks or more, KernelOptions.deep_ring_blocks); "wgmma2": a second stage's wgmma in flight on the shipped
rings at every M (shipped at M 33-64, KernelOptions.wgmma2_min_m_pad); "no-wgmma2-64": at M=64 only on the deep ring, as
before stop 36; "no-deep-ring": M=64 long runs on the half-SM ring (two wgmma in flight, as every M=64 build);
"deep-64": the deep ring from 64 blocks per CTA (shipped: 100, KernelOptions.deep_ring_blocks); "deep-tile-64": that for
launches of one CTA per row tile only (KernelOptions.deep_ring_tile_blocks); "scatter-last" and "scatter-last-64": the
cluster's last rank owns every piece of the reduce-scatter at M <= 16 and at every M (shipped: equal shares,
KernelOptions.scatter_last_max_m_pad; "equal-shares" named the shipped cut in sweep run 51, where "shipped" was
"scatter-last"); "stream-k": stream-K at every shape (every SM streams an equal run, so every GPC a share in proportion
to its SMs); "stream-k-deep": that with the whole SM's ring and two wgmma in flight; "fill": launches with their
partials beside the ring give it all the shared memory the partials leave at every M (KernelOptions.ring_fill; shipped:
for m_pad 64, M 33-64); "no-fill": at no M, as before sweep run 32; "direct": builds of one CTA per row tile store y one
output at a time, as before sweep run 41 (shipped since: through shared memory in coalesced 16-byte runs,
KernelOptions.staged_store); "two-wg": two consumer warpgroups of 64 weight rows each; "two-wg-full-ring-wgmma2": that
and the full ring with two wgmma in flight; earlier runs also swept the weight loaded without the L2 evict-first hint,
the release form of the cluster barrier's entry arrive, the descriptor prefetch, the TMA atom's kernel-parameter
descriptor instead of torch_tma's, stream-K, clusters that do not all run at once, the cluster split's bounds, a second
wgmma in flight on the half-SM ring, PDL, the descriptor fence scope, shares of the shared memory and two CTAs per SM,
and options since taken out of the kernel (x multicast, a bounded steady depth, a deep ring chosen per CTA, a smaller
first request, the trigger from the MMA warps; the code that ran them is commit 2dc719b): see docs/linear.md; every
variant is built from the current DEFAULT_OPTIONS, so at M 33-64 on long runs "full-ring", "x-evict-last" and "two-wg"
now get the deep ring too), each shape N x K in SHAPES (or --shapes) and M in MS (or --ms) (bf16, no bias): first
validate the variant's output against the float64 reference (|ours - ref64| <= 2 |F.linear - ref64| + eps * max|ref64|,
output poisoned with NaN before the launch), then time it as CUDA events around replays of one CUDA graph of
back-to-back calls, each on the next of several weight copies (together ~7x the 60 MB L2). cuBLAS (F.linear) is timed
the same way in the same run. In each cell the variants' and cuBLAS's graphs are replayed in turns (bench_linear's
interleaved_time_us; before stop 48 one after another, cuBLAS last), so a drift of the GPU's clocks reaches them alike.
Variants launch the compiled kernel directly with their own split-K workspace and output, so the host path
(linear_out) is not involved.

"In situ" (the IN_SITU variants, or those named by --in-situ, and cuBLAS): the same graph with a small elementwise
kernel on x before every call (x *= 1), as in a model where a norm or an activation feeds each linear layer; the time
per call is the pair's minus the small kernel's alone (--feed-smem-kib: the small kernel is benchmarks/feed_kernel.py's,
asking for that much shared memory, to see what the SM's L1/shared split costs). Back-to-back calls let a PDL launch
overlap the previous call; in situ there is no previous call of ours to overlap, so this is what a decode step sees.

Prints one table: per variant and cell, GPU microseconds per call (median of the replays) and the speedup
over cuBLAS, then the geomean speedup. A variant whose output is wrong is reported as FAIL in its cells
and not timed; the script then exits with status 1 after printing everything.
"""

import argparse
import csv
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_linear import DTYPE, Shape, check_close, in_situ_times_us, interleaved_time_us  # noqa: E402

# (N, K): Llama-3-8B's layers as the decode benchmark runs them (k/v 1024x4096, q/o, gate/up 14336x4096, down),
# the fused qkv and gate_up of bench_linear, and two Llama-3-70B ones
SHAPES = [(1024, 4096), (4096, 4096), (6144, 4096), (14336, 4096), (4096, 14336), (28672, 4096), (10240, 8192),
          (8192, 28672), (57344, 8192)]
MS = (1, 16, 32, 64)
IN_SITU = ("shipped",)  # the trigger does not reach a small kernel launched without PDL
CALLS_PER_GRAPH = 40


def variants(linear):
    """name -> KernelOptions; "shipped" is linear.DEFAULT_OPTIONS, the others differ from it as named. Each is
    resolved per shape by linear.options_for (cluster split or stream-K)."""
    shipped = linear.DEFAULT_OPTIONS
    return {
        "shipped": shipped,
        # every one that fits one CTA per SM triggers after its last load and is alone on its SMs
        "exclusive-trigger": shipped._replace(exclusive_trigger_grid=1.0, exclusive_max_blocks=0),
        # launches of at most half the SMs trigger after their last load, sharing their SMs (shipped until run 17)
        "half-trigger": shipped._replace(exclusive_trigger_grid=0.0, load_trigger_grid=0.5, trigger_lead=0),
        # every cluster and one-CTA-per-tile build triggers the next launch after its last weight load, not at exit
        "load-trigger": shipped._replace(exclusive_trigger_grid=0.0, load_trigger=True, trigger_lead=0),
        "no-trigger": shipped._replace(exclusive_trigger_grid=0.0),  # every one triggers at exit
        # the launches that trigger after their last load do so after it (not 3 loads before it) at every M, or 8
        # loads before it at M <= 16 (run 21's "lead-3" and "lead-8" led at every M; "lead-3" is shipped for M <= 16)
        "no-lead": shipped._replace(trigger_lead=0),
        "lead-8": shipped._replace(trigger_lead=8),
        "lead-5": shipped._replace(trigger_lead=5),
        "lead-2": shipped._replace(trigger_lead=2),
        # CTA 0 of a cluster receives every partial and sums and stores all of the row tile's y (shipped before run 24:
        # now every CTA sums and stores a share of it, a reduce-scatter, KernelOptions.cluster_scatter)
        "reduce-cta0": shipped._replace(cluster_scatter=False),
        # every cluster build's partials land in the drained ring (own_partial_bytes=0): at M=16 with 3 CTAs per tile,
        # 6 stages of the half-SM ring instead of 5, senders waiting for the cluster's slowest CTA
        "ring-partials": shipped._replace(own_partial_bytes=0),
        # partials that would land in the drained ring do so in launches alone on their SMs too (shipped since sweep
        # run 26: a buffer of their own in the SM's other half, KernelOptions.partials_beside)
        "no-beside": shipped._replace(partials_beside=False),
        # ... but partials small enough for a buffer in the ring's share stay there (shipped since sweep run 27: they
        # move out too and the ring gains their stages, KernelOptions.beside_small)
        "no-beside-small": shipped._replace(beside_small=False),
        # launches with their partials beside the ring give the ring all the SM's shared memory the partials leave
        # (KernelOptions.ring_fill; shipped for m_pad 64 since sweep run 32) at every M; "no-fill": at no M
        "fill": shipped._replace(ring_fill=True, ring_fill_min_m_pad=linear.M_PADS[0]),
        "no-fill": shipped._replace(ring_fill=False),
        # one-CTA-per-tile builds store y one 2-byte output at a time, not through shared memory in 16-byte runs
        # (KernelOptions.staged_store, shipped since sweep run 41; "staged" named it in run 40)
        "direct": shipped._replace(staged_store=False),
        # at most 2 CTAs per row tile: 4096x4096 on 64 SMs, so two launches in a row fit beside each other
        "half-grid": shipped._replace(cluster_max_k=2),
        "x-evict-last": shipped._replace(x_eviction="last"),  # x loads marked evict-last in L2
        "evict-normal": shipped._replace(weight_eviction="normal"),  # weight loads without the evict-first hint
        "full-ring": shipped._replace(smem_share=1),  # the whole SM's shared memory for the ring
        # ... and a second stage's wgmma in flight, which the half-SM ring could not afford (run 5)
        "full-ring-wgmma2": shipped._replace(smem_share=1, wgmma_in_flight=2),
        # a second stage's wgmma in flight on the shipped rings (half the SM's at M <= 32 and short M=64 runs)
        "wgmma2": shipped._replace(wgmma_in_flight=2),
        # no second wgmma in flight at M=64 but on the deep ring (shipped until stop 36: KernelOptions.wgmma2_min_m_pad)
        "no-wgmma2-64": shipped._replace(wgmma2_min_m_pad=0),
        "two-wg": shipped._replace(consumer_warpgroups=2),  # two consumer warpgroups, 64 weight rows each
        "two-wg-full-ring-wgmma2": shipped._replace(consumer_warpgroups=2, smem_share=1, wgmma_in_flight=2),
        "no-deep-ring": shipped._replace(deep_ring_blocks=0),  # M=64 long runs keep the half-SM ring
        # the deep ring from 64 blocks per CTA (shipped: 100): at M=64 on an H200, 14336x4096 (one CTA per row tile,
        # 64 blocks, 4 stages on the half ring) and 4096x14336 (3 CTAs per tile, 74-75 blocks) take it
        "deep-64": shipped._replace(deep_ring_blocks=64),
        # ... only for launches of one CTA per row tile (KernelOptions.deep_ring_tile_blocks): 14336x4096 at M=64
        "deep-tile-64": shipped._replace(deep_ring_tile_blocks=64),
        # the reduce-scatter's pieces all owned by the cluster's last rank, the one that streams the most blocks and
        # ends last (KernelOptions.scatter_last_max_m_pad), at M <= 16 and at every M
        "scatter-last": shipped._replace(scatter_last_max_m_pad=16),
        "scatter-last-64": shipped._replace(scatter_last_max_m_pad=64),
        # stream-K at every shape (equal runs of weight blocks on every SM, partials summed through global memory by
        # the last arriver; shipped only where row tiles outnumber two per SM): a launch of fewer row tiles than SMs
        # then uses every SM, so every GPC streams a share in proportion to its SMs
        "stream-k": shipped._replace(cluster_split=0),
        # ... with the whole SM's ring and a second stage's wgmma in flight (the M=64 deep ring)
        "stream-k-deep": shipped._replace(cluster_split=0, smem_share=1, wgmma_in_flight=2),
    }


def select_variants(parser, table, names):
    """The entries of table named in names (all of them for none); an unknown name is a usage error."""
    unknown = set(names or ()) - set(table)
    if unknown:
        parser.error(f"unknown variant(s) {sorted(unknown)}; known: {sorted(table)}")
    return {name: o for name, o in table.items() if not names or name in names}


def select_shapes(parser, names):
    """The (N, K) of SHAPES named "NxK" in names (all of them for none); anything else is a usage error."""
    known = {f"{n}x{k}": (n, k) for n, k in SHAPES}
    unknown = [name for name in names or () if name not in known]
    if unknown:
        parser.error(f"unknown shape(s) {unknown}; known: {list(known)}")
    return [known[name] for name in names] if names else list(SHAPES)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--csv", help="also write one row per (variant, shape, M) here")
    parser.add_argument("--variant", action="append", help="only this variant (repeatable; default all)")
    parser.add_argument("--in-situ", action="append", help=f"time this variant in situ too (repeatable; default "
                                                           f"{list(IN_SITU)})")
    parser.add_argument("--ms", type=int, nargs="+", default=list(MS), help=f"M values (default {list(MS)})")
    parser.add_argument("--shapes", nargs="+", metavar="NxK", help="only these of SHAPES (default all)")
    parser.add_argument("--feed-smem-kib", type=int, metavar="KIB",
                        help="in situ, feed each call with benchmarks/feed_kernel.py's x *= 1 asking for this many KiB "
                             "of dynamic shared memory instead of torch's x.mul_(1)")
    args = parser.parse_args()
    shapes = select_shapes(parser, args.shapes)
    feed_name = "x.mul_(1)"
    if args.feed_smem_kib is not None:
        from feed_kernel import MAX_SMEM_KIB, make_feed
        if not 0 <= args.feed_smem_kib <= MAX_SMEM_KIB:
            parser.error(f"--feed-smem-kib must be 0..{MAX_SMEM_KIB}, got {args.feed_smem_kib}")
        feed_name = f"feed_kernel x *= 1 asking {args.feed_smem_kib} KiB of shared memory"

    import cutlass
    import torch_tma
    from torch_tma.kernels import linear

    assert torch.cuda.get_device_capability() == (9, 0), "this sweep is for Hopper (sm_90)"
    started = time.perf_counter()
    device = torch.device("cuda")
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    capacity = linear.cluster_capacity(device.index or 0)
    print(f"clusters of 1..{linear.MAX_CLUSTER_K} CTAs the GPU runs at once, one CTA per SM: {capacity}", flush=True)
    cache = torch_tma.default_cache(device)
    stream = torch.cuda.Stream()
    table = select_variants(parser, variants(linear), args.variant)
    in_situ_names = tuple(args.in_situ or IN_SITU)
    ms = tuple(args.ms)
    # One workspace per variant: partials for 2 tiles per CTA at the largest grid, counters zero.
    workspaces = {
        name: (torch.empty(sm_count * o.ctas_per_sm * 2 * linear.M_PADS[-1] * linear.TILE_N, dtype=torch.float32,
                           device=device),
               torch.zeros(linear.ARRIVAL_WORDS, dtype=torch.int32, device=device))
        for name, o in table.items()
    }
    for o in table.values():  # compile up front so compile time shows apart from measurement
        for (n, k), m in ((shape, m) for shape in shapes for m in ms):
            linear.compile_kernel(cutlass.BFloat16, linear.m_pad(m), False, "",
                                  linear.options_for(o, n, k, m, sm_count, capacity))
    print(f"compiled {linear.compile_kernel.cache_info().currsize} kernels [{time.perf_counter() - started:.0f} s]",
          flush=True)

    results = {}  # (variant or "cublas", N, K, M) -> us, or None for a wrong result
    in_situ = {}  # the same keys, IN_SITU variants and cuBLAS only: us per call after a small kernel
    failed = []
    for n, k in shapes:
        shape = Shape(n, k, linear, cache, CALLS_PER_GRAPH)
        for m in ms:
            x = torch.randn(m, k, dtype=DTYPE, device=device)
            feed = None if args.feed_smem_kib is None else make_feed(x, args.feed_smem_kib * 1024)
            lists, outs = {}, {}  # the variants that computed right, then cuBLAS: their calls; the variants' outputs
            for name, o in table.items():
                o = linear.options_for(o, n, k, m, sm_count, capacity)
                compiled = linear.compile_kernel(cutlass.BFloat16, linear.m_pad(m), False, "", o)
                partials, arrivals = workspaces[name]
                num_ctas = linear.grid_size(n, k, sm_count, o)
                out = torch.empty(m, n, dtype=DTYPE, device=device)
                calls = shape.launches(compiled, x, out, partials, arrivals, num_ctas)
                out.fill_(math.nan)
                calls[0]()
                torch.cuda.synchronize()
                try:
                    check_close(out, x, shape.weights[0], f"{name} {n}x{k} M={m}")
                    if int(arrivals.abs().sum()):
                        raise AssertionError(f"{name} {n}x{k} M={m}: split-K arrival counters not reset")
                except AssertionError as e:
                    print(f"FAIL {e}", flush=True)
                    failed.append(name)
                    results[name, n, k, m] = in_situ[name, n, k, m] = None
                    continue
                lists[name], outs[name] = calls, out
            lists["cublas"] = shape.cublas(x)
            for key, times in zip(lists, interleaved_time_us(list(lists.values()), stream)):
                results[key, n, k, m] = times[1]
            situ = [key for key in lists if key in in_situ_names or key == "cublas"]
            for key, times in zip(situ, in_situ_times_us([lists[key] for key in situ], x, stream, feed=feed)):
                in_situ[key, n, k, m] = times[1]
            for name, out in outs.items():  # each graph's last replay must be right too (PDL overlaps launches there)
                check_close(out, x, shape.last_weight, f"{name} {n}x{k} M={m} after replays")
            print(f"{n}x{k} M={m} done [{time.perf_counter() - started:.0f} s]", flush=True)
        del shape
        torch.cuda.empty_cache()

    cells = [(n, k, m) for n, k in shapes for m in ms]
    for title, res, names in (("back-to-back calls", results, list(table)),
                              (f"in situ (a small kernel before each call: {feed_name})", in_situ,
                               [v for v in table if v in in_situ_names])):
        print(f"\n{title}: GPU us per call (median over graph replays) and speedup vs cuBLAS; "
              f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
        print(f"{'variant':18s} {'N x K':>11s}" + "".join(f"{f'M={m}':>16s}" for m in ms))
        for n, k in shapes:
            print(f"{'cublas':18s} {f'{n}x{k}':>11s}" + "".join(f"{res['cublas', n, k, m]:>16.2f}" for m in ms))
            for name in names:
                row = ""
                for m in ms:
                    us = res[name, n, k, m]
                    row += f"{'FAIL':>16s}" if us is None else f"{us:>9.2f} {res['cublas', n, k, m] / us:>5.2f}x"
                print(f"{name:18s} {f'{n}x{k}':>11s}{row}")
        for name in names:
            speedups = [res["cublas", n, k, m] / res[name, n, k, m] for n, k, m in cells
                        if res[name, n, k, m] is not None]
            geomean = math.exp(sum(map(math.log, speedups)) / len(speedups)) if len(speedups) == len(cells) else math.nan
            worst = min(speedups) if speedups else math.nan
            print(f"{name:18s} geomean speedup {geomean:6.3f}x  worst cell {worst:5.2f}x")
    print(f"[{time.perf_counter() - started:.0f} s]")

    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["variant", "options", "N", "K", "M", "us_p50", "cublas_us_p50", "in_situ_us_p50",
                             "cublas_in_situ_us_p50"])
            for name, o in table.items():
                for n, k, m in cells:
                    us, situ = results[name, n, k, m], in_situ.get((name, n, k, m), "")
                    writer.writerow([name, repr(o), n, k, m, "FAIL" if us is None else f"{us:.3f}",
                                     f"{results['cublas', n, k, m]:.3f}",
                                     "FAIL" if situ is None else situ and f"{situ:.3f}",
                                     f"{in_situ['cublas', n, k, m]:.3f}"])
    if failed:
        print(f"wrong results from: {sorted(set(failed))}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
