"""Host-side cost of the descriptor service on the GPU machine (pytest-benchmark).

    pytest benchmarks/bench_cache.py --benchmark-json=cache.json

Measured in the same run as its baselines: a Python dict keyed on the same fields built from the tensor (what a
hand-rolled cache costs), and a fresh encode through cuda-bindings (what re-encoding per launch costs).
Targets (issue 2): get() hit <= 0.6 us, bound handle check + pointer <= 0.25 us."""
import pytest
import torch

import torch_tma
from torch_tma import L2Promotion, Swizzle

pytestmark = pytest.mark.requires_sm90
DEV = torch.device("cuda", 0)
BOX = (64, 64)


@pytest.fixture(scope="module")
def weight():
    return torch.randn(4096, 4096, device=DEV, dtype=torch.bfloat16)


def test_get_hit(benchmark, weight):
    cache = torch_tma.TensorMapCache(DEV)
    tm = cache.get(weight, BOX, swizzle=Swizzle.B128, l2_promotion=L2Promotion.L2_256B)
    result = benchmark(cache.get, weight, BOX, swizzle=Swizzle.B128, l2_promotion=L2Promotion.L2_256B)
    assert result is tm


@pytest.mark.parametrize("source", ["module_attr", "tensor", "callable"])
def test_bound_ptr(benchmark, weight, source):
    """The bound handle's validity check plus pointer, for each kind of source (module attribute: what
    torch_tma.nn.Linear binds)."""
    cache = torch_tma.TensorMapCache(DEV)
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(weight, requires_grad=False)
    src = {"module_attr": (module, "weight"), "tensor": module.weight, "callable": lambda: module.weight}[source]
    handle = cache.bind(src, BOX, swizzle=Swizzle.B128)
    ptr = handle.ptr
    assert benchmark(getattr, handle, "ptr") == ptr


def test_baseline_python_dict(benchmark, weight):
    table = {}

    def lookup(t):
        key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), BOX, int(Swizzle.B128), int(L2Promotion.L2_256B))
        return table.setdefault(key, key)

    benchmark(lookup, weight)


def test_baseline_bindings_encode(benchmark, weight):
    from cuda.bindings import driver as drv
    U32, U64 = drv.cuuint32_t, drv.cuuint64_t
    dims = [U64(weight.shape[1]), U64(weight.shape[0])]
    strides, box, es = [U64(weight.stride(0) * 2)], [U32(64), U32(64)], [U32(1), U32(1)]

    def encode():
        return drv.cuTensorMapEncodeTiled(
            drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, weight.data_ptr(), dims, strides, box, es,
            drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
            drv.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)

    assert benchmark(encode)[0] == drv.CUresult.CUDA_SUCCESS


def test_miss_encode_and_slot_write(benchmark, weight):
    cache = torch_tma.TensorMapCache(DEV, capacity_bytes=64 << 20)
    views = iter([weight[i:] for i in range(0, 4096)])  # 4096 distinct addresses, every one a miss

    def miss():
        return cache.get(next(views), BOX, swizzle=Swizzle.B128)

    benchmark.pedantic(miss, rounds=2000, iterations=1, warmup_rounds=10)
    assert cache.stats()["hits"] == 0


def test_refresh_in_place(benchmark, weight):
    cache = torch_tma.TensorMapCache(DEV)
    pair = [weight, weight[64:]]
    holder = {"w": pair[0]}
    handle = cache.bind(lambda: holder["w"], BOX, swizzle=Swizzle.B128)
    state = {"i": 0}

    def refresh():
        state["i"] ^= 1
        holder["w"] = pair[state["i"]]
        return handle.refresh()

    assert benchmark(refresh)
