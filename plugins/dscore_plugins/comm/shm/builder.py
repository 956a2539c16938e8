"""The ``shm_sync`` op builder: the memory ordering of the shared-memory transport, in C++.

The source stays in the repository's ``csrc/comm/shm_sync.cpp`` (shipped as package data of
``dscore_plugins.ops``), found by :func:`dscore_plugins.ops.builders.kernel_source_root` like every other
kernel source. Importing this module probes and compiles nothing and does not import torch.
"""

from __future__ import annotations

from pathlib import Path

from dscore.ops import CPUOpBuilder
from dscore_plugins.ops.builders import kernel_source_root

__all__ = ["ShmSyncBuilder"]


class ShmSyncBuilder(CPUOpBuilder):
    """shm_sync: release/acquire words and futex wait/wake for the same-host shared-memory transport
    (:mod:`dscore_plugins.comm.shm.channel`); Linux only."""

    NAME = "shm_sync"
    BUILD_VAR = "DS_BUILD_SHM_SYNC"

    def sources(self) -> list[Path]:
        return [kernel_source_root() / "comm" / "shm_sync.cpp"]

    def cxx_flags(self) -> list[str]:
        return ["-O2", "-UC10_USE_GLOG"]  # no SIMD or OpenMP: a few atomics and system calls

    def ld_flags(self) -> list[str]:
        return []
