"""Adam / AdamW as DeepSpeed selects them (``deepspeed-behaviour.md`` §4).

``adam_w_mode`` (default **true**) chooses decoupled weight decay (AdamW, Loshchilov & Hutter,
arXiv:1711.05101) over L2-in-the-gradient Adam (Kingma & Ba, arXiv:1412.6980), so ``"type": "Adam"`` is
AdamW-style unless ``"adam_w_mode": false``; type ``adamw`` forces it true. ``torch_adam: true`` yields
``torch.optim.AdamW``/``Adam`` with the for-each implementation. Otherwise DeepSpeed uses its FusedAdam
kernel; dscore uses torch's ``fused=True`` implementation where the parameters' device supports it,
else for-each. Both follow the same update rule as FusedAdam.

Under ZeRO optimizer offload DeepSpeed replaces Adam with its CPU Adam op; dscore does the same through
the specs' ``offload_factory`` (:func:`build_adam_offload`): ``DscoreCPUAdam`` from the ``cpu_adam`` op
(JIT-built with ninja on first use), or torch's CPU implementation with a warning when the op cannot be
built here (no compiler), or when ``torch_adam: true`` asks for torch's.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from dscore.errors import ConfigError, OpBuildError

if TYPE_CHECKING:
    import torch

    from dscore.protocols import OptimizerContext
    from dscore_plugins.optim.config import AdamParams, AdamWParams

__all__ = ["build_adam", "build_adam_offload", "build_adamw", "build_adamw_offload"]

log = logging.getLogger("dscore.optim")

#: keys of ``optimizer.params`` that are torch.optim.Adam/AdamW constructor arguments
_TORCH_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad")


def _torch_adam(
    param_groups: list[dict[str, Any]], p: AdamParams, *, adam_w_mode: bool, path: str
) -> torch.optim.Optimizer:
    """``torch.optim.AdamW`` (``adam_w_mode``) or ``torch.optim.Adam`` with the validated params ``p``.

    With ``torch_adam`` only the keys written in the config reach torch, so the rest take torch's own
    defaults (``weight_decay`` 0.01 for AdamW), exactly as DeepSpeed 0.19.8; otherwise every value comes
    from the params model (FusedAdam's defaults, ``weight_decay`` 0.0), fused where the device allows.

    Raises:
        ConfigError: ``bias_correction`` false (torch's implementation always bias-corrects).
    """
    import torch

    if not p.bias_correction:
        raise ConfigError(
            f"{path}.bias_correction=false is not supported by dscore's Adam (torch's implementation always "
            "bias-corrects); remove the key or set it to true",
            path=f"{path}.bias_correction",
        )
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    groups = [dict(g) for g in param_groups]
    if p.torch_adam:
        given = {k: getattr(p, k) for k in _TORCH_KEYS if k in p.model_fields_set}
        if p.fused:
            return cls(groups, fused=True, foreach=p.foreach, **given)
        return cls(groups, foreach=True if p.foreach is None else p.foreach, fused=p.fused, **given)
    kwargs: dict[str, Any] = {k: getattr(p, k) for k in _TORCH_KEYS}
    try:
        return cls(groups, fused=True, **kwargs)
    except (RuntimeError, ValueError) as exc:  # device/dtype without a fused kernel
        log.debug("fused %s unavailable (%s); using for-each", cls.__name__, exc)
        return cls(groups, foreach=True, **kwargs)


def build_adam(param_groups: list[dict[str, Any]], ctx: OptimizerContext[AdamParams]) -> torch.optim.Optimizer:
    """Build DeepSpeed's ``"Adam"``: ``torch.optim.AdamW`` when ``adam_w_mode`` else ``torch.optim.Adam``.

    Args:
        param_groups: torch-style param groups (``params`` plus per-group overrides).
        ctx: ``ctx.section`` is the validated :class:`~dscore_plugins.optim.config.AdamParams` (torch names
            and units; ``adam_w_mode`` default true, as DeepSpeed).

    Returns:
        a ``torch.optim.Adam`` or ``torch.optim.AdamW``.

    Raises:
        ConfigError: ``bias_correction`` false (not available on torch's implementation).
    """
    return _torch_adam(param_groups, ctx.section, adam_w_mode=ctx.section.adam_w_mode, path=ctx.path)


def _forced_w_mode(p: AdamParams) -> None:
    if not p.adam_w_mode:
        log.warning("optimizer.type AdamW forces adam_w_mode=true (as DeepSpeed); ignoring adam_w_mode=false")


def build_adamw(param_groups: list[dict[str, Any]], ctx: OptimizerContext[AdamWParams]) -> torch.optim.Optimizer:
    """Build DeepSpeed's ``"AdamW"``: :func:`build_adam` with ``adam_w_mode`` forced true."""
    _forced_w_mode(ctx.section)
    return _torch_adam(param_groups, ctx.section, adam_w_mode=True, path=ctx.path)


def _offload_adam(
    param_groups: list[dict[str, Any]], p: AdamParams, *, adam_w_mode: bool, path: str
) -> torch.optim.Optimizer:
    if p.torch_adam:
        return _torch_adam(param_groups, p, adam_w_mode=adam_w_mode, path=path)
    try:
        from dscore_plugins.ops.cpu_optim import DscoreCPUAdam

        return DscoreCPUAdam(
            [dict(g) for g in param_groups], lr=p.lr, betas=p.betas, eps=p.eps, weight_decay=p.weight_decay,
            amsgrad=p.amsgrad, adamw_mode=adam_w_mode, bias_correction=p.bias_correction,
        )
    except OpBuildError as exc:
        log.warning("cpu_adam op unavailable (%s); the offloaded Adam runs on torch's CPU implementation", exc)
        return _torch_adam(param_groups, p, adam_w_mode=adam_w_mode, path=path)


def build_adam_offload(
    param_groups: list[dict[str, Any]], ctx: OptimizerContext[AdamParams]
) -> torch.optim.Optimizer:
    """``"Adam"`` under ZeRO optimizer offload: the ``cpu_adam`` op's ``DscoreCPUAdam`` (DeepSpeed's
    DeepSpeedCPUAdam swap), falling back to :func:`build_adam` with a warning when the op cannot be built.

    Args: as :func:`build_adam`; the parameters are fp32 CPU tensors (the offloaded partitions).

    Raises:
        ConfigError: ``amsgrad`` with the CPU op (as DeepSpeed's CPU Adam), or bad hyper-parameters.
    """
    return _offload_adam(param_groups, ctx.section, adam_w_mode=ctx.section.adam_w_mode, path=ctx.path)


def build_adamw_offload(
    param_groups: list[dict[str, Any]], ctx: OptimizerContext[AdamWParams]
) -> torch.optim.Optimizer:
    """``"AdamW"`` under ZeRO optimizer offload: :func:`build_adam_offload` with ``adam_w_mode`` forced true."""
    _forced_w_mode(ctx.section)
    return _offload_adam(param_groups, ctx.section, adam_w_mode=True, path=ctx.path)
