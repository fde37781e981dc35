"""The weight-streaming linear kernel (torch_tma/kernels/linear.py), below the op.

CPU (CI, CUTE_DSL_ARCH=sm_90a): every static configuration compiles for sm_90a, loads the weight through
the descriptor argument after the acquire fence, issues the wgmma shape it is built for, and (where
nvdisasm is installed) has no predicated R2UR; the descriptor the op requests (weight_box, weight_swizzle)
equals the one the kernel's own TMA atom describes.

GPU (requires_sm90, hard timeouts: a TMA or mbarrier mistake hangs instead of failing): results against a
float64 reference with the output poisoned, for every benchmark shape and ragged ones, every M in 1..64,
with and without bias, both dtypes; strided x rows, a weight at a storage offset, no writes outside out,
every L2 promotion, determinism, counters left at zero, CUDA-graph replay; every unsupported_reason.
"""

import functools
import glob
import math
import os
import re
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

import cutlass
import cutlass.cute as cute
import cutlass.utils
from cutlass import Int32, Int64
from cutlass.cute.nvgpu import cpasync

import torch_tma
import torch_tma.cute as tma_cute
from torch_tma.kernels import linear
from test_ops import assert_matches_reference

DSL_DTYPES = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}
CONFIGS = [(dtype, m_pad, bias) for dtype in DSL_DTYPES for m_pad in linear.M_PADS for bias in (False, True)]
CONFIG_IDS = [f"{str(d).split('.')[1]}-m{m}-{'bias' if b else 'nobias'}" for d, m, b in CONFIGS]

# (N, K) of benchmarks/bench_linear.py, then ragged ones: N and K not multiples of the 128 x 64 weight
# block (K a multiple of 8, not of 64), a single block, and a tail of 8 columns.
BENCH_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (10240, 8192), (57344, 8192), (8192, 28672)]
RAGGED_SHAPES = [(1000, 1000), (129, 72), (1, 8), (8191, 4104), (300, 200)]
# The other weights the sweeps and the decode benchmark time (Llama-3-8B k/v, gate/up, lm_head)
DECODE_SHAPES = [(1024, 4096), (14336, 4096), (128256, 4096)]
GPU_TIMEOUT_S = 300


# Non-default KernelOptions (benchmarks/sweep_linear.py times them on the H200)
OPTION_VARIANTS = [
    linear.KernelOptions(fence_scope="gpu"),
    linear.KernelOptions(fence_scope="gpu", pdl=True),
    linear.KernelOptions(fence_scope="gpu", pdl=True, weight_before_wait=True),
    linear.KernelOptions(fence_scope="sys", pdl=True, weight_before_wait=True, ctas_per_sm=2),
    linear.KernelOptions(fence_scope="gpu", ctas_per_sm=2),
    linear.KernelOptions(fence_scope="sys", pdl=True, weight_before_wait=True, smem_share=2),
    linear.KernelOptions(fence_scope="gpu", pdl=True, weight_before_wait=True, smem_share=3),
    linear.KernelOptions(fence_scope="sys", pdl=True, weight_before_wait=True, smem_share=2, cluster_split=2),
    linear.KernelOptions(fence_scope="gpu", smem_share=2, cluster_split=1),
    linear.KernelOptions(fence_scope="sys", pdl=True, weight_before_wait=True, smem_share=2, cluster_split=1,
                         early_trigger=False),
    linear.KernelOptions(fence_scope="sys", pdl=True, weight_before_wait=True, smem_share=2, cluster_split=1,
                         early_trigger=False, wgmma_in_flight=2),
    linear.KernelOptions(fence_scope="sys", pdl=True, weight_before_wait=True, smem_share=2, wgmma_in_flight=2),
    linear.DEFAULT_OPTIONS._replace(cluster_fit=False),
    linear.DEFAULT_OPTIONS._replace(early_trigger=False, load_trigger=True),
    linear.DEFAULT_OPTIONS._replace(consumer_warpgroups=2),
    linear.DEFAULT_OPTIONS._replace(smem_share=1, wgmma_in_flight=2),  # the deep ring (deep_ring_blocks) at every M
    # alone on its SMs, triggering after the last load wherever the grid fits (exclusive_trigger_grid=1), and
    # exclusive_sm on every build, stream-K too
    linear.DEFAULT_OPTIONS._replace(exclusive_trigger_grid=1.0, exclusive_sm=True),
    linear.DEFAULT_OPTIONS._replace(cluster_scatter=False),  # CTA 0 of a cluster sums and stores all of y
    linear.DEFAULT_OPTIONS._replace(own_partial_bytes=0),  # every cluster build's partials in the drained ring
    # alone on the SM, partials above OWN_PARTIAL_BYTES in the drained ring rather than in the SM's other half
    linear.DEFAULT_OPTIONS._replace(partials_beside=False),
    # one-CTA-per-tile builds storing y one output at a time (shipped: through shared memory, staged_store)
    linear.DEFAULT_OPTIONS._replace(staged_store=False),
]
OPTION_IDS = [f"{o.fence_scope}-pdl{int(o.pdl)}-wbw{int(o.weight_before_wait)}-cta{o.ctas_per_sm}-share{o.smem_share}"
              f"-cluster{o.cluster_split}{'fit' * o.cluster_fit}-early{int(o.early_trigger)}-wgmma{o.wgmma_in_flight}"
              f"{'-prefetch' * bool(o.descriptor_prefetch)}{'-loadtrigger' * o.load_trigger}"
              f"{'-2wg' * (o.consumer_warpgroups == 2)}{'-exclusive' * o.exclusive_sm}"
              f"{'-reduce0' * (o.cluster_split > 0 and not o.cluster_scatter)}"
              f"{'-ring' * (o.own_partial_bytes != linear.OWN_PARTIAL_BYTES)}{'-nobeside' * (o.cluster_scatter and not o.partials_beside)}"
              f"{'-direct' * (o == linear.DEFAULT_OPTIONS._replace(staged_store=False))}"
              for o in OPTION_VARIANTS]


# A 2-D TMA load in PTX; group 1 is the register holding the descriptor address it reads through.
TMA_LOAD_DESCRIPTOR = re.compile(r"cp\.async\.bulk\.tensor\.2d\.shared::cta\.global\.tile\S* \[[^\]]+\], \[(%rd\d+), \{")
# A cluster split's 16-byte partial piece sent to another CTA's shared memory, counted on its mbarrier; and a remote
# mbarrier arrive released at cluster scope (the word that a CTA's ring is drained).
ST_ASYNC_SEND = re.compile(r"st\.async\.shared::cluster\.mbarrier::complete_tx::bytes\.v4\.b32")
DRAINED_ARRIVE = re.compile(r"mbarrier\.arrive\.release\.cluster\.shared::cluster\.b64")


def _ptx_and_cubin(dtype, m_pad, has_bias, tmp_path, options=linear.DEFAULT_OPTIONS):
    """PTX text and cubin path of one build, compiled anew into tmp_path (compile_kernel's cache would return a build
    an earlier test compiled without dumping it)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    linear.compile_kernel.__wrapped__(
        DSL_DTYPES[dtype], m_pad, has_bias, f"--keep-ptx --keep-cubin --dump-dir={tmp_path}", options
    )
    (ptx,) = glob.glob(str(tmp_path / "*.ptx"))
    (cubin,) = glob.glob(str(tmp_path / "*.cubin"))
    with open(ptx) as f:
        return f.read(), cubin


# ---- CPU: compiled code ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,m_pad,has_bias", CONFIGS, ids=CONFIG_IDS)
def test_kernel_compiles_for_sm90a(dtype, m_pad, has_bias, tmp_path):
    ptx, _ = _ptx_and_cubin(dtype, m_pad, has_bias, tmp_path)
    assert re.search(r"^\.target sm_90a", ptx, re.M), "not compiled for sm_90a"
    # The weight descriptor address is the kernel's Int64 argument; it is acquired, then every weight load
    # reads through it, and x loads through the atom's own descriptor: one weight and one x load site per
    # loop (two loops when the weight is loaded before the PDL wait).
    (fenced,) = re.findall(r"fence\.proxy\.tensormap::generic\.acquire\.\w+ \[(%rd\d+)\], 128;", ptx)
    loads = TMA_LOAD_DESCRIPTOR.findall(ptx)
    sites = 4 if linear.DEFAULT_OPTIONS.weight_before_wait else 2
    assert len(loads) == sites and loads.count(fenced) == sites // 2, (fenced, loads)
    argument = re.search(r"ld\.param\.b64\s+" + re.escape(fenced) + r", \[\w+_param_(\d+)\];", ptx)
    assert argument, f"the fenced descriptor {fenced} is not loaded from a kernel argument"
    ab = "bf16" if dtype == torch.bfloat16 else "f16"
    mma = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.f32\.(\w+)\.(\w+)", ptx))
    assert mma == {(f"m64n{m_pad}k16", ab, ab)}, mma


def test_param_descriptor_build_loads_the_weight_without_our_descriptor(tmp_path):
    """The measurement build weight_descriptor="param" loads W through the atom's own descriptor (a kernel parameter):
    no tensormap fence, and no load reads through the Int64 argument the shipped build fences."""
    options = linear.DEFAULT_OPTIONS._replace(weight_descriptor="param", cluster_k=3)
    ptx, _ = _ptx_and_cubin(torch.bfloat16, 8, False, tmp_path, options)
    assert "fence.proxy.tensormap" not in ptx
    loads = TMA_LOAD_DESCRIPTOR.findall(ptx)
    assert len(loads) == 4, loads  # weight before and after the PDL wait, x after it: four sites as shipped
    for register in loads:  # each one a 128-byte kernel parameter's address
        assert re.search(r"cvta\.param\.u64\s+" + re.escape(register) + r", ", ptx), register
    with pytest.raises(ValueError, match="weight_descriptor"):
        options._replace(weight_descriptor="global").check()


@pytest.mark.parametrize("where", ["entry", "entry-acquired"])
def test_descriptor_prefetch_builds_prefetch_before_the_barriers(where, tmp_path):
    """descriptor_prefetch: the TMA warp prefetches the weight descriptor (after a fence for "entry-acquired") before
    the first mbarrier is set up, and the loads still read through the address tma_desc_ptr fences later."""
    options = linear.DEFAULT_OPTIONS._replace(descriptor_prefetch=where, cluster_k=3)
    ptx, _ = _ptx_and_cubin(torch.bfloat16, 8, False, tmp_path, options)
    fence = r"fence\.proxy\.tensormap::generic\.acquire\.sys \[(%rd\d+)\], 128;"
    (early,) = re.findall((fence + " " if where == "entry-acquired" else "") + r"prefetch\.tensormap \[(%rd\d+)\];",
                          ptx)
    assert ptx.index("prefetch.tensormap") < ptx.index("mbarrier.init")
    late = [m for m in re.finditer(fence + r"\n", ptx) if m.start() > ptx.index("mbarrier.init")]
    loads = TMA_LOAD_DESCRIPTOR.findall(ptx)
    assert len(late) == 1 and loads.count(late[0].group(1)) == 2, (early, late, loads)
    with pytest.raises(ValueError, match="descriptor_prefetch"):
        options._replace(descriptor_prefetch="start").check()


def _nvdisasm():
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia

        candidates = [os.path.join(p, "cu13", "bin", "nvdisasm") for p in nvidia.__path__]
    except ImportError:
        candidates = []
    return next((c for c in candidates if os.path.exists(c)), None)


def _predicated_r2ur(cubin, nvdisasm):
    """(UTMALDG count, predicated R2UR instructions) of a cubin's SASS."""
    sass = subprocess.run([nvdisasm, "-c", cubin], check=True, capture_output=True, text=True).stdout
    return sass.count("UTMALDG"), re.findall(r"@!?P\d\s+R2UR\b.*", sass)


