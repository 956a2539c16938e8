"""Named CPU tensors (optimizer-state chunks) swapped to per-run files on local disk (NVMe offload).

:class:`NVMeSwapManager` keeps each named tensor in its own swap file under a folder that belongs to the
run and the rank: ``<folder>/dscore-swap-<run_id>/rank<rank>/``. Tensors go out with :meth:`swap_out`
(synchronous, or asynchronous until :meth:`wait_writes`), come back with :meth:`swap_in`, and the next
chunk can be read ahead with :meth:`prefetch` while the current one is being stepped — the pattern of
DeepSpeed's ZeRO-Infinity optimizer swapper (one read stream and one write stream, ``buffer_count``
read-ahead buffers). All I/O goes through the ``async_io`` op (:class:`dscore_plugins.ops.aio.AsyncIOHandle`,
``O_DIRECT`` into 4096-aligned buffers), configured by the ds_config ``aio`` block.

The rank folder holds an ``owner.json`` (pid, host, run id, creation time); :meth:`close` (also run at
interpreter exit, and by ``with``) removes it and the run folder when no other rank uses it any more.
SIGTERM (a launcher stopping the ranks of a failed job) removes the folders too, then ends the process
as the signal's default action would, where no SIGTERM handler was installed before.
:func:`find_stale_swap_folders` (:mod:`dscore.swap_folders`) lists folders whose owner process is gone
(a crashed run). ZeRO's NVMe offload of optimizer state (:mod:`.nvme_optimizer`) and stage-3 parameters (:mod:`.nvme_params`)
is built on this class.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dscore import process
from dscore.errors import DscoreError
from dscore.swap_folders import OWNER_FILE as _OWNER
from dscore.swap_folders import SWAP_DIR_PREFIX, find_stale_swap_folders

__all__ = ["NVMeSwapManager", "SwapEntry", "find_stale_swap_folders", "SWAP_DIR_PREFIX"]


@dataclass(frozen=True)
class SwapEntry:
    """Where and what a swapped tensor is: its file, shape, dtype and size in bytes."""

    name: str
    path: Path
    shape: tuple[int, ...]
    dtype: Any
    nbytes: int


def _remove_rank_folder(rank_dir: Path) -> None:
    shutil.rmtree(rank_dir, ignore_errors=True)
    try:
        rank_dir.parent.rmdir()  # the run folder, once the last rank is gone
    except OSError:
        pass


# finalizers of open managers' folders, run by the SIGTERM handler below
_OPEN_FOLDERS: set[weakref.finalize] = set()
_sigterm_installed = False


def _remove_open_folders_then_die(signum: int, frame: Any) -> None:
    """SIGTERM (what a launcher sends every rank when one fails): remove the swap folders of this process,
    then die of the signal as the default action would (same exit status for the launcher)."""
    for fin in list(_OPEN_FOLDERS):
        fin()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_sigterm_cleanup() -> None:
    """Install :func:`_remove_open_folders_then_die` for SIGTERM once, only where nobody handles SIGTERM
    (default action) and only from the main thread (Python's rule); a user's own handler is left alone
    (if it exits normally, interpreter exit removes the folders)."""
    global _sigterm_installed
    if _sigterm_installed or threading.current_thread() is not threading.main_thread():
        return
    _sigterm_installed = True
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        process.apply("nvme_sigterm_cleanup", signal.signal, signal.SIGTERM, _remove_open_folders_then_die)


class NVMeSwapManager:
    """Swap named CPU tensors to files in a per-run, per-rank folder, with read-ahead.

    Args:
        folder: where swap folders are created (``offload_optimizer.nvme_path`` in DeepSpeed's config);
            created if missing.
        aio: the ds_config ``aio`` section (an ``AioConfig``, a dict or ``None`` for the defaults).
        run_id: identifies the run (all ranks of one run pass the same id); default: a new random id.
        rank: this process's rank (its own subfolder).
        buffer_count: how many tensors may be read ahead by :meth:`prefetch` and not yet taken by
            :meth:`swap_in` (DeepSpeed's ``buffer_count``, default 4).
        pin_memory: allocate read buffers page-locked; the caller passes it only where its accelerator
            can pin (:meth:`dscore.accelerator.Accelerator.supports_pinned_memory`).

    Raises:
        AsyncIOError: the folder cannot be created (read-only, missing parent permissions).
        ConfigError: an invalid ``aio`` value. OpBuildError: the async_io op cannot be built here.
    """

    def __init__(
        self,
        folder: str | os.PathLike[str],
        *,
        aio: Any = None,
        run_id: str | None = None,
        rank: int = 0,
        buffer_count: int = 4,
        pin_memory: bool = False,
    ) -> None:
        from dscore_plugins.ops.aio import AsyncIOError, AsyncIOHandle

        if buffer_count < 1:
            raise DscoreError(f"NVMeSwapManager: buffer_count must be >= 1, got {buffer_count}")
        self.run_id = run_id or f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
        self.rank = int(rank)
        self.buffer_count = int(buffer_count)
        self.folder = Path(folder) / f"{SWAP_DIR_PREFIX}{self.run_id}" / f"rank{self.rank}"
        try:
            self.folder.mkdir(parents=True, exist_ok=False, mode=0o700)
            owner = {"pid": os.getpid(), "host": socket.gethostname(), "run_id": self.run_id, "created": time.time()}
            (self.folder / _OWNER).write_text(json.dumps(owner))
        except FileExistsError:
            raise DscoreError(
                f"swap folder {self.folder} already exists: another process of run {self.run_id!r} uses rank "
                f"{self.rank}; give each rank its own rank and each run its own run_id"
            ) from None
        except OSError as exc:
            raise AsyncIOError(exc.errno, f"cannot create the swap folder {self.folder}: {exc.strerror}",
                               str(self.folder), operation="mkdir", file_offset=0, nbytes=0) from None
        self._cleanup = weakref.finalize(self, _remove_rank_folder, self.folder)
        _OPEN_FOLDERS.add(self._cleanup)
        _install_sigterm_cleanup()
        try:
            self._reader = AsyncIOHandle.from_config(aio)
            self._writer = AsyncIOHandle.from_config(aio)
        except BaseException:
            self._cleanup()
            raise
        # the caller asked the accelerator whether it can pin (Accelerator.supports_pinned_memory)
        self.pinned = bool(pin_memory)
        self._entries: dict[str, SwapEntry] = {}
        self._writing: dict[str, Any] = {}  # name -> tensor whose write is queued
        self._prefetched: OrderedDict[str, Any] = OrderedDict()  # name -> buffer being/been read
        self._lost: dict[str, str] = {}  # name -> why its last swap-out failed
        self._closed = False

    # ------------------------------------------------------------------ queries
    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        """Names of the tensors held in swap, in the order they were first swapped out."""
        return list(self._entries)

    def entry(self, name: str) -> SwapEntry:
        """The :class:`SwapEntry` of ``name``. Raises DscoreError (listing what is held) when unknown."""
        if name in self._lost:
            raise DscoreError(f"{name!r} is not available: its swap-out failed ({self._lost[name]}); swap it out again")
        try:
            return self._entries[name]
        except KeyError:
            held = ", ".join(self._entries) or "nothing"
            raise DscoreError(f"no tensor named {name!r} is swapped out (held: {held})") from None

    def free_read_buffers(self) -> int:
        """How many more tensors :meth:`prefetch` may read ahead now (``buffer_count`` minus those held)."""
        return self.buffer_count - len(self._prefetched)

    def is_prefetched(self, name: str) -> bool:
        """Whether ``name`` was read ahead by :meth:`prefetch` and not swapped in yet."""
        return name in self._prefetched

    def pending_writes(self) -> int:
        """Tensors whose asynchronous :meth:`swap_out` is queued and not yet waited for."""
        return len(self._writing)

    def bytes_on_disk(self) -> int:
        """Total bytes of the swap files of this rank."""
        return sum(e.nbytes for e in self._entries.values())

    # ------------------------------------------------------------------ I/O
    def swap_out(self, name: str, tensor: Any, *, async_op: bool = False) -> None:
        """Write ``tensor`` (a contiguous CPU tensor of any dtype) to ``name``'s swap file.

        With ``async_op`` the tensor must stay unmodified until :meth:`wait_writes` (or a later
        ``swap_in``/``prefetch`` of the same name, which waits for it). A read-ahead copy of ``name``
        from before is dropped.

        Raises:
            AsyncIOError: the write failed (ENOSPC, EIO, read-only folder), naming the file.
            DscoreError: the manager is closed or the tensor is not a contiguous CPU tensor.
        """
        self._check_open()
        if name in self._prefetched:
            self._reader.wait()
            self._prefetched.pop(name)
        if name in self._writing:  # a queued write of the old value must not land after the new one
            self.wait_writes()
        entry = self._entries.get(name)
        if entry is None:
            entry_path = self.folder / f"{len(self._entries):06d}.swp"
        else:
            entry_path = entry.path
            if entry.nbytes != int(tensor.nbytes):
                entry_path.unlink(missing_ok=True)  # writes never truncate: start the file afresh
        new_entry = SwapEntry(name, entry_path, tuple(tensor.shape), tensor.dtype, int(tensor.nbytes))
        self._entries[name] = new_entry
        try:
            self._writer.async_pwrite(tensor, entry_path, 0)
        except Exception as exc:
            self._lost[name] = str(exc)
            raise
        self._lost.pop(name, None)
        self._writing[name] = tensor
        if not async_op:
            self.wait_writes()

    def wait_writes(self) -> int:
        """Wait for every queued :meth:`swap_out`; returns how many finished.

        Raises:
            AsyncIOError: a write failed. Every tensor whose write was queued is then unavailable
                (``swap_in`` raises, naming the failure) until it is swapped out again: a file
                preallocated or partly written must never be read back as the tensor.
        """
        try:
            return self._writer.wait()
        except Exception as exc:
            for name in self._writing:
                self._lost[name] = str(exc)
            raise
        finally:
            self._writing.clear()

    def prefetch(self, name: str, out: Any = None) -> None:
        """Start reading ``name`` into ``out`` (a contiguous CPU tensor of its shape and dtype, reused
        memory) or a fresh aligned buffer; a later :meth:`swap_in` returns that tensor.

        Raises:
            DscoreError: ``name`` is unknown, ``out`` does not match, or ``buffer_count`` read-ahead
                buffers are already taken.
            AsyncIOError: the read cannot be started (file missing or truncated).
        """
        self._check_open()
        entry = self.entry(name)
        if out is not None and (tuple(out.shape) != entry.shape or out.dtype != entry.dtype):
            raise DscoreError(
                f"prefetch({name!r}): out has shape {tuple(out.shape)} and dtype {out.dtype}, the swapped tensor "
                f"{entry.shape} and {entry.dtype}"
            )
        if name in self._prefetched:
            return
        if len(self._prefetched) >= self.buffer_count:
            raise DscoreError(
                f"prefetch({name!r}): all buffer_count={self.buffer_count} read-ahead buffers hold tensors not "
                f"swapped in yet ({', '.join(self._prefetched)}); swap_in one of them first or raise buffer_count"
            )
        if name in self._writing:
            self.wait_writes()
        buf = out if out is not None else self._new_buffer(entry)
        self._reader.async_pread(buf, entry.path, 0)
        self._prefetched[name] = buf

    def swap_in(self, name: str, out: Any = None) -> Any:
        """Return ``name``'s tensor read back from swap (shape and dtype as swapped out).

        A prefetched read is waited for and its buffer returned (or copied into ``out``); otherwise the
        tensor is read now, into ``out`` when given (same shape and dtype, contiguous CPU) or a new
        4096-aligned buffer. The swap file stays, so the same name can be swapped in again.

        Raises:
            AsyncIOError: the read failed or the file is shorter than recorded (never a partial tensor).
            DscoreError: ``name`` is unknown or ``out`` does not match.
        """
        self._check_open()
        entry = self.entry(name)
        if out is not None and (tuple(out.shape) != entry.shape or out.dtype != entry.dtype):
            raise DscoreError(
                f"swap_in({name!r}): out has shape {tuple(out.shape)} and dtype {out.dtype}, the swapped tensor "
                f"{entry.shape} and {entry.dtype}"
            )
        if name in self._prefetched:
            self._reader.wait()  # the read-ahead queue holds only prefetches
            buf = self._prefetched.pop(name)
            if out is None:
                return buf
            out.copy_(buf)
            return out
        if name in self._writing:
            self.wait_writes()
        target = out if out is not None else self._new_buffer(entry)
        self._reader.async_pread(target, entry.path, 0)
        try:
            self._reader.wait()
        except BaseException:
            # the failed read may have been waited for together with prefetches: those are lost too
            self._prefetched.clear()
            raise
        return target

    def remove(self, name: str) -> None:
        """Forget ``name`` and delete its swap file (waits for its queued write or read first)."""
        self._check_open()
        if name not in self._entries:
            self.entry(name)  # raises, listing what is held
        entry = self._entries[name]
        if name in self._writing:
            self.wait_writes()
        if name in self._prefetched:
            self._reader.wait()
            self._prefetched.pop(name)
        entry.path.unlink(missing_ok=True)
        del self._entries[name]
        self._lost.pop(name, None)

    def close(self) -> None:
        """Wait for queued I/O, stop the I/O threads and remove this rank's swap folder (and the run
        folder when it is empty). Idempotent; errors of the last queued writes are raised after cleanup."""
        if self._closed:
            return
        self._closed = True
        try:
            self._writer.close()
            self._reader.close()
        finally:
            self._prefetched.clear()
            self._writing.clear()
            self._entries.clear()
            self._cleanup()
            _OPEN_FOLDERS.discard(self._cleanup)

    def __enter__(self) -> NVMeSwapManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _check_open(self) -> None:
        if self._closed:
            raise DscoreError(f"NVMeSwapManager for {self.folder} is closed")

    def _new_buffer(self, entry: SwapEntry) -> Any:
        from dscore_plugins.ops.aio import aligned_empty

        numel = 1
        for d in entry.shape:
            numel *= d
        return aligned_empty(numel, entry.dtype, pin_memory=self.pinned).view(entry.shape)
