"""``deepspeed.utils.zero_to_fp32``: consolidated fp32 weights of a checkpoint, read safely by dscore.

Works on DeepSpeed's layout (as saved by DeepSpeed or by this compatibility layer) and on dscore's own; the
files are read without running pickled code (:func:`dscore.checkpoint.get_fp32_state_dict_from_checkpoint`).
"""

from __future__ import annotations

import glob
import json
import os
import re
from typing import Any

from dscore.errors import CheckpointError

__all__ = [
    "convert_zero_checkpoint_to_fp32_state_dict",
    "convert_zero_checkpoint_to_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "get_model_state_file",
    "get_optim_files",
    "load_state_dict_from_zero_checkpoint",
    "to_torch_tensor",
]

# the ``dtype`` spellings the conversions accept (also with a ``torch.`` prefix, any case), as DeepSpeed 0.19.8;
# values are torch attribute names (torch is imported on use: ``import deepspeed`` stays light)
_DTYPE_NAMES = {
    "float32": "float32",
    "fp32": "float32",
    "float16": "float16",
    "fp16": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}


def _output_dtype(dtype: Any) -> Any:
    """``dtype`` (``torch.float32`` / ``float16`` / ``bfloat16`` or one of their names) as a torch dtype.

    Raises:
        dscore.errors.CheckpointError: any other value (the valid names are listed).
    """
    import torch

    valid = {getattr(torch, n) for n in _DTYPE_NAMES.values()}
    resolved = dtype
    if isinstance(dtype, str):
        name = dtype[len("torch.") :] if dtype.startswith("torch.") else dtype
        attr = _DTYPE_NAMES.get(name.lower())
        resolved = getattr(torch, attr) if attr else None
    if resolved not in valid:
        raise CheckpointError(
            f"unsupported output dtype {dtype!r} for deepspeed.utils.zero_to_fp32; choose one of "
            f"{', '.join(sorted(_DTYPE_NAMES))} (or the torch dtype)"
        )
    return resolved


def _frozen_names(checkpoint_dir: str, tag: str | None) -> set[str]:
    """Names of the parameters a DeepSpeed-layout checkpoint records as frozen (``frozen_param_shapes`` of its
    model-states file; the native layout does not record which parameters were frozen, so it is refused)."""
    from dscore.checkpoint import deepspeed as ds_ckpt

    if not ds_ckpt.is_deepspeed_checkpoint(checkpoint_dir, tag):
        raise CheckpointError(
            f"exclude_frozen_parameters=True needs a checkpoint in DeepSpeed's layout (it records which parameters were "
            f"frozen); {checkpoint_dir} is in dscore's native layout: save with "
            "engine.save_checkpoint(dir, exclude_frozen_parameters=True) instead"
        )
    resolved = ds_ckpt.resolve_deepspeed_tag(checkpoint_dir, tag)
    tag_dir = os.path.join(checkpoint_dir, str(resolved))
    names: set[str] = set()
    for path in sorted(glob.glob(os.path.join(tag_dir, "*model_states.pt"))):
        if os.path.basename(path).startswith("layer_"):  # MoE expert files hold no frozen-parameter list
            continue
        states = ds_ckpt.safe_load(path)
        names.update(str(k) for k in (states.get("frozen_param_shapes") or {}))
    return names


def to_torch_tensor(state_dict: dict[str, Any], return_empty_tensor: bool = False, dtype: Any = None) -> dict[str, Any]:
    """A copy of ``state_dict`` whose values are contiguous tensors: entries that are one object (tied weights) stay
    one tensor; floating-point ones are cast to ``dtype`` when given (other dtypes keep theirs).

    Args:
        state_dict: name -> tensor (or any object with ``contiguous()``, ``shape`` and ``dtype``).
        return_empty_tensor: give uninitialised tensors of the output shape and dtype (to size shards).
        dtype: the floating-point output dtype (see ``float32``/``fp32``/``float16``/``fp16``/``bfloat16``/``bf16``), or None to keep each one's.

    Raises:
        dscore.errors.CheckpointError: an unsupported ``dtype``.
    """
    import torch

    target = None if dtype is None else _output_dtype(dtype)
    out: dict[str, Any] = {}
    first_name: dict[int, str] = {}
    for name, value in state_dict.items():
        if id(value) in first_name:  # tied: the same output tensor under both names
            out[name] = out[first_name[id(value)]]
            continue
        first_name[id(value)] = name
        cast = target if target is not None and value.dtype.is_floating_point else None
        if return_empty_tensor:
            out[name] = torch.empty(tuple(value.shape), dtype=cast or value.dtype, device="cpu")
        else:
            tensor = value.contiguous()
            out[name] = tensor.to(dtype=cast) if cast is not None else tensor
    return out


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    lazy_mode: bool = False,
) -> dict[str, Any]:
    """The full state dict with fp32 floating-point tensors on CPU; tied parameters are one tensor under each name.

    Args:
        checkpoint_dir: the directory given to ``save_checkpoint`` (DeepSpeed's layout, or dscore's).
        tag: the tag; None reads ``latest``.
        exclude_frozen_parameters: leave out the parameters the checkpoint records as frozen (DeepSpeed's layout).
        lazy_mode: DeepSpeed returns placeholders whose ``contiguous()`` gives each tensor; dscore reads the
            consolidated tensors at once, so the values are already tensors (``contiguous()`` works on them the
            same) and no memory is saved.

    Raises:
        dscore.errors.CheckpointError: an unreadable or incomplete checkpoint (see
            :func:`dscore.checkpoint.get_fp32_state_dict_from_checkpoint`), or ``exclude_frozen_parameters`` on a
            checkpoint in dscore's native layout. dscore.errors.CheckpointNotFoundError: no such directory, tag or
            ``latest``.
    """
    from dscore.checkpoint import get_fp32_state_dict_from_checkpoint

    checkpoint_dir = os.fspath(checkpoint_dir)
    state = dict(get_fp32_state_dict_from_checkpoint(checkpoint_dir, tag))
    if exclude_frozen_parameters:
        frozen = _frozen_names(checkpoint_dir, tag)
        state = {k: v for k, v in state.items() if k not in frozen}
    return state


