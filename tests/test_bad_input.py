"""Bad input to the op and the modules: each row of docs/validation.md's "ops and modules" table, one case each.

A row either raises a named exception whose message matches, or is a documented fallback: the result equals
F.linear's and the "torch_tma" logger names the cause. The descriptor-service rows are in test_spec.py and
test_cache_cpu.py.
"""

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torch_tma
import torch_tma.nn as tnn
from torch_tma import ops

from test_ops import assert_matches_reference, poison_next_allocation, reference

GPU_TIMEOUT_S = 300
ArgErr = ops.LinearArgumentError


def _xw(m=3, n=16, k=32, dtype=torch.float32, device="cpu"):
    return (torch.randn(m, k, dtype=dtype, device=device), torch.randn(n, k, dtype=dtype, device=device) / math.sqrt(k))


# (id, call, exception, message regex): raised on every machine
RAISES = [
    ("op x not a tensor", lambda: torch.ops.tma.linear([1.0], torch.ones(2, 2)), RuntimeError,
     "Expected a value of type 'Tensor' for argument 'x'"),
    ("op weight 1-D", lambda: torch.ops.tma.linear(*_xw()[:1], torch.ones(32)), ArgErr, "weight must be 2-D"),
    ("op K mismatch", lambda: torch.ops.tma.linear(torch.ones(3, 8), _xw()[1]), ArgErr,
     "x's last dim must equal weight's K=32"),
    ("op 0-d x", lambda: torch.ops.tma.linear(torch.tensor(1.0), _xw()[1]), ArgErr, "x's last dim"),
    ("op bias shape", lambda: torch.ops.tma.linear(*_xw(), torch.ones(8)), ArgErr, r"bias must be \[N=16\]"),
    ("op dtype mismatch", lambda: torch.ops.tma.linear(_xw()[0], _xw()[1].bfloat16()), ArgErr,
     "weight is torch.bfloat16 on cpu, x is torch.float32 on cpu: they must match"),
    ("op bias dtype mismatch", lambda: torch.ops.tma.linear(*_xw(), torch.ones(16, dtype=torch.float64)), ArgErr,
     "bias is torch.float64 on cpu, x is torch.float32"),
    ("op meta dtype mismatch", lambda: torch.ops.tma.linear(torch.ones(2, 8, device="meta"),
                                                            torch.ones(3, 8, device="meta", dtype=torch.half)),
     ArgErr, "weight is torch.float16 on meta"),
    ("op promotion value", lambda: torch.ops.tma.linear(*_xw(), l2_promotion=7), ArgErr, "l2_promotion=7"),
    ("op promotion string", lambda: torch.ops.tma.linear(*_xw(), l2_promotion="L2_64B"), RuntimeError,
     "Optional\\[int\\]' for argument 'l2_promotion'"),
    ("op meta bad K", lambda: torch.ops.tma.linear(torch.ones(2, 8, device="meta"), torch.ones(3, 4, device="meta")),
     ArgErr, "weight's K=4"),
    ("Linear promotion", lambda: tnn.Linear(8, 8, l2_promotion=9), ValueError,
     r"l2_promotion=9 is not a L2Promotion \(valid: NONE=0, L2_64B=1"),
    ("Linear promotion bool", lambda: tnn.Linear(8, 8, l2_promotion=True), TypeError,
     "l2_promotion must be a torch_tma.L2Promotion, got bool True"),
    ("from_linear non-Linear", lambda: tnn.Linear.from_linear(nn.Conv1d(1, 1, 1)), TypeError,
     "expected an nn.Linear, got Conv1d"),
    ("swap_linear_ non-module", lambda: tnn.swap_linear_([nn.Linear(8, 8)]), TypeError,
     "model must be an nn.Module, got list"),
    ("swap_linear_ filter", lambda: tnn.swap_linear_(nn.Linear(8, 8), filter_fn=True), TypeError,
     "filter_fn must be callable"),
    ("swap_linear_ promotion", lambda: tnn.swap_linear_(nn.Linear(8, 8), l2_promotion=5), ValueError,
     "l2_promotion=5 is not a L2Promotion"),
    ("unswap_linear_ non-module", lambda: tnn.unswap_linear_("model"), TypeError, "model must be an nn.Module"),
    ("refresh non-module", lambda: torch_tma.refresh(None), TypeError, "model must be an nn.Module, got NoneType"),
]


