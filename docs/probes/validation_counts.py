"""What the recorded driver verdicts say about each validation rule (CPU only).

    python docs/probes/validation_counts.py [--verdicts tests/data/driver_verdicts.json.gz]

Reads the H200 driver's verdicts on 20,000 boundary input sets (docs/probes/driver_record.py) and, with the
validator's rules one by one (torch_tma.validation.broken_rules, compute capability 9.0), prints: the rejections
each rule alone explains; the accepted sets a rule refuses (our deliberately stricter rules); the box-footprint
bracket and what two other footprint formulas would get wrong; the 128B-atom swizzle sets; and the addresses drawn.
docs/validation.md quotes this output (docs/results/validation-counts.log).
"""
import argparse
import collections
import gzip
import json
import math
import os
import sys

from torch_tma import validation
from torch_tma.spec import ELEMENT_BYTES, Swizzle

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "tests"))
from spec_fuzz import to_spec  # noqa: E402

CC = (9, 0)


def footprint_ceil(spec) -> int:
    """The footprint with ceiling division: what rounding up would give."""
    return ELEMENT_BYTES[spec.data_type] * math.prod(-(-b // e) for b, e in zip(spec.box, spec.elem_strides))


def footprint_without_dim0_stride(spec) -> int:
    """The footprint with dim 0's element stride left out."""
    rest = math.prod(b // e for b, e in zip(spec.box[1:], spec.elem_strides[1:]))
    return ELEMENT_BYTES[spec.data_type] * spec.box[0] * rest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--verdicts", default=os.path.join(ROOT, "tests", "data", "driver_verdicts.json.gz"))
    args = parser.parse_args()
    with gzip.open(args.verdicts) as f:
        verdicts = json.load(f)["verdicts"]
    accepted = sum(v["result"] == "CUDA_SUCCESS" for v in verdicts)
    print(f"{os.path.relpath(args.verdicts, ROOT)}: {len(verdicts)} sets, {accepted} accepted, {len(verdicts) - accepted} rejected")

    only, refused_accepted, unexplained = collections.Counter(), collections.Counter(), 0
    footprint_accepted, footprint_rejected = [], []  # footprints of sets no other rule refuses
    ceil_wrong, dim0_wrong, atom_sets, atom_accepted, addresses = 0, 0, 0, 0, []
    inner_interleaved = 0  # rejections the 16-byte inner box alone explains, with an interleave
    for v in verdicts:
        ok = v["result"] == "CUDA_SUCCESS"
        spec = to_spec(v["inputs"])
        broken = validation.broken_rules(spec, CC)
        addresses.append((spec.address, ok))
        if ok:
            refused_accepted.update(broken.keys())
        elif len(broken) == 1:
            only.update(broken.keys())
            inner_interleaved += "inner_box_16_bytes" in broken and spec.interleave != 0
        elif not broken:
            unexplained += 1
        if set(broken) <= {"box_footprint"} and "rank" not in broken:
            (footprint_accepted if ok else footprint_rejected).append(validation.box_footprint(spec))
            ceil_wrong += ok and footprint_ceil(spec) > validation.MAX_BOX_FOOTPRINT
            dim0_wrong += ok and footprint_without_dim0_stride(spec) > validation.MAX_BOX_FOOTPRINT
        if 1 <= spec.rank <= 5 and spec.swizzle >= Swizzle.B128_ATOM_32B:
            atom_sets += 1
            atom_accepted += ok

    print("rejections that one rule alone explains:")
    for name, _ in validation.RULES:
        if only[name]:
            print(f"  {name:24s} {only[name]:6d}")
    print(f"  of inner_box_16_bytes's, with interleave 16B or 32B (documented for NONE only): {inner_interleaved}")
    print(f"rejections no rule explains: {unexplained}")
    print("accepted sets a rule refuses (deliberately stricter):",
          ", ".join(f"{name} {n}" for name, n in refused_accepted.items()) or "none")
    print(f"box footprint (sets no other rule refuses): largest accepted {max(footprint_accepted)} B, smallest "
          f"rejected {min(footprint_rejected)} B (limit {validation.MAX_BOX_FOOTPRINT} B)")
    print(f"  accepted sets other formulas would refuse: ceiling division {ceil_wrong}, dim 0's element stride left "
          f"out {dim0_wrong}")
    print(f"128B-atom swizzles, rank 1..5: {atom_sets} sets, {atom_accepted} accepted")
    top = max(a for a, ok in addresses if ok)
    between = sum(2**47 < a < 2**63 for a, _ in addresses)
    print(f"addresses: largest accepted {top:#x} (2^{math.log2(top):.2f}); drawn strictly between 2^47 and 2^63: "
          f"{between}; at or above 2^63: {sum(a >= 2**63 for a, _ in addresses)}, accepted "
          f"{sum(ok for a, ok in addresses if a >= 2**63)}")


if __name__ == "__main__":
    main()
