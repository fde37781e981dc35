"""Weight-streaming linear on the H200: torch_tma's kernel against cuBLAS (F.linear) and the streaming floor.

    python benchmarks/bench_linear.py                      # full run (< 6 min on an H200), writes CSV + PNG
    python benchmarks/bench_linear.py --quick              # two shapes, M in {1, 16}: a smoke run
    python benchmarks/bench_linear.py --plot CSV           # only redraw the PNG from a CSV (any machine)

For every shape N x K and M in {1, 2, 4, 8, 16, 32, 64} (bf16, no bias): validate the providers (the kernel,
torch.ops.tma.linear, cuBLAS's F.linear) against a float64 reference, then time them as CUDA events around replays
of one CUDA graph per provider that holds many calls, each on the next of several weight copies so the working set
is well past the 60 MB L2 (what a model's layer sequence does). The providers' graphs are replayed in turns
(interleaved_time_us), back to back and then in situ (a small kernel before each call), so a drift of the GPU's
clocks during a cell reaches all of them; NVML's SM and memory clocks, power and clock-event reasons, sampled
during the replays (gpu_clocks.py), go into every row. Each replay waits behind a spin kernel, so its start event
fires when the GPU reaches the graph and the host's graph launch is not in the time. The floor is (weight + x + y
bytes) / ceiling, with the ceiling the fastest streaming rate measured in the same run: a 2 GiB torch.sum read, a
1 GiB device copy, and every cell's own rate back to back (bytes / median time, any provider or promotion), so no
cell runs under its floor. Then a sweep of the weight descriptor's L2 promotion (NONE / 64B / 128B / 256B, timed in turns)
per shape at M in {1, 16, 64}, and the eager host cost per call (the op and F.linear timed in turns, round by
round: profile_host.host_us_in_turns).

Writes, long format with one row per shape, M and provider in each file: docs/results/linear-h200.csv (back to
back), linear-h200-in-situ.csv, linear-h200-promotion.csv (one row per promotion too) and linear-h200-host.csv;
and docs/results/linear-h200.png (% of floor by shape and M for both providers); prints a summary with the geomean
speedup. `--restate CSV` rewrites an older grid's CSV (one file, every metric) this way, its ceiling and floors
taken again from its own rows.
"""

import argparse
import csv
import datetime
import functools
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_clocks  # noqa: E402
from profile_host import host_us_in_turns  # noqa: E402

SHAPES = {  # name: (N, K)
    "llama8b.qkv": (6144, 4096),
    "llama8b.o": (4096, 4096),
    "llama8b.gate_up": (28672, 4096),
    "llama8b.down": (4096, 14336),
    "llama70b.qkv": (10240, 8192),
    "llama70b.gate_up": (57344, 8192),
    "llama70b.down": (8192, 28672),
}
MS = (1, 2, 4, 8, 16, 32, 64)
SWEEP_MS = (1, 16, 64)
DTYPE = torch.bfloat16
ROTATION_BYTES = 400 << 20  # weight copies per shape: together at least this much, ~7x the L2
CALLS_PER_GRAPH = 40
REPLAYS = 15
ROUNDS = 5  # interleaved_time_us: turns per list, REPLAYS // ROUNDS replays each
HOST_ROUNDS = 15  # host cost: rounds of profile_host.CALLS calls per provider, in turns
CSV_FIELDS = ["metric", "name", "N", "K", "M", "dtype", "provider", "l2_promotion", "us_min", "us_p20", "us_p50",
              "us_p80", "bytes", "floor_us", "ceiling_gbs", "pct_floor", "gpu", "torch", "date", *gpu_clocks.FIELDS]
METRIC_FILES = {"gpu_us": "", "gpu_us_in_situ": "-in-situ", "gpu_us_promotion_sweep": "-promotion",
                "host_us": "-host"}  # each metric's file: the CSV path's stem + this
SPIN_CYCLES = 200_000  # the spin before each timed replay: ~0.1 ms at 1.98 GHz, longer than a graph launch
HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CSV = os.path.join(HERE, "..", "docs", "results", "linear-h200.csv")


# ---- measurement ---------------------------------------------------------------------------------------


