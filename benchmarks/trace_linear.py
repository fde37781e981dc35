"""Where the linear kernel's time goes: per-CTA timelines from a trace build (KernelOptions.trace) on the H200.

    timeout 300 python benchmarks/trace_linear.py [--csv PATH] [--cta-csv PATH] [--case N K M ...] [--variant NAME ...]

For each case (N x K, M; bf16, no bias) and variant, a CUDA graph of back-to-back calls and one with a small
elementwise kernel on x before every call ("in situ", as benchmarks/sweep_linear.py), weights rotated past the
L2, is replayed REPLAYS times (bench_linear.graph_time_us); every call writes its CTAs' timelines into its own
rows of a trace buffer, read after the last replay. The output of the trace build is checked against the
float64 reference first (poisoned with NaN before the launch).

Per call, from the CTAs' rows (TRACE_FIELDS in torch_tma/kernels/linear.py), medians over the calls:
  span      first CTA start -> last CTA end (%globaltimer), the kernel's own wall time
  gap       previous call's last CTA end -> this call's first CTA start (negative: PDL overlap; in situ it
            holds the small kernel)
  skew      last CTA start - first CTA start
  early     CTAs that started before the previous call's last CTA ended
  sms       SMs the call's CTAs ran on; stacked: SMs that ran two or more of them
  pre       weight blocks a CTA asked for before griddepcontrol.wait, mean over the CTAs (its ring's depth, or its
            whole run where that is shorter; 0 for builds without weight_before_wait)
and per CTA (SM clock converted with the clock rate measured from the same rows), median and max over CTAs:
  issue     start -> first weight block issued by the TMA warp
  wait      start -> griddepcontrol.wait returned in the TMA warp
  ready     start -> first stage landed (first bytes)
  stream    first stage landed -> last stage consumed
  tail      last stage consumed -> CTA end (fix-up or epilogue)
  fixup     a last arriver's final fix-up sum start -> CTA end (CTAs that did one)
  send      last stage consumed -> its cluster split's partial pieces sent to the other CTAs (every CTA of a cluster
            split, also one that owned all its pieces and sent none)
  recv      pieces sent -> its own pieces received (the fix-up sum's start; CTAs that sent and summed)
cuBLAS's time per call (CUDA events) in the same graphs is printed beside them. --cta-csv writes every CTA of every
timed call (its SM, start, end and phases, cta_rows), for questions the medians cannot answer (which SMs stream late).
"""

import argparse
import csv
import functools
import math
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_linear import DTYPE, Shape, check_close, graph_time_us  # noqa: E402
import sweep_linear  # noqa: E402

CASES = [(4096, 4096, 1), (4096, 4096, 16), (6144, 4096, 1), (4096, 14336, 1), (10240, 8192, 1), (28672, 4096, 1)]
CALLS_PER_GRAPH = 24
SKIP_CALLS = 2  # the graph's first calls follow the previous replay's tail: left out of the medians


def variants(linear):
    """sweep_linear's variants as trace builds, and the ones only traced."""
    shipped = linear.DEFAULT_OPTIONS._replace(trace=True)
    table = {name: o._replace(trace=True) for name, o in sweep_linear.variants(linear).items()}
    table.update({"stream-k": shipped._replace(cluster_split=0),
                  "stream-k-no-pdl": shipped._replace(cluster_split=0, pdl=False, weight_before_wait=False),
                  "cluster2": shipped._replace(cluster_split=2, cluster_fit=False),
                  "stacked": shipped._replace(cluster_fit=False),
                  "param-desc": shipped._replace(weight_descriptor="param"),
                  "no-prefetch": shipped._replace(descriptor_prefetch=""),
                  "prefetch-acquired": shipped._replace(descriptor_prefetch="entry-acquired"),
                  "release-arrive": shipped._replace(relaxed_cluster_arrive=False)})
    return table


def cta_phases(col, i):
    """Each CTA's phases of call i in SM cycles (the per-CTA quantities of the module docstring but the fix-up), from
    col, the trace's columns by field name."""
    t0 = col["clk_start"][i]
    return {
        "issue": col["clk_first_issue"][i] - t0,
        "wait": col["clk_wait_done"][i] - t0,
        "ready": col["clk_first_ready"][i] - t0,
        "stream": col["clk_last_release"][i] - col["clk_first_ready"][i],
        "tail": col["clk_end"][i] - col["clk_last_release"][i],
    }


