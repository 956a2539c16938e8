"""AutoTP training (the ``autotp`` model transform's machinery and the names ``dscore.parallel.autotp`` exports).

* :mod:`.plan`: which layers split and how, the split itself (:func:`apply_autotp`), ``tp_model_init``;
* :mod:`.stage`: :class:`TensorParallelStage`, the ZeRO wrapper for the model-wide gradient norm (overflow verdict,
  clipping, reported norm) and full-tensor checkpoints.

Importing this package imports torch; the transform object (:mod:`dscore_plugins.parallel.transforms`) does not.
"""

from __future__ import annotations

from dscore_plugins.parallel.autotp.plan import (
    Rule,
    TPBatchMismatchError,
    apply_autotp,
    check_tp_config,
    plan_autotp,
    remap_parameters,
    tp_model_init,
    tp_params_of,
)
from dscore_plugins.parallel.autotp.stage import TensorParallelStage, split_groups_for_tp, wrap_stage

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
