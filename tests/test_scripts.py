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
