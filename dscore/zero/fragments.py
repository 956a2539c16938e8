"""Per-parameter access to ZeRO's partitioned training state: fp32 master weights, reduced gradients and
optimizer state of one module parameter, whole (gathered) or this rank's fragment.

DeepSpeed 0.19.8 offers these as ``deepspeed.utils.safe_get_full_fp32_param`` & co.
(``deepspeed/utils/tensor_fragment.py``); RLHF and fine-tuning libraries use them to read or edit a
parameter's master weights or optimizer moments without a checkpoint. dscore's engine records, on every
parameter of the module it trains, which ZeRO stage owns it (:func:`attach`); each accessor asks that
stage for the parameter's :class:`~dscore.protocols.zero.ParamFragment` (the stage protocol's
:meth:`~dscore.protocols.zero.ZeroStage.param_fragment`) and reads or writes through its views.

Semantics (every stage 0-3, with or without ``offload_optimizer: cpu``):

* ``get_full_*`` return a new fp32 tensor of the parameter's full shape (under stage 3 its ``ds_shape``)
  on the parameter's compute device (the accelerator, as DeepSpeed), assembled from every rank's
  fragment with one sum all-reduce over the group the parameter is partitioned over: **collective**
  wherever the parameter is partitioned (stages 1-3): every rank of that group must call them, for the
  same parameters in the same order. Stage 0 holds everything locally and communicates nothing.
* ``get_full_grad`` is the data-parallel averaged gradient (``gradient_allreduce_op: sum``: the sum),
  available from the ``backward`` that ends a gradient accumulation window (stages 2/3: any micro step,
  the window's reduced sum so far) until ``step``/``zero_grad``; under fp16 it still carries the loss scale,
  as DeepSpeed's.
* ``set_full_*`` write this rank's fragment of a full value (no communication; every rank passes the same
  value). ``set_full_fp32_param`` also writes the module's compute-dtype weights on this rank at once, so
  the next forward and the next ``step`` both start from the new value on every rank. DeepSpeed writes
  only the fp32 master and the 16-bit weights follow at the next step (a forward in between runs on the
  old weights); dscore cannot defer it uniformly, because under fp32 without offload its masters *are*
  the module's storage, and a half-applied write (this rank's chunk only) would differ across ranks.
* ``set_local_fp32_param`` writes only this rank's master fragment (and, where the master is the module's
  storage, those elements of it); the module's weights on every rank follow at the next ``step``.
* ``*_local_*`` read or write only this rank's fragment: a 1-D fp32 tensor of
  :attr:`ParamFragment.numel` elements (0 when this rank holds none of the parameter), no communication.
  DeepSpeed defines them for ZeRO-3 only (an assertion elsewhere); dscore answers at every stage (stage 0:
  the whole parameter, flattened).
* A frozen parameter has no master or optimizer state: the getters return None (as DeepSpeed), the
  setters raise :class:`~dscore.errors.FragmentAccessError` (DeepSpeed silently ignores them).

Errors (:class:`dscore.errors.FragmentAccessError`, a ``ValueError``) name the parameter and what would be
valid: a tensor no engine trains, a stage that does not provide :meth:`ZeroStage.param_fragment`, no reduced
gradient now, an optimizer state key the optimizer does not hold (any key before the first step), a value
with the wrong number of elements, and masters kept in NVMe swap files (``offload_optimizer: nvme``).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from dscore.errors import FragmentAccessError

if TYPE_CHECKING:
    from dscore.protocols.zero import ParamFragment, ZeroStage

__all__ = [
    "attach",
    "get_full_fp32_param",
    "get_full_grad",
    "get_full_optimizer_state",
    "get_local_fp32_param",
    "get_local_grad",
    "get_local_optimizer_state",
    "param_fragment",
    "set_full_fp32_param",
    "set_full_grad",
    "set_full_optimizer_state",
    "set_local_fp32_param",
    "set_local_grad",
    "set_local_optimizer_state",
    "stage_of",
    "update_full_grad_vectorized",
]

#: the attribute the engine sets on each parameter it trains: a weak reference to its ZeRO stage
STAGE_ATTR = "_dscore_zero_stage"


def attach(stage: ZeroStage, params: Iterable[torch.nn.Parameter]) -> None:
    """Record ``stage`` as the owner of ``params`` (the engine calls this once the stage is built).

    A weak reference, so a parameter does not keep a closed engine alive; a later engine over the same
    module takes the parameters over.
    """
    ref = weakref.ref(stage)
    for p in params:
        setattr(p, STAGE_ATTR, ref)


def stage_of(param: torch.Tensor) -> ZeroStage:
    """The ZeRO stage that trains ``param``.

    Raises:
        FragmentAccessError: ``param`` is not a tensor, or no live engine trains it.
    """
    if not isinstance(param, torch.Tensor):
        raise FragmentAccessError(f"expected a module parameter (torch.nn.Parameter), got {type(param).__name__}")
    ref = getattr(param, STAGE_ATTR, None)
    stage = ref() if ref is not None else None
    if stage is None:
        raise FragmentAccessError(
            f"tensor of shape {tuple(param.shape)} is not a parameter of a live dscore engine's module: pass a "
            "parameter of engine.module (the per-parameter ZeRO accessors find the engine through it)"
        )
    return stage


def param_fragment(param: torch.Tensor) -> ParamFragment | None:
    """``param``'s :class:`~dscore.protocols.zero.ParamFragment` from its stage (None: a frozen parameter).

    Raises:
        FragmentAccessError: as :func:`stage_of`, or the stage does not provide per-parameter access.
    """
    return stage_of(param).param_fragment(param)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- internals
def _assemble(frag: ParamFragment, local: torch.Tensor) -> torch.Tensor:
    """Full fp32 tensor of ``frag.shape`` on ``frag.device`` from every rank's ``local`` (collective)."""
    full = torch.zeros(math.prod(frag.shape), dtype=torch.float32, device=frag.device)
    if frag.numel:
        full[frag.start : frag.start + frag.numel].copy_(local.reshape(-1))
    if frag.comm is not None and frag.comm.world_size > 1:
        frag.comm.all_reduce(full, op="sum")  # fragments are disjoint: a sum with zeros is exact
    return full.view(frag.shape)


