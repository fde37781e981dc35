"""torch.func.grad through a torch.library custom op with a registered autograd formula (CPU only).

    python docs/probes/func_grad_custom_op.py

Runs torch.func.grad over two ops: a toy op built with torch.library.custom_op and register_autograd (with a
setup_context), and torch.ops.tma.linear's CPU path. It prints, for each, the gradient's error against the float64
one, or the error that stopped it. In torch 2.13 the toy op stops with a RuntimeError: the autograd.Function that
torch.library's Autograd kernel applies has no setup_context of its own. Until stop 48 torch.ops.tma.linear stopped
the same way; its own Function has a setup_context since, but applied inside a transform from the op's Autograd
kernel it meets "no kernel for HigherOrderOperator custom_function_call at Autograd", so inside a torch.func
transform the op computes with F.linear and logs why (docs/serving.md, "torch.compile").
"""
import argparse

import torch

import torch_tma  # noqa: F401  (registers torch.ops.tma)


@torch.library.custom_op("tma_probe::mm", mutates_args=())
def toy_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w.t()


@toy_mm.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[0])


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    x, w = ctx.saved_tensors
    return grad @ w, grad.t() @ x


toy_mm.register_autograd(_backward, setup_context=_setup)


def try_grad(name, op):
    x, w = torch.randn(3, 64), torch.randn(5, 64)
    expected = torch.func.grad(lambda w: (x.double() @ w.t()).sum())(w.double())
    try:
        got = torch.func.grad(lambda w: op(x, w).sum())(w)
    except Exception as e:  # the point of the probe is which error, if any
        print(f"{name}: {type(e).__name__}: {str(e).splitlines()[0]}")
        return
    print(f"{name}: gradient max abs error {(got.double() - expected).abs().max().item():.2e}")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    print(f"torch {torch.__version__}")
    try_grad("torch.library.custom_op + register_autograd", toy_mm)
    try_grad("torch.ops.tma.linear (CPU)", torch.ops.tma.linear)