def capture(calls, stream) -> torch.cuda.CUDAGraph:
    """One CUDA graph that runs every call once, warmed up and replayed once."""
    stream.wait_stream(torch.cuda.current_stream())  # inputs and descriptor slots were written there
    with torch.cuda.stream(stream):  # warm up on the capture stream: compile, workspaces, cuBLAS handles
        for call in calls:
            call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def replays_us(graph, calls: int, replays: int, clocks=None) -> list[float]:
    """GPU microseconds per call of each of `replays` replays (CUDA events around each, queued behind a spin kernel:
    an idle GPU would record the start event at once and time the host's graph launch too); clocks
    (gpu_clocks.Clocks): one NVML sample during each replay."""
    per_call = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SPIN_CYCLES)  # the GPU is busy while the host records start and launches the graph
        start.record()
        graph.replay()
        end.record()
        if clocks is not None:
            start.synchronize()  # the spin is over: the replay runs while NVML is read
            clocks.sample()
        end.synchronize()
        per_call.append(start.elapsed_time(end) * 1e3 / calls)
    return per_call


def quantiles(per_call) -> tuple[float, float, float]:
    """(p20, p50, p80)."""
    q = statistics.quantiles(per_call, n=10)
    return q[1], statistics.median(per_call), q[7]


def graph_time_us(calls, stream, clocks=None) -> tuple[float, float, float]:
    """GPU microseconds per call (p20, p50, p80 over REPLAYS) of one CUDA graph that runs every call once."""
    return quantiles(replays_us(capture(calls, stream), len(calls), REPLAYS, clocks))


