"""torch.ops.tma.linear: y = x @ weight^T + bias with the weight streamed through a cached TMA descriptor.

    torch.ops.tma.linear(x, weight, bias=None, *, l2_promotion=None) -> Tensor

x is [..., K] with any leading dims, weight [N, K], bias [N] or None; bf16 or fp16 in, fp32 accumulate,
output [..., N] in x's dtype. l2_promotion is a torch_tma.L2Promotion value for the weight descriptor;
None takes the kernel's measured default for the GPU model and weight size (kernels.linear.default_l2_promotion:
128B, 256B on an H100 80GB HBM3 for weights of 100 MB and more; set from the promotion sweeps).

Registered once through torch.library: a CUDA kernel (the CuTe DSL weight-streaming kernel on Hopper,
F.linear elsewhere), a CPU kernel (F.linear), a fake kernel for torch.compile, autograd, and autocast on CPU and
CUDA (F.linear's rule: inputs cast to the autocast dtype). x, weight and bias must share a dtype and a device.
Inputs that do not describe a linear layer raise LinearArgumentError, a ValueError and a RuntimeError (what
F.linear raises for them).
The CUDA and Autograd kernels are C++ (csrc/linear_op.cpp): a steady-state call runs no Python; the first call of
a shape, fallbacks, errors and calls that record an autograd graph go to the Python functions here. Where the
kernel does not apply (M above the crossover, a GPU other than sm_90, a K byte stride that is not a
multiple of 16, a non-contiguous weight, an unsupported dtype) the CUDA kernel falls back to F.linear and
logs the reason once per distinct cause (the reason with its numbers taken out) on the "torch_tma" logger at
INFO level.

The weight descriptor comes from torch_tma.default_cache(device): after the first call for a weight a
call encodes nothing and copies nothing, it only looks the descriptor's slot up. The DSL kernel module is
imported on the first CUDA call, so importing this module never needs the DSL.
"""

import functools
import importlib
import inspect
import logging
import math
import re
import sys
import threading
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula

from . import _C
from .cache import TensorMapCache, default_cache
from .spec import L2Promotion, Swizzle

__all__ = ["LinearArgumentError", "bind_weight_map", "unsupported_reason", "weight_unsupported_reason"]

_log = logging.getLogger("torch_tma")

# FRAGMENT, not DEF: other torch_tma modules may add ops to the same namespace.
_lib = torch.library.Library("tma", "FRAGMENT")
_lib.define("linear(Tensor x, Tensor weight, Tensor? bias=None, *, int? l2_promotion=None) -> Tensor")

_L2_PROMOTION_VALUES = frozenset(int(p) for p in L2Promotion)


def _out_shape(x: torch.Tensor, weight: torch.Tensor) -> tuple[int, ...]:
    """Output shape [..., N] of the op; the one shape helper of the real and fake kernels."""
    return (*x.shape[:-1], weight.shape[0])


class LinearArgumentError(ValueError, RuntimeError):
    """tma::linear's inputs do not describe a linear layer; the message names the argument.

    A ValueError, and a RuntimeError as F.linear raises for the same mistakes (shapes that cannot be multiplied,
    mixed dtypes or devices), so code written for nn.Linear catches it where it caught those.
    """


