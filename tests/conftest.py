"""Test-suite switches. GPU tests carry the marker ``requires_sm90`` and are skipped, with a reason, where no
Hopper GPU is visible (CI). On the GPU machine set TORCH_TMA_REQUIRE_GPU=1: a missing GPU then fails the run
instead of skipping it, so a GPU pass cannot silently test nothing."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/spec_fuzz.py
# CuTe DSL compiles for sm_100a when it sees no GPU; every kernel here targets Hopper.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def pytest_configure(config):
    config.addinivalue_line("markers", "requires_sm90: needs a Hopper (sm_90) GPU; skipped elsewhere")


def pytest_collection_modifyitems(config, items):
    if _hopper():
        return
    if os.environ.get("TORCH_TMA_REQUIRE_GPU") == "1":
        raise pytest.UsageError("TORCH_TMA_REQUIRE_GPU=1 but no Hopper GPU is visible")
    skip = pytest.mark.skip(reason="needs a Hopper (sm_90) GPU")
    for item in items:
        if "requires_sm90" in item.keywords:
            item.add_marker(skip)
