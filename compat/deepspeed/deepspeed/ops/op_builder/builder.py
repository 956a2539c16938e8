"""``deepspeed.ops.op_builder.builder.OpBuilder``: DeepSpeed 0.19.8's op-builder interface over dscore's
op-builder registry (:func:`dscore.ops.op_builder_class`).

A builder class here names a DeepSpeed op (``NAME``, ``BUILD_VAR``). When dscore registers an op builder of
that name, every question is answered by dscore's builder, looked up when asked (the current runtime's
registry, so ``plugins.disable`` holds): ``is_compatible()`` is its ``compatibility()``, ``load()`` /
``jit_load()`` build and import it through dscore's build cache, ``sources()`` / ``include_paths()`` /
``cxx_args()`` / ``nvcc_args()`` / ``extra_ldflags()`` are its declarations. When dscore has no such op,
``is_compatible()`` is False (the op cannot be loaded here, with the reason logged when ``verbose``) and
``load()`` raises dscore's not-provided error.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from deepspeed._not_provided import NotProvidedError
from dscore.errors import DscoreError

__all__ = ["OpBuilder"]

logger = logging.getLogger("deepspeed.ops.op_builder")


class OpBuilder:
    """DeepSpeed's op builder for the op ``NAME``, answered by dscore's builder of that name.

    Class attributes:
        NAME: DeepSpeed's op name (``"cpu_adam"``), also dscore's registry name.
        BUILD_VAR: the ``DS_BUILD_<OP>`` variable.
    """

    NAME: ClassVar[str] = ""
    BUILD_VAR: ClassVar[str] = ""
    _loaded_ops: ClassVar[dict[str, Any]] = {}

    def __init__(self, name: str | None = None) -> None:
        self.name = self.NAME if name is None else name
        self.error_log: str | None = None

    # ---------------------------------------------------------------- dscore's builder
    def dscore_builder(self) -> Any:
        """A new instance of dscore's op builder registered as :attr:`name`.

        Raises:
            NotProvidedError: dscore registers no op builder of that name (or its provider is disabled).
        """
        from dscore.ops import get_op_builder

        try:
            return get_op_builder(self.name)
        except DscoreError as exc:
            raise NotProvidedError(
                f"deepspeed.ops.op_builder.{type(self).__name__} (op {self.name!r}, DeepSpeed 0.19.8) is not "
                f"provided by dscore: {exc}"
            ) from exc

    # ---------------------------------------------------------------- DeepSpeed's interface
    def absolute_name(self) -> str:
        """Import name of the op's module (``deepspeed.ops.<name>_op``; dscore imports it from its cache)."""
        return f"deepspeed.ops.{self.name}_op"

    def is_compatible(self, verbose: bool = False) -> bool:
        """Whether the op can be built and run here (dscore's ``compatibility()``); never raises."""
        try:
            ok, reason = self.dscore_builder().compatibility()
        except DscoreError as exc:
            ok, reason = False, str(exc)
        if not ok:
            self.error_log = reason
            if verbose:
                logger.warning("%s is not compatible here: %s", self.name, reason)
        return bool(ok)

    def load(self, verbose: bool = True) -> Any:
        """The op's compiled module, built into dscore's cache on first use.

        Raises:
            NotProvidedError: dscore has no op of this name.
            OpBuildError: the op is incompatible here, the toolchain is missing or the build failed.
        """
        if self.name in self._loaded_ops:
            return self._loaded_ops[self.name]
        module = self.dscore_builder().load(verbose=verbose)
        self._loaded_ops[self.name] = module
        return module

    jit_load = load

    def sources(self) -> list[str]:
        """The op's source files (absolute paths)."""
        return [str(p) for p in self.dscore_builder().sources()]

    def include_paths(self) -> list[str]:
        """The op's include directories (absolute paths)."""
        return [str(p) for p in self.dscore_builder().include_dirs()]

    def cxx_args(self) -> list[str]:
        """Host compiler flags."""
        return list(self.dscore_builder().cxx_flags())

    def nvcc_args(self) -> list[str]:
        """Device compiler flags (empty for CPU ops)."""
        return list(self.dscore_builder().device_flags())

    def extra_ldflags(self) -> list[str]:
        """Linker flags."""
        return list(self.dscore_builder().ld_flags())

    @staticmethod
    def is_rocm_pytorch() -> bool:
        """True when torch is a ROCm build."""
        import torch

        return getattr(torch.version, "hip", None) is not None

    @staticmethod
    def installed_rocm_version() -> tuple[int, int]:
        """``(major, minor)`` of torch's ROCm build, ``(0, 0)`` for a non-ROCm torch."""
        import torch

        hip = getattr(torch.version, "hip", None)
        if not hip:
            return (0, 0)
        major, minor = (hip.split(".") + ["0"])[:2]
        return (int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0))


class CUDAOpBuilder(OpBuilder):
    """DeepSpeed's base of CUDA ops (same interface)."""


class TorchCPUOpBuilder(CUDAOpBuilder):
    """DeepSpeed's base of CPU ops built with torch (same interface)."""
