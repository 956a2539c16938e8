"""``deepspeed.utils.zero_to_fp32``: consolidated fp32 weights of a checkpoint, read safely by dscore.

Works on DeepSpeed's layout (as saved by DeepSpeed or by this compatibility layer) and on dscore's own; the
files are read without running pickled code (:func:`dscore.checkpoint.get_fp32_state_dict_from_checkpoint`).
"""

from __future__ import annotations

import glob
import os
import re
from typing import Any

__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "get_model_state_file",
    "get_optim_files",
    "load_state_dict_from_zero_checkpoint",
]


def _refuse(name: str, what: str) -> None:
    from dscore.errors import CheckpointError

    raise CheckpointError(f"deepspeed.utils.zero_to_fp32.{name}({what}) is not supported by dscore's compatibility layer")


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str, tag: str | None = None, exclude_frozen_parameters: bool = False, lazy_mode: bool = False
) -> dict[str, Any]:
    """The full state dict with fp32 floating-point tensors on CPU (tag None: ``latest``).

    Raises:
        dscore.errors.CheckpointError: ``exclude_frozen_parameters`` or ``lazy_mode`` (not supported), or an
            unreadable / incomplete checkpoint (see :func:`dscore.checkpoint.get_fp32_state_dict_from_checkpoint`).
    """
    if exclude_frozen_parameters:
        _refuse("get_fp32_state_dict_from_zero_checkpoint", "exclude_frozen_parameters=True")
    if lazy_mode:
        _refuse("get_fp32_state_dict_from_zero_checkpoint", "lazy_mode=True")
    from dscore.checkpoint import get_fp32_state_dict_from_checkpoint

    return dict(get_fp32_state_dict_from_checkpoint(checkpoint_dir, tag))


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str, output_dir: str, tag: str | None = None, exclude_frozen_parameters: bool = False, **kwargs: Any
) -> None:
    """Write the consolidated fp32 weights as ``<output_dir>/model.safetensors`` (only safetensors output;
    ``max_shard_size`` and ``safe_serialization=False`` are refused)."""
    if kwargs.get("safe_serialization") is False or kwargs.get("max_shard_size") not in (None, "5GB"):
        _refuse("convert_zero_checkpoint_to_fp32_state_dict", "safe_serialization=False / max_shard_size")
    from safetensors.torch import save_file

    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    os.makedirs(output_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(output_dir, "model.safetensors"))


def load_state_dict_from_zero_checkpoint(model: Any, checkpoint_dir: str, tag: str | None = None) -> Any:
    """Load the consolidated fp32 weights into ``model`` (moved to CPU first, as DeepSpeed) and return it."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def get_model_state_file(checkpoint_dir: str, zero_stage: int) -> str:
    """The model-states file of a DeepSpeed tag directory (ZeRO-3: rank 0's).

    Raises:
        FileNotFoundError: the directory or the file does not exist.
    """
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"Directory '{checkpoint_dir}' doesn't exist")
    name = "zero_pp_rank_0_mp_rank_00_model_states.pt" if zero_stage >= 3 else "mp_rank_00_model_states.pt"
    path = os.path.join(checkpoint_dir, name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"can't find model states file at '{path}'")
    return path


def get_optim_files(checkpoint_dir: str) -> list[str]:
    """The optimizer-state files of a DeepSpeed tag directory, in rank order.

    Raises:
        FileNotFoundError: none found.
    """
    files = glob.glob(os.path.join(checkpoint_dir, "*_optim_states.pt"))
    if not files:
        raise FileNotFoundError(f"can't find '*_optim_states.pt' files in directory '{checkpoint_dir}'")

    def key(path: str) -> list[Any]:
        return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", os.path.basename(path))]

    return sorted(files, key=key)
