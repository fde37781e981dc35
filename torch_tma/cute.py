"""CuTe DSL glue: any L2 promotion for a ``cpasync.make_tiled_tma_atom`` load.

``make_tiled_tma_atom`` always encodes 128B L2 promotion and has no parameter for it (NVIDIA/cutlass
#3672). This module gives a DSL kernel the same descriptor with the promotion it asks for, from
torch_tma's cache, without matching box, swizzle or mode order by hand (docs/cute.md):

host side
    ``atom_tensor_map(op, tensor, smem_layout, cta_tiler, num_multicast, l2_promotion=...)`` takes what
    ``make_tiled_tma_atom`` takes and returns the cached ``TensorMap`` whose data type, mode order, dims,
    byte strides, box, element strides and swizzle equal what the atom encodes for that tensor.
    ``bind_atom_tensor_map(...)``: the same for a tensor that is replaced over time (a weight); the slot keeps
    its address and is re-encoded in place. ``plan_atom`` exposes the per-configuration plan behind both,
    ``atom_descriptor`` the atom's own bytes (for checking a match).
kernel side
    ``tma_desc_ptr(address)`` turns the slot address (an ``Int64`` kernel argument) into the pointer that
    ``cute.copy(atom, src, dst, tma_bar_ptr=..., tma_desc_ptr=...)`` takes, after the acquire fence.

How the match is made: CuTe DSL encodes an atom's descriptor in host code. For each static configuration
a host-only ``@cute.jit`` function is compiled once that builds the atom exactly as the kernel does and
copies the atom's own descriptor (``cpasync.copy_tensormap``) into host memory: no GPU is involved, so
this also works on a CPU-only machine. The fields that do not depend on the tensor's runtime values
(box, element strides, swizzle, data type) are read from those bytes; the mode order is read from the
atom's type (``tma_gbasis``: which tensor modes become which TMA dims), and each tensor's dims and
strides follow from it with CuTe's rule. The first tensor's derivation is checked against the atom's
bytes, field by field; a mismatch raises instead of returning a wrong map.

Supported: tiled TMA loads (``CopyBulkTensorTileG2SOp``, ``CopyBulkTensorTileG2SMulticastOp``) of torch
tensors whose element width equals the TMA format's, with nvidia-cutlass-dsl 4.8.x. TMA stores and
reductions are refused: the promotion sets how much of a DRAM line L2 fetches on a read miss, a store
has no such read to promote and we have no measurement of one, so a store keeps the atom's own
descriptor. im2col, gather4/scatter4 and 2-CTA (sm_100) ops are refused by name.
"""
from __future__ import annotations

import functools
import importlib.metadata
import math
import re
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

SUPPORTED_DSL = "nvidia-cutlass-dsl >=4.8.0,<4.9"


def _check_dsl_version() -> None:
    try:
        version = importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(f"torch_tma.cute needs CuTe DSL ({SUPPORTED_DSL}); it is not installed") from None
    major_minor = tuple(int(p) for p in re.findall(r"\d+", version)[:2])
    if major_minor != (4, 8):
        raise ImportError(f"torch_tma.cute supports {SUPPORTED_DSL}, found {version}: the descriptor match "
                          f"reads the atom's type and host encoding, which are only verified on 4.8.x")


_check_dsl_version()

import cutlass.cute as cute  # noqa: E402  (after the version check, so a wrong DSL fails with its message)
import cutlass._mlir.dialects.cute as _cute_ir  # noqa: E402
import cutlass._mlir.dialects.cute_nvgpu as _cute_nvgpu_ir  # noqa: E402
from cutlass import Int64  # noqa: E402
from cutlass._mlir import ir  # noqa: E402
from cutlass._mlir.dialects import llvm  # noqa: E402
from cutlass.cute.nvgpu import cpasync  # noqa: E402
from cutlass.cute.nvgpu.cpasync import copy as _tma_ops  # noqa: E402  (the ops cpasync does not re-export)
from cutlass.cute.nvgpu.tcgen05.mma import CtaGroup  # noqa: E402
from cutlass.cute.runtime import from_dlpack, make_fake_tensor  # noqa: E402
from cutlass.cutlass_dsl import dsl_user_op  # noqa: E402

