"""Released ZeRO-3 parameters refuse torch calls that would read or write their (absent) values.

A partitioned parameter outside a gather keeps its full shape over 0 bytes of storage (the storage model
of :mod:`dscore.zero.partition`: autograd graphs that saved it stay valid), so a plain torch call on it
(``p.sum()``, ``p.clone()``, ``p.fill_(0)``, ``print(p)``, ``F.linear(x, p)``) would read or write memory
nobody owns and kill the process with SIGSEGV. DeepSpeed instead swaps ``param.data`` for a 0-element
tensor, so the same calls return silently wrong results (``p.sum() == 0``).

dscore's rule: while a unit is released its parameters' Python class is a subclass of their own class
(:class:`~torch.nn.Parameter` -> ``ReleasedParameter``) whose ``__torch_function__`` lets through the calls
that read only metadata (shape, dtype, device, ``requires_grad``, ``grad``, hooks, storage pointers, a
no-op ``.to``) and raises :class:`dscore.errors.PartitionedParameterError` naming the parameter, the call
and ``dscore.zero.GatheredParameters`` for everything else. ``detach()`` (what ``module.state_dict()`` calls;
transformers' ``from_pretrained`` reads its keys inside ``zero.Init``) returns a ``ReleasedAlias``: same
metadata and ``ds_*`` attributes, the same refusal of any data use (saving included). Gathering the unit swaps the class back, so
the hot path (forward and backward run on gathered parameters) sees ordinary parameters and pays
nothing per torch call; the cost is one ``__class__`` assignment per parameter per gather and release.

Why an error and not a gather on touch (what ``dscore.zero.Init`` does while modules are built): a gather
is a collective. Construction code runs on every rank, but code after the build may not (``if rank == 0:
print(p.sum())``), and a gather started on one rank only would hang every rank; a silent all-gather per
touch would also hide a full-parameter memory and communication cost. ``GatheredParameters`` makes both
explicit.

Only parameters whose class keeps torch's disabled ``__torch_function__`` (``torch.nn.Parameter`` and its
subclasses that do not override it) are guarded; other tensor subclasses keep their own dispatch.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ReleasedParameter", "mark_released", "mark_available", "name_parameters", "parameter_name"]

_NAME_ATTR = "_dscore_name"
_UNIT_ATTR = "_dscore_unit"  # :mod:`dscore.zero.partition`'s back-reference (not imported: no cycle)

# property getters that return data (an alias of the released storage or its values)
_DATA_GETTERS = frozenset({"data", "T", "mT", "H", "mH", "real", "imag"})
# property setters that write values (setting ``.data``/``.grad`` rebinds, which reads nothing)
_DATA_SETTERS = frozenset({"real", "imag"})
# methods that read only metadata, storage pointers or autograd state
_METADATA_METHODS = frozenset(
    {
        "size", "dim", "ndimension", "numel", "nelement", "element_size", "is_floating_point", "is_complex",
        "is_signed", "requires_grad_", "register_hook", "register_post_accumulate_grad_hook", "retain_grad",
        "__hash__", "__len__", "data_ptr", "untyped_storage", "storage_offset", "stride", "is_contiguous",
        "get_device", "is_pinned", "is_shared", "_is_view", "has_names", "is_set_to", "is_inference",
        "_has_compatible_shallow_copy_type", "__dir__",
        # what dynamo's fake-tensor conversion (torch._subclasses.meta_utils) asks of every graph input
        "is_conj", "is_neg", "_is_zerotensor", "_is_functional_tensor", "_get_creation_meta", "is_coalesced",
        "dense_dim", "sparse_dim",
    }
)


def _disabled(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _call_of(func: Any) -> tuple[str, str]:
    """(kind, name): kind is "get"/"set" for a property, "call" otherwise."""
    name = str(getattr(func, "__name__", ""))
    if name in ("__get__", "__set__"):
        prop = str(getattr(getattr(func, "__self__", None), "__name__", name))
        return ("get" if name == "__get__" else "set"), prop
    return "call", name


def _call_label(func: Any) -> str:
    kind, name = _call_of(func)
    if kind != "call":
        return f"Tensor.{name} ({'read' if kind == 'get' else 'write'})"
    module = str(getattr(func, "__module__", None) or "")
    if module == "torch._C._nn":  # the C entry points behind torch.nn.functional
        module = "torch.nn.functional"
    elif module in ("torch._C._VariableFunctions", "torch._C"):
        module = "torch"
    return f"{module}.{name}" if module.startswith("torch") else f"Tensor.{name}"


def _is_noop_to(func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
    """``p.to(...)``/``p.cpu()`` that returns ``p`` itself (same device and dtype): reads nothing."""
    _, name = _call_of(func)
    if not args or not isinstance(args[0], torch.Tensor):
        return False
    p = args[0]
    if name == "cpu":
        return p.device.type == "cpu" and not kwargs
    if name != "to" or kwargs.get("copy"):
        return False
    kw = {k: v for k, v in kwargs.items() if k != "copy"}
    try:
        device, dtype, _non_blocking, memory_format = torch._C._nn._parse_to(*args[1:], **kw)
    except Exception:  # malformed: let torch refuse it on its own terms below
        return False
    same_device = device is None or torch.device(device) == p.device
    return same_device and (dtype is None or dtype == p.dtype) and memory_format is None


def _released_in(args: Any, kwargs: dict[str, Any]) -> torch.Tensor | None:
    stack: list[Any] = [*args, *kwargs.values()]
    while stack:
        a = stack.pop()
        if type(a) in _original_class:
            return a
        if isinstance(a, (list, tuple)):
            stack.extend(a)
    return None


def parameter_name(p: torch.Tensor) -> str:
    """The name recorded for a partitioned parameter (qualified ``"lin.weight"`` once the module that owns
    it is built or handed to the engine), else its unit's name and shape."""
    name = getattr(p, _NAME_ATTR, None)
    if name:
        return str(name)
    unit = getattr(p, _UNIT_ATTR, None)
    return f"<parameter of unit {getattr(unit, 'name', '?')!r}>"


