"""``save_checkpoint`` / ``load_checkpoint`` / ``save_16bit_model`` over an engine (see the package docs)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import socket
import sys
import time
import uuid
from typing import Any

import torch

from dscore.checkpoint import _layout as L
from dscore.checkpoint._tensorfile import read_tensor_file, write_tensor_file
from dscore.checkpoint._tree import decode, encode
from dscore.comm import Comm
from dscore.comm.guard import ensure_all_arrived
from dscore.errors import CheckpointError, CheckpointNotFoundError

__all__ = ["load_checkpoint", "save_16bit_model", "save_checkpoint"]

logger = logging.getLogger("dscore.checkpoint")

_TAG_VALIDATION_MODES = ("IGNORE", "WARN", "FAIL")


_agree = L.agree  # Comm.agree with the checkpoint error types (shared with the pipeline engine's saves)
_local_error = L.capture


# ------------------------------------------------------------------------------------- engine access


class _Engine:
    """Every engine attribute the checkpoint code touches, read in one place (see ``CheckpointEngine``)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        runtime = getattr(engine, "runtime", None)
        comm = getattr(runtime, "comm", None) or getattr(engine, "comm", None)
        self.coll: Comm = comm if isinstance(comm, Comm) else Comm(None)
        zero = getattr(engine, "zero_stage_impl", None)
        if zero is None:
            raise CheckpointError(
                f"{type(engine).__name__} has no zero_stage_impl (the ZeroStage that owns the optimizer state); "
                "checkpoints need an engine built by dscore.initialize"
            )
        self.zero = zero

    @property
    def config(self) -> Any:
        return getattr(self.engine, "config", None)

    @property
    def tag_validation(self) -> str:
        mode = getattr(getattr(self.config, "checkpoint", None), "tag_validation", "WARN")
        mode = str(mode).upper()
        if mode not in _TAG_VALIDATION_MODES:
            raise CheckpointError(
                f"checkpoint.tag_validation is {mode!r}; expected one of {list(_TAG_VALIDATION_MODES)}"
            )
        return mode

    @property
    def zero_stage(self) -> int:
        stage = getattr(self.zero, "stage", None)
        if stage is None:
            stage = getattr(self.config, "zero_stage", 0)
        return int(stage or 0)

    @property
    def gather_16bit_on_save(self) -> bool:
        zcfg = getattr(self.config, "zero_optimization", None)
        for name in ("gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save"):
            if zcfg is not None and hasattr(zcfg, name):
                return bool(getattr(zcfg, name))
        return False

    @property
    def accelerator(self) -> Any:
        runtime = getattr(self.engine, "runtime", None)
        return getattr(runtime, "accelerator", None) or getattr(self.engine, "accelerator", None)

    def call_hook(self, name: str, **kwargs: Any) -> None:
        pm = getattr(getattr(self.engine, "runtime", None), "plugin_manager", None)
        if pm is None:
            return
        if callable(getattr(pm, "call", None)):  # DscorePluginManager: skips hooks nobody implements
            pm.call(name, engine=self.engine, **kwargs)
            return
        hook = getattr(getattr(pm, "hook", None), name, None)
        if hook is not None:
            hook(engine=self.engine, **kwargs)

    def config_json(self) -> str:
        cfg = self.config
        try:
            if hasattr(cfg, "model_dump"):
                return json.dumps(cfg.model_dump(mode="json"), default=str)
        except Exception:  # informational only; never block a save on it
            logger.debug("could not serialise the config into the checkpoint", exc_info=True)
        return "null"

    def data_sampler_state(self) -> Any:
        state = getattr(self.engine, "data_sampler_state", None)
        return state() if callable(state) else state

    def load_data_sampler_state(self, state: Any) -> None:
        loader = getattr(self.engine, "load_data_sampler_state", None)
        if callable(loader):
            loader(state)
            return
        dl = getattr(self.engine, "training_dataloader", None)
        if dl is not None and hasattr(dl, "load_state_dict"):
            dl.load_state_dict(state)
            return
        logger.warning(
            "the checkpoint holds a data loader position %s but the engine has no training data loader to "
            "restore it into; it is ignored",
            state,
        )


