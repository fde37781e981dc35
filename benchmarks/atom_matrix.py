"""Does torch_tma.cute reproduce make_tiled_tma_atom's descriptor? The whole matrix, on a Hopper GPU.

For every cell (rank 2/3; fp16, bf16, fp32, fp8 e4m3; swizzle none/32B/64B/128B from the DSL's own
smem-layout atoms; K-major and MN-major; multicast 1 and 2; box equal to the tensor, tensor below
128 KiB, tensor above 128 KiB) one kernel, on a cluster of ``num_multicast`` CTAs:
  1. copies the atom's own descriptor to global memory (``cpasync.copy_tensormap``);
  2. loads the tensor's last tile (partial where the shape allows, so OOB handling counts) twice into
     poisoned shared memory: through the atom, and through torch_tma's cached descriptor
     (``tma_desc_ptr=``, 256B promotion);
  3. writes both shared-memory buffers out as raw words.
The host decodes the device dump and our descriptor with ``torch_tma.decode`` and compares every field
(promotion aside), compares the DSL's host-side encoding with the device dump byte for byte, and compares
the two buffers byte for byte.

One command on the H200 (hard time budget; each cell runs in a child process so a hung cell is killed
and reported, not fatal):

    source .gpu/env.sh && pip install --no-build-isolation --no-deps -q -e . && \
        timeout -s KILL 240 python benchmarks/atom_matrix.py

Writes tests/data/atom_dumps.json.gz (read by tests/test_cute.py on CPU) and docs/results/atom-matrix.md,
prints a summary; exit status 1 if any cell differs or fails.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gzip
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import torch  # noqa: E402
from cuda.bindings import driver as cuda  # noqa: E402

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Int32, Int64  # noqa: E402
from cutlass.cute.nvgpu import cpasync, warpgroup  # noqa: E402
from cutlass.cute.runtime import from_dlpack, make_fake_tensor  # noqa: E402
from cutlass.memory import SmemAllocator  # noqa: E402

from torch_tma import cute as tma_cute  # noqa: E402
from torch_tma.layout import decode  # noqa: E402
from torch_tma.spec import L2Promotion  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DUMPS = ROOT / "tests" / "data" / "atom_dumps.json.gz"  # gzipped: the device tool carries at most 64 MiB
REPORT = ROOT / "docs" / "results" / "atom-matrix.md"

DTYPES = {"float16": (torch.float16, cutlass.Float16), "bfloat16": (torch.bfloat16, cutlass.BFloat16),
          "float32": (torch.float32, cutlass.Float32), "float8_e4m3fn": (torch.float8_e4m3fn, cutlass.Float8E4M3FN)}
# SmemLayoutAtomKind suffix -> bytes one swizzle atom spans along the contiguous mode (INTER: no swizzle)
SWIZZLE_SPAN = {"INTER": 16, "SW32": 32, "SW64": 64, "SW128": 128}
SIZES = ("equal", "small", "large")      # box == tensor; tensor < 128 KiB; tensor > 128 KiB
THREADS = 128
STAGES = 2                               # rank-2 cells pass a staged smem layout, as kernels do
OTHER_TILE = 64                          # tile extent of the non-contiguous mode
PROMOTION = L2Promotion.L2_256B          # what our map asks for; the atom always encodes 128B
# Different poisons in the two buffers: a word neither load wrote shows as a difference.
POISON_ATOM, POISON_OURS = -0x55555556, 0x55555555   # 0xAAAAAAAA and 0x55555555 as int32 words


@dataclass(frozen=True)
class Config:
    """The compile-time facts of one group of cells (one kernel)."""
    rank: int
    dtype: str
    swizzle: str
    major: str
    num_multicast: int

    @property
    def name(self) -> str:
        return f"r{self.rank}-{self.dtype}-{self.major}-{self.swizzle}-mc{self.num_multicast}"

    @property
    def contiguous_dim(self) -> int:
        """Torch-order index of the tensor's unit-stride dim: the last for K-major, the first for MN-major."""
        return 1 if self.major == "K" else 0

    @property
    def tile(self) -> tuple[int, ...]:
        """CTA tile in torch order: two swizzle atoms along the contiguous dim, 64 along the other, and 2
        along the third (outermost in memory) dim of rank-3 tensors."""
        width = 2 * SWIZZLE_SPAN[self.swizzle] // self.element_size
        tile = (OTHER_TILE, width) if self.major == "K" else (width, OTHER_TILE)
        return tile + ((2,) if self.rank == 3 else ())

    @property
    def element_size(self) -> int:
        return DTYPES[self.dtype][0].itemsize

    def op(self):
        return cpasync.CopyBulkTensorTileG2SOp() if self.num_multicast == 1 else \
            cpasync.CopyBulkTensorTileG2SMulticastOp()

    def smem_layout(self):
        """The DSL's own smem layout atom of this swizzle and major mode, tiled to the CTA tile (plus a
        stage mode for rank 2), the way ``sm90_utils.make_smem_layout_a`` builds one."""
        kind = getattr(warpgroup.SmemLayoutAtomKind, f"{self.major}_{self.swizzle}")
        atom = warpgroup.make_smem_layout_atom(kind, DTYPES[self.dtype][1])
        shape = self.tile + ((STAGES,) if self.rank == 2 else ())
        order = (0, 1, 2) if self.major == "K" else (1, 0, 2)
        return cute.tile_to_shape(atom, shape, order)


