"""torch.ops.tma.linear: y = x @ weight^T + bias with the weight streamed through a cached TMA descriptor.

    torch.ops.tma.linear(x, weight, bias=None, *, l2_promotion=None) -> Tensor

x is [..., K] with any leading dims, weight [N, K], bias [N] or None; bf16 or fp16 in, fp32 accumulate,
output [..., N] in x's dtype. l2_promotion is a torch_tma.L2Promotion value for the weight descriptor;
None takes the kernel's default (kernels.linear.DEFAULT_L2_PROMOTION, set from its sweeps).

Registered once through torch.library: a CUDA kernel (the CuTe DSL weight-streaming kernel on Hopper,
F.linear elsewhere), a CPU kernel (F.linear), a fake kernel for torch.compile, and autograd. Where the
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
import logging
import re
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .cache import TensorMapCache, default_cache
from .spec import L2Promotion, Swizzle

__all__ = ["bind_weight_map", "unsupported_reason", "weight_unsupported_reason"]

_log = logging.getLogger("torch_tma")

# FRAGMENT, not DEF: other torch_tma modules may add ops to the same namespace.
_lib = torch.library.Library("tma", "FRAGMENT")
_lib.define("linear(Tensor x, Tensor weight, Tensor? bias=None, *, int? l2_promotion=None) -> Tensor")

_L2_PROMOTION_VALUES = frozenset(int(p) for p in L2Promotion)


def _out_shape(x: torch.Tensor, weight: torch.Tensor) -> tuple[int, ...]:
    """Output shape [..., N] of the op; the one shape helper of the real and fake kernels."""
    return (*x.shape[:-1], weight.shape[0])


def _check_args(x, weight, bias, l2_promotion) -> None:
    """Raise ValueError naming the argument when the inputs do not describe a linear layer."""
    if weight.dim() != 2:
        raise ValueError(f"tma::linear: weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"tma::linear: x's last dim must equal weight's K={weight.shape[1]}, got x shape {tuple(x.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"tma::linear: bias must be [N={weight.shape[0]}], got shape {tuple(bias.shape)}")
    if l2_promotion is not None and l2_promotion not in _L2_PROMOTION_VALUES:
        raise ValueError(
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
    major, minor = _capability(weight.device.index)
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
    # A cause is the reason without its numbers: prefills of every prompt length share one line.
    cause = re.sub(r"\d+", "#", reason)
    if cause not in _logged_reasons:
        _logged_reasons.add(cause)
        _log.info("tma::linear falls back to F.linear: %s", reason)


class _Plan(NamedTuple):
    """Everything a call needs beyond its tensors, fixed by (device, dtype, N, K, promotion)."""

    cache: TensorMapCache
    box: tuple[int, int]  # weight tile, elements, outermost first (rows of N, columns of K)
    swizzle: Swizzle
    l2_promotion: L2Promotion


@functools.cache
def _plan(device: torch.device, dtype: torch.dtype, n: int, k: int, l2_promotion: int | None) -> _Plan:
    kernels = _kernels()
    promotion = kernels.DEFAULT_L2_PROMOTION if l2_promotion is None else l2_promotion
    return _Plan(
        default_cache(device), kernels.weight_box(n, k, dtype), kernels.weight_swizzle(dtype), L2Promotion(promotion)
    )


def bind_weight_map(source, weight: torch.Tensor, l2_promotion: int | None = None):
    """Bind source's descriptor (a zero-arg callable returning the current weight, now `weight`) in the device's
    default cache, with the box, swizzle and promotion the op looks up, so the op's lookups hit the pinned slot.

    Returns the cache's BoundTensorMap; only for a weight that weight_unsupported_reason() accepts.
    """
    n, k = weight.shape
    plan = _plan(weight.device, weight.dtype, n, k, l2_promotion)
    return plan.cache.bind(source, plan.box, swizzle=plan.swizzle, l2_promotion=plan.l2_promotion)


def _linear_cuda(x, weight, bias=None, *, l2_promotion=None):
    _check_args(x, weight, bias, l2_promotion)
    x2d = x.reshape(-1, x.shape[-1])
    reason = unsupported_reason(x2d, weight, bias)
    if reason is not None:
        _log_fallback(reason)
        return F.linear(x, weight, bias)
    n, k = weight.shape
    plan = _plan(weight.device, weight.dtype, n, k, l2_promotion)
    weight_map = plan.cache.get(weight, plan.box, swizzle=plan.swizzle, l2_promotion=plan.l2_promotion)
    out = x.new_empty(_out_shape(x, weight))
    _kernels().linear_out(x2d, weight, bias, out.view(-1, n), weight_map.ptr, l2_promotion=plan.l2_promotion)
    return out


def _linear_cpu(x, weight, bias=None, *, l2_promotion=None):
    _check_args(x, weight, bias, l2_promotion)
    return F.linear(x, weight, bias)


def _linear_fake(x, weight, bias=None, *, l2_promotion=None):
    _check_args(x, weight, bias, l2_promotion)
    return x.new_empty(_out_shape(x, weight))


_lib.impl("linear", _linear_cuda, "CUDA")
_lib.impl("linear", _linear_cpu, "CPU")
torch.library.register_fake("tma::linear", _linear_fake, lib=_lib)


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _backward(ctx, grad):
    """grad_x = grad @ W, grad_W = grad^T x and grad_b = sum of grad over the leading dims."""
    x, weight = ctx.saved_tensors
    n, k = weight.shape
    grad_x = grad_weight = grad_bias = None
    if ctx.needs_input_grad[0]:
        grad_x = grad @ weight
    if ctx.needs_input_grad[1]:
        grad_weight = grad.reshape(-1, n).t() @ x.reshape(-1, k)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_bias = grad.reshape(-1, n).sum(0)
    return grad_x, grad_weight, grad_bias


torch.library.register_autograd("tma::linear", _backward, setup_context=_setup_context, lib=_lib)
