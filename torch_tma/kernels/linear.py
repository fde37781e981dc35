"""Weight-streaming linear layer for Hopper: y = x W^T (+ b) for small M, W streamed through our descriptor.

At decode sizes (M = 1..64 rows of x) a linear layer is a read of W: 4096x4096 bf16 is 32 MiB against
at most 512 KiB of x and y. The kernel exists to read W at the H200's streaming ceiling (~4.4 TB/s,
shared/reference/h200-baseline.md) through a device-resident descriptor from torch_tma's cache, with
the L2 promotion the caller picked, where cuBLAS leaves 20-40 % on the table at 32-120 MB weights.

How (160 threads per CTA; KernelOptions.consumer_warpgroups=2, a measured alternative, has 288):
- Swapped operands. The wgmma A operand is a 128-row tile of W (two m64 instructions), B is x padded
  to m_pad in {8, 16, 32, 64} rows, so D = W x^T is a 128 x m_pad tile of y^T in registers. TMA
  zero-fills x rows >= M and every row or column past N and K, so ragged edges cost no code.
- Two ways to cut the work (KernelOptions.cluster_split; options_for() picks per shape):
  * Cluster split (wherever the grid fits: cluster_k_for). One thread-block cluster per 128-row tile,
    cluster_k CTAs (up to 8, one CTA per SM, no more than lets every tile's cluster run at once: cluster_capacity)
    each stream an equal share of the tile's K. Shipped (KernelOptions.cluster_scatter), a reduce-scatter: each
    CTA owns an equal share of the tile's outputs and sends the rest of its fp32 partial to their owners with
    st.async, counted in bytes on the owner's mbarrier: into a buffer of its own when small, or in a launch that has
    its SMs alone (KernelOptions.partials_beside) into one in the half of the SM's shared memory its ring leaves (at
    M=64 the ring takes all the partials leave, KernelOptions.ring_fill), else
    into the owner's weight ring once every other CTA has said (remote mbarrier arrive) that it consumed its last
    stage. Each owner
    adds its share's values in rank order (deterministic), adds the bias and writes them. Without it, CTA 0
    receives every partial and writes all of y (cluster_reduce). No global workspace, no atomics: CTA 0's fix-up
    cost ~0.16 us after the last block (benchmarks/trace_linear.py) instead of ~2.5 us.
  * Stream-K (more row tiles than two per SM). The (N / 128) x (K / 64) grid of 16 KiB weight blocks is cut into num_ctas
    equal contiguous runs, one per SM, whatever the shape. A CTA that covered a whole row tile writes y
    directly; one that covered part of a tile writes its fp32 partial to its own workspace slot and adds its
    block count to the tile's arrival counter; the CTA that completes the count sums every partial of the
    tile in CTA order (deterministic), adds the bias, writes y and resets the counter to zero, so the next
    launch, and every CUDA-graph replay, starts from zeros. Nothing ever waits on another CTA.
- Warp 4 only issues TMA loads (W through our descriptor via tma_desc_ptr=, with an L2 evict-first policy since
  it is read once; x through the atom's own descriptor) into a ring of as many stages as half an SM's shared
  memory holds (KernelOptions.smem_share=2, chosen by measurement: see DEFAULT_OPTIONS); warps 0-3 run wgmma,
  release each stage, and do the fix-up and epilogue, so loads keep flowing while a tile is written out (a CTA that
  stores a whole tile's y stages it in its drained ring and writes 16-byte runs: KernelOptions.staged_store). At M=64
  every launch keeps a second stage's wgmma in flight (KernelOptions.wgmma2_min_m_pad), and a launch whose CTAs each
  stream many blocks (KernelOptions.deep_ring_blocks) takes the whole SM's shared memory for the ring: those runs are
  limited by the consumer.
- Programmatic dependent launch: weight blocks are loaded before griddepcontrol.wait, x and every output
  after it, so the start overlaps the previous kernel when that one lets it. A stream-K launch lets the next one
  start as each of its CTAs starts (the grid is one wave). A cluster or one-CTA-per-tile launch lets it start at
  its CTAs' exit, or, where it takes at most three quarters of the SMs (KernelOptions.exclusive_trigger_grid), once
  each CTA's TMA warp has issued its last weight load (not where a CTA streams a long run on the half-SM ring:
  KernelOptions.exclusive_max_blocks); at M <= 16 three loads before the last (KernelOptions.trigger_lead).
  Every cluster or one-CTA-per-tile launch that fits one CTA per SM asks for
  more than half an SM's shared memory, so the next one's CTAs start on the SMs it leaves free and then on each SM
  it gives up, never two to an SM.

Host path per call (linear_out): validate (unsupported_reason) -> launch configuration (_launch_config, cached per
device, dtype, M, N, K and bias) -> compiled kernel (cached, one per static configuration, TVM-FFI) -> launch on
the current torch stream. torch.ops.tma.linear's steady-state calls skip the Python: the native op launches the
kernel it was handed (torch_tma/ops.py, csrc/linear_op.cpp).
"""

import functools
import math
from typing import NamedTuple, Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
import torch
from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import nvvm
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from ..cache import long_lived_empty
from ..cute import l2_evict_first_policy, l2_evict_last_policy, prefetch_tma_desc, tma_desc_ptr
from ..spec import L2Promotion, Swizzle

__all__ = [
    "CROSSOVER_M",
    "DEFAULT_L2_PROMOTION",
    "MEASURED_L2_PROMOTION",
    "default_l2_promotion",
    "l2_promotion_for",
    "linear_out",
    "linear_ref",
    "unsupported_reason",
    "weight_box",
    "weight_swizzle",
]

TILE_N = 128  # weight rows per tile: the wgmma M side, two m64 instructions
TILE_K = 64  # K elements per pipeline stage: 128 bytes of a 2-byte dtype, the 128B swizzle span
M_PADS = (8, 16, 32, 64)  # wgmma N sizes compiled; M is padded up to the next one
# Warps 0-3: one warpgroup for wgmma, fix-up and epilogue; warp 4 issues every TMA load (KernelOptions.mma_threads,
# producer_warp and threads: twice the MMA warps with consumer_warpgroups=2).
MMA_THREADS = 128
THREADS = MMA_THREADS + 32  # the one-warpgroup block; the occupancy probe's (shared memory decides its count)
# sm_90 allows 227 KiB of dynamic shared memory per block; 2 KiB stay for the mbarriers, the arrival
# flag and the 1 KiB alignment of the two swizzled buffers.
SMEM_BYTES = 227 * 1024
SMEM_RESERVED = 2 * 1024
# Shared memory of one SM, split between co-resident CTAs; the driver keeps 1 KiB of it per CTA.
SMEM_PER_SM = 228 * 1024
SMEM_PER_CTA_SYSTEM = 1024
# What a KernelOptions.exclusive_sm launch asks for at least: two such CTAs and their system shares overflow an SM.
EXCLUSIVE_SMEM_BYTES = SMEM_PER_SM // 2
MAX_CLUSTER_K = 8  # most CTAs one row tile is split across in a cluster-split build (the portable cluster size)
# A cluster's CTA 0 receives cluster_k - 1 fp32 partials of 128 x m_pad (cluster_reduce; with cluster_scatter each CTA
# receives less, and the same rule sizes its buffer). Up to this many bytes they get a buffer of their own beside the
# ring (what was measured at M <= 16, cluster_k <= 4); larger ones land in the receiver's ring once it has consumed its
# last stage, so they cost no stages (KernelOptions.own_partial_bytes). A launch alone on its SMs keeps either kind in
# the half of the SM its ring leaves instead (KernelOptions.partials_beside, beside_small).
OWN_PARTIAL_BYTES = 24 * 1024
MAX_ROW_TILES = 1 << 16  # arrival counters per workspace: N up to 8,388,608 rows
ARRIVAL_WORDS = MAX_ROW_TILES
FIXUP_BARRIER = 1  # named barrier of the MMA threads (0 is __syncthreads)
# KernelOptions.staged_store: y of a row tile staged in shared memory as m_pad rows of the tile's 128 outputs, each row
# padded by 16 bytes, so that the 4 x rows one warp's writes touch at once start 8 banks apart (no bank conflicts)
STAGE_PITCH = TILE_N + 8
# Columns of the KernelOptions.trace buffer, one row per CTA. gt_*: %globaltimer (ns, one clock for the GPU);
# clk_*: clock64 of the CTA's SM (cycles; comparable only within a row).
TRACE_FIELDS = (
    "gt_start",  # thread 0 at kernel entry
    "gt_end",  # thread 0 after its last epilogue or fix-up
    "clk_start",  # thread 0 at kernel entry
    "clk_first_issue",  # TMA warp: first weight block issued (descriptor fence done)
    "clk_wait_done",  # TMA warp: griddepcontrol.wait returned (= clk_first_issue's neighbour without PDL)
    "clk_first_ready",  # thread 0: first stage's bytes have landed
    "clk_last_release",  # thread 0: last stage of the run consumed (its wgmma done)
    "clk_end",  # thread 0 after its last epilogue or fix-up
    "clk_fixup_start",  # thread 0: the last fix-up sum this CTA started (0: none)
    "fixups",  # tiles this CTA summed as the last arriver (cluster split: 1 in a CTA that sums a share, every
    # CTA with cluster_scatter where the tile's outputs are more pieces than CTAs, else CTA 0)
    "sm",  # %smid of the SM the CTA ran on
    "pre_wait_loads",  # weight blocks the TMA warp asked for before griddepcontrol.wait
    "clk_sent",  # thread 0: its cluster split's partial pieces sent to the other CTAs (0: no cluster split)
)

_DTYPES = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}
_CLUSTER_SCOPE = nvvm.MemScopeKind.CLUSTER  # a remote mbarrier arrive that releases at cluster scope

# Weight descriptor L2 promotion where a call names none. benchmarks/bench_linear.py sweeps NONE/64B/128B/256B
# (timed in turns) at M in {1, 16, 64} on 7 shapes; this follows the measurement. On the H200, 256B was never faster
# than 128B (up to 6.4 % slower in stop 26's grid, docs/results/linear-h200-before-staged-store.log; 7.0 % in stop
# 35's, linear-h200-stop35.log; 6.9 % in stop 41's, linear-h200.log), and NONE and 64B were within 0.7 % of it (0.8 %;
# 0.9 % in stop 41's): 128B. GPU models whose grids found otherwise are in MEASURED_L2_PROMOTION.
DEFAULT_L2_PROMOTION = L2Promotion.L2_128B

# GPU model (torch.cuda.get_device_name) -> (weight bytes from which, promotion): where that model's grids found
# another promotion faster on weights of that size. NVIDIA H100 80GB HBM3: against 128B, 256B was faster in all 45
# cells on weights of 100 MB and more in three grids (docs/results/linear-h100-stop31.log, linear-h100-stop33-128b.log,
# linear-h100-stop33.log; by 0.05-3.6 %); on 4096x4096 and 6144x4096 (34 and 50 MB) it went either way (2.1 % slower
# to 2.8 % faster; faster in 4, 1 and 5 of the 6 cells).
MEASURED_L2_PROMOTION = {"NVIDIA H100 80GB HBM3": (100_000_000, L2Promotion.L2_256B)}


def l2_promotion_for(device_name: str, weight_bytes: int) -> L2Promotion:
    """The weight descriptor's promotion for a call that names none: MEASURED_L2_PROMOTION where the GPU model is
    listed and the weight is large enough, else DEFAULT_L2_PROMOTION."""
    from_bytes, promotion = MEASURED_L2_PROMOTION.get(device_name, (0, DEFAULT_L2_PROMOTION))
    return promotion if weight_bytes >= from_bytes else DEFAULT_L2_PROMOTION


def default_l2_promotion(device_index: int, N: int, K: int, dtype: torch.dtype) -> L2Promotion:
    """l2_promotion_for() of this device's model and an [N, K] weight of dtype."""
    return l2_promotion_for(torch.cuda.get_device_name(device_index), N * K * dtype.itemsize)


# Largest M at which this kernel is used, per weight-size class: (upper bound of N*K*element bytes,
# max M); above it the op falls back to cuBLAS. From benchmarks/sweep_linear.py on the H200, kernel vs cuBLAS, back
# to back and in situ. Runs 4 and 5 (2026-12-03, docs/results/sweep-linear-h200-run{4,5}.*, the cluster split at every
# M) put M=32 at 0.90-0.99x under 64 MB and 0.97-1.17x above, M=64 at 0.66-1.06x. With the weight loaded evict-first
# (runs 11-13 and the grids docs/results/linear-h200-before-staged-store.csv and -before-full-crossover.csv), M=32 was
# 1.04-1.07x on 4096x4096 and 1.00-1.05x on 6144x4096 (32 and 48 MB); 1024x4096 (8 MB) stayed 0.98x in situ.
CROSSOVER_M = (
    (16 << 20, 16),
    (math.inf, 32),
)
# ... and M=64 (the largest tile) from FULL_CROSSOVER_BYTES of weight where the kernel's M=64 launch is a cluster-split
# or one-CTA-per-row-tile build on at least FULL_CROSSOVER_SMS of the SMs (crossover_m). Sweep runs 11-13 at M=64,
# kernel vs cuBLAS back to back / in situ: 14336x4096 (112 CTAs) 1.05-1.06x / 1.07-1.08x, 4096x14336 (96) 1.03-1.04x /
# 1.04-1.05x, 28672x4096 (224) 1.03-1.04x / 1.04-1.05x, 8192x28672 (128) 1.11x / 1.07-1.11x; but 10240x8192 (80 CTAs,
# 61 % of the SMs) 0.85-0.87x / 0.87-0.88x, 57344x8192 (stream-K) 0.96-0.97x / 0.94-0.96x, and under 64 MB 0.72-0.96x.
FULL_CROSSOVER_BYTES = 64 << 20
FULL_CROSSOVER_SMS = 0.7


