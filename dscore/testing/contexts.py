"""Build factory contexts outside ``dscore.initialize``: for unit tests of a plugin's factories.

``dscore.initialize`` builds the :class:`~dscore.protocols.OptimizerContext` (and the other kinds) itself;
a plugin author testing a factory in isolation needs the same objects without a process group. The
:func:`local_runtime` here is a real :class:`~dscore.runtime.runtime.Runtime` over the installed plugins
and the CPU accelerator, for one process (rank 0 of 1) and *without* creating a process group (its
``comm`` must not be used for collectives).

Example::

    from dscore.testing.contexts import optimizer_context
    ctx = optimizer_context("SignSGD", {"lr": 0.5})
    opt = build_sign_sgd([{"params": [w]}], ctx)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dscore.config.model import DscoreConfig
    from dscore.protocols.context import MonitorContext, OptimizerContext, PrecisionContext, SchedulerContext
    from dscore.runtime.runtime import Runtime

__all__ = [
    "local_config",
    "local_runtime",
    "monitor_context",
    "optimizer_context",
    "precision_context",
    "scheduler_context",
]


def local_runtime(*, disable: tuple[str, ...] = ()) -> Runtime:
    """A one-process runtime (installed plugins minus ``disable``, the ``cpu`` accelerator, no process group).

    Raises:
        PluginValidationError / AcceleratorError: a plugin is broken, or the cpu accelerator is missing.
    """
    from dscore.accelerator import select_accelerator
    from dscore.comm.env import DistributedEnv
    from dscore.comm.facade import Comm
    from dscore.plugin_manager import create_plugin_manager
    from dscore.registry import Registry
    from dscore.runtime.runtime import Runtime

    manager = create_plugin_manager(disable=list(disable))
    registry = Registry(manager)
    accelerator, reason = select_accelerator(registry, "cpu", {})
    env = DistributedEnv(
        rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr="127.0.0.1", master_port=0,
        source="explicit",
    )
    return Runtime(manager, registry, accelerator, reason, Comm(None, backend="gloo", env=env), env)


def local_config(data: dict[str, Any] | None = None, *, runtime: Runtime | None = None) -> DscoreConfig:
    """``data`` (default: ``{"train_batch_size": 1}`` merged in) validated for a world size of 1.

    Raises:
        ConfigError: the config is invalid (key paths in the message).
    """
    from dscore.config import load_config
    from dscore.plugin_manager import create_plugin_manager
    from dscore.registry import Registry

    registry = runtime.registry if runtime is not None else Registry(create_plugin_manager())
    return load_config({"train_batch_size": 1, **(data or {})}, world_size=1, registry=registry)


def optimizer_context(
    type_name: str, params: dict[str, Any] | None = None, *, offload: bool = False, runtime: Runtime | None = None
) -> OptimizerContext[Any]:
    """The context ``dscore.initialize`` would give the factory of ``optimizer.type = type_name``.

    ``params`` are validated by the spec's ``params_model`` exactly as at ``initialize`` (a bad value
    raises the same :class:`~dscore.errors.ConfigError` with its key path).
    """
    from dscore.protocols.context import OptimizerContext
    from dscore.runtime.optimizer_builder import component_section, lookup_component

    runtime = runtime or local_runtime()
    config = local_config({"optimizer": {"type": type_name, "params": dict(params or {})}}, runtime=runtime)
    spec, fallback = lookup_component(runtime.registry, "optimizer", type_name, "optimizer.type")
    section = component_section(
        spec, runtime.registry, type_name, dict(params or {}), fallback=fallback, path="optimizer.params"
    )
    return OptimizerContext(config=config, section=section, runtime=runtime, path="optimizer.params", offload=offload)


def scheduler_context(
    type_name: str, params: dict[str, Any] | None = None, *, runtime: Runtime | None = None
) -> SchedulerContext[Any]:
    """The context ``dscore.initialize`` would give the factory of ``scheduler.type = type_name``."""
    from dscore.protocols.context import SchedulerContext
    from dscore.runtime.optimizer_builder import component_section, lookup_component

    runtime = runtime or local_runtime()
    config = local_config({"scheduler": {"type": type_name, "params": dict(params or {})}}, runtime=runtime)
    spec, fallback = lookup_component(runtime.registry, "lr_scheduler", type_name, "scheduler.type")
    section = component_section(
        spec, runtime.registry, type_name, dict(params or {}), fallback=fallback, path="scheduler.params"
    )
    return SchedulerContext(config=config, section=section, runtime=runtime, path="scheduler.params")


def monitor_context(
    name: str, section: dict[str, Any] | None = None, *, runtime: Runtime | None = None
) -> MonitorContext[Any]:
    """The context ``dscore.initialize`` would give the factory of the monitor registered as ``name``.

    ``section`` is the user's block under the spec's ``config_key`` (``{"enabled": True, ...}``), validated
    by the section's model as at ``initialize``; the runtime is rank 0 of 1.

    Raises:
        ComponentNotFoundError: no monitor ``name`` is registered. ConfigError: ``section`` is invalid.
    """
    from dscore.protocols.context import MonitorContext
    from dscore.specs import MonitorSpec

    runtime = runtime or local_runtime()
    spec = runtime.registry.get_typed(MonitorSpec, name)
    config = local_config({spec.config_key: dict(section or {})}, runtime=runtime)
    return MonitorContext(
        config=config, section=config.section(spec.config_key), runtime=runtime, path=spec.config_key
    )


def precision_context(
    name: str, section: dict[str, Any] | None = None, *, runtime: Runtime | None = None
) -> PrecisionContext[Any]:
    """The context ``dscore.initialize`` would give the factory of the precision mode registered as ``name``
    (``section`` is its block, e.g. ``{"enabled": True, "loss_scale": 0}``; ``None`` section for a mode
    without a ``config_key`` such as ``fp32``).

    Raises:
        ComponentNotFoundError: no precision mode ``name`` is registered. ConfigError: ``section`` is invalid.
    """
    from dscore.protocols.context import PrecisionContext
    from dscore.specs import PrecisionSpec

    runtime = runtime or local_runtime()
    spec = runtime.registry.get_typed(PrecisionSpec, name)
    key = spec.config_key
    config = local_config({key: dict(section or {})} if key else {}, runtime=runtime)
    return PrecisionContext(
        config=config, section=config.section(key) if key else None, runtime=runtime, path=key or ""
    )
