"""A CuTe DSL kernel that streams a 2-D tensor through a torch_tma descriptor with a chosen L2 promotion.

The kernel sums every element (a checksum): a persistent grid, one producer warp issuing TMA loads into a
ring of shared-memory stages guarded by mbarriers (``cutlass.pipeline.PipelineTmaAsync``), and consumer
warps adding each stage up while the next ones are in flight. The descriptor comes from
``torch_tma.cute.atom_tensor_map``: the map ``make_tiled_tma_atom`` would encode for the same smem layout
and tile, but with the promotion asked for, cached at a stable device address; the kernel turns that
address into a descriptor pointer with ``torch_tma.cute.tma_desc_ptr`` and passes it to ``cute.copy``.

    python examples/tma_stream_reduce.py            # Hopper GPU: checks a 470 MB bf16 tensor, prints GB/s

``benchmarks/bench_promotion.py`` sweeps promotion x box shape x occupancy with this kernel.
"""
from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import torch  # noqa: E402
from cuda.bindings import driver as cuda  # noqa: E402

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import cutlass.pipeline as pipeline  # noqa: E402
from cutlass import Float32, Int32, Int64  # noqa: E402
from cutlass.cute.nvgpu import cpasync, warpgroup  # noqa: E402
from cutlass.cute.runtime import from_dlpack, make_fake_tensor  # noqa: E402
from cutlass.memory import SmemAllocator  # noqa: E402

from torch_tma import L2Promotion  # noqa: E402
from torch_tma.cute import atom_tensor_map, tma_desc_ptr  # noqa: E402

DTYPES = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16, torch.float32: cutlass.Float32}
SWIZZLE_BYTES = {"NONE": None, "B32": 32, "B64": 64, "B128": 128}
LOAD_BYTES = 16          # each consumer thread reads shared memory 16 bytes at a time


