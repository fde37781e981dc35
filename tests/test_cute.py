"""torch_tma.cute: the descriptor a make_tiled_tma_atom load would encode, with any L2 promotion.

CPU (any machine with nvidia-cutlass-dsl 4.8; CuTe DSL encodes an atom's descriptor in host code, so the
atom's own bytes are available without a GPU):
  * the derived spec equals the atom's own descriptor, field by field, over the dtype x swizzle x major x
    multicast x rank matrix, on tensors other than the one each plan was made from (dynamic layouts; a static
    plan serves one shape: on its own tensor);
  * the same against the device dumps recorded on the H200 by benchmarks/atom_matrix.py
    (tests/data/atom_dumps.json.gz), and the DSL's host encoding equals those dumps byte for byte;
  * unsupported ops and tensors are refused by name; every DSL kernel of ours compiles for sm_90a with
    the acquire fence unpredicated before the first TMA load.
GPU (requires_sm90, hard timeouts: TMA and mbarrier mistakes hang):
  * loads through our cached descriptor land the same shared-memory bytes as through the atom's own;
  * the feature request's repro: our promotion reads NONE / 64B / 128B / 256B as asked, the atom's 128B;
  * a bound map follows a replaced weight at the same address; the example kernel's checksum is exact.
"""
import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # read when CuTe DSL is imported: compile for Hopper

import gzip  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass.cute.nvgpu import cpasync  # noqa: E402
from cutlass.cute.nvgpu.cpasync import copy as tma_ops  # noqa: E402

import atom_matrix  # noqa: E402
import tma_stream_reduce  # noqa: E402
from test_cache_cpu import cpu_cache  # noqa: E402
import torch_tma  # noqa: E402
from torch_tma import L2Promotion, decode  # noqa: E402
from torch_tma import cute as tma_cute  # noqa: E402

GPU_TIMEOUT_S = 300
SPEC_FIELDS = ("data_type", "dims", "strides", "box", "elem_strides", "interleave", "swizzle", "oob_fill")
CONFIGS = atom_matrix.all_configs()


def assert_spec_is_atom(spec, atom_bytes: bytes, address: int) -> None:
    """Every field of our spec equals the atom's descriptor, the promotion aside (the atom's is 128B)."""
    atom = decode(atom_bytes)
    assert atom.address == address == spec.address
    assert atom.l2_promotion == L2Promotion.L2_128B
    for name in SPEC_FIELDS:
        assert getattr(spec, name) == getattr(atom, name), (name, getattr(spec, name), getattr(atom, name))


def cpu_tensor(config, size):
    return atom_matrix.make_tensor(config, size, "cpu")


# ---- CPU: the match --------------------------------------------------------------------------------------


