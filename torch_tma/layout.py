"""The byte layout of a Hopper CUtensorMap: the one place that knows it.

Established on an H200 (driver 580.159, CUDA 13.0) by encoding through cuTensorMapEncodeTiled while varying
one input at a time (docs/probes/driver_record.py, written up in docs/descriptor-layout.md) and checked against
3,000 random driver encodings (tests/data/driver_descriptors.json.gz). qN is little-endian 64-bit word N.

  q0            global address
  q1[4:6]       rank - 1
  q1[7:10]      hardware data format (not the driver enum; see _HW_FORMAT)
  q1[11:12]     interleave          q1[13:14] swizzle        q1[15] OOB fill NaN
  q1[16]        tf32 rounding (with format f32 / f32-ftz)   q1[17:18] L2 promotion
  q1[1], q1[21] flags written by CuTe DSL's own encoder, never by the driver
  q1[32:63]     stride[0] >> 4 (low 32 bits)   q2[0:31] stride[1] >> 4   q2[32:63] stride[2] >> 4
  q3[0:31]      stride[3] >> 4                 q3[32+4i : 35+4i] bits 32..35 of stride[i] >> 4
  q4, q5, q6[0:31]  dims[i] - 1, 32 bits each (d0, d1 | d2, d3 | d4)
  q6[32+3i : 34+3i] elem_strides[i] - 1       q6[56:63] box[0] - 1     q7 byte i-1: box[i] - 1 (i >= 1)
  q8            bytes one box occupies in shared memory (prod floor(box/elem_stride) x element size)
  q9            swizzle pattern repeat in bytes (16 for none, 256 / 512 / 1024 for 32B / 64B / 128B)
  bytes 80..127 zero
"""
from __future__ import annotations

from dataclasses import dataclass

from .spec import DataType, Interleave, L2Promotion, OOBFill, Swizzle, TensorMapSpec

DESCRIPTOR_BYTES = 128

# hardware format code -> driver data type (tf32 flag clear / set)
_HW_FORMAT = {0: DataType.UINT8, 1: DataType.UINT16, 2: DataType.UINT32, 3: DataType.INT32,
              4: DataType.UINT64, 5: DataType.INT64, 6: DataType.FLOAT16, 7: DataType.FLOAT32,
              8: DataType.FLOAT32_FTZ, 9: DataType.FLOAT64, 10: DataType.BFLOAT16}
_HW_FORMAT_TF32 = {7: DataType.TFLOAT32, 8: DataType.TFLOAT32_FTZ}
_KNOWN_Q1_BITS = (0x7 << 4) | (0xF << 7) | (0x3 << 11) | (0x3 << 13) | (1 << 15) | (1 << 16) | (0x3 << 17) \
    | (0xFFFFFFFF << 32)


def _bits(word: int, lo: int, n: int) -> int:
    return (word >> lo) & ((1 << n) - 1)


@dataclass(frozen=True)
class DecodedTensorMap:
    """The fields of 128 descriptor bytes, driver order (innermost first), strides in bytes."""
    address: int
    data_type: DataType
    rank: int
    dims: tuple[int, ...]
    strides: tuple[int, ...]
    box: tuple[int, ...]
    elem_strides: tuple[int, ...]
    interleave: Interleave
    swizzle: Swizzle
    l2_promotion: L2Promotion
    oob_fill: OOBFill
    box_bytes: int          # q8: shared-memory bytes of one box, as the driver computed it
    swizzle_bytes: int      # q9: swizzle pattern repeat in bytes
    extra_flags: int        # q1 bits outside the known fields (CuTe DSL sets bits 1 and 21)

    def to_spec(self) -> TensorMapSpec:
        return TensorMapSpec(data_type=self.data_type, address=self.address, dims=self.dims,
                             strides=self.strides, box=self.box, elem_strides=self.elem_strides,
                             interleave=self.interleave, swizzle=self.swizzle,
                             l2_promotion=self.l2_promotion, oob_fill=self.oob_fill)

    def describe(self) -> str:
        lines = [
            f"address       {self.address:#x}",
            f"data type     {self.data_type.name} (rank {self.rank})",
            f"dims          {list(self.dims)} elements, innermost first",
            f"strides       {list(self.strides)} bytes (dims 1..{self.rank - 1})",
            f"box           {list(self.box)} elements ({self.box_bytes} B in shared memory)",
            f"elem strides  {list(self.elem_strides)}",
            f"interleave    {self.interleave.name}",
            f"swizzle       {self.swizzle.name} (repeat {self.swizzle_bytes} B)",
            f"L2 promotion  {self.l2_promotion.name}",
            f"OOB fill      {self.oob_fill.name}",
        ]
        if self.extra_flags:
            lines.append(f"extra flags   {self.extra_flags:#x} (q1 bits outside the known fields)")
        return "\n".join(lines)


