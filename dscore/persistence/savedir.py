"""The checkpoint directory layout, atomic file operations, tag rules and the load-path rules.

Layout of one save directory (every name here is a constant below)::

    <save_dir>/latest                              text: the newest complete tag (no newline)
    <save_dir>/<tag>/_COMPLETE                     JSON manifest, written last: files, sizes, world size
    <save_dir>/<tag>/model_states.safetensors      full module state dict (rank 0; a plain state dict)
    <save_dir>/<tag>/optim_states.safetensors      ZeroStage.state_dict() (rank 0; full tensors)
    <save_dir>/<tag>/engine_states.safetensors     counters, LR scheduler, loss scaler, client_state
    <save_dir>/<tag>/rank_00000_states.safetensors RNG states and data-loader position of rank 0 (one per rank)
    <save_dir>/.<tag>.tmp-<token>/                 a save in progress (or killed); never read

A tag directory only ever appears under its final name complete: it is assembled under a hidden
temporary name and renamed (exchanged, when the tag already exists) in one step after every rank
finished writing and ``_COMPLETE`` is in it. ``latest`` is replaced by rename after that.

Pipeline checkpoints (the pipeline engine plugin's, through this public module) hold other file
names but follow the same rules through the same helpers (the phases of a save, :func:`resolve_tag`); their ``_COMPLETE`` says
``"kind": "pipeline"`` (absent: ``"standard"``), so each engine refuses the other's checkpoints by name.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dscore.errors import (
    CheckpointArgumentError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointTagMismatchError,
)

if TYPE_CHECKING:
    from dscore.comm import Comm

__all__ = [
    "COMPLETE_FILE",
    "ENGINE_FILE",
    "FORMAT",
    "FORMAT_VERSION",
    "FSYNC_ENV",
    "LATEST_FILE",
    "MODEL_FILE",
    "OPTIM_FILE",
    "agree",
    "atomic_write",
    "atomic_write_bytes",
    "capture",
    "check_files",
    "choose_tag",
    "durable",
    "exchange_or_rename",
    "fsync_dir",
    "is_complete",
    "list_tags",
    "prepare_tmp_dir",
    "publish",
    "rank_file",
    "read_latest",
    "read_manifest",
    "remove_stale",
    "resolve_tag",
    "tags_present_text",
    "tmp_dir_path",
    "validate_tag",
]

logger = logging.getLogger("dscore.checkpoint")

FORMAT = "dscore-checkpoint"
FORMAT_VERSION = 1
LATEST_FILE = "latest"
COMPLETE_FILE = "_COMPLETE"
MODEL_FILE = "model_states.safetensors"
OPTIM_FILE = "optim_states.safetensors"
ENGINE_FILE = "engine_states.safetensors"
_RANK_FILE_RE = re.compile(r"^rank_(\d{5,})_states\.safetensors$")
_TAG_MARKERS = (COMPLETE_FILE, MODEL_FILE, ENGINE_FILE)


def rank_file(rank: int) -> str:
    """File name of one rank's own state (RNG, data-loader position)."""
    return f"rank_{rank:05d}_states.safetensors"


# --------------------------------------------------------------------------------------------- atomic


#: Environment variable: "1"/"true"/"yes"/"on" fsyncs every file and directory of a save before it is
#: published (durable across a power loss or kernel crash; costs the disk write time, 0.5-1x of a
#: torch.save on the benchmark machine). Default off, like torch.save and DeepSpeed: a save is still atomic
#: against a killed process (renames), and after a power loss a torn file is caught at load by the size
#: recorded in ``_COMPLETE``.
FSYNC_ENV = "DSCORE_CHECKPOINT_FSYNC"


def durable() -> bool:
    """Whether saves fsync their files and directories (see :data:`FSYNC_ENV`)."""
    return os.environ.get(FSYNC_ENV, "0").strip().lower() in ("1", "true", "yes", "on")


def fsync_dir(path: str) -> None:
    """Flush a directory entry table to stable storage (no-op where directories cannot be opened, or when
    :func:`durable` is False)."""
    if not durable():
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str, write: Callable[[str], object], *, fsync: bool | None = None) -> None:
    """Have ``write(tmp)`` create the file at a private temporary name ``<path>.tmp-<pid>-<random>``, then
    ``os.replace`` it onto ``path`` (fsync'd first, with its directory after, when ``fsync`` or
    :func:`durable`).

    A reader sees either the old file or the complete new one; a failed ``write`` removes the temporary
    file and re-raises; a crash leaves at most the temporary file (:func:`remove_stale` clears it).
    """
    fsync = durable() if fsync is None else fsync
    tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        write(tmp)
        if fsync:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if fsync:
        fsync_dir(os.path.dirname(os.path.abspath(path)))