@pytest.mark.parametrize("m_pad", [linear.M_PADS[0], linear.M_PADS[-1]])
def test_no_predicated_r2ur(m_pad, tmp_path):
    """A uniform-register move under an elected thread's predicate is an illegal instruction on sm_90a
    (error 715 at run time, seen in CUTLASS's Hopper grouped GEMM). The loading warp keeps its block
    coordinates loop-carried so that none is computed inside cute.copy's elected branch."""
    nvdisasm = _nvdisasm()
    if nvdisasm is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")
    _, cubin = _ptx_and_cubin(torch.bfloat16, m_pad, True, tmp_path)
    tma_loads, predicated = _predicated_r2ur(cubin, nvdisasm)
    assert tma_loads >= 2, "expected the weight and the x TMA loads"
    assert not predicated, predicated


@pytest.mark.parametrize("options", OPTION_VARIANTS, ids=OPTION_IDS)
def test_kernel_options_compile(options, tmp_path):
    """Each option reaches the code: the fence scope, griddepcontrol (one trigger, a second in the load loop for
    trigger_lead; waits only with pdl),
    weight loads through the fenced descriptor (twice as many load sites with weight_before_wait), and no
    predicated R2UR in the extra load loop."""
    ptx, cubin = _ptx_and_cubin(torch.bfloat16, 16, True, tmp_path, options)
    (fenced,) = re.findall(rf"fence\.proxy\.tensormap::generic\.acquire\.{options.fence_scope} \[(%rd\d+)\], 128;", ptx)
    loads = TMA_LOAD_DESCRIPTOR.findall(ptx)
    sites = 4 if options.weight_before_wait else 2
    assert len(loads) == sites and loads.count(fenced) == sites // 2, (fenced, loads)
    lead = options.trigger_in_run and options.trigger_lead > 0
    assert ptx.count("griddepcontrol.launch_dependents;") == int(options.pdl and (options.early_trigger
                                                                                  or options.load_trigger)) + lead
    assert (ptx.count("griddepcontrol.wait;") > 0) == options.pdl
    nvdisasm = _nvdisasm()
    if nvdisasm is not None:
        assert not _predicated_r2ur(cubin, nvdisasm)[1]


@pytest.mark.parametrize("m_pad", linear.M_PADS)
@pytest.mark.parametrize("slots", [1, 2, 3])
def test_pipeline_fits_shared_memory(m_pad, slots):
    """`slots` rings, their reserve and the driver's per-CTA KiB fit in one SM; one more stage would not."""
    stages = linear.pipeline_stages(m_pad, slots)
    stage_bytes = (linear.TILE_N + m_pad) * linear.TILE_K * 2
    per_cta = stages * stage_bytes + linear.SMEM_RESERVED
    assert stages >= 2 and per_cta <= linear.SMEM_BYTES
    assert slots * (per_cta + linear.SMEM_PER_CTA_SYSTEM) <= linear.SMEM_PER_SM
    budget = min(linear.SMEM_BYTES, linear.SMEM_PER_SM // slots - linear.SMEM_PER_CTA_SYSTEM)
    assert per_cta + stage_bytes > budget


STORAGE_CASES = [(share, m_pad, cluster_k) for share in (1, 2, 3) for m_pad in linear.M_PADS
                 for cluster_k in (0, *range(2, linear.MAX_CLUSTER_K + 1))
                 if not cluster_k or linear._fits_cluster(m_pad, cluster_k, share)]
# (m_pad, cluster_k) of every cluster build the policy can pick with two CTA shares per SM (DEFAULT_OPTIONS)
CLUSTER_BUILDS = [(m_pad, cluster_k) for m_pad in linear.M_PADS for cluster_k in range(2, linear.MAX_CLUSTER_K + 1)
                  if linear._fits_cluster(m_pad, cluster_k, 2)]


def _launch_smem_bytes(m_pad, stages, options):
    """Shared memory a bf16 build without bias launches with: its SharedStorage (barriers, ring, received partials),
    sized once the kernel is compiled for sm_90a."""
    kernel = linear.WeightStreamingLinear(DSL_DTYPES[torch.bfloat16], m_pad, False, stages, options)
    cute.compile(kernel, *linear._fake_problem(DSL_DTYPES[torch.bfloat16], False), Int64(0), Int32(1),
                 cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True), None,
                 options="--gpu-arch sm_90a --enable-tvm-ffi")
    return kernel.shared_storage.size_in_bytes()


@pytest.mark.parametrize("share,m_pad,cluster_k", STORAGE_CASES,
                         ids=[f"share{s}-m{m}-cluster{c}" for s, m, c in STORAGE_CASES])
