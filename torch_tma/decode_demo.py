"""Serving demo and benchmark: greedy decoding of a Llama-3-8B-shaped model, stock nn.Linear vs torch_tma.nn.Linear.

The model is built here (Decoder): the module names and shapes of transformers' LlamaForCausalLM (separate
q/k/v/o and gate/up/down projections, lm_head, no biases) with random weights, plain RoPE (theta 5e5, no
Llama-3 frequency scaling: irrelevant with random weights), a static KV cache indexed by a device-side
position so that one decode step is a CUDA graph, and greedy sampling inside that graph. transformers'
own model is not used: its StaticCache and mask APIs change across 4.x/5.x, and this file must also run
on CPU machines that lack it; what torch_tma swaps is the same set of nn.Linear layers either way.

On a Hopper GPU, for each batch size: prefill the prompt (eager), check that the swapped model's logits
are as close to an fp32 copy of the model as the stock model's (teacher-forced on the stock's tokens),
capture one decode step per model, then time replays of the steps (interleaving stock and swapped
repetitions) and, separately, of a graph that runs only the model's linear layers at the same shapes,
which gives their share of a step. Also measured: eager host time per call of the op and of F.linear.
Writes a long-format CSV and a PNG plot and prints a table. Without a Hopper GPU it says so, runs a tiny
model on the CPU for a few steps to show the wiring, and exits non-zero: nothing it prints is a measurement.

    python -m torch_tma decode [--layers 32] [--batch 1 4 16] [--out DIR]
    python -m torch_tma decode --plot DIR/decode.csv    # only redraw the PNG beside a CSV (any machine)
"""

import argparse
import copy
import csv
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from . import nn as tma_nn