def decode(raw) -> DecodedTensorMap:
    """Decode 128 descriptor bytes (bytes, bytearray, memoryview, or a uint8 tensor on the CPU)."""
    if hasattr(raw, "numpy"):
        raw = raw.contiguous().numpy().tobytes()
    raw = bytes(raw)
    if len(raw) < 64:
        raise ValueError(f"a CUtensorMap has {DESCRIPTOR_BYTES} bytes (the fields live in the first 80), "
                         f"got {len(raw)}")
    q = [int.from_bytes(raw[8 * i:8 * i + 8], "little") for i in range(len(raw) // 8)]
    q += [0] * (16 - len(q))
    q1 = q[1]
    rank = _bits(q1, 4, 3) + 1
    if rank > 5:
        raise ValueError(f"rank field {rank} in q1={q1:#018x}: a tiled CUtensorMap has rank 1..5 (not a "
                         f"descriptor, or one this decoder does not know)")
    if _bits(q1, 11, 2) == 3:
        raise ValueError(f"interleave field 3 in q1={q1:#018x} is not an interleave the driver encodes (0..2)")
    fmt = _bits(q1, 7, 4)
    tf32 = _bits(q1, 16, 1)
    table = _HW_FORMAT_TF32 if tf32 else _HW_FORMAT
    if fmt not in table:
        raise ValueError(f"unknown hardware data format {fmt} (tf32 flag {tf32}) in q1={q1:#018x}")
    stride_lo = [_bits(q1, 32, 32), _bits(q[2], 0, 32), _bits(q[2], 32, 32), _bits(q[3], 0, 32)]
    strides = tuple(((_bits(q[3], 32 + 4 * i, 4) << 32) | stride_lo[i]) << 4 for i in range(rank - 1))
    dim_words = [_bits(q[4], 0, 32), _bits(q[4], 32, 32), _bits(q[5], 0, 32), _bits(q[5], 32, 32), _bits(q[6], 0, 32)]
    box = [_bits(q[6], 56, 8) + 1] + [_bits(q[7], 8 * (i - 1), 8) + 1 for i in range(1, 5)]
    return DecodedTensorMap(
        address=q[0],
        data_type=table[fmt],
        rank=rank,
        dims=tuple(d + 1 for d in dim_words[:rank]),
        strides=strides,
        box=tuple(box[:rank]),
        elem_strides=tuple(_bits(q[6], 32 + 3 * i, 3) + 1 for i in range(rank)),
        interleave=Interleave(_bits(q1, 11, 2)),
        swizzle=Swizzle(_bits(q1, 13, 2)),
        l2_promotion=L2Promotion(_bits(q1, 17, 2)),
        oob_fill=OOBFill(_bits(q1, 15, 1)),
        box_bytes=q[8],
        swizzle_bytes=q[9],
        extra_flags=q1 & ~_KNOWN_Q1_BITS & ((1 << 64) - 1),
    )