def _error(func: Any, p: torch.Tensor) -> Exception:
    from dscore.errors import PartitionedParameterError

    name, call = parameter_name(p), _call_label(func)
    unit = getattr(p, _UNIT_ATTR, None)
    held = getattr(p, "partition_numel", None)
    where = (
        f"rank {unit.rank} of {unit.world} holds {held()} of its {p.numel()} elements"
        if unit is not None and callable(held)
        else "only this rank's partition is held"
    )
    return PartitionedParameterError(
        f"{call} on ZeRO-3 partitioned parameter {name!r} (shape {tuple(p.shape)}, {p.dtype}): the parameter is "
        f"released ({where}), so its values are not on this rank. Read it inside "
        "`with dscore.zero.GatheredParameters(param):` or change it inside "
        "`with dscore.zero.GatheredParameters(param, modifier_rank=0):` (every rank of the data-parallel group "
        "must enter; the modifier rank's values are kept). Inside `dscore.zero.Init` and during the engine's "
        "forward/backward the parameter is gathered for you.",
        name=name,
        call=call,
    )


class ReleasedParameter(torch.nn.Parameter):
    """The class a released partitioned :class:`torch.nn.Parameter` wears (module doc); never built
    directly: :func:`mark_released` assigns it, :func:`mark_available` takes it back."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        kind, name = _call_of(func)
        allowed = (
            (kind == "get" and name not in _DATA_GETTERS)
            or (kind == "set" and name not in _DATA_SETTERS)
            or (kind == "call" and name in _METADATA_METHODS)
        )
        if allowed:
            return _disabled(func, args, kwargs)
        if _is_noop_to(func, args, kwargs):
            return args[0]
        if name == "detach" and kind == "call" and type(args[0]) in _original_class:
            return _guarded_alias(args[0])
        p = _released_in(args, kwargs)
        if p is None:  # our class reached here through a non-released argument: cannot happen; be plain
            return _disabled(func, args, kwargs)
        raise _error(func, p)


class ReleasedAlias(torch.Tensor):
    """What ``detach()`` of a released parameter returns (``module.state_dict()`` detaches every
    parameter): an alias with the parameter's metadata and ``ds_*`` attributes that refuses data use
    exactly as the parameter does. It stays guarded after a gather: it aliases the released storage."""

    __torch_function__ = ReleasedParameter.__dict__["__torch_function__"]


def _guarded_alias(p: torch.Tensor) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        alias = torch.Tensor.detach(p)
    alias.__class__ = ReleasedAlias
    for k, v in vars(p).items():  # ds_* attributes, name and unit back-reference
        if k.startswith(("ds_", "_dscore_")):
            setattr(alias, k, v)
    return alias


_released_class: dict[type, type] = {torch.nn.Parameter: ReleasedParameter}
_original_class: dict[type, type] = {ReleasedParameter: torch.nn.Parameter, ReleasedAlias: torch.Tensor}


def _guarded_class(cls: type) -> type | None:
    got = _released_class.get(cls)
    if got is not None or cls in _original_class:
        return got
    if not (issubclass(cls, torch.nn.Parameter) and cls.__torch_function__ is torch.nn.Parameter.__torch_function__):
        return None
    sub = type(f"Released{cls.__name__}", (cls,), {"__torch_function__": ReleasedParameter.__dict__["__torch_function__"]})
    _released_class[cls] = sub
    _original_class[sub] = cls
    return sub


def mark_released(p: torch.Tensor) -> None:
    """Give a parameter whose storage was just released the guarded class (no-op when unguardable)."""
    cls = type(p)
    if cls in _original_class:
        return
    sub = _guarded_class(cls)
    if sub is not None:
        p.__class__ = sub


def mark_available(p: torch.Tensor) -> None:
    """Give a gathered parameter its own class back."""
    orig = _original_class.get(type(p))
    if orig is not None:
        p.__class__ = orig


def name_parameters(module: torch.nn.Module) -> None:
    """Record each partitioned parameter's qualified name in ``module`` (for error messages)."""
    for n, p in module.named_parameters():
        if getattr(p, _UNIT_ATTR, None) is not None:
            setattr(p, _NAME_ATTR, n)