def _local(frag: ParamFragment, values: torch.Tensor) -> torch.Tensor:
    return values.detach().to(device=frag.device, dtype=torch.float32).reshape(-1).clone()


def _own_part(frag: ParamFragment, value: torch.Tensor, what: str) -> torch.Tensor:
    """This rank's fragment of the full ``value`` (checked to have the parameter's element count)."""
    if not isinstance(value, torch.Tensor):
        raise FragmentAccessError(f"{what} of parameter {frag.name!r}: the value must be a torch.Tensor, got "
                                  f"{type(value).__name__}")
    full = math.prod(frag.shape)
    if value.numel() != full:
        raise FragmentAccessError(
            f"{what} of parameter {frag.name!r}: value has {value.numel()} elements (shape {tuple(value.shape)}), the "
            f"parameter has {full} (shape {tuple(frag.shape)})"
        )
    return value.detach().reshape(-1)[frag.start : frag.start + frag.numel]


def _check_local(frag: ParamFragment, value: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.numel() != frag.numel:
        got = f"{value.numel()} elements" if isinstance(value, torch.Tensor) else type(value).__name__
        raise FragmentAccessError(
            f"{what} of parameter {frag.name!r}: this rank holds {frag.numel} of its elements "
            f"(elements {frag.start}..{frag.start + frag.numel} of the flattened parameter), the value has {got}"
        )
    return value.detach().reshape(-1)


def _trainable(param: torch.Tensor, what: str) -> ParamFragment:
    frag = param_fragment(param)
    if frag is None:
        raise FragmentAccessError(
            f"{what}: the parameter (shape {tuple(param.shape)}) is frozen (requires_grad=False), so the ZeRO stage "
            "keeps no fp32 master, gradient or optimizer state for it; set it on the module parameter itself"
        )
    return frag


def _grad(frag: ParamFragment, what: str) -> torch.Tensor:
    if frag.grad is None:
        raise FragmentAccessError(
            f"{what} of parameter {frag.name!r}: no reduced gradient is held now; gradients are available after "
            "engine.backward() of the micro step that ends a gradient accumulation window and before "
            "engine.step() (or zero_grad())"
        )
    return frag.grad


def _state(frag: ParamFragment, key: str, what: str) -> torch.Tensor:
    """The 1-D view of this rank's fragment of optimizer state ``key``."""
    state = _optimizer_state_of(frag)
    value = state.get(key) if state is not None else None
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or frag.state_offset + frag.numel > value.numel():
        keys = sorted(k for k, v in (state or {}).items() if isinstance(v, torch.Tensor) and v.dim() > 0)
        why = ("the optimizer holds no state for it yet (optimizer state is created by the first step)"
               if not keys else f"valid keys: {keys}")
        if frag.optimizer is None:
            why = "the engine has no optimizer"
        raise FragmentAccessError(f"{what} of parameter {frag.name!r}: no optimizer state {key!r}; {why}")
    return value.view(-1)[frag.state_offset : frag.state_offset + frag.numel]


def _optimizer_state_of(frag: ParamFragment) -> dict[str, object] | None:
    if frag.optimizer is None or frag.optimizer_param is None:
        return None
    return frag.optimizer.state.get(frag.optimizer_param)  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------------------------- full values
def get_full_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The full fp32 master weights of ``param`` (collective over its partition group, see module doc).

    Returns:
        fp32 tensor of the parameter's full shape on its compute device, or None for a frozen parameter.

    Raises:
        FragmentAccessError: as :func:`param_fragment`.
    """
    frag = param_fragment(param)
    return None if frag is None else _assemble(frag, frag.master.detach())


def get_full_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The full reduced (data-parallel averaged) gradient of ``param`` (collective, see module doc).

    Returns:
        fp32 tensor of the parameter's full shape on its compute device, or None for a frozen parameter.

    Raises:
        FragmentAccessError: no reduced gradient is held now (before the boundary's backward, after step).
    """
    frag = param_fragment(param)
    if frag is None:
        return None
    grad = _grad(frag, "get_full_grad").detach().to(device=frag.device, dtype=torch.float32)
    if frag.grad_divisor != 1.0:
        grad = grad / frag.grad_divisor
    return _assemble(frag, grad)


def get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """The full fp32 optimizer state ``optim_state_key`` (``"exp_avg"``, ``"exp_avg_sq"`` for Adam) of
    ``param`` (collective, see module doc).

    Returns:
        fp32 tensor of the parameter's full shape on its compute device, or None for a frozen parameter.

    Raises:
        FragmentAccessError: the optimizer holds no such state (names the keys it holds).
    """
    frag = param_fragment(param)
    return None if frag is None else _assemble(frag, _state(frag, optim_state_key, "get_full_optimizer_state"))


@torch.no_grad()
def set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Write ``value`` into ``param``'s fp32 master weights (this rank's fragment) and into the module's
    compute-dtype weights on this rank (no communication: every rank passes the same value).

    Args:
        value: any shape with the parameter's element count, any dtype/device.

    Raises:
        FragmentAccessError: a frozen parameter, or ``value`` has the wrong number of elements.
    """
    frag = _trainable(param, "set_full_fp32_param")
    frag.master.copy_(_own_part(frag, value, "set_full_fp32_param"))
    frag.write_weights(value.detach().to(device=frag.device, dtype=torch.float32).reshape(frag.shape))


@torch.no_grad()
def set_full_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Write this rank's fragment of the full ``value`` into optimizer state ``optim_state_key`` of ``param``.

    Raises:
        FragmentAccessError: a frozen parameter, no such state, or the wrong number of elements.
    """
    frag = _trainable(param, "set_full_optimizer_state")
    _state(frag, optim_state_key, "set_full_optimizer_state").copy_(_own_part(frag, value, "set_full_optimizer_state"))


