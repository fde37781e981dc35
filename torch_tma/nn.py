"""torch_tma.nn: a drop-in nn.Linear computed by torch.ops.tma.linear, and the functions that swap it in.

    swap_linear_(model)      nn.Linear -> torch_tma.nn.Linear in place, reusing the Parameters
    unswap_linear_(model)    back to nn.Linear
    refresh(model)           rewrite every bound weight descriptor for the current weights, same slots

On a CUDA device each layer binds its weight's descriptor in torch_tma.default_cache(device): a pinned slot
whose address never changes while the layer stays on that device, which the op's cache lookup hits. A CUDA
graph captured through the layer reads the descriptor from that slot, so after the weights move to new
storage, refresh(model) rewrites the slots in place and the same graph reads the new weights.
"""

import weakref
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.utils import parametrize

from . import ops
from .spec import L2Promotion, _enum

__all__ = ["Linear", "swap_linear_", "unswap_linear_", "unservable_reason", "refresh"]


class Linear(nn.Linear):
    """nn.Linear whose forward is torch.ops.tma.linear; same Parameters, state_dict keys and arguments.

    l2_promotion: torch_tma.L2Promotion for the weight descriptor; None takes the kernel's default.
    Device and dtype moves, load_state_dict(assign=True) and `weight.data = ...` are picked up by the next
    eager forward (or by torch_tma.refresh(model), which CUDA graphs need since a replay runs no Python).
    """

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, *, l2_promotion=None):
        super().__init__(in_features, out_features, bias, device, dtype)
        self.l2_promotion = None if l2_promotion is None else int(_enum(L2Promotion, l2_promotion, "l2_promotion"))
        self._weight_map = None  # BoundTensorMap while the kernel serves the weight on its CUDA device
        self._weight_key = None  # (device, dtype, shape, stride, address) of the weight last synced

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, l2_promotion=None) -> "Linear":
        """A torch_tma Linear that shares linear's Parameters (no copy)."""
        return _rebuild(cls, linear, l2_promotion=l2_promotion)

    def to_linear(self) -> nn.Linear:
        """A plain nn.Linear that shares this layer's Parameters (no copy)."""
        return _rebuild(nn.Linear, self)

    def __getstate__(self):
        # A copy (deepcopy, pickle) binds its own descriptor on its first forward; a handle is not copyable.
        # nn.Module's own state leaves out what it cannot pickle (the call .compile() set).
        return {**super().__getstate__(), "_weight_map": None, "_weight_key": None}

    def _replicate_for_data_parallel(self):
        # A replica (DataParallel) shares this layer's __dict__ items: it binds its own device's descriptor, and must
        # not close this layer's.
        replica = super()._replicate_for_data_parallel()
        replica._weight_map, replica._weight_key = None, None
        return replica

    @property
    def weight_map(self):
        """The weight's bound descriptor (a BoundTensorMap: .map.ptr is its slot) or None while unbound."""
        return self._weight_map

    def extra_repr(self) -> str:
        promotion = "kernel default" if self.l2_promotion is None else L2Promotion(self.l2_promotion).name
        bound = "" if self._weight_map is None else f", weight_map=0x{self._weight_map.map.ptr:x}"
        return f"{super().extra_repr()}, l2_promotion={promotion}{bound}"

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002  (nn.Linear's name: layer(input=x) works)
        # Binding is host bookkeeping that dynamo cannot trace; compiled code still finds the descriptor
        # through the op's cache lookup, which hits the bound slot once an eager call or refresh() made it.
        # A torch.func transform's weight is a wrapper without storage: nothing to bind (the op computes such calls
        # with F.linear).
        if not torch.compiler.is_compiling() and not torch._C._functorch.is_functorch_wrapped_tensor(self.weight):
            self.sync_weight_map()
        return torch.ops.tma.linear(input, self.weight, self.bias, l2_promotion=self.l2_promotion)

    def sync_weight_map(self) -> None:
        """Make the bound descriptor encode the current weight: refresh in place after a move to new storage,
        rebind after a device, dtype, shape or stride change, unbind where the kernel cannot serve the weight."""
        w = self.weight
        key = (w.device, w.dtype, w.shape, w.stride(), w.data_ptr())
        if key == self._weight_key:
            return
        servable = w.is_cuda and ops.weight_unsupported_reason(w, self.bias) is None
        if servable and self._weight_map is not None and key[:4] == self._weight_key[:4]:
            self._weight_map.refresh()
        else:
            if self._weight_map is not None:
                self._weight_map.close()  # the slot is reused only after kernels that read it have finished
            self._weight_map = self._bind(w) if servable else None
        self._weight_key = key

    def _bind(self, weight: torch.Tensor):
        # A weak reference: the cache must not keep the layer (and its weight) alive.
        layer = weakref.ref(self)
        return ops.bind_weight_map(lambda: layer().weight, weight, self.l2_promotion)


# Not carried over: torch_tma.nn.Linear's own fields (set by its __init__) and a compiled forward of the old module.
_OWN_FIELDS = frozenset(("l2_promotion", "_weight_map", "_weight_key", "_compiled_call_impl"))


def _rebuild(cls, linear: nn.Linear, *, move_hooks: bool = False, **kwargs) -> nn.Linear:
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"expected an nn.Linear, got {type(linear).__name__}")
    reason = _not_rebuildable_reason(linear)
    if reason is not None:
        raise TypeError(f"cannot rebuild this {type(linear).__name__}: {reason}")
    # Built on the meta device so no weight is allocated or initialised, then handed everything else the layer
    # carries: its Parameters (the same objects), buffers, hooks, training flag and any attribute set on it. The
    # module's dicts and sets are copied, so the two modules do not share later registrations; with move_hooks
    # (a swap, which drops the old module) the hook dicts themselves are handed over, so the handles
    # register_*_hook returned before still remove their hooks.
    with torch.device("meta"):
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, **kwargs)
    # Hooks registered with the module as their first argument (load_state_dict pre-hooks) hold it by a weak
    # reference (torch's _WrappedHook): they are pointed at the new layer, or they would call the dropped one, or fail.
    wrapped = nn.modules.module._WrappedHook
    for name, value in linear.__dict__.items():
        if name in _OWN_FIELDS:
            continue
        hooks = "hooks" in name
        if isinstance(value, (dict, set)) and not (move_hooks and hooks):
            value = value.copy()
        if hooks and isinstance(value, dict):
            for key, hook in list(value.items()):
                if isinstance(hook, wrapped) and hook.with_module and hook.module() is linear:
                    value[key] = wrapped(hook.hook, new)
        new.__dict__[name] = value
    return new


