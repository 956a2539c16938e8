"""Probes of the build toolchain: C++ compiler, ninja, CUDA (nvcc), CPU SIMD level, CUDA arch lists.

Every probe is a plain function called on demand (nothing runs at import) and is memoised per
executable path and modification time, so a cached op load pays a few milliseconds at most. Probes
that fail raise :class:`~dscore.errors.OpBuildError` with what was looked for and how to fix it.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from dscore.errors import OpBuildError

__all__ = [
    "Tool",
    "find_cxx",
    "find_ninja",
    "find_cuda_home",
    "find_nvcc",
    "cpu_simd_level",
    "simd_flags",
    "parse_cuda_arch_list",
    "cuda_arch_gencode_flags",
    "check_cuda_versions",
    "SIMD_LEVELS",
]

logger = logging.getLogger("dscore.ops")

#: SIMD levels a CPU op can be built for, best last.
SIMD_LEVELS: tuple[str, ...] = ("scalar", "avx2", "avx512")

_PROBE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Tool:
    """A located executable.

    Attributes:
        path: absolute path of the executable.
        version: first meaningful line of its ``--version`` output (``"13.0"`` style for nvcc).
        origin: how it was found (``"CXX"``, ``"PATH"``, ``"python ninja package"``, ``"CUDA_HOME"``).
    """

    path: str
    version: str
    origin: str


@functools.lru_cache(maxsize=64)
def _version_output(path: str, mtime_ns: int) -> str:
    del mtime_ns  # part of the memo key only: a replaced executable is probed again
    try:
        proc = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=_PROBE_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise OpBuildError(f"could not run {path} --version: {exc}") from exc
    if proc.returncode != 0:
        raise OpBuildError(f"{path} --version exited with {proc.returncode}: {proc.stderr.strip()[:300]}")
    return proc.stdout


def _run_version(path: str) -> str:
    return _version_output(path, os.stat(path).st_mtime_ns)


def _which(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    env = os.environ if environ is None else environ
    return shutil.which(name, path=env.get("PATH", os.defpath))


def find_cxx(environ: Mapping[str, str] | None = None) -> Tool:
    """Locate the C++ compiler torch's extension builder will use (``$CXX``, else ``c++`` on PATH).

    Raises:
        OpBuildError: ``CXX`` points at nothing executable, or no ``c++`` is on PATH. Raised before ninja
            is ever started, so a broken toolchain is reported as such instead of as a build failure.
    """
    env = os.environ if environ is None else environ
    requested = env.get("CXX")
    origin = "CXX" if requested else "PATH"
    name = requested or "c++"
    path = name if os.path.isabs(name) else _which(name, env)
    if not path or not os.path.isfile(path) or not os.access(path, os.X_OK):
        where = f"CXX={requested!r}" if requested else "'c++' on PATH"
        raise OpBuildError(
            f"no C++ compiler found ({where} is not an executable file). Install g++/clang++ or set CXX to "
            "the compiler's path; ops need it to JIT-build (prebuilt ops in the cache still load)."
        )
    first = _run_version(path).strip().splitlines()
    return Tool(path=os.path.realpath(path), version=first[0] if first else "unknown", origin=origin)


def find_ninja(environ: Mapping[str, str] | None = None) -> Tool:
    """Locate ninja: on PATH first, else the binary of the ``ninja`` Python package.

    Raises:
        OpBuildError: neither exists (``pip install ninja`` fixes it).
    """
    path = _which("ninja", environ)
    origin = "PATH"
    if path is None:
        try:
            import ninja  # the PyPI package ships the binary

            candidate = os.path.join(ninja.BIN_DIR, "ninja")
        except (ImportError, AttributeError):
            candidate = ""
        if candidate and os.access(candidate, os.X_OK):
            path, origin = candidate, "python ninja package"
    if path is None:
        raise OpBuildError("ninja is required to JIT-build ops but was not found on PATH; `pip install ninja`.")
    first = _run_version(path).strip().splitlines()
    return Tool(path=os.path.realpath(path), version=first[0] if first else "unknown", origin=origin)


def _is_cuda_home(path: Path) -> bool:
    return (path / "bin" / "nvcc").is_file() and (path / "include" / "cuda_runtime_api.h").is_file()


def find_cuda_home(environ: Mapping[str, str] | None = None) -> tuple[Path, str]:
    """Return ``(cuda_home, origin)``: ``$CUDA_HOME``, ``$CUDA_PATH``, the toolkit of the nvcc on PATH, or
    /usr/local/cuda.

    An explicitly set ``CUDA_HOME``/``CUDA_PATH`` is trusted (and checked by :func:`find_nvcc`) rather
    than silently replaced by another installation. An nvcc on PATH counts only when its directory's
    parent holds the CUDA headers (a wrapper script in /usr/local/bin does not make /usr/local a toolkit).

    Raises:
        OpBuildError: none of them exists.
    """
    env = os.environ if environ is None else environ
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if env.get(var):
            return Path(env[var]), var
    nvcc = _which("nvcc", env)
    if nvcc:
        home = Path(os.path.realpath(nvcc)).parent.parent
        if _is_cuda_home(home):
            return home, "nvcc on PATH"
    if _is_cuda_home(Path("/usr/local/cuda")):
        return Path("/usr/local/cuda"), "/usr/local/cuda"
    raise OpBuildError(
        "CUDA_HOME is not set and no CUDA toolkit was found (no nvcc with CUDA headers on PATH, no "
        "/usr/local/cuda): CUDA ops cannot be built. Install the CUDA toolkit and set CUDA_HOME."
    )


def find_nvcc(environ: Mapping[str, str] | None = None) -> Tool:
    """Locate ``$CUDA_HOME/bin/nvcc`` and read its release (``Tool.version`` is e.g. ``"13.0"``).

    Raises:
        OpBuildError: CUDA home missing, or it has no executable ``bin/nvcc``.
    """
    home, origin = find_cuda_home(environ)
    nvcc = home / "bin" / "nvcc"
    if not (nvcc.is_file() and os.access(nvcc, os.X_OK)):
        raise OpBuildError(f"{origin} points at {home}, which has no executable bin/nvcc; fix CUDA_HOME.")
    out = _run_version(str(nvcc))
    match = re.search(r"release (\d+)\.(\d+)", out)
    if not match:
        raise OpBuildError(f"cannot read the CUDA release from `{nvcc} --version`: {out.strip()[-200:]}")
    return Tool(path=str(nvcc), version=f"{match.group(1)}.{match.group(2)}", origin=origin)


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_simd_level(environ: Mapping[str, str] | None = None) -> str:
    """The best SIMD level of this CPU for the CPU ops: ``"avx512"``, ``"avx2"`` or ``"scalar"``.

    Detected at build time from ``/proc/cpuinfo`` (x86-64 Linux); anything else gets the portable
    scalar code (which the compiler may still auto-vectorise). ``DSCORE_CPU_SIMD`` forces a level
    (lower levels are always allowed; asking for more than the CPU has raises).

    Raises:
        OpBuildError: ``DSCORE_CPU_SIMD`` is not one of :data:`SIMD_LEVELS` or exceeds the CPU.
    """
    env = os.environ if environ is None else environ
    flags = _cpu_flags() if sys.platform.startswith("linux") else set()
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"} <= flags:
        detected = "avx512"
    elif {"avx2", "fma", "f16c"} <= flags:
        detected = "avx2"
    else:
        detected = "scalar"
    forced = env.get("DSCORE_CPU_SIMD", "").strip().lower()
    if not forced:
        return detected
    if forced not in SIMD_LEVELS:
        raise OpBuildError(f"DSCORE_CPU_SIMD={forced!r} is not valid; use one of {', '.join(SIMD_LEVELS)}")
    if SIMD_LEVELS.index(forced) > SIMD_LEVELS.index(detected):
        raise OpBuildError(f"DSCORE_CPU_SIMD={forced!r} but this CPU only supports {detected!r}")
    return forced


def simd_flags(level: str) -> list[str]:
    """Compiler flags (gcc/clang) selecting ``level``'s code path in ``csrc/includes/dscore_simd.h``."""
    if level == "avx512":
        return ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c", "-DDSCORE_SIMD_AVX512"]
    if level == "avx2":
        return ["-mavx2", "-mfma", "-mf16c", "-DDSCORE_SIMD_AVX2"]
    if level == "scalar":
        return ["-DDSCORE_SIMD_SCALAR"]
    raise OpBuildError(f"unknown SIMD level {level!r}; use one of {', '.join(SIMD_LEVELS)}")


