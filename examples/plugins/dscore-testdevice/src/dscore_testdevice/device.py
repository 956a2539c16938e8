"""Activate the ``testdev`` device in this process: build/load the C++ backend, rename ``PrivateUse1``.

After :func:`activate`, ``torch.device("testdev", i)`` works for ``i < device_count()`` (default 8, set
``DSCORE_TESTDEV_COUNT``), tensors have ``.testdev()`` / ``.is_testdev``, modules ``.testdev()``, and
``torch.testdev`` is the device module (``torch.get_device_module("testdev")``) with the functions dscore's
accelerator base class calls on ``torch.cuda``: device control, streams and events (``torch.Stream`` /
``torch.Event`` of this device type), memory statistics (bytes held by device tensors and their peak),
RNG (the CPU generator: operators run through the CPU fallback, which draws from it), and capabilities.

What is emulated and how it differs from a GPU:

* Memory is host RAM underneath, but only ``.to("testdev")`` / ``.cpu()`` (``_copy_from``) move data between
  the two; every other operator on a mix of testdev and non-scalar CPU tensors raises torch's
  "Expected all tensors to be on the same device" (0-dim CPU tensors and CPU index tensors are accepted,
  as CUDA accepts them).
* Kernels run synchronously on the calling thread, so streams and events order work trivially;
  ``Event.elapsed_time`` measures host time between records.
* ``pin_memory()`` hands out host memory from a separate allocator that remembers its ranges, so
  ``is_pinned()`` is true exactly for memory pinned through this device.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
import types
from typing import Any

__all__ = ["DEVICE_TYPE", "activate", "extension"]

DEVICE_TYPE = "testdev"
log = logging.getLogger("dscore_testdevice")
_lock = threading.Lock()
_ext: Any = None


def extension() -> Any:
    """The loaded C++ extension (builds it on first use, see :class:`.builder.TestDeviceBuilder`)."""
    activate()
    return _ext


def activate() -> types.ModuleType:
    """Build (once, cached) and register the ``testdev`` device; idempotent. Returns ``torch.testdev``.

    Raises:
        dscore.errors.OpBuildError: the extension cannot be compiled here.
        RuntimeError: ``PrivateUse1`` was already renamed to another device type in this process.
    """
    global _ext
    import torch

    with _lock:
        if _ext is not None:
            return torch.testdev  # type: ignore[attr-defined,no-any-return]
        from dscore_testdevice.builder import TestDeviceBuilder

        ext = TestDeviceBuilder().load()
        ext.register_hooks()
        if torch._C._get_privateuse1_backend_name() != DEVICE_TYPE:
            torch.utils.rename_privateuse1_backend(DEVICE_TYPE)
        module = _device_module(ext)
        torch._register_device_module(DEVICE_TYPE, module)
        torch.utils.generate_methods_for_privateuse1_backend(
            for_tensor=True, for_module=True, for_packed_sequence=True, for_storage=True
        )
        _ext = ext
        atexit.register(_quiesce_autograd_threads)
        log.debug("testdev device registered (%d devices)", ext.device_count())
        return module


def _autograd_thread_activity() -> int:
    """Nanoseconds torch's autograd device threads (``pt_autograd_<i>``) have run or waited to run."""
    total = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as fh:
                if not fh.read().startswith("pt_autograd_"):
                    continue
            with open(f"/proc/self/task/{tid}/schedstat") as fh:
                run, wait, _ = fh.read().split()
            total += int(run) + int(wait)
        except (OSError, ValueError):
            continue
    return total


def _quiesce_autograd_threads() -> None:
    """At exit, release the GIL until the autograd device threads are idle (at most 2 s).

    torch runs the backward of a non-CPU device on its own thread, which may still drop the last
    reference to a finished graph task (and so decref a Python object, needing the GIL) when the main
    thread returns; if the interpreter is finalizing by then, that thread is cancelled inside a noexcept
    destructor and the process aborts ("terminate called without an active exception"). CUDA has the
    same window; on this synchronous device it is hit often. Waiting here closes it.
    """
    deadline = time.monotonic() + 2.0
    last, quiet = _autograd_thread_activity(), 0
    while quiet < 3 and time.monotonic() < deadline:
        time.sleep(0.002)
        now = _autograd_thread_activity()
        quiet = quiet + 1 if now == last else 0
        last = now


