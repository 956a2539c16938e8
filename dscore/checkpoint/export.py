"""Consolidated weights from a checkpoint without a process group (DeepSpeed's ``zero_to_fp32`` job).

A DeepSpeed save directory is recognised and consolidated from its ZeRO shards directly (streamed one
shard at a time; see :mod:`dscore.checkpoint.deepspeed`).

Because :func:`dscore.checkpoint.save_checkpoint` stores full (gathered) tensors, consolidation is a read:
the fp32 weight of a parameter is the optimizer's fp32 master copy when the ZeRO stage keeps one
(``fp32_params`` in the optimizer state: fp16/bf16 training), otherwise the module's own tensor cast to
fp32. Buffers and non-floating-point entries come from the module state unchanged.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from typing import Any

import torch

from dscore.checkpoint import _layout as L
from dscore.checkpoint._tensorfile import read_tensor_file, write_tensor_file
from dscore.checkpoint._tree import decode
from dscore.errors import CheckpointError, CheckpointNotFoundError

__all__ = ["DTYPES", "convert_checkpoint", "describe_checkpoints", "get_fp32_state_dict_from_checkpoint"]

logger = logging.getLogger("dscore.checkpoint")

#: ``--dtype`` choices.
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _tag_dir(checkpoint_dir: str, tag: str | None, what: str) -> str:
    resolved = L.resolve_tag(checkpoint_dir, tag, what=what)
    if resolved is None:
        raise CheckpointNotFoundError(
            f"{checkpoint_dir} has no '{L.LATEST_FILE}' file; pass a tag (tags present: "
            f"{L.tags_present_text(checkpoint_dir)})"
        )
    return os.path.join(checkpoint_dir, resolved)


def get_fp32_state_dict_from_checkpoint(
    checkpoint_dir: str | os.PathLike[str], tag: str | None = None
) -> dict[str, torch.Tensor]:
    """The full model state dict of a checkpoint with floating-point tensors in fp32 (on CPU).

    Args:
        checkpoint_dir: the directory given to ``save_checkpoint`` (dscore's or DeepSpeed's).
        tag: the tag; None reads ``latest``.

    Raises:
        CheckpointNotFoundError: no such directory, tag, ``latest`` or file.
        CheckpointError: the checkpoint is incomplete or malformed.
    """
    checkpoint_dir = os.path.abspath(os.fspath(checkpoint_dir))
    from dscore.checkpoint import deepspeed as ds

    if ds.is_deepspeed_checkpoint(checkpoint_dir, tag):
        return ds.get_fp32_state_dict_from_deepspeed(checkpoint_dir, tag)
    tag_dir = _tag_dir(checkpoint_dir, tag, "dscore checkpoint export")
    module, _ = read_tensor_file(os.path.join(tag_dir, L.MODEL_FILE))
    masters: dict[str, Any] = {}
    o_path = os.path.join(tag_dir, L.OPTIM_FILE)
    if os.path.exists(o_path):
        o_tensors, o_meta = read_tensor_file(o_path)
        if "optim" in o_meta:
            optim = decode(json.loads(o_meta["optim"]), o_tensors, source=o_path)
            if isinstance(optim, dict) and isinstance(optim.get("fp32_params"), dict):
                masters = optim["fp32_params"]
    out: dict[str, torch.Tensor] = {}
    for name, t in module.items():
        if not t.is_floating_point():
            out[name] = t
            continue
        master = masters.get(name)
        if isinstance(master, torch.Tensor):
            if tuple(master.shape) != tuple(t.shape):
                raise CheckpointError(
                    f"{o_path}: fp32 master of {name!r} has shape {tuple(master.shape)} but the module tensor in "
                    f"{L.MODEL_FILE} has {tuple(t.shape)}"
                )
            out[name] = master.to(torch.float32)
        else:
            out[name] = t.to(torch.float32)
    return out


def convert_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    output: str | os.PathLike[str],
    tag: str | None = None,
    dtype: str = "fp32",
) -> str:
    """Write one consolidated safetensors file of the full model (no process group needed).

    Args:
        checkpoint_dir: the directory given to ``save_checkpoint``.
        output: the output file; when it is an existing directory, ``<output>/model.safetensors``.
        tag: the tag; None reads ``latest``.
        dtype: ``"fp32"``, ``"bf16"`` or ``"fp16"``: floating-point tensors are cast to it.

    Returns:
        The path written (atomically: temporary name, then rename).

    Raises:
        CheckpointError: unknown ``dtype``; see :func:`get_fp32_state_dict_from_checkpoint`.
    """
    if dtype not in DTYPES:
        raise CheckpointError(f"unknown export dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    from dscore.checkpoint import deepspeed as ds

    if ds.is_deepspeed_checkpoint(os.fspath(checkpoint_dir), tag):  # streamed, one shard at a time
        return ds.export_fp32(checkpoint_dir, output, tag=tag, dtype=dtype)
    state = get_fp32_state_dict_from_checkpoint(checkpoint_dir, tag)
    target = DTYPES[dtype]
    state = {k: (v.to(target) if v.is_floating_point() else v) for k, v in state.items()}
    out = os.path.abspath(os.fspath(output))
    if os.path.isdir(out):
        out = os.path.join(out, "model.safetensors")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = f"{out}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        write_tensor_file(tmp, state, {"format": "pt"}, fsync=L.durable())
        os.replace(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    L.fsync_dir(os.path.dirname(out))
    logger.info("wrote %d tensors (%s) to %s", len(state), dtype, out)
    return out


def describe_checkpoints(checkpoint_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Summary of a save directory: ``{"dir", "latest", "tags": [{"tag", "complete", "world_size",
    "zero_stage", "global_steps", "bytes"}]}`` (sizes in bytes; unknown values None).

    Raises:
        CheckpointNotFoundError: the directory does not exist.
        CheckpointError: it is not a directory.
    """
    d = os.path.abspath(os.fspath(checkpoint_dir))
    if not os.path.exists(d):
        raise CheckpointNotFoundError(f"checkpoint directory {d} does not exist")
    if not os.path.isdir(d):
        raise CheckpointError(f"{d} is not a directory")
    tags = []
    for tag, complete in L.list_tags(d):
        manifest = L.read_manifest(os.path.join(d, tag)) or {}
        files = manifest.get("files", {})
        tags.append(
            {
                "tag": tag,
                "complete": complete,
                "world_size": manifest.get("world_size"),
                "zero_stage": manifest.get("zero_stage"),
                "global_steps": manifest.get("global_steps"),
                "bytes": sum(int(f["bytes"]) for f in files.values()) if files else None,
            }
        )
    return {"dir": d, "latest": L.read_latest(d), "tags": tags}
