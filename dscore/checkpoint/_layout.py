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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable
from typing import Any

from dscore.errors import CheckpointError, CheckpointNotFoundError

__all__ = [
    "COMPLETE_FILE",
    "ENGINE_FILE",
    "FORMAT",
    "FORMAT_VERSION",
    "FSYNC_ENV",
    "LATEST_FILE",
    "MODEL_FILE",
    "OPTIM_FILE",
    "atomic_write",
    "atomic_write_bytes",
    "durable",
    "exchange_or_rename",
    "fsync_dir",
    "is_complete",
    "list_tags",
    "rank_file",
    "read_latest",
    "read_manifest",
    "remove_stale",
    "resolve_tag",
    "tags_present_text",
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
        CheckpointError: empty, ``.``/``..``, a leading ``.`` (reserved for temporary directories), a path
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
        raise CheckpointError(
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


def resolve_tag(load_dir: str, tag: str | None, *, what: str = "load_checkpoint") -> str | None:
    """Apply the load-path rules; return the tag to load, or None for "nothing to resume from".

    Rules (in order):

    * ``load_dir`` does not exist -> :class:`CheckpointNotFoundError` naming it.
    * ``load_dir`` is a tag directory, or a file inside one -> :class:`CheckpointError` suggesting
      ``load_checkpoint(<save_dir>, tag=<tag>)``; any other file -> :class:`CheckpointError`.
    * ``tag`` is None and there is no ``latest`` -> None (the caller warns, listing the tags present).
    * the tag (given, or read from ``latest``) is missing or incomplete -> :class:`CheckpointNotFoundError`
      listing the complete tags.
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
    if not is_complete(tag_dir):
        raise CheckpointNotFoundError(
            f"checkpoint tag {tag!r} ({source}) in {load_dir} is incomplete (no valid {COMPLETE_FILE} marker: the "
            f"save did not finish or the tag was not written by dscore); complete tags: {_complete_text(load_dir)}"
        )
    return tag


def tags_present_text(save_dir: str) -> str:
    """Human-readable list of the tags in ``save_dir`` with their completeness."""
    tags = list_tags(save_dir)
    if not tags:
        return "no tags"
    return ", ".join(f"{t!r}" + ("" if ok else " (incomplete)") for t, ok in tags)