from .cache import BoundTensorMap, TensorMap, TensorMapCache, default_cache  # noqa: E402
from .layout import DESCRIPTOR_BYTES, decode  # noqa: E402
from .spec import ELEMENT_BYTES, DataType, Interleave, L2Promotion, OOBFill, Swizzle, TensorMapSpec, _enum  # noqa: E402

__all__ = ["SUPPORTED_DSL", "tma_desc_ptr", "prefetch_tma_desc", "l2_evict_first_policy", "l2_evict_last_policy",
           "AtomPlan", "plan_atom", "atom_tensor_map", "bind_atom_tensor_map", "atom_descriptor"]

# The TMA unit requires descriptor addresses aligned to 64 bytes; torch_tma's slots are at least that.
DESCRIPTOR_ALIGN = 64
# Tensors of more dims are refused: the DSL folds a rank-6 tensor's modes into 5 TMA dims whether or not they are
# contiguous, and its box then covers other elements than the tile's (docs/probes/cute_rank6.py shows it).
MAX_TENSOR_RANK = 5
# Scopes of the descriptor acquire fence in tma_desc_ptr: .sys (host-written slots, the guide's rule) or .gpu.
_FENCE_SCOPES = ("sys", "gpu")
# The acquire fence tma_desc_ptr issues on a slot ($0: its address), by scope; prefetch_tma_desc may issue it too.
_ACQUIRE_FENCE = "fence.proxy.tensormap::generic.acquire.{scope} [$0], 128;"


# --------------------------------------------------------------------------------------------------
# kernel side


@dsl_user_op
def tma_desc_ptr(address, *, scope: str = "sys", loc=None, ip=None) -> cute.Pointer:
    """The TMA-descriptor pointer for the torch_tma slot at ``address``, acquired for this thread.

    Use inside ``@cute.kernel`` code: ``address`` is the slot's device address (``TensorMap.ptr``) passed
    as an ``Int64`` kernel argument. Returns the generic-address-space ``tma_descriptor_tiled`` pointer
    that ``cute.copy(..., tma_desc_ptr=)`` needs (the gmem address space fails in the NVVM backend; a
    plain integer is silently ignored by ``cute.copy``).

    It also issues ``fence.proxy.tensormap::generic.acquire.sys [address], 128`` so that this thread's
    TMA copies read the slot's current bytes, not a copy the tensormap proxy cached before the host
    re-encoded the slot (a refresh). Scope ``.sys`` because the host writes the slot (the CUDA
    programming guide's rule for tensor maps modified by the host); docs/cute.md has the reasoning.
    ``scope="gpu"`` issues the ``.gpu`` fence instead: torch_tma writes slots with stream-ordered
    copies that complete before the kernel starts, so the narrower scope is expected to suffice; a
    kernel opts in per compiled configuration once measured (shared/reference/h200-baseline.md
    found the ``.gpu`` fence free).

    Call it once at kernel top level, by all threads, before any elected or predicated branch: the
    pointer computed inside such a branch can compile to an illegal predicated ``R2UR`` on sm_90a
    (NVIDIA/cutlass Hopper grouped GEMM example), and ``cute.copy`` already elects the issuing thread.
    """
    if scope not in _FENCE_SCOPES:
        raise ValueError(f"tma_desc_ptr: scope must be one of {_FENCE_SCOPES}, got {scope!r}")
    address = Int64(address).ir_value(loc=loc, ip=ip)
    aligned = _cute_ir.assume(_cute_ir.ConstrainedIntType.get(DESCRIPTOR_ALIGN, 64), address, loc=loc, ip=ip)
    pointer_type = _cute_ir.PtrType.get(_cute_nvgpu_ir.TmaDescriptorTiledType.get(), cute.AddressSpace.generic,
                                        DESCRIPTOR_ALIGN)
    pointer = _cute_ir.inttoptr(pointer_type, aligned, loc=loc, ip=ip)
    _tensormap_asm(address, _ACQUIRE_FENCE.format(scope=scope), loc, ip)
    return pointer


