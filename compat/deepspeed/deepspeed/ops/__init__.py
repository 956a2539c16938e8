"""``deepspeed.ops``: the fused optimizers (``adam.FusedAdam``, ``lamb.FusedLamb``, ``lion.FusedLion``) and the CPU ones (``adam.DeepSpeedCPUAdam``, ``adagrad.DeepSpeedCPUAdagrad``,
``lion.DeepSpeedCPULion``), found through dscore's optimizer registry under their DeepSpeed names;
``op_builder`` (DeepSpeed's builder classes over dscore's op builders) and ``__compatible_ops__`` (op name ->
whether it can be built here, asked of each builder on first access)."""

from __future__ import annotations

from typing import Any

__all__ = ["adagrad", "adam", "lamb", "lion", "op_builder", "registered_optimizer_class"]


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
    if name in ("adam", "adagrad", "lamb", "lion", "op_builder"):
        from importlib import import_module

        return import_module(f"deepspeed.ops.{name}")
    if name == "__compatible_ops__":
        from deepspeed.ops.op_builder import ALL_OPS

        compatible = {op: builder.is_compatible() for op, builder in ALL_OPS.items()}
        globals()[name] = compatible
        return compatible
    raise AttributeError(f"deepspeed.ops.{name} is not provided by dscore's compatibility layer")