@dataclass(frozen=True)
class DecoderConfig:
    """Model shape; sizes in elements."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5


LLAMA3_8B = DecoderConfig(128256, 4096, 14336, 32, 32, 8, 128)
TINY = DecoderConfig(512, 128, 256, 2, 4, 2, 32)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x):
        # In fp32, then back to x's dtype, as LlamaRMSNorm does.
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, c: DecoderConfig, **factory):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False, **factory)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False, **factory)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False, **factory)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False, **factory)

    def forward(self, x, cos, sin, k_cache, v_cache, positions, mask):
        B, T, _ = x.shape
        groups = self.num_heads // self.num_kv_heads  # query heads per kv head: head h reads kv head h // groups
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        # Cache [B, kv heads, max_len, head_dim]; positions on the device keep the step graph-capturable.
        k_cache.index_copy_(2, positions, k)
        v_cache.index_copy_(2, positions, v)
        # A kv head's query heads become rows of one attention problem: no copy of the cache per query head.
        q = q.reshape(B, self.num_kv_heads, groups * T, self.head_dim)
        o = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask.repeat(groups, 1))
        return self.o_proj(o.reshape(B, self.num_heads, T, self.head_dim).transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, c: DecoderConfig, **factory):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False, **factory)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False, **factory)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False, **factory)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: DecoderConfig, **factory):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, **factory)
        self.self_attn = Attention(c, **factory)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, **factory)
        self.mlp = MLP(c, **factory)

    def forward(self, x, cos, sin, k_cache, v_cache, positions, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, positions, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class KVCache:
    """Static keys and values [layers, batch, kv heads, max_len, head_dim] and the positions 0..max_len-1."""

    def __init__(self, c: DecoderConfig, batch: int, max_len: int, device, dtype):
        shape = (c.num_layers, batch, c.num_kv_heads, max_len, c.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.positions = torch.arange(max_len, device=device)


class Decoder(nn.Module):
    """Llama-shaped causal LM over a static KV cache; forward returns the last position's logits [B, vocab]."""

    def __init__(self, c: DecoderConfig, max_positions: int, device=None, dtype=None):
        super().__init__()
        factory = dict(device=device, dtype=dtype)
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, **factory)
        self.layers = nn.ModuleList(DecoderLayer(c, **factory) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, **factory)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False, **factory)
        # RoPE tables stay fp32 whatever the model's dtype; cast at use, as transformers does.
        inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2, device=device, dtype=torch.float32) / c.head_dim)
        angles = torch.outer(torch.arange(max_positions, device=device, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", torch.cat((angles, angles), -1).cos(), persistent=False)
        self.register_buffer("sin", torch.cat((angles, angles), -1).sin(), persistent=False)

    def forward(self, tokens, positions, kv: KVCache):
        """tokens [B, T] at positions [T] (int64, on the model's device) -> logits [B, vocab] of the last one."""
        x = self.embed_tokens(tokens)
        cos, sin = self.cos[positions].to(x.dtype), self.sin[positions].to(x.dtype)
        mask = kv.positions[None, :] <= positions[:, None]  # [T, max_len], True = attend
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv.k[i], kv.v[i], positions, mask)
        return self.lm_head(self.norm(x[:, -1]))


GRAPH_WARMUP = 3  # eager calls of a step before its capture (capture_graph)


def capture_graph(fn, warmup: int = GRAPH_WARMUP):
    """(CUDA graph of fn(), fn's output in the graph's memory) after warm-up on a side stream (which compiles
    the kernels and fills the descriptor cache: a cache miss is not allowed during capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


class GreedySession:
    """Greedy decoding of one prompt batch with static buffers, so that step() can be captured and replayed."""

    def __init__(self, model: Decoder, prompt: torch.Tensor, new_tokens: int):
        batch, self.prompt_len = prompt.shape
        p = next(model.parameters())
        self.model, self.prompt = model, prompt
        self.kv = KVCache(model.config, batch, self.prompt_len + new_tokens, p.device, p.dtype)
        self.tokens = prompt.new_empty(batch, 1)  # the token fed to the next step
        self.pos = prompt.new_empty(1)  # its position
        self.generated = prompt.new_empty(batch, new_tokens + 1)  # [first token from prefill, steps...]
        self.first = None
        self.graph = None
        self.graph_logits = None  # what the graph's step writes its logits into

    def prefill(self) -> torch.Tensor:
        logits = self.model(self.prompt, self.kv.positions[: self.prompt_len], self.kv)
        self.first = logits.argmax(-1, keepdim=True)
        self.reset()
        return logits

    def reset(self) -> None:
        """Back to just after prefill: feed the first generated token at position prompt_len."""
        self.tokens.copy_(self.first)
        self.pos.fill_(self.prompt_len)
        self.generated[:, :1].copy_(self.first)

    def step(self) -> torch.Tensor:
        """One decode step: logits for self.tokens, greedy next token fed back; device-side only."""
        logits = self.model(self.tokens, self.pos, self.kv)
        nxt = logits.argmax(-1, keepdim=True)
        self.generated.index_copy_(1, self.pos - (self.prompt_len - 1), nxt)
        self.tokens.copy_(nxt)
        self.pos.add_(1)
        return logits

    def run_eager(self, steps: int, forced: torch.Tensor | None = None):
        """Prefill then steps-1 eager steps; forced [steps, B] replaces the fed tokens (teacher forcing).

        Returns (tokens [steps, B] the model picked, logits [steps, B, vocab] in float32)."""
        logits = [self.prefill().float()]
        tokens = [self.tokens[:, 0].clone()]
        for s in range(1, steps):
            if forced is not None:
                self.tokens.copy_(forced[s - 1, :, None])
            logits.append(self.step().float())
            tokens.append(self.tokens[:, 0].clone())
        return torch.stack(tokens), torch.stack(logits)

    def capture(self) -> None:
        """Capture step(); its warm-up calls decode from just after prefill, so they stay within new_tokens."""
        self.reset()
        self.graph, self.graph_logits = capture_graph(self.step)
        self.reset()

    def decode(self, steps: int) -> None:
        for _ in range(steps):
            if self.graph is None:
                self.step()
            else:
                self.graph.replay()


def linear_layers(model: nn.Module) -> list[nn.Linear]:
    """The model's linear layers in forward order (module registration order in Decoder)."""
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def linears_only(model: nn.Module, batch: int):
    """A function running every linear layer once on fresh [batch, in_features] inputs: a step's linear work."""
    layers = linear_layers(model)
    p = layers[0].weight
    inputs = [torch.randn(batch, m.in_features, device=p.device, dtype=p.dtype) for m in layers]
    return lambda: [m(x) for m, x in zip(layers, inputs)]


def time_ms(run, reps: int, cuda: bool, setup=None) -> list[float]:
    """Time of run() per repetition in ms: CUDA events when cuda, else host perf_counter."""
    times = []
    for _ in range(reps):
        if setup is not None:
            setup()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            run()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def host_us_per_call(call, calls: int = 200, reps: int = 5) -> float:
    """Median host time per call in us while the GPU is kept busy, so enqueueing never waits on it."""
    results = []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)  # ~25 ms of GPU time at ~2 GHz: longer than the calls take to enqueue
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        results.append((time.perf_counter() - t0) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(results)


def quantiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) == 1:
        return values[0], values[0], values[0]
    q = statistics.quantiles(values, n=10, method="inclusive")
    return q[1], statistics.median(values), q[7]


