"""How much could balancing the CTAs' work take back? Upper bounds read from a trace run's per-CTA rows.

    python docs/probes/balance_bound.py [docs/results/trace-linear-h100-run28-ctas.csv.gz ...]

Input: what benchmarks/trace_linear.py --cta-csv writes (gzipped or not). No GPU needed.

A call's weight streaming ends when its last CTA consumes its last stage. Per CTA, that time is its start against
the call's first CTA start (%globaltimer, which moves in 256 ns steps on these GPUs) plus its ready and stream phases
(SM clock). Per call:
  last       the latest CTA's end of streaming
  cluster    the latest cluster's mean end: where every cluster (cluster_k CTAs of one row tile, consecutive CTA
             ids) finished its blocks together, each CTA taking blocks from its cluster's others as it falls idle
             (work stolen inside the cluster, perfect and free)
  launch     the mean end over all CTAs: the whole launch balanced (a perfect, free stream-K)
and the same three from the stream phase alone (every CTA's first stage landing at once; SM clocks only, so no
globaltimer steps). "take back" = last - cluster and last - launch: what each balance could save at most, medians
over calls. "block" is the time one CTA streams one 64-column weight block at the median rate (stream p50 /
blocks per CTA), the step a balance made of whole blocks moves in.

The bounds are upper bounds: a real balance pays for its claims (a cluster-scope atomic per block, or partials
through global memory), cannot split a block, and the max of noisy ends is biased up by the 256 ns steps.
"""

import argparse
import collections
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpc_load import calls_of, read_rows  # noqa: E402

DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "results",
                       "trace-linear-h100-run28-ctas.csv.gz")
TILE_K = 64  # columns of one weight block (torch_tma.kernels.linear.TILE_K)


def call_bounds(ctas):
    """For one call's CTA rows: {"last", "cluster", "launch"} (ns, from the call's first CTA start) and the same
    from the stream phase alone ("last_stream", "cluster_stream", "launch_stream")."""
    k = max(1, int(ctas[0]["cluster_k"]))
    out = {}
    for suffix, end in (("", lambda r: float(r["start_ns"]) + float(r["ready_ns"]) + float(r["stream_ns"])),
                        ("_stream", lambda r: float(r["stream_ns"]))):
        ends = {int(r["cta"]): end(r) for r in ctas}
        clusters = collections.defaultdict(list)
        for cta, t in ends.items():
            clusters[cta // k].append(t)
        out["last" + suffix] = max(ends.values())
        out["cluster" + suffix] = max(statistics.fmean(ts) for ts in clusters.values())
        out["launch" + suffix] = statistics.fmean(ends.values())
    return out


def bounds(rows):
    """(N, K, M, variant, mode) -> medians over calls (us): last, the two take-backs (with and without start times),
    and block, one weight block's stream time at the median rate."""
    per_case = collections.defaultdict(list)
    for key, ctas in calls_of(rows).items():
        per_case[key[:5]].append(ctas)
    out = {}
    for case, case_calls in per_case.items():
        b = [call_bounds(ctas) for ctas in case_calls]
        k = max(1, int(case_calls[0][0]["cluster_k"]))
        blocks = -(-int(case[1]) // TILE_K) // k
        stream_p50 = statistics.median(float(r["stream_ns"]) for ctas in case_calls for r in ctas)
        med = lambda f: statistics.median(f(x) for x in b) / 1e3  # noqa: E731
        out[case] = {
            "ctas": len(case_calls[0]), "cluster_k": k, "last": med(lambda x: x["last"]),
            "cluster": med(lambda x: x["last"] - x["cluster"]), "launch": med(lambda x: x["last"] - x["launch"]),
            "cluster_stream": med(lambda x: x["last_stream"] - x["cluster_stream"]),
            "launch_stream": med(lambda x: x["last_stream"] - x["launch_stream"]),
            "block": stream_p50 / blocks / 1e3,
        }
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="*", default=[DEFAULT], help="trace_linear.py --cta-csv files (.csv or .csv.gz)")
    parser.add_argument("--variant", default="shipped", help="only this variant (default: shipped; 'all' for every one)")
    args = parser.parse_args()
    print("us, medians over calls; take back at most: inside the cluster / the whole launch "
          "(from start times | stream phase alone)")
    for path in args.paths:
        print(f"\n{os.path.basename(path)}")
        for (n, k, m, variant, mode), b in bounds(read_rows(path)).items():
            if args.variant not in ("all", variant):
                continue
            print(f"  {n}x{k} M={m} {variant} {mode}: {b['ctas']} CTAs, clusters of {b['cluster_k']}; last end "
                  f"{b['last']:.2f}; cluster {b['cluster']:.2f} | {b['cluster_stream']:.2f}; launch "
                  f"{b['launch']:.2f} | {b['launch_stream']:.2f}; block {b['block']:.2f}")


if __name__ == "__main__":
    main()
