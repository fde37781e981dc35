"""TensorMapCache: device-resident TMA descriptors at stable addresses.

Each cache owns, for one device, an arena of 128-byte slots in device memory. The arena grows in chunks taken
from torch's caching allocator (base addresses 512-byte aligned, so every slot is 128-byte aligned, above the
64 bytes TMA requires) and never moves a slot once handed out. A hit on ``get`` is one native hash lookup: no
encode, no copy. A miss validates the inputs, encodes through the driver and writes the bytes into a slot with a
non-blocking copy on the current stream, so any kernel launched after ``get`` returns on that stream reads the
new descriptor. Launch kernels that use a descriptor on the stream that was current at ``get``, or order their
stream after it.

Lifetimes (DESIGN invariants 2-4):
  * a slot is reused for another key only after events recorded on every stream the old entry was handed out
    on have completed (least recently used first, only when the arena is at its byte cap);
  * bound handles (``bind``) are pinned and keep their slot for life; ``refresh`` rewrites it in place;
  * an entry handed out while the current stream is being captured into a CUDA graph is pinned for the cache's
    life, since the graph may replay it at any time;
  * a miss during capture raises CaptureMissError (warm up first): it never records a host-side write.
"""
from __future__ import annotations

import functools
import logging
import os
import threading
import weakref
from typing import Callable

import torch

from . import _C
from .layout import DESCRIPTOR_BYTES, decode
from .spec import Interleave, L2Promotion, OOBFill, Swizzle, TensorMapSpec

__all__ = ["TensorMap", "BoundTensorMap", "TensorMapCache", "default_cache", "CaptureMissError",
           "StaleTensorMapError", "CacheFullError", "driver_status"]

log = logging.getLogger("torch_tma")
SLOT_BYTES = DESCRIPTOR_BYTES
DEFAULT_CAPACITY = 16 << 20  # capacity_bytes where neither the argument nor TORCH_TMA_CACHE_BYTES gives one


def _capacity_from_env() -> int:
    """TORCH_TMA_CACHE_BYTES, read when a cache is made (a bad value fails there, naming the variable, not at
    import)."""
    value = os.environ.get("TORCH_TMA_CACHE_BYTES")
    if value is None:
        return DEFAULT_CAPACITY
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"TORCH_TMA_CACHE_BYTES={value!r} must be a whole number of bytes "
                         f"(e.g. {DEFAULT_CAPACITY} for the default 16 MiB)") from None
DEFAULT_CHUNK = 64 << 10
_DEBUG = os.environ.get("TORCH_TMA_DEBUG", "0") not in ("", "0")


class CaptureMissError(RuntimeError):
    """A descriptor was missing (or needed a refresh) while the current stream was capturing a CUDA graph."""


class StaleTensorMapError(RuntimeError):
    """A TensorMap whose slot was evicted was used."""


class CacheFullError(RuntimeError):
    """Every slot under the byte cap is pinned or in use by a capture."""


def driver_status() -> str:
    """Empty when the CUDA driver is usable; otherwise what is missing."""
    return _C.driver_status()


class TensorMap:
    """One descriptor in device memory. ``ptr`` is the slot's device address (128-byte aligned); ``raw`` the 128
    bytes written there; ``spec`` the inputs (driver order)."""
    __slots__ = ("_ptr", "raw", "spec", "device", "_entry_id", "_evicted", "__weakref__")

    def __init__(self, ptr: int, raw: bytes, spec: TensorMapSpec, device: torch.device):
        self._ptr, self.raw, self.spec, self.device = ptr, raw, spec, device
        self._entry_id = 0
        self._evicted = False

    @property
    def ptr(self) -> int:
        if self._evicted:
            raise StaleTensorMapError(f"this TensorMap's slot {self._ptr:#x} was evicted and may hold another "
                                      f"descriptor: call cache.get() again, or bind() to keep a slot")
        return self._ptr

    def describe(self) -> str:
        return decode(self.raw).describe()

    def __int__(self) -> int:
        return self.ptr

    def __repr__(self) -> str:
        state = " EVICTED" if self._evicted else ""
        s = self.spec
        return (f"TensorMap(ptr={self._ptr:#x}{state}, device={self.device}, {s.data_type.name}, "
                f"dims={list(s.dims)}, box={list(s.box)}, swizzle={s.swizzle.name}, "
                f"l2_promotion={s.l2_promotion.name}, innermost first)")


