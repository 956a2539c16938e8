"""The recompute-in-backward autograd function behind :func:`dscore.checkpointing.checkpoint` (imports torch).

Forward: save the RNG states (CPU, and the accelerator's when an input lives on one), the autocast
state and the inputs (moved to host memory with ``cpu_checkpointing``, copied into a contiguous slot
with ``contiguous_memory_optimization``); run the function with autograd off.
Backward: bring the inputs back, swap in the saved RNG states (the caller's are restored afterwards,
so recomputing does not shift later random draws), run the function again with autograd on, and
back-propagate the incoming gradients through that graph.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch  # noqa: TID253 (this module is imported only when checkpoint() is first called)

from dscore_plugins.parallel.checkpointing.state import CheckpointingError, CheckpointSettings

__all__ = ["run_checkpoint", "ContiguousPool"]

log = logging.getLogger("dscore.checkpointing")


class _DeviceOps:
    """RNG and synchronize for one device: a dscore Accelerator, a torch device module, or nothing (CPU)."""

    def __init__(self, settings: CheckpointSettings, args: Sequence[Any]) -> None:
        self.backend: Any = None
        self.device_type = "cpu"
        acc = settings.accelerator
        if acc is not None and getattr(acc, "device_type", "cpu") != "cpu":
            self.backend, self.device_type = acc, str(acc.device_type)
            return
        for a in args:
            if isinstance(a, torch.Tensor) and a.device.type not in ("cpu", "meta"):
                self.device_type = a.device.type
                self.backend = torch.get_device_module(a.device.type)
                return

    def get_rng_state(self) -> Any:
        return None if self.backend is None else self.backend.get_rng_state()

    def set_rng_state(self, state: Any) -> None:
        if self.backend is not None and state is not None:
            self.backend.set_rng_state(state)

    def synchronize(self) -> None:
        if self.backend is not None:
            self.backend.synchronize()


class ContiguousPool:
    """Preallocated buffers for saved inputs: ``slots`` slots, each holding one flat buffer per argument
    index, allocated at the first checkpoint (DeepSpeed's contiguous checkpointing assumes homogeneous
    checkpoints). A slot is taken in the forward and freed after its backward (or when its graph dies)."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.free = list(range(slots))
        self.buffers: dict[int, list[torch.Tensor]] = {}  # arg index -> one flat buffer per slot

    def acquire(self) -> int:
        if not self.free:
            raise CheckpointingError(
                f"activation_checkpointing.number_checkpoints = {self.slots}, but checkpoint was called for a "
                f"{self.slots + 1}th time before the earlier ones were back-propagated; set number_checkpoints "
                "to the number of checkpointed layers in one forward"
            )
        return self.free.pop(0)

    def release(self, slot: int) -> None:
        if slot not in self.free:
            self.free.append(slot)
            self.free.sort()

    def store(self, slot: int, index: int, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Copy ``t`` into slot ``slot`` of argument ``index`` on ``device``; returns the view holding it."""
        bufs = self.buffers.get(index)
        if bufs is None:
            pin = device.type == "cpu" and t.device.type != "cpu"  # host staging of device tensors
            bufs = [torch.empty(t.numel(), dtype=t.dtype, device=device, pin_memory=pin) for _ in range(self.slots)]
            self.buffers[index] = bufs
        buf = bufs[slot]
        if buf.dtype != t.dtype or buf.device != device or t.numel() > buf.numel():
            raise CheckpointingError(
                f"contiguous_memory_optimization: checkpoint argument {index} is a {t.dtype} tensor of "
                f"{t.numel()} elements, but its buffers hold {buf.numel()} elements of {buf.dtype} on {buf.device} "
                "(sized by the first checkpoint): contiguous checkpointing needs checkpoints with inputs of one "
                "size and dtype (e.g. identical layers); turn it off for heterogeneous ones"
            )
        view = buf[: t.numel()].view(t.shape)
        view.copy_(t, non_blocking=True)
        return view


_pools: dict[int, ContiguousPool] = {}


def _pool(settings: CheckpointSettings, generation: int) -> ContiguousPool:
    pool = _pools.get(generation)
    if pool is None:
        _pools.clear()  # older generations live on only through the checkpoints that hold a slot
        assert settings.number_checkpoints is not None  # guaranteed by the config model
        pool = _pools[generation] = ContiguousPool(settings.number_checkpoints)
    return pool


class _Slot:
    """Owns one contiguous slot; freed after backward or when the autograd graph holding it dies."""

    def __init__(self, pool: ContiguousPool, slot: int) -> None:
        self.pool, self.slot, self.used = pool, slot, False
        self._finalizer = weakref.finalize(self, pool.release, slot)

    def free(self) -> None:
        self.used = True
        self._finalizer()


class _Call:
    """What the autograd function needs besides the tensors (kept off the tensor argument list)."""

    def __init__(self, fn: Callable[..., Any], args: Sequence[Any], settings: CheckpointSettings, generation: int):
        self.fn = fn
        self.settings = settings
        self.generation = generation
        self.device = _DeviceOps(settings, args)
        self.n_args = len(args)


def _autocast_state(device_type: str) -> list[tuple[str, bool, torch.dtype]]:
    types = ["cpu"] if device_type == "cpu" else ["cpu", device_type]
    return [(t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in types if _autocast_available(t)]


def _autocast_available(device_type: str) -> bool:
    try:
        return bool(torch.amp.is_autocast_available(device_type))
    except RuntimeError:  # a device type torch does not know (an out-of-tree accelerator's name)
        return False


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, call: _Call, _anchor: torch.Tensor, *args: Any) -> Any:  # type: ignore[override]
        s = call.settings
        timed = s.profile
        if s.synchronize_checkpoint_boundary or timed:
            call.device.synchronize()
        start = time.perf_counter()
        ctx.call = call
        ctx.cpu_rng = torch.get_rng_state()
        ctx.dev_rng = call.device.get_rng_state()
        ctx.autocast = _autocast_state(call.device.device_type)

        outputs = call.fn(*args)

        tensor_index: list[int] = []
        to_save: list[torch.Tensor] = []
        ctx.devices = []
        ctx.grad_flags = []
        ctx.slot = None
        contiguous = s.contiguous_memory_optimization
        if contiguous and any(isinstance(a, torch.Tensor) for a in args):
            pool = _pool(s, call.generation)
            ctx.slot = _Slot(pool, pool.acquire())
        for i, a in enumerate(args):
            if not isinstance(a, torch.Tensor):
                continue
            keep = a.detach()
            target = torch.device("cpu") if s.cpu_checkpointing else keep.device
            if ctx.slot is not None:
                keep = ctx.slot.pool.store(ctx.slot.slot, i, keep, target)
            elif target != keep.device:
                keep = keep.to(target, non_blocking=False)
            tensor_index.append(i)
            to_save.append(keep)
            ctx.devices.append(a.device)
            ctx.grad_flags.append(a.requires_grad)
        ctx.tensor_index = tensor_index
        ctx.others = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.save_for_backward(*to_save)

        single = not isinstance(outputs, (tuple, list))
        ctx.single = single
        outs = (outputs,) if single else tuple(outputs)
        non_diff = [o for o in outs if isinstance(o, torch.Tensor) and not o.is_floating_point()]
        if non_diff:
            ctx.mark_non_differentiable(*non_diff)
        if s.synchronize_checkpoint_boundary or timed:
            call.device.synchronize()
        if timed:
            log.info("checkpoint %s forward: %.3f ms", _name(call.fn), 1e3 * (time.perf_counter() - start))
        return outputs if single else outs

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # type: ignore[override]
        call: _Call = ctx.call
        s = call.settings
        slot: _Slot | None = ctx.slot
        if slot is not None and slot.used:
            raise CheckpointingError(
                "a second backward through a checkpoint with contiguous_memory_optimization: its buffer slot was "
                "released after the first backward (retain_graph is not supported with contiguous checkpointing)"
            )
        timed = s.profile
        if s.synchronize_checkpoint_boundary or timed:
            call.device.synchronize()
        start = time.perf_counter()

        args = list(ctx.others)
        saved = ctx.saved_tensors
        inputs: list[torch.Tensor] = []
        for i, t, dev, flag in zip(ctx.tensor_index, saved, ctx.devices, ctx.grad_flags, strict=True):
            x = t.to(dev, non_blocking=True) if t.device != dev else t
            x = x.detach().requires_grad_(flag)
            args[i] = x
            inputs.append(x)

        # recompute under the forward's RNG and autocast state, then give the caller its RNG back
        cpu_now = torch.get_rng_state()
        dev_now = call.device.get_rng_state()
        torch.set_rng_state(ctx.cpu_rng)
        call.device.set_rng_state(ctx.dev_rng)
        try:
            with torch.enable_grad(), _autocast(ctx.autocast):
                outputs = call.fn(*args)
        finally:
            torch.set_rng_state(cpu_now)
            call.device.set_rng_state(dev_now)
        outs = (outputs,) if ctx.single else tuple(outputs)
        pairs = [
            (o, g)
            for o, g in zip(outs, grads, strict=False)
            if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
        ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if slot is not None:
            slot.free()
        if s.synchronize_checkpoint_boundary or timed:
            call.device.synchronize()
        if timed:
            log.info("checkpoint %s recompute+backward: %.3f ms", _name(call.fn), 1e3 * (time.perf_counter() - start))
        result: list[Any] = [None] * call.n_args
        for i, x in zip(ctx.tensor_index, inputs, strict=True):
            result[i] = x.grad if x.requires_grad else None
        return (None, None, *result)


class _autocast:
    """Re-enter the autocast state recorded in the forward (one context per device type)."""

    def __init__(self, state: list[tuple[str, bool, torch.dtype]]) -> None:
        self.contexts = [torch.autocast(device_type=t, enabled=on, dtype=dt) for t, on, dt in state]

    def __enter__(self) -> None:
        for c in self.contexts:
            c.__enter__()

    def __exit__(self, *exc: Any) -> None:
        for c in reversed(self.contexts):
            c.__exit__(*exc)


def _name(fn: Any) -> str:
    return type(fn).__name__ if isinstance(fn, torch.nn.Module) else getattr(fn, "__qualname__", repr(fn))


def _run(fn: Callable[..., Any], args: Sequence[Any], settings: CheckpointSettings, generation: int) -> Any:
    # an empty leaf that requires grad makes the outputs part of the graph even when no input requires
    # grad, so parameters used inside ``fn`` still receive gradients (torch's re-entrant variant loses them)
    anchor = torch.empty(0, requires_grad=True)
    return _Recompute.apply(_Call(fn, args, settings, generation), anchor, *args)


# Inside a torch.compile'd region the checkpointed function runs eagerly (a graph break): Inductor draws
# dropout masks from its own seeds, not from the global generator _Recompute saves and restores, so a
# compiled recompute would use other masks than the forward (DeepSpeed #6811). torch's own non-reentrant
# checkpoint has the same fault under backend="eager"; running the region eagerly is exact on every backend.
_run_eagerly = torch.compiler.disable(_run, recursive=True)


def run_checkpoint(fn: Callable[..., Any], args: Sequence[Any], settings: CheckpointSettings, generation: int) -> Any:
    """Implementation of :func:`dscore.checkpointing.checkpoint` (see there)."""
    if not torch.is_grad_enabled():
        return fn(*args)
    if torch.compiler.is_compiling():
        return _run_eagerly(fn, args, settings, generation)
    return _run(fn, args, settings, generation)