class Progress:
    """A one-line progress bar on stderr (a line per stage when stderr is not a terminal)."""

    def __init__(self, total: int):
        self.total, self.done, self.tty = total, 0, sys.stderr.isatty()

    def advance(self, label: str) -> None:
        self.done += 1
        bar = "#" * (30 * self.done // self.total)
        end = "\r" if self.tty and self.done < self.total else "\n"
        sys.stderr.write(f"\033[2K[{bar:<30}] {self.done}/{self.total} {label}{end}" if self.tty else
                         f"[{bar:<30}] {self.done}/{self.total} {label}\n")
        sys.stderr.flush()


def logits_error_ratio(ours: torch.Tensor, stock: torch.Tensor, ref: torch.Tensor) -> float:
    """max over steps and rows of ||ours - ref|| / ||stock - ref|| (norms over the vocab).

    The swapped model passes at <= 2: no further from the high-precision reference than twice PyTorch's own
    low-precision error. Norms, not elements: through many layers single elements of the two errors are
    unrelated, while a wrong weight or descriptor moves the whole vector (ratio >> 2)."""
    return ((ours - ref).norm(dim=-1) / (stock - ref).norm(dim=-1)).max().item()


def check_error_ratio(batch: int, ratio: float) -> None:
    """Raise CheckFailed unless the swapped model's logits pass (ratio <= 2; a NaN or inf in them fails)."""
    if not math.isfinite(ratio) or ratio > 2:
        raise CheckFailed(f"batch {batch}: swapped logits are {ratio:.2f}x further from the reference than the "
                          f"stock model's (limit 2): the swapped model computes something else")


def first_divergence(a: torch.Tensor, b: torch.Tensor) -> int:
    """Number of leading positions where the token sequences [B, n] agree in every row."""
    differ = (a != b).any(0).nonzero()
    return a.shape[1] if differ.numel() == 0 else int(differ[0])


class CheckFailed(RuntimeError):
    """The swapped model's logits failed the comparison with the reference."""


@dataclass
class Result:
    provider: str
    batch: int
    step_ms: list[float]
    linear_ms: list[float]
    linear_bytes: int

    @property
    def tokens_per_s(self) -> float:
        return self.batch * 1e3 / statistics.median(self.step_ms)


def run(config: DecoderConfig, batches, prompt_len, new_tokens, reps, check_steps, device, dtype, ref_dtype, seed):
    """Check, then time stock vs swapped for each batch size.

    Returns (results, logits error ratio per batch, agreeing greedy tokens per batch, eager host us per call,
    skipped layers); raises CheckFailed when the swapped model's logits are off."""
    use_graphs = device.type == "cuda"
    progress = Progress(3 * len(batches) + 4 + use_graphs)
    torch.manual_seed(seed)
    model = Decoder(config, prompt_len + new_tokens, device=device, dtype=dtype).eval()
    prompts = {b: torch.randint(config.vocab_size, (b, prompt_len), device=device) for b in batches}
    progress.advance(f"built {config.num_layers}-layer model ({sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params)")

    stock, stock_check = {}, {}
    for b in batches:
        stock[b] = GreedySession(model, prompts[b], new_tokens)
        stock_check[b] = stock[b].run_eager(check_steps)
        if use_graphs:
            stock[b].capture()
        progress.advance(f"stock batch {b}: decoded {check_steps} steps eagerly" + ", captured" * use_graphs)

    # The reference: the same weights in ref_dtype, teacher-forced on the stock model's tokens.
    reference = copy.deepcopy(model).to(ref_dtype)
    ref_logits = {
        b: GreedySession(reference, prompts[b], check_steps).run_eager(check_steps, forced=stock_check[b][0])[1]
        for b in batches
    }
    del reference
    progress.advance(f"{ref_dtype} reference logits")

    stock_linears = {b: linears_only(model, b) for b in batches}
    linear_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linear_layers(model))
    skipped = []
    # The swap is in place. The stock sessions' graphs, captured above, keep the stock layers; without graphs their
    # eager steps would run whatever the model holds, so they keep a model of their own.
    model = tma_nn.swap_linear_(model if use_graphs else copy.deepcopy(model), report=skipped)
    tma_nn.refresh(model)
    progress.advance(f"swapped {len(linear_layers(model)) - len(skipped)} linear layers, {len(skipped)} skipped")

    swapped, checks = {}, {}
    for b in batches:
        swapped[b] = GreedySession(model, prompts[b], new_tokens)
        _, logits = swapped[b].run_eager(check_steps, forced=stock_check[b][0])
        checks[b] = logits_error_ratio(logits, stock_check[b][1], ref_logits[b])
        check_error_ratio(b, checks[b])
        if use_graphs:
            swapped[b].capture()
        progress.advance(f"swapped batch {b}: logits error {checks[b]:.2f}x stock's" + ", captured" * use_graphs)

    results, agreement = [], {}
    for b in batches:
        runs = {}
        for name, linears in (("stock", stock_linears[b]), ("torch_tma", linears_only(model, b))):
            linear_run = capture_graph(linears)[0].replay if use_graphs else linears
            runs[name] = Result(name, b, [], time_ms(linear_run, reps, use_graphs), linear_bytes)
        # Interleaved repetitions, so that drift on a shared machine hits both providers alike.
        for _ in range(reps):
            for name, session in (("stock", stock[b]), ("torch_tma", swapped[b])):
                ms = time_ms(lambda: session.decode(new_tokens), 1, use_graphs, setup=session.reset)[0]
                runs[name].step_ms.append(ms / new_tokens)
        agreement[b] = first_divergence(stock[b].generated, swapped[b].generated)
        results += runs.values()
        progress.advance(f"batch {b}: timed")

    host_us = {}
    if use_graphs:
        host_us = measure_host_overhead(model, device, dtype)
        progress.advance("eager host time per call")
    progress.advance("done")
    return results, checks, agreement, host_us, skipped


