"""The public contracts a dscore plugin implements or receives, in one place.

A plugin (built-in or third-party) is written against these names and the public modules they come
from — never against a private ``dscore.x._y`` module (an import contract checked in CI holds that line).
Importing this package imports neither torch nor any plugin: names resolve lazily on first access.

Kinds and their contracts:

* every kind: :func:`hookimpl` and the ``*Spec`` records (:mod:`dscore.specs`), the error types
  (:mod:`dscore.errors`), config section base types (:mod:`dscore.config.base`);
* ZeRO stage: :class:`ZeroStage`, :class:`ZeroStageContext`, :class:`StepOutcome` (:mod:`dscore.protocols.zero`);
  its building blocks: :class:`GradientReducer`, :class:`ReduceBucket` and the partition helpers (:mod:`dscore.zero`);
* factories of the optimizer, lr_scheduler, precision and monitor kinds: :class:`OptimizerContext`,
  :class:`SchedulerContext`, :class:`PrecisionContext`, :class:`MonitorContext` (all
  :class:`PluginContext`), :class:`OpaqueParams`, :class:`TorchClassParams` (:mod:`dscore.protocols.context`);
* precision: :class:`PrecisionMode`, :class:`LossScaler` (:mod:`dscore.protocols.precision`);
* engine: :class:`Engine`, :class:`EngineContext`, the base class :class:`DscoreEngine`
  (:mod:`dscore.protocols.engine`);
* model transform: :class:`ModelTransform`, :class:`PrepareContext`, :class:`TransformContext`,
  :class:`StageInputs`, :class:`VerifyContext` (:mod:`dscore.protocols.transform`);
* collectives: :class:`Comm` — every collective in dscore goes through it — and its async :class:`Work`
  handles (:mod:`dscore.comm`);
* checkpoint layout: :class:`CheckpointLayout`, :class:`CheckpointSaveState`, :class:`CheckpointLoadRequest`,
  :class:`LoadedCheckpoint` (:mod:`dscore.protocols.checkpoint`); building blocks in :mod:`dscore.persistence`;
* comm transport: :class:`Transport`, :class:`TransportContext` (:mod:`dscore.protocols.transport`);
* accelerator: :class:`Accelerator`, :class:`ProbeResult` (:mod:`dscore.accelerator`).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

# name -> "module:attribute"
_LAZY: dict[str, str] = {
    "hookimpl": "dscore.hookspecs:hookimpl",
    # ZeRO stage
    "ZeroStage": "dscore.protocols.zero:ZeroStage",
    "ZeroStageContext": "dscore.protocols.zero:ZeroStageContext",
    "StepOutcome": "dscore.protocols.zero:StepOutcome",
    "GradientReducer": "dscore.zero.reducer:GradientReducer",
    "ReduceBucket": "dscore.zero.reducer:ReduceBucket",
    # precision
    "PrecisionMode": "dscore.protocols.precision:PrecisionMode",
    "LossScaler": "dscore.protocols.precision:LossScaler",
    # per-kind factory contexts
    "PluginContext": "dscore.protocols.context:PluginContext",
    "OptimizerContext": "dscore.protocols.context:OptimizerContext",
    "SchedulerContext": "dscore.protocols.context:SchedulerContext",
    "PrecisionContext": "dscore.protocols.context:PrecisionContext",
    "MonitorContext": "dscore.protocols.context:MonitorContext",
    "OpaqueParams": "dscore.protocols.context:OpaqueParams",
    "TorchClassParams": "dscore.protocols.context:TorchClassParams",
    # engine
    "Engine": "dscore.protocols.engine:Engine",
    "EngineContext": "dscore.protocols.engine:EngineContext",
    "DscoreEngine": "dscore.runtime.engine:DscoreEngine",
    # checkpoint layouts
    "CheckpointLayout": "dscore.protocols.checkpoint:CheckpointLayout",
    "CheckpointLoadRequest": "dscore.protocols.checkpoint:CheckpointLoadRequest",
    "CheckpointSaveState": "dscore.protocols.checkpoint:CheckpointSaveState",
    "LoadedCheckpoint": "dscore.protocols.checkpoint:LoadedCheckpoint",
    # model transform
    "ModelTransform": "dscore.protocols.transform:ModelTransform",
    "PrepareContext": "dscore.protocols.transform:PrepareContext",
    "TransformContext": "dscore.protocols.transform:TransformContext",
    "StageInputs": "dscore.protocols.transform:StageInputs",
    "VerifyContext": "dscore.protocols.transform:VerifyContext",
    # collectives
    "Comm": "dscore.comm.facade:Comm",
    "Work": "dscore.comm.facade:Work",
    # comm transport
    "Transport": "dscore.protocols.transport:Transport",
    "TransportContext": "dscore.protocols.transport:TransportContext",
    # accelerator
    "Accelerator": "dscore.accelerator.base:Accelerator",
    "ProbeResult": "dscore.accelerator.base:ProbeResult",
}

__all__ = [
    "Accelerator",
    "CheckpointLayout",
    "CheckpointLoadRequest",
    "CheckpointSaveState",
    "Comm",
    "DscoreEngine",
    "Engine",
    "EngineContext",
    "GradientReducer",
    "LoadedCheckpoint",
    "LossScaler",
    "ModelTransform",
    "MonitorContext",
    "OpaqueParams",
    "OptimizerContext",
    "PluginContext",
    "PrecisionContext",
    "PrecisionMode",
    "PrepareContext",
    "ProbeResult",
    "ReduceBucket",
    "SchedulerContext",
    "StageInputs",
    "StepOutcome",
    "TorchClassParams",
    "TransformContext",
    "VerifyContext",
    "Transport",
    "TransportContext",
    "Work",
    "ZeroStage",
    "ZeroStageContext",
    "hookimpl",
]

if TYPE_CHECKING:  # pragma: no cover
    from dscore.accelerator.base import Accelerator, ProbeResult
    from dscore.comm.facade import Comm, Work
    from dscore.hookspecs import hookimpl
    from dscore.protocols.checkpoint import (
        CheckpointLayout,
        CheckpointLoadRequest,
        CheckpointSaveState,
        LoadedCheckpoint,
    )
    from dscore.protocols.context import (
        MonitorContext,
        OpaqueParams,
        OptimizerContext,
        PluginContext,
        PrecisionContext,
        SchedulerContext,
        TorchClassParams,
    )
    from dscore.protocols.engine import Engine, EngineContext
    from dscore.protocols.precision import LossScaler, PrecisionMode
    from dscore.protocols.transform import (
        ModelTransform,
        PrepareContext,
        StageInputs,
        TransformContext,
        VerifyContext,
    )
    from dscore.protocols.transport import Transport, TransportContext
    from dscore.protocols.zero import StepOutcome, ZeroStage, ZeroStageContext
    from dscore.runtime.engine import DscoreEngine
    from dscore.zero.reducer import GradientReducer, ReduceBucket


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'dscore.protocols' has no attribute {name!r}")
    module_name, _, attr = target.partition(":")
    value = getattr(import_module(module_name), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
