"""The pipeline engine's ``save_checkpoint`` / ``load_checkpoint``: its state into and out of the per-layer
layout of :mod:`dscore_plugins.engine.pipe.checkpoint`.

:class:`~dscore_plugins.engine.pipeline.PipelineEngine` delegates to :func:`save_engine` and
:func:`load_engine` (and fires the ``dscore_checkpoint_saved`` / ``_loaded`` hooks itself). Both are
collective: every rank of the job calls them, and every phase is agreed, so an error on one rank is
raised on every rank.

Engine members used (:class:`PipelineCheckpointable`): ``module`` (the :class:`~dscore.pipe.PipelineModule`
of this stage), ``zero_stage_impl`` (``module_state_dict()``, ``state_dict()``,
``load_module_state_dict(sd, strict=)``, ``load_state_dict(sd, load_optimizer_states=)``), ``grid``,
``stage_id``, ``num_stages``, ``global_rank``, ``global_steps``, ``runtime.comm``, ``config.checkpoint``,
``checkpoint_layout``, ``state_for_checkpoint()``, ``load_state_from_checkpoint(state, ...)``,
``zero_optimization_stage()``.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Protocol

import torch

from dscore.checkpoint import list_tags
from dscore.errors import CheckpointError
from dscore.pipe import PipelineGrid, PipelineModule
from dscore_plugins.engine.pipe import checkpoint as ckpt

__all__ = ["PipelineCheckpointable", "layer_states", "load_engine", "save_engine"]

log = logging.getLogger("dscore.pipe.engine")


class PipelineCheckpointable(Protocol):
    """What :func:`save_engine` / :func:`load_engine` need of the pipeline engine (see the module docstring)."""

    module: Any
    zero_stage_impl: Any
    grid: PipelineGrid
    stage_id: int
    num_stages: int
    global_rank: int
    global_steps: int
    runtime: Any
    config: Any
    checkpoint_layout: str

    def state_for_checkpoint(self) -> dict[str, Any]: ...

    def load_state_from_checkpoint(self, state: dict[str, Any], *, load_lr_scheduler_states: bool = True) -> None: ...

    def zero_optimization_stage(self) -> int: ...


def _prefix(pipe: PipelineModule, idx: int) -> str:
    """The module-state key prefix of layer ``idx`` (``"tied_modules.<key>."`` for a tied layer, else ``"<idx>."``)."""
    key = pipe.tied_key(idx)
    return f"tied_modules.{key}." if key is not None else f"{idx}."


def layer_states(engine: PipelineCheckpointable) -> dict[int, dict[str, torch.Tensor]]:
    """This stage's layers' states (keys relative to the layer, CPU copies), from the ZeRO stage's module state."""
    pipe: PipelineModule = engine.module
    full = engine.zero_stage_impl.module_state_dict()
    out: dict[int, dict[str, torch.Tensor]] = {}
    for idx in pipe.layer_range():
        if pipe.layer_module(idx) is None:
            continue
        prefix = _prefix(pipe, idx)
        out[idx] = {k[len(prefix) :]: v.detach().cpu().clone() for k, v in full.items() if k.startswith(prefix)}
    return out


def save_engine(
    engine: PipelineCheckpointable,
    save_dir: str,
    tag: str | None,
    client_state: dict[str, Any] | None,
    save_latest: bool,
    exclude_frozen_parameters: bool,
) -> str:
    """Save ``engine`` as a per-layer pipeline checkpoint atomically; returns the tag saved.

    Arguments and errors as :meth:`PipelineEngine.save_checkpoint
    <dscore_plugins.engine.pipeline.PipelineEngine.save_checkpoint>`.

    Raises:
        CheckpointError: on every rank: ``engine.checkpoint_layout`` is not ``"dscore"``, an invalid tag or
            ``save_dir``, an unstorable ``client_state``, a failure writing or publishing on any rank.
    """
    if engine.checkpoint_layout != "dscore":
        raise CheckpointError(
            f"checkpoint_layout {engine.checkpoint_layout!r} is not supported by the pipeline engine: it saves "
            "dscore's per-layer layout only; set engine.checkpoint_layout = 'dscore'"
        )
    pipe: PipelineModule = engine.module
    layout = {
        "num_layers": pipe.num_layers,
        "num_stages": engine.num_stages,
        "parts": list(pipe.parts),
        "data_parallel_size": engine.grid.data_parallel_size,
    }

    def collect() -> dict[str, Any]:
        layers = layer_states(engine)
        if exclude_frozen_parameters:
            frozen = {n for n, p in engine.module.named_parameters() if not p.requires_grad}
            for idx, state in layers.items():
                prefix = _prefix(pipe, idx)
                layers[idx] = {k: v for k, v in state.items() if prefix + k not in frozen}
        optim_state = engine.zero_stage_impl.state_dict()  # collective within the data-parallel group
        files: dict[str, Any] = {}
        if engine.grid.data_parallel_id == 0:
            for idx, state in layers.items():
                files[ckpt.layer_name(idx)] = state
            files[ckpt.optim_name(engine.stage_id)] = optim_state
        if engine.global_rank == 0:
            engine_state = engine.state_for_checkpoint()
            engine_state.pop("rng", None)  # per-rank; not meaningful across layouts
            engine_state["layout"] = layout
            files[ckpt.ENGINE_FILE] = engine_state
        return files

    return ckpt.save_pipeline_checkpoint(
        engine.runtime.comm,
        save_dir,
        f"global_step{engine.global_steps}" if tag is None else tag,
        collect,
        client_state=client_state,
        tag_validation=engine.config.checkpoint.tag_validation,
        save_latest=save_latest,
        fields={"global_steps": int(engine.global_steps), "zero_stage": engine.zero_optimization_stage(), **layout},
    )


