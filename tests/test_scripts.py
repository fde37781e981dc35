"""The GPU-only scripts (benchmarks/, docs/probes/) import and parse their arguments on the CPU.

They run only on the H200, so without this a broken import or option would show first in a GPU session, where
device time is scarce. Each is run as __main__ with --help in this process (the imports are shared with the other
tests) and must print its usage and exit 0.
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


def _ncu_row(launch, ranges, kernel, metric, value):
    """One row of `ncu --csv` output as ncu writes it (17 columns; the ranges column as ncu nests them)."""
    stack = " ".join(f'"<default domain>:{name}:none:none:none:none:none:none"' for name in ranges)
    return [str(launch), "1", "python3", "host", f"1  {stack} ", "", kernel, "1", "7", "(160, 1, 1)", "(1, 112, 1)",
            "0", "9.0", "Command line profiler metrics", metric, "byte", value]


def test_ncu_summary_groups_launches_by_label_range(tmp_path, capsys):
    import csv
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import ncu_linear
    ours, theirs = ncu_linear.OUR_KERNEL + "_build", "nvjet_sm90_tst"
    rows = [_ncu_row(0, ["profile", "ours a"], ours, "dram__bytes_write.sum", "0"),
            _ncu_row(0, ["profile", "ours a"], ours, "gpu__time_duration.sum", "42,500"),
            _ncu_row(1, ["profile", "ours a"], ours, "dram__bytes_write.sum", "1,000,000"),
            _ncu_row(1, ["profile", "ours a"], ours, "gpu__time_duration.sum", "41,000"),
            _ncu_row(2, ["profile", "cublas b"], theirs, "dram__bytes_write.sum", "2,000,000"),
            _ncu_row(2, ["profile", "cublas b"], theirs, "gpu__time_duration.sum", "44,000")]
    path = tmp_path / "ncu.csv"
    with open(path, "w", newline="") as f:
        f.write("==PROF== Connected to process 1\n")
        csv.writer(f, quoting=csv.QUOTE_ALL).writerows(rows)
    ncu_linear.summarize(str(path))
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"ours a | {ours} | 2 launches | 41.00-42.50 us | 0.00-1.00 MB written",
                     f"cublas b | {theirs} | 1 launches | 44.00-44.00 us | 2.00-2.00 MB written"]


def test_ncu_summary_labels_run1_from_the_scripts_log(capsys):
    """docs/results' first eviction run has no label ranges: the log's lines name its launches in order (two cuBLAS
    kernels a call at 4096x4096 M <= 16)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import ncu_linear
    results = ROOT / "docs" / "results"
    ncu_linear.summarize(str(results / "ncu-eviction-h100-run1-warm.csv.xz"),
                         str(results / "ncu-eviction-h100-run1-warm.log"))
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 20  # 6 cells x (2 builds + cuBLAS), and the split-K reduce kernel at 4096x4096 M=1, 16
    assert all(" | 3 launches | " in line for line in lines)
    shipped = [line for line in lines if line.startswith("ours shipped")]
    assert len(shipped) == 6 and all("0.00-0.00 MB written" in line for line in shipped)
    assert sum(line.startswith("cublas 4096x4096 M=16 | ") for line in lines) == 2
