"""Does a CTA stream longer when more CTAs of its launch share its GPC? Read from a trace run's per-CTA rows.

    python docs/probes/gpc_load.py [docs/results/trace-linear-h200-run12-ctas.csv.gz]

Input: what benchmarks/trace_linear.py --cta-csv writes (gzipped or not): one row per CTA of every timed call, with
its SM (%smid) and its phases. No GPU needed.

The SMs' GPCs are not a PTX register, so they are read from the cluster builds in the same file: the CTAs of one
cluster always run in one GPC, so SMs that ever held CTAs of one cluster are joined (union-find). What comes out is a
partition of the SMs into groups that are each inside one GPC (a GPC whose SMs never shared a cluster in the file can
show up as several groups). Then for every (case, variant, mode): per call, how many of its CTAs ran in each group,
and the median stream time (first stage landed -> last stage consumed) of the CTAs by that count.
"""

import argparse
import collections
import csv
import gzip
import os
import statistics

DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "results",
                       "trace-linear-h200-run12-ctas.csv.gz")


def read_rows(path):
    """The per-CTA rows of a --cta-csv file."""
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return list(csv.DictReader(f))


def sm_groups(rows):
    """SM -> group id: SMs that ever ran CTAs of one cluster (same case, variant, mode, call and row tile) share a
    group."""
    parent = {}

    def find(sm):
        parent.setdefault(sm, sm)
        while parent[sm] != sm:
            parent[sm] = parent[parent[sm]]
            sm = parent[sm]
        return sm

    clusters = collections.defaultdict(list)
    for r in rows:
        k = int(r["cluster_k"])
        find(int(r["sm"]))
        if k > 1:
            key = (r["N"], r["K"], r["M"], r["variant"], r["mode"], r["call"], int(r["cta"]) // k)
            clusters[key].append(int(r["sm"]))
    for sms in clusters.values():
        for sm in sms[1:]:
            parent[find(sm)] = find(sms[0])
    return {sm: find(sm) for sm in list(parent)}


def calls_of(rows):
    """(N, K, M, variant, mode, call) -> that call's CTA rows."""
    calls = collections.defaultdict(list)
    for r in rows:
        calls[(r["N"], r["K"], r["M"], r["variant"], r["mode"], r["call"])].append(r)
    return calls


def stream_by_load(rows, group):
    """(N, K, M, variant, mode) -> {CTAs of the call in the CTA's group: [stream_ns, ...]}."""
    out = collections.defaultdict(lambda: collections.defaultdict(list))
    for key, ctas in calls_of(rows).items():
        load = collections.Counter(group[int(r["sm"])] for r in ctas)
        for r in ctas:
            out[key[:5]][load[group[int(r["sm"])]]].append(float(r["stream_ns"]))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", nargs="?", default=DEFAULT, help="a trace_linear.py --cta-csv file (.csv or .csv.gz)")
    args = parser.parse_args()
    rows = read_rows(args.path)
    group = sm_groups(rows)
    members = collections.defaultdict(list)
    for sm, g in group.items():
        members[g].append(sm)
    print(f"{len(group)} SMs in {len(members)} groups (SMs that shared a cluster):")
    for sms in sorted(members.values(), key=min):
        print(f"  {len(sms):2d} SMs: {sorted(sms)}")
    print("\nmedian stream time (us) of a CTA by how many CTAs of its call ran in its group [CTA-calls]:")
    for (n, k, m, variant, mode), by_load in stream_by_load(rows, group).items():
        cells = "  ".join(f"{load:2d}: {statistics.median(v) / 1e3:5.2f} [{len(v)}]" for load, v in sorted(by_load.items()))
        print(f"  {n}x{k} M={m} {variant} {mode}: {cells}")


if __name__ == "__main__":
    main()
