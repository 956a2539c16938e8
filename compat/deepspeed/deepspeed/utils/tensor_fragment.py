"""``deepspeed.utils.tensor_fragment``: DeepSpeed 0.19.8's per-parameter accessors into ZeRO's partitioned
fp32 weights, gradients and optimizer state, onto :mod:`dscore.zero.fragments`.

``safe_get_full_*`` / ``safe_set_full_*`` / ``safe_*_local_*`` / ``safe_update_full_grad_vectorized`` take a
parameter of ``engine.module`` (dscore's engine records its ZeRO stage on each parameter at
``deepspeed.initialize``). The ``get_full`` forms are collective wherever the parameter is partitioned
(ZeRO 1-3): every data-parallel rank must call them. Where dscore differs from DeepSpeed (documented in
:mod:`dscore.zero.fragments`): values at ZeRO stage 0 under fp32/fp16 too (DeepSpeed: None), the local
forms at every stage (DeepSpeed: ZeRO-3 only), setters on a frozen parameter or a gradient read outside
backward..step raise :class:`dscore.errors.FragmentAccessError` (DeepSpeed ignores the set, and returns
stale zeros at ZeRO-3). DeepSpeed's internal mapping objects (``tensor_fragment``, ``get_hp_fragment_mapping``,
``link_hp_params``, ...) are refused on use: dscore's stages lay partitions out differently.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from deepspeed._not_provided import not_provided

if TYPE_CHECKING:
    import torch

__all__ = [
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "safe_update_full_grad_vectorized",
]


def safe_get_full_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The full fp32 master weights of ``param`` on the accelerator, None when frozen (collective)."""
    from dscore.zero.fragments import get_full_fp32_param

    return get_full_fp32_param(param)


def safe_set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Write ``value`` (the full parameter) into ``param``'s fp32 master weights; applied at the next step."""
    from dscore.zero.fragments import set_full_fp32_param

    set_full_fp32_param(param, value)


def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """The full fp32 optimizer state ``optim_state_key`` of ``param``, None when frozen (collective)."""
    from dscore.zero.fragments import get_full_optimizer_state

    return get_full_optimizer_state(param, optim_state_key)


def safe_set_full_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Write ``value`` (full) into optimizer state ``optim_state_key`` of ``param``."""
    from dscore.zero.fragments import set_full_optimizer_state

    set_full_optimizer_state(param, value, optim_state_key)


def safe_get_full_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The full averaged fp32 gradient of ``param`` between backward and step, None when frozen (collective)."""
    from dscore.zero.fragments import get_full_grad

    return get_full_grad(param)


def safe_set_full_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Replace ``param``'s averaged gradient by the full ``value`` (between backward and step)."""
    from dscore.zero.fragments import set_full_grad

    set_full_grad(param, value)


def safe_get_local_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """This rank's fragment (1-D fp32) of ``param``'s averaged gradient, None when frozen."""
    from dscore.zero.fragments import get_local_grad

    return get_local_grad(param)


def safe_set_local_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Replace this rank's fragment of ``param``'s averaged gradient."""
    from dscore.zero.fragments import set_local_grad

    set_local_grad(param, value)


def safe_get_local_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    """This rank's fragment (1-D fp32) of ``param``'s master weights, None when frozen."""
    from dscore.zero.fragments import get_local_fp32_param

    return get_local_fp32_param(param)


def safe_get_local_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """This rank's fragment (1-D fp32) of optimizer state ``optim_state_key`` of ``param``, None when frozen."""
    from dscore.zero.fragments import get_local_optimizer_state

    return get_local_optimizer_state(param, optim_state_key)


def safe_set_local_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Write this rank's fragment of optimizer state ``optim_state_key`` of ``param``."""
    from dscore.zero.fragments import set_local_optimizer_state

    set_local_optimizer_state(param, value, optim_state_key)


def safe_set_local_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Write this rank's fragment of ``param``'s master weights."""
    from dscore.zero.fragments import set_local_fp32_param

    set_local_fp32_param(param, value)


def safe_update_full_grad_vectorized(
    param_list: Iterable[torch.nn.Parameter], update_func: Callable[[torch.Tensor, torch.nn.Parameter], torch.Tensor]
) -> None:
    """``safe_set_full_grad(p, update_func(safe_get_full_grad(p), p))`` for each trainable ``p`` (collective)."""
    from dscore.zero.fragments import update_full_grad_vectorized

    update_full_grad_vectorized(param_list, update_func)


_INTERNAL_WHY = ("DeepSpeed's internal lp/hp mapping objects are not reproduced (dscore's ZeRO stages lay partitions "
                 "out differently); use deepspeed.utils.safe_get_full_fp32_param & co. or dscore.zero.fragments")
for _name in ("get_full_hp_param", "get_full_hp_grad", "set_full_hp_param", "set_full_hp_grad", "tensor_fragment",
              "fragment_address", "get_hp_fragment_mapping", "map_to_flat_opt_states"):
    globals()[_name] = not_provided(f"deepspeed.utils.tensor_fragment.{_name}", _INTERNAL_WHY)
    __all__.append(_name)
del _name
