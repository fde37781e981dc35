"""Host time per call of torch.ops.tma.linear, stage by stage, against F.linear (H200, < 1 minute).

    python benchmarks/profile_host.py               # llama8b.o (4096 x 4096 bf16), M = 1, no bias
    python benchmarks/profile_host.py --n 14336 --k 4096 --m 16

Eager decode is host-bound when the op's host cost exceeds its GPU time (~15 us at 4096 x 4096), so this
times the CPU side only: each stage runs CALLS times in a perf_counter loop right after torch.cuda._sleep
has queued a long spin on the GPU, so no loop ever waits for the GPU or for a free launch slot. Stages are
the Python kernel's steps in order (check, validate, plan, descriptor lookup, out allocation, launch: the path
of a shape's first call), then that whole Python kernel without the dispatcher, the op through the dispatcher
in the three grad modes (steady-state calls: the native C++ kernel, csrc/linear_op.cpp), a
torch.library op that does nothing (the dispatcher's floor for a Python kernel), F.linear, and the
torch_tma.nn.Linear module against nn.Linear. The op's output is checked against a float64 reference
first, and a steady-state call is checked to run natively; either failing stops the run.
"""

import argparse
import contextlib
import math
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

CALLS = 200  # per round: well under the ~1,000 launches a stream queues before the host blocks
ROUNDS = 9
SPIN_CYCLES = 100_000_000  # ~50 ms at the H200's 1.98 GHz: longer than any round's loop


def host_us(fn, mode=contextlib.nullcontext) -> tuple[float, float]:
    """(median, min) over ROUNDS of the host microseconds per call of fn, the GPU kept busy throughout.

    mode: a grad mode (torch.no_grad, torch.inference_mode) entered once around the loops, as a serving loop
    holds it around many steps.
    """
    return host_us_in_turns([fn], mode)[0]


def host_us_in_turns(fns, mode=contextlib.nullcontext, rounds: int = ROUNDS) -> list[tuple[float, float]]:
    """host_us for several callables timed in turns: round r times every fn once, in order, before round r + 1.

    A stretch of slow host time (another process, a frequency change) then falls on every fn's rounds alike rather
    than on one fn's whole set, which is what comparing two of them (the op against F.linear) needs.
    """
    per_call = [[] for _ in fns]
    with mode():
        for fn in fns:
            for _ in range(20):
                fn()
        torch.cuda.synchronize()
        for _ in range(rounds):
            for times, fn in zip(per_call, fns):
                torch.cuda._sleep(SPIN_CYCLES)
                start = time.perf_counter()
                for _ in range(CALLS):
                    fn()
                times.append((time.perf_counter() - start) / CALLS * 1e6)
                torch.cuda.synchronize()
    return [(statistics.median(times), min(times)) for times in per_call]


def check_close(out, x, weight) -> None:
    """|out - ref64| <= 2 |F.linear - ref64| + atol, elementwise; raises naming the worst element."""
    ref = F.linear(x.double(), weight.double())
    lowp = F.linear(x, weight).double()
    atol = torch.finfo(out.dtype).eps * ref.abs().max().item()
    err, limit = (out.double() - ref).abs(), 2 * (lowp - ref).abs() + atol
    if not bool((err <= limit).all()):
        raise AssertionError(f"tma::linear is off: {(err > limit).sum().item()} elements, worst error "
                             f"{err.max().item():.3e} (limit there {limit.flatten()[err.argmax()].item():.3e})")


def assert_native(ops, x, weight) -> None:
    """Fails unless a steady-state call of the op is made by the native CUDA kernel, without Python."""
    before = ops.native_stats()
    torch.ops.tma.linear(x, weight)
    after = ops.native_stats()
    if (after["fast_calls"] - before["fast_calls"], after["slow_calls"] - before["slow_calls"]) != (1, 0):
        raise AssertionError(f"a steady-state call did not run natively: {before} -> {after}")


