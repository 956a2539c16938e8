"""The recompute-in-backward autograd function behind :func:`dscore.checkpointing.checkpoint` (imports torch).

Forward: save the RNG states (CPU, and the accelerator's when an input lives on one), the autocast
state and the inputs (moved to host memory with ``cpu_checkpointing``, copied into a contiguous slot
with ``contiguous_memory_optimization``); run the function with autograd off.
Backward: bring the inputs back, swap in the saved RNG states (the caller's are restored afterwards,
so recomputing does not shift later random draws), run the function again with autograd on, and
back-propagate the incoming gradients through that graph.

Under ``torch.compile`` (``torch.compiler.is_compiling()``) :func:`run_checkpoint` calls torch's
non-reentrant checkpoint instead, which dynamo captures as one op, with :func:`_compiled_contexts` making the
recompute replay the forward's RNG whichever backend runs the graph; the settings a graph cannot express
send the call to the eager function above (a graph break).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch  # noqa: TID253 (this module is imported only when checkpoint() is first called)
import torch.utils.checkpoint  # noqa: TID253

from dscore_plugins.parallel.checkpointing.state import CheckpointingError, CheckpointSettings
from dscore_plugins.parallel.checkpointing.state import current as _current

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
    # (on the first tensor argument's device, so autograd never mixes devices; the host when there is none)
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    device = first.device if first is not None else torch.device("cpu")
    anchor = torch.empty(0, device=device, requires_grad=True)
    return _Recompute.apply(_Call(fn, args, settings, generation), anchor, *args)


# Features the compiled path cannot express run the checkpoint eagerly under compile (a graph break): host
# placement and contiguous slots of saved inputs, and synchronize/profile around the forward and recompute.
_warned_eager: set[str] = set()


def _eager_features(settings: CheckpointSettings) -> list[str]:
    names = ("cpu_checkpointing", "contiguous_memory_optimization", "synchronize_checkpoint_boundary", "profile")
    return [n for n in names if getattr(settings, n)]


class _RngBox:
    """The RNG states one checkpointed call's forward started with (filled by :class:`_SaveRng`)."""

    def __init__(self) -> None:
        self.cpu: torch.Tensor | None = None
        self.dev: Any = None
        self.device = _DeviceOps(_current()[0], ())
        if self.device.backend is None:  # no dscore accelerator configured: torch's, once it is in use
            acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
            module = torch.get_device_module(acc.type) if acc is not None else None
            if module is not None and getattr(module, "is_initialized", lambda: False)():
                self.device.backend, self.device.device_type = module, acc.type


class _SaveRng:
    """Forward context of a traced checkpoint run by eager code: records the RNG states at entry."""

    def __init__(self, box: _RngBox) -> None:
        self.box = box

    def __enter__(self) -> None:
        self.box.cpu = torch.get_rng_state()
        self.box.dev = self.box.device.get_rng_state()

    def __exit__(self, *exc: Any) -> None:
        return None


class _ReplayRng:
    """Recompute context: swaps in the forward's RNG states, gives the caller's back on exit."""

    def __init__(self, box: _RngBox) -> None:
        self.box = box
        self.cpu: torch.Tensor | None = None
        self.dev: Any = None

    def __enter__(self) -> None:
        box = self.box
        if box.cpu is None:
            raise CheckpointingError("checkpoint recompute before its forward ran (no RNG state was recorded)")
        self.cpu, self.dev = torch.get_rng_state(), box.device.get_rng_state()
        torch.set_rng_state(box.cpu)
        box.device.set_rng_state(box.dev)

    def __exit__(self, *exc: Any) -> None:
        assert self.cpu is not None
        torch.set_rng_state(self.cpu)
        self.box.device.set_rng_state(self.dev)


def _run_eager_warned(
    fn: Callable[..., Any], args: Sequence[Any], settings: CheckpointSettings, generation: int
) -> Any:
    eager = _eager_features(settings)
    key = ",".join(eager)
    if key not in _warned_eager:
        _warned_eager.add(key)
        log.warning(
            "dscore.checkpointing.checkpoint under torch.compile: activation_checkpointing.%s cannot be expressed "
            "in a compiled graph, so each checkpointed call runs eagerly (a graph break per call); turn %s off to "
            "have the checkpoint compiled",
            " and ".join(eager),
            "it" if len(eager) == 1 else "them",
        )
    return _run(fn, args, settings, generation)


_run_eagerly = torch.compiler.disable(_run_eager_warned, recursive=True)


def _always_recompute(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    return torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


def _compiled_contexts() -> tuple[Any, Any]:
    """``context_fn`` of the traced checkpoint (called when the captured graph's checkpoint op runs).

    Under AOTAutograd's tracing (``aot_eager``, ``inductor``; a proxy dispatch mode is active) the recompute is
    a copy of the forward's nodes in the joint graph, whose random ops Inductor/AOT functionalise to the
    forward's seeds: the usual "recompute everything" selective-checkpoint modes. Run by eager code
    (``backend="eager"``, or any backend that executes dynamo's graph as Python), torch forces
    ``preserve_rng_state=False`` on the op, so the dropout mask would differ; these contexts replay the
    forward's CPU and accelerator RNG states in the recompute instead.
    """
    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None:
        return torch.utils.checkpoint.create_selective_checkpoint_contexts(_always_recompute)
    box = _RngBox()
    return _SaveRng(box), _ReplayRng(box)


class _QuietContextFnNotice(logging.Filter):
    # torch logs a caution about in-place ops whenever a context_fn reaches its checkpoint op; ours hands AOT the
    # very contexts torch's own checkpoint uses there, so the caution says nothing about dscore's checkpoint
    def filter(self, record: logging.LogRecord) -> bool:
        return "context_fn is passed to torch.utils.checkpoint" not in record.getMessage()


logging.getLogger("torch._higher_order_ops.wrap").addFilter(_QuietContextFnNotice())


def _run_traced(fn: Callable[..., Any], args: Sequence[Any]) -> Any:
    # torch's non-reentrant checkpoint is what dynamo captures as one higher-order op (no graph break);
    # an output is returned as a tuple when ``fn`` returns a list, as the eager path does
    out = torch.utils.checkpoint.checkpoint(
        fn, *args, use_reentrant=False, preserve_rng_state=True, context_fn=_compiled_contexts
    )
    return tuple(out) if isinstance(out, list) else out


def run_checkpoint(fn: Callable[..., Any], args: Sequence[Any], settings: CheckpointSettings, generation: int) -> Any:
    """Implementation of :func:`dscore.checkpointing.checkpoint` (see there)."""
    if not torch.is_grad_enabled():
        return fn(*args)
    if torch.compiler.is_compiling():
        if _eager_features(settings):
            return _run_eagerly(fn, args, settings, generation)
        return _run_traced(fn, args)
    return _run(fn, args, settings, generation)