@torch.no_grad()
def set_full_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Replace ``param``'s reduced gradient by the full averaged gradient ``value`` (this rank's fragment;
    the next step uses it). Valid when :func:`get_full_grad` is.

    Raises:
        FragmentAccessError: a frozen parameter, no reduced gradient now, or the wrong number of elements.
    """
    frag = _trainable(param, "set_full_grad")
    grad = _grad(frag, "set_full_grad")
    grad.copy_(_own_part(frag, value, "set_full_grad").to(device=grad.device, dtype=torch.float32) * frag.grad_divisor)


def update_full_grad_vectorized(
    params: Iterable[torch.nn.Parameter], update_func: Callable[[torch.Tensor, torch.nn.Parameter], torch.Tensor]
) -> None:
    """``set_full_grad(p, update_func(get_full_grad(p), p))`` for every trainable ``p`` of ``params``
    (collective, in the given order; frozen parameters are skipped, as DeepSpeed's)."""
    for p in params:
        grad = get_full_grad(p)
        if grad is not None:
            set_full_grad(p, update_func(grad, p))


# ---------------------------------------------------------------------------------------------- this rank's
def get_local_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    """A copy of this rank's fragment of ``param``'s fp32 master weights (1-D, :attr:`ParamFragment.numel`
    elements, on the compute device), or None for a frozen parameter. No communication."""
    frag = param_fragment(param)
    return None if frag is None else _local(frag, frag.master)


def get_local_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """This rank's fragment of the averaged gradient (1-D fp32, on the compute device), or None for a frozen
    parameter. No communication.

    Raises:
        FragmentAccessError: no reduced gradient is held now.
    """
    frag = param_fragment(param)
    if frag is None:
        return None
    grad = _local(frag, _grad(frag, "get_local_grad"))
    return grad / frag.grad_divisor if frag.grad_divisor != 1.0 else grad


def get_local_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """A copy of this rank's fragment of optimizer state ``optim_state_key`` (1-D fp32), or None for a frozen
    parameter. No communication.

    Raises:
        FragmentAccessError: the optimizer holds no such state.
    """
    frag = param_fragment(param)
    return None if frag is None else _local(frag, _state(frag, optim_state_key, "get_local_optimizer_state"))


@torch.no_grad()
def set_local_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Write this rank's fragment of ``param``'s fp32 master weights (``value``: ``numel`` elements).

    Raises:
        FragmentAccessError: a frozen parameter, or ``value`` does not have this rank's element count.
    """
    frag = _trainable(param, "set_local_fp32_param")
    frag.master.copy_(_check_local(frag, value, "set_local_fp32_param"))


@torch.no_grad()
def set_local_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Write this rank's fragment of optimizer state ``optim_state_key`` of ``param``.

    Raises:
        FragmentAccessError: a frozen parameter, no such state, or the wrong element count.
    """
    frag = _trainable(param, "set_local_optimizer_state")
    _state(frag, optim_state_key, "set_local_optimizer_state").copy_(
        _check_local(frag, value, "set_local_optimizer_state"))


@torch.no_grad()
def set_local_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Replace this rank's fragment of ``param``'s averaged gradient.

    Raises:
        FragmentAccessError: a frozen parameter, no reduced gradient now, or the wrong element count.
    """
    frag = _trainable(param, "set_local_grad")
    grad = _grad(frag, "set_local_grad")
    grad.copy_(_check_local(frag, value, "set_local_grad").to(device=grad.device, dtype=torch.float32)
               * frag.grad_divisor)