class KernelOptions(NamedTuple):
    """Static launch and synchronisation choices of the kernel; part of the compile cache key.

    fence_scope: scope of the descriptor acquire fence, "sys" (the guide's rule for host-written tensor
        maps) or "gpu" (torch_tma writes slots with stream-ordered copies that finish before the launch).
    pdl: programmatic dependent launch. The kernel is launched with programmatic stream serialisation,
        every CTA triggers its dependents as it starts (the grid is one wave, so a dependent CTA only
        takes an SM this grid has left), and nothing reads x or writes out, partials or arrivals before
        griddepcontrol.wait, so barrier init, the descriptor fence and (below) weight loads overlap the
        previous kernel's tail.
    early_trigger: with pdl, trigger the dependent launch as each CTA starts (above); False leaves the trigger to
        the CTAs' exit, so the next launch is staged but none of its CTAs shares an SM with this one.
    load_trigger: with pdl and early_trigger False, the TMA warp triggers the dependent launch as soon as it has issued
        its run's last weight load, instead of leaving it to the CTA's exit: the next launch's CTAs start (on free
        SMs, or in the second shared-memory slot of this launch's) while this launch streams its last stages, and
        (weight_before_wait) load their own weight. A trigger is once per CTA, whichever thread issues it first (PTX
        griddepcontrol). Static; options_for() sets it from load_trigger_grid.
    load_trigger_grid: the load_trigger policy: options_for() turns load_trigger on for cluster-split builds (and one
        CTA per row tile) whose grid is at most this share of the SMs (0: never; 1: all of them). The next launch's
        CTAs take the SMs this one leaves free; where there are too few, the GPU places two CTAs of that launch on
        one SM (benchmarks/trace_linear.py: 4096x4096 after itself ran on 80 SMs, 16 of them holding two CTAs).
    exclusive_trigger_grid: a policy beside load_trigger_grid: options_for() gives every cluster-split (or one CTA
        per row tile) build whose grid is at most this share of the SMs load_trigger (0: never; 1: wherever the grid
        fits one CTA per SM), except a build on a ring of a share of the SM (smem_share > 1) whose CTAs each stream
        exclusive_max_blocks or more blocks; and, when it is above 0, every such build whose grid fits one CTA per SM
        exclusive_sm. The next launch's CTAs then start on the SMs this one leaves free and on each of its SMs as its
        CTA there exits, never beside it, so none of them shares an SM with another of its own launch (a launch that
        triggers at exit asks for its SMs alone too: behind one that triggers early, it would otherwise put two of
        its CTAs on some of the free SMs, docs/linear.md). The overlap takes back the gap between launches and the next
        launch's ramp, and lengthens the overlapped streams (benchmarks/trace_linear.py: net 1.2-1.4 us per call at
        4096x4096, none at 4096x14336 or 6144x4096 M=1). Shipped at 0.75: on an H200 the launches of up to 96 CTAs
        gained in the sweeps' geomean (6144x4096 lost 1-4 % at M 1-2), those of 112 and 128 CTAs lost at most M, and
        so did the long half-ring run of 10240x8192 at M=32 (docs/linear.md).
    trigger_lead: with load_trigger, the TMA warp triggers the dependent launch once it has issued the load trigger_lead
        blocks before its run's last one (0: after the last; a run whose ring-filling loads, issued before
        griddepcontrol.wait, reach that point triggers after its last load). The next launch's CTAs start earlier on the
        free SMs and load their weight beside this launch's last stages. options_for() keeps it only where load_trigger
        is on and M pads to at most trigger_lead_max_m_pad (0 elsewhere). Shipped at 3 for M <= 16: sweep run 21
        (docs/linear.md), back to back, 4096x4096 M=1 took 8.94 against 9.56 us and 6144x4096 M=1 13.62 against
        14.49 us; at M 32-64 it lost (6144x4096 M=32 14.85 against 14.68 us).
    trigger_lead_max_m_pad: the bound of trigger_lead's policy above, one of M_PADS.
    cluster_scatter: in a cluster-split build, every CTA sums and stores a share of the row tile's outputs (a
        reduce-scatter) instead of CTA 0 receiving every partial and storing all of them: each CTA receives
        (cluster_k - 1) / cluster_k of a partial rather than CTA 0 cluster_k - 1 whole ones, and the sums and y
        stores are spread over the cluster. The same additions in the same (rank) order, so the same results.
        Shipped: sweep run 24 (docs/linear.md), geomean 1.198x against 1.185x back to back and 1.071x against 1.051x
        in situ over 25 cells; 1024x4096 M=32 4.39 against 5.46 us; it lost 6144x4096 M=32 back to back (15.05
        against 14.32 us).
    scatter_last_max_m_pad: in a cluster_scatter build whose M pads to at most this (one of M_PADS; 0: none), the
        cluster's last rank owns every piece of the tile's outputs instead of equal shares: rank r streams blocks
        r * k_blocks // cluster_k up to (r + 1) * k_blocks // cluster_k, so the last rank streams the most (4096x4096
        on an H200: 22 blocks against 21) and ends its run last, and with equal shares the other owners wait for its
        partial to cross the cluster (trace runs 12 and 26: at M=1 rank 1's tail 0.64-0.75 us against rank 2's
        0.30-0.35). Owning all of them, it finds the others' partials already landed. The same additions in the same
        rank order, so the same results. Not shipped: sweep run 51 (an H100, docs/linear.md) at 16 won back to back
        (geomean 1.259x against 1.252x over 20 cells; 4096x4096 M=16 11.71 against 11.93 us) and lost in situ (1.101x
        against 1.112x; 1024x4096 M=16, 8 CTAs per tile, 6.31 against 5.34 us). In sweep run 24, CTA 0 summing and
        storing every output (cluster_reduce) took 8.76 / 8.91 / 9.30 us at 4096x4096 M=1 / 8 / 16 back to back against
        the equal cut's 8.81 / 8.92 / 9.40 (in situ at M=16 11.29 against 11.04).
    own_partial_bytes: a cluster-split build receives its partials in a buffer of their own beside the ring up to
        this many bytes ((cluster_k - 1) fp32 tiles of 128 x m_pad, the same rule with cluster_scatter), and in the
        receiver's drained weight ring above it (partials_in_ring): a buffer of its own lets a CTA send as soon as it
        is done, the ring costs no stages but makes every sender wait until the cluster's slowest CTA has drained
        its ring. Shipped at OWN_PARTIAL_BYTES (24 KiB); 0 puts every cluster build's partials in the ring (at M=16
        with 3 CTAs per tile: 6 stages of the half-SM ring instead of 5). Sweep run 25: 0 lost at M <= 16
        (4096x4096 M=1 9.40 against 8.82 us, M=16 9.84 against 9.49 us), not shipped.
    partials_beside: a policy for cluster-split builds that take their SMs alone (exclusive_sm) on a share of the SM
        (smem_share > 1) and whose partials would land in the drained ring (above own_partial_bytes): their buffer
        of their own goes in the SM's other share, which exclusive_sm keeps from other CTAs anyway, so the ring keeps
        its depth and no sender waits for the cluster's slowest CTA to drain its ring (partials_beside_ring).
        options_for() keeps it only where it applies and the ring, the partials and SMEM_RESERVED fit in SMEM_BYTES.
        Shipped: sweep run 26 (docs/linear.md), geomean 1.223x against 1.201x back to back and 1.099x against 1.073x
        in situ over 25 cells; 4096x4096 M=64 10.80 against 11.39 us, 4096x14336 M=64 31.06 against 31.64 us,
        1024x4096 M=1 3.71 against 4.02 us (its 8 CTAs per tile need a 28 KiB partials buffer at M=1, above
        own_partial_bytes). Sweep run 25: every cluster
        build's partials in the ring (own_partial_bytes=0) lengthened 4096x4096 M=1 from 8.82 to 9.40 us, the CTAs'
        median tail from 0.31 to 0.97 us (trace run 12): the handshake this avoids.
    beside_small: with partials_beside, partials of at most own_partial_bytes move out of the ring's share too, so
        the ring gains the stages their buffer took (m_pad 16 with 2 or 3 CTAs per tile: 6 stages instead of 5; m_pad
        32 with 2: 5 instead of 4). Shipped: sweep run 27 (docs/linear.md), geomean 1.147x against 1.142x back to
        back and 1.086x against 1.081x in situ over 12 cells; 6144x4096 M=32 15.19 against 15.91 us in situ,
        8192x28672 M=32 106.75 against 108.00 us back to back; it lost 4096x14336 M=16 back to back (29.52 against
        29.31 us) and M=32 in situ (31.14 against 30.84 us).
    ring_fill: with partials_beside (a cluster build alone on its SMs, its partials in a buffer of their own), the ring
        takes all the shared memory the partials leave instead of half the SM's: at M=64 with 3 CTAs per tile 6 stages
        instead of 4, at M=16 11 instead of 6 (ring_stages). options_for() keeps it where M pads to at least
        ring_fill_min_m_pad and the partials lie beside the ring (ring_stages itself does not look at the bound: an
        unresolved build fills at any m_pad). Shipped for m_pad 64 (ring_fill_min_m_pad=64; M 33-64, timed at M=64): sweep
        run 32 (docs/linear.md), 4096x4096 M=64 10.42 against 10.95 us back to back and 12.34 against 12.63 in situ,
        4096x14336 M=64 31.10 against 31.66 and 32.66 against 33.56; at M <= 32 it won 9 of 12 cells back to back
        (6144x4096 M=16 12.70 against 14.03 us) and lost all 12 in situ (4096x14336 M=16 33.60 against 30.90 us),
        for reasons not established (docs/linear.md).
    ring_fill_min_m_pad: the bound of ring_fill's policy above, one of M_PADS.
    exclusive_max_blocks: the bound of exclusive_trigger_grid's exception above, in 64-column weight blocks per CTA
        (0: none). Shipped at 100, deep_ring_blocks' value: the runs long enough for the deep ring at M=64.
    exclusive_sm: the launch asks for more than half an SM's shared memory (EXCLUSIVE_SMEM_BYTES) whatever its ring
        uses, so no second CTA of this kernel fits on an SM beside one of its CTAs. The ring keeps its smem_share
        depth. Static; options_for() sets it from exclusive_trigger_grid (stream-K builds, whose trigger at CTA start
        is meant to let the next launch in beside them, never get it).
    weight_before_wait: with pdl, the TMA warp fills the ring with weight blocks before
        griddepcontrol.wait and adds the x blocks after it. Valid only when the kernel just before this
        one in the stream does not write the weight (decode: weights are constant).
    ctas_per_sm: CTAs of one launch per SM. The grid is grid_size(...) CTAs and the workspace must hold
        2 partial tiles per CTA.
    smem_share: the SM's shared memory is cut into max(ctas_per_sm, smem_share) equal shares and a CTA's
        ring fills one. With ctas_per_sm=1 and smem_share=2 a CTA of the next launch fits beside this one
        on every SM (ncu: shared-memory occupancy limit 2), at the cost of a ring half as deep. Measured
        gain (DEFAULT_OPTIONS): after a foreign kernel, not on back-to-back launches of this one; why is
        not established.
    cluster_split: where a shape allows it (cluster_k_for), split K inside a thread-block cluster instead of
        stream-K: one cluster of cluster_k CTAs per row tile, each CTA streams 1/cluster_k of the tile's K, and
        the partials are summed in the first CTA's shared memory (distributed shared memory) instead of through
        global memory. The value is the CTAs per SM the clusters may take (1 or 2; 2 needs smem_slots >= 2);
        0 keeps stream-K everywhere. A policy: options_for() turns it into cluster_k for one shape.
    cluster_k: CTAs per cluster (and per row tile) of a cluster-split build, 1..MAX_CLUSTER_K; 0 = stream-K.
        Static: part of the compiled kernel. Set by options_for(), not by hand.
    cluster_max_k, cluster_max_m_pad: bounds of the cluster_split policy (cluster_k_for): at most cluster_max_k CTAs
        per row tile, and stream-K for M padded above cluster_max_m_pad. (4, 16) is the policy measured first.
    cluster_fit: with cluster_split=1 (refused with 2), lower cluster_k until the GPU runs every row tile's cluster
        at once with one CTA per SM (cluster_capacity: clusters live inside one GPC, so an H200 places 30 clusters of
        4 that way, not 33). False keeps sm_count // row tiles: 32 row tiles then get clusters of 4, and 8 SMs run
        two CTAs.
    deep_ring_blocks: the deep-ring policy: options_for() gives a build of the largest m_pad (64) whose CTAs each stream
        at least this many 64-column weight blocks the whole SM's shared memory for the ring (smem_share=1) and a
        second stage's wgmma in flight (wgmma_in_flight=2), where that leaves the launch's decomposition (cluster_k
        and grid) as it was; 0: never. At M=64 a long run is limited by the consumer, not by DRAM: with 4 stages and
        each stage's wgmma waited for, 10240x8192's CTAs streamed for 42.5-43.9 us back to back (benchmarks/
        trace_linear.py, runs 8 and 9), with 9 stages and two in flight 34.3 us (run 8), while the deeper ring lands
        the first stage ~1.5 us later.
    deep_ring_tile_blocks: the deep-ring policy's bound for launches of one CTA per row tile (cluster_k 1), where
        it is not 0 (0: deep_ring_blocks for them too). Not shipped: its H200 sweep is still to run. Sweep run 50 (an
        H100, docs/linear.md): the deep ring from 64 blocks took 14336x4096 M=64 (112 CTAs, 64 blocks each, 4 stages
        on the half ring) to 40.20 against 40.91 us back to back and 40.18 against 40.83 in situ; for every launch
        (deep_ring_blocks=64) it lost 4096x14336 M=64 (3 CTAs per tile, 74-75 blocks: 42.00 against 39.86 us back to
        back), which this bound leaves on the half ring.
    consumer_warpgroups: warpgroups that run wgmma, 1 or 2. With 2, each takes 64 of a tile's 128 weight rows (one
        m64 wgmma per k step instead of two), both read the same x stage, and a stage is free once both have read
        it; the fix-up and y stores of a tile are split between them the same way. 2 * 128 + 32 threads per CTA.
    wgmma_in_flight: stages whose wgmma may be running at once. 1: wait for a stage's wgmma, release the stage,
        then wait for the next one. 2: issue the next stage's wgmma before waiting for the previous one (released
        one stage late), so the tensor cores never wait for the warpgroup's round trip.
    wgmma2_min_m_pad: the two-in-flight policy: options_for() gives every build whose M pads to at least this (one of
        M_PADS) wgmma_in_flight=2 on whatever ring it has; 0: none (the deep-ring policy still gives it to its
        builds). Shipped at 64 (M 33-64): sweep runs 45-47 on an H100 (docs/linear.md), 4096x14336 M=64 40.70-40.93
        against 41.57-41.66 us back to back and 42.36-42.98 against 43.86-44.16 us in situ, 1024x4096 M=64 6.09
        against 7.27 us; the other M=64 cells within 0.4 % back to back, and 3.5-4.0 % faster in situ at 4096x4096 and
        6144x4096; at M=32 it lost (1024x4096 4.71 against 4.47 us, 10240x8192 59.22 against 58.14 us). Run 48, at M=33
        and 64 on 7 shapes: geomean 1.113x against 1.083x back to back, 1.038x against 1.002x in situ; it lost
        6144x4096 M=64 (19.09 against 18.87 us) and 4096x4096 M=33 (13.66 against 13.53 us) back to back. On an H200
        (run 49, the same cells): 1.068x against 1.038x back to back, 0.994x against 0.961x in situ (1024x4096 M=64
        6.11 against 7.69 us); it lost 14336x4096 M=64 both ways (32.14 against 30.67 us back to back, 32.30 against
        30.91 in situ), 6144x4096 M=33-64 back to back (15.50 against 15.23 us at M=64) and, by 0.3-1.1 %, 28672x4096
        and 14336x4096 at M=33 and 4096x4096 M=33 back to back.
    descriptor_prefetch: "": the TMA warp acquires the weight descriptor just before its first load, and the TMA unit
        fetches it then. "entry" (shipped): the TMA warp also issues prefetch.tensormap at kernel entry, before the
        barriers are set up, so the fetch overlaps the set-up; "entry-acquired": the fence and then the prefetch at
        entry (prefetch_tma_desc). Either way the loads acquire it again.
    weight_descriptor: "cache" (what the op ships): the weight is loaded through torch_tma's device-resident descriptor
        at weight_map, acquired with the fence above. "param": a measurement build that loads it through the TMA
        atom's own descriptor, which CuTe DSL passes as a kernel parameter (fixed 128B promotion, built on the host at
        every launch and frozen into a CUDA graph at capture, so a refresh cannot reach it); no fence and no
        descriptor_prefetch (there is no slot to fetch). What the
        device-resident descriptor costs on the GPU is the difference (benchmarks/sweep_linear.py).
    relaxed_cluster_arrive: in a cluster-split build, each thread's arrive on the cluster barrier at kernel entry is
        barrier.cluster.arrive.relaxed (shipped) instead of the release form. What it announces (the CTA's mbarriers
        are initialised) is released to the cluster by fence.mbarrier_init, so the release form only delays the
        start: the first weight load went out ~0.25 us later with it (benchmarks/trace_linear.py).
    weight_eviction: the L2 eviction priority the weight loads carry (their TMA cache hint, a createpolicy value):
        "normal" (no hint beyond the default) or "first": the streamed weight, read once per call, is the first
        thing L2 evicts, so the small tensors a model step rereads (activations, norms, the KV cache) stay.
    x_eviction: the L2 eviction priority the x loads carry: "normal" (no hint) or "last": x, which every row tile's
        CTAs reread from L2 (at M=64 half as many bytes as the weight), is the last thing L2 evicts while the weight
        streams past it.
    staged_store: a build of one CTA per row tile (cluster_k 1) writes its y through shared memory: every MMA thread
        puts its values (bias added, converted) into a staging area at the start of its drained weight ring, laid out
        as y's rows (STAGE_PITCH), and the threads then store whole 16-byte runs of 8 outputs, coalesced, where y's
        rows are 16-byte aligned (else one output at a time, as without it). Without it each thread stores its values
        one 2-byte output at a time, 8 outputs of a row per warp instruction: 1.14 us from the last wgmma to the CTA's
        end at 10240x8192 M=64 (64 values per thread), 0.69 us with it (trace run 25, an H100); sweep runs 40-41
        (H100): up to 1.7 % faster at M 32-64 on 28672x4096 and 10240x8192, within 0.7 % at M <= 16 (docs/linear.md).
        Cluster builds keep the direct stores: each CTA stores 1 / cluster_k of the tile, and staging it made their
        sum and stores longer (0.35 -> 0.42 us at 4096x4096 M=64, trace run 24). Stream-K builds (a CTA's run can go
        on to the next tile while the ring refills) keep them too.
    late_first_cta_ns: a test build: in a cluster-split build, CTA 0 of each cluster spins this many nanoseconds
        (on %globaltimer) after its last wgmma, before it says its ring is drained or waits for the partials, so
        the other CTAs reach their waits before CTA 0 arrives (tests/test_linear_kernel.py). 0 in shipped builds.
    trace: a measurement build. The kernel takes one more tensor, int64 [num_ctas, TRACE_FIELDS], and each CTA
        writes its timeline there (TRACE_FIELDS names the columns): %globaltimer at its start and end, SM clock
        (clock64) at each phase. Results are the same; benchmarks/trace_linear.py reads it.
    """

    fence_scope: str = "sys"
    pdl: bool = False
    weight_before_wait: bool = False
    ctas_per_sm: int = 1
    smem_share: int = 1
    early_trigger: bool = True
    load_trigger: bool = False
    load_trigger_grid: float = 0.0
    exclusive_trigger_grid: float = 0.0
    exclusive_max_blocks: int = 0
    trigger_lead: int = 0
    trigger_lead_max_m_pad: int = M_PADS[-1]
    cluster_scatter: bool = False
    scatter_last_max_m_pad: int = 0
    own_partial_bytes: int = OWN_PARTIAL_BYTES
    partials_beside: bool = False
    beside_small: bool = False
    ring_fill: bool = False
    ring_fill_min_m_pad: int = M_PADS[0]
    exclusive_sm: bool = False
    cluster_split: int = 0
    cluster_k: int = 0
    cluster_max_k: int = MAX_CLUSTER_K
    cluster_max_m_pad: int = M_PADS[-1]
    cluster_fit: bool = False
    wgmma_in_flight: int = 1
    wgmma2_min_m_pad: int = 0
    consumer_warpgroups: int = 1
    deep_ring_blocks: int = 0
    deep_ring_tile_blocks: int = 0
    weight_descriptor: str = "cache"
    descriptor_prefetch: str = ""
    relaxed_cluster_arrive: bool = False
    weight_eviction: str = "normal"
    x_eviction: str = "normal"
    staged_store: bool = False
    late_first_cta_ns: int = 0
    trace: bool = False

    @property
    def trigger_in_run(self) -> bool:
        """The TMA warp triggers the dependent launch inside the CTA's run, as it issues a weight load (load_trigger,
        trigger_lead), rather than the CTA at its start or at exit."""
        return self.pdl and self.load_trigger and not self.early_trigger

    @property
    def mma_threads(self) -> int:
        """Threads of the consumer warpgroups (wgmma, fix-up, epilogue): warps 0 .. producer_warp - 1."""
        return MMA_THREADS * self.consumer_warpgroups

    @property
    def producer_warp(self) -> int:
        """The warp that issues every TMA load: the one after the consumer warpgroups."""
        return self.mma_threads // 32

    @property
    def threads(self) -> int:
        """Threads per CTA."""
        return self.mma_threads + 32

    @property
    def smem_slots(self) -> int:
        """Equal shares the SM's shared memory is cut into (one per CTA)."""
        return max(self.ctas_per_sm, self.smem_share)

    def check(self) -> None:
        if self.fence_scope not in ("sys", "gpu"):
            raise ValueError(f"KernelOptions.fence_scope must be 'sys' or 'gpu', got {self.fence_scope!r}")
        if (self.load_trigger or self.load_trigger_grid) and not self.pdl:
            raise ValueError("KernelOptions.load_trigger and load_trigger_grid need pdl=True (there is no dependent "
                             "launch to trigger)")
        if (self.exclusive_trigger_grid or self.exclusive_sm) and (not self.pdl or self.ctas_per_sm != 1):
            raise ValueError("KernelOptions.exclusive_trigger_grid and exclusive_sm need pdl=True and ctas_per_sm=1 "
                             "(one CTA of a launch per SM)")
        for name in ("load_trigger_grid", "exclusive_trigger_grid"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"KernelOptions.{name} must be a share of the SMs, 0..1, got {getattr(self, name)!r}")
        if self.weight_before_wait and not self.pdl:
            raise ValueError("KernelOptions.weight_before_wait needs pdl=True (there is no wait to load before)")
        if self.ctas_per_sm not in (1, 2):
            raise ValueError(f"KernelOptions.ctas_per_sm must be 1 or 2, got {self.ctas_per_sm!r}")
        if self.smem_share not in (1, 2, 3):
            raise ValueError(f"KernelOptions.smem_share must be 1, 2 or 3, got {self.smem_share!r}")
        if self.cluster_split not in (0, 1, 2) or self.cluster_split > self.smem_slots:
            raise ValueError(f"KernelOptions.cluster_split must be 0, 1 or 2 and at most smem_slots "
                             f"({self.smem_slots}), got {self.cluster_split!r}")
        if not 0 <= self.cluster_k <= MAX_CLUSTER_K or (self.cluster_k and self.ctas_per_sm != 1):
            raise ValueError(f"KernelOptions.cluster_k must be 0..{MAX_CLUSTER_K} (with ctas_per_sm=1), "
                             f"got {self.cluster_k!r}")
        if self.weight_descriptor not in ("cache", "param"):
            raise ValueError(f"KernelOptions.weight_descriptor must be 'cache' or 'param', got "
                             f"{self.weight_descriptor!r}")
        if self.descriptor_prefetch not in ("", "entry", "entry-acquired"):
            raise ValueError(f"KernelOptions.descriptor_prefetch must be '', 'entry' or 'entry-acquired', got "
                             f"{self.descriptor_prefetch!r}")
        if self.weight_eviction not in ("normal", "first"):
            raise ValueError(f"KernelOptions.weight_eviction must be 'normal' or 'first', got {self.weight_eviction!r}")
        if self.x_eviction not in ("normal", "last"):
            raise ValueError(f"KernelOptions.x_eviction must be 'normal' or 'last', got {self.x_eviction!r}")
        if self.trigger_lead < 0 or self.trigger_lead_max_m_pad not in M_PADS:
            raise ValueError(f"KernelOptions.trigger_lead must be >= 0 and trigger_lead_max_m_pad one of {M_PADS}, got "
                             f"{self.trigger_lead!r}, {self.trigger_lead_max_m_pad!r}")
        if self.ring_fill_min_m_pad not in M_PADS:
            raise ValueError(f"KernelOptions.ring_fill_min_m_pad must be one of {M_PADS}, got "
                             f"{self.ring_fill_min_m_pad!r}")
        if self.own_partial_bytes < 0:
            raise ValueError(f"KernelOptions.own_partial_bytes must be >= 0, got {self.own_partial_bytes!r}")
        if self.exclusive_max_blocks < 0:
            raise ValueError(f"KernelOptions.exclusive_max_blocks must be >= 0, got {self.exclusive_max_blocks!r}")
        if self.deep_ring_blocks < 0 or self.deep_ring_tile_blocks < 0:
            raise ValueError(f"KernelOptions.deep_ring_blocks and deep_ring_tile_blocks must be >= 0, got "
                             f"{self.deep_ring_blocks!r}, {self.deep_ring_tile_blocks!r}")
        if self.consumer_warpgroups not in (1, 2):
            raise ValueError(f"KernelOptions.consumer_warpgroups must be 1 or 2, got {self.consumer_warpgroups!r}")
        if self.wgmma_in_flight not in (1, 2):
            raise ValueError(f"KernelOptions.wgmma_in_flight must be 1 or 2, got {self.wgmma_in_flight!r}")
        if self.scatter_last_max_m_pad not in (0,) + M_PADS:
            raise ValueError(f"KernelOptions.scatter_last_max_m_pad must be 0 or one of {M_PADS}, got "
                             f"{self.scatter_last_max_m_pad!r}")
        if self.wgmma2_min_m_pad not in (0,) + M_PADS:
            raise ValueError(f"KernelOptions.wgmma2_min_m_pad must be 0 or one of {M_PADS}, got "
                             f"{self.wgmma2_min_m_pad!r}")
        if self.late_first_cta_ns < 0 or (self.late_first_cta_ns and self.cluster_k < 2):
            raise ValueError(f"KernelOptions.late_first_cta_ns must be >= 0, and 0 unless cluster_k >= 2, got "
                             f"{self.late_first_cta_ns!r} with cluster_k={self.cluster_k!r}")
        if self.cluster_fit and self.cluster_split == 2:
            raise ValueError("KernelOptions.cluster_fit counts clusters at one CTA per SM: it cannot go with "
                             "cluster_split=2")
        if not 1 <= self.cluster_max_k <= MAX_CLUSTER_K or self.cluster_max_m_pad not in M_PADS:
            raise ValueError(f"KernelOptions.cluster_max_k must be 1..{MAX_CLUSTER_K} and cluster_max_m_pad one of "
                             f"{M_PADS}, got {self.cluster_max_k!r}, {self.cluster_max_m_pad!r}")


