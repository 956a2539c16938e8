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
from collections.abc import Iterable
from typing import Any

from dscore.errors import ConfigError

__all__ = ["FUSED_ADAM_WEIGHT_DECAY", "build_adam", "build_adam_offload", "build_adamw", "build_adamw_offload"]

log = logging.getLogger("dscore.optim")

#: ``weight_decay`` when ``optimizer.params`` has none: DeepSpeed 0.19.8's FusedAdam / DeepSpeedCPUAdam
#: default. Only ``torch_adam: true`` keeps torch's own default (0.01 for AdamW, 0 for Adam).
FUSED_ADAM_WEIGHT_DECAY = 0.0


def _param_list(params: Iterable[Any]) -> list[Any]:
    """Materialise ``params`` (a generator would be consumed by a failed first attempt)."""
    out = list(params)
    return [dict(g) if isinstance(g, dict) else g for g in out]


def build_adam(
    params: Iterable[Any],
    *,
    adam_w_mode: bool = True,
    torch_adam: bool = False,
    bias_correction: bool = True,
    set_grad_none: bool = True,
    fp32_optimizer_states: bool = True,
    **kwargs: Any,
) -> Any:
    """Build DeepSpeed's ``"Adam"``: ``torch.optim.AdamW`` when ``adam_w_mode`` else ``torch.optim.Adam``.

    Args:
        params: tensors or torch-style param groups.
        adam_w_mode: decoupled weight decay (default true, as DeepSpeed).
        torch_adam: force torch's for-each implementation instead of the fused one.
        bias_correction: must be true (torch's Adam always corrects).
        set_grad_none, fp32_optimizer_states: accepted for DeepSpeed compatibility; no effect here.
        **kwargs: ``lr``, ``betas``, ``eps``, ``weight_decay``, ``amsgrad`` (torch names and units).
            ``weight_decay`` defaults to 0.0 (DeepSpeed's FusedAdam) unless ``torch_adam`` is true, where
            torch's default applies (0.01 for ``AdamW``), exactly as DeepSpeed 0.19.8.

    Returns:
        a ``torch.optim.Adam`` or ``torch.optim.AdamW``.

    Raises:
        ConfigError: ``bias_correction`` false (not available on torch's implementation).
    """
    import torch

    if not bias_correction:
        raise ConfigError(
            "optimizer.params.bias_correction=false is not supported by dscore's Adam (torch's implementation "
            "always bias-corrects); remove the key or set it to true",
            path="optimizer.params.bias_correction",
        )
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    params = _param_list(params)
    if torch_adam:
        return cls(params, foreach=True, **kwargs)
    # DeepSpeed's FusedAdam defaults weight_decay to 0.0; torch.optim.AdamW's own default is 0.01.
    kwargs.setdefault("weight_decay", FUSED_ADAM_WEIGHT_DECAY)
    try:
        return cls(params, fused=True, **kwargs)
    except (RuntimeError, ValueError) as exc:  # device/dtype without a fused kernel
        log.debug("fused %s unavailable (%s); using for-each", cls.__name__, exc)
        return cls(params, foreach=True, **kwargs)


def build_adamw(params: Iterable[Any], *, adam_w_mode: bool = True, **kwargs: Any) -> Any:
    """Build DeepSpeed's ``"AdamW"``: :func:`build_adam` with ``adam_w_mode`` forced true."""
    if not adam_w_mode:
        log.warning("optimizer.type AdamW forces adam_w_mode=true (as DeepSpeed); ignoring adam_w_mode=false")
    return build_adam(params, adam_w_mode=True, **kwargs)


def build_adam_offload(
    params: Iterable[Any],
    *,
    adam_w_mode: bool = True,
    torch_adam: bool = False,
    bias_correction: bool = True,
    set_grad_none: bool = True,
    fp32_optimizer_states: bool = True,
    **kwargs: Any,
) -> Any:
    """``"Adam"`` under ZeRO optimizer offload: the ``cpu_adam`` op's ``DscoreCPUAdam`` (DeepSpeed's
    DeepSpeedCPUAdam swap), falling back to :func:`build_adam` with a warning when the op cannot be built.

    Args: as :func:`build_adam`; the parameters are fp32 CPU tensors (the offloaded partitions).

    Raises:
        ConfigError: ``amsgrad`` with the CPU op (as DeepSpeed's CPU Adam), or bad hyper-parameters.
    """
    from dscore.errors import OpBuildError

    params = _param_list(params)
    common = dict(set_grad_none=set_grad_none, fp32_optimizer_states=fp32_optimizer_states)
    if torch_adam:
        return build_adam(params, adam_w_mode=adam_w_mode, torch_adam=True, bias_correction=bias_correction, **common, **kwargs)
    kwargs.setdefault("weight_decay", FUSED_ADAM_WEIGHT_DECAY)  # DeepSpeedCPUAdam's default
    try:
        from dscore_plugins.ops.cpu_optim import DscoreCPUAdam

        return DscoreCPUAdam(params, adamw_mode=adam_w_mode, bias_correction=bias_correction, **kwargs)
    except OpBuildError as exc:
        log.warning("cpu_adam op unavailable (%s); the offloaded Adam runs on torch's CPU implementation", exc)
        return build_adam(params, adam_w_mode=adam_w_mode, bias_correction=bias_correction, **common, **kwargs)


def build_adamw_offload(params: Iterable[Any], *, adam_w_mode: bool = True, **kwargs: Any) -> Any:
    """``"AdamW"`` under ZeRO optimizer offload: :func:`build_adam_offload` with ``adam_w_mode`` forced true."""
    if not adam_w_mode:
        log.warning("optimizer.type AdamW forces adam_w_mode=true (as DeepSpeed); ignoring adam_w_mode=false")
    return build_adam_offload(params, adam_w_mode=True, **kwargs)