def _check_args(x, weight, bias, l2_promotion) -> None:
    """Raise LinearArgumentError naming the argument when the inputs do not describe a linear layer."""
    w_shape = weight.shape
    if len(w_shape) != 2:
        raise LinearArgumentError(f"tma::linear: weight must be 2-D [N, K], got shape {tuple(w_shape)}")
    x_shape = x.shape
    if not x_shape or x_shape[-1] != w_shape[1]:
        raise LinearArgumentError(f"tma::linear: x's last dim must equal weight's K={w_shape[1]}, "
                                  f"got x shape {tuple(x_shape)}")
    if bias is not None and bias.shape != w_shape[:1]:
        raise LinearArgumentError(f"tma::linear: bias must be [N={w_shape[0]}], got shape {tuple(bias.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):  # under torch.autocast the Autocast kernel casts first
        if t is not None and (t.dtype != x.dtype or t.device != x.device):
            raise LinearArgumentError(f"tma::linear: {name} is {t.dtype} on {t.device}, "
                                      f"x is {x.dtype} on {x.device}: they must match")
    if l2_promotion is not None and l2_promotion not in _L2_PROMOTION_VALUES:
        raise LinearArgumentError(
            f"tma::linear: l2_promotion={l2_promotion!r} is not a torch_tma.L2Promotion value "
            f"{sorted(_L2_PROMOTION_VALUES)} (None takes the kernel's default)"
        )


@functools.cache
def _kernels():
    """torch_tma.kernels.linear, imported on first use: it needs the CuTe DSL."""
    return importlib.import_module("torch_tma.kernels.linear")


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def unsupported_reason(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """Why the TMA kernel cannot compute F.linear(x2d, weight, bias) on this CUDA device, or None.

    x2d is [M, K] (the op's leading dims flattened); the conditions (M crossover, dtype, contiguity,
    16-byte strides, ...) are the kernel's own. The architecture is checked here first so that a GPU
    other than sm_90 never imports the DSL, which may not even be installed there.
    """
    if not weight.is_cuda:
        return "tensors are not all on a CUDA device"
    major, minor = _capability(weight.get_device())
    if (major, minor) != (9, 0):
        return f"GPU is sm_{major}{minor}, not Hopper (sm_90)"
    return _kernels().unsupported_reason(x2d, weight, bias)


def weight_unsupported_reason(weight: torch.Tensor, bias: torch.Tensor | None = None) -> str | None:
    """Why the kernel cannot serve this CUDA weight even for a one-row x (a decode step), or None.

    A row of the weight itself stands in for x: same dtype and device, K elements, 16-byte aligned.
    """
    return unsupported_reason(weight[:1], weight, bias)


_logged_reasons: set[str] = set()


def _log_fallback(reason: str) -> None:
    # A cause is the reason without its numbers: prefills of every prompt length share one line. Digits inside a
    # name stay (torch.float32 and torch.float64 are two causes; 4096x4096 is #x#). It counts as logged only once
    # the logger emits it, so INFO turned on after a warm-up still shows every cause.
    cause = re.sub(r"(?<![A-Za-wyz_.])\d+", "#", reason)
    if cause not in _logged_reasons and _log.isEnabledFor(logging.INFO):
        _logged_reasons.add(cause)
        _log.info("tma::linear falls back to F.linear: %s", reason)


class _Plan(NamedTuple):
    """Everything a call needs beyond its tensors, fixed by (device, dtype, N, K, promotion)."""

    cache: TensorMapCache
    box: tuple[int, int]  # weight tile, elements, outermost first (rows of N, columns of K)
    swizzle: Swizzle
    l2_promotion: L2Promotion
    linear_out: Callable  # kernels.linear.linear_out, held here so a call looks nothing else up


@functools.cache
def _plan(device_index: int, dtype: torch.dtype, n: int, k: int, l2_promotion: int | None) -> _Plan:
    # Keyed on the device index, not a torch.device: tensor.get_device() builds no object per call.
    kernels = _kernels()
    if l2_promotion is None:
        l2_promotion = kernels.default_l2_promotion(device_index, n, k, dtype)
    return _Plan(
        default_cache(torch.device("cuda", device_index)),
        kernels.weight_box(n, k, dtype),
        kernels.weight_swizzle(dtype),
        L2Promotion(l2_promotion),
        kernels.linear_out,
    )


def bind_weight_map(source, weight: torch.Tensor, l2_promotion: int | None = None):
    """Bind source's descriptor (a zero-arg callable returning the current weight, now `weight`) in the device's
    default cache, with the box, swizzle and promotion the op looks up, so the op's lookups hit the pinned slot.

    Returns the cache's BoundTensorMap; only for a weight that weight_unsupported_reason() accepts.
    """
    n, k = weight.shape
    plan = _plan(weight.get_device(), weight.dtype, n, k, l2_promotion)
    return plan.cache.bind(source, plan.box, swizzle=plan.swizzle, l2_promotion=plan.l2_promotion)


def _linear_cuda(x, weight, bias=None, *, l2_promotion=None):
    _check_args(x, weight, bias, l2_promotion)
    # a reshape costs ~1 us even when it is a no-op; not reshape(-1, K): that fails where K is 0
    x2d = x if x.dim() == 2 else x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    reason = unsupported_reason(x2d, weight, bias)
    if reason is not None:
        _log_fallback(reason)
        return F.linear(x, weight, bias)
    n, k = weight.shape
    plan = _plan(weight.get_device(), weight.dtype, n, k, l2_promotion)
    out = x2d.new_empty((x2d.shape[0], n))
    # The cache's lock from the lookup to the launch: no other thread's eviction or bind can retire the slot between
    # the hit (which records this stream for the slot's retire events) and the kernel that reads it.
    with plan.cache._lock:
        weight_map = plan.cache.get(weight, plan.box, swizzle=plan.swizzle, l2_promotion=plan.l2_promotion)
        plan.linear_out(x2d, weight, bias, out, weight_map.ptr, l2_promotion=plan.l2_promotion)
    _remember_launch(x2d, weight, bias, l2_promotion, plan)
    return out if x2d is x else out.view(_out_shape(x, weight))


def _linear_cpu(x, weight, bias=None, *, l2_promotion=None):
    _check_args(x, weight, bias, l2_promotion)
    return F.linear(x, weight, bias)


def _linear_fake(x, weight, bias=None, *, l2_promotion=None):
    _check_args(x, weight, bias, l2_promotion)
    return x.new_empty(_out_shape(x, weight))


def _autocast_kernel(device_type: str, key: torch._C.DispatchKey) -> Callable:
    """The op under torch.autocast on device_type (dispatch key `key`): F.linear's autocast rule (floating inputs
    other than float64 cast to the autocast dtype), then the op with autocast excluded, so eager, compiled and fake
    calls agree on the output's dtype. A weight that needs that cast would be a new tensor, and a new descriptor, on
    every call: such calls run F.linear on the cast inputs instead (on CUDA with a logged reason)."""

    def kernel(x, weight, bias=None, *, l2_promotion=None):
        dtype = torch.get_autocast_dtype(device_type)

        def cast(t):
            eligible = t is not None and t.is_floating_point() and t.dtype != torch.float64
            return t.to(dtype) if eligible else t

        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
            x, weight_cast, bias = cast(x), cast(weight), cast(bias)
            if weight_cast is weight:
                return _linear_op(x, weight, bias, l2_promotion=l2_promotion)
            _check_args(x, weight_cast, bias, l2_promotion)
            if device_type == "cuda":
                _log_fallback(f"weight is {weight.dtype}, not the autocast dtype {dtype}: its cast would be a new "
                              f"tensor and a new descriptor on every call (keep the weight in {dtype})")
            return F.linear(x, weight_cast, bias)

    return kernel


_lib.impl("linear", _linear_cpu, "CPU")
torch.library.register_fake("tma::linear", _linear_fake, lib=_lib)

# Keys the Autograd kernel hands on to. Private torch API, the one torch.library.register_autograd uses.
_AFTER_AUTOGRAD = torch._C._after_autograd_keyset
_linear_op = torch.ops.tma.linear.default
for _device_type in ("cpu", "cuda"):
    _autocast_key = "Autocast" + torch._C._dispatch_key_for_device(_device_type)
    _autocast = _autocast_kernel(_device_type, getattr(torch._C.DispatchKey, _autocast_key))
    _lib.impl("linear", _autocast, _autocast_key)
    # ... and for the Python dispatcher torch.compile traces with, so the casts land in the compiled graph
    _linear_op.py_impl(getattr(torch._C.DispatchKey, _autocast_key))(_autocast)


class _Linear(torch.autograd.Function):
    """The op under autograd: forward is the op below the Autograd and ADInplaceOrView keys (so an output that is a
    view of the kernel's buffer is not a custom Function's view, which autograd would refuse to modify in place),
    backward and jvp the linear layer's formulas. setup_context keeps it usable under torch.func transforms."""

    @staticmethod
    def forward(keyset, x, weight, bias, l2_promotion):
        with torch._C._AutoDispatchBelowADInplaceOrView():
            return _linear_op.redispatch(keyset, x, weight, bias, l2_promotion=l2_promotion)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, x, weight, bias, _ = inputs
        ctx.save_for_backward(x, weight)
        ctx.save_for_forward(x, weight)
        ctx.has_bias = bias is not None

    @staticmethod
    def jvp(ctx, _, x_t, weight_t, bias_t, __):
        """y_t = x_t W^T + x W_t^T (+ b_t), for forward-mode AD (torch.func.jvp, jacfwd, forward_ad)."""
        x, weight = ctx.saved_tensors
        y_t = None
        if x_t is not None:
            y_t = F.linear(x_t, weight)
        if weight_t is not None:
            y_t = F.linear(x, weight_t) if y_t is None else y_t + F.linear(x, weight_t)
        if bias_t is not None:
            y_t = bias_t.expand(*x.shape[:-1], weight.shape[0]) if y_t is None else y_t + bias_t
        return y_t

    @staticmethod
    def backward(ctx, grad):
        """grad_x = grad @ W, grad_W = grad^T x and grad_b = sum of grad over the leading dims."""
        x, weight = ctx.saved_tensors
        n, k = weight.shape
        rows = math.prod(x.shape[:-1])  # not reshape(-1, ...): that fails where N or K is 0
        _, needs_x, needs_weight, needs_bias, _ = ctx.needs_input_grad
        grad_x = grad @ weight if needs_x else None
        grad_weight = grad.reshape(rows, n).t() @ x.reshape(rows, k) if needs_weight else None
        grad_bias = grad.reshape(rows, n).sum(0) if ctx.has_bias and needs_bias else None
        return None, grad_x, grad_weight, grad_bias, None


def _linear_autograd_graph(keyset_raw, x, weight, bias=None, l2_promotion=None):
    """The op for a call that records an autograd graph, called by the native Autograd kernel (csrc/linear_op.cpp)
    with the key set it was dispatched with (DispatchKeySet.raw_repr()). Calls that record nothing never come here:
    the native kernel sends them below the Autograd key through the dispatcher."""
    if torch._C._functorch.maybe_current_level() is not None:
        # torch.func.grad / jvp / jacrev / hessian: applying an autograd.Function from inside an op's Autograd kernel
        # is refused there (torch 2.13: no kernel for the custom_function_call HigherOrderOperator at Autograd).
        _log_fallback("inside a torch.func transform (grad, jvp, jacrev, hessian)")
        return F.linear(x, weight, bias)
    keyset = torch._C.DispatchKeySet.from_raw_repr(keyset_raw)
    return _Linear.apply(keyset & _AFTER_AUTOGRAD, x, weight, bias, l2_promotion)


# The CUDA and Autograd kernels are C++ (csrc/linear_op.cpp): a Python kernel costs the dispatcher's hand-over to
# Python and back on every call. The CUDA kernel makes steady-state launches itself and hands every other call to
# _linear_cuda above; the Autograd kernel hands calls that record a graph to _linear_autograd_graph.
_C.linear_register_kernels(_linear_cuda, _linear_autograd_graph)


@register_flop_formula(torch.ops.tma.linear)
def _linear_flops(x_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    """FlopCounterMode's count: a multiply and an add per x row, weight row and K, as for F.linear (aten.mm/addmm)."""
    return 2 * math.prod(x_shape[:-1]) * x_shape[-1] * weight_shape[0]


@functools.cache
def _ffi_library() -> str:
    """Path of libtvm_ffi.so, which the native kernel calls the compiled kernel through (loaded by the DSL)."""
    import tvm_ffi.libinfo

    return tvm_ffi.libinfo.find_libtvm_ffi()


def _ffi_target(compiled, nargs: int):
    """(the tvm_ffi.Function a call of the compiled kernel ends in, how many None arguments follow the nargs given).

    cute.compile returns a tvm_ffi.Function, or (for a signature with defaults, like the kernel's trace=None) a
    wrapper that fills the defaults in and calls a positional tvm_ffi.Function: the native kernel calls that one,
    with the defaults, which must be None.
    """
    wrapper = getattr(compiled, "_kwargs_wrapper", None)
    if wrapper is None:
        return compiled, 0
    rest = list(inspect.signature(wrapper).parameters.values())[nargs:]
    if any(p.default is not None for p in rest):
        raise RuntimeError(f"tma::linear: the compiled kernel's arguments after the first {nargs} are not all "
                           f"None by default: {rest}")
    return compiled.__tvm_ffi_object__(), len(rest)


_remembered: set[tuple] = set()  # launches and (device, stream) workspaces handed to the native kernel
_remember_lock = threading.Lock()  # _remembered and the native plans change together (reset_launches)


def _remember_launch(x2d, weight, bias, l2_promotion, plan: "_Plan") -> None:
    """Hand the native CUDA kernel what it needs to make this launch again without Python: the compiled kernel,
    its grid, the descriptor lookup's arguments and (once the stream has its own) the stream's workspace. Each
    once: a call the native kernel keeps handing back (e.g. on a stream that only ever captures) costs a set lookup."""
    kernels = _kernels()
    m = x2d.shape[0]
    n, k = weight.shape
    device = weight.get_device()
    launch = (device, weight.dtype, m, n, k, bias is not None, l2_promotion)
    if launch not in _remembered:
        with _remember_lock:  # a reset_launches meanwhile must not leave this launch's old plan behind
            compiled, num_ctas = kernels._launch_config(device, weight.dtype, m, n, k, bias is not None)
            function, trailing_nones = _ffi_target(compiled, 8)  # linear_out passes 8 arguments
            _C.linear_remember_launch(weight, m, bias is not None, l2_promotion, plan.cache.get, plan.box,
                                      int(plan.swizzle), int(plan.l2_promotion), function, trailing_nones, num_ctas,
                                      _ffi_library())
            _remembered.add(launch)
    stream = torch._C._cuda_getCurrentRawStream(device)
    ws = kernels._workspaces.get((device, stream))  # None while a stream first seen during capture uses the capture one
    if ws is not None and (device, stream) not in _remembered:
        with _remember_lock:
            _C.linear_remember_workspace(device, stream, ws.partials, ws.arrivals)
            _remembered.add((device, stream))


def reset_launches() -> None:
    """Forget every launch the op has planned (the compiled kernel and grid per shape, in Python and in the native
    CUDA kernel), so each shape's next call plans again from kernels.linear.DEFAULT_OPTIONS. For benchmarks that
    compare kernel options in one process; a CUDA graph captured before keeps the kernels it captured."""
    with _remember_lock:
        _C.linear_forget_launches()
        _remembered.difference_update([key for key in _remembered if len(key) != 2])  # (device, stream) stay
        if "torch_tma.kernels.linear" in sys.modules:  # not imported: nothing planned in Python yet
            _kernels()._launch_config.cache_clear()
            _kernels()._device_crossover.cache_clear()  # its M=64 part follows DEFAULT_OPTIONS too


def native_stats() -> dict:
    """Calls the native CUDA kernel made itself (fast_calls) and handed to the Python kernel (slow_calls), and the
    launches (plans) and stream workspaces it holds."""
    return _C.linear_native_stats()
