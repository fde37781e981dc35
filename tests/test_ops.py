"""torch.ops.tma.linear: numerics against float64, descriptor reuse, fallbacks, autograd, torch.compile, opcheck.

Each behaviour is one _test_*(device, ...) helper with thin CPU and CUDA wrappers; the CUDA ones need an
sm_90 GPU (marker requires_sm90) and run under a hard timeout because a TMA or mbarrier mistake hangs.
"""

import logging
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import torch_tma
from torch_tma import ops

CUDA_TIMEOUT_S = 120

# (leading dims of x, N, K): decode rows M = 1, 4, 16 (up to the crossover), ragged N and K
# (not multiples of the 128 x 64 weight box), and x with two leading dims.
SHAPES = [((1,), 4096, 4096), ((4,), 1000, 1032), ((2, 8), 384, 256), ((16,), 256, 512), ((1,), 136, 8)]


def assert_matches_reference(ours: torch.Tensor, lowp: torch.Tensor, ref64: torch.Tensor) -> None:
    """|ours - ref64| <= 2 |lowp - ref64| + atol elementwise, where lowp is PyTorch's own result in ours' dtype.

    atol is one unit of ours' precision at the largest reference magnitude: where PyTorch's rounding happens to
    land on the exact value, ours may still round the other way.
    """
    assert ours.shape == ref64.shape and ours.dtype == lowp.dtype, (ours.shape, ours.dtype, lowp.dtype)
    ours64, lowp64, ref = ours.double().cpu(), lowp.double().cpu(), ref64.double().cpu()
    assert torch.isfinite(ours64).all(), "output has non-finite values (unwritten, poisoned elements?)"
    atol = torch.finfo(ours.dtype).eps * ref.abs().max().item()
    err, limit = (ours64 - ref).abs(), 2 * (lowp64 - ref).abs() + atol
    worst = (err - limit).argmax()
    assert (err <= limit).all(), (
        f"{(err > limit).sum().item()} of {err.numel()} elements off; worst at flat index {worst.item()}: "
        f"ours {ours64.flatten()[worst].item()}, ref {ref.flatten()[worst].item()}, "
        f"torch {lowp64.flatten()[worst].item()}"
    )


def poison_next_allocation(shape, dtype, device) -> None:
    """Fill a block of shape's size with NaN and free it: the caching allocator hands that block to the op's
    output next, so elements the kernel leaves unwritten show as NaN."""
    if torch.device(device).type == "cuda":
        torch.full(shape, math.nan, dtype=dtype, device=device)


def python_output(code: str) -> str:
    """stdout of `python -c code` in a fresh process (which must succeed)."""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return run.stdout


def op_poisoned(x, weight, bias=None, **kwargs):
    """torch.ops.tma.linear(x, weight, bias, **kwargs) with its output's block poisoned first."""
    poison_next_allocation((*x.shape[:-1], weight.shape[0]), x.dtype, x.device)
    return torch.ops.tma.linear(x, weight, bias, **kwargs)


def random_linear(leading, n, k, dtype, device, bias=True):
    """Fresh x [*leading, k], weight [n, k] and bias [n] (or None), scaled so outputs are O(1)."""
    x = torch.randn(*leading, k, dtype=dtype, device=device)
    weight = (torch.randn(n, k, dtype=torch.float64) / math.sqrt(k)).to(dtype=dtype, device=device)
    b = torch.randn(n, dtype=dtype, device=device) if bias else None
    return x, weight, b


def reference(x, weight, bias):
    """(PyTorch's own result in the inputs' dtype, the float64 result on the CPU)."""
    ref64 = F.linear(x.double().cpu(), weight.double().cpu(), None if bias is None else bias.double().cpu())
    return F.linear(x, weight, bias), ref64


# ---- numerics -------------------------------------------------------------------------------------------


