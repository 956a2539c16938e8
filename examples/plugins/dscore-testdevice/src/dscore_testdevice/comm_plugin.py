"""Manifest of the ``testnccl`` comm backend (NCCL's rules on ``testdev`` tensors, over gloo; :mod:`.comm`).

Torch-free: only the spec. torch.distributed learns the backend from the ``testdev`` accelerator's
``comm_backend_setup``, just before the process group is created.
"""

from __future__ import annotations

from dscore import hookimpl
from dscore.specs import CommBackendSpec

__all__ = ["dscore_register_comm_backends"]


@hookimpl
def dscore_register_comm_backends() -> list[CommBackendSpec]:
    """Register ``testnccl`` (NCCL's rules on testdev tensors, over gloo)."""
    return [
        CommBackendSpec(
            name="testnccl",
            torch_backend="testnccl",
            device_types=("testdev",),
            description="NCCL's rules (device tensors only, no p2p tags, results at wait) over gloo, for testdev",
        )
    ]
