"""Per-layer checkpoints of a pipeline (DeepSpeed's ``layer_XX-model_states.pt`` layout), saved atomically.

A pipeline checkpoint ``<save_dir>/<tag>/`` holds

* ``layer_{idx:02d}-model_states.pt``: the state dict of layer ``idx`` (keys relative to the layer, e.g.
  ``"weight"``), one file per layer that has state, written by data-parallel rank 0 of the owning stage.
  A tied layer's file holds the tied module's state (every position of the tie has one, all equal);
* ``optim_states-stage_{s:02d}.pt``: stage ``s``'s ZeRO-stage optimizer state (world-size independent,
  keyed by the global parameter names ``"3.weight"`` / ``"tied_modules.embed.weight"``);
* ``engine_states.pt``: counters, LR scheduler, layout (``num_layers``, ``num_stages``, ``parts``),
  ``client_state``;
* ``_COMPLETE``: the JSON manifest of :mod:`dscore.persistence` with ``"kind": "pipeline"`` (every file,
  the rank that wrote it and its size), written last;
* ``<save_dir>/latest``: the tag of the last complete save.

Because files are per layer and optimizer state is keyed by global names, a checkpoint saved with
``p`` stages loads with any other number of stages (each stage reads the layers it owns and picks its
parameters out of every stage's optimizer file), and into a plain model with :func:`load_into_layers`.

Saving (:func:`save_pipeline_checkpoint`) follows the standard engine's protocol: the request is validated
and agreed by every rank, the files are written into a private ``<save_dir>/.<tag>.tmp-<token>`` directory,
every rank's outcome is agreed (a failed write on one rank raises the same :class:`CheckpointError` on
every rank), then rank 0 writes ``_COMPLETE``, swaps the directory in under ``<tag>`` in one rename
(``renameat2(RENAME_EXCHANGE)`` when the tag exists) and moves ``latest`` last. A save that fails or is
killed leaves the previous ``<tag>`` and ``latest`` as they were.

Loading (:func:`find_checkpoint`) applies the standard load-path rules: a tag folder without ``_COMPLETE``
is refused naming the folder, except one written before pipeline saves had the marker (its
``engine_states.pt`` does not say that a marker is written), which still loads with a warning; hidden
in-progress folders cannot be named as tags.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from dscore.errors import CheckpointError, CheckpointNotFoundError
from dscore.persistence import savedir as L
from dscore.persistence.savedir import COMPLETE_FILE, LATEST_FILE, agree, atomic_write, capture
from dscore.persistence.tree import encode

if TYPE_CHECKING:
    from dscore.comm import Comm

__all__ = [
    "COMPLETE_FILE",
    "ENGINE_FILE",
    "KIND",
    "LATEST_FILE",
    "agree",
    "atomic_save",
    "capture",
    "check_files",
    "find_checkpoint",
    "is_legacy_checkpoint",
    "layer_file",
    "layer_name",
    "layer_state_dicts",
    "load_file",
    "load_into_layers",
    "optim_file",
    "optim_name",
    "resolve_tag",
    "save_pipeline_checkpoint",
]

logger = logging.getLogger("dscore.pipe.checkpoint")

ENGINE_FILE = "engine_states.pt"
#: The manifest ``"kind"`` of a pipeline checkpoint (the standard engine refuses it, naming the reader).
KIND = "pipeline"
#: Key of ``engine_states.pt`` saying the save also wrote ``_COMPLETE`` (absent in older checkpoints).
_MARKER_KEY = "complete_marker"
_LAYER_RE = re.compile(r"^layer_(\d+)-model_states\.pt$")


def layer_name(idx: int) -> str:
    """File name of layer ``idx``'s state (``layer_{idx:02d}-model_states.pt``)."""
    return f"layer_{idx:02d}-model_states.pt"


def optim_name(stage: int) -> str:
    """File name of stage ``stage``'s optimizer state (``optim_states-stage_{stage:02d}.pt``)."""
    return f"optim_states-stage_{stage:02d}.pt"


def layer_file(ckpt_dir: str, idx: int) -> str:
    """Path of layer ``idx``'s state in the tag folder ``ckpt_dir``."""
    return os.path.join(ckpt_dir, layer_name(idx))


