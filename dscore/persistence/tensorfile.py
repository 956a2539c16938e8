"""Reading and writing safetensors files without pickle and without extra copies.

The on-disk format is the public safetensors layout (8-byte little-endian header length, a JSON header
naming each tensor's dtype, shape and byte range, then the raw little-endian bytes), so every file dscore
writes opens with ``safetensors.safe_open`` / ``safetensors.torch.load_file`` and any tool that reads
safetensors. dscore writes and reads it itself because the ``safetensors`` package materialises each
tensor as a Python ``bytes`` object before writing (one extra copy of the whole state), and because a
reader that ``readinto``\\ s each tensor's own storage gives tensors that own their memory (no view keeps a
whole file buffer alive). Nothing here unpickles anything: the worst a hostile file can do is fail the
header checks, which raise :class:`~dscore.errors.CheckpointError` naming the file.

Structured (non-tensor) data travels as JSON in the header's ``__metadata__`` (string -> string map).
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, cast

import torch

from dscore.errors import CheckpointError

if TYPE_CHECKING:
    from typing import BinaryIO

__all__ = ["DTYPE_CODES", "read_header", "read_tensor_file", "write_tensor_file"]

#: torch dtype -> safetensors dtype code.
DTYPE_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
):
    if hasattr(torch, _name):
        DTYPE_CODES[getattr(torch, _name)] = _code
_CODE_TO_DTYPE = {code: dtype for dtype, code in DTYPE_CODES.items()}

_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit
_ALIGN = 8  # header padded so the data section starts 8-byte aligned


def _bytes_view(t: torch.Tensor) -> memoryview:
    """A writable/readable byte view of a contiguous CPU tensor's memory (no copy)."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(b"")
    buf = (ctypes.c_ubyte * nbytes).from_address(t.data_ptr())
    return memoryview(buf).cast("B")


