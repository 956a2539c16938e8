"""The public contracts a dscore plugin implements or receives, in one place.

A plugin (built-in or third-party) is written against these names and the public modules they come
from — never against a private ``dscore.x._y`` module (an import contract checked in CI holds that line).
Importing this package imports neither torch nor any plugin: names resolve lazily on first access.

Kinds and their contracts:

* every kind: :func:`hookimpl` and the ``*Spec`` records (:mod:`dscore.specs`), the error types
  (:mod:`dscore.errors`), config section base types (:mod:`dscore.config.base`);
* ZeRO stage: :class:`ZeroStage`, :class:`ZeroStageContext`, :class:`StepOutcome` (:mod:`dscore.protocols.zero`);
* precision: :class:`PrecisionMode`, :class:`LossScaler` (:mod:`dscore.protocols.precision`);
* collectives: :class:`Comm` — every collective in dscore goes through it (:mod:`dscore.comm`);
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
    # precision
    "PrecisionMode": "dscore.protocols.precision:PrecisionMode",
    "LossScaler": "dscore.protocols.precision:LossScaler",
    # collectives
    "Comm": "dscore.comm.facade:Comm",
    # accelerator
    "Accelerator": "dscore.accelerator.base:Accelerator",
    "ProbeResult": "dscore.accelerator.base:ProbeResult",
}

__all__ = [
    "Accelerator",
    "Comm",
    "LossScaler",
    "PrecisionMode",
    "ProbeResult",
    "StepOutcome",
    "ZeroStage",
    "ZeroStageContext",
    "hookimpl",
]

if TYPE_CHECKING:  # pragma: no cover
    from dscore.accelerator.base import Accelerator, ProbeResult
    from dscore.comm.facade import Comm
    from dscore.hookspecs import hookimpl
    from dscore.protocols.precision import LossScaler, PrecisionMode
    from dscore.protocols.zero import StepOutcome, ZeroStage, ZeroStageContext


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