def _not_rebuildable_reason(linear: nn.Linear) -> str | None:
    """What a layer carries that a rebuild (from_linear, to_linear, the swaps) would get wrong, or None."""
    if "forward" in linear.__dict__:
        return ("its forward is set on the instance (e.g. by accelerate's hooks), so the rebuilt layer would "
                "still run the old one: remove that first")
    if parametrize.is_parametrized(linear):
        return "it is parametrized (torch.nn.utils.parametrize): remove the parametrizations first"
    return None


def unservable_reason(linear: nn.Linear) -> str | None:
    """Why the TMA kernel can never serve this layer where it is now, or None.

    Checked without knowing the dtype it will run in: a bf16/fp16 weight row of in_features elements must be a
    multiple of 16 bytes. A layer already on a CUDA device gets the op's full check for a one-row input.
    """
    if type(linear) is not nn.Linear:
        return f"{type(linear).__name__} subclasses nn.Linear; its forward may differ"
    reason = _not_rebuildable_reason(linear)  # a forward set on the instance (a plain Linear is not parametrized)
    if reason is not None:
        return reason
    if not isinstance(linear._parameters.get("weight"), nn.Parameter):
        return "its weight is not a Parameter of the layer (weight_norm / spectral_norm recompute it on every call)"
    if _is_dtensor(linear.weight):
        return "its weight is a DTensor (tensor parallel): tma::linear has no sharding rule"
    if linear.in_features * 2 % 16:
        return f"in_features={linear.in_features}: a 16-bit weight row is not a multiple of 16 bytes (TMA)"
    if linear.weight.is_cuda:
        return ops.weight_unsupported_reason(linear.weight, linear.bias)
    return None