class BoundTensorMap:
    """A pinned slot tied to a tensor source: a tensor (``param.data = new`` is seen, since the Parameter object
    stays), a ``(module, "weight")`` pair (the attribute is read each time, so a replaced Parameter is seen too),
    or a zero-argument callable returning the current tensor. ``ptr`` checks natively that the source still has
    the address, dtype, shape and strides it was encoded for and refreshes the slot in place if not; the address
    never changes."""

    # Native getter (csrc/tma_core.cpp: bound_ptr): reads _native, _src and _src_attr from this object's __dict__.
    ptr = property(_C.bound_ptr, doc="Device address of the slot (stable); refreshes first if the source moved.")

    def __init__(self, cache: "TensorMapCache", source, make_spec: Callable[[torch.Tensor], TensorMapSpec],
                 key_given: tuple[bool, bool] | None):
        # key_given: None where get_spec() finds the handle (bind_spec), else whether bind() was given elem_strides
        # and data_type (get() keys on the tensor and the arguments as given: see _tensor_key_args)
        self._src, self._src_attr = _as_source(source)
        self._cache, self._make_spec, self._key_given = cache, make_spec, key_given
        self.map: TensorMap = cache._bind_new(self)
        self._id = self.map._entry_id
        self._native = _C.make_bound_state(cache._table, self._id)
        self._finalizer = weakref.finalize(self, cache._release, self._id)
        with cache._lock:  # refresh_all sees the handle only once it is whole
            cache._bound.add(self)

    def tensor(self) -> torch.Tensor:
        """The source's current tensor."""
        if self._src_attr is None:
            return self._src
        if self._src_attr is Ellipsis:
            return self._src()
        return getattr(self._src, self._src_attr)

    def _refresh_and_ptr(self) -> int:
        self.refresh()
        return self.map._ptr

    def refresh(self) -> bool:
        """Re-encode into the same slot if the source tensor moved; True if it did."""
        self._check_open()
        return self._cache._refresh(self)

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise StaleTensorMapError(f"this bound descriptor's slot {self.map._ptr:#x} was given back by close() "
                                      f"and may hold another descriptor: bind() again")

    def close(self) -> None:
        """Give the slot back (it is reused only after kernels that may read it have finished; never if a CUDA
        graph captured it). Afterwards ``ptr``, ``refresh()`` and ``map.ptr`` raise StaleTensorMapError;
        ``refresh_all`` skips the handle."""
        self.__dict__.pop("_native", None)  # ptr's native getter then defers to refresh(), which raises
        with self._cache._lock:
            self._cache._bound.discard(self)
        self._finalizer()

    @property
    def spec(self) -> TensorMapSpec:
        return self.map.spec

    def __repr__(self) -> str:
        return f"Bound{self.map!r}"


