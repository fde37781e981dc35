"""The benchmark's timing and clock bookkeeping (benchmarks/bench_linear.py, benchmarks/gpu_clocks.py) on the CPU:
the order in which interleaved_time_us replays its graphs, the in-situ arithmetic, and what the NVML summary
reports. The GPU side of both runs in every bench_linear run on the H200. And the in-situ feed kernel
(benchmarks/feed_kernel.py): compiled on the CPU, run on the GPU."""

import csv
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_linear  # noqa: E402
import feed_kernel  # noqa: E402
import gpu_clocks  # noqa: E402


@pytest.fixture
def fake_graphs(monkeypatch):
    """capture() returns the list's index; replays_us() logs (index, replays) and gives per-call times from `cost`."""
    log, cost = [], {}

    def capture(calls, stream):
        return calls[0]

    def replays_us(graph, calls, replays, clocks=None):
        log.append((graph, replays))
        return [cost[graph] if graph in cost else float(graph)] * replays

    monkeypatch.setattr(bench_linear, "capture", capture)
    monkeypatch.setattr(bench_linear, "replays_us", replays_us)
    return log, cost


def test_interleaved_replays_every_list_in_rotating_turns(fake_graphs):
    log, _ = fake_graphs
    times = bench_linear.interleaved_time_us([[0], [1], [2]], stream=None)
    per_turn = bench_linear.REPLAYS // bench_linear.ROUNDS
    assert [r for _, r in log] == [per_turn] * (3 * bench_linear.ROUNDS)
    order = [g for g, _ in log]
    assert order[:9] == [0, 1, 2, 1, 2, 0, 2, 0, 1]  # each round starts one list later
    assert all(sorted(order[3 * r:3 * r + 3]) == [0, 1, 2] for r in range(bench_linear.ROUNDS))
    assert [t[1] for t in times] == [0.0, 1.0, 2.0]


def test_in_situ_subtracts_the_small_kernel(fake_graphs, monkeypatch):
    """A paired graph's per-entry time is (feed + call) / 2, so the call is twice it less the feed's."""
    log, cost = fake_graphs
    feed_us, call_us = 3.0, 10.0

    def capture(calls, stream):
        return "feed" if len(calls) == 2 else calls[1]  # [feed, feed] or [feed, call, feed, call]

    monkeypatch.setattr(bench_linear, "capture", capture)
    cost.update({"feed": feed_us, "a": (feed_us + call_us) / 2, "b": (feed_us + 2 * call_us) / 2})
    (a, b) = bench_linear.in_situ_times_us([["a", "a"], ["b", "b"]], x=None, stream=None)
    assert a == pytest.approx((call_us,) * 3) and b == pytest.approx((2 * call_us,) * 3)
    with pytest.raises(AssertionError, match="one length"):
        bench_linear.in_situ_times_us([["a"], ["b", "b"]], x=None, stream=None)


def test_in_situ_uses_the_given_feed(fake_graphs, monkeypatch):
    """A feed passed in is the small kernel of every paired graph and of the feed's own."""
    captured = []

    def capture(calls, stream):
        captured.append(list(calls))
        return len(captured)  # a graph fake_graphs times at this many us

    monkeypatch.setattr(bench_linear, "capture", capture)
    bench_linear.in_situ_times_us([["a", "a"]], x=None, stream=None, feed="f")
    assert captured == [["f", "f"], ["f", "a", "f", "a"]]


def test_feed_kernel_compiles_once_per_size():
    small, large = feed_kernel.compile_feed(0), feed_kernel.compile_feed(227 * 1024)
    assert small is not large and feed_kernel.compile_feed(0) is small


def test_feed_kernel_refuses_bad_input():
    with pytest.raises(ValueError, match="smem_bytes"):
        feed_kernel.compile_feed(228 * 1024)
    with pytest.raises(ValueError, match="contiguous"):
        feed_kernel.make_feed(torch.zeros(4, 6)[:, :3], 0)


@pytest.mark.requires_sm90
@pytest.mark.parametrize("kib", [0, 100, 227])
def test_feed_kernel_scales_x_with_its_shared_memory(kib):
    """The feed, compiled to ask for kib KiB of dynamic shared memory (227: a Hopper CTA's most, which the launch
    must opt in to), launches and scales every element: by 2 through the compiled kernel, by 3 through make_feed
    (the benchmarks' feed scales by 1); on fresh random data of a size not a multiple of the block."""
    x = torch.randn(3, 1000, device="cuda").to(torch.bfloat16)
    before = x.clone()
    feed_kernel.compile_feed(kib * 1024)(x.view(-1), 2.0)
    torch.cuda.synchronize()
    assert torch.equal(x, before * 2)
    feed_kernel.make_feed(x, kib * 1024, scale=3.0)()
    torch.cuda.synchronize()
    assert torch.equal(x, (before * 2) * 3)


