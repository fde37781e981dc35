"""Which of the linear kernel's builds does a change reach? One line per build: its variant, shape, M, bias and a hash
of its PTX (comment lines left out), compiled on the CPU for sm_90a (no GPU needed).

    CUTE_DSL_ARCH=sm_90a python docs/probes/ptx_hashes.py > after.txt
    CUTE_DSL_ARCH=sm_90a python docs/probes/ptx_hashes.py --tree /tmp/before > before.txt  # a `git worktree` of the
                                                                                        # commit before
    CUTE_DSL_ARCH=sm_90a python docs/probes/ptx_hashes.py --variants shipped no-lead stream-k --shapes 4096x4096

Diff two outputs: the builds whose line differs are the ones the change compiles differently. --tree imports
torch_tma and benchmarks/sweep_linear.py from that checkout instead of this one (its compiled extension must be
there, e.g. copied from this one's torch_tma/; the script refuses a tree its imports did not come from). Builds are
linear.options_for(variant, ...) resolved for an H200 (132 SMs and its cluster capacities), as the op picks them
there; variants are sweep_linear.variants' names ("shipped": DEFAULT_OPTIONS). A build that the options refuse prints
its error instead of a hash.
"""

import argparse
import hashlib
import os
import sys
import tempfile

H200 = (132, (132, 66, 39, 30, 22, 17, 15, 15))  # SMs and clusters of 1..8 CTAs that run at once (cluster_capacity)
SHAPES = [(4096, 4096), (1024, 4096), (4096, 14336), (10240, 8192), (57344, 8192)]
MS = (1, 16, 32, 64)


def ptx_hash(linear, cutlass, options, n: int, k: int, m: int, bias: bool) -> str:
    """sha256 of the PTX of options resolved for N x K at M rows, bf16, comment lines left out."""
    resolved = linear.options_for(options, n, k, m, *H200)
    with tempfile.TemporaryDirectory() as dump:
        linear.compile_kernel.__wrapped__(cutlass.BFloat16, linear.m_pad(m), bias,
                                          f"--keep-ptx --dump-dir={dump}", resolved)
        (name,) = [f for f in os.listdir(dump) if f.endswith(".ptx")]
        with open(os.path.join(dump, name)) as f:
            code = "".join(line for line in f if not line.startswith("//"))
    return hashlib.sha256(code.encode()).hexdigest()[:16]


def shape(text: str) -> tuple[int, int]:
    """N x K of an --shapes value such as 4096x14336."""
    try:
        n, k = (int(v) for v in text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not N x K, e.g. 4096x14336") from None
    return n, k


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."),
                        help="checkout whose torch_tma and benchmarks/sweep_linear.py are compiled (default: this one)")
    parser.add_argument("--variants", nargs="+", default=["shipped"], help="sweep_linear variant names")
    parser.add_argument("--shapes", nargs="+", type=shape, default=SHAPES, help="N x K of the weight, e.g. 4096x14336")
    parser.add_argument("--ms", nargs="+", type=int, default=MS)
    parser.add_argument("--bias", nargs="+", type=int, choices=(0, 1), default=(0, 1))
    args = parser.parse_args()
    tree = os.path.realpath(args.tree)
    sys.path[:0] = [tree, os.path.join(tree, "benchmarks")]
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # read when CuTe DSL is imported: compile for Hopper
    import cutlass
    import sweep_linear
    from torch_tma.kernels import linear

    for module in (linear, sweep_linear):  # an installed torch_tma, or one imported before, would hash another tree
        if not os.path.realpath(module.__file__).startswith(tree + os.sep):
            parser.error(f"--tree {args.tree}: {module.__name__} was imported from {module.__file__}, not from it")

    table = sweep_linear.variants(linear)
    for name, o in sweep_linear.select_variants(parser, table, args.variants).items():
        for n, k in args.shapes:
            for m in args.ms:
                for bias in args.bias:
                    try:
                        line = ptx_hash(linear, cutlass, o, n, k, m, bool(bias))
                    except ValueError as error:
                        line = f"refused: {error}"
                    print(f"{name} {n}x{k} M={m} bias={bias} {line}", flush=True)


if __name__ == "__main__":
    main()
