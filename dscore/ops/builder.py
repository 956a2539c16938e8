"""The declarative ``OpBuilder`` base: sources, flags, compatibility, a thrash-free JIT build cache.

An op builder subclass declares what to compile (``sources()``, ``include_dirs()``, ``cxx_flags()``,
``device_flags()``, ``ld_flags()``), when it can (``compatibility() -> (ok, reason)``) and its
``DS_BUILD_<OP>`` name. :meth:`OpBuilder.load` then

1. returns the module already loaded in this process, or imports ``prebuilt_module`` when installed;
2. checks compatibility and the toolchain (compiler, ninja, nvcc) *before* ninja runs, so a missing
   compiler or CUDA toolkit is a clear :class:`~dscore.errors.OpBuildError`;
3. picks a cache directory keyed by op, device type, torch and Python version and a hash of every
   flag plus the compiler, ninja and nvcc versions. Two environments with different toolchains on one
   machine therefore get different directories and never rebuild each other's builds (ninja discards
   a ``.ninja_log``/``.ninja_deps`` written by another ninja version, which is what made DeepSpeed's
   ``cpu_adam`` rebuild on every load when a venv's ninja and the system ninja alternated);
4. if a completed build with the same source digest is there, imports the ``.so`` directly (no ninja
   run, a few milliseconds);
5. otherwise takes a :mod:`filelock` lock on ``<dir>.lock`` (an ``flock``, released by the kernel when the
   holder dies, so a killed build never blocks forever; a live build by another rank is waited for up to
   a timeout),
   removes a stale torch ``lock`` baton left by a killed build with a warning, and builds through
   ``torch.utils.cpp_extension.load`` with ninja.

The cache root is ``$TORCH_EXTENSIONS_DIR/dscore`` (default ``~/.cache/torch_extensions/dscore``).
Environment variables touched for a build (``PATH`` for the ninja package, ``TORCH_CUDA_ARCH_LIST``)
are restored afterwards.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import json
import logging
import os
import re
import socket
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

from dscore.errors import OpBuildError
from dscore.ops import toolchain

__all__ = [
    "OpBuilder",
    "CPUOpBuilder",
    "CUDAOpBuilder",
    "BuildPlan",
    "cache_root",
    "build_lock",
    "DEFAULT_LOCK_TIMEOUT_S",
]

logger = logging.getLogger("dscore.ops")

#: Seconds a load waits for another process's build of the same op before giving up.
DEFAULT_LOCK_TIMEOUT_S = 900.0
_STAMP = "dscore_build.json"
_TORCH_BATON = "lock"  # torch.utils.file_baton.FileBaton's file inside the build directory


def cache_root(environ: Mapping[str, str] | None = None) -> Path:
    """Root of dscore's op cache: ``$TORCH_EXTENSIONS_DIR/dscore`` or ``~/.cache/torch_extensions/dscore``."""
    env = os.environ if environ is None else environ
    base = env.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions")
    return Path(base) / "dscore"


@contextlib.contextmanager
def _scoped_env(updates: Mapping[str, str | None]) -> Iterator[None]:
    """Set (or, for ``None``, unset) environment variables for the block and restore them after."""
    saved = {k: os.environ.get(k) for k in updates}
    try:
        for key, value in updates.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


