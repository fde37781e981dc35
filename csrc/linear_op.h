// tma::linear's native kernels (linear_op.cpp), added to the extension module by tma_core.cpp.
#pragma once
#include <torch/csrc/utils/pybind.h>

void register_linear_op(pybind11::module& m);
