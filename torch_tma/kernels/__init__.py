"""CuTe DSL kernels that load through torch_tma's cached descriptors.

Each kernel module imports the CuTe DSL (nvidia-cutlass-dsl) at import time, so this package imports none
of them: callers (torch_tma.ops) import a kernel module on first use.

    linear    the weight-streaming linear layer y = x W^T (+ b) for small M (1..64) on Hopper
"""