# Measured with benchmarks/sweep_linear.py on the H200 (2026-12-02, docs/linear.md, docs/results/sweep-linear-h200*):
# PDL with the weight loaded before the wait took the fixed overhead from ~7 to ~3.5 us on back-to-back calls
# (4096x4096, M=1: 14.94 -> 11.26 us; cuBLAS 12.75); the fence scope changed nothing measurable (.sys kept: the
# guide's rule for host-written maps). In a model a linear layer follows a norm or an activation, not another
# linear layer: there ("in situ", a small kernel before each call) half the shared memory per CTA
# (smem_share=2) was faster than the full ring on all 20 cells in each of two runs (4096x4096 M=1: 13.12 vs
# 14.18 us; geomean 0.897x vs 0.855x of cuBLAS) and at most 2.6 % slower on back-to-back calls (geomean 0.973x
# vs 0.986x). A third of it, and two CTAs per SM of one launch, were slower in both.
# Third sweep (docs/results/sweep-linear-h200-run3.*): at M <= 16, split-K inside a cluster per row tile
# (cluster_split=1, trigger at exit) instead of stream-K was faster than stream-K in situ on all 10 cells (4096x4096
# M=1: 11.12 vs 13.31 us, cuBLAS 12.36) and back to back on all 10 (10.95 vs 11.42 us): the per-CTA timelines
# (benchmarks/trace_linear.py) put stream-K's fix-up at 1.0 us for every CTA plus 1.5 us for the last arriver, the
# cluster's at 0.16 us.
# Sweep runs 4 and 5 (2026-12-03, docs/results/sweep-linear-h200-run{4,5}.*): the cluster split at every M where its
# received partials fit (in CTA 0's drained ring above OWN_PARTIAL_BYTES) and up to 8 CTAs per row tile took the
# sweep's geomean from 0.942x (the bounds first shipped: 4 CTAs, M <= 16) to 1.012x back to back and from 0.903x to
# 0.999x in situ; 4096x4096 M=64 17.14 -> 14.09 us, 1024x4096 M=1 6.08 -> 5.75 us (cuBLAS 11.72 / 6.96). Keeping a
# second stage's wgmma in flight (wgmma_in_flight=2) was slower: 1.012x vs 1.032x back to back, 0.998x vs 1.018x in
# situ (run 5).
# Sweep run 6 (2026-12-03, docs/results/sweep-linear-h200-run6.*): cluster_fit (clusters no larger than lets all row
# tiles' clusters run at once, one CTA per SM; the H200 runs 30 clusters of 4, 39 of 3) changes only 32-row-tile
# shapes, from 4 CTAs per tile (8 SMs running two) to 3: 4096x4096 M=32 13.67 -> 12.61 us back to back, 13.88 ->
# 12.77 in situ (cuBLAS 12.92 / 12.77), M=16 2.3 % faster; 4096x14336 M=32 3 % faster, M=1 and M=16 0.7-0.9 %
# slower. The trace (run 4) shows the same streaming spread across CTAs with or without two CTAs on an SM.
# Sweep runs 7-9 (docs/results/sweep-linear-h200-run{7,8,9}.*): loading the weight through the atom's own
# kernel-parameter descriptor instead of ours was ~0.2-0.3 us faster per call (geomean 1.022x vs 1.010x back to
# back, run 7), and the trace put the difference between the first load's issue and its bytes landing. A
# prefetch.tensormap of our descriptor by the TMA warp at kernel entry (descriptor_prefetch="entry") took most of it
# back in run 9: 1.018x vs 1.009x back to back (the kernel-parameter descriptor 1.018x), 1.005x vs 0.997x in situ.
# Fencing at entry too was slower than not prefetching: "entry-acquired" 1.005x / 0.989x in run 9, and every thread
# fencing and prefetching at entry with no later fence 1.009x / 0.992x against 1.012x / 1.000x in run 8.
# Sweep run 10 (docs/results/sweep-linear-h200-run10.*): the relaxed form of the cluster barrier's entry arrive
# (relaxed_cluster_arrive) took the first weight load's issue from 0.69-0.77 us after the CTA's start to 0.45-0.48 us
# (trace run 6; single-CTA builds: 0.39 us) and was 0.03-0.18 us faster in every cell of a clustered shape at M=1 and
# M=16, both ways (1024x4096 M=1 5.48 -> 5.35 us back to back, 5.71 -> 5.59 in situ; 4096x4096 M=1 10.56 -> 10.45,
# 10.74 -> 10.62): geomean 1.016x -> 1.020x back to back, 1.003x -> 1.007x in situ. The whole SM's shared memory for
# the ring (smem_share=1) was slower again, at every M: 0.986x / 0.964x.
# Sweep run 11 (docs/results/sweep-linear-h200-run11.*): weight loads with an L2 evict-first policy
# (weight_eviction="first") against none: geomean 1.038x vs 1.020x back to back, 1.036x vs 1.005x in situ, faster in
# 35 of 36 cells in situ (14336x4096 M=16 29.27 vs 30.87 us). In the decode benchmark at batch 1 it took the swapped
# model from 1.057x to 1.092x over stock (docs/results/decode-eviction-h200.log): the rest of the step no longer loses
# what it rereads from L2 to the weight stream.
# Sweep run 12 and trace run 7 (docs/results/sweep-linear-h200-run12.*, trace-linear-h200-run7.*): triggering the next
# launch once the TMA warp has issued its last weight load (load_trigger) instead of at exit took 1024x4096 M=1 from
# 5.38 to 4.80 us back to back (its 64 CTAs leave the next launch 68 free SMs), but where two launches of 96 CTAs
# overlap, the second ran two CTAs on some SMs (4096x4096 M=1: 80 SMs, 16 with two; 10.44 -> 11.21 us) and 4096x14336
# lost at every M. So only launches of at most half the SMs triggered early (load_trigger_grid=0.5): in a decode step, the
# v projection after the k one (docs/linear.md).
# Sweep runs 14 and 15 (docs/results/sweep-linear-h200-run{14,15}.*): at M=64 the whole SM's shared memory for the ring
# with a second stage's wgmma in flight ("full-ring-wgmma2") was faster in both runs, back to back, on the launches
# whose CTAs stream 128 or more weight blocks (10240x8192 +7.2 / +4.5 %, 8192x28672 +3.1 / +1.4 %, 57344x8192 +5.5 /
# +1.0 %; in situ, run 14: +6.9, +4.2, +2.5 %) and slower on 4096x4096, 6144x4096 and 4096x14336 (21-74 blocks per CTA,
# -0.8 to -3.6 %); 14336x4096 (64 blocks) gained 2.1-2.7 %. Trace run 8: 10240x8192's CTAs streamed 34.3 us against
# 43.9 us, the first stage landing 1.5 us later. So deep_ring_blocks=100 (only the M=64 build, M 33-64: at M=32
# 10240x8192 lost 3-5 %); run 16 checked the shipped policy against none: +7.3, +4.9 and +1.8 % on those three, the
# other cells the same build.
# Marking x evict-last in L2 (x_eviction) and two consumer warpgroups (consumer_warpgroups=2) did not help (geomean
# 1.067x against 1.067x in run 14; 1.058x against 1.062x in run 15).
# Sweep run 17 and trace run 10 (docs/results/sweep-linear-h200-run17.*, trace-linear-h200-run10.*): the trigger after
# the last weight load with the launch asking for more than half an SM's shared memory (exclusive_sm), so that the next
# launch's CTAs start only on SMs it leaves free and never two on one SM (trace: 96 of 96 CTAs started before the
# previous call ended, none stacked). Every cluster and one-CTA-per-tile launch that fits one CTA per SM doing so
# ("exclusive-trigger") took the sweep's back-to-back geomean from 1.074x to 1.111x (4096x4096 M=1 10.42 -> 9.54 us,
# 1024x4096 M=1 4.69 -> 3.87, 4096x14336 M=64 34.27 -> 32.05); in situ, where no launch of ours comes just before,
# 1.047x against 1.050x. It lost on the launches of 112 and 128 CTAs (14336x4096 M=1-32 by 1.6-3.5 %, 8192x28672
# M=64 by 5 %), so exclusive_trigger_grid=0.75: up to 99 CTAs on 132 SMs, which takes in the launches
# load_trigger_grid=0.5 covered. Sweep run 18, trace run 11 and that session's first grid: with it 10240x8192 at M=32
# (one CTA per row tile, 128 blocks each on the half-SM ring) took 45.4-49.2 us against 42.4-44.3 without, so such long
# half-ring runs keep the trigger at exit (exclusive_max_blocks=100). Sweep run 19: 1.107x back to back against 1.067x
# for the policy before (load_trigger_grid=0.5), 1.044x against 1.046x in situ. In the decode benchmark's graph of the
# step's linear layers back to back, gate (112 CTAs, trigger at exit) after o (96, trigger after its last load) put
# two CTAs on some of the SMs o left free (4.430 against 4.175 ms per step); with every one-wave launch asking for its
# SMs alone (exclusive_sm wherever the policy is on), 4.135 ms, and the step 1.114x over stock (docs/linear.md).
# Sweep run 20 repeated run 19 on that final policy: 1.107x against 1.068x back to back, 1.045x against 1.046x in situ.
# Sweep runs 21 and 22 (docs/results/sweep-linear-h200-run{21,22}.*): those launches triggering 3 loads before their last
# (trigger_lead) at M <= 16 took 4096x4096 M=1 from 9.32 to 8.76 us and 6144x4096 M=1 from 14.39 to 13.59 (run 22),
# geomean 1.155x against 1.142x over M 1-32 back to back, in situ the same 1.074x; at M=32-64 the lead lost (run 21).
# Sweep runs 24-27: the reduce-scatter (cluster_scatter) and the partials beside the ring (partials_beside,
# beside_small); see their docstrings. Sweep run 32 (docs/results/sweep-linear-h200-run32.*): the ring filling what
# the partials beside it leave (ring_fill) won 7 of the 8 M=64 cells, back to back and in situ (it lost 1024x4096 in situ
# by 0.07 us), and lost every in-situ cell at M <= 32, so it ships for m_pad 64 (ring_fill_min_m_pad). Measured and not shipped, sweep runs 28-31 (docs/linear.md): stream-K at
# every shape (its fix-up cost 4-5 us at 10240x8192 M=64), x multicast and cluster placement for one-CTA-per-tile
# launches, a second wgmma on the half ring and leads of 2 and 5 loads. Options measured and not shipped that only
# those sweeps used (x multicast, a bounded steady depth, a deep ring chosen per CTA, a smaller first request, the
# trigger from the MMA warps) were taken out of the kernel in stop 35; the code that ran them is commit 2dc719b.
# Trace runs 24-25 and sweep runs 40-41 (an H100; docs/results/trace-linear-h100-run2{4,5}.*,
# sweep-linear-h100-run4{0,1}.*): one-CTA-per-tile builds storing y through shared memory in 16-byte runs
# (staged_store) took 10240x8192 M=64's tail from 1.14 to 0.69 us and gained up to 1.7 % at M 32-64 on 28672x4096 and
# 10240x8192; see staged_store. Stop 35's H200 grid (docs/results/linear-h200-stop35.csv) is the first with it. Sweep
# runs 45-48 (an H100) and 49 (an H200): a second wgmma in flight on every M=64 ring (wgmma2_min_m_pad), not only the
# deep one; see its docstring. Stop 41's H200 grid (docs/results/linear-h200.csv) is the first with it. Sweep runs
# 50-51 (an H100): the deep ring for one CTA per row tile from 64 blocks (deep_ring_tile_blocks) and the last rank
# owning the reduce-scatter at M <= 16 (scatter_last_max_m_pad), not shipped; see their docstrings.
DEFAULT_OPTIONS = KernelOptions(fence_scope="sys", pdl=True, weight_before_wait=True, smem_share=2, cluster_split=1,
                                cluster_fit=True, descriptor_prefetch="entry", relaxed_cluster_arrive=True,
                                weight_eviction="first", exclusive_trigger_grid=0.75, exclusive_max_blocks=100,
                                deep_ring_blocks=100, trigger_lead=3, trigger_lead_max_m_pad=16,
                                cluster_scatter=True, partials_beside=True, beside_small=True, ring_fill=True,
                                ring_fill_min_m_pad=64, staged_store=True, wgmma2_min_m_pad=64)