def _merge_optimizer_parts(parts: list[Any], own: set[str]) -> dict[str, Any]:
    """One optimizer state for this stage from every saved stage's file: the entries of the parameters in ``own``."""
    merged: dict[str, Any] = {}
    for part in parts:
        if not merged:
            merged = {k: v for k, v in part.items() if k not in ("state", "fp32_params", "param_names")}
            merged.update({"state": {}, "fp32_params": {}, "param_names": []})
        merged["state"].update({n: v for n, v in part.get("state", {}).items() if n in own})
        merged["fp32_params"].update({n: v for n, v in (part.get("fp32_params") or {}).items() if n in own})
        merged["param_names"] += [n for n in part.get("param_names", []) if n in own]
    if not merged.get("fp32_params"):
        merged.pop("fp32_params", None)
    return merged


def load_engine(
    engine: PipelineCheckpointable,
    load_dir: str,
    tag: str | None,
    load_module_strict: bool,
    load_optimizer_states: bool,
    load_lr_scheduler_states: bool,
    load_module_only: bool,
) -> tuple[str | None, dict[str, Any] | None]:
    """Load a pipeline checkpoint saved with any number of stages into ``engine``.

    Arguments, return value and errors as :meth:`PipelineEngine.load_checkpoint
    <dscore_plugins.engine.pipeline.PipelineEngine.load_checkpoint>`: ``(tag folder, client_state)``, or
    ``(None, None)`` with a warning when no tag is given and ``load_dir`` has no ``latest``.

    Raises:
        CheckpointNotFoundError: a missing or incomplete folder or file.
        CheckpointError: ranks asked for different folders or tags, a standard-engine checkpoint, a
            truncated file, another number of layers, weights that do not fit.
    """
    pipe: PipelineModule = engine.module
    comm = engine.runtime.comm
    text = os.fspath(load_dir) if load_dir is not None else ""
    asked = (os.path.abspath(text) if text else "", None if tag is None else str(tag))

    def resolve() -> str | None:
        if not text:
            raise CheckpointError(f"load_dir must be a non-empty path, got {load_dir!r}")
        return ckpt.find_checkpoint(text, tag)

    path, err = ckpt.capture(resolve)
    results = ckpt.agree(comm, err, f"resolving the pipeline checkpoint in {asked[0]}", (asked, path))
    if len({a for a, _ in results}) > 1:
        listing = "; ".join(f"rank {r}: load_dir={d!r}, tag={t!r}" for r, ((d, t), _) in enumerate(results))
        raise CheckpointError(
            f"load_checkpoint was called with different arguments on different ranks ({listing}); every rank "
            "must load the same directory and tag"
        )
    if len({p for _, p in results}) > 1:  # the filesystem changed under us between ranks
        raise CheckpointError(f"ranks resolved different tag folders in {asked[0]}: {[p for _, p in results]}")
    if path is None:
        log.warning(
            "no %s file in %s and no tag given: nothing loaded (tags present: %s)",
            ckpt.LATEST_FILE,
            asked[0],
            ", ".join(t for t, _ in list_tags(asked[0])) or "none",
        )
        return None, None
    want_optim = not load_module_only and load_optimizer_states

    def read() -> tuple[dict[str, Any], dict[str, torch.Tensor], list[Any]]:
        ckpt.check_files(path, [ckpt.ENGINE_FILE])
        engine_state = ckpt.load_file(os.path.join(path, ckpt.ENGINE_FILE))
        layout = engine_state.get("layout", {})
        if int(layout.get("num_layers", pipe.num_layers)) != pipe.num_layers:
            raise CheckpointError(
                f"{path} was saved from a PipelineModule of {layout.get('num_layers')} layers; this one has "
                f"{pipe.num_layers}"
            )
        owned = [idx for idx in pipe.layer_range() if pipe.layer_module(idx) is not None]
        saved_stages = int(layout.get("num_stages", engine.num_stages))
        optim_names = [ckpt.optim_name(s) for s in range(saved_stages)] if want_optim else []
        ckpt.check_files(path, [ckpt.layer_name(idx) for idx in owned] + optim_names)
        module_state: dict[str, torch.Tensor] = {}
        for idx in owned:
            prefix = _prefix(pipe, idx)
            for k, v in ckpt.load_file(ckpt.layer_file(path, idx)).items():
                module_state[prefix + k] = v
        parts = [ckpt.load_file(os.path.join(path, name)) for name in optim_names]
        return engine_state, module_state, parts

    state, err = ckpt.capture(read)
    ckpt.agree(comm, err, f"reading pipeline checkpoint {path}")
    engine_state, module_state, parts = state

    def apply() -> None:
        try:
            engine.zero_stage_impl.load_module_state_dict(module_state, strict=load_module_strict)
        except RuntimeError as exc:
            raise CheckpointError(
                f"the layer weights in {path} do not fit stage {engine.stage_id}'s layers: {exc}"
            ) from exc
        if want_optim:
            own = {n for n, _ in engine.module.named_parameters()}
            engine.zero_stage_impl.load_state_dict(_merge_optimizer_parts(parts, own), load_optimizer_states=True)
        if not load_module_only:
            engine.load_state_from_checkpoint(engine_state, load_lr_scheduler_states=load_lr_scheduler_states)

    ckpt.agree(comm, ckpt.capture(apply)[1], f"loading pipeline checkpoint {path} into the engine")
    return path, engine_state.get("client_state")
