"""What make_tiled_tma_atom builds for a rank-6 tensor (CPU only: the DSL encodes on the host).

    python docs/probes/cute_rank6.py

TMA maps have at most 5 dims, so the DSL folds a rank-6 tensor's modes into 5: here dims 0 and 1 into one TMA dim
at dim 1's stride, extent (e0-1)(s0/s1) + (e1-1) + 1 by CuTe's gcd recurrence, with one box of b0*b1 coordinates
along it. A tile's elements (d0, d1) sit at coordinates (s0/s1)*d0 + d1 there, so the box [c, c + b0*b1) is the
tile only where s0 = s1*e1 (dim 0 follows dim 1 in memory) and the tile spans all of dim 1 (b1 = e1). Where the
tensor is padded (a slice of a larger one), it covers other elements: for the 2 x 2 tile below, coordinates 0..3
where the tile needs 0, 1, 5 and 6; where the tile covers part of dim 1, it is 0..3 where the tile needs 0, 1, 3
and 4. This is read off the descriptor's fields, not run on a GPU. Where the tile spans all of dim 1 (a tensor of
shape (2, 2, 3, 3, 16, 64) or (3, 2, 3, 3, 16, 64), the same tile), planning aborted the whole process inside
the DSL (std::bad_variant_access, nvidia-cutlass-dsl 4.8.1), so that case is not run here. Both are why
torch_tma.cute refuses tensors of more than torch_tma.cute.MAX_TENSOR_RANK dims.
"""
import argparse

import torch
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

from torch_tma import decode
from torch_tma import cute as tma_cute


def smem_rank6():
    return cute.make_layout((2, 2, 2, 2, 8, 64), stride=(4096, 2048, 1024, 512, 64, 1))


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    limit, tma_cute.MAX_TENSOR_RANK = tma_cute.MAX_TENSOR_RANK, 6  # lifted here only, to see what the DSL builds
    try:
        show()
    finally:
        tma_cute.MAX_TENSOR_RANK = limit


def show() -> None:
    padded = torch.randn(4, 5, 5, 5, 24, 72).half()
    cases = {"contiguous, tile is part of dim 1": torch.randn(2, 3, 3, 3, 16, 64).half(),
             "padded": padded[:2, :3, :3, :3, :16, :64]}
    for name, x in cases.items():
        plan = tma_cute.plan_atom(cpasync.CopyBulkTensorTileG2SOp(), x, smem_rank6, (2, 2, 2, 2, 8, 64),
                                  static_layout=True)
        atom = decode(plan.atom_descriptor(x))
        print(f"{name}: shape {tuple(x.shape)}, element strides {x.stride()}")
        print(f"  tma_gbasis {plan.gbasis}")
        print(f"  atom: dims {atom.dims}, byte strides {atom.strides}, box {atom.box}")
        ratio = x.stride(0) // x.stride(1)
        box = list(range(atom.box[-1]))  # the atom's box along the folded (outermost) TMA dim, from coordinate 0
        tile = sorted(ratio * d0 + d1 for d0 in range(2) for d1 in range(2))  # smem_rank6's 2 x 2 over dims 0, 1
        verdict = "the tile" if box == tile else "NOT the tile"
        print(f"  dims 0 and 1 folded: the box covers coordinates {box}, the 2 x 2 tile's elements sit at "
              f"{tile}: {verdict}")


if __name__ == "__main__":
    main()