def test_shared_storage_fits_the_share(share, m_pad, cluster_k):
    """The shared memory the kernel launches with (its SharedStorage: barriers, ring, received partials) fits one
    CTA's share of the SM, so smem_share CTAs fit per SM and the launch is not rejected."""
    options = linear.DEFAULT_OPTIONS._replace(smem_share=share, cluster_k=cluster_k)
    used = _launch_smem_bytes(m_pad, linear.pipeline_stages(m_pad, share, cluster_k), options)
    assert used <= min(linear.SMEM_BYTES, linear.SMEM_PER_SM // share - linear.SMEM_PER_CTA_SYSTEM), used


def test_kernel_options_check():
    with pytest.raises(ValueError, match="fence_scope"):
        linear.KernelOptions(fence_scope="cta").check()
    with pytest.raises(ValueError, match="weight_before_wait"):
        linear.KernelOptions(weight_before_wait=True).check()
    with pytest.raises(ValueError, match="ctas_per_sm"):
        linear.KernelOptions(ctas_per_sm=3).check()
    with pytest.raises(ValueError, match="smem_share"):
        linear.KernelOptions(smem_share=4).check()
    with pytest.raises(ValueError, match="wgmma_in_flight"):
        linear.KernelOptions(wgmma_in_flight=3).check()
    with pytest.raises(ValueError, match="load_trigger"):
        linear.KernelOptions(load_trigger=True).check()
    with pytest.raises(ValueError, match="exclusive_trigger_grid and exclusive_sm"):
        linear.KernelOptions(exclusive_sm=True).check()
    with pytest.raises(ValueError, match="exclusive_trigger_grid and exclusive_sm"):
        linear.DEFAULT_OPTIONS._replace(ctas_per_sm=2, cluster_split=0).check()
    with pytest.raises(ValueError, match="exclusive_trigger_grid must be a share"):
        linear.DEFAULT_OPTIONS._replace(exclusive_trigger_grid=1.5).check()
    with pytest.raises(ValueError, match="exclusive_max_blocks"):
        linear.DEFAULT_OPTIONS._replace(exclusive_max_blocks=-1).check()
    with pytest.raises(ValueError, match="trigger_lead"):
        linear.DEFAULT_OPTIONS._replace(trigger_lead=-1).check()
    with pytest.raises(ValueError, match="trigger_lead_max_m_pad"):
        linear.DEFAULT_OPTIONS._replace(trigger_lead_max_m_pad=12).check()
    with pytest.raises(ValueError, match="weight_eviction"):
        linear.KernelOptions(weight_eviction="last").check()
    with pytest.raises(ValueError, match="x_eviction"):
        linear.KernelOptions(x_eviction="first").check()
    with pytest.raises(ValueError, match="consumer_warpgroups"):
        linear.KernelOptions(consumer_warpgroups=3).check()
    assert linear.KernelOptions(ctas_per_sm=2).smem_slots == 2
    assert linear.KernelOptions(smem_share=3).smem_slots == 3
    with pytest.raises(ValueError, match="scope"):
        tma_cute.tma_desc_ptr(0, scope="cta")


# A 2-D TMA load in PTX with its cache hint; group 1 the descriptor address register, group 2 the cache policy.
TMA_LOAD_POLICY = re.compile(r"cp\.async\.bulk\.tensor\.2d\.shared::cta\.global\.tile\S*L2::cache_hint "
                             r"\[[^\]]+\], \[(%rd\d+), \{[^}]*\}\], \[[^\]]+\], (%rd\d+);")


@pytest.mark.parametrize("eviction", ["first", "normal"])
def test_weight_loads_carry_the_eviction_policy(eviction, tmp_path):
    """weight_eviction="first": one createpolicy evict_first, and every weight load (through the fenced descriptor)
    carries it; x loads do not. "normal": no policy is created."""
    options = linear.DEFAULT_OPTIONS._replace(cluster_k=3, weight_eviction=eviction)
    ptx, _ = _ptx_and_cubin(torch.bfloat16, 16, False, tmp_path, options)
    policies = re.findall(r"createpolicy\.fractional\.L2::evict_first\.b64 (%rd\d+), 1\.0;", ptx)
    (fenced,) = re.findall(r"fence\.proxy\.tensormap::generic\.acquire\.\w+ \[(%rd\d+)\], 128;", ptx)
    loads = TMA_LOAD_POLICY.findall(ptx)
    assert len(loads) == 4, loads
    weight_policies = {policy for desc, policy in loads if desc == fenced}
    x_policies = {policy for desc, policy in loads if desc != fenced}
    if eviction == "first":
        assert len(policies) == 1 and weight_policies == set(policies), (policies, loads)
        assert not x_policies & weight_policies, loads
    else:
        assert not policies


@pytest.mark.parametrize("x_eviction", ["last", "normal"])
def test_x_loads_carry_their_eviction_policy(x_eviction, tmp_path):
    """x_eviction="last": one createpolicy evict_last, carried by every x load (both loops: x after the PDL wait for
    the ring's first stages, then with the weight) and by no weight load; "normal": no evict_last policy (the DSL
    gives x loads a cache hint of 0 of its own)."""
    options = linear.DEFAULT_OPTIONS._replace(cluster_k=3, x_eviction=x_eviction)
    ptx, _ = _ptx_and_cubin(torch.bfloat16, 64, False, tmp_path, options)
    (last,) = re.findall(r"createpolicy\.fractional\.L2::evict_last\.b64 (%rd\d+), 1\.0;", ptx) or [None]
    (fenced,) = re.findall(r"fence\.proxy\.tensormap::generic\.acquire\.\w+ \[(%rd\d+)\], 128;", ptx)
    hinted = TMA_LOAD_POLICY.findall(ptx)
    x_hinted = [policy for desc, policy in hinted if desc != fenced]
    assert len(TMA_LOAD_DESCRIPTOR.findall(ptx)) == 4
    if x_eviction == "last":
        assert last is not None and x_hinted == [last, last], (last, hinted)
        assert all(policy != last for desc, policy in hinted if desc == fenced), hinted
    else:
        assert last is None and all(re.search(rf"mov\.b64\s+{re.escape(p)}, 0;", ptx) for p in x_hinted), hinted


@pytest.mark.parametrize("m_pad,cluster_k", [(8, 3), (64, 3)], ids=["m8-cluster3", "m64-cluster3-in-ring"])
def test_relaxed_cluster_arrive_follows_the_barrier_init_fence(m_pad, cluster_k, tmp_path):
    """relaxed_cluster_arrive (shipped): the entry arrive is the relaxed form, and the only thing it announces, CTA 0's
    partials barrier (and in-ring, each sender's drained barrier) initialised, is released before it by
    fence.mbarrier_init."""
    assert linear.DEFAULT_OPTIONS.relaxed_cluster_arrive
    options = linear.DEFAULT_OPTIONS._replace(cluster_k=cluster_k)
    ptx, _ = _ptx_and_cubin(torch.bfloat16, m_pad, False, tmp_path, options)
    assert re.findall(r"barrier\.cluster\.arrive[.\w]*", ptx) == ["barrier.cluster.arrive.relaxed"]
    arrive = ptx.index("barrier.cluster.arrive.relaxed")
    partials_barrier = ptx.index("mbarrier.arrive.expect_tx")  # CTA 0 arms it right after its init and fence
    assert ptx.rindex("mbarrier.init", 0, partials_barrier) < ptx.rindex("fence.mbarrier_init.release.cluster", 0,
                                                                         partials_barrier) < arrive
    assert ptx.rindex("mbarrier.init", 0, arrive) < ptx.rindex("fence.mbarrier_init.release.cluster", 0, arrive)


@pytest.mark.parametrize("m_pad,cluster_k", CLUSTER_BUILDS, ids=[f"m{m}-cluster{c}" for m, c in CLUSTER_BUILDS])
def test_cluster_split_compiles(m_pad, cluster_k, tmp_path):
    """A cluster-split build reducing on CTA 0 (cluster_scatter=False) sends its partial to CTA 0 with st.async (m_pad / 4 16-byte pieces per thread) counted
    on CTA 0's barrier, waits on the cluster barrier only before sending, and uses no global atomics (no split-K
    counters); its ring and received partials fit the CTA's share of shared memory. Partials above
    OWN_PARTIAL_BYTES land in CTA 0's ring: there CTA 0 also waits on the cluster barrier and then tells each
    sender, with a remote mbarrier arrive released at cluster scope, that its ring is drained."""
    options = linear.DEFAULT_OPTIONS._replace(cluster_split=2, cluster_fit=False, cluster_k=cluster_k,
                                              cluster_scatter=False)
    ptx, _ = _ptx_and_cubin(torch.bfloat16, m_pad, False, tmp_path, options)
    sends = ST_ASYNC_SEND.findall(ptx)
    assert len(sends) == m_pad // 4, sends
    in_ring = linear.partials_in_ring(m_pad, cluster_k)
    assert ptx.count("barrier.cluster.arrive") == 1 and ptx.count("barrier.cluster.wait") == 1 + in_ring
    drained = DRAINED_ARRIVE.findall(ptx)
    assert len(drained) == in_ring and ("fence.proxy.async.shared::cta" in ptx) == in_ring
    if in_ring:
        # CTA 0 says it is drained only after its last wgmma wait (the consumer loop comes first in the code)
        last_wait = ptx.rindex("wgmma.wait_group.sync.aligned")
        handshake = [ptx.index(i) for i in ("fence.proxy.async.shared::cta", "bar.sync \t1, 128;",
                                            "mbarrier.arrive.release.cluster")]
        assert last_wait < handshake[0] < handshake[1] < handshake[2], (last_wait, handshake)
    assert "atom.global" not in ptx and "red.global" not in ptx
    stages = linear.pipeline_stages(m_pad, options.smem_slots, cluster_k)
    received = (cluster_k - 1) * linear.TILE_N * m_pad * 4
    if in_ring:
        assert received > linear.OWN_PARTIAL_BYTES and received <= stages * linear.TILE_N * linear.TILE_K * 2
        received = 0
    per_cta = stages * (linear.TILE_N + m_pad) * linear.TILE_K * 2 + linear.SMEM_RESERVED + received
    assert stages >= 2 and options.smem_slots * (per_cta + linear.SMEM_PER_CTA_SYSTEM) <= linear.SMEM_PER_SM


OWN = linear.OWN_PARTIAL_BYTES
SCATTER_BUILDS = [(8, 8, 1, OWN), (16, 3, 1, OWN), (32, 4, 1, OWN), (64, 2, 1, OWN), (8, 8, 2, OWN), (64, 3, 2, OWN),
                  (16, 3, 1, 0), (8, 2, 2, 0)]


@pytest.mark.parametrize("m_pad,cluster_k,warpgroups,own_bytes", SCATTER_BUILDS,
                         ids=[f"m{m}-cluster{c}-wg{w}{'-ring' * (not o)}" for m, c, w, o in SCATTER_BUILDS])
def test_cluster_scatter_compiles(m_pad, cluster_k, warpgroups, own_bytes, tmp_path):
    """A reduce-scatter build (cluster_scatter) has one st.async site per 16-byte piece of a thread's partial (each
    sent by every rank but its owner), a single cluster wait, no global atomics; with the partials in the ring (large
    ones, or any with own_partial_bytes=0), one remote drained arrive (each CTA to every other) released at cluster
    scope after the last wgmma wait and the proxy fence. Builds where some ranks own no piece (m_pad 8 over 8 CTAs)
    compile too."""
    options = linear.DEFAULT_OPTIONS._replace(cluster_split=2, cluster_fit=False, cluster_k=cluster_k,
                                              consumer_warpgroups=warpgroups, cluster_scatter=True,
                                              own_partial_bytes=own_bytes)
    ptx, _ = _ptx_and_cubin(torch.bfloat16, m_pad, False, tmp_path, options)
    pieces = linear.TILE_N * m_pad // options.mma_threads // 4
    sends = ST_ASYNC_SEND.findall(ptx)
    assert len(sends) == pieces, (len(sends), pieces)
    in_ring = linear.partials_in_ring(m_pad, cluster_k, own_bytes)
    assert in_ring or own_bytes  # own_partial_bytes=0 puts every cluster build's partials in the ring
    assert ptx.count("barrier.cluster.arrive") == 1 and ptx.count("barrier.cluster.wait") == 1
    drained = DRAINED_ARRIVE.findall(ptx)
    assert len(drained) == in_ring
    if in_ring:
        last_wait = ptx.rindex("wgmma.wait_group.sync.aligned")
        assert last_wait < ptx.index("fence.proxy.async.shared::cta") < ptx.index("mbarrier.arrive.release.cluster")
    assert "atom.global" not in ptx and "red.global" not in ptx


@pytest.mark.parametrize("m_pad,cluster_k", [(8, 0), (64, 1), (16, 4), (64, 3)],
                         ids=["m8-streamk", "m64-tile", "m16-cluster4", "m64-cluster3-in-ring"])
def test_two_consumer_warpgroups_split_the_tile(m_pad, cluster_k, tmp_path):
    """consumer_warpgroups=2: 288 threads; each warpgroup issues one m64 wgmma per k step (4 per stage, against 8 for
    one warpgroup) on its 64 weight rows; the stage barrier counts 8 consumer warps; the fix-up barrier 256 threads;
    a cluster sender's st.async carries half as many 16-byte pieces per thread (m_pad / 8) and a thread stores half as
    many outputs; the TMA loads come from warp 8."""
    counts = {}
    for groups in (1, 2):
        dump = tmp_path / f"wg{groups}"
        dump.mkdir()
        options = linear.DEFAULT_OPTIONS._replace(cluster_k=cluster_k, consumer_warpgroups=groups)
        ptx, _ = _ptx_and_cubin(torch.bfloat16, m_pad, False, dump, options)
        assert re.search(rf"\.reqntid {options.threads}, 1, 1", ptx), groups
        counts[groups] = {
            "wgmma": len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16", ptx)),
            "sends": len(ST_ASYNC_SEND.findall(ptx)),
            "stores": len(re.findall(r"st\.global\.b16", ptx)),
            "bar": set(re.findall(r"bar\.sync \t1, (\d+);", ptx)),
        }
        # the TMA loads are issued under a warp index test against producer_warp
        assert re.search(rf"setp\.\w+\.[bsu]32\s+%p\d+, %r\d+, {options.producer_warp};", ptx), groups
    assert counts[1]["wgmma"] == 2 * counts[2]["wgmma"] == 8, counts
    assert counts[2]["sends"] * 2 == counts[1]["sends"] == (m_pad // 4 if cluster_k > 1 else 0), counts
    assert counts[2]["stores"] * 2 == counts[1]["stores"], counts
    assert counts[1]["bar"] <= {"128"} and counts[2]["bar"] <= {"256"}, counts
    assert linear.DEFAULT_OPTIONS._replace(consumer_warpgroups=2).threads == 288


@pytest.mark.parametrize("cluster_k", [0, 3])
def test_wgmma_in_flight_two_waits_for_the_previous_stage(cluster_k, tmp_path):
    """wgmma_in_flight=2 waits for all but the newest wgmma group inside the loop and for all after it; the default
    waits for each stage's group (0) only. Stream-K and an in-ring cluster build (m_pad 64, 3 CTAs)."""
    waits = {}
    for in_flight in (1, 2):
        options = linear.DEFAULT_OPTIONS._replace(cluster_k=cluster_k, wgmma_in_flight=in_flight)
        dump = tmp_path / f"w{in_flight}"
        dump.mkdir()
        ptx, _ = _ptx_and_cubin(torch.bfloat16, 64, False, dump, options)
        waits[in_flight] = sorted(set(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d)", ptx)))
    assert waits == {1: ["0"], 2: ["0", "1"]}, waits


@pytest.mark.parametrize("m_pad,cluster_k", [(8, 4), (64, 3)], ids=["own-buffer", "in-ring"])
def test_late_first_cta_build_spins_before_the_handshake(m_pad, cluster_k, tmp_path):
    """The test build behind test_cluster_senders_wait_for_a_late_first_cta: CTA 0 reads %globaltimer in a loop after
    its last wgmma wait and before its handshake (the drained arrive, or its wait for the partials); shipped
    builds never read the timer."""
    options = linear.DEFAULT_OPTIONS._replace(cluster_k=cluster_k)
    plain, _ = _ptx_and_cubin(torch.bfloat16, m_pad, False, tmp_path, options)
    late_dir = tmp_path / "late"
    late_dir.mkdir()
    late, _ = _ptx_and_cubin(torch.bfloat16, m_pad, False, late_dir, options._replace(late_first_cta_ns=20_000))
    assert "globaltimer" not in plain
    spin = late.index("%globaltimer")
    after = "mbarrier.arrive.release.cluster" if linear.partials_in_ring(m_pad, cluster_k) else "mbarrier.try_wait"
    assert late.rindex("wgmma.wait_group.sync.aligned") < spin < late.index(after, spin), after
    with pytest.raises(ValueError, match="late_first_cta_ns"):
        linear.DEFAULT_OPTIONS._replace(late_first_cta_ns=1000).check()  # no cluster: nothing to be late for


# An H200's (SM count, cluster_capacity): what options_for and crossover_m are given for that GPU.
H200 = (132, (132, 66, 39, 30, 22, 17, 15, 15))


def _resolved_trigger(options, n, k, m=1):
    """(load_trigger, exclusive_sm, CTAs) of options resolved for an n x k weight at M=m on an H200."""
    o = linear.options_for(options, n, k, m, *H200)
    return o.load_trigger, o.exclusive_sm, linear.grid_size(n, k, H200[0], o)


def test_crossover_by_weight_size_and_launch():
    """The op's cuBLAS crossover: M=16 under 16 MB of weight, M=32 from there on (CROSSOVER_M), both dtypes; and on a
    GPU (an H200's SM count and cluster capacity) M=64 from 64 MB where the M=64 launch is a cluster-split or
    one-CTA-per-tile build on at least 70 % of the SMs."""
    for dtype in (torch.bfloat16, torch.float16):
        assert linear.crossover_m(1024, 4096, dtype) == 16  # 8 MB: Llama-3-8B's k/v projections
        assert linear.crossover_m(2048, 4096, dtype) == 32  # exactly 16 MB
        assert linear.crossover_m(4096, 4096, dtype) == 32
        assert linear.crossover_m(57344, 8192, dtype) == 32
        assert linear.crossover_m(1024, 4096, dtype, *H200) == 16
        assert linear.crossover_m(4096, 4096, dtype, *H200) == 32  # 96 CTAs, but 32 MB
        for n, k in ((14336, 4096), (4096, 14336), (28672, 4096), (8192, 28672)):  # 112, 96, 224, 128 CTAs
            assert linear.crossover_m(n, k, dtype, *H200) == 64, (n, k)
        assert linear.crossover_m(10240, 8192, dtype, *H200) == 32  # 80 CTAs
        assert linear.crossover_m(57344, 8192, dtype, *H200) == 32  # stream-K
        assert linear.crossover_m(4096, 14336, dtype, 264, (264, 132, 78, 60, 44, 34, 30, 30)) == 32  # 96 CTAs of 264


def test_default_l2_promotion_by_gpu_model_and_weight_size(monkeypatch):
    """A call that names no promotion: 256B on an H100 80GB HBM3 for weights of 100 MB and more (its grids' sweeps),
    128B below that, on the H200 and on models no grid measured."""
    P, h100 = torch_tma.L2Promotion, "NVIDIA H100 80GB HBM3"
    assert linear.l2_promotion_for(h100, 4096 * 14336 * 2) == P.L2_256B  # 117 MB
    assert linear.l2_promotion_for(h100, 100_000_000) == P.L2_256B
    assert linear.l2_promotion_for(h100, 99_999_999) == P.L2_128B
    assert linear.l2_promotion_for(h100, 6144 * 4096 * 2) == P.L2_128B  # 50 MB
    assert linear.l2_promotion_for("NVIDIA H200", 57344 * 8192 * 2) == P.L2_128B
    assert linear.l2_promotion_for("NVIDIA H100 PCIe", 10**9) == P.L2_128B  # no grid on it
    names = {0: "NVIDIA H200", 1: h100}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: names[index])
    for dtype in (torch.bfloat16, torch.float16):
        assert linear.default_l2_promotion(1, 4096, 14336, dtype) == P.L2_256B
        assert linear.default_l2_promotion(1, 4096, 4096, dtype) == P.L2_128B
        assert linear.default_l2_promotion(0, 4096, 14336, dtype) == P.L2_128B


def test_load_trigger_policy():
    """options_for turns load_trigger on for cluster-split launches of at most load_trigger_grid of the SMs, never for
    stream-K (which triggers at start). The shipped options leave it to exclusive_trigger_grid (the next test)."""
    resolved = _resolved_trigger
    half = linear.DEFAULT_OPTIONS._replace(exclusive_trigger_grid=0.0, load_trigger_grid=0.5)  # shipped until run 17
    assert linear.DEFAULT_OPTIONS.load_trigger_grid == 0.0 and not linear.DEFAULT_OPTIONS.load_trigger
    assert resolved(half, 1024, 4096) == (True, False, 64)
    assert resolved(half, 1024, 4096, 64) == (True, False, 24)  # M=64: 3 CTAs per tile, what the partials fit
    assert resolved(half, 4096, 4096) == (False, False, 96)
    assert resolved(half, 14336, 4096) == (False, False, 112)
    assert resolved(half._replace(load_trigger_grid=0.75), 4096, 4096) == (True, False, 96)
    assert resolved(half._replace(load_trigger_grid=0.0), 1024, 4096) == (False, False, 64)
    stream_k = linear.options_for(half, 57344, 8192, 1, *H200)
    assert stream_k.cluster_k == 0 and stream_k.early_trigger and not stream_k.load_trigger
    with pytest.raises(ValueError, match="load_trigger_grid"):
        half._replace(load_trigger_grid=1.5).check()


def test_exclusive_trigger_policy():
    """exclusive_trigger_grid (shipped: 0.75) gives every cluster-split or one-CTA-per-tile launch of at most that
    share of the SMs the trigger after its last load: on an H200 the launches of 96 CTAs and fewer, not those of 112 or
    128, and not a half-SM ring's run of exclusive_max_blocks or more. Every such launch that fits one CTA per SM takes
    its SMs alone (exclusive_sm), whatever its trigger; a launch of more CTAs than SMs and stream-K never."""
    resolved = _resolved_trigger
    shipped, everywhere = linear.DEFAULT_OPTIONS, linear.DEFAULT_OPTIONS._replace(exclusive_trigger_grid=1.0)

    assert shipped.exclusive_trigger_grid == 0.75 and shipped.exclusive_max_blocks == 100
    for n, k, m, ctas in ((4096, 4096, 1, 96), (4096, 4096, 64, 96), (6144, 4096, 16, 96), (4096, 14336, 32, 96),
                          (1024, 4096, 1, 64), (1024, 4096, 64, 24)):
        assert resolved(shipped, n, k, m) == (True, True, ctas), (n, k, m)
    # 128 blocks per CTA: on the half-SM ring a long run keeps the trigger at exit; the deep ring (M=64) takes it
    for m in (1, 16, 32):
        assert resolved(shipped, 10240, 8192, m) == (False, True, 80), m
    assert resolved(shipped, 10240, 8192, 64)[:2] == (True, True)
    assert resolved(shipped._replace(exclusive_max_blocks=0), 10240, 8192, 32) == (True, True, 80)
    assert resolved(shipped._replace(exclusive_max_blocks=74), 4096, 14336, 32) == (False, True, 96)  # 74 blocks
    assert resolved(shipped, 14336, 4096) == (False, True, 112)  # one CTA per row tile, no cluster
    assert resolved(everywhere, 14336, 4096) == (True, True, 112)
    assert resolved(shipped, 8192, 28672, 64) == (False, True, 128)
    assert resolved(shipped._replace(exclusive_trigger_grid=0.0), 4096, 4096) == (False, False, 96)
    assert resolved(shipped._replace(exclusive_trigger_grid=0.0), 14336, 4096) == (False, False, 112)
    for options in (shipped, everywhere):
        assert resolved(options, 28672, 4096) == (False, False, 224)  # 224 row tiles: two CTAs per SM
        stream_k = linear.options_for(options, 57344, 8192, 1, *H200)
        assert stream_k.cluster_k == 0 and stream_k.early_trigger and not stream_k.exclusive_sm


def test_trigger_lead_policy():
    """options_for keeps trigger_lead (shipped: 3 loads before the last) on launches that trigger after their last load
    at M <= 16 (trigger_lead_max_m_pad) and sets it to 0 everywhere else, so the other builds stay one each."""
    shipped = linear.DEFAULT_OPTIONS
    assert shipped.trigger_lead == 3 and shipped.trigger_lead_max_m_pad == 16

    def lead(options, n, k, m):
        return linear.options_for(options, n, k, m, *H200).trigger_lead

    for n, k in ((1024, 4096), (4096, 4096), (6144, 4096), (4096, 14336)):  # they trigger after their last load
        assert [lead(shipped, n, k, m) for m in (1, 9, 16, 17, 32, 64)] == [3, 3, 3, 0, 0, 0], (n, k)
    assert [lead(shipped, 10240, 8192, m) for m in (1, 16, 64)] == [0, 0, 0]  # at exit, or after the load at M=64
    assert lead(shipped, 14336, 4096, 1) == 0 and lead(shipped, 57344, 8192, 1) == 0  # at exit; stream-K
    assert lead(shipped._replace(trigger_lead_max_m_pad=64), 4096, 4096, 64) == 3
    assert lead(shipped._replace(trigger_lead=0), 4096, 4096, 1) == 0


def test_exclusive_sm_asks_for_more_than_half_the_sm():
    """An exclusive_sm build's launch asks for EXCLUSIVE_SMEM_BYTES of dynamic shared memory, more than its ring
    needs, so that two of its CTAs and the driver's share per CTA overflow one SM; the same build without it asks
    for what its storage uses."""
    assert 2 * (linear.EXCLUSIVE_SMEM_BYTES + linear.SMEM_PER_CTA_SYSTEM) > linear.SMEM_PER_SM
    options = linear.options_for(linear.DEFAULT_OPTIONS, 4096, 4096, 1, *H200)
    assert options.exclusive_sm and options.smem_slots == 2
    ring = linear.pipeline_stages(8, 2, options.cluster_k) * (linear.TILE_N + 8) * linear.TILE_K * 2
    assert ring + linear.SMEM_RESERVED < linear.EXCLUSIVE_SMEM_BYTES
    asked = re.compile(rf"llvm\.mlir\.constant\({linear.EXCLUSIVE_SMEM_BYTES} : i64\)")
    for exclusive in (True, False):
        built = linear.compile_kernel(linear._DTYPES[torch.bfloat16], 8, False, "",
                                      options._replace(exclusive_sm=exclusive))
        assert bool(asked.search(str(built.ir_module))) == exclusive


def test_deep_ring_policy(tmp_path):
    """options_for gives M=64 launches whose CTAs each stream at least deep_ring_blocks (shipped: 100) weight blocks the
    whole SM's shared memory and two wgmma in flight, where that keeps cluster_k and the grid: on an H200 10240x8192
    (one CTA per row tile, 128 blocks), 8192x28672 (2 CTAs per tile, 224) and 57344x8192 (stream-K, 434); not
    4096x14336 (74 blocks) or 28672x4096 (64, and the full ring would make it stream-K); never below M=33."""
    shipped = linear.DEFAULT_OPTIONS
    assert shipped.deep_ring_blocks == 100 and shipped.smem_share == 2 and shipped.wgmma_in_flight == 1
    deep = set()
    for n, k in BENCH_SHAPES + DECODE_SHAPES[:2]:
        for m in (1, 16, 32, 33, 64):
            o = linear.options_for(shipped, n, k, m, *H200)
            plain = linear.options_for(shipped._replace(deep_ring_blocks=0), n, k, m, *H200)
            if (o.smem_share, o.wgmma_in_flight) == (1, 2):
                deep.add((n, k, m))
                assert (o.cluster_k, linear.grid_size(n, k, 132, o)) == (plain.cluster_k,
                                                                          linear.grid_size(n, k, 132, plain))
                assert linear._blocks_per_cta(n, k, 132, plain) >= 100
            else:
                assert o == plain._replace(deep_ring_blocks=shipped.deep_ring_blocks), (n, k, m)
    assert deep == {(n, k, m) for n, k in ((10240, 8192), (8192, 28672), (57344, 8192)) for m in (33, 64)}, deep
    assert linear._blocks_per_cta(28672, 4096, 132, linear.options_for(shipped, 28672, 4096, 64, *H200)) == 64
    assert linear.options_for(shipped._replace(deep_ring_blocks=64), 28672, 4096, 64, *H200).smem_share == 2
    assert linear.options_for(shipped._replace(deep_ring_blocks=64), 14336, 4096, 64, *H200).smem_share == 1
    # deep_ring_tile_blocks: a lower bound for launches of one CTA per row tile only
    tile64 = shipped._replace(deep_ring_tile_blocks=64)
    assert shipped.deep_ring_tile_blocks == 0
    assert (linear.options_for(tile64, 14336, 4096, 64, *H200).smem_share,
            linear.options_for(tile64, 14336, 4096, 64, *H200).wgmma_in_flight) == (1, 2)
    assert linear.options_for(tile64, 14336, 4096, 32, *H200).smem_share == 2
    assert linear.options_for(tile64, 4096, 14336, 64, *H200).smem_share == 2  # 3 CTAs per tile: deep_ring_blocks
    assert linear.options_for(tile64, 28672, 4096, 64, *H200).smem_share == 2  # the full ring would be stream-K
    with pytest.raises(ValueError, match="deep_ring_tile_blocks"):
        shipped._replace(deep_ring_tile_blocks=-1).check()
    with pytest.raises(ValueError, match="deep_ring_blocks"):
        shipped._replace(deep_ring_blocks=-1).check()
    # the deep builds compile, and their ring fills the SM
    o = linear.options_for(shipped, 8192, 28672, 64, *H200)
    ptx, _ = _ptx_and_cubin(torch.bfloat16, 64, False, tmp_path, o)
    assert sorted(set(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d)", ptx))) == ["0", "1"]
    assert linear.pipeline_stages(64, o.smem_slots, o.cluster_k) == 9


def test_wgmma2_policy():
    """options_for gives every build at M 33-64 (shipped wgmma2_min_m_pad=64) two wgmma in flight, whatever its ring and
    split, and changes nothing else: the same resolution as without the policy but for wgmma_in_flight; at M <= 32
    none has it. Without the policy only the deep-ring builds have it."""
    shipped = linear.DEFAULT_OPTIONS
    assert shipped.wgmma2_min_m_pad == 64 and shipped.wgmma_in_flight == 1
    for n, k in BENCH_SHAPES + DECODE_SHAPES[:2] + [(1000, 1000)]:
        for m in (1, 16, 32, 33, 64):
            o = linear.options_for(shipped, n, k, m, *H200)
            plain = linear.options_for(shipped._replace(wgmma2_min_m_pad=0), n, k, m, *H200)
            assert o.wgmma_in_flight == (2 if m > 32 else 1), (n, k, m, o)
            assert o._replace(wgmma_in_flight=plain.wgmma_in_flight, wgmma2_min_m_pad=0) == plain, (n, k, m)
            assert plain.wgmma_in_flight == (2 if plain.smem_share == 1 else 1), (n, k, m, plain)
    assert linear.options_for(shipped._replace(wgmma2_min_m_pad=16), 4096, 4096, 9, *H200).wgmma_in_flight == 2
    for bad in (1, 48, 128):
        with pytest.raises(ValueError, match="wgmma2_min_m_pad"):
            shipped._replace(wgmma2_min_m_pad=bad).check()


def test_cluster_k_for_policy():
    """One cluster per row tile, the whole grid resident at once, as large as the received partials fit; stream-K
    where that cannot be."""
    sms = 132
    assert linear.cluster_k_for(4096, 4096, 8, sms, 1) == 4  # 32 row tiles x 4 = 128 CTAs
    assert linear.cluster_k_for(6144, 4096, 16, sms, 1) == 2  # 48 x 2 = 96 (x 3 = 144 > 132)
    assert linear.cluster_k_for(6144, 4096, 16, sms, 2) == 5  # 48 x 5 = 240 <= 264
    assert linear.cluster_k_for(10240, 8192, 8, sms, 2) == 3  # 80 x 3 = 240
    assert linear.cluster_k_for(28672, 4096, 8, sms, 2) == 1  # 224 row tiles, one CTA each
    assert linear.cluster_k_for(28672, 4096, 8, sms, 1) == 0  # 224 > 132: stream-K
    assert linear.cluster_k_for(28672, 4096, 8, sms, 1, 2) == 1  # ... unless two CTAs fit per SM
    assert linear.cluster_k_for(10240, 8192, 8, sms, 1) == 1  # 80 row tiles: 80 CTAs, no cluster
    assert linear.cluster_k_for(57344, 8192, 8, sms, 2) == 0  # 448 > 264: stream-K
    assert linear.cluster_k_for(1024, 4096, 8, sms, 1, 2) == 8  # 8 row tiles x 8 (the largest portable cluster)
    assert linear.cluster_k_for(1024, 4096, 8, sms, 1, 2, max_k=4) == 4
    assert linear.cluster_k_for(4096, 4096, 32, sms, 1, 2) == 4  # 3 x 16 KiB of partials in CTA 0's 80 KiB ring
    assert linear.cluster_k_for(4096, 4096, 64, sms, 1, 2) == 3  # 4 x 24 KiB stages: 2 x 32 KiB fit, 3 do not
    assert linear.cluster_k_for(4096, 4096, 64, sms, 1, 1) == 4  # the whole SM: 9 stages
    assert linear.cluster_k_for(4096, 4096, 32, sms, 1, 2, max_m_pad=16) == 0  # stream-K above max_m_pad
    assert linear.cluster_k_for(1024, 4096, 32, sms, 2) == 6  # 264 // 8 = 33, capped to 8; 5 x 16 KiB fit the ring
    assert linear.cluster_k_for(1000, 72, 8, sms, 2) == 2  # K = 72: two 64-column blocks
    shaped = linear.options_for(linear.KernelOptions(smem_share=2, cluster_split=1), 4096, 4096, 3, sms)
    assert shaped.cluster_k == 4 and linear.grid_size(4096, 4096, sms, shaped) == 128
    assert linear.options_for(linear.KernelOptions(), 4096, 4096, 3, sms).cluster_k == 0
    with pytest.raises(ValueError, match="cluster_k"):
        linear.grid_size(1000, 72, sms, shaped)
    with pytest.raises(ValueError, match="cluster_split"):
        linear.KernelOptions(cluster_split=2).check()  # two CTAs per SM need half the shared memory each
    with pytest.raises(ValueError, match="do not fit"):
        linear.compile_kernel(DSL_DTYPES[torch.bfloat16], 64, False, "", shaped)  # 3 x 32 KiB > the 64 KiB ring
    with pytest.raises(ValueError, match="cluster_max_k"):
        linear.KernelOptions(cluster_max_k=9).check()
    with pytest.raises(ValueError, match="cluster_max_m_pad"):
        linear.KernelOptions(cluster_max_m_pad=12).check()


def test_cluster_k_for_fits_every_cluster_at_once():
    """Given the GPU's cluster capacity (clusters of 1..8 CTAs it runs at once, one CTA per SM), cluster_k drops until
    every row tile's cluster runs at once; without it, or with cluster_fit off, sm_count // row tiles as before."""
    sms = 132
    capacity = (132, 66, 40, 30, 24, 18, 16, 16)  # made up, GPC-like: 4 x 30 = 120 < 132
    assert linear.cluster_k_for(4096, 4096, 8, sms, 1, 2) == 4  # 32 row tiles: 132 // 32
    assert linear.cluster_k_for(4096, 4096, 8, sms, 1, 2, capacity=capacity) == 3  # 32 clusters of 4 > 30
    assert linear.cluster_k_for(4096, 4096, 8, sms, 1, 2, capacity=capacity[:2] + (31,) + capacity[3:]) == 2
    assert linear.cluster_k_for(6144, 4096, 8, sms, 1, 2, capacity=capacity) == 2  # 48 <= 66
    assert linear.cluster_k_for(1024, 4096, 8, sms, 1, 2, capacity=capacity) == 8  # 8 <= 16
    assert linear.cluster_k_for(4096, 4096, 64, sms, 1, 2, capacity=capacity) == 3  # the ring's bound, 32 <= 40
    assert linear.cluster_k_for(10240, 8192, 8, sms, 1, 2, capacity=capacity) == 1  # 80 tiles: no cluster
    fit = linear.DEFAULT_OPTIONS
    assert fit.cluster_fit  # the shipped policy (sweep run 6)
    assert linear.options_for(fit, 4096, 14336, 1, sms, capacity).cluster_k == 3
    assert linear.options_for(fit._replace(cluster_fit=False), 4096, 14336, 1, sms, capacity).cluster_k == 4
    assert linear.options_for(fit._replace(cluster_split=0), 4096, 14336, 1, sms).cluster_k == 0  # stream-K: no need
    with pytest.raises(ValueError, match="cluster_capacity"):
        linear.options_for(fit, 4096, 14336, 1, sms)  # fit without the GPU's numbers: refused, not ignored
    with pytest.raises(ValueError, match="cluster_fit"):
        fit._replace(cluster_split=2).check()  # two CTAs per SM: the count does not apply


# ---- CPU: the descriptor contract with the op --------------------------------------------------------


def _weight_block_layout(dsl_dtype):
    return cute.slice_(linear.weight_smem_layout(dsl_dtype, 1), (None, None, 0))


# plan_atom caches on the factory object: one fixed factory per dtype.
_WEIGHT_BLOCK_LAYOUTS = {dtype: functools.partial(_weight_block_layout, dsl) for dtype, dsl in DSL_DTYPES.items()}


@pytest.mark.parametrize("dtype", list(DSL_DTYPES))
@pytest.mark.parametrize("n,k", [(4096, 4096), (1000, 1000), (1, 8)])
def test_weight_descriptor_matches_kernel_atom(dtype, n, k):
    """The map the op asks the cache for (weight_box, weight_swizzle) is the kernel's TMA atom for the weight,
    field by field, but for the promotion: otherwise the kernel reads wrong bytes or waits for bytes that
    never arrive."""
    weight = torch.randn(n, k).to(dtype)
    for promotion in torch_tma.L2Promotion:
        atom = tma_cute.plan_atom(
            cpasync.CopyBulkTensorTileG2SOp(), weight, _WEIGHT_BLOCK_LAYOUTS[dtype], (linear.TILE_N, linear.TILE_K)
        ).spec(weight, promotion)
        requested = torch_tma.TensorMapSpec.from_strided(
            weight.data_ptr(), weight.dtype, weight.shape, weight.stride(), linear.weight_box(n, k, dtype),
            swizzle=linear.weight_swizzle(dtype), l2_promotion=promotion,
        )
        assert requested == atom, f"\nop asks   {requested.describe()}\natom has  {atom.describe()}"


def test_unsupported_reason_off_cuda():
    x, weight = torch.randn(2, 64, dtype=torch.bfloat16), torch.randn(128, 64, dtype=torch.bfloat16)
    assert "CUDA" in linear.unsupported_reason(x, weight, None)


def test_linear_ref_is_float64_linear():
    x, weight, bias = torch.randn(3, 40, dtype=torch.bfloat16), torch.randn(5, 40, dtype=torch.bfloat16), torch.randn(5)
    ref = linear.linear_ref(x, weight, bias.bfloat16())
    assert ref.dtype == torch.float64
    expected = F.linear(x.double(), weight.double(), bias.bfloat16().double())
    assert torch.equal(ref, expected)


# ---- GPU: numerics -----------------------------------------------------------------------------------


def test_staged_store_builds_store_16_byte_runs(tmp_path):
    """A staged_store build (shipped) of one CTA per tile (10240x8192 M=64 on the deep ring, 28672x4096 M=16 two to an
    SM, 14336x4096 M=1) stores y with 16-byte st.global.v4 from 16-byte shared loads (2-byte stores remain as the
    fallback); without the option none; a cluster build (4096x4096 M=16) compiles to the same PTX with or without it."""
    h200 = (132, (132, 66, 39, 30, 22, 17, 15, 15))
    staged = linear.DEFAULT_OPTIONS
    assert staged.staged_store
    for n, k, m, cluster_k in [(10240, 8192, 64, 1), (28672, 4096, 16, 1), (14336, 4096, 1, 1), (4096, 4096, 16, 3)]:
        options = linear.options_for(staged, n, k, m, *h200)
        assert options.cluster_k == cluster_k, (n, k, m)
        ptx, direct = (_ptx_and_cubin(torch.bfloat16, linear.m_pad(m), False, tmp_path / f"{name}{n}-{m}", o)[0]
                       for name, o in (("staged", options), ("direct", options._replace(staged_store=False))))
        assert "st.global.v4.b32" not in direct, (n, k, m)
        if options.cluster_k == 1:
            assert ptx.count("st.global.v4.b32") == ptx.count("ld.shared.v4.b32") > 0, (n, k, m)
            assert "st.global.b16" in ptx, (n, k, m)  # the fallback, one output at a time
        else:
            code = ["".join(line for line in text.splitlines(True) if not line.startswith("//")) for text in (ptx, direct)]
            assert code[0] == code[1], (n, k, m)


def on_gpu(test):
    """Hopper only, under a hard timeout that kills the process (a hung kernel never returns to Python)."""
    return pytest.mark.requires_sm90(pytest.mark.timeout(GPU_TIMEOUT_S, method="thread")(test))


def _random(m, n, k, dtype, bias):
    """Fresh x [m, k], weight [n, k] scaled so outputs are O(1), bias [n] or None."""
    x = torch.randn(m, k, dtype=dtype, device="cuda")
    weight = (torch.randn(n, k, device="cuda") / math.sqrt(k)).to(dtype)
    b = torch.randn(n, dtype=dtype, device="cuda") if bias else None
    return x, weight, b


def _weight_map(weight, l2_promotion=linear.DEFAULT_L2_PROMOTION):
    """The weight's descriptor from the default cache, requested as torch_tma.ops requests it."""
    n, k = weight.shape
    return torch_tma.default_cache(weight.device).get(
        weight, linear.weight_box(n, k, weight.dtype), swizzle=linear.weight_swizzle(weight.dtype),
        l2_promotion=l2_promotion,
    )


def _launch(x2d, weight, bias, out=None, l2_promotion=linear.DEFAULT_L2_PROMOTION):
    """Poison out with NaN and run the kernel on it (a fresh out unless one is given)."""
    assert linear.unsupported_reason(x2d, weight, bias, crossover=False) is None, linear.unsupported_reason(x2d, weight, bias, crossover=False)
    if out is None:
        out = torch.empty(x2d.shape[0], weight.shape[0], dtype=x2d.dtype, device=x2d.device)
    out.fill_(math.nan)
    linear.linear_out(x2d, weight, bias, out, _weight_map(weight, l2_promotion).ptr, l2_promotion=l2_promotion)
    return out


def _check(out, x2d, weight, bias, label):
    try:
        assert_matches_reference(out, F.linear(x2d, weight, bias), linear.linear_ref(x2d, weight, bias))
    except AssertionError as e:
        raise AssertionError(f"{label}: {e}") from None


def _arrivals_all_zero():
    torch.cuda.synchronize()
    for ws in linear._workspaces.values():
        assert int(ws.arrivals.abs().sum()) == 0, "split-K arrival counters not reset by the kernel"


SHAPE_IDS = [f"{n}x{k}" for n, k in BENCH_SHAPES + DECODE_SHAPES + RAGGED_SHAPES]


@on_gpu
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", list(DSL_DTYPES), ids=["bf16", "fp16"])
@pytest.mark.parametrize("n,k", BENCH_SHAPES + DECODE_SHAPES + RAGGED_SHAPES, ids=SHAPE_IDS)
def test_matches_reference_every_m(n, k, dtype, bias):
    weight = (torch.randn(n, k, device="cuda") / math.sqrt(k)).to(dtype)
    b = torch.randn(n, dtype=dtype, device="cuda") if bias else None
    for m in range(1, linear.M_PADS[-1] + 1):
        x = torch.randn(m, k, dtype=dtype, device="cuda")
        _check(_launch(x, weight, b), x, weight, b, f"{n}x{k} M={m}")
    _arrivals_all_zero()


@on_gpu
@pytest.mark.parametrize("m", [1, 7, 16, 33, 64])
def test_strided_x_offset_weight_and_no_stray_writes(m):
    """x rows with a padded stride, a weight that starts 16 bytes into its storage, and out as a window of a
    NaN frame: the kernel must read through the strides and write exactly out, nothing beside it."""
    n, k, dtype = 1000, 1000, torch.bfloat16
    x = torch.randn(m, k + 24, dtype=dtype, device="cuda")[:, :k]
    weight = (torch.randn(n * k + 8, device="cuda") / math.sqrt(k)).to(dtype)[8:].view(n, k)
    assert weight.storage_offset() == 8 and x.stride(0) == k + 24
    b = torch.randn(n, dtype=dtype, device="cuda")
    frame = torch.full((m + 2, n + 16), math.nan, dtype=dtype, device="cuda")
    out = frame[1 : m + 1, 8 : n + 8]
    _launch(x, weight, b, out=out)
    _check(out, x, weight, b, f"strided M={m}")
    outside = frame.clone()
    outside[1 : m + 1, 8 : n + 8] = 0
    assert int(outside.isnan().sum()) == frame.numel() - m * n, "the kernel wrote outside out"


@on_gpu
def test_every_l2_promotion_same_bits():
    """The promotion changes how L2 fetches, never the result, and the split-K sum runs in CTA order: results
    are bitwise equal across promotions and across runs."""
    x, weight, b = _random(5, 4096, 4096, torch.bfloat16, True)
    runs = {p.name: _launch(x, weight, b, l2_promotion=p).clone() for p in torch_tma.L2Promotion}
    runs["repeat"] = _launch(x, weight, b).clone()
    _check(runs["repeat"], x, weight, b, "4096x4096 M=5")
    for name, out in runs.items():
        assert torch.equal(out, runs["repeat"]), f"{name} differs"


def _check_build(options, m, n, k, bias, label):
    """Launch the build of `options` on fresh random data into a NaN-poisoned y and check y against float64."""
    x, weight, b = _random(m, n, k, torch.bfloat16, bias)
    out = torch.full((m, n), math.nan, dtype=torch.bfloat16, device="cuda")
    workspace = linear._workspace(0)
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    compiled = linear.compile_kernel(DSL_DTYPES[x.dtype], linear.m_pad(m), bias, "", options)
    compiled(x, weight, b, out, workspace.partials, workspace.arrivals, _weight_map(weight).ptr,
             linear.grid_size(n, k, sm_count, options))
    torch.cuda.synchronize()
    _check(out, x, weight, b, label)


def _check_split_builds(options, shapes, ms, label, counters_zero=False):
    """_check_build for every (N, K) of shapes and M of ms that options.cluster_k applies to (no more CTAs per tile than
    K has 64-column blocks, and the received partials fit the share); with bias at odd M. counters_zero: the stream-K
    arrival counters are back at zero after each launch."""
    for n, k in shapes:
        for m in ms:
            if options.cluster_k > -(-k // linear.TILE_K) or not linear._fits_cluster(linear.m_pad(m), options.cluster_k,
                                                                                     options.smem_slots):
                continue
            _check_build(options, m, n, k, m % 2 == 1, f"{label} {n}x{k} M={m}")
            if counters_zero:
                assert int(linear._workspace(0).arrivals.abs().sum()) == 0


@on_gpu
@pytest.mark.parametrize("cluster_k", range(1, linear.MAX_CLUSTER_K + 1), ids=lambda c: f"k{c}")
def test_cluster_split_numerics(cluster_k):
    """Every cluster size on benchmark and ragged shapes, M around every m_pad whose partials fit (in a buffer of
    their own or in CTA 0's ring), with and without bias: each output element matches the float64 reference
    (NaN-poisoned before the launch)."""
    options = linear.DEFAULT_OPTIONS._replace(smem_share=2, cluster_split=2, cluster_fit=False, cluster_k=cluster_k)
    _check_split_builds(options, [(4096, 4096), (1024, 4096), (6144, 4096), (1000, 1000), (129, 520), (8, 256)],
                        (1, 2, 7, 8, 9, 16, 17, 32, 33, 64), f"cluster_k={cluster_k}")


def _launch_each(x, weight, b, builds, workspace, sm_count):
    """y of each build (KernelOptions) launched on x, weight and b, into NaN-poisoned outputs, synchronized."""
    (m, k), n = x.shape, weight.shape[0]
    outs = []
    for options in builds:
        out = torch.full((m, n), math.nan, dtype=x.dtype, device="cuda")
        compiled = linear.compile_kernel(DSL_DTYPES[x.dtype], linear.m_pad(m), b is not None, "", options)
        compiled(x, weight, b, out, workspace.partials, workspace.arrivals, _weight_map(weight).ptr,
                 linear.grid_size(n, k, sm_count, options))
        outs.append(out)
    torch.cuda.synchronize()
    return outs


@on_gpu
@pytest.mark.parametrize("warpgroups", [1, 2], ids=lambda w: f"wg{w}")
@pytest.mark.parametrize("cluster_k", range(2, linear.MAX_CLUSTER_K + 1), ids=lambda c: f"k{c}")
def test_cluster_scatter_matches_reduce_bitwise(cluster_k, warpgroups):
    """The reduce-scatter (cluster_scatter), with equal shares and with the last rank owning every piece
    (scatter_last_max_m_pad), makes the same additions in the same rank order as CTA 0's reduction, so on fresh random
    data, M around every m_pad whose partials fit (in a buffer of their own or in the ring, some ranks owning no piece
    where a thread has fewer pieces than the cluster has CTAs), with bias at odd M, y is bit for bit the same, and it
    matches the float64 reference; y poisoned with NaN before each launch."""
    reduce = linear.DEFAULT_OPTIONS._replace(smem_share=2, cluster_split=2, cluster_fit=False, cluster_k=cluster_k,
                                             consumer_warpgroups=warpgroups, cluster_scatter=False)
    scatter = reduce._replace(cluster_scatter=True)
    to_last = scatter._replace(scatter_last_max_m_pad=linear.M_PADS[-1])
    workspace = linear._workspace(0)
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    checked = 0
    for n, k in [(4096, 4096), (1000, 1000), (129, 520)]:
        for m in (1, 8, 9, 16, 17, 32, 33, 64):
            if cluster_k > -(-k // linear.TILE_K) or not linear._fits_cluster(linear.m_pad(m), cluster_k, 2):
                continue
            x, weight, b = _random(m, n, k, torch.bfloat16, m % 2 == 1)
            outs = _launch_each(x, weight, b, (reduce, scatter, to_last), workspace, sm_count)
            for name, out in (("scatter", outs[1]), ("scatter to the last rank", outs[2])):
                _check(out, x, weight, b, f"{name} cluster_k={cluster_k} {n}x{k} M={m}")
                assert torch.equal(outs[0], out), f"cluster_k={cluster_k} {n}x{k} M={m}: {name} differs from reduce"
            checked += 1
    assert checked >= 6, checked


@on_gpu
@pytest.mark.parametrize("ring", ["half", "deep"])
def test_staged_store_matches_direct_bitwise(ring):
    """staged_store moves the same converted values, so y is bit for bit the direct stores' and matches the float64
    reference: one CTA per tile on the half-SM ring and on the deep ring (whole SM, two wgmma in flight), M around every
    m_pad, bias at odd M; N a multiple of 8 (16-byte runs) and not (129: one output at a time), a ragged last tile
    (1000); and y as a window of a NaN frame, its rows 16-byte aligned (N=1004: the last run cut short, one output at a
    time) or not: nothing outside it is written. y poisoned with NaN before each launch."""
    direct = linear.DEFAULT_OPTIONS._replace(cluster_split=1, cluster_fit=False, cluster_k=1, smem_share=2,
                                             staged_store=False)
    if ring == "deep":
        direct = direct._replace(smem_share=1, wgmma_in_flight=2)
    staged = direct._replace(staged_store=True)
    workspace = linear._workspace(0)
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    for n, k in [(4096, 4096), (1000, 1000), (129, 520)]:
        for m in (1, 8, 9, 16, 17, 32, 33, 64):
            x, weight, b = _random(m, n, k, torch.bfloat16, m % 2 == 1)
            outs = _launch_each(x, weight, b, (direct, staged), workspace, sm_count)
            _check(outs[1], x, weight, b, f"staged {ring} {n}x{k} M={m}")
            assert torch.equal(outs[0], outs[1]), f"{ring} {n}x{k} M={m}: staged differs from direct"
    # y inside a NaN frame: rows 16-byte aligned (a window at column 8 of rows of 1024) or not (column 3)
    m, n, k = 33, 1004, 1000
    x, weight, b = _random(m, n, k, torch.bfloat16, True)
    compiled = linear.compile_kernel(cutlass.BFloat16, linear.m_pad(m), True, "", staged)
    for col in (8, 3):
        frame = torch.full((m + 2, n + 20), math.nan, dtype=torch.bfloat16, device="cuda")
        out = frame[1 : m + 1, col : n + col]
        compiled(x, weight, b, out, workspace.partials, workspace.arrivals, _weight_map(weight).ptr,
                 linear.grid_size(n, k, sm_count, staged))
        torch.cuda.synchronize()
        _check(out, x, weight, b, f"staged {ring} in a frame at column {col}")
        outside = frame.clone()
        outside[1 : m + 1, col : n + col] = 0
        assert int(outside.isnan().sum()) == frame.numel() - m * n, f"column {col}: wrote outside y"


def test_own_partial_bytes_moves_partials_into_the_ring():
    """KernelOptions.own_partial_bytes: at 0 every cluster build's partials land in the drained ring, so the buffer
    beside the ring is gone and (m_pad 16, 3 CTAs per tile, half an SM) the ring holds 6 stages instead of 5; the
    default keeps the shipped threshold; a negative value is refused."""
    assert linear.DEFAULT_OPTIONS.own_partial_bytes == linear.OWN_PARTIAL_BYTES
    assert not linear.partials_in_ring(16, 3) and linear.partials_in_ring(16, 3, 0)
    assert linear.pipeline_stages(16, 2, 3) == 5 and linear.pipeline_stages(16, 2, 3, 0) == 6
    for m_pad in linear.M_PADS:
        for cluster_k in range(2, linear.MAX_CLUSTER_K + 1):
            assert linear.pipeline_stages(m_pad, 2, cluster_k, 0) == linear.pipeline_stages(m_pad, 2)
            assert linear.pipeline_stages(m_pad, 2, cluster_k, 0) >= linear.pipeline_stages(m_pad, 2, cluster_k)
    o = linear.options_for(linear.DEFAULT_OPTIONS._replace(own_partial_bytes=0), 4096, 4096, 16, *H200)
    assert o.cluster_k == 3 and o.own_partial_bytes == 0
    with pytest.raises(ValueError, match="own_partial_bytes"):
        linear.DEFAULT_OPTIONS._replace(own_partial_bytes=-1).check()


def test_partials_beside_ring():
    """KernelOptions.partials_beside (shipped): an exclusive_sm cluster build on half an SM whose partials would land in
    the ring keeps them in a buffer in the SM's other half, the ring as deep as without partials; with beside_small
    (shipped) smaller partials too, so the ring gains their stages; options_for keeps the policy only there
    (4096x4096 at M=32 and 64 on an H200, M=16 only with beside_small; not without exclusive_sm or a cluster)."""
    policy = linear.DEFAULT_OPTIONS
    assert policy.partials_beside and policy.beside_small
    resolved = {m: linear.options_for(policy, 4096, 4096, m, *H200) for m in (16, 32, 64)}
    assert [resolved[m].partials_beside for m in (16, 32, 64)] == [True, True, True]
    assert not linear.options_for(policy._replace(beside_small=False), 4096, 4096, 16, *H200).partials_beside
    assert linear.pipeline_stages(16, 2, 3) == 5 and linear.pipeline_stages(16, 2, 3, beside=True) == 6
    assert all(o.exclusive_sm and o.cluster_k == 3 for o in resolved.values())
    o = resolved[64]
    assert linear.partials_beside_ring(64, o) and not linear.partials_beside_ring(64, o._replace(exclusive_sm=False))
    assert not linear.partials_beside_ring(64, o._replace(smem_share=1))
    assert linear.pipeline_stages(64, 2, 3, beside=True) == linear.pipeline_stages(64, 2) == 4
    assert not linear.options_for(policy, 10240, 8192, 64, *H200).partials_beside  # one CTA per tile: no partials
    kernel = linear.WeightStreamingLinear(DSL_DTYPES[torch.bfloat16], 64, False, 4, o)
    assert kernel.beside and not kernel.in_ring


def test_ring_fill_policy():
    """Shipped: the ring fills what the partials beside it leave at M=64 (m_pad 64) only, where the partials lie
    beside the ring: 4096x4096 and 4096x14336 (3 CTAs per tile) 6 stages instead of 4; never at M <= 32, nor on a
    build without partials (10240x8192, one CTA per tile) or with the deep ring (8192x28672 at M=64)."""
    policy = linear.DEFAULT_OPTIONS
    assert policy.ring_fill and policy.ring_fill_min_m_pad == 64
    for n, k in ((4096, 4096), (4096, 14336)):
        resolved = {m: linear.options_for(policy, n, k, m, *H200) for m in (1, 16, 32, 64)}
        assert [resolved[m].ring_fill for m in (1, 16, 32, 64)] == [False, False, False, True]
        assert linear.ring_stages(64, resolved[64]) == 6 and linear.ring_stages(16, resolved[16]) == 6
    for n, k in ((10240, 8192), (8192, 28672), (57344, 8192)):
        o = linear.options_for(policy, n, k, 64, *H200)
        assert not o.ring_fill and linear.ring_stages(64, o) == linear.ring_stages(64, o._replace(ring_fill=True))
    with pytest.raises(ValueError, match="ring_fill_min_m_pad"):
        policy._replace(ring_fill_min_m_pad=48).check()


FILL_BUILDS = [(m_pad, cluster_k) for m_pad in linear.M_PADS for cluster_k in (2, 3, 4, 8)]


@pytest.mark.parametrize("m_pad,cluster_k", FILL_BUILDS, ids=[f"m{m}-k{k}" for m, k in FILL_BUILDS])
def test_ring_fill_takes_what_the_partials_leave(m_pad, cluster_k):
    """KernelOptions.ring_fill: a partials_beside build's ring takes all the shared memory its partials leave, one
    stage more would not fit, and what it launches with (SharedStorage) fits an SM; without partials beside the
    ring it changes nothing."""
    o = linear.DEFAULT_OPTIONS._replace(cluster_k=cluster_k, exclusive_sm=True, ring_fill=True)
    if not linear.partials_beside_ring(m_pad, o):
        assert linear.ring_stages(m_pad, o) == linear.ring_stages(m_pad, o._replace(ring_fill=False))
        return
    stages, stage = linear.ring_stages(m_pad, o), linear._stage_bytes(m_pad)
    partials = linear._cluster_partial_bytes(m_pad, cluster_k)
    assert stages >= linear.ring_stages(m_pad, o._replace(ring_fill=False))
    assert linear.SMEM_RESERVED + stages * stage + partials <= linear.SMEM_BYTES
    assert linear.SMEM_RESERVED + (stages + 1) * stage + partials > linear.SMEM_BYTES
    assert _launch_smem_bytes(m_pad, stages, o) <= linear.SMEM_BYTES
    if (m_pad, cluster_k) == (64, 3):
        assert stages == 6 and linear.ring_stages(16, o) == 11


@pytest.mark.parametrize("m_pad", [32, 64])
def test_partials_beside_build_has_no_drained_handshake(m_pad, tmp_path):
    """A partials_beside build of 3 CTAs per tile sends every piece it does not own with st.async and never arrives on
    another CTA's drained barrier (the in-ring build does, once)."""
    o = linear.options_for(linear.DEFAULT_OPTIONS, 4096, 4096, m_pad, *H200)
    assert o.partials_beside
    for options, drained in ((o, 0), (o._replace(partials_beside=False), 1)):
        dump = tmp_path / f"beside{int(options.partials_beside)}"
        dump.mkdir()
        ptx, _ = _ptx_and_cubin(torch.bfloat16, m_pad, False, dump, options)
        assert len(DRAINED_ARRIVE.findall(ptx)) == drained, options.partials_beside
        assert len(ST_ASYNC_SEND.findall(ptx)) == m_pad // 4


@on_gpu
@pytest.mark.parametrize("cluster_k", [2, 3, 8], ids=lambda c: f"k{c}")
def test_partials_in_ring_match_own_buffer_bitwise(cluster_k):
    """own_partial_bytes=0 (every cluster build's partials in the drained ring) and partials_beside (an exclusive_sm
    build's in a buffer in the SM's other half) give y bit for bit equal to the build without them (a buffer of
    their own at small m_pad, the ring above OWN_PARTIAL_BYTES) on fresh random data, M around every m_pad whose
    partials fit, bias at odd M, and each matches the float64 reference; y poisoned with NaN before each launch."""
    own = linear.DEFAULT_OPTIONS._replace(smem_share=2, cluster_split=2, cluster_fit=False, cluster_k=cluster_k)
    ring = own._replace(own_partial_bytes=0)
    beside = own._replace(exclusive_sm=True, partials_beside=True)
    workspace = linear._workspace(0)
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    checked = besides = 0
    for n, k in [(4096, 4096), (1000, 1000)]:
        for m in (1, 8, 9, 16, 17, 32, 64):
            if not linear._fits_cluster(linear.m_pad(m), cluster_k, 2):
                continue
            x, weight, b = _random(m, n, k, torch.bfloat16, m % 2 == 1)
            outs = _launch_each(x, weight, b, (own, ring, beside), workspace, sm_count)
            besides += linear.partials_beside_ring(linear.m_pad(m), beside)
            for name, out in zip(("in-ring", "beside"), outs[1:]):
                _check(out, x, weight, b, f"{name} cluster_k={cluster_k} {n}x{k} M={m}")
                assert torch.equal(outs[0], out), f"cluster_k={cluster_k} {n}x{k} M={m}: {name} differs"
            checked += 1
    assert checked >= 6 and besides >= 2, (checked, besides)


def test_scatter_shares():
    """Every piece has one owner, owners in rank order with equal runs (within one piece), and ranks beyond the
    pieces own none."""
    for pieces in (1, 2, 4, 8, 16):
        for cluster_k in range(2, linear.MAX_CLUSTER_K + 1):
            first, owner = linear.scatter_shares(pieces, cluster_k)
            assert first[0] == 0 and first[-1] == pieces and first == sorted(first)
            assert len(owner) == pieces and owner == sorted(owner)
            runs = [first[r + 1] - first[r] for r in range(cluster_k)]
            assert max(runs) - min(runs) <= 1 and sum(runs) == pieces
            assert all(first[owner[q]] <= q < first[owner[q] + 1] for q in range(pieces))
    assert linear.scatter_shares(2, 3) == ([0, 0, 1, 2], [1, 2])
    # scatter_last_max_m_pad: the last rank owns every piece
    assert linear.scatter_shares(4, 3, to_last=True) == ([0, 0, 0, 4], [2, 2, 2, 2])
    assert linear.scatter_shares(2, 2, to_last=True) == ([0, 0, 2], [1, 1])


def test_scatter_last_policy(tmp_path):
    """options_for keeps scatter_last_max_m_pad (not shipped) only on cluster_scatter builds whose M pads to at most
    it (one build elsewhere); such a build sends every piece of a thread's partial to the last rank from each other
    rank (one st.async site per piece, as the equal cut), and the option's bound is checked."""
    last = linear.DEFAULT_OPTIONS._replace(scatter_last_max_m_pad=16)
    assert linear.DEFAULT_OPTIONS.scatter_last_max_m_pad == 0
    for m, kept in ((1, 16), (16, 16), (17, 0), (64, 0)):
        assert linear.options_for(last, 4096, 4096, m, *H200).scatter_last_max_m_pad == kept, m
    # one CTA per row tile and stream-K: nothing to scatter
    assert linear.options_for(last, 10240, 8192, 1, *H200).scatter_last_max_m_pad == 0
    assert linear.options_for(last, 57344, 8192, 1, *H200).scatter_last_max_m_pad == 0
    options = linear.options_for(last, 4096, 4096, 16, *H200)
    assert options.cluster_k == 3 and options.cluster_scatter
    ptx, _ = _ptx_and_cubin(torch.bfloat16, 16, False, tmp_path, options)
    assert len(ST_ASYNC_SEND.findall(ptx)) == linear.TILE_N * 16 // options.mma_threads // 4
    with pytest.raises(ValueError, match="scatter_last_max_m_pad"):
        linear.DEFAULT_OPTIONS._replace(scatter_last_max_m_pad=12).check()


@on_gpu
@pytest.mark.parametrize("cluster_k", [0, 1, 2, 3, 8], ids=lambda c: f"k{c}")
def test_two_consumer_warpgroups_numerics(cluster_k):
    """consumer_warpgroups=2 on stream-K (cluster_k 0), one CTA per row tile and cluster splits (partials in a buffer
    of their own and in CTA 0's ring), benchmark and ragged shapes, M around every m_pad, with and without bias:
    each output element matches the float64 reference (NaN-poisoned before the launch), and the stream-K arrival
    counters are zero after each launch."""
    options = linear.DEFAULT_OPTIONS._replace(smem_share=2, cluster_split=2, cluster_fit=False, cluster_k=cluster_k,
                                              consumer_warpgroups=2)
    _check_split_builds(options, [(4096, 4096), (1024, 4096), (1000, 1000), (129, 520), (8, 256)],
                        (1, 2, 8, 9, 16, 31, 32, 33, 64), f"2 warpgroups, cluster_k={cluster_k}",
                        counters_zero=True)


@on_gpu
def test_cluster_capacity_from_the_driver():
    """The driver's count of clusters of 1..8 CTAs running at once with one CTA per SM: every SM for single CTAs,
    never more CTAs than SMs, fewer clusters as they grow; and what the policy then picks for 32 row tiles."""
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    capacity = linear.cluster_capacity(0)
    assert len(capacity) == linear.MAX_CLUSTER_K and capacity[0] == sm_count, capacity
    for k, clusters in enumerate(capacity, 1):
        assert 1 <= clusters <= sm_count // k, (k, capacity)
    assert list(capacity) == sorted(capacity, reverse=True), capacity
    fit = linear.options_for(linear.DEFAULT_OPTIONS, 4096, 4096, 1, sm_count, capacity)
    assert capacity[fit.cluster_k - 1] >= 32 and (fit.cluster_k == 8 or capacity[fit.cluster_k] < 32), (fit, capacity)
    # The same counts as CuTe DSL's own query (which compiles a DSL kernel per cluster size; ours loads PTX once).
    dsl = cutlass.utils.HardwareInfo(0)
    assert capacity == tuple(dsl.get_max_active_clusters(k) for k in range(1, linear.MAX_CLUSTER_K + 1)), capacity


def test_driver_errors_name_the_call_and_the_error():
    import cuda.bindings.driver as cuda
    assert linear._driver_result("cuDeviceGet", (cuda.CUresult.CUDA_SUCCESS, 7)) == 7
    with pytest.raises(RuntimeError, match=r"cuModuleLoadData failed: CUDA_ERROR_INVALID_PTX"):
        linear._driver_result("cuModuleLoadData", (cuda.CUresult.CUDA_ERROR_INVALID_PTX, None))


@on_gpu
@pytest.mark.parametrize("cluster_k", [2, 3, 8], ids=lambda c: f"k{c}")
def test_cluster_senders_wait_for_a_late_first_cta(cluster_k):
    """CTA 0 of every cluster arrives 20 us late (late_first_cta_ns): the other CTAs finish their share first and
    wait, for CTA 0's drained ring (partials in its ring) or only for their st.async to land (own buffer). Each
    output element still matches the float64 reference (NaN-poisoned before the launch)."""
    options = linear.DEFAULT_OPTIONS._replace(cluster_k=cluster_k, late_first_cta_ns=20_000)
    kinds = set()
    for n, k in [(4096, 4096), (1000, 1032)]:
        for m in (1, 16, 33, 64):
            if not linear._fits_cluster(linear.m_pad(m), cluster_k, options.smem_slots):
                continue
            kinds.add(linear.partials_in_ring(linear.m_pad(m), cluster_k))
            _check_build(options, m, n, k, True, f"late CTA 0, cluster_k={cluster_k} {n}x{k} M={m}")
    assert kinds == ({False, True} if cluster_k <= 3 else {True}), kinds  # in ring: senders wait for the drain


@on_gpu
def test_cuda_graph_replay():
    """Captured once, replayed with new x: every replay is right, so the arrival counters are back at zero
    after each one (the CTA that completes a tile resets its counter)."""
    n, k, m, dtype = 4096, 4096, 3, torch.bfloat16
    x, weight, b = _random(m, n, k, dtype, True)
    weight_map = _weight_map(weight)
    out = torch.empty(m, n, dtype=dtype, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # the descriptor slot and inputs are written there
    with torch.cuda.stream(stream):  # warm up: compile, and make the capture stream's workspace
        linear.linear_out(x, weight, b, out, weight_map.ptr, l2_promotion=linear.DEFAULT_L2_PROMOTION)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        linear.linear_out(x, weight, b, out, weight_map.ptr, l2_promotion=linear.DEFAULT_L2_PROMOTION)
    for replay in range(5):
        x.copy_(torch.randn_like(x))
        out.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        _check(out, x, weight, b, f"replay {replay}")
    _arrivals_all_zero()


@on_gpu
def test_unsupported_reasons():
    x, weight, b = _random(4, 256, 512, torch.bfloat16, True)
    assert linear.unsupported_reason(x, weight, b, crossover=False) is None
    bf16 = dict(dtype=torch.bfloat16, device="cuda")
    cases = {
        "is not bfloat16 or float16": (x.float(), weight.float(), None),
        "dtypes differ": (x, weight, b.half()),
        "above the crossover": (torch.randn(linear.crossover_m(*weight.shape, torch.bfloat16) + 1, 512, **bf16), weight, b),
        "empty": (x[:0], weight, b),
        "multiple of 8": (x[:, :500], weight[:, :500].contiguous(), b),
        "weight is not contiguous": (x[:, :256], weight[:, :256], b),
        "x strides": (torch.randn(512, 4, **bf16).t(), weight, b),
        "16-byte aligned": (torch.randn(4 * 512 + 1, **bf16)[1:].view(4, 512), weight, b),
        "is not a contiguous [N=256]": (x, weight, torch.randn(256, 2, **bf16)[:, 0]),
    }
    for expected, args in cases.items():
        reason = linear.unsupported_reason(*args)
        assert reason is not None and expected in reason, (expected, reason)
    x65 = torch.randn(65, 512, **bf16)  # above the largest tile: the crossover's cause, unless the policy is off
    assert "M=65 is above the crossover" in linear.unsupported_reason(x65, weight, b)
    assert "M=65 is above the kernel's largest tile M=64" in linear.unsupported_reason(x65, weight, b, crossover=False)


@on_gpu
def test_crossover_on_this_gpu():
    """On an H200 the op takes M=64 for 4096x14336 (its M=64 launch: 96 of 132 SMs) and hands it to cuBLAS for
    10240x8192 (80 SMs) above M=32; both weights are over 64 MB."""
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    if sm_count != 132:
        pytest.skip(f"the expected crossovers are an H200's (132 SMs), this GPU has {sm_count}")
    bf16 = dict(dtype=torch.bfloat16, device="cuda")
    for (n, k), expected in (((4096, 14336), None), ((10240, 8192), "above the crossover M=32")):
        weight = torch.empty(n, k, **bf16)
        reason = linear.unsupported_reason(torch.randn(64, k, **bf16), weight, None)
        if expected is None:
            assert reason is None, (n, k, reason)
        else:
            assert reason is not None and expected in reason, (n, k, reason)
        assert linear.unsupported_reason(torch.randn(32, k, **bf16), weight, None) is None


def _launch_chain(options, problems, outs, partials, arrivals):
    """Launch every (x, weight, bias, weight_map) of problems back to back with one compiled option set,
    sharing one workspace: with pdl each launch overlaps the previous one's tail."""
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    for (x, weight, b, weight_map), out in zip(problems, outs):
        shaped = linear.options_for(options, weight.shape[0], weight.shape[1], x.shape[0], sm_count,
                                    linear.cluster_capacity(0))
        compiled = linear.compile_kernel(DSL_DTYPES[x.dtype], linear.m_pad(x.shape[0]), b is not None, "", shaped)
        num_ctas = linear.grid_size(weight.shape[0], weight.shape[1], sm_count, shaped)
        compiled(x, weight, b, out, partials, arrivals, weight_map.ptr, num_ctas)


@on_gpu
@pytest.mark.parametrize("options", OPTION_VARIANTS, ids=OPTION_IDS)
def test_kernel_options_chained_eager_and_graph(options):
    """Each option set on back-to-back launches of different shapes and M (ragged ones included), eager and
    replayed from a CUDA graph (where pdl becomes programmatic edges) with fresh x each replay: every output
    matches the reference and the shared arrival counters are zero after each chain."""
    dtype = torch.bfloat16
    cases = [(1, 4096, 4096, False), (16, 6144, 4096, True), (64, 1000, 1000, True), (5, 10240, 8192, False),
             (33, 129, 72, False), (32, 10240, 8192, True), (1, 4096, 4096, True)]
    problems = []
    for m, n, k, bias in cases:
        x, weight, b = _random(m, n, k, dtype, bias)
        problems.append((x, weight, b, _weight_map(weight)))
    outs = [torch.empty(x.shape[0], w.shape[0], dtype=dtype, device="cuda") for x, w, _, _ in problems]
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    partials = torch.empty(sm_count * options.ctas_per_sm * 2 * linear.M_PADS[-1] * linear.TILE_N,
                           dtype=torch.float32, device="cuda")
    arrivals = torch.zeros(linear.ARRIVAL_WORDS, dtype=torch.int32, device="cuda")

    def check_all(label):
        torch.cuda.synchronize()
        for (x, weight, b, _), out, (m, n, k, _) in zip(problems, outs, cases):
            _check(out, x, weight, b, f"{label} {n}x{k} M={m}")
        assert int(arrivals.abs().sum()) == 0, f"{label}: arrival counters not reset"

    for out in outs:
        out.fill_(math.nan)
    _launch_chain(options, problems, outs, partials, arrivals)
    check_all("eager")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        _launch_chain(options, problems, outs, partials, arrivals)
    for replay in range(3):
        for (x, _, _, _), out in zip(problems, outs):
            x.copy_(torch.randn_like(x))
            out.fill_(math.nan)
        graph.replay()
        check_all(f"replay {replay}")


def test_first_launch_on_a_device_during_capture_asks_for_a_warm_up(monkeypatch):
    """A device's first launch while its stream captures (a weight bound beforehand, so the descriptor lookup hits)
    gets the warm-up error before anything synchronizes the device, which would invalidate the capture. CPU: the
    CUDA calls on that path are stand-ins."""
    def synchronize(*args):
        raise AssertionError("synchronized during capture")

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 1234, raising=False)
    monkeypatch.setattr(linear, "_workspaces", {})
    monkeypatch.setattr(linear, "_capture_workspaces", {})
    monkeypatch.setattr(linear, "_launch_config", lambda *key: torch.cuda.synchronize())  # as cluster_capacity does

    class Tensor:  # what linear_out reads of its tensors before launching
        def __init__(self, *shape):
            self.shape, self.dtype = shape, torch.bfloat16

        def get_device(self):
            return 0

        def stride(self, dim=None):
            return 1

    with pytest.raises(RuntimeError, match="first call on this device during CUDA-graph capture.*warm-up"):
        linear.linear_out(Tensor(1, 4096), Tensor(4096, 4096), None, Tensor(1, 4096), 0,
                          l2_promotion=torch_tma.L2Promotion.L2_128B)
    # The op decides the crossover before it launches, which measures the cluster capacity: that refuses too.
    with pytest.raises(RuntimeError, match="first call on this device during CUDA-graph capture.*warm-up"):
        linear.cluster_capacity.__wrapped__(0)