def run(n: int, k: int, m: int) -> None:
    import tvm_ffi

    import torch_tma
    from torch_tma import ops
    from torch_tma.kernels import linear

    device = torch.device("cuda")
    assert torch.cuda.get_device_capability() == (9, 0), "this profile is for Hopper (sm_90)"
    dtype = torch.bfloat16
    x = torch.randn(m, k, dtype=dtype, device=device)
    x3 = x.view(1, m, k)
    weight = (torch.randn(n, k, device=device) / math.sqrt(k)).to(dtype)
    check_close(torch.ops.tma.linear(x, weight), x, weight)  # also compiles, encodes, makes the workspace
    assert_native(ops, x, weight)

    index = weight.get_device()
    plan = ops._plan(index, dtype, n, k, None)
    weight_map = plan.cache.get(weight, plan.box, swizzle=plan.swizzle, l2_promotion=plan.l2_promotion)
    ptr = weight_map.ptr
    out = torch.empty(m, n, dtype=dtype, device=device)
    compiled, num_ctas = linear._launch_config(index, dtype, m, n, k, False)
    ws = linear._workspace(index)
    spec = weight_map.spec
    ffi_args = [tvm_ffi.from_dlpack(t) for t in (x, weight, out, ws.partials, ws.arrivals)]
    encode_args = (int(spec.data_type), spec.address, spec.dims, spec.strides, spec.box, spec.elem_strides,
                   int(spec.interleave), int(spec.swizzle), int(spec.l2_promotion), int(spec.oob_fill), index)

    probe = torch.library.Library("profile_host", "DEF")
    probe.define("nothing(Tensor x, Tensor weight, Tensor? bias=None, *, int? l2_promotion=None) -> Tensor")
    probe.impl("nothing", lambda x, weight, bias=None, *, l2_promotion=None: x, "CUDA")

    layer = nn.Linear(k, n, bias=False, device=device, dtype=dtype)
    ours = torch_tma.nn.Linear.from_linear(layer)
    ours(x)  # binds the weight's descriptor

    stages = [
        ("-- the Python kernel (a shape's first call), stage by stage --",),
        ("empty loop (included in every row)", lambda: None),
        ("ops._check_args", lambda: ops._check_args(x, weight, None, None)),
        ("x.reshape(-1, K) (3-D x only)", lambda: x3.reshape(-1, k)),
        ("ops.unsupported_reason", lambda: ops.unsupported_reason(x, weight, None)),
        ("  kernels.linear.unsupported_reason", lambda: linear.unsupported_reason(x, weight, None)),
        ("ops._plan lookup", lambda: ops._plan(weight.get_device(), weight.dtype, n, k, None)),
        ("cache.get (hit)", lambda: plan.cache.get(weight, plan.box, swizzle=plan.swizzle,
                                                   l2_promotion=plan.l2_promotion)),
        ("TensorMap.ptr", lambda: weight_map.ptr),
        ("x.new_empty((M, N))", lambda: x.new_empty((m, n))),
        ("linear_out, whole", lambda: linear.linear_out(x, weight, None, out, ptr, l2_promotion=plan.l2_promotion)),
        ("  torch.cuda.current_device()", torch.cuda.current_device),
        ("  linear._launch_config lookup", lambda: linear._launch_config(index, dtype, m, n, k, False)),
        ("  linear._workspace", lambda: linear._workspace(index)),
        ("  compiled kernel call (TVM-FFI launch)",
         lambda: compiled(x, weight, None, out, ws.partials, ws.arrivals, ptr, num_ctas)),
        ("  same call, tensors converted to tvm_ffi once",
         lambda: compiled(ffi_args[0], ffi_args[1], None, *ffi_args[2:], ptr, num_ctas)),
        ("torch.cuda._sleep(1) (one runtime-API launch)", lambda: torch.cuda._sleep(1)),
        ("one cuTensorMapEncodeTiled (driver)", lambda: plan.cache._encode_tiled(*encode_args)),
        ("-- whole op --",),
        ("ops._linear_cuda (the Python kernel, no dispatcher)", lambda: ops._linear_cuda(x, weight)),
        ("torch.ops.tma.linear.default", lambda: torch.ops.tma.linear.default(x, weight)),
        ("torch.ops.tma.linear", lambda: torch.ops.tma.linear(x, weight)),
        ("torch.ops.tma.linear, 3-D x", lambda: torch.ops.tma.linear(x3, weight)),
        ("torch.ops.tma.linear, no_grad", lambda: torch.ops.tma.linear(x, weight), torch.no_grad),
        ("torch.ops.tma.linear, inference_mode", lambda: torch.ops.tma.linear(x, weight), torch.inference_mode),
        ("torch.ops.profile_host.nothing (floor)", lambda: torch.ops.profile_host.nothing(x, weight)),
        ("F.linear", lambda: F.linear(x, weight)),
        ("F.linear, inference_mode", lambda: F.linear(x, weight), torch.inference_mode),
        ("-- modules (weights require grad) --",),
        ("torch_tma.nn.Linear, no_grad", lambda: ours(x), torch.no_grad),
        ("nn.Linear, no_grad", lambda: layer(x), torch.no_grad),
        ("torch_tma.nn.Linear, inference_mode", lambda: ours(x), torch.inference_mode),
        ("nn.Linear, inference_mode", lambda: layer(x), torch.inference_mode),
    ]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, weight {n}x{k} bf16, x [{m}, {k}], no bias; "
          f"steady-state calls run in the native kernel (csrc/linear_op.cpp)")
    print(f"{'stage':44s} {'us/call p50':>11s} {'min':>7s}   ({ROUNDS} rounds of {CALLS} calls, GPU busy)")
    started = time.perf_counter()
    for name, *timed in stages:
        if not timed:
            print(name)
            continue
        p50, low = host_us(*timed)
        print(f"{name:44s} {p50:11.2f} {low:7.2f}", flush=True)
    print(f"done in {time.perf_counter() - started:.0f} s")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=4096, help="weight rows N (elements)")
    parser.add_argument("--k", type=int, default=4096, help="weight columns K (elements)")
    parser.add_argument("--m", type=int, default=1, help="rows of x (1 to 64)")
    args = parser.parse_args()
    run(args.n, args.k, args.m)


if __name__ == "__main__":
    main()