@dsl_user_op
def prefetch_tma_desc(address, *, acquire: Optional[str] = None, loc=None, ip=None) -> None:
    """Start fetching the torch_tma slot at ``address`` into the TMA unit's descriptor cache (``prefetch.tensormap``).

    For ``@cute.kernel`` code that wants the fetch to overlap its set-up (barriers, pipeline state): issue it early,
    in the thread that later loads through ``tma_desc_ptr(address)``. ``acquire="sys"`` or ``"gpu"`` issues
    ``tma_desc_ptr``'s fence before the prefetch; either way the loads still take their pointer from
    ``tma_desc_ptr``, which fences again, so a prefetch cannot make a load read stale bytes.
    """
    if acquire is not None and acquire not in _FENCE_SCOPES:
        raise ValueError(f"prefetch_tma_desc: acquire must be None or one of {_FENCE_SCOPES}, got {acquire!r}")
    fence = "" if acquire is None else _ACQUIRE_FENCE.format(scope=acquire) + " "
    _tensormap_asm(Int64(address).ir_value(loc=loc, ip=ip), fence + "prefetch.tensormap [$0];", loc, ip)


def _l2_fractional_policy(priority: str, loc, ip) -> Int64:
    """``createpolicy.fractional.L2::<priority>.b64`` with fraction 1.0: an Int64 cache policy for all of a load's
    lines."""
    policy = llvm.inline_asm(ir.IntegerType.get_signless(64), [],
                             f"createpolicy.fractional.L2::{priority}.b64 $0, 1.0;", "=l",
                             has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                             loc=loc, ip=ip)
    return Int64(policy)


@dsl_user_op
def l2_evict_first_policy(*, loc=None, ip=None) -> Int64:
    """An L2 cache policy (``createpolicy.fractional.L2::evict_first``, fraction 1.0) for the ``cache_policy=`` of a
    TMA load in ``@cute.kernel`` code: the lines it brings into L2 are the first ones L2 evicts. For data read once
    (a streamed weight), so that it does not push out what the kernels around it reread."""
    return _l2_fractional_policy("evict_first", loc, ip)


@dsl_user_op
def l2_evict_last_policy(*, loc=None, ip=None) -> Int64:
    """An L2 cache policy (``createpolicy.fractional.L2::evict_last``, fraction 1.0) for the ``cache_policy=`` of a
    TMA load in ``@cute.kernel`` code: the lines it brings into L2 are the last ones L2 evicts. For a small tensor that
    every CTA rereads while something large streams past it."""
    return _l2_fractional_policy("evict_last", loc, ip)