@contextlib.contextmanager
def build_lock(lock_path: Path, *, timeout_s: float = DEFAULT_LOCK_TIMEOUT_S, poll_s: float = 0.2) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_path`` for the block (one builder per cache entry).

    The lock is :class:`filelock.FileLock` (an ``flock`` on POSIX): the kernel drops it when its holder
    dies, so a build killed with SIGKILL cannot leave a lock that blocks forever. The holder writes its
    pid and host into the file; a dead previous owner found there is logged as a warning (its build was
    interrupted). A live owner (another rank building the same op) is waited for, polling every
    ``poll_s`` seconds.

    Raises:
        OpBuildError: the lock was still held after ``timeout_s`` seconds (names the owner and the file),
            or the lock file cannot be created.
    """
    import filelock

    lock_path.parent.mkdir(parents=True, exist_ok=True)
    lock = filelock.FileLock(str(lock_path), mode=0o666)
    try:
        try:
            lock.acquire(timeout=0)
        except filelock.Timeout:
            logger.info("waiting for another process building into %s (%s)", lock_path.parent, _owner(lock_path))
            try:
                lock.acquire(timeout=timeout_s, poll_interval=poll_s)
            except filelock.Timeout:
                raise OpBuildError(
                    f"timed out after {timeout_s:.0f} s waiting for the build lock {lock_path} held by "
                    f"{_owner(lock_path)}; if that build is stuck, stop it (or raise DSCORE_OPS_LOCK_TIMEOUT)"
                ) from None
    except OSError as exc:
        raise OpBuildError(f"cannot lock {lock_path}: {exc}") from exc
    try:
        previous = _read_owner(lock_path)
        if previous and previous.get("host") == socket.gethostname() and not _pid_alive(int(previous.get("pid", 0))):
            logger.warning(
                "removed a stale build lock %s left by process %s (no longer running, build was interrupted)",
                lock_path,
                previous.get("pid"),
            )
        lock_path.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "time": time.time()}))
        try:
            yield
        finally:
            lock_path.write_text("")  # no owner while nobody holds it
    finally:
        lock.release()


def _read_owner(lock_path: Path) -> dict[str, Any]:
    try:
        raw = lock_path.read_text()
        data = json.loads(raw) if raw.strip() else {}
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _owner(lock_path: Path) -> str:
    data = _read_owner(lock_path)
    return f"pid {data.get('pid', '?')} on {data.get('host', '?')}" if data else "an unknown process"


@dataclass
class BuildPlan:
    """Everything that determines one build, and where it lives in the cache.

    Attributes:
        name: op name.
        module_name: Python module name of the built extension (unique per key).
        directory: cache directory for this key.
        key_fields: the inputs hashed into the key (flags, toolchain versions, ...).
        env: environment variables set for the build (restored afterwards).
    """

    name: str
    module_name: str
    directory: Path
    key_fields: dict[str, Any]
    sources: list[Path]
    include_dirs: list[Path]
    cxx_flags: list[str]
    device_flags: list[str]
    ld_flags: list[str]
    with_cuda: bool
    env: dict[str, str | None] = field(default_factory=dict)

    @property
    def lock_path(self) -> Path:
        return self.directory.with_name(self.directory.name + ".lock")


class OpBuilder:
    """Base of every op builder (declarative; nothing is probed or compiled until :meth:`load`).

    Subclasses set ``NAME``, ``BUILD_VAR`` and ``DEVICE_TYPE`` and implement :meth:`sources`; they may
    override the flag methods and :meth:`compatibility`. Source and include paths are absolute.

    Class attributes:
        NAME: op name (``"cpu_adam"``).
        BUILD_VAR: the ``DS_BUILD_<OP>`` variable that selects it for an ahead-of-time build.
        DEVICE_TYPE: the torch device type the op runs on (``"cpu"``, ``"cuda"``).
        PREBUILT_MODULE: import name of a module shipped prebuilt in a wheel, or ``None``.
    """

    NAME: ClassVar[str] = ""
    BUILD_VAR: ClassVar[str] = ""
    DEVICE_TYPE: ClassVar[str] = "cpu"
    PREBUILT_MODULE: ClassVar[str | None] = None

    _loaded: ClassVar[dict[str, ModuleType]] = {}

    def __init__(self, *, lock_timeout_s: float | None = None, verbose: bool = False) -> None:
        if not self.NAME or not self.BUILD_VAR:
            raise OpBuildError(f"{type(self).__name__} must set NAME and BUILD_VAR")
        env_timeout = os.environ.get("DSCORE_OPS_LOCK_TIMEOUT")
        self.lock_timeout_s = float(lock_timeout_s if lock_timeout_s is not None else env_timeout or DEFAULT_LOCK_TIMEOUT_S)
        self.verbose = verbose

    # ------------------------------------------------------------------ declarations
    def sources(self) -> list[Path]:
        """Absolute paths of the C++/CUDA files compiled into the op."""
        raise NotImplementedError(f"{type(self).__name__}.sources() is not implemented")

    def include_dirs(self) -> list[Path]:
        """Extra include directories (absolute)."""
        return []

    def cxx_flags(self) -> list[str]:
        """Flags for the host C++ compiler."""
        return ["-O3", "-UC10_USE_GLOG"]  # the C++ standard is torch's (it passes -std=c++17/20 itself)

    def device_flags(self) -> list[str]:
        """Flags for the device compiler (nvcc); unused by CPU ops."""
        return []

    def ld_flags(self) -> list[str]:
        """Extra linker flags."""
        return []

    def compatibility(self) -> tuple[bool, str]:
        """``(ok, reason)``: whether the op can be built and run here, and why (never raises)."""
        return True, "ok"

    def depends(self) -> list[Path]:
        """Files whose content is part of the source digest besides :meth:`sources` (headers)."""
        files: list[Path] = []
        for inc in self.include_dirs():
            if inc.is_dir():
                files.extend(sorted(p for p in inc.iterdir() if p.suffix in {".h", ".hpp", ".cuh"}))
        return files

    # ------------------------------------------------------------------ toolchain / keys
    def toolchain_fields(self) -> dict[str, Any]:
        """Toolchain identity hashed into the cache key. CPU: compiler and ninja.

        Raises:
            OpBuildError: the compiler or ninja is missing.
        """
        cxx = toolchain.find_cxx()
        ninja = toolchain.find_ninja()
        return {"cxx": [cxx.path, cxx.version], "ninja": ninja.version, "_ninja_dir": os.path.dirname(ninja.path)}

    def plan(self) -> BuildPlan:
        """Resolve flags, toolchain and cache location (probes the toolchain; compiles nothing).

        Raises:
            OpBuildError: the toolchain is missing or misconfigured.
        """
        import torch

        tool = self.toolchain_fields()
        ninja_dir = tool.pop("_ninja_dir", "")
        env: dict[str, str | None] = dict(tool.pop("_env", {}))
        if ninja_dir and toolchain._which("ninja") is None:
            env["PATH"] = ninja_dir + os.pathsep + os.environ.get("PATH", "")
        sources = [Path(s) for s in self.sources()]
        includes = [Path(p) for p in self.include_dirs()]
        fields: dict[str, Any] = {
            "op": self.NAME,
            "device": self.DEVICE_TYPE,
            "torch": torch.__version__,
            "python": f"cp{sys.version_info[0]}{sys.version_info[1]}",
            "cxx_flags": self.cxx_flags(),
            "device_flags": self.device_flags(),
            "ld_flags": self.ld_flags(),
            "includes": [str(p) for p in includes],
            "sources": [str(p) for p in sources],
            **tool,
        }
        digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
        torch_tag = re.sub(r"[^0-9A-Za-z.]+", "_", torch.__version__)
        dirname = f"{self.NAME}-{self.DEVICE_TYPE}-torch{torch_tag}-{fields['python']}-{digest}"
        return BuildPlan(
            name=self.NAME,
            module_name=f"dscore_{self.NAME}_{digest[:10]}",
            directory=cache_root() / dirname,
            key_fields=fields,
            sources=sources,
            include_dirs=includes,
            cxx_flags=list(fields["cxx_flags"]),
            device_flags=list(fields["device_flags"]),
            ld_flags=list(fields["ld_flags"]),
            with_cuda=self.DEVICE_TYPE == "cuda",
            env=env,
        )

    def source_digest(self) -> str:
        """SHA-256 of the sources' and headers' contents (a change rebuilds; an unchanged tree never does)."""
        h = hashlib.sha256()
        for path in [*self.sources(), *self.depends()]:
            h.update(str(path.name).encode())
            try:
                h.update(Path(path).read_bytes())
            except OSError as exc:
                raise OpBuildError(f"op {self.NAME}: source file {path} cannot be read: {exc}") from exc
        return h.hexdigest()

    def cached_build(self, plan: BuildPlan | None = None) -> Path | None:
        """Path of a completed build of the current sources in the cache, else ``None`` (builds nothing).

        Raises:
            OpBuildError: the toolchain cannot be probed (when ``plan`` is not given).
        """
        plan = plan or self.plan()
        stamp = plan.directory / _STAMP
        try:
            data = json.loads(stamp.read_text())
        except (OSError, ValueError):
            return None
        library = plan.directory / str(data.get("library", ""))
        if data.get("source_digest") != self.source_digest() or not library.is_file():
            return None
        return library

    # ------------------------------------------------------------------ load / build
    def load(self, *, verbose: bool | None = None) -> ModuleType:
        """Return the compiled op module, building it into the cache on first use.

        Returns:
            The extension module (its functions are documented by each op's binding).

        Raises:
            OpBuildError: the op is incompatible here (with the reason), the toolchain is missing, another
                process's build did not finish within the lock timeout, or compilation failed.
        """
        verbose = self.verbose if verbose is None else verbose
        if self.PREBUILT_MODULE:
            try:
                module = importlib.import_module(self.PREBUILT_MODULE)
                logger.debug("op %s: using prebuilt module %s", self.NAME, self.PREBUILT_MODULE)
                return module
            except ImportError:
                pass
        ok, reason = self.compatibility()
        if not ok:
            raise OpBuildError(f"op {self.NAME!r} cannot be built here: {reason}")
        plan = self.plan()
        if plan.module_name in self._loaded:
            return self._loaded[plan.module_name]
        library = self.cached_build(plan)
        if library is None:
            with build_lock(plan.lock_path, timeout_s=self.lock_timeout_s):
                library = self.cached_build(plan)  # another rank may have finished it while we waited
                if library is None:
                    library = self._build(plan, verbose=verbose)
        module = _import_extension(plan.module_name, library)
        self._loaded[plan.module_name] = module
        return module

    def _build(self, plan: BuildPlan, *, verbose: bool) -> Path:
        import torch.utils.cpp_extension as cpp_extension

        plan.directory.mkdir(parents=True, exist_ok=True)
        baton = plan.directory / _TORCH_BATON
        if baton.exists():  # we hold the flock, so no live build of this key owns it
            if hasattr(cpp_extension, "FileBaton"):  # torch <= 2.13: the file's existence blocks forever
                logger.warning("removed a stale torch build lock %s left by an interrupted build", baton)
            baton.unlink()  # newer torch holds an flock on it and leaves the file behind: nothing to report
        (plan.directory / _STAMP).unlink(missing_ok=True)
        digest = self.source_digest()
        start = time.perf_counter()
        # WARNING, not INFO: the build is a silent pause of 10-60 s otherwise, and applications often log
        # only warnings (DeepSpeed prints this unconditionally)
        logger.warning(
            "building op %s (first use: compiling %s with ninja, usually 10-60 s) into %s ...",
            self.NAME, "C++/CUDA" if plan.with_cuda else "C++", plan.directory,
        )
        try:
            with (
                _scoped_env(plan.env),
                _scoped_torch_cuda_home(cpp_extension, plan.env.get("CUDA_HOME")),
                _build_progress(self.NAME, quiet=verbose),
            ):
                cpp_extension.load(
                    name=plan.module_name,
                    sources=[str(s) for s in plan.sources],
                    extra_cflags=plan.cxx_flags,
                    extra_cuda_cflags=plan.device_flags or None,
                    extra_ldflags=plan.ld_flags,
                    extra_include_paths=[str(p) for p in plan.include_dirs],
                    build_directory=str(plan.directory),
                    verbose=verbose,
                    with_cuda=plan.with_cuda,
                    is_python_module=True,
                )
        except Exception as exc:  # torch raises RuntimeError/CalledProcessError/OSError with the log
            raise OpBuildError(f"building op {self.NAME!r} in {plan.directory} failed: {exc}") from exc
        library = plan.directory / f"{plan.module_name}.so"
        if not library.is_file():
            found = sorted(plan.directory.glob(f"{plan.module_name}*.so"))
            if not found:
                raise OpBuildError(f"building op {self.NAME!r} produced no library in {plan.directory}")
            library = found[-1]
        stamp = {"source_digest": digest, "library": library.name, "key": plan.key_fields, "built": time.time()}
        tmp = plan.directory / (_STAMP + ".tmp")
        tmp.write_text(json.dumps(stamp, indent=1, default=str))
        os.replace(tmp, plan.directory / _STAMP)
        logger.warning("built op %s in %.1f s (cached: later runs load it at once)", self.NAME, time.perf_counter() - start)
        return library


@contextlib.contextmanager
def _build_progress(name: str, *, quiet: bool) -> Iterator[None]:
    """A live elapsed-time line (tqdm, on stderr) while ninja compiles ``name``, when stderr is a terminal.

    Nothing is shown in logs and pipes, nor with ``verbose`` (ninja's own output is shown then).
    """
    if quiet or not sys.stderr.isatty():
        yield
        return
    import threading

    from tqdm import tqdm

    bar = tqdm(total=None, desc=f"building op {name}", bar_format="{desc}: {elapsed} elapsed", leave=False)
    done = threading.Event()

    def tick() -> None:
        while not done.wait(0.5):
            bar.refresh()

    ticker = threading.Thread(target=tick, name=f"dscore-op-build-{name}", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
        bar.close()


@contextlib.contextmanager
def _scoped_torch_cuda_home(cpp_extension: Any, cuda_home: str | None) -> Iterator[None]:
    """Point torch's builder at the toolkit dscore checked (torch reads ``CUDA_HOME`` once, at import,
    and may have taken a wrapper script's directory); restored afterwards."""
    if not cuda_home:
        yield
        return
    saved = cpp_extension.CUDA_HOME
    cpp_extension.CUDA_HOME = cuda_home
    try:
        yield
    finally:
        cpp_extension.CUDA_HOME = saved


def _import_extension(module_name: str, library: Path) -> ModuleType:
    import torch  # noqa: F401  (the extension needs libtorch's symbols loaded first)

    if module_name in sys.modules:
        return sys.modules[module_name]
    loader = importlib.machinery.ExtensionFileLoader(module_name, str(library))
    spec = importlib.util.spec_from_file_location(module_name, str(library), loader=loader)
    if spec is None:
        raise OpBuildError(f"cannot import the op library {library}")
    module = importlib.util.module_from_spec(spec)
    try:
        loader.exec_module(module)
    except ImportError as exc:
        raise OpBuildError(f"the op library {library} cannot be imported: {exc}; remove the directory to rebuild") from exc
    sys.modules[module_name] = module
    return module


class CPUOpBuilder(OpBuilder):
    """A C++ op for the CPU: OpenMP, and the best SIMD level of the build machine's CPU.

    The SIMD level (``avx512``/``avx2``/``scalar``, see :func:`dscore.ops.toolchain.cpu_simd_level`)
    becomes part of the flags and therefore of the cache key.
    """

    DEVICE_TYPE: ClassVar[str] = "cpu"

    def simd_level(self) -> str:
        """The SIMD level this build targets (``DSCORE_CPU_SIMD`` may force a lower one)."""
        return toolchain.cpu_simd_level()

    def cxx_flags(self) -> list[str]:
        # -ffp-contract=off: no silent a*b+c -> fma contraction, so results follow the written op order
        return [*super().cxx_flags(), "-fopenmp", "-ffp-contract=off", *toolchain.simd_flags(self.simd_level())]

    def ld_flags(self) -> list[str]:
        return ["-fopenmp"]

    def compatibility(self) -> tuple[bool, str]:
        if not sys.platform.startswith("linux"):
            return False, f"CPU ops are built with gcc/clang + OpenMP on Linux; this is {sys.platform}"
        try:
            level = self.simd_level()
        except OpBuildError as exc:
            return False, str(exc)
        return True, f"ok (SIMD: {level})"


class CUDAOpBuilder(OpBuilder):
    """A CUDA op compiled with nvcc for the architectures of ``TORCH_CUDA_ARCH_LIST``.

    ``kernel_sources()`` are the torch-free ``.cu`` files (raw pointers + sizes) that ``nvcc -c`` can
    compile with only the CUDA headers and ``include_dirs()``; ``sources()`` adds the thin torch
    binding. The arch list comes from ``TORCH_CUDA_ARCH_LIST`` (``;``/space separated, ``+PTX``
    allowed), else from the visible devices' compute capabilities.
    """

    DEVICE_TYPE: ClassVar[str] = "cuda"

    def kernel_sources(self) -> list[Path]:
        """The torch-free ``.cu`` files."""
        return [p for p in self.sources() if p.suffix == ".cu"]

    def device_flags(self) -> list[str]:
        # no --use_fast_math and no FMA contraction: results follow the written op order, like torch's
        return ["-O3", "-std=c++17", "-lineinfo", "--fmad=false"]

    def arch_list(self, environ: Mapping[str, str] | None = None) -> list[tuple[str, bool]]:
        """``[(capability, ptx), ...]`` to compile for.

        Raises:
            OpBuildError: ``TORCH_CUDA_ARCH_LIST`` is malformed, or it is unset and no CUDA device is visible.
        """
        env = os.environ if environ is None else environ
        value = env.get("TORCH_CUDA_ARCH_LIST", "").strip()
        if value:
            return toolchain.parse_cuda_arch_list(value)
        import torch

        if not torch.cuda.is_available():
            raise OpBuildError(
                "TORCH_CUDA_ARCH_LIST is unset and no CUDA device is visible to read capabilities from; "
                "set TORCH_CUDA_ARCH_LIST, e.g. '8.0;9.0+PTX'"
            )
        caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
        arch = [(f"{major}.{minor}", False) for major, minor in caps]
        arch[-1] = (arch[-1][0], True)  # PTX of the newest for forward compatibility
        return arch

    def compatibility(self) -> tuple[bool, str]:
        try:
            import torch

            nvcc = toolchain.find_nvcc()
            toolchain.check_cuda_versions(nvcc.version, torch.version.cuda)
        except OpBuildError as exc:
            return False, str(exc)
        except Exception as exc:  # a broken torch install must not crash a report
            return False, f"{type(exc).__name__}: {exc}"
        return True, f"ok (nvcc {nvcc.version}, torch CUDA {torch.version.cuda})"

    def toolchain_fields(self) -> dict[str, Any]:
        import torch

        fields = super().toolchain_fields()
        nvcc = toolchain.find_nvcc()
        toolchain.check_cuda_versions(nvcc.version, torch.version.cuda)
        arch = self.arch_list()
        arch_value = ";".join(cap + ("+PTX" if ptx else "") for cap, ptx in arch)
        fields.update(
            nvcc=[nvcc.path, nvcc.version],
            torch_cuda=torch.version.cuda,
            arch=arch_value,
            _env={"TORCH_CUDA_ARCH_LIST": arch_value, "CUDA_HOME": str(Path(nvcc.path).parent.parent)},
        )
        return fields

    def object_compile_command(
        self, source: Path, output: Path, arch_list: list[tuple[str, bool]] | None = None
    ) -> list[str]:
        """The ``nvcc -c`` command compiling one torch-free kernel file to ``output`` (an object file).

        Raises:
            OpBuildError: nvcc is missing or the arch list is malformed/unavailable.
        """
        nvcc = toolchain.find_nvcc()
        arch = arch_list if arch_list is not None else self.arch_list()
        cmd = [nvcc.path, "-c", str(source), "-o", str(output), "-Xcompiler", "-fPIC"]
        cmd += [f"-I{p}" for p in self.include_dirs()]
        cmd += self.device_flags() + toolchain.cuda_arch_gencode_flags(arch)
        return cmd
