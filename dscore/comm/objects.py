"""Object collectives without numpy: all-gather and broadcast of picklable Python objects.

``torch.distributed.all_gather_object`` / ``broadcast_object_list`` turn the received bytes back into
objects with ``tensor.numpy()``, so on a torch build without numpy installed (dscore does not depend on
it) they raise ``RuntimeError: Numpy is not available`` (torch 2.13, ``_tensor_to_object``). dscore's own
object collectives use these helpers instead: the :class:`~dscore.comm.facade.Comm` methods of the same
names call them, and code running on a raw torch group before a facade exists (the shared-memory
transport's set-up) calls them directly.

The wire format is dscore's own and only ever read by these helpers: each object is pickled (protocol
``pickle.HIGHEST_PROTOCOL``) into a flat ``uint8`` tensor; the ranks first exchange the byte lengths (one
``int64`` per rank), then the payloads padded to the longest. Tensors live on
:func:`object_device` of the group: the host for a group whose backend moves CPU tensors (gloo, MPI, or a
``"cpu:..."`` entry of a device map), else the current accelerator device (an NCCL group gets CUDA
tensors), as torch's own object collectives choose.

Unpickling runs ``pickle.loads`` on what peers sent: use these only inside one job, as torch's are.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from dscore.errors import DistributedError

__all__ = ["all_gather_object", "broadcast_object", "object_device", "object_from_tensor", "object_to_tensor",
           "tensor_bytes"]

#: torch backends whose collectives take host (CPU) tensors
_HOST_BACKENDS = frozenset({"gloo", "mpi"})


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The raw bytes of ``tensor``'s elements in row-major order (any dtype, any device), without numpy.

    A tensor on another device is copied to the host first; a non-contiguous one is made contiguous.
    ``len(result) == tensor.numel() * tensor.element_size()``; the byte order is the machine's.
    """
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.to("cpu")
    raw = flat.contiguous().view(torch.uint8)  # a byte view of the elements (bool, bf16, ... included)
    out = bytearray(raw.numel())
    if out:
        # torch.frombuffer views the bytearray without copying; copy_ fills it
        torch.frombuffer(out, dtype=torch.uint8).copy_(raw)
    return bytes(out)


def object_to_tensor(obj: Any, device: torch.device | str = "cpu") -> torch.Tensor:
    """``obj`` pickled into a 1-D ``uint8`` tensor on ``device`` (its length is the pickle's byte count).

    Raises:
        pickle.PicklingError, TypeError, AttributeError: ``obj`` cannot be pickled (pickle's own errors).
    """
    data = bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))  # writable: frombuffer warns else
    return torch.frombuffer(data, dtype=torch.uint8).to(device=device, copy=True)


def object_from_tensor(tensor: torch.Tensor, nbytes: int | None = None) -> Any:
    """The object pickled in the first ``nbytes`` bytes (default: all) of a 1-D ``uint8`` ``tensor``
    (:func:`object_to_tensor`'s inverse; the tensor may be on any device)."""
    if nbytes is not None:
        tensor = tensor[: int(nbytes)]
    return pickle.loads(tensor_bytes(tensor))


def _backend_names(group: Any) -> tuple[set[str], set[str]]:
    """(backend names, device types named) of ``group``'s backend string (``"gloo"``, ``"cpu:gloo,cuda:nccl"``)."""
    text = str(dist.get_backend(group)).lower()
    names: set[str] = set()
    devices: set[str] = set()
    for part in text.split(","):
        device, sep, name = part.strip().rpartition(":")
        names.add(name)
        if sep:
            devices.add(device)
    return names, devices


def object_device(group: Any = None, accelerator: Any = None) -> torch.device:
    """The device object collectives on ``group`` (None: the default group) exchange their tensors on.

    The host when the group's backend moves CPU tensors (gloo or MPI, or a device map with a ``cpu``
    entry such as ``"cpu:gloo,cuda:nccl"``). Otherwise the current device of ``accelerator`` (a
    :class:`dscore.accelerator.Accelerator`; the facade passes the one ``init_distributed`` selected), else
    of torch's current accelerator (``torch.accelerator``, torch >= 2.6): ``cuda:<current>`` for an NCCL group, as
    torch's own object collectives choose (``init_distributed`` selected that device). The host when none
    of these names a device.
    """
    names, devices = _backend_names(group)
    if "cpu" in devices or names & _HOST_BACKENDS:
        return torch.device("cpu")
    if accelerator is not None and getattr(accelerator, "device_type", "cpu") != "cpu":
        return torch.device(accelerator.current_device_name())
    accel = getattr(torch, "accelerator", None)
    if accel is not None and accel.is_available():
        current = accel.current_accelerator()
        if current is not None:
            return torch.device(current.type, accel.current_device_index())
    return torch.device("cpu")


