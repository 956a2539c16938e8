"""Consolidated weights from a checkpoint without a process group (DeepSpeed's ``zero_to_fp32`` job), the
16-bit model export, ``dscore checkpoint import`` and ``list``, for any registered layout.

The save directory's layout is detected as at load (:func:`dscore.persistence.layouts.layout_for_load`):
a DeepSpeed save directory is consolidated from its ZeRO shards by the ``deepspeed`` layout (streamed one
shard at a time). Because :func:`dscore.persistence.save_checkpoint` stores full (gathered) tensors in the
native layout, consolidation there is a read: the fp32 weight of a parameter is the optimizer's fp32
master copy when the ZeRO stage keeps one (``fp32_params`` in the optimizer state: fp16/bf16 training),
otherwise the module's own tensor cast to fp32. Buffers and non-floating-point entries come from the
module state unchanged.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Any

import torch

from dscore.comm.guard import ensure_all_arrived
from dscore.errors import CheckpointError, CheckpointNotFoundError
from dscore.persistence import layouts
from dscore.persistence import savedir as S
from dscore.persistence._engine_view import EngineView
from dscore.persistence.tensorfile import write_tensor_file

__all__ = [
    "DTYPES",
    "convert_checkpoint",
    "describe_checkpoints",
    "get_fp32_state_dict_from_checkpoint",
    "import_checkpoint",
    "save_16bit_model",
]

logger = logging.getLogger("dscore.checkpoint")

#: ``--dtype`` choices.
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _registry() -> Any:
    from dscore.exports import active_registry

    return active_registry()[0]


def get_fp32_state_dict_from_checkpoint(
    checkpoint_dir: str | os.PathLike[str], tag: str | None = None
) -> dict[str, torch.Tensor]:
    """The full model state dict of a checkpoint with floating-point tensors in fp32 (on CPU).

    Args:
        checkpoint_dir: the directory given to ``save_checkpoint`` (dscore's or DeepSpeed's, or any
            registered layout's).
        tag: the tag; None reads ``latest``.

    Raises:
        CheckpointNotFoundError: no such directory, tag, ``latest`` or file.
        CheckpointError: the checkpoint is incomplete or malformed, or its layout is disabled (named).
    """
    checkpoint_dir = os.path.abspath(os.fspath(checkpoint_dir))
    _, impl = layouts.layout_for_load(_registry(), checkpoint_dir, tag)
    return dict(impl.fp32_state_dict(checkpoint_dir, tag))


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
    source = os.path.abspath(os.fspath(checkpoint_dir))
    _, impl = layouts.layout_for_load(_registry(), source, tag)
    export_weights = getattr(impl, "export_weights", None)
    if callable(export_weights):  # e.g. DeepSpeed's: streamed, one shard at a time
        return str(export_weights(source, output, tag, dtype))
    state = impl.fp32_state_dict(source, tag)
    target = DTYPES[dtype]
    state = {k: (v.to(target) if v.is_floating_point() else v) for k, v in state.items()}
    out = os.path.abspath(os.fspath(output))
    if os.path.isdir(out):
        out = os.path.join(out, "model.safetensors")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = f"{out}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        write_tensor_file(tmp, state, {"format": "pt"}, fsync=S.durable())
        os.replace(tmp, out)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    S.fsync_dir(os.path.dirname(out))
    logger.info("wrote %d tensors (%s) to %s", len(state), dtype, out)
    return out


def import_checkpoint(src_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], tag: str | None = None) -> str:
    """Convert a save directory in another layout (DeepSpeed's) into the native layout under ``out_dir``
    (``dscore checkpoint import``). Returns the tag directory written.

    Raises:
        CheckpointError: ``src_dir`` is in the native layout already, or its layout has no import (named), or
            its layout is disabled; CheckpointNotFoundError: no such directory or tag.
    """
    source = os.path.abspath(os.fspath(src_dir))
    name, impl = layouts.layout_for_load(_registry(), source, tag)
    importer = getattr(impl, "import_checkpoint", None)
    if name == layouts.NATIVE or not callable(importer):
        raise CheckpointError(
            f"{src_dir} is not a DeepSpeed save directory (its layout is {name!r}, which `dscore checkpoint import` "
            "does not convert); `dscore checkpoint import` converts DeepSpeed checkpoints and other layouts that "
            "declare an import (dscore checkpoints need no import)"
        )
    return str(importer(source, os.fspath(out_dir), tag))


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
    for tag, complete in S.list_tags(d):
        manifest = S.read_manifest(os.path.join(d, tag)) or {}
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
    return {"dir": d, "latest": S.read_latest(d), "tags": tags}


def save_16bit_model(engine: Any, save_dir: str | os.PathLike[str], save_filename: str = "pytorch_model.bin") -> bool:
    """Write the full module state dict in the engine's compute dtype to ``<save_dir>/<save_filename>``.

    Every rank calls this (ZeRO-3 gathers the partitioned parameters); rank 0 writes the file through a
    temporary name. ``*.safetensors`` names get a safetensors file, anything else a ``torch.save`` file
    holding only tensors (loadable with ``torch.load(weights_only=True)``). Buffers are included.

    Returns:
        True.

    Raises:
        CheckpointError: ZeRO stage 3 without ``zero_optimization.gather_16bit_weights_on_model_save``
            (``stage3_gather_16bit_weights_on_model_save``) (DeepSpeed logs and returns False instead);
            an empty ``save_dir`` or ``save_filename``; a failed write on rank 0 (raised on every rank).
        CollectiveArrivalError: not every rank called it within ``DSCORE_ARRIVAL_TIMEOUT`` (names the ranks).
    """
    ensure_all_arrived("save_16bit_model")
    view = EngineView(engine)
    coll = view.coll
    if save_dir is None or not os.fspath(save_dir):
        raise CheckpointError(f"save_dir must be a non-empty path, got {save_dir!r}")
    if not save_filename or os.path.basename(save_filename) != save_filename:
        raise CheckpointError(f"save_filename must be a plain file name, got {save_filename!r}")
    if view.zero_stage == 3 and not view.gather_16bit_on_save:
        raise CheckpointError(
            "save_16bit_model under ZeRO stage 3 needs the partitioned parameters gathered: set "
            '"zero_optimization": {"gather_16bit_weights_on_model_save": true} (DeepSpeed spelling '
            "stage3_gather_16bit_weights_on_model_save), or export the fp32 weights of a checkpoint with "
            "`dscore checkpoint export CKPT_DIR OUT`"
        )
    state = view.zero.module_state_dict()
    path = os.path.join(os.path.abspath(os.fspath(save_dir)), save_filename)

    def write() -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        plain = {}
        for k, v in state.items():
            t = v.detach().to("cpu")
            if t.untyped_storage().nbytes() != t.numel() * t.element_size() or not t.is_contiguous():
                t = t.clone(memory_format=torch.contiguous_format)
            plain[k] = t
        if save_filename.endswith(".safetensors"):
            S.atomic_write(path, lambda tmp: write_tensor_file(tmp, plain, {"format": "pt"}, fsync=False))
        else:
            S.atomic_write(path, lambda tmp: torch.save(plain, tmp))

    err = S.capture(write)[1] if coll.rank == 0 else None
    S.agree(coll, err, f"writing {path}")
    if coll.rank == 0:
        logger.info("saved 16-bit model weights to %s", path)
    return True
