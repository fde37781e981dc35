"""Record what cuTensorMapEncodeTiled does, straight from the driver (no torch_tma code involved).

Three parts, each written to --out (default tests/data):
  layout    one input changed at a time from a base encoding; prints which descriptor bits move
            (the evidence behind docs/descriptor-layout.md) and saves layout_probe.json.
  record    N random VALID input sets and the 128 bytes the driver wrote: driver_descriptors.json.gz,
            replayed by tests/test_layout.py on the CPU to check torch_tma.decode.
  verdicts  N random input sets drawn to sit on every documented boundary, and the driver's CUresult for
            each: driver_verdicts.json.gz, replayed against our validator by
            tests/test_layout.py::test_validator_agrees_with_recorded_driver_verdicts.

The driver never dereferences globalAddress while encoding, so addresses are synthetic.
Run on the GPU machine:  python docs/probes/driver_record.py --encoder native --out tests/data --record 3000 --verdicts 20000
(--encoder native: cuda-bindings' encoder gives wrong rank-1 verdicts, docs/descriptor-layout.md)
"""
import argparse
import gzip
import json
import os
import platform
import random
import sys

from cuda.bindings import driver as drv

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from spec_fuzz import ELEM_BYTES, boundary_inputs, valid_inputs  # noqa: E402

def encode(inp):
    """Encode one input dict; return (CUresult name, 128 bytes or None)."""
    U32, U64 = drv.cuuint32_t, drv.cuuint64_t
    err, tmap = drv.cuTensorMapEncodeTiled(
        drv.CUtensorMapDataType(inp["dt"]), inp["rank"], inp["addr"],
        [U64(v) for v in inp["dims"]], [U64(v) for v in inp["strides"]],
        [U32(v) for v in inp["box"]], [U32(v) for v in inp["es"]],
        drv.CUtensorMapInterleave(inp["il"]), drv.CUtensorMapSwizzle(inp["sw"]),
        drv.CUtensorMapL2promotion(inp["l2"]), drv.CUtensorMapFloatOOBfill(inp["oob"]))
    if err != drv.CUresult.CUDA_SUCCESS:
        return err.name, None
    return err.name, b"".join(int(v).to_bytes(8, "little") for v in tmap.opaque)


def encode_native(inp):
    """The same call through torch_tma's native core (C++; a valid strides pointer even for rank 1)."""
    from torch_tma import _C
    try:
        raw = _C.encode_tiled(inp["dt"], inp["addr"], inp["dims"], inp["strides"], inp["box"], inp["es"],
                              inp["il"], inp["sw"], inp["l2"], inp["oob"], 0)
    except ValueError as e:
        return str(e).split()[-1], None
    return "CUDA_SUCCESS", raw


