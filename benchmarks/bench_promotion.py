"""L2 promotion x box shape x occupancy for a TMA streaming kernel, through torch_tma's cached descriptors.

The kernel is examples/tma_stream_reduce.py (a checksum: persistent grid, 4-stage TMA ring, one producer
warp). It streams a 28672 x 8192 bf16 tensor (470 MB, far past the 60 MB L2) and is checked for an exact sum
before it is timed. Every cell is timed with CUDA events around replays of a CUDA graph of 20 launches.
In the same run: the same kernel through the atom's own descriptor (always 128B; shows what the cached
descriptor costs), and ``torch.sum`` over the same tensor (a ceiling reference that owes nothing to TMA).

One command on the H200 (about a minute):

    source .gpu/env.sh && pip install --no-build-isolation --no-deps -q -e . && \
        timeout -s KILL 240 python benchmarks/bench_promotion.py

Writes docs/results/promotion-h200.csv (long format: one row per cell and metric) and
docs/results/promotion-h200.png, prints a table. ``--plot CSV`` redraws the PNG from a CSV on any machine.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import os
import sys
import time
from importlib.metadata import version
from pathlib import Path

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import torch  # noqa: E402

CSV = ROOT / "docs" / "results" / "promotion-h200.csv"
SHAPE = (28672, 8192)
# (label, box rows, box inner bytes, swizzle): the shapes of shared/reference/h200-baseline.md
BOXES = [("128x128B", 128, 128, "B128"), ("64x128B", 64, 128, "B128"), ("128x64B", 128, 64, "B64"),
         ("64x256B", 64, 256, "NONE")]
CTAS_PER_SM = (1, 2, 3)      # 4 stages of 8-16 KB: up to 3 CTAs fit an SM's shared memory
LAUNCHES_PER_GRAPH = 20
REPLAYS = 15
HANG_S = 20.0                # a TMA or mbarrier mistake hangs instead of failing


def wait(what: str) -> None:
    """Synchronize, but fail instead of hanging forever."""
    done = torch.cuda.Event()
    done.record()
    deadline = time.monotonic() + HANG_S
    while not done.query():
        if time.monotonic() > deadline:
            print(f"bench_promotion: {what} did not finish in {HANG_S:.0f} s (hung kernel); giving up", flush=True)
            os._exit(3)
        time.sleep(0.001)


def time_graph(launch) -> list[float]:
    """Seconds per launch, one sample per replay of a graph of LAUNCHES_PER_GRAPH launches."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        launch()            # warm: module load, descriptor slot written before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAUNCHES_PER_GRAPH):
            launch()
    graph.replay()
    wait("graph warm-up replay")
    samples = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        wait("graph replay")
        samples.append(start.elapsed_time(end) / 1e3 / LAUNCHES_PER_GRAPH)
    return samples


def quantiles(samples: list[float]) -> tuple[float, float, float]:
    q = torch.tensor(samples, dtype=torch.float64).quantile(torch.tensor([0.2, 0.5, 0.8], dtype=torch.float64))
    return tuple(q.tolist())


def run() -> list[dict]:
    import tma_stream_reduce as sr
    from torch_tma import L2Promotion

    # Small integers keep every float32 partial sum exact, so each configuration is checked for equality.
    x = torch.randint(1, 9, SHAPE, device="cuda").to(torch.bfloat16)
    expected = sr.tma_stream_reduce_ref(x).item()
    nbytes = x.numel() * x.element_size()
    meta = dict(kernel="tma_stream_reduce", shape="x".join(map(str, SHAPE)), dtype="bfloat16",
                gpu=torch.cuda.get_device_name(), dsl=version("nvidia-cutlass-dsl"), torch=torch.__version__,
                date=datetime.date.today().isoformat())
    rows = []

    def record(provider, box, swizzle, ctas_per_sm, promotion, samples):
        seconds = quantiles(samples)
        gbs = [nbytes / s / 1e9 for s in reversed(seconds)]   # p20 of GB/s is the p80 of time
        for metric, values in (("us", [s * 1e6 for s in seconds]), ("GB/s", gbs)):
            rows.append(dict(meta, provider=provider, box=box, swizzle=swizzle, ctas_per_sm=ctas_per_sm,
                             l2_promotion=promotion, metric=metric, p20=round(values[0], 3),
                             p50=round(values[1], 3), p80=round(values[2], 3)))

    record("torch.sum", "-", "-", "-", "-", time_graph(lambda: x.sum(dtype=torch.float32)))
    for label, box_rows, inner_bytes, swizzle in BOXES:
        for descriptor in ("atom", "cached"):
            config = sr.StreamReduce(box_rows=box_rows, box_inner_bytes=inner_bytes, swizzle=swizzle,
                                     descriptor=descriptor)
            promotions = [L2Promotion.L2_128B] if descriptor == "atom" else list(L2Promotion)
            for ctas_per_sm in CTAS_PER_SM:
                for promotion in promotions:
                    out = config.partial_sums(x, l2_promotion=promotion, ctas_per_sm=ctas_per_sm)
                    wait(f"{label} {descriptor} {promotion.name} x{ctas_per_sm}")
                    got = out.sum(dtype=torch.float64).item()
                    name = f"{label} {descriptor} {promotion.name} {ctas_per_sm} CTA/SM"
                    if got != expected:
                        print(f"bench_promotion: WRONG SUM for {name}: {got} != {expected}; not timed", flush=True)
                        rows.append(dict(meta, provider=f"tma/{descriptor}", box=label, swizzle=swizzle,
                                         ctas_per_sm=ctas_per_sm, l2_promotion=promotion.name, metric="wrong sum",
                                         p20="", p50="", p80=""))
                        continue
                    samples = time_graph(lambda: config.partial_sums(x, l2_promotion=promotion,
                                                                     ctas_per_sm=ctas_per_sm, out=out))
                    record(f"tma/{descriptor}", label, swizzle, ctas_per_sm, promotion.name, samples)
    return rows


