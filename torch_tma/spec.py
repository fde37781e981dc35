"""Every input of cuTensorMapEncodeTiled, validated before the driver sees it.

Two orders of dimensions meet here, and this module is the one place that converts between them:
  * torch order: outermost dimension first (``tensor.shape``), strides in elements;
  * driver order: innermost dimension first (``globalDim[0]`` is the contiguous one), strides in bytes,
    and only the ``rank - 1`` outer strides (the innermost stride is implicitly one element).
``TensorMapSpec`` is always in driver order. ``TensorMapSpec.from_strided`` / ``from_tensor`` take torch order.
"""
from __future__ import annotations

import enum
import operator
from dataclasses import dataclass, field

import torch

__all__ = [
    "DataType", "Swizzle", "L2Promotion", "Interleave", "OOBFill", "TensorMapSpec",
    "ELEMENT_BYTES", "data_type_for", "MAX_RANK",
]

MAX_RANK = 5
MAX_DIM = 2**32          # globalDim[i] <= 2^32
MAX_STRIDE = 2**40       # globalStrides[i] < 2^40
MAX_BOX = 256            # boxDim[i] <= 256
MAX_ELEM_STRIDE = 8      # elementStrides[i] <= 8


class DataType(enum.IntEnum):
    """``CUtensorMapDataType``: values equal the driver's enum."""
    UINT8 = 0
    UINT16 = 1
    UINT32 = 2
    INT32 = 3
    UINT64 = 4
    INT64 = 5
    FLOAT16 = 6
    FLOAT32 = 7
    FLOAT64 = 8
    BFLOAT16 = 9
    FLOAT32_FTZ = 10
    TFLOAT32 = 11
    TFLOAT32_FTZ = 12


class Swizzle(enum.IntEnum):
    """``CUtensorMapSwizzle``. The 128B-atom variants are accepted by the driver only on sm_100+ (on the
    H200 every encoding with them returned CUDA_ERROR_INVALID_VALUE), so they are checked against the device."""
    NONE = 0
    B32 = 1
    B64 = 2
    B128 = 3
    B128_ATOM_32B = 4
    B128_ATOM_32B_FLIP_8B = 5
    B128_ATOM_64B = 6

    @property
    def span(self) -> int | None:
        """Largest inner box extent in bytes that this swizzle allows (None: no swizzle, no limit)."""
        return {0: None, 1: 32, 2: 64}.get(int(self), 128)


class L2Promotion(enum.IntEnum):
    """``CUtensorMapL2promotion``: the granularity at which L2 misses are filled from DRAM."""
    NONE = 0
    L2_64B = 1
    L2_128B = 2
    L2_256B = 3


class Interleave(enum.IntEnum):
    """``CUtensorMapInterleave``."""
    NONE = 0
    B16 = 1
    B32 = 2


class OOBFill(enum.IntEnum):
    """``CUtensorMapFloatOOBfill``: what out-of-bounds elements read as."""
    NONE = 0
    NAN_REQUEST_ZERO_FMA = 1


ELEMENT_BYTES = {
    DataType.UINT8: 1, DataType.UINT16: 2, DataType.UINT32: 4, DataType.INT32: 4,
    DataType.UINT64: 8, DataType.INT64: 8, DataType.FLOAT16: 2, DataType.FLOAT32: 4,
    DataType.FLOAT64: 8, DataType.BFLOAT16: 2, DataType.FLOAT32_FTZ: 4, DataType.TFLOAT32: 4,
    DataType.TFLOAT32_FTZ: 4,
}
FLOAT_TYPES = frozenset({DataType.FLOAT16, DataType.FLOAT32, DataType.FLOAT64, DataType.BFLOAT16,
                         DataType.FLOAT32_FTZ, DataType.TFLOAT32, DataType.TFLOAT32_FTZ})

# The TMA moves bytes; types it has no format for travel as unsigned integers of the same width.
_TORCH_TO_DATA_TYPE = {
    torch.float16: DataType.FLOAT16, torch.bfloat16: DataType.BFLOAT16,
    torch.float32: DataType.FLOAT32, torch.float64: DataType.FLOAT64,
    torch.uint8: DataType.UINT8, torch.int8: DataType.UINT8,
    torch.int16: DataType.UINT16, torch.int32: DataType.INT32, torch.int64: DataType.INT64,
}
for _name, _dt in (("float8_e4m3fn", DataType.UINT8), ("float8_e5m2", DataType.UINT8),
                   ("float8_e4m3fnuz", DataType.UINT8), ("float8_e5m2fnuz", DataType.UINT8),
                   ("uint16", DataType.UINT16), ("uint32", DataType.UINT32), ("uint64", DataType.UINT64)):
    if hasattr(torch, _name):
        _TORCH_TO_DATA_TYPE[getattr(torch, _name)] = _dt


