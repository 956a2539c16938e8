"""Host-memory policy of ZeRO stage 3 and NVMe offload: glibc returns large freed buffers to the OS.

Used by :mod:`.stage3` (parameters on the host) and :mod:`.nvme_optimizer` (``offload_optimizer: nvme``);
see :func:`apply_host_malloc_policy`.
"""

from __future__ import annotations

import logging

from dscore.errors import ConfigError

__all__ = ["apply_host_malloc_policy"]

log = logging.getLogger("dscore.zero")

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_ENV = "DSCORE_MALLOC_MMAP_THRESHOLD"
_DEFAULT_MMAP_THRESHOLD = 1 << 20  # bytes
_malloc_policy_applied = False


def apply_host_malloc_policy() -> int:
    """Make glibc return large freed host buffers to the OS (stage 3 on CPU calls it once per process).

    Stage 3 frees every gathered unit after use and gathers it again later. glibc serves a large
    allocation with ``mmap`` only until the first such block is freed; then it raises its mmap threshold
    (up to 32 MiB) and keeps later blocks of that size in the heap, where freed memory stays in the
    process: peak RSS grows by the released buffers. Fixing ``M_MMAP_THRESHOLD`` (which also turns the
    dynamic adjustment off) keeps every block of at least that many bytes on ``mmap``, returned on
    ``free``; ``M_TRIM_THRESHOLD`` is set to twice that so the heap top is trimmed too. This is an
    allocation strategy set once, not a per-step ``malloc_trim``.

    Scope: process-wide (it affects every allocation of the process), applied by the first stage-3
    engine whose parameters live on the CPU; other allocators (jemalloc/tcmalloc via ``LD_PRELOAD``)
    and non-glibc systems are left alone. ``DSCORE_MALLOC_MMAP_THRESHOLD`` sets the threshold in bytes
    (default 1 MiB); ``0`` disables the policy. It is the process policy ``malloc_mmap_threshold``
    (:mod:`dscore.process`: ``DSCORE_PROCESS_POLICIES`` can turn it off).

    Returns:
        the threshold applied in bytes, or 0 when nothing was changed.

    Raises:
        ConfigError: ``DSCORE_MALLOC_MMAP_THRESHOLD`` is not an integer.
    """
    global _malloc_policy_applied
    if _malloc_policy_applied:
        return 0
    import ctypes
    import os
    import platform
    import sys

    from dscore import process

    raw = os.environ.get(_MMAP_THRESHOLD_ENV, "").strip()
    try:
        threshold = int(raw) if raw else _DEFAULT_MMAP_THRESHOLD
    except ValueError:
        raise ConfigError(
            f"environment variable {_MMAP_THRESHOLD_ENV}={raw!r} must be an integer number of bytes (0 disables)"
        ) from None
    _malloc_policy_applied = True
    if threshold <= 0 or not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return 0

    def set_thresholds() -> bool:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(threshold)) and libc.mallopt(
            _M_TRIM_THRESHOLD, ctypes.c_int(2 * threshold)
        ))

    try:
        ok = process.apply("malloc_mmap_threshold", set_thresholds)  # off: nothing changed (None)
    except (OSError, AttributeError):
        return 0
    if ok:
        log.debug("stage 3: glibc mmap threshold fixed at %d bytes (%s)", threshold, _MMAP_THRESHOLD_ENV)
    return threshold if ok else 0
