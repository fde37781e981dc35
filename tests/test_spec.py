"""TensorMapSpec: the torch-order -> driver-order conversion and every validation rule (CPU)."""
import dataclasses
import re

import pytest
import torch

from torch_tma import DataType, Interleave, L2Promotion, OOBFill, Swizzle, TensorMapSpec, data_type_for

BASE = dict(data_type=DataType.FLOAT16, address=0x7F0000001000, dims=(128, 64, 8), strides=(256, 256 * 64),
            box=(64, 32, 2), elem_strides=(1, 1, 1), swizzle=Swizzle.B128, l2_promotion=L2Promotion.L2_256B)


def spec(**changes):
    return TensorMapSpec(**{**BASE, **changes})


def test_base_spec_is_valid():
    assert spec().validate((9, 0)) is not None


def test_from_strided_converts_to_driver_order():
    s = TensorMapSpec.from_strided(0x1000, torch.bfloat16, shape=(3, 40, 64), stride=(40 * 72, 72, 1),
                                   box=(1, 8, 64), elem_strides=(1, 2, 1), swizzle=Swizzle.B128)
    assert s.dims == (64, 40, 3)
    assert s.strides == (72 * 2, 40 * 72 * 2)
    assert s.box == (64, 8, 1)
    assert s.elem_strides == (1, 2, 1)
    assert s.data_type == DataType.BFLOAT16
    assert s.l2_promotion == L2Promotion.L2_128B  # the default, what CuTe and CUTLASS encode


def test_from_strided_default_elem_strides_and_key():
    s = TensorMapSpec.from_strided(0x2000, torch.float32, (16, 32), (32, 1), (8, 32))
    assert s.elem_strides == (1, 1)
    assert s.key() == (int(DataType.FLOAT32), 0x2000, (32, 16), (128,), (32, 8), (1, 1), 0, 0, 2, 0)
    assert s.key() != s.replace(l2_promotion=L2Promotion.L2_256B).key()
    assert s.key() != s.replace(box=(16, 8)).key()
    assert hash(s) == hash(TensorMapSpec.from_strided(0x2000, torch.float32, (16, 32), (32, 1), (8, 32)))


@pytest.mark.parametrize("dtype, expected", [
    (torch.float16, DataType.FLOAT16), (torch.bfloat16, DataType.BFLOAT16), (torch.float32, DataType.FLOAT32),
    (torch.float64, DataType.FLOAT64), (torch.int8, DataType.UINT8), (torch.uint8, DataType.UINT8),
    (torch.float8_e4m3fn, DataType.UINT8), (torch.float8_e5m2, DataType.UINT8), (torch.int16, DataType.UINT16),
    (torch.int32, DataType.INT32), (torch.int64, DataType.INT64), (torch.uint16, DataType.UINT16),
    (torch.uint32, DataType.UINT32), (torch.uint64, DataType.UINT64)])
def test_data_type_mapping(dtype, expected):
    assert data_type_for(dtype) == expected


def test_data_type_override_same_width():
    assert data_type_for(torch.float32, DataType.TFLOAT32) == DataType.TFLOAT32
    with pytest.raises(ValueError, match="data_type=FLOAT16 has 2-byte elements but the tensor's dtype torch.float32"):
        data_type_for(torch.float32, DataType.FLOAT16)
    with pytest.raises(TypeError, match="tensor dtype torch.complex64 has no TMA data type"):
        data_type_for(torch.complex64)