def write_csv(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def print_table(rows: list[dict]) -> None:
    gbs = [r for r in rows if r["metric"] == "GB/s"]
    ceiling = next(r["p50"] for r in gbs if r["provider"] == "torch.sum")
    print(f"GB/s (p50 of {REPLAYS} graph replays x {LAUNCHES_PER_GRAPH} launches), {SHAPE[0]}x{SHAPE[1]} bf16; "
          f"torch.sum {ceiling:,.0f} GB/s")
    promotions = ["NONE", "L2_64B", "L2_128B", "L2_256B"]
    print(f"{'box':10s} {'CTA/SM':>6s} {'atom 128B':>10s} " + " ".join(f"{p:>9s}" for p in promotions))
    for label, *_ in BOXES:
        for ctas_per_sm in CTAS_PER_SM:
            cell = {(r["provider"], r["l2_promotion"]): r["p50"] for r in gbs
                    if r["box"] == label and r["ctas_per_sm"] == ctas_per_sm}
            atom = cell.get(("tma/atom", "L2_128B"))
            values = [cell.get(("tma/cached", p)) for p in promotions]
            print(f"{label:10s} {ctas_per_sm:>6d} " + (f"{atom:>10,.0f}" if atom is not None else f"{'wrong':>10s}")
                  + " " + " ".join(f"{v:>9,.0f}" if v is not None else f"{'wrong':>9s}" for v in values))


def plot(csv_path: Path) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no PNG; run `python benchmarks/bench_promotion.py --plot {csv_path}` "
              f"where it is", flush=True)
        return None
    with csv_path.open() as f:
        rows = [r for r in csv.DictReader(f) if r["metric"] == "GB/s"]
    ceiling = next(float(r["p50"]) for r in rows if r["provider"] == "torch.sum")
    promotions = ["NONE", "L2_64B", "L2_128B", "L2_256B"]
    fig, axes = plt.subplots(1, len(CTAS_PER_SM), figsize=(5 * len(CTAS_PER_SM), 4), sharey=True)
    for ax, ctas_per_sm in zip(axes, CTAS_PER_SM):
        for label, *_ in BOXES:
            cell = {r["l2_promotion"]: float(r["p50"]) for r in rows if r["box"] == label
                    and r["provider"] == "tma/cached" and r["ctas_per_sm"] == str(ctas_per_sm)}
            line = ax.plot(range(4), [cell.get(p, float("nan")) for p in promotions], marker="o", label=label)[0]
            atom = [float(r["p50"]) for r in rows if r["box"] == label and r["provider"] == "tma/atom"
                    and r["ctas_per_sm"] == str(ctas_per_sm)]
            if atom:
                ax.plot([2], atom, marker="x", markersize=10, color=line.get_color())
        ax.axhline(ceiling, color="gray", linestyle="--", label="torch.sum")
        ax.set_xticks(range(4), promotions)
        ax.set_title(f"{ctas_per_sm} CTA/SM")
        ax.set_xlabel("L2 promotion (x: atom's own descriptor)")
    axes[0].set_ylabel("GB/s (p50)")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"TMA streaming checksum, {SHAPE[0]}x{SHAPE[1]} bf16, {rows[0]['gpu']}, {rows[0]['date']}")
    fig.tight_layout()
    png = csv_path.with_suffix(".png")
    fig.savefig(png, dpi=120)
    return png


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plot", type=Path, help="only redraw the PNG from this CSV (no GPU needed)")
    args = parser.parse_args()
    if args.plot:
        return 0 if plot(args.plot) else 1
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        print("bench_promotion needs a Hopper (sm_90) GPU", file=sys.stderr)
        return 2
    start = time.monotonic()
    rows = run()
    write_csv(rows, CSV)
    png = plot(CSV)
    print_table(rows)
    wrong = [r for r in rows if r["metric"] == "wrong sum"]
    print(f"bench_promotion: {len(rows)} rows in {time.monotonic() - start:.0f} s -> {CSV.relative_to(ROOT)}"
          + (f", {png.relative_to(ROOT)}" if png else "") + (f"; {len(wrong)} WRONG SUMS" if wrong else ""))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
