"""Asynchronous file I/O of CPU tensors on the ``async_io`` op (Linux kernel AIO through libaio).

:class:`AsyncIOHandle` mirrors DeepSpeed's ``aio_handle``: ``async_pread`` / ``async_pwrite`` queue a
read or write of a whole CPU tensor (plain or pinned, any dtype, contiguous) at a byte offset of a file
and return at once; ``wait()`` blocks until every queued request finished and returns how many
completed. Each request is split across ``intra_op_parallelism`` submission threads, each keeping up to
``queue_depth`` requests of ``block_size`` bytes in flight in its own kernel AIO context.

``O_DIRECT`` (no page cache) is used when the file offset is a multiple of :data:`ALIGNMENT`; a tensor
whose memory is not aligned goes through aligned bounce buffers (use :func:`aligned_empty` to avoid the
copy), and a tail shorter than :data:`ALIGNMENT` is transferred through the page cache. An unaligned
file offset, or a file system without ``O_DIRECT``, makes the whole request buffered. When more than
one kernel request can be in flight (``queue_depth`` or ``intra_op_parallelism`` > 1), a direct write
that would extend the file allocates its range first (``fallocate``, which also reports a full device
before any byte is written): file systems such as ext4 serialise extending direct writes, which would
leave one request in flight. Every failure
(a missing file or folder, a read-only file system, ``ENOSPC``, ``EIO``, a read past the end of the
file) raises :class:`AsyncIOError` naming the file, the operation, the offset and the size; a short
read is never returned silently.

Example::

    from dscore_plugins.ops.aio import AsyncIOHandle, aligned_empty
    with AsyncIOHandle(queue_depth=8, intra_op_parallelism=2) as h:
        buf = aligned_empty(1 << 20, torch.float32)
        h.async_pwrite(buf, "/nvme/x.swp", file_offset=0)
        h.wait()                                   # -> 1
"""

from __future__ import annotations

import errno as errno_mod
import os
import stat
from collections.abc import Mapping
from typing import Any

from dscore.config.aio import AIO_ALIGNMENT, AioConfig
from dscore.errors import ConfigError, DscoreError

__all__ = ["AsyncIOHandle", "AsyncIOError", "aligned_empty", "ALIGNMENT"]

#: Byte alignment of O_DIRECT transfers (file offsets, buffer addresses, lengths).
ALIGNMENT = AIO_ALIGNMENT


class AsyncIOError(DscoreError, OSError):
    """A read or write of the async_io op failed.

    Attributes:
        errno: the OS error number (``None`` for a read that reached the end of the file).
        filename: the file.
        operation: ``"read"`` or ``"write"``.
        file_offset: byte offset in the file where the failing part starts.
        nbytes: bytes of the failing part.
    """

    def __init__(self, err: int | None, message: str, filename: str, *, operation: str, file_offset: int, nbytes: int) -> None:
        super().__init__(err, message, filename)
        self.operation = operation
        self.file_offset = file_offset
        self.nbytes = nbytes
        self.message = message

    def __str__(self) -> str:
        return self.message


def _describe(err: int | None, operation: str, path: str, offset: int, nbytes: int, detail: str) -> str:
    cause = os.strerror(err) + f" ({errno_mod.errorcode.get(err, err)})" if err else ""
    what = f"async_io {operation} of {nbytes} bytes at offset {offset} of {path!r} failed"
    if err == errno_mod.ENOSPC:
        cause += ": the device holding the file is full"
    elif err == errno_mod.EROFS:
        cause += ": the file system is mounted read-only"
    return f"{what}: " + "; ".join(p for p in (cause, detail) if p)


