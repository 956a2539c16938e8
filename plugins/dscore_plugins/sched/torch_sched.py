"""Fallback LR scheduler: any ``torch.optim.lr_scheduler`` class by name.

DeepSpeed looks ``scheduler.type`` up in its own schedulers, then in ``torch.optim.lr_scheduler``
(``deepspeed-behaviour.md`` §3). dscore's engine does the same through the registry: when
``scheduler.type`` is not a registered scheduler it calls this factory (registered as the scheduler
spec ``"torch"``) with ``type_name=<the name>``.
"""

from __future__ import annotations

import logging
from typing import Any

from dscore.errors import ConfigError
from dscore_plugins.optim.torch_optim import find_torch_class

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


def torch_scheduler_factory(optimizer: Any, type_name: str | None = None, **params: Any) -> Any:
    """Build ``torch.optim.lr_scheduler.<type_name>(optimizer, **params)``.

    The exact class name is tried first (DeepSpeed's rule), then a unique case-insensitive match
    (``"steplr"`` -> ``StepLR``).

    Args:
        optimizer: the engine's optimizer (its ``param_groups`` carry the live lr).
        type_name: the ``scheduler.type`` the user wrote.
        **params: ``scheduler.params``, passed to the constructor unchanged.

    Raises:
        ComponentNotFoundError: no such class; lists dscore's and torch's schedulers with close matches.
        ConfigError: the class rejected ``params`` (the constructor's TypeError is chained).
    """
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
            path="scheduler.params",
        ) from exc