# (changes, exception, message pattern): one failing case per rule, each naming the argument, value and limit.
RULES = [
    (dict(dims=(), strides=(), box=(), elem_strides=()), ValueError, r"rank=0 \(len\(dims\)\) is out of range: .*1\.\.5"),
    (dict(dims=(2,) * 6, strides=(32,) * 5, box=(2,) * 6, elem_strides=(1,) * 6), ValueError, r"rank=6 .*1\.\.5"),
    (dict(strides=(256,)), ValueError, r"strides=\[256\] has 1 entries: rank 3 needs 2"),
    (dict(box=(64, 32)), ValueError, r"box=\[64, 32\] has 2 entries: rank 3 needs 3"),
    (dict(elem_strides=(1, 1)), ValueError, r"elem_strides=\[1, 1\] has 2 entries: rank 3 needs 3"),
    (dict(dims=(128, 64), strides=(256,), box=(8, 32), elem_strides=(1, 1), interleave=Interleave.B16,
          swizzle=Swizzle.NONE), ValueError, r"interleave=B16 needs rank >= 3, got rank 2"),
    (dict(address=0x7F0000001008), ValueError, r"address=0x7f0000001008 is not 16-byte aligned"),
    (dict(address=0x7F0000001010, interleave=Interleave.B32, swizzle=Swizzle.B32, box=(16, 32, 2)),
     ValueError, r"address=0x7f0000001010 is not 32-byte aligned \(interleave B32"),
    (dict(address=2**57), ValueError, r"address=0x200000000000000 is out of range: .*below 2\^57"),
    (dict(dims=(128, 0, 8)), ValueError, r"dims\[1\]=0 is out of range: .*1\.\.2\^32"),
    (dict(dims=(128, 64, 2**32 + 1)), ValueError, r"dims\[2\]=4294967297 is out of range"),
    (dict(strides=(264, 256 * 64)), ValueError, r"strides\[0\]=264 bytes is not a multiple of 16"),
    (dict(strides=(256, 2**40)), ValueError, r"strides\[1\]=1099511627776 bytes is out of range: .*below 2\^40"),
    (dict(interleave=Interleave.B32, swizzle=Swizzle.B32, box=(16, 32, 2), strides=(272, 256 * 64)),
     ValueError, r"strides\[0\]=272 bytes is not a multiple of 32 \(interleave B32\)"),
    (dict(box=(64, 0, 2)), ValueError, r"box\[1\]=0 is out of range: .*1\.\.256"),
    (dict(box=(64, 257, 2)), ValueError, r"box\[1\]=257 is out of range"),
    (dict(box=(12, 32, 2), swizzle=Swizzle.NONE), ValueError, r"box\[0\]=12 elements x 2 B = 24 B is not a multiple of 16"),
    (dict(box=(12, 32, 2), swizzle=Swizzle.NONE, interleave=Interleave.B16), ValueError, r"24 B is not a multiple of 16"),
    (dict(elem_strides=(1, 0, 1)), ValueError, r"elem_strides\[1\]=0 is out of range: .*1\.\.8"),
    (dict(elem_strides=(1, 9, 1)), ValueError, r"elem_strides\[1\]=9 is out of range"),
    (dict(box=(128, 32, 2)), ValueError, r"256 B exceeds the 128-byte span of swizzle B128"),
    (dict(box=(32, 32, 2), swizzle=Swizzle.B32), ValueError, r"64 B exceeds the 32-byte span of swizzle B32"),
    (dict(box=(64, 256, 8), swizzle=Swizzle.B128), ValueError, r"occupies 262144 B of shared memory .* limit of 233472 B"),
    (dict(interleave=Interleave.B32, swizzle=Swizzle.B64, box=(16, 32, 2)), ValueError,
     r"swizzle=B64 with interleave=B32: the driver documentation requires swizzle B32"),
    (dict(data_type=DataType.INT32, box=(32, 32, 2), oob_fill=OOBFill.NAN_REQUEST_ZERO_FMA), ValueError,
     r"oob_fill=NAN_REQUEST_ZERO_FMA needs a floating-point data type, got INT32"),
    (dict(swizzle=Swizzle.B128_ATOM_32B), ValueError, r"swizzle=B128_ATOM_32B needs compute capability 10\.0 or newer, got compute capability 9\.0"),
]


@pytest.mark.parametrize("changes, exc, pattern", RULES, ids=[re.sub(r"\W+", "_", p[2])[:40] for p in RULES])
def test_rule_rejects_with_named_field(changes, exc, pattern):
    with pytest.raises(exc, match=pattern):
        spec(**changes).validate((9, 0))


def test_footprint_counts_floor_of_box_over_elem_stride():
    # 64 x 256 x 8 fp16 would be 256 KiB; with element stride 2 on dim 1 it is 128 KiB and valid.
    spec(box=(64, 256, 8), elem_strides=(1, 2, 1)).validate((9, 0))
    # exactly at the limit: 233,472 B = 2 B x 64 x 228 x 8
    spec(box=(64, 228, 8)).validate((9, 0))
    with pytest.raises(ValueError, match="occupies 235520 B"):
        spec(box=(64, 230, 8)).validate((9, 0))