class TensorMapCache:
    """Descriptors for one device, in an arena of 128-byte slots capped at ``capacity_bytes``."""

    def __init__(self, device=None, *, capacity_bytes: int | None = None, chunk_bytes: int = DEFAULT_CHUNK):
        source = "capacity_bytes"
        if capacity_bytes is None:
            capacity_bytes, source = _capacity_from_env(), "TORCH_TMA_CACHE_BYTES"
        device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if chunk_bytes % SLOT_BYTES or chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes={chunk_bytes} must be a positive multiple of {SLOT_BYTES}")
        if capacity_bytes < chunk_bytes:
            raise ValueError(f"{source}={capacity_bytes} is below one chunk ({chunk_bytes} B)")
        self.device, self.capacity_bytes, self.chunk_bytes = device, capacity_bytes, chunk_bytes
        self._table = _C.Table(device.type, device.index or 0)
        self._lock = threading.RLock()
        self._chunks: list[torch.Tensor] = []
        self._slot_views: dict[int, torch.Tensor] = {}
        self._free: list[int] = []
        self._retiring: list[tuple[int, int]] = []  # (entry id, slot) waiting for their events
        self._bound: weakref.WeakSet[BoundTensorMap] = weakref.WeakSet()
        self._counts = dict(misses=0, encodes=0, refreshes=0, evictions=0)
        self._capability = None
        self._encode_tiled = _C.encode_tiled  # the driver call; CPU tests of the bookkeeping substitute a fake
        # The instance's get is native (csrc/tma_core.cpp: fast_get): a hit never enters Python; anything else
        # calls the Python method below with the same arguments.
        self.get = _C.make_fast_get(self._table, functools.partial(TensorMapCache.get, self))

    # ---- lookups ------------------------------------------------------------------------------------------
    def get(self, tensor: torch.Tensor, box, *, swizzle=Swizzle.NONE, l2_promotion=L2Promotion.L2_128B,
            interleave=Interleave.NONE, oob_fill=OOBFill.NONE, elem_strides=None, data_type=None) -> TensorMap:
        """The descriptor for ``tensor`` with ``box`` (torch order, outermost first) and the given encoding.
        A hit costs one native lookup (on instances this method is served natively; this Python body runs for
        misses); a miss encodes and writes a slot on the current stream."""
        kw = dict(swizzle=swizzle, l2_promotion=l2_promotion, interleave=interleave, oob_fill=oob_fill,
                  elem_strides=elem_strides, data_type=data_type)
        spec = TensorMapSpec.from_tensor(tensor, box, **kw)
        self._check_device(tensor)
        key_args = _tensor_key_args(spec, elem_strides is not None, data_type is not None)
        with self._lock:
            hit = self._explained_lookup(spec, self._table.lookup, tensor, *key_args)
            if hit is not None:
                return hit
            tm = self._new_map(spec)
            tm._entry_id = self._table.insert(tensor, *key_args, tm)
        return tm

    def get_spec(self, spec: TensorMapSpec) -> TensorMap:
        """The descriptor for a spec already in driver order (e.g. derived from a CuTe DSL atom)."""
        if not isinstance(spec, TensorMapSpec):
            raise TypeError(f"expected a TensorMapSpec, got {type(spec).__name__}")
        key = spec.key()
        hit = self._explained_lookup(spec, self._table.lookup_spec, key)
        if hit is not None:
            return hit
        with self._lock:
            hit = self._table.lookup_spec(key)
            if hit is not None:
                return hit
            tm = self._new_map(spec)
            tm._entry_id = self._table.insert_spec(key, tm)
        return tm

    def _explained_lookup(self, spec: TensorMapSpec, lookup: Callable, *key):
        """lookup(*key); where the key holds an int outside int64 (csrc/tma_core.cpp: key_int), the validator's
        error for spec, which names the field, instead of the key's."""
        try:
            return lookup(*key)
        except ValueError:
            spec.validate(self._compute_capability())
            raise

    # ---- bound handles ------------------------------------------------------------------------------------
    def bind(self, source, box, *, swizzle=Swizzle.NONE, l2_promotion=L2Promotion.L2_128B,
             interleave=Interleave.NONE, oob_fill=OOBFill.NONE, elem_strides=None, data_type=None) -> BoundTensorMap:
        """A pinned, refreshable descriptor for ``source``: a tensor, a ``(module, attribute name)`` pair, or a
        zero-argument callable returning the current tensor (the first two are checked without entering Python).
        While bound, ``get`` with the same tensor and arguments returns the bound slot."""
        kw = dict(swizzle=swizzle, l2_promotion=l2_promotion, interleave=interleave, oob_fill=oob_fill,
                  elem_strides=elem_strides, data_type=data_type)
        given = (elem_strides is not None, data_type is not None)
        return BoundTensorMap(self, source, lambda t: TensorMapSpec.from_tensor(t, box, **kw), given)

    def bind_spec(self, source, make_spec: Callable[[torch.Tensor], TensorMapSpec]) -> BoundTensorMap:
        """Like ``bind`` for specs built by ``make_spec(tensor)`` (e.g. from a CuTe DSL atom); ``get_spec`` with
        the current spec returns the bound slot."""
        return BoundTensorMap(self, source, make_spec, None)

    def refresh_all(self) -> int:
        """Refresh every bound handle whose source moved (after reloading weights, before replaying graphs).
        Returns how many were rewritten. A handle closed meanwhile is skipped; where a source or make_spec raises,
        the other handles are still refreshed and then the first error is raised (its note counts the failures)."""
        with self._lock:
            handles = list(self._bound)
        rewritten, errors = 0, []
        for handle in handles:
            try:
                rewritten += handle.refresh()
            except StaleTensorMapError:
                continue  # closed since the list was taken (e.g. by another handle's source)
            except Exception as e:  # noqa: BLE001  (raised below, once every handle had its turn)
                errors.append(e)
        if errors:
            errors[0].add_note(f"refresh_all: {len(errors)} of {len(handles)} bound handles failed to refresh; "
                               f"the others were refreshed ({rewritten} rewritten)")
            raise errors[0]
        return rewritten

    def _bind_new(self, handle: BoundTensorMap) -> TensorMap:
        tensor = handle.tensor()
        spec = handle._make_spec(tensor)
        self._check_device(tensor)
        with self._lock:
            tm = self._new_map(spec)
            tm._entry_id = self._table.insert_unkeyed(tm)
            self._table.set_pinned(tm._entry_id, True)
            self._link(handle, tm, tensor)
        return tm

    def _link(self, handle: BoundTensorMap, tm: TensorMap, tensor: torch.Tensor) -> None:
        """Key the bound entry on its current tensor so get()/get_spec() hit it; remember the fingerprint."""
        if handle._key_given is not None:
            displaced = self._table.rekey(tm._entry_id, tensor, *_tensor_key_args(tm.spec, *handle._key_given))
        else:
            displaced = self._table.rekey_spec(tm._entry_id, tm.spec.key())
        if displaced > 0:  # an ordinary entry held the key: its slot retires like an eviction
            self._evicted(displaced)
        self._table.set_fingerprint(tm._entry_id, tensor, tm._ptr)

    def _refresh(self, handle: BoundTensorMap) -> bool:
        tensor = handle.tensor()
        tm = handle.map
        with self._lock:  # reading the source runs Python: it, or another thread, may have closed the handle
            handle._check_open()
            if self._table.matches(tm._entry_id, tensor):
                return False
        self._check_device(tensor)
        spec = handle._make_spec(tensor)
        with self._lock:
            handle._check_open()  # make_spec runs Python too
            self._check_not_capturing(f"refreshing the bound descriptor at {tm._ptr:#x}")
            raw = self._encode(spec)
            self._table.order_after_uses(tm._entry_id)
            self._write(tm._ptr, raw)
            tm.raw, tm.spec = raw, spec
            self._link(handle, tm, tensor)
            self._counts["refreshes"] += 1
        return True

    def _release(self, entry_id: int) -> None:
        with self._lock:
            if self._table.entry_state(entry_id)["captured"]:
                # A CUDA graph may replay the slot: no more hits, and it stays pinned (never reused) for the cache's
                # life, as a captured get() entry does.
                self._table.retire(entry_id)
                self._table.value(entry_id)._evicted = True
                return
            self._table.set_pinned(entry_id, False)
            self._evicted(entry_id, count=False)

    # ---- slots --------------------------------------------------------------------------------------------
    def _new_map(self, spec: TensorMapSpec) -> TensorMap:
        """Validate, encode, take a slot and write it (caller holds the lock)."""
        self._check_not_capturing(f"encoding {spec.describe()}")
        raw = self._encode(spec)
        slot = self._take_slot()
        try:
            self._write(slot, raw)
        except BaseException:
            self._free.append(slot)  # not handed out: back to the free list
            raise
        self._counts["misses"] += 1
        return TensorMap(slot, raw, spec, self.device)

    def _encode(self, spec: TensorMapSpec) -> bytes:
        spec.validate(self._compute_capability())
        try:
            raw = self._encode_tiled(int(spec.data_type), spec.address, spec.dims, spec.strides, spec.box,
                                  spec.elem_strides, int(spec.interleave), int(spec.swizzle),
                                  int(spec.l2_promotion), int(spec.oob_fill), self.device.index or 0)
        except ValueError as e:
            raise ValueError(f"{e} for {spec.describe()}") from None
        self._counts["encodes"] += 1
        if _DEBUG:
            log.warning("torch_tma encoded %s\n%s", spec.describe(), decode(raw).describe())
        return raw

    def _write(self, slot: int, raw: bytes) -> None:
        # Pinned source + non_blocking: the copy runs in stream order, and torch's host allocator keeps the pinned
        # block alive until the copy has run.
        src = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        if self.device.type == "cuda":
            src = src.pin_memory()
        self._slot_views[slot].copy_(src, non_blocking=True)

    def _take_slot(self) -> int:
        self._reclaim()
        if not self._free and self.bytes_reserved + self.chunk_bytes <= self.capacity_bytes:
            self._grow()
        if not self._free and not self._retiring:
            candidates = self._table.lru_candidates()
            if not candidates:
                raise CacheFullError(f"the {self.capacity_bytes} B arena on {self.device} is full of pinned or "
                                     f"graph-captured descriptors; raise capacity_bytes / TORCH_TMA_CACHE_BYTES")
            self._evicted(candidates[0])
            self._reclaim()
        if not self._free:
            # The oldest retired slot may still be read by kernels in flight: wait for its events, never reuse early.
            self._table.wait_retired(self._retiring[0][0])
            self._reclaim()
        return self._free.pop()

    def _evicted(self, entry_id: int, count: bool = True) -> None:
        tm = self._table.value(entry_id)
        self._table.retire(entry_id)
        tm._evicted = True
        self._retiring.append((entry_id, tm._ptr))
        if count:
            self._counts["evictions"] += 1

    def _reclaim(self) -> None:
        still = []
        for entry_id, slot in self._retiring:
            if self._table.retired(entry_id):
                self._table.erase(entry_id)
                self._free.append(slot)
            else:
                still.append((entry_id, slot))
        self._retiring = still

    def _grow(self) -> None:
        # CUDA's caching allocator hands out 512-byte aligned blocks; the CPU allocator (tests) only 64, so the
        # chunk carries one spare slot and starts at the first 128-byte boundary.
        chunk = long_lived_empty(self.chunk_bytes + SLOT_BYTES, torch.uint8, self.device)
        skip = -chunk.data_ptr() % SLOT_BYTES
        self._chunks.append(chunk)
        base = chunk.data_ptr() + skip
        slots = range(base, base + self.chunk_bytes, SLOT_BYTES)
        for offset, slot in zip(range(skip, skip + self.chunk_bytes, SLOT_BYTES), slots):
            self._slot_views[slot] = chunk[offset:offset + SLOT_BYTES]
        self._free.extend(reversed(slots))  # hand out low addresses first

    # ---- checks -------------------------------------------------------------------------------------------
    def _check_device(self, tensor: torch.Tensor) -> None:
        if tensor.device != self.device:
            raise ValueError(f"tensor is on {tensor.device} but this cache holds descriptors for {self.device}: "
                             f"use torch_tma.default_cache({tensor.device}) or a cache for that device")

    def _check_not_capturing(self, what: str) -> None:
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise CaptureMissError(f"{what} while the current stream is capturing a CUDA graph: run the same call "
                                   f"once before capture (warm-up) so the descriptor is resident, then capture")

    def _compute_capability(self):
        if self._capability is None and self.device.type == "cuda":
            self._capability = torch.cuda.get_device_capability(self.device)
        return self._capability

    # ---- introspection ------------------------------------------------------------------------------------
    @property
    def bytes_reserved(self) -> int:
        return len(self._chunks) * self.chunk_bytes

    def stats(self) -> dict:
        """hits, misses, encodes, refreshes, evictions, slots_in_use, bytes_reserved, bound."""
        with self._lock:
            return dict(hits=self._table.hits, **self._counts, slots_in_use=len(self._table),
                        bytes_reserved=self.bytes_reserved, bound=len(self._bound))

    def entries(self) -> list[TensorMap]:
        """Every TensorMap that still owns a slot (retiring ones included)."""
        with self._lock:
            return list(self._table.values())

    def __repr__(self) -> str:
        s = self.stats()
        return (f"TensorMapCache({self.device}, {s['slots_in_use']} slots, {s['bytes_reserved']} of "
                f"{self.capacity_bytes} B reserved, {s['hits']} hits / {s['misses']} misses)")