def aligned_empty(numel: int, dtype: Any = None, *, pin_memory: bool = False) -> Any:
    """An uninitialised 1-D CPU tensor of ``numel`` elements whose memory starts on an :data:`ALIGNMENT`
    boundary, so reads and writes of it at aligned offsets use ``O_DIRECT`` without bounce copies.

    Args:
        numel: element count (>= 0).
        dtype: torch dtype (default float32).
        pin_memory: allocate page-locked memory (needs an accelerator runtime that supports pinning).

    Raises:
        DscoreError: ``pin_memory`` is true and this torch build cannot pin memory.
    """
    import torch

    dtype = torch.float32 if dtype is None else dtype
    itemsize = torch.empty((), dtype=dtype).element_size()
    try:
        raw = torch.empty(numel * itemsize + ALIGNMENT, dtype=torch.uint8, pin_memory=pin_memory)
    except RuntimeError as exc:  # pinning needs an accelerator runtime
        raise DscoreError(f"aligned_empty: cannot allocate {numel * itemsize} bytes of pinned memory: {exc}") from exc
    shift = (-raw.data_ptr()) % ALIGNMENT
    return raw[shift : shift + numel * itemsize].view(dtype)


def _load_module() -> Any:
    """The compiled async_io op, looked up like every op (the current runtime's registry, so a disabled
    ops plugin is named in the error rather than bypassed)."""
    from dscore.errors import OpBuildError
    from dscore.ops import get_op_builder

    try:
        return get_op_builder("async_io").load()
    except OpBuildError:
        raise
    except DscoreError as exc:  # not registered / disabled: say which op and why
        raise OpBuildError(f"cannot load op 'async_io': {exc}") from exc