@pytest.mark.parametrize("static_layout", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_spec_equals_host_encoded_atom(config, static_layout):
    args = (config.op(), config.smem_layout, config.tile, config.num_multicast)
    made_from = cpu_tensor(config, "small")
    plan = tma_cute.plan_atom(args[0], made_from, *args[1:], static_layout=static_layout)
    # A dynamic plan serves every shape: check it on a tensor it was not made from. A static plan has one shape.
    x = made_from if static_layout else cpu_tensor(config, "large")
    for promotion in L2Promotion:
        spec = plan.spec(x, promotion)
        assert spec.l2_promotion == promotion
        assert_spec_is_atom(spec, plan.atom_descriptor(x), x.data_ptr())


def smem_rows_64():
    return cute.make_layout((2, 64, 64), stride=(4096, 64, 1))


def smem_wide():
    return cute.make_layout((8, 512), stride=(512, 1))


def smem_two_rows():
    return cute.make_layout((2, 64), stride=(64, 1))


def smem_rank5():
    return cute.make_layout((2, 2, 2, 8, 64), stride=(2048, 1024, 512, 64, 1))


def smem_fp32():
    return cute.make_layout((32, 32), stride=(32, 1))


@pytest.mark.parametrize("case", [
    # CuTe merges two contiguous static modes into one TMA dim (dims by its gcd recurrence); dynamic: rank 3
    dict(shape=(4, 64, 64), dtype=torch.bfloat16, smem=smem_rows_64, tiler=(2, 64, 64), static=True,
         gbasis="(64,(64,2)):(1@2,(1@1,1@0))", box=(64, 128)),
    dict(shape=(4, 64, 64), dtype=torch.bfloat16, smem=smem_rows_64, tiler=(2, 64, 64), static=False,
         gbasis="(64,64,2):(1@2,1@1,1@0)", box=(64, 64, 2)),
    # a tile wider than the 256-element box limit: one box is 256 x 1, the copy issues several
    dict(shape=(40, 2048), dtype=torch.bfloat16, smem=smem_wide, tiler=(8, 512), static=False,
         gbasis="(256,1):(1@1,1@0)", box=(256, 1)),
    # multicast 4 over a 2-row box: the split crosses from the outer TMA dim into the inner one
    dict(shape=(40, 2048), dtype=torch.bfloat16, smem=smem_two_rows, tiler=(2, 64), static=False, mc=4,
         gbasis="(64,2):(1@1,1@0)", box=(32, 1)),
    dict(shape=(3, 3, 3, 16, 64), dtype=torch.float16, smem=smem_rank5, tiler=(2, 2, 2, 8, 64), static=False,
         gbasis="(64,8,2,2,(2)):(1@4,1@3,1@2,1@1,(1@0))", box=(64, 8, 2, 2, 2)),
    dict(shape=(100, 64), dtype=torch.float32, smem=smem_fp32, tiler=(32, 32), static=False,
         internal_type=cutlass.TFloat32, gbasis="(32,32):(1@1,1@0)", box=(32, 32)),
], ids=["merged-static", "merged-dynamic", "wide-tile", "multicast4", "rank5", "tf32"])
def test_spec_equals_host_encoded_atom_edge_cases(case):
    x = torch.randn(case["shape"]).to(case["dtype"])
    mc = case.get("mc", 1)
    op = cpasync.CopyBulkTensorTileG2SOp() if mc == 1 else cpasync.CopyBulkTensorTileG2SMulticastOp()
    plan = tma_cute.plan_atom(op, x, case["smem"], case["tiler"], mc, static_layout=case["static"],
                              internal_type=case.get("internal_type"))
    assert plan.gbasis == case["gbasis"] and plan.box == case["box"]
    spec = plan.spec(x, L2Promotion.L2_256B)
    assert_spec_is_atom(spec, plan.atom_descriptor(x), x.data_ptr())


def test_feature_request_premise_atom_encodes_128b():
    """NVIDIA/cutlass #3672: the atom's byte 10 reads 0x24 (promotion bits [2:1] = 2, 128B; bit 5 the DSL's flag)
    for the issue's 256 x 256 fp16 tensor and 64 x 64 box, while our spec carries the promotion asked for."""
    x = torch.randn(256, 256).half()
    op = cpasync.CopyBulkTensorTileG2SOp()
    atom = tma_cute.atom_descriptor(op, x, smem_64x64, (64, 64), static_layout=True)
    assert atom[10] == 0x24
    plan = tma_cute.plan_atom(op, x, smem_64x64, (64, 64), static_layout=True)
    assert [plan.spec(x, p).l2_promotion for p in L2Promotion] == list(L2Promotion)


def smem_64x64():
    return cute.make_layout((64, 64), stride=(64, 1))


# ---- CPU: against the device dumps recorded on the H200 ---------------------------------------------------

DUMPS = ROOT / "tests" / "data" / "atom_dumps.json.gz"


def recorded_cells():
    if not DUMPS.exists():
        return [pytest.param(None, marks=pytest.mark.skip(
            reason=f"{DUMPS.relative_to(ROOT)} not recorded yet: run benchmarks/atom_matrix.py on the H200"))]
    cells = json.loads(gzip.decompress(DUMPS.read_bytes()))["cells"]
    return [pytest.param(c, id=f"{atom_matrix.Config(**c['config']).name}-{c['size']}") for c in cells]


@pytest.mark.parametrize("cell", recorded_cells())
def test_recorded_device_atom(cell):
    if cell["status"] == "not run":
        pytest.skip("the H200 run spent its time budget before this cell")
    assert cell["status"] == "ok", f"the H200 run reported {cell['status']}: {cell.get('error') or cell}"
    config = atom_matrix.Config(**cell["config"])
    # The same shape and strides as on the GPU, in host memory: the DSL encodes without touching the data.
    storage = torch.empty(sum(s * (n - 1) for s, n in zip(cell["stride"], cell["shape"])) + 1,
                          dtype=atom_matrix.DTYPES[config.dtype][0])
    x = storage.as_strided(cell["shape"], cell["stride"])
    device_atom = bytes.fromhex(cell["device_atom"])
    plan = tma_cute.plan_atom(config.op(), x, config.smem_layout, config.tile, config.num_multicast)
    spec = plan.spec(x, L2Promotion.L2_256B)
    theirs = decode(device_atom)
    assert theirs.address == cell["address"] and theirs.l2_promotion == L2Promotion.L2_128B
    for name in SPEC_FIELDS:
        assert getattr(spec, name) == getattr(theirs, name), (name, getattr(spec, name), getattr(theirs, name))
    # What plans rely on: the DSL's host-side encoding is the device's, every byte but the address.
    assert plan.atom_descriptor(x)[8:64] == device_atom[8:64]
    assert decode(bytes.fromhex(cell["ours"])).l2_promotion.name == cell["promotion"]["ours"]


# ---- CPU: refusals and the host API around the cache -----------------------------------------------------


@pytest.mark.parametrize("op_type, case", [
    (tma_ops.CopyBulkTensorIm2ColG2SOp, "im2col"),
    (tma_ops.CopyBulkTensorIm2ColG2SMulticastOp, "im2col"),
    (tma_ops.CopyBulkTensorIm2ColS2GOp, "im2col"),
    (tma_ops.CopyBulkTensor2DGather4G2SOp, "gather4"),      # sm_100 only: built without the DSL's arch check
    (tma_ops.CopyBulkTensor2DScatter4S2GOp, "scatter4"),
    (tma_ops.CopyBulkTensorTileS2GOp, "TMA stores"),
    (tma_ops.CopyReduceBulkTensorTileS2GOp, "TMA reductions"),
])
def test_refuses_unsupported_ops_by_name(op_type, case):
    op = object.__new__(op_type)
    with pytest.raises(ValueError, match=case):
        tma_cute.plan_atom(op, torch.randn(64, 64).half(), smem_64x64, (64, 64))


def test_refuses_bad_arguments():
    x = torch.randn(128, 128).half()
    with pytest.raises(TypeError, match="tiled TMA load op"):
        tma_cute.plan_atom(cpasync.CopyBulkG2SOp(), x, smem_64x64, (64, 64))
    with pytest.raises(ValueError, match="num_multicast=2 needs CopyBulkTensorTileG2SMulticastOp"):
        tma_cute.plan_atom(cpasync.CopyBulkTensorTileG2SOp(), x, smem_64x64, (64, 64), 2)
    with pytest.raises(TypeError, match="smem_layout must be a zero-argument callable"):
        tma_cute.plan_atom(cpasync.CopyBulkTensorTileG2SOp(), x, "(64,64):(64,1)", (64, 64))
    with pytest.raises(ValueError, match="no single unit-stride dim"):
        tma_cute.plan_atom(cpasync.CopyBulkTensorTileG2SOp(), x[:, ::2], smem_64x64, (64, 64))
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        tma_cute.plan_atom(cpasync.CopyBulkTensorTileG2SOp(), x.numpy(), smem_64x64, (64, 64))
    # the DSL folds a rank-6 tensor's modes whether or not the box is then the tile (docs/probes/cute_rank6.py)
    for static_layout in (False, True):
        with pytest.raises(ValueError, match="tensor rank 6 is not supported.*folds.*at most 5 dims"):
            tma_cute.plan_atom(cpasync.CopyBulkTensorTileG2SOp(), torch.randn(2, 3, 3, 3, 16, 64).half(),
                               smem_64x64, (1, 1, 1, 1, 64, 64), static_layout=static_layout)


def test_refuses_bad_arguments_even_with_a_cached_plan():
    op, x = cpasync.CopyBulkTensorTileG2SOp(), torch.randn(128, 128).half()
    plan = tma_cute.plan_atom(op, x, smem_64x64, (64, 64), 1)
    with pytest.raises(ValueError, match="num_multicast must be an int >= 1, got True"):  # True == 1 as a key
        tma_cute.plan_atom(op, x, smem_64x64, (64, 64), True)
    assert tma_cute.plan_atom(op, x, smem_64x64, [64, 64]) is plan  # a list tiler, as make_tiled_tma_atom takes
    with pytest.raises(TypeError, match="l2_promotion must be a torch_tma.L2Promotion, got bool"):
        plan.spec(x, True)
    with pytest.raises(ValueError, match="tensor dim 0 has stride 0"):  # a broadcast view
        tma_cute.plan_atom(op, torch.randn(128).half().expand(128, 128), smem_64x64, (64, 64))
    for tiler in ((64.0, 64), (True, 64), (64, None), ()):  # (64.0, 64) == (64, 64) as a key
        with pytest.raises(TypeError, match="cta_tiler must be a tuple of ints"):
            tma_cute.plan_atom(op, x, smem_64x64, tiler)
    with pytest.raises(TypeError, match="smem_layout must be hashable.*got Unhashable"):
        tma_cute.plan_atom(op, x, Unhashable(), (64, 64))
    with pytest.raises(ValueError, match="no single unit-stride dim"):  # static too: not a smem major-mode error
        tma_cute.plan_atom(op, torch.randn(128, 256).half()[:, ::2], smem_64x64, (64, 64), static_layout=True)


class Unhashable:
    """A layout factory that cannot key a plan (a callable dataclass instance would be one)."""
    __hash__ = None

    def __call__(self):
        return smem_64x64()


def smem_8x64():
    return cute.make_layout((8, 64), stride=(64, 1))


def smem_1x64x64():
    return cute.make_layout((1, 64, 64), stride=(4096, 64, 1))


@pytest.mark.parametrize("make, smem, tiler", [
    (lambda: torch.randn(64).half().as_strided((1, 64), (0, 1)), smem_8x64, (8, 64)),
    (lambda: torch.randn(64, 64).half().expand(3, 64, 64)[:1], smem_1x64x64, (1, 64, 64)),
], ids=["1x64", "1x64x64"])
def test_a_size_one_dim_with_stride_zero_gets_a_plan_of_its_own(make, smem, tiler):
    """mark_layout_dynamic keeps a stride of 0 static, and the atom drops that mode: such a view is not the type of
    one with a real stride there, so it gets its own plan, which matches its atom."""
    op, x = cpasync.CopyBulkTensorTileG2SOp(), make()
    ordinary = torch.randn((4,) + tuple(x.shape[1:])).half()
    plan = tma_cute.plan_atom(op, ordinary, smem, tiler)
    with pytest.raises(ValueError, match="does not fit this plan"):
        plan.spec(x)
    own = tma_cute.plan_atom(op, x, smem, tiler)
    assert own is not plan
    assert_spec_is_atom(own.spec(x), own.atom_descriptor(x), x.data_ptr())


def test_atom_descriptor_and_atom_tensor_map_check_the_tensor():
    op, x = cpasync.CopyBulkTensorTileG2SOp(), torch.randn(128, 128).half()
    plan = tma_cute.plan_atom(op, x, smem_64x64, (64, 64))
    with pytest.raises(ValueError, match="does not fit this plan"):
        plan.atom_descriptor(torch.randn(128, 256).float())
    with pytest.raises(ValueError, match="tensor is on cpu but this cache holds descriptors for meta"):
        tma_cute.atom_tensor_map(op, x, smem_64x64, (64, 64), l2_promotion=L2Promotion.L2_256B,
                                 cache=torch_tma.TensorMapCache("meta", capacity_bytes=256, chunk_bytes=256))


def test_a_tensor_tma_cannot_map_is_named_not_reported_as_a_mismatch():
    op = cpasync.CopyBulkTensorTileG2SOp()
    with pytest.raises(ValueError, match="strides\\[0\\]=200 bytes is not a multiple of 16"):  # 100 fp16 rows
        tma_cute.plan_atom(op, torch.randn(300, 100).half(), smem_64x64, (64, 64), static_layout=True)


def test_refuses_smem_major_mode_that_does_not_match_the_tensor():
    mn = atom_matrix.Config(2, "bfloat16", "SW128", "MN", 1)
    k_major = torch.randn(300, 1024).bfloat16()
    with pytest.raises(ValueError, match="innermost TMA dim spans tensor dims"):
        tma_cute.plan_atom(mn.op(), k_major, mn.smem_layout, mn.tile)


def test_plan_refuses_a_tensor_of_another_kind():
    op = cpasync.CopyBulkTensorTileG2SOp()
    plan = tma_cute.plan_atom(op, torch.randn(128, 128).half(), smem_64x64, (64, 64))
    with pytest.raises(ValueError, match="does not fit this plan"):
        plan.spec(torch.randn(128, 128).bfloat16())
    static = tma_cute.plan_atom(op, torch.randn(128, 128).half(), smem_64x64, (64, 64), static_layout=True)
    with pytest.raises(ValueError, match="does not fit this plan"):
        static.spec(torch.randn(128, 192).half())


def test_plans_are_cached_per_static_configuration():
    op = cpasync.CopyBulkTensorTileG2SOp()
    a = tma_cute.plan_atom(op, torch.randn(128, 128).half(), smem_64x64, (64, 64))
    assert tma_cute.plan_atom(cpasync.CopyBulkTensorTileG2SOp(), torch.randn(77, 320).half(), smem_64x64,
                              (64, 64)) is a
    assert tma_cute.plan_atom(op, torch.randn(128, 128).half(), smem_64x64, (64, 64), static_layout=True) is not a


def test_dsl_version_outside_4_8_is_refused(monkeypatch):
    for found in ("4.9.0", "4.7.1"):
        monkeypatch.setattr(importlib.metadata, "version", lambda name, found=found: found)
        with pytest.raises(ImportError, match=re.escape(f"supports {tma_cute.SUPPORTED_DSL}, found {found}")):
            tma_cute._check_dsl_version()


def test_atom_tensor_map_and_bound_map_through_a_cache():
    """The host API on a CPU cache (real table and slots, fake driver encoder): the map holds the derived spec,
    and a bound map keeps its slot while its source's tensor is replaced."""
    cache = cpu_cache(slots=8)
    config = atom_matrix.Config(2, "float16", "SW64", "K", 1)
    args = (config.op(), config.smem_layout, config.tile)
    x = cpu_tensor(config, "small")
    tmap = tma_cute.atom_tensor_map(args[0], x, *args[1:], l2_promotion=L2Promotion.L2_64B, cache=cache)
    assert tmap.spec == tma_cute.plan_atom(args[0], x, *args[1:]).spec(x, L2Promotion.L2_64B)
    assert tma_cute.atom_tensor_map(args[0], x, *args[1:], l2_promotion=L2Promotion.L2_64B, cache=cache) is tmap

    weights = {"w": cpu_tensor(config, "small")}
    bound = tma_cute.bind_atom_tensor_map(args[0], lambda: weights["w"], *args[1:], l2_promotion=L2Promotion.L2_256B,
                                          cache=cache)
    ptr = bound.ptr
    weights["w"] = cpu_tensor(config, "large")
    assert bound.ptr == ptr
    assert bound.spec == tma_cute.plan_atom(args[0], weights["w"], *args[1:]).spec(weights["w"], L2Promotion.L2_256B)
    assert cache.stats()["refreshes"] == 1


def test_prefetch_tma_desc_refuses_an_unknown_fence_scope():
    """The prefetch's optional fence takes tma_desc_ptr's scopes only (its PTX: tests/test_linear_kernel.py)."""
    with pytest.raises(ValueError, match="acquire must be None or one of"):
        tma_cute.prefetch_tma_desc(0, acquire="cta")


# ---- CPU: our DSL kernels compile for sm_90a --------------------------------------------------------------


def assert_fence_before_first_load(ptx: str) -> None:
    """The acquire fence on our descriptor runs on every thread: no branch or label precedes it (so it is not
    inside an elected or predicated block), and it comes before the first TMA load."""
    lines = [line.strip() for line in ptx.splitlines()]
    entry = next(i for i, line in enumerate(lines) if line.startswith(".visible .entry") or line.startswith(".entry"))
    fence = next(i for i, line in enumerate(lines) if "fence.proxy.tensormap::generic.acquire.sys" in line)
    first_load = next(i for i, line in enumerate(lines) if "cp.async.bulk.tensor" in line)
    assert entry < fence < first_load
    before = lines[entry:fence + 1]
    assert not any(re.search(r"\bbra(\.uni)?\b", line) or line.startswith("$L") or line.startswith("@")
                   for line in before), "the fence is behind a branch or predicate"


# one config per (rank, major, multicast) with dtype and swizzle varied across them
KERNEL_CONFIGS = [c for c in CONFIGS if (c.rank, c.major, c.num_multicast, c.dtype, c.swizzle) in {
    (2, "K", 1, "bfloat16", "SW128"), (2, "K", 2, "float8_e4m3fn", "SW64"), (2, "MN", 1, "float16", "SW32"),
    (2, "MN", 2, "float32", "INTER"), (3, "K", 1, "float32", "SW32"), (3, "K", 2, "float16", "INTER"),
    (3, "MN", 1, "float8_e4m3fn", "SW128"), (3, "MN", 2, "bfloat16", "SW64")}]


@pytest.mark.parametrize("config", KERNEL_CONFIGS, ids=[c.name for c in KERNEL_CONFIGS])
def test_atom_matrix_kernel_compiles_for_sm90a(config, tmp_path):
    compiled = atom_matrix.compile_cell_kernel(config, options=f"--keep-ptx --dump-dir {tmp_path}")
    assert_fence_before_first_load(compiled.artifacts.PTX)


STREAM_CONFIGS = [tma_stream_reduce.StreamReduce(box_rows=r, box_inner_bytes=b, swizzle=s, descriptor=d)
                  for r, b, s in [(128, 128, "B128"), (64, 128, "B128"), (128, 64, "B64"), (64, 256, "NONE")]
                  for d in ("cached", "atom")] + [tma_stream_reduce.StreamReduce(dtype=torch.float32, box_rows=64,
                                                                                   box_inner_bytes=32, swizzle="B32")]


@pytest.mark.parametrize("config", STREAM_CONFIGS, ids=lambda c: f"{c.box_rows}x{c.box_inner_bytes}B-{c.swizzle}-"
                         f"{c.descriptor}-{str(c.dtype)[6:]}")
def test_stream_reduce_kernel_compiles_for_sm90a(config, tmp_path):
    compiled = config.compile(options=f"--keep-ptx --dump-dir {tmp_path}")
    ptx = compiled.artifacts.PTX
    assert_fence_before_first_load(ptx)
    # "cached" loads name the descriptor the fence acquired; "atom" loads use the kernel's parameter instead
    fence_reg = re.search(r"fence\.proxy\.tensormap::generic\.acquire\.sys \[(%rd\d+)\]", ptx).group(1)
    load_desc = re.search(r"cp\.async\.bulk\.tensor\S* \[[^\]]+\], \[(%rd\d+),", ptx).group(1)
    assert (load_desc == fence_reg) == (config.descriptor == "cached")


def test_stream_reduce_refuses_bad_configurations():
    with pytest.raises(ValueError, match="must equal the B128 swizzle span"):
        tma_stream_reduce.StreamReduce(box_inner_bytes=64, swizzle="B128")
    with pytest.raises(ValueError, match="does not split into 16-byte loads"):
        tma_stream_reduce.StreamReduce(box_rows=1, box_inner_bytes=32)


# ---- GPU ---------------------------------------------------------------------------------------------------

GPU_CELLS = [(c, s) for c in KERNEL_CONFIGS for s in ("small", "large")]


@pytest.fixture(scope="module")
def cell_kernels():
    return {}


def compiled_cell(cell_kernels, config):
    if config not in cell_kernels:
        cell_kernels[config] = atom_matrix.compile_cell_kernel(config)
    return cell_kernels[config]


@pytest.mark.requires_sm90
@pytest.mark.timeout(GPU_TIMEOUT_S)
@pytest.mark.parametrize("config, size", GPU_CELLS, ids=[f"{c.name}-{s}" for c, s in GPU_CELLS])
def test_cached_descriptor_lands_the_same_smem_bytes(cell_kernels, config, size):
    record = atom_matrix.run_cell(config, size, compiled_cell(cell_kernels, config))
    assert record["functional"] == "same", record["functional"]
    assert not record["field_diffs"], record["field_diffs"]
    assert record["host_matches_device"]
    assert record["status"] == "ok"


@pytest.mark.requires_sm90
@pytest.mark.timeout(GPU_TIMEOUT_S)
@pytest.mark.parametrize("promotion", list(L2Promotion), ids=[p.name for p in L2Promotion])
def test_feature_request_repro_on_device(cell_kernels, promotion):
    """#3672's repro as a test: the atom's own descriptor, dumped on the device, reads 128B; ours reads what
    was asked for; both load the same bytes."""
    config = atom_matrix.Config(2, "float16", "SW128", "K", 1)
    record = atom_matrix.run_cell(config, "small", compiled_cell(cell_kernels, config), promotion)
    assert record["promotion"] == {"atom": "L2_128B", "ours": promotion.name}
    assert record["functional"] == "same" and record["status"] == "ok"
    assert (bytes.fromhex(record["ours"])[10] >> 1) & 3 == int(promotion)


@pytest.mark.requires_sm90
@pytest.mark.timeout(GPU_TIMEOUT_S)
def test_bound_map_follows_a_replaced_weight(cell_kernels):
    config = atom_matrix.Config(2, "bfloat16", "SW128", "K", 2)
    compiled = compiled_cell(cell_kernels, config)
    weights = {"w": atom_matrix.make_tensor(config, "large", "cuda")}
    bound = tma_cute.bind_atom_tensor_map(config.op(), lambda: weights["w"], config.smem_layout, config.tile,
                                          config.num_multicast, l2_promotion=L2Promotion.L2_256B)
    ptr = bound.ptr
    _, out = atom_matrix.load_both(compiled, config, weights["w"], ptr)
    assert torch.equal(out[0], out[1])

    old = weights["w"]                                                # kept alive: the stale map reads it
    weights["w"] = atom_matrix.make_tensor(config, "large", "cuda")   # a new tensor, a new address
    assert weights["w"].data_ptr() != old.data_ptr()
    _, stale = atom_matrix.load_both(compiled, config, weights["w"], ptr)
    assert not torch.equal(stale[0], stale[1]), "the slot still describes the old tensor: this must differ"
    assert bound.ptr == ptr                                           # refreshes in place
    _, out = atom_matrix.load_both(compiled, config, weights["w"], ptr)
    assert torch.equal(out[0], out[1])


@pytest.mark.requires_sm90
@pytest.mark.timeout(GPU_TIMEOUT_S)
@pytest.mark.parametrize("config", STREAM_CONFIGS, ids=lambda c: f"{c.box_rows}x{c.box_inner_bytes}B-{c.swizzle}-"
                         f"{c.descriptor}-{str(c.dtype)[6:]}")
def test_stream_reduce_checksum_is_exact(config):
    # Ragged shape (partial boxes at both edges) and small random integers: every float32 partial sum is exact
    # (below 2^24), so the float64 total must equal the float64 reference exactly; a lost or repeated box shows.
    x = torch.randint(1, 9, (3001, 2056), device="cuda").to(config.dtype)
    expected = tma_stream_reduce.tma_stream_reduce_ref(x)
    for promotion in L2Promotion:
        for ctas_per_sm in (1, 2):
            out = torch.full((config.grid(x, ctas_per_sm), config.consumer_threads), float("nan"), device="cuda")
            got = config.partial_sums(x, l2_promotion=promotion, ctas_per_sm=ctas_per_sm, out=out)
            torch.cuda.synchronize()
            assert torch.isfinite(got).all(), "a consumer thread did not write its partial sum"
            assert got.sum(dtype=torch.float64).item() == expected.item(), (promotion, ctas_per_sm)