# -------------------------------------------------------------------------------------------- RNG


def _rng_states(acc: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {"rng/torch_cpu": torch.get_rng_state()}
    if acc is not None and getattr(acc, "device_type", "cpu") != "cpu":
        try:
            tensors["rng/accelerator"] = acc.get_rng_state()
        except Exception as exc:  # a device without an RNG: record nothing, say so
            logger.warning("could not read the %s RNG state (%s); it is not checkpointed", acc.device_type, exc)
    other: dict[str, Any] = {"python": random.getstate()}
    np = sys.modules.get("numpy")
    if np is not None:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        other["numpy"] = (kind, [int(k) for k in keys], int(pos), int(has_gauss), float(gauss))
    return tensors, other


def _restore_rng(acc: Any, tensors: dict[str, torch.Tensor], other: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["rng/torch_cpu"])
    if "rng/accelerator" in tensors and acc is not None and getattr(acc, "device_type", "cpu") != "cpu":
        acc.set_rng_state(tensors["rng/accelerator"])
    version, state, gauss = other["python"]
    random.setstate((version, tuple(state), gauss))
    np = sys.modules.get("numpy")
    if np is not None and other.get("numpy") is not None:
        kind, keys, pos, has_gauss, g = other["numpy"]
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, g))


def _derived_seed(tag: str, rank: int, rank0_cpu_state: torch.Tensor) -> int:
    """Seed for a rank that did not exist at save time: sha256(tag, rank, rank 0's saved CPU RNG state)."""
    h = hashlib.sha256(f"dscore-rng:{tag}:{rank}:".encode())
    h.update(rank0_cpu_state.numpy().tobytes())
    return int.from_bytes(h.digest()[:8], "little") & ((1 << 63) - 1)


def _seed_everything(seed: int, acc: Any) -> None:
    torch.manual_seed(seed)  # seeds the CPU and every device generator torch knows
    if acc is not None and getattr(acc, "device_type", "cpu") != "cpu":
        try:
            acc.manual_seed(seed)
        except Exception:
            logger.debug("accelerator manual_seed failed", exc_info=True)
    random.seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed % (1 << 32))


