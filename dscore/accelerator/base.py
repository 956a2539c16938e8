"""The accelerator interface: small typed protocols plus an :class:`Accelerator` base class.

An accelerator is a device family (``cpu``, ``cuda``, ``xpu``, ``hpu``, ``npu``, ``mps``) registered by a
plugin through :class:`dscore.specs.AcceleratorSpec`. DeepSpeed has one untyped class of ~65 methods
(``accelerator/abstract_accelerator.py``); dscore splits the surface into protocols a caller can ask for
(:class:`DeviceControl`, :class:`StreamsAndEvents`, :class:`MemoryStats`, :class:`RngControl`,
:class:`Capabilities`, :class:`LaunchEnv`) and gives :class:`Accelerator` defaults that delegate to
``torch.get_device_module(device_type)`` (``torch.cuda``, ``torch.xpu``, ...), so a concrete accelerator
overrides only what differs from its torch device module.

Nothing here imports torch at module level; the base class imports it on first use.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from dscore.errors import AcceleratorError

if TYPE_CHECKING:
    import torch

__all__ = [
    "Accelerator",
    "Capabilities",
    "DeviceControl",
    "LaunchEnv",
    "MemoryStats",
    "ProbeResult",
    "RngControl",
    "StreamsAndEvents",
]


@dataclass(frozen=True)
class ProbeResult:
    """What an accelerator's probe found on this machine.

    A probe is cheap and side-effect free: it never creates a device context, and an importable vendor
    package that sees zero devices reports ``available=False``.

    Attributes:
        available: True when the accelerator can be used here (``device_count >= 1``).
        reason: one line saying why (``"torch.cuda sees 2 device(s)"``, ``"torch built without CUDA"``).
        device_count: devices visible to this process (0 when unavailable).
    """

    available: bool
    reason: str
    device_count: int = 0


# ------------------------------------------------------------------------------------------ protocols
@runtime_checkable
class DeviceControl(Protocol):
    """Device naming and selection."""

    device_type: str

    def device_name(self, index: int | None = None) -> str: ...
    def device(self, index: int | None = None) -> torch.device: ...
    def current_device(self) -> int: ...
    def current_device_name(self) -> str: ...
    def set_device(self, index: int) -> None: ...
    def device_count(self) -> int: ...
    def synchronize(self, index: int | None = None) -> None: ...
    def is_available(self) -> bool: ...


@runtime_checkable
class StreamsAndEvents(Protocol):
    """Streams, events and the stream context manager."""

    @property
    def Stream(self) -> Any: ...  # noqa: N802 - mirrors torch.cuda.Stream
    @property
    def Event(self) -> Any: ...  # noqa: N802 - mirrors torch.cuda.Event
    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]: ...
    def current_stream(self, index: int | None = None) -> Any: ...


@runtime_checkable
class MemoryStats(Protocol):
    """Memory statistics, all in bytes."""

    def memory_allocated(self, index: int | None = None) -> int: ...
    def max_memory_allocated(self, index: int | None = None) -> int: ...
    def reset_peak_memory_stats(self, index: int | None = None) -> None: ...
    def memory_reserved(self, index: int | None = None) -> int: ...
    def total_memory(self, index: int | None = None) -> int: ...
    def available_memory(self, index: int | None = None) -> int: ...
    def empty_cache(self) -> None: ...


@runtime_checkable
class RngControl(Protocol):
    """Random-number generator state of the device."""

    def manual_seed(self, seed: int) -> None: ...
    def manual_seed_all(self, seed: int) -> None: ...
    def initial_seed(self) -> int: ...
    def get_rng_state(self, index: int | None = None) -> torch.Tensor: ...
    def set_rng_state(self, state: torch.Tensor, index: int | None = None) -> None: ...


@runtime_checkable
class Capabilities(Protocol):
    """Dtype support and traits."""

    def is_bf16_supported(self) -> bool: ...
    def is_fp16_supported(self) -> bool: ...
    def is_fp64_supported(self) -> bool: ...
    def supported_dtypes(self) -> list[torch.dtype]: ...
    def is_synchronized_device(self) -> bool: ...


@runtime_checkable
class LaunchEnv(Protocol):
    """What the launcher needs: device visibility, variables to forward, the default comm backend."""

    def communication_backend_name(self) -> str: ...
    def visible_devices_envs(self) -> list[str]: ...
    def set_visible_devices_envs(self, env: MutableMapping[str, str], device_ids: Sequence[int]) -> None: ...
    def export_envs(self) -> list[str]: ...


# ------------------------------------------------------------------------------------------ base class
class Accelerator:
    """Base class of every accelerator; defaults delegate to ``torch.get_device_module(device_type)``.

    Subclasses set the class attributes and override what their torch device module lacks. Instances
    are created with no arguments by :func:`dscore.accelerator.select_accelerator` and owned by a
    :class:`dscore.runtime.runtime.Runtime` (there is no global accelerator object).

    Attributes:
        name: the registered accelerator name (``"cuda"``).
        device_type: the torch device type (``"cuda"``).
        default_comm_backend: the comm-backend name :meth:`communication_backend_name` returns.
        visible_devices_env: the variable restricting visible devices (``CUDA_VISIBLE_DEVICES``), or ``None``.
        export_env_prefixes: variable-name prefixes the launcher forwards to remote nodes.
        default_compile_backend: the ``torch.compile`` backend :meth:`get_compile_backend` returns until
            :meth:`set_compile_backend` changes it (``"inductor"``; HPU ``"hpu_backend"``, as DeepSpeed 0.19.8).
    """

    name: ClassVar[str] = ""
    device_type: ClassVar[str] = ""
    default_comm_backend: ClassVar[str] = "gloo"
    visible_devices_env: ClassVar[str | None] = None
    export_env_prefixes: ClassVar[tuple[str, ...]] = ()
    default_compile_backend: ClassVar[str] = "inductor"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device_type={self.device_type!r})"

    # -------------------------------------------------------------- helpers
    def device_module(self) -> Any:
        """The torch module for this device type (``torch.cuda`` for ``cuda``).

        Raises:
            AcceleratorError: torch has no module for ``device_type``.
        """
        import torch

        try:
            return torch.get_device_module(self.device_type)
        except (RuntimeError, ValueError, AttributeError) as exc:
            raise AcceleratorError(
                f"torch {torch.__version__} has no device module for device type {self.device_type!r} "
                f"(accelerator {self.name!r}); install the vendor's torch extension"
            ) from exc

    def _module_call(self, attr: str, *args: Any, **kwargs: Any) -> Any:
        fn = getattr(self.device_module(), attr, None)
        if fn is None:
            raise AcceleratorError(
                f"accelerator {self.name!r}: torch.{self.device_type} has no {attr}(); "
                f"{type(self).__name__} must override it"
            )
        return fn(*args, **kwargs)

    def _index(self, index: int | None) -> int:
        return self.current_device() if index is None else int(index)

    # -------------------------------------------------------------- DeviceControl
    def device_name(self, index: int | None = None) -> str:
        """``"cuda"`` for ``index=None``, else ``"cuda:<index>"`` (a string torch.device accepts)."""
        return self.device_type if index is None else f"{self.device_type}:{int(index)}"

    def device(self, index: int | None = None) -> torch.device:
        """``torch.device`` for ``index`` (the current device when ``None``)."""
        import torch

        return torch.device(self.device_type, self._index(index))

    def current_device(self) -> int:
        """Index of the current device of this process."""
        return int(self._module_call("current_device"))

    def current_device_name(self) -> str:
        """``"<device_type>:<current index>"``."""
        return self.device_name(self.current_device())

    def set_device(self, index: int) -> None:
        """Make ``index`` the current device of this process.

        Raises:
            AcceleratorError: ``index`` is outside ``[0, device_count())``.
        """
        count = self.device_count()
        if not 0 <= int(index) < count:
            raise AcceleratorError(
                f"{self.name}: device index {index} is out of range; {count} device(s) are visible "
                f"(valid: 0..{count - 1}); check {self.visible_devices_env or 'the visible-devices variable'}"
            )
        self._module_call("set_device", int(index))

    def device_count(self) -> int:
        """Number of devices visible to this process."""
        return int(self._module_call("device_count"))

    def synchronize(self, index: int | None = None) -> None:
        """Wait for all queued work on the device to finish."""
        if index is None:
            self._module_call("synchronize")
        else:
            self._module_call("synchronize", int(index))

    def is_available(self) -> bool:
        """True when at least one device is usable."""
        return bool(self._module_call("is_available"))

    # -------------------------------------------------------------- StreamsAndEvents
    @property
    def Stream(self) -> Any:  # noqa: N802 - mirrors torch.cuda.Stream
        """The device's stream class (``torch.cuda.Stream``)."""
        return self.device_module().Stream

    @property
    def Event(self) -> Any:  # noqa: N802 - mirrors torch.cuda.Event
        """The device's event class (``torch.cuda.Event``)."""
        return self.device_module().Event

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Context manager making ``stream`` current (``torch.cuda.stream``)."""
        return self._module_call("stream", stream)

    def current_stream(self, index: int | None = None) -> Any:
        """The current stream of device ``index``."""
        return self._module_call("current_stream", index) if index is not None else self._module_call("current_stream")

    # -------------------------------------------------------------- MemoryStats (bytes)
    def memory_allocated(self, index: int | None = None) -> int:
        """Bytes currently held by tensors on the device."""
        return int(self._module_call("memory_allocated", index))

    def max_memory_allocated(self, index: int | None = None) -> int:
        """Peak of :meth:`memory_allocated` since start or the last :meth:`reset_peak_memory_stats`, bytes."""
        return int(self._module_call("max_memory_allocated", index))

    def reset_peak_memory_stats(self, index: int | None = None) -> None:
        """Restart the peak counters."""
        self._module_call("reset_peak_memory_stats", index)

    def memory_reserved(self, index: int | None = None) -> int:
        """Bytes held by the caching allocator (allocated plus cached)."""
        return int(self._module_call("memory_reserved", index))

    def total_memory(self, index: int | None = None) -> int:
        """Total device memory in bytes."""
        return int(self._module_call("get_device_properties", self._index(index)).total_memory)

    def available_memory(self, index: int | None = None) -> int:
        """Free device memory in bytes as the driver reports it (``mem_get_info``)."""
        free, _total = self._module_call("mem_get_info", self._index(index))
        return int(free)

    def empty_cache(self) -> None:
        """Release cached, unused blocks back to the device."""
        self._module_call("empty_cache")

    # -------------------------------------------------------------- RngControl
    def manual_seed(self, seed: int) -> None:
        """Seed the current device's generator."""
        self._module_call("manual_seed", int(seed))

    def manual_seed_all(self, seed: int) -> None:
        """Seed the generators of every device."""
        self._module_call("manual_seed_all", int(seed))

    def initial_seed(self) -> int:
        """The seed of the current device's generator."""
        return int(self._module_call("initial_seed"))

    def get_rng_state(self, index: int | None = None) -> torch.Tensor:
        """Generator state of device ``index`` as a ``torch.uint8`` CPU tensor."""
        return self._module_call("get_rng_state", self._index(index))

    def set_rng_state(self, state: torch.Tensor, index: int | None = None) -> None:
        """Restore what :meth:`get_rng_state` returned."""
        self._module_call("set_rng_state", state, self._index(index))

    # -------------------------------------------------------------- Capabilities
    def is_bf16_supported(self) -> bool:
        """True when bfloat16 training works on this device."""
        fn = getattr(self.device_module(), "is_bf16_supported", None)
        return bool(fn()) if fn is not None else False

    def is_fp16_supported(self) -> bool:
        """True when float16 training works on this device."""
        return True

    def is_fp64_supported(self) -> bool:
        """True when float64 works on this device (False on MPS)."""
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        """Floating dtypes usable for training here, float32 first."""
        import torch

        dtypes = [torch.float32]
        if self.is_fp16_supported():
            dtypes.append(torch.float16)
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        return dtypes

    def is_synchronized_device(self) -> bool:
        """True when kernels run synchronously with the host (CPU), so streams/events are no-ops."""
        return False

    # -------------------------------------------------------------- tensors
    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """A page-locked copy of a CPU ``tensor`` (same shape and dtype) for fast host-device copies."""
        return tensor.pin_memory()

    def supports_pinned_memory(self) -> bool:
        """True when this accelerator can page-lock host memory (False for the CPU: nothing to copy to)."""
        return True

    def empty_pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised 1-D host tensor of ``numel`` elements, page-locked when
        :meth:`supports_pinned_memory`: allocated pinned in one step, so a large offload buffer never exists
        twice (a plain allocation plus its pinned copy)."""
        import torch

        pin = self.supports_pinned_memory()
        return torch.empty(int(numel), dtype=dtype, device="cpu", pin_memory=pin)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """True when ``tensor`` lives in page-locked host memory."""
        return bool(tensor.is_pinned())

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """True when ``tensor`` lives on this accelerator's device type."""
        return tensor.device.type == self.device_type

    # -------------------------------------------------------------- ranges (profiler markers)
    def range_push(self, message: str) -> None:
        """Open a named profiler range; a no-op where the device has no range API."""

    def range_pop(self) -> None:
        """Close the innermost profiler range; a no-op where the device has no range API."""

    # -------------------------------------------------------------- torch.compile
    def get_compile_backend(self) -> str:
        """The ``torch.compile`` backend name ``engine.compile()`` uses when none is given (DeepSpeed's
        ``get_accelerator().get_compile_backend()``): :attr:`default_compile_backend` unless
        :meth:`set_compile_backend` chose another for this accelerator instance."""
        return str(self.__dict__.get("_compile_backend", self.default_compile_backend))

    def set_compile_backend(self, backend: str) -> None:
        """Make ``backend`` this accelerator's default ``torch.compile`` backend.

        Raises:
            AcceleratorError: ``backend`` is not a registered dynamo backend
                (``torch._dynamo.list_backends(exclude_tags=())``); the message lists the valid names.
        """
        import torch._dynamo

        known = sorted(torch._dynamo.list_backends(exclude_tags=()))
        if backend not in known:
            raise AcceleratorError(
                f"set_compile_backend({backend!r}): not a torch.compile backend known on {self.name or self.device_type}; "
                f"valid: {', '.join(known)}"
            )
        self._compile_backend = backend

    # -------------------------------------------------------------- LaunchEnv
    def communication_backend_name(self) -> str:
        """Name of the comm-backend plugin used by default (``"nccl"`` for cuda, ``"gloo"`` for cpu)."""
        return self.default_comm_backend

    def comm_backend_setup(self, backend: str) -> None:
        """Import whatever registers ``backend`` with torch.distributed (HPU's hccl module); default none."""

    def visible_devices_envs(self) -> list[str]:
        """Variables restricting the devices a process sees (``["CUDA_VISIBLE_DEVICES"]``); may be empty."""
        return [self.visible_devices_env] if self.visible_devices_env else []

    def set_visible_devices_envs(self, env: MutableMapping[str, str], device_ids: Sequence[int]) -> None:
        """Write ``device_ids`` (comma-separated) into every visible-devices variable of ``env``."""
        value = ",".join(str(int(i)) for i in device_ids)
        for var in self.visible_devices_envs():
            env[var] = value

    def export_envs(self) -> list[str]:
        """Variable-name prefixes the launcher forwards to remote nodes (``["NCCL"]`` for cuda)."""
        return list(self.export_env_prefixes)

    def launch_env(self, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """The variables of ``environ`` (default ``os.environ``) whose names start with an export prefix."""
        env = os.environ if environ is None else environ
        prefixes = tuple(self.export_envs())
        return {k: v for k, v in env.items() if prefixes and k.startswith(prefixes)}
