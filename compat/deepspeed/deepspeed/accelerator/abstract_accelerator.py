"""``deepspeed.accelerator.abstract_accelerator.DeepSpeedAccelerator``: DeepSpeed 0.19.8's accelerator object
API over one of dscore's accelerator plugins (:class:`dscore.accelerator.Accelerator`).

Every method dscore's accelerator has is its own (device control, streams, memory statistics, RNG, dtype
support, pinning, launch environment). What DeepSpeed adds is mapped here:

* identity and traits: ``_name``, ``_communication_backend_name``, ``_compile_backend``, ``use_host_timers()``,
  ``resolves_data_dependency()``, ``handles_memory_backpressure()`` (all three: whether the device is
  synchronous with the host, DeepSpeed's rule);
* ``device_count()`` on the CPU accelerator: ``LOCAL_SIZE`` when set (DeepSpeed's convention: its launcher and
  mpirun set it to the processes per node), else dscore's count;
* DeepSpeed's memory-statistics aliases (``memory_cached``, ``max_memory_cached``, ``reset_max_memory_*``,
  ``max_memory_reserved``, ``memory_stats``), ``random()``, ``default_generator(i)``, ``default_stream(i)``,
  ``lazy_call(cb)``, the tensor-type properties (``FloatTensor``, ...: constructors that place the tensor on
  the current device), graphs (``create_graph``, ``capture_to_graph``, ``replay_graph``,
  ``is_current_stream_capturing``), ``is_triton_supported()``, ``unpin_memory``, ``pin_memory(t, ...)``;
* op builders: ``op_builder_dir()`` is ``deepspeed.ops.op_builder`` (one directory for every device: its
  builders report through dscore's op-builder registry), ``get_op_builder(class_name)`` /
  ``create_op_builder(class_name)`` the class / an instance, ``None`` for a name that directory lacks;
* compile: ``get_compile_backend()`` / ``set_compile_backend(name)`` (``inductor`` by default; a name torch's
  dynamo does not list is a ``ValueError`` naming the valid ones).

Differences kept from dscore (better-defined values): ``current_device()`` is an ``int`` (DeepSpeed's CPU
accelerator returns ``LOCAL_RANK`` as a string), ``device(i)`` a ``torch.device`` (``None`` there), and
``is_fp16_supported()`` a ``bool`` (``None`` there when false).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

from dscore.accelerator import Accelerator
from dscore.errors import AcceleratorError

__all__ = ["DeepSpeedAccelerator"]


class DeepSpeedAccelerator:
    """DeepSpeed's accelerator object over the dscore accelerator ``accelerator``.

    Args:
        accelerator: the dscore accelerator instance (an engine's ``runtime.accelerator`` or one made by
            :func:`dscore.accelerator.select_accelerator`).

    Raises:
        AcceleratorError: ``accelerator`` is not a :class:`dscore.accelerator.Accelerator`.
    """

    def __init__(self, accelerator: Accelerator) -> None:
        if not isinstance(accelerator, Accelerator):
            raise AcceleratorError(
                f"DeepSpeedAccelerator wraps a dscore.accelerator.Accelerator, got {type(accelerator).__name__}"
            )
        self._accelerator = accelerator
        self._name = accelerator.name
        self._communication_backend_name = accelerator.communication_backend_name()
        self._compile_backend = "inductor"

    @property
    def dscore_accelerator(self) -> Accelerator:
        """The dscore accelerator this object maps."""
        return self._accelerator

    def __getattr__(self, attr: str) -> Any:
        # everything dscore's accelerator has (device_name, synchronize, memory_allocated, manual_seed, ...)
        if attr.startswith("__") or attr == "_accelerator":
            raise AttributeError(attr)
        return getattr(self._accelerator, attr)

    def __repr__(self) -> str:
        return f"DeepSpeedAccelerator({self._accelerator!r})"

    def _torch(self) -> Any:
        import torch

        return torch

    # ---------------------------------------------------------------- traits
    def use_host_timers(self) -> bool:
        """True when host wall-clock timers time device work (a synchronous device)."""
        return self._accelerator.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        """True when the device orders dependent work itself (a synchronous device)."""
        return self._accelerator.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        """True when allocation waits for the device rather than failing (a synchronous device)."""
        return self._accelerator.is_synchronized_device()

    # ---------------------------------------------------------------- device
    def device_count(self) -> int:
        """Devices of this node. CPU: ``LOCAL_SIZE`` when set (DeepSpeed's convention), else dscore's count.

        Raises:
            AcceleratorError: ``LOCAL_SIZE`` is set but not a positive integer.
        """
        if self._accelerator.device_type == "cpu" and os.environ.get("LOCAL_SIZE", "").strip():
            raw = os.environ["LOCAL_SIZE"].strip()
            try:
                n = int(raw)
            except ValueError:
                n = 0
            if n < 1:
                raise AcceleratorError(f"LOCAL_SIZE={raw!r}: the CPU device count must be a positive integer")
            return n
        return self._accelerator.device_count()

    # ---------------------------------------------------------------- RNG
    def random(self) -> Any:
        """``torch.random`` (the host RNG module DeepSpeed returns on every accelerator)."""
        return self._torch().random

    def default_generator(self, device_index: int) -> Any:
        """The default ``torch.Generator`` of device ``device_index`` (the host's on the CPU)."""
        torch = self._torch()
        if self._accelerator.device_type == "cpu":
            return torch.default_generator
        return self._accelerator.device_module().default_generators[int(device_index)]

    # ---------------------------------------------------------------- streams
    def default_stream(self, device_index: int | None = None) -> Any:
        """The default stream of device ``device_index``; ``None`` on a synchronous device (no streams)."""
        if self._accelerator.is_synchronized_device():
            return None
        module = self._accelerator.device_module()
        return module.default_stream(device_index) if device_index is not None else module.default_stream()

    def lazy_call(self, callback: Callable[[], Any]) -> Any:
        """Run ``callback`` once the device is initialised (at once on a synchronous device)."""
        if self._accelerator.is_synchronized_device():
            return callback()
        return self._accelerator.device_module()._lazy_call(callback)

    # ---------------------------------------------------------------- memory (bytes)
    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        """Reset the peak of :meth:`memory_allocated` (dscore's ``reset_peak_memory_stats``)."""
        self._accelerator.reset_peak_memory_stats(device_index)

    reset_max_memory_cached = reset_max_memory_allocated

    def memory_cached(self, device_index: int | None = None) -> int:
        """Bytes held by the caching allocator: DeepSpeed's old name of :meth:`memory_reserved`."""
        return self._accelerator.memory_reserved(device_index)

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        """Peak of :meth:`memory_reserved`; on a synchronous device (no caching allocator) the peak of
        :meth:`memory_allocated`, as DeepSpeed's CPU accelerator."""
        if self._accelerator.is_synchronized_device():
            return self._accelerator.max_memory_allocated(device_index)
        module = self._accelerator.device_module()
        return int(module.max_memory_reserved(device_index))

    max_memory_cached = max_memory_reserved

    def memory_stats(self, device_index: int | None = None) -> dict[str, int]:
        """The device allocator's statistics (``torch.cuda.memory_stats``); on a synchronous device the
        current and peak allocated bytes under DeepSpeed's keys ``allocated_bytes.all.current`` / ``.peak``."""
        if self._accelerator.is_synchronized_device():
            return {"allocated_bytes.all.current": self._accelerator.memory_allocated(device_index),
                    "allocated_bytes.all.peak": self._accelerator.max_memory_allocated(device_index)}
        return dict(self._accelerator.device_module().memory_stats(device_index))

    # ---------------------------------------------------------------- pinning
    def pin_memory(self, tensor: Any, make_copy: bool = True, match_shape: bool = True) -> Any:
        """A page-locked ``tensor`` (dscore's ``pin_memory``; the tensor itself on the CPU accelerator).
        ``make_copy`` / ``match_shape`` are DeepSpeed 0.19.8's pin-pool options: the result is always a
        fresh pinned copy of the same shape, which satisfies both."""
        return self._accelerator.pin_memory(tensor)

    def unpin_memory(self, tensor: Any) -> Any:
        """``tensor`` (a pinned torch tensor is released when it is freed; nothing to undo by hand)."""
        return tensor

    # ---------------------------------------------------------------- misc
    def is_triton_supported(self) -> bool:
        """True when triton is installed and the device is CUDA with compute capability >= 8 (DeepSpeed's
        rule); False elsewhere."""
        if self._accelerator.device_type != "cuda":
            return False
        import importlib.util

        if importlib.util.find_spec("triton") is None:
            return False
        major, _ = self._accelerator.device_module().get_device_capability()
        return bool(major >= 8)

    def prefer_triton_grouped_mm(self) -> bool:
        """False: dscore's MoE uses torch's grouped matmul, never a triton kernel."""
        return False

    # ---------------------------------------------------------------- graphs
    def _graph_module(self) -> Any:
        module = None if self._accelerator.is_synchronized_device() else self._accelerator.device_module()
        return module if module is not None and hasattr(module, "graph") else None

    def is_current_stream_capturing(self) -> bool:
        """True while a graph capture runs on the current stream (never on a device without graphs)."""
        module = self._graph_module()
        return bool(module.is_current_stream_capturing()) if module is not None else False

    def create_graph(self) -> Any:
        """A new device graph (``torch.cuda.CUDAGraph``); ``None`` on a device without graphs."""
        module = self._graph_module()
        return module.CUDAGraph() if module is not None and hasattr(module, "CUDAGraph") else None

    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None) -> contextlib.AbstractContextManager[Any]:
        """A context capturing the work inside it into ``graph`` (a no-op context without graphs)."""
        module = self._graph_module()
        if module is None or graph is None:
            return contextlib.nullcontext()
        return module.graph(graph, pool=pool, stream=stream)

    def replay_graph(self, graph: Any) -> None:
        """Replay a captured ``graph`` (nothing to do for ``None``, what :meth:`create_graph` gives without
        graphs)."""
        if graph is not None:
            graph.replay()

    # ---------------------------------------------------------------- tensor types
    def _tensor_type(self, dtype_name: str) -> Callable[..., Any]:
        torch = self._torch()
        dtype = getattr(torch, dtype_name)
        device = self._accelerator.current_device_name()

        def make(*data: Any, **kwargs: Any) -> Any:
            # DeepSpeed's properties are torch's legacy typed constructors for the device; these build the
            # same tensors with an explicit device and dtype: T(data) copies data, T(n, m) is empty.
            if len(data) == 1 and not isinstance(data[0], int):
                return torch.tensor(data[0], dtype=dtype, device=device, **kwargs)
            return torch.empty(*data, dtype=dtype, device=device, **kwargs)

        make.__name__ = f"{dtype_name}_tensor"
        return make

    BFloat16Tensor = property(lambda self: self._tensor_type("bfloat16"))
    ByteTensor = property(lambda self: self._tensor_type("uint8"))
    DoubleTensor = property(lambda self: self._tensor_type("float64"))
    FloatTensor = property(lambda self: self._tensor_type("float32"))
    HalfTensor = property(lambda self: self._tensor_type("float16"))
    IntTensor = property(lambda self: self._tensor_type("int32"))
    LongTensor = property(lambda self: self._tensor_type("int64"))

    # ---------------------------------------------------------------- op builders
    def op_builder_dir(self) -> str:
        """``"deepspeed.ops.op_builder"``: the compat distribution's one builder directory (every device)."""
        return "deepspeed.ops.op_builder"

    def get_op_builder(self, class_name: str) -> Any:
        """The builder class ``class_name`` of :mod:`deepspeed.ops.op_builder` (``"CPUAdamBuilder"``), or
        ``None`` when that directory has no such class (DeepSpeed's answer for an unknown op)."""
        from deepspeed.ops import op_builder

        return getattr(op_builder, class_name, None) if class_name in op_builder.__all__ else None

    def create_op_builder(self, class_name: str) -> Any:
        """An instance of :meth:`get_op_builder`'s class, or ``None``."""
        cls = self.get_op_builder(class_name)
        return cls() if cls is not None else None

    def build_extension(self) -> Any:
        """torch's ``BuildExtension`` (what DeepSpeed's setup passes to ``cmdclass``)."""
        from torch.utils.cpp_extension import BuildExtension

        return BuildExtension

    # ---------------------------------------------------------------- compile
    def get_compile_backend(self) -> str:
        """The ``torch.compile`` backend name used by ``engine.compile()`` callers (default ``inductor``)."""
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        """Set :meth:`get_compile_backend`.

        Raises:
            ValueError: ``backend`` is not one of torch dynamo's backends (the message lists them).
        """
        import torch._dynamo

        supported = torch._dynamo.list_backends(exclude_tags=())
        if backend not in supported:
            raise ValueError(f"{backend} not supported by {self.device_name()}. Supported Backends are {supported}")
        self._compile_backend = backend