def test_clock_summary():
    clocks = gpu_clocks.Clocks("not-a-bus-id")
    assert clocks.error  # no driver here, or no such GPU
    clocks.sample()
    assert clocks.take() == dict.fromkeys(gpu_clocks.FIELDS, "")
    clocks.samples = [(1980, 2619, 512.4, 0x0), (1755, 2619, 698.9, 0x4), (1830, 2600, 650.0, 0x1)]
    assert clocks.take() == {"sm_mhz_min": 1755, "sm_mhz_max": 1980, "mem_mhz_min": 2600, "power_w_max": "699",
                             "clock_events": "idle|sw-power-cap"}
    assert clocks.take() == dict.fromkeys(gpu_clocks.FIELDS, "")
    assert gpu_clocks.event_names(0) == ""
    assert gpu_clocks.event_names(0x40 | 0x10000) == "hw-thermal|0x10000"
    assert gpu_clocks.event_names(0x10 | 0x20 | 0x80 | 0x100) == "sync-boost|sw-thermal|hw-power-brake|display-clock"


def test_trace_cta_rows():
    """benchmarks/trace_linear.py --cta-csv: one row per CTA of each call after the skipped ones, its SM, the weight
    blocks it asked for before griddepcontrol.wait, its start and end against the call's first start and last end
    (globaltimer ns), its phases from the SM clock in ns."""
    import torch
    import trace_linear
    from torch_tma.kernels.linear import TRACE_FIELDS

    calls, ctas = trace_linear.SKIP_CALLS + 1, 2
    trace = torch.zeros(calls, ctas, len(TRACE_FIELDS), dtype=torch.int64)
    values = {  # per CTA of the last call; SM clock at 2 GHz (2 cycles per ns)
        "gt_start": (1000, 1300), "gt_end": (9000, 9500), "clk_start": (100, 50), "clk_first_issue": (300, 250),
        "clk_wait_done": (500, 450), "clk_first_ready": (2100, 2050), "clk_last_release": (14100, 16050),
        "clk_end": (14500, 17050), "sm": (7, 12), "pre_wait_loads": (6, 11)}
    for name, per_cta in values.items():
        trace[-1, :, TRACE_FIELDS.index(name)] = torch.tensor(per_cta)
    rows = trace_linear.cta_rows(trace, TRACE_FIELDS, calls, 2.0)
    assert [(r["call"], r["cta"], r["sm"], r["pre_wait_loads"]) for r in rows] == [(calls - 1, 0, 7, 6),
                                                                                  (calls - 1, 1, 12, 11)]
    assert [(r["start_ns"], r["end_ns"]) for r in rows] == [(0.0, -500.0), (300.0, 0.0)]
    assert [(r["issue_ns"], r["wait_ns"], r["ready_ns"], r["stream_ns"], r["tail_ns"]) for r in rows] == [
        (100.0, 200.0, 1000.0, 6000.0, 200.0), (100.0, 200.0, 1000.0, 7000.0, 500.0)]


def test_trace_summary_splits_a_cluster_tail():
    """benchmarks/trace_linear.py's per-CTA medians: the tail of a CTA that sent partial pieces splits into send (last
    stage consumed -> pieces sent) and recv (sent -> its own pieces in, the fix-up's start); CTAs of no cluster split
    (clk_sent 0) stay out of both."""
    import torch
    import trace_linear
    from torch_tma.kernels.linear import TRACE_FIELDS

    calls, ctas = trace_linear.SKIP_CALLS + 1, 2
    trace = torch.zeros(calls, ctas, len(TRACE_FIELDS), dtype=torch.int64)
    values = {  # SM clock at 2 GHz; CTA 0 sent and summed, CTA 1 neither
        "gt_start": (0, 0), "gt_end": (5700, 5700), "clk_start": (0, 0), "clk_first_ready": (2000, 2000),
        "clk_last_release": (10000, 10000), "clk_sent": (10400, 0), "clk_fixup_start": (11000, 0),
        "fixups": (1, 0), "clk_end": (11400, 11400)}
    for name, per_cta in values.items():
        trace[-1, :, TRACE_FIELDS.index(name)] = torch.tensor(per_cta)
    out = trace_linear.summarize(trace, TRACE_FIELDS, calls)
    assert out["sm_ghz"] == 2.0
    assert (out["send_p50"], out["recv_p50"], out["fixup_p50"], out["tail_p50"]) == (0.2, 0.3, 0.2, 0.7)


