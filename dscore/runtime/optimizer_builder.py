"""Building the optimizer factory and the LR scheduler from the config, the registry or the client.

Rules (DeepSpeed ``deepspeed/runtime/engine.py::_configure_optimizer`` / ``_configure_lr_scheduler``):

* **Optimizer.** A client optimizer *instance* is used as it is: the engine steps that very object and
  its ``param_groups`` define the group structure (empty and all-frozen groups kept, so a client
  scheduler's per-group lists stay aligned; DeepSpeed drops empty groups, which breaks a ``LambdaLR``
  built before ``initialize``). A client *callable* is called with the parameter groups; otherwise
  ``optimizer.type`` is looked up in the
  registry (case-insensitive, aliases included) and its factory called as ``factory(params, **params)``.
  A type no plugin registers falls back to the spec named ``"torch"``, called with
  ``type_name=<type as written>`` (any ``torch.optim`` class, case-sensitive like DeepSpeed: ``"SGD"``
  works, ``"sgd"`` does not). A client optimizer wins over ``optimizer.type`` (a warning says so).
* **Offload.** With ``zero_optimization.offload_optimizer.device`` in ``{cpu, nvme}``, a client optimizer
  whose class is not offload-capable (no registered ``OptimizerSpec(offload_capable=True)`` builds it and
  the class has no true ``offload_capable`` attribute) is refused unless ``zero_force_ds_cpu_optimizer``
  is false. A configured type that is not offload-capable is refused the same way.
* **Untested optimizers.** Under ZeRO stages 1-3 a client optimizer (instance or callable result) whose
  class is not known to be ZeRO-safe (:func:`is_zero_supported`) is refused unless
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
from typing import Any

from dscore.errors import ComponentNotFoundError, ConfigError
from dscore.specs import LRSchedulerSpec, OptimizerSpec, resolve

__all__ = [
    "OptimizerChoice",
    "build_lr_scheduler",
    "check_offload_compatible",
    "check_zero_supported",
    "choose_optimizer",
    "is_zero_supported",
]

log = logging.getLogger("dscore.runtime.optimizer_builder")

TORCH_FALLBACK = "torch"


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
        client_optimizer: Any = None,
        factory: Callable[[list[dict[str, Any]]], Any] | None = None,
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


def _lookup(registry: Any, kind: str, type_name: str, config_path: str) -> tuple[Any, bool]:
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


def _offload_device(config: Any) -> str:
    zero = config.section("zero_optimization") if hasattr(config, "section") else None
    off = getattr(zero, "offload_optimizer", None)
    device = getattr(off, "device", None) if off is not None else None
    return str(getattr(device, "value", device) or "none").lower()


def choose_optimizer(config: Any, registry: Any, client: Any) -> OptimizerChoice:
    """Decide where the optimizer comes from (see the module docstring).

    Args:
        config: the validated DscoreConfig.
        registry: the runtime's :class:`dscore.registry.Registry`.
        client: ``initialize(optimizer=...)``: an optimizer instance, a callable, or None.

    Raises:
        ConfigError: ``optimizer.params`` holds ``max_grad_norm``; an offload-incompatible optimizer is
            used with ZeRO optimizer offload and ``zero_force_ds_cpu_optimizer`` is true; a client
            optimizer not known to be ZeRO-safe under ZeRO 1-3 without ``zero_allow_untested_optimizer``.
        ComponentNotFoundError: ``optimizer.type`` is not registered and no ``torch`` fallback exists.
    """
    import torch

    opt_cfg = getattr(config, "optimizer", None)
    offload = _offload_device(config) in ("cpu", "nvme")
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
    params = dict(opt_cfg.params or {})
    if "max_grad_norm" in params:
        raise ConfigError(
            "'max_grad_norm' is not supported as an optimizer parameter; use the top-level "
            "'gradient_clipping' key instead",
            path="optimizer.params.max_grad_norm",
        )
    spec, fallback = _lookup(registry, "optimizer", opt_cfg.type, "optimizer.type")
    assert isinstance(spec, OptimizerSpec)
    if offload and not spec.offload_capable and bool(getattr(config, "zero_force_ds_cpu_optimizer", True)):
        raise ConfigError(
            f"optimizer.type = {opt_cfg.type!r} cannot run with zero_optimization.offload_optimizer on the CPU/NVMe "
            "(its optimizer is not offload-capable). Choose an offload-capable optimizer (Adam, AdamW, Adagrad, "
            "Lion) or set zero_force_ds_cpu_optimizer: false to use it anyway.",
            path="optimizer.type",
        )
    factory = resolve(spec.offload_factory if offload and spec.offload_factory else spec.factory)
    type_name = opt_cfg.type

    def from_config(groups: list[dict[str, Any]]) -> Any:
        if fallback:
            return factory(groups, type_name=type_name, **params)
        return factory(groups, **params)

    desc = f"{type_name} ({'torch.optim fallback' if fallback else spec.name}{', offload variant' if offload and spec.offload_factory else ''})"
    return OptimizerChoice(factory=from_config, spec=spec, description=desc)


def check_offload_compatible(config: Any, registry: Any, cls: type) -> None:
    """Refuse a non offload-capable optimizer class under ZeRO optimizer offload (§4 of the reference).

    Raises:
        ConfigError: naming ``zero_force_ds_cpu_optimizer: false`` as the way out.
    """
    if not bool(getattr(config, "zero_force_ds_cpu_optimizer", True)):
        return
    if getattr(cls, "offload_capable", False):
        return
    for spec in registry.specs("optimizer"):
        if isinstance(spec, OptimizerSpec) and spec.offload_capable:
            try:
                built = resolve(spec.factory)
            except Exception:  # a broken optional optimizer cannot be the client's class
                continue
            if isinstance(built, type) and issubclass(cls, built):
                return
    raise ConfigError(
        f"the client optimizer {cls.__module__}.{cls.__name__} is not offload-capable, but "
        "zero_optimization.offload_optimizer puts optimizer states on the CPU/NVMe. Use an offload-capable "
        "optimizer (e.g. optimizer.type 'Adam' in the config) or set zero_force_ds_cpu_optimizer: false "
        "to run this one on CPU tensors anyway.",
        path="zero_force_ds_cpu_optimizer",
    )


# DeepSpeed's ZERO_SUPPORTED_OPTIMIZERS, by exact class (``type(opt) in ...``): torch's Adam, AdamW and
# Adagrad, plus the registered names of the fused / CPU optimizers DeepSpeed lists.
_ZERO_SUPPORTED_TORCH = ("Adam", "AdamW", "Adagrad")
_ZERO_SUPPORTED_SPECS = (
    "FusedAdam", "FusedLion", "DscoreCPUAdam", "DscoreCPUAdagrad", "DscoreCPULion",
)


def is_zero_supported(registry: Any, cls: type) -> bool:
    """True when ``cls`` is an optimizer class known to be correct over ZeRO partitions.

    Known: exactly ``torch.optim.Adam``/``AdamW``/``Adagrad``; the classes registered under
    DeepSpeed's fused/CPU names (``FusedAdam``, ``FusedLion``, ``DscoreCPUAdam``, ``DscoreCPUAdagrad``,
    ``DscoreCPULion``); any class with a true ``zero_supported`` class attribute (how a plugin
    declares an element-wise optimizer ZeRO-safe). Subclasses of torch's optimizers are *not* known, as in
    DeepSpeed (they may override ``step`` with cross-element logic).
    """
    import torch

    if getattr(cls, "zero_supported", False) is True:
        return True
    if any(cls is getattr(torch.optim, name) for name in _ZERO_SUPPORTED_TORCH):
        return True
    for name in _ZERO_SUPPORTED_SPECS:
        try:
            spec = registry.get("optimizer", name)
            built = resolve(spec.factory)
        except Exception:  # noqa: BLE001 - an optional optimizer that cannot load is not the client's class
            continue
        if built is cls:
            return True
    return False


def check_zero_supported(config: Any, registry: Any, cls: type) -> None:
    """Refuse a client optimizer class not known to be ZeRO-safe under ZeRO stages 1-3 (DeepSpeed
    ``_do_optimizer_sanity_check``) unless ``zero_allow_untested_optimizer: true``.

    Raises:
        ConfigError: naming ``zero_allow_untested_optimizer`` and the optimizer class.
    """
    stage = int(getattr(config, "zero_stage", 0) or 0)
    if stage == 0 or is_zero_supported(registry, cls):
        return
    if bool(getattr(config, "zero_allow_untested_optimizer", False)):
        log.warning(
            "ZeRO stage %d with the untested client optimizer %s.%s (zero_allow_untested_optimizer: true); "
            "proceed with caution", stage, cls.__module__, cls.__name__,
        )
        return
    raise ConfigError(
        f"the client optimizer {cls.__module__}.{cls.__name__} is not known to be correct under ZeRO stage {stage} "
        "(known: torch.optim.Adam, AdamW, Adagrad and dscore's fused/CPU Adam, Adagrad and Lion). Set "
        '"zero_allow_untested_optimizer": true in ds_config to use it anyway (element-wise optimizers such as '
        "SGD are safe), or use zero_optimization.stage 0",
        path="zero_allow_untested_optimizer",
    )


def build_lr_scheduler(config: Any, registry: Any, optimizer: Any, client: Any) -> Any:
    """Create the LR scheduler driving ``optimizer`` (see the module docstring), or None.

    Raises:
        ConfigError: the client scheduler is neither an object with ``step()`` nor a callable, is bound to
            another optimizer object, or has a different number of per-group learning rates.
        ComponentNotFoundError: ``scheduler.type`` is unknown and no ``torch`` fallback exists.
    """
    sched_cfg = getattr(config, "scheduler", None)
    if optimizer is None:
        if sched_cfg is not None or client is not None:
            log.warning("an LR scheduler was given but there is no optimizer; it is ignored (as in DeepSpeed)")
        return None
    if sched_cfg is not None:
        spec, fallback = _lookup(registry, "lr_scheduler", sched_cfg.type, "scheduler.type")
        assert isinstance(spec, LRSchedulerSpec)
        factory = resolve(spec.factory)
        params = dict(sched_cfg.params or {})
        if client is not None:
            log.warning(
                "both scheduler.type=%r and a client lr_scheduler were given; using the config's", sched_cfg.type
            )
        if fallback:
            return factory(optimizer, type_name=sched_cfg.type, **params)
        return factory(optimizer, **params)
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
