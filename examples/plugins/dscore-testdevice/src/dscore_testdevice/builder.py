"""The op builder of the test device's C++ extension (built with ninja into dscore's op cache, like any op)."""

from __future__ import annotations

from pathlib import Path

from dscore.ops import OpBuilder

__all__ = ["TestDeviceBuilder"]

_CSRC = Path(__file__).resolve().parent / "csrc"


class TestDeviceBuilder(OpBuilder):
    """``testdev``: the PrivateUse1 backend (allocator, guard, copies, CPU fallback) of ``csrc/testdev.cpp``."""

    NAME = "testdev"
    BUILD_VAR = "DS_BUILD_TESTDEV"
    DEVICE_TYPE = "cpu"  # compiled by the host compiler; the device it implements is "testdev"

    def sources(self) -> list[Path]:
        return [_CSRC / "testdev.cpp"]

    def cxx_flags(self) -> list[str]:
        return ["-O2", "-UC10_USE_GLOG"]
