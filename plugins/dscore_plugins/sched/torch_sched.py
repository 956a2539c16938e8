"""Fallback LR scheduler: any ``torch.optim.lr_scheduler`` class by name.

DeepSpeed looks ``scheduler.type`` up in its own schedulers, then in ``torch.optim.lr_scheduler``
(``deepspeed-behaviour.md`` §3). dscore's engine does the same through the registry: when
``scheduler.type`` is not a registered scheduler it calls this factory (registered as the scheduler
spec ``"torch"``) with a :class:`dscore.protocols.TorchClassParams` section (the name and its params).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from dscore.errors import ConfigError
from dscore_plugins.optim.torch_optim import find_torch_class

if TYPE_CHECKING:
    from dscore.protocols import SchedulerContext, TorchClassParams

__all__ = ["torch_scheduler_classes", "torch_scheduler_factory"]

log = logging.getLogger("dscore.sched")


def torch_scheduler_classes() -> dict[str, type]:
    """Name -> class of every public scheduler class in ``torch.optim.lr_scheduler``."""
    import torch.optim.lr_scheduler as lrs

    base = lrs.LRScheduler
    out: dict[str, type] = {}
    for name in dir(lrs):
        obj = getattr(lrs, name)
        if name.startswith("_") or not isinstance(obj, type) or obj is base:
            continue
        if issubclass(obj, base) or name == "ReduceLROnPlateau":
            out[name] = obj
    return out


def _builtin_names() -> list[str]:
    from dscore_plugins.sched.plugin import SCHEDULER_SPECS

    return [s.name for s in SCHEDULER_SPECS if s.name != "torch"]


def torch_scheduler_factory(optimizer: Any, ctx: SchedulerContext[TorchClassParams]) -> Any:
    """Build ``torch.optim.lr_scheduler.<ctx.section.type_name>(optimizer, **ctx.section.params)``.

    The exact class name is tried first (DeepSpeed's rule), then a unique case-insensitive match
    (``"steplr"`` -> ``StepLR``). torch checks the arguments.

    Args:
        optimizer: the engine's optimizer (its ``param_groups`` carry the live lr).
        ctx: ``ctx.section`` holds the ``scheduler.type`` as written and ``scheduler.params``.

    Raises:
        ComponentNotFoundError: no such class; lists dscore's and torch's schedulers with close matches.
        ConfigError: the class rejected the params (the constructor's TypeError is chained).
    """
    type_name, params = ctx.section.type_name, dict(ctx.section.params)
    if not type_name:
        raise ConfigError("scheduler.type is required to build a torch.optim.lr_scheduler class", path="scheduler.type")
    cls = find_torch_class(
        torch_scheduler_classes(), type_name, kind="lr_scheduler", config_key="scheduler",
        module="torch.optim.lr_scheduler", builtin_names=_builtin_names(),
    )
    try:
        return cls(optimizer, **params)
    except TypeError as exc:
        raise ConfigError(
            f"torch.optim.lr_scheduler.{cls.__name__} rejected scheduler.params {sorted(params)}: {exc}",
            path=ctx.path or "scheduler.params",
        ) from exc
