"""Decode benchmark: Llama-3-8B-shaped greedy decoding under CUDA graphs, stock nn.Linear vs torch_tma.nn.Linear.

The measurement is torch_tma.decode_demo's (the CLI's demo runs the same code); this entry point writes its
CSV and PNG to docs/results/ (decode.csv, decode.png). Any demo option may follow, e.g. --layers 8 or --batch 1. On the H200:

    source .gpu/env.sh && timeout -s KILL 600 python benchmarks/bench_decode.py

Exit status: 0 measured and checked; 1 a correctness check failed; 2 no Hopper GPU (a tiny CPU run only).
"""

import os
import sys

from torch_tma.decode_demo import main

if __name__ == "__main__":
    results = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "results")
    sys.exit(main(["--out", results, *sys.argv[1:]]))