def measure_host_overhead(model, device, dtype) -> dict[tuple[str, str], float]:
    """Eager host us per call, M=1 on the model's o_proj weight: {(provider, grad mode): us}."""
    weight = model.layers[0].self_attn.o_proj.weight
    x = torch.randn(1, weight.shape[1], device=device, dtype=dtype)
    out = {}
    for mode, inference in (("inference_mode", True), ("no_grad", False)):
        # no_grad outside inference mode is how transformers' generate() runs: the op's autograd kernel runs too.
        with torch.inference_mode(inference), torch.no_grad():
            out["F.linear", mode] = host_us_per_call(lambda: F.linear(x, weight))
            out["tma.linear", mode] = host_us_per_call(lambda: torch.ops.tma.linear(x, weight))
    return out


def write_csv(path, results, checks, agreement, host_us, device_name):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["benchmark", "provider", "batch", "metric", "p20", "p50", "p80", "unit", "device", "torch"])
        for r in results:
            step = quantiles(r.step_ms)
            linear = quantiles(r.linear_ms)
            rows = [
                ("ms_per_step", step, "ms"),
                ("tokens_per_s", tuple(r.batch * 1e3 / v for v in reversed(step)), "tokens/s"),
                ("linear_ms_per_step", linear, "ms"),
                ("linear_share", tuple(v / step[1] for v in linear), "fraction"),
                ("linear_weight_bandwidth", tuple(r.linear_bytes / v / 1e6 for v in reversed(linear)), "GB/s"),
            ]
            if r.provider == "torch_tma":
                rows += [("logits_error_vs_stock", (checks[r.batch],) * 3, "ratio"),
                         ("greedy_tokens_agreeing", (agreement[r.batch],) * 3, "tokens")]
            for metric, (p20, p50, p80), unit in rows:
                w.writerow(["decode", r.provider, r.batch, metric, f"{p20:.6g}", f"{p50:.6g}", f"{p80:.6g}", unit,
                            device_name, torch.__version__])
        for (provider, mode), us in host_us.items():
            w.writerow(["eager_host_per_call", provider, 1, f"host_us_{mode}", "", f"{us:.4g}", "", "us",
                        device_name, torch.__version__])