def data_type_for(dtype: torch.dtype, override: DataType | int | None = None) -> DataType:
    """The TMA data type for a torch dtype; ``override`` picks another format of the same width
    (e.g. TFLOAT32 or FLOAT32_FTZ for a float32 tensor)."""
    if dtype not in _TORCH_TO_DATA_TYPE:
        supported = ", ".join(sorted(str(d).replace("torch.", "") for d in _TORCH_TO_DATA_TYPE))
        raise TypeError(f"tensor dtype {dtype} has no TMA data type (supported: {supported})")
    natural = _TORCH_TO_DATA_TYPE[dtype]
    if override is None:
        return natural
    chosen = _enum(DataType, override, "data_type")
    if ELEMENT_BYTES[chosen] != ELEMENT_BYTES[natural]:
        raise ValueError(f"data_type={chosen.name} has {ELEMENT_BYTES[chosen]}-byte elements but the tensor's "
                         f"dtype {dtype} has {ELEMENT_BYTES[natural]}-byte elements")
    return chosen


def _enum(cls, value, name):
    if isinstance(value, cls):
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a torch_tma.{cls.__name__}, got {type(value).__name__} {value!r}")
    try:
        return cls(value)
    except ValueError:
        raise ValueError(f"{name}={value} is not a {cls.__name__} (valid: "
                         f"{', '.join(f'{m.name}={m.value}' for m in cls)})") from None


def _int_tuple(values, name):
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__} {values!r}")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, (bool, float)) or not hasattr(v, "__index__"):
            raise TypeError(f"{name}[{i}] must be an int, got {type(v).__name__} {v!r}")
        out.append(operator.index(v))
    return tuple(out)