def summarize(trace, fields, calls):
    """Medians over calls of the per-call quantities in the module docstring, from trace [calls, ctas, fields]."""
    col = {f: trace[..., i].double() for i, f in enumerate(fields)}
    wall_ns = col["gt_end"] - col["gt_start"]
    ghz = float(((col["clk_end"] - col["clk_start"]) / wall_ns)[wall_ns > 2000].median())
    per_call = {"span": [], "gap": [], "skew": [], "early": [], "sms": [], "stacked": [], "pre": []}
    per_cta = {"issue": [], "wait": [], "ready": [], "stream": [], "tail": [], "fixup": [], "send": [], "recv": []}
    for i in range(SKIP_CALLS, calls):
        start, end = col["gt_start"][i], col["gt_end"][i]
        per_call["span"].append(float(end.max() - start.min()))
        per_call["gap"].append(float(start.min() - col["gt_end"][i - 1].max()))
        per_call["skew"].append(float(start.max() - start.min()))
        # CTAs that started before the previous call's last CTA ended (PDL overlap), SMs used, SMs with 2+ CTAs
        per_call["early"].append(float((start < col["gt_end"][i - 1].max()).sum()))
        sms = torch.bincount(trace[i, :, fields.index("sm")])
        per_call["sms"].append(float((sms > 0).sum()))
        per_call["stacked"].append(float((sms > 1).sum()))
        per_call["pre"].append(float(col["pre_wait_loads"][i].mean()))
        phases = cta_phases(col, i)
        fixers = col["fixups"][i] > 0
        if bool(fixers.any()):
            phases["fixup"] = (col["clk_end"][i] - col["clk_fixup_start"][i])[fixers]
        senders = col["clk_sent"][i] > 0
        if bool(senders.any()):
            phases["send"] = (col["clk_sent"][i] - col["clk_last_release"][i])[senders]
        if bool((senders & fixers).any()):
            phases["recv"] = (col["clk_fixup_start"][i] - col["clk_sent"][i])[senders & fixers]
        for name, cycles in phases.items():
            ns = cycles / ghz
            per_cta[name].append((float(ns.median()), float(ns.max())))
    out = {name: statistics.median(v) / (1e3 if name in ("span", "gap", "skew") else 1) for name, v in per_call.items()}
    for name, v in per_cta.items():
        if v:
            out[name + "_p50"] = statistics.median(m for m, _ in v) / 1e3
            out[name + "_max"] = statistics.median(x for _, x in v) / 1e3
    out["sm_ghz"] = ghz
    return out


