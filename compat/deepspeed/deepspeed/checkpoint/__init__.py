"""``deepspeed.checkpoint``: DeepSpeed 0.19.8's checkpoint constants and per-rank file names.

Every name of :mod:`deepspeed.checkpoint.constants` is here (as in DeepSpeed), and ``utils``'s
``get_model_ckpt_name_for_rank`` / ``get_zero_ckpt_name_for_rank`` / ``get_layer_ckpt_name_for_rank``
(imported on first use: they load torch). DeepSpeed's reshaping tools (``DeepSpeedCheckpoint``,
``ZeROCheckpoint``, ``model_3d_desc``, ``get_model_3d_descriptor``, ``reshape_meg_2d_parallel``,
``merge_state``) and the universal-checkpoint conversion (``ds_to_universal``, ``enable_universal_checkpoint``)
are not provided: dscore loads a DeepSpeed checkpoint directly at any world size and ZeRO stage
(``engine.load_checkpoint``; ``dscore.checkpoint.deepspeed.DeepSpeedCheckpoint`` describes one), so no
conversion step exists. Using one of them raises :class:`deepspeed._not_provided.NotProvidedError`.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from deepspeed._not_provided import not_provided
from deepspeed.checkpoint.constants import *  # noqa: F403 - DeepSpeed's package re-exports every constant
from deepspeed.checkpoint.constants import __all__ as _CONSTANTS

_RESHAPE = (
    "dscore loads a DeepSpeed checkpoint at any world size and ZeRO stage without reshaping it "
    "(engine.load_checkpoint); dscore.checkpoint.deepspeed.DeepSpeedCheckpoint describes a save directory"
)
_UNIVERSAL = (
    "dscore has no universal-checkpoint format: a DeepSpeed checkpoint loads directly at another world size "
    "or ZeRO stage (engine.load_checkpoint), so no ds_to_universal conversion is needed"
)
DeepSpeedCheckpoint = not_provided("deepspeed.checkpoint.DeepSpeedCheckpoint", _RESHAPE)
ZeROCheckpoint = not_provided("deepspeed.checkpoint.ZeROCheckpoint", _RESHAPE)
model_3d_desc = not_provided("deepspeed.checkpoint.model_3d_desc", _RESHAPE)
get_model_3d_descriptor = not_provided("deepspeed.checkpoint.get_model_3d_descriptor", _RESHAPE)
reshape_meg_2d_parallel = not_provided("deepspeed.checkpoint.reshape_meg_2d_parallel", _RESHAPE)
merge_state = not_provided("deepspeed.checkpoint.merge_state", _RESHAPE)
enable_universal_checkpoint = not_provided("deepspeed.checkpoint.enable_universal_checkpoint", _UNIVERSAL)
SubparamShape = not_provided("deepspeed.checkpoint.SubparamShape", _UNIVERSAL)

_UTILS = ("get_layer_ckpt_name_for_rank", "get_model_ckpt_name_for_rank", "get_zero_ckpt_name_for_rank")
_SUBMODULES = ("autoep_universal", "constants", "ds_to_universal", "universal_checkpoint", "utils")

__all__ = [  # noqa: PLE0604 - the constants' names are strings
    *_CONSTANTS, *_UTILS, *_SUBMODULES,
    "DeepSpeedCheckpoint", "SubparamShape", "ZeROCheckpoint", "enable_universal_checkpoint",
    "get_model_3d_descriptor", "merge_state", "model_3d_desc", "reshape_meg_2d_parallel",
]


def __getattr__(name: str) -> Any:
    if name in _UTILS:
        value = getattr(import_module("deepspeed.checkpoint.utils"), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return import_module(f"deepspeed.checkpoint.{name}")
    raise AttributeError(f"deepspeed.checkpoint.{name} is not provided by dscore's compatibility layer")
