"""TensorMapCache bookkeeping that needs no GPU: keys, hits, LRU eviction, pins, stale handles, threads (CPU).

A cache on the CPU device runs the real table and slot logic; only the driver call is replaced by a fake
encoder that returns 128 bytes derived from the spec, so nothing here pretends to test the driver."""
import os
import subprocess
import sys
import threading

import pytest
import torch

import torch_tma
from torch_tma import TensorMapSpec, _C
from torch_tma.cache import StaleTensorMapError


def fake_encode(data_type, address, dims, strides, box, elem_strides, il, sw, l2, oob, device_index):
    payload = repr((data_type, address, tuple(dims), tuple(strides), tuple(box), tuple(elem_strides), il, sw, l2,
                    oob)).encode()
    return (payload * (128 // len(payload) + 1))[:128]


def cpu_cache(slots=4, chunk_slots=2):
    cache = torch_tma.TensorMapCache("cpu", capacity_bytes=128 * slots, chunk_bytes=128 * chunk_slots)
    cache._encode_tiled = fake_encode
    return cache


def spec(address=0x10000, **kw):
    return TensorMapSpec.from_strided(address, torch.float16, (64, 128), (128, 1), (32, 64), **kw)


def spec_of(t):
    """A (32, 64) box over a CPU tensor, as bind_spec's make_spec."""
    return TensorMapSpec.from_strided(t.data_ptr(), t.dtype, t.shape, t.stride(), (32, 64))


def test_get_spec_miss_then_hit():
    cache = cpu_cache()
    a = cache.get_spec(spec())
    b = cache.get_spec(spec())
    assert a is b
    assert a.ptr % 128 == 0 and len(a.raw) == 128
    assert bytes(cache._slot_views[a.ptr].tolist()) == a.raw  # the slot holds what was encoded
    s = cache.stats()
    assert (s["hits"], s["misses"], s["encodes"], s["slots_in_use"], s["bytes_reserved"]) == (1, 1, 1, 1, 256)


def test_every_encoding_input_is_part_of_the_key():
    cache = cpu_cache(slots=16, chunk_slots=16)
    base = spec()
    variants = [base, base.replace(address=0x20000), base.replace(box=(64, 16)),
                base.replace(l2_promotion=torch_tma.L2Promotion.L2_256B),
                base.replace(swizzle=torch_tma.Swizzle.B128), base.replace(elem_strides=(1, 2)),
                base.replace(oob_fill=torch_tma.OOBFill.NAN_REQUEST_ZERO_FMA),
                base.replace(data_type=torch_tma.DataType.BFLOAT16), base.replace(dims=(64, 127)),
                base.replace(strides=(512,))]
    ptrs = {cache.get_spec(v).ptr for v in variants}
    assert len(ptrs) == len(variants)
    assert cache.stats()["misses"] == len(variants)


def test_tensor_keys_in_the_native_table():
    table = _C.Table("cpu", 0)
    x = torch.randn(4, 64)
    args = ((2, 64), None, 0, 0, 2, 0, -1)
    table.insert(x, *args, "x")
    assert table.lookup(x, *args) == "x"
    assert table.lookup(x, [2, 64], *args[1:]) == "x"  # list or tuple box: same key
    assert table.lookup(x.t().contiguous().t(), *args) is None  # other strides
    assert table.lookup(x.half(), *args) is None  # other dtype
    assert table.lookup(x[1:], *args) is None  # other address and shape
    assert table.lookup(x, (4, 64), *args[1:]) is None  # other box
    assert table.lookup(x, (2, 64), None, 0, 0, 3, 0, -1) is None  # other promotion
    assert table.lookup(x, (2, 64), (1, 2), 0, 0, 2, 0, -1) is None  # other element strides
    with pytest.raises(TypeError):
        table.lookup(x, ("a", 64), *args[1:])


def test_hits_stay_native_with_box_positional_or_by_keyword(monkeypatch):
    calls = []  # the Python get runs only for what the native hit path hands on
    python_get = torch_tma.TensorMapCache.get
    monkeypatch.setattr(torch_tma.TensorMapCache, "get",
                        lambda self, *a, **kw: calls.append(kw) or python_get(self, *a, **kw))
    cache = cpu_cache()
    x = torch.randn(64, 128, dtype=torch.float16)
    enc = dict(swizzle=torch_tma.Swizzle.B128, l2_promotion=torch_tma.L2Promotion.L2_256B)
    cache._table.insert(x, (32, 64), None, 0, int(enc["swizzle"]), int(enc["l2_promotion"]), 0, -1, "entry")
    assert cache.get(x, (32, 64), **enc) == "entry"
    assert cache.get(x, box=(32, 64), **enc) == "entry"
    assert cache.get(x, box=[32, 64], l2_promotion=enc["l2_promotion"], swizzle=enc["swizzle"]) == "entry"
    assert calls == []
    with pytest.raises(ValueError, match="not a CUDA device"):  # a miss: the Python path (CPU memory is refused)
        cache.get(x, box=(16, 64), **enc)
    with pytest.raises(TypeError, match="multiple values for argument 'box'"):
        cache.get(x, (32, 64), box=(32, 64), **enc)
    assert len(calls) == 2


def test_lru_eviction_at_capacity_and_stale_handles():
    cache = cpu_cache(slots=4, chunk_slots=2)
    maps = [cache.get_spec(spec(address=0x10000 * (i + 1))) for i in range(4)]
    assert cache.stats()["bytes_reserved"] == 512
    cache.get_spec(spec(address=0x10000))  # touch the first: the second is now least recently used
    fifth = cache.get_spec(spec(address=0x90000))
    assert fifth.ptr == maps[1]._ptr  # the LRU slot was reused
    assert cache.stats()["evictions"] == 1 and cache.stats()["bytes_reserved"] == 512
    with pytest.raises(StaleTensorMapError, match="was evicted"):
        maps[1].ptr
    assert "EVICTED" in repr(maps[1])
    assert maps[0].ptr and maps[2].ptr
    again = cache.get_spec(spec(address=0x20000))  # the evicted key encodes anew
    assert again is not maps[1] and cache.stats()["misses"] == 6


def test_bound_handles_are_pinned_and_refresh_in_place():
    cache = cpu_cache(slots=2, chunk_slots=2)
    holder = {"t": torch.empty(64, 128, dtype=torch.float16)}  # the source reads holder["t"]: "reallocate" it
    handle = cache.bind_spec(lambda: holder["t"], spec_of)
    ptr = handle.ptr
    assert cache.get_spec(spec_of(holder["t"])) is handle.map  # get_spec hits the bound slot
    for i in range(3):  # pressure: the bound slot is never the victim
        cache.get_spec(spec(address=0x100000 * (i + 1)))
    assert handle.ptr == ptr
    holder["t"] = torch.empty(64, 128, dtype=torch.float16)  # "reallocated"
    assert handle.ptr == ptr  # same slot...
    assert handle.spec.address == holder["t"].data_ptr()  # ...new contents
    assert bytes(cache._slot_views[ptr].tolist()) == handle.map.raw
    assert cache.stats()["refreshes"] == 1
    assert cache.refresh_all() == 0  # nothing moved since
    holder["t"] = torch.empty(32, 128, dtype=torch.float16)
    assert cache.refresh_all() == 1 and handle.spec.dims == (128, 32)


def test_full_of_pinned_slots_raises():
    cache = cpu_cache(slots=2, chunk_slots=2)
    tensors = [torch.empty(64, 128, dtype=torch.float16) for _ in range(2)]
    handles = [cache.bind_spec(t, spec_of) for t in tensors]
    with pytest.raises(torch_tma.CacheFullError, match="full of pinned or graph-captured descriptors"):
        cache.get_spec(spec(address=0x700000))
    handles[0].close()  # its slot comes back
    assert cache.get_spec(spec(address=0x700000)).ptr == handles[0].map._ptr


def test_threads_share_one_cache_consistently():
    cache = cpu_cache(slots=64, chunk_slots=8)
    errors = []

    def worker(seed):
        try:
            for i in range(300):
                tm = cache.get_spec(spec(address=0x10000 * (1 + (seed * 7 + i) % 40)))
                assert tm.spec.address == 0x10000 * (1 + (seed * 7 + i) % 40)
        except Exception as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    s = cache.stats()
    assert s["hits"] + s["misses"] == 8 * 300
    live = [tm for tm in cache.entries() if not tm._evicted]
    assert len({tm.spec.key() for tm in live}) == len(live)  # no key twice
    for tm in live:
        assert bytes(cache._slot_views[tm._ptr].tolist()) == tm.raw


def test_cache_argument_errors():
    with pytest.raises(ValueError, match="chunk_bytes=100 must be a positive multiple of 128"):
        torch_tma.TensorMapCache("cpu", chunk_bytes=100)
    with pytest.raises(ValueError, match="capacity_bytes=128 is below one chunk"):
        torch_tma.TensorMapCache("cpu", capacity_bytes=128, chunk_bytes=256)
    with pytest.raises(TypeError, match="expected a TensorMapSpec, got dict"):
        cpu_cache().get_spec({})
    with pytest.raises(TypeError, match=r"source must be a tensor, a \(module, attribute name\) pair or a zero-argument callable"):
        cpu_cache().bind(3, (8, 8))


def test_get_rejects_cpu_tensors_with_a_clear_error():
    with pytest.raises(ValueError, match="tensor is on cpu, not a CUDA device"):
        cpu_cache().get(torch.randn(8, 64), (8, 64))
    with pytest.raises(TypeError, match="expected a torch.Tensor, got str"):
        cpu_cache().get("weights", (8, 64))


def test_import_without_a_driver_fails_only_on_device_use():
    """On a machine without libcuda (CI), import works and the first device feature names what is missing."""
    code = ("import torch_tma, sys\n"
            "status = torch_tma.driver_status()\n"
            "print('STATUS', status)\n"
            "try:\n"
            "    print('ENCODED', len(torch_tma._C.encode_tiled(6, 4096, [64, 64], [128], [64, 64], [1, 1], 0, 0, 2,"
            " 0, 0)))\n"
            "except RuntimeError as e:\n"
            "    print('ERROR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    status = out.split("STATUS", 1)[1].splitlines()[0].strip()
    if status:  # no driver here: the message says what is missing
        assert "libcuda.so.1" in status or "cuInit" in status
        assert "ERROR torch_tma:" in out and "NVIDIA" in out
    else:  # a driver: a fresh process (no CUDA context yet) encodes through the device's primary context
        assert "ENCODED 128" in out, out


def test_a_closed_bound_handle_is_stale_and_left_out_of_refresh_all():
    cache = cpu_cache(slots=2, chunk_slots=2)
    holder = {"t": torch.empty(64, 128, dtype=torch.float16)}  # the source reads holder["t"]: "reallocate" it
    handle = cache.bind_spec(lambda: holder["t"], spec_of)
    slot = handle.ptr
    handle.close()
    handle.close()  # twice is fine
    assert cache.stats()["bound"] == 0
    for read in (lambda: handle.ptr, handle.refresh, lambda: handle.map.ptr):
        with pytest.raises(StaleTensorMapError, match="given back by close|was evicted"):
            read()
    holder["t"] = torch.empty(64, 128, dtype=torch.float16)  # moved: refresh_all must not write the old slot
    assert cache.refresh_all() == 0
    other = cache.get_spec(spec(address=0x900000))
    cache.get_spec(spec(address=0xA00000))  # the arena's two slots are in use: the closed one was reused
    assert slot in {other._ptr, cache.get_spec(spec(address=0xA00000))._ptr}
    assert cache.refresh_all() == 0
    with pytest.raises(StaleTensorMapError, match="given back by close"):
        handle.ptr


def test_a_handle_closed_while_its_source_runs_is_stale():
    """ptr reads the source (Python code) in its native call: a close() there, or in another thread meanwhile,
    must not leave the call reading the freed native state or the given-back slot."""
    cache = cpu_cache(slots=2, chunk_slots=2)
    t = torch.empty(64, 128, dtype=torch.float16)
    calls = []

    def source():
        calls.append(1)
        if len(calls) == 3:  # bind reads it once, the first ptr once: close during the second ptr
            handle.close()
            [bytearray(24) for _ in range(100)]  # hand the freed native state's bytes to new objects
        return t

    handle = cache.bind_spec(source, spec_of)
    assert handle.ptr == handle.map._ptr
    for _ in range(2):  # closed inside the read, then closed before it
        with pytest.raises(StaleTensorMapError, match="given back by close"):
            handle.ptr


def test_a_handle_closed_while_its_moved_source_runs_is_stale():
    """The same through the refresh path: the source moved, so ptr re-encodes, and reading it closes the handle."""
    cache = cpu_cache(slots=2, chunk_slots=2)
    tensors = [torch.empty(64, 128, dtype=torch.float16) for _ in range(2)]
    calls = []

    def source():
        calls.append(1)
        if len(calls) == 3:  # bind reads it once, ptr's native read once, then refresh() reads it: close there
            handle.close()
        return tensors[len(calls) > 1]  # moved after bind

    handle = cache.bind_spec(source, spec_of)
    with pytest.raises(StaleTensorMapError, match="given back by close"):
        handle.ptr
    assert cache.stats()["refreshes"] == 0
    with pytest.raises(StaleTensorMapError):
        handle.map.ptr
    assert cache.get_spec(spec_of(tensors[1])) is not handle.map  # the closed entry was not keyed on the new tensor


def test_refresh_all_skips_handles_closed_meanwhile_and_refreshes_past_a_failing_source():
    cache = cpu_cache(slots=4, chunk_slots=4)
    holders = [{"t": torch.empty(64, 128, dtype=torch.float16)} for _ in range(3)]
    fail, handles = {"close": False, "raise": 0}, []

    def source_of(i):
        def source():
            if fail["close"]:  # the first source read closes the other handles
                fail["close"] = False
                for other in handles[:i] + handles[i + 1:]:
                    other.close()
            if fail["raise"] and i == 0:
                fail["raise"] -= 1
                raise KeyError("source failed")
            return holders[i]["t"]
        return source

    handles += [cache.bind_spec(source_of(i), spec_of) for i in range(3)]
    for holder in holders:
        holder["t"] = torch.empty(64, 128, dtype=torch.float16)  # every source moved
    fail["raise"] = 1
    with pytest.raises(KeyError, match="source failed") as raised:
        cache.refresh_all()
    assert "1 of 3 bound handles failed to refresh" in str(raised.value.__notes__)
    assert cache.stats()["refreshes"] == 2  # the two after (or before) the failing one
    assert cache.refresh_all() == 1  # the failed one, now that its source answers
    fail["close"] = True
    assert cache.refresh_all() in (0, 1) and cache.stats()["bound"] == 1  # no StaleTensorMapError


def test_refresh_of_a_handle_closed_while_its_unmoved_source_runs_is_stale():
    cache = cpu_cache(slots=2, chunk_slots=2)
    t, closing = torch.empty(64, 128, dtype=torch.float16), {"on": False}

    def source():
        if closing["on"]:
            handle.close()
        return t

    handle = cache.bind_spec(source, spec_of)
    closing["on"] = True
    with pytest.raises(StaleTensorMapError, match="given back by close"):
        handle.refresh()  # not False: the handle is closed


def test_a_failed_slot_write_gives_the_slot_back(monkeypatch):
    cache = cpu_cache(slots=2, chunk_slots=2)
    write = cache._write

    def failing(slot, raw):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(cache, "_write", failing)
    for address in (0x900000, 0xA00000):
        with pytest.raises(RuntimeError, match="copy failed"):
            cache.get_spec(spec(address=address))
    monkeypatch.setattr(cache, "_write", write)
    tms = [cache.get_spec(spec(address=a)) for a in (0xB00000, 0xC00000)]  # both slots are free again
    assert len({tm._ptr for tm in tms}) == 2 and cache.stats()["slots_in_use"] == 2


@pytest.fixture
def cpu_tensor_specs(monkeypatch):
    """TensorMapSpec.from_tensor without its CUDA check, so cache.get runs on CPU tensors (the only change)."""
    def from_tensor(cls, tensor, box, **kwargs):
        return cls.from_strided(tensor.data_ptr(), tensor.dtype, tensor.shape, tensor.stride(), box, **kwargs)
    monkeypatch.setattr(TensorMapSpec, "from_tensor", classmethod(from_tensor))


def test_get_keys_on_checked_ints(cpu_tensor_specs):
    cache = cpu_cache(slots=8, chunk_slots=8)
    x = torch.randn(64, 128, dtype=torch.float16)
    first = cache.get(x, (torch.tensor(32), 64))  # __index__ ints are accepted, as by the spec...
    assert cache.get(x, (32, 64)) is first  # ...and keyed as the ints the native hit path sees
    bound = cache.bind(x, [torch.tensor(16), 64])
    assert cache.get(x, (16, 64)) is bound.map
    cache.get(x, (1, 64))
    with pytest.raises(TypeError, match=r"box\[0\] must be an int, got bool True"):  # not a hit on (1, 64)
        cache.get(x, (True, 64))
    cache.get(x, (16, 16), swizzle=torch_tma.Swizzle.B32)
    with pytest.raises(TypeError, match="swizzle must be a torch_tma.Swizzle, got bool True"):
        cache.get(x, (16, 16), swizzle=True)
    with pytest.raises(ValueError, match="data_type=-1 is not a DataType"):  # not the data_type=None entry
        cache.get(x, (32, 64), data_type=-1)
    with pytest.raises(ValueError, match=r"box\[1\]=1180591620717411303424 is out of range"):
        cache.get(x, (2**70, 64))
    assert cache.stats()["misses"] == 4


@pytest.mark.parametrize("field, value, pattern", [
    ("address", 2**63, "address=0x8000000000000000 is out of range"),
    ("dims", (2**64, 64), r"dims\[0\]=18446744073709551616 is out of range"),
    ("strides", (2**63,), r"strides\[0\]=9223372036854775808 bytes is out of range"),
])
def test_get_spec_names_values_outside_int64(field, value, pattern):
    with pytest.raises(ValueError, match=pattern):
        cpu_cache().get_spec(spec().replace(**{field: value}))


def test_native_keys_refuse_bools_and_values_outside_int64():
    table = _C.Table("cpu", 0)
    x = torch.randn(4, 64)
    with pytest.raises(TypeError, match="box entries must be ints"):
        table.lookup(x, (True, 64), None, 0, 0, 2, 0, -1)
    with pytest.raises(ValueError, match="box entry 18446744073709551616 is outside int64"):
        table.lookup(x, (2**64, 64), None, 0, 0, 2, 0, -1)


def test_cache_bytes_from_the_environment_are_read_when_a_cache_is_made():
    code = ("import torch_tma\n"
            "for value in ('16MiB', '1000'):\n"
            "    import os; os.environ['TORCH_TMA_CACHE_BYTES'] = value\n"
            "    try:\n"
            "        torch_tma.TensorMapCache('cpu')\n"
            "    except ValueError as e:\n"
            "        print('ERROR', e)\n"
            "os.environ['TORCH_TMA_CACHE_BYTES'] = str(1 << 20)\n"
            "print('CAP', torch_tma.TensorMapCache('cpu').capacity_bytes)\n")
    env = {**os.environ, "TORCH_TMA_CACHE_BYTES": "not a number"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert "ERROR TORCH_TMA_CACHE_BYTES='16MiB' must be a whole number of bytes" in out
    assert "ERROR TORCH_TMA_CACHE_BYTES=1000 is below one chunk (65536 B)" in out
    assert f"CAP {1 << 20}" in out


def test_get_takes_one_shot_iterables(cpu_tensor_specs, monkeypatch):
    """The native hit path keys lists and tuples only: an iterator reaches the Python get undrained."""
    cache = cpu_cache(slots=8, chunk_slots=8)
    x = torch.randn(64, 128, dtype=torch.float16)
    first = cache.get(x, iter([32, 64]), elem_strides=iter([1, 1]))
    assert cache.get(x, (32, 64), elem_strides=(1, 1)) is first
    assert cache.get(x, iter([32, 64]), elem_strides=(1, 1)) is first
    assert cache.get(x, [32, 64], elem_strides=[1, 1]) is first
    specs_made = []  # the Python get makes a spec; the native hit path does not
    made = TensorMapSpec.from_tensor
    monkeypatch.setattr(TensorMapSpec, "from_tensor",
                        classmethod(lambda cls, *args, **kwargs: specs_made.append(1) or made(*args, **kwargs)))
    assert cache.get(x, range(32, 65, 32), elem_strides=(1, 1)) is first  # a sequence, not a list: still native
    assert cache.get(x, iter([32, 64]), elem_strides=(1, 1)) is first and len(specs_made) == 1
    assert cache.stats()["misses"] == 1
