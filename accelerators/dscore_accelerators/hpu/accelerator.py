"""The Intel Gaudi accelerator (``habana_frameworks.torch``, which registers ``torch.hpu``).

DeepSpeed facts mirrored (``accelerator/hpu_accelerator.py``): the collective backend is ``hccl``,
registered by importing ``habana_frameworks.torch.distributed.hccl``; first-generation Gaudi does not
train in fp16. Difference: the visible-devices variable is ``HABANA_VISIBLE_MODULES`` (what the Gaudi
runtime reads), where DeepSpeed reuses ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import re
from typing import Any

from dscore.accelerator import Accelerator

__all__ = ["HpuAccelerator"]


class HpuAccelerator(Accelerator):
    """Intel Gaudi; importing the bridge on creation makes ``torch.hpu`` available to the base class."""

    name = "hpu"
    default_compile_backend = "hpu_backend"
    device_type = "hpu"
    default_comm_backend = "hccl"
    visible_devices_env = "HABANA_VISIBLE_MODULES"
    export_env_prefixes = ("PT_HPU", "HABANA", "HCCL")

    def __init__(self) -> None:
        import habana_frameworks.torch.core  # noqa: F401 - registers the hpu device with torch
        import habana_frameworks.torch.hpu as hpu

        self._hpu = hpu

    def device_module(self) -> Any:
        """``habana_frameworks.torch.hpu`` (also reachable as ``torch.hpu``)."""
        return self._hpu

    def is_bf16_supported(self) -> bool:
        """True on every Gaudi generation."""
        return True

    def is_fp16_supported(self) -> bool:
        """False on first-generation Gaudi, True on Gaudi2 and newer."""
        match = re.search(r"GAUDI(\d*)", str(self._hpu.get_device_name()).upper())
        generation = int(match.group(1)) if match and match.group(1) else 1
        return generation >= 2

    def comm_backend_setup(self, backend: str) -> None:
        """Import ``habana_frameworks.torch.distributed.hccl`` so torch knows the ``hccl`` backend."""
        if backend == "hccl":
            import habana_frameworks.torch.distributed.hccl  # noqa: F401