def weight_box(N: int, K: int, dtype: torch.dtype) -> tuple[int, int]:
    """Weight descriptor box in torch order (rows of N, columns of K), in elements.

    One box is one pipeline stage of one row tile: 128 rows x 64 columns (128 bytes, the whole
    128B-swizzle span) for both supported dtypes and every shape; N and K only have to be positive
    (the box may overhang the tensor: TMA zero-fills the overhang).
    """
    if N < 1 or K < 1:
        raise ValueError(f"weight_box: N={N} and K={K} must be positive")
    if dtype not in _DTYPES:
        raise TypeError(f"weight_box: dtype {dtype} is not supported (bfloat16, float16)")
    return (TILE_N, TILE_K)


def weight_swizzle(dtype: torch.dtype) -> Swizzle:
    """Shared-memory swizzle of the weight descriptor: 128B, the layout wgmma reads K-major tiles in."""
    if dtype not in _DTYPES:
        raise TypeError(f"weight_swizzle: dtype {dtype} is not supported (bfloat16, float16)")
    return Swizzle.B128


def crossover_m(N: int, K: int, dtype: torch.dtype, sm_count: int = 0, capacity: tuple[int, ...] = ()) -> int:
    """Largest M this kernel takes for an N x K weight: CROSSOVER_M by weight size, and given the GPU's SM count (and
    its cluster_capacity, where DEFAULT_OPTIONS.cluster_fit), M_PADS[-1] from FULL_CROSSOVER_BYTES of weight where the
    M=64 launch is a cluster-split or one-CTA-per-tile build on at least FULL_CROSSOVER_SMS of the SMs."""
    weight_bytes = N * K * torch.finfo(dtype).bits // 8
    max_m = next(max_m for bound, max_m in CROSSOVER_M if weight_bytes < bound)
    if sm_count and weight_bytes >= FULL_CROSSOVER_BYTES:
        options = options_for(DEFAULT_OPTIONS, N, K, M_PADS[-1], sm_count, capacity)
        if options.cluster_k and grid_size(N, K, sm_count, options) >= FULL_CROSSOVER_SMS * sm_count:
            return M_PADS[-1]
    return max_m


@functools.cache
def _device_crossover(device_index: int, dtype: torch.dtype, N: int, K: int) -> int:
    """crossover_m on CUDA device `device_index`, once per shape (the first time an M above the weight-size class
    comes: it may query the driver, cluster_capacity)."""
    return crossover_m(N, K, dtype, *_device_limits(device_index))


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# An empty kernel for the driver's occupancy calculator: loading PTX text JIT-compiles it in the driver (no DSL
# compile, no file); what the calculator needs is its launch shape, set below.
_OCCUPANCY_PROBE_PTX = b"""
.version 8.0
.target sm_90
.address_size 64
.visible .entry torch_tma_occupancy_probe() { ret; }
"""


def _driver_result(name: str, result: tuple):
    """The value of a cuda-bindings call, or a RuntimeError naming the call and the driver's error."""
    if result[0] != cuda.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{name} failed: {result[0].name}")
    return result[1] if len(result) == 2 else result[1:]


@functools.cache
def cluster_capacity(device_index: int) -> tuple[int, ...]:
    """Clusters of 1..MAX_CLUSTER_K CTAs (item k - 1) that CUDA device `device_index` runs at once with one CTA per SM.

    The driver's occupancy calculator (cuOccupancyMaxActiveClusters) for a block of THREADS threads that takes a
    whole SM's shared memory, so no two CTAs share an SM. A cluster runs inside one GPC, so the count is below
    sm_count // k where GPC sizes are not multiples of k. Loads one empty PTX kernel: once per device and process.
    """
    if torch.cuda.is_current_stream_capturing():  # the synchronize below would invalidate the capture
        raise RuntimeError("tma::linear: first call on this device during CUDA-graph capture; run one eager call "
                           "(warm-up) before capturing")
    with torch.cuda.device(device_index):
        torch.cuda.synchronize()  # the device's primary context is current on this thread
        module = _driver_result("cuModuleLoadData", cuda.cuModuleLoadData(_OCCUPANCY_PROBE_PTX))
        try:
            probe = _driver_result("cuModuleGetFunction",
                                   cuda.cuModuleGetFunction(module, b"torch_tma_occupancy_probe"))
            device = _driver_result("cuDeviceGet", cuda.cuDeviceGet(device_index))
            smem_optin = _driver_result("cuDeviceGetAttribute", cuda.cuDeviceGetAttribute(
                cuda.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, device))
            _driver_result("cuFuncSetAttribute", cuda.cuFuncSetAttribute(
                probe, cuda.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_optin))
            config = cuda.CUlaunchConfig()
            config.blockDimX, config.blockDimY, config.blockDimZ = THREADS, 1, 1
            config.sharedMemBytes = smem_optin
            capacity = []
            for k in range(1, MAX_CLUSTER_K + 1):
                cluster = cuda.CUlaunchAttribute()
                cluster.id = cuda.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
                cluster.value.clusterDim.x, cluster.value.clusterDim.y, cluster.value.clusterDim.z = k, 1, 1
                config.gridDimX, config.gridDimY, config.gridDimZ = k, 1, 1
                config.attrs, config.numAttrs = [cluster], 1
                capacity.append(_driver_result("cuOccupancyMaxActiveClusters",
                                               cuda.cuOccupancyMaxActiveClusters(probe, config)))
            return tuple(capacity)
        finally:
            _driver_result("cuModuleUnload", cuda.cuModuleUnload(module))


def _device_limits(device_index: int) -> tuple[int, tuple[int, ...]]:
    """(SM count, cluster_capacity or () where DEFAULT_OPTIONS does not fit clusters): what options_for needs to know
    of CUDA device `device_index`."""
    return _sm_count(device_index), cluster_capacity(device_index) if DEFAULT_OPTIONS.cluster_fit else ()


