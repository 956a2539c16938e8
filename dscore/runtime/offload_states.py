"""``engine.offload_states`` / ``reload_states``: move training state to host memory and back.

DeepSpeed 0.19.8 (``DeepSpeedEngine.offload_states``, ``deepspeed/runtime/zero/offload_states.py``) moves
the ZeRO optimizer's buffers to the host between phases of an RLHF loop (so generation can use the device
memory) and back before training continues. Kinds (``OffloadStateTypeEnum`` values): ``optim_states``,
``hp_params`` (fp32 master weights), ``lp_params`` (the model's parameters), ``lp_grads`` (gradients) and
``contiguous_grad_buffer`` (gradient staging buffers). The ZeRO stage says which tensors hold each kind
(:meth:`dscore.protocols.zero.ZeroStage.offload_state_tensors`).

**Storages, not tensors.** Each distinct storage behind the listed tensors is copied byte for byte into a
host buffer (page-locked with ``pin_memory`` where the accelerator supports it) and then resized to zero
bytes, which frees its device memory while every view of it (parameters viewing a flat buffer, master
chunks, bucket views, ``.grad`` views) stays the same Python object. ``reload_states`` re-allocates each
storage at its size and copies the bytes back, so training continues bit for bit as if nothing moved,
without re-linking any view. Storages already in host memory when the accelerator is a device are left
alone (nothing to free). A storage that cannot be resized (memory mapped from a file) is left in place.

**Rules (DeepSpeed's).** An optimizer is required; ``offload_param`` must be off; ``device`` is
``"cpu"`` (``"none"`` logs a warning and does nothing, ``"nvme"`` is refused); with
``offload_optimizer`` on, ``hp_params`` and ``optim_states`` already live on the host and are skipped
(stage 3 also skips ``lp_grads``). While states are offloaded the engine refuses every call that reads
or writes them (:func:`refuse_while_offloaded`: ``forward``, ``backward``, ``step``, ``zero_grad``,
``save_checkpoint``, ``load_checkpoint``, ``module_state_dict``, the consolidated 16-bit state dict,
``save_16bit_model``; ZeRO-3 gathers, e.g. ``GatheredParameters``, refuse in the unit) with an
:class:`~dscore.runtime.engine_errors.EngineError` naming the call: their storages are freed, and
reading them would crash or fail inside torch. ``get_global_grad_norm`` (a number kept by the engine),
``offload_states``/``reload_states`` again and ``close``/``destroy`` work. When two kinds share storage (fp32 without offload: the
master weights *are* the parameters' buffer), offloading one moves both and both count as offloaded.

**On the optimizer too.** DeepSpeed's ZeRO optimizers carry the same two methods (the engine's call
``self.optimizer.offload_states(...)``), and OpenRLHF and verl call them on ``engine.optimizer`` directly.
:func:`bind_optimizer_state_methods` gives the optimizer ``engine.optimizer`` returns (ZeRO 0-3, a client
optimizer included) ``offload_states(include, device, pin_memory, non_blocking)``, ``reload_states(
non_blocking)`` and ``empty_partition_cache()``, each the engine's own call (one offloader, one set of
rules and refusals): moving states through the optimizer makes the engine refuse ``forward`` just as
moving them through the engine does, and either reload brings back what either offload moved.

On the CPU accelerator the "device" is host memory: the states are copied to a fresh host buffer and the
original freed, so resident memory does not drop; :meth:`StateOffloader.bytes_by_kind` reports the
bytes each kind released (what a device would get back).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "OFFLOAD_STATE_TYPES",
    "OPTIMIZER_STATE_METHODS",
    "OptimizerStateMethod",
    "StateOffloader",
    "bind_optimizer_state_methods",
    "refuse_while_offloaded",
]

log = logging.getLogger("dscore.runtime.offload_states")

#: DeepSpeed's ``OffloadStateTypeEnum`` values, in its order.
OFFLOAD_STATE_TYPES: tuple[str, ...] = ("optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer")


@dataclass
class _Moved:
    storage: Any  # torch.UntypedStorage, resized to 0 while offloaded
    nbytes: int
    host: torch.Tensor  # uint8, nbytes elements
    kinds: set[str] = field(default_factory=set)


def _bytes_view(storage: Any, nbytes: int) -> torch.Tensor:
    """A flat uint8 tensor over the whole ``storage`` (no copy)."""
    out = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return out.set_(storage, 0, (nbytes,), (1,))


def state_type_name(item: Any) -> str:
    """``"hp_params"`` from a string or an enum member (``OffloadStateTypeEnum.hp_params``)."""
    value = getattr(item, "value", item)
    return str(value)


class StateOffloader:
    """Moves the storages of a ZeRO stage's state kinds to host memory and back.

    Args:
        stage: the engine's ZeRO stage (``offload_state_tensors()``).
        accelerator: the runtime's accelerator (device type, ``pin_memory``, ``synchronize``, ``empty_cache``).
    """

    def __init__(self, stage: Any, accelerator: Any) -> None:
        self.stage = stage
        self.accelerator = accelerator
        self.offloaded: set[str] = set()
        self._moved: dict[int, _Moved] = {}
        self._in_flight: list[torch.Tensor] = []

    def bytes_by_kind(self) -> dict[str, int]:
        """Bytes of device storage each offloaded kind released (a storage shared by two kinds counts in both)."""
        out: dict[str, int] = {}
        for moved in self._moved.values():
            for kind in moved.kinds:
                out[kind] = out.get(kind, 0) + moved.nbytes
        return out

    def offload(self, kinds: Iterable[str], *, pin_memory: bool, non_blocking: bool) -> dict[str, int]:
        """Offload ``kinds`` (already validated) not offloaded yet; returns :meth:`bytes_by_kind`."""
        self._in_flight = []
        tensors = self.stage.offload_state_tensors()
        device_type = self.accelerator.device().type
        wanted = [k for k in kinds if k not in self.offloaded]
        for kind in wanted:
            for t in tensors.get(kind, []):
                if t is None or t.device.type != device_type:
                    continue
                storage = t.untyped_storage()  # one Python object per storage (torch keeps it)
                key = id(storage)
                moved = self._moved.get(key)
                if moved is None:
                    nbytes = int(storage.nbytes())
                    if nbytes == 0:  # released (a stage-3 gather buffer between uses)
                        continue
                    moved = self._move_out(storage, nbytes, pin_memory, non_blocking)
                    if moved is None:
                        continue
                    self._moved[key] = moved
                moved.kinds.add(kind)
            self.offloaded.add(kind)
        # a kind whose every storage went out with another kind counts as offloaded too
        for kind, ts in tensors.items():
            keys = {id(t.untyped_storage()) for t in ts if t is not None and t.device.type == device_type}
            if kind not in self.offloaded and keys and keys <= set(self._moved):
                self.offloaded.add(kind)
                for key in keys:
                    self._moved[key].kinds.add(kind)
        if not non_blocking:
            self.accelerator.synchronize()
        self.accelerator.empty_cache()
        sizes = self.bytes_by_kind()
        log.info("offload_states: %s", ", ".join(f"{k} {v} B" for k, v in sorted(sizes.items())) or "nothing to move")
        return sizes

    def _move_out(self, storage: Any, nbytes: int, pin_memory: bool, non_blocking: bool) -> _Moved | None:
        src = _bytes_view(storage, nbytes)
        host = torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cpu"))
        if pin_memory:
            host = self.accelerator.pin_memory(host)
        host.copy_(src, non_blocking=non_blocking and pin_memory)
        if non_blocking:
            self.accelerator.synchronize()  # the source is freed next: the copy must have read it
        del src
        try:
            storage.resize_(0)
        except RuntimeError as exc:  # e.g. a storage mapped from a file
            log.info("offload_states: a %d-byte storage cannot be freed (%s); it stays in place", nbytes, exc)
            return None
        return _Moved(storage=storage, nbytes=nbytes, host=host)

    def reload(self, *, non_blocking: bool) -> None:
        """Bring every offloaded storage back (same size, same bytes)."""
        pending = []
        for moved in self._moved.values():
            moved.storage.resize_(moved.nbytes)
            dst = _bytes_view(moved.storage, moved.nbytes)
            dst.copy_(moved.host, non_blocking=non_blocking)
            pending.append(moved.host)
        self._moved.clear()
        self.offloaded.clear()
        if non_blocking:
            self._in_flight = pending  # the host sources stay alive until the next call
        else:
            self.accelerator.synchronize()


def refuse_while_offloaded(engine: Any, call: str) -> None:
    """Raise if ``engine``'s training states are offloaded: ``call`` (e.g. ``"engine.save_checkpoint()"``)
    would read or write storages :func:`offload_engine_states` freed.

    Raises:
        EngineError: names ``call``, the offloaded kinds and ``reload_states()``.
    """
    if not getattr(engine, "_states_offloaded", False):
        return
    offloader = engine.__dict__.get("_state_offloader")
    kinds = sorted(offloader.offloaded) if offloader is not None else []
    _refuse(
        f"{call}: the training states are offloaded (offload_states() on the engine or its optimizer moved "
        f"{kinds} to host memory and freed their device storage); call reload_states() first"
    )


def _refuse(message: str) -> None:
    from dscore.runtime.engine_errors import EngineError

    raise EngineError(message)


def offload_engine_states(
    engine: Any, include: Iterable[Any] | None, device: Any, *, pin_memory: bool, non_blocking: bool
) -> None:
    """``engine.offload_states``: validate as DeepSpeed 0.19.8 does, then move the kinds (module docstring).

    Raises:
        EngineError: no optimizer, ``offload_param`` on, ``device`` not ``"cpu"``/``"none"``, or ``include``
            names an unknown kind.
    """
    if engine.zero_stage_impl.optimizer is None:
        _refuse("offload_states() needs an optimizer (moving states without one is not supported, as DeepSpeed)")
    if engine.zero_offload_param():
        _refuse(
            "offload_states() cannot move states while zero_optimization.offload_param is on (the parameters "
            "are offloaded already); set offload_param.device to 'none'"
        )
    where = str(getattr(device, "value", device)).lower()
    if where == "none":
        log.warning("offload_states(device='none'): no device given, nothing is offloaded")
        return
    if where == "nvme":
        _refuse("offload_states(device='nvme'): NVMe is not supported for offloading states; use device='cpu'")
    if where != "cpu":
        _refuse(f"offload_states(device={device!r}): the only target is 'cpu' ('none' does nothing)")
    kinds = list(OFFLOAD_STATE_TYPES) if include is None else [state_type_name(k) for k in include]
    unknown = sorted(set(kinds) - set(OFFLOAD_STATE_TYPES))
    if unknown:
        _refuse(f"offload_states(include=...): unknown state type(s) {unknown}; valid: {list(OFFLOAD_STATE_TYPES)}")
    if engine.zero_offload_optimizer():  # already on the host (DeepSpeed's _refine_include_states)
        skip = {"hp_params", "optim_states"} | ({"lp_grads"} if engine.zero_optimization_stage() == 3 else set())
        kinds = [k for k in kinds if k not in skip]
    offloader = engine.__dict__.get("_state_offloader")
    if offloader is None:
        offloader = StateOffloader(engine.zero_stage_impl, engine.runtime.accelerator)
        engine.__dict__["_state_offloader"] = offloader
    offloader.offload(kinds, pin_memory=pin_memory, non_blocking=non_blocking)
    engine._states_offloaded = bool(offloader.offloaded)


def reload_engine_states(engine: Any, *, non_blocking: bool) -> None:
    """``engine.reload_states``: bring back everything :func:`offload_engine_states` moved (no-op if nothing).

    Raises:
        EngineError: the engine has no optimizer.
    """
    if engine.zero_stage_impl.optimizer is None:
        _refuse("reload_states() needs an optimizer (moving states without one is not supported, as DeepSpeed)")
    offloader = engine.__dict__.get("_state_offloader")
    if offloader is not None:
        offloader.reload(non_blocking=non_blocking)
    engine._states_offloaded = False


class OptimizerStateMethod:
    """``optimizer.offload_states`` / ``reload_states`` / ``empty_partition_cache``: calls the engine's method
    of the same name (:func:`bind_optimizer_state_methods`). Holds the engine weakly (the optimizer does
    not keep a closed engine alive).

    Raises:
        EngineError: the engine that bound it no longer exists; otherwise what the engine's method raises.
    """

    def __init__(self, engine: Any, name: str) -> None:
        self._engine = weakref.ref(engine)
        self._name = name
        self.__doc__ = getattr(type(engine), name).__doc__

    @property
    def engine(self) -> Any:
        """The engine that bound this method, or None once it is gone."""
        return self._engine()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        engine = self._engine()
        if engine is None:
            _refuse(
                f"optimizer.{self._name}(): the engine this optimizer belonged to is gone; call it on the "
                "optimizer of a live engine (engine.optimizer)"
            )
        return getattr(engine, self._name)(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<optimizer.{self._name} of the dscore engine (engine.{self._name})>"


#: the methods DeepSpeed's ZeRO optimizers have that the engine's optimizer gets (the engine's calls)
OPTIMIZER_STATE_METHODS: tuple[str, ...] = ("offload_states", "reload_states", "empty_partition_cache")


def bind_optimizer_state_methods(engine: Any, optimizer: Any) -> list[str]:
    """Give ``optimizer`` (what ``engine.optimizer`` returns) :data:`OPTIMIZER_STATE_METHODS` as instance
    attributes calling ``engine``'s methods (module docstring). An optimizer whose class defines one of
    them keeps its own; one bound to an earlier engine (a client optimizer passed to a second
    ``initialize``) is re-bound to ``engine``.

    Returns:
        the names bound.
    """
    if optimizer is None:
        return []
    bound = []
    for name in OPTIMIZER_STATE_METHODS:
        current = vars(optimizer).get(name)
        if current is not None and not isinstance(current, OptimizerStateMethod):
            continue  # set by the user: theirs
        if current is None and hasattr(type(optimizer), name):
            continue  # the optimizer's own method
        setattr(optimizer, name, OptimizerStateMethod(engine, name))
        bound.append(name)
    return bound