@pytest.mark.parametrize("field, value, pattern", [
    ("data_type", "fp16", r"data_type must be a torch_tma.DataType, got str 'fp16'"),
    ("swizzle", 9, r"swizzle=9 is not a Swizzle \(valid: NONE=0"),
    ("l2_promotion", 1.0, r"l2_promotion must be a torch_tma.L2Promotion, got float"),
    ("interleave", True, r"interleave must be a torch_tma.Interleave, got bool"),
    ("oob_fill", 2, r"oob_fill=2 is not a OOBFill"),
    ("address", 4096.0, r"address must be an int, got float"),
    ("box", (64, "32", 2), r"box\[1\] must be an int, got str"),
    ("dims", 5, r"dims must be a sequence of ints, got int 5"),
])
def test_wrong_types(field, value, pattern):
    with pytest.raises(TypeError if "must be" in pattern else ValueError, match=pattern):
        spec(**{field: value})


def test_from_strided_errors():
    with pytest.raises(ValueError, match=r"innermost dimension must be contiguous \(stride 1\), got stride \(1, 16\)"):
        TensorMapSpec.from_strided(0x1000, torch.float16, (16, 16), (1, 16), (8, 8))
    with pytest.raises(ValueError, match=r"tensor shape \(0, 16\) has a zero-size dimension 0"):
        TensorMapSpec.from_strided(0x1000, torch.float16, (0, 16), (16, 1), (8, 8))
    with pytest.raises(ValueError, match=r"box=\(8,\) has 1 entries but the tensor has rank 2"):
        TensorMapSpec.from_strided(0x1000, torch.float16, (16, 16), (16, 1), (8,))
    with pytest.raises(ValueError, match=r"tensor rank 6 is not supported"):
        TensorMapSpec.from_strided(0x1000, torch.float16, (2,) * 6, (32, 16, 8, 4, 2, 1), (1,) * 6)
    with pytest.raises(ValueError, match=r"stride\[0\]=-16 is negative"):
        TensorMapSpec.from_strided(0x1000, torch.float16, (16, 16), (-16, 1), (8, 8))
    with pytest.raises(ValueError, match=r"stride=\(64,\) has 1 entries but shape=\(4, 64\) has 2"):
        TensorMapSpec.from_strided(0x1000, torch.float16, (4, 64), (64,), (4, 64))
    with pytest.raises(ValueError, match=r"stride=\(64, 1, 1\) has 3 entries but shape=\(4, 64\) has 2"):
        TensorMapSpec.from_strided(0x1000, torch.float16, (4, 64), (64, 1, 1), (4, 64))
    with pytest.raises(ValueError, match=r"elem_strides=\(1,\) has 1 entries but the tensor has rank 2"):
        TensorMapSpec.from_strided(0x1000, torch.float16, (16, 16), (16, 1), (8, 8), elem_strides=(1,))


def test_from_tensor_needs_a_cuda_tensor():
    with pytest.raises(ValueError, match=r"tensor is on cpu, not a CUDA device"):
        TensorMapSpec.from_tensor(torch.randn(8, 8), (8, 8))
    with pytest.raises(ValueError, match=r"tensor is on meta, not a CUDA device"):
        TensorMapSpec.from_tensor(torch.empty(8, 8, device="meta"), (8, 8))
    with pytest.raises(TypeError, match=r"expected a torch.Tensor, got list"):
        TensorMapSpec.from_tensor([[1.0]], (1, 1))


def test_misaligned_storage_offset_is_reported_by_address():
    # A view one fp16 element into an aligned buffer: address % 16 == 2.
    s = TensorMapSpec.from_strided(0x7F0000001000 + 2, torch.float16, (64, 64), (64, 1), (8, 64))
    with pytest.raises(ValueError, match=r"is not 16-byte aligned .*storage offset"):
        s.validate()


def test_describe_names_fields_innermost_first():
    text = spec().describe()
    assert "FLOAT16 rank 3" in text and "dims [128, 64, 8]" in text and "innermost first" in text
    assert "L2 promotion L2_256B" in text


def test_a_replaced_spec_is_checked_again():
    valid = spec().validate()
    changed = dataclasses.replace(valid, box=(256, 32, 2))  # 512 B inner box under a 128-byte swizzle
    with pytest.raises(ValueError, match=r"box\[0\]=256 .* exceeds the 128-byte span of swizzle B128"):
        changed.validate()