def _tensormap_asm(address, asm: str, loc, ip) -> None:
    """Inline PTX on one 64-bit address operand ($0), with side effects and a memory clobber."""
    llvm.inline_asm(None, [address], asm, "l,~{memory}", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


# --------------------------------------------------------------------------------------------------
# host side: which ops are matched

_REFUSED_OPS = (
    (_tma_ops.CopyBulkTensorIm2ColG2SOp, "im2col loads (CopyBulkTensorIm2ColG2SOp)"),
    (_tma_ops.CopyBulkTensorIm2ColG2SMulticastOp, "im2col loads (CopyBulkTensorIm2ColG2SMulticastOp)"),
    (_tma_ops.CopyBulkTensorIm2ColS2GOp, "im2col stores (CopyBulkTensorIm2ColS2GOp)"),
    (_tma_ops.CopyBulkTensor2DGather4G2SOp, "gather4 loads (CopyBulkTensor2DGather4G2SOp)"),
    (_tma_ops.CopyBulkTensor2DGather4G2SMulticastOp, "gather4 loads (CopyBulkTensor2DGather4G2SMulticastOp)"),
    (_tma_ops.CopyBulkTensor2DScatter4S2GOp, "scatter4 stores (CopyBulkTensor2DScatter4S2GOp)"),
    (_tma_ops.CopyBulkTensorTileS2GOp, "TMA stores (CopyBulkTensorTileS2GOp): L2 promotion widens the DRAM "
                                       "fetch of a read miss; a store keeps the atom's own descriptor"),
    (_tma_ops.CopyReduceBulkTensorTileS2GOp, "TMA reductions (CopyReduceBulkTensorTileS2GOp): like stores, "
                                             "they keep the atom's own descriptor"),
)
_LOAD_OPS = (cpasync.CopyBulkTensorTileG2SOp, cpasync.CopyBulkTensorTileG2SMulticastOp)


def _check_op(op, num_multicast) -> None:
    for op_type, case in _REFUSED_OPS:
        if isinstance(op, op_type):
            raise ValueError(f"torch_tma.cute does not support {case}; supported: tiled TMA loads "
                             f"(CopyBulkTensorTileG2SOp, CopyBulkTensorTileG2SMulticastOp)")
    if not isinstance(op, _LOAD_OPS):
        raise TypeError(f"op must be a tiled TMA load op (cpasync.CopyBulkTensorTileG2SOp or "
                        f"cpasync.CopyBulkTensorTileG2SMulticastOp), got {type(op).__name__}")
    if op.cta_group != CtaGroup.ONE:
        raise ValueError(f"torch_tma.cute does not support 2-CTA loads (cta_group={op.cta_group}): they are "
                         f"sm_100 only and torch_tma targets sm_90a")
    if isinstance(num_multicast, bool) or not isinstance(num_multicast, int) or num_multicast < 1:
        raise ValueError(f"num_multicast must be an int >= 1, got {num_multicast!r}")
    if isinstance(op, cpasync.CopyBulkTensorTileG2SOp) and num_multicast != 1:
        raise ValueError(f"num_multicast={num_multicast} needs CopyBulkTensorTileG2SMulticastOp; "
                         f"CopyBulkTensorTileG2SOp loads without multicast (num_multicast=1)")


# --------------------------------------------------------------------------------------------------
# host side: the plan of one static configuration

# A layout factory: a zero-argument callable that builds the layout inside the DSL trace (CuTe layouts
# exist only while a @cute.jit function is being traced).
LayoutFactory = Callable[[], object]


def _leading_dim(tensor: torch.Tensor) -> int:
    """The tensor's unit-stride dim, as ``from_dlpack(t).mark_layout_dynamic()`` deduces it."""
    unit = [d for d, s in enumerate(tensor.stride()) if s == 1]
    if len(unit) > 1:
        unit = [d for d in unit if tensor.shape[d] > 1]
    if len(unit) != 1:
        raise ValueError(f"tensor with shape {tuple(tensor.shape)} and strides {tensor.stride()} has no single "
                         f"unit-stride dim: a TMA map needs one contiguous dim (its innermost)")
    return unit[0]


def _view_signature(tensor: torch.Tensor, static_layout: bool) -> tuple:
    """What the atom's type depends on in a tensor: its dtype and rank, and either every shape and stride
    (static layout) or which dim has the static unit stride and which (size-1) dims have a stride of 0, which
    ``mark_layout_dynamic`` also keeps static (dynamic layout)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    rank = tensor.dim()
    if not 1 <= rank <= MAX_TENSOR_RANK:
        why = (" (make_tiled_tma_atom folds two of a rank-6 tensor's modes into one TMA dim whose box is then not the "
               "tile, docs/cute.md)" if rank == MAX_TENSOR_RANK + 1 else "")
        raise ValueError(f"tensor rank {rank} is not supported: TMA maps have rank 1..{MAX_TENSOR_RANK}{why}; view "
                         f"the tensor with at least 1 and at most {MAX_TENSOR_RANK} dims")
    strides = tensor.stride()
    for d, (size, stride) in enumerate(zip(tensor.shape, strides) if 0 in strides else ()):
        if stride == 0 and size > 1:
            raise ValueError(f"tensor dim {d} has stride 0 (a broadcast view, e.g. from expand): torch_tma.cute "
                             f"does not plan such views; pass tensor.contiguous()")
    lead = _leading_dim(tensor)  # refuses a tensor without one, whichever the layout
    if static_layout:
        return tensor.dtype, tuple(tensor.shape), strides
    return tensor.dtype, rank, lead, tuple(d for d, stride in enumerate(strides) if stride == 0)


def _fake_view(tensor: torch.Tensor, static_layout: bool):
    """A compile-time stand-in typed like the view the kernel builds: ``from_dlpack(t)`` (static layout)
    or ``from_dlpack(t).mark_layout_dynamic()`` / ``make_fake_compact_tensor`` with ``sym_int`` dims."""
    element_type = from_dlpack(tensor).element_type
    if static_layout:
        shape, stride = tuple(tensor.shape), tensor.stride()
    else:
        lead = _leading_dim(tensor)
        shape = tuple(cute.sym_int() for _ in range(tensor.dim()))
        stride = tuple(1 if d == lead else 0 if s == 0 else cute.sym_int(64) for d, s in enumerate(tensor.stride()))
    return make_fake_tensor(element_type, shape, stride, assumed_align=16)


def _runtime_view(tensor: torch.Tensor, static_layout: bool):
    view = from_dlpack(tensor, assumed_align=16)
    return view if static_layout else view.mark_layout_dynamic()


def _parse_int_tuple(text: str):
    """Parse a CuTe int tuple such as ``(64,(64,2))`` or ``(1@2,(1@1,1@0))`` into nested tuples of str."""
    stack = [[]]
    for token in re.findall(r"\(|\)|[^(),\s]+", text):
        if token == "(":
            stack.append([])
        elif token == ")":
            done = tuple(stack.pop())
            stack[-1].append(done)
        else:
            stack[-1].append(token)
    (result,) = stack[0]
    return result


def _flatten(node):
    return [node] if isinstance(node, str) else [leaf for child in node for leaf in _flatten(child)]


def _gbasis_modes(gbasis: str) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """Split the atom's ``tma_gbasis`` (TMA box shape : tensor-mode basis per TMA dim, innermost first) into
    the box extent of each TMA dim and the tensor modes each TMA dim spans, in CuTe's order."""
    shape_text, stride_text = gbasis.split(":", 1)
    shape, stride = _parse_int_tuple(shape_text), _parse_int_tuple(stride_text)
    if isinstance(shape, str):
        shape, stride = (shape,), (stride,)
    box, modes = [], []
    for extent, basis in zip(shape, stride):
        box.append(math.prod(int(e) for e in _flatten(extent)))
        dims = []
        for element in _flatten(basis):
            scale, *index = element.split("@")
            if scale != "1" or len(index) != 1:
                raise ValueError(f"torch_tma.cute does not support the TMA basis {element!r} in tma_gbasis "
                                 f"{gbasis!r}: only flat tensors with unit-scaled modes are matched")
            dims.append(int(index[0]))
        modes.append(tuple(dims))
    return tuple(box), tuple(modes)


def _split_for_multicast(box: tuple[int, ...], num_multicast: int) -> tuple[int, ...]:
    """CuTe's multicast split: each of the ``num_multicast`` CTAs loads a slice of the box, taken from the
    outermost TMA dim inwards."""
    box = list(box)
    remaining, i = num_multicast, len(box) - 1
    while remaining > 1 and i >= 0:
        box[i], remaining = -(-box[i] // remaining), -(-remaining // box[i])
        i -= 1
    return tuple(box)


def _tma_dims_strides(modes, shape, stride) -> tuple[list[int], list[int]]:
    """Dims and element strides of each TMA dim from the tensor modes it spans. Modes CuTe merged into one
    TMA dim get CuTe's recurrence: the gcd of their strides as the stride, the extent that covers them all."""
    dims, strides = [], []
    for spanned in modes:
        if len(spanned) == 1:
            dims.append(shape[spanned[0]])
            strides.append(stride[spanned[0]])
            continue
        extent, step = 1, 0
        for m in spanned:
            merged = math.gcd(step, stride[m])
            extent = (extent - 1) * (step // merged) + (shape[m] - 1) * (stride[m] // merged) + 1 if merged \
                else shape[m]
            step = merged
        dims.append(extent)
        strides.append(step)
    return dims, strides


def _compile_atom_encoder(op, fake_view, smem_layout: LayoutFactory, cta_tiler, num_multicast, internal_type):
    """Compile a host-only function that builds the atom as a kernel would and copies the atom's own
    descriptor to a host address; also return what the trace saw (the atom's type, the smem layout)."""
    traced = {}

    @cute.jit
    def encode_atom(gmem: cute.Tensor, out_address: Int64):
        layout = smem_layout()
        tiler = cta_tiler() if callable(cta_tiler) else cta_tiler
        atom, _ = cpasync.make_tiled_tma_atom(op, gmem, layout, tiler, num_multicast, internal_type=internal_type)
        traced["atom_type"] = str(atom.type)
        traced["smem_layout"] = str(layout)
        cpasync.copy_tensormap(atom, cute.make_ptr(Int64, out_address, cute.AddressSpace.gmem,
                                                   assumed_align=DESCRIPTOR_ALIGN))

    return cute.compile(encode_atom, fake_view, Int64(0)), traced


def _encode_atom(encoder, tensor: torch.Tensor, static_layout: bool) -> bytes:
    """Run the compiled host function on ``tensor``: the atom's descriptor bytes, zero-padded to 128. The DSL
    only stores the tensor's address, so the tensor may live on the CPU or a GPU."""
    out = torch.zeros(DESCRIPTOR_BYTES // 8, dtype=torch.int64)
    encoder(_runtime_view(tensor, static_layout), Int64(out.data_ptr()))
    return out.numpy().tobytes()


@dataclass(frozen=True, eq=False)
class AtomPlan:
    """What ``make_tiled_tma_atom`` encodes for one static configuration, apart from the tensor's address,
    dims and strides (which ``spec`` derives per tensor).

    tensor_modes  for each TMA dim, innermost first: the tensor dims (torch order, outermost = 0) it spans,
                  in CuTe's order (more than one when CuTe merges modes into one TMA dim)
    box           elements per TMA dim, innermost first, after the multicast split
    elem_strides  traversal step per TMA dim, innermost first
    data_type, swizzle, interleave, oob_fill   as the atom encodes them
    gbasis        the atom's ``tma_gbasis`` as the DSL prints it (box shape : tensor-mode basis)
    smem_layout   the shared-memory layout the atom was built from, as the DSL prints it
    """
    static_layout: bool
    tensor_modes: tuple[tuple[int, ...], ...]
    box: tuple[int, ...]
    elem_strides: tuple[int, ...]
    data_type: DataType
    swizzle: Swizzle
    interleave: Interleave
    oob_fill: OOBFill
    gbasis: str
    smem_layout: str
    signature: tuple = field(repr=False)      # what the atom's type depends on in a tensor (_view_signature)
    encoder: object = field(repr=False)        # the compiled host function that encodes the atom

    def spec(self, tensor: torch.Tensor, l2_promotion: L2Promotion = L2Promotion.L2_128B) -> TensorMapSpec:
        """The descriptor inputs (driver order, innermost first) of this atom for ``tensor``, with
        ``l2_promotion`` in place of the atom's 128B."""
        self._check_fits(tensor)
        return _derive_spec(self, tensor.data_ptr(), tensor.shape, tensor.stride(),
                            _enum(L2Promotion, l2_promotion, "l2_promotion"))

    def atom_descriptor(self, tensor: torch.Tensor) -> bytes:
        """The atom's own descriptor for ``tensor``, as the DSL encodes it on the host: 128 bytes, of which
        the DSL writes the first 64 (the rest stay zero)."""
        self._check_fits(tensor)
        return _encode_atom(self.encoder, tensor, self.static_layout)

    def _check_fits(self, tensor: torch.Tensor) -> None:
        if _view_signature(tensor, self.static_layout) != self.signature:
            raise ValueError(f"tensor (dtype {tensor.dtype}, shape {tuple(tensor.shape)}, strides "
                             f"{tensor.stride()}) does not fit this plan, made for {self.signature}")

    def describe(self) -> str:
        return (f"make_tiled_tma_atom plan: tma_gbasis {self.gbasis} (tensor dims per TMA dim "
                f"{list(self.tensor_modes)}, innermost first), box {list(self.box)}, {self.data_type.name}, "
                f"swizzle {self.swizzle.name}, smem layout {self.smem_layout}, "
                f"{'static' if self.static_layout else 'dynamic'} tensor layout")


# Activations come back at a few recurring addresses (the caching allocator), so recent specs are reused.
@functools.lru_cache(maxsize=1024)
def _derive_spec(plan: AtomPlan, address: int, shape, stride, l2_promotion: L2Promotion) -> TensorMapSpec:
    dims, strides = _tma_dims_strides(plan.tensor_modes, shape, stride)
    if dims[0] > 1 and strides[0] != 1:
        raise ValueError(f"the atom's innermost TMA dim spans tensor dims {plan.tensor_modes[0]}, whose stride is "
                         f"{strides[0]} elements; TMA needs it contiguous (stride 1): check the smem layout's "
                         f"major mode against the tensor's")
    element_bytes = ELEMENT_BYTES[plan.data_type]
    return TensorMapSpec(data_type=plan.data_type, address=address, dims=tuple(dims),
                         strides=tuple(s * element_bytes for s in strides[1:]), box=plan.box,
                         elem_strides=plan.elem_strides, interleave=plan.interleave, swizzle=plan.swizzle,
                         l2_promotion=l2_promotion, oob_fill=plan.oob_fill)


_PLANS: dict[tuple, AtomPlan] = {}


def plan_atom(op, tensor: torch.Tensor, smem_layout: LayoutFactory, cta_tiler, num_multicast: int = 1, *,
              internal_type=None, static_layout: bool = False) -> AtomPlan:
    """The plan of ``cpasync.make_tiled_tma_atom(op, view(tensor), smem_layout(), cta_tiler, num_multicast,
    internal_type=internal_type)``, built once per static configuration and cached.

    smem_layout    zero-argument callable returning the shared-memory layout (with or without the stage
                   mode), run inside the DSL trace; plans are cached on it, so pass the same object each
                   time (a module-level function or a bound method, not a fresh lambda)
    cta_tiler      a tuple of ints, or a zero-argument callable returning a CuTe tiler
    static_layout  False: the kernel's view of the tensor has dynamic shapes and strides except the unit
                   stride (``from_dlpack(t).mark_layout_dynamic()``, or ``make_fake_compact_tensor`` with
                   ``cute.sym_int()`` dims); True: every shape and stride is static (``from_dlpack(t)``).
                   The mode order can differ between the two, so it must be the kernel's.
    """
    signature = _view_signature(tensor, static_layout)
    if type(num_multicast) is not int:  # a bool too: True == 1 would find the plan made for 1
        _check_op(op, num_multicast)
    cta_tiler = _checked_tiler(cta_tiler)
    if not callable(smem_layout):
        raise TypeError(f"smem_layout must be a zero-argument callable that builds the layout inside the "
                        f"DSL trace, got {type(smem_layout).__name__}")
    key = (type(op), getattr(op, "cta_group", None), signature, smem_layout, cta_tiler, num_multicast, internal_type)
    try:
        plan = _PLANS.get(key)
    except TypeError:  # the tiler is checked above: what is left unhashable is the layout factory
        raise TypeError(f"smem_layout must be hashable (plans are cached on it): a module-level function or a bound "
                        f"method, got {type(smem_layout).__name__}") from None
    if plan is None:
        _check_op(op, num_multicast)
        plan = _make_plan(op, tensor, smem_layout, cta_tiler, num_multicast, internal_type, static_layout, signature)
        _PLANS[key] = plan
    return plan


def _checked_tiler(cta_tiler):
    """cta_tiler as the plan key holds it: a callable as it is, a (nested) tuple or list of ints as tuples; anything
    else (a float or bool among the ints too: (64.0, 64) would find the plan made for (64, 64)) is refused."""
    if callable(cta_tiler):
        return cta_tiler

    def as_tuple(node):
        if isinstance(node, (tuple, list)) and node:
            return tuple(as_tuple(child) for child in node)
        if type(node) is int:
            return node
        raise TypeError(f"cta_tiler must be a tuple of ints or a zero-argument callable returning a CuTe tiler, "
                        f"got {type(cta_tiler).__name__} {cta_tiler!r}")

    return as_tuple(cta_tiler)


def _make_plan(op, tensor, smem_layout, cta_tiler, num_multicast, internal_type, static_layout, signature):
    encoder, traced = _compile_atom_encoder(op, _fake_view(tensor, static_layout), smem_layout, cta_tiler,
                                            num_multicast, internal_type)
    gbasis = re.search(r'tma_gbasis = <"([^"]*)">', traced["atom_type"]).group(1)
    gbasis_box, tensor_modes = _gbasis_modes(gbasis)
    atom = decode(_encode_atom(encoder, tensor, static_layout))
    plan = AtomPlan(static_layout=static_layout, tensor_modes=tensor_modes, box=atom.box,
                    elem_strides=atom.elem_strides, data_type=atom.data_type, swizzle=atom.swizzle,
                    interleave=atom.interleave, oob_fill=atom.oob_fill, gbasis=gbasis,
                    smem_layout=traced["smem_layout"], signature=signature, encoder=encoder)
    _check_plan(plan, atom, _split_for_multicast(gbasis_box, num_multicast), tensor)
    return plan


def _check_plan(plan: AtomPlan, atom, gbasis_box, tensor) -> None:
    """Raise if the plan's derivation disagrees with the atom's own bytes for the tensor it was made from."""
    if tensor.element_size() != ELEMENT_BYTES[atom.data_type]:
        raise ValueError(f"the atom moves {atom.data_type.name} ({ELEMENT_BYTES[atom.data_type]}-byte elements) "
                         f"but the tensor has {tensor.element_size()}-byte elements; torch_tma.cute matches "
                         f"atoms whose internal type has the tensor's width")
    ours = plan.spec(tensor)
    ours.validate()  # a tensor TMA cannot map (e.g. rows not 16-byte multiples) is the caller's, not a mismatch
    expected = {"rank": (atom.rank, ours.rank), "box": (atom.box, gbasis_box), "dims": (atom.dims, ours.dims),
                "strides": (atom.strides, ours.strides), "address": (atom.address, ours.address)}
    for name, (theirs, derived) in expected.items():
        if theirs != derived:
            raise RuntimeError(f"torch_tma.cute cannot reproduce this atom: its descriptor has {name}={theirs}, "
                               f"the derivation from tma_gbasis {plan.gbasis} gives {derived}; please report "
                               f"this configuration ({plan.describe()})")


# --------------------------------------------------------------------------------------------------
# host side: the public calls


def atom_tensor_map(op, tensor: torch.Tensor, smem_layout: LayoutFactory, cta_tiler, num_multicast: int = 1, *,
                    l2_promotion: L2Promotion, internal_type=None, static_layout: bool = False,
                    cache: TensorMapCache | None = None) -> TensorMap:
    """The cached descriptor that ``make_tiled_tma_atom(op, view(tensor), smem_layout(), cta_tiler,
    num_multicast)`` would encode, but with ``l2_promotion``.

    Arguments as ``plan_atom``; ``cache`` defaults to ``torch_tma.default_cache(tensor.device)``. Pass the
    returned map's ``.ptr`` to the kernel as an ``Int64`` and load with
    ``cute.copy(atom, src, dst, tma_bar_ptr=..., tma_desc_ptr=tma_desc_ptr(ptr))``, where ``atom`` is the
    kernel's own atom from the same arguments (it supplies the copy shape; our map supplies the descriptor).
    """
    plan = plan_atom(op, tensor, smem_layout, cta_tiler, num_multicast, internal_type=internal_type,
                     static_layout=static_layout)
    cache = cache or default_cache(tensor.device)
    cache._check_device(tensor)
    spec = _derive_spec(plan, tensor.data_ptr(), tensor.shape, tensor.stride(),
                        _enum(L2Promotion, l2_promotion, "l2_promotion"))
    return cache.get_spec(spec)


def atom_descriptor(op, tensor: torch.Tensor, smem_layout: LayoutFactory, cta_tiler, num_multicast: int = 1, *,
                    internal_type=None, static_layout: bool = False) -> bytes:
    """The atom's own descriptor for ``tensor``, encoded on the host by the DSL (no GPU needed): 128 bytes,
    the first 64 written by the DSL. For checking a match: ``torch_tma.decode`` both and compare fields."""
    plan = plan_atom(op, tensor, smem_layout, cta_tiler, num_multicast, internal_type=internal_type,
                     static_layout=static_layout)
    return plan.atom_descriptor(tensor)


def bind_atom_tensor_map(op, source, smem_layout: LayoutFactory, cta_tiler, num_multicast: int = 1, *,
                         l2_promotion: L2Promotion, internal_type=None, static_layout: bool = False,
                         cache: TensorMapCache | None = None) -> BoundTensorMap:
    """Like ``atom_tensor_map`` for a tensor that is replaced over time: ``source`` is a tensor or a
    zero-argument callable returning the current one (e.g. ``lambda: module.weight``). The returned handle's
    ``.ptr`` keeps its address for life; when the source's tensor moved, ``.ptr`` (or ``.refresh()``,
    ``cache.refresh_all()``) re-encodes the slot in place, so a compiled kernel or a captured CUDA graph that
    holds the address reads the new tensor. With ``static_layout=True`` the new tensor must keep the shape and
    strides the kernel was compiled for."""
    tensor = source() if callable(source) else source
    plan = plan_atom(op, tensor, smem_layout, cta_tiler, num_multicast, internal_type=internal_type,
                     static_layout=static_layout)
    promotion = _enum(L2Promotion, l2_promotion, "l2_promotion")
    return (cache or default_cache(tensor.device)).bind_spec(source, lambda current: plan.spec(current, promotion))
