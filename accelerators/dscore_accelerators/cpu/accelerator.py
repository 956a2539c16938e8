"""The CPU accelerator.

Choices (and how they relate to DeepSpeed's ``accelerator/cpu_accelerator.py``):

* ``device_count()`` is 1: the host is one device. How many CPU processes run per node is decided by
  ``dscore run --num_gpus N`` (default 1), not by this class. DeepSpeed instead returns ``LOCAL_SIZE``
  or the number of NUMA nodes that have cores.
* ``set_device(i)`` accepts any non-negative index and does nothing: all CPU ranks share the host, so
  ``set_device(local_rank)`` in generic code works as on DeepSpeed's CPU accelerator.
* bf16: supported. torch's CPU kernels implement bfloat16 for every training op on any x86-64/aarch64
  CPU (emulated through float32 where the CPU lacks AVX512-BF16/AMX-BF16, so slower there).
* fp16: supported only when the CPU computes fp16 natively (AMX-FP16 or AVX512-FP16, as reported by
  ``torch.cpu.get_capabilities()``). DeepSpeed likewise reports fp16 only with oneDNN fp16 support, but
  returns ``None`` rather than ``False`` otherwise.
* Communication backend: ``ccl`` when ``oneccl_bindings_for_pytorch`` is installed (checked without
  importing it), else ``gloo`` — DeepSpeed's rule.
* No visible-devices variable and no exported prefixes. ``pin_memory`` returns the tensor itself:
  page-locking needs an accelerator, and CPU training has no host-to-device copies to speed up.
* Memory statistics are the process's resident set size (RSS) in bytes; ``total_memory`` is physical
  RAM and ``available_memory`` the memory the OS reports available. ``psutil`` is used when installed,
  ``/proc`` and ``os.sysconf`` otherwise.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from typing import TYPE_CHECKING, Any

from dscore.accelerator import Accelerator
from dscore.errors import AcceleratorError

if TYPE_CHECKING:
    import torch

__all__ = ["CpuAccelerator"]


def _rss_bytes() -> int:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        pass
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource  # Unix only; reached only where /proc is missing

        # ru_maxrss: kilobytes on Linux, bytes on macOS; the peak is the best we have here
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)


class CpuAccelerator(Accelerator):
    """The host CPU as a dscore accelerator (see the module docstring for every choice made)."""

    name = "cpu"
    device_type = "cpu"
    default_comm_backend = "gloo"
    visible_devices_env = None
    export_env_prefixes = ()

    def __init__(self) -> None:
        self._peak_rss = 0

    # ---------------------------------------------------------------- device control
    def device_name(self, index: int | None = None) -> str:
        """Always ``"cpu"`` (the index is ignored: there is one host device)."""
        return "cpu"

    def device(self, index: int | None = None) -> torch.device:
        """``torch.device("cpu")`` whatever the index."""
        import torch

        return torch.device("cpu")

    def current_device(self) -> int:
        """Always 0."""
        return 0

    def current_device_name(self) -> str:
        """Always ``"cpu"``."""
        return "cpu"

    def set_device(self, index: int) -> None:
        """Accept any non-negative index and do nothing (all ranks share the host).

        Raises:
            AcceleratorError: ``index`` is negative.
        """
        if int(index) < 0:
            raise AcceleratorError(f"cpu: device index must be >= 0, got {index}")

    def device_count(self) -> int:
        """1: the host is one device (processes per node come from ``dscore run --num_gpus``)."""
        return 1

    def synchronize(self, index: int | None = None) -> None:
        """No-op: CPU kernels finish before they return."""

    def is_available(self) -> bool:
        """Always True."""
        return True

    # ---------------------------------------------------------------- streams and events
    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """``torch.cpu.stream(stream)`` (a no-op context: CPU work is synchronous)."""
        import torch

        return torch.cpu.stream(stream)

    def current_stream(self, index: int | None = None) -> Any:
        """``torch.cpu.current_stream()``."""
        import torch

        return torch.cpu.current_stream()

    # ---------------------------------------------------------------- memory (bytes)
    def memory_allocated(self, index: int | None = None) -> int:
        """Resident set size of this process in bytes."""
        rss = _rss_bytes()
        self._peak_rss = max(self._peak_rss, rss)
        return rss

    def max_memory_allocated(self, index: int | None = None) -> int:
        """Largest RSS seen by :meth:`memory_allocated` (or now) since the last reset, bytes."""
        return max(self._peak_rss, self.memory_allocated())

    def reset_peak_memory_stats(self, index: int | None = None) -> None:
        """Restart the peak at the current RSS."""
        self._peak_rss = _rss_bytes()

    def memory_reserved(self, index: int | None = None) -> int:
        """Same as :meth:`memory_allocated` (the CPU allocator has no separate cache statistic)."""
        return self.memory_allocated()

    def total_memory(self, index: int | None = None) -> int:
        """Physical RAM of the host in bytes."""
        try:
            import psutil

            return int(psutil.virtual_memory().total)
        except ImportError:
            return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    def available_memory(self, index: int | None = None) -> int:
        """Memory the OS reports available for new allocations, bytes."""
        try:
            import psutil

            return int(psutil.virtual_memory().available)
        except ImportError:
            pass
        try:
            with open("/proc/meminfo") as fh:
                for line in fh:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))

    def empty_cache(self) -> None:
        """No-op: the CPU allocator returns memory to the OS itself."""

    # ---------------------------------------------------------------- RNG
    def manual_seed(self, seed: int) -> None:
        """``torch.manual_seed(seed)``."""
        import torch

        torch.manual_seed(int(seed))

    def manual_seed_all(self, seed: int) -> None:
        """Same as :meth:`manual_seed` (one device)."""
        self.manual_seed(seed)

    def initial_seed(self) -> int:
        """``torch.initial_seed()``."""
        import torch

        return int(torch.initial_seed())

    def get_rng_state(self, index: int | None = None) -> torch.Tensor:
        """``torch.get_rng_state()``: a ``torch.uint8`` tensor."""
        import torch

        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, index: int | None = None) -> None:
        """``torch.set_rng_state(state)``."""
        import torch

        torch.set_rng_state(state)

    # ---------------------------------------------------------------- capabilities
    def is_bf16_supported(self) -> bool:
        """True: torch CPU kernels support bfloat16 everywhere (native with AVX512-BF16/AMX, else emulated)."""
        return True

    def is_fp16_supported(self) -> bool:
        """True only when the CPU computes fp16 natively (AMX-FP16 or AVX512-FP16)."""
        import torch

        caps_fn = getattr(torch.cpu, "get_capabilities", None)
        if caps_fn is not None:
            caps = caps_fn()
            return bool(caps.get("amx_fp16") or caps.get("avx512_fp16"))
        amx = getattr(torch.cpu, "_is_amx_fp16_supported", None)
        return bool(amx()) if amx is not None else False

    def is_synchronized_device(self) -> bool:
        """True: CPU kernels are synchronous with the host."""
        return True

    # ---------------------------------------------------------------- tensors
    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """Returns ``tensor`` itself (page-locking needs an accelerator; nothing to speed up on CPU)."""
        return tensor

    def supports_pinned_memory(self) -> bool:
        """False: the CPU accelerator never page-locks memory (see :meth:`pin_memory`)."""
        return False

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Always False on the CPU accelerator."""
        return False

    # ---------------------------------------------------------------- launch env
    def communication_backend_name(self) -> str:
        """``"ccl"`` when oneCCL bindings are installed (found without importing them), else ``"gloo"``."""
        if importlib.util.find_spec("oneccl_bindings_for_pytorch") is not None:
            return "ccl"
        return "gloo"
