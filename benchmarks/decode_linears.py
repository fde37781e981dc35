"""Where a decode step's linear time goes: Llama-3-8B's linear layers by kind, stock nn.Linear against torch_tma's.

    source .gpu/env.sh && timeout 300 python benchmarks/decode_linears.py [--batch 1 16] [--variant NAME ...]

The decode benchmark (torch_tma.decode_demo) reports one number for a step's linear layers: a CUDA graph of all 225
of them (32 layers x q/k/v/o/gate/up/down, then lm_head) on fresh inputs. This script builds the same layers (random
bf16 weights, no biases) and times, per batch size:
- "all": that graph, the layers in forward order;
- one graph per kind (q_proj ... down_proj: its 32 calls in layer order, each on its own weight, so nothing is reread
  from the 60 MB L2; lm_head: its one 1 GB call);
- one graph per chain of layers a decode step runs back to back (CHAINS: q, k, v; gate, up), layer by layer.
Each graph is replayed REPLAYS times between CUDA events, REPEATS times; the median is printed, in us per step
(per kind or chain) and per call. The kinds' sum ("sum") against "all" says how much the calls gain or lose from
their neighbours.

Providers: "stock" (F.linear, cuBLAS), then torch_tma.nn.Linear with the shipped kernel options and with each
--variant (variants(): KernelOptions that differ from the shipped ones as named), each over the same weights.
"""

import argparse
import os
import statistics
import sys
from dataclasses import replace

import torch
from torch import nn

from torch_tma import nn as tma_nn
from torch_tma import ops
from torch_tma.decode_demo import LLAMA3_8B, capture_graph
from torch_tma.kernels import linear

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sweep_linear  # noqa: E402
from bench_linear import SPIN_CYCLES  # noqa: E402

KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
# the layers a decode step runs back to back (nothing else between them): per layer q, k, v; and gate, up
CHAINS = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate+up": ("gate_proj", "up_proj")}
REPLAYS, REPEATS = 5, 7


def variants():
    """name -> KernelOptions for torch_tma's layers: sweep_linear's "shipped" (linear.DEFAULT_OPTIONS) and its trigger
    variants ("half-trigger": launches of at most half the SMs trigger the next launch once the TMA warp has issued
    its last weight load and share their SMs, the policy shipped until sweep run 17; "load-trigger": every cluster and
    one-CTA-per-tile build does; "no-trigger": at exit everywhere, the default before; "no-lead": the shipped policy
    with the trigger right after the last load at every M), and "trigger-3q": those of at most three quarters of the
    SMs, right after their last load, sharing their SMs."""
    table = sweep_linear.variants(linear)
    chosen = {name: table[name] for name in ("shipped", "half-trigger", "load-trigger", "no-trigger", "no-lead")}
    chosen["trigger-3q"] = table["no-trigger"]._replace(load_trigger_grid=0.75, trigger_lead=0)
    return chosen


def build_layers(config, device, dtype):
    """[(kind, nn.Linear)] in forward order: per layer q, k, v, o, gate, up, down; then lm_head."""
    h, kv = config.hidden_size, config.num_kv_heads * config.head_dim
    shapes = {"q_proj": (h, config.num_heads * config.head_dim), "k_proj": (h, kv), "v_proj": (h, kv),
              "o_proj": (config.num_heads * config.head_dim, h), "gate_proj": (h, config.intermediate_size),
              "up_proj": (h, config.intermediate_size), "down_proj": (config.intermediate_size, h)}
    layers = [(kind, nn.Linear(*shapes[kind], bias=False, device=device, dtype=dtype))
              for _ in range(config.num_layers) for kind in KINDS[:-1]]
    layers.append(("lm_head", nn.Linear(h, config.vocab_size, bias=False, device=device, dtype=dtype)))
    for _, m in layers:
        nn.init.normal_(m.weight, std=m.in_features ** -0.5)
    return layers


def time_graph_us(layers, batch: int) -> float:
    """Median over REPEATS of one replay's GPU time (us) of a graph that calls every layer once, in order."""
    inputs = [torch.randn(batch, m.in_features, device=m.weight.device, dtype=m.weight.dtype) for m in layers]
    graph, _ = capture_graph(lambda: [m(x) for m, x in zip(layers, inputs)])
    graph.replay()
    times = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SPIN_CYCLES)  # busy while the host records start and launches the first replay
        start.record()
        for _ in range(REPLAYS):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / REPLAYS)
    return statistics.median(times)


def breakdown(layers, batch: int) -> dict[str, float]:
    """{"all", kind or chain: us per step} for one provider's layers."""
    result = {"all": time_graph_us([m for _, m in layers], batch)}
    for kind in KINDS:
        result[kind] = time_graph_us([m for k, m in layers if k == kind], batch)
    for chain, kinds in CHAINS.items():
        result[chain] = time_graph_us([m for k, m in layers if k in kinds], batch)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--variant", nargs="*", default=[], help=f"variants besides 'shipped': {list(variants())[1:]}")
    p.add_argument("--layers", type=int, default=LLAMA3_8B.num_layers)
    args = p.parse_args(argv)
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        print("NO HOPPER GPU: nothing to measure", file=sys.stderr)
        return 2
    table = variants()
    unknown = set(args.variant) - set(table)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; known: {list(table)}")
    config = replace(LLAMA3_8B, num_layers=args.layers)
    torch.manual_seed(0)
    with torch.inference_mode():
        stock = build_layers(config, torch.device("cuda"), torch.bfloat16)
        swapped = [(kind, tma_nn.Linear.from_linear(m)) for kind, m in stock]
        shipped = linear.DEFAULT_OPTIONS
        rows = {}
        try:
            for batch in args.batch:
                rows[("stock", batch)] = breakdown(stock, batch)
                for name in ["shipped", *args.variant]:
                    linear.DEFAULT_OPTIONS = table[name]
                    ops.reset_launches()  # each shape's next call plans its kernel from DEFAULT_OPTIONS
                    rows[(name, batch)] = breakdown(swapped, batch)
        finally:
            linear.DEFAULT_OPTIONS = shipped
            ops.reset_launches()
    print(f"{config.num_layers}-layer Llama-3-8B linear layers, bf16, us per step (per call), median of {REPEATS} x "
          f"{REPLAYS} graph replays: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    calls = {kind: sum(k == kind for k, _ in stock) for kind in KINDS}
    calls.update({chain: sum(calls[k] for k in kinds) for chain, kinds in CHAINS.items()})
    columns = [*KINDS, *CHAINS]
    print(f"{'provider':14s} {'batch':>5s} {'all':>9s} {'sum':>9s} " + " ".join(f"{k:>17s}" for k in columns))
    for (name, batch), r in rows.items():
        cells = " ".join(f"{r[k]:8.1f} ({r[k] / calls[k]:6.2f})" for k in columns)
        print(f"{name:14s} {batch:5d} {r['all']:9.1f} {sum(r[k] for k in KINDS):9.1f} {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
