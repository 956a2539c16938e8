"""``testnccl``: a torch.distributed backend that enforces NCCL's rules on ``testdev`` tensors over gloo.

Registered with ``torch.distributed.Backend.register_backend("testnccl", ..., devices=["testdev"])`` by
:func:`register` (the accelerator's ``comm_backend_setup`` calls it before ``init_process_group``). The
process group is written in Python (:class:`NcclRulesProcessGroup`, a ``ProcessGroup`` subclass) and moves
the bytes through a private gloo group on host copies. The rules it enforces, as NCCL does:

* every collective and point-to-point call accepts only ``testdev`` tensors, all on this rank's current
  device; a host tensor (or a tensor of another device index) raises :class:`NcclRuleError` naming the
  call and the argument, synchronously;
* point-to-point messages carry no tag: ``tag`` is ignored and messages between two ranks are matched in
  the order they were posted (gloo underneath always uses tag 0);
* object collectives (``all_gather_object``, ``broadcast_object_list``, ...) run on the device: torch picks
  the object device from ``_device_types``, which is ``testdev`` only, so they work only after
  ``set_device`` as on NCCL;
* results are asynchronous: the output of a collective is written into the device tensor when its work
  is waited for (``Work.wait``), never before, so a read before ``wait()`` sees the old values, as a
  read from another stream would on a GPU;
* no gloo-only fast path applies: ``dist.get_backend`` reports ``"testnccl"``.

Reduce ops: SUM, AVG (sum then divide, as NCCL's ncclAvg), PRODUCT, MIN, MAX; PREMUL_SUM is refused.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dscore_testdevice.device import DEVICE_TYPE

__all__ = ["BACKEND_NAME", "NcclRuleError", "NcclRulesProcessGroup", "register"]

BACKEND_NAME = "testnccl"
log = logging.getLogger("dscore_testdevice.comm")


class NcclRuleError(RuntimeError):
    """A call NCCL would refuse (host tensor, mixed devices, unsupported reduce op)."""


class _Work(dist._Work):  # type: ignore[misc,name-defined]
    """Completes a gloo work, then runs ``finish`` (the host->device copy of the result) exactly once."""

    def __init__(self, inner: Sequence[Any], finish: Callable[[], None] | None = None, result: Any = None) -> None:
        super().__init__()
        self._inner = list(inner)
        self._finish = finish
        self._done = False
        self._result = result

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if not self._done:
            for w in self._inner:
                w.wait() if timeout is None else w.wait(timeout)
            if self._finish is not None:
                self._finish()
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done

    def is_success(self) -> bool:
        return self._done

    def get_future(self) -> torch.futures.Future:  # type: ignore[type-arg]
        self.wait()
        fut: torch.futures.Future = torch.futures.Future()  # type: ignore[type-arg]
        fut.set_result(self._result)
        return fut

    def result(self) -> Any:
        self.wait()
        return self._result


def _sum_op() -> Any:
    return dist.ReduceOp.SUM


class NcclRulesProcessGroup(dist.ProcessGroup):  # type: ignore[misc]
    """A process group with NCCL's rules over a private gloo group (see the module docstring)."""

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("testnccl-gloo", store), rank, size, timeout)

    # ------------------------------------------------------------------ identity
    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device(DEVICE_TYPE)]

    # ------------------------------------------------------------------ rules
    def _check(self, call: str, arg: str, tensors: Sequence[torch.Tensor]) -> None:
        current = torch.accelerator.current_device_index() if torch.accelerator.is_available() else 0
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            if t.device.type != DEVICE_TYPE:
                raise NcclRuleError(
                    f"{BACKEND_NAME}.{call}: argument {arg!r} is a {t.device} tensor (shape {tuple(t.shape)}, "
                    f"{t.dtype}); NCCL accepts only {DEVICE_TYPE} tensors: move it to the device first"
                )
            if t.device.index is not None and t.device.index != current:
                raise NcclRuleError(
                    f"{BACKEND_NAME}.{call}: argument {arg!r} is on {t.device} but this rank's current device is "
                    f"{DEVICE_TYPE}:{current}; NCCL needs the communicator's device (call set_device first)"
                )

    @staticmethod
    def _op(call: str, op: Any) -> tuple[Any, bool]:
        """The gloo reduce op for ``op`` and whether to divide by the world size afterwards (AVG)."""
        op = getattr(op, "op", op)  # options hold a ReduceOp wrapping the RedOpType
        if op == dist.ReduceOp.AVG:
            return dist.ReduceOp.SUM, True
        if op in (dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX):
            return op, False
        raise NcclRuleError(f"{BACKEND_NAME}.{call}: reduce op {op} is not supported by this backend")

    @staticmethod
    def _host(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu", copy=True).contiguous()

    @staticmethod
    def _copier(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], scale: float | None = None) -> Callable[[], None]:
        def finish() -> None:
            for dev, host in pairs:
                if scale is not None:
                    host = host / scale if host.is_floating_point() or host.is_complex() else host // int(scale)
                dev.copy_(host.view(dev.shape) if host.numel() == dev.numel() else host)

        return finish

    # ------------------------------------------------------------------ collectives
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        self._check("all_reduce", "tensor", tensors)
        op, avg = self._op("all_reduce", getattr(opts, "reduceOp", _sum_op()) if opts is not None else _sum_op())
        hosts = [self._host(t) for t in tensors]
        o = dist.AllreduceOptions()
        o.reduceOp = op
        w = self._gloo.allreduce(hosts, o)
        return _Work([w], self._copier(list(zip(tensors, hosts, strict=True)), self._size if avg else None), tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        o = dist.AllreduceOptions()
        if opts is not None:
            o.reduceOp = opts.reduceOp
        return self.allreduce(tensors, o)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> _Work:
        self._check("broadcast", "tensor", tensors)
        hosts = [self._host(t) for t in tensors]
        o = dist.BroadcastOptions()
        o.rootRank, o.rootTensor = opts.rootRank, opts.rootTensor
        w = self._gloo.broadcast(hosts, o)
        return _Work([w], self._copier(list(zip(tensors, hosts, strict=True))), tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> _Work:
        self._check("reduce", "tensor", tensors)
        op, avg = self._op("reduce", opts.reduceOp)
        hosts = [self._host(t) for t in tensors]
        o = dist.AllreduceOptions()
        o.reduceOp = op
        # gloo's reduce result is defined on the root only; an all-reduce gives the root the same values
        w = self._gloo.allreduce(hosts, o)
        pairs = list(zip(tensors, hosts, strict=True)) if self._rank == opts.rootRank else []
        return _Work([w], self._copier(pairs, self._size if avg else None), tensors)

    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> _Work:
        self._check("all_gather", "tensor", inputs)
        for outs in output_lists:
            self._check("all_gather", "tensor_list", outs)
        host_in = [self._host(t) for t in inputs]
        host_out = [[torch.empty(o.shape, dtype=o.dtype, device="cpu") for o in outs] for outs in output_lists]
        w = self._gloo.allgather(host_out, host_in)
        pairs = [(d, h) for outs, houts in zip(output_lists, host_out, strict=True) for d, h in zip(outs, houts, strict=True)]
        return _Work([w], self._copier(pairs), output_lists)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> _Work:  # noqa: A002
        self._check("all_gather_into_tensor", "output_tensor", [output])
        self._check("all_gather_into_tensor", "input_tensor", [input])
        if output.numel() != input.numel() * self._size:
            raise NcclRuleError(
                f"{BACKEND_NAME}.all_gather_into_tensor: output has {output.numel()} elements, expected "
                f"world_size * input = {self._size} * {input.numel()}"
            )
        host_in = self._host(input).view(-1)
        host_out = [torch.empty_like(host_in) for _ in range(self._size)]
        w = self._gloo.allgather([host_out], [host_in])

        def finish() -> None:
            output.view(-1).copy_(torch.cat(host_out))

        return _Work([w], finish, output)

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> _Work:
        works = [self._allgather_base(o, i) for o, i in zip(outputs, inputs, strict=True)]
        return _Work(works, None, outputs)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> _Work:  # noqa: A002
        self._check("reduce_scatter_tensor", "output", [output])
        self._check("reduce_scatter_tensor", "input", [input])
        if input.numel() != output.numel() * self._size:
            raise NcclRuleError(
                f"{BACKEND_NAME}.reduce_scatter_tensor: input has {input.numel()} elements, expected "
                f"world_size * output = {self._size} * {output.numel()}"
            )
        op, avg = self._op("reduce_scatter_tensor", opts.reduceOp if opts is not None else _sum_op())
        host = self._host(input).view(-1)
        o = dist.AllreduceOptions()
        o.reduceOp = op
        w = self._gloo.allreduce([host], o)
        n = output.numel()
        part = host[self._rank * n:(self._rank + 1) * n]
        return _Work([w], self._copier([(output, part)], self._size if avg else None), output)

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> _Work:
        works = [self._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return _Work(works, None, outputs)

    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None) -> _Work:
        self._check("reduce_scatter", "output", outputs)
        works = []
        for out, ins in zip(outputs, input_lists, strict=True):
            self._check("reduce_scatter", "input_list", ins)
            flat = torch.cat([t.reshape(-1) for t in ins])
            works.append(self._reduce_scatter_base(out, flat, opts))
        return _Work(works, None, outputs)

    def gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> _Work:
        self._check("gather", "tensor", inputs)
        for outs in output_lists:
            self._check("gather", "gather_list", outs)
        host_in = [self._host(t) for t in inputs]
        host_out = [[torch.empty(t.shape, dtype=t.dtype, device="cpu") for _ in range(self._size)] for t in inputs]
        w = self._gloo.allgather(host_out, host_in)
        pairs = []
        if self._rank == opts.rootRank:
            pairs = [(d, h) for outs, houts in zip(output_lists, host_out, strict=True) for d, h in zip(outs, houts, strict=True)]
        return _Work([w], self._copier(pairs), output_lists)

    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any) -> _Work:
        self._check("scatter", "tensor", outputs)
        for ins in input_lists:
            self._check("scatter", "scatter_list", ins)
        root = opts.rootRank
        hosts = [self._host(t) for t in outputs]
        works = []
        for i, h in enumerate(hosts):
            if self._rank == root:
                stacked = torch.stack([self._host(t) for t in input_lists[i]])
            else:
                stacked = torch.empty((self._size, *h.shape), dtype=h.dtype, device="cpu")
            bo = dist.BroadcastOptions()
            bo.rootRank, bo.rootTensor = root, 0
            works.append(self._gloo.broadcast([stacked], bo))
            hosts[i] = stacked[self._rank]
        return _Work(works, self._copier(list(zip(outputs, hosts, strict=True))), outputs)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, out_splits: list[int], in_splits: list[int], opts: Any = None) -> _Work:  # noqa: A002
        self._check("all_to_all_single", "output", [output])
        self._check("all_to_all_single", "input", [input])
        host_in = self._host(input)
        host_out = torch.empty(output.shape, dtype=output.dtype, device="cpu")
        w = self._gloo.alltoall_base(host_out, host_in, list(out_splits), list(in_splits), dist.AllToAllOptions())
        return _Work([w], self._copier([(output, host_out)]), output)

    # torch >= 2.12 names (the old ones stay for older torch)
    all_gather_single = _allgather_base
    reduce_scatter_single = _reduce_scatter_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
    all_to_all_single = alltoall_base

    def barrier(self, opts: Any = None) -> _Work:
        # NCCL's barrier is an all-reduce of one element on the current device
        t = torch.zeros(1, device=torch.device(DEVICE_TYPE, torch.accelerator.current_device_index()))
        return self.allreduce([t])

    # ------------------------------------------------------------------ point-to-point (no tags)
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> _Work:
        self._check("send", "tensor", tensors)
        hosts = [self._host(t) for t in tensors]
        w = self._gloo.send(hosts, dst, 0)  # NCCL has no tags: every message between two ranks is in one queue
        return _Work([w], None, hosts)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> _Work:
        self._check("recv", "tensor", tensors)
        hosts = [torch.empty(t.shape, dtype=t.dtype, device="cpu") for t in tensors]
        w = self._gloo.recv(hosts, src, 0)
        return _Work([w], self._copier(list(zip(tensors, hosts, strict=True))), tensors)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> _Work:
        raise NcclRuleError(f"{BACKEND_NAME}.recv: NCCL cannot receive from any source; name the source rank")


def _create(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> NcclRulesProcessGroup:
    return NcclRulesProcessGroup(store, rank, size, timeout)


def register() -> None:
    """Register ``testnccl`` with torch.distributed for ``testdev`` tensors (idempotent)."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, devices=[DEVICE_TYPE])