def layout_probe():
    """Change one input at a time from a base encoding and report the bits that move."""
    base = {"dt": 6, "rank": 2, "addr": 0x7F0012345600, "dims": [128, 64], "strides": [256],
            "box": [64, 64], "es": [1, 1], "il": 0, "sw": 3, "l2": 2, "oob": 0}
    variations = [("base", {})]
    variations += [(f"dt={dt}", {"dt": dt, "box": [128 // ELEM_BYTES[dt], 64],
                                  "dims": [128, 64], "strides": [max(256, 128 * ELEM_BYTES[dt])]})
                   for dt in ELEM_BYTES]
    variations += [(f"sw={sw}", {"sw": sw}) for sw in range(7)]
    variations += [(f"l2={l2}", {"l2": l2}) for l2 in range(4)]
    variations += [("oob=1", {"oob": 1})]
    variations += [(f"addr+{d:#x}", {"addr": 0x7F0012345600 + d}) for d in (16, 256, 1 << 20, 1 << 40, 1 << 50)]
    variations += [(f"dims0={v}", {"dims": [v, 64]}) for v in (65, 255, 256, 2**16, 2**32)]
    variations += [(f"dims1={v}", {"dims": [128, v]}) for v in (1, 2, 1000, 2**32)]
    variations += [(f"stride0={v}", {"strides": [v]}) for v in (272, 4096, 2**32, 2**36, 2**40 - 16)]
    variations += [(f"box0={v}", {"box": [v, 64]}) for v in (8, 16, 32)]
    variations += [(f"box1={v}", {"box": [64, v]}) for v in (1, 2, 128, 256)]
    variations += [(f"es={e}", {"es": e}) for e in ([2, 1], [1, 2], [1, 8], [8, 8])]
    rank3 = {"rank": 3, "dims": [128, 64, 7], "strides": [256, 256 * 64], "box": [64, 64, 3], "es": [1, 1, 1]}
    variations += [("rank3", rank3)]
    variations += [(f"rank3.{n}", dict(rank3, **kv)) for n, kv in (
        ("dims2=9", {"dims": [128, 64, 9]}), ("stride1=2^20", {"strides": [256, 2**20]}),
        ("box2=5", {"box": [64, 64, 5]}), ("es2=3", {"es": [1, 1, 3]}))]
    rank5 = {"rank": 5, "dims": [32, 3, 5, 7, 11], "strides": [64, 192, 960, 6720],
             "box": [32, 2, 3, 4, 5], "es": [1, 2, 3, 4, 5], "sw": 2}
    variations += [("rank5", rank5)]
    variations += [("rank1", {"rank": 1, "dims": [1000], "strides": [], "box": [64], "es": [1], "sw": 0})]
    variations += [(f"il={il}", {"rank": 3, "dims": [8, 64, 7], "strides": [256, 256 * 64], "box": [8, 64, 3],
                                 "es": [1, 1, 1], "il": il, "sw": 1}) for il in (0, 1, 2)]
    results = []
    base_raw = encode(base)[1]
    for name, change in variations:
        inp = dict(base, **change)
        status, raw = encode(inp)
        entry = {"name": name, "inputs": inp, "result": status, "raw": raw.hex() if raw else None}
        if raw:
            diffs = []
            for w in range(16):
                a = int.from_bytes(base_raw[8 * w:8 * w + 8], "little")
                b = int.from_bytes(raw[8 * w:8 * w + 8], "little")
                if a != b:
                    bits = [bit for bit in range(64) if (a ^ b) >> bit & 1]
                    diffs.append(f"q{w}: {a:#018x} -> {b:#018x} bits {bits}")
            entry["diff"] = diffs
        results.append(entry)
        print(f"{name:16s} {status:24s} " + ("; ".join(entry.get("diff", [])) or "-"))
    print("base raw:", base_raw.hex())
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="tests/data")
    ap.add_argument("--record", type=int, default=3000)
    ap.add_argument("--verdicts", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=20261202)
    ap.add_argument("--encoder", choices=["bindings", "native"], default="bindings",
                    help="cuda-bindings (independent of torch_tma) or torch_tma's native core")
    args = ap.parse_args()
    global encode
    if args.encoder == "native":
        encode = encode_native
    (err,) = drv.cuInit(0)
    assert err == drv.CUresult.CUDA_SUCCESS, err
    err, version = drv.cuDriverGetVersion()
    meta = {"driver_version": version, "python": platform.python_version(), "seed": args.seed,
            "encoder": args.encoder}
    err, dev = drv.cuDeviceGet(0)
    # Encoding needs a current context (CUDA_ERROR_INVALID_CONTEXT without one, seen on the H200).
    err, ctx = drv.cuDevicePrimaryCtxRetain(dev)
    (err,) = drv.cuCtxSetCurrent(ctx)
    assert err == drv.CUresult.CUDA_SUCCESS, err
    err, name = drv.cuDeviceGetName(64, dev)
    meta["device"] = name.split(b"\0")[0].decode()
    print(meta)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "layout_probe.json"), "w") as f:
        json.dump({"meta": meta, "variations": layout_probe()}, f, indent=1)
    rng = random.Random(args.seed)
    records = []
    while len(records) < args.record:
        inp = valid_inputs(rng)
        status, raw = encode(inp)
        if raw is None:
            print("valid generator produced a rejected set:", status, inp, file=sys.stderr)
            continue
        records.append({"inputs": inp, "raw": raw.hex()})
    with gzip.open(os.path.join(args.out, "driver_descriptors.json.gz"), "wt") as f:
        json.dump({"meta": meta, "records": records}, f)
    verdicts, counts = [], {}
    for _ in range(args.verdicts):
        inp = boundary_inputs(rng)
        try:
            status, _ = encode(inp)
        except ValueError as e:  # cuda-bindings refuses arrays longer than 5 before calling the driver
            status = f"BINDINGS_REJECTED: {e}"
        counts[status] = counts.get(status, 0) + 1
        verdicts.append({"inputs": inp, "result": status})
    with gzip.open(os.path.join(args.out, "driver_verdicts.json.gz"), "wt") as f:
        json.dump({"meta": meta, "verdicts": verdicts}, f)
    print(f"recorded {len(records)} descriptors, {len(verdicts)} verdicts {counts}")


if __name__ == "__main__":
    main()