def interleaved_time_us(call_lists, stream, clocks=None) -> list[tuple[float, float, float]]:
    """graph_time_us of several lists of calls, timed in turns: every list's graph is captured first, then ROUNDS
    rounds each replay every graph REPLAYS // ROUNDS times, the order rotating by one each round. A change of the
    GPU's clocks or temperature during the cell then reaches every list alike, where timing one list after another
    gave the last a different GPU (docs/linear.md: the same cuBLAS call, timed after the others, 7 % slower)."""
    graphs = [capture(calls, stream) for calls in call_lists]
    per_call = [[] for _ in graphs]
    for r in range(ROUNDS):
        for i in ((r + j) % len(graphs) for j in range(len(graphs))):
            per_call[i] += replays_us(graphs[i], len(call_lists[i]), REPLAYS // ROUNDS, clocks)
    return [quantiles(t) for t in per_call]


def in_situ_times_us(call_lists, x, stream, clocks=None, feed=None) -> list[tuple[float, float, float]]:
    """GPU microseconds per call "in situ", per list of calls (all of one length): the calls' graph with a small
    elementwise kernel on x before each call (x *= 1, as a norm or an activation feeds a linear layer in a model),
    less the small kernel's own median time; the graphs, and the small kernel's alone, timed in turns
    (interleaved_time_us). Back-to-back calls let a PDL launch overlap the previous call of the same kernel; here
    nothing of ours comes before a call, as in a decode step. feed: the small kernel as a no-argument call (default
    torch's x.mul_(1); benchmarks/feed_kernel.py makes one that asks for shared memory)."""
    feed = feed or functools.partial(torch.Tensor.mul_, x, 1.0)
    n = len(call_lists[0])
    assert all(len(calls) == n for calls in call_lists), "in_situ_times_us: lists of one length"
    feed_times, *paired = interleaved_time_us([[feed] * n] + [[c for call in calls for c in (feed, call)]
                                                               for calls in call_lists], stream, clocks)
    return [tuple(2 * t - feed_times[1] for t in times) for times in paired]


def in_situ_time_us(calls, x, stream, feed=None) -> tuple[float, float, float]:
    """in_situ_times_us of one list of calls."""
    return in_situ_times_us([calls], x, stream, feed=feed)[0]


def measure_ceiling_gbs(stream) -> dict:
    """Streaming rates of this GPU now, in GB/s: a 2 GiB read (torch.sum) and a 1 GiB copy (read + write)."""
    buf = torch.randn(1 << 30, dtype=DTYPE, device="cuda")  # 2 GiB
    _, sum_us, _ = graph_time_us([lambda: buf.sum(dtype=torch.float32)] * 5, stream)
    src, dst = buf[: 1 << 29], torch.empty(1 << 29, dtype=DTYPE, device="cuda")
    _, copy_us, _ = graph_time_us([lambda: dst.copy_(src)] * 5, stream)
    return {"sum_read": buf.numel() * 2 / sum_us / 1e3, "copy_read_write": 2 * src.numel() * 2 / copy_us / 1e3}


def check_close(out, x, weight, label):
    """|out - ref64| <= 2 |F.linear - ref64| + eps * max|ref64| elementwise; raise naming the cell if not."""
    ref = x.double() @ weight.double().t()
    lowp = F.linear(x, weight).double()
    atol = torch.finfo(out.dtype).eps * ref.abs().max().item()
    err, limit = (out.double() - ref).abs(), 2 * (lowp - ref).abs() + atol
    if not bool((err <= limit).all()):  # NaN (an unwritten element) fails here too
        torch_err = (lowp - ref).abs().max().item()
        raise AssertionError(f"{label}: {int((~(err <= limit)).sum())} of {err.numel()} elements off the float64 "
                             f"reference (max error {err.max().item():.4g}, torch's {torch_err:.4g})")


class Shape:
    """Weight copies of one shape, their descriptors per L2 promotion, and the calls to time.

    ``calls`` is ``calls_per_graph`` rounded down to whole turns over the copies (at least one turn); ``promotion`` is
    the one ``torch.ops.tma.linear`` takes for this shape on this GPU (``default_l2_promotion``)."""

    def __init__(self, n, k, linear, cache, calls_per_graph=CALLS_PER_GRAPH):
        self.n, self.k, self.linear, self.cache = n, k, linear, cache
        weight_bytes = n * k * 2
        copies = max(2, -(-ROTATION_BYTES // weight_bytes))
        self.weights = [(torch.randn(n, k, device="cuda") / math.sqrt(k)).to(DTYPE) for _ in range(copies)]
        self.calls = copies * max(1, calls_per_graph // copies)
        self.promotion = linear.default_l2_promotion(torch.cuda.current_device(), n, k, DTYPE)
        self.last_weight = self.weights[(self.calls - 1) % copies]  # the one the graph's last call reads
        self._maps = {}

    def maps(self, promotion):
        """Descriptor addresses of the weight copies for one promotion (made before any capture)."""
        if promotion not in self._maps:
            box, swizzle = self.linear.weight_box(self.n, self.k, DTYPE), self.linear.weight_swizzle(DTYPE)
            self._maps[promotion] = [self.cache.get(w, box, swizzle=swizzle, l2_promotion=promotion).ptr
                                     for w in self.weights]
        return self._maps[promotion]

    def launches(self, compiled, x, out, partials, arrivals, num_ctas, traces=None):
        """A compiled build (``linear.compile_kernel``) launched on each weight copy with the op's promotion; with
        ``traces``, call i also gets ``traces[i]`` (a trace build's buffer)."""
        maps = self.maps(self.promotion)
        return [functools.partial(compiled, x, self.weights[i % len(maps)], None, out, partials, arrivals,
                                  maps[i % len(maps)], num_ctas, *(() if traces is None else (traces[i],)))
                for i in range(self.calls)]

    def ours(self, x, out, promotion):
        maps = self.maps(promotion)
        return [functools.partial(self.linear.linear_out, x, self.weights[i % len(maps)], None, out,
                                  maps[i % len(maps)], l2_promotion=promotion) for i in range(self.calls)]

    def op(self, x):
        """torch.ops.tma.linear on each weight copy: the kernel up to the crossover M, cuBLAS above it."""
        return [functools.partial(torch.ops.tma.linear, x, self.weights[i % len(self.weights)])
                for i in range(self.calls)]

    def cublas(self, x):
        return [functools.partial(F.linear, x, self.weights[i % len(self.weights)]) for i in range(self.calls)]


def run(shapes, ms, sweep_ms, csv_path):
    import torch_tma
    from torch_tma.kernels import linear

    device = torch.device("cuda")
    assert torch.cuda.get_device_capability() == (9, 0), "this benchmark is for Hopper (sm_90)"
    cache = torch_tma.default_cache(device)
    stream = torch.cuda.Stream()
    started = time.perf_counter()
    common = {"dtype": "bfloat16", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": datetime.date.today().isoformat()}
    rates = measure_ceiling_gbs(stream)
    torch.cuda.empty_cache()  # the 3 GiB of buffers go back before the weights come
    ceiling = max(rates.values())  # until the cells' own rates are in (apply_ceiling)
    print(f"streaming: torch.sum read {rates['sum_read']:.0f} GB/s, copy (read+write) {rates['copy_read_write']:.0f} "
          f"GB/s", flush=True)
    rows = []
    clocks = gpu_clocks.Clocks.for_device(device)
    if clocks.error:
        print(f"no clock readings in the CSV: {clocks.error}", flush=True)

    def record(metric, name, n, k, m, provider, promotion, times, state=None, us_min=None):
        """One row; its floor comes later (apply_ceiling), from bytes (GPU times only)."""
        p20, p50, p80 = (f"{t:.3f}" if t is not None else "" for t in times)
        rows.append({**common, "metric": metric, "name": name, "N": n, "K": k, "M": m, "provider": provider,
                     "l2_promotion": promotion, "us_min": "" if us_min is None else f"{us_min:.3f}", "us_p20": p20,
                     "us_p50": p50, "us_p80": p80, "bytes": "" if metric == "host_us" else stream_bytes(n, k, m),
                     **(state or dict.fromkeys(gpu_clocks.FIELDS, ""))})

    for name in shapes:
        n, k = SHAPES[name]
        shape = Shape(n, k, linear, cache)
        default = shape.promotion  # what the op takes
        for m in ms:
            x = torch.randn(m, k, dtype=DTYPE, device=device)
            out = torch.full((m, n), math.nan, dtype=DTYPE, device=device)
            assert linear.unsupported_reason(x, shape.weights[0], None, crossover=False) is None
            floor_us = stream_bytes(n, k, m) / ceiling / 1e3  # torch.sum's, for the progress line
            providers = {"torch_tma": (shape.ours(x, out, default), default.name),
                         "torch_tma_op": (shape.op(x), default.name), "cublas": (shape.cublas(x), "")}
            out.fill_(math.nan)
            providers["torch_tma"][0][0]()
            check_close(out, x, shape.weights[0], f"torch_tma {name} M={m}")
            check_close(providers["torch_tma_op"][0][0](), x, shape.weights[0], f"torch.ops.tma.linear {name} M={m}")
            check_close(providers["cublas"][0][0](), x, shape.weights[0], f"cublas {name} M={m}")
            lists = [calls for calls, _ in providers.values()]
            back, back_state = interleaved_time_us(lists, stream, clocks), clocks.take()
            situ, situ_state = in_situ_times_us(lists, x, stream, clocks), clocks.take()
            for metric, timed, state in (("gpu_us", back, back_state), ("gpu_us_in_situ", situ, situ_state)):
                for (provider, (_, promotion)), times in zip(providers.items(), timed):
                    record(metric, name, n, k, m, provider, promotion, times, state)
            ours, theirs, state = back[0][1], back[2][1], back_state
            print(f"{name:18s} M={m:<3d} torch_tma {ours:8.2f} us  cublas {theirs:8.2f} us  floor {floor_us:7.2f} us  "
                  f"speedup {theirs / ours:5.2f}x  (SM {state['sm_mhz_min']}-{state['sm_mhz_max']} MHz, "
                  f"{state['power_w_max']} W{' ' + state['clock_events'] if state['clock_events'] else ''})  "
                  f"[{time.perf_counter() - started:5.0f} s]", flush=True)
            if m in sweep_ms:  # every promotion, the default too, timed in turns
                promotions = list(torch_tma.L2Promotion)
                for promotion in promotions:
                    out.fill_(math.nan)
                    shape.ours(x, out, promotion)[0]()
                    check_close(out, x, shape.weights[0], f"torch_tma {name} M={m} {promotion.name}")
                timed = interleaved_time_us([shape.ours(x, out, p) for p in promotions], stream, clocks)
                state = clocks.take()
                for promotion, times in zip(promotions, timed):
                    record("gpu_us_promotion_sweep", name, n, k, m, "torch_tma", promotion.name, times, state)
        del shape
        torch.cuda.empty_cache()

    n, k = SHAPES["llama8b.gate_up"]
    default = linear.default_l2_promotion(torch.cuda.current_device(), n, k, DTYPE)
    weight = (torch.randn(n, k, device=device) / math.sqrt(k)).to(DTYPE)
    x = torch.randn(1, k, dtype=DTYPE, device=device)
    # host time per eager call, the GPU kept busy, inference mode: the two providers timed in turns, round by round
    # (profile_host.host_us_in_turns: median and min over HOST_ROUNDS rounds each)
    providers = (("torch_tma_op", default.name, lambda: torch.ops.tma.linear(x, weight)),
                 ("cublas", "", lambda: F.linear(x, weight)))
    timed = host_us_in_turns([fn for _, _, fn in providers], torch.inference_mode, HOST_ROUNDS)
    for (provider, promotion, _), (p50, low) in zip(providers, timed):
        record("host_us", "llama8b.gate_up", n, k, 1, provider, promotion, (None, p50, None), us_min=low)
    print(apply_ceiling(rows, ceiling))
    write_csvs(csv_path, rows)
    print(f"in {time.perf_counter() - started:.0f} s")
    return rows


def stream_bytes(n: int, k: int, m: int) -> int:
    """Bytes a call must move at least: the bf16 weight [n, k], x [m, k] and y [m, n]."""
    return (n * k + m * k + m * n) * 2


def apply_ceiling(rows, measured_gbs: float) -> str:
    """Set every timed row's ceiling_gbs, floor_us and pct_floor: the ceiling is the fastest streaming rate of the run,
    measured_gbs (torch.sum's read or the copy) or a cell's own rate back to back (bytes / us_p50, any provider or
    promotion; a kernel that reads the weight faster than torch.sum would otherwise run under its floor). Returns
    what it chose."""
    cells = [r for r in rows if r["metric"] in ("gpu_us", "gpu_us_promotion_sweep") and r["bytes"] != ""]
    fastest = max(cells, key=lambda r: int(r["bytes"]) / float(r["us_p50"]), default=None)
    cell_gbs = int(fastest["bytes"]) / float(fastest["us_p50"]) / 1e3 if fastest else 0.0
    ceiling = max(measured_gbs, cell_gbs)
    for r in rows:
        if r["bytes"] != "":
            floor_us = int(r["bytes"]) / ceiling / 1e3
            r.update(ceiling_gbs=f"{ceiling:.0f}", floor_us=f"{floor_us:.3f}",
                     pct_floor=f"{100 * floor_us / float(r['us_p50']):.1f}")
        else:  # host time: no floor
            r.update(ceiling_gbs="", floor_us="", pct_floor="")
    where = (f"{fastest['l2_promotion']} in the promotion sweep" if fastest and fastest["metric"] != "gpu_us"
             else "back to back")
    source = (f"{fastest['name']} M={fastest['M']} {fastest['provider']} {where}" if cell_gbs > measured_gbs
              else "torch.sum / copy")
    return (f"ceiling: {ceiling:.0f} GB/s from {source} (torch.sum / copy {measured_gbs:.0f} GB/s, fastest cell "
            f"{cell_gbs:.0f} GB/s)")


def metric_path(csv_path: str, metric: str) -> str:
    stem, ext = os.path.splitext(csv_path)
    return stem + METRIC_FILES[metric] + ext


def write_csvs(csv_path: str, rows) -> None:
    """One file per metric (METRIC_FILES), each with one row per shape, M and provider (and promotion)."""
    os.makedirs(os.path.dirname(os.path.abspath(csv_path)), exist_ok=True)
    for metric in METRIC_FILES:
        chosen = [r for r in rows if r["metric"] == metric]
        keys = [(r["name"], r["M"], r["provider"], r["l2_promotion"]) for r in chosen]
        assert len(set(keys)) == len(keys), f"{metric}: more than one row for a shape, M and provider"
        if chosen:
            path = metric_path(csv_path, metric)
            with open(path, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
                writer.writeheader()
                writer.writerows({field: r.get(field, "") for field in CSV_FIELDS} for r in chosen)
            print(f"wrote {path} ({len(chosen)} rows)")


def read_rows(csv_path: str) -> list[dict]:
    """Every row of a grid: the CSV and the metric files beside it (write_csvs), or an older CSV holding them all."""
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    for metric in METRIC_FILES:
        path = metric_path(csv_path, metric)
        if path != csv_path and os.path.exists(path):
            with open(path) as f:
                rows += csv.DictReader(f)
    return rows


def restate(csv_path: str) -> None:
    """Rewrite an older grid's single CSV as write_csvs does, ceiling and floors from apply_ceiling (the measured
    rate being the ceiling it recorded, then the faster of torch.sum and the copy). No time is changed."""
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        if r["metric"] == "host_us" and not r.get("us_min"):  # recorded as (min, median, median)
            r.update(us_min=r["us_p20"], us_p20="", us_p80="")
        if not r.get("bytes") and r.get("floor_us"):
            r["bytes"] = stream_bytes(int(r["N"]), int(r["K"]), int(r["M"]))
        r.setdefault("bytes", "")
    print(apply_ceiling(rows, max(float(r["ceiling_gbs"]) for r in rows if r["ceiling_gbs"])))
    write_csvs(csv_path, rows)


# ---- report ----------------------------------------------------------------------------------------------


def gm(values) -> float:
    values = list(values)
    return math.exp(sum(map(math.log, values)) / len(values))


def summarize(rows):
    """Print speedups and the targets: no cell >2 % slower than cuBLAS, >= 90 % of floor on weights >= 100 MB,
    geomean speedup >= 1.15x, >= 1.4x on 4096x4096 for M <= 16; and the best promotion per shape."""
    cells, in_situ = {}, {}
    for r in rows:
        if r["metric"] == "gpu_us":
            cells.setdefault((r["name"], int(r["M"])), {})[r["provider"]] = r
        if r["metric"] == "gpu_us_in_situ":
            in_situ.setdefault((r["name"], int(r["M"])), {})[r["provider"]] = float(r["us_p50"])
    speedups, slow, low_floor = [], [], []
    for (name, m), by in sorted(cells.items()):
        ours, theirs = float(by["torch_tma"]["us_p50"]), float(by["cublas"]["us_p50"])
        speedups.append(theirs / ours)
        if ours > 1.02 * theirs:
            slow.append(f"{name} M={m}: {ours:.2f} us vs cuBLAS {theirs:.2f} us")
        n, k = int(by["torch_tma"]["N"]), int(by["torch_tma"]["K"])
        if n * k * 2 >= 100e6 and float(by["torch_tma"]["pct_floor"]) < 90:
            low_floor.append(f"{name} M={m}: {by['torch_tma']['pct_floor']} % of floor")
    geomean = gm(speedups)
    small = [float(by["cublas"]["us_p50"]) / float(by["torch_tma"]["us_p50"])
             for (name, m), by in cells.items() if name == "llama8b.o" and m <= 16]
    # the most any kernel could get: cuBLAS's time over the streaming floor, per cell
    at_floor = gm(float(by["cublas"]["us_p50"]) / float(by["cublas"]["floor_us"]) for by in cells.values())
    print(f"\ngeomean speedup over cuBLAS: {geomean:.3f}x over {len(speedups)} cells (target >= 1.15x; a kernel at "
          f"the floor in every cell would get {at_floor:.3f}x)")
    if small:
        print(f"4096x4096, M <= 16: min speedup {min(small):.2f}x (target >= 1.4x)")
    print(f"cells more than 2 % slower than cuBLAS: {len(slow)}" + "".join(f"\n  {s}" for s in slow))
    for provider, label in (("torch_tma_op", "torch.ops.tma.linear (cuBLAS above the crossover)"),):
        op = [float(by["cublas"]["us_p50"]) / float(by[provider]["us_p50"]) for by in cells.values() if provider in by]
        if op:
            print(f"{label}, back to back: geomean {gm(op):.3f}x over {len(op)} cells, worst {min(op):.2f}x")
    for provider in ("torch_tma", "torch_tma_op"):
        situ = {key: by["cublas"] / by[provider] for key, by in in_situ.items() if provider in by}
        if situ:
            low = [v for (name, m), v in situ.items() if m <= 16]
            print(f"in situ (a small kernel before each call), {provider}: geomean {gm(situ.values()):.3f}x over "
                  f"{len(situ)} cells, {gm(low):.3f}x over the {len(low)} with M <= 16, worst {min(situ.values()):.2f}x")
    print(f"cells on weights >= 100 MB under 90 % of floor: {len(low_floor)}" + "".join(f"\n  {s}" for s in low_floor))
    sweep = {}
    for r in rows:
        if r["metric"] == "gpu_us_promotion_sweep":
            sweep.setdefault((r["name"], int(r["M"])), {})[r["l2_promotion"]] = float(r["us_p50"])
    print("\nL2 promotion sweep (p50 us; * = fastest):")
    for (name, m), by in sorted(sweep.items()):
        if len(by) > 1:
            best = min(by, key=by.get)
            cells = "  ".join(f"{p}{'*' if p == best else ' '} {us:8.2f}" for p, us in by.items())
            print(f"  {name:18s} M={m:<3d} {cells}")
    for r in rows:
        if r["metric"] == "host_us":
            print(f"eager host cost per call, {r['provider']}: {float(r['us_p50']):.1f} us")


def plot(csv_path, png_path):
    """% of floor against M, one panel per shape, torch_tma and cuBLAS."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in read_rows(csv_path) if r["metric"] == "gpu_us"]
    names = list(dict.fromkeys(r["name"] for r in rows))
    cols = 4
    fig, axes = plt.subplots(-(-len(names) // cols), cols, figsize=(4 * cols, 3.2 * -(-len(names) // cols)),
                             squeeze=False, sharey=True)
    for ax, name in zip(axes.flat, names):
        for provider, style in (("torch_tma", "o-"), ("cublas", "s--")):
            pts = sorted((int(r["M"]), float(r["pct_floor"]))
                         for r in rows if r["name"] == name and r["provider"] == provider)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=provider)
        n, k = next((r["N"], r["K"]) for r in rows if r["name"] == name)
        ax.set_title(f"{name} {n}x{k}", fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_xticks(MS, [str(m) for m in MS])
        ax.axhline(100, color="gray", lw=0.5)
        ax.set_xlabel("M")
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(names):]:
        ax.axis("off")
    axes[0][0].set_ylabel("% of streaming floor")
    axes[0][0].legend(fontsize=8)
    first = rows[0]
    fig.suptitle(f"bf16 linear, {first['gpu']}, ceiling {first['ceiling_gbs']} GB/s, {first['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    print(f"wrote {png_path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--csv", default=DEFAULT_CSV, help="output CSV, its metric files beside it (default "
                                                             "docs/results/linear-h200.csv)")
    parser.add_argument("--quick", action="store_true", help="two shapes, M in {1, 16}")
    parser.add_argument("--plot", metavar="CSV", help="only draw the PNG from an existing CSV")
    parser.add_argument("--summary", metavar="CSV", help="only print the summary of an existing CSV")
    parser.add_argument("--restate", metavar="CSV", help="rewrite an older single-file CSV as this version writes it")
    args = parser.parse_args()
    if args.restate:
        restate(args.restate)
        return
    if args.summary:
        summarize(read_rows(args.summary))
        return
    if args.plot:
        plot(args.plot, os.path.splitext(args.plot)[0] + ".png")
        return
    shapes = ["llama8b.o", "llama70b.qkv"] if args.quick else list(SHAPES)
    ms, sweep_ms = ((1, 16), (16,)) if args.quick else (MS, SWEEP_MS)
    rows = run(shapes, ms, sweep_ms, args.csv)
    summarize(rows)
    try:
        plot(args.csv, os.path.splitext(args.csv)[0] + ".png")
    except ImportError:
        print(f"matplotlib is not installed here: draw the PNG elsewhere with "
              f"python benchmarks/bench_linear.py --plot {args.csv}", file=sys.stderr)


if __name__ == "__main__":
    main()
