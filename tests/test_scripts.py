"""The GPU-only scripts (benchmarks/, docs/probes/) import and parse their arguments on the CPU.

They run only on the H200, so without this a broken import or option would show first in a GPU session, where
device time is scarce. Each is run as __main__ with --help in this process (the imports are shared with the other
tests) and must print its usage and exit 0. The parts that need no GPU run for real: ncu_linear's summary of a
profile and ptx_hashes' PTX hashes.
"""

import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in [*ROOT.glob("benchmarks/*.py"), *ROOT.glob("docs/probes/*.py")]
                 # a pytest-benchmark module, collected by pytest, and a module the sweep imports: neither is run
                 if p.name not in ("bench_cache.py", "feed_kernel.py"))


def test_every_script_is_listed():
    assert {p.name for p in SCRIPTS} >= {"bench_linear.py", "bench_decode.py", "profile_host.py",
                                         "cluster_racecheck.py", "fallback_order.py"}


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_script_answers_help(path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(path), "--help"])
    monkeypatch.setattr(sys, "path", list(sys.path))  # scripts that add their own folder leave no trace
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(path), run_name="__main__")
    assert exit_info.value.code in (0, None)
    assert capsys.readouterr().out.startswith("usage:")


@pytest.fixture
def ncu_linear(monkeypatch):
    """benchmarks/ncu_linear.py as a module, its folder on sys.path only for the test (it imports its siblings)."""
    monkeypatch.setattr(sys, "path", [str(ROOT / "benchmarks"), *sys.path])
    import ncu_linear
    return ncu_linear


def _ncu_row(launch, kernel, metric, value):
    """One row of `ncu --csv` output as ncu writes it (17 columns)."""
    return [str(launch), "1", "python3", "host", '1  "<default domain>:profile:none:none:none:none:none:none" ', "",
            kernel, "1", "7", "(160, 1, 1)", "(1, 112, 1)", "0", "9.0", "Command line profiler metrics", metric, "byte",
            value]


def test_ncu_summary_names_launches_from_the_scripts_log(tmp_path, capsys, ncu_linear):
    import csv
    ours, theirs, reduce = ncu_linear.OUR_KERNEL + "_build", "nvjet_sm90_tst_splitK", "splitKreduce_kernel"
    launches = [(ours, "0", "42,500"), (ours, "1,000,000", "41,000"), (theirs, "2,000,000", "44,000"),
                (reduce, "0", "4,000")]
    path, log = tmp_path / "ncu.csv", tmp_path / "run.log"
    with open(path, "w", newline="") as f:
        f.write("==PROF== Connected to process 1\n")
        csv.writer(f, quoting=csv.QUOTE_ALL).writerows(
            row for i, (kernel, written, ns) in enumerate(launches)
            for row in (_ncu_row(i, kernel, "dram__bytes_write.sum", written),
                        _ncu_row(i, kernel, "gpu__time_duration.sum", ns)))
    log.write_text("ours a (96 CTAs): 2 launches\ncublas b: 1 launches\n")
    ncu_linear.summarize(str(path), str(log))
    assert capsys.readouterr().out.splitlines() == [
        f"ours a (96 CTAs) | {ours} | 2 launches | 41.00-42.50 us | 0.00-1.00 MB written",
        f"cublas b | {theirs} | 1 launches | 44.00-44.00 us | 2.00-2.00 MB written",
        f"cublas b | {reduce} | 1 launches | 4.00-4.00 us | 0.00-0.00 MB written"]
    log.write_text("ours a (96 CTAs): 1 launches\n")  # a log of another run names too few launches
    with pytest.raises(SystemExit, match="names 1 of the 4 launches"):
        ncu_linear.summarize(str(path), str(log))


def test_ncu_summary_of_the_first_eviction_run(capsys, ncu_linear):
    """docs/results keeps the first eviction run's CSV and log; the shipped launches wrote nothing back to DRAM."""
    results = ROOT / "docs" / "results"
    ncu_linear.summarize(str(results / "ncu-eviction-h100-run1-warm.csv.xz"),
                         str(results / "ncu-eviction-h100-run1-warm.log"))
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 20  # 6 cells x (2 builds + cuBLAS), and the split-K reduce kernel at 4096x4096 M=1, 16
    assert all(" | 3 launches | " in line for line in lines)
    shipped = [line for line in lines if line.startswith("ours shipped")]
    assert len(shipped) == 6 and all("0.00-0.00 MB written" in line for line in shipped)
    assert sum(line.startswith("cublas 4096x4096 M=16 | ") for line in lines) == 2


def test_ptx_hashes_tell_builds_apart(monkeypatch, capsys, tmp_path):
    """docs/probes/ptx_hashes.py on this checkout (--tree): one build compiled for M=1 and M=8 (both pad to 8) hashes
    the same, the shipped lead of 3 loads against none at M=1 hashes differently; and a --tree its imports did not
    come from (torch_tma is already imported from this checkout) is refused rather than hashed."""
    path = ROOT / "docs" / "probes" / "ptx_hashes.py"
    argv = [str(path), "--tree", str(ROOT), "--variants", "shipped", "no-lead", "--shapes", "4096x4096", "--ms", "1",
            "8", "--bias", "0"]
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(sys, "path", list(sys.path))
    runpy.run_path(str(path), run_name="__main__")
    lines = dict(line.rsplit(" ", 1) for line in capsys.readouterr().out.splitlines())
    assert list(lines) == [f"{v} 4096x4096 M={m} bias=0" for v in ("shipped", "no-lead") for m in (1, 8)]
    assert all(len(h) == 16 and int(h, 16) >= 0 for h in lines.values())
    assert lines["shipped 4096x4096 M=1 bias=0"] == lines["shipped 4096x4096 M=8 bias=0"]
    assert lines["shipped 4096x4096 M=1 bias=0"] != lines["no-lead 4096x4096 M=1 bias=0"]
    (tmp_path / "benchmarks").mkdir()
    monkeypatch.setattr(sys, "argv", [str(path), "--tree", str(tmp_path), "--shapes", "4096x4096", "--ms", "1"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(path), run_name="__main__")
    assert exit_info.value.code == 2 and "was imported from" in capsys.readouterr().err


def test_host_cost_is_timed_in_turns(monkeypatch):
    """profile_host.host_us_in_turns gives each callable one round before any gets its next (what bench_linear's
    op-against-F.linear host line relies on), with the GPU spin queued before every round; the GPU calls are
    replaced by records, so the order is checked on the CPU."""
    monkeypatch.setattr(sys, "path", [str(ROOT / "benchmarks"), *sys.path])
    import profile_host
    import torch
    log = []
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: log.append("spin"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: log.append("sync"))
    monkeypatch.setattr(profile_host, "CALLS", 3)
    timed = profile_host.host_us_in_turns([lambda: log.append("a"), lambda: log.append("b")], rounds=2)
    assert log == ["a"] * 20 + ["b"] * 20 + ["sync"] + (["spin", "a", "a", "a", "sync", "spin", "b", "b", "b", "sync"]
                                                       * 2)
    assert len(timed) == 2 and all(low <= p50 for p50, low in timed)