@functools.cache
def _is_hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def unsupported_reason(x2d: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], *,
                       crossover: bool = True) -> Optional[str]:
    """Why this kernel cannot compute F.linear(x2d, weight, bias), or None when it can.

    crossover=False drops the measured policy (M above CROSSOVER_M goes to cuBLAS) and keeps only what the
    kernel can compute at all (M up to its largest tile): for tests and benchmarks of the kernel itself.

    x2d is [M, K], weight [N, K], bias [N] or None. The kernel needs: CUDA tensors on one sm_90 device,
    one dtype (bf16 or fp16) for all, 1 <= M <= the crossover of the shape, K a multiple of 8 (TMA
    strides are multiples of 16 bytes), x with unit column stride and a row stride of a multiple of
    16 bytes, weight and bias contiguous, x and weight 16-byte aligned.

    Runs on every call of the op: what depends only on (device, dtype, N, K) is cached (_shape_support),
    the rest reads each tensor attribute once (each read costs 0.1-0.5 us of host time).
    """
    if not (x2d.is_cuda and weight.is_cuda and (bias is None or bias.is_cuda)):
        return "tensors are not all on a CUDA device"
    device_index = weight.get_device()
    if x2d.get_device() != device_index or (bias is not None and bias.get_device() != device_index):
        return "x, weight and bias are on different devices"
    dtype = x2d.dtype
    if weight.dtype != dtype or (bias is not None and bias.dtype != dtype):
        return "x, weight and bias dtypes differ"
    x_shape, w_shape = x2d.shape, weight.shape
    if len(x_shape) != 2 or len(w_shape) != 2 or x_shape[1] != w_shape[1]:
        return f"shapes x {tuple(x_shape)} and weight {tuple(w_shape)} are not [M, K] and [N, K]"
    M, K = x_shape
    N = w_shape[0]
    reason, max_m = _shape_support(device_index, dtype, N, K)
    if reason is not None:
        return reason
    if M == 0:
        return "empty x or weight"
    # The crossover (at most the largest tile) first: with it, every M the op hands to cuBLAS is one cause, one line.
    if crossover and M > max_m:
        max_m = _device_crossover(device_index, dtype, N, K)  # the launch-dependent part, above the size class
        if M > max_m:
            return f"M={M} is above the crossover M={max_m} for a {N}x{K} weight"
    if M > M_PADS[-1]:
        return f"M={M} is above the kernel's largest tile M={M_PADS[-1]}"
    if weight.stride() != (K, 1):
        return f"weight is not contiguous (strides {weight.stride()})"
    x_stride = x2d.stride()
    if x_stride[1] != 1 or x_stride[0] % 8 or (M > 1 and x_stride[0] < K):
        return f"x strides {x_stride} are not (a multiple of 8 that is >= K, 1) elements"
    if x2d.data_ptr() % 16 or weight.data_ptr() % 16:
        return "x or weight data pointer is not 16-byte aligned"
    if bias is not None and (bias.shape != w_shape[:1] or bias.stride() != (1,)):
        return f"bias shape {tuple(bias.shape)} / stride {bias.stride()} is not a contiguous [N={N}]"
    return None