def _is_dtensor(t: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _check_model(model, fn: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"torch_tma.nn.{fn}: model must be an nn.Module, got {type(model).__name__}")


def _replace(module: nn.Module, fqn: str, replacement: Callable[[nn.Module, str], nn.Module], done: dict) -> nn.Module:
    """Depth-first: each module is offered to replacement(module, fqn) once; a shared module stays shared."""
    if id(module) in done:
        return done[id(module)]
    new = replacement(module, fqn)
    if new is module:
        # _modules, not named_children(): that yields a shared child once, leaving its other parents unswapped.
        for name, child in list(module._modules.items()):
            if child is None:
                continue
            new_child = _replace(child, f"{fqn}.{name}" if fqn else name, replacement, done)
            if new_child is not child:
                setattr(module, name, new_child)
    done[id(module)] = new
    return new


def swap_linear_(
    model: nn.Module,
    filter_fn: Callable[[nn.Linear, str], bool] | None = None,
    *,
    l2_promotion=None,
    report: list | None = None,
) -> nn.Module:
    """Replace nn.Linear layers of model by torch_tma.nn.Linear in place, sharing their Parameters.

    filter_fn(module, fqn) -> bool picks the layers among the plain nn.Linear modules; without it a layer is
    swapped when unservable_reason(module) is None. report, if given, is a list that receives (fqn, reason) for
    every nn.Linear (or subclass) left as it is. Returns model, or the new root when model is itself a Linear.
    """
    _check_model(model, "swap_linear_")
    if filter_fn is not None and not callable(filter_fn):
        raise TypeError(
            f"swap_linear_: filter_fn must be callable (module, fqn) -> bool, got {type(filter_fn).__name__}"
        )
    if l2_promotion is not None:
        l2_promotion = _enum(L2Promotion, l2_promotion, "l2_promotion")  # checked before any swap

    def swap(module, fqn):
        if not isinstance(module, nn.Linear) or isinstance(module, Linear):
            return module
        if filter_fn is None or type(module) is not nn.Linear:
            reason = unservable_reason(module)
        else:
            reason = _not_rebuildable_reason(module) or (None if filter_fn(module, fqn) else "filter_fn returned False")
        if reason is None:
            return _rebuild(Linear, module, move_hooks=True, l2_promotion=l2_promotion)
        if report is not None:
            report.append((fqn, reason))
        return module

    return _replace(model, "", swap, {})


def unswap_linear_(model: nn.Module) -> nn.Module:
    """Replace every torch_tma.nn.Linear of model by an nn.Linear sharing its Parameters; returns the root."""
    _check_model(model, "unswap_linear_")
    for fqn, module in model.named_modules(remove_duplicate=False):  # checked before anything is unswapped
        if isinstance(module, Linear) and type(module) is not Linear:
            raise TypeError(f"unswap_linear_: {fqn or 'the model'} is a {type(module).__name__}, a subclass of "
                            f"torch_tma.nn.Linear (parametrized after the swap?): undo that first")
        if isinstance(module, Linear) and (reason := _not_rebuildable_reason(module)) is not None:
            raise TypeError(f"unswap_linear_: {fqn or 'the model'}: {reason}")
    unswap = lambda m, fqn: _rebuild(nn.Linear, m, move_hooks=True) if isinstance(m, Linear) else m  # noqa: E731
    return _replace(model, "", unswap, {})


def refresh(model: nn.Module) -> None:
    """Re-encode the weight descriptor of every torch_tma.nn.Linear in model for its current weight.

    A layer whose weight moved to new storage on the same device keeps its slot: CUDA graphs captured before
    read the new weight on their next replay. A bias, and any parameter outside these descriptors, is baked
    into a graph by address: update those in place (copy_) instead. During graph capture a weight that moved
    raises CaptureMissError (one that did not is left as it is).
    """
    _check_model(model, "refresh")
    for module in model.modules():
        if isinstance(module, Linear):
            module.sync_weight_map()
