"""The benchmark's timing and clock bookkeeping (benchmarks/bench_linear.py, benchmarks/gpu_clocks.py) on the CPU:
the order in which interleaved_time_us replays its graphs, the in-situ arithmetic, and what the NVML summary
reports. The GPU side of both runs in every bench_linear run on the H200."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_linear  # noqa: E402
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
    assert gpu_clocks.event_names(0x80 | 0x10000) == "hw-thermal|0x10000"
