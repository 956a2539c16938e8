"""``load_checkpoint``: the collective load of a checkpoint in any registered layout (see the package docs)."""

from __future__ import annotations

import logging
import os
from typing import Any

from dscore.comm.guard import ensure_all_arrived
from dscore.errors import CheckpointError, CheckpointNotFoundError
from dscore.persistence import layouts
from dscore.persistence import savedir as S
from dscore.persistence._engine_view import EngineView
from dscore.persistence._rng import derived_seed, restore_rng, seed_everything
from dscore.protocols.checkpoint import CheckpointLoadRequest, LoadedCheckpoint

__all__ = ["load_checkpoint"]

logger = logging.getLogger("dscore.checkpoint")


def _load_module(engine: Any, view: EngineView, state: LoadedCheckpoint, *, strict: bool) -> None:
    """Load the saved module weights; keys left out by ``exclude_frozen_parameters`` may be missing.

    Under ``strict`` exactly the recorded frozen keys are allowed to be missing (they keep the values the
    model already holds); any other missing or unexpected key is still an error, as in torch.

    Raises:
        CheckpointError: strict and the saved weights miss keys that were not excluded, or hold unknown ones.
    """
    excluded = set(state.engine_state.get("excluded_frozen_parameters") or ())
    saved = state.module
    if not excluded:
        view.zero.load_module_state_dict(saved, strict=strict)
        return
    if strict:
        expected = set(engine.module.state_dict(keep_vars=True).keys())
        missing = sorted(expected - set(saved) - excluded)
        unexpected = sorted(set(saved) - expected)
        if missing or unexpected:
            raise CheckpointError(
                "the module weights do not fit the model (saved with exclude_frozen_parameters=True, so only "
                f"the frozen parameters may be missing): missing keys {missing}, unexpected keys {unexpected}. "
                "Pass load_module_strict=False to load anyway"
            )
        now_trainable = sorted(k for k, p in engine.module.named_parameters(remove_duplicate=False)
                               if k in excluded and k not in saved and p.requires_grad)
        if now_trainable:
            logger.warning(
                "parameters %s were frozen and left out of the checkpoint but are trainable now; they keep the "
                "model's current values",
                now_trainable,
            )
    view.zero.load_module_state_dict(saved, strict=False)


def _universal_tag(load_dir: str) -> str:
    """The tag named by ``<load_dir>/latest_universal`` (``checkpoint.load_universal``, as DeepSpeed).

    Raises:
        CheckpointNotFoundError: the file does not exist (DeepSpeed silently returns ``(None, None)``).
        CheckpointError: the file is empty.
    """
    path = os.path.join(load_dir, "latest_universal")
    try:
        with open(path, encoding="utf-8") as f:
            tag = f.read().strip()
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f'"checkpoint": {{"load_universal": true}} reads the tag to load from {path}, which does not exist. dscore '
            "checkpoints and DeepSpeed ZeRO checkpoints load at any world size and ZeRO stage without a universal "
            "conversion: set checkpoint.load_universal to false (or pass tag=...)"
        ) from None
    if not tag:
        raise CheckpointError(f"{path} is empty; it must name the tag to load")
    return tag