def test_gpc_load_groups_sms_by_cluster_and_counts_ctas_per_group():
    """docs/probes/gpc_load.py: SMs that held CTAs of one cluster share a group (transitively, across calls); a CTA's
    stream time is filed under the number of CTAs of its call in its group."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs" / "probes"))
    import gpc_load

    def row(call, cta, sm, k, stream):
        return {"N": "8", "K": "64", "M": "1", "variant": "v", "mode": "m", "cluster_k": str(k), "call": str(call),
                "cta": str(cta), "sm": str(sm), "stream_ns": str(stream)}

    # call 0: clusters of 2 on SMs (0, 1) and (1, 2), so 0, 1, 2 are one group; SM 5 alone
    rows = [row(0, 0, 0, 2, 100), row(0, 1, 1, 2, 100), row(0, 2, 1, 2, 200), row(0, 3, 2, 2, 200),
            row(0, 4, 5, 2, 50), row(0, 5, 5, 2, 70)]
    group = gpc_load.sm_groups(rows)
    assert group[0] == group[1] == group[2] != group[5]
    by_load = gpc_load.stream_by_load(rows, group)[("8", "64", "1", "v", "m")]
    assert sorted(by_load) == [2, 4] and by_load[4] == [100.0, 100.0, 200.0, 200.0] and by_load[2] == [50.0, 70.0]


def test_balance_bound_takes_cluster_and_launch_means():
    """docs/probes/balance_bound.py: a CTA's end of streaming is start + ready + stream; the in-cluster bound is the
    last end minus the latest cluster's mean end, the launch bound the last end minus the mean over all CTAs; a block
    is the median stream time over the blocks per CTA."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs" / "probes"))
    import balance_bound

    def row(call, cta, start, ready, stream):
        return {"N": "256", "K": "256", "M": "1", "variant": "v", "mode": "m", "cluster_k": "2", "call": str(call),
                "cta": str(cta), "start_ns": str(start), "ready_ns": str(ready), "stream_ns": str(stream)}

    # call 0, ends: cluster 0 = (1000, 3000), cluster 1 = (2000, 2000); stream alone: (900, 2000), (1500, 1000)
    call0 = [row(0, 0, 0, 100, 900), row(0, 1, 0, 1000, 2000), row(0, 2, 256, 244, 1500), row(0, 3, 512, 488, 1000)]
    b = balance_bound.call_bounds(call0)
    assert (b["last"], b["cluster"], b["launch"]) == (3000.0, 2000.0, 2000.0)
    assert (b["last_stream"], b["cluster_stream"], b["launch_stream"]) == (2000.0, 1450.0, 1350.0)
    # call 1: every CTA ends at 4000 after the same stream, so nothing to take back
    call1 = [row(1, c, 0, 1000, 3000) for c in range(4)]
    out = balance_bound.bounds(call0 + call1)[("256", "256", "1", "v", "m")]
    assert out["ctas"] == 4 and out["cluster_k"] == 2 and out["last"] == 3.5  # median of 3000 and 4000 ns
    assert out["cluster"] == 0.5 and out["launch"] == 0.5  # medians of (1000, 0) ns
    assert out["cluster_stream"] == 0.275 and out["launch_stream"] == 0.325
    assert out["block"] == 2500 / 2 / 1e3  # K=256: 4 blocks over clusters of 2; stream median over 8 CTA-calls


def test_replays_are_timed_behind_a_spin(monkeypatch):
    """Each replay's start event is queued behind a spin kernel, so the host's graph launch is not timed."""
    log = []

    class Event:
        def __init__(self, enable_timing):
            pass

        def record(self):
            log.append("record")

        def synchronize(self):
            log.append("wait")

        def elapsed_time(self, other):
            return 0.004  # ms

    class Graph:
        def replay(self):
            log.append("replay")

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: log.append(("spin", cycles)))
    per_call = bench_linear.replays_us(Graph(), calls=2, replays=3)
    assert per_call == pytest.approx([2.0] * 3)
    assert log == [("spin", bench_linear.SPIN_CYCLES), "record", "replay", "record", "wait"] * 3

    class Clocks:  # NVML is read once the start event has fired: during the replay, not the spin
        def sample(self):
            log.append("sample")

    log.clear()
    bench_linear.replays_us(Graph(), calls=2, replays=1, clocks=Clocks())
    assert log == [("spin", bench_linear.SPIN_CYCLES), "record", "replay", "record", "wait", "sample", "wait"]