@pytest.mark.parametrize("call,exc,match", [c[1:] for c in RAISES], ids=[c[0] for c in RAISES])
def test_raises(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


# the same mistakes made with nn.Linear's F.linear: each raises a RuntimeError there, and the op's error is one too
F_LINEAR_MISTAKES = [
    ("K mismatch", lambda: (torch.ones(3, 8), _xw()[1], None)),
    ("bias shape", lambda: (*_xw(), torch.ones(8))),
    ("dtype mismatch", lambda: (_xw()[0], _xw()[1].double(), None)),
    ("bias dtype mismatch", lambda: (*_xw(), torch.ones(16, dtype=torch.float64))),
]


@pytest.mark.parametrize("make", [c[1] for c in F_LINEAR_MISTAKES], ids=[c[0] for c in F_LINEAR_MISTAKES])
def test_op_errors_are_caught_where_f_linear_errors_are(make):
    args = make()
    with pytest.raises(RuntimeError):
        F.linear(*args)
    with pytest.raises(RuntimeError) as raised:
        torch.ops.tma.linear(*args)
    assert isinstance(raised.value, ValueError) and type(raised.value) is ArgErr
    layer = tnn.Linear(args[1].shape[1], args[1].shape[0], bias=args[2] is not None, dtype=args[1].dtype)
    with torch.no_grad():
        layer.weight.copy_(args[1])
    if args[2] is not None:
        layer.bias = nn.Parameter(args[2])
    with pytest.raises(RuntimeError) as raised:  # the module, which nn.Linear's users call
        layer(args[0])
    assert type(raised.value) is ArgErr


def test_swap_linear_bad_promotion_leaves_model_unchanged():
    model = nn.Sequential(nn.Linear(8, 8))
    with pytest.raises(ValueError):
        tnn.swap_linear_(model, l2_promotion=5)
    assert type(model[0]) is nn.Linear


def test_meta_tensors_give_meta_output_of_the_right_shape():
    out = torch.ops.tma.linear(torch.ones(2, 5, 8, device="meta"), torch.ones(3, 8, device="meta"))
    assert out.device.type == "meta" and out.shape == (2, 5, 3)
    layer = tnn.Linear(8, 3, device="meta")
    assert layer(torch.ones(4, 8, device="meta")).shape == (4, 3)


def test_empty_x_gives_empty_output_cpu():
    x, w = _xw(0)
    assert torch.ops.tma.linear(x, w).shape == (0, 16)


# ---- CUDA: documented fallbacks and errors -----------------------------------------------------------------

def on_gpu(fn):
    """An sm_90 GPU and a hard timeout (both marks on the test, not one inside the other)."""
    return pytest.mark.requires_sm90(pytest.mark.timeout(GPU_TIMEOUT_S, method="thread")(fn))


def _bf16(m, n, k):
    return _xw(m, n, k, torch.bfloat16, "cuda")


def _offset_x():
    x, w = _bf16(4, 256, 512)
    return torch.randn(4 * 512 + 1, dtype=torch.bfloat16, device="cuda")[1:].view(4, 512), w


def _transposed_weight():
    x, _ = _bf16(4, 256, 512)
    return x, torch.randn(512, 256, dtype=torch.bfloat16, device="cuda").t()


# (id, inputs, cause the log names): the op falls back to F.linear and logs the cause once
FALLBACKS = [
    ("float32", lambda: _xw(4, 256, 512, torch.float32, "cuda"), "dtype torch.float32 is not bfloat16 or float16"),
    ("storage offset of one element", _offset_x, "not 16-byte aligned"),
    ("non-contiguous weight", _transposed_weight, "weight is not contiguous"),
    ("K not a multiple of 8", lambda: _bf16(4, 256, 516), "K must be a multiple of 8"),
    ("M=0", lambda: _bf16(0, 256, 512), "empty x or weight"),
    ("M above the largest tile", lambda: _bf16(200, 256, 512), "M=200 is above the crossover M=16 for a 256x512 weight"),
    ("M above the crossover", lambda: _bf16(48, 256, 512), "M=48 is above the crossover M=16 for a 256x512 weight"),
]


@on_gpu
@pytest.mark.parametrize("make,cause", [c[1:] for c in FALLBACKS], ids=[c[0] for c in FALLBACKS])
def test_fallback_matches_f_linear_and_logs_the_cause(make, cause, caplog, monkeypatch):
    monkeypatch.setattr(ops, "_logged_reasons", set())
    x, w = make()
    with caplog.at_level(logging.INFO, logger="torch_tma"):
        out = torch.ops.tma.linear(x, w)
    torch.testing.assert_close(out, F.linear(x, w), rtol=0, atol=0)
    assert any(cause in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


@on_gpu
def test_mixed_devices_raise_naming_the_argument(caplog, monkeypatch):
    monkeypatch.setattr(ops, "_logged_reasons", set())
    x, w = _bf16(4, 256, 512)
    with caplog.at_level(logging.INFO, logger="torch_tma"):
        with pytest.raises(ArgErr, match="weight is torch.bfloat16 on cuda:0, x is torch.bfloat16 on cpu"):
            torch.ops.tma.linear(x.cpu(), w)
        with pytest.raises(ArgErr, match="bias is torch.bfloat16 on cpu, x is torch.bfloat16 on cuda:0"):
            torch.ops.tma.linear(x, w, torch.zeros(256, dtype=torch.bfloat16))
        with pytest.raises(ArgErr, match="weight is torch.float16 on cuda:0, x is torch.bfloat16 on cuda:0"):
            torch.ops.tma.linear(x, w.half())
    assert not caplog.records  # no fallback is claimed for a call that raises


@on_gpu
def test_refresh_during_capture_raises_capture_miss():
    layer = tnn.Linear(512, 256, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16)
    layer(x)  # binds
    layer.weight.data = torch.randn_like(layer.weight)  # new storage: the next sync must re-encode
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with pytest.raises(torch_tma.CaptureMissError, match="capturing a CUDA graph"):
        with torch.cuda.graph(graph, stream=stream):
            torch_tma.refresh(layer)
    torch_tma.refresh(layer)  # outside capture it works, and the layer computes with the new weight
    with torch.no_grad():
        poison_next_allocation((1, 256), torch.bfloat16, "cuda")
        assert_matches_reference(layer(x), *reference(x, layer.weight, None))
