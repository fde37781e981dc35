"""The rules of cuTensorMapEncodeTiled, checked before the driver is called.

Each rule returns a message naming the argument, its value and the limit, or None; check_spec raises ValueError
with the first rule's message that a spec breaks, in RULES order. The rules come from the driver documentation;
where the H200's driver (580.159, CUDA 13.0) applies a rule the documentation does not state, the rule says so and
docs/validation.md shows the evidence (tests/data/driver_verdicts.json.gz, counted by
docs/probes/validation_counts.py).
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


def _align(spec) -> int:
    return 32 if spec.interleave == Interleave.B32 else 16


def _inner_bytes(spec) -> int:
    return spec.box[0] * ELEMENT_BYTES[spec.data_type]


# ---- the shape of the arguments: the rules below assume these hold ----------------------------------------

def _rank(spec, cc):
    if not 1 <= spec.rank <= MAX_RANK:
        return f"rank={spec.rank} (len(dims)) is out of range: tiled TMA maps have rank 1..{MAX_RANK}"


def _strides_length(spec, cc):
    if len(spec.strides) != spec.rank - 1:
        return (f"strides={list(spec.strides)} has {len(spec.strides)} entries: rank {spec.rank} needs "
                f"{spec.rank - 1} (the byte strides of dims 1..rank-1, innermost first)")


def _box_length(spec, cc):
    if len(spec.box) != spec.rank:
        return f"box={list(spec.box)} has {len(spec.box)} entries: rank {spec.rank} needs {spec.rank}"


def _elem_strides_length(spec, cc):
    if len(spec.elem_strides) != spec.rank:
        return (f"elem_strides={list(spec.elem_strides)} has {len(spec.elem_strides)} entries: rank {spec.rank} "
                f"needs {spec.rank}")


# ---- the values ------------------------------------------------------------------------------------------

def _interleave_rank(spec, cc):
    if spec.interleave != Interleave.NONE and spec.rank < 3:
        return f"interleave={spec.interleave.name} needs rank >= 3, got rank {spec.rank}"


def _address_range(spec, cc):
    if not 0 <= spec.address < MAX_ADDRESS:
        return f"address={spec.address:#x} is out of range: device addresses are below 2^57"


def _address_alignment(spec, cc):
    align = _align(spec)
    if spec.address % align:
        return (f"address={spec.address:#x} is not {align}-byte aligned"
                + (" (interleave B32 needs 32-byte alignment)" if align == 32 else
                   " (TMA needs 16-byte aligned global addresses; check the tensor's storage offset)"))


def _dims(spec, cc):
    for i, d in enumerate(spec.dims):
        if not 1 <= d <= MAX_DIM:
            return f"dims[{i}]={d} is out of range: each global dim must be in 1..2^32"


def _strides(spec, cc):
    align = _align(spec)
    for i, s in enumerate(spec.strides):
        if s % align:
            return (f"strides[{i}]={s} bytes is not a multiple of {align}"
                    + (" (interleave B32)" if align == 32 else "")
                    + ": TMA needs every outer byte stride to be a multiple of 16 (pad the rows)")
        if not 0 <= s < MAX_STRIDE:
            return f"strides[{i}]={s} bytes is out of range: each byte stride must be below 2^40"


def _box(spec, cc):
    for i, b in enumerate(spec.box):
        if not 1 <= b <= MAX_BOX:
            return f"box[{i}]={b} is out of range: each box dim must be in 1..{MAX_BOX} elements"


def _inner_box_16_bytes(spec, cc):
    # documented for interleave NONE; the driver applies it to every interleave
    inner = _inner_bytes(spec)
    if inner % 16:
        return (f"box[0]={spec.box[0]} elements x {ELEMENT_BYTES[spec.data_type]} B = {inner} B is not a multiple of "
                f"16 bytes (the innermost box extent must be whole 16-byte units)")


def _elem_strides(spec, cc):
    for i, e in enumerate(spec.elem_strides):
        if not 1 <= e <= MAX_ELEM_STRIDE:
            return f"elem_strides[{i}]={e} is out of range: each element stride must be in 1..{MAX_ELEM_STRIDE}"


def box_footprint(spec) -> int:
    """Bytes of shared memory the box fills: esize x prod(box[i] // elem_strides[i]), every dim."""
    return ELEMENT_BYTES[spec.data_type] * math.prod(b // e for b, e in zip(spec.box, spec.elem_strides))


def _box_footprint(spec, cc):
    if _elem_strides(spec, cc) is None and box_footprint(spec) > MAX_BOX_FOOTPRINT:  # undocumented (above)
        return (f"box={list(spec.box)} with elem_strides={list(spec.elem_strides)} occupies {box_footprint(spec)} B of "
                f"shared memory (esize x prod(box // elem_strides)), above the driver's limit of {MAX_BOX_FOOTPRINT} B")


def _interleave_32b_swizzle(spec, cc):
    # Documented, though the H200's driver accepted interleave B32 with other swizzles: deliberately stricter.
    if spec.interleave == Interleave.B32 and spec.swizzle != Swizzle.B32:
        return f"swizzle={spec.swizzle.name} with interleave=B32: the driver documentation requires swizzle B32"


def _swizzle_span(spec, cc):
    sw, inner = spec.swizzle, _inner_bytes(spec)
    if spec.interleave == Interleave.NONE and sw.span is not None and inner > sw.span:
        return (f"box[0]={spec.box[0]} elements x {ELEMENT_BYTES[spec.data_type]} B = {inner} B exceeds the "
                f"{sw.span}-byte span of swizzle {sw.name}: use a smaller inner box or a wider swizzle")


def _nan_fill(spec, cc):
    if spec.oob_fill == OOBFill.NAN_REQUEST_ZERO_FMA and spec.data_type not in FLOAT_TYPES:
        return f"oob_fill=NAN_REQUEST_ZERO_FMA needs a floating-point data type, got {spec.data_type.name}"


def _atom_swizzle(spec, cc):
    if spec.swizzle >= Swizzle.B128_ATOM_32B and (cc is None or cc < (10, 0)):
        where = "an unknown device" if cc is None else f"compute capability {cc[0]}.{cc[1]}"
        return (f"swizzle={spec.swizzle.name} needs compute capability 10.0 or newer, got {where} (the H200's driver "
                f"rejects every 128B-atom swizzle)")


SHAPE_RULES = (("rank", _rank), ("strides_length", _strides_length), ("box_length", _box_length),
               ("elem_strides_length", _elem_strides_length))
RULES = SHAPE_RULES + (
    ("interleave_rank", _interleave_rank), ("address_range", _address_range),
    ("address_alignment", _address_alignment), ("dims", _dims), ("strides", _strides), ("box", _box),
    ("inner_box_16_bytes", _inner_box_16_bytes), ("elem_strides", _elem_strides), ("box_footprint", _box_footprint),
    ("interleave_32b_swizzle", _interleave_32b_swizzle), ("swizzle_span", _swizzle_span), ("nan_fill", _nan_fill),
    ("atom_swizzle", _atom_swizzle),
)


def broken_rules(spec, compute_capability=None) -> dict[str, str]:
    """Every rule ``spec`` breaks, name -> message, in RULES order (only the shape rules where one of them breaks:
    the others assume them)."""
    shape = {name: msg for name, rule in SHAPE_RULES if (msg := rule(spec, compute_capability)) is not None}
    if shape:
        return shape
    return {name: msg for name, rule in RULES if (msg := rule(spec, compute_capability)) is not None}


def check_spec(spec, compute_capability=None) -> None:
    """Raise ValueError for the first rule ``spec`` breaks. See module docstring."""
    for _, rule in RULES:
        msg = rule(spec, compute_capability)
        if msg is not None:
            raise ValueError(msg)
