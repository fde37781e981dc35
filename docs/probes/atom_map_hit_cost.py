"""Host cost of torch_tma.cute.atom_tensor_map on a hit (CPU only: a CPU cache with the driver call faked).

    python docs/probes/atom_map_hit_cost.py [--hits 20000] [--repeats 3]

Prints us per call, once per repeat: plan lookup, argument checks, the memoized derivation and the cache's spec
lookup, for a 300 x 1024 fp16 tensor and a 2-D K-major SW64 atom (benchmarks/atom_matrix.py's config).
"""
import argparse
import sys
import timeit
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

import atom_matrix  # noqa: E402
from test_cache_cpu import cpu_cache  # noqa: E402
from torch_tma import L2Promotion  # noqa: E402
from torch_tma import cute as tma_cute  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hits", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    cache = cpu_cache(slots=8)
    config = atom_matrix.Config(2, "float16", "SW64", "K", 1)
    op, smem_layout, tile = config.op(), config.smem_layout, config.tile
    x = torch.randn(300, 1024).half()

    def hit():
        return tma_cute.atom_tensor_map(op, x, smem_layout, tile, l2_promotion=L2Promotion.L2_64B, cache=cache)

    first = hit()  # plans (compiles the atom's encoder) and encodes
    assert hit() is first and cache.stats()["misses"] == 1
    for _ in range(args.repeats):
        print(f"atom_tensor_map hit: {timeit.timeit(hit, number=args.hits) / args.hits * 1e6:.2f} us")


if __name__ == "__main__":
    main()