def _test_matches_reference(device, dtype, leading, n, k, bias):
    x, weight, b = random_linear(leading, n, k, dtype, device, bias)
    if device == "cuda":  # these shapes are the kernel's: a silent fallback to F.linear would make this vacuous
        assert ops.unsupported_reason(x.reshape(-1, k), weight, b) is None
    poison_next_allocation((*leading, n), dtype, device)
    out = torch.ops.tma.linear(x, weight, b)
    assert out.device == x.device and out.shape == (*leading, n)
    assert_matches_reference(out, *reference(x, weight, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("leading,n,k", SHAPES[1:4])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_reference_cpu(dtype, leading, n, k, bias):
    _test_matches_reference("cpu", dtype, leading, n, k, bias)


@pytest.mark.requires_sm90
@pytest.mark.timeout(CUDA_TIMEOUT_S)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("leading,n,k", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
def test_matches_reference_cuda(dtype, leading, n, k, bias):
    _test_matches_reference("cuda", dtype, leading, n, k, bias)


def _test_non_contiguous_x(device, dtype):
    n, k = 384, 264
    x_padded = torch.randn(2, 3, k + 8, dtype=dtype, device=device)[..., :k]  # rows 272 elements apart: a view
    x_transposed = torch.randn(3, 2, k, dtype=dtype, device=device).transpose(0, 1)  # flattening copies
    _, weight, b = random_linear((), n, k, dtype, device)
    for x in (x_padded, x_transposed):
        assert not x.is_contiguous()
        if device == "cuda":  # the kernel's case: a silent fallback would make this vacuous
            assert ops.unsupported_reason(x.reshape(-1, k), weight, b) is None
        poison_next_allocation((*x.shape[:-1], n), dtype, device)
        out = torch.ops.tma.linear(x, weight, b)
        assert out.shape == (2, 3, n)
        assert_matches_reference(out, *reference(x, weight, b))


def test_non_contiguous_x_cpu():
    _test_non_contiguous_x("cpu", torch.bfloat16)


@pytest.mark.requires_sm90
@pytest.mark.timeout(CUDA_TIMEOUT_S)
def test_non_contiguous_x_cuda():
    _test_non_contiguous_x("cuda", torch.bfloat16)


@pytest.mark.requires_sm90
@pytest.mark.timeout(CUDA_TIMEOUT_S)
def test_calls_compile_once_per_static_configuration():
    """M=5..8 share one build (M pads to 8): after the first call, more calls at those M compile nothing."""
    compile_kernel = ops._kernels().compile_kernel
    _, weight, b = random_linear((), 320, 704, torch.bfloat16, "cuda")
    torch.ops.tma.linear(torch.randn(5, 704, dtype=torch.bfloat16, device="cuda"), weight, b)
    misses = compile_kernel.cache_info().misses
    for m in (5, 6, 7, 8, 5):
        x = torch.randn(m, 704, dtype=torch.bfloat16, device="cuda")
        assert_matches_reference(op_poisoned(x, weight, b), *reference(x, weight, b))
    assert compile_kernel.cache_info().misses == misses


def test_one_dimensional_x_cpu():
    x, weight, b = random_linear((), 24, 40, torch.float32, "cpu")
    out = torch.ops.tma.linear(x, weight, b)
    assert out.shape == (24,)
    assert_matches_reference(out, *reference(x, weight, b))


def test_bad_arguments_name_the_argument():
    x, weight, b = random_linear((3,), 16, 32, torch.float32, "cpu")
    with pytest.raises(ValueError, match="K=32"):
        torch.ops.tma.linear(x[:, :16], weight, b)
    with pytest.raises(ValueError, match="weight must be 2-D"):
        torch.ops.tma.linear(x, weight.flatten(), b)
    with pytest.raises(ValueError, match="bias must be"):
        torch.ops.tma.linear(x, weight, b[:8])
    with pytest.raises(ValueError, match="l2_promotion=7"):
        torch.ops.tma.linear(x, weight, b, l2_promotion=7)


# ---- the descriptor: looked up, never re-encoded -------------------------------------------------------


def _weight_map_args(weight, promotion):
    """(box, swizzle, promotion) the kernel asks for, from the kernel module's own functions."""
    from torch_tma.kernels import linear as kernel

    if promotion is None:
        promotion = kernel.default_l2_promotion(weight.get_device(), *weight.shape, weight.dtype)
    return kernel.weight_box(*weight.shape, weight.dtype), kernel.weight_swizzle(weight.dtype), promotion


@pytest.mark.requires_sm90
@pytest.mark.timeout(CUDA_TIMEOUT_S)
def test_steady_state_encodes_and_copies_nothing():
    cache = torch_tma.default_cache(torch.device("cuda"))
    x, weight, b = random_linear((1,), 2048, 1024, torch.bfloat16, "cuda")
    torch.ops.tma.linear(x, weight, b)  # first call: encodes the weight's descriptor
    before = cache.stats()
    inputs = [torch.randn_like(x) for _ in range(10)]
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        outs = [op_poisoned(xi, weight, b) for xi in inputs]
        torch.cuda.synchronize()
    after = cache.stats()
    assert (after["encodes"], after["misses"]) == (before["encodes"], before["misses"])
    assert after["hits"] == before["hits"] + len(inputs)
    copies = [e.name for e in prof.events() if "memcpy" in e.name.lower()]
    assert not copies, f"steady-state calls copied: {copies}"
    for xi, out in zip(inputs, outs):
        assert_matches_reference(out, *reference(xi, weight, b))


@pytest.mark.requires_sm90
@pytest.mark.timeout(CUDA_TIMEOUT_S)
@pytest.mark.parametrize("promotion", list(torch_tma.L2Promotion) + [None])
def test_l2_promotion_reaches_the_descriptor(promotion):
    cache = torch_tma.default_cache(torch.device("cuda"))
    x, weight, b = random_linear((4,), 512, 512, torch.bfloat16, "cuda")
    out = op_poisoned(x, weight, b, l2_promotion=None if promotion is None else int(promotion))
    assert_matches_reference(out, *reference(x, weight, b))
    box, swizzle, expected = _weight_map_args(weight, promotion)
    misses = cache.stats()["misses"]
    weight_map = cache.get(weight, box, swizzle=swizzle, l2_promotion=expected)  # the op's key: must hit
    assert cache.stats()["misses"] == misses
    decoded = torch_tma.decode(weight_map.raw)
    assert (decoded.l2_promotion, decoded.address) == (expected, weight.data_ptr())


@pytest.mark.requires_sm90
@pytest.mark.timeout(CUDA_TIMEOUT_S)
def test_default_promotion_follows_the_gpu_model_and_weight_size():
    """l2_promotion=None: 256B for a weight of 100 MB on an H100 80GB HBM3, 128B for a small one and on other GPUs
    (kernels.linear.MEASURED_L2_PROMOTION), read back from the descriptor the op's first call (Python) and second
    (native) looked up."""
    cache = torch_tma.default_cache(torch.device("cuda"))
    h100 = torch.cuda.get_device_name() == "NVIDIA H100 80GB HBM3"
    for n, k, big in ((512, 512, False), (8192, 6144, True)):  # 0.5 MB; 100.7 MB
        x, weight, b = random_linear((4,), n, k, torch.bfloat16, "cuda")
        assert_matches_reference(op_poisoned(x, weight, b), *reference(x, weight, b))  # plans in Python
        misses = cache.stats()["misses"]
        x = torch.randn_like(x)
        assert_matches_reference(op_poisoned(x, weight, b), *reference(x, weight, b))  # the native path
        expected = torch_tma.L2Promotion.L2_256B if h100 and big else torch_tma.L2Promotion.L2_128B
        box, swizzle, _ = _weight_map_args(weight, expected)
        decoded = torch_tma.decode(cache.get(weight, box, swizzle=swizzle, l2_promotion=expected).raw)
        assert cache.stats()["misses"] == misses, f"{n}x{k}: the op's descriptor is not {expected.name}"
        assert (decoded.l2_promotion, decoded.address) == (expected, weight.data_ptr())


# ---- fallbacks ------------------------------------------------------------------------------------------


@pytest.mark.requires_sm90
@pytest.mark.timeout(CUDA_TIMEOUT_S)
def test_fallback_logs_one_reason_per_cause(monkeypatch, caplog):
    monkeypatch.setattr(ops, "_logged_reasons", set())
    x_big, weight, b = random_linear((512,), 256, 512, torch.bfloat16, "cuda")  # M above any crossover
    strided = weight.t().contiguous().t()  # same values, not contiguous
    x_odd, weight_odd, b_odd = random_linear((2,), 64, 36, torch.bfloat16, "cuda")  # 72-byte rows
    x32, weight32, b32 = random_linear((2,), 64, 64, torch.float32, "cuda")
    # Four causes: M above the crossover (16 for this weight), four times with other numbers (above the largest
    # tile too, or not), a non-contiguous weight, 72-byte rows, float32.
    cases = [(x_big, weight, b), (x_big[:300], weight, b), (x_big[:20], weight, b), (x_big[:48], weight, b),
             (x_big[:4], strided, b), (x_odd, weight_odd, b_odd), (x32, weight32, b32)]
    with caplog.at_level(logging.INFO, logger="torch_tma"):
        for _ in range(2):
            for case in cases:
                assert torch.equal(torch.ops.tma.linear(*case), F.linear(*case))
    reasons = [r.getMessage() for r in caplog.records if r.getMessage().startswith("tma::linear falls back")]
    assert len(reasons) == 4, reasons
    assert any("M=512 is above the crossover M=16 for a 256x512 weight" in r for r in reasons), reasons


@pytest.mark.requires_sm90
@pytest.mark.timeout(CUDA_TIMEOUT_S)
def test_gpu_other_than_hopper_falls_back_without_the_dsl():
    """On a GPU other than sm_90 (the capability patched in a fresh process) the op runs F.linear, logs the GPU once
    and never imports the kernel module (the DSL may not be installed there)."""
    code = (
        "import logging, sys, torch, torch.nn.functional as F, torch_tma; from torch_tma import ops; "
        "log = logging.getLogger('torch_tma'); log.setLevel(logging.INFO); "
        "log.addHandler(logging.StreamHandler(sys.stdout)); "
        "ops._capability = lambda index: (8, 0); "
        "x = torch.randn(4, 512, dtype=torch.bfloat16, device='cuda'); "
        "w = torch.randn(256, 512, dtype=torch.bfloat16, device='cuda'); "
        "assert all(torch.equal(torch.ops.tma.linear(x, w), F.linear(x, w)) for _ in range(2)); "
        "print('kernel module imported:', 'torch_tma.kernels.linear' in sys.modules)"
    )
    assert python_output(code).splitlines() == [
        "tma::linear falls back to F.linear: GPU is sm_80, not Hopper (sm_90)", "kernel module imported: False"]


def test_fallback_causes_ignore_the_numbers(monkeypatch, caplog):
    monkeypatch.setattr(ops, "_logged_reasons", set())
    reasons = ["M=128 is above the crossover M=64 for a 4096x4096 weight",
               "M=2048 is above the crossover M=64 for a 14336x4096 weight", "weight is not contiguous"]
    with caplog.at_level(logging.INFO, logger="torch_tma"):
        for reason in reasons * 2:
            ops._log_fallback(reason)
    assert [r.getMessage() for r in caplog.records] == [
        f"tma::linear falls back to F.linear: {reason}" for reason in (reasons[0], reasons[2])
    ]


def test_fallback_causes_keep_the_digits_of_names(monkeypatch, caplog):
    monkeypatch.setattr(ops, "_logged_reasons", set())
    reasons = ["dtype torch.float32 is not bfloat16 or float16", "dtype torch.float64 is not bfloat16 or float16"]
    with caplog.at_level(logging.INFO, logger="torch_tma"):
        for reason in reasons * 2:
            ops._log_fallback(reason)
    assert [r.getMessage() for r in caplog.records] == [f"tma::linear falls back to F.linear: {r}" for r in reasons]


def test_cuda_path_takes_k_zero_with_leading_dims():
    """F.linear's answer for K=0 (zeros) from the op's CUDA kernel's Python path too (here on CPU tensors, which
    it hands to F.linear with the reason): its flattening of the leading dims must not fail on zero elements."""
    x, weight = torch.empty(2, 3, 0, dtype=torch.bfloat16), torch.empty(5, 0, dtype=torch.bfloat16)
    assert torch.equal(ops._linear_cuda(x, weight), F.linear(x, weight))


def test_a_cause_seen_while_info_is_off_is_logged_once_info_is_on(monkeypatch, caplog):
    monkeypatch.setattr(ops, "_logged_reasons", set())
    reason = "weight is not contiguous (strides (1, 512))"
    with caplog.at_level(logging.WARNING, logger="torch_tma"):  # a warm-up before logging is configured
        ops._log_fallback(reason)
    with caplog.at_level(logging.INFO, logger="torch_tma"):
        ops._log_fallback(reason)
        ops._log_fallback(reason)
    assert [r.getMessage() for r in caplog.records] == [f"tma::linear falls back to F.linear: {reason}"]


def test_cpu_path_never_imports_the_kernel_module():
    code = (
        "import sys, torch, torch_tma; torch.ops.tma.linear(torch.randn(2, 32), torch.randn(16, 32)); "
        "print('torch_tma.kernels.linear' in sys.modules)"
    )
    assert python_output(code).strip() == "False"


# ---- autograd, compile, opcheck -------------------------------------------------------------------------


def _test_gradients_match_f_linear(device, dtype, leading, bias):
    x, weight, b = random_linear(leading, 48, 64, dtype, device, bias)
    grad_out = torch.randn(*leading, 48, dtype=dtype, device=device)

    def grads(linear, x, weight, b):
        leaves = [t.detach().requires_grad_() for t in (x, weight, b) if t is not None]
        return torch.autograd.grad(linear(*leaves) if bias else linear(*leaves, None), leaves, grad_out.to(x))

    ours = grads(torch.ops.tma.linear, x, weight, b)
    stock = grads(F.linear, x, weight, b)
    ref = grads(F.linear, *(None if t is None else t.double().cpu() for t in (x, weight, b)))
    assert len(ours) == 2 + bias
    for g_ours, g_stock, g_ref in zip(ours, stock, ref):
        assert_matches_reference(g_ours, g_stock, g_ref)


@pytest.mark.parametrize("leading", [(5,), (2, 3)])
@pytest.mark.parametrize("bias", [True, False])
def test_gradients_match_f_linear_cpu(leading, bias):
    _test_gradients_match_f_linear("cpu", torch.float64, leading, bias)


@pytest.mark.requires_sm90
@pytest.mark.timeout(CUDA_TIMEOUT_S)
@pytest.mark.parametrize("bias", [True, False])
def test_gradients_match_f_linear_cuda(bias):
    _test_gradients_match_f_linear("cuda", torch.bfloat16, (2, 3), bias)


@pytest.mark.parametrize("leading,n,k", [((2, 3), 4, 0), ((2, 3), 0, 5), ((0,), 4, 5)], ids=["K=0", "N=0", "M=0"])
def test_gradients_with_an_empty_dim_match_f_linear_cpu(leading, n, k):
    x, weight, b = random_linear(leading, n, k, torch.float64, "cpu")
    grad_out = torch.randn(*leading, n, dtype=torch.float64)
    leaves = [t.requires_grad_() for t in (x, weight, b)]
    ours = torch.autograd.grad(torch.ops.tma.linear(*leaves), leaves, grad_out)
    stock = torch.autograd.grad(F.linear(*leaves), leaves, grad_out)
    for g_ours, g_stock in zip(ours, stock):
        assert g_ours.shape == g_stock.shape and torch.equal(g_ours, g_stock)


def _test_autocast(device, caplog, monkeypatch):
    """Under torch.autocast the op follows F.linear's rule (inputs cast to the autocast dtype), eager and compiled
    alike; a float32 weight runs F.linear on the cast inputs, logged once on CUDA."""
    monkeypatch.setattr(ops, "_logged_reasons", set())
    x, weight, b = random_linear((4,), 256, 512, torch.float32, device)
    weight_lowp = weight.to(torch.bfloat16)
    # relu: a graph of the op alone runs it eagerly, where the autocast state of the call applies anyway
    compiled = torch.compile(lambda *a: torch.relu(torch.ops.tma.linear(*a)), fullgraph=True)
    ref64 = F.linear(*(t.to(torch.bfloat16).double().cpu() for t in (x, weight_lowp, b)))
    with torch.autocast(device, dtype=torch.bfloat16), caplog.at_level(logging.INFO, logger="torch_tma"):
        if device == "cuda":  # the kernel's case once cast: a silent fallback would make this vacuous
            assert ops.unsupported_reason(x.to(torch.bfloat16), weight_lowp, b.to(torch.bfloat16)) is None
        stock = F.linear(x, weight_lowp, b)
        poison_next_allocation(stock.shape, torch.bfloat16, device)  # the op's output (x's cast is another size)
        assert_matches_reference(torch.ops.tma.linear(x, weight_lowp, b), stock, ref64)
        assert_matches_reference(compiled(x, weight_lowp, b), torch.relu(stock), torch.relu(ref64))
        assert not caplog.records
        for _ in range(2):
            assert torch.equal(torch.ops.tma.linear(x, weight, b), F.linear(x, weight, b))
    reasons = [r.getMessage() for r in caplog.records]
    assert reasons == (["tma::linear falls back to F.linear: weight is torch.float32, not the autocast dtype "
                        "torch.bfloat16: its cast would be a new tensor and a new descriptor on every call (keep the "
                        "weight in torch.bfloat16)"] if device == "cuda" else []), reasons
    assert torch.ops.tma.linear(x, weight, b).dtype == torch.float32  # outside autocast: no cast


def test_autocast_follows_f_linear_cpu(caplog, monkeypatch):
    _test_autocast("cpu", caplog, monkeypatch)


@pytest.mark.requires_sm90
@pytest.mark.timeout(2 * CUDA_TIMEOUT_S)
def test_autocast_follows_f_linear_cuda(caplog, monkeypatch):
    _test_autocast("cuda", caplog, monkeypatch)


def test_gradcheck_cpu():
    x, weight, b = random_linear((3, 2), 5, 8, torch.float64, "cpu")
    inputs = [t.requires_grad_() for t in (x, weight, b)]
    assert torch.autograd.gradcheck(lambda *a: torch.ops.tma.linear(*a), inputs, check_forward_ad=True)
    assert torch.autograd.gradgradcheck(lambda *a: torch.ops.tma.linear(*a), inputs)


def _test_forward_ad(device, dtype):
    """Dual tensors (forward-mode AD) need not require grad: their tangent must not be dropped on the way to the
    kernel. The primal comes from the op, the tangent from the linear formula."""
    import torch.autograd.forward_ad as fwAD

    x, weight, b = random_linear((2, 3), 48, 64, dtype, device)
    tangents = [torch.randn_like(t) for t in (x, weight, b)]
    for which in ([0], [1], [2], [0, 1, 2]):
        with torch.no_grad(), fwAD.dual_level():
            duals = [fwAD.make_dual(t, tangents[i]) if i in which else t for i, t in enumerate((x, weight, b))]
            poison_next_allocation((2, 3, 48), dtype, device)
            ours = fwAD.unpack_dual(torch.ops.tma.linear(*duals))
            stock = fwAD.unpack_dual(F.linear(*duals))
        assert ours.tangent is not None, which
        assert_matches_reference(ours.primal, stock.primal, reference(x, weight, b)[1])
        torch.testing.assert_close(ours.tangent, stock.tangent, msg=f"tangents of inputs {which}")


def test_forward_ad_cpu():
    _test_forward_ad("cpu", torch.float64)


@pytest.mark.requires_sm90
@pytest.mark.timeout(CUDA_TIMEOUT_S)
def test_forward_ad_cuda():
    _test_forward_ad("cuda", torch.bfloat16)


def test_torch_func_transforms_match_f_linear(monkeypatch, caplog):
    """grad, jvp, jacrev, jacfwd, hessian and vmap of grad: the op answers as F.linear (which computes it there:
    torch 2.13 cannot apply the op's autograd.Function inside a transform), logging why."""
    monkeypatch.setattr(ops, "_logged_reasons", set())
    x, weight, b = random_linear((2, 3), 4, 5, torch.float64, "cpu")
    t = torch.randn_like(x)
    loss = lambda lin: (lambda x, w, b: lin(x, w, b).pow(2).sum())  # noqa: E731
    cases = {
        "grad": lambda lin: torch.func.grad(loss(lin), argnums=(0, 1, 2))(x, weight, b),
        "jvp": lambda lin: torch.func.jvp(lambda x: lin(x, weight, b), (x,), (t,)),
        "jacrev": lambda lin: (torch.func.jacrev(lambda w: lin(x, w, b))(weight),),
        "jacfwd": lambda lin: (torch.func.jacfwd(lambda w: lin(x, w, b))(weight),),
        "hessian": lambda lin: (torch.func.hessian(lambda b: lin(x, weight, b).pow(2).sum())(b),),
        "vmap-grad": lambda lin: (torch.func.vmap(torch.func.grad(lambda x: lin(x, weight, b).pow(2).sum()))(x),),
    }
    with caplog.at_level(logging.INFO, logger="torch_tma"):
        for name, case in cases.items():
            ours, stock = case(torch.ops.tma.linear), case(F.linear)
            assert len(ours) == len(stock) and all(torch.allclose(o, s) for o, s in zip(ours, stock)), name
    assert [r.getMessage() for r in caplog.records] == [
        "tma::linear falls back to F.linear: inside a torch.func transform (grad, jvp, jacrev, hessian)"]


@pytest.mark.parametrize("leading", [(2, 3), ()], ids=["3-D x", "1-D x"])
def test_output_modified_in_place_under_autograd(leading):
    """y += r or an in-place activation on the op's output (a view of the kernel's buffer where x is not 2-D)."""
    x, weight, b = random_linear(leading, 4, 5, torch.float64, "cpu")
    grads = []
    for linear in (torch.ops.tma.linear, F.linear):
        leaves = [t.detach().requires_grad_() for t in (x, weight, b)]
        y = linear(*leaves)
        y += 1
        y.relu_()
        grads.append(torch.autograd.grad(y.pow(2).sum(), leaves))
    assert all(torch.equal(o, s) for o, s in zip(*grads))


def _test_compile_fullgraph(device, dtype, dynamic):
    def f(x, weight, bias):
        return torch.relu(torch.ops.tma.linear(x, weight, bias, l2_promotion=int(torch_tma.L2Promotion.L2_256B)))

    compiled = torch.compile(f, fullgraph=True, dynamic=dynamic)
    for m in (4, 8, 16):  # several M: one graph when dynamic, recompiles otherwise
        x, weight, b = random_linear((m,), 256, 512, dtype, device)
        lowp, ref64 = reference(x, weight, b)
        assert_matches_reference(compiled(x, weight, b), torch.relu(lowp), torch.relu(ref64))


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph_cpu(dynamic):
    _test_compile_fullgraph("cpu", torch.float32, dynamic)


@pytest.mark.requires_sm90
@pytest.mark.timeout(2 * CUDA_TIMEOUT_S)
@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph_cuda(dynamic):
    _test_compile_fullgraph("cuda", torch.bfloat16, dynamic)


def _test_opcheck(device, dtype):
    for bias in (True, False):
        for requires_grad in (False, True):
            x, weight, b = random_linear((2, 3), 64, 128, dtype, device, bias)
            args = [t.requires_grad_(requires_grad) if t is not None else None for t in (x, weight, b)]
            torch.library.opcheck(torch.ops.tma.linear.default, tuple(args), {"l2_promotion": 2})


def test_opcheck_cpu():
    _test_opcheck("cpu", torch.float32)


@pytest.mark.requires_sm90
@pytest.mark.timeout(2 * CUDA_TIMEOUT_S)
def test_opcheck_cuda():
    _test_opcheck("cuda", torch.bfloat16)


# ---- CUDA graphs ----------------------------------------------------------------------------------------


@pytest.mark.requires_sm90
@pytest.mark.timeout(CUDA_TIMEOUT_S)
def test_cuda_graph_replays_with_new_inputs():
    x, weight, b = random_linear((4,), 1024, 2048, torch.bfloat16, "cuda")
    torch.ops.tma.linear(x, weight, b)  # warm-up: compile, encode, allocate the workspace
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.tma.linear(x, weight, b)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        out.fill_(math.nan)
        graph.replay()
        assert_matches_reference(out, *reference(x, weight, b))


@pytest.mark.requires_sm90
@pytest.mark.timeout(CUDA_TIMEOUT_S)
def test_cuda_graph_capture_of_an_unseen_weight_raises():
    x, weight, b = random_linear((4,), 1024, 2048, torch.bfloat16, "cuda")
    torch.ops.tma.linear(x, weight, b)
    unseen = torch.randn_like(weight)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(torch_tma.CaptureMissError):
        with torch.cuda.graph(graph):
            torch.ops.tma.linear(x, unseen, b)


# ---- the native kernels (csrc/linear_op.cpp) ------------------------------------------------------------


def test_cuda_and_autograd_kernels_are_native():
    dump = torch._C._dispatch_dump("tma::linear")
    for key in ("CUDA", "Autograd[alias]", "CPU"):
        line = next((row for row in dump.splitlines() if row.startswith(f"{key}:")), None)
        assert line is not None, dump
        assert ("linear_op.cpp" in line) == (key != "CPU"), line


def test_autograd_kernel_records_a_graph_only_when_asked_cpu():
    x, weight, b = random_linear((3,), 16, 32, torch.float32, "cpu")
    weight.requires_grad_()
    assert torch.ops.tma.linear(x, weight, b).grad_fn is not None
    with torch.no_grad():
        out = torch.ops.tma.linear(x, weight, b)  # below autograd through the dispatcher, no Python
    assert out.grad_fn is None and not out.requires_grad
    assert_matches_reference(out, *reference(x, weight.detach(), b))


def test_native_descriptor_lookup_takes_the_tables_hit_path():
    # The CUDA kernel looks the weight's descriptor up through the cache's native get, which matches keyword names
    # by identity: a hit must not reach the Python get (the miss handler), a miss must.
    table = torch_tma._C.Table("cpu", 0)
    misses = []
    get = torch_tma._C.make_fast_get(table, lambda *args, **kwargs: misses.append(args) or "missed")
    weight = torch.randn(128, 64)
    swizzle, l2 = int(torch_tma.Swizzle.B128), int(torch_tma.L2Promotion.L2_256B)
    table.insert(weight, (64, 128), None, 0, swizzle, l2, 0, -1, "the bound entry")
    assert torch_tma._C.linear_lookup_for_test(get, weight, (64, 128), swizzle, l2) == "the bound entry"
    assert misses == [] and table.hits == 1
    assert torch_tma._C.linear_lookup_for_test(get, weight.clone(), (64, 128), swizzle, l2) == "missed"
    assert len(misses) == 1


def test_ffi_call_passes_tensors_none_ints_and_the_stream():
    # The native CUDA kernel's call of the compiled kernel, made here on CPU tensors with a Python TVM-FFI
    # function in its place: checks the hand-declared TVM-FFI ABI (argument kinds, DLTensor views, stream).
    tvm_ffi = pytest.importorskip("tvm_ffi")
    seen = {}

    def fn(a, none, b, i, j, *trailing):
        seen.update(a=(tuple(a.shape), tuple(a.strides), str(a.dtype), a.data_ptr()), none=none,
                    b=(tuple(b.shape), tuple(b.strides), str(b.dtype), b.data_ptr()), ints=(i, j), trailing=trailing,
                    stream=tvm_ffi.get_raw_stream(tvm_ffi.device("cuda", 0)))

    a = torch.randn(6, 8, dtype=torch.bfloat16)[:, 2:6]  # strided view
    b = torch.zeros(3, dtype=torch.int32)
    before = tvm_ffi.get_raw_stream(tvm_ffi.device("cuda", 0))
    torch_tma._C.ffi_call_for_test(tvm_ffi.convert(fn), [a, None, b], [-5, 1 << 40], 2, 0x1234560,
                                   ops._ffi_library())
    assert seen == dict(a=((6, 4), (8, 1), "bfloat16", a.data_ptr()), none=None,
                        b=((3,), (1,), "int32", b.data_ptr()), ints=(-5, 1 << 40), trailing=(None, None),
                        stream=0x1234560)
    assert tvm_ffi.get_raw_stream(tvm_ffi.device("cuda", 0)) == before  # restored after the call


def test_ffi_target_fills_the_compiled_kernels_defaults():
    tvm_ffi = pytest.importorskip("tvm_ffi")
    from tvm_ffi.utils import kwargs_wrapper

    class Compiled:  # what cute.compile returns for a signature with defaults (kernels.linear's trace=None)
        def __init__(self, target, names, defaults):
            self._target = target
            self._kwargs_wrapper = kwargs_wrapper.make_kwargs_wrapper(target, names, defaults)

        def __tvm_ffi_object__(self):
            return self._target

    target = tvm_ffi.convert(lambda *args: None)
    assert ops._ffi_target(Compiled(target, ["a", "b", "trace"], (None,)), 2) == (target, 1)
    assert ops._ffi_target(target, 2) == (target, 0)  # a plain positional function
    with pytest.raises(RuntimeError, match="not all None"):
        ops._ffi_target(Compiled(target, ["a", "b", "flag"], (True,)), 2)


def test_ffi_call_raises_the_functions_error():
    tvm_ffi = pytest.importorskip("tvm_ffi")

    def fn(a):
        raise ValueError("the kernel refused")

    with pytest.raises(RuntimeError, match="the kernel refused"):
        torch_tma._C.ffi_call_for_test(tvm_ffi.convert(fn), [torch.zeros(2)], [], 0, 0, ops._ffi_library())


def _native_calls() -> tuple[int, int]:
    """(calls the native CUDA kernel made itself, calls it handed to the Python kernel) so far."""
    stats = ops.native_stats()
    return stats["fast_calls"], stats["slow_calls"]


@pytest.mark.requires_sm90
@pytest.mark.timeout(CUDA_TIMEOUT_S)
@pytest.mark.parametrize("leading,bias", [((1,), False), ((5,), True), ((2, 8), True)])
def test_steady_state_calls_run_native(leading, bias):
    x, weight, b = random_linear(leading, 1000, 1032, torch.bfloat16, "cuda", bias)
    torch.ops.tma.linear(x, weight, b)  # the first call of a shape goes through Python and is remembered
    for _ in range(3):
        x = torch.randn_like(x)
        fast, slow = _native_calls()
        poison_next_allocation((*leading, 1000), x.dtype, "cuda")
        out = torch.ops.tma.linear(x, weight, b)
        assert _native_calls() == (fast + 1, slow)
        assert_matches_reference(out, *reference(x, weight, b))


def test_reset_launches_forgets_launches_and_keeps_workspaces():
    """The Python side; the native plans it drops are checked on the GPU, where there are some
    (test_reset_launches_plans_again_from_the_options)."""
    ops._remembered.add((0, 1234))  # a stream workspace handed over: kept
    ops._remembered.add((0, torch.bfloat16, 1, 8, 8, False, None))  # a launch: forgotten
    try:
        ops.reset_launches()
        assert (0, 1234) in ops._remembered
        assert (0, torch.bfloat16, 1, 8, 8, False, None) not in ops._remembered
    finally:
        ops._remembered.discard((0, 1234))


@pytest.mark.requires_sm90
@pytest.mark.timeout(CUDA_TIMEOUT_S)
def test_reset_launches_plans_again_from_the_options(monkeypatch):
    """After reset_launches, a shape's next call goes through Python and compiles from the current DEFAULT_OPTIONS
    (a benchmark comparing options in one process relies on it), and the results stay right."""
    from torch_tma.kernels import linear

    x, weight, b = random_linear((4,), 640, 1024, torch.bfloat16, "cuda", True)
    torch.ops.tma.linear(x, weight, b)
    torch.ops.tma.linear(x, weight, b)  # native
    monkeypatch.setattr(linear, "DEFAULT_OPTIONS", linear.DEFAULT_OPTIONS._replace(load_trigger=True))
    try:
        ops.reset_launches()
        assert ops.native_stats()["plans"] == 0
        assert linear._launch_config.cache_info().currsize == 0
        fast, slow = _native_calls()
        poison_next_allocation((4, 640), x.dtype, "cuda")
        out = torch.ops.tma.linear(x, weight, b)
        assert _native_calls() == (fast, slow + 1)
        launch = linear._launch_config(0, torch.bfloat16, 4, 640, 1024, True)  # what the call planned: cached
        assert linear._launch_config.cache_info().currsize == 1
        options = linear.options_for(linear.DEFAULT_OPTIONS, 640, 1024, 4, *linear._device_limits(0))
        assert options.load_trigger
        assert launch[0] is linear.compile_kernel(linear._DTYPES[torch.bfloat16], 8, True, options=options)
        assert ops.native_stats()["plans"] == 1
        assert_matches_reference(out, *reference(x, weight, b))
    finally:
        monkeypatch.undo()
        ops.reset_launches()


@pytest.mark.requires_sm90
@pytest.mark.timeout(CUDA_TIMEOUT_S)
def test_native_path_follows_new_weights_streams_and_alignment():
    x, weight, b = random_linear((4,), 512, 1024, torch.bfloat16, "cuda")
    torch.ops.tma.linear(x, weight, b)
    # a weight in new storage: the native lookup misses, the cache encodes it, the result uses it
    weight = weight.clone() * 2
    assert_matches_reference(op_poisoned(x, weight, b), *reference(x, weight, b))
    # another stream: its first call goes through Python (its own workspace), later ones are native
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fast, slow = _native_calls()
        first = op_poisoned(x, weight, b)
        assert _native_calls() == (fast, slow + 1)
        second = op_poisoned(x, weight, b)
        assert _native_calls() == (fast + 1, slow + 1)
    torch.cuda.current_stream().wait_stream(stream)
    for out in (first, second):
        assert_matches_reference(out, *reference(x, weight, b))
    # an invalid promotion never matches the remembered default (None): Python rejects it
    with pytest.raises(ValueError, match="l2_promotion=-1"):
        torch.ops.tma.linear(x, weight, b, l2_promotion=-1)
    # x one element off 16-byte alignment: the native checks hand it to Python, which falls back to F.linear
    offset = torch.randn(4 * 1024 + 1, dtype=torch.bfloat16, device="cuda")[1:].view(4, 1024)
    fast, slow = _native_calls()
    assert torch.equal(torch.ops.tma.linear(offset, weight, b), F.linear(offset, weight, b))
    assert _native_calls() == (fast, slow + 1)


def test_flop_counter_counts_the_op_as_f_linear():
    from torch.utils.flop_counter import FlopCounterMode

    x, weight, b = random_linear((3, 4), 5, 8, torch.float32, "cpu")
    leaves = [t.requires_grad_() for t in (x, weight, b)]
    counts = []
    for linear in (torch.ops.tma.linear, F.linear):
        with FlopCounterMode(display=False) as forward:
            y = linear(*leaves)
        with FlopCounterMode(display=False) as backward:
            y.sum().backward()
        counts.append((forward.get_total_flops(), backward.get_total_flops()))
    assert counts[0] == counts[1] and counts[0][0] == 2 * 12 * 8 * 5
