"""torch_tma: device-resident CUDA TMA descriptors (CUtensorMap) for Hopper kernels, with any L2 promotion.

    cache = torch_tma.default_cache()                      # one per device
    tm = cache.get(w, box=(64, 64), swizzle=torch_tma.Swizzle.B128, l2_promotion=torch_tma.L2Promotion.L2_256B)
    tm.ptr                                                 # device address of the 128-byte descriptor
    torch_tma.decode(tm.raw)                               # its fields

Importing works without a GPU or driver; device features fail then with a message naming what is missing.
``torch_tma.cute`` (CuTe DSL glue) is imported on demand, since it needs nvidia-cutlass-dsl.
"""
from .spec import (DataType, Interleave, L2Promotion, OOBFill, Swizzle, TensorMapSpec,  # noqa: F401
                   data_type_for)
from .layout import DecodedTensorMap, decode  # noqa: F401
from .cache import (BoundTensorMap, CacheFullError, CaptureMissError, StaleTensorMapError, TensorMap,  # noqa: F401
                    TensorMapCache, default_cache, driver_status)
from . import ops  # noqa: F401,E402  (registers torch.ops.tma.*)
from . import nn  # noqa: F401,E402
from .nn import refresh  # noqa: F401,E402

__version__ = "0.1.0"
