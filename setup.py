"""Builds the native core (csrc/) with the host compiler against torch's headers: no nvcc, no libcuda link.
The CUDA driver is opened at run time (dlopen), so the extension imports on machines without a GPU."""
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

setup(
    ext_modules=[
        CppExtension(
            "torch_tma._C",
            ["csrc/tma_core.cpp", "csrc/linear_op.cpp"],
            extra_compile_args=["-O2", "-g0"],
            libraries=["dl"],
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=False)},
)