def _device_module(ext: Any) -> types.ModuleType:
    import torch

    mod = types.ModuleType("torch.testdev", "the testdev device module (dscore_testdevice.device)")

    def _idx(device: Any = None) -> int:
        if device is None:
            return int(ext.current_device())
        if isinstance(device, int):
            return device
        d = torch.device(device)
        return int(ext.current_device()) if d.index is None else int(d.index)

    def stream_cls(device: Any = None, priority: int = 0) -> Any:
        return torch.Stream(torch.device(DEVICE_TYPE, _idx(device)), priority=priority)

    def event_cls(enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> Any:
        return torch.Event(torch.device(DEVICE_TYPE, int(ext.current_device())), enable_timing=enable_timing)

    @contextlib.contextmanager
    def stream(s: Any) -> Any:
        if s is None:
            yield
            return
        prev = torch.accelerator.current_stream(s.device)
        torch.accelerator.set_stream(s)
        try:
            yield
        finally:
            torch.accelerator.set_stream(prev)

    @contextlib.contextmanager
    def device(d: Any) -> Any:
        prev = int(ext.current_device())
        ext.set_device(_idx(d))
        try:
            yield
        finally:
            ext.set_device(prev)

    class _Props:
        def __init__(self, index: int) -> None:
            import os

            self.name = f"testdev {index} (host memory)"
            self.total_memory = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
            self.major, self.minor = 0, 0
            self.multi_processor_count = 1

    funcs: dict[str, Any] = {
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "_is_in_bad_fork": lambda: False,
        "device_count": lambda: int(ext.device_count()),
        "current_device": lambda: int(ext.current_device()),
        "set_device": lambda d: ext.set_device(_idx(d)),
        "synchronize": lambda device=None: None,  # kernels are synchronous
        "Stream": stream_cls,
        "Event": event_cls,
        "stream": stream,
        "device": device,
        "current_stream": lambda device=None: torch.accelerator.current_stream(torch.device(DEVICE_TYPE, _idx(device))),
        "memory_allocated": lambda device=None: int(ext.memory_allocated(_idx(device))),
        "max_memory_allocated": lambda device=None: int(ext.max_memory_allocated(_idx(device))),
        "reset_peak_memory_stats": lambda device=None: ext.reset_peak_memory_stats(_idx(device)),
        "memory_reserved": lambda device=None: int(ext.memory_allocated(_idx(device))),
        "empty_cache": lambda: None,
        "get_device_properties": lambda device=None: _Props(_idx(device)),
        "mem_get_info": lambda device=None: (
            _Props(_idx(device)).total_memory - int(ext.memory_allocated(_idx(device))),
            _Props(_idx(device)).total_memory,
        ),
        "get_device_name": lambda device=None: _Props(_idx(device)).name,
        "is_bf16_supported": lambda including_emulation=True: True,
        # the device draws from the CPU generator (torch.manual_seed calls manual_seed_all here: no recursion)
        "manual_seed": lambda seed: torch.default_generator.manual_seed(int(seed)) and None,
        "manual_seed_all": lambda seed: torch.default_generator.manual_seed(int(seed)) and None,
        "seed": lambda: torch.default_generator.seed() and None,
        "initial_seed": lambda: torch.initial_seed(),
        "get_rng_state": lambda device=None: torch.get_rng_state(),
        "set_rng_state": lambda state, device=None: torch.set_rng_state(state),
        "get_amp_supported_dtype": lambda: [torch.float16, torch.bfloat16],
        # not in torch.cuda: device scalars read on the host so far (each a host sync on a GPU)
        "host_scalar_reads": lambda: int(ext.host_scalar_reads()),
    }
    for name, fn in funcs.items():
        setattr(mod, name, fn)
    return mod