def convert_zero_checkpoint_to_state_dict(
    checkpoint_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    dtype: Any = "float32",
    max_shard_size: int | str | None = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> None:
    """Write a checkpoint's consolidated weights as a ``state_dict`` file set under ``output_dir``.

    ``pytorch_model.bin`` (``torch.save``; tied weights stay one tensor, so ``torch.load`` gives one object for
    both names) or, with ``safe_serialization``, ``model.safetensors``. Above ``max_shard_size`` (bytes, or a
    size such as ``"5GB"``, split as Hugging Face does) the files are ``pytorch_model-00001-of-0000N.bin`` /
    ``model-00001-of-0000N.safetensors`` plus ``pytorch_model.bin.index.json`` / ``model.safetensors.index.json``
    (``{"metadata": {"total_size": bytes}, "weight_map": {name: file}}``); None never shards.

    Args:
        dtype: floating-point output dtype: ``torch.float32`` / ``float16`` / ``bfloat16`` or a name of
            ``float32``/``fp32``/``float16``/``fp16``/``bfloat16``/``bf16``; integer and bool buffers keep their dtype.
            Default float32 (DeepSpeed's default ``torch.float32``).
        tag, exclude_frozen_parameters: as :func:`get_fp32_state_dict_from_zero_checkpoint`.

    Raises:
        dscore.errors.CheckpointError: an unsupported ``dtype``; ``max_shard_size`` without ``huggingface_hub``
            installed (it computes the split); tied weights with ``safe_serialization`` (safetensors cannot hold
            shared tensors); see :func:`get_fp32_state_dict_from_zero_checkpoint`.
    """
    import torch

    target = _output_dtype(dtype)
    split = None
    if max_shard_size is not None:
        try:
            from huggingface_hub import split_torch_state_dict_into_shards
        except ImportError as e:
            raise CheckpointError(
                "convert_zero_checkpoint_to_state_dict(max_shard_size=...) needs huggingface_hub (pip install "
                "huggingface_hub), or pass max_shard_size=None for one unsharded file"
            ) from e
        split = split_torch_state_dict_into_shards
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    weights_name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    if safe_serialization:
        names_of: dict[int, list[str]] = {}
        for name, value in state.items():
            names_of.setdefault(id(value), []).append(name)
        tied = [names for names in names_of.values() if len(names) > 1]
        if tied:
            raise CheckpointError(
                f"safe_serialization=True cannot write tied weights ({', '.join(' = '.join(t) for t in tied)}): "
                "safetensors holds no shared tensors; use safe_serialization=False (pytorch_model.bin)"
            )
    if split is not None:
        pattern = weights_name.replace(".bin", "{suffix}.bin").replace(".safetensors", "{suffix}.safetensors")
        plan = split(
            to_torch_tensor(state, return_empty_tensor=True, dtype=target),
            filename_pattern=pattern,
            max_shard_size=max_shard_size,
        )
        files, sharded = plan.filename_to_tensors, plan.is_sharded
    else:
        files, sharded = {weights_name: list(state)}, False
    out_dir = os.fspath(output_dir)
    os.makedirs(out_dir, exist_ok=True)
    for file_name, names in files.items():
        shard = to_torch_tensor({n: state[n] for n in names}, dtype=target)
        path = os.path.join(out_dir, file_name)
        if safe_serialization:
            from safetensors.torch import save_file

            save_file(shard, path, metadata={"format": "pt"})
        else:
            torch.save(shard, path)
        for n in names:  # release each shard's tensors once written
            del state[n]
    if sharded:
        index_name = "model.safetensors.index.json" if safe_serialization else "pytorch_model.bin.index.json"
        index = {"metadata": plan.metadata, "weight_map": plan.tensor_to_filename}
        with open(os.path.join(out_dir, index_name), "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    max_shard_size: int | str | None = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> None:
    """:func:`convert_zero_checkpoint_to_state_dict` with ``dtype=torch.float32`` (DeepSpeed's older name):
    ``<output_dir>/pytorch_model.bin`` (or shards and an index) by default, ``model.safetensors`` with
    ``safe_serialization``. Raises as that function."""
    convert_zero_checkpoint_to_state_dict(
        checkpoint_dir,
        output_dir,
        dtype="float32",
        max_shard_size=max_shard_size,
        safe_serialization=safe_serialization,
        tag=tag,
        exclude_frozen_parameters=exclude_frozen_parameters,
    )


def load_state_dict_from_zero_checkpoint(
    model: Any, checkpoint_dir: str | os.PathLike[str], tag: str | None = None
) -> Any:
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