def cta_rows(trace, fields, calls, ghz):
    """One dict per CTA of each call after the first SKIP_CALLS, from trace [calls, ctas, fields]: the call, the CTA,
    its SM, its start against the call's first CTA start and its end against the call's last CTA end (%globaltimer,
    ns), and its phases (cta_phases; ns, from the SM clock at ghz)."""
    col = {f: trace[..., i].double() for i, f in enumerate(fields)}
    out = []
    for i in range(SKIP_CALLS, calls):
        first, last = float(col["gt_start"][i].min()), float(col["gt_end"][i].max())
        phases = cta_phases(col, i)
        for cta in range(trace.shape[1]):
            row = {"call": i, "cta": cta, "sm": int(trace[i, cta, fields.index("sm")]),
                   "pre_wait_loads": int(trace[i, cta, fields.index("pre_wait_loads")]),
                   "start_ns": float(col["gt_start"][i][cta]) - first, "end_ns": float(col["gt_end"][i][cta]) - last}
            row.update({f"{name}_ns": round(float(v[cta]) / ghz, 1) for name, v in phases.items()})
            out.append(row)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--csv", help="also write one row per (case, variant, mode) here")
    parser.add_argument("--case", nargs=3, type=int, action="append", metavar=("N", "K", "M"),
                        help="trace this case instead of CASES (repeatable)")
    parser.add_argument("--variant", action="append", help="only this variant (repeatable; default all)")
    parser.add_argument("--cta-csv", help="also write one row per CTA of every timed call here (cta_rows)")
    args = parser.parse_args()

    import cutlass
    import torch_tma
    from torch_tma.kernels import linear

    assert torch.cuda.get_device_capability() == (9, 0), "this script is for Hopper (sm_90)"
    device = torch.device("cuda")
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    capacity = linear.cluster_capacity(device.index or 0)
    cache = torch_tma.default_cache(device)
    stream = torch.cuda.Stream()
    fields = linear.TRACE_FIELDS
    partials = torch.empty(sm_count * 2 * linear.M_PADS[-1] * linear.TILE_N, dtype=torch.float32, device=device)
    arrivals = torch.zeros(linear.ARRIVAL_WORDS, dtype=torch.int32, device=device)
    table = sweep_linear.select_variants(parser, variants(linear), args.variant)
    rows, cta_table = [], []
    for n, k, m in args.case or CASES:
        shape = Shape(n, k, linear, cache, CALLS_PER_GRAPH)
        calls = shape.calls
        x = torch.randn(m, k, dtype=DTYPE, device=device)
        out = torch.empty(m, n, dtype=DTYPE, device=device)
        feed = functools.partial(torch.Tensor.mul_, x, 1.0)
        feed_us = graph_time_us([feed] * calls, stream)[1]
        cublas = shape.cublas(x)
        cublas_us = {"back to back": graph_time_us(cublas, stream)[1],
                     "in situ": graph_time_us([c for f in cublas for c in (feed, f)], stream)[1] * 2 - feed_us}
        for name, o in table.items():
            o = linear.options_for(o, n, k, m, sm_count, capacity)
            compiled = linear.compile_kernel(cutlass.BFloat16, linear.m_pad(m), False, "", o)
            num_ctas = linear.grid_size(n, k, sm_count, o)
            trace = torch.zeros(calls, num_ctas, len(fields), dtype=torch.int64, device=device)
            ours = shape.launches(compiled, x, out, partials, arrivals, num_ctas, trace)
            out.fill_(math.nan)
            ours[0]()
            torch.cuda.synchronize()
            check_close(out, x, shape.weights[0], f"trace build {name} {n}x{k} M={m}")
            for mode, graph_calls in (("back to back", ours), ("in situ", [c for f in ours for c in (feed, f)])):
                us = graph_time_us(graph_calls, stream)[1] * (2 if mode == "in situ" else 1)
                if mode == "in situ":
                    us -= feed_us
                row = {"N": n, "K": k, "M": m, "variant": name, "mode": mode, "us_per_call": us,
                       "cublas_us": cublas_us[mode], "feed_us": feed_us}
                row.update(summarize(trace.cpu(), fields, calls))
                rows.append(row)
                if args.cta_csv:
                    ident = {"N": n, "K": k, "M": m, "variant": name, "mode": mode, "cluster_k": o.cluster_k}
                    cta_table += [dict(ident, **r) for r in cta_rows(trace.cpu(), fields, calls, row["sm_ghz"])]
                print(f"{n}x{k} M={m} {name:8s} {mode:12s} {us:6.2f} us (cuBLAS {cublas_us[mode]:6.2f}) | span "
                      f"{row['span']:5.2f} gap {row['gap']:5.2f} skew {row['skew']:4.2f} early {row['early']:3.0f} SMs "
                      f"{row['sms']:3.0f} stacked {row['stacked']:3.0f} pre {row['pre']:4.1f} | per CTA p50/max: issue "
                      f"{row['issue_p50']:4.2f}/{row['issue_max']:4.2f} wait {row['wait_p50']:4.2f}/{row['wait_max']:4.2f} ready {row['ready_p50']:4.2f}/"
                      f"{row['ready_max']:4.2f} stream {row['stream_p50']:5.2f}/{row['stream_max']:5.2f} tail "
                      f"{row['tail_p50']:4.2f}/{row['tail_max']:4.2f} fixup {row.get('fixup_p50', 0):4.2f}/"
                      f"{row.get('fixup_max', 0):4.2f} send {row.get('send_p50', 0):4.2f}/{row.get('send_max', 0):4.2f} "
                      f"recv {row.get('recv_p50', 0):4.2f}/{row.get('recv_max', 0):4.2f} us [SM {row['sm_ghz']:.2f} GHz]",
                      flush=True)
            check_close(out, x, shape.last_weight, f"trace build {name} {n}x{k} M={m} after replays")
        del shape
        torch.cuda.empty_cache()
    for path, table_rows in ((args.csv, rows), (args.cta_csv, cta_table)):
        if path:
            with open(path, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(key for row in table_rows for key in row)))
                writer.writeheader()
                writer.writerows(table_rows)


if __name__ == "__main__":
    main()
