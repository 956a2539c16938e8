"""``deepspeed.ops``: the CPU optimizers (``adam.DeepSpeedCPUAdam``, ``adagrad.DeepSpeedCPUAdagrad``,
``lion.DeepSpeedCPULion``), found through dscore's optimizer registry under their DeepSpeed names."""

from __future__ import annotations

from typing import Any

__all__ = ["adagrad", "adam", "lion", "registered_optimizer_class"]


def registered_optimizer_class(name: str) -> Any:
    """The optimizer class registered in dscore under ``name`` (a DeepSpeed spelling such as
    ``DeepSpeedCPUAdam``), imported from its ``OptimizerSpec.classes``.

    Raises:
        dscore.errors.ComponentNotFoundError: no installed plugin registers ``name``.
    """
    from dscore.plugin_manager import create_plugin_manager
    from dscore.registry import Registry
    from dscore.specs import resolve

    spec: Any = Registry(create_plugin_manager()).get("optimizer", name)
    return resolve(spec.classes[0])


def __getattr__(name: str) -> Any:
    if name in ("adam", "adagrad", "lion"):
        from importlib import import_module

        return import_module(f"deepspeed.ops.{name}")
    raise AttributeError(f"deepspeed.ops.{name} is not provided by dscore's compatibility layer")