def all_configs() -> list[Config]:
    return [Config(r, d, s, m, mc) for r, d, s, m, mc in
            itertools.product((2, 3), DTYPES, SWIZZLE_SPAN, ("K", "MN"), (1, 2))]


def tensor_shape(config: Config, size: str) -> tuple[int, ...]:
    """Torch-order shape of a cell. Sizes not multiples of the tile make the last tile partial."""
    tile = list(config.tile)
    c, o = config.contiguous_dim, 1 - config.contiguous_dim
    if size == "equal":
        return tuple(tile)
    shape = list(tile)
    if config.rank == 3:
        shape[2] = 3
    row_bytes = {"small": 2, "large": 4}[size] * tile[c] * config.element_size
    shape[c] = row_bytes // config.element_size
    depth = shape[2] if config.rank == 3 else 1
    shape[o] = tile[o] + 9 if size == "small" else math.ceil(300 * 1024 / (row_bytes * depth)) + 9
    return tuple(shape)


def make_tensor(config: Config, size: str, device) -> torch.Tensor:
    """Fresh random data in the cell's shape, with the unit stride on the config's contiguous dim and the
    third dim (rank 3) outermost in memory."""
    shape = tensor_shape(config, size)
    order = [2] if config.rank == 3 else []
    order += [1 - config.contiguous_dim, config.contiguous_dim]     # memory order, outermost first
    storage_shape = [shape[d] for d in order]
    torch_dtype = DTYPES[config.dtype][0]
    data = torch.randn(storage_shape, device=device).to(torch_dtype)
    return data.permute([order.index(d) for d in range(config.rank)])


