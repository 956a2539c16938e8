"""Building the optimizer factory and the LR scheduler from the config, the registry or the client.

Rules (DeepSpeed ``deepspeed/runtime/engine.py::_configure_optimizer`` / ``_configure_lr_scheduler``):

* **Optimizer.** A client optimizer *instance* is used as it is: the engine steps that very object and
  its ``param_groups`` define the group structure (empty and all-frozen groups kept, so a client
  scheduler's per-group lists stay aligned; DeepSpeed drops empty groups, which breaks a ``LambdaLR``
  built before ``initialize``). A client *callable* is called with the parameter groups; otherwise
  ``optimizer.type`` is looked up in the
  registry (case-insensitive, aliases included) and its factory called as ``factory(param_groups, ctx)``
  with an :class:`~dscore.protocols.OptimizerContext` whose ``section`` is ``optimizer.params`` validated
  by the spec's ``params_model`` (defaults filled in by the model, nowhere else). A type no plugin
  registers falls back to the spec named ``"torch"``, whose section is a
  :class:`~dscore.protocols.TorchClassParams` (any ``torch.optim`` class; exact name first as DeepSpeed,
  then a unique case-insensitive match). A client optimizer wins over ``optimizer.type`` (a warning says so).
* **Capabilities come from the specs** (``OptimizerSpec.offload_capable``, ``offload_factory``,
  ``zero_supported``, ``classes``), never from class names.
* **Offload.** With ``zero_optimization.offload_optimizer.device`` in ``{cpu, nvme}``, a client optimizer
  whose exact class is not built by an offload-capable spec (:func:`is_offload_capable`) is refused unless
  ``zero_force_ds_cpu_optimizer`` is false. A configured type whose spec is not offload-capable is refused
  the same way; an offload-capable one is built by its ``offload_factory`` when it has one.
* **Untested optimizers.** Under ZeRO stages 1-3 a client optimizer (instance or callable result) whose
  exact class no ``zero_supported`` spec builds (:func:`is_zero_supported`) is refused unless
  ``zero_allow_untested_optimizer: true`` (DeepSpeed's ``_do_optimizer_sanity_check``).
* **LR scheduler.** The config's ``scheduler.type`` wins over a client scheduler (as DeepSpeed); a client
  scheduler is an instance or a callable taking the engine's optimizer, and must be bound to the
  optimizer the engine steps (an instance built over another optimizer object is refused). There is no
  scheduler without an optimizer. Unknown types fall back to the spec ``"torch"`` (any
  ``torch.optim.lr_scheduler`` class).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from dscore.errors import ComponentNotFoundError, ConfigError
from dscore.specs import LRSchedulerSpec, OptimizerSpec, resolve

if TYPE_CHECKING:
    import torch

    from dscore.config.model import DscoreConfig
    from dscore.registry import Registry
    from dscore.runtime.runtime import Runtime

__all__ = [
    "OptimizerChoice",
    "build_lr_scheduler",
    "check_offload_compatible",
    "check_zero_supported",
    "choose_optimizer",
    "is_offload_capable",
    "is_zero_supported",
    "lookup_component",
    "component_section",
    "optimizer_offload",
]

log = logging.getLogger("dscore.runtime.optimizer_builder")

TORCH_FALLBACK = "torch"

#: ``factory(param_groups) -> torch.optim.Optimizer`` as handed to the ZeRO stage
OptimizerFactory = Callable[[list[dict[str, Any]]], Any]


class OptimizerChoice:
    """What :func:`choose_optimizer` decided.

    Attributes:
        client_optimizer: the user's optimizer instance, or None.
        factory: ``factory(param_groups) -> torch.optim.Optimizer``, or None.
        spec: the registry spec used (None for a client optimizer / callable).
        description: a short human description for logs.
    """

    def __init__(
        self,
        *,
        client_optimizer: torch.optim.Optimizer | None = None,
        factory: OptimizerFactory | None = None,
        spec: OptimizerSpec | None = None,
        description: str = "none",
    ) -> None:
        self.client_optimizer = client_optimizer
        self.factory = factory
        self.spec = spec
        self.description = description

    @property
    def has_optimizer(self) -> bool:
        """True when an optimizer will exist (client instance, callable, or configured type)."""
        return self.client_optimizer is not None or self.factory is not None


def lookup_component(registry: Registry, kind: str, type_name: str, config_path: str) -> tuple[Any, bool]:
    """Return ``(spec, is_torch_fallback)`` for ``type_name``.

    Raises:
        ComponentNotFoundError / PluginLoadError: neither the name nor the ``torch`` fallback exists.
    """
    try:
        return registry.get(kind, type_name, config_path=config_path), False
    except ComponentNotFoundError as missing:
        try:
            return registry.get(kind, TORCH_FALLBACK, config_path=config_path), True
        except ComponentNotFoundError:
            raise missing from None


def _runtime(runtime: Runtime | None) -> Runtime:
    if runtime is not None:
        return runtime
    from dscore.runtime.context import current_runtime

    return current_runtime()


def component_section(
    spec: OptimizerSpec | LRSchedulerSpec, registry: Registry, type_name: str, params: dict[str, Any], *,
    fallback: bool, path: str,
) -> BaseModel:
    """The validated section a factory receives: ``params`` through the spec's ``params_model``.

    The torch fallback gets :class:`~dscore.protocols.TorchClassParams`, a spec without a params model
    :class:`~dscore.protocols.OpaqueParams`.

    Raises:
        ConfigError: ``params`` fail the model (one problem per key path under ``path``, the same message
            :func:`dscore.config.load_config` gives).
        PluginLoadError: the params model cannot be imported.
    """
    from dscore.config.components import params_model_of
    from dscore.config.errors import problems_from_validation, raise_problems
    from dscore.protocols.context import OpaqueParams, TorchClassParams

    if fallback:
        return TorchClassParams(type_name=type_name, params=dict(params))
    model = params_model_of(spec, registry)
    if model is None:
        return OpaqueParams(params=dict(params))
    try:
        return model.model_validate(params)
    except ValidationError as exc:
        prefix = tuple(path.split("."))
        raise_problems(problems_from_validation(exc, params, model, prefix=prefix), source=path)
        raise  # unreachable: raise_problems raised


def optimizer_offload(config: DscoreConfig) -> bool:
    """True when ``zero_optimization.offload_optimizer.device`` is ``cpu`` or ``nvme``."""
    zero = config.section("zero_optimization", None)
    off = zero.offload_optimizer if zero is not None else None
    return off is not None and str(off.device).lower() in ("cpu", "nvme")


def choose_optimizer(
    config: DscoreConfig,
    registry: Registry,
    client: torch.optim.Optimizer | OptimizerFactory | None,
    *,
    runtime: Runtime | None = None,
) -> OptimizerChoice:
    """Decide where the optimizer comes from (see the module docstring).

    Args:
        config: the validated DscoreConfig.
        registry: the runtime's :class:`dscore.registry.Registry`.
        client: ``initialize(optimizer=...)``: an optimizer instance, a callable, or None.
        runtime: the runtime given to the factory's context (default: the current one, which
            ``dscore.initialize`` sets).

    Raises:
        ConfigError: ``optimizer.params`` holds ``max_grad_norm`` or fails the params model; an
            offload-incompatible optimizer is used with ZeRO optimizer offload and
            ``zero_force_ds_cpu_optimizer`` is true; a client optimizer not known to be ZeRO-safe under
            ZeRO 1-3 without ``zero_allow_untested_optimizer``.
        ComponentNotFoundError: ``optimizer.type`` is not registered and no ``torch`` fallback exists.
    """
    import torch

    opt_cfg = config.optimizer
    offload = optimizer_offload(config)
    if client is not None:
        if opt_cfg is not None:
            log.warning(
                "both a client optimizer and optimizer.type=%r were given; using the client optimizer",
                opt_cfg.type,
            )
        if isinstance(client, torch.optim.Optimizer):
            if offload:
                check_offload_compatible(config, registry, type(client))
            check_zero_supported(config, registry, type(client))
            return OptimizerChoice(client_optimizer=client, description=f"client {type(client).__name__}")
        if callable(client):

            def from_callable(groups: list[dict[str, Any]]) -> Any:
                opt = client(groups)
                if offload:
                    check_offload_compatible(config, registry, type(opt))
                check_zero_supported(config, registry, type(opt))
                return opt

            return OptimizerChoice(factory=from_callable, description="client optimizer callable")
        raise ConfigError(
            f"optimizer must be a torch.optim.Optimizer or a callable(params) -> optimizer, got {type(client).__name__}"
        )
    if opt_cfg is None:
        return OptimizerChoice()
    params = dict(opt_cfg.params)
    if "max_grad_norm" in params:
        raise ConfigError(
            "'max_grad_norm' is not supported as an optimizer parameter; use the top-level "
            "'gradient_clipping' key instead",
            path="optimizer.params.max_grad_norm",
        )
    spec, fallback = lookup_component(registry, "optimizer", opt_cfg.type, "optimizer.type")
    assert isinstance(spec, OptimizerSpec)
    if offload and not spec.offload_capable and config.zero_force_ds_cpu_optimizer:
        raise ConfigError(
            f"optimizer.type = {opt_cfg.type!r} cannot run with zero_optimization.offload_optimizer on the CPU/NVMe "
            "(its optimizer is not offload-capable). Choose an offload-capable optimizer (Adam, AdamW, Adagrad, "
            "Lion) or set zero_force_ds_cpu_optimizer: false to use it anyway.",
            path="optimizer.type",
        )
    from dscore.protocols.context import OptimizerContext

    section = component_section(
        spec, registry, opt_cfg.type, params, fallback=fallback, path="optimizer.params"
    )
    ctx = OptimizerContext(
        config=config, section=section, runtime=_runtime(runtime), path="optimizer.params", offload=offload
    )
    factory: Any = registry.load(spec, "offload_factory" if offload and spec.offload_factory else "factory")

    def from_config(groups: list[dict[str, Any]]) -> Any:
        return factory(groups, ctx)

    variant = ", offload variant" if offload and spec.offload_factory else ""
    desc = f"{opt_cfg.type} ({'torch.optim fallback' if fallback else spec.name}{variant})"
    return OptimizerChoice(factory=from_config, spec=spec, description=desc)


def _built_by(spec: OptimizerSpec, cls: type) -> bool:
    """True when ``cls`` is exactly one of the classes ``spec`` declares it builds."""
    for target in spec.classes:
        try:
            built = resolve(target)
        except Exception:  # noqa: BLE001 - an optional optimizer that cannot load is not the client's class
            continue
        if built is cls:
            return True
    return False


def is_offload_capable(registry: Registry, cls: type) -> bool:
    """True when an offload-capable spec runs exactly ``cls`` under optimizer offload.

    That is a spec with ``offload_capable=True`` and no ``offload_factory`` (its own factory runs under
    offload) listing ``cls`` in ``classes`` — dscore's CPU optimizers, ``torch.optim.Adagrad``. A spec with
    an ``offload_factory`` (``adam``) swaps in another optimizer under offload, so the classes its plain
    factory builds (``torch.optim.AdamW``) are not offload-capable as client optimizers (DeepSpeed refuses
    them too).
    """
    return any(
        isinstance(spec, OptimizerSpec) and spec.offload_capable and not spec.offload_factory and _built_by(spec, cls)
        for spec in registry.specs("optimizer")
    )


def check_offload_compatible(config: DscoreConfig, registry: Registry, cls: type) -> None:
    """Refuse a non offload-capable optimizer class under ZeRO optimizer offload (§4 of the reference).

    Raises:
        ConfigError: naming ``zero_force_ds_cpu_optimizer: false`` as the way out.
    """
    if not config.zero_force_ds_cpu_optimizer or is_offload_capable(registry, cls):
        return
    raise ConfigError(
        f"the client optimizer {cls.__module__}.{cls.__name__} is not offload-capable, but "
        "zero_optimization.offload_optimizer puts optimizer states on the CPU/NVMe. Use an offload-capable "
        "optimizer (e.g. optimizer.type 'Adam' in the config) or set zero_force_ds_cpu_optimizer: false "
        "to run this one on CPU tensors anyway.",
        path="zero_force_ds_cpu_optimizer",
    )


def is_zero_supported(registry: Registry, cls: type) -> bool:
    """True when a spec with ``zero_supported=True`` builds exactly ``cls`` (DeepSpeed's
    ``ZERO_SUPPORTED_OPTIMIZERS``: ``type(opt) in ...``).

    The built-in specs declare torch's ``Adam``/``AdamW``/``Adagrad``, dscore's fused and CPU Adam,
    Adagrad and Lion, and ``MuonWithAuxAdam``. Subclasses are *not* known, as in DeepSpeed (they may
    override ``step`` with cross-element logic); a plugin declares its own optimizer ZeRO-safe with
    ``OptimizerSpec(zero_supported=True, classes=(...,))``.
    """
    return any(
        isinstance(spec, OptimizerSpec) and spec.zero_supported and _built_by(spec, cls)
        for spec in registry.specs("optimizer")
    )


def check_zero_supported(config: DscoreConfig, registry: Registry, cls: type) -> None:
    """Refuse a client optimizer class not known to be ZeRO-safe under ZeRO stages 1-3 (DeepSpeed
    ``_do_optimizer_sanity_check``) unless ``zero_allow_untested_optimizer: true``.

    Raises:
        ConfigError: naming ``zero_allow_untested_optimizer`` and the optimizer class.
    """
    stage = config.zero_stage
    if stage == 0 or is_zero_supported(registry, cls):
        return
    if config.zero_allow_untested_optimizer:
        log.warning(
            "ZeRO stage %d with the untested client optimizer %s.%s (zero_allow_untested_optimizer: true); "
            "proceed with caution", stage, cls.__module__, cls.__name__,
        )
        return
    raise ConfigError(
        f"the client optimizer {cls.__module__}.{cls.__name__} is not known to be correct under ZeRO stage {stage} "
        "(known: torch.optim.Adam, AdamW, Adagrad, dscore's fused/CPU Adam, Adagrad and Lion, and the optimizers "
        "plugins declare zero_supported). Set "
        '"zero_allow_untested_optimizer": true in ds_config to use it anyway (element-wise optimizers such as '
        "SGD are safe), or use zero_optimization.stage 0",
        path="zero_allow_untested_optimizer",
    )


def build_lr_scheduler(
    config: DscoreConfig,
    registry: Registry,
    optimizer: torch.optim.Optimizer | None,
    client: Any,
    *,
    runtime: Runtime | None = None,
) -> Any:
    """Create the LR scheduler driving ``optimizer`` (see the module docstring), or None.

    A configured ``scheduler.type`` is built as ``factory(optimizer, ctx)`` with a
    :class:`~dscore.protocols.SchedulerContext` whose ``section`` is the validated ``scheduler.params``
    (``runtime``: default the current one).

    Raises:
        ConfigError: the client scheduler is neither an object with ``step()`` nor a callable, is bound to
            another optimizer object, or has a different number of per-group learning rates.
        ComponentNotFoundError: ``scheduler.type`` is unknown and no ``torch`` fallback exists.
    """
    sched_cfg = config.scheduler
    if optimizer is None:
        if sched_cfg is not None or client is not None:
            log.warning("an LR scheduler was given but there is no optimizer; it is ignored (as in DeepSpeed)")
        return None
    if sched_cfg is not None:
        spec, fallback = lookup_component(registry, "lr_scheduler", sched_cfg.type, "scheduler.type")
        assert isinstance(spec, LRSchedulerSpec)
        from dscore.protocols.context import SchedulerContext

        factory: Any = registry.load(spec)
        section = component_section(
            spec, registry, sched_cfg.type, dict(sched_cfg.params), fallback=fallback, path="scheduler.params"
        )
        if client is not None:
            log.warning(
                "both scheduler.type=%r and a client lr_scheduler were given; using the config's", sched_cfg.type
            )
        ctx = SchedulerContext(config=config, section=section, runtime=_runtime(runtime), path="scheduler.params")
        return factory(optimizer, ctx)
    if client is None:
        return None
    if hasattr(client, "step") and hasattr(client, "state_dict"):
        _check_scheduler_binding(client, optimizer)
        return client
    if callable(client):
        sched = client(optimizer)
        _check_scheduler_binding(sched, optimizer)
        return sched
    raise ConfigError(
        f"lr_scheduler must be a scheduler object or a callable(optimizer) -> scheduler, got {type(client).__name__}"
    )


def _check_scheduler_binding(scheduler: Any, optimizer: Any) -> None:
    """A client scheduler must drive the optimizer the engine steps, with one entry per group.

    The engine steps the client optimizer object itself (its groups re-pointed at ZeRO partitions), so a
    scheduler built over it stays bound. A scheduler built over another optimizer object would change
    learning rates nobody uses.

    Raises:
        ConfigError: the scheduler's ``optimizer`` is another object, or its per-group ``base_lrs`` do not
            match the number of parameter groups.
    """
    bound = getattr(scheduler, "optimizer", None)
    if bound is not None and bound is not optimizer:
        raise ConfigError(
            f"the client lr_scheduler ({type(scheduler).__name__}) is bound to a different optimizer object than "
            "the one the engine steps; build the scheduler over the optimizer you pass to dscore.initialize, or "
            "pass a callable(optimizer) -> scheduler"
        )
    base_lrs = getattr(scheduler, "base_lrs", None)
    groups = getattr(optimizer, "param_groups", None)
    if isinstance(base_lrs, list) and groups is not None and len(base_lrs) != len(groups):
        raise ConfigError(
            f"the client lr_scheduler ({type(scheduler).__name__}) has {len(base_lrs)} per-group learning rates "
            f"but the optimizer has {len(groups)} parameter group(s)"
        )