class AsyncIOHandle:
    """A pool of submission threads doing asynchronous reads/writes of CPU tensors to files.

    Args mirror the ds_config ``aio`` block (DeepSpeed 0.19.8 defaults):
        block_size: bytes per kernel request; a positive multiple of :data:`ALIGNMENT`.
        queue_depth: requests each thread keeps in flight (>= 1).
        intra_op_parallelism: threads one request is split across (>= 1); ``thread_count`` is the
            legacy name.
        single_submit: submit kernel requests one at a time instead of in batches.
        overlap_events: refill each slot as soon as it completes (else submit a batch, reap all of it).
        use_gds: must be false (GPUDirect Storage is not implemented).

    Raises:
        ConfigError: a value is out of range, or ``use_gds`` is true (named as ``aio.<key>``).
        OpBuildError: the async_io op cannot be built here (the reason names libaio.h / libaio.so).
    """

    def __init__(
        self,
        block_size: int = 1048576,
        queue_depth: int = 8,
        intra_op_parallelism: int = 1,
        single_submit: bool = False,
        overlap_events: bool = True,
        use_gds: bool = False,
        *,
        thread_count: int | None = None,
    ) -> None:
        if thread_count is not None:
            intra_op_parallelism = thread_count
        from pydantic import ValidationError

        try:
            cfg = AioConfig(
                block_size=block_size, queue_depth=queue_depth, intra_op_parallelism=intra_op_parallelism,
                single_submit=single_submit, overlap_events=overlap_events, use_gds=use_gds,
            )
        except ValidationError as exc:
            first = exc.errors()[0]
            key = ".".join(str(p) for p in first["loc"])
            raise ConfigError(f"aio.{key}: {first['msg']}", path=f"aio.{key}") from None
        self.config = cfg
        self._mod = _load_module()
        self._h = self._mod.Handle(
            cfg.block_size, cfg.queue_depth, cfg.single_submit, cfg.overlap_events, cfg.intra_op_parallelism
        )
        self._parallel = cfg.queue_depth > 1 or cfg.intra_op_parallelism > 1
        self._pending: list[Any] = []  # tensors referenced by queued requests (kept alive until wait)
        self.direct_requests = 0
        self.buffered_requests = 0

    @classmethod
    def from_config(cls, aio: AioConfig | Mapping[str, Any] | None) -> AsyncIOHandle:
        """A handle configured by a loaded config's ``aio`` section (or a raw ``aio`` dict; ``None``: defaults).

        Raises:
            ConfigError: an invalid value (``aio.<key>``).
        """
        if aio is None:
            return cls()
        if isinstance(aio, AioConfig):
            return cls(**aio.model_dump())
        values = dict(aio)
        if "thread_count" in values and "intra_op_parallelism" in values:
            raise ConfigError("aio.thread_count: the legacy spelling of aio.intra_op_parallelism; give only one of them",
                              path="aio.thread_count")
        if "thread_count" in values:
            values["intra_op_parallelism"] = values.pop("thread_count")
        unknown = sorted(set(values) - set(AioConfig.model_fields))
        if unknown:
            raise ConfigError(f"aio.{unknown[0]}: unknown key; valid keys: {sorted(AioConfig.model_fields)}",
                              path=f"aio.{unknown[0]}")
        return cls(**values)

    # ------------------------------------------------------------------ properties
    @property
    def block_size(self) -> int:
        return int(self._h.block_size)

    @property
    def queue_depth(self) -> int:
        return int(self._h.queue_depth)

    @property
    def intra_op_parallelism(self) -> int:
        return int(self._h.threads)

    @property
    def single_submit(self) -> bool:
        return bool(self._h.single_submit)

    @property
    def overlap_events(self) -> bool:
        return bool(self._h.overlap_events)

    def inflight(self) -> int:
        """Requests queued and not yet finished."""
        return int(self._h.inflight())

    # ------------------------------------------------------------------ I/O
    def async_pread(self, tensor: Any, path: str | os.PathLike[str], file_offset: int = 0) -> int:
        """Queue a read of ``tensor.nbytes`` bytes at ``file_offset`` of ``path`` into ``tensor``.

        The tensor must not be used until :meth:`wait` returns. Returns the number of requests in flight.

        Raises:
            AsyncIOError: the file cannot be opened (missing, permissions) or is shorter than
                ``file_offset + tensor.nbytes`` (named with its size).
            DscoreError: ``tensor`` is not a contiguous CPU tensor, or the offset is negative.
        """
        return self._submit(True, tensor, path, file_offset)

    def async_pwrite(self, tensor: Any, path: str | os.PathLike[str], file_offset: int = 0) -> int:
        """Queue a write of ``tensor``'s bytes to ``path`` at ``file_offset`` (the file is created if
        missing and never truncated, so several tensors can share one file at different offsets).

        The tensor must not be modified until :meth:`wait` returns. Returns the number of requests in flight.

        Raises:
            AsyncIOError: the file cannot be opened or created (missing folder, read-only file system).
            DscoreError: ``tensor`` is not a contiguous CPU tensor, or the offset is negative.
        """
        return self._submit(False, tensor, path, file_offset)

    def sync_pread(self, tensor: Any, path: str | os.PathLike[str], file_offset: int = 0) -> int:
        """:meth:`async_pread` then :meth:`wait`; returns the bytes read. Raises like both."""
        self.async_pread(tensor, path, file_offset)
        self.wait()
        return int(tensor.nbytes)

    def sync_pwrite(self, tensor: Any, path: str | os.PathLike[str], file_offset: int = 0) -> int:
        """:meth:`async_pwrite` then :meth:`wait`; returns the bytes written. Raises like both."""
        self.async_pwrite(tensor, path, file_offset)
        self.wait()
        return int(tensor.nbytes)

    def wait(self) -> int:
        """Block until every queued request finished; return how many completed since the last wait.

        Raises:
            AsyncIOError: one or more requests failed (the first is raised, the others are counted in
                its message); the data of a failed read is incomplete and must not be used.
        """
        try:
            done = int(self._h.wait())
        finally:
            self._pending.clear()
        errors = self._h.take_errors()
        if errors:
            err, op, path, offset, nbytes, detail = errors[0]
            message = _describe(err or None, op, path, offset, nbytes, detail)
            if len(errors) > 1:
                message += f" (and {len(errors) - 1} more failed request(s))"
            raise AsyncIOError(err or None, message, path, operation=op, file_offset=offset, nbytes=nbytes)
        return done

    def close(self) -> None:
        """Wait for queued requests and stop the threads (idempotent; failures of the last requests raise)."""
        if self._h is None:
            return
        try:
            self.wait()
        finally:
            self._h = None

    def __enter__(self) -> AsyncIOHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _submit(self, is_read: bool, tensor: Any, path: str | os.PathLike[str], file_offset: int) -> int:
        import torch

        if self._h is None:
            raise DscoreError("AsyncIOHandle is closed")
        op = "read" if is_read else "write"
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            raise DscoreError(f"async_io {op}: expected a CPU tensor, got {type(tensor).__name__}"
                              + (f" on {tensor.device}" if isinstance(tensor, torch.Tensor) else ""))
        if not tensor.is_contiguous():
            raise DscoreError(f"async_io {op}: the tensor must be contiguous (call .contiguous() on a copy)")
        if isinstance(file_offset, bool) or not isinstance(file_offset, int) or file_offset < 0:
            raise DscoreError(f"async_io {op}: file_offset must be an integer >= 0, got {file_offset!r}")
        path = os.fspath(path)
        nbytes = int(tensor.nbytes)
        flags = (os.O_RDONLY if is_read else os.O_WRONLY | os.O_CREAT) | os.O_CLOEXEC
        try:
            fd_buffered = os.open(path, flags, 0o644)
        except OSError as exc:
            raise AsyncIOError(exc.errno, _describe(exc.errno, op, path, file_offset, nbytes,
                                                    "cannot open the file"),
                               path, operation=op, file_offset=file_offset, nbytes=nbytes) from None
        fd_direct = -1
        try:
            if is_read:
                st = os.fstat(fd_buffered)
                size = st.st_size
                if stat.S_ISREG(st.st_mode) and file_offset + nbytes > size:
                    raise AsyncIOError(
                        None,
                        _describe(None, op, path, file_offset, nbytes,
                                  f"read past the end of the file: it has {size} bytes, the read needs "
                                  f"{file_offset + nbytes}"),
                        path, operation=op, file_offset=file_offset, nbytes=nbytes,
                    )
            if file_offset % ALIGNMENT == 0 and nbytes >= ALIGNMENT and hasattr(os, "O_DIRECT"):
                try:
                    fd_direct = os.open(path, flags | os.O_DIRECT, 0o644)
                except OSError as exc:
                    if exc.errno not in (errno_mod.EINVAL, errno_mod.EOPNOTSUPP):
                        raise AsyncIOError(exc.errno, _describe(exc.errno, op, path, file_offset, nbytes,
                                                                "cannot open the file"),
                                           path, operation=op, file_offset=file_offset, nbytes=nbytes) from None
                    # this file system has no O_DIRECT: the request goes through the page cache
            # extending direct writes run one at a time on ext4 (each waits for all direct I/O in
            # flight); writes into allocated (unwritten) extents overlap, but each costs an extent
            # conversion, which only pays when several are in flight (measured: qd 8 1.3 vs 0.3 GB/s
            # with / without; qd 1 0.2 vs 1.1 GB/s)
            if not is_read and fd_direct >= 0 and self._parallel:
                err = int(self._mod.preallocate(fd_buffered, file_offset, nbytes))
                if err:
                    raise AsyncIOError(err, _describe(err, op, path, file_offset, nbytes,
                                                      "cannot allocate the file's space"),
                                       path, operation=op, file_offset=file_offset, nbytes=nbytes)
            in_flight = int(self._h.submit(is_read, tensor.data_ptr(), nbytes, file_offset, fd_direct, fd_buffered, path))
        except BaseException:
            os.close(fd_buffered)
            if fd_direct >= 0:
                os.close(fd_direct)
            raise
        self._pending.append(tensor)
        if fd_direct >= 0:
            self.direct_requests += 1
        else:
            self.buffered_requests += 1
        return in_flight