def last_tile(config: Config, tensor: torch.Tensor) -> tuple[int, ...]:
    return tuple(-(-n // t) - 1 for n, t in zip(tensor.shape, config.tile))


# --------------------------------------------------------------------------------------------------
# the device side of one cell


@cute.kernel
def _load_both(atom: cute.CopyAtom, tma_tensor: cute.Tensor, smem_layout: cute.ComposedLayout,
               tiler: cutlass.Constexpr, num_multicast: cutlass.Constexpr, rank: cutlass.Constexpr,
               desc_address: Int64, c0: Int32, c1: Int32, c2: Int32, dump: cute.Tensor, out: cute.Tensor):
    desc = tma_cute.tma_desc_ptr(desc_address)      # top level, every thread, before any branch
    tidx, _, _ = cute.arch.thread_idx()
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    cta = cute.arch.block_idx_in_cluster()

    tile_layout = cute.select(smem_layout.outer, mode=list(range(rank)))
    words = cute.cosize(tile_layout) * atom.value_type.width // 32
    smem = SmemAllocator()
    bars = smem.allocate_array(Int64, 2, byte_alignment=8)
    raw = [smem.allocate_array(Int32, words, byte_alignment=1024) for _ in range(2)]
    bufs = [cute.make_tensor(cute.recast_ptr(r, swizzle_=smem_layout.inner, dtype=atom.value_type), tile_layout)
            for r in raw]
    flat = [cute.make_tensor(r, cute.make_layout(words)) for r in raw]
    for i in range(tidx, words, THREADS):
        flat[0][i] = Int32(POISON_ATOM)
        flat[1][i] = Int32(POISON_OURS)
    cute.arch.fence_view_async_shared()
    if tidx == 0:
        cute.arch.mbarrier_init(bars, 1)
        cute.arch.mbarrier_init(bars + 1, 1)
    if tidx == 0 and cta == 0:
        cpasync.copy_tensormap(atom, dump.iterator)
    cute.arch.mbarrier_init_fence()
    if cutlass.const_expr(num_multicast > 1):
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
    else:
        cute.arch.barrier()

    coord = (c0, c1, c2) if cutlass.const_expr(rank == 3) else (c0, c1)
    gtile = cute.local_tile(tma_tensor, tiler, coord)
    tile_bytes = cute.size(tile_layout) * atom.value_type.width // 8
    parts = [cpasync.tma_partition(atom, cta, cute.make_layout(num_multicast), cute.group_modes(b, 0, rank),
                                   cute.group_modes(gtile, 0, rank)) for b in bufs]
    if warp == 0:
        if tidx == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(bars, tile_bytes)
            cute.arch.mbarrier_arrive_and_expect_tx(bars + 1, tile_bytes)
        if cutlass.const_expr(num_multicast > 1):
            mask = cutlass.Int16((1 << num_multicast) - 1)
            cute.copy(atom, parts[0][1], parts[0][0], tma_bar_ptr=bars, mcast_mask=mask)
            cute.copy(atom, parts[1][1], parts[1][0], tma_bar_ptr=bars + 1, mcast_mask=mask, tma_desc_ptr=desc)
        else:
            cute.copy(atom, parts[0][1], parts[0][0], tma_bar_ptr=bars)
            cute.copy(atom, parts[1][1], parts[1][0], tma_bar_ptr=bars + 1, tma_desc_ptr=desc)
    cute.arch.mbarrier_wait(bars, 0)
    cute.arch.mbarrier_wait(bars + 1, 0)
    for i in range(tidx, words, THREADS):
        out[0, cta, i] = flat[0][i]
        out[1, cta, i] = flat[1][i]
    if cutlass.const_expr(num_multicast > 1):
        cute.arch.cluster_arrive()   # no CTA leaves while a peer's multicast may still target it
        cute.arch.cluster_wait()


@cute.jit
def _launch(x: cute.Tensor, desc_address: Int64, c0: Int32, c1: Int32, c2: Int32, dump: cute.Tensor,
            out: cute.Tensor, stream: cuda.CUstream, config: cutlass.Constexpr):
    layout = config.smem_layout()
    atom, tma_tensor = cpasync.make_tiled_tma_atom(config.op(), x, layout, config.tile, config.num_multicast)
    _load_both(atom, tma_tensor, layout, config.tile, config.num_multicast, config.rank, desc_address,
               c0, c1, c2, dump, out).launch(grid=[config.num_multicast, 1, 1], block=[THREADS, 1, 1],
                                             cluster=[config.num_multicast, 1, 1], stream=stream)


def tile_words(config: Config) -> int:
    return math.prod(config.tile) * config.element_size // 4


def compile_cell_kernel(config: Config, options: str = ""):
    """Compile the cell kernel of one config for sm_90a (works without a GPU); ``options`` as cute.compile's."""
    torch_dtype, dsl_dtype = DTYPES[config.dtype]
    stride = tuple(1 if d == config.contiguous_dim else cute.sym_int(64) for d in range(config.rank))
    x = make_fake_tensor(dsl_dtype, tuple(cute.sym_int() for _ in range(config.rank)), stride, assumed_align=16)
    dump = make_fake_tensor(cutlass.Int64, (16,), (1,), assumed_align=128)
    words = tile_words(config)
    out = make_fake_tensor(Int32, (2, config.num_multicast, words), (config.num_multicast * words, words, 1),
                           assumed_align=16)
    return cute.compile(_launch, x, Int64(0), Int32(0), Int32(0), Int32(0), dump, out, cuda.CUstream(0), config,
                        options=options)


# --------------------------------------------------------------------------------------------------
# one cell on the GPU


def _field_diffs(theirs, ours) -> dict:
    """Fields where two decoded descriptors differ, promotion and address aside."""
    names = ("data_type", "rank", "dims", "strides", "box", "elem_strides", "interleave", "swizzle", "oob_fill")
    return {n: [str(getattr(theirs, n)), str(getattr(ours, n))] for n in names
            if getattr(theirs, n) != getattr(ours, n)}


def load_both(compiled, config: Config, x: torch.Tensor, desc_address: int) -> tuple[bytes, torch.Tensor]:
    """Run the cell kernel on ``x``: returns the atom's own descriptor as dumped on the device (128 bytes, the
    DSL writes the first 64) and the raw words of the last tile loaded through the atom (``[0]``) and through
    the descriptor at ``desc_address`` (``[1]``), per CTA of the cluster."""
    coord = last_tile(config, x) + (0,) * (3 - config.rank)
    dump = torch.zeros(16, dtype=torch.int64, device=x.device)
    out = torch.full((2, config.num_multicast, tile_words(config)), 0x7F7F7F7F, dtype=torch.int32, device=x.device)
    stream = cuda.CUstream(torch.cuda.current_stream(x.device).cuda_stream)
    compiled(from_dlpack(x, assumed_align=16).mark_layout_dynamic(), Int64(desc_address),
             *(Int32(c) for c in coord), from_dlpack(dump, assumed_align=128), from_dlpack(out, assumed_align=16),
             stream)
    torch.cuda.synchronize()
    return dump.cpu().numpy().tobytes(), out


def run_cell(config: Config, size: str, compiled, promotion: L2Promotion = PROMOTION) -> dict:
    x = make_tensor(config, size, "cuda")
    record = {"config": dataclasses.asdict(config), "size": size, "shape": list(x.shape), "stride": list(x.stride()),
              "tensor_bytes": x.numel() * x.element_size(), "address": x.data_ptr(),
              "tile_coord": list(last_tile(config, x))}
    args = (config.op(), x, config.smem_layout, config.tile, config.num_multicast)
    tmap = tma_cute.atom_tensor_map(*args, l2_promotion=promotion)
    host_atom = tma_cute.atom_descriptor(*args)
    device_atom, out = load_both(compiled, config, x, tmap.ptr)
    theirs, ours = decode(device_atom), decode(bytes(tmap.raw))
    differing = int((out[0] != out[1]).sum())
    record.update(
        device_atom=device_atom.hex(), host_atom=host_atom.hex(), ours=bytes(tmap.raw).hex(),
        field_diffs=_field_diffs(theirs, ours),
        promotion={"atom": theirs.l2_promotion.name, "ours": ours.l2_promotion.name},
        host_matches_device=host_atom[:64] == device_atom[:64],
        functional="same" if differing == 0 else f"differs in {differing} of {out[0].numel()} words")
    ok = (not record["field_diffs"] and record["host_matches_device"] and differing == 0
          and ours.l2_promotion == promotion and theirs.l2_promotion == L2Promotion.L2_128B
          and theirs.address == x.data_ptr())
    record["status"] = "ok" if ok else "mismatch"
    return record


def all_cells() -> list[tuple[Config, str]]:
    return [(c, s) for c in all_configs() for s in SIZES]


def worker(cell_ids: list[int], results: Path) -> None:
    """Run cells in order, appending a 'start' line before and the record after each one."""
    cells = all_cells()
    compiled = {}
    with results.open("a") as log:
        for i in cell_ids:
            config, size = cells[i]
            log.write(json.dumps({"start": i}) + "\n")
            log.flush()
            try:
                if config not in compiled:
                    compiled[config] = compile_cell_kernel(config)
                record = run_cell(config, size, compiled[config])
            except Exception as e:  # one failing cell is reported, the rest still run
                record = {"config": dataclasses.asdict(config), "size": size, "status": "error",
                          "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]}
            record["id"] = i
            log.write(json.dumps(record) + "\n")
            log.flush()


# --------------------------------------------------------------------------------------------------
# the parent: children run the cells, a stalled child is killed and its cell reported as hung


def _read_results(path: Path) -> tuple[dict[int, dict], int | None]:
    records, started = {}, None
    if path.exists():
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            if "start" in entry:
                started = entry["start"]
            else:
                records[entry["id"]] = entry
                started = None
    return records, started


def run_matrix(budget_s: float, stall_s: float, results: Path) -> list[dict]:
    cells = all_cells()
    deadline = time.monotonic() + budget_s
    failed: dict[int, dict] = {}

    def fail(i, status, error):
        failed[i] = {"id": i, "config": dataclasses.asdict(cells[i][0]), "size": cells[i][1], "status": status,
                     "error": error}

    while time.monotonic() < deadline:
        records, _ = _read_results(results)
        remaining = [i for i in range(len(cells)) if i not in records and i not in failed]
        if not remaining:
            break
        child = subprocess.Popen([sys.executable, __file__, "--worker", ",".join(map(str, remaining)),
                                  "--results", str(results)])
        last_change, last_size = time.monotonic(), -1
        while child.poll() is None:
            time.sleep(0.5)
            size = results.stat().st_size if results.exists() else 0
            if size != last_size:
                last_change, last_size = time.monotonic(), size
            if time.monotonic() - last_change > stall_s or time.monotonic() > deadline:
                child.kill()
                child.wait()
        records, started = _read_results(results)
        if started is not None and child.returncode < 0:
            fail(started, "hung", f"no progress for {stall_s:.0f} s or time budget spent: child killed")
        elif started is not None:
            fail(started, "error", f"the child process exited with status {child.returncode} in this cell")
        elif child.returncode != 0:
            for i in remaining:
                if i not in records:
                    fail(i, "error", f"the child process exited with status {child.returncode} before this cell")
    records, _ = _read_results(results)
    records.update(failed)
    return [records.get(i) or {"id": i, "config": dataclasses.asdict(cells[i][0]), "size": cells[i][1],
                               "status": "not run", "error": "time budget spent"} for i in range(len(cells))]


def write_outputs(records: list[dict], elapsed: float) -> None:
    from importlib.metadata import version
    meta = {"schema": 1, "generated": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "dsl": version("nvidia-cutlass-dsl"), "promotion": PROMOTION.name,
            "command": "python benchmarks/atom_matrix.py", "elapsed_s": round(elapsed, 1)}
    DUMPS.parent.mkdir(parents=True, exist_ok=True)
    cells = ",\n".join(json.dumps(r, separators=(",", ":")) for r in records)   # one cell per line
    text = json.dumps(meta, indent=1)[:-2] + ',\n "cells": [\n' + cells + "\n]}\n"
    DUMPS.write_bytes(gzip.compress(text.encode(), mtime=0))
    counts = {}
    for r in records:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    lines = [f"# make_tiled_tma_atom vs torch_tma.cute: the descriptor matrix on {meta['gpu']}", "",
             f"{meta['generated']}, nvidia-cutlass-dsl {meta['dsl']}, torch {meta['torch']} (CUDA {meta['cuda']}), "
             f"`{meta['command']}`, {meta['elapsed_s']} s.", "",
             "Per cell: the atom's own descriptor dumped on the device vs torch_tma's cached map (256B promotion), "
             "field by field after `torch_tma.decode` (promotion aside); the DSL's host-side encoding vs the "
             "device dump, byte for byte (bytes 0-63); and the last tile loaded through both into poisoned "
             "shared memory, word for word.", "",
             "Totals: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())), "",
             "| config | size | shape | bytes | fields | host = device | smem bytes | promotion atom / ours | status |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        c = Config(**r["config"])
        promo = r.get("promotion", {})
        fields = "equal" if not r.get("field_diffs") else r["field_diffs"]
        lines.append(f"| {c.name} | {r['size']} | {r.get('shape', '')} | {r.get('tensor_bytes', '')} | {fields} | "
                     f"{r.get('host_matches_device', '')} | {r.get('functional', '')} | "
                     f"{promo.get('atom', '')} / {promo.get('ours', '')} | "
                     f"{r['status']}{': ' + r['error'] if r.get('error') else ''} |")
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=170.0, help="seconds for the whole matrix")
    parser.add_argument("--stall", type=float, default=45.0, help="seconds without progress before a cell is hung")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--results", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker([int(i) for i in args.worker.split(",")], args.results)
        return 0
    if torch.cuda.get_device_capability() != (9, 0):
        print(f"atom_matrix needs a Hopper GPU (sm_90), found {torch.cuda.get_device_name()}", file=sys.stderr)
        return 2
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as scratch:
        records = run_matrix(args.budget, args.stall, Path(scratch) / "cells.jsonl")
    write_outputs(records, time.monotonic() - start)
    bad = [r for r in records if r["status"] != "ok"]
    print(f"atom_matrix: {len(records) - len(bad)}/{len(records)} cells ok in {time.monotonic() - start:.0f} s "
          f"-> {DUMPS.relative_to(ROOT)}, {REPORT.relative_to(ROOT)}")
    for r in bad[:20]:
        why = r.get("error") or r.get("field_diffs") or r.get("functional")
        print(f"  {Config(**r['config']).name} {r['size']}: {r['status']} {why}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