def atomic_write_bytes(path: str, data: bytes, *, fsync: bool | None = None) -> None:
    """Write ``data`` to ``path`` atomically (:func:`atomic_write`)."""

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)

    atomic_write(path, write, fsync=fsync)


_RENAME_EXCHANGE = 2
_renameat2: Callable[..., int] | None | bool = False  # False = not looked up yet


def _lookup_renameat2() -> Callable[..., int] | None:
    global _renameat2
    if _renameat2 is False:
        fn = None
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            fn = libc.renameat2
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            fn.restype = ctypes.c_int
        except (OSError, AttributeError):
            fn = None
        _renameat2 = fn
    return _renameat2 or None  # type: ignore[return-value]


def exchange_or_rename(src: str, dst: str) -> str | None:
    """Move directory ``src`` to ``dst``; when ``dst`` exists, swap the two in one step.

    Uses Linux ``renameat2(RENAME_EXCHANGE)`` so ``dst`` is never absent; elsewhere (or on filesystems
    without it) falls back to renaming the old ``dst`` aside first.

    Returns:
        The path now holding the previous ``dst`` (to be deleted by the caller), or None when ``dst``
        did not exist.
    """
    if not os.path.lexists(dst):
        os.rename(src, dst)
        return None
    fn = _lookup_renameat2()
    if fn is not None:
        at_fdcwd = -100
        if fn(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), _RENAME_EXCHANGE) == 0:
            return src  # src now holds the old directory
    parent, name = os.path.split(dst)
    aside = os.path.join(parent, f".{name}.old-{uuid.uuid4().hex}")
    os.rename(dst, aside)
    os.rename(src, dst)
    return aside