def format_table(results, checks, agreement, new_tokens) -> str:
    lines = [f"{'batch':>5} {'provider':<10} {'tokens/s':>10} {'ms/step':>8} {'linear ms':>9} {'linear %':>8} "
             f"{'lin GB/s':>8} {'speedup':>7} {'logits err':>10} {'greedy agree':>12}"]
    base = {r.batch: r for r in results if r.provider == "stock"}
    for r in results:
        step, linear = statistics.median(r.step_ms), statistics.median(r.linear_ms)
        speedup = r.tokens_per_s / base[r.batch].tokens_per_s
        extra = (f"{checks[r.batch]:>9.2f}x {agreement[r.batch]:>5}/{new_tokens + 1:<6}" if r.provider != "stock"
                 else f"{'':>10} {'':>12}")
        lines.append(f"{r.batch:>5} {r.provider:<10} {r.tokens_per_s:>10.1f} {step:>8.3f} {linear:>9.3f} "
                     f"{100 * linear / step:>7.1f}% {r.linear_bytes / linear / 1e6:>8.0f} {speedup:>6.3f}x {extra}")
    return "\n".join(lines)


def results_from_csv(path):
    """(Results, device, torch version) read back from a decode.csv (write_csv): each Result holds its batch's median
    step and linear times, which is what plot and format_table read."""
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["benchmark"] == "decode"]
    if not rows:
        raise ValueError(f"{path}: no decode rows (is it a decode.csv written by python -m torch_tma decode?)")
    medians = {(r["provider"], int(r["batch"]), r["metric"]): float(r["p50"]) for r in rows}
    results = []
    for provider, batch in dict.fromkeys((r["provider"], int(r["batch"])) for r in rows):
        linear_ms = medians[provider, batch, "linear_ms_per_step"]
        linear_bytes = round(medians[provider, batch, "linear_weight_bandwidth"] * 1e6 * linear_ms)
        results.append(Result(provider, batch, [medians[provider, batch, "ms_per_step"]], [linear_ms], linear_bytes))
    return results, rows[0]["device"], rows[0]["torch"]


