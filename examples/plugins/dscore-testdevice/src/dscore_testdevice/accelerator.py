"""The ``testdev`` accelerator: dscore's :class:`~dscore.accelerator.Accelerator` over ``torch.testdev``.

Written as a vendor would write one for a device dscore has never heard of: only public dscore names,
defaults of the base class (which call ``torch.get_device_module("testdev")``) wherever the device module
provides the function. Creating it builds (once, cached) and registers the device.
"""

from __future__ import annotations

from typing import Any

from dscore.accelerator import Accelerator
from dscore.errors import AcceleratorError

__all__ = ["TestDeviceAccelerator"]


class TestDeviceAccelerator(Accelerator):
    """A device that is not the host, with NCCL's rules (``testnccl``) as its default comm backend."""

    name = "testdev"
    device_type = "testdev"
    default_comm_backend = "testnccl"
    visible_devices_env = "DSCORE_TESTDEV_VISIBLE_DEVICES"
    export_env_prefixes = ("DSCORE_TESTDEV",)

    def __init__(self) -> None:
        from dscore_testdevice.device import activate

        self._module = activate()

    def device_module(self) -> Any:
        """``torch.testdev`` (registered by :func:`dscore_testdevice.device.activate`)."""
        return self._module

    def comm_backend_setup(self, backend: str) -> None:
        """Register ``testnccl`` with torch.distributed before a process group is created with it."""
        if backend == "testnccl":
            from dscore_testdevice.comm import register

            register()

    def is_bf16_supported(self) -> bool:
        """True: bf16 operators run through the CPU fallback."""
        return True

    def is_fp16_supported(self) -> bool:
        """True: fp16 operators run through the CPU fallback."""
        return True

    def set_device(self, index: int) -> None:
        """Make ``index`` current (checked against ``DSCORE_TESTDEV_COUNT``, default 8 devices)."""
        if not 0 <= int(index) < self.device_count():
            raise AcceleratorError(
                f"testdev: device index {index} is out of range; {self.device_count()} device(s) exist "
                "(DSCORE_TESTDEV_COUNT sets how many)"
            )
        self._module.set_device(int(index))
