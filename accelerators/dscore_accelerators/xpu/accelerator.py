"""The Intel XPU accelerator (``torch.xpu``, in mainline torch since 2.4).

DeepSpeed facts mirrored (``accelerator/xpu_accelerator.py``): the collective backend is ``ccl`` when
``oneccl_bindings_for_pytorch`` is installed, otherwise torch's built-in ``xccl``; devices are restricted
with ``ZE_AFFINITY_MASK``.
"""

from __future__ import annotations

import importlib.util

from dscore.accelerator import Accelerator

__all__ = ["XpuAccelerator"]


class XpuAccelerator(Accelerator):
    """Intel GPUs; everything not overridden delegates to ``torch.xpu``."""

    name = "xpu"
    device_type = "xpu"
    default_comm_backend = "xccl"
    visible_devices_env = "ZE_AFFINITY_MASK"
    export_env_prefixes = ("CCL", "I_MPI", "FI_")

    def communication_backend_name(self) -> str:
        """``"ccl"`` when oneCCL bindings are installed (found without importing them), else ``"xccl"``."""
        if importlib.util.find_spec("oneccl_bindings_for_pytorch") is not None:
            return "ccl"
        return "xccl"

    def is_bf16_supported(self) -> bool:
        """True: every torch-supported Intel GPU computes bfloat16."""
        return True

    def comm_backend_setup(self, backend: str) -> None:
        """Import the oneCCL bindings before ``init_process_group`` when ``backend`` is ``ccl``."""
        if backend == "ccl":
            import oneccl_bindings_for_pytorch  # noqa: F401 - registers the ccl backend with torch