_ARCH_RE = re.compile(r"^(\d+)\.(\d+)([a-z]?)(\+PTX)?$", re.IGNORECASE)


def parse_cuda_arch_list(value: str) -> list[tuple[str, bool]]:
    """Parse a ``TORCH_CUDA_ARCH_LIST`` value into ``[(capability, ptx), ...]``.

    Entries are separated by ``;``, spaces or commas; each is ``major.minor`` with an optional
    arch-specific suffix letter (``9.0a``) and an optional ``+PTX`` (also embed PTX for that arch).
    Example: ``"8.0;8.6 9.0+PTX"`` -> ``[("8.0", False), ("8.6", False), ("9.0", True)]``.
    Duplicates are dropped, order kept.

    Raises:
        OpBuildError: an entry is not of that form, or the list is empty.
    """
    out: list[tuple[str, bool]] = []
    for raw in re.split(r"[;\s,]+", value.strip()):
        if not raw:
            continue
        match = _ARCH_RE.match(raw)
        if not match:
            raise OpBuildError(
                f"TORCH_CUDA_ARCH_LIST entry {raw!r} is not valid; write e.g. '8.0;8.6;9.0+PTX' (';' or spaces)"
            )
        item = (f"{match.group(1)}.{match.group(2)}{match.group(3).lower()}", bool(match.group(4)))
        if item not in out:
            out.append(item)
    if not out:
        raise OpBuildError(f"TORCH_CUDA_ARCH_LIST={value!r} names no architecture")
    return out