# ------------------------------------------------------------------------------------------- save


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

    See :mod:`dscore.checkpoint` for the layout, the atomicity guarantees and the engine attributes used.

    Args:
        engine: the engine (every rank calls this with its own engine).
        save_dir: the save directory (created by rank 0 when missing); must be on a filesystem every rank
            sees.
        tag: the tag directory name (``str()``-ed); default ``global_step<engine.global_steps>``.
        client_state: the user's state: JSON-like values and tensors (see :mod:`dscore.checkpoint._tree`);
            rank 0's copy is saved. Keys may equal engine key names: engine state lives apart.
        save_latest: point ``<save_dir>/latest`` at ``tag`` once the checkpoint is complete.
        exclude_frozen_parameters: leave parameters with ``requires_grad=False`` out of the saved module
            state (DeepSpeed's keyword, used by LoRA runs); their names are recorded so that
            :func:`load_checkpoint` accepts exactly those keys missing (the model being loaded into must
            already hold them).
        layout: ``"dscore"`` (the pickle-free format above) or ``"deepspeed"``: DeepSpeed 0.19.8's files
            (:mod:`dscore.checkpoint.deepspeed.writer`; ZeRO stages 1-3, fp32/bf16), written with the same
            atomic protocol and read back by :func:`load_checkpoint` through the safe DeepSpeed reader. RNG
            states and the data-loader position are not part of that layout (as in DeepSpeed).

    Returns:
        True.

    Raises:
        CheckpointError: (on every rank) an invalid ``save_dir`` or tag, tags that differ across ranks under
            ``checkpoint.tag_validation: FAIL``, a ``client_state`` value that cannot be stored safely, or a
            failure writing on any rank (named). Nothing is visible under ``<save_dir>/<tag>`` or ``latest``
            unless the whole save succeeded.
        CollectiveArrivalError: not every rank called it within ``DSCORE_ARRIVAL_TIMEOUT`` (names the ranks).
    """
    ensure_all_arrived("save_checkpoint")
    t0 = time.perf_counter()
    view = _Engine(engine)
    coll = view.coll
    rank, world = coll.rank, coll.world_size

    # Phase 1 - validate everything locally, then agree before anything is written.
    def check() -> dict[str, Any]:
        if save_dir is None or not os.fspath(save_dir):
            raise CheckpointError(f"save_dir must be a non-empty path, got {save_dir!r}")
        mode = view.tag_validation
        tag_text = L.validate_tag(f"global_step{int(engine.global_steps)}" if tag is None else tag)
        client = {} if client_state is None else client_state
        if not isinstance(client, dict):
            raise CheckpointError(f"client_state must be a dict (or None), got {type(client).__name__}")
        if layout not in ("dscore", "deepspeed"):
            raise CheckpointError(f"checkpoint layout must be 'dscore' or 'deepspeed', got {layout!r}")
        if layout == "deepspeed":
            from dscore.checkpoint.deepspeed.writer import check_supported

            check_supported(view.zero_stage, bool(getattr(view.config, "fp16_enabled", False)),
                            getattr(view.zero, "optimizer", None) is not None,
                            moe=bool(getattr(engine, "has_moe_layers", False)))
        tensors: dict[str, torch.Tensor] = {}
        tree = encode(client, root="client_state", tensor_prefix="client/", tensors=tensors)
        return {"mode": mode, "tag": tag_text, "client": (tree, tensors)}

    local, err = _local_error(check)
    info = None if local is None else {"tag": local["tag"], "host": socket.gethostname()}
    if rank == 0 and info is not None:
        info["token"] = uuid.uuid4().hex
    infos = _agree(coll, err, "validating the checkpoint request", info)
    assert local is not None
    tag_text = L.choose_tag([i["tag"] for i in infos], local["mode"], rank)
    save_dir = os.path.abspath(os.fspath(save_dir))
    tag_dir = os.path.join(save_dir, tag_text)
    tmp_dir = L.tmp_dir_path(save_dir, tag_text, infos[0]["token"])

    # Phase 2 - rank 0 prepares the private temporary tag directory.
    err = _local_error(L.prepare_tmp_dir, save_dir, tag_text, tmp_dir)[1] if rank == 0 else None
    _agree(coll, err, f"creating {tmp_dir}")

    durable = L.durable()

    # Phase 3 - gather full state (collective for partitioned stages) and write this rank's files.
    module_sd = view.zero.module_state_dict()
    excluded = _frozen_parameter_names(engine) if exclude_frozen_parameters else []
    if excluded:
        module_sd = type(module_sd)((k, v) for k, v in module_sd.items() if k not in set(excluded))
    optim_sd = view.zero.state_dict()

    def write_deepspeed() -> dict[str, int]:
        from dscore.checkpoint.deepspeed.writer import deepspeed_files

        sched = getattr(engine, "lr_scheduler", None)
        raw = getattr(view.config, "raw", None)
        files = deepspeed_files(
            module=engine.module,
            module_sd=module_sd,
            optim_sd=optim_sd,
            stage=view.zero_stage,
            rank=rank,
            world=world,
            counters={k: int(getattr(engine, k, 0)) for k in ("global_steps", "global_samples", "skipped_steps")},
            lr_scheduler_state=sched.state_dict() if sched is not None else None,
            ds_config=dict(raw) if isinstance(raw, dict) else {},
            client_state=dict(client_state or {}),
        )
        written: dict[str, int] = {}
        for name, obj in files.items():
            path = os.path.join(tmp_dir, name)

            def save(tmp: str, obj: dict[str, Any] = obj) -> None:
                torch.save(obj, tmp)

            L.atomic_write(path, save, fsync=durable)
            written[name] = os.path.getsize(path)
        return written

    def write() -> dict[str, int]:
        if layout == "deepspeed":
            return write_deepspeed()
        written: dict[str, int] = {}
        if rank == 0:
            written[L.MODEL_FILE] = write_tensor_file(
                os.path.join(tmp_dir, L.MODEL_FILE),
                module_sd,
                {"format": L.FORMAT, "format_version": str(L.FORMAT_VERSION), "content": "module"},
                fsync=durable,
            )
            o_tensors: dict[str, torch.Tensor] = {}
            o_tree = encode(optim_sd, root="optimizer state", tensor_prefix="optim/", tensors=o_tensors)
            written[L.OPTIM_FILE] = write_tensor_file(
                os.path.join(tmp_dir, L.OPTIM_FILE),
                o_tensors,
                {"format": L.FORMAT, "format_version": str(L.FORMAT_VERSION), "optim": json.dumps(o_tree)},
                fsync=durable,
            )
            e_tensors: dict[str, torch.Tensor] = {}
            sched = getattr(engine, "lr_scheduler", None)
            scaler = getattr(engine, "loss_scaler", None)
            engine_state = {
                "global_steps": int(engine.global_steps),
                "global_samples": int(getattr(engine, "global_samples", 0)),
                "micro_steps": int(getattr(engine, "micro_steps", 0)),
                "skipped_steps": int(getattr(engine, "skipped_steps", 0)),
                "excluded_frozen_parameters": list(excluded),
                "lr_scheduler": sched.state_dict() if sched is not None else None,
                "loss_scaler": scaler.state_dict() if scaler is not None else None,
            }
            e_tree = encode(engine_state, root="engine state", tensor_prefix="engine/", tensors=e_tensors)
            c_tree, c_tensors = local["client"]
            e_tensors.update(c_tensors)
            written[L.ENGINE_FILE] = write_tensor_file(
                os.path.join(tmp_dir, L.ENGINE_FILE),
                e_tensors,
                {
                    "format": L.FORMAT,
                    "format_version": str(L.FORMAT_VERSION),
                    "engine": json.dumps(e_tree),
                    "client": json.dumps(c_tree),
                    "config": view.config_json(),
                },
                fsync=durable,
            )
        r_tensors, r_other = _rng_states(view.accelerator)
        sampler = view.data_sampler_state()
        r_tree = encode(
            {"rank": rank, "world_size": world, "rng": r_other, "data_sampler": sampler},
            root=f"rank {rank} state",
            tensor_prefix="rank/",
            tensors=r_tensors,
        )
        name = L.rank_file(rank)
        written[name] = write_tensor_file(
            os.path.join(tmp_dir, name),
            r_tensors,
            {"format": L.FORMAT, "format_version": str(L.FORMAT_VERSION), "rank": json.dumps(r_tree)},
            fsync=durable,
        )
        return written

    written, err = _local_error(write)
    manifests = _agree(coll, err, f"writing checkpoint files into {tmp_dir}", written)

    # Phase 4 - rank 0 seals the directory, publishes it under its tag, then moves `latest`.
    def publish() -> None:
        fields = {"zero_stage": view.zero_stage, "global_steps": int(engine.global_steps), "layout": layout}
        L.publish(save_dir, tag_text, tmp_dir, manifests, [i["host"] for i in infos], fields, save_latest=save_latest)

    err = _local_error(publish)[1] if rank == 0 else None
    _agree(coll, err, f"publishing checkpoint {tag_dir}")
    if rank == 0:
        logger.info("saved checkpoint %s (%d rank(s), %.2f s)", tag_dir, world, time.perf_counter() - t0)
    view.call_hook("dscore_checkpoint_saved", save_dir=save_dir, tag=tag_text)
    return True


# ------------------------------------------------------------------------------------------- load


def _frozen_parameter_names(engine: Any) -> list[str]:
    """State-dict names of the module's parameters with ``requires_grad=False`` (tied names included)."""
    module = getattr(engine, "module", None)
    if module is None:
        return []
    return [n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad]


def _load_module(engine: Any, view: Any, state: dict[str, Any], *, strict: bool) -> None:
    """Load the saved module weights; keys left out by ``exclude_frozen_parameters`` may be missing.

    Under ``strict`` exactly the recorded frozen keys are allowed to be missing (they keep the values the
    model already holds); any other missing or unexpected key is still an error, as in torch.

    Raises:
        CheckpointError: strict and the saved weights miss keys that were not excluded, or hold unknown ones.
    """
    excluded = set(state["engine"].get("excluded_frozen_parameters") or ())
    saved = state["module"]
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


def _meta_json(meta: dict[str, str], key: str, path: str) -> Any:
    try:
        return json.loads(meta[key])
    except (KeyError, ValueError) as exc:
        raise CheckpointError(
            f"{path} has no valid {key!r} metadata; it was not written by dscore's checkpointer"
        ) from exc


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
    """Restore a checkpoint written by :func:`save_checkpoint` into ``engine`` (collective).

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
            or a file; a file is truncated or malformed; the state does not fit the engine.
        CollectiveArrivalError: not every rank called it within ``DSCORE_ARRIVAL_TIMEOUT`` (names the ranks).
    """
    ensure_all_arrived("load_checkpoint")
    view = _Engine(engine)
    coll = view.coll
    rank, world = coll.rank, coll.world_size
    load_dir_text = os.path.abspath(os.fspath(load_dir)) if load_dir is not None and os.fspath(load_dir) else ""
    tag_arg = None if tag is None else str(tag)

    universal = bool(getattr(getattr(view.config, "checkpoint", None), "load_universal", False))
    source = {"deepspeed": False}

    def resolve() -> str | None:
        if not load_dir_text:
            raise CheckpointError(f"load_dir must be a non-empty path, got {load_dir!r}")
        from dscore.checkpoint import deepspeed as ds

        wanted = tag_arg
        if universal and wanted is None and os.path.isdir(load_dir_text):
            wanted = _universal_tag(load_dir_text)
        if ds.looks_like_deepspeed_tag_dir(load_dir_text) or ds.is_deepspeed_checkpoint(load_dir_text, wanted):
            source["deepspeed"] = True
            return ds.resolve_deepspeed_tag(load_dir_text, wanted, missing_ok=True)
        return L.resolve_tag(load_dir_text, wanted)

    resolved, err = _local_error(resolve)
    asks = coll.all_gather_object((load_dir_text, tag_arg))
    if len(set(asks)) > 1:
        listing = "; ".join(f"rank {r}: load_dir={d!r}, tag={t!r}" for r, (d, t) in enumerate(asks))
        raise CheckpointError(
            f"load_checkpoint was called with different arguments on different ranks ({listing}); every rank "
            "must load the same directory and tag"
        )
    results = _agree(coll, err, f"resolving the checkpoint in {load_dir_text}", resolved)
    if len(set(results)) > 1:  # the filesystem changed under us between ranks
        raise CheckpointError(f"ranks resolved different tags in {load_dir_text}: {results}; retry the load")
    if resolved is None:
        if source["deepspeed"]:
            present = ", ".join(
                repr(n) for n in sorted(os.listdir(load_dir_text)) if os.path.isdir(os.path.join(load_dir_text, n))
            ) or "no tags"
        else:
            present = L.tags_present_text(load_dir_text)
        logger.warning(
            "no checkpoint to load: %s has no '%s' file and no tag was given (tags present: %s); starting fresh. "
            "Pass tag=... to load a specific tag",
            load_dir_text,
            L.LATEST_FILE,
            present,
        )
        return None, None
    tag_text = resolved
    tag_dir = os.path.join(load_dir_text, tag_text)
    model_path = os.path.join(tag_dir, L.MODEL_FILE)

    def read() -> dict[str, Any]:
        if source["deepspeed"]:  # DeepSpeed's pickles, read safely into dscore's full-state structure
            from dscore.checkpoint import deepspeed as ds

            return ds.read_for_engine(
                engine,
                load_dir_text,
                tag_text,
                load_module_strict=load_module_strict,
                load_optimizer_states=load_optimizer_states,
                load_lr_scheduler_states=load_lr_scheduler_states,
                load_module_only=load_module_only,
            )
        manifest = L.read_manifest(tag_dir)
        if manifest is None:
            raise CheckpointNotFoundError(f"checkpoint {tag_dir} lost its {L.COMPLETE_FILE} marker during the load")
        if int(manifest.get("format_version", 0)) > L.FORMAT_VERSION:
            raise CheckpointError(
                f"checkpoint {tag_dir} has format version {manifest['format_version']}; this dscore reads up to "
                f"{L.FORMAT_VERSION}"
            )
        saved_world = int(manifest["world_size"])
        own = L.rank_file(rank) if rank < saved_world else None
        needed = [L.MODEL_FILE, L.ENGINE_FILE]
        if not load_module_only:
            needed.append(L.OPTIM_FILE)
            needed.append(own if own is not None else L.rank_file(0))
        L.check_files(tag_dir, manifest, needed)
        out: dict[str, Any] = {"manifest": manifest}
        out["module"], _ = read_tensor_file(model_path)
        e_path = os.path.join(tag_dir, L.ENGINE_FILE)
        e_tensors, e_meta = read_tensor_file(e_path)
        out["engine"] = decode(_meta_json(e_meta, "engine", e_path), e_tensors, source=e_path)
        out["client"] = decode(_meta_json(e_meta, "client", e_path), e_tensors, source=e_path)
        if not load_module_only:
            o_path = os.path.join(tag_dir, L.OPTIM_FILE)
            o_tensors, o_meta = read_tensor_file(o_path)
            out["optim"] = decode(_meta_json(o_meta, "optim", o_path), o_tensors, source=o_path)
            r_path = os.path.join(tag_dir, own if own is not None else L.rank_file(0))
            r_tensors, r_meta = read_tensor_file(r_path)
            out["rank_tensors"] = r_tensors
            out["rank"] = decode(_meta_json(r_meta, "rank", r_path), r_tensors, source=r_path)
            out["own_rank_file"] = own is not None
        return out

    state, err = _local_error(read)
    _agree(coll, err, f"reading checkpoint {tag_dir}")
    assert state is not None

    def apply() -> None:
        try:
            _load_module(engine, view, state, strict=load_module_strict)
        except RuntimeError as exc:
            raise CheckpointError(f"the module weights in {model_path} do not fit the model: {exc}") from exc
        if load_module_only:
            return
        view.zero.load_state_dict(state["optim"], load_optimizer_states=load_optimizer_states)
        es = state["engine"]
        sched = getattr(engine, "lr_scheduler", None)
        if load_lr_scheduler_states and sched is not None and es.get("lr_scheduler") is not None:
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
        rs = state["rank"]
        if rs is None:  # a DeepSpeed checkpoint: no RNG state or data position recorded (DeepSpeed saves none)
            return
        if rs.get("data_sampler") is not None:
            view.load_data_sampler_state(rs["data_sampler"])
        if rs.get("rng") is None:  # imported from DeepSpeed (`dscore checkpoint import`): RNGs left alone
            pass
        elif state["own_rank_file"]:
            _restore_rng(view.accelerator, state["rank_tensors"], rs["rng"])
        else:
            seed = _derived_seed(tag_text, rank, state["rank_tensors"]["rng/torch_cpu"])
            _seed_everything(seed, view.accelerator)
            logger.info(
                "rank %d did not exist when %s was saved (%d rank(s)); seeded its RNGs with %d derived from the tag "
                "and rank",
                rank,
                tag_dir,
                int(state["manifest"]["world_size"]),
                seed,
            )

    err = _local_error(apply)[1]
    _agree(coll, err, f"loading checkpoint {tag_dir} into the engine")
    if rank == 0:
        logger.info(
            "loaded checkpoint %s (saved with %d rank(s), loaded with %d)",
            tag_dir,
            state["manifest"]["world_size"],
            world,
        )
    view.call_hook("dscore_checkpoint_loaded", load_dir=load_dir_text, tag=tag_text)
    return state.get("load_path", model_path), state["client"]


# ----------------------------------------------------------------------------------------- export


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
    view = _Engine(engine)
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
            L.atomic_write(path, lambda tmp: write_tensor_file(tmp, plain, {"format": "pt"}, fsync=False))
        else:
            L.atomic_write(path, lambda tmp: torch.save(plain, tmp))

    err = _local_error(write)[1] if coll.rank == 0 else None
    _agree(coll, err, f"writing {path}")
    if coll.rank == 0:
        logger.info("saved 16-bit model weights to %s", path)
    return True