def remove_stale(save_dir: str, tag: str) -> list[str]:
    """Delete leftovers of killed saves of ``tag`` (``.<tag>.tmp-*``, ``.<tag>.old-*``) and stray
    ``latest.tmp-*`` files. Assumes one job saves into ``save_dir`` at a time. Returns what was removed."""
    removed: list[str] = []
    try:
        names = os.listdir(save_dir)
    except FileNotFoundError:
        return removed
    prefixes = (f".{tag}.tmp-", f".{tag}.old-", f"{LATEST_FILE}.tmp-")
    for name in names:
        if name.startswith(prefixes):
            path = os.path.join(save_dir, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.unlink(path)
                except OSError:
                    continue
            removed.append(name)
    if removed:
        logger.info("removed leftovers of an interrupted save in %s: %s", save_dir, ", ".join(sorted(removed)))
    return removed


# ----------------------------------------------------------------------------------------------- tags


def validate_tag(tag: object) -> str:
    """Return ``str(tag)`` if it can name a tag directory.

    Raises:
        CheckpointArgumentError: empty, ``.``/``..``, a leading ``.`` (reserved for temporary directories), a path
            separator or NUL, the name ``latest``, or longer than 255 bytes.
    """
    text = str(tag)
    problem = None
    if not text:
        problem = "it is empty"
    elif text in (".", ".."):
        problem = "it names the current or parent directory"
    elif text.startswith("."):
        problem = "it starts with '.', which dscore reserves for in-progress saves"
    elif "/" in text or "\\" in text or os.sep in text or "\0" in text:
        problem = "it contains a path separator or NUL"
    elif text == LATEST_FILE:
        problem = f"'{LATEST_FILE}' is the name of the file that records the newest tag"
    elif len(os.fsencode(text)) > 255:
        problem = "it is longer than 255 bytes"
    if problem:
        raise CheckpointArgumentError(
            f"invalid checkpoint tag {text!r}: {problem}. A tag is one directory name such as 'global_step100'"
        )
    return text


def _natural_key(name: str) -> list[Any]:
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", name) if p]


def read_manifest(tag_dir: str) -> dict[str, Any] | None:
    """The parsed ``_COMPLETE`` manifest of a tag directory, or None when absent or unreadable."""
    try:
        with open(os.path.join(tag_dir, COMPLETE_FILE), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return None
    return data


def is_complete(tag_dir: str) -> bool:
    """True when ``tag_dir`` holds a ``_COMPLETE`` manifest written by dscore."""
    return read_manifest(tag_dir) is not None


def list_tags(save_dir: str) -> list[tuple[str, bool]]:
    """``[(tag, complete), ...]`` for every tag directory in ``save_dir``, in natural order
    (``global_step2`` before ``global_step10``). Hidden (in-progress) directories are skipped."""
    try:
        names = os.listdir(save_dir)
    except (FileNotFoundError, NotADirectoryError):
        return []
    tags = []
    for name in sorted(names, key=_natural_key):
        path = os.path.join(save_dir, name)
        if name.startswith(".") or not os.path.isdir(path):
            continue
        tags.append((name, is_complete(path)))
    return tags


def read_latest(save_dir: str) -> str | None:
    """The tag named by ``<save_dir>/latest`` (stripped), or None when the file does not exist."""
    try:
        with open(os.path.join(save_dir, LATEST_FILE), encoding="utf-8") as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


def _looks_like_tag_dir(path: str) -> bool:
    if not os.path.isdir(path):
        return False
    try:
        names = set(os.listdir(path))
    except OSError:
        return False
    return bool(names & set(_TAG_MARKERS)) or any(_RANK_FILE_RE.match(n) for n in names)


def _complete_text(save_dir: str) -> str:
    complete = [t for t, ok in list_tags(save_dir) if ok]
    return ", ".join(repr(t) for t in complete) if complete else "none"


def resolve_tag(
    load_dir: str,
    tag: str | None,
    *,
    what: str = "load_checkpoint",
    kind: str = "standard",
    legacy: Callable[[str], bool] | None = None,
) -> str | None:
    """Apply the load-path rules; return the tag to load, or None for "nothing to resume from".

    ``kind`` is the checkpoint kind the caller reads (the manifest's ``"kind"``; manifests without one are
    ``"standard"``); ``legacy(tag_dir)`` may accept a tag directory without ``_COMPLETE`` written by a format
    older than the marker (the caller then checks its files itself).

    Rules (in order):

    * ``load_dir`` does not exist -> :class:`CheckpointNotFoundError` naming it.
    * ``load_dir`` is a tag directory, or a file inside one -> :class:`CheckpointError` suggesting
      ``load_checkpoint(<save_dir>, tag=<tag>)``; any other file -> :class:`CheckpointError`.
    * ``tag`` is None and there is no ``latest`` -> None (the caller warns, listing the tags present).
    * the tag (given, or read from ``latest``) is missing or incomplete (and not accepted by ``legacy``) ->
      :class:`CheckpointNotFoundError` listing the complete tags.
    * the tag was written by another kind of engine -> :class:`CheckpointError` saying which reads it.
    """
    if not os.path.exists(load_dir):
        raise CheckpointNotFoundError(f"checkpoint directory {load_dir} does not exist")
    if not os.path.isdir(load_dir):
        parent = os.path.dirname(os.path.abspath(load_dir))
        if _looks_like_tag_dir(parent):
            save_dir, tag_name = os.path.split(parent)
            raise CheckpointError(
                f"{load_dir} is a file inside the checkpoint tag {tag_name!r}; pass the save directory and the "
                f"tag instead: {what}({save_dir!r}, tag={tag_name!r})"
            )
        raise CheckpointError(f"{load_dir} is a file; {what} expects the directory given to save_checkpoint")
    if _looks_like_tag_dir(load_dir):
        save_dir, tag_name = os.path.split(os.path.abspath(load_dir))
        raise CheckpointError(
            f"{load_dir} is a checkpoint tag directory, not a save directory; use "
            f"{what}({save_dir!r}, tag={tag_name!r})"
        )
    source = "requested"
    if tag is None:
        tag = read_latest(load_dir)
        if tag is None:
            return None
        source = f"named by {os.path.join(load_dir, LATEST_FILE)}"
        if not tag:
            raise CheckpointError(
                f"{os.path.join(load_dir, LATEST_FILE)} is empty; complete tags: {_complete_text(load_dir)}"
            )
    tag = validate_tag(tag)
    tag_dir = os.path.join(load_dir, tag)
    if not os.path.isdir(tag_dir):
        raise CheckpointNotFoundError(
            f"checkpoint tag {tag!r} ({source}) does not exist in {load_dir}; complete tags: {_complete_text(load_dir)}"
        )
    manifest = read_manifest(tag_dir)
    if manifest is None:
        if legacy is not None and legacy(tag_dir):
            return tag
        raise CheckpointNotFoundError(
            f"checkpoint tag {tag!r} ({source}) in {load_dir} is incomplete (no valid {COMPLETE_FILE} marker: the "
            f"save did not finish or the tag was not written by dscore); complete tags: {_complete_text(load_dir)}"
        )
    saved_kind = str(manifest.get("kind", "standard"))
    if saved_kind != kind:
        raise CheckpointError(
            f"checkpoint {tag_dir} was written by the {saved_kind} engine and {what} here reads {kind} checkpoints; "
            f"load it with {_KIND_READERS.get(saved_kind, f'an engine of kind {saved_kind!r}')}"
        )
    return tag


#: Who reads a checkpoint of each manifest ``"kind"`` (for the wrong-kind error).
_KIND_READERS = {
    "standard": "the standard engine's load_checkpoint (a model that is not a PipelineModule) or "
    "dscore.checkpoint.get_fp32_state_dict_from_checkpoint",
    "pipeline": "the pipeline engine's load_checkpoint (a dscore.pipe.PipelineModule) or dscore.pipe.load_into_layers",
}


def tags_present_text(save_dir: str) -> str:
    """Human-readable list of the tags in ``save_dir`` with their completeness."""
    tags = list_tags(save_dir)
    if not tags:
        return "no tags"
    return ", ".join(f"{t!r}" + ("" if ok else " (incomplete)") for t, ok in tags)


# ------------------------------------------------------------------------------------ phases of a save
#
# A collective save runs in phases; each ends with :func:`agree`, so an error on any rank is raised on every
# rank instead of leaving the others waiting: validate the request, rank 0 creates the private temporary
# directory (:func:`prepare_tmp_dir`), every rank writes its files into it, rank 0 publishes it
# (:func:`publish`). Both engines (:mod:`dscore.checkpoint`, the pipeline engine plugin) save this way.


def capture(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, Exception | None]:
    """``(fn(*args, **kwargs), None)``, or ``(None, exc)`` when it raised an :class:`Exception`: one rank's
    outcome of a phase, for :func:`agree` (a ``BaseException`` such as ``KeyboardInterrupt`` propagates)."""
    try:
        return fn(*args, **kwargs), None
    except Exception as exc:
        return None, exc


def agree(comm: Comm, error: BaseException | None, what: str, payload: Any = None) -> list[Any]:
    """:meth:`dscore.comm.Comm.agree` with the checkpoint error types (collective).

    Returns:
        every rank's ``payload`` in rank order when no rank failed.

    Raises:
        CheckpointNotFoundError / CheckpointArgumentError / CheckpointTagMismatchError / CheckpointError: on every rank when any rank failed (other exception types
            become CheckpointError); the message names ``what`` and the failing ranks with their errors.
    """
    return comm.agree(
        error,
        what,
        payload,
        error_types=(CheckpointNotFoundError, CheckpointArgumentError, CheckpointTagMismatchError, CheckpointError),
        default_error=CheckpointError,
    )


def choose_tag(tags: list[str], mode: str, rank: int) -> str:
    """The tag a save uses given every rank's tag (``tags[r]`` from rank ``r``), per ``checkpoint.tag_validation``.

    Equal tags are used as they are. Different tags: ``FAIL`` raises; ``WARN`` logs on rank 0 and ``IGNORE``
    stays silent, both using rank 0's tag (DeepSpeed would write one checkpoint per distinct tag).

    Raises:
        CheckpointTagMismatchError: the tags differ and ``mode`` is ``FAIL`` (every rank raises it: ``tags`` is agreed).
    """
    tag = tags[0]
    if len(set(tags)) > 1 and mode != "IGNORE":
        listing = ", ".join(f"rank {r}: {t!r}" for r, t in enumerate(tags))
        message = (
            f"the checkpoint tag is not the same on every rank ({listing}); pass the same tag on every rank or "
            "tag=None for 'global_step<N>'"
        )
        if mode == "FAIL":
            raise CheckpointTagMismatchError(message + " (checkpoint.tag_validation is FAIL)")
        if rank == 0:
            logger.warning("%s; saving under rank 0's tag %r (checkpoint.tag_validation is WARN)", message, tag)
    return tag


def tmp_dir_path(save_dir: str, tag: str, token: str) -> str:
    """The private directory a save of ``tag`` assembles its files in (``<save_dir>/.<tag>.tmp-<token>``)."""
    return os.path.join(save_dir, f".{tag}.tmp-{token}")


def prepare_tmp_dir(save_dir: str, tag: str, tmp_dir: str) -> None:
    """Create ``save_dir`` when missing, remove leftovers of killed saves of ``tag``, create ``tmp_dir``
    (rank 0, before any rank writes)."""
    os.makedirs(save_dir, exist_ok=True)
    remove_stale(save_dir, tag)
    os.mkdir(tmp_dir)


def publish(
    save_dir: str,
    tag: str,
    tmp_dir: str,
    written: list[dict[str, int]],
    hosts: list[str],
    fields: dict[str, Any],
    *,
    save_latest: bool,
) -> None:
    """Seal ``tmp_dir`` and publish it as ``<save_dir>/<tag>``, then point ``latest`` at it (rank 0, after
    every rank wrote its files).

    Writes ``_COMPLETE`` (format, version, tag, world size, torch version, ``fields``, and every file with the
    rank that wrote it and its size), fsyncs per :func:`durable`, swaps the directory in with
    :func:`exchange_or_rename` (the previous ``<tag>`` is deleted after), then replaces ``latest``.

    Args:
        written: per rank (index = rank), ``{file name: bytes}`` of the files it wrote into ``tmp_dir``.
        hosts: per rank, its host name (for the shared-filesystem error).
        fields: extra manifest entries (``zero_stage``, ``global_steps``, ``kind``, ...).

    Raises:
        CheckpointError: a file a rank wrote is not visible here (``save_dir`` not shared), or two ranks
            wrote the same file.
        OSError: writing the manifest or renaming failed.
    """
    import torch

    files: dict[str, dict[str, int]] = {}
    for r, names in enumerate(written):
        for name, nbytes in names.items():
            if name in files:
                raise CheckpointError(f"ranks {files[name]['rank']} and {r} both wrote {name} into {tmp_dir}")
            if not os.path.exists(os.path.join(tmp_dir, name)):
                raise CheckpointError(
                    f"rank {r} ({hosts[r]}) wrote {name} but rank 0 cannot see it in {tmp_dir}: save_dir "
                    "must be on a filesystem shared by every rank"
                )
            files[name] = {"rank": r, "bytes": int(nbytes)}
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "tag": tag,
        "world_size": len(written),
        **fields,
        "created_unix_s": time.time(),
        "torch_version": torch.__version__,
        "files": files,
    }
    atomic_write_bytes(os.path.join(tmp_dir, COMPLETE_FILE), json.dumps(manifest, indent=1).encode())
    fsync_dir(tmp_dir)
    old = exchange_or_rename(tmp_dir, os.path.join(save_dir, tag))
    fsync_dir(save_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    if save_latest:
        atomic_write_bytes(os.path.join(save_dir, LATEST_FILE), tag.encode("utf-8"))


def check_files(tag_dir: str, manifest: dict[str, Any], names: list[str]) -> None:
    """Check that each file of ``names`` is listed in the manifest and has the size recorded at save.

    Raises:
        CheckpointNotFoundError: a file is missing (names the rank that wrote it).
        CheckpointError: a file is not in the manifest, or its size differs (truncated or modified).
    """
    files = manifest.get("files", {})
    saved_world = manifest.get("world_size", "?")
    for name in names:
        entry = files.get(name)
        writer = f"rank {entry['rank']}" if entry else "an unknown rank"
        path = os.path.join(tag_dir, name)
        if entry is None:
            raise CheckpointError(
                f"checkpoint {tag_dir} does not list {name} in its {COMPLETE_FILE} manifest (files: "
                f"{', '.join(sorted(files))})"
            )
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            raise CheckpointNotFoundError(
                f"checkpoint {tag_dir} is missing {name}, the file written by {writer} of {saved_world} at save"
            ) from None
        if size != entry["bytes"]:
            raise CheckpointError(
                f"checkpoint file {path} (written by {writer} of {saved_world}) is {size} bytes but the manifest "
                f"records {entry['bytes']}: it was truncated or modified after the save"
            )