def optim_file(ckpt_dir: str, stage: int) -> str:
    """Path of stage ``stage``'s optimizer state in the tag folder ``ckpt_dir``."""
    return os.path.join(ckpt_dir, optim_name(stage))


def atomic_save(obj: Any, path: str) -> None:
    """``torch.save`` through a temporary name and a rename, as every checkpoint file is written (a reader
    never sees half a file; ``DSCORE_CHECKPOINT_FSYNC=1`` makes it durable)."""
    atomic_write(path, lambda tmp: torch.save(obj, tmp))


def load_file(path: str) -> Any:
    """``torch.load`` on CPU (weights only: tensors, numbers, strings, lists, dicts).

    Raises:
        CheckpointNotFoundError: the file does not exist.
        CheckpointError: it cannot be read (names the file).
    """
    if not os.path.isfile(path):
        raise CheckpointNotFoundError(f"pipeline checkpoint file {path} does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"cannot read pipeline checkpoint file {path}: {type(exc).__name__}: {exc}") from exc


# ------------------------------------------------------------------------------------------------ save


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not name or os.path.basename(name) != name or name.startswith("."):
        raise CheckpointError(f"pipeline checkpoint file name {name!r} is not a plain file name")
    if name == COMPLETE_FILE:
        raise CheckpointError(f"{COMPLETE_FILE} is written by the save itself, not by a rank")
    return name


def save_pipeline_checkpoint(
    comm: Comm,
    save_dir: str | os.PathLike[str],
    tag: object,
    collect: Callable[[], dict[str, Any]],
    *,
    client_state: Any = None,
    tag_validation: str = "WARN",
    save_latest: bool = True,
    fields: dict[str, Any] | None = None,
) -> str:
    """Save a pipeline checkpoint atomically (collective: every rank of ``comm`` calls it).

    Phases, each agreed by every rank (an error on one rank is raised on all of them, naming it):

    1. validate ``save_dir``, ``tag`` (one directory name) and ``client_state`` (a dict of JSON-like values
       and tensors, the key path of anything else named); compare the tags (``tag_validation``);
    2. rank 0 creates ``<save_dir>`` when missing, clears leftovers of killed saves of the tag and creates
       the private ``<save_dir>/.<tag>.tmp-<token>``;
    3. every rank calls ``collect()`` (it may run collectives) and writes the files it returns into the
       temporary directory; when that failed on any rank, rank 0 removes the temporary directory;
    4. rank 0 writes ``_COMPLETE`` (``"kind": "pipeline"`` plus ``fields``), publishes the directory as
       ``<save_dir>/<tag>`` in one rename (an existing tag is swapped, then deleted) and, with
       ``save_latest``, moves ``latest``.

    Args:
        comm: the :class:`dscore.comm.Comm` of the whole job.
        save_dir: the save directory; on a filesystem every rank sees.
        tag: the tag directory name (``str()``-ed).
        collect: returns this rank's ``{file name: object}`` (``torch.save``-d, loaded back with
            ``weights_only=True``); exactly one rank returns :data:`ENGINE_FILE` (a dict), into which
            ``client_state`` is stored under ``"client_state"``.
        client_state: the user's state (the copy of the rank writing :data:`ENGINE_FILE` is saved).
        tag_validation: ``checkpoint.tag_validation`` (``FAIL``/``WARN``/``IGNORE``), as the standard engine.
        save_latest: point ``<save_dir>/latest`` at the tag once it is published.
        fields: extra manifest entries (``global_steps``, ``num_stages``, ...).

    Returns:
        The tag saved (rank 0's under ``WARN``/``IGNORE`` when the ranks' tags differ).

    Raises:
        CheckpointError: on every rank: an invalid request, a failure writing on any rank (disk full,
            unwritable directory: the rank and its error named) or publishing. Nothing under ``<tag>`` or
            ``latest`` changes unless the whole save succeeded.
    """
    rank = int(comm.get_rank())

    def check() -> dict[str, Any]:
        if save_dir is None or not os.fspath(save_dir):
            raise CheckpointError(f"save_dir must be a non-empty path, got {save_dir!r}")
        tag_text = L.validate_tag(tag)
        if client_state is not None and not isinstance(client_state, dict):
            raise CheckpointError(f"client_state must be a dict (or None), got {type(client_state).__name__}")
        # the standard engine's rule: what it could not store without pickle is refused at save, key path named
        encode(client_state or {}, root="client_state", tensor_prefix="client/", tensors={})
        info = {"tag": tag_text, "host": socket.gethostname()}
        if rank == 0:
            info["token"] = uuid.uuid4().hex
        return info

    info, err = capture(check)
    infos = agree(comm, err, "validating the pipeline checkpoint request", info)
    tag_text = L.choose_tag([i["tag"] for i in infos], str(tag_validation).upper(), rank)
    root = os.path.abspath(os.fspath(save_dir))
    tmp_dir = L.tmp_dir_path(root, tag_text, infos[0]["token"])

    err = capture(L.prepare_tmp_dir, root, tag_text, tmp_dir)[1] if rank == 0 else None
    agree(comm, err, f"creating {tmp_dir}")

    def write(files: dict[str, Any]) -> dict[str, int]:
        written: dict[str, int] = {}
        for name, obj in files.items():
            _check_name(name)
            if name == ENGINE_FILE:
                if not isinstance(obj, dict):
                    raise CheckpointError(f"the {ENGINE_FILE} content must be a dict, got {type(obj).__name__}")
                obj = {**obj, "client_state": client_state or {}, _MARKER_KEY: COMPLETE_FILE}
            path = os.path.join(tmp_dir, name)
            atomic_save(obj, path)
            written[name] = os.path.getsize(path)
        return written

    # collect() may run collectives, so a failure before them still strands the other ranks in them; one
    # after them (or in the writes) is agreed like any other
    files, err = capture(collect)
    written = None
    if err is None:
        written, err = capture(write, files)
    what = f"gathering and writing the files of pipeline checkpoint {tag_text!r} into {tmp_dir}"
    try:
        manifests = agree(comm, err, what, written)
    except CheckpointError:
        if rank == 0:  # every rank is past its writes: the partial directory can go
            shutil.rmtree(tmp_dir, ignore_errors=True)
        raise

    def publish() -> None:
        if sum(ENGINE_FILE in m for m in manifests) != 1:
            raise CheckpointError(f"exactly one rank must write {ENGINE_FILE}; written: {manifests}")
        manifest_fields = {"kind": KIND, **(fields or {})}
        L.publish(root, tag_text, tmp_dir, manifests, [i["host"] for i in infos], manifest_fields,
                  save_latest=save_latest)

    err = capture(publish)[1] if rank == 0 else None
    agree(comm, err, f"publishing pipeline checkpoint {os.path.join(root, tag_text)}")
    return tag_text


# ------------------------------------------------------------------------------------------------ load


def is_legacy_checkpoint(tag_dir: str) -> bool:
    """True for a pipeline tag folder written before pipeline saves wrote ``_COMPLETE``: its
    ``engine_states.pt`` loads and holds the pipeline ``layout`` but no completion-marker key. (A folder of
    the current format without ``_COMPLETE`` is incomplete or was modified, and is refused.)"""
    path = os.path.join(tag_dir, ENGINE_FILE)
    if not os.path.isfile(path):
        return False
    try:
        state = load_file(path)
    except CheckpointError:
        return False
    return isinstance(state, dict) and "layout" in state and _MARKER_KEY not in state


def _legacy_accepted(tag_dir: str) -> bool:
    if not is_legacy_checkpoint(tag_dir):
        return False
    logger.warning(
        "pipeline checkpoint %s has no %s marker (written before pipeline saves had one); loading it, each file "
        "is checked for presence only",
        tag_dir,
        COMPLETE_FILE,
    )
    return True


def find_checkpoint(load_dir: str | os.PathLike[str], tag: object = None) -> str | None:
    """The tag folder to load (``tag``, else the one ``latest`` names), or None when no tag is given and
    ``load_dir`` has no ``latest`` (nothing to resume from).

    The standard engine's load-path rules (:func:`dscore.persistence.savedir.resolve_tag`) with the
    pipeline's kind; a folder without ``_COMPLETE`` loads only when :func:`is_legacy_checkpoint`.

    Raises:
        CheckpointNotFoundError: ``load_dir`` or the tag folder does not exist, or the folder is incomplete
            (no ``_COMPLETE`` and not a pre-marker checkpoint); the message names it and lists complete tags.
        CheckpointError: an invalid tag (e.g. a hidden in-progress folder), ``load_dir`` is itself a tag
            folder, or the tag was written by the standard engine.
    """
    root = os.path.abspath(os.fspath(load_dir))
    resolved = L.resolve_tag(root, None if tag is None else str(tag), kind=KIND, legacy=_legacy_accepted)
    return None if resolved is None else os.path.join(root, resolved)


def resolve_tag(load_dir: str | os.PathLike[str], tag: object = None) -> str:
    """The tag folder to read: ``tag``, else the one ``<load_dir>/latest`` names (see :func:`find_checkpoint`).

    Raises:
        CheckpointNotFoundError: no ``latest`` file and no tag; see :func:`find_checkpoint`.
        CheckpointError: see :func:`find_checkpoint`.
    """
    path = find_checkpoint(load_dir, tag)
    if path is None:
        raise CheckpointNotFoundError(
            f"no tag given and {os.path.join(os.fspath(load_dir), LATEST_FILE)} does not exist; pass tag= or load a "
            "folder written by save_checkpoint"
        )
    return path


def check_files(tag_dir: str, names: Sequence[str]) -> None:
    """Check the files ``names`` of a tag folder before reading them: listed in ``_COMPLETE`` with the size
    recorded at save (a pre-marker folder: present).

    Raises:
        CheckpointNotFoundError: a file is missing (the rank that wrote it named).
        CheckpointError: a file is not in the manifest, or was truncated or modified after the save.
    """
    manifest = L.read_manifest(tag_dir)
    if manifest is not None:
        L.check_files(tag_dir, manifest, list(names))
        return
    for name in names:
        if not os.path.isfile(os.path.join(tag_dir, name)):
            raise CheckpointNotFoundError(f"pipeline checkpoint {tag_dir} (no {COMPLETE_FILE} marker) is missing {name}")


def layer_state_dicts(load_dir: str, tag: str | None = None) -> dict[int, dict[str, torch.Tensor]]:
    """``{layer index: state dict}`` of every layer file of a pipeline checkpoint (on CPU).

    Raises:
        CheckpointNotFoundError: the folder (or ``latest``) is missing or incomplete, or it holds no layer file.
        CheckpointError: a layer file is truncated or unreadable (see :func:`check_files`).
    """
    path = resolve_tag(load_dir, tag)
    names = [n for n in sorted(os.listdir(path)) if _LAYER_RE.match(n)]
    if not names:
        raise CheckpointNotFoundError(f"{path} holds no layer_XX-model_states.pt file; is it a pipeline checkpoint?")
    check_files(path, names)
    out: dict[int, dict[str, torch.Tensor]] = {}
    for name in names:
        m = _LAYER_RE.match(name)
        assert m is not None
        out[int(m.group(1))] = load_file(os.path.join(path, name))
    return out


def load_into_layers(
    layers: Sequence[torch.nn.Module | None], load_dir: str, tag: str | None = None, *, strict: bool = True
) -> list[int]:
    """Load a pipeline checkpoint into a plain model given as its layers, in pipeline order.

    ``layers[i]`` is the module playing layer ``i`` of the :class:`~dscore.pipe.PipelineModule` (the same
    module object may appear at several positions, e.g. an embedding reused as the output head), or None
    for a layer without state (a function).

    Returns:
        The layer indices loaded.

    Raises:
        CheckpointError: the number of layers differs from the checkpoint's, a module has no file, or
            (``strict``) keys do not match (names the layer).
    """
    states = layer_state_dicts(load_dir, tag)
    last = max(states)
    if last >= len(layers):
        raise CheckpointError(f"the checkpoint has layer files up to layer {last} but {len(layers)} layers were given")
    loaded = []
    for i, module in enumerate(layers):
        if module is None:
            continue
        if i not in states:
            if any(True for _ in module.state_dict()):
                raise CheckpointError(f"layer {i} ({type(module).__name__}) has state but the checkpoint has no file for it")
            continue
        try:
            module.load_state_dict(states[i], strict=strict)
        except RuntimeError as exc:
            raise CheckpointError(f"layer {i} ({type(module).__name__}): {exc}") from exc
        loaded.append(i)
    return loaded
