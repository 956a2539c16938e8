"""Validating ``optimizer.params`` and ``scheduler.params`` against the selected plugin's params model.

The component is looked up in the registry (case-insensitive, aliases included); its spec's
``params_model`` import string names a torch-free pydantic model. The params are validated by it (so a
plugin's own parameters get the same strict checking as dscore's) but the dict is kept as written:
defaults are not injected.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from dscore.config.errors import Problem, problems_from_validation, short_repr
from dscore.errors import ComponentNotFoundError, PluginLoadError, did_you_mean
from dscore.specs import LRSchedulerSpec, OptimizerSpec

if TYPE_CHECKING:
    from dscore.registry import Registry

__all__ = ["validate_components", "COMPONENT_BLOCKS", "params_model_of"]

_TORCH_MODULES = {"optimizer": "torch.optim", "lr_scheduler": "torch.optim.lr_scheduler"}


def _torch_class_names(kind: str) -> list[str]:
    """Names of the optimizer (or LR scheduler) classes torch provides.

    torch is imported only here, i.e. only when a config names a component no plugin registers, so
    validating an ordinary config stays torch-free.
    """
    import importlib

    try:
        module = importlib.import_module(_TORCH_MODULES[kind])
        base = module.Optimizer if kind == "optimizer" else module.LRScheduler
    except (ImportError, AttributeError):
        return []
    return sorted(
        name
        for name, obj in vars(module).items()
        if isinstance(obj, type) and issubclass(obj, base) and obj is not base and not name.startswith("_")
    )

#: top-level block -> registry kind of the component it selects.
COMPONENT_BLOCKS: dict[str, str] = {"optimizer": "optimizer", "scheduler": "lr_scheduler"}


def params_model_of(spec: OptimizerSpec | LRSchedulerSpec, registry: Registry) -> type[BaseModel] | None:
    """The pydantic model class named by ``spec.params_model``, or None when the spec has none.

    Raises:
        PluginLoadError: the import string cannot be imported or is not a pydantic model (names the plugin).
    """
    if not spec.params_model:
        return None
    record = registry.provider(spec)
    model = registry.load(spec, "params_model")
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise PluginLoadError(
            f"plugin {record.label()}: params_model {spec.params_model!r} is not a pydantic model class",
            plugin=record.name,
            distribution=record.distribution,
            version=record.version,
        )
    return model


def validate_components(data: dict[str, Any], registry: Registry, warn: Callable[[str], None]) -> list[Problem]:
    """Check ``optimizer`` and ``scheduler`` in ``data`` (edited in place only to drop a type-less block).

    A block without ``type`` means "no component from the config" (DeepSpeed's behaviour); it is dropped
    with a warning. ``optimizer.params.max_grad_norm`` is refused (use ``gradient_clipping``).

    Returns:
        Problems with paths like ``optimizer.type`` or ``scheduler.params.warmup_num_steps``.

    Raises:
        PluginLoadError: the selected plugin's params model cannot be imported, or the name is not found
            and a broken plugin might provide it.
        PluginConflictError: two plugins provide the name.
    """
    problems: list[Problem] = []
    for key, kind in COMPONENT_BLOCKS.items():
        block = data.get(key)
        if not isinstance(block, dict):
            continue
        if block.get("type") is None:
            if block:
                warn(f"{key} has no 'type': no {key} is built from the config and {key!r} is ignored")
            data[key] = None
            continue
        name = block["type"]
        if not isinstance(name, str):
            continue  # reported by validation
        params = block.get("params")
        if params is None and "params" in block:
            block["params"] = params = {}
        if key == "optimizer" and isinstance(params, dict) and "max_grad_norm" in params:
            problems.append(
                (
                    "optimizer.params.max_grad_norm",
                    "optimizer.params.max_grad_norm: not supported as an optimizer parameter; use the top-level "
                    "'gradient_clipping' key instead (as DeepSpeed)",
                    (key, "params", "max_grad_norm"),
                )
            )
        try:
            spec = registry.get(kind, name, config_path=f"{key}.type")
        except ComponentNotFoundError as exc:
            if registry.manager.disabled_unit_providers(kind, name):  # kind:name disabled: never a torch fallback
                problems.append((f"{key}.type", f"{key}.type: {exc}", (key, "type")))
                continue
            torch_names = _torch_class_names(kind) if "torch" in {n.lower() for n in registry.names(kind)} else []
            if any(n.lower() == name.lower() for n in torch_names):
                continue  # any torch.optim / torch.optim.lr_scheduler class by name; torch checks its params
            disabled = registry.manager.disabled_providers(kind, name)
            if disabled:
                from dscore.registry import disabled_message

                text = disabled_message(kind, repr(name), disabled)
                problems.append((f"{key}.type", f"{key}.type: {text}", (key, "type")))
                continue
            close = did_you_mean(name, [*exc.available, *torch_names])
            hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            problems.append(
                (
                    f"{key}.type",
                    f"{key}.type: {name!r} is neither a registered {kind.replace('_', ' ')} "
                    f"({', '.join(exc.available)}) nor a class of {_TORCH_MODULES[kind]}.{hint} "
                    "A plugin providing it may not be installed (see `dscore plugins list`).",
                    (key, "type"),
                )
            )
            continue
        assert isinstance(spec, (OptimizerSpec, LRSchedulerSpec))
        model = params_model_of(spec, registry)
        if model is None or not isinstance(params, dict):
            continue
        checked = {k: v for k, v in params.items() if not (key == "optimizer" and k == "max_grad_norm")}
        try:
            model.model_validate(checked)
        except ValidationError as exc:
            problems += problems_from_validation(exc, checked, model, prefix=(key, "params"))
        except (TypeError, ValueError) as exc:  # a plugin validator raising outside pydantic's protocol
            problems.append((f"{key}.params", f"{key}.params: {exc} (got {short_repr(params)})", (key, "params")))
    return problems