def _prepare(name: str, t: object, path: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise CheckpointError(f"cannot write {name!r} to {path}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in DTYPE_CODES:
        raise CheckpointError(
            f"cannot write tensor {name!r} to {path}: dtype {t.dtype} is not storable in safetensors "
            f"(storable: {', '.join(sorted(str(d).removeprefix('torch.') for d in DTYPE_CODES))})"
        )
    if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
        raise CheckpointError(
            f"cannot write tensor {name!r} to {path}: only dense tensors with data can be stored "
            f"(got layout {t.layout}, device {t.device}{', quantized' if t.is_quantized else ''})"
        )
    return t.detach().to("cpu").contiguous()


def write_tensor_file(
    path: str,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
    *,
    fsync: bool = True,
) -> int:
    """Write ``tensors`` (and string ``metadata``) to ``path`` in safetensors format.

    The file is written in place (callers that need atomicity write into a private temporary name or
    directory first). Tensors are moved to CPU and made contiguous; they are written ordered by element
    size then name, so every tensor starts aligned to its element size. Tensors sharing storage are
    written once each (sharing is not preserved).

    Args:
        path: the file to create or truncate.
        tensors: name -> dense tensor of a dtype in :data:`DTYPE_CODES`.
        metadata: strings stored under the header's ``__metadata__``.
        fsync: flush the file to stable storage before returning.

    Returns:
        The file size in bytes.

    Raises:
        CheckpointError: a value is not a storable tensor (the message names it and ``path``).
        OSError: the file cannot be written.
    """
    if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
        raise CheckpointError(f"cannot write {path}: safetensors files are little-endian and this machine is not")
    prepared = {name: _prepare(name, t, path) for name, t in tensors.items()}
    order = sorted(prepared, key=lambda n: (-prepared[n].element_size(), n))
    header: dict[str, object] = {}
    offset = 0
    for name in order:
        t = prepared[name]
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": DTYPE_CODES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-(len(raw) + 8) % _ALIGN)
    if len(raw) > _MAX_HEADER_BYTES:
        raise CheckpointError(
            f"cannot write {path}: the header is {len(raw)} bytes, above the safetensors limit of "
            f"{_MAX_HEADER_BYTES} bytes (too many tensors or too much structured state in one file)"
        )
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        kicked = 0  # bytes already handed to asynchronous writeback
        for name in order:
            t = prepared[name]
            if t.numel():
                _write_all(f, _bytes_view(t))
            if fsync and f.tell() - kicked >= _WRITEBACK_CHUNK:
                f.flush()
                _start_writeback(f.fileno(), kicked, f.tell() - kicked)
                kicked = f.tell()
        f.flush()
        if fsync:
            os.fsync(f.fileno())
        return f.tell()


_WRITEBACK_CHUNK = 32 * 1024 * 1024  # bytes
_sync_file_range: object = False  # False = not looked up yet, None = unavailable


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing ``[offset, offset+nbytes)`` of ``fd`` to disk without waiting (Linux
    ``sync_file_range(SYNC_FILE_RANGE_WRITE)``), so the final fsync overlaps with the rest of the write
    instead of following it. A no-op where the call does not exist."""
    global _sync_file_range
    if _sync_file_range is False:
        fn = None
        try:
            import ctypes.util

            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            fn = libc.sync_file_range
            fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            fn.restype = ctypes.c_int
        except (OSError, AttributeError):
            fn = None
        _sync_file_range = fn
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, 2)  # type: ignore[operator]  # 2 = SYNC_FILE_RANGE_WRITE


def _write_all(f: BinaryIO, view: memoryview) -> None:
    done = 0
    while done < len(view):
        n = f.write(view[done:])
        done += n if n is not None else len(view) - done


def read_header(path: str) -> tuple[dict[str, dict[str, object]], dict[str, str], int]:
    """Parse the header of a safetensors file.

    Returns:
        ``(entries, metadata, data_start)``: tensor name -> ``{"dtype", "shape", "data_offsets"}``, the
        ``__metadata__`` map (empty when absent) and the byte offset where the data section starts.

    Raises:
        CheckpointNotFoundError: ``path`` does not exist.
        CheckpointError: the file is not a well-formed safetensors file (names the file and the problem).
    """
    from dscore.errors import CheckpointNotFoundError

    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(
                    f"{path} is not a safetensors file: {size} bytes, shorter than the 8-byte header length"
                )
            (hlen,) = struct.unpack("<Q", head)
            if hlen > _MAX_HEADER_BYTES or hlen + 8 > size:
                raise CheckpointError(
                    f"{path} is not a valid safetensors file (truncated or corrupt): header length {hlen} bytes "
                    f"for a file of {size} bytes"
                )
            raw = f.read(hlen)
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(f"checkpoint file {path} does not exist") from exc
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is not a valid safetensors file: its header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} is not a valid safetensors file: its header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + hlen
    data_len = size - data_start
    end = 0
    for name, entry in header.items():
        ok = (
            isinstance(entry, dict)
            and entry.get("dtype") in _CODE_TO_DTYPE
            and isinstance(entry.get("shape"), list)
            and all(isinstance(d, int) and d >= 0 for d in entry["shape"])
            and isinstance(entry.get("data_offsets"), list)
            and len(entry["data_offsets"]) == 2
            and all(isinstance(o, int) for o in entry["data_offsets"])
        )
        if not ok:
            raise CheckpointError(f"{path}: malformed header entry for tensor {name!r}: {entry!r}")
        begin, stop = entry["data_offsets"]
        numel = 1
        for d in entry["shape"]:
            numel *= d
        itemsize = torch.empty((), dtype=_CODE_TO_DTYPE[entry["dtype"]]).element_size()
        if not (0 <= begin <= stop <= data_len) or stop - begin != numel * itemsize:
            raise CheckpointError(
                f"{path} is truncated or corrupt: tensor {name!r} needs bytes [{begin}, {stop}) of a "
                f"{data_len}-byte data section and {numel * itemsize} bytes for shape {entry['shape']}"
            )
        end = max(end, stop)
    if end != data_len:
        raise CheckpointError(
            f"{path} is corrupt: its tensors cover {end} bytes but the data section holds {data_len} bytes"
        )
    return header, dict(metadata), data_start


def read_tensor_file(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read every tensor of a safetensors file into its own CPU storage.

    Returns:
        ``(tensors, metadata)`` with tensors in file order.

    Raises:
        CheckpointNotFoundError: ``path`` does not exist.
        CheckpointError: the file is malformed or truncated (the message names it).
    """
    entries, metadata, data_start = read_header(path)
    ordered = sorted(entries.items(), key=lambda kv: kv[1]["data_offsets"][0])  # type: ignore[index]
    out: dict[str, torch.Tensor] = {}
    with open(path, "rb", buffering=0) as f:
        f.seek(data_start)
        pos = 0
        for name, entry in ordered:
            offsets = cast("list[int]", entry["data_offsets"])
            begin, stop = int(offsets[0]), int(offsets[1])
            t = torch.empty(cast("list[int]", entry["shape"]), dtype=_CODE_TO_DTYPE[cast(str, entry["dtype"])])
            if begin != pos:
                f.seek(data_start + begin)
            view = _bytes_view(t)
            done = 0
            while done < len(view):
                n = f.readinto(view[done:])
                if not n:
                    raise CheckpointError(f"{path} is truncated: tensor {name!r} ends early")
                done += n
            pos = stop
            out[name] = t
    return {name: out[name] for name in entries}, metadata