#: the length a rank sends when its object cannot be pickled, so every rank raises instead of the others
#: waiting for a payload that never comes
_FAILED = -1


def _pickled(obj: Any, device: torch.device) -> tuple[torch.Tensor, BaseException | None]:
    try:
        return object_to_tensor(obj, device), None
    except Exception as exc:  # pickle's errors vary (PicklingError, TypeError, AttributeError, ...)
        return torch.empty(0, dtype=torch.uint8, device=device), exc


def _raise_if_failed(call: str, lengths: list[int], group: Any, failure: BaseException | None) -> None:
    bad = [i for i, n in enumerate(lengths) if n == _FAILED]
    if not bad:
        return
    ranks = [dist.get_global_rank(group, i) if group is not None else i for i in bad]
    detail = f" (here: {type(failure).__name__}: {failure})" if failure is not None else ""
    raise DistributedError(f"{call}: the object of rank(s) {ranks} cannot be pickled{detail}") from failure


def all_gather_object(
    obj: Any, group: Any = None, *, device: torch.device | str | None = None, accelerator: Any = None
) -> list[Any]:
    """Every rank's picklable ``obj`` in the rank order of ``group`` (None: the default group).

    Collective: every rank of ``group`` calls it. Two collectives: an all-gather of each rank's pickle
    length (``int64``), then one of the payloads padded to the longest (``uint8``), on ``device``
    (default :func:`object_device` of ``group`` and ``accelerator``). Without a process group, or on a one-rank group, returns ``[obj]``.

    Raises:
        DistributedError: on every rank, when some rank's ``obj`` cannot be pickled (names the ranks; the
            pickling error is the cause on those ranks), so no rank waits for a payload that never comes.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    world = dist.get_world_size(group)
    if world == 1:
        return [obj]
    dev = torch.device(device) if device is not None else object_device(group, accelerator)
    payload, failure = _pickled(obj, dev)
    size = torch.tensor([payload.numel() if failure is None else _FAILED], dtype=torch.int64, device=dev)
    sizes = [torch.empty(1, dtype=torch.int64, device=dev) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(s.item()) for s in sizes]
    _raise_if_failed("all_gather_object", lengths, group, failure)
    longest = max(lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=dev)
    padded[: payload.numel()].copy_(payload)
    received = [torch.empty(longest, dtype=torch.uint8, device=dev) for _ in range(world)]
    dist.all_gather(received, padded, group=group)
    return [object_from_tensor(t, n) for t, n in zip(received, lengths)]


def broadcast_object(
    obj: Any, src: int = 0, group: Any = None, *, device: torch.device | str | None = None, accelerator: Any = None
) -> Any:
    """Global rank ``src``'s picklable ``obj`` on every rank of ``group`` (None: the default group).

    Collective: every rank calls it; only ``src``'s ``obj`` is pickled (the others' are ignored). Two
    broadcasts: the pickle length (``int64``), then the payload (``uint8``), on ``device`` (default
    :func:`object_device` of ``group`` and ``accelerator``). Without a process group, or on a one-rank group, returns ``obj``.

    Raises:
        DistributedError: on every rank, when ``src``'s ``obj`` cannot be pickled.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    if dist.get_world_size(group) == 1:
        return obj
    dev = torch.device(device) if device is not None else object_device(group, accelerator)
    mine = dist.get_rank() == int(src)
    payload, failure = _pickled(obj, dev) if mine else (None, None)
    if failure is not None:
        payload = None
    count = _FAILED if failure is not None else (payload.numel() if payload is not None else 0)
    size = torch.tensor([count], dtype=torch.int64, device=dev)
    dist.broadcast(size, src=int(src), group=group)
    if int(size.item()) == _FAILED:
        raise DistributedError(
            f"broadcast_object: the object of source rank {int(src)} cannot be pickled"
            + (f" ({type(failure).__name__}: {failure})" if failure is not None else "")
        ) from failure
    if payload is None:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=dev)
    dist.broadcast(payload, src=int(src), group=group)
    return obj if mine else object_from_tensor(payload)
