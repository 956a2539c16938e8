"""torch.optim-backed optimizers: ``adagrad``, ``sgd``, and the fallback for any ``torch.optim`` class.

DeepSpeed builds ``torch.optim.Adagrad`` for ``adagrad`` and ``getattr(torch.optim, type)`` for any other
name (``deepspeed-behaviour.md`` §4). dscore's engine calls :func:`torch_optimizer_factory` (registered as
the optimizer spec ``"torch"``) with a :class:`dscore.protocols.TorchClassParams` section (the
``optimizer.type`` as written and its params) when the name is not a registered optimizer. Unlike DeepSpeed the lookup is case-insensitive when unambiguous (``"rmsprop"`` works).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dscore.errors import ComponentNotFoundError, ConfigError, did_you_mean

if TYPE_CHECKING:
    import torch

    from dscore.protocols import OptimizerContext, TorchClassParams
    from dscore_plugins.optim.config import AdagradParams, SGDParams

__all__ = ["build_adagrad", "build_sgd", "torch_optimizer_classes", "torch_optimizer_factory"]


def build_adagrad(param_groups: list[dict[str, Any]], ctx: OptimizerContext[AdagradParams]) -> torch.optim.Adagrad:
    """``torch.optim.Adagrad`` with the validated params (DeepSpeed's defaults lr=1e-2, eps=1e-10 live in
    :class:`~dscore_plugins.optim.config.AdagradParams`)."""
    import torch

    p = ctx.section
    return torch.optim.Adagrad(
        param_groups, lr=p.lr, lr_decay=p.lr_decay, weight_decay=p.weight_decay,
        initial_accumulator_value=p.initial_accumulator_value, eps=p.eps,
    )


def build_sgd(param_groups: list[dict[str, Any]], ctx: OptimizerContext[SGDParams]) -> torch.optim.SGD:
    """``torch.optim.SGD`` with the validated params."""
    import torch

    p = ctx.section
    return torch.optim.SGD(
        param_groups, lr=p.lr, momentum=p.momentum, dampening=p.dampening, weight_decay=p.weight_decay,
        nesterov=p.nesterov, maximize=p.maximize,
    )


def torch_optimizer_classes() -> dict[str, type]:
    """Name -> class of every public ``torch.optim.Optimizer`` subclass exported by ``torch.optim``."""
    import torch

    out: dict[str, type] = {}
    for name in dir(torch.optim):
        obj = getattr(torch.optim, name)
        if not name.startswith("_") and isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer):
            if obj is not torch.optim.Optimizer:
                out[name] = obj
    return out


def _builtin_names() -> list[str]:
    from dscore_plugins.optim.plugin import OPTIMIZER_SPECS

    return [s.name for s in OPTIMIZER_SPECS if s.name != "torch"]


def torch_optimizer_factory(
    param_groups: list[dict[str, Any]], ctx: OptimizerContext[TorchClassParams]
) -> torch.optim.Optimizer:
    """Build ``torch.optim.<ctx.section.type_name>(param_groups, **ctx.section.params)``.

    The exact name is tried first (DeepSpeed's rule), then a unique case-insensitive match. The arguments
    are torch's to check: dscore has no model of every torch optimizer's keyword arguments.

    Args:
        param_groups: torch-style param groups.
        ctx: ``ctx.section`` holds the ``optimizer.type`` as written and ``optimizer.params``.

    Raises:
        ComponentNotFoundError: no such class; lists dscore's and torch's optimizers with close matches.
        ConfigError: ``max_grad_norm`` given (use ``gradient_clipping``), or the class rejected the params.
    """
    type_name, kwargs = ctx.section.type_name, dict(ctx.section.params)
    if not type_name:
        raise ConfigError("optimizer.type is required to build a torch.optim class", path="optimizer.type")
    if "max_grad_norm" in kwargs:
        raise ConfigError(
            "'max_grad_norm' is not supported as an optimizer parameter; use the top-level ds_config key "
            "'gradient_clipping' instead",
            path=ctx.key("max_grad_norm"),
        )
    cls = find_torch_class(
        torch_optimizer_classes(), type_name, kind="optimizer", config_key="optimizer", module="torch.optim",
        builtin_names=_builtin_names(),
    )
    try:
        return cls(param_groups, **kwargs)  # type: ignore[no-any-return]
    except TypeError as exc:
        raise ConfigError(
            f"torch.optim.{cls.__name__} rejected optimizer.params {sorted(kwargs)}: {exc}", path=ctx.path
        ) from exc


def find_torch_class(
    classes: dict[str, type], type_name: str, *, kind: str, config_key: str, module: str, builtin_names: list[str]
) -> type:
    """Pick ``type_name`` from ``classes`` (torch's optimizers or LR schedulers): the exact name first
    (DeepSpeed's rule), then a unique case-insensitive match.

    Raises:
        ComponentNotFoundError: no such class; the message lists dscore's and torch's names with close matches.
    """
    cls = classes.get(type_name)
    if cls is None:
        matches = [c for n, c in classes.items() if n.lower() == type_name.lower()]
        cls = matches[0] if len(matches) == 1 else None
    if cls is not None:
        return cls
    available = sorted(set(builtin_names) | set(classes), key=str.lower)
    suggestions = did_you_mean(type_name, available)
    hint = f" Did you mean {' or '.join(repr(s) for s in suggestions)}?" if suggestions else ""
    label = kind.replace("_", " ")
    raise ComponentNotFoundError(
        f"no {label} named {config_key}.type = {type_name!r}: it is neither a dscore {label} nor a class of "
        f"{module}. Installed: {', '.join(available)}.{hint} "
        "A plugin providing it may not be installed (see `dscore plugins list`).",
        kind=kind,
        name=type_name,
        available=available,
        suggestions=suggestions,
    )