@functools.cache
def _shape_support(device_index: int, dtype: torch.dtype, N: int, K: int) -> tuple[Optional[str], int]:
    """(why the kernel cannot take an N x K weight of dtype on this CUDA device, or None; the largest M it takes).

    The part of unsupported_reason that depends on no tensor but the shape: checked once per shape.
    """
    if not _is_hopper(device_index):
        major, minor = torch.cuda.get_device_capability(device_index)
        return f"GPU is sm_{major}{minor}, not Hopper (sm_90)", 0
    if dtype not in _DTYPES:
        return f"dtype {dtype} is not bfloat16 or float16", 0
    if N == 0 or K == 0:
        return "empty x or weight", 0
    if K % 8:
        return f"K={K} makes a row stride that is not a multiple of 16 bytes (K must be a multiple of 8)", 0
    if -(-N // TILE_N) > MAX_ROW_TILES:
        return f"N={N} is above the kernel's {MAX_ROW_TILES * TILE_N} rows", 0
    if _iteration_count(N, K) * _sm_count(device_index) >= 2**31:
        return f"a {N}x{K} weight overflows the kernel's 32-bit block indices", 0
    return None, crossover_m(N, K, dtype)


def _iteration_count(N: int, K: int) -> int:
    """Weight blocks (128 rows x 64 columns) of an N x K weight: the stream-K iteration space."""
    return -(-N // TILE_N) * -(-K // TILE_K)


def m_pad(M: int) -> int:
    """The wgmma N size (x rows, padded) that serves M rows."""
    return next(p for p in M_PADS if p >= M)


def pipeline_stages(m_pad_: int, smem_slots: int = 1, cluster_k: int = 0,
                    own_partial_bytes: int = OWN_PARTIAL_BYTES, beside: bool = False, fill: bool = False) -> int:
    """Stages of the TMA ring that fit in one CTA's share (1 / smem_slots) of an SM's shared memory; a stage
    is a 128 x 64 weight block and an m_pad x 64 block of x, 2-byte elements. A cluster-split build whose received
    partials are small (partials_in_ring False) keeps them beside the ring, inside its share; with beside
    (partials_beside_ring) they lie outside it, in the SM's other share, and the ring keeps its depth; with fill too
    (KernelOptions.ring_fill) the ring takes all the CTA's shared memory the partials leave."""
    stage_bytes = _stage_bytes(m_pad_)
    if beside and fill:
        return (SMEM_BYTES - SMEM_RESERVED - _cluster_partial_bytes(m_pad_, cluster_k)) // stage_bytes
    cta_bytes = min(SMEM_BYTES, SMEM_PER_SM // smem_slots - SMEM_PER_CTA_SYSTEM)
    in_ring = partials_in_ring(m_pad_, cluster_k, own_partial_bytes)
    own = 0 if in_ring or beside else _cluster_partial_bytes(m_pad_, cluster_k)
    return (cta_bytes - SMEM_RESERVED - own) // stage_bytes


def ring_stages(m_pad_: int, options: "KernelOptions") -> int:
    """Stages of the ring of a resolved build (options_for): pipeline_stages for its share of the SM, partials and
    KernelOptions.ring_fill."""
    return pipeline_stages(m_pad_, options.smem_slots, options.cluster_k, options.own_partial_bytes,
                           partials_beside_ring(m_pad_, options), options.ring_fill)


def _stage_bytes(m_pad_: int) -> int:
    """Bytes of one ring stage: a 128 x 64 weight block and an m_pad x 64 block of x, 2-byte elements."""
    return (TILE_N + m_pad_) * TILE_K * 2


def _cluster_partial_bytes(m_pad_: int, cluster_k: int) -> int:
    """Bytes of the partials a cluster's CTA 0 receives: cluster_k - 1 fp32 tiles of 128 x m_pad."""
    return max(0, cluster_k - 1) * TILE_N * m_pad_ * 4


def partials_in_ring(m_pad_: int, cluster_k: int, own_partial_bytes: int = OWN_PARTIAL_BYTES) -> bool:
    """Whether a cluster-split build receives its partials in the receiver's weight ring (after its last stage; CTA
    0's without cluster_scatter, every CTA's with it) rather than in a buffer of their own: above own_partial_bytes
    (KernelOptions.own_partial_bytes)."""
    return _cluster_partial_bytes(m_pad_, cluster_k) > own_partial_bytes


def partials_beside_ring(m_pad_: int, options: "KernelOptions") -> bool:
    """Whether a build keeps the partials it receives in a buffer of their own in the SM's other shared-memory share
    (KernelOptions.partials_beside): a resolved exclusive_sm cluster-split build on a share of the SM whose partials
    would otherwise land in its drained ring, where its ring, the partials and SMEM_RESERVED fit in SMEM_BYTES."""
    k, slots = options.cluster_k, options.smem_slots
    if not (options.partials_beside and options.exclusive_sm and k > 1 and slots > 1
            and (options.beside_small or partials_in_ring(m_pad_, k, options.own_partial_bytes))):
        return False
    ring = pipeline_stages(m_pad_, slots) * _stage_bytes(m_pad_)
    return SMEM_RESERVED + ring + _cluster_partial_bytes(m_pad_, k) <= SMEM_BYTES


def scatter_shares(pieces: int, cluster_k: int, to_last: bool = False) -> tuple[list[int], list[int]]:
    """The reduce-scatter's cut (KernelOptions.cluster_scatter) of a thread's `pieces` 4-value pieces over a cluster:
    (first, owner), rank r owning pieces first[r] .. first[r + 1] - 1 (equal runs in rank order; with fewer pieces
    than ranks, some own none; to_last: the last rank owns all, KernelOptions.scatter_last_max_m_pad) and owner[q]
    the rank that owns piece q."""
    first = [0] * cluster_k + [pieces] if to_last else [r * pieces // cluster_k for r in range(cluster_k + 1)]
    owner = [r for q in range(pieces) for r in range(cluster_k) if first[r] <= q < first[r + 1]]
    return first, owner


def _weight_ring_bytes(stages: int) -> int:
    """Bytes of the weight half of a ring of `stages` stages: where in-ring partials land (2-byte elements)."""
    return stages * TILE_N * TILE_K * 2


def _fits_cluster(m_pad_: int, cluster_k: int, smem_slots: int, own_partial_bytes: int = OWN_PARTIAL_BYTES) -> bool:
    """A cluster-split build's received partials fit: in their own buffer, or in the receiver's weight ring."""
    if not partials_in_ring(m_pad_, cluster_k, own_partial_bytes):
        return pipeline_stages(m_pad_, smem_slots, cluster_k, own_partial_bytes) >= 2
    return _cluster_partial_bytes(m_pad_, cluster_k) <= _weight_ring_bytes(pipeline_stages(m_pad_, smem_slots))


def cluster_k_for(N: int, K: int, m_pad_: int, sm_count: int, ctas_per_sm: int, smem_slots: int = 0,
                  max_k: int = MAX_CLUSTER_K, max_m_pad: int = M_PADS[-1], capacity: tuple[int, ...] = (),
                  own_partial_bytes: int = OWN_PARTIAL_BYTES) -> int:
    """CTAs per row tile of a cluster-split launch for an N x K weight, or 0 where the shape takes stream-K.

    Every row tile gets one cluster, as many CTAs as ctas_per_sm per SM allows (at most max_k, one 64-column
    block each, and no more than the received partials fit: _fits_cluster), and, given capacity (cluster_capacity),
    no more than lets every row tile's cluster run at once. With more row tiles than that, one CTA
    per row tile (no cluster) while the grid fits with smem_slots (default ctas_per_sm) CTAs per SM, the whole grid
    resident at once; stream-K beyond, and for m_pad above max_m_pad.
    """
    tiles, k_blocks = -(-N // TILE_N), -(-K // TILE_K)
    smem_slots = max(ctas_per_sm, smem_slots)
    if m_pad_ > max_m_pad or tiles > sm_count * smem_slots:
        return 0
    if tiles > sm_count * ctas_per_sm:
        return 1
    cluster_k = min(max_k, k_blocks, sm_count * ctas_per_sm // tiles)
    while cluster_k > 1 and (not _fits_cluster(m_pad_, cluster_k, smem_slots, own_partial_bytes)
                             or (capacity and capacity[cluster_k - 1] < tiles)):
        cluster_k -= 1
    return cluster_k


def options_for(options: "KernelOptions", N: int, K: int, M: int, sm_count: int,
                capacity: tuple[int, ...] = ()) -> "KernelOptions":
    """options resolved for one problem shape: cluster_k set from the cluster_split policy (cluster_k_for); a
    cluster-split build never triggers its dependents at its start, and triggers them after its last weight load
    (load_trigger) where its grid is at most options.load_trigger_grid of the SMs, or options.exclusive_trigger_grid
    and its run is not a long one on a half-SM ring, trigger_lead loads before the last where M pads to at most
    trigger_lead_max_m_pad; with exclusive_trigger_grid above 0, such a build whose grid fits
    one CTA per SM takes its SMs alone (exclusive_sm); at M_PADS[-1], the
    deep ring with two wgmma in flight where each CTA streams at least options.deep_ring_blocks blocks
    (deep_ring_tile_blocks for a launch of one CTA per row tile, where set) and the
    decomposition stays the same; ring_fill only where the partials lie beside the ring and M pads to at least
    ring_fill_min_m_pad; the last rank owning the reduce-scatter's pieces only in cluster_scatter builds where M pads
    to at most scatter_last_max_m_pad; a second wgmma in flight where M pads to at least wgmma2_min_m_pad.
    capacity: the GPU's cluster_capacity, needed when options.cluster_fit.

    Why not early: with the trigger at CTA start, the next launch's CTAs take the second slot of SMs this launch
    runs on, and cluster placement then piles two CTAs of one launch on many SMs (benchmarks/trace_linear.py on
    the H200: 4096x14336 back to back ran its 128 CTAs on 91 SMs, 38.7 us against 30.4 us with the trigger at
    exit; docs/linear.md). Stream-K launches keep it: they need the overlap to hide their fix-up.
    """
    resolved = _split_for(options, N, K, M, sm_count, capacity)
    deep_blocks = (options.deep_ring_tile_blocks if resolved.cluster_k == 1 and options.deep_ring_tile_blocks
                   else options.deep_ring_blocks)
    if deep_blocks and m_pad(M) == M_PADS[-1] and _blocks_per_cta(N, K, sm_count, resolved) >= deep_blocks:
        deep = _split_for(options._replace(smem_share=1, wgmma_in_flight=2), N, K, M, sm_count, capacity)
        if deep.cluster_k == resolved.cluster_k:  # with ctas_per_sm unchanged, the same grid (grid_size)
            resolved = deep
    if not resolved.load_trigger or m_pad(M) > options.trigger_lead_max_m_pad:
        resolved = resolved._replace(trigger_lead=0)  # one build where the lead cannot apply
    if not partials_beside_ring(m_pad(M), resolved):
        resolved = resolved._replace(partials_beside=False)  # likewise
    if not resolved.partials_beside or m_pad(M) < options.ring_fill_min_m_pad:
        resolved = resolved._replace(ring_fill=False)  # likewise
    if not (resolved.cluster_k > 1 and resolved.cluster_scatter) or m_pad(M) > options.scatter_last_max_m_pad:
        resolved = resolved._replace(scatter_last_max_m_pad=0)  # likewise
    if options.wgmma2_min_m_pad and m_pad(M) >= options.wgmma2_min_m_pad:
        resolved = resolved._replace(wgmma_in_flight=2)
    return resolved


def _split_for(options: "KernelOptions", N: int, K: int, M: int, sm_count: int,
               capacity: tuple[int, ...]) -> "KernelOptions":
    """options_for without the deep-ring policy: cluster_k and the trigger."""
    if not options.cluster_split:
        return options._replace(cluster_k=0)
    if options.cluster_fit and len(capacity) != MAX_CLUSTER_K:
        raise ValueError(f"options_for: KernelOptions.cluster_fit needs the GPU's cluster_capacity (one count per "
                         f"cluster size 1..{MAX_CLUSTER_K}), got {capacity!r}")
    cluster_k = cluster_k_for(N, K, m_pad(M), sm_count, options.cluster_split, options.smem_slots,
                              options.cluster_max_k, options.cluster_max_m_pad,
                              capacity if options.cluster_fit else (), options.own_partial_bytes)
    if cluster_k:
        resolved = options._replace(cluster_k=cluster_k, early_trigger=False)
        grid = grid_size(N, K, sm_count, resolved)
        # a long run on a share of the SM keeps the trigger at exit (sweep run 18: 10240x8192 M=32)
        long_half_ring = resolved.smem_share > 1 and 0 < options.exclusive_max_blocks <= _blocks_per_cta(
            N, K, sm_count, resolved)
        after_load = grid <= options.exclusive_trigger_grid * sm_count and not long_half_ring
        # with the policy on, every launch that fits one CTA per SM takes its SMs alone: behind a launch that triggers
        # after its last load, its CTAs would otherwise start two to an SM on the SMs that launch leaves free
        alone = options.exclusive_sm or (options.exclusive_trigger_grid > 0 and grid <= sm_count)
        return resolved._replace(load_trigger=options.load_trigger or after_load or grid <= options.load_trigger_grid *
                                 sm_count, exclusive_sm=alone)
    return options._replace(cluster_k=0)


def _blocks_per_cta(N: int, K: int, sm_count: int, options: "KernelOptions") -> int:
    """64-column weight blocks the shortest-running CTA of a resolved launch streams: a cluster rank's share of a row
    tile's K, or a stream-K CTA's share of all blocks."""
    if options.cluster_k:
        return -(-K // TILE_K) // options.cluster_k
    return _iteration_count(N, K) // grid_size(N, K, sm_count, options)


def grid_size(N: int, K: int, sm_count: int, options: "KernelOptions") -> int:
    """CTAs of one launch: stream-K, ctas_per_sm per SM (one wave), never more than there are weight blocks;
    cluster split (options.cluster_k), cluster_k per row tile."""
    if options.cluster_k:
        if options.cluster_k > -(-K // TILE_K):
            raise ValueError(f"grid_size: cluster_k={options.cluster_k} is more CTAs than K={K} has 64-column blocks")
        return -(-N // TILE_N) * options.cluster_k
    return min(sm_count * options.ctas_per_sm, _iteration_count(N, K))


def weight_smem_layout(dtype: type[cutlass.Numeric], stages: int) -> cute.ComposedLayout:
    """Shared-memory layout of `stages` weight blocks, TILE_N x TILE_K each, K-major with 128B swizzle.

    Call inside a DSL trace. The wgmma A layout does not depend on the N side of the tile, so any
    m_pad gives the same layout.
    """
    return sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (TILE_N, M_PADS[0], TILE_K), dtype, stages)


class WeightStreamingLinear:
    """The kernel for one static configuration: dtype, m_pad (wgmma N), bias or not, pipeline stages,
    KernelOptions.

    Tensors (element counts, torch order): x [M, K] row stride any multiple of 8; weight [N, K]
    contiguous (only its shape and the TMA atom come from it: the bytes are loaded through the
    descriptor at weight_map); bias [N] or None; out [M, N] unit column stride; partials fp32 with at
    least num_ctas * 2 * m_pad * 128 elements; arrivals int32 [ARRIVAL_WORDS] (ceil(N / 128) row tiles'
    counters), all zero on entry and left all zero on exit.
    """

    def __init__(
        self, dtype: type[cutlass.Numeric], m_pad_: int, has_bias: bool, stages: int, options: KernelOptions
    ):
        options.check()
        self.dtype = dtype
        self.m_pad = m_pad_
        self.has_bias = has_bias
        self.stages = stages
        self.options = options
        self.tile_mnk = (TILE_N, m_pad_, TILE_K)
        self.partial_elems = TILE_N * m_pad_  # fp32 values of one partial tile
        self.mma_threads = options.mma_threads
        self.values = self.partial_elems // self.mma_threads  # accumulator values per MMA thread
        # cluster split: the first CTA of a cluster receives the other cluster_k - 1 partials (fp32), in a buffer of
        # their own or in its drained weight ring (partials_in_ring); other builds keep a 16-byte stub (a struct
        # member cannot be empty)
        self.cluster_elems = (options.cluster_k - 1) * self.partial_elems if options.cluster_k > 1 else 4
        # the reduce-scatter's cut: the last rank owns every piece (scatter_last_max_m_pad) or equal shares
        self.scatter_to_last = 0 < m_pad_ <= options.scatter_last_max_m_pad
        self.beside = partials_beside_ring(m_pad_, options)
        self.in_ring = (options.cluster_k > 1 and not self.beside
                        and partials_in_ring(m_pad_, options.cluster_k, options.own_partial_bytes))
        if self.in_ring and self.cluster_elems * 4 > _weight_ring_bytes(stages):
            raise ValueError(f"WeightStreamingLinear: {self.cluster_elems * 4} bytes of partials do not fit in a ring "
                             f"of {stages} stages")
        # staged_store: the builds of one CTA per row tile, whose CTAs each store a whole tile's y (the staging area
        # is the start of the drained ring)
        self.staged = options.staged_store and options.cluster_k == 1
        if self.staged and m_pad_ * STAGE_PITCH * 2 > _weight_ring_bytes(stages):
            raise ValueError(f"WeightStreamingLinear: staged_store's {m_pad_ * STAGE_PITCH * 2} bytes do not fit in a "
                             f"ring of {stages} stages")

    @cute.jit
    def __call__(
        self,
        x: cute.Tensor,
        weight: cute.Tensor,
        bias: Optional[cute.Tensor],
        out: cute.Tensor,
        partials: cute.Tensor,
        arrivals: cute.Tensor,
        weight_map: Int64,
        num_ctas: Int32,
        stream: cuda.CUstream,
        trace: Optional[cute.Tensor] = None,
    ):
        # one warpgroup per 64 weight rows of a consumer_warpgroups=2 build; one for all 128 (two m64 steps) otherwise
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.K, Float32,
            (self.options.consumer_warpgroups, 1, 1), (64, self.m_pad)
        )
        w_smem = weight_smem_layout(self.dtype, self.stages)
        # ROW_MAJOR: x's K is contiguous, a K-major wgmma B operand
        x_smem = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, self.tile_mnk, self.dtype, self.stages)
        load_op = cpasync.CopyBulkTensorTileG2SOp()
        w_atom, w_coords = cpasync.make_tiled_tma_atom(
            load_op, weight, cute.slice_(w_smem, (None, None, 0)), (TILE_N, TILE_K)
        )
        x_atom, x_coords = cpasync.make_tiled_tma_atom(
            load_op, x, cute.slice_(x_smem, (None, None, 0)), (self.m_pad, TILE_K)
        )

        cluster_k = self.options.cluster_k

        @cute.struct
        class SharedStorage:
            stage_barriers: cute.struct.MemRange[Int64, self.stages * 2]
            fixup_count: cute.struct.MemRange[Int32, 1]
            w_tiles: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(w_smem)], 1024]
            x_tiles: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(x_smem)], 1024]
            cluster_partials: cute.struct.Align[cute.struct.MemRange[Float32, 4 if self.in_ring else self.cluster_elems],
                                                16]
            cluster_barrier: cute.struct.MemRange[Int64, 1]
            drained_barrier: cute.struct.MemRange[Int64, 1]

        self.shared_storage = SharedStorage
        # exclusive_sm: ask for more than the ring uses, so that no second CTA fits on the SM
        smem = max(SharedStorage.size_in_bytes(), EXCLUSIVE_SMEM_BYTES) if self.options.exclusive_sm else None
        kernel = self.kernel(
            w_atom, w_coords, x_atom, x_coords, bias, out, partials, arrivals, weight_map, tiled_mma, w_smem, x_smem,
            trace,
        )
        if cutlass.const_expr(cluster_k):
            # one cluster of cluster_k CTAs per row tile
            tiles = cute.ceil_div(weight.shape[0], TILE_N)
            kernel.launch(grid=[cluster_k, tiles, 1], block=[self.options.threads, 1, 1], cluster=[cluster_k, 1, 1],
                          stream=stream, use_pdl=self.options.pdl, smem=smem)
        else:
            kernel.launch(grid=[num_ctas, 1, 1], block=[self.options.threads, 1, 1], stream=stream,
                          use_pdl=self.options.pdl, smem=smem)

    @cute.kernel
    def kernel(
        self,
        w_atom: cute.CopyAtom,
        w_coords: cute.Tensor,
        x_atom: cute.CopyAtom,
        x_coords: cute.Tensor,
        bias: Optional[cute.Tensor],
        out: cute.Tensor,
        partials: cute.Tensor,
        arrivals: cute.Tensor,
        weight_map: Int64,
        tiled_mma: cute.TiledMma,
        w_smem: cute.ComposedLayout,
        x_smem: cute.ComposedLayout,
        trace: Optional[cute.Tensor],
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        cta, cluster_tile, _ = cute.arch.block_idx()
        num_ctas, _, _ = cute.arch.grid_dim()
        cluster_k = self.options.cluster_k
        if cutlass.const_expr(cluster_k):
            rank = cta  # grid x is the CTA's rank in its cluster, grid y the cluster
            cta = cluster_tile * cluster_k + rank
        if cutlass.const_expr(self.options.trace):
            if tidx == 0:
                trace[cta, 0] = cute.arch.globaltimer()
                trace[cta, 2] = cute.arch.clock64()
                trace[cta, 8] = Int64(0)
                trace[cta, 9] = Int64(0)
                trace[cta, 11] = Int64(0)
                trace[cta, 12] = Int64(0)
                trace[cta, 10] = Int64(cute.arch.smid())

        if cutlass.const_expr(self.options.descriptor_prefetch != "" and self.options.weight_descriptor == "cache"):
            if warp_idx == self.options.producer_warp:
                prefetch_tma_desc(weight_map, acquire=self.options.fence_scope
                                  if self.options.descriptor_prefetch == "entry-acquired" else None)
        if cutlass.const_expr(self.options.pdl and self.options.early_trigger):
            cute.arch.griddepcontrol_launch_dependents()
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        stage_bytes = cute.size_in_bytes(self.dtype, cute.slice_(w_smem, (None, None, 0))) + cute.size_in_bytes(
            self.dtype, cute.slice_(x_smem, (None, None, 0))
        )
        loads = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.stage_barriers.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            # consumer_release arrives once per MMA warp (lane 0)
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.mma_threads // 32),
            tx_count=stage_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
        )
        w_tiles = storage.w_tiles.get_tensor(w_smem.outer, swizzle=w_smem.inner)
        x_tiles = storage.x_tiles.get_tensor(x_smem.outer, swizzle=x_smem.inner)

        k_blocks = cute.ceil_div(w_coords.shape[1], TILE_K)
        total = cute.ceil_div(w_coords.shape[0], TILE_N) * k_blocks
        run_begin = cta * total // num_ctas
        run_end = (cta + 1) * total // num_ctas
        if cutlass.const_expr(cluster_k):
            run_begin = cluster_tile * k_blocks + rank * k_blocks // cluster_k
            run_end = cluster_tile * k_blocks + (rank + 1) * k_blocks // cluster_k
        if cutlass.const_expr(self.in_ring):
            # the partials land in the receiver's weight ring (CTA 0's, or with cluster_scatter every CTA's); a CTA
            # sends once its receivers say they are drained
            ring = cute.recast_ptr(storage.w_tiles.data_ptr(), dtype=Float32)
            cluster_partials = cute.make_tensor(ring, cute.make_layout(self.cluster_elems))
        else:
            cluster_partials = storage.cluster_partials.get_tensor(cute.make_layout(self.cluster_elems))
        if cutlass.const_expr(cluster_k > 1):
            if cutlass.const_expr(self.options.cluster_scatter):
                # every CTA's barrier counts the bytes of its share of the other CTAs' partials (its run of
                # scatter_shares), and with the partials in the ring its drained_barrier the other CTAs' word that
                # their rings are drained
                if tidx == 0:
                    first, _ = scatter_shares(self.values // 4, cluster_k, self.scatter_to_last)
                    share = Int32(0)  # first[rank + 1] - first[rank], rank being a runtime value
                    for r in cutlass.range_constexpr(cluster_k):
                        share = share + Int32(rank == r) * (first[r + 1] - first[r])
                    cute.arch.mbarrier_init(storage.cluster_barrier.data_ptr(), 1)
                    if cutlass.const_expr(self.in_ring):
                        cute.arch.mbarrier_init(storage.drained_barrier.data_ptr(), cluster_k - 1)
                    cute.arch.mbarrier_init_fence()
                    cute.arch.mbarrier_arrive_and_expect_tx(
                        storage.cluster_barrier.data_ptr(), (cluster_k - 1) * share * 4 * self.mma_threads * 4
                    )
            else:
                # CTA 0's barrier counts the bytes of the other CTAs' partials (cluster_reduce)
                if rank == 0 and tidx == 0:
                    cute.arch.mbarrier_init(storage.cluster_barrier.data_ptr(), 1)
                    cute.arch.mbarrier_init_fence()
                    cute.arch.mbarrier_arrive_and_expect_tx(
                        storage.cluster_barrier.data_ptr(), (cluster_k - 1) * self.partial_elems * 4
                    )
                if cutlass.const_expr(self.in_ring):
                    if rank != 0 and tidx == 0:  # CTA 0 arrives on it once its ring is drained (cluster_reduce)
                        cute.arch.mbarrier_init(storage.drained_barrier.data_ptr(), 1)
                        cute.arch.mbarrier_init_fence()
            # Every thread arrives once: this CTA has started and its barriers are set. A CTA waits on it only when it
            # reaches its reduction (cluster_reduce: the senders, and CTA 0 before it says it is drained;
            # cluster_scatter: every CTA), so the start does not wait on it. Relaxed: the barrier inits are already
            # released to the cluster by fence.mbarrier_init above.
            if cutlass.const_expr(self.options.relaxed_cluster_arrive):
                cute.arch.cluster_arrive_relaxed()
            else:
                cute.arch.cluster_arrive()

        if warp_idx == self.options.producer_warp:
            self.load_run(
                w_atom, w_coords, x_atom, x_coords, w_tiles, x_tiles, loads, weight_map, run_begin, run_end, k_blocks,
                trace, cta, tidx,
            )
        if warp_idx < self.options.producer_warp:
            if cutlass.const_expr(self.options.pdl):
                cute.arch.griddepcontrol_wait()  # out, partials and arrivals may still be in the previous grid's use
            # staged_store: y's staging area, the drained ring
            stage = cute.make_tensor(storage.w_tiles.data_ptr(), cute.make_layout(self.m_pad * STAGE_PITCH))
            self.mma_run(
                tiled_mma, w_tiles, x_tiles, loads, bias, out, partials, arrivals,
                storage.fixup_count.get_tensor(cute.make_layout(1)), cluster_partials,
                storage.cluster_barrier.data_ptr(), storage.drained_barrier.data_ptr(),
                cta, num_ctas, tidx, run_begin, run_end, k_blocks, total, trace, stage,
            )
            if cutlass.const_expr(self.options.trace):
                if tidx == 0:
                    trace[cta, 7] = cute.arch.clock64()
                    trace[cta, 1] = cute.arch.globaltimer()

    @cute.jit
    def load_run(
        self, w_atom, w_coords, x_atom, x_coords, w_tiles, x_tiles, loads, weight_map, run_begin, run_end, k_blocks,
        trace, cta, tidx,
    ):
        """Warp 4: TMA-load weight block (tile, kb) and x block kb for every iteration of this CTA's run."""
        # outside the elected copy branches, with the acquire fence; None: the atom's own descriptor (a kernel parameter)
        weight_map_ptr = (tma_desc_ptr(weight_map, scope=self.options.fence_scope)
                          if cutlass.const_expr(self.options.weight_descriptor == "cache") else None)
        w_policy = l2_evict_first_policy() if cutlass.const_expr(self.options.weight_eviction == "first") else None
        x_policy = l2_evict_last_policy() if cutlass.const_expr(self.options.x_eviction == "last") else None
        w_dst = cute.group_modes(w_tiles, 0, 2)
        x_dst = cute.group_modes(x_tiles, 0, 2)
        # Block coordinates in elements, carried across iterations rather than derived from `it`:
        # derived ones are computed inside cute.copy's elected branch, where ptxas moves them to
        # uniform registers with a predicated R2UR, an illegal instruction on sm_90a.
        tile = run_begin // k_blocks
        row = tile * TILE_N
        col = (run_begin - tile * k_blocks) * TILE_K
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        first = run_begin  # first iteration that loads weight and x together
        if cutlass.const_expr(self.options.weight_before_wait):
            # The weight blocks of the first ring's worth of iterations go out before the wait, their x
            # blocks after it: both land on the stage's barrier, which expects their sum.
            first = cutlass.min(run_end, run_begin + self.stages)
            x_col = col
            for _ in cutlass.range(run_begin, first, unroll=1):
                row, state, col = self._weight_load(w_atom, w_coords, w_dst, loads, state, row, col, k_blocks,
                                                    weight_map_ptr, w_policy, trace, cta, tidx)
            if cutlass.const_expr(self.options.trace):
                if tidx == self.options.producer_warp * 32:
                    trace[cta, 11] = Int64(first - run_begin)
            cute.arch.griddepcontrol_wait()  # x is the previous kernel's output
            if cutlass.const_expr(self.options.trace):
                if tidx == self.options.producer_warp * 32:
                    trace[cta, 4] = cute.arch.clock64()
            x_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
            for _ in cutlass.range(run_begin, first, unroll=1):
                x_smem_dst, x_src = self._block(x_atom, x_coords, x_dst, 0, x_col, self.m_pad)
                cute.copy(x_atom, x_src, x_smem_dst[(None, x_state.index)],
                          tma_bar_ptr=loads.producer_get_barrier(x_state), cache_policy=x_policy)
                x_state.advance()
                x_col = x_col + TILE_K
                if x_col == k_blocks * TILE_K:
                    x_col = 0
        elif cutlass.const_expr(self.options.pdl):
            cute.arch.griddepcontrol_wait()  # x is the previous kernel's output
        if cutlass.const_expr(self.options.trace and not self.options.weight_before_wait):
            if tidx == self.options.producer_warp * 32:
                trace[cta, 4] = cute.arch.clock64()
        # the trigger after the last weight load (load_trigger), and trigger_lead loads before it
        after_load = self.options.trigger_in_run
        trigger_at = run_end - 1 - self.options.trigger_lead
        for i in cutlass.range(first, run_end, unroll=1):
            w_smem_dst, w_src = self._block(w_atom, w_coords, w_dst, row, col, TILE_N)
            x_smem_dst, x_src = self._block(x_atom, x_coords, x_dst, 0, col, self.m_pad)
            loads.producer_acquire(state)  # waits for the slot, then expects stage_bytes on its barrier
            barrier = loads.producer_get_barrier(state)
            cute.copy(w_atom, w_src, w_smem_dst[(None, state.index)], tma_bar_ptr=barrier, tma_desc_ptr=weight_map_ptr,
                      cache_policy=w_policy)
            cute.copy(x_atom, x_src, x_smem_dst[(None, state.index)], tma_bar_ptr=barrier, cache_policy=x_policy)
            state.advance()
            if cutlass.const_expr(self.options.trace and not self.options.weight_before_wait):
                if tidx == self.options.producer_warp * 32 and state.count == 1:
                    trace[cta, 3] = cute.arch.clock64()
            col = col + TILE_K
            if col == k_blocks * TILE_K:
                col = 0
                row = row + TILE_N
            if cutlass.const_expr(after_load and self.options.trigger_lead > 0):
                if i == trigger_at:
                    cute.arch.griddepcontrol_launch_dependents()  # trigger_lead loads before the last
        if cutlass.const_expr(after_load):
            # every weight load of this CTA is issued (a no-op where the trigger_lead one went out: once per CTA)
            cute.arch.griddepcontrol_launch_dependents()
        loads.producer_tail(state)

    @cute.jit
    def _weight_load(self, w_atom, w_coords, w_dst, loads, state, row, col, k_blocks, weight_map_ptr, w_policy, trace,
                     cta, tidx):
        """One weight block before griddepcontrol.wait (its x block follows after it) at element (row, col) into
        state's stage; returns the next block's row, state (advanced) and the next block's col. Returning state lets
        the caller's loop carry it (a loop carries what its body rebinds), in the order the inlined loop had."""
        w_smem_dst, w_src = self._block(w_atom, w_coords, w_dst, row, col, TILE_N)
        loads.producer_acquire(state)
        cute.copy(
            w_atom, w_src, w_smem_dst[(None, state.index)],
            tma_bar_ptr=loads.producer_get_barrier(state), tma_desc_ptr=weight_map_ptr, cache_policy=w_policy,
        )
        state.advance()
        if cutlass.const_expr(self.options.trace):
            if tidx == self.options.producer_warp * 32 and state.count == 1:
                trace[cta, 3] = cute.arch.clock64()
        # Branch-free step to the next block: with an `if` here, ptxas predicates the R2UR of row.
        wrapped = (col + TILE_K) // (k_blocks * TILE_K)
        col = col + TILE_K - wrapped * (k_blocks * TILE_K)
        row = row + wrapped * TILE_N
        return row, state, col

    @staticmethod
    def _block(atom, coords, smem, row, col, rows):
        """(smem destination per stage, global source) of the rows x TILE_K block at element (row, col)."""
        block = cute.local_tile(cute.domain_offset((row, col), coords), (rows, TILE_K), (0, 0))
        return cpasync.tma_partition(atom, 0, cute.make_layout(1), smem, cute.group_modes(block, 0, 2))

    @cute.jit
    def mma_run(
        self, tiled_mma, w_tiles, x_tiles, loads, bias, out, partials, arrivals, fixup_count, cluster_partials,
        cluster_barrier, drained_barrier, cta, num_ctas, tidx, run_begin, run_end, k_blocks, total, trace, stage,
    ):
        """Warps 0-3: accumulate each segment (the part of the run inside one row tile), then finish it."""
        thr_mma = tiled_mma.get_slice(tidx)
        w_frag = tiled_mma.make_fragment_A(thr_mma.partition_A(w_tiles))
        x_frag = tiled_mma.make_fragment_B(thr_mma.partition_B(x_tiles))
        # (row in tile, x row) of every accumulator element this thread holds
        acc_coords = thr_mma.partition_C(cute.make_identity_tensor((TILE_N, self.m_pad)))
        acc = cute.make_rmem_tensor(acc_coords.shape, Float32)
        tile_sum = cute.make_rmem_tensor(acc_coords.shape, Float32)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        released = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)  # lags with 2 in flight

        it = run_begin
        while it < run_end:
            tile = it // k_blocks
            tile_begin = tile * k_blocks
            seg_end = cutlass.min(run_end, tile_begin + k_blocks)
            acc.fill(0.0)
            for i in cutlass.range(it, seg_end, unroll=1):
                loads.consumer_wait(state)
                if cutlass.const_expr(self.options.trace):
                    if tidx == 0 and state.count == 0:
                        trace[cta, 5] = cute.arch.clock64()
                warpgroup.fence()
                for k_phase in cutlass.range_constexpr(cute.size(w_frag, mode=[2])):
                    cute.gemm(
                        tiled_mma, acc,
                        w_frag[(None, None, k_phase, state.index)], x_frag[(None, None, k_phase, state.index)],
                        acc,
                    )
                warpgroup.commit_group()
                if cutlass.const_expr(self.options.wgmma_in_flight == 1):
                    warpgroup.wait_group(0)  # the stage is free only once wgmma has read it
                    loads.consumer_release(state)
                else:
                    warpgroup.wait_group(1)  # the previous stage's wgmma is done: that stage is free
                    if released.count != state.count:
                        loads.consumer_release(released)
                        released.advance()
                state.advance()
            if cutlass.const_expr(self.options.wgmma_in_flight == 2):
                warpgroup.wait_group(0)
                loads.consumer_release(released)
                released.advance()
            if cutlass.const_expr(self.options.trace):
                if tidx == 0 and seg_end == run_end:
                    trace[cta, 6] = cute.arch.clock64()

            if cutlass.const_expr(self.options.cluster_k > 1 and self.options.cluster_scatter):
                self.cluster_scatter(
                    acc, tile_sum, acc_coords, tile, bias, out, cluster_partials, cluster_barrier, drained_barrier,
                    tidx, trace, cta,
                )
            elif cutlass.const_expr(self.options.cluster_k > 1):
                self.cluster_reduce(
                    acc, tile_sum, acc_coords, tile, bias, out, cluster_partials, cluster_barrier, drained_barrier,
                    tidx, trace, cta,
                )
            elif it == tile_begin and seg_end == tile_begin + k_blocks:
                if cutlass.const_expr(self.staged):
                    self.store_staged(acc, acc_coords, tile, bias, out, stage, tidx)
                else:
                    self.store_tile(acc, acc_coords, tile, bias, out)
            else:
                self.finish_partial(
                    acc, tile_sum, acc_coords, tile, seg_end - it, it == run_begin, bias, out, partials,
                    arrivals, fixup_count, cta, num_ctas, tidx, k_blocks, total, trace,
                )
            it = seg_end

    @cute.jit
    def finish_partial(
        self, acc, tile_sum, acc_coords, tile, blocks, is_first_segment, bias, out, partials, arrivals,
        fixup_count, cta, num_ctas, tidx, k_blocks, total, trace,
    ):
        """Publish this CTA's partial of a row tile; the CTA that completes the tile sums all and writes y.

        Slot s of CTA c holds the partial of c's first segment (s = 0) or last segment (s = 1); only
        those can cover part of a tile. Layout [cta][slot][value][thread]: a warp stores 128 contiguous
        bytes at a time.
        """
        slot_elems = self.partial_elems
        slot = Int32(1)
        if is_first_segment:
            slot = Int32(0)
        base = (cta * 2 + slot) * slot_elems + tidx
        for v in cutlass.range(cute.size(acc), unroll_full=True):
            partials[base + v * self.mma_threads] = acc[v]
        # Release this thread's partial at GPU scope, then count the tile's blocks once for the CTA.
        cute.arch.fence_acq_rel_gpu()
        cute.arch.barrier(barrier_id=FIXUP_BARRIER, number_of_threads=self.mma_threads)
        if tidx == 0:
            before = cute.arch.atomic_add(arrivals.iterator + tile, Int32(blocks), sem="acq_rel", scope="gpu")
            fixup_count[0] = before + blocks
        cute.arch.barrier(barrier_id=FIXUP_BARRIER, number_of_threads=self.mma_threads)
        if fixup_count[0] == k_blocks:
            if cutlass.const_expr(self.options.trace):
                if tidx == 0:
                    trace[cta, 8] = cute.arch.clock64()
                    trace[cta, 9] = trace[cta, 9] + 1
            cute.arch.fence_acq_rel_gpu()  # acquire every other CTA's partial of this tile
            tile_begin = tile * k_blocks
            # CTAs whose runs hold the tile's first and last block: c owns iteration i iff
            # c * total // num_ctas <= i < (c + 1) * total // num_ctas
            first = (tile_begin + 1) * num_ctas // total
            first = first - 1 + Int32((tile_begin + 1) * num_ctas % total != 0)
            last = (tile_begin + k_blocks) * num_ctas // total
            last = last - 1 + Int32((tile_begin + k_blocks) * num_ctas % total != 0)
            # Sum in CTA order, a chunk of contributors at a time: all of a chunk's loads are issued before
            # the first add, so the chunk costs one L2 round trip (a chunk holds 64 values per thread).
            chunk = max(1, 64 // self.values)
            loaded = cute.make_rmem_tensor((chunk * self.values,), Float32)
            tile_sum.fill(0.0)
            for c0 in cutlass.range(first, last + 1, chunk, unroll=1):
                for j in cutlass.range_constexpr(chunk):
                    c = cutlass.min(c0 + j, last)  # past `last`: a repeat load, not added below
                    c_slot = Int32(1)
                    if c * total // num_ctas >= tile_begin:  # the tile is where c's run starts
                        c_slot = Int32(0)
                    c_base = (c * 2 + c_slot) * slot_elems + tidx
                    for v in cutlass.range(self.values, unroll_full=True):
                        loaded[j * self.values + v] = partials[c_base + v * self.mma_threads]
                for j in cutlass.range_constexpr(chunk):
                    if c0 + j <= last:
                        for v in cutlass.range(self.values, unroll_full=True):
                            tile_sum[v] = tile_sum[v] + loaded[j * self.values + v]
            self.store_tile(tile_sum, acc_coords, tile, bias, out)
            if tidx == 0:
                arrivals[tile] = Int32(0)  # ready for the next launch or graph replay

    @cute.jit
    def cluster_reduce(self, acc, tile_sum, acc_coords, tile, bias, out, cluster_partials, cluster_barrier,
                       drained_barrier, tidx, trace, cta):
        """Cluster split: CTAs 1..cluster_k-1 send their partial into CTA 0's shared memory with st.async, which
        counts the bytes on CTA 0's barrier; CTA 0 waits for all of them, adds them to its own in rank order
        (deterministic) and writes y.

        Received partials: [rank - 1][value // 4][thread][value % 4], so each thread sends 16-byte pieces. In a
        buffer of their own, or (self.in_ring) over CTA 0's weight ring: there CTA 0, once its 4 MMA warps are past
        their last wgmma (every TMA load of its run has landed and been read), arrives on each sender's
        drained_barrier, and a sender waits for that before it sends.
        """
        rank = cute.arch.block_idx_in_cluster()
        slot_elems = self.partial_elems
        self.delay_first_cta(rank)
        if cutlass.const_expr(self.in_ring):
            if rank == 0:
                # wgmma read the ring through the async proxy; the senders' stores must come after those reads
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=FIXUP_BARRIER, number_of_threads=self.mma_threads)
                cute.arch.cluster_wait()  # every sender has initialised its drained_barrier
                if tidx < self.options.cluster_k - 1:
                    cute.arch.mbarrier_arrive(drained_barrier, tidx + 1, scope=_CLUSTER_SCOPE)
        if rank != 0:
            cute.arch.cluster_wait()  # CTA 0 has started and initialised its barrier
            if cutlass.const_expr(self.in_ring):
                cute.arch.mbarrier_wait(drained_barrier, 0)  # CTA 0 is done with its ring
            bits = cute.recast_tensor(acc, Int32)
            for q in cutlass.range_constexpr(cute.size(acc) // 4):
                offset = cute.assume((rank - 1) * slot_elems + q * 4 * self.mma_threads + tidx * 4, divby=4)
                cute.arch.store_async_dsmem(
                    cluster_partials.iterator + offset,
                    (bits[4 * q], bits[4 * q + 1], bits[4 * q + 2], bits[4 * q + 3]),
                    cluster_barrier, 0,
                )
            if cutlass.const_expr(self.options.trace):
                if tidx == 0:
                    trace[cta, 12] = cute.arch.clock64()
        else:
            cute.arch.mbarrier_wait(cluster_barrier, 0)
            if cutlass.const_expr(self.options.trace):
                if tidx == 0:
                    trace[cta, 8] = cute.arch.clock64()
                    trace[cta, 9] = Int64(1)
            for v in cutlass.range(cute.size(acc), unroll_full=True):
                tile_sum[v] = acc[v]
            for r in cutlass.range_constexpr(self.options.cluster_k - 1):
                for v in cutlass.range(cute.size(acc), unroll_full=True):
                    tile_sum[v] = tile_sum[v] + cluster_partials[
                        r * slot_elems + (v // 4) * 4 * self.mma_threads + tidx * 4 + v % 4]
            self.store_tile(tile_sum, acc_coords, tile, bias, out)

    @cute.jit
    def cluster_scatter(self, acc, tile_sum, acc_coords, tile, bias, out, cluster_partials, cluster_barrier,
                        drained_barrier, tidx, trace, cta):
        """Cluster split, reduce-scatter (KernelOptions.cluster_scatter): a thread's accumulator values are cut into
        16-byte pieces of 4, and piece q belongs to rank owner(q) (the ranks take equal runs of pieces, in order).
        Each CTA sends every piece it does not own to its owner with st.async (counted in bytes on the owner's
        barrier), waits for its own pieces from the others, adds them in rank order and writes those y values.

        Received: [sender's slot (its rank, less one above the receiver's)][piece - first owned][thread][value % 4],
        a slot as long as the largest share. In a buffer of their own, or (self.in_ring) over the receiver's weight
        ring: there every CTA, once its MMA warps are past their last wgmma, arrives on every other CTA's
        drained_barrier, and sends only once all the others have arrived on its own.
        """
        rank = cute.arch.block_idx_in_cluster()
        cluster_k = self.options.cluster_k
        pieces = self.values // 4
        first, owner = scatter_shares(pieces, cluster_k, self.scatter_to_last)
        slot = max(first[r + 1] - first[r] for r in range(cluster_k)) * 4 * self.mma_threads
        self.delay_first_cta(rank)
        if cutlass.const_expr(self.in_ring):
            # wgmma read the ring through the async proxy; the other CTAs' stores must come after those reads
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=FIXUP_BARRIER, number_of_threads=self.mma_threads)
        cute.arch.cluster_wait()  # every CTA has started and initialised its barriers
        if cutlass.const_expr(self.in_ring):
            if tidx < cluster_k and tidx != rank:
                cute.arch.mbarrier_arrive(drained_barrier, tidx, scope=_CLUSTER_SCOPE)
            cute.arch.mbarrier_wait(drained_barrier, 0)  # every other CTA is done with its ring
        bits = cute.recast_tensor(acc, Int32)
        for q in cutlass.range_constexpr(pieces):
            r = owner[q]
            if rank != r:
                sender_slot = rank - Int32(rank > r)
                offset = cute.assume(sender_slot * slot + (q - first[r]) * 4 * self.mma_threads + tidx * 4, divby=4)
                cute.arch.store_async_dsmem(
                    cluster_partials.iterator + offset,
                    (bits[4 * q], bits[4 * q + 1], bits[4 * q + 2], bits[4 * q + 3]),
                    cluster_barrier, r,
                )
        if cutlass.const_expr(self.options.trace):
            if tidx == 0:
                trace[cta, 12] = cute.arch.clock64()
        for r in cutlass.range_constexpr(cluster_k):
            if cutlass.const_expr(first[r] < first[r + 1]):
                if rank == r:
                    cute.arch.mbarrier_wait(cluster_barrier, 0)
                    if cutlass.const_expr(self.options.trace):
                        if tidx == 0:
                            trace[cta, 8] = cute.arch.clock64()
                            trace[cta, 9] = Int64(1)
                    for v in cutlass.range_constexpr(4 * first[r], 4 * first[r + 1]):
                        base = (v // 4 - first[r]) * 4 * self.mma_threads + tidx * 4 + v % 4
                        for src in cutlass.range_constexpr(cluster_k):  # rank order, as cluster_reduce
                            if cutlass.const_expr(src == r):
                                part = acc[v]
                            else:
                                part = cluster_partials[(src - int(src > r)) * slot + base]
                            if cutlass.const_expr(src == 0):
                                tile_sum[v] = part
                            else:
                                tile_sum[v] = tile_sum[v] + part
                    self.store_tile(tile_sum, acc_coords, tile, bias, out, 4 * first[r], 4 * first[r + 1])

    @cute.jit
    def delay_first_cta(self, rank):
        """A test build's delay (KernelOptions.late_first_cta_ns): CTA 0 of the cluster spins that long before its
        part of the reduction, so the other CTAs reach their waits first. Nothing in shipped builds."""
        if cutlass.const_expr(self.options.late_first_cta_ns):
            if rank == 0:
                start = cute.arch.globaltimer()
                now = start
                while now - start < Int64(self.options.late_first_cta_ns):
                    now = cute.arch.globaltimer()

    @cute.jit
    def store_tile(self, values, acc_coords, tile, bias, out, lo=0, hi=None):
        """y[m, n] = values (+ bias[n]) for this thread's elements of row tile `tile` with m < M, n < N: values
        lo..hi-1 (compile-time bounds), all of them by default."""
        M, N = out.shape
        for v in cutlass.range(lo, cute.size(values) if cutlass.const_expr(hi is None) else hi, unroll_full=True):
            row, m = acc_coords[v]
            n = tile * TILE_N + row
            if n < N and m < M:
                y = values[v]
                if cutlass.const_expr(self.has_bias):
                    y = y + bias[n].to(Float32)
                out[m, n] = y.to(self.dtype)

    @cute.jit
    def store_staged(self, values, acc_coords, tile, bias, out, stage, tidx):
        """store_tile through shared memory (KernelOptions.staged_store): each MMA thread writes its values (bias added,
        converted) into `stage` as y's rows of the tile (x row m at m * STAGE_PITCH), then the MMA threads store the
        tile's m_pad x 16 runs of 8 outputs, 16 bytes each, consecutive threads along a row. Runs past M or N are left
        out; where y's rows are not 16-byte aligned, or at N's ragged end, a run is stored one output at a time."""
        M, N = out.shape
        # the ring's last bytes were written by TMA and read by wgmma (the async proxy): those come first
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=FIXUP_BARRIER, number_of_threads=self.mma_threads)
        for v in cutlass.range(cute.size(values), unroll_full=True):
            row, m = acc_coords[v]
            y = values[v]
            if cutlass.const_expr(self.has_bias):
                y = y + bias[cutlass.min(tile * TILE_N + row, N - 1)].to(Float32)  # past N: a value not stored
            stage[m * STAGE_PITCH + row] = y.to(self.dtype)
        cute.arch.barrier(barrier_id=FIXUP_BARRIER, number_of_threads=self.mma_threads)
        row_stride = out.layout.stride[0]
        aligned = row_stride % 8 == 0 and out.iterator.toint() % 16 == 0
        runs_per_row = TILE_N // 8
        for first_run in cutlass.range_constexpr(0, self.m_pad * runs_per_row, self.mma_threads):
            m = (first_run + tidx) // runs_per_row
            col = (first_run + tidx) % runs_per_row * 8  # the run's first weight row in the tile
            n = tile * TILE_N + col
            if m < M and n < N:
                src = cute.make_tensor(stage.iterator + cute.assume(m * STAGE_PITCH + col, divby=8), cute.make_layout(8))
                if aligned and n + 8 <= N:
                    run_values = cute.make_rmem_tensor((8,), self.dtype)
                    cute.autovec_copy(src, run_values)
                    dst = cute.make_ptr(self.dtype, (out.iterator + (m * row_stride + n)).toint(), cute.AddressSpace.gmem,
                                        assumed_align=16)
                    cute.autovec_copy(run_values, cute.make_tensor(dst, cute.make_layout(8)))
                else:
                    for e in cutlass.range_constexpr(8):
                        if n + e < N:
                            out[m, n + e] = src[e]

def _fake_problem(dtype: type[cutlass.Numeric], has_bias: bool):
    """Fake tensors with symbolic sizes for compiling once per static configuration.

    Shared symbols make TVM-FFI check at every call that the shapes agree: x [M, K], weight [N, K]
    with row stride K (contiguous), bias [N], out [M, N]; row strides of x and out are free.
    """
    M, N, K = cute.sym_int(), cute.sym_int(), cute.sym_int(divisibility=8)
    x = cute.runtime.make_fake_tensor(dtype, (M, K), stride=(cute.sym_int64(divisibility=8), 1), assumed_align=16)
    weight = cute.runtime.make_fake_tensor(dtype, (N, K), stride=(K, 1), assumed_align=16)
    bias = cute.runtime.make_fake_tensor(dtype, (N,), stride=(1,)) if has_bias else None
    out = cute.runtime.make_fake_tensor(dtype, (M, N), stride=(cute.sym_int64(), 1))
    partials = cute.runtime.make_fake_tensor(Float32, (cute.sym_int(),), stride=(1,), assumed_align=16)
    arrivals = cute.runtime.make_fake_tensor(Int32, (cute.sym_int(),), stride=(1,), assumed_align=4)
    return x, weight, bias, out, partials, arrivals


@functools.cache
def compile_kernel(
    dtype: type[cutlass.Numeric],
    m_pad_: int,
    has_bias: bool,
    extra_options: str = "",
    options: KernelOptions = DEFAULT_OPTIONS,
):
    """The kernel compiled for one static configuration (sm_90a, TVM-FFI), cached for the process.

    Called as f(x, weight, bias, out, partials, arrivals, weight_map_address, num_ctas) with torch
    tensors (a workspace's: arrivals int32 [ARRIVAL_WORDS], zero), num_ctas = grid_size(N, K, sm_count, options);
    it launches on the current torch stream.
    extra_options go to cute.compile (e.g. "--keep-ptx --dump-dir=DIR" to inspect the code).
    """
    beside = partials_beside_ring(m_pad_, options)
    if options.cluster_k > 1 and not beside and not _fits_cluster(m_pad_, options.cluster_k, options.smem_slots,
                                                                  options.own_partial_bytes):
        raise ValueError(f"compile_kernel: the partials of a cluster_k={options.cluster_k} build do not fit beside or "
                         f"in the ring of m_pad={m_pad_} with the SM's shared memory in {options.smem_slots} shares")
    stages = ring_stages(m_pad_, options)
    kernel = WeightStreamingLinear(dtype, m_pad_, has_bias, stages, options)
    # options.trace: one more argument, the int64 [num_ctas, len(TRACE_FIELDS)] timeline
    trace = (cute.runtime.make_fake_tensor(Int64, (cute.sym_int(), len(TRACE_FIELDS)), stride=(len(TRACE_FIELDS), 1))
             if options.trace else None)
    return cute.compile(
        kernel,
        *_fake_problem(dtype, has_bias),
        Int64(0),
        Int32(1),
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
        trace,
        options=f"--gpu-arch sm_90a --enable-tvm-ffi {extra_options}",
    )


class _Workspace(NamedTuple):
    partials: torch.Tensor  # fp32 [sm_count * 2 * max(M_PADS) * TILE_N]: two partial tiles per CTA
    arrivals: torch.Tensor  # int32 [ARRIVAL_WORDS]: blocks counted per row tile; zero between launches


_workspaces: dict[tuple[int, int], _Workspace] = {}
_capture_workspaces: dict[int, _Workspace] = {}


def _new_workspace(device_index: int) -> _Workspace:
    device = torch.device("cuda", device_index)
    ctas = _sm_count(device_index) * DEFAULT_OPTIONS.ctas_per_sm
    partials = long_lived_empty(ctas * 2 * M_PADS[-1] * TILE_N, torch.float32, device)
    arrivals = long_lived_empty(ARRIVAL_WORDS, torch.int32, device, zero=True)
    return _Workspace(partials, arrivals)


def _workspace(device_index: int) -> _Workspace:
    """The split-K workspace of the current stream on CUDA device `device_index` (9 MB on an H200), made on
    first use.

    One per (device, stream): launches on one stream run in order and leave the counters at zero, so
    they share it; launches on different streams must not. Never freed or regrown, so a CUDA graph
    that captured it stays valid. A stream seen first while it captures a graph takes the device's capture
    workspace, made (outside any graph pool) with the first eager workspace: allocating during capture would
    put it in the graph's pool, which torch.compile's cudagraph trees refuse. Graphs that share it must not be
    replayed concurrently on different streams. A graph captured on a stream that launched eagerly before holds that
    stream's workspace: replay it on that stream, or not while eager launches run there (the stream-K builds, more
    row tiles than two per SM, sum partials through it; the cluster builds do not touch it).
    """
    # The raw cudaStream_t, as inductor's generated code reads it: torch.cuda.current_stream() builds a
    # Stream object per call.
    key = (device_index, torch._C._cuda_getCurrentRawStream(device_index))
    ws = _workspaces.get(key)
    if ws is None:
        if torch.cuda.is_current_stream_capturing():
            if device_index not in _capture_workspaces:
                raise RuntimeError("tma::linear: first call on this device during CUDA-graph capture; run one "
                                   "eager call (warm-up) before capturing")
            return _capture_workspaces[device_index]
        if device_index not in _capture_workspaces:
            _capture_workspaces[device_index] = _new_workspace(device_index)
        ws = _workspaces[key] = _new_workspace(device_index)
    return ws


@functools.cache
def _launch_config(device_index: int, dtype: torch.dtype, M: int, N: int, K: int, has_bias: bool):
    """(compiled kernel, num_ctas) of one problem shape: compile_kernel's cache key and the grid, worked out
    once per shape rather than on every call."""
    sm_count, capacity = _device_limits(device_index)
    options = options_for(DEFAULT_OPTIONS, N, K, M, sm_count, capacity)
    compiled = compile_kernel(_DTYPES[dtype], m_pad(M), has_bias, options=options)
    return compiled, grid_size(N, K, sm_count, options)


def linear_out(
    x2d: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    out: torch.Tensor,
    weight_map_ptr: int,
    *,
    l2_promotion: L2Promotion,
) -> None:
    """out = x2d @ weight^T (+ bias), launched on the current torch stream.

    x2d [M, K] (rows may be strided, unit column stride), weight [N, K] contiguous, bias [N] or None,
    out [M, N] with unit column stride, all one dtype; unsupported_reason(x2d, weight, bias) must be
    None. weight_map_ptr is the device address of weight's 128-byte descriptor, encoded for
    box=weight_box(N, K, dtype), swizzle=weight_swizzle(dtype) and l2_promotion (the kernel reads
    weight's bytes only through it; the promotion is recorded there, the kernel itself does not
    depend on it).
    """
    if not isinstance(l2_promotion, L2Promotion):
        raise TypeError(f"linear_out: l2_promotion must be a torch_tma.L2Promotion, got {l2_promotion!r}")
    M, K = x2d.shape
    N = weight.shape[0]
    dtype = x2d.dtype
    if out.shape != (M, N) or out.dtype != dtype or out.stride(1) != 1:
        raise ValueError(
            f"linear_out: out must be [{M}, {N}] {dtype} with unit column stride, got "
            f"{tuple(out.shape)} {out.dtype} strides {out.stride()}"
        )
    device_index = weight.get_device()
    if device_index != torch.cuda.current_device():  # the launch goes to the current device's context
        with torch.cuda.device(device_index):
            return linear_out(x2d, weight, bias, out, weight_map_ptr, l2_promotion=l2_promotion)
    ws = _workspace(device_index)  # first: it refuses a device's first call during capture, _launch_config would sync
    compiled, num_ctas = _launch_config(device_index, dtype, M, N, K, bias is not None)
    compiled(x2d, weight, bias, out, ws.partials, ws.arrivals, weight_map_ptr, num_ctas)


def linear_ref(x2d: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """float64 reference of x2d @ weight^T (+ bias), on x2d's device."""
    y = x2d.double() @ weight.double().t()
    return y if bias is None else y + bias.double()