def _grid_rows(times):
    """Rows as bench_linear.run records them: {(N, K, M, provider): us_p50}, plus a host row."""
    rows = []
    for (n, k, m, provider), us in times.items():
        for metric in ("gpu_us", "gpu_us_in_situ"):
            rows.append({"metric": metric, "name": f"{n}x{k}", "N": n, "K": k, "M": m, "provider": provider,
                         "l2_promotion": "", "us_p20": us, "us_p50": f"{us:.3f}", "us_p80": us,
                         "bytes": bench_linear.stream_bytes(n, k, m)})
    rows.append({"metric": "host_us", "name": "h", "N": 1, "K": 1, "M": 1, "provider": "cublas", "l2_promotion": "",
                 "us_min": "9.0", "us_p20": "", "us_p50": "13.0", "us_p80": "", "bytes": ""})
    return rows


def test_the_ceiling_is_the_fastest_rate_of_the_run():
    # 4096x4096 bf16 M=1: 33.57 MB; at 8 us that is 4,197 GB/s, at 7 us 4,796 GB/s
    rows = _grid_rows({(4096, 4096, 1, "torch_tma"): 7.0, (4096, 4096, 1, "cublas"): 8.0})
    said = bench_linear.apply_ceiling(rows, measured_gbs=4300.0)
    ceiling = (4096 * 4096 + 4096 + 4096) * 2 / 7.0 / 1e3
    assert f"{ceiling:.0f} GB/s from 4096x4096 M=1 torch_tma" in said
    pct = {(r["metric"], r["provider"]): float(r["pct_floor"]) for r in rows if r["bytes"] != ""}
    assert pct[("gpu_us", "torch_tma")] == 100.0 and pct[("gpu_us", "cublas")] == pytest.approx(87.5, abs=0.05)
    rows = _grid_rows({(4096, 4096, 1, "torch_tma"): 8.0})
    assert "from torch.sum / copy" in bench_linear.apply_ceiling(rows, measured_gbs=5000.0)
    assert all(r["ceiling_gbs"] == "5000" for r in rows if r["bytes"] != "")


def test_each_metric_file_has_one_row_per_shape_m_and_provider(tmp_path):
    rows = _grid_rows({(4096, 4096, m, p): 8.0 + m for m in (1, 16) for p in ("torch_tma", "cublas")})
    bench_linear.apply_ceiling(rows, 4300.0)
    path = str(tmp_path / "grid.csv")
    bench_linear.write_csvs(path, rows)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grid-host.csv", "grid-in-situ.csv", "grid.csv"]
    with open(path) as f:
        main = list(csv.DictReader(f))
    assert {r["metric"] for r in main} == {"gpu_us"} and len(main) == 4
    back = bench_linear.read_rows(path)
    assert sorted((r["metric"], r["M"], r["provider"]) for r in back) == sorted(
        (r["metric"], str(r["M"]), r["provider"]) for r in rows)
    with pytest.raises(AssertionError, match="more than one row"):
        bench_linear.write_csvs(path, rows + rows[:1])


def test_restate_splits_an_older_grid_and_takes_its_ceiling_again(tmp_path):
    """An older grid: one CSV, every metric, floors against torch.sum's ceiling, the host minimum in us_p20."""
    old_fields = [f for f in bench_linear.CSV_FIELDS if f not in ("us_min", "bytes")]
    rows = _grid_rows({(4096, 4096, 1, "torch_tma"): 7.0, (4096, 4096, 1, "cublas"): 8.0})
    for r in rows:
        r.pop("bytes")
        r.update(ceiling_gbs="4300", floor_us="" if r["metric"] == "host_us" else "7.8")
    host = rows[-1]
    host.update(us_p20=host.pop("us_min"), us_p80=host["us_p50"])
    path = tmp_path / "old.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=old_fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    bench_linear.restate(str(path))
    back = {(r["metric"], r["provider"]): r for r in bench_linear.read_rows(str(path))}
    assert back[("gpu_us", "torch_tma")]["pct_floor"] == "100.0"
    assert back[("host_us", "cublas")]["us_min"] == "9.0" and back[("host_us", "cublas")]["us_p20"] == ""
    assert (tmp_path / "old-in-situ.csv").exists()
