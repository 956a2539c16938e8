"""Typed per-kind contexts: what dscore hands a component factory.

Every factory of the optimizer, LR scheduler, precision and monitor kinds receives one context object
instead of raw dicts or ``**params``:

* ``config`` — the validated :class:`~dscore.config.model.DscoreConfig` of this run;
* ``section`` — the component's *own* validated model: ``optimizer.params`` validated by the spec's
  ``params_model``, ``scheduler.params`` likewise, the ``fp16``/``bf16`` block of a precision mode, the
  ``csv_monitor``/``tensorboard``/``wandb`` block of a monitor. Defaults live once, in these models;
  a factory reads ``ctx.section.lr``, never ``params.get("lr", 1e-3)``;
* ``runtime`` — the :class:`~dscore.runtime.runtime.Runtime` of this ``initialize`` (accelerator,
  comm, rank/world size in ``runtime.env``, the registry for op builders);
* ``path`` — the dotted config path of ``section`` (``"optimizer.params"``), for error messages.

Factory signatures (the registration specs in :mod:`dscore.specs` name the factories):

* optimizer: ``factory(param_groups: list[dict], ctx: OptimizerContext[ParamsModel]) -> torch.optim.Optimizer``
* lr_scheduler: ``factory(optimizer, ctx: SchedulerContext[ParamsModel])`` -> a scheduler
* precision: ``factory(ctx: PrecisionContext[SectionModel | None]) -> PrecisionMode``
* monitor: ``factory(ctx: MonitorContext[SectionModel])`` -> an object with ``write_events`` and ``close``

A spec without a ``params_model`` receives :class:`OpaqueParams` (the dict as written); the ``torch``
fallback specs receive :class:`TorchClassParams` (the class name as written plus its arguments, which
torch itself checks). This module imports neither torch nor any plugin.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from dscore.config.model import DscoreConfig
    from dscore.runtime.runtime import Runtime

__all__ = [
    "MonitorContext",
    "OpaqueParams",
    "OptimizerContext",
    "PluginContext",
    "PrecisionContext",
    "SchedulerContext",
    "SectionT",
    "TorchClassParams",
]

#: the type of a context's ``section`` (a pydantic model, or None for a component without a block)
SectionT = TypeVar("SectionT", covariant=True)


@dataclass(frozen=True, kw_only=True)
class PluginContext(Generic[SectionT]):
    """What every component factory receives (see the module docstring).

    Attributes:
        config: the validated ds_config of this run.
        section: the component's own validated section / params model.
        runtime: the runtime of this ``initialize`` (accelerator, comm, registry, ``env.rank``).
        path: dotted config path of ``section`` (``"optimizer.params"``, ``"fp16"``); ``""`` when the
            component reads no block.
    """

    config: DscoreConfig
    section: SectionT
    runtime: Runtime
    path: str = ""

    def key(self, name: str) -> str:
        """The dotted config path of field ``name`` of the section (``"optimizer.params.betas"``)."""
        return f"{self.path}.{name}" if self.path else name


@dataclass(frozen=True, kw_only=True)
class OptimizerContext(PluginContext[SectionT]):
    """Context of an optimizer factory.

    Attributes:
        offload: True when ZeRO optimizer offload to the CPU or NVMe is on
            (``zero_optimization.offload_optimizer.device`` in ``{cpu, nvme}``): the parameters the
            optimizer receives are fp32 CPU partitions. The spec's ``offload_factory`` (when it has
            one) is the factory called then.
    """

    offload: bool = False


@dataclass(frozen=True, kw_only=True)
class SchedulerContext(PluginContext[SectionT]):
    """Context of an LR scheduler factory (``section``: the validated ``scheduler.params``)."""


@dataclass(frozen=True, kw_only=True)
class PrecisionContext(PluginContext[SectionT]):
    """Context of a precision-mode factory (``section``: the ``config_key`` block, None for the default)."""


@dataclass(frozen=True, kw_only=True)
class MonitorContext(PluginContext[SectionT]):
    """Context of a monitor factory (``section``: the monitor's ``config_key`` block)."""

    @property
    def rank(self) -> int:
        """Global rank of this process (only rank 0 writes, as DeepSpeed's monitors)."""
        return int(self.runtime.env.rank)


class OpaqueParams(BaseModel):
    """``params`` of a component whose spec declares no ``params_model``: the mapping as written.

    The component validates it itself (and should raise :class:`~dscore.errors.ConfigError` with the
    context's ``path``). A spec with a ``params_model`` never receives this.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    params: dict[str, Any] = Field(default_factory=dict)
    """The ``optimizer.params`` / ``scheduler.params`` mapping exactly as the config holds it."""


class TorchClassParams(OpaqueParams):
    """Section of the ``torch`` fallback specs: any ``torch.optim`` (or ``torch.optim.lr_scheduler``) class.

    dscore calls the spec named ``"torch"`` with this when ``optimizer.type`` (``scheduler.type``) is not
    a registered name, as DeepSpeed's ``getattr(torch.optim, type)``; torch checks the arguments.
    """

    type_name: str
    """The ``type`` as written in the config (``"RMSprop"``)."""
