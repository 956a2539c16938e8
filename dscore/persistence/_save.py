"""``save_checkpoint``: the collective, atomic save of an engine in a registered layout (see the package docs)."""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from typing import Any

from dscore.comm.guard import ensure_all_arrived
from dscore.errors import CheckpointArgumentError, CheckpointError
from dscore.persistence import layouts
from dscore.persistence import savedir as S
from dscore.persistence._engine_view import EngineView, frozen_parameter_names
from dscore.persistence._rng import rng_states
from dscore.persistence.tree import encode
from dscore.protocols.checkpoint import CheckpointSaveState

__all__ = ["save_checkpoint"]

logger = logging.getLogger("dscore.checkpoint")


def save_checkpoint(
    engine: Any,
    save_dir: str | os.PathLike[str],
    tag: object = None,
    client_state: dict[str, Any] | None = None,
    save_latest: bool = True,
    exclude_frozen_parameters: bool = False,
    layout: str = "dscore",
) -> bool:
    """Save everything ``engine`` owns plus ``client_state`` under ``<save_dir>/<tag>`` (collective).

    See :mod:`dscore.persistence` for the native layout, the atomicity guarantees and the engine attributes used.

    Args:
        engine: the engine (every rank calls this with its own engine).
        save_dir: the save directory (created by rank 0 when missing); must be on a filesystem every rank
            sees.
        tag: the tag directory name (``str()``-ed); default ``global_step<engine.global_steps>``.
        client_state: the user's state: JSON-like values and tensors (see :mod:`dscore.persistence.tree`);
            rank 0's copy is saved. Keys may equal engine key names: engine state lives apart.
        save_latest: point ``<save_dir>/latest`` at ``tag`` once the checkpoint is complete.
        exclude_frozen_parameters: leave parameters with ``requires_grad=False`` out of the saved module
            state (DeepSpeed's keyword, used by LoRA runs); their names are recorded so that
            :func:`load_checkpoint` accepts exactly those keys missing (the model being loaded into must
            already hold them).
        layout: a registered ``checkpoint_layout`` unit (``engine.checkpoint_layout``): ``"dscore"`` (the
            pickle-free native layout) or ``"deepspeed"`` (DeepSpeed 0.19.8's files; ZeRO stages 1-3,
            fp32/bf16; RNG states and the data-loader position are not part of it, as in DeepSpeed), or a
            third party's. Every layout is written with the same atomic protocol and its name recorded in
            ``_COMPLETE``, so :func:`load_checkpoint` reads it back through the same layout.

    Returns:
        True.

    Raises:
        CheckpointError: (on every rank) an invalid ``save_dir`` or tag (:class:`CheckpointArgumentError`, a
            ``ValueError``), tags that differ across ranks under ``checkpoint.tag_validation: FAIL``
            (:class:`CheckpointTagMismatchError`, an ``AssertionError``), a ``client_state`` value that cannot be stored safely, an
            unknown layout (close matches named) or a disabled one (``checkpoint_layout:<name>`` named with
            how to re-enable it), an engine the layout cannot store, or a failure writing on any rank
            (named). Nothing is visible under ``<save_dir>/<tag>`` or ``latest`` unless the whole save
            succeeded.
        CollectiveArrivalError: not every rank called it within ``DSCORE_ARRIVAL_TIMEOUT`` (names the ranks).
    """
    ensure_all_arrived("save_checkpoint")
    t0 = time.perf_counter()
    view = EngineView(engine)
    coll = view.coll
    rank, world = coll.rank, coll.world_size

    # Phase 1 - validate everything locally, then agree before anything is written.
    def check() -> dict[str, Any]:
        if save_dir is None or not os.fspath(save_dir):
            raise CheckpointArgumentError(f"save_dir must be a non-empty path, got {save_dir!r}")
        mode = view.tag_validation
        tag_text = S.validate_tag(f"global_step{int(engine.global_steps)}" if tag is None else tag)
        client = {} if client_state is None else client_state
        if not isinstance(client, dict):
            raise CheckpointError(f"client_state must be a dict (or None), got {type(client).__name__}")
        name, impl = layouts.layout_for_save(view.registry, layout)
        check_save = getattr(impl, "check_save", None)
        if callable(check_save):
            check_save(engine, view.zero_stage)
        encode(client, root="client_state", tensor_prefix="client/", tensors={})  # refuse unsafe values now
        return {"mode": mode, "tag": tag_text, "client": client, "layout": (name, impl)}

    local, err = S.capture(check)
    info = None if local is None else {"tag": local["tag"], "host": socket.gethostname()}
    if rank == 0 and info is not None:
        info["token"] = uuid.uuid4().hex
    infos = S.agree(coll, err, "validating the checkpoint request", info)
    assert local is not None
    layout_name, impl = local["layout"]
    tag_text = S.choose_tag([i["tag"] for i in infos], local["mode"], rank)
    save_dir = os.path.abspath(os.fspath(save_dir))
    tag_dir = os.path.join(save_dir, tag_text)
    tmp_dir = S.tmp_dir_path(save_dir, tag_text, infos[0]["token"])

    # Phase 2 - rank 0 prepares the private temporary tag directory.
    err = S.capture(S.prepare_tmp_dir, save_dir, tag_text, tmp_dir)[1] if rank == 0 else None
    S.agree(coll, err, f"creating {tmp_dir}")

    # Phase 3 - gather full state (collective for partitioned stages) and write this rank's files.
    module_sd = view.zero.module_state_dict()
    excluded = frozen_parameter_names(engine) if exclude_frozen_parameters else []
    if excluded:
        module_sd = type(module_sd)((k, v) for k, v in module_sd.items() if k not in set(excluded))
    optim_sd = view.zero.state_dict()

    def write() -> dict[str, int]:
        sched = getattr(engine, "lr_scheduler", None)
        scaler = getattr(engine, "loss_scaler", None)
        r_tensors, r_other = rng_states(view.accelerator)
        state = CheckpointSaveState(
            engine=engine,
            rank=rank,
            world_size=world,
            zero_stage=view.zero_stage,
            module_state=module_sd,
            optimizer_state=optim_sd,
            engine_state={
                "global_steps": int(engine.global_steps),
                "global_samples": int(getattr(engine, "global_samples", 0)),
                "micro_steps": int(getattr(engine, "micro_steps", 0)),
                "skipped_steps": int(getattr(engine, "skipped_steps", 0)),
                "excluded_frozen_parameters": list(excluded),
                "lr_scheduler": sched.state_dict() if sched is not None else None,
                "loss_scaler": scaler.state_dict() if scaler is not None else None,
            },
            client_state=local["client"],
            rank_state={"rank": rank, "world_size": world, "rng": r_other, "data_sampler": view.data_sampler_state()},
            rank_tensors=r_tensors,
            config_json=view.config_json() if rank == 0 else "null",
            durable=S.durable(),
        )
        written = impl.write(state, tmp_dir)
        return {str(k): int(v) for k, v in written.items()}

    written, err = S.capture(write)
    manifests = S.agree(coll, err, f"writing checkpoint files into {tmp_dir}", written)

    # Phase 4 - rank 0 seals the directory, publishes it under its tag, then moves `latest`.
    def publish() -> None:
        fields = {"zero_stage": view.zero_stage, "global_steps": int(engine.global_steps), "layout": layout_name}
        S.publish(save_dir, tag_text, tmp_dir, manifests, [i["host"] for i in infos], fields, save_latest=save_latest)

    err = S.capture(publish)[1] if rank == 0 else None
    S.agree(coll, err, f"publishing checkpoint {tag_dir}")
    if rank == 0:
        logger.info("saved checkpoint %s (%d rank(s), %.2f s)", tag_dir, world, time.perf_counter() - t0)
    view.call_hook("dscore_checkpoint_saved", save_dir=save_dir, tag=tag_text)
    return True
