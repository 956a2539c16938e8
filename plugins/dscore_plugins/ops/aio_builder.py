"""The ``async_io`` op builder: Linux kernel AIO through libaio (torch-free; probes only on demand).

:meth:`AsyncIOBuilder.compatibility` asks the C++ compiler dscore builds with whether it can see
``libaio.h`` (``<cxx> -E``) and link ``libaio.so`` (``<cxx> -print-file-name=libaio.so``), so
``dscore report`` and ``dscore ops build`` name exactly which of the two is missing and how to install
it (Debian/Ubuntu ``libaio-dev``, Fedora/RHEL ``libaio-devel``). ``DS_BUILD_AIO=1`` selects the op for
``dscore ops build`` (DeepSpeed's variable of the same op).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

from dscore.errors import OpBuildError
from dscore.ops import OpBuilder, toolchain
from dscore_plugins.ops.builders import kernel_source_root

__all__ = ["AsyncIOBuilder", "libaio_status"]

_INSTALL_HINT = "install libaio's development files (Debian/Ubuntu: apt-get install libaio-dev; Fedora/RHEL: dnf install libaio-devel)"
_PROBE_TIMEOUT_S = 30.0


@functools.lru_cache(maxsize=8)
def _probe(cxx: str) -> tuple[bool, str]:
    """``(ok, reason)`` for one compiler: is ``libaio.h`` includable and ``libaio.so`` linkable."""
    missing: list[str] = []
    try:
        header = subprocess.run(
            [cxx, "-E", "-x", "c++", "-"], input="#include <libaio.h>\n", capture_output=True, text=True,
            timeout=_PROBE_TIMEOUT_S,
        )
        if header.returncode != 0:
            missing.append("the header libaio.h (not on the compiler's include path)")
        lib = subprocess.run(
            [cxx, "-print-file-name=libaio.so"], capture_output=True, text=True, timeout=_PROBE_TIMEOUT_S
        )
        lib_path = lib.stdout.strip()
        # the compiler echoes the bare name back when the file is on none of its library paths
        if lib.returncode != 0 or not os.path.isabs(lib_path) or not os.path.exists(lib_path):
            missing.append("the library libaio.so (not on the linker's search path)")
    except (OSError, subprocess.SubprocessError) as exc:
        return False, f"cannot run the C++ compiler {cxx} to look for libaio: {exc}"
    if missing:
        return False, f"{' and '.join(missing)} is missing; {_INSTALL_HINT}"
    return True, f"ok (libaio: {os.path.normpath(lib_path)})"


def libaio_status() -> tuple[bool, str]:
    """``(ok, reason)``: whether libaio's header and library are usable by dscore's C++ compiler.

    Never raises; a missing compiler is reported as the reason.
    """
    if not sys.platform.startswith("linux"):
        return False, f"kernel AIO (libaio) exists only on Linux; this is {sys.platform}"
    try:
        cxx = toolchain.find_cxx()
    except OpBuildError as exc:
        return False, str(exc)
    return _probe(cxx.path)


class AsyncIOBuilder(OpBuilder):
    """async_io: reads/writes of host memory to files at offsets through libaio (O_DIRECT when aligned).

    The compiled module exposes ``Handle(block_size, queue_depth, single_submit, overlap_events,
    threads)``; use it through :class:`dscore_plugins.ops.aio.AsyncIOHandle`, which checks arguments
    and turns failures into :class:`dscore_plugins.ops.aio.AsyncIOError`.
    """

    NAME = "async_io"
    BUILD_VAR = "DS_BUILD_AIO"
    DEVICE_TYPE = "cpu"

    def sources(self) -> list[Path]:
        return [kernel_source_root() / "aio" / "dscore_aio.cpp"]

    def cxx_flags(self) -> list[str]:
        return [*super().cxx_flags(), "-Wall"]

    def ld_flags(self) -> list[str]:
        return ["-laio"]

    def compatibility(self) -> tuple[bool, str]:
        return libaio_status()