@dataclass(frozen=True)
class StreamReduce:
    """One compiled configuration of the checksum kernel.

    box_rows, box_inner_bytes   the TMA box: rows x bytes of the contiguous (last) dim; with a swizzle the inner
                                extent equals the swizzle span (one swizzle atom wide), as TMA requires
    swizzle                     NONE, B32, B64 or B128: the shared-memory layout the atom is built from
    stages                      shared-memory ring depth (one box per stage)
    consumer_warps              warps that add up stages; one more warp issues the loads
    descriptor                  "cached": load through torch_tma's map (any promotion); "atom": through the
                                atom's own descriptor (always 128B), the baseline
    """
    dtype: torch.dtype = torch.bfloat16
    box_rows: int = 64
    box_inner_bytes: int = 256
    swizzle: str = "NONE"
    stages: int = 4
    consumer_warps: int = 4
    descriptor: str = "cached"

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype} is not supported (supported: {', '.join(map(str, DTYPES))})")
        if self.swizzle not in SWIZZLE_BYTES:
            raise ValueError(f"swizzle={self.swizzle!r}, expected one of {', '.join(SWIZZLE_BYTES)}")
        span = SWIZZLE_BYTES[self.swizzle]
        if span is not None and self.box_inner_bytes != span:
            raise ValueError(f"box_inner_bytes={self.box_inner_bytes} must equal the {self.swizzle} swizzle span "
                             f"({span} bytes)")
        if not 16 <= self.box_inner_bytes <= 256 * self.element_size or self.box_inner_bytes % 16:
            raise ValueError(f"box_inner_bytes={self.box_inner_bytes} must be a multiple of 16 in 16.."
                             f"{256 * self.element_size}")
        if not 1 <= self.box_rows <= 256:
            raise ValueError(f"box_rows={self.box_rows} must be in 1..256 (TMA box limit)")
        if self.tile_bytes % (LOAD_BYTES * self.consumer_threads):
            raise ValueError(f"a {self.tile_bytes}-byte box does not split into {LOAD_BYTES}-byte loads over "
                             f"{self.consumer_threads} consumer threads")
        if self.descriptor not in ("cached", "atom"):
            raise ValueError(f"descriptor={self.descriptor!r}, expected 'cached' or 'atom'")

    @property
    def element_size(self) -> int:
        return self.dtype.itemsize

    @property
    def tiler(self) -> tuple[int, int]:
        """The box in elements, torch order (rows, columns)."""
        return self.box_rows, self.box_inner_bytes // self.element_size

    @property
    def tile_bytes(self) -> int:
        return self.box_rows * self.box_inner_bytes

    @property
    def consumer_threads(self) -> int:
        return 32 * self.consumer_warps

    def op(self):
        return cpasync.CopyBulkTensorTileG2SOp()

    def smem_layout(self):
        """(rows, columns, stages), row-major within a stage; swizzled with the DSL's K-major atom when asked."""
        rows, cols = self.tiler
        if self.swizzle == "NONE":
            return cute.make_layout((rows, cols, self.stages), stride=(cols, 1, rows * cols))
        kind = getattr(warpgroup.SmemLayoutAtomKind, f"K_SW{SWIZZLE_BYTES[self.swizzle]}")
        return cute.tile_to_shape(warpgroup.make_smem_layout_atom(kind, DTYPES[self.dtype]),
                                  (rows, cols, self.stages), (0, 1, 2))

    # ---- device code --------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, atom: cute.CopyAtom, tma_tensor: cute.Tensor, desc_address: Int64, partials: cute.Tensor):
        desc = tma_desc_ptr(desc_address)  # top level, every thread: before the warp-role branch
        smem_layout = self.smem_layout()
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())

        smem = SmemAllocator()
        bars = smem.allocate_array(Int64, 2 * self.stages, byte_alignment=8)
        tile_elems = self.tile_bytes // self.element_size
        buf = smem.allocate_array(DTYPES[self.dtype], tile_elems * self.stages, byte_alignment=1024)
        if cutlass.const_expr(self.swizzle == "NONE"):
            stages = cute.make_tensor(buf, smem_layout)
        else:
            stages = cute.make_tensor(cute.recast_ptr(buf, swizzle_=smem_layout.inner, dtype=DTYPES[self.dtype]),
                                      smem_layout.outer)
        ring = pipeline.PipelineTmaAsync.create(
            num_stages=self.stages, producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.consumer_warps),
            tx_count=self.tile_bytes, barrier_storage=bars, tidx=tidx)

        tiles = cute.local_tile(tma_tensor, self.tiler, (None, None))          # (rows, cols, tiles_m, tiles_n)
        stage_s, tile_g = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(stages, 0, 2),
                                                cute.group_modes(tiles, 0, 2))
        tiles_n = cute.size(tiles, mode=[3])
        total = cute.size(tiles, mode=[2]) * tiles_n

        if warp == 0:
            produce = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
            for t in cutlass.range(bid, total, grid, unroll=1):
                ring.producer_acquire(produce)
                if cutlass.const_expr(self.descriptor == "cached"):
                    cute.copy(atom, tile_g[None, t // tiles_n, t % tiles_n], stage_s[None, produce.index],
                              tma_bar_ptr=ring.producer_get_barrier(produce), tma_desc_ptr=desc)
                else:
                    cute.copy(atom, tile_g[None, t // tiles_n, t % tiles_n], stage_s[None, produce.index],
                              tma_bar_ptr=ring.producer_get_barrier(produce))
                produce.advance()
            ring.producer_tail(produce)
        else:
            # The sum does not depend on element order, so consumers read each stage as flat memory,
            # swizzled or not: thread c takes 16-byte vectors c, c + threads, c + 2 threads, ...
            vec = LOAD_BYTES // self.element_size
            per_thread = tile_elems // (vec * self.consumer_threads)
            flat = cute.make_tensor(buf, cute.make_layout(
                (vec, self.consumer_threads, per_thread, self.stages),
                stride=(1, vec, vec * self.consumer_threads, tile_elems)))
            consumer = tidx - 32
            consume = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            total_sum = Float32(0.0)
            for t in cutlass.range(bid, total, grid, unroll=1):
                ring.consumer_wait(consume)
                values = flat[None, consumer, None, consume.index].load().to(Float32)
                total_sum += values.reduce(cute.ReductionOp.ADD, Float32(0.0), reduction_profile=0)
                cute.arch.sync_warp()  # every lane has read the stage before lane 0 releases it
                ring.consumer_release(consume)
                consume.advance()
            partials[bid, consumer] = total_sum

    @cute.jit
    def launch(self, x: cute.Tensor, desc_address: Int64, partials: cute.Tensor, grid: Int32,
               stream: cuda.CUstream):
        layout = self.smem_layout()
        atom, tma_tensor = cpasync.make_tiled_tma_atom(self.op(), x, layout, self.tiler)
        self.kernel(atom, tma_tensor, desc_address, partials).launch(
            grid=[grid, 1, 1], block=[32 * (1 + self.consumer_warps), 1, 1], stream=stream)

    # ---- host ---------------------------------------------------------------------------------------------
    def compile(self, options: str = ""):
        """Compile for sm_90a (no GPU needed) against a fake tensor with dynamic rows, columns and row stride."""
        x = make_fake_tensor(DTYPES[self.dtype], (cute.sym_int(), cute.sym_int()), (cute.sym_int(64), 1),
                             assumed_align=16)
        partials = make_fake_tensor(Float32, (cute.sym_int(), self.consumer_threads), (self.consumer_threads, 1),
                                    assumed_align=16)
        return cute.compile(self.launch, x, Int64(0), partials, Int32(1), cuda.CUstream(0), options=options)

    def check(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor) or x.device.type != "cuda" or x.dim() != 2:
            raise ValueError(f"x must be a 2-D CUDA tensor, got {getattr(x, 'shape', x)!r} on "
                             f"{getattr(x, 'device', None)}")
        if x.dtype != self.dtype:
            raise ValueError(f"x has dtype {x.dtype}, this configuration streams {self.dtype}")
        if x.stride(1) != 1 or (x.stride(0) * x.element_size()) % 16:
            raise ValueError(f"x must have contiguous rows and a row stride that is a multiple of 16 bytes, got "
                             f"strides {x.stride()} ({x.element_size()}-byte elements)")

    def grid(self, x: torch.Tensor, ctas_per_sm: int) -> int:
        tiles = -(-x.shape[0] // self.tiler[0]) * -(-x.shape[1] // self.tiler[1])
        return min(tiles, ctas_per_sm * torch.cuda.get_device_properties(x.device).multi_processor_count)

    def partial_sums(self, x: torch.Tensor, *, l2_promotion: L2Promotion, ctas_per_sm: int = 1,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """Launch on the current stream: float32 partial sums [grid, consumer_threads] whose sum is x's sum.
        ``out`` (from an earlier call with the same grid) avoids an allocation, e.g. inside a CUDA graph."""
        self.check(x)
        grid = self.grid(x, ctas_per_sm)
        if out is None:
            out = torch.empty(grid, self.consumer_threads, dtype=torch.float32, device=x.device)
        # "atom" loads ignore our map, but the kernel takes an address either way
        tmap = atom_tensor_map(self.op(), x, self.smem_layout, self.tiler, l2_promotion=l2_promotion)
        stream = cuda.CUstream(torch.cuda.current_stream(x.device).cuda_stream)
        _compiled(self)(from_dlpack(x, assumed_align=16).mark_layout_dynamic(), Int64(tmap.ptr),
                      from_dlpack(out, assumed_align=16), Int32(grid), stream)
        return out


@functools.lru_cache(maxsize=None)
def _compiled(config: StreamReduce):
    return config.compile()


def tma_stream_reduce(x: torch.Tensor, *, l2_promotion: L2Promotion = L2Promotion.L2_128B,
                      config: StreamReduce = StreamReduce(), ctas_per_sm: int = 1) -> torch.Tensor:
    """The sum of every element of a 2-D CUDA tensor (float64 scalar), streamed through a cached TMA
    descriptor with ``l2_promotion``. Each thread adds in float32; the partial sums are added in float64."""
    return config.partial_sums(x, l2_promotion=l2_promotion, ctas_per_sm=ctas_per_sm).sum(dtype=torch.float64)


def tma_stream_reduce_ref(x: torch.Tensor) -> torch.Tensor:
    return x.double().sum()


def main() -> int:
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        print("tma_stream_reduce needs a Hopper (sm_90) GPU", file=sys.stderr)
        return 2
    # Small integers keep every float32 partial sum exact (below 2^24), so the check is exact equality.
    x = torch.randint(1, 9, (28672, 8192), device="cuda").to(torch.bfloat16)
    ref = tma_stream_reduce_ref(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for promotion in L2Promotion:
        got = tma_stream_reduce(x, l2_promotion=promotion)
        start.record()
        tma_stream_reduce(x, l2_promotion=promotion)
        end.record()
        end.synchronize()
        gbs = x.numel() * x.element_size() / start.elapsed_time(end) / 1e6
        status = "ok" if got.item() == ref.item() else f"WRONG (expected {ref.item()})"
        print(f"{promotion.name:8s} sum {got.item():.0f} {status}  ~{gbs:,.0f} GB/s (one eager call)")
        if status != "ok":
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
