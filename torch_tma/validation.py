"""The rules of cuTensorMapEncodeTiled, checked before the driver is called.

Each rule raises ValueError naming the argument, its value and the limit. The rules come from the driver
documentation; where the H200's driver (580.159, CUDA 13.0) applies a rule the documentation does not state,
the rule says so and docs/validation.md shows the evidence (tests/data/driver_verdicts.json.gz).
"""
from __future__ import annotations

import math

from .spec import (ELEMENT_BYTES, FLOAT_TYPES, MAX_BOX, MAX_DIM, MAX_ELEM_STRIDE, MAX_RANK, MAX_STRIDE,
                   Interleave, OOBFill, Swizzle)


# Undocumented limits the H200's driver applies, bracketed by the recorded verdicts (docs/validation.md):
# the box's shared-memory footprint, esize * prod(box[i] // elem_strides[i]) over every dim (floor division,
# dim 0 included), must be at most 228 KiB: the largest accepted was 233,472 B, the smallest rejected 235,520 B.
# That equals sm_90's shared memory per SM.
MAX_BOX_FOOTPRINT = 233472
# Accepted addresses reached 2^47 and 2^63 was rejected; we reject from 2^57 (a 57-bit virtual address space),
# deliberately stricter inside a range no recorded input fell in.
MAX_ADDRESS = 2**57


def _fail(msg: str):
    raise ValueError(msg)


def check_spec(spec, compute_capability=None) -> None:
    """Raise ValueError for the first rule ``spec`` breaks. See module docstring."""
    rank, esize = spec.rank, ELEMENT_BYTES[spec.data_type]
    il, sw = spec.interleave, spec.swizzle

    if not 1 <= rank <= MAX_RANK:
        _fail(f"rank={rank} (len(dims)) is out of range: tiled TMA maps have rank 1..{MAX_RANK}")
    if len(spec.strides) != rank - 1:
        _fail(f"strides={list(spec.strides)} has {len(spec.strides)} entries: rank {rank} needs {rank - 1} "
              f"(the byte strides of dims 1..rank-1, innermost first)")
    if len(spec.box) != rank:
        _fail(f"box={list(spec.box)} has {len(spec.box)} entries: rank {rank} needs {rank}")
    if len(spec.elem_strides) != rank:
        _fail(f"elem_strides={list(spec.elem_strides)} has {len(spec.elem_strides)} entries: rank {rank} needs {rank}")
    if il != Interleave.NONE and rank < 3:
        _fail(f"interleave={il.name} needs rank >= 3, got rank {rank}")

    align = 32 if il == Interleave.B32 else 16
    if not 0 <= spec.address < MAX_ADDRESS:
        _fail(f"address={spec.address:#x} is out of range: device addresses are below 2^57")
    if spec.address % align:
        _fail(f"address={spec.address:#x} is not {align}-byte aligned"
              + (" (interleave B32 needs 32-byte alignment)" if align == 32 else
                 " (TMA needs 16-byte aligned global addresses; check the tensor's storage offset)"))

    for i, d in enumerate(spec.dims):
        if not 1 <= d <= MAX_DIM:
            _fail(f"dims[{i}]={d} is out of range: each global dim must be in 1..2^32")
    for i, s in enumerate(spec.strides):
        if s % align:
            _fail(f"strides[{i}]={s} bytes is not a multiple of {align}"
                  + (" (interleave B32)" if align == 32 else "")
                  + ": TMA needs every outer byte stride to be a multiple of 16 (pad the rows)")
        if not 0 <= s < MAX_STRIDE:
            _fail(f"strides[{i}]={s} bytes is out of range: each byte stride must be below 2^40")

    for i, b in enumerate(spec.box):
        if not 1 <= b <= MAX_BOX:
            _fail(f"box[{i}]={b} is out of range: each box dim must be in 1..{MAX_BOX} elements")
    inner_bytes = spec.box[0] * esize
    if inner_bytes % 16:  # documented for interleave NONE; the driver applies it to every interleave
        _fail(f"box[0]={spec.box[0]} elements x {esize} B = {inner_bytes} B is not a multiple of 16 bytes "
              f"(the innermost box extent must be whole 16-byte units)")
    for i, e in enumerate(spec.elem_strides):
        if not 1 <= e <= MAX_ELEM_STRIDE:
            _fail(f"elem_strides[{i}]={e} is out of range: each element stride must be in 1..{MAX_ELEM_STRIDE}")

    footprint = esize * math.prod(b // e for b, e in zip(spec.box, spec.elem_strides))
    if footprint > MAX_BOX_FOOTPRINT:
        _fail(f"box={list(spec.box)} with elem_strides={list(spec.elem_strides)} occupies {footprint} B of shared "
              f"memory (esize x prod(box // elem_strides)), above the driver's limit of {MAX_BOX_FOOTPRINT} B")
    # Documented, though the H200's driver accepted interleave B32 with other swizzles: deliberately stricter.
    if il == Interleave.B32 and sw != Swizzle.B32:
        _fail(f"swizzle={sw.name} with interleave=B32: the driver documentation requires swizzle B32")
    if il == Interleave.NONE and sw.span is not None and inner_bytes > sw.span:
        _fail(f"box[0]={spec.box[0]} elements x {esize} B = {inner_bytes} B exceeds the {sw.span}-byte span of "
              f"swizzle {sw.name}: use a smaller inner box or a wider swizzle")
    if spec.oob_fill == OOBFill.NAN_REQUEST_ZERO_FMA and spec.data_type not in FLOAT_TYPES:
        _fail(f"oob_fill=NAN_REQUEST_ZERO_FMA needs a floating-point data type, got {spec.data_type.name}")
    if sw >= Swizzle.B128_ATOM_32B and (compute_capability is None or compute_capability < (10, 0)):
        where = "an unknown device" if compute_capability is None else \
            f"compute capability {compute_capability[0]}.{compute_capability[1]}"
        _fail(f"swizzle={sw.name} needs compute capability 10.0 or newer, got {where} (the H200's driver "
              f"rejects every 128B-atom swizzle)")
