"""python -m torch_tma [descriptors | decode ...]

No arguments: the main job, the descriptor demo followed by the serving benchmark (decode). Each says what it
cannot do on a machine without a Hopper GPU and the command then exits non-zero. `decode --help` lists the
benchmark's options; an unknown command exits with status 2, as argparse does for a bad option.
"""
import sys

import torch

import torch_tma
from torch_tma import L2Promotion, Swizzle, TensorMapSpec


def descriptors() -> int:
    """Encode, cache, refresh and decode descriptors for one bf16 weight; print what lands in device memory."""
    print("== torch_tma descriptor demo")
    status = torch_tma.driver_status()
    hopper = not status and torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
    if not hopper:
        why = status or f"no GPU of compute capability 9.0+ (torch.cuda.is_available()={torch.cuda.is_available()})"
        print(f"cannot encode descriptors here: {why}")
        spec = TensorMapSpec.from_strided(0x7F0000000000, torch.bfloat16, (4096, 4096), (4096, 1), (64, 64),
                                          swizzle=Swizzle.B128, l2_promotion=L2Promotion.L2_256B)
        print("what a 4096x4096 bf16 weight with a 64x64 box would be encoded from (driver order):")
        print("  " + spec.validate().describe())
        try:
            spec.replace(box=(256, 64)).validate()
        except ValueError as e:
            print(f"and the validator's answer to a 512-byte inner box: {e}")
        return 1
    dev = torch.device("cuda", torch.cuda.current_device())
    cache = torch_tma.default_cache(dev)
    w = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    print(f"{torch.cuda.get_device_name(dev)}; weight 4096x4096 bf16 at {w.data_ptr():#x}, box 64x64, swizzle 128B")
    for promo in L2Promotion:
        tm = cache.get(w, (64, 64), swizzle=Swizzle.B128, l2_promotion=promo)
        print(f"  {promo.name:8s} slot {tm.ptr:#x}  byte 10 = {tm.raw[10]:#04x}  decoded promotion: "
              f"{torch_tma.decode(tm.raw).l2_promotion.name}")
    assert cache.get(w, (64, 64), swizzle=Swizzle.B128, l2_promotion=L2Promotion.L2_256B) is tm
    holder = {"w": w}
    bound = cache.bind(lambda: holder["w"], (64, 64), swizzle=Swizzle.B128, l2_promotion=L2Promotion.L2_256B)
    before = bound.ptr
    holder["w"] = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)  # "reloaded weights"
    print(f"bound slot {before:#x}; after the weight moved to {holder['w'].data_ptr():#x}: slot {bound.ptr:#x}, "
          f"descriptor address {torch_tma.decode(bound.map.raw).address:#x}")
    print("decoded:\n  " + bound.map.describe().replace("\n", "\n  "))
    print(f"stats: {cache.stats()}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "descriptors":
        return descriptors()
    if argv and argv[0] == "decode":
        from torch_tma import decode_demo
        return decode_demo.main(argv[1:])
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if argv:
        print(f"unknown command {argv[0]!r}\n\n{__doc__}", file=sys.stderr)
        return 2
    from torch_tma import decode_demo
    rc = descriptors()
    print()
    return max(rc, decode_demo.main([]))


if __name__ == "__main__":
    sys.exit(main())
