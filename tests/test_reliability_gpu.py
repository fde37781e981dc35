"""Issue 6 on the GPU: no stale descriptor is ever read while tensors are allocated, freed, reallocated (the
caching allocator handing a freed block to a tensor of another shape), resized and swapped across two streams.

Every step is followed by a kernel that reads the weight through the cache (torch.ops.tma.linear streams its
weight through the cached TMA descriptor) and the result is checked against F.linear: a descriptor that still
pointed at an old tensor, shape or stride would read the wrong bytes or the wrong extent."""
import math
import random
import time

import pytest
import torch
import torch.nn.functional as F

import torch_tma
from test_ops import assert_matches_reference
from torch_tma import ops

pytestmark = [pytest.mark.requires_sm90, pytest.mark.timeout(600, method="thread")]
DEV = torch.device("cuda", 0)
SHAPES = [(256, 512), (512, 256), (384, 512), (256, 1024)]  # equal byte sizes pairwise: blocks get reused


def _weight(shape):
    n, k = shape
    return (torch.randn(n, k, dtype=torch.float64, device=DEV) / math.sqrt(k)).to(torch.bfloat16)


def _check(weight, stream):
    with torch.cuda.stream(stream):
        x = torch.randn(4, weight.shape[1], dtype=torch.bfloat16, device=DEV)
        assert ops.unsupported_reason(x, weight, None) is None
        out = torch.ops.tma.linear(x, weight)
        ref = F.linear(x, weight)
    stream.synchronize()
    ref64 = F.linear(x.double().cpu(), weight.double().cpu())
    assert_matches_reference(out, ref, ref64)


def test_no_stale_descriptor_under_allocate_free_reallocate_resize_swap():
    rng = random.Random(time.time_ns())
    streams = [torch.cuda.Stream(DEV), torch.cuda.Stream(DEV)]
    layer = torch_tma.nn.Linear(512, 256, bias=False, device=DEV, dtype=torch.bfloat16)
    live = [_weight(rng.choice(SHAPES)) for _ in range(3)]
    counts = {}
    for _ in range(300):
        op = rng.choice(["alloc", "free_realloc", "resize", "swap", "param_data", "copy_"])
        counts[op] = counts.get(op, 0) + 1
        stream = rng.choice(streams)
        if op == "alloc":
            live.append(_weight(rng.choice(SHAPES)))
            target = live[-1]
        elif op == "free_realloc":  # free a block, then a tensor of another shape takes the same bytes
            old = live.pop(rng.randrange(len(live)))
            old_ptr, old_shape = old.data_ptr(), tuple(old.shape)
            for s in streams:
                s.synchronize()
            del old
            shape = rng.choice([s for s in SHAPES if s != old_shape and s[0] * s[1] == old_shape[0] * old_shape[1]]
                               or SHAPES)
            live.append(_weight(shape))
            target = live[-1]
            counts["same_block"] = counts.get("same_block", 0) + (target.data_ptr() == old_ptr)
        elif op == "resize":  # same storage, a narrower view of it
            i = rng.randrange(len(live))
            live[i] = live[i][: live[i].shape[0] // 2] if live[i].shape[0] >= 128 else _weight(rng.choice(SHAPES))
            target = live[i]
        elif op == "swap":
            i, j = rng.randrange(len(live)), rng.randrange(len(live))
            live[i], live[j] = live[j], live[i]
            target = live[i]
        elif op == "param_data":  # a bound module weight moved to new storage
            layer.weight.data = _weight((256, 512))
            target = layer.weight.detach()
        else:  # in-place copy: same address, new values, no refresh needed
            with torch.no_grad():
                layer.weight.copy_(_weight((256, 512)))
            target = layer.weight.detach()
        _check(target, stream)
        if op in ("param_data", "copy_"):
            with torch.cuda.stream(stream):
                x = torch.randn(2, 512, dtype=torch.bfloat16, device=DEV)
                y = layer(x)
            stream.synchronize()
            assert_matches_reference(y, F.linear(x, layer.weight), F.linear(x.double().cpu(),
                                                                            layer.weight.double().cpu()))
    assert counts.get("same_block", 0) > 0, f"the caching allocator never reused a block: {counts}"