def plot(path, results, title) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r.batch for r in results})
    fig, (ax_tps, ax_ms) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.38
    for i, provider in enumerate(("stock", "torch_tma")):
        rs = [next(r for r in results if r.provider == provider and r.batch == b) for b in batches]
        xs = [j + (i - 0.5) * width for j in range(len(batches))]
        bars = ax_tps.bar(xs, [r.tokens_per_s for r in rs], width, label=provider)
        if provider == "torch_tma":
            stock = [next(r for r in results if r.provider == "stock" and r.batch == b) for b in batches]
            ax_tps.bar_label(bars, [f"{r.tokens_per_s / s.tokens_per_s:.2f}x" for r, s in zip(rs, stock)], fontsize=8)
        linear = [statistics.median(r.linear_ms) for r in rs]
        other = [statistics.median(r.step_ms) - lin for r, lin in zip(rs, linear)]
        ax_ms.bar(xs, linear, width, label=f"{provider}: linear layers", color=f"C{i}")
        ax_ms.bar(xs, other, width, bottom=linear, label=f"{provider}: rest", color=f"C{i}", alpha=0.4)
    for ax, ylabel in ((ax_tps, "tokens/s"), (ax_ms, "ms per decode step")):
        ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _at_least(low: int):
    """An argparse type: an int of at least low."""
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    parse.__name__ = "int"  # argparse names the type in its message for a non-int
    return parse


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m torch_tma decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=_at_least(1), default=LLAMA3_8B.num_layers,
                   help="decoder layers (Llama-3-8B: 32)")
    p.add_argument("--batch", type=_at_least(1), nargs="+", default=[1, 4, 16])
    p.add_argument("--prompt", type=_at_least(1), default=128, help="prompt tokens")
    p.add_argument("--new-tokens", type=_at_least(GRAPH_WARMUP), default=128,
                   help=f"decode steps timed per repetition (at least {GRAPH_WARMUP}: the graph's warm-up steps)")
    p.add_argument("--reps", type=_at_least(1), default=5, help="timed repetitions per batch and provider")
    p.add_argument("--check-steps", type=_at_least(1), default=8,
                   help="teacher-forced steps compared with the reference (at most --new-tokens are used)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="decode_results", help="folder for decode.csv and decode.png")
    p.add_argument("--plot", metavar="CSV", help="only redraw the PNG beside an existing decode CSV (any machine)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    """Run the demo; returns the exit status (0 only for a measured run on a Hopper GPU that passed its checks)."""
    args = _parse(argv)
    if args.plot:
        results, device_name, torch_version = results_from_csv(args.plot)
        png_path = os.path.splitext(args.plot)[0] + ".png"
        plot(png_path, results, f"greedy decode, Llama-3-8B-shaped model: {device_name}, torch {torch_version} "
                                f"(redrawn from {os.path.basename(args.plot)})")
        print(f"wrote {png_path}")
        return 0
    hopper = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    if hopper:
        device, dtype, ref_dtype = torch.device("cuda"), torch.bfloat16, torch.float32
        config = replace(LLAMA3_8B, num_layers=args.layers)
        device_name = torch.cuda.get_device_name()
        prompt_len, new_tokens, reps = args.prompt, args.new_tokens, args.reps
    else:
        found = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA GPU"
        print(f"NO HOPPER GPU ({found}): the TMA kernel needs sm_90. Running a tiny {TINY.num_layers}-layer model "
              f"on the CPU for a few steps to show the wiring; nothing below is a measurement.", file=sys.stderr)
        device, dtype, ref_dtype = torch.device("cpu"), torch.float32, torch.float64
        config, device_name = TINY, f"CPU ({platform.processor() or platform.machine()})"
        prompt_len, new_tokens, reps = min(args.prompt, 16), min(args.new_tokens, 8), min(args.reps, 2)
    check_steps = min(args.check_steps, new_tokens)

    with torch.inference_mode():
        try:
            results, checks, agreement, host_us, skipped = run(
                config, args.batch, prompt_len, new_tokens, reps, check_steps, device, dtype, ref_dtype, args.seed
            )
        except CheckFailed as e:
            print(f"FAILED: {e}", file=sys.stderr)
            return 1

    title = (f"greedy decode, {config.num_layers}-layer Llama-3-8B-shaped model, {dtype}, prompt {prompt_len}, "
             f"{new_tokens} steps, CUDA graphs: {device_name}, torch {torch.__version__}" if hopper else
             f"tiny {config.num_layers}-layer model on {device_name}: wiring only, not a measurement")
    print(title)
    print(format_table(results, checks, agreement, new_tokens))
    for fqn, reason in skipped:
        print(f"not swapped: {fqn}: {reason}")
    for (provider, mode), us in host_us.items():
        print(f"eager host time per call ({mode}), M=1, {config.hidden_size}x{config.hidden_size}: {provider}: {us:.1f} us")

    os.makedirs(args.out, exist_ok=True)
    csv_path, png_path = os.path.join(args.out, "decode.csv"), os.path.join(args.out, "decode.png")
    write_csv(csv_path, results, checks, agreement, host_us, device_name)
    try:
        plot(png_path, results, title)
    except ImportError:
        print("matplotlib is not installed: no plot written", file=sys.stderr)
        png_path = "(none)"
    print(f"wrote {csv_path} and {png_path}")
    if not hopper:
        print("NO HOPPER GPU: exiting with status 2 (no measurement was made)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