def cuda_arch_gencode_flags(arch_list: list[tuple[str, bool]]) -> list[str]:
    """nvcc ``-gencode`` flags for ``arch_list`` (SASS for each, PTX too where ``ptx`` is true)."""
    flags: list[str] = []
    for cap, ptx in arch_list:
        num = cap.replace(".", "")
        flags.append(f"-gencode=arch=compute_{num},code=sm_{num}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{num},code=compute_{num}")
    return flags


def check_cuda_versions(nvcc_version: str, torch_cuda_version: str | None, environ: Mapping[str, str] | None = None) -> None:
    """Fail when nvcc's CUDA major version differs from the one torch was built with.

    Args:
        nvcc_version: ``"13.0"`` from :func:`find_nvcc`.
        torch_cuda_version: ``torch.version.cuda`` (``None`` for a CPU-only torch build).

    Raises:
        OpBuildError: torch has no CUDA, or the major versions differ and ``DS_SKIP_CUDA_CHECK=1`` is not
            set (with it set, the mismatch is logged as a warning instead).
    """
    env = os.environ if environ is None else environ
    if not torch_cuda_version:
        raise OpBuildError(
            "this torch build has no CUDA support (torch.version.cuda is None); CUDA ops need a CUDA build of torch"
        )
    from packaging.version import InvalidVersion, Version

    try:
        same_major = Version(nvcc_version).major == Version(torch_cuda_version).major
    except InvalidVersion as exc:
        raise OpBuildError(
            f"cannot compare CUDA versions nvcc {nvcc_version!r} and torch {torch_cuda_version!r}: {exc}"
        ) from exc
    if same_major:
        return
    message = (
        f"CUDA version mismatch: nvcc (CUDA_HOME) is CUDA {nvcc_version} but torch was built with CUDA "
        f"{torch_cuda_version}; extensions built this way may fail to load or crash."
    )
    if env.get("DS_SKIP_CUDA_CHECK", "0") == "1":
        logger.warning("%s Continuing because DS_SKIP_CUDA_CHECK=1.", message)
        return
    raise OpBuildError(f"{message} Install a matching toolkit or set DS_SKIP_CUDA_CHECK=1 to build anyway.")