@dataclass(frozen=True)
class TensorMapSpec:
    """Every input of ``cuTensorMapEncodeTiled``, in DRIVER order (innermost dimension first).

    dims          global extent of each dimension, in elements, innermost first (``globalDim``)
    strides       byte stride of dimensions 1..rank-1 (``globalStrides``; the innermost is one element)
    box           elements per dimension moved by one copy, innermost first (``boxDim``)
    elem_strides  traversal step per dimension, innermost first (``elementStrides``)
    """
    data_type: DataType
    address: int
    dims: tuple[int, ...]
    strides: tuple[int, ...]
    box: tuple[int, ...]
    elem_strides: tuple[int, ...] = ()
    interleave: Interleave = Interleave.NONE
    swizzle: Swizzle = Swizzle.NONE
    l2_promotion: L2Promotion = L2Promotion.L2_128B
    oob_fill: OOBFill = OOBFill.NONE
    # Set by validate(); not an init argument, so dataclasses.replace() gives a spec that is checked again.
    _validated: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self):
        set_ = object.__setattr__
        set_(self, "data_type", _enum(DataType, self.data_type, "data_type"))
        set_(self, "interleave", _enum(Interleave, self.interleave, "interleave"))
        set_(self, "swizzle", _enum(Swizzle, self.swizzle, "swizzle"))
        set_(self, "l2_promotion", _enum(L2Promotion, self.l2_promotion, "l2_promotion"))
        set_(self, "oob_fill", _enum(OOBFill, self.oob_fill, "oob_fill"))
        if isinstance(self.address, bool) or not isinstance(self.address, int):
            raise TypeError(f"address must be an int, got {type(self.address).__name__} {self.address!r}")
        set_(self, "dims", _int_tuple(self.dims, "dims"))
        set_(self, "strides", _int_tuple(self.strides, "strides"))
        set_(self, "box", _int_tuple(self.box, "box"))
        es = _int_tuple(self.elem_strides, "elem_strides") or (1,) * len(self.dims)
        set_(self, "elem_strides", es)

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def element_bytes(self) -> int:
        return ELEMENT_BYTES[self.data_type]

    def validate(self, compute_capability: tuple[int, int] | None = None) -> "TensorMapSpec":
        """Check every documented constraint of cuTensorMapEncodeTiled (and those the H200's driver
        applies beyond the documentation, see docs/validation.md). Raises ValueError naming the field,
        its value and the limit; returns self. ``compute_capability`` enables the device-specific checks."""
        if self._validated and compute_capability is None:
            return self
        from .validation import check_spec  # the rule table lives beside its documentation
        check_spec(self, compute_capability)
        if compute_capability is None:
            object.__setattr__(self, "_validated", True)
        return self

    def replace(self, **changes) -> "TensorMapSpec":
        fields = {k: getattr(self, k) for k in ("data_type", "address", "dims", "strides", "box", "elem_strides",
                                                "interleave", "swizzle", "l2_promotion", "oob_fill")}
        fields.update(changes)
        return TensorMapSpec(**fields)

    @classmethod
    def from_strided(cls, address: int, dtype: torch.dtype, shape, stride, box, *, swizzle=Swizzle.NONE,
                     l2_promotion=L2Promotion.L2_128B, interleave=Interleave.NONE, oob_fill=OOBFill.NONE,
                     elem_strides=None, data_type=None) -> "TensorMapSpec":
        """The one torch-order -> driver-order conversion.

        ``shape``/``stride`` (elements) and ``box``/``elem_strides`` are in TORCH order, outermost first,
        exactly as ``tensor.shape`` and ``tensor.stride()``. The innermost dimension must be contiguous.
        """
        shape, stride = _int_tuple(shape, "shape"), _int_tuple(stride, "stride")
        box = _int_tuple(box, "box")
        rank = len(shape)
        if not 1 <= rank <= MAX_RANK:
            raise ValueError(f"tensor rank {rank} is not supported: TMA tiled maps have rank 1..{MAX_RANK}")
        if len(stride) != rank:
            raise ValueError(f"stride={stride} has {len(stride)} entries but shape={shape} has {rank}")
        if len(box) != rank:
            raise ValueError(f"box={box} has {len(box)} entries but the tensor has rank {rank} "
                             f"(give one box extent per tensor dimension, outermost first)")
        for i, n in enumerate(shape):
            if n == 0:
                raise ValueError(f"tensor shape {shape} has a zero-size dimension {i}: a TMA map needs every "
                                 f"extent >= 1")
        if stride[-1] != 1 and shape[-1] != 1:
            raise ValueError(f"the innermost dimension must be contiguous (stride 1), got stride {stride} for "
                             f"shape {shape}: call .contiguous() or choose a view whose last stride is 1")
        for i, s in enumerate(stride[:-1]):
            if s < 0:
                raise ValueError(f"stride[{i}]={s} is negative: TMA maps need non-negative strides")
        dt = data_type_for(dtype, data_type)
        esize = ELEMENT_BYTES[dt]
        if elem_strides is not None:
            elem_strides = _int_tuple(elem_strides, "elem_strides")
            if len(elem_strides) != rank:
                raise ValueError(f"elem_strides={elem_strides} has {len(elem_strides)} entries but the tensor "
                                 f"has rank {rank}")
            elem_strides = elem_strides[::-1]
        return cls(data_type=dt, address=address, dims=shape[::-1],
                   strides=tuple(s * esize for s in stride[-2::-1]), box=box[::-1],
                   elem_strides=elem_strides or (), interleave=interleave, swizzle=swizzle,
                   l2_promotion=l2_promotion, oob_fill=oob_fill)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor, box, **kwargs) -> "TensorMapSpec":
        """A spec for a CUDA tensor; ``box`` (and ``elem_strides``) in the tensor's own order, outermost
        first. Keyword arguments as ``from_strided``."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type != "cuda":
            raise ValueError(f"tensor is on {tensor.device}, not a CUDA device: TMA maps describe CUDA memory")
        return cls.from_strided(tensor.data_ptr(), tensor.dtype, tensor.shape, tensor.stride(), box, **kwargs)

    def key(self) -> tuple:
        """Every encoding input as a hashable tuple (what the cache keys spec lookups on)."""
        return (int(self.data_type), self.address, self.dims, self.strides, self.box, self.elem_strides,
                int(self.interleave), int(self.swizzle), int(self.l2_promotion), int(self.oob_fill))

    def describe(self) -> str:
        return (f"{self.data_type.name} rank {self.rank} at {self.address:#x}: dims {list(self.dims)} "
                f"strides {list(self.strides)} B, box {list(self.box)}, elem strides {list(self.elem_strides)}, "
                f"interleave {self.interleave.name}, swizzle {self.swizzle.name}, "
                f"L2 promotion {self.l2_promotion.name}, OOB fill {self.oob_fill.name} (innermost first)")
