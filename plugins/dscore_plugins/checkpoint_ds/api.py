"""Reading DeepSpeed checkpoints: load them into a dscore engine at any world size and ZeRO stage, safely.

``engine.load_checkpoint(dir)`` recognises a DeepSpeed save directory (``latest``, ``global_step*/``,
``mp_rank_00_model_states.pt``, ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt``, ZeRO-3's per-rank
model-state files) and restores, through the same resharding path as dscore's own checkpoints: module
weights, fp32 master weights, optimizer moments and steps, the LR scheduler, ``global_steps`` /
``global_samples`` / ``skipped_steps``, the fp16 loss scaler, and the user's ``client_state`` keys only.
DeepSpeed itself needs an offline conversion to change world size; here any saved world size loads at any
other, and any ZeRO stage at any other.

Safety: every file is read by :func:`safe_load` (``torch.load(weights_only=True)`` plus the explicit
allow-list :data:`ALLOWED_DEEPSPEED_GLOBALS` of inert stand-ins); anything else is refused naming the
type and the file. The whole checkpoint (every shard, every slice) is validated before the engine is
touched: missing shards, an undeterminable world size or a layout dscore does not know (pipeline, tensor
parallel, MoE at stage 0/3; MoE at ZeRO 1/2 loads at any ep_size) raise :class:`~dscore.errors.CheckpointError` naming the files.

Also: :func:`import_checkpoint` (``dscore checkpoint import DS_DIR OUT_DIR``) converts once into dscore's
pickle-free format, and :func:`export_fp32` (``dscore checkpoint export DS_DIR --fp32 OUT``) writes the
consolidated weights (DeepSpeed's ``zero_to_fp32``), both streaming one shard at a time.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from dscore.errors import CheckpointError
from dscore_plugins.checkpoint_ds._detect import (
    is_deepspeed_checkpoint,
    looks_like_deepspeed_tag_dir,
    resolve_deepspeed_tag,
)
from dscore_plugins.checkpoint_ds._layout import DeepSpeedCheckpoint
from dscore_plugins.checkpoint_ds._unpickle import ALLOWED_DEEPSPEED_GLOBALS, safe_load

__all__ = [
    "ALLOWED_DEEPSPEED_GLOBALS",
    "DeepSpeedCheckpoint",
    "export_fp32",
    "get_fp32_state_dict_from_deepspeed",
    "import_checkpoint",
    "is_deepspeed_checkpoint",
    "looks_like_deepspeed_tag_dir",
    "read_for_engine",
    "resolve_deepspeed_tag",
    "safe_load",
]

logger = logging.getLogger("dscore.checkpoint")


def import_checkpoint(ds_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], tag: str | None = None) -> str:
    """Convert the DeepSpeed checkpoint ``ds_dir`` (tag ``tag`` or ``latest``) into a dscore checkpoint in
    ``out_dir`` (same tag; ``latest`` updated). Streams one shard at a time. Returns the tag directory.

    Raises:
        CheckpointNotFoundError / CheckpointError: see :class:`DeepSpeedCheckpoint`.
    """
    from dscore_plugins.checkpoint_ds._convert import import_checkpoint as _import

    return _import(DeepSpeedCheckpoint(ds_dir, tag), out_dir)


def export_fp32(
    ds_dir: str | os.PathLike[str], output: str | os.PathLike[str], tag: str | None = None, dtype: str = "fp32"
) -> str:
    """Write the consolidated weights of a DeepSpeed checkpoint (fp32 masters; buffers as saved) to one
    safetensors file, streaming one shard at a time. ``dtype``: ``fp32`` (default), ``bf16`` or ``fp16``.

    Returns:
        The path written.
    """
    import torch

    from dscore_plugins.checkpoint_ds._convert import export_consolidated

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if dtype not in dtypes:
        raise CheckpointError(f"unknown export dtype {dtype!r}; choose one of {', '.join(dtypes)}")
    return export_consolidated(DeepSpeedCheckpoint(ds_dir, tag), output, dtype=dtypes[dtype])


def get_fp32_state_dict_from_deepspeed(ds_dir: str | os.PathLike[str], tag: str | None = None) -> dict[str, Any]:
    """The consolidated module state dict of a DeepSpeed checkpoint with fp32 parameters (CPU), in memory
    (DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint``)."""
    from dscore_plugins.checkpoint_ds._convert import full_state

    ck = DeepSpeedCheckpoint(ds_dir, tag)
    return dict(full_state(ck, optimizer=False)["module"])


def _step_as_tensor(optimizer: Any) -> bool:
    """torch's optimizers and the op-based ones (classes in an ``ops`` package: fused/CPU Adam, Lion, ...)
    keep ``step`` as a 0-dim fp32 tensor; pure-Python plugin optimizers (Lamb, Muon) an int."""
    if optimizer is None:
        return True
    module = type(optimizer).__module__
    return module.startswith("torch.") or ".ops." in f".{module}."


def _check_against_engine(ck: DeepSpeedCheckpoint, engine: Any, strict: bool, with_optimizer: bool) -> None:
    """Everything that could fail while applying, checked first (names, shapes, trainable set)."""
    module = getattr(engine, "module", None)
    if module is None:
        return
    from dscore.moe.checkpoint import ExpertNaming

    naming = ExpertNaming(module)  # MoE: the checkpoint names experts by global id, the engine by local
    shapes = {p.name: p.shape for p in ck.params}
    shapes.update(ck.frozen_shapes)
    saved_keys = {local for k in ck.module_keys if (local := naming.to_local(k)) is not None}
    own: dict[str, tuple[int, ...]] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        own[n] = tuple(getattr(p, "ds_shape", p.shape))
    for n, b in module.named_buffers(remove_duplicate=False):
        own[n] = tuple(b.shape)
    expected_keys = set(module.state_dict(keep_vars=True).keys())  # keep_vars: ZeRO-3 params are released
    if strict:
        missing = sorted(expected_keys - saved_keys)
        unexpected = sorted(saved_keys - expected_keys)
        if missing or unexpected:
            raise CheckpointError(
                f"the module weights in DeepSpeed checkpoint {ck.tag_dir} do not fit the model (load_module_strict=True): "
                f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}, unexpected "
                f"{unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}"
            )
    for key in ck.module_keys:
        local = naming.to_local(key)
        if local is None or local not in own:
            continue
        src = ck.shared.get(key, key)
        saved = shapes.get(src, tuple(ck.module[src].shape))
        if tuple(saved) != own[local]:
            raise CheckpointError(
                f"DeepSpeed checkpoint {ck.tag_dir}: {key!r} has shape {list(saved)} but the model's is {list(own[local])}"
            )
    if with_optimizer and ck.has_optimizer:
        seen: set[int] = set()
        trainable = []
        for n, p in module.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                trainable.append(naming.to_global(n))
        saved_names = {p.name for p in ck.params}
        lacking = [n for n in trainable if n not in saved_names]
        if lacking:
            raise CheckpointError(
                f"DeepSpeed checkpoint {ck.tag_dir} has no optimizer state for trainable parameter(s) "
                f"{lacking[:8]}; load with load_optimizer_states=False (or load_module_only=True) to keep fresh state"
            )


def read_for_engine(
    engine: Any,
    load_dir: str,
    tag: str | None,
    *,
    load_module_strict: bool = True,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
    universal: bool = False,
) -> dict[str, Any]:
    """Read and validate a DeepSpeed checkpoint for ``engine``; nothing is applied here.

    Returns:
        The structure :func:`dscore.persistence.load_checkpoint` applies: ``{"manifest": {"world_size",
        "format": "deepspeed"}, "module", "engine", "client", "optim" (unless ``load_module_only``), "rank":
        None (DeepSpeed stores no RNG state), "load_path"}``.

    Raises:
        CheckpointNotFoundError / CheckpointError: anything wrong with the directory, its files, or the fit
            with ``engine`` (named).
    """
    from dscore_plugins.checkpoint_ds._convert import client_state, engine_state, full_state, to_dscore_optim

    ck = DeepSpeedCheckpoint(load_dir, tag, universal=universal)
    want_opt = not load_module_only
    _check_against_engine(ck, engine, load_module_strict, want_opt and load_optimizer_states)
    full = full_state(ck, optimizer=want_opt and load_optimizer_states)
    zero = getattr(engine, "zero_stage_impl", None)
    optimizer = getattr(zero, "optimizer", None)
    out: dict[str, Any] = {
        "manifest": {"world_size": ck.world_size, "format": "deepspeed", "zero_stage": ck.stage},
        "module": full["module"],
        "client": client_state(ck),
        "rank": None,
        "load_path": ck.model_file,
        "tag": ck.tag,
    }
    gas = getattr(engine, "gradient_accumulation_steps", None)
    gas = gas() if callable(gas) else int(getattr(getattr(engine, "config", None), "gradient_accumulation_steps", 1))
    out["engine"] = engine_state(ck, gas)
    if want_opt:
        groups = optimizer.param_groups if optimizer is not None else None
        if ck.has_optimizer:
            out["optim"] = to_dscore_optim(ck, full, step_as_tensor=_step_as_tensor(optimizer), current_groups=groups)
        else:  # nothing to restore: the engine's groups as they are, masters refreshed from the weights
            kept = [{k: v for k, v in g.items() if k != "params"} | {"param_names": []} for g in groups or []]
            out["optim"] = {"param_names": [], "state": {}, "param_groups": kept, "fp32_params": {}}
        sched = getattr(engine, "lr_scheduler", None)
        if load_lr_scheduler_states and sched is not None and isinstance(ck.lr_scheduler, dict):
            try:
                own_keys = set(sched.state_dict())
            except Exception:  # a scheduler without state_dict: nothing to check
                own_keys = set()
            if not own_keys <= set(ck.lr_scheduler):
                raise CheckpointError(
                    f"the LR scheduler state in {ck.model_file} ({sorted(ck.lr_scheduler)}) does not fit the engine's "
                    f"{type(sched).__name__} (needs {sorted(own_keys)}); configure the same scheduler as the DeepSpeed "
                    "run or pass load_lr_scheduler_states=False"
                )
        es = out["engine"]
        scaler = getattr(engine, "loss_scaler", None)
        saved = es.get("loss_scaler")
        if scaler is not None and saved is not None:
            try:
                own_dynamic = bool(scaler.state_dict().get("dynamic", False))
            except Exception:  # a scaler without a state dict: leave it
                own_dynamic = False
            if own_dynamic and not saved.get("dynamic", False):
                logger.info(
                    "DeepSpeed checkpoint %s has a static loss scale (%s); the engine's dynamic fp16 loss scaler keeps "
                    "its own state",
                    ck.tag_dir,
                    saved.get("cur_scale"),
                )
                es["loss_scaler"] = None
        if ck.data_sampler is not None:
            logger.warning(
                "DeepSpeed checkpoint %s holds a curriculum data-sampler state; dscore does not restore it", ck.tag_dir
            )
        if not ck.has_optimizer and load_optimizer_states:
            logger.warning("DeepSpeed checkpoint %s holds no optimizer state; the optimizer starts fresh", ck.tag_dir)
    return out
