"""``deepspeed.checkpoint.utils``: DeepSpeed 0.19.8's checkpoint file names per rank and
``clone_tensors_for_torch_save``.

The file names are those dscore's ``deepspeed`` checkpoint layout reads and writes
(``save_checkpoint(..., layout="deepspeed")``): ``mp_rank_<mp>_model_states.pt``,
``zero_pp_rank_<dp>_mp_rank_<mp:02d>_optim_states.pt`` and the pipeline layers' ``layer_<id>-model_<tp:02d>_model_states.pt``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from deepspeed.checkpoint.constants import MODEL_FILE_PREFIX, MODEL_FILE_SUFFIX, OPTIM_FILE_SUFFIX, ZERO_FILE_PREFIX

__all__ = [
    "clone_tensors_for_torch_save",
    "get_layer_ckpt_name_for_rank",
    "get_model_ckpt_name_for_rank",
    "get_zero_ckpt_name_for_rank",
]


def get_model_ckpt_name_for_rank(base_folder: str | os.PathLike[str], mp_rank_str: str) -> str:
    """The model-states file of model-parallel rank ``mp_rank_str`` (already formatted, e.g. ``"00"``) in
    ``base_folder`` (a tag directory): ``<base_folder>/mp_rank_<mp_rank_str>_model_states.pt``."""
    return os.path.join(base_folder, f"{MODEL_FILE_PREFIX}{mp_rank_str}{MODEL_FILE_SUFFIX}")


def get_zero_ckpt_name_for_rank(base_folder: str | os.PathLike[str], dp_rank: int, mp_rank: int) -> str:
    """The ZeRO optimizer-states file of data-parallel rank ``dp_rank`` and model-parallel rank ``mp_rank``:
    ``<base_folder>/zero_pp_rank_<dp_rank>_mp_rank_<mp_rank:02d>_optim_states.pt`` (without the ``bf16_``
    prefix DeepSpeed's bf16 optimizer adds)."""
    return os.path.join(base_folder, f"{ZERO_FILE_PREFIX}{dp_rank}_{MODEL_FILE_PREFIX}{mp_rank:02d}{OPTIM_FILE_SUFFIX}")


def get_layer_ckpt_name_for_rank(base_folder: str | os.PathLike[str], layer_id: str, tp_rank: int) -> str:
    """A pipeline layer's file: ``<base_folder>/<layer_id>-model_<tp_rank:02d>_model_states.pt``; ``layer_id``
    is the formatted prefix DeepSpeed passes (``"layer_01"``)."""
    return os.path.join(base_folder, f"{layer_id}-model_{tp_rank:02d}{MODEL_FILE_SUFFIX}")


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = "cpu") -> Any:
    """Copy every tensor of a (nested list/tuple/dict) value to ``device`` as a compact tensor of its own,
    so ``torch.save`` writes only its elements (a view of a large flat buffer would save the whole buffer).
    Other values are returned as they are."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)((k, clone_tensors_for_torch_save(v, device)) for k, v in item.items())
    return item
