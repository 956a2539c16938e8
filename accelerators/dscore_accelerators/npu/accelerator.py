"""The Huawei Ascend accelerator (``torch_npu``, which registers ``torch.npu``).

DeepSpeed facts mirrored (``accelerator/npu_accelerator.py``): ``hccl`` for collectives,
``ASCEND_RT_VISIBLE_DEVICES`` restricts devices, variables starting with ``ASCEND``, ``HCCL``,
``LD_LIBRARY`` and ``PATH`` are forwarded to remote nodes.
"""

from __future__ import annotations

from dscore.accelerator import Accelerator

__all__ = ["NpuAccelerator"]


class NpuAccelerator(Accelerator):
    """Ascend NPUs; everything not overridden delegates to ``torch.npu``."""

    name = "npu"
    device_type = "npu"
    default_comm_backend = "hccl"
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"
    export_env_prefixes = ("ASCEND", "HCCL", "LD_LIBRARY", "PATH")

    def __init__(self) -> None:
        import torch_npu  # noqa: F401 - registers torch.npu and the hccl backend

    def comm_backend_setup(self, backend: str) -> None:
        """Nothing to import: ``torch_npu`` registered ``hccl`` when this accelerator was created."""
