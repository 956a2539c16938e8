"""The CUDA accelerator (``torch.cuda``); most methods are the base class's delegation to torch.cuda.

DeepSpeed facts mirrored (``accelerator/cuda_accelerator.py``): nccl is the collective backend (gloo on
Windows), ``CUDA_VISIBLE_DEVICES`` restricts devices, variables starting with ``NCCL`` are forwarded to
remote nodes, and fp16 needs compute capability 7.0 or newer (6.x is accepted only with
``DS_ALLOW_DEPRECATED_FP16=1``).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from dscore.accelerator import Accelerator

if TYPE_CHECKING:
    import torch

__all__ = ["CudaAccelerator"]


class CudaAccelerator(Accelerator):
    """NVIDIA GPUs (and AMD GPUs with a ROCm build of torch, which also uses ``torch.cuda``)."""

    name = "cuda"
    device_type = "cuda"
    default_comm_backend = "nccl"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"
    export_env_prefixes = ("NCCL",)

    def communication_backend_name(self) -> str:
        """``"nccl"``; ``"gloo"`` on Windows, where torch ships no nccl."""
        return "gloo" if sys.platform == "win32" else "nccl"

    def is_bf16_supported(self) -> bool:
        """``torch.cuda.is_bf16_supported()`` (Ampere or newer; emulation is not counted)."""
        import torch

        try:
            return bool(torch.cuda.is_bf16_supported(including_emulation=False))
        except TypeError:  # older torch without the keyword
            return bool(torch.cuda.is_bf16_supported())

    def is_fp16_supported(self) -> bool:
        """Compute capability >= 7.0, or 6.x with ``DS_ALLOW_DEPRECATED_FP16=1``."""
        import torch

        major, _minor = torch.cuda.get_device_capability()
        if major >= 7:
            return True
        return major == 6 and os.environ.get("DS_ALLOW_DEPRECATED_FP16", "0") == "1"

    def get_rng_state(self, index: int | None = None) -> torch.Tensor:
        """``torch.cuda.get_rng_state(device)``: a ``torch.uint8`` CPU tensor."""
        import torch

        return torch.cuda.get_rng_state(self._index(index))

    def range_push(self, message: str) -> None:
        """``torch.cuda.nvtx.range_push`` (visible in Nsight Systems)."""
        import torch

        torch.cuda.nvtx.range_push(message)

    def range_pop(self) -> None:
        """``torch.cuda.nvtx.range_pop``."""
        import torch

        torch.cuda.nvtx.range_pop()
