"""The Apple MPS accelerator (``torch.mps``): one device, no streams, no float64.

DeepSpeed facts mirrored (``accelerator/mps_accelerator.py``, 0.19.8): gloo is the collective backend.
Differences: no visible-devices variable (there is one GPU), and ``max_memory_allocated`` is tracked by
this class because ``torch.mps`` keeps no peak counter.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from dscore.accelerator import Accelerator
from dscore.errors import AcceleratorError

if TYPE_CHECKING:
    import torch

__all__ = ["MpsAccelerator"]


class MpsAccelerator(Accelerator):
    """Apple silicon GPU: index 0 only."""

    name = "mps"
    device_type = "mps"
    default_comm_backend = "gloo"
    visible_devices_env = None
    export_env_prefixes = ("PYTORCH_MPS",)

    def __init__(self) -> None:
        self._peak = 0

    def device(self, index: int | None = None) -> torch.device:
        """``torch.device("mps")``."""
        import torch

        return torch.device("mps")

    def current_device(self) -> int:
        """Always 0."""
        return 0

    def set_device(self, index: int) -> None:
        """Only index 0 exists.

        Raises:
            AcceleratorError: ``index != 0``.
        """
        if int(index) != 0:
            raise AcceleratorError(f"mps: there is one device; index must be 0, got {index}")

    def device_count(self) -> int:
        """1 when MPS is usable, else 0."""
        import torch

        return 1 if torch.backends.mps.is_available() else 0

    def is_available(self) -> bool:
        """``torch.backends.mps.is_available()``."""
        import torch

        return bool(torch.backends.mps.is_available())

    def synchronize(self, index: int | None = None) -> None:
        """``torch.mps.synchronize()``."""
        import torch

        torch.mps.synchronize()

    @property
    def Stream(self) -> Any:  # noqa: N802
        """MPS has no user streams.

        Raises:
            AcceleratorError: always.
        """
        raise AcceleratorError("mps has no user-visible streams; use the default stream")

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """A no-op context (work is ordered on MPS's single command queue)."""
        return contextlib.nullcontext(stream)

    def current_stream(self, index: int | None = None) -> Any:
        """``None``: MPS has no stream objects."""
        return None

    def memory_allocated(self, index: int | None = None) -> int:
        """``torch.mps.current_allocated_memory()`` in bytes."""
        import torch

        value = int(torch.mps.current_allocated_memory())
        self._peak = max(self._peak, value)
        return value

    def max_memory_allocated(self, index: int | None = None) -> int:
        """Peak of :meth:`memory_allocated` as observed by this object, bytes."""
        return max(self._peak, self.memory_allocated())

    def reset_peak_memory_stats(self, index: int | None = None) -> None:
        """Restart the peak at the current allocation."""
        import torch

        self._peak = int(torch.mps.current_allocated_memory())

    def memory_reserved(self, index: int | None = None) -> int:
        """``torch.mps.driver_allocated_memory()`` in bytes."""
        import torch

        return int(torch.mps.driver_allocated_memory())

    def total_memory(self, index: int | None = None) -> int:
        """``torch.mps.recommended_max_memory()``: the Metal working-set limit in bytes."""
        import torch

        return int(torch.mps.recommended_max_memory())

    def available_memory(self, index: int | None = None) -> int:
        """Working-set limit minus driver-allocated memory, bytes."""
        return max(0, self.total_memory() - self.memory_reserved())

    def manual_seed_all(self, seed: int) -> None:
        """Same as :meth:`manual_seed` (one device)."""
        self.manual_seed(seed)

    def initial_seed(self) -> int:
        """``torch.initial_seed()`` (MPS shares the default seed)."""
        import torch

        return int(torch.initial_seed())

    def get_rng_state(self, index: int | None = None) -> torch.Tensor:
        """``torch.mps.get_rng_state()``."""
        import torch

        return torch.mps.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, index: int | None = None) -> None:
        """``torch.mps.set_rng_state(state)``."""
        import torch

        torch.mps.set_rng_state(state)

    def is_bf16_supported(self) -> bool:
        """True on macOS 14 or newer (where MPS has bfloat16 kernels)."""
        import torch

        check = getattr(torch.backends.mps, "is_macos_or_newer", None)
        return bool(check(14, 0)) if check is not None else False

    def is_fp64_supported(self) -> bool:
        """False: Metal has no float64."""
        return False

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """Returns ``tensor`` itself: Apple silicon memory is unified, there is nothing to page-lock."""
        return tensor

    def supports_pinned_memory(self) -> bool:
        """False, like :meth:`pin_memory`: MPS shares memory with the host."""
        return False

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Always False (unified memory)."""
        return False
