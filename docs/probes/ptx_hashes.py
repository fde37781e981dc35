"""Which of the linear kernel's shipped builds does a change reach? One line per build: its shape, M, bias and a hash
of its PTX (comment lines left out), compiled on the CPU for sm_90a (no GPU needed).

    CUTE_DSL_ARCH=sm_90a python docs/probes/ptx_hashes.py > after.txt

Run it on two trees (e.g. a `git worktree` of the commit before) and diff the outputs: the builds whose line differs
are the ones the change compiles differently. Builds are linear.options_for(DEFAULT_OPTIONS, ...) resolved for an
H200 (132 SMs and its cluster capacities), as the op picks them there.
"""

import hashlib
import os
import sys
import tempfile

import cutlass

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from torch_tma.kernels import linear  # noqa: E402

H200 = (132, (132, 66, 39, 30, 22, 17, 15, 15))  # SMs and clusters of 1..8 CTAs that run at once (cluster_capacity)
SHAPES = [(4096, 4096), (1024, 4096), (4096, 14336), (10240, 8192), (57344, 8192)]
MS = (1, 16, 32, 64)


def ptx_hash(n: int, k: int, m: int, bias: bool) -> str:
    """sha256 of the PTX of the default build for N x K at M rows, bf16, comment lines left out."""
    options = linear.options_for(linear.DEFAULT_OPTIONS, n, k, m, *H200)
    with tempfile.TemporaryDirectory() as dump:
        linear.compile_kernel.__wrapped__(cutlass.BFloat16, linear.m_pad(m), bias,
                                          f"--keep-ptx --dump-dir={dump}", options)
        (name,) = [f for f in os.listdir(dump) if f.endswith(".ptx")]
        with open(os.path.join(dump, name)) as f:
            code = "".join(line for line in f if not line.startswith("//"))
    return hashlib.sha256(code.encode()).hexdigest()[:16]


def main():
    for n, k in SHAPES:
        for m in MS:
            for bias in (False, True):
                print(f"{n}x{k} M={m} bias={int(bias)} {ptx_hash(n, k, m, bias)}", flush=True)


if __name__ == "__main__":
    main()