def load_checkpoint(
    engine: Any,
    load_dir: str | os.PathLike[str],
    tag: object = None,
    load_module_strict: bool = True,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
) -> tuple[str | None, dict[str, Any] | None]:
    """Restore a checkpoint into ``engine`` (collective), in whichever registered layout holds it
    (:func:`dscore.persistence.layouts.layout_for_load`): one written by :func:`save_checkpoint`, or by
    DeepSpeed.

    Args:
        engine: the engine (every rank calls this).
        load_dir: the save directory given to ``save_checkpoint``.
        tag: the tag to load; None reads ``<load_dir>/latest``.
        load_module_strict: passed to the module's ``load_state_dict(strict=...)``.
        load_optimizer_states: restore the optimizer state (moments, steps); when False the ZeRO stage is
            given the saved state with ``load_optimizer_states=False`` (it keeps its fresh moments).
        load_lr_scheduler_states: restore the LR scheduler.
        load_module_only: restore the module weights only (no optimizer, scheduler, loss scaler, counters,
            RNG or data position), for fine-tuning from a checkpoint.

    Returns:
        ``(load_path, client_state)``: the path of the model-states file and the ``client_state`` exactly as
        saved; ``(None, None)`` (with a warning listing the tags present) when ``tag`` is None and the
        directory has no ``latest``.

    Raises:
        CheckpointNotFoundError: ``load_dir`` does not exist; the tag is missing or incomplete (the complete
            tags are listed); a file of the checkpoint is missing (rank and file named).
        CheckpointError: ranks asked for different directories or tags; ``load_dir`` is a tag directory
            or a file; a file is truncated or malformed; the state does not fit the engine; the checkpoint's
            layout is disabled (``checkpoint_layout:<name>`` named with how to re-enable it).
        CollectiveArrivalError: not every rank called it within ``DSCORE_ARRIVAL_TIMEOUT`` (names the ranks).
    """
    ensure_all_arrived("load_checkpoint")
    view = EngineView(engine)
    coll = view.coll
    rank, world = coll.rank, coll.world_size
    load_dir_text = os.path.abspath(os.fspath(load_dir)) if load_dir is not None and os.fspath(load_dir) else ""
    tag_arg = None if tag is None else str(tag)

    universal = bool(getattr(getattr(view.config, "checkpoint", None), "load_universal", False))
    chosen: dict[str, Any] = {}

    def resolve() -> str | None:
        if not load_dir_text:
            raise CheckpointError(f"load_dir must be a non-empty path, got {load_dir!r}")
        wanted = tag_arg
        if universal and wanted is None and os.path.isdir(load_dir_text):
            wanted = _universal_tag(load_dir_text)
        name, impl = layouts.layout_for_load(view.registry, load_dir_text, wanted)
        chosen["name"], chosen["layout"] = name, impl
        return impl.resolve_tag(load_dir_text, wanted, universal=False)

    resolved, err = S.capture(resolve)
    asks = coll.all_gather_object((load_dir_text, tag_arg))
    if len(set(asks)) > 1:
        listing = "; ".join(f"rank {r}: load_dir={d!r}, tag={t!r}" for r, (d, t) in enumerate(asks))
        raise CheckpointError(
            f"load_checkpoint was called with different arguments on different ranks ({listing}); every rank "
            "must load the same directory and tag"
        )
    results = S.agree(coll, err, f"resolving the checkpoint in {load_dir_text}", resolved)
    if len(set(results)) > 1:  # the filesystem changed under us between ranks
        raise CheckpointError(f"ranks resolved different tags in {load_dir_text}: {results}; retry the load")
    impl = chosen["layout"]
    if resolved is None:
        tags_present = getattr(impl, "tags_present", None)
        if callable(tags_present):
            present = tags_present(load_dir_text)
        else:
            present = ", ".join(
                repr(n) for n in sorted(os.listdir(load_dir_text)) if os.path.isdir(os.path.join(load_dir_text, n))
            ) or "no tags"
        logger.warning(
            "no checkpoint to load: %s has no '%s' file and no tag was given (tags present: %s); starting fresh. "
            "Pass tag=... to load a specific tag",
            load_dir_text,
            S.LATEST_FILE,
            present,
        )
        return None, None
    tag_text = resolved
    tag_dir = os.path.join(load_dir_text, tag_text)
    request = CheckpointLoadRequest(
        engine=engine,
        rank=rank,
        world_size=world,
        save_dir=load_dir_text,
        tag=tag_text,
        tag_dir=tag_dir,
        load_module_strict=load_module_strict,
        load_optimizer_states=load_optimizer_states,
        load_lr_scheduler_states=load_lr_scheduler_states,
        load_module_only=load_module_only,
        universal=universal,
    )
    state, err = S.capture(impl.read, request)
    S.agree(coll, err, f"reading checkpoint {tag_dir}")
    assert isinstance(state, LoadedCheckpoint)
    err = S.capture(_apply, engine, view, state, request)[1]
    S.agree(coll, err, f"loading checkpoint {tag_dir} into the engine")
    if rank == 0:
        logger.info("loaded checkpoint %s (saved with %d rank(s), loaded with %d)", tag_dir, state.saved_world_size, world)
    view.call_hook("dscore_checkpoint_loaded", load_dir=load_dir_text, tag=tag_text)
    return state.load_path, state.client_state


def _apply(engine: Any, view: EngineView, state: LoadedCheckpoint, request: CheckpointLoadRequest) -> None:
    """Apply what a layout read to the engine (every rank; errors are agreed by the caller)."""
    try:
        _load_module(engine, view, state, strict=request.load_module_strict)
    except RuntimeError as exc:
        raise CheckpointError(f"the module weights in {state.load_path} do not fit the model: {exc}") from exc
    if request.load_module_only:
        return
    if state.optimizer_state is None:
        raise CheckpointError(f"checkpoint {request.tag_dir}: the layout read no optimizer state")
    view.zero.load_state_dict(state.optimizer_state, load_optimizer_states=request.load_optimizer_states)
    es = state.engine_state
    sched = getattr(engine, "lr_scheduler", None)
    if request.load_lr_scheduler_states and sched is not None and es.get("lr_scheduler") is not None:
        sched.load_state_dict(es["lr_scheduler"])
    scaler = getattr(engine, "loss_scaler", None)
    if scaler is not None and es.get("loss_scaler") is not None:
        scaler.load_state_dict(es["loss_scaler"])
    counters = {k: int(es[k]) for k in ("global_steps", "global_samples", "micro_steps", "skipped_steps")}
    if callable(getattr(engine, "load_counters_state", None)):
        engine.load_counters_state(counters)  # also resets the engine's throughput window
    else:
        for key, value in counters.items():
            setattr(engine, key, value)
    rs = state.rank_state
    if rs is None:  # a layout without per-rank state (DeepSpeed's): RNG and data position left alone
        return
    if rs.get("data_sampler") is not None:
        view.load_data_sampler_state(rs["data_sampler"])
    if rs.get("rng") is None:  # imported from DeepSpeed (`dscore checkpoint import`): RNGs left alone
        return
    if state.own_rank:
        restore_rng(view.accelerator, state.rank_tensors, rs["rng"])
        return
    seed = derived_seed(request.tag, request.rank, state.rank_tensors["rng/torch_cpu"])
    seed_everything(seed, view.accelerator)
    logger.info(
        "rank %d did not exist when %s was saved (%d rank(s)); seeded its RNGs with %d derived from the tag and rank",
        request.rank,
        request.tag_dir,
        state.saved_world_size,
        seed,
    )
