"""AutoTP training: ``tp_model_init``, the layer plan and the tensor-parallel ZeRO wrapper.

The machinery is the ``autotp`` model transform of the built-in ``parallel`` plugin; this module's names
resolve through the registry on first access (:func:`dscore.exports.thin_getattr`), so they follow
``DSCORE_DISABLE_PLUGINS=model_transform:autotp`` (then importing a name raises the error naming the unit).
"""

from __future__ import annotations

# ruff: noqa: F822 - the names of __all__ resolve through __getattr__ (a thin module)
from typing import Any

from dscore.exports import thin_getattr

__all__ = [
    "Rule",
    "TensorParallelStage",
    "TPBatchMismatchError",
    "apply_autotp",
    "check_tp_config",
    "plan_autotp",
    "remap_parameters",
    "split_groups_for_tp",
    "wrap_stage",
    "tp_model_init",
    "tp_params_of",
]

_resolve = thin_getattr(__name__, "model_transform", "autotp", __all__)


def __getattr__(name: str) -> Any:
    """Resolve one of ``__all__`` through the registry on first access (then a plain module attribute)."""
    return _resolve(name)