def long_lived_empty(shape, dtype: torch.dtype, device: torch.device, zero: bool = False) -> torch.Tensor:
    """A device buffer that lives as long as its owner (arena chunks, kernel workspaces), from the default
    memory pool even while this thread's allocations are routed to a CUDA-graph pool (torch.compile's cudagraph
    trees do that during warm-up, then refuse untracked tensors in their pool): allocated, and zeroed, by a
    short-lived thread on the device's default stream, which the current stream then waits for. During a real
    capture it is allocated as usual (the capture owns it)."""
    device = torch.device(device)
    make = torch.zeros if zero else torch.empty
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return make(shape, dtype=dtype, device=device)
    out: list = []

    def allocate():
        try:
            out.append(make(shape, dtype=dtype, device=device))
        except BaseException as e:  # noqa: BLE001  (re-raised in the caller's thread)
            out.append(e)

    worker = threading.Thread(target=allocate, name="torch_tma-alloc")
    worker.start()
    worker.join()
    if isinstance(out[0], BaseException):
        raise out[0]
    torch.cuda.current_stream(device).wait_stream(torch.cuda.default_stream(device))
    return out[0]


def _tensor_key_args(spec: TensorMapSpec, elem_strides_given: bool, data_type_given: bool) -> tuple:
    """The native table's key for a tensor lookup, after the tensor itself: box, elem_strides (None where not
    given), interleave, swizzle, l2_promotion, oob_fill, data_type (-1 where not given). Built from the checked
    spec, so the key holds plain ints in torch order, as the native get (csrc/tma_core.cpp: fast_get) builds it
    from ints; arguments it does not take (NumPy ints, bools) never reach a key."""
    return (spec.box[::-1], spec.elem_strides[::-1] if elem_strides_given else None, int(spec.interleave),
            int(spec.swizzle), int(spec.l2_promotion), int(spec.oob_fill),
            int(spec.data_type) if data_type_given else -1)


def _as_source(source) -> tuple:
    """(object, attribute): (tensor, None), (module, "name"), or (callable, Ellipsis)."""
    if isinstance(source, torch.Tensor):
        return source, None
    if isinstance(source, tuple) and len(source) == 2 and isinstance(source[1], str):
        return source
    if callable(source):
        return source, Ellipsis
    raise TypeError(f"source must be a tensor, a (module, attribute name) pair or a zero-argument callable "
                    f"returning a tensor, got {type(source).__name__}")


_default_caches: dict[torch.device, TensorMapCache] = {}
_default_lock = threading.Lock()


def default_cache(device=None) -> TensorMapCache:
    """The process-wide cache for ``device`` (default: the current CUDA device), shared by the ops and modules."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    cache = _default_caches.get(device)
    if cache is None:
        with _default_lock:
            cache = _default_caches.setdefault(device, TensorMapCache(device))
    return cache
